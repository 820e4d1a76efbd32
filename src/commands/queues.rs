//! `jetworker queues`, `pause` and `resume`: the label queues as a table
//! (or JSON lines) and the switch that stops one. The numbers and the
//! pause itself are [`crate::queues`]'s; this module only prints them.
//!
//! `queues --json` prints one [`crate::queues::QueueStats`] per label and
//! line; `--watch` prints the table (or the lines) again every
//! `--interval`, clearing the screen first on a terminal.
//! `pause`/`resume --json` print one [`crate::queues::PauseState`].

use std::time::Duration;

use anyhow::anyhow;
use chrono::{DateTime, Utc};
use clap::Args;

use super::common::Conn;
use super::output::{self, colour_enabled, Table};
use super::Exit;
use crate::protocol::parse_duration;
use crate::queues::{self, PauseState, QueueStats};

#[derive(Debug, Clone, Args)]
#[command(after_help = "\
Examples:
  jetworker queues                        # every label: waiting, running, oldest, paused
  jetworker queues --watch --interval 5s
  jetworker queues --label gpu --json")]
pub struct QueuesArgs {
    /// Only this label.
    #[arg(long, short = 'l')]
    pub label: Option<String>,
    /// Keep running and show the queues again every --interval.
    #[arg(long, short = 'w')]
    pub watch: bool,
    /// Time between two readings with --watch.
    #[arg(long, default_value = "2s", value_name = "DURATION")]
    pub interval: String,
    /// Print JSON lines (one label per line) instead of a table.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Clone, Args)]
#[command(after_help = "\
Examples:
  jetworker pause gpu                     # until `jetworker resume gpu`
  jetworker pause gpu --for 10m
  jetworker pause gpu --until 2026-01-02T03:00:00Z")]
pub struct PauseArgs {
    /// The label whose workers stop taking new tasks (running ones go on).
    pub label: String,
    /// Resume by itself after this long (e.g. 10m).
    #[arg(long = "for", value_name = "DURATION", conflicts_with = "until")]
    pub duration: Option<String>,
    /// Resume by itself at this time (RFC 3339).
    #[arg(long, value_name = "TIME")]
    pub until: Option<String>,
    /// Print one JSON line instead of text.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Clone, Args)]
pub struct ResumeArgs {
    /// The paused label.
    pub label: String,
    /// Print one JSON line instead of text.
    #[arg(long)]
    pub json: bool,
}

/// `paused`, `paused 9m58s` (time left) or `no`.
fn paused_text(s: &QueueStats) -> String {
    match (s.paused, s.paused_until) {
        (false, _) => "no".into(),
        (true, None) => "paused".into(),
        (true, Some(u)) => format!(
            "paused {}",
            output::short_duration((u - s.read_at).to_std().unwrap_or_default())
        ),
    }
}

fn table(all: &[QueueStats], colour: bool) -> Table {
    let mut t = Table::new(
        &[
            "LABEL",
            "WAITING",
            "RUNNING",
            "DELAYED",
            "REDELIVERED",
            "OLDEST",
            "PAUSED",
            "SLOTS",
            "WORKERS",
        ],
        colour,
    );
    for s in all {
        let oldest = s
            .oldest_waiting_ms
            .map(|ms| output::short_duration(Duration::from_millis(ms)))
            .unwrap_or_else(|| "-".into());
        let workers = if s.workers.is_empty() {
            "none online".to_string()
        } else {
            s.workers.join(",")
        };
        t.push(vec![
            s.label.clone(),
            s.waiting.to_string(),
            s.running.to_string(),
            s.delayed.to_string(),
            s.redelivered.to_string(),
            oldest,
            paused_text(s),
            s.slots.to_string(),
            workers,
        ]);
    }
    t
}

pub async fn run(ctx: &super::Ctx, args: QueuesArgs) -> anyhow::Result<Exit> {
    let interval = parse_duration(&args.interval).map_err(|e| anyhow!("--interval: {e}"))?;
    let conn = Conn::open(ctx).await?;
    let colour = colour_enabled();
    loop {
        let all = queues::queue_stats(&conn.js, &conn.names, args.label.as_deref()).await?;
        if args.json {
            for s in &all {
                output::json_line(s)?;
            }
        } else {
            if args.watch && colour {
                // Redraw in place, like watch(1).
                print!("\x1b[H\x1b[2J");
            }
            if args.watch {
                output::line(&output::timestamp(Utc::now()))?;
            }
            if all.is_empty() {
                output::line(
                    match &args.label {
                        Some(l) => format!("no queue for label {l} (no consumer, no worker)"),
                        None => "no queues yet (start a worker or run `jetworker setup`)".into(),
                    }
                    .as_str(),
                )?;
            } else {
                table(&all, colour).print()?;
            }
        }
        if !args.watch {
            return Ok(Exit::Ok);
        }
        tokio::time::sleep(interval).await;
        if !args.json && !colour {
            output::line("")?;
        }
    }
}

fn report(p: &PauseState, json: bool) -> anyhow::Result<()> {
    if json {
        return output::json_line(p);
    }
    let text = match (p.paused, p.paused_until) {
        (false, _) => format!("{}: resumed; its workers take tasks again", p.label),
        (true, None) => format!(
            "{}: paused until `jetworker resume {}`; running tasks go on",
            p.label, p.label
        ),
        (true, Some(u)) => format!(
            "{}: paused until {}; running tasks go on",
            p.label,
            output::timestamp(u)
        ),
    };
    Ok(output::line(&text)?)
}

/// When a pause given as `--for` or `--until` ends (`None`: never).
fn pause_end(args: &PauseArgs) -> anyhow::Result<Option<DateTime<Utc>>> {
    if let Some(d) = &args.duration {
        let d = parse_duration(d).map_err(|e| anyhow!("--for: {e}"))?;
        let d = chrono::Duration::from_std(d).map_err(|e| anyhow!("--for: {e}"))?;
        return Ok(Some(Utc::now() + d));
    }
    if let Some(t) = &args.until {
        let t = DateTime::parse_from_rfc3339(t)
            .map_err(|e| anyhow!("--until: `{t}` is not an RFC 3339 time: {e}"))?
            .with_timezone(&Utc);
        if t <= Utc::now() {
            anyhow::bail!("--until: {t} is in the past");
        }
        return Ok(Some(t));
    }
    Ok(None)
}

pub async fn pause(ctx: &super::Ctx, args: PauseArgs) -> anyhow::Result<Exit> {
    let until = pause_end(&args)?;
    let conn = Conn::open(ctx).await?;
    let p = queues::pause(&conn.js, &conn.names, &args.label, until).await?;
    report(&p, args.json)?;
    Ok(Exit::Ok)
}

pub async fn resume(ctx: &super::Ctx, args: ResumeArgs) -> anyhow::Result<Exit> {
    let conn = Conn::open(ctx).await?;
    let p = queues::resume(&conn.js, &conn.names, &args.label).await?;
    report(&p, args.json)?;
    Ok(Exit::Ok)
}
