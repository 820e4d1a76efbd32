//! `jetworker submit`: build a task from flags (or `--file`/stdin), check
//! it locally exactly as a worker will, publish it to `tasks.<label>` with
//! `Nats-Msg-Id` = its id (so re-running the same command inside the
//! duplicate window queues nothing new), optionally as N shards, and with
//! `--wait` wait for the final result(s).
//!
//! `--in 10m` / `--at <RFC3339>` delay a task: it is stored as a one-shot
//! message schedule (`@at`, nats-server 2.12+) on `schedules.delayed.<id>`
//! that the server fires into `tasks.<label>` at that time (rounded up to
//! the second); the worker keeps the task's id for such a firing. Submitting
//! the same id again before it fires replaces the schedule;
//! `jetworker schedule rm delayed.<id>` removes it. `--wait` waits through
//! the delay.
//!
//! Downstream tasks (DESIGN.md section 5, "Downstream tasks"): `--then`
//! (repeatable, or `-- a --then b --then c`) builds a chain, each step with
//! the submitted task's settings and its own body (or a task JSON object);
//! `--on-failure` adds a task queued if any step ends failed, timeout or
//! dead; `--then-all` (with `--shards`) a join queued once every shard is
//! final, `--join-policy` saying whether it needs them all to succeed.
//!
//! Output: without `--wait`, the id of each published task, one per line
//! (`--json`: `{"id","subject","sequence","duplicate","at"}` per line;
//! `subject` is the schedule's for a delayed task, `at` when it fires or
//! null). With
//! `--wait`, a summary line per final result, and for a single task its
//! output (`--json`: each final result as one JSON line); a task with
//! downstream tasks waits for its whole tree and prints it as
//! `results --tree` does. Exit code 0 only if every task (of the tree)
//! succeeded, 1 otherwise (including `--wait-timeout`), 2 for a bad task or
//! a connection problem.
//!
//! While waiting, stderr says when no online worker serves the label (the
//! task then waits in the queue) and shows each attempt that will be
//! retried.

use std::io::Write;
use std::time::Duration;

use anyhow::{bail, Context as _};
use chrono::{DateTime, SubsecRound, Utc};
use clap::Args;
use rand::distr::{Alphanumeric, SampleString};
use serde::Serialize;

use super::common::Conn;
use super::output::{self, colour_enabled, status_text};
use super::schedule::{check_schedules, parse_at, schedule_headers, Spec};
use super::taskflags;
use super::taskflags::{validate_locally, Origin, TaskArgs};
use super::tree::{self, Roots};
use super::Exit;
use crate::protocol::{parse_duration, JoinPolicy, Shard, Status, TaskMessage, TaskResult};

#[derive(Debug, Clone, Args)]
pub struct SubmitArgs {
    #[command(flatten)]
    pub task: Box<TaskArgs>,
    /// Fan out N tasks with shard {no, total}; ids <id>-<no>.
    #[arg(long, value_name = "N")]
    pub shards: Option<u32>,
    /// Queue this task when the one before succeeds (repeatable: a chain).
    /// Its body as for this task (shell: the script; command, container:
    /// the words; http: the URL) or a task JSON object; also as words:
    /// `-- a --then b --then c`.
    #[arg(long = "then", value_name = "TASK", help_heading = "Downstream tasks")]
    pub then: Vec<String>,
    /// Queue this task if any task of the chain ends failed, timeout or dead.
    #[arg(long, value_name = "TASK", help_heading = "Downstream tasks")]
    pub on_failure: Option<String>,
    /// With --shards: queue this task once every shard is final (a join,
    /// id <id>-join, with JOIN_SUMMARY in its environment).
    #[arg(
        long,
        value_name = "TASK",
        requires = "shards",
        help_heading = "Downstream tasks"
    )]
    pub then_all: Option<String>,
    /// When the join runs: all-success (only if every shard succeeded;
    /// the default) or always.
    #[arg(
        long,
        value_name = "POLICY",
        requires = "then_all",
        help_heading = "Downstream tasks"
    )]
    pub join_policy: Option<JoinPolicy>,
    /// Wait for the final result(s); exit 0 only if all succeeded.
    #[arg(long, short = 'w')]
    pub wait: bool,
    /// Give up waiting after this long (exit 1); default: wait for ever.
    #[arg(long, value_name = "DURATION", requires = "wait")]
    pub wait_timeout: Option<String>,
    /// Queue the task after this delay (10m), through a message schedule.
    #[arg(long = "in", value_name = "DURATION", conflicts_with = "at")]
    pub delay: Option<String>,
    /// Queue the task at this RFC3339 time, through a message schedule.
    #[arg(long, value_name = "TIME")]
    pub at: Option<String>,
    /// Print JSON lines instead of text.
    #[arg(long)]
    pub json: bool,
    /// Print the task JSON that would be published, publish nothing.
    #[arg(long)]
    pub dry_run: bool,
}

/// What `--json` prints for each published task.
#[derive(Serialize)]
struct Published<'a> {
    id: &'a str,
    subject: &'a str,
    sequence: u64,
    duplicate: bool,
    /// When a delayed task is queued; null for one queued now.
    at: Option<DateTime<Utc>>,
}

/// A task of a type neither built in nor defined in the config file is
/// only checked as far as its envelope: say so, since a typo would
/// otherwise surface only as `dead` once no worker takes it.
fn not_known_here(ty: &str, known: bool) {
    if !known {
        let builtin = ["shell", "command", "http", "container"];
        eprintln!(
            "note: type `{ty}` is not built in or defined in this config{}; its fields are not \
             checked here, and it waits for a worker of the label that runs it",
            crate::suggest::hint(ty, builtin)
        );
    }
}

/// A random task id: 16 lowercase letters and digits.
pub fn random_id() -> String {
    Alphanumeric
        .sample_string(&mut rand::rng(), 16)
        .to_ascii_lowercase()
}

pub async fn run(ctx: &super::Ctx, args: SubmitArgs) -> anyhow::Result<Exit> {
    let label = args.task.label()?.to_string();
    let wait_timeout = match &args.wait_timeout {
        Some(s) => Some(parse_duration(s).map_err(|e| anyhow::anyhow!("--wait-timeout: {e}"))?),
        None => None,
    };
    let now = Utc::now();
    let at = delayed_until(&args, now)?;
    let base = with_downstream(&args)?;
    let base_id = base.id.clone().unwrap_or_else(random_id);
    let downstream = base.then.is_some() || base.then_all.is_some();
    if let Some(e) = &base.expires {
        let queued = at.unwrap_or(now);
        if DateTime::parse_from_rfc3339(e.trim()).is_ok_and(|t| t < queued) {
            bail!("--expires: {e} is before the task is queued; it would never run");
        }
    }

    // Build and validate every task before publishing any.
    let mut tasks = Vec::new();
    match args.shards {
        None => {
            let mut m = base.clone();
            m.id = Some(base_id.clone());
            let (bytes, task) = validate_locally(
                &label,
                &m,
                Origin::Direct { msg_id: &base_id },
                &ctx.type_defs,
            )?;
            not_known_here(&task.task_type, task.runnable());
            tasks.push((base_id.clone(), bytes));
        }
        Some(0) => bail!("--shards: must be at least 1"),
        Some(total) => {
            if base.shard.is_some() || base.shard_no.is_some() || base.shard_total.is_some() {
                bail!("--shards: the task already names a shard");
            }
            for no in 0..total {
                let id = format!("{base_id}-{no}");
                let mut m = base.clone();
                m.id = Some(id.clone());
                m.shard = Some(Shard { no, total });
                let (bytes, _) =
                    validate_locally(&label, &m, Origin::Direct { msg_id: &id }, &ctx.type_defs)?;
                tasks.push((id, bytes));
            }
        }
    }

    if args.dry_run {
        for (_, bytes) in &tasks {
            output::line(&String::from_utf8_lossy(bytes))?;
        }
        return Ok(Exit::Ok);
    }

    let conn = Conn::open(ctx).await?;
    let since_seq = if args.wait {
        conn.results_last_seq().await
    } else {
        0
    };
    let target = conn.names.task_subject(&label);
    let spec = at.map(Spec::At);
    if let Some(spec) = &spec {
        check_schedules(&conn, spec).await?;
    }
    let ids: Vec<String> = tasks.iter().map(|(id, _)| id.clone()).collect();
    for (id, bytes) in tasks {
        // Delayed: a one-shot schedule, replaced by a second submit (no
        // message id: the fired copy must not look like a duplicate of it).
        let (subject, msg_id, headers) = match &spec {
            Some(spec) => (
                conn.names.delayed_subject(&id),
                None,
                Some(schedule_headers(spec, &target)),
            ),
            None => (target.clone(), Some(id.as_str()), None),
        };
        let ack = conn
            .publish(&subject, bytes, msg_id, headers)
            .await
            .with_context(|| format!("task {id}"))?;
        if args.json && !args.wait {
            output::json_line(&Published {
                id: &id,
                subject: &subject,
                sequence: ack.sequence,
                duplicate: ack.duplicate,
                at,
            })?;
        } else if !args.wait {
            output::line(&id)?;
        }
        if ack.duplicate {
            eprintln!("jetworker: {id} was already queued (duplicate within the window); not queued again");
        }
    }
    if !args.wait {
        return Ok(Exit::Ok);
    }
    if let Some(at) = at {
        eprintln!(
            "jetworker: queued at {}; waiting for the result",
            output::timestamp(at)
        );
    }
    warn_if_unserved(&conn, &label).await;
    if downstream {
        let roots = match args.shards {
            Some(_) => Roots::Shards { base: base_id, ids },
            None => Roots::One(base_id),
        };
        let deadline = wait_timeout.map(|t| tokio::time::Instant::now() + t);
        let mut recs = tree::Records::default();
        let nodes = tree::wait(&conn, &roots, since_seq, deadline, &mut recs).await?;
        tree::print(&roots, &nodes, &recs, args.json, colour_enabled())?;
        return Ok(tree::exit(&nodes, &recs, true));
    }
    wait_and_report(&conn, &ids, since_seq, wait_timeout, args.json).await
}

/// When a delayed task is to be queued (`--in`, `--at`), or `None` for
/// now. `--in` is rounded up to the next second (schedules fire on whole
/// seconds), so the task never starts before the delay is over.
fn delayed_until(args: &SubmitArgs, now: DateTime<Utc>) -> anyhow::Result<Option<DateTime<Utc>>> {
    if let Some(d) = &args.delay {
        let d = parse_duration(d).map_err(|e| anyhow::anyhow!("--in: {e}"))?;
        if d.is_zero() {
            bail!("--in: must be greater than 0 (leave it out to queue the task now)");
        }
        let at = now + chrono::Duration::from_std(d).context("--in: too long")?;
        let up = if at.timestamp_subsec_nanos() > 0 {
            chrono::Duration::seconds(1)
        } else {
            chrono::Duration::zero()
        };
        return Ok(Some(at.trunc_subsecs(0) + up));
    }
    if let Some(t) = &args.at {
        let at = parse_at(t)?;
        if at <= now {
            bail!("--at: {t} has passed (leave it out to queue the task now)");
        }
        return Ok(Some(at));
    }
    Ok(None)
}

/// The task from the flags, with the downstream tasks the flags describe.
fn with_downstream(args: &SubmitArgs) -> anyhow::Result<TaskMessage> {
    let mut flags = (*args.task).clone();
    let mut parts = flags.words.split(|w| w == "--then");
    let first = parts.next().unwrap_or_default().to_vec();
    let mut steps: Vec<Step> = parts.map(|p| Step::Words(p.to_vec())).collect();
    if !steps.is_empty() && !args.then.is_empty() {
        bail!("give the chain either as --then flags or as `-- a --then b`, not both");
    }
    steps.extend(args.then.iter().cloned().map(Step::Text));
    flags.words = first;
    let mut base = flags.build()?;
    let template = template_of(&base);
    if !steps.is_empty() || args.on_failure.is_some() {
        if base.then.is_some() {
            bail!("the task JSON has `then` already: give the chain either there or with --then/--on-failure");
        }
        let failure = match &args.on_failure {
            Some(f) => {
                let mut t = step_task(&template, &Step::Text(f.clone()))
                    .map_err(|e| anyhow::anyhow!("--on-failure: {e:#}"))?;
                t.on = Some(vec![Status::Failed, Status::Timeout, Status::Dead]);
                Some(t)
            }
            None => None,
        };
        // From the last step back to the first, each one the next's child.
        let mut next: Option<TaskMessage> = None;
        for (i, s) in steps.iter().enumerate().rev() {
            let mut t = step_task(&template, s)
                .map_err(|e| anyhow::anyhow!("--then (step {}): {e:#}", i + 1))?;
            append(&mut t, next.take().into_iter().chain(failure.clone()));
            next = Some(t);
        }
        append(&mut base, next.into_iter().chain(failure));
    }
    if let Some(j) = &args.then_all {
        if base.then_all.is_some() {
            bail!("the task JSON has `then_all` already: give the join either there or with --then-all");
        }
        let mut t = step_task(&template, &Step::Text(j.clone()))
            .map_err(|e| anyhow::anyhow!("--then-all: {e:#}"))?;
        t.policy = args.join_policy.or(t.policy);
        base.then_all = Some(Box::new(t));
    }
    Ok(base)
}

/// A downstream task given on the command line.
enum Step {
    /// Words after `--`, after a `--then` word.
    Words(Vec<String>),
    /// The value of a flag: a body, or a task JSON object.
    Text(String),
}

/// What a step built from a body starts from: the submitted task's
/// settings (type, timeout, retries, env, limits, image, …) without its
/// identity, body and downstream tasks.
fn template_of(base: &TaskMessage) -> TaskMessage {
    let mut t = base.clone();
    t.id = None;
    t.idempotency_key = None;
    t.shard = None;
    t.shard_no = None;
    t.shard_total = None;
    t.then = None;
    t.then_all = None;
    for f in ["payload", "script", "command", "args"] {
        t.remove_field(f);
    }
    if t.task_type.as_deref() == Some("http") {
        t.remove_field("url");
    }
    t
}

/// A step as a task: a JSON object as it is, else the template with the
/// step's body.
fn step_task(template: &TaskMessage, step: &Step) -> anyhow::Result<TaskMessage> {
    let words = match step {
        Step::Text(t) if t.trim_start().starts_with('{') => return taskflags::parse_message(t),
        Step::Text(t) => match template.task_type.as_deref() {
            Some("http") => {
                let mut m = template.clone();
                m.set_field("url", t.clone());
                return Ok(m);
            }
            Some("shell") | None => vec![t.clone()],
            Some(_) => shell_words::split(t).map_err(|e| anyhow::anyhow!("`{t}`: {e}"))?,
        },
        Step::Words(w) => w.clone(),
    };
    let mut m = template.clone();
    taskflags::apply_words(&mut m, &words)?;
    Ok(m)
}

/// Add children to a task's `then`.
fn append(m: &mut TaskMessage, children: impl Iterator<Item = TaskMessage>) {
    let children: Vec<TaskMessage> = children.collect();
    if !children.is_empty() {
        m.then.get_or_insert_with(Vec::new).extend(children);
    }
}

/// Wait for the final results of `ids`, print them, and map them to the
/// exit status.
async fn wait_and_report(
    conn: &Conn,
    ids: &[String],
    since_seq: u64,
    timeout: Option<Duration>,
    json: bool,
) -> anyhow::Result<Exit> {
    let colour = colour_enabled();
    let bar = (ids.len() > 1).then(|| output::progress(ids.len() as u64, "finished"));
    let single = ids.len() == 1;
    let deadline = timeout.map(|t| tokio::time::Instant::now() + t);
    let mut failed = 0u64;
    let mut print_err: Option<anyhow::Error> = None;
    let done = conn
        .wait_results(ids, since_seq, deadline, |r| {
            // `running`/`queued` records are progress, not attempts.
            if matches!(r.status, Status::Running | Status::Queued) {
                return;
            }
            if !r.is_final {
                let msg = retry_note(r);
                match &bar {
                    Some(b) => b.println(msg),
                    None => eprintln!("{msg}"),
                }
                return;
            }
            if r.status != Status::Success {
                failed += 1;
            }
            let res = print_final(r, json, single, colour);
            if let Err(e) = res {
                print_err.get_or_insert(e);
            }
            if let Some(b) = &bar {
                b.inc(1);
                if failed > 0 {
                    b.set_message(format!("{failed} not successful"));
                }
            }
        })
        .await?;
    if let Some(b) = bar {
        b.finish_and_clear();
    }
    if let Some(e) = print_err {
        return Err(e);
    }
    let missing: Vec<&String> = ids.iter().filter(|i| !done.contains_key(*i)).collect();
    if !missing.is_empty() {
        let shown: Vec<&str> = missing.iter().take(10).map(|s| s.as_str()).collect();
        eprintln!(
            "jetworker: gave up waiting: {} of {} task(s) have no final result yet: {}{}",
            missing.len(),
            ids.len(),
            shown.join(", "),
            if missing.len() > 10 { ", …" } else { "" }
        );
        return Ok(Exit::NotSucceeded);
    }
    Ok(if done.values().all(|r| r.status == Status::Success) {
        Exit::Ok
    } else {
        Exit::NotSucceeded
    })
}

/// A non-final attempt, for stderr:
/// `jetworker: <id> attempt 1/3 failed (exit 1): <error>; retrying in 2s`.
fn retry_note(r: &TaskResult) -> String {
    let mut s = format!(
        "jetworker: {} attempt {}/{} {}",
        r.id, r.attempt, r.max_attempts, r.status
    );
    if let Some(c) = r.exit_code {
        s.push_str(&format!(" (exit {c})"));
    }
    if let Some(e) = &r.error {
        s.push_str(&format!(": {}", output::first_line(e, 120)));
    }
    match r.retry_in_ms {
        Some(ms) => s.push_str(&format!(
            "; retrying in {}",
            output::short_duration(Duration::from_millis(ms))
        )),
        None => s.push_str("; it will be retried"),
    }
    s
}

/// Warn (stderr) when no online worker serves `label`: the task then waits
/// in the queue, and a waiter would otherwise wait without a hint.
async fn warn_if_unserved(conn: &Conn, label: &str) {
    let Ok(store) = conn.js.get_key_value(&conn.names.workers_bucket).await else {
        eprintln!(
            "jetworker: no worker has ever run here; {label} tasks wait in the queue until one serves the label (jetworker run --labels {label})"
        );
        return;
    };
    let Ok(all) = crate::queues::online_workers(&store).await else {
        return;
    };
    if !all.iter().any(|hb| hb.labels.iter().any(|l| l == label)) {
        eprintln!(
            "jetworker: no worker online serves label {label} ({} online); the task waits in the queue until one does (jetworker run --labels {label})",
            all.len()
        );
    }
}

/// One final result: a JSON line, or a summary line (and, for a single
/// task, its output).
fn print_final(r: &TaskResult, json: bool, single: bool, colour: bool) -> anyhow::Result<()> {
    if json {
        return output::json_line(r);
    }
    let mut o = std::io::stdout().lock();
    writeln!(o, "{}", summary(r, colour))?;
    if single && !r.output.is_empty() {
        o.write_all(r.output.as_bytes())?;
        if !r.output.ends_with('\n') {
            o.write_all(b"\n")?;
        }
        if r.output_truncated {
            writeln!(o, "[output truncated: {} bytes in all]", r.output_bytes)?;
        }
    }
    o.flush()?;
    Ok(())
}

/// `<id> <status> attempt 1/3 12ms exit 0 on <worker>: <error>`.
pub fn summary(r: &TaskResult, colour: bool) -> String {
    let mut s = format!(
        "{} {} (attempt {}/{}, {}",
        r.id,
        status_text(r.status, colour),
        r.attempt,
        r.max_attempts,
        output::short_duration(Duration::from_millis(r.duration_ms)),
    );
    if let Some(c) = r.exit_code {
        s.push_str(&format!(", exit {c}"));
    }
    if let Some(sig) = &r.signal {
        s.push_str(&format!(", signal {sig}"));
    }
    if let Some(h) = r.http_status {
        s.push_str(&format!(", http {h}"));
    }
    if !r.worker_id.is_empty() {
        s.push_str(&format!(", worker {}", r.worker_id));
    }
    s.push(')');
    if let Some(e) = &r.error {
        s.push_str(&format!(": {e}"));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct T {
        #[command(flatten)]
        a: SubmitArgs,
    }

    fn build(v: &[&str]) -> anyhow::Result<TaskMessage> {
        let mut all = vec!["x"];
        if !v.contains(&"--type") {
            all.extend(["--type", "shell"]);
        }
        all.extend_from_slice(v);
        with_downstream(&T::parse_from(all).a)
    }

    fn scripts(m: &TaskMessage) -> Vec<String> {
        let script = |m: &TaskMessage| {
            m.field("script")
                .and_then(|s| s.as_str())
                .unwrap_or_default()
                .to_string()
        };
        let mut out = vec![script(m)];
        let mut at = m;
        while let Some(next) = at.then.as_ref().and_then(|t| t.first()) {
            out.push(script(next));
            at = next;
        }
        out
    }

    #[test]
    fn a_chain_from_words_or_flags() {
        let m = build(&[
            "--retries",
            "1",
            "--",
            "echo",
            "a",
            "--then",
            "echo b",
            "--then",
            "echo",
            "c",
        ])
        .unwrap();
        assert_eq!(scripts(&m), vec!["echo a", "echo b", "echo c"]);
        // Each step keeps the submitted task's settings, not its identity.
        let b = &m.then.as_ref().unwrap()[0];
        assert_eq!(b.retry.as_ref().unwrap().max_attempts, Some(2));
        assert!(b.id.is_none());
        let m = build(&[
            "--id", "x1", "--then", "echo b", "--then", "echo c", "--", "echo a",
        ])
        .unwrap();
        assert_eq!(scripts(&m), vec!["echo a", "echo b", "echo c"]);
        assert!(build(&["--then", "b", "--", "a", "--then", "c"]).is_err());
        assert!(build(&["--", "a", "--then"]).is_err(), "an empty step");
    }

    #[test]
    fn failure_branch_join_and_json_steps() {
        let m = build(&["--on-failure", "undo", "--then", "b", "--", "a"]).unwrap();
        let then = m.then.as_ref().unwrap();
        assert_eq!(then.len(), 2);
        assert_eq!(then[1].field("script"), Some(&"undo".into()));
        assert_eq!(
            then[1].on.as_deref(),
            Some(&[Status::Failed, Status::Timeout, Status::Dead][..])
        );
        // The last step has its own failure branch.
        assert_eq!(
            then[0].then.as_ref().unwrap()[0]
                .field("script")
                .and_then(|s| s.as_str()),
            Some("undo")
        );
        let m = build(&[
            "--shards",
            "3",
            "--then-all",
            r#"{"type":"command","command":"merge"}"#,
            "--join-policy",
            "always",
            "--",
            "part",
        ])
        .unwrap();
        let j = m.then_all.unwrap();
        assert_eq!(j.field("command"), Some(&"merge".into()));
        assert_eq!(j.policy, Some(JoinPolicy::Always));
        let m = build(&[
            "--type",
            "command",
            "--then",
            "/bin/echo 'b c'",
            "--",
            "/bin/true",
        ])
        .unwrap();
        let b = &m.then.unwrap()[0];
        assert_eq!(b.field("command"), Some(&"/bin/echo".into()));
        assert_eq!(b.field("args"), Some(&serde_json::json!(["b c"])));
    }
}
