//! Command-line definitions (clap). The settings flags are not written out
//! here: they are built from [`crate::config::SETTINGS`] (one definition per
//! setting), global ones (connection, names, logging) on every subcommand,
//! worker ones on `run` and `config check`. Their values go to
//! [`crate::config::Settings::gather`] as plain strings.

use std::collections::BTreeMap;

use clap::{Arg, ArgAction, ArgMatches, Args, FromArgMatches, Parser, Subcommand};

use crate::config::{Group, Kind, SETTINGS};

const EXAMPLES: &str = "\
Examples:
  jetworker run --labels default,gpu --slots 4      # a worker
  jetworker submit --wait -- 'echo hello'           # a task; exit 0 if it succeeded
  jetworker results -f                              # results as they come
  jetworker workers --watch
  jetworker queues                                  # waiting, running, oldest, paused
  jetworker status 3f9a2c                           # exit 0/1 final, 3 not yet, 4 unknown
  jetworker config check --show-sources             # every setting and its source

Connection settings follow the nats CLI: --server/NATS_URL replace only the
URL of the selected `nats` context; its credentials and TLS stay.";

/// jetworker: a task worker for NATS JetStream, and its operator tools.
#[derive(Debug, Parser)]
#[command(
    name = "jetworker",
    version,
    about,
    propagate_version = true,
    args_override_self = true,
    after_help = EXAMPLES
)]
pub struct Cli {
    #[command(flatten)]
    pub global: GlobalArgs,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the worker daemon.
    #[command(after_help = RUN_EXAMPLES)]
    Run(Box<RunArgs>),
    /// Submit a task (or N shards of one).
    #[command(after_help = SUBMIT_EXAMPLES)]
    Submit(super::submit::SubmitArgs),
    /// List recent results, follow new ones, or show one task's attempts.
    Results(super::results::ResultsArgs),
    /// List online workers, or watch them come and go.
    Workers(super::workers::WorkersArgs),
    /// Per label: tasks waiting and running, the oldest, paused or not.
    Queues(super::queues::QueuesArgs),
    /// Where one task stands (exit 0 success, 1 failed, 3 not final, 4 unknown).
    Status(super::status::StatusArgs),
    /// Stop a label's workers from taking new tasks.
    Pause(super::queues::PauseArgs),
    /// Let a paused label's workers take tasks again.
    Resume(super::queues::ResumeArgs),
    /// Probe a worker's /readyz (or /healthz): exit 0 when it answers 200.
    Health(super::health::HealthArgs),
    /// Cancel a queued or running task.
    Cancel(super::cancel::CancelArgs),
    /// Follow the live output of a running task.
    Logs(super::logs::LogsArgs),
    /// List, replay or purge dead letters.
    Dead(super::dead::DeadArgs),
    /// Run failed (or expired, dead, rejected) tasks again under new ids.
    #[command(after_help = RETRY_EXAMPLES)]
    Retry(super::retry::RetryArgs),
    /// Manage cron schedules stored in the task stream.
    Schedule(super::schedule::ScheduleArgs),
    /// Print the JSON Schema of the task message.
    Schema(super::schema::SchemaArgs),
    /// Create or update the streams and buckets.
    Setup(super::setup::SetupArgs),
    /// Serve a live web dashboard (workers, queues, results, live output).
    Ui(crate::ui::UiArgs),
    /// Check the settings and show where each comes from.
    Config(super::configcmd::ConfigArgs),
    /// Print a shell completion script (bash, zsh, fish, elvish, powershell).
    Completions(super::completions::CompletionsArgs),
    /// Print the man page (roff) to stdout.
    Man(super::completions::ManArgs),
}

const RUN_EXAMPLES: &str = "\
Examples:
  jetworker run                                     # label default, all task types
  jetworker run --labels gpu --types command --slots 2
  NATS_URL=nats://nats:4222 jetworker run --metrics-addr 0.0.0.0:9090
  jetworker --config /etc/jetworker/config.toml run";

const SUBMIT_EXAMPLES: &str = "\
Examples:
  jetworker submit -- 'echo hello'                  # prints the task id
  jetworker submit --wait -- 'make test'            # exit 0 only if it succeeded
  jetworker submit --type command --retries 2 -- /bin/echo hi
  jetworker submit --shards 8 --wait -- 'process-part $SHARD_NO'
  jetworker submit --file task.json --label gpu     # or a task on stdin (-f -)
  jetworker submit --in 10m --wait -- 'make report' # runs in 10 minutes
  jetworker submit --expires 30m -- 'send-reminder' # not run after 30 minutes";

const RETRY_EXAMPLES: &str = "\
Examples:
  jetworker retry 3f9akx2m                          # runs it again as 3f9akx2m-r1
  jetworker retry --status failed --since 1h        # every task that failed in the last hour
  jetworker retry --status expired --label gpu --dry-run";

/// The settings flags of some groups, by setting key.
#[derive(Debug, Clone, Default)]
pub struct SettingFlags {
    pub values: BTreeMap<&'static str, String>,
}

/// The help line of a setting: doc, environment variables, default.
fn help_of(def: &crate::config::Setting) -> String {
    let mut h = def.doc_text();
    if !def.env.is_empty() {
        h.push_str(&format!(" [env: {}]", def.env.join(", ")));
    }
    let d = def.default_text();
    if !d.is_empty() {
        h.push_str(&format!(" [default: {d}]"));
    }
    h
}

fn augment(mut cmd: clap::Command, groups: &[Group], global: bool) -> clap::Command {
    for def in SETTINGS.iter().filter(|d| groups.contains(&d.group)) {
        let mut a = Arg::new(def.key)
            .long(def.flag)
            .value_name(def.value_name)
            .help(help_of(def))
            .help_heading(def.group.heading())
            .global(global)
            .action(ArgAction::Set);
        if let Some(c) = def.short {
            a = a.short(c);
        }
        if !def.aliases.is_empty() {
            a = a.aliases(def.aliases.iter().copied());
        }
        if def.group == Group::Names {
            // Ten names would crowd every `-h`; `--help` shows them.
            a = a.hide_short_help(true);
        }
        if def.kind == Kind::Bool {
            // `--tlsfirst` alone is true; a value needs `=` so that the
            // next word is never taken for it.
            a = a
                .num_args(0..=1)
                .require_equals(true)
                .default_missing_value("true");
        }
        cmd = cmd.arg(a);
    }
    cmd
}

fn collect(m: &ArgMatches, groups: &[Group]) -> SettingFlags {
    let mut values = BTreeMap::new();
    for def in SETTINGS.iter().filter(|d| groups.contains(&d.group)) {
        if let Ok(Some(v)) = m.try_get_one::<String>(def.key) {
            if m.value_source(def.key) == Some(clap::parser::ValueSource::CommandLine) {
                values.insert(def.key, v.clone());
            }
        }
    }
    SettingFlags { values }
}

/// Config-file, context, connection, names and log flags: global, so they
/// work before or after any subcommand.
#[derive(Debug, Clone, Default)]
pub struct GlobalArgs {
    pub flags: SettingFlags,
    /// `--no-context`: ignore the selected `nats` context.
    pub no_context: bool,
}

const GLOBAL_GROUPS: [Group; 4] = [
    Group::General,
    Group::Connection,
    Group::Names,
    Group::Logging,
];

impl Args for GlobalArgs {
    fn augment_args(cmd: clap::Command) -> clap::Command {
        augment(cmd, &GLOBAL_GROUPS, true).arg(
            Arg::new("no_context")
                .long("no-context")
                .help("Ignore the selected nats context")
                .help_heading(Group::General.heading())
                .global(true)
                .action(ArgAction::SetTrue),
        )
    }
    fn augment_args_for_update(cmd: clap::Command) -> clap::Command {
        Self::augment_args(cmd)
    }
}

impl FromArgMatches for GlobalArgs {
    fn from_arg_matches(m: &ArgMatches) -> Result<Self, clap::Error> {
        Ok(GlobalArgs {
            flags: collect(m, &GLOBAL_GROUPS),
            no_context: m.try_get_one::<bool>("no_context").ok().flatten() == Some(&true),
        })
    }
    fn update_from_arg_matches(&mut self, m: &ArgMatches) -> Result<(), clap::Error> {
        *self = Self::from_arg_matches(m)?;
        Ok(())
    }
}

/// The worker's own settings (`run`, `config check`).
#[derive(Debug, Clone, Default)]
pub struct WorkerArgs {
    pub flags: SettingFlags,
}

impl Args for WorkerArgs {
    fn augment_args(cmd: clap::Command) -> clap::Command {
        augment(cmd, &[Group::Worker], false)
    }
    fn augment_args_for_update(cmd: clap::Command) -> clap::Command {
        Self::augment_args(cmd)
    }
}

impl FromArgMatches for WorkerArgs {
    fn from_arg_matches(m: &ArgMatches) -> Result<Self, clap::Error> {
        Ok(WorkerArgs {
            flags: collect(m, &[Group::Worker]),
        })
    }
    fn update_from_arg_matches(&mut self, m: &ArgMatches) -> Result<(), clap::Error> {
        *self = Self::from_arg_matches(m)?;
        Ok(())
    }
}

/// `jetworker run`.
#[derive(Debug, Clone, Default, Args)]
pub struct RunArgs {
    #[command(flatten)]
    pub worker: WorkerArgs,
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn the_command_line_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn help_screens_group_connection_flags_and_show_examples() {
        let mut cli = Cli::command();
        // Global flags reach the subcommands when the command is built.
        cli.build();
        for name in ["run", "submit"] {
            let help = cli
                .find_subcommand_mut(name)
                .unwrap()
                .render_long_help()
                .to_string();
            for part in ["Connection:", "Examples:", "[env: NATS_URL]", "[default: "] {
                assert!(help.contains(part), "{name} --help lacks {part}:\n{help}");
            }
        }
    }

    #[test]
    fn global_flags_work_after_the_subcommand() {
        let c = Cli::try_parse_from([
            "jetworker",
            "workers",
            "--server",
            "nats://x:1",
            "--tlsfirst",
            "--no-context",
        ])
        .unwrap();
        assert_eq!(c.global.flags.values["server"], "nats://x:1");
        assert_eq!(c.global.flags.values["tls_first"], "true");
        assert!(c.global.no_context);
        let c = Cli::try_parse_from(["jetworker", "run", "--slots", "3", "--slots", "4"]).unwrap();
        let Command::Run(r) = c.command else {
            panic!("run")
        };
        assert_eq!(r.worker.flags.values["slots"], "4");
    }
}
