//! docker-compose as test ground: NATS plus three scaled workers built
//! offline into images (`scripts/build-images.sh`), tasks submitted from the
//! host, results checked to come from more than one worker
//! (`scripts/compose-smoke.sh` does the work; this test runs it with the
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

#[test]
fn compose_scaled_workers_share_tasks() {
    if !docker_available() || !compose_available() {
        crate::util::skip(
            "compose_scaled_workers_share_tasks needs a Docker Engine and docker-compose",
        );
        return;
    }
    let root = env!("CARGO_MANIFEST_DIR");
    let out = Command::new("bash")
        .arg(format!("{root}/scripts/compose-smoke.sh"))
        .env("JETWORKER_BIN", crate::util::jetworker_bin())
        .env("SMOKE_PROJECT", format!("jwtest{}", std::process::id()))
        .env("SMOKE_TASKS", "12")
        .output()
        .expect("run compose-smoke.sh");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "compose smoke failed:\n{text}");
    assert!(text.contains("compose-smoke: PASS"), "{text}");
}
