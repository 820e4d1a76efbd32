//! The operator CLI with a real worker (the built binary) behind it: what
//! an operator sees when tasks actually run, fail, get cancelled, die and
//! fire from schedules.

use std::collections::BTreeSet;
use std::time::Duration;

use jetworker::protocol::{Heartbeat, Status, TaskResult};

use crate::cli::{assert_exit, jw, stdout, Running};
use crate::util::{final_result, last_result, wait_for, NatsServer, ProcWorker};

const T: Duration = Duration::from_secs(30);

/// The heartbeats `jetworker workers --json` prints.
async fn workers(url: &str) -> Vec<Heartbeat> {
    let o = jw(url, &["workers", "--json"]).await;
    if o.status.code() != Some(0) {
        return vec![];
    }
    stdout(&o)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// Start a worker and wait until it is online.
async fn worker(url: &str, extra: &[&str]) -> (ProcWorker, Heartbeat) {
    let w = ProcWorker::start(url, extra);
    let pid = w.pid() as u32;
    let hb = wait_for(T, "worker online", || async {
        workers(url).await.into_iter().find(|h| h.pid == pid)
    })
    .await;
    (w, hb)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn submit_wait_exit_codes_with_a_worker() {
    let srv = NatsServer::start();
    let url = srv.url();
    let (_w, _) = worker(&url, &[]).await;

    let o = jw(
        &url,
        &[
            "submit", "--wait", "--", "echo", "hello", "from", "a", "task",
        ],
    )
    .await;
    assert_exit(&o, 0);
    let out = stdout(&o);
    assert!(out.contains("success (attempt 1/3"), "{out}");
    assert!(out.contains("hello from a task"), "{out}");

    let o = jw(
        &url,
        &[
            "submit",
            "--wait",
            "--retries",
            "0",
            "--",
            "echo no; exit 3",
        ],
    )
    .await;
    assert_exit(&o, 1);
    let out = stdout(&o);
    assert!(
        out.contains("failed (attempt 1/1") && out.contains("exit 3"),
        "{out}"
    );

    // A typo never reaches the worker.
    let o = jw(
        &url,
        &["submit", "--wait", "--timeout", "5 parsecs", "--", "true"],
    )
    .await;
    assert_exit(&o, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shards_fan_out_with_distinct_shard_no() {
    let srv = NatsServer::start();
    let url = srv.url();
    let (_w, _) = worker(&url, &[]).await;
    let o = jw(
        &url,
        &[
            "submit",
            "--id",
            "fan",
            "--shards",
            "4",
            "--wait",
            "--json",
            "--",
            "echo shard $SHARD_NO of $SHARD_TOTAL",
        ],
    )
    .await;
    assert_exit(&o, 0);
    let results: Vec<TaskResult> = stdout(&o)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(results.len(), 4);
    let outputs: BTreeSet<String> = results
        .iter()
        .map(|r| r.output.trim().to_string())
        .collect();
    let want: BTreeSet<String> = (0..4).map(|i| format!("shard {i} of 4")).collect();
    assert_eq!(outputs, want);
    let ids: BTreeSet<String> = results.iter().map(|r| r.id.clone()).collect();
    assert_eq!(ids, (0..4).map(|i| format!("fan-{i}")).collect());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_watch_sees_a_sigkilled_worker_go_offline() {
    let srv = NatsServer::start();
    let url = srv.url();
    let (mut w, hb) = worker(&url, &["--labels", "default,gpu"]).await;
    let o = jw(&url, &["workers"]).await;
    assert_exit(&o, 0);
    let out = stdout(&o);
    assert!(out.contains(&hb.id) && out.contains("default,gpu"), "{out}");

    let mut watch = Running::spawn(&url, &["workers", "--watch"]);
    watch.expect(&[&hb.id], T).await;
    w.kill();
    // Offline TTL is 3s: the expiry marker arrives a few seconds later.
    watch.expect(&["offline", &hb.id, "expired"], T).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_stops_a_running_sleep() {
    let srv = NatsServer::start();
    let url = srv.url();
    let (_w, _) = worker(&url, &[]).await;
    let o = jw(&url, &["submit", "--id", "nap", "--", "sleep 60"]).await;
    assert_exit(&o, 0);
    wait_for(T, "nap running", || async {
        workers(&url)
            .await
            .iter()
            .any(|h| h.tasks.iter().any(|t| t == "nap"))
            .then_some(())
    })
    .await;
    let o = jw(&url, &["cancel", "nap", "--reason", "operator said so"]).await;
    assert_exit(&o, 0);
    // The message comes from the result: it ran, and on which worker.
    let out = stdout(&o);
    assert!(out.contains("running attempt on proc-"), "{out}");
    assert!(out.contains("stopped after"), "{out}");
    let js = srv.js().await;
    let r = final_result(&js, "nap", T).await;
    assert_eq!(r.status, Status::Cancelled);
    assert!(r.duration_ms < 30_000, "{r:?}");
    let o = jw(&url, &["results", "nap"]).await;
    assert_exit(&o, 1);
    assert!(stdout(&o).contains("cancelled"), "{}", stdout(&o));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logs_follow_streams_output_before_the_task_ends() {
    let srv = NatsServer::start();
    let url = srv.url();
    let (_w, _) = worker(&url, &[]).await;
    let js = srv.js().await;
    let mut f = Running::spawn(&url, &["logs", "--follow", "chatty"]);
    tokio::time::sleep(Duration::from_millis(500)).await;
    let o = jw(
        &url,
        &[
            "submit",
            "--id",
            "chatty",
            "--",
            "echo first line; sleep 3; echo last line",
        ],
    )
    .await;
    assert_exit(&o, 0);
    f.expect(&["first line"], T).await;
    assert!(
        last_result(&js, "chatty")
            .await
            .is_none_or(|r| r.status == Status::Running),
        "the first line must arrive while the task still runs"
    );
    f.expect(&["last line"], T).await;
    assert_eq!(f.exit_code(T).await, Some(0));
    // Afterwards: the stored output.
    let o = jw(&url, &["logs", "chatty"]).await;
    assert_exit(&o, 0);
    assert_eq!(stdout(&o), "first line\nlast line\n");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_letter_listed_and_replayed_under_a_new_id() {
    let srv = NatsServer::start();
    let url = srv.url();
    // A worker that runs only command tasks dead-letters a shell task with
    // no attempts left.
    let (mut picky, _) = worker(&url, &["--types", "command"]).await;
    let o = jw(
        &url,
        &[
            "submit",
            "--id",
            "orphan",
            "--retries",
            "0",
            "--",
            "echo replayed",
        ],
    )
    .await;
    assert_exit(&o, 0);
    let js = srv.js().await;
    let r = final_result(&js, "orphan", T).await;
    assert_eq!(r.status, Status::Dead);
    let o = wait_for(T, "dead letter listed", || async {
        let o = jw(&url, &["dead"]).await;
        stdout(&o).contains("orphan").then_some(o)
    })
    .await;
    assert!(stdout(&o).contains("runs type shell"), "{}", stdout(&o));
    let o = jw(&url, &["dead", "--json"]).await;
    let d: serde_json::Value = serde_json::from_str(stdout(&o).trim()).unwrap();
    assert_eq!(d["id"], "orphan");
    assert!(d["task"].as_str().unwrap().contains("echo replayed"), "{d}");
    picky.kill();

    let (_w, _) = worker(&url, &[]).await;
    let o = jw(&url, &["dead", "replay", "orphan"]).await;
    assert_exit(&o, 0);
    assert!(stdout(&o).contains("orphan-r1"), "{}", stdout(&o));
    let r = final_result(&js, "orphan-r1", T).await;
    assert_eq!(r.status, Status::Success);
    assert_eq!(r.output, "replayed\n");
    assert_eq!(r.max_attempts, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn schedule_every_second_runs_with_distinct_ids_until_removed() {
    let srv = NatsServer::start();
    let url = srv.url();
    let (_w, _) = worker(&url, &["--labels", "sched"]).await;
    let o = jw(
        &url,
        &[
            "schedule",
            "add",
            "tick",
            "--every",
            "1s",
            "-l",
            "sched",
            "--",
            "echo $SCHEDULE_INSTANCE_ID",
        ],
    )
    .await;
    assert_exit(&o, 0);
    let ids = |o: &std::process::Output| -> BTreeSet<String> {
        stdout(o)
            .lines()
            .filter_map(|l| serde_json::from_str::<TaskResult>(l).ok())
            .filter(|r| r.status == Status::Success)
            .map(|r| {
                assert_eq!(r.output.trim(), r.id, "SCHEDULE_INSTANCE_ID is the id");
                r.id
            })
            .collect()
    };
    let seen = wait_for(T, "3 firings with distinct ids", || async {
        let o = jw(
            &url,
            &["results", "--json", "--label", "sched", "--limit", "0"],
        )
        .await;
        let s = ids(&o);
        (s.len() >= 3).then_some(s)
    })
    .await;
    for id in &seen {
        assert!(id.starts_with("tick-") && id.ends_with('Z'), "{id}");
    }
    let o = jw(&url, &["schedule", "rm", "tick"]).await;
    assert_exit(&o, 0);
    tokio::time::sleep(Duration::from_secs(2)).await;
    let count = || async {
        ids(&jw(
            &url,
            &["results", "--json", "--label", "sched", "--limit", "0"],
        )
        .await)
        .len()
    };
    let n = count().await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(count().await, n, "still firing after schedule rm");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn worker_log_file_has_no_escape_codes() {
    let srv = NatsServer::start();
    let url = srv.url();
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("worker.log");
    // stderr is a file, not a terminal; NO_COLOR is not set.
    let mut child = std::process::Command::new(crate::util::jetworker_bin())
        .args(["run", "--server", &url, "--name", "plain", "--state-dir"])
        .arg(dir.path().join("state"))
        .args(["--heartbeat", "500ms", "--offline-after", "3s"])
        .env_remove("NO_COLOR")
        .env("LOG_LEVEL", "info")
        .env("XDG_CONFIG_HOME", "/nonexistent-jetworker-test")
        .stdin(std::process::Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let o = jw(
        &url,
        &["submit", "--wait", "--id", "plain-1", "--", "exit 4"],
    )
    .await;
    assert_exit(&o, 1);
    let _ = nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(child.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    );
    let _ = child.wait();
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(text.contains("INFO"), "the worker logged at info: {text}");
    assert!(
        !text.contains('\x1b'),
        "escape codes in the log file:\n{text}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn submit_wait_says_when_no_worker_serves_the_label() {
    let srv = NatsServer::start();
    let url = srv.url();
    let (_w, _) = worker(&url, &["--labels", "cpu"]).await;
    let mut run = Running::spawn(&url, &["submit", "--wait", "-l", "gpu", "--", "true"]);
    let l = run.expect_err("no worker online serves label gpu", T).await;
    assert!(l.contains("1 online"), "{l}");
    assert!(l.contains("jetworker run --labels gpu"), "{l}");
    // A label that is served: no such line.
    let o = jw(&url, &["submit", "--wait", "-l", "cpu", "--", "true"]).await;
    assert_exit(&o, 0);
    assert!(
        !crate::cli::stderr(&o).contains("no worker"),
        "{}",
        crate::cli::stderr(&o)
    );
}
