//! The operator CLI against a real nats-server, run as the built binary.
//! These tests need no worker: they write results, heartbeats and dead
//! letters straight into the streams and buckets (as a worker would) and
//! check what the commands print and exit with. The tests that need a
//! running worker are in `cli_worker.rs`.

use std::collections::BTreeMap;
use std::process::Output;
use std::time::Duration;

use async_nats::jetstream;
use bytes::Bytes;
use chrono::Utc;
use jetworker::protocol::{Heartbeat, Names, Status, TaskResult};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

use crate::util::{jetworker_bin, publish_raw, wait_for, NatsServer};

/// `jetworker --server <url> <args>` with a clean environment (no
/// NATS_URL, no nats context of the person running the tests).
pub fn jw_command(url: &str, args: &[&str]) -> Command {
    let mut c = Command::new(jetworker_bin());
    c.arg("--server")
        .arg(url)
        .args(args)
        .env_remove("NATS_URL")
        .env_remove("NATS_CONTEXT")
        .env("XDG_CONFIG_HOME", "/nonexistent-jetworker-test")
        .env("NO_COLOR", "1")
        .stdin(std::process::Stdio::null())
        .kill_on_drop(true);
    c
}

/// Run to the end; output and exit code.
pub async fn jw(url: &str, args: &[&str]) -> Output {
    tokio::time::timeout(Duration::from_secs(60), jw_command(url, args).output())
        .await
        .unwrap_or_else(|_| panic!("jetworker {args:?} did not finish in 60s"))
        .unwrap()
}

pub fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Assert the exit code, showing the output when it differs.
#[track_caller]
pub fn assert_exit(o: &Output, code: i32) {
    assert_eq!(
        o.status.code(),
        Some(code),
        "stdout:\n{}\nstderr:\n{}",
        stdout(o),
        stderr(o)
    );
}

/// A running command whose stdout and stderr are read line by line.
pub struct Running {
    pub child: Child,
    lines: tokio::sync::mpsc::UnboundedReceiver<String>,
    errs: tokio::sync::mpsc::UnboundedReceiver<String>,
    pub seen: Vec<String>,
    pub seen_err: Vec<String>,
}

/// Forward the lines of `r` into a channel.
fn line_channel(
    r: impl tokio::io::AsyncRead + Unpin + Send + 'static,
) -> tokio::sync::mpsc::UnboundedReceiver<String> {
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(async move {
        let mut r = BufReader::new(r).lines();
        while let Ok(Some(l)) = r.next_line().await {
            if tx.send(l).is_err() {
                break;
            }
        }
    });
    rx
}

impl Running {
    pub fn spawn(url: &str, args: &[&str]) -> Running {
        let mut c = jw_command(url, args);
        c.stdout(std::process::Stdio::piped());
        c.stderr(std::process::Stdio::piped());
        let mut child = c.spawn().unwrap();
        let lines = line_channel(child.stdout.take().unwrap());
        let errs = line_channel(child.stderr.take().unwrap());
        Running {
            child,
            lines,
            errs,
            seen: Vec::new(),
            seen_err: Vec::new(),
        }
    }

    /// Wait for a stderr line containing `part`; returns it.
    pub async fn expect_err(&mut self, part: &str, timeout: Duration) -> String {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            match tokio::time::timeout_at(deadline, self.errs.recv()).await {
                Ok(Some(l)) => {
                    self.seen_err.push(l.clone());
                    if l.contains(part) {
                        return l;
                    }
                }
                Ok(None) => panic!(
                    "stderr ended without {part:?}; saw {:#?} / stdout {:#?}",
                    self.seen_err, self.seen
                ),
                Err(_) => panic!(
                    "no stderr line with {part:?} in {timeout:?}; saw {:#?}",
                    self.seen_err
                ),
            }
        }
    }

    /// Wait for the `jetworker: ready:` line a follow or watch prints once
    /// it is subscribed.
    pub async fn ready(&mut self) {
        self.expect_err("jetworker: ready:", Duration::from_secs(20))
            .await;
    }

    /// Wait for a line containing every one of `parts`; returns it.
    pub async fn expect(&mut self, parts: &[&str], timeout: Duration) -> String {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            match tokio::time::timeout_at(deadline, self.lines.recv()).await {
                Ok(Some(l)) => {
                    self.seen.push(l.clone());
                    if parts.iter().all(|p| l.contains(p)) {
                        return l;
                    }
                }
                Ok(None) => panic!("output ended without {parts:?}; saw {:#?}", self.seen),
                Err(_) => panic!(
                    "no line with {parts:?} in {timeout:?}; saw {:#?}",
                    self.seen
                ),
            }
        }
    }

    /// Like [`Running::expect`], but `None` on timeout.
    pub async fn try_expect(&mut self, parts: &[&str], timeout: Duration) -> Option<String> {
        let deadline = tokio::time::Instant::now() + timeout;
        while let Ok(Some(l)) = tokio::time::timeout_at(deadline, self.lines.recv()).await {
            self.seen.push(l.clone());
            if parts.iter().all(|p| l.contains(p)) {
                return Some(l);
            }
        }
        None
    }

    /// Wait for the process to exit; its code.
    pub async fn exit_code(&mut self, timeout: Duration) -> Option<i32> {
        tokio::time::timeout(timeout, self.child.wait())
            .await
            .unwrap_or_else(|_| panic!("did not exit in {timeout:?}; saw {:#?}", self.seen))
            .unwrap()
            .code()
    }
}

/// Create every stream and bucket (as `jetworker setup` does).
async fn setup(url: &str, extra: &[&str]) {
    let mut args = vec!["setup"];
    args.extend_from_slice(extra);
    let o = jw(url, &args).await;
    assert_exit(&o, 0);
}

/// A result as a worker would publish it.
pub fn fake_result(id: &str, label: &str, status: Status, fin: bool, attempt: u32) -> TaskResult {
    let now = Utc::now();
    TaskResult {
        id: id.into(),
        label: label.into(),
        task_type: Some("shell".into()),
        status,
        is_final: fin,
        attempt,
        max_attempts: 3,
        exit_code: Some(if status == Status::Success { 0 } else { 1 }),
        signal: None,
        http_status: None,
        output: format!("output of {id} attempt {attempt}\nsecond line\n"),
        output_truncated: false,
        output_bytes: 30,
        error: (status != Status::Success).then(|| "exit code 1".to_string()),
        worker_id: "fake-1".into(),
        idempotency_key: Some(id.into()),
        shard: None,
        started_at: now,
        finished_at: now,
        duration_ms: 12,
        retry_in_ms: (!fin).then_some(1000),
        task_seq: None,
        children: Vec::new(),
        join: None,
        parent: None,
        live: true,
    }
}

async fn publish_result(js: &jetstream::Context, r: &TaskResult) {
    publish_raw(
        js,
        &Names::default().result_subject(&r.id),
        Bytes::from(serde_json::to_vec(r).unwrap()),
        Some(&format!("{}.{}", r.id, r.attempt)),
    )
    .await;
}

/// Every message on `subject` (wildcards allowed) in stream `stream`:
/// (headers, payload). Reads by sequence, no consumer (a consumer on the
/// work-queue stream would compete with the workers).
pub async fn stream_messages(
    js: &jetstream::Context,
    stream: &str,
    subject: &str,
) -> Vec<(async_nats::HeaderMap, Bytes)> {
    let s = js.get_stream(stream).await.unwrap();
    let mut out = Vec::new();
    let mut seq = 1;
    while let Ok(m) = s
        .raw_message_builder()
        .sequence(seq)
        .next_by_subject(subject.to_string())
        .send()
        .await
    {
        seq = m.sequence + 1;
        out.push((m.headers.clone(), m.payload.clone()));
    }
    out
}

fn json(b: &[u8]) -> serde_json::Value {
    serde_json::from_slice(b).unwrap()
}

/// JSON lines of a command's stdout.
fn json_lines(o: &Output) -> Vec<serde_json::Value> {
    stdout(o)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{l}: {e}")))
        .collect()
}

#[tokio::test]
async fn schema_validates_design_examples_and_rejects_unknown_fields() {
    // `schema` needs no server: the unreachable URL proves it.
    let o = jw("nats://127.0.0.1:1", &["schema"]).await;
    assert_exit(&o, 0);
    let schema: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let v = jsonschema::validator_for(&schema).expect("a valid JSON Schema");
    for ok in [
        r#"{"type":"shell","payload":"echo hello"}"#,
        r#"{"type":"shell","script":"echo $SHARD_NO","id":"job-1","shard":{"no":0,"total":4},
            "timeout":"90s","retry":{"max_attempts":3,"backoff":"1s","factor":2,"max_backoff":"5m"},
            "env":{"A":"1"},"limits":{"memory":"256MiB","cpu":1.5,"pids":256,"nofile":1024,"output":"1MiB"}}"#,
        r#"{"type":"shell","payload":"x","shard_no":1,"shard_total":2,"timeout_seconds":30,"idempotency_key":"k","expires":"10m"}"#,
        r#"{"type":"shell","payload":"x","expires":"2026-01-02T03:04:05Z"}"#,
        r#"{"type":"command","command":"/bin/echo","args":["hi"]}"#,
        r#"{"type":"http","url":"https://example.com/hook","method":"POST","headers":{"A":"b"},"body":"{}","success":[200,299]}"#,
        r#"{"type":"http","payload":"https://example.com","success":"200-204"}"#,
        r#"{"type":"container","image":"busybox","entrypoint":["sh","-c"],"args":["echo hi"],
            "workdir":"/tmp","user":"1000","network":"none","pull":"if-missing","limits":{"memory":67108864}}"#,
        r#"{"type":"container","image":"busybox","payload":"-e A=1 --memory 64MiB"}"#,
        r#"{"type":"shell","script":"a","then":{"type":"shell","script":"b"}}"#,
        r#"{"type":"shell","script":"a","then":[{"type":"shell","script":"b","then":[{"type":"command","command":"c"}]},
            {"id":"undo","type":"shell","script":"u","on":["failed","timeout"],"label":"ops"}]}"#,
        r#"{"id":"j-0","type":"shell","script":"s","shard":{"no":0,"total":2},
            "then_all":{"type":"shell","script":"m","policy":"always"}}"#,
        r#"{"id":"j-join","type":"shell","script":"m","parent":"j",
            "join_summary":{"policy":"all_success","total":2,"counts":{"success":2},"not_success":[]}}"#,
    ] {
        let task: serde_json::Value = serde_json::from_str(ok).unwrap();
        let errors: Vec<String> = v.iter_errors(&task).map(|e| e.to_string()).collect();
        assert!(errors.is_empty(), "{ok}: {errors:?}");
    }
    for bad in [
        r#"{"type":"shell","payload":"x","timout":"5s"}"#,
        r#"{"type":"ftp","payload":"x"}"#,
        r#"{"type":"shell","retry":{"max_attempts":"3"}}"#,
        r#"{"type":"shell","shard":{"no":1}}"#,
        r#"{"type":"shell","payload":"x","then":[{"type":"shell","timout":"5s"}]}"#,
        r#"{"type":"shell","payload":"x","then":"echo"}"#,
        r#"{"type":"shell","payload":"x","then":[{"type":"shell","on":["sometimes"]}]}"#,
    ] {
        let task: serde_json::Value = serde_json::from_str(bad).unwrap();
        assert!(!v.is_valid(&task), "schema accepted {bad}");
    }
}

#[tokio::test]
async fn unreachable_server_is_exit_2_with_one_line() {
    let o = jw("nats://127.0.0.1:1", &["workers"]).await;
    assert_exit(&o, 2);
    let err = stderr(&o);
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(err.starts_with("jetworker: cannot connect"), "{err}");
}

#[tokio::test]
async fn nats_context_file_names_the_server() {
    let server = NatsServer::start();
    let home = tempfile::tempdir().unwrap();
    let dir = home.path().join("nats");
    std::fs::create_dir_all(dir.join("context")).unwrap();
    std::fs::write(dir.join("context.txt"), "test").unwrap();
    std::fs::write(
        dir.join("context/test.json"),
        format!(r#"{{"description":"t","url":"{}"}}"#, server.url()),
    )
    .unwrap();
    // No --server: the context is the only place that names the port.
    let o = Command::new(jetworker_bin())
        .args(["submit", "--id", "ctx-1", "--", "true"])
        .env_remove("NATS_URL")
        .env_remove("NATS_CONTEXT")
        .env("XDG_CONFIG_HOME", home.path())
        .stdin(std::process::Stdio::null())
        .output()
        .await
        .unwrap();
    assert_exit(&o, 0);
    let js = server.js().await;
    assert_eq!(
        stream_messages(&js, "TASKS", "tasks.default").await.len(),
        1
    );
}

#[tokio::test]
async fn setup_creates_and_updates_streams_and_buckets() {
    let server = NatsServer::start();
    let url = server.url();
    setup(&url, &[]).await;
    // Shortening the results' retention (7d → 1h) is refused without
    // --force, and nothing changes.
    let shorter = [
        "setup",
        "--results-max-age",
        "1h",
        "--offline-after",
        "5s",
        "--cancel-max-age",
        "2h",
    ];
    let o = jw(&url, &shorter).await;
    assert_exit(&o, 2);
    assert!(stderr(&o).contains("refusing"), "{}", stderr(&o));
    assert!(
        stdout(&o).contains("RESULTS: would update; max_age 7days → 1h (lowers)"),
        "{}",
        stdout(&o)
    );
    let js = server.js().await;
    assert_eq!(
        js.get_stream("RESULTS")
            .await
            .unwrap()
            .info()
            .await
            .unwrap()
            .config
            .max_age,
        Duration::from_secs(7 * 24 * 3600)
    );
    // --dry-run --json: one object per stream and bucket, nothing changed.
    let mut dry = shorter.to_vec();
    dry.extend(["--dry-run", "--json", "--force"]);
    let o = jw(&url, &dry).await;
    assert_exit(&o, 0);
    let plans = json_lines(&o);
    assert_eq!(plans.len(), 6, "{plans:?}");
    let results = plans.iter().find(|p| p["name"] == "RESULTS").unwrap();
    assert_eq!(results["action"], "would update");
    assert_eq!(results["changes"][0]["lowers"], true);
    let mut forced = shorter.to_vec();
    forced.push("--force");
    setup(&url, &forced[1..]).await;
    // (Lowering replicas needs a cluster; the rule is unit-tested in
    // commands::setup.)
    let mut results = js.get_stream("RESULTS").await.unwrap();
    assert_eq!(
        results.info().await.unwrap().config.max_age,
        Duration::from_secs(3600)
    );
    let mut tasks = js.get_stream("TASKS").await.unwrap();
    let cfg = tasks.info().await.unwrap().config.clone();
    assert!(cfg.allow_message_schedules);
    assert!(cfg.subjects.contains(&"schedules.>".to_string()));
    js.get_stream("DEAD").await.unwrap();
    let mut workers = js.get_stream("KV_workers").await.unwrap();
    assert_eq!(
        workers.info().await.unwrap().config.max_age,
        Duration::from_secs(5)
    );
    let mut cancel = js.get_stream("KV_cancel").await.unwrap();
    assert_eq!(
        cancel.info().await.unwrap().config.max_age,
        Duration::from_secs(7200)
    );
    // Join progress is kept as long as results.
    let mut joins = js.get_stream("KV_joins").await.unwrap();
    assert_eq!(
        joins.info().await.unwrap().config.max_age,
        Duration::from_secs(3600)
    );
    let o = jw(&url, &["setup", "--results-max-age", "forever"]).await;
    assert_exit(&o, 2);
    assert!(stderr(&o).contains("--results-max-age"), "{}", stderr(&o));
}

#[tokio::test]
async fn submit_publishes_with_msg_id_and_fails_fast_on_bad_tasks() {
    let server = NatsServer::start();
    let url = server.url();
    // Before any stream exists: submit creates them, the task is queued.
    let o = jw(
        &url,
        &[
            "submit",
            "--id",
            "job-1",
            "--retries",
            "4",
            "-e",
            "A=1",
            "--",
            "echo",
            "$A",
        ],
    )
    .await;
    assert_exit(&o, 0);
    assert_eq!(stdout(&o).trim(), "job-1");
    // The same command again inside the duplicate window queues nothing.
    let o = jw(&url, &["submit", "--id", "job-1", "--", "echo", "$A"]).await;
    assert_exit(&o, 0);
    assert!(stderr(&o).contains("already queued"), "{}", stderr(&o));
    let js = server.js().await;
    let msgs = stream_messages(&js, "TASKS", "tasks.default").await;
    assert_eq!(msgs.len(), 1);
    let (h, body) = &msgs[0];
    assert_eq!(h.get("Nats-Msg-Id").unwrap().as_str(), "job-1");
    let t = json(body);
    assert_eq!(t["id"], "job-1");
    assert_eq!(t["type"], "shell");
    assert_eq!(t["script"], "echo $A");
    assert_eq!(t["retry"]["max_attempts"], 5);
    assert_eq!(t["env"]["A"], "1");

    // A random id, a command task on another label.
    let o = jw(
        &url,
        &[
            "submit",
            "-l",
            "other",
            "--type",
            "command",
            "--",
            "/bin/echo",
            "a",
            "b",
        ],
    )
    .await;
    assert_exit(&o, 0);
    let id = stdout(&o).trim().to_string();
    assert!(jetworker::protocol::valid_id(&id), "{id}");
    let msgs = stream_messages(&js, "TASKS", "tasks.other").await;
    let t = json(&msgs[0].1);
    assert_eq!(t["id"], id.as_str());
    assert_eq!(t["command"], "/bin/echo");
    assert_eq!(t["args"], serde_json::json!(["a", "b"]));

    // Shards: ids <id>-<no>, shard {no,total}.
    let o = jw(
        &url,
        &[
            "submit", "-l", "sh", "--id", "fan", "--shards", "3", "--json", "--", "true",
        ],
    )
    .await;
    assert_exit(&o, 0);
    let lines = json_lines(&o);
    assert_eq!(lines.len(), 3);
    assert_eq!(lines[2]["id"], "fan-2");
    let msgs = stream_messages(&js, "TASKS", "tasks.sh").await;
    let shards: Vec<(String, u64, u64)> = msgs
        .iter()
        .map(|(_, b)| {
            let t = json(b);
            (
                t["id"].as_str().unwrap().to_string(),
                t["shard"]["no"].as_u64().unwrap(),
                t["shard"]["total"].as_u64().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        shards,
        vec![
            ("fan-0".to_string(), 0, 3),
            ("fan-1".to_string(), 1, 3),
            ("fan-2".to_string(), 2, 3)
        ]
    );

    // A file with flags on top.
    let dir = tempfile::tempdir().unwrap();
    let f = dir.path().join("t.json");
    std::fs::write(
        &f,
        r#"{"type":"http","url":"https://example.com","method":"POST"}"#,
    )
    .unwrap();
    let o = jw(
        &url,
        &[
            "submit",
            "-l",
            "web",
            "--file",
            f.to_str().unwrap(),
            "--id",
            "h1",
            "--timeout",
            "5s",
        ],
    )
    .await;
    assert_exit(&o, 0);
    let t = json(&stream_messages(&js, "TASKS", "tasks.web").await[0].1);
    assert_eq!(t["url"], "https://example.com");
    assert_eq!(t["timeout"], "5s");
    assert_eq!(t["id"], "h1");

    // Bad tasks: exit 2, one line naming the problem, nothing published.
    let before = crate::util::tasks_left(&js).await;
    for (args, needle) in [
        (vec!["submit", "--timeout", "soon", "--", "x"], "timeout"),
        (vec!["submit", "--type", "command"], "command"),
        (vec!["submit", "-e", "ATTEMPT=3", "--", "x"], "env.ATTEMPT"),
        (vec!["submit", "--id", "bad id", "--", "x"], "--id"),
        (vec!["submit", "--label", "a.b", "--", "x"], "--label"),
        (vec!["submit", "--type", "http", "--url", "ftp://x"], "url"),
        (vec!["submit", "--limit", "disk=1G", "--", "x"], "disk"),
        (
            vec!["submit", "--file", f.to_str().unwrap(), "--shards", "0"],
            "--shards",
        ),
    ] {
        let o = jw(&url, &args).await;
        assert_exit(&o, 2);
        let err = stderr(&o);
        assert!(err.contains(needle), "{args:?}: {err}");
        assert_eq!(err.lines().count(), 1, "{args:?}: {err}");
    }
    std::fs::write(&f, r#"{"type":"shell","payload":"x","timout":"5s"}"#).unwrap();
    let o = jw(&url, &["submit", "--file", f.to_str().unwrap()]).await;
    assert_exit(&o, 2);
    assert!(stderr(&o).contains("timout"), "{}", stderr(&o));
    assert_eq!(crate::util::tasks_left(&js).await, before);
}

#[tokio::test]
async fn submit_wait_maps_final_results_to_exit_codes() {
    let server = NatsServer::start();
    let url = server.url();
    setup(&url, &[]).await;
    let js = server.js().await;

    // Success: exit 0, the summary and the output.
    let mut run = Running::spawn(&url, &["submit", "--id", "w-ok", "--wait", "--", "true"]);
    wait_for(Duration::from_secs(10), "task queued", || async {
        (crate::util::tasks_left(&js).await >= 1).then_some(())
    })
    .await;
    publish_result(
        &js,
        &fake_result("w-ok", "default", Status::Failed, false, 1),
    )
    .await;
    publish_result(
        &js,
        &fake_result("w-ok", "default", Status::Success, true, 2),
    )
    .await;
    run.expect(&["w-ok", "success", "attempt 2/3"], Duration::from_secs(10))
        .await;
    let note = run
        .expect_err("w-ok attempt 1/3 failed", Duration::from_secs(5))
        .await;
    assert!(note.contains("retrying in 1.0s"), "{note}");
    run.expect(&["output of w-ok attempt 2"], Duration::from_secs(5))
        .await;
    assert_eq!(run.exit_code(Duration::from_secs(10)).await, Some(0));

    // A final failure: exit 1.
    let mut run = Running::spawn(
        &url,
        &["submit", "--id", "w-bad", "--wait", "--json", "--", "false"],
    );
    // No worker serves the label: the waiter says so.
    run.expect_err(
        "no worker online serves label default",
        Duration::from_secs(10),
    )
    .await;
    publish_result(
        &js,
        &fake_result("w-bad", "default", Status::Failed, true, 3),
    )
    .await;
    let l = run.expect(&["w-bad"], Duration::from_secs(10)).await;
    let r: TaskResult = serde_json::from_str(&l).unwrap();
    assert_eq!(r.status, Status::Failed);
    assert_eq!(run.exit_code(Duration::from_secs(10)).await, Some(1));

    // Re-submitting a finished id answers with its stored result at once.
    let o = jw(&url, &["submit", "--id", "w-ok", "--wait", "--", "true"]).await;
    assert_exit(&o, 0);

    // Shards: all must succeed.
    let mut run = Running::spawn(
        &url,
        &[
            "submit", "--id", "ws", "--shards", "2", "--wait", "--", "true",
        ],
    );
    run.expect_err("no worker online serves label", Duration::from_secs(10))
        .await;
    publish_result(
        &js,
        &fake_result("ws-0", "default", Status::Success, true, 1),
    )
    .await;
    publish_result(
        &js,
        &fake_result("ws-1", "default", Status::Timeout, true, 1),
    )
    .await;
    run.expect(&["ws-1", "timeout"], Duration::from_secs(10))
        .await;
    assert_eq!(run.exit_code(Duration::from_secs(10)).await, Some(1));

    // Nobody answers: --wait-timeout gives up with exit 1.
    let o = jw(
        &url,
        &["submit", "--wait", "--wait-timeout", "1s", "--", "true"],
    )
    .await;
    assert_exit(&o, 1);
    assert!(stderr(&o).contains("gave up waiting"), "{}", stderr(&o));
    // A bad task never waits: exit 2.
    let o = jw(&url, &["submit", "--wait", "--timeout", "x", "--", "true"]).await;
    assert_exit(&o, 2);
}

#[tokio::test]
async fn results_lists_filters_and_shows_attempts() {
    let server = NatsServer::start();
    let url = server.url();
    setup(&url, &[]).await;
    let js = server.js().await;
    publish_result(&js, &fake_result("r-a", "x", Status::Success, true, 1)).await;
    publish_result(&js, &fake_result("r-b", "y", Status::Failed, false, 1)).await;
    publish_result(&js, &fake_result("r-b", "y", Status::Failed, true, 2)).await;
    publish_result(&js, &fake_result("r-c", "x", Status::Timeout, true, 1)).await;

    let o = jw(&url, &["results"]).await;
    assert_exit(&o, 0);
    let out = stdout(&o);
    let lines: Vec<&str> = out.lines().collect();
    assert!(lines[0].starts_with("ID"), "{out}");
    assert_eq!(lines.len(), 4, "{out}");
    assert!(
        lines[2].contains("r-b") && lines[2].contains("failed") && lines[2].contains("2/3"),
        "{out}"
    );
    assert!(lines[1].contains("output of r-a attempt 1"), "{out}");

    let ids = |o: &Output| -> Vec<String> {
        json_lines(o)
            .iter()
            .map(|v| v["id"].as_str().unwrap().to_string())
            .collect()
    };
    let o = jw(&url, &["results", "--json", "--status", "failed"]).await;
    assert_eq!(ids(&o), vec!["r-b"]);
    let o = jw(&url, &["results", "--json", "--status", "failed,timeout"]).await;
    assert_eq!(ids(&o), vec!["r-b", "r-c"]);
    let o = jw(&url, &["results", "--json", "--label", "x"]).await;
    assert_eq!(ids(&o), vec!["r-a", "r-c"]);
    let o = jw(&url, &["results", "--json", "--limit", "1"]).await;
    assert_eq!(ids(&o), vec!["r-c"]);
    let o = jw(&url, &["results", "--json", "--since", "1h"]).await;
    assert_eq!(ids(&o), vec!["r-a", "r-b", "r-c"]);
    let o = jw(
        &url,
        &["results", "--json", "--since", "2999-01-01T00:00:00Z"],
    )
    .await;
    assert!(ids(&o).is_empty());
    let o = jw(&url, &["results", "--status", "bogus"]).await;
    assert_exit(&o, 2);

    // One task whole: every attempt; exit code from its final status.
    let o = jw(&url, &["results", "r-b"]).await;
    assert_exit(&o, 1);
    let out = stdout(&o);
    assert!(out.contains("attempt 1/3: failed (retry in 1.0s)"), "{out}");
    assert!(out.contains("attempt 2/3: failed (final)"), "{out}");
    assert!(out.contains("output of r-b attempt 2"), "{out}");
    let o = jw(&url, &["results", "r-b", "--json"]).await;
    assert_eq!(json_lines(&o).len(), 2);
    assert_exit(&jw(&url, &["results", "r-a"]).await, 0);
    let o = jw(&url, &["results", "nope"]).await;
    assert_exit(&o, 2);

    // -f (--follow): the table, then a row per new attempt.
    let mut f = Running::spawn(&url, &["results", "-f", "--label", "x"]);
    f.expect(&["r-c", "timeout"], Duration::from_secs(10)).await;
    f.ready().await;
    publish_result(&js, &fake_result("r-d", "y", Status::Success, true, 1)).await;
    publish_result(&js, &fake_result("r-e", "x", Status::Cancelled, true, 1)).await;
    let l = f.expect(&["r-e"], Duration::from_secs(10)).await;
    assert!(l.contains("cancelled"), "{l}");
    assert!(
        !f.seen.iter().any(|l| l.contains("r-d")),
        "label filter: {:?}",
        f.seen
    );
}

fn heartbeat(id: &str, tasks: &[&str]) -> Heartbeat {
    let now = Utc::now();
    Heartbeat {
        id: id.into(),
        hostname: "host-a".into(),
        pid: 42,
        version: "0.1.0".into(),
        labels: vec!["default".into(), "gpu".into()],
        types: vec!["shell".into(), "command".into()],
        slots: 4,
        running: tasks.len(),
        running_by_label: BTreeMap::new(),
        tasks: tasks.iter().map(|s| s.to_string()).collect(),
        started_at: now,
        seen_at: now,
        counts: BTreeMap::new(),
    }
}

#[tokio::test]
async fn workers_table_and_watch_see_stop_and_expiry() {
    let server = NatsServer::start();
    let url = server.url();
    setup(&url, &["--offline-after", "2s"]).await;
    let js = server.js().await;
    let kv = js.get_key_value("workers").await.unwrap();
    let o = jw(&url, &["workers"]).await;
    assert_exit(&o, 0);
    assert!(stdout(&o).contains("no workers online"));

    kv.put(
        "w-1",
        serde_json::to_vec(&heartbeat("w-1", &["t1"]))
            .unwrap()
            .into(),
    )
    .await
    .unwrap();
    let o = jw(&url, &["workers"]).await;
    assert_exit(&o, 0);
    let out = stdout(&o);
    assert!(out.lines().next().unwrap().starts_with("ID"), "{out}");
    let row = out.lines().nth(1).unwrap();
    for part in [
        "w-1",
        "host-a",
        "default,gpu",
        "shell,command",
        "4",
        "1",
        "0.1.0",
    ] {
        assert!(row.contains(part), "{part} in {row}");
    }
    let o = jw(&url, &["workers", "--json"]).await;
    let hb: Heartbeat = serde_json::from_str(stdout(&o).trim()).unwrap();
    assert_eq!(hb.id, "w-1");

    let mut watch = Running::spawn(&url, &["workers", "--watch"]);
    watch
        .expect(&["w-1", "host-a"], Duration::from_secs(10))
        .await;
    watch.ready().await;
    kv.put(
        "w-2",
        serde_json::to_vec(&heartbeat("w-2", &[])).unwrap().into(),
    )
    .await
    .unwrap();
    watch
        .expect(&["online", "w-2"], Duration::from_secs(10))
        .await;
    kv.delete("w-1").await.unwrap();
    watch
        .expect(&["offline", "w-1", "stopped"], Duration::from_secs(10))
        .await;
    // w-2 stops beating: the bucket's max age removes it, the marker shows it.
    watch
        .expect(&["offline", "w-2", "expired"], Duration::from_secs(15))
        .await;

    let mut watch = Running::spawn(&url, &["workers", "--watch", "--json"]);
    watch.ready().await;
    kv.put(
        "w-3",
        serde_json::to_vec(&heartbeat("w-3", &[])).unwrap().into(),
    )
    .await
    .unwrap();
    let l = watch.expect(&["w-3"], Duration::from_secs(10)).await;
    let v: serde_json::Value = serde_json::from_str(&l).unwrap();
    assert_eq!(v["event"], "online");
    assert_eq!(v["heartbeat"]["slots"], 4);
    // One shape per stream: the workers already online came first, as
    // `online` events too.
    for l in &watch.seen {
        let v: serde_json::Value = serde_json::from_str(l).unwrap();
        assert!(v["event"].is_string(), "{l}");
        assert!(v["worker"].is_string(), "{l}");
    }
}

#[tokio::test]
async fn cancel_stores_the_key_and_reports() {
    let server = NatsServer::start();
    let url = server.url();
    setup(&url, &[]).await;
    let js = server.js().await;
    // An id that is nowhere: refused (exit 1), no key stored.
    let o = jw(&url, &["cancel", "c-1", "--reason", "not needed"]).await;
    assert_exit(&o, 1);
    assert!(
        stderr(&o).contains("no task c-1 is known"),
        "{}",
        stderr(&o)
    );
    let kv = js.get_key_value("cancel").await.unwrap();
    assert!(kv.get("c-1").await.unwrap().is_none());
    // With --force the key is stored in advance.
    let o = jw(
        &url,
        &[
            "cancel",
            "c-1",
            "--reason",
            "not needed",
            "--force",
            "--json",
        ],
    )
    .await;
    assert_exit(&o, 0);
    let v = json_lines(&o);
    assert_eq!(v[0]["outcome"], "requested", "{v:?}");
    assert!(v[0]["message"].as_str().unwrap().contains("not running"));
    // A queued task is known: no --force needed.
    let o = jw(&url, &["submit", "--id", "c-q", "--", "true"]).await;
    assert_exit(&o, 0);
    let o = jw(&url, &["cancel", "c-q"]).await;
    assert_exit(&o, 0);
    assert!(stdout(&o).contains("will not start"), "{}", stdout(&o));
    assert_eq!(
        kv.get("c-1").await.unwrap().unwrap(),
        Bytes::from("not needed")
    );

    // A task listed as running on a worker; the worker reports `cancelled`.
    let workers = js.get_key_value("workers").await.unwrap();
    workers
        .put(
            "w-9",
            serde_json::to_vec(&heartbeat("w-9", &["c-2"]))
                .unwrap()
                .into(),
        )
        .await
        .unwrap();
    let mut run = Running::spawn(&url, &["cancel", "c-2"]);
    wait_for(Duration::from_secs(10), "cancel key", || async {
        kv.get("c-2").await.unwrap().map(|_| ())
    })
    .await;
    publish_result(
        &js,
        &fake_result("c-2", "default", Status::Cancelled, true, 1),
    )
    .await;
    // The message comes from the result (the worker that stopped it, how
    // long it ran), not from the heartbeat.
    run.expect(
        &[
            "c-2",
            "cancelled",
            "running attempt on fake-1 stopped after 12ms",
        ],
        Duration::from_secs(10),
    )
    .await;
    assert_eq!(run.exit_code(Duration::from_secs(10)).await, Some(0));

    // Already finished: nothing to cancel, exit 1.
    publish_result(
        &js,
        &fake_result("c-3", "default", Status::Success, true, 1),
    )
    .await;
    let o = jw(&url, &["cancel", "c-3"]).await;
    assert_exit(&o, 1);
    assert!(stdout(&o).contains("already finished"), "{}", stdout(&o));
    assert_exit(&jw(&url, &["cancel", "bad id"]).await, 2);
}

#[tokio::test]
async fn logs_follow_prints_chunks_and_ends_at_eof_or_final_result() {
    let server = NatsServer::start();
    let url = server.url();
    setup(&url, &[]).await;
    let js = server.js().await;
    let client = server.client().await;
    let chunk = |stream: &str, text: &str| {
        let mut h = async_nats::HeaderMap::new();
        h.insert("Jetworker-Stream", stream);
        (h, Bytes::from(text.to_string()))
    };

    let mut f = Running::spawn(&url, &["logs", "l-1", "--follow"]);
    // The follower subscribes before anything is published; retry the
    // first line until it is seen.
    let mut n = 0;
    loop {
        let (h, b) = chunk("stdout", &format!("line {n}\n"));
        client.publish_with_headers("logs.l-1", h, b).await.unwrap();
        client.flush().await.unwrap();
        if f.try_expect(&["line"], Duration::from_millis(300))
            .await
            .is_some()
        {
            break;
        }
        n += 1;
        assert!(n < 50, "follower never printed a line");
    }
    let (h, b) = chunk("stdout", "more output\n");
    client.publish_with_headers("logs.l-1", h, b).await.unwrap();
    f.expect(&["more output"], Duration::from_secs(5)).await;
    let (h, b) = chunk("eof", "");
    client.publish_with_headers("logs.l-1", h, b).await.unwrap();
    client.flush().await.unwrap();
    assert_eq!(f.exit_code(Duration::from_secs(10)).await, Some(0));

    // Ends when a final result appears (exit 1: it failed).
    let mut f = Running::spawn(&url, &["logs", "l-2", "--follow"]);
    tokio::time::sleep(Duration::from_millis(500)).await;
    publish_result(&js, &fake_result("l-2", "default", Status::Failed, true, 1)).await;
    assert_eq!(f.exit_code(Duration::from_secs(10)).await, Some(1));

    // A finished task: its stored output, with or without --follow.
    let o = jw(&url, &["logs", "l-2"]).await;
    assert_exit(&o, 1);
    assert!(stdout(&o).contains("output of l-2 attempt 1"));
    let o = jw(&url, &["logs", "l-2", "--follow"]).await;
    assert!(stdout(&o).contains("output of l-2 attempt 1"));
    let o = jw(&url, &["logs", "l-none"]).await;
    assert_exit(&o, 2);
}

/// `dead --limit N` shows the newest N, oldest first, from the end of a
/// long history (read in growing windows, not whole): sparse letters of one
/// label far behind many others are still found, and `--limit 0` is all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_limit_reads_the_newest_from_a_long_history() {
    let server = NatsServer::start();
    let url = server.url();
    setup(&url, &[]).await;
    let js = server.js().await;
    let put = |id: String, label: &'static str| {
        let js = js.clone();
        async move {
            let mut h = async_nats::HeaderMap::new();
            h.insert("Jetworker-Reason", "failed");
            h.insert("Jetworker-Task-Id", id.as_str());
            h.insert("Jetworker-Label", label);
            js.send_publish(
                format!("dead.{label}.{id}"),
                jetstream::message::PublishMessage::build()
                    .payload(Bytes::from(format!(r#"{{"type":"shell","id":"{id}"}}"#)))
                    .headers(h),
            )
            .await
            .unwrap()
            .await
            .unwrap();
        }
    };
    // Three `rare` letters first, then 600 `bulk` ones.
    for n in 0..3 {
        put(format!("rare-{n}"), "rare").await;
    }
    for n in 0..600 {
        put(format!("bulk-{n:03}"), "bulk").await;
    }
    let ids = |o: &std::process::Output| -> Vec<String> {
        json_lines(o)
            .iter()
            .map(|v| v["id"].as_str().unwrap().to_string())
            .collect()
    };
    let o = jw(&url, &["dead", "--json", "--limit", "5"]).await;
    assert_exit(&o, 0);
    assert_eq!(
        ids(&o),
        ["bulk-595", "bulk-596", "bulk-597", "bulk-598", "bulk-599"]
    );
    let o = jw(&url, &["dead", "--json", "--label", "rare", "--limit", "2"]).await;
    assert_exit(&o, 0);
    assert_eq!(ids(&o), ["rare-1", "rare-2"]);
    let o = jw(
        &url,
        &["dead", "--json", "--label", "rare", "--limit", "10"],
    )
    .await;
    assert_eq!(ids(&o), ["rare-0", "rare-1", "rare-2"]);
    let o = jw(&url, &["dead", "--json", "--limit", "0"]).await;
    let all = ids(&o);
    assert_eq!(all.len(), 603);
    assert_eq!(all[0], "rare-0");
    assert_eq!(all[602], "bulk-599");
}

#[tokio::test]
async fn dead_lists_replays_and_purges() {
    let server = NatsServer::start();
    let url = server.url();
    setup(&url, &[]).await;
    let js = server.js().await;
    let dead = |id: &str, label: &str, body: &str, reason: &str| {
        let mut h = async_nats::HeaderMap::new();
        h.insert("Jetworker-Reason", reason);
        h.insert("Jetworker-Task-Id", id);
        h.insert("Jetworker-Label", label);
        (
            format!("dead.{label}.{id}"),
            h,
            Bytes::from(body.to_string()),
        )
    };
    for (subject, h, b) in [
        dead(
            "d-1",
            "default",
            r#"{"type":"shell","id":"d-1","payload":"exit 1"}"#,
            "attempts used up (3)",
        ),
        dead(
            "d-2",
            "gpu",
            r#"{"type":"shell","payload":"x","timout":"1s"}"#,
            "rejected: timout: unknown field",
        ),
    ] {
        js.send_publish(
            subject,
            jetstream::message::PublishMessage::build()
                .payload(b)
                .headers(h),
        )
        .await
        .unwrap()
        .await
        .unwrap();
    }
    let o = jw(&url, &["dead"]).await;
    assert_exit(&o, 0);
    let out = stdout(&o);
    assert!(out.lines().nth(1).unwrap().contains("d-1"), "{out}");
    assert!(out.contains("attempts used up"), "{out}");
    assert!(out.contains("gpu"), "{out}");
    let o = jw(&url, &["dead", "--json", "--label", "gpu"]).await;
    let v = json_lines(&o);
    assert_eq!(v.len(), 1);
    assert_eq!(v[0]["id"], "d-2");
    assert!(v[0]["task"].as_str().unwrap().contains("timout"));

    // Replay: the original under <id>-r1, Nats-Msg-Id set, fresh budget.
    let o = jw(&url, &["dead", "replay", "d-1"]).await;
    assert_exit(&o, 0);
    assert!(stdout(&o).contains("d-1-r1"), "{}", stdout(&o));
    let msgs = stream_messages(&js, "TASKS", "tasks.default").await;
    assert_eq!(msgs.len(), 1);
    assert_eq!(msgs[0].0.get("Nats-Msg-Id").unwrap().as_str(), "d-1-r1");
    let t = json(&msgs[0].1);
    assert_eq!(t["id"], "d-1-r1");
    assert_eq!(t["payload"], "exit 1");
    // Once r1 has run, the next replay is r2.
    publish_result(
        &js,
        &fake_result("d-1-r1", "default", Status::Failed, true, 3),
    )
    .await;
    let o = jw(&url, &["dead", "replay", "d-1", "--json"]).await;
    assert_exit(&o, 0);
    let v = json_lines(&o);
    assert_eq!(v[0]["new_id"], "d-1-r2", "{v:?}");
    assert_eq!(v[0]["subject"], "tasks.default");
    // A task that can never be valid is not replayed as it is.
    let o = jw(&url, &["dead", "replay", "d-2"]).await;
    assert_exit(&o, 2);
    assert!(stderr(&o).contains("timout"), "{}", stderr(&o));
    assert_exit(&jw(&url, &["dead", "replay", "d-nope"]).await, 2);

    // Not a terminal: purging needs --force, and nothing is deleted.
    let o = jw(&url, &["dead", "purge", "--id", "d-1"]).await;
    assert_exit(&o, 2);
    assert!(stderr(&o).contains("--force"), "{}", stderr(&o));
    let o = jw(&url, &["dead", "purge", "--id", "d-1", "--force"]).await;
    assert_exit(&o, 0);
    assert!(stdout(&o).contains("purged 1"), "{}", stdout(&o));
    let o = jw(&url, &["dead", "--json"]).await;
    assert_eq!(json_lines(&o).len(), 1);
    let o = jw(&url, &["dead", "purge"]).await;
    assert_exit(&o, 2);
    assert!(
        stderr(&o).contains("Delete ALL 1 dead letter(s)"),
        "{}",
        stderr(&o)
    );
    let o = jw(&url, &["dead", "purge", "--force", "--json"]).await;
    assert_exit(&o, 0);
    assert_eq!(json_lines(&o)[0]["purged"], 1);
    assert!(stdout(&jw(&url, &["dead"]).await).contains("no dead letters"));
}

#[tokio::test]
async fn schedule_every_fires_into_tasks_until_removed() {
    let server = NatsServer::start();
    let url = server.url();
    // Bad specs fail locally, before connecting.
    for (args, needle) in [
        (
            vec!["schedule", "add", "s", "--cron", "61 * * * *", "--", "x"],
            "not a cron spec",
        ),
        (
            vec!["schedule", "add", "s", "--every", "500ms", "--", "x"],
            "at least 1s",
        ),
        (
            vec![
                "schedule",
                "add",
                "s",
                "--every",
                "1s",
                "--tz",
                "Europe/Paris",
                "--",
                "x",
            ],
            "--tz",
        ),
        (
            vec![
                "schedule",
                "add",
                "s",
                "--cron",
                "0 0 9 * * *",
                "--tz",
                "Nowhere/X",
                "--",
                "x",
            ],
            "--tz",
        ),
        (
            vec!["schedule", "add", "s", "--at", "tomorrow", "--", "x"],
            "--at",
        ),
        (
            vec!["schedule", "add", "a.b", "--every", "1s", "--", "x"],
            "schedule name",
        ),
        (
            vec![
                "schedule",
                "add",
                "s",
                "--every",
                "1s",
                "--timeout",
                "x",
                "--",
                "x",
            ],
            "timeout",
        ),
    ] {
        let o = jw("nats://127.0.0.1:1", &args).await;
        assert_exit(&o, 2);
        assert!(stderr(&o).contains(needle), "{args:?}: {}", stderr(&o));
    }

    let o = jw(
        &url,
        &[
            "schedule", "add", "tick", "--every", "1s", "-l", "sched", "--", "echo", "tick",
        ],
    )
    .await;
    assert_exit(&o, 0);
    let o = jw(
        &url,
        &[
            "schedule",
            "add",
            "nightly",
            "--cron",
            "30 2 * * *",
            "--tz",
            "Europe/Paris",
            "-l",
            "sched",
            "--json",
            "--",
            "backup",
        ],
    )
    .await;
    assert_exit(&o, 0);
    // A 5-field crontab spec means second 0.
    let added = json_lines(&o);
    assert_eq!(added[0]["spec"], "0 30 2 * * *", "{added:?}");
    assert_eq!(added[0]["target"], "tasks.sched");
    let o = jw(&url, &["schedule", "ls"]).await;
    assert_exit(&o, 0);
    let out = stdout(&o);
    assert!(
        out.contains("tick") && out.contains("@every 1s") && out.contains("tasks.sched"),
        "{out}"
    );
    assert!(
        out.contains("nightly") && out.contains("0 30 2 * * *") && out.contains("Europe/Paris"),
        "{out}"
    );
    let o = jw(&url, &["schedule", "ls", "--json"]).await;
    let v = json_lines(&o);
    assert_eq!(v.len(), 2);
    let nightly = v.iter().find(|s| s["name"] == "nightly").unwrap();
    let next: chrono::DateTime<Utc> = nightly["next"].as_str().unwrap().parse().unwrap();
    let local = next.with_timezone(&chrono_tz::Europe::Paris);
    assert_eq!(local.format("%H:%M:%S").to_string(), "02:30:00");

    // The server fires copies of the task into tasks.sched.
    let js = server.js().await;
    let fired = wait_for(Duration::from_secs(15), "3 firings", || async {
        let m = stream_messages(&js, "TASKS", "tasks.sched").await;
        (m.len() >= 3).then_some(m)
    })
    .await;
    for (h, b) in &fired {
        assert_eq!(h.get("Nats-Scheduler").unwrap().as_str(), "schedules.tick");
        assert_eq!(json(b)["script"], "echo tick");
    }

    let o = jw(&url, &["schedule", "rm", "tick"]).await;
    assert_exit(&o, 0);
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let n = stream_messages(&js, "TASKS", "tasks.sched").await.len();
    tokio::time::sleep(Duration::from_millis(2500)).await;
    assert_eq!(
        stream_messages(&js, "TASKS", "tasks.sched").await.len(),
        n,
        "still firing after rm"
    );
    let o = jw(&url, &["schedule", "ls", "--json"]).await;
    assert_eq!(json_lines(&o).len(), 1);
    assert_exit(&jw(&url, &["schedule", "rm", "tick"]).await, 2);
    let o = jw(&url, &["schedule", "rm", "nightly", "--json"]).await;
    assert_exit(&o, 0);
    assert_eq!(json_lines(&o)[0]["removed"], true);
}

#[tokio::test]
async fn completions_man_page_and_config_check() {
    // Completions and the man page need no server and no settings.
    for (shell, needle) in [
        ("bash", "complete -F"),
        ("zsh", "#compdef jetworker"),
        ("fish", "complete -c jetworker"),
    ] {
        let o = jw("nats://127.0.0.1:1", &["completions", shell]).await;
        assert_exit(&o, 0);
        let out = stdout(&o);
        assert!(out.contains(needle), "{shell}: {out}");
        assert!(
            out.contains("submit") && out.contains("results-stream"),
            "{shell}"
        );
    }
    let o = jw("nats://127.0.0.1:1", &["man"]).await;
    assert_exit(&o, 0);
    assert!(stdout(&o).starts_with(".ie") || stdout(&o).contains(".TH jetworker"));

    // config check: each setting, its value and where it came from.
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("config.toml");
    std::fs::write(
        &file,
        "labels = [\"a\", \"b\"]\n[names]\ntasks_stream = \"T2\"\n",
    )
    .unwrap();
    let mut c = jw_command(
        "nats://127.0.0.1:1",
        &[
            "config",
            "check",
            "--show-sources",
            "--config",
            file.to_str().unwrap(),
            "--slots",
            "3",
        ],
    );
    c.env("JETWORKER_DRAIN_TIMEOUT", "7s");
    let o = c.output().await.unwrap();
    assert_exit(&o, 0);
    let out = stdout(&o);
    let line = |key: &str| {
        out.lines()
            .find(|l| l.starts_with(&format!("{key} ")))
            .unwrap_or_else(|| panic!("{key} in {out}"))
            .to_string()
    };
    assert!(line("server").contains("# flag --server"), "{out}");
    assert!(line("slots").contains("= 3") && line("slots").contains("# flag --slots"));
    assert!(line("drain_timeout").contains("# env JETWORKER_DRAIN_TIMEOUT"));
    assert!(line("labels").contains("a,b") && line("labels").contains("# file "));
    assert!(line("names.tasks_stream").contains("T2"), "{out}");
    assert!(line("ack_wait").contains("30s") && line("ack_wait").contains("# default"));
    // --json: one object per setting.
    let o = jw(
        "nats://127.0.0.1:1",
        &["config", "check", "--json", "--slots", "3"],
    )
    .await;
    assert_exit(&o, 0);
    let v = json_lines(&o);
    let slots = v.iter().find(|s| s["key"] == "slots").unwrap();
    assert_eq!(slots["value"], "3");
    assert_eq!(slots["source"], "flag --slots");
    // A bad value: exit 2, one line naming it; a typo in the file: did you mean.
    let o = jw("nats://127.0.0.1:1", &["config", "check", "--slots", "0"]).await;
    assert_exit(&o, 2);
    assert!(
        stderr(&o).contains("invalid setting slots"),
        "{}",
        stderr(&o)
    );
    std::fs::write(&file, "drain_timout = \"5s\"\n").unwrap();
    let o = jw(
        "nats://127.0.0.1:1",
        &["config", "check", "--config", file.to_str().unwrap()],
    )
    .await;
    assert_exit(&o, 2);
    assert!(
        stderr(&o).contains("did you mean `drain_timeout`"),
        "{}",
        stderr(&o)
    );
}
