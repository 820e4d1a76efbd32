//! The on-disk outbox (DESIGN.md section 5, "ack after report"): a message
//! that must be stored (a result, a dead letter) and could not be published
//! is written to `state_dir/outbox/` first, then published with retries.
//! The task is acked only after the publish succeeded; a worker that stops
//! meanwhile leaves the file, and the next worker on the same state
//! directory publishes it at start-up. `Nats-Msg-Id` makes a re-publish of
//! the same entry a no-op on the server.
//!
//! File format: one JSON line of metadata, then the raw payload bytes.

use std::path::{Path, PathBuf};
use std::time::Duration;

use async_nats::jetstream::{self, message::PublishMessage};
use bytes::Bytes;
use serde::{Deserialize, Serialize};

/// One message to publish durably.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Entry {
    pub subject: String,
    /// `Nats-Msg-Id`, also the file name.
    pub msg_id: String,
    pub headers: Vec<(String, String)>,
    #[serde(skip)]
    pub payload: Bytes,
}

/// How long one publish may take before it counts as failed.
const PUBLISH_TIMEOUT: Duration = Duration::from_secs(5);

impl Entry {
    /// Publish and wait for the PubAck.
    pub async fn publish(&self, js: &jetstream::Context) -> anyhow::Result<()> {
        let mut m = PublishMessage::build()
            .payload(self.payload.clone())
            .message_id(&self.msg_id);
        for (k, v) in &self.headers {
            m = m.header(k.as_str(), v.as_str());
        }
        let fut = async {
            let ack = js.send_publish(self.subject.clone(), m).await?;
            ack.await?;
            anyhow::Ok(())
        };
        match tokio::time::timeout(PUBLISH_TIMEOUT, fut).await {
            Ok(r) => r,
            Err(_) => anyhow::bail!("no PubAck within {PUBLISH_TIMEOUT:?}"),
        }
    }
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
                tracing::warn!(file = %p.display(), "outbox file without metadata line; leaving it");
                continue;
            };
            match serde_json::from_slice::<Entry>(&bytes[..nl]) {
                Ok(mut e) => {
                    e.payload = Bytes::copy_from_slice(&bytes[nl + 1..]);
                    let mtime = de.metadata().and_then(|m| m.modified()).ok();
                    v.push((mtime, p, e));
                }
                Err(err) => {
                    tracing::warn!(file = %p.display(), %err, "unreadable outbox file; leaving it")
                }
            }
        }
        v.sort_by_key(|a| a.0);
        v.into_iter().map(|(_, p, e)| (p, e)).collect()
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
