//! `jetworker logs <id>`: the output of a task. Without `--follow`, the
//! output stored in its latest result. With `--follow` (`-f`), the live
//! output the worker publishes on `logs.<id>` (coalesced chunks, header
//! `Jetworker-Stream: stdout|stderr`, `skipped` when the rate cap dropped
//! some, and an empty `eof` message ending each attempt), written to this
//! process's stdout and stderr as it arrives.
//!
//! A follower that attaches late still gets the output so far: the logs
//! stream keeps the recent messages of every `logs.<id>` subject and the
//! follower reads them from the start (without that stream, only what is
//! published after it subscribed). Between attempts it prints a separator
//! on stderr, and at the end the final status. Once its subscription is in
//! place it prints the ready line `jetworker: following <id>` on stderr.
//! It ends at the final attempt's `eof` or when a final result appears.
//! An attempt that ended before its first live flush published nothing
//! live (its record says `"live": false`): the follower prints the output
//! stored in that record instead, so every attempt's output shows once.
//!
//! `--json`: one JSON object per line, all of the same shape
//! ([`LogLine`]): `event` is `output`, `skipped`, `attempt_end` or
//! `result`.
//!
//! Exit code: 0 when the task's final result is `success` (or unknown when
//! following ends), 1 when it is another status, 2 on errors.

use std::io::Write;
use std::time::Duration;

use anyhow::{bail, Context as _};
use async_nats::jetstream::consumer::DeliverPolicy;
use clap::Args;
use futures::StreamExt;
use serde::Serialize;

use super::common::{header, parse_result, Conn, OrderedReader};
use super::Exit;
use crate::output::{logs_stream_name, HEADER_ATTEMPT, HEADER_SKIPPED};
use crate::protocol::{valid_id, Status, TaskResult};

use crate::protocol::HEADER_FINAL;
/// Header naming the stream of a live-output chunk (`stdout`, `stderr`,
/// `skipped`, or `eof` on the last, empty message of an attempt).
pub use crate::protocol::HEADER_STREAM;

#[derive(Debug, Clone, Args)]
pub struct LogsArgs {
    /// Task id.
    pub id: String,
    /// Stream the live output until the task ends (from its start, if the
    /// worker's logs stream still has it).
    #[arg(long, short = 'f', visible_short_alias = 'F')]
    pub follow: bool,
    /// One JSON object per line instead of raw output.
    #[arg(long)]
    pub json: bool,
}

/// One line of `logs --json`; every line has every field.
#[derive(Debug, Serialize, PartialEq)]
pub struct LogLine {
    pub id: String,
    /// `output`, `skipped`, `attempt_end` or `result`.
    pub event: &'static str,
    pub attempt: Option<u32>,
    /// `stdout` or `stderr` for `output`.
    pub stream: Option<String>,
    /// The output text (`output`; the stored output for a `result` read
    /// without `--follow`).
    pub data: Option<String>,
    /// Bytes left off the live stream (`skipped`).
    pub bytes: Option<u64>,
    /// Whether no retry follows (`attempt_end`, `result`).
    pub r#final: Option<bool>,
    /// The result's status and error (`result`).
    pub status: Option<String>,
    pub error: Option<String>,
}

impl LogLine {
    fn new(id: &str, event: &'static str) -> Self {
        LogLine {
            id: id.to_string(),
            event,
            attempt: None,
            stream: None,
            data: None,
            bytes: None,
            r#final: None,
            status: None,
            error: None,
        }
    }

    fn result(r: &TaskResult, with_output: bool) -> Self {
        LogLine {
            attempt: Some(r.attempt),
            data: with_output.then(|| r.output.clone()),
            r#final: Some(r.is_final),
            status: Some(r.status.as_str().to_string()),
            error: r.error.clone(),
            ..LogLine::new(&r.id, "result")
        }
    }
}

fn exit_for(r: Option<&TaskResult>) -> Exit {
    match r {
        Some(r) if r.is_final && r.status != Status::Success => Exit::NotSucceeded,
        _ => Exit::Ok,
    }
}

/// Where lines go: raw output to stdout/stderr, or JSON lines.
struct Printer {
    id: String,
    json: bool,
    /// The attempt whose output was printed last.
    attempt: Option<u32>,
}

impl Printer {
    fn line(&self, l: &LogLine) -> anyhow::Result<()> {
        let mut o = std::io::stdout().lock();
        serde_json::to_writer(&mut o, l)?;
        o.write_all(b"\n")?;
        o.flush()?;
        Ok(())
    }

    fn output(&mut self, attempt: Option<u32>, stream: &str, data: &[u8]) -> anyhow::Result<()> {
        if self.json {
            return self.line(&LogLine {
                attempt,
                stream: Some(stream.to_string()),
                data: Some(String::from_utf8_lossy(data).into_owned()),
                ..LogLine::new(&self.id, "output")
            });
        }
        if let Some(a) = attempt {
            if self.attempt.is_some_and(|prev| prev != a) || (self.attempt.is_none() && a > 1) {
                eprintln!("jetworker: ── attempt {a} ──");
            }
            self.attempt = Some(a);
        }
        if stream == "stderr" {
            let mut e = std::io::stderr().lock();
            e.write_all(data)?;
            e.flush()?;
        } else {
            let mut o = std::io::stdout().lock();
            o.write_all(data)?;
            o.flush()?;
        }
        Ok(())
    }

    fn skipped(&self, attempt: Option<u32>, bytes: u64) -> anyhow::Result<()> {
        if self.json {
            return self.line(&LogLine {
                attempt,
                bytes: Some(bytes),
                ..LogLine::new(&self.id, "skipped")
            });
        }
        eprintln!(
            "jetworker: [{bytes} bytes of live output skipped (rate cap); the result keeps them]"
        );
        Ok(())
    }

    fn attempt_end(&self, is_final: bool) -> anyhow::Result<()> {
        if self.json {
            return self.line(&LogLine {
                attempt: self.attempt,
                r#final: Some(is_final),
                ..LogLine::new(&self.id, "attempt_end")
            });
        }
        if !is_final {
            eprintln!("jetworker: ── attempt ended; a retry follows ──");
        }
        Ok(())
    }

    /// An attempt that never went live (`live: false`): the output its
    /// record stores, and its end.
    fn stored_attempt(&mut self, r: &TaskResult) -> anyhow::Result<()> {
        if !r.output.is_empty() {
            self.output(Some(r.attempt), "stdout", r.output.as_bytes())?;
        }
        self.attempt = Some(r.attempt);
        self.attempt_end(r.is_final)
    }

    fn result(&self, r: &TaskResult) -> anyhow::Result<()> {
        if self.json {
            return self.line(&LogLine::result(r, false));
        }
        match &r.error {
            Some(e) => eprintln!(
                "jetworker: {} {} (attempt {}): {e}",
                r.id, r.status, r.attempt
            ),
            None => eprintln!("jetworker: {} {} (attempt {})", r.id, r.status, r.attempt),
        }
        Ok(())
    }

    /// One live message; `Some(final)` at an `eof`.
    fn message(
        &mut self,
        headers: Option<&async_nats::HeaderMap>,
        payload: &[u8],
    ) -> anyhow::Result<Option<bool>> {
        match LiveMsg::parse(headers, payload) {
            LiveMsg::Eof { is_final } => {
                self.attempt_end(is_final)?;
                return Ok(Some(is_final));
            }
            LiveMsg::Skipped { attempt, bytes } => self.skipped(attempt, bytes)?,
            LiveMsg::Output {
                attempt,
                stream,
                data,
            } => self.output(attempt, stream, data)?,
        }
        Ok(None)
    }
}

/// One message of a task's live output (`logs.<id>`), read from its
/// headers: how `logs -f` and `jetworker ui` tell chunks from markers.
#[derive(Debug, PartialEq)]
pub(crate) enum LiveMsg<'a> {
    /// A chunk of output; `stream` is `stdout` or `stderr`.
    Output {
        attempt: Option<u32>,
        stream: &'static str,
        data: &'a [u8],
    },
    /// The rate cap left `bytes` off the live stream (the result has them).
    Skipped { attempt: Option<u32>, bytes: u64 },
    /// An attempt ended; `is_final`: no retry follows.
    Eof { is_final: bool },
}

impl<'a> LiveMsg<'a> {
    pub(crate) fn parse(headers: Option<&async_nats::HeaderMap>, payload: &'a [u8]) -> Self {
        let attempt = header(headers, HEADER_ATTEMPT).and_then(|a| a.parse().ok());
        match header(headers, HEADER_STREAM).as_deref() {
            Some("eof") => LiveMsg::Eof {
                is_final: header(headers, HEADER_FINAL).as_deref() != Some("false"),
            },
            Some("skipped") => LiveMsg::Skipped {
                attempt,
                bytes: header(headers, HEADER_SKIPPED)
                    .and_then(|n| n.parse().ok())
                    .unwrap_or(0),
            },
            Some("stderr") => LiveMsg::Output {
                attempt,
                stream: "stderr",
                data: payload,
            },
            _ => LiveMsg::Output {
                attempt,
                stream: "stdout",
                data: payload,
            },
        }
    }
}

fn print_stored(r: &TaskResult, json: bool) -> anyhow::Result<()> {
    if json {
        let p = Printer {
            id: r.id.clone(),
            json,
            attempt: None,
        };
        return p.line(&LogLine::result(r, true));
    }
    let mut o = std::io::stdout().lock();
    o.write_all(r.output.as_bytes())?;
    o.flush()?;
    if r.output_truncated {
        eprintln!(
            "jetworker: output truncated ({} bytes in all)",
            r.output_bytes
        );
    }
    Ok(())
}

/// A task's attempt records (not its `running`/`queued` states), from the
/// first the result stream keeps, watched in the background, until the
/// final one: what a follower needs besides the live stream — the output
/// of each attempt that never went live (`live: false`: it ended before its
/// first flush, and its record carries the output) and the final result.
/// The watch stops when this is dropped.
pub(crate) struct RecordWatch {
    pub rx: tokio::sync::mpsc::UnboundedReceiver<TaskResult>,
    task: tokio::task::JoinHandle<()>,
}

impl RecordWatch {
    pub(crate) async fn start(conn: &Conn, id: &str) -> anyhow::Result<RecordWatch> {
        let results = conn.ensure_results().await?;
        let mut reader = OrderedReader::open(
            &results,
            vec![conn.names.result_subject(id)],
            DeliverPolicy::All,
        )
        .await?;
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let task = tokio::spawn(async move {
            while let Ok(Some(m)) = reader.next().await {
                let Ok(r) = parse_result(&m.payload) else {
                    continue;
                };
                if r.is_state() {
                    continue;
                }
                let done = r.is_final;
                if tx.send(r).is_err() || done {
                    return;
                }
            }
        });
        Ok(RecordWatch { rx, task })
    }

    /// The final record, skipping the attempts before it, if it comes
    /// within `wait`.
    pub(crate) async fn final_within(&mut self, wait: Duration) -> Option<TaskResult> {
        tokio::time::timeout(wait, async {
            while let Some(r) = self.rx.recv().await {
                if r.is_final {
                    return Some(r);
                }
            }
            None
        })
        .await
        .ok()
        .flatten()
    }
}

impl Drop for RecordWatch {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Live messages: from the logs stream (from the start of what it keeps),
/// or a plain subscription where there is no such stream.
pub(crate) enum Live {
    Stream(Box<OrderedReader>),
    Core(async_nats::Subscriber),
}

impl Live {
    /// Attach to the live output of `id`, flushed so that nothing published
    /// from the return on is missed (and, with the logs stream, nothing it
    /// still keeps from before).
    pub(crate) async fn open(conn: &Conn, id: &str) -> anyhow::Result<Live> {
        let subject = conn.names.logs_subject(id);
        let live = match conn.js.get_stream(logs_stream_name(&conn.names)).await {
            Ok(s) => Live::Stream(Box::new(
                OrderedReader::open(&s, vec![subject], DeliverPolicy::All).await?,
            )),
            Err(_) => Live::Core(
                conn.client
                    .subscribe(subject)
                    .await
                    .context("cannot subscribe to the live output")?,
            ),
        };
        conn.client.flush().await.context("cannot subscribe")?;
        Ok(live)
    }

    pub(crate) async fn next(
        &mut self,
    ) -> anyhow::Result<Option<(Option<async_nats::HeaderMap>, bytes::Bytes)>> {
        Ok(match self {
            Live::Stream(r) => r.next().await?.map(|m| (m.headers, m.payload)),
            Live::Core(s) => s.next().await.map(|m| (m.headers, m.payload)),
        })
    }
}

/// How long chunks published just before a final result may still be on
/// their way to a follower.
const LATE_CHUNKS: Duration = Duration::from_millis(300);

/// What a follower's sink made of one message.
pub(crate) enum Seen {
    /// Shown; more follows.
    More,
    /// An attempt's `eof`; `is_final`: no retry follows.
    Eof { is_final: bool },
    /// Nobody is reading any more (the dashboard's page went away).
    Gone,
}

/// Where a follower shows a task's output: the terminal (`logs -f`) or a
/// dashboard page (`ui::live`).
pub(crate) trait FollowSink {
    /// An attempt that never went live (`live: false`): the output its
    /// record stores, and its end.
    async fn stored_attempt(&mut self, r: &TaskResult) -> anyhow::Result<Seen>;
    /// One message of the live stream.
    async fn live(
        &mut self,
        headers: Option<&async_nats::HeaderMap>,
        payload: &[u8],
    ) -> anyhow::Result<Seen>;
}

/// How following ended.
pub(crate) enum Followed {
    /// The final record arrived (and the live chunks just before it).
    Final(Box<TaskResult>),
    /// The final attempt's `eof` arrived; its record is close behind.
    FinalEof,
    /// The live stream or the records ended, or the sink is gone.
    Over,
}

/// The one follow loop of `logs -f` and the dashboard: the live stream and
/// the attempts' records side by side. An attempt that never went live is
/// shown from its record, before whatever follows it; at the final record,
/// chunks still on their way are taken for a moment.
pub(crate) async fn follow(
    live: &mut Live,
    records: &mut RecordWatch,
    sink: &mut impl FollowSink,
) -> anyhow::Result<Followed> {
    loop {
        tokio::select! {
            // An attempt that never went live comes before what follows it.
            biased;
            r = records.rx.recv() => {
                let Some(r) = r else { return Ok(Followed::Over) };
                if !r.live {
                    if matches!(sink.stored_attempt(&r).await?, Seen::Gone) {
                        return Ok(Followed::Over);
                    }
                } else if r.is_final {
                    while let Ok(Ok(Some((h, payload)))) =
                        tokio::time::timeout(LATE_CHUNKS, live.next()).await
                    {
                        if !matches!(sink.live(h.as_ref(), &payload).await?, Seen::More) {
                            break;
                        }
                    }
                }
                if r.is_final {
                    return Ok(Followed::Final(Box::new(r)));
                }
            }
            m = live.next() => {
                let Some((h, payload)) = m? else { return Ok(Followed::Over) };
                match sink.live(h.as_ref(), &payload).await? {
                    Seen::More | Seen::Eof { is_final: false } => {}
                    Seen::Eof { is_final: true } => return Ok(Followed::FinalEof),
                    Seen::Gone => return Ok(Followed::Over),
                }
            }
        }
    }
}

impl FollowSink for Printer {
    async fn stored_attempt(&mut self, r: &TaskResult) -> anyhow::Result<Seen> {
        Printer::stored_attempt(self, r)?;
        Ok(Seen::More)
    }

    async fn live(
        &mut self,
        headers: Option<&async_nats::HeaderMap>,
        payload: &[u8],
    ) -> anyhow::Result<Seen> {
        Ok(match self.message(headers, payload)? {
            None => Seen::More,
            Some(is_final) => Seen::Eof { is_final },
        })
    }
}

pub async fn run(ctx: &super::Ctx, args: LogsArgs) -> anyhow::Result<Exit> {
    if !valid_id(&args.id) {
        bail!("`{}` is not a task id ([A-Za-z0-9_-]{{1,128}})", args.id);
    }
    let conn = Conn::open(ctx).await?;
    if !args.follow {
        let results = conn.stream(&conn.names.results_stream).await?;
        let Some(r) = conn.last_result(&results, &args.id).await? else {
            bail!(
                "no result for {} yet; `jetworker logs --follow {}` streams the output of a running task",
                args.id,
                args.id
            );
        };
        print_stored(&r, args.json)?;
        return Ok(exit_for(Some(&r)));
    }

    // Attach before looking at the results, so nothing falls between.
    let mut live = Live::open(&conn, &args.id).await?;
    let results = conn.ensure_results().await?;
    eprintln!("jetworker: following {}", args.id);
    if let Some(r) = conn.last_result(&results, &args.id).await? {
        if r.is_final {
            eprintln!(
                "jetworker: {} already finished ({}); its stored output:",
                args.id, r.status
            );
            print_stored(&r, args.json)?;
            return Ok(exit_for(Some(&r)));
        }
    }

    // The attempts' records, watched beside the live output.
    let mut records = RecordWatch::start(&conn, &args.id).await?;

    let mut p = Printer {
        id: args.id.clone(),
        json: args.json,
        attempt: None,
    };
    let final_result = match follow(&mut live, &mut records, &mut p).await? {
        Followed::Final(r) => Some(*r),
        // Ended at eof: the attempt's result follows its output closely.
        Followed::FinalEof | Followed::Over => records.final_within(Duration::from_secs(2)).await,
    };
    if let Some(r) = &final_result {
        p.result(r)?;
    }
    Ok(exit_for(final_result.as_ref()))
}
