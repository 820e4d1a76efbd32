//! `jetworker workers`: the online workers, read from their heartbeats in
//! KV `workers` (a worker is online while its key exists). `--watch` then
//! prints each transition as it happens: `online` for a new key,
//! `offline (stopped)` for a deleted one (clean shutdown) and
//! `offline (expired)` for the limit marker the bucket leaves when a
//! worker stops beating (DESIGN.md section 6).
//!
//! `--json`: the heartbeat values, one per line. With `--watch`, one shape
//! only: events `{"event":"online"|"offline","worker":…,"time":…,
//! "reason":…,"heartbeat":…}` one per line, the workers already online
//! first (as `online` events). Once the watch is subscribed, `--watch`
//! prints `jetworker: ready: watching workers` on stderr.

use std::collections::BTreeSet;

use anyhow::Context as _;
use async_nats::jetstream::kv::{self, Operation};
use chrono::Utc;
use clap::Args;
use futures::StreamExt;
use serde::Serialize;

use super::common::Conn;
use super::output::{self, colour_enabled, Table};
use super::Exit;
use crate::protocol::Heartbeat;

#[derive(Debug, Clone, Args)]
pub struct WorkersArgs {
    /// Keep running and print workers coming online and going offline.
    #[arg(long, short = 'w')]
    pub watch: bool,
    /// Print JSON lines instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// A `--watch --json` event.
#[derive(Serialize)]
struct Event<'a> {
    event: &'a str,
    worker: &'a str,
    time: chrono::DateTime<Utc>,
    #[serde(skip_serializing_if = "Option::is_none")]
    reason: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    heartbeat: Option<&'a Heartbeat>,
}

/// The workers bucket, with a clear error when no worker ever ran.
async fn bucket(conn: &Conn) -> anyhow::Result<kv::Store> {
    conn.js
        .get_key_value(&conn.names.workers_bucket)
        .await
        .map_err(|_| {
            anyhow::anyhow!(
                "KV bucket {} does not exist yet (start a worker or run `jetworker setup`)",
                conn.names.workers_bucket
            )
        })
}

fn join<T: ToString>(v: &[T]) -> String {
    v.iter().map(T::to_string).collect::<Vec<_>>().join(",")
}

pub async fn run(ctx: &super::Ctx, args: WorkersArgs) -> anyhow::Result<Exit> {
    let conn = Conn::open(ctx).await?;
    let store = bucket(&conn).await?;
    // Watch first, then list: nothing that happens in between is missed.
    let mut watch = if args.watch {
        Some(store.watch_all().await.context("cannot watch workers")?)
    } else {
        None
    };
    let all = crate::queues::online_workers(&store).await?;
    let colour = colour_enabled();
    if args.json && args.watch {
        for hb in &all {
            print_event("online", &hb.id, None, Some(hb), hb.seen_at, true, colour)?;
        }
    } else if args.json {
        for hb in &all {
            output::json_line(hb)?;
        }
    } else if all.is_empty() {
        output::line("no workers online")?;
    } else {
        let now = Utc::now();
        let mut t = Table::new(
            &[
                "ID", "HOST", "LABELS", "TYPES", "SLOTS", "RUNNING", "SEEN", "VERSION",
            ],
            colour,
        );
        for hb in &all {
            t.push(vec![
                hb.id.clone(),
                hb.hostname.clone(),
                join(&hb.labels),
                join(&hb.types),
                hb.slots.to_string(),
                hb.running.to_string(),
                output::ago(hb.seen_at, now),
                hb.version.clone(),
            ]);
        }
        t.print()?;
    }
    let Some(watch) = watch.as_mut() else {
        return Ok(Exit::Ok);
    };
    output::ready("watching workers")?;
    let mut online: BTreeSet<String> = all.iter().map(|h| h.id.clone()).collect();
    while let Some(e) = watch.next().await {
        let e = e.context("watching workers")?;
        let time = output::chrono_time(e.created);
        match e.operation {
            Operation::Put => {
                if online.insert(e.key.clone()) {
                    let hb = serde_json::from_slice::<Heartbeat>(&e.value).ok();
                    print_event("online", &e.key, None, hb.as_ref(), time, args.json, colour)?;
                }
            }
            Operation::Delete | Operation::Purge => {
                online.remove(&e.key);
                let reason = if e.operation == Operation::Delete {
                    "stopped"
                } else {
                    "expired: no heartbeat"
                };
                print_event(
                    "offline",
                    &e.key,
                    Some(reason),
                    None,
                    time,
                    args.json,
                    colour,
                )?;
            }
        }
    }
    Ok(Exit::Ok)
}

fn print_event(
    event: &str,
    worker: &str,
    reason: Option<&str>,
    heartbeat: Option<&Heartbeat>,
    time: chrono::DateTime<Utc>,
    json: bool,
    colour: bool,
) -> anyhow::Result<()> {
    if json {
        return output::json_line(&Event {
            event,
            worker,
            time,
            reason,
            heartbeat,
        });
    }
    let word = match (event, colour) {
        ("online", true) => "\x1b[32monline\x1b[0m ".to_string(),
        ("offline", true) => "\x1b[31moffline\x1b[0m".to_string(),
        (e, _) => format!("{e:<7}"),
    };
    let mut line = format!("{} {word} {worker}", output::timestamp(time));
    if let Some(hb) = heartbeat {
        line.push_str(&format!(
            " (labels {}, {} slots, {})",
            join(&hb.labels),
            hb.slots,
            hb.hostname
        ));
    }
    if let Some(r) = reason {
        line.push_str(&format!(" ({r})"));
    }
    output::line(&line)?;
    Ok(())
}
