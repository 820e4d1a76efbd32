//! The operator's view of the label queues and the switch to stop one:
//! what `jetworker queues`, `pause`, `resume` and `workers` show and do,
//! kept here (not in `commands`) so that every front end — the CLI, a web
//! dashboard — reads the same numbers the same way. Every type is
//! `Serialize`: a front end can send it as JSON unchanged.
//!
//! A label's queue is its durable consumer on the task stream
//! ([`Names::consumer_name`], the one name the worker creates in
//! [`crate::setup::ensure_label_consumer`]); the numbers come from that
//! consumer's info, read for all labels with one paged request
//! (`CONSUMER.LIST`), and who serves it from the heartbeats in KV
//! `workers` (DESIGN.md section 6). Pausing is the server's consumer pause
//! (nats-server 2.11): a paused consumer hands out nothing until its pause
//! time passes or it is resumed, so every worker of the label stops taking
//! its tasks at once, running tasks go on, and nothing is lost.
//!
//! One task's state ([`task_status`], `jetworker status`) is read the same
//! way a worker reads it: the last record on `results.<id>` (DESIGN.md
//! section 5), the holder's heartbeat for a `running` claim, and — for an
//! id with no record yet — the task stream, where it waits for its first
//! attempt.

use std::collections::BTreeMap;

use anyhow::{anyhow, bail, Context as _};
use async_nats::jetstream::{
    self,
    consumer::Info as ConsumerInfo,
    context::ConsumerInfoErrorKind,
    kv,
    stream::{RawMessageErrorKind, Stream},
};
use chrono::{DateTime, Utc};
use futures::StreamExt;
use serde::Serialize;

use crate::protocol::{
    best_effort_id, chrono_time, header, valid_id, valid_label, Envelope, Heartbeat, Names, Status,
    TaskResult,
};

/// One label's queue, as `jetworker queues --json` prints it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct QueueStats {
    /// The label.
    pub label: String,
    /// When these numbers were read (ages count to this time).
    pub read_at: DateTime<Utc>,
    /// Tasks not handed to any worker yet (the consumer's `num_pending`).
    pub waiting: u64,
    /// Tasks of this label running on its online workers, as of their
    /// last heartbeats (`running_by_label`; a heartbeat of an earlier
    /// worker without it counts its `running` when it serves only this
    /// label).
    pub running: usize,
    /// Tasks handed out and not answered, but not running: Nak'ed with a
    /// delay (a retry's backoff, an id running elsewhere, a type no worker
    /// of the label runs, a hand-back at shutdown) and not handed out again
    /// yet, or held by a worker that is gone until its lease ends. The
    /// consumer's `num_ack_pending` less `running`.
    pub delayed: usize,
    /// Tasks the broker handed out again after a Nak or an expired lease
    /// (`num_redelivered`; retries, hand-backs and takeovers).
    pub redelivered: usize,
    /// When the oldest waiting task was published (`None`: nothing waits).
    pub oldest_waiting_at: Option<DateTime<Utc>>,
    /// How long it has waited, in milliseconds, when the stats were read.
    pub oldest_waiting_ms: Option<u64>,
    /// Whether the consumer is paused: its workers take nothing new.
    pub paused: bool,
    /// When the pause ends by itself (`None` while paused: until
    /// `resume`).
    pub paused_until: Option<DateTime<Utc>>,
    /// Whether the label's consumer exists (a worker created it or
    /// `setup` did); a label known only from a heartbeat has none yet.
    pub consumer: bool,
    /// Online workers serving the label (their ids).
    pub workers: Vec<String>,
    /// Slots of those workers together.
    pub slots: usize,
}

/// A pause time this far ahead is shown (and sent as JSON) as "until
/// resumed": [`pause`] without a duration pauses until [`PAUSE_FOREVER`].
const FOREVER_THRESHOLD_DAYS: i64 = 365 * 50;

/// The pause time of a pause without an end: far enough to mean "until
/// `resume`", early enough for every client's date arithmetic.
pub fn pause_forever() -> DateTime<Utc> {
    DateTime::parse_from_rfc3339(PAUSE_FOREVER)
        .expect("valid constant")
        .with_timezone(&Utc)
}

/// See [`pause_forever`].
pub const PAUSE_FOREVER: &str = "2999-12-31T00:00:00Z";

/// The end of a pause as shown: `None` for "until resumed".
fn shown_pause_end(until: DateTime<Utc>, now: DateTime<Utc>) -> Option<DateTime<Utc>> {
    (until - now < chrono::Duration::days(FOREVER_THRESHOLD_DAYS)).then_some(until)
}

/// The label of one of the label consumers (`label-<label>`), if it is one.
fn label_of_consumer<'a>(names: &Names, consumer: &'a str) -> Option<&'a str> {
    let prefix = names.consumer_name("");
    consumer.strip_prefix(&prefix).filter(|l| valid_label(l))
}

/// The KV bucket of heartbeats, if it exists (no worker ever ran: `None`).
pub async fn workers_bucket(js: &jetstream::Context, names: &Names) -> Option<kv::Store> {
    js.get_key_value(&names.workers_bucket).await.ok()
}

/// Every online worker's heartbeat, by id (keys whose value does not parse
/// are skipped).
pub async fn online_workers(store: &kv::Store) -> anyhow::Result<Vec<Heartbeat>> {
    let mut keys = store.keys().await.context("cannot list workers")?;
    let mut out = Vec::new();
    while let Some(k) = keys.next().await {
        let k = k.context("cannot list workers")?;
        if let Some(v) = store.get(&k).await.context("cannot read a heartbeat")? {
            if let Ok(hb) = serde_json::from_slice::<Heartbeat>(&v) {
                out.push(hb);
            }
        }
    }
    out.sort_by(|a, b| a.id.cmp(&b.id));
    Ok(out)
}

/// The info of every label consumer on the task stream, by label.
pub async fn label_consumers(
    tasks: &Stream,
    names: &Names,
) -> anyhow::Result<BTreeMap<String, ConsumerInfo>> {
    let mut out = BTreeMap::new();
    let mut list = tasks.consumers();
    while let Some(info) = list.next().await {
        let info = info.context("cannot list the label consumers")?;
        if let Some(label) = label_of_consumer(names, &info.name) {
            out.insert(label.to_string(), info);
        }
    }
    Ok(out)
}

/// When the oldest task that no worker has been handed yet was published:
/// the first message on the label's subjects after the last one the
/// consumer delivered (two reads at the stream leader, one per filter).
async fn oldest_waiting(
    tasks: &Stream,
    names: &Names,
    label: &str,
    info: &ConsumerInfo,
) -> anyhow::Result<Option<DateTime<Utc>>> {
    if info.num_pending == 0 {
        return Ok(None);
    }
    let from = info.delivered.stream_sequence + 1;
    let reads = names.label_filters(label).into_iter().map(|f| async move {
        match tasks.get_first_raw_message_by_subject(&f, from).await {
            Ok(m) => Ok(Some((m.sequence, chrono_time(m.time)))),
            Err(e) if e.kind() == RawMessageErrorKind::NoMessageFound => Ok(None),
            Err(e) => Err(anyhow!("reading the oldest task of {label}: {e}")),
        }
    });
    let found = futures::future::try_join_all(reads).await?;
    Ok(found.into_iter().flatten().min().map(|(_, t)| t))
}

/// How many of `label`'s tasks the worker of heartbeat `h` runs.
fn running_here(h: &Heartbeat, label: &str) -> usize {
    match h.running_by_label.get(label) {
        Some(n) => *n,
        None if h.running_by_label.is_empty() && h.labels.len() == 1 => h.running,
        None => 0,
    }
}

/// The stats of one label from its consumer's info (`None`: no consumer).
async fn stats_of(
    tasks: &Stream,
    names: &Names,
    label: &str,
    info: Option<&ConsumerInfo>,
    workers: &[Heartbeat],
    now: DateTime<Utc>,
) -> anyhow::Result<QueueStats> {
    let serving: Vec<&Heartbeat> = workers
        .iter()
        .filter(|h| h.labels.iter().any(|l| l == label))
        .collect();
    let mut s = QueueStats {
        label: label.to_string(),
        read_at: now,
        waiting: 0,
        running: serving.iter().map(|h| running_here(h, label)).sum(),
        delayed: 0,
        redelivered: 0,
        oldest_waiting_at: None,
        oldest_waiting_ms: None,
        paused: false,
        paused_until: None,
        consumer: info.is_some(),
        workers: serving.iter().map(|h| h.id.clone()).collect(),
        slots: serving.iter().map(|h| h.slots).sum(),
    };
    let Some(info) = info else {
        return Ok(s);
    };
    s.waiting = info.num_pending;
    // Heartbeats lag: never more running than handed out.
    s.running = s.running.min(info.num_ack_pending);
    s.delayed = info.num_ack_pending - s.running;
    s.redelivered = info.num_redelivered;
    s.oldest_waiting_at = oldest_waiting(tasks, names, label, info).await?;
    s.oldest_waiting_ms = s
        .oldest_waiting_at
        .map(|t| (now - t).num_milliseconds().max(0) as u64);
    let (paused, until) = pause_state(info, now);
    s.paused = paused;
    s.paused_until = until;
    Ok(s)
}

/// Whether a consumer is paused, and until when (`None`: until resumed).
pub fn pause_state(info: &ConsumerInfo, now: DateTime<Utc>) -> (bool, Option<DateTime<Utc>>) {
    if !info.paused {
        return (false, None);
    }
    let until = info
        .config
        .pause_until
        .map(chrono_time)
        .or_else(|| {
            let d = chrono::Duration::from_std(info.pause_remaining?).ok()?;
            now.checked_add_signed(d)
        })
        .and_then(|u| shown_pause_end(u, now));
    (true, until)
}

/// The task stream, with an error that says how to make it.
pub async fn tasks_stream(js: &jetstream::Context, names: &Names) -> anyhow::Result<Stream> {
    js.get_stream(&names.tasks_stream).await.map_err(|e| {
        anyhow!(
            "cannot read stream {} ({e}); start a worker or run `jetworker setup`",
            names.tasks_stream
        )
    })
}

/// The queue of every label that has a consumer or an online worker,
/// sorted by label; `only` keeps just that label (an unknown one yields an
/// empty list).
pub async fn queue_stats(
    js: &jetstream::Context,
    names: &Names,
    only: Option<&str>,
) -> anyhow::Result<Vec<QueueStats>> {
    let tasks = tasks_stream(js, names).await?;
    let consumers = label_consumers(&tasks, names).await?;
    let workers = match workers_bucket(js, names).await {
        Some(b) => online_workers(&b).await?,
        None => Vec::new(),
    };
    let mut labels: Vec<&str> = consumers.keys().map(String::as_str).collect();
    labels.extend(
        workers
            .iter()
            .flat_map(|h| h.labels.iter().map(String::as_str)),
    );
    labels.sort_unstable();
    labels.dedup();
    labels.retain(|l| only.is_none_or(|o| o == *l));
    let now = Utc::now();
    let reads = labels
        .iter()
        .map(|l| stats_of(&tasks, names, l, consumers.get(*l), &workers, now));
    futures::future::try_join_all(reads).await
}

/// The answer to `pause` and `resume`: the label's state afterwards.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PauseState {
    /// The label.
    pub label: String,
    /// Whether its consumer is paused now.
    pub paused: bool,
    /// When the pause ends by itself (`None` while paused: until resumed).
    pub paused_until: Option<DateTime<Utc>>,
}

/// The label's consumer must exist: pausing creates nothing (its settings
/// are the workers' to choose).
async fn existing_consumer(tasks: &Stream, names: &Names, label: &str) -> anyhow::Result<String> {
    if !valid_label(label) {
        bail!("`{label}` is not a label ([A-Za-z0-9_-]{{1,64}})");
    }
    let name = names.consumer_name(label);
    match tasks.consumer_info(&name).await {
        Ok(_) => Ok(name),
        Err(e) if e.kind() == ConsumerInfoErrorKind::NotFound => bail!(
            "label {label} has no consumer yet (no worker has served it); start a worker with --labels {label} first"
        ),
        Err(e) => Err(anyhow!("cannot read consumer {name}: {e}")),
    }
}

/// Pause a label until `until` (`None`: until [`resume`]). Its workers stop
/// taking its tasks within one pull (2 s); tasks running go on, and tasks
/// published meanwhile wait.
pub async fn pause(
    js: &jetstream::Context,
    names: &Names,
    label: &str,
    until: Option<DateTime<Utc>>,
) -> anyhow::Result<PauseState> {
    let tasks = tasks_stream(js, names).await?;
    let name = existing_consumer(&tasks, names, label).await?;
    let at = until.unwrap_or_else(pause_forever);
    let at = time::OffsetDateTime::from_unix_timestamp(at.timestamp())
        .map_err(|e| anyhow!("pause time out of range: {e}"))?;
    let r = tasks
        .pause_consumer(&name, at)
        .await
        .map_err(|e| anyhow!("cannot pause {label}: {e}"))?;
    let now = Utc::now();
    Ok(PauseState {
        label: label.to_string(),
        paused: r.paused,
        paused_until: shown_pause_end(chrono_time(r.pause_until), now),
    })
}

/// Resume a paused label: its workers take its tasks again within one
/// pull. Resuming a label that is not paused changes nothing.
pub async fn resume(
    js: &jetstream::Context,
    names: &Names,
    label: &str,
) -> anyhow::Result<PauseState> {
    let tasks = tasks_stream(js, names).await?;
    let name = existing_consumer(&tasks, names, label).await?;
    let r = tasks
        .resume_consumer(&name)
        .await
        .map_err(|e| anyhow!("cannot resume {label}: {e}"))?;
    Ok(PauseState {
        label: label.to_string(),
        paused: r.paused,
        paused_until: None,
    })
}

/// Whether one label's consumer is paused now (for the worker's
/// `jetworker_label_paused` gauge).
pub async fn is_paused(tasks: &Stream, names: &Names, label: &str) -> anyhow::Result<bool> {
    let info = tasks
        .consumer_info(names.consumer_name(label))
        .await
        .map_err(|e| anyhow!("cannot read the consumer of {label}: {e}"))?;
    Ok(info.paused)
}

/// Where one task stands (`jetworker status <id>`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum TaskState {
    /// A worker claimed an attempt and runs it (`running` record).
    Running,
    /// An attempt failed or timed out and the next one waits for its
    /// backoff (a non-final result with `retry_in_ms`).
    Retrying,
    /// Waits in the task stream for a worker: never started yet, handed
    /// back at a worker's shutdown (`queued` record), or fenced after a
    /// lost lease (non-final `cancelled`).
    Waiting,
    /// A final record exists: nothing runs any more.
    Final,
    /// No record, and not found in the task stream.
    Unknown,
}

impl TaskState {
    /// The name `status --json` prints (`running`).
    pub fn as_str(self) -> &'static str {
        match self {
            TaskState::Running => "running",
            TaskState::Retrying => "retrying",
            TaskState::Waiting => "waiting",
            TaskState::Final => "final",
            TaskState::Unknown => "unknown",
        }
    }
}

/// One task's state, as `jetworker status <id> --json` prints it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TaskStatus {
    /// The task's id.
    pub id: String,
    /// Where it stands.
    pub state: TaskState,
    /// The task's label (from its last record, or its task message).
    pub label: Option<String>,
    /// For `running`: whether the claim's holder is online (its heartbeat
    /// key exists). An offline holder's claim is taken over at the next
    /// delivery (attempt n + 1).
    pub worker_online: Option<bool>,
    /// For `retrying`: when the next attempt becomes due.
    pub next_attempt_at: Option<DateTime<Utc>>,
    /// For a task with no record yet: when its message was published.
    pub published_at: Option<DateTime<Utc>>,
    /// The last record on `results.<id>` (DESIGN.md section 4), if any.
    pub record: Option<TaskResult>,
    /// Why the state is `unknown` although the task may exist: the task
    /// stream was too large to search ([`SCAN_LIMIT`]).
    pub note: Option<String>,
}

/// The last record of `id`, read at the stream leader (as a worker reads
/// it: a lagging replica could show an older state).
pub async fn last_record(
    results: &Stream,
    names: &Names,
    id: &str,
) -> anyhow::Result<Option<TaskResult>> {
    match results
        .get_last_raw_message_by_subject(&names.result_subject(id))
        .await
    {
        Ok(m) => Ok(serde_json::from_slice(&m.payload).ok()),
        Err(e) if e.kind() == RawMessageErrorKind::NoMessageFound => Ok(None),
        Err(e) => Err(anyhow!("cannot read the records of {id}: {e}")),
    }
}

/// Most task messages [`find_queued`] reads (one request each) before it
/// gives up and says the id may be among the rest.
pub const SCAN_LIMIT: usize = 5000;

/// Whether a task waits in the task stream for its first attempt.
#[derive(Debug, Clone, PartialEq)]
pub enum Queued {
    /// A message with this id: its label and when it was published.
    Found {
        /// Its label.
        label: String,
        /// When it was stored.
        published_at: DateTime<Utc>,
    },
    /// No message with this id.
    Absent,
    /// More than [`SCAN_LIMIT`] messages: not all were looked at.
    NotSearched,
}

/// Look for a task message with id `id` in the task stream (the JSON `id`
/// wins over the `Nats-Msg-Id` header, else `seq-<n>`, as the worker reads
/// it). Reads message by message at the stream leader: a WorkQueue stream
/// allows no second consumer over the label consumers' subjects.
pub async fn find_queued(
    js: &jetstream::Context,
    names: &Names,
    id: &str,
) -> anyhow::Result<Queued> {
    let Ok(stream) = js.get_stream(&names.tasks_stream).await else {
        return Ok(Queued::Absent);
    };
    let filter = format!("{}.>", names.tasks_prefix);
    let mut seq = 0u64;
    for _ in 0..SCAN_LIMIT {
        let m = match stream
            .raw_message_builder()
            .sequence(seq + 1)
            .next_by_subject(filter.clone())
            .send()
            .await
        {
            Ok(m) => m,
            Err(e) if e.kind() == RawMessageErrorKind::NoMessageFound => return Ok(Queued::Absent),
            Err(e) => return Err(anyhow!("cannot read the task stream: {e}")),
        };
        seq = m.sequence;
        let Some(label) = names.label_of(&m.subject) else {
            continue;
        };
        let msg_id = header(
            Some(&m.headers),
            async_nats::header::NATS_MESSAGE_ID.as_ref(),
        );
        let env = Envelope {
            label,
            msg_id: msg_id.as_deref(),
            stream_sequence: m.sequence,
            ..Default::default()
        };
        if best_effort_id(&m.payload, &env) == id {
            return Ok(Queued::Found {
                label: label.to_string(),
                published_at: chrono_time(m.time),
            });
        }
    }
    Ok(Queued::NotSearched)
}

/// Where task `id` stands: its last record, whether a running claim's
/// holder is online, or — with no record — whether it waits in the task
/// stream.
pub async fn task_status(
    js: &jetstream::Context,
    names: &Names,
    id: &str,
) -> anyhow::Result<TaskStatus> {
    if !valid_id(id) {
        bail!("`{id}` is not a task id ([A-Za-z0-9_-]{{1,128}})");
    }
    let mut st = TaskStatus {
        id: id.to_string(),
        state: TaskState::Unknown,
        label: None,
        worker_online: None,
        next_attempt_at: None,
        published_at: None,
        record: None,
        note: None,
    };
    let record = match js.get_stream(&names.results_stream).await {
        Ok(results) => last_record(&results, names, id).await?,
        Err(_) => None,
    };
    let Some(r) = record else {
        match find_queued(js, names, id).await? {
            Queued::Found {
                label,
                published_at,
            } => {
                st.state = TaskState::Waiting;
                st.label = Some(label);
                st.published_at = Some(published_at);
            }
            Queued::Absent => {}
            Queued::NotSearched => {
                st.note = Some(format!(
                    "the task stream holds more than {SCAN_LIMIT} tasks; not all were searched"
                ))
            }
        }
        return Ok(st);
    };
    st.label = Some(r.label.clone());
    st.state = if r.is_final {
        TaskState::Final
    } else {
        match r.status {
            Status::Running => TaskState::Running,
            Status::Failed | Status::Timeout if r.retry_in_ms.is_some() => TaskState::Retrying,
            _ => TaskState::Waiting,
        }
    };
    match st.state {
        TaskState::Running => {
            st.worker_online = Some(match workers_bucket(js, names).await {
                Some(b) => b
                    .get(&r.worker_id)
                    .await
                    .context("cannot read the workers bucket")?
                    .is_some(),
                None => false,
            });
        }
        TaskState::Retrying => {
            st.next_attempt_at = r
                .retry_in_ms
                .map(|ms| r.finished_at + chrono::Duration::milliseconds(ms as i64));
        }
        _ => {}
    }
    st.record = Some(r);
    Ok(st)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn consumer_names_map_back_to_labels() {
        let n = Names::default();
        assert_eq!(label_of_consumer(&n, &n.consumer_name("gpu")), Some("gpu"));
        assert_eq!(label_of_consumer(&n, "other"), None);
        assert_eq!(label_of_consumer(&n, "label-"), None);
        assert_eq!(label_of_consumer(&n, "label-a.b"), None);
    }

    #[test]
    fn a_pause_without_end_is_shown_as_until_resumed() {
        let now = Utc::now();
        assert_eq!(shown_pause_end(pause_forever(), now), None);
        let soon = now + chrono::Duration::minutes(10);
        assert_eq!(shown_pause_end(soon, now), Some(soon));
    }
}
