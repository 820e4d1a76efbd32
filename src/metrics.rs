//! Prometheus metrics and health endpoints: `/metrics`, `/healthz` (the
//! process is alive), `/readyz` (connected to NATS and pulling).
//!
//! The series (all prefixed `jetworker_`; DESIGN.md section 9 lists them):
//! what the worker did (`attempts_total`, `tasks_finished_total`,
//! `attempt_duration_seconds`, `lease_lost_total`), what it holds now
//! (`slots`, `running`, `outbox`, `outbox_oldest_age_seconds`), its link
//! to NATS (`connected`, `reconnects_total`) and `build_info`.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use axum::{extract::State, http::StatusCode, routing::get, Router};
use prometheus_client::encoding::text::encode;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::{Registry, Unit};

/// Labels of the outcome counters: which task, and how it came out.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct AttemptLabels {
    pub label: String,
    /// The task type; `unknown` for a rejected task whose type is unreadable.
    pub r#type: String,
    pub status: String,
}

/// Labels of the per-label gauges.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct LabelLabels {
    pub label: String,
}

/// Labels of the duration histogram.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TaskLabels {
    pub label: String,
    pub r#type: String,
}

/// Labels of `build_info`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct BuildLabels {
    version: String,
}

type DurationFamily = Family<TaskLabels, Histogram, fn() -> Histogram>;

fn duration_histogram() -> Histogram {
    Histogram::new(exponential_buckets(0.005, 2.0, 20))
}

/// The worker's metrics.
pub struct Metrics {
    registry: Registry,
    // What the worker did.
    /// Attempts that ran, by the status of the attempt.
    pub attempts: Family<AttemptLabels, Counter>,
    /// Final statuses, one per task that ended on this worker — ran or not
    /// (rejected, dead, expired, cancelled before start).
    pub finished: Family<AttemptLabels, Counter>,
    /// How long attempts ran.
    pub duration: DurationFamily,
    /// Attempts stopped because their lease was lost.
    pub lease_lost: Counter,
    // What it holds now.
    /// Configured slots.
    pub slots: Gauge,
    /// Tasks running now.
    pub running: Gauge,
    /// Messages waiting in the on-disk outbox.
    pub outbox: Gauge,
    /// 1 while the label's consumer is paused (`jetworker pause`), read
    /// from the consumer's info at each heartbeat.
    pub label_paused: Family<LabelLabels, Gauge>,
    /// When the oldest outbox entry was written; its age is computed at
    /// each scrape.
    outbox_oldest: Mutex<Option<SystemTime>>,
    outbox_age: Gauge<f64, AtomicU64>,
    // Its link to NATS.
    /// 1 while connected, else 0.
    pub connected: Gauge,
    /// Connections made after the first.
    pub reconnects: Counter,
    /// Connected and pulling (`/readyz`).
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
        let build = Family::<BuildLabels, Gauge>::default();
        build
            .get_or_create(&BuildLabels {
                version: crate::VERSION.to_string(),
            })
            .set(1);
        registry.register("build_info", "The worker's version", build);

        let attempts = Family::<AttemptLabels, Counter>::default();
        registry.register(
            "attempts",
            "Finished task attempts by label, type and status",
            attempts.clone(),
        );
        let finished = Family::<AttemptLabels, Counter>::default();
        registry.register(
            "tasks_finished",
            "Final statuses by label, type and status (tasks that ran or were settled without a run)",
            finished.clone(),
        );
        let duration = DurationFamily::new_with_constructor(duration_histogram);
        registry.register(
            "attempt_duration_seconds",
            "Duration of task attempts by label and type",
            duration.clone(),
        );
        let lease_lost = Counter::default();
        registry.register(
            "lease_lost",
            "Attempts stopped because their lease was lost",
            lease_lost.clone(),
        );

        let slots = Gauge::default();
        registry.register(
            "slots",
            "Tasks this worker runs at most at once",
            slots.clone(),
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
        let outbox_age = Gauge::<f64, AtomicU64>::default();
        registry.register_with_unit(
            "outbox_oldest_age",
            "Age of the oldest outbox entry (0 when empty)",
            Unit::Seconds,
            outbox_age.clone(),
        );

        let connected = Gauge::default();
        registry.register("connected", "1 while connected to NATS", connected.clone());
        let reconnects = Counter::default();
        registry.register(
            "reconnects",
            "Connections to NATS made after the first",
            reconnects.clone(),
        );
        Metrics {
            registry,
            attempts,
            finished,
            duration,
            lease_lost,
            slots,
            running,
            outbox,
            label_paused,
            outbox_oldest: Mutex::new(None),
            outbox_age,
            connected,
            reconnects,
            ready: AtomicBool::new(false),
        }
    }

    /// An attempt ran: its status and how long it took.
    pub fn attempt(&self, label: &str, r#type: &str, status: &str, seconds: f64) {
        self.attempts
            .get_or_create(&AttemptLabels {
                label: label.into(),
                r#type: r#type.into(),
                status: status.into(),
            })
            .inc();
        self.duration
            .get_or_create(&TaskLabels {
                label: label.into(),
                r#type: r#type.into(),
            })
            .observe(seconds);
    }

    /// A task's final status was stored by this worker.
    pub fn finished(&self, label: &str, r#type: &str, status: &str) {
        self.finished
            .get_or_create(&AttemptLabels {
                label: label.into(),
                r#type: r#type.into(),
                status: status.into(),
            })
            .inc();
    }

    /// The outbox now holds `entries`, the oldest written at `oldest`.
    pub fn set_outbox(&self, entries: usize, oldest: Option<SystemTime>) {
        self.outbox.set(entries as i64);
        *self.outbox_oldest.lock().unwrap() = oldest;
    }

    pub fn encode(&self) -> String {
        let oldest = *self.outbox_oldest.lock().unwrap();
        let age = oldest
            .and_then(|t| SystemTime::now().duration_since(t).ok())
            .map_or(0.0, |d| d.as_secs_f64());
        self.outbox_age.set(age);
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn series_are_named_and_labelled() {
        let m = Metrics::new();
        m.attempt("default", "shell", "success", 0.01);
        m.finished("default", "unknown", "rejected");
        m.set_outbox(
            2,
            Some(SystemTime::now() - std::time::Duration::from_secs(90)),
        );
        let text = m.encode();
        for want in [
            &format!("jetworker_build_info{{version=\"{}\"}} 1", crate::VERSION),
            r#"jetworker_attempts_total{label="default",type="shell",status="success"} 1"#,
            r#"jetworker_tasks_finished_total{label="default",type="unknown",status="rejected"} 1"#,
            r#"jetworker_attempt_duration_seconds_count{label="default",type="shell"} 1"#,
            "jetworker_outbox 2",
            "jetworker_lease_lost_total 0",
            "jetworker_reconnects_total 0",
            "jetworker_connected 0",
            "jetworker_slots 0",
        ] {
            assert!(text.contains(want), "{want} missing in:\n{text}");
        }
        let age: f64 = text
            .lines()
            .find_map(|l| l.strip_prefix("jetworker_outbox_oldest_age_seconds "))
            .expect("outbox age")
            .parse()
            .unwrap();
        assert!((90.0..120.0).contains(&age), "{age}");
    }
}
