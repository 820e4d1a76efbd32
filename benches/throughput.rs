//! End to end through a real nats-server and a worker running in this
//! process (`jetworker::worker::run`, the daemon's own entry point):
//!
//! - **throughput**: N tasks (`{"type":"command","command":"true"}`, then
//!   `{"type":"shell","payload":"true"}`, each with its own id) published
//!   as fast as the server takes them while the worker runs; tasks/s is N
//!   over the time from the first publish to the last final result seen on
//!   `results.>`. Every result must be a final `success`.
//! - **latency**: a trickle of tasks sent one at a time, each published
//!   only after the previous one's result arrived; p50/p99/max of publish →
//!   result on `results.<id>`.
//! - **peak RSS** (`VmHWM`) of this process — worker, bench client and
//!   runtime, not the task processes — per slots setting (reset through
//!   `/proc/self/clear_refs` before each) and overall.
//!
//! Both are run for a worker with 2 and with 8 slots (a fresh worker each,
//! same server). Publisher, worker, server and task processes share the
//! machine, as they would on a single host; the worker and the bench share
//! one 2-thread tokio runtime.
//!
//! Run: `cargo bench --bench throughput` (needs `nats-server` on PATH or
//! `NATS_SERVER_BIN`). Settings (environment): `BENCH_TASKS` (default
//! 5000), `BENCH_TRICKLE` (200).

mod common;

use std::time::{Duration, Instant};

use async_nats::jetstream;
use futures::StreamExt;
use jetworker::config::WorkerConfig;
use jetworker::protocol::{Names, Status, TaskResult};
use tokio_util::sync::CancellationToken;

/// Slots settings compared.
const SLOTS: [usize; 2] = [2, 8];
/// Longest wait for one batch or one trickle task before the bench gives up.
const GIVE_UP: Duration = Duration::from_secs(600);

/// The two task kinds, as JSON without the id.
const KINDS: [(&str, &str); 2] = [
    ("command", r#""type":"command","command":"true""#),
    ("shell", r#""type":"shell","payload":"true""#),
];

/// A worker running in this process; drained on [`Worker::stop`].
struct Worker {
    token: CancellationToken,
    handle: tokio::task::JoinHandle<anyhow::Result<()>>,
    _state: tempfile::TempDir,
}

impl Worker {
    async fn start(url: &str, js: &jetstream::Context, slots: usize) -> Self {
        let state = tempfile::tempdir().unwrap();
        let mut cfg = WorkerConfig::for_server(url, state.path());
        cfg.slots = slots;
        cfg.heartbeat = Duration::from_millis(500);
        cfg.offline_after = Duration::from_secs(3);
        cfg.drain_timeout = Duration::from_secs(10);
        cfg.name = format!("bench-s{slots}");
        let prefix = format!("{}-", cfg.name);
        let token = CancellationToken::new();
        let handle = tokio::spawn(jetworker::worker::run(cfg, token.clone()));
        // Ready once its first heartbeat is stored; the pullers start right
        // after that.
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            assert!(!handle.is_finished(), "the worker exited during start-up");
            if let Ok(kv) = js.get_key_value(&Names::default().workers_bucket).await {
                if let Ok(keys) = kv.keys().await {
                    let keys: Vec<String> = keys.filter_map(|k| async { k.ok() }).collect().await;
                    if keys.iter().any(|k| k.starts_with(&prefix)) {
                        break;
                    }
                }
            }
            assert!(Instant::now() < deadline, "worker did not start in 30s");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
        Worker {
            token,
            handle,
            _state: state,
        }
    }

    async fn stop(self) {
        self.token.cancel();
        self.handle
            .await
            .expect("worker task panicked")
            .expect("worker failed");
    }
}

/// Final results of ids starting with a prefix, read from a `results.>`
/// subscription made before anything is published.
struct Results {
    sub: async_nats::Subscriber,
    results_prefix: String,
}

impl Results {
    async fn subscribe(client: &async_nats::Client) -> Self {
        let names = Names::default();
        let sub = client
            .subscribe(format!("{}.>", names.results_prefix))
            .await
            .unwrap();
        client.flush().await.unwrap();
        Results {
            sub,
            results_prefix: format!("{}.", names.results_prefix),
        }
    }

    /// The next final result whose id starts with `id_prefix`; every such
    /// result must be a success.
    async fn next_final(&mut self, id_prefix: &str) -> TaskResult {
        let want = format!("{}{id_prefix}", self.results_prefix);
        loop {
            let msg = tokio::time::timeout(GIVE_UP, self.sub.next())
                .await
                .unwrap_or_else(|_| panic!("no result for {id_prefix}* within {GIVE_UP:?}"))
                .expect("results subscription ended");
            if !msg.subject.as_str().starts_with(&want) {
                continue;
            }
            let r: TaskResult = serde_json::from_slice(&msg.payload).expect("result JSON");
            assert!(
                r.status == Status::Success,
                "task {} ended {:?}: {:?}",
                r.id,
                r.status,
                r.error
            );
            if r.is_final {
                return r;
            }
        }
    }
}

fn task_json(kind: &str, id: &str) -> bytes::Bytes {
    format!(r#"{{{kind},"id":"{id}"}}"#).into()
}

/// Publish `n` tasks at once (up to 256 acks in flight), then wait for all
/// their final results. Returns (tasks/s, seconds the publishing took).
async fn throughput(
    js: &jetstream::Context,
    results: &mut Results,
    kind: &str,
    prefix: &str,
    n: usize,
) -> (f64, f64) {
    let subject = Names::default().task_subject("default");
    let start = Instant::now();
    futures::stream::iter(0..n)
        .map(|i| {
            let payload = task_json(kind, &format!("{prefix}{i:06}"));
            let subject = subject.clone();
            async move {
                js.publish(subject, payload)
                    .await
                    .expect("publish")
                    .await
                    .expect("publish ack")
            }
        })
        .buffer_unordered(256)
        .for_each(|_| async {})
        .await;
    let published = start.elapsed().as_secs_f64();
    let mut seen = std::collections::HashSet::with_capacity(n);
    while seen.len() < n {
        seen.insert(results.next_final(prefix).await.id);
    }
    (n as f64 / start.elapsed().as_secs_f64(), published)
}

/// Publish → final result, one task at a time; sorted latencies.
async fn trickle(
    js: &jetstream::Context,
    results: &mut Results,
    kind: &str,
    prefix: &str,
    n: usize,
) -> Vec<Duration> {
    let subject = Names::default().task_subject("default");
    let mut lat = Vec::with_capacity(n);
    for i in 0..n {
        let id = format!("{prefix}{i:06}");
        let start = Instant::now();
        js.publish(subject.clone(), task_json(kind, &id))
            .await
            .expect("publish")
            .await
            .expect("publish ack");
        let r = results.next_final(prefix).await;
        lat.push(start.elapsed());
        assert_eq!(r.id, id, "results arrived out of order");
    }
    lat.sort();
    lat
}

/// Wait until the TASKS stream is empty (every task acked).
async fn wait_tasks_empty(js: &jetstream::Context) {
    let mut stream = js.get_stream(&Names::default().tasks_stream).await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while stream.info().await.unwrap().state.messages > 0 {
        assert!(
            Instant::now() < deadline,
            "TASKS not empty 30s after the last result"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let n = common::env_usize("BENCH_TASKS", 5000);
    let n_trickle = common::env_usize("BENCH_TRICKLE", 200);
    let server = common::NatsServer::start();
    let client = async_nats::connect(server.url()).await.unwrap();
    let js = jetstream::new(client.clone());
    let mut results = Results::subscribe(&client).await;
    let run = std::process::id();
    let mut overall_peak: f64 = 0.0;

    println!(
        "throughput: {n} tasks per batch, trickle of {n_trickle}; {} CPUs",
        std::thread::available_parallelism().map_or(0, |p| p.get())
    );
    println!(
        "{:>5}  {:<7}  {:>8}  {:>10}  {:>9}  {:>9}  {:>9}",
        "slots", "type", "tasks/s", "publish s", "p50 ms", "p99 ms", "max ms"
    );
    for slots in SLOTS {
        let can_reset = common::reset_peak_rss();
        let worker = Worker::start(&server.url(), &js, slots).await;
        for (kind_name, kind) in KINDS {
            let prefix = format!("b{run}-s{slots}-{kind_name}-");
            let (rate, published) = throughput(&js, &mut results, kind, &prefix, n).await;
            wait_tasks_empty(&js).await;
            let prefix = format!("t{run}-s{slots}-{kind_name}-");
            let lat = trickle(&js, &mut results, kind, &prefix, n_trickle).await;
            println!(
                "{slots:>5}  {kind_name:<7}  {rate:>8.0}  {published:>10.2}  {:>9.1}  {:>9.1}  {:>9.1}",
                ms(common::percentile(&lat, 50.0)),
                ms(common::percentile(&lat, 99.0)),
                ms(*lat.last().unwrap()),
            );
        }
        worker.stop().await;
        let peak = common::peak_rss_mib();
        overall_peak = overall_peak.max(peak);
        println!(
            "       peak RSS with {slots} slots: {peak:.1} MiB{}",
            if can_reset {
                ""
            } else {
                " (cannot reset VmHWM here: cumulative)"
            }
        );
    }
    println!("peak RSS of the bench process (VmHWM): {overall_peak:.1} MiB");
}
