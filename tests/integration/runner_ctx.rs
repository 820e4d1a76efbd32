//! Helpers for the runner-level tests (`http`, `container`): a validated
//! task from JSON and the [`RunContext`] the worker would hand a runner,
//! so that runners can be exercised without a broker.

#![allow(dead_code)]

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use jetworker::protocol::{parse_task, Envelope, Task, ValidationLimits};
use jetworker::runner::{RunContext, Stop};

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

/// The reserved variables (DESIGN.md 3.1) plus the task's `env`.
pub fn task_env(task: &Task, attempt: u32) -> BTreeMap<String, String> {
    let mut env = BTreeMap::new();
    env.insert("IDEMPOTENCY_KEY".into(), task.idempotency_key.clone());
    env.insert("SCHEDULE_INSTANCE_ID".into(), task.id.clone());
    env.insert("ATTEMPT".into(), attempt.to_string());
    if let Some(s) = task.shard {
        env.insert("SHARD_NO".into(), s.no.to_string());
        env.insert("SHARD_TOTAL".into(), s.total.to_string());
    }
    env.extend(task.env.clone());
    env
}

/// A first-attempt context with the given timeout and a 1s kill grace.
pub fn context(task: Arc<Task>, timeout: Duration) -> RunContext {
    let env = task_env(&task, 1);
    RunContext {
        task,
        attempt: 1,
        worker_id: "test-runner".into(),
        timeout,
        kill_grace: Duration::from_secs(1),
        output_cap: TEST_OUTPUT_CAP,
        env,
        stop: Stop::new(),
        live: None,
    }
}
