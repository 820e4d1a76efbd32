//! JetStream plumbing shared by the operator subcommands: a connection with
//! its JetStream context and names, publishing that creates the streams on
//! first use, reading results back, and an ordered reader that knows when it
//! has caught up with a stream (so "list then follow" is one loop).

use std::time::Duration;

use anyhow::{anyhow, Context as _};
use async_nats::jetstream::{
    self,
    consumer::{pull::OrderedConfig, DeliverPolicy},
    context::{GetStreamErrorKind, PublishErrorKind},
    message::PublishMessage,
    stream::{DirectGetErrorKind, Stream},
};
use async_nats::HeaderMap;
use chrono::{DateTime, Utc};
use futures::StreamExt;

use crate::protocol::{Names, TaskResult};
use crate::setup::{ensure_all, SetupOptions};

/// One connection for one command.
#[derive(Clone)]
pub struct Conn {
    pub client: async_nats::Client,
    pub js: jetstream::Context,
    pub names: Names,
}

impl Conn {
    /// Connect with the command's settings (fails fast, exit 2).
    pub async fn open(ctx: &super::Ctx) -> anyhow::Result<Conn> {
        let client = ctx.client().await?;
        let js = crate::connect::jetstream(client.clone(), &ctx.connect);
        Ok(Conn {
            client,
            js,
            names: ctx.connect.names.clone(),
        })
    }

    /// Create the streams and buckets a worker would create, with the
    /// defaults, where they are missing (never changing existing ones).
    pub async fn ensure_infra(&self) -> anyhow::Result<crate::setup::Infra> {
        ensure_all(&self.js, &self.names, &SetupOptions::default())
            .await
            .context("cannot create the jetworker streams (or run `jetworker setup` with an account that may)")
    }

    /// A stream that must exist; the error says how to make it.
    pub async fn stream(&self, name: &str) -> anyhow::Result<Stream> {
        match self.js.get_stream(name).await {
            Ok(s) => Ok(s),
            Err(e) => match e.kind() {
                GetStreamErrorKind::JetStream(j)
                    if j.error_code() == jetstream::ErrorCode::STREAM_NOT_FOUND =>
                {
                    Err(anyhow!(
                        "stream {name} does not exist yet (start a worker or run `jetworker setup`)"
                    ))
                }
                _ => Err(anyhow!(e).context(format!("cannot read stream {name}"))),
            },
        }
    }

    /// Publish with an optional message id and headers and wait for the
    /// PubAck. When no stream holds the subject yet, the streams are
    /// created (as a worker would) and the publish is tried once more, so a
    /// task submitted before the first worker starts is queued, not lost.
    pub async fn publish(
        &self,
        subject: &str,
        payload: Vec<u8>,
        msg_id: Option<&str>,
        headers: Option<HeaderMap>,
    ) -> anyhow::Result<jetstream::publish::PublishAck> {
        let mut m = PublishMessage::build().payload(payload.into());
        if let Some(h) = headers {
            m = m.headers(h);
        }
        if let Some(id) = msg_id {
            m = m.message_id(id);
        }
        let mut created = false;
        loop {
            let res = match self.js.send_publish(subject.to_string(), m.clone()).await {
                Ok(ack) => ack.await,
                Err(e) => Err(e),
            };
            match res {
                Ok(a) => return Ok(a),
                Err(e) if e.kind() == PublishErrorKind::StreamNotFound && !created => {
                    self.ensure_infra().await?;
                    created = true;
                }
                Err(e) => return Err(anyhow!(e).context(format!("cannot publish to {subject}"))),
            }
        }
    }

    /// The last result stored for `id`, if any.
    pub async fn last_result(
        &self,
        results: &Stream,
        id: &str,
    ) -> anyhow::Result<Option<TaskResult>> {
        match results
            .direct_get_last_for_subject(self.names.result_subject(id))
            .await
        {
            Ok(m) => Ok(Some(parse_result(&m.payload)?)),
            Err(e) if e.kind() == DirectGetErrorKind::NotFound => Ok(None),
            Err(e) => Err(anyhow!(e).context(format!("cannot read the result of {id}"))),
        }
    }

    /// Every result stored for `id` (one per attempt), oldest first.
    pub async fn all_results(&self, results: &Stream, id: &str) -> anyhow::Result<Vec<TaskResult>> {
        let subject = self.names.result_subject(id);
        let mut out = Vec::new();
        let mut seq = 0u64;
        loop {
            match results
                .direct_get_next_for_subject(subject.clone(), Some(seq + 1))
                .await
            {
                Ok(m) => {
                    seq = m.sequence;
                    out.push(parse_result(&m.payload)?);
                }
                Err(e) if e.kind() == DirectGetErrorKind::NotFound => return Ok(out),
                Err(e) => {
                    return Err(anyhow!(e).context(format!("cannot read the results of {id}")))
                }
            }
        }
    }
}

/// Parse a result message; the error says it is one.
pub fn parse_result(bytes: &[u8]) -> anyhow::Result<TaskResult> {
    serde_json::from_slice(bytes).context("a result message is not valid result JSON")
}

pub use crate::protocol::header;

/// One message read by an [`OrderedReader`].
pub struct Read {
    pub subject: String,
    pub headers: Option<HeaderMap>,
    pub payload: bytes::Bytes,
    pub sequence: u64,
    pub time: DateTime<Utc>,
    /// Messages still pending when this one was delivered: 0 means the
    /// reader has caught up with the stream.
    pub pending: u64,
}

/// An ordered (ephemeral, flow-controlled) consumer over a stream.
pub struct OrderedReader {
    messages: jetstream::consumer::pull::Ordered,
    /// No message was pending when the consumer was created.
    pub empty_at_start: bool,
}

impl OrderedReader {
    /// Read `filters` of `stream` from `deliver`.
    pub async fn open(
        stream: &Stream,
        filters: Vec<String>,
        deliver: DeliverPolicy,
    ) -> anyhow::Result<OrderedReader> {
        let mut cfg = OrderedConfig {
            deliver_policy: deliver,
            ..Default::default()
        };
        if filters.len() == 1 {
            cfg.filter_subject = filters.into_iter().next().unwrap_or_default();
        } else {
            cfg.filter_subjects = filters;
        }
        let consumer = stream
            .create_consumer(cfg)
            .await
            .context("cannot create a reader on the stream")?;
        let empty_at_start = consumer.cached_info().num_pending == 0;
        let messages = consumer
            .messages()
            .await
            .context("cannot read the stream")?;
        Ok(OrderedReader {
            messages,
            empty_at_start,
        })
    }

    /// The next message (waits for one).
    pub async fn next(&mut self) -> anyhow::Result<Option<Read>> {
        match self.messages.next().await {
            None => Ok(None),
            Some(Err(e)) => Err(anyhow!(e).context("reading the stream")),
            Some(Ok(m)) => {
                let info = m.info().map_err(|e| anyhow!("bad message metadata: {e}"))?;
                let sequence = info.stream_sequence;
                let pending = info.pending;
                let time = super::output::chrono_time(info.published);
                Ok(Some(Read {
                    subject: m.subject.to_string(),
                    headers: m.headers.clone(),
                    payload: m.payload.clone(),
                    sequence,
                    time,
                    pending,
                }))
            }
        }
    }

    /// The next message, or `None` at `deadline` (or when the reader ends).
    pub async fn next_before(
        &mut self,
        deadline: Option<tokio::time::Instant>,
    ) -> anyhow::Result<Option<Read>> {
        match deadline {
            Some(d) => match tokio::time::timeout_at(d, self.next()).await {
                Ok(r) => r,
                Err(_) => Ok(None),
            },
            None => self.next().await,
        }
    }

    /// Every message up to the end of the stream as it was when the reader
    /// was opened (or a little later), then stop.
    pub async fn read_to_end(&mut self) -> anyhow::Result<Vec<Read>> {
        let mut out = Vec::new();
        if self.empty_at_start {
            return Ok(out);
        }
        // A message deleted while we read (WorkQueue, purge, max age) can
        // leave `pending` above zero for good: a quiet stream also ends it.
        while let Ok(r) = tokio::time::timeout(Duration::from_secs(2), self.next()).await {
            let Some(r) = r? else { break };
            let done = r.pending == 0;
            out.push(r);
            if done {
                break;
            }
        }
        Ok(out)
    }
}

/// Wait-for-results: how many ids one reader may filter on by subject;
/// more are read from the whole result stream and picked out here.
const MAX_FILTERS: usize = 256;

impl Conn {
    /// Wait until every id in `ids` has a final result (or `deadline`
    /// passes), calling `on_final` for each as it arrives. See
    /// [`Conn::wait_results`].
    pub async fn wait_finals(
        &self,
        ids: &[String],
        since_seq: u64,
        deadline: Option<tokio::time::Instant>,
        mut on_final: impl FnMut(&TaskResult),
    ) -> anyhow::Result<std::collections::BTreeMap<String, TaskResult>> {
        self.wait_results(ids, since_seq, deadline, |r| {
            if r.is_final {
                on_final(r)
            }
        })
        .await
    }

    /// Wait until every id in `ids` has a final result (or `deadline`
    /// passes), calling `on_result` for each result of a pending id as it
    /// arrives (non-final ones too: a retry is news to a waiter). Results stored
    /// before the call count (a duplicate submit of a finished id is
    /// answered by its old result, as the worker would answer it).
    /// `since_seq` is the RESULTS sequence before the tasks were published;
    /// it bounds the read when there are too many ids to filter by subject.
    pub async fn wait_results(
        &self,
        ids: &[String],
        since_seq: u64,
        deadline: Option<tokio::time::Instant>,
        mut on_result: impl FnMut(&TaskResult),
    ) -> anyhow::Result<std::collections::BTreeMap<String, TaskResult>> {
        let results = self.ensure_results().await?;
        let mut pending: std::collections::BTreeSet<&str> =
            ids.iter().map(String::as_str).collect();
        let mut done = std::collections::BTreeMap::new();
        // Results stored before the submit (a finished id submitted again)
        // are read once; everything after it in order, so that no retry
        // note stored before the reader opened is missed.
        for id in ids {
            let last = match results
                .direct_get_last_for_subject(self.names.result_subject(id))
                .await
            {
                Ok(m) if m.sequence <= since_seq => m,
                Ok(_) => continue, // stored since: the reader below has it
                Err(e) if e.kind() == DirectGetErrorKind::NotFound => continue,
                Err(e) => return Err(anyhow!(e).context(format!("cannot read the result of {id}"))),
            };
            let Ok(r) = parse_result(&last.payload) else {
                continue;
            };
            if r.is_final && pending.remove(id.as_str()) {
                on_result(&r);
                done.insert(id.clone(), r);
            }
        }
        let filters = if ids.len() <= MAX_FILTERS {
            ids.iter().map(|i| self.names.result_subject(i)).collect()
        } else {
            vec![format!("{}.>", self.names.results_prefix)]
        };
        let mut reader = OrderedReader::open(
            &results,
            filters,
            DeliverPolicy::ByStartSequence {
                start_sequence: since_seq + 1,
            },
        )
        .await?;
        while !pending.is_empty() {
            let Some(m) = reader.next_before(deadline).await? else {
                break;
            };
            let Ok(r) = parse_result(&m.payload) else {
                continue;
            };
            if !pending.contains(r.id.as_str()) {
                continue;
            }
            on_result(&r);
            if r.is_final {
                pending.remove(r.id.as_str());
                done.insert(r.id.clone(), r);
            }
        }
        Ok(done)
    }

    /// The result stream, created (as a worker would) if it is missing, so
    /// that a waiter started before any worker does not fail.
    pub async fn ensure_results(&self) -> anyhow::Result<Stream> {
        match self.stream(&self.names.results_stream).await {
            Ok(s) => Ok(s),
            Err(_) => Ok(self.ensure_infra().await?.results),
        }
    }

    /// The last sequence of the result stream (0 when it is missing).
    pub async fn results_last_seq(&self) -> u64 {
        match self.js.get_stream(&self.names.results_stream).await {
            Ok(mut s) => s.info().await.map(|i| i.state.last_sequence).unwrap_or(0),
            Err(_) => 0,
        }
    }
}
