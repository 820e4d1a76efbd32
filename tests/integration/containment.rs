//! Issue 9: nothing a task starts outlives its attempt (setsid escapees on
//! a normal exit, timeout, cancel, and a worker SIGKILL followed by a
//! restart), the restart sweep leaves strangers alone, the task user runs
//! inside its cgroup with limits, the worker's token is out of a task's
//! reach, live output is bounded and replayable, and a program that can
//! never start is final at once.
//!
//! These need root and a writable cgroup tree (the CI machine has both:
//! cgroup v1, root); they fail, not skip, without them.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use jetworker::internals::ProcessRunner;
use jetworker::protocol::Status;

use crate::runner_ctx::{context, task, RunTask};
use crate::util::*;

const T: Duration = Duration::from_secs(30);

fn require_root_and_cgroups() {
    assert!(
        nix::unistd::geteuid().is_root(),
        "containment tests need root (CI runs them as root)"
    );
    if let Err(why) = jetworker::internals::Cgroups::detect() {
        panic!("containment tests need a writable cgroup tree: {why}");
    }
}

/// A pid written by a task into `path`.
async fn read_pid(path: &Path) -> i32 {
    wait_for(T, "the task to write its pid", || async {
        std::fs::read_to_string(path)
            .ok()
            .and_then(|s| s.trim().parse::<i32>().ok())
    })
    .await
}

async fn gone(pid: i32, what: &str) {
    wait_for(Duration::from_secs(10), what, || async {
        (!pid_alive(pid)).then_some(())
    })
    .await;
}

/// A `setsid` escapee that writes its pid to `file`, then `rest`.
fn escape_script(file: &Path, rest: &str) -> String {
    format!(
        "setsid sh -c 'echo $$ > {}; exec sleep 100000' </dev/null >/dev/null 2>&1 & {rest}",
        file.display()
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn setsid_escapees_die_with_their_attempt() {
    require_root_and_cgroups();
    let srv = NatsServer::start();
    let _w = InProcWorker::start(|c| c.kill_grace = Duration::from_secs(1), &srv.url());
    let js = srv.js().await;
    let dir = tempfile::tempdir().unwrap();
    let cases = [
        ("esc-exit", "sleep 0.5; exit 0", Status::Success),
        ("esc-timeout", "sleep 600", Status::Timeout),
        ("esc-cancel", "sleep 600", Status::Cancelled),
    ];
    for (id, rest, _) in &cases {
        let file = dir.path().join(id);
        let timeout = if *id == "esc-timeout" { "3s" } else { "60s" };
        let json = serde_json::json!({
            "id": id, "type": "shell", "timeout": timeout,
            "retry": {"max_attempts": 1},
            "payload": escape_script(&file, rest),
        });
        publish_task(&js, "default", &json.to_string()).await;
    }
    let mut pids = Vec::new();
    for (id, _, _) in &cases {
        pids.push(read_pid(&dir.path().join(id)).await);
    }
    let kv = wait_for(T, "cancel bucket", || async {
        js.get_key_value("cancel").await.ok()
    })
    .await;
    kv.put("esc-cancel", "test".into()).await.unwrap();
    for ((id, _, status), pid) in cases.iter().zip(pids) {
        let r = final_result(&js, id, T).await;
        assert_eq!(r.status, *status, "{r:?}");
        gone(pid, &format!("the setsid escapee of {id} to die")).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn escapees_die_after_worker_sigkill_and_restart() {
    require_root_and_cgroups();
    let srv = NatsServer::start();
    let state = tempfile::tempdir().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let mut w = ProcWorker::start_in(&srv.url(), state.path(), &[]);
    let js = srv.js().await;
    let file = dir.path().join("p");
    let json = serde_json::json!({
        "id": "esc-crash", "type": "shell",
        "payload": escape_script(&file, "sleep 600"),
    });
    publish_task(&js, "default", &json.to_string()).await;
    let pid = read_pid(&file).await;
    // Kill the worker and its watchdog together, so only the restart sweep
    // is left to find the escapee.
    let watchdog = children_of(w.pid())
        .into_iter()
        .find(|p| cmdline(*p).contains("jetworker-watchdog"))
        .expect("the worker has a watchdog");
    let _ = nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(watchdog),
        nix::sys::signal::Signal::SIGKILL,
    );
    let dead_pid = w.pid();
    w.kill();
    assert!(pid_alive(pid), "nothing but the sweep should kill it");
    let work = state.path().join("work");
    let left = || {
        std::fs::read_dir(&work)
            .unwrap()
            .flatten()
            .filter(|e| {
                let name = e.file_name();
                name.to_string_lossy()
                    .starts_with(&format!("w-{dead_pid}-"))
            })
            .count()
    };
    assert_eq!(left(), 1, "the crashed attempt's working directory");
    let _w2 = ProcWorker::start_in(&srv.url(), state.path(), &[]);
    gone(pid, "the escapee to die when the worker starts again").await;
    wait_for(T, "the dead worker's working directories to go", || async {
        (left() == 0).then_some(())
    })
    .await;
}

fn children_of(pid: i32) -> Vec<i32> {
    let mut v = Vec::new();
    for t in std::fs::read_dir(format!("/proc/{pid}/task"))
        .unwrap()
        .flatten()
    {
        v.extend(
            std::fs::read_to_string(t.path().join("children"))
                .unwrap_or_default()
                .split_whitespace()
                .filter_map(|p| p.parse::<i32>().ok()),
        );
    }
    v
}

fn cmdline(pid: i32) -> String {
    std::fs::read(format!("/proc/{pid}/cmdline"))
        .map(|b| String::from_utf8_lossy(&b).replace('\0', " "))
        .unwrap_or_default()
}

fn start_time(pid: i32) -> u64 {
    jetworker::internals::start_time(pid as u32).expect("process exists")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restart_sweep_kills_only_provable_orphans() {
    // Without cgroups: only the journal of a dead worker is evidence.
    let state = tempfile::tempdir().unwrap();
    let spawn_group = || {
        use std::os::unix::process::CommandExt;
        Command::new("sleep")
            .arg("600")
            .process_group(0)
            .spawn()
            .unwrap()
    };
    let mut stranger = spawn_group();
    let mut orphan = spawn_group();
    // A worker that is gone: a finished process's pid.
    let mut dead = Command::new("true").spawn().unwrap();
    let dead_pid = dead.id();
    dead.wait().unwrap();
    let (s, o) = (stranger.id() as i32, orphan.id() as i32);
    std::fs::create_dir_all(state.path().join("pgroups")).unwrap();
    std::fs::write(
        state.path().join("pgroups").join(dead_pid.to_string()),
        // The stranger reused a recorded id, with another start time.
        format!("+{s} {}\n+{o} {}\n", start_time(s) + 1, start_time(o)),
    )
    .unwrap();
    let runner = ProcessRunner::new(
        vec!["bash".into(), "-c".into()],
        &[],
        None,
        state.path(),
        false,
    )
    .unwrap();
    assert_eq!(runner.reap_orphans(), 1);
    orphan.wait().unwrap();
    assert!(pid_alive(s), "the sweep killed a stranger");
    let _ = stranger.kill();
    let _ = stranger.wait();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn task_user_with_limits_runs_inside_its_cgroup() {
    require_root_and_cgroups();
    let srv = NatsServer::start();
    let w = InProcWorker::start(|c| c.task_user = Some("nobody".into()), &srv.url());
    let js = srv.js().await;
    publish_task(
        &js,
        "default",
        r#"{"id":"tu-lim","type":"shell","limits":{"memory":"128MiB","pids":64,"cpu_seconds":30},
            "payload":"id -u; touch here && echo writable; grep memory /proc/self/cgroup; echo; pwd"}"#,
    )
    .await;
    let r = final_result(&js, "tu-lim", T).await;
    assert_eq!(r.status, Status::Success, "{r:?}");
    let mut lines = r.output.lines();
    assert_eq!(lines.next(), Some("65534"), "{}", r.output);
    assert_eq!(lines.next(), Some("writable"), "{}", r.output);
    assert!(
        lines.next().is_some_and(|l| l.contains("/jetworker-")),
        "not in a task cgroup: {}",
        r.output
    );
    // The working directory is not under the worker's state directory,
    // which therefore needs no opening to the task user.
    let pwd = lines.nth(1).unwrap_or_default();
    assert!(
        !Path::new(pwd).starts_with(w.state.path()) && pwd.contains("jetworker-work-"),
        "working directory {pwd:?}"
    );
    // And without limits.
    publish_task(
        &js,
        "default",
        r#"{"id":"tu-nolim","type":"command","command":"id","args":["-u"]}"#,
    )
    .await;
    let r = final_result(&js, "tu-nolim", T).await;
    assert_eq!(r.status, Status::Success, "{r:?}");
    assert_eq!(r.output.trim(), "65534");
}

/// Start `jetworker run` as user nobody (uid 65534) on a token-protected
/// server, with `args` and `env`.
fn worker_as_nobody(url: &str, state: &Path, args: &[&str], env: &[(&str, &str)]) -> KillOnDrop {
    use std::os::unix::process::CommandExt;
    nix::unistd::chown(
        state,
        Some(nix::unistd::Uid::from_raw(65534)),
        Some(nix::unistd::Gid::from_raw(65534)),
    )
    .unwrap();
    let mut c = Command::new(jetworker_bin());
    c.args([
        "run",
        "--server",
        url,
        "--name",
        "nobody",
        "--heartbeat",
        "500ms",
    ])
    .arg("--state-dir")
    .arg(state)
    .args(args)
    .env_remove("JETWORKER_TOKEN")
    .envs(env.iter().copied())
    .env("LOG_LEVEL", "error")
    .current_dir("/")
    .stdin(Stdio::null())
    .uid(65534)
    .gid(65534);
    KillOnDrop(c.spawn().unwrap())
}

/// A child process killed when the test ends, passed or not.
struct KillOnDrop(std::process::Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_task_cannot_see_the_workers_token_under_proc() {
    assert!(
        nix::unistd::geteuid().is_root(),
        "needs root to run the worker as nobody"
    );
    let (a, b) = ("tok-", "9f3c1e77b2");
    let token = format!("{a}{b}");
    let srv = NatsServer::start_with(&[&format!("authorization {{ token: \"{token}\" }}")]);
    let client = async_nats::ConnectOptions::with_token(token.clone())
        .connect(srv.url())
        .await
        .unwrap();
    let js = async_nats::jetstream::new(client);
    // The token through the environment, then through the flag.
    let env_state = tempfile::tempdir().unwrap();
    let flag_state = tempfile::tempdir().unwrap();
    type Variant<'a> = (&'a str, &'a Path, Vec<&'a str>, Vec<(&'a str, &'a str)>);
    let variants: [Variant; 2] = [
        (
            "sec-env",
            env_state.path(),
            vec![],
            vec![("JETWORKER_TOKEN", token.as_str())],
        ),
        (
            "sec-flag",
            flag_state.path(),
            vec!["--token", token.as_str()],
            vec![],
        ),
    ];
    for (id, state, args, env) in variants {
        let w = worker_as_nobody(&srv.url(), state, &args, &env);
        wait_for(T, "the worker's streams", || async {
            js.get_stream("TASKS").await.ok()
        })
        .await;
        // The token in two halves, so that the script itself holds no copy.
        let script = format!(
            "A={a}; B={b}; id -u; cat /proc/$PPID/comm; \
             timeout 60 grep -rlaF -- \"$A$B\" /proc/$PPID/ 2>/dev/null | head -20; echo scanned"
        );
        let json = serde_json::json!({"id": id, "type": "shell", "payload": script});
        js.publish("tasks.default", json.to_string().into())
            .await
            .unwrap()
            .await
            .unwrap();
        let r = final_result(&js, id, Duration::from_secs(120)).await;
        drop(w);
        assert_eq!(r.status, Status::Success, "{r:?}");
        let lines: Vec<&str> = r.output.lines().collect();
        assert_eq!(
            lines.first(),
            Some(&"65534"),
            "the task runs as the worker's user: {}",
            r.output
        );
        assert!(
            lines.get(1).is_some_and(|l| l.starts_with("jetworker")),
            "$PPID is the worker: {}",
            r.output
        );
        assert_eq!(
            &lines[2..],
            &["scanned"],
            "{id}: the token is readable at these paths"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn live_output_is_coalesced_capped_and_the_result_complete() {
    use futures::StreamExt;
    let srv = NatsServer::start();
    let _w = InProcWorker::start(|_| {}, &srv.url());
    let client = srv.client().await;
    let js = srv.js().await;
    let mut sub = client.subscribe("logs.flood").await.unwrap();
    client.flush().await.unwrap();
    // 20 MB as fast as the pipe takes it, in 4 KiB writes.
    publish_task(
        &js,
        "default",
        r#"{"id":"flood","type":"shell","payload":"head -c 20000000 /dev/zero | tr '\\0' y"}"#,
    )
    .await;
    let r = final_result(&js, "flood", T).await;
    assert_eq!(r.status, Status::Success, "{r:?}");
    assert_eq!(r.output_bytes, 20_000_000, "the result counts every byte");
    let (mut msgs, mut bytes, mut skipped, mut eof) = (0u64, 0u64, 0u64, false);
    while let Ok(Some(m)) = tokio::time::timeout(Duration::from_secs(3), sub.next()).await {
        let h = |k: &str| {
            m.headers
                .as_ref()
                .and_then(|h| h.get(k))
                .map(|v| v.to_string())
        };
        match h("Jetworker-Stream").as_deref() {
            Some("eof") => {
                eof = true;
                break;
            }
            Some("skipped") => skipped += h("Jetworker-Skipped").unwrap().parse::<u64>().unwrap(),
            _ => {
                msgs += 1;
                bytes += m.payload.len() as u64;
            }
        }
    }
    assert!(eof, "the attempt's eof was published");
    assert!(skipped > 0, "the rate cap skipped nothing of 20 MB");
    assert_eq!(bytes + skipped, 20_000_000, "sent + skipped = all");
    // 512 KiB burst + 128 KiB/s over a few seconds, in chunks ≥ 4 KiB.
    assert!(bytes < 4_000_000, "{bytes} bytes live");
    assert!(
        msgs <= bytes / 4096 + 10,
        "{msgs} messages for {bytes} bytes: not coalesced"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_follower_gets_the_output_so_far_and_the_status() {
    let srv = NatsServer::start();
    let _w = InProcWorker::start(|_| {}, &srv.url());
    let js = srv.js().await;
    let dir = tempfile::tempdir().unwrap();
    let go = dir.path().join("go");
    let json = serde_json::json!({
        "id": "late", "type": "shell",
        "payload": format!("echo first; while [ ! -e {} ]; do sleep 0.05; done; echo second >&2", go.display()),
    });
    publish_task(&js, "default", &json.to_string()).await;
    // The first line is out (kept by the logs stream) before the follower starts.
    let logs = wait_for(T, "logs stream", || async {
        js.get_stream("LOGS").await.ok()
    })
    .await;
    wait_for(T, "the first line to be published", || async {
        logs.get_last_raw_message_by_subject("logs.late").await.ok()
    })
    .await;
    let f = Follower::attach(&srv.url(), "late").await;
    // Let the task finish once the follower is attached.
    std::fs::write(&go, "").unwrap();
    let (stdout, rest, code) = f.end().await;
    assert_eq!(stdout, "first\n", "stderr: {rest}");
    assert!(rest.contains("second\n"), "{rest}");
    assert!(rest.contains("late success"), "final status: {rest}");
    assert_eq!(code, Some(0));
}

/// `jetworker logs -f <id>`, past its ready line.
struct Follower {
    child: tokio::process::Child,
    err: tokio::io::BufReader<tokio::process::ChildStderr>,
}

impl Follower {
    async fn attach(url: &str, id: &str) -> Self {
        use tokio::io::AsyncBufReadExt;
        let mut child = tokio::process::Command::new(jetworker_bin())
            .args(["logs", "-f", id, "--server", url])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let mut err = tokio::io::BufReader::new(child.stderr.take().unwrap());
        let mut line = String::new();
        tokio::time::timeout(T, err.read_line(&mut line))
            .await
            .unwrap()
            .unwrap();
        assert!(
            line.contains(&format!("following {id}")),
            "ready line: {line:?}"
        );
        Follower { child, err }
    }

    /// Once it ends: its stdout, the rest of its stderr, its exit code.
    async fn end(mut self) -> (String, String, Option<i32>) {
        let mut rest = String::new();
        tokio::time::timeout(
            T,
            tokio::io::AsyncReadExt::read_to_string(&mut self.err, &mut rest),
        )
        .await
        .unwrap()
        .unwrap();
        let out = tokio::time::timeout(T, self.child.wait_with_output())
            .await
            .unwrap()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        (stdout, rest, out.status.code())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_program_that_cannot_start_is_permanent() {
    let state = tempfile::tempdir().unwrap();
    let runner = ProcessRunner::new(
        vec!["bash".into(), "-c".into()],
        &[],
        None,
        state.path(),
        true,
    )
    .unwrap();
    for json in [
        r#"{"type":"command","command":"/no/such/binary"}"#,
        r#"{"type":"command","command":"no-such-program-jw"}"#,
        r#"{"type":"command","command":"/etc/passwd"}"#,
    ] {
        let o = runner.run_task(context(task(json), T)).await;
        assert_eq!(o.status, Status::Failed, "{o:?}");
        assert!(o.permanent, "{json}: {o:?}");
    }
    let o = runner
        .run_task(context(task(r#"{"type":"command","command":"false"}"#), T))
        .await;
    assert!(!o.permanent, "an exit code is not permanent: {o:?}");
    runner.cleanup();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn short_attempts_stay_off_the_live_stream_and_followers_print_their_records() {
    let srv = NatsServer::start();
    let _w = InProcWorker::start(|_| {}, &srv.url());
    let js = srv.js().await;
    // Attached before the task exists: it sees every attempt as it ends.
    let f = Follower::attach(&srv.url(), "quick").await;
    // Two attempts that end at once, each with a line of output.
    let json = serde_json::json!({
        "id": "quick", "type": "shell", "payload": "echo out-$ATTEMPT; exit 3",
        "retry": {"max_attempts": 2, "backoff": "200ms"},
    });
    publish_task(&js, "default", &json.to_string()).await;
    let (stdout, rest, code) = f.end().await;
    assert_eq!(stdout, "out-1\nout-2\n", "stderr: {rest}");
    assert!(rest.contains("a retry follows"), "{rest}");
    assert!(rest.contains("attempt 2"), "{rest}");
    assert!(rest.contains("quick failed"), "final status: {rest}");
    assert_eq!(code, Some(1));

    // Each attempt's record says it never went live, and nothing did.
    let results = all_results(&js, "quick").await;
    assert_eq!(results.len(), 2, "{results:?}");
    assert!(results.iter().all(|r| !r.live), "{results:?}");
    let logs = js.get_stream("LOGS").await.unwrap();
    assert!(
        logs.get_last_raw_message_by_subject("logs.quick")
            .await
            .is_err(),
        "a short attempt published on logs.quick"
    );

    // An attempt that outlives the first flush goes live, ends with its
    // eof, and its record says nothing (`live` absent means true).
    let json = serde_json::json!({
        "id": "slow", "type": "shell", "payload": "echo a; sleep 0.4; echo b",
    });
    publish_task(&js, "default", &json.to_string()).await;
    let r = final_result(&js, "slow", T).await;
    assert_eq!(r.status, Status::Success);
    assert!(r.live, "{r:?}");
    let raw = js
        .get_stream("RESULTS")
        .await
        .unwrap()
        .direct_get_last_for_subject("results.slow")
        .await
        .unwrap();
    assert!(
        !String::from_utf8_lossy(&raw.payload).contains("\"live\""),
        "a live attempt's record carries no `live`"
    );
    let last = logs
        .get_last_raw_message_by_subject("logs.slow")
        .await
        .expect("the live attempt published on logs.slow");
    assert_eq!(
        last.headers.get("Jetworker-Stream").map(|v| v.as_str()),
        Some("eof"),
        "the live stream ends with the attempt's eof"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn working_directories_are_reused_only_empty_and_as_made() {
    require_root_and_cgroups();
    let srv = NatsServer::start();
    let w = InProcWorker::start(|c| c.slots = 1, &srv.url());
    let js = srv.js().await;
    let run = |id: &'static str, script: &'static str| {
        let js = js.clone();
        async move {
            let json = serde_json::json!({"id": id, "type": "shell", "payload": script});
            publish_task(&js, "default", &json.to_string()).await;
            let r = final_result(&js, id, T).await;
            assert_eq!(r.status, Status::Success, "{id}: {r:?}");
            r.output
        }
    };
    // A task that leaves a file: its directory is removed, not reused.
    let a = run("wd-a", "touch left-behind; pwd").await;
    let a = a.trim().to_string();
    assert!(!Path::new(&a).exists(), "{a} kept with a file in it");
    // The next ones start empty; an empty directory is handed on.
    let b = run("wd-b", "ls -A; pwd").await;
    assert!(!b.contains("left-behind"), "{b}");
    let b = b.trim().to_string();
    assert!(b.starts_with(&w.state.path().display().to_string()), "{b}");
    let c = run("wd-c", "ls -A; pwd; chmod 755 .").await;
    assert_eq!(
        c.trim(),
        b,
        "an empty directory is reused by the next attempt"
    );
    // One whose mode the task changed is not handed on.
    assert!(!Path::new(&b).exists(), "{b} kept after chmod");
    let d = run("wd-d", "ls -A; stat -c %a .").await;
    assert_eq!(d.trim(), "700", "a fresh directory, mode 0700");
}
