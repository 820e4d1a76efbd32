//! The tree of a task and of what it queued (DESIGN.md section 5,
//! "Downstream tasks"), for `results <id> --tree` and for `--wait` on a
//! chain or a fan-out. It is built from the records alone: a record lists
//! its task's children (every planned one while it runs, those its status
//! fired once it is final), a shard's record names its join. A node
//! without a record yet is pending.
//!
//! Text: one row per node, indented under its parent; a fan-out of more
//! than [`SHOWN_SHARDS`] shards is one summary row plus the shards that
//! did not succeed. `--json`: one line per node, every shard included:
//! `{"id","kind","parent","depth","status","final","result"}` (`status`
//! `pending` and `result` null without a record).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::Duration;

use async_nats::jetstream::consumer::DeliverPolicy;
use async_nats::jetstream::stream::{DirectGetErrorKind, Stream};
use futures::StreamExt;
use serde::Serialize;

use super::common::{parse_result, Conn, OrderedReader};
use super::output::{self, Table};
use super::Exit;
use crate::protocol::{Status, TaskResult};

/// Shards shown one by one; a larger fan-out shows the ones that did not
/// succeed under a summary row.
pub const SHOWN_SHARDS: usize = 10;

/// Where a tree starts.
#[derive(Debug, Clone)]
pub enum Roots {
    /// One task (and what it queued).
    One(String),
    /// The shards `<base>-<no>` of a fan-out (and their join).
    Shards { base: String, ids: Vec<String> },
}

/// What a node is to its parent.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Kind {
    Task,
    Shard,
    Child,
    Join,
}

/// One task of the tree.
#[derive(Debug, Clone)]
pub struct Node {
    pub id: String,
    pub kind: Kind,
    pub parent: Option<String>,
    pub depth: usize,
}

/// The last record of each node, with its stream sequence (a newer one
/// replaces an older one, whatever order they are read in).
#[derive(Debug, Default)]
pub struct Records {
    last: HashMap<String, (u64, TaskResult)>,
    asked: HashSet<String>,
}

impl Records {
    pub fn get(&self, id: &str) -> Option<&TaskResult> {
        self.last.get(id).map(|(_, r)| r)
    }

    fn put(&mut self, seq: u64, r: TaskResult) {
        match self.last.get(&r.id) {
            Some((s, _)) if *s >= seq => {}
            _ => {
                self.last.insert(r.id.clone(), (seq, r));
            }
        }
    }
}

/// The nodes of the tree in display order (depth first), as far as the
/// records tell.
pub fn layout(roots: &Roots, recs: &Records) -> Vec<Node> {
    let mut out = Vec::new();
    let mut seen = HashSet::new();
    match roots {
        Roots::One(id) => walk(id, Kind::Task, None, 0, true, recs, &mut out, &mut seen),
        Roots::Shards { base, ids } => {
            for id in ids {
                walk(
                    id,
                    Kind::Shard,
                    Some(base),
                    1,
                    false,
                    recs,
                    &mut out,
                    &mut seen,
                );
            }
            if let Some(j) = ids.iter().find_map(|id| recs.get(id)?.join.clone()) {
                walk(
                    &j,
                    Kind::Join,
                    Some(base),
                    1,
                    true,
                    recs,
                    &mut out,
                    &mut seen,
                );
            }
        }
    }
    out
}

#[allow(clippy::too_many_arguments)]
fn walk(
    id: &str,
    kind: Kind,
    parent: Option<&str>,
    depth: usize,
    show_join: bool,
    recs: &Records,
    out: &mut Vec<Node>,
    seen: &mut HashSet<String>,
) {
    // Ids are the user's to give: a loop ends here.
    if !seen.insert(id.to_string()) {
        return;
    }
    out.push(Node {
        id: id.to_string(),
        kind,
        parent: parent.map(str::to_string),
        depth,
    });
    let Some(r) = recs.get(id) else { return };
    for c in &r.children {
        walk(c, Kind::Child, Some(id), depth + 1, true, recs, out, seen);
    }
    if let (true, Some(j)) = (show_join, &r.join) {
        walk(j, Kind::Join, Some(id), depth + 1, true, recs, out, seen);
    }
}

/// Whether every node has a final record.
pub fn complete(nodes: &[Node], recs: &Records) -> bool {
    nodes
        .iter()
        .all(|n| recs.get(&n.id).is_some_and(|r| r.is_final))
}

/// Whether every node ended `success`.
pub fn succeeded(nodes: &[Node], recs: &Records) -> bool {
    nodes.iter().all(|n| {
        recs.get(&n.id)
            .is_some_and(|r| r.is_final && r.status == Status::Success)
    })
}

/// The exit status for a tree: 0 only if every node succeeded. After a
/// wait that ended early, stderr says how many are not final.
pub fn exit(nodes: &[Node], recs: &Records, waited: bool) -> Exit {
    let open = nodes
        .iter()
        .filter(|n| !recs.get(&n.id).is_some_and(|r| r.is_final))
        .count();
    if waited && open > 0 {
        eprintln!(
            "jetworker: gave up waiting: {open} of {} task(s) of the tree have no final result yet",
            nodes.len()
        );
    }
    if succeeded(nodes, recs) {
        Exit::Ok
    } else {
        Exit::NotSucceeded
    }
}

/// The last record of `id` with its sequence.
async fn fetch(
    conn: &Conn,
    results: &Stream,
    id: &str,
) -> anyhow::Result<Option<(u64, TaskResult)>> {
    match results
        .direct_get_last_for_subject(conn.names.result_subject(id))
        .await
    {
        Ok(m) => Ok(Some((m.sequence, parse_result(&m.payload)?))),
        Err(e) if e.kind() == DirectGetErrorKind::NotFound => Ok(None),
        Err(e) => Err(anyhow::anyhow!(e).context(format!("cannot read the result of {id}"))),
    }
}

/// Lay the tree out, reading the record of each node not read yet, until
/// no new node appears.
pub async fn load(
    conn: &Conn,
    results: &Stream,
    roots: &Roots,
    recs: &mut Records,
) -> anyhow::Result<Vec<Node>> {
    loop {
        let nodes = layout(roots, recs);
        let todo: Vec<String> = nodes
            .iter()
            .filter(|n| !recs.asked.contains(&n.id))
            .map(|n| n.id.clone())
            .collect();
        if todo.is_empty() {
            return Ok(nodes);
        }
        recs.asked.extend(todo.iter().cloned());
        let mut reads = futures::stream::iter(todo.iter().map(|id| fetch(conn, results, id)))
            .buffer_unordered(32);
        while let Some(r) = reads.next().await {
            if let Some((seq, rec)) = r? {
                recs.put(seq, rec);
            }
        }
    }
}

/// The roots of `results <id> --tree`: the task `id`, or, when it has no
/// record, the fan-out whose shards are `<id>-<no>`.
pub async fn roots_of(conn: &Conn, results: &Stream, id: &str) -> anyhow::Result<Option<Roots>> {
    if fetch(conn, results, id).await?.is_some() {
        return Ok(Some(Roots::One(id.to_string())));
    }
    let first = fetch(conn, results, &format!("{id}-0")).await?;
    Ok(first.and_then(|(_, r)| r.shard).map(|s| Roots::Shards {
        base: id.to_string(),
        ids: (0..s.total).map(|no| format!("{id}-{no}")).collect(),
    }))
}

/// [`roots_of`], waiting (until `deadline`) for the first record of `id`
/// or of its first shard when neither has one yet: a task still queued.
pub async fn wait_for_roots(
    conn: &Conn,
    results: &Stream,
    id: &str,
    since_seq: u64,
    deadline: Option<tokio::time::Instant>,
) -> anyhow::Result<Option<Roots>> {
    let mut reader = OrderedReader::open(
        results,
        vec![
            conn.names.result_subject(id),
            conn.names.result_subject(&format!("{id}-0")),
        ],
        DeliverPolicy::ByStartSequence {
            start_sequence: since_seq + 1,
        },
    )
    .await?;
    loop {
        if let Some(r) = roots_of(conn, results, id).await? {
            return Ok(Some(r));
        }
        if reader.next_before(deadline).await?.is_none() {
            return Ok(None);
        }
    }
}

/// Wait until every node of the tree has a final record (or `deadline`
/// passes): the records stored since `since_seq` are followed, and the
/// tree grows as they name new nodes. Returns the last layout.
pub async fn wait(
    conn: &Conn,
    roots: &Roots,
    since_seq: u64,
    deadline: Option<tokio::time::Instant>,
    recs: &mut Records,
) -> anyhow::Result<Vec<Node>> {
    let results = conn.ensure_results().await?;
    let mut reader = OrderedReader::open(
        &results,
        vec![format!("{}.>", conn.names.results_prefix)],
        DeliverPolicy::ByStartSequence {
            start_sequence: since_seq + 1,
        },
    )
    .await?;
    let mut nodes = load(conn, &results, roots, recs).await?;
    let bar = output::progress(nodes.len() as u64, "tasks final");
    while !complete(&nodes, recs) {
        let ids: HashSet<&str> = nodes.iter().map(|n| n.id.as_str()).collect();
        let Some(m) = reader.next_before(deadline).await? else {
            break;
        };
        let Ok(r) = parse_result(&m.payload) else {
            continue;
        };
        if !ids.contains(r.id.as_str()) {
            continue;
        }
        recs.put(m.sequence, r);
        nodes = load(conn, &results, roots, recs).await?;
        bar.set_length(nodes.len() as u64);
        bar.set_position(
            nodes
                .iter()
                .filter(|n| recs.get(&n.id).is_some_and(|r| r.is_final))
                .count() as u64,
        );
    }
    bar.finish_and_clear();
    Ok(nodes)
}

/// One `--json` line.
#[derive(Serialize)]
struct JsonNode<'a> {
    id: &'a str,
    kind: Kind,
    parent: Option<&'a str>,
    depth: usize,
    status: String,
    #[serde(rename = "final")]
    is_final: bool,
    result: Option<&'a TaskResult>,
}

const HEADERS: [&str; 6] = ["TASK", "STATUS", "ATTEMPT", "DURATION", "WORKER", "OUTPUT"];

/// Print the tree: a table, or JSON lines.
pub fn print(
    roots: &Roots,
    nodes: &[Node],
    recs: &Records,
    json: bool,
    colour: bool,
) -> anyhow::Result<()> {
    if json {
        for n in nodes {
            let r = recs.get(&n.id);
            output::json_line(&JsonNode {
                id: &n.id,
                kind: n.kind,
                parent: n.parent.as_deref(),
                depth: n.depth,
                status: r.map_or("pending".into(), |r| r.status.to_string()),
                is_final: r.is_some_and(|r| r.is_final),
                result: r,
            })?;
        }
        return Ok(());
    }
    let mut t = Table::new(&HEADERS, colour);
    if let Roots::Shards { base, ids } = roots {
        t.push(fan_out_row(base, ids, recs));
    }
    let many = matches!(roots, Roots::Shards { ids, .. } if ids.len() > SHOWN_SHARDS);
    let mut hidden: Option<usize> = None;
    for n in nodes {
        let r = recs.get(&n.id);
        // A big fan-out: only the shards that did not succeed (with what
        // hangs below them).
        if many && n.depth == 1 && n.kind == Kind::Shard {
            let ok = r.is_some_and(|r| r.is_final && r.status == Status::Success);
            hidden = ok.then_some(n.depth);
            if ok {
                continue;
            }
        } else if hidden.is_some_and(|d| n.depth > d) {
            continue;
        } else {
            hidden = None;
        }
        t.push(row(n, r, colour));
    }
    print!("{}", t.render());
    Ok(())
}

fn row(n: &Node, r: Option<&TaskResult>, colour: bool) -> Vec<String> {
    let mut name = match n.depth {
        0 => String::new(),
        d => format!("{}└─ ", "   ".repeat(d - 1)),
    };
    name.push_str(&n.id);
    if n.kind == Kind::Join {
        name.push_str(" (join)");
    }
    let Some(r) = r else {
        return vec![
            name,
            "pending".into(),
            String::new(),
            String::new(),
            String::new(),
            String::new(),
        ];
    };
    vec![
        name,
        super::results::status_cell(r, colour),
        format!("{}/{}", r.attempt, r.max_attempts),
        output::short_duration(Duration::from_millis(r.duration_ms)),
        r.worker_id.clone(),
        super::results::output_cell(r),
    ]
}

/// `job-{0..49}  50 shards: 48 success, 2 failed`.
fn fan_out_row(base: &str, ids: &[String], recs: &Records) -> Vec<String> {
    let mut counts: BTreeMap<String, usize> = BTreeMap::new();
    for id in ids {
        let s = recs.get(id).map_or("pending".to_string(), |r| {
            if r.is_final {
                r.status.to_string()
            } else {
                format!("{} (not final)", r.status)
            }
        });
        *counts.entry(s).or_default() += 1;
    }
    let summary: Vec<String> = counts.iter().map(|(s, n)| format!("{n} {s}")).collect();
    vec![
        format!("{base}-{{0..{}}}", ids.len().saturating_sub(1)),
        format!("{} shards", ids.len()),
        String::new(),
        String::new(),
        String::new(),
        summary.join(", "),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::Shard;
    use chrono::Utc;

    fn rec(id: &str, status: Status, fin: bool) -> TaskResult {
        let mut r = TaskResult::blank(id, "default", None, status, 1, 3, "w", Utc::now());
        r.is_final = fin;
        r
    }

    #[test]
    fn chain_fan_out_and_join_layout() {
        let mut recs = Records::default();
        let mut a = rec("a", Status::Success, true);
        a.children = vec!["a-then-1".into()];
        recs.put(1, a);
        let mut b = rec("a-then-1", Status::Running, false);
        b.children = vec!["a-then-1-then-1".into()];
        recs.put(2, b);
        let nodes = layout(&Roots::One("a".into()), &recs);
        let ids: Vec<(&str, usize)> = nodes.iter().map(|n| (n.id.as_str(), n.depth)).collect();
        assert_eq!(ids, vec![("a", 0), ("a-then-1", 1), ("a-then-1-then-1", 2)]);
        assert!(!complete(&nodes, &recs));
        // An older record never replaces a newer one.
        recs.put(0, rec("a", Status::Running, false));
        assert!(recs.get("a").unwrap().is_final);

        let mut recs = Records::default();
        for no in 0..3 {
            let mut r = rec(&format!("j-{no}"), Status::Success, true);
            r.shard = Some(Shard { no, total: 3 });
            r.join = Some("j-join".into());
            recs.put(u64::from(no) + 1, r);
        }
        recs.put(9, rec("j-join", Status::Success, true));
        let roots = Roots::Shards {
            base: "j".into(),
            ids: (0..3).map(|n| format!("j-{n}")).collect(),
        };
        let nodes = layout(&roots, &recs);
        assert_eq!(nodes.len(), 4);
        assert_eq!(nodes[3].kind, Kind::Join);
        assert!(complete(&nodes, &recs) && succeeded(&nodes, &recs));
    }
}
