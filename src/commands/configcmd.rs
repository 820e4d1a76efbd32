//! `jetworker config check [--show-sources]`: resolve every setting exactly
//! as `jetworker run` would (flags, environment, config file, `nats`
//! context, defaults), print each effective value — with
//! `--show-sources`, where it came from — and exit 0, or print the one-line
//! error of the first bad value and exit 2. Secrets are never printed.
//!
//! `--json`: one object per setting per line,
//! `{"key","value","source"}`.

use std::collections::BTreeMap;

use clap::{Args, Subcommand};
use serde::Serialize;

use super::cli::WorkerArgs;
use super::output;
use super::Exit;
use crate::config::{resolve_worker, Settings};

#[derive(Debug, Clone, Args)]
pub struct ConfigArgs {
    #[command(subcommand)]
    pub command: ConfigCommand,
}

#[derive(Debug, Clone, Subcommand)]
pub enum ConfigCommand {
    /// Validate the settings and print each effective value.
    #[command(after_help = "\
Examples:
  jetworker config check --show-sources
  JETWORKER_SLOTS=8 jetworker config check --slots 2 --show-sources   # the flag wins")]
    Check(CheckArgs),
}

#[derive(Debug, Clone, Args)]
pub struct CheckArgs {
    /// Say where each value came from (flag, env, file, nats context, default).
    #[arg(long)]
    pub show_sources: bool,
    /// Print JSON lines: {"key","value","source"}.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub worker: WorkerArgs,
}

impl ConfigArgs {
    /// The worker flags given to `config check`.
    pub fn worker_flags(&self) -> BTreeMap<&'static str, String> {
        match &self.command {
            ConfigCommand::Check(c) => c.worker.flags.values.clone(),
        }
    }
}

#[derive(Serialize)]
struct Line<'a> {
    key: &'a str,
    value: &'a str,
    source: String,
}

pub fn run(settings: &Settings, a: ConfigArgs) -> anyhow::Result<Exit> {
    let ConfigCommand::Check(c) = a.command;
    // Validation first: a bad value is exit 2 with its one-line error.
    resolve_worker(settings)?;
    let all = settings.explain();
    let width = all.iter().map(|(d, _, _)| d.key.len()).max().unwrap_or(0);
    if !c.json {
        if let Some(f) = &settings.file {
            output::line(&format!("# config file: {}", f.display()))?;
        }
        if let Some((n, p)) = &settings.context {
            output::line(&format!("# nats context: {n} ({})", p.display()))?;
        }
    }
    for (def, value, source) in &all {
        if c.json {
            output::json_line(&Line {
                key: def.key,
                value,
                source: source.to_string(),
            })?;
        } else if c.show_sources {
            output::line(&format!("{:<width$} = {value:<30} # {source}", def.key))?;
        } else {
            output::line(&format!("{:<width$} = {value}", def.key))?;
        }
    }
    Ok(Exit::Ok)
}
