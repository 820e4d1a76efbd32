//! `jetworker schedule` (placeholder until the operator CLI lands).

use clap::Args;

#[derive(Debug, Clone, Args)]
pub struct ScheduleArgs {}

pub async fn run(_ctx: &super::Ctx, _args: ScheduleArgs) -> anyhow::Result<super::Exit> {
    anyhow::bail!("`jetworker schedule` is not implemented yet")
}
