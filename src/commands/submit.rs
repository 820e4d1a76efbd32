//! `jetworker submit`: build a task from flags (or `--file`/stdin), check
//! it locally exactly as a worker will, publish it to `tasks.<label>` with
//! `Nats-Msg-Id` = its id (so re-running the same command inside the
//! duplicate window queues nothing new), optionally as N shards, and with
//! `--wait` wait for the final result(s).
//!
//! Output: without `--wait`, the id of each published task, one per line
//! (`--json`: `{"id","subject","sequence","duplicate"}` per line). With
//! `--wait`, a summary line per final result, and for a single task its
//! output (`--json`: each final result as one JSON line). Exit code 0 only
//! if every task succeeded, 1 otherwise (including `--wait-timeout`), 2 for
//! a bad task or a connection problem.
//!
//! While waiting, stderr says when no online worker serves the label (the
//! task then waits in the queue) and shows each attempt that will be
//! retried.

use std::io::Write;
use std::time::Duration;

use anyhow::{bail, Context as _};
use clap::Args;
use rand::distr::{Alphanumeric, SampleString};
use serde::Serialize;

use super::common::Conn;
use super::output::{self, colour_enabled, status_text};
use super::taskflags::{validate_locally, Origin, TaskArgs};
use super::Exit;
use crate::protocol::{parse_duration, Shard, Status, TaskResult};

#[derive(Debug, Clone, Args)]
pub struct SubmitArgs {
    #[command(flatten)]
    pub task: Box<TaskArgs>,
    /// Fan out N tasks with shard {no, total}; ids <id>-<no>.
    #[arg(long, value_name = "N")]
    pub shards: Option<u32>,
    /// Wait for the final result(s); exit 0 only if all succeeded.
    #[arg(long, short = 'w')]
    pub wait: bool,
    /// Give up waiting after this long (exit 1); default: wait for ever.
    #[arg(long, value_name = "DURATION", requires = "wait")]
    pub wait_timeout: Option<String>,
    /// Print JSON lines instead of text.
    #[arg(long)]
    pub json: bool,
    /// Print the task JSON that would be published, publish nothing.
    #[arg(long)]
    pub dry_run: bool,
}

/// What `--json` prints for each published task.
#[derive(Serialize)]
struct Published<'a> {
    id: &'a str,
    subject: &'a str,
    sequence: u64,
    duplicate: bool,
}

/// A random task id: 16 lowercase letters and digits.
pub fn random_id() -> String {
    Alphanumeric
        .sample_string(&mut rand::rng(), 16)
        .to_ascii_lowercase()
}

pub async fn run(ctx: &super::Ctx, args: SubmitArgs) -> anyhow::Result<Exit> {
    let label = args.task.label()?.to_string();
    let wait_timeout = match &args.wait_timeout {
        Some(s) => Some(parse_duration(s).map_err(|e| anyhow::anyhow!("--wait-timeout: {e}"))?),
        None => None,
    };
    let base = args.task.build()?;
    let base_id = base.id.clone().unwrap_or_else(random_id);

    // Build and validate every task before publishing any.
    let mut tasks = Vec::new();
    match args.shards {
        None => {
            let mut m = base.clone();
            m.id = Some(base_id.clone());
            let (bytes, _) = validate_locally(&label, &m, Origin::Direct { msg_id: &base_id })?;
            tasks.push((base_id.clone(), bytes));
        }
        Some(0) => bail!("--shards: must be at least 1"),
        Some(total) => {
            if base.shard.is_some() || base.shard_no.is_some() || base.shard_total.is_some() {
                bail!("--shards: the task already names a shard");
            }
            for no in 0..total {
                let id = format!("{base_id}-{no}");
                let mut m = base.clone();
                m.id = Some(id.clone());
                m.shard = Some(Shard { no, total });
                let (bytes, _) = validate_locally(&label, &m, Origin::Direct { msg_id: &id })?;
                tasks.push((id, bytes));
            }
        }
    }

    if args.dry_run {
        for (_, bytes) in &tasks {
            output::line(&String::from_utf8_lossy(bytes))?;
        }
        return Ok(Exit::Ok);
    }

    let conn = Conn::open(ctx).await?;
    let since_seq = if args.wait {
        conn.results_last_seq().await
    } else {
        0
    };
    let subject = conn.names.task_subject(&label);
    let ids: Vec<String> = tasks.iter().map(|(id, _)| id.clone()).collect();
    for (id, bytes) in tasks {
        let ack = conn
            .publish(&subject, bytes, Some(&id), None)
            .await
            .with_context(|| format!("task {id}"))?;
        if args.json && !args.wait {
            output::json_line(&Published {
                id: &id,
                subject: &subject,
                sequence: ack.sequence,
                duplicate: ack.duplicate,
            })?;
        } else if !args.wait {
            output::line(&id)?;
        }
        if ack.duplicate {
            eprintln!("jetworker: {id} was already queued (duplicate within the window); not queued again");
        }
    }
    if !args.wait {
        return Ok(Exit::Ok);
    }
    warn_if_unserved(&conn, &label).await;
    wait_and_report(&conn, &ids, since_seq, wait_timeout, args.json).await
}

/// Wait for the final results of `ids`, print them, and map them to the
/// exit status.
async fn wait_and_report(
    conn: &Conn,
    ids: &[String],
    since_seq: u64,
    timeout: Option<Duration>,
    json: bool,
) -> anyhow::Result<Exit> {
    let colour = colour_enabled();
    let bar = (ids.len() > 1).then(|| {
        // Hidden by indicatif itself when stderr is not a terminal.
        let b = indicatif::ProgressBar::new(ids.len() as u64);
        b.set_style(
            indicatif::ProgressStyle::with_template(
                "{spinner} {pos}/{len} finished [{elapsed_precise}] {wide_bar} {msg}",
            )
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
        );
        b.enable_steady_tick(Duration::from_millis(200));
        b
    });
    let single = ids.len() == 1;
    let deadline = timeout.map(|t| tokio::time::Instant::now() + t);
    let mut failed = 0u64;
    let mut print_err: Option<anyhow::Error> = None;
    let done = conn
        .wait_results(ids, since_seq, deadline, |r| {
            // `running`/`queued` records are progress, not attempts.
            if matches!(r.status, Status::Running | Status::Queued) {
                return;
            }
            if !r.is_final {
                let msg = retry_note(r);
                match &bar {
                    Some(b) => b.println(msg),
                    None => eprintln!("{msg}"),
                }
                return;
            }
            if r.status != Status::Success {
                failed += 1;
            }
            let res = print_final(r, json, single, colour);
            if let Err(e) = res {
                print_err.get_or_insert(e);
            }
            if let Some(b) = &bar {
                b.inc(1);
                if failed > 0 {
                    b.set_message(format!("{failed} not successful"));
                }
            }
        })
        .await?;
    if let Some(b) = bar {
        b.finish_and_clear();
    }
    if let Some(e) = print_err {
        return Err(e);
    }
    let missing: Vec<&String> = ids.iter().filter(|i| !done.contains_key(*i)).collect();
    if !missing.is_empty() {
        let shown: Vec<&str> = missing.iter().take(10).map(|s| s.as_str()).collect();
        eprintln!(
            "jetworker: gave up waiting: {} of {} task(s) have no final result yet: {}{}",
            missing.len(),
            ids.len(),
            shown.join(", "),
            if missing.len() > 10 { ", …" } else { "" }
        );
        return Ok(Exit::NotSucceeded);
    }
    Ok(if done.values().all(|r| r.status == Status::Success) {
        Exit::Ok
    } else {
        Exit::NotSucceeded
    })
}

/// A non-final attempt, for stderr:
/// `jetworker: <id> attempt 1/3 failed (exit 1): <error>; retrying in 2s`.
fn retry_note(r: &TaskResult) -> String {
    let mut s = format!(
        "jetworker: {} attempt {}/{} {}",
        r.id, r.attempt, r.max_attempts, r.status
    );
    if let Some(c) = r.exit_code {
        s.push_str(&format!(" (exit {c})"));
    }
    if let Some(e) = &r.error {
        s.push_str(&format!(": {}", output::first_line(e, 120)));
    }
    match r.retry_in_ms {
        Some(ms) => s.push_str(&format!(
            "; retrying in {}",
            output::short_duration(Duration::from_millis(ms))
        )),
        None => s.push_str("; it will be retried"),
    }
    s
}

/// Warn (stderr) when no online worker serves `label`: the task then waits
/// in the queue, and a waiter would otherwise wait without a hint.
async fn warn_if_unserved(conn: &Conn, label: &str) {
    let Ok(store) = conn.js.get_key_value(&conn.names.workers_bucket).await else {
        eprintln!(
            "jetworker: no worker has ever run here; {label} tasks wait in the queue until one serves the label (jetworker run --labels {label})"
        );
        return;
    };
    let Ok(all) = crate::queues::online_workers(&store).await else {
        return;
    };
    if !all.iter().any(|hb| hb.labels.iter().any(|l| l == label)) {
        eprintln!(
            "jetworker: no worker online serves label {label} ({} online); the task waits in the queue until one does (jetworker run --labels {label})",
            all.len()
        );
    }
}

/// One final result: a JSON line, or a summary line (and, for a single
/// task, its output).
fn print_final(r: &TaskResult, json: bool, single: bool, colour: bool) -> anyhow::Result<()> {
    if json {
        return output::json_line(r);
    }
    let mut o = std::io::stdout().lock();
    writeln!(o, "{}", summary(r, colour))?;
    if single && !r.output.is_empty() {
        o.write_all(r.output.as_bytes())?;
        if !r.output.ends_with('\n') {
            o.write_all(b"\n")?;
        }
        if r.output_truncated {
            writeln!(o, "[output truncated: {} bytes in all]", r.output_bytes)?;
        }
    }
    o.flush()?;
    Ok(())
}

/// `<id> <status> attempt 1/3 12ms exit 0 on <worker>: <error>`.
pub fn summary(r: &TaskResult, colour: bool) -> String {
    let mut s = format!(
        "{} {} (attempt {}/{}, {}",
        r.id,
        status_text(r.status, colour),
        r.attempt,
        r.max_attempts,
        output::short_duration(Duration::from_millis(r.duration_ms)),
    );
    if let Some(c) = r.exit_code {
        s.push_str(&format!(", exit {c}"));
    }
    if let Some(sig) = &r.signal {
        s.push_str(&format!(", signal {sig}"));
    }
    if let Some(h) = r.http_status {
        s.push_str(&format!(", http {h}"));
    }
    if !r.worker_id.is_empty() {
        s.push_str(&format!(", worker {}", r.worker_id));
    }
    s.push(')');
    if let Some(e) = &r.error {
        s.push_str(&format!(": {e}"));
    }
    s
}
