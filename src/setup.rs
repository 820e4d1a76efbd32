//! Creating or checking the streams, consumers and KV buckets of DESIGN.md
//! section 2. Every function is idempotent and safe when several workers
//! start at once: creation races end in "already exists", which is read
//! back, and the server's transient 10049 on a fresh store is retried.

use std::time::Duration;

use anyhow::{anyhow, Context as _};
use async_nats::jetstream::{
    self,
    consumer::{pull, AckPolicy, DeliverPolicy, PullConsumer},
    kv,
    stream::{Config as StreamConfig, DiscardPolicy, RetentionPolicy, StorageType, Stream},
};

use crate::connect::server_at_least;
use crate::protocol::Names;

/// Options an operator may set with `jetworker setup`; workers use the
/// defaults.
#[derive(Debug, Clone)]
pub struct SetupOptions {
    /// Replicas of every stream and bucket created (or, with
    /// `update_existing`, updated); `None`: `auto_replicas`.
    pub replicas: Option<usize>,
    /// File or memory storage of every stream and bucket created.
    pub storage: StorageType,
    /// RESULTS max age.
    pub results_max_age: Duration,
    /// DEAD max age (zero: kept until purged).
    pub dead_max_age: Duration,
    /// KV `workers` max age: the offline TTL.
    pub offline_after: Duration,
    /// KV `cancel` max age.
    pub cancel_max_age: Duration,
    /// Update existing streams to these options (setup) or leave them as
    /// they are (workers).
    pub update_existing: bool,
}

impl Default for SetupOptions {
    fn default() -> Self {
        SetupOptions {
            replicas: None,
            storage: StorageType::File,
            results_max_age: Duration::from_secs(7 * 24 * 3600),
            dead_max_age: Duration::ZERO,
            offline_after: crate::config::DEFAULT_OFFLINE_AFTER,
            cancel_max_age: Duration::from_secs(24 * 3600),
            update_existing: false,
        }
    }
}

/// Most replicas a worker (or `jetworker setup` without `--replicas`)
/// gives the streams and buckets it creates: three copies survive the loss
/// of any one node, and more only slow every write down.
pub const AUTO_MAX_REPLICAS: usize = 3;

/// How long a worker that is about to create the streams on a cluster that
/// seems to have fewer than 3 nodes keeps asking the meta leader to place
/// 3 replicas (a cluster still forming) before it settles for fewer
/// ([`ensure_all`]).
const FORMING_WAIT: Duration = Duration::from_secs(5);

/// The replica count when nobody chose one, as far as the connected
/// server's INFO tells: 1 on a single server, `min(3, servers in the
/// cluster)` on a cluster, counting the server itself plus the other nodes'
/// client URLs it advertises; a cluster that does not advertise its nodes
/// (`no_advertise`) gets 1: run `jetworker setup --replicas 3` there.
///
/// This INFO is the one the client got when it connected: async-nats
/// (0.51) ignores the INFO updates a server sends as routes come and go, so
/// it can name fewer nodes than the cluster has by the time streams are
/// created. [`ensure_all`] therefore does not trust a count below 3 on a
/// cluster: it asks the meta leader to place 3 replicas first. Streams that
/// exist are never changed by this rule.
pub fn auto_replicas(info: &async_nats::ServerInfo) -> usize {
    if info.cluster.is_none() {
        return 1;
    }
    let own = format!("{}:{}", info.host, info.port);
    let mut servers: Vec<&str> = info.connect_urls.iter().map(String::as_str).collect();
    servers.push(&own);
    servers.sort_unstable();
    servers.dedup();
    // `connect_urls` lists this server too; 0.0.0.0 is not an address.
    let count = servers
        .iter()
        .filter(|s| !s.starts_with("0.0.0.0:") && !s.starts_with("[::]:"))
        .count();
    count.clamp(1, AUTO_MAX_REPLICAS)
}

impl SetupOptions {
    /// The replica count to plan with: the chosen one, else
    /// `auto_replicas` (the connected server's INFO, which can undercount
    /// a cluster; [`ensure_all`] corrects that when it creates the task
    /// stream).
    pub async fn resolve_replicas(&self, js: &jetstream::Context, _names: &Names) -> usize {
        match self.replicas {
            Some(r) => r,
            None => auto_replicas(&js.client().server_info()),
        }
    }

    /// The replicas a config gets: [`ensure_all`] (and `jetworker setup`)
    /// resolve `None` first (with [`Self::resolve_replicas`]); a config
    /// built directly from unresolved options gets 1.
    pub(crate) fn num_replicas(&self) -> usize {
        self.replicas.unwrap_or(1)
    }
}

/// Config of the task stream.
pub fn tasks_stream_config(names: &Names, o: &SetupOptions, schedules: bool) -> StreamConfig {
    StreamConfig {
        name: names.tasks_stream.clone(),
        subjects: vec![
            format!("{}.>", names.tasks_prefix),
            format!("{}.>", names.schedules_prefix),
        ],
        retention: RetentionPolicy::WorkQueue,
        storage: o.storage,
        num_replicas: o.num_replicas(),
        duplicate_window: Duration::from_secs(120),
        allow_message_schedules: schedules,
        allow_rollup: schedules,
        ..Default::default()
    }
}

pub fn results_stream_config(names: &Names, o: &SetupOptions) -> StreamConfig {
    StreamConfig {
        name: names.results_stream.clone(),
        subjects: vec![format!("{}.>", names.results_prefix)],
        retention: RetentionPolicy::Limits,
        storage: o.storage,
        num_replicas: o.num_replicas(),
        max_age: o.results_max_age,
        allow_direct: true,
        duplicate_window: Duration::from_secs(120),
        discard: DiscardPolicy::Old,
        ..Default::default()
    }
}

pub fn dead_stream_config(names: &Names, o: &SetupOptions) -> StreamConfig {
    StreamConfig {
        name: names.dead_stream.clone(),
        subjects: vec![format!("{}.>", names.dead_prefix)],
        retention: RetentionPolicy::Limits,
        storage: o.storage,
        num_replicas: o.num_replicas(),
        max_age: o.dead_max_age,
        allow_direct: true,
        duplicate_window: Duration::from_secs(120),
        ..Default::default()
    }
}

/// Get a stream, creating it (or updating it, with `update`) as needed.
pub async fn ensure_stream(
    js: &jetstream::Context,
    cfg: StreamConfig,
    update: bool,
) -> anyhow::Result<Stream> {
    let name = cfg.name.clone();
    let mut last_err = None;
    for attempt in 0..10u32 {
        if update {
            match js.create_or_update_stream(cfg.clone()).await {
                Ok(_) => {
                    return js
                        .get_stream(&name)
                        .await
                        .with_context(|| format!("stream {name}"))
                }
                Err(e) => last_err = Some(anyhow!(e)),
            }
        } else {
            match js.get_stream(&name).await {
                Ok(s) => return Ok(s),
                Err(e)
                    if matches!(
                        e.kind(),
                        jetstream::context::GetStreamErrorKind::JetStream(ref j)
                            if j.error_code() == jetstream::ErrorCode::STREAM_NOT_FOUND
                    ) =>
                {
                    match js.create_stream(cfg.clone()).await {
                        Ok(s) => return Ok(s),
                        Err(e) => last_err = Some(anyhow!(e)),
                    }
                }
                Err(e) => last_err = Some(anyhow!(e)),
            }
        }
        tokio::time::sleep(Duration::from_millis(50 * (attempt as u64 + 1))).await;
    }
    Err(last_err
        .unwrap_or_else(|| anyhow!("unknown error"))
        .context(format!("cannot create or read stream {name}")))
}

/// The task stream, with message schedules where the server has them.
pub async fn ensure_tasks_stream(
    js: &jetstream::Context,
    names: &Names,
    o: &SetupOptions,
) -> anyhow::Result<Stream> {
    let schedules = server_at_least(&js.client(), 2, 12);
    ensure_stream(
        js,
        tasks_stream_config(names, o, schedules),
        o.update_existing,
    )
    .await
}

/// A KV bucket; `markers` turns on limit markers for that long.
pub async fn ensure_kv(
    js: &jetstream::Context,
    bucket: &str,
    max_age: Duration,
    markers: Option<Duration>,
    o: &SetupOptions,
) -> anyhow::Result<kv::Store> {
    let cfg = kv::Config {
        bucket: bucket.to_string(),
        history: 1,
        max_age,
        storage: o.storage,
        num_replicas: o.num_replicas(),
        limit_markers: markers,
        ..Default::default()
    };
    let mut last_err = None;
    for attempt in 0..10u32 {
        if o.update_existing {
            match js.create_or_update_key_value(cfg.clone()).await {
                Ok(s) => return Ok(s),
                Err(e) => last_err = Some(anyhow!(e)),
            }
        } else {
            match js.get_key_value(bucket).await {
                Ok(s) => return Ok(s),
                Err(_) => match js.create_key_value(cfg.clone()).await {
                    Ok(s) => return Ok(s),
                    Err(e) => last_err = Some(anyhow!(e)),
                },
            }
        }
        tokio::time::sleep(Duration::from_millis(50 * (attempt as u64 + 1))).await;
    }
    Err(last_err
        .unwrap_or_else(|| anyhow!("unknown error"))
        .context(format!("cannot create or read KV bucket {bucket}")))
}

/// The heartbeat bucket: max age = offline TTL, with limit markers so that
/// watchers see a silent worker go.
pub async fn ensure_workers_kv(
    js: &jetstream::Context,
    names: &Names,
    o: &SetupOptions,
) -> anyhow::Result<kv::Store> {
    let ttl = o.offline_after.max(Duration::from_secs(1));
    ensure_kv(js, &names.workers_bucket, ttl, Some(ttl), o).await
}

pub async fn ensure_cancel_kv(
    js: &jetstream::Context,
    names: &Names,
    o: &SetupOptions,
) -> anyhow::Result<kv::Store> {
    ensure_kv(js, &names.cancel_bucket, o.cancel_max_age, None, o).await
}

/// The fan-in bucket (DESIGN.md section 5, "Downstream tasks"): one key
/// per join, kept as long as results are.
pub async fn ensure_joins_kv(
    js: &jetstream::Context,
    names: &Names,
    o: &SetupOptions,
) -> anyhow::Result<kv::Store> {
    ensure_kv(js, &names.joins_bucket, o.results_max_age, None, o).await
}

/// Pull requests a label's consumer keeps waiting at once: each idle
/// worker keeps one per label, and the server's default (512) refuses the
/// rest with 409, so past 512 idle workers on a label they would spin on
/// refusals (benches/scale.rs: 1,000 idle pullers cost ~14 KiB and 0.005 %
/// of a core each at the server with room for all of them).
pub const MAX_WAITING_PULLS: i64 = 4096;

/// The durable consumer of one label, shared by all its workers.
pub async fn ensure_label_consumer(
    stream: &Stream,
    names: &Names,
    label: &str,
    ack_wait: Duration,
) -> anyhow::Result<PullConsumer> {
    let name = names.consumer_name(label);
    let cfg = pull::Config {
        durable_name: Some(name.clone()),
        filter_subjects: names.label_filters(label),
        ack_policy: AckPolicy::Explicit,
        deliver_policy: DeliverPolicy::All,
        ack_wait,
        max_deliver: -1,
        max_ack_pending: 10_000,
        max_waiting: MAX_WAITING_PULLS,
        ..Default::default()
    };
    let mut last_err = None;
    for attempt in 0..10u32 {
        match stream
            .get_or_create_consumer::<pull::Config>(&name, cfg.clone())
            .await
        {
            Ok(c) => return Ok(c),
            Err(e) => last_err = Some(anyhow!(e)),
        }
        tokio::time::sleep(Duration::from_millis(50 * (attempt as u64 + 1))).await;
    }
    Err(last_err
        .unwrap_or_else(|| anyhow!("unknown error"))
        .context(format!("cannot create or read consumer {name}")))
}

/// Everything a worker needs, in one call.
pub struct Infra {
    pub tasks: Stream,
    pub results: Stream,
    pub dead: Stream,
    pub workers: kv::Store,
    pub cancel: kv::Store,
    pub joins: kv::Store,
}

/// Whether a stream create was refused because the meta leader cannot place
/// that many replicas (too few nodes, or nodes not yet known to be up).
fn is_placement_error(e: &jetstream::context::CreateStreamError) -> bool {
    matches!(
        e.kind(),
        jetstream::context::CreateStreamErrorKind::JetStream(ref j)
            if j.error_code() == jetstream::ErrorCode::CLUSTER_NO_PEERS
                || j.error_code() == jetstream::ErrorCode::INSUFFICIENT_RESOURCES
    )
}

/// The replicas of a task stream that does not exist yet on a cluster whose
/// INFO named fewer than 3 nodes (`counted`): create it with 3, asking
/// again while the meta leader cannot place them, for up to
/// [`FORMING_WAIT`]; then settle for `counted`. Returns the replicas the
/// task stream got (also when another worker created it meanwhile).
async fn place_tasks_stream(
    js: &jetstream::Context,
    names: &Names,
    o: &SetupOptions,
    counted: usize,
) -> usize {
    let schedules = server_at_least(&js.client(), 2, 12);
    let o3 = SetupOptions {
        replicas: Some(AUTO_MAX_REPLICAS),
        ..o.clone()
    };
    let deadline = tokio::time::Instant::now() + FORMING_WAIT;
    loop {
        match js
            .create_stream(tasks_stream_config(names, &o3, schedules))
            .await
        {
            Ok(s) => return s.cached_info().config.num_replicas,
            Err(e) if is_placement_error(&e) && tokio::time::Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
            // Placement still refused: fewer nodes than 3. Anything else
            // (it exists now, a timeout): read it back, else use the count;
            // ensure_tasks_stream retries and reports real errors.
            Err(_) => {
                return match js.get_stream(&names.tasks_stream).await {
                    Ok(mut s) => match s.info().await {
                        Ok(i) => i.config.num_replicas,
                        Err(_) => counted,
                    },
                    Err(_) => counted,
                };
            }
        }
    }
}

/// Create or check everything; replicas chosen once for all of it:
/// the chosen count, else `auto_replicas` — except on a cluster whose
/// INFO names fewer than 3 nodes while the task stream does not exist yet,
/// where the meta leader decides (`place_tasks_stream`): 3 if it can
/// place them within `FORMING_WAIT`, else the count from INFO.
pub async fn ensure_all(
    js: &jetstream::Context,
    names: &Names,
    o: &SetupOptions,
) -> anyhow::Result<Infra> {
    let mut replicas = o.resolve_replicas(js, names).await;
    if o.replicas.is_none()
        && replicas < AUTO_MAX_REPLICAS
        && js.client().server_info().cluster.is_some()
        && js.get_stream(&names.tasks_stream).await.is_err()
    {
        replicas = place_tasks_stream(js, names, o, replicas).await;
    }
    if o.replicas.is_none() && replicas > 1 {
        tracing::debug!(
            replicas,
            "clustered server: new streams get {replicas} replicas"
        );
    }
    let o = &SetupOptions {
        replicas: Some(replicas),
        ..o.clone()
    };
    // Recent live output for late followers; live output works without it.
    if let Err(e) = ensure_stream(
        js,
        crate::output::logs_stream_config(names),
        o.update_existing,
    )
    .await
    {
        tracing::warn!("no live-output stream ({e:#}); `logs --follow` sees only output published after it attaches");
    }
    Ok(Infra {
        tasks: ensure_tasks_stream(js, names, o).await?,
        results: ensure_stream(js, results_stream_config(names, o), o.update_existing).await?,
        dead: ensure_stream(js, dead_stream_config(names, o), o.update_existing).await?,
        workers: ensure_workers_kv(js, names, o).await?,
        cancel: ensure_cancel_kv(js, names, o).await?,
        joins: ensure_joins_kv(js, names, o).await?,
    })
}
