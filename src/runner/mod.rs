//! Task runners: one per task type. The worker builds a [`RunContext`]
//! (effective timeout, output cap, environment, stop signal) and calls
//! [`Runners::run`]; each runner returns an [`Outcome`] and never panics or
//! errors out: every failure is an outcome with a reason.
//!
//! Runners enforce the timeout and the stop signal themselves, because how
//! to stop differs (a process group, a container); the process and
//! container runners share one clock for it ([`supervise`]).

pub mod command;
pub mod container;
pub mod http;
mod supervise;

use std::collections::BTreeMap;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::output::{Captured, LiveOutput};
use crate::protocol::{Status, Task, TaskKind, TaskType};

/// Why an attempt is being stopped; decides what the worker does with the
/// message afterwards.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StopKind {
    /// An operator cancelled it: final `cancelled`, Ack.
    Cancelled,
    /// The worker is shutting down: no result, Nak for immediate redelivery.
    Shutdown,
    /// The worker was cut off longer than ack wait: the task is someone
    /// else's now; non-final `cancelled`, never acked.
    LeaseLost,
}

/// A request to stop a running attempt, with the reason that ends up in the
/// result's `error`. The first request wins.
#[derive(Clone, Default)]
pub struct Stop {
    token: CancellationToken,
    reason: Arc<OnceLock<(StopKind, String)>>,
}

impl Stop {
    pub fn new() -> Self {
        Self::default()
    }
    /// Ask the attempt to stop.
    pub fn fire(&self, kind: StopKind, reason: impl Into<String>) {
        let _ = self.reason.set((kind, reason.into()));
        self.token.cancel();
    }
    pub fn is_fired(&self) -> bool {
        self.token.is_cancelled()
    }
    pub async fn fired(&self) {
        self.token.cancelled().await
    }
    /// Kind and reason, once fired.
    pub fn reason(&self) -> Option<(StopKind, String)> {
        self.reason.get().cloned()
    }

    /// The reason as a result's `error` text.
    pub fn reason_text(&self) -> String {
        self.reason
            .get()
            .map(|r| r.1.clone())
            .unwrap_or_else(|| "cancelled".into())
    }
}

/// The `error` text of a timed-out attempt, the same for every runner.
pub fn timeout_reason(timeout: Duration) -> String {
    format!("timed out after {}", humantime::format_duration(timeout))
}

/// Everything a runner needs besides the task itself.
#[derive(Clone)]
pub struct RunContext {
    pub task: Arc<Task>,
    /// 1-based attempt number (the delivery count).
    pub attempt: u32,
    pub worker_id: String,
    /// Whole attempt, kill included.
    pub timeout: Duration,
    /// Between the polite stop (SIGTERM, docker stop) and the kill.
    pub kill_grace: Duration,
    /// Bytes of output kept for the result.
    pub output_cap: u64,
    /// The full task environment: reserved variables and the task's `env`
    /// (plus, for processes, the worker's base and pass-through variables).
    pub env: BTreeMap<String, String>,
    /// Fired on cancel, shutdown or lost lease.
    pub stop: Stop,
    /// Live output publisher (`logs.<id>`).
    pub live: Option<LiveOutput>,
}

/// What an attempt came to.
#[derive(Debug, Clone, PartialEq)]
pub struct Outcome {
    /// Success, Failed, Timeout or Cancelled.
    pub status: Status,
    pub exit_code: Option<i32>,
    pub signal: Option<String>,
    pub http_status: Option<u16>,
    pub output: Captured,
    pub error: Option<String>,
    /// The attempt can never succeed on retry (the program does not exist
    /// or cannot be executed): the worker makes the result final at once.
    pub permanent: bool,
}

impl Outcome {
    /// A failure before anything ran (spawn error, docker unreachable).
    pub fn failed(error: impl Into<String>) -> Self {
        Outcome {
            status: Status::Failed,
            exit_code: None,
            signal: None,
            http_status: None,
            output: Captured::default(),
            error: Some(error.into()),
            permanent: false,
        }
    }

    /// A program that can never start: final at once, no retries.
    pub fn cannot_start(error: impl Into<String>) -> Self {
        Outcome {
            permanent: true,
            ..Outcome::failed(format!("{} (not retried)", error.into()))
        }
    }
}

/// The runners of one worker, built once at start-up.
pub struct Runners {
    pub process: command::ProcessRunner,
    pub http: http::HttpRunner,
    pub container: container::ContainerRunner,
}

impl Runners {
    /// Run one attempt.
    pub async fn run(&self, ctx: RunContext) -> Outcome {
        match &ctx.task.kind {
            TaskKind::Shell { .. } | TaskKind::Command { .. } => self.process.run(ctx).await,
            TaskKind::Http(_) => self.http.run(ctx).await,
            TaskKind::Container(_) => self.container.run(ctx).await,
        }
    }

    /// Types that can run on this machine (container needs a reachable
    /// Docker Engine).
    pub async fn available(&self) -> Vec<TaskType> {
        let mut v = vec![TaskType::Shell, TaskType::Command, TaskType::Http];
        if self.container.available().await {
            v.push(TaskType::Container);
        }
        v
    }
}
