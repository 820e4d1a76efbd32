//! Scale figures (issue 10), printed, asserting nothing about time:
//!
//! - **workers**: trivial tasks (`{"type":"command","command":"true"}`)
//!   through 1, 2, 4 and 8 worker processes (`jetworker run --slots 2`) on
//!   one label, against one server (R1) and a 3-node cluster with R1 and R3
//!   streams. tasks/s = N over first publish → last final result on
//!   `results.>`.
//! - **idle**: the server's cost of 1,000 idle pullers on one label, each
//!   the worker's own idle loop (`fetch().max_messages(1).expires(2s)`,
//!   over 100 connections): the server's CPU and resident memory per
//!   puller (from /proc, against the same connections without pullers) and
//!   pull requests per second, with the server's default `max_waiting`
//!   (512: how many pulls it refuses) and with the worker's
//!   (`setup::MAX_WAITING_PULLS`).
//! - **ceiling**: one consumer on one stream leader, no task run at all:
//!   M messages pre-published to `tasks.ceil`, then 4 pullers fetch in
//!   batches of 1 and of 64 and ack each message (WorkQueue: the ack
//!   deletes it); messages/s on R1 (one server) and R3 (the cluster).
//!
//! Run: `cargo bench --bench scale` (needs `nats-server` on PATH or
//! `NATS_SERVER_BIN`). Settings: `SCALE_TASKS` (1500 per worker run),
//! `SCALE_IDLE` (1000 pullers), `SCALE_CEIL` (20000 messages).

mod common;
// The integration tests' cluster harness, which finds `util` at the root.
#[path = "../tests/integration/cluster_util.rs"]
mod cluster_util;
use common::util;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::jetstream::{self, consumer::pull, message::PublishMessage};
use futures::StreamExt;
use jetworker::internals::{ensure_all, SetupOptions};
use jetworker::protocol::{Names, TaskResult};

use cluster_util::NatsCluster;
use common::env_usize;
use util::{NatsServer, ProcWorker};

const WORKER_COUNTS: [usize; 4] = [1, 2, 4, 8];
/// Publishes in flight while loading the stream.
const IN_FLIGHT: usize = 256;

/// Where the bench runs: one server or the 3-node cluster, and the
/// replicas of the jetworker streams on it.
struct Deployment {
    name: &'static str,
    urls: String,
    js: jetstream::Context,
    /// Server processes, for /proc.
    pids: Vec<u32>,
    _single: Option<NatsServer>,
    _cluster: Option<NatsCluster>,
}

impl Deployment {
    async fn single() -> Self {
        let srv = NatsServer::start();
        let js = jetstream::new(srv.client().await);
        ensure_all(&js, &Names::default(), &replicas(1))
            .await
            .unwrap();
        Deployment {
            name: "1 node, R1",
            urls: srv.url(),
            js,
            pids: vec![srv.pid().unwrap()],
            _single: Some(srv),
            _cluster: None,
        }
    }

    async fn cluster(r: usize) -> Self {
        let c = NatsCluster::start(3).await;
        let js = c.js().await;
        ensure_all(&js, &Names::default(), &replicas(r))
            .await
            .unwrap();
        Deployment {
            name: if r == 1 { "3 nodes, R1" } else { "3 nodes, R3" },
            urls: c.server_list(),
            js,
            pids: (0..3).filter_map(|i| c.pid(i)).collect(),
            _single: None,
            _cluster: Some(c),
        }
    }
}

fn replicas(r: usize) -> SetupOptions {
    SetupOptions {
        replicas: Some(r),
        ..Default::default()
    }
}

/// Publish `bodies` to `subject` with ids, [`IN_FLIGHT`] acks at a time.
async fn publish_all(js: &jetstream::Context, subject: &str, bodies: Vec<(String, String)>) {
    let mut acks = std::collections::VecDeque::new();
    for (id, body) in bodies {
        let m = PublishMessage::build().payload(body.into()).message_id(id);
        acks.push_back(js.send_publish(subject.to_string(), m).await.unwrap());
        if acks.len() >= IN_FLIGHT {
            acks.pop_front().unwrap().await.unwrap();
        }
    }
    for a in acks {
        a.await.unwrap();
    }
}

/// tasks/s of `n` trivial tasks through `workers` worker processes.
async fn workers_run(d: &Deployment, workers: usize, n: usize) -> f64 {
    let tag = format!("w{}x{workers}", d.name.len() + d.pids.len());
    let run: Vec<ProcWorker> = (0..workers)
        .map(|i| ProcWorker::start(&d.urls, &["--name", &format!("{tag}-{i}"), "--slots", "2"]))
        .collect();
    // Ready once every one has stored a heartbeat.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let beats = util::heartbeats(&d.js).await.unwrap_or_default();
        let up = beats
            .iter()
            .filter(|h| h.id.starts_with(&format!("{tag}-")))
            .count();
        if up >= workers {
            break;
        }
        assert!(Instant::now() < deadline, "workers did not start");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let prefix = format!("{tag}-t");
    let mut results = d.js.client().subscribe("results.>").await.unwrap();
    d.js.client().flush().await.unwrap();
    let bodies = (0..n)
        .map(|i| {
            let id = format!("{prefix}{i}");
            let body = format!(r#"{{"id":"{id}","type":"command","command":"true"}}"#);
            (id, body)
        })
        .collect();
    let t0 = Instant::now();
    let js = d.js.clone();
    let publisher = tokio::spawn(async move { publish_all(&js, "tasks.default", bodies).await });
    let mut finals = 0;
    while finals < n {
        let m = tokio::time::timeout(Duration::from_secs(120), results.next())
            .await
            .expect("results stopped coming")
            .unwrap();
        let r: TaskResult = serde_json::from_slice(&m.payload).unwrap();
        if r.is_final && r.id.starts_with(&prefix) {
            assert_eq!(r.status.to_string(), "success", "{r:?}");
            finals += 1;
        }
    }
    let rate = n as f64 / t0.elapsed().as_secs_f64();
    publisher.await.unwrap();
    drop(run);
    rate
}

/// CPU seconds (user + system) and resident MiB of the processes `pids`.
fn proc_usage(pids: &[u32]) -> (f64, f64) {
    // SAFETY: sysconf has no preconditions.
    let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    let mut cpu = 0.0;
    let mut rss = 0.0;
    for pid in pids {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
        let fields: Vec<&str> = stat
            .rsplit(')')
            .next()
            .unwrap()
            .split_whitespace()
            .collect();
        // Fields 14 and 15 (utime, stime) are 12 and 13 after the comm.
        cpu += (fields[11].parse::<f64>().unwrap() + fields[12].parse::<f64>().unwrap()) / ticks;
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
        let kib: f64 = status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .unwrap();
        rss += kib / 1024.0;
    }
    (cpu, rss)
}

/// `pullers` idle pull loops on a consumer of `tasks.<label>`, over
/// `conns` connections; returns (pull requests sent, pulls refused) counters
/// and a stop switch.
async fn start_pullers(
    clients: &[async_nats::Client],
    label: &str,
    pullers: usize,
) -> (
    Arc<AtomicU64>,
    Arc<AtomicU64>,
    tokio_util::sync::CancellationToken,
) {
    let sent = Arc::new(AtomicU64::new(0));
    let refused = Arc::new(AtomicU64::new(0));
    let stop = tokio_util::sync::CancellationToken::new();
    for i in 0..pullers {
        let js = jetstream::new(clients[i % clients.len()].clone());
        let (sent, refused, stop) = (sent.clone(), refused.clone(), stop.clone());
        let label = label.to_string();
        tokio::spawn(async move {
            let stream = js.get_stream("TASKS").await.unwrap();
            let consumer: jetstream::consumer::PullConsumer = stream
                .get_consumer(&Names::default().consumer_name(&label))
                .await
                .unwrap();
            while !stop.is_cancelled() {
                sent.fetch_add(1, Ordering::Relaxed);
                match consumer
                    .fetch()
                    .max_messages(1)
                    .expires(Duration::from_secs(2))
                    .messages()
                    .await
                {
                    Ok(mut b) => {
                        while let Some(m) = b.next().await {
                            if m.is_err() {
                                refused.fetch_add(1, Ordering::Relaxed);
                                tokio::time::sleep(Duration::from_millis(500)).await;
                            }
                        }
                    }
                    Err(_) => {
                        refused.fetch_add(1, Ordering::Relaxed);
                        tokio::time::sleep(Duration::from_millis(500)).await;
                    }
                }
            }
        });
    }
    (sent, refused, stop)
}

/// The idle-puller figures for one consumer setting.
async fn idle(pullers: usize, max_waiting: Option<i64>) {
    let srv = NatsServer::start();
    let js = jetstream::new(srv.client().await);
    let infra = ensure_all(&js, &Names::default(), &replicas(1))
        .await
        .unwrap();
    let label = "idle";
    let mut cfg = pull::Config {
        durable_name: Some(Names::default().consumer_name(label)),
        filter_subjects: Names::default().label_filters(label),
        ack_policy: jetstream::consumer::AckPolicy::Explicit,
        max_ack_pending: 10_000,
        ..Default::default()
    };
    if let Some(w) = max_waiting {
        cfg.max_waiting = w;
    }
    infra.tasks.create_consumer(cfg).await.unwrap();
    let conns = (pullers / 10).max(1);
    let mut clients = Vec::new();
    for _ in 0..conns {
        clients.push(srv.client().await);
    }
    let pid = [srv.pid().unwrap()];
    // Baseline: the connections, no pullers.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let (c0, rss0) = proc_usage(&pid);
    let t0 = Instant::now();
    tokio::time::sleep(Duration::from_secs(5)).await;
    let (c1, _) = proc_usage(&pid);
    let idle_cpu = (c1 - c0) / t0.elapsed().as_secs_f64();
    let (sent, refused, stop) = start_pullers(&clients, label, pullers).await;
    // Two expiry cycles to settle, then a 10 s window.
    tokio::time::sleep(Duration::from_secs(4)).await;
    let (c2, _) = proc_usage(&pid);
    let (s2, r2) = (
        sent.load(Ordering::Relaxed),
        refused.load(Ordering::Relaxed),
    );
    let t2 = Instant::now();
    tokio::time::sleep(Duration::from_secs(10)).await;
    let secs = t2.elapsed().as_secs_f64();
    let (c3, rss3) = proc_usage(&pid);
    let pulls = (sent.load(Ordering::Relaxed) - s2) as f64 / secs;
    let refusals = (refused.load(Ordering::Relaxed) - r2) as f64 / secs;
    let cpu = (c3 - c2) / secs;
    stop.cancel();
    println!(
        "idle  {pullers} pullers on {conns} connections, max_waiting {}: {pulls:.0} pull requests/s \
         ({refusals:.0}/s refused); server CPU {:.1}% of a core ({:.1}% without pullers), \
         {:.3}% per puller; RSS {rss3:.1} MiB ({rss0:.1} MiB without), {:.1} KiB per puller",
        max_waiting.map_or("default (512)".into(), |w| w.to_string()),
        cpu * 100.0,
        idle_cpu * 100.0,
        (cpu - idle_cpu).max(0.0) * 100.0 / pullers as f64,
        (rss3 - rss0).max(0.0) * 1024.0 / pullers as f64,
    );
}

/// Messages/s through one consumer: `m` pre-published messages, 4
/// pullers fetching `batch` at a time and acking each.
async fn ceiling(d: &Deployment, m: usize, batch: usize) -> f64 {
    let label = format!("ceil{batch}");
    let names = Names::default();
    let stream = d.js.get_stream("TASKS").await.unwrap();
    let consumer: jetstream::consumer::PullConsumer = stream
        .create_consumer(pull::Config {
            durable_name: Some(names.consumer_name(&label)),
            filter_subjects: names.label_filters(&label),
            ack_policy: jetstream::consumer::AckPolicy::Explicit,
            max_ack_pending: 10_000,
            ..Default::default()
        })
        .await
        .unwrap();
    let bodies = (0..m)
        .map(|i| {
            (
                format!("{label}-{i}"),
                r#"{"type":"command","command":"true"}"#.to_string(),
            )
        })
        .collect();
    publish_all(&d.js, &format!("tasks.{label}"), bodies).await;
    let done = Arc::new(AtomicU64::new(0));
    let t0 = Instant::now();
    let mut pullers = Vec::new();
    for _ in 0..4 {
        let (consumer, done) = (consumer.clone(), done.clone());
        pullers.push(tokio::spawn(async move {
            while done.load(Ordering::Relaxed) < m as u64 {
                let Ok(mut b) = consumer
                    .fetch()
                    .max_messages(batch)
                    .expires(Duration::from_millis(500))
                    .messages()
                    .await
                else {
                    continue;
                };
                while let Some(Ok(msg)) = b.next().await {
                    msg.ack().await.unwrap();
                    done.fetch_add(1, Ordering::Relaxed);
                }
            }
        }));
    }
    for p in pullers {
        p.await.unwrap();
    }
    m as f64 / t0.elapsed().as_secs_f64()
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let n = env_usize("SCALE_TASKS", 1500);
    let idle_n = env_usize("SCALE_IDLE", 1000);
    let ceil_n = env_usize("SCALE_CEIL", 20_000);
    println!(
        "scale: {} CPUs, nats-server {}",
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        String::from_utf8_lossy(
            &std::process::Command::new(util::nats_server_bin())
                .arg("--version")
                .output()
                .unwrap()
                .stdout
        )
        .trim()
    );

    for make in 0..3 {
        let d = match make {
            0 => Deployment::single().await,
            1 => Deployment::cluster(1).await,
            _ => Deployment::cluster(3).await,
        };
        let mut line = format!("workers  {:<12}", d.name);
        let mut base = None;
        for w in WORKER_COUNTS {
            let rate = workers_run(&d, w, n).await;
            let b = *base.get_or_insert(rate);
            line.push_str(&format!("  {w}: {rate:>5.0}/s (x{:.2})", rate / b));
        }
        println!("{line}");
        if make != 1 {
            let mut line = format!("ceiling  {:<12}", d.name);
            for batch in [1, 64] {
                let rate = ceiling(&d, ceil_n, batch).await;
                line.push_str(&format!("  batch {batch}: {rate:>6.0} msgs/s"));
            }
            println!("{line}");
        }
    }
    idle(idle_n, None).await;
    idle(idle_n, Some(jetworker::internals::MAX_WAITING_PULLS)).await;
}
