//! `jetworker dead`: the dead letters in stream DEAD (`dead.<label>.<id>`:
//! the original task bytes, headers `Jetworker-Reason`, `Jetworker-Task-Id`,
//! `Jetworker-Label`, `Jetworker-Status`: the final status that put it
//! there — `rejected`, `dead`, `expired`, `failed` or `timeout`). `dead`
//! lists them; `dead replay <id>` publishes the original again under the
//! new id `<id>-r<n>` (the id is the unit of idempotency, so the same id
//! would not run again) with a fresh attempt budget — the same code as
//! `jetworker retry <id>` ([`super::retry::retry`]); `dead purge` removes
//! them (all, or one id's, or one label's).
//!
//! `dead purge` asks first on a terminal and needs `--force` elsewhere.
//!
//! `--json` prints one dead letter per line:
//! `{"id","label","status","reason","time","sequence","task"}` (`task` is
//! the original bytes as text; `status` is empty on letters written by
//! hand); `replay --json`: `{"id","new_id","subject","duplicate",
//! "dropped_expires"}`; `purge --json`: `{"filter","purged"}`.

use anyhow::{bail, Context as _};
use async_nats::jetstream::consumer::DeliverPolicy;
use chrono::{DateTime, Utc};
use clap::{Args, Subcommand};
use futures::TryStreamExt;
use serde::Serialize;

use super::common::{header, Conn, OrderedReader, Read};
use super::output::{self, colour_enabled, Table};
use super::Exit;
use crate::protocol::{
    valid_id, valid_label, HEADER_LABEL, HEADER_REASON, HEADER_STATUS, HEADER_TASK_ID,
    HEADER_TRUNCATED,
};

#[derive(Debug, Clone, Args)]
#[command(args_conflicts_with_subcommands = true)]
pub struct DeadArgs {
    #[command(subcommand)]
    pub command: Option<DeadCommand>,
    /// Only dead letters of this label.
    #[arg(long, short = 'l')]
    pub label: Option<String>,
    /// Show at most the newest N (0: all).
    #[arg(long, default_value_t = 50, value_name = "N")]
    pub limit: usize,
    /// Print JSON lines instead of a table (or text).
    #[arg(long, global = true)]
    pub json: bool,
}

#[derive(Debug, Clone, Subcommand)]
pub enum DeadCommand {
    /// Publish a dead task again under a new id (<id>-r<n>).
    Replay(ReplayArgs),
    /// Remove dead letters: all of them, or those of --id / --label.
    Purge(PurgeArgs),
}

#[derive(Debug, Clone, Args)]
pub struct ReplayArgs {
    /// Id of the dead task.
    pub id: String,
}

#[derive(Debug, Clone, Args)]
pub struct PurgeArgs {
    /// Only this task's dead letters.
    #[arg(long)]
    pub id: Option<String>,
    /// Only this label's dead letters.
    #[arg(long, short = 'l')]
    pub label: Option<String>,
    /// Do not ask (needed when stdin is not a terminal).
    #[arg(long)]
    pub force: bool,
}

/// What `purge --json` prints.
#[derive(Serialize)]
struct Purged<'a> {
    filter: &'a str,
    purged: u64,
}

/// One dead letter.
#[derive(Debug, Serialize)]
pub struct DeadLetter {
    pub id: String,
    pub label: String,
    /// The final status that put it here (`Jetworker-Status`); empty when
    /// the letter does not say.
    pub status: String,
    pub reason: String,
    pub time: DateTime<Utc>,
    pub sequence: u64,
    pub task: String,
    #[serde(skip)]
    pub bytes: bytes::Bytes,
    /// `Jetworker-Truncated`: the copy kept only the head of the original.
    #[serde(skip)]
    pub truncated: Option<String>,
}

impl DeadLetter {
    fn from_read(prefix: &str, m: Read) -> DeadLetter {
        // dead.<label>.<id>, unless the headers say otherwise.
        let mut tokens = m
            .subject
            .strip_prefix(prefix)
            .and_then(|s| s.strip_prefix('.'))
            .unwrap_or("")
            .splitn(2, '.');
        let label_s = tokens.next().unwrap_or("").to_string();
        let id_s = tokens.next().unwrap_or("").to_string();
        let h = m.headers.as_ref();
        DeadLetter {
            id: header(h, HEADER_TASK_ID).unwrap_or(id_s),
            label: header(h, HEADER_LABEL).unwrap_or(label_s),
            status: header(h, HEADER_STATUS).unwrap_or_default(),
            reason: header(h, HEADER_REASON).unwrap_or_default(),
            time: m.time,
            sequence: m.sequence,
            task: String::from_utf8_lossy(&m.payload).into_owned(),
            bytes: m.payload,
            truncated: header(h, HEADER_TRUNCATED),
        }
    }
}

/// The newest `limit` dead letters on `filter` (a subject under the dead
/// prefix; `limit` 0: all of them), oldest first. A long history is not
/// read whole to show its end: a window at the end of DEAD grows fourfold
/// until it holds `limit` matches or reaches the first message.
pub(crate) async fn read(
    conn: &Conn,
    filter: String,
    limit: usize,
) -> anyhow::Result<Vec<DeadLetter>> {
    let mut stream = conn.stream(&conn.names.dead_stream).await?;
    let (first, last) = {
        let state = &stream
            .info()
            .await
            .context("cannot read DEAD's state")?
            .state;
        (state.first_sequence, state.last_sequence)
    };
    let prefix = conn.names.dead_prefix.clone();
    let mut window = if limit == 0 {
        u64::MAX
    } else {
        (limit as u64).max(16).saturating_mul(2)
    };
    loop {
        let start = last.saturating_sub(window.saturating_sub(1)).max(first);
        let deliver = if start <= first {
            DeliverPolicy::All
        } else {
            DeliverPolicy::ByStartSequence {
                start_sequence: start,
            }
        };
        let mut reader = OrderedReader::open(&stream, vec![filter.clone()], deliver).await?;
        let mut got: Vec<DeadLetter> = reader
            .read_to_end()
            .await?
            .into_iter()
            .map(|m| DeadLetter::from_read(&prefix, m))
            .collect();
        if start <= first || got.len() >= limit {
            if limit > 0 && got.len() > limit {
                got.drain(..got.len() - limit);
            }
            return Ok(got);
        }
        window = window.saturating_mul(4);
    }
}

pub(crate) fn check_label(l: &str) -> anyhow::Result<()> {
    if !valid_label(l) {
        bail!("--label: `{l}` is not [A-Za-z0-9_-]{{1,64}}");
    }
    Ok(())
}

pub(crate) fn check_id(id: &str) -> anyhow::Result<()> {
    if !valid_id(id) {
        bail!("`{id}` is not a task id ([A-Za-z0-9_-]{{1,128}})");
    }
    Ok(())
}

pub async fn run(ctx: &super::Ctx, args: DeadArgs) -> anyhow::Result<Exit> {
    let conn = Conn::open(ctx).await?;
    match args.command {
        None => list(&conn, args.label, args.limit, args.json).await,
        Some(DeadCommand::Replay(a)) => replay(&conn, &a.id, args.json).await,
        Some(DeadCommand::Purge(a)) => purge(&conn, a, args.json).await,
    }
}

async fn list(
    conn: &Conn,
    label: Option<String>,
    limit: usize,
    json: bool,
) -> anyhow::Result<Exit> {
    let p = &conn.names.dead_prefix;
    let filter = match &label {
        Some(l) => {
            check_label(l)?;
            format!("{p}.{l}.>")
        }
        None => format!("{p}.>"),
    };
    let all = read(conn, filter, limit).await?;
    if json {
        for d in &all {
            output::json_line(d)?;
        }
        return Ok(Exit::Ok);
    }
    if all.is_empty() {
        output::line("no dead letters")?;
        return Ok(Exit::Ok);
    }
    let mut t = Table::new(
        &["ID", "LABEL", "STATUS", "REASON", "TIME", "TASK"],
        colour_enabled(),
    );
    for d in &all {
        t.push(vec![
            d.id.clone(),
            d.label.clone(),
            if d.status.is_empty() {
                "-".into()
            } else {
                d.status.clone()
            },
            output::truncate(&d.reason, 50),
            output::timestamp(d.time),
            output::truncate(&d.task, 60),
        ]);
    }
    t.print()?;
    Ok(Exit::Ok)
}

async fn replay(conn: &Conn, id: &str, json: bool) -> anyhow::Result<Exit> {
    let r = super::retry::retry(conn, id).await?;
    super::retry::print(&r, "replayed", json)?;
    Ok(Exit::Ok)
}

async fn purge(conn: &Conn, a: PurgeArgs, json: bool) -> anyhow::Result<Exit> {
    let p = &conn.names.dead_prefix;
    let label = match &a.label {
        Some(l) => {
            check_label(l)?;
            l.as_str()
        }
        None => "*",
    };
    let filter = match &a.id {
        Some(id) => {
            check_id(id)?;
            format!("{p}.{label}.{id}")
        }
        None if a.label.is_some() => format!("{p}.{label}.>"),
        None => format!("{p}.>"),
    };
    let stream = conn.stream(&conn.names.dead_stream).await?;
    if !a.force {
        // Counted from the stream's per-subject counts, not by reading
        // every letter.
        let n: u64 = stream
            .info_with_subjects(&filter)
            .await
            .context("cannot count dead letters")?
            .map_ok(|(_, n)| n as u64)
            .try_fold(0, |a, n| async move { Ok(a + n) })
            .await
            .context("cannot count dead letters")?;
        if n == 0 {
            return purged(&filter, 0, json);
        }
        let which = match (&a.id, &a.label) {
            (None, None) => "ALL".to_string(),
            _ => "the matching".to_string(),
        };
        output::confirm(
            &format!("Delete {which} {n} dead letter(s) ({filter}) for good?"),
            false,
        )?;
    }
    let r = stream
        .purge()
        .filter(&filter)
        .await
        .context("cannot purge dead letters")?;
    purged(&filter, r.purged, json)
}

fn purged(filter: &str, n: u64, json: bool) -> anyhow::Result<Exit> {
    if json {
        output::json_line(&Purged { filter, purged: n })?;
    } else {
        output::line(&format!("purged {n} dead letter(s)"))?;
    }
    Ok(Exit::Ok)
}
