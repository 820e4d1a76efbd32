//! `jetworker logs <id>`: the output of a task. Without `--follow`, the
//! output stored in its latest result. With `--follow`, the live output the
//! worker publishes on core NATS `logs.<id>` while the task runs (raw
//! chunks, header `Jetworker-Stream: stdout|stderr`, a final empty message
//! with `Jetworker-Stream: eof`), written to this process's stdout and
//! stderr as it arrives; it ends at `eof` or when a final result for the
//! id appears. Live output is not stored: a follower sees what is published
//! after it subscribed (a finished task's stored output is shown instead).
//!
//! Exit code: 0 when the task's final result is `success` (or unknown when
//! following ends), 1 when it is another status, 2 on errors.

use std::io::Write;
use std::time::Duration;

use anyhow::{bail, Context as _};
use clap::Args;
use futures::StreamExt;

use super::common::{header, Conn};
use super::Exit;
use crate::protocol::{valid_id, Status, TaskResult};

use crate::protocol::HEADER_FINAL;
/// Header naming the stream of a live-output chunk (`stdout`, `stderr`,
/// or `eof` on the last, empty message of an attempt).
pub use crate::protocol::HEADER_STREAM;

#[derive(Debug, Clone, Args)]
pub struct LogsArgs {
    /// Task id.
    pub id: String,
    /// Stream the live output until the task ends.
    #[arg(long, short = 'F')]
    pub follow: bool,
}

fn exit_for(r: Option<&TaskResult>) -> Exit {
    match r {
        Some(r) if r.is_final && r.status != Status::Success => Exit::NotSucceeded,
        _ => Exit::Ok,
    }
}

fn print_stored(r: &TaskResult) -> anyhow::Result<()> {
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
        print_stored(&r)?;
        return Ok(exit_for(Some(&r)));
    }

    // Subscribe before looking at the results, so nothing falls between.
    let mut sub = conn
        .client
        .subscribe(conn.names.logs_subject(&args.id))
        .await
        .context("cannot subscribe to the live output")?;
    conn.client.flush().await.context("cannot subscribe")?;
    let since_seq = conn.results_last_seq().await;
    let results = conn.ensure_results().await?;
    if let Some(r) = conn.last_result(&results, &args.id).await? {
        if r.is_final {
            eprintln!(
                "jetworker: {} already finished ({}); its stored output:",
                args.id, r.status
            );
            print_stored(&r)?;
            return Ok(exit_for(Some(&r)));
        }
    }

    // The final result, watched beside the live output.
    let (tx, mut final_rx) = tokio::sync::oneshot::channel::<TaskResult>();
    let watcher = {
        let ids = vec![args.id.clone()];
        let conn = conn.clone();
        tokio::spawn(async move {
            let mut tx = Some(tx);
            let _ = conn
                .wait_finals(&ids, since_seq, None, |r| {
                    if let Some(tx) = tx.take() {
                        let _ = tx.send(r.clone());
                    }
                })
                .await;
        })
    };

    let mut final_result = None;
    loop {
        tokio::select! {
            m = sub.next() => {
                let Some(m) = m else { break };
                let stream = header(m.headers.as_ref(), HEADER_STREAM);
                match stream.as_deref() {
                    // A retry follows: keep following the next attempt.
                    Some("eof") if header(m.headers.as_ref(), HEADER_FINAL).as_deref() == Some("false") => {}
                    Some("eof") => break,
                    Some("stderr") => {
                        let mut e = std::io::stderr().lock();
                        e.write_all(&m.payload)?;
                        e.flush()?;
                    }
                    _ => {
                        let mut o = std::io::stdout().lock();
                        o.write_all(&m.payload)?;
                        o.flush()?;
                    }
                }
            }
            r = &mut final_rx, if final_result.is_none() => {
                match r {
                    Ok(r) => {
                        final_result = Some(r);
                        // Chunks published just before the result may still
                        // be on their way: take what comes in a moment.
                        drain(&mut sub, Duration::from_millis(300)).await?;
                        break;
                    }
                    Err(_) => break,
                }
            }
        }
    }
    if final_result.is_none() {
        // Ended at eof: the attempt's result follows its output closely.
        if let Ok(Ok(r)) = tokio::time::timeout(Duration::from_secs(2), final_rx).await {
            final_result = Some(r);
        }
    }
    watcher.abort();
    Ok(exit_for(final_result.as_ref()))
}

/// Print chunks that arrive within `quiet` of each other, then stop.
async fn drain(sub: &mut async_nats::Subscriber, quiet: Duration) -> anyhow::Result<()> {
    while let Ok(Some(m)) = tokio::time::timeout(quiet, sub.next()).await {
        match header(m.headers.as_ref(), HEADER_STREAM).as_deref() {
            Some("eof") => break,
            Some("stderr") => std::io::stderr().lock().write_all(&m.payload)?,
            _ => {
                let mut o = std::io::stdout().lock();
                o.write_all(&m.payload)?;
                o.flush()?;
            }
        }
    }
    Ok(())
}
