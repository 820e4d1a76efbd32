//! The worker daemon: start-up (connect, check the server, create the
//! streams, consumers and buckets), one puller per label that never leases
//! more messages than free slots, the per-task handler ([`task`]),
//! heartbeats, the cancel watcher, lease-loss detection, the outbox, and the
//! drain on shutdown (DESIGN.md sections 1, 5 and 6).
//!
//! Shutdown: the `shutdown` token stops the pullers; running tasks get
//! `drain_timeout` to finish; the rest are stopped and Nak'ed for immediate
//! redelivery; the heartbeat key is deleted; the connection is flushed.

mod heartbeat;
pub mod outbox;
mod task;

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use async_nats::jetstream::{self, consumer::PullConsumer, AckKind};
use chrono::{DateTime, Utc};
use futures::StreamExt;
use rand::Rng;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{debug, error, info, warn};

use crate::config::{LeaseLost, WorkerConfig};
use crate::metrics::Metrics;
use crate::protocol::{Names, TaskType, ValidationLimits};
use crate::runner::{self, Runners, Stop, StopKind};
use crate::setup::{self, Infra, SetupOptions};

/// How long one pull request waits at the server for messages.
const PULL_EXPIRES: Duration = Duration::from_secs(2);
/// Room left in a result message for everything but the output.
const RESULT_OVERHEAD: usize = 16 * 1024;

/// Connection state, fed by the client's event callback; used to detect a
/// lost lease and for `/readyz`.
#[derive(Default)]
pub struct ConnState {
    connected: AtomicBool,
    disconnected_at: Mutex<Option<Instant>>,
}

impl ConnState {
    fn on_event(&self, e: &async_nats::Event) {
        match e {
            async_nats::Event::Connected => {
                self.connected.store(true, Ordering::SeqCst);
                *self.disconnected_at.lock().unwrap() = None;
                info!("connected to NATS");
            }
            async_nats::Event::Disconnected => {
                self.connected.store(false, Ordering::SeqCst);
                self.disconnected_at
                    .lock()
                    .unwrap()
                    .get_or_insert_with(Instant::now);
                warn!("disconnected from NATS; reconnecting");
            }
            other => debug!(event = %other, "NATS event"),
        }
    }

    /// How long the worker has been cut off, if it is.
    pub fn cut_off_for(&self) -> Option<Duration> {
        self.disconnected_at.lock().unwrap().map(|t| t.elapsed())
    }

    pub fn is_connected(&self) -> bool {
        self.connected.load(Ordering::SeqCst)
    }
}

/// State shared by every part of one worker.
pub struct Shared {
    pub cfg: WorkerConfig,
    /// `<name>-<random>`, unique per process.
    pub id: String,
    pub hostname: String,
    pub client: async_nats::Client,
    pub js: jetstream::Context,
    pub names: Names,
    pub infra: Infra,
    pub runners: Runners,
    /// Types this worker runs (configured ∩ available).
    pub types: Vec<TaskType>,
    pub validation: ValidationLimits,
    /// Output cap after clamping to the server's max_payload.
    pub output_cap: u64,
    /// Largest message the server takes.
    pub max_payload: usize,
    /// The consumers' real ack wait (the smallest, if they differ).
    pub ack_wait: Duration,
    /// Running tasks by id, with the handle that stops each.
    running: Mutex<HashMap<String, Stop>>,
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
    /// The pipe that keeps the orphan watchdog waiting; closed on exit.
    watchdog: Mutex<Option<std::process::ChildStdin>>,
}

impl Shared {
    /// Register a running task; false if the same id already runs here.
    fn start_task(&self, id: &str, stop: Stop) -> bool {
        let mut m = self.running.lock().unwrap();
        if m.contains_key(id) {
            return false;
        }
        m.insert(id.to_string(), stop);
        self.metrics.running.set(m.len() as i64);
        true
    }

    fn end_task(&self, id: &str) {
        let mut m = self.running.lock().unwrap();
        m.remove(id);
        self.metrics.running.set(m.len() as i64);
    }

    /// Stop a running task (cancel watcher, shutdown, lease loss).
    fn stop_task(&self, id: &str, kind: StopKind, reason: &str) -> bool {
        match self.running.lock().unwrap().get(id) {
            Some(r) => {
                r.fire(kind, reason);
                true
            }
            None => false,
        }
    }

    fn stop_all(&self, kind: StopKind, reason: &str) -> usize {
        let m = self.running.lock().unwrap();
        for r in m.values() {
            r.fire(kind, reason);
        }
        m.len()
    }

    fn running_ids(&self) -> Vec<String> {
        let mut v: Vec<String> = self.running.lock().unwrap().keys().cloned().collect();
        v.sort();
        v
    }

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

/// Run a worker until `shutdown` fires, then drain and return.
pub async fn run(cfg: WorkerConfig, shutdown: CancellationToken) -> anyhow::Result<()> {
    crate::process::protect_secrets();
    let id = format!("{}-{}", cfg.name, random_suffix());
    let hostname = hostname::get()
        .ok()
        .and_then(|h| h.into_string().ok())
        .unwrap_or_else(|| "unknown".into());
    std::fs::create_dir_all(&cfg.state_dir)
        .with_context(|| format!("state_dir: cannot create {}", cfg.state_dir.display()))?;
    let _ = rustls::crypto::ring::default_provider().install_default();

    let conn = Arc::new(ConnState::default());
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
        Some(u) => Some(crate::process::resolve_user(u).map_err(anyhow::Error::msg)?),
        None => None,
    };
    let process = runner::command::ProcessRunner::new(
        cfg.shell.clone(),
        &cfg.pass_env,
        task_user,
        &cfg.state_dir,
        cfg.cgroups,
    )
    .context("state_dir: cannot prepare the working directories")?;
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
    let runners = Runners {
        process,
        http: runner::http::HttpRunner::new(cfg.deny_private_http)?,
        container: runner::container::ContainerRunner::new(
            cfg.docker_host.as_deref(),
            cfg.default_network.clone(),
            &id,
            &cfg.name,
        ),
    };
    let available = runners.available().await;
    let types: Vec<TaskType> = cfg
        .types
        .iter()
        .copied()
        .filter(|t| {
            let ok = available.contains(t) || cfg.types_explicit;
            if !ok {
                warn!(r#type = %t, "task type not available on this machine; not advertised");
            }
            ok
        })
        .collect();
    if types.contains(&TaskType::Container) {
        let removed = runners.container.remove_leftovers().await;
        if removed > 0 {
            warn!(
                containers = removed,
                "removed containers left by workers of this host that are gone"
            );
        }
    }

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
    let outbox =
        outbox::Outbox::open(&cfg.state_dir).context("state_dir: cannot open the outbox")?;
    let metrics = Arc::new(Metrics::new());
    let validation = ValidationLimits {
        max_task_bytes: cfg.max_task_bytes,
        allowed_networks: cfg.allowed_networks.clone(),
    };
    let sh = Arc::new(Shared {
        id: id.clone(),
        hostname,
        client: client.clone(),
        js,
        names,
        infra,
        runners,
        types,
        validation,
        output_cap,
        max_payload,
        ack_wait,
        running: Mutex::new(HashMap::new()),
        counts: Mutex::new(BTreeMap::new()),
        outbox,
        conn,
        metrics: metrics.clone(),
        started_at: Utc::now(),
        shutdown: shutdown.clone(),
        abandon: CancellationToken::new(),
        die_before_ack: std::env::var("JETWORKER_TEST_FAULT").as_deref() == Ok("die-before-ack"),
        watchdog: Mutex::new(watchdog),
        cfg,
    });
    info!(worker_id = %sh.id, labels = ?sh.cfg.labels, slots = sh.cfg.slots,
        types = ?sh.types.iter().map(|t| t.as_str()).collect::<Vec<_>>(),
        ack_wait = ?sh.ack_wait, "worker started");

    if let Some(addr) = sh.cfg.metrics_addr {
        let m = metrics.clone();
        tokio::spawn(async move {
            if let Err(e) = crate::metrics::serve(addr, m).await {
                error!(%addr, "metrics endpoint failed: {e:#}");
            }
        });
    }

    let background = CancellationToken::new();
    let hb = tokio::spawn(heartbeat::beat(sh.clone(), background.clone()));
    tokio::spawn(watch_cancels(sh.clone(), background.clone()));
    tokio::spawn(watch_lease(sh.clone(), background.clone()));
    // Results an earlier life left behind go out before any pulling, so a
    // redelivered task finds its result and is not run again.
    if tokio::time::timeout(
        Duration::from_secs(10),
        flush_outbox(sh.clone(), background.clone()),
    )
    .await
    .is_err()
    {
        warn!("outbox not empty after 10s; publishing it in the background");
        tokio::spawn(flush_outbox(sh.clone(), background.clone()));
    }

    let tracker = TaskTracker::new();
    let sem = Arc::new(Semaphore::new(sh.cfg.slots));
    let per_pull = (sh.cfg.slots / consumers.len()).clamp(1, 64);
    let mut pullers = Vec::new();
    for (label, consumer) in consumers {
        pullers.push(tokio::spawn(pull_loop(
            sh.clone(),
            label,
            consumer,
            sem.clone(),
            tracker.clone(),
            per_pull,
        )));
    }
    metrics.ready.store(true, Ordering::Relaxed);

    shutdown.cancelled().await;
    metrics.ready.store(false, Ordering::Relaxed);
    info!(
        running = sh.running_ids().len(),
        "stopping: no new tasks; draining"
    );
    // A puller finishes its current pull (at most PULL_EXPIRES); one stuck
    // on a dead connection is abandoned: what it may still receive is
    // redelivered after ack wait.
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
    if tokio::time::timeout(sh.cfg.drain_timeout, tracker.wait())
        .await
        .is_err()
    {
        let n = sh.stop_all(StopKind::Shutdown, "worker shutting down");
        warn!(
            tasks = n,
            "drain timeout reached: stopping the remaining tasks for redelivery"
        );
        // They need the kill grace, then a moment to Nak.
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
    sh.watchdog.lock().unwrap().take();
    sh.runners.process.cleanup();
    info!(worker_id = %sh.id, "worker stopped");
    Ok(())
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

/// Connect, check the server, create or check streams, buckets and the
/// label consumers.
async fn start_up(cfg: &WorkerConfig, id: &str, conn: Arc<ConnState>) -> anyhow::Result<StartUp> {
    let c2 = conn.clone();
    let client =
        crate::connect::connect_worker(&cfg.connect, id, Arc::new(move |e| c2.on_event(&e)))
            .await?;
    conn.connected.store(true, Ordering::SeqCst);
    crate::connect::check_server(&client)?;
    let js = jetstream::ContextBuilder::new()
        .timeout(Duration::from_secs(10))
        .build(client.clone());
    let names = cfg.connect.names.clone();
    let opts = SetupOptions {
        offline_after: cfg.offline_after,
        ..Default::default()
    };
    let infra = setup::ensure_all(&js, &names, &opts).await?;
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
        let mut c = setup::ensure_label_consumer(&infra.tasks, &names, label, cfg.ack_wait).await?;
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

    Ok(StartUp {
        client,
        js,
        names,
        infra,
        consumers,
        ack_wait,
    })
}

/// Pull from one label's consumer, never leasing more than free slots.
async fn pull_loop(
    sh: Arc<Shared>,
    label: String,
    mut consumer: PullConsumer,
    sem: Arc<Semaphore>,
    tracker: TaskTracker,
    per_pull: usize,
) {
    let mut failures = 0u32;
    loop {
        let first = tokio::select! {
            p = sem.clone().acquire_owned() => p.expect("semaphore open"),
            _ = sh.shutdown.cancelled() => return,
        };
        let mut permits = vec![first];
        while permits.len() < per_pull {
            match sem.clone().try_acquire_owned() {
                Ok(p) => permits.push(p),
                Err(_) => break,
            }
        }
        let batch = consumer
            .fetch()
            .max_messages(permits.len())
            .expires(PULL_EXPIRES)
            .messages()
            .await;
        let mut batch = match batch {
            Ok(b) => {
                failures = 0;
                b
            }
            Err(e) => {
                failures += 1;
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
                        consumer = c;
                    }
                }
                continue;
            }
        };
        while let Some(item) = batch.next().await {
            match item {
                Ok(msg) => {
                    if sh.shutdown.is_cancelled() {
                        // Arrived after we stopped: hand it straight back.
                        let _ = msg.ack_with(AckKind::Nak(None)).await;
                        continue;
                    }
                    let Some(permit) = permits.pop() else {
                        // The server sent more than asked: give it back.
                        let _ = msg.ack_with(AckKind::Nak(None)).await;
                        continue;
                    };
                    let sh = sh.clone();
                    let label = label.clone();
                    tracker.spawn(async move {
                        task::handle(sh, label, msg).await;
                        drop(permit);
                    });
                }
                Err(e) => {
                    debug!(label, "pull batch ended: {e}");
                    break;
                }
            }
        }
    }
}

/// Watch KV `cancel` and stop running tasks whose id is put there.
async fn watch_cancels(sh: Arc<Shared>, stop: CancellationToken) {
    loop {
        match sh.infra.cancel.watch_all().await {
            Ok(mut w) => loop {
                tokio::select! {
                    _ = stop.cancelled() => return,
                    e = w.next() => match e {
                        Some(Ok(entry)) if entry.operation == async_nats::jetstream::kv::Operation::Put => {
                            let reason = String::from_utf8_lossy(&entry.value).trim().to_string();
                            let reason = if reason.is_empty() { "cancelled by operator".to_string() } else { reason };
                            if sh.stop_task(&entry.key, StopKind::Cancelled, &reason) {
                                info!(task_id = %entry.key, %reason, "cancelling running task");
                            }
                        }
                        Some(Ok(_)) => {}
                        Some(Err(e)) => { debug!("cancel watch error: {e}"); break; }
                        None => break,
                    }
                }
            },
            Err(e) => debug!("cannot watch the cancel bucket: {e}"),
        }
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(Duration::from_secs(1)) => {}
        }
    }
}

/// When cut off from NATS for longer than ack wait, the broker hands our
/// tasks to other workers: stop our copies (unless configured to keep them).
async fn watch_lease(sh: Arc<Shared>, stop: CancellationToken) {
    let mut tick = tokio::time::interval(Duration::from_millis(250));
    let mut fired = false;
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tick.tick() => {}
        }
        match sh.conn.cut_off_for() {
            Some(d) if d > sh.ack_wait => {
                if !fired && sh.cfg.on_lease_lost == LeaseLost::Kill {
                    let n = sh.stop_all(
                        StopKind::LeaseLost,
                        &format!(
                            "lease lost: cut off from NATS for more than ack wait ({})",
                            humantime::format_duration(sh.ack_wait)
                        ),
                    );
                    if n > 0 {
                        warn!(tasks = n, "lease lost: stopping running tasks (they will be redelivered elsewhere)");
                    }
                }
                fired = true;
            }
            Some(_) => {}
            None => fired = false,
        }
    }
}

/// Publish entries an earlier life of this worker left in the outbox.
async fn flush_outbox(sh: Arc<Shared>, stop: CancellationToken) {
    let pending = sh.outbox.pending();
    if pending.is_empty() {
        return;
    }
    info!(
        entries = pending.len(),
        "publishing results left in the outbox"
    );
    for (path, entry) in pending {
        let mut delay = Duration::from_millis(200);
        loop {
            match entry.publish(&sh.js).await {
                Ok(()) => {
                    sh.outbox.remove(&path);
                    break;
                }
                Err(e) => debug!(subject = %entry.subject, "outbox publish failed: {e:#}"),
            }
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tokio::time::sleep(delay) => {}
            }
            delay = (delay * 2).min(Duration::from_secs(5));
        }
    }
    sh.metrics.outbox.set(sh.outbox.len() as i64);
}
