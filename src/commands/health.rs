//! `jetworker health`: an exit-code probe of a worker's `/readyz` (or
//! `/healthz` with `--live`) for container health checks and scripts, so
//! that an image needs no curl or wget. It speaks just enough HTTP/1.0 to
//! read the status line; it never connects to NATS.
//!
//! The address is `--addr`, else the `metrics_addr` setting (flag-less:
//! `JETWORKER_METRICS_ADDR` or the config file, as the worker reads it);
//! an unspecified host (`0.0.0.0`, `[::]`) is probed on loopback.
//!
//! Exit 0 when the endpoint answers 200; 1 when it answers anything else,
//! nothing listens, or it does not answer within `--timeout` (Docker reads
//! 1 as unhealthy); 2 when no address is configured or it is malformed.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::time::Duration;

use anyhow::{anyhow, bail};
use clap::Args;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::output;
use super::Exit;
use crate::config::Settings;
use crate::protocol::parse_duration;

#[derive(Debug, Clone, Args)]
#[command(after_help = "\
Exit codes: 0 ready (or live), 1 not, 2 no or bad address.

Examples:
  jetworker health                        # /readyz at metrics_addr
  jetworker health --addr 127.0.0.1:9090 --live
  HEALTHCHECK CMD [\"jetworker\", \"health\"]  # in a Dockerfile")]
pub struct HealthArgs {
    /// The worker's metrics address (default: the metrics_addr setting).
    #[arg(long, value_name = "HOST:PORT")]
    pub addr: Option<String>,
    /// Probe /healthz (the process is alive) instead of /readyz
    /// (connected to NATS and pulling).
    #[arg(long)]
    pub live: bool,
    /// Give up after this long.
    #[arg(long, default_value = "3s", value_name = "DURATION")]
    pub timeout: String,
}

/// Where to probe: an unspecified host means "every interface", of which
/// loopback is one.
fn probe_addr(mut a: SocketAddr) -> SocketAddr {
    if a.ip().is_unspecified() {
        a.set_ip(match a.ip() {
            IpAddr::V4(_) => IpAddr::V4(Ipv4Addr::LOCALHOST),
            IpAddr::V6(_) => IpAddr::V6(Ipv6Addr::LOCALHOST),
        });
    }
    a
}

/// GET `path` and return the status code and the first body line.
async fn get(addr: SocketAddr, path: &str) -> anyhow::Result<(u16, String)> {
    let mut s = tokio::net::TcpStream::connect(addr).await?;
    s.write_all(format!("GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").as_bytes())
        .await?;
    let mut buf = Vec::new();
    // The endpoints answer a few bytes; 4 KiB is plenty.
    let mut chunk = [0u8; 1024];
    while buf.len() < 4096 {
        let n = s.read(&mut chunk).await?;
        if n == 0 {
            break;
        }
        buf.extend_from_slice(&chunk[..n]);
    }
    let text = String::from_utf8_lossy(&buf);
    let code = text
        .lines()
        .next()
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|c| c.parse::<u16>().ok())
        .ok_or_else(|| anyhow!("not an HTTP answer"))?;
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.trim().to_string())
        .unwrap_or_default();
    Ok((code, body))
}

pub async fn run(settings: &Settings, args: HealthArgs) -> anyhow::Result<Exit> {
    let timeout = parse_duration(&args.timeout).map_err(|e| anyhow!("--timeout: {e}"))?;
    let addr = match &args.addr {
        Some(a) => a
            .parse::<SocketAddr>()
            .map_err(|_| anyhow!("--addr: `{a}` is not an address like 127.0.0.1:9090"))?,
        None => match crate::config::metrics_addr(settings)? {
            Some(a) => a,
            None => bail!(
                "no address to probe: give --addr, or set metrics_addr (JETWORKER_METRICS_ADDR) as for the worker"
            ),
        },
    };
    let addr = probe_addr(addr);
    let path = if args.live { "/healthz" } else { "/readyz" };
    let answer = tokio::time::timeout(timeout.max(Duration::from_millis(1)), get(addr, path)).await;
    let (ok, text) = match answer {
        Ok(Ok((200, body))) => (true, body),
        Ok(Ok((code, body))) => (false, format!("{body} (HTTP {code})")),
        Ok(Err(e)) => (false, format!("no answer from http://{addr}{path}: {e}")),
        Err(_) => (
            false,
            format!("no answer from http://{addr}{path} within {timeout:?}"),
        ),
    };
    output::line(&text)?;
    Ok(if ok { Exit::Ok } else { Exit::NotSucceeded })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unspecified_hosts_are_probed_on_loopback() {
        let a: SocketAddr = "0.0.0.0:9090".parse().unwrap();
        assert_eq!(probe_addr(a), "127.0.0.1:9090".parse().unwrap());
        let a: SocketAddr = "[::]:9090".parse().unwrap();
        assert_eq!(probe_addr(a), "[::1]:9090".parse().unwrap());
        let a: SocketAddr = "10.0.0.1:9090".parse().unwrap();
        assert_eq!(probe_addr(a), a);
    }
}
