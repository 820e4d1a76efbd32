//! `jetworker schema`: the JSON Schema of the task message, generated from
//! the Rust type the worker deserialises ([`TaskMessage`]), so it cannot
//! drift from what workers accept. For editors and for publishers written
//! in other languages.

use clap::Args;

use super::Exit;
use crate::protocol::TaskMessage;

#[derive(Debug, Clone, Args)]
pub struct SchemaArgs {}

/// The schema as a JSON value.
pub fn task_schema() -> serde_json::Value {
    serde_json::to_value(schemars::schema_for!(TaskMessage)).unwrap_or_default()
}

pub async fn run(_ctx: &super::Ctx, _args: SchemaArgs) -> anyhow::Result<Exit> {
    let text = serde_json::to_string_pretty(&task_schema())?;
    super::output::line(&text)?;
    Ok(Exit::Ok)
}
