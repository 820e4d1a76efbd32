//! Soak tests (not in the default suite; run with
//! `cargo test --release --test integration soak -- --ignored --nocapture`):
//! 20,000 tasks across 3 workers while one worker is SIGKILLed and
//! restarted every few seconds and nats-server is restarted once; every
//! task must end with exactly one final result. And a 1,000-shard fan-out
//! whose join must fire exactly once while workers are SIGKILLed.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use async_nats::jetstream::consumer::{self, DeliverPolicy};
use futures::StreamExt;
use jetworker::protocol::{Status, TaskResult};

use crate::util::*;

const TASKS: usize = 20_000;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "soak: minutes long; run explicitly"]
async fn soak_kills_and_restarts() {
    let n: usize = std::env::var("SOAK_TASKS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(TASKS);
    let mut srv = NatsServer::start();
    let mut fleet = Fleet::start(&srv.url(), 3, &["--slots", "4", "--ack-wait", "3s"]);
    let js = srv.js().await;
    wait_for(Duration::from_secs(30), "TASKS stream", || async {
        js.get_stream("TASKS").await.ok()
    })
    .await;
    let t0 = Instant::now();
    for i in 0..n {
        let body = format!(r#"{{"id":"s{i}","type":"command","command":"true"}}"#);
        let mut m = async_nats::jetstream::message::PublishMessage::build().payload(body.into());
        m = m.message_id(format!("s{i}"));
        // Publish without waiting for each ack; wait in batches.
        let ack = loop {
            match js.send_publish("tasks.default", m.clone()).await {
                Ok(a) => break a,
                Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
            }
        };
        if i % 500 == 499 || i == n - 1 {
            ack.await.expect("PubAck");
        }
    }
    let mut ts = js.get_stream("TASKS").await.unwrap();
    assert!(
        ts.info().await.unwrap().state.last_sequence >= n as u64,
        "all tasks stored"
    );
    println!("published {n} tasks in {:?}", t0.elapsed());

    let mut server_restarted = false;
    let deadline = Instant::now() + Duration::from_secs(900);
    loop {
        tokio::time::sleep(Duration::from_secs(3)).await;
        let left = match js.get_stream("TASKS").await {
            Ok(mut s) => s.info().await.map(|i| i.state.messages).unwrap_or(u64::MAX),
            Err(_) => u64::MAX,
        };
        if left == 0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "soak did not finish: {left} tasks left"
        );
        fleet.kill_next();
        let kills = fleet.kills;
        if !server_restarted && kills == 5 {
            srv.restart();
            server_restarted = true;
            println!("nats-server restarted");
        }
        println!(
            "{:>6.1}s: {left} left, {kills} worker kills",
            t0.elapsed().as_secs_f64()
        );
    }
    let elapsed = t0.elapsed();
    let kills = fleet.kills;
    // Give outboxes a moment, then read every result.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let js = srv.js().await;
    let stream = js.get_stream("RESULTS").await.unwrap();
    let c = stream
        .create_consumer(consumer::pull::OrderedConfig {
            deliver_policy: DeliverPolicy::All,
            ..Default::default()
        })
        .await
        .unwrap();
    let mut msgs = c.messages().await.unwrap();
    let mut finals: HashMap<String, usize> = HashMap::new();
    let mut attempts = 0usize;
    let mut statuses: HashMap<Status, usize> = HashMap::new();
    loop {
        let m = match tokio::time::timeout(Duration::from_secs(5), msgs.next()).await {
            Ok(Some(Ok(m))) => m,
            _ => break,
        };
        let r: TaskResult = serde_json::from_slice(&m.payload).unwrap();
        attempts += 1;
        if r.is_final {
            *finals.entry(r.id.clone()).or_default() += 1;
            *statuses.entry(r.status).or_default() += 1;
        }
        if m.info().unwrap().pending == 0 {
            break;
        }
    }
    let missing: Vec<String> = (0..n)
        .map(|i| format!("s{i}"))
        .filter(|id| !finals.contains_key(id))
        .collect();
    let doubled: Vec<(&String, &usize)> = finals.iter().filter(|(_, c)| **c > 1).collect();
    println!(
        "soak: {n} tasks, 3 workers, {kills} SIGKILLs, server restarted: {server_restarted}; \
         drained in {elapsed:?} ({:.0} tasks/s); {attempts} results stored; finals by status {statuses:?}; \
         missing {}, more than one final {}",
        n as f64 / elapsed.as_secs_f64(),
        missing.len(),
        doubled.len()
    );
    assert!(
        missing.is_empty(),
        "no final result: {:?}",
        &missing[..missing.len().min(20)]
    );
    assert!(
        doubled.is_empty(),
        "several finals: {:?}",
        &doubled[..doubled.len().min(20)]
    );
}

const JOIN_SHARDS: u32 = 1_000;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "soak: a minute or more; run explicitly"]
async fn soak_a_1000_shard_join_fires_once() {
    let n: u32 = std::env::var("SOAK_SHARDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(JOIN_SHARDS);
    let srv = NatsServer::start();
    let dir = tempfile::tempdir().unwrap();
    let join_log = dir.path().join("join");
    let mut fleet = Fleet::start(&srv.url(), 3, &["--slots", "8", "--ack-wait", "3s"]);
    let js = srv.js().await;
    let t0 = Instant::now();
    crate::chains::publish_fan_out(&js, "big", n, 20, "sleep 0.0$((RANDOM % 10))", &join_log).await;
    println!("published {n} shards in {:?}", t0.elapsed());

    // A SIGKILL and restart every 3 s until the join has its final record.
    let deadline = Instant::now() + Duration::from_secs(900);
    let join = loop {
        if let Some(r) = last_result(&js, "big-join").await.filter(|r| r.is_final) {
            break r;
        }
        assert!(Instant::now() < deadline, "the join never finished");
        tokio::time::sleep(Duration::from_secs(3)).await;
        fleet.kill_next();
        let kills = fleet.kills;
        let done = crate::chains::join_state_opt(&js, "big-join")
            .await
            .map_or(0, |s| s.done.len());
        println!(
            "{:>6.1}s: {done}/{n} shards in the join's key, {kills} kills",
            t0.elapsed().as_secs_f64()
        );
    };
    assert_eq!(join.status, Status::Success, "{join:?}");
    let kills = fleet.kills;
    queue_drained(&js, Duration::from_secs(120), "every task acked").await;
    let runs = std::fs::read_to_string(&join_log).unwrap_or_default();
    let stored = crate::chains::tasks_published(&js).await;
    let claims = all_records(&js, "big-join")
        .await
        .iter()
        .filter(|r| r.status == Status::Running)
        .count();
    let st = crate::chains::join_state(&js, "big-join").await;
    println!(
        "soak join: {n} shards, 3 workers, {kills} SIGKILLs; join final after {:?}; \
         join runs {}, join claims {claims}, TASKS messages {stored}, shards in the key {}",
        t0.elapsed(),
        runs.lines().count(),
        st.done.len()
    );
    assert_eq!(runs.lines().count(), 1, "the join ran once: {runs}");
    assert_eq!(claims, 1, "one claim of the join");
    assert_eq!(stored, u64::from(n) + 1, "one join message");
    assert_eq!((st.of, st.done.len()), (n, n as usize));
    assert!(
        runs.contains(&format!(r#""total":{n},"counts":{{"success":{n}}}"#)),
        "{runs}"
    );
}
