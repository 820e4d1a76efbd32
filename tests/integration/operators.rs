//! Operators see and steer (issue 11): `queues`, `status`, `pause` and
//! `resume`, `/readyz` and `health`, a metrics address that cannot be
//! bound, and systemd notification — each against a real nats-server and
//! a real worker (the built binary, or in-process for the library view).

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use jetworker::protocol::{Names, Status};
use jetworker::queues;
use serde_json::Value;

use crate::cli::{assert_exit, jw, jw_command, stderr, stdout};
use crate::proxy::Proxy;
use crate::util::{
    final_result, free_addr, http_get, http_status, last_result, publish_task, wait_for,
    InProcWorker, NatsServer, ProcOpts, ProcWorker,
};

const T: Duration = Duration::from_secs(30);

/// Poll `/readyz` until it answers `code`.
async fn readyz_becomes(addr: SocketAddr, code: u16, timeout: Duration) {
    wait_for(timeout, &format!("/readyz {code}"), || async {
        (http_status(addr, "/readyz").await == Some(code)).then_some(())
    })
    .await
}

/// One JSON line per label from `jetworker queues --json`.
async fn queue_lines(url: &str, label: &str) -> Vec<Value> {
    let o = jw(url, &["queues", "--json", "--label", label]).await;
    assert_exit(&o, 0);
    stdout(&o)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// `jetworker queues` as a table: the whole output and the cells of the
/// `default` row.
async fn queues_table(url: &str) -> (String, Vec<String>) {
    let o = jw(url, &["queues"]).await;
    assert_exit(&o, 0);
    let out = stdout(&o);
    let row = out
        .lines()
        .find(|l| l.starts_with("default"))
        .unwrap_or_else(|| panic!("no default row: {out}"));
    let cells = row.split_whitespace().map(str::to_string).collect();
    (out, cells)
}

/// `jetworker status <id> --json`: exit code and the JSON.
async fn status(url: &str, id: &str) -> (Option<i32>, Value) {
    let o = jw(url, &["status", id, "--json"]).await;
    let v = serde_json::from_str(stdout(&o).trim()).unwrap_or(Value::Null);
    (o.status.code(), v)
}

/// Wait until `status <id>` says `state` (and exits `code`).
async fn status_becomes(url: &str, id: &str, state: &str, code: i32) -> Value {
    wait_for(T, &format!("{id} {state}"), || async {
        let (c, v) = status(url, id).await;
        (c == Some(code) && v["state"] == state).then_some(v)
    })
    .await
}

/// A worker (the binary) with test timings, online.
async fn worker(url: &str, extra: &[&str]) -> ProcWorker {
    let w = ProcWorker::start(url, extra);
    let pid = w.pid() as u32;
    wait_for(T, "worker online", || async {
        let o = jw(url, &["workers", "--json"]).await;
        stdout(&o)
            .lines()
            .any(|l| l.contains(&format!("\"pid\":{pid},")))
            .then_some(())
    })
    .await;
    w
}

/// The library view: counts while tasks wait and run, and a pause without
/// an end shown as "until resumed".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queue_stats_count_waiting_and_running_tasks() {
    let srv = NatsServer::start();
    let js = srv.js().await;
    let names = Names::default();
    let _w = InProcWorker::start(|c| c.slots = 1, &srv.url());
    wait_for(T, "the label consumer", || async {
        queues::queue_stats(&js, &names, None)
            .await
            .ok()
            .filter(|q| q.iter().any(|s| s.consumer && !s.workers.is_empty()))
    })
    .await;
    publish_task(
        &js,
        "default",
        r#"{"id":"long","type":"shell","payload":"sleep 30"}"#,
    )
    .await;
    for i in 0..3 {
        publish_task(
            &js,
            "default",
            &format!(r#"{{"id":"w{i}","type":"shell","payload":"true"}}"#),
        )
        .await;
    }
    let s = wait_for(T, "1 running, 3 waiting", || async {
        let q = queues::queue_stats(&js, &names, Some("default"))
            .await
            .ok()?;
        q.into_iter()
            .next()
            .filter(|s| s.running == 1 && s.waiting == 3)
    })
    .await;
    assert!(s.oldest_waiting_at.is_some(), "{s:?}");
    assert!(!s.paused);
    assert_eq!(s.slots, 1);
    let p = queues::pause(&js, &names, "default", None).await.unwrap();
    assert!(p.paused);
    assert_eq!(p.paused_until, None);
    let s = queues::queue_stats(&js, &names, Some("default"))
        .await
        .unwrap();
    assert!(s[0].paused && s[0].paused_until.is_none(), "{s:?}");
    let r = queues::resume(&js, &names, "default").await.unwrap();
    assert!(!r.paused);
    assert!(queues::pause(&js, &names, "nobody", None).await.is_err());
}

/// `jetworker queues`: one slot busy with a long task, three waiting
/// behind it; the oldest waiting task's age grows; the table shows it all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queues_counts_waiting_and_running_tasks() {
    let srv = NatsServer::start();
    let url = srv.url();
    let js = srv.js().await;
    let w = worker(&url, &["--slots", "1"]).await;
    publish_task(
        &js,
        "default",
        r#"{"id":"q-long","type":"shell","payload":"sleep 60"}"#,
    )
    .await;
    status_becomes(&url, "q-long", "running", 3).await;
    let before_waiting = chrono::Utc::now();
    for i in 0..3 {
        publish_task(
            &js,
            "default",
            &format!(r#"{{"id":"q-{i}","type":"shell","payload":"true"}}"#),
        )
        .await;
    }
    let q = wait_for(T, "queues: 3 waiting, 1 running", || async {
        let q = queue_lines(&url, "default").await;
        (q.len() == 1 && q[0]["waiting"] == 3 && q[0]["running"] == 1).then(|| q[0].clone())
    })
    .await;
    assert_eq!(q["label"], "default");
    assert_eq!(q["paused"], false);
    assert_eq!(q["slots"], 1);
    assert_eq!(q["workers"].as_array().unwrap().len(), 1, "{q}");
    let oldest: chrono::DateTime<chrono::Utc> =
        serde_json::from_value(q["oldest_waiting_at"].clone()).unwrap();
    // The first of the three (published after the long one was taken).
    assert!(
        oldest >= before_waiting - chrono::Duration::seconds(1),
        "{q}"
    );
    let age = q["oldest_waiting_ms"].as_u64().unwrap();
    // It keeps waiting: its age grows.
    wait_for(T, "the oldest age grows", || async {
        let q = queue_lines(&url, "default").await;
        (q[0]["oldest_waiting_ms"].as_u64()? > age + 500).then_some(())
    })
    .await;
    let (out, cells) = queues_table(&url).await;
    assert_eq!(&cells[1..4], &["3", "1", "0"], "{out}");
    assert!(out.contains("OLDEST") && out.contains("PAUSED"), "{out}");
    // An unknown label is an empty answer, not an error.
    let o = jw(&url, &["queues", "--label", "nobody"]).await;
    assert_exit(&o, 0);
    assert!(
        stdout(&o).contains("no queue for label nobody"),
        "{}",
        stdout(&o)
    );
    drop(w);
}

/// `queues` tells a task that runs from one waiting out its retry backoff
/// (handed out, Nak'ed with a delay): `running` 1, `delayed` 1, in the
/// JSON and the table.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queues_count_a_retry_backoff_as_delayed_not_running() {
    let srv = NatsServer::start();
    let url = srv.url();
    let js = srv.js().await;
    let w = worker(&url, &["--slots", "2"]).await;
    publish_task(
        &js,
        "default",
        r#"{"id":"q-backoff","type":"shell","payload":"exit 1","retry":{"max_attempts":3,"backoff":"5m"}}"#,
    )
    .await;
    status_becomes(&url, "q-backoff", "retrying", 3).await;
    publish_task(
        &js,
        "default",
        r#"{"id":"q-runs","type":"shell","payload":"sleep 60"}"#,
    )
    .await;
    status_becomes(&url, "q-runs", "running", 3).await;
    let q = wait_for(T, "queues: 1 running, 1 delayed", || async {
        let q = queue_lines(&url, "default").await;
        (q.len() == 1 && q[0]["running"] == 1 && q[0]["delayed"] == 1).then(|| q[0].clone())
    })
    .await;
    assert_eq!(q["waiting"], 0, "{q}");
    let (out, cells) = queues_table(&url).await;
    assert!(out.contains("DELAYED"), "{out}");
    assert_eq!(&cells[1..4], &["0", "1", "1"], "{out}");
    drop(w);
}

/// `jetworker status` in every state, with its exit code.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_reports_every_state_with_its_exit_code() {
    let srv = NatsServer::start();
    let url = srv.url();
    let js = srv.js().await;
    let mut w = worker(&url, &["--drain-timeout", "1s"]).await;

    // Final success → 0, final failure → 1.
    publish_task(
        &js,
        "default",
        r#"{"id":"s-ok","type":"shell","payload":"true"}"#,
    )
    .await;
    publish_task(
        &js,
        "default",
        r#"{"id":"s-bad","type":"shell","payload":"exit 3","retry":{"max_attempts":1}}"#,
    )
    .await;
    final_result(&js, "s-ok", T).await;
    final_result(&js, "s-bad", T).await;
    let (c, v) = status(&url, "s-ok").await;
    assert_eq!(c, Some(0), "{v}");
    assert_eq!(v["state"], "final");
    assert_eq!(v["record"]["status"], "success");
    let (c, v) = status(&url, "s-bad").await;
    assert_eq!(c, Some(1), "{v}");
    assert_eq!(v["record"]["status"], "failed");
    let o = jw(&url, &["status", "s-bad"]).await;
    assert!(
        stdout(&o).contains("s-bad: final: failed (attempt 1/1"),
        "{}",
        stdout(&o)
    );

    // Retrying: a failed attempt with a long backoff → 3.
    publish_task(
        &js,
        "default",
        r#"{"id":"s-retry","type":"shell","payload":"exit 1","retry":{"max_attempts":3,"backoff":"10m"}}"#,
    )
    .await;
    let v = status_becomes(&url, "s-retry", "retrying", 3).await;
    assert_eq!(v["record"]["attempt"], 1);
    let next: chrono::DateTime<chrono::Utc> =
        serde_json::from_value(v["next_attempt_at"].clone()).unwrap();
    assert!(
        next > chrono::Utc::now() + chrono::Duration::minutes(9),
        "{v}"
    );

    // Running → 3, with where, since when and the attempt.
    publish_task(
        &js,
        "default",
        r#"{"id":"s-run","type":"shell","payload":"sleep 60"}"#,
    )
    .await;
    let v = status_becomes(&url, "s-run", "running", 3).await;
    assert_eq!(v["worker_online"], true, "{v}");
    assert_eq!(v["record"]["attempt"], 1);
    assert!(v["record"]["worker_id"]
        .as_str()
        .unwrap()
        .starts_with("proc-"));
    let o = jw(&url, &["status", "s-run"]).await;
    assert_exit(&o, 3);
    assert!(
        stdout(&o).contains("s-run: running on proc-"),
        "{}",
        stdout(&o)
    );
    assert!(stdout(&o).contains("(online) since"), "{}", stdout(&o));

    // Never started: a label nobody serves → waiting, 3.
    publish_task(
        &js,
        "idle",
        r#"{"id":"s-wait","type":"shell","payload":"true"}"#,
    )
    .await;
    let v = status_becomes(&url, "s-wait", "waiting", 3).await;
    assert_eq!(v["label"], "idle");
    assert!(v["record"].is_null());

    // Handed back at shutdown (a `queued` record) → waiting, 3.
    w.signal(nix::sys::signal::Signal::SIGTERM);
    assert_eq!(w.wait_exit(T).await, Some(0));
    let v = status_becomes(&url, "s-run", "waiting", 3).await;
    assert_eq!(v["record"]["status"], "queued", "{v}");

    // Unknown → 4; not an id → 2.
    let (c, v) = status(&url, "s-nothing").await;
    assert_eq!(c, Some(4), "{v}");
    assert_eq!(v["state"], "unknown");
    let o = jw(&url, &["status", "not/an/id"]).await;
    assert_exit(&o, 2);
    // No server → 2.
    let o = jw("nats://127.0.0.1:1", &["status", "s-ok"]).await;
    assert_exit(&o, 2);
}

/// Pause stops delivery (tasks published meanwhile wait, the worker stays
/// up and ready), `workers` and the metrics show it, resume restarts it;
/// `--for` ends by itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pause_stops_delivery_and_resume_restarts_it() {
    let srv = NatsServer::start();
    let url = srv.url();
    let js = srv.js().await;
    let addr = free_addr();
    let _w = worker(&url, &["--metrics-addr", &addr.to_string()]).await;
    readyz_becomes(addr, 200, T).await;

    let o = jw(&url, &["pause", "default"]).await;
    assert_exit(&o, 0);
    assert!(stdout(&o).contains("default: paused until `jetworker resume default`"));
    publish_task(
        &js,
        "default",
        r#"{"id":"p-1","type":"shell","payload":"true"}"#,
    )
    .await;
    // Nothing runs for several pulls (each waits 2 s at the server).
    let quiet = Instant::now();
    while quiet.elapsed() < Duration::from_secs(5) {
        assert!(last_result(&js, "p-1").await.is_none(), "ran while paused");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let q = queue_lines(&url, "default").await;
    assert_eq!(q[0]["paused"], true, "{q:?}");
    assert!(q[0]["paused_until"].is_null(), "{q:?}");
    assert_eq!(q[0]["waiting"], 1, "{q:?}");
    let o = jw(&url, &["workers"]).await;
    assert!(stdout(&o).contains("default(paused)"), "{}", stdout(&o));
    let o = jw(&url, &["workers", "--json"]).await;
    assert!(
        stdout(&o).contains(r#""paused_labels":["default"]"#),
        "{}",
        stdout(&o)
    );
    wait_for(T, "the paused gauge", || async {
        let (_, m) = http_get(addr, "/metrics").await?;
        m.contains(r#"jetworker_label_paused{label="default"} 1"#)
            .then_some(())
    })
    .await;
    // Paused is not unready: the worker pulls, the server answers.
    assert_eq!(http_status(addr, "/readyz").await, Some(200));

    let o = jw(&url, &["resume", "default", "--json"]).await;
    assert_exit(&o, 0);
    assert!(stdout(&o).contains(r#""paused":false"#), "{}", stdout(&o));
    assert_eq!(final_result(&js, "p-1", T).await.status, Status::Success);
    wait_for(T, "the gauge back to 0", || async {
        let (_, m) = http_get(addr, "/metrics").await?;
        m.contains(r#"jetworker_label_paused{label="default"} 0"#)
            .then_some(())
    })
    .await;

    // --for: the pause ends by itself.
    let o = jw(&url, &["pause", "default", "--for", "3s", "--json"]).await;
    assert_exit(&o, 0);
    let p: Value = serde_json::from_str(stdout(&o).trim()).unwrap();
    let until: chrono::DateTime<chrono::Utc> =
        serde_json::from_value(p["paused_until"].clone()).unwrap();
    publish_task(
        &js,
        "default",
        r#"{"id":"p-2","type":"shell","payload":"true"}"#,
    )
    .await;
    let r = final_result(&js, "p-2", T).await;
    assert!(
        r.started_at >= until - chrono::Duration::milliseconds(500),
        "{r:?} before {until}"
    );

    // A label without a consumer cannot be paused; a bad --for is usage.
    let o = jw(&url, &["pause", "nobody"]).await;
    assert_exit(&o, 2);
    assert!(stderr(&o).contains("no consumer yet"), "{}", stderr(&o));
    let o = jw(&url, &["pause", "default", "--for", "soon"]).await;
    assert_exit(&o, 2);
}

/// `/readyz` says 503 soon after the worker's link goes silent (a
/// blackhole: no close, no reset) and 200 again once it carries traffic;
/// `jetworker health` maps both to its exit code, `--live` stays 0, and a
/// port where nothing listens is not healthy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readyz_flips_on_disconnect_and_health_exit_codes() {
    let srv = NatsServer::start();
    let proxy = Proxy::start(srv.port);
    let addr = free_addr();
    let a = addr.to_string();
    // ack_wait 60 s: the client's keepalive alone gives a silent link up
    // after 3 pings of ack_wait / 4, 45 s; readiness must not wait for it.
    let w = ProcWorker::start(&proxy.url(), &["--metrics-addr", &a, "--ack-wait", "60s"]);
    readyz_becomes(addr, 200, T).await;
    let o = jw(&srv.url(), &["health", "--addr", &a]).await;
    assert_exit(&o, 0);
    assert_eq!(stdout(&o).trim(), "ready");
    // The address can come from the setting, as the worker reads it.
    let o = jw_command(&srv.url(), &["health"])
        .env("JETWORKER_METRICS_ADDR", format!("0.0.0.0:{}", addr.port()))
        .output()
        .await
        .unwrap();
    assert_exit(&o, 0);

    proxy.blackhole();
    let cut_at = Instant::now();
    // A pull the server does not answer ends by the client's timer 7 s
    // after it was sent.
    readyz_becomes(addr, 503, Duration::from_secs(20)).await;
    let took = cut_at.elapsed();
    eprintln!("readyz: 503 {took:?} after the link went silent");
    let o = jw(&srv.url(), &["health", "--addr", &a]).await;
    assert_exit(&o, 1);
    assert!(
        stdout(&o).contains("not ready (HTTP 503)"),
        "{}",
        stdout(&o)
    );
    let o = jw(&srv.url(), &["health", "--addr", &a, "--live"]).await;
    assert_exit(&o, 0);

    proxy.pass();
    readyz_becomes(addr, 200, T).await;
    let o = jw(&srv.url(), &["health", "--addr", &a]).await;
    assert_exit(&o, 0);

    // A cut link (closed at once) flips it too.
    proxy.cut();
    readyz_becomes(addr, 503, T).await;
    proxy.pass();
    readyz_becomes(addr, 200, T).await;

    drop(w);
    let o = jw(&srv.url(), &["health", "--addr", &a]).await;
    assert_exit(&o, 1);
    assert!(stdout(&o).contains("no answer"), "{}", stdout(&o));
    let o = jw(&srv.url(), &["health"]).await;
    assert_exit(&o, 2);
    assert!(stderr(&o).contains("--addr"), "{}", stderr(&o));
}

/// A metrics address that cannot be bound stops the worker at start with
/// the configuration exit code (2), before it even reaches NATS.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_metrics_address_that_cannot_be_bound_is_fatal() {
    let srv = NatsServer::start();
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let a = taken.local_addr().unwrap().to_string();
    let log = tempfile::NamedTempFile::new().unwrap();
    for url in [srv.url(), "nats://127.0.0.1:1".to_string()] {
        let dir = tempfile::tempdir().unwrap();
        let mut w = ProcWorker::start_opts(
            &url,
            dir.path(),
            &["--metrics-addr", &a],
            &ProcOpts {
                log: Some(log.path().to_path_buf()),
                ..Default::default()
            },
        );
        assert_eq!(w.wait_exit(T).await, Some(2), "{url}");
    }
    let text = std::fs::read_to_string(log.path()).unwrap();
    assert!(text.contains("metrics_addr") && text.contains(&a), "{text}");
}

/// Type=notify: READY=1 once the worker pulls, WATCHDOG=1 every half
/// WATCHDOG_USEC while it is alive, STOPPING=1 when it drains.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn systemd_hears_ready_watchdog_and_stopping() {
    let srv = NatsServer::start();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("notify.sock");
    let sock = tokio::net::UnixDatagram::bind(&path).unwrap();
    let state = tempfile::tempdir().unwrap();
    let mut w = ProcWorker::start_opts(
        &srv.url(),
        state.path(),
        &[],
        &ProcOpts {
            env: vec![
                ("NOTIFY_SOCKET".into(), path.display().to_string()),
                ("WATCHDOG_USEC".into(), "600000".into()),
            ],
            ..Default::default()
        },
    );
    let mut seen: Vec<String> = Vec::new();
    let mut buf = vec![0u8; 4096];
    let deadline = Instant::now() + T;
    // Two pings at 300 ms after READY: the watchdog goes round.
    while !(seen.iter().any(|m| m.contains("READY=1"))
        && seen.iter().filter(|m| m.contains("WATCHDOG=1")).count() >= 2)
    {
        let left = deadline.saturating_duration_since(Instant::now());
        let n = match tokio::time::timeout(left, sock.recv(&mut buf)).await {
            Ok(r) => r.unwrap(),
            Err(_) => panic!("no READY=1 and two WATCHDOG=1 in {T:?}: {seen:?}"),
        };
        seen.push(String::from_utf8_lossy(&buf[..n]).into_owned());
    }
    let ready = seen.iter().position(|m| m.contains("READY=1")).unwrap();
    assert_eq!(
        seen.iter().filter(|m| m.contains("READY=1")).count(),
        1,
        "{seen:?}"
    );
    // The watchdog is armed at READY=1: no ping before it.
    let first_ping = seen.iter().position(|m| m.contains("WATCHDOG=1")).unwrap();
    assert!(ready < first_ping, "{seen:?}");
    // The worker was pulling when it said so.
    let o = jw(&srv.url(), &["queues", "--json"]).await;
    assert!(stdout(&o).contains(r#""label":"default""#), "{seen:?}");
    w.signal(nix::sys::signal::Signal::SIGTERM);
    let deadline = Instant::now() + T;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let Ok(n) = tokio::time::timeout(left, sock.recv(&mut buf)).await else {
            panic!("no STOPPING=1 in {T:?}");
        };
        if String::from_utf8_lossy(&buf[..n.unwrap()]).contains("STOPPING=1") {
            break;
        }
    }
    assert_eq!(w.wait_exit(T).await, Some(0));
}
