//! The `shell` and `command` runners: a child process in its own group and
//! (where the cgroup tree is writable) its own cgroup, in a fresh working
//! directory (reused by the next attempt when it is left empty), with a
//! scrubbed environment, output captured while it
//! streams, and everything it started killed when the attempt ends — on
//! timeout, cancel, or a normal exit of the main process (DESIGN.md
//! section 5, "No orphans"; how the process is spawned: [`crate::process`]).

use std::collections::BTreeMap;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use nix::sys::signal::Signal;
use tokio::io::AsyncReadExt;
use tokio::process::{Child, ChildStderr, ChildStdout};
use tokio::time::Instant;

use schemars::JsonSchema;
use serde::Deserialize;

use super::supervise::{self, Clock, OutputSource, Supervised};
use super::{fields_schema_of, Fields, Outcome, RunContext, Runner};
use crate::cgroup::{Cgroups, TaskCgroup};
use crate::output::{OutputSink, StreamKind};
use crate::process::{self, ChildLimits, ChildSetup, GroupJournal, TaskUser};
use crate::protocol::{Invalid, Status, Task};

/// How long to keep reading pipes after the group was killed, in case a
/// process that left the group still holds them.
const PIPE_DRAIN: Duration = Duration::from_secs(2);
/// Read buffer per pipe.
const PIPE_BUF: usize = 16 * 1024;
/// Empty working directories kept for the next attempts, at most.
const MAX_SPARE_DIRS: usize = 64;

/// What a process attempt runs.
#[derive(Debug, Clone, PartialEq)]
pub enum ProcessSpec {
    /// A script for the worker's shell (`shell`).
    Shell {
        /// The script.
        script: String,
    },
    /// A program, looked up on the task's PATH, with its arguments
    /// (`command`, and the types defined in config).
    Program {
        /// The program name or path.
        program: String,
        /// Its arguments.
        args: Vec<String>,
        /// Variables set on top of the task's environment.
        env: BTreeMap<String, String>,
    },
}

/// The fields of a `command` task.
#[derive(Debug, Deserialize, JsonSchema)]
#[schemars(title = "command")]
struct CommandFields {
    /// command: the program (a path, or a name looked up on PATH).
    command: Option<String>,
    /// command: arguments; container: overrides the image's CMD.
    args: Option<Vec<String>>,
}

/// Runs `command` tasks.
pub struct CommandRunner {
    process: Option<Arc<ProcessRunner>>,
}

impl CommandRunner {
    /// Command tasks run by `process`.
    pub(crate) fn new(process: Arc<ProcessRunner>) -> Self {
        CommandRunner {
            process: Some(process),
        }
    }

    /// Validation only (the CLI): running fails.
    pub(crate) fn validator() -> Self {
        CommandRunner { process: None }
    }
}

impl Runner for CommandRunner {
    type Spec = ProcessSpec;

    fn name(&self) -> &str {
        "command"
    }

    fn fields_schema(&self) -> serde_json::Value {
        fields_schema_of::<CommandFields>()
    }

    fn validate(&self, fields: &Fields, _task: &Task) -> Result<ProcessSpec, Invalid> {
        let f: CommandFields = fields.parse()?;
        let program = f
            .command
            .ok_or_else(|| Invalid::new("command", "missing (the program to run)"))?;
        if program.is_empty() || program.contains('\0') {
            return Err(Invalid::new("command", "must be a non-empty program name"));
        }
        let args = f.args.unwrap_or_default();
        if let Some(i) = args.iter().position(|a| a.contains('\0')) {
            return Err(Invalid::new(format!("args[{i}]"), "contains a NUL byte"));
        }
        Ok(ProcessSpec::Program {
            program,
            args,
            env: BTreeMap::new(),
        })
    }

    async fn run(&self, spec: &ProcessSpec, ctx: RunContext) -> Outcome {
        run_on(self.process.as_deref(), spec, ctx).await
    }
}

/// Run a process attempt on `process`, the runner of the shell, command
/// and config-defined types (`None`: a validation-only runner).
pub(crate) async fn run_on(
    process: Option<&ProcessRunner>,
    spec: &ProcessSpec,
    ctx: RunContext,
) -> Outcome {
    match process {
        Some(p) => p.run(spec, ctx).await,
        None => Outcome::validation_only(),
    }
}

/// Runs processes for `shell`, `command` and the types defined in config:
/// one per worker, shared by those runners.
pub struct ProcessRunner {
    /// Shell program (resolved) and flags (`bash -c`).
    shell: PathBuf,
    shell_args: Vec<String>,
    /// PATH, LANG and the pass-through variables, read once at start-up.
    base_env: BTreeMap<String, String>,
    user: Option<TaskUser>,
    /// Where per-attempt cgroups go, if the tree is writable.
    cgroups: Option<Cgroups>,
    /// Spawned process groups, kept only where there are no cgroups.
    journal: Option<GroupJournal>,
    /// Parent of the per-attempt working directories.
    work_root: PathBuf,
    state_dir: PathBuf,
    /// Makes working directory names unique within this worker.
    seq: AtomicU64,
    /// Working directories of finished attempts that ended contained (in
    /// a cgroup, emptied) and left them as they were made, empty: the next
    /// attempt takes one instead of a `mkdir` and an `rmdir` (on ext4 about
    /// a quarter of a millisecond of the worker's CPU per attempt).
    spare_dirs: std::sync::Mutex<Vec<PathBuf>>,
    /// Who owns a working directory as made (uid, gid): the task user, or
    /// this worker's effective ids.
    workdir_owner: (u32, u32),
}

/// Where task working directories go when tasks run as another user: a
/// root of their own, so the worker's state directory stays closed
/// (`<tmp>/jetworker-work-<worker uid>`, mode 0711, owned by the worker).
fn separate_work_root() -> std::io::Result<PathBuf> {
    use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
    let me = nix::unistd::geteuid().as_raw();
    let root = std::env::temp_dir().join(format!("jetworker-work-{me}"));
    match std::fs::DirBuilder::new().mode(0o711).create(&root) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(e),
    }
    // Someone else may have made it first (a shared /tmp): it must be a
    // real directory of ours, not a link.
    let m = std::fs::symlink_metadata(&root)?;
    if !m.is_dir() || m.uid() != me {
        return Err(std::io::Error::other(format!(
            "{} is not a directory owned by uid {me}",
            root.display()
        )));
    }
    std::fs::set_permissions(&root, std::fs::Permissions::from_mode(0o711))?;
    Ok(root)
}

impl ProcessRunner {
    /// Runs processes with `shell` (for shell tasks) and the worker's
    /// `pass_env`, as `user` if given, each in a fresh work directory (under
    /// `state_dir`, or a root of their own for another user) and, with
    /// `use_cgroups`, its own cgroup where the tree is writable.
    pub fn new(
        shell: Vec<String>,
        pass_env: &[String],
        user: Option<TaskUser>,
        state_dir: &Path,
        use_cgroups: bool,
    ) -> std::io::Result<Self> {
        let work_root = if user.is_some() {
            separate_work_root()?
        } else {
            let w = state_dir.join("work");
            std::fs::create_dir_all(&w)?;
            w
        };
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
        let (shell_prog, shell_args) = shell
            .split_first()
            .ok_or_else(|| std::io::Error::other("the shell setting is empty"))?;
        let shell_path = process::resolve_program(shell_prog, &base_env["PATH"])
            .map_err(|e| std::io::Error::other(format!("shell: {}", e.message)))?;
        let cgroups = if use_cgroups {
            match Cgroups::detect() {
                Ok(c) => Some(c),
                Err(why) => {
                    tracing::info!("per-task cgroups unavailable: {why}");
                    None
                }
            }
        } else {
            None
        };
        match &cgroups {
            Some(c) => tracing::info!(
                parents = ?c.parents(),
                "containment: every shell/command attempt runs in its own cgroup, emptied when it ends"
            ),
            None => tracing::warn!(
                "containment without cgroups: an attempt's process group is killed when it ends \
                 (and by the watchdog or the next start if the worker dies); processes that leave \
                 the group (setsid, daemonising) are NOT contained, and limits.memory/pids are \
                 per-process rlimits"
            ),
        }
        std::fs::create_dir_all(state_dir.join("pgroups"))?;
        let list = process::cgroup_list_path(state_dir);
        let parents: String = cgroups
            .iter()
            .flat_map(|c| c.parents())
            .map(|p| format!("{}\n", p.display()))
            .collect();
        std::fs::write(&list, parents)?;
        let journal = match cgroups {
            Some(_) => None,
            None => Some(GroupJournal::open(state_dir)?),
        };
        Ok(ProcessRunner {
            shell: shell_path,
            shell_args: shell_args.to_vec(),
            base_env,
            user,
            cgroups,
            journal,
            work_root,
            state_dir: state_dir.to_path_buf(),
            seq: AtomicU64::new(0),
            spare_dirs: Default::default(),
            workdir_owner: match user {
                Some(u) => (u.uid, u.gid),
                None => (
                    nix::unistd::geteuid().as_raw(),
                    nix::unistd::getegid().as_raw(),
                ),
            },
        })
    }

    /// Kill what earlier lives of a worker on this state directory left
    /// running: their cgroups, and their recorded process groups whose
    /// leader still has the recorded start time. How many were killed.
    pub fn reap_orphans(&self) -> usize {
        let killed = process::sweep_journals(&self.state_dir)
            + self.cgroups.as_ref().map(|c| c.reap_stale()).unwrap_or(0);
        self.sweep_workdirs();
        killed
    }

    /// Remove the working directories (`w-<pid>-<n>`) of worker processes
    /// that are gone: what a crash left, spare or in use.
    fn sweep_workdirs(&self) {
        let Ok(entries) = std::fs::read_dir(&self.work_root) else {
            return;
        };
        let me = std::process::id();
        for e in entries.flatten() {
            let name = e.file_name();
            let Some(pid) = name
                .to_str()
                .and_then(|n| n.strip_prefix("w-"))
                .and_then(|n| n.split('-').next())
                .and_then(|p| p.parse::<u32>().ok())
            else {
                continue;
            };
            if pid != me && !process::pid_alive(pid) {
                let _ = std::fs::remove_dir_all(e.path());
            }
        }
    }

    /// Remove what this runner made outside the state directory.
    pub fn cleanup(&self) {
        for d in std::mem::take(&mut *self.spare_dirs.lock().unwrap()) {
            let _ = std::fs::remove_dir(d);
        }
        if let Some(c) = &self.cgroups {
            c.cleanup();
        }
        let _ = std::fs::remove_file(process::cgroup_list_path(&self.state_dir));
    }

    /// An empty working directory of the attempt's own (mode 0700, owned
    /// by the task user if there is one): a spare one, else a new one.
    fn make_workdir(&self) -> std::io::Result<PathBuf> {
        use std::os::unix::fs::DirBuilderExt;
        if let Some(d) = self.spare_dirs.lock().unwrap().pop() {
            return Ok(d);
        }
        let dir = self.work_root.join(format!(
            "w-{}-{}",
            std::process::id(),
            self.seq.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::DirBuilder::new().mode(0o700).create(&dir)?;
        if let Some(u) = self.user {
            if let Err(e) = nix::unistd::chown(
                &dir,
                Some(nix::unistd::Uid::from_raw(u.uid)),
                Some(nix::unistd::Gid::from_raw(u.gid)),
            ) {
                let _ = std::fs::remove_dir(&dir);
                return Err(e.into());
            }
        }
        Ok(dir)
    }

    /// Run one attempt of a process task.
    pub async fn run(&self, spec: &ProcessSpec, ctx: RunContext) -> Outcome {
        let (program, args): (PathBuf, &[String]) = match spec {
            ProcessSpec::Shell { .. } => (self.shell.clone(), &self.shell_args),
            ProcessSpec::Program { program, args, .. } => {
                let path = ctx
                    .env
                    .get("PATH")
                    .unwrap_or_else(|| &self.base_env["PATH"]);
                match process::resolve_program(program, path) {
                    Ok(p) => (p, args),
                    Err(e) if e.permanent => return Outcome::cannot_start(e.message),
                    Err(e) => return Outcome::failed(e.message),
                }
            }
        };
        let workdir = match self.make_workdir() {
            Ok(d) => d,
            Err(e) => return Outcome::failed(format!("cannot create working directory: {e}")),
        };
        let cgroup = match &self.cgroups {
            Some(c) => match c.acquire(&ctx.task.limits) {
                Ok(cg) => Some(cg),
                Err(e) => {
                    remove_workdir(workdir).await;
                    return Outcome::failed(format!("cannot create the task's cgroup: {e}"));
                }
            },
            None => None,
        };
        let outcome = self
            .run_in(&ctx, spec, &program, args, &workdir, cgroup.as_ref())
            .await;
        let contained = match (&self.cgroups, cgroup) {
            (Some(c), Some(cg)) => c.release(cg).await,
            _ => false,
        };
        self.recycle_workdir(workdir, contained).await;
        outcome
    }

    /// After the attempt: keep its working directory for the next one when
    /// nothing of the attempt can still write there (`contained`: its
    /// cgroup was emptied) and it is still what [`Self::make_workdir`]
    /// made — a directory, not a link, mode 0700, the task user's, empty;
    /// else remove it with whatever the task left in it.
    async fn recycle_workdir(&self, dir: PathBuf, contained: bool) {
        if contained && self.as_made(&dir) {
            let mut spare = self.spare_dirs.lock().unwrap();
            if spare.len() < MAX_SPARE_DIRS {
                spare.push(dir);
                return;
            }
        }
        remove_workdir(dir).await;
    }

    /// Whether `dir` is an empty directory with the mode and owner it was
    /// made with (one `lstat`, one read of the directory).
    fn as_made(&self, dir: &Path) -> bool {
        use std::os::unix::fs::MetadataExt;
        let Ok(m) = std::fs::symlink_metadata(dir) else {
            return false;
        };
        let (uid, gid) = self.workdir_owner;
        m.is_dir()
            && m.mode() & 0o7777 == 0o700
            && m.uid() == uid
            && m.gid() == gid
            && std::fs::read_dir(dir).is_ok_and(|mut e| e.next().is_none())
    }

    async fn run_in(
        &self,
        ctx: &RunContext,
        spec: &ProcessSpec,
        program: &Path,
        args: &[String],
        workdir: &Path,
        cgroup: Option<&TaskCgroup>,
    ) -> Outcome {
        let mut cmd = tokio::process::Command::new(program);
        cmd.args(args);
        let extra_env = match spec {
            ProcessSpec::Shell { script } => {
                cmd.arg(script);
                None
            }
            ProcessSpec::Program { env, .. } => Some(env),
        };
        cmd.env_clear()
            .envs(&self.base_env)
            .env("HOME", workdir)
            .env("TMPDIR", workdir)
            .envs(&ctx.env)
            .envs(extra_env.into_iter().flatten())
            .current_dir(workdir)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        let mut limits = ChildLimits::from(&ctx.task.limits);
        if cgroup.is_some() {
            // The cgroup bounds the whole tree; per-process rlimits would only
            // get in the way (RLIMIT_AS breaks runtimes that reserve memory).
            limits.memory = None;
            limits.pids = None;
        }
        let setup = ChildSetup {
            user: self.user,
            limits,
            join: cgroup.map(|c| c.join_files()).unwrap_or_default(),
        };
        process::configure(&mut cmd, setup);

        let spawned = match (&self.cgroups, cgroup) {
            (Some(c), Some(cg)) => c.spawn_inside(cg, || cmd.spawn()).and_then(|r| r),
            _ => cmd.spawn(),
        };
        let mut child = match spawned {
            Ok(c) => c,
            Err(e) if process::permanent_exec_error(&e) => {
                return Outcome::cannot_start(format!("cannot start `{}`: {e}", program.display()))
            }
            Err(e) => return Outcome::failed(format!("cannot start `{}`: {e}", program.display())),
        };
        let pgid = child.id().unwrap_or(0);
        if let Some(j) = &self.journal {
            j.started(pgid);
        }
        let mut pipes = Pipes {
            stdout: child.stdout.take(),
            stderr: child.stderr.take(),
            obuf: vec![0u8; PIPE_BUF],
            ebuf: vec![0u8; PIPE_BUF],
        };
        let mut sink = OutputSink::new(ctx.output_cap, ctx.live.clone(), ctx.attempt);
        let mut target = Group {
            child,
            pgid,
            cgroup,
        };
        let deadline = Instant::now() + ctx.timeout;
        let sup = supervise::supervise(
            &mut target,
            &mut pipes,
            &mut sink,
            ctx,
            deadline,
            Clock {
                drain: PIPE_DRAIN,
                kill_confirm: None,
                what: "the process",
                kill: "SIGKILL",
            },
        )
        .await;
        // Whatever is left of the group dies with the attempt.
        process::signal_group(pgid, Signal::SIGKILL);
        if let Some(j) = &self.journal {
            j.ended(pgid);
        }
        let oom = match cgroup {
            Some(cg) if ctx.task.limits.memory.is_some() => {
                let _ = cg.empty().await;
                cg.oom_killed()
            }
            _ => false,
        };
        let output = sink.finish().await;

        let (exit_code, signal) = match &sup.exit {
            Some(Ok(s)) => (s.code(), s.signal()),
            _ => (None, None),
        };
        let signal_name = signal.map(process::signal_name);
        let (status, error) = if let Some((status, reason)) = sup.stopped_by_clock(ctx) {
            (status, Some(reason))
        } else {
            match &sup.exit {
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
                Some(Err(e)) => (Status::Failed, Some(e.clone())),
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
            permanent: false,
        }
    }
}

/// Remove a working directory: one `rmdir` when the task left nothing,
/// the tree walk (off the runtime threads) only when it did.
async fn remove_workdir(dir: PathBuf) {
    match std::fs::remove_dir(&dir) {
        Ok(()) => {}
        Err(e)
            if e.raw_os_error() == Some(libc::ENOTEMPTY)
                || e.raw_os_error() == Some(libc::EEXIST) =>
        {
            let _ = tokio::task::spawn_blocking(move || std::fs::remove_dir_all(&dir)).await;
        }
        Err(e) => tracing::debug!(dir = %dir.display(), "cannot remove working directory: {e}"),
    }
}

/// The task's process group, for the supervision clock.
struct Group<'a> {
    child: Child,
    pgid: u32,
    cgroup: Option<&'a TaskCgroup>,
}

impl Supervised for Group<'_> {
    type Exit = std::process::ExitStatus;
    async fn wait(&mut self) -> Result<std::process::ExitStatus, String> {
        let r = self
            .child
            .wait()
            .await
            .map_err(|e| format!("cannot wait for the process: {e}"));
        // Background children die with the attempt, escapees too.
        process::signal_group(self.pgid, Signal::SIGKILL);
        if let Some(cg) = self.cgroup {
            cg.kill_now();
        }
        r
    }
    fn term(&mut self, _grace: Duration) {
        process::signal_group(self.pgid, Signal::SIGTERM);
    }
    async fn kill(&mut self) {
        process::signal_group(self.pgid, Signal::SIGKILL);
        if let Some(cg) = self.cgroup {
            cg.kill_now();
        }
        let _ = self.child.start_kill();
    }
}

/// The task's stdout and stderr pipes.
struct Pipes {
    stdout: Option<ChildStdout>,
    stderr: Option<ChildStderr>,
    obuf: Vec<u8>,
    ebuf: Vec<u8>,
}

impl OutputSource for Pipes {
    async fn read_into(&mut self, sink: &mut OutputSink) -> bool {
        if self.stdout.is_none() && self.stderr.is_none() {
            return false;
        }
        tokio::select! {
            r = read_some(&mut self.stdout, &mut self.obuf) => match r {
                Some(n) => sink.push(StreamKind::Stdout, &self.obuf[..n]),
                None => self.stdout = None,
            },
            r = read_some(&mut self.stderr, &mut self.ebuf) => match r {
                Some(n) => sink.push(StreamKind::Stderr, &self.ebuf[..n]),
                None => self.stderr = None,
            },
        }
        true
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
