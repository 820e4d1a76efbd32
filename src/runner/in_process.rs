//! Async Rust functions as task types: [`function`] makes a [`Runner`] of
//! an `async fn(fields, TaskContext) -> anyhow::Result<()>`.
//!
//! The function runs as its own tokio task under the same supervision clock
//! as processes and containers (`runner::supervise`):
//!
//! - **cancel and shutdown**: [`TaskContext::cancelled`] fires; a function
//!   that has not returned a kill grace later is aborted (dropped at its
//!   next `.await`). A lost lease aborts it at once;
//! - **timeout**: the same, at the task's timeout minus the grace;
//! - **output**: [`TaskContext::stdout`] and [`TaskContext::stderr`] are
//!   writers into the attempt's capture (and live output), bounded like a
//!   process's;
//! - **panics** are caught: the attempt is `failed` with the panic message,
//!   and the worker lives on.
//!
//! `Ok(())` is `success`; `Err(e)` is `failed` with `e` (and its causes) as
//! the error.

use std::future::Future;
use std::marker::PhantomData;
use std::sync::Arc;
use std::time::Duration;

use schemars::JsonSchema;
use serde::de::DeserializeOwned;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::supervise::{self, Clock, OutputSource, Supervised};
use super::{fields_schema_of, Fields, Outcome, RunContext, Runner};
use crate::output::{OutputSink, StreamKind};
use crate::protocol::{Invalid, Status, Task};

/// How long output written after the function returned is still taken.
const OUTPUT_DRAIN: Duration = Duration::from_millis(200);

/// A task type with no fields of its own.
#[derive(Debug, Clone, Default, serde::Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct NoFields {}

/// What an in-process function gets besides its fields.
pub struct TaskContext {
    task: Arc<Task>,
    attempt: u32,
    env: std::collections::BTreeMap<String, String>,
    cancel: CancellationToken,
    output: mpsc::UnboundedSender<(StreamKind, Vec<u8>)>,
}

impl TaskContext {
    /// The task (id, label, env, shard, …).
    pub fn task(&self) -> &Task {
        &self.task
    }

    /// The task's id.
    pub fn id(&self) -> &str {
        &self.task.id
    }

    /// 1-based attempt number.
    pub fn attempt(&self) -> u32 {
        self.attempt
    }

    /// The environment a process of this attempt would get (the reserved
    /// variables such as `IDEMPOTENCY_KEY` and the task's `env`).
    pub fn env(&self) -> &std::collections::BTreeMap<String, String> {
        &self.env
    }

    /// Completes when the attempt should stop (cancel, timeout, shutdown):
    /// return soon after, or be aborted a kill grace later.
    pub async fn cancelled(&self) {
        self.cancel.cancelled().await
    }

    /// Whether the attempt was asked to stop.
    pub fn is_cancelled(&self) -> bool {
        self.cancel.is_cancelled()
    }

    /// A writer into the attempt's standard output.
    pub fn stdout(&self) -> OutputWriter {
        OutputWriter {
            kind: StreamKind::Stdout,
            tx: self.output.clone(),
        }
    }

    /// A writer into the attempt's standard error.
    pub fn stderr(&self) -> OutputWriter {
        OutputWriter {
            kind: StreamKind::Stderr,
            tx: self.output.clone(),
        }
    }
}

/// Writes into an attempt's captured output (`std::io::Write`, so
/// `writeln!(out, …)` works). Never blocks; output past the attempt's cap
/// is counted, not kept.
#[derive(Clone)]
pub struct OutputWriter {
    kind: StreamKind,
    tx: mpsc::UnboundedSender<(StreamKind, Vec<u8>)>,
}

impl OutputWriter {
    /// Append bytes.
    pub fn write_bytes(&self, data: impl AsRef<[u8]>) {
        let data = data.as_ref();
        if !data.is_empty() {
            let _ = self.tx.send((self.kind, data.to_vec()));
        }
    }
}

impl std::io::Write for OutputWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.write_bytes(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// A task type run by an async function; made by [`function`].
pub struct FnRunner<T, F> {
    name: String,
    f: F,
    _fields: PhantomData<fn() -> T>,
}

/// A task type `name` whose fields deserialize into `T` (a
/// `#[derive(Deserialize, JsonSchema)]` struct, or [`NoFields`]) and which
/// runs `f`.
///
/// ```ignore
/// #[derive(Clone, Deserialize, JsonSchema)]
/// struct Greet { name: String }
/// let greet = function("greet", |f: Greet, ctx: TaskContext| async move {
///     writeln!(ctx.stdout(), "hello {}", f.name)?;
///     Ok(())
/// });
/// ```
pub fn function<T, F, Fut>(name: &str, f: F) -> FnRunner<T, F>
where
    T: DeserializeOwned + JsonSchema + Clone + Send + Sync + 'static,
    F: Fn(T, TaskContext) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = anyhow::Result<()>> + Send + 'static,
{
    FnRunner {
        name: name.to_string(),
        f,
        _fields: PhantomData,
    }
}

impl<T, F, Fut> Runner for FnRunner<T, F>
where
    T: DeserializeOwned + JsonSchema + Clone + Send + Sync + 'static,
    F: Fn(T, TaskContext) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = anyhow::Result<()>> + Send + 'static,
{
    type Spec = T;

    fn name(&self) -> &str {
        &self.name
    }

    fn fields_schema(&self) -> serde_json::Value {
        fields_schema_of::<T>()
    }

    fn validate(&self, fields: &Fields, _task: &Task) -> Result<T, Invalid> {
        fields.parse()
    }

    async fn run(&self, spec: &T, ctx: RunContext) -> Outcome {
        let (tx, rx) = mpsc::unbounded_channel();
        let cancel = CancellationToken::new();
        let tctx = TaskContext {
            task: ctx.task.clone(),
            attempt: ctx.attempt,
            env: ctx.env.clone(),
            cancel: cancel.clone(),
            output: tx,
        };
        let handle = tokio::spawn((self.f)(spec.clone(), tctx));
        let mut target = Spawned { handle, cancel };
        let mut source = Channel { rx };
        let mut sink = OutputSink::new(ctx.output_cap, ctx.live.clone(), ctx.attempt);
        let deadline = Instant::now() + ctx.timeout;
        let sup = supervise::supervise(
            &mut target,
            &mut source,
            &mut sink,
            &ctx,
            deadline,
            Clock {
                drain: OUTPUT_DRAIN,
                kill_confirm: Some(Duration::from_secs(1)),
                what: "the function",
                kill: "the abort",
            },
        )
        .await;
        target.handle.abort();
        let output = sink.finish().await;
        let (status, error) = match sup.stopped_by_clock(&ctx) {
            Some((status, reason)) => (status, Some(reason)),
            None => match sup.exit {
                Some(Ok(Ok(()))) => (Status::Success, None),
                Some(Ok(Err(e))) => (Status::Failed, Some(e)),
                Some(Err(e)) => (Status::Failed, Some(e)),
                None => (Status::Failed, Some("the function's end is unknown".into())),
            },
        };
        Outcome {
            status,
            exit_code: None,
            signal: None,
            http_status: None,
            output,
            error,
            permanent: false,
        }
    }
}

/// The function's tokio task, for the supervision clock.
struct Spawned {
    handle: JoinHandle<anyhow::Result<()>>,
    cancel: CancellationToken,
}

impl Supervised for Spawned {
    /// The function's own result, its error as text.
    type Exit = Result<(), String>;

    async fn wait(&mut self) -> Result<Result<(), String>, String> {
        match (&mut self.handle).await {
            Ok(r) => Ok(r.map_err(|e| format!("{e:#}"))),
            Err(e) if e.is_panic() => {
                let p = e.into_panic();
                let msg = p
                    .downcast_ref::<&str>()
                    .map(|s| s.to_string())
                    .or_else(|| p.downcast_ref::<String>().cloned())
                    .unwrap_or_else(|| "a non-text panic".into());
                Err(format!("panicked: {msg}"))
            }
            Err(_) => Err("aborted".into()),
        }
    }

    fn term(&mut self, _grace: Duration) {
        self.cancel.cancel();
    }

    async fn kill(&mut self) {
        self.cancel.cancel();
        self.handle.abort();
    }
}

/// The writers' channel, for the supervision clock.
struct Channel {
    rx: mpsc::UnboundedReceiver<(StreamKind, Vec<u8>)>,
}

impl OutputSource for Channel {
    async fn read_into(&mut self, sink: &mut OutputSink) -> bool {
        match self.rx.recv().await {
            Some((kind, data)) => {
                sink.push(kind, &data);
                true
            }
            None => false,
        }
    }
}
