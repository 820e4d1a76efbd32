//! One task's live output as server-sent events: what `jetworker logs -f`
//! follows (the logs stream from its start, so a late page sees the output
//! so far; a plain subscription where there is no logs stream), read with
//! the same code, until the task's final result is stored. Then the page
//! shows the stored output of every attempt instead. An attempt that ended
//! before its first live flush published nothing live (`"live": false` in
//! its record): its stored output is sent as its chunk.
//!
//! Events (JSON data): `chunk` `{attempt, stream, data}`, `skipped`
//! `{attempt, bytes}`, `eof` `{final}` at the end of each attempt,
//! `final` `{status, attempt}` last, and `error` `{message}`.

use std::convert::Infallible;
use std::time::Duration;

use axum::response::sse::Event;
use futures::Stream;
use serde_json::json;
use tokio::sync::mpsc;

use crate::commands::common::Conn;
use crate::commands::logs::{self, FollowSink, Followed, Live, LiveMsg, RecordWatch, Seen};
use crate::protocol::TaskResult;

/// Events a slow page may have outstanding before the reader waits.
const BUFFER: usize = 256;

fn event(name: &'static str, v: serde_json::Value) -> Event {
    Event::default().event(name).data(v.to_string())
}

/// The event stream for task `id`; it ends after `final` (or when the
/// page goes away: the reader stops at its next send).
pub(crate) fn follow(conn: Conn, id: String) -> impl Stream<Item = Result<Event, Infallible>> {
    let (tx, rx) = mpsc::channel::<Event>(BUFFER);
    tokio::spawn(async move {
        if let Err(e) = run(&conn, &id, &tx).await {
            let _ = tx
                .send(event("error", json!({ "message": format!("{e:#}") })))
                .await;
        }
    });
    futures::stream::unfold(
        rx,
        |mut rx| async move { rx.recv().await.map(|e| (Ok(e), rx)) },
    )
}

/// An attempt that never went live (`live: false`), as the live events
/// it would have made: its stored output as one chunk, and its `eof`.
async fn stored_attempt(tx: &mpsc::Sender<Event>, r: &TaskResult) -> Result<(), ()> {
    if !r.output.is_empty() {
        let chunk = json!({ "attempt": r.attempt, "stream": "stdout", "data": r.output });
        tx.send(event("chunk", chunk)).await.map_err(|_| ())?;
    }
    tx.send(event("eof", json!({ "final": r.is_final })))
        .await
        .map_err(|_| ())
}

fn final_event(r: &TaskResult) -> Event {
    event("final", json!({ "status": r.status, "attempt": r.attempt }))
}

/// Send one live message; `Some(final)` at an `eof`.
async fn forward(
    tx: &mpsc::Sender<Event>,
    headers: Option<&async_nats::HeaderMap>,
    payload: &[u8],
) -> Result<Option<bool>, ()> {
    let (e, eof) = match LiveMsg::parse(headers, payload) {
        LiveMsg::Output {
            attempt,
            stream,
            data,
        } => (
            event(
                "chunk",
                json!({
                    "attempt": attempt,
                    "stream": stream,
                    "data": String::from_utf8_lossy(data),
                }),
            ),
            None,
        ),
        LiveMsg::Skipped { attempt, bytes } => (
            event("skipped", json!({ "attempt": attempt, "bytes": bytes })),
            None,
        ),
        LiveMsg::Eof { is_final } => (event("eof", json!({ "final": is_final })), Some(is_final)),
    };
    tx.send(e).await.map_err(|_| ())?;
    Ok(eof)
}

/// The page's end of [`logs::follow`]: every message becomes an event; a send
/// that fails means the page went away.
struct Page<'a>(&'a mpsc::Sender<Event>);

impl FollowSink for Page<'_> {
    async fn stored_attempt(&mut self, r: &TaskResult) -> anyhow::Result<Seen> {
        Ok(match stored_attempt(self.0, r).await {
            Ok(()) => Seen::More,
            Err(()) => Seen::Gone,
        })
    }

    async fn live(
        &mut self,
        headers: Option<&async_nats::HeaderMap>,
        payload: &[u8],
    ) -> anyhow::Result<Seen> {
        Ok(match forward(self.0, headers, payload).await {
            Ok(None) => Seen::More,
            Ok(Some(is_final)) => Seen::Eof { is_final },
            Err(()) => Seen::Gone,
        })
    }
}

async fn run(conn: &Conn, id: &str, tx: &mpsc::Sender<Event>) -> anyhow::Result<()> {
    // Attach before looking at the results, so nothing falls between.
    let mut live = Live::open(conn, id).await?;
    if let Ok(results) = conn.stream(&conn.names.results_stream).await {
        if let Some(r) = conn.last_result(&results, id).await? {
            if r.is_final {
                let _ = tx.send(final_event(&r)).await;
                return Ok(());
            }
        }
    }
    let mut watch = RecordWatch::start(conn, id).await?;
    let outcome = logs::follow(&mut live, &mut watch, &mut Page(tx)).await;
    let r = match outcome? {
        Followed::Final(r) => Some(*r),
        // The final attempt's result follows its output.
        Followed::FinalEof => watch.final_within(Duration::from_secs(5)).await,
        Followed::Over => None,
    };
    drop(watch);
    match r {
        Some(r) => {
            let _ = tx.send(final_event(&r)).await;
        }
        None => {
            let _ = tx.send(event("final", json!({}))).await;
        }
    }
    Ok(())
}
