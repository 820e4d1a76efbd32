//! Whether the worker is ready (`/readyz`, systemd `READY=1`) and alive
//! (systemd `WATCHDOG=1`), worked out in one place (DESIGN.md section 7,
//! "Readiness").
//!
//! **Ready** means connected and pulling: the client holds a connection
//! (its event callback said so), and every label's puller has had its last
//! pull request *answered by the server* on that connection — a message or
//! the server's end of the request. Sending a pull proves nothing: on a
//! silently dropped link the request goes into the socket, and the client
//! ends the batch by its own timer a few seconds later as if the server had
//! said "nothing there". That is why `/readyz` used to stay 200 until the
//! keepalive gave the link up (up to 3 × ack_wait / 4). A puller whose
//! slots are all busy does not pull; it counts as pulling while the last
//! heartbeat was stored on the current connection.
//!
//! **Alive** means the heartbeat loop goes round: it ticks every interval
//! whether its puts succeed or not, and it takes the locks the task
//! lifecycle takes, so a wedged worker stops ticking. Losing NATS does not
//! make a worker dead — a restart would not bring the broker back and would
//! kill the running tasks — only not ready.
//!
//! systemd (`Type=notify`): `READY=1` the first time the worker is ready,
//! `WATCHDOG=1` every half `WATCHDOG_USEC` while it is alive, `STOPPING=1`
//! when it starts to drain. Each is a no-op without `NOTIFY_SOCKET`.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use sd_notify::NotifyState;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use crate::metrics::Metrics;

/// Where one label's puller stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Pull {
    /// Its last pull failed or got no answer from the server.
    Failing,
    /// Every slot is busy: it waits for one and does not pull.
    Busy,
    /// The server answered its last pull on connection number `n`.
    Answered(u64),
}

/// Connection and readiness state, fed by the client's event callback, the
/// pullers and the heartbeat loop.
pub struct ConnState {
    connected: AtomicBool,
    /// Connections so far: bumped at each (re)connect, so that an answer on
    /// an earlier connection does not count.
    generation: AtomicU64,
    pulls: Mutex<HashMap<String, Pull>>,
    /// The connection on which the last heartbeat was stored (0: failing).
    beat_on: AtomicU64,
    /// When the heartbeat loop last went round.
    beat_tick: Mutex<Instant>,
    stopping: AtomicBool,
    ready_sent: AtomicBool,
    metrics: Arc<Metrics>,
}

impl ConnState {
    pub(crate) fn new(metrics: Arc<Metrics>) -> Self {
        ConnState {
            connected: AtomicBool::new(false),
            generation: AtomicU64::new(0),
            pulls: Mutex::new(HashMap::new()),
            beat_on: AtomicU64::new(0),
            beat_tick: Mutex::new(Instant::now()),
            stopping: AtomicBool::new(false),
            ready_sent: AtomicBool::new(false),
            metrics,
        }
    }

    pub(crate) fn on_event(&self, e: &async_nats::Event) {
        match e {
            async_nats::Event::Connected => {
                // The first connection is counted by set_connected at
                // start-up; every Connected event after it is a reconnect.
                if self.generation.fetch_add(1, Ordering::SeqCst) > 0 {
                    self.metrics.reconnects.inc();
                }
                self.connected.store(true, Ordering::SeqCst);
                self.metrics.connected.set(1);
                info!("connected to NATS");
            }
            async_nats::Event::Disconnected => {
                self.connected.store(false, Ordering::SeqCst);
                self.metrics.connected.set(0);
                warn!("disconnected from NATS; reconnecting");
            }
            other => debug!(event = %other, "NATS event"),
        }
        self.update();
    }

    /// Connected, as the start-up sees it before any event arrives.
    pub(crate) fn set_connected(&self) {
        self.connected.store(true, Ordering::SeqCst);
        self.metrics.connected.set(1);
    }

    pub fn is_connected(&self) -> bool {
        self.connected.load(Ordering::SeqCst)
    }

    /// The connection number now (to stamp an answer with).
    pub(crate) fn generation(&self) -> u64 {
        self.generation.load(Ordering::SeqCst)
    }

    /// Record where a label's puller stands.
    pub(crate) fn pull(&self, label: &str, p: Pull) {
        self.pulls.lock().unwrap().insert(label.to_string(), p);
        self.update();
    }

    /// Record a heartbeat round: `stored` if the put succeeded.
    pub(crate) fn beat(&self, stored: bool) {
        *self.beat_tick.lock().unwrap() = Instant::now();
        let on = if stored { self.generation() } else { 0 };
        self.beat_on.store(on, Ordering::SeqCst);
        self.update();
    }

    /// Whether the heartbeat loop went round within `within`.
    pub(crate) fn alive(&self, within: Duration) -> bool {
        self.beat_tick.lock().unwrap().elapsed() <= within
    }

    /// The worker drains: not ready any more, whatever happens next.
    pub(crate) fn stop(&self) {
        self.stopping.store(true, Ordering::SeqCst);
        self.update();
        notify(&[NotifyState::Stopping, NotifyState::Status("draining")]);
    }

    fn is_ready(&self) -> bool {
        if self.stopping.load(Ordering::SeqCst) || !self.is_connected() {
            return false;
        }
        let now = self.generation();
        let beat_ok = self.beat_on.load(Ordering::SeqCst) == now;
        let pulls = self.pulls.lock().unwrap();
        !pulls.is_empty()
            && pulls.values().all(|p| match p {
                Pull::Answered(n) => *n == now,
                Pull::Busy => beat_ok,
                Pull::Failing => false,
            })
    }

    /// Work the state out again and publish it.
    fn update(&self) {
        let ready = self.is_ready();
        self.metrics.ready.store(ready, Ordering::Relaxed);
        if ready && !self.ready_sent.swap(true, Ordering::SeqCst) {
            notify(&[NotifyState::Ready, NotifyState::Status("ready: pulling")]);
        }
    }
}

/// Send to systemd's notification socket; nothing without `NOTIFY_SOCKET`.
fn notify(state: &[NotifyState]) {
    if let Err(e) = sd_notify::notify(state) {
        debug!("cannot notify systemd: {e}");
    }
}

/// Ping systemd's watchdog every half `WATCHDOG_USEC`, from `READY=1` on,
/// while the worker is alive (its heartbeat loop went round within `alive_within`), until
/// `stop`. Returns at once when no watchdog is asked for.
pub(crate) async fn watchdog(
    conn: Arc<ConnState>,
    alive_within: Duration,
    stop: CancellationToken,
) {
    let Some(period) = sd_notify::watchdog_enabled() else {
        return;
    };
    let mut tick = tokio::time::interval((period / 2).max(Duration::from_millis(100)));
    let mut silent = false;
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tick.tick() => {}
        }
        // systemd arms the watchdog at READY=1; nothing to say before.
        if !conn.ready_sent.load(Ordering::SeqCst) {
            continue;
        }
        if conn.alive(alive_within) {
            notify(&[NotifyState::Watchdog]);
            silent = false;
        } else if !silent {
            warn!("the heartbeat loop is stuck; no watchdog ping (systemd restarts the worker)");
            silent = true;
        }
    }
}
