//! The registry of task types: every [`Runner`] a worker knows, by name.
//!
//! Validation goes through it ([`Registry::validate`]): the type's own
//! fields (everything in a task message besides the envelope) are checked
//! against the names the runner's schema declares (a field of another
//! type: "does not apply to type …"; an unknown one: "did you mean …"),
//! then handed to the runner, which builds its spec. A task of a type the
//! registry does not hold validates without a spec: the worker hands it
//! back for a worker that runs it. The JSON Schema of the task message is
//! generated from the registered types ([`Registry::schema`]).

use std::any::Any;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use serde_json::{Map, Value};

use super::{Fields, Outcome, RunContext, Runner};
use crate::protocol::{Invalid, Task};

/// A validated type spec, type-erased; the runner that made it downcasts.
pub(crate) type AnySpec = Arc<dyn Any + Send + Sync>;

type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// [`Runner`] with its spec type erased, so that runners of different spec
/// types share one registry.
trait DynRunner: Send + Sync {
    fn name(&self) -> &str;
    fn validate(&self, fields: &Fields, task: &Task) -> Result<AnySpec, Invalid>;
    fn run(&self, ctx: RunContext) -> BoxFuture<'_, Outcome>;
    fn available(&self) -> BoxFuture<'_, bool>;
}

impl<R: Runner> DynRunner for R {
    fn name(&self) -> &str {
        Runner::name(self)
    }
    fn validate(&self, fields: &Fields, task: &Task) -> Result<AnySpec, Invalid> {
        Runner::validate(self, fields, task).map(|s| Arc::new(s) as AnySpec)
    }
    fn run(&self, ctx: RunContext) -> BoxFuture<'_, Outcome> {
        Box::pin(super::run_attempt(self, ctx))
    }
    fn available(&self) -> BoxFuture<'_, bool> {
        Box::pin(Runner::available(self))
    }
}

/// One registered type.
struct Entry {
    runner: Box<dyn DynRunner>,
    /// The field names its schema declares.
    fields: Vec<String>,
    /// Its schema of the type's own fields.
    schema: Value,
}

/// The task types one worker (or the CLI, for local validation) knows.
/// Cheap to clone.
#[derive(Clone, Default)]
pub struct Registry {
    entries: Vec<Arc<Entry>>,
}

impl std::fmt::Debug for Registry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.names()).finish()
    }
}

impl Registry {
    /// An empty registry.
    pub fn new() -> Self {
        Self::default()
    }

    /// The built-in types (shell, command, http, container) and `defined`
    /// for validation only: running a task through them fails. Container
    /// tasks may name the networks in `allowed_networks` besides `none` and
    /// `bridge`.
    pub fn validators(allowed_networks: Vec<String>, defined: &[super::defined::TypeDef]) -> Self {
        let mut r = Registry::new();
        r.register(super::shell::ShellRunner::validator())
            .and_then(|r| r.register(super::command::CommandRunner::validator()))
            .and_then(|r| r.register(super::http::HttpRunner::validator()))
            .and_then(|r| {
                r.register(super::container::ContainerRunner::validator(
                    allowed_networks,
                ))
            })
            .expect("the built-in names are distinct");
        for d in defined {
            // Config resolution refuses clashes; a duplicate is left out.
            let _ = r.register(super::defined::DefinedRunner::validator(d.clone()));
        }
        r
    }

    /// Add a runner. Errors when its name is not a valid type name
    /// (`[a-z0-9_-]{1,64}`, starting with a letter) or is taken.
    pub fn register<R: Runner>(&mut self, runner: R) -> Result<&mut Self, String> {
        let name = Runner::name(&runner).to_string();
        if let Err(e) = check_type_name(&name) {
            return Err(format!("type name `{name}`: {e}"));
        }
        if self.contains(&name) {
            return Err(format!("type `{name}` is registered twice"));
        }
        let schema = Runner::fields_schema(&runner);
        let fields = schema
            .get("properties")
            .and_then(Value::as_object)
            .map(|p| p.keys().cloned().collect())
            .unwrap_or_default();
        self.entries.push(Arc::new(Entry {
            runner: Box::new(runner),
            fields,
            schema,
        }));
        Ok(self)
    }

    /// Registered type names, in registration order.
    pub fn names(&self) -> Vec<&str> {
        self.entries.iter().map(|e| e.runner.name()).collect()
    }

    /// Whether `name` is registered.
    pub fn contains(&self, name: &str) -> bool {
        self.entry(name).is_some()
    }

    fn entry(&self, name: &str) -> Option<&Entry> {
        self.entries
            .iter()
            .find(|e| e.runner.name() == name)
            .map(|e| &**e)
    }

    /// Validate a task's own fields with its type's runner: `Ok(None)` when
    /// the type is not registered here.
    pub(crate) fn validate(
        &self,
        fields: &Fields,
        task: &Task,
    ) -> Result<Option<AnySpec>, Invalid> {
        let Some(entry) = self.entry(&task.task_type) else {
            return Ok(None);
        };
        for name in fields.names() {
            if entry.fields.iter().any(|f| f == name) {
                continue;
            }
            if self
                .entries
                .iter()
                .any(|e| e.fields.iter().any(|f| f == name))
            {
                return Err(Invalid::new(
                    name,
                    format!("does not apply to type {}", task.task_type),
                ));
            }
            let candidates = entry
                .fields
                .iter()
                .map(String::as_str)
                .chain(crate::protocol::ENVELOPE_FIELDS.iter().copied());
            return Err(Invalid::new(
                name,
                format!(
                    "unknown field `{name}`{}; `jetworker schema` lists the fields",
                    crate::suggest::hint(name, candidates)
                ),
            ));
        }
        entry.runner.validate(fields, task).map(Some)
    }

    /// Run one attempt with the runner of the task's type.
    pub(crate) async fn run(&self, ctx: RunContext) -> Outcome {
        match self.entry(&ctx.task.task_type) {
            Some(e) => e.runner.run(ctx).await,
            None => Outcome::failed(format!(
                "type {} is not registered on this worker",
                ctx.task.task_type
            )),
        }
    }

    /// The registered types that can run on this machine (a runner's
    /// [`Runner::available`]).
    pub async fn available(&self) -> Vec<String> {
        let mut v = Vec::new();
        for e in self.entries.iter() {
            if e.runner.available().await {
                v.push(e.runner.name().to_string());
            }
        }
        v
    }

    /// The JSON Schema of a task message with these types: the envelope
    /// (generated from [`crate::protocol::TaskMessage`]) plus every type's
    /// fields, `type` limited to the registered names, unknown fields
    /// refused. Each type's fields are allowed only with that type.
    pub fn schema(&self) -> Value {
        let mut root = serde_json::to_value(schemars::schema_for!(crate::protocol::TaskMessage))
            .unwrap_or_default();
        let mut defs = root
            .get("$defs")
            .and_then(Value::as_object)
            .cloned()
            .unwrap_or_default();
        let mut by_type = Vec::new();
        let mut all_props = Map::new();
        for e in self.entries.iter() {
            if let Some(d) = e.schema.get("$defs").and_then(Value::as_object) {
                for (k, v) in d {
                    defs.insert(k.clone(), v.clone());
                }
            }
            let props = e
                .schema
                .get("properties")
                .and_then(Value::as_object)
                .cloned()
                .unwrap_or_default();
            for (k, v) in &props {
                all_props.entry(k.clone()).or_insert_with(|| v.clone());
            }
            by_type.push((e.runner.name().to_string(), props));
        }
        // The message object itself and, where nested tasks refer to it by
        // a definition, that definition too.
        let names: Vec<Value> = self
            .names()
            .into_iter()
            .map(|n| Value::String(n.into()))
            .collect();
        let shape = |obj: &mut Map<String, Value>| {
            let props = obj
                .entry("properties")
                .or_insert_with(|| Value::Object(Map::new()));
            if let Some(p) = props.as_object_mut() {
                let mut ty = serde_json::json!({
                    "description": "The task type: a type registered on the workers of the label.",
                    "type": "string",
                });
                if !names.is_empty() {
                    ty["enum"] = Value::Array(names.clone());
                }
                p.insert("type".into(), ty);
                for (k, v) in &all_props {
                    p.entry(k.clone()).or_insert_with(|| v.clone());
                }
            }
            obj.insert("additionalProperties".into(), Value::Bool(false));
            let rules: Vec<Value> = by_type
                .iter()
                .map(|(name, props)| {
                    let foreign: Vec<Value> = all_props
                        .keys()
                        .filter(|k| !props.contains_key(*k))
                        .map(|k| serde_json::json!({ "required": [k] }))
                        .collect();
                    serde_json::json!({
                        "if": { "properties": { "type": { "const": name } }, "required": ["type"] },
                        "then": { "not": { "anyOf": foreign } },
                    })
                })
                .filter(|r| {
                    r["then"]["not"]["anyOf"]
                        .as_array()
                        .is_some_and(|a| !a.is_empty())
                })
                .collect();
            if !rules.is_empty() {
                obj.insert("allOf".into(), Value::Array(rules));
            }
        };
        if let Some(obj) = root.as_object_mut() {
            shape(obj);
        }
        if let Some(Value::Object(t)) = defs.get_mut("TaskMessage") {
            shape(t);
        }
        if !defs.is_empty() {
            root["$defs"] = Value::Object(defs);
        }
        root
    }
}

/// A type name: `[a-z][a-z0-9_-]{0,63}`.
pub(crate) fn check_type_name(name: &str) -> Result<(), String> {
    let mut b = name.bytes();
    let ok = matches!(b.next(), Some(c) if c.is_ascii_lowercase())
        && b.all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == b'_' || c == b'-')
        && name.len() <= 64;
    if ok {
        Ok(())
    } else {
        Err("must be a lowercase letter followed by up to 63 of a-z, 0-9, _ and -".into())
    }
}

/// The JSON Schema (an object with `properties`) of a fields struct, for
/// [`Runner::fields_schema`].
pub fn fields_schema_of<T: schemars::JsonSchema>() -> Value {
    serde_json::to_value(schemars::schema_for!(T)).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn type_names() {
        assert!(check_type_name("resize-image").is_ok());
        assert!(check_type_name("python3").is_ok());
        assert!(check_type_name("Shell").is_err());
        assert!(check_type_name("").is_err());
        assert!(check_type_name("a.b").is_err());
    }

    #[test]
    fn builtins_are_registered_once() {
        let r = Registry::validators(Vec::new(), &[]);
        assert_eq!(r.names(), ["shell", "command", "http", "container"]);
    }
}
