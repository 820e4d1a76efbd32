//! The live state of the dashboard and its event feed.
//!
//! Background tasks keep a small state current: the workers (KV `workers`
//! watch: online, and offline as the bucket removes or the worker deletes
//! its key), the queues (polled while someone watches), the result
//! records as they are stored (the `results.>` subjects) and a throughput
//! and latency series over the last minutes. Changes are coalesced for a
//! short while and sent to every page as one server-sent event per kind
//! (`workers`, `results`, `queues`, `stats`), each carrying only the rows
//! that changed, keyed by id. A page starts with a `snapshot`.
//!
//! A page subscribes and takes its snapshot under the state's lock, and
//! every event is sent under that lock too, so a page sees each change
//! exactly once: in the snapshot or after it. Events are serialised once,
//! for all pages; a page that falls behind gets a fresh snapshot.
//!
//! Memory is bounded: one row per worker (offline ones for
//! [`OFFLINE_KEEP`]), one per label, [`WINDOW`] of statistics buckets, and
//! publish times of at most [`PUBLISH_TIMES_CAP`] tasks. Result history is
//! never held here (see `history`).

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_nats::jetstream::consumer::DeliverPolicy;
use async_nats::jetstream::kv::Operation;
use chrono::{DateTime, Utc};
use futures::StreamExt;
use serde::{Deserialize, Serialize};
use tokio::sync::broadcast;

use super::history::ResultRow;
use crate::commands::common::{parse_result, Conn, OrderedReader};
use crate::commands::output::{chrono_time, js_time};
use crate::protocol::{header, valid_id, Heartbeat};

/// How long changes are gathered before they go out as one event.
const COALESCE: Duration = Duration::from_millis(200);
/// How long an offline worker stays listed (greyed).
pub(crate) const OFFLINE_KEEP: Duration = Duration::from_secs(15 * 60);
/// One point of the throughput/latency chart.
pub(crate) const BUCKET_SECS: i64 = 5;
/// The chart's span.
pub(crate) const WINDOW: Duration = Duration::from_secs(10 * 60);
/// Latency samples kept per bucket (the first ones; enough for p95).
const SAMPLES_CAP: usize = 5000;
/// Publish times remembered for the latency of tasks still running.
pub(crate) const PUBLISH_TIMES_CAP: usize = 100_000;
/// Result rows in one `results` event at most (the newest).
const RESULTS_PER_EVENT: usize = 500;
/// How often queues are polled while a page is open.
const QUEUE_POLL: Duration = Duration::from_secs(2);
/// Events a slow page may fall behind before it is resynchronised.
const CHANNEL: usize = 1024;

/// One serialised event: name and JSON data.
pub(crate) type Frame = Arc<(&'static str, String)>;

/// A worker as the page shows it: its heartbeat (which carries no
/// environment or secret) and whether it is still online.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct WorkerRow {
    #[serde(flatten)]
    pub hb: Heartbeat,
    pub online: bool,
    pub offline_at: Option<DateTime<Utc>>,
    /// `stopped` (the worker deleted its key) or `expired` (no heartbeat
    /// within the bucket's TTL).
    pub offline_reason: Option<&'static str>,
}

/// One point of the chart: tasks finished in the bucket starting at `t`
/// (unix seconds), and the latency from publish to final result.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub(crate) struct Point {
    pub t: i64,
    pub done: u64,
    pub failed: u64,
    pub p50_ms: Option<u64>,
    pub p95_ms: Option<u64>,
    pub samples: usize,
}

#[derive(Default)]
struct Bucket {
    done: u64,
    failed: u64,
    latencies: Vec<u64>,
}

/// Finished tasks per bucket over the [`WINDOW`].
#[derive(Default)]
struct Stats {
    buckets: BTreeMap<i64, Bucket>,
}

impl Stats {
    fn key(t: DateTime<Utc>) -> i64 {
        t.timestamp().div_euclid(BUCKET_SECS) * BUCKET_SECS
    }

    fn add(&mut self, time: DateTime<Utc>, ok: bool, latency_ms: Option<u64>) {
        let b = self.buckets.entry(Self::key(time)).or_default();
        b.done += 1;
        if !ok {
            b.failed += 1;
        }
        if let Some(l) = latency_ms {
            if b.latencies.len() < SAMPLES_CAP {
                b.latencies.push(l);
            }
        }
    }

    fn prune(&mut self, now: DateTime<Utc>) {
        let oldest = Self::key(now) - WINDOW.as_secs() as i64;
        self.buckets.retain(|t, _| *t >= oldest);
    }

    fn point(t: i64, b: &Bucket) -> Point {
        let mut l = b.latencies.clone();
        l.sort_unstable();
        let pct = |p: f64| -> Option<u64> {
            if l.is_empty() {
                return None;
            }
            let rank = ((p / 100.0) * l.len() as f64).ceil() as usize;
            Some(l[rank.clamp(1, l.len()) - 1])
        };
        Point {
            t,
            done: b.done,
            failed: b.failed,
            p50_ms: pct(50.0),
            p95_ms: pct(95.0),
            samples: l.len(),
        }
    }

    fn points(&self) -> Vec<Point> {
        self.buckets
            .iter()
            .map(|(t, b)| Self::point(*t, b))
            .collect()
    }

    /// The current bucket and the one before (late records land there).
    fn recent(&self, now: DateTime<Utc>) -> Vec<Point> {
        let k = Self::key(now);
        [k - BUCKET_SECS, k]
            .iter()
            .filter_map(|t| self.buckets.get(t).map(|b| Self::point(*t, b)))
            .collect()
    }
}

/// When each task was published (seen on its subject), for latency.
#[derive(Default)]
struct PublishTimes {
    at: HashMap<String, DateTime<Utc>>,
    order: VecDeque<String>,
}

impl PublishTimes {
    fn insert(&mut self, id: String, t: DateTime<Utc>) {
        if self.at.insert(id.clone(), t).is_none() {
            self.order.push_back(id);
        }
        while self.order.len() > PUBLISH_TIMES_CAP {
            if let Some(old) = self.order.pop_front() {
                self.at.remove(&old);
            }
        }
    }

    fn take(&mut self, id: &str) -> Option<DateTime<Utc>> {
        // The id stays in `order` until it ages out; harmless.
        self.at.remove(id)
    }
}

/// A queue (label) as the page shows it.
pub(crate) type QueueRow = serde_json::Value;

#[derive(Default)]
struct State {
    workers: BTreeMap<String, WorkerRow>,
    dirty_workers: BTreeSet<String>,
    removed_workers: Vec<String>,
    queues: BTreeMap<String, QueueRow>,
    results: VecDeque<ResultRow>,
    stats: Stats,
    publish_times: PublishTimes,
}

/// What a page gets first.
#[derive(Serialize)]
struct Snapshot<'a> {
    workers: Vec<&'a WorkerRow>,
    queues: Vec<&'a QueueRow>,
    stats: Vec<Point>,
    bucket_secs: i64,
    window_secs: u64,
    offline_keep_secs: u64,
}

/// The live state and its feed.
pub(crate) struct Hub {
    state: Mutex<State>,
    tx: broadcast::Sender<Frame>,
    /// A page arrived: poll the queues now rather than at the next tick.
    page_arrived: tokio::sync::Notify,
}

fn frame(name: &'static str, v: &impl Serialize) -> Frame {
    Arc::new((
        name,
        serde_json::to_string(v).unwrap_or_else(|_| "{}".into()),
    ))
}

impl Hub {
    /// The hub and its background feeds (they run for the process's life).
    pub(crate) fn start(conn: Conn) -> Arc<Hub> {
        let hub = Arc::new(Hub {
            state: Mutex::new(State::default()),
            tx: broadcast::channel(CHANNEL).0,
            page_arrived: tokio::sync::Notify::new(),
        });
        tokio::spawn(workers_feed(hub.clone(), conn.clone()));
        tokio::spawn(results_feed(hub.clone(), conn.clone()));
        tokio::spawn(publish_times_feed(hub.clone(), conn.clone()));
        tokio::spawn(queues_feed(hub.clone(), conn));
        tokio::spawn(flusher(hub.clone()));
        hub
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A snapshot and the events after it, taken together.
    pub(crate) fn subscribe(&self) -> (Frame, broadcast::Receiver<Frame>) {
        let st = self.lock();
        let snap = frame(
            "snapshot",
            &Snapshot {
                workers: st.workers.values().collect(),
                queues: st.queues.values().collect(),
                stats: st.stats.points(),
                bucket_secs: BUCKET_SECS,
                window_secs: WINDOW.as_secs(),
                offline_keep_secs: OFFLINE_KEEP.as_secs(),
            },
        );
        let rx = self.tx.subscribe();
        drop(st);
        self.page_arrived.notify_one();
        (snap, rx)
    }

    /// Pages connected now.
    fn watched(&self) -> bool {
        self.tx.receiver_count() > 0
    }

    fn send(&self, f: Frame) {
        // No receiver is not an error: nobody watches.
        let _ = self.tx.send(f);
    }

    /// A heartbeat was stored.
    fn worker_put(&self, hb: Heartbeat) {
        let mut st = self.lock();
        if let Some(old) = st.workers.get(&hb.id) {
            // The list after a (re)watch may have been newer than a
            // change still queued in the watch.
            if old.online && old.hb.seen_at > hb.seen_at {
                return;
            }
        }
        let id = hb.id.clone();
        st.workers.insert(
            id.clone(),
            WorkerRow {
                hb,
                online: true,
                offline_at: None,
                offline_reason: None,
            },
        );
        st.dirty_workers.insert(id);
    }

    /// A worker's key went: deleted (clean stop) or expired.
    fn worker_gone(&self, id: &str, at: DateTime<Utc>, reason: &'static str) {
        let mut st = self.lock();
        if let Some(w) = st.workers.get_mut(id) {
            if w.online {
                w.online = false;
                w.offline_at = Some(at);
                w.offline_reason = Some(reason);
                st.dirty_workers.insert(id.to_string());
            }
        }
    }

    /// After a (re)watch: the listed heartbeats are the online workers.
    fn workers_resync(&self, listed: Vec<Heartbeat>) {
        let ids: BTreeSet<String> = listed.iter().map(|h| h.id.clone()).collect();
        let gone: Vec<String> = {
            let st = self.lock();
            st.workers
                .values()
                .filter(|w| w.online && !ids.contains(&w.hb.id))
                .map(|w| w.hb.id.clone())
                .collect()
        };
        for id in gone {
            self.worker_gone(&id, Utc::now(), "expired");
        }
        for hb in listed {
            self.worker_put(hb);
        }
    }

    /// A result record was stored (`received`: when this process saw it).
    fn result(&self, row: ResultRow, received: DateTime<Utc>, stored: DateTime<Utc>) {
        let mut st = self.lock();
        if row.is_final && !row.is_state() {
            let latency = st
                .publish_times
                .take(&row.id)
                .map(|p| (received - p).num_milliseconds().max(0) as u64);
            st.stats.add(
                stored,
                row.status == crate::protocol::Status::Success,
                latency,
            );
        }
        st.results.push_back(row);
        if st.results.len() > RESULTS_PER_EVENT {
            st.results.pop_front();
        }
    }

    fn published(&self, id: String, at: DateTime<Utc>) {
        self.lock().publish_times.insert(id, at);
    }

    /// Send what changed since the last flush.
    fn flush(&self, now: DateTime<Utc>) {
        let mut st = self.lock();
        let keep = chrono::Duration::from_std(OFFLINE_KEEP).unwrap_or_default();
        let old: Vec<String> = st
            .workers
            .values()
            .filter(|w| w.offline_at.is_some_and(|t| now - t > keep))
            .map(|w| w.hb.id.clone())
            .collect();
        for id in old {
            st.workers.remove(&id);
            st.dirty_workers.remove(&id);
            st.removed_workers.push(id);
        }
        if !st.dirty_workers.is_empty() || !st.removed_workers.is_empty() {
            let dirty = std::mem::take(&mut st.dirty_workers);
            let removed = std::mem::take(&mut st.removed_workers);
            let rows: Vec<&WorkerRow> = dirty.iter().filter_map(|id| st.workers.get(id)).collect();
            let f = frame(
                "workers",
                &serde_json::json!({"rows": rows, "removed": removed}),
            );
            self.send(f);
        }
        if !st.results.is_empty() {
            let rows: Vec<ResultRow> = st.results.drain(..).collect();
            self.send(frame("results", &serde_json::json!({ "rows": rows })));
        }
    }

    /// Send the chart's newest points (every bucket's worth of time).
    fn flush_stats(&self, now: DateTime<Utc>) {
        let mut st = self.lock();
        st.stats.prune(now);
        let points = st.stats.recent(now);
        self.send(frame(
            "stats",
            &serde_json::json!({ "points": points, "now": now.timestamp() }),
        ));
    }

    /// New queue figures: send the labels whose row changed.
    fn queues(&self, rows: Vec<(String, QueueRow)>) {
        let mut st = self.lock();
        let labels: BTreeSet<&String> = rows.iter().map(|(l, _)| l).collect();
        let removed: Vec<String> = st
            .queues
            .keys()
            .filter(|l| !labels.contains(l))
            .cloned()
            .collect();
        for l in &removed {
            st.queues.remove(l);
        }
        let mut changed = Vec::new();
        for (l, row) in rows {
            if st.queues.get(&l) != Some(&row) {
                st.queues.insert(l, row.clone());
                changed.push(row);
            }
        }
        if !changed.is_empty() || !removed.is_empty() {
            self.send(frame(
                "queues",
                &serde_json::json!({"rows": changed, "removed": removed}),
            ));
        }
    }
}

/// Retry pause of the feeds after an error (the broker restarting, a
/// bucket or stream not created yet).
const RETRY: Duration = Duration::from_secs(1);

/// KV `workers`: list, then follow. Watch first, so nothing between the
/// list and the watch is missed.
async fn workers_feed(hub: Arc<Hub>, conn: Conn) {
    loop {
        if let Err(e) = follow_workers(&hub, &conn).await {
            tracing::debug!("workers feed: {e:#}");
        }
        tokio::time::sleep(RETRY).await;
    }
}

async fn follow_workers(hub: &Hub, conn: &Conn) -> anyhow::Result<()> {
    let store = conn.js.get_key_value(&conn.names.workers_bucket).await?;
    let mut watch = store.watch_all().await?;
    hub.workers_resync(crate::queues::online_workers(&store).await?);
    while let Some(e) = watch.next().await {
        let e = e?;
        match e.operation {
            Operation::Put => {
                if let Ok(hb) = serde_json::from_slice::<Heartbeat>(&e.value) {
                    hub.worker_put(hb);
                }
            }
            Operation::Delete => hub.worker_gone(&e.key, chrono_time(e.created), "stopped"),
            Operation::Purge => hub.worker_gone(&e.key, chrono_time(e.created), "expired"),
        }
    }
    Ok(())
}

/// The results stream from [`WINDOW`] ago (for the chart), then as
/// records are stored.
async fn results_feed(hub: Arc<Hub>, conn: Conn) {
    let mut next_seq: Option<u64> = None;
    loop {
        if let Err(e) = follow_results(&hub, &conn, &mut next_seq).await {
            tracing::debug!("results feed: {e:#}");
        }
        tokio::time::sleep(RETRY).await;
    }
}

async fn follow_results(hub: &Hub, conn: &Conn, next_seq: &mut Option<u64>) -> anyhow::Result<()> {
    let stream = conn.stream(&conn.names.results_stream).await?;
    let deliver = match *next_seq {
        Some(s) => DeliverPolicy::ByStartSequence { start_sequence: s },
        None => DeliverPolicy::ByStartTime {
            start_time: js_time(Utc::now() - chrono::Duration::from_std(WINDOW)?),
        },
    };
    let mut reader = OrderedReader::open(
        &stream,
        vec![format!("{}.>", conn.names.results_prefix)],
        deliver,
    )
    .await?;
    while let Some(m) = reader.next().await? {
        *next_seq = Some(m.sequence + 1);
        if let Ok(r) = parse_result(&m.payload) {
            hub.result(ResultRow::new(m.sequence, m.time, &r), Utc::now(), m.time);
        }
    }
    Ok(())
}

/// Just the id of a task message.
#[derive(Deserialize)]
struct IdOnly {
    id: Option<String>,
}

/// Publish times of tasks, from a plain subscription to the task
/// subjects (JetStream publishes reach plain subscribers too). The id is
/// the JSON `id`, else the `Nats-Msg-Id` header, as a worker reads it;
/// tasks named by their stream sequence have no id here and no latency.
async fn publish_times_feed(hub: Arc<Hub>, conn: Conn) {
    loop {
        let subject = format!("{}.>", conn.names.tasks_prefix);
        match conn.client.subscribe(subject).await {
            Ok(mut sub) => {
                while let Some(m) = sub.next().await {
                    let json_id = serde_json::from_slice::<IdOnly>(&m.payload)
                        .ok()
                        .and_then(|v| v.id);
                    let id = json_id
                        .or_else(|| header(m.headers.as_ref(), "Nats-Msg-Id"))
                        .filter(|i| valid_id(i));
                    if let Some(id) = id {
                        hub.published(id, Utc::now());
                    }
                }
            }
            Err(e) => tracing::debug!("publish times feed: {e:#}"),
        }
        tokio::time::sleep(RETRY).await;
    }
}

/// Queue figures every [`QUEUE_POLL`] while a page is open, and at once
/// when one arrives (its snapshot may hold none yet).
async fn queues_feed(hub: Arc<Hub>, conn: Conn) {
    let mut tick = tokio::time::interval(QUEUE_POLL);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = hub.page_arrived.notified() => tick.reset(),
        }
        if !hub.watched() {
            continue;
        }
        match super::queues::rows(&conn).await {
            Ok(rows) => hub.queues(rows),
            Err(e) => tracing::debug!("queues feed: {e:#}"),
        }
    }
}

/// Coalesced changes every [`COALESCE`]; chart points every bucket.
async fn flusher(hub: Arc<Hub>) {
    let mut tick = tokio::time::interval(COALESCE);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut last_stats = Utc::now();
    loop {
        tick.tick().await;
        let now = Utc::now();
        hub.flush(now);
        if (now - last_stats).num_seconds() >= 1 {
            // Each second: the current bucket fills as results arrive.
            hub.flush_stats(now);
            last_stats = now;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(s: i64) -> DateTime<Utc> {
        DateTime::from_timestamp(s, 0).unwrap()
    }

    #[test]
    fn stats_bucket_and_percentiles() {
        let mut s = Stats::default();
        for (i, l) in (1..=100).enumerate() {
            s.add(t(1000 + (i as i64 % 3)), i % 10 != 0, Some(l));
        }
        s.add(t(1007), true, None);
        let p = s.points();
        assert_eq!(p.len(), 2);
        assert_eq!(p[0].t, 1000);
        assert_eq!(p[0].done, 100);
        assert_eq!(p[0].failed, 10);
        assert_eq!(p[0].p50_ms, Some(50));
        assert_eq!(p[0].p95_ms, Some(95));
        assert_eq!(p[1].t, 1005);
        assert_eq!(p[1].p50_ms, None);
        assert_eq!(s.recent(t(1009)).len(), 2);
        s.prune(t(1000 + 601 + 5));
        assert_eq!(s.points().len(), 1);
    }

    #[test]
    fn publish_times_are_bounded() {
        let mut p = PublishTimes::default();
        for i in 0..PUBLISH_TIMES_CAP + 10 {
            p.insert(format!("t{i}"), t(0));
        }
        assert_eq!(p.at.len(), PUBLISH_TIMES_CAP);
        assert!(p.take("t0").is_none());
        assert!(p.take(&format!("t{}", PUBLISH_TIMES_CAP + 9)).is_some());
    }
}
