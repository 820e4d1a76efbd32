//! The `shell` type: a script run by the worker's shell (`bash -c`), with
//! the process handling of [`super::command::ProcessRunner`].

use std::sync::Arc;

use schemars::JsonSchema;
use serde::Deserialize;

use super::command::{ProcessRunner, ProcessSpec};
use super::{fields_schema_of, Fields, Outcome, RunContext, Runner};
use crate::protocol::{Invalid, Task};

/// The fields of a `shell` task.
#[derive(Debug, Deserialize, JsonSchema)]
#[schemars(title = "shell")]
struct ShellFields {
    /// shell: the script.
    script: Option<String>,
    /// Seed short form: shell → the script, http → the URL, container →
    /// docker-run options.
    payload: Option<String>,
}

/// Runs `shell` tasks.
pub struct ShellRunner {
    process: Option<Arc<ProcessRunner>>,
}

impl ShellRunner {
    /// Shell tasks run by `process`.
    pub(crate) fn new(process: Arc<ProcessRunner>) -> Self {
        ShellRunner {
            process: Some(process),
        }
    }

    /// Validation only (the CLI): running fails.
    pub(crate) fn validator() -> Self {
        ShellRunner { process: None }
    }
}

impl Runner for ShellRunner {
    type Spec = ProcessSpec;

    fn name(&self) -> &str {
        "shell"
    }

    fn fields_schema(&self) -> serde_json::Value {
        fields_schema_of::<ShellFields>()
    }

    fn validate(&self, fields: &Fields, _task: &Task) -> Result<ProcessSpec, Invalid> {
        let f: ShellFields = fields.parse()?;
        let (script, field) = match (f.script, f.payload) {
            (Some(_), Some(_)) => {
                return Err(Invalid::new(
                    "payload",
                    "give either `script` or `payload`, not both",
                ))
            }
            (Some(s), None) => (s, "script"),
            (None, Some(p)) => (p, "payload"),
            (None, None) => return Err(Invalid::new("script", "missing (or give `payload`)")),
        };
        if script.trim().is_empty() {
            return Err(Invalid::new(field, "is empty"));
        }
        if script.contains('\0') {
            return Err(Invalid::new(field, "contains a NUL byte"));
        }
        Ok(ProcessSpec::Shell { script })
    }

    async fn run(&self, spec: &ProcessSpec, ctx: RunContext) -> Outcome {
        super::command::run_on(self.process.as_deref(), spec, ctx).await
    }
}
