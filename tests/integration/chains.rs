//! Downstream tasks (issue 15, DESIGN.md section 5 "Downstream tasks"):
//! a chain of three, a failure branch, an invalid child that rejects its
//! parent, a parent redelivered after a crash (before the ack, and before
//! its children were queued) that still queues one child, a 50-shard
//! fan-out whose join fires exactly once while workers are SIGKILLed, and
//! `results --tree` / `submit --wait` of a tree. Real nats-server, real
//! worker processes; exactly-once is checked by counting runs (each run
//! appends a line to a marker file), by the records and by the number of
//! messages ever stored in TASKS.

use std::path::Path;
use std::time::Duration;

use async_nats::jetstream;
use jetworker::protocol::{JoinState, Names, Status, TaskResult};

use crate::cli::{assert_exit, jw, stdout};
use crate::util::*;

const T: Duration = Duration::from_secs(60);

fn lines(path: &Path) -> Vec<String> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .map(str::to_string)
        .collect()
}

/// A shell task that appends `<name> <PARENT_ID> <IDEMPOTENCY_KEY>` to
/// `marker`, then runs `then_script`.
fn step(marker: &Path, name: &str, then_script: &str) -> serde_json::Value {
    serde_json::json!({
        "type": "shell",
        "script": format!(
            "echo \"{name} ${{PARENT_ID:--}} $IDEMPOTENCY_KEY\" >> {m}; {then_script}",
            m = marker.display()
        ),
    })
}

fn finals(all: &[TaskResult]) -> Vec<&TaskResult> {
    all.iter().filter(|r| r.is_final).collect()
}

fn claims(all: &[TaskResult]) -> usize {
    all.iter().filter(|r| r.status == Status::Running).count()
}

/// Messages ever stored in TASKS (WorkQueue: acked ones are gone, the
/// sequence stays): a child queued twice would show here.
pub async fn tasks_published(js: &jetstream::Context) -> u64 {
    let mut s = js.get_stream("TASKS").await.unwrap();
    s.info().await.unwrap().state.last_sequence
}

/// Create TASKS as a worker would, but with a 1 s duplicate window, so that
/// a test sees what the queue-once guard does where `Nats-Msg-Id` no
/// longer de-duplicates.
async fn tasks_stream_with_short_dedup(js: &jetstream::Context) {
    let mut cfg = jetworker::internals::tasks_stream_config(
        &Names::default(),
        &jetworker::internals::SetupOptions::default(),
        false,
    );
    cfg.duplicate_window = Duration::from_secs(1);
    js.create_stream(cfg).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chain_of_three_runs_in_order_once_each() {
    let srv = NatsServer::start();
    let dir = tempfile::tempdir().unwrap();
    let marker = dir.path().join("runs");
    let _a = ProcWorker::start(&srv.url(), &["--slots", "2"]);
    let _b = ProcWorker::start(&srv.url(), &["--slots", "2"]);
    let js = srv.js().await;
    let mut c = step(&marker, "c", "echo third");
    c["id"] = "ch-last".into();
    let mut b = step(&marker, "b", "echo second");
    b["then"] = c;
    let mut a = step(&marker, "a", "echo first");
    a["id"] = "ch".into();
    a["idempotency_key"] = "key-1".into();
    a["then"] = serde_json::json!([b]);
    publish_task(&js, "default", &a.to_string()).await;

    let last = final_result(&js, "ch-last", T).await;
    assert_eq!(last.status, Status::Success, "{last:?}");
    assert_eq!(last.parent.as_deref(), Some("ch-then-1"));
    queue_drained(&js, T, "every task acked").await;
    assert_eq!(
        lines(&marker),
        vec!["a - key-1", "b ch key-1", "c ch-then-1 key-1"],
        "ran once each, in order, with PARENT_ID and the inherited key"
    );
    for (id, child) in [
        ("ch", Some("ch-then-1")),
        ("ch-then-1", Some("ch-last")),
        ("ch-last", None),
    ] {
        let all = all_records(&js, id).await;
        let f = finals(&all);
        assert_eq!(f.len(), 1, "{id}: one final: {all:?}");
        assert_eq!(claims(&all), 1, "{id}: one claim: {all:?}");
        let want: Vec<String> = child.into_iter().map(str::to_string).collect();
        // The claim plans the child; the final record lists it as queued.
        assert_eq!(all[0].children, want, "{id}: planned: {all:?}");
        assert_eq!(f[0].children, want, "{id}: queued: {all:?}");
    }
    assert_eq!(tasks_published(&js).await, 3, "three messages, no copy");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failure_branch_runs_only_on_failure() {
    let srv = NatsServer::start();
    let dir = tempfile::tempdir().unwrap();
    let marker = dir.path().join("runs");
    let _w = ProcWorker::start(&srv.url(), &["--slots", "2"]);
    let js = srv.js().await;
    let mut on_fail = step(&marker, "cleanup", "true");
    on_fail["on"] = serde_json::json!(["failed", "timeout"]);
    on_fail["label"] = "default".into();
    let mut parent = step(&marker, "p", "exit 3");
    parent["id"] = "fb".into();
    parent["retry"] = serde_json::json!({"max_attempts": 2, "backoff": "100ms"});
    parent["then"] = serde_json::json!([step(&marker, "next", "true"), on_fail]);
    publish_task(&js, "default", &parent.to_string()).await;

    let cleanup = final_result(&js, "fb-then-2", T).await;
    assert_eq!(cleanup.status, Status::Success, "{cleanup:?}");
    queue_drained(&js, T, "every task acked").await;
    let p = last_result(&js, "fb").await.unwrap();
    assert_eq!((p.status, p.attempt), (Status::Failed, 2), "{p:?}");
    assert_eq!(p.children, vec!["fb-then-2"]);
    // The first, retried attempt queued nothing.
    let all = all_records(&js, "fb").await;
    assert!(
        all.iter()
            .filter(|r| !r.is_final)
            .all(|r| r.children.len() == 2),
        "non-final records plan both: {all:?}"
    );
    assert_eq!(lines(&marker), vec!["p - fb", "p - fb", "cleanup fb fb"]);
    assert!(
        last_result(&js, "fb-then-1").await.is_none(),
        "the success branch never ran"
    );
    assert_eq!(tasks_published(&js).await, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_invalid_child_rejects_the_parent_before_it_runs() {
    let srv = NatsServer::start();
    let dir = tempfile::tempdir().unwrap();
    let marker = dir.path().join("runs");
    let _w = ProcWorker::start(&srv.url(), &[]);
    let js = srv.js().await;
    let mut bad = step(&marker, "bad", "true");
    bad["timeout"] = "soon".into();
    let mut parent = step(&marker, "p", "true");
    parent["id"] = "inv".into();
    parent["then"] = serde_json::json!([step(&marker, "ok", "true"), bad]);
    publish_task(&js, "default", &parent.to_string()).await;

    let r = final_result(&js, "inv", T).await;
    assert_eq!(r.status, Status::Rejected, "{r:?}");
    let err = r.error.unwrap_or_default();
    assert!(err.contains("then[1].timeout"), "{err}");
    queue_drained(&js, T, "terminated").await;
    assert!(lines(&marker).is_empty(), "nothing ran");
    assert!(last_result(&js, "inv-then-1").await.is_none());
    let dead = js
        .get_stream("DEAD")
        .await
        .unwrap()
        .info()
        .await
        .unwrap()
        .state
        .messages;
    assert_eq!(dead, 1, "the original is in DEAD");

    // `submit` finds the same problem before publishing anything.
    let o = jw(
        &srv.url(),
        &[
            "submit",
            "--dry-run",
            "--then",
            r#"{"type":"shell","script":"x","timeout":"soon"}"#,
            "--",
            "true",
        ],
    )
    .await;
    assert_exit(&o, 2);
    assert!(
        crate::cli::stderr(&o).contains("then[0].timeout"),
        "{}",
        crate::cli::stderr(&o)
    );
}

/// A parent whose worker dies after its final record, `fault` saying
/// where: before the ack (the child is queued) or before the downstream
/// step (the child is not). The redelivery, on another worker, must leave
/// exactly one child run and one child message, with a duplicate window
/// too short to help.
async fn redelivered_parent_queues_one_child(fault: &str, code: i32) {
    let srv = NatsServer::start();
    let js = srv.js().await;
    tasks_stream_with_short_dedup(&js).await;
    let dir = tempfile::tempdir().unwrap();
    let marker = dir.path().join("runs");
    let state = tempfile::tempdir().unwrap();
    // One slot: the dying worker cannot take the child meanwhile.
    let mut a = ProcWorker::start_opts(
        &srv.url(),
        state.path(),
        &["--slots", "1", "--ack-wait", "2s"],
        &ProcOpts {
            env: vec![("JETWORKER_TEST_FAULT".into(), fault.into())],
            ..Default::default()
        },
    );
    let mut parent = step(&marker, "p", "true");
    parent["id"] = "rp".into();
    parent["then"] = step(&marker, "child", "true");
    publish_task(&js, "default", &parent.to_string()).await;
    let p = final_result(&js, "rp", T).await;
    assert_eq!(p.status, Status::Success);
    assert_eq!(
        a.wait_exit(T).await,
        Some(code),
        "died where the fault says"
    );
    assert_eq!(tasks_left(&js).await, if code == 86 { 2 } else { 1 });

    let _b = ProcWorker::start(&srv.url(), &["--ack-wait", "2s"]);
    let c = final_result(&js, "rp-then-1", T).await;
    assert_eq!(c.status, Status::Success, "{c:?}");
    queue_drained(&js, T, "the redelivered parent acked").await;
    assert_eq!(
        lines(&marker),
        vec!["p - rp", "child rp rp"],
        "one run each"
    );
    let all = all_records(&js, "rp").await;
    assert_eq!(finals(&all).len(), 1, "{all:?}");
    assert_eq!(claims(&all), 1, "the parent ran once: {all:?}");
    assert_eq!(claims(&all_records(&js, "rp-then-1").await), 1);
    assert_eq!(tasks_published(&js).await, 2, "one child message");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_parent_redelivered_after_a_crash_before_the_ack_queues_one_child() {
    redelivered_parent_queues_one_child("die-before-ack", 86).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_parent_redelivered_after_a_crash_before_its_children_queues_them() {
    redelivered_parent_queues_one_child("die-before-downstream", 87).await;
}

/// Number of shards of `base` with a final record.
async fn finished_shards(js: &jetstream::Context, base: &str, n: u32) -> u32 {
    let mut done = 0;
    for no in 0..n {
        if last_result(js, &format!("{base}-{no}"))
            .await
            .is_some_and(|r| r.is_final)
        {
            done += 1;
        }
    }
    done
}

/// Publish `n` shards of `base` (`attempts` each: a shard whose worker is
/// SIGKILLed under it spends one) whose join appends `$PARENT_ID
/// $JOIN_SUMMARY` to `join_log`.
pub async fn publish_fan_out(
    js: &jetstream::Context,
    base: &str,
    n: u32,
    attempts: u32,
    shard: &str,
    join_log: &Path,
) {
    for no in 0..n {
        let task = serde_json::json!({
            "id": format!("{base}-{no}"),
            "type": "shell",
            "script": shard,
            "shard": {"no": no, "total": n},
            "retry": {"max_attempts": attempts, "backoff": "100ms"},
            "then_all": {"type": "shell", "script": format!(
                "echo \"$PARENT_ID $JOIN_SUMMARY\" >> {}", join_log.display())},
        });
        publish_task(js, "default", &task.to_string()).await;
    }
}

/// The join's key in KV `joins`, if it is there.
pub async fn join_state_opt(js: &jetstream::Context, join: &str) -> Option<JoinState> {
    let kv = js.get_key_value("joins").await.ok()?;
    let v = kv.get(join).await.ok()??;
    Some(serde_json::from_slice(&v).unwrap())
}

/// The join's key in KV `joins`.
pub async fn join_state(js: &jetstream::Context, join: &str) -> JoinState {
    join_state_opt(js, join).await.expect("the join's key")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_50_shard_join_fires_once_while_workers_are_killed() {
    const N: u32 = 50;
    let srv = NatsServer::start();
    let dir = tempfile::tempdir().unwrap();
    let shard_log = dir.path().join("shards");
    let join_log = dir.path().join("join");
    let mut fleet = Fleet::start(&srv.url(), 3, &["--slots", "4", "--ack-wait", "3s"]);
    let js = srv.js().await;
    let shard = format!(
        "sleep 0.$((3 + RANDOM % 7)); echo $SHARD_NO >> {}",
        shard_log.display()
    );
    publish_fan_out(&js, "fan", N, 20, &shard, &join_log).await;

    // A SIGKILL (and a restart on the same state) after every few shards.
    let mut seen = 0;
    while seen < N {
        let now = wait_for(T * 2, "more shards to finish", || async {
            let d = finished_shards(&js, "fan", N).await;
            (d >= (seen + 3).min(N)).then_some(d)
        })
        .await;
        seen = now;
        if seen < N {
            fleet.kill_next();
        }
    }
    let kills = fleet.kills;
    println!("{kills} SIGKILLs during the fan-out");
    assert!(
        kills >= 3,
        "workers were killed during the fan-out: {kills}"
    );

    let j = final_result(&js, "fan-join", T * 2).await;
    let mut not_ok = Vec::new();
    for no in 0..N {
        let r = last_result(&js, &format!("fan-{no}")).await.unwrap();
        if r.status != Status::Success {
            not_ok.push(r);
        }
    }
    assert!(not_ok.is_empty(), "shards that did not succeed: {not_ok:?}");
    assert_eq!(j.status, Status::Success, "{j:?}");
    assert_eq!(j.parent.as_deref(), Some("fan"));
    queue_drained(&js, T * 2, "every task acked").await;
    let runs = lines(&join_log);
    assert_eq!(runs.len(), 1, "the join ran once: {runs:?}");
    assert!(
        runs[0].starts_with(
            r#"fan {"policy":"all_success","total":50,"counts":{"success":50},"not_success":[]}"#
        ),
        "{runs:?}"
    );
    let all = all_records(&js, "fan-join").await;
    assert_eq!((claims(&all), finals(&all).len()), (1, 1), "{all:?}");
    assert_eq!(
        tasks_published(&js).await,
        u64::from(N) + 1,
        "one join message"
    );
    let st = join_state(&js, "fan-join").await;
    assert_eq!((st.of, st.done.len()), (N, N as usize));
    assert!(st.done.values().all(|s| *s == Status::Success));
    let mut shards: Vec<u32> = lines(&shard_log)
        .iter()
        .map(|l| l.parse().unwrap())
        .collect();
    shards.sort_unstable();
    shards.dedup();
    assert_eq!(shards.len(), N as usize, "every shard ran");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shards_finishing_together_on_six_workers_queue_one_join() {
    const N: u32 = 12;
    let srv = NatsServer::start();
    let dir = tempfile::tempdir().unwrap();
    let gate = dir.path().join("gate");
    let join_log = dir.path().join("join");
    let _workers: Vec<ProcWorker> = (0..6)
        .map(|_| ProcWorker::start(&srv.url(), &["--slots", "2"]))
        .collect();
    let js = srv.js().await;
    let shard = format!(
        "while [ ! -e {g} ]; do sleep 0.01; done",
        g = gate.display()
    );
    publish_fan_out(&js, "tog", N, 1, &shard, &join_log).await;
    // Every shard runs (one per slot), then all end at once.
    wait_for(T, "every shard to run", || async {
        let mut running = 0;
        for no in 0..N {
            if last_result(&js, &format!("tog-{no}"))
                .await
                .is_some_and(|r| r.status == Status::Running)
            {
                running += 1;
            }
        }
        (running == N).then_some(())
    })
    .await;
    std::fs::write(&gate, "").unwrap();
    let j = final_result(&js, "tog-join", T).await;
    assert_eq!(j.status, Status::Success, "{j:?}");
    queue_drained(&js, T, "every task acked").await;
    assert_eq!(lines(&join_log).len(), 1, "the join ran once");
    assert_eq!(
        tasks_published(&js).await,
        u64::from(N) + 1,
        "one join message"
    );
    assert_eq!(join_state(&js, "tog-join").await.done.len(), N as usize);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_join_under_all_success_is_not_run_when_a_shard_fails() {
    let srv = NatsServer::start();
    let dir = tempfile::tempdir().unwrap();
    let join_log = dir.path().join("join");
    let _w = ProcWorker::start(&srv.url(), &["--slots", "4"]);
    let js = srv.js().await;
    publish_fan_out(&js, "pol", 4, 1, "test $SHARD_NO -ne 2", &join_log).await;
    let j = final_result(&js, "pol-join", T).await;
    assert_eq!(j.status, Status::Cancelled, "{j:?}");
    assert_eq!(
        j.error.as_deref(),
        Some("not run: 1 of 4 shards did not succeed (policy all_success)")
    );
    queue_drained(&js, T, "every task acked").await;
    assert!(lines(&join_log).is_empty(), "the join never ran");
    assert_eq!(join_state(&js, "pol-join").await.done[&2], Status::Failed);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn results_tree_and_submit_wait_show_the_whole_tree() {
    let srv = NatsServer::start();
    let url = srv.url();
    let _w = ProcWorker::start(&url, &["--slots", "4"]);
    let js = srv.js().await;
    wait_for(T, "worker online", || async {
        heartbeats(&js).await.filter(|h| !h.is_empty())
    })
    .await;

    let o = jw(
        &url,
        &[
            "submit", "--id", "tr", "--wait", "--", "echo a", "--then", "echo b", "--then",
            "echo c",
        ],
    )
    .await;
    assert_exit(&o, 0);
    let out = stdout(&o);
    for want in ["tr  ", "└─ tr-then-1 ", "   └─ tr-then-1-then-1 "] {
        assert!(out.contains(want), "{want:?} in:\n{out}");
    }
    let o = jw(&url, &["results", "tr", "--tree", "--json"]).await;
    assert_exit(&o, 0);
    let nodes: Vec<serde_json::Value> = stdout(&o)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let got: Vec<(&str, &str, &str, u64)> = nodes
        .iter()
        .map(|n| {
            (
                n["id"].as_str().unwrap(),
                n["kind"].as_str().unwrap(),
                n["status"].as_str().unwrap(),
                n["depth"].as_u64().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        got,
        vec![
            ("tr", "task", "success", 0),
            ("tr-then-1", "child", "success", 1),
            ("tr-then-1-then-1", "child", "success", 2)
        ]
    );
    assert_eq!(nodes[2]["result"]["output"], "c\n");

    // A failed step: --wait exits 1, the failure branch ran, the rest did not.
    let o = jw(
        &url,
        &[
            "submit",
            "--id",
            "tf",
            "--retries",
            "0",
            "--wait",
            "--on-failure",
            "echo undo",
            "--then",
            "exit 4",
            "--then",
            "echo never",
            "--",
            "echo a",
        ],
    )
    .await;
    assert_exit(&o, 1);
    let o = jw(&url, &["results", "tf", "--tree", "--json"]).await;
    assert_exit(&o, 1);
    let ids: Vec<String> = stdout(&o)
        .lines()
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l).unwrap()["id"]
                .as_str()
                .unwrap()
                .to_string()
        })
        .collect();
    assert_eq!(ids, vec!["tf", "tf-then-1", "tf-then-1-then-2"]);
    assert!(last_result(&js, "tf-then-1-then-1").await.is_none());

    // A fan-out and its join, waited for by `results --tree --wait`.
    let o = jw(
        &url,
        &[
            "submit",
            "--id",
            "tj",
            "--shards",
            "3",
            "--then-all",
            "echo joined $PARENT_ID",
            "--",
            "echo s",
        ],
    )
    .await;
    assert_exit(&o, 0);
    // Waits for the fan-out to start, then for every shard and the join.
    let o = jw(
        &url,
        &["results", "tj", "--tree", "--wait", "--wait-timeout", "60s"],
    )
    .await;
    assert_exit(&o, 0);
    let out = stdout(&o);
    for want in [
        "tj-{0..2}",
        "3 shards",
        "3 success",
        "└─ tj-join (join)",
        "joined tj",
    ] {
        assert!(out.contains(want), "{want:?} in:\n{out}");
    }
}
