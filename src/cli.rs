//! Command-line definitions (clap). Global connection and log flags work
//! before or after any subcommand; worker settings are taken as strings
//! (with their environment variables) and validated in [`crate::config`].

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};

/// jetworker: a task worker for NATS JetStream, and its operator tools.
#[derive(Debug, Parser)]
#[command(
    name = "jetworker",
    version,
    about,
    propagate_version = true,
    args_override_self = true
)]
pub struct Cli {
    #[command(flatten)]
    pub global: GlobalArgs,
    #[command(subcommand)]
    pub command: Command,
}

/// Connection, config-file and log settings shared by every subcommand.
#[derive(Debug, Clone, Default, Args)]
pub struct GlobalArgs {
    /// TOML config file.
    #[arg(long, global = true, env = "JETWORKER_CONFIG", value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// NATS server URL(s), comma separated.
    #[arg(long, short = 's', global = true, env = "NATS_URL", value_name = "URL")]
    pub server: Option<String>,
    /// NATS credentials file (JWT + nkey seed).
    #[arg(long, global = true, env = "JETWORKER_CREDS", value_name = "FILE")]
    pub creds: Option<PathBuf>,
    /// NATS nkey seed file.
    #[arg(long, global = true, env = "JETWORKER_NKEY", value_name = "FILE")]
    pub nkey: Option<PathBuf>,
    /// NATS token.
    #[arg(long, global = true, env = "JETWORKER_TOKEN", hide_env_values = true)]
    pub token: Option<String>,
    /// NATS user (with --password).
    #[arg(long, global = true, env = "JETWORKER_USER")]
    pub user: Option<String>,
    /// NATS password (with --user).
    #[arg(
        long,
        global = true,
        env = "JETWORKER_PASSWORD",
        hide_env_values = true
    )]
    pub password: Option<String>,
    /// CA certificate (PEM) to verify the server.
    #[arg(long, global = true, env = "JETWORKER_TLS_CA", value_name = "FILE")]
    pub tls_ca: Option<PathBuf>,
    /// Client certificate (PEM), with --tls-key.
    #[arg(long, global = true, env = "JETWORKER_TLS_CERT", value_name = "FILE")]
    pub tls_cert: Option<PathBuf>,
    /// Client key (PEM), with --tls-cert.
    #[arg(long, global = true, env = "JETWORKER_TLS_KEY", value_name = "FILE")]
    pub tls_key: Option<PathBuf>,
    /// Log format: text or json.
    #[arg(long, global = true, env = "JETWORKER_LOG_FORMAT")]
    pub log_format: Option<String>,
    /// Log level or filter (info, debug, jetworker=trace); also RUST_LOG.
    #[arg(long, global = true, env = "LOG_LEVEL")]
    pub log_level: Option<String>,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the worker daemon.
    Run(Box<RunArgs>),
    /// Submit a task (or N shards of one).
    Submit(crate::commands::submit::SubmitArgs),
    /// List recent results, follow new ones, or show one task's attempts.
    Results(crate::commands::results::ResultsArgs),
    /// List online workers, or watch them come and go.
    Workers(crate::commands::workers::WorkersArgs),
    /// Cancel a queued or running task.
    Cancel(crate::commands::cancel::CancelArgs),
    /// Follow the live output of a running task.
    Logs(crate::commands::logs::LogsArgs),
    /// List, replay or purge dead letters.
    Dead(crate::commands::dead::DeadArgs),
    /// Manage cron schedules stored in the task stream.
    Schedule(crate::commands::schedule::ScheduleArgs),
    /// Print the JSON Schema of the task message.
    Schema(crate::commands::schema::SchemaArgs),
    /// Create or update the streams and buckets.
    Setup(crate::commands::setup::SetupArgs),
}

/// Worker settings (DESIGN.md section 7). Strings here; validated in config.
#[derive(Debug, Clone, Default, Args)]
pub struct RunArgs {
    /// Worker name; the id is <name>-<random> (also WORKER_NAME).
    #[arg(long, env = "JETWORKER_NAME")]
    pub name: Option<String>,
    /// Labels (queues) to serve, comma separated.
    #[arg(long, env = "JETWORKER_LABELS")]
    pub labels: Option<String>,
    /// Task types to accept (shell,command,http,container).
    #[arg(long, env = "JETWORKER_TYPES")]
    pub types: Option<String>,
    /// Maximum tasks running at once (default: number of CPUs).
    #[arg(long, env = "JETWORKER_SLOTS")]
    pub slots: Option<String>,
    /// Timeout of a task that names none (300s).
    #[arg(long, env = "JETWORKER_DEFAULT_TIMEOUT")]
    pub default_timeout: Option<String>,
    /// Time between SIGTERM and SIGKILL (10s).
    #[arg(long, env = "JETWORKER_KILL_GRACE")]
    pub kill_grace: Option<String>,
    /// Consumer ack wait (30s); progress acks every third of it.
    #[arg(long, env = "JETWORKER_ACK_WAIT")]
    pub ack_wait: Option<String>,
    /// Heartbeat interval (5s).
    #[arg(long, env = "JETWORKER_HEARTBEAT")]
    pub heartbeat: Option<String>,
    /// A worker silent this long is offline (30s).
    #[arg(long, env = "JETWORKER_OFFLINE_AFTER")]
    pub offline_after: Option<String>,
    /// Time running tasks get to finish on shutdown (30s).
    #[arg(long, env = "JETWORKER_DRAIN_TIMEOUT")]
    pub drain_timeout: Option<String>,
    /// Output kept per attempt (256KiB), clamped to the server's max_payload.
    #[arg(long, env = "JETWORKER_OUTPUT_CAP")]
    pub output_cap: Option<String>,
    /// Larger tasks are rejected (256KiB).
    #[arg(long, env = "JETWORKER_MAX_TASK_BYTES")]
    pub max_task_bytes: Option<String>,
    /// Outbox and local state.
    #[arg(long, env = "JETWORKER_STATE_DIR")]
    pub state_dir: Option<PathBuf>,
    /// Serve /metrics, /healthz, /readyz on this address.
    #[arg(long, env = "JETWORKER_METRICS_ADDR")]
    pub metrics_addr: Option<String>,
    /// Worker environment variables passed to tasks, comma separated.
    #[arg(long, env = "JETWORKER_PASS_ENV")]
    pub pass_env: Option<String>,
    /// Shell for shell tasks ("bash -c").
    #[arg(long, env = "JETWORKER_SHELL")]
    pub shell: Option<String>,
    /// Run shell and command tasks as this user (worker must be root).
    #[arg(long, env = "JETWORKER_TASK_USER")]
    pub task_user: Option<String>,
    /// Docker networks container tasks may use besides none and bridge.
    #[arg(long, env = "JETWORKER_ALLOWED_NETWORKS")]
    pub allowed_networks: Option<String>,
    /// Network of container tasks that name none (bridge).
    #[arg(long, env = "JETWORKER_DEFAULT_NETWORK")]
    pub default_network: Option<String>,
    /// Docker Engine address (default: DOCKER_HOST or the local socket).
    #[arg(long, env = "JETWORKER_DOCKER_HOST")]
    pub docker_host: Option<String>,
    /// Refuse http tasks to private, loopback and link-local addresses.
    #[arg(long, env = "JETWORKER_DENY_PRIVATE_HTTP", num_args = 0..=1, default_missing_value = "true")]
    pub deny_private_http: Option<String>,
    /// Per-task cgroups where the tree is writable: auto (default) or off.
    #[arg(long, env = "JETWORKER_CGROUPS")]
    pub cgroups: Option<String>,
    /// When cut off longer than ack wait: kill (default) or keep running tasks.
    #[arg(long, env = "JETWORKER_ON_LEASE_LOST")]
    pub on_lease_lost: Option<String>,
}
