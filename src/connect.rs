//! Connecting to NATS with the configured auth and TLS, and checking that
//! the server is new enough for this design (2.11: KV limit markers and
//! per-message TTL; 2.14: cron schedules).

use std::time::Duration;

use anyhow::{bail, Context as _};
use async_nats::{Client, ConnectOptions, Event};

use crate::config::{ConfigError, ConnectConfig};

/// Oldest server the worker accepts.
pub const MIN_SERVER: (u64, u64) = (2, 11);

/// Parsed `major.minor.patch` of a server version string.
pub fn parse_version(v: &str) -> Option<(u64, u64, u64)> {
    let core = v.trim_start_matches('v').split(['-', '+']).next()?;
    let mut it = core.split('.').map(|p| p.parse::<u64>().ok());
    Some((it.next()??, it.next()??, it.next().flatten().unwrap_or(0)))
}

/// Whether the connected server is at least `major.minor`.
pub fn server_at_least(client: &Client, major: u64, minor: u64) -> bool {
    parse_version(&client.server_info().version)
        .map(|(a, b, _)| (a, b) >= (major, minor))
        .unwrap_or(false)
}

/// Options for a connection: auth, TLS, a name.
pub async fn options(cfg: &ConnectConfig, name: &str) -> anyhow::Result<ConnectOptions> {
    let mut o = ConnectOptions::new().name(name);
    if let Some(p) = &cfg.creds {
        o = ConnectOptions::with_credentials_file(p.clone())
            .await
            .with_context(|| format!("creds: cannot read {}", p.display()))?
            .name(name);
    }
    if let Some(p) = &cfg.nkey {
        let seed = std::fs::read_to_string(p)
            .with_context(|| format!("nkey: cannot read {}", p.display()))?;
        let seed = seed
            .lines()
            .map(str::trim)
            .find(|l| l.starts_with('S'))
            .with_context(|| format!("nkey: no seed (a line starting with S) in {}", p.display()))?
            .to_string();
        o = o.nkey(seed);
    }
    if let Some(t) = &cfg.token {
        o = o.token(t.clone());
    }
    if let (Some(u), Some(pw)) = (&cfg.user, &cfg.password) {
        o = o.user_and_password(u.clone(), pw.clone());
    }
    if let Some(ca) = &cfg.tls_ca {
        o = o.add_root_certificates(ca.clone()).require_tls(true);
    }
    if let (Some(c), Some(k)) = (&cfg.tls_cert, &cfg.tls_key) {
        o = o
            .add_client_certificate(c.clone(), k.clone())
            .require_tls(true);
    }
    if cfg.tls_first {
        o = o.tls_first().require_tls(true);
    }
    if let Some(p) = &cfg.inbox_prefix {
        o = o.custom_inbox_prefix(p);
    }
    Ok(o.connection_timeout(cfg.api_timeout))
}

/// The JetStream context for `client`: the configured domain (`--js-domain`:
/// `$JS.<domain>.API`) and the API timeout. The worker and every operator
/// command use this one, so both reach the same streams.
pub fn jetstream(client: Client, cfg: &ConnectConfig) -> async_nats::jetstream::Context {
    use async_nats::jetstream::ContextBuilder;
    match &cfg.js_domain {
        Some(d) => ContextBuilder::new()
            .timeout(cfg.api_timeout)
            .domain(d.clone())
            .build(client),
        None => ContextBuilder::new().timeout(cfg.api_timeout).build(client),
    }
}

/// Connect once (operator commands): fail fast with a clear message.
pub async fn connect_cli(cfg: &ConnectConfig) -> anyhow::Result<Client> {
    let o = options(cfg, "jetworker-cli").await?;
    let client = o
        .connect(cfg.servers.clone())
        .await
        .with_context(|| format!("cannot connect to NATS at {}", cfg.servers.join(",")))?;
    // The server's INFO (version, max_payload) may land a moment later.
    for _ in 0..200 {
        if !client.server_info().version.is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    Ok(client)
}

/// Connect for a long-running worker: keep trying until the server is up
/// (a worker started beside its server in compose must not crash), report
/// connection events through `on_event`.
///
/// The keepalive ping runs every quarter of `ack_wait`: the client gives a
/// connection up after three unanswered pings, so a silently dropped link
/// is noticed within ack wait rather than after async-nats' default of
/// about three minutes. (Leases do not depend on it: they are counted from
/// confirmed progress acks.) Unreadable credentials are a [`ConfigError`].
pub async fn connect_worker(
    cfg: &ConnectConfig,
    name: &str,
    ack_wait: Duration,
    on_event: std::sync::Arc<dyn Fn(Event) + Send + Sync>,
) -> anyhow::Result<Client> {
    let o = options(cfg, name)
        .await
        .map_err(|e| ConfigError::new("connection", format!("{e:#}")))?
        .ping_interval(keepalive(ack_wait))
        .retry_on_initial_connect()
        .connection_timeout(Duration::from_secs(5))
        .reconnect_delay_callback(|attempts| {
            Duration::from_millis((100u64 << attempts.min(5)).min(2000))
        })
        .event_callback(move |e| {
            let f = on_event.clone();
            async move { f(e) }
        });
    let client = o
        .connect(cfg.servers.clone())
        .await
        .with_context(|| format!("cannot connect to NATS at {}", cfg.servers.join(",")))?;
    // With retry_on_initial_connect the client returns at once; the server's
    // info (version, max_payload) is only there once connected.
    let start = std::time::Instant::now();
    let mut warned = false;
    // The state can read Connected a moment before the INFO is stored.
    while client.connection_state() != async_nats::connection::State::Connected
        || client.server_info().version.is_empty()
    {
        if !warned && start.elapsed() > Duration::from_secs(3) {
            tracing::warn!(servers = %cfg.servers.join(","), "waiting for NATS");
            warned = true;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Ok(client)
}

/// Refuse servers older than [`MIN_SERVER`] and servers without JetStream
/// (operator commands, which fail fast).
pub fn check_server(client: &Client) -> anyhow::Result<()> {
    check_server_version(client)?;
    if !client.server_info().jetstream {
        bail!("JetStream is not enabled on the server (start nats-server with -js)");
    }
    Ok(())
}

/// The keepalive ping interval for a worker whose leases last `ack_wait`.
pub fn keepalive(ack_wait: Duration) -> Duration {
    (ack_wait / 4).clamp(Duration::from_millis(500), Duration::from_secs(30))
}

/// Refuse servers older than [`MIN_SERVER`] (what no restart fixes).
pub fn check_server_version(client: &Client) -> anyhow::Result<()> {
    let info = client.server_info();
    let Some((a, b, _)) = parse_version(&info.version) else {
        bail!("cannot read the server version `{}`", info.version);
    };
    if (a, b) < MIN_SERVER {
        bail!(
            "nats-server {} is too old: jetworker needs {}.{} or newer (KV limit markers, per-message TTL)",
            info.version,
            MIN_SERVER.0,
            MIN_SERVER.1
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::parse_version;

    #[test]
    fn versions() {
        assert_eq!(parse_version("2.15.1"), Some((2, 15, 1)));
        assert_eq!(parse_version("v2.11.0-beta.2"), Some((2, 11, 0)));
        assert_eq!(parse_version("2.9"), Some((2, 9, 0)));
        assert_eq!(parse_version("x"), None);
    }
}
