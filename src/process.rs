//! Spawning task processes so that none outlives its attempt: each task is
//! the leader of its own process group, carries a parent-death signal
//! (SIGKILL when the worker dies), gets its rlimits, and may switch to the
//! configured task user. The group is killed as a whole (SIGTERM, then
//! SIGKILL after the grace period), so `sleep 600 &` dies with its script.
//!
//! For the case where the worker itself is SIGKILLed, the direct child dies
//! through the parent-death signal; its background descendants stay in the
//! group, whose id is recorded in `state_dir/pgroups/`. Two things kill
//! those: a watchdog started once per worker ([`spawn_watchdog`], a tiny
//! `sh` blocked on a pipe that only the worker holds — when the worker dies
//! the pipe closes and the watchdog kills the groups it recorded), and, as
//! a fallback, a worker starting on the same state directory
//! ([`GroupRecords::reap_orphans`]). Spawning a task costs nothing extra.

use std::path::{Path, PathBuf};

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

/// Prepare `cmd` so that the child leads its own process group, dies with
/// the worker, runs as `user` and carries `limits`.
///
/// The group is set through std (`process_group`); the rest needs a
/// `pre_exec` hook, which only uses async-signal-safe calls.
/// `cgroup_join` lists `cgroup.procs` files the child enters before exec
/// (see [`crate::cgroup`]), so that even its first fork is inside.
pub fn configure(
    cmd: &mut tokio::process::Command,
    user: Option<TaskUser>,
    limits: ChildLimits,
    cgroup_join: Vec<std::ffi::CString>,
) {
    cmd.process_group(0);
    if let Some(u) = user {
        cmd.uid(u.uid);
        cmd.gid(u.gid);
    }
    let parent = std::process::id() as libc::pid_t;
    // SAFETY: the closure runs in the forked child before exec and only
    // makes raw syscalls (prctl, getppid, setrlimit, kill/_exit-free paths).
    unsafe {
        cmd.pre_exec(move || {
            // std applies uid/gid before this hook, so the parent-death
            // signal set here is not cleared by the credential change.
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            // The worker may have died between fork and prctl.
            if libc::getppid() != parent {
                return Err(std::io::Error::other("worker exited during spawn"));
            }
            crate::cgroup::join_in_child(&cgroup_join)?;
            let set = |res, v: u64| -> std::io::Result<()> {
                let lim = libc::rlimit {
                    rlim_cur: v as libc::rlim_t,
                    rlim_max: v as libc::rlim_t,
                };
                if libc::setrlimit(res, &lim) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            };
            if let Some(m) = limits.memory {
                set(libc::RLIMIT_AS, m)?;
            }
            if let Some(c) = limits.cpu_seconds {
                // Soft limit sends SIGXCPU; the hard one a second later SIGKILL.
                let lim = libc::rlimit {
                    rlim_cur: c as libc::rlim_t,
                    rlim_max: (c + 1) as libc::rlim_t,
                };
                if libc::setrlimit(libc::RLIMIT_CPU, &lim) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
            }
            if let Some(p) = limits.pids {
                set(libc::RLIMIT_NPROC, p)?;
            }
            if let Some(n) = limits.nofile {
                set(libc::RLIMIT_NOFILE, n)?;
            }
            Ok(())
        });
    }
}

/// Send `sig` to the whole group. A group that is already gone is fine.
pub fn signal_group(pgid: u32, sig: Signal) {
    let _ = killpg(Pid::from_raw(pgid as i32), sig);
}

/// Whether any process of the group still exists.
pub fn group_alive(pgid: u32) -> bool {
    killpg(Pid::from_raw(pgid as i32), None).is_ok()
}

/// Records of running process groups in `state_dir/pgroups/`, one file per
/// group, named by the group id and holding the worker's pid.
#[derive(Debug, Clone)]
pub struct GroupRecords {
    dir: PathBuf,
}

impl GroupRecords {
    pub fn new(state_dir: &Path) -> std::io::Result<Self> {
        let dir = state_dir.join("pgroups");
        std::fs::create_dir_all(&dir)?;
        Ok(GroupRecords { dir })
    }

    pub fn add(&self, pgid: u32, task_id: &str) {
        let _ = std::fs::write(
            self.dir.join(pgid.to_string()),
            format!("{} {}\n", std::process::id(), task_id),
        );
    }

    pub fn remove(&self, pgid: u32) {
        let _ = std::fs::remove_file(self.dir.join(pgid.to_string()));
    }

    /// Kill the groups recorded by an earlier life of a worker on this state
    /// directory whose process is gone. Returns how many were killed.
    pub fn reap_orphans(&self) -> usize {
        let mut n = 0;
        let Ok(rd) = std::fs::read_dir(&self.dir) else {
            return 0;
        };
        for e in rd.flatten() {
            let path = e.path();
            let Some(pgid) = path
                .file_name()
                .and_then(|s| s.to_str())
                .and_then(|s| s.parse::<u32>().ok())
            else {
                continue;
            };
            let owner: Option<i32> = std::fs::read_to_string(&path)
                .ok()
                .and_then(|s| s.split_whitespace().next().and_then(|p| p.parse().ok()));
            let owner_alive = owner
                .map(|p| {
                    p != std::process::id() as i32
                        && nix::sys::signal::kill(Pid::from_raw(p), None).is_ok()
                })
                .unwrap_or(false);
            if owner_alive {
                continue; // another live worker shares this state dir
            }
            if pgid > 1 && group_alive(pgid) {
                signal_group(pgid, Signal::SIGKILL);
                n += 1;
            }
            let _ = std::fs::remove_file(&path);
        }
        n
    }
}

/// The watchdog script: wait for EOF on stdin (the worker is gone), then
/// SIGKILL every process group recorded for that worker.
const WATCHDOG: &str = r#"cat >/dev/null
cd "$1" 2>/dev/null || exit 0
for f in *; do
  [ -f "$f" ] || continue
  read -r owner _ < "$f" || continue
  [ "$owner" = "$2" ] || continue
  kill -9 "-$f" 2>/dev/null
  rm -f -- "$f"
done"#;

/// Start the watchdog for this worker; keep the returned pipe end open for
/// the worker's whole life (dropping it fires the watchdog).
pub fn spawn_watchdog(state_dir: &Path) -> std::io::Result<std::process::ChildStdin> {
    use std::os::unix::process::CommandExt;
    let dir = state_dir.join("pgroups");
    let mut child = std::process::Command::new("/bin/sh")
        .arg("-c")
        .arg(WATCHDOG)
        .arg("jetworker-watchdog")
        .arg(&dir)
        .arg(std::process::id().to_string())
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
