//! A headless Chromium driven over the DevTools protocol, for the
//! dashboard's tests and benchmark: no WebDriver, no crate, no websocket.
//! Chromium is started with `--remote-debugging-pipe`: it reads commands
//! on its fd 3 and writes answers and events on its fd 4, each a JSON
//! object ended by a NUL byte. One page = one target attached in
//! "flatten" mode, addressed by its session id.
//!
//! The browser runs in its own process group, killed whole on drop (the
//! renderer and GPU processes too).
//!
//! Finding it: `JETWORKER_CHROMIUM`, else `chromium`, `chromium-browser`,
//! `google-chrome` on PATH. Without one, [`Browser::launch`] calls
//! `util::skip` (which fails under `JETWORKER_NO_SKIP=1`, as in CI) and
//! returns `None`.

#![allow(dead_code)]

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use base64::Engine as _;
use serde_json::{json, Value};
use tokio::sync::oneshot;

use super::util;

type Pending = Arc<Mutex<HashMap<u64, oneshot::Sender<Result<Value, String>>>>>;

/// Exceptions thrown in pages and console errors, by session id.
type Errors = Arc<Mutex<Vec<(String, String)>>>;

pub struct Browser {
    child: Child,
    to_chrome: Mutex<std::fs::File>,
    next_id: AtomicU64,
    pending: Pending,
    errors: Errors,
    _profile: tempfile::TempDir,
}

/// The browser binary, if there is one.
pub fn chromium_bin() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("JETWORKER_CHROMIUM") {
        return Some(PathBuf::from(p));
    }
    let path = std::env::var_os("PATH")?;
    for name in ["chromium", "chromium-browser", "google-chrome"] {
        for dir in std::env::split_paths(&path) {
            let p = dir.join(name);
            if p.is_file() {
                return Some(p);
            }
        }
    }
    None
}

fn pipe() -> (OwnedFd, OwnedFd) {
    nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).expect("pipe")
}

impl Browser {
    /// Start a headless browser (`None` where there is none; see the
    /// module doc).
    pub fn launch() -> Option<Browser> {
        let Some(bin) = chromium_bin() else {
            util::skip("no chromium (apt-get install chromium, or set JETWORKER_CHROMIUM)");
            return None;
        };
        let profile = tempfile::tempdir().unwrap();
        let (cmd_read, cmd_write) = pipe();
        let (out_read, out_write) = pipe();
        let log = std::fs::File::create(profile.path().join("chromium.log")).unwrap();
        let mut cmd = Command::new(&bin);
        cmd.args([
            "--headless=new",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--remote-debugging-pipe",
            "--no-first-run",
            "--no-default-browser-check",
            "--disable-extensions",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--mute-audio",
            "--hide-scrollbars",
            "--window-size=1400,900",
        ])
        .arg(format!("--user-data-dir={}", profile.path().display()))
        .arg("about:blank")
        .stdin(Stdio::null())
        .stdout(log.try_clone().unwrap())
        .stderr(log)
        .process_group(0);
        let (r, w) = (cmd_read.as_raw_fd(), out_write.as_raw_fd());
        // SAFETY: only async-signal-safe calls between fork and exec.
        unsafe {
            cmd.pre_exec(move || {
                // Move both ends above 4 first, so that dup2 onto 3 and 4
                // cannot clobber one of them.
                let r2 = libc::fcntl(r, libc::F_DUPFD, 10);
                let w2 = libc::fcntl(w, libc::F_DUPFD, 10);
                if r2 < 0 || w2 < 0 || libc::dup2(r2, 3) < 0 || libc::dup2(w2, 4) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {}: {e}", bin.display()));
        drop(cmd_read);
        drop(out_write);
        let pending: Pending = Arc::default();
        let errors: Errors = Arc::default();
        {
            let pending = pending.clone();
            let errors = errors.clone();
            let from_chrome = std::fs::File::from(out_read);
            std::thread::spawn(move || read_loop(from_chrome, pending, errors));
        }
        Some(Browser {
            child,
            to_chrome: Mutex::new(std::fs::File::from(cmd_write)),
            next_id: AtomicU64::new(1),
            pending,
            errors,
            _profile: profile,
        })
    }

    /// Send one command (to a page's session, or to the browser) and wait
    /// for its answer.
    pub async fn call(&self, session: Option<&str>, method: &str, params: Value) -> Value {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let mut msg = json!({ "id": id, "method": method, "params": params });
        if let Some(s) = session {
            msg["sessionId"] = json!(s);
        }
        let (tx, rx) = oneshot::channel();
        self.pending.lock().unwrap().insert(id, tx);
        {
            let mut w = self.to_chrome.lock().unwrap();
            let mut bytes = serde_json::to_vec(&msg).unwrap();
            bytes.push(0);
            w.write_all(&bytes)
                .unwrap_or_else(|e| panic!("chromium went away ({method}): {e}"));
        }
        match tokio::time::timeout(Duration::from_secs(60), rx).await {
            Ok(Ok(Ok(v))) => v,
            Ok(Ok(Err(e))) => panic!("{method}: {e}"),
            Ok(Err(_)) => panic!("{method}: chromium closed the pipe"),
            Err(_) => panic!("{method}: no answer in 60 s"),
        }
    }

    /// A new tab, 1400×900.
    pub async fn new_page(&self) -> Page<'_> {
        let t = self
            .call(None, "Target.createTarget", json!({ "url": "about:blank" }))
            .await;
        let target = t["targetId"].as_str().unwrap().to_string();
        let a = self
            .call(
                None,
                "Target.attachToTarget",
                json!({ "targetId": target, "flatten": true }),
            )
            .await;
        let session = a["sessionId"].as_str().unwrap().to_string();
        let p = Page {
            browser: self,
            session,
        };
        p.call("Page.enable", json!({})).await;
        p.call("Runtime.enable", json!({})).await;
        p.call(
            "Emulation.setDeviceMetricsOverride",
            json!({ "width": 1400, "height": 900, "deviceScaleFactor": 1, "mobile": false }),
        )
        .await;
        p
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        let pgid = nix::unistd::Pid::from_raw(self.child.id() as i32);
        let _ = nix::sys::signal::killpg(pgid, nix::sys::signal::Signal::SIGKILL);
        let _ = self.child.wait();
    }
}

/// Answers go to their waiter; exceptions and console errors are kept.
fn read_loop(from_chrome: std::fs::File, pending: Pending, errors: Errors) {
    let mut r = BufReader::new(from_chrome);
    let mut buf = Vec::new();
    loop {
        buf.clear();
        match r.read_until(0, &mut buf) {
            Ok(0) | Err(_) => break,
            Ok(_) => {}
        }
        if buf.last() == Some(&0) {
            buf.pop();
        }
        let Ok(v) = serde_json::from_slice::<Value>(&buf) else {
            continue;
        };
        if let Some(id) = v.get("id").and_then(Value::as_u64) {
            if let Some(tx) = pending.lock().unwrap().remove(&id) {
                let res = match v.get("error") {
                    Some(e) => Err(e.to_string()),
                    None => Ok(v.get("result").cloned().unwrap_or(Value::Null)),
                };
                let _ = tx.send(res);
            }
            continue;
        }
        let session = v["sessionId"].as_str().unwrap_or("").to_string();
        match v["method"].as_str() {
            Some("Runtime.exceptionThrown") => {
                let d = &v["params"]["exceptionDetails"];
                let text = d["exception"]["description"]
                    .as_str()
                    .or_else(|| d["text"].as_str())
                    .unwrap_or("exception")
                    .to_string();
                errors.lock().unwrap().push((session, text));
            }
            Some("Runtime.consoleAPICalled") if v["params"]["type"] == "error" => {
                errors
                    .lock()
                    .unwrap()
                    .push((session, format!("console.error: {}", v["params"]["args"])));
            }
            _ => {}
        }
    }
    // Wake every waiter: the browser is gone.
    pending.lock().unwrap().clear();
}

/// One tab.
pub struct Page<'a> {
    browser: &'a Browser,
    session: String,
}

impl Page<'_> {
    pub async fn call(&self, method: &str, params: Value) -> Value {
        self.browser.call(Some(&self.session), method, params).await
    }

    /// Open `url` and wait for the document to be loaded.
    pub async fn goto(&self, url: &str) {
        let r = self.call("Page.navigate", json!({ "url": url })).await;
        if let Some(e) = r.get("errorText").and_then(Value::as_str) {
            panic!("navigating to {url}: {e}");
        }
        self.wait(
            &format!("{url} to load"),
            Duration::from_secs(20),
            "document.readyState === 'complete' && location.href !== 'about:blank'",
        )
        .await;
    }

    /// The value of a JavaScript expression (promises awaited). An
    /// exception in it fails the test.
    pub async fn eval(&self, expr: &str) -> Value {
        let r = self
            .call(
                "Runtime.evaluate",
                json!({ "expression": expr, "returnByValue": true, "awaitPromise": true }),
            )
            .await;
        if let Some(e) = r.get("exceptionDetails") {
            panic!("evaluating `{expr}`: {e}");
        }
        r["result"]["value"].clone()
    }

    /// Poll `expr` until it is truthy (its value), or fail after `timeout`.
    pub async fn wait(&self, what: &str, timeout: Duration, expr: &str) -> Value {
        let deadline = Instant::now() + timeout;
        let wrapped =
            format!("(() => {{ try {{ return ({expr}); }} catch (e) {{ return null; }} }})()");
        loop {
            let v = self.eval(&wrapped).await;
            let truthy = match &v {
                Value::Null => false,
                Value::Bool(b) => *b,
                Value::Number(n) => n.as_f64() != Some(0.0),
                Value::String(s) => !s.is_empty(),
                _ => true,
            };
            if truthy {
                return v;
            }
            if Instant::now() > deadline {
                let body = self
                    .eval("document.body ? document.body.innerText.slice(0, 3000) : ''")
                    .await;
                panic!(
                    "timed out after {timeout:?} waiting for {what} (`{expr}`); the page shows:\n{}",
                    body.as_str().unwrap_or("")
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// A PNG of the viewport.
    pub async fn screenshot(&self, path: &Path) {
        let r = self
            .call("Page.captureScreenshot", json!({ "format": "png" }))
            .await;
        let png = base64::engine::general_purpose::STANDARD
            .decode(r["data"].as_str().unwrap())
            .unwrap();
        if let Some(d) = path.parent() {
            std::fs::create_dir_all(d).unwrap();
        }
        std::fs::write(path, png).unwrap();
    }

    /// Exceptions thrown (and console errors logged) in this page so far.
    pub fn errors(&self) -> Vec<String> {
        self.browser
            .errors
            .lock()
            .unwrap()
            .iter()
            .filter(|(s, _)| *s == self.session)
            .map(|(_, e)| e.clone())
            .collect()
    }
}
