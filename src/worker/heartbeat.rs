//! Heartbeats (DESIGN.md section 6): the worker's JSON value is put in KV
//! `workers` under its id every interval. The bucket's max age removes the
//! key of a worker that stops beating, and its limit marker lets watchers
//! see it go; a clean shutdown deletes the key (see [`super::run`]).
//! Each round also tells [`super::ConnState`] that the worker is alive
//! (and whether the put was stored), and reads whether its labels are
//! paused for the `jetworker_label_paused` gauge.

use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use super::Shared;
use crate::metrics::LabelLabels;
use crate::protocol::Heartbeat;

/// The current heartbeat value.
pub fn value(sh: &Shared) -> Heartbeat {
    let (tasks, running_by_label) = sh.running.snapshot();
    Heartbeat {
        id: sh.id.clone(),
        hostname: sh.hostname.clone(),
        pid: std::process::id(),
        version: crate::VERSION.to_string(),
        labels: sh.cfg.labels.clone(),
        types: sh.types.clone(),
        slots: sh.cfg.slots,
        running: tasks.len(),
        running_by_label,
        tasks,
        started_at: sh.started_at,
        seen_at: chrono::Utc::now(),
        counts: sh.counts(),
    }
}

/// Set the `jetworker_label_paused` gauge of each label from its
/// consumer's info (`jetworker pause` changes the consumer, not the worker).
async fn paused_labels(sh: &Shared) {
    for label in &sh.cfg.labels {
        let read = crate::queues::is_paused(&sh.infra.tasks, &sh.names, label);
        match tokio::time::timeout(Duration::from_secs(5), read).await {
            Ok(Ok(p)) => {
                sh.metrics
                    .label_paused
                    .get_or_create(&LabelLabels {
                        label: label.clone(),
                    })
                    .set(i64::from(p));
            }
            Ok(Err(e)) => debug!("{e:#}"),
            Err(_) => debug!(label, "reading the consumer timed out"),
        }
    }
}

/// Beat until `stop` fires; `first` fires once the first beat is stored
/// (the worker pulls only after that: see [`super::records::held_elsewhere`]).
pub async fn beat(sh: Arc<Shared>, stop: CancellationToken, first: CancellationToken) {
    let mut tick = tokio::time::interval(sh.cfg.heartbeat);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut failing = false;
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tick.tick() => {}
        }
        let v = match serde_json::to_vec(&value(&sh)) {
            Ok(v) => v,
            Err(e) => {
                warn!("cannot encode heartbeat: {e}");
                continue;
            }
        };
        let put = sh.infra.workers.put(&sh.id, v.into());
        let stored = tokio::time::timeout(Duration::from_secs(5), put).await;
        sh.conn.beat(matches!(stored, Ok(Ok(_))));
        if matches!(stored, Ok(Ok(_))) {
            paused_labels(&sh).await;
        }
        match stored {
            Ok(Ok(_)) => {
                first.cancel();
                if failing {
                    debug!("heartbeats resumed");
                }
                failing = false;
            }
            Ok(Err(e)) => {
                if !failing {
                    warn!("heartbeat failed: {e}");
                }
                failing = true;
            }
            Err(_) => {
                if !failing {
                    warn!("heartbeat timed out");
                }
                failing = true;
            }
        }
    }
}
