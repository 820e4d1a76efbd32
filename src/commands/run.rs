//! `jetworker run`: the worker daemon until SIGTERM or SIGINT.

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
    crate::worker::run(cfg, shutdown).await?;
    Ok(Exit::Ok)
}
