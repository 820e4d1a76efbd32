//! Test harness: a private nats-server per test (free port, temporary store,
//! killed and removed on drop), workers in-process or as the built binary,
//! and helpers that poll for conditions instead of sleeping.

#![allow(dead_code)]

use std::future::Future;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use async_nats::jetstream;
use bytes::Bytes;
use jetworker::config::WorkerConfig;
use jetworker::protocol::{Names, TaskResult};
use tokio_util::sync::CancellationToken;

/// The nats-server binary: `NATS_SERVER_BIN`, else `nats-server` on PATH.
pub fn nats_server_bin() -> PathBuf {
    std::env::var_os("NATS_SERVER_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("nats-server"))
}

/// A private nats-server with JetStream.
pub struct NatsServer {
    child: Option<Child>,
    pub port: u16,
    store: tempfile::TempDir,
    extra: Vec<String>,
    /// Whether the config enables JetStream (see `set_jetstream`).
    jetstream: bool,
}

impl NatsServer {
    pub fn start() -> Self {
        Self::start_with(&[])
    }

    /// Start with extra config lines (e.g. `max_payload: 4MB`).
    pub fn start_with(config_lines: &[&str]) -> Self {
        let store = tempfile::tempdir().unwrap();
        let mut s = NatsServer {
            child: None,
            port: 0,
            store,
            extra: config_lines.iter().map(|s| s.to_string()).collect(),
            jetstream: true,
        };
        s.spawn();
        s
    }

    /// Start the server. The first time it picks its own port (`-1`) and
    /// reports it in a ports file, so that parallel tests never race for
    /// one; a restart reuses that port.
    fn spawn(&mut self) {
        let conf = self.store.path().join("server.conf");
        let ports_dir = self.store.path().join("ports");
        let _ = std::fs::remove_dir_all(&ports_dir);
        std::fs::create_dir_all(&ports_dir).unwrap();
        let port = if self.port == 0 {
            "-1".to_string()
        } else {
            self.port.to_string()
        };
        let mut text = format!(
            "listen: 127.0.0.1:{port}\nports_file_dir: \"{}\"\n",
            ports_dir.display()
        );
        if self.jetstream {
            text.push_str(&format!(
                "jetstream {{ store_dir: \"{}\" }}\n",
                self.store.path().join("js").display()
            ));
        }
        for l in &self.extra {
            text.push_str(l);
            text.push('\n');
        }
        std::fs::write(&conf, text).unwrap();
        let mut child = Command::new(nats_server_bin())
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
        // The ports file appears once the server listens.
        let port = loop {
            if let Some(st) = child.try_wait().unwrap() {
                panic!("nats-server exited at start ({st}); port {port}");
            }
            let found = std::fs::read_dir(&ports_dir).ok().and_then(|rd| {
                rd.flatten().find_map(|e| {
                    let text = std::fs::read_to_string(e.path()).ok()?;
                    let v: serde_json::Value = serde_json::from_str(&text).ok()?;
                    let url = v.get("nats")?.as_array()?.first()?.as_str()?.to_string();
                    url.rsplit(':').next()?.parse::<u16>().ok()
                })
            });
            if let Some(p) = found {
                break p;
            }
            assert!(Instant::now() < deadline, "nats-server did not start");
            std::thread::sleep(Duration::from_millis(10));
        };
        self.port = port;
        self.child = Some(child);
        while std::net::TcpStream::connect(("127.0.0.1", self.port)).is_err() {
            assert!(
                Instant::now() < deadline,
                "nats-server did not accept on port {}",
                self.port
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// A server without JetStream (a broker not ready for workers yet).
    pub fn start_without_jetstream() -> Self {
        let mut s = NatsServer {
            child: None,
            port: 0,
            store: tempfile::tempdir().unwrap(),
            extra: Vec::new(),
            jetstream: false,
        };
        s.spawn();
        s
    }

    /// Turn JetStream on or off for the next (re)start.
    pub fn set_jetstream(&mut self, on: bool) {
        self.jetstream = on;
    }

    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    /// The server's process id while it runs (benches read its CPU and
    /// memory from /proc).
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Kill the server (SIGKILL), keeping its store.
    pub fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Start again on the same port with the same store.
    pub fn restart(&mut self) {
        self.stop();
        self.spawn();
    }

    pub async fn client(&self) -> async_nats::Client {
        async_nats::connect(self.url()).await.unwrap()
    }

    pub async fn js(&self) -> jetstream::Context {
        jetstream::new(self.client().await)
    }
}

impl Drop for NatsServer {
    fn drop(&mut self) {
        self.stop();
    }
}

/// A free loopback address (for a worker's metrics endpoint).
pub fn free_addr() -> std::net::SocketAddr {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
}

/// GET `path` over HTTP/1.0: the status code and the body (`None`: no
/// answer within 2 s).
pub async fn http_get(addr: std::net::SocketAddr, path: &str) -> Option<(u16, String)> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let connect = tokio::net::TcpStream::connect(addr);
    let mut s = tokio::time::timeout(Duration::from_secs(2), connect)
        .await
        .ok()?
        .ok()?;
    s.write_all(format!("GET {path} HTTP/1.0\r\nHost: x\r\n\r\n").as_bytes())
        .await
        .ok()?;
    let mut out = String::new();
    tokio::time::timeout(Duration::from_secs(2), s.read_to_string(&mut out))
        .await
        .ok()?
        .ok()?;
    let code = out.split_whitespace().nth(1)?.parse().ok()?;
    let body = out.split_once("\r\n\r\n").map(|(_, b)| b.to_string())?;
    Some((code, body))
}

/// GET `path`: the status code only.
pub async fn http_status(addr: std::net::SocketAddr, path: &str) -> Option<u16> {
    http_get(addr, path).await.map(|(c, _)| c)
}

/// Poll `f` until it returns `Some`, or panic after `timeout` with `what`.
pub async fn wait_for<T, F, Fut>(timeout: Duration, what: &str, mut f: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = f().await {
            return v;
        }
        if Instant::now() > deadline {
            panic!("timed out after {timeout:?} waiting for {what}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A worker running in this process; stopped (drained) on drop.
pub struct InProcWorker {
    pub token: CancellationToken,
    pub handle: Option<tokio::task::JoinHandle<anyhow::Result<()>>>,
    pub state: tempfile::TempDir,
}

/// A worker config for tests: short heartbeats and timeouts.
pub fn test_config(url: &str, state: &Path) -> WorkerConfig {
    let mut c = WorkerConfig::for_server(url, state);
    c.slots = 4;
    c.heartbeat = Duration::from_millis(500);
    c.offline_after = Duration::from_secs(3);
    c.kill_grace = Duration::from_secs(2);
    c.drain_timeout = Duration::from_secs(10);
    c.name = "test".into();
    c
}

impl InProcWorker {
    pub fn start(cfg_fn: impl FnOnce(&mut WorkerConfig), url: &str) -> Self {
        let state = tempfile::tempdir().unwrap();
        let mut cfg = test_config(url, state.path());
        cfg_fn(&mut cfg);
        let token = CancellationToken::new();
        let handle = tokio::spawn(jetworker::worker::run(cfg, token.clone()));
        InProcWorker {
            token,
            handle: Some(handle),
            state,
        }
    }

    /// Ask it to shut down and wait for it to return.
    pub async fn shutdown(mut self) -> anyhow::Result<()> {
        self.token.cancel();
        self.handle.take().unwrap().await.unwrap()
    }
}

impl Drop for InProcWorker {
    fn drop(&mut self) {
        self.token.cancel();
        if let Some(h) = self.handle.take() {
            h.abort();
        }
    }
}

/// Environment and logging for [`ProcWorker::start_opts`].
#[derive(Debug, Default, Clone)]
pub struct ProcOpts {
    /// Extra environment variables (e.g. `JETWORKER_TEST_FAULT`).
    pub env: Vec<(String, String)>,
    /// Append stdout and stderr to this file instead of inheriting them.
    pub log: Option<PathBuf>,
    /// `LOG_LEVEL` (default: `TEST_LOG_LEVEL`, else `error`).
    pub log_level: Option<&'static str>,
}

/// A worker running as the built binary; SIGKILLed on drop.
pub struct ProcWorker {
    pub child: Child,
    pub state: PathBuf,
    _state_dir: Option<tempfile::TempDir>,
}

pub fn jetworker_bin() -> &'static str {
    env!("CARGO_BIN_EXE_jetworker")
}

impl ProcWorker {
    /// Start `jetworker run` with test-friendly timings and `extra` flags.
    pub fn start(url: &str, extra: &[&str]) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let state = dir.path().to_path_buf();
        let mut w = Self::start_in(url, &state, extra);
        w._state_dir = Some(dir);
        w
    }

    /// Start on a given state directory (to restart a worker on its state).
    pub fn start_in(url: &str, state: &Path, extra: &[&str]) -> Self {
        Self::start_opts(url, state, extra, &ProcOpts::default())
    }

    /// Start on a given state directory with extra environment and logging.
    pub fn start_opts(url: &str, state: &Path, extra: &[&str], opts: &ProcOpts) -> Self {
        let mut cmd = Command::new(jetworker_bin());
        cmd.args(["run", "--server", url, "--state-dir"])
            .arg(state)
            .args([
                "--heartbeat",
                "500ms",
                "--offline-after",
                "3s",
                "--kill-grace",
                "2s",
            ])
            .args(if extra.contains(&"--name") {
                &[][..]
            } else {
                &["--name", "proc"][..]
            })
            .args(extra)
            .env(
                "LOG_LEVEL",
                opts.log_level.map(str::to_string).unwrap_or_else(|| {
                    std::env::var("TEST_LOG_LEVEL").unwrap_or_else(|_| "error".into())
                }),
            )
            // Neither the tester's nats context nor their config file.
            .env("XDG_CONFIG_HOME", "/nonexistent-jetworker-test")
            .envs(opts.env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null());
        if let Some(log) = &opts.log {
            let f = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(log)
                .unwrap();
            cmd.stdout(f.try_clone().unwrap()).stderr(f);
        }
        ProcWorker {
            child: cmd.spawn().unwrap(),
            state: state.to_path_buf(),
            _state_dir: None,
        }
    }

    pub fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    pub fn signal(&self, sig: nix::sys::signal::Signal) {
        let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(self.pid()), sig);
    }

    /// SIGKILL and reap.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Wait for the process to exit; its exit code.
    pub async fn wait_exit(&mut self, timeout: Duration) -> Option<i32> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(st) = self.child.try_wait().unwrap() {
                return st.code();
            }
            if Instant::now() > deadline {
                return None;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

impl Drop for ProcWorker {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Worker processes, each on its own state directory, that a test
/// SIGKILLs and restarts in turn (soak and fault tests).
pub struct Fleet {
    url: String,
    flags: Vec<String>,
    states: Vec<tempfile::TempDir>,
    workers: Vec<ProcWorker>,
    /// SIGKILLs so far.
    pub kills: usize,
}

impl Fleet {
    /// `n` workers with `flags`.
    pub fn start(url: &str, n: usize, flags: &[&str]) -> Self {
        let states: Vec<tempfile::TempDir> = (0..n).map(|_| tempfile::tempdir().unwrap()).collect();
        let workers = states
            .iter()
            .map(|s| ProcWorker::start_in(url, s.path(), flags))
            .collect();
        Fleet {
            url: url.to_string(),
            flags: flags.iter().map(|f| f.to_string()).collect(),
            states,
            workers,
            kills: 0,
        }
    }

    /// SIGKILL the next worker in turn and start it again on its state
    /// directory (its outbox and journal are there).
    pub fn kill_next(&mut self) {
        let k = self.kills % self.workers.len();
        let flags: Vec<&str> = self.flags.iter().map(String::as_str).collect();
        self.workers[k].kill();
        self.workers[k] = ProcWorker::start_in(&self.url, self.states[k].path(), &flags);
        self.kills += 1;
    }
}

/// Publish a task (JSON text) to `tasks.<label>` and wait for the PubAck.
pub async fn publish_task(js: &jetstream::Context, label: &str, json: &str) -> u64 {
    publish_raw(
        js,
        &format!("tasks.{label}"),
        Bytes::from(json.to_string()),
        None,
    )
    .await
}

/// Publish bytes with an optional `Nats-Msg-Id`.
pub async fn publish_raw(
    js: &jetstream::Context,
    subject: &str,
    payload: Bytes,
    msg_id: Option<&str>,
) -> u64 {
    let mut m = jetstream::message::PublishMessage::build().payload(payload);
    if let Some(id) = msg_id {
        m = m.message_id(id);
    }
    // The stream exists once a worker has started; retry until it does.
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        match js.send_publish(subject.to_string(), m.clone()).await {
            Ok(ack) => match ack.await {
                Ok(a) => return a.sequence,
                Err(e) if Instant::now() < deadline => {
                    let _ = e;
                }
                Err(e) => panic!("publish to {subject}: {e}"),
            },
            Err(e) => panic!("publish to {subject}: {e}"),
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The last result stored for `id`, if any.
pub async fn last_result(js: &jetstream::Context, id: &str) -> Option<TaskResult> {
    let stream = js.get_stream("RESULTS").await.ok()?;
    let msg = stream
        .direct_get_last_for_subject(Names::default().result_subject(id))
        .await
        .ok()?;
    Some(serde_json::from_slice(&msg.payload).expect("result is valid JSON"))
}

/// Every result of an attempt stored for `id`, oldest first (without the
/// `running`/`queued` state records).
pub async fn all_results(js: &jetstream::Context, id: &str) -> Vec<TaskResult> {
    all_records(js, id)
        .await
        .into_iter()
        .filter(|r| !r.is_state())
        .collect()
}

/// Every record stored for `id` (states included), oldest first.
pub async fn all_records(js: &jetstream::Context, id: &str) -> Vec<TaskResult> {
    let Ok(stream) = js.get_stream("RESULTS").await else {
        return vec![];
    };
    let subject = Names::default().result_subject(id);
    let mut out = Vec::new();
    let mut seq = 0u64;
    while let Ok(m) = stream
        .direct_get_next_for_subject(subject.clone(), Some(seq + 1))
        .await
    {
        seq = m.sequence;
        out.push(serde_json::from_slice(&m.payload).unwrap());
    }
    out
}

/// Wait for the final result of `id`.
pub async fn final_result(js: &jetstream::Context, id: &str, timeout: Duration) -> TaskResult {
    wait_for(timeout, &format!("final result of {id}"), || async {
        last_result(js, id).await.filter(|r| r.is_final)
    })
    .await
}

/// The heartbeats in KV `workers` (`None` until the bucket exists).
pub async fn heartbeats(js: &jetstream::Context) -> Option<Vec<jetworker::protocol::Heartbeat>> {
    use futures::StreamExt;
    let kv = js.get_key_value("workers").await.ok()?;
    let keys: Vec<String> = kv
        .keys()
        .await
        .ok()?
        .filter_map(|k| async { k.ok() })
        .collect()
        .await;
    let mut out = Vec::new();
    for k in keys {
        if let Ok(Some(v)) = kv.get(&k).await {
            out.push(serde_json::from_slice(&v).expect("heartbeat is valid JSON"));
        }
    }
    Some(out)
}

/// Number of messages left in the TASKS stream.
pub async fn tasks_left(js: &jetstream::Context) -> u64 {
    let mut s = js.get_stream("TASKS").await.unwrap();
    s.info().await.unwrap().state.messages
}

/// Wait until the TASKS stream is empty: every task acked or terminated.
pub async fn queue_drained(js: &jetstream::Context, timeout: Duration, what: &str) {
    wait_for(timeout, what, || async {
        (tasks_left(js).await == 0).then_some(())
    })
    .await
}

/// Entries waiting in the outbox of a worker's state directory.
pub fn outbox_len(state: &Path) -> usize {
    std::fs::read_dir(state.join("outbox"))
        .map(|rd| {
            rd.flatten()
                .filter(|e| e.path().extension().is_some_and(|x| x == "msg"))
                .count()
        })
        .unwrap_or(0)
}

/// Whether a process with this pid exists (and is not a zombie).
pub fn pid_alive(pid: i32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(s) => !s
            .rsplit(')')
            .next()
            .unwrap_or("")
            .trim_start()
            .starts_with('Z'),
        Err(_) => false,
    }
}

/// The environment variable that turns every skipped test into a failure.
pub const NO_SKIP_ENV: &str = "JETWORKER_NO_SKIP";

/// A test whose prerequisite (Docker, docker-compose, busybox-static, root,
/// a writable cgroup tree, /proc/self/clear_refs) is missing prints
/// `SKIPPED: <why>` and returns. With `JETWORKER_NO_SKIP=1` (set by
/// `.ci/run`: CI has all of them) it fails instead, so that a test never
/// passes by skipping where it should run.
pub fn skip(why: &str) {
    if std::env::var(NO_SKIP_ENV).is_ok_and(|v| v == "1") {
        panic!("{why} ({NO_SKIP_ENV}=1: a missing prerequisite is a failure)");
    }
    eprintln!("SKIPPED: {why}");
}
