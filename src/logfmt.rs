//! JSON log lines (`--log-format json`) with every field at the top level:
//! the event's own fields and those of every span it happens in, so that
//! a line logged inside a task carries `task_id`, `label`, `attempt` and
//! the worker's `worker_id` as plain keys (`jq 'select(.task_id == "x")'`)
//! instead of nested under `span`/`spans` as tracing-subscriber's own JSON
//! format puts them.
//!
//! A line: `{"timestamp","level", <span fields, outermost first>,
//! <event fields, "message" among them>, "target"}`; an inner span's field
//! replaces an outer one of the same name, and the event's replace both.
//! Span fields are kept as JSON by [`JsonFields`] (which merges fields
//! recorded later, such as `attempt`), and read back here.
//!
//! Lines logged outside the worker's span — by the NATS client's own
//! tasks, which do not inherit it — get the id of the process's worker
//! ([`set_worker_id`]; a process that runs several workers, as the tests
//! do, gets the first one's there).

use std::fmt;
use std::sync::OnceLock;

use serde_json::Value;
use tracing::field::{Field, Visit};
use tracing::{Event, Subscriber};
use tracing_subscriber::fmt::format::{JsonFields, Writer};
use tracing_subscriber::fmt::{FmtContext, FormatEvent, FormattedFields};
use tracing_subscriber::registry::LookupSpan;

/// The event format of JSON logs; pair it with `.fmt_fields(JsonFields::new())`.
pub(crate) struct FlatJson;

/// The worker id for lines logged outside any worker span.
static WORKER_ID: OnceLock<String> = OnceLock::new();

/// Name the worker this process runs (the first call wins).
pub(crate) fn set_worker_id(id: &str) {
    let _ = WORKER_ID.set(id.to_string());
}

/// A JSON object that keeps its keys in insertion order (a later value
/// for a key replaces the earlier one in place).
#[derive(Default)]
struct Line(Vec<(String, Value)>);

impl Line {
    fn insert(&mut self, k: &str, v: Value) {
        match self.0.iter_mut().find(|(x, _)| x == k) {
            Some(slot) => slot.1 = v,
            None => self.0.push((k.to_string(), v)),
        }
    }

    fn has(&self, k: &str) -> bool {
        self.0.iter().any(|(x, _)| x == k)
    }

    fn to_json(&self) -> Result<String, serde_json::Error> {
        let mut out = String::from("{");
        for (i, (k, v)) in self.0.iter().enumerate() {
            if i > 0 {
                out.push(',');
            }
            out.push_str(&serde_json::to_string(k)?);
            out.push(':');
            out.push_str(&serde_json::to_string(v)?);
        }
        out.push('}');
        Ok(out)
    }
}

impl<S> FormatEvent<S, JsonFields> for FlatJson
where
    S: Subscriber + for<'a> LookupSpan<'a>,
{
    fn format_event(
        &self,
        ctx: &FmtContext<'_, S, JsonFields>,
        mut writer: Writer<'_>,
        event: &Event<'_>,
    ) -> fmt::Result {
        let meta = event.metadata();
        let mut line = Line::default();
        line.insert(
            "timestamp",
            chrono::Utc::now()
                .to_rfc3339_opts(chrono::SecondsFormat::Micros, true)
                .into(),
        );
        line.insert("level", meta.level().as_str().into());
        if let Some(scope) = ctx.event_scope() {
            for span in scope.from_root() {
                let ext = span.extensions();
                let Some(f) = ext.get::<FormattedFields<JsonFields>>() else {
                    continue;
                };
                if let Ok(Value::Object(fields)) = serde_json::from_str::<Value>(&f.fields) {
                    for (k, v) in fields {
                        line.insert(&k, v);
                    }
                }
            }
        }
        if !line.has("worker_id") {
            if let Some(id) = WORKER_ID.get() {
                line.insert("worker_id", id.as_str().into());
            }
        }
        event.record(&mut Fields(&mut line));
        line.insert("target", meta.target().into());
        let text = line.to_json().map_err(|_| fmt::Error)?;
        writeln!(writer, "{text}")
    }
}

/// Collects an event's fields as JSON values.
struct Fields<'a>(&'a mut Line);

impl Visit for Fields<'_> {
    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        self.0.insert(field.name(), format!("{value:?}").into());
    }
    fn record_str(&mut self, field: &Field, value: &str) {
        self.0.insert(field.name(), value.into());
    }
    fn record_i64(&mut self, field: &Field, value: i64) {
        self.0.insert(field.name(), value.into());
    }
    fn record_u64(&mut self, field: &Field, value: u64) {
        self.0.insert(field.name(), value.into());
    }
    fn record_f64(&mut self, field: &Field, value: f64) {
        self.0.insert(field.name(), value.into());
    }
    fn record_bool(&mut self, field: &Field, value: bool) {
        self.0.insert(field.name(), value.into());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};
    use tracing_subscriber::fmt::MakeWriter;

    #[derive(Clone, Default)]
    struct Buf(Arc<Mutex<Vec<u8>>>);

    impl std::io::Write for Buf {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    impl<'a> MakeWriter<'a> for Buf {
        type Writer = Buf;
        fn make_writer(&'a self) -> Buf {
            self.clone()
        }
    }

    #[test]
    fn span_fields_are_flat_and_recorded_later_ones_too() {
        let buf = Buf::default();
        let sub = tracing_subscriber::fmt()
            .fmt_fields(JsonFields::new())
            .event_format(FlatJson)
            .with_writer(buf.clone())
            .finish();
        tracing::subscriber::with_default(sub, || {
            let w = tracing::info_span!("worker", worker_id = "w-1");
            let _w = w.enter();
            let t = tracing::info_span!(
                "task",
                task_id = "t-1",
                label = "default",
                r#type = "shell",
                attempt = tracing::field::Empty
            );
            let _t = t.enter();
            tracing::info!(status = "success", "claimed");
            t.record("attempt", 2u32);
            tracing::warn!(n = 3, "attempt finished");
        });
        let text = String::from_utf8(buf.0.lock().unwrap().clone()).unwrap();
        let lines: Vec<Value> = text
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(lines.len(), 2, "{text}");
        for l in &lines {
            assert_eq!(l["worker_id"], "w-1", "{l}");
            assert_eq!(l["task_id"], "t-1", "{l}");
            assert_eq!(l["label"], "default", "{l}");
            assert_eq!(l["type"], "shell", "{l}");
            assert!(l.get("span").is_none() && l.get("spans").is_none(), "{l}");
        }
        assert_eq!(lines[0]["message"], "claimed");
        assert!(lines[0].get("attempt").is_none());
        assert_eq!(lines[1]["attempt"], 2);
        assert_eq!(lines[1]["n"], 3);
        assert_eq!(lines[1]["level"], "WARN");
        assert!(text.starts_with(r#"{"timestamp":"#), "{text}");
    }
}
