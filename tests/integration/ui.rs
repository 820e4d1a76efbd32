//! `jetworker ui` in a real browser (headless Chromium over the DevTools
//! protocol, `browser.rs`) against a real server, real workers and the
//! built binary: workers appear and grey out, a submitted task's live
//! output grows and ends in its stored output, `<script>` in output stays
//! text, actions need `--allow-actions`, the CSRF token and (where set)
//! the token, a non-loopback bind needs a token, and every view renders
//! what the broker holds.
//!
//! With `JETWORKER_UI_SCREENSHOTS=<dir>` (relative to the crate) the tests
//! save PNGs of the views there (the README shows them).

use std::path::PathBuf;
use std::time::Duration;

use serde_json::json;

use super::browser::{Browser, Page};
use super::ui_util::{http, ui_command, UiProc};
use super::util::{self, publish_task, InProcWorker, NatsServer, ProcWorker};

const T: Duration = Duration::from_secs(20);

/// Where screenshots go, if anywhere.
fn screenshot_dir() -> Option<PathBuf> {
    let d = std::env::var_os("JETWORKER_UI_SCREENSHOTS")?;
    Some(PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(d))
}

async fn shot(page: &Page<'_>, name: &str) {
    if let Some(d) = screenshot_dir() {
        // No toast over the view; let the last layout and chart draw
        // settle into the frame.
        page.eval(
            "document.getElementById('toast').hidden = true; \
             new Promise(r => requestAnimationFrame(() => requestAnimationFrame(r)))",
        )
        .await;
        page.screenshot(&d.join(format!("{name}.png"))).await;
    }
}

/// A JavaScript string literal.
fn js(s: &str) -> String {
    serde_json::to_string(s).unwrap()
}

fn no_errors(page: &Page<'_>) {
    let e = page.errors();
    assert!(e.is_empty(), "the page threw: {e:?}");
}

/// The page's CSRF token.
async fn csrf(page: &Page<'_>) -> String {
    page.eval("document.querySelector('meta[name=\"jetworker-csrf\"]').content")
        .await
        .as_str()
        .unwrap()
        .to_string()
}

/// Wait until task `id` runs.
async fn running(js: &async_nats::jetstream::Context, id: &str) {
    util::wait_for(T, &format!("{id} running"), || async {
        util::last_result(js, id)
            .await
            .filter(|r| r.status == jetworker::protocol::Status::Running)
    })
    .await;
}

/// `POST /api/actions/cancel` for `long-1` with `headers`.
fn post_cancel(port: u16, headers: &[(&str, &str)]) -> super::ui_util::Response {
    http(
        port,
        "POST",
        "/api/actions/cancel",
        headers,
        r#"{"id":"long-1"}"#,
    )
}

/// Selector of a worker's row.
fn worker_row(prefix: &str) -> String {
    format!(
        "document.querySelector('#workers-table .row[data-id^={}]')",
        js(prefix)
    )
}

#[tokio::test]
async fn ui_shows_workers_live_and_greys_one_out_after_sigkill() {
    let Some(browser) = Browser::launch() else {
        return;
    };
    let srv = NatsServer::start();
    let mut victim = ProcWorker::start(&srv.url(), &["--name", "victim", "--labels", "default"]);
    let ui = UiProc::start(&srv.url(), &[]);
    let page = browser.new_page().await;
    page.goto(&ui.url).await;
    page.wait("the snapshot", T, "document.body.dataset.ready === '1'")
        .await;

    // The worker appears, online, with its label and slots.
    let row = worker_row("victim-");
    page.wait(
        "the worker's row",
        T,
        &format!("{row} && !{row}.classList.contains('offline')"),
    )
    .await;
    let text = page.eval(&format!("{row}.innerText")).await;
    let text = text.as_str().unwrap();
    assert!(text.contains("default") && text.contains("0 / "), "{text}");
    // A second worker joining shows up without a reload.
    let late = ProcWorker::start(&srv.url(), &["--name", "late", "--labels", "gpu"]);
    let late_row = worker_row("late-");
    page.wait("the late worker's row", T, &late_row).await;

    // SIGKILL: no clean stop, the key expires (offline TTL 3 s) and the
    // row greys out, with no reload.
    victim.kill();
    page.wait(
        "the killed worker to grey out",
        Duration::from_secs(30),
        &format!("{row}.classList.contains('offline')"),
    )
    .await;
    let seen = page.eval(&format!("{row}.innerText")).await;
    assert!(seen.as_str().unwrap().contains("expired"), "{seen}");
    assert_eq!(
        page.eval(&format!("{late_row}.classList.contains('offline')"))
            .await,
        json!(false),
        "the other worker stays online"
    );
    // The summary counts it.
    page.wait(
        "the summary",
        T,
        "document.getElementById('workers-summary').textContent.startsWith('1 online, 1 offline')",
    )
    .await;
    drop(late);
    no_errors(&page);
}

/// A task that prints markup slowly.
const SLOW_SCRIPT_TASK: &str = "for i in 1 2 3 4 5 6 7 8 9 10; do \
    echo \"line $i <script>window.__xss=1</script><img src=x onerror=window.__xss=2>\"; \
    sleep 0.3; done";

#[tokio::test]
async fn ui_submits_a_task_and_follows_its_live_output_as_text() {
    let Some(browser) = Browser::launch() else {
        return;
    };
    let srv = NatsServer::start();
    let _w = InProcWorker::start(|c| c.labels = vec!["default".into()], &srv.url());
    let ui = UiProc::start(&srv.url(), &["--allow-actions"]);
    let page = browser.new_page().await;
    page.goto(&format!("{}/#/submit", ui.url)).await;
    page.wait(
        "the schema",
        T,
        "document.getElementById('s-submit').disabled === false",
    )
    .await;

    // The form checks the task against the JSON Schema as it is typed.
    let set = |task: &str| {
        format!(
            "(() => {{ const t = document.getElementById('s-task'); t.value = {}; \
             t.dispatchEvent(new Event('input')); return true; }})()",
            js(task)
        )
    };
    page.eval(&set(r#"{"type":"shel","script":"x","timout":"1s"}"#))
        .await;
    let errs = page
        .eval("document.getElementById('s-errors').innerText")
        .await;
    let errs = errs.as_str().unwrap();
    assert!(
        errs.contains("$.type") && errs.contains("$.timout: unknown field"),
        "{errs}"
    );
    assert_eq!(
        page.eval("document.getElementById('s-submit').disabled")
            .await,
        json!(true)
    );

    let task = json!({"type": "shell", "id": "live-1", "script": SLOW_SCRIPT_TASK}).to_string();
    page.eval(&set(&task)).await;
    page.eval("document.getElementById('s-submit').click()")
        .await;
    // The page goes to the task and follows its output as it grows.
    page.wait(
        "the task page",
        T,
        "location.hash === '#/task/live-1' && document.getElementById('task-id').textContent === 'live-1'",
    )
    .await;
    page.wait(
        "the first lines",
        T,
        "document.getElementById('task-live').textContent.includes('line 2')",
    )
    .await;
    let early = page
        .eval("document.getElementById('task-live').textContent.length")
        .await
        .as_u64()
        .unwrap();
    page.wait(
        "more lines",
        T,
        "document.getElementById('task-live').textContent.includes('line 6')",
    )
    .await;
    let later = page
        .eval("document.getElementById('task-live').textContent.length")
        .await
        .as_u64()
        .unwrap();
    assert!(later > early, "live output grew: {early} → {later}");
    // Markup in output is text: shown literally, never parsed or run.
    let live = page
        .eval("document.getElementById('task-live').textContent")
        .await;
    assert!(
        live.as_str()
            .unwrap()
            .contains("<script>window.__xss=1</script>"),
        "{live}"
    );
    assert_eq!(
        page.eval("document.querySelectorAll('#task-live script, #task-live img').length")
            .await,
        json!(0)
    );
    shot(&page, "task-live").await;

    // The final result: the stored output replaces the live view.
    page.wait(
        "the final result",
        Duration::from_secs(30),
        "document.getElementById('task-status').textContent === 'success' && \
         document.getElementById('task-live-box').hidden",
    )
    .await;
    let stored = page
        .eval("document.querySelector('#task-attempts pre.output').textContent")
        .await;
    let stored = stored.as_str().unwrap();
    assert!(
        stored.contains("line 10 <script>window.__xss=1</script>"),
        "{stored}"
    );
    assert_eq!(
        page.eval("document.querySelectorAll('#task-attempts script, #task-attempts img').length")
            .await,
        json!(0)
    );
    assert_eq!(page.eval("typeof window.__xss").await, json!("undefined"));

    // The results list has it, live (the page was open when it finished).
    page.eval("location.hash = '#/results'").await;
    page.wait(
        "the results row",
        T,
        "[...document.querySelectorAll('#results-table a.id')].some(a => a.textContent === 'live-1')",
    )
    .await;
    no_errors(&page);
}

#[tokio::test]
async fn ui_cancel_needs_allow_actions_csrf_and_the_token() {
    let Some(browser) = Browser::launch() else {
        return;
    };
    let srv = NatsServer::start();
    let js_ctx = srv.js().await;
    let _w = InProcWorker::start(|c| c.labels = vec!["default".into()], &srv.url());
    publish_task(
        &js_ctx,
        "default",
        r#"{"type":"shell","id":"long-1","script":"sleep 60"}"#,
    )
    .await;
    running(&js_ctx, "long-1").await;

    // Read-only: no cancel button, and the API refuses even with the CSRF.
    {
        let ui = UiProc::start(&srv.url(), &[]);
        let page = browser.new_page().await;
        page.goto(&format!("{}/#/task/long-1", ui.url)).await;
        page.wait(
            "the running task",
            T,
            "document.getElementById('task-status').textContent === 'running'",
        )
        .await;
        assert_eq!(
            page.eval("document.getElementById('task-cancel').checkVisibility()")
                .await,
            json!(false),
            "no cancel button without --allow-actions"
        );
        let token = csrf(&page).await;
        let r = post_cancel(
            ui.port,
            &[
                ("Content-Type", "application/json"),
                ("X-Jetworker-Csrf", &token),
            ],
        );
        assert_eq!(r.status, 403, "{r:?}");
        assert!(r.body.contains("--allow-actions"), "{r:?}");
        // GET is not an action route.
        assert_eq!(
            http(ui.port, "GET", "/api/actions/cancel", &[], "").status,
            405
        );
        no_errors(&page);
    }

    // Actions and a token.
    let secret = "tok-0123456789abcdef";
    let ui = UiProc::start(&srv.url(), &["--allow-actions", "--ui-token", secret]);
    let bearer = format!("Bearer {secret}");
    let r = post_cancel(ui.port, &[("Content-Type", "application/json")]);
    assert_eq!(r.status, 401, "no token: {r:?}");
    let r = post_cancel(
        ui.port,
        &[
            ("Content-Type", "application/json"),
            ("Authorization", &bearer),
        ],
    );
    assert_eq!(r.status, 403, "token but no CSRF: {r:?}");
    assert!(
        util::last_result(&js_ctx, "long-1").await.unwrap().status
            == jetworker::protocol::Status::Running,
        "nothing was cancelled yet"
    );

    // In the browser: the token once in the address becomes a cookie, the
    // button sends the CSRF token, the task is cancelled.
    let page = browser.new_page().await;
    page.goto(&format!("{}/?token={secret}", ui.url)).await;
    assert_eq!(
        page.eval("location.search").await,
        json!(""),
        "token left the address"
    );
    page.eval("location.hash = '#/task/long-1'").await;
    page.wait(
        "the running task",
        T,
        "document.getElementById('task-status').textContent === 'running' && \
         document.getElementById('task-cancel').checkVisibility()",
    )
    .await;
    // A cross-site request carrying the cookie would still lack the CSRF
    // token: the cookie alone is not enough.
    let cookie_only = page
        .eval(
            "fetch('/api/actions/cancel', {method: 'POST', headers: {'Content-Type': 'application/json'}, \
             body: JSON.stringify({id: 'long-1'})}).then(r => r.status)",
        )
        .await;
    assert_eq!(cookie_only, json!(403));
    page.eval("document.getElementById('task-cancel').click()")
        .await;
    page.wait(
        "the task to show cancelled",
        Duration::from_secs(30),
        "document.getElementById('task-status').textContent === 'cancelled'",
    )
    .await;
    let r = util::final_result(&js_ctx, "long-1", T).await;
    assert_eq!(r.status, jetworker::protocol::Status::Cancelled);
    no_errors(&page);
}

#[tokio::test]
async fn ui_on_a_non_loopback_address_needs_the_token() {
    let srv = NatsServer::start();
    // No token, no --insecure-no-auth: refused, exit 2.
    let out = ui_command(&srv.url(), &["--listen", "0.0.0.0:0"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("not a loopback address") && err.contains("--ui-token"),
        "{err}"
    );

    let Some(browser) = Browser::launch() else {
        return;
    };
    let secret = "another-token-4242";
    let ui = UiProc::start(&srv.url(), &["--listen", "0.0.0.0:0", "--ui-token", secret]);
    // Unreachable without the token: the page, the API, the feed.
    for path in [
        "/",
        "/api/events",
        "/api/results",
        "/api/tasks/x",
        "/api/schema",
    ] {
        let r = http(ui.port, "GET", path, &[], "");
        assert_eq!(r.status, 401, "{path}: {r:?}");
        assert!(!r.body.contains("jetworker-csrf"), "{path} leaked the page");
    }
    let r = http(ui.port, "GET", "/?token=wrong", &[], "");
    assert_eq!(r.status, 401);
    let r = http(
        ui.port,
        "GET",
        "/api/schema",
        &[("Authorization", &format!("Bearer {secret}"))],
        "",
    );
    assert_eq!(r.status, 200, "{r:?}");
    let r = http(ui.port, "GET", "/", &[], "");
    assert!(
        r.header("content-security-policy")
            .is_some_and(|c| c.contains("script-src 'self'")),
        "{r:?}"
    );

    // The browser gets the login form, not the dashboard; logging in
    // opens it.
    let page = browser.new_page().await;
    page.goto(&ui.url).await;
    assert_eq!(
        page.eval("document.getElementById('workers-table') === null && !!document.querySelector('form.login-box')")
            .await,
        json!(true)
    );
    page.eval(&format!(
        "document.querySelector('input[name=token]').value = {}; document.querySelector('form.login-box').submit(); true",
        js(secret)
    ))
    .await;
    page.wait(
        "the dashboard after logging in",
        T,
        "document.getElementById('workers-table') !== null && document.body.dataset.ready === '1'",
    )
    .await;
    no_errors(&page);
}

#[tokio::test]
async fn ui_views_render_results_dead_letters_and_schedules() {
    let Some(browser) = Browser::launch() else {
        return;
    };
    let srv = NatsServer::start();
    let js_ctx = srv.js().await;
    let _w1 = InProcWorker::start(
        |c| {
            c.labels = vec!["default".into(), "reports".into()];
            c.name = "alpha".into();
        },
        &srv.url(),
    );
    let _w2 = InProcWorker::start(
        |c| {
            c.labels = vec!["gpu".into()];
            c.name = "beta".into();
            c.slots = 2;
        },
        &srv.url(),
    );
    let ui = UiProc::start(&srv.url(), &["--allow-actions"]);
    // Results of several kinds.
    publish_task(
        &js_ctx,
        "default",
        r#"{"type":"shell","id":"ok-1","script":"echo fine"}"#,
    )
    .await;
    publish_task(
        &js_ctx,
        "gpu",
        r#"{"type":"shell","id":"bad-1","script":"echo oops >&2; exit 3","retry":{"max_attempts":2,"backoff":"100ms"}}"#,
    )
    .await;
    publish_task(
        &js_ctx,
        "reports",
        r#"{"type":"shell","id":"slow-1","script":"sleep 30"}"#,
    )
    .await;
    // Invalid: rejected to DEAD, with a secret in its env.
    publish_task(
        &js_ctx,
        "default",
        r#"{"type":"shell","id":"typo-1","script":"true","timout":"1s","env":{"API_KEY":"s3cret-value"}}"#,
    )
    .await;
    // A replayable dead letter (as a worker would write one).
    let mut h = async_nats::HeaderMap::new();
    h.insert("Jetworker-Reason", "attempts used up: workers vanished");
    h.insert("Jetworker-Task-Id", "lost-1");
    h.insert("Jetworker-Label", "default");
    h.insert("Jetworker-Status", "dead");
    jetworker::internals::ensure_all(&js_ctx, &Default::default(), &Default::default())
        .await
        .unwrap();
    js_ctx
        .publish_with_headers(
            "dead.default.lost-1",
            h,
            r#"{"type":"shell","id":"lost-1","script":"echo replayed"}"#.into(),
        )
        .await
        .unwrap()
        .await
        .unwrap();
    // A schedule, through the CLI.
    let add = [
        "schedule",
        "add",
        "nightly-report",
        "--cron",
        "0 30 2 * * *",
    ];
    let task = ["--label", "reports", "--", "echo nightly"];
    let out = super::cli::jw(&srv.url(), &[&add[..], &task[..]].concat()).await;
    assert!(
        out.status.success(),
        "schedule add: {}",
        super::cli::stderr(&out)
    );
    util::final_result(&js_ctx, "bad-1", T).await;
    util::final_result(&js_ctx, "ok-1", T).await;
    running(&js_ctx, "slow-1").await;

    let page = browser.new_page().await;
    page.goto(&ui.url).await;
    page.wait(
        "both workers",
        T,
        "document.querySelectorAll('#workers-table .body .row:not(.offline)').length === 2",
    )
    .await;
    page.wait(
        "the running task on its worker",
        T,
        &format!("{}.innerText.includes('slow-1')", worker_row("alpha-")),
    )
    .await;
    shot(&page, "workers").await;

    // Results: newest first, filters, a task's attempts.
    page.eval("location.hash = '#/results'").await;
    let ids = "[...document.querySelectorAll('#results-table .body a.id')].map(a => a.textContent)";
    page.wait(
        "the results",
        T,
        &format!("['ok-1','bad-1','slow-1','typo-1'].every(i => {ids}.includes(i))"),
    )
    .await;
    shot(&page, "results").await;
    page.eval(
        "document.getElementById('f-status').value = 'failed'; \
         document.querySelector('#results-filter button').click(); true",
    )
    .await;
    page.wait(
        "only the failed task",
        T,
        &format!("JSON.stringify({ids}) === '[\"bad-1\"]'"),
    )
    .await;
    page.eval("location.hash = '#/task/bad-1'").await;
    page.wait(
        "both attempts of bad-1",
        T,
        "document.querySelectorAll('#task-attempts .attempt').length >= 3 && \
         document.getElementById('task-status').textContent === 'failed'",
    )
    .await;
    let attempts = page
        .eval("document.getElementById('task-attempts').innerText")
        .await;
    let attempts = attempts.as_str().unwrap();
    assert!(
        attempts.contains("attempt 1 of 2")
            && attempts.contains("attempt 2 of 2")
            && attempts.contains("oops"),
        "{attempts}"
    );
    shot(&page, "task").await;

    // Dead letters: reason, original task with its secret masked; replay.
    // Three: the rejected task, the one written by hand, and bad-1, whose
    // final failure keeps its original in DEAD for a retry.
    page.eval("location.hash = '#/dead'").await;
    page.wait(
        "the dead letters",
        T,
        "document.querySelectorAll('#dead-table tbody tr').length === 3",
    )
    .await;
    let dead = page
        .eval("document.getElementById('dead-table').innerText")
        .await;
    let dead = dead.as_str().unwrap();
    assert!(dead.contains("typo-1") && dead.contains("timout"), "{dead}");
    assert!(
        dead.contains("API_KEY") && !dead.contains("s3cret-value"),
        "{dead}"
    );
    assert!(dead.contains("workers vanished"), "{dead}");
    assert!(dead.contains("bad-1") && dead.contains("failed"), "{dead}");
    shot(&page, "dead").await;
    page.eval(
        "[...document.querySelectorAll('#dead-table tbody tr')].find(tr => tr.innerText.includes('lost-1')) \
         .querySelector('button').click(); true",
    )
    .await;
    page.wait(
        "the replayed task",
        T,
        "location.hash === '#/task/lost-1-r1'",
    )
    .await;
    let r = util::final_result(&js_ctx, "lost-1-r1", T).await;
    assert_eq!(r.output.trim(), "replayed");
    page.wait(
        "its stored output",
        T,
        "document.getElementById('task-status').textContent === 'success'",
    )
    .await;

    // Schedules: spec, zone, next fire time.
    page.eval("location.hash = '#/schedules'").await;
    page.wait(
        "the schedule",
        T,
        "document.getElementById('schedules-table').innerText.includes('nightly-report')",
    )
    .await;
    let s = page
        .eval("document.getElementById('schedules-table').innerText")
        .await;
    let s = s.as_str().unwrap();
    assert!(
        s.contains("0 30 2 * * *") && s.contains("tasks.reports") && s.contains("(in "),
        "{s}"
    );
    shot(&page, "schedules").await;

    // Queues: one row per label with its workers; the chart has points.
    page.eval("location.hash = '#/queues'").await;
    page.wait(
        "the queues",
        T,
        "['default','gpu','reports'].every(l => [...document.querySelectorAll('#queues-table .body .id')].some(td => td.textContent === l))",
    )
    .await;
    page.wait(
        "points on the chart",
        T,
        "window.jetworkerUi.Chart.points.size > 0",
    )
    .await;
    let gpu_row = "[...document.querySelectorAll('#queues-table .body .row')].find(r => r.firstChild.textContent === 'gpu')";
    let reports_row = "[...document.querySelectorAll('#queues-table .body .row')].find(r => r.firstChild.textContent === 'reports')";
    // slow-1 runs on reports: one running, its worker listed.
    page.wait(
        "reports running 1",
        T,
        &format!("{reports_row}.children[2].textContent === '1' && {reports_row}.children[5].textContent === '1'"),
    )
    .await;
    // Pause and resume a label from the page.
    page.eval(&format!("{gpu_row}.querySelector('button').click(); true"))
        .await;
    page.wait(
        "gpu paused",
        T,
        &format!(
            "{gpu_row}.classList.contains('paused') && {gpu_row}.innerText.includes('paused')"
        ),
    )
    .await;
    let stats = jetworker::queues::queue_stats(&js_ctx, &Default::default(), Some("gpu"))
        .await
        .unwrap();
    assert!(stats[0].paused, "{stats:?}");
    shot(&page, "queues").await;
    page.eval(&format!("{gpu_row}.querySelector('button').click(); true"))
        .await;
    page.wait(
        "gpu resumed",
        T,
        &format!(
            "!{gpu_row}.classList.contains('paused') && {gpu_row}.innerText.includes('active')"
        ),
    )
    .await;
    page.eval("location.hash = '#/submit'").await;
    page.wait(
        "the form",
        T,
        "document.getElementById('s-submit').disabled === false",
    )
    .await;
    shot(&page, "submit").await;
    no_errors(&page);
}
