//! `jetworker status <id>`: where one task stands, for people and for
//! scripts. The state is [`crate::queues::task_status`]'s; this module
//! prints it and turns it into the exit code:
//!
//! | exit | state |
//! |---|---|
//! | 0 | final, `success` |
//! | 1 | final, any other status |
//! | 3 | not final yet: running, retrying, or waiting for an attempt |
//! | 4 | unknown id: no record, not in the task stream |
//! | 2 | usage or connection error |
//!
//! `--json`: one [`crate::queues::TaskStatus`] line.

use std::time::Duration;

use chrono::Utc;
use clap::Args;

use super::common::Conn;
use super::output::{self, colour_enabled, status_text};
use super::Exit;
use crate::protocol::Status;
use crate::queues::{self, TaskState, TaskStatus};

#[derive(Debug, Clone, Args)]
#[command(after_help = "\
Exit codes: 0 final success, 1 final non-success, 3 not final yet
(running, retrying, waiting), 4 unknown id, 2 usage or connection error.

Examples:
  jetworker status 3f9a2c
  until jetworker status 3f9a2c >/dev/null; [ $? -ne 3 ]; do sleep 1; done")]
pub struct StatusArgs {
    /// Task id.
    pub id: String,
    /// Print one JSON line instead of text.
    #[arg(long)]
    pub json: bool,
}

/// The exit code of a state.
pub fn exit_of(st: &TaskStatus) -> Exit {
    match st.state {
        TaskState::Final => match &st.record {
            Some(r) if r.status == Status::Success => Exit::Ok,
            _ => Exit::NotSucceeded,
        },
        TaskState::Running | TaskState::Retrying | TaskState::Waiting => Exit::NotFinal,
        TaskState::Unknown => Exit::Unknown,
    }
}

/// One line (two with a note) saying where the task stands.
fn describe(st: &TaskStatus, colour: bool) -> String {
    let now = Utc::now();
    let id = output::bold(&st.id, colour);
    let label = st.label.as_deref().unwrap_or("?");
    let Some(r) = &st.record else {
        return match (st.state, st.published_at) {
            (TaskState::Waiting, Some(t)) => format!(
                "{id}: waiting for its first attempt (label {label}, published {})",
                output::ago(t, now)
            ),
            _ => {
                let mut s = format!("{id}: unknown: no record and not in the task stream");
                if let Some(n) = &st.note {
                    s.push_str(&format!("\n  ({n})"));
                }
                s
            }
        };
    };
    let attempt = format!("attempt {}/{}", r.attempt, r.max_attempts);
    match st.state {
        TaskState::Running => {
            let holder = if st.worker_online == Some(true) {
                "online"
            } else {
                "offline: the next delivery takes it over"
            };
            format!(
                "{id}: running on {} ({holder}) since {} ({}), {attempt}, label {label}",
                r.worker_id,
                output::timestamp(r.started_at),
                output::ago(r.started_at, now)
            )
        }
        TaskState::Retrying => {
            let when = match st.next_attempt_at {
                Some(t) if t > now => format!(
                    "next attempt in {}",
                    output::short_duration((t - now).to_std().unwrap_or_default())
                ),
                _ => "next attempt due now".to_string(),
            };
            format!(
                "{id}: retrying: {attempt} ended {} {}; {when}, label {label}",
                status_text(r.status, colour),
                output::ago(r.finished_at, now)
            )
        }
        TaskState::Waiting => {
            let why = match r.status {
                Status::Queued => "handed back at a worker's shutdown",
                _ => r.error.as_deref().unwrap_or("not final"),
            };
            format!(
                "{id}: waiting for attempt {}/{} ({why}, {}), label {label}",
                r.attempt + 1,
                r.max_attempts,
                output::ago(r.finished_at, now)
            )
        }
        TaskState::Final | TaskState::Unknown => {
            let mut s = format!(
                "{id}: final: {} ({attempt}, {}, worker {}, finished {})",
                status_text(r.status, colour),
                output::short_duration(Duration::from_millis(r.duration_ms)),
                r.worker_id,
                output::ago(r.finished_at, now)
            );
            if let Some(e) = &r.error {
                s.push_str(&format!("\n  error: {}", output::first_line(e, 200)));
            }
            s
        }
    }
}

pub async fn run(ctx: &super::Ctx, args: StatusArgs) -> anyhow::Result<Exit> {
    let conn = Conn::open(ctx).await?;
    let st = queues::task_status(&conn.js, &conn.names, &args.id).await?;
    if args.json {
        output::json_line(&st)?;
    } else {
        output::line(&describe(&st, colour_enabled()))?;
    }
    Ok(exit_of(&st))
}
