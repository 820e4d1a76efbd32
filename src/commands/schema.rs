//! `jetworker schema`: the JSON Schema of the task message, generated from
//! the Rust type the worker deserialises (the envelope,
//! [`crate::protocol::TaskMessage`]) and the registered types' fields (the
//! built-in ones and those the config file defines), so it cannot drift
//! from what workers accept. For editors and for publishers written in
//! other languages.

use clap::Args;

use super::Exit;

#[derive(Debug, Clone, Args)]
pub struct SchemaArgs {}

/// The schema of the built-in types and `defined`, as a JSON value.
pub fn task_schema(defined: &[crate::runner::defined::TypeDef]) -> serde_json::Value {
    crate::runner::Registry::validators(Vec::new(), defined).schema()
}

pub async fn run(ctx: &super::Ctx, _args: SchemaArgs) -> anyhow::Result<Exit> {
    let text = serde_json::to_string_pretty(&task_schema(&ctx.type_defs))?;
    super::output::line(&text)?;
    Ok(Exit::Ok)
}
