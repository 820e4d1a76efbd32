//! Task types defined in the worker's config, for people who don't write
//! Rust: a type name mapped to a command template.
//!
//! ```toml
//! [types.python]
//! command = ["python3", "-c", "{script}"]
//! fields = { script = "string", level = "integer?" }
//! env = { LOG_LEVEL = "{level}" }
//! description = "A Python script"
//! ```
//!
//! A task `{"type":"python","script":"print(1)"}` runs `python3 -c
//! 'print(1)'`: task fields fill the command's words and the environment
//! (never through a shell), with the process handling, containment and
//! limits of `command` tasks. Field kinds: `string`, `integer`, `number`,
//! `boolean`, and `strings` (a list, which must be a whole word: it becomes
//! one word per item); a trailing `?` makes a field optional. A field may
//! also be a table: `{ kind = "string", required = false, description =
//! "…" }`. An optional field that is absent drops a command word that is
//! only that field and leaves unset a variable that is only that field;
//! elsewhere it is empty text. `{{` and
//! `}}` are literal braces. Tasks are validated like the built-in types
//! (a missing field or one of the wrong kind is `rejected` naming it), and
//! the type shows in heartbeats and in `jetworker schema`.

use std::collections::BTreeMap;
use std::sync::Arc;

use serde_json::{json, Value};

use super::command::{ProcessRunner, ProcessSpec};
use super::{check_type_name, Fields, Outcome, RunContext, Runner};
use crate::protocol::{json_kind, Invalid, Task, ENVELOPE_FIELDS};

/// What a field holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FieldKind {
    /// A JSON string.
    String,
    /// A whole number.
    Integer,
    /// Any JSON number.
    Number,
    /// `true` or `false`.
    Boolean,
    /// A list of strings: one word per item.
    Strings,
}

impl FieldKind {
    fn parse(s: &str) -> Option<FieldKind> {
        Some(match s {
            "string" => FieldKind::String,
            "integer" => FieldKind::Integer,
            "number" => FieldKind::Number,
            "boolean" => FieldKind::Boolean,
            "strings" => FieldKind::Strings,
            _ => return None,
        })
    }

    /// The kind with its article, for messages ("an integer").
    fn a(self) -> &'static str {
        match self {
            FieldKind::String => "a string",
            FieldKind::Integer => "an integer",
            FieldKind::Number => "a number",
            FieldKind::Boolean => "a boolean",
            FieldKind::Strings => "a list of strings",
        }
    }

    fn as_str(self) -> &'static str {
        match self {
            FieldKind::String => "string",
            FieldKind::Integer => "integer",
            FieldKind::Number => "number",
            FieldKind::Boolean => "boolean",
            FieldKind::Strings => "strings",
        }
    }

    /// The JSON Schema of a value of this kind.
    fn schema(self) -> Value {
        match self {
            FieldKind::String => json!({ "type": "string" }),
            FieldKind::Integer => json!({ "type": "integer" }),
            FieldKind::Number => json!({ "type": "number" }),
            FieldKind::Boolean => json!({ "type": "boolean" }),
            FieldKind::Strings => json!({ "type": "array", "items": { "type": "string" } }),
        }
    }

    /// Whether `v` is of this kind.
    fn admits(self, v: &Value) -> bool {
        match self {
            FieldKind::String => v.is_string(),
            FieldKind::Integer => v.is_i64() || v.is_u64(),
            FieldKind::Number => v.is_number(),
            FieldKind::Boolean => v.is_boolean(),
            FieldKind::Strings => v.as_array().is_some_and(|a| a.iter().all(Value::is_string)),
        }
    }
}

/// One field of a defined type.
#[derive(Debug, Clone, PartialEq)]
pub struct FieldDef {
    /// The field's name in the task JSON.
    pub name: String,
    /// What it holds.
    pub kind: FieldKind,
    /// Whether a task must give it.
    pub required: bool,
    /// Shown in the schema.
    pub description: Option<String>,
}

/// A piece of a template: literal text or a field.
#[derive(Debug, Clone, PartialEq)]
enum Piece {
    Text(String),
    Field(String),
}

/// A word or a value with `{field}` placeholders, parsed once.
#[derive(Debug, Clone, PartialEq)]
struct Template(Vec<Piece>);

impl Template {
    fn parse(s: &str) -> Result<Template, String> {
        let mut pieces = Vec::new();
        let mut text = String::new();
        let mut chars = s.chars().peekable();
        while let Some(c) = chars.next() {
            match c {
                '{' if chars.peek() == Some(&'{') => {
                    chars.next();
                    text.push('{');
                }
                '}' if chars.peek() == Some(&'}') => {
                    chars.next();
                    text.push('}');
                }
                '{' => {
                    let mut name = String::new();
                    loop {
                        match chars.next() {
                            Some('}') => break,
                            Some(c) => name.push(c),
                            None => return Err(format!("`{s}`: `{{` without `}}`")),
                        }
                    }
                    if !text.is_empty() {
                        pieces.push(Piece::Text(std::mem::take(&mut text)));
                    }
                    pieces.push(Piece::Field(name.trim().to_string()));
                }
                '}' => return Err(format!("`{s}`: `}}` without `{{` (write `}}}}`)")),
                c => text.push(c),
            }
        }
        if !text.is_empty() {
            pieces.push(Piece::Text(text));
        }
        Ok(Template(pieces))
    }

    fn fields(&self) -> impl Iterator<Item = &str> {
        self.0.iter().filter_map(|p| match p {
            Piece::Field(f) => Some(f.as_str()),
            Piece::Text(_) => None,
        })
    }

    /// The one field this template is, if it is nothing else.
    fn whole_field(&self) -> Option<&str> {
        match self.0.as_slice() {
            [Piece::Field(f)] => Some(f),
            _ => None,
        }
    }

    /// The text with the fields' values (an absent one as empty text).
    fn render(&self, values: &serde_json::Map<String, Value>) -> String {
        let mut out = String::new();
        for p in &self.0 {
            match p {
                Piece::Text(t) => out.push_str(t),
                Piece::Field(f) => {
                    if let Some(v) = values.get(f) {
                        out.push_str(&text_of(v));
                    }
                }
            }
        }
        out
    }
}

/// A scalar as a word: strings as they are, numbers and booleans as JSON.
fn text_of(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

/// A task type defined in config (`[types.<name>]`).
#[derive(Debug, Clone, PartialEq)]
pub struct TypeDef {
    /// The type's name.
    pub name: String,
    /// Shown in the schema.
    pub description: Option<String>,
    /// The fields tasks give.
    pub fields: Vec<FieldDef>,
    command: Vec<Template>,
    env: BTreeMap<String, Template>,
}

impl TypeDef {
    /// Read `[types.<name>]`; the error says what is wrong (the caller
    /// names the setting).
    pub fn from_toml(name: &str, value: &toml::Value) -> Result<TypeDef, String> {
        check_type_name(name).map_err(|e| format!("type name `{name}` {e}"))?;
        if ["shell", "command", "http", "container"].contains(&name) {
            return Err(format!("`{name}` is a built-in type"));
        }
        let t = value
            .as_table()
            .ok_or_else(|| format!("types.{name} must be a table"))?;
        let known = ["command", "fields", "env", "description"];
        if let Some(k) = t.keys().find(|k| !known.contains(&k.as_str())) {
            return Err(format!(
                "types.{name}: unknown key `{k}`{}",
                crate::suggest::hint(k, known)
            ));
        }
        let words: Vec<String> = match t.get("command") {
            Some(toml::Value::Array(a)) => a
                .iter()
                .map(|w| w.as_str().map(str::to_string))
                .collect::<Option<_>>()
                .ok_or_else(|| format!("types.{name}.command must be a list of strings"))?,
            Some(toml::Value::String(s)) => {
                shell_words::split(s).map_err(|e| format!("types.{name}.command: {e}"))?
            }
            Some(_) => return Err(format!("types.{name}.command must be a list of strings")),
            None => return Err(format!("types.{name}: `command` is missing")),
        };
        if words.is_empty() || words[0].is_empty() {
            return Err(format!("types.{name}.command: the program is missing"));
        }
        let command = words
            .iter()
            .map(|w| Template::parse(w).map_err(|e| format!("types.{name}.command: {e}")))
            .collect::<Result<Vec<_>, _>>()?;
        let mut fields = Vec::new();
        if let Some(f) = t.get("fields") {
            let f = f
                .as_table()
                .ok_or_else(|| format!("types.{name}.fields must be a table"))?;
            for (fname, spec) in f {
                fields.push(field_def(name, fname, spec)?);
            }
        }
        let mut env = BTreeMap::new();
        if let Some(e) = t.get("env") {
            let e = e
                .as_table()
                .ok_or_else(|| format!("types.{name}.env must be a table"))?;
            for (k, v) in e {
                let v = v
                    .as_str()
                    .ok_or_else(|| format!("types.{name}.env.{k} must be a string"))?;
                crate::protocol::check_env_pair(k, v, "env")
                    .map_err(|e| format!("types.{name}.{e}"))?;
                let tpl = Template::parse(v).map_err(|e| format!("types.{name}.env.{k}: {e}"))?;
                env.insert(k.clone(), tpl);
            }
        }
        let description = match t.get("description") {
            Some(d) => Some(
                d.as_str()
                    .ok_or_else(|| format!("types.{name}.description must be a string"))?
                    .to_string(),
            ),
            None => None,
        };
        let def = TypeDef {
            name: name.to_string(),
            description,
            fields,
            command,
            env,
        };
        def.check_references()?;
        Ok(def)
    }

    /// Every placeholder names a field, every field is used, a list is a
    /// whole word of the command.
    fn check_references(&self) -> Result<(), String> {
        let name = &self.name;
        let kind_of = |f: &str| self.fields.iter().find(|d| d.name == f).map(|d| d.kind);
        let mut used = Vec::new();
        for (i, w) in self.command.iter().enumerate() {
            for f in w.fields() {
                match kind_of(f) {
                    None => {
                        return Err(format!(
                            "types.{name}.command: `{{{f}}}` is not one of the type's fields{}",
                            crate::suggest::hint(f, self.fields.iter().map(|d| d.name.as_str()))
                        ))
                    }
                    Some(FieldKind::Strings) if w.whole_field().is_none() || i == 0 => {
                        return Err(format!(
                            "types.{name}.command: the list `{{{f}}}` must be a whole argument"
                        ))
                    }
                    Some(_) => used.push(f.to_string()),
                }
            }
        }
        for (k, v) in &self.env {
            for f in v.fields() {
                match kind_of(f) {
                    None => {
                        return Err(format!(
                            "types.{name}.env.{k}: `{{{f}}}` is not one of the type's fields"
                        ))
                    }
                    Some(FieldKind::Strings) => {
                        return Err(format!(
                            "types.{name}.env.{k}: the list `{{{f}}}` can only fill arguments"
                        ))
                    }
                    Some(_) => used.push(f.to_string()),
                }
            }
        }
        if let Some(unused) = self.fields.iter().find(|d| !used.contains(&d.name)) {
            return Err(format!(
                "types.{name}.fields.{}: not used in `command` or `env`",
                unused.name
            ));
        }
        Ok(())
    }

    /// The JSON Schema of the type's fields.
    fn schema(&self) -> Value {
        let mut props = serde_json::Map::new();
        for f in &self.fields {
            let mut s = f.kind.schema();
            let d = f.description.clone().unwrap_or_else(|| {
                format!(
                    "{}: {}{}",
                    self.name,
                    f.kind.as_str(),
                    if f.required { "" } else { " (optional)" }
                )
            });
            s["description"] = Value::String(d);
            props.insert(f.name.clone(), s);
        }
        let required: Vec<&str> = self
            .fields
            .iter()
            .filter(|f| f.required)
            .map(|f| f.name.as_str())
            .collect();
        let mut s = json!({ "title": self.name, "type": "object", "properties": props, "required": required });
        if let Some(d) = &self.description {
            s["description"] = Value::String(d.clone());
        }
        s
    }

    /// Check a task's fields and build the process to run.
    fn spec(&self, fields: &Fields) -> Result<ProcessSpec, Invalid> {
        for f in &self.fields {
            match fields.get(&f.name) {
                None | Some(Value::Null) if f.required => {
                    return Err(Invalid::new(
                        &f.name,
                        format!("missing ({} for type {})", f.kind.a(), self.name),
                    ))
                }
                None | Some(Value::Null) => {}
                Some(v) if !f.kind.admits(v) => {
                    return Err(Invalid::new(
                        &f.name,
                        format!("must be {}, not {}", f.kind.a(), json_kind(v)),
                    ))
                }
                Some(v) => {
                    let nul = match v {
                        Value::String(s) => s.contains('\0'),
                        Value::Array(a) => a
                            .iter()
                            .any(|s| s.as_str().is_some_and(|s| s.contains('\0'))),
                        _ => false,
                    };
                    if nul {
                        return Err(Invalid::new(&f.name, "contains a NUL byte"));
                    }
                }
            }
        }
        let values: serde_json::Map<String, Value> = fields
            .0
            .iter()
            .filter(|(_, v)| !v.is_null())
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        let mut words = Vec::new();
        for w in &self.command {
            match w.whole_field() {
                Some(f) => match values.get(f) {
                    Some(Value::Array(items)) => {
                        words.extend(items.iter().map(text_of));
                    }
                    Some(v) => words.push(text_of(v)),
                    None => {}
                },
                None => words.push(w.render(&values)),
            }
        }
        let mut env = BTreeMap::new();
        for (k, t) in &self.env {
            let absent = t.fields().any(|f| !values.contains_key(f));
            if !(absent && t.whole_field().is_some()) {
                env.insert(k.clone(), t.render(&values));
            }
        }
        let program = words.remove(0);
        if program.is_empty() {
            return Err(Invalid::new(
                "(message)",
                format!("type {}: the program is empty", self.name),
            ));
        }
        Ok(ProcessSpec::Program {
            program,
            args: words,
            env,
        })
    }
}

fn field_def(ty: &str, name: &str, spec: &toml::Value) -> Result<FieldDef, String> {
    let at = format!("types.{ty}.fields.{name}");
    if ENVELOPE_FIELDS.contains(&name) {
        return Err(format!("{at}: `{name}` is a field of every task"));
    }
    if name.is_empty()
        || !name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
    {
        return Err(format!("{at}: a field name is letters, digits, _ and -"));
    }
    let (kind, required, description) = match spec {
        toml::Value::String(s) => {
            let (k, opt) = match s.strip_suffix('?') {
                Some(k) => (k, true),
                None => (s.as_str(), false),
            };
            (k.to_string(), !opt, None)
        }
        toml::Value::Table(t) => {
            let k = t
                .get("kind")
                .and_then(|k| k.as_str())
                .ok_or_else(|| format!("{at}: `kind` is missing"))?;
            let required = match t.get("required") {
                None => true,
                Some(toml::Value::Boolean(b)) => *b,
                Some(_) => return Err(format!("{at}.required must be true or false")),
            };
            let d = t
                .get("description")
                .and_then(|d| d.as_str())
                .map(str::to_string);
            (k.to_string(), required, d)
        }
        _ => return Err(format!("{at} must be a kind such as \"string\" or a table")),
    };
    let kind = FieldKind::parse(&kind).ok_or_else(|| {
        format!("{at}: unknown kind `{kind}` (string, integer, number, boolean, strings; `?` for optional)")
    })?;
    Ok(FieldDef {
        name: name.to_string(),
        kind,
        required,
        description,
    })
}

/// Runs the tasks of one type defined in config.
pub(crate) struct DefinedRunner {
    def: TypeDef,
    process: Option<Arc<ProcessRunner>>,
}

impl DefinedRunner {
    /// Tasks of type `def` run by `process`.
    pub(crate) fn new(def: TypeDef, process: Arc<ProcessRunner>) -> Self {
        DefinedRunner {
            def,
            process: Some(process),
        }
    }

    /// Validation only (the CLI): running fails.
    pub(crate) fn validator(def: TypeDef) -> Self {
        DefinedRunner { def, process: None }
    }
}

impl Runner for DefinedRunner {
    type Spec = ProcessSpec;

    fn name(&self) -> &str {
        &self.def.name
    }

    fn fields_schema(&self) -> Value {
        self.def.schema()
    }

    fn validate(&self, fields: &Fields, _task: &Task) -> Result<ProcessSpec, Invalid> {
        self.def.spec(fields)
    }

    async fn run(&self, spec: &ProcessSpec, ctx: RunContext) -> Outcome {
        super::command::run_on(self.process.as_deref(), spec, ctx).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn def(toml_text: &str) -> Result<TypeDef, String> {
        let v: toml::Table = toml::from_str(toml_text).unwrap();
        let (name, body) = v.iter().next().unwrap();
        TypeDef::from_toml(name, body)
    }

    fn fields(json: &str) -> Fields {
        Fields(serde_json::from_str(json).unwrap())
    }

    #[test]
    fn a_python_type() {
        let d = def(r#"python = { command = ["python3", "-c", "{script}", "{args}"], fields = { script = "string", args = "strings?", level = "integer?" }, env = { LEVEL = "{level}" } }"#).unwrap();
        let s = d
            .spec(&fields(
                r#"{"script":"print(1)","args":["a","b c"],"level":3}"#,
            ))
            .unwrap();
        assert_eq!(
            s,
            ProcessSpec::Program {
                program: "python3".into(),
                args: vec!["-c".into(), "print(1)".into(), "a".into(), "b c".into()],
                env: [("LEVEL".to_string(), "3".to_string())].into(),
            }
        );
        // Absent optional fields: the list word and the variable go.
        let s = d.spec(&fields(r#"{"script":"x"}"#)).unwrap();
        let ProcessSpec::Program { args, env, .. } = s else {
            panic!()
        };
        assert_eq!(args, vec!["-c", "x"]);
        assert!(env.is_empty());
        let e = d.spec(&fields(r#"{}"#)).unwrap_err();
        assert_eq!(e.field, "script");
        let e = d.spec(&fields(r#"{"script":5}"#)).unwrap_err();
        assert_eq!(
            (e.field.as_str(), e.problem.as_str()),
            ("script", "must be a string, not a number")
        );
    }

    #[test]
    fn bad_definitions_say_what_is_wrong() {
        for (t, want) in [
            (r#"shell = { command = ["x"] }"#, "built-in"),
            (
                r#"py = { command = ["x", "{scrpt}"], fields = { script = "string" } }"#,
                "not one of the type's fields",
            ),
            (
                r#"py = { command = ["x"], fields = { script = "string" } }"#,
                "not used",
            ),
            (
                r#"py = { command = ["x", "-{a}"], fields = { a = "strings" } }"#,
                "whole argument",
            ),
            (
                r#"py = { command = ["x", "{a}"], fields = { a = "text" } }"#,
                "unknown kind",
            ),
            (r#"py = { cmd = ["x"] }"#, "unknown key `cmd`"),
            (
                r#"py = { command = ["x", "{a}"], fields = { a = "string" }, env = { ATTEMPT = "{a}" } }"#,
                "reserved",
            ),
            (
                r#"py = { command = ["x", "{a}"], fields = { timeout = "string" } }"#,
                "field of every task",
            ),
        ] {
            let e = def(t).unwrap_err();
            assert!(e.contains(want), "{t}: {e}");
        }
    }

    #[test]
    fn braces_escape() {
        let t = Template::parse("{{literal}} {x}").unwrap();
        let v: serde_json::Map<String, Value> = serde_json::from_str(r#"{"x":true}"#).unwrap();
        assert_eq!(t.render(&v), "{literal} true");
    }
}
