//! Who may see the dashboard and who may act through it.
//!
//! - **Token.** With a token (`--ui-token`), every page and API call needs
//!   it: `Authorization: Bearer <token>`, or the session cookie set by the
//!   login form (`POST /login`) or by opening any page with `?token=<token>`
//!   once (the answer redirects to the same page without the token in the
//!   address). The cookie holds a per-process random session value, never
//!   the token; it is `HttpOnly` and `SameSite=Strict`. Without a token
//!   (loopback, or `--insecure-no-auth`) the page is open.
//! - **Host check.** An open page on loopback answers only requests whose
//!   `Host` is the loopback address it serves (`127.0.0.1:<port>`,
//!   `localhost:<port>`, `[::1]:<port>`): a web site that rebinds its DNS
//!   name to 127.0.0.1 gets 403, not the page and its CSRF token.
//! - **CSRF.** Actions are POST only, with JSON bodies (so a cross-site
//!   form cannot send one) and the header `X-Jetworker-Csrf` carrying a
//!   per-process random token that the page embeds; a request with an
//!   `Origin` other than its own host is refused.
//! - **Headers.** A strict Content-Security-Policy (scripts and styles only
//!   from this server, nothing inline), `nosniff`, no framing, no referrer,
//!   no caching.

use std::net::SocketAddr;
use std::sync::Arc;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, HeaderValue, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Redirect, Response};
use axum::Form;
use rand::distr::{Alphanumeric, SampleString};
use serde::Deserialize;

use super::routes::App;

/// The header an action must carry, with [`Security::csrf`] as its value.
pub(crate) const CSRF_HEADER: &str = "x-jetworker-csrf";

/// The login page (static text; the message slot takes fixed strings).
const LOGIN_HTML: &str = include_str!("assets/login.html");

/// Auth settings of one `jetworker ui` process.
pub(crate) struct Security {
    /// The token, when the page needs one.
    token: Option<String>,
    /// The cookie value that proves a login (random, per process).
    session: String,
    /// Name of the session cookie: per port, since cookies are not.
    cookie: String,
    /// The CSRF token the page embeds and actions send back.
    pub csrf: String,
    /// Whether actions are offered at all (`--allow-actions`).
    pub allow_actions: bool,
    /// `Host` values accepted (None: any; the token protects the page).
    hosts: Option<Vec<String>>,
}

fn random_token() -> String {
    Alphanumeric.sample_string(&mut rand::rng(), 32)
}

/// Equality that takes as long for any two values of one length.
fn same(a: &str, b: &str) -> bool {
    a.len() == b.len() && a.bytes().zip(b.bytes()).fold(0u8, |d, (x, y)| d | (x ^ y)) == 0
}

impl Security {
    pub(crate) fn new(
        token: Option<String>,
        allow_actions: bool,
        addr: SocketAddr,
        insecure_no_auth: bool,
    ) -> Security {
        let port = addr.port();
        let hosts = (token.is_none() && !insecure_no_auth && addr.ip().is_loopback()).then(|| {
            let mut h = vec![
                format!("127.0.0.1:{port}"),
                format!("localhost:{port}"),
                format!("[::1]:{port}"),
                addr.to_string(),
            ];
            h.dedup();
            h
        });
        Security {
            token,
            session: random_token(),
            cookie: format!("jetworker_ui_{port}"),
            csrf: random_token(),
            allow_actions,
            hosts,
        }
    }

    /// Whether the request carries the token or the session cookie.
    fn authorised(&self, headers: &HeaderMap) -> bool {
        let Some(token) = &self.token else {
            return true;
        };
        let bearer = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "));
        if bearer.is_some_and(|b| same(b.trim(), token)) {
            return true;
        }
        headers
            .get_all(header::COOKIE)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(';'))
            .filter_map(|c| c.trim().split_once('='))
            .any(|(k, v)| k == self.cookie && same(v, &self.session))
    }

    fn host_ok(&self, headers: &HeaderMap) -> bool {
        let Some(hosts) = &self.hosts else {
            return true;
        };
        headers
            .get(header::HOST)
            .and_then(|h| h.to_str().ok())
            .is_some_and(|h| hosts.iter().any(|a| a.eq_ignore_ascii_case(h)))
    }

    fn set_cookie(&self) -> HeaderValue {
        HeaderValue::from_str(&format!(
            "{}={}; Path=/; HttpOnly; SameSite=Strict",
            self.cookie, self.session
        ))
        .expect("cookie is ASCII")
    }

    /// Whether an action may go ahead: actions on, JSON, the CSRF header,
    /// no foreign `Origin`. The error is the response to send.
    pub(crate) fn check_action(&self, headers: &HeaderMap) -> Result<(), Refused> {
        if !self.allow_actions {
            return Err(Refused(
                StatusCode::FORBIDDEN,
                "actions are off: start `jetworker ui` with --allow-actions",
            ));
        }
        let json = headers
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.starts_with("application/json"));
        if !json {
            return Err(Refused(
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                "actions take application/json",
            ));
        }
        let csrf = headers.get(CSRF_HEADER).and_then(|v| v.to_str().ok());
        if !csrf.is_some_and(|c| same(c, &self.csrf)) {
            return Err(Refused(
                StatusCode::FORBIDDEN,
                "missing or wrong CSRF token (reload the page)",
            ));
        }
        if let Some(origin) = headers.get(header::ORIGIN).and_then(|v| v.to_str().ok()) {
            let host = headers
                .get(header::HOST)
                .and_then(|h| h.to_str().ok())
                .unwrap_or("");
            let own = origin
                .strip_prefix("http://")
                .or_else(|| origin.strip_prefix("https://"))
                .is_some_and(|o| o.eq_ignore_ascii_case(host));
            if !own {
                return Err(Refused(
                    StatusCode::FORBIDDEN,
                    "cross-origin action refused",
                ));
            }
        }
        Ok(())
    }
}

/// Why a request is refused, and with which status.
#[derive(Debug)]
pub(crate) struct Refused(pub StatusCode, pub &'static str);

impl IntoResponse for Refused {
    fn into_response(self) -> Response {
        refuse(self.0, self.1)
    }
}

/// A plain-text refusal.
pub(crate) fn refuse(status: StatusCode, why: &str) -> Response {
    (status, format!("{}: {why}\n", status.as_u16())).into_response()
}

/// The login page with one of our fixed messages.
fn login_page(status: StatusCode, message: &str) -> Response {
    let html = LOGIN_HTML.replace("{{MESSAGE}}", message);
    (
        status,
        [(header::CONTENT_TYPE, "text/html; charset=utf-8")],
        html,
    )
        .into_response()
}

/// Paths anyone may fetch: the login form and the static assets (code,
/// no data).
fn public(path: &str) -> bool {
    path == "/login" || path.starts_with("/assets/")
}

/// The `token` query parameter, if any.
fn query_token(q: Option<&str>) -> Option<String> {
    q?.split('&').find_map(|kv| {
        let (k, v) = kv.split_once('=')?;
        (k == "token").then(|| percent_decode(v))
    })
}

/// `%XX` and `+` decoding of a query value.
fn percent_decode(v: &str) -> String {
    let hex = |c: u8| (c as char).to_digit(16).map(|d| d as u8);
    let b = v.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'+' => out.push(b' '),
            b'%' if i + 2 < b.len() => match (hex(b[i + 1]), hex(b[i + 2])) {
                (Some(h), Some(l)) => {
                    out.push(h << 4 | l);
                    i += 2;
                }
                _ => out.push(b'%'),
            },
            c => out.push(c),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The auth middleware: Host check, then the token (or the `?token=`
/// exchange), for every path but the public ones.
pub(crate) async fn guard(State(app): State<Arc<App>>, req: Request, next: Next) -> Response {
    let sec = &app.security;
    if !sec.host_ok(req.headers()) {
        return refuse(
            StatusCode::FORBIDDEN,
            "unexpected Host header (open the page by its loopback address)",
        );
    }
    let path = req.uri().path().to_string();
    if public(&path) || sec.authorised(req.headers()) {
        return next.run(req).await;
    }
    if req.method() == Method::GET {
        if let Some(t) = query_token(req.uri().query()) {
            if sec.token.as_deref().is_some_and(|tok| same(&t, tok)) {
                // Back to the same page, never to another site (`//host`).
                let to = if path.starts_with("//") { "/" } else { &path };
                let mut r = Redirect::to(to).into_response();
                r.headers_mut().insert(header::SET_COOKIE, sec.set_cookie());
                return r;
            }
            return login_page(StatusCode::UNAUTHORIZED, "That token is not right.");
        }
    }
    if path.starts_with("/api/") {
        let mut r = refuse(
            StatusCode::UNAUTHORIZED,
            "token required (Authorization: Bearer <token>, or log in at /login)",
        );
        r.headers_mut()
            .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        return r;
    }
    login_page(StatusCode::UNAUTHORIZED, "This dashboard needs its token.")
}

/// `GET /login`.
pub(crate) async fn login_form(State(app): State<Arc<App>>) -> Response {
    if app.security.token.is_none() {
        return Redirect::to("/").into_response();
    }
    login_page(StatusCode::OK, "This dashboard needs its token.")
}

#[derive(Deserialize)]
pub(crate) struct LoginForm {
    token: String,
}

/// `POST /login`: the form's token becomes the session cookie.
pub(crate) async fn login(State(app): State<Arc<App>>, Form(f): Form<LoginForm>) -> Response {
    let sec = &app.security;
    match &sec.token {
        Some(t) if same(f.token.trim(), t) => {
            let mut r = Redirect::to("/").into_response();
            r.headers_mut().insert(header::SET_COOKIE, sec.set_cookie());
            r
        }
        Some(_) => login_page(StatusCode::UNAUTHORIZED, "That token is not right."),
        None => Redirect::to("/").into_response(),
    }
}

/// Security headers on every response.
pub(crate) async fn headers(req: Request<Body>, next: Next) -> Response {
    let mut r = next.run(req).await;
    let h = r.headers_mut();
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(
            "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; \
             connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
        ),
    );
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    h.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    h.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("no-referrer"),
    );
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hm(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.append(
                axum::http::HeaderName::from_bytes(k.as_bytes()).unwrap(),
                HeaderValue::from_str(v).unwrap(),
            );
        }
        h
    }

    #[test]
    fn token_by_bearer_or_cookie() {
        let s = Security::new(
            Some("s3cret-token".into()),
            true,
            "0.0.0.0:8222".parse().unwrap(),
            false,
        );
        assert!(!s.authorised(&hm(&[])));
        assert!(s.authorised(&hm(&[("authorization", "Bearer s3cret-token")])));
        assert!(!s.authorised(&hm(&[("authorization", "Bearer s3cret-tokem")])));
        let c = format!("a=b; jetworker_ui_8222={}", s.session);
        assert!(s.authorised(&hm(&[("cookie", &c)])));
        assert!(!s.authorised(&hm(&[("cookie", "jetworker_ui_8222=s3cret-token")])));
        // Any Host: the token protects the page.
        assert!(s.host_ok(&hm(&[("host", "example.com")])));
    }

    #[test]
    fn open_loopback_answers_its_own_host_only() {
        let s = Security::new(None, false, "127.0.0.1:8222".parse().unwrap(), false);
        assert!(s.authorised(&hm(&[])));
        assert!(s.host_ok(&hm(&[("host", "127.0.0.1:8222")])));
        assert!(s.host_ok(&hm(&[("host", "localhost:8222")])));
        assert!(!s.host_ok(&hm(&[("host", "evil.example:8222")])));
        assert!(!s.host_ok(&hm(&[])));
    }

    #[test]
    fn actions_need_the_flag_json_and_csrf() {
        let s = Security::new(None, false, "127.0.0.1:1".parse().unwrap(), false);
        let ok = [
            ("content-type", "application/json"),
            (CSRF_HEADER, s.csrf.as_str()),
            ("host", "127.0.0.1:1"),
        ];
        assert_eq!(
            s.check_action(&hm(&ok)).unwrap_err().0,
            StatusCode::FORBIDDEN
        );
        let mut s = s;
        s.allow_actions = true;
        let ok = [
            ("content-type", "application/json"),
            (CSRF_HEADER, s.csrf.as_str()),
            ("host", "127.0.0.1:1"),
        ];
        assert!(s.check_action(&hm(&ok)).is_ok());
        assert!(s.check_action(&hm(&ok[1..])).is_err(), "form posts refused");
        assert!(s.check_action(&hm(&[ok[0], ok[2]])).is_err(), "no csrf");
        let mut cross = ok.to_vec();
        cross.push(("origin", "http://evil.example"));
        assert!(s.check_action(&hm(&cross)).is_err());
        let mut same_origin = ok.to_vec();
        same_origin.push(("origin", "http://127.0.0.1:1"));
        assert!(s.check_action(&hm(&same_origin)).is_ok());
    }

    #[test]
    fn query_tokens_are_decoded() {
        assert_eq!(
            query_token(Some("a=1&token=x%2By+z")).as_deref(),
            Some("x+y z")
        );
        assert_eq!(query_token(Some("a=1")), None);
        assert_eq!(query_token(Some("token=%zz%4")).as_deref(), Some("%zz%4"));
    }
}
