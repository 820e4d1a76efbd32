//! A task type of your own: `greet` tasks run an async Rust function in the
//! worker. Start a worker with it, submit one task, print its result.
//!
//!     nats-server -js &
//!     NATS_URL=nats://127.0.0.1:4222 cargo run --example custom_runner

use std::io::Write;
use std::time::Duration;

use jetworker::runner::in_process::{function, TaskContext};
use jetworker::{config::WorkerConfig, protocol::TaskResult, Worker};

/// The fields of a `greet` task: `{"type":"greet","name":"world"}`.
#[derive(Clone, serde::Deserialize, schemars::JsonSchema)]
struct Greet {
    /// Who to greet.
    name: String,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let url = std::env::var("NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".into());
    let state = tempfile::tempdir()?;
    let greet = function("greet", |f: Greet, ctx: TaskContext| async move {
        writeln!(ctx.stdout(), "hello {} (attempt {})", f.name, ctx.attempt())?;
        Ok(())
    });
    let stop = tokio_util::sync::CancellationToken::new();
    let worker = Worker::builder()
        .config(WorkerConfig::for_server(&url, state.path()))
        .runner(greet)
        .run(stop.clone());
    let worker = tokio::spawn(worker);

    // Submit a task (retrying while the worker creates the streams) and
    // wait for its final result.
    let js = async_nats::jetstream::new(async_nats::connect(&url).await?);
    let task = r#"{"type":"greet","id":"greet-example","name":"world"}"#;
    while js
        .publish("tasks.default", task.into())
        .await?
        .await
        .is_err()
    {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let result: TaskResult = loop {
        let stream = js.get_stream("RESULTS").await?;
        if let Ok(m) = stream
            .get_last_raw_message_by_subject("results.greet-example")
            .await
        {
            let r: TaskResult = serde_json::from_slice(&m.payload)?;
            if r.is_final {
                break r;
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    println!("{}: {}", result.status, result.output.trim_end());
    stop.cancel();
    worker.await??;
    Ok(())
}
