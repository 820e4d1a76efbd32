//! The newcomer path, as written: the README's Install and Quick start
//! blocks (marked `<!-- readme-test: … -->`) run in a temporary clone of the
//! committed tree, with a fresh `HOME`, `XDG_*` directories and install
//! root, so nothing of the tester's setup (a nats context, an installed
//! jetworker, a config file) helps them along. Opt-in (`--ignored`): it
//! builds the release binary. The build goes to `target/readme-test`,
//! kept on purpose so that a second run is incremental.

use std::path::{Path, PathBuf};
use std::process::Command;

/// The shell block that follows the marker `<!-- readme-test: <name> -->`.
fn block(readme: &str, name: &str) -> String {
    let marker = format!("<!-- readme-test: {name} -->");
    let after = readme
        .split_once(&marker)
        .unwrap_or_else(|| panic!("README.md has no {marker}"))
        .1;
    let body = after
        .split_once("```sh\n")
        .unwrap_or_else(|| panic!("no ```sh block after {marker}"))
        .1;
    body.split_once("```")
        .unwrap_or_else(|| panic!("unterminated block after {marker}"))
        .0
        .to_string()
}

/// Run the block's lines in one shell; after a line that starts
/// nats-server in the background, wait until it listens (a reader types
/// the next command a moment later; a script would not).
fn script(blocks: &[String]) -> String {
    let mut s = String::from("set -euo pipefail\n");
    for b in blocks {
        for line in b.lines() {
            s.push_str(line);
            s.push('\n');
            if line.trim_start().starts_with("nats-server") {
                s.push_str(
                    "for i in $(seq 200); do (exec 3<>/dev/tcp/127.0.0.1/4222) 2>/dev/null && break; sleep 0.05; done\n",
                );
            }
        }
    }
    s
}

fn real_home() -> PathBuf {
    std::env::var_os("HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/root"))
}

#[test]
#[ignore = "builds the release binary in a temporary clone; run with --ignored"]
fn readme_install_and_quick_start_work_on_a_fresh_clone() {
    let repo = Path::new(env!("CARGO_MANIFEST_DIR"));
    let readme = std::fs::read_to_string(repo.join("README.md")).unwrap();
    let blocks = [block(&readme, "install"), block(&readme, "quick-start")];

    let tmp = tempfile::tempdir().unwrap();
    let clone = tmp.path().join("jetworker");
    let st = Command::new("git")
        .args(["clone", "--quiet"])
        .arg(repo)
        .arg(&clone)
        .status()
        .unwrap();
    assert!(st.success(), "git clone failed");
    let home = tmp.path().join("home");
    std::fs::create_dir_all(&home).unwrap();
    // cargo and rustup keep their own homes (registry, toolchains); only
    // the install root is fresh.
    let cargo_home = std::env::var_os("CARGO_HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| real_home().join(".cargo"));
    let rustup_home = std::env::var_os("RUSTUP_HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| real_home().join(".rustup"));
    let path = format!(
        "{}:{}",
        cargo_home.join("bin").display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let mut cmd = Command::new("bash");
    cmd.arg("-c")
        .arg(script(&blocks))
        .current_dir(&clone)
        .env_clear()
        .env("PATH", path)
        .env("HOME", &home)
        .env("CARGO_HOME", &cargo_home)
        .env("RUSTUP_HOME", &rustup_home)
        .env("CARGO_INSTALL_ROOT", home.join(".cargo"))
        .env("CARGO_TARGET_DIR", repo.join("target/readme-test"))
        .env("XDG_CONFIG_HOME", home.join(".config"))
        .env("XDG_DATA_HOME", home.join(".local/share"))
        .env("TMPDIR", tmp.path());
    if let Some(bin) = std::env::var_os("NATS_SERVER_BIN") {
        cmd.env("NATS_SERVER_BIN", bin);
    }
    let out = cmd.output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "README commands failed ({}):\nstdout:\n{stdout}\nstderr:\n{stderr}",
        out.status
    );
    assert!(
        stdout.contains("hello from jetworker"),
        "the task's output:\n{stdout}\nstderr:\n{stderr}"
    );
    assert!(
        home.join(".cargo/bin/jetworker").is_file(),
        "cargo install put the binary into the fresh install root"
    );
}

#[test]
fn readme_blocks_are_marked() {
    let readme =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("README.md")).unwrap();
    assert!(block(&readme, "install").contains("cargo install --path ."));
    assert!(block(&readme, "quick-start").contains("jetworker submit --wait"));
}
