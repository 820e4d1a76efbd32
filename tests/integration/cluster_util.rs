//! Test harness for a nats-server cluster: N nodes on loopback with routes
//! between them, JetStream on each with its own store, client and
//! monitoring ports chosen by the servers themselves (ports file, as for
//! [`crate::util::NatsServer`]). Helpers find the meta leader and a
//! stream's leader (from the servers' `/jsz` and the stream info), kill or
//! restart one node on its ports and store, wait for a new leader, and find
//! the node a client is connected to (`/connz`).

#![allow(dead_code)]

use std::io::{Read as _, Write as _};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use async_nats::jetstream;

use crate::util::{nats_server_bin, wait_for};

/// One node: its ports survive a restart, and so does its store.
pub struct ClusterNode {
    pub name: String,
    child: Option<Child>,
    /// Client port (0 until the first start has reported it).
    pub port: u16,
    /// Monitoring port (`/jsz`, `/connz`).
    pub http_port: u16,
    /// Route port; chosen before the start, because every node's config
    /// lists the others' routes.
    pub cluster_port: u16,
    dir: PathBuf,
}

/// A cluster of nodes `n1`..`nN`, killed on drop (stores in a temp dir).
pub struct NatsCluster {
    pub nodes: Vec<ClusterNode>,
    extra: Vec<String>,
    _dir: tempfile::TempDir,
}

/// Free loopback ports for the routes, held together so that they differ.
/// (A route port cannot come from the ports file: every node needs the
/// others' route ports in its config before it starts.)
fn free_ports(n: usize) -> Vec<u16> {
    let held: Vec<std::net::TcpListener> = (0..n)
        .map(|_| std::net::TcpListener::bind("127.0.0.1:0").unwrap())
        .collect();
    held.iter()
        .map(|l| l.local_addr().unwrap().port())
        .collect()
}

impl NatsCluster {
    /// Start `n` nodes and wait until they agree on a meta leader.
    pub async fn start(n: usize) -> Self {
        Self::start_with(n, &[]).await
    }

    /// Start with extra config lines for every node.
    pub async fn start_with(n: usize, config_lines: &[&str]) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let nodes = free_ports(n)
            .into_iter()
            .enumerate()
            .map(|(i, cluster_port)| ClusterNode {
                name: format!("n{}", i + 1),
                child: None,
                port: 0,
                http_port: 0,
                cluster_port,
                dir: dir.path().join(format!("n{}", i + 1)),
            })
            .collect();
        let mut c = NatsCluster {
            nodes,
            extra: config_lines.iter().map(|s| s.to_string()).collect(),
            _dir: dir,
        };
        for i in 0..n {
            c.launch(i);
        }
        for i in 0..n {
            c.await_listening(i);
        }
        c.wait_ready(Duration::from_secs(30)).await;
        c
    }

    /// Write node `i`'s config and start its process (without waiting).
    fn launch(&mut self, i: usize) {
        let routes: Vec<String> = self
            .nodes
            .iter()
            .enumerate()
            .filter(|(j, _)| *j != i)
            .map(|(_, n)| format!("\"nats-route://127.0.0.1:{}\"", n.cluster_port))
            .collect();
        let node = &mut self.nodes[i];
        let ports_dir = node.dir.join("ports");
        let _ = std::fs::remove_dir_all(&ports_dir);
        std::fs::create_dir_all(&ports_dir).unwrap();
        let or_random = |p: u16| {
            if p == 0 {
                "-1".to_string()
            } else {
                p.to_string()
            }
        };
        let mut text = format!(
            "server_name: {name}\nlisten: 127.0.0.1:{port}\nhttp: 127.0.0.1:{http}\n\
             ports_file_dir: \"{ports}\"\njetstream {{ store_dir: \"{store}\" }}\n\
             cluster {{\n  name: jwc\n  listen: 127.0.0.1:{cport}\n  routes: [{routes}]\n}}\n",
            name = node.name,
            port = or_random(node.port),
            http = or_random(node.http_port),
            ports = ports_dir.display(),
            store = node.dir.join("js").display(),
            cport = node.cluster_port,
            routes = routes.join(", "),
        );
        for l in &self.extra {
            text.push_str(l);
            text.push('\n');
        }
        let conf = node.dir.join("server.conf");
        std::fs::write(&conf, text).unwrap();
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(node.dir.join("server.log"))
            .unwrap();
        let child = Command::new(nats_server_bin())
            .arg("-c")
            .arg(&conf)
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| {
                panic!(
                    "cannot start nats-server ({}): {e}; set NATS_SERVER_BIN",
                    nats_server_bin().display()
                )
            });
        node.child = Some(child);
    }

    /// Wait for node `i`'s ports file and client port.
    fn await_listening(&mut self, i: usize) {
        let node = &mut self.nodes[i];
        let ports_dir = node.dir.join("ports");
        let deadline = Instant::now() + Duration::from_secs(20);
        let (port, http) = loop {
            if let Some(st) = node.child.as_mut().unwrap().try_wait().unwrap() {
                let log = std::fs::read_to_string(node.dir.join("server.log")).unwrap_or_default();
                panic!("nats-server {} exited at start ({st}):\n{log}", node.name);
            }
            let found = std::fs::read_dir(&ports_dir).ok().and_then(|rd| {
                rd.flatten().find_map(|e| {
                    let text = std::fs::read_to_string(e.path()).ok()?;
                    let v: serde_json::Value = serde_json::from_str(&text).ok()?;
                    let port_of = |key: &str| -> Option<u16> {
                        let url = v.get(key)?.as_array()?.first()?.as_str()?;
                        url.rsplit(':').next()?.parse().ok()
                    };
                    Some((port_of("nats")?, port_of("monitoring")?))
                })
            });
            if let Some(p) = found {
                break p;
            }
            assert!(
                Instant::now() < deadline,
                "nats-server {} did not start",
                node.name
            );
            std::thread::sleep(Duration::from_millis(10));
        };
        node.port = port;
        node.http_port = http;
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(Instant::now() < deadline, "{} did not accept", node.name);
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    pub fn url(&self, i: usize) -> String {
        format!("nats://127.0.0.1:{}", self.nodes[i].port)
    }

    /// Every node's URL.
    pub fn urls(&self) -> Vec<String> {
        (0..self.nodes.len()).map(|i| self.url(i)).collect()
    }

    /// The server list as `--server` takes it (comma-separated).
    pub fn server_list(&self) -> String {
        self.urls().join(",")
    }

    /// Node `i`'s process id while it runs.
    pub fn pid(&self, i: usize) -> Option<u32> {
        self.nodes[i].child.as_ref().map(Child::id)
    }

    pub fn is_up(&self, i: usize) -> bool {
        self.nodes[i].child.is_some()
    }

    pub fn index_of(&self, name: &str) -> usize {
        self.nodes
            .iter()
            .position(|n| n.name == name)
            .unwrap_or_else(|| panic!("no node named {name}"))
    }

    /// SIGKILL node `i`, keeping its store and ports.
    pub fn kill(&mut self, i: usize) {
        if let Some(mut c) = self.nodes[i].child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Start node `i` again on its ports and store (killing it first if it
    /// runs); returns once it accepts clients.
    pub fn restart(&mut self, i: usize) {
        self.kill(i);
        self.launch(i);
        self.await_listening(i);
    }

    /// GET a monitoring path of node `i` as JSON (None if it does not answer).
    pub fn monitor(&self, i: usize, path: &str) -> Option<serde_json::Value> {
        if !self.is_up(i) {
            return None;
        }
        let addr = std::net::SocketAddr::from(([127, 0, 0, 1], self.nodes[i].http_port));
        let mut s = std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(1)).ok()?;
        s.set_read_timeout(Some(Duration::from_secs(3))).ok()?;
        s.write_all(format!("GET {path} HTTP/1.0\r\nHost: x\r\n\r\n").as_bytes())
            .ok()?;
        let mut out = Vec::new();
        s.read_to_end(&mut out).ok()?;
        let text = String::from_utf8_lossy(&out);
        let body = text.split_once("\r\n\r\n")?.1;
        serde_json::from_str(body).ok()
    }

    /// The meta leader's name, if every running node names the same one
    /// and it is running.
    pub fn meta_leader(&self) -> Option<String> {
        let mut leader: Option<String> = None;
        for i in (0..self.nodes.len()).filter(|&i| self.is_up(i)) {
            let jsz = self.monitor(i, "/jsz")?;
            let l = jsz
                .get("meta_cluster")?
                .get("leader")?
                .as_str()?
                .to_string();
            if l.is_empty() || leader.as_ref().is_some_and(|x| *x != l) {
                return None;
            }
            leader = Some(l);
        }
        leader.filter(|l| self.is_up(self.index_of(l)))
    }

    /// Whether every running node has routes to every other running node
    /// (then each advertises all of them to its clients).
    pub fn routes_complete(&self) -> bool {
        let up: Vec<usize> = (0..self.nodes.len()).filter(|&i| self.is_up(i)).collect();
        up.iter().all(|&i| {
            let Some(routez) = self.monitor(i, "/routez") else {
                return false;
            };
            let mut peers: Vec<&str> = routez
                .get("routes")
                .and_then(|r| r.as_array())
                .map(|rs| {
                    rs.iter()
                        .filter_map(|r| r.get("remote_name")?.as_str())
                        .collect()
                })
                .unwrap_or_default();
            peers.sort_unstable();
            peers.dedup();
            up.iter()
                .filter(|&&j| j != i)
                .all(|&j| peers.contains(&self.nodes[j].name.as_str()))
        })
    }

    /// Wait until the running nodes are fully routed and agree on a running
    /// meta leader.
    pub async fn wait_ready(&self, timeout: Duration) -> String {
        wait_for(
            timeout,
            "routes and a meta leader all running nodes agree on",
            || async { self.meta_leader().filter(|_| self.routes_complete()) },
        )
        .await
    }

    /// Wait for a meta leader other than `old`.
    pub async fn wait_new_meta_leader(&self, old: &str, timeout: Duration) -> String {
        wait_for(
            timeout,
            &format!("a meta leader other than {old}"),
            || async { self.meta_leader().filter(|l| l != old) },
        )
        .await
    }

    /// A client connected to every node (it reconnects to a survivor).
    pub async fn client(&self) -> async_nats::Client {
        async_nats::ConnectOptions::new()
            .name("cluster-test")
            .retry_on_initial_connect()
            .reconnect_delay_callback(|_| Duration::from_millis(100))
            .connect(self.urls())
            .await
            .unwrap()
    }

    pub async fn js(&self) -> jetstream::Context {
        jetstream::ContextBuilder::new()
            .timeout(Duration::from_secs(3))
            .build(self.client().await)
    }

    /// The node (index) holding a client connection whose name starts with
    /// `prefix` (a worker's id is `<name>-<suffix>`).
    pub fn node_of_connection(&self, prefix: &str) -> Option<usize> {
        (0..self.nodes.len()).find(|&i| {
            self.monitor(i, "/connz?limit=1024")
                .and_then(|c| {
                    c.get("connections")?.as_array().map(|conns| {
                        conns.iter().any(|c| {
                            c.get("name")
                                .and_then(|n| n.as_str())
                                .is_some_and(|n| n.starts_with(prefix))
                        })
                    })
                })
                .unwrap_or(false)
        })
    }
}

/// A stream's leader (server name) and how many of its replicas are
/// current, as the stream info reports them.
pub async fn stream_leader(js: &jetstream::Context, stream: &str) -> Option<(String, usize)> {
    let mut s = js.get_stream(stream).await.ok()?;
    let info = s.info().await.ok()?;
    let cluster = info.cluster.as_ref()?;
    let leader = cluster.leader.clone().filter(|l| !l.is_empty())?;
    let current = cluster.replicas.iter().filter(|r| r.current).count();
    Some((leader, current))
}

/// Wait until `stream` has a leader other than `old` (any leader for None).
pub async fn wait_stream_leader(
    js: &jetstream::Context,
    stream: &str,
    old: Option<&str>,
    timeout: Duration,
) -> String {
    wait_for(
        timeout,
        &format!("a leader of {stream} other than {old:?}"),
        || async {
            stream_leader(js, stream)
                .await
                .map(|(l, _)| l)
                .filter(|l| Some(l.as_str()) != old)
        },
    )
    .await
}

/// The replica count of a stream (KV buckets are streams `KV_<bucket>`).
pub async fn replicas_of(js: &jetstream::Context, stream: &str) -> usize {
    let mut s = js.get_stream(stream).await.unwrap();
    s.info().await.unwrap().config.num_replicas
}

impl Drop for NatsCluster {
    fn drop(&mut self) {
        for i in 0..self.nodes.len() {
            self.kill(i);
        }
    }
}
