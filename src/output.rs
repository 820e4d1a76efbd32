//! Bounded capture of a task's output: whatever a task prints, memory stays
//! within the cap. The head and the tail are kept; the result text is cut on
//! UTF-8 boundaries. Chunks are also handed to the live-output publisher.

use bytes::Bytes;

use crate::protocol::{HEADER_FINAL, HEADER_STREAM};

/// Which stream a chunk came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StreamKind {
    Stdout,
    Stderr,
}

impl StreamKind {
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
    pub text: String,
    pub truncated: bool,
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

    /// Total bytes pushed.
    pub fn total(&self) -> u64 {
        self.total
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

/// Publishes live output chunks on `logs.<id>` (core NATS, best effort:
/// nobody may be listening, and nothing is stored).
#[derive(Clone)]
pub struct LiveOutput {
    client: async_nats::Client,
    subject: async_nats::Subject,
}

impl LiveOutput {
    pub fn new(client: async_nats::Client, subject: String) -> Self {
        LiveOutput {
            client,
            subject: subject.into(),
        }
    }

    /// Publish one chunk with a `Jetworker-Stream` header.
    pub async fn send(&self, kind: StreamKind, data: Bytes) {
        let mut h = async_nats::HeaderMap::new();
        h.insert(HEADER_STREAM, kind.as_str());
        let _ = self
            .client
            .publish_with_headers(self.subject.clone(), h, data)
            .await;
    }

    /// Tell followers this attempt's output is complete, and whether its
    /// result is final (no retry follows).
    pub async fn end(&self, is_final: bool) {
        let mut h = async_nats::HeaderMap::new();
        h.insert(HEADER_STREAM, "eof");
        h.insert(HEADER_FINAL, if is_final { "true" } else { "false" });
        let _ = self
            .client
            .publish_with_headers(self.subject.clone(), h, Bytes::new())
            .await;
    }
}

/// Capture plus optional live forwarding; what runners write output to.
pub struct OutputSink {
    capture: Capture,
    live: Option<LiveOutput>,
}

impl OutputSink {
    pub fn new(cap: u64, live: Option<LiveOutput>) -> Self {
        OutputSink {
            capture: Capture::new(cap),
            live,
        }
    }

    pub async fn push(&mut self, kind: StreamKind, data: &[u8]) {
        self.capture.push(data);
        if let Some(l) = &self.live {
            l.send(kind, Bytes::copy_from_slice(data)).await;
        }
    }

    pub fn finish(&self) -> Captured {
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
