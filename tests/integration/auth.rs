//! Connecting with credentials: token, user/password and nkey, against a
//! server that requires them (the same settings serve the worker and every
//! CLI subcommand).

use std::time::Duration;

use jetworker::protocol::Status;

use crate::util::*;

const T: Duration = Duration::from_secs(30);

/// Run one task through a worker started with `flags`, publishing with a
/// client that connects with `opts`.
async fn round_trip(srv: &NatsServer, flags: &[&str], opts: async_nats::ConnectOptions) {
    let _w = ProcWorker::start(&srv.url(), flags);
    let client = opts.connect(srv.url()).await.unwrap();
    let js = async_nats::jetstream::new(client);
    publish_task(
        &js,
        "default",
        r#"{"id":"authed","type":"shell","payload":"echo in"}"#,
    )
    .await;
    let r = final_result(&js, "authed", T).await;
    assert_eq!(r.status, Status::Success);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn token_auth() {
    let srv = NatsServer::start_with(&["authorization { token: \"s3cret\" }"]);
    round_trip(
        &srv,
        &["--token", "s3cret"],
        async_nats::ConnectOptions::with_token("s3cret".into()),
    )
    .await;
    // A wrong token is a clear failure, exit 2 (operator command).
    let out = std::process::Command::new(jetworker_bin())
        .args(["workers", "--server", &srv.url(), "--token", "wrong"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "{out:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn user_password_auth() {
    let srv = NatsServer::start_with(&["authorization { user: jw, password: \"pw-1\" }"]);
    round_trip(
        &srv,
        &["--user", "jw", "--password", "pw-1"],
        async_nats::ConnectOptions::with_user_and_password("jw".into(), "pw-1".into()),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nkey_auth() {
    let kp = nkeys::KeyPair::new_user();
    let seed = kp.seed().unwrap();
    let srv = NatsServer::start_with(&[&format!(
        "authorization {{ users: [ {{ nkey: {} }} ] }}",
        kp.public_key()
    )]);
    let dir = tempfile::tempdir().unwrap();
    let seed_file = dir.path().join("user.nk");
    std::fs::write(&seed_file, format!("{seed}\n")).unwrap();
    round_trip(
        &srv,
        &["--nkey", seed_file.to_str().unwrap()],
        async_nats::ConnectOptions::with_nkey(seed),
    )
    .await;
}
