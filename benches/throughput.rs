//! The JetStream path of the worker against a raw loop, in one run, through
//! a real nats-server:
//!
//! - **raw loop** (the reference): a minimal worker with no logic — pull
//!   (at most one message per free slot, 64 slots), publish a result of the
//!   same size as jetworker's to a file-backed results stream and wait for
//!   its PubAck, ack. Same task messages, same storage.
//! - **raw loop + HTTP** (the ceiling for `http` tasks): the same loop
//!   making the task's GET (one kept-alive client, as the worker's) before
//!   it publishes. No worker that stores a result and makes the request
//!   can go faster; its ratio to the raw loop bounds the `http` ratio.
//! - **raw loop + claim** (the floor of invariant I3): the same loop
//!   writing a `running` record of the same size first and awaiting its
//!   PubAck, as every worker that claims an id before running it must
//!   (DESIGN.md section 5); its ratio to the raw loop is what the claim
//!   alone costs, and bounds the no-op ratio of such a worker.
//! - **jetworker, trivial `http` tasks**: the daemon's own entry point
//!   (`jetworker::Worker::builder`) in this process with 64 slots, each
//!   task a GET to a local HTTP server that answers at once.
//! - **jetworker, no-op in-process tasks**: the same worker with a task
//!   type that is an async function returning at once
//!   (`runner::in_process::function`): the worker's own overhead, with no
//!   spawn and no request (issue 14: ≥ 60 % of the raw loop; p50 at
//!   100/s ≤ 2 × the raw p50).
//!
//! For each: **throughput** (N tasks published as fast as the server takes
//! them; tasks/s from the first publish to the last final result; raw,
//! http and no-op take turns for `BENCH_ROUNDS` rounds, and the ratios
//! printed are the medians of the per-round ratios, so that a change of
//! load on a shared machine moves both sides of a ratio) and
//! **latency** at a steady 100 tasks/s (p50/p99 of publish → final result
//! seen on `results.>`). Printed: the ratio jetworker / raw, and the
//! targets of DESIGN.md/BENCHMARKS.md (throughput ≥ 60 % of the raw loop;
//! p50 ≤ 2 × raw p50 + the HTTP request's own p50, measured here too).
//!
//! **CPU per task** in each throughput phase, of the nats-server and of
//! this process (the worker or the raw loop, with the harness), from
//! `/proc`: steadier than rates on a shared machine.
//!
//! **Round trips**: a wiretap subscription on `>` counts, per task, what the
//! worker sends on the critical path: writes to `results.<id>` (each waits
//! for a PubAck), reads of `results.<id>` (direct gets), and acks (not
//! awaited).
//!
//! Run: `cargo bench --bench throughput` (needs `nats-server` on PATH or
//! `NATS_SERVER_BIN`). Settings (environment): `BENCH_TASKS` (default
//! 5000), `BENCH_ROUNDS` (5), `BENCH_PACED` (300 tasks at 100/s), `BENCH_PERF_CTL` (a
//! `perf record --control fifo:<path>` control FIFO: the no-op throughput
//! phases alone are recorded, `perf record -D -1 --control fifo:ctl ...`).

mod common;

/// The daemon's allocator (src/main.rs), so that the worker in this process
/// runs as `jetworker run` does; the raw loop shares it.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::jetstream::{self, consumer::pull, stream};
use futures::StreamExt;
use jetworker::config::WorkerConfig;
use jetworker::protocol::{Names, Status, TaskResult};
use jetworker::runner::in_process::{function, NoFields, TaskContext};
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;

/// Slots of the raw loop and of the worker.
const SLOTS: usize = 64;
/// Longest wait for one result before the bench gives up.
const GIVE_UP: Duration = Duration::from_secs(600);
/// The paced load.
const RATE_PER_S: u64 = 100;
/// Where the "raw loop + HTTP" reference's tasks go.
const RAW_HTTP_SUBJECT: &str = "raw.tasks.http";
/// Where the "raw loop + claim" reference's tasks go.
const RAW_CLAIM_SUBJECT: &str = "raw.tasks.claim";

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
        cfg.deny_private_http = false;
        cfg.name = format!("bench-s{slots}");
        let prefix = format!("{}-", cfg.name);
        let token = CancellationToken::new();
        let noop = function("noop", |_: NoFields, _: TaskContext| async { Ok(()) });
        let handle = tokio::spawn(
            jetworker::Worker::builder()
                .config(cfg)
                .runner(noop)
                .run(token.clone()),
        );
        // Ready once its first heartbeat is stored; the pullers start right
        // after that.
        common::wait_heartbeat(js, &prefix).await;
        assert!(!handle.is_finished(), "the worker exited during start-up");
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

/// Where a path publishes its tasks and results, and which tasks.
#[derive(Clone)]
struct Path {
    name: &'static str,
    task_subject: String,
    results_prefix: String,
    /// `http` (a GET to the local server) or `noop` (in-process).
    kind: &'static str,
}

/// Final results on `<results_prefix>.>`, read from a subscription made
/// before anything is published.
struct Results {
    sub: async_nats::Subscriber,
}

impl Results {
    async fn subscribe(client: &async_nats::Client, path: &Path) -> Self {
        let sub = client
            .subscribe(format!("{}.>", path.results_prefix))
            .await
            .unwrap();
        client.flush().await.unwrap();
        Results { sub }
    }

    /// The next final result; every result of an attempt must be a success.
    async fn next_final(&mut self) -> Seen {
        loop {
            let msg = tokio::time::timeout(GIVE_UP, self.sub.next())
                .await
                .unwrap_or_else(|_| panic!("no result within {GIVE_UP:?}"))
                .expect("results subscription ended");
            let r: Seen = serde_json::from_slice(&msg.payload).expect("result JSON");
            if matches!(r.status, Status::Running | Status::Queued) {
                continue;
            }
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

/// What the bench reads of a record: what tells a final success, not the
/// whole record (the harness should cost both paths as little as it can;
/// jetworker's claims reach it too).
#[derive(serde::Deserialize)]
struct Seen {
    id: String,
    status: Status,
    #[serde(rename = "final")]
    is_final: bool,
    #[serde(default)]
    error: Option<String>,
}

fn task_json(kind: &str, url: &str, id: &str) -> bytes::Bytes {
    match kind {
        "noop" => format!(r#"{{"type":"noop","id":"{id}"}}"#).into(),
        _ => format!(r#"{{"type":"http","url":"{url}","id":"{id}"}}"#).into(),
    }
}

/// What one throughput phase measured.
struct Phase {
    /// Tasks/s.
    rate: f64,
    /// CPU per task, in µs, of the nats-server and of this process (the
    /// worker or the raw loop, and the harness that publishes and collects).
    server_us: f64,
    own_us: f64,
}

/// Publish `n` tasks at once (up to 256 acks in flight), then wait for all
/// their final results.
async fn throughput(
    js: &jetstream::Context,
    path: &Path,
    results: &mut Results,
    url: &str,
    prefix: &str,
    n: usize,
) -> Phase {
    let server = SERVER_PID.load(std::sync::atomic::Ordering::Relaxed);
    let cpu = || {
        (
            common::cpu_seconds(server),
            common::cpu_seconds(std::process::id()),
        )
    };
    let cpu0 = cpu();
    let start = Instant::now();
    futures::stream::iter(0..n)
        .map(|i| {
            let payload = task_json(path.kind, url, &format!("{prefix}{i:06}"));
            let subject = path.task_subject.clone();
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
    let mut seen = std::collections::HashSet::with_capacity(n);
    while seen.len() < n {
        seen.insert(results.next_final().await.id);
    }
    let rate = n as f64 / start.elapsed().as_secs_f64();
    let cpu1 = cpu();
    let per_task = |s: f64| s * 1e6 / n as f64;
    Phase {
        rate,
        server_us: per_task(cpu1.0 - cpu0.0),
        own_us: per_task(cpu1.1 - cpu0.1),
    }
}

/// The nats-server's pid, for [`throughput`]'s CPU figures.
static SERVER_PID: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);

/// Publish `n` tasks at a steady [`RATE_PER_S`]; sorted publish → final
/// result latencies.
async fn paced(
    js: &jetstream::Context,
    path: &Path,
    results: &mut Results,
    url: &str,
    prefix: &str,
    n: usize,
) -> Vec<Duration> {
    let sent: Arc<std::sync::Mutex<HashMap<String, Instant>>> = Default::default();
    let publisher = {
        let js = js.clone();
        let path = path.clone();
        let url = url.to_string();
        let prefix = prefix.to_string();
        let sent = sent.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_micros(1_000_000 / RATE_PER_S));
            for i in 0..n {
                tick.tick().await;
                let id = format!("{prefix}{i:06}");
                sent.lock().unwrap().insert(id.clone(), Instant::now());
                let ack = js
                    .publish(path.task_subject.clone(), task_json(path.kind, &url, &id))
                    .await
                    .expect("publish");
                tokio::spawn(async move { ack.await.expect("publish ack") });
            }
        })
    };
    let mut lat = Vec::with_capacity(n);
    while lat.len() < n {
        let r = results.next_final().await;
        let at = Instant::now();
        if let Some(t0) = sent.lock().unwrap().remove(&r.id) {
            lat.push(at - t0);
        }
    }
    publisher.await.unwrap();
    lat.sort();
    lat
}

/// Wait until a work-queue stream is empty (every task acked).
async fn wait_empty(js: &jetstream::Context, stream: &str) {
    let mut stream = js.get_stream(stream).await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while stream.info().await.unwrap().state.messages > 0 {
        assert!(
            Instant::now() < deadline,
            "stream not empty 30s after the last result"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The reference: pull → read the task's id → publish a result of the same
/// shape and size as jetworker's (await the PubAck) → ack, with at most one
/// message per free slot, until `stop`.
///
/// A task published on `raw.tasks.http` is also fetched from its `url`
/// first (the "raw loop + HTTP" reference); one on `raw.tasks.claim` gets a
/// `running` record first, its PubAck awaited (the "raw loop + claim"
/// reference).
async fn raw_loop(
    js: jetstream::Context,
    consumer: jetstream::consumer::PullConsumer,
    sample: TaskResult,
    stop: CancellationToken,
) {
    #[derive(serde::Deserialize)]
    struct Id {
        id: String,
        #[serde(default)]
        url: String,
    }
    let http = reqwest_client();
    let sample = Arc::new(sample);
    let sem = Arc::new(Semaphore::new(SLOTS));
    while !stop.is_cancelled() {
        let first = sem.clone().acquire_owned().await.unwrap();
        let mut permits = vec![first];
        while let Ok(p) = sem.clone().try_acquire_owned() {
            permits.push(p);
        }
        let Ok(mut batch) = consumer
            .fetch()
            .max_messages(permits.len())
            .expires(Duration::from_millis(500))
            .messages()
            .await
        else {
            continue;
        };
        while let Some(Ok(msg)) = batch.next().await {
            let Some(permit) = permits.pop() else { break };
            let js = js.clone();
            let sample = sample.clone();
            let http = http.clone();
            tokio::spawn(async move {
                let Id { id, url } = serde_json::from_slice::<Id>(&msg.payload).unwrap();
                let mut r = (*sample).clone();
                r.idempotency_key = Some(id.clone());
                r.id = id;
                // Publish a record and wait for its PubAck.
                let store = |r: &TaskResult| {
                    let body = bytes::Bytes::from(serde_json::to_vec(r).unwrap());
                    let (js, subject) = (js.clone(), format!("raw.results.{}", r.id));
                    async move {
                        js.publish(subject, body)
                            .await
                            .expect("publish a record")
                            .await
                            .expect("a record's PubAck");
                    }
                };
                if msg.subject.as_str() == RAW_CLAIM_SUBJECT {
                    let mut claim = r.clone();
                    claim.status = Status::Running;
                    claim.is_final = false;
                    store(&claim).await;
                }
                if msg.subject.as_str() == RAW_HTTP_SUBJECT {
                    let r = http.get(&url).send().await.expect("GET");
                    let _ = r.bytes().await.expect("GET body");
                }
                store(&r).await;
                let _ = msg.ack().await;
                drop(permit);
            });
        }
    }
}

/// Set up the raw loop's streams and consumer (file storage, like TASKS and
/// RESULTS).
async fn raw_setup(js: &jetstream::Context) -> jetstream::consumer::PullConsumer {
    let tasks = js
        .create_stream(stream::Config {
            name: "RAW".into(),
            subjects: vec!["raw.tasks.>".into()],
            retention: stream::RetentionPolicy::WorkQueue,
            storage: stream::StorageType::File,
            ..Default::default()
        })
        .await
        .unwrap();
    js.create_stream(stream::Config {
        name: "RAWRES".into(),
        subjects: vec!["raw.results.>".into()],
        storage: stream::StorageType::File,
        allow_direct: true,
        ..Default::default()
    })
    .await
    .unwrap();
    tasks
        .create_consumer(pull::Config {
            durable_name: Some("raw".into()),
            ack_policy: jetstream::consumer::AckPolicy::Explicit,
            ack_wait: Duration::from_secs(30),
            max_ack_pending: 10_000,
            ..Default::default()
        })
        .await
        .unwrap()
}

/// A local HTTP server that answers every GET at once; its URL.
async fn http_server() -> String {
    let app = axum::Router::new().route("/", axum::routing::get(|| async { "ok" }));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    format!("http://{addr}/")
}

/// p50 of the HTTP request alone (a client kept alive, as the worker's is).
async fn http_p50(url: &str, n: usize) -> Duration {
    let client = reqwest_client();
    let mut lat = Vec::with_capacity(n);
    for _ in 0..n {
        let t0 = Instant::now();
        let r = client.get(url).send().await.unwrap();
        let _ = r.bytes().await.unwrap();
        lat.push(t0.elapsed());
    }
    lat.sort();
    common::percentile(&lat, 50.0)
}

fn reqwest_client() -> reqwest::Client {
    let _ = rustls::crypto::ring::default_provider().install_default();
    reqwest::Client::builder().build().unwrap()
}

/// Messages the worker sent per task, by kind, from a wiretap on `>`.
#[derive(Default, Debug)]
struct Tap {
    result_writes: usize,
    result_reads: usize,
    acks: usize,
    progress: usize,
}

async fn wiretap(client: &async_nats::Client) -> (Arc<std::sync::Mutex<Tap>>, CancellationToken) {
    let mut sub = client.subscribe(">").await.unwrap();
    client.flush().await.unwrap();
    let tap: Arc<std::sync::Mutex<Tap>> = Default::default();
    let stop = CancellationToken::new();
    let (t, s) = (tap.clone(), stop.clone());
    tokio::spawn(async move {
        loop {
            let m = tokio::select! {
                m = sub.next() => match m { Some(m) => m, None => return },
                _ = s.cancelled() => return,
            };
            let subj = m.subject.as_str();
            let mut t = t.lock().unwrap();
            if subj.starts_with("results.") {
                t.result_writes += 1;
            } else if subj.starts_with("$JS.API.DIRECT.GET.RESULTS")
                || subj.starts_with("$JS.API.STREAM.MSG.GET.RESULTS")
            {
                t.result_reads += 1;
            } else if subj.starts_with("$JS.ACK.TASKS.") {
                if m.payload.starts_with(b"+WPI") {
                    t.progress += 1;
                } else {
                    t.acks += 1;
                }
            }
        }
    });
    (tap, stop)
}

/// Switch `perf record` on or off through its control FIFO
/// (`BENCH_PERF_CTL`), so that a profile holds one phase.
fn perf_ctl(cmd: &str) {
    if let Ok(path) = std::env::var("BENCH_PERF_CTL") {
        std::fs::write(&path, format!("{cmd}\n"))
            .unwrap_or_else(|e| panic!("BENCH_PERF_CTL={path}: {e}"));
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let n = common::env_usize("BENCH_TASKS", 5000);
    let n_paced = common::env_usize("BENCH_PACED", 300);
    let rounds = common::env_usize("BENCH_ROUNDS", 5);
    let server = common::NatsServer::start();
    SERVER_PID.store(
        server.pid().expect("the server runs"),
        std::sync::atomic::Ordering::Relaxed,
    );
    let client = async_nats::connect(server.url()).await.unwrap();
    let js = jetstream::new(client.clone());
    let url = http_server().await;
    let run = std::process::id();
    println!(
        "throughput: {n} tasks per batch, {rounds} rounds (raw, raw + HTTP, raw + claim, http, \
         no-op in turn), \
         {n_paced} paced at {RATE_PER_S}/s, {SLOTS} slots; {} CPUs",
        std::thread::available_parallelism().map_or(0, |p| p.get())
    );

    // The reference.
    let raw = Path {
        name: "raw loop",
        task_subject: "raw.tasks.default".into(),
        results_prefix: "raw.results".into(),
        kind: "http",
    };
    let raw_http = Path {
        name: "raw loop + HTTP",
        task_subject: RAW_HTTP_SUBJECT.into(),
        ..raw.clone()
    };
    let raw_claim = Path {
        name: "raw loop + claim",
        task_subject: RAW_CLAIM_SUBJECT.into(),
        ..raw.clone()
    };
    let consumer = raw_setup(&js).await;
    let sample = {
        let mut r = TaskResult::blank(
            "b000000-http-000000",
            "default",
            Some("http".into()),
            Status::Success,
            1,
            3,
            "bench-s64-0123abcd",
            chrono::Utc::now(),
        );
        r.http_status = Some(200);
        r.output = "ok".into();
        r.output_bytes = 2;
        r.idempotency_key = Some(r.id.clone());
        r.task_seq = Some(1);
        r
    };
    let stop_raw = CancellationToken::new();
    let raw_task = tokio::spawn(raw_loop(js.clone(), consumer, sample, stop_raw.clone()));
    let mut raw_results = Results::subscribe(&client, &raw).await;

    // jetworker, running all along: the raw loop and the worker take turns
    // on the same machine, round after round, so that a change of load on
    // this shared machine moves both sides of a ratio.
    let worker_path = Path {
        name: "jetworker http",
        task_subject: Names::default().task_subject("default"),
        results_prefix: Names::default().results_prefix,
        kind: "http",
    };
    let noop_path = Path {
        name: "jetworker noop",
        kind: "noop",
        ..worker_path.clone()
    };
    let tasks_stream = Names::default().tasks_stream;
    let can_reset = common::reset_peak_rss();
    let worker = Worker::start(&server.url(), &js, SLOTS).await;
    let mut results = Results::subscribe(&client, &worker_path).await;

    let (mut raw_rates, mut rates, mut noop_rates) = (vec![], vec![], vec![]);
    let (mut raw_http_rates, mut raw_claim_rates) = (vec![], vec![]);
    // CPU µs per task (server, this process) of each path, per round.
    let mut cpu: [Vec<(f64, f64)>; 5] = Default::default();
    for round in 0..rounds {
        // The references on RAW, then jetworker on TASKS; the perf control
        // FIFO (if any) records the no-op phase alone.
        let mut phases = Vec::with_capacity(5);
        for (path, tag) in [
            (&raw, "r"),
            (&raw_http, "rh"),
            (&raw_claim, "rc"),
            (&worker_path, "b"),
            (&noop_path, "n"),
        ] {
            let on_raw = path.results_prefix == raw.results_prefix;
            let (res, stream) = if on_raw {
                (&mut raw_results, "RAW")
            } else {
                (&mut results, tasks_stream.as_str())
            };
            let noop = path.kind == noop_path.kind;
            if noop {
                perf_ctl("enable");
            }
            let prefix = format!("{tag}{run}-{round}-");
            phases.push(throughput(&js, path, res, &url, &prefix, n).await);
            if noop {
                perf_ctl("disable");
            }
            wait_empty(&js, stream).await;
        }
        let [r, rh, rc, h, z]: [Phase; 5] = phases.try_into().ok().expect("five phases");
        for (i, p) in [&r, &rh, &rc, &h, &z].into_iter().enumerate() {
            cpu[i].push((p.server_us, p.own_us));
        }
        let (r, rh, rc, h, z) = (r.rate, rh.rate, rc.rate, h.rate, z.rate);
        println!(
            "round {}: raw {r:.0}/s, raw + HTTP {rh:.0}/s ({:.0} %), raw + claim {rc:.0}/s ({:.0} %), \
             http {h:.0}/s ({:.0} %), no-op {z:.0}/s ({:.0} %)",
            round + 1,
            100.0 * rh / r,
            100.0 * rc / r,
            100.0 * h / r,
            100.0 * z / r
        );
        raw_rates.push(r);
        raw_http_rates.push(rh);
        raw_claim_rates.push(rc);
        rates.push(h);
        noop_rates.push(z);
    }

    let raw_lat = paced(
        &js,
        &raw,
        &mut raw_results,
        &url,
        &format!("rp{run}-"),
        n_paced,
    )
    .await;
    stop_raw.cancel();
    let _ = raw_task.await;
    drop(raw_results);
    let (tap, stop_tap) = wiretap(&client).await;
    let lat = paced(
        &js,
        &worker_path,
        &mut results,
        &url,
        &format!("p{run}-"),
        n_paced,
    )
    .await;
    wait_empty(&js, &tasks_stream).await;
    stop_tap.cancel();
    let noop_lat = paced(
        &js,
        &noop_path,
        &mut results,
        &url,
        &format!("np{run}-"),
        n_paced,
    )
    .await;
    wait_empty(&js, &tasks_stream).await;
    worker.stop().await;
    let peak = common::peak_rss_mib();
    let http = http_p50(&url, 500).await;

    println!(
        "{:<16}  {:>8}  {:>9}  {:>9}  {:>9}",
        "path", "tasks/s", "p50 ms", "p99 ms", "max ms"
    );
    for (name, rates, lat) in [
        (raw.name, &raw_rates, &raw_lat),
        (worker_path.name, &rates, &lat),
        (noop_path.name, &noop_rates, &noop_lat),
    ] {
        println!(
            "{name:<16}  {:>8.0}  {:>9.2}  {:>9.2}  {:>9.2}",
            common::median(rates),
            ms(common::percentile(lat, 50.0)),
            ms(common::percentile(lat, 99.0)),
            ms(*lat.last().unwrap()),
        );
    }
    println!(
        "CPU per task in the throughput phases (median of {rounds} rounds, µs): \
         nats-server / this process (worker or raw loop, and the harness)"
    );
    for (name, c) in [
        (raw.name, &cpu[0]),
        (raw_http.name, &cpu[1]),
        (raw_claim.name, &cpu[2]),
        (worker_path.name, &cpu[3]),
        (noop_path.name, &cpu[4]),
    ] {
        let server: Vec<f64> = c.iter().map(|x| x.0).collect();
        let own: Vec<f64> = c.iter().map(|x| x.1).collect();
        println!(
            "  {name:<16}  {:>6.0} / {:>6.0}",
            common::median(&server),
            common::median(&own)
        );
    }
    // Per-round percentages of `of` against `to`.
    let pct = |of: &[f64], to: &[f64]| -> Vec<f64> {
        of.iter().zip(to).map(|(x, r)| 100.0 * x / r).collect()
    };
    let ratios = |of: &[f64]| pct(of, &raw_rates);
    let (http_ratios, noop_ratios) = (ratios(&rates), ratios(&noop_rates));
    let raw_p50 = common::percentile(&raw_lat, 50.0);
    let p50 = common::percentile(&lat, 50.0);
    let limit = raw_p50 * 2 + http;
    let ceiling = ratios(&raw_http_rates);
    let of_ceiling = pct(&rates, &raw_http_rates);
    println!(
        "throughput ratio jetworker/raw: {:.0} % (median of {rounds} rounds, {}; target ≥ 60 %)",
        common::median(&http_ratios),
        spread(&http_ratios)
    );
    println!(
        "  ceiling: raw loop + HTTP / raw = {:.0} % ({}): no worker that makes the request \
         and stores a result goes faster; jetworker http = {:.0} % of it ({})",
        common::median(&ceiling),
        spread(&ceiling),
        common::median(&of_ceiling),
        spread(&of_ceiling)
    );
    println!(
        "p50: {:.2} ms against 2 × raw p50 + HTTP p50 = 2 × {:.2} + {:.2} = {:.2} ms ({})",
        ms(p50),
        ms(raw_p50),
        ms(http),
        ms(limit),
        if p50 <= limit {
            "within the target"
        } else {
            "over the target"
        }
    );
    let noop_p50 = common::percentile(&noop_lat, 50.0);
    println!(
        "no-op in-process: throughput {:.0} % of raw (median of {rounds} rounds, {}; target ≥ 60 %); \
         p50 {:.2} ms against 2 × raw p50 = {:.2} ms ({})",
        common::median(&noop_ratios),
        spread(&noop_ratios),
        ms(noop_p50),
        ms(raw_p50 * 2),
        if noop_p50 <= raw_p50 * 2 {
            "within the target"
        } else {
            "over the target"
        }
    );
    let claim_floor = ratios(&raw_claim_rates);
    let of_floor = pct(&noop_rates, &raw_claim_rates);
    println!(
        "  the claim's cost: raw loop + claim / raw = {:.0} % ({}): the most a worker that claims \
         each id before running it can reach; jetworker no-op = {:.0} % of it ({})",
        common::median(&claim_floor),
        spread(&claim_floor),
        common::median(&of_floor),
        spread(&of_floor)
    );
    let t = tap.lock().unwrap();
    let per = |x: usize| x as f64 / n_paced as f64;
    println!(
        "per task on the critical path: {:.2} awaited writes to results.<id> (claim, result), \
         {:.2} reads of results.<id>, {:.2} acks (not awaited), {:.2} progress acks",
        per(t.result_writes),
        per(t.result_reads),
        per(t.acks),
        per(t.progress)
    );
    println!(
        "peak RSS of the bench process with the worker (VmHWM): {peak:.1} MiB{}",
        if can_reset {
            ""
        } else {
            " (cannot reset VmHWM here: cumulative)"
        }
    );
}

/// `lowest–highest` of per-round percentages.
fn spread(xs: &[f64]) -> String {
    let lo = xs.iter().copied().fold(f64::INFINITY, f64::min);
    let hi = xs.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    format!("{lo:.0}–{hi:.0} %")
}
