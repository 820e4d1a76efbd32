//! `jetworker retry`: run again tasks that ended for good without
//! succeeding. Such a task's original is in DEAD (`dead.<label>.<id>`,
//! `Jetworker-Status` = `failed`, `timeout`, `expired`, `dead` or
//! `rejected`; DESIGN.md section 5), and it is published again under a new
//! id `<id>-r<n>` (the first `n` whose id has no record yet) with a fresh
//! attempt budget: the id is the unit of idempotency, so the old id would
//! not run again. `jetworker dead replay <id>` is the same operation.
//!
//! - `retry <id>`: the newest dead letter of `<id>`.
//! - `retry --status failed,timeout --since 1h --label L`: every dead
//!   letter that matches (newest per id; `--status` defaults to
//!   `failed,timeout`) and has not been retried yet (`<id>-r1` has no
//!   record); `--dry-run` lists them and publishes nothing.
//!
//! Refused: an id whose last record is `success` or not final (it is still
//! running or waiting for a retry), a DEAD copy that was truncated to fit
//! `max_payload`, and a task that is not valid as it is (fix it and submit
//! it with `--file`). An `expires` that is an RFC 3339 time already past
//! is dropped, or the task would only expire again (the output says so).
//!
//! Output: `retried <id> as <new id> on <subject>` per task (`--json`:
//! `{"id","new_id","subject","duplicate","dropped_expires"}`; `--dry-run
//! --json`: the dead letters, as `dead --json` prints them). Exit 0; 2
//! when a task could not be retried (bulk: after trying the others).
//!
//! Library use (the web dashboard's "retry" button): [`retry`] takes an
//! open [`Conn`] and an id and returns the new id in [`Retried`].

use std::collections::BTreeMap;

use anyhow::{anyhow, bail, Context as _};
use chrono::Utc;
use clap::{ArgGroup, Args};
use serde::Serialize;

use super::common::Conn;
use super::dead::{check_id, check_label, read, DeadLetter};
use super::output;
use super::taskflags::{parse_message, validate_locally, Origin};
use super::Exit;
use crate::protocol::{valid_id, Status};

#[derive(Debug, Clone, Args)]
#[command(group(ArgGroup::new("which").required(true).multiple(true)
    .args(["id", "status", "since", "label"])))]
pub struct RetryArgs {
    /// Id of the task to run again (its newest dead letter).
    #[arg(conflicts_with_all = ["status", "since", "label", "dry_run"])]
    pub id: Option<String>,
    /// Bulk: dead letters with these final statuses (failed, timeout, expired,
    /// dead, rejected) [default: failed,timeout].
    #[arg(long, value_delimiter = ',', value_name = "STATUS")]
    pub status: Vec<Status>,
    /// Bulk: only dead letters newer than this: a duration back (1h) or an RFC3339 time.
    #[arg(long, value_name = "WHEN")]
    pub since: Option<String>,
    /// Bulk: only dead letters of this label.
    #[arg(long, short = 'l')]
    pub label: Option<String>,
    /// Bulk: list the dead letters that would be retried; publish nothing.
    #[arg(long)]
    pub dry_run: bool,
    /// Print JSON lines instead of text.
    #[arg(long)]
    pub json: bool,
}

/// A task published again.
#[derive(Debug, Clone, Serialize)]
pub struct Retried {
    /// The id it had.
    pub id: String,
    /// The id it runs under now (`<id>-r<n>`).
    pub new_id: String,
    /// Where it was published (`tasks.<label>`).
    pub subject: String,
    /// The broker had it already (the same retry within the duplicate
    /// window): not queued twice.
    pub duplicate: bool,
    /// The task's `expires`, left off because that time had passed.
    pub dropped_expires: Option<String>,
}

/// Run the task `id` again under a new id: the one operation behind
/// `jetworker retry <id>`, `jetworker dead replay <id>` and the
/// dashboard's retry button. Reads the newest dead letter of `id`,
/// checks that it may run again (module docs), publishes it as
/// `<id>-r<n>` and returns what it did. Errors say why in words.
pub async fn retry(conn: &Conn, id: &str) -> anyhow::Result<Retried> {
    check_id(id)?;
    let filter = format!("{}.*.{id}", conn.names.dead_prefix);
    let Some(letter) = read(conn, filter, 1).await?.pop() else {
        bail!(
            "no dead letter for {id}: only tasks that ended failed, timeout, expired, dead or rejected keep their original in DEAD"
        );
    };
    republish(conn, &letter, None).await
}

/// Publish a dead letter's task again under `new_id` (default: the first
/// free `<id>-r<n>`).
async fn republish(conn: &Conn, d: &DeadLetter, new_id: Option<String>) -> anyhow::Result<Retried> {
    let id = d.id.as_str();
    check_label(&d.label).map_err(|_| anyhow!("dead letter of {id} has no valid label"))?;
    let results = conn.ensure_results().await?;
    match conn.last_result(&results, id).await? {
        Some(r) if !r.is_final => bail!(
            "{id} is not finished ({}, attempt {}): retry it once it has ended",
            r.status,
            r.attempt
        ),
        Some(r) if r.status == Status::Success => {
            bail!("{id} succeeded (attempt {}); nothing to retry", r.attempt)
        }
        _ => {}
    }
    if let Some(t) = &d.truncated {
        bail!("the dead copy of {id} is truncated ({t}): it cannot be run again as it is");
    }
    let text = std::str::from_utf8(&d.bytes)
        .map_err(|_| anyhow!("the dead task {id} is not UTF-8 text; it cannot be replayed"))?;
    let mut msg = parse_message(text).map_err(|e| {
        anyhow!(
            "the dead task {id} ({}) cannot be replayed as it is: {e}; fix it and submit it with --file",
            d.reason
        )
    })?;
    let dropped_expires = msg
        .expires
        .take_if(|e| chrono::DateTime::parse_from_rfc3339(e.trim()).is_ok_and(|t| t < Utc::now()));
    let new_id = match new_id {
        Some(n) => n,
        None => next_id(conn, id).await?.1,
    };
    msg.id = Some(new_id.clone());
    let (bytes, _) = validate_locally(&d.label, &msg, Origin::Direct { msg_id: &new_id }, &[])
        .map_err(|e| anyhow!("the dead task {id} cannot be replayed as it is: {e}"))?;
    let subject = conn.names.task_subject(&d.label);
    let ack = conn
        .publish(&subject, bytes, Some(&new_id), None)
        .await
        .with_context(|| format!("cannot replay {id}"))?;
    Ok(Retried {
        id: id.to_string(),
        new_id,
        subject,
        duplicate: ack.duplicate,
        dropped_expires,
    })
}

/// The first `<id>-r<n>` that has no record yet, and its `n`.
async fn next_id(conn: &Conn, id: &str) -> anyhow::Result<(u32, String)> {
    let results = conn.ensure_results().await?;
    for n in 1..1000u32 {
        let cand = format!("{id}-r{n}");
        if !valid_id(&cand) {
            bail!("cannot replay {id}: the new id {cand} would be longer than 128 characters");
        }
        if conn.last_result(&results, &cand).await?.is_none() {
            return Ok((n, cand));
        }
    }
    bail!("{id} was replayed too often (r1 to r999 all have results)")
}

/// Print what [`retry`] did: `<verb> <id> as <new id> on <subject>`.
pub(crate) fn print(r: &Retried, verb: &str, json: bool) -> anyhow::Result<()> {
    if json {
        return output::json_line(r);
    }
    if let Some(e) = &r.dropped_expires {
        eprintln!(
            "jetworker: {}: dropped `expires` {e}, which has passed",
            r.id
        );
    }
    let text = if r.duplicate {
        format!("{} was already {verb} as {} (still queued)", r.id, r.new_id)
    } else {
        format!("{verb} {} as {} on {}", r.id, r.new_id, r.subject)
    };
    output::line(&text)?;
    Ok(())
}

pub async fn run(ctx: &super::Ctx, args: RetryArgs) -> anyhow::Result<Exit> {
    let conn = Conn::open(ctx).await?;
    if let Some(id) = &args.id {
        let r = retry(&conn, id).await?;
        print(&r, "retried", args.json)?;
        return Ok(Exit::Ok);
    }
    bulk(&conn, &args).await
}

/// `retry --status/--since/--label`.
async fn bulk(conn: &Conn, args: &RetryArgs) -> anyhow::Result<Exit> {
    let statuses = if args.status.is_empty() {
        vec![Status::Failed, Status::Timeout]
    } else {
        args.status.clone()
    };
    if let Some(s) = statuses.iter().find(|s| !s.dead_lettered()) {
        bail!("--status: {s} tasks keep no original in DEAD (failed, timeout, expired, dead or rejected)");
    }
    let since = match &args.since {
        Some(s) => Some(output::parse_since(s).map_err(|e| anyhow!("--since: {e}"))?),
        None => None,
    };
    let p = &conn.names.dead_prefix;
    let filter = match &args.label {
        Some(l) => {
            check_label(l)?;
            format!("{p}.{l}.>")
        }
        None => format!("{p}.>"),
    };
    // The newest letter per id (a task can be dead-lettered more than once).
    let mut newest: BTreeMap<String, DeadLetter> = BTreeMap::new();
    for d in read(conn, filter, 0).await? {
        newest.insert(d.id.clone(), d);
    }
    let mut picked: Vec<DeadLetter> = newest
        .into_values()
        .filter(|d| statuses.iter().any(|s| s.as_str() == d.status))
        .filter(|d| since.is_none_or(|s| d.time >= s))
        .collect();
    picked.sort_by_key(|d| d.sequence);
    let (mut done, mut skipped, mut failed) = (0, 0, 0);
    for d in &picked {
        // Retried before: its first retry has a record (or is queued, and
        // the duplicate window answers a second publish).
        let (n, new_id) = match next_id(conn, &d.id).await {
            Ok(x) => x,
            Err(e) => {
                eprintln!("jetworker: cannot retry {}: {e:#}", d.id);
                failed += 1;
                continue;
            }
        };
        if n > 1 {
            skipped += 1;
            continue;
        }
        if args.dry_run {
            if args.json {
                output::json_line(d)?;
            } else {
                output::line(&format!(
                    "would retry {} ({} {}) as {new_id}",
                    d.id,
                    d.status,
                    output::timestamp(d.time)
                ))?;
            }
            done += 1;
            continue;
        }
        match republish(conn, d, Some(new_id)).await {
            Ok(r) => {
                print(&r, "retried", args.json)?;
                done += 1;
            }
            Err(e) => {
                eprintln!("jetworker: cannot retry {}: {e:#}", d.id);
                failed += 1;
            }
        }
    }
    let verb = if args.dry_run {
        "would retry"
    } else {
        "retried"
    };
    eprintln!(
        "jetworker: {verb} {done} task(s); {skipped} retried before; {failed} could not be retried"
    );
    if failed > 0 {
        bail!("{failed} of {} task(s) could not be retried", picked.len());
    }
    Ok(Exit::Ok)
}
