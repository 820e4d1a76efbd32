//! Helpers shared by the benches: settings from the environment, medians,
//! the process's peak RSS, and the integration tests' private nats-server
//! (`tests/integration/util.rs`, included by path).

#![allow(dead_code)]

use std::time::Duration;

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

/// CPU time (user + system) that process `pid` has used so far, in
/// seconds (`/proc/<pid>/stat`; a clock tick is 10 ms, so measure phases
/// of a second or more).
pub fn cpu_seconds(pid: u32) -> f64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .unwrap_or_else(|e| panic!("/proc/{pid}/stat: {e}"));
    // Fields after the command's closing parenthesis, from field 3 (state):
    // utime is field 14, stime field 15.
    let f: Vec<&str> = s[s.rfind(')').expect("stat has a comm") + 2..]
        .split(' ')
        .collect();
    let ticks: f64 = f[11].parse::<f64>().unwrap() + f[12].parse::<f64>().unwrap();
    // SAFETY: sysconf has no preconditions.
    ticks / unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64
}

/// Wait until a worker whose id starts with `prefix` has stored a
/// heartbeat (its pullers start right after), at most 30 s.
pub async fn wait_heartbeat(js: &async_nats::jetstream::Context, prefix: &str) {
    use futures::StreamExt;
    let bucket = jetworker::protocol::Names::default().workers_bucket;
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        if let Ok(kv) = js.get_key_value(&bucket).await {
            if let Ok(keys) = kv.keys().await {
                let keys: Vec<String> = keys.filter_map(|k| async { k.ok() }).collect().await;
                if keys.iter().any(|k| k.starts_with(prefix)) {
                    return;
                }
            }
        }
        assert!(
            std::time::Instant::now() < deadline,
            "worker did not start in 30s"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The integration tests' harness: a private nats-server that picks its own
/// port, with a temporary store, killed and removed on drop.
#[path = "../../tests/integration/util.rs"]
pub mod util;

// Not every bench starts a server.
#[allow(unused_imports)]
pub use util::NatsServer;
