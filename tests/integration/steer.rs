//! What an operator steers with (issue 11, items 3, 5 and 7), each against
//! a real server and worker: a failed task kept in DEAD and run again with
//! `retry` (one and in bulk), deadlines (`expires`: before a run, behind a
//! backlog, before a retry), delayed submits (`submit --in`), every final
//! status counted in `/metrics`, and JSON log lines with flat task fields.

use std::path::Path;
use std::time::Duration;

use bytes::Bytes;
use chrono::Utc;
use jetworker::protocol::{Status, TaskResult};

use crate::cli::{assert_exit, jw, stderr, stdout};
use crate::util::*;

const T: Duration = Duration::from_secs(40);

/// A shell task as JSON.
fn shell(id: &str, script: &str, extra: serde_json::Value) -> String {
    let mut v = serde_json::json!({"id": id, "type": "shell", "payload": script});
    if let serde_json::Value::Object(m) = extra {
        v.as_object_mut().unwrap().extend(m);
    }
    v.to_string()
}

/// A script that fails (exit 3) the first time it runs and prints `second`
/// on every later run: the marker file makes the difference.
fn fails_once(marker: &Path) -> String {
    format!(
        "test -e {m} && echo second || {{ touch {m}; exit 3; }}",
        m = marker.display()
    )
}

/// One attempt only.
fn once() -> serde_json::Value {
    serde_json::json!({"retry": {"max_attempts": 1}})
}

/// The DEAD copy of `id` on `label`: its `Jetworker-Status` and the bytes.
async fn dead_copy(js: &async_nats::jetstream::Context, label: &str, id: &str) -> (String, Bytes) {
    let dead = js.get_stream("DEAD").await.unwrap();
    let m = dead
        .direct_get_last_for_subject(format!("dead.{label}.{id}"))
        .await
        .unwrap_or_else(|e| panic!("no DEAD copy of {id}: {e}"));
    let status = m
        .headers
        .get("Jetworker-Status")
        .map(|v| v.as_str().to_string())
        .unwrap_or_default();
    (status, m.payload)
}

fn json_lines(s: &str) -> Vec<serde_json::Value> {
    s.lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{l}: {e}")))
        .collect()
}

/// A shell task with a misspelt field: rejected, its type still readable.
fn misspelt(id: &str) -> String {
    format!(r#"{{"id":"{id}","type":"shell","payload":"true","timout":"1s"}}"#)
}

/// A command task with one attempt: `dead` where only shell tasks run.
fn command_once(id: &str) -> String {
    format!(
        r#"{{"id":"{id}","type":"command","command":"/bin/true","retry":{{"max_attempts":1}}}}"#
    )
}

/// A worker (the binary) logging JSON at `level` to a file in `dir`.
fn json_worker(url: &str, dir: &Path, extra: &[&str], level: &'static str) -> ProcWorker {
    let mut args = vec!["--log-format", "json"];
    args.extend_from_slice(extra);
    ProcWorker::start_opts(
        url,
        &dir.join("state"),
        &args,
        &ProcOpts {
            log: Some(dir.join("worker.log")),
            log_level: Some(level),
            ..Default::default()
        },
    )
}

/// Stop a [`json_worker`] (SIGTERM, exit 0); its log, and the log's lines.
async fn stop_and_read(mut w: ProcWorker, dir: &Path) -> (String, Vec<serde_json::Value>) {
    w.signal(nix::sys::signal::Signal::SIGTERM);
    assert_eq!(w.wait_exit(T).await, Some(0));
    let text = std::fs::read_to_string(dir.join("worker.log")).unwrap();
    let lines = json_lines(&text);
    (text, lines)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_task_is_kept_in_dead_and_retried_under_a_new_id() {
    let srv = NatsServer::start();
    let url = srv.url();
    let dir = tempfile::tempdir().unwrap();
    let _w = ProcWorker::start(&url, &["--slots", "2"]);
    let js = srv.js().await;
    let task = shell("f-1", &fails_once(&dir.path().join("m")), once());
    publish_task(&js, "default", &task).await;
    let r = final_result(&js, "f-1", T).await;
    assert_eq!((r.status, r.exit_code), (Status::Failed, Some(3)), "{r:?}");

    // The original is in DEAD with the status, before the ack.
    let (status, bytes) = dead_copy(&js, "default", "f-1").await;
    assert_eq!(status, "failed");
    assert_eq!(bytes, task.as_bytes());
    let o = jw(&url, &["dead", "--json"]).await;
    let v = json_lines(&stdout(&o));
    assert_eq!(
        (v[0]["id"].as_str(), v[0]["status"].as_str()),
        (Some("f-1"), Some("failed"))
    );
    assert!(
        v[0]["reason"].as_str().unwrap().contains("exit code 3"),
        "{v:?}"
    );
    let o = jw(&url, &["dead"]).await;
    assert!(
        stdout(&o).contains("STATUS") && stdout(&o).contains("failed"),
        "{}",
        stdout(&o)
    );

    // retry <id>: the original runs again as <id>-r1 (and succeeds).
    let o = jw(&url, &["retry", "f-1"]).await;
    assert_exit(&o, 0);
    assert!(
        stdout(&o).contains("retried f-1 as f-1-r1 on tasks.default"),
        "{}",
        stdout(&o)
    );
    let r = final_result(&js, "f-1-r1", T).await;
    assert_eq!(
        (r.status, r.output.as_str()),
        (Status::Success, "second\n"),
        "{r:?}"
    );
    assert_eq!(r.max_attempts, 1, "the task is the original: {r:?}");

    // `dead replay` is the same operation: the next free id.
    let o = jw(&url, &["dead", "replay", "f-1", "--json"]).await;
    assert_exit(&o, 0);
    assert_eq!(json_lines(&stdout(&o))[0]["new_id"], "f-1-r2");
    final_result(&js, "f-1-r2", T).await;
    // A task that succeeded left no dead letter: nothing to retry.
    let o = jw(&url, &["retry", "f-1-r1"]).await;
    assert_exit(&o, 2);
    assert!(
        stderr(&o).contains("no dead letter for f-1-r1"),
        "{}",
        stderr(&o)
    );

    // A task still waiting for its retry is not retried beside it.
    let waiting = shell(
        "f-2",
        "exit 1",
        serde_json::json!({"retry": {"max_attempts": 2, "backoff": "1h"}}),
    );
    publish_task(&js, "default", &waiting).await;
    wait_for(T, "f-2's first attempt", || async {
        last_result(&js, "f-2")
            .await
            .filter(|r| r.status == Status::Failed)
    })
    .await;
    // Its DEAD letter, as if an earlier message with the id had been rejected.
    let mut h = async_nats::HeaderMap::new();
    h.insert("Jetworker-Status", "rejected");
    h.insert("Jetworker-Label", "default");
    js.send_publish(
        "dead.default.f-2",
        async_nats::jetstream::message::PublishMessage::build()
            .payload(Bytes::from(waiting))
            .headers(h),
    )
    .await
    .unwrap()
    .await
    .unwrap();
    let o = jw(&url, &["retry", "f-2"]).await;
    assert_exit(&o, 2);
    assert!(
        stderr(&o).contains("f-2 is not finished (failed"),
        "{}",
        stderr(&o)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bulk_retry_picks_dead_letters_by_status_since_and_label() {
    let srv = NatsServer::start();
    let url = srv.url();
    let dir = tempfile::tempdir().unwrap();
    let _w = ProcWorker::start(&url, &["--slots", "4", "--labels", "default,other"]);
    let js = srv.js().await;
    let m = |n: &str| dir.path().join(n);
    for (label, id) in [("default", "b-1"), ("default", "b-2"), ("other", "b-3")] {
        publish_task(&js, label, &shell(id, &fails_once(&m(id)), once())).await;
    }
    let timeout = serde_json::json!({"retry": {"max_attempts": 1}, "timeout": "1s"});
    let slow = format!(
        "test -e {t} && echo second || {{ touch {t}; sleep 30; }}",
        t = m("b-4").display()
    );
    publish_task(&js, "default", &shell("b-4", &slow, timeout)).await;
    publish_task(&js, "default", &shell("b-5", "echo fine", once())).await;
    for (id, status) in [
        ("b-1", Status::Failed),
        ("b-2", Status::Failed),
        ("b-3", Status::Failed),
        ("b-4", Status::Timeout),
        ("b-5", Status::Success),
    ] {
        assert_eq!(final_result(&js, id, T).await.status, status, "{id}");
    }
    assert_eq!(dead_copy(&js, "default", "b-4").await.0, "timeout");

    // Nothing failed after `--since`.
    let later = (Utc::now() + chrono::Duration::seconds(1)).to_rfc3339();
    let o = jw(&url, &["retry", "--status", "failed", "--since", &later]).await;
    assert_exit(&o, 0);
    assert_eq!(stdout(&o), "", "{}", stderr(&o));

    let o = jw(
        &url,
        &[
            "retry", "--status", "failed", "--since", "1h", "--label", "default",
        ],
    )
    .await;
    assert_exit(&o, 0);
    let out = stdout(&o);
    assert!(
        out.contains("retried b-1 as b-1-r1") && out.contains("retried b-2 as b-2-r1"),
        "{out}"
    );
    assert_eq!(out.lines().count(), 2, "{out}");
    for id in ["b-1-r1", "b-2-r1"] {
        assert_eq!(
            final_result(&js, id, T).await.status,
            Status::Success,
            "{id}"
        );
    }

    // Without --status: failed and timeout; those retried before are skipped.
    let o = jw(&url, &["retry", "--since", "1h", "--json"]).await;
    assert_exit(&o, 0);
    let mut got: Vec<String> = json_lines(&stdout(&o))
        .iter()
        .map(|v| v["new_id"].as_str().unwrap().to_string())
        .collect();
    got.sort();
    assert_eq!(got, ["b-3-r1", "b-4-r1"], "{}", stderr(&o));
    assert!(stderr(&o).contains("2 retried before"), "{}", stderr(&o));
    for id in ["b-3-r1", "b-4-r1"] {
        assert_eq!(
            final_result(&js, id, T).await.status,
            Status::Success,
            "{id}"
        );
    }
    let o = jw(&url, &["retry", "--status", "success"]).await;
    assert_exit(&o, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expired_tasks_never_run() {
    let srv = NatsServer::start();
    let url = srv.url();
    let dir = tempfile::tempdir().unwrap();
    let _w = ProcWorker::start(&url, &["--slots", "1"]);
    let js = srv.js().await;
    let ran = |id: &str| dir.path().join(id);
    let touch = |id: &str| format!("echo run >> {}", ran(id).display());

    // A deadline in the past.
    let past = serde_json::json!({"expires": "2020-01-01T00:00:00Z"});
    publish_task(&js, "default", &shell("e-1", &touch("e-1"), past)).await;
    let r = final_result(&js, "e-1", T).await;
    assert_eq!(r.status, Status::Expired, "{r:?}");
    assert!(
        r.error.as_deref().unwrap().contains("2020-01-01T00:00:00Z"),
        "{r:?}"
    );
    assert!(!ran("e-1").exists(), "an expired task ran");
    assert_eq!(dead_copy(&js, "default", "e-1").await.0, "expired");

    // A short deadline behind a backlog on the one slot.
    let blocker = format!("sleep 3; {}", touch("block"));
    publish_task(&js, "default", &shell("block", &blocker, once())).await;
    wait_for(T, "the blocker running", || async {
        last_result(&js, "block")
            .await
            .filter(|r| r.status == Status::Running)
    })
    .await;
    let soon = serde_json::json!({"expires": "1s"});
    publish_task(&js, "default", &shell("e-2", &touch("e-2"), soon)).await;
    let r = final_result(&js, "e-2", T).await;
    assert_eq!(r.status, Status::Expired, "{r:?}");
    assert!(ran("block").exists() && !ran("e-2").exists());

    // A retry that would start after the deadline: expired at once, the
    // attempt's outcome kept.
    let retry_late = serde_json::json!({"expires": "5s",
        "retry": {"max_attempts": 3, "backoff": "1h"}});
    let script = format!("{}; exit 4", touch("e-3"));
    publish_task(&js, "default", &shell("e-3", &script, retry_late)).await;
    let r = final_result(&js, "e-3", T).await;
    assert_eq!(
        (r.status, r.attempt, r.exit_code),
        (Status::Expired, 1, Some(4)),
        "{r:?}"
    );
    assert!(r.error.as_deref().unwrap().contains("not retried"), "{r:?}");
    let runs = std::fs::read_to_string(ran("e-3")).unwrap();
    assert_eq!(runs.lines().count(), 1);
    queue_drained(&js, T, "every task answered").await;

    // Retried, an expired time that has passed is left off.
    let o = jw(&url, &["retry", "e-1"]).await;
    assert_exit(&o, 0);
    assert!(stderr(&o).contains("dropped `expires`"), "{}", stderr(&o));
    let r = final_result(&js, "e-1-r1", T).await;
    assert_eq!(r.status, Status::Success, "{r:?}");
    assert!(ran("e-1").exists());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn submit_in_queues_the_task_later_and_wait_waits_for_it() {
    let srv = NatsServer::start();
    let url = srv.url();
    let _w = ProcWorker::start(&url, &[]);
    let js = srv.js().await;
    let before = Utc::now();
    let o = jw(
        &url,
        &["submit", "--in", "2s", "--id", "later", "--", "echo later"],
    )
    .await;
    assert_exit(&o, 0);
    assert_eq!(stdout(&o).trim(), "later");
    // Not queued yet: no record, nothing on tasks.default.
    assert!(last_result(&js, "later").await.is_none(), "ran at once");
    let r = final_result(&js, "later", T).await;
    assert_eq!((r.status, r.output.as_str()), (Status::Success, "later\n"));
    assert!(
        r.started_at >= before + chrono::Duration::seconds(2),
        "started {} before the 2s were over (submitted {before})",
        r.started_at
    );

    // --wait waits through the delay.
    let o = jw(
        &url,
        &["submit", "--in", "2s", "--wait", "--", "echo waited"],
    )
    .await;
    assert_exit(&o, 0);
    assert!(stdout(&o).contains("waited"), "{}", stdout(&o));

    // A delayed task waits as a schedule until it fires; it can be removed.
    let o = jw(
        &url,
        &["submit", "--in", "1h", "--id", "much-later", "--", "true"],
    )
    .await;
    assert_exit(&o, 0);
    let o = jw(&url, &["schedule", "ls", "--json"]).await;
    let v = json_lines(&stdout(&o));
    assert!(
        v.iter()
            .any(|s| s["name"] == "delayed.much-later" && s["target"] == "tasks.default"),
        "{v:?}"
    );
    let o = jw(&url, &["schedule", "rm", "delayed.much-later"]).await;
    assert_exit(&o, 0);
    let o = jw(&url, &["schedule", "ls", "--json"]).await;
    assert_eq!(stdout(&o), "");
    let o = jw(
        &url,
        &["submit", "--at", "2020-01-01T00:00:00Z", "--", "true"],
    )
    .await;
    assert_exit(&o, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_final_status_is_counted_with_label_and_type() {
    let srv = NatsServer::start();
    let url = srv.url();
    let js = srv.js().await;
    // Queued before the worker starts, with its cancel key: cancelled
    // before it starts (the worker reads the keys before pulling).
    let o = jw(&url, &["setup"]).await;
    assert_exit(&o, 0);
    let cancel = js.get_key_value("cancel").await.unwrap();
    cancel.put("c-1", "not needed".into()).await.unwrap();
    publish_task(&js, "default", &shell("c-1", "true", once())).await;

    let addr = free_addr();
    let _w = InProcWorker::start(
        |c| {
            c.metrics_addr = Some(addr);
            c.types = Some(vec!["shell".into()]);
        },
        &url,
    );
    publish_task(&js, "default", &shell("s-1", "true", once())).await;
    publish_task(&js, "default", &shell("f-1", "exit 2", once())).await;
    let timeout = serde_json::json!({"retry": {"max_attempts": 1}, "timeout": "1s"});
    publish_task(&js, "default", &shell("t-1", "sleep 30", timeout)).await;
    let past = serde_json::json!({"expires": "2020-01-01T00:00:00Z"});
    publish_task(&js, "default", &shell("x-1", "true", past)).await;
    // Invalid (a misspelt field): rejected; its type is still readable.
    publish_task(&js, "default", &misspelt("r-1")).await;
    // A type nobody runs, one attempt: dead.
    publish_task(&js, "default", &command_once("d-1")).await;
    // Cancelled while it runs.
    publish_task(&js, "default", &shell("c-2", "sleep 30", once())).await;
    wait_for(T, "c-2 running", || async {
        last_result(&js, "c-2")
            .await
            .filter(|r| r.status == Status::Running)
    })
    .await;
    cancel.put("c-2", "stop".into()).await.unwrap();

    let want = [
        ("c-1", "shell", Status::Cancelled),
        ("s-1", "shell", Status::Success),
        ("f-1", "shell", Status::Failed),
        ("t-1", "shell", Status::Timeout),
        ("x-1", "shell", Status::Expired),
        ("r-1", "shell", Status::Rejected),
        ("d-1", "command", Status::Dead),
        ("c-2", "shell", Status::Cancelled),
    ];
    for (id, _, status) in want {
        let r: TaskResult = final_result(&js, id, T).await;
        assert_eq!(r.status, status, "{id}: {r:?}");
    }
    // One final status per task, counted by label, type and status.
    let mut finals = std::collections::BTreeMap::new();
    for (_, ty, status) in want {
        *finals.entry((ty, status.as_str())).or_insert(0) += 1;
    }
    let mut lines: Vec<String> = finals
        .iter()
        .map(|((ty, status), n)| {
            format!(r#"jetworker_tasks_finished_total{{label="default",type="{ty}",status="{status}"}} {n}"#)
        })
        .collect();
    // Four attempts ran (s-1, f-1, t-1, c-2); the rest were settled unrun.
    lines.extend(
        [
            r#"jetworker_attempt_duration_seconds_count{label="default",type="shell"} 4"#,
            "jetworker_slots 4",
            "jetworker_connected 1",
            "jetworker_running 0",
            "jetworker_outbox 0",
            "jetworker_outbox_oldest_age_seconds 0.0",
            "jetworker_reconnects_total 0",
            "jetworker_lease_lost_total 0",
        ]
        .map(String::from),
    );
    // Counted once the record is stored: poll until every line is there.
    let m = wait_for(T, "every final status in /metrics", || async {
        let (_, m) = http_get(addr, "/metrics").await?;
        lines.iter().all(|l| m.contains(l.as_str())).then_some(m)
    })
    .await;
    assert!(
        m.contains(&format!(
            "jetworker_build_info{{version=\"{}\"}} 1",
            jetworker::VERSION
        )),
        "{m}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn json_log_lines_carry_flat_task_fields() {
    let srv = NatsServer::start();
    let dir = tempfile::tempdir().unwrap();
    let w = json_worker(&srv.url(), dir.path(), &[], "info,jetworker=debug");
    let js = srv.js().await;
    publish_task(&js, "default", &shell("j-1", "echo hi", once())).await;
    let retried = serde_json::json!({"retry": {"max_attempts": 2, "backoff": "100ms"}});
    publish_task(&js, "default", &shell("j-2", "exit 1", retried)).await;
    final_result(&js, "j-1", T).await;
    final_result(&js, "j-2", T).await;
    let worker_id = wait_for(T, "the heartbeat", || async {
        heartbeats(&js).await?.first().map(|h| h.id.clone())
    })
    .await;
    let (text, lines) = stop_and_read(w, dir.path()).await;
    assert!(lines.len() > 5, "{text}");
    for l in &lines {
        assert_eq!(l["worker_id"], worker_id.as_str(), "{l}");
        assert!(l.get("span").is_none() && l.get("spans").is_none(), "{l}");
        if l.get("task_id").is_some() {
            assert_eq!(l["label"], "default", "{l}");
        }
    }
    let finished: Vec<&serde_json::Value> = lines
        .iter()
        .filter(|l| l["message"] == "attempt finished")
        .collect();
    // `attempt` comes from the task's span (the event does not name it).
    let mut seen: Vec<(String, u64)> = finished
        .iter()
        .map(|l| {
            (
                l["task_id"].as_str().unwrap().to_string(),
                l["attempt"].as_u64().unwrap(),
            )
        })
        .collect();
    seen.sort();
    assert_eq!(
        seen,
        [
            ("j-1".to_string(), 1),
            ("j-2".to_string(), 1),
            ("j-2".to_string(), 2)
        ],
        "{text}"
    );
    // Lines inside the attempt (the runner's debug line) carry the attempt too.
    assert!(
        lines
            .iter()
            .any(|l| l["message"] == "running" && l["task_id"] == "j-2" && l["attempt"] == 2),
        "{text}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn json_log_lines_name_the_task_at_warn_level_too() {
    let srv = NatsServer::start();
    let dir = tempfile::tempdir().unwrap();
    let w = json_worker(&srv.url(), dir.path(), &["--types", "shell"], "warn");
    let js = srv.js().await;
    // Each gets a warning inside its task: rejected; a type nobody runs.
    publish_task(&js, "default", &misspelt("w-1")).await;
    publish_task(&js, "default", &command_once("w-2")).await;
    assert_eq!(final_result(&js, "w-1", T).await.status, Status::Rejected);
    assert_eq!(final_result(&js, "w-2", T).await.status, Status::Dead);
    let (text, lines) = stop_and_read(w, dir.path()).await;
    for (id, message) in [("w-1", "rejected task"), ("w-2", "no online worker")] {
        let l = lines
            .iter()
            .find(|l| l["message"].as_str().unwrap_or("").starts_with(message))
            .unwrap_or_else(|| panic!("no line {message:?} in {text}"));
        assert_eq!(
            (l["task_id"].as_str(), l["label"].as_str()),
            (Some(id), Some("default")),
            "{l}"
        );
        assert!(
            l["worker_id"]
                .as_str()
                .is_some_and(|w| w.starts_with("proc-")),
            "{l}"
        );
    }
}
