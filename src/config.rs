//! Worker and connection settings: a TOML file, then environment
//! variables, then flags (each later source wins), validated into
//! [`WorkerConfig`] and [`ConnectConfig`] (DESIGN.md section 7).
//!
//! Flags and environment variables are read by clap (see [`crate::cli`]) as
//! plain strings; every value is converted here, so that a bad value from
//! any source produces the same one-line [`ConfigError`] naming the setting.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;

use crate::cli::{GlobalArgs, RunArgs};
use crate::protocol::{parse_duration, parse_size, valid_label, Names, TaskType};

/// A setting with a bad value: printed as one line, exit code 2.
#[derive(Debug, thiserror::Error)]
#[error("invalid setting {setting}: {problem}")]
pub struct ConfigError {
    pub setting: String,
    pub problem: String,
}

impl ConfigError {
    pub fn new(setting: impl Into<String>, problem: impl Into<String>) -> Self {
        ConfigError {
            setting: setting.into(),
            problem: problem.into(),
        }
    }
}

/// The TOML file: every key optional, unknown keys refused.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileConfig {
    pub server: Option<StringOrList>,
    pub creds: Option<PathBuf>,
    pub nkey: Option<PathBuf>,
    pub token: Option<String>,
    pub user: Option<String>,
    pub password: Option<String>,
    pub tls_ca: Option<PathBuf>,
    pub tls_cert: Option<PathBuf>,
    pub tls_key: Option<PathBuf>,
    pub name: Option<String>,
    pub labels: Option<StringOrList>,
    pub types: Option<StringOrList>,
    pub slots: Option<usize>,
    pub default_timeout: Option<String>,
    pub kill_grace: Option<String>,
    pub ack_wait: Option<String>,
    pub heartbeat: Option<String>,
    pub offline_after: Option<String>,
    pub drain_timeout: Option<String>,
    pub output_cap: Option<String>,
    pub max_task_bytes: Option<String>,
    pub state_dir: Option<PathBuf>,
    pub metrics_addr: Option<String>,
    pub log_format: Option<String>,
    pub log_level: Option<String>,
    pub pass_env: Option<StringOrList>,
    pub shell: Option<StringOrList>,
    pub task_user: Option<String>,
    pub allowed_networks: Option<StringOrList>,
    pub default_network: Option<String>,
    pub docker_host: Option<String>,
    pub deny_private_http: Option<bool>,
    pub on_lease_lost: Option<String>,
    pub cgroups: Option<String>,
    pub names: Option<Names>,
}

/// `"a,b"` or `["a", "b"]`.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum StringOrList {
    One(String),
    Many(Vec<String>),
}

impl StringOrList {
    fn into_vec(self) -> Vec<String> {
        match self {
            StringOrList::One(s) => split_list(&s),
            StringOrList::Many(v) => v,
        }
    }
}

fn split_list(s: &str) -> Vec<String> {
    s.split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(String::from)
        .collect()
}

impl FileConfig {
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|e| {
            ConfigError::new("config", format!("cannot read {}: {e}", path.display()))
        })?;
        toml::from_str(&text).map_err(|e| {
            let msg = e.message().to_string();
            ConfigError::new("config", format!("{}: {}", path.display(), msg.trim()))
        })
    }
}

/// How to reach NATS; shared by the worker and every CLI subcommand.
#[derive(Debug, Clone, Default)]
pub struct ConnectConfig {
    pub servers: Vec<String>,
    pub creds: Option<PathBuf>,
    pub nkey: Option<PathBuf>,
    pub token: Option<String>,
    pub user: Option<String>,
    pub password: Option<String>,
    pub tls_ca: Option<PathBuf>,
    pub tls_cert: Option<PathBuf>,
    pub tls_key: Option<PathBuf>,
    /// Stream, subject and bucket names.
    pub names: Names,
}

/// What the worker does with a task whose lease it lost while cut off from
/// NATS (the broker will have handed it to another worker).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LeaseLost {
    /// Kill the local copy and report it `cancelled` (default).
    Kill,
    /// Let it finish; its result is still reported.
    Keep,
}

/// Validated worker settings.
#[derive(Debug, Clone)]
pub struct WorkerConfig {
    pub connect: ConnectConfig,
    /// Base of the worker id (`<name>-<random>`).
    pub name: String,
    /// Labels (queues) served.
    pub labels: Vec<String>,
    /// Task types accepted; others are left for other workers... and
    /// rejected if they reach this one.
    pub types: Vec<TaskType>,
    /// Whether `types` was set: then a type that cannot run here (container
    /// without Docker) is still accepted and fails with a clear reason.
    pub types_explicit: bool,
    /// Maximum tasks running at once.
    pub slots: usize,
    pub default_timeout: Duration,
    pub kill_grace: Duration,
    pub ack_wait: Duration,
    pub heartbeat: Duration,
    pub offline_after: Duration,
    pub drain_timeout: Duration,
    /// Output cap per attempt, before clamping to the server's max_payload.
    pub output_cap: u64,
    pub max_task_bytes: usize,
    pub state_dir: PathBuf,
    pub metrics_addr: Option<SocketAddr>,
    /// Worker environment variables passed through to tasks.
    pub pass_env: Vec<String>,
    /// Shell and its flag for `shell` tasks (`["bash", "-c"]`).
    pub shell: Vec<String>,
    /// Run tasks as this user (worker must be root).
    pub task_user: Option<String>,
    pub allowed_networks: Vec<String>,
    pub default_network: Option<String>,
    pub docker_host: Option<String>,
    pub deny_private_http: bool,
    pub on_lease_lost: LeaseLost,
    /// Give shell/command tasks their own cgroup where the tree is writable.
    pub cgroups: bool,
}

/// Log settings, resolved before anything else so that errors are logged.
#[derive(Debug, Clone)]
pub struct LogConfig {
    pub json: bool,
    pub level: String,
}

fn pick<T>(flag_or_env: Option<T>, file: Option<T>) -> Option<T> {
    flag_or_env.or(file)
}

fn duration(setting: &str, v: Option<String>, default: Duration) -> Result<Duration, ConfigError> {
    match v {
        None => Ok(default),
        Some(s) => {
            let d = parse_duration(&s).map_err(|e| ConfigError::new(setting, e))?;
            Ok(d)
        }
    }
}

fn size(setting: &str, v: Option<String>, default: u64) -> Result<u64, ConfigError> {
    match v {
        None => Ok(default),
        Some(s) => parse_size(&s).map_err(|e| ConfigError::new(setting, e)),
    }
}

/// Load the config file named by `--config` / `JETWORKER_CONFIG`, if any.
pub fn load_file(global: &GlobalArgs) -> Result<FileConfig, ConfigError> {
    match &global.config {
        Some(p) => FileConfig::load(p),
        None => Ok(FileConfig::default()),
    }
}

/// Resolve the log settings (flags/env, then file, then defaults).
pub fn resolve_log(global: &GlobalArgs, file: &FileConfig) -> Result<LogConfig, ConfigError> {
    let format =
        pick(global.log_format.clone(), file.log_format.clone()).unwrap_or_else(|| "text".into());
    let json = match format.as_str() {
        "text" => false,
        "json" => true,
        other => {
            return Err(ConfigError::new(
                "log_format",
                format!("`{other}` is not text or json"),
            ))
        }
    };
    let level = global
        .log_level
        .clone()
        .or_else(|| std::env::var("RUST_LOG").ok().filter(|s| !s.is_empty()))
        .or_else(|| file.log_level.clone())
        .unwrap_or_else(|| "info".into());
    if tracing_subscriber::EnvFilter::try_new(&level).is_err() {
        return Err(ConfigError::new(
            "log_level",
            format!("`{level}` is not a log level or filter"),
        ));
    }
    Ok(LogConfig { json, level })
}

/// Resolve connection settings.
pub fn resolve_connect(
    global: &GlobalArgs,
    file: &FileConfig,
) -> Result<ConnectConfig, ConfigError> {
    // With no server from flags, NATS_URL or the file, the `nats` CLI's
    // selected context (if any) names the server and fills in its auth.
    let context = match (&global.server, &file.server) {
        (None, None) => match nats_context_dir() {
            Some(dir) => {
                let selected = std::env::var("NATS_CONTEXT").ok().filter(|s| !s.is_empty());
                load_nats_context(&dir, selected.as_deref())?
            }
            None => None,
        },
        _ => None,
    }
    .unwrap_or_default();
    let servers = match &global.server {
        Some(s) => split_list(s),
        None => file
            .server
            .clone()
            .map(StringOrList::into_vec)
            .or_else(|| context.url.as_deref().map(split_list))
            .unwrap_or_else(|| vec!["nats://127.0.0.1:4222".into()]),
    };
    if servers.is_empty() {
        return Err(ConfigError::new("server", "no server URL given"));
    }
    for s in &servers {
        let with_scheme = if s.contains("://") {
            s.clone()
        } else {
            format!("nats://{s}")
        };
        if reqwest::Url::parse(&with_scheme).is_err() {
            return Err(ConfigError::new(
                "server",
                format!("`{s}` is not a server URL"),
            ));
        }
    }
    let c = ConnectConfig {
        servers,
        creds: pick(global.creds.clone(), file.creds.clone()).or(context.creds),
        nkey: pick(global.nkey.clone(), file.nkey.clone()).or(context.nkey),
        token: pick(global.token.clone(), file.token.clone()).or(context.token),
        user: pick(global.user.clone(), file.user.clone()).or(context.user),
        password: pick(global.password.clone(), file.password.clone()).or(context.password),
        tls_ca: pick(global.tls_ca.clone(), file.tls_ca.clone()).or(context.ca),
        tls_cert: pick(global.tls_cert.clone(), file.tls_cert.clone()).or(context.cert),
        tls_key: pick(global.tls_key.clone(), file.tls_key.clone()).or(context.key),
        names: file.names.clone().unwrap_or_default(),
    };
    if c.tls_cert.is_some() != c.tls_key.is_some() {
        return Err(ConfigError::new(
            "tls_cert",
            "tls_cert and tls_key go together",
        ));
    }
    if c.user.is_some() != c.password.is_some() {
        return Err(ConfigError::new("user", "user and password go together"));
    }
    for (setting, p) in [
        ("creds", &c.creds),
        ("nkey", &c.nkey),
        ("tls_ca", &c.tls_ca),
        ("tls_cert", &c.tls_cert),
        ("tls_key", &c.tls_key),
    ] {
        if let Some(p) = p {
            if !p.is_file() {
                return Err(ConfigError::new(
                    setting,
                    format!("{} is not a readable file", p.display()),
                ));
            }
        }
    }
    for (setting, v) in [
        ("names.tasks_prefix", &c.names.tasks_prefix),
        ("names.schedules_prefix", &c.names.schedules_prefix),
        ("names.results_prefix", &c.names.results_prefix),
        ("names.dead_prefix", &c.names.dead_prefix),
        ("names.logs_prefix", &c.names.logs_prefix),
        ("names.tasks_stream", &c.names.tasks_stream),
        ("names.results_stream", &c.names.results_stream),
        ("names.dead_stream", &c.names.dead_stream),
        ("names.workers_bucket", &c.names.workers_bucket),
        ("names.cancel_bucket", &c.names.cancel_bucket),
    ] {
        if !valid_label(v) {
            return Err(ConfigError::new(
                setting,
                format!("`{v}` must be [A-Za-z0-9_-]{{1,64}}"),
            ));
        }
    }
    Ok(c)
}

/// The connection part of a `nats` CLI context
/// (`~/.config/nats/context/<name>.json`); empty strings count as unset.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct NatsContext {
    pub url: Option<String>,
    pub token: Option<String>,
    pub user: Option<String>,
    pub password: Option<String>,
    pub creds: Option<PathBuf>,
    pub nkey: Option<PathBuf>,
    pub ca: Option<PathBuf>,
    pub cert: Option<PathBuf>,
    pub key: Option<PathBuf>,
}

/// `$XDG_CONFIG_HOME/nats`, else `~/.config/nats` (where the `nats` CLI
/// keeps its contexts on every platform).
pub fn nats_context_dir() -> Option<PathBuf> {
    match std::env::var_os("XDG_CONFIG_HOME").filter(|v| !v.is_empty()) {
        Some(x) => Some(PathBuf::from(x).join("nats")),
        None => dirs::home_dir().map(|h| h.join(".config").join("nats")),
    }
}

/// The context named by `selected` (`NATS_CONTEXT`), else by
/// `<dir>/context.txt`; `None` when no context is selected. A selected
/// context that cannot be read is an error naming the file.
pub fn load_nats_context(
    dir: &Path,
    selected: Option<&str>,
) -> Result<Option<NatsContext>, ConfigError> {
    let name = match selected {
        Some(n) => n.to_string(),
        None => match std::fs::read_to_string(dir.join("context.txt")) {
            Ok(n) if !n.trim().is_empty() => n.trim().to_string(),
            _ => return Ok(None),
        },
    };
    if name.contains('/') || name.contains("..") {
        return Err(ConfigError::new(
            "nats context",
            format!("`{name}` is not a context name"),
        ));
    }
    let path = dir.join("context").join(format!("{name}.json"));
    let text = std::fs::read_to_string(&path).map_err(|e| {
        ConfigError::new(
            "nats context",
            format!("cannot read {}: {e}", path.display()),
        )
    })?;
    #[derive(Deserialize)]
    struct Raw {
        #[serde(default)]
        url: String,
        #[serde(default)]
        token: String,
        #[serde(default)]
        user: String,
        #[serde(default)]
        password: String,
        #[serde(default)]
        creds: String,
        #[serde(default)]
        nkey: String,
        #[serde(default)]
        ca: String,
        #[serde(default)]
        cert: String,
        #[serde(default)]
        key: String,
    }
    let raw: Raw = serde_json::from_str(&text)
        .map_err(|e| ConfigError::new("nats context", format!("{}: {e}", path.display())))?;
    let text_of = |s: String| Some(s).filter(|s| !s.is_empty());
    let path_of = |s: String| text_of(s).map(|s| expand_home(&s));
    Ok(Some(NatsContext {
        url: text_of(raw.url),
        token: text_of(raw.token),
        user: text_of(raw.user),
        password: text_of(raw.password),
        creds: path_of(raw.creds),
        nkey: path_of(raw.nkey),
        ca: path_of(raw.ca),
        cert: path_of(raw.cert),
        key: path_of(raw.key),
    }))
}

/// `~/x` → `$HOME/x` (contexts written by hand often use it).
fn expand_home(p: &str) -> PathBuf {
    match (p.strip_prefix("~/"), dirs::home_dir()) {
        (Some(rest), Some(h)) => h.join(rest),
        _ => PathBuf::from(p),
    }
}

/// Number of CPUs, the default for `slots`.
fn cpus() -> usize {
    std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
}

/// The default state directory: `$XDG_DATA_HOME/jetworker` or
/// `~/.local/share/jetworker`, `/var/lib/jetworker` for root without a home.
pub fn default_state_dir() -> PathBuf {
    dirs::data_dir()
        .map(|d| d.join("jetworker"))
        .unwrap_or_else(|| PathBuf::from("/var/lib/jetworker"))
}

/// An empty value (`JETWORKER_SLOTS=` in a compose file) means "not set".
fn unset_empty(run: &RunArgs) -> RunArgs {
    fn f(v: &Option<String>) -> Option<String> {
        v.clone().filter(|s| !s.trim().is_empty())
    }
    RunArgs {
        name: f(&run.name),
        labels: f(&run.labels),
        types: f(&run.types),
        slots: f(&run.slots),
        default_timeout: f(&run.default_timeout),
        kill_grace: f(&run.kill_grace),
        ack_wait: f(&run.ack_wait),
        heartbeat: f(&run.heartbeat),
        offline_after: f(&run.offline_after),
        drain_timeout: f(&run.drain_timeout),
        output_cap: f(&run.output_cap),
        max_task_bytes: f(&run.max_task_bytes),
        state_dir: run.state_dir.clone().filter(|p| !p.as_os_str().is_empty()),
        metrics_addr: f(&run.metrics_addr),
        pass_env: f(&run.pass_env),
        shell: f(&run.shell),
        task_user: f(&run.task_user),
        allowed_networks: f(&run.allowed_networks),
        default_network: f(&run.default_network),
        docker_host: f(&run.docker_host),
        deny_private_http: f(&run.deny_private_http),
        on_lease_lost: f(&run.on_lease_lost),
        cgroups: f(&run.cgroups),
    }
}

/// Resolve every worker setting.
pub fn resolve_worker(
    global: &GlobalArgs,
    run: &RunArgs,
    file: FileConfig,
) -> Result<WorkerConfig, ConfigError> {
    let connect = resolve_connect(global, &file)?;
    let run = &unset_empty(run);
    let name = run
        .name
        .clone()
        .or_else(|| std::env::var("WORKER_NAME").ok().filter(|s| !s.is_empty()))
        .or(file.name)
        .unwrap_or_else(|| {
            hostname::get()
                .ok()
                .and_then(|h| h.into_string().ok())
                .unwrap_or_else(|| "worker".into())
        });
    let name: String = name
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '_' {
                c
            } else {
                '-'
            }
        })
        .collect();
    if name.is_empty() || name.len() > 100 {
        return Err(ConfigError::new("name", "must be 1 to 100 characters"));
    }

    let labels = run
        .labels
        .as_deref()
        .map(split_list)
        .or_else(|| file.labels.map(StringOrList::into_vec))
        .unwrap_or_else(|| vec!["default".into()]);
    if labels.is_empty() {
        return Err(ConfigError::new("labels", "at least one label is needed"));
    }
    for l in &labels {
        if !valid_label(l) {
            return Err(ConfigError::new(
                "labels",
                format!("`{l}` is not [A-Za-z0-9_-]{{1,64}}"),
            ));
        }
    }
    let mut labels_dedup = labels.clone();
    labels_dedup.sort();
    labels_dedup.dedup();
    if labels_dedup.len() != labels.len() {
        return Err(ConfigError::new("labels", "a label is listed twice"));
    }

    let types_given = run.types.is_some() || file.types.is_some();
    let types = match run
        .types
        .as_deref()
        .map(split_list)
        .or_else(|| file.types.map(StringOrList::into_vec))
    {
        None => TaskType::ALL.to_vec(),
        Some(list) => {
            let mut v = Vec::new();
            for t in list {
                let tt: TaskType = t.parse().map_err(|e| ConfigError::new("types", e))?;
                if !v.contains(&tt) {
                    v.push(tt);
                }
            }
            if v.is_empty() {
                return Err(ConfigError::new("types", "at least one type is needed"));
            }
            v
        }
    };

    let slots = match run.slots.clone() {
        Some(s) => s
            .parse::<usize>()
            .map_err(|_| ConfigError::new("slots", format!("`{s}` is not a whole number")))?,
        None => file.slots.unwrap_or_else(cpus),
    };
    if slots == 0 || slots > 10_000 {
        return Err(ConfigError::new("slots", "must be 1 to 10000"));
    }

    let default_timeout = duration(
        "default_timeout",
        pick(run.default_timeout.clone(), file.default_timeout),
        Duration::from_secs(300),
    )?;
    let kill_grace = duration(
        "kill_grace",
        pick(run.kill_grace.clone(), file.kill_grace),
        Duration::from_secs(10),
    )?;
    let ack_wait = duration(
        "ack_wait",
        pick(run.ack_wait.clone(), file.ack_wait),
        Duration::from_secs(30),
    )?;
    let heartbeat = duration(
        "heartbeat",
        pick(run.heartbeat.clone(), file.heartbeat),
        Duration::from_secs(5),
    )?;
    let offline_after = duration(
        "offline_after",
        pick(run.offline_after.clone(), file.offline_after),
        Duration::from_secs(30),
    )?;
    let drain_timeout = duration(
        "drain_timeout",
        pick(run.drain_timeout.clone(), file.drain_timeout),
        Duration::from_secs(30),
    )?;
    if default_timeout.is_zero() {
        return Err(ConfigError::new(
            "default_timeout",
            "must be greater than 0",
        ));
    }
    if ack_wait < Duration::from_secs(1) {
        return Err(ConfigError::new("ack_wait", "must be at least 1s"));
    }
    if heartbeat.is_zero() {
        return Err(ConfigError::new("heartbeat", "must be greater than 0"));
    }
    if offline_after < Duration::from_secs(1) {
        return Err(ConfigError::new("offline_after", "must be at least 1s"));
    }
    if heartbeat >= offline_after {
        return Err(ConfigError::new(
            "heartbeat",
            format!(
                "must be shorter than offline_after ({})",
                humantime::format_duration(offline_after)
            ),
        ));
    }
    let output_cap = size(
        "output_cap",
        pick(run.output_cap.clone(), file.output_cap),
        256 * 1024,
    )?;
    if output_cap < 1024 {
        return Err(ConfigError::new("output_cap", "must be at least 1KiB"));
    }
    let max_task_bytes = size(
        "max_task_bytes",
        pick(run.max_task_bytes.clone(), file.max_task_bytes),
        256 * 1024,
    )?;
    if max_task_bytes < 64 {
        return Err(ConfigError::new(
            "max_task_bytes",
            "must be at least 64 bytes",
        ));
    }
    let state_dir = pick(run.state_dir.clone(), file.state_dir).unwrap_or_else(default_state_dir);
    let metrics_addr = match pick(run.metrics_addr.clone(), file.metrics_addr) {
        None => None,
        Some(s) if s.is_empty() || s == "off" => None,
        Some(s) => Some(s.parse::<SocketAddr>().map_err(|_| {
            ConfigError::new(
                "metrics_addr",
                format!("`{s}` is not an address like 127.0.0.1:9090"),
            )
        })?),
    };
    let pass_env = run
        .pass_env
        .as_deref()
        .map(split_list)
        .or_else(|| file.pass_env.map(StringOrList::into_vec))
        .unwrap_or_default();
    let shell = run
        .shell
        .as_deref()
        .map(|s| s.split_whitespace().map(String::from).collect())
        .or_else(|| {
            file.shell.map(|s| match s {
                StringOrList::One(s) => s.split_whitespace().map(String::from).collect(),
                StringOrList::Many(v) => v,
            })
        })
        .unwrap_or_else(|| vec!["bash".to_string(), "-c".to_string()]);
    if shell.is_empty() {
        return Err(ConfigError::new(
            "shell",
            "must name a program, e.g. \"bash -c\"",
        ));
    }
    let task_user = pick(run.task_user.clone(), file.task_user).filter(|s| !s.is_empty());
    if let Some(u) = &task_user {
        crate::process::resolve_user(u).map_err(|e| ConfigError::new("task_user", e))?;
        if !nix::unistd::Uid::effective().is_root() {
            return Err(ConfigError::new(
                "task_user",
                "the worker must run as root to switch users",
            ));
        }
    }
    let allowed_networks = run
        .allowed_networks
        .as_deref()
        .map(split_list)
        .or_else(|| file.allowed_networks.map(StringOrList::into_vec))
        .unwrap_or_default();
    let default_network = pick(run.default_network.clone(), file.default_network);
    if let Some(n) = &default_network {
        if !(n == "none" || n == "bridge" || allowed_networks.contains(n)) {
            return Err(ConfigError::new(
                "default_network",
                format!("`{n}` is not none, bridge or in allowed_networks"),
            ));
        }
    }
    let on_lease_lost = match pick(run.on_lease_lost.clone(), file.on_lease_lost).as_deref() {
        None | Some("kill") => LeaseLost::Kill,
        Some("keep") => LeaseLost::Keep,
        Some(o) => {
            return Err(ConfigError::new(
                "on_lease_lost",
                format!("`{o}` is not kill or keep"),
            ))
        }
    };
    let deny_private_http = match &run.deny_private_http {
        Some(s) => parse_bool(s).ok_or_else(|| {
            ConfigError::new("deny_private_http", format!("`{s}` is not true or false"))
        })?,
        None => file.deny_private_http.unwrap_or(false),
    };
    let cgroups = match pick(run.cgroups.clone(), file.cgroups).as_deref() {
        None | Some("auto") => true,
        Some("off") => false,
        Some(o) => {
            return Err(ConfigError::new(
                "cgroups",
                format!("`{o}` is not auto or off"),
            ))
        }
    };
    Ok(WorkerConfig {
        connect,
        name,
        labels,
        types,
        types_explicit: types_given,
        slots,
        default_timeout,
        kill_grace,
        ack_wait,
        heartbeat,
        offline_after,
        drain_timeout,
        output_cap,
        max_task_bytes: max_task_bytes.min(usize::MAX as u64) as usize,
        state_dir,
        metrics_addr,
        pass_env,
        shell,
        task_user,
        allowed_networks,
        default_network,
        docker_host: pick(run.docker_host.clone(), file.docker_host),
        deny_private_http,
        on_lease_lost,
        cgroups,
    })
}

fn parse_bool(s: &str) -> Option<bool> {
    match s.to_ascii_lowercase().as_str() {
        "1" | "true" | "yes" | "on" => Some(true),
        "0" | "false" | "no" | "off" => Some(false),
        _ => None,
    }
}

impl WorkerConfig {
    /// A configuration for tests and embedding: defaults, one server URL.
    pub fn for_server(url: &str, state_dir: &Path) -> Self {
        let global = GlobalArgs {
            server: Some(url.to_string()),
            ..Default::default()
        };
        let run = RunArgs {
            state_dir: Some(state_dir.to_path_buf()),
            ..Default::default()
        };
        resolve_worker(&global, &run, FileConfig::default()).expect("default config is valid")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(s: &str) -> FileConfig {
        toml::from_str(s).unwrap()
    }

    #[test]
    fn file_values_apply_and_flags_win() {
        let f = file("labels = [\"a\", \"b\"]\nslots = 3\ndrain_timeout = \"5s\"\n");
        let g = GlobalArgs::default();
        let r = RunArgs {
            slots: Some("7".into()),
            state_dir: Some("/tmp/x".into()),
            ..Default::default()
        };
        let c = resolve_worker(&g, &r, f).unwrap();
        assert_eq!(c.labels, vec!["a", "b"]);
        assert_eq!(c.slots, 7);
        assert_eq!(c.drain_timeout, Duration::from_secs(5));
    }

    #[test]
    fn bad_values_name_the_setting() {
        let g = GlobalArgs::default();
        let r = RunArgs {
            drain_timeout: Some("soon".into()),
            ..Default::default()
        };
        let e = resolve_worker(&g, &r, FileConfig::default()).unwrap_err();
        assert_eq!(e.setting, "drain_timeout");
        let r = RunArgs {
            labels: Some("a b".into()),
            ..Default::default()
        };
        assert_eq!(
            resolve_worker(&g, &r, FileConfig::default())
                .unwrap_err()
                .setting,
            "labels"
        );
        let r = RunArgs {
            types: Some("shell,ftp".into()),
            ..Default::default()
        };
        assert_eq!(
            resolve_worker(&g, &r, FileConfig::default())
                .unwrap_err()
                .setting,
            "types"
        );
        let f = file("slots = 0");
        assert_eq!(
            resolve_worker(&g, &RunArgs::default(), f)
                .unwrap_err()
                .setting,
            "slots"
        );
    }

    #[test]
    fn unknown_file_key_is_refused() {
        assert!(toml::from_str::<FileConfig>("slotz = 3").is_err());
    }

    #[test]
    fn nats_context_is_read() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(load_nats_context(dir.path(), None).unwrap(), None);
        std::fs::create_dir(dir.path().join("context")).unwrap();
        std::fs::write(dir.path().join("context.txt"), "prod\n").unwrap();
        std::fs::write(
            dir.path().join("context/prod.json"),
            r#"{"description":"x","url":"nats://a:4222,nats://b:4222","token":"t","user":"","creds":"/c.creds","nsc":""}"#,
        )
        .unwrap();
        let c = load_nats_context(dir.path(), None).unwrap().unwrap();
        assert_eq!(c.url.as_deref(), Some("nats://a:4222,nats://b:4222"));
        assert_eq!(c.token.as_deref(), Some("t"));
        assert_eq!(c.user, None);
        assert_eq!(c.creds, Some(PathBuf::from("/c.creds")));
        // NATS_CONTEXT (here: the argument) picks another; a missing one is an error.
        assert!(load_nats_context(dir.path(), Some("dev")).is_err());
    }

    #[test]
    fn names_section() {
        let f = file("[names]\ntasks_stream = \"T2\"\n");
        let c = resolve_connect(&GlobalArgs::default(), &f).unwrap();
        assert_eq!(c.names.tasks_stream, "T2");
        assert_eq!(c.names.results_stream, "RESULTS");
    }
}
