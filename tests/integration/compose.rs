//! docker-compose as test ground, with images built offline
//! (`scripts/build-images.sh`): NATS plus three scaled workers, tasks
//! submitted from the host, results checked to come from more than one
//! worker; and the 3-node cluster of `deploy/compose.cluster.yml` with a
//! NATS container and a worker container killed under load
//! (`scripts/compose-smoke.sh` does the work; these tests run it with the
//! binary under test).

use std::process::Command;

fn docker_available() -> bool {
    Command::new("docker")
        .arg("info")
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false)
}

fn compose_available() -> bool {
    let v1 = Command::new("docker-compose")
        .arg("version")
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false);
    let v2 = Command::new("docker")
        .args(["compose", "version"])
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false);
    v1 || v2
}

/// One compose project at a time: both build the same images, and the
/// machine carries one.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Run `scripts/compose-smoke.sh` with `env`; false if it was skipped.
fn smoke(test: &str, env: &[(&str, &str)]) -> bool {
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    if !docker_available() || !compose_available() {
        crate::util::skip(&format!("{test} needs a Docker Engine and docker-compose"));
        return false;
    }
    let root = env!("CARGO_MANIFEST_DIR");
    let out = Command::new("bash")
        .arg(format!("{root}/scripts/compose-smoke.sh"))
        .env("JETWORKER_BIN", crate::util::jetworker_bin())
        .env(
            "SMOKE_PROJECT",
            format!("jwtest{}{}", std::process::id(), env.len()),
        )
        .envs(env.iter().copied())
        .output()
        .expect("run compose-smoke.sh");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "compose smoke failed:\n{text}");
    assert!(text.contains("compose-smoke: PASS"), "{text}");
    true
}

#[test]
fn compose_scaled_workers_share_tasks() {
    smoke(
        "compose_scaled_workers_share_tasks",
        &[("SMOKE_TASKS", "12")],
    );
}

#[test]
fn compose_cluster_survives_a_nats_and_a_worker_kill() {
    smoke(
        "compose_cluster_survives_a_nats_and_a_worker_kill",
        &[
            ("SMOKE_CLUSTER", "1"),
            ("SMOKE_TASKS", "30"),
            ("SMOKE_TIMEOUT", "90"),
        ],
    );
}
