//! `jetworker cancel <id>`: put key `<id>` in KV `cancel` (the value is
//! the reason), then wait briefly for the task's final result and say what
//! happened: a running attempt stopped, a queued task will not start, or
//! the task had already finished.
//!
//! Exit 0 when the cancellation took effect or is in place for a task that
//! has not started; 1 when the task had already finished (nothing to
//! cancel) or a running attempt ended with another status; 2 on errors.

use std::time::Duration;

use anyhow::{bail, Context as _};
use clap::Args;

use super::common::Conn;
use super::output;
use super::Exit;
use crate::protocol::{parse_duration, valid_id, Status};

#[derive(Debug, Clone, Args)]
pub struct CancelArgs {
    /// Task id.
    pub id: String,
    /// Why; stored as the key's value and shown in the result's error.
    #[arg(long, short = 'r')]
    pub reason: Option<String>,
    /// How long to wait for a running attempt to stop (covers the
    /// worker's kill grace).
    #[arg(long, default_value = "15s", value_name = "DURATION")]
    pub wait: String,
}

/// The worker running `id`, from the heartbeats (`tasks` lists them).
async fn running_on(conn: &Conn, id: &str) -> Option<String> {
    let store = conn
        .js
        .get_key_value(&conn.names.workers_bucket)
        .await
        .ok()?;
    let all = super::workers::list(&store).await.ok()?;
    all.into_iter()
        .find(|hb| hb.tasks.iter().any(|t| t == id))
        .map(|hb| hb.id)
}

pub async fn run(ctx: &super::Ctx, args: CancelArgs) -> anyhow::Result<Exit> {
    if !valid_id(&args.id) {
        bail!("`{}` is not a task id ([A-Za-z0-9_-]{{1,128}})", args.id);
    }
    let wait = parse_duration(&args.wait).map_err(|e| anyhow::anyhow!("--wait: {e}"))?;
    let conn = Conn::open(ctx).await?;
    let results = conn.ensure_results().await?;
    if let Some(r) = conn.last_result(&results, &args.id).await? {
        if r.is_final {
            output::line(&format!(
                "{} already finished: {}; nothing to cancel",
                args.id, r.status
            ))?;
            return Ok(Exit::NotSucceeded);
        }
    }
    let since_seq = conn.results_last_seq().await;
    let worker = running_on(&conn, &args.id).await;
    let store = match conn.js.get_key_value(&conn.names.cancel_bucket).await {
        Ok(s) => s,
        Err(_) => conn.ensure_infra().await?.cancel,
    };
    store
        .put(&args.id, args.reason.clone().unwrap_or_default().into())
        .await
        .with_context(|| format!("cannot store the cancellation of {}", args.id))?;

    // A queued task is cancelled when a worker pulls it, which may be much
    // later: only wait long for a task that is running. Heartbeats lag the
    // start of a task by up to one interval, so a task not listed yet gets
    // a short wait and a second look.
    let ids = [args.id.clone()];
    let start = tokio::time::Instant::now();
    let first = if worker.is_some() {
        wait
    } else {
        wait.min(Duration::from_secs(6))
    };
    let mut done = conn
        .wait_finals(&ids, since_seq, Some(start + first), |_| {})
        .await?;
    let worker = match worker {
        Some(w) => Some(w),
        None => running_on(&conn, &args.id).await,
    };
    if done.is_empty() && worker.is_some() && first < wait {
        done = conn
            .wait_finals(&ids, since_seq, Some(start + wait), |_| {})
            .await?;
    }
    match (done.get(&args.id), worker) {
        (Some(r), Some(w)) if r.status == Status::Cancelled => {
            output::line(&format!(
                "{}: cancelled; the running attempt on {w} stopped after {}",
                args.id,
                output::short_duration(Duration::from_millis(r.duration_ms))
            ))?;
            Ok(Exit::Ok)
        }
        (Some(r), None) if r.status == Status::Cancelled => {
            output::line(&format!("{}: cancelled before it ran", args.id))?;
            Ok(Exit::Ok)
        }
        (Some(r), _) => {
            output::line(&format!(
                "{}: finished as {} before the cancellation took effect",
                args.id, r.status
            ))?;
            Ok(Exit::NotSucceeded)
        }
        (None, Some(w)) => {
            output::line(&format!(
                "{}: cancellation requested; the attempt on {w} has not reported stopping within {}",
                args.id,
                humantime::format_duration(wait)
            ))?;
            Ok(Exit::NotSucceeded)
        }
        (None, None) => {
            output::line(&format!(
                "{}: cancellation requested; the task is not running, so it will not start",
                args.id
            ))?;
            Ok(Exit::Ok)
        }
    }
}
