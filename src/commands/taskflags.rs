//! The task flags shared by `submit` and `schedule add`: everything that
//! turns a command line (or a JSON file / stdin, with flags on top) into a
//! [`TaskMessage`], and the local validation that makes a typo fail before
//! anything is published (exit 2, naming the field).
//!
//! Flags map one to one onto DESIGN.md section 3; the words after `--` are
//! the shell script (`shell`), the program and its arguments (`command`) or
//! the container's CMD (`container`).

use std::collections::BTreeMap;
use std::io::{IsTerminal, Read as _};
use std::path::PathBuf;

use anyhow::{anyhow, bail, Context as _};
use chrono::Utc;
use clap::Args;

use serde_json::Value;

use crate::protocol::{
    parse_task, valid_id, valid_label, Envelope, LimitsMessage, RetryMessage, SizeValue, Task,
    TaskMessage, ValidationLimits,
};
use crate::runner::defined::TypeDef;

/// How to describe a task on the command line.
#[derive(Debug, Clone, Default, Args)]
pub struct TaskArgs {
    /// Task type: shell, command, http, container or a type the label's
    /// workers define [default: container with --image, http with --url,
    /// else shell].
    #[arg(long = "type", short = 't', value_name = "TYPE")]
    pub task_type: Option<String>,
    /// Queue label; the task goes to tasks.<label>.
    #[arg(long, short = 'l', default_value = "default")]
    pub label: String,
    /// Task id [A-Za-z0-9_-]{1,128} (default for submit: random).
    #[arg(long)]
    pub id: Option<String>,
    /// Seed short form: shell script, http URL, or container docker-run options.
    #[arg(long)]
    pub payload: Option<String>,
    /// Read the task JSON from FILE (`-`: stdin); flags given here override its fields.
    #[arg(long, short = 'f', value_name = "FILE")]
    pub file: Option<PathBuf>,
    /// IDEMPOTENCY_KEY for the task (default: its id).
    #[arg(long, value_name = "KEY")]
    pub idempotency_key: Option<String>,
    /// Whole-attempt timeout (90s, 5m).
    #[arg(long, value_name = "DURATION")]
    pub timeout: Option<String>,
    /// Retries after the first attempt (max_attempts = N + 1).
    #[arg(long, value_name = "N")]
    pub retries: Option<u32>,
    /// Delay before the first retry (1s); doubles per retry.
    #[arg(long, value_name = "DURATION")]
    pub backoff: Option<String>,
    /// Do not start the task after this: an RFC3339 time, or a duration
    /// from when it is queued (for a schedule: from each firing).
    #[arg(long, value_name = "WHEN")]
    pub expires: Option<String>,
    /// Environment variable for the task (repeatable).
    #[arg(long = "env", short = 'e', value_name = "K=V")]
    pub env: Vec<String>,
    /// Resource limit (repeatable): memory=256MiB, cpu=1.5, cpu_seconds=60,
    /// pids=256, nofile=1024, output=1MiB.
    #[arg(long = "limit", value_name = "NAME=VALUE")]
    pub limits: Vec<String>,
    /// http: the URL.
    #[arg(long, help_heading = "HTTP tasks")]
    pub url: Option<String>,
    /// http: the method (GET).
    #[arg(long, help_heading = "HTTP tasks")]
    pub method: Option<String>,
    /// http: a request header "Name: value" (repeatable).
    #[arg(
        long = "header",
        short = 'H',
        value_name = "NAME: VALUE",
        help_heading = "HTTP tasks"
    )]
    pub headers: Vec<String>,
    /// http: the request body.
    #[arg(long, help_heading = "HTTP tasks")]
    pub body: Option<String>,
    /// http: statuses counted as success (200-299, or one status).
    #[arg(long, value_name = "RANGE", help_heading = "HTTP tasks")]
    pub success: Option<String>,
    /// container: the image.
    #[arg(long, help_heading = "Container tasks")]
    pub image: Option<String>,
    /// container: ENTRYPOINT override, one word per flag (repeatable).
    #[arg(long, value_name = "WORD", help_heading = "Container tasks")]
    pub entrypoint: Vec<String>,
    /// container: working directory.
    #[arg(long, help_heading = "Container tasks")]
    pub workdir: Option<String>,
    /// container: user (uid[:gid] or name).
    #[arg(long, value_name = "USER", help_heading = "Container tasks")]
    pub container_user: Option<String>,
    /// container: none, bridge or a network the worker allows.
    #[arg(long, help_heading = "Container tasks")]
    pub network: Option<String>,
    /// container: never, if-missing or always.
    #[arg(long, value_name = "POLICY", help_heading = "Container tasks")]
    pub pull: Option<String>,
    /// A field of the task's type (repeatable), for types defined on the
    /// workers: NAME=VALUE, the value as JSON when it parses (5, true,
    /// ["a","b"]), else as text.
    #[arg(long = "field", short = 'F', value_name = "NAME=VALUE")]
    pub fields: Vec<String>,
    /// After `--`: shell → the script; command → program and arguments;
    /// container → the image's CMD.
    #[arg(last = true, value_name = "WORDS")]
    pub words: Vec<String>,
}

impl TaskArgs {
    /// Whether any flag describes the body of the task (so stdin is not
    /// read for it).
    fn has_body(&self) -> bool {
        self.file.is_some()
            || self.payload.is_some()
            || !self.words.is_empty()
            || self.url.is_some()
            || self.image.is_some()
            || self.task_type.is_some()
            || !self.fields.is_empty()
    }

    /// The label, checked.
    pub fn label(&self) -> anyhow::Result<&str> {
        if !valid_label(&self.label) {
            bail!("--label: `{}` is not [A-Za-z0-9_-]{{1,64}}", self.label);
        }
        Ok(&self.label)
    }

    /// Build the task message: the file (or stdin) first, then every flag
    /// on top of it.
    pub fn build(&self) -> anyhow::Result<TaskMessage> {
        let mut m: TaskMessage = self.base()?.unwrap_or_default();
        self.apply(&mut m)?;
        Ok(m)
    }

    /// The task JSON from `--file` (or stdin when it is piped and nothing
    /// else describes the task).
    fn base(&self) -> anyhow::Result<Option<TaskMessage>> {
        let (text, from) = match &self.file {
            Some(p) if p.as_os_str() == "-" => (read_stdin()?, "stdin".to_string()),
            Some(p) => (
                std::fs::read_to_string(p)
                    .with_context(|| format!("--file: cannot read {}", p.display()))?,
                p.display().to_string(),
            ),
            None if !self.has_body() && !std::io::stdin().is_terminal() => {
                let t = read_stdin()?;
                if t.trim().is_empty() {
                    return Ok(None);
                }
                (t, "stdin".to_string())
            }
            None => return Ok(None),
        };
        parse_message(&text)
            .map(Some)
            .map_err(|e| anyhow!("{from}: {e}"))
    }

    fn apply(&self, m: &mut TaskMessage) -> anyhow::Result<()> {
        if let Some(t) = &self.task_type {
            m.task_type = Some(t.clone());
        }
        if m.task_type.is_none() {
            m.task_type = Some(
                if self.image.is_some() {
                    "container"
                } else if self.url.is_some() {
                    "http"
                } else {
                    "shell"
                }
                .to_string(),
            );
        }
        if let Some(id) = &self.id {
            if !valid_id(id) {
                bail!("--id: `{id}` is not [A-Za-z0-9_-]{{1,128}}");
            }
            m.id = Some(id.clone());
        }
        if let Some(p) = &self.payload {
            if !self.words.is_empty() {
                bail!("give the task either as --payload or as words after --, not both");
            }
            m.set_field("payload", p.clone());
        }
        if let Some(k) = &self.idempotency_key {
            m.idempotency_key = Some(k.clone());
        }
        if let Some(t) = &self.timeout {
            m.timeout = Some(t.clone());
            m.timeout_seconds = None;
        }
        if let Some(e) = &self.expires {
            m.expires = Some(e.clone());
        }
        if self.retries.is_some() || self.backoff.is_some() {
            let r = m.retry.get_or_insert_with(RetryMessage::default);
            if let Some(n) = self.retries {
                r.max_attempts = Some(
                    n.checked_add(1)
                        .ok_or_else(|| anyhow!("--retries: too large"))?,
                );
            }
            if let Some(b) = &self.backoff {
                r.backoff = Some(b.clone());
            }
        }
        for kv in &self.env {
            let (k, v) = kv
                .split_once('=')
                .ok_or_else(|| anyhow!("--env: `{kv}` is not K=V"))?;
            m.env
                .get_or_insert_with(BTreeMap::new)
                .insert(k.to_string(), v.to_string());
        }
        for l in &self.limits {
            apply_limit(m.limits.get_or_insert_with(LimitsMessage::default), l)?;
        }
        // http
        if let Some(u) = &self.url {
            m.set_field("url", u.clone());
        }
        if let Some(x) = &self.method {
            m.set_field("method", x.clone());
        }
        if !self.headers.is_empty() {
            let mut headers = match m.remove_field("headers") {
                Some(Value::Object(h)) => h,
                _ => serde_json::Map::new(),
            };
            for h in &self.headers {
                let (k, v) = h
                    .split_once(':')
                    .ok_or_else(|| anyhow!("--header: `{h}` is not \"Name: value\""))?;
                headers.insert(k.trim().to_string(), Value::from(v.trim()));
            }
            m.set_field("headers", Value::Object(headers));
        }
        if let Some(b) = &self.body {
            m.set_field("body", b.clone());
        }
        if let Some(s) = &self.success {
            m.set_field(
                "success",
                match s.parse::<u16>() {
                    Ok(n) => Value::from(n),
                    Err(_) => Value::from(s.clone()),
                },
            );
        }
        // container
        if let Some(i) = &self.image {
            m.set_field("image", i.clone());
        }
        if !self.entrypoint.is_empty() {
            m.set_field("entrypoint", self.entrypoint.clone());
        }
        if let Some(w) = &self.workdir {
            m.set_field("workdir", w.clone());
        }
        if let Some(u) = &self.container_user {
            m.set_field("user", u.clone());
        }
        if let Some(n) = &self.network {
            m.set_field("network", n.clone());
        }
        if let Some(p) = &self.pull {
            if !["never", "if-missing", "always"].contains(&p.as_str()) {
                bail!("--pull: `{p}` is not never, if-missing or always");
            }
            m.set_field("pull", p.clone());
        }
        // Any type's fields.
        for f in &self.fields {
            let (k, v) = f
                .split_once('=')
                .ok_or_else(|| anyhow!("--field: `{f}` is not NAME=VALUE"))?;
            let value = serde_json::from_str::<Value>(v).unwrap_or_else(|_| Value::from(v));
            m.set_field(k.trim(), value);
        }
        // The words after `--`.
        if !self.words.is_empty() {
            apply_words(m, &self.words)?;
        }
        Ok(())
    }
}

/// The words after `--` as the task's body: the script (`shell`), the
/// program and its arguments (`command`) or the image's CMD (`container`).
pub fn apply_words(m: &mut TaskMessage, words: &[String]) -> anyhow::Result<()> {
    let Some((first, rest)) = words.split_first() else {
        bail!("no words for the task");
    };
    match m.task_type.as_deref().unwrap_or("shell") {
        "shell" => {
            m.set_field("script", words.join(" "));
            m.remove_field("payload");
        }
        "command" => {
            m.set_field("command", first.clone());
            m.set_field("args", rest.to_vec());
        }
        "container" => m.set_field("args", words.to_vec()),
        "http" => {
            bail!("http tasks take --url (or --payload), not words after --")
        }
        other => bail!("words after -- are for shell, command and container tasks; give type {other}'s fields with --field NAME=VALUE"),
    }
    Ok(())
}

fn read_stdin() -> anyhow::Result<String> {
    let mut s = String::new();
    std::io::stdin()
        .read_to_string(&mut s)
        .context("cannot read the task from stdin")?;
    Ok(s)
}

/// Parse task JSON into the wire form; the error names the field.
pub fn parse_message(text: &str) -> anyhow::Result<TaskMessage> {
    crate::protocol::parse_message(text.as_bytes()).map_err(|e| anyhow!("{e}"))
}

/// `--limit NAME=VALUE` onto the limits object.
fn apply_limit(l: &mut LimitsMessage, spec: &str) -> anyhow::Result<()> {
    let (k, v) = spec
        .split_once('=')
        .ok_or_else(|| anyhow!("--limit: `{spec}` is not NAME=VALUE"))?;
    let num = |what: &str| -> anyhow::Result<u64> {
        v.parse()
            .map_err(|_| anyhow!("--limit {k}: `{v}` is not a whole number of {what}"))
    };
    match k.trim().replace('-', "_").as_str() {
        "memory" => l.memory = Some(SizeValue::Text(v.to_string())),
        "output" => l.output = Some(SizeValue::Text(v.to_string())),
        "cpu" => {
            l.cpu = Some(
                v.parse()
                    .map_err(|_| anyhow!("--limit cpu: `{v}` is not a number of cores"))?,
            )
        }
        "cpu_seconds" => l.cpu_seconds = Some(num("seconds")?),
        "pids" => l.pids = Some(num("processes")?),
        "nofile" => l.nofile = Some(num("files")?),
        o => bail!("--limit: unknown limit `{o}` (memory, cpu, cpu_seconds, pids, nofile, output)"),
    }
    Ok(())
}

/// Remove `null` members of objects, recursively.
fn strip_nulls(v: &mut serde_json::Value) {
    if let serde_json::Value::Object(m) = v {
        m.retain(|_, x| !x.is_null());
        m.values_mut().for_each(strip_nulls);
    }
}

/// Where a task will come from, for local validation.
pub enum Origin<'a> {
    /// Published directly, under this id (the `Nats-Msg-Id`).
    Direct { msg_id: &'a str },
    /// Fired by the schedule on this subject.
    Schedule { subject: &'a str },
}

/// Validate a task exactly as a worker will, before publishing it, with
/// the built-in types and `defined` (the config file's): a task of another
/// type has its envelope checked only. Networks are the worker's business,
/// so the task's own network is allowed here.
pub fn validate_locally(
    label: &str,
    m: &TaskMessage,
    origin: Origin<'_>,
    defined: &[TypeDef],
) -> anyhow::Result<(Vec<u8>, Task)> {
    // Nested objects serialise their unset fields as null; leave them out
    // so that the wire form is what a person would have typed.
    let mut value = serde_json::to_value(m).context("cannot encode the task")?;
    strip_nulls(&mut value);
    let bytes = serde_json::to_vec(&value).context("cannot encode the task")?;
    let (msg_id, scheduler, published) = match origin {
        Origin::Direct { msg_id } => (Some(msg_id), None, None),
        Origin::Schedule { subject } => (None, Some(subject), Some(Utc::now())),
    };
    let env = Envelope {
        label,
        msg_id,
        stream_sequence: 0,
        scheduler,
        published,
    };
    let networks = m
        .field("network")
        .and_then(Value::as_str)
        .map(str::to_string);
    let limits = ValidationLimits {
        types: crate::runner::Registry::validators(networks.into_iter().collect(), defined),
        ..Default::default()
    };
    let task = parse_task(&bytes, &env, &limits).map_err(|e| anyhow!("invalid task: {e}"))?;
    Ok((bytes, task))
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct T {
        #[command(flatten)]
        a: TaskArgs,
    }

    fn args(v: &[&str]) -> TaskArgs {
        let mut all = vec!["x", "--type", "shell"];
        if v.contains(&"--type") {
            all.truncate(1);
        }
        all.extend_from_slice(v);
        T::parse_from(all).a
    }

    #[test]
    fn shell_words_are_the_script() {
        let m = args(&["--retries", "2", "-e", "A=1", "--", "echo", "hi"])
            .build()
            .unwrap();
        assert_eq!(m.field("script"), Some(&Value::from("echo hi")));
        assert_eq!(m.retry.unwrap().max_attempts, Some(3));
        assert_eq!(m.env.unwrap()["A"], "1");
    }

    #[test]
    fn command_words_are_program_and_args() {
        let m = args(&["--type", "command", "--", "/bin/echo", "a", "b"])
            .build()
            .unwrap();
        assert_eq!(m.field("command"), Some(&Value::from("/bin/echo")));
        assert_eq!(m.field("args"), Some(&serde_json::json!(["a", "b"])));
    }

    #[test]
    fn limits_and_validation() {
        let m = args(&[
            "--limit",
            "memory=64MiB",
            "--limit",
            "pids=10",
            "--retries",
            "1",
            "--",
            "true",
        ])
        .build()
        .unwrap();
        let (bytes, _) =
            validate_locally("default", &m, Origin::Direct { msg_id: "x" }, &[]).unwrap();
        assert_eq!(
            String::from_utf8(bytes).unwrap(),
            r#"{"limits":{"memory":"64MiB","pids":10},"retry":{"max_attempts":2},"script":"true","type":"shell"}"#
        );
        assert!(args(&["--limit", "disk=1"]).build().is_err());
        let m = args(&["--timeout", "soon", "--", "true"]).build().unwrap();
        let e = validate_locally("default", &m, Origin::Direct { msg_id: "x" }, &[]).unwrap_err();
        assert!(e.to_string().contains("timeout"), "{e}");
    }

    #[test]
    fn unknown_field_in_file_is_named() {
        let m = parse_message(r#"{"type":"shell","script":"x","timout":"5s"}"#).unwrap();
        let e = validate_locally("default", &m, Origin::Direct { msg_id: "x" }, &[]).unwrap_err();
        assert!(e.to_string().contains("did you mean `timeout`"), "{e}");
    }

    #[test]
    fn fields_of_other_types() {
        let m = args(&["--type", "python", "-F", "script=print(1)", "-F", "n=5"])
            .build()
            .unwrap();
        assert_eq!(m.field("n"), Some(&Value::from(5)));
        // Not a type known here: the envelope is checked, the rest is the
        // workers' business.
        let (_, t) = validate_locally("default", &m, Origin::Direct { msg_id: "x" }, &[]).unwrap();
        assert!(!t.runnable());
    }
}
