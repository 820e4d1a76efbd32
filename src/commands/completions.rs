//! `jetworker completions <shell>` and `jetworker man`: a shell completion
//! script (clap_complete) and the man page (clap_mangen), both generated
//! from the same definitions as `--help`, printed to stdout. Exit 0, or 2
//! when stdout cannot be written.

use std::io::Write;

use clap::{Args, CommandFactory};
use clap_complete::Shell;

use super::cli::Cli;
use super::Exit;

#[derive(Debug, Clone, Args)]
#[command(after_help = "\
Examples:
  jetworker completions bash > ~/.local/share/bash-completion/completions/jetworker
  jetworker completions zsh > ~/.zfunc/_jetworker
  jetworker completions fish > ~/.config/fish/completions/jetworker.fish")]
pub struct CompletionsArgs {
    /// The shell.
    #[arg(value_enum)]
    pub shell: Shell,
}

#[derive(Debug, Clone, Args)]
#[command(after_help = "\
Examples:
  jetworker man > jetworker.1 && man ./jetworker.1
  sudo sh -c 'jetworker man > /usr/local/share/man/man1/jetworker.1'")]
pub struct ManArgs {}

pub fn completions(a: &CompletionsArgs) -> anyhow::Result<Exit> {
    let mut cmd = Cli::command();
    let mut out = Vec::new();
    clap_complete::generate(a.shell, &mut cmd, "jetworker", &mut out);
    let mut o = std::io::stdout().lock();
    o.write_all(&out)?;
    o.flush()?;
    Ok(Exit::Ok)
}

pub fn man(_a: &ManArgs) -> anyhow::Result<Exit> {
    let mut out = Vec::new();
    clap_mangen::Man::new(Cli::command()).render(&mut out)?;
    let mut o = std::io::stdout().lock();
    o.write_all(&out)?;
    o.flush()?;
    Ok(Exit::Ok)
}
