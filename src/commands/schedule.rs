//! `jetworker schedule add|ls|rm`: cron in the broker. A schedule is the
//! task JSON stored on `schedules.<name>` in the task stream with
//! JetStream message-schedule headers (`Nats-Schedule`,
//! `Nats-Schedule-Target: tasks.<label>`, `Nats-Schedule-Time-Zone`); the
//! server fires a copy into `tasks.<label>` each time, and the worker gives
//! each firing its own id (`<id or name>-<YYYYMMDDTHHMMSSZ>`). Publishing
//! on the same name replaces the schedule; purging the subject removes it.
//!
//! Specs: `--cron` (6 fields, seconds first; 5 crontab fields, meaning
//! second 0; or `@hourly`-style names; server 2.14+), `--every 30s` (server 2.14+), `--at <RFC3339>` (once;
//! server 2.12+). The spec and time zone are checked locally, so a typo
//! fails with exit 2 before anything is published.
//!
//! Delayed tasks (`submit --in/--at`) are one-shot `@at` schedules on
//! `schedules.delayed.<id>` ([`check_schedules`] and [`schedule_headers`]
//! serve both): `ls` lists them as `delayed.<id>` until they fire, and
//! `rm delayed.<id>` removes one before it does.
//!
//! `--json`: `ls` prints one object per schedule per line; `add` the new
//! schedule as one such object; `rm` `{"name","removed":true}`.

use std::time::Duration;

use anyhow::{anyhow, bail, Context as _};
use async_nats::header::{NATS_SCHEDULE, NATS_SCHEDULE_TARGET, NATS_SCHEDULE_TIME_ZONE};
use async_nats::HeaderMap;
use chrono::{DateTime, SubsecRound, Utc};
use clap::{ArgGroup, Args, Subcommand};
use futures::TryStreamExt;
use serde::Serialize;

use super::common::{header, Conn};
use super::output::{self, colour_enabled, Table};
use super::taskflags::{validate_locally, Origin, TaskArgs};
use super::Exit;
use crate::connect::server_at_least;
use crate::protocol::{parse_duration, valid_id, valid_label, DELAYED_TOKEN};

#[derive(Debug, Clone, Args)]
pub struct ScheduleArgs {
    #[command(subcommand)]
    pub command: ScheduleCommand,
    /// Print JSON lines instead of text.
    #[arg(long, global = true)]
    pub json: bool,
}

#[derive(Debug, Clone, Subcommand)]
pub enum ScheduleCommand {
    /// Add (or replace) a schedule.
    Add(AddArgs),
    /// List schedules with their next fire time.
    #[command(alias = "list")]
    Ls(LsArgs),
    /// Remove a schedule.
    #[command(alias = "remove")]
    Rm(RmArgs),
}

#[derive(Debug, Clone, Args)]
#[command(group(ArgGroup::new("when").required(true).args(["cron", "every", "at"])))]
pub struct AddArgs {
    /// Schedule name [A-Za-z0-9_-]{1,64}; the subject is schedules.<name>.
    pub name: String,
    /// Cron spec: "*/5 * * * *" (crontab, at second 0), "30 */5 * * * *" (seconds first), or @hourly, @daily, …
    #[arg(long, value_name = "SPEC")]
    pub cron: Option<String>,
    /// Fire every DURATION (at least 1s).
    #[arg(long, value_name = "DURATION")]
    pub every: Option<String>,
    /// Fire once at this RFC3339 time.
    #[arg(long, value_name = "TIME")]
    pub at: Option<String>,
    /// Time zone of a --cron spec (IANA name, e.g. Europe/Paris); default UTC.
    #[arg(long, value_name = "ZONE")]
    pub tz: Option<String>,
    #[command(flatten)]
    pub task: Box<TaskArgs>,
    /// Print the task JSON and headers, publish nothing.
    #[arg(long)]
    pub dry_run: bool,
}

#[derive(Debug, Clone, Args)]
pub struct LsArgs {}

#[derive(Debug, Clone, Args)]
pub struct RmArgs {
    /// Schedule name.
    pub name: String,
}

pub async fn run(ctx: &super::Ctx, args: ScheduleArgs) -> anyhow::Result<Exit> {
    match args.command {
        ScheduleCommand::Add(a) => add(ctx, a, args.json).await,
        ScheduleCommand::Ls(_) => ls(ctx, args.json).await,
        ScheduleCommand::Rm(a) => rm(ctx, a, args.json).await,
    }
}

/// A checked schedule spec.
#[derive(Debug, Clone, PartialEq)]
pub enum Spec {
    /// 6-field cron (or an `@` name) and an optional IANA zone.
    Cron {
        spec: String,
        tz: Option<String>,
    },
    Every(Duration),
    At(DateTime<Utc>),
}

impl Spec {
    /// The `Nats-Schedule` header value.
    pub fn header(&self) -> String {
        match self {
            Spec::Cron { spec, .. } => spec.clone(),
            Spec::Every(d) => format!("@every {}", go_duration(*d)),
            Spec::At(t) => format!(
                "@at {}",
                t.to_rfc3339_opts(chrono::SecondsFormat::Secs, true)
            ),
        }
    }

    /// Parse a `Nats-Schedule` header (and time zone) back, for `ls`.
    pub fn from_header(v: &str, tz: Option<String>) -> Option<Spec> {
        if let Some(d) = v.strip_prefix("@every ") {
            return parse_go_duration(d).map(Spec::Every);
        }
        if let Some(t) = v.strip_prefix("@at ") {
            return DateTime::parse_from_rfc3339(t.trim())
                .ok()
                .map(|t| Spec::At(t.with_timezone(&Utc)));
        }
        Some(Spec::Cron {
            spec: v.to_string(),
            tz,
        })
    }

    /// The next time it fires after `now`; `created` anchors `@every`.
    pub fn next_after(&self, now: DateTime<Utc>, created: DateTime<Utc>) -> Option<DateTime<Utc>> {
        match self {
            Spec::Cron { spec, tz } => {
                let cron = parse_cron(spec).ok()?;
                // croner keeps the sub-second part of the start time.
                let now = now.trunc_subsecs(0);
                match tz {
                    Some(z) => {
                        let z: chrono_tz::Tz = z.parse().ok()?;
                        cron.find_next_occurrence(&now.with_timezone(&z), false)
                            .ok()
                            .map(|t| t.with_timezone(&Utc))
                    }
                    None => cron.find_next_occurrence(&now, false).ok(),
                }
            }
            Spec::Every(d) => {
                let d = chrono::Duration::from_std(*d).ok()?;
                if d.is_zero() {
                    return None;
                }
                let elapsed = now - created;
                let n = elapsed.num_milliseconds() / d.num_milliseconds() + 1;
                Some((created + d * (n.max(1) as i32)).trunc_subsecs(0))
            }
            Spec::At(t) => (*t > now).then_some(*t),
        }
    }
}

/// A cron spec as the server takes it: 6 fields, seconds first, or a
/// predefined `@` name. A 5-field crontab spec (which the server refuses)
/// is read as running at second 0: `*/5 * * * *` → `0 */5 * * * *`.
pub fn server_cron(spec: &str) -> String {
    let s = spec.trim();
    if !s.starts_with('@') && s.split_whitespace().count() == 5 {
        format!("0 {}", s.split_whitespace().collect::<Vec<_>>().join(" "))
    } else {
        s.to_string()
    }
}

/// Check a cron spec in the server's form (see [`server_cron`]).
pub fn parse_cron(spec: &str) -> anyhow::Result<croner::Cron> {
    const NAMES: [&str; 7] = [
        "@yearly",
        "@annually",
        "@monthly",
        "@weekly",
        "@daily",
        "@midnight",
        "@hourly",
    ];
    let s = spec.trim();
    if s.starts_with('@') && !NAMES.contains(&s) {
        bail!(
            "--cron: `{s}` is not one of {} (for intervals use --every)",
            NAMES.join(", ")
        );
    }
    croner::parser::CronParser::builder()
        .seconds(croner::parser::Seconds::Required)
        .year(croner::parser::Year::Disallowed)
        .build()
        .parse(s)
        .map_err(|e| {
            anyhow!(
                "--cron: `{s}` is not a cron spec (sec min hour day month weekday, or the 5 crontab fields): {e}"
            )
        })
}

/// A duration in Go's syntax (`1h2m3s`, `1500ms`), which the server parses.
pub fn go_duration(d: Duration) -> String {
    if d.subsec_millis() != 0 {
        return format!("{}ms", d.as_millis());
    }
    let s = d.as_secs();
    let (h, m, s) = (s / 3600, (s / 60) % 60, s % 60);
    let mut out = String::new();
    if h > 0 {
        out.push_str(&format!("{h}h"));
    }
    if m > 0 {
        out.push_str(&format!("{m}m"));
    }
    if s > 0 || out.is_empty() {
        out.push_str(&format!("{s}s"));
    }
    out
}

/// Go-style durations back (`1h2m3s`, `1500ms`, `2.5s`).
fn parse_go_duration(s: &str) -> Option<Duration> {
    humantime::parse_duration(s.trim()).ok().or_else(|| {
        let secs: f64 = s.trim().strip_suffix('s')?.parse().ok()?;
        Some(Duration::from_secs_f64(secs))
    })
}

/// Check the `--cron/--every/--at/--tz` flags into a [`Spec`].
pub fn spec_from_args(a: &AddArgs) -> anyhow::Result<Spec> {
    if a.tz.is_some() && a.cron.is_none() {
        bail!("--tz applies to --cron only (the server refuses a time zone with @every and @at)");
    }
    if let Some(c) = &a.cron {
        let c = &server_cron(c);
        parse_cron(c)?;
        if let Some(z) = &a.tz {
            z.parse::<chrono_tz::Tz>()
                .map_err(|_| anyhow!("--tz: `{z}` is not an IANA time zone like Europe/Paris"))?;
        }
        return Ok(Spec::Cron {
            spec: c.trim().to_string(),
            tz: a.tz.clone(),
        });
    }
    if let Some(e) = &a.every {
        let d = parse_duration(e).map_err(|e| anyhow!("--every: {e}"))?;
        if d < Duration::from_secs(1) {
            bail!("--every: must be at least 1s");
        }
        return Ok(Spec::Every(d));
    }
    if let Some(t) = &a.at {
        return Ok(Spec::At(parse_at(t)?));
    }
    bail!("give one of --cron, --every or --at")
}

/// `--at`: an RFC3339 time.
pub fn parse_at(t: &str) -> anyhow::Result<DateTime<Utc>> {
    let t = DateTime::parse_from_rfc3339(t).map_err(|e| {
        anyhow!("--at: `{t}` is not an RFC3339 time like 2026-01-02T03:04:05Z ({e})")
    })?;
    Ok(t.with_timezone(&Utc))
}

/// The headers of a schedule message that fires into `target` per `spec`.
pub fn schedule_headers(spec: &Spec, target: &str) -> HeaderMap {
    let mut headers = HeaderMap::new();
    headers.insert(NATS_SCHEDULE, spec.header().as_str());
    headers.insert(NATS_SCHEDULE_TARGET, target);
    if let Spec::Cron { tz: Some(z), .. } = spec {
        headers.insert(NATS_SCHEDULE_TIME_ZONE, z.as_str());
    }
    headers
}

/// Check that the server and the task stream take schedules like `spec`
/// (`@at` needs nats-server 2.12, cron and `@every` 2.14; the stream must
/// allow message schedules), creating the streams if they are missing.
pub async fn check_schedules(conn: &Conn, spec: &Spec) -> anyhow::Result<()> {
    let names = &conn.names;
    let version = conn.client.server_info().version.clone();
    let (need, what) = match spec {
        Spec::At(_) => ((2, 12), "--at schedules and delayed tasks"),
        _ => ((2, 14), "--cron and --every schedules"),
    };
    if !server_at_least(&conn.client, need.0, need.1) {
        bail!(
            "{what} need nats-server {}.{} or newer; the server is {version}",
            need.0,
            need.1
        );
    }
    let mut tasks = match conn.stream(&names.tasks_stream).await {
        Ok(s) => s,
        Err(_) => conn.ensure_infra().await?.tasks,
    };
    if !tasks.info().await?.config.allow_message_schedules {
        bail!(
            "stream {} was created without message schedules; run `jetworker setup` to turn them on",
            names.tasks_stream
        );
    }
    Ok(())
}

async fn add(ctx: &super::Ctx, a: AddArgs, json: bool) -> anyhow::Result<Exit> {
    if !valid_label(&a.name) {
        bail!("schedule name `{}` is not [A-Za-z0-9_-]{{1,64}}", a.name);
    }
    let spec = spec_from_args(&a)?;
    let label = a.task.label()?.to_string();
    let names = &ctx.connect.names;
    let subject = names.schedule_subject(&a.name);
    let target = names.task_subject(&label);
    let msg = a.task.build()?;
    let (bytes, _) = validate_locally(
        &label,
        &msg,
        Origin::Schedule { subject: &subject },
        &ctx.type_defs,
    )?;

    let headers = schedule_headers(&spec, &target);
    if a.dry_run {
        output::line(&format!("subject: {subject}"))?;
        for (k, v) in headers.iter() {
            for v in v {
                output::line(&format!("{k}: {v}"))?;
            }
        }
        output::line(&String::from_utf8_lossy(&bytes))?;
        return Ok(Exit::Ok);
    }

    let conn = Conn::open(ctx).await?;
    check_schedules(&conn, &spec).await?;
    conn.publish(&subject, bytes.clone(), None, Some(headers))
        .await
        .with_context(|| format!("cannot store schedule {}", a.name))?;
    let next_time = spec.next_after(Utc::now(), Utc::now());
    if json {
        output::json_line(&ScheduleInfo {
            name: a.name.clone(),
            spec: spec.header(),
            time_zone: match &spec {
                Spec::Cron { tz, .. } => tz.clone(),
                _ => None,
            },
            next: next_time,
            target: target.clone(),
            task: String::from_utf8_lossy(&bytes).into_owned(),
        })?;
        return Ok(Exit::Ok);
    }
    let next = next_time
        .map(output::timestamp)
        .unwrap_or_else(|| "-".into());
    output::line(&format!(
        "schedule {} ({}) → {target}; next {next}",
        a.name,
        spec.header()
    ))?;
    Ok(Exit::Ok)
}

/// One schedule as `ls` shows it.
#[derive(Debug, Serialize)]
pub struct ScheduleInfo {
    pub name: String,
    pub spec: String,
    pub time_zone: Option<String>,
    pub next: Option<DateTime<Utc>>,
    pub target: String,
    pub task: String,
}

/// Every schedule stored in the task stream.
pub async fn list(conn: &Conn) -> anyhow::Result<Vec<ScheduleInfo>> {
    let names = &conn.names;
    let tasks = conn.stream(&names.tasks_stream).await?;
    let filter = format!("{}.>", names.schedules_prefix);
    let mut subjects: Vec<String> = tasks
        .info_with_subjects(&filter)
        .await
        .context("cannot list schedule subjects")?
        .map_ok(|(s, _)| s)
        .try_collect()
        .await
        .context("cannot list schedule subjects")?;
    subjects.sort();
    let now = Utc::now();
    let mut out = Vec::new();
    for subject in subjects {
        let Ok(m) = tasks.get_last_raw_message_by_subject(&subject).await else {
            continue; // fired (@at) or removed meanwhile
        };
        let h = Some(&m.headers);
        let Some(raw) = header(h, NATS_SCHEDULE.as_ref()) else {
            continue; // not a schedule
        };
        let tz = header(h, NATS_SCHEDULE_TIME_ZONE.as_ref());
        let created = output::chrono_time(m.time);
        let next = Spec::from_header(&raw, tz.clone()).and_then(|s| s.next_after(now, created));
        let name = subject
            .strip_prefix(&format!("{}.", names.schedules_prefix))
            .unwrap_or(&subject)
            .to_string();
        out.push(ScheduleInfo {
            name,
            spec: raw,
            time_zone: tz,
            next,
            target: header(h, NATS_SCHEDULE_TARGET.as_ref()).unwrap_or_default(),
            task: String::from_utf8_lossy(&m.payload).into_owned(),
        });
    }
    Ok(out)
}

async fn ls(ctx: &super::Ctx, json: bool) -> anyhow::Result<Exit> {
    let conn = Conn::open(ctx).await?;
    let all = list(&conn).await?;
    if json {
        for s in &all {
            output::json_line(s)?;
        }
        return Ok(Exit::Ok);
    }
    if all.is_empty() {
        output::line("no schedules")?;
        return Ok(Exit::Ok);
    }
    let mut t = Table::new(
        &["NAME", "SPEC", "TZ", "NEXT", "TARGET", "TASK"],
        colour_enabled(),
    );
    for s in &all {
        t.push(vec![
            s.name.clone(),
            s.spec.clone(),
            s.time_zone.clone().unwrap_or_else(|| "UTC".into()),
            s.next.map(output::timestamp).unwrap_or_else(|| "-".into()),
            s.target.clone(),
            output::truncate(&s.task, 60),
        ]);
    }
    t.print()?;
    Ok(Exit::Ok)
}

async fn rm(ctx: &super::Ctx, a: RmArgs, json: bool) -> anyhow::Result<Exit> {
    let delayed = a
        .name
        .split_once('.')
        .is_some_and(|(t, id)| t == DELAYED_TOKEN && valid_id(id));
    if !valid_label(&a.name) && !delayed {
        bail!(
            "schedule name `{}` is not [A-Za-z0-9_-]{{1,64}} (or {DELAYED_TOKEN}.<id> for a delayed task)",
            a.name
        );
    }
    let conn = Conn::open(ctx).await?;
    let tasks = conn.stream(&conn.names.tasks_stream).await?;
    let subject = conn.names.schedule_subject(&a.name);
    let r = tasks
        .purge()
        .filter(&subject)
        .await
        .with_context(|| format!("cannot remove schedule {}", a.name))?;
    if r.purged == 0 {
        bail!("no schedule named {}", a.name);
    }
    if json {
        output::json_line(&serde_json::json!({"name": a.name, "removed": true}))?;
    } else {
        output::line(&format!("removed schedule {}", a.name))?;
    }
    Ok(Exit::Ok)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cron_specs() {
        assert!(parse_cron("*/3 * * * * *").is_ok());
        assert!(parse_cron("0 */5 * * * *").is_ok());
        assert!(parse_cron("@daily").is_ok());
        assert!(
            parse_cron("*/5 * * * *").is_err(),
            "5 fields reach the parser as 6"
        );
        assert_eq!(server_cron(" */5  * * * * "), "0 */5 * * * *");
        assert_eq!(server_cron("*/3 * * * * *"), "*/3 * * * * *");
        assert_eq!(server_cron("@daily"), "@daily");
        assert!(parse_cron("61 * * * * *").is_err());
        assert!(parse_cron("@every 5s").is_err());
    }

    #[test]
    fn go_durations() {
        assert_eq!(go_duration(Duration::from_secs(30)), "30s");
        assert_eq!(go_duration(Duration::from_secs(3723)), "1h2m3s");
        assert_eq!(go_duration(Duration::from_secs(3600)), "1h");
        assert_eq!(go_duration(Duration::from_millis(1500)), "1500ms");
        assert_eq!(parse_go_duration("1h2m3s"), Some(Duration::from_secs(3723)));
    }

    #[test]
    fn next_fire_times() {
        let now = DateTime::parse_from_rfc3339("2026-01-02T03:04:05Z")
            .unwrap()
            .with_timezone(&Utc);
        let s = Spec::from_header("0 0 * * * *", None).unwrap();
        assert_eq!(
            s.next_after(now, now).unwrap().to_rfc3339(),
            "2026-01-02T04:00:00+00:00"
        );
        let s = Spec::from_header("0 0 9 * * *", Some("Europe/Paris".into())).unwrap();
        assert_eq!(
            s.next_after(now, now).unwrap().to_rfc3339(),
            "2026-01-02T08:00:00+00:00"
        );
        let s = Spec::from_header("@every 30s", None).unwrap();
        let created = now - chrono::Duration::seconds(45);
        assert_eq!(
            s.next_after(now, created),
            Some(now + chrono::Duration::seconds(15))
        );
        let s = Spec::from_header("@at 2026-01-02T03:05:00Z", None).unwrap();
        assert_eq!(s.header(), "@at 2026-01-02T03:05:00Z");
    }
}
