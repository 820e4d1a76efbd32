//! Output helpers shared by the operator subcommands: aligned tables,
//! colour (only when stdout is a terminal and `NO_COLOR` is unset), JSON
//! lines for `--json`, and short human forms of times, durations and
//! output snippets.
//!
//! Every listing command's `--json` prints **one JSON object per line**
//! (JSON Lines), never an array: the same format works for a one-shot list
//! and for `--follow`/`--watch`, and `jq -c`/`while read` consume it as it
//! streams.

use std::io::{IsTerminal, Write};
use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::Serialize;

use crate::protocol::Status;

/// Whether to colour stdout: a terminal, and `NO_COLOR` not set.
pub fn colour_enabled() -> bool {
    std::io::stdout().is_terminal() && std::env::var_os("NO_COLOR").is_none()
}

/// A status word, coloured when `colour` is on: green for success, red for
/// the failures, yellow for the outcomes nobody ran to the end.
pub fn status_text(s: Status, colour: bool) -> String {
    if !colour {
        return s.to_string();
    }
    let code = match s {
        Status::Success => "32",
        Status::Failed | Status::Timeout | Status::Dead => "31",
        _ => "33",
    };
    format!("\x1b[{code}m{s}\x1b[0m")
}

/// Bold header text when `colour` is on.
pub fn bold(s: &str, colour: bool) -> String {
    if colour {
        format!("\x1b[1m{s}\x1b[0m")
    } else {
        s.to_string()
    }
}

/// Display width of `s`, ignoring ANSI colour sequences (so coloured cells
/// line up with plain ones).
fn visible_width(s: &str) -> usize {
    let mut n = 0;
    let mut in_escape = false;
    for c in s.chars() {
        if in_escape {
            if c == 'm' {
                in_escape = false;
            }
        } else if c == '\x1b' {
            in_escape = true;
        } else {
            n += 1;
        }
    }
    n
}

/// A table of text cells, printed with columns padded to the widest cell.
/// The last column is not padded, so long free text (an output line) does
/// not push trailing spaces.
pub struct Table {
    headers: Vec<String>,
    rows: Vec<Vec<String>>,
    colour: bool,
}

impl Table {
    pub fn new(headers: &[&str], colour: bool) -> Self {
        Table {
            headers: headers.iter().map(|h| h.to_string()).collect(),
            rows: Vec::new(),
            colour,
        }
    }

    pub fn push(&mut self, row: Vec<String>) {
        self.rows.push(row);
    }

    /// Column widths over the header and every row.
    pub fn widths(&self) -> Vec<usize> {
        let mut w: Vec<usize> = self.headers.iter().map(|h| visible_width(h)).collect();
        for r in &self.rows {
            for (i, c) in r.iter().enumerate() {
                if i < w.len() {
                    w[i] = w[i].max(visible_width(c));
                }
            }
        }
        w
    }

    /// The table as text, header first.
    pub fn render(&self) -> String {
        let w = self.widths();
        let mut out = String::new();
        let header = format_row(&self.headers, &w);
        out.push_str(&bold(&header, self.colour));
        out.push('\n');
        for r in &self.rows {
            out.push_str(&format_row(r, &w));
            out.push('\n');
        }
        out
    }

    /// Print to stdout.
    pub fn print(&self) -> std::io::Result<()> {
        let mut o = std::io::stdout().lock();
        o.write_all(self.render().as_bytes())?;
        o.flush()
    }
}

/// One row padded to `widths` (two spaces between columns).
pub fn format_row(cells: &[String], widths: &[usize]) -> String {
    let mut line = String::new();
    for (i, c) in cells.iter().enumerate() {
        if i > 0 {
            line.push_str("  ");
        }
        line.push_str(c);
        if i + 1 < cells.len() {
            let pad = widths.get(i).copied().unwrap_or(0);
            let have = visible_width(c);
            if pad > have {
                line.push_str(&" ".repeat(pad - have));
            }
        }
    }
    line.trim_end().to_string()
}

/// A progress bar on stderr, `⠋ 3/50 <what> [00:00:04] ▇▇▇   <msg>`;
/// indicatif hides it when stderr is not a terminal.
pub fn progress(len: u64, what: &str) -> indicatif::ProgressBar {
    let b = indicatif::ProgressBar::new(len);
    b.set_style(
        indicatif::ProgressStyle::with_template(&format!(
            "{{spinner}} {{pos}}/{{len}} {what} [{{elapsed_precise}}] {{wide_bar}} {{msg}}"
        ))
        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    b.enable_steady_tick(std::time::Duration::from_millis(200));
    b
}

/// Print one value as a JSON line on stdout.
pub fn json_line<T: Serialize>(v: &T) -> anyhow::Result<()> {
    let mut o = std::io::stdout().lock();
    serde_json::to_writer(&mut o, v)?;
    o.write_all(b"\n")?;
    o.flush()?;
    Ok(())
}

/// Print a line on stdout, flushing (followers must show lines at once).
pub fn line(s: &str) -> std::io::Result<()> {
    let mut o = std::io::stdout().lock();
    o.write_all(s.as_bytes())?;
    o.write_all(b"\n")?;
    o.flush()
}

/// Tell a watcher (a person, a test, a script) on stderr that a follow or
/// watch is subscribed: whatever is published from now on will be shown.
/// One line, `jetworker: ready: <what>`, printed once.
pub fn ready(what: &str) -> std::io::Result<()> {
    let mut e = std::io::stderr().lock();
    writeln!(e, "jetworker: ready: {what}")?;
    e.flush()
}

/// Ask before a destructive step: with `force`, go ahead; on a terminal,
/// ask `question` (y/N); elsewhere refuse, naming `--force`, so that a
/// script never deletes by accident.
pub fn confirm(question: &str, force: bool) -> anyhow::Result<()> {
    use std::io::{BufRead, IsTerminal};
    if force {
        return Ok(());
    }
    if !std::io::stdin().is_terminal() {
        anyhow::bail!("{question} Refusing without --force (stdin is not a terminal to ask)");
    }
    let mut e = std::io::stderr().lock();
    write!(e, "{question} [y/N] ")?;
    e.flush()?;
    let mut answer = String::new();
    std::io::stdin().lock().read_line(&mut answer)?;
    match answer.trim().to_ascii_lowercase().as_str() {
        "y" | "yes" => Ok(()),
        _ => anyhow::bail!("not confirmed; nothing changed"),
    }
}

/// `12ms`, `3.4s`, `2m05s`, `1h02m`: short, for a table column.
pub fn short_duration(d: Duration) -> String {
    let ms = d.as_millis();
    if ms < 1000 {
        format!("{ms}ms")
    } else if ms < 60_000 {
        format!("{:.1}s", ms as f64 / 1000.0)
    } else if ms < 3_600_000 {
        format!("{}m{:02}s", ms / 60_000, (ms / 1000) % 60)
    } else {
        format!("{}h{:02}m", ms / 3_600_000, (ms / 60_000) % 60)
    }
}

/// How long ago `t` was, as `5s ago`; `now` for the future and the present.
pub fn ago(t: DateTime<Utc>, now: DateTime<Utc>) -> String {
    match (now - t).to_std() {
        Ok(d) if d >= Duration::from_secs(1) => {
            let d = Duration::from_secs(d.as_secs());
            format!("{} ago", short_duration(d).replace(".0s", "s"))
        }
        _ => "now".to_string(),
    }
}

/// A timestamp for tables: `2026-01-02 03:04:05Z`.
pub fn timestamp(t: DateTime<Utc>) -> String {
    t.format("%Y-%m-%d %H:%M:%SZ").to_string()
}

/// The first non-empty line of `s`, cut to `max` characters (with `…`).
pub fn first_line(s: &str, max: usize) -> String {
    let l = s
        .lines()
        .map(str::trim)
        .find(|l| !l.is_empty())
        .unwrap_or("");
    truncate(l, max)
}

/// `s` cut to `max` characters, control characters replaced, `…` when cut.
pub fn truncate(s: &str, max: usize) -> String {
    let clean: String = s
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect();
    if clean.chars().count() <= max {
        clean
    } else {
        let mut t: String = clean.chars().take(max.saturating_sub(1)).collect();
        t.push('…');
        t
    }
}

pub use crate::protocol::chrono_time;

/// A chrono UTC time as a JetStream (`time` crate) timestamp.
pub fn js_time(t: DateTime<Utc>) -> time::OffsetDateTime {
    time::OffsetDateTime::from_unix_timestamp_nanos(t.timestamp_nanos_opt().unwrap_or(0) as i128)
        .unwrap_or(time::OffsetDateTime::UNIX_EPOCH)
}

/// `--since`: a duration back from now (`1h`) or an RFC3339 time.
pub fn parse_since(s: &str) -> Result<DateTime<Utc>, String> {
    if let Ok(t) = DateTime::parse_from_rfc3339(s) {
        return Ok(t.with_timezone(&Utc));
    }
    let d = humantime::parse_duration(s.trim()).map_err(|_| {
        format!("`{s}` is neither a duration like 1h nor a time like 2026-01-02T03:04:05Z")
    })?;
    let d = chrono::Duration::from_std(d).map_err(|e| e.to_string())?;
    Ok(Utc::now() - d)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_aligns_and_ignores_colour() {
        let mut t = Table::new(&["ID", "STATUS", "OUT"], false);
        t.push(vec![
            "a".into(),
            status_text(Status::Success, true),
            "x".into(),
        ]);
        t.push(vec!["long-id".into(), "failed".into(), "y y".into()]);
        let s = t.render();
        let lines: Vec<&str> = s.lines().collect();
        assert_eq!(lines[0], "ID       STATUS   OUT");
        assert_eq!(lines[2], "long-id  failed   y y");
        assert_eq!(lines[1], "a        \x1b[32msuccess\x1b[0m  x");
    }

    #[test]
    fn short_forms() {
        assert_eq!(short_duration(Duration::from_millis(12)), "12ms");
        assert_eq!(short_duration(Duration::from_millis(3400)), "3.4s");
        assert_eq!(short_duration(Duration::from_secs(125)), "2m05s");
        assert_eq!(first_line("\n  hello\nworld", 10), "hello");
        assert_eq!(truncate("abcdef", 4), "abc…");
    }

    #[test]
    fn since_forms() {
        let t = parse_since("2026-01-02T03:04:05Z").unwrap();
        assert_eq!(t.timestamp(), 1767323045);
        let t = parse_since("1h").unwrap();
        assert!((Utc::now() - t).num_seconds() >= 3599);
        assert!(parse_since("yesterday").is_err());
    }

    #[test]
    fn time_conversions_round_trip() {
        let now = Utc::now();
        assert_eq!(chrono_time(js_time(now)), now);
    }
}
