//! One integration-test binary (ripgrep style): every test starts its own
//! nats-server (see `util`) and real workers.

mod container;
mod core;
mod http;
mod runner_ctx;
mod util;
