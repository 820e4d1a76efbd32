//! The worker under failure (issue 3): SIGKILLed workers, a crash between
//! result and ack, NATS outages, lost leases, attempts used up by lost
//! deliveries, floods of bad input, cancellation, resource limits and the
//! task user. Real worker processes, a real server.

use std::time::Duration;

use jetworker::protocol::Status;
use nix::sys::signal::Signal;

use crate::util::*;

const T: Duration = Duration::from_secs(40);

/// Wait until a file exists and holds a pid.
async fn read_pid(path: &std::path::Path) -> i32 {
    wait_for(T, "task to write its pid", || async {
        std::fs::read_to_string(path).ok()?.trim().parse().ok()
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkilled_worker_task_is_redelivered_and_its_processes_die() {
    let srv = NatsServer::start();
    let dir = tempfile::tempdir().unwrap();
    let pidfile = dir.path().join("pid");
    let bgfile = dir.path().join("bg");
    let mut a = ProcWorker::start(&srv.url(), &["--ack-wait", "2s"]);
    let js = srv.js().await;
    publish_task(
        &js,
        "default",
        &format!(
            r#"{{"id":"victim","type":"shell","payload":"if [ $ATTEMPT = 1 ]; then sleep 600 & echo $! > {bg}; echo $$ > {pid}; sleep 600; fi; echo done $ATTEMPT"}}"#,
            bg = bgfile.display(),
            pid = pidfile.display()
        ),
    )
    .await;
    let shell = read_pid(&pidfile).await;
    let bg = read_pid(&bgfile).await;
    a.kill();
    // The script and its background child die with the worker.
    wait_for(Duration::from_secs(5), "script to die", || async {
        (!pid_alive(shell)).then_some(())
    })
    .await;
    wait_for(
        Duration::from_secs(5),
        "background sleep to die",
        || async { (!pid_alive(bg)).then_some(()) },
    )
    .await;
    let _b = ProcWorker::start(&srv.url(), &["--ack-wait", "2s"]);
    let r = final_result(&js, "victim", T).await;
    assert_eq!(r.status, Status::Success, "{r:?}");
    assert_eq!(r.output, "done 2\n");
    assert_eq!(
        all_results(&js, "victim").await.len(),
        1,
        "exactly one result"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crash_between_result_and_ack_is_not_run_again() {
    let srv = NatsServer::start();
    let dir = tempfile::tempdir().unwrap();
    let runs = dir.path().join("runs");
    let mut child = std::process::Command::new(jetworker_bin());
    child
        .args([
            "run",
            "--server",
            &srv.url(),
            "--ack-wait",
            "2s",
            "--state-dir",
        ])
        .arg(dir.path().join("a"))
        .env("JETWORKER_TEST_FAULT", "die-before-ack")
        .env("LOG_LEVEL", "warn");
    let mut a = child.spawn().unwrap();
    let js = srv.js().await;
    publish_task(
        &js,
        "default",
        &format!(
            r#"{{"id":"once","type":"shell","payload":"echo run >> {}"}}"#,
            runs.display()
        ),
    )
    .await;
    let r = final_result(&js, "once", T).await;
    assert_eq!(r.status, Status::Success);
    let st = a.wait().unwrap();
    assert_eq!(st.code(), Some(86), "the fault hook exits before the ack");
    assert_eq!(tasks_left(&js).await, 1, "not acked");
    let _b = ProcWorker::start(&srv.url(), &["--ack-wait", "2s"]);
    queue_drained(&js, T, "the redelivery to be acked").await;
    assert_eq!(std::fs::read_to_string(&runs).unwrap(), "run\n", "ran once");
    assert_eq!(all_results(&js, "once").await.len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_outage_results_wait_in_the_outbox() {
    let mut srv = NatsServer::start();
    let _w = ProcWorker::start(&srv.url(), &["--slots", "4"]);
    let js = srv.js().await;
    for i in 0..3 {
        publish_task(
            &js,
            "default",
            &format!(r#"{{"id":"out{i}","type":"shell","payload":"sleep 2; echo {i}"}}"#),
        )
        .await;
    }
    // Wait until they run, then cut NATS off for 10 s.
    wait_for(T, "3 running", || async {
        (heartbeats(&js).await?.first()?.running == 3).then_some(())
    })
    .await;
    srv.stop();
    tokio::time::sleep(Duration::from_secs(10)).await;
    srv.restart();
    let js = srv.js().await;
    for i in 0..3 {
        let r = final_result(&js, &format!("out{i}"), T).await;
        assert_eq!(r.status, Status::Success);
        assert_eq!(r.output, format!("{i}\n"));
    }
    queue_drained(&js, T, "acks after the results").await;
    for i in 0..3 {
        assert_eq!(
            all_results(&js, &format!("out{i}")).await.len(),
            1,
            "out{i} once"
        );
    }
    // It keeps pulling after the outage.
    publish_task(
        &js,
        "default",
        r#"{"id":"after-outage","type":"shell","payload":"echo ok"}"#,
    )
    .await;
    assert_eq!(
        final_result(&js, "after-outage", T).await.status,
        Status::Success
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn outbox_survives_a_worker_restart() {
    let mut srv = NatsServer::start();
    let state = tempfile::tempdir().unwrap();
    let mut w = ProcWorker::start_in(
        &srv.url(),
        state.path(),
        &["--drain-timeout", "1s", "--kill-grace", "1s"],
    );
    let js = srv.js().await;
    publish_task(
        &js,
        "default",
        r#"{"id":"boxed","type":"shell","payload":"sleep 2; echo kept"}"#,
    )
    .await;
    wait_for(T, "task to start", || async {
        std::fs::read_dir(state.path().join("work"))
            .ok()?
            .next()
            .map(|_| ())
    })
    .await;
    srv.stop();
    // The task finishes while NATS is down: its result goes to the outbox.
    wait_for(T, "outbox entry", || async {
        std::fs::read_dir(state.path().join("outbox"))
            .ok()?
            .flatten()
            .find(|e| e.path().extension().is_some_and(|x| x == "msg"))
            .map(|_| ())
    })
    .await;
    w.signal(Signal::SIGTERM);
    assert_eq!(w.wait_exit(T).await, Some(0));
    srv.restart();
    let _w2 = ProcWorker::start_in(&srv.url(), state.path(), &[]);
    let js = srv.js().await;
    let r = final_result(&js, "boxed", T).await;
    assert_eq!((r.status, r.output.as_str()), (Status::Success, "kept\n"));
    queue_drained(&js, T, "the redelivery to be acked without running").await;
    assert_eq!(all_results(&js, "boxed").await.len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lost_lease_kills_the_copy_and_never_acks() {
    let mut srv = NatsServer::start();
    let dir = tempfile::tempdir().unwrap();
    let pidfile = dir.path().join("pid");
    let _w = ProcWorker::start(&srv.url(), &["--ack-wait", "2s"]);
    let js = srv.js().await;
    publish_task(
        &js,
        "default",
        &format!(
            r#"{{"id":"leased","type":"shell","payload":"if [ $ATTEMPT = 1 ]; then echo $$ > {}; sleep 600; fi; echo second"}}"#,
            pidfile.display()
        ),
    )
    .await;
    let pid = read_pid(&pidfile).await;
    srv.stop();
    // Cut off longer than ack wait: the copy is killed.
    wait_for(Duration::from_secs(15), "copy killed", || async {
        (!pid_alive(pid)).then_some(())
    })
    .await;
    srv.restart();
    let js = srv.js().await;
    let r = final_result(&js, "leased", T).await;
    assert_eq!(r.status, Status::Success, "{r:?}");
    assert_eq!(r.attempt, 2);
    let all = all_results(&js, "leased").await;
    let lost: Vec<_> = all
        .iter()
        .filter(|r| r.status == Status::Cancelled)
        .collect();
    assert_eq!(lost.len(), 1, "{all:?}");
    assert!(!lost[0].is_final);
    assert!(lost[0].error.as_deref().unwrap().contains("lease lost"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deliveries_past_max_attempts_go_dead() {
    let srv = NatsServer::start();
    let dir = tempfile::tempdir().unwrap();
    let pidfile = dir.path().join("pid");
    let mut a = ProcWorker::start(&srv.url(), &["--ack-wait", "2s"]);
    let js = srv.js().await;
    publish_task(
        &js,
        "default",
        &format!(r#"{{"id":"doomed","type":"shell","retry":{{"max_attempts":1}},"payload":"echo $$ > {}; sleep 600"}}"#, pidfile.display()),
    )
    .await;
    read_pid(&pidfile).await;
    a.kill();
    let _b = ProcWorker::start(&srv.url(), &["--ack-wait", "2s"]);
    let r = final_result(&js, "doomed", T).await;
    assert_eq!(r.status, Status::Dead, "{r:?}");
    assert_eq!(r.attempt, 2);
    assert!(r.error.unwrap().contains("max_attempts"));
    let dead = js.get_stream("DEAD").await.unwrap();
    let m = dead
        .direct_get_last_for_subject("dead.default.doomed")
        .await
        .unwrap();
    assert!(std::str::from_utf8(&m.payload)
        .unwrap()
        .contains("sleep 600"));
    assert!(m
        .headers
        .get("Jetworker-Reason")
        .unwrap()
        .as_str()
        .contains("max_attempts"));
    queue_drained(&js, T, "terminated").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn thousand_bad_among_thousand_good() {
    let srv = NatsServer::start_with(&["max_payload: 4MB"]);
    let _w = InProcWorker::start(|c| c.slots = 8, &srv.url());
    let js = srv.js().await;
    let huge = format!(
        r#"{{"type":"shell","payload":"{}"}}"#,
        "y".repeat(2 * 1024 * 1024)
    );
    let bad: Vec<Vec<u8>> = vec![
        b"{oops".to_vec(),
        b"42".to_vec(),
        br#"{"type":"teleport"}"#.to_vec(),
        br#"{"type":"shell","payload":"x","colour":"red"}"#.to_vec(),
        br#"{"type":"shell","payload":"x","retry":{"max_attempts":"many"}}"#.to_vec(),
        br#"{"type":"shell","payload":"x","shard":{"no":3,"total":1}}"#.to_vec(),
        br#"{"type":"shell","payload":"x","id":"no spaces"}"#.to_vec(),
        huge.into_bytes(),
        vec![0xde, 0xad, 0xbe, 0xef, 0x00, 0xff],
    ];
    for i in 0..2000usize {
        if i % 2 == 0 {
            let body = format!(r#"{{"id":"good{i}","type":"command","command":"true"}}"#);
            publish_raw(&js, "tasks.default", body.into(), None).await;
        } else {
            let b = bad[(i / 2) % bad.len()].clone();
            publish_raw(&js, "tasks.default", b.into(), Some(&format!("bad{i}"))).await;
        }
    }
    for i in (0..2000usize).step_by(2) {
        let r = final_result(&js, &format!("good{i}"), Duration::from_secs(120)).await;
        assert_eq!(r.status, Status::Success, "good{i}");
    }
    wait_for(Duration::from_secs(60), "1000 dead letters", || async {
        let mut d = js.get_stream("DEAD").await.ok()?;
        (d.info().await.ok()?.state.messages == 1000).then_some(())
    })
    .await;
    queue_drained(&js, T, "queue empty").await;
    for i in (1..2000usize).step_by(2).take(50) {
        // A type no worker of the label runs is not invalid: it is handed
        // back, then dead once its deliveries are used up.
        let want = if (i / 2) % bad.len() == 2 {
            Status::Dead
        } else {
            Status::Rejected
        };
        assert_eq!(
            last_result(&js, &format!("bad{i}")).await.unwrap().status,
            want,
            "bad{i}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_running_and_queued() {
    let srv = NatsServer::start();
    let _a = ProcWorker::start(&srv.url(), &["--slots", "1", "--kill-grace", "1s"]);
    let _b = ProcWorker::start(&srv.url(), &["--slots", "1", "--kill-grace", "1s"]);
    let js = srv.js().await;
    let kv = wait_for(T, "cancel bucket", || async {
        js.get_key_value("cancel").await.ok()
    })
    .await;
    let dir = tempfile::tempdir().unwrap();
    for n in ["c1", "c2"] {
        publish_task(
            &js,
            "default",
            &format!(r#"{{"id":"{n}","type":"shell","payload":"echo $$ > {}/{n}; trap '' TERM; sleep 600"}}"#, dir.path().display()),
        )
        .await;
    }
    let p1 = read_pid(&dir.path().join("c1")).await;
    let p2 = read_pid(&dir.path().join("c2")).await;
    // Both slots busy: this one waits in the queue.
    publish_task(
        &js,
        "default",
        r#"{"id":"c3","type":"shell","payload":"echo should-not-run"}"#,
    )
    .await;
    kv.put("c3", "not needed".into()).await.unwrap();
    kv.put("c1", "operator said so".into()).await.unwrap();
    kv.put("c2", "".into()).await.unwrap();
    let r1 = final_result(&js, "c1", T).await;
    assert_eq!(r1.status, Status::Cancelled);
    assert_eq!(r1.error.as_deref(), Some("operator said so"));
    let r2 = final_result(&js, "c2", T).await;
    assert_eq!(r2.status, Status::Cancelled);
    assert!(
        r2.duration_ms >= 1000,
        "TERM ignored, killed after the grace period"
    );
    assert!(!pid_alive(p1) && !pid_alive(p2));
    let r3 = final_result(&js, "c3", T).await;
    assert_eq!(r3.status, Status::Cancelled);
    assert!(r3.error.unwrap().contains("before it started"));
    assert_eq!(r3.output, "");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resource_limits_are_enforced() {
    let srv = NatsServer::start();
    let _w = InProcWorker::start(|_| {}, &srv.url());
    let js = srv.js().await;
    publish_task(
        &js,
        "default",
        r#"{"id":"nofile","type":"shell","limits":{"nofile":64},"payload":"ulimit -n"}"#,
    )
    .await;
    publish_task(
        &js,
        "default",
        r#"{"id":"mem","type":"shell","retry":{"max_attempts":1},"limits":{"memory":"64MiB"},"payload":"x=$(head -c 200000000 /dev/zero | tr '\\0' a); echo ${#x}"}"#,
    )
    .await;
    publish_task(
        &js,
        "default",
        r#"{"id":"cpu","type":"shell","retry":{"max_attempts":1},"limits":{"cpu_seconds":1},"payload":"while :; do :; done"}"#,
    )
    .await;
    publish_task(
        &js,
        "default",
        r#"{"id":"after-limits","type":"shell","payload":"echo fine"}"#,
    )
    .await;
    assert_eq!(final_result(&js, "nofile", T).await.output, "64\n");
    let r = final_result(&js, "mem", T).await;
    assert_eq!(r.status, Status::Failed, "{r:?}");
    assert!(r.error.unwrap().contains("memory limit 64MiB"));
    let r = final_result(&js, "cpu", T).await;
    assert_eq!(r.status, Status::Failed, "{r:?}");
    assert!(r.error.unwrap().contains("CPU time limit"));
    assert_eq!(final_result(&js, "after-limits", T).await.output, "fine\n");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tasks_run_as_the_task_user() {
    if !nix::unistd::Uid::effective().is_root() {
        skip("tasks_run_as_the_task_user needs root");
        return;
    }
    let srv = NatsServer::start();
    let _w = InProcWorker::start(|c| c.task_user = Some("nobody".into()), &srv.url());
    let js = srv.js().await;
    publish_task(
        &js,
        "default",
        r#"{"id":"who","type":"shell","payload":"id -u; id -g; touch file && echo wrote"}"#,
    )
    .await;
    let r = final_result(&js, "who", T).await;
    assert_eq!(r.status, Status::Success, "{r:?}");
    let nobody = nix::unistd::User::from_name("nobody").unwrap().unwrap();
    assert_eq!(r.output, format!("{}\n{}\nwrote\n", nobody.uid, nobody.gid));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn per_task_cgroup_bounds_the_whole_tree() {
    if let Err(why) = jetworker::internals::Cgroups::detect() {
        skip(&format!(
            "per_task_cgroup_bounds_the_whole_tree: no writable cgroup tree ({why})"
        ));
        return;
    }
    let srv = NatsServer::start();
    let _w = InProcWorker::start(|_| {}, &srv.url());
    let js = srv.js().await;
    let dir = tempfile::tempdir().unwrap();
    let escaped = dir.path().join("escaped");
    // A process that leaves the process group still dies with the attempt.
    publish_task(
        &js,
        "default",
        &format!(
            r#"{{"id":"cg-escape","type":"shell","limits":{{"memory":"256MiB"}},"payload":"setsid sleep 600 & echo $! > {}; echo ok"}}"#,
            escaped.display()
        ),
    )
    .await;
    let r = final_result(&js, "cg-escape", T).await;
    assert_eq!(r.status, Status::Success, "{r:?}");
    let pid = read_pid(&escaped).await;
    wait_for(Duration::from_secs(5), "escaped process to die", || async {
        (!pid_alive(pid)).then_some(())
    })
    .await;
    // Memory over the limit: killed by the OOM killer, reported as such.
    publish_task(
        &js,
        "default",
        r#"{"id":"cg-oom","type":"shell","retry":{"max_attempts":1},"limits":{"memory":"32MiB"},"payload":"x=$(head -c 200000000 /dev/zero | tr '\\0' a); echo ${#x}"}"#,
    )
    .await;
    let r = final_result(&js, "cg-oom", T).await;
    assert_eq!(r.status, Status::Failed, "{r:?}");
    let err = r.error.unwrap();
    assert!(err.contains("memory limit 32MiB exceeded"), "{err}");
    // pids: forks beyond the limit fail.
    publish_task(
        &js,
        "default",
        r#"{"id":"cg-pids","type":"shell","retry":{"max_attempts":1},"limits":{"pids":8},"payload":"for i in $(seq 30); do sleep 2 & done; wait"}"#,
    )
    .await;
    let r = final_result(&js, "cg-pids", T).await;
    assert!(
        r.output.contains("fork") || r.output.contains("Resource temporarily unavailable"),
        "{r:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lost_lease_with_keep_lets_the_copy_finish() {
    let mut srv = NatsServer::start();
    let dir = tempfile::tempdir().unwrap();
    let pidfile = dir.path().join("pid");
    let _w = ProcWorker::start(&srv.url(), &["--ack-wait", "2s", "--on-lease-lost", "keep"]);
    let js = srv.js().await;
    publish_task(
        &js,
        "default",
        &format!(
            r#"{{"id":"kept","type":"shell","payload":"echo $$ > {}; sleep 6; echo finished $ATTEMPT"}}"#,
            pidfile.display()
        ),
    )
    .await;
    let pid = read_pid(&pidfile).await;
    srv.stop();
    tokio::time::sleep(Duration::from_secs(4)).await;
    assert!(pid_alive(pid), "keep: the copy runs on past the lost lease");
    srv.restart();
    let js = srv.js().await;
    let first = wait_for(T, "the kept copy's result", || async {
        all_results(&js, "kept")
            .await
            .into_iter()
            .find(|r| r.attempt == 1)
    })
    .await;
    assert_eq!(first.status, Status::Success, "{first:?}");
    assert_eq!(first.output, "finished 1\n");
}
