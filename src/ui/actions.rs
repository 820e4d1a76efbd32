//! The dashboard's actions, offered only with `--allow-actions`: POST,
//! JSON bodies, the CSRF header ([`super::auth::Security::check_action`],
//! checked before the body is even read). Each calls the code the CLI
//! runs for the same thing:
//!
//! - `POST /api/actions/cancel` `{"id","reason"?}`: `jetworker cancel`'s
//!   request (a finished or unknown task is refused, nothing stored);
//! - `POST /api/actions/replay` `{"id"}`: `jetworker dead replay` (the
//!   newest dead letter of the id, as `<id>-r<n>`); it also retries a
//!   failed task whose copy is in DEAD;
//! - `POST /api/actions/pause` `{"label"}` and `/resume`: the queues'
//!   consumer pause (until resumed);
//! - `POST /api/actions/submit` `{"label","task":{…}}`: validated exactly
//!   as `jetworker submit` validates (the page checks it against the JSON
//!   Schema first), published under its id (a random one if it has none).
//!
//! Answers are JSON: `{"ok":true,"message",…}` or `{"ok":false,"message"}`
//! with a 4xx/5xx status.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::de::DeserializeOwned;
use serde::Deserialize;
use serde_json::json;

use super::routes::App;
use crate::commands::cancel::{self, Requested};
use crate::commands::submit::random_id;
use crate::commands::taskflags::{validate_locally, Origin};
use crate::protocol::valid_label;

fn answer(status: StatusCode, v: serde_json::Value) -> Response {
    (status, Json(v)).into_response()
}

fn failed(status: StatusCode, message: String) -> Response {
    answer(status, json!({ "ok": false, "message": message }))
}

/// Check the request, then parse its body; the error is the answer.
fn accept<T: DeserializeOwned>(
    app: &App,
    headers: &HeaderMap,
    body: &[u8],
) -> Result<T, Box<Response>> {
    app.security
        .check_action(headers)
        .map_err(|r| Box::new(r.into_response()))?;
    serde_json::from_slice(body).map_err(|e| {
        Box::new(failed(
            StatusCode::BAD_REQUEST,
            format!("bad request body: {e}"),
        ))
    })
}

#[derive(Deserialize)]
struct CancelBody {
    id: String,
    reason: Option<String>,
}

pub(crate) async fn cancel(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let b: CancelBody = match accept(&app, &headers, &body) {
        Ok(b) => b,
        Err(r) => return *r,
    };
    let reason = b
        .reason
        .as_deref()
        .filter(|r| !r.is_empty())
        .unwrap_or("cancelled from the dashboard");
    match cancel::request(&app.conn, &b.id, Some(reason), false).await {
        Ok(Requested::Finished(r)) => failed(
            StatusCode::CONFLICT,
            format!("{} already finished: {}; nothing to cancel", b.id, r.status),
        ),
        Ok(Requested::Unknown) => failed(
            StatusCode::NOT_FOUND,
            format!(
                "no task {} is known: no result, not running, not queued",
                b.id
            ),
        ),
        Ok(Requested::Stored { worker, .. }) => answer(
            StatusCode::OK,
            json!({
                "ok": true,
                "worker": worker,
                "message": match &worker {
                    Some(w) => format!("cancellation requested; the attempt on {w} stops"),
                    None => "cancellation requested; the task will not start".to_string(),
                },
            }),
        ),
        Err(e) => failed(StatusCode::BAD_REQUEST, format!("{e:#}")),
    }
}

#[derive(Deserialize)]
struct IdBody {
    id: String,
}

pub(crate) async fn replay(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let b: IdBody = match accept(&app, &headers, &body) {
        Ok(b) => b,
        Err(r) => return *r,
    };
    match crate::commands::dead::replay_task(&app.conn, &b.id).await {
        Ok(r) => answer(
            StatusCode::OK,
            json!({
                "ok": true,
                "new_id": r.new_id,
                "subject": r.subject,
                "duplicate": r.duplicate,
                "message": if r.duplicate {
                    format!("{} was already replayed as {} (still queued)", b.id, r.new_id)
                } else {
                    format!("replayed {} as {}", b.id, r.new_id)
                },
            }),
        ),
        Err(e) => failed(StatusCode::BAD_REQUEST, format!("{e:#}")),
    }
}

#[derive(Deserialize)]
struct LabelBody {
    label: String,
}

pub(crate) async fn pause(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    pause_or_resume(&app, &headers, &body, true).await
}

pub(crate) async fn resume(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    pause_or_resume(&app, &headers, &body, false).await
}

async fn pause_or_resume(app: &App, headers: &HeaderMap, body: &[u8], pause: bool) -> Response {
    let b: LabelBody = match accept(app, headers, body) {
        Ok(b) => b,
        Err(r) => return *r,
    };
    let (js, names) = (&app.conn.js, &app.conn.names);
    let r = if pause {
        crate::queues::pause(js, names, &b.label, None).await
    } else {
        crate::queues::resume(js, names, &b.label).await
    };
    match r {
        Ok(s) => answer(
            StatusCode::OK,
            json!({
                "ok": true,
                "message": format!("{} {}", b.label, if s.paused { "paused" } else { "resumed" }),
                "state": s,
            }),
        ),
        Err(e) => failed(StatusCode::BAD_REQUEST, format!("{e:#}")),
    }
}

#[derive(Deserialize)]
struct SubmitBody {
    label: String,
    task: serde_json::Value,
}

pub(crate) async fn submit(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let b: SubmitBody = match accept(&app, &headers, &body) {
        Ok(b) => b,
        Err(r) => return *r,
    };
    if !valid_label(&b.label) {
        return failed(
            StatusCode::BAD_REQUEST,
            format!("label `{}` is not [A-Za-z0-9_-]{{1,64}}", b.label),
        );
    }
    let text = b.task.to_string();
    let mut msg = match crate::protocol::parse_message(text.as_bytes()) {
        Ok(m) => m,
        Err(e) => return failed(StatusCode::BAD_REQUEST, e.to_string()),
    };
    let id = msg.id.clone().unwrap_or_else(random_id);
    msg.id = Some(id.clone());
    let bytes = match validate_locally(&b.label, &msg, Origin::Direct { msg_id: &id }) {
        Ok((bytes, _)) => bytes,
        Err(e) => return failed(StatusCode::BAD_REQUEST, format!("{e:#}")),
    };
    let subject = app.conn.names.task_subject(&b.label);
    match app.conn.publish(&subject, bytes, Some(&id), None).await {
        Ok(ack) => answer(
            StatusCode::OK,
            json!({
                "ok": true,
                "id": id,
                "subject": subject,
                "sequence": ack.sequence,
                "duplicate": ack.duplicate,
                "message": if ack.duplicate {
                    format!("{id} was already queued (duplicate within the window)")
                } else {
                    format!("submitted {id} to {subject}")
                },
            }),
        ),
        Err(e) => failed(StatusCode::BAD_GATEWAY, format!("{e:#}")),
    }
}
