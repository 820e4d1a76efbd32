//! `container` tasks against the machine's Docker Engine, with an image
//! built offline by the test setup (a busybox-static rootfs imported
//! through the Engine API; no registry is reachable). Where no engine
//! answers, each test prints `SKIPPED: no Docker Engine` and returns, or
//! fails with `JETWORKER_NO_SKIP=1` (set in CI, which has one).

use std::collections::HashMap;
use std::time::{Duration, Instant};

use bollard::models::ContainerCreateBody;
use bollard::query_parameters::{
    CreateContainerOptionsBuilder, CreateImageOptionsBuilder, ListContainersOptionsBuilder,
    RemoveContainerOptionsBuilder,
};
use bollard::Docker;
use futures::StreamExt;
use jetworker::internals::{ContainerRunner, WorkerIdentity, LABEL_TASK_ID};
use jetworker::protocol::{parse_task, Envelope, Status, ValidationLimits};
use jetworker::runner::StopKind;

use crate::runner_ctx::{context, task, RunTask};
use crate::util::wait_for;

/// The image every test runs: busybox and a few applet links. Bump the tag
/// when `tests/support/busybox-rootfs.sh` changes, so that an image built
/// by an older script is not reused.
const TEST_IMAGE: &str = "jetworker-test-busybox:v1";

/// Built once per test run, whichever test gets there first.
static IMAGE: tokio::sync::OnceCell<Result<Built, String>> = tokio::sync::OnceCell::const_new();

/// Whether the test image could be made.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Built {
    Yes,
    /// No busybox on this machine (and none installable): a missing
    /// prerequisite, reported like a missing engine.
    NoBusybox,
}

/// A client for this test's runtime (a client must not outlive the
/// runtime that made its connections), or `None` after printing why the
/// test is skipped.
async fn engine() -> Option<Docker> {
    let docker = match Docker::connect_with_defaults() {
        Ok(d) => d,
        Err(e) => {
            crate::util::skip(&format!("no Docker Engine ({e})"));
            return None;
        }
    };
    match tokio::time::timeout(Duration::from_secs(5), docker.negotiate_version()).await {
        Ok(Ok(d)) => Some(d),
        Ok(Err(e)) => {
            crate::util::skip(&format!("no Docker Engine ({e})"));
            None
        }
        Err(_) => {
            crate::util::skip("no Docker Engine (no answer within 5s)");
            None
        }
    }
}

/// Engine client with the test image present, or `None` (skipped).
async fn setup() -> Option<Docker> {
    let docker = engine().await?;
    match IMAGE.get_or_init(|| build_image(docker.clone())).await {
        Ok(Built::Yes) => Some(docker),
        Ok(Built::NoBusybox) => {
            crate::util::skip(&format!(
                "no busybox-static to build {TEST_IMAGE} (install busybox-static)"
            ));
            None
        }
        Err(e) => panic!("cannot build the test image {TEST_IMAGE}: {e}"),
    }
}

/// `docker import` of the rootfs made by `tests/support/busybox-rootfs.sh`,
/// through the Engine API; nothing to do if the image is there already.
async fn build_image(docker: Docker) -> Result<Built, String> {
    if docker.inspect_image(TEST_IMAGE).await.is_ok() {
        return Ok(Built::Yes);
    }
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/support/busybox-rootfs.sh"
    );
    let out = tokio::process::Command::new("sh")
        .arg(script)
        .output()
        .await
        .map_err(|e| format!("cannot run {script}: {e}"))?;
    if out.status.code() == Some(3) {
        return Ok(Built::NoBusybox);
    }
    if !out.status.success() {
        return Err(format!(
            "{script} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    let (repo, tag) = TEST_IMAGE.split_once(':').unwrap();
    let opts = CreateImageOptionsBuilder::new()
        .from_src("-")
        .repo(repo)
        .tag(tag)
        .changes(vec!["ENV PATH=/bin".to_string()])
        .build();
    let mut progress = docker.create_image(
        Some(opts),
        Some(bollard::body_full(out.stdout.into())),
        None,
    );
    while let Some(step) = progress.next().await {
        step.map_err(|e| format!("import failed: {e}"))?;
    }
    Ok(Built::Yes)
}

fn runner() -> ContainerRunner {
    let id = format!("test-{:08x}", rand::random::<u32>());
    ContainerRunner::new(None, None, Vec::new(), &id, "test")
}

/// A container task running `script` with `sh -c` in the test image.
fn sh_task(id: &str, script: &str, extra: &str) -> std::sync::Arc<jetworker::protocol::Task> {
    let args = serde_json::to_string(&vec!["sh", "-c", script]).unwrap();
    task(&format!(
        r#"{{"type":"container","id":"{id}","image":"{TEST_IMAGE}","pull":"never","args":{args}{extra}}}"#
    ))
}

fn unique(prefix: &str) -> String {
    format!("{prefix}-{:08x}", rand::random::<u32>())
}

/// Containers (any state) labelled with this task id.
async fn containers_of(docker: &Docker, task_id: &str) -> Vec<String> {
    let filters = HashMap::from([("label", vec![format!("{LABEL_TASK_ID}={task_id}")])]);
    docker
        .list_containers(Some(
            ListContainersOptionsBuilder::new()
                .all(true)
                .filters(&filters)
                .build(),
        ))
        .await
        .unwrap()
        .into_iter()
        .filter_map(|c| c.id)
        .collect()
}

/// Whether a container exists.
async fn exists(docker: &Docker, id: &str) -> bool {
    docker.inspect_container(id, None).await.is_ok()
}

#[tokio::test]
async fn container_echo_output() {
    let Some(docker) = setup().await else { return };
    let id = unique("echo");
    let out = runner()
        .run_task(context(
            sh_task(&id, "echo hello; echo oops >&2", ""),
            Duration::from_secs(30),
        ))
        .await;
    assert_eq!(out.status, Status::Success, "{out:?}");
    assert_eq!(out.exit_code, Some(0));
    assert!(out.output.text.contains("hello\n"), "{out:?}");
    assert!(out.output.text.contains("oops\n"), "{out:?}");
    assert!(containers_of(&docker, &id).await.is_empty(), "removed");
}

#[tokio::test]
async fn container_nonzero_exit() {
    let Some(docker) = setup().await else { return };
    let id = unique("exit");
    let out = runner()
        .run_task(context(
            sh_task(&id, "echo before; exit 3", ""),
            Duration::from_secs(30),
        ))
        .await;
    assert_eq!(out.status, Status::Failed, "{out:?}");
    assert_eq!(out.exit_code, Some(3));
    assert_eq!(out.error.as_deref(), Some("exit code 3"));
    assert_eq!(out.output.text, "before\n");
    assert!(containers_of(&docker, &id).await.is_empty(), "removed");
}

#[tokio::test]
async fn container_env_workdir_user_injection() {
    let Some(_docker) = setup().await else { return };
    let id = unique("env");
    let t = sh_task(
        &id,
        "env | sort; pwd; id -u",
        r#","idempotency_key":"k-9","shard":{"no":2,"total":4},"env":{"FOO":"bar baz"},
           "payload":"-e EXTRA=1 -w /tmp -u 65534""#,
    );
    let out = runner().run_task(context(t, Duration::from_secs(30))).await;
    assert_eq!(out.status, Status::Success, "{out:?}");
    let text = &out.output.text;
    for line in [
        "IDEMPOTENCY_KEY=k-9".to_string(),
        format!("SCHEDULE_INSTANCE_ID={id}"),
        "SHARD_NO=2".into(),
        "SHARD_TOTAL=4".into(),
        "ATTEMPT=1".into(),
        "FOO=bar baz".into(),
        "EXTRA=1".into(),
        "/tmp".into(),
        "65534".into(),
    ] {
        assert!(
            text.lines().any(|l| l == line),
            "missing `{line}` in:\n{text}"
        );
    }
}

#[tokio::test]
async fn container_network_none() {
    let Some(_docker) = setup().await else { return };
    let id = unique("net");
    let t = sh_task(&id, "ls /sys/class/net", r#","network":"none""#);
    let out = runner().run_task(context(t, Duration::from_secs(30))).await;
    assert_eq!(out.status, Status::Success, "{out:?}");
    assert_eq!(out.output.text.trim(), "lo", "only loopback: {out:?}");
}

#[tokio::test]
async fn container_large_output_is_truncated() {
    let Some(_docker) = setup().await else { return };
    let id = unique("big");
    let t = sh_task(&id, "yes | head -c 1000000", "");
    let out = runner().run_task(context(t, Duration::from_secs(30))).await;
    assert_eq!(out.status, Status::Success, "{out:?}");
    assert!(out.output.truncated);
    assert_eq!(out.output.total_bytes, 1_000_000);
}

#[tokio::test]
async fn container_timeout_kills_and_removes() {
    let Some(docker) = setup().await else { return };
    let id = unique("timeout");
    // As PID 1 with no handler, sleep ignores SIGTERM: only the kill ends it.
    let t = task(&format!(
        r#"{{"type":"container","id":"{id}","image":"{TEST_IMAGE}","pull":"never","args":["sleep","600"]}}"#
    ));
    let started = Instant::now();
    let out = runner().run_task(context(t, Duration::from_secs(3))).await;
    let took = started.elapsed();
    assert_eq!(out.status, Status::Timeout, "{out:?}");
    assert_eq!(out.error.as_deref(), Some("timed out after 3s"));
    assert!(took < Duration::from_secs(15), "took {took:?}");
    assert!(containers_of(&docker, &id).await.is_empty(), "removed");
}

#[tokio::test]
async fn container_cancel_stops_and_removes() {
    let Some(docker) = setup().await else { return };
    let id = unique("cancel");
    let t = sh_task(&id, "echo started; sleep 600", "");
    let ctx = context(t, Duration::from_secs(120));
    let stop = ctx.stop.clone();
    let runner = runner();
    let run = tokio::spawn(async move { runner.run_task(ctx).await });
    // Cancel once the container runs.
    wait_for(Duration::from_secs(30), "the container to run", || {
        let docker = docker.clone();
        let id = id.clone();
        async move { (!containers_of(&docker, &id).await.is_empty()).then_some(()) }
    })
    .await;
    let started = Instant::now();
    stop.fire(StopKind::Cancelled, "cancelled by test");
    let out = run.await.unwrap();
    assert_eq!(out.status, Status::Cancelled, "{out:?}");
    assert_eq!(out.error.as_deref(), Some("cancelled by test"));
    // sh as PID 1 ignores SIGTERM: the kill after the 1s grace ends it.
    assert!(started.elapsed() < Duration::from_secs(15));
    assert!(containers_of(&docker, &id).await.is_empty(), "removed");
}

/// A worker may drop an attempt's future (abort); the container must not
/// stay behind.
#[tokio::test]
async fn container_removed_when_the_attempt_is_dropped() {
    let Some(docker) = setup().await else { return };
    let id = unique("dropped");
    let t = sh_task(&id, "sleep 600", "");
    let ctx = context(t, Duration::from_secs(120));
    let runner = runner();
    let run = tokio::spawn(async move { runner.run_task(ctx).await });
    wait_for(Duration::from_secs(30), "the container to run", || {
        let docker = docker.clone();
        let id = id.clone();
        async move { (!containers_of(&docker, &id).await.is_empty()).then_some(()) }
    })
    .await;
    run.abort();
    assert!(run.await.unwrap_err().is_cancelled());
    wait_for(
        Duration::from_secs(30),
        "the container to be removed",
        || {
            let docker = docker.clone();
            let id = id.clone();
            async move { containers_of(&docker, &id).await.is_empty().then_some(()) }
        },
    )
    .await;
}

#[tokio::test]
async fn container_memory_limit_is_enforced() {
    let Some(_docker) = setup().await else { return };
    let id = unique("oom");
    // dd's 64 MiB buffer is touched at once as /dev/zero fills it. (A
    // pipe into `tail` also works, but grows slowly enough that the kernel
    // can spend many seconds reclaiming page cache before it gives up.)
    let t = task(&format!(
        r#"{{"type":"container","id":"{id}","image":"{TEST_IMAGE}","pull":"never",
            "args":["dd","if=/dev/zero","of=/dev/null","bs=64M","count=1"],
            "limits":{{"memory":"8MiB"}}}}"#
    ));
    let out = runner().run_task(context(t, Duration::from_secs(60))).await;
    assert_eq!(out.status, Status::Failed, "{out:?}");
    assert_eq!(out.exit_code, Some(137), "SIGKILLed: {out:?}");
    // The engine records the OOM kill from an event of its own, which can
    // lag behind the exit; the runner waits a moment for it and otherwise
    // still names the limit. Either way the reason names the limit.
    let error = out.error.unwrap();
    assert!(
        error == "exit code 137: killed by the out-of-memory killer: memory limit 8MiB exceeded"
            || error == "exit code 137 (SIGKILL; memory limit 8MiB may have been exceeded)",
        "{error}"
    );
}

#[tokio::test]
async fn container_dangerous_payload_options_are_rejected() {
    // Validation only: no engine needed.
    let env = Envelope {
        label: "default",
        stream_sequence: 1,
        ..Default::default()
    };
    let v = ValidationLimits::default();
    for (payload, field, named) in [
        ("--privileged", "payload", "--privileged"),
        ("-v /:/host", "payload", "-v"),
        ("--volume=/:/host", "payload", "--volume"),
        ("--pid=host", "payload", "--pid"),
        ("--cap-add ALL", "payload", "--cap-add"),
        ("--device /dev/sda", "payload", "--device"),
        ("-p 80:80", "payload", "-p"),
        (
            "-e A=1 --security-opt seccomp=unconfined",
            "payload",
            "--security-opt",
        ),
        ("--network host", "network", "host"),
        ("--network=container:abc", "network", "container:abc"),
        ("-e ATTEMPT=7", "payload --env.ATTEMPT", "reserved"),
    ] {
        let json =
            serde_json::json!({"type": "container", "image": TEST_IMAGE, "payload": payload});
        let err = parse_task(json.to_string().as_bytes(), &env, &v)
            .expect_err(&format!("`{payload}` must be rejected"));
        assert_eq!(err.field, field, "{payload}: {err}");
        assert!(err.to_string().contains(named), "{payload}: {err}");
    }
}

#[tokio::test]
async fn container_pull_never_with_missing_image() {
    let Some(docker) = setup().await else { return };
    let id = unique("never");
    let t = task(&format!(
        r#"{{"type":"container","id":"{id}","image":"jetworker-test-absent:nope","pull":"never"}}"#
    ));
    let out = runner().run_task(context(t, Duration::from_secs(30))).await;
    assert_eq!(out.status, Status::Failed, "{out:?}");
    assert_eq!(
        out.error.as_deref(),
        Some("image jetworker-test-absent:nope not present and pull is never")
    );
    assert!(containers_of(&docker, &id).await.is_empty());
}

#[tokio::test]
async fn container_pull_failure_is_reported() {
    let Some(_docker) = setup().await else { return };
    let id = unique("pull");
    // Nothing listens on port 1: the pull fails at once.
    let t = task(&format!(
        r#"{{"type":"container","id":"{id}","image":"localhost:1/jetworker/absent:nope"}}"#
    ));
    let out = runner().run_task(context(t, Duration::from_secs(30))).await;
    assert_eq!(out.status, Status::Failed, "{out:?}");
    let err = out.error.unwrap();
    assert!(
        err.starts_with("cannot pull image localhost:1/jetworker/absent:nope: "),
        "{err}"
    );
}

#[tokio::test]
async fn container_unreachable_engine_fails_clearly() {
    let runner = ContainerRunner::new(
        Some("unix:///nonexistent/docker.sock"),
        None,
        Vec::new(),
        "test-x",
        "test",
    );
    assert!(!runner.engine_answers().await);
    let t = task(&format!(
        r#"{{"type":"container","image":"{TEST_IMAGE}","pull":"never"}}"#
    ));
    let out = runner.run_task(context(t, Duration::from_secs(10))).await;
    assert_eq!(out.status, Status::Failed);
    let err = out.error.unwrap();
    assert!(
        err.starts_with("Docker Engine not reachable at unix:///nonexistent/docker.sock: "),
        "{err}"
    );

    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let endpoint = format!("tcp://127.0.0.1:{port}");
    let runner = ContainerRunner::new(Some(&endpoint), None, Vec::new(), "test-x", "test");
    assert!(!runner.engine_answers().await);
    let t = task(&format!(r#"{{"type":"container","image":"{TEST_IMAGE}"}}"#));
    let out = runner.run_task(context(t, Duration::from_secs(10))).await;
    let err = out.error.unwrap();
    assert!(
        err.starts_with(&format!("Docker Engine not reachable at {endpoint}: ")),
        "{err}"
    );
    assert_eq!(runner.remove_leftovers().await, 0);
}

/// Create (and start) a `sleep` container labelled as if `owner` had made
/// it for task `task_id`.
async fn labelled_container(docker: &Docker, owner: &WorkerIdentity, task_id: &str) -> String {
    let mut labels = owner.labels();
    labels.insert(LABEL_TASK_ID.into(), task_id.into());
    let body = ContainerCreateBody {
        image: Some(TEST_IMAGE.into()),
        cmd: Some(vec!["sleep".into(), "600".into()]),
        labels: Some(labels),
        ..Default::default()
    };
    let name = format!("jetworker-{task_id}-1-test");
    let id = docker
        .create_container(
            Some(CreateContainerOptionsBuilder::new().name(&name).build()),
            body,
        )
        .await
        .unwrap()
        .id;
    docker.start_container(&id, None).await.unwrap();
    id
}

#[tokio::test]
async fn container_leftovers_of_dead_workers_are_removed() {
    let Some(docker) = setup().await else { return };
    let runner = runner();
    let me = runner.identity().clone();

    // A worker of this host that is gone: a process that has exited.
    let mut child = std::process::Command::new("true").spawn().unwrap();
    let dead_pid = child.id();
    child.wait().unwrap();
    let dead = WorkerIdentity {
        worker_id: unique("dead"),
        worker_name: "someone".into(),
        pid: dead_pid,
        started: None,
        ..me.clone()
    };
    // A live worker of this host (another process in our namespace).
    let mut sleeper = std::process::Command::new("sleep")
        .arg("60")
        .spawn()
        .unwrap();
    let live = WorkerIdentity::current(&unique("live"), "test");
    let live = WorkerIdentity {
        pid: sleeper.id(),
        started: std::fs::read_to_string(format!("/proc/{}/stat", sleeper.id()))
            .ok()
            .and_then(|s| {
                s.rsplit_once(')')
                    .and_then(|r| r.1.split_whitespace().nth(19)?.parse().ok())
            }),
        ..live
    };
    // A dead worker of another host.
    let remote = WorkerIdentity {
        host: format!("{}-elsewhere", me.host),
        ..dead.clone()
    };
    // Our own pid reused by a later process: the recorded start time
    // differs.
    let reused = WorkerIdentity {
        worker_id: unique("reused"),
        started: me.started.map(|s| s.saturating_sub(1)),
        ..me.clone()
    };

    let dead_c = labelled_container(&docker, &dead, &unique("left-dead")).await;
    let live_c = labelled_container(&docker, &live, &unique("left-live")).await;
    let remote_c = labelled_container(&docker, &remote, &unique("left-remote")).await;
    let reused_c = if me.started.is_some() {
        Some(labelled_container(&docker, &reused, &unique("left-reused")).await)
    } else {
        None
    };

    // (No assertion on the count: in a full test run, a worker that
    // another test starts on this host may get to the dead ones first.)
    runner.remove_leftovers().await;
    // Another runner in this process may be removing the same container
    // ("removal already in progress"): give that removal time to finish.
    let gone_soon = |c: String| {
        let docker = docker.clone();
        async move {
            let deadline = std::time::Instant::now() + Duration::from_secs(10);
            while exists(&docker, &c).await {
                if std::time::Instant::now() > deadline {
                    return false;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            true
        }
    };
    let dead_gone = gone_soon(dead_c.clone()).await;
    let reused_gone = match &reused_c {
        Some(c) => gone_soon(c.clone()).await,
        None => true,
    };
    let live_kept = exists(&docker, &live_c).await;
    let remote_kept = exists(&docker, &remote_c).await;

    let _ = sleeper.kill();
    let _ = sleeper.wait();
    for c in [&dead_c, &live_c, &remote_c]
        .into_iter()
        .chain(reused_c.as_ref())
    {
        let _ = docker
            .remove_container(
                c,
                Some(RemoveContainerOptionsBuilder::new().force(true).build()),
            )
            .await;
    }
    assert!(dead_gone, "dead worker's container removed");
    assert!(reused_gone, "container of a reused pid removed");
    assert!(live_kept, "live worker's container kept");
    assert!(remote_kept, "other host's container kept");
}

/// Through the whole worker: the result carries output and exit code.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn container_task_through_the_worker() {
    use crate::util::{final_result, publish_task, InProcWorker, NatsServer};
    let Some(_docker) = setup().await else { return };
    let nats = NatsServer::start();
    let _w = InProcWorker::start(|_| {}, &nats.url());
    let js = nats.js().await;
    let id = unique("via-worker");
    publish_task(
        &js,
        "default",
        &format!(
            r#"{{"id":"{id}","type":"container","image":"{TEST_IMAGE}","pull":"never",
                "args":["sh","-c","echo attempt $ATTEMPT of $SCHEDULE_INSTANCE_ID"]}}"#
        ),
    )
    .await;
    let r = final_result(&js, &id, Duration::from_secs(60)).await;
    assert_eq!(r.status, Status::Success, "{r:?}");
    assert_eq!(r.exit_code, Some(0));
    assert_eq!(r.output, format!("attempt 1 of {id}\n"));
}

/// The real thing: a worker process SIGKILLed mid-task leaves its
/// container running; the next worker to start on this host (here: the
/// restarted one, or any other worker a parallel test starts) removes it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn container_of_a_sigkilled_worker_is_removed_at_restart() {
    use crate::util::{publish_task, NatsServer, ProcWorker};
    let Some(docker) = setup().await else { return };
    let nats = NatsServer::start();
    let name = unique("killed");
    let mut first = ProcWorker::start(&nats.url(), &["--name", &name]);
    let js = nats.js().await;
    let id = unique("orphan");
    publish_task(
        &js,
        "default",
        &format!(
            r#"{{"id":"{id}","type":"container","image":"{TEST_IMAGE}","pull":"never","args":["sleep","600"]}}"#
        ),
    )
    .await;
    let container = wait_for(Duration::from_secs(60), "the task's container", || {
        let docker = docker.clone();
        let id = id.clone();
        async move { containers_of(&docker, &id).await.into_iter().next() }
    })
    .await;
    first.kill();
    // The engine keeps it: nothing in-process can remove it now. (No
    // assertion on that: in a full test run, any other worker starting on
    // this host may already remove it, which is the point.)

    // Another label, so that the redelivered task is not picked up again.
    let second = ProcWorker::start_in(
        &nats.url(),
        &first.state,
        &["--name", &name, "--labels", "elsewhere"],
    );
    wait_for(
        Duration::from_secs(30),
        "the leftover to be removed",
        || {
            let docker = docker.clone();
            let container = container.clone();
            async move { (!exists(&docker, &container).await).then_some(()) }
        },
    )
    .await;
    second.signal(nix::sys::signal::Signal::SIGTERM);
}
