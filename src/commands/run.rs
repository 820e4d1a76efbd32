//! `jetworker run`: the worker daemon until SIGTERM or SIGINT.
//!
//! Exit codes: 0 after a clean stop; 2 for a configuration error (a bad
//! setting, an unreadable credential, a server too old) that no restart
//! fixes; 1 for anything else, which a supervisor should restart.
//! Transient broker trouble at start is retried inside, not an exit.

use super::Exit;
use crate::config::WorkerConfig;

pub async fn run(cfg: WorkerConfig) -> anyhow::Result<Exit> {
    let shutdown = tokio_util::sync::CancellationToken::new();
    let s = shutdown.clone();
    tokio::spawn(async move {
        crate::worker::shutdown_signal().await;
        tracing::info!("shutdown requested: draining");
        s.cancel();
    });
    match crate::worker::run(cfg, shutdown).await {
        Ok(()) => Ok(Exit::Ok),
        // Exit 2: nothing a restart can fix.
        Err(e) if e.downcast_ref::<crate::config::ConfigError>().is_some() => Err(e),
        // Exit 1: anything else; a supervisor should restart the worker.
        Err(e) => {
            tracing::error!("worker failed: {e:#}");
            eprintln!("jetworker: {e:#}");
            Ok(Exit::NotSucceeded)
        }
    }
}
