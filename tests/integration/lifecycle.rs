//! The task lifecycle under the failures listed at the top of issue 8, one
//! test per failure: an oversized message, the same id twice (one worker,
//! two workers), a cancel after a stored success, late writers (a fenced
//! worker's report, a stale outbox entry), a silent partition, and start-up
//! without JetStream; plus what the history checker found (a server
//! restart right after a redelivery, a claim after a shutdown hand-back). Real nats-server, real worker processes; the fault
//! proxy (`proxy.rs`) stands between a worker and the server where a test
//! needs to cut or blackhole one worker's link.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use jetworker::internals::{Entry, Outbox};
use jetworker::protocol::{Status, TaskResult};

use crate::proxy::Proxy;
use crate::util::*;

const T: Duration = Duration::from_secs(40);

/// A shell task as JSON (quotes in the script escaped properly).
fn shell(id: &str, script: &str) -> String {
    serde_json::json!({"id": id, "type": "shell", "payload": script}).to_string()
}

/// Wait until a file holds a pid.
async fn read_pid(path: &Path) -> i32 {
    wait_for(T, "task to write its pid", || async {
        std::fs::read_to_string(path).ok()?.trim().parse().ok()
    })
    .await
}

fn lines(path: &Path) -> Vec<String> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .map(str::to_string)
        .collect()
}

/// Every record of `id` with its stream sequence, oldest first.
async fn record_seqs(js: &async_nats::jetstream::Context, id: &str) -> Vec<(u64, TaskResult)> {
    let stream = js.get_stream("RESULTS").await.unwrap();
    let mut out = Vec::new();
    let mut seq = 0;
    while let Ok(m) = stream
        .direct_get_next_for_subject(format!("results.{id}"), Some(seq + 1))
        .await
    {
        seq = m.sequence;
        out.push((seq, serde_json::from_slice(&m.payload).unwrap()));
    }
    out
}

fn finals(all: &[TaskResult]) -> Vec<&TaskResult> {
    all.iter().filter(|r| r.is_final).collect()
}

/// A script that runs long the first time (writing its pid to `pid`) and
/// prints `second` on every later run; `mkdir` makes "first" atomic.
fn first_run_hangs(dir: &Path) -> String {
    format!(
        "if mkdir {m} 2>/dev/null; then echo $$ > {p}; sleep 600; fi; echo second",
        m = dir.join("first").display(),
        p = dir.join("pid").display()
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_task_is_dead_lettered_truncated_and_the_label_keeps_running() {
    let srv = NatsServer::start();
    let state = tempfile::tempdir().unwrap();
    let _w = ProcWorker::start_in(
        &srv.url(),
        state.path(),
        &["--slots", "2", "--ack-wait", "2s"],
    );
    let js = srv.js().await;
    let max = srv.client().await.server_info().max_payload;
    // A task of exactly max_payload bytes: the server takes it, the worker
    // rejects it (over max_task_bytes), and its DEAD copy cannot be whole.
    let head = r#"{"id":"big","type":"shell","payload":""#;
    let tail = r#""}"#;
    let body = format!("{head}{}{tail}", "y".repeat(max - head.len() - tail.len()));
    assert_eq!(body.len(), max);
    publish_raw(&js, "tasks.default", Bytes::from(body.clone()), None).await;

    let r = final_result(&js, "big", T).await;
    assert_eq!(r.status, Status::Rejected, "{r:?}");
    let dead = js.get_stream("DEAD").await.unwrap();
    let m = dead
        .direct_get_last_for_subject("dead.default.big")
        .await
        .expect("a DEAD copy of the oversized task");
    assert!(
        m.payload.len() < max && !m.payload.is_empty(),
        "the DEAD copy keeps what fits: {} bytes",
        m.payload.len()
    );
    assert!(
        body.as_bytes().starts_with(&m.payload),
        "the DEAD copy is the head of the original"
    );
    assert!(
        m.headers.get("Jetworker-Truncated").is_some(),
        "a header says the copy is truncated: {:?}",
        m.headers
    );

    // The label is not wedged: both slots take new work.
    for i in 0..6 {
        publish_task(
            &js,
            "default",
            &shell(&format!("after{i}"), &format!("echo {i}")),
        )
        .await;
    }
    for i in 0..6 {
        let r = final_result(&js, &format!("after{i}"), T).await;
        assert_eq!(
            (r.status, r.output.as_str()),
            (Status::Success, format!("{i}\n").as_str())
        );
    }
    queue_drained(&js, T, "every task answered").await;
    wait_for(T, "the outbox to be empty", || async {
        (outbox_len(state.path()) == 0).then_some(())
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn same_id_twice_on_one_worker_runs_once() {
    let srv = NatsServer::start();
    let dir = tempfile::tempdir().unwrap();
    let runs = dir.path().join("runs");
    let _w = ProcWorker::start(&srv.url(), &["--slots", "2"]);
    let js = srv.js().await;
    // Long enough for the old Nak-every-2s loop to use up four deliveries.
    let task = shell(
        "dup1",
        &format!("echo $$ >> {}; sleep 10; echo done", runs.display()),
    );
    publish_task(&js, "default", &task).await;
    publish_task(&js, "default", &task).await;
    let r = final_result(&js, "dup1", Duration::from_secs(60)).await;
    assert_eq!((r.status, r.output.as_str()), (Status::Success, "done\n"));
    queue_drained(&js, T, "both messages acked").await;
    assert_eq!(lines(&runs).len(), 1, "ran once: {:?}", lines(&runs));
    let all = all_records(&js, "dup1").await;
    assert_eq!(finals(&all).len(), 1, "one final: {all:?}");
    assert!(
        all.iter().all(|r| r.status != Status::Dead),
        "no dead: {all:?}"
    );
    assert!(last_result(&js, "dup1").await.unwrap().is_final);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn same_id_on_two_workers_runs_once() {
    let srv = NatsServer::start();
    let dir = tempfile::tempdir().unwrap();
    let runs = dir.path().join("runs");
    let overlaps = dir.path().join("overlaps");
    let _a = ProcWorker::start(&srv.url(), &["--slots", "1", "--name", "a"]);
    let _b = ProcWorker::start(&srv.url(), &["--slots", "1", "--name", "b"]);
    let js = srv.js().await;
    wait_for(T, "both workers up", || async {
        (heartbeats(&js).await?.len() == 2).then_some(())
    })
    .await;
    let task = shell(
        "dup2",
        &format!(
            "exec 9>>{lock}; flock -n 9 || echo dup2 >> {o}; echo $$ >> {r}; sleep 5; echo done",
            lock = dir.path().join("lock").display(),
            o = overlaps.display(),
            r = runs.display()
        ),
    );
    publish_task(&js, "default", &task).await;
    publish_task(&js, "default", &task).await;
    let r = final_result(&js, "dup2", T).await;
    assert_eq!(r.status, Status::Success, "{r:?}");
    queue_drained(&js, T, "both messages acked").await;
    assert_eq!(lines(&runs).len(), 1, "ran once: {:?}", lines(&runs));
    assert!(!overlaps.exists(), "two copies ran at the same time");
    let all = all_records(&js, "dup2").await;
    assert_eq!(finals(&all).len(), 1, "one final: {all:?}");
    assert!(last_result(&js, "dup2").await.unwrap().is_final);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_after_success_leaves_the_success() {
    let srv = NatsServer::start();
    let a_state = tempfile::tempdir().unwrap();
    let mut a = ProcWorker::start_opts(
        &srv.url(),
        a_state.path(),
        &["--ack-wait", "2s"],
        &ProcOpts {
            env: vec![("JETWORKER_TEST_FAULT".into(), "die-before-ack".into())],
            ..Default::default()
        },
    );
    let js = srv.js().await;
    publish_task(&js, "default", &shell("cas1", "echo ok")).await;
    let r = final_result(&js, "cas1", T).await;
    assert_eq!(r.status, Status::Success);
    assert_eq!(a.wait_exit(T).await, Some(86), "died before the ack");
    assert_eq!(tasks_left(&js).await, 1, "not acked");
    // The operator cancels a task that already succeeded.
    let kv = js.get_key_value("cancel").await.unwrap();
    kv.put("cas1", "too late".into()).await.unwrap();
    let _b = ProcWorker::start(&srv.url(), &["--ack-wait", "2s"]);
    queue_drained(&js, T, "the redelivery to be acked").await;
    let all = all_records(&js, "cas1").await;
    assert_eq!(finals(&all).len(), 1, "one final: {all:?}");
    let last = all.last().unwrap();
    assert_eq!(
        (last.status, last.is_final),
        (Status::Success, true),
        "the success stays the last record: {all:?}"
    );
    let o = crate::cli::jw(&srv.url(), &["results", "cas1"]).await;
    assert_eq!(
        o.status.code(),
        Some(0),
        "`jetworker results cas1` exits 0: {}{}",
        crate::cli::stdout(&o),
        crate::cli::stderr(&o)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn late_lease_lost_report_after_another_final_is_refused() {
    let srv = NatsServer::start();
    let proxy = Proxy::start(srv.port);
    let dir = tempfile::tempdir().unwrap();
    let a_state = tempfile::tempdir().unwrap();
    let _a = ProcWorker::start_in(
        &proxy.url(),
        a_state.path(),
        &[
            "--ack-wait",
            "3s",
            "--labels",
            "default,only-a",
            "--name",
            "fenced",
        ],
    );
    let js = srv.js().await;
    publish_task(
        &js,
        "default",
        &shell("late1", &first_run_hangs(dir.path())),
    )
    .await;
    let pid = read_pid(&dir.path().join("pid")).await;
    let _b = ProcWorker::start(&srv.url(), &["--ack-wait", "3s", "--name", "other"]);
    // Cut the fenced worker off: it stops its copy after ack wait and
    // keeps a "lease lost" report; the other worker runs the redelivery.
    proxy.cut();
    wait_for(T, "the fenced copy to be stopped", || async {
        (!pid_alive(pid)).then_some(())
    })
    .await;
    let fin = final_result(&js, "late1", T).await;
    assert_eq!(
        (fin.status, fin.output.as_str()),
        (Status::Success, "second\n"),
        "{fin:?}"
    );
    assert!(fin.worker_id.starts_with("other-"), "{fin:?}");
    // Heal the link: the fenced worker is back (it runs a probe only it
    // serves) and its late report has left the outbox.
    proxy.pass();
    publish_task(&js, "only-a", &shell("probe-a", "echo back")).await;
    assert_eq!(
        final_result(&js, "probe-a", T).await.status,
        Status::Success
    );
    wait_for(T, "the fenced worker's outbox to empty", || async {
        (outbox_len(a_state.path()) == 0).then_some(())
    })
    .await;
    let all = all_records(&js, "late1").await;
    assert_eq!(finals(&all).len(), 1, "one final: {all:?}");
    let last = all.last().unwrap();
    assert!(
        last.is_final && last.worker_id == fin.worker_id && last.status == Status::Success,
        "the other worker's final stays the last record: {all:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stale_outbox_entry_replayed_after_a_final_is_dropped() {
    let srv = NatsServer::start();
    let dir = tempfile::tempdir().unwrap();
    let a_state = tempfile::tempdir().unwrap();
    let flags = ["--ack-wait", "2s", "--name", "old"];
    let mut a = ProcWorker::start_in(&srv.url(), a_state.path(), &flags);
    let js = srv.js().await;
    publish_task(
        &js,
        "default",
        &shell("stale1", &first_run_hangs(dir.path())),
    )
    .await;
    let pid = read_pid(&dir.path().join("pid")).await;
    a.kill();
    wait_for(T, "the killed worker's copy to die", || async {
        (!pid_alive(pid)).then_some(())
    })
    .await;
    let _b = ProcWorker::start(&srv.url(), &["--ack-wait", "2s", "--name", "new"]);
    let fin = final_result(&js, "stale1", T).await;
    assert_eq!(
        (fin.status, fin.output.as_str()),
        (Status::Success, "second\n"),
        "{fin:?}"
    );
    // What the first life could have left behind: its attempt's report,
    // written after its claim (running{1}) and never published.
    let claim = record_seqs(&js, "stale1")
        .await
        .into_iter()
        .find(|(_, r)| r.status == Status::Running && r.attempt == 1)
        .expect("the first life's claim");
    let mut stale = TaskResult::blank(
        "stale1",
        "default",
        None,
        Status::Cancelled,
        1,
        3,
        "old-00000000",
        chrono::Utc::now(),
    );
    stale.is_final = false;
    stale.error = Some("lease lost: cut off from NATS".into());
    stale.task_seq = claim.1.task_seq;
    let entry = Entry {
        subject: "results.stale1".into(),
        msg_id: "stale1.1".into(),
        headers: vec![
            ("Jetworker-Status".into(), "cancelled".into()),
            ("Jetworker-Label".into(), "default".into()),
        ],
        expected_last_seq: Some(claim.0),
        cas_only: true,
        payload: serde_json::to_vec(&stale).unwrap().into(),
    };
    Outbox::open(a_state.path()).unwrap().store(&entry).unwrap();
    assert_eq!(outbox_len(a_state.path()), 1);
    let _a2 = ProcWorker::start_in(&srv.url(), a_state.path(), &flags);
    wait_for(T, "the outbox replay", || async {
        (outbox_len(a_state.path()) == 0).then_some(())
    })
    .await;
    let all = all_records(&js, "stale1").await;
    assert_eq!(finals(&all).len(), 1, "one final: {all:?}");
    let last = all.last().unwrap();
    assert!(
        last.is_final && last.worker_id == fin.worker_id,
        "the stale entry did not land after the final: {all:?}"
    );
    assert!(
        all.iter()
            .all(|r| r.status != Status::Cancelled && r.worker_id != "old-00000000"),
        "the stale report was dropped: {all:?}"
    );
}

/// Seconds since the epoch, as the task scripts write them (`date +%s.%N`).
fn now_secs() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs_f64()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_partition_fences_the_copy_before_the_redelivery_starts() {
    let srv = NatsServer::start();
    let proxy = Proxy::start(srv.port);
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let ack_wait = Duration::from_secs(3);
    let a_state = tempfile::tempdir().unwrap();
    let _a = ProcWorker::start_in(
        &proxy.url(),
        a_state.path(),
        &["--ack-wait", "3s", "--name", "fenced"],
    );
    let js = srv.js().await;
    // Every copy logs its start; the first one its stop (on SIGTERM); the
    // flock on fd 9 (kept by the whole process group) detects an overlap.
    let script = format!(
        "exec 9>>{lock}; flock -n 9 || echo part1 >> {o}; \
         echo \"start $(date +%s.%N) $$\" >> {t}; \
         if mkdir {m} 2>/dev/null; then \
           trap 'echo \"stop $(date +%s.%N) $$\" >> {t}; exit 143' TERM; \
           echo $$ > {p}; sleep 600 & wait; \
         fi; echo second",
        lock = d.join("lock").display(),
        o = d.join("overlaps").display(),
        t = d.join("times").display(),
        m = d.join("first").display(),
        p = d.join("pid").display(),
    );
    publish_task(&js, "default", &shell("part1", &script)).await;
    let pid = read_pid(&d.join("pid")).await;
    let _b = ProcWorker::start(&srv.url(), &["--ack-wait", "3s", "--name", "other"]);
    wait_for(T, "the other worker up", || async {
        (heartbeats(&js).await?.len() == 2).then_some(())
    })
    .await;

    // The link goes silent: nothing is closed, nothing gets through.
    let t_blackhole = now_secs();
    proxy.blackhole();
    let watch_until = Instant::now() + ack_wait * 5;
    let mut died_seen: Option<f64> = None;
    while Instant::now() < watch_until {
        if !pid_alive(pid) {
            died_seen = Some(now_secs());
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // The first copy's trap logged "stop <time> <pid>" on SIGTERM.
    let times = lines(&d.join("times"));
    let trap_stop: Option<f64> = times.iter().find_map(|l| {
        let f: Vec<&str> = l.split_whitespace().collect();
        (f.first() == Some(&"stop") && f.get(2) == Some(&pid.to_string().as_str()))
            .then(|| f.get(1)?.parse().ok())
            .flatten()
    });
    // Stopped: the trap's time, else when the test saw the process gone.
    let stopped = trap_stop.or(died_seen);
    let fenced_after = stopped.map(|s| s - t_blackhole);
    assert!(
        fenced_after.is_some_and(|f| f <= (ack_wait + Duration::from_secs(2)).as_secs_f64()),
        "the fenced copy stops within about ack wait of the blackhole: {fenced_after:?} s; \
         task log: {times:?}"
    );
    let stopped = stopped.unwrap();
    proxy.pass();
    let fin = final_result(&js, "part1", T).await;
    assert_eq!(
        (fin.status, fin.output.as_str()),
        (Status::Success, "second\n"),
        "{fin:?}"
    );
    let times = lines(&d.join("times"));
    let second_start: f64 = times
        .iter()
        .filter(|l| l.starts_with("start "))
        .nth(1)
        .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        .expect("the redelivered copy logged its start");
    println!(
        "silent partition (ack wait {ack_wait:?}): the fenced copy stopped {:.2}s after the \
         blackhole, the redelivered copy started {:.2}s after it; overlap {:.3}s \
         (negative: a gap)",
        stopped - t_blackhole,
        second_start - t_blackhole,
        stopped - second_start
    );
    assert!(
        stopped < second_start,
        "the redelivered copy started {:.3}s before the fenced one stopped",
        stopped - second_start
    );
    assert!(!d.join("overlaps").exists(), "flock saw two copies at once");
    let all = all_records(&js, "part1").await;
    assert_eq!(finals(&all).len(), 1, "one final: {all:?}");
    assert!(all.last().unwrap().is_final, "{all:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_restart_never_runs_two_copies_at_once() {
    // Found by the history checker: a nats-server SIGKILLed just after it
    // redelivered a message comes back without that delivery in the
    // consumer's state and hands the message out again, while the copy it
    // started still runs (and still gets its progress acks confirmed).
    let mut srv = NatsServer::start();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let flags = ["--ack-wait", "3s", "--slots", "1"];
    let mut a = ProcWorker::start(&srv.url(), &flags);
    let js = srv.js().await;
    let script = format!(
        "exec 9>>{lock}; flock -n 9 || echo r1 >> {o}; echo \"$$ $ATTEMPT $EPOCHREALTIME\" >> {runs}; \
         sleep 8; echo \"$$ end $EPOCHREALTIME\" >> {runs}; echo done",
        lock = d.join("lock").display(),
        o = d.join("overlaps").display(),
        runs = d.join("runs").display(),
    );
    publish_task(&js, "default", &shell("r1", &script)).await;
    wait_for(T, "the first copy", || async {
        (lines(&d.join("runs")).len() == 1).then_some(())
    })
    .await;
    a.kill();
    let _b = ProcWorker::start(&srv.url(), &flags);
    let _c = ProcWorker::start(&srv.url(), &flags);
    // The redelivery (after ack wait) starts a second copy; SIGKILL the
    // server right then.
    wait_for(T, "the redelivered copy", || async {
        (lines(&d.join("runs")).len() >= 2).then_some(())
    })
    .await;
    let t_restart = now_secs();
    srv.restart();
    let js = srv.js().await;
    let fin = final_result(&js, "r1", T).await;
    assert_eq!(fin.status, Status::Success, "{fin:?}");
    queue_drained(&js, T, "the task acked").await;
    let all = all_records(&js, "r1").await;
    assert!(
        !d.join("overlaps").exists(),
        "a copy started while another ran; server SIGKILLed at {t_restart:.3}; \
         runs (pid attempt start | pid end time): {:?}; records: {:?}",
        lines(&d.join("runs")),
        all.iter()
            .map(|r| (r.status, r.attempt, r.worker_id.clone(), r.task_seq))
            .collect::<Vec<_>>()
    );
    assert_eq!(finals(&all).len(), 1, "{all:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shutdown_hand_back_is_claimed_again_and_finishes() {
    // Found by the history checker: after `queued`, the next claim of the
    // same attempt number must be stored, not mistaken for the earlier one.
    let srv = NatsServer::start();
    let dir = tempfile::tempdir().unwrap();
    let runs = dir.path().join("runs");
    let mut a = ProcWorker::start(&srv.url(), &["--drain-timeout", "1s", "--name", "a"]);
    let js = srv.js().await;
    publish_task(
        &js,
        "default",
        &shell(
            "handback",
            // The first copy outlasts the drain (pull wait + 1 s) whatever
            // the load; the second ends at once.
            &format!(
                "echo \"$$ $ATTEMPT\" >> {r}; if mkdir {m} 2>/dev/null; then sleep 30; fi; echo done",
                r = runs.display(),
                m = dir.path().join("first").display()
            ),
        ),
    )
    .await;
    wait_for(T, "the first copy", || async {
        (!lines(&runs).is_empty()).then_some(())
    })
    .await;
    // Stopped while it runs: handed back, not counted as an attempt.
    a.signal(nix::sys::signal::Signal::SIGTERM);
    assert_eq!(a.wait_exit(T).await, Some(0));
    let _b = ProcWorker::start(&srv.url(), &["--name", "b"]);
    let deadline = Instant::now() + T;
    let fin = loop {
        if let Some(r) = last_result(&js, "handback").await.filter(|r| r.is_final) {
            break r;
        }
        if Instant::now() > deadline {
            panic!(
                "no final result within {T:?}; runs (pid attempt): {:?}; records: {:?}",
                lines(&runs),
                all_records(&js, "handback")
                    .await
                    .iter()
                    .map(|r| (r.status, r.attempt, r.worker_id.clone()))
                    .collect::<Vec<_>>()
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(
        (fin.status, fin.output.as_str(), fin.attempt),
        (Status::Success, "done\n", 1),
        "{fin:?}"
    );
    assert!(fin.worker_id.starts_with("b-"), "{fin:?}");
    queue_drained(&js, T, "the task acked").await;
    assert_eq!(lines(&runs).len(), 2, "{:?}", lines(&runs));
    let all = all_records(&js, "handback").await;
    let shape: Vec<(Status, u32)> = all.iter().map(|r| (r.status, r.attempt)).collect();
    assert_eq!(
        shape,
        vec![
            (Status::Running, 1),
            (Status::Queued, 0),
            (Status::Running, 1),
            (Status::Success, 1)
        ],
        "{all:?}"
    );
}

/// Poll a worker's log until `pred` holds; panic if the worker exits.
async fn wait_log(w: &mut ProcWorker, log: &PathBuf, what: &str, pred: impl Fn(&str) -> bool) {
    let deadline = Instant::now() + T;
    loop {
        let text = std::fs::read_to_string(log).unwrap_or_default();
        if let Some(st) = w.child.try_wait().unwrap() {
            panic!("the worker exited ({st}) while waiting for {what}; its log:\n{text}");
        }
        if pred(&text) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "timed out waiting for {what}; log:\n{text}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn start_up_without_jetstream_retries_until_it_is_there() {
    let mut srv = NatsServer::start_without_jetstream();
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("worker.log");
    let mut w = ProcWorker::start_opts(
        &srv.url(),
        &dir.path().join("state"),
        &[],
        &ProcOpts {
            log: Some(log.clone()),
            log_level: Some("info"),
            ..Default::default()
        },
    );
    wait_log(&mut w, &log, "a log line saying it retries", |t| {
        t.lines().any(|l| {
            let l = l.to_ascii_lowercase();
            l.contains("jetstream") && l.contains("retr")
        })
    })
    .await;
    // JetStream arrives on the same port.
    srv.set_jetstream(true);
    srv.restart();
    let js = srv.js().await;
    publish_task(&js, "default", &shell("after-js", "echo ok")).await;
    let r = final_result(&js, "after-js", Duration::from_secs(60)).await;
    assert_eq!((r.status, r.output.as_str()), (Status::Success, "ok\n"));
    assert!(w.child.try_wait().unwrap().is_none(), "still running");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn start_up_configuration_errors_still_exit_2() {
    let srv = NatsServer::start_without_jetstream();
    let state = tempfile::tempdir().unwrap();
    let st = state.path().to_str().unwrap();
    for (args, setting) in [
        (vec!["run", "--state-dir", st, "--slots", "0"], "slots"),
        (
            vec!["run", "--state-dir", st, "--labels", "no spaces"],
            "labels",
        ),
        (
            vec!["run", "--state-dir", st, "--ack-wait", "10ms"],
            "ack_wait",
        ),
    ] {
        let o = crate::cli::jw(&srv.url(), &args).await;
        let err = crate::cli::stderr(&o);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {err}");
        assert!(
            err.replace('-', "_").contains(setting),
            "{args:?} names {setting}: {err}"
        );
    }
}

#[test]
fn systemd_unit_restarts_on_every_exit_but_2() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/jetworker.service");
    let text = std::fs::read_to_string(&path).unwrap();
    let mut section = "";
    let mut service: Vec<(&str, &str)> = Vec::new();
    for l in text.lines().map(str::trim) {
        if l.starts_with('[') {
            section = l;
        } else if section == "[Service]" && !l.starts_with('#') {
            if let Some((k, v)) = l.split_once('=') {
                service.push((k.trim(), v.trim()));
            }
        }
    }
    let get = |k: &str| -> Vec<&str> {
        service
            .iter()
            .filter(|(key, _)| *key == k)
            .map(|(_, v)| *v)
            .collect()
    };
    assert_eq!(
        get("Restart"),
        vec!["always"],
        "restart after any exit (a clean 0 included)"
    );
    assert_eq!(
        get("RestartPreventExitStatus"),
        vec!["2"],
        "only a configuration error (2) stops the restarts"
    );
    assert!(
        get("SuccessExitStatus").is_empty(),
        "no other exit code treated specially: {:?}",
        get("SuccessExitStatus")
    );
    // Readiness and the watchdog (tested in operators.rs) are only heard
    // with Type=notify and a WatchdogSec.
    assert_eq!(get("Type"), vec!["notify"]);
    assert_eq!(get("WatchdogSec").len(), 1);
}
