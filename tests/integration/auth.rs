//! Connecting with credentials: token, user/password, nkey and TLS (server
//! and mutual, with certificates made in the test), against a
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

/// A test CA and a certificate signed by it, as PEM files in `dir`.
fn tls_files(dir: &std::path::Path) -> (std::path::PathBuf, [std::path::PathBuf; 4]) {
    use rcgen::{
        BasicConstraints, CertificateParams, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
        KeyUsagePurpose,
    };
    let ca_key = KeyPair::generate().unwrap();
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca_params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    let ca_cert = ca_params.self_signed(&ca_key).unwrap();
    let issuer = Issuer::new(ca_params, ca_key);
    let leaf = |names: Vec<String>, usage: ExtendedKeyUsagePurpose| {
        let key = KeyPair::generate().unwrap();
        let mut p = CertificateParams::new(names).unwrap();
        p.extended_key_usages = vec![usage];
        let cert = p.signed_by(&key, &issuer).unwrap();
        (cert.pem(), key.serialize_pem())
    };
    let (server_cert, server_key) = leaf(
        vec!["localhost".into(), "127.0.0.1".into()],
        ExtendedKeyUsagePurpose::ServerAuth,
    );
    let (client_cert, client_key) =
        leaf(vec!["worker".into()], ExtendedKeyUsagePurpose::ClientAuth);
    let ca = dir.join("ca.pem");
    std::fs::write(&ca, ca_cert.pem()).unwrap();
    let files = [
        "server.pem",
        "server-key.pem",
        "client.pem",
        "client-key.pem",
    ]
    .map(|n| dir.join(n));
    for (f, text) in files
        .iter()
        .zip([server_cert, server_key, client_cert, client_key])
    {
        std::fs::write(f, text).unwrap();
    }
    (ca, files)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_and_mutual_tls() {
    let dir = tempfile::tempdir().unwrap();
    let (ca, [scert, skey, ccert, ckey]) = tls_files(dir.path());
    // Server TLS: the worker verifies the server against --tls-ca.
    let srv = NatsServer::start_with(&[&format!(
        "tls {{ cert_file: \"{}\", key_file: \"{}\" }}",
        scert.display(),
        skey.display()
    )]);
    let client_opts = || {
        async_nats::ConnectOptions::new()
            .add_root_certificates(ca.clone())
            .require_tls(true)
    };
    round_trip(&srv, &["--tls-ca", ca.to_str().unwrap()], client_opts()).await;
    // Without the CA the server's certificate is not trusted: exit 2.
    let out = std::process::Command::new(jetworker_bin())
        .args(["workers", "--server", &srv.url()])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    drop(srv);

    // Mutual TLS: the server requires a client certificate from the CA.
    let srv = NatsServer::start_with(&[&format!(
        "tls {{ cert_file: \"{}\", key_file: \"{}\", ca_file: \"{}\", verify: true }}",
        scert.display(),
        skey.display(),
        ca.display()
    )]);
    round_trip(
        &srv,
        &[
            "--tls-ca",
            ca.to_str().unwrap(),
            "--tls-cert",
            ccert.to_str().unwrap(),
            "--tls-key",
            ckey.to_str().unwrap(),
        ],
        client_opts().add_client_certificate(ccert.clone(), ckey.clone()),
    )
    .await;
    // Without a client certificate the server refuses: exit 2.
    let out = std::process::Command::new(jetworker_bin())
        .args([
            "workers",
            "--server",
            &srv.url(),
            "--tls-ca",
            ca.to_str().unwrap(),
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "{out:?}");
}

/// `jetworker <args>` with only `env` (plus PATH/HOME) set: no --server, so
/// the context and the variables decide.
fn jw_env(args: &[&str], env: &[(&str, &str)]) -> std::process::Output {
    let mut c = std::process::Command::new(jetworker_bin());
    c.args(args).env_clear().stdin(std::process::Stdio::null());
    for k in ["PATH", "HOME"] {
        if let Some(v) = std::env::var_os(k) {
            c.env(k, v);
        }
    }
    for (k, v) in env {
        c.env(k, v);
    }
    c.output().unwrap()
}

/// A `nats` CLI context directory (`<home>/nats`) with these contexts,
/// `selected` written to context.txt.
fn nats_contexts(home: &std::path::Path, selected: &str, contexts: &[(&str, String)]) {
    let dir = home.join("nats");
    std::fs::create_dir_all(dir.join("context")).unwrap();
    std::fs::write(dir.join("context.txt"), selected).unwrap();
    for (name, json) in contexts {
        std::fs::write(dir.join(format!("context/{name}.json")), json).unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_context_merges_field_by_field_as_natscli() {
    let srv = NatsServer::start_with(&["authorization { token: \"ctx-tok\" }"]);
    let home = tempfile::tempdir().unwrap();
    let xdg = home.path().to_str().unwrap();
    // The selected context names a dead URL and the right token; another
    // context a wrong token.
    nats_contexts(
        home.path(),
        "tenant",
        &[
            (
                "tenant",
                r#"{"url":"nats://127.0.0.1:1","token":"ctx-tok"}"#.to_string(),
            ),
            (
                "other",
                format!(r#"{{"url":"{}","token":"wrong"}}"#, srv.url()),
            ),
        ],
    );
    // NATS_URL replaces only the URL: the context's token stays.
    let o = jw_env(
        &["setup"],
        &[("XDG_CONFIG_HOME", xdg), ("NATS_URL", &srv.url())],
    );
    assert_eq!(o.status.code(), Some(0), "{o:?}");
    // config check names each source.
    let o = jw_env(
        &["config", "check", "--show-sources"],
        &[("XDG_CONFIG_HOME", xdg), ("NATS_URL", &srv.url())],
    );
    assert_eq!(o.status.code(), Some(0), "{o:?}");
    let out = String::from_utf8_lossy(&o.stdout);
    let line = |key: &str| {
        out.lines()
            .find(|l| l.starts_with(&format!("{key} ")))
            .unwrap_or_else(|| panic!("{key} in {out}"))
            .to_string()
    };
    assert!(line("server").ends_with("# env NATS_URL"), "{out}");
    assert!(line("token").contains("nats context tenant"), "{out}");
    assert!(line("token").contains("(hidden)"), "{out}");
    assert!(!out.contains("ctx-tok"), "a secret was printed: {out}");
    assert!(line("slots").ends_with("# default"), "{out}");
    // --context picks another context (wrong token: refused, exit 2) ...
    let o = jw_env(
        &["workers", "--context", "other"],
        &[("XDG_CONFIG_HOME", xdg)],
    );
    assert_eq!(o.status.code(), Some(2), "{o:?}");
    // ... and a flag overrides the context's field.
    let o = jw_env(
        &["workers", "--context", "other", "--token", "ctx-tok"],
        &[("XDG_CONFIG_HOME", xdg)],
    );
    assert_eq!(o.status.code(), Some(0), "{o:?}");
    // A secret on the command line draws a warning.
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("--token-file"),
        "{o:?}"
    );
    // --no-context: the context's token is gone, NATS_TOKEN supplies one.
    let o = jw_env(
        &["workers", "--no-context", "--server", &srv.url()],
        &[("XDG_CONFIG_HOME", xdg)],
    );
    assert_eq!(o.status.code(), Some(2), "{o:?}");
    let o = jw_env(
        &["workers", "--no-context"],
        &[
            ("XDG_CONFIG_HOME", xdg),
            ("NATS_URL", &srv.url()),
            ("NATS_TOKEN", "ctx-tok"),
        ],
    );
    assert_eq!(o.status.code(), Some(0), "{o:?}");
    // NATS_CONTEXT selects a context as --context does.
    let o = jw_env(
        &["workers"],
        &[("XDG_CONFIG_HOME", xdg), ("NATS_CONTEXT", "other")],
    );
    assert_eq!(o.status.code(), Some(2), "{o:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_user_password_variables_and_secret_files() {
    let srv = NatsServer::start_with(&["authorization { user: jw, password: \"pw-2\" }"]);
    let none = tempfile::tempdir().unwrap();
    let xdg = none.path().to_str().unwrap();
    let o = jw_env(
        &["setup"],
        &[
            ("XDG_CONFIG_HOME", xdg),
            ("NATS_URL", &srv.url()),
            ("NATS_USER", "jw"),
            ("NATS_PASSWORD", "pw-2"),
        ],
    );
    assert_eq!(o.status.code(), Some(0), "{o:?}");
    assert!(
        !String::from_utf8_lossy(&o.stderr).contains("visible"),
        "no warning for the environment: {o:?}"
    );
    // --password-file and JETWORKER_PASSWORD_FILE.
    let pw = none.path().join("pw");
    std::fs::write(&pw, "pw-2\n").unwrap();
    let o = jw_env(
        &[
            "workers",
            "--server",
            &srv.url(),
            "--user",
            "jw",
            "--password-file",
            pw.to_str().unwrap(),
        ],
        &[("XDG_CONFIG_HOME", xdg)],
    );
    assert_eq!(o.status.code(), Some(0), "{o:?}");
    let o = jw_env(
        &["workers", "--server", &srv.url()],
        &[
            ("XDG_CONFIG_HOME", xdg),
            ("JETWORKER_USER", "jw"),
            ("JETWORKER_PASSWORD_FILE", pw.to_str().unwrap()),
        ],
    );
    assert_eq!(o.status.code(), Some(0), "{o:?}");
    // The worker takes the same settings.
    let _w = ProcWorker::start(
        &srv.url(),
        &["--user", "jw", "--password-file", pw.to_str().unwrap()],
    );
    let client = async_nats::ConnectOptions::with_user_and_password("jw".into(), "pw-2".into())
        .connect(srv.url())
        .await
        .unwrap();
    let js = async_nats::jetstream::new(client);
    publish_task(
        &js,
        "default",
        r#"{"id":"pwfile","type":"shell","payload":"true"}"#,
    )
    .await;
    assert_eq!(final_result(&js, "pwfile", T).await.status, Status::Success);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inbox_prefix_and_js_domain_reach_the_requests() {
    // A user who may subscribe only to replies under _INBOX_team.
    let srv = NatsServer::start_with(&[
        "authorization { users: [ { user: jw, password: pw, permissions: { publish: \">\", subscribe: [\"_INBOX_team.>\"] } } ] }",
    ]);
    let none = tempfile::tempdir().unwrap();
    let xdg = none.path().to_str().unwrap();
    let env = [
        ("XDG_CONFIG_HOME", xdg),
        ("JETWORKER_USER", "jw"),
        ("JETWORKER_PASSWORD", "pw"),
    ];
    let url = srv.url();
    let o = jw_env(
        &["setup", "--server", &url, "--inbox-prefix", "_INBOX_team"],
        &env,
    );
    assert_eq!(o.status.code(), Some(0), "{o:?}");
    let o = jw_env(&["workers", "--server", &url, "--api-timeout", "1s"], &env);
    assert_eq!(
        o.status.code(),
        Some(2),
        "replies on _INBOX are denied: {o:?}"
    );
    let o = jw_env(
        &["workers", "--server", &url, "--inbox-prefix", "_INBOX_team"],
        &env,
    );
    assert_eq!(o.status.code(), Some(0), "{o:?}");
    drop(srv);

    // A server in JetStream domain `hub`: the API answers on $JS.hub.API.
    let srv = NatsServer::start_with(&["jetstream { domain: hub }"]);
    let url = srv.url();
    let env = [("XDG_CONFIG_HOME", xdg)];
    let o = jw_env(&["setup", "--server", &url, "--js-domain", "hub"], &env);
    assert_eq!(o.status.code(), Some(0), "{o:?}");
    let o = jw_env(
        &[
            "workers",
            "--server",
            &url,
            "--js-domain",
            "elsewhere",
            "--api-timeout",
            "1s",
        ],
        &env,
    );
    assert_eq!(
        o.status.code(),
        Some(2),
        "no JetStream in that domain: {o:?}"
    );
}
