//! `jetworker schema` (placeholder until the operator CLI lands).

use clap::Args;

#[derive(Debug, Clone, Args)]
pub struct SchemaArgs {}

pub async fn run(_ctx: &super::Ctx, _args: SchemaArgs) -> anyhow::Result<super::Exit> {
    anyhow::bail!("`jetworker schema` is not implemented yet")
}
