//! Dashboard figures (issue 13), printed, asserting nothing about time:
//! `jetworker ui` (the built binary) and headless Chromium against a
//! private nats-server holding 500 simulated workers on 100 labels.
//!
//! - **load**: navigation start → the snapshot applied (500 worker rows,
//!   100 queue rows in the DOM; the page's `jetworker-snapshot`
//!   performance mark), median of several loads; the page's DOM load too.
//! - **lag**: a heartbeat put into KV `workers` → the page showing it (a
//!   MutationObserver in the page stamps the moment the row's version
//!   cell changes; both clocks are this machine's).
//! - **steady state**: every simulated worker beats every 5 s (100 puts/s)
//!   while the page is open: the UI process's CPU and resident memory
//!   (/proc), the page's long tasks (> 50 ms) and largest gap between
//!   animation frames, its JS heap.
//! - **results**: a first page of 50 and a filtered page (a status that
//!   is rare) over a RESULTS stream of `UI_BENCH_RESULTS` records.
//!
//! Run: `cargo bench --bench ui` (needs `nats-server` on PATH or
//! `NATS_SERVER_BIN`, and chromium). Settings: `UI_BENCH_WORKERS` (500),
//! `UI_BENCH_LABELS` (100), `UI_BENCH_RESULTS` (20000), `UI_BENCH_LOADS`
//! (5), `UI_BENCH_LAGS` (40).

#[path = "../tests/integration/browser.rs"]
mod browser;
mod common;
#[path = "../tests/integration/ui_util.rs"]
mod ui_util;
use common::util;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::jetstream::{self, message::PublishMessage};
use chrono::Utc;
use jetworker::internals::{ensure_all, ensure_label_consumer, SetupOptions};
use jetworker::protocol::{Heartbeat, Names};
use serde_json::json;

use browser::Browser;
use common::{env_usize, median};
use ui_util::{http, UiProc};
use util::NatsServer;

fn heartbeat(i: usize, labels: usize, version: &str) -> Heartbeat {
    let now = Utc::now();
    Heartbeat {
        id: format!("sim-{i:04}"),
        hostname: format!("host-{:02}", i % 40),
        pid: 1000 + i as u32,
        version: version.to_string(),
        labels: (0..1 + i % 3)
            .map(|k| format!("label-{:03}", (i + k * 37) % labels))
            .collect(),
        types: vec!["shell".into(), "command".into()],
        slots: 4,
        running: i % 5,
        running_by_label: Default::default(),
        tasks: (0..i % 5).map(|k| format!("task-{i}-{k}")).collect(),
        started_at: now - chrono::Duration::minutes(30),
        seen_at: now,
        counts: [("success".to_string(), i as u64)].into_iter().collect(),
    }
}

/// `VmRSS` and `VmHWM` of a process, in MiB.
fn rss_mib(pid: u32) -> (f64, f64) {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let field = |f: &str| -> f64 {
        s.lines()
            .find_map(|l| l.strip_prefix(f)?.strip_prefix(':'))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
            .unwrap_or(0.0)
            / 1024.0
    };
    (field("VmRSS"), field("VmHWM"))
}

/// CPU time (user + system) of a process, in seconds.
fn cpu_secs(pid: u32) -> f64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let rest = s.rsplit_once(')').unwrap().1;
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks: f64 = f[11].parse::<f64>().unwrap() + f[12].parse::<f64>().unwrap();
    ticks / 100.0
}

#[tokio::main]
async fn main() {
    let workers = env_usize("UI_BENCH_WORKERS", 500);
    let labels = env_usize("UI_BENCH_LABELS", 100);
    let results = env_usize("UI_BENCH_RESULTS", 20_000);
    let loads = env_usize("UI_BENCH_LOADS", 5);
    let lags = env_usize("UI_BENCH_LAGS", 40);
    let Some(browser) = Browser::launch() else {
        panic!("the ui bench needs chromium");
    };
    let srv = NatsServer::start();
    let js = jetstream::new(srv.client().await);
    let names = Names::default();
    let infra = ensure_all(&js, &names, &SetupOptions::default())
        .await
        .unwrap();
    for l in 0..labels {
        ensure_label_consumer(
            &infra.tasks,
            &names,
            &format!("label-{l:03}"),
            Duration::from_secs(30),
        )
        .await
        .unwrap();
    }
    let kv = infra.workers.clone();
    for i in 0..workers {
        let hb = heartbeat(i, labels, "0.1.0");
        kv.put(&hb.id, serde_json::to_vec(&hb).unwrap().into())
            .await
            .unwrap();
    }
    // Results: what a busy day leaves, 1 in 50 failed.
    let t0 = Instant::now();
    let mut acks = Vec::new();
    for n in 0..results {
        let id = format!("r{n:06}");
        let status = if n % 50 == 0 { "failed" } else { "success" };
        let r = json!({"id": id, "label": format!("label-{:03}", n % labels), "type": "shell",
            "status": status, "final": true, "attempt": 1, "max_attempts": 3,
            "exit_code": if status == "success" { 0 } else { 1 }, "signal": null, "http_status": null,
            "output": format!("output of {id}\n"), "output_truncated": false, "output_bytes": 16,
            "error": null, "worker_id": "sim-0001", "idempotency_key": id, "shard": null,
            "started_at": Utc::now(), "finished_at": Utc::now(), "duration_ms": 12, "retry_in_ms": null});
        let m = PublishMessage::build().payload(serde_json::to_vec(&r).unwrap().into());
        acks.push(js.send_publish(names.result_subject(&id), m).await.unwrap());
        if acks.len() >= 512 {
            for a in acks.drain(..) {
                a.await.unwrap();
            }
        }
    }
    for a in acks.drain(..) {
        a.await.unwrap();
    }
    eprintln!(
        "loaded {workers} heartbeats, {labels} label consumers, {results} results in {:.1}s",
        t0.elapsed().as_secs_f64()
    );

    // Every worker beats every 5 s from now on.
    let beating = Arc::new(AtomicBool::new(true));
    let beater = {
        let kv = kv.clone();
        let beating = beating.clone();
        tokio::spawn(async move {
            let every = Duration::from_secs(5) / workers as u32;
            let mut tick = tokio::time::interval(every);
            let mut i = 0;
            while beating.load(Ordering::Relaxed) {
                tick.tick().await;
                // The lag probe owns worker 0.
                if i % workers != 0 {
                    let hb = heartbeat(i % workers, labels, "0.1.0");
                    let _ = kv
                        .put(&hb.id, serde_json::to_vec(&hb).unwrap().into())
                        .await;
                }
                i += 1;
            }
        })
    };

    let ui = UiProc::start(&srv.url(), &[]);
    let pid = ui.pid();
    let page = browser.new_page().await;

    // Load: navigation start → snapshot applied with every row.
    let mut load_ms = Vec::new();
    let mut dom_ms = Vec::new();
    let mut feed_ms = Vec::new();
    for _ in 0..loads {
        page.goto(&ui.url).await;
        page.wait(
            "every worker row",
            Duration::from_secs(60),
            &format!(
                "document.querySelectorAll('#workers-table .body .row').length === {workers} && \
                 document.querySelectorAll('#queues-table .body .row').length === {labels}"
            ),
        )
        .await;
        let v = page
            .eval(
                "({snap: performance.getEntriesByName('jetworker-snapshot')[0].startTime, \
                  dom: performance.getEntriesByType('navigation')[0].domContentLoadedEventEnd, \
                  feed: performance.getEntriesByName('jetworker-feed-open')[0].startTime})",
            )
            .await;
        load_ms.push(v["snap"].as_f64().unwrap());
        dom_ms.push(v["dom"].as_f64().unwrap());
        feed_ms.push(v["feed"].as_f64().unwrap_or(0.0));
    }
    if let Some(d) = std::env::var_os("JETWORKER_UI_SCREENSHOTS") {
        let d = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(d);
        page.screenshot(&d.join("workers-500.png")).await;
        page.eval("location.hash = '#/queues'").await;
        tokio::time::sleep(Duration::from_millis(500)).await;
        page.screenshot(&d.join("queues-100.png")).await;
        page.eval("location.hash = '#/workers'").await;
    }

    // Steady state: the page open, 100 heartbeats/s.
    page.eval(
        "window.__long = []; new PerformanceObserver(l => window.__long.push(...l.getEntries().map(e => e.duration))) \
         .observe({type: 'longtask', buffered: false}); \
         window.__gap = 0; (function f(last) { requestAnimationFrame(t => { \
           if (last) window.__gap = Math.max(window.__gap, t - last); f(t); }); })(0); true",
    )
    .await;
    page.call("Performance.enable", json!({})).await;
    let metrics = |v: serde_json::Value| -> std::collections::HashMap<String, f64> {
        v["metrics"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| {
                (
                    m["name"].as_str().unwrap().to_string(),
                    m["value"].as_f64().unwrap_or(0.0),
                )
            })
            .collect()
    };
    let m0 = metrics(page.call("Performance.getMetrics", json!({})).await);
    let cpu0 = cpu_secs(pid);
    let w0 = Instant::now();
    let steady = Duration::from_secs(20);
    tokio::time::sleep(steady).await;
    let m1 = metrics(page.call("Performance.getMetrics", json!({})).await);
    let busy = |k: &str| (m1[k] - m0[k]) / steady.as_secs_f64() * 100.0;
    let (script, layout, style, task) = (
        busy("ScriptDuration"),
        busy("LayoutDuration"),
        busy("RecalcStyleDuration"),
        busy("TaskDuration"),
    );
    let cpu = (cpu_secs(pid) - cpu0) / w0.elapsed().as_secs_f64() * 100.0;
    let (rss, hwm) = rss_mib(pid);
    let page_stats = page
        .eval(
            "({long: window.__long.length, longest: Math.max(0, ...window.__long), gap: window.__gap, \
              heap: performance.memory ? performance.memory.usedJSHeapSize / 1048576 : null, \
              nodes: document.getElementsByTagName('*').length})",
        )
        .await;

    // Lag: heartbeat put → the row's version cell shows it.
    page.eval(
        "window.__seen = {}; new MutationObserver(ms => { for (const m of ms) { \
           const t = m.target.nodeType === 3 ? m.target.parentNode : m.target; \
           const s = t && t.textContent; \
           if (s && s.startsWith('lag-') && !(s in window.__seen)) window.__seen[s] = Date.now(); } }) \
         .observe(document.getElementById('workers-table'), {subtree: true, childList: true, characterData: true}); true",
    )
    .await;
    let mut lag_ms = Vec::new();
    for k in 0..lags {
        let v = format!("lag-{k}");
        let hb = heartbeat(0, labels, &v);
        let sent = Utc::now().timestamp_millis();
        kv.put(&hb.id, serde_json::to_vec(&hb).unwrap().into())
            .await
            .unwrap();
        let seen = page
            .wait(
                "the heartbeat on the page",
                Duration::from_secs(10),
                &format!("window.__seen[{}]", serde_json::to_string(&v).unwrap()),
            )
            .await
            .as_f64()
            .unwrap();
        lag_ms.push(seen - sent as f64);
        tokio::time::sleep(Duration::from_millis(150)).await;
    }
    lag_ms.sort_by(f64::total_cmp);
    let pct = |p: f64| {
        lag_ms[((p / 100.0 * lag_ms.len() as f64).ceil() as usize).clamp(1, lag_ms.len()) - 1]
    };

    // Results pages over the stream.
    let time = |path: &str| {
        let t = Instant::now();
        let r = http(ui.port, "GET", path, &[], "");
        assert_eq!(r.status, 200, "{path}: {}", r.body);
        let v: serde_json::Value = serde_json::from_str(&r.body).unwrap();
        (
            t.elapsed().as_secs_f64() * 1000.0,
            v["rows"].as_array().unwrap().len(),
            v["scanned"].as_u64().unwrap(),
        )
    };
    let first = time("/api/results?limit=50");
    let older = time(&format!("/api/results?limit=50&before={}", results / 2));
    let failed = time("/api/results?limit=50&status=failed");
    beating.store(false, Ordering::Relaxed);
    let _ = beater.await;

    println!("\n## jetworker ui: {workers} workers, {labels} labels, {results} results\n");
    println!("| figure | value |");
    println!("|---|---|");
    println!(
        "| page load, navigation → snapshot applied (median of {loads}) | {:.0} ms (DOM ready {:.0} ms, event feed open {:.0} ms) |",
        median(&load_ms),
        median(&dom_ms),
        median(&feed_ms)
    );
    println!(
        "| heartbeat put → shown on the page (n={lags}) | p50 {:.0} ms, p95 {:.0} ms, max {:.0} ms |",
        pct(50.0),
        pct(95.0),
        lag_ms[lag_ms.len() - 1]
    );
    println!("| `jetworker ui` resident memory (RSS, peak) | {rss:.1} MiB, {hwm:.1} MiB |");
    println!(
        "| `jetworker ui` CPU at {} heartbeats/s, one page open | {cpu:.1} % of a core |",
        workers / 5
    );
    println!(
        "| page over {}s at that rate: long tasks (> 50 ms), longest, largest frame gap | {}, {:.0} ms, {:.0} ms |",
        steady.as_secs(),
        page_stats["long"],
        page_stats["longest"].as_f64().unwrap_or(0.0),
        page_stats["gap"].as_f64().unwrap_or(0.0)
    );
    println!(
        "| page main thread busy at that rate: all tasks (script, layout, style) | {task:.1} % ({script:.1} %, {layout:.1} %, {style:.1} %) |"
    );
    println!(
        "| page JS heap, DOM elements | {:.1} MiB, {} |",
        page_stats["heap"].as_f64().unwrap_or(0.0),
        page_stats["nodes"]
    );
    for (what, (ms, rows, scanned)) in [
        ("results, newest 50", first),
        ("results, 50 older than the middle", older),
        ("results, 50 with status failed (1 in 50)", failed),
    ] {
        println!("| {what} | {ms:.0} ms ({rows} rows, {scanned} records read) |");
    }
    drop(page);
}
