//! `jetworker setup` (placeholder until the operator CLI lands).

use clap::Args;

#[derive(Debug, Clone, Args)]
pub struct SetupArgs {}

pub async fn run(_ctx: &super::Ctx, _args: SetupArgs) -> anyhow::Result<super::Exit> {
    anyhow::bail!("`jetworker setup` is not implemented yet")
}
