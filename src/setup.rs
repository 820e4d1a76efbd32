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
    pub replicas: usize,
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
            replicas: 1,
            storage: StorageType::File,
            results_max_age: Duration::from_secs(7 * 24 * 3600),
            dead_max_age: Duration::ZERO,
            offline_after: crate::config::DEFAULT_OFFLINE_AFTER,
            cancel_max_age: Duration::from_secs(24 * 3600),
            update_existing: false,
        }
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
        num_replicas: o.replicas,
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
        num_replicas: o.replicas,
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
        num_replicas: o.replicas,
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
        num_replicas: o.replicas,
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
}

pub async fn ensure_all(
    js: &jetstream::Context,
    names: &Names,
    o: &SetupOptions,
) -> anyhow::Result<Infra> {
    Ok(Infra {
        tasks: ensure_tasks_stream(js, names, o).await?,
        results: ensure_stream(js, results_stream_config(names, o), o.update_existing).await?,
        dead: ensure_stream(js, dead_stream_config(names, o), o.update_existing).await?,
        workers: ensure_workers_kv(js, names, o).await?,
        cancel: ensure_cancel_kv(js, names, o).await?,
    })
}
