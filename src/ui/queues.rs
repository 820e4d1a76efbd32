//! The queues view's rows: [`crate::queues::queue_stats`] (the numbers
//! `jetworker queues` prints), one JSON object per label.

use super::hub::QueueRow;
use crate::commands::common::Conn;

/// Every label's queue, keyed by label.
pub(crate) async fn rows(conn: &Conn) -> anyhow::Result<Vec<(String, QueueRow)>> {
    let stats = crate::queues::queue_stats(&conn.js, &conn.names, None).await?;
    Ok(stats
        .into_iter()
        .map(|s| {
            let mut row = serde_json::to_value(&s).unwrap_or_default();
            // Changes at every poll: it would make every row news.
            if let Some(o) = row.as_object_mut() {
                o.remove("read_at");
            }
            (s.label, row)
        })
        .collect())
}
