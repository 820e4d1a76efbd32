//! Helpers shared by the benches: settings from the environment, medians,
//! the process's peak RSS, and a private nats-server (free port, temporary
//! store, killed and removed on drop — the same logic as
//! `tests/integration/util.rs`, which a bench cannot import).

#![allow(dead_code)]

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A positive number from the environment variable `name`, else `default`.
pub fn env_usize(name: &str, default: usize) -> usize {
    match std::env::var(name) {
        Ok(v) => match v.parse::<usize>() {
            Ok(n) if n > 0 => n,
            _ => panic!("{name}={v:?}: expected a positive integer"),
        },
        Err(_) => default,
    }
}

/// The median of `v` (the mean of the middle two for an even count).
pub fn median(v: &[f64]) -> f64 {
    assert!(!v.is_empty(), "median of nothing");
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    let m = s.len() / 2;
    if s.len() % 2 == 1 {
        s[m]
    } else {
        (s[m - 1] + s[m]) / 2.0
    }
}

/// The `p`-th percentile (0–100) of sorted `v`, nearest rank.
pub fn percentile(sorted: &[Duration], p: f64) -> Duration {
    assert!(!sorted.is_empty(), "percentile of nothing");
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// A field of `/proc/self/status` in KiB (`VmHWM`, `VmRSS`).
fn status_kib(field: &str) -> u64 {
    let s = std::fs::read_to_string("/proc/self/status").expect("read /proc/self/status");
    s.lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or_else(|| panic!("no {field} in /proc/self/status"))
}

/// Peak resident set size of this process so far, in MiB (`VmHWM`).
pub fn peak_rss_mib() -> f64 {
    status_kib("VmHWM") as f64 / 1024.0
}

/// Reset the peak RSS to the current RSS (`/proc/self/clear_refs`, value
/// 5), so that the next [`peak_rss_mib`] covers only what follows. Returns
/// false where the kernel does not allow it.
pub fn reset_peak_rss() -> bool {
    std::fs::write("/proc/self/clear_refs", "5").is_ok()
}

/// The nats-server binary: `NATS_SERVER_BIN`, else `nats-server` on PATH.
pub fn nats_server_bin() -> PathBuf {
    std::env::var_os("NATS_SERVER_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("nats-server"))
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A private nats-server with JetStream, killed (and its store removed) on
/// drop.
pub struct NatsServer {
    child: Child,
    pub port: u16,
    _store: tempfile::TempDir,
}

impl NatsServer {
    pub fn start() -> Self {
        let store = tempfile::tempdir().unwrap();
        let port = free_port();
        let conf = store.path().join("server.conf");
        let text = format!(
            "listen: 127.0.0.1:{port}\njetstream {{ store_dir: \"{}\" }}\n",
            store.path().join("js").display()
        );
        std::fs::write(&conf, text).unwrap();
        let child = Command::new(nats_server_bin())
            .arg("-c")
            .arg(&conf)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| {
                panic!(
                    "cannot start nats-server ({}): {e}; set NATS_SERVER_BIN",
                    nats_server_bin().display()
                )
            });
        let deadline = Instant::now() + Duration::from_secs(20);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(
                Instant::now() < deadline,
                "nats-server did not start on port {port}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        NatsServer {
            child,
            port,
            _store: store,
        }
    }

    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }
}

impl Drop for NatsServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
