//! Subcommand dispatch, one module per subcommand. [`main`] is the real
//! `main`: it parses arguments, sets up logging, builds the runtime and maps
//! results to exit codes (0 ok, 1 a task did not succeed, 2 usage,
//! configuration or connection error; `status` adds 3 not final yet and 4
//! unknown id).

// Doc comments on clap arguments are `--help` text, not rustdoc: `<id>` and
// `uid[:gid]` there are placeholders, not HTML or links.
#![allow(rustdoc::invalid_html_tags, rustdoc::broken_intra_doc_links)]

pub mod cancel;
pub mod cli;
pub mod common;
pub mod completions;
pub mod configcmd;
pub mod dead;
pub mod health;
pub mod logs;
pub mod output;
pub mod queues;
pub mod results;
pub mod retry;
pub mod run;
pub mod schedule;
pub mod schema;
pub mod setup;
pub mod status;
pub mod submit;
pub mod taskflags;
pub mod tree;
pub mod workers;

use std::io::IsTerminal;
use std::process::ExitCode;

use clap::Parser;

use crate::config::{self, ConfigError, ConnectConfig, Inputs, LogConfig, Settings};
use cli::{Cli, Command};

/// What a subcommand came to, besides errors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Exit {
    /// Exit 0.
    Ok,
    /// Exit 1: the task(s) did not succeed.
    NotSucceeded,
    /// Exit 3 (`status`): the task has no final result yet.
    NotFinal,
    /// Exit 4 (`status`): no task with this id is known.
    Unknown,
}

/// Shared settings handed to every subcommand.
pub struct Ctx {
    pub connect: ConnectConfig,
    /// Task types the config file defines: `schema` shows them and local
    /// validation checks their tasks.
    pub type_defs: Vec<crate::runner::defined::TypeDef>,
}

impl Ctx {
    /// Connect for an operator command (fails fast).
    pub async fn client(&self) -> anyhow::Result<async_nats::Client> {
        crate::connect::connect_cli(&self.connect).await
    }
}

/// Whether log lines (on stderr) may carry colour: stderr is a terminal
/// and `NO_COLOR` is unset (log files and `docker logs` get plain text).
pub fn log_colour() -> bool {
    std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty())
}

/// Set up `tracing` to stderr: text, or JSON lines with every field
/// (the spans' too: `worker_id`, `task_id`, …) at the top level
/// (`crate::logfmt`).
pub fn init_logging(log: &LogConfig) {
    let filter = tracing_subscriber::EnvFilter::try_new(&log.level)
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let b = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(!log.json && log_colour())
        .with_writer(std::io::stderr);
    let _ = if log.json {
        b.fmt_fields(tracing_subscriber::fmt::format::JsonFields::new())
            .event_format(crate::logfmt::FlatJson)
            .try_init()
    } else {
        b.try_init()
    };
}

/// Whether an error is a broken pipe (`jetworker results | head`).
fn is_broken_pipe(e: &anyhow::Error) -> bool {
    e.chain().any(|c| {
        c.downcast_ref::<std::io::Error>()
            .map(|io| io.kind() == std::io::ErrorKind::BrokenPipe)
            .unwrap_or(false)
    })
}

/// The binary's entry point.
pub fn main() -> ExitCode {
    let cli = Cli::parse();
    match run_cli(cli) {
        Ok(Exit::Ok) => ExitCode::SUCCESS,
        Ok(Exit::NotSucceeded) => ExitCode::from(1),
        Ok(Exit::NotFinal) => ExitCode::from(3),
        Ok(Exit::Unknown) => ExitCode::from(4),
        Err(e) if is_broken_pipe(&e) => ExitCode::SUCCESS,
        Err(e) => {
            if let Some(c) = e.downcast_ref::<ConfigError>() {
                eprintln!("jetworker: {c}");
            } else {
                eprintln!("jetworker: {e:#}");
            }
            ExitCode::from(2)
        }
    }
}

fn run_cli(cli: Cli) -> anyhow::Result<Exit> {
    // These print text generated from the definitions alone: no settings.
    match &cli.command {
        Command::Completions(a) => return completions::completions(a),
        Command::Man(a) => return completions::man(a),
        _ => {}
    }
    let mut flags = cli.global.flags.values.clone();
    match &cli.command {
        Command::Run(a) => flags.extend(a.worker.flags.values.clone()),
        Command::Config(a) => flags.extend(a.worker_flags()),
        _ => {}
    }
    let settings = Settings::gather(&Inputs {
        flags,
        env: &Inputs::process_env,
        no_context: cli.global.no_context,
    })?;
    let mut log = config::resolve_log(&settings)?;
    // Operator commands talk to people: the client's connection chatter
    // at info level is noise there, so they log warnings unless asked.
    if !matches!(cli.command, Command::Run(_)) && !log.level_given {
        log.level = "warn".into();
    }
    init_logging(&log);
    for w in &settings.warnings {
        tracing::warn!("{w}");
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    if let Command::Run(_) = cli.command {
        let cfg = config::resolve_worker(&settings)?;
        return rt.block_on(run::run(cfg));
    }
    if let Command::Config(a) = cli.command {
        return configcmd::run(&settings, a);
    }
    if let Command::Health(a) = cli.command {
        return rt.block_on(health::run(&settings, a));
    }
    let connect = config::resolve_connect(&settings)?;
    let ctx = Ctx {
        connect,
        type_defs: settings.type_defs.clone(),
    };
    rt.block_on(async move {
        match cli.command {
            Command::Run(_)
            | Command::Config(_)
            | Command::Health(_)
            | Command::Completions(_)
            | Command::Man(_) => {
                unreachable!()
            }
            Command::Submit(a) => submit::run(&ctx, a).await,
            Command::Results(a) => results::run(&ctx, a).await,
            Command::Workers(a) => workers::run(&ctx, a).await,
            Command::Queues(a) => queues::run(&ctx, a).await,
            Command::Status(a) => status::run(&ctx, a).await,
            Command::Pause(a) => queues::pause(&ctx, a).await,
            Command::Resume(a) => queues::resume(&ctx, a).await,
            Command::Cancel(a) => cancel::run(&ctx, a).await,
            Command::Logs(a) => logs::run(&ctx, a).await,
            Command::Dead(a) => dead::run(&ctx, a).await,
            Command::Retry(a) => retry::run(&ctx, a).await,
            Command::Schedule(a) => schedule::run(&ctx, a).await,
            Command::Schema(a) => schema::run(&ctx, a).await,
            Command::Setup(a) => setup::run(&ctx, a).await,
            Command::Ui(a) => crate::ui::run(&ctx, a).await,
        }
    })
}
