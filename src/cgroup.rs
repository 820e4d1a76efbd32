//! A cgroup for every `shell` and `command` attempt, where the cgroup tree
//! is writable: containment (everything the attempt started, `setsid` and
//! double-forked processes included, is killed when it ends), and memory
//! (with OOM detection), pids and CPU limits that hold for the whole tree.
//!
//! - cgroup v2 (unified): the worker moves itself into a leaf
//!   `<own>/jetworker-worker` (the "no internal processes" rule), enables
//!   the controllers in `<own>`, and keeps its task cgroups in
//!   `<own>/jetworker-<pid>-<n>/t<k>`. This is what `Delegate=yes` in the
//!   systemd unit allows. The child joins from a `pre_exec` hook (v2 cannot
//!   move one thread of a process), so v2 spawns take the fork path.
//! - cgroup v1 (legacy/hybrid): per controller,
//!   `<own>/jetworker-<pid>-<n>/t<k>`. The child is *born* inside: the
//!   spawning thread moves itself into the task's cgroup (`tasks` takes a
//!   thread id), spawns through `posix_spawn`, and moves back — two writes
//!   to kept-open files, no hook, no fork. Only the memory hierarchy is
//!   joined unless the task sets `pids` or `cpu`.
//!
//! Task cgroups are pooled: an attempt without limits takes an empty one
//! from the pool and gives it back emptied; one with limits gets a fresh
//! cgroup that is removed afterwards (so its limits and OOM counters start
//! clean). Never the worker's own cgroup: limits go to the task's. Where
//! nothing is writable (most containers), [`Cgroups::detect`] fails and
//! tasks are contained by their process group only (DESIGN.md section 5).

use std::ffi::CString;
use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use crate::process::cstring;
use crate::protocol::Limits;

const CPU_PERIOD_US: u64 = 100_000;

/// Tells apart the runners of one process (tests start several workers in
/// one process), so that each owns its parent: `jetworker-<pid>-<n>`.
static INSTANCE: AtomicU32 = AtomicU32::new(0);

/// Where task cgroups are made, and the pool of empty ones.
#[derive(Debug)]
pub struct Cgroups {
    kind: Kind,
    pool: Mutex<Vec<TaskCgroup>>,
    next: AtomicU32,
}

#[derive(Debug)]
enum Kind {
    V2 {
        /// `<own>/jetworker-<pid>-<n>`.
        parent: PathBuf,
    },
    V1 {
        memory: Hierarchy,
        pids: Option<Hierarchy>,
        cpu: Option<Hierarchy>,
    },
}

/// One v1 hierarchy: this worker's parent for task cgroups, and the
/// `tasks` file of the worker's own cgroup (where a spawning thread
/// returns).
#[derive(Debug)]
struct Hierarchy {
    parent: PathBuf,
    home: File,
}

/// One attempt's cgroup(s).
#[derive(Debug)]
pub struct TaskCgroup {
    /// v2: the cgroup; v1: the memory cgroup.
    dir: PathBuf,
    /// `cgroup.procs` of `dir`, read to find what is left.
    procs: PathBuf,
    /// v1: `tasks` of the memory cgroup and, when the attempt has those
    /// limits, of its pids and cpu cgroups (dir, tasks).
    v1_tasks: Vec<(PathBuf, File)>,
    v2: bool,
    /// Set limits: a fresh cgroup, removed (not pooled) afterwards.
    limited: bool,
}

fn write(path: &Path, value: &str) -> std::io::Result<()> {
    std::fs::write(path, value)
}

/// The path of this process in each hierarchy: (controllers, path).
fn own_cgroups() -> Vec<(String, String)> {
    std::fs::read_to_string("/proc/self/cgroup")
        .unwrap_or_default()
        .lines()
        .filter_map(|l| {
            let mut it = l.splitn(3, ':');
            let _id = it.next()?;
            Some((it.next()?.to_string(), it.next()?.to_string()))
        })
        .collect()
}

/// The pids listed in a `cgroup.procs` file. Opened afresh each time: a
/// v1 kernel caches the list per open file for a second after a read, so a
/// kept-open file would show stale (for instance empty) lists.
fn read_pids(path: &Path) -> Vec<i32> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.trim().parse().ok())
        .collect()
}

impl Cgroups {
    /// Find a writable place for task cgroups, or why there is none (for
    /// the log).
    pub fn detect() -> Result<Self, String> {
        let root = Path::new("/sys/fs/cgroup");
        let kind = if root.join("cgroup.controllers").exists() {
            Self::detect_v2(root)?
        } else {
            Self::detect_v1(root)?
        };
        Ok(Cgroups {
            kind,
            pool: Mutex::new(Vec::new()),
            next: AtomicU32::new(0),
        })
    }

    fn detect_v2(root: &Path) -> Result<Kind, String> {
        let own = own_cgroups()
            .into_iter()
            .find(|(c, _)| c.is_empty())
            .map(|(_, p)| p)
            .ok_or("no cgroup v2 path in /proc/self/cgroup")?;
        let own_dir = root.join(own.trim_start_matches('/'));
        let available = std::fs::read_to_string(own_dir.join("cgroup.controllers"))
            .map_err(|e| format!("cannot read {}: {e}", own_dir.display()))?;
        let wanted: Vec<&str> = ["memory", "pids", "cpu"]
            .into_iter()
            .filter(|c| available.split_whitespace().any(|a| a == *c))
            .collect();
        if !wanted.contains(&"memory") {
            return Err(format!(
                "the memory controller is not available in {}",
                own_dir.display()
            ));
        }
        // Move ourselves into a leaf so that the controllers can be enabled
        // for the children of our cgroup.
        let leaf = own_dir.join("jetworker-worker");
        if !own_dir.ends_with("jetworker-worker") {
            std::fs::create_dir_all(&leaf)
                .map_err(|e| format!("{} is not writable: {e}", own_dir.display()))?;
            write(&leaf.join("cgroup.procs"), &std::process::id().to_string())
                .map_err(|e| format!("cannot move the worker into {}: {e}", leaf.display()))?;
        }
        let base = if own_dir.ends_with("jetworker-worker") {
            own_dir.parent().map(Path::to_path_buf).unwrap_or(own_dir)
        } else {
            own_dir
        };
        let enable: String = wanted.iter().map(|c| format!("+{c} ")).collect();
        let enable = enable.trim();
        write(&base.join("cgroup.subtree_control"), enable)
            .map_err(|e| format!("cannot enable controllers in {}: {e}", base.display()))?;
        let parent = base.join(instance_name());
        std::fs::create_dir_all(&parent)
            .map_err(|e| format!("cannot create {}: {e}", parent.display()))?;
        write(&parent.join("cgroup.subtree_control"), enable)
            .map_err(|e| format!("cannot enable controllers in {}: {e}", parent.display()))?;
        Ok(Kind::V2 { parent })
    }

    fn detect_v1(root: &Path) -> Result<Kind, String> {
        let own = own_cgroups();
        let name = instance_name();
        let place = |ctrl: &str| -> Option<Hierarchy> {
            let path = own
                .iter()
                .find(|(c, _)| c.split(',').any(|x| x == ctrl))
                .map(|(_, p)| p.clone())?;
            // `cpu` is often a link to `cpu,cpuacct`; either way it resolves.
            let mount = root.join(ctrl);
            if !mount.join("cgroup.procs").exists() {
                return None;
            }
            let own_dir = mount.join(path.trim_start_matches('/'));
            let home = std::fs::OpenOptions::new()
                .write(true)
                .open(own_dir.join("tasks"))
                .ok()?;
            let parent = own_dir.join(&name);
            std::fs::create_dir_all(&parent).ok()?;
            Some(Hierarchy { parent, home })
        };
        let memory = place("memory").ok_or("no writable cgroup v2 tree or v1 memory controller")?;
        Ok(Kind::V1 {
            memory,
            pids: place("pids"),
            cpu: place("cpu"),
        })
    }

    /// This worker's parents of task cgroups (what the watchdog empties).
    pub fn parents(&self) -> Vec<PathBuf> {
        match &self.kind {
            Kind::V2 { parent } => vec![parent.clone()],
            Kind::V1 { memory, pids, cpu } => [Some(memory), pids.as_ref(), cpu.as_ref()]
                .into_iter()
                .flatten()
                .map(|h| h.parent.clone())
                .collect(),
        }
    }

    /// Remove the pool and this worker's parents on shutdown.
    pub fn cleanup(&self) {
        for t in self.pool.lock().unwrap().drain(..) {
            t.remove();
        }
        for p in self.parents() {
            let _ = std::fs::remove_dir(p);
        }
    }

    /// A cgroup for one attempt: an empty pooled one, or (for an attempt
    /// with memory, pids or cpu limits) a fresh one with the limits set.
    pub fn acquire(&self, limits: &Limits) -> std::io::Result<TaskCgroup> {
        let limited = limits.memory.is_some() || limits.pids.is_some() || limits.cpu.is_some();
        if !limited {
            if let Some(t) = self.pool.lock().unwrap().pop() {
                return Ok(t);
            }
        }
        let name = format!("t{}", self.next.fetch_add(1, Ordering::Relaxed));
        match &self.kind {
            Kind::V2 { parent } => {
                let dir = parent.join(&name);
                std::fs::create_dir(&dir)?;
                let set = |file: &str, v: String| write(&dir.join(file), &v);
                let r = (|| {
                    if let Some(m) = limits.memory {
                        set("memory.max", m.to_string())?;
                        if dir.join("memory.swap.max").exists() {
                            set("memory.swap.max", "0".into())?;
                        }
                    }
                    if let Some(p) = limits.pids {
                        set("pids.max", p.to_string())?;
                    }
                    if let Some(c) = limits.cpu {
                        let quota = ((c * CPU_PERIOD_US as f64) as u64).max(1000);
                        set("cpu.max", format!("{quota} {CPU_PERIOD_US}"))?;
                    }
                    Ok(dir.join("cgroup.procs"))
                })();
                match r {
                    Ok(procs) => Ok(TaskCgroup {
                        dir,
                        procs,
                        v1_tasks: Vec::new(),
                        v2: true,
                        limited,
                    }),
                    Err(e) => {
                        let _ = std::fs::remove_dir(&dir);
                        Err(e)
                    }
                }
            }
            Kind::V1 { memory, pids, cpu } => {
                let mut made: Vec<PathBuf> = Vec::new();
                let r = (|| {
                    let mut mk = |h: &Hierarchy| -> std::io::Result<(PathBuf, File)> {
                        let dir = h.parent.join(&name);
                        std::fs::create_dir(&dir)?;
                        made.push(dir.clone());
                        let tasks = std::fs::OpenOptions::new()
                            .write(true)
                            .open(dir.join("tasks"))?;
                        Ok((dir, tasks))
                    };
                    let mut tasks = vec![mk(memory)?];
                    let mdir = tasks[0].0.clone();
                    if let Some(m) = limits.memory {
                        write(&mdir.join("memory.limit_in_bytes"), &m.to_string())?;
                        if mdir.join("memory.memsw.limit_in_bytes").exists() {
                            let _ =
                                write(&mdir.join("memory.memsw.limit_in_bytes"), &m.to_string());
                        }
                    }
                    if let (Some(p), Some(h)) = (limits.pids, pids) {
                        let t = mk(h)?;
                        write(&t.0.join("pids.max"), &p.to_string())?;
                        tasks.push(t);
                    }
                    if let (Some(c), Some(h)) = (limits.cpu, cpu) {
                        let t = mk(h)?;
                        write(&t.0.join("cpu.cfs_period_us"), &CPU_PERIOD_US.to_string())?;
                        let quota = ((c * CPU_PERIOD_US as f64) as u64).max(1000);
                        write(&t.0.join("cpu.cfs_quota_us"), &quota.to_string())?;
                        tasks.push(t);
                    }
                    let procs = mdir.join("cgroup.procs");
                    Ok(TaskCgroup {
                        dir: mdir,
                        procs,
                        v1_tasks: tasks,
                        v2: false,
                        limited,
                    })
                })();
                if r.is_err() {
                    for d in made.iter().rev() {
                        let _ = std::fs::remove_dir(d);
                    }
                }
                r
            }
        }
    }

    /// Give an attempt's cgroup back once the attempt is over: emptied
    /// (every process left is SIGKILLed), then pooled, or removed if it had
    /// limits.
    /// Whether it ended empty: nothing of the attempt is left running.
    pub async fn release(&self, t: TaskCgroup) -> bool {
        let emptied = t.empty().await;
        if t.limited || !emptied {
            t.remove();
        } else {
            self.pool.lock().unwrap().push(t);
        }
        emptied
    }

    /// Run `spawn` so that the process it starts is born inside `t`: on v1
    /// this thread moves into the task's cgroups for the duration of the
    /// call (the spawn is synchronous, so nothing else runs on this thread
    /// meanwhile) and then back; on v2 the child joins from its `pre_exec`
    /// hook (`TaskCgroup::join_files`) and this only calls `spawn`.
    pub fn spawn_inside<T>(&self, t: &TaskCgroup, spawn: impl FnOnce() -> T) -> std::io::Result<T> {
        let Kind::V1 { memory, pids, cpu } = &self.kind else {
            return Ok(spawn());
        };
        // "0" names the calling thread: the kernel then moves it without
        // the global thread-group lock a numeric tid takes (7x cheaper
        // here, and it does not stall every fork and exit meanwhile).
        let this_thread = b"0";
        let homes: Vec<&File> = [Some(memory), pids.as_ref(), cpu.as_ref()]
            .into_iter()
            .flatten()
            .map(|h| &h.home)
            .collect();
        let go_home = |n: usize| {
            // The memory hierarchy first, then as many as were joined.
            for h in homes.iter().take(n.max(1)) {
                if let Err(e) = (&**h).write_all(this_thread) {
                    tracing::error!("cannot move a worker thread back into its own cgroup: {e}");
                }
            }
        };
        for (joined, (_, f)) in t.v1_tasks.iter().enumerate() {
            if let Err(e) = (&*f).write_all(this_thread) {
                if joined > 0 {
                    go_home(homes.len());
                }
                return Err(e);
            }
        }
        let r = spawn();
        // pids/cpu are joined only with those limits; going home in every
        // hierarchy is harmless (the thread is there already).
        go_home(homes.len());
        Ok(r)
    }

    /// Kill and remove task cgroups left by dead workers: the
    /// `jetworker-<pid>-<n>` parents whose worker process is gone. Returns
    /// how many processes were killed.
    pub fn reap_stale(&self) -> usize {
        let mut n = 0;
        let bases: Vec<PathBuf> = self
            .parents()
            .iter()
            .filter_map(|d| d.parent().map(Path::to_path_buf))
            .collect();
        for base in bases {
            let Ok(rd) = std::fs::read_dir(&base) else {
                continue;
            };
            for e in rd.flatten() {
                let name = e.file_name().to_string_lossy().to_string();
                let stale = name
                    .strip_prefix("jetworker-")
                    .and_then(|rest| rest.split('-').next())
                    .and_then(|pid| pid.parse::<i32>().ok())
                    .is_some_and(|pid| {
                        pid as u32 != std::process::id()
                            && nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), None)
                                .is_err()
                    });
                if !stale {
                    continue;
                }
                if let Ok(tasks) = std::fs::read_dir(e.path()) {
                    for t in tasks.flatten().filter(|t| t.path().is_dir()) {
                        n += kill_procs_blocking(&t.path());
                        let _ = std::fs::remove_dir(t.path());
                    }
                }
                let _ = std::fs::remove_dir(e.path());
            }
        }
        n
    }
}

/// `jetworker-<pid>-<n>`: this runner's parent in each hierarchy.
fn instance_name() -> String {
    format!(
        "jetworker-{}-{}",
        std::process::id(),
        INSTANCE.fetch_add(1, Ordering::Relaxed)
    )
}

/// SIGKILL every process listed in `dir/cgroup.procs` until none is left
/// (at start-up, before any task runs); how many were killed.
fn kill_procs_blocking(dir: &Path) -> usize {
    let f = dir.join("cgroup.procs");
    let mut n = 0;
    for _ in 0..100 {
        let pids = read_pids(&f);
        if pids.is_empty() {
            break;
        }
        n += kill_all(&pids);
        std::thread::sleep(Duration::from_millis(10));
    }
    n
}

fn kill_all(pids: &[i32]) -> usize {
    for &p in pids {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(p),
            nix::sys::signal::Signal::SIGKILL,
        );
    }
    pids.len()
}

impl TaskCgroup {
    /// `cgroup.procs` files the child writes its pid to before exec (v2
    /// only; v1 children are born inside, see [`Cgroups::spawn_inside`]).
    pub fn join_files(&self) -> Vec<CString> {
        if self.v2 {
            vec![cstring(&self.dir.join("cgroup.procs"))]
        } else {
            Vec::new()
        }
    }

    /// Whether processes are left in the cgroup.
    pub fn occupied(&self) -> bool {
        !read_pids(&self.procs).is_empty()
    }

    /// SIGKILL what is in the cgroup now (one pass, no waiting): the
    /// moment the attempt's main process is gone, so escapees holding its
    /// pipes let go at once.
    pub fn kill_now(&self) {
        let pids = read_pids(&self.procs);
        if pids.is_empty() {
            return;
        }
        if !(self.v2 && write(&self.dir.join("cgroup.kill"), "1").is_ok()) {
            kill_all(&pids);
        }
    }

    /// Kill every process left in the cgroup and wait (up to a second and
    /// a half) until it is empty; whether it is. One read when it is empty
    /// already.
    pub async fn empty(&self) -> bool {
        let mut pids = read_pids(&self.procs);
        if pids.is_empty() {
            return true;
        }
        if self.v2 && write(&self.dir.join("cgroup.kill"), "1").is_ok() {
            pids.clear();
        }
        for _ in 0..150 {
            kill_all(&pids);
            tokio::time::sleep(Duration::from_millis(10)).await;
            pids = read_pids(&self.procs);
            if pids.is_empty() {
                return true;
            }
        }
        tracing::warn!(cgroup = %self.dir.display(), "processes survived SIGKILL in a task cgroup");
        false
    }

    /// Whether the kernel OOM-killed something in this cgroup (meaningful
    /// for a cgroup with a memory limit, which is always fresh).
    pub fn oom_killed(&self) -> bool {
        let file = if self.v2 {
            "memory.events"
        } else {
            "memory.oom_control"
        };
        let text = std::fs::read_to_string(self.dir.join(file)).unwrap_or_default();
        let from_events = text
            .lines()
            .filter_map(|l| l.strip_prefix("oom_kill "))
            .any(|n| n.trim().parse::<u64>().unwrap_or(0) > 0);
        if from_events || self.v2 {
            return from_events;
        }
        // Older v1 kernels: the limit was hit.
        std::fs::read_to_string(self.dir.join("memory.failcnt"))
            .ok()
            .and_then(|s| s.trim().parse::<u64>().ok())
            .is_some_and(|n| n > 0)
    }

    /// Remove the cgroup directories (after the processes are gone).
    fn remove(&self) {
        let dirs: Vec<&Path> = if self.v2 {
            vec![&self.dir]
        } else {
            self.v1_tasks.iter().map(|(d, _)| d.as_path()).collect()
        };
        for d in dirs {
            for _ in 0..50 {
                if std::fs::remove_dir(d).is_ok() || !d.exists() {
                    break;
                }
                kill_procs_blocking(d);
            }
        }
    }
}

/// Write this process's pid to each file (called in the child before exec:
/// only raw syscalls, no allocation).
///
/// # Safety
/// Must only be called in a freshly forked child.
pub unsafe fn join_in_child(files: &[CString]) -> std::io::Result<()> {
    let pid = libc::getpid();
    let mut buf = [0u8; 16];
    let mut i = buf.len();
    let mut v = pid as u32;
    loop {
        i -= 1;
        buf[i] = b'0' + (v % 10) as u8;
        v /= 10;
        if v == 0 {
            break;
        }
    }
    for f in files {
        let fd = libc::open(f.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC);
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        let n = libc::write(fd, buf[i..].as_ptr() as *const libc::c_void, buf.len() - i);
        libc::close(fd);
        if n < 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}
