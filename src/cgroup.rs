//! Per-task cgroups for `shell` and `command` tasks, where the cgroup tree
//! is writable: memory (with OOM detection), pids and CPU share limits that
//! hold for the whole process tree, and a reliable way to kill that tree.
//!
//! - cgroup v2 (unified): the worker moves itself into a leaf
//!   `<own>/jetworker-worker` (the "no internal processes" rule), enables
//!   the controllers in `<own>`, and creates `<own>/task-…` per task. This is
//!   what `Delegate=yes` in the systemd unit allows.
//! - cgroup v1 (legacy/hybrid): per controller, `<own>/jetworker-<pid>-<n>/task-…`.
//!
//! Never the worker's own cgroup: limits go to the task's. Where nothing is
//! writable (most containers), [`Cgroups::detect`] returns `None` and tasks
//! get rlimits only.

use std::ffi::CString;
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::protocol::Limits;

const CPU_PERIOD_US: u64 = 100_000;

/// Tells apart the runners of one process (tests start several workers in
/// one process), so that each owns its v1 parent: `jetworker-<pid>-<n>`.
static INSTANCE: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);

/// Where task cgroups are made.
#[derive(Debug, Clone)]
pub enum Cgroups {
    V2 {
        parent: PathBuf,
    },
    V1 {
        memory: Option<PathBuf>,
        pids: Option<PathBuf>,
        cpu: Option<PathBuf>,
    },
}

/// One task's cgroup(s).
#[derive(Debug)]
pub struct TaskCgroup {
    v2: bool,
    /// One directory (v2) or one per controller (v1); memory first if any.
    dirs: Vec<PathBuf>,
    memory_dir: Option<PathBuf>,
    /// `cgroup.procs` files to join, prepared for the child.
    join: Vec<CString>,
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

impl Cgroups {
    /// Find a writable place for task cgroups, or `None` (with the reason
    /// for the log).
    pub fn detect() -> Result<Self, String> {
        let root = Path::new("/sys/fs/cgroup");
        if root.join("cgroup.controllers").exists() {
            return Self::detect_v2(root);
        }
        Self::detect_v1(root)
    }

    fn detect_v2(root: &Path) -> Result<Self, String> {
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
        let parent = if own_dir.ends_with("jetworker-worker") {
            own_dir.parent().map(Path::to_path_buf).unwrap_or(own_dir)
        } else {
            own_dir
        };
        let enable: String = wanted.iter().map(|c| format!("+{c} ")).collect();
        write(&parent.join("cgroup.subtree_control"), enable.trim())
            .map_err(|e| format!("cannot enable controllers in {}: {e}", parent.display()))?;
        Ok(Cgroups::V2 { parent })
    }

    fn detect_v1(root: &Path) -> Result<Self, String> {
        let own = own_cgroups();
        let instance = INSTANCE.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let place = |ctrl: &str| -> Option<PathBuf> {
            let path = own
                .iter()
                .find(|(c, _)| c.split(',').any(|x| x == ctrl))
                .map(|(_, p)| p.clone())?;
            // `cpu` is often a link to `cpu,cpuacct`; either way it resolves.
            let mount = root.join(ctrl);
            if !mount.join("cgroup.procs").exists() {
                return None;
            }
            let dir = mount
                .join(path.trim_start_matches('/'))
                .join(format!("jetworker-{}-{instance}", std::process::id()));
            std::fs::create_dir_all(&dir).ok()?;
            Some(dir)
        };
        let memory = place("memory");
        if memory.is_none() {
            return Err("no writable cgroup v2 tree or v1 memory controller".into());
        }
        Ok(Cgroups::V1 {
            memory,
            pids: place("pids"),
            cpu: place("cpu"),
        })
    }

    /// Remove this worker's (empty) v1 parents on shutdown.
    pub fn cleanup(&self) {
        if let Cgroups::V1 { memory, pids, cpu } = self {
            for d in [memory, pids, cpu].into_iter().flatten() {
                let _ = std::fs::remove_dir(d);
            }
        }
    }

    /// Whether a task with these limits needs a cgroup.
    pub fn wanted(limits: &Limits) -> bool {
        limits.memory.is_some() || limits.pids.is_some() || limits.cpu.is_some()
    }

    /// Make a task's cgroup with its limits.
    pub fn create(&self, name: &str, limits: &Limits) -> std::io::Result<TaskCgroup> {
        match self {
            Cgroups::V2 { parent } => {
                let dir = parent.join(format!("task-{name}"));
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
                    Ok(())
                })();
                if let Err(e) = r {
                    let _ = std::fs::remove_dir(&dir);
                    return Err(e);
                }
                Ok(TaskCgroup {
                    v2: true,
                    join: vec![cstring(&dir.join("cgroup.procs"))],
                    memory_dir: Some(dir.clone()),
                    dirs: vec![dir],
                })
            }
            Cgroups::V1 { memory, pids, cpu } => {
                let mut t = TaskCgroup {
                    v2: false,
                    dirs: Vec::new(),
                    memory_dir: None,
                    join: Vec::new(),
                };
                let mut add = |base: &Option<PathBuf>,
                               f: &dyn Fn(&Path) -> std::io::Result<()>|
                 -> std::io::Result<Option<PathBuf>> {
                    let Some(base) = base else { return Ok(None) };
                    let dir = base.join(format!("task-{name}"));
                    std::fs::create_dir(&dir)?;
                    t.dirs.push(dir.clone());
                    f(&dir)?;
                    t.join.push(cstring(&dir.join("cgroup.procs")));
                    Ok(Some(dir))
                };
                let r = (|| {
                    t.memory_dir = add(memory, &|d| {
                        if let Some(m) = limits.memory {
                            write(&d.join("memory.limit_in_bytes"), &m.to_string())?;
                            if d.join("memory.memsw.limit_in_bytes").exists() {
                                let _ =
                                    write(&d.join("memory.memsw.limit_in_bytes"), &m.to_string());
                            }
                        }
                        Ok(())
                    })?;
                    if let Some(p) = limits.pids {
                        add(pids, &|d| write(&d.join("pids.max"), &p.to_string()))?;
                    }
                    if let Some(c) = limits.cpu {
                        add(cpu, &|d| {
                            write(&d.join("cpu.cfs_period_us"), &CPU_PERIOD_US.to_string())?;
                            let quota = ((c * CPU_PERIOD_US as f64) as u64).max(1000);
                            write(&d.join("cpu.cfs_quota_us"), &quota.to_string())
                        })?;
                    }
                    Ok(())
                })();
                if let Err(e) = r {
                    t.remove();
                    return Err(e);
                }
                Ok(t)
            }
        }
    }

    /// Kill and remove task cgroups left by dead workers (v1: the
    /// `jetworker-<pid>-<n>` parents of processes that are gone).
    pub fn reap_stale(&self) -> usize {
        let mut n = 0;
        let parents: Vec<PathBuf> = match self {
            Cgroups::V2 { parent } => vec![parent.clone()],
            Cgroups::V1 { memory, pids, cpu } => [memory, pids, cpu]
                .into_iter()
                .flatten()
                .filter_map(|d| d.parent().map(Path::to_path_buf))
                .collect(),
        };
        for p in parents {
            let Ok(rd) = std::fs::read_dir(&p) else {
                continue;
            };
            for e in rd.flatten() {
                let name = e.file_name().to_string_lossy().to_string();
                let stale_parent = name
                    .strip_prefix("jetworker-")
                    .and_then(|rest| rest.split('-').next())
                    .and_then(|pid| pid.parse::<i32>().ok())
                    .is_some_and(|pid| {
                        pid as u32 != std::process::id()
                            && nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), None)
                                .is_err()
                    });
                if stale_parent {
                    if let Ok(tasks) = std::fs::read_dir(e.path()) {
                        for t in tasks.flatten().filter(|t| t.path().is_dir()) {
                            n += kill_procs(&t.path());
                            let _ = std::fs::remove_dir(t.path());
                        }
                    }
                    let _ = std::fs::remove_dir(e.path());
                }
            }
        }
        n
    }
}

fn cstring(p: &Path) -> CString {
    CString::new(p.as_os_str().as_encoded_bytes()).expect("cgroup path without NUL")
}

/// SIGKILL every process listed in `dir/cgroup.procs`; how many.
fn kill_procs(dir: &Path) -> usize {
    let mut n = 0;
    for _ in 0..20 {
        let pids: Vec<i32> = std::fs::read_to_string(dir.join("cgroup.procs"))
            .unwrap_or_default()
            .lines()
            .filter_map(|l| l.trim().parse().ok())
            .collect();
        if pids.is_empty() {
            break;
        }
        for p in pids {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(p),
                nix::sys::signal::Signal::SIGKILL,
            );
            n += 1;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    n
}

impl TaskCgroup {
    /// `cgroup.procs` files the child writes its pid to before exec.
    pub fn join_files(&self) -> Vec<CString> {
        self.join.clone()
    }

    /// Kill every process left in the cgroup.
    pub fn kill_all(&self) {
        if self.v2 {
            if let Some(d) = self.dirs.first() {
                if write(&d.join("cgroup.kill"), "1").is_ok() {
                    return;
                }
            }
        }
        for d in &self.dirs {
            kill_procs(d);
        }
    }

    /// Whether the kernel OOM-killed something in this cgroup.
    pub fn oom_killed(&self) -> bool {
        let Some(d) = &self.memory_dir else {
            return false;
        };
        let file = if self.v2 {
            "memory.events"
        } else {
            "memory.oom_control"
        };
        let text = std::fs::read_to_string(d.join(file)).unwrap_or_default();
        let from_events = text
            .lines()
            .filter_map(|l| l.strip_prefix("oom_kill "))
            .any(|n| n.trim().parse::<u64>().unwrap_or(0) > 0);
        if from_events || self.v2 {
            return from_events;
        }
        // Older v1 kernels: the limit was hit.
        std::fs::read_to_string(d.join("memory.failcnt"))
            .ok()
            .and_then(|s| s.trim().parse::<u64>().ok())
            .is_some_and(|n| n > 0)
    }

    /// Remove the cgroup directories (after the processes are gone).
    pub fn remove(&self) {
        for d in &self.dirs {
            for _ in 0..50 {
                if std::fs::remove_dir(d).is_ok() || !d.exists() {
                    break;
                }
                kill_procs(d);
                std::thread::sleep(Duration::from_millis(10));
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
