//! `jetworker ui` for the dashboard's tests and benchmark: the built binary
//! on a free port (its ready line says which), and a bare HTTP/1.1 client
//! for the checks that a browser would hide (status codes, headers).

#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::util;

/// A running `jetworker ui`; SIGKILLed on drop.
pub struct UiProc {
    pub child: Child,
    /// `http://127.0.0.1:<port>` (also for a wildcard bind).
    pub url: String,
    pub port: u16,
    /// Its stderr so far.
    pub log: Arc<Mutex<String>>,
}

/// The command line of `jetworker ui` against `nats_url` with `extra` flags
/// (`--listen 127.0.0.1:0` unless `extra` names one).
pub fn ui_command(nats_url: &str, extra: &[&str]) -> Command {
    let mut cmd = Command::new(util::jetworker_bin());
    cmd.args(["ui", "--no-context", "--server", nats_url]);
    if !extra.contains(&"--listen") {
        cmd.args(["--listen", "127.0.0.1:0"]);
    }
    cmd.args(extra)
        .env("XDG_CONFIG_HOME", "/nonexistent-jetworker-test")
        .env_remove("JETWORKER_UI_TOKEN")
        .env(
            "LOG_LEVEL",
            std::env::var("TEST_LOG_LEVEL").unwrap_or_else(|_| "warn".into()),
        )
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    cmd
}

impl UiProc {
    /// Start it and wait for its ready line (`jetworker: ready: ui on
    /// http://ADDR/`).
    pub fn start(nats_url: &str, extra: &[&str]) -> UiProc {
        let mut child = ui_command(nats_url, extra).spawn().unwrap();
        let stderr = child.stderr.take().unwrap();
        let log = Arc::new(Mutex::new(String::new()));
        let (tx, rx) = std::sync::mpsc::channel::<String>();
        {
            let log = log.clone();
            std::thread::spawn(move || {
                for line in BufReader::new(stderr).lines() {
                    let Ok(line) = line else { break };
                    if let Some(u) = line.strip_prefix("jetworker: ready: ui on ") {
                        let _ = tx.send(u.trim_end_matches('/').to_string());
                    }
                    let mut l = log.lock().unwrap();
                    l.push_str(&line);
                    l.push('\n');
                }
            });
        }
        let addr = match rx.recv_timeout(Duration::from_secs(30)) {
            Ok(a) => a,
            Err(_) => {
                let _ = child.kill();
                panic!(
                    "jetworker ui did not get ready; it said:\n{}",
                    log.lock().unwrap()
                );
            }
        };
        let port: u16 = addr.rsplit(':').next().unwrap().parse().unwrap();
        UiProc {
            child,
            url: format!("http://127.0.0.1:{port}"),
            port,
            log,
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for UiProc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A response: status, headers (lower-case names), body.
#[derive(Debug)]
pub struct Response {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: String,
}

impl Response {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }
}

/// One HTTP/1.1 request to `127.0.0.1:port` (`Connection: close`).
pub fn http(port: u16, method: &str, path: &str, headers: &[(&str, &str)], body: &str) -> Response {
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let mut req = format!("{method} {path} HTTP/1.1\r\nConnection: close\r\n");
    if !headers.iter().any(|(k, _)| k.eq_ignore_ascii_case("host")) {
        req.push_str(&format!("Host: 127.0.0.1:{port}\r\n"));
    }
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    req.push_str(&format!("Content-Length: {}\r\n\r\n{body}", body.len()));
    s.write_all(req.as_bytes()).unwrap();
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).unwrap();
    let text = String::from_utf8_lossy(&raw).into_owned();
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let mut lines = head.lines();
    let status = lines
        .next()
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|c| c.parse().ok())
        .unwrap_or_else(|| panic!("no HTTP status in {head:?}"));
    let headers = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
        .collect();
    Response {
        status,
        headers,
        body: body.to_string(),
    }
}
