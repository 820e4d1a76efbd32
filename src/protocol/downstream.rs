//! Downstream tasks in the task message (DESIGN.md sections 3 and 5,
//! "Downstream tasks"): `then` (children queued when a task ends with one
//! of the statuses in their `on`) and `then_all` (a join queued once after
//! every shard of a fan-out is final), their validation together with the
//! whole tree, and the ids of derived tasks.
//!
//! A child is validated by the same function as a top-level task
//! ([`super::validate`]), with its id, label, idempotency key and parent
//! filled in exactly as the worker will publish it, so a message whose
//! tree holds one invalid task is rejected before anything runs, naming
//! the path (`then[1].timeout`).

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

use schemars::JsonSchema;
use serde::{de, Deserialize, Deserializer, Serialize};

use super::{
    truncate_for_error, valid_id, valid_label, validate_node, Envelope, Invalid, Status, Task,
    TaskMessage, ValidationLimits,
};

/// Levels of downstream tasks below the task that was published.
pub const MAX_DOWNSTREAM_DEPTH: usize = 8;
/// Tasks in one message's tree, itself included.
pub const MAX_TREE_TASKS: usize = 100;
/// Shards a join may wait for (its KV value lists each one's status).
pub const MAX_JOIN_SHARDS: u32 = 10_000;

/// When a join runs.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum JoinPolicy {
    /// Only if every shard succeeded; otherwise the join's final record is
    /// `cancelled`, saying how many did not.
    #[default]
    AllSuccess,
    /// Whatever the shards' outcome.
    Always,
}

impl JoinPolicy {
    /// The name on the wire (`all_success`).
    pub fn as_str(self) -> &'static str {
        match self {
            JoinPolicy::AllSuccess => "all_success",
            JoinPolicy::Always => "always",
        }
    }
}

impl std::str::FromStr for JoinPolicy {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.replace('-', "_").as_str() {
            "all_success" => Ok(JoinPolicy::AllSuccess),
            "always" => Ok(JoinPolicy::Always),
            _ => Err(format!(
                "`{s}` is not a join policy (all_success or always)"
            )),
        }
    }
}

/// The shards' outcome, handed to the join (field `join_summary`, and
/// `JOIN_SUMMARY` in its environment).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct JoinSummary {
    /// The join's policy.
    pub policy: JoinPolicy,
    /// Shards in the fan-out.
    pub total: u32,
    /// Shards per final status.
    pub counts: BTreeMap<String, u32>,
    /// Numbers of the shards that did not succeed, ascending.
    pub not_success: Vec<u32>,
}

impl JoinSummary {
    /// The summary of a complete fan-out.
    pub fn of(state: &JoinState, policy: JoinPolicy) -> Self {
        let mut counts = BTreeMap::new();
        for s in state.done.values() {
            *counts.entry(s.as_str().to_string()).or_insert(0) += 1;
        }
        JoinSummary {
            policy,
            total: state.of,
            counts,
            not_success: state
                .done
                .iter()
                .filter(|(_, s)| **s != Status::Success)
                .map(|(no, _)| *no)
                .collect(),
        }
    }

    /// Why the join must not run under its policy, if it must not.
    pub fn not_run_reason(&self) -> Option<String> {
        (self.policy == JoinPolicy::AllSuccess && !self.not_success.is_empty()).then(|| {
            format!(
                "not run: {} of {} shards did not succeed (policy all_success)",
                self.not_success.len(),
                self.total
            )
        })
    }
}

/// Value of a join's key in KV `joins`: the final status of each shard
/// recorded so far. Written only with compare-and-set on the key's
/// revision; a shard already present is never written again.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct JoinState {
    /// Shards in the fan-out.
    pub of: u32,
    /// Shard number → its final status.
    pub done: BTreeMap<u32, Status>,
}

impl JoinState {
    /// Whether every shard is final.
    pub fn complete(&self) -> bool {
        self.done.len() as u64 >= u64::from(self.of)
    }
}

/// A validated downstream task: what to publish, where, and when.
#[derive(Debug, Clone, PartialEq)]
pub struct Child {
    /// Its id (given, or derived from the parent's).
    pub id: String,
    /// Where it is published (default: the parent's label).
    pub label: String,
    /// Final statuses of the parent that queue it (empty for a join).
    pub on: Vec<Status>,
    /// The message to publish: id, idempotency key and parent filled in,
    /// `on`, `label` and `policy` left out.
    pub message: TaskMessage,
}

/// A validated `then_all`.
#[derive(Debug, Clone, PartialEq)]
pub struct Join {
    /// The join task.
    pub task: Child,
    /// When it runs.
    pub policy: JoinPolicy,
    /// The shards' common id (`<base>-<no>`): the join's PARENT_ID.
    pub base: String,
}

impl Task {
    /// Whether anything is queued when this task ends.
    pub fn has_downstream(&self) -> bool {
        !self.then.is_empty() || self.join.is_some()
    }

    /// The children a final `status` queues, in order.
    pub fn fired(&self, status: Status) -> impl Iterator<Item = &Child> {
        self.then.iter().filter(move |c| c.on.contains(&status))
    }

    /// Why this task (a join) must not run, if its summary says so.
    pub fn not_run_reason(&self) -> Option<String> {
        self.join_summary.as_ref()?.not_run_reason()
    }
}

/// What one validation of a message's tree has counted so far.
#[derive(Debug, Default)]
pub(super) struct Tree {
    depth: usize,
    tasks: usize,
    ids: BTreeSet<String>,
}

/// The downstream fields of one task message, taken out before the rest
/// is validated.
pub(super) struct Fields {
    then: Option<Vec<TaskMessage>>,
    then_all: Option<Box<TaskMessage>>,
    parent: Option<String>,
    join_summary: Option<JoinSummary>,
}

impl Fields {
    /// Take the downstream fields; `on`, `label` and `policy` belong under
    /// `then`/`then_all`, where [`child`] and [`join`] take them first.
    pub(super) fn take(m: &mut TaskMessage) -> Result<Fields, Invalid> {
        if m.on.is_some() {
            return Err(Invalid::new("on", "only applies to a task under `then`"));
        }
        if m.label.is_some() {
            return Err(Invalid::new(
                "label",
                "only applies to a task under `then` or `then_all` (the subject names a published task's label)",
            ));
        }
        if m.policy.is_some() {
            return Err(Invalid::new(
                "policy",
                "only applies to the task under `then_all`",
            ));
        }
        if let Some(p) = &m.parent {
            if !valid_id(p) {
                return Err(Invalid::new("parent", "is not a task id"));
            }
        }
        Ok(Fields {
            then: m.then.take(),
            then_all: m.then_all.take(),
            parent: m.parent.take(),
            join_summary: m.join_summary.take(),
        })
    }

    /// Validate the tasks below `task` (the rest of it is valid) and store
    /// them in it.
    pub(super) fn validate_into(
        self,
        task: &mut Task,
        limits: &ValidationLimits,
        tree: &mut Tree,
    ) -> Result<(), Invalid> {
        tree.tasks += 1;
        if tree.tasks > MAX_TREE_TASKS {
            return Err(Invalid::new(
                "(message)",
                format!("more than {MAX_TREE_TASKS} tasks in one message (then, then_all)"),
            ));
        }
        if !tree.ids.insert(task.id.clone()) {
            return Err(Invalid::new(
                "id",
                format!("`{}` names two tasks of one tree", task.id),
            ));
        }
        task.parent = self.parent;
        if let Some(s) = self.join_summary {
            if s.total == 0 || s.not_success.iter().any(|n| *n >= s.total) {
                return Err(Invalid::new(
                    "join_summary",
                    "needs total > 0 and shard numbers below it",
                ));
            }
            task.join_summary = Some(s);
        }
        let then = self.then.unwrap_or_default();
        if (!then.is_empty() || self.then_all.is_some()) && tree.depth >= MAX_DOWNSTREAM_DEPTH {
            return Err(Invalid::new(
                "(message)",
                format!("more than {MAX_DOWNSTREAM_DEPTH} levels of downstream tasks"),
            ));
        }
        for (i, c) in then.into_iter().enumerate() {
            let derived = format!("{}-then-{}", task.id, i + 1);
            let c = child(task, c, derived, limits, tree)
                .map_err(|e| e.under(&format!("then[{i}]")))?;
            task.then.push(c);
        }
        if let Some(j) = self.then_all {
            task.join = Some(join(task, *j, limits, tree).map_err(|e| e.under("then_all"))?);
        }
        Ok(())
    }
}

/// A `then` entry, as its parent's worker will publish it.
fn child(
    parent: &Task,
    mut m: TaskMessage,
    derived: String,
    limits: &ValidationLimits,
    tree: &mut Tree,
) -> Result<Child, Invalid> {
    let on = match m.on.take() {
        None => vec![Status::Success],
        Some(v) if v.is_empty() => {
            return Err(Invalid::new("on", "is empty: name at least one status"))
        }
        Some(v) => {
            if let Some(s) = v
                .iter()
                .find(|s| matches!(s, Status::Running | Status::Queued | Status::Rejected))
            {
                return Err(Invalid::new(
                    "on",
                    format!("`{s}` does not end a task that ran (success, failed, timeout, cancelled, dead)"),
                ));
            }
            v
        }
    };
    if m.policy.is_some() {
        return Err(Invalid::new(
            "policy",
            "only applies to the task under `then_all`",
        ));
    }
    let label = take_label(&mut m, parent)?;
    let id = named_id(&mut m, derived)?;
    if m.idempotency_key.is_none() {
        m.idempotency_key = Some(parent.idempotency_key.clone());
    }
    m.parent = Some(parent.id.clone());
    validate_below(&m, &label, limits, tree)?;
    Ok(Child {
        id,
        label,
        on,
        message: m,
    })
}

/// A `then_all`, as the worker that completes the fan-out will publish it
/// (without the summary, which it adds).
fn join(
    parent: &Task,
    mut m: TaskMessage,
    limits: &ValidationLimits,
    tree: &mut Tree,
) -> Result<Join, Invalid> {
    let Some(shard) = parent.shard else {
        return Err(Invalid::new(
            "(message)",
            "applies to a shard only (give `shard`, or use submit --shards N --then-all)",
        ));
    };
    if shard.total > MAX_JOIN_SHARDS {
        return Err(Invalid::new(
            "(message)",
            format!("a join waits for at most {MAX_JOIN_SHARDS} shards"),
        ));
    }
    let base = parent
        .id
        .strip_suffix(&format!("-{}", shard.no))
        .filter(|b| !b.is_empty())
        .ok_or_else(|| {
            Invalid::new(
                "(message)",
                format!(
                    "needs the shard's id to be <base>-<no> (`{}` is shard {}), as submit --shards makes them",
                    truncate_for_error(&parent.id),
                    shard.no
                ),
            )
        })?
        .to_string();
    if m.on.is_some() {
        return Err(Invalid::new(
            "on",
            "does not apply to then_all: the join waits for every shard (see `policy`)",
        ));
    }
    let policy = m.policy.take().unwrap_or_default();
    let label = take_label(&mut m, parent)?;
    let id = named_id(&mut m, format!("{base}-join"))?;
    m.parent = Some(base.clone());
    validate_below(&m, &label, limits, tree)?;
    Ok(Join {
        task: Child {
            id,
            label,
            on: Vec::new(),
            message: m,
        },
        policy,
        base,
    })
}

/// The label of a downstream task (default: the parent's), taken out of
/// the message: the subject carries it.
fn take_label(m: &mut TaskMessage, parent: &Task) -> Result<String, Invalid> {
    for (field, set) in [
        ("parent", m.parent.is_some()),
        ("join_summary", m.join_summary.is_some()),
    ] {
        if set {
            return Err(Invalid::new(
                field,
                "is set by the worker that queues the task",
            ));
        }
    }
    match m.label.take() {
        None => Ok(parent.label.clone()),
        Some(l) if valid_label(&l) => Ok(l),
        Some(l) => Err(Invalid::new(
            "label",
            format!("`{}` is not [A-Za-z0-9_-]{{1,64}}", truncate_for_error(&l)),
        )),
    }
}

/// The task's own `id`, else the derived one (which must stay a valid id).
fn named_id(m: &mut TaskMessage, derived: String) -> Result<String, Invalid> {
    if let Some(id) = &m.id {
        return Ok(id.clone());
    }
    if !valid_id(&derived) {
        return Err(Invalid::new(
            "id",
            format!(
                "the derived id `{}` is longer than 128 characters; give this task an `id`",
                truncate_for_error(&derived)
            ),
        ));
    }
    m.id = Some(derived.clone());
    Ok(derived)
}

/// Validate a downstream task exactly as its worker will on receipt.
fn validate_below(
    m: &TaskMessage,
    label: &str,
    limits: &ValidationLimits,
    tree: &mut Tree,
) -> Result<(), Invalid> {
    let env = Envelope {
        label,
        ..Default::default()
    };
    tree.depth += 1;
    let r = validate_node(m.clone(), &env, limits, tree);
    tree.depth -= 1;
    r.map(|_| ())
}

/// `then`: one task object or an array of them (read as an array).
pub(super) fn one_or_many<'de, D: Deserializer<'de>>(
    d: D,
) -> Result<Option<Vec<TaskMessage>>, D::Error> {
    struct V;
    impl<'de> de::Visitor<'de> for V {
        type Value = Vec<TaskMessage>;
        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("a task object or an array of task objects")
        }
        fn visit_map<A: de::MapAccess<'de>>(self, map: A) -> Result<Self::Value, A::Error> {
            TaskMessage::deserialize(de::value::MapAccessDeserializer::new(map)).map(|t| vec![t])
        }
        fn visit_seq<A: de::SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
            let mut v = Vec::new();
            while let Some(t) = seq.next_element()? {
                v.push(t);
            }
            Ok(v)
        }
    }
    d.deserialize_any(V).map(Some)
}

/// The schema of `then` (what [`one_or_many`] reads).
#[derive(JsonSchema)]
#[serde(untagged)]
#[allow(dead_code)]
pub(super) enum OneOrMany {
    One(Box<TaskMessage>),
    Many(Vec<TaskMessage>),
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::{parse_task, Shard};

    fn parse(s: &str) -> Result<Task, Invalid> {
        let env = Envelope {
            label: "default",
            stream_sequence: 7,
            ..Default::default()
        };
        parse_task(s.as_bytes(), &env, &ValidationLimits::default())
    }

    fn chain(depth: usize) -> String {
        let mut s = r#"{"type":"shell","script":"x"}"#.to_string();
        for _ in 0..depth {
            s = format!(r#"{{"type":"shell","script":"x","then":{s}}}"#);
        }
        s
    }

    #[test]
    fn a_chain_gets_derived_ids_parent_key_and_label() {
        let t = parse(
            r#"{"id":"a","type":"shell","script":"x","idempotency_key":"k",
                "then":{"type":"shell","script":"y","then":[{"type":"command","command":"z"}]}}"#,
        )
        .unwrap();
        assert_eq!(t.then.len(), 1);
        let b = &t.then[0];
        assert_eq!((b.id.as_str(), b.label.as_str()), ("a-then-1", "default"));
        assert_eq!(b.on, vec![Status::Success]);
        assert_eq!(b.message.parent.as_deref(), Some("a"));
        assert_eq!(b.message.idempotency_key.as_deref(), Some("k"));
        // What the worker publishes parses to the same child, one level down.
        let bytes = serde_json::to_vec(&b.message).unwrap();
        let env = Envelope {
            label: "default",
            ..Default::default()
        };
        let bt = parse_task(&bytes, &env, &ValidationLimits::default()).unwrap();
        assert_eq!(bt.id, "a-then-1");
        assert_eq!(bt.parent.as_deref(), Some("a"));
        assert_eq!(bt.then[0].id, "a-then-1-then-1");
        assert_eq!(bt.then[0].message.idempotency_key.as_deref(), Some("k"));
    }

    #[test]
    fn on_label_and_given_ids() {
        let t = parse(
            r#"{"id":"a","type":"shell","script":"x","then":[
                {"type":"shell","script":"ok"},
                {"id":"cleanup","label":"gpu","on":["failed","timeout"],"type":"shell","script":"c",
                 "idempotency_key":"own"}]}"#,
        )
        .unwrap();
        assert_eq!(t.then[1].id, "cleanup");
        assert_eq!(t.then[1].label, "gpu");
        assert_eq!(t.then[1].message.idempotency_key.as_deref(), Some("own"));
        assert!(t.then[1].message.label.is_none() && t.then[1].message.on.is_none());
        let fired: Vec<&str> = t.fired(Status::Failed).map(|c| c.id.as_str()).collect();
        assert_eq!(fired, vec!["cleanup"]);
        assert_eq!(t.fired(Status::Success).count(), 1);
        assert_eq!(t.fired(Status::Cancelled).count(), 0);
    }

    #[test]
    fn an_invalid_child_names_its_path() {
        let e = parse(
            r#"{"type":"shell","script":"x","then":[{"type":"shell","script":"y"},
                {"type":"shell","script":"y","timeout":"soon"}]}"#,
        )
        .unwrap_err();
        assert_eq!(e.field, "then[1].timeout", "{e}");
        let e = parse(
            r#"{"type":"shell","script":"x","then":{"type":"shell","script":"y","then":{"type":"shell"}}}"#,
        )
        .unwrap_err();
        assert_eq!(e.field, "then[0].then[0].script", "{e}");
        let e = parse(
            r#"{"type":"shell","script":"x","then":[{"type":"shell","script":"y","timout":"1s"}]}"#,
        )
        .unwrap_err();
        assert!(e.to_string().contains("timout"), "{e}");
        assert!(e.field.starts_with("then[0]"), "{e}");
        let e = parse(r#"{"type":"shell","script":"x","then":[{"type":"shell","script":"y","on":["running"]}]}"#)
            .unwrap_err();
        assert_eq!(e.field, "then[0].on", "{e}");
        let e = parse(
            r#"{"type":"shell","script":"x","then":[{"type":"shell","script":"y","parent":"p"}]}"#,
        )
        .unwrap_err();
        assert_eq!(e.field, "then[0].parent", "{e}");
        let e = parse(r#"{"type":"shell","script":"x","then":[{"type":"shell","script":"y","policy":"always"}]}"#)
            .unwrap_err();
        assert_eq!(e.field, "then[0].policy", "{e}");
        let e = parse(r#"{"type":"shell","script":"x","then":"echo"}"#).unwrap_err();
        assert_eq!(e.field, "then", "{e}");
    }

    #[test]
    fn child_only_fields_are_refused_at_the_top() {
        for f in [
            r#""on":["success"]"#,
            r#""label":"x""#,
            r#""policy":"always""#,
        ] {
            let e = parse(&format!(r#"{{"type":"shell","script":"x",{f}}}"#)).unwrap_err();
            assert!(f.contains(&e.field), "{f}: {e}");
        }
    }

    #[test]
    fn limits_on_depth_size_and_ids() {
        parse(&chain(MAX_DOWNSTREAM_DEPTH)).unwrap();
        let e = parse(&chain(MAX_DOWNSTREAM_DEPTH + 1)).unwrap_err();
        assert!(e.problem.contains("levels"), "{e}");
        let many = vec![r#"{"type":"shell","script":"y"}"#; MAX_TREE_TASKS].join(",");
        let e = parse(&format!(
            r#"{{"type":"shell","script":"x","then":[{many}]}}"#
        ))
        .unwrap_err();
        assert!(e.problem.contains("tasks in one message"), "{e}");
        let long = "a".repeat(122);
        let e = parse(&format!(
            r#"{{"id":"{long}","type":"shell","script":"x","then":{{"type":"shell","script":"y"}}}}"#
        ))
        .unwrap_err();
        assert_eq!(e.field, "then[0].id", "{e}");
        let e = parse(r#"{"id":"a","type":"shell","script":"x","then":{"id":"a","type":"shell","script":"y"}}"#)
            .unwrap_err();
        assert_eq!(e.field, "then[0].id", "{e}");
    }

    #[test]
    fn then_all_on_a_shard() {
        let t = parse(
            r#"{"id":"job-3","type":"shell","script":"x","shard":{"no":3,"total":5},
                "then_all":{"type":"shell","script":"merge","policy":"always"}}"#,
        )
        .unwrap();
        let j = t.join.unwrap();
        assert_eq!((j.task.id.as_str(), j.base.as_str()), ("job-join", "job"));
        assert_eq!(j.policy, JoinPolicy::Always);
        assert_eq!(j.task.message.parent.as_deref(), Some("job"));
        assert!(j.task.message.policy.is_none());
        for bad in [
            r#"{"id":"job-3","type":"shell","script":"x","then_all":{"type":"shell","script":"m"}}"#,
            r#"{"id":"job3","type":"shell","script":"x","shard":{"no":3,"total":5},"then_all":{"type":"shell","script":"m"}}"#,
        ] {
            assert_eq!(parse(bad).unwrap_err().field, "then_all", "{bad}");
        }
        let e = parse(
            r#"{"id":"job-3","type":"shell","script":"x","shard":{"no":3,"total":5},
                "then_all":{"type":"shell","script":"m","on":["failed"]}}"#,
        )
        .unwrap_err();
        assert_eq!(e.field, "then_all.on");
    }

    #[test]
    fn summary_and_policy() {
        let mut st = JoinState {
            of: 3,
            ..Default::default()
        };
        st.done.insert(0, Status::Success);
        st.done.insert(2, Status::Failed);
        assert!(!st.complete());
        st.done.insert(1, Status::Success);
        assert!(st.complete());
        let s = JoinSummary::of(&st, JoinPolicy::AllSuccess);
        assert_eq!(s.not_success, vec![2]);
        assert_eq!(s.counts["success"], 2);
        assert_eq!(
            s.not_run_reason().unwrap(),
            "not run: 1 of 3 shards did not succeed (policy all_success)"
        );
        assert!(JoinSummary::of(&st, JoinPolicy::Always)
            .not_run_reason()
            .is_none());
        // A join message carrying its summary is valid on receipt.
        let t = parse(&format!(
            r#"{{"id":"job-join","type":"shell","script":"m","parent":"job","join_summary":{}}}"#,
            serde_json::to_string(&s).unwrap()
        ))
        .unwrap();
        assert!(t.not_run_reason().is_some());
        assert_eq!(t.shard, None::<Shard>);
        let v = serde_json::to_string(&st).unwrap();
        assert_eq!(serde_json::from_str::<JoinState>(&v).unwrap(), st);
    }
}
