//! The router: the page, its embedded assets, the read API, the event
//! feeds and the actions (DESIGN.md, "The dashboard").
//!
//! | path | what |
//! |---|---|
//! | `GET /` | the page (the CSRF token and whether actions are on in `<meta>`) |
//! | `GET /assets/app.js`, `/assets/app.css` | embedded, public |
//! | `GET, POST /login` | the token form (only with a token) |
//! | `GET /api/events` | SSE: `snapshot`, then `workers`, `results`, `queues`, `stats` |
//! | `GET /api/results?before&limit&status&label&prefix&since` | a page of results, newest first |
//! | `GET /api/tasks/{id}` | every record of a task, its dead letter |
//! | `GET /api/tasks/{id}/live` | SSE: its live output until the final result |
//! | `GET /api/dead?label&limit` | dead letters, newest first |
//! | `GET /api/schedules` | schedules with their next fire time |
//! | `GET /api/schema` | the task's JSON Schema |
//! | `POST /api/actions/{cancel,replay,pause,resume,submit}` | with `--allow-actions` |

use std::convert::Infallible;
use std::sync::Arc;

use axum::extract::{Path, Query, State};
use axum::http::{header, StatusCode};
use axum::middleware;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures::{Stream, StreamExt};
use serde::{Deserialize, Serialize};
use tokio::sync::broadcast::error::RecvError;
use tokio_util::sync::CancellationToken;

use super::auth::{self, Security};
use super::history::{self, ResultsQuery};
use super::hub::{Frame, Hub};
use crate::commands::common::Conn;
use crate::protocol::valid_id;

const INDEX_HTML: &str = include_str!("assets/index.html");
const APP_JS: &str = include_str!("assets/app.js");
const APP_CSS: &str = include_str!("assets/app.css");

/// Everything a handler needs.
pub(crate) struct App {
    pub conn: Conn,
    pub hub: Arc<Hub>,
    pub security: Security,
    /// The page, with this process's CSRF token in it.
    pub index: String,
    /// Ends the event streams at shutdown (they would hold it up).
    pub shutdown: CancellationToken,
    /// The task schema: the built-in types and the config file's.
    pub schema: serde_json::Value,
}

impl App {
    /// The app; `/api/schema` covers the built-in types and `defined`.
    pub(crate) fn new(
        conn: Conn,
        hub: Arc<Hub>,
        security: Security,
        defined: &[crate::runner::defined::TypeDef],
    ) -> App {
        let index = INDEX_HTML
            .replace("{{CSRF}}", &security.csrf)
            .replace(
                "{{ACTIONS}}",
                if security.allow_actions { "on" } else { "off" },
            )
            .replace("{{VERSION}}", crate::VERSION);
        App {
            conn,
            hub,
            security,
            index,
            shutdown: CancellationToken::new(),
            schema: crate::commands::schema::task_schema(defined),
        }
    }
}

pub(crate) fn router(app: Arc<App>) -> Router {
    Router::new()
        .route("/", get(index))
        .route("/assets/app.js", get(js))
        .route("/assets/app.css", get(css))
        .route("/login", get(auth::login_form).post(auth::login))
        .route("/api/events", get(events))
        .route("/api/results", get(results))
        .route("/api/tasks/{id}", get(task))
        .route("/api/tasks/{id}/live", get(task_live))
        .route("/api/dead", get(dead))
        .route("/api/schedules", get(schedules))
        .route("/api/schema", get(schema))
        .route("/api/actions/cancel", post(super::actions::cancel))
        .route("/api/actions/replay", post(super::actions::replay))
        .route("/api/actions/pause", post(super::actions::pause))
        .route("/api/actions/resume", post(super::actions::resume))
        .route("/api/actions/submit", post(super::actions::submit))
        .layer(middleware::from_fn_with_state(app.clone(), auth::guard))
        .layer(middleware::from_fn(auth::headers))
        .with_state(app)
}

async fn index(State(app): State<Arc<App>>) -> Response {
    (
        [(header::CONTENT_TYPE, "text/html; charset=utf-8")],
        app.index.clone(),
    )
        .into_response()
}

async fn js() -> Response {
    (
        [(header::CONTENT_TYPE, "text/javascript; charset=utf-8")],
        APP_JS,
    )
        .into_response()
}

async fn css() -> Response {
    ([(header::CONTENT_TYPE, "text/css; charset=utf-8")], APP_CSS).into_response()
}

/// A read's answer: its JSON, or 400 with the error in words.
fn api<T: Serialize>(r: anyhow::Result<T>) -> Response {
    match r {
        Ok(v) => Json(v).into_response(),
        Err(e) => (
            StatusCode::BAD_REQUEST,
            Json(serde_json::json!({ "ok": false, "message": format!("{e:#}") })),
        )
            .into_response(),
    }
}

fn bad_id(id: &str) -> Option<Response> {
    (!valid_id(id)).then(|| {
        (
            StatusCode::BAD_REQUEST,
            Json(serde_json::json!({
                "ok": false,
                "message": "not a task id ([A-Za-z0-9_-]{1,128})",
            })),
        )
            .into_response()
    })
}

fn to_event(f: &Frame) -> Result<Event, Infallible> {
    Ok(Event::default().event(f.0).data(f.1.as_str()))
}

/// `GET /api/events`: the snapshot, then the hub's events.
async fn events(State(app): State<Arc<App>>) -> Sse<impl Stream<Item = Result<Event, Infallible>>> {
    let (snap, rx) = app.hub.subscribe();
    let hub = app.hub.clone();
    let s = futures::stream::unfold((Some(snap), rx, hub), |(first, mut rx, hub)| async move {
        if let Some(f) = first {
            return Some((to_event(&f), (None, rx, hub)));
        }
        match rx.recv().await {
            Ok(f) => Some((to_event(&f), (None, rx, hub))),
            // Fell behind: start over from a fresh snapshot.
            Err(RecvError::Lagged(_)) => {
                let (snap, rx) = hub.subscribe();
                Some((to_event(&snap), (None, rx, hub)))
            }
            Err(RecvError::Closed) => None,
        }
    });
    Sse::new(s.take_until(app.shutdown.clone().cancelled_owned())).keep_alive(KeepAlive::default())
}

async fn results(State(app): State<Arc<App>>, Query(q): Query<ResultsQuery>) -> Response {
    api(history::results_page(&app.conn, &q).await)
}

async fn task(State(app): State<Arc<App>>, Path(id): Path<String>) -> Response {
    if let Some(r) = bad_id(&id) {
        return r;
    }
    api(history::task(&app.conn, &id).await)
}

async fn task_live(State(app): State<Arc<App>>, Path(id): Path<String>) -> Response {
    if let Some(r) = bad_id(&id) {
        return r;
    }
    let s = super::live::follow(app.conn.clone(), id);
    Sse::new(s.take_until(app.shutdown.clone().cancelled_owned()))
        .keep_alive(KeepAlive::default())
        .into_response()
}

#[derive(Deserialize)]
struct DeadQuery {
    label: Option<String>,
    limit: Option<usize>,
}

async fn dead(State(app): State<Arc<App>>, Query(q): Query<DeadQuery>) -> Response {
    let label = q.label.as_deref().filter(|l| !l.is_empty());
    if let Some(l) = label {
        if !crate::protocol::valid_label(l) {
            return api::<()>(Err(anyhow::anyhow!("`{l}` is not a label")));
        }
    }
    let limit = q.limit.unwrap_or(200).clamp(1, history::MAX_LIMIT);
    api(history::dead_letters(&app.conn, None, label, limit).await)
}

async fn schedules(State(app): State<Arc<App>>) -> Response {
    api(history::schedules(&app.conn).await)
}

async fn schema(State(app): State<Arc<App>>) -> Response {
    Json(app.schema.clone()).into_response()
}
