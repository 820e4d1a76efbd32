//! Task types: the [`Runner`] trait, one runner per type, and the
//! [`Registry`] that holds them by name.
//!
//! A runner names its type, declares and validates its own fields (into
//! its own spec, before anything runs) and runs one attempt with a
//! [`RunContext`] (effective timeout, output cap, environment, stop
//! signal), returning an [`Outcome`]: it never panics or errors out, every
//! failure is an outcome with a reason. The built-in types (`shell`,
//! `command`, `http`, `container`) are runners like any other; so are the
//! types defined in the worker's config ([`defined`]) and async Rust
//! functions ([`in_process`]).
//!
//! Runners enforce the timeout and the stop signal themselves, because how
//! to stop differs (a process group, a container, a future); the process and
//! container runners share one clock for it (`supervise`).

pub(crate) mod command;
pub(crate) mod container;
pub mod defined;
pub(crate) mod http;
pub mod in_process;
mod registry;
pub(crate) mod shell;
mod supervise;

pub use crate::output::{Captured, LiveOutput, OutputSink, StreamKind};
pub(crate) use registry::{check_type_name, AnySpec};
pub use registry::{fields_schema_of, Registry};

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use serde::de::DeserializeOwned;
use tokio_util::sync::CancellationToken;

use crate::protocol::{Invalid, Status, Task};

/// A task type: validates its own fields and runs attempts.
///
/// ```ignore
/// struct Echo;
/// impl Runner for Echo {
///     type Spec = String;
///     fn name(&self) -> &str { "echo" }
///     fn fields_schema(&self) -> serde_json::Value { fields_schema_of::<EchoFields>() }
///     fn validate(&self, f: &Fields, _t: &Task) -> Result<String, Invalid> {
///         Ok(f.parse::<EchoFields>()?.text)
///     }
///     async fn run(&self, text: &String, ctx: RunContext) -> Outcome {
///         Outcome::success(text.clone())
///     }
/// }
/// ```
pub trait Runner: Send + Sync + 'static {
    /// What validation makes of a task's fields; what [`Runner::run`] gets.
    type Spec: Send + Sync + 'static;

    /// The name tasks give in `type` (`[a-z][a-z0-9_-]{0,63}`).
    fn name(&self) -> &str;

    /// The JSON Schema of the type's own fields: an object schema whose
    /// `properties` name every field the type takes (usually
    /// [`fields_schema_of`] of a `#[derive(JsonSchema)]` struct). Fields
    /// not named here are refused before [`Runner::validate`] is called.
    fn fields_schema(&self) -> serde_json::Value;

    /// Check the type's fields (and whatever of the envelope matters, such
    /// as `task.env` or `task.limits`) and build the spec. An error names
    /// the field; the task becomes `rejected` without running.
    fn validate(&self, fields: &Fields, task: &Task) -> Result<Self::Spec, Invalid>;

    /// Run one attempt. Honour `ctx.timeout` and `ctx.stop` (or use a
    /// runner that does, such as [`in_process`]); write output to an
    /// [`crate::output::OutputSink`] made from the context.
    fn run(&self, spec: &Self::Spec, ctx: RunContext) -> impl Future<Output = Outcome> + Send;

    /// Whether the type can run on this machine now (container: a Docker
    /// Engine answers). Types that cannot are not advertised in
    /// heartbeats unless the worker's `types` names them.
    fn available(&self) -> impl Future<Output = bool> + Send {
        async { true }
    }
}

/// Run one attempt of `ctx.task` with `runner` directly (the registry
/// does this for the worker; tests and tools may too). The task must have
/// been validated by a runner with the same spec type; otherwise the
/// attempt fails saying so.
pub async fn run_attempt<R: Runner>(runner: &R, ctx: RunContext) -> Outcome {
    let spec = ctx
        .task
        .spec
        .0
        .clone()
        .and_then(|s| s.downcast::<R::Spec>().ok());
    match spec {
        Some(spec) => runner.run(&spec, ctx).await,
        None => Outcome::failed(format!(
            "internal error: the task was not validated by the {} runner",
            runner.name()
        )),
    }
}

/// A shared runner is a runner (the worker keeps a handle on some).
impl<R: Runner> Runner for Arc<R> {
    type Spec = R::Spec;
    fn name(&self) -> &str {
        (**self).name()
    }
    fn fields_schema(&self) -> serde_json::Value {
        (**self).fields_schema()
    }
    fn validate(&self, fields: &Fields, task: &Task) -> Result<Self::Spec, Invalid> {
        (**self).validate(fields, task)
    }
    fn run(&self, spec: &Self::Spec, ctx: RunContext) -> impl Future<Output = Outcome> + Send {
        (**self).run(spec, ctx)
    }
    fn available(&self) -> impl Future<Output = bool> + Send {
        (**self).available()
    }
}

/// A task's own fields: everything in the message besides the envelope
/// (DESIGN.md section 3), as given.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Fields(pub(crate) serde_json::Map<String, serde_json::Value>);

impl Fields {
    /// A field's value, if given.
    pub fn get(&self, name: &str) -> Option<&serde_json::Value> {
        self.0.get(name)
    }

    /// The names given.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.0.keys().map(String::as_str)
    }

    /// Deserialize the fields into a struct; a field of the wrong type is
    /// an error naming it (`args[1]`).
    pub fn parse<T: DeserializeOwned>(&self) -> Result<T, Invalid> {
        crate::protocol::deserialize_named(serde_json::Value::Object(self.0.clone()))
    }
}

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
    /// A signal not fired yet.
    pub fn new() -> Self {
        Self::default()
    }
    /// Ask the attempt to stop.
    pub fn fire(&self, kind: StopKind, reason: impl Into<String>) {
        let _ = self.reason.set((kind, reason.into()));
        self.token.cancel();
    }
    /// Wait until the signal fires (at once if it has).
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

/// Everything a runner needs besides the task itself. Built with
/// [`RunContext::new`] (the worker and tests alike), then adjusted.
#[derive(Clone)]
pub struct RunContext {
    /// The validated task.
    pub task: Arc<Task>,
    /// 1-based attempt number (the delivery count).
    pub attempt: u32,
    /// The id of the worker running it.
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

impl RunContext {
    /// The context of attempt `attempt` of `task`: the task's timeout (else
    /// `default_timeout`), its output limit within `output_cap`, the
    /// reserved variables and the task's `env`, a fresh stop signal and no
    /// live output.
    pub fn new(
        task: Arc<Task>,
        attempt: u32,
        worker_id: &str,
        default_timeout: Duration,
        kill_grace: Duration,
        output_cap: u64,
    ) -> Self {
        let output_cap = task.limits.output.map_or(output_cap, |o| o.min(output_cap));
        RunContext {
            timeout: task.timeout.unwrap_or(default_timeout),
            env: task_env(&task, attempt),
            task,
            attempt,
            worker_id: worker_id.to_string(),
            kill_grace,
            output_cap,
            stop: Stop::new(),
            live: None,
        }
    }
}

/// What an attempt came to.
#[derive(Debug, Clone, PartialEq)]
pub struct Outcome {
    /// Success, Failed, Timeout or Cancelled.
    pub status: Status,
    /// A process's or container's exit code.
    pub exit_code: Option<i32>,
    /// The signal that killed the process (`SIGKILL`).
    pub signal: Option<String>,
    /// An HTTP response's status.
    pub http_status: Option<u16>,
    /// What the attempt printed, within the cap.
    pub output: Captured,
    /// Why it did not succeed, in words.
    pub error: Option<String>,
    /// The attempt can never succeed on retry (the program does not exist
    /// or cannot be executed): the worker makes the result final at once.
    pub permanent: bool,
}

impl Outcome {
    /// A success with this output.
    pub fn success(output: Captured) -> Self {
        Outcome {
            status: Status::Success,
            exit_code: None,
            signal: None,
            http_status: None,
            output,
            error: None,
            permanent: false,
        }
    }

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

    /// What a validation-only runner (the CLI's) answers if asked to run.
    pub(crate) fn validation_only() -> Self {
        Outcome::failed("internal error: a validation-only runner cannot run tasks")
    }

    /// A program that can never start: final at once, no retries.
    pub fn cannot_start(error: impl Into<String>) -> Self {
        Outcome {
            permanent: true,
            ..Outcome::failed(format!("{} (not retried)", error.into()))
        }
    }
}

/// The reserved variables (DESIGN.md section 3), then the task's `env`
/// (which validation keeps from overriding them).
fn task_env(task: &Task, attempt: u32) -> BTreeMap<String, String> {
    let mut env = BTreeMap::new();
    env.insert("IDEMPOTENCY_KEY".to_string(), task.idempotency_key.clone());
    env.insert("SCHEDULE_INSTANCE_ID".to_string(), task.id.clone());
    env.insert("ATTEMPT".to_string(), attempt.to_string());
    if let Some(s) = task.shard {
        env.insert("SHARD_NO".to_string(), s.no.to_string());
        env.insert("SHARD_TOTAL".to_string(), s.total.to_string());
    }
    if let Some(p) = &task.parent {
        env.insert("PARENT_ID".to_string(), p.clone());
    }
    if let Some(s) = &task.join_summary {
        let json = serde_json::to_string(s).expect("a summary serializes");
        env.insert("JOIN_SUMMARY".to_string(), json);
    }
    for (k, v) in &task.env {
        env.insert(k.clone(), v.clone());
    }
    env
}
