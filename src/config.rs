//! Settings: every worker and connection setting is defined once, in
//! [`SETTINGS`] (name, default, doc, flag, environment variables, file key),
//! and resolved in one place, [`Settings::gather`], from four layers:
//!
//! 1. a flag (`--drain-timeout 5s`),
//! 2. an environment variable (`JETWORKER_DRAIN_TIMEOUT`; the connection
//!    settings also take natscli's `NATS_URL`, `NATS_CREDS`, …),
//! 3. the TOML file (`--config`, else `$XDG_CONFIG_HOME/jetworker/config.toml`
//!    when it exists),
//! 4. for connection settings, the selected `nats` CLI context — field by
//!    field, as natscli merges it: `NATS_URL` replaces only the URL, and the
//!    context's creds and TLS stay,
//!
//! then the default. Each value remembers its [`Source`], so
//! `jetworker config check --show-sources` can explain it. Values are plain
//! strings until [`resolve_worker`]/[`resolve_connect`] convert them, so a
//! bad value from any layer produces the same one-line [`ConfigError`].
//!
//! This module knows nothing about clap: the command line (in
//! `commands::cli`) builds its flags from [`SETTINGS`] and hands the given
//! values over as a map.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::protocol::{format_size, parse_duration, parse_size, valid_label, Names};
use crate::runner::defined::TypeDef;

/// A setting with a bad value: printed as one line, exit code 2.
#[derive(Debug, thiserror::Error)]
#[error("invalid setting {setting}: {problem}")]
pub struct ConfigError {
    /// The setting's key (`slots`, `names.tasks_stream`).
    pub setting: String,
    /// What is wrong with its value.
    pub problem: String,
}

impl ConfigError {
    /// A bad value of `setting`.
    pub fn new(setting: impl Into<String>, problem: impl Into<String>) -> Self {
        ConfigError {
            setting: setting.into(),
            problem: problem.into(),
        }
    }
}

// ---------------------------------------------------------------------------
// Defaults, as named constants (other modules use them too: `setup`).

/// Where the worker connects when nothing names a server.
pub const DEFAULT_SERVER: &str = "nats://127.0.0.1:4222";
/// Bound on every JetStream API request and on connecting.
pub const DEFAULT_API_TIMEOUT: Duration = Duration::from_secs(10);
/// Timeout of a task that names none.
pub const DEFAULT_TASK_TIMEOUT: Duration = Duration::from_secs(300);
/// Time between SIGTERM and SIGKILL.
pub const DEFAULT_KILL_GRACE: Duration = Duration::from_secs(10);
/// Consumer ack wait; progress acks go out every third of it.
pub const DEFAULT_ACK_WAIT: Duration = Duration::from_secs(30);
/// Heartbeat interval.
pub const DEFAULT_HEARTBEAT: Duration = Duration::from_secs(5);
/// A worker silent this long is offline (the workers bucket's max age).
pub const DEFAULT_OFFLINE_AFTER: Duration = Duration::from_secs(30);
/// Time running tasks get to finish on shutdown.
pub const DEFAULT_DRAIN_TIMEOUT: Duration = Duration::from_secs(30);
/// Output kept per attempt.
pub const DEFAULT_OUTPUT_CAP: u64 = 256 * 1024;
/// Larger tasks are rejected.
pub const DEFAULT_MAX_TASK_BYTES: u64 = 256 * 1024;

// ---------------------------------------------------------------------------
// The definitions.

/// Where a setting is shown in `--help` and `config check`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Group {
    /// Which file and which `nats` context to read.
    General,
    /// Server, auth, TLS, JetStream domain.
    Connection,
    /// Stream, bucket and subject names (several tenants in one account).
    Names,
    /// Log format and level.
    Logging,
    /// `jetworker run` only.
    Worker,
}

impl Group {
    /// The `--help` heading.
    pub fn heading(self) -> &'static str {
        match self {
            Group::General => "Config",
            Group::Connection => "Connection",
            Group::Names => "Names",
            Group::Logging => "Logging",
            Group::Worker => "Worker",
        }
    }
}

/// How a value is written in TOML and shown.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// Free text.
    Text,
    /// A file path.
    Path,
    /// `"a,b"` or `["a", "b"]`.
    List,
    /// `"bash -c"` or `["bash", "-c"]`.
    Words,
    /// `true`/`false`; as a flag, given alone means true.
    Bool,
    /// Never printed; passing it as a flag draws a warning.
    Secret,
}

/// A setting's default.
#[derive(Debug, Clone, Copy)]
pub enum Dflt {
    /// Unset; the text says what that means ("off").
    Unset(&'static str),
    /// This text.
    Text(&'static str),
    /// This duration (`30s`).
    Duration(Duration),
    /// This many bytes (`256KiB`).
    Size(u64),
    /// Computed at start (host name, CPUs); the text describes it.
    Computed(fn() -> String, &'static str),
    /// From [`Names::default`].
    Name,
}

/// One setting.
#[derive(Debug)]
pub struct Setting {
    /// TOML key (`names.tasks_stream` is `tasks_stream` under `[names]`).
    pub key: &'static str,
    /// Long flag, without `--`.
    pub flag: &'static str,
    /// Short flag, if any.
    pub short: Option<char>,
    /// Other long flags (natscli spellings).
    pub aliases: &'static [&'static str],
    /// Environment variables, the first found (non-empty) wins.
    pub env: &'static [&'static str],
    /// Field of a `nats` CLI context that fills it.
    pub context: Option<&'static str>,
    /// Used when no layer gives a value.
    pub default: Dflt,
    /// How its value is written.
    pub kind: Kind,
    /// Where `--help` shows it.
    pub group: Group,
    /// The placeholder in `--help` (`DURATION`).
    pub value_name: &'static str,
    /// Whether the TOML file may set it.
    pub in_file: bool,
    /// One-line description (`--help`, `config check`, README).
    pub doc: &'static str,
}

const fn s(key: &'static str, flag: &'static str, group: Group, doc: &'static str) -> Setting {
    Setting {
        key,
        flag,
        short: None,
        aliases: &[],
        env: &[],
        context: None,
        default: Dflt::Unset(""),
        kind: Kind::Text,
        group,
        value_name: "VALUE",
        in_file: true,
        doc,
    }
}

const fn conn(key: &'static str, flag: &'static str, doc: &'static str) -> Setting {
    s(key, flag, Group::Connection, doc)
}

const fn work(key: &'static str, flag: &'static str, doc: &'static str) -> Setting {
    s(key, flag, Group::Worker, doc)
}

const fn name(key: &'static str, flag: &'static str, env: &'static [&'static str]) -> Setting {
    Setting {
        env,
        default: Dflt::Name,
        value_name: "NAME",
        ..s(key, flag, Group::Names, "")
    }
}

fn hostname_default() -> String {
    hostname::get()
        .ok()
        .and_then(|h| h.into_string().ok())
        .unwrap_or_else(|| "worker".into())
}

fn cpus_default() -> String {
    cpus().to_string()
}

fn state_dir_default() -> String {
    default_state_dir().display().to_string()
}

/// Every setting, in `--help` and `config check` order.
pub static SETTINGS: &[Setting] = &[
    Setting {
        env: &["JETWORKER_CONFIG"],
        kind: Kind::Path,
        value_name: "FILE",
        in_file: false,
        default: Dflt::Unset("$XDG_CONFIG_HOME/jetworker/config.toml if present"),
        ..s("config", "config", Group::General, "TOML config file")
    },
    Setting {
        env: &["NATS_CONTEXT"],
        value_name: "NAME",
        default: Dflt::Unset("the one `nats context select` chose"),
        ..s(
            "context",
            "context",
            Group::General,
            "nats CLI context to read the connection from (see --no-context)",
        )
    },
    Setting {
        short: Some('s'),
        env: &["NATS_URL"],
        context: Some("url"),
        default: Dflt::Text(DEFAULT_SERVER),
        kind: Kind::List,
        value_name: "URL",
        ..conn("server", "server", "NATS server URL(s), comma separated")
    },
    Setting {
        env: &["JETWORKER_CREDS", "NATS_CREDS"],
        context: Some("creds"),
        kind: Kind::Path,
        value_name: "FILE",
        ..conn("creds", "creds", "Credentials file (JWT + nkey seed)")
    },
    Setting {
        env: &["JETWORKER_NKEY", "NATS_NKEY"],
        context: Some("nkey"),
        kind: Kind::Path,
        value_name: "FILE",
        ..conn("nkey", "nkey", "Nkey seed file")
    },
    Setting {
        env: &["JETWORKER_TOKEN", "NATS_TOKEN"],
        context: Some("token"),
        kind: Kind::Secret,
        value_name: "TOKEN",
        ..conn(
            "token",
            "token",
            "Token (prefer --token-file or the environment)",
        )
    },
    Setting {
        env: &["JETWORKER_TOKEN_FILE"],
        kind: Kind::Path,
        value_name: "FILE",
        ..conn("token_file", "token-file", "File holding the token")
    },
    Setting {
        env: &["JETWORKER_USER", "NATS_USER"],
        context: Some("user"),
        value_name: "USER",
        ..conn("user", "user", "User name, with a password")
    },
    Setting {
        env: &["JETWORKER_PASSWORD", "NATS_PASSWORD"],
        context: Some("password"),
        kind: Kind::Secret,
        value_name: "PASSWORD",
        ..conn(
            "password",
            "password",
            "Password (prefer --password-file or the environment)",
        )
    },
    Setting {
        env: &["JETWORKER_PASSWORD_FILE"],
        kind: Kind::Path,
        value_name: "FILE",
        ..conn(
            "password_file",
            "password-file",
            "File holding the password",
        )
    },
    Setting {
        aliases: &["tlsca"],
        env: &["JETWORKER_TLS_CA", "NATS_CA"],
        context: Some("ca"),
        kind: Kind::Path,
        value_name: "FILE",
        ..conn(
            "tls_ca",
            "tls-ca",
            "CA certificate (PEM) to verify the server",
        )
    },
    Setting {
        aliases: &["tlscert"],
        env: &["JETWORKER_TLS_CERT", "NATS_CERT"],
        context: Some("cert"),
        kind: Kind::Path,
        value_name: "FILE",
        ..conn(
            "tls_cert",
            "tls-cert",
            "Client certificate (PEM), with --tls-key",
        )
    },
    Setting {
        aliases: &["tlskey"],
        env: &["JETWORKER_TLS_KEY", "NATS_KEY"],
        context: Some("key"),
        kind: Kind::Path,
        value_name: "FILE",
        ..conn("tls_key", "tls-key", "Client key (PEM), with --tls-cert")
    },
    Setting {
        aliases: &["tls-first"],
        env: &["JETWORKER_TLS_FIRST"],
        context: Some("tls_first"),
        kind: Kind::Bool,
        default: Dflt::Text("false"),
        value_name: "BOOL",
        ..conn(
            "tls_first",
            "tlsfirst",
            "TLS handshake before the server's INFO (servers with handshake_first)",
        )
    },
    Setting {
        env: &["JETWORKER_JS_DOMAIN"],
        context: Some("jetstream_domain"),
        value_name: "DOMAIN",
        ..conn(
            "js_domain",
            "js-domain",
            "JetStream domain (leaf nodes, hubs)",
        )
    },
    Setting {
        env: &["JETWORKER_INBOX_PREFIX"],
        context: Some("inbox_prefix"),
        value_name: "PREFIX",
        default: Dflt::Unset("_INBOX"),
        ..conn(
            "inbox_prefix",
            "inbox-prefix",
            "Prefix of reply subjects (accounts that limit _INBOX)",
        )
    },
    Setting {
        env: &["JETWORKER_API_TIMEOUT", "NATS_TIMEOUT"],
        default: Dflt::Duration(DEFAULT_API_TIMEOUT),
        value_name: "DURATION",
        ..conn(
            "api_timeout",
            "api-timeout",
            "Bound on connecting and on each JetStream API request",
        )
    },
    name(
        "names.tasks_stream",
        "tasks-stream",
        &["JETWORKER_TASKS_STREAM"],
    ),
    name(
        "names.tasks_prefix",
        "tasks-prefix",
        &["JETWORKER_TASKS_PREFIX"],
    ),
    name(
        "names.schedules_prefix",
        "schedules-prefix",
        &["JETWORKER_SCHEDULES_PREFIX"],
    ),
    name(
        "names.results_stream",
        "results-stream",
        &["JETWORKER_RESULTS_STREAM"],
    ),
    name(
        "names.results_prefix",
        "results-prefix",
        &["JETWORKER_RESULTS_PREFIX"],
    ),
    name(
        "names.dead_stream",
        "dead-stream",
        &["JETWORKER_DEAD_STREAM"],
    ),
    name(
        "names.dead_prefix",
        "dead-prefix",
        &["JETWORKER_DEAD_PREFIX"],
    ),
    name(
        "names.logs_prefix",
        "logs-prefix",
        &["JETWORKER_LOGS_PREFIX"],
    ),
    name(
        "names.workers_bucket",
        "workers-bucket",
        &["JETWORKER_WORKERS_BUCKET"],
    ),
    name(
        "names.cancel_bucket",
        "cancel-bucket",
        &["JETWORKER_CANCEL_BUCKET"],
    ),
    name(
        "names.joins_bucket",
        "joins-bucket",
        &["JETWORKER_JOINS_BUCKET"],
    ),
    Setting {
        env: &["JETWORKER_LOG_FORMAT"],
        default: Dflt::Text("text"),
        value_name: "text|json",
        ..s(
            "log_format",
            "log-format",
            Group::Logging,
            "Log format; text is coloured only on a terminal without NO_COLOR",
        )
    },
    Setting {
        env: &["JETWORKER_LOG_LEVEL", "LOG_LEVEL", "RUST_LOG"],
        default: Dflt::Text("info"),
        value_name: "FILTER",
        ..s(
            "log_level",
            "log-level",
            Group::Logging,
            "Log level or filter (debug, jetworker=trace); operator commands: warn",
        )
    },
    Setting {
        env: &["JETWORKER_NAME", "WORKER_NAME"],
        default: Dflt::Computed(hostname_default, "host name"),
        value_name: "NAME",
        ..work("name", "name", "Worker name; the id is <name>-<random>")
    },
    Setting {
        env: &["JETWORKER_LABELS"],
        default: Dflt::Text("default"),
        kind: Kind::List,
        value_name: "LABELS",
        ..work(
            "labels",
            "labels",
            "Labels (queues) to serve, comma separated",
        )
    },
    Setting {
        env: &["JETWORKER_TYPES"],
        default: Dflt::Unset("all that work here"),
        kind: Kind::List,
        value_name: "TYPES",
        ..work(
            "types",
            "types",
            "Task types to run: shell,command,http,container and the types defined in the config file's [types.<name>] tables",
        )
    },
    Setting {
        env: &["JETWORKER_SLOTS"],
        default: Dflt::Computed(cpus_default, "number of CPUs"),
        value_name: "N",
        ..work("slots", "slots", "Maximum tasks running at once")
    },
    Setting {
        env: &["JETWORKER_DEFAULT_TIMEOUT"],
        default: Dflt::Duration(DEFAULT_TASK_TIMEOUT),
        value_name: "DURATION",
        ..work(
            "default_timeout",
            "default-timeout",
            "Timeout of a task that names none",
        )
    },
    Setting {
        env: &["JETWORKER_KILL_GRACE"],
        default: Dflt::Duration(DEFAULT_KILL_GRACE),
        value_name: "DURATION",
        ..work(
            "kill_grace",
            "kill-grace",
            "Time between SIGTERM and SIGKILL",
        )
    },
    Setting {
        env: &["JETWORKER_ACK_WAIT"],
        default: Dflt::Duration(DEFAULT_ACK_WAIT),
        value_name: "DURATION",
        ..work(
            "ack_wait",
            "ack-wait",
            "Consumer ack wait; progress acks every third of it",
        )
    },
    Setting {
        env: &["JETWORKER_HEARTBEAT"],
        default: Dflt::Duration(DEFAULT_HEARTBEAT),
        value_name: "DURATION",
        ..work("heartbeat", "heartbeat", "Heartbeat interval")
    },
    Setting {
        env: &["JETWORKER_OFFLINE_AFTER"],
        default: Dflt::Duration(DEFAULT_OFFLINE_AFTER),
        value_name: "DURATION",
        ..work(
            "offline_after",
            "offline-after",
            "A worker silent this long is offline",
        )
    },
    Setting {
        env: &["JETWORKER_DRAIN_TIMEOUT"],
        default: Dflt::Duration(DEFAULT_DRAIN_TIMEOUT),
        value_name: "DURATION",
        ..work(
            "drain_timeout",
            "drain-timeout",
            "Time running tasks get to finish on shutdown",
        )
    },
    Setting {
        env: &["JETWORKER_OUTPUT_CAP"],
        default: Dflt::Size(DEFAULT_OUTPUT_CAP),
        value_name: "SIZE",
        ..work(
            "output_cap",
            "output-cap",
            "Output kept per attempt, clamped to the server's max_payload",
        )
    },
    Setting {
        env: &["JETWORKER_MAX_TASK_BYTES"],
        default: Dflt::Size(DEFAULT_MAX_TASK_BYTES),
        value_name: "SIZE",
        ..work(
            "max_task_bytes",
            "max-task-bytes",
            "Larger tasks are rejected",
        )
    },
    Setting {
        env: &["JETWORKER_STATE_DIR"],
        default: Dflt::Computed(state_dir_default, "platform data dir"),
        kind: Kind::Path,
        value_name: "DIR",
        ..work("state_dir", "state-dir", "Outbox and local state")
    },
    Setting {
        env: &["JETWORKER_METRICS_ADDR"],
        default: Dflt::Unset("off"),
        value_name: "ADDR",
        ..work(
            "metrics_addr",
            "metrics-addr",
            "Serve /metrics, /healthz, /readyz on this address",
        )
    },
    Setting {
        env: &["JETWORKER_PASS_ENV"],
        kind: Kind::List,
        value_name: "VARS",
        default: Dflt::Unset("none"),
        ..work(
            "pass_env",
            "pass-env",
            "Worker environment variables passed to tasks, comma separated",
        )
    },
    Setting {
        env: &["JETWORKER_SHELL"],
        default: Dflt::Text("bash -c"),
        kind: Kind::Words,
        value_name: "SHELL",
        ..work("shell", "shell", "Shell and its flag for shell tasks")
    },
    Setting {
        env: &["JETWORKER_TASK_USER"],
        value_name: "USER",
        default: Dflt::Unset("the worker's user"),
        ..work(
            "task_user",
            "task-user",
            "Run shell and command tasks as this user (worker must be root)",
        )
    },
    Setting {
        env: &["JETWORKER_ALLOWED_NETWORKS"],
        kind: Kind::List,
        value_name: "NETWORKS",
        default: Dflt::Unset("none and bridge only"),
        ..work(
            "allowed_networks",
            "allowed-networks",
            "Docker networks container tasks may use besides none and bridge",
        )
    },
    Setting {
        env: &["JETWORKER_DEFAULT_NETWORK"],
        value_name: "NETWORK",
        default: Dflt::Unset("bridge"),
        ..work(
            "default_network",
            "default-network",
            "Network of container tasks that name none",
        )
    },
    Setting {
        env: &["JETWORKER_DOCKER_HOST"],
        value_name: "ADDR",
        default: Dflt::Unset("DOCKER_HOST or the local socket"),
        ..work("docker_host", "docker-host", "Docker Engine address")
    },
    Setting {
        env: &["JETWORKER_DENY_PRIVATE_HTTP"],
        kind: Kind::Bool,
        default: Dflt::Text("false"),
        value_name: "BOOL",
        ..work(
            "deny_private_http",
            "deny-private-http",
            "Refuse http tasks to private, loopback and link-local addresses",
        )
    },
    Setting {
        env: &["JETWORKER_CGROUPS"],
        default: Dflt::Text("auto"),
        value_name: "auto|off",
        ..work(
            "cgroups",
            "cgroups",
            "Per-task cgroups where the tree is writable",
        )
    },
    Setting {
        env: &["JETWORKER_ON_LEASE_LOST"],
        default: Dflt::Text("kill"),
        value_name: "kill|keep",
        ..work(
            "on_lease_lost",
            "on-lease-lost",
            "When cut off longer than ack wait: kill or keep running tasks",
        )
    },
];

/// The definition of `key` (a programming error if there is none).
pub fn setting(key: &str) -> &'static Setting {
    SETTINGS
        .iter()
        .find(|s| s.key == key)
        .unwrap_or_else(|| panic!("no setting {key}"))
}

impl Setting {
    /// The default as text, for `--help` and `config check`.
    pub fn default_text(&self) -> String {
        match self.default {
            Dflt::Unset(t) => t.to_string(),
            Dflt::Text(t) => t.to_string(),
            Dflt::Duration(d) => humantime::format_duration(d).to_string(),
            Dflt::Size(b) => format_size(b),
            Dflt::Computed(_, t) => t.to_string(),
            Dflt::Name => name_field(&Names::default(), self.key)
                .cloned()
                .unwrap_or_default(),
        }
    }

    /// The doc of a name setting is made from its key.
    pub fn doc_text(&self) -> String {
        if self.group == Group::Names {
            let what = self.key.trim_start_matches("names.").replace('_', " ");
            return format!("Name of the {what}");
        }
        self.doc.to_string()
    }
}

fn name_field<'a>(n: &'a Names, key: &str) -> Option<&'a String> {
    Some(match key {
        "names.tasks_stream" => &n.tasks_stream,
        "names.tasks_prefix" => &n.tasks_prefix,
        "names.schedules_prefix" => &n.schedules_prefix,
        "names.results_stream" => &n.results_stream,
        "names.results_prefix" => &n.results_prefix,
        "names.dead_stream" => &n.dead_stream,
        "names.dead_prefix" => &n.dead_prefix,
        "names.logs_prefix" => &n.logs_prefix,
        "names.workers_bucket" => &n.workers_bucket,
        "names.cancel_bucket" => &n.cancel_bucket,
        "names.joins_bucket" => &n.joins_bucket,
        _ => return None,
    })
}

fn name_field_mut<'a>(n: &'a mut Names, key: &str) -> Option<&'a mut String> {
    Some(match key {
        "names.tasks_stream" => &mut n.tasks_stream,
        "names.tasks_prefix" => &mut n.tasks_prefix,
        "names.schedules_prefix" => &mut n.schedules_prefix,
        "names.results_stream" => &mut n.results_stream,
        "names.results_prefix" => &mut n.results_prefix,
        "names.dead_stream" => &mut n.dead_stream,
        "names.dead_prefix" => &mut n.dead_prefix,
        "names.logs_prefix" => &mut n.logs_prefix,
        "names.workers_bucket" => &mut n.workers_bucket,
        "names.cancel_bucket" => &mut n.cancel_bucket,
        "names.joins_bucket" => &mut n.joins_bucket,
        _ => return None,
    })
}

// ---------------------------------------------------------------------------
// Gathering the layers.

/// Where a value came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    /// The built-in default.
    Default,
    /// A `nats` CLI context (name, file).
    Context(String, PathBuf),
    /// The config file.
    File(PathBuf),
    /// This environment variable.
    Env(&'static str),
    /// This flag (`--slots`).
    Flag(&'static str),
}

impl std::fmt::Display for Source {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Source::Default => write!(f, "default"),
            Source::Context(n, p) => write!(f, "nats context {n} ({})", p.display()),
            Source::File(p) => write!(f, "file {}", p.display()),
            Source::Env(v) => write!(f, "env {v}"),
            Source::Flag(fl) => write!(f, "flag --{fl}"),
        }
    }
}

/// A value as given, and where.
#[derive(Debug, Clone)]
pub struct Value {
    /// The value, unconverted.
    pub text: String,
    /// The layer it came from.
    pub source: Source,
}

/// What the process was given: flags by setting key, and a way to read the
/// environment (tests pass their own).
pub struct Inputs<'a> {
    /// Flags given, by setting key.
    pub flags: BTreeMap<&'static str, String>,
    /// Reads an environment variable.
    pub env: &'a dyn Fn(&str) -> Option<String>,
    /// `--no-context`: ignore the `nats` CLI context.
    pub no_context: bool,
}

impl Inputs<'_> {
    /// The process environment.
    pub fn process_env(name: &str) -> Option<String> {
        std::env::var(name).ok()
    }

    /// No environment at all.
    pub fn no_env(_: &str) -> Option<String> {
        None
    }
}

/// Every setting's value with its source, before conversion.
#[derive(Debug, Clone, Default)]
pub struct Settings {
    values: BTreeMap<&'static str, Value>,
    /// The config file read, if any.
    pub file: Option<PathBuf>,
    /// The `nats` context read, if any (name, file).
    pub context: Option<(String, PathBuf)>,
    /// Things worth a warning once logging is up (a secret given as a flag).
    pub warnings: Vec<String>,
    /// The task types the config file defines (`[types.<name>]`).
    pub type_defs: Vec<TypeDef>,
}

/// `$XDG_CONFIG_HOME`, else `~/.config` (on every platform, as natscli).
fn config_home() -> Option<PathBuf> {
    match std::env::var_os("XDG_CONFIG_HOME").filter(|v| !v.is_empty()) {
        Some(x) => Some(PathBuf::from(x)),
        None => dirs::home_dir().map(|h| h.join(".config")),
    }
}

/// The config file read when `--config` names none.
pub fn default_config_path() -> Option<PathBuf> {
    config_home().map(|d| d.join("jetworker").join("config.toml"))
}

/// `$XDG_CONFIG_HOME/nats`, else `~/.config/nats` (where the `nats` CLI
/// keeps its contexts on every platform).
pub fn nats_context_dir() -> Option<PathBuf> {
    config_home().map(|d| d.join("nats"))
}

impl Settings {
    /// Gather every layer (flag, environment, file, `nats` context).
    pub fn gather(inputs: &Inputs) -> Result<Settings, ConfigError> {
        let mut out = Settings::default();
        // Flags and environment first: they may name the file and context.
        let given = |key: &'static str| -> Option<Value> {
            let def = setting(key);
            if let Some(v) = inputs.flags.get(key) {
                return Some(Value {
                    text: v.clone(),
                    source: Source::Flag(def.flag),
                });
            }
            // An empty variable (`JETWORKER_SLOTS=` in a compose file) is unset.
            def.env.iter().find_map(|var| {
                (inputs.env)(var)
                    .filter(|v| !v.trim().is_empty())
                    .map(|text| Value {
                        text,
                        source: Source::Env(var),
                    })
            })
        };
        let (file_path, explicit) = match given("config") {
            Some(v) => (Some(PathBuf::from(v.text)), true),
            None => (default_config_path(), false),
        };
        let mut file_values = BTreeMap::new();
        if let Some(p) = file_path {
            if explicit || p.is_file() {
                (file_values, out.type_defs) = load_file(&p)?;
                out.file = Some(p);
            }
        }
        let context_name = match given("context") {
            Some(v) => Some(v.text),
            None => file_values.get("context").cloned(),
        };
        let mut context_values = BTreeMap::new();
        if !inputs.no_context {
            if let Some(dir) = nats_context_dir() {
                if let Some(c) = load_nats_context(&dir, context_name.as_deref())? {
                    context_values = c.values;
                    out.context = Some((c.name, c.path));
                }
            }
        } else if context_name.is_some() && inputs.flags.contains_key("context") {
            return Err(ConfigError::new(
                "context",
                "--context and --no-context contradict each other",
            ));
        }
        for def in SETTINGS {
            let v = given(def.key)
                .or_else(|| {
                    let f = out.file.clone()?;
                    file_values.get(def.key).map(|text| Value {
                        text: text.clone(),
                        source: Source::File(f),
                    })
                })
                .or_else(|| {
                    let (n, p) = out.context.clone()?;
                    context_values.get(def.context?).map(|text: &String| Value {
                        text: text.clone(),
                        source: Source::Context(n, p),
                    })
                });
            if let Some(v) = v {
                if def.kind == Kind::Secret && matches!(v.source, Source::Flag(_)) {
                    out.warnings.push(format!(
                        "--{} on the command line is visible to every user of this machine (ps); use --{}-file or {}",
                        def.flag, def.flag, def.env[0]
                    ));
                }
                out.values.insert(def.key, v);
            }
        }
        Ok(out)
    }

    /// Only the given flags (tests, embedding): no environment, no file, no
    /// context.
    pub fn from_flags(flags: &[(&'static str, &str)]) -> Result<Settings, ConfigError> {
        let mut map: BTreeMap<&'static str, String> = flags
            .iter()
            .map(|(k, v)| (setting(k).key, v.to_string()))
            .collect();
        // No file either: an explicit empty config would be an error.
        map.remove("config");
        let mut s = Settings::default();
        for (k, v) in map {
            s.values.insert(
                k,
                Value {
                    text: v,
                    source: Source::Flag(setting(k).flag),
                },
            );
        }
        Ok(s)
    }

    /// The value of `key` as given, if any.
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.values.get(key)
    }

    fn text(&self, key: &str) -> Option<String> {
        self.get(key).map(|v| v.text.clone())
    }

    /// The effective value of every setting and where it came from (secrets
    /// hidden), for `config check`.
    pub fn explain(&self) -> Vec<(&'static Setting, String, Source)> {
        SETTINGS
            .iter()
            .map(|def| match self.get(def.key) {
                Some(v) if def.kind == Kind::Secret => (def, "(hidden)".into(), v.source.clone()),
                Some(v) => (def, v.text.clone(), v.source.clone()),
                None => {
                    let text = match (def.key, def.default) {
                        ("config", _) if self.file.is_some() => {
                            self.file.iter().map(|p| p.display().to_string()).collect()
                        }
                        ("context", _) if self.context.is_some() => {
                            self.context.iter().map(|(n, _)| n.clone()).collect()
                        }
                        (_, Dflt::Computed(f, _)) => f(),
                        (_, Dflt::Unset("")) => "(unset)".into(),
                        (_, Dflt::Unset(t)) => format!("(unset: {t})"),
                        _ => def.default_text(),
                    };
                    (def, text, Source::Default)
                }
            })
            .collect()
    }

    fn list(&self, key: &str) -> Option<Vec<String>> {
        self.text(key).map(|s| split_list(&s))
    }

    fn duration(&self, key: &str) -> Result<Duration, ConfigError> {
        match self.text(key) {
            Some(s) => parse_duration(&s).map_err(|e| ConfigError::new(key, e)),
            None => match setting(key).default {
                Dflt::Duration(d) => Ok(d),
                _ => unreachable!("{key} has a duration default"),
            },
        }
    }

    fn size(&self, key: &str) -> Result<u64, ConfigError> {
        match self.text(key) {
            Some(s) => parse_size(&s).map_err(|e| ConfigError::new(key, e)),
            None => match setting(key).default {
                Dflt::Size(b) => Ok(b),
                _ => unreachable!("{key} has a size default"),
            },
        }
    }

    fn bool(&self, key: &str) -> Result<bool, ConfigError> {
        let text = self
            .text(key)
            .unwrap_or_else(|| setting(key).default_text());
        parse_bool(&text)
            .ok_or_else(|| ConfigError::new(key, format!("`{text}` is not true or false")))
    }

    /// A text value, or its default text (`Text` and `Computed` defaults).
    fn text_or_default(&self, key: &str) -> String {
        self.text(key)
            .unwrap_or_else(|| match setting(key).default {
                Dflt::Computed(f, _) => f(),
                _ => setting(key).default_text(),
            })
    }

    /// A file path, or the contents of a `*_file` setting.
    fn secret(&self, key: &str) -> Result<Option<String>, ConfigError> {
        let file_key = match key {
            "token" => "token_file",
            _ => "password_file",
        };
        let direct = self.get(key);
        let file = self.get(file_key);
        match (direct, file) {
            // A context's secret gives way to a file named anywhere else.
            (Some(d), Some(_)) if !matches!(d.source, Source::Context(..)) => Err(
                ConfigError::new(key, format!("give {key} or {file_key}, not both")),
            ),
            (_, Some(f)) => {
                let text = std::fs::read_to_string(&f.text).map_err(|e| {
                    ConfigError::new(file_key, format!("cannot read {}: {e}", f.text))
                })?;
                let text = text.trim_end_matches(['\n', '\r']).to_string();
                if text.is_empty() {
                    return Err(ConfigError::new(file_key, format!("{} is empty", f.text)));
                }
                Ok(Some(text))
            }
            (Some(d), None) => Ok(Some(d.text.clone())),
            (None, None) => Ok(None),
        }
    }
}

/// Read the TOML file into setting keys and text values, and the task
/// types it defines (`types` as a table of tables; as a list it is the
/// setting); unknown keys are an error with a "did you mean".
fn load_file(path: &Path) -> Result<(BTreeMap<String, String>, Vec<TypeDef>), ConfigError> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| ConfigError::new("config", format!("cannot read {}: {e}", path.display())))?;
    let table: toml::Table = toml::from_str(&text).map_err(|e| {
        ConfigError::new(
            "config",
            format!("{}: {}", path.display(), e.message().trim()),
        )
    })?;
    let mut out = BTreeMap::new();
    let mut flat = Vec::new();
    let mut defs = Vec::new();
    for (k, v) in table {
        match (k.as_str(), v) {
            ("names", toml::Value::Table(t)) => {
                for (nk, nv) in t {
                    flat.push((format!("names.{nk}"), nv));
                }
            }
            ("types", toml::Value::Table(t)) => {
                for (name, def) in t {
                    defs.push(TypeDef::from_toml(&name, &def).map_err(|e| {
                        ConfigError::new("types", format!("{}: {e}", path.display()))
                    })?);
                }
            }
            (_, v) => flat.push((k, v)),
        }
    }
    let known = || SETTINGS.iter().filter(|s| s.in_file).map(|s| s.key);
    for (k, v) in flat {
        let Some(def) = SETTINGS.iter().find(|s| s.key == k && s.in_file) else {
            return Err(ConfigError::new(
                "config",
                format!(
                    "{}: unknown key `{k}`{}",
                    path.display(),
                    crate::suggest::hint(&k, known())
                ),
            ));
        };
        let bad = || {
            ConfigError::new(
                def.key,
                format!("{}: `{k}` has a value of the wrong type", path.display()),
            )
        };
        let text = match (def.kind, v) {
            (_, toml::Value::String(s)) => s,
            (Kind::Bool, toml::Value::Boolean(b)) => b.to_string(),
            (Kind::Text, toml::Value::Integer(i)) => i.to_string(),
            (Kind::List, toml::Value::Array(a)) | (Kind::Words, toml::Value::Array(a)) => {
                let items: Option<Vec<String>> = a
                    .into_iter()
                    .map(|x| x.as_str().map(String::from))
                    .collect();
                let items = items.ok_or_else(bad)?;
                let sep = if def.kind == Kind::List { "," } else { " " };
                items.join(sep)
            }
            _ => return Err(bad()),
        };
        out.insert(def.key.to_string(), text);
    }
    Ok((out, defs))
}

/// The selected `nats` CLI context (`<dir>/context/<name>.json`): `selected`
/// (`--context`, `NATS_CONTEXT`), else `<dir>/context.txt`; `None` when none
/// is selected. A selected context that cannot be read is an error naming
/// the file. Values by context field; empty strings count as unset.
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
            "context",
            format!("`{name}` is not a context name"),
        ));
    }
    let path = dir.join("context").join(format!("{name}.json"));
    let text = std::fs::read_to_string(&path).map_err(|e| {
        ConfigError::new(
            "context",
            format!("cannot read nats context {name} ({}): {e}", path.display()),
        )
    })?;
    let raw: BTreeMap<String, serde_json::Value> = serde_json::from_str(&text)
        .map_err(|e| ConfigError::new("context", format!("{}: {e}", path.display())))?;
    let mut out = BTreeMap::new();
    for def in SETTINGS {
        let Some(field) = def.context else { continue };
        let text = match raw.get(field) {
            Some(serde_json::Value::String(s)) if !s.is_empty() => match def.kind {
                Kind::Path => expand_home(s).display().to_string(),
                _ => s.clone(),
            },
            Some(serde_json::Value::Bool(true)) => "true".into(),
            _ => continue,
        };
        out.insert(field.to_string(), text);
    }
    Ok(Some(NatsContext {
        name,
        path,
        values: out,
    }))
}

/// A `nats` CLI context as read.
#[derive(Debug, Clone)]
pub struct NatsContext {
    /// The context's name.
    pub name: String,
    /// Its file.
    pub path: PathBuf,
    /// Values by context field (`url`, `creds`, …).
    pub values: BTreeMap<String, String>,
}

/// `~/x` → `$HOME/x` (contexts written by hand often use it).
fn expand_home(p: &str) -> PathBuf {
    match (p.strip_prefix("~/"), dirs::home_dir()) {
        (Some(rest), Some(h)) => h.join(rest),
        _ => PathBuf::from(p),
    }
}

fn split_list(s: &str) -> Vec<String> {
    s.split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(String::from)
        .collect()
}

fn parse_bool(s: &str) -> Option<bool> {
    match s.to_ascii_lowercase().as_str() {
        "1" | "true" | "yes" | "on" => Some(true),
        "0" | "false" | "no" | "off" => Some(false),
        _ => None,
    }
}

// ---------------------------------------------------------------------------
// The resolved settings.

/// How to reach NATS; shared by the worker and every CLI subcommand.
#[derive(Debug, Clone)]
pub struct ConnectConfig {
    /// Server URLs, tried in turn.
    pub servers: Vec<String>,
    /// Credentials file (JWT and seed).
    pub creds: Option<PathBuf>,
    /// NKey seed file.
    pub nkey: Option<PathBuf>,
    /// Auth token.
    pub token: Option<String>,
    /// User name (with `password`).
    pub user: Option<String>,
    /// Password (with `user`).
    pub password: Option<String>,
    /// CA certificate(s) that sign the server's.
    pub tls_ca: Option<PathBuf>,
    /// Client certificate (with `tls_key`).
    pub tls_cert: Option<PathBuf>,
    /// Client certificate's key.
    pub tls_key: Option<PathBuf>,
    /// TLS handshake first (`--tlsfirst`).
    pub tls_first: bool,
    /// JetStream domain: the JetStream context uses `$JS.<domain>.API`.
    pub js_domain: Option<String>,
    /// Reply-subject prefix instead of `_INBOX` (set on the connection).
    pub inbox_prefix: Option<String>,
    /// Bound on connecting and on each JetStream API request.
    pub api_timeout: Duration,
    /// Stream, subject and bucket names.
    pub names: Names,
}

impl Default for ConnectConfig {
    fn default() -> Self {
        ConnectConfig {
            servers: vec![DEFAULT_SERVER.into()],
            creds: None,
            nkey: None,
            token: None,
            user: None,
            password: None,
            tls_ca: None,
            tls_cert: None,
            tls_key: None,
            tls_first: false,
            js_domain: None,
            inbox_prefix: None,
            api_timeout: DEFAULT_API_TIMEOUT,
            names: Names::default(),
        }
    }
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

/// Validated worker settings (see [`SETTINGS`] for each one's doc and
/// default).
#[derive(Debug, Clone)]
pub struct WorkerConfig {
    /// How to reach NATS.
    pub connect: ConnectConfig,
    /// Base of the worker id (`<name>-<random>`).
    pub name: String,
    /// Labels (queues) served.
    pub labels: Vec<String>,
    /// Task types run (`None`: every registered type that can run on this
    /// machine); tasks of other types are handed back for other workers.
    /// Resolved against the built-in types and [`WorkerConfig::type_defs`];
    /// an embedding program may name its own runners' types here.
    pub types: Option<Vec<String>>,
    /// Task types defined in the config file (`[types.<name>]`).
    pub type_defs: Vec<TypeDef>,
    /// Maximum tasks running at once.
    pub slots: usize,
    /// Timeout of a task that gives none.
    pub default_timeout: Duration,
    /// Between the polite stop and the kill.
    pub kill_grace: Duration,
    /// The consumers' ack wait: the lease on a task between progress acks.
    pub ack_wait: Duration,
    /// Interval of heartbeats (KV `workers`).
    pub heartbeat: Duration,
    /// A worker without a heartbeat for this long is offline.
    pub offline_after: Duration,
    /// On shutdown, how long running tasks get to finish.
    pub drain_timeout: Duration,
    /// Output cap per attempt, before clamping to the server's max_payload.
    pub output_cap: u64,
    /// Largest task message accepted.
    pub max_task_bytes: usize,
    /// Outbox and local state.
    pub state_dir: PathBuf,
    /// Address of `/metrics`, `/healthz` and `/readyz` (`None`: off).
    pub metrics_addr: Option<SocketAddr>,
    /// Worker environment variables passed through to tasks.
    pub pass_env: Vec<String>,
    /// Shell and its flag for `shell` tasks (`["bash", "-c"]`).
    pub shell: Vec<String>,
    /// Run tasks as this user (worker must be root).
    pub task_user: Option<String>,
    /// Docker networks container tasks may use besides `none` and `bridge`.
    pub allowed_networks: Vec<String>,
    /// Network of container tasks that name none (`None`: `bridge`).
    pub default_network: Option<String>,
    /// Docker Engine address (default: `DOCKER_HOST`, else the local socket).
    pub docker_host: Option<String>,
    /// Refuse http tasks to private, loopback and link-local addresses.
    pub deny_private_http: bool,
    /// What to do with a task whose lease was lost.
    pub on_lease_lost: LeaseLost,
    /// Give shell/command tasks their own cgroup where the tree is writable.
    pub cgroups: bool,
}

/// Log settings, resolved before anything else so that errors are logged.
#[derive(Debug, Clone)]
pub struct LogConfig {
    /// JSON lines (else text).
    pub json: bool,
    /// Filter (`info`, `jetworker=debug`).
    pub level: String,
    /// Whether the level was given (operator commands default to warn).
    pub level_given: bool,
}

/// Resolve the log settings.
pub fn resolve_log(s: &Settings) -> Result<LogConfig, ConfigError> {
    let json = match s.text_or_default("log_format").as_str() {
        "text" => false,
        "json" => true,
        other => {
            return Err(ConfigError::new(
                "log_format",
                format!("`{other}` is not text or json"),
            ))
        }
    };
    let level = s.text_or_default("log_level");
    if tracing_subscriber::EnvFilter::try_new(&level).is_err() {
        return Err(ConfigError::new(
            "log_level",
            format!("`{level}` is not a log level or filter"),
        ));
    }
    Ok(LogConfig {
        json,
        level,
        level_given: s.get("log_level").is_some(),
    })
}

/// Resolve the connection settings.
pub fn resolve_connect(s: &Settings) -> Result<ConnectConfig, ConfigError> {
    let servers = s
        .list("server")
        .unwrap_or_else(|| vec![DEFAULT_SERVER.into()]);
    if servers.is_empty() {
        return Err(ConfigError::new("server", "no server URL given"));
    }
    for u in &servers {
        let with_scheme = if u.contains("://") {
            u.clone()
        } else {
            format!("nats://{u}")
        };
        if reqwest::Url::parse(&with_scheme).is_err() {
            return Err(ConfigError::new(
                "server",
                format!("`{u}` is not a server URL"),
            ));
        }
    }
    let path = |k: &str| s.text(k).map(PathBuf::from);
    let mut names = Names::default();
    for def in SETTINGS.iter().filter(|d| d.group == Group::Names) {
        if let (Some(v), Some(field)) = (s.text(def.key), name_field_mut(&mut names, def.key)) {
            *field = v;
        }
    }
    let c = ConnectConfig {
        servers,
        creds: path("creds"),
        nkey: path("nkey"),
        token: s.secret("token")?,
        user: s.text("user"),
        password: s.secret("password")?,
        tls_ca: path("tls_ca"),
        tls_cert: path("tls_cert"),
        tls_key: path("tls_key"),
        tls_first: s.bool("tls_first")?,
        js_domain: s.text("js_domain"),
        inbox_prefix: s.text("inbox_prefix"),
        api_timeout: s.duration("api_timeout")?,
        names,
    };
    if c.api_timeout < Duration::from_millis(100) {
        return Err(ConfigError::new("api_timeout", "must be at least 100ms"));
    }
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
    if let Some(d) = &c.js_domain {
        if !valid_label(d) {
            return Err(ConfigError::new(
                "js_domain",
                format!("`{d}` must be [A-Za-z0-9_-]{{1,64}}"),
            ));
        }
    }
    if let Some(p) = &c.inbox_prefix {
        if p.is_empty() || p.contains([' ', '*', '>']) || p.ends_with('.') {
            return Err(ConfigError::new(
                "inbox_prefix",
                format!("`{p}` is not a subject prefix like _INBOX_team"),
            ));
        }
    }
    for def in SETTINGS.iter().filter(|d| d.group == Group::Names) {
        let v = name_field(&c.names, def.key).cloned().unwrap_or_default();
        if !valid_label(&v) {
            return Err(ConfigError::new(
                def.key,
                format!("`{v}` must be [A-Za-z0-9_-]{{1,64}}"),
            ));
        }
    }
    Ok(c)
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

/// One of a few words, or the default.
fn choice<T: Copy>(s: &Settings, key: &str, options: &[(&str, T)]) -> Result<T, ConfigError> {
    let v = s.text_or_default(key);
    options
        .iter()
        .find(|(w, _)| *w == v)
        .map(|(_, t)| *t)
        .ok_or_else(|| {
            let words: Vec<&str> = options.iter().map(|(w, _)| *w).collect();
            ConfigError::new(key, format!("`{v}` is not {}", words.join(" or ")))
        })
}

/// The `metrics_addr` setting (`None`: off). `jetworker health` reads it
/// too, to probe the worker configured in the same place.
pub fn metrics_addr(s: &Settings) -> Result<Option<SocketAddr>, ConfigError> {
    match s.text("metrics_addr") {
        None => Ok(None),
        Some(a) if a.is_empty() || a == "off" => Ok(None),
        Some(a) => a.parse::<SocketAddr>().map(Some).map_err(|_| {
            ConfigError::new(
                "metrics_addr",
                format!("`{a}` is not an address like 127.0.0.1:9090"),
            )
        }),
    }
}

/// Resolve every worker setting.
impl WorkerConfig {
    /// Settings from these values only (setting keys such as `labels` or
    /// `server`, as in the config file): no environment, file or `nats`
    /// context. For programs that embed a worker, and tests.
    pub fn from_flags(flags: &[(&'static str, &str)]) -> Result<WorkerConfig, ConfigError> {
        resolve_worker(&Settings::from_flags(flags)?)
    }
}

/// Resolve and check the worker settings; the first bad value is the error.
pub fn resolve_worker(s: &Settings) -> Result<WorkerConfig, ConfigError> {
    let connect = resolve_connect(s)?;
    let name: String = s
        .text_or_default("name")
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

    let labels = s.list("labels").unwrap_or_else(|| vec!["default".into()]);
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

    let types = match s.list("types") {
        None => None,
        Some(list) => {
            let known: Vec<&str> = ["shell", "command", "http", "container"]
                .into_iter()
                .chain(s.type_defs.iter().map(|d| d.name.as_str()))
                .collect();
            let mut v: Vec<String> = Vec::new();
            for t in list {
                if !known.contains(&t.as_str()) {
                    return Err(ConfigError::new(
                        "types",
                        format!(
                            "unknown task type `{t}`{} (known: {})",
                            crate::suggest::hint(&t, known.iter().copied()),
                            known.join(", ")
                        ),
                    ));
                }
                if !v.contains(&t) {
                    v.push(t);
                }
            }
            if v.is_empty() {
                return Err(ConfigError::new("types", "at least one type is needed"));
            }
            Some(v)
        }
    };

    let slots_text = s.text_or_default("slots");
    let slots = slots_text
        .trim()
        .parse::<usize>()
        .map_err(|_| ConfigError::new("slots", format!("`{slots_text}` is not a whole number")))?;
    if slots == 0 || slots > 10_000 {
        return Err(ConfigError::new("slots", "must be 1 to 10000"));
    }

    let default_timeout = s.duration("default_timeout")?;
    let kill_grace = s.duration("kill_grace")?;
    let ack_wait = s.duration("ack_wait")?;
    let heartbeat = s.duration("heartbeat")?;
    let offline_after = s.duration("offline_after")?;
    let drain_timeout = s.duration("drain_timeout")?;
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
    let output_cap = s.size("output_cap")?;
    if output_cap < 1024 {
        return Err(ConfigError::new("output_cap", "must be at least 1KiB"));
    }
    let max_task_bytes = s.size("max_task_bytes")?;
    if max_task_bytes < 64 {
        return Err(ConfigError::new(
            "max_task_bytes",
            "must be at least 64 bytes",
        ));
    }
    let state_dir = PathBuf::from(s.text_or_default("state_dir"));
    let metrics_addr = metrics_addr(s)?;
    let pass_env = s.list("pass_env").unwrap_or_default();
    let shell: Vec<String> = s
        .text_or_default("shell")
        .split_whitespace()
        .map(String::from)
        .collect();
    if shell.is_empty() {
        return Err(ConfigError::new(
            "shell",
            "must name a program, e.g. \"bash -c\"",
        ));
    }
    let task_user = s.text("task_user");
    if let Some(u) = &task_user {
        crate::process::resolve_user(u).map_err(|e| ConfigError::new("task_user", e))?;
        if !nix::unistd::Uid::effective().is_root() {
            return Err(ConfigError::new(
                "task_user",
                "the worker must run as root to switch users",
            ));
        }
    }
    let allowed_networks = s.list("allowed_networks").unwrap_or_default();
    let default_network = s.text("default_network");
    if let Some(n) = &default_network {
        if !(n == "none" || n == "bridge" || allowed_networks.contains(n)) {
            return Err(ConfigError::new(
                "default_network",
                format!("`{n}` is not none, bridge or in allowed_networks"),
            ));
        }
    }
    let on_lease_lost = choice(
        s,
        "on_lease_lost",
        &[("kill", LeaseLost::Kill), ("keep", LeaseLost::Keep)],
    )?;
    let cgroups = choice(s, "cgroups", &[("auto", true), ("off", false)])?;
    Ok(WorkerConfig {
        connect,
        name,
        labels,
        types,
        type_defs: s.type_defs.clone(),
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
        docker_host: s.text("docker_host"),
        deny_private_http: s.bool("deny_private_http")?,
        on_lease_lost,
        cgroups,
    })
}

impl WorkerConfig {
    /// A configuration for tests and embedding: defaults, one server URL,
    /// nothing read from the environment, a file or a `nats` context.
    pub fn for_server(url: &str, state_dir: &Path) -> Self {
        let state = state_dir.display().to_string();
        let s = Settings::from_flags(&[("server", url), ("state_dir", &state)])
            .expect("flags are valid");
        resolve_worker(&s).expect("default config is valid")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Gather with these flags and environment, no context dir lookups
    /// beyond `XDG_CONFIG_HOME` of the process.
    fn gather(flags: &[(&'static str, &str)], env: &[(&str, &str)]) -> Settings {
        let env: BTreeMap<String, String> = env
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let read = move |k: &str| env.get(k).cloned();
        Settings::gather(&Inputs {
            flags: flags.iter().map(|(k, v)| (*k, v.to_string())).collect(),
            env: &read,
            no_context: true,
        })
        .unwrap()
    }

    #[test]
    fn every_setting_is_well_formed() {
        let mut keys = std::collections::BTreeSet::new();
        let mut flags = std::collections::BTreeSet::new();
        for s in SETTINGS {
            assert!(keys.insert(s.key), "{} twice", s.key);
            assert!(flags.insert(s.flag), "--{} twice", s.flag);
            assert!(!s.doc_text().is_empty(), "{} has no doc", s.key);
            if s.group != Group::Names {
                assert!(!s.env.is_empty(), "{} has no env", s.key);
            }
            // Defaults that are values must parse as their setting would.
            let _ = s.default_text();
        }
        // The defaults resolve.
        resolve_worker(&Settings::default()).unwrap();
    }

    #[test]
    fn the_example_file_names_real_keys_and_true_defaults() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/config.example.toml");
        let text = std::fs::read_to_string(&path).unwrap();
        // Uncommented, it must load.
        let uncommented: String = text
            .lines()
            .map(|l| {
                let t = l.trim_start_matches("# ");
                if t.contains(" = ") || t == "[names]" {
                    t.split("  #").next().unwrap_or(t)
                } else {
                    ""
                }
            })
            .filter(|l| !l.is_empty())
            .fold(
                (String::new(), std::collections::BTreeSet::new()),
                |(mut acc, mut seen), l| {
                    // Keep the first of several examples of one key.
                    let key = l.split(" = ").next().unwrap_or("").to_string();
                    if l == "[names]" || seen.insert(key) {
                        acc.push_str(l);
                        acc.push('\n');
                    }
                    (acc, seen)
                },
            )
            .0;
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("all.toml");
        std::fs::write(&f, &uncommented).unwrap();
        let (values, _) = load_file(&f).unwrap_or_else(|e| panic!("{e}\n{uncommented}"));
        // A duration or size shown commented out is the default.
        for def in SETTINGS {
            let Some(v) = values.get(def.key) else {
                continue;
            };
            match def.default {
                Dflt::Duration(d) if text.contains(&format!("# {} = ", def.key)) => {
                    assert_eq!(parse_duration(v).unwrap(), d, "{}", def.key)
                }
                Dflt::Size(b) => assert_eq!(parse_size(v).unwrap(), b, "{}", def.key),
                _ => {}
            }
        }
    }

    #[test]
    fn flags_beat_env_beat_file() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("c.toml");
        std::fs::write(
            &f,
            "labels = [\"a\", \"b\"]\nslots = 3\ndrain_timeout = \"5s\"\nheartbeat = \"2s\"\n[names]\ntasks_stream = \"T2\"\n",
        )
        .unwrap();
        let path = f.to_str().unwrap();
        let s = gather(
            &[("config", path), ("slots", "7")],
            &[("JETWORKER_SLOTS", "9"), ("JETWORKER_HEARTBEAT", "1s")],
        );
        let c = resolve_worker(&s).unwrap();
        assert_eq!(c.labels, vec!["a", "b"]);
        assert_eq!(c.slots, 7);
        assert_eq!(c.heartbeat, Duration::from_secs(1));
        assert_eq!(c.drain_timeout, Duration::from_secs(5));
        assert_eq!(c.connect.names.tasks_stream, "T2");
        assert_eq!(c.connect.names.results_stream, "RESULTS");
        assert_eq!(s.get("slots").unwrap().source, Source::Flag("slots"));
        assert_eq!(
            s.get("heartbeat").unwrap().source,
            Source::Env("JETWORKER_HEARTBEAT")
        );
        assert_eq!(s.get("labels").unwrap().source, Source::File(f.clone()));
        // An empty variable is unset.
        let s = gather(&[], &[("JETWORKER_SLOTS", "")]);
        assert!(s.get("slots").is_none());
    }

    #[test]
    fn bad_values_name_the_setting() {
        let e = resolve_worker(&gather(&[("drain_timeout", "soon")], &[])).unwrap_err();
        assert_eq!(e.setting, "drain_timeout");
        let e = resolve_worker(&gather(&[("labels", "a b")], &[])).unwrap_err();
        assert_eq!(e.setting, "labels");
        let e = resolve_worker(&gather(&[], &[("JETWORKER_TYPES", "shell,ftp")])).unwrap_err();
        assert_eq!(e.setting, "types");
        let e = resolve_worker(&gather(&[("slots", "0")], &[])).unwrap_err();
        assert_eq!(e.setting, "slots");
    }

    #[test]
    fn unknown_file_key_suggests_the_right_one() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("c.toml");
        std::fs::write(&f, "slotz = 3\n").unwrap();
        let e = Settings::gather(&Inputs {
            flags: [("config", f.display().to_string())].into_iter().collect(),
            env: &Inputs::no_env,
            no_context: true,
        })
        .unwrap_err();
        assert!(e.problem.contains("did you mean `slots`"), "{e}");
    }

    #[test]
    fn nats_context_is_read_field_by_field() {
        let dir = tempfile::tempdir().unwrap();
        assert!(load_nats_context(dir.path(), None).unwrap().is_none());
        std::fs::create_dir(dir.path().join("context")).unwrap();
        std::fs::write(dir.path().join("context.txt"), "prod\n").unwrap();
        std::fs::write(
            dir.path().join("context/prod.json"),
            r#"{"description":"x","url":"nats://a:4222,nats://b:4222","token":"t","user":"","creds":"/c.creds","nsc":"","tls_first":true,"jetstream_domain":"hub"}"#,
        )
        .unwrap();
        let ctx = load_nats_context(dir.path(), None).unwrap().unwrap();
        assert_eq!(ctx.name, "prod");
        let c = ctx.values;
        assert_eq!(c["url"], "nats://a:4222,nats://b:4222");
        assert_eq!(c["token"], "t");
        assert!(!c.contains_key("user"));
        assert_eq!(c["creds"], "/c.creds");
        assert_eq!(c["tls_first"], "true");
        assert_eq!(c["jetstream_domain"], "hub");
        // --context (here: the argument) picks another; a missing one is an error.
        assert!(load_nats_context(dir.path(), Some("dev")).is_err());
    }

    #[test]
    fn secrets_from_files_and_flag_warnings() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("tok");
        std::fs::write(&f, "s3cret\n").unwrap();
        let s = gather(&[("token_file", f.to_str().unwrap())], &[]);
        assert_eq!(
            resolve_connect(&s).unwrap().token.as_deref(),
            Some("s3cret")
        );
        assert!(s.warnings.is_empty());
        let s = gather(&[("token", "x")], &[]);
        assert_eq!(s.warnings.len(), 1);
        let s = gather(
            &[("token", "x")],
            &[("JETWORKER_TOKEN_FILE", f.to_str().unwrap())],
        );
        assert_eq!(resolve_connect(&s).unwrap_err().setting, "token");
        let s = gather(&[], &[("NATS_TOKEN", "from-env")]);
        assert_eq!(
            resolve_connect(&s).unwrap().token.as_deref(),
            Some("from-env")
        );
        assert!(s.warnings.is_empty());
    }
}
