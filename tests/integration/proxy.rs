//! A TCP fault proxy for the harness (issue 8): it sits between a worker and
//! nats-server on loopback and, switched at runtime by the test, either
//! passes traffic, cuts it (closes both sides of every connection and
//! closes new ones at once), or blackholes it (holds every byte in both
//! directions without closing anything, as a silently dropped link does;
//! new connections are accepted but get nothing). Switching back to `pass`
//! releases what a blackhole held, in order, as TCP retransmission would.
//!
//! Plain threads, not tokio tasks: the proxy keeps working whatever runtime
//! (or none) the test uses, and its `Drop` stops it synchronously.

#![allow(dead_code)]

use std::collections::HashMap;
use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

/// What the proxy does with traffic.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Forward both ways.
    Pass,
    /// Close both sides of every connection; close new ones at once.
    Cut,
    /// Forward nothing and close nothing.
    Blackhole,
}

/// How often an idle pump or the acceptor looks at the mode.
const POLL: Duration = Duration::from_millis(20);

struct State {
    mode: Mutex<Mode>,
    stop: AtomicBool,
    /// Both sockets of each live connection, to close them on a cut.
    conns: Mutex<HashMap<u64, (TcpStream, TcpStream)>>,
    next_id: AtomicU64,
    /// Connections accepted so far (cut ones included).
    accepted: AtomicU64,
}

impl State {
    fn mode(&self) -> Mode {
        *self.mode.lock().unwrap()
    }

    fn close(&self, id: u64) {
        if let Some((a, b)) = self.conns.lock().unwrap().remove(&id) {
            let _ = a.shutdown(Shutdown::Both);
            let _ = b.shutdown(Shutdown::Both);
        }
    }

    fn close_all(&self) {
        for (_, (a, b)) in self.conns.lock().unwrap().drain() {
            let _ = a.shutdown(Shutdown::Both);
            let _ = b.shutdown(Shutdown::Both);
        }
    }
}

/// A running proxy from `127.0.0.1:<port>` to one upstream port.
pub struct Proxy {
    addr: SocketAddr,
    state: Arc<State>,
    acceptor: Option<JoinHandle<()>>,
}

impl Proxy {
    /// Listen on a free loopback port and forward to `127.0.0.1:upstream`.
    pub fn start(upstream: u16) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        listener.set_nonblocking(true).unwrap();
        let addr = listener.local_addr().unwrap();
        let state = Arc::new(State {
            mode: Mutex::new(Mode::Pass),
            stop: AtomicBool::new(false),
            conns: Mutex::new(HashMap::new()),
            next_id: AtomicU64::new(0),
            accepted: AtomicU64::new(0),
        });
        let st = state.clone();
        let acceptor = std::thread::spawn(move || accept_loop(listener, upstream, st));
        Proxy {
            addr,
            state,
            acceptor: Some(acceptor),
        }
    }

    /// The URL a worker connects to.
    pub fn url(&self) -> String {
        format!("nats://{}", self.addr)
    }

    pub fn mode(&self) -> Mode {
        self.state.mode()
    }

    pub fn set(&self, mode: Mode) {
        *self.state.mode.lock().unwrap() = mode;
        if mode == Mode::Cut {
            self.state.close_all();
        }
    }

    pub fn pass(&self) {
        self.set(Mode::Pass)
    }

    pub fn cut(&self) {
        self.set(Mode::Cut)
    }

    pub fn blackhole(&self) {
        self.set(Mode::Blackhole)
    }

    /// Connections open through the proxy now.
    pub fn open_connections(&self) -> usize {
        self.state.conns.lock().unwrap().len()
    }

    /// Connections accepted since the start.
    pub fn accepted(&self) -> u64 {
        self.state.accepted.load(Ordering::SeqCst)
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.state.stop.store(true, Ordering::SeqCst);
        self.state.close_all();
        if let Some(a) = self.acceptor.take() {
            let _ = a.join();
        }
    }
}

fn accept_loop(listener: TcpListener, upstream: u16, st: Arc<State>) {
    while !st.stop.load(Ordering::SeqCst) {
        let client = match listener.accept() {
            Ok((c, _)) => c,
            Err(e) if e.kind() == ErrorKind::WouldBlock => {
                std::thread::sleep(POLL);
                continue;
            }
            Err(_) => {
                std::thread::sleep(POLL);
                continue;
            }
        };
        st.accepted.fetch_add(1, Ordering::SeqCst);
        if st.mode() == Mode::Cut {
            let _ = client.shutdown(Shutdown::Both);
            continue;
        }
        let _ = client.set_nonblocking(false);
        let Ok(server) = TcpStream::connect(("127.0.0.1", upstream)) else {
            // Upstream down (a server restart): the client sees a closed
            // connection, as it would without the proxy.
            let _ = client.shutdown(Shutdown::Both);
            continue;
        };
        let _ = client.set_nodelay(true);
        let _ = server.set_nodelay(true);
        let id = st.next_id.fetch_add(1, Ordering::SeqCst);
        let (Ok(c2), Ok(s2), Ok(c3), Ok(s3)) = (
            client.try_clone(),
            server.try_clone(),
            client.try_clone(),
            server.try_clone(),
        ) else {
            continue;
        };
        st.conns.lock().unwrap().insert(id, (c3, s3));
        // A cut that raced with this accept must still close it.
        if st.mode() == Mode::Cut {
            st.close(id);
            continue;
        }
        let st1 = st.clone();
        std::thread::spawn(move || pump(client, s2, id, st1));
        let st2 = st.clone();
        std::thread::spawn(move || pump(server, c2, id, st2));
    }
}

/// Copy `from` → `to` while the mode allows; end (closing both sides) on
/// EOF, an error, a cut or the proxy's drop.
/// Hold still while blackholed (nothing read, nothing closed); false once
/// the link is cut or the proxy stops.
fn hold_while_blackholed(st: &State) -> bool {
    loop {
        if st.stop.load(Ordering::SeqCst) {
            return false;
        }
        match st.mode() {
            Mode::Pass => return true,
            Mode::Cut => return false,
            Mode::Blackhole => std::thread::sleep(POLL),
        }
    }
}

fn pump(mut from: TcpStream, mut to: TcpStream, id: u64, st: Arc<State>) {
    let _ = from.set_read_timeout(Some(POLL));
    let mut buf = vec![0u8; 64 * 1024];
    'outer: loop {
        // Hold still while blackholed: nothing read, nothing closed.
        if !hold_while_blackholed(&st) {
            break 'outer;
        }
        let n = match from.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => continue,
            Err(_) => break,
        };
        // Bytes read just before a blackhole wait for the link to return.
        if !hold_while_blackholed(&st) {
            break 'outer;
        }
        if to.write_all(&buf[..n]).is_err() {
            break;
        }
    }
    st.close(id);
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;

    /// An echo server on loopback for the proxy's own tests.
    fn echo_server() -> u16 {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        std::thread::spawn(move || {
            for s in l.incoming().flatten() {
                std::thread::spawn(move || {
                    let mut s = s;
                    let mut buf = [0u8; 1024];
                    while let Ok(n) = s.read(&mut buf) {
                        if n == 0 || s.write_all(&buf[..n]).is_err() {
                            break;
                        }
                    }
                });
            }
        });
        port
    }

    fn connect(p: &Proxy) -> TcpStream {
        let s = TcpStream::connect(p.addr).unwrap();
        s.set_read_timeout(Some(Duration::from_millis(300)))
            .unwrap();
        s
    }

    fn echo(s: &mut TcpStream, what: &[u8]) -> std::io::Result<Vec<u8>> {
        s.write_all(what)?;
        let mut got = vec![0u8; what.len()];
        s.read_exact(&mut got)?;
        Ok(got)
    }

    /// Whether the peer closes `s` within 5 s.
    fn closed_soon(s: &mut TcpStream) -> bool {
        let t0 = Instant::now();
        let mut buf = [0u8; 16];
        while t0.elapsed() < Duration::from_secs(5) {
            match s.read(&mut buf) {
                Ok(0) => return true,
                Ok(_) => return false,
                Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
                Err(_) => return true,
            }
        }
        false
    }

    #[test]
    fn pass_cut_blackhole() {
        let p = Proxy::start(echo_server());
        let mut a = connect(&p);
        assert_eq!(echo(&mut a, b"hello").unwrap(), b"hello");

        // Blackhole: nothing comes back, nothing is closed.
        p.blackhole();
        a.write_all(b"held").unwrap();
        let mut buf = [0u8; 4];
        let e = a.read(&mut buf).unwrap_err();
        assert!(matches!(
            e.kind(),
            ErrorKind::WouldBlock | ErrorKind::TimedOut
        ));
        let mut b = connect(&p);
        b.write_all(b"x").unwrap();
        assert!(b.read(&mut buf).is_err(), "a new connection gets nothing");
        // Back to pass: the held bytes arrive, in order.
        p.pass();
        a.read_exact(&mut buf).unwrap();
        assert_eq!(&buf, b"held");
        assert_eq!(echo(&mut a, b"again").unwrap(), b"again");

        // Cut: the open connection is closed, new ones too.
        p.cut();
        assert!(closed_soon(&mut a), "cut closes the open connection");
        let mut c = connect(&p);
        let _ = c.write_all(b"x");
        assert!(closed_soon(&mut c), "a new connection is closed");
        assert_eq!(p.open_connections(), 0);
        p.pass();
        let mut d = connect(&p);
        assert_eq!(echo(&mut d, b"back").unwrap(), b"back");
    }
}
