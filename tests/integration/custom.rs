//! Custom task types (issue 14): the example program, types defined in the
//! config file, async functions as types (panics, cancel), the schema, and
//! a task of a type this worker does not run.

use std::time::Duration;

use jetworker::protocol::Status;
use jetworker::runner::in_process::{function, NoFields, TaskContext};
use serde::Deserialize;

use crate::cli::{assert_exit, jw, jw_command, stdout};
use crate::util::*;

const T: Duration = Duration::from_secs(30);

/// A type defined in config: `printf` with a word, a count and a variable.
const DEFINED: &str = r#"
[types.greet]
description = "Print a greeting"
command = ["sh", "-c", "printf '%s-%s-%s' \"$0\" \"$1\" \"$GREETING\"", "{word}", "{n}"]
fields = { word = "string", n = "integer", tone = "string?" }
env = { GREETING = "hi {tone}" }
"#;

fn config_file(dir: &std::path::Path) -> std::path::PathBuf {
    let p = dir.join("config.toml");
    std::fs::write(&p, DEFINED).unwrap();
    p
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_custom_runner_example_runs_end_to_end() {
    let srv = NatsServer::start();
    // `cargo test` builds the examples next to the test binary's directory.
    let exe = std::env::current_exe().unwrap();
    let example = exe
        .parent()
        .and_then(|d| d.parent())
        .map(|d| d.join("examples").join("custom_runner"))
        .unwrap();
    if !example.exists() {
        // Only `--test integration` was built: build the example too.
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let st = std::process::Command::new(cargo)
            .args(["build", "--example", "custom_runner"])
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .status()
            .unwrap();
        assert!(st.success(), "cannot build the example");
    }
    assert!(example.exists(), "{} was not built", example.display());
    let out = tokio::time::timeout(
        Duration::from_secs(60),
        tokio::process::Command::new(&example)
            .env("NATS_URL", srv.url())
            .kill_on_drop(true)
            .output(),
    )
    .await
    .expect("the example finishes")
    .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(text.trim(), "success: hello world (attempt 1)");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_type_defined_in_config_runs_and_checks_its_fields() {
    let srv = NatsServer::start();
    let dir = tempfile::tempdir().unwrap();
    let cfg = config_file(dir.path());
    let _w = ProcWorker::start(&srv.url(), &["--config", cfg.to_str().unwrap()]);
    let js = srv.js().await;
    publish_task(
        &js,
        "default",
        r#"{"id":"g1","type":"greet","word":"a b","n":3,"tone":"there"}"#,
    )
    .await;
    let r = final_result(&js, "g1", T).await;
    assert_eq!(r.status, Status::Success, "{r:?}");
    assert_eq!(r.output, "a b-3-hi there");
    assert_eq!(r.task_type.as_deref(), Some("greet"));
    // Optional and absent: empty text within a value.
    publish_task(
        &js,
        "default",
        r#"{"id":"g2","type":"greet","word":"x","n":1}"#,
    )
    .await;
    let r = final_result(&js, "g2", T).await;
    assert_eq!(
        (r.status, r.output.as_str()),
        (Status::Success, "x-1-hi "),
        "{r:?}"
    );

    for (id, json, field, problem) in [
        (
            "g3",
            r#"{"id":"g3","type":"greet","n":1}"#,
            "word",
            "missing",
        ),
        (
            "g4",
            r#"{"id":"g4","type":"greet","word":"x","n":"three"}"#,
            "n",
            "must be an integer, not a string",
        ),
        (
            "g5",
            r#"{"id":"g5","type":"greet","word":"x","n":1,"colour":"red"}"#,
            "colour",
            "unknown field",
        ),
    ] {
        publish_task(&js, "default", json).await;
        let r = final_result(&js, id, T).await;
        assert_eq!(r.status, Status::Rejected, "{r:?}");
        let e = r.error.unwrap_or_default();
        assert!(
            e.contains(&format!("{field}: ")) && e.contains(problem),
            "{id}: {e}"
        );
    }
    // The heartbeat lists it.
    let hb = wait_for(T, "a heartbeat", || async {
        heartbeats(&js).await.filter(|h| !h.is_empty())
    })
    .await;
    assert!(
        hb[0].types.iter().any(|t| t == "greet"),
        "{:?}",
        hb[0].types
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_schema_includes_types_defined_in_config() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config_file(dir.path());
    let o = jw(
        "nats://127.0.0.1:1",
        &["--config", cfg.to_str().unwrap(), "schema"],
    )
    .await;
    assert_exit(&o, 0);
    let schema: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let types = schema["properties"]["type"]["enum"].as_array().unwrap();
    assert!(types.iter().any(|t| t == "greet"), "{types:?}");
    assert_eq!(schema["properties"]["word"]["type"], "string");
    let v = jsonschema::validator_for(&schema).expect("a valid JSON Schema");
    assert!(v.is_valid(&serde_json::json!({"type":"greet","word":"x","n":1})));
    // A field of another type does not apply.
    assert!(!v.is_valid(&serde_json::json!({"type":"shell","script":"x","word":"y"})));
    // Local validation knows the type too.
    let mut c = jw_command(
        "nats://127.0.0.1:1",
        &[
            "--config",
            cfg.to_str().unwrap(),
            "submit",
            "--type",
            "greet",
            "-F",
            "word=x",
            "-F",
            "n=nope",
        ],
    );
    let o = c.output().await.unwrap();
    assert_exit(&o, 2);
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("n: must be an integer"),
        "{}",
        stdout(&o)
    );
}

#[derive(Clone, Deserialize, schemars::JsonSchema)]
struct Nap {
    /// Milliseconds to sleep.
    ms: u64,
}

/// A worker with in-process types: `boom` panics, `nap` sleeps unless
/// cancelled, `ok` writes a line.
fn in_process_worker(url: &str) -> InProcWorker {
    let state = tempfile::tempdir().unwrap();
    let mut cfg = test_config(url, state.path());
    cfg.kill_grace = Duration::from_secs(1);
    let token = tokio_util::sync::CancellationToken::new();
    let run = jetworker::Worker::builder()
        .config(cfg)
        .runner(function(
            "boom",
            |_: NoFields, _ctx: TaskContext| async move { blow_up() },
        ))
        .runner(function("nap", |f: Nap, ctx: TaskContext| async move {
            use std::io::Write;
            writeln!(ctx.stdout(), "napping")?;
            tokio::select! {
                _ = tokio::time::sleep(Duration::from_millis(f.ms)) => Ok(()),
                _ = ctx.cancelled() => anyhow::bail!("woken up"),
            }
        }))
        .runner(function("ok", |_: NoFields, ctx: TaskContext| async move {
            use std::io::Write;
            writeln!(ctx.stdout(), "fine, {}", ctx.id())?;
            Ok(())
        }))
        .run(token.clone());
    InProcWorker {
        token,
        handle: Some(tokio::spawn(run)),
        state,
    }
}

fn blow_up() -> anyhow::Result<()> {
    panic!("the function blew up")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panicking_function_fails_and_the_worker_lives_on() {
    let srv = NatsServer::start();
    let _w = in_process_worker(&srv.url());
    let js = srv.js().await;
    publish_task(
        &js,
        "default",
        r#"{"id":"p1","type":"boom","retry":{"max_attempts":1}}"#,
    )
    .await;
    let r = final_result(&js, "p1", T).await;
    assert_eq!(r.status, Status::Failed, "{r:?}");
    assert!(
        r.error
            .as_deref()
            .unwrap_or("")
            .contains("panicked: the function blew up"),
        "{r:?}"
    );
    publish_task(&js, "default", r#"{"id":"p2","type":"ok"}"#).await;
    let r = final_result(&js, "p2", T).await;
    assert_eq!(
        (r.status, r.output.as_str()),
        (Status::Success, "fine, p2\n"),
        "{r:?}"
    );
    // A field the function's struct does not have is refused up front.
    publish_task(&js, "default", r#"{"id":"p3","type":"nap","ms":"long"}"#).await;
    let r = final_result(&js, "p3", T).await;
    assert_eq!(r.status, Status::Rejected, "{r:?}");
    assert!(r.error.unwrap_or_default().contains("ms: "));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn functions_are_cancelled_and_timed_out() {
    let srv = NatsServer::start();
    let _w = in_process_worker(&srv.url());
    let js = srv.js().await;
    publish_task(&js, "default", r#"{"id":"n1","type":"nap","ms":600000}"#).await;
    wait_for(T, "n1 running", || async {
        last_result(&js, "n1")
            .await
            .filter(|r| r.status == Status::Running)
    })
    .await;
    let o = jw(&srv.url(), &["cancel", "n1", "--reason", "enough"]).await;
    assert_exit(&o, 0);
    let r = final_result(&js, "n1", T).await;
    assert_eq!(r.status, Status::Cancelled, "{r:?}");
    assert_eq!(r.output, "napping\n");
    assert!(r.error.unwrap_or_default().contains("enough"));

    publish_task(
        &js,
        "default",
        r#"{"id":"n2","type":"nap","ms":600000,"timeout":"2s","retry":{"max_attempts":1}}"#,
    )
    .await;
    let r = final_result(&js, "n2", T).await;
    assert_eq!(r.status, Status::Timeout, "{r:?}");
    assert!(r.duration_ms < 10_000, "{r:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_type_no_worker_runs_is_handed_back_then_dead_with_a_hint() {
    let srv = NatsServer::start();
    let js = srv.js().await;
    // A plain worker: `nap` is not its type, so it hands the task back
    // (not an attempt, not rejected) until a worker that runs it comes.
    let plain = InProcWorker::start(|_| {}, &srv.url());
    publish_task(&js, "default", r#"{"id":"h1","type":"nap","ms":1}"#).await;
    let seen = wait_for(T, "h1 redelivered", || async {
        let info = js
            .get_stream("TASKS")
            .await
            .ok()?
            .consumer_info(jetworker::protocol::Names::default().consumer_name("default"))
            .await
            .ok()?;
        (info.num_redelivered > 0).then_some(())
    });
    seen.await;
    assert!(
        last_result(&js, "h1").await.is_none(),
        "no record for a hand-back"
    );
    let _w = in_process_worker(&srv.url());
    let r = final_result(&js, "h1", T).await;
    assert_eq!(r.status, Status::Success, "{r:?}");
    assert_eq!(r.task_type.as_deref(), Some("nap"));
    drop(_w);

    // A misspelt type nobody runs: dead once its deliveries are used up,
    // saying which types exist.
    publish_task(
        &js,
        "default",
        r#"{"id":"h2","type":"shel","script":"x","retry":{"max_attempts":2}}"#,
    )
    .await;
    let r = final_result(&js, "h2", T).await;
    assert_eq!(r.status, Status::Dead, "{r:?}");
    let e = r.error.unwrap_or_default();
    assert!(
        e.contains("runs type shel") && e.contains("did you mean `shell`"),
        "{e}"
    );
    plain.shutdown().await.unwrap();
}
