//! `jetworker results` (placeholder until the operator CLI lands).

use clap::Args;

#[derive(Debug, Clone, Args)]
pub struct ResultsArgs {}

pub async fn run(_ctx: &super::Ctx, _args: ResultsArgs) -> anyhow::Result<super::Exit> {
    anyhow::bail!("`jetworker results` is not implemented yet")
}
