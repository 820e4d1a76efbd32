//! `jetworker logs` (placeholder until the operator CLI lands).

use clap::Args;

#[derive(Debug, Clone, Args)]
pub struct LogsArgs {}

pub async fn run(_ctx: &super::Ctx, _args: LogsArgs) -> anyhow::Result<super::Exit> {
    anyhow::bail!("`jetworker logs` is not implemented yet")
}
