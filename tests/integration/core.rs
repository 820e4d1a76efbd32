//! The core worker (issue 2): pull, run, report, then ack; validation;
//! environment; output cap; timeouts; retries; progress acks; sharing work
//! between workers; heartbeats; graceful shutdown.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use futures::StreamExt;
use jetworker::protocol::Status;
use nix::sys::signal::Signal;

use crate::util::*;

const T: Duration = Duration::from_secs(30);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hello_by_hand() {
    let srv = NatsServer::start();
    let _w = InProcWorker::start(|_| {}, &srv.url());
    let js = srv.js().await;
    let seq = publish_task(&js, "default", r#"{"type":"shell","payload":"echo hello"}"#).await;
    let r = final_result(&js, &format!("seq-{seq}"), T).await;
    assert_eq!(r.status, Status::Success, "{r:?}");
    assert_eq!(r.output, "hello\n");
    assert_eq!(r.exit_code, Some(0));
    assert_eq!(r.attempt, 1);
    assert!(r.worker_id.starts_with("test-"));
    // Acked: nothing left in the work queue.
    queue_drained(&js, T, "queue to drain").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn command_task_and_header_id() {
    let srv = NatsServer::start();
    let _w = InProcWorker::start(|_| {}, &srv.url());
    let js = srv.js().await;
    publish_raw(
        &js,
        "tasks.default.sub",
        r#"{"type":"command","command":"printf","args":["%s-%s","a b","c"]}"#.into(),
        Some("from-header"),
    )
    .await;
    let r = final_result(&js, "from-header", T).await;
    assert_eq!(r.status, Status::Success, "{r:?}");
    assert_eq!(r.output, "a b-c");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_validation_error_class_is_rejected_and_dead_lettered() {
    let srv = NatsServer::start_with(&["max_payload: 4MB"]);
    let _w = InProcWorker::start(|_| {}, &srv.url());
    let js = srv.js().await;
    let big = format!(
        r#"{{"id":"big","type":"shell","payload":"{}"}}"#,
        "x".repeat(2 * 1024 * 1024)
    );
    let cases: Vec<(&str, String, &str)> = vec![
        ("badjson", "{not json".into(), "not valid JSON"),
        ("nonobject", "[1,2,3]".into(), "JSON object"),
        (
            "unknowntype",
            r#"{"id":"unknowntype","type":"FTP!","payload":"x"}"#.into(),
            "type",
        ),
        (
            "unknownfield",
            r#"{"id":"unknownfield","type":"shell","payload":"x","timout":"5s"}"#.into(),
            "timout",
        ),
        (
            "wrongtype",
            r#"{"id":"wrongtype","type":"shell","payload":"x","timeout_seconds":"5"}"#.into(),
            "timeout_seconds",
        ),
        (
            "shard",
            r#"{"id":"shard","type":"shell","payload":"x","shard":{"no":5,"total":2}}"#.into(),
            "shard",
        ),
        (
            "badid",
            r#"{"id":"bad id!","type":"shell","payload":"x"}"#.into(),
            "id",
        ),
        (
            "missing",
            r#"{"id":"missing","type":"command"}"#.into(),
            "command",
        ),
        (
            "reserved",
            r#"{"id":"reserved","type":"shell","payload":"x","env":{"ATTEMPT":"1"}}"#.into(),
            "env.ATTEMPT",
        ),
        ("big", big, "max_task_bytes"),
    ];
    let mut seqs = HashMap::new();
    for (name, body, _) in &cases {
        let seq = publish_raw(
            &js,
            "tasks.default",
            body.clone().into(),
            Some(&format!("m-{name}")),
        )
        .await;
        seqs.insert(*name, seq);
    }
    // Binary garbage too.
    publish_raw(
        &js,
        "tasks.default",
        vec![0xff, 0x00, 0xfe, 0x80].into(),
        Some("m-garbage"),
    )
    .await;
    for (name, _, needle) in &cases {
        // JSON id where valid, else the Nats-Msg-Id header.
        let id = match *name {
            "badjson" | "nonobject" | "badid" => format!("m-{name}"),
            n => n.to_string(),
        };
        let r = final_result(&js, &id, T).await;
        assert_eq!(r.status, Status::Rejected, "{name}: {r:?}");
        let err = r.error.clone().unwrap_or_default();
        assert!(
            err.contains(needle),
            "{name}: error {err:?} should mention {needle:?}"
        );
        assert!(r.is_final);
    }
    let r = final_result(&js, "m-garbage", T).await;
    assert_eq!(r.status, Status::Rejected);
    // Originals in DEAD with the reason; queue empty; worker alive.
    let want = cases.len() as u64 + 1;
    let js2 = js.clone();
    wait_for(T, "dead letters", || {
        let js = js2.clone();
        async move {
            let mut dead = js.get_stream("DEAD").await.ok()?;
            (dead.info().await.ok()?.state.messages == want).then_some(())
        }
    })
    .await;
    let dead = js.get_stream("DEAD").await.unwrap();
    let m = dead
        .direct_get_last_for_subject("dead.default.unknownfield")
        .await
        .unwrap();
    assert_eq!(&m.payload[..], cases[3].1.as_bytes());
    assert!(m
        .headers
        .get("Jetworker-Reason")
        .unwrap()
        .as_str()
        .contains("timout"));
    assert_eq!(tasks_left(&js).await, 0);
    let seq = publish_task(
        &js,
        "default",
        r#"{"id":"after","type":"shell","payload":"true"}"#,
    )
    .await;
    assert!(seq > 0);
    assert_eq!(final_result(&js, "after", T).await.status, Status::Success);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn environment_is_scrubbed_and_injected() {
    std::env::set_var("JW_TEST_PASS", "passed");
    std::env::set_var("JW_TEST_SECRET", "leaked");
    let srv = NatsServer::start();
    let _w = InProcWorker::start(|c| c.pass_env = vec!["JW_TEST_PASS".into()], &srv.url());
    let js = srv.js().await;
    publish_task(
        &js,
        "default",
        r#"{"id":"envt","type":"shell","idempotency_key":"k-1","shard":{"no":2,"total":5},
            "env":{"MINE":"yes"},
            "payload":"echo $IDEMPOTENCY_KEY $SHARD_NO $SHARD_TOTAL $SCHEDULE_INSTANCE_ID $ATTEMPT $MINE $JW_TEST_PASS ${JW_TEST_SECRET:-none}; pwd; echo $HOME"}"#,
    )
    .await;
    let r = final_result(&js, "envt", T).await;
    assert_eq!(r.status, Status::Success, "{r:?}");
    let lines: Vec<&str> = r.output.lines().collect();
    assert_eq!(lines[0], "k-1 2 5 envt 1 yes passed none");
    assert_eq!(lines[1], lines[2], "HOME is the fresh working directory");
    // Left empty, the directory may wait for the next attempt; nothing of
    // this one stays in it (containment::working_directories_...).
    let wd = std::path::Path::new(lines[1]);
    assert!(
        !wd.exists() || std::fs::read_dir(wd).unwrap().next().is_none(),
        "working directory removed or empty afterwards"
    );
    assert_eq!(r.idempotency_key.as_deref(), Some("k-1"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn output_cap_with_100mb() {
    let srv = NatsServer::start();
    let _w = InProcWorker::start(|c| c.output_cap = 64 * 1024, &srv.url());
    let js = srv.js().await;
    publish_task(
        &js,
        "default",
        r#"{"id":"big-out","type":"shell","payload":"echo START; head -c 100000000 /dev/zero | tr '\\0' x; echo; echo END"}"#,
    )
    .await;
    let r = final_result(&js, "big-out", Duration::from_secs(120)).await;
    assert_eq!(r.status, Status::Success, "{:?}", r.error);
    assert!(r.output_truncated);
    assert_eq!(r.output_bytes, 100_000_000 + 6 + 1 + 4);
    assert!(r.output.len() <= 64 * 1024 + 100, "{}", r.output.len());
    assert!(r.output.starts_with("START\nxxx"));
    assert!(r.output.ends_with("xxx\nEND\n"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn timeout_kills_the_whole_group() {
    let srv = NatsServer::start();
    let _w = InProcWorker::start(|c| c.kill_grace = Duration::from_secs(1), &srv.url());
    let js = srv.js().await;
    let marker = format!("jw-orphan-{}", std::process::id());
    publish_task(
        &js,
        "default",
        &format!(
            r#"{{"id":"to","type":"shell","timeout":"2s","retry":{{"max_attempts":1}},
                "payload":"bash -c 'exec -a {marker} sleep 1000' & echo $! > pid; trap '' TERM; cat pid; sleep 1000"}}"#
        ),
    )
    .await;
    let r = final_result(&js, "to", T).await;
    assert_eq!(r.status, Status::Timeout, "{r:?}");
    assert!(r.error.unwrap().contains("timed out"));
    assert!(
        r.duration_ms < 4000,
        "kill included in the timeout: {}",
        r.duration_ms
    );
    let pid: i32 = r.output.trim().parse().unwrap();
    wait_for(Duration::from_secs(5), "grandchild to die", || async {
        (!pid_alive(pid)).then_some(())
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exit_code_and_signal_reported() {
    let srv = NatsServer::start();
    let _w = InProcWorker::start(|_| {}, &srv.url());
    let js = srv.js().await;
    publish_task(
        &js,
        "default",
        r#"{"id":"ex3","type":"shell","payload":"exit 3","retry":{"max_attempts":1}}"#,
    )
    .await;
    publish_task(
        &js,
        "default",
        r#"{"id":"sig","type":"shell","payload":"kill -KILL $$","retry":{"max_attempts":1}}"#,
    )
    .await;
    let r = final_result(&js, "ex3", T).await;
    assert_eq!((r.status, r.exit_code), (Status::Failed, Some(3)));
    assert_eq!(r.error.as_deref(), Some("exit code 3"));
    let r = final_result(&js, "sig", T).await;
    assert_eq!(r.status, Status::Failed);
    assert_eq!(r.signal.as_deref(), Some("SIGKILL"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retry_then_success() {
    let srv = NatsServer::start();
    let _w = InProcWorker::start(|_| {}, &srv.url());
    let js = srv.js().await;
    publish_task(
        &js,
        "default",
        r#"{"id":"flaky","type":"shell","retry":{"max_attempts":3,"backoff":"200ms"},
            "payload":"echo try $ATTEMPT; [ $ATTEMPT -ge 2 ]"}"#,
    )
    .await;
    let r = final_result(&js, "flaky", T).await;
    assert_eq!(r.status, Status::Success);
    assert_eq!(r.attempt, 2);
    let all = all_results(&js, "flaky").await;
    assert_eq!(all.len(), 2);
    assert_eq!(all[0].status, Status::Failed);
    assert!(!all[0].is_final);
    assert_eq!(all[0].retry_in_ms, Some(200));
    assert_eq!(all[0].output, "try 1\n");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failures_stop_after_max_attempts() {
    let srv = NatsServer::start();
    let _w = InProcWorker::start(|_| {}, &srv.url());
    let js = srv.js().await;
    publish_task(&js, "default", r#"{"id":"never","type":"shell","retry":{"max_attempts":2,"backoff":"100ms"},"payload":"exit 1"}"#).await;
    let r = final_result(&js, "never", T).await;
    assert_eq!((r.status, r.attempt, r.is_final), (Status::Failed, 2, true));
    queue_drained(&js, T, "queue to drain").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn long_task_keeps_its_lease() {
    let srv = NatsServer::start();
    let _w = InProcWorker::start(|c| c.ack_wait = Duration::from_secs(1), &srv.url());
    let js = srv.js().await;
    publish_task(
        &js,
        "default",
        r#"{"id":"long","type":"shell","payload":"sleep 3.5; echo done"}"#,
    )
    .await;
    let r = final_result(&js, "long", T).await;
    assert_eq!(r.status, Status::Success);
    // Give a redelivery the chance to show up, then check there was none.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let all = all_results(&js, "long").await;
    assert_eq!(all.len(), 1, "ran more than once: {all:?}");
    assert_eq!(all[0].attempt, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn labels_route_and_workers_share() {
    let srv = NatsServer::start();
    let url = srv.url();
    let d: Vec<ProcWorker> = (0..3)
        .map(|_| ProcWorker::start(&url, &["--labels", "default", "--slots", "2"]))
        .collect();
    let _g = ProcWorker::start(&url, &["--labels", "gpu", "--name", "gpu"]);
    let js = srv.js().await;
    // Wait for all four heartbeats.
    wait_for(T, "4 workers online", || async {
        (heartbeats(&js).await?.len() == 4).then_some(())
    })
    .await;
    for i in 0..30 {
        publish_task(
            &js,
            "default",
            &format!(r#"{{"id":"d{i}","type":"shell","payload":"sleep 0.2"}}"#),
        )
        .await;
    }
    for i in 0..5 {
        publish_task(
            &js,
            "gpu",
            &format!(r#"{{"id":"g{i}","type":"shell","payload":"true"}}"#),
        )
        .await;
    }
    let mut by_worker: HashMap<String, usize> = HashMap::new();
    for i in 0..30 {
        let r = final_result(&js, &format!("d{i}"), T).await;
        assert!(r.worker_id.starts_with("proc-"), "{}", r.worker_id);
        *by_worker.entry(r.worker_id).or_default() += 1;
        assert_eq!(
            all_results(&js, &format!("d{i}")).await.len(),
            1,
            "d{i} ran twice"
        );
    }
    assert!(by_worker.len() >= 2, "work not shared: {by_worker:?}");
    let mut gpu = HashSet::new();
    for i in 0..5 {
        gpu.insert(final_result(&js, &format!("g{i}"), T).await.worker_id);
    }
    assert_eq!(gpu.len(), 1);
    assert!(gpu.iter().next().unwrap().starts_with("gpu-"));
    drop(d);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heartbeat_expires_after_sigkill() {
    let srv = NatsServer::start();
    let mut w = ProcWorker::start(&srv.url(), &[]);
    let js = srv.js().await;
    let hb = wait_for(T, "heartbeat", || async {
        heartbeats(&js).await?.into_iter().next()
    })
    .await;
    let key = hb.id.clone();
    let kv = js.get_key_value("workers").await.unwrap();
    assert_eq!(kv.get(&key).await.unwrap().map(|_| ()), Some(()));
    assert_eq!(hb.pid as i32, w.pid());
    assert_eq!(hb.labels, vec!["default"]);
    let mut watch = kv.watch_all().await.unwrap();
    w.kill();
    let t0 = std::time::Instant::now();
    let op = tokio::time::timeout(Duration::from_secs(15), async {
        loop {
            let e = watch.next().await.unwrap().unwrap();
            if e.key == key && e.operation != async_nats::jetstream::kv::Operation::Put {
                return e.operation;
            }
        }
    })
    .await
    .expect("watcher saw the expiry");
    assert_eq!(op, async_nats::jetstream::kv::Operation::Purge);
    assert!(
        t0.elapsed() < Duration::from_secs(8),
        "offline TTL is 3s: {:?}",
        t0.elapsed()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_drains_running_tasks() {
    let srv = NatsServer::start();
    let mut w = ProcWorker::start(&srv.url(), &["--slots", "2", "--drain-timeout", "20s"]);
    let js = srv.js().await;
    for i in 0..2 {
        publish_task(
            &js,
            "default",
            &format!(r#"{{"id":"drain{i}","type":"shell","payload":"sleep 2; echo ok"}}"#),
        )
        .await;
    }
    publish_task(
        &js,
        "default",
        r#"{"id":"queued","type":"shell","payload":"echo later"}"#,
    )
    .await;
    // Both running (heartbeat lists them), then SIGTERM.
    wait_for(T, "2 tasks running", || async {
        (heartbeats(&js).await?.first()?.running == 2).then_some(())
    })
    .await;
    w.signal(Signal::SIGTERM);
    assert_eq!(w.wait_exit(T).await, Some(0));
    for i in 0..2 {
        let r = final_result(&js, &format!("drain{i}"), T).await;
        assert_eq!(r.status, Status::Success);
    }
    // The queued task was not started and is still there for others.
    assert!(last_result(&js, "queued").await.is_none());
    assert_eq!(tasks_left(&js).await, 1);
    let left = heartbeats(&js).await.unwrap();
    assert!(left.is_empty(), "heartbeat key removed: {left:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_and_health_endpoints() {
    let srv = NatsServer::start();
    let addr = free_addr();
    let _w = InProcWorker::start(|c| c.metrics_addr = Some(addr), &srv.url());
    let js = srv.js().await;
    publish_task(
        &js,
        "default",
        r#"{"id":"m1","type":"shell","payload":"true"}"#,
    )
    .await;
    final_result(&js, "m1", T).await;
    let get = |path: &'static str| http_get(addr, path);
    let (_, ready) = wait_for(T, "readyz", || async {
        get("/readyz").await.filter(|(code, _)| *code == 200)
    })
    .await;
    assert!(ready.ends_with("ready\n"), "{ready}");
    assert_eq!(get("/healthz").await.map(|(c, _)| c), Some(200));
    let (_, m) = wait_for(T, "attempt counter", || async {
        get("/metrics").await.filter(|(_, m)| {
            m.contains(
                r#"jetworker_attempts_total{label="default",type="shell",status="success"} 1"#,
            )
        })
    })
    .await;
    assert!(m.contains("jetworker_running 0"), "{m}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_config_is_one_line_and_exit_2() {
    let out = std::process::Command::new(jetworker_bin())
        .args(["run", "--drain-timeout", "soon"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8(out.stderr).unwrap();
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(err.contains("drain_timeout"), "{err}");
    let dir = tempfile::tempdir().unwrap();
    let f = dir.path().join("c.toml");
    std::fs::write(&f, "slots = 0\n").unwrap();
    let out = std::process::Command::new(jetworker_bin())
        .args(["run", "--config"])
        .arg(&f)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("slots"));
    let out = std::process::Command::new(jetworker_bin())
        .args(["run"])
        .env("JETWORKER_SLOTS", "many")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("slots"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_starting_at_once_do_not_fail() {
    let srv = NatsServer::start();
    let ws: Vec<InProcWorker> = (0..4)
        .map(|_| InProcWorker::start(|_| {}, &srv.url()))
        .collect();
    let js = srv.js().await;
    publish_task(
        &js,
        "default",
        r#"{"id":"race","type":"shell","payload":"true"}"#,
    )
    .await;
    assert_eq!(final_result(&js, "race", T).await.status, Status::Success);
    for w in ws {
        assert!(
            !w.handle.as_ref().unwrap().is_finished(),
            "a worker failed to start"
        );
        w.shutdown().await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_while_waiting_for_nats_exits_0() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let mut w = ProcWorker::start(&format!("nats://127.0.0.1:{port}"), &[]);
    tokio::time::sleep(Duration::from_millis(500)).await;
    w.signal(Signal::SIGTERM);
    assert_eq!(w.wait_exit(Duration::from_secs(5)).await, Some(0));
}

/// A fake NATS server that announces `version` and answers PINGs: enough
/// for a client to connect and read the server info.
async fn fake_old_server(version: &'static str) -> u16 {
    use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = l.local_addr().unwrap().port();
    tokio::spawn(async move {
        while let Ok((s, _)) = l.accept().await {
            tokio::spawn(async move {
                let (r, mut w) = s.into_split();
                let info = format!(
                    "INFO {{\"server_id\":\"fake\",\"server_name\":\"fake\",\"version\":\"{version}\",\"go\":\"go1\",\"host\":\"127.0.0.1\",\"port\":{port},\"headers\":true,\"max_payload\":1048576,\"proto\":1,\"jetstream\":true}}\r\n"
                );
                let _ = w.write_all(info.as_bytes()).await;
                let mut lines = BufReader::new(r).lines();
                while let Ok(Some(line)) = lines.next_line().await {
                    if line.starts_with("PING") {
                        let _ = w.write_all(b"PONG\r\n").await;
                    }
                }
            });
        }
    });
    port
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn old_server_is_refused() {
    let port = fake_old_server("2.9.25").await;
    let out = tokio::process::Command::new(jetworker_bin())
        .args(["run", "--server", &format!("nats://127.0.0.1:{port}")])
        .arg("--state-dir")
        .arg(tempfile::tempdir().unwrap().path())
        .env("LOG_LEVEL", "error")
        .output();
    let out = tokio::time::timeout(T, out).await.expect("exits").unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("2.9.25 is too old") && err.contains("2.11"),
        "{err}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_busy_worker_leases_no_more_than_its_slots() {
    let srv = NatsServer::start();
    let _w = InProcWorker::start(|c| c.slots = 1, &srv.url());
    let js = srv.js().await;
    for i in 0..3 {
        publish_task(
            &js,
            "default",
            &format!(r#"{{"id":"slot{i}","type":"shell","payload":"sleep 1"}}"#),
        )
        .await;
    }
    let stream = js.get_stream("TASKS").await.unwrap();
    let mut c: async_nats::jetstream::consumer::PullConsumer =
        wait_for(T, "the label's consumer", || {
            let stream = stream.clone();
            async move { stream.get_consumer("label-default").await.ok() }
        })
        .await;
    // While the first runs, only it is leased; the others wait in the stream
    // for any worker that is free.
    let deadline = std::time::Instant::now() + T;
    let info = loop {
        let i = c.info().await.unwrap().clone();
        if i.num_ack_pending >= 1 {
            break i;
        }
        assert!(std::time::Instant::now() < deadline, "nothing leased");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(info.num_ack_pending, 1, "{info:?}");
    assert_eq!(info.num_pending, 2, "{info:?}");
    for _ in 0..5 {
        let i = c.info().await.unwrap().clone();
        assert!(i.num_ack_pending <= 1, "hoarding: {i:?}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    for i in 0..3 {
        final_result(&js, &format!("slot{i}"), T).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn labels_are_served_fairly() {
    let srv = NatsServer::start();
    let js = srv.js().await;
    // Queue both labels first, then start one worker with one slot.
    let setup = async_nats::jetstream::new(srv.client().await);
    jetworker::internals::ensure_all(&setup, &Default::default(), &Default::default())
        .await
        .unwrap();
    for i in 0..6 {
        publish_task(
            &js,
            "a",
            &format!(r#"{{"id":"a{i}","type":"shell","payload":"sleep 0.1"}}"#),
        )
        .await;
        publish_task(
            &js,
            "b",
            &format!(r#"{{"id":"b{i}","type":"shell","payload":"sleep 0.1"}}"#),
        )
        .await;
    }
    let _w = InProcWorker::start(
        |c| {
            c.slots = 1;
            c.labels = vec!["a".into(), "b".into()];
        },
        &srv.url(),
    );
    let mut done = Vec::new();
    for l in ["a", "b"] {
        for i in 0..6 {
            let r = final_result(&js, &format!("{l}{i}"), T).await;
            done.push((r.started_at, l));
        }
    }
    done.sort();
    let first_half: Vec<&str> = done[..6].iter().map(|d| d.1).collect();
    assert!(
        first_half.contains(&"a") && first_half.contains(&"b"),
        "one label starved the other: {first_half:?}"
    );
}
