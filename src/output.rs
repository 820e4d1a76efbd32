//! Bounded capture of a task's output: whatever a task prints, memory stays
//! within the cap. The head and the tail are kept; the result text is cut on
//! UTF-8 boundaries. Chunks are also handed to the live-output publisher,
//! which coalesces them and caps their rate, so that a chatty task neither
//! floods `logs.<id>` nor delays anything else the worker sends.

use bytes::Bytes;

use crate::protocol::{HEADER_FINAL, HEADER_STREAM};

/// Which stream a chunk came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StreamKind {
    /// Standard output.
    Stdout,
    /// Standard error.
    Stderr,
}

impl StreamKind {
    /// The name on the live stream (`stdout`).
    pub fn as_str(self) -> &'static str {
        match self {
            StreamKind::Stdout => "stdout",
            StreamKind::Stderr => "stderr",
        }
    }
}

/// Marker placed between head and tail of a truncated output.
pub const TRUNCATION_MARKER: &str = "\n… [output truncated] …\n";

/// Head-and-tail capture with a fixed byte budget.
#[derive(Debug)]
pub struct Capture {
    cap: usize,
    head: Vec<u8>,
    /// Ring buffer holding the most recent bytes past the head.
    tail: Vec<u8>,
    tail_start: usize,
    total: u64,
}

/// Captured output, ready for a result.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Captured {
    /// The text kept: everything if it fit, else head, marker and tail (valid UTF-8).
    pub text: String,
    /// Whether anything was cut.
    pub truncated: bool,
    /// Bytes pushed in all.
    pub total_bytes: u64,
}

impl Capture {
    pub fn new(cap: u64) -> Self {
        let cap = cap.min(usize::MAX as u64) as usize;
        Capture {
            cap,
            head: Vec::new(),
            tail: Vec::new(),
            tail_start: 0,
            total: 0,
        }
    }

    fn head_cap(&self) -> usize {
        self.cap / 2
    }

    fn tail_cap(&self) -> usize {
        self.cap - self.head_cap()
    }

    /// Add bytes. Memory never exceeds the cap.
    pub fn push(&mut self, mut data: &[u8]) {
        self.total += data.len() as u64;
        let room = self.head_cap().saturating_sub(self.head.len());
        if room > 0 {
            let n = room.min(data.len());
            self.head.extend_from_slice(&data[..n]);
            data = &data[n..];
        }
        let tcap = self.tail_cap();
        if data.is_empty() || tcap == 0 {
            return;
        }
        if data.len() >= tcap {
            self.tail.clear();
            self.tail.extend_from_slice(&data[data.len() - tcap..]);
            self.tail_start = 0;
            return;
        }
        if self.tail.len() < tcap {
            let room = tcap - self.tail.len();
            let n = room.min(data.len());
            self.tail.extend_from_slice(&data[..n]);
            data = &data[n..];
        }
        for &b in data {
            self.tail[self.tail_start] = b;
            self.tail_start = (self.tail_start + 1) % tcap;
        }
    }

    /// The captured text: everything if it fit, else head + marker + tail,
    /// each cut on a character boundary.
    pub fn finish(&self) -> Captured {
        let kept = (self.head.len() + self.tail.len()) as u64;
        let mut tail = Vec::with_capacity(self.tail.len());
        tail.extend_from_slice(&self.tail[self.tail_start..]);
        tail.extend_from_slice(&self.tail[..self.tail_start]);
        if kept == self.total {
            let mut all = self.head.clone();
            all.extend_from_slice(&tail);
            return Captured {
                text: String::from_utf8_lossy(&all).into_owned(),
                truncated: false,
                total_bytes: self.total,
            };
        }
        let head = utf8_prefix(&self.head);
        let tail = utf8_suffix(&tail);
        let mut text = String::from_utf8_lossy(head).into_owned();
        text.push_str(TRUNCATION_MARKER);
        text.push_str(&String::from_utf8_lossy(tail));
        Captured {
            text,
            truncated: true,
            total_bytes: self.total,
        }
    }
}

/// The longest prefix that does not end inside a multi-byte character.
fn utf8_prefix(b: &[u8]) -> &[u8] {
    let mut end = b.len();
    // Step back over at most 3 continuation bytes to a lead byte.
    let mut i = end;
    while i > 0 && end - i < 4 {
        i -= 1;
        let c = b[i];
        if c & 0xC0 != 0x80 {
            let need = if c < 0x80 {
                1
            } else if c >> 5 == 0b110 {
                2
            } else if c >> 4 == 0b1110 {
                3
            } else if c >> 3 == 0b11110 {
                4
            } else {
                1
            };
            if end - i < need {
                end = i;
            }
            break;
        }
    }
    &b[..end]
}

/// The longest suffix that does not start inside a multi-byte character.
fn utf8_suffix(b: &[u8]) -> &[u8] {
    let mut start = 0;
    while start < b.len() && start < 4 && b[start] & 0xC0 == 0x80 {
        start += 1;
    }
    &b[start..]
}

/// Shrink a captured text to at most `max` bytes, keeping head and tail.
/// Used when a result would not fit the server's max_payload.
pub fn shrink(c: &Captured, max: usize) -> Captured {
    if c.text.len() <= max {
        return c.clone();
    }
    let budget = max.saturating_sub(TRUNCATION_MARKER.len());
    let bytes = c.text.as_bytes();
    let head = utf8_prefix(&bytes[..budget / 2]);
    let tail = utf8_suffix(&bytes[bytes.len() - (budget - budget / 2)..]);
    let mut text = String::from_utf8_lossy(head).into_owned();
    text.push_str(TRUNCATION_MARKER);
    text.push_str(&String::from_utf8_lossy(tail));
    Captured {
        text,
        truncated: true,
        total_bytes: c.total_bytes,
    }
}

/// Header of a live-output chunk: the attempt it belongs to.
pub const HEADER_ATTEMPT: &str = "Jetworker-Attempt";
/// Header of a `Jetworker-Stream: skipped` message: how many bytes of
/// output the rate cap kept off the live stream (the result has them).
pub const HEADER_SKIPPED: &str = "Jetworker-Skipped";

/// Live chunks are sent once this much is pending…
const LIVE_MIN_CHUNK: usize = 4 * 1024;
/// …or this long after the first pending byte…
const LIVE_FLUSH_EVERY: std::time::Duration = std::time::Duration::from_millis(100);
/// …and never larger than this.
const LIVE_MAX_CHUNK: usize = 64 * 1024;
/// Per attempt: the sustained live-output rate, and the burst above it.
const LIVE_RATE: f64 = 128.0 * 1024.0;
const LIVE_BURST: f64 = 512.0 * 1024.0;
/// Chunks queued between a runner and its publisher; a full queue skips.
const LIVE_QUEUE: usize = 64;

/// The stream that keeps recent live output, so that a follower attaching
/// late sees the output so far: memory storage, a per-subject limit, short
/// retention (DESIGN.md section 4, live output).
pub fn logs_stream_config(names: &crate::protocol::Names) -> async_nats::jetstream::stream::Config {
    use async_nats::jetstream::stream::{Config, DiscardPolicy, StorageType};
    Config {
        name: logs_stream_name(names),
        subjects: vec![format!("{}.>", names.logs_prefix)],
        storage: StorageType::Memory,
        max_messages_per_subject: 1000,
        max_bytes: 256 << 20,
        max_age: std::time::Duration::from_secs(3600),
        discard: DiscardPolicy::Old,
        duplicate_window: std::time::Duration::from_secs(1),
        description: Some("jetworker live output, recent (for late followers)".into()),
        ..Default::default()
    }
}

/// `LOGS` for the default `logs` prefix.
pub fn logs_stream_name(names: &crate::protocol::Names) -> String {
    names
        .logs_prefix
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() {
                c.to_ascii_uppercase()
            } else {
                '_'
            }
        })
        .collect()
}

/// Publishes live output on `logs.<id>` (core NATS publishes, kept for a
/// while by the logs stream where it exists). Cheap to clone; each
/// attempt's chunks go through an [`OutputSink`], which coalesces and
/// rate-caps them.
///
/// An attempt goes live only at its first flush: one that ends before it
/// (no output, or less than 4 KiB of it within its first 100 ms)
/// publishes nothing at all, not even its `eof`; its
/// record says so (`"live": false`) and followers show the stored output.
/// Most short tasks thus cost the broker nothing on the live stream.
#[derive(Clone)]
pub struct LiveOutput {
    client: async_nats::Client,
    subject: async_nats::Subject,
    /// Whether anything of this attempt was published (shared by clones).
    published: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl LiveOutput {
    /// Publish on `subject` (`logs.<id>`) through `client`.
    pub(crate) fn new(client: async_nats::Client, subject: String) -> Self {
        LiveOutput {
            client,
            subject: subject.into(),
            published: Default::default(),
        }
    }

    async fn publish(&self, h: async_nats::HeaderMap, data: Bytes) {
        self.published
            .store(true, std::sync::atomic::Ordering::Relaxed);
        let _ = self
            .client
            .publish_with_headers(self.subject.clone(), h, data)
            .await;
    }

    /// Whether any of this attempt's output went to the live stream (then
    /// it ends with an `eof`); `false` goes into the record as `live`.
    pub fn published(&self) -> bool {
        self.published.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Tell followers this attempt's output is complete, and whether its
    /// result is final (no retry follows). Nothing for an attempt that
    /// never went live: its record carries its output.
    pub async fn end(&self, is_final: bool) {
        if !self.published() {
            return;
        }
        let mut h = async_nats::HeaderMap::new();
        h.insert(HEADER_STREAM, "eof");
        h.insert(HEADER_FINAL, if is_final { "true" } else { "false" });
        self.publish(h, Bytes::new()).await;
    }
}

/// What a runner hands the live publisher.
enum LiveMsg {
    Chunk(StreamKind, Bytes),
    Skipped(u64),
}

/// One attempt's live publisher: coalesces chunks per stream (at least
/// [`LIVE_MIN_CHUNK`] or every [`LIVE_FLUSH_EVERY`]) and publishes them;
/// what the rate cap skipped is announced with the next chunk (and at the
/// end).
async fn publish_live(
    live: LiveOutput,
    attempt: u32,
    mut rx: tokio::sync::mpsc::Receiver<LiveMsg>,
) {
    use tokio::time::{sleep_until, Instant};
    let attempt = attempt.to_string();
    let mut pending: Vec<u8> = Vec::new();
    let mut kind = StreamKind::Stdout;
    let mut since: Option<Instant> = None;
    let mut skipped: u64 = 0;
    let far = Instant::now() + std::time::Duration::from_secs(10 * 365 * 24 * 3600);
    // Publish `data` (if any) after the skipped notice (if any).
    let flush = |data: Vec<u8>, kind: StreamKind, skipped: &mut u64| {
        let live = live.clone();
        let attempt = attempt.clone();
        let n = std::mem::take(skipped);
        async move {
            let headers = |stream: &str| {
                let mut h = async_nats::HeaderMap::new();
                h.insert(HEADER_STREAM, stream);
                h.insert(HEADER_ATTEMPT, attempt.as_str());
                h
            };
            if n > 0 {
                let mut h = headers("skipped");
                h.insert(HEADER_SKIPPED, n.to_string().as_str());
                live.publish(h, Bytes::new()).await;
            }
            if !data.is_empty() {
                live.publish(headers(kind.as_str()), Bytes::from(data))
                    .await;
            }
        }
    };
    loop {
        let msg = tokio::select! {
            m = rx.recv() => m,
            _ = sleep_until(since.map(|t| t + LIVE_FLUSH_EVERY).unwrap_or(far)), if since.is_some() => {
                flush(std::mem::take(&mut pending), kind, &mut skipped).await;
                since = None;
                continue;
            }
        };
        match msg {
            None => {
                // The attempt is over. What never went live stays off the
                // live stream: the record has it (`live: false`).
                if live.published() || skipped > 0 {
                    flush(std::mem::take(&mut pending), kind, &mut skipped).await;
                }
                return;
            }
            Some(LiveMsg::Skipped(n)) => skipped += n,
            Some(LiveMsg::Chunk(k, data)) => {
                if k != kind && !pending.is_empty() {
                    flush(std::mem::take(&mut pending), kind, &mut skipped).await;
                }
                kind = k;
                pending.extend_from_slice(&data);
                since.get_or_insert_with(Instant::now);
                while pending.len() >= LIVE_MIN_CHUNK {
                    let n = pending.len().min(LIVE_MAX_CHUNK);
                    let rest = pending.split_off(n);
                    flush(std::mem::replace(&mut pending, rest), kind, &mut skipped).await;
                    since = if pending.is_empty() {
                        None
                    } else {
                        Some(Instant::now())
                    };
                }
            }
        }
    }
}

/// The live side of a sink: a token bucket (the rate cap) in front of the
/// publisher task, started on the first output.
struct LiveFeed {
    live: LiveOutput,
    attempt: u32,
    tx: Option<tokio::sync::mpsc::Sender<LiveMsg>>,
    task: Option<tokio::task::JoinHandle<()>>,
    tokens: f64,
    refilled: std::time::Instant,
    skipped: u64,
}

impl LiveFeed {
    fn push(&mut self, kind: StreamKind, data: &[u8]) {
        let now = std::time::Instant::now();
        self.tokens = (self.tokens + now.duration_since(self.refilled).as_secs_f64() * LIVE_RATE)
            .min(LIVE_BURST);
        self.refilled = now;
        // A chunk goes whole or not at all: no trickle of slivers.
        if self.tokens < data.len() as f64 {
            self.skipped += data.len() as u64;
            return;
        }
        let tx = self.sender().clone();
        if self.skipped > 0 && tx.try_send(LiveMsg::Skipped(self.skipped)).is_ok() {
            self.skipped = 0;
        }
        match tx.try_send(LiveMsg::Chunk(kind, Bytes::copy_from_slice(data))) {
            Ok(()) => self.tokens -= data.len() as f64,
            Err(_) => self.skipped += data.len() as u64,
        }
    }

    /// The channel to this attempt's publisher, started on first use.
    fn sender(&mut self) -> &tokio::sync::mpsc::Sender<LiveMsg> {
        let (live, attempt, task) = (&self.live, self.attempt, &mut self.task);
        self.tx.get_or_insert_with(|| {
            let (tx, rx) = tokio::sync::mpsc::channel(LIVE_QUEUE);
            *task = Some(tokio::spawn(publish_live(live.clone(), attempt, rx)));
            tx
        })
    }

    /// Flush, say what was skipped, and wait until everything is handed to
    /// the client (so the worker's `eof` comes after it).
    async fn finish(mut self) {
        if self.skipped > 0 {
            let skipped = self.skipped;
            let _ = self.sender().send(LiveMsg::Skipped(skipped)).await;
        }
        drop(self.tx.take());
        if let Some(t) = self.task.take() {
            let _ = t.await;
        }
    }
}

/// Capture plus optional live forwarding; what runners write output to.
/// Pushing never waits: the live side is bounded, coalesced and
/// rate-capped (what it skips is announced on the live stream; the
/// captured output is complete within its cap).
pub struct OutputSink {
    capture: Capture,
    live: Option<LiveFeed>,
}

impl OutputSink {
    /// Keep up to `cap` bytes; forward to `live`, if given, as attempt `attempt`.
    pub fn new(cap: u64, live: Option<LiveOutput>, attempt: u32) -> Self {
        OutputSink {
            capture: Capture::new(cap),
            live: live.map(|live| LiveFeed {
                live,
                attempt,
                tx: None,
                task: None,
                tokens: LIVE_BURST,
                refilled: std::time::Instant::now(),
                skipped: 0,
            }),
        }
    }

    /// Take a chunk of output.
    pub fn push(&mut self, kind: StreamKind, data: &[u8]) {
        self.capture.push(data);
        if let Some(l) = &mut self.live {
            l.push(kind, data);
        }
    }

    /// The captured output, once the live side has published everything.
    pub async fn finish(mut self) -> Captured {
        if let Some(l) = self.live.take() {
            l.finish().await;
        }
        self.capture.finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fits_whole() {
        let mut c = Capture::new(100);
        c.push(b"hello ");
        c.push(b"world");
        let r = c.finish();
        assert_eq!(r.text, "hello world");
        assert!(!r.truncated);
        assert_eq!(r.total_bytes, 11);
    }

    #[test]
    fn keeps_head_and_tail() {
        let mut c = Capture::new(10);
        for i in 0..1000u32 {
            c.push(format!("{}", i % 10).as_bytes());
        }
        let r = c.finish();
        assert!(r.truncated);
        assert_eq!(r.total_bytes, 1000);
        assert!(r.text.starts_with("01234"), "{}", r.text);
        assert!(r.text.ends_with("56789"), "{}", r.text);
    }

    #[test]
    fn large_chunk_and_utf8_boundaries() {
        let mut c = Capture::new(9);
        let s = "ééééééééééééé"; // 2 bytes each
        c.push(s.as_bytes());
        let r = c.finish();
        assert!(r.truncated);
        assert!(!r.text.contains('\u{FFFD}'), "{:?}", r.text);
        assert!(r.text.starts_with("éé"));
        assert!(r.text.ends_with("éé"));
    }

    #[test]
    fn shrink_keeps_valid_utf8() {
        let c = Captured {
            text: "€".repeat(1000),
            truncated: false,
            total_bytes: 3000,
        };
        let s = shrink(&c, 101);
        assert!(s.text.len() <= 101);
        assert!(s.truncated);
        assert!(!s.text.contains('\u{FFFD}'));
    }
}
