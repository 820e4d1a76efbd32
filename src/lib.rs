//! jetworker: a task worker for NATS JetStream, and its operator CLI.
//!
//! The wire contract (subjects, JSON fields, statuses, delivery rules) is
//! DESIGN.md; this crate implements it.
//!
//! # The library
//!
//! For programs that embed a worker with task types of their own, or that
//! read and steer the queues:
//!
//! - [`worker`]: [`Worker::builder`] runs a worker with your own
//!   [`Runner`]s besides the built-in types; [`worker::run`] runs the
//!   plain one.
//! - [`runner`]: the [`Runner`] trait and the [`runner::Registry`] of task
//!   types; [`runner::in_process::function`] makes an async function a
//!   type; [`runner::defined`] reads types defined in config.
//! - [`config`]: every setting defined once; flags + environment + file +
//!   `nats` context → validated settings ([`config::WorkerConfig`]).
//! - [`protocol`]: names, the task message and its validation, results,
//!   heartbeats.
//! - [`queues`]: the label queues as operators see and steer them (stats,
//!   pause, resume), shared by the CLI and any other front end.
//!
//! # Layout of the rest (crate-private)
//!
//! - `commands`: the binary — clap definitions (`commands::cli`) and one
//!   module per subcommand; `suggest`: "did you mean" for misspelt names.
//! - `connect`: NATS connection, auth, TLS, server version check.
//! - `setup`: streams, consumers and KV buckets, created idempotently.
//! - `worker`'s own parts: pulling, per-task handling, acks, heartbeats,
//!   cancellation, the outbox, shutdown.
//! - The built-in runners (`runner::shell`, `command`, `http`,
//!   `container`); `process` (process groups, signals, rlimits), `cgroup`
//!   and `output` (bounded capture) serve them.
//! - `memory`: the daemon hands its start-up code pages back once it pulls.
//! - `metrics`: Prometheus `/metrics`, `/healthz`, `/readyz`; `logfmt`:
//!   JSON log lines with span fields at the top level.
//! - `ui`: `jetworker ui`, the live web dashboard.
//!
//! The binary, the integration tests and the benchmarks reach some of
//! these through a hidden `internals` module, which is not API.

#![warn(missing_docs)]

pub(crate) mod cgroup;
pub(crate) mod commands;
pub mod config;
pub(crate) mod connect;
mod logfmt;
pub(crate) mod memory;
pub(crate) mod metrics;
pub(crate) mod output;
pub(crate) mod process;
pub mod protocol;
pub mod queues;
pub mod runner;
pub(crate) mod setup;
pub(crate) mod suggest;
pub(crate) mod ui;
pub mod worker;

pub use runner::{Fields, Outcome, RunContext, Runner};
pub use worker::{Worker, WorkerBuilder};

/// The version reported in heartbeats and `--version`.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");

/// Not API: what the `jetworker` binary, the integration tests and the
/// benchmarks reach inside the crate for. It may change in any release.
#[doc(hidden)]
pub mod internals {
    pub use crate::cgroup::Cgroups;
    pub use crate::commands::main;
    pub use crate::process::start_time;
    pub use crate::runner::command::{ProcessRunner, ProcessSpec};
    pub use crate::runner::container::{
        ContainerRunner, ContainerSpec, WorkerIdentity, LABEL_TASK_ID,
    };
    pub use crate::runner::http::HttpRunner;
    pub use crate::setup::{
        ensure_all, ensure_label_consumer, tasks_stream_config, SetupOptions, MAX_WAITING_PULLS,
    };
    pub use crate::worker::outbox::{Entry, Outbox};
}
