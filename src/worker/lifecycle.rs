//! The task lifecycle: one delivered message, from arrival to the one
//! answer the broker gets (DESIGN.md sections 1 and 5). [`handle`] reads
//! top to bottom:
//!
//! 1. **validate** — invalid: original bytes to DEAD, final `rejected`,
//!    Terminate;
//! 2. **type** — one this worker does not run: Redeliver in 1 s for another
//!    worker of the label (not an attempt); `dead` once the deliveries reach
//!    `max_attempts` and no online worker of the label runs the type;
//! 3. **already running here** — the same message again means our lease
//!    was lost: stop our copy, wait for it, take over; another message
//!    with the same id: Redeliver later (not an attempt);
//! 4. **claim** — decided against the last record on `results.<id>` and
//!    written with compare-and-set ([`write_after`]): a final record →
//!    Ack without running; `running` for another message → Redeliver later;
//!    a cancel key (or a join's policy, [`Task::not_run_reason`]) → final
//!    `cancelled`, Ack; past the task's `expires` → DEAD copy, final
//!    `expired`, Ack; attempts used up → DEAD copy,
//!    final `dead`, Terminate; otherwise `running{attempt n}`. A first
//!    delivery assumes an empty subject, so it starts after one round trip;
//! 5. **run** — with a progress ack every quarter of ack wait; a copy whose
//!    lease is no longer confirmed is stopped before the broker can hand
//!    the message to someone else ([`keep_lease`]);
//! 6. **report** — a final `failed`/`timeout` (or a retry that would start
//!    after `expires`: `expired`) first copies the original to DEAD; then
//!    the attempt's record, compare-and-set on the claim, through the
//!    outbox ([`super::outbox::deliver`]);
//!    before a message whose id has a final record is acked, the tasks
//!    that record queues are queued ([`settle`]);
//! 7. **answer** — [`answer`], the one place that answers the broker.
//!
//! Every path ends in an [`Answer`], named after what happens to the
//! message next. Every final record this worker stores is counted in one
//! of two places: [`write_after`] (settled without a run) and [`report`]
//! (after a run), both through [`finished`].

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::jetstream::{self, AckKind};
use async_nats::HeaderMap;
use chrono::{DateTime, Utc};
use tracing::{debug, error_span, info, warn, Instrument};

use super::downstream::{self, NotYet};
use super::outbox::{self, Delivered, Entry, PublishFailure};
use super::records::{self, Last};
use super::Shared;
use crate::output::LiveOutput;
use crate::protocol::{
    self, best_effort_id, Envelope, Status, Task, TaskResult, DEFAULT_MAX_ATTEMPTS, HEADER_LABEL,
    HEADER_REASON, HEADER_SCHEDULER, HEADER_STATUS, HEADER_TASK_ID, HEADER_TRUNCATED,
};
use crate::runner::{Outcome, RunContext, Stop, StopKind};

/// What happens to the message next: the one decision the broker hears.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Answer {
    /// Its result, or a final result for its id, is stored: Ack.
    Ack,
    /// A non-final result is stored; the next attempt after this delay: Nak.
    RetryIn(Duration),
    /// Not run, not an attempt (a type for another worker, an id running
    /// elsewhere, a hand-back at shutdown, the broker busy): Nak, redelivered
    /// after the delay.
    Redeliver(Duration),
    /// A final record is stored and the original is in DEAD: Term.
    Terminate,
    /// Say nothing: the lease is lost (the message belongs to another
    /// delivery now) or the result waits in the outbox; the broker
    /// redelivers after ack wait.
    LeaveUnanswered,
}

/// How long a message whose id runs elsewhere waits before it looks again.
const WAIT_FOR_RUNNING: Duration = Duration::from_secs(1);
/// How long a message waits when the broker could not be asked.
const BROKER_RETRY: Duration = Duration::from_secs(1);
/// How long a task of another type waits for another worker to take it.
const OTHER_TYPE_RETRY: Duration = Duration::from_secs(1);
/// Compare-and-set rounds before giving the message back (each refusal
/// means another writer moved the state on; this bounds a pathological
/// race, it is never reached in practice).
const MAX_CAS_ROUNDS: usize = 8;

/// What the broker told us about the delivery.
struct Delivery {
    /// TASKS stream sequence: the message's identity across redeliveries.
    seq: u64,
    /// JetStream delivery count (attempts come from the records instead).
    delivered: u32,
    published: Option<DateTime<Utc>>,
    /// When it arrived: the lease is counted from here.
    received: Instant,
}

/// Handle one message; never panics, answers the broker exactly once
/// (or deliberately not at all).
pub(crate) async fn handle(sh: Arc<Shared>, label: String, msg: jetstream::Message) {
    let received = Instant::now();
    let then = match msg.info() {
        Ok(i) => {
            let d = Delivery {
                seq: i.stream_sequence,
                delivered: i.delivered.max(1) as u32,
                published: Some(protocol::chrono_time(i.published)),
                received,
            };
            lifecycle(&sh, &label, &msg, &d).await
        }
        Err(e) => {
            warn!("message without JetStream info ({e}); terminating it");
            Answer::Terminate
        }
    };
    answer(&sh, &msg, then).await;
}

async fn lifecycle(
    sh: &Arc<Shared>,
    label: &str,
    msg: &jetstream::Message,
    d: &Delivery,
) -> Answer {
    let msg_id = protocol::header(
        msg.headers.as_ref(),
        async_nats::header::NATS_MESSAGE_ID.as_ref(),
    );
    let scheduler = protocol::header(msg.headers.as_ref(), HEADER_SCHEDULER);
    let env = Envelope {
        label,
        msg_id: msg_id.as_deref(),
        stream_sequence: d.seq,
        scheduler: scheduler.as_deref(),
        published: d.published,
    };

    // 1. Validate.
    let task = match protocol::parse_task(&msg.payload, &env, &sh.validation) {
        Ok(t) => Arc::new(t),
        Err(invalid) => {
            let id = best_effort_id(&msg.payload, &env);
            let span = error_span!("task", task_id = %id, label, attempt = d.delivered);
            return reject(sh, msg, d, label, id, invalid.to_string())
                .instrument(span)
                .await;
        }
    };
    // `attempt` is recorded once the claim decides it.
    // At error level, like the worker's span, so that it is enabled
    // whatever the log level: a warning about a task names the task.
    let span = error_span!("task", task_id = %task.id, label, r#type = %task.task_type(),
        attempt = tracing::field::Empty);
    async move {
        // 2. A type this worker runs?
        if !task.runnable() || !sh.types.iter().any(|t| t == task.task_type()) {
            return settle(sh, &task, other_type(sh, msg, d, &task).await).await;
        }

        // 3. Already running here?
        let stop = Stop::new();
        let _guard = loop {
            match sh.running.register(&task.id, label, d.seq, stop.clone()) {
                Ok(g) => break g,
                Err(busy) if busy.same_message => {
                    warn!("redelivered while our copy still runs: its lease is lost; stopping it and taking over");
                    busy.stop.fire(
                        StopKind::LeaseLost,
                        "lease lost: the broker redelivered the message",
                    );
                    busy.finished.cancelled().await;
                }
                Err(_) => {
                    debug!("the id is running on this worker; looking again later");
                    return Answer::Redeliver(WAIT_FOR_RUNNING);
                }
            }
        };

        // 4. Claim the attempt (or learn that there is nothing to run).
        let (attempt, claim_seq) = match claim(sh, msg, d, &task).await {
            Ok(c) => c,
            Err(answer) => return settle(sh, &task, answer).await,
        };

        // 5. Run.
        let (record, then) = run(sh, msg, d, &task, attempt, stop).await;

        // 6. Report, then 7. answer (by the caller).
        settle(sh, &task, report(sh, msg, record, claim_seq, then).await).await
    }
    .instrument(span)
    .await
}

/// Step 2: a task of a type this worker does not run.
async fn other_type(sh: &Shared, msg: &jetstream::Message, d: &Delivery, task: &Task) -> Answer {
    let ty = task.task_type();
    if d.delivered < task.retry.max_attempts || sh.type_served(&task.label, ty) {
        info!("type {ty} is not run by this worker; handing it back");
        return Answer::Redeliver(OTHER_TYPE_RETRY);
    }
    let started = Utc::now();
    let known = sh.known_types();
    let error = format!(
        "no online worker on label {} runs type {ty}{} (this one runs {})",
        task.label,
        crate::suggest::hint(ty, known.iter().map(String::as_str)),
        sh.types.join(",")
    );
    warn!("{error}; dead-lettering");
    let written = write_after(sh, msg, d, &task.id, false, |prev| {
        match prev_record(prev) {
            Some(p) if p.is_final => Plan::Answer(Answer::Ack),
            Some(p) if records::held_elsewhere(sh, p) => {
                Plan::Answer(Answer::Redeliver(WAIT_FOR_RUNNING))
            }
            p => {
                let mut r = base_result(sh, task, next_attempt(p), Status::Dead, started, d);
                r.error = Some(error.clone());
                Plan::Write(Box::new(r))
            }
        }
    })
    .await;
    match written {
        Ok(_) => Answer::Terminate,
        Err(a) => a,
    }
}

/// Step 4: decide against the last record and claim the attempt with
/// compare-and-set. `Ok((attempt, seq of the claim))` to run; `Err` with
/// the answer when there is nothing to run.
async fn claim(
    sh: &Shared,
    msg: &jetstream::Message,
    d: &Delivery,
    task: &Task,
) -> Result<(u32, u64), Answer> {
    let started = Utc::now();
    let (r, seq) = write_after(sh, msg, d, &task.id, false, |prev| {
        let p = prev_record(prev);
        match p {
            Some(p) if p.is_final => {
                info!(status = %p.status, "already has a final result; acking without running");
                return Plan::Answer(Answer::Ack);
            }
            // A claim of ours for this very message that we no longer run
            // (its PubAck was lost): it is ours, use it.
            Some(p) if p.status == Status::Running
                && p.worker_id == sh.id
                && p.task_seq == Some(d.seq) =>
            {
                return Plan::Adopt;
            }
            Some(p) if records::held_elsewhere(sh, p) => {
                debug!(worker = %p.worker_id, "the id is running on another worker; waiting");
                return Plan::Answer(Answer::Redeliver(WAIT_FOR_RUNNING));
            }
            _ => {}
        }
        let attempt = next_attempt(p);
        let mut r = base_result(sh, task, attempt, Status::Running, started, d);
        if let Some(reason) = sh.cancel_reason(&task.id) {
            r.status = Status::Cancelled;
            r.error = Some(if reason.is_empty() {
                "cancelled before it started".into()
            } else {
                format!("cancelled before it started: {reason}")
            });
        } else if task.expired_at(started) {
            r.status = Status::Expired;
            r.error = Some(format!(
                "expired at {} before attempt {attempt} could start",
                rfc3339(task.deadline)
            ));
        } else if let Some(why) = task.not_run_reason() {
            info!("{why}");
            r.status = Status::Cancelled;
            r.error = Some(why);
        } else if attempt > task.retry.max_attempts {
            r.status = Status::Dead;
            r.error = Some(format!(
                "attempt {attempt} exceeds max_attempts {}: earlier attempts were lost with their worker",
                task.retry.max_attempts
            ));
        } else {
            r.is_final = false;
        }
        downstream::stamp(&mut r, task);
        Plan::Write(Box::new(r))
    })
    .await?;
    // Recorded once, so that every later line of the task (and the text
    // format's span prefix) names it once.
    tracing::Span::current().record("attempt", r.attempt);
    match r.status {
        Status::Running => Ok((r.attempt, seq)),
        Status::Dead => {
            warn!("attempts used up by lost deliveries; dead-lettered");
            Err(Answer::Terminate)
        }
        Status::Expired => {
            info!(expires = %rfc3339(task.deadline), "expired before it started; dead-lettered");
            Err(Answer::Ack)
        }
        _ => {
            info!(status = %r.status, "not run: {}", r.error.as_deref().unwrap_or(""));
            Err(Answer::Ack)
        }
    }
}

/// A time for a message, seconds precision (`-` for none).
fn rfc3339(t: Option<DateTime<Utc>>) -> String {
    t.map_or_else(
        || "-".into(),
        |t| t.to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
    )
}

/// What [`write_after`] should do after the last record.
enum Plan {
    /// Write this record.
    Write(Box<TaskResult>),
    /// The last record is our own claim: take it as written.
    Adopt,
    /// Write nothing; answer this.
    Answer(Answer),
}

/// Write the record that `decide` plans after the last one on
/// `results.<id>`, with compare-and-set; on a refusal read the new last
/// record and decide again (never a blind retry). A planned final status
/// that keeps the original ([`Status::dead_lettered`]: `dead`, `expired`)
/// first copies it to DEAD, so a crash never loses it, unless
/// `original_kept` says it is there already. A stored final record is
/// counted ([`finished`]). `Ok((record, its stream sequence))`, or the
/// answer when nothing was written.
async fn write_after(
    sh: &Shared,
    msg: &jetstream::Message,
    d: &Delivery,
    id: &str,
    original_kept: bool,
    mut decide: impl FnMut(Option<&Last>) -> Plan,
) -> Result<(TaskResult, u64), Answer> {
    // A first delivery assumes that nothing is stored yet: when that holds
    // (nearly always) the claim is the only round trip.
    let mut last = if d.delivered == 1 {
        None
    } else {
        read_last(sh, id).await?
    };
    let mut dead_copied = original_kept;
    for _ in 0..MAX_CAS_ROUNDS {
        let mut r = match decide(last.as_ref()) {
            Plan::Write(r) => *r,
            Plan::Adopt => {
                let l = last.expect("adopt follows a record");
                return Ok((l.record.expect("adopt follows a parsed record"), l.seq));
            }
            Plan::Answer(a) => return Err(a),
        };
        if r.is_final && r.status.dead_lettered() && !dead_copied {
            dead_copy(sh, msg, &r).await?;
            dead_copied = true;
        }
        let expected = last.as_ref().map_or(0, |l| l.seq);
        let entry = records::entry(sh, &mut r, expected, false);
        match entry.publish(&sh.client, sh.max_payload).await {
            Ok(seq) => {
                settled_without_run(sh, &r);
                return Ok((r, seq));
            }
            Err(PublishFailure::Refused) => {
                last = read_last(sh, id).await?;
                if let Some(l) = &last {
                    if l.msg_id.as_deref() == Some(entry.msg_id.as_str()) {
                        // Our own write, whose PubAck was lost.
                        settled_without_run(sh, &r);
                        return Ok((r, l.seq));
                    }
                }
            }
            Err(PublishFailure::NoStream) => {
                if let Err(e) = sh.recreate_streams().await {
                    warn!("cannot recreate the streams: {e:#}");
                }
                return Err(Answer::Redeliver(BROKER_RETRY));
            }
            Err(f) => {
                warn!("cannot write results.{id} ({f:?}); handing the message back");
                return Err(Answer::Redeliver(BROKER_RETRY));
            }
        }
    }
    warn!("results.{id} kept moving under us; handing the message back");
    Err(Answer::Redeliver(BROKER_RETRY))
}

/// A record [`write_after`] stored: a final one (decided without a run)
/// is counted in the heartbeat's counts and the metrics.
fn settled_without_run(sh: &Shared, r: &TaskResult) {
    if r.is_final {
        sh.count(r.status.as_str());
        finished(sh, r);
    }
}

/// Count a final status this worker stored (metrics
/// `tasks_finished_total{label, type, status}`).
fn finished(sh: &Shared, r: &TaskResult) {
    let ty = r.task_type.as_deref().unwrap_or("unknown");
    sh.metrics.finished(&r.label, ty, r.status.as_str());
}

/// The last record, or the answer when the broker cannot tell.
async fn read_last(sh: &Shared, id: &str) -> Result<Option<Last>, Answer> {
    records::read_last(sh, id).await.map_err(|e| {
        debug!("{e:#}; handing the message back");
        Answer::Redeliver(BROKER_RETRY)
    })
}

fn prev_record(prev: Option<&Last>) -> Option<&TaskResult> {
    prev.and_then(|l| l.record.as_ref())
}

/// The attempt number that follows `prev`: a non-final result or a queued
/// state of attempt n, or a claim of attempt n being taken over, is
/// followed by n + 1.
fn next_attempt(prev: Option<&TaskResult>) -> u32 {
    prev.map_or(1, |p| p.attempt + 1)
}

/// A record with the fields every status shares (final unless changed).
fn base_result(
    sh: &Shared,
    task: &Task,
    attempt: u32,
    status: Status,
    started: DateTime<Utc>,
    d: &Delivery,
) -> TaskResult {
    let mut r = TaskResult::blank(
        &task.id,
        &task.label,
        Some(task.task_type.clone()),
        status,
        attempt,
        task.retry.max_attempts,
        &sh.id,
        started,
    );
    r.idempotency_key = Some(task.idempotency_key.clone());
    r.shard = task.shard;
    r.task_seq = Some(d.seq);
    downstream::stamp(&mut r, task);
    r
}

/// Step 5: run one attempt; its record and the answer it asks for.
async fn run(
    sh: &Shared,
    msg: &jetstream::Message,
    d: &Delivery,
    task: &Arc<Task>,
    attempt: u32,
    stop: Stop,
) -> (TaskResult, Answer) {
    let started = Utc::now();
    let live = LiveOutput::new(sh.live_client.clone(), sh.names.logs_subject(&task.id));
    let mut ctx = RunContext::new(
        task.clone(),
        attempt,
        &sh.id,
        sh.cfg.default_timeout,
        sh.cfg.kill_grace,
        sh.output_cap,
    );
    ctx.stop = stop.clone();
    ctx.live = Some(live.clone());
    let timeout = ctx.timeout;
    debug!(?timeout, "running");
    let t0 = Instant::now();
    let outcome = keep_lease(sh, msg, d.received, &stop, sh.runners.run(ctx)).await;
    let elapsed = t0.elapsed();
    sh.metrics.attempt(
        &task.label,
        task.task_type(),
        outcome.status.as_str(),
        elapsed.as_secs_f64(),
    );

    let mut r = base_result(sh, task, attempt, outcome.status, started, d);
    fill_outcome(&mut r, &outcome);
    // The runner has handed all its output over: whether any went live is
    // settled (an attempt that ended before its first flush published none).
    r.live = live.published();
    let then = match (outcome.status, stop.reason().map(|r| r.0)) {
        (Status::Cancelled, Some(StopKind::Shutdown)) => {
            // Not an attempt: the next worker runs it again from the start.
            info!("stopped by shutdown; handing back for redelivery");
            r.status = Status::Queued;
            r.is_final = false;
            r.attempt = attempt - 1;
            r.error = Some(format!("handed back by {} at shutdown", sh.id));
            downstream::stamp(&mut r, task);
            sh.count("interrupted");
            live.end(false).await;
            return (r, Answer::Redeliver(Duration::ZERO));
        }
        (Status::Cancelled, Some(StopKind::LeaseLost)) => {
            // Another delivery owns the task now: report, never answer.
            sh.metrics.lease_lost.inc();
            r.is_final = false;
            Answer::LeaveUnanswered
        }
        (Status::Success, _) | (Status::Cancelled, _) => Answer::Ack,
        (Status::Failed | Status::Timeout, _)
            if attempt < task.retry.max_attempts && !outcome.permanent =>
        {
            let delay = task.retry.delay_after(attempt);
            let next = Utc::now() + delay;
            if task.expired_at(next) {
                // Waiting for a retry that may not start is pointless: the
                // task expires now, its last attempt's outcome kept.
                let why = r.error.take().unwrap_or_else(|| r.status.to_string());
                r.error = Some(format!(
                    "{why}; not retried: attempt {} would start at {}, after the task expires at {}",
                    attempt + 1,
                    rfc3339(Some(next)),
                    rfc3339(task.deadline)
                ));
                r.status = Status::Expired;
                Answer::Ack
            } else {
                r.is_final = false;
                r.retry_in_ms = Some(delay.as_millis() as u64);
                Answer::RetryIn(delay)
            }
        }
        _ => Answer::Ack,
    };
    downstream::stamp(&mut r, task);
    info!(status = %r.status, r#final = r.is_final, duration_ms = r.duration_ms,
        exit_code = r.exit_code.map(|c| c.to_string()).unwrap_or_default(),
        error = r.error.as_deref().unwrap_or(""), "attempt finished");
    sh.count(r.status.as_str());
    live.end(r.is_final).await;
    (r, then)
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

/// Drive the attempt while keeping its lease: a progress ack every quarter
/// of ack wait, each confirmed by the server. The lease is counted from the
/// message's arrival and from each confirmed progress ack (sent time), never
/// from connection events. When none has been confirmed for three quarters
/// of ack wait, the broker may hand the message to another worker a quarter
/// later, so the copy is stopped now (fencing), unless the worker is set to
/// keep such copies (`--on-lease-lost keep`).
async fn keep_lease<F: Future<Output = Outcome>>(
    sh: &Shared,
    msg: &jetstream::Message,
    received: Instant,
    stop: &Stop,
    fut: F,
) -> Outcome {
    let every = (sh.ack_wait / 4).max(Duration::from_millis(100));
    let fence_after = sh.ack_wait * 3 / 4;
    let fence = sh.cfg.on_lease_lost == crate::config::LeaseLost::Kill;
    let mut confirmed = received;
    let mut next_progress = Instant::now() + every;
    let mut fenced = false;
    type Progress<'a> = Pin<Box<dyn Future<Output = (Instant, bool)> + Send + 'a>>;
    let mut progress: Option<Progress<'_>> = None;
    tokio::pin!(fut);
    loop {
        let wake = if fenced || !fence {
            next_progress
        } else {
            next_progress.min(confirmed + fence_after)
        };
        tokio::select! {
            o = &mut fut => return o,
            (sent, ok) = async { progress.as_mut().expect("guarded").await }, if progress.is_some() => {
                progress = None;
                if ok {
                    confirmed = confirmed.max(sent);
                } else {
                    debug!("progress ack not confirmed");
                }
            }
            _ = tokio::time::sleep_until(wake.into()) => {}
        }
        let now = Instant::now();
        if fence && !fenced && now >= confirmed + fence_after {
            fenced = true;
            warn!(unconfirmed_ms = (now - confirmed).as_millis() as u64,
                "lease lost: no progress ack confirmed; stopping this copy before the task is redelivered");
            stop.fire(
                StopKind::LeaseLost,
                format!(
                    "lease lost: no progress ack confirmed for {} (ack wait {})",
                    humantime::format_duration(Duration::from_millis(
                        (now - confirmed).as_millis() as u64
                    )),
                    humantime::format_duration(sh.ack_wait)
                ),
            );
        }
        if now >= next_progress && progress.is_none() {
            next_progress = now + every;
            progress = Some(Box::pin(async move {
                let ok = matches!(
                    tokio::time::timeout(every, msg.double_ack_with(AckKind::Progress)).await,
                    Ok(Ok(()))
                );
                (now, ok)
            }));
        }
    }
}

/// Step 6: store the attempt's record after the claim (compare-and-set on
/// the claim's sequence), through the outbox. A refusal means the claim
/// was taken over (our lease was lost): the record is dropped.
///
/// A final record whose status keeps the original (`failed`, `timeout`,
/// `expired`: [`Status::dead_lettered`]) first copies it to DEAD, as a
/// `dead` claim does, so that `jetworker retry` can run it again; a crash
/// between the two leaves a copy and a `running` claim, which the
/// redelivery takes over as the next attempt (attempts used up: `dead`,
/// whose copy the duplicate window folds into this one). A copy the
/// broker cannot take now stays in the outbox ahead of the record.
async fn report(
    sh: &Shared,
    msg: &jetstream::Message,
    mut r: TaskResult,
    claim_seq: u64,
    then: Answer,
) -> Answer {
    if r.is_final && r.status.dead_lettered() {
        // Err only when the outbox keeps it (shutdown, broker gone): the
        // record below then waits there too, after it.
        let _ = dead_copy(sh, msg, &r).await;
    }
    let entry = records::entry(sh, &mut r, claim_seq, true);
    match outbox::deliver(sh, &entry, None).await {
        Delivered::Stored => {
            if r.is_final {
                finished(sh, &r);
            }
            then
        }
        Delivered::Superseded(last) if last.as_ref().is_some_and(|l| l.is_final()) => Answer::Ack,
        Delivered::Superseded(_) | Delivered::Kept => Answer::LeaveUnanswered,
        Delivered::Dropped(why) => {
            warn!("the result can never be stored ({why}); terminating the message");
            Answer::Terminate
        }
    }
}

/// Step 6b: before a message whose id has a final record is acked or
/// terminated, everything that record queues is queued ([`downstream`]:
/// `then`, a shard's part of its join). A crash in between leaves the
/// message unacked; its redelivery finds the final record and does it
/// again, idempotently.
async fn settle(sh: &Shared, task: &Task, a: Answer) -> Answer {
    if !task.has_downstream() || !matches!(a, Answer::Ack | Answer::Terminate) {
        return a;
    }
    if sh.die_before_downstream {
        warn!("JETWORKER_TEST_FAULT=die-before-downstream: exiting before the downstream tasks");
        // SAFETY: _exit ends the process at once, like a crash would.
        unsafe { libc::_exit(87) };
    }
    match downstream::ensure(sh, task).await {
        Ok(()) => a,
        Err(NotYet::Kept) => Answer::LeaveUnanswered,
        Err(NotYet::Broker) => Answer::Redeliver(BROKER_RETRY),
    }
}

/// Step 7: tell the broker what became of the message — the only place
/// that does. Acks are not awaited: a lost one means a redelivery, which
/// finds the final record and is acked without running.
pub(crate) async fn answer(sh: &Shared, msg: &jetstream::Message, a: Answer) {
    let kind = match a {
        Answer::Ack => AckKind::Ack,
        Answer::RetryIn(d) => AckKind::Nak(Some(d)),
        Answer::Redeliver(d) if d.is_zero() => AckKind::Nak(None),
        Answer::Redeliver(d) => AckKind::Nak(Some(d)),
        Answer::Terminate => AckKind::Term,
        Answer::LeaveUnanswered => return,
    };
    if sh.die_before_ack && a == Answer::Ack {
        warn!("JETWORKER_TEST_FAULT=die-before-ack: exiting before the ack");
        // SAFETY: _exit ends the process at once, like a crash would.
        unsafe { libc::_exit(86) };
    }
    if let Err(e) = msg.ack_with(kind).await {
        debug!("answering the broker failed ({e}); the message will be redelivered");
    }
}

/// Copy the original message to DEAD with the reason; `Err` with the
/// answer when it could not be stored yet. A message too large to copy
/// whole keeps as much as fits and says so (`Jetworker-Truncated`).
async fn dead_copy(sh: &Shared, msg: &jetstream::Message, r: &TaskResult) -> Result<(), Answer> {
    let mut headers = vec![
        (HEADER_REASON.to_string(), one_line(&dead_reason(r))),
        (HEADER_TASK_ID.to_string(), r.id.clone()),
        (HEADER_LABEL.to_string(), r.label.clone()),
        (HEADER_STATUS.to_string(), r.status.as_str().to_string()),
        ("Jetworker-Subject".to_string(), msg.subject.to_string()),
    ];
    if let Some(h) = &msg.headers {
        copy_headers(h, &mut headers);
    }
    let seq = msg.info().map(|i| i.stream_sequence).unwrap_or(0);
    let mut entry = Entry {
        subject: sh.names.dead_subject(&r.label, &r.id),
        msg_id: format!("dead-{}-{}", sh.names.tasks_stream, seq),
        headers,
        expected_last_seq: None,
        cas_only: false,
        payload: msg.payload.clone(),
    };
    fit_dead_copy(&mut entry, sh.max_payload);
    match outbox::deliver(sh, &entry, None).await {
        Delivered::Stored | Delivered::Superseded(_) => Ok(()),
        // Logged by deliver; going on is better than a wedged slot.
        Delivered::Dropped(_) => Ok(()),
        Delivered::Kept => Err(Answer::LeaveUnanswered),
    }
}

/// The `Jetworker-Reason` of a DEAD copy: the record's error, or for an
/// attempt that failed without one what it came to (`exit 3`).
fn dead_reason(r: &TaskResult) -> String {
    let detail = r.error.clone().unwrap_or_else(|| {
        if let Some(c) = r.exit_code {
            format!("exit {c}")
        } else if let Some(s) = &r.signal {
            format!("killed by {s}")
        } else if let Some(h) = r.http_status {
            format!("HTTP {h}")
        } else {
            r.status.to_string()
        }
    });
    match r.status {
        Status::Failed | Status::Timeout => format!(
            "{} on attempt {}/{}: {detail}",
            r.status, r.attempt, r.max_attempts
        ),
        _ => detail,
    }
}

/// Shorten a DEAD copy's payload until the whole message fits the
/// server's `max_payload`, saying how much was kept.
fn fit_dead_copy(e: &mut Entry, max_payload: usize) {
    if e.wire_size() <= max_payload {
        return;
    }
    let total = e.payload.len();
    e.headers.push((
        HEADER_TRUNCATED.to_string(),
        format!("kept the first 0000000000 of {total} bytes"),
    ));
    let keep = total.saturating_sub(e.wire_size() - max_payload);
    e.payload = e.payload.slice(..keep);
    let last = e.headers.len() - 1;
    e.headers[last].1 = format!("kept the first {keep} of {total} bytes");
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

/// Step 1 failed: invalid input. The original bytes go to DEAD, then a
/// final `rejected` record names the problem (unless the id already
/// belongs to a finished or running task, whose record stays), Terminate.
/// Never retried, never lost.
async fn reject(
    sh: &Shared,
    msg: &jetstream::Message,
    d: &Delivery,
    label: &str,
    id: String,
    problem: String,
) -> Answer {
    warn!(%problem, "rejected task");
    let task_type = serde_json::from_slice::<serde_json::Value>(&msg.payload)
        .ok()
        .and_then(|v| {
            v.get("type")
                .and_then(|t| t.as_str())
                .filter(|t| crate::runner::check_type_name(t).is_ok())
                .map(str::to_string)
        });
    let mut r = TaskResult::blank(
        &id,
        label,
        task_type,
        Status::Rejected,
        d.delivered,
        DEFAULT_MAX_ATTEMPTS,
        &sh.id,
        Utc::now(),
    );
    r.error = Some(format!("invalid task: {problem}"));
    r.task_seq = Some(d.seq);
    if let Err(a) = dead_copy(sh, msg, &r).await {
        return a;
    }
    let written = write_after(sh, msg, d, &id, true, |prev| match prev_record(prev) {
        Some(p) if p.is_final || records::held_elsewhere(sh, p) => {
            info!(status = %p.status, "the id belongs to another task; its record stays");
            Plan::Answer(Answer::Terminate)
        }
        _ => Plan::Write(Box::new(r.clone())),
    })
    .await;
    match written {
        Ok(_) => Answer::Terminate,
        Err(a) => a,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dead_copy_fits_max_payload() {
        let mut e = Entry {
            subject: "dead.default.x".into(),
            msg_id: "dead-TASKS-1".into(),
            headers: vec![("Jetworker-Reason".into(), "too big".into())],
            expected_last_seq: None,
            cas_only: false,
            payload: bytes::Bytes::from(vec![b'a'; 1 << 20]),
        };
        fit_dead_copy(&mut e, 1 << 20);
        assert!(e.wire_size() <= 1 << 20, "{}", e.wire_size());
        let (k, v) = e.headers.last().unwrap();
        assert_eq!(k, HEADER_TRUNCATED);
        assert_eq!(
            v,
            &format!("kept the first {} of {} bytes", e.payload.len(), 1 << 20)
        );
        assert!(e.payload.len() > (1 << 20) - 1024);
    }

    #[test]
    fn attempts_follow_the_records() {
        assert_eq!(next_attempt(None), 1);
        let mut r = TaskResult::blank("a", "l", None, Status::Failed, 2, 3, "w", Utc::now());
        assert_eq!(next_attempt(Some(&r)), 3);
        r.status = Status::Queued;
        r.attempt = 0;
        assert_eq!(next_attempt(Some(&r)), 1);
    }
}
