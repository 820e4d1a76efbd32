//! The tasks running on this worker, by id. Registering returns a
//! [`Guard`] whose `Drop` unregisters, so no path through the lifecycle can
//! leave an id registered; a second delivery of a registered id sees who
//! holds it and what message it came from.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};

use prometheus_client::metrics::gauge::Gauge;
use tokio_util::sync::CancellationToken;

use crate::runner::{Stop, StopKind};

/// One registered task.
#[derive(Clone)]
struct Slot {
    /// TASKS stream sequence of the message being run.
    task_seq: u64,
    /// The label it came from (heartbeats count running tasks per label).
    label: String,
    stop: Stop,
    /// Cancelled when the guard drops.
    finished: CancellationToken,
}

/// The registry.
pub(crate) struct Running {
    map: Mutex<HashMap<String, Slot>>,
    gauge: Gauge,
}

/// Someone else holds the id.
pub(crate) struct Busy {
    /// The holder runs the very same message: this delivery is a
    /// redelivery after the holder's lease was lost.
    pub same_message: bool,
    pub stop: Stop,
    pub finished: CancellationToken,
}

/// Holds an id registered until dropped.
pub(crate) struct Guard {
    reg: Arc<Running>,
    id: String,
    finished: CancellationToken,
}

impl Drop for Guard {
    fn drop(&mut self) {
        let mut m = self.reg.map.lock().unwrap();
        m.remove(&self.id);
        self.reg.gauge.set(m.len() as i64);
        self.finished.cancel();
    }
}

impl Running {
    pub(crate) fn new(gauge: Gauge) -> Arc<Self> {
        Arc::new(Running {
            map: Mutex::new(HashMap::new()),
            gauge,
        })
    }

    /// Register `id` of `label` for the message `task_seq`, stopped
    /// through `stop`.
    pub(crate) fn register(
        self: &Arc<Self>,
        id: &str,
        label: &str,
        task_seq: u64,
        stop: Stop,
    ) -> Result<Guard, Busy> {
        let mut m = self.map.lock().unwrap();
        if let Some(s) = m.get(id) {
            return Err(Busy {
                same_message: s.task_seq == task_seq,
                stop: s.stop.clone(),
                finished: s.finished.clone(),
            });
        }
        let finished = CancellationToken::new();
        m.insert(
            id.to_string(),
            Slot {
                task_seq,
                label: label.to_string(),
                stop,
                finished: finished.clone(),
            },
        );
        self.gauge.set(m.len() as i64);
        Ok(Guard {
            reg: self.clone(),
            id: id.to_string(),
            finished,
        })
    }

    /// Stop one task (cancel); false if it does not run here.
    pub(crate) fn stop(&self, id: &str, kind: StopKind, reason: &str) -> bool {
        match self.map.lock().unwrap().get(id) {
            Some(s) => {
                s.stop.fire(kind, reason);
                true
            }
            None => false,
        }
    }

    /// Stop every task (shutdown); how many there were.
    pub(crate) fn stop_all(&self, kind: StopKind, reason: &str) -> usize {
        let m = self.map.lock().unwrap();
        for s in m.values() {
            s.stop.fire(kind, reason);
        }
        m.len()
    }

    /// The ids running now, sorted, and how many of them came from each
    /// label: read under one lock, so the two always agree.
    pub(crate) fn snapshot(&self) -> (Vec<String>, BTreeMap<String, usize>) {
        let m = self.map.lock().unwrap();
        let mut per_label = BTreeMap::new();
        for s in m.values() {
            *per_label.entry(s.label.clone()).or_insert(0) += 1;
        }
        let mut ids: Vec<String> = m.keys().cloned().collect();
        ids.sort();
        (ids, per_label)
    }

    /// How many run now.
    pub(crate) fn len(&self) -> usize {
        self.map.lock().unwrap().len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn guard_unregisters_and_signals() {
        let r = Running::new(Gauge::default());
        let g = r.register("a", "l1", 1, Stop::new()).ok().unwrap();
        let busy = r.register("a", "l1", 1, Stop::new()).err().unwrap();
        assert!(busy.same_message);
        assert!(
            !r.register("a", "l1", 2, Stop::new())
                .err()
                .unwrap()
                .same_message
        );
        let g2 = r.register("b", "l2", 3, Stop::new()).ok().unwrap();
        let _g3 = r.register("c", "l2", 4, Stop::new()).ok().unwrap();
        assert_eq!(
            r.snapshot(),
            (
                vec!["a".to_string(), "b".into(), "c".into()],
                BTreeMap::from([("l1".to_string(), 1), ("l2".to_string(), 2)])
            )
        );
        drop(g);
        drop(g2);
        assert!(busy.finished.is_cancelled());
        assert_eq!(
            r.snapshot(),
            (
                vec!["c".to_string()],
                BTreeMap::from([("l2".to_string(), 1)])
            )
        );
        assert_eq!(r.len(), 1);
        assert!(r.register("a", "l1", 2, Stop::new()).is_ok());
    }
}
