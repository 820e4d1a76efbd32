//! The `shell` and `command` runners: a child process in its own group, in a
//! fresh working directory (removed afterwards), with a scrubbed
//! environment, output captured while it streams, and the whole group
//! killed on timeout, cancel, or when the main process exits (so that
//! background children never outlive their attempt).

use std::collections::BTreeMap;
use std::os::unix::process::ExitStatusExt;
use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use nix::sys::signal::Signal;
use tokio::io::AsyncReadExt;
use tokio::time::{sleep_until, Instant};

use super::{timeout_reason, Outcome, RunContext};
use crate::cgroup::Cgroups;
use crate::output::{OutputSink, StreamKind};
use crate::process::{self, ChildLimits, GroupRecords, TaskUser};
use crate::protocol::{Status, TaskKind};

/// How long to keep reading pipes after the group was killed, in case a
/// process that left the group still holds them.
const PIPE_DRAIN: Duration = Duration::from_secs(2);

/// Runs `shell` and `command` tasks.
pub struct ProcessRunner {
    /// Shell program and flags (`bash -c`).
    shell: Vec<String>,
    /// PATH, LANG and the pass-through variables, read once at start-up.
    base_env: BTreeMap<String, String>,
    user: Option<TaskUser>,
    /// Where per-task cgroups go, if the tree is writable.
    cgroups: Option<Cgroups>,
    /// Parent of the per-task working directories.
    work_root: PathBuf,
    records: GroupRecords,
}

impl ProcessRunner {
    pub fn new(
        shell: Vec<String>,
        pass_env: &[String],
        user: Option<TaskUser>,
        state_dir: &std::path::Path,
        use_cgroups: bool,
    ) -> std::io::Result<Self> {
        let work_root = state_dir.join("work");
        std::fs::create_dir_all(&work_root)?;
        if user.is_some() {
            // The task user must be able to reach its own working directory
            // (owned by it) without reading anything else of the worker's.
            use std::os::unix::fs::PermissionsExt;
            for d in [state_dir, work_root.as_path()] {
                let mut p = std::fs::metadata(d)?.permissions();
                p.set_mode(p.mode() | 0o111);
                std::fs::set_permissions(d, p)?;
            }
        }
        let mut base_env = BTreeMap::new();
        base_env.insert(
            "PATH".to_string(),
            std::env::var("PATH").unwrap_or_else(|_| "/usr/local/bin:/usr/bin:/bin".into()),
        );
        base_env.insert(
            "LANG".to_string(),
            std::env::var("LANG").unwrap_or_else(|_| "C.UTF-8".into()),
        );
        for k in pass_env {
            if let Ok(v) = std::env::var(k) {
                base_env.insert(k.clone(), v);
            }
        }
        let cgroups = if use_cgroups {
            match Cgroups::detect() {
                Ok(c) => {
                    tracing::info!(?c, "per-task cgroups enabled");
                    Some(c)
                }
                Err(why) => {
                    tracing::info!("per-task cgroups unavailable ({why}); limits use rlimits only");
                    None
                }
            }
        } else {
            None
        };
        Ok(ProcessRunner {
            shell,
            base_env,
            user,
            cgroups,
            work_root,
            records: GroupRecords::new(state_dir)?,
        })
    }

    /// Kill process groups (and cgroups) left by an earlier life of this
    /// worker.
    pub fn reap_orphans(&self) -> usize {
        self.records.reap_orphans() + self.cgroups.as_ref().map(|c| c.reap_stale()).unwrap_or(0)
    }

    /// Remove what this runner made outside the state directory.
    pub fn cleanup(&self) {
        if let Some(c) = &self.cgroups {
            c.cleanup();
        }
    }

    pub async fn run(&self, ctx: RunContext) -> Outcome {
        let workdir = match tempfile::Builder::new()
            .prefix(&format!("{}-", ctx.task.id))
            .tempdir_in(&self.work_root)
        {
            Ok(d) => d,
            Err(e) => return Outcome::failed(format!("cannot create working directory: {e}")),
        };
        if let Some(u) = self.user {
            if let Err(e) = nix::unistd::chown(
                workdir.path(),
                Some(nix::unistd::Uid::from_raw(u.uid)),
                Some(nix::unistd::Gid::from_raw(u.gid)),
            ) {
                return Outcome::failed(format!(
                    "cannot hand the working directory to the task user: {e}"
                ));
            }
        }
        let (program, args): (String, Vec<String>) = match &ctx.task.kind {
            TaskKind::Shell { script } => {
                let mut a: Vec<String> = self.shell[1..].to_vec();
                a.push(script.clone());
                (self.shell[0].clone(), a)
            }
            TaskKind::Command { program, args } => (program.clone(), args.clone()),
            _ => return Outcome::failed("internal error: not a process task"),
        };
        let mut cmd = tokio::process::Command::new(&program);
        cmd.args(&args)
            .env_clear()
            .envs(&self.base_env)
            .env("HOME", workdir.path())
            .env("TMPDIR", workdir.path())
            .envs(&ctx.env)
            .current_dir(workdir.path())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        let mut limits = ChildLimits::from(&ctx.task.limits);
        let cgroup = match &self.cgroups {
            Some(c) if Cgroups::wanted(&ctx.task.limits) => {
                let name = format!("{}-{}-{}", ctx.task.id, ctx.attempt, std::process::id());
                match c.create(&name, &ctx.task.limits) {
                    Ok(cg) => Some(cg),
                    Err(e) => {
                        return Outcome::failed(format!("cannot create the task's cgroup: {e}"))
                    }
                }
            }
            _ => None,
        };
        if cgroup.is_some() {
            // The cgroup bounds the whole tree; per-process rlimits would only
            // get in the way (RLIMIT_AS breaks runtimes that reserve memory).
            limits.memory = None;
            limits.pids = None;
        }
        let join = cgroup.as_ref().map(|c| c.join_files()).unwrap_or_default();
        process::configure(&mut cmd, self.user, limits, join);

        let mut child = match cmd.spawn() {
            Ok(c) => c,
            Err(e) => {
                if let Some(cg) = &cgroup {
                    cg.remove();
                }
                return Outcome::failed(format!("cannot start `{program}`: {e}"));
            }
        };
        let pgid = child.id().unwrap_or(0);
        if pgid > 0 {
            self.records.add(pgid, &ctx.task.id);
        }
        let mut sink = OutputSink::new(ctx.output_cap, ctx.live.clone());
        let mut stdout = child.stdout.take();
        let mut stderr = child.stderr.take();
        let mut obuf = vec![0u8; 64 * 1024];
        let mut ebuf = vec![0u8; 64 * 1024];

        let start = Instant::now();
        let deadline = start + ctx.timeout;
        // "Whole attempt, kill included": the polite signal comes early
        // enough that the kill still lands within the timeout.
        let grace = ctx.kill_grace.min(ctx.timeout / 10);
        let term_at = deadline - grace;
        let mut timed_out = false;
        let mut stopped = false;
        let mut kill_at: Option<Instant> = None;
        let mut killed = false;
        let mut status = None;
        let mut drain_until: Option<Instant> = None;
        let far = start + Duration::from_secs(10 * 365 * 24 * 3600);

        loop {
            if status.is_some() && stdout.is_none() && stderr.is_none() {
                break;
            }
            tokio::select! {
                r = read_some(&mut stdout, &mut obuf), if stdout.is_some() => match r {
                    Some(n) => sink.push(StreamKind::Stdout, &obuf[..n]).await,
                    None => stdout = None,
                },
                r = read_some(&mut stderr, &mut ebuf), if stderr.is_some() => match r {
                    Some(n) => sink.push(StreamKind::Stderr, &ebuf[..n]).await,
                    None => stderr = None,
                },
                st = child.wait(), if status.is_none() => {
                    status = Some(st);
                    // Background children die with the attempt.
                    if pgid > 0 {
                        process::signal_group(pgid, Signal::SIGKILL);
                    }
                    drain_until = Some(Instant::now() + PIPE_DRAIN);
                }
                _ = sleep_until(term_at), if status.is_none() && !timed_out && !stopped => {
                    timed_out = true;
                    process::signal_group(pgid, Signal::SIGTERM);
                    kill_at = Some(deadline);
                }
                _ = ctx.stop.fired(), if status.is_none() && !stopped && !timed_out => {
                    stopped = true;
                    process::signal_group(pgid, Signal::SIGTERM);
                    kill_at = Some(Instant::now() + ctx.kill_grace);
                }
                _ = sleep_until(kill_at.unwrap_or(far)), if kill_at.is_some() && !killed && status.is_none() => {
                    killed = true;
                    process::signal_group(pgid, Signal::SIGKILL);
                    let _ = child.start_kill();
                }
                _ = sleep_until(drain_until.unwrap_or(far)), if drain_until.is_some() => {
                    stdout = None;
                    stderr = None;
                }
            }
        }
        if pgid > 0 {
            self.records.remove(pgid);
        }
        let oom = match &cgroup {
            Some(cg) => {
                cg.kill_all();
                let oom = cg.oom_killed();
                cg.remove();
                oom
            }
            None => false,
        };
        drop(workdir);

        let output = sink.finish();
        let (exit_code, signal) = match &status {
            Some(Ok(s)) => (s.code(), s.signal()),
            _ => (None, None),
        };
        let signal_name = signal.map(process::signal_name);
        let (status, error) = if stopped {
            (Status::Cancelled, Some(ctx.stop.reason_text()))
        } else if timed_out {
            (Status::Timeout, Some(timeout_reason(ctx.timeout)))
        } else {
            match &status {
                Some(Ok(s)) if s.success() => (Status::Success, None),
                Some(Ok(_)) if oom => (
                    Status::Failed,
                    Some(format!(
                        "{}: memory limit {} exceeded (killed by the OOM killer)",
                        failure_reason(exit_code, signal, &ChildLimits::default()),
                        crate::protocol::format_size(ctx.task.limits.memory.unwrap_or(0))
                    )),
                ),
                Some(Ok(_)) => (
                    Status::Failed,
                    Some(failure_reason(exit_code, signal, &limits)),
                ),
                Some(Err(e)) => (
                    Status::Failed,
                    Some(format!("cannot wait for the process: {e}")),
                ),
                None => (Status::Failed, Some("process state unknown".into())),
            }
        };
        Outcome {
            status,
            exit_code,
            signal: signal_name,
            http_status: None,
            output,
            error,
        }
    }
}

/// Words for a non-zero exit, naming a limit that probably caused it.
fn failure_reason(code: Option<i32>, signal: Option<i32>, limits: &ChildLimits) -> String {
    let base = match (code, signal) {
        (_, Some(s)) => format!("killed by {}", process::signal_name(s)),
        (Some(c), None) => format!("exit code {c}"),
        (None, None) => "failed".to_string(),
    };
    if signal == Some(libc::SIGXCPU)
        || (signal == Some(libc::SIGKILL) && limits.cpu_seconds.is_some())
    {
        if let Some(c) = limits.cpu_seconds {
            return format!("{base}: CPU time limit ({c}s) exceeded");
        }
    }
    if let Some(m) = limits.memory {
        return format!(
            "{base} (memory limit {} may have been exceeded)",
            crate::protocol::format_size(m)
        );
    }
    base
}

async fn read_some<R: AsyncReadExt + Unpin>(r: &mut Option<R>, buf: &mut [u8]) -> Option<usize> {
    match r {
        Some(r) => match r.read(buf).await {
            Ok(0) | Err(_) => None,
            Ok(n) => Some(n),
        },
        None => std::future::pending().await,
    }
}
