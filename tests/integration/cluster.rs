//! jetworker on a 3-node JetStream cluster (issue 10): the replica rule,
//! and failure drills. Each drill runs 3 worker processes (connected to the
//! whole server list) under a steady load of short tasks plus some long
//! ones, breaks the cluster mid-load (a stream leader, the node a worker is
//! connected to, the meta leader, a rolling restart, quorum loss, the
//! RESULTS leader moving), and ends with the invariants of
//! [`Drill::finish`]: every task published has exactly one final result and
//! it is the last record, the queue drains, no worker exited, every run was
//! claimed (`running` record) first, no task ran twice unless its history
//! shows a lost lease, and no two copies ever ran at once.

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_nats::jetstream::{self, message::PublishMessage};
use jetworker::protocol::Status;
use tokio_util::sync::CancellationToken;

use crate::cluster_util::*;
use crate::util::*;

/// Timeout of each wait in a drill: how long a 3-node cluster on a loaded
/// 2-core machine may take to elect leaders again after a restart (seen
/// above 30 s under a parallel test suite). A drill that passes is usually
/// done in 10–55 s; this bounds a stuck one.
const T: Duration = Duration::from_secs(60);
/// Short tasks published per second during a drill.
const RATE: u64 = 8;
/// One task in this many is a long one (2 s).
const LONG_EVERY: u64 = 12;
/// The workers' `--ack-wait`.
const ACK_WAIT: &str = "8s";

/// One drill at a time: each is a 3-node cluster, three workers and a load,
/// as much as a 2-core machine carries beside the rest of the suite.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// A cluster, three workers, a load generator and the files the task
/// script writes.
struct Drill {
    cluster: NatsCluster,
    workers: Vec<ProcWorker>,
    /// Each worker's `/readyz` address.
    metrics: Vec<SocketAddr>,
    js: jetstream::Context,
    /// `runs` (one line `<id> <start ns> <ATTEMPT>` per run) and `overlaps` (ids seen
    /// running twice at once, by flock), and one lock file per id.
    dir: tempfile::TempDir,
    /// Ids whose publish was acknowledged by the stream.
    published: Arc<Mutex<Vec<String>>>,
    stop_load: CancellationToken,
    load: Option<tokio::task::JoinHandle<()>>,
    started: Instant,
    /// Last, so that it is released after the cluster and workers are gone.
    _turn: tokio::sync::MutexGuard<'static, ()>,
}

impl Drill {
    /// A 3-node cluster, three workers, the load running; returns once
    /// the first results are in.
    async fn start(name: &str) -> Drill {
        let turn = ONE_AT_A_TIME.lock().await;
        let cluster = NatsCluster::start(3).await;
        let servers = cluster.server_list();
        let metrics: Vec<SocketAddr> = (0..3).map(|_| free_addr()).collect();
        let workers = metrics
            .iter()
            .enumerate()
            .map(|(i, addr)| {
                ProcWorker::start(
                    &servers,
                    &[
                        "--name",
                        &format!("w{i}"),
                        "--slots",
                        "3",
                        "--ack-wait",
                        ACK_WAIT,
                        "--metrics-addr",
                        &addr.to_string(),
                    ],
                )
            })
            .collect();
        let js = cluster.js().await;
        wait_for(T, "TASKS stream", || async {
            js.get_stream("TASKS").await.ok()
        })
        .await;
        // The workers made it with 3 replicas (else a kill loses tasks).
        assert_eq!(replicas_of(&js, "TASKS").await, 3);
        let mut d = Drill {
            _turn: turn,
            cluster,
            workers,
            metrics,
            js,
            dir: tempfile::tempdir().unwrap(),
            published: Arc::default(),
            stop_load: CancellationToken::new(),
            load: None,
            started: Instant::now(),
        };
        d.wait_workers_ready().await;
        d.load = Some(tokio::spawn(load(
            d.js.clone(),
            d.dir.path().to_path_buf(),
            format!("{name}-"),
            d.published.clone(),
            d.stop_load.clone(),
        )));
        d.wait_results(5).await;
        d
    }

    /// Wait until at least `n` more task runs than now have started.
    async fn wait_results(&self, n: usize) {
        let count = || read_runs(self.dir.path()).len();
        let target = count() + n;
        wait_for(T, &format!("{n} more task runs"), || async {
            (count() >= target).then_some(())
        })
        .await;
    }

    async fn wait_workers_ready(&self) {
        for (i, addr) in self.metrics.iter().enumerate() {
            wait_for(T, &format!("worker {i} /readyz 200"), || async {
                (http_status(*addr, "/readyz").await == Some(200)).then_some(())
            })
            .await;
        }
    }

    /// Every worker process is still running.
    fn assert_workers_alive(&mut self) {
        for (i, w) in self.workers.iter_mut().enumerate() {
            assert!(
                w.child.try_wait().unwrap().is_none(),
                "worker {i} exited during the drill"
            );
        }
    }

    /// Stop the load, wait for every published task to finish and check
    /// the invariants.
    async fn finish(self) {
        self.finish_with(false).await
    }

    /// [`Self::finish`], and with `history` also the history checker of
    /// tests/integration/history.rs (I1, and the chain rule I2 over every
    /// record of RESULTS).
    async fn finish_with(mut self, history: bool) {
        self.stop_load.cancel();
        self.load.take().unwrap().await.unwrap();
        let ids = self.published.lock().unwrap().clone();
        assert!(ids.len() >= 20, "too little load: {} tasks", ids.len());
        let js = &self.js.clone();
        for id in &ids {
            final_result(js, id, T).await;
        }
        let deadline = Instant::now() + T;
        while tasks_left(js).await > 0 {
            if Instant::now() > deadline {
                panic!(
                    "TASKS did not drain in {T:?}; left:\n{}",
                    leftover_tasks(js).await.join("\n")
                );
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        self.assert_workers_alive();

        let all_runs = read_runs(self.dir.path());
        let mut starts: HashMap<&str, Vec<&Run>> = HashMap::new();
        for r in &all_runs {
            starts.entry(r.id.as_str()).or_default().push(r);
        }
        let overlaps =
            std::fs::read_to_string(self.dir.path().join("overlaps")).unwrap_or_default();
        let mut problems = Vec::new();
        for id in &ids {
            // Every record, the `running` claims included (DESIGN.md 5).
            let history = all_records(js, id).await;
            let finals = history.iter().filter(|r| r.is_final).count();
            if finals != 1 || !history.last().is_some_and(|r| r.is_final) {
                problems.push(format!(
                    "{id}: {finals} final results, last final: {}; history {:?}",
                    history.last().is_some_and(|r| r.is_final),
                    summary(&history)
                ));
            }
            // A second run is allowed only where the history shows that a
            // lease was lost: a second claim (a takeover, or a claim after
            // a hand-back) or a later attempt.
            let claims = history
                .iter()
                .filter(|r| r.status == Status::Running)
                .count();
            let lease_lost = claims > 1 || history.iter().any(|r| r.attempt > 1);
            let id_starts = starts.get(id.as_str()).cloned().unwrap_or_default();
            let n = id_starts.len();
            // "+<seconds after the first run> a<ATTEMPT>" of each run.
            let first = id_starts.first().map_or(0, |r| r.start_ns);
            let runs_at: Vec<String> = id_starts
                .iter()
                .map(|r| {
                    let after = r.start_ns.saturating_sub(first) as f64 / 1e9;
                    format!("+{after:.2}s a{}", r.attempt)
                })
                .collect();
            if n == 0 {
                problems.push(format!("{id}: final result but no run recorded"));
            }
            if n > 1 && !lease_lost {
                problems.push(format!(
                    "{id}: ran {n} times without a lost lease (runs {runs_at:?}); history {:?}",
                    summary(&history)
                ));
            }
            // Each run was claimed first.
            if n > claims {
                problems.push(format!(
                    "{id}: ran {n} times on {claims} claims (runs {runs_at:?}); history {:?}",
                    summary(&history)
                ));
            }
            // Never two copies at once, lost lease or not (the worker
            // stops its copy before the lease can pass to another).
            if overlaps.lines().any(|l| l == id) {
                problems.push(format!(
                    "{id}: two copies ran at once (runs {runs_at:?}; ack wait {ACK_WAIT}); history {:?}",
                    summary(&history)
                ));
            }
        }
        if history {
            let (records, _, unreadable) = crate::history::read_results(js).await;
            assert!(unreadable.is_empty(), "unreadable records: {unreadable:?}");
            let mut v = crate::history::Violations::default();
            for (id, recs) in &records {
                crate::history::check_chain(id, recs, &mut v);
                crate::history::check_final(id, recs, &mut v);
            }
            assert!(v.is_empty(), "the history checker:\n{}", v.report());
        }
        assert!(
            problems.is_empty(),
            "{} of {} tasks broke the invariants:\n{}",
            problems.len(),
            ids.len(),
            problems.join("\n")
        );
        eprintln!(
            "drill: {} tasks, {} runs, {:?}",
            ids.len(),
            all_runs.len(),
            self.started.elapsed()
        );
    }
}

/// The messages left in TASKS: sequence, subject, id and that id's records.
async fn leftover_tasks(js: &jetstream::Context) -> Vec<String> {
    let mut stream = js.get_stream("TASKS").await.unwrap();
    let state = stream.info().await.unwrap().state.clone();
    let mut out = Vec::new();
    for seq in state.first_sequence..=state.last_sequence {
        let Ok(m) = stream.get_raw_message(seq).await else {
            continue;
        };
        let id = serde_json::from_slice::<serde_json::Value>(&m.payload)
            .ok()
            .and_then(|v| v.get("id")?.as_str().map(String::from))
            .unwrap_or_default();
        let history = summary(&all_records(js, &id).await);
        out.push(format!("seq {seq} {} id {id}: {history:?}", m.subject));
    }
    out
}

/// (status, final, attempt, worker) of each record, for messages.
fn summary(h: &[jetworker::protocol::TaskResult]) -> Vec<String> {
    h.iter()
        .map(|r| {
            format!(
                "{}{} a{} {}",
                r.status,
                if r.is_final { "(final)" } else { "" },
                r.attempt,
                r.worker_id
            )
        })
        .collect()
}

/// Publish [`RATE`] tasks a second until `stop`: short ones, and a 2 s one
/// every [`LONG_EVERY`]. Each publish carries its id as `Nats-Msg-Id` and is
/// retried until the stream acknowledges it (the dedup window makes a
/// retry harmless), so that an election only pauses the load. The task
/// script records each run and, by flock, two copies running at once.
async fn load(
    js: jetstream::Context,
    dir: PathBuf,
    prefix: String,
    published: Arc<Mutex<Vec<String>>>,
    stop: CancellationToken,
) {
    let d = dir.display();
    let mut tick = tokio::time::interval(Duration::from_millis(1000 / RATE));
    for n in 0u64.. {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tick.tick() => {}
        }
        let id = format!("{prefix}{n}");
        let sleep = if n % LONG_EVERY == LONG_EVERY - 1 {
            "2"
        } else {
            "0.05"
        };
        let script = format!(
            "exec 9>>{d}/$SCHEDULE_INSTANCE_ID.lock; flock -n 9 || echo $SCHEDULE_INSTANCE_ID >> {d}/overlaps; \
             echo \"$SCHEDULE_INSTANCE_ID $(date +%s%N) $ATTEMPT\" >> {d}/runs; sleep {sleep}"
        );
        let body = serde_json::json!({"id": id, "type": "shell", "payload": script}).to_string();
        loop {
            let m = PublishMessage::build()
                .payload(body.clone().into())
                .message_id(&id);
            let acked = match js.send_publish("tasks.default", m).await {
                Ok(ack) => ack.await.is_ok(),
                Err(_) => false,
            };
            if acked {
                published.lock().unwrap().push(id);
                break;
            }
            if stop.is_cancelled() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

/// Start times (ns since the epoch) of the runs in `runs`.
/// One line of the `runs` file the task script appends to.
struct Run {
    id: String,
    /// Start time, ns since the epoch.
    start_ns: u128,
    /// `$ATTEMPT` of the run.
    attempt: String,
}

/// The runs so far, in the order they started.
fn read_runs(dir: &std::path::Path) -> Vec<Run> {
    std::fs::read_to_string(dir.join("runs"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| {
            let mut f = l.split(' ');
            Some(Run {
                id: f.next()?.to_string(),
                start_ns: f.next()?.parse().ok()?,
                attempt: f.next().unwrap_or("?").to_string(),
            })
        })
        .collect()
}

fn now_ns() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_create_r3_on_a_3_node_cluster_and_r1_on_one_server() {
    let cluster = NatsCluster::start(3).await;
    let _w = ProcWorker::start(&cluster.server_list(), &[]);
    let js = cluster.js().await;
    wait_for(T, "the cancel bucket", || async {
        js.get_stream("KV_cancel").await.ok()
    })
    .await;
    let mut got = BTreeMap::new();
    for s in ["TASKS", "RESULTS", "DEAD", "KV_workers", "KV_cancel"] {
        got.insert(s, replicas_of(&js, s).await);
    }
    assert!(got.values().all(|&r| r == 3), "{got:?}");

    let one = NatsServer::start();
    let _w1 = ProcWorker::start(&one.url(), &[]);
    let js1 = one.js().await;
    wait_for(T, "the cancel bucket", || async {
        js1.get_stream("KV_cancel").await.ok()
    })
    .await;
    assert_eq!(replicas_of(&js1, "TASKS").await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn setup_replicas_3_and_workers_keep_it() {
    let cluster = NatsCluster::start(3).await;
    let out = std::process::Command::new(jetworker_bin())
        .args([
            "setup",
            "--replicas",
            "3",
            "--server",
            &cluster.server_list(),
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let js = cluster.js().await;
    for s in ["TASKS", "RESULTS", "DEAD", "KV_workers", "KV_cancel"] {
        assert_eq!(replicas_of(&js, s).await, 3, "{s}");
    }
    // R3 asked of fewer nodes than that is an error, not a silent R1.
    let one = NatsServer::start();
    let out = std::process::Command::new(jetworker_bin())
        .args(["setup", "--replicas", "3", "--server", &one.url()])
        .output()
        .unwrap();
    assert!(!out.status.success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drill_kill_tasks_stream_leader() {
    let mut d = Drill::start("tl").await;
    let leader = wait_stream_leader(&d.js, "TASKS", None, T).await;
    let i = d.cluster.index_of(&leader);
    d.cluster.kill(i);
    wait_stream_leader(&d.js, "TASKS", Some(&leader), T).await;
    d.wait_results(10).await;
    d.cluster.restart(i);
    d.cluster.wait_ready(T).await;
    d.wait_results(5).await;
    d.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drill_kill_the_node_a_worker_is_connected_to() {
    let mut d = Drill::start("wn").await;
    let i = wait_for(T, "worker w0's connection", || async {
        d.cluster.node_of_connection("w0-")
    })
    .await;
    d.cluster.kill(i);
    // w0 reconnects to a survivor and keeps taking work.
    wait_for(T, "w0 on another node", || async {
        d.cluster.node_of_connection("w0-").filter(|&j| j != i)
    })
    .await;
    d.wait_results(10).await;
    d.cluster.restart(i);
    d.cluster.wait_ready(T).await;
    d.wait_results(5).await;
    d.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drill_kill_the_meta_leader() {
    let mut d = Drill::start("ml").await;
    let leader = d.cluster.wait_ready(T).await;
    let i = d.cluster.index_of(&leader);
    d.cluster.kill(i);
    d.cluster.wait_new_meta_leader(&leader, T).await;
    d.wait_results(10).await;
    d.cluster.restart(i);
    d.cluster.wait_ready(T).await;
    d.wait_results(5).await;
    d.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drill_rolling_restart() {
    let mut d = Drill::start("rr").await;
    for i in 0..3 {
        d.cluster.kill(i);
        d.wait_results(3).await;
        d.cluster.restart(i);
        d.cluster.wait_ready(T).await;
        // The restarted node has caught up on the task stream before the
        // next one goes.
        wait_for(T, "TASKS replicas current", || async {
            stream_leader(&d.js, "TASKS")
                .await
                .filter(|(_, current)| *current == 2)
        })
        .await;
    }
    d.wait_results(5).await;
    d.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drill_lose_two_of_three_nodes() {
    let mut d = Drill::start("q").await;
    d.cluster.kill(1);
    d.cluster.kill(2);
    let lost_at = Instant::now();
    // No quorum: every worker says it is not ready, and none exits.
    for (i, addr) in d.metrics.clone().iter().enumerate() {
        wait_for(T, &format!("worker {i} /readyz not 200"), || async {
            (http_status(*addr, "/readyz")
                .await
                .is_some_and(|s| s != 200))
            .then_some(())
        })
        .await;
    }
    // No new work starts once the stream leaders are gone (after a grace
    // for deliveries already on their way).
    let grace = Duration::from_secs(3).saturating_sub(lost_at.elapsed());
    tokio::time::sleep(grace).await;
    let quiet_from = now_ns();
    let window = Instant::now();
    while window.elapsed() < Duration::from_secs(4) {
        d.assert_workers_alive();
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let started: Vec<Run> = read_runs(d.dir.path())
        .into_iter()
        .filter(|r| r.start_ns > quiet_from)
        .collect();
    assert!(
        started.is_empty(),
        "{} tasks started without a quorum",
        started.len()
    );
    d.cluster.restart(1);
    d.cluster.wait_ready(T).await;
    d.wait_workers_ready().await;
    d.wait_results(10).await;
    d.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drill_results_leader_moves_while_publishing() {
    let mut d = Drill::start("rl").await;
    for _ in 0..3 {
        let old = wait_stream_leader(&d.js, "RESULTS", None, T).await;
        // Account users may ask a stream leader to step down.
        let r =
            d.js.client()
                .request("$JS.API.STREAM.LEADER.STEPDOWN.RESULTS", "".into())
                .await
                .unwrap();
        let v: serde_json::Value = serde_json::from_slice(&r.payload).unwrap();
        assert!(v.get("error").is_none(), "stepdown refused: {v}");
        wait_stream_leader(&d.js, "RESULTS", Some(&old), T).await;
        d.wait_results(6).await;
    }
    // And once the hard way: its node dies with PubAcks in flight.
    let old = wait_stream_leader(&d.js, "RESULTS", None, T).await;
    let i = d.cluster.index_of(&old);
    d.cluster.kill(i);
    wait_stream_leader(&d.js, "RESULTS", Some(&old), T).await;
    d.wait_results(6).await;
    d.cluster.restart(i);
    d.cluster.wait_ready(T).await;
    d.finish().await;
}

/// The plan for a hot label (DESIGN.md, "Scaling"): its own task stream,
/// configured with `[names]`, whose leader can sit on another node than
/// TASKS; results stay in the one RESULTS stream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hot_label_in_its_own_stream_with_its_own_leader() {
    let cluster = NatsCluster::start(3).await;
    let servers = cluster.server_list();
    let conf = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(
        conf.path(),
        "[names]\ntasks_stream = \"TASKS_HOT\"\ntasks_prefix = \"hot\"\nschedules_prefix = \"hotschedules\"\n",
    )
    .unwrap();
    let _plain = ProcWorker::start(&servers, &[]);
    let _hot = ProcWorker::start(
        &servers,
        &["--config", conf.path().to_str().unwrap(), "--labels", "gpu"],
    );
    let js = cluster.js().await;
    for s in ["TASKS", "TASKS_HOT"] {
        wait_for(T, s, || async { js.get_stream(s).await.ok() }).await;
    }
    publish_task(
        &js,
        "default",
        r#"{"id":"plain","type":"shell","payload":"echo plain"}"#,
    )
    .await;
    publish_raw(
        &js,
        "hot.gpu",
        r#"{"id":"hot","type":"shell","payload":"echo hot"}"#.into(),
        None,
    )
    .await;
    assert_eq!(final_result(&js, "plain", T).await.output, "plain\n");
    let hot = final_result(&js, "hot", T).await;
    assert_eq!((hot.output.as_str(), hot.label.as_str()), ("hot\n", "gpu"));
    assert_eq!(replicas_of(&js, "TASKS_HOT").await, 3);
    // Leaders are placed by the meta leader; ask the hot stream's to step
    // down until it sits elsewhere (account users may).
    let apart = wait_for(T, "TASKS_HOT led by another node than TASKS", || async {
        let (a, _) = stream_leader(&js, "TASKS").await?;
        let (b, _) = stream_leader(&js, "TASKS_HOT").await?;
        if a != b {
            return Some((a, b));
        }
        let _ = js
            .client()
            .request("$JS.API.STREAM.LEADER.STEPDOWN.TASKS_HOT", "".into())
            .await;
        None
    })
    .await;
    eprintln!("leaders: TASKS on {}, TASKS_HOT on {}", apart.0, apart.1);
}

/// Opt-in long drill: a node killed and restarted every few seconds, the
/// next one each time, under load for `CLUSTER_SOAK_SECS` (default 120),
/// then the invariants of [`Drill::finish`] and the history checker
/// (tests/integration/history.rs). Run with
/// `cargo test --release --test integration cluster::soak -- --ignored --nocapture`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "long: minutes of node kills; run explicitly"]
async fn soak_node_kills_under_load() {
    let secs: u64 = std::env::var("CLUSTER_SOAK_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(120);
    let mut d = Drill::start("soak").await;
    let until = Instant::now() + Duration::from_secs(secs);
    let mut i = 0;
    while Instant::now() < until {
        d.cluster.kill(i);
        d.wait_results(5).await;
        d.cluster.restart(i);
        d.cluster.wait_ready(T).await;
        d.wait_results(5).await;
        i = (i + 1) % 3;
    }
    d.finish_with(true).await;
}
