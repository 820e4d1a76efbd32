//! Durable publishing (DESIGN.md section 5, "ack after report"): the one
//! delivery loop for everything the worker must store — attempt results on
//! `results.<id>`, copies in DEAD and downstream tasks on their queue-once
//! subject `tasks.<label>.id.<id>` — and the on-disk outbox behind it.
//!
//! [`deliver`] publishes an [`Entry`] and classifies what the broker said:
//! - stored: done;
//! - refused by the compare-and-set on `results.<id>`: the subject moved on.
//!   If the last record there is this very write (a retry after a lost
//!   PubAck) it counts as stored; otherwise the write is stale and dropped,
//!   never retried blindly (invariant I2);
//! - a queue-once task: not published at all when its id already has a
//!   record (a copy was queued and consumed before: superseded); refused
//!   by its compare-and-set when a copy waits or runs (it is queued:
//!   stored); after a publish that raced with a consumed copy, the new copy
//!   is deleted again ([`super::downstream::drop_late_copy`]);
//! - permanent (too large for `max_payload`, permission denied): dropped
//!   with an error, so nothing wedges a slot or comes back at every start;
//! - stream missing: the stream is recreated once, then retried;
//! - transient (timeout, disconnected, no responders): written to
//!   `state_dir/outbox/` and retried with backoff until it is stored or the
//!   worker gives up at shutdown; the next start on the same state
//!   directory delivers it through the same loop ([`super::run`]).
//!
//! So the outbox only ever holds what a reconnect can deliver.
//!
//! File format: one JSON line of metadata, then the raw payload bytes.

use std::path::{Path, PathBuf};
use std::time::Duration;

use bytes::Bytes;
use serde::{Deserialize, Serialize};
use tracing::{debug, info, warn};

use super::Shared;

/// One message to publish durably.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Entry {
    /// Where to publish.
    pub subject: String,
    /// The write's identity, also the file name: `Nats-Msg-Id`, or
    /// `Jetworker-Write-Id` where [`Entry::cas_only`] says so.
    pub msg_id: String,
    /// The identity goes in `Jetworker-Write-Id` instead of `Nats-Msg-Id`:
    /// for the records of `results.<id>`, whose compare-and-set already
    /// refuses a repeat (the sequence check comes before de-duplication), so
    /// the broker's duplicate tracking would cost it a table entry per
    /// write for nothing. The writer recognises its own write by the header.
    #[serde(default)]
    pub cas_only: bool,
    /// Other headers.
    pub headers: Vec<(String, String)>,
    /// Compare-and-set: the stream sequence the subject's last message must
    /// have (`Nats-Expected-Last-Subject-Sequence`; 0 = no message yet).
    /// `None` for subjects without a state machine (DEAD).
    #[serde(default)]
    pub expected_last_seq: Option<u64>,
    /// The message body (stored after the JSON line).
    #[serde(skip)]
    pub payload: Bytes,
}

/// The identity of a record on `results.<id>` (`<id>.<attempt>`, ...):
/// how a writer recognises its own write after a lost PubAck.
pub(crate) const HEADER_WRITE_ID: &str = "Jetworker-Write-Id";

/// How long one publish may take before it counts as failed.
const PUBLISH_TIMEOUT: Duration = Duration::from_secs(5);

/// Why a publish did not store the message.
#[derive(Debug)]
pub(crate) enum PublishFailure {
    /// The compare-and-set refused it: the subject's last message is
    /// another one.
    Refused,
    /// No stream takes the subject (deleted under the worker).
    NoStream,
    /// Can never succeed as it is.
    Permanent(String),
    /// A reconnect or a moment may help.
    Transient(String),
}

impl Entry {
    /// Bytes this entry takes on the wire, roughly (payload, headers,
    /// subject): compared with the server's `max_payload`.
    pub(crate) fn wire_size(&self) -> usize {
        let headers: usize = self
            .headers
            .iter()
            .map(|(k, v)| k.len() + v.len() + 4)
            .sum();
        self.payload.len() + headers + self.msg_id.len() + self.subject.len() + 128
    }

    /// Publish once and wait for the PubAck: the stored stream sequence.
    ///
    /// A core request with one timer and a reply parsed for what a writer
    /// decides on ([`PubAck`]), rather than async-nats' JetStream publish
    /// (an ack-permit semaphore, three timers with the caller's, a boxed
    /// future and an untagged reply that fails one parse on every
    /// success): two of these are on every task's critical path.
    pub(crate) async fn publish(
        &self,
        client: &async_nats::Client,
        max_payload: usize,
    ) -> Result<u64, PublishFailure> {
        use async_nats::{header, RequestErrorKind};
        if self.wire_size() > max_payload {
            return Err(PublishFailure::Permanent(format!(
                "{} bytes do not fit the server's max_payload ({max_payload})",
                self.wire_size()
            )));
        }
        let mut h = async_nats::HeaderMap::new();
        if self.cas_only {
            h.insert(HEADER_WRITE_ID, self.msg_id.as_str());
        } else {
            h.insert(header::NATS_MESSAGE_ID, self.msg_id.as_str());
        }
        if let Some(seq) = self.expected_last_seq {
            h.insert(header::NATS_EXPECTED_LAST_SUBJECT_SEQUENCE, seq.to_string());
        }
        for (k, v) in &self.headers {
            h.insert(k.as_str(), v.as_str());
        }
        let request = async_nats::Request::new()
            .headers(h)
            .payload(self.payload.clone())
            .timeout(Some(PUBLISH_TIMEOUT));
        let reply = match client.send_request(self.subject.clone(), request).await {
            Ok(m) => m,
            Err(e) => {
                return Err(match e.kind() {
                    RequestErrorKind::NoResponders => PublishFailure::NoStream,
                    RequestErrorKind::TimedOut => {
                        PublishFailure::Transient(format!("no PubAck within {PUBLISH_TIMEOUT:?}"))
                    }
                    RequestErrorKind::MaxPayloadExceeded | RequestErrorKind::InvalidSubject => {
                        PublishFailure::Permanent(e.to_string())
                    }
                    _ => classify_text(e.to_string()),
                })
            }
        };
        match serde_json::from_slice::<PubAck>(&reply.payload) {
            Ok(PubAck { error: None, seq }) if seq > 0 => Ok(seq),
            Ok(PubAck { error: Some(e), .. }) => Err(match e.err_code {
                ERR_WRONG_LAST_SEQUENCE => PublishFailure::Refused,
                ERR_MESSAGE_TOO_LARGE => PublishFailure::Permanent(e.description),
                _ => classify_text(format!("{} (error {})", e.description, e.err_code)),
            }),
            _ => Err(PublishFailure::Transient(format!(
                "not a PubAck: {}",
                String::from_utf8_lossy(&reply.payload)
            ))),
        }
    }
}

/// A broker's answer to a JetStream publish: the stored sequence, or an
/// API error (what [`Entry::publish`] decides on; the rest is ignored).
#[derive(Deserialize)]
struct PubAck {
    #[serde(default)]
    seq: u64,
    #[serde(default)]
    error: Option<ApiError>,
}

#[derive(Deserialize)]
struct ApiError {
    #[serde(default)]
    err_code: u64,
    #[serde(default)]
    description: String,
}

/// JetStream's "wrong last sequence": the compare-and-set refused it.
const ERR_WRONG_LAST_SEQUENCE: u64 = 10071;
/// JetStream's "message size exceeds maximum allowed" (the stream's
/// `max_msg_size`): the same bytes can never be stored.
const ERR_MESSAGE_TOO_LARGE: u64 = 10054;

/// A failure named only by its text: a permission error is permanent,
/// anything else may pass after a reconnect or a moment.
fn classify_text(text: String) -> PublishFailure {
    if text.contains("Permissions Violation") || text.contains("permission") {
        PublishFailure::Permanent(text)
    } else {
        PublishFailure::Transient(text)
    }
}

/// What became of an entry handed to [`deliver`].
#[derive(Debug)]
pub(crate) enum Delivered {
    /// Stored (now, or by an earlier try whose PubAck was lost).
    Stored,
    /// Refused by the compare-and-set and not ours: a newer state exists
    /// (this is it, when it could be read). For a queue-once task: its id
    /// has records already (this is the last one); it is not queued again.
    Superseded(Option<Box<super::records::Last>>),
    /// Can never be stored; dropped (the reason was logged).
    Dropped(String),
    /// Still not stored when the worker gave up; the file stays for the
    /// next start.
    Kept,
}

/// The one delivery loop: publish `entry` until it is stored, superseded
/// or dropped, keeping it on disk while the broker is unreachable. `file`
/// is the entry's outbox file when it comes from disk.
pub(crate) async fn deliver(sh: &Shared, entry: &Entry, mut file: Option<PathBuf>) -> Delivered {
    let mut delay = Duration::from_millis(200);
    let mut recreated = false;
    let mut warned = false;
    let once = sh.names.once_task_id(&entry.subject);
    loop {
        if let Some(id) = once {
            match super::records::read_last(sh, id).await {
                Ok(Some(last)) => {
                    debug!(
                        task_id = id,
                        "it has records: queued before; not queued again"
                    );
                    return finish(sh, file, Delivered::Superseded(Some(Box::new(last))));
                }
                Ok(None) => {}
                Err(e) => {
                    file = keep(sh, entry, file, &mut warned, &format!("{e:#}"));
                    if !backoff(sh, &mut delay).await {
                        return Delivered::Kept;
                    }
                    continue;
                }
            }
        }
        let failure = match entry.publish(&sh.client, sh.max_payload).await {
            Ok(seq) => {
                if let Some(id) = once {
                    super::downstream::drop_late_copy(sh, id, seq).await;
                }
                if warned {
                    info!(subject = %entry.subject, "published from the outbox");
                }
                return finish(sh, file, Delivered::Stored);
            }
            Err(f) => f,
        };
        match failure {
            // A copy of the queue-once task waits or runs: it is queued.
            PublishFailure::Refused if once.is_some() => {
                return finish(sh, file, Delivered::Stored);
            }
            PublishFailure::Refused => {
                let outcome = match super::records::read_last_raw(sh, &entry.subject).await {
                    Ok(Some(last)) if last.msg_id.as_deref() == Some(entry.msg_id.as_str()) => {
                        Delivered::Stored
                    }
                    Ok(last) => {
                        info!(subject = %entry.subject, msg_id = %entry.msg_id,
                            "a newer state is stored; dropping this stale write");
                        Delivered::Superseded(last.map(Box::new))
                    }
                    // Cannot tell yet whether it was ours: try again later.
                    Err(e) => {
                        debug!(subject = %entry.subject, "cannot read the last record: {e:#}");
                        file = keep(sh, entry, file, &mut warned, &e.to_string());
                        if !backoff(sh, &mut delay).await {
                            return Delivered::Kept;
                        }
                        continue;
                    }
                };
                return finish(sh, file, outcome);
            }
            PublishFailure::Permanent(why) => {
                warn!(subject = %entry.subject, msg_id = %entry.msg_id,
                    "cannot be stored, ever ({why}); dropping it");
                return finish(sh, file, Delivered::Dropped(why));
            }
            PublishFailure::NoStream if !recreated && sh.conn.is_connected() => {
                recreated = true;
                debug!(subject = %entry.subject, "no stream takes the subject; recreating the streams if one is gone");
                if let Err(e) = sh.recreate_streams().await {
                    warn!("cannot recreate the streams: {e:#}");
                }
                continue;
            }
            PublishFailure::NoStream => {
                file = keep(sh, entry, file, &mut warned, "no stream for the subject");
            }
            PublishFailure::Transient(why) => {
                file = keep(sh, entry, file, &mut warned, &why);
            }
        }
        if !backoff(sh, &mut delay).await {
            warn!(subject = %entry.subject, "giving up for now; the outbox keeps it for the next start");
            return Delivered::Kept;
        }
    }
}

/// Make sure a failing entry is on disk (once), logging the first failure.
fn keep(
    sh: &Shared,
    entry: &Entry,
    file: Option<PathBuf>,
    warned: &mut bool,
    why: &str,
) -> Option<PathBuf> {
    if !*warned {
        warn!(subject = %entry.subject, "publish failed ({why}); keeping it in the outbox");
        *warned = true;
    }
    if file.is_some() {
        return file;
    }
    match sh.outbox.store(entry) {
        Ok(p) => {
            sh.outbox_changed();
            Some(p)
        }
        Err(err) => {
            warn!("cannot write the outbox ({err}); retrying from memory");
            None
        }
    }
}

/// Wait before the next try; false once the worker gives up.
async fn backoff(sh: &Shared, delay: &mut Duration) -> bool {
    tokio::select! {
        _ = sh.abandon.cancelled() => return false,
        _ = tokio::time::sleep(*delay) => {}
    }
    *delay = (*delay * 2).min(Duration::from_secs(5));
    // While disconnected, wait for the connection rather than spin.
    while !sh.conn.is_connected() {
        tokio::select! {
            _ = sh.abandon.cancelled() => return false,
            _ = tokio::time::sleep(Duration::from_millis(100)) => {}
        }
    }
    true
}

/// Remove the entry's file once it is settled.
fn finish(sh: &Shared, file: Option<PathBuf>, d: Delivered) -> Delivered {
    if let Some(p) = file {
        sh.outbox.remove(&p);
        sh.outbox_changed();
    }
    d
}

/// The outbox directory.
#[derive(Debug, Clone)]
pub struct Outbox {
    dir: PathBuf,
}

fn file_name(msg_id: &str) -> String {
    let safe: String = msg_id
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '_' || c == '.' {
                c
            } else {
                '_'
            }
        })
        .collect();
    format!("{safe}.msg")
}

impl Outbox {
    /// The outbox under `state_dir` (`outbox/`), created if missing.
    pub fn open(state_dir: &Path) -> std::io::Result<Self> {
        let dir = state_dir.join("outbox");
        std::fs::create_dir_all(&dir)?;
        Ok(Outbox { dir })
    }

    /// Persist an entry (atomically: write, fsync, rename).
    pub fn store(&self, e: &Entry) -> std::io::Result<PathBuf> {
        use std::io::Write;
        let path = self.dir.join(file_name(&e.msg_id));
        let tmp = path.with_extension("tmp");
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(serde_json::to_string(e)?.as_bytes())?;
        f.write_all(b"\n")?;
        f.write_all(&e.payload)?;
        f.sync_all()?;
        std::fs::rename(&tmp, &path)?;
        Ok(path)
    }

    /// Forget a delivered entry.
    pub fn remove(&self, path: &Path) {
        let _ = std::fs::remove_file(path);
    }

    /// Entries on disk, oldest first.
    pub fn pending(&self) -> Vec<(PathBuf, Entry)> {
        let mut v = Vec::new();
        let Ok(rd) = std::fs::read_dir(&self.dir) else {
            return Vec::new();
        };
        for de in rd.flatten() {
            let p = de.path();
            if p.extension().and_then(|s| s.to_str()) != Some("msg") {
                continue;
            }
            let Ok(bytes) = std::fs::read(&p) else {
                continue;
            };
            let Some(nl) = bytes.iter().position(|&b| b == b'\n') else {
                warn!(file = %p.display(), "outbox file without metadata line; leaving it");
                continue;
            };
            match serde_json::from_slice::<Entry>(&bytes[..nl]) {
                Ok(mut e) => {
                    e.payload = Bytes::copy_from_slice(&bytes[nl + 1..]);
                    let mtime = de.metadata().and_then(|m| m.modified()).ok();
                    v.push((mtime, p, e));
                }
                Err(err) => {
                    warn!(file = %p.display(), %err, "unreadable outbox file; leaving it")
                }
            }
        }
        v.sort_by_key(|a| a.0);
        v.into_iter().map(|(_, p, e)| (p, e)).collect()
    }

    /// Number of entries waiting and when the oldest was written.
    pub fn stats(&self) -> (usize, Option<std::time::SystemTime>) {
        let Ok(rd) = std::fs::read_dir(&self.dir) else {
            return (0, None);
        };
        let mut n = 0;
        let mut oldest: Option<std::time::SystemTime> = None;
        for d in rd.flatten() {
            if d.path().extension().and_then(|s| s.to_str()) != Some("msg") {
                continue;
            }
            n += 1;
            if let Ok(t) = d.metadata().and_then(|m| m.modified()) {
                oldest = Some(oldest.map_or(t, |o| o.min(t)));
            }
        }
        (n, oldest)
    }

    /// Number of entries waiting.
    pub fn len(&self) -> usize {
        std::fs::read_dir(&self.dir)
            .map(|rd| {
                rd.flatten()
                    .filter(|d| d.path().extension().and_then(|s| s.to_str()) == Some("msg"))
                    .count()
            })
            .unwrap_or(0)
    }

    /// Whether nothing waits.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip() {
        let d = tempfile::tempdir().unwrap();
        let o = Outbox::open(d.path()).unwrap();
        let e = Entry {
            subject: "results.a".into(),
            msg_id: "a.1".into(),
            headers: vec![("Jetworker-Status".into(), "success".into())],
            expected_last_seq: Some(7),
            cas_only: true,
            payload: Bytes::from_static(b"{\"x\":1}\n\xff binary"),
        };
        let p = o.store(&e).unwrap();
        let got = o.pending();
        assert_eq!(got.len(), 1);
        assert_eq!(got[0].1, e);
        assert_eq!(got[0].1.payload, e.payload);
        o.remove(&p);
        assert!(o.is_empty());
    }
}
