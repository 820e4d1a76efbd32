//! `jetworker cancel` (placeholder until the operator CLI lands).

use clap::Args;

#[derive(Debug, Clone, Args)]
pub struct CancelArgs {}

pub async fn run(_ctx: &super::Ctx, _args: CancelArgs) -> anyhow::Result<super::Exit> {
    anyhow::bail!("`jetworker cancel` is not implemented yet")
}
