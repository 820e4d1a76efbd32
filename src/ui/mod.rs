//! `jetworker ui`: a live web dashboard served from the same binary, over
//! the same connection settings and contexts as every other subcommand.
//!
//! # Layout
//!
//! - this file: the command line, the bind/auth policy (a non-loopback
//!   address needs a token or an explicit `--insecure-no-auth`), start-up.
//! - [`auth`]: the token (bearer header, or a cookie from the login form or
//!   a `?token=` exchange), the CSRF token on actions, the Host check
//!   against DNS rebinding, security headers.
//! - [`hub`]: the live state the browser sees, fed by the KV `workers`
//!   watch, the results stream and queue polling; it coalesces changes into
//!   server-sent events (`/api/events`) keyed by id, so the page updates
//!   the rows that changed and nothing else.
//! - [`history`]: what is read on request, never held: results paged
//!   backwards from the RESULTS stream, one task's attempts, dead letters,
//!   schedules.
//! - [`live`]: one task's live output (`logs.<id>`) as server-sent events,
//!   until its final result.
//! - [`actions`]: cancel, replay, pause/resume, submit (POST only, with
//!   `--allow-actions`).
//! - [`routes`]: the router and the embedded assets (`assets/`: plain
//!   HTML, JavaScript and CSS, no build step).
//!
//! Exit codes: 0 after SIGINT/SIGTERM, 2 for a refused configuration (a
//! non-loopback bind without auth, an unreadable token file) or a
//! connection error at start.

mod actions;
mod auth;
mod history;
mod hub;
mod live;
mod queues;
mod routes;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{bail, Context as _};
use clap::Args;

use crate::commands::common::Conn;
use crate::commands::{Ctx, Exit};

/// Default listen address: loopback only.
pub const DEFAULT_LISTEN: &str = "127.0.0.1:8222";

#[derive(Debug, Clone, Args)]
#[command(after_help = "\
Examples:
  jetworker ui                                       # http://127.0.0.1:8222/, read-only
  jetworker ui --allow-actions                       # with cancel, replay, pause, submit
  JETWORKER_UI_TOKEN=$(openssl rand -hex 16) jetworker ui --listen 0.0.0.0:8222

On another address than loopback the page needs a token: send it as
`Authorization: Bearer <token>`, or open http://HOST:PORT/?token=<token> once
(it becomes a cookie), or log in at /login. (`--token` is the NATS token.)")]
pub struct UiArgs {
    /// Address to serve on (port 0: any free port, printed at start).
    #[arg(long, default_value = DEFAULT_LISTEN, value_name = "ADDR")]
    pub listen: SocketAddr,
    /// Token the page asks for (bearer header, cookie or /login); required
    /// on any address but loopback.
    #[arg(
        long,
        env = "JETWORKER_UI_TOKEN",
        hide_env_values = true,
        value_name = "TOKEN"
    )]
    pub ui_token: Option<String>,
    /// File holding the UI token (first line).
    #[arg(
        long,
        env = "JETWORKER_UI_TOKEN_FILE",
        value_name = "FILE",
        conflicts_with = "ui_token"
    )]
    pub ui_token_file: Option<PathBuf>,
    /// Offer actions: cancel, replay/retry, pause/resume, submit.
    #[arg(long)]
    pub allow_actions: bool,
    /// Serve a non-loopback address without a token (anyone who reaches
    /// the port sees everything, and acts with --allow-actions).
    #[arg(long, conflicts_with_all = ["ui_token", "ui_token_file"])]
    pub insecure_no_auth: bool,
}

/// The token from `--ui-token` or `--ui-token-file`.
fn token(args: &UiArgs) -> anyhow::Result<Option<String>> {
    let t = match (&args.ui_token, &args.ui_token_file) {
        (Some(t), _) => t.trim().to_string(),
        (None, Some(f)) => std::fs::read_to_string(f)
            .with_context(|| format!("--ui-token-file: cannot read {}", f.display()))?
            .lines()
            .next()
            .unwrap_or("")
            .trim()
            .to_string(),
        (None, None) => return Ok(None),
    };
    if t.is_empty() {
        bail!("--ui-token: the token is empty");
    }
    if t.len() < 12 {
        tracing::warn!(
            "the UI token is short ({} characters); use 16 or more",
            t.len()
        );
    }
    Ok(Some(t))
}

/// The bind policy: loopback is open by default; any other address needs
/// a token or `--insecure-no-auth`.
fn check_bind(listen: SocketAddr, token: bool, insecure: bool) -> anyhow::Result<()> {
    if listen.ip().is_loopback() || token || insecure {
        return Ok(());
    }
    bail!(
        "--listen {listen} is not a loopback address: anyone who reaches it would see every task; \
         give a token (--ui-token, JETWORKER_UI_TOKEN or --ui-token-file) or, knowingly, --insecure-no-auth"
    )
}

pub async fn run(ctx: &Ctx, args: UiArgs) -> anyhow::Result<Exit> {
    let token = token(&args)?;
    check_bind(args.listen, token.is_some(), args.insecure_no_auth)?;
    // The token's value is blanked in /proc/<pid>/cmdline, the process made
    // non-dumpable, as for the worker.
    crate::process::protect_secrets();
    let conn = Conn::open(ctx).await?;
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("--listen: cannot bind {}", args.listen))?;
    let addr = listener.local_addr()?;
    let security = auth::Security::new(token, args.allow_actions, addr, args.insecure_no_auth);
    let hub = hub::Hub::start(conn.clone());
    let app = Arc::new(routes::App::new(conn, hub, security, &ctx.type_defs));
    let stop = app.shutdown.clone();
    crate::commands::output::ready(&format!("ui on http://{addr}/"))?;
    axum::serve(listener, routes::router(app))
        .with_graceful_shutdown(async move {
            shutdown().await;
            stop.cancel();
        })
        .await
        .context("the UI server stopped")?;
    Ok(Exit::Ok)
}

/// SIGINT or SIGTERM.
async fn shutdown() {
    use tokio::signal::unix::{signal, SignalKind};
    let Ok(mut term) = signal(SignalKind::terminate()) else {
        let _ = tokio::signal::ctrl_c().await;
        return;
    };
    tokio::select! {
        _ = term.recv() => {}
        _ = tokio::signal::ctrl_c() => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn non_loopback_needs_a_token_or_the_insecure_flag() {
        let lo: SocketAddr = "127.0.0.1:8222".parse().unwrap();
        let lo6: SocketAddr = "[::1]:8222".parse().unwrap();
        let any: SocketAddr = "0.0.0.0:8222".parse().unwrap();
        assert!(check_bind(lo, false, false).is_ok());
        assert!(check_bind(lo6, false, false).is_ok());
        let e = check_bind(any, false, false).unwrap_err().to_string();
        assert!(
            e.contains("--ui-token") && e.contains("--insecure-no-auth"),
            "{e}"
        );
        assert!(check_bind(any, true, false).is_ok());
        assert!(check_bind(any, false, true).is_ok());
    }
}
