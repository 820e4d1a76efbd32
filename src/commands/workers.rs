//! `jetworker workers` (placeholder until the operator CLI lands).

use clap::Args;

#[derive(Debug, Clone, Args)]
pub struct WorkersArgs {}

pub async fn run(_ctx: &super::Ctx, _args: WorkersArgs) -> anyhow::Result<super::Exit> {
    anyhow::bail!("`jetworker workers` is not implemented yet")
}
