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
use axum::extract::{FromRequest, Request, State};
use axum::http::StatusCode;
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

/// The answer to an action that went through (`ok: true` and its fields),
/// or 400 with the error in words.
fn done(r: anyhow::Result<serde_json::Value>) -> Response {
    match r {
        Ok(mut v) => {
            v["ok"] = json!(true);
            answer(StatusCode::OK, v)
        }
        Err(e) => failed(StatusCode::BAD_REQUEST, format!("{e:#}")),
    }
}

/// An action's JSON body, taken only once the request passed
/// [`super::auth::Security::check_action`] (before the body is read).
pub(crate) struct Action<T>(T);

impl<T: DeserializeOwned> FromRequest<Arc<App>> for Action<T> {
    type Rejection = Response;

    async fn from_request(req: Request, app: &Arc<App>) -> Result<Self, Response> {
        app.security
            .check_action(req.headers())
            .map_err(IntoResponse::into_response)?;
        let body = Bytes::from_request(req, app)
            .await
            .map_err(IntoResponse::into_response)?;
        serde_json::from_slice(&body)
            .map(Action)
            .map_err(|e| failed(StatusCode::BAD_REQUEST, format!("bad request body: {e}")))
    }
}

#[derive(Deserialize)]
pub(crate) struct CancelBody {
    id: String,
    reason: Option<String>,
}

pub(crate) async fn cancel(State(app): State<Arc<App>>, Action(b): Action<CancelBody>) -> Response {
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
pub(crate) struct IdBody {
    id: String,
}

pub(crate) async fn replay(State(app): State<Arc<App>>, Action(b): Action<IdBody>) -> Response {
    let r = crate::commands::retry::retry(&app.conn, &b.id).await;
    done(r.map(|r| {
        json!({
            "new_id": r.new_id,
            "subject": r.subject,
            "duplicate": r.duplicate,
            "message": if r.duplicate {
                format!("{} was already replayed as {} (still queued)", b.id, r.new_id)
            } else {
                format!("replayed {} as {}", b.id, r.new_id)
            },
        })
    }))
}

#[derive(Deserialize)]
pub(crate) struct LabelBody {
    label: String,
}

pub(crate) async fn pause(State(app): State<Arc<App>>, Action(b): Action<LabelBody>) -> Response {
    pause_or_resume(&app, b, true).await
}

pub(crate) async fn resume(State(app): State<Arc<App>>, Action(b): Action<LabelBody>) -> Response {
    pause_or_resume(&app, b, false).await
}

async fn pause_or_resume(app: &App, b: LabelBody, pause: bool) -> Response {
    let (js, names) = (&app.conn.js, &app.conn.names);
    let r = if pause {
        crate::queues::pause(js, names, &b.label, None).await
    } else {
        crate::queues::resume(js, names, &b.label).await
    };
    done(r.map(|s| {
        json!({
            "message": format!("{} {}", b.label, if s.paused { "paused" } else { "resumed" }),
            "state": s,
        })
    }))
}

#[derive(Deserialize)]
pub(crate) struct SubmitBody {
    label: String,
    task: serde_json::Value,
}

pub(crate) async fn submit(State(app): State<Arc<App>>, Action(b): Action<SubmitBody>) -> Response {
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
    let bytes = match validate_locally(&b.label, &msg, Origin::Direct { msg_id: &id }, &[]) {
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
