//! Downstream tasks (DESIGN.md section 5, "Downstream tasks"): what a
//! task's final record queues, made sure of before its message is acked.
//!
//! - **Children** (`then`): the final record lists the ids its status
//!   fires ([`stamp`]); each is then published on its queue-once subject
//!   `tasks.<label>.id.<child id>` with `Nats-Expected-Last-Subject-Sequence:
//!   0`, through the outbox ([`super::outbox::deliver`] knows the subject):
//!   a copy that waits or runs refuses the publish, and a consumed copy
//!   left records on `results.<child id>`, which are looked at first. So a
//!   redelivered parent queues nothing twice, in or out of the duplicate
//!   window.
//! - **Joins** (`then_all` on a shard): the shard's final status is added
//!   to the join's key in KV `joins` with compare-and-set on the key's
//!   revision (a shard already there is left alone; the shards finishing
//!   on this worker together share one write); whoever finds the set
//!   complete queues the join with the shards' summary, through the same
//!   queue-once publish, so it is queued once however many shards finish
//!   together or are redelivered.
//!
//! [`ensure`] is idempotent: the lifecycle calls it before acking any
//! message whose id has a final record — after reporting, and again when
//! a redelivery finds the final record (a crash before the ack).

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};

use async_nats::jetstream::kv::UpdateErrorKind;
use async_nats::jetstream::stream::LastRawMessageErrorKind;
use chrono::Utc;
use tracing::{debug, info, warn};

use super::outbox::{self, Delivered, Entry};
use super::records;
use super::Shared;
use crate::protocol::{
    Child, Join, JoinState, JoinSummary, Status, Task, TaskMessage, TaskResult,
    DEFAULT_MAX_ATTEMPTS,
};

/// Compare-and-set rounds on a join's key before the message is handed
/// back (each refusal means another shard was recorded meanwhile).
const MAX_JOIN_ROUNDS: usize = 64;

/// Why the downstream of a final record is not settled: its message must
/// not be acked yet.
#[derive(Debug)]
pub(super) enum NotYet {
    /// A child waits in the outbox (the broker is unreachable).
    Kept,
    /// The broker could not be asked; try again on redelivery.
    Broker,
}

/// Record on `r` what its task queues: every planned child while it is a
/// state, the children its status fires once it is final; the join's id
/// and the task's parent.
pub(super) fn stamp(r: &mut TaskResult, task: &Task) {
    r.children = if r.is_final {
        task.fired(r.status).map(|c| c.id.clone()).collect()
    } else {
        task.then.iter().map(|c| c.id.clone()).collect()
    };
    r.join = task.join.as_ref().map(|j| j.task.id.clone());
    r.parent = task.parent.clone();
}

/// Queue everything the final record of `task` queues: the children its
/// status fires and, for a shard, its part of the join. Idempotent; `Ok`
/// too when the id has no final record (nothing to queue).
pub(super) async fn ensure(sh: &Shared, task: &Task) -> Result<(), NotYet> {
    let last = records::read_last(sh, &task.id).await.map_err(|e| {
        debug!("{e:#}; the downstream tasks are queued on redelivery");
        NotYet::Broker
    })?;
    let Some(fin) = last.and_then(|l| l.record).filter(|r| r.is_final) else {
        return Ok(());
    };
    for c in task.fired(fin.status) {
        queue(sh, c, &c.message).await?;
    }
    if let Some(j) = &task.join {
        join_step(sh, task, j, fin.status).await?;
    }
    Ok(())
}

/// Publish a downstream task on its queue-once subject, through the outbox.
async fn queue(sh: &Shared, c: &Child, message: &TaskMessage) -> Result<(), NotYet> {
    let entry = Entry {
        subject: sh.names.once_task_subject(&c.label, &c.id),
        msg_id: c.id.clone(),
        headers: Vec::new(),
        expected_last_seq: Some(0),
        cas_only: false,
        payload: serde_json::to_vec(message)
            .expect("a task serializes")
            .into(),
    };
    match outbox::deliver(sh, &entry, None).await {
        Delivered::Stored => {
            info!(child = %c.id, label = %c.label, "downstream task queued");
            Ok(())
        }
        Delivered::Superseded(_) => Ok(()),
        Delivered::Kept => Err(NotYet::Kept),
        Delivered::Dropped(why) => {
            not_queued(sh, c, &why).await;
            Ok(())
        }
    }
}

/// A downstream task that can never be published (permission denied, too
/// large) gets a final `dead` record saying so, unless its id has one, so
/// that nobody waits for it for ever.
async fn not_queued(sh: &Shared, c: &Child, why: &str) {
    let mut r = TaskResult::blank(
        &c.id,
        &c.label,
        c.message.task_type.clone(),
        Status::Dead,
        0,
        DEFAULT_MAX_ATTEMPTS,
        &sh.id,
        Utc::now(),
    );
    r.error = Some(format!("could not be queued: {why}"));
    r.parent = c.message.parent.clone();
    let entry = records::entry(sh, &mut r, 0, false);
    outbox::deliver(sh, &entry, None).await;
}

/// Add this shard's final status to the join's key, and queue the join if
/// the set is complete — also when an earlier delivery already added it.
///
/// The shards of one join that finish on this worker at the same time are
/// written together (group commit): each puts its status in the join's
/// local batch and waits for the batch's write lock; whoever holds it
/// writes every status waiting, so the key sees one compare-and-set per
/// batch instead of one per slot. A status leaves the batch only while the
/// lock is held, and goes back if the write fails, so a shard that finds
/// its status gone when it gets the lock knows it is stored.
async fn join_step(sh: &Shared, task: &Task, j: &Join, status: Status) -> Result<(), NotYet> {
    let shard = task.shard.expect("then_all is validated on a shard");
    let key = &j.task.id;
    let batch = sh.joins.batch(key);
    batch.pending.lock().unwrap().insert(shard.no, status);
    let state = {
        let _writer = batch.write.lock().await;
        let entries = std::mem::take(&mut *batch.pending.lock().unwrap());
        let written = batch.last.lock().unwrap().clone();
        match written {
            // Ours was in an earlier batch, stored with this state.
            Some(st) if entries.is_empty() => st,
            _ => match write_statuses(sh, key, shard.total, &entries).await {
                Ok(st) => {
                    *batch.last.lock().unwrap() = Some(st.clone());
                    st
                }
                Err(e) => {
                    batch.pending.lock().unwrap().extend(entries);
                    return Err(e);
                }
            },
        }
    };
    sh.joins.release(key, batch);
    if state.complete() {
        let mut m = j.task.message.clone();
        m.join_summary = Some(JoinSummary::of(&state, j.policy));
        return queue(sh, &j.task, &m).await;
    }
    Ok(())
}

/// Add `entries` (shard number → final status) to the join's key with
/// compare-and-set on its revision, read from the stream leader; shards
/// already there are left as they are. The state stored.
async fn write_statuses(
    sh: &Shared,
    key: &str,
    total: u32,
    entries: &BTreeMap<u32, Status>,
) -> Result<JoinState, NotYet> {
    let kv = &sh.infra.joins;
    let subject = format!("{}{key}", kv.prefix);
    for _ in 0..MAX_JOIN_ROUNDS {
        let (mut state, revision) = match kv.stream.get_last_raw_message_by_subject(&subject).await
        {
            Ok(m) if m.headers.get("KV-Operation").is_none() => {
                match serde_json::from_slice::<JoinState>(&m.payload) {
                    Ok(s) => (s, m.sequence),
                    Err(e) => {
                        warn!(join = %key, "the join's key is not a join state ({e}); leaving the message for later");
                        return Err(NotYet::Broker);
                    }
                }
            }
            // Deleted by hand: start again over the marker.
            Ok(m) => (JoinState::default(), m.sequence),
            Err(e) if e.kind() == LastRawMessageErrorKind::NoMessageFound => {
                (JoinState::default(), 0)
            }
            Err(e) => {
                debug!(join = %key, "cannot read the join's key: {e}");
                return Err(NotYet::Broker);
            }
        };
        if state.of == 0 {
            state.of = total;
        } else if state.of != total {
            warn!(join = %key, of = state.of, total, "shards of one join disagree on their total; the first one counts");
        }
        let before = state.done.len();
        for (no, st) in entries {
            state.done.entry(*no).or_insert(*st);
        }
        if state.done.len() == before {
            return Ok(state);
        }
        let value = serde_json::to_vec(&state).expect("a join state serializes");
        match kv.update(key, value.into(), revision).await {
            Ok(_) => {
                debug!(join = %key, added = state.done.len() - before, done = state.done.len(), of = state.of, "shards recorded");
                return Ok(state);
            }
            // Another worker recorded shards meanwhile: read again.
            Err(e) if e.kind() == UpdateErrorKind::WrongLastRevision => continue,
            Err(e) => {
                debug!(join = %key, "cannot update the join's key: {e}");
                return Err(NotYet::Broker);
            }
        }
    }
    warn!(join = %key, "the join's key kept moving; trying again on redelivery");
    Err(NotYet::Broker)
}

/// The joins this worker is writing to: one batch per join id, while any
/// of its shards is between its final record and its ack here.
#[derive(Default)]
pub(crate) struct JoinBatches {
    batches: Mutex<HashMap<String, Arc<JoinBatch>>>,
}

#[derive(Default)]
pub(crate) struct JoinBatch {
    /// Statuses waiting to be written.
    pending: Mutex<BTreeMap<u32, Status>>,
    /// Held while a batch is written.
    write: tokio::sync::Mutex<()>,
    /// The state the last write of this worker stored.
    last: Mutex<Option<JoinState>>,
}

impl JoinBatches {
    fn batch(&self, key: &str) -> Arc<JoinBatch> {
        self.batches
            .lock()
            .unwrap()
            .entry(key.to_string())
            .or_default()
            .clone()
    }

    /// Forget a batch nobody else uses and nothing waits in. (Should
    /// another shard get it meanwhile, it writes through its own copy:
    /// one more compare-and-set, never a lost status.)
    fn release(&self, key: &str, batch: Arc<JoinBatch>) {
        let mut m = self.batches.lock().unwrap();
        if Arc::strong_count(&batch) == 2 && batch.pending.lock().unwrap().is_empty() {
            m.remove(key);
        }
    }
}

/// After a queue-once task `id` was published at `seq`: if its id has a
/// record of another message, a copy was consumed between the look at the
/// records and the publish, and this one is not needed — delete it (it
/// would not run anyway: its claim finds that record).
pub(super) async fn drop_late_copy(sh: &Shared, id: &str, seq: u64) {
    let Ok(Some(last)) = records::read_last(sh, id).await else {
        return;
    };
    if last.record.is_some_and(|r| r.task_seq != Some(seq)) {
        match sh.infra.tasks.delete_message(seq).await {
            Ok(_) => debug!(
                task_id = id,
                seq, "deleted a late copy of a queue-once task"
            ),
            Err(e) => debug!(
                task_id = id,
                seq, "late copy not deleted ({e}); its claim will ack it"
            ),
        }
    }
}
