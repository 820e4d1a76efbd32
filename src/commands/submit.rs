//! `jetworker submit` (placeholder until the operator CLI lands).

use clap::Args;

#[derive(Debug, Clone, Args)]
pub struct SubmitArgs {}

pub async fn run(_ctx: &super::Ctx, _args: SubmitArgs) -> anyhow::Result<super::Exit> {
    anyhow::bail!("`jetworker submit` is not implemented yet")
}
