//! `jetworker dead`: the dead letters in stream DEAD (`dead.<label>.<id>`:
//! the original task bytes, headers `Jetworker-Reason`, `Jetworker-Task-Id`,
//! `Jetworker-Label`). `dead` lists them; `dead replay <id>` publishes the
//! original again under the new id `<id>-r<n>` (the id is the unit of
//! idempotency, so the same id would not run again) with a fresh attempt
//! budget; `dead purge` removes them (all, or one id's, or one label's).
//!
//! `dead purge` asks first on a terminal and needs `--force` elsewhere.
//!
//! `--json` prints one dead letter per line:
//! `{"id","label","reason","time","sequence","task"}` (`task` is the
//! original bytes as text); `replay --json`: `{"id","new_id","subject",
//! "duplicate"}`; `purge --json`: `{"filter","purged"}`.

use anyhow::{anyhow, bail, Context as _};
use async_nats::jetstream::consumer::DeliverPolicy;
use chrono::{DateTime, Utc};
use clap::{Args, Subcommand};
use serde::Serialize;

use super::common::{header, Conn, OrderedReader, Read};
use super::output::{self, colour_enabled, Table};
use super::taskflags::{parse_message, validate_locally, Origin};
use super::Exit;
use crate::protocol::{valid_id, valid_label, HEADER_LABEL, HEADER_REASON, HEADER_TASK_ID};

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

/// What `replay --json` prints.
#[derive(Serialize)]
struct Replayed<'a> {
    id: &'a str,
    new_id: &'a str,
    subject: &'a str,
    duplicate: bool,
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
    pub reason: String,
    pub time: DateTime<Utc>,
    pub sequence: u64,
    pub task: String,
    #[serde(skip)]
    pub bytes: bytes::Bytes,
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
            reason: header(h, HEADER_REASON).unwrap_or_default(),
            time: m.time,
            sequence: m.sequence,
            task: String::from_utf8_lossy(&m.payload).into_owned(),
            bytes: m.payload,
        }
    }
}

/// Dead letters on `filter` (a subject under the dead prefix), oldest first.
pub(crate) async fn read(conn: &Conn, filter: String) -> anyhow::Result<Vec<DeadLetter>> {
    let stream = conn.stream(&conn.names.dead_stream).await?;
    let mut reader = OrderedReader::open(&stream, vec![filter], DeliverPolicy::All).await?;
    let prefix = conn.names.dead_prefix.clone();
    Ok(reader
        .read_to_end()
        .await?
        .into_iter()
        .map(|m| DeadLetter::from_read(&prefix, m))
        .collect())
}

fn check_label(l: &str) -> anyhow::Result<()> {
    if !valid_label(l) {
        bail!("--label: `{l}` is not [A-Za-z0-9_-]{{1,64}}");
    }
    Ok(())
}

fn check_id(id: &str) -> anyhow::Result<()> {
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
    let mut all = read(conn, filter).await?;
    if limit > 0 && all.len() > limit {
        all.drain(..all.len() - limit);
    }
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
    let mut t = Table::new(&["ID", "LABEL", "REASON", "TIME", "TASK"], colour_enabled());
    for d in &all {
        t.push(vec![
            d.id.clone(),
            d.label.clone(),
            output::truncate(&d.reason, 50),
            output::timestamp(d.time),
            output::truncate(&d.task, 60),
        ]);
    }
    t.print()?;
    Ok(Exit::Ok)
}

/// The first `<id>-r<n>` that has no result and no dead letter yet.
async fn replay_id(conn: &Conn, id: &str) -> anyhow::Result<String> {
    let results = conn.ensure_results().await?;
    for n in 1..1000u32 {
        let cand = format!("{id}-r{n}");
        if !valid_id(&cand) {
            bail!("cannot replay {id}: the new id {cand} would be longer than 128 characters");
        }
        if conn.last_result(&results, &cand).await?.is_none() {
            return Ok(cand);
        }
    }
    bail!("{id} was replayed too often (r1 to r999 all have results)")
}

/// A dead task published again.
pub(crate) struct Replay {
    pub new_id: String,
    pub subject: String,
    /// Already queued under that id (duplicate within the window).
    pub duplicate: bool,
}

/// Publish the newest dead letter of `id` again as `<id>-r<n>` with a
/// fresh attempt budget: the one replay path, for `dead replay` and for
/// `jetworker ui`.
pub(crate) async fn replay_task(conn: &Conn, id: &str) -> anyhow::Result<Replay> {
    check_id(id)?;
    let filter = format!("{}.*.{id}", conn.names.dead_prefix);
    let Some(d) = read(conn, filter).await?.pop() else {
        bail!("no dead letter for {id}");
    };
    check_label(&d.label).map_err(|_| anyhow!("dead letter of {id} has no valid label"))?;
    let text = std::str::from_utf8(&d.bytes)
        .map_err(|_| anyhow!("the dead task {id} is not UTF-8 text; it cannot be replayed"))?;
    let mut msg = parse_message(text).map_err(|e| {
        anyhow!(
            "the dead task {id} ({}) cannot be replayed as it is: {e}; fix it and submit it with --file",
            d.reason
        )
    })?;
    let new_id = replay_id(conn, id).await?;
    msg.id = Some(new_id.clone());
    let (bytes, _) = validate_locally(&d.label, &msg, Origin::Direct { msg_id: &new_id })
        .map_err(|e| anyhow!("the dead task {id} cannot be replayed as it is: {e}"))?;
    let subject = conn.names.task_subject(&d.label);
    let ack = conn
        .publish(&subject, bytes, Some(&new_id), None)
        .await
        .with_context(|| format!("cannot replay {id}"))?;
    Ok(Replay {
        new_id,
        subject,
        duplicate: ack.duplicate,
    })
}

async fn replay(conn: &Conn, id: &str, json: bool) -> anyhow::Result<Exit> {
    let Replay {
        new_id,
        subject,
        duplicate,
    } = replay_task(conn, id).await?;
    if json {
        output::json_line(&Replayed {
            id,
            new_id: &new_id,
            subject: &subject,
            duplicate,
        })?;
    } else if duplicate {
        output::line(&format!(
            "{id} was already replayed as {new_id} (still queued)"
        ))?;
    } else {
        output::line(&format!("replayed {id} as {new_id} on {subject}"))?;
    }
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
        let n = read(conn, filter.clone()).await?.len();
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
