//! Helpers for the runner-level tests (`http`, `container`): a validated
//! task from JSON and the [`RunContext`] the worker would hand a runner,
//! so that runners can be exercised without a broker.

#![allow(dead_code)]

use std::sync::Arc;
use std::time::Duration;

use jetworker::internals::ContainerRunner;
use jetworker::internals::HttpRunner;
use jetworker::internals::{ProcessRunner, ProcessSpec};
use jetworker::protocol::{parse_task, Envelope, Task, ValidationLimits};
use jetworker::runner::{run_attempt, Outcome, RunContext};

/// Output cap used by runner tests (small, so truncation is easy to hit).
pub const TEST_OUTPUT_CAP: u64 = 64 * 1024;

/// Parse and validate a task message as the worker would.
pub fn task(json: &str) -> Arc<Task> {
    let env = Envelope {
        label: "default",
        stream_sequence: 1,
        ..Default::default()
    };
    Arc::new(
        parse_task(json.as_bytes(), &env, &ValidationLimits::default())
            .unwrap_or_else(|e| panic!("test task is invalid: {e}")),
    )
}

/// A first-attempt context with the given timeout and a 1s kill grace,
/// built by the worker's own constructor.
pub fn context(task: Arc<Task>, timeout: Duration) -> RunContext {
    RunContext::new(
        task,
        1,
        "test-runner",
        timeout,
        Duration::from_secs(1),
        TEST_OUTPUT_CAP,
    )
}

/// Run one attempt through a runner the test holds directly.
pub trait RunTask {
    /// Run `ctx.task` (validated by the built-in type of this runner).
    async fn run_task(&self, ctx: RunContext) -> Outcome;
}

impl RunTask for HttpRunner {
    async fn run_task(&self, ctx: RunContext) -> Outcome {
        run_attempt(self, ctx).await
    }
}

impl RunTask for ContainerRunner {
    async fn run_task(&self, ctx: RunContext) -> Outcome {
        run_attempt(self, ctx).await
    }
}

impl RunTask for ProcessRunner {
    async fn run_task(&self, ctx: RunContext) -> Outcome {
        let spec = ctx
            .task
            .spec::<ProcessSpec>()
            .expect("a shell or command task")
            .clone();
        self.run(&spec, ctx).await
    }
}
