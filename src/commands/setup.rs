//! `jetworker setup`: create or update the streams and KV buckets of
//! DESIGN.md section 2 with explicit options, for operators who do not want
//! workers to create them with the defaults (or who need replicas, memory
//! storage or other retention). Existing streams are updated to the given
//! options; running it twice is harmless.

use clap::{Args, ValueEnum};

use super::common::Conn;
use super::Exit;
use crate::protocol::parse_duration;
use crate::setup::{ensure_all, SetupOptions};
use async_nats::jetstream::stream::StorageType;

/// Where JetStream keeps the messages.
#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum Storage {
    File,
    Memory,
}

#[derive(Debug, Clone, Args)]
pub struct SetupArgs {
    /// Replicas of every stream and bucket (clustered servers: 1, 3 or 5);
    /// default: 1 on a single server, min(3, cluster size) on a cluster.
    #[arg(long)]
    pub replicas: Option<usize>,
    /// Storage of every stream and bucket.
    #[arg(long, value_enum, default_value = "file")]
    pub storage: Storage,
    /// How long results are kept.
    #[arg(long, default_value = "7d", value_name = "DURATION")]
    pub results_max_age: String,
    /// How long dead letters are kept (0: until purged).
    #[arg(long, default_value = "0s", value_name = "DURATION")]
    pub dead_max_age: String,
    /// A worker without a heartbeat this long is offline (the workers
    /// bucket's max age); keep it equal to the workers' --offline-after.
    #[arg(long, default_value = "30s", value_name = "DURATION")]
    pub offline_after: String,
    /// How long cancellation requests are kept.
    #[arg(long, default_value = "24h", value_name = "DURATION")]
    pub cancel_max_age: String,
}

fn duration(flag: &str, v: &str) -> anyhow::Result<std::time::Duration> {
    parse_duration(v).map_err(|e| anyhow::anyhow!("--{flag}: {e}"))
}

pub async fn run(ctx: &super::Ctx, args: SetupArgs) -> anyhow::Result<Exit> {
    if args.replicas.is_some_and(|r| !(1..=5).contains(&r)) {
        anyhow::bail!("--replicas: must be 1 to 5");
    }
    let offline_after = duration("offline-after", &args.offline_after)?;
    if offline_after < std::time::Duration::from_secs(1) {
        anyhow::bail!("--offline-after: must be at least 1s");
    }
    let o = SetupOptions {
        replicas: args.replicas,
        storage: match args.storage {
            Storage::File => StorageType::File,
            Storage::Memory => StorageType::Memory,
        },
        results_max_age: duration("results-max-age", &args.results_max_age)?,
        dead_max_age: duration("dead-max-age", &args.dead_max_age)?,
        offline_after,
        cancel_max_age: duration("cancel-max-age", &args.cancel_max_age)?,
        update_existing: true,
    };
    let conn = Conn::open(ctx).await?;
    crate::connect::check_server(&conn.client)?;
    let mut infra = ensure_all(&conn.js, &conn.names, &o).await?;
    let n = &conn.names;
    let tasks = infra.tasks.info().await?.clone();
    let schedules = if tasks.config.allow_message_schedules {
        "message schedules on"
    } else {
        "no message schedules (server older than 2.12)"
    };
    super::output::line(&format!(
        "stream {}: subjects {}, work queue, {}",
        n.tasks_stream,
        tasks.config.subjects.join(" "),
        schedules
    ))?;
    super::output::line(&format!(
        "stream {}: subjects {}.>, max age {}",
        n.results_stream,
        n.results_prefix,
        humantime::format_duration(o.results_max_age)
    ))?;
    let dead_age = if o.dead_max_age.is_zero() {
        "kept until purged".to_string()
    } else {
        format!("max age {}", humantime::format_duration(o.dead_max_age))
    };
    super::output::line(&format!(
        "stream {}: subjects {}.>, {dead_age}",
        n.dead_stream, n.dead_prefix
    ))?;
    super::output::line(&format!(
        "bucket {}: offline after {}",
        n.workers_bucket,
        humantime::format_duration(o.offline_after)
    ))?;
    super::output::line(&format!(
        "bucket {}: max age {}",
        n.cancel_bucket,
        humantime::format_duration(o.cancel_max_age)
    ))?;
    Ok(Exit::Ok)
}
