//! The `jetworker` binary: parse arguments, set up logging, run the chosen
//! subcommand, map the outcome to an exit code (0 ok, 1 a task did not
//! succeed, 2 usage, configuration or connection error).

use std::process::ExitCode;

fn main() -> ExitCode {
    jetworker::internals::main()
}
