//! `jetworker cancel <id>`: put key `<id>` in KV `cancel` (the value is
//! the reason), then wait briefly for the task's final result and say what
//! happened, from that result: a running attempt stopped (after how long,
//! on which worker), a queued task was cancelled before it ran, or the task
//! had already finished. An id that is nowhere — no result, not running,
//! not in the queue — is refused (a stored key would silently cancel a
//! later task submitted with that id for the key's lifetime) unless
//! `--force`.
//!
//! Exit 0 when the cancellation took effect or is in place for a task that
//! has not started; 1 when the task had already finished (nothing to
//! cancel), a running attempt ended with another status, or the id is
//! unknown; 2 on errors.
//!
//! `--json`: one line `{"id","outcome","status","worker","ran_ms","message"}`
//! with `outcome` one of `cancelled`, `finished`, `requested`, `unknown`.

use std::time::Duration;

use anyhow::{bail, Context as _};
use clap::Args;
use serde::Serialize;

use super::common::Conn;
use super::output;
use super::Exit;
use crate::protocol::{parse_duration, valid_id, Status, TaskResult};

#[derive(Debug, Clone, Args)]
#[command(after_help = "\
Examples:
  jetworker cancel 3f9a2c --reason 'not needed'
  jetworker cancel nightly-2026 --force     # not submitted yet: cancel it in advance")]
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
    /// Store the cancellation even for an id that is nowhere yet.
    #[arg(long)]
    pub force: bool,
    /// Print one JSON line instead of text.
    #[arg(long)]
    pub json: bool,
}

/// What `--json` prints.
#[derive(Debug, Serialize)]
struct Outcome {
    id: String,
    /// `cancelled`, `finished`, `requested` or `unknown`.
    outcome: &'static str,
    status: Option<Status>,
    worker: Option<String>,
    /// How long the cancelled attempt ran (absent: it never started).
    ran_ms: Option<u64>,
    message: String,
}

/// The worker running `id`, from the heartbeats (`tasks` lists them).
async fn running_on(conn: &Conn, id: &str) -> Option<String> {
    let store = conn
        .js
        .get_key_value(&conn.names.workers_bucket)
        .await
        .ok()?;
    let all = crate::queues::online_workers(&store).await.ok()?;
    all.into_iter()
        .find(|hb| hb.tasks.iter().any(|t| t == id))
        .map(|hb| hb.id)
}

fn report(o: Outcome, json: bool) -> anyhow::Result<()> {
    if json {
        output::json_line(&o)
    } else {
        Ok(output::line(&o.message)?)
    }
}

/// Whether a `cancelled` result is for an attempt that never started.
fn never_ran(r: &TaskResult) -> bool {
    r.exit_code.is_none()
        && r.signal.is_none()
        && r.error
            .as_deref()
            .is_some_and(|e| e.starts_with("cancelled before it started"))
}

/// What [`request`] came to, before any waiting.
pub(crate) enum Requested {
    /// The task has a final result already: nothing was stored.
    Finished(Box<TaskResult>),
    /// No result, not running, not queued (and not `force`d): nothing was
    /// stored, since the key would cancel a later task with this id.
    Unknown,
    /// The key is stored.
    Stored {
        /// The worker running the task, where known.
        worker: Option<String>,
        /// The RESULTS sequence before the key was stored (a waiter for
        /// the final result reads from there).
        since_seq: u64,
        /// The queue was too long to look for an id with no result.
        queue_unchecked: bool,
    },
}

/// Store the cancellation of `id` (KV `cancel`, the reason as the value),
/// unless the task finished already or is unknown and not `force`d: the
/// one place that decides it, for the CLI and for `jetworker ui`.
pub(crate) async fn request(
    conn: &Conn,
    id: &str,
    reason: Option<&str>,
    force: bool,
) -> anyhow::Result<Requested> {
    if !valid_id(id) {
        bail!("`{id}` is not a task id ([A-Za-z0-9_-]{{1,128}})");
    }
    let results = conn.ensure_results().await?;
    let last = conn.last_result(&results, id).await?;
    if let Some(r) = last.as_ref().filter(|r| r.is_final) {
        return Ok(Requested::Finished(Box::new(r.clone())));
    }
    let since_seq = conn.results_last_seq().await;
    // A `running` record names the worker at once; heartbeats lag.
    let worker = match &last {
        Some(r) if r.status == Status::Running => Some(r.worker_id.clone()),
        _ => running_on(conn, id).await,
    };
    let mut queue_unchecked = false;
    if last.is_none() && worker.is_none() && !force {
        match crate::queues::find_queued(&conn.js, &conn.names, id).await? {
            crate::queues::Queued::Found { .. } => {}
            crate::queues::Queued::Absent => return Ok(Requested::Unknown),
            crate::queues::Queued::NotSearched => queue_unchecked = true,
        }
    }
    let store = match conn.js.get_key_value(&conn.names.cancel_bucket).await {
        Ok(s) => s,
        Err(_) => conn.ensure_infra().await?.cancel,
    };
    store
        .put(id, reason.unwrap_or_default().to_string().into())
        .await
        .with_context(|| format!("cannot store the cancellation of {id}"))?;
    Ok(Requested::Stored {
        worker,
        since_seq,
        queue_unchecked,
    })
}

pub async fn run(ctx: &super::Ctx, args: CancelArgs) -> anyhow::Result<Exit> {
    if !valid_id(&args.id) {
        bail!("`{}` is not a task id ([A-Za-z0-9_-]{{1,128}})", args.id);
    }
    let id = args.id.clone();
    let wait = parse_duration(&args.wait).map_err(|e| anyhow::anyhow!("--wait: {e}"))?;
    let conn = Conn::open(ctx).await?;
    let (worker, since_seq) = match request(&conn, &id, args.reason.as_deref(), args.force).await? {
        Requested::Finished(r) => {
            report(
                Outcome {
                    id: id.clone(),
                    outcome: "finished",
                    status: Some(r.status),
                    worker: Some(r.worker_id.clone()),
                    ran_ms: None,
                    message: format!("{id} already finished: {}; nothing to cancel", r.status),
                },
                args.json,
            )?;
            return Ok(Exit::NotSucceeded);
        }
        Requested::Unknown => {
            eprintln!(
                "jetworker: no task {id} is known: no result, not running, not queued. \
                 A cancellation stored now would cancel a task submitted later with this id; \
                 use --force to store it anyway"
            );
            report(
                Outcome {
                    id: id.clone(),
                    outcome: "unknown",
                    status: None,
                    worker: None,
                    ran_ms: None,
                    message: format!("{id}: unknown task; nothing cancelled"),
                },
                args.json,
            )?;
            return Ok(Exit::NotSucceeded);
        }
        Requested::Stored {
            worker,
            since_seq,
            queue_unchecked,
        } => {
            if queue_unchecked {
                eprintln!(
                    "jetworker: the queue holds more than {} tasks; \
                     not checked whether {id} is among them",
                    crate::queues::SCAN_LIMIT
                );
            }
            (worker, since_seq)
        }
    };

    // A queued task is cancelled when a worker pulls it, which may be much
    // later: only wait long for a task that is running. Heartbeats lag the
    // start of a task by up to one interval, so a task not listed yet gets
    // a short wait and a second look.
    let ids = [id.clone()];
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
        None => running_on(&conn, &id).await,
    };
    if done.is_empty() && worker.is_some() && first < wait {
        done = conn
            .wait_finals(&ids, since_seq, Some(start + wait), |_| {})
            .await?;
    }
    // What happened is read from the result, not from the heartbeat (which
    // lags the task by up to one interval).
    let (outcome, exit) = match done.remove(&id) {
        Some(r) if r.status == Status::Cancelled && never_ran(&r) => (
            Outcome {
                id: id.clone(),
                outcome: "cancelled",
                status: Some(r.status),
                worker: Some(r.worker_id.clone()),
                ran_ms: None,
                message: format!("{id}: cancelled before it ran"),
            },
            Exit::Ok,
        ),
        Some(r) if r.status == Status::Cancelled => (
            Outcome {
                id: id.clone(),
                outcome: "cancelled",
                status: Some(r.status),
                worker: Some(r.worker_id.clone()),
                ran_ms: Some(r.duration_ms),
                message: format!(
                    "{id}: cancelled; the running attempt on {} stopped after {}",
                    r.worker_id,
                    output::short_duration(Duration::from_millis(r.duration_ms))
                ),
            },
            Exit::Ok,
        ),
        Some(r) => (
            Outcome {
                id: id.clone(),
                outcome: "finished",
                status: Some(r.status),
                worker: Some(r.worker_id.clone()),
                ran_ms: Some(r.duration_ms),
                message: format!(
                    "{id}: finished as {} before the cancellation took effect",
                    r.status
                ),
            },
            Exit::NotSucceeded,
        ),
        None => match worker {
            Some(w) => (
                Outcome {
                    id: id.clone(),
                    outcome: "requested",
                    status: None,
                    worker: Some(w.clone()),
                    ran_ms: None,
                    message: format!(
                        "{id}: cancellation requested; the attempt on {w} has not reported stopping within {}",
                        humantime::format_duration(wait)
                    ),
                },
                Exit::NotSucceeded,
            ),
            None => (
                Outcome {
                    id: id.clone(),
                    outcome: "requested",
                    status: None,
                    worker: None,
                    ran_ms: None,
                    message: format!(
                        "{id}: cancellation requested; the task is not running, so it will not start"
                    ),
                },
                Exit::Ok,
            ),
        },
    };
    report(outcome, args.json)?;
    Ok(exit)
}
