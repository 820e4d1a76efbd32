//! The one supervision clock of the process and container runners: output
//! into the sink while the attempt runs; at the deadline minus the grace
//! the polite stop (SIGTERM, `docker stop`) and at the deadline the kill;
//! on a stop request the polite stop and the kill a grace later; after the
//! exit, the output drained for a short while; and the classification of
//! what happened into `cancelled` / `timeout` (the runner classifies a
//! plain exit itself).

use std::time::Duration;

use tokio::time::{sleep_until, Instant};

use super::{timeout_reason, RunContext};
use crate::output::OutputSink;
use crate::protocol::Status;

/// Where an attempt's output comes from.
pub(crate) trait OutputSource {
    /// Read what is available into `sink`; false once everything is read.
    async fn read_into(&mut self, sink: &mut OutputSink) -> bool;
}

/// What the clock stops.
pub(crate) trait Supervised {
    /// How the attempt ended.
    type Exit;
    /// Wait for the end (cancel-safe: called again after other events).
    async fn wait(&mut self) -> Result<Self::Exit, String>;
    /// Ask it to stop; the kill follows `grace` later unless it is gone.
    fn term(&mut self, grace: Duration);
    /// Stop it now.
    async fn kill(&mut self);
}

/// What the clock saw.
pub(crate) struct Supervision<E> {
    /// `None` when it never reported an end.
    pub exit: Option<Result<E, String>>,
    pub timed_out: bool,
    pub stopped: bool,
}

impl<E> Supervision<E> {
    /// `cancelled` or `timeout` with their reason, if the clock ended it.
    pub fn stopped_by_clock(&self, ctx: &RunContext) -> Option<(Status, String)> {
        if self.stopped {
            Some((Status::Cancelled, ctx.stop.reason_text()))
        } else if self.timed_out {
            Some((Status::Timeout, timeout_reason(ctx.timeout)))
        } else {
            None
        }
    }
}

/// Timings that differ between runners.
pub(crate) struct Clock {
    /// How long to keep reading output after the end.
    pub drain: Duration,
    /// After the kill, how long to wait for the end before giving up
    /// (`None`: wait as long as it takes).
    pub kill_confirm: Option<Duration>,
    /// What is supervised, for the give-up message ("the container").
    pub what: &'static str,
    /// How it is killed, for the same message ("SIGKILL", "the abort").
    pub kill: &'static str,
}

/// Drive one attempt from start to end. `deadline` is the end of the
/// whole attempt, kill included.
pub(crate) async fn supervise<S: Supervised, O: OutputSource>(
    target: &mut S,
    output: &mut O,
    sink: &mut OutputSink,
    ctx: &RunContext,
    deadline: Instant,
    clock: Clock,
) -> Supervision<S::Exit> {
    // "Whole attempt, kill included": the polite stop comes early enough
    // that the kill still lands within the timeout.
    let grace = ctx.kill_grace.min(ctx.timeout / 10);
    let term_at = deadline - grace;
    let far = deadline + Duration::from_secs(10 * 365 * 24 * 3600);
    let mut s = Supervision {
        exit: None,
        timed_out: false,
        stopped: false,
    };
    let mut kill_at: Option<Instant> = None;
    let mut killed = false;
    let mut give_up_at: Option<Instant> = None;
    let mut output_done = false;
    let mut drain_until: Option<Instant> = None;

    while s.exit.is_none() || !output_done {
        let running = s.exit.is_none();
        tokio::select! {
            more = output.read_into(sink), if !output_done => {
                if !more {
                    output_done = true;
                }
            }
            w = target.wait(), if running => {
                s.exit = Some(w);
                drain_until = Some(Instant::now() + clock.drain);
            }
            _ = sleep_until(term_at), if running && !s.timed_out && !s.stopped => {
                s.timed_out = true;
                target.term(grace);
                kill_at = Some(deadline);
            }
            _ = ctx.stop.fired(), if running && !s.stopped && !s.timed_out => {
                s.stopped = true;
                // A lost lease means another copy may start soon: no grace.
                let grace = match ctx.stop.reason() {
                    Some((crate::runner::StopKind::LeaseLost, _)) => Duration::ZERO,
                    _ => ctx.kill_grace,
                };
                if !grace.is_zero() {
                    target.term(grace);
                }
                kill_at = Some(Instant::now() + grace);
            }
            _ = sleep_until(kill_at.unwrap_or(far)), if running && kill_at.is_some() && !killed => {
                killed = true;
                target.kill().await;
                give_up_at = clock.kill_confirm.map(|d| Instant::now() + d);
            }
            _ = sleep_until(give_up_at.unwrap_or(far)), if running && give_up_at.is_some() => {
                s.exit = Some(Err(format!(
                    "{} did not stop within {} of {}",
                    clock.what,
                    humantime::format_duration(clock.kill_confirm.unwrap_or_default()),
                    clock.kill
                )));
                output_done = true;
            }
            _ = sleep_until(drain_until.unwrap_or(far)), if drain_until.is_some() && !output_done => {
                output_done = true;
            }
        }
    }
    s
}
