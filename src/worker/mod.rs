//! The worker daemon (placeholder)
pub async fn shutdown_signal() {}
pub async fn run(
    _c: crate::config::WorkerConfig,
    _s: tokio_util::sync::CancellationToken,
) -> anyhow::Result<()> {
    Ok(())
}
