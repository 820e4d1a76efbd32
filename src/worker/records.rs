//! The records on `results.<id>`: reading the last one, and turning a
//! record into an [`Entry`] that is written with a compare-and-set against
//! the record it follows (DESIGN.md section 5, "the state machine").
//!
//! Every write names the stream sequence of the record it replaces
//! (`Nats-Expected-Last-Subject-Sequence`, 0 for "nothing yet"), so the
//! broker, not the worker, decides who wins: a second writer for the same
//! state is refused, and a stale writer (a fenced worker, an old outbox
//! entry) can never overwrite a newer state.

use bytes::Bytes;

use super::outbox::{Entry, HEADER_WRITE_ID};
use super::Shared;
use crate::output::{self, Captured};
use crate::protocol::{Status, TaskResult, HEADER_LABEL, HEADER_STATUS};

/// The last message on a `results.<id>` subject.
#[derive(Debug, Clone)]
pub(crate) struct Last {
    /// Its stream sequence: what the next write must expect.
    pub seq: u64,
    /// Its write id (`Jetworker-Write-Id`; `Nats-Msg-Id` on records of
    /// earlier versions), to recognise one's own write after a lost PubAck.
    pub msg_id: Option<String>,
    /// The record, if it parses (anything else on the subject is treated
    /// as a non-final state with no attempts).
    pub record: Option<TaskResult>,
}

impl Last {
    pub(crate) fn is_final(&self) -> bool {
        self.record.as_ref().is_some_and(|r| r.is_final)
    }
}

/// The last message on `subject` (`None`: nothing there yet). Read from
/// the stream leader (`STREAM.MSG.GET`), not with a direct get: on a
/// replicated stream a direct get may be answered by a follower that lags,
/// and a stale `running` claim would be taken for the current state (a
/// finished task adopted and run again).
pub(crate) async fn read_last_raw(sh: &Shared, subject: &str) -> anyhow::Result<Option<Last>> {
    use async_nats::jetstream::stream::LastRawMessageErrorKind;
    match sh
        .infra
        .results
        .get_last_raw_message_by_subject(subject)
        .await
    {
        Ok(m) => Ok(Some(Last {
            seq: m.sequence,
            msg_id: crate::protocol::header(Some(&m.headers), HEADER_WRITE_ID).or_else(|| {
                crate::protocol::header(
                    Some(&m.headers),
                    async_nats::header::NATS_MESSAGE_ID.as_ref(),
                )
            }),
            record: serde_json::from_slice(&m.payload).ok(),
        })),
        Err(e) if e.kind() == LastRawMessageErrorKind::NoMessageFound => Ok(None),
        Err(e) => Err(anyhow::anyhow!("reading {subject}: {e}")),
    }
}

/// The last record of task `id`.
pub(crate) async fn read_last(sh: &Shared, id: &str) -> anyhow::Result<Option<Last>> {
    read_last_raw(sh, &sh.names.result_subject(id)).await
}

/// The message id of a record: `<id>.<attempt>` for the result of an
/// attempt that ran (as in version 1; each attempt ends once), and
/// `<id>.<attempt>.<status>.<expected>.<worker id>` for states and for
/// records written without a run (cancelled before start, dead, rejected).
/// Two workers may race for the same place in the chain, and a state can
/// repeat — `running{2}` again after a shutdown's `queued{1}` — so the id
/// names the writer and the record it follows: a retry of the same write
/// recognises itself by it, and nobody else's write ever looks like its own.
fn msg_id(r: &TaskResult, ran: bool, expected: u64) -> String {
    if ran && !r.is_state() {
        format!("{}.{}", r.id, r.attempt)
    } else {
        format!(
            "{}.{}.{}.{expected}.{}",
            r.id, r.attempt, r.status, r.worker_id
        )
    }
}

/// The entry that writes `r` after the record at `expected` (0: first).
/// `ran`: the record reports an attempt that ran.
pub(crate) fn entry(sh: &Shared, r: &mut TaskResult, expected: u64, ran: bool) -> Entry {
    Entry {
        subject: sh.names.result_subject(&r.id),
        msg_id: msg_id(r, ran, expected),
        headers: vec![
            (HEADER_STATUS.to_string(), r.status.as_str().to_string()),
            (HEADER_LABEL.to_string(), r.label.clone()),
        ],
        expected_last_seq: Some(expected),
        cas_only: true,
        payload: encode(r, sh.max_payload),
    }
}

/// Serialize a record so that it fits the server's max_payload, shrinking
/// the output if it must.
fn encode(r: &mut TaskResult, max_payload: usize) -> Bytes {
    let limit = max_payload.saturating_sub(1024);
    loop {
        // Sized for a record with its output, so the buffer grows once at
        // most (about 450 bytes besides the output).
        let mut b =
            Vec::with_capacity(640 + r.output.len() + r.error.as_ref().map_or(0, String::len));
        serde_json::to_writer(&mut b, &r).expect("result serializes");
        if b.len() <= limit || r.output.is_empty() {
            return b.into();
        }
        let excess = b.len() - limit;
        let target = r
            .output
            .len()
            .saturating_sub(excess + 64)
            .min(r.output.len() * 9 / 10);
        let shrunk = output::shrink(
            &Captured {
                text: std::mem::take(&mut r.output),
                truncated: r.output_truncated,
                total_bytes: r.output_bytes,
            },
            target,
        );
        r.output = shrunk.text;
        r.output_truncated = shrunk.truncated;
    }
}

/// Whether `r` is a claim held by another worker that is still online:
/// such a claim is waited for, never taken over. A worker only pulls after
/// its first heartbeat is stored, so a claim's holder is visible before the
/// claim is. A claim whose holder is offline (its heartbeat key expired or
/// was deleted) is taken over, whatever message it came from: the holder
/// stopped its copy when it lost its lease, and a crashed holder's copy died
/// with it. Not trusting the broker's redelivery alone matters: a
/// nats-server restarted after a crash may hand out a message again that it
/// had already delivered, while the first copy still runs.
pub(crate) fn held_elsewhere(sh: &Shared, r: &TaskResult) -> bool {
    r.status == Status::Running && r.worker_id != sh.id && sh.workers_online(&r.worker_id)
}
