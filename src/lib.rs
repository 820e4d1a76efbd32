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

pub mod cgroup;
pub mod commands;
pub mod config;
pub mod connect;
mod logfmt;
pub mod metrics;
pub mod output;
pub mod process;
pub mod protocol;
pub mod queues;
pub mod runner;
pub mod setup;
pub mod suggest;
pub mod ui;
pub mod worker;

pub use runner::{Fields, Outcome, RunContext, Runner};
pub use worker::{Worker, WorkerBuilder};

/// The version reported in heartbeats and `--version`.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");
