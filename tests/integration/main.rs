//! One integration-test binary (ripgrep style): every test starts its own
//! nats-server (see `util`) and real workers.

mod auth;
mod browser;
mod chains;
mod cli;
mod cli_worker;
mod cluster;
mod cluster_util;
mod compose;
mod container;
mod containment;
mod core;
mod custom;
mod faults;
mod history;
mod http;
mod lifecycle;
mod operators;
mod proxy;
mod readme;
mod runner_ctx;
mod soak;
mod steer;
mod ui;
mod ui_util;
mod util;
mod wire;
