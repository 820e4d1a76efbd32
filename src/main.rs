//! The `jetworker` binary: parse arguments, set up logging, run the chosen
//! subcommand, map the outcome to an exit code (0 ok, 1 a task did not
//! succeed, 2 usage, configuration or connection error).

use std::process::ExitCode;

/// mimalloc instead of glibc's allocator: the worker allocates and frees
/// small buffers on every task across its runtime threads, and glibc's
/// arenas spent about a fifth of the worker's CPU on it (`malloc_consolidate`
/// after every large read buffer freed, `unlink_chunk`); BENCHMARKS.md,
/// "Idle memory and worker CPU". Programs that embed the library choose
/// their own.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    jetworker::internals::main()
}
