//! The wire contract of DESIGN.md sections 2–4 and 6: subject and bucket
//! names, the task message as a person types it ([`TaskMessage`]), its
//! validated form ([`Task`]), the result message ([`TaskResult`]) and the
//! heartbeat value ([`Heartbeat`]).
//!
//! Validation lives here, not in the runners, so that every problem with a
//! task is found before anything runs and is reported as one `rejected`
//! result that names the field.

use std::collections::BTreeMap;
use std::time::Duration;

use chrono::{DateTime, Utc};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

mod downstream;
pub use downstream::{
    Child, Join, JoinPolicy, JoinState, JoinSummary, MAX_DOWNSTREAM_DEPTH, MAX_JOIN_SHARDS,
    MAX_TREE_TASKS,
};

/// Header carrying the result status, so that consumers can filter results
/// without parsing JSON.
pub const HEADER_STATUS: &str = "Jetworker-Status";
/// Header carrying the label of the task a result (or dead letter) is for.
pub const HEADER_LABEL: &str = "Jetworker-Label";
/// Header carrying the reason a task was dead-lettered.
pub const HEADER_REASON: &str = "Jetworker-Reason";
/// Header carrying the id of the task a dead letter belongs to.
pub const HEADER_TASK_ID: &str = "Jetworker-Task-Id";
/// Header on a DEAD copy that kept only the head of the original (too
/// large for `max_payload` with the headers): `kept the first N of M bytes`.
pub const HEADER_TRUNCATED: &str = "Jetworker-Truncated";
/// Header of a live-output chunk on `logs.<id>`: `stdout`, `stderr`, or
/// `eof` on the empty message that ends an attempt's output.
pub const HEADER_STREAM: &str = "Jetworker-Stream";
/// Header of the `eof` message: `true` when that attempt's result is final
/// (no retry follows), so followers know whether to keep listening.
pub const HEADER_FINAL: &str = "Jetworker-Final";
/// Header set by the server on a copy fired by a message schedule.
pub const HEADER_SCHEDULER: &str = "Nats-Scheduler";

/// Defaults from DESIGN.md section 3.
pub const DEFAULT_MAX_ATTEMPTS: u32 = 3;
/// Delay before the first retry.
pub const DEFAULT_BACKOFF: Duration = Duration::from_secs(1);
/// Each further retry waits this many times longer.
pub const DEFAULT_BACKOFF_FACTOR: f64 = 2.0;
/// Longest wait between retries.
pub const DEFAULT_MAX_BACKOFF: Duration = Duration::from_secs(300);
/// Upper bound for `retry.max_attempts`, so that a typo cannot make a task
/// retry forever.
pub const MAX_ATTEMPTS_LIMIT: u32 = 1000;
/// Upper bound for a task timeout (one week).
pub const MAX_TIMEOUT: Duration = Duration::from_secs(7 * 24 * 3600);

/// Environment variables the worker sets itself; a task's `env` may not
/// override them.
pub const RESERVED_ENV: &[&str] = &[
    "IDEMPOTENCY_KEY",
    "SHARD_NO",
    "SHARD_TOTAL",
    "SCHEDULE_INSTANCE_ID",
    "ATTEMPT",
    "PARENT_ID",
    "JOIN_SUMMARY",
];

/// Names of every stream, subject prefix and bucket (DESIGN.md section 2).
/// All overridable, so that several tenants can share one account.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(default, deny_unknown_fields)]
pub struct Names {
    /// WorkQueue stream holding tasks and schedules.
    pub tasks_stream: String,
    /// First token of task subjects (`tasks.<label>`).
    pub tasks_prefix: String,
    /// First token of schedule subjects, stored in the tasks stream.
    pub schedules_prefix: String,
    /// Limits stream holding results.
    pub results_stream: String,
    /// First token of result subjects (`results.<id>`).
    pub results_prefix: String,
    /// Stream holding dead letters.
    pub dead_stream: String,
    /// First token of dead-letter subjects (`dead.<label>.<id>`).
    pub dead_prefix: String,
    /// First token of the live-output subjects (`logs.<id>`, core NATS).
    pub logs_prefix: String,
    /// KV bucket of worker heartbeats.
    pub workers_bucket: String,
    /// KV bucket of cancellation requests.
    pub cancel_bucket: String,
    /// KV bucket of fan-in (join) progress, one key per join id.
    pub joins_bucket: String,
}

impl Default for Names {
    fn default() -> Self {
        Names {
            tasks_stream: "TASKS".into(),
            tasks_prefix: "tasks".into(),
            schedules_prefix: "schedules".into(),
            results_stream: "RESULTS".into(),
            results_prefix: "results".into(),
            dead_stream: "DEAD".into(),
            dead_prefix: "dead".into(),
            logs_prefix: "logs".into(),
            workers_bucket: "workers".into(),
            cancel_bucket: "cancel".into(),
            joins_bucket: "joins".into(),
        }
    }
}

impl Names {
    /// Where tasks of `label` are published: `tasks.<label>`.
    pub fn task_subject(&self, label: &str) -> String {
        format!("{}.{}", self.tasks_prefix, label)
    }
    /// The two filters of a label's consumer: exactly `tasks.<label>` and
    /// everything below it. They never overlap another label's filters.
    pub fn label_filters(&self, label: &str) -> Vec<String> {
        vec![
            format!("{}.{}", self.tasks_prefix, label),
            format!("{}.{}.>", self.tasks_prefix, label),
        ]
    }
    /// The queue-once subject of task `id` on `label`:
    /// `tasks.<label>.id.<id>`. Published with
    /// `Nats-Expected-Last-Subject-Sequence: 0`, a second copy is refused
    /// while one waits or runs (DESIGN.md section 5, "Downstream tasks").
    pub fn once_task_subject(&self, label: &str, id: &str) -> String {
        format!("{}.{label}.id.{id}", self.tasks_prefix)
    }
    /// The task id of a queue-once subject ([`Names::once_task_subject`]).
    pub fn once_task_id<'a>(&self, subject: &'a str) -> Option<&'a str> {
        let rest = subject
            .strip_prefix(&self.tasks_prefix)?
            .strip_prefix('.')?;
        let mut t = rest.split('.');
        let (label, id_token, id) = (t.next()?, t.next()?, t.next()?);
        (t.next().is_none() && id_token == "id" && valid_label(label) && valid_id(id)).then_some(id)
    }
    /// The durable consumer of `label`: `label-<label>`.
    pub fn consumer_name(&self, label: &str) -> String {
        format!("label-{label}")
    }
    /// The schedule `<name>`: `schedules.<name>`.
    pub fn schedule_subject(&self, name: &str) -> String {
        format!("{}.{}", self.schedules_prefix, name)
    }
    /// The one-shot schedule of a delayed task (`submit --in/--at`):
    /// `schedules.delayed.<id>`, fired once into `tasks.<label>`.
    pub fn delayed_subject(&self, id: &str) -> String {
        format!("{}.{DELAYED_TOKEN}.{id}", self.schedules_prefix)
    }
    /// The records of task `<id>`: `results.<id>`.
    pub fn result_subject(&self, id: &str) -> String {
        format!("{}.{}", self.results_prefix, id)
    }
    /// The DEAD copy of task `<id>`: `dead.<label>.<id>`.
    pub fn dead_subject(&self, label: &str, id: &str) -> String {
        format!("{}.{}.{}", self.dead_prefix, label, id)
    }
    /// Live output of task `<id>`: `logs.<id>`.
    pub fn logs_subject(&self, id: &str) -> String {
        format!("{}.{}", self.logs_prefix, id)
    }
    /// The label of a task subject (`tasks.<label>[.…]`), if it is one.
    pub fn label_of<'a>(&self, subject: &'a str) -> Option<&'a str> {
        let rest = subject
            .strip_prefix(&self.tasks_prefix)?
            .strip_prefix('.')?;
        let label = rest.split('.').next()?;
        valid_label(label).then_some(label)
    }
}

/// `[A-Za-z0-9_-]{1,64}`.
pub fn valid_label(s: &str) -> bool {
    !s.is_empty() && s.len() <= 64 && s.bytes().all(is_id_byte)
}

/// `[A-Za-z0-9_-]{1,128}`: safe as a subject token, a KV key and a file name.
pub fn valid_id(s: &str) -> bool {
    !s.is_empty() && s.len() <= 128 && s.bytes().all(is_id_byte)
}

fn is_id_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b == b'_' || b == b'-'
}

/// `shard`: which slice of a fanned-out job this task is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Shard {
    /// This shard's number: `0 <= no < total`.
    pub no: u32,
    /// Shards in the job.
    pub total: u32,
}

/// `retry`: the attempt budget and backoff of a task.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RetryMessage {
    /// Attempts in all, the first included (default 3).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_attempts: Option<u32>,
    /// Delay before the second attempt, humantime (default `1s`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub backoff: Option<String>,
    /// Multiplier per further attempt (default 2).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub factor: Option<f64>,
    /// Upper bound of the delay (default `5m`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_backoff: Option<String>,
}

/// `limits`: per-task resource limits; sizes accept `256MiB`, `1GB`, or
/// a number of bytes.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct LimitsMessage {
    /// Memory ceiling (`"256MiB"`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub memory: Option<SizeValue>,
    /// CPU share in cores (cgroup / docker), e.g. 1.5.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cpu: Option<f64>,
    /// CPU time in seconds (RLIMIT_CPU) for shell and command tasks.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cpu_seconds: Option<u64>,
    /// Maximum number of processes/threads.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pids: Option<u64>,
    /// Maximum number of open files.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub nofile: Option<u64>,
    /// Output cap for this task (never above the worker's).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub output: Option<SizeValue>,
}

/// A size given as a string with a unit or as a plain number of bytes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(untagged)]
pub enum SizeValue {
    /// A number of bytes.
    Bytes(u64),
    /// With a unit (`"256MiB"`).
    Text(String),
}

impl SizeValue {
    fn parse(&self, field: &str) -> Result<u64, Invalid> {
        match self {
            SizeValue::Bytes(n) => Ok(*n),
            SizeValue::Text(s) => parse_size(s).map_err(|e| Invalid::new(field, e)),
        }
    }
}

/// A size such as `256KiB`, `1 MiB`, `10MB` or `4096`.
pub fn parse_size(s: &str) -> Result<u64, String> {
    parse_size::Config::new()
        .with_binary()
        .parse_size(s.trim())
        .map_err(|e| format!("`{s}` is not a size like 256MiB ({e})"))
}

/// A size for people: `256KiB`, `1.5MiB`, `12B`.
pub fn format_size(b: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b as f64;
    let mut i = 0;
    while v >= 1024.0 && i < UNITS.len() - 1 {
        v /= 1024.0;
        i += 1;
    }
    if i == 0 || v.fract() == 0.0 {
        format!("{}{}", v as u64, UNITS[i])
    } else {
        format!("{v:.1}{}", UNITS[i])
    }
}

/// A duration such as `90s`, `5m`, `1h 30m`.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    humantime::parse_duration(s.trim())
        .map_err(|e| format!("`{s}` is not a duration like 90s or 5m ({e})"))
}

/// The task message exactly as it travels (DESIGN.md section 3): the
/// envelope, and the type's own fields in [`TaskMessage::fields`]. Every
/// field is optional here so that validation can name what is missing;
/// unknown fields are refused by validation, which knows the type's fields
/// ([`crate::runner::Registry`]).
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize, JsonSchema)]
#[schemars(
    title = "jetworker task",
    description = "A task message published on tasks.<label>"
)]
pub struct TaskMessage {
    /// The task type: shell, command, http, container, or a type
    /// registered on the label's workers.
    #[serde(rename = "type")]
    pub task_type: Option<String>,
    /// Instance id `[A-Za-z0-9_-]{1,128}`; default: the Nats-Msg-Id header or `seq-<n>`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    /// Exported as IDEMPOTENCY_KEY / X-Idempotency-Key; default: the instance id.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub idempotency_key: Option<String>,
    /// Which slice of a fanned-out job this task is.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub shard: Option<Shard>,
    /// Flat form of `shard.no`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub shard_no: Option<u32>,
    /// Flat form of `shard.total`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub shard_total: Option<u32>,
    /// Whole-attempt timeout, humantime (`"90s"`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub timeout: Option<String>,
    /// Whole-attempt timeout in seconds.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub timeout_seconds: Option<u64>,
    /// Attempts and the backoff between them.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub retry: Option<RetryMessage>,
    /// Deadline: an RFC 3339 time (`"2026-01-02T03:04:05Z"`) or a duration
    /// counted from when the message was stored (`"10m"`). A delivery after
    /// it does not run: final status `expired`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub expires: Option<String>,
    /// Extra environment; may not override the reserved names.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub env: Option<BTreeMap<String, String>>,
    /// Resource limits (memory, cpu, cpu_seconds, pids, nofile, output).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub limits: Option<LimitsMessage>,
    /// Tasks to queue when this one ends: a task object or an array of
    /// them, each queued on the statuses in its `on` (default success).
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "downstream::one_or_many"
    )]
    #[schemars(with = "Option<downstream::OneOrMany>")]
    pub then: Option<Vec<TaskMessage>>,
    /// Under `then` only: the final statuses that queue this task
    /// (default `["success"]`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub on: Option<Vec<Status>>,
    /// Under `then` or `then_all` only: the label to queue it on (default:
    /// the parent's).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub label: Option<String>,
    /// On a shard: the task (the join) queued once, after every shard of
    /// the fan-out is final.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub then_all: Option<Box<TaskMessage>>,
    /// Under `then_all` only: `all_success` (default: the join runs only if
    /// every shard succeeded) or `always`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub policy: Option<JoinPolicy>,
    /// Set by the worker that queued this task: the parent's id (a join's:
    /// the shards' base id); exported as PARENT_ID.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub parent: Option<String>,
    /// Set by the worker that queued a join: the shards' outcome; exported
    /// as JOIN_SUMMARY (JSON).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub join_summary: Option<JoinSummary>,
    /// The type's own fields (shell: `script`/`payload`; command:
    /// `command`, `args`; …), validated by the type's runner.
    #[serde(flatten)]
    #[schemars(skip)]
    pub fields: serde_json::Map<String, serde_json::Value>,
}

/// The envelope's field names: every task has them, whatever its type.
pub const ENVELOPE_FIELDS: &[&str] = &[
    "type",
    "id",
    "idempotency_key",
    "shard",
    "shard_no",
    "shard_total",
    "timeout",
    "timeout_seconds",
    "retry",
    "expires",
    "env",
    "limits",
    "then",
    "on",
    "label",
    "then_all",
    "policy",
    "parent",
    "join_summary",
];

impl TaskMessage {
    /// One of the type's own fields, if given.
    pub fn field(&self, name: &str) -> Option<&serde_json::Value> {
        self.fields.get(name)
    }

    /// Set one of the type's own fields.
    pub fn set_field(&mut self, name: &str, value: impl Into<serde_json::Value>) {
        self.fields.insert(name.to_string(), value.into());
    }

    /// Remove one of the type's own fields.
    pub fn remove_field(&mut self, name: &str) -> Option<serde_json::Value> {
        self.fields.remove(name)
    }
}

/// Why a task was refused: the field (a JSON path) and the problem. The
/// whole message (`(message)`) is not named in the text: its problem says
/// what it is about.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{}", if field == "(message)" { problem.clone() } else { format!("{field}: {problem}") })]
pub struct Invalid {
    /// The field (`retry.max_attempts`, `args[1]`), or `(message)`.
    pub field: String,
    /// What is wrong with it.
    pub problem: String,
}

impl Invalid {
    /// A problem with `field`.
    pub fn new(field: impl Into<String>, problem: impl Into<String>) -> Self {
        Invalid {
            field: field.into(),
            problem: problem.into(),
        }
    }

    /// The same problem in a task nested at `path` (`then[1]`).
    pub fn under(self, path: &str) -> Self {
        let field = if self.field == "(message)" {
            path.to_string()
        } else {
            format!("{path}.{}", self.field)
        };
        Invalid { field, ..self }
    }
}

/// Retry policy of a validated task.
#[derive(Debug, Clone, PartialEq)]
pub struct RetryPolicy {
    /// Attempts in all, the first included.
    pub max_attempts: u32,
    /// Delay before the first retry.
    pub backoff: Duration,
    /// Each further retry waits this many times longer.
    pub factor: f64,
    /// Longest wait between retries.
    pub max_backoff: Duration,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        RetryPolicy {
            max_attempts: DEFAULT_MAX_ATTEMPTS,
            backoff: DEFAULT_BACKOFF,
            factor: DEFAULT_BACKOFF_FACTOR,
            max_backoff: DEFAULT_MAX_BACKOFF,
        }
    }
}

impl RetryPolicy {
    /// The delay before the attempt after `attempt` (1-based):
    /// `backoff × factor^(attempt-1)`, capped at `max_backoff`.
    pub fn delay_after(&self, attempt: u32) -> Duration {
        let exp = attempt.saturating_sub(1).min(64) as i32;
        let secs = self.backoff.as_secs_f64() * self.factor.powi(exp);
        let max = self.max_backoff.as_secs_f64();
        Duration::from_secs_f64(if secs.is_finite() { secs.min(max) } else { max })
    }
}

/// Validated per-task limits (bytes, cores, counts).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Limits {
    /// Bytes of memory.
    pub memory: Option<u64>,
    /// A share of CPU, in cores.
    pub cpu: Option<f64>,
    /// CPU time, in seconds (RLIMIT_CPU).
    pub cpu_seconds: Option<u64>,
    /// Processes (the cgroup's `pids.max`, else RLIMIT_NPROC).
    pub pids: Option<u64>,
    /// Open files (RLIMIT_NOFILE).
    pub nofile: Option<u64>,
    /// Bytes of output kept for the result (within the worker's cap).
    pub output: Option<u64>,
}

/// A validated type spec, as the type's runner made it (`None`: the type
/// is not registered here). Compared by presence only: it is derived from
/// [`Task::fields`], which compare by value.
#[derive(Clone, Default)]
pub struct TypeSpec(pub(crate) Option<crate::runner::AnySpec>);

impl std::fmt::Debug for TypeSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.is_some() {
            "TypeSpec(..)"
        } else {
            "TypeSpec(none)"
        })
    }
}

impl PartialEq for TypeSpec {
    fn eq(&self, other: &Self) -> bool {
        self.0.is_some() == other.0.is_some()
    }
}

/// A task that passed validation: everything a runner needs.
#[derive(Debug, Clone, PartialEq)]
pub struct Task {
    /// The task's id (given, or derived from the message).
    pub id: String,
    /// The label (queue) it was published on.
    pub label: String,
    /// The type's name (`type`).
    pub task_type: String,
    /// The type's own fields, as given.
    pub fields: crate::runner::Fields,
    /// What the type's runner made of them.
    pub spec: TypeSpec,
    /// Exported as IDEMPOTENCY_KEY; default: the id.
    pub idempotency_key: String,
    /// Which slice of a fanned-out job this task is.
    pub shard: Option<Shard>,
    /// Whole-attempt timeout (`None`: the worker's default).
    pub timeout: Option<Duration>,
    /// Attempts and backoff.
    pub retry: RetryPolicy,
    /// When the task expires (`expires`, resolved against the message's
    /// stored time): no attempt starts after it.
    pub deadline: Option<DateTime<Utc>>,
    /// Extra environment (never a reserved name).
    pub env: BTreeMap<String, String>,
    /// Resource limits.
    pub limits: Limits,
    /// Tasks queued when this one ends, by status (`then`).
    pub then: Vec<Child>,
    /// On a shard: the join queued after every shard is final (`then_all`).
    pub join: Option<Join>,
    /// The task that queued this one (`parent`, PARENT_ID).
    pub parent: Option<String>,
    /// On a join: the shards' outcome (`join_summary`, JOIN_SUMMARY).
    pub join_summary: Option<JoinSummary>,
}

impl Task {
    /// The type's name.
    pub fn task_type(&self) -> &str {
        &self.task_type
    }

    /// Whether a runner of this worker validated the task (its type is
    /// registered here).
    pub fn runnable(&self) -> bool {
        self.spec.0.is_some()
    }

    /// The spec the type's runner made, if it is a `T`.
    pub fn spec<T: 'static>(&self) -> Option<&T> {
        self.spec.0.as_ref()?.downcast_ref::<T>()
    }

    /// Whether an attempt starting at `at` would start after the deadline.
    pub fn expired_at(&self, at: DateTime<Utc>) -> bool {
        self.deadline.is_some_and(|d| at > d)
    }
}

/// Where a message came from, as far as the task id is concerned.
#[derive(Debug, Clone, Default)]
pub struct Envelope<'a> {
    /// The label, from the subject.
    pub label: &'a str,
    /// `Nats-Msg-Id` header, if any.
    pub msg_id: Option<&'a str>,
    /// Stream sequence of the message.
    pub stream_sequence: u64,
    /// `Nats-Scheduler` header (the schedule subject), for cron firings.
    pub scheduler: Option<&'a str>,
    /// When the message was stored; a cron firing's scheduled time.
    pub published: Option<DateTime<Utc>>,
}

/// What fired a message, as its `Nats-Scheduler` header tells.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fired<'a> {
    /// Published directly (no schedule).
    Direct,
    /// A cron (or `schedule add --at`) firing of the schedule `<name>`:
    /// each firing is its own instance.
    Schedule {
        /// The schedule's name.
        name: &'a str,
    },
    /// A delayed task (`submit --in/--at`), stored on
    /// `<schedules prefix>.delayed.<id>`: it fires once and keeps its id.
    Delayed {
        /// The task's id.
        id: &'a str,
    },
}

/// The token after the schedules prefix that marks a delayed task's
/// one-shot schedule (`schedules.delayed.<id>`). Schedule names are single
/// tokens, so no cron schedule can collide with it.
pub const DELAYED_TOKEN: &str = "delayed";

impl Envelope<'_> {
    /// The id used when the JSON gives none (DESIGN.md section 3).
    pub fn fallback_id(&self) -> String {
        if let Fired::Delayed { id } = self.fired() {
            return id.to_string();
        }
        match self.msg_id {
            Some(h) if valid_id(h) => h.to_string(),
            _ => format!("seq-{}", self.stream_sequence),
        }
    }

    /// What fired this message: the schedule subject's tokens after the
    /// prefix (`schedules.<name>`, `schedules.delayed.<id>`).
    pub fn fired(&self) -> Fired<'_> {
        let Some(s) = self.scheduler else {
            return Fired::Direct;
        };
        let name = s.split_once('.').map(|(_, n)| n).unwrap_or(s);
        match name.split_once('.') {
            Some((DELAYED_TOKEN, id)) if valid_id(id) => Fired::Delayed { id },
            _ => Fired::Schedule { name },
        }
    }
}

/// The id under which a rejected message is reported: the JSON `id` if the
/// bytes are an object with a valid one (not for a cron firing, whose id
/// names the firing), else the envelope's fallback.
pub fn best_effort_id(bytes: &[u8], env: &Envelope<'_>) -> String {
    #[derive(Deserialize)]
    struct OnlyId {
        id: Option<serde_json::Value>,
    }
    if let Ok(OnlyId {
        id: Some(serde_json::Value::String(id)),
    }) = serde_json::from_slice::<OnlyId>(bytes)
    {
        if valid_id(&id) && !matches!(env.fired(), Fired::Schedule { .. }) {
            return id;
        }
    }
    env.fallback_id()
}

/// Options the worker passes to validation.
#[derive(Debug, Clone)]
pub struct ValidationLimits {
    /// Largest task message accepted.
    pub max_task_bytes: usize,
    /// The types whose fields are checked; a task of another type passes
    /// with its envelope checked only ([`Task::runnable`] is false).
    pub types: crate::runner::Registry,
}

impl Default for ValidationLimits {
    /// 256 KiB and the built-in types.
    fn default() -> Self {
        ValidationLimits {
            max_task_bytes: 256 * 1024,
            types: crate::runner::Registry::validators(Vec::new(), &[]),
        }
    }
}

/// Parse and validate a task message. The error names the field.
pub fn parse_task(
    bytes: &[u8],
    env: &Envelope<'_>,
    limits: &ValidationLimits,
) -> Result<Task, Invalid> {
    if bytes.len() > limits.max_task_bytes {
        return Err(Invalid::new(
            "(message)",
            format!(
                "task is {} bytes, more than max_task_bytes ({})",
                bytes.len(),
                limits.max_task_bytes
            ),
        ));
    }
    let msg = parse_message(bytes)?;
    validate(msg, env, limits)
}

/// Parse task JSON into the wire form, unvalidated (the worker validates
/// next; `submit --file` merges flags first). The error names the field,
/// with a "did you mean" for an unknown one.
pub fn parse_message(bytes: &[u8]) -> Result<TaskMessage, Invalid> {
    const LIKE: &str = r#"a task is a JSON object like {"type":"shell","payload":"echo hi"}"#;
    let text = std::str::from_utf8(bytes).map_err(|e| {
        Invalid::new(
            "(message)",
            format!("the task is not valid UTF-8 JSON ({e}); {LIKE}"),
        )
    })?;
    let value: serde_json::Value = serde_json::from_str(text).map_err(|e| {
        Invalid::new(
            "(message)",
            format!("the task is not valid JSON ({e}); {LIKE}"),
        )
    })?;
    if !value.is_object() {
        return Err(Invalid::new(
            "(message)",
            format!("task must be a JSON object, not {}", json_kind(&value)),
        ));
    }
    deserialize_named(value)
}

/// Deserialize JSON into `T`; the error names the field by its path
/// (`retry.max_attempts`, `args[1]`), with a "did you mean" for an unknown
/// one. The task message and every type's fields ([`crate::runner::Fields`])
/// go through here.
pub(crate) fn deserialize_named<T: serde::de::DeserializeOwned>(
    value: serde_json::Value,
) -> Result<T, Invalid> {
    serde_path_to_error::deserialize(value).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner().to_string();
        // serde names the offending key of an unknown field itself.
        let field = if path == "." {
            unknown_field_name(&inner).unwrap_or_else(|| "(message)".into())
        } else {
            path
        };
        Invalid::new(field, unknown_field_hint(&inner).unwrap_or(inner))
    })
}

/// serde's "unknown field `x`, expected one of `a`, `b`, …" (every field
/// of the object, 26 for a task) as "unknown field `x` (did you mean
/// `y`?)", pointing to `jetworker schema` for the list.
fn unknown_field_hint(msg: &str) -> Option<String> {
    let name = unknown_field_name(msg)?;
    let expected = msg.split_once("expected ").map(|(_, e)| e).unwrap_or("");
    let candidates: Vec<&str> = expected
        .split('`')
        .enumerate()
        .filter(|(i, _)| i % 2 == 1)
        .map(|(_, c)| c)
        .collect();
    Some(format!(
        "unknown field `{name}`{}; `jetworker schema` lists the fields",
        crate::suggest::hint(&name, candidates)
    ))
}

fn unknown_field_name(msg: &str) -> Option<String> {
    let rest = msg.strip_prefix("unknown field `")?;
    Some(rest.split('`').next()?.to_string())
}

pub(crate) fn json_kind(v: &serde_json::Value) -> &'static str {
    match v {
        serde_json::Value::Null => "null",
        serde_json::Value::Bool(_) => "a boolean",
        serde_json::Value::Number(_) => "a number",
        serde_json::Value::String(_) => "a string",
        serde_json::Value::Array(_) => "an array",
        serde_json::Value::Object(_) => "an object",
    }
}

/// A header value of a message, as text.
pub fn header(h: Option<&async_nats::HeaderMap>, name: &str) -> Option<String> {
    h?.get(name).map(|v| v.as_str().to_string())
}

/// A JetStream timestamp (the `time` crate's) as a chrono UTC time.
pub fn chrono_time(t: time::OffsetDateTime) -> DateTime<Utc> {
    DateTime::from_timestamp_nanos(t.unix_timestamp_nanos().clamp(0, i64::MAX as i128) as i64)
}

/// Format of a cron firing's scheduled time in its instance id.
pub fn instance_time(t: DateTime<Utc>) -> String {
    t.format("%Y%m%dT%H%M%SZ").to_string()
}

/// Validate a parsed task message against DESIGN.md section 3, with
/// every task under it (`then`, `then_all`): an invalid one anywhere
/// rejects the whole message, naming its path (`then[1].timeout`).
pub fn validate(
    msg: TaskMessage,
    env: &Envelope<'_>,
    limits: &ValidationLimits,
) -> Result<Task, Invalid> {
    validate_node(msg, env, limits, &mut downstream::Tree::default())
}

/// One task of a tree; `tree` counts the tasks and ids seen so far.
fn validate_node(
    mut msg: TaskMessage,
    env: &Envelope<'_>,
    limits: &ValidationLimits,
    tree: &mut downstream::Tree,
) -> Result<Task, Invalid> {
    let below = downstream::Fields::take(&mut msg)?;
    let task_type = msg.task_type.clone().ok_or_else(|| {
        Invalid::new(
            "type",
            format!("missing ({})", limits.types.names().join(", ")),
        )
    })?;
    crate::runner::check_type_name(&task_type)
        .map_err(|e| Invalid::new("type", format!("`{}` {e}", truncate_for_error(&task_type))))?;

    if let Some(id) = &msg.id {
        if !valid_id(id) {
            return Err(Invalid::new(
                "id",
                format!("`{}` is not [A-Za-z0-9_-]{{1,128}}", truncate_for_error(id)),
            ));
        }
    }
    let mut id = msg.id.clone().unwrap_or_else(|| env.fallback_id());
    let fired = env.fired();
    if let Fired::Schedule { name } = fired {
        // A cron firing: each scheduled time is its own instance.
        let base = msg.id.clone().unwrap_or_else(|| name.to_string());
        let when = env.published.unwrap_or_else(Utc::now);
        id = format!("{base}-{}", instance_time(when));
        if !valid_id(&id) {
            return Err(Invalid::new(
                "id",
                format!("instance id `{}` is too long", truncate_for_error(&id)),
            ));
        }
    }

    let idempotency_key = match &msg.idempotency_key {
        Some(k) if k.is_empty() || k.len() > 256 => {
            return Err(Invalid::new(
                "idempotency_key",
                "must be 1 to 256 characters",
            ))
        }
        Some(k) if k.chars().any(char::is_control) => {
            return Err(Invalid::new(
                "idempotency_key",
                "may not contain control characters",
            ))
        }
        Some(k) if matches!(fired, Fired::Schedule { .. }) => {
            format!("{k}-{}", id_suffix(&id))
        }
        Some(k) => k.clone(),
        None => id.clone(),
    };

    let shard = match (msg.shard, msg.shard_no, msg.shard_total) {
        (Some(_), Some(_), _) | (Some(_), _, Some(_)) => {
            return Err(Invalid::new(
                "shard",
                "give either `shard` or `shard_no`/`shard_total`, not both",
            ))
        }
        (Some(s), None, None) => Some(check_shard(s, "shard")?),
        (None, Some(no), Some(total)) => Some(check_shard(Shard { no, total }, "shard_no")?),
        (None, Some(_), None) => {
            return Err(Invalid::new("shard_total", "missing (shard_no is set)"))
        }
        (None, None, Some(_)) => {
            return Err(Invalid::new("shard_no", "missing (shard_total is set)"))
        }
        (None, None, None) => None,
    };

    let timeout = match (&msg.timeout, msg.timeout_seconds) {
        (Some(_), Some(_)) => {
            return Err(Invalid::new(
                "timeout",
                "give either `timeout` or `timeout_seconds`, not both",
            ))
        }
        (Some(t), None) => Some(check_timeout(
            parse_duration(t).map_err(|e| Invalid::new("timeout", e))?,
            "timeout",
        )?),
        (None, Some(s)) => Some(check_timeout(Duration::from_secs(s), "timeout_seconds")?),
        (None, None) => None,
    };

    let retry = match &msg.retry {
        None => RetryPolicy::default(),
        Some(r) => {
            let d = RetryPolicy::default();
            let max_attempts = r.max_attempts.unwrap_or(d.max_attempts);
            if max_attempts == 0 || max_attempts > MAX_ATTEMPTS_LIMIT {
                return Err(Invalid::new(
                    "retry.max_attempts",
                    format!("must be 1 to {MAX_ATTEMPTS_LIMIT}"),
                ));
            }
            let backoff = match &r.backoff {
                Some(b) => parse_duration(b).map_err(|e| Invalid::new("retry.backoff", e))?,
                None => d.backoff,
            };
            let factor = r.factor.unwrap_or(d.factor);
            if !(1.0..=100.0).contains(&factor) {
                return Err(Invalid::new("retry.factor", "must be between 1 and 100"));
            }
            let max_backoff = match &r.max_backoff {
                Some(b) => parse_duration(b).map_err(|e| Invalid::new("retry.max_backoff", e))?,
                None => d.max_backoff.max(backoff),
            };
            if max_backoff < backoff {
                return Err(Invalid::new(
                    "retry.max_backoff",
                    "must not be shorter than retry.backoff",
                ));
            }
            if max_backoff > Duration::from_secs(24 * 3600) {
                return Err(Invalid::new("retry.max_backoff", "must be at most 24h"));
            }
            RetryPolicy {
                max_attempts,
                backoff,
                factor,
                max_backoff,
            }
        }
    };

    let deadline = match &msg.expires {
        Some(e) => Some(deadline(e, env.published.unwrap_or_else(Utc::now))?),
        None => None,
    };

    let task_env = msg.env.clone().unwrap_or_default();
    for (k, v) in &task_env {
        check_env_pair(k, v, "env")?;
    }

    let lim = msg.limits.clone().unwrap_or_default();
    let limits_v = Limits {
        memory: positive(
            lim.memory
                .as_ref()
                .map(|m| m.parse("limits.memory"))
                .transpose()?,
            "limits.memory",
        )?,
        cpu: match lim.cpu {
            Some(c) if !(c > 0.0 && c <= 1024.0) => {
                return Err(Invalid::new(
                    "limits.cpu",
                    "must be a number of cores above 0",
                ))
            }
            c => c,
        },
        cpu_seconds: positive(lim.cpu_seconds, "limits.cpu_seconds")?,
        pids: positive(lim.pids, "limits.pids")?,
        nofile: positive(lim.nofile, "limits.nofile")?,
        output: positive(
            lim.output
                .as_ref()
                .map(|m| m.parse("limits.output"))
                .transpose()?,
            "limits.output",
        )?,
    };
    if let Some(m) = limits_v.memory {
        if m < 1024 * 1024 {
            return Err(Invalid::new("limits.memory", "must be at least 1MiB"));
        }
    }

    let mut task = Task {
        id,
        label: env.label.to_string(),
        task_type,
        fields: crate::runner::Fields(std::mem::take(&mut msg.fields)),
        spec: TypeSpec::default(),
        idempotency_key,
        shard,
        timeout,
        retry,
        deadline,
        env: task_env,
        limits: limits_v,
        then: Vec::new(),
        join: None,
        parent: None,
        join_summary: None,
    };
    task.spec = TypeSpec(limits.types.validate(&task.fields, &task)?);
    below.validate_into(&mut task, limits, tree)?;
    Ok(task)
}

/// `expires`: an RFC 3339 time, or a duration counted from `stored` (the
/// message's stream timestamp; for a schedule's firing, when it fired).
pub fn deadline(expires: &str, stored: DateTime<Utc>) -> Result<DateTime<Utc>, Invalid> {
    let e = expires.trim();
    if let Ok(t) = DateTime::parse_from_rfc3339(e) {
        return Ok(t.with_timezone(&Utc));
    }
    let d = humantime::parse_duration(e).map_err(|_| {
        Invalid::new(
            "expires",
            format!(
                "`{}` is neither an RFC 3339 time (2026-01-02T03:04:05Z) nor a duration like 10m",
                truncate_for_error(e)
            ),
        )
    })?;
    if d.is_zero() {
        return Err(Invalid::new("expires", "a duration must be greater than 0"));
    }
    chrono::Duration::from_std(d)
        .ok()
        .and_then(|d| stored.checked_add_signed(d))
        .ok_or_else(|| Invalid::new("expires", "is too far in the future"))
}

fn id_suffix(id: &str) -> &str {
    id.rsplit('-').next().unwrap_or(id)
}

pub(crate) fn truncate_for_error(s: &str) -> String {
    if s.chars().count() > 40 {
        format!("{}…", s.chars().take(40).collect::<String>())
    } else {
        s.to_string()
    }
}

fn positive(v: Option<u64>, field: &str) -> Result<Option<u64>, Invalid> {
    match v {
        Some(0) => Err(Invalid::new(field, "must be greater than 0")),
        v => Ok(v),
    }
}

fn check_shard(s: Shard, field: &str) -> Result<Shard, Invalid> {
    if s.total == 0 || s.no >= s.total {
        return Err(Invalid::new(
            field,
            format!("need 0 <= no < total, got no={} total={}", s.no, s.total),
        ));
    }
    Ok(s)
}

fn check_timeout(d: Duration, field: &str) -> Result<Duration, Invalid> {
    if d.is_zero() {
        return Err(Invalid::new(field, "must be greater than 0"));
    }
    if d > MAX_TIMEOUT {
        return Err(Invalid::new(field, "must be at most 7 days"));
    }
    Ok(d)
}

/// An environment variable name: `[A-Za-z_][A-Za-z0-9_]*`, not reserved,
/// and a value without NUL.
pub(crate) fn check_env_pair(k: &str, v: &str, field: &str) -> Result<(), Invalid> {
    let f = format!("{field}.{k}");
    let mut bytes = k.bytes();
    let ok = matches!(bytes.next(), Some(b) if b.is_ascii_alphabetic() || b == b'_')
        && bytes.all(|b| b.is_ascii_alphanumeric() || b == b'_');
    if !ok || k.len() > 256 {
        return Err(Invalid::new(f, "not a valid environment variable name"));
    }
    if RESERVED_ENV.contains(&k) {
        return Err(Invalid::new(f, "is reserved and set by the worker"));
    }
    if v.contains('\0') {
        return Err(Invalid::new(f, "value contains a NUL byte"));
    }
    Ok(())
}

/// Status of one attempt (DESIGN.md section 4).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
#[non_exhaustive]
pub enum Status {
    /// Not a result: an attempt was claimed and runs now (non-final; the
    /// record's `worker_id`, `attempt` and `task_seq` say where and which).
    Running,
    /// Not a result: a claimed attempt was handed back unfinished (worker
    /// shutdown); `attempt` counts the attempts used so far (non-final).
    Queued,
    /// The attempt succeeded.
    Success,
    /// The attempt failed: non-zero exit, killed by a signal or a limit,
    /// HTTP status outside `success`, container error.
    Failed,
    /// The attempt ran out of time.
    Timeout,
    /// An operator cancelled the task (or a lease was lost).
    Cancelled,
    /// Invalid; never ran.
    Rejected,
    /// Attempts used up by deliveries whose worker vanished.
    Dead,
    /// Its `expires` deadline passed before an attempt could start (never
    /// ran, or a retry would have started after it).
    Expired,
}

impl Status {
    /// The name on the wire (`success`).
    pub fn as_str(self) -> &'static str {
        match self {
            Status::Running => "running",
            Status::Queued => "queued",
            Status::Success => "success",
            Status::Failed => "failed",
            Status::Timeout => "timeout",
            Status::Cancelled => "cancelled",
            Status::Rejected => "rejected",
            Status::Dead => "dead",
            Status::Expired => "expired",
        }
    }

    /// Whether a final record with this status keeps the original task in
    /// DEAD (`Jetworker-Status` says which), so that it can be run again
    /// under a new id (`jetworker retry`, `dead replay`): the tasks that
    /// never ran (`rejected`, `dead`, `expired`) and those that failed for
    /// good (`failed`, `timeout`). Not `success` or `cancelled`.
    pub fn dead_lettered(self) -> bool {
        matches!(
            self,
            Status::Rejected | Status::Dead | Status::Expired | Status::Failed | Status::Timeout
        )
    }
}

impl std::fmt::Display for Status {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for Status {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        serde_json::from_value(serde_json::Value::String(s.to_string()))
            .map_err(|_| format!("unknown status `{s}`"))
    }
}

/// The result message of one attempt (DESIGN.md section 4).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct TaskResult {
    /// The task's id.
    pub id: String,
    /// Its label.
    pub label: String,
    /// Its type (`None`: a rejected message without a usable one).
    #[serde(rename = "type")]
    pub task_type: Option<String>,
    /// What the attempt (or the task) came to; `running` and `queued` are state records.
    pub status: Status,
    /// No further record follows (`final`): no retry, no other attempt.
    #[serde(rename = "final")]
    pub is_final: bool,
    /// 1-based attempt number.
    pub attempt: u32,
    /// The task's attempt budget.
    pub max_attempts: u32,
    /// A process's or container's exit code.
    pub exit_code: Option<i32>,
    /// The signal that killed the process (`SIGKILL`).
    pub signal: Option<String>,
    /// An http task's response status.
    pub http_status: Option<u16>,
    /// Output (stdout and stderr, or the response body), within the cap: head and tail when cut.
    pub output: String,
    /// Whether the output was cut.
    pub output_truncated: bool,
    /// Bytes the task produced in all.
    pub output_bytes: u64,
    /// Why, in words (the limit that killed it, the invalid field).
    pub error: Option<String>,
    /// The worker that wrote the record.
    pub worker_id: String,
    /// The task's idempotency key.
    pub idempotency_key: Option<String>,
    /// The task's shard.
    pub shard: Option<Shard>,
    /// When the attempt started.
    pub started_at: DateTime<Utc>,
    /// When it ended (for a state record: when it was written).
    pub finished_at: DateTime<Utc>,
    /// Its running time.
    pub duration_ms: u64,
    /// On a non-final `failed` or `timeout`: when the retry is due.
    pub retry_in_ms: Option<u64>,
    /// TASKS stream sequence of the message this record belongs to: tells a
    /// redelivery of the same message (which may take over a lost lease)
    /// from a second message with the same id (which waits).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub task_seq: Option<u64>,
    /// Downstream tasks (`then`): on a state record every planned child's
    /// id, on a final record the ids of those its status queued.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub children: Vec<String>,
    /// On a shard with `then_all`: the join's id.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub join: Option<String>,
    /// The id of the task that queued this one (`parent`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parent: Option<String>,
    /// Whether the attempt's output went to the live stream (`logs.<id>`,
    /// ended by an `eof`). Written only as `false`: the attempt ended
    /// before its first live flush, nothing of it was published live, and
    /// a follower shows the output stored here instead (DESIGN.md section
    /// 2, live output). Absent means `true`.
    #[serde(default = "live_default", skip_serializing_if = "is_live_default")]
    pub live: bool,
}

fn live_default() -> bool {
    true
}

fn is_live_default(live: &bool) -> bool {
    *live
}

impl TaskResult {
    /// A final result with no outcome yet (no exit code, output or error),
    /// finished now; callers fill in what they know.
    #[allow(clippy::too_many_arguments)]
    pub fn blank(
        id: &str,
        label: &str,
        task_type: Option<String>,
        status: Status,
        attempt: u32,
        max_attempts: u32,
        worker_id: &str,
        started_at: DateTime<Utc>,
    ) -> Self {
        let finished_at = Utc::now();
        TaskResult {
            id: id.to_string(),
            label: label.to_string(),
            task_type,
            status,
            is_final: true,
            attempt,
            max_attempts,
            exit_code: None,
            signal: None,
            http_status: None,
            output: String::new(),
            output_truncated: false,
            output_bytes: 0,
            error: None,
            worker_id: worker_id.to_string(),
            idempotency_key: None,
            shard: None,
            started_at,
            finished_at,
            duration_ms: (finished_at - started_at).num_milliseconds().max(0) as u64,
            retry_in_ms: None,
            task_seq: None,
            children: Vec::new(),
            join: None,
            parent: None,
            live: true,
        }
    }

    /// Whether this record is a state (running, queued) rather than the
    /// result of an attempt.
    pub fn is_state(&self) -> bool {
        matches!(self.status, Status::Running | Status::Queued)
    }
}

/// Value of a worker's key in KV `workers` (DESIGN.md section 6).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct Heartbeat {
    /// The worker id (`<name>-<random>`), also its key.
    pub id: String,
    /// Its host.
    pub hostname: String,
    /// Its process id.
    pub pid: u32,
    /// jetworker's version.
    pub version: String,
    /// The labels it serves.
    pub labels: Vec<String>,
    /// The types this worker runs.
    pub types: Vec<String>,
    /// Tasks it runs at once at most.
    pub slots: usize,
    /// Tasks running now.
    pub running: usize,
    /// Of those, how many came from each label (absent when nothing runs,
    /// and in heartbeats of earlier workers).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub running_by_label: BTreeMap<String, usize>,
    /// Their ids.
    pub tasks: Vec<String>,
    /// When the worker started.
    pub started_at: DateTime<Utc>,
    /// When this heartbeat was written.
    pub seen_at: DateTime<Utc>,
    /// Attempts run since the start, by status.
    pub counts: BTreeMap<String, u64>,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env() -> Envelope<'static> {
        Envelope {
            label: "default",
            msg_id: None,
            stream_sequence: 7,
            scheduler: None,
            published: None,
        }
    }

    fn parse(s: &str) -> Result<Task, Invalid> {
        parse_task(s.as_bytes(), &env(), &ValidationLimits::default())
    }

    #[test]
    fn smallest_task_parses() {
        let t = parse(r#"{"type":"shell","payload":"echo hello"}"#).unwrap();
        assert_eq!(t.id, "seq-7");
        assert_eq!(t.idempotency_key, "seq-7");
        assert_eq!(
            t.spec::<crate::runner::command::ProcessSpec>(),
            Some(&crate::runner::command::ProcessSpec::Shell {
                script: "echo hello".into()
            })
        );
        assert_eq!(t.retry, RetryPolicy::default());
    }

    #[test]
    fn header_id_is_used_and_json_wins() {
        let e = Envelope {
            msg_id: Some("from-header"),
            ..env()
        };
        let v = ValidationLimits::default();
        let t = parse_task(br#"{"type":"shell","script":"x"}"#, &e, &v).unwrap();
        assert_eq!(t.id, "from-header");
        let t = parse_task(br#"{"type":"shell","script":"x","id":"j"}"#, &e, &v).unwrap();
        assert_eq!(t.id, "j");
        let e = Envelope {
            msg_id: Some("bad id!"),
            ..env()
        };
        let t = parse_task(br#"{"type":"shell","script":"x"}"#, &e, &v).unwrap();
        assert_eq!(t.id, "seq-7");
    }

    #[test]
    fn unknown_field_is_named() {
        let e = parse(r#"{"type":"shell","payload":"x","timout":"5s"}"#).unwrap_err();
        assert_eq!(e.field, "timout");
        // One suggestion, not the list of every field.
        assert_eq!(
            e.to_string(),
            "timout: unknown field `timout` (did you mean `timeout`?); `jetworker schema` lists the fields"
        );
        let e = parse(r#"{"type":"shell","payload":"x","retry":{"max_atempts":2}}"#).unwrap_err();
        assert!(e.problem.contains("did you mean `max_attempts`"), "{e}");
        let e = parse("echo hi").unwrap_err();
        assert!(
            e.to_string().starts_with("the task is not valid JSON"),
            "{e}"
        );
    }

    #[test]
    fn wrong_type_is_named() {
        let e = parse(r#"{"type":"shell","payload":"x","timeout_seconds":"5"}"#).unwrap_err();
        assert_eq!(e.field, "timeout_seconds");
        let e =
            parse(r#"{"type":"shell","payload":"x","retry":{"max_attempts":"x"}}"#).unwrap_err();
        assert_eq!(e.field, "retry.max_attempts");
        // A type not registered here may run on another worker of the
        // label: only the envelope is checked.
        let t = parse(r#"{"type":"resize-image","width":5}"#).unwrap();
        assert!(!t.runnable());
        assert_eq!(t.fields.get("width"), Some(&serde_json::json!(5)));
        for bad in [
            r#"{"type":"No Such"}"#,
            r#"{"type":5}"#,
            r#"{"payload":"x"}"#,
        ] {
            assert_eq!(parse(bad).unwrap_err().field, "type", "{bad}");
        }
    }

    #[test]
    fn fields_are_checked_by_their_type() {
        let e = parse(r#"{"type":"shell","payload":"x","timout":"5s"}"#).unwrap_err();
        assert_eq!(e.field, "timout");
        assert!(e.problem.contains("did you mean `timeout`"), "{e}");
        let e = parse(r#"{"type":"shell","payload":"x","url":"http://x"}"#).unwrap_err();
        assert_eq!(
            (e.field.as_str(), e.problem.as_str()),
            ("url", "does not apply to type shell")
        );
        let e = parse(r#"{"type":"command","command":"x","args":"y"}"#).unwrap_err();
        assert_eq!(e.field, "args");
    }

    #[test]
    fn non_object_and_garbage() {
        assert_eq!(parse("[1,2]").unwrap_err().field, "(message)");
        assert_eq!(parse("{not json").unwrap_err().field, "(message)");
        let e = parse_task(&[0xff, 0xfe, 0], &env(), &ValidationLimits::default()).unwrap_err();
        assert!(e.problem.contains("UTF-8"), "{e}");
    }

    #[test]
    fn too_large() {
        let big = format!(
            r#"{{"type":"shell","payload":"{}"}}"#,
            "x".repeat(300 * 1024)
        );
        assert!(parse(&big).unwrap_err().problem.contains("max_task_bytes"));
    }

    #[test]
    fn shard_forms() {
        let t = parse(r#"{"type":"shell","payload":"x","shard":{"no":1,"total":3}}"#).unwrap();
        assert_eq!(t.shard, Some(Shard { no: 1, total: 3 }));
        let t = parse(r#"{"type":"shell","payload":"x","shard_no":0,"shard_total":2}"#).unwrap();
        assert_eq!(t.shard, Some(Shard { no: 0, total: 2 }));
        assert_eq!(
            parse(r#"{"type":"shell","payload":"x","shard":{"no":3,"total":3}}"#)
                .unwrap_err()
                .field,
            "shard"
        );
        assert_eq!(
            parse(r#"{"type":"shell","payload":"x","shard_no":1}"#)
                .unwrap_err()
                .field,
            "shard_total"
        );
    }

    #[test]
    fn timeouts() {
        let t = parse(r#"{"type":"shell","payload":"x","timeout":"90s"}"#).unwrap();
        assert_eq!(t.timeout, Some(Duration::from_secs(90)));
        let t = parse(r#"{"type":"shell","payload":"x","timeout_seconds":5}"#).unwrap();
        assert_eq!(t.timeout, Some(Duration::from_secs(5)));
        assert_eq!(
            parse(r#"{"type":"shell","payload":"x","timeout":"soon"}"#)
                .unwrap_err()
                .field,
            "timeout"
        );
        assert_eq!(
            parse(r#"{"type":"shell","payload":"x","timeout_seconds":0}"#)
                .unwrap_err()
                .field,
            "timeout_seconds"
        );
    }

    #[test]
    fn env_rules() {
        assert_eq!(
            parse(r#"{"type":"shell","payload":"x","env":{"ATTEMPT":"9"}}"#)
                .unwrap_err()
                .field,
            "env.ATTEMPT"
        );
        assert_eq!(
            parse(r#"{"type":"shell","payload":"x","env":{"1A":"9"}}"#)
                .unwrap_err()
                .field,
            "env.1A"
        );
        assert_eq!(
            parse(r#"{"type":"shell","payload":"x","env":{"A":1}}"#)
                .unwrap_err()
                .field,
            "env.A"
        );
    }

    #[test]
    fn fields_of_other_types_are_refused() {
        assert_eq!(
            parse(r#"{"type":"shell","payload":"x","url":"http://a"}"#)
                .unwrap_err()
                .field,
            "url"
        );
        assert_eq!(parse(r#"{"type":"command"}"#).unwrap_err().field, "command");
    }

    #[test]
    fn invalid_id() {
        assert_eq!(
            parse(r#"{"type":"shell","payload":"x","id":"a b"}"#)
                .unwrap_err()
                .field,
            "id"
        );
    }

    #[test]
    fn retry_backoff() {
        let t = parse(r#"{"type":"shell","payload":"x","retry":{"max_attempts":5,"backoff":"2s","factor":3,"max_backoff":"10s"}}"#).unwrap();
        assert_eq!(t.retry.delay_after(1), Duration::from_secs(2));
        assert_eq!(t.retry.delay_after(2), Duration::from_secs(6));
        assert_eq!(t.retry.delay_after(3), Duration::from_secs(10));
        assert_eq!(
            parse(r#"{"type":"shell","payload":"x","retry":{"max_attempts":0}}"#)
                .unwrap_err()
                .field,
            "retry.max_attempts"
        );
    }

    #[test]
    fn container_payload_safe_subset() {
        let t = parse(r#"{"type":"container","image":"busybox","payload":"-e A=1 --memory 64MiB -w /tmp --network none"}"#).unwrap();
        let c = t.spec::<crate::runner::container::ContainerSpec>().unwrap();
        assert_eq!(c.env.get("A").map(String::as_str), Some("1"));
        assert_eq!(c.memory, Some(64 * 1024 * 1024));
        assert_eq!(c.workdir.as_deref(), Some("/tmp"));
        for bad in [
            // A multi-byte character right after the dash once panicked
            // (slicing inside the character).
            "-é",
            "-éx",
            "--privileged",
            "-v /:/host",
            "--pid=host",
            "--cap-add ALL",
            "busybox",
        ] {
            let s = format!(r#"{{"type":"container","image":"busybox","payload":"{bad}"}}"#);
            let e = parse(&s).unwrap_err();
            assert_eq!(e.field, "payload", "{bad}");
        }
        assert_eq!(
            parse(r#"{"type":"container","image":"b","network":"host"}"#)
                .unwrap_err()
                .field,
            "network"
        );
    }

    #[test]
    fn http_fields() {
        let t =
            parse(r#"{"type":"http","payload":"http://127.0.0.1/x","success":"200-204"}"#).unwrap();
        let h = t.spec::<crate::runner::http::HttpSpec>().unwrap();
        assert_eq!(h.success, (200, 204));
        assert_eq!(h.method, "GET");
        assert_eq!(
            parse(r#"{"type":"http","url":"ftp://x"}"#)
                .unwrap_err()
                .field,
            "url"
        );
    }

    #[test]
    fn cron_firing_gets_instance_id() {
        let when = DateTime::parse_from_rfc3339("2026-01-02T03:04:05.7Z")
            .unwrap()
            .with_timezone(&Utc);
        let e = Envelope {
            scheduler: Some("schedules.nightly"),
            published: Some(when),
            ..env()
        };
        let t = parse_task(
            br#"{"type":"shell","payload":"x"}"#,
            &e,
            &ValidationLimits::default(),
        )
        .unwrap();
        assert_eq!(t.id, "nightly-20260102T030405Z");
        assert_eq!(t.idempotency_key, t.id);
    }

    #[test]
    fn delayed_firing_keeps_its_id() {
        let e = Envelope {
            scheduler: Some("schedules.delayed.abc"),
            published: Some(Utc::now()),
            ..env()
        };
        assert_eq!(e.fired(), Fired::Delayed { id: "abc" });
        let lim = ValidationLimits::default();
        let t = parse_task(br#"{"type":"shell","payload":"x"}"#, &e, &lim).unwrap();
        assert_eq!((t.id.as_str(), t.idempotency_key.as_str()), ("abc", "abc"));
        let t = parse_task(
            br#"{"type":"shell","payload":"x","id":"own","idempotency_key":"k"}"#,
            &e,
            &lim,
        )
        .unwrap();
        assert_eq!((t.id.as_str(), t.idempotency_key.as_str()), ("own", "k"));
        assert_eq!(best_effort_id(br#"{"id":"own"}"#, &e), "own");
        // A schedule name is one token: `schedules.delayed` is a cron schedule.
        let cron = Envelope {
            scheduler: Some("schedules.delayed"),
            ..env()
        };
        assert_eq!(cron.fired(), Fired::Schedule { name: "delayed" });
        assert_eq!(best_effort_id(br#"{"id":"own"}"#, &cron), "seq-7");
        assert_eq!(
            Names::default().delayed_subject("abc"),
            "schedules.delayed.abc"
        );
    }

    #[test]
    fn expires_is_a_time_or_a_duration_from_the_stored_time() {
        let stored = DateTime::parse_from_rfc3339("2026-01-02T03:04:05Z")
            .unwrap()
            .with_timezone(&Utc);
        let e = Envelope {
            published: Some(stored),
            ..env()
        };
        let lim = ValidationLimits::default();
        let t = parse_task(
            br#"{"type":"shell","payload":"x","expires":"10m"}"#,
            &e,
            &lim,
        )
        .unwrap();
        assert_eq!(t.deadline, Some(stored + chrono::Duration::minutes(10)));
        assert!(!t.expired_at(stored + chrono::Duration::minutes(10)));
        assert!(t.expired_at(stored + chrono::Duration::minutes(11)));
        let t = parse_task(
            br#"{"type":"shell","payload":"x","expires":"2026-01-02T04:00:00+01:00"}"#,
            &e,
            &lim,
        )
        .unwrap();
        assert_eq!(t.deadline, Some(stored - chrono::Duration::seconds(245)));
        assert!(parse("{\"type\":\"shell\",\"payload\":\"x\"}")
            .unwrap()
            .deadline
            .is_none());
        for bad in ["soon", "0s", ""] {
            let json = format!(r#"{{"type":"shell","payload":"x","expires":"{bad}"}}"#);
            let err = parse(&json).unwrap_err();
            assert_eq!(err.field, "expires", "{bad}: {err}");
        }
        assert_eq!("expired".parse::<Status>(), Ok(Status::Expired));
    }

    #[test]
    fn names() {
        let n = Names::default();
        assert_eq!(n.label_of("tasks.gpu.x.y"), Some("gpu"));
        assert_eq!(n.label_of("tasks.gpu"), Some("gpu"));
        assert_eq!(n.label_of("schedules.x"), None);
    }
}
