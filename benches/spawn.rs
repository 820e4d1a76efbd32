//! Spawn cost, and what a worker makes of it end to end, each against a
//! raw reference measured in the same run (issue 9's targets):
//!
//! 1. **Spawn path, no broker.** Spawns/s at parallelism P (`SPAWN_PAR`,
//!    the worker's slots, default 8):
//!    - raw `posix_spawn("/bin/true")` + `waitpid`, P threads;
//!    - raw `posix_spawn("bash", "-c", "true")`, P threads;
//!    - jetworker's spawn path: `ProcessRunner::run` (working directory,
//!      environment, process group, cgroup where writable, pipes, the
//!      supervision clock) for `command /bin/true` and `shell true`, P
//!      concurrent attempts on a 2-thread runtime.
//! 2. **End to end**, through a private nats-server and the release
//!    `jetworker run` binary as its own process (so its CPU and memory can
//!    be read from `/proc`), with `--slots P` and containment on
//!    (`--cgroups auto`):
//!    - tasks/s for N `command /bin/true` and N `shell true` tasks
//!      published at once, and the ratio to the raw spawn rates above;
//!    - the worker's CPU (user + system, not its children) per task, and
//!      the nats-server's;
//!    - the ceiling: the most any worker could reach, the spawn path alone
//!      (part 1) plus the server's CPU per task and no worker overhead;
//!    - p50 publish → result for `command /bin/true` at 100 tasks/s, next
//!      to the raw JetStream round trip (publish → PubAck) and the raw
//!      spawn latency (`posix_spawn` + `waitpid` of `/bin/true`), each
//!      measured at the same 100/s (the target's basis: a lone operation
//!      on an otherwise idle VM also pays for waking a CPU) and back to
//!      back;
//!    - the worker's RSS idle (the highest of samples over its first 3 s
//!      after start-up, six heartbeats: the daemon hands its start-up code
//!      pages back once it pulls, and what its idle loop runs comes back),
//!      and with 64 `sleep` tasks running (`--slots 64`).
//!
//! Run: `cargo bench --bench spawn` (needs nats-server on PATH or
//! `NATS_SERVER_BIN`). Settings: `SPAWN_PAR` (8), `SPAWN_N` (3000 spawns
//! per raw measurement), `BENCH_TASKS` (3000 per batch), `SPAWN_ROUNDS` (3,
//! medians printed).

mod common;

use std::ffi::CString;
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::jetstream;
use futures::StreamExt;
use jetworker::internals::{ProcessRunner, ProcessSpec};
use jetworker::protocol::{parse_task, Envelope, Names, Status, TaskResult, ValidationLimits};
use jetworker::runner::RunContext;

const GIVE_UP: Duration = Duration::from_secs(300);

/// `posix_spawn` `argv` and wait, `n` times over `par` threads; spawns/s.
fn raw_spawn(argv: &[&str], n: usize, par: usize) -> f64 {
    let per = n / par;
    let start = Instant::now();
    std::thread::scope(|s| {
        for _ in 0..par {
            s.spawn(|| {
                for _ in 0..per {
                    raw_spawn_once(argv);
                }
            });
        }
    });
    (per * par) as f64 / start.elapsed().as_secs_f64()
}

fn raw_spawn_once(argv: &[&str]) {
    let c: Vec<CString> = argv.iter().map(|a| CString::new(*a).unwrap()).collect();
    let mut ptrs: Vec<*mut libc::c_char> = c.iter().map(|a| a.as_ptr() as *mut _).collect();
    ptrs.push(std::ptr::null_mut());
    let env: [*mut libc::c_char; 1] = [std::ptr::null_mut()];
    let mut pid: libc::pid_t = 0;
    // SAFETY: valid NUL-terminated argv/envp arrays that outlive the call.
    let rc = unsafe {
        libc::posix_spawn(
            &mut pid,
            ptrs[0],
            std::ptr::null(),
            std::ptr::null(),
            ptrs.as_ptr(),
            env.as_ptr(),
        )
    };
    assert_eq!(rc, 0, "posix_spawn {argv:?}");
    let mut status = 0;
    // SAFETY: waiting for our own child.
    unsafe { libc::waitpid(pid, &mut status, 0) };
    assert_eq!(status, 0, "{argv:?} failed");
}

fn task(json: &str) -> Arc<jetworker::protocol::Task> {
    let env = Envelope {
        label: "default",
        stream_sequence: 1,
        ..Default::default()
    };
    Arc::new(parse_task(json.as_bytes(), &env, &ValidationLimits::default()).expect("valid task"))
}

/// `n` attempts of `json` through the process runner, `par` at a time;
/// attempts/s.
async fn runner_rate(runner: Arc<ProcessRunner>, json: &str, n: usize, par: usize) -> f64 {
    let t = task(json);
    let per = n / par;
    let start = Instant::now();
    let mut set = tokio::task::JoinSet::new();
    for _ in 0..par {
        let (runner, t) = (runner.clone(), t.clone());
        set.spawn(async move {
            for _ in 0..per {
                let ctx = RunContext::new(
                    t.clone(),
                    1,
                    "bench",
                    Duration::from_secs(30),
                    Duration::from_secs(1),
                    64 * 1024,
                );
                let spec = t.spec::<ProcessSpec>().expect("a process task").clone();
                let o = runner.run(&spec, ctx).await;
                assert_eq!(o.status, Status::Success, "{o:?}");
            }
        });
    }
    while let Some(r) = set.join_next().await {
        r.unwrap();
    }
    (per * par) as f64 / start.elapsed().as_secs_f64()
}

/// A `jetworker run` process on the bench server.
struct WorkerProc {
    child: std::process::Child,
    _state: tempfile::TempDir,
}

impl WorkerProc {
    async fn start(url: &str, js: &jetstream::Context, slots: usize, name: &str) -> Self {
        let state = tempfile::tempdir().unwrap();
        let child = std::process::Command::new(env!("CARGO_BIN_EXE_jetworker"))
            .args(["run", "--server", url, "--slots", &slots.to_string()])
            .args(["--name", name, "--heartbeat", "500ms", "--cgroups", "auto"])
            .arg("--state-dir")
            .arg(state.path())
            .env("RUST_LOG", "warn")
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("start jetworker");
        common::wait_heartbeat(js, &format!("{name}-")).await;
        tokio::time::sleep(Duration::from_millis(500)).await;
        WorkerProc {
            child,
            _state: state,
        }
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    /// User + system CPU of the worker itself (not its children), seconds.
    fn cpu(&self) -> f64 {
        common::cpu_seconds(self.pid())
    }

    fn rss_mib(&self) -> f64 {
        let s = std::fs::read_to_string(format!("/proc/{}/status", self.pid())).unwrap();
        s.lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
            .unwrap()
            / 1024.0
    }

    /// The highest RSS of `samples` readings, `every` apart.
    async fn peak_rss_mib(&self, samples: usize, every: Duration) -> f64 {
        let mut peak: f64 = 0.0;
        for i in 0..samples {
            if i > 0 {
                tokio::time::sleep(every).await;
            }
            peak = peak.max(self.rss_mib());
        }
        peak
    }

    /// Idle RSS: the highest of 13 samples over 3 s (six heartbeats), so
    /// that what the idle loop faults back in after start-up is counted.
    async fn idle_rss_mib(&self) -> f64 {
        self.peak_rss_mib(13, Duration::from_millis(250)).await
    }

    /// Direct children (task processes and the watchdog).
    fn children(&self) -> usize {
        let mut n = 0;
        if let Ok(rd) = std::fs::read_dir(format!("/proc/{}/task", self.pid())) {
            for t in rd.flatten() {
                n += std::fs::read_to_string(t.path().join("children"))
                    .unwrap_or_default()
                    .split_whitespace()
                    .count();
            }
        }
        n
    }

    fn stop(mut self) {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(self.pid() as i32),
            nix::sys::signal::Signal::SIGTERM,
        );
        let _ = self.child.wait();
    }
}

/// Final results by id prefix from a `results.>` subscription.
struct Results(async_nats::Subscriber);

impl Results {
    async fn next_final(&mut self, prefix: &str) -> (TaskResult, Instant) {
        let want = format!("{}.{prefix}", Names::default().results_prefix);
        loop {
            let m = tokio::time::timeout(GIVE_UP, self.0.next())
                .await
                .expect("results in time")
                .expect("subscription open");
            let at = Instant::now();
            if !m.subject.as_str().starts_with(&want) {
                continue;
            }
            let r: TaskResult = serde_json::from_slice(&m.payload).unwrap();
            if r.is_state() {
                // The `running` claim before the result.
                continue;
            }
            assert_eq!(r.status, Status::Success, "{} {:?}", r.id, r.error);
            if r.is_final {
                return (r, at);
            }
        }
    }
}

async fn publish(js: &jetstream::Context, body: String) {
    js.publish(Names::default().task_subject("default"), body.into())
        .await
        .unwrap()
        .await
        .unwrap();
}

/// N tasks at once; (tasks/s, worker CPU ms per task).
/// What one end-to-end batch measured.
struct Batch {
    /// Tasks/s.
    rate: f64,
    /// CPU per task of the worker (not its children) and of the
    /// nats-server, ms.
    worker_ms: f64,
    server_ms: f64,
}

async fn batch(
    js: &jetstream::Context,
    res: &mut Results,
    w: &WorkerProc,
    server_pid: u32,
    kind: &str,
    prefix: &str,
    n: usize,
) -> Batch {
    let cpu0 = w.cpu();
    let server0 = common::cpu_seconds(server_pid);
    let start = Instant::now();
    futures::stream::iter(0..n)
        .map(|i| publish(js, format!(r#"{{{kind},"id":"{prefix}{i:06}"}}"#)))
        .buffer_unordered(256)
        .for_each(|_| async {})
        .await;
    let mut seen = std::collections::HashSet::new();
    while seen.len() < n {
        seen.insert(res.next_final(prefix).await.0.id);
    }
    let rate = n as f64 / start.elapsed().as_secs_f64();
    let per_task = |s: f64| s * 1000.0 / n as f64;
    Batch {
        rate,
        worker_ms: per_task(w.cpu() - cpu0),
        server_ms: per_task(common::cpu_seconds(server_pid) - server0),
    }
}

/// `n` tasks published at `per_sec` (open loop); sorted latencies.
async fn paced(
    js: &jetstream::Context,
    res: &mut Results,
    kind: &str,
    prefix: &str,
    n: usize,
    per_sec: f64,
) -> Vec<Duration> {
    let every = Duration::from_secs_f64(1.0 / per_sec);
    let sent: Arc<std::sync::Mutex<std::collections::HashMap<String, Instant>>> =
        Default::default();
    let pub_task = {
        let (js, sent, kind, prefix) = (
            js.clone(),
            sent.clone(),
            kind.to_string(),
            prefix.to_string(),
        );
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(every);
            for i in 0..n {
                tick.tick().await;
                let id = format!("{prefix}{i:06}");
                sent.lock().unwrap().insert(id.clone(), Instant::now());
                publish(&js, format!(r#"{{{kind},"id":"{id}"}}"#)).await;
            }
        })
    };
    let mut lat = Vec::with_capacity(n);
    while lat.len() < n {
        let (r, at) = res.next_final(prefix).await;
        let t0 = sent.lock().unwrap()[&r.id];
        lat.push(at - t0);
    }
    pub_task.await.unwrap();
    lat.sort();
    lat
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let par = common::env_usize("SPAWN_PAR", 8);
    let n = common::env_usize("SPAWN_N", 3000);
    let n_tasks = common::env_usize("BENCH_TASKS", 3000);
    let rounds = common::env_usize("SPAWN_ROUNDS", 3);
    println!(
        "spawn: parallelism {par}, {n} spawns / {n_tasks} tasks per measurement, median of {rounds}; {} CPUs",
        std::thread::available_parallelism().map_or(0, |p| p.get())
    );

    // 1. Spawn path.
    let state = tempfile::tempdir().unwrap();
    let runner = Arc::new(
        ProcessRunner::new(
            vec!["bash".into(), "-c".into()],
            &[],
            None,
            state.path(),
            true,
        )
        .unwrap(),
    );
    let cmd_json = r#"{"type":"command","command":"/bin/true"}"#;
    let sh_json = r#"{"type":"shell","payload":"true"}"#;
    let (mut raw_t, mut raw_b, mut jw_c, mut jw_s) = (vec![], vec![], vec![], vec![]);
    for _ in 0..rounds {
        raw_t.push(tokio::task::block_in_place(|| {
            raw_spawn(&["/bin/true"], n, par)
        }));
        jw_c.push(runner_rate(runner.clone(), cmd_json, n, par).await);
        raw_b.push(tokio::task::block_in_place(|| {
            raw_spawn(&["/bin/bash", "-c", "true"], n / 2, par)
        }));
        jw_s.push(runner_rate(runner.clone(), sh_json, n / 2, par).await);
    }
    let (raw_t, raw_b) = (common::median(&raw_t), common::median(&raw_b));
    let (jw_c, jw_s) = (common::median(&jw_c), common::median(&jw_s));
    println!("\n1. spawn path, spawns/s at parallelism {par}");
    println!("  raw posix_spawn /bin/true        {raw_t:>8.0}");
    println!(
        "  jetworker runner command /bin/true {jw_c:>6.0}  {:>5.0} % of raw",
        100.0 * jw_c / raw_t
    );
    println!("  raw posix_spawn bash -c true     {raw_b:>8.0}");
    println!(
        "  jetworker runner shell true      {jw_s:>8.0}  {:>5.0} % of raw",
        100.0 * jw_s / raw_b
    );
    runner.cleanup();
    drop(runner);

    // 2. End to end.
    let server = common::NatsServer::start();
    let client = async_nats::connect(server.url()).await.unwrap();
    let js = jetstream::new(client.clone());
    let mut res = Results(
        client
            .subscribe(format!("{}.>", Names::default().results_prefix))
            .await
            .unwrap(),
    );
    client.flush().await.unwrap();
    let w = WorkerProc::start(&server.url(), &js, par, "bench-spawn").await;
    let idle_rss = w.idle_rss_mib().await;
    let run = std::process::id();
    let server_pid = server.pid().expect("the server runs");
    let (mut cmd, mut shell) = (vec![], vec![]);
    for round in 0..rounds {
        for (kind, prefix, into) in [
            (r#""type":"command","command":"/bin/true""#, "c", &mut cmd),
            (r#""type":"shell","payload":"true""#, "s", &mut shell),
        ] {
            let b = batch(
                &js,
                &mut res,
                &w,
                server_pid,
                kind,
                &format!("{prefix}{run}-{round}-"),
                n_tasks,
            )
            .await;
            into.push(b);
        }
    }
    let med =
        |v: &[Batch], f: fn(&Batch) -> f64| common::median(&v.iter().map(f).collect::<Vec<_>>());
    let (c_rate, c_cpu, c_srv) = (
        med(&cmd, |b| b.rate),
        med(&cmd, |b| b.worker_ms),
        med(&cmd, |b| b.server_ms),
    );
    let (s_rate, s_cpu, s_srv) = (
        med(&shell, |b| b.rate),
        med(&shell, |b| b.worker_ms),
        med(&shell, |b| b.server_ms),
    );
    println!("\n2. end to end, worker process with --slots {par}, containment on");
    println!("  command /bin/true  {c_rate:>6.0} tasks/s  {:>4.0} % of raw posix_spawn (target 80 %)  worker CPU {c_cpu:.3} ms/task (target 0.3)", 100.0 * c_rate / raw_t);
    println!("  shell true         {s_rate:>6.0} tasks/s  {:>4.0} % of raw bash -c true (target 80 %)  worker CPU {s_cpu:.3} ms/task", 100.0 * s_rate / raw_b);
    // The most any worker could reach: the contained spawn path alone (part
    // 1, which keeps the CPUs busy) plus the CPU the broker itself spends
    // per task, and no worker overhead at all.
    let cpus = std::thread::available_parallelism().map_or(1, |p| p.get()) as f64;
    let ceiling = |runner: f64, server_ms: f64| 1.0 / (1.0 / runner + server_ms / 1000.0 / cpus);
    println!(
        "  nats-server CPU per task: command {c_srv:.3} ms, shell {s_srv:.3} ms; ceiling with no \
         worker overhead (runner alone + the server's CPU, {cpus:.0} CPUs): command {:.0} %, \
         shell {:.0} % of raw",
        100.0 * ceiling(jw_c, c_srv) / raw_t,
        100.0 * ceiling(jw_s, s_srv) / raw_b
    );

    // Latency at 100/s, and the references.
    let mut rt = Vec::new();
    let rt_subject = "bench.rt";
    let _ = js
        .create_stream(jetstream::stream::Config {
            name: "BENCHRT".into(),
            subjects: vec![rt_subject.into()],
            storage: jetstream::stream::StorageType::Memory,
            max_messages: 1000,
            ..Default::default()
        })
        .await;
    // The references back to back, and at the tasks' own 100/s: on a VM a
    // lone operation also pays for waking an idle CPU (most of a
    // millisecond for a spawn here), which a back-to-back loop never does.
    let gap = Duration::from_millis(10);
    let mut rt_paced = Vec::new();
    for i in 0..600 {
        if i >= 300 {
            tokio::time::sleep(gap).await;
        }
        let t0 = Instant::now();
        js.publish(rt_subject, "x".into())
            .await
            .unwrap()
            .await
            .unwrap();
        if i < 300 { &mut rt } else { &mut rt_paced }.push(t0.elapsed());
    }
    rt.sort();
    rt_paced.sort();
    let mut sp = Vec::new();
    let mut sp_paced = Vec::new();
    for i in 0..600 {
        if i >= 300 {
            tokio::time::sleep(gap).await;
        }
        let t0 = Instant::now();
        raw_spawn_once(&["/bin/true"]);
        if i < 300 { &mut sp } else { &mut sp_paced }.push(t0.elapsed());
    }
    sp.sort();
    sp_paced.sort();
    let lat = paced(
        &js,
        &mut res,
        r#""type":"command","command":"/bin/true""#,
        &format!("l{run}-"),
        500,
        100.0,
    )
    .await;
    let p50 = |v: &[Duration]| ms(common::percentile(v, 50.0));
    let (rt50, sp50, l50) = (p50(&rt_paced), p50(&sp_paced), p50(&lat));
    println!(
        "  p50 publish→result at 100/s: {l50:.2} ms (p99 {:.2}); target ≤ 2 × {rt50:.2} (JetStream round trip) + {sp50:.2} (raw spawn) + 0.3 = {:.2} ms, references at 100/s",
        ms(common::percentile(&lat, 99.0)),
        2.0 * rt50 + sp50 + 0.3
    );
    println!(
        "    (references back to back: 2 × {:.2} + {:.2} + 0.3 = {:.2} ms)",
        p50(&rt),
        p50(&sp),
        2.0 * p50(&rt) + p50(&sp) + 0.3
    );
    w.stop();

    // RSS: idle, and with 64 tasks running.
    let w = WorkerProc::start(&server.url(), &js, 64, "bench-rss").await;
    let idle64 = w.idle_rss_mib().await;
    for i in 0..64 {
        publish(
            &js,
            format!(r#"{{"type":"command","command":"sleep","args":["3"],"id":"r{run}-{i}"}}"#),
        )
        .await;
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    // 64 tasks plus the watchdog.
    while w.children() < 65 {
        assert!(
            Instant::now() < deadline,
            "64 tasks did not start ({} children)",
            w.children()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let peak = w.peak_rss_mib(20, Duration::from_millis(50)).await;
    for _ in 0..64 {
        res.next_final(&format!("r{run}-")).await;
    }
    println!(
        "  RSS idle {idle_rss:.1} MiB (slots {par}), {idle64:.1} MiB (slots 64); with 64 tasks running {peak:.1} MiB (targets 12 / 24)"
    );
    w.stop();
}
