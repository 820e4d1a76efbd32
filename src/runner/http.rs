//! The `http` runner (DESIGN.md 3.3): one request per attempt through a
//! client shared by the whole worker, so that connections to the same host
//! are reused across tasks.
//!
//! - The request carries the task's method, headers and body, plus
//!   `X-Idempotency-Key`, `X-Schedule-Instance-Id`, `X-Attempt` and, for a
//!   shard, `X-Shard-No`/`X-Shard-Total`, for a downstream task
//!   `X-Parent-Id` and for a join `X-Join-Summary` (these win over task
//!   headers of the same name: the receiver must be able to trust them).
//! - The response body is streamed into the output sink chunk by chunk, so a
//!   huge body costs no more memory than the output cap.
//! - The task timeout bounds the whole exchange, body included; the stop
//!   signal (cancel, shutdown, lease loss) aborts it at any point.
//! - A status outside the task's `success` range is `failed` ("HTTP 404 Not
//!   Found"); connection, TLS and redirect errors are `failed` with the whole
//!   cause chain, since the top-level reqwest message alone ("error sending
//!   request") says nothing useful.
//!
//! # SSRF guard
//!
//! With the worker setting `deny_private_http` (off by default) the runner
//! refuses destinations that are not public unicast addresses: loopback,
//! private (RFC 1918), link-local, unspecified, CGNAT (100.64/10), unique
//! local (fc00::/7), multicast, broadcast, documentation and other reserved
//! ranges, including IPv4 addresses embedded in IPv6 (mapped, NAT64, 6to4).
//! The check happens *after DNS resolution*, in a custom resolver, so a
//! public-looking name that resolves to 127.0.0.1 is refused too, and it
//! holds across redirects: every new connection goes through the resolver,
//! and the redirect policy checks IP-literal locations (which skip the
//! resolver). With the guard on, environment proxies (`HTTP_PROXY`, …) are
//! ignored, because a proxy would resolve the name itself, out of the
//! guard's sight; with it off (the default) they are honoured.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::Arc;

use reqwest::dns::{Addrs, Name, Resolve, Resolving};
use reqwest::header::{HeaderMap, HeaderName, HeaderValue};
use reqwest::redirect;
use tokio::time::{sleep_until, Instant};

use std::collections::BTreeMap;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::{fields_schema_of, timeout_reason, Fields, Outcome, RunContext, Runner};
use crate::output::{OutputSink, StreamKind};
use crate::protocol::{truncate_for_error, Invalid, Status, Task};

/// HTTP success range: `[200, 299]`, `"200-299"` or a single status.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(untagged)]
pub enum SuccessValue {
    /// One status.
    One(u16),
    /// Low and high, inclusive.
    Range([u16; 2]),
    /// `"200-299"` or `"204"`.
    Text(String),
}

/// The fields of an `http` task.
#[derive(Debug, Deserialize, JsonSchema)]
#[schemars(title = "http")]
struct HttpFields {
    /// http: the URL.
    url: Option<String>,
    /// Seed short form: shell → the script, http → the URL, container →
    /// docker-run options.
    payload: Option<String>,
    /// http: the method (GET).
    method: Option<String>,
    /// http: request headers.
    headers: Option<BTreeMap<String, String>>,
    /// http: request body.
    body: Option<String>,
    /// http: statuses that count as success (default 200–299).
    success: Option<SuccessValue>,
}

/// A validated http task.
#[derive(Debug, Clone, PartialEq)]
pub struct HttpSpec {
    /// The URL (http or https).
    pub url: String,
    /// The method, upper case.
    pub method: String,
    /// Request headers.
    pub headers: BTreeMap<String, String>,
    /// Request body.
    pub body: Option<String>,
    /// Inclusive range of statuses counted as success.
    pub success: (u16, u16),
}

/// Redirects followed before the request fails (DESIGN.md 3.3).
pub const MAX_REDIRECTS: usize = 5;

/// Runs `http` tasks with one shared client.
pub struct HttpRunner {
    /// Shared by all attempts: connection pool, TLS sessions, resolver
    /// (`None`: validation only).
    client: Option<reqwest::Client>,
    /// Whether the SSRF guard is on (worker setting `deny_private_http`).
    deny_private: bool,
}

impl HttpRunner {
    /// Build the worker's client. `deny_private` turns the SSRF guard on
    /// (see the module docs). Fails only if the TLS stack cannot be set up.
    pub fn new(deny_private: bool) -> anyhow::Result<Self> {
        // reqwest is built without a default crypto provider; ring is the
        // one this crate ships. Installing twice is harmless (the first
        // one stays), so every runner may try.
        let _ = rustls::crypto::ring::default_provider().install_default();
        let mut builder = reqwest::Client::builder()
            .user_agent(concat!("jetworker/", env!("CARGO_PKG_VERSION")))
            .tls_backend_rustls();
        builder = if deny_private {
            builder
                .dns_resolver(Arc::new(GuardedResolver))
                .no_proxy()
                .redirect(redirect::Policy::custom(|attempt| {
                    if attempt.previous().len() > MAX_REDIRECTS {
                        return attempt
                            .error(format!("too many redirects (more than {MAX_REDIRECTS})"));
                    }
                    if let Some(reason) = denied_literal(attempt.url()) {
                        return attempt.error(reason);
                    }
                    attempt.follow()
                }))
        } else {
            builder.redirect(redirect::Policy::limited(MAX_REDIRECTS))
        };
        let client = builder
            .build()
            .map_err(|e| anyhow::anyhow!("cannot build the HTTP client: {}", cause_chain(&e)))?;
        Ok(HttpRunner {
            client: Some(client),
            deny_private,
        })
    }

    /// Validation only (the CLI): running fails.
    pub(crate) fn validator() -> Self {
        HttpRunner {
            client: None,
            deny_private: false,
        }
    }
}

impl Runner for HttpRunner {
    type Spec = HttpSpec;

    fn name(&self) -> &str {
        "http"
    }

    fn fields_schema(&self) -> serde_json::Value {
        fields_schema_of::<HttpFields>()
    }

    fn validate(&self, fields: &Fields, _task: &Task) -> Result<HttpSpec, Invalid> {
        validate(fields.parse()?)
    }

    /// Run one attempt; every failure is an outcome.
    async fn run(&self, spec: &HttpSpec, ctx: RunContext) -> Outcome {
        let Some(client) = &self.client else {
            return Outcome::validation_only();
        };
        let request = match self.build_request(client, spec, &ctx) {
            Ok(r) => r,
            Err(reason) => return Outcome::failed(reason),
        };

        let deadline = Instant::now() + ctx.timeout;
        let mut sink = OutputSink::new(ctx.output_cap, ctx.live.clone(), ctx.attempt);
        let mut http_status: Option<u16> = None;
        let exchange = exchange(client, request, spec, &mut sink, &mut http_status);
        let (status, error) = tokio::select! {
            r = exchange => match r {
                Ok(()) => (Status::Success, None),
                Err(reason) => (Status::Failed, Some(reason)),
            },
            _ = sleep_until(deadline) => (Status::Timeout, Some(timeout_reason(ctx.timeout))),
            _ = ctx.stop.fired() => (Status::Cancelled, Some(ctx.stop.reason_text())),
        };
        Outcome {
            status,
            exit_code: None,
            signal: None,
            http_status,
            output: sink.finish().await,
            permanent: false,
            error,
        }
    }
}

impl HttpRunner {
    /// The request for one attempt, or why it cannot be sent.
    fn build_request(
        &self,
        client: &reqwest::Client,
        spec: &HttpSpec,
        ctx: &RunContext,
    ) -> Result<reqwest::Request, String> {
        let url = reqwest::Url::parse(&spec.url).map_err(|e| format!("invalid URL: {e}"))?;
        if self.deny_private {
            if let Some(reason) = denied_literal(&url) {
                return Err(reason);
            }
        }
        let method = reqwest::Method::from_bytes(spec.method.as_bytes())
            .map_err(|_| format!("`{}` is not an HTTP method", spec.method))?;
        let mut headers = HeaderMap::new();
        for (k, v) in &spec.headers {
            let name = HeaderName::from_bytes(k.as_bytes())
                .map_err(|_| format!("`{k}` is not a valid header name"))?;
            let value = HeaderValue::from_str(v)
                .map_err(|_| format!("header `{k}` has an invalid value"))?;
            headers.append(name, value);
        }
        let task = &ctx.task;
        let mut ours: Vec<(&'static str, String)> = vec![
            ("x-idempotency-key", task.idempotency_key.clone()),
            ("x-schedule-instance-id", task.id.clone()),
            ("x-attempt", ctx.attempt.to_string()),
        ];
        if let Some(shard) = task.shard {
            ours.push(("x-shard-no", shard.no.to_string()));
            ours.push(("x-shard-total", shard.total.to_string()));
        }
        if let Some(p) = &task.parent {
            ours.push(("x-parent-id", p.clone()));
        }
        if let Some(s) = &task.join_summary {
            ours.push((
                "x-join-summary",
                serde_json::to_string(s).unwrap_or_default(),
            ));
        }
        for (name, value) in ours {
            let value = HeaderValue::from_str(&value)
                .map_err(|_| format!("`{name}` value `{value}` is not a valid header value"))?;
            headers.insert(HeaderName::from_static(name), value);
        }
        let mut builder = client.request(method, url).headers(headers);
        if let Some(body) = &spec.body {
            builder = builder.body(body.clone());
        }
        builder
            .build()
            .map_err(|e| format!("cannot build the request: {}", cause_chain(&e)))
    }
}

/// Send the request and stream the body into `sink`. `Err` is the reason
/// for a `failed` outcome. Dropped (and the connection with it) when the
/// timeout or the stop signal wins the race in [`HttpRunner::run`].
async fn exchange(
    client: &reqwest::Client,
    request: reqwest::Request,
    spec: &HttpSpec,
    sink: &mut OutputSink,
    http_status: &mut Option<u16>,
) -> Result<(), String> {
    let url = request.url().clone();
    let mut response = client
        .execute(request)
        .await
        .map_err(|e| format!("{} {url} failed: {}", spec.method, causes(&e)))?;
    let status = response.status();
    *http_status = Some(status.as_u16());
    while let Some(chunk) = response
        .chunk()
        .await
        .map_err(|e| format!("reading the response body failed: {}", causes(&e)))?
    {
        sink.push(StreamKind::Stdout, &chunk);
    }
    let (low, high) = spec.success;
    if (low..=high).contains(&status.as_u16()) {
        Ok(())
    } else {
        Err(format!(
            "HTTP {}{}",
            status.as_u16(),
            status
                .canonical_reason()
                .map(|r| format!(" {r}"))
                .unwrap_or_default()
        ))
    }
}

/// The causes of a reqwest error: its own message only repeats the URL
/// ("error sending request for url (…)"), which the caller names already.
fn causes(e: &reqwest::Error) -> String {
    use std::error::Error;
    match e.source() {
        Some(source) => cause_chain(source),
        None => e.to_string(),
    }
}

/// An error and its sources, joined with ": ", skipping a source whose
/// text its parent already contains (hyper and reqwest often repeat).
pub fn cause_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        let text = s.to_string();
        if !text.is_empty() && !out.contains(&text) {
            out.push_str(": ");
            out.push_str(&text);
        }
        source = s.source();
    }
    out
}

/// The refusal reason for a URL whose host is a denied IP literal. Such
/// URLs never reach the resolver, so they are checked here.
fn denied_literal(url: &reqwest::Url) -> Option<String> {
    // The URL parser normalizes IP hosts (`2130706433` → `127.0.0.1`) and
    // brackets IPv6 ones.
    let host = url.host_str()?;
    let ip: IpAddr = host
        .strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host)
        .parse()
        .ok()?;
    denied_kind(ip).map(|kind| refusal(&ip.to_string(), kind))
}

fn refusal(what: &str, kind: &str) -> String {
    format!(
        "refused to connect to {what} ({kind} address): this worker denies private destinations (deny_private_http)"
    )
}

/// DNS resolution through the system resolver, keeping only the addresses
/// the SSRF guard allows. A name with no allowed address fails, naming
/// what it resolved to.
struct GuardedResolver;

impl Resolve for GuardedResolver {
    fn resolve(&self, name: Name) -> Resolving {
        let host = name.as_str().to_string();
        Box::pin(async move {
            let resolved: Vec<SocketAddr> =
                tokio::net::lookup_host((host.as_str(), 0)).await?.collect();
            let (allowed, denied): (Vec<SocketAddr>, Vec<SocketAddr>) = resolved
                .into_iter()
                .partition(|a| denied_kind(a.ip()).is_none());
            if allowed.is_empty() {
                let refused = match denied.first() {
                    Some(a) => refusal(
                        &format!("{host} = {}", a.ip()),
                        denied_kind(a.ip()).unwrap_or("denied"),
                    ),
                    None => format!("{host} resolves to no address"),
                };
                return Err(refused.into());
            }
            let addrs: Addrs = Box::new(allowed.into_iter());
            Ok(addrs)
        })
    }
}

/// Why the SSRF guard refuses an address, or `None` for a public unicast
/// address.
pub fn denied_kind(ip: IpAddr) -> Option<&'static str> {
    match ip {
        IpAddr::V4(v4) => denied_v4(v4),
        IpAddr::V6(v6) => denied_v6(v6),
    }
}

fn denied_v4(ip: Ipv4Addr) -> Option<&'static str> {
    let [a, b, c, _] = ip.octets();
    Some(match (a, b, c) {
        _ if ip.is_unspecified() => "unspecified",
        (0, _, _) => "\"this network\"",
        (127, _, _) => "loopback",
        (10, _, _) | (192, 168, _) => "private",
        (172, b, _) if (16..32).contains(&b) => "private",
        (169, 254, _) => "link-local",
        (100, b, _) if (64..128).contains(&b) => "shared (CGNAT)",
        (192, 0, 0) => "IETF protocol",
        (192, 0, 2) | (198, 51, 100) | (203, 0, 113) => "documentation",
        (198, 18, _) | (198, 19, _) => "benchmarking",
        _ if ip.is_broadcast() => "broadcast",
        (224..=239, _, _) => "multicast",
        (240..=255, _, _) => "reserved",
        _ => return None,
    })
}

fn denied_v6(ip: Ipv6Addr) -> Option<&'static str> {
    let s = ip.segments();
    if ip.is_unspecified() {
        return Some("unspecified");
    }
    if ip.is_loopback() {
        return Some("loopback");
    }
    // IPv4 inside IPv6: mapped (::ffff:a.b.c.d), compatible (::a.b.c.d),
    // NAT64 (64:ff9b::a.b.c.d) and 6to4 (2002:AABB:CCDD::) all reach the
    // embedded IPv4 address.
    let embedded = |hi: u16, lo: u16| Ipv4Addr::from(((hi as u32) << 16) | lo as u32);
    if s[..5] == [0; 5] && s[5] == 0xffff {
        return denied_v4(embedded(s[6], s[7]));
    }
    if s[..6] == [0; 6] {
        // Deprecated IPv4-compatible form: nothing legitimate uses it.
        return Some("IPv4-compatible");
    }
    if s[..6] == [0x64, 0xff9b, 0, 0, 0, 0] {
        return denied_v4(embedded(s[6], s[7]));
    }
    if s[0] == 0x2002 {
        return denied_v4(embedded(s[1], s[2]));
    }
    Some(match s[0] {
        x if x & 0xfe00 == 0xfc00 => "unique local",
        x if x & 0xffc0 == 0xfe80 => "link-local",
        x if x & 0xffc0 == 0xfec0 => "site-local",
        x if x & 0xff00 == 0xff00 => "multicast",
        0x2001 if s[1] == 0x0db8 => "documentation",
        0x0100 if s[1..4] == [0, 0, 0] => "discard-only",
        _ => return None,
    })
}

/// Check an http task's fields (DESIGN.md 3.3).
fn validate(m: HttpFields) -> Result<HttpSpec, Invalid> {
    let (url, field) = match (&m.url, &m.payload) {
        (Some(_), Some(_)) => {
            return Err(Invalid::new(
                "payload",
                "give either `url` or `payload`, not both",
            ))
        }
        (Some(u), None) => (u.trim().to_string(), "url"),
        (None, Some(p)) => (p.trim().to_string(), "payload"),
        (None, None) => return Err(Invalid::new("url", "missing (or give `payload`)")),
    };
    let parsed = reqwest::Url::parse(&url).map_err(|e| {
        Invalid::new(
            field,
            format!("`{}` is not a URL: {e}", truncate_for_error(&url)),
        )
    })?;
    if !matches!(parsed.scheme(), "http" | "https") {
        return Err(Invalid::new(field, "only http and https URLs are allowed"));
    }
    let method = m
        .method
        .clone()
        .unwrap_or_else(|| "GET".into())
        .to_ascii_uppercase();
    if reqwest::Method::from_bytes(method.as_bytes()).is_err() {
        return Err(Invalid::new(
            "method",
            format!("`{method}` is not an HTTP method"),
        ));
    }
    let headers = m.headers.clone().unwrap_or_default();
    for (k, v) in &headers {
        if reqwest::header::HeaderName::from_bytes(k.as_bytes()).is_err() {
            return Err(Invalid::new(
                format!("headers.{k}"),
                "not a valid header name",
            ));
        }
        if reqwest::header::HeaderValue::from_str(v).is_err() {
            return Err(Invalid::new(
                format!("headers.{k}"),
                "not a valid header value",
            ));
        }
    }
    let success = match &m.success {
        None => (200, 299),
        Some(SuccessValue::One(s)) => (*s, *s),
        Some(SuccessValue::Range([a, b])) => (*a, *b),
        Some(SuccessValue::Text(t)) => {
            let (a, b) = t.split_once('-').unwrap_or((t, t));
            let p = |s: &str| s.trim().parse::<u16>().ok();
            match (p(a), p(b)) {
                (Some(a), Some(b)) => (a, b),
                _ => {
                    return Err(Invalid::new(
                        "success",
                        format!("`{t}` is not a status range like \"200-299\""),
                    ))
                }
            }
        }
    };
    if !(100..=599).contains(&success.0)
        || !(100..=599).contains(&success.1)
        || success.0 > success.1
    {
        return Err(Invalid::new(
            "success",
            "must be a status range within 100-599, low to high",
        ));
    }
    Ok(HttpSpec {
        url,
        method,
        headers,
        body: m.body.clone(),
        success,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kind(s: &str) -> Option<&'static str> {
        denied_kind(s.parse().unwrap())
    }

    #[test]
    fn denied_ranges() {
        for (addr, want) in [
            ("127.0.0.1", "loopback"),
            ("127.255.0.9", "loopback"),
            ("0.0.0.0", "unspecified"),
            ("0.1.2.3", "\"this network\""),
            ("10.1.2.3", "private"),
            ("172.16.0.1", "private"),
            ("172.31.255.255", "private"),
            ("192.168.1.1", "private"),
            ("169.254.169.254", "link-local"),
            ("100.64.0.1", "shared (CGNAT)"),
            ("100.127.255.255", "shared (CGNAT)"),
            ("224.0.0.1", "multicast"),
            ("255.255.255.255", "broadcast"),
            ("240.0.0.1", "reserved"),
            ("::", "unspecified"),
            ("::1", "loopback"),
            ("::ffff:127.0.0.1", "loopback"),
            ("::ffff:10.0.0.1", "private"),
            ("64:ff9b::a9fe:a9fe", "link-local"),
            ("2002:c0a8:0101::1", "private"),
            ("fd00::1", "unique local"),
            ("fc00::1", "unique local"),
            ("fe80::1", "link-local"),
            ("ff02::1", "multicast"),
            ("2001:db8::1", "documentation"),
        ] {
            assert_eq!(kind(addr), Some(want), "{addr}");
        }
    }

    #[test]
    fn public_addresses_pass() {
        for addr in [
            "1.1.1.1",
            "8.8.8.8",
            "172.32.0.1",
            "172.15.255.255",
            "100.128.0.1",
            "100.63.255.255",
            "192.169.0.1",
            "2606:4700:4700::1111",
            "::ffff:8.8.8.8",
            "2002:0808:0808::1",
        ] {
            assert_eq!(kind(addr), None, "{addr}");
        }
    }

    #[test]
    fn literal_urls() {
        let u = |s: &str| reqwest::Url::parse(s).unwrap();
        assert!(denied_literal(&u("http://127.0.0.1:8080/x"))
            .unwrap()
            .contains("127.0.0.1 (loopback address)"));
        assert!(denied_literal(&u("http://[::1]/")).is_some());
        assert!(denied_literal(&u("http://[::ffff:7f00:1]/")).is_some());
        assert!(denied_literal(&u("http://2130706433/")).is_some());
        assert!(denied_literal(&u("http://example.com/")).is_none());
        assert!(denied_literal(&u("https://8.8.8.8/")).is_none());
    }
}
