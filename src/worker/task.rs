//! Handling one delivered message, start to ack (DESIGN.md sections 1, 4
//! and 5):
//!
//! 1. validate — invalid: final `rejected` result, original bytes to DEAD, Term;
//! 2. a delivery past `max_attempts` — final `dead`, copy to DEAD, Term;
//! 3. cancelled before start, or already has a final result — Ack;
//! 4. run, with progress acks every third of ack wait;
//! 5. publish the result and wait for the PubAck (outbox on failure);
//! 6. only then Ack, Nak with backoff, or (shutdown) Nak at once.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::jetstream::{self, AckKind};
use async_nats::HeaderMap;
use bytes::Bytes;
use chrono::{DateTime, Utc};
use tracing::{debug, info, info_span, warn, Instrument};

use super::outbox::Entry;
use super::Shared;
use crate::output::{self, Captured, LiveOutput};
use crate::protocol::{
    self, best_effort_id, Envelope, Status, Task, TaskResult, TaskType, DEFAULT_MAX_ATTEMPTS,
    HEADER_LABEL, HEADER_REASON, HEADER_SCHEDULER, HEADER_STATUS, HEADER_TASK_ID,
};
use crate::runner::{Outcome, RunContext, Stop, StopKind};

/// What to tell the broker once the result is stored.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Disposition {
    Ack,
    Nak(Option<Duration>),
    Term,
    /// Do not answer: the lease is lost and the message belongs to another
    /// delivery now.
    Nothing,
}

/// Handle one message; never panics, always answers the broker (except on
/// a lost lease).
pub async fn handle(sh: Arc<Shared>, label: String, msg: jetstream::Message) {
    let (seq, delivered, published) = match msg.info() {
        Ok(i) => (
            i.stream_sequence,
            i.delivered.max(1) as u32,
            Some(protocol::chrono_time(i.published)),
        ),
        Err(e) => {
            warn!("message without JetStream info ({e}); terminating it");
            let _ = msg.ack_with(AckKind::Term).await;
            return;
        }
    };
    let msg_id = protocol::header(
        msg.headers.as_ref(),
        async_nats::header::NATS_MESSAGE_ID.as_ref(),
    );
    let scheduler = protocol::header(msg.headers.as_ref(), HEADER_SCHEDULER);
    let env = Envelope {
        label: &label,
        msg_id: msg_id.as_deref(),
        stream_sequence: seq,
        scheduler: scheduler.as_deref(),
        published,
    };
    let task = match protocol::parse_task(&msg.payload, &env, &sh.validation) {
        Ok(t) => t,
        Err(invalid) => {
            let id = best_effort_id(&msg.payload, &env);
            let span = info_span!("task", id = %id, label = %label, attempt = delivered);
            reject(&sh, &msg, &label, id, delivered, invalid.to_string())
                .instrument(span)
                .await;
            return;
        }
    };
    let span = info_span!("task", id = %task.id, label = %label, attempt = delivered, r#type = %task.task_type());
    process(sh, msg, task, delivered).instrument(span).await;
}

/// A result with the fields every status shares.
fn base_result(
    sh: &Shared,
    task: &Task,
    attempt: u32,
    status: Status,
    started: DateTime<Utc>,
) -> TaskResult {
    let mut r = TaskResult::blank(
        &task.id,
        &task.label,
        Some(task.task_type()),
        status,
        attempt,
        task.retry.max_attempts,
        &sh.id,
        started,
    );
    r.idempotency_key = Some(task.idempotency_key.clone());
    r.shard = task.shard;
    r
}

async fn process(sh: Arc<Shared>, msg: jetstream::Message, task: Task, attempt: u32) {
    let started = Utc::now();
    let task = Arc::new(task);

    if !sh.types.contains(&task.task_type()) {
        // Another worker on this label may run it.
        if attempt < task.retry.max_attempts {
            info!(
                "type {} is not run by this worker; handing it back",
                task.task_type()
            );
            let _ = msg
                .ack_with(AckKind::Nak(Some(Duration::from_secs(1))))
                .await;
        } else {
            let mut r = base_result(&sh, &task, attempt, Status::Dead, started);
            r.error = Some(format!(
                "no worker on label {} took type {} within {} deliveries (this one runs {})",
                task.label,
                task.task_type(),
                attempt,
                sh.types
                    .iter()
                    .map(|t| t.as_str())
                    .collect::<Vec<_>>()
                    .join(",")
            ));
            dead_letter(&sh, &msg, &task.label, &task.id, r).await;
        }
        return;
    }

    if attempt > task.retry.max_attempts {
        let mut r = base_result(&sh, &task, attempt, Status::Dead, started);
        r.error = Some(format!(
            "delivery {attempt} exceeds max_attempts {}: earlier attempts were lost with their worker",
            task.retry.max_attempts
        ));
        warn!("attempts used up by lost deliveries; dead-lettering");
        dead_letter(&sh, &msg, &task.label, &task.id, r).await;
        return;
    }

    let stop = Stop::new();
    if !sh.start_task(&task.id, stop.clone()) {
        debug!("the same id is already running on this worker; retrying later");
        let _ = msg
            .ack_with(AckKind::Nak(Some(Duration::from_secs(2))))
            .await;
        return;
    }
    let disposition = run_registered(&sh, &msg, &task, attempt, started, stop).await;
    sh.end_task(&task.id);
    if sh.die_before_ack && disposition == Disposition::Ack {
        warn!("JETWORKER_TEST_FAULT=die-before-ack: exiting before the ack");
        // SAFETY: _exit ends the process at once, like a crash would.
        unsafe { libc::_exit(86) };
    }
    answer(&sh, &msg, disposition).await;
}

/// Steps 3–5 for a task registered as running (so that a cancel arriving
/// meanwhile is seen).
async fn run_registered(
    sh: &Arc<Shared>,
    msg: &jetstream::Message,
    task: &Arc<Task>,
    attempt: u32,
    started: DateTime<Utc>,
    stop: Stop,
) -> Disposition {
    // Cancelled while queued?
    if let Ok(Some(v)) = sh.infra.cancel.get(&task.id).await {
        let reason = String::from_utf8_lossy(&v).trim().to_string();
        let mut r = base_result(sh, task, attempt, Status::Cancelled, started);
        r.error = Some(if reason.is_empty() {
            "cancelled before it started".into()
        } else {
            format!("cancelled before it started: {reason}")
        });
        info!("cancelled before start");
        return publish_then(sh, r, Disposition::Ack).await;
    }
    // Already finished (a redelivery after our ack got lost, or a duplicate)?
    match last_result(sh, &task.id).await {
        Some(prev) if prev.is_final => {
            info!(status = %prev.status, "already has a final result; acking without running");
            return Disposition::Ack;
        }
        _ => {}
    }

    let timeout = task.timeout.unwrap_or(sh.cfg.default_timeout);
    let cap = task
        .limits
        .output
        .map(|o| o.min(sh.output_cap))
        .unwrap_or(sh.output_cap);
    let live = LiveOutput::new(sh.client.clone(), sh.names.logs_subject(&task.id));
    let ctx = RunContext {
        task: task.clone(),
        attempt,
        worker_id: sh.id.clone(),
        timeout,
        kill_grace: sh.cfg.kill_grace,
        output_cap: cap,
        env: task_env(task, attempt),
        stop: stop.clone(),
        live: Some(live.clone()),
    };
    debug!(?timeout, "running");
    let t0 = Instant::now();
    let outcome = with_progress(sh, msg, sh.runners.run(ctx)).await;
    let elapsed = t0.elapsed();

    let mut r = base_result(sh, task, attempt, outcome.status, started);
    fill_outcome(&mut r, &outcome);
    sh.metrics
        .attempts
        .get_or_create(&crate::metrics::AttemptLabels {
            label: task.label.clone(),
            r#type: task.task_type().as_str().into(),
            status: outcome.status.as_str().into(),
        })
        .inc();
    sh.metrics.duration.observe(elapsed.as_secs_f64());

    let disposition = match (outcome.status, stop.reason().map(|r| r.0)) {
        (Status::Cancelled, Some(StopKind::Shutdown)) => {
            // No result: the next worker runs it again from the start.
            info!("stopped by shutdown; handing back for redelivery");
            live.end(false).await;
            sh.count("interrupted");
            return Disposition::Nak(None);
        }
        (Status::Cancelled, Some(StopKind::LeaseLost)) => {
            // Another worker owns the task now: report, never ack.
            r.is_final = false;
            Disposition::Nothing
        }
        (Status::Success, _) | (Status::Cancelled, _) => Disposition::Ack,
        (Status::Failed | Status::Timeout, _) if attempt < task.retry.max_attempts => {
            let delay = task.retry.delay_after(attempt);
            r.is_final = false;
            r.retry_in_ms = Some(delay.as_millis() as u64);
            Disposition::Nak(Some(delay))
        }
        _ => Disposition::Ack,
    };
    info!(status = %r.status, r#final = r.is_final, duration_ms = r.duration_ms,
        exit_code = ?r.exit_code, error = r.error.as_deref().unwrap_or(""), "attempt finished");
    sh.count(r.status.as_str());
    live.end(r.is_final).await;
    publish_then(sh, r, disposition).await
}

/// The reserved variables, then the task's `env` (which validation keeps
/// from overriding them).
fn task_env(task: &Task, attempt: u32) -> BTreeMap<String, String> {
    let mut env = BTreeMap::new();
    env.insert("IDEMPOTENCY_KEY".to_string(), task.idempotency_key.clone());
    env.insert("SCHEDULE_INSTANCE_ID".to_string(), task.id.clone());
    env.insert("ATTEMPT".to_string(), attempt.to_string());
    if let Some(s) = task.shard {
        env.insert("SHARD_NO".to_string(), s.no.to_string());
        env.insert("SHARD_TOTAL".to_string(), s.total.to_string());
    }
    for (k, v) in &task.env {
        env.insert(k.clone(), v.clone());
    }
    env
}

fn fill_outcome(r: &mut TaskResult, o: &Outcome) {
    r.exit_code = o.exit_code;
    r.signal = o.signal.clone();
    r.http_status = o.http_status;
    r.output = o.output.text.clone();
    r.output_truncated = o.output.truncated;
    r.output_bytes = o.output.total_bytes;
    r.error = o.error.clone();
}

/// Drive `fut` while sending in-progress acks every third of ack wait, so a
/// long task keeps its lease.
async fn with_progress<F: std::future::Future<Output = Outcome>>(
    sh: &Shared,
    msg: &jetstream::Message,
    fut: F,
) -> Outcome {
    let every = (sh.ack_wait / 3).max(Duration::from_millis(100));
    let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tokio::pin!(fut);
    loop {
        tokio::select! {
            o = &mut fut => return o,
            _ = tick.tick() => {
                if let Err(e) = msg.ack_with(AckKind::Progress).await {
                    debug!("progress ack failed: {e}");
                }
            }
        }
    }
}

/// The last stored result of `id`.
pub(crate) async fn last_result(sh: &Shared, id: &str) -> Option<TaskResult> {
    let subject = sh.names.result_subject(id);
    let m = sh
        .infra
        .results
        .direct_get_last_for_subject(subject)
        .await
        .ok()?;
    serde_json::from_slice(&m.payload).ok()
}

/// Serialize a result so that it fits the server's max_payload, shrinking
/// the output if it must.
fn encode_result(r: &mut TaskResult, max_payload: usize) -> Bytes {
    let limit = max_payload.saturating_sub(1024);
    loop {
        let b = serde_json::to_vec(&r).expect("result serializes");
        if b.len() <= limit || r.output.is_empty() {
            return b.into();
        }
        let excess = b.len() - limit;
        let target = r
            .output
            .len()
            .saturating_sub(excess + 64)
            .min(r.output.len() * 9 / 10);
        let shrunk = output::shrink(
            &Captured {
                text: std::mem::take(&mut r.output),
                truncated: r.output_truncated,
                total_bytes: r.output_bytes,
            },
            target,
        );
        r.output = shrunk.text;
        r.output_truncated = shrunk.truncated;
    }
}

/// Publish a result durably, then answer the broker.
async fn publish_then(sh: &Shared, mut r: TaskResult, then: Disposition) -> Disposition {
    let payload = encode_result(&mut r, sh.max_payload);
    let entry = Entry {
        subject: sh.names.result_subject(&r.id),
        msg_id: format!("{}.{}", r.id, r.attempt),
        headers: vec![
            (HEADER_STATUS.to_string(), r.status.as_str().to_string()),
            (HEADER_LABEL.to_string(), r.label.clone()),
        ],
        payload,
    };
    if publish_durably(sh, entry).await {
        then
    } else {
        // Stored in the outbox; the next start publishes it. The message is
        // redelivered after ack wait and found to be finished then.
        Disposition::Nothing
    }
}

/// Publish; on failure keep the entry in the outbox and retry until it is
/// published or the worker gives up (entry left for the next start).
pub(crate) async fn publish_durably(sh: &Shared, entry: Entry) -> bool {
    let first = entry.publish(&sh.js).await;
    let Err(e) = first else { return true };
    warn!(subject = %entry.subject, "publish failed ({e:#}); keeping it in the outbox");
    let path = match sh.outbox.store(&entry) {
        Ok(p) => Some(p),
        Err(err) => {
            warn!("cannot write the outbox ({err}); retrying from memory");
            None
        }
    };
    sh.metrics.outbox.set(sh.outbox.len() as i64);
    let mut delay = Duration::from_millis(200);
    loop {
        tokio::select! {
            _ = sh.abandon.cancelled() => {
                warn!(subject = %entry.subject, "giving up for now; the outbox keeps it for the next start");
                return false;
            }
            _ = tokio::time::sleep(delay) => {}
        }
        delay = (delay * 2).min(Duration::from_secs(5));
        if !sh.conn.is_connected() {
            continue;
        }
        if entry.publish(&sh.js).await.is_ok() {
            if let Some(p) = &path {
                sh.outbox.remove(p);
            }
            sh.metrics.outbox.set(sh.outbox.len() as i64);
            info!(subject = %entry.subject, "published from the outbox");
            return true;
        }
    }
}

/// Tell the broker what became of the message.
async fn answer(sh: &Shared, msg: &jetstream::Message, d: Disposition) {
    let kind = match d {
        Disposition::Ack => AckKind::Ack,
        Disposition::Nak(delay) => AckKind::Nak(delay),
        Disposition::Term => AckKind::Term,
        Disposition::Nothing => return,
    };
    // Wait for the server to confirm, retrying through a short outage, so
    // a result is not followed by a redelivery we could have avoided.
    for i in 0..5u32 {
        match tokio::time::timeout(Duration::from_secs(5), msg.double_ack_with(kind)).await {
            Ok(Ok(())) => return,
            Ok(Err(e)) => debug!("ack failed: {e}"),
            Err(_) => debug!("ack timed out"),
        }
        if sh.abandon.is_cancelled() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200 * (i as u64 + 1))).await;
    }
    warn!(
        "could not answer the broker; the message will be redelivered and recognised as finished"
    );
}

/// Publish a final result (rejected/dead), copy the original message to
/// DEAD with the reason, then Term.
async fn dead_letter(sh: &Shared, msg: &jetstream::Message, label: &str, id: &str, r: TaskResult) {
    sh.count(r.status.as_str());
    let reason = r.error.clone().unwrap_or_default();
    let mut headers = vec![
        (HEADER_REASON.to_string(), one_line(&reason)),
        (HEADER_TASK_ID.to_string(), id.to_string()),
        (HEADER_LABEL.to_string(), label.to_string()),
        (HEADER_STATUS.to_string(), r.status.as_str().to_string()),
        ("Jetworker-Subject".to_string(), msg.subject.to_string()),
    ];
    if let Some(h) = &msg.headers {
        copy_headers(h, &mut headers);
    }
    let seq = msg.info().map(|i| i.stream_sequence).unwrap_or(0);
    let dead = Entry {
        subject: sh.names.dead_subject(label, id),
        msg_id: format!("dead-{}-{}", sh.names.tasks_stream, seq),
        headers,
        payload: msg.payload.clone(),
    };
    if !publish_durably(sh, dead).await {
        return;
    }
    let d = publish_then(sh, r, Disposition::Term).await;
    answer(sh, msg, d).await;
}

/// Original headers worth keeping on a dead letter (not the server's own).
fn copy_headers(h: &HeaderMap, out: &mut Vec<(String, String)>) {
    for (k, vs) in h.iter() {
        let k = k.to_string();
        if k.eq_ignore_ascii_case("Nats-Msg-Id") {
            if let Some(v) = vs.first() {
                out.push(("Jetworker-Original-Msg-Id".into(), v.to_string()));
            }
            continue;
        }
        if k.starts_with("Nats-") || k.starts_with("Jetworker-") {
            continue;
        }
        for v in vs {
            out.push((k.clone(), v.to_string()));
        }
    }
}

fn one_line(s: &str) -> String {
    let l: String = s
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect();
    l.chars().take(1000).collect()
}

/// Invalid input: final `rejected` result naming the problem, original
/// bytes to DEAD, Term. Never retried, never lost.
async fn reject(
    sh: &Shared,
    msg: &jetstream::Message,
    label: &str,
    id: String,
    attempt: u32,
    problem: String,
) {
    warn!(%problem, "rejected task");
    let now = Utc::now();
    let task_type = serde_json::from_slice::<serde_json::Value>(&msg.payload)
        .ok()
        .and_then(|v| {
            v.get("type")
                .and_then(|t| t.as_str())
                .and_then(|t| t.parse::<TaskType>().ok())
        });
    let mut r = TaskResult::blank(
        &id,
        label,
        task_type,
        Status::Rejected,
        attempt,
        DEFAULT_MAX_ATTEMPTS,
        &sh.id,
        now,
    );
    r.error = Some(format!("invalid task: {problem}"));
    dead_letter(sh, msg, label, &id, r).await;
}
