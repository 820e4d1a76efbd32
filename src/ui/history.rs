//! What the dashboard reads on request and never holds: results paged
//! backwards from the RESULTS stream, one task's records, dead letters and
//! schedules (read by the same code as `jetworker dead` and `schedule ls`).
//!
//! **Results, newest first.** One row per task, at its latest record, if
//! that record passes the filters (status, label, id prefix, since). A page
//! is read backwards in windows: an ordered consumer from the window's
//! first sequence, read up to its last, the window's rows taken in reverse.
//! The first record of an id seen going back is its latest one below the
//! page's start; on later pages (a `before` cursor) a direct get of the
//! id's last record tells whether a newer one was on an earlier page. A
//! request scans at most [`MAX_SCAN`] records and answers with a cursor to
//! go on from, so a rare filter over a long stream costs several short
//! requests, never one long one or history in memory.
//!
//! **Secrets.** Results carry no environment; the task JSON of dead
//! letters and schedules does (`env`) and may carry credentials in http
//! `headers`: their values are shown as `•••`.

use std::collections::HashSet;
use std::time::Duration;

use anyhow::Context as _;
use async_nats::jetstream::consumer::DeliverPolicy;
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use crate::commands::common::{parse_result, Conn, OrderedReader};
use crate::commands::dead::DeadLetter;
use crate::commands::output::{first_line, parse_since};
use crate::protocol::{Status, TaskResult};

/// Records scanned for one request at most.
pub(crate) const MAX_SCAN: u64 = 20_000;
/// The first window read back; later ones grow up to [`MAX_WINDOW`].
const FIRST_WINDOW: u64 = 256;
const MAX_WINDOW: u64 = 4096;
/// Rows per page at most.
pub(crate) const MAX_LIMIT: usize = 500;
/// Length of the output/error snippet of a row.
const SNIPPET: usize = 160;

/// One result record as a row of the list (no full output).
#[derive(Debug, Clone, Serialize)]
pub(crate) struct ResultRow {
    /// RESULTS stream sequence of the record.
    pub seq: u64,
    /// When the record was stored.
    pub time: DateTime<Utc>,
    pub id: String,
    pub label: String,
    pub status: Status,
    #[serde(rename = "final")]
    pub is_final: bool,
    pub attempt: u32,
    pub max_attempts: u32,
    pub worker: String,
    pub started_at: DateTime<Utc>,
    pub finished_at: DateTime<Utc>,
    pub duration_ms: u64,
    pub retry_in_ms: Option<u64>,
    /// The first line of the output, else of the error.
    pub snippet: String,
}

impl ResultRow {
    pub(crate) fn new(seq: u64, time: DateTime<Utc>, r: &TaskResult) -> ResultRow {
        let text = if r.output.trim().is_empty() {
            r.error.as_deref().unwrap_or("")
        } else {
            r.output.as_str()
        };
        ResultRow {
            seq,
            time,
            id: r.id.clone(),
            label: r.label.clone(),
            status: r.status,
            is_final: r.is_final,
            attempt: r.attempt,
            max_attempts: r.max_attempts,
            worker: r.worker_id.clone(),
            started_at: r.started_at,
            finished_at: r.finished_at,
            duration_ms: r.duration_ms,
            retry_in_ms: r.retry_in_ms,
            snippet: first_line(text, SNIPPET),
        }
    }

    /// A `running` or `queued` state rather than an attempt's result.
    pub(crate) fn is_state(&self) -> bool {
        matches!(self.status, Status::Running | Status::Queued)
    }
}

/// `GET /api/results` parameters.
#[derive(Debug, Default, Deserialize)]
pub(crate) struct ResultsQuery {
    /// Only records below this sequence (the cursor of the previous page).
    pub before: Option<u64>,
    pub limit: Option<usize>,
    /// Comma-separated statuses.
    pub status: Option<String>,
    pub label: Option<String>,
    /// Id prefix.
    pub prefix: Option<String>,
    /// A duration back (`1h`) or an RFC3339 time.
    pub since: Option<String>,
}

/// The checked filters.
struct Filter {
    status: Vec<Status>,
    label: Option<String>,
    prefix: Option<String>,
    since: Option<DateTime<Utc>>,
}

impl Filter {
    fn from_query(q: &ResultsQuery) -> anyhow::Result<Filter> {
        fn nonempty(s: &Option<String>) -> Option<&str> {
            s.as_deref().map(str::trim).filter(|s| !s.is_empty())
        }
        let status = match nonempty(&q.status) {
            Some(s) => s
                .split(',')
                .map(|w| w.trim().parse::<Status>().map_err(anyhow::Error::msg))
                .collect::<anyhow::Result<_>>()?,
            None => Vec::new(),
        };
        let since = match nonempty(&q.since) {
            Some(s) => Some(parse_since(s).map_err(|e| anyhow::anyhow!("since: {e}"))?),
            None => None,
        };
        Ok(Filter {
            status,
            label: nonempty(&q.label).map(String::from),
            prefix: nonempty(&q.prefix).map(String::from),
            since,
        })
    }

    fn keep(&self, r: &TaskResult) -> bool {
        (self.status.is_empty() || self.status.contains(&r.status))
            && self.label.as_ref().is_none_or(|l| &r.label == l)
            && self.prefix.as_ref().is_none_or(|p| r.id.starts_with(p))
    }
}

/// One page of results.
#[derive(Debug, Serialize)]
pub(crate) struct ResultsPage {
    pub rows: Vec<ResultRow>,
    /// Pass as `before` for the next page (`None`: nothing older to read).
    pub next_before: Option<u64>,
    /// Records read for this page.
    pub scanned: u64,
    /// The time of the oldest record read (how far back this page went).
    pub reached: Option<DateTime<Utc>>,
}

/// Read records `lo..=hi` of the result stream, each as `(seq, time,
/// result)` (records that are not results are left out).
async fn window(
    conn: &Conn,
    stream: &async_nats::jetstream::stream::Stream,
    lo: u64,
    hi: u64,
) -> anyhow::Result<Vec<(u64, DateTime<Utc>, TaskResult)>> {
    let mut reader = OrderedReader::open(
        stream,
        vec![format!("{}.>", conn.names.results_prefix)],
        DeliverPolicy::ByStartSequence { start_sequence: lo },
    )
    .await?;
    let mut out = Vec::new();
    if reader.empty_at_start {
        return Ok(out);
    }
    // A quiet stream ends the read too (deleted records can leave the
    // pending count above zero).
    while let Ok(m) = tokio::time::timeout(Duration::from_secs(2), reader.next()).await {
        let Some(m) = m? else { break };
        if m.sequence > hi {
            break;
        }
        let last = m.sequence == hi || m.pending == 0;
        if let Ok(r) = parse_result(&m.payload) {
            out.push((m.sequence, m.time, r));
        }
        if last {
            break;
        }
    }
    Ok(out)
}

/// A page of results, newest first (see the module doc).
pub(crate) async fn results_page(conn: &Conn, q: &ResultsQuery) -> anyhow::Result<ResultsPage> {
    let filter = Filter::from_query(q)?;
    let limit = q.limit.unwrap_or(50).clamp(1, MAX_LIMIT);
    let mut stream = conn.stream(&conn.names.results_stream).await?;
    let state = stream
        .info()
        .await
        .context("cannot read the result stream")?
        .state
        .clone();
    let first = state.first_sequence.max(1);
    let mut hi = match q.before {
        Some(b) => b.saturating_sub(1).min(state.last_sequence),
        None => state.last_sequence,
    };
    let mut page = ResultsPage {
        rows: Vec::new(),
        next_before: None,
        scanned: 0,
        reached: None,
    };
    let mut seen: HashSet<String> = HashSet::new();
    let mut size = FIRST_WINDOW;
    let mut done = state.messages == 0 || hi < first;
    'scan: while !done && page.rows.len() < limit && page.scanned < MAX_SCAN {
        let lo = hi.saturating_sub(size - 1).max(first);
        let records = window(conn, &stream, lo, hi).await?;
        page.scanned += hi - lo + 1;
        for (seq, time, r) in records.into_iter().rev() {
            page.reached = Some(time);
            if filter.since.is_some_and(|s| time < s) {
                done = true;
                break 'scan;
            }
            if !seen.insert(r.id.clone()) {
                continue;
            }
            if !filter.keep(&r) {
                continue;
            }
            if q.before.is_some() && !is_latest(conn, &stream, &r.id, seq).await? {
                continue;
            }
            page.rows.push(ResultRow::new(seq, time, &r));
            if page.rows.len() == limit {
                // Go on from just below this row next time.
                page.next_before = Some(seq);
                break 'scan;
            }
        }
        if lo <= first {
            done = true;
        } else {
            hi = lo - 1;
            size = (size * 2).min(MAX_WINDOW);
        }
    }
    if !done && page.next_before.is_none() {
        page.next_before = Some(hi + 1);
    }
    Ok(page)
}

/// Whether record `seq` is the last one of task `id`.
async fn is_latest(
    conn: &Conn,
    stream: &async_nats::jetstream::stream::Stream,
    id: &str,
    seq: u64,
) -> anyhow::Result<bool> {
    match stream
        .direct_get_last_for_subject(conn.names.result_subject(id))
        .await
    {
        Ok(m) => Ok(m.sequence <= seq),
        Err(e) => Err(anyhow::anyhow!(e).context(format!("cannot read the last record of {id}"))),
    }
}

/// One task: every record (attempts and states), oldest first, and its
/// newest dead letter if it has one.
#[derive(Debug, Serialize)]
pub(crate) struct TaskView {
    pub id: String,
    pub records: Vec<TaskResult>,
    pub dead: Option<DeadLetter>,
}

pub(crate) async fn task(conn: &Conn, id: &str) -> anyhow::Result<TaskView> {
    let records = match conn.stream(&conn.names.results_stream).await {
        Ok(s) => conn.all_results(&s, id).await?,
        Err(_) => Vec::new(),
    };
    let dead = dead_letters(conn, Some(id), None, 1).await?.pop();
    Ok(TaskView {
        id: id.to_string(),
        records,
        dead,
    })
}

/// Dead letters, newest first, at most `limit`, of one id or label.
/// The original task's secrets are masked ([`mask_task`]).
pub(crate) async fn dead_letters(
    conn: &Conn,
    id: Option<&str>,
    label: Option<&str>,
    limit: usize,
) -> anyhow::Result<Vec<DeadLetter>> {
    let p = &conn.names.dead_prefix;
    let filter = format!("{p}.{}.{}", label.unwrap_or("*"), id.unwrap_or(">"));
    if conn.js.get_stream(&conn.names.dead_stream).await.is_err() {
        return Ok(Vec::new());
    }
    let all = crate::commands::dead::read(conn, filter, limit).await?;
    Ok(all
        .into_iter()
        .rev()
        .take(limit)
        .map(|d| DeadLetter {
            task: mask_task(&d.task),
            ..d
        })
        .collect())
}

/// A schedule as the page shows it.
#[derive(Debug, Serialize)]
pub(crate) struct ScheduleView {
    #[serde(flatten)]
    pub info: crate::commands::schedule::ScheduleInfo,
}

/// Every schedule, its task's secrets masked.
pub(crate) async fn schedules(conn: &Conn) -> anyhow::Result<Vec<ScheduleView>> {
    if conn.js.get_stream(&conn.names.tasks_stream).await.is_err() {
        return Ok(Vec::new());
    }
    let all = crate::commands::schedule::list(conn).await?;
    Ok(all
        .into_iter()
        .map(|mut info| {
            info.task = mask_task(&info.task);
            ScheduleView { info }
        })
        .collect())
}

/// The task JSON with the values of `env` and `headers` masked (they are
/// where credentials go). Text that is not a JSON object is shown as it
/// is: it was dead-lettered for not being a task.
pub(crate) fn mask_task(text: &str) -> String {
    let Ok(serde_json::Value::Object(mut m)) = serde_json::from_str::<serde_json::Value>(text)
    else {
        return text.to_string();
    };
    for key in ["env", "headers"] {
        if let Some(serde_json::Value::Object(vars)) = m.get_mut(key) {
            for v in vars.values_mut() {
                *v = serde_json::Value::String("•••".into());
            }
        }
    }
    serde_json::to_string(&m).unwrap_or_else(|_| text.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secrets_in_task_json_are_masked() {
        let t = r#"{"type":"shell","script":"echo","env":{"API_KEY":"s3cret"},"headers":{"Authorization":"Bearer x"}}"#;
        let m = mask_task(t);
        assert!(!m.contains("s3cret") && !m.contains("Bearer x"), "{m}");
        assert!(m.contains("API_KEY") && m.contains("Authorization"), "{m}");
        assert_eq!(mask_task("not json <b>"), "not json <b>");
    }

    #[test]
    fn filters_parse() {
        let q = ResultsQuery {
            status: Some("failed, success".into()),
            label: Some(" ".into()),
            since: Some("1h".into()),
            ..Default::default()
        };
        let f = Filter::from_query(&q).unwrap();
        assert_eq!(f.status, vec![Status::Failed, Status::Success]);
        assert!(f.label.is_none());
        assert!(f.since.is_some());
        let q = ResultsQuery {
            status: Some("nope".into()),
            ..Default::default()
        };
        assert!(Filter::from_query(&q).is_err());
    }
}
