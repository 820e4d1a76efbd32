//! `jetworker setup`: create or update the streams and KV buckets of
//! DESIGN.md section 2 with explicit options, for operators who do not want
//! workers to create them with the defaults (or who need replicas, memory
//! storage or other retention). Running it twice is harmless.
//!
//! Before changing anything it compares each existing stream and bucket
//! with the options and prints what would change. Lowering replicas or
//! shortening retention (results, dead letters, cancellations, joins) loses data
//! or redundancy, so it is refused (exit 2, nothing changed) unless
//! `--force`; `--dry-run` only shows the changes.
//!
//! `--json`: one line per stream or bucket, `{"kind","name","action",
//! "changes":[{"field","from","to","lowers"}]}`, `action` one of `created`,
//! `updated`, `unchanged` (`would create`/`would update` with `--dry-run`
//! or when refused).

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use async_nats::jetstream::stream::StorageType;
use clap::{Args, ValueEnum};
use serde::Serialize;

use super::common::Conn;
use super::output;
use super::Exit;
use crate::protocol::{parse_duration, Names};
use crate::setup::{ensure_all, SetupOptions};

/// Where JetStream keeps the messages.
#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum Storage {
    File,
    Memory,
}

/// A duration flag that shows its default like `7days` in `--help`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Dur(pub Duration);

impl fmt::Display for Dur {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", humantime::format_duration(self.0))
    }
}

impl FromStr for Dur {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        parse_duration(s).map(Dur)
    }
}

fn defaults() -> SetupOptions {
    SetupOptions::default()
}

#[derive(Debug, Clone, Args)]
#[command(after_help = "\
Examples:
  jetworker setup --dry-run                         # what would change
  jetworker setup --replicas 3 --results-max-age 30d
  jetworker setup --replicas 1 --force              # lower replicas on purpose")]
pub struct SetupArgs {
    /// Replicas of every stream and bucket (clustered servers: 1, 3 or 5);
    /// default: 1 on a single server, min(3, cluster size) on a cluster.
    #[arg(long)]
    pub replicas: Option<usize>,
    /// Storage of every stream and bucket.
    #[arg(long, value_enum, default_value = "file")]
    pub storage: Storage,
    /// How long results are kept.
    #[arg(long, value_name = "DURATION", default_value_t = Dur(defaults().results_max_age))]
    pub results_max_age: Dur,
    /// How long dead letters are kept (0s: until purged).
    #[arg(long, value_name = "DURATION", default_value_t = Dur(defaults().dead_max_age))]
    pub dead_max_age: Dur,
    /// A worker without a heartbeat this long is offline (the workers
    /// bucket's max age); keep it equal to the workers' --offline-after.
    #[arg(long, value_name = "DURATION", default_value_t = Dur(defaults().offline_after))]
    pub offline_after: Dur,
    /// How long cancellation requests are kept.
    #[arg(long, value_name = "DURATION", default_value_t = Dur(defaults().cancel_max_age))]
    pub cancel_max_age: Dur,
    /// Apply changes that lower replicas or shorten retention.
    #[arg(long)]
    pub force: bool,
    /// Show what would change; change nothing.
    #[arg(long)]
    pub dry_run: bool,
    /// Print JSON lines instead of text.
    #[arg(long)]
    pub json: bool,
}

/// One field that differs.
#[derive(Debug, Serialize)]
struct Change {
    field: &'static str,
    from: String,
    to: String,
    /// Lowers replicas or shortens retention.
    lowers: bool,
}

/// One stream or bucket and what setup does to it.
#[derive(Debug, Serialize)]
struct Plan {
    kind: &'static str,
    name: String,
    action: String,
    changes: Vec<Change>,
}

/// What each resource should look like: name, kind, stream name,
/// replicas, max age, whether a shorter max age loses data.
fn wanted(names: &Names, o: &SetupOptions) -> Vec<(&'static str, String, String, Duration, bool)> {
    vec![
        (
            "stream",
            names.tasks_stream.clone(),
            names.tasks_stream.clone(),
            Duration::ZERO,
            true,
        ),
        (
            "stream",
            names.results_stream.clone(),
            names.results_stream.clone(),
            o.results_max_age,
            true,
        ),
        (
            "stream",
            names.dead_stream.clone(),
            names.dead_stream.clone(),
            o.dead_max_age,
            true,
        ),
        // The heartbeat TTL is not retention: changing it loses nothing.
        (
            "bucket",
            names.workers_bucket.clone(),
            format!("KV_{}", names.workers_bucket),
            o.offline_after,
            false,
        ),
        (
            "bucket",
            names.cancel_bucket.clone(),
            format!("KV_{}", names.cancel_bucket),
            o.cancel_max_age,
            true,
        ),
        (
            "bucket",
            names.joins_bucket.clone(),
            format!("KV_{}", names.joins_bucket),
            o.results_max_age,
            true,
        ),
    ]
}

fn age_text(d: Duration) -> String {
    if d.is_zero() {
        "unlimited".into()
    } else {
        humantime::format_duration(d).to_string()
    }
}

/// What changes between an existing stream's config and the options;
/// `max_age: None` leaves the age alone (the task stream has none).
/// `retention`: a shorter max age loses data.
fn diff(
    cfg: &async_nats::jetstream::stream::Config,
    o: &SetupOptions,
    max_age: Option<Duration>,
    retention: bool,
) -> Vec<Change> {
    let mut changes = Vec::new();
    let replicas = o.num_replicas();
    if cfg.num_replicas != replicas {
        changes.push(Change {
            field: "replicas",
            from: cfg.num_replicas.to_string(),
            to: replicas.to_string(),
            lowers: replicas < cfg.num_replicas,
        });
    }
    if let Some(max_age) = max_age.filter(|a| *a != cfg.max_age) {
        // Zero is "kept for ever": any limit shortens it.
        let shorter = !max_age.is_zero() && (cfg.max_age.is_zero() || max_age < cfg.max_age);
        changes.push(Change {
            field: "max_age",
            from: age_text(cfg.max_age),
            to: age_text(max_age),
            lowers: retention && shorter,
        });
    }
    if cfg.storage != o.storage {
        changes.push(Change {
            field: "storage",
            from: format!("{:?}", cfg.storage).to_lowercase(),
            to: format!("{:?}", o.storage).to_lowercase(),
            lowers: false,
        });
    }
    changes
}

/// Compare the existing streams with the options.
async fn plan(conn: &Conn, o: &SetupOptions) -> anyhow::Result<Vec<Plan>> {
    let mut out = Vec::new();
    for (kind, name, stream, max_age, retention) in wanted(&conn.names, o) {
        let Ok(mut s) = conn.js.get_stream(&stream).await else {
            out.push(Plan {
                kind,
                name,
                action: "create".into(),
                changes: Vec::new(),
            });
            continue;
        };
        let cfg = s.info().await?.config.clone();
        let is_tasks = kind == "stream" && stream == conn.names.tasks_stream;
        let max_age = (!is_tasks).then_some(max_age);
        let changes = diff(&cfg, o, max_age, retention);
        let action = if changes.is_empty() {
            "unchanged"
        } else {
            "update"
        };
        out.push(Plan {
            kind,
            name,
            action: action.into(),
            changes,
        });
    }
    Ok(out)
}

pub async fn run(ctx: &super::Ctx, args: SetupArgs) -> anyhow::Result<Exit> {
    if args.replicas.is_some_and(|r| !(1..=5).contains(&r)) {
        anyhow::bail!("--replicas: must be 1 to 5");
    }
    if args.offline_after.0 < Duration::from_secs(1) {
        anyhow::bail!("--offline-after: must be at least 1s");
    }
    let o = SetupOptions {
        replicas: args.replicas,
        storage: match args.storage {
            Storage::File => StorageType::File,
            Storage::Memory => StorageType::Memory,
        },
        results_max_age: args.results_max_age.0,
        dead_max_age: args.dead_max_age.0,
        offline_after: args.offline_after.0,
        cancel_max_age: args.cancel_max_age.0,
        update_existing: true,
    };
    let conn = Conn::open(ctx).await?;
    crate::connect::check_server(&conn.client)?;
    // Without --replicas, the workers' rule (src/setup.rs), resolved here
    // so that the plan shows the number that will be applied.
    let o = SetupOptions {
        replicas: Some(o.resolve_replicas(&conn.js, &conn.names).await),
        ..o
    };
    let mut plans = plan(&conn, &o).await?;
    let lowering: Vec<String> = plans
        .iter()
        .flat_map(|p| {
            p.changes
                .iter()
                .filter(|c| c.lowers)
                .map(move |c| format!("{} {} {} → {}", p.name, c.field, c.from, c.to))
        })
        .collect();
    let refuse = !lowering.is_empty() && !args.force;
    for p in &mut plans {
        if p.action == "unchanged" {
            continue;
        }
        p.action = if args.dry_run || refuse {
            format!("would {}", p.action)
        } else {
            format!("{}d", p.action)
        };
    }
    for p in &plans {
        if args.json {
            output::json_line(p)?;
            continue;
        }
        let mut line = format!("{} {}: {}", p.kind, p.name, p.action);
        for c in &p.changes {
            line.push_str(&format!(
                "; {} {} → {}{}",
                c.field,
                c.from,
                c.to,
                if c.lowers { " (lowers)" } else { "" }
            ));
        }
        output::line(&line)?;
    }
    if refuse {
        anyhow::bail!(
            "refusing to lower replicas or shorten retention ({}); give the current values, or --force to apply",
            lowering.join(", ")
        );
    }
    if args.dry_run {
        return Ok(Exit::Ok);
    }
    let mut infra = ensure_all(&conn.js, &conn.names, &o).await?;
    if !args.json {
        let tasks = infra.tasks.info().await?.clone();
        if !tasks.config.allow_message_schedules {
            output::line(&format!(
                "stream {}: no message schedules (server older than 2.12)",
                conn.names.tasks_stream
            ))?;
        }
    }
    Ok(Exit::Ok)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lowering_replicas_or_retention_is_flagged() {
        let existing = async_nats::jetstream::stream::Config {
            num_replicas: 3,
            max_age: Duration::from_secs(7 * 24 * 3600),
            ..Default::default()
        };
        let o = SetupOptions::default();
        let c = diff(&existing, &o, Some(Duration::from_secs(3600)), true);
        assert_eq!(c.len(), 2);
        assert!(c.iter().all(|c| c.lowers), "{c:?}");
        // Raising is fine; an unlimited age is never a shortening.
        let o3 = SetupOptions {
            replicas: Some(5),
            ..Default::default()
        };
        let c = diff(&existing, &o3, Some(Duration::ZERO), true);
        assert!(c.iter().all(|c| !c.lowers), "{c:?}");
        // A bucket whose age is a TTL, not retention.
        let c = diff(&existing, &o3, Some(Duration::from_secs(30)), false);
        assert!(c.iter().all(|c| !c.lowers), "{c:?}");
        // Unchanged.
        let same = async_nats::jetstream::stream::Config {
            num_replicas: 1,
            ..Default::default()
        };
        assert!(diff(&same, &o, None, true).is_empty());
    }
}
