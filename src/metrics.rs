//! Prometheus metrics and health endpoints: `/metrics`, `/healthz` (the
//! process is alive), `/readyz` (connected to NATS and pulling).

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use axum::{extract::State, http::StatusCode, routing::get, Router};
use prometheus_client::encoding::text::encode;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

/// Labels of the per-attempt counter.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct AttemptLabels {
    pub label: String,
    pub r#type: String,
    pub status: String,
}

/// Labels of the per-label gauges.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct LabelLabels {
    pub label: String,
}

/// The worker's metrics.
pub struct Metrics {
    registry: Registry,
    pub attempts: Family<AttemptLabels, Counter>,
    pub duration: Histogram,
    pub running: Gauge,
    pub outbox: Gauge,
    /// 1 while the label's consumer is paused (`jetworker pause`), read
    /// from the consumer's info at each heartbeat.
    pub label_paused: Family<LabelLabels, Gauge>,
    pub ready: AtomicBool,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("jetworker");
        let attempts = Family::<AttemptLabels, Counter>::default();
        registry.register(
            "attempts",
            "Finished task attempts by label, type and status",
            attempts.clone(),
        );
        let duration = Histogram::new(exponential_buckets(0.005, 2.0, 20));
        registry.register(
            "attempt_duration_seconds",
            "Duration of task attempts",
            duration.clone(),
        );
        let running = Gauge::default();
        registry.register("running", "Tasks running now", running.clone());
        let outbox = Gauge::default();
        registry.register(
            "outbox",
            "Messages waiting in the on-disk outbox",
            outbox.clone(),
        );
        let label_paused = Family::<LabelLabels, Gauge>::default();
        registry.register(
            "label_paused",
            "1 while the label is paused (its workers take no new tasks)",
            label_paused.clone(),
        );
        Metrics {
            registry,
            attempts,
            duration,
            running,
            outbox,
            label_paused,
            ready: AtomicBool::new(false),
        }
    }

    pub fn encode(&self) -> String {
        let mut s = String::new();
        let _ = encode(&mut s, &self.registry);
        s
    }
}

/// Bind the endpoints' address: at start, so that an address that cannot
/// be bound stops the worker (a configuration error) instead of leaving it
/// running unobserved.
pub async fn bind(addr: SocketAddr) -> std::io::Result<tokio::net::TcpListener> {
    tokio::net::TcpListener::bind(addr).await
}

/// Serve the endpoints on a [`bind`]ed listener until the process exits.
pub async fn serve(listener: tokio::net::TcpListener, metrics: Arc<Metrics>) -> anyhow::Result<()> {
    let app = Router::new()
        .route(
            "/metrics",
            get(|State(m): State<Arc<Metrics>>| async move {
                (
                    [(
                        "content-type",
                        "application/openmetrics-text; version=1.0.0; charset=utf-8",
                    )],
                    m.encode(),
                )
            }),
        )
        .route("/healthz", get(|| async { "ok\n" }))
        .route(
            "/readyz",
            get(|State(m): State<Arc<Metrics>>| async move {
                if m.ready.load(Ordering::Relaxed) {
                    (StatusCode::OK, "ready\n")
                } else {
                    (StatusCode::SERVICE_UNAVAILABLE, "not ready\n")
                }
            }),
        )
        .with_state(metrics);
    if let Ok(addr) = listener.local_addr() {
        tracing::info!(%addr, "metrics endpoint listening");
    }
    axum::serve(listener, app).await?;
    Ok(())
}
