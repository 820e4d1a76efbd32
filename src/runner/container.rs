//! The `container` runner (DESIGN.md 3.4): one Docker container per attempt,
//! driven through the Docker Engine API (bollard), never the `docker` CLI.
//!
//! An attempt goes: make sure the image is there (pull policy) → create the
//! container (image, entrypoint, args, environment, workdir, user, network,
//! memory / CPU / pids limits, labels) → attach to its stdout and stderr →
//! start it → stream the output into the sink while waiting for it to exit →
//! inspect it (exit code, OOM kill) → remove it.
//!
//! Output comes from an attach made before the start, not from the logs
//! endpoint: the engine's log files rotate (a flood of short lines costs
//! ~30× its size in json-file format and loses its beginning), and an
//! attached stream applies back-pressure instead of dropping anything. The
//! log driver is therefore `none`: nothing piles up on the engine's disk. Timeout and stop (cancel, shutdown, lease loss) ask
//! the engine to stop the container with the grace period, then kill it; the
//! container is removed (forced) on every path, including errors and an
//! attempt future that is dropped half-way.
//!
//! A memory-limited container that dies of SIGKILL fails naming the limit:
//! "killed by the out-of-memory killer" when the engine recorded the OOM
//! kill, "may have been exceeded" when it did not (the engine can miss it).
//!
//! The one thing the runner cannot do in-process is outlive a SIGKILL of the
//! worker: the engine keeps such a container running. Every container is
//! therefore labelled with the worker's identity (see [`WorkerIdentity`]),
//! and [`ContainerRunner::remove_leftovers`], called when a worker starts,
//! removes the containers whose worker is provably gone.
//!
//! The engine is contacted lazily and the API version negotiated on first
//! use, so a worker started before Docker still picks it up later; until
//! then [`ContainerRunner::available`] is false and container tasks fail
//! with "Docker Engine not reachable at …".

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use bollard::container::LogOutput;
use bollard::errors::Error as DockerError;
use bollard::models::{ContainerCreateBody, HostConfig, HostConfigLogConfig, ResourcesUlimits};
use bollard::query_parameters::{
    AttachContainerOptionsBuilder, CreateContainerOptionsBuilder, CreateImageOptionsBuilder,
    KillContainerOptionsBuilder, ListContainersOptionsBuilder, RemoveContainerOptionsBuilder,
    StopContainerOptionsBuilder, WaitContainerOptionsBuilder,
};
use bollard::Docker;
use futures::Stream;
use futures::StreamExt;
use tokio::time::{sleep_until, timeout, Instant};

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::supervise::{Clock, OutputSource, Supervised};
use super::{fields_schema_of, timeout_reason, Fields, Outcome, RunContext, Runner};
use crate::output::{Captured, OutputSink, StreamKind};
use crate::protocol::{
    check_env_pair, format_size, parse_size, truncate_for_error, Invalid, Status, Task,
};

/// When to pull a container image.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "kebab-case")]
pub enum PullPolicy {
    /// Never: the image must be there.
    Never,
    /// When the engine does not have it (the default).
    #[default]
    IfMissing,
    /// Before every attempt.
    Always,
}

/// The fields of a `container` task.
#[derive(Debug, Deserialize, JsonSchema)]
#[schemars(title = "container")]
struct ContainerFields {
    /// container: the image (required).
    image: Option<String>,
    /// Seed short form: shell → the script, http → the URL, container →
    /// docker-run options.
    payload: Option<String>,
    /// container: overrides the image's ENTRYPOINT.
    entrypoint: Option<Vec<String>>,
    /// command: arguments; container: overrides the image's CMD.
    args: Option<Vec<String>>,
    /// container: working directory inside the container.
    workdir: Option<String>,
    /// container: user (`uid[:gid]` or name).
    user: Option<String>,
    /// container: `none`, `bridge`, or a network the worker allows.
    network: Option<String>,
    /// container: `never`, `if-missing` (default) or `always`.
    pull: Option<PullPolicy>,
}

/// A validated container task.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct ContainerSpec {
    /// The image reference.
    pub image: String,
    /// Replaces the image's ENTRYPOINT.
    pub entrypoint: Option<Vec<String>>,
    /// Replaces the image's CMD.
    pub args: Option<Vec<String>>,
    /// The task's environment plus `--env` options of the seed form.
    pub env: BTreeMap<String, String>,
    /// Working directory inside the container.
    pub workdir: Option<String>,
    /// User inside the container.
    pub user: Option<String>,
    /// Network (`none`, `bridge`, or an allowed one).
    pub network: Option<String>,
    /// When to pull the image.
    pub pull: PullPolicy,
    /// Memory limit in bytes.
    pub memory: Option<u64>,
    /// CPU limit in cores.
    pub cpus: Option<f64>,
}

/// Label: the task id of the attempt the container runs.
pub const LABEL_TASK_ID: &str = "jetworker.task-id";
/// Label: the attempt number.
pub const LABEL_ATTEMPT: &str = "jetworker.attempt";
/// Label: the id of the worker process that created the container.
pub const LABEL_WORKER_ID: &str = "jetworker.worker-id";
/// Label: the configured worker name (`--name`), stable across restarts.
pub const LABEL_WORKER_NAME: &str = "jetworker.worker-name";
/// Label: the host name of the machine (or container) the worker runs on.
pub const LABEL_WORKER_HOST: &str = "jetworker.worker-host";
/// Label: the worker's pid, as seen in its own PID namespace.
pub const LABEL_WORKER_PID: &str = "jetworker.worker-pid";
/// Label: the worker's start time (clock ticks since boot, `/proc/<pid>/stat`
/// field 22), which tells a live worker from a later process that reuses
/// its pid.
pub const LABEL_WORKER_STARTED: &str = "jetworker.worker-started";
/// Label: the worker's PID namespace (`/proc/self/ns/pid` link), without
/// which a pid means nothing.
pub const LABEL_WORKER_PIDNS: &str = "jetworker.worker-pidns";

/// How long the engine may take to answer the first ping.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// Timeout of a single Engine API request (until the response headers;
/// streamed bodies such as logs are not bounded by it).
const REQUEST_TIMEOUT_SECS: u64 = 120;
/// How long to keep reading output after the container exited, in case the
/// attached stream lags behind the exit.
const LOG_DRAIN: Duration = Duration::from_secs(2);
/// After SIGKILL, how long to wait for the engine to report the exit before
/// giving up on the container (it is removed by force anyway).
const KILL_CONFIRM: Duration = Duration::from_secs(10);
/// Bound on the final forced removal.
const REMOVE_TIMEOUT: Duration = Duration::from_secs(60);
/// Bound on create + attach + start together; these requests are never
/// abandoned half-way for a timeout or a stop (see [`ContainerRunner::run`]).
const START_TIMEOUT: Duration = Duration::from_secs(60);
/// How long a removal keeps trying when the engine says "no such container"
/// although a create request may still be in flight (an abandoned create
/// completes on the engine all the same).
const REMOVE_PATIENCE: Duration = Duration::from_secs(10);
/// How long to wait for the engine to record an OOM kill after a SIGKILLed
/// exit: the OOM event is processed apart from the exit, and may lag. (It
/// may also be lost: Docker 20.10 on cgroup v1 missed about one in ten in
/// testing, flag and `oom` event alike; hence the fallback wording in
/// [`supervise`] rather than a longer wait.)
const OOM_CONFIRM: Duration = Duration::from_millis(500);

/// The container's output, as attached before the start.
type OutputStream = std::pin::Pin<Box<dyn Stream<Item = Result<LogOutput, DockerError>> + Send>>;

/// Who created a container: enough to decide, from another process on the
/// same Docker Engine, whether that worker is still alive.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerIdentity {
    /// Unique per process (`<name>-<random>`).
    pub worker_id: String,
    /// Configured name; the same across restarts of one deployment.
    pub worker_name: String,
    /// Host name; containers of other hosts are never touched.
    pub host: String,
    /// Process id.
    pub pid: u32,
    /// Start time in clock ticks since boot, where `/proc` has it.
    pub started: Option<u64>,
    /// PID namespace, where `/proc` has it.
    pub pidns: Option<String>,
}

impl WorkerIdentity {
    /// The identity of this process.
    pub fn current(worker_id: &str, worker_name: &str) -> Self {
        let pid = std::process::id();
        WorkerIdentity {
            worker_id: worker_id.to_string(),
            worker_name: worker_name.to_string(),
            host: hostname::get()
                .map(|h| h.to_string_lossy().into_owned())
                .unwrap_or_default(),
            pid,
            started: process_start_time(pid),
            pidns: std::fs::read_link("/proc/self/ns/pid")
                .ok()
                .map(|p| p.to_string_lossy().into_owned()),
        }
    }

    /// The identity labels put on every container.
    pub fn labels(&self) -> HashMap<String, String> {
        let mut l = HashMap::new();
        l.insert(LABEL_WORKER_ID.into(), self.worker_id.clone());
        l.insert(LABEL_WORKER_NAME.into(), self.worker_name.clone());
        l.insert(LABEL_WORKER_HOST.into(), self.host.clone());
        l.insert(LABEL_WORKER_PID.into(), self.pid.to_string());
        if let Some(s) = self.started {
            l.insert(LABEL_WORKER_STARTED.into(), s.to_string());
        }
        if let Some(ns) = &self.pidns {
            l.insert(LABEL_WORKER_PIDNS.into(), ns.clone());
        }
        l
    }

    /// Whether a container with these labels is a leftover of a worker that
    /// is gone, from the point of view of `self` (a worker starting up).
    /// `alive(pid, started)` says whether that process exists in our PID
    /// namespace (and, if `started` is known, started at that time).
    ///
    /// The rule, conservative where it cannot know:
    /// - never a container of another host, or of this very process, or
    ///   one without our identity labels (not made by a jetworker worker);
    /// - same PID namespace: a leftover iff its worker process is gone (pid
    ///   dead, or reused by a process with another start time) — whatever
    ///   that worker's name was, an orphan is an orphan;
    /// - another PID namespace (a containerized worker that was restarted
    ///   gets a fresh one; its pid 1 says nothing to us): a leftover iff the
    ///   worker *name* is ours, i.e. it is an earlier life of this
    ///   deployment. Two live workers that share a host name and a worker
    ///   name in different PID namespaces on one engine would remove each
    ///   other's containers: give them distinct `--name`s.
    pub fn is_leftover(
        &self,
        labels: &HashMap<String, String>,
        alive: impl Fn(u32, Option<u64>) -> bool,
    ) -> bool {
        let get = |k: &str| labels.get(k).map(String::as_str);
        if get(LABEL_WORKER_HOST) != Some(self.host.as_str()) {
            return false;
        }
        let Some(id) = get(LABEL_WORKER_ID) else {
            return false;
        };
        if id == self.worker_id {
            return false;
        }
        let Some(pid) = get(LABEL_WORKER_PID).and_then(|p| p.parse::<u32>().ok()) else {
            return false;
        };
        let same_ns = match (get(LABEL_WORKER_PIDNS), &self.pidns) {
            (Some(theirs), Some(ours)) => theirs == ours,
            // Without namespace information (not Linux), assume one.
            _ => true,
        };
        if !same_ns {
            return get(LABEL_WORKER_NAME) == Some(self.worker_name.as_str());
        }
        let started = get(LABEL_WORKER_STARTED).and_then(|s| s.parse::<u64>().ok());
        !alive(pid, started)
    }
}

/// Start time of a process (clock ticks since boot), from `/proc`.
fn process_start_time(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command name (which may contain spaces) start with
    // field 3 (state); the start time is field 22.
    let rest = stat.rsplit_once(')')?.1;
    rest.split_whitespace().nth(19)?.parse().ok()
}

/// Whether `pid` is a live (non-zombie) process in our PID namespace,
/// started at `started` when that is known.
fn process_alive(pid: u32, started: Option<u64>) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => {
            let rest = stat.rsplit_once(')').map(|r| r.1).unwrap_or("");
            if rest.trim_start().starts_with('Z') {
                return false;
            }
            match (started, process_start_time(pid)) {
                (Some(want), Some(have)) => want == have,
                _ => true,
            }
        }
        // No /proc entry: gone (or no /proc at all: ask the kernel).
        Err(_) if std::path::Path::new("/proc/self/stat").exists() => false,
        Err(_) => nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid as i32), None).is_ok(),
    }
}

/// Runs `container` tasks on a Docker Engine.
pub struct ContainerRunner {
    /// Where the engine is: `--docker-host`, else `DOCKER_HOST`, else the
    /// local socket. Named in every "not reachable" error.
    endpoint: String,
    /// The connected, version-negotiated client; `None` until the engine
    /// first answers (so that it is retried on the next use).
    docker: tokio::sync::Mutex<Option<Docker>>,
    /// Network of tasks that name none (the worker's `default_network`,
    /// else `bridge`).
    default_network: Option<String>,
    /// Put on every container; see [`WorkerIdentity::is_leftover`].
    me: WorkerIdentity,
    /// Networks a task may name besides `none` and `bridge`.
    allowed_networks: Vec<String>,
}

impl ContainerRunner {
    /// A runner for the engine at `docker_host` (`unix:///path`,
    /// `tcp://host:port`, `http://…`; default `DOCKER_HOST`, else
    /// `unix:///var/run/docker.sock`). Never fails: an unreachable engine
    /// shows as [`available`](Self::available) = false and as failed
    /// container tasks.
    pub fn new(
        docker_host: Option<&str>,
        default_network: Option<String>,
        allowed_networks: Vec<String>,
        worker_id: &str,
        worker_name: &str,
    ) -> Self {
        let endpoint = docker_host
            .map(str::to_string)
            .or_else(|| std::env::var("DOCKER_HOST").ok().filter(|h| !h.is_empty()))
            .unwrap_or_else(|| "unix:///var/run/docker.sock".to_string());
        ContainerRunner {
            endpoint,
            docker: tokio::sync::Mutex::new(None),
            default_network,
            me: WorkerIdentity::current(worker_id, worker_name),
            allowed_networks,
        }
    }

    /// Validation only (the CLI): tasks may name `allowed_networks`; the
    /// engine is never contacted unless a task is run.
    pub(crate) fn validator(allowed_networks: Vec<String>) -> Self {
        ContainerRunner {
            endpoint: String::new(),
            docker: tokio::sync::Mutex::new(None),
            default_network: None,
            // Never labels a container: no host name or /proc to read.
            me: WorkerIdentity {
                worker_id: String::new(),
                worker_name: String::new(),
                host: String::new(),
                pid: 0,
                started: None,
                pidns: None,
            },
            allowed_networks,
        }
    }

    /// This worker's identity as labelled on its containers.
    pub fn identity(&self) -> &WorkerIdentity {
        &self.me
    }

    /// Whether the engine answers (container tasks can run here).
    pub async fn engine_answers(&self) -> bool {
        self.engine().await.is_ok()
    }

    /// The connected client, connecting and negotiating the API version on
    /// first use; the error is the reason a container task fails.
    async fn engine(&self) -> Result<Docker, String> {
        let mut slot = self.docker.lock().await;
        if let Some(d) = slot.as_ref() {
            return Ok(d.clone());
        }
        let unreachable =
            |why: String| format!("Docker Engine not reachable at {}: {why}", self.endpoint);
        let docker = connect(&self.endpoint).map_err(|e| unreachable(docker_error(&e)))?;
        // Old engines refuse requests for a newer API version than theirs;
        // negotiation lowers the client's version to the engine's.
        let docker = match timeout(CONNECT_TIMEOUT, docker.negotiate_version()).await {
            Ok(Ok(d)) => d,
            Ok(Err(e)) => return Err(unreachable(docker_error(&e))),
            Err(_) => {
                return Err(unreachable(format!(
                    "no answer within {}",
                    humantime::format_duration(CONNECT_TIMEOUT)
                )))
            }
        };
        *slot = Some(docker.clone());
        Ok(docker)
    }

    /// Remove the containers left behind by workers of this host that died
    /// without cleaning up (SIGKILL, power loss), according to
    /// [`WorkerIdentity::is_leftover`]. Called once when the worker starts;
    /// returns how many were removed. Problems (engine unreachable, a
    /// removal that fails) are logged, never fatal.
    pub async fn remove_leftovers(&self) -> usize {
        let docker = match self.engine().await {
            Ok(d) => d,
            Err(e) => {
                tracing::debug!("not looking for leftover containers: {e}");
                return 0;
            }
        };
        let filters = HashMap::from([(
            "label".to_string(),
            vec![format!("{LABEL_WORKER_HOST}={}", self.me.host)],
        )]);
        let list = docker
            .list_containers(Some(
                ListContainersOptionsBuilder::new()
                    .all(true)
                    .filters(&filters)
                    .build(),
            ))
            .await;
        let containers = match list {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!(
                    "cannot list containers to remove leftovers: {}",
                    docker_error(&e)
                );
                return 0;
            }
        };
        let mut removed = 0;
        for c in containers {
            let labels = c.labels.unwrap_or_default();
            let Some(id) = c.id else { continue };
            if !self.me.is_leftover(&labels, process_alive) {
                continue;
            }
            let task = labels.get(LABEL_TASK_ID).map(String::as_str).unwrap_or("?");
            let owner = labels
                .get(LABEL_WORKER_ID)
                .map(String::as_str)
                .unwrap_or("?");
            match remove(&docker, &id).await {
                Ok(true) => {
                    removed += 1;
                    tracing::info!(container = %id, task, worker = owner, "removed leftover container of a worker that is gone");
                }
                // Gone meanwhile (another worker got there first).
                Ok(false) => {}
                Err(e) => tracing::warn!(container = %id, "cannot remove leftover container: {e}"),
            }
        }
        removed
    }

    /// Run one attempt; every failure is an outcome.
    async fn run_attempt(&self, spec: &ContainerSpec, ctx: RunContext) -> Outcome {
        let docker = match self.engine().await {
            Ok(d) => d,
            Err(e) => return Outcome::failed(e),
        };
        let start = Instant::now();
        let deadline = start + ctx.timeout;
        let name = format!(
            "jetworker-{}-{}-{:08x}",
            ctx.task.id,
            ctx.attempt,
            rand::random::<u32>()
        );
        // Armed before the container exists: if this future is dropped
        // while a create request is in flight, the engine still creates it.
        let mut cleanup = Cleanup {
            docker: docker.clone(),
            name: name.clone(),
            armed: true,
        };
        let sink = OutputSink::new(ctx.output_cap, ctx.live.clone(), ctx.attempt);
        let early = |status, error| Outcome {
            status,
            exit_code: None,
            signal: None,
            http_status: None,
            output: Captured::default(),
            error: Some(error),
            permanent: false,
        };

        // The image: a pull can take long and holds nothing to clean up, so
        // timeout and stop cut it short.
        let pulled = tokio::select! {
            r = ensure_image(&docker, &spec.image, spec.pull) => r.map_err(|e| (Status::Failed, e)),
            _ = sleep_until(deadline) => Err((Status::Timeout, timeout_reason(ctx.timeout))),
            _ = ctx.stop.fired() => Err((Status::Cancelled, ctx.stop.reason_text())),
        };
        if let Err((status, error)) = pulled {
            cleanup.armed = false;
            return early(status, error);
        }

        // Create, attach, start: not raced against timeout or stop. An
        // abandoned create still completes on the engine, after a removal
        // by name would have found nothing; a timeout or stop that came
        // meanwhile is handled by `supervise` as soon as the container runs.
        let started = timeout(START_TIMEOUT, self.start(&docker, spec, &ctx, &name)).await;
        let outcome = match started {
            Ok(Ok(output)) => supervise(&docker, &name, output, spec, &ctx, deadline, sink).await,
            Ok(Err(error)) => early(Status::Failed, error),
            Err(_) => {
                // Requests were abandoned: the container may appear late.
                let _ = remove_eventually(&docker, &name).await;
                cleanup.armed = false;
                return early(
                    Status::Failed,
                    format!(
                        "the Docker Engine did not create and start the container within {}",
                        humantime::format_duration(START_TIMEOUT)
                    ),
                );
            }
        };

        // Disarmed only once the removal is done: if this future is dropped
        // while waiting for it, the guard tries again.
        match timeout(REMOVE_TIMEOUT, remove(&docker, &name)).await {
            Ok(Ok(_)) => {}
            Ok(Err(e)) => tracing::warn!(container = %name, "cannot remove container: {e}"),
            Err(_) => tracing::warn!(container = %name, "removing the container took too long"),
        }
        cleanup.armed = false;
        outcome
    }

    /// Create, attach, start; the attached output.
    async fn start(
        &self,
        docker: &Docker,
        spec: &ContainerSpec,
        ctx: &RunContext,
        name: &str,
    ) -> Result<OutputStream, String> {
        let body = self.create_body(spec, ctx);
        docker
            .create_container(
                Some(CreateContainerOptionsBuilder::new().name(name).build()),
                body,
            )
            .await
            .map_err(|e| format!("cannot create the container: {}", docker_error(&e)))?;
        // Before the start, so that not a byte is missed.
        let attached = docker
            .attach_container(
                name,
                Some(
                    AttachContainerOptionsBuilder::new()
                        .stream(true)
                        .stdout(true)
                        .stderr(true)
                        .build(),
                ),
            )
            .await
            .map_err(|e| format!("cannot attach to the container: {}", docker_error(&e)))?;
        docker
            .start_container(name, None)
            .await
            .map_err(|e| format!("cannot start the container: {}", docker_error(&e)))?;
        Ok(attached.output)
    }

    /// The create request: what the task asks for, the worker's labels,
    /// and the limits.
    fn create_body(&self, spec: &ContainerSpec, ctx: &RunContext) -> ContainerCreateBody {
        // The reserved variables and the task env, then the container's own
        // (task env again plus `-e` options of the seed payload).
        let mut env: BTreeMap<&str, &str> = BTreeMap::new();
        for (k, v) in ctx.env.iter().chain(spec.env.iter()) {
            env.insert(k, v);
        }
        let mut labels = self.me.labels();
        labels.insert(LABEL_TASK_ID.into(), ctx.task.id.clone());
        labels.insert(LABEL_ATTEMPT.into(), ctx.attempt.to_string());
        let limits = &ctx.task.limits;
        let network = spec
            .network
            .clone()
            .or_else(|| self.default_network.clone())
            .unwrap_or_else(|| "bridge".into());
        let host_config = HostConfig {
            network_mode: Some(network),
            memory: spec.memory.map(clamp_i64),
            // Equal to memory: no swap on top of the limit.
            memory_swap: spec.memory.map(clamp_i64),
            nano_cpus: spec.cpus.map(|c| (c * 1e9).round() as i64),
            pids_limit: limits.pids.map(clamp_i64),
            ulimits: limits.nofile.map(|n| {
                vec![ResourcesUlimits {
                    name: Some("nofile".into()),
                    soft: Some(clamp_i64(n)),
                    hard: Some(clamp_i64(n)),
                }]
            }),
            // Output is read from the attached stream (see the module docs);
            // a log file would only fill the engine's disk.
            log_config: Some(HostConfigLogConfig {
                typ: Some("none".into()),
                config: None,
            }),
            ..Default::default()
        };
        ContainerCreateBody {
            image: Some(spec.image.clone()),
            entrypoint: spec.entrypoint.clone(),
            cmd: spec.args.clone(),
            env: Some(env.iter().map(|(k, v)| format!("{k}={v}")).collect()),
            working_dir: spec.workdir.clone(),
            user: spec.user.clone(),
            labels: Some(labels),
            open_stdin: Some(false),
            tty: Some(false),
            host_config: Some(host_config),
            ..Default::default()
        }
    }
}

/// Removes the container if the attempt future is dropped before it could
/// do so itself (the worker aborting a task): a removal is spawned.
struct Cleanup {
    docker: Docker,
    name: String,
    armed: bool,
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            let docker = self.docker.clone();
            let name = std::mem::take(&mut self.name);
            rt.spawn(async move {
                if let Err(e) = remove_eventually(&docker, &name).await {
                    tracing::warn!(container = %name, "cannot remove container: {e}");
                }
            });
        }
    }
}

/// Connect (without talking to the engine yet).
fn connect(endpoint: &str) -> Result<Docker, DockerError> {
    if endpoint.starts_with('/') {
        return Docker::connect_with_unix(
            endpoint,
            REQUEST_TIMEOUT_SECS,
            bollard::API_DEFAULT_VERSION,
        );
    }
    Docker::connect_with_host(endpoint)
        .map(|d| d.with_timeout(Duration::from_secs(REQUEST_TIMEOUT_SECS)))
}

/// Force-remove a container and its anonymous volumes. `Ok(false)`: there
/// was no such container (or someone else is removing it).
async fn remove(docker: &Docker, name: &str) -> Result<bool, String> {
    let opts = RemoveContainerOptionsBuilder::new()
        .force(true)
        .v(true)
        .build();
    match docker.remove_container(name, Some(opts)).await {
        Ok(()) => Ok(true),
        Err(DockerError::DockerResponseServerError {
            status_code: 404, ..
        }) => Ok(false),
        // "removal already in progress": someone else finishes it.
        Err(DockerError::DockerResponseServerError {
            status_code: 409, ..
        }) => Ok(false),
        Err(e) => Err(docker_error(&e)),
    }
}

/// Remove a container that may not exist *yet*: after a create request was
/// abandoned, the engine may still be creating it. Tries until a removal
/// succeeds or [`REMOVE_PATIENCE`] has passed.
async fn remove_eventually(docker: &Docker, name: &str) -> Result<(), String> {
    let give_up = Instant::now() + REMOVE_PATIENCE;
    loop {
        let r = timeout(REMOVE_TIMEOUT, remove(docker, name))
            .await
            .unwrap_or_else(|_| Err("no answer from the engine".into()));
        match r {
            Ok(true) => return Ok(()),
            Ok(false) | Err(_) if Instant::now() < give_up => {
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
            Ok(false) => return Ok(()),
            Err(e) => return Err(e),
        }
    }
}

/// Apply the pull policy.
async fn ensure_image(docker: &Docker, image: &str, pull: PullPolicy) -> Result<(), String> {
    if pull != PullPolicy::Always {
        match docker.inspect_image(image).await {
            Ok(_) => return Ok(()),
            Err(DockerError::DockerResponseServerError {
                status_code: 404, ..
            }) if pull == PullPolicy::Never => {
                return Err(format!("image {image} not present and pull is never"))
            }
            Err(DockerError::DockerResponseServerError {
                status_code: 404, ..
            }) => {}
            Err(e) => {
                return Err(format!(
                    "cannot inspect image {image}: {}",
                    docker_error(&e)
                ))
            }
        }
    }
    let reference = with_default_tag(image);
    let mut progress = docker.create_image(
        Some(
            CreateImageOptionsBuilder::new()
                .from_image(&reference)
                .build(),
        ),
        None,
        None,
    );
    while let Some(step) = progress.next().await {
        step.map_err(|e| format!("cannot pull image {reference}: {}", docker_error(&e)))?;
    }
    Ok(())
}

/// `busybox` → `busybox:latest`: without a tag the engine would pull every
/// tag of the repository.
fn with_default_tag(image: &str) -> String {
    if image.contains('@') {
        return image.to_string();
    }
    let last = image.rsplit('/').next().unwrap_or(image);
    if last.contains(':') {
        image.to_string()
    } else {
        format!("{image}:latest")
    }
}

/// The container's output, for the supervision clock.
struct Logs(OutputStream, String);

impl OutputSource for Logs {
    async fn read_into(&mut self, sink: &mut OutputSink) -> bool {
        match self.0.next().await {
            Some(Ok(LogOutput::StdOut { message })) | Some(Ok(LogOutput::Console { message })) => {
                sink.push(StreamKind::Stdout, &message)
            }
            Some(Ok(LogOutput::StdErr { message })) => sink.push(StreamKind::Stderr, &message),
            Some(Ok(LogOutput::StdIn { .. })) => {}
            Some(Err(e)) => {
                tracing::warn!(container = %self.1, "output stream failed: {}", docker_error(&e));
                return false;
            }
            None => return false,
        }
        true
    }
}

/// A running container, for the supervision clock: its exit code.
struct Running<'a, W> {
    docker: &'a Docker,
    name: &'a str,
    wait: std::pin::Pin<&'a mut W>,
}

impl<W> Supervised for Running<'_, W>
where
    W: futures::Stream<Item = Result<bollard::models::ContainerWaitResponse, DockerError>>,
{
    type Exit = i64;
    async fn wait(&mut self) -> Result<i64, String> {
        match self.wait.next().await {
            Some(Ok(r)) => Ok(r.status_code),
            Some(Err(DockerError::DockerContainerWaitError { code, .. })) => Ok(code),
            Some(Err(e)) => Err(format!("lost track of the container: {}", docker_error(&e))),
            None => Err("lost track of the container: the wait ended without a status".into()),
        }
    }
    fn term(&mut self, grace: Duration) {
        polite_stop(self.docker, self.name, grace);
    }
    async fn kill(&mut self) {
        let _ = self
            .docker
            .kill_container(
                self.name,
                Some(KillContainerOptionsBuilder::new().signal("SIGKILL").build()),
            )
            .await;
    }
}

/// From start to exit: output into the sink, exit status, timeout, stop
/// (the shared clock, [`super::supervise`]), then the OOM check.
async fn supervise(
    docker: &Docker,
    name: &str,
    logs: OutputStream,
    spec: &ContainerSpec,
    ctx: &RunContext,
    deadline: Instant,
    mut sink: OutputSink,
) -> Outcome {
    let wait = docker.wait_container(
        name,
        Some(
            WaitContainerOptionsBuilder::new()
                .condition("not-running")
                .build(),
        ),
    );
    let wait = std::pin::pin!(wait);
    let mut running = Running { docker, name, wait };
    let mut logs = Logs(logs, name.to_string());
    let sup = super::supervise::supervise(
        &mut running,
        &mut logs,
        &mut sink,
        ctx,
        deadline,
        Clock {
            drain: LOG_DRAIN,
            kill_confirm: Some(KILL_CONFIRM),
            what: "the container",
            kill: "SIGKILL",
        },
    )
    .await;
    let by_clock = sup.stopped_by_clock(ctx);
    let (stopped, timed_out) = (sup.stopped, sup.timed_out);
    let exited = sup.exit;

    let exit_code = match &exited {
        Some(Ok(c)) => i32::try_from(*c).ok(),
        _ => None,
    };
    // The wait status says how it exited; inspect says whether the kernel's
    // OOM killer was involved. The engine records that from a separate
    // event, so a SIGKILLed task with a memory limit gets a moment for it.
    let sigkilled_alone = exit_code == Some(137) && !stopped && !timed_out;
    let confirm_until = Instant::now()
        + if sigkilled_alone && spec.memory.is_some() {
            OOM_CONFIRM
        } else {
            Duration::ZERO
        };
    let oom_killed = loop {
        let oom = match docker.inspect_container(name, None).await {
            Ok(info) => info.state.and_then(|s| s.oom_killed).unwrap_or(false),
            Err(_) => false,
        };
        if oom || Instant::now() >= confirm_until {
            break oom;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let (status, error) = if let Some((status, reason)) = by_clock {
        (status, Some(reason))
    } else {
        match exited {
            Some(Ok(_)) if oom_killed => (Status::Failed, Some(oom_reason(exit_code, spec.memory))),
            Some(Ok(0)) => (Status::Success, None),
            // SIGKILL from neither us nor a confirmed OOM kill: with a
            // memory limit, most likely the limit all the same.
            Some(Ok(137)) if spec.memory.is_some() => (
                Status::Failed,
                Some(format!(
                    "exit code 137 (SIGKILL; memory limit {} may have been exceeded)",
                    format_size(spec.memory.unwrap_or_default())
                )),
            ),
            Some(Ok(c)) => (Status::Failed, Some(format!("exit code {c}"))),
            Some(Err(e)) => (Status::Failed, Some(e)),
            None => (Status::Failed, Some("container state unknown".into())),
        }
    };
    Outcome {
        status,
        exit_code,
        signal: None,
        http_status: None,
        output: sink.finish().await,
        error,
        permanent: false,
    }
}

/// Ask the engine to stop the container: the image's stop signal, then
/// SIGKILL after `grace`. Not awaited (the request lasts until the
/// container is down); the supervisor keeps reading logs meanwhile and
/// kills on its own schedule should this request fail.
fn polite_stop(docker: &Docker, name: &str, grace: Duration) {
    let docker = docker.clone();
    let name = name.to_string();
    // Whole seconds; rounding up is safe because the supervisor's own kill
    // lands on time anyway.
    let secs = grace.as_secs_f64().ceil().min(i32::MAX as f64) as i32;
    tokio::spawn(async move {
        let _ = docker
            .stop_container(
                &name,
                Some(StopContainerOptionsBuilder::new().t(secs).build()),
            )
            .await;
    });
}

/// Words for an attempt the OOM killer ended, naming the limit.
fn oom_reason(exit_code: Option<i32>, memory: Option<u64>) -> String {
    let code = exit_code
        .map(|c| format!("exit code {c}: "))
        .unwrap_or_default();
    match memory {
        Some(m) => format!(
            "{code}killed by the out-of-memory killer: memory limit {} exceeded",
            format_size(m)
        ),
        None => format!("{code}killed by the out-of-memory killer (no memory limit set: the host ran out of memory)"),
    }
}

fn clamp_i64(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

/// An engine error in words: the engine's own message for API errors,
/// else the error and its causes.
fn docker_error(e: &DockerError) -> String {
    match e {
        DockerError::DockerResponseServerError {
            status_code,
            message,
        } => format!("{message} (HTTP {status_code})"),
        other => super::http::cause_chain(other),
    }
}

impl Runner for ContainerRunner {
    type Spec = ContainerSpec;

    fn name(&self) -> &str {
        "container"
    }

    fn fields_schema(&self) -> serde_json::Value {
        fields_schema_of::<ContainerFields>()
    }

    fn validate(&self, fields: &Fields, task: &Task) -> Result<ContainerSpec, Invalid> {
        validate(fields.parse()?, &self.allowed_networks, task)
    }

    async fn run(&self, spec: &ContainerSpec, ctx: RunContext) -> Outcome {
        self.run_attempt(spec, ctx).await
    }

    async fn available(&self) -> bool {
        self.engine_answers().await
    }
}

/// `docker run` options allowed in a container task's seed `payload`.
const SAFE_DOCKER_OPTS: &str =
    "-e/--env, -w/--workdir, -u/--user, --entrypoint, --network, --memory, --cpus";

/// Check a container task's fields (DESIGN.md 3.4).
fn validate(
    m: ContainerFields,
    allowed_networks: &[String],
    task: &Task,
) -> Result<ContainerSpec, Invalid> {
    let image = m
        .image
        .clone()
        .ok_or_else(|| Invalid::new("image", "missing (the image to run)"))?;
    if image.is_empty()
        || image.len() > 512
        || image.chars().any(|c| c.is_whitespace() || c.is_control())
    {
        return Err(Invalid::new("image", "not a valid image reference"));
    }
    let mut spec = ContainerSpec {
        image,
        entrypoint: m.entrypoint.clone(),
        args: m.args.clone(),
        env: task.env.clone(),
        workdir: m.workdir.clone(),
        user: m.user.clone(),
        network: m.network.clone(),
        pull: m.pull.unwrap_or_default(),
        memory: task.limits.memory,
        cpus: task.limits.cpu,
    };
    if let Some(p) = &m.payload {
        apply_docker_options(&mut spec, p)?;
    }
    if let Some(n) = &spec.network {
        if !(n == "none" || n == "bridge" || allowed_networks.iter().any(|a| a == n)) {
            return Err(Invalid::new(
                "network",
                format!(
                    "`{n}` is not allowed (none, bridge, or a network on the worker's allow list)"
                ),
            ));
        }
    }
    if let Some(ep) = &spec.entrypoint {
        if ep.is_empty() {
            return Err(Invalid::new("entrypoint", "must not be empty"));
        }
    }
    Ok(spec)
}

/// Parse the seed form's `docker run` options, accepting only the safe set.
fn apply_docker_options(spec: &mut ContainerSpec, payload: &str) -> Result<(), Invalid> {
    let words = shell_words::split(payload)
        .map_err(|e| Invalid::new("payload", format!("cannot split options: {e}")))?;
    let mut it = words.into_iter();
    while let Some(word) = it.next() {
        let (name, inline) = match word.split_once('=') {
            Some((n, v)) if n.starts_with("--") => (n.to_string(), Some(v.to_string())),
            _ => (word.clone(), None),
        };
        // Short options may carry their value glued on: -eK=V, -w/dir.
        let (name, inline) = if !name.starts_with("--")
            && name.starts_with('-')
            && name.len() > 2
            && name.is_char_boundary(2)
        {
            (name[..2].to_string(), Some(name[2..].to_string()))
        } else {
            (name, inline)
        };
        let canonical = match name.as_str() {
            "-e" | "--env" => "--env",
            "-w" | "--workdir" => "--workdir",
            "-u" | "--user" => "--user",
            "--entrypoint" | "--network" | "--memory" | "--cpus" => name.as_str(),
            _ if name.starts_with('-') => {
                return Err(Invalid::new(
                    "payload",
                    format!("docker option `{name}` is not allowed (allowed: {SAFE_DOCKER_OPTS})"),
                ))
            }
            _ => {
                return Err(Invalid::new(
                    "payload",
                    format!("unexpected word `{}`: payload holds docker run options only; the image goes in `image`, the command in `args`", truncate_for_error(&word)),
                ))
            }
        }
        .to_string();
        let value = match inline {
            Some(v) => v,
            None => it
                .next()
                .ok_or_else(|| Invalid::new("payload", format!("option `{name}` needs a value")))?,
        };
        match canonical.as_str() {
            "--env" => {
                let (k, v) = value.split_once('=').ok_or_else(|| {
                    Invalid::new("payload", format!("`{name} {value}`: expected K=V"))
                })?;
                check_env_pair(k, v, "payload --env")?;
                spec.env.insert(k.to_string(), v.to_string());
            }
            "--workdir" => spec.workdir = Some(value),
            "--user" => spec.user = Some(value),
            "--entrypoint" => spec.entrypoint = Some(vec![value]),
            "--network" => spec.network = Some(value),
            "--memory" => {
                let b = parse_size(&value).map_err(|e| Invalid::new("payload --memory", e))?;
                if b < 1024 * 1024 {
                    return Err(Invalid::new("payload --memory", "must be at least 1MiB"));
                }
                spec.memory = Some(b);
            }
            "--cpus" => {
                let c: f64 = value
                    .parse()
                    .ok()
                    .filter(|c: &f64| *c > 0.0 && *c <= 1024.0)
                    .ok_or_else(|| {
                        Invalid::new(
                            "payload --cpus",
                            format!("`{value}` is not a number of cores"),
                        )
                    })?;
                spec.cpus = Some(c);
            }
            _ => unreachable!(),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn me() -> WorkerIdentity {
        WorkerIdentity {
            worker_id: "w-new".into(),
            worker_name: "w".into(),
            host: "h1".into(),
            pid: 100,
            started: Some(5000),
            pidns: Some("pid:[1]".into()),
        }
    }

    fn labels_of(id: &WorkerIdentity) -> HashMap<String, String> {
        id.labels()
    }

    #[test]
    fn leftover_rules() {
        let me = me();
        let alive_none = |_: u32, _: Option<u64>| false;
        let alive_all = |_: u32, _: Option<u64>| true;

        // Our own containers are never leftovers.
        assert!(!me.is_leftover(&labels_of(&me), alive_none));

        // Same namespace: decided by the process.
        let old = WorkerIdentity {
            worker_id: "other-1".into(),
            worker_name: "someone-else".into(),
            pid: 42,
            started: Some(10),
            ..me.clone()
        };
        assert!(me.is_leftover(&labels_of(&old), alive_none));
        assert!(!me.is_leftover(&labels_of(&old), alive_all));
        let checks_start = |pid: u32, started: Option<u64>| pid == 42 && started == Some(11);
        assert!(me.is_leftover(&labels_of(&old), checks_start), "pid reused");

        // Other host: never.
        let remote = WorkerIdentity {
            host: "h2".into(),
            ..old.clone()
        };
        assert!(!me.is_leftover(&labels_of(&remote), alive_none));

        // Other namespace: only an earlier life of the same name.
        let earlier = WorkerIdentity {
            worker_id: "w-old".into(),
            pidns: Some("pid:[2]".into()),
            ..me.clone()
        };
        assert!(me.is_leftover(&labels_of(&earlier), alive_all));
        let stranger = WorkerIdentity {
            worker_name: "x".into(),
            ..earlier.clone()
        };
        assert!(!me.is_leftover(&labels_of(&stranger), alive_none));

        // Not ours at all.
        let mut foreign = HashMap::new();
        foreign.insert(LABEL_WORKER_HOST.to_string(), "h1".to_string());
        assert!(!me.is_leftover(&foreign, alive_none));
    }

    #[test]
    fn own_process_is_alive() {
        let me = WorkerIdentity::current("w-1", "w");
        assert!(process_alive(me.pid, me.started));
        if me.started.is_some() {
            assert!(!process_alive(me.pid, me.started.map(|s| s + 1)));
        }
    }

    #[test]
    fn default_tag() {
        assert_eq!(with_default_tag("busybox"), "busybox:latest");
        assert_eq!(with_default_tag("busybox:1.36"), "busybox:1.36");
        assert_eq!(
            with_default_tag("localhost:5000/team/app"),
            "localhost:5000/team/app:latest"
        );
        assert_eq!(with_default_tag("a/b@sha256:00"), "a/b@sha256:00");
    }

    #[test]
    fn oom_words() {
        assert_eq!(
            oom_reason(Some(137), Some(8 * 1024 * 1024)),
            "exit code 137: killed by the out-of-memory killer: memory limit 8MiB exceeded"
        );
    }
}
