//! The worker daemon: start-up (connect, check the server, create the
//! streams, consumers and buckets, retrying while the broker is not ready),
//! one puller per label that never leases more messages than free slots,
//! the task lifecycle (`lifecycle`), heartbeats, the cancel and workers
//! watches, the outbox, and the drain on shutdown (DESIGN.md sections 1, 5
//! and 6).
//!
//! Layout: `lifecycle` handles one message and is the only code that
//! answers the broker; `records` reads and builds the records on
//! `results.<id>` (every write a compare-and-set); `outbox` is the one
//! delivery loop for what must be stored; `running` is the registry of
//! running tasks, whose guard unregisters on drop; `readiness` works out
//! `/readyz` and what systemd hears (`READY=1`, watchdog, `STOPPING=1`).
//!
//! Shutdown: the `shutdown` token stops the pullers; running tasks get
//! `drain_timeout` to finish; the rest are stopped, recorded `queued` and
//! handed back for immediate redelivery; the heartbeat key is deleted; the
//! connection is flushed.

mod downstream;
mod heartbeat;
mod lifecycle;
pub(crate) mod outbox;
mod puller;
mod readiness;
mod records;
mod running;

pub(crate) use readiness::ConnState;
use readiness::Pull;

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_nats::jetstream::{self, consumer::PullConsumer, kv};
use chrono::{DateTime, Utc};
use futures::StreamExt;
use rand::Rng;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{debug, error, info, warn, Instrument};

use crate::config::{ConfigError, WorkerConfig};
use crate::metrics::Metrics;
use crate::protocol::{Heartbeat, Names, ValidationLimits};
use crate::runner::{self, Registry, Runner, StopKind};
use crate::setup::{self, Infra, SetupOptions};

/// How long one pull request waits at the server for messages.
const PULL_EXPIRES: Duration = Duration::from_secs(2);
/// A pull that ends later than its expiry plus this was not ended by the
/// server (the client's own timer ends it 5 s after the expiry).
const PULL_ANSWER_MARGIN: Duration = Duration::from_secs(2);
/// Room left in a result message for everything but the output.
const RESULT_OVERHEAD: usize = 16 * 1024;

/// State shared by every part of one worker.
pub(crate) struct Shared {
    pub cfg: WorkerConfig,
    /// `<name>-<random>`, unique per process.
    pub id: String,
    pub hostname: String,
    /// A second connection for live output (`logs.<id>`), so a chatty task
    /// can never delay progress acks and results on the main one (`js`).
    pub live_client: async_nats::Client,
    /// The main connection: records and copies are published on it as
    /// core requests ([`outbox::Entry::publish`]); `js` wraps it.
    pub client: async_nats::Client,
    pub js: jetstream::Context,
    pub names: Names,
    pub infra: Infra,
    /// Every type this worker knows (validation, running).
    pub runners: Registry,
    /// The processes of shell, command and config-defined tasks.
    process: Arc<runner::command::ProcessRunner>,
    /// Types this worker runs (configured ∩ available).
    pub types: Vec<String>,
    pub validation: ValidationLimits,
    /// Output cap after clamping to the server's max_payload.
    pub output_cap: u64,
    /// Largest message the server takes.
    pub max_payload: usize,
    /// The consumers' real ack wait (the smallest, if they differ).
    pub ack_wait: Duration,
    /// Tasks running here.
    running: Arc<running::Running>,
    /// Keys of KV `cancel` (id → reason), kept by [`watch_cancels`]: a task
    /// is checked against it without a round trip.
    cancels: Mutex<HashMap<String, String>>,
    /// Shards of joins being written to KV `joins` ([`downstream`]).
    joins: downstream::JoinBatches,
    /// Heartbeats of the online workers (KV `workers`), kept by
    /// [`watch_workers`].
    workers: Mutex<HashMap<String, Heartbeat>>,
    counts: Mutex<BTreeMap<String, u64>>,
    pub outbox: outbox::Outbox,
    pub conn: Arc<ConnState>,
    pub metrics: Arc<Metrics>,
    pub started_at: DateTime<Utc>,
    /// Fired when the worker stops pulling.
    pub shutdown: CancellationToken,
    /// Fired when the drain is over: outbox retries give up (the entries
    /// stay on disk for the next start).
    pub abandon: CancellationToken,
    /// Test-only fault (`JETWORKER_TEST_FAULT=die-before-ack`): exit right
    /// after a result is stored and before the ack, as a crash would.
    pub die_before_ack: bool,
    /// Test-only fault (`JETWORKER_TEST_FAULT=die-before-downstream`): exit
    /// right after a final record is stored, before its downstream tasks
    /// are queued.
    pub die_before_downstream: bool,
    /// The pipe that keeps the orphan watchdog waiting; closed on exit.
    watchdog: Mutex<Option<std::process::ChildStdin>>,
}

impl Shared {
    fn count(&self, status: &str) {
        *self
            .counts
            .lock()
            .unwrap()
            .entry(status.to_string())
            .or_default() += 1;
    }

    fn counts(&self) -> BTreeMap<String, u64> {
        self.counts.lock().unwrap().clone()
    }

    /// Tell the metrics what the outbox holds now (after each store and
    /// removal).
    fn outbox_changed(&self) {
        let (entries, oldest) = self.outbox.stats();
        self.metrics.set_outbox(entries, oldest);
    }

    /// The reason of a cancel key for `id`, if there is one.
    fn cancel_reason(&self, id: &str) -> Option<String> {
        self.cancels.lock().unwrap().get(id).cloned()
    }

    /// Whether a worker with this id has a heartbeat.
    fn workers_online(&self, id: &str) -> bool {
        id == self.id || self.workers.lock().unwrap().contains_key(id)
    }

    /// Whether another online worker serves `label` and runs `ty`.
    fn type_served(&self, label: &str, ty: &str) -> bool {
        self.workers.lock().unwrap().values().any(|h| {
            h.id != self.id
                && h.labels.iter().any(|l| l == label)
                && h.types.iter().any(|t| t == ty)
        })
    }

    /// Every type name this worker or an online one runs (for "did you
    /// mean").
    fn known_types(&self) -> Vec<String> {
        let mut v: Vec<String> = self.runners.names().iter().map(|s| s.to_string()).collect();
        for h in self.workers.lock().unwrap().values() {
            v.extend(h.types.iter().cloned());
        }
        v.sort();
        v.dedup();
        v
    }

    /// Create the streams and buckets again if one was deleted under us.
    /// "No stream for the subject" is also what a cluster answers while a
    /// stream elects its leader, so nothing is created unless the server
    /// confirms that a stream is gone (error 10059): a transient answer is
    /// left to the caller's retry.
    async fn recreate_streams(&self) -> anyhow::Result<()> {
        use async_nats::jetstream::context::GetStreamErrorKind;
        let mut missing = false;
        for name in [
            &self.names.tasks_stream,
            &self.names.results_stream,
            &self.names.dead_stream,
        ] {
            if let Err(e) = self.js.get_stream(name).await {
                if matches!(e.kind(), GetStreamErrorKind::JetStream(ref j)
                    if j.error_code() == jetstream::ErrorCode::STREAM_NOT_FOUND)
                {
                    missing = true;
                }
            }
        }
        if missing {
            setup::ensure_all(&self.js, &self.names, &setup_options(&self.cfg)).await?;
        }
        Ok(())
    }
}

/// What the worker creates when a stream or bucket is missing.
fn setup_options(cfg: &WorkerConfig) -> SetupOptions {
    SetupOptions {
        offline_after: cfg.offline_after,
        ..Default::default()
    }
}

/// Wait for SIGTERM or SIGINT.
pub async fn shutdown_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).expect("SIGTERM handler");
    let mut int = signal(SignalKind::interrupt()).expect("SIGINT handler");
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
}

fn random_suffix() -> String {
    let n: u32 = rand::rng().random();
    format!("{n:08x}")
}

/// Run a worker with the built-in types and those defined in its config
/// until `shutdown` fires, then drain and return ([`Worker::builder`] adds
/// types of your own).
///
/// Errors: a [`ConfigError`] for what no restart can fix (settings, an
/// unreadable credential, a server too old); anything else is worth a
/// restart. Transient broker trouble at start (JetStream not ready, API
/// timeouts, no responders) is retried here with backoff, not returned.
pub async fn run(cfg: WorkerConfig, shutdown: CancellationToken) -> anyhow::Result<()> {
    let mut b = Worker::builder().config(cfg);
    // The daemon's own process: its start-up code can go once it pulls. A
    // program embedding the worker decides about its own memory.
    b.release_startup_pages = true;
    b.run(shutdown).await
}

/// A worker embedded in a Rust program, with task types of its own.
///
/// ```no_run
/// # async fn f() -> anyhow::Result<()> {
/// use jetworker::{config::WorkerConfig, Worker};
/// let cfg = WorkerConfig::from_flags(&[("labels", "images")])?;
/// let shutdown = tokio_util::sync::CancellationToken::new();
/// Worker::builder().config(cfg).run(shutdown).await
/// # }
/// ```
pub struct Worker;

impl Worker {
    /// Start describing a worker.
    pub fn builder() -> WorkerBuilder {
        WorkerBuilder::default()
    }
}

/// A type to add to the registry once the worker's own are in.
type AddRunner = Box<dyn FnOnce(&mut Registry) -> Result<(), String> + Send>;

/// Builds and runs a worker: its settings and the types it runs besides
/// the built-in ones and those of its config.
#[derive(Default)]
pub struct WorkerBuilder {
    cfg: Option<WorkerConfig>,
    runners: Vec<AddRunner>,
    /// Hand the executable's start-up pages back once pulling
    /// ([`crate::memory`]): only for the daemon ([`run`]).
    release_startup_pages: bool,
}

impl WorkerBuilder {
    /// The worker's settings (default: [`WorkerConfig::from_flags`] with
    /// none, that is every default).
    pub fn config(mut self, cfg: WorkerConfig) -> Self {
        self.cfg = Some(cfg);
        self
    }

    /// Add a task type. Its name must not be taken (by a built-in type, a
    /// type defined in config, or another runner): [`WorkerBuilder::run`]
    /// fails with a settings error if it is.
    pub fn runner<R: Runner>(mut self, runner: R) -> Self {
        self.runners
            .push(Box::new(move |reg| reg.register(runner).map(|_| ())));
        self
    }

    /// Run until `shutdown` fires, then drain and return (see [`run`]).
    pub async fn run(self, shutdown: CancellationToken) -> anyhow::Result<()> {
        let cfg = match self.cfg {
            Some(c) => c,
            None => WorkerConfig::from_flags(&[])?,
        };
        let id = format!("{}-{}", cfg.name, random_suffix());
        crate::logfmt::set_worker_id(&id);
        // Every log line of this worker's life carries its id: the span is
        // entered here and passed on to everything it spawns. Error level:
        // a span is left out when the log level filters out its own level, and
        // this one must be there at any level.
        let span = tracing::error_span!("worker", worker_id = %id);
        run_as(cfg, self.runners, self.release_startup_pages, shutdown, id)
            .instrument(span)
            .await
    }
}

/// [`run`], inside the worker's span.
async fn run_as(
    cfg: WorkerConfig,
    custom: Vec<AddRunner>,
    release_startup_pages: bool,
    shutdown: CancellationToken,
    id: String,
) -> anyhow::Result<()> {
    crate::process::protect_secrets();
    let hostname = hostname::get()
        .ok()
        .and_then(|h| h.into_string().ok())
        .unwrap_or_else(|| "unknown".into());
    std::fs::create_dir_all(&cfg.state_dir).map_err(|e| {
        ConfigError::new(
            "state_dir",
            format!("cannot create {}: {e}", cfg.state_dir.display()),
        )
    })?;
    let _ = rustls::crypto::ring::default_provider().install_default();

    let metrics = Arc::new(Metrics::new());
    metrics.slots.set(cfg.slots as i64);
    // Bound before anything else: an address that cannot be bound is a
    // configuration error (exit 2), and /healthz answers (and /readyz says
    // "not ready") while the worker still waits for NATS.
    let _endpoints = match cfg.metrics_addr {
        Some(addr) => {
            let listener = crate::metrics::bind(addr).await.map_err(|e| {
                ConfigError::new("metrics_addr", format!("cannot listen on {addr}: {e}"))
            })?;
            let m = metrics.clone();
            Some(tokio_util::task::AbortOnDropHandle::new(tokio::spawn(
                async move {
                    if let Err(e) = crate::metrics::serve(listener, m).await {
                        error!(%addr, "metrics endpoint failed: {e:#}");
                    }
                },
            )))
        }
        None => None,
    };
    let conn = Arc::new(ConnState::new(metrics.clone()));
    // Until it pulls, a worker waiting for NATS or for its streams must
    // still stop at once on SIGTERM.
    let started = tokio::select! {
        r = start_up(&cfg, &id, conn.clone()) => r?,
        _ = shutdown.cancelled() => {
            info!("stopped before it was connected");
            return Ok(());
        }
    };
    let StartUp {
        client,
        js,
        names,
        infra,
        consumers,
        ack_wait,
    } = started;
    let task_user = match &cfg.task_user {
        Some(u) => {
            Some(crate::process::resolve_user(u).map_err(|e| ConfigError::new("task_user", e))?)
        }
        None => None,
    };
    let process = Arc::new(
        runner::command::ProcessRunner::new(
            cfg.shell.clone(),
            &cfg.pass_env,
            task_user,
            &cfg.state_dir,
            cfg.cgroups,
        )
        .map_err(|e| {
            ConfigError::new(
                "state_dir",
                format!("cannot prepare the working directories: {e}"),
            )
        })?,
    );
    let reaped = process.reap_orphans();
    if reaped > 0 {
        warn!(
            groups = reaped,
            "killed task process groups left by an earlier run"
        );
    }
    let watchdog = match crate::process::spawn_watchdog(&cfg.state_dir) {
        Ok(w) => Some(w),
        Err(e) => {
            warn!("cannot start the orphan watchdog ({e}); background task processes may outlive a crashed worker until it restarts");
            None
        }
    };
    let container = Arc::new(runner::container::ContainerRunner::new(
        cfg.docker_host.as_deref(),
        cfg.default_network.clone(),
        cfg.allowed_networks.clone(),
        &id,
        &cfg.name,
    ));
    let runners = registry(&cfg, process.clone(), container.clone(), custom)?;
    let available = runners.available().await;
    let types: Vec<String> = match &cfg.types {
        None => {
            for t in runners.names() {
                if !available.iter().any(|a| a == t) {
                    warn!(r#type = %t, "task type not available on this machine; not advertised");
                }
            }
            available
        }
        Some(chosen) => {
            for t in chosen {
                if !runners.contains(t) {
                    return Err(ConfigError::new(
                        "types",
                        format!(
                            "unknown type `{t}`{} (this worker has {})",
                            crate::suggest::hint(t, runners.names()),
                            runners.names().join(", ")
                        ),
                    )
                    .into());
                }
                if !available.contains(t) {
                    warn!(r#type = %t, "task type named in `types` is not available on this machine; its tasks will fail until it is");
                }
            }
            chosen.clone()
        }
    };
    if types.iter().any(|t| t == "container") {
        let removed = container.remove_leftovers().await;
        if removed > 0 {
            warn!(
                containers = removed,
                "removed containers left by workers of this host that are gone"
            );
        }
    }

    let live_client = crate::connect::connect_worker(
        &cfg.connect,
        &format!("{id}-live"),
        cfg.ack_wait,
        Arc::new(|_| {}),
    )
    .await?;
    let max_payload = client.server_info().max_payload;
    let output_cap = cfg
        .output_cap
        .min(max_payload.saturating_sub(RESULT_OVERHEAD).max(1024) as u64);
    if output_cap < cfg.output_cap {
        info!(
            output_cap,
            max_payload, "output cap clamped to fit the server's max_payload"
        );
    }
    let outbox = outbox::Outbox::open(&cfg.state_dir)
        .map_err(|e| ConfigError::new("state_dir", format!("cannot open the outbox: {e}")))?;
    let validation = ValidationLimits {
        max_task_bytes: cfg.max_task_bytes,
        types: runners.clone(),
    };
    let sh = Arc::new(Shared {
        id: id.clone(),
        hostname,
        live_client,
        client: client.clone(),
        js,
        names,
        infra,
        runners,
        process,
        types,
        validation,
        output_cap,
        max_payload,
        ack_wait,
        running: running::Running::new(metrics.running.clone()),
        cancels: Mutex::new(HashMap::new()),
        joins: Default::default(),
        workers: Mutex::new(HashMap::new()),
        counts: Mutex::new(BTreeMap::new()),
        outbox,
        conn,
        metrics: metrics.clone(),
        started_at: Utc::now(),
        shutdown: shutdown.clone(),
        abandon: CancellationToken::new(),
        die_before_ack: std::env::var("JETWORKER_TEST_FAULT").as_deref() == Ok("die-before-ack"),
        die_before_downstream: std::env::var("JETWORKER_TEST_FAULT").as_deref()
            == Ok("die-before-downstream"),
        watchdog: Mutex::new(watchdog),
        cfg,
    });
    info!(labels = ?sh.cfg.labels, slots = sh.cfg.slots,
        types = ?sh.types,
        ack_wait = ?sh.ack_wait, "worker started");

    let background = CancellationToken::new();
    let first_beat = CancellationToken::new();
    let hb = tokio::spawn(
        heartbeat::beat(sh.clone(), background.clone(), first_beat.clone()).in_current_span(),
    );
    // Cancel keys and heartbeats are read before any pulling, so that the
    // first task already sees a cancel put while it was queued.
    let cancels_current = CancellationToken::new();
    let workers_current = CancellationToken::new();
    tokio::spawn(
        watch_cancels(sh.clone(), background.clone(), cancels_current.clone()).in_current_span(),
    );
    tokio::spawn(
        watch_workers(sh.clone(), background.clone(), workers_current.clone()).in_current_span(),
    );
    let caught_up = async {
        cancels_current.cancelled().await;
        workers_current.cancelled().await;
    };
    if tokio::time::timeout(Duration::from_secs(10), caught_up)
        .await
        .is_err()
    {
        warn!("the cancel and workers buckets were not read within 10s; going on");
    }
    // Other workers must see this one online before any claim of its own
    // (a claim of an online worker is waited for, never taken over).
    tokio::select! {
        _ = first_beat.cancelled() => {}
        _ = shutdown.cancelled() => {}
    }
    // Records an earlier life left behind go out before any pulling, so a
    // redelivered task finds its result and is not run again.
    if tokio::time::timeout(Duration::from_secs(10), replay_outbox(sh.clone()))
        .await
        .is_err()
    {
        warn!("outbox not empty after 10s; delivering it in the background");
        tokio::spawn(replay_outbox(sh.clone()).in_current_span());
    }

    let tracker = TaskTracker::new();
    let sem = Arc::new(Semaphore::new(sh.cfg.slots));
    let per_pull = (sh.cfg.slots / consumers.len()).clamp(1, 64);
    // Not ready until every label's first pull is answered.
    for (label, _) in &consumers {
        sh.conn.pull(label, Pull::Failing);
    }
    // The heartbeat loop goes round every interval, a put taking at most
    // 5 s: a worker whose loop missed two rounds is stuck.
    let alive_within = sh.cfg.heartbeat * 2 + Duration::from_secs(10);
    tokio::spawn(readiness::watchdog(
        sh.conn.clone(),
        alive_within,
        background.clone(),
    ));
    let mut pullers = Vec::new();
    for (label, consumer) in consumers {
        pullers.push(tokio::spawn(
            pull_loop(
                sh.clone(),
                label,
                consumer,
                sem.clone(),
                tracker.clone(),
                per_pull,
            )
            .in_current_span(),
        ));
    }
    if release_startup_pages {
        tokio::task::spawn_blocking(|| {
            let n = crate::memory::release_startup_pages();
            debug!(
                kib = n / 1024,
                "start-up pages of the executable handed back"
            );
        });
    }

    shutdown.cancelled().await;
    // The drain timeout counts from the request to stop.
    let drain_until = tokio::time::Instant::now() + sh.cfg.drain_timeout;
    sh.conn.stop();
    info!(
        running = sh.running.len(),
        "stopping: no new tasks; draining"
    );
    // A puller finishes its current pull (at most PULL_EXPIRES); one stuck
    // on a dead connection is abandoned: what it may still receive is
    // redelivered after ack wait. Running tasks go on meanwhile.
    for p in pullers {
        let abort = p.abort_handle();
        if tokio::time::timeout(PULL_EXPIRES + Duration::from_secs(3), p)
            .await
            .is_err()
        {
            abort.abort();
        }
    }
    tracker.close();
    if tokio::time::timeout_at(drain_until, tracker.wait())
        .await
        .is_err()
    {
        let n = sh
            .running
            .stop_all(StopKind::Shutdown, "worker shutting down");
        warn!(
            tasks = n,
            "drain timeout reached: stopping the remaining tasks for redelivery"
        );
        // They need the kill grace, then a moment to report and Nak.
        let extra = sh.cfg.kill_grace + Duration::from_secs(5);
        if tokio::time::timeout(extra, tracker.wait()).await.is_err() {
            sh.abandon.cancel();
            let _ = tokio::time::timeout(Duration::from_secs(2), tracker.wait()).await;
        }
    }
    sh.abandon.cancel();
    background.cancel();
    // A beat stuck on a dead connection must not hold up the exit.
    hb.abort();
    let _ = hb.await;
    // Cut off from NATS, the key cannot be deleted: it expires by itself.
    let wait = if sh.conn.is_connected() {
        Duration::from_secs(5)
    } else {
        Duration::from_millis(500)
    };
    if let Err(e) = tokio::time::timeout(wait, sh.infra.workers.delete(&sh.id)).await {
        warn!("could not delete the heartbeat key ({e}); it expires after offline_after");
    }
    let _ = tokio::time::timeout(wait, client.flush()).await;
    let _ = tokio::time::timeout(wait, sh.live_client.flush()).await;
    sh.watchdog.lock().unwrap().take();
    sh.process.cleanup();
    info!("worker stopped");
    Ok(())
}

/// The worker's types: the built-in ones, those defined in its config,
/// then the embedding program's. A name taken twice is a settings error.
fn registry(
    cfg: &WorkerConfig,
    process: Arc<runner::command::ProcessRunner>,
    container: Arc<runner::container::ContainerRunner>,
    custom: Vec<AddRunner>,
) -> anyhow::Result<Registry> {
    let mut r = Registry::new();
    let taken = |e: String| ConfigError::new("types", e);
    r.register(runner::shell::ShellRunner::new(process.clone()))
        .map_err(taken)?;
    r.register(runner::command::CommandRunner::new(process.clone()))
        .map_err(taken)?;
    r.register(runner::http::HttpRunner::new(cfg.deny_private_http)?)
        .map_err(taken)?;
    r.register(container).map_err(taken)?;
    for def in &cfg.type_defs {
        r.register(runner::defined::DefinedRunner::new(
            def.clone(),
            process.clone(),
        ))
        .map_err(taken)?;
    }
    for add in custom {
        add(&mut r).map_err(taken)?;
    }
    Ok(r)
}

/// What start-up produced.
struct StartUp {
    client: async_nats::Client,
    js: jetstream::Context,
    names: Names,
    infra: Infra,
    consumers: Vec<(String, PullConsumer)>,
    ack_wait: Duration,
}

/// Connect, check the server, then create or check streams, buckets and
/// the label consumers — retrying that part with backoff while the broker
/// is not ready (JetStream off or still electing, API timeouts, no
/// responders), because a restart would not do better.
async fn start_up(cfg: &WorkerConfig, id: &str, conn: Arc<ConnState>) -> anyhow::Result<StartUp> {
    let c2 = conn.clone();
    let span = tracing::Span::current();
    let client = crate::connect::connect_worker(
        &cfg.connect,
        id,
        cfg.ack_wait,
        // The client calls back from its own task: log in the worker's span.
        Arc::new(move |e| span.in_scope(|| c2.on_event(&e))),
    )
    .await?;
    conn.set_connected();
    crate::connect::check_server_version(&client)
        .map_err(|e| ConfigError::new("server", format!("{e:#}")))?;
    let js = crate::connect::jetstream(client.clone(), &cfg.connect);
    let names = cfg.connect.names.clone();
    let mut delay = Duration::from_millis(500);
    let mut tries = 0u32;
    loop {
        tries += 1;
        match prepare(&client, &js, cfg, &names).await {
            Ok((infra, consumers, ack_wait)) => {
                if tries > 1 {
                    info!(tries, "JetStream ready");
                }
                return Ok(StartUp {
                    client,
                    js,
                    names,
                    infra,
                    consumers,
                    ack_wait,
                });
            }
            Err(e) => {
                if tries == 1 || tries.is_multiple_of(10) {
                    warn!(retry_in = ?delay, tries, "JetStream not ready: {e:#}; retrying");
                } else {
                    debug!("JetStream not ready: {e:#}");
                }
            }
        }
        tokio::time::sleep(delay).await;
        delay = (delay * 2).min(Duration::from_secs(10));
    }
}

/// The JetStream part of start-up (streams, buckets, label consumers).
async fn prepare(
    client: &async_nats::Client,
    js: &jetstream::Context,
    cfg: &WorkerConfig,
    names: &Names,
) -> anyhow::Result<(Infra, Vec<(String, PullConsumer)>, Duration)> {
    if !client.server_info().jetstream {
        anyhow::bail!("JetStream is not enabled on the server (start nats-server with -js)");
    }
    let infra = setup::ensure_all(js, names, &setup_options(cfg)).await?;
    // The bucket's max age is the offline TTL for every worker; the first to
    // create it (or `jetworker setup`) decides.
    if let Ok(status) = infra.workers.status().await {
        if status.max_age() != cfg.offline_after {
            warn!(bucket_max_age = ?status.max_age(), offline_after = ?cfg.offline_after,
                "the workers bucket exists with another offline TTL; it applies (change it with `jetworker setup --offline-after`)");
        }
    }
    let mut consumers = Vec::new();
    let mut ack_wait = cfg.ack_wait;
    for label in &cfg.labels {
        let mut c = setup::ensure_label_consumer(&infra.tasks, names, label, cfg.ack_wait).await?;
        let real = c
            .info()
            .await
            .map(|i| i.config.ack_wait)
            .unwrap_or(cfg.ack_wait);
        if real != cfg.ack_wait {
            warn!(label, consumer_ack_wait = ?real, configured = ?cfg.ack_wait,
                "the label's consumer exists with another ack wait; using the consumer's");
        }
        ack_wait = ack_wait.min(real);
        consumers.push((label.clone(), c));
    }
    Ok((infra, consumers, ack_wait))
}

/// Pull from one label's consumer, never leasing more than free slots,
/// telling [`ConnState`] whether the server answers (`/readyz`).
async fn pull_loop(
    sh: Arc<Shared>,
    label: String,
    consumer: PullConsumer,
    sem: Arc<Semaphore>,
    tracker: TaskTracker,
    per_pull: usize,
) {
    let mut puller = puller::Puller::new(sh.js.clone(), consumer);
    let mut failures = 0u32;
    loop {
        // Shutdown first: with a free slot, both branches are ready.
        let first = match sem.clone().try_acquire_owned() {
            Ok(p) if !sh.shutdown.is_cancelled() => p,
            _ => {
                sh.conn.pull(&label, Pull::Busy);
                tokio::select! {
                    biased;
                    _ = sh.shutdown.cancelled() => return,
                    p = sem.clone().acquire_owned() => p.expect("semaphore open"),
                }
            }
        };
        let mut permits = vec![first];
        while permits.len() < per_pull {
            match sem.clone().try_acquire_owned() {
                Ok(p) => permits.push(p),
                Err(_) => break,
            }
        }
        let generation = sh.conn.generation();
        let sent = tokio::time::Instant::now();
        let batch = puller.pull(permits.len(), PULL_EXPIRES).await;
        let mut batch = match batch {
            Ok(b) => {
                failures = 0;
                b
            }
            Err(e) => {
                failures += 1;
                sh.conn.pull(&label, Pull::Failing);
                if failures == 1 || failures.is_multiple_of(30) {
                    warn!(label, "pull failed: {e}");
                }
                drop(permits);
                tokio::select! {
                    _ = tokio::time::sleep(Duration::from_millis(500)) => {}
                    _ = sh.shutdown.cancelled() => return,
                }
                // The consumer may have been deleted (e.g. by setup): recreate.
                if failures.is_multiple_of(4) && sh.conn.is_connected() {
                    if let Ok(c) = setup::ensure_label_consumer(
                        &sh.infra.tasks,
                        &sh.names,
                        &label,
                        sh.ack_wait,
                    )
                    .await
                    {
                        puller.set_consumer(c);
                    }
                }
                continue;
            }
        };
        // The server ends a pull at its expiry; a batch that ends well
        // after that was ended by the client's own timer: no answer.
        let mut answered = false;
        let mut failed = false;
        while let Some(item) = batch.next().await {
            match item {
                Ok(msg) => {
                    answered = true;
                    // Arrived after we stopped, or more than asked: hand it
                    // straight back (not an attempt).
                    let permit = match permits.pop() {
                        Some(p) if !sh.shutdown.is_cancelled() => p,
                        _ => {
                            lifecycle::answer(
                                &sh,
                                &msg,
                                lifecycle::Answer::Redeliver(Duration::ZERO),
                            )
                            .await;
                            continue;
                        }
                    };
                    let sh = sh.clone();
                    let label = label.clone();
                    tracker.spawn(
                        async move {
                            lifecycle::handle(sh, label, msg).await;
                            drop(permit);
                        }
                        .in_current_span(),
                    );
                }
                Err(e) => {
                    // Expiry ends a batch without an error; this is the
                    // broker failing (no quorum, stream leader gone).
                    failed = true;
                    debug!(label, "pull batch ended: {e}");
                    break;
                }
            }
        }
        answered |= !failed && sent.elapsed() < PULL_EXPIRES + PULL_ANSWER_MARGIN;
        sh.conn.pull(
            &label,
            if answered && !failed {
                Pull::Answered(generation)
            } else {
                Pull::Failing
            },
        );
    }
}

/// Keep a bucket's current keys through a watch that starts with its
/// history; `current` fires once the history is read. `apply` gets each
/// entry; the watch is re-opened (history again) after an error.
async fn keep_watching(
    bucket: &kv::Store,
    what: &str,
    stop: &CancellationToken,
    current: &CancellationToken,
    mut apply: impl FnMut(&kv::Entry),
) {
    loop {
        let empty = bucket.status().await.is_ok_and(|s| s.values() == 0);
        match bucket.watch_with_history(">").await {
            Ok(mut w) => {
                if empty {
                    current.cancel();
                }
                loop {
                    tokio::select! {
                        _ = stop.cancelled() => return,
                        e = w.next() => match e {
                            Some(Ok(entry)) => {
                                apply(&entry);
                                if entry.delta == 0 {
                                    current.cancel();
                                }
                            }
                            Some(Err(e)) => { debug!("{what} watch error: {e}"); break; }
                            None => break,
                        }
                    }
                }
            }
            Err(e) => debug!("cannot watch the {what} bucket: {e}"),
        }
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(Duration::from_secs(1)) => {}
        }
    }
}

/// Keep the set of cancel keys, and stop running tasks whose id is put.
async fn watch_cancels(sh: Arc<Shared>, stop: CancellationToken, current: CancellationToken) {
    let max_age = sh
        .infra
        .cancel
        .status()
        .await
        .map(|s| s.max_age())
        .unwrap_or(Duration::ZERO);
    keep_watching(&sh.infra.cancel, "cancel", &stop, &current, |entry| {
        if entry.operation != kv::Operation::Put {
            sh.cancels.lock().unwrap().remove(&entry.key);
            return;
        }
        // An expired key whose removal the watch did not see (no limit
        // markers on this bucket) must not cancel a later task.
        let age = time::OffsetDateTime::now_utc() - entry.created;
        if !max_age.is_zero() && age > max_age {
            return;
        }
        let reason = String::from_utf8_lossy(&entry.value).trim().to_string();
        sh.cancels
            .lock()
            .unwrap()
            .insert(entry.key.clone(), reason.clone());
        let reason = if reason.is_empty() {
            "cancelled by operator".to_string()
        } else {
            reason
        };
        if sh.running.stop(&entry.key, StopKind::Cancelled, &reason) {
            info!(task_id = %entry.key, %reason, "cancelling running task");
        }
    })
    .await
}

/// Keep the heartbeats of the online workers (who serves which types, and
/// whose claims are abandoned).
async fn watch_workers(sh: Arc<Shared>, stop: CancellationToken, current: CancellationToken) {
    keep_watching(&sh.infra.workers, "workers", &stop, &current, |entry| {
        let mut m = sh.workers.lock().unwrap();
        if entry.operation != kv::Operation::Put {
            m.remove(&entry.key);
        } else if let Ok(h) = serde_json::from_slice::<Heartbeat>(&entry.value) {
            m.insert(entry.key.clone(), h);
        }
    })
    .await
}

/// Deliver what an earlier life of this worker left in the outbox, through
/// the same loop as a live result: a stale entry is refused by the
/// compare-and-set and dropped.
async fn replay_outbox(sh: Arc<Shared>) {
    let pending = sh.outbox.pending();
    if pending.is_empty() {
        return;
    }
    sh.outbox_changed();
    info!(entries = pending.len(), "delivering the outbox");
    for (path, entry) in pending {
        outbox::deliver(&sh, &entry, Some(path)).await;
    }
    sh.outbox_changed();
}
