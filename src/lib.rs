//! jetworker: a task worker for NATS JetStream, and its operator CLI.
//!
//! The wire contract (subjects, JSON fields, statuses, delivery rules) is
//! DESIGN.md; this crate implements it.
//!
//! # Layout
//!
//! - [`protocol`]: names, the task message and its validation, results,
//!   heartbeats.
//! - [`config`]: every setting defined once; flags + environment + file +
//!   `nats` context → validated settings (no clap here).
//! - [`commands`]: the binary — clap definitions (`commands::cli`) and one
//!   module per subcommand; [`suggest`]: "did you mean" for misspelt names.
//! - [`connect`]: NATS connection, auth, TLS, server version check.
//! - [`setup`]: streams, consumers and KV buckets, created idempotently.
//! - [`worker`]: the daemon — pulling, per-task handling, acks, heartbeats,
//!   cancellation, the outbox, shutdown.
//! - [`runner`]: the [`Runner`] trait and the registry of task types, one
//!   runner per type (built-in, defined in config, or your own);
//!   [`process`] (process groups, signals, rlimits) and [`output`]
//!   (bounded capture) serve them.
//! - [`metrics`]: Prometheus `/metrics`, `/healthz`, `/readyz`;
//!   `logfmt`: JSON log lines with span fields at the top level.
//! - [`queues`]: the label queues as operators see and steer them (stats,
//!   pause, resume), shared by the CLI and any other front end.
//! - [`ui`]: `jetworker ui`, the live web dashboard.

#![warn(missing_docs)]

pub(crate) mod cgroup;
pub(crate) mod commands;
pub mod config;
pub(crate) mod connect;
mod logfmt;
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
