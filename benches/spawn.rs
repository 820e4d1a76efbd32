//! Raw spawn cost of a task process: a program spawned and waited for, over
//! and over, through `tokio::process::Command` (as the worker does), with
//! more and more of jetworker's process setup:
//!
//! - (a) a plain command — std takes the `posix_spawn` (vfork-like) path;
//! - (b) plus `process_group(0)` — still `posix_spawn` (`POSIX_SPAWN_SETPGROUP`);
//! - (c) jetworker's full setup, `jetworker::process::configure(&mut cmd,
//!   None, ChildLimits::default())`: the process group plus a `pre_exec`
//!   hook that sets the parent-death signal, which makes std fall back to
//!   fork + exec;
//! - (d) as (c) with all four rlimits set (more syscalls in the hook);
//! - (e) no process setup, but `true` named without a path and the
//!   environment the runner gives a task (`env_clear` + `PATH`): std then
//!   also takes the fork path, to search the child's PATH.
//!
//! `bash -c true` is measured plain and under (c), since shell tasks pay
//! bash's start-up on top. Finally (a), (c) and (e) are measured again
//! after the bench process has touched a growing heap ("ballast", 4 KiB
//! pages): fork copies the parent's page tables, `posix_spawn` does not, so
//! the gap grows with the worker's resident size.
//!
//! Stdio is `/dev/null` in every variant, so only the spawn path differs.
//! Each measurement spawns N processes split over `conc` concurrent loops on
//! a 2-thread runtime; the variants are interleaved round by round (each
//! round starting at the next variant) so that drifting machine load hits
//! them alike, and the median of the rounds is printed with its ratio to (a)
//! at the same concurrency.
//!
//! Run: `cargo bench --bench spawn`. Settings (environment): `SPAWN_N`
//! (default 2000), `SPAWN_ROUNDS` (5), `SPAWN_BALLAST_MIB` (heap sizes,
//! default `10,64,256`, N/10 spawns each; 10 MiB brings this process to
//! the peak RSS of a worker in `benches/throughput.rs`).

mod common;

use std::process::Stdio;
use std::time::Instant;

use jetworker::process::{configure, ChildLimits};
use tokio::process::Command;

/// How the command is prepared before spawning.
#[derive(Clone, Copy)]
enum Setup {
    Plain,
    Group,
    Jetworker,
    JetworkerLimits,
    /// No process setup, but the environment the runner gives a task:
    /// `env_clear` and a `PATH`. A program named without a `/` is then
    /// looked up in the child's PATH, which std does only on its fork path.
    RunnerEnv,
}

/// One line of the table.
struct Variant {
    name: &'static str,
    program: &'static str,
    args: &'static [&'static str],
    setup: Setup,
}

const VARIANTS: &[Variant] = &[
    Variant {
        name: "(a) /bin/true, plain",
        program: "/bin/true",
        args: &[],
        setup: Setup::Plain,
    },
    Variant {
        name: "(b) /bin/true, process_group(0)",
        program: "/bin/true",
        args: &[],
        setup: Setup::Group,
    },
    Variant {
        name: "(c) /bin/true, jetworker configure",
        program: "/bin/true",
        args: &[],
        setup: Setup::Jetworker,
    },
    Variant {
        name: "(d) /bin/true, configure + rlimits",
        program: "/bin/true",
        args: &[],
        setup: Setup::JetworkerLimits,
    },
    Variant {
        name: "(e) true by name, runner's env, plain",
        program: "true",
        args: &[],
        setup: Setup::RunnerEnv,
    },
    Variant {
        name: "bash -c true, plain",
        program: "bash",
        args: &["-c", "true"],
        setup: Setup::Plain,
    },
    Variant {
        name: "bash -c true, jetworker configure",
        program: "bash",
        args: &["-c", "true"],
        setup: Setup::Jetworker,
    },
];

/// The rlimits of (d): a typical task's memory, CPU time, process and file
/// limits, all generous enough for `/bin/true`.
const LIMITS: ChildLimits = ChildLimits {
    memory: Some(256 << 20),
    cpu_seconds: Some(60),
    pids: Some(4096),
    nofile: Some(1024),
};

fn command(v: &Variant) -> Command {
    let mut cmd = Command::new(v.program);
    cmd.args(v.args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    match v.setup {
        Setup::Plain => {}
        Setup::Group => {
            cmd.process_group(0);
        }
        Setup::Jetworker => configure(&mut cmd, None, ChildLimits::default(), Vec::new()),
        Setup::JetworkerLimits => configure(&mut cmd, None, LIMITS, Vec::new()),
        Setup::RunnerEnv => {
            cmd.env_clear().env("PATH", "/usr/local/bin:/usr/bin:/bin");
        }
    }
    cmd
}

/// Spawn and wait for `n` processes over `conc` concurrent loops; spawns/s.
async fn measure(v: &'static Variant, n: usize, conc: usize) -> f64 {
    let per_loop = n / conc;
    let start = Instant::now();
    let mut loops = tokio::task::JoinSet::new();
    for _ in 0..conc {
        loops.spawn(async move {
            for _ in 0..per_loop {
                let status = command(v)
                    .spawn()
                    .unwrap_or_else(|e| panic!("{}: spawn: {e}", v.name))
                    .wait()
                    .await
                    .unwrap_or_else(|e| panic!("{}: wait: {e}", v.name));
                assert!(status.success(), "{}: {status}", v.name);
            }
        });
    }
    while let Some(r) = loops.join_next().await {
        r.expect("spawn loop panicked");
    }
    (per_loop * conc) as f64 / start.elapsed().as_secs_f64()
}

const CONCURRENCY: [usize; 2] = [1, 2];

/// Interleaved rounds over `variants`; the median spawns/s of each
/// (variant, concurrency), indexed `[variant][conc]`.
async fn rounds(variants: &[&'static Variant], n: usize, rounds: usize) -> Vec<Vec<f64>> {
    let mut samples = vec![vec![Vec::new(); CONCURRENCY.len()]; variants.len()];
    for round in 0..rounds {
        for (ci, &conc) in CONCURRENCY.iter().enumerate() {
            // Each round starts at another variant, so none is always the
            // first after a pause or a change of concurrency.
            for k in 0..variants.len() {
                let vi = (round + k) % variants.len();
                samples[vi][ci].push(measure(variants[vi], n, conc).await);
            }
        }
    }
    samples
        .iter()
        .map(|per_conc| per_conc.iter().map(|s| common::median(s)).collect())
        .collect()
}

/// Print one table, with ratios to its first row.
fn print_table(title: &str, variants: &[&Variant], medians: &[Vec<f64>]) {
    println!("\n{title}");
    print!("{:<40}", "variant");
    for c in CONCURRENCY {
        print!("  {:>17}", format!("conc {c}: /s  x(a)"));
    }
    println!();
    for (v, m) in variants.iter().zip(medians) {
        print!("{:<40}", v.name);
        for ci in 0..CONCURRENCY.len() {
            print!("  {:>10.0}  {:>5.2}", m[ci], m[ci] / medians[0][ci]);
        }
        println!();
    }
}

/// Allocate and touch `mib` MiB in 4 KiB pages (no transparent huge
/// pages), as a long-running worker's heap would be.
fn ballast(mib: usize) -> Vec<u8> {
    let len = mib << 20;
    let mut v: Vec<u8> = Vec::with_capacity(len);
    // SAFETY: advice on memory this Vec owns. Should it fail, THP may back
    // the heap and the ballast rows understate what fork costs.
    unsafe {
        libc::madvise(v.as_mut_ptr().cast(), len, libc::MADV_NOHUGEPAGE);
    }
    v.resize(len, 1);
    v
}

fn thp_mode() -> String {
    std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled")
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|_| "unknown".into())
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let n = common::env_usize("SPAWN_N", 2000);
    let nrounds = common::env_usize("SPAWN_ROUNDS", 5);
    let ballast_mib: Vec<usize> = std::env::var("SPAWN_BALLAST_MIB")
        .unwrap_or_else(|_| "10,64,256".into())
        .split(',')
        .map(|s| {
            s.trim()
                .parse()
                .unwrap_or_else(|_| panic!("SPAWN_BALLAST_MIB: `{s}` is not a size in MiB"))
        })
        .collect();
    println!(
        "spawn: {n} spawns per measurement, median of {nrounds} interleaved rounds; \
         {} CPUs; THP {}",
        std::thread::available_parallelism().map_or(0, |p| p.get()),
        thp_mode()
    );

    let all: Vec<&'static Variant> = VARIANTS.iter().collect();
    // Warm the page cache and the runtime; not reported.
    for &v in &all {
        measure(v, 50, 1).await;
    }
    let medians = rounds(&all, n, nrounds).await;
    print_table(
        &format!(
            "spawn + wait, spawns/s (bench process RSS {:.0} MiB)",
            common::peak_rss_mib()
        ),
        &all,
        &medians,
    );

    // (a), (c) and (e).
    let some: Vec<&'static Variant> = vec![&VARIANTS[0], &VARIANTS[2], &VARIANTS[4]];
    let n_big = (n / 10).max(CONCURRENCY.len());
    let mut heap: Vec<Vec<u8>> = Vec::new();
    for mib in ballast_mib {
        let have = heap.iter().map(Vec::len).sum::<usize>() >> 20;
        if mib > have {
            heap.push(ballast(mib - have));
        }
        let medians = rounds(&some, n_big, nrounds).await;
        print_table(
            &format!(
                "with {mib} MiB of touched heap (RSS {:.0} MiB), {n_big} spawns per measurement",
                common::peak_rss_mib()
            ),
            &some,
            &medians,
        );
    }
}
