//! `jetworker results`: recent results as a table (one row per task: its
//! latest attempt), filtered by `--status`, `--label`, `--since`, the newest
//! `--limit` rows; `--follow` then prints a row per attempt as results
//! arrive (`jetworker: ready: following results` on stderr once subscribed).
//! `jetworker results <id>` shows one task whole, every attempt.
//!
//! `jetworker results <id> --tree` shows the task and every task it queued
//! (`then` children, or the shards `<id>-<no>` of a fan-out and their join),
//! one row per task with its state ([`super::tree`]); `--wait` waits until
//! every one of them is final.
//!
//! `--json` prints each result message (DESIGN.md section 4) as one JSON
//! line. `results <id>` exits 0 when the task's final result is `success`,
//! 1 otherwise (not final yet, or any other status), 2 when it has none;
//! with `--tree`, 0 only when every task of the tree succeeded.

use std::collections::HashMap;
use std::io::Write;
use std::time::Duration;

use anyhow::bail;
use async_nats::jetstream::consumer::DeliverPolicy;
use chrono::{DateTime, Utc};
use clap::Args;

use super::common::{parse_result, Conn, OrderedReader};
use super::output::{self, colour_enabled, status_text, Table};
use super::tree;
use super::Exit;
use crate::protocol::{parse_duration, valid_id, Status, TaskResult};

#[derive(Debug, Clone, Args)]
pub struct ResultsArgs {
    /// Show every attempt of this task.
    pub id: Option<String>,
    /// Only these statuses (comma separated: success,failed,timeout,cancelled,rejected,dead,expired).
    #[arg(long, value_delimiter = ',', value_name = "STATUS")]
    pub status: Vec<Status>,
    /// Only tasks of this label.
    #[arg(long, short = 'l')]
    pub label: Option<String>,
    /// Only results newer than this: a duration back (1h) or an RFC3339 time.
    #[arg(long, value_name = "WHEN")]
    pub since: Option<String>,
    /// Show at most the newest N tasks (0: all).
    #[arg(long, default_value_t = 50, value_name = "N")]
    pub limit: usize,
    /// Keep running and print each new result as it arrives.
    #[arg(long, short = 'f', short_alias = 'F')]
    pub follow: bool,
    /// Print JSON lines (one result message per line).
    #[arg(long)]
    pub json: bool,
    /// With an id: the task and every task it queued (then, or the shards
    /// <id>-<no> and their join), one row each.
    #[arg(long, requires = "id")]
    pub tree: bool,
    /// With --tree: wait until every task of the tree is final; exit 0
    /// only if all succeeded.
    #[arg(long, short = 'w', requires = "tree")]
    pub wait: bool,
    /// Give up waiting after this long (exit 1).
    #[arg(long, value_name = "DURATION", requires = "wait")]
    pub wait_timeout: Option<String>,
}

/// The list filters.
struct Filter {
    status: Vec<Status>,
    label: Option<String>,
    since: Option<DateTime<Utc>>,
}

impl Filter {
    fn keep(&self, r: &TaskResult, time: DateTime<Utc>) -> bool {
        (self.status.is_empty() || self.status.contains(&r.status))
            && self.label.as_ref().is_none_or(|l| &r.label == l)
            && self.since.is_none_or(|s| time >= s)
    }
}

const HEADERS: [&str; 8] = [
    "ID", "LABEL", "STATUS", "ATTEMPT", "DURATION", "WORKER", "FINISHED", "OUTPUT",
];

/// The status cell of a result: `failed (retrying)` for a non-final
/// attempt.
pub(super) fn status_cell(r: &TaskResult, colour: bool) -> String {
    let mut status = status_text(r.status, colour);
    if !r.is_final && !r.is_state() {
        status.push_str(" (retrying)");
    }
    status
}

/// The output cell of a result: its first line, else its error's.
pub(super) fn output_cell(r: &TaskResult) -> String {
    let out = if r.output.trim().is_empty() {
        r.error.as_deref().unwrap_or_default()
    } else {
        &r.output
    };
    output::first_line(out, 60)
}

/// A table row for one result.
fn row(r: &TaskResult, now: DateTime<Utc>, colour: bool) -> Vec<String> {
    vec![
        r.id.clone(),
        r.label.clone(),
        status_cell(r, colour),
        format!("{}/{}", r.attempt, r.max_attempts),
        output::short_duration(Duration::from_millis(r.duration_ms)),
        r.worker_id.clone(),
        output::ago(r.finished_at, now),
        output_cell(r),
    ]
}

pub async fn run(ctx: &super::Ctx, args: ResultsArgs) -> anyhow::Result<Exit> {
    let conn = Conn::open(ctx).await?;
    if let (Some(id), true) = (&args.id, args.tree) {
        return show_tree(&conn, id, &args).await;
    }
    if let Some(id) = &args.id {
        return show_one(&conn, id, args.json).await;
    }
    let filter = Filter {
        status: args.status.clone(),
        label: args.label.clone(),
        since: match &args.since {
            Some(s) => Some(output::parse_since(s).map_err(|e| anyhow::anyhow!("--since: {e}"))?),
            None => None,
        },
    };
    let results = conn.stream(&conn.names.results_stream).await?;
    let deliver = match filter.since {
        Some(t) => DeliverPolicy::ByStartTime {
            start_time: output::js_time(t),
        },
        None => DeliverPolicy::LastPerSubject,
    };
    let mut reader = OrderedReader::open(
        &results,
        vec![format!("{}.>", conn.names.results_prefix)],
        deliver,
    )
    .await?;

    // The latest result of each task, in stream order.
    let mut latest: HashMap<String, (u64, DateTime<Utc>, TaskResult)> = HashMap::new();
    for m in reader.read_to_end().await? {
        if let Ok(r) = parse_result(&m.payload) {
            latest.insert(r.id.clone(), (m.sequence, m.time, r));
        }
    }
    let mut rows: Vec<(u64, DateTime<Utc>, TaskResult)> = latest
        .into_values()
        .filter(|(_, t, r)| filter.keep(r, *t))
        .collect();
    rows.sort_by_key(|(seq, _, _)| *seq);
    if args.limit > 0 && rows.len() > args.limit {
        rows.drain(..rows.len() - args.limit);
    }

    let colour = colour_enabled();
    let now = Utc::now();
    let mut widths = vec![0; HEADERS.len()];
    if args.json {
        for (_, _, r) in &rows {
            output::json_line(r)?;
        }
    } else if rows.is_empty() && !args.follow {
        output::line("no results")?;
    } else {
        let mut t = Table::new(&HEADERS, colour);
        for (_, _, r) in &rows {
            t.push(row(r, now, colour));
        }
        widths = t.widths();
        print!("{}", t.render());
        std::io::stdout().flush()?;
    }
    if !args.follow {
        return Ok(Exit::Ok);
    }
    // The reader was created before the list was read: nothing published
    // from here on is missed.
    output::ready("following results")?;
    // Later attempts: a row each, as they come.
    while let Some(m) = reader.next().await? {
        let Ok(r) = parse_result(&m.payload) else {
            continue;
        };
        if !filter.keep(&r, m.time) {
            continue;
        }
        if args.json {
            output::json_line(&r)?;
        } else {
            let cells = row(&r, Utc::now(), colour);
            output::line(&output::format_row(&cells, &widths))?;
        }
    }
    Ok(Exit::Ok)
}

/// `results <id> --tree`: the task and what it queued.
async fn show_tree(conn: &Conn, id: &str, args: &ResultsArgs) -> anyhow::Result<Exit> {
    if !valid_id(id) {
        bail!("`{id}` is not a task id ([A-Za-z0-9_-]{{1,128}})");
    }
    let deadline = match &args.wait_timeout {
        Some(s) => Some(
            tokio::time::Instant::now()
                + parse_duration(s).map_err(|e| anyhow::anyhow!("--wait-timeout: {e}"))?,
        ),
        None => None,
    };
    let since = conn.results_last_seq().await;
    let results = conn.stream(&conn.names.results_stream).await?;
    let roots = if args.wait {
        tree::wait_for_roots(conn, &results, id, since, deadline).await?
    } else {
        tree::roots_of(conn, &results, id).await?
    };
    let Some(roots) = roots else {
        bail!("no result for {id} yet, nor for shards {id}-<no> (queued, expired, or unknown)");
    };
    let mut recs = tree::Records::default();
    let nodes = if args.wait {
        tree::wait(conn, &roots, since, deadline, &mut recs).await?
    } else {
        tree::load(conn, &results, &roots, &mut recs).await?
    };
    tree::print(&roots, &nodes, &recs, args.json, colour_enabled())?;
    std::io::stdout().flush()?;
    Ok(tree::exit(&nodes, &recs, args.wait))
}

/// `results <id>`: every attempt.
async fn show_one(conn: &Conn, id: &str, json: bool) -> anyhow::Result<Exit> {
    if !valid_id(id) {
        bail!("`{id}` is not a task id ([A-Za-z0-9_-]{{1,128}})");
    }
    let results = conn.stream(&conn.names.results_stream).await?;
    let all = conn.all_results(&results, id).await?;
    let Some(last) = all.last() else {
        bail!("no result for {id} yet (queued, running, expired, or unknown)");
    };
    let exit = if last.is_final && last.status == Status::Success {
        Exit::Ok
    } else {
        Exit::NotSucceeded
    };
    if json {
        for r in &all {
            output::json_line(r)?;
        }
        return Ok(exit);
    }
    let colour = colour_enabled();
    let mut o = std::io::stdout().lock();
    for (i, r) in all.iter().enumerate() {
        if i > 0 {
            writeln!(o)?;
        }
        write_attempt(&mut o, r, colour)?;
    }
    o.flush()?;
    Ok(exit)
}

/// One attempt as a block of `key value` lines and the output.
fn write_attempt(o: &mut impl Write, r: &TaskResult, colour: bool) -> std::io::Result<()> {
    let state = if r.is_final {
        "final".to_string()
    } else {
        match r.retry_in_ms {
            Some(ms) => format!(
                "retry in {}",
                output::short_duration(Duration::from_millis(ms))
            ),
            None => "not final".to_string(),
        }
    };
    writeln!(
        o,
        "{} attempt {}/{}: {} ({state})",
        output::bold(&r.id, colour),
        r.attempt,
        r.max_attempts,
        status_text(r.status, colour)
    )?;
    let kv = |o: &mut dyn Write, k: &str, v: &str| writeln!(o, "  {k:<10} {v}");
    kv(o, "label", &r.label)?;
    if let Some(t) = &r.task_type {
        kv(o, "type", t)?;
    }
    kv(o, "worker", &r.worker_id)?;
    kv(o, "started", &output::timestamp(r.started_at))?;
    kv(
        o,
        "finished",
        &format!(
            "{} ({})",
            output::timestamp(r.finished_at),
            output::short_duration(Duration::from_millis(r.duration_ms))
        ),
    )?;
    if let Some(c) = r.exit_code {
        kv(o, "exit code", &c.to_string())?;
    }
    if let Some(s) = &r.signal {
        kv(o, "signal", s)?;
    }
    if let Some(h) = r.http_status {
        kv(o, "http", &h.to_string())?;
    }
    if let Some(s) = r.shard {
        kv(o, "shard", &format!("{}/{}", s.no, s.total))?;
    }
    if let Some(k) = &r.idempotency_key {
        kv(o, "idem key", k)?;
    }
    if let Some(p) = &r.parent {
        kv(o, "parent", p)?;
    }
    if !r.children.is_empty() {
        let what = if r.is_final { "queued" } else { "planned" };
        kv(
            o,
            "children",
            &format!("{} ({what})", r.children.join(", ")),
        )?;
    }
    if let Some(j) = &r.join {
        kv(o, "join", j)?;
    }
    if let Some(e) = &r.error {
        kv(o, "error", e)?;
    }
    let trunc = if r.output_truncated {
        format!(
            ", truncated from {}",
            crate::protocol::format_size(r.output_bytes)
        )
    } else {
        String::new()
    };
    kv(
        o,
        "output",
        &format!(
            "{}{trunc}",
            crate::protocol::format_size(r.output.len() as u64)
        ),
    )?;
    for l in r.output.lines() {
        writeln!(o, "    {l}")?;
    }
    Ok(())
}
