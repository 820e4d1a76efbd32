//! Spawning task processes cheaply, so that none outlives its attempt, and
//! keeping the worker's secrets out of their reach (DESIGN.md section 5,
//! "No orphans").
//!
//! **Spawn path.** A task process leads its own process group and is
//! started through `posix_spawn` (glibc: `clone(CLONE_VM|CLONE_VFORK)`):
//! the program is resolved against the task's `PATH` here in the worker
//! ([`resolve_program`]) and the group is set through the spawn attributes,
//! so std never falls back to fork. Fork copies the worker's page tables
//! and write-protects its heap; at a worker's size that costs more than the
//! spawn itself (BENCHMARKS.md). Only what cannot be said through spawn
//! attributes takes the fork path with a `pre_exec` hook: a task user
//! (credentials are dropped in the hook *after* joining the cgroup), rlimits,
//! and joining a cgroup v2 from inside the child. On cgroup v1 the child is
//! born inside its cgroup without a hook ([`crate::cgroup`]).
//!
//! **No orphans.** Where cgroups are writable every attempt runs in its own
//! cgroup, which is emptied when the attempt ends. Without cgroups the
//! process group is what is killed, and each spawned group is recorded with
//! its leader's start time in one journal per worker life
//! (`state_dir/pgroups/<worker pid>`, appended to; not one file per task).
//! When the worker dies, a watchdog ([`spawn_watchdog`], a small `sh`
//! blocked on a pipe only the worker holds) empties the worker's cgroups
//! and kills the journal's groups whose leader still has the recorded start
//! time. A worker starting on the same state directory does the same for
//! earlier lives ([`sweep_journals`], [`crate::cgroup::Cgroups::reap_stale`]):
//! it kills only what provably belongs to the dead worker.
//!
//! **Secrets.** [`protect_secrets`] makes the worker non-dumpable (so a task
//! running as the same user can read neither `/proc/<worker>/environ` nor
//! its memory) and blanks secret flag values in its command line.

use std::ffi::CString;
use std::fs::File;
use std::io::Write;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use nix::sys::signal::{killpg, Signal};
use nix::unistd::{Pid, Uid, User};

use crate::protocol::Limits;

/// A resolved task user.
#[derive(Debug, Clone, Copy)]
pub struct TaskUser {
    pub uid: u32,
    pub gid: u32,
}

/// Resolve a user name or numeric `uid[:gid]`.
pub fn resolve_user(spec: &str) -> Result<TaskUser, String> {
    let (u, g) = match spec.split_once(':') {
        Some((u, g)) => (u, Some(g)),
        None => (spec, None),
    };
    let (uid, default_gid) = if let Ok(n) = u.parse::<u32>() {
        let gid = User::from_uid(Uid::from_raw(n))
            .ok()
            .flatten()
            .map(|x| x.gid.as_raw())
            .unwrap_or(n);
        (n, gid)
    } else {
        let user = User::from_name(u)
            .map_err(|e| format!("cannot look up user `{u}`: {e}"))?
            .ok_or_else(|| format!("no user `{u}` on this machine"))?;
        (user.uid.as_raw(), user.gid.as_raw())
    };
    let gid = match g {
        None => default_gid,
        Some(g) => match g.parse::<u32>() {
            Ok(n) => n,
            Err(_) => nix::unistd::Group::from_name(g)
                .map_err(|e| format!("cannot look up group `{g}`: {e}"))?
                .ok_or_else(|| format!("no group `{g}` on this machine"))?
                .gid
                .as_raw(),
        },
    };
    Ok(TaskUser { uid, gid })
}

/// rlimits applied in the child before exec.
#[derive(Debug, Clone, Copy, Default)]
pub struct ChildLimits {
    pub memory: Option<u64>,
    pub cpu_seconds: Option<u64>,
    pub pids: Option<u64>,
    pub nofile: Option<u64>,
}

impl ChildLimits {
    fn any(&self) -> bool {
        self.memory.is_some()
            || self.cpu_seconds.is_some()
            || self.pids.is_some()
            || self.nofile.is_some()
    }
}

impl From<&Limits> for ChildLimits {
    fn from(l: &Limits) -> Self {
        ChildLimits {
            memory: l.memory,
            cpu_seconds: l.cpu_seconds,
            pids: l.pids,
            nofile: l.nofile,
        }
    }
}

/// Why a program cannot be started.
#[derive(Debug)]
pub struct SpawnError {
    pub message: String,
    /// The program does not exist or cannot be executed: no retry can help.
    pub permanent: bool,
}

/// Whether an `exec` error means the program can never start (missing,
/// not executable, not a binary or script the kernel runs).
pub fn permanent_exec_error(e: &std::io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::ENOENT | libc::EACCES | libc::ENOEXEC | libc::ENOTDIR | libc::ELOOP)
    )
}

/// The executable `program` names, searched in `path` (colon-separated)
/// when it has no `/`, as `execvp` would. Done in the worker so that the
/// spawn itself needs no search in the child (std searches only on its
/// fork path).
pub fn resolve_program(program: &str, path: &str) -> Result<PathBuf, SpawnError> {
    let executable = |p: &Path| -> std::io::Result<()> {
        let m = std::fs::metadata(p)?;
        if m.is_dir() || m.permissions().mode() & 0o111 == 0 {
            return Err(std::io::Error::from_raw_os_error(libc::EACCES));
        }
        Ok(())
    };
    if program.is_empty() {
        return Err(SpawnError {
            message: "cannot start ``: empty program name".into(),
            permanent: true,
        });
    }
    if program.contains('/') {
        let p = PathBuf::from(program);
        return match executable(&p) {
            Ok(()) => Ok(p),
            Err(e) => Err(SpawnError {
                permanent: permanent_exec_error(&e),
                message: format!("cannot start `{program}`: {e}"),
            }),
        };
    }
    let mut denied = None;
    for dir in path.split(':') {
        let dir = if dir.is_empty() { "." } else { dir };
        let p = Path::new(dir).join(program);
        match executable(&p) {
            Ok(()) => return Ok(p),
            Err(e) if e.raw_os_error() == Some(libc::EACCES) => denied = Some(p),
            Err(_) => {}
        }
    }
    Err(SpawnError {
        message: match denied {
            Some(p) => format!(
                "cannot start `{program}`: {} is not executable",
                p.display()
            ),
            None => format!("cannot start `{program}`: not found in PATH ({path})"),
        },
        permanent: true,
    })
}

/// What the child needs besides program, arguments, environment and
/// working directory.
#[derive(Debug, Default)]
pub struct ChildSetup {
    pub user: Option<TaskUser>,
    pub limits: ChildLimits,
    /// `cgroup.procs` files the child writes its pid to before exec (cgroup
    /// v2; v1 children are born inside instead, see [`crate::cgroup`]).
    pub join: Vec<CString>,
}

impl ChildSetup {
    /// Whether the child needs a `pre_exec` hook (and so the fork path).
    pub fn needs_hook(&self) -> bool {
        self.user.is_some() || self.limits.any() || !self.join.is_empty()
    }
}

/// Prepare `cmd` (program already resolved to a path) so that the child
/// leads its own process group and gets `setup`. Without a task user,
/// rlimits or an in-child cgroup join this adds no `pre_exec` hook, and std
/// spawns through `posix_spawn`.
pub fn configure(cmd: &mut tokio::process::Command, setup: ChildSetup) {
    cmd.process_group(0);
    if !setup.needs_hook() {
        return;
    }
    let parent = std::process::id() as libc::pid_t;
    // SAFETY: the closure runs in the forked child before exec and only
    // makes raw syscalls; it allocates nothing (the join paths and limits
    // were prepared before the fork).
    unsafe {
        cmd.pre_exec(move || {
            // This path forks anyway, so the parent-death signal comes for
            // free; the watchdog covers the posix_spawn path.
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            if libc::getppid() != parent {
                return Err(std::io::Error::other("worker exited during spawn"));
            }
            // Join the cgroup while still privileged: `cgroup.procs` is
            // the worker's.
            crate::cgroup::join_in_child(&setup.join)?;
            if let Some(u) = setup.user {
                let gid = u.gid as libc::gid_t;
                if libc::setgroups(1, &gid) != 0
                    || libc::setgid(gid) != 0
                    || libc::setuid(u.uid as libc::uid_t) != 0
                {
                    return Err(std::io::Error::last_os_error());
                }
                // A credential change clears the parent-death signal.
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0);
            }
            set_rlimits(&setup.limits)
        });
    }
}

/// Apply `limits` to the calling process (async-signal-safe).
fn set_rlimits(limits: &ChildLimits) -> std::io::Result<()> {
    let set = |res, cur: u64, max: u64| -> std::io::Result<()> {
        let lim = libc::rlimit {
            rlim_cur: cur as libc::rlim_t,
            rlim_max: max as libc::rlim_t,
        };
        // SAFETY: setrlimit with a valid pointer.
        if unsafe { libc::setrlimit(res, &lim) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(())
    };
    if let Some(m) = limits.memory {
        set(libc::RLIMIT_AS, m, m)?;
    }
    if let Some(c) = limits.cpu_seconds {
        // Soft limit sends SIGXCPU; the hard one a second later SIGKILL.
        set(libc::RLIMIT_CPU, c, c + 1)?;
    }
    if let Some(p) = limits.pids {
        set(libc::RLIMIT_NPROC, p, p)?;
    }
    if let Some(n) = limits.nofile {
        set(libc::RLIMIT_NOFILE, n, n)?;
    }
    Ok(())
}

/// Send `sig` to the whole group. A group that is already gone is fine.
pub fn signal_group(pgid: u32, sig: Signal) {
    if pgid > 1 {
        let _ = killpg(Pid::from_raw(pgid as i32), sig);
    }
}

/// Whether any process of the group still exists.
pub fn group_alive(pgid: u32) -> bool {
    pgid > 1 && killpg(Pid::from_raw(pgid as i32), None).is_ok()
}

/// Whether a process with this pid exists (a zombie counts).
pub fn pid_alive(pid: u32) -> bool {
    pid > 0
        && nix::sys::signal::kill(Pid::from_raw(pid as i32), None)
            .map_or_else(|e| e == nix::errno::Errno::EPERM, |()| true)
}

/// Start time of a process (clock ticks since boot), from `/proc`; `None`
/// when it is gone or a zombie.
pub fn start_time(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command name (which may contain spaces) start with
    // field 3 (state); the start time is field 22.
    let rest = stat.rsplit_once(')')?.1;
    let mut f = rest.split_whitespace();
    if f.next()? == "Z" {
        return None;
    }
    f.nth(18)?.parse().ok()
}

/// The process groups this worker life spawned, as one append-only journal
/// `state_dir/pgroups/<worker pid>`: `+<pgid> <leader start time>` when a
/// group starts, `-<pgid>` when it is gone. Used only where tasks get no
/// cgroup. Read by the watchdog and by [`sweep_journals`].
#[derive(Debug)]
pub struct GroupJournal {
    dir: PathBuf,
    file: Mutex<File>,
}

/// Past this size the journal is rewritten with only the live groups.
const JOURNAL_COMPACT: u64 = 256 * 1024;

impl GroupJournal {
    pub fn open(state_dir: &Path) -> std::io::Result<Self> {
        let dir = state_dir.join("pgroups");
        std::fs::create_dir_all(&dir)?;
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(dir.join(std::process::id().to_string()))?;
        file.set_len(0)?;
        Ok(GroupJournal {
            dir,
            file: Mutex::new(file),
        })
    }

    fn path(&self) -> PathBuf {
        self.dir.join(std::process::id().to_string())
    }

    /// Record a started group (its leader's pid is the group id).
    pub fn started(&self, pgid: u32) {
        let Some(t) = start_time(pgid) else { return };
        let mut f = self.file.lock().unwrap();
        let _ = f.write_all(format!("+{pgid} {t}\n").as_bytes());
    }

    /// Record a group as gone (after it was killed).
    pub fn ended(&self, pgid: u32) {
        let mut f = self.file.lock().unwrap();
        let _ = f.write_all(format!("-{pgid}\n").as_bytes());
        if f.metadata().map(|m| m.len()).unwrap_or(0) > JOURNAL_COMPACT {
            let live = read_journal(&self.path());
            let text: String = live.iter().map(|(g, t)| format!("+{g} {t}\n")).collect();
            let _ = f.set_len(0);
            let _ = f.write_all(text.as_bytes());
        }
    }
}

impl Drop for GroupJournal {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(self.path());
    }
}

/// Kill the groups recorded by earlier lives of a worker on this state
/// directory whose worker is gone — only where the group's leader still
/// has the recorded start time, so a stranger that reused the id is
/// left alone. Returns how many groups were killed.
pub fn sweep_journals(state_dir: &Path) -> usize {
    let dir = state_dir.join("pgroups");
    let mut n = 0;
    let Ok(rd) = std::fs::read_dir(&dir) else {
        return 0;
    };
    for e in rd.flatten() {
        let path = e.path();
        let name = path.file_name().and_then(|s| s.to_str()).unwrap_or("");
        let (stem, is_list) = match name.strip_suffix(".cgroups") {
            Some(stem) => (stem, true),
            None => (name, false),
        };
        let Some(owner) = stem.parse::<i32>().ok() else {
            // A record file of the old format (one file per group,
            // without a start time): nothing proves the group is ours.
            let _ = std::fs::remove_file(&path);
            continue;
        };
        if owner == std::process::id() as i32
            || nix::sys::signal::kill(Pid::from_raw(owner), None).is_ok()
        {
            continue; // this worker, or another live one on this state dir
        }
        if is_list {
            // The cgroups it lists are swept by the cgroup code.
            let _ = std::fs::remove_file(&path);
            continue;
        }
        for (pgid, started) in read_journal(&path) {
            if start_time(pgid) == Some(started) && group_alive(pgid) {
                signal_group(pgid, Signal::SIGKILL);
                n += 1;
            }
        }
        let _ = std::fs::remove_file(&path);
    }
    n
}

/// The live groups of a journal: (pgid, leader start time).
fn read_journal(path: &Path) -> Vec<(u32, u64)> {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let mut live: std::collections::BTreeMap<u32, u64> = Default::default();
    for l in text.lines() {
        if let Some(rest) = l.strip_prefix('+') {
            let mut it = rest.split_whitespace();
            if let (Some(Ok(g)), Some(Ok(t))) = (
                it.next().map(str::parse::<u32>),
                it.next().map(str::parse::<u64>),
            ) {
                live.insert(g, t);
            }
        } else if let Some(Ok(g)) = l.strip_prefix('-').map(str::parse::<u32>) {
            live.remove(&g);
        }
    }
    live.into_iter().collect()
}

/// The watchdog script. `$1` is the journal, `$2`… are cgroup parents.
/// Wait for EOF on stdin (the worker is gone), then SIGKILL everything in
/// the worker's cgroups, and the journal's live groups whose leader still
/// has the recorded start time (field 22 of `/proc/<pid>/stat`).
const WATCHDOG: &str = r#"cat >/dev/null
journal=$1; shift
for round in 1 2 3 4 5; do
  for parent in "$@"; do
    for procs in "$parent"/*/cgroup.procs; do
      [ -f "$procs" ] || continue
      while read -r p; do kill -9 "$p" 2>/dev/null; done < "$procs"
    done
  done
done
[ -f "$journal" ] || exit 0
awk '/^\+/ { g = substr($1, 2); live[g] = $2 } /^-/ { delete live[substr($1, 2)] }
  END { for (g in live) {
    line = ""; f = "/proc/" g "/stat"
    if ((getline line < f) > 0) {
      sub(/.*\) /, "", line); split(line, x, " ")
      if (x[1] != "Z" && x[20] == live[g]) system("kill -9 -" g " 2>/dev/null")
    }
    close(f)
  } }' "$journal"
rm -f -- "$journal""#;

/// Where the runner tells the watchdog which cgroup parents are this
/// worker's: one path a line, written once at start.
pub(crate) fn cgroup_list_path(state_dir: &Path) -> PathBuf {
    state_dir
        .join("pgroups")
        .join(format!("{}.cgroups", std::process::id()))
}

/// Start the watchdog for this worker; keep the returned pipe end open for
/// the worker's whole life (dropping it fires the watchdog). It empties the
/// cgroup parents listed in [`cgroup_list_path`] (read when it starts, so
/// the process runner is made first) and kills the journal's groups.
pub fn spawn_watchdog(state_dir: &Path) -> std::io::Result<std::process::ChildStdin> {
    use std::os::unix::process::CommandExt;
    let dir = state_dir.join("pgroups");
    std::fs::create_dir_all(&dir)?;
    let cgroups: Vec<String> = std::fs::read_to_string(cgroup_list_path(state_dir))
        .unwrap_or_default()
        .lines()
        .map(str::to_string)
        .collect();
    let mut child = std::process::Command::new("/bin/sh")
        .arg("-c")
        .arg(WATCHDOG)
        .arg("jetworker-watchdog")
        .arg(dir.join(std::process::id().to_string()))
        .args(cgroups)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        // Its own group: a Ctrl-C meant for the worker must not kill it.
        .process_group(0)
        .spawn()?;
    let stdin = child.stdin.take().expect("piped stdin");
    // Reap it when it exits, so it does not linger as a zombie.
    std::thread::spawn(move || {
        let _ = child.wait();
    });
    Ok(stdin)
}

/// Name of a signal number (`SIGKILL`).
pub fn signal_name(sig: i32) -> String {
    Signal::try_from(sig)
        .map(|s| s.as_str().to_string())
        .unwrap_or_else(|_| format!("signal {sig}"))
}

/// Flags whose value is a secret, blanked in the command line of the
/// worker and of `jetworker ui`.
const SECRET_FLAGS: [&str; 3] = ["--token", "--password", "--ui-token"];

/// Keep the worker's secrets from its tasks (call once at worker start,
/// after the command line was parsed): make the process non-dumpable, so
/// that a task running as the same user can read neither
/// `/proc/<worker>/environ` (where `JETWORKER_TOKEN` lives) nor its memory
/// nor attach a debugger, and overwrite the values of `--token` and
/// `--password` in the process's argument area, which
/// `/proc/<worker>/cmdline` shows to everyone.
pub fn protect_secrets() {
    // SAFETY: prctl with constant arguments.
    if unsafe { libc::prctl(libc::PR_SET_DUMPABLE, 0, 0, 0, 0) } != 0 {
        tracing::warn!(
            "cannot make the worker non-dumpable ({}); tasks running as its user may read its environment",
            std::io::Error::last_os_error()
        );
    }
    blank_secret_args();
}

/// The argument area of this process (`arg_start`, `arg_end`: fields 48
/// and 49 of `/proc/self/stat`), overwritten in place.
fn blank_secret_args() {
    let Ok(stat) = std::fs::read_to_string("/proc/self/stat") else {
        return;
    };
    let Some(rest) = stat.rsplit_once(')').map(|r| r.1) else {
        return;
    };
    let f: Vec<&str> = rest.split_whitespace().collect();
    // Field n (1-based) is f[n - 3].
    let (Some(start), Some(end)) = (
        f.get(45).and_then(|s| s.parse::<usize>().ok()),
        f.get(46).and_then(|s| s.parse::<usize>().ok()),
    ) else {
        return;
    };
    if start == 0 || end <= start {
        return;
    }
    // SAFETY: [arg_start, arg_end) is this process's own argument strings,
    // mapped and writable for the life of the process (it is on the initial
    // stack). std copies what it needs when the arguments are read; nothing
    // holds a Rust reference into this area.
    let area = unsafe { std::slice::from_raw_parts_mut(start as *mut u8, end - start) };
    blank_in(area);
}

/// Overwrite secret flag values in a NUL-separated argument area.
fn blank_in(area: &mut [u8]) {
    let mut blank_next = false;
    let mut i = 0;
    while i < area.len() {
        let len = area[i..]
            .iter()
            .position(|&b| b == 0)
            .unwrap_or(area.len() - i);
        let arg = &mut area[i..i + len];
        if blank_next {
            arg.fill(b'*');
            blank_next = false;
        } else if SECRET_FLAGS.iter().any(|f| arg == f.as_bytes()) {
            blank_next = true;
        } else if let Some(f) = SECRET_FLAGS
            .iter()
            .find(|f| arg.starts_with(f.as_bytes()) && arg.get(f.len()) == Some(&b'='))
        {
            arg[f.len() + 1..].fill(b'*');
        }
        i += len + 1;
    }
}

/// `p` as a C string (paths never hold NUL).
pub(crate) fn cstring(p: &Path) -> CString {
    CString::new(p.as_os_str().as_bytes()).expect("path without NUL")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blanks_secret_values() {
        let mut a = b"jetworker\0run\0--token\0s3cret\0--password=pw\0--user\0u\0".to_vec();
        blank_in(&mut a);
        assert_eq!(
            &a[..],
            b"jetworker\0run\0--token\0******\0--password=**\0--user\0u\0"
        );
        let mut a = b"jetworker\0ui\0--ui-token=abc\0--ui-token-file\0f\0".to_vec();
        blank_in(&mut a);
        assert_eq!(
            &a[..],
            b"jetworker\0ui\0--ui-token=***\0--ui-token-file\0f\0"
        );
    }

    #[test]
    fn resolves_like_execvp() {
        let p = resolve_program("sh", "/nonexistent:/bin:/usr/bin").unwrap();
        assert!(p.ends_with("sh"), "{p:?}");
        let e = resolve_program("no-such-program-jw", "/bin").unwrap_err();
        assert!(e.permanent, "{e:?}");
        let e = resolve_program("/no/such/binary", "/bin").unwrap_err();
        assert!(
            e.permanent && e.message.contains("/no/such/binary"),
            "{e:?}"
        );
        let e = resolve_program("/etc/passwd", "/bin").unwrap_err();
        assert!(e.permanent, "{e:?}");
    }

    #[test]
    fn journal_keeps_live_groups() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("j");
        std::fs::write(&p, "+10 5\n+11 6\n-10\n+12 7\n").unwrap();
        assert_eq!(read_journal(&p), vec![(11, 6), (12, 7)]);
    }
}
