//! `jetworker dead` (placeholder until the operator CLI lands).

use clap::Args;

#[derive(Debug, Clone, Args)]
pub struct DeadArgs {}

pub async fn run(_ctx: &super::Ctx, _args: DeadArgs) -> anyhow::Result<super::Exit> {
    anyhow::bail!("`jetworker dead` is not implemented yet")
}
