//! Build script: link the `jetworker` binary with packed relative
//! relocations (`-z pack-relative-relocs`, DT_RELR) where the linker and
//! the C library support them.
//!
//! Why: the binary is position-independent, and its ~65,000 relative
//! relocations take 1.5 MB as classic `.rela.dyn` entries, which the
//! dynamic loader reads in full at every start, so they stay resident in
//! every worker (BENCHMARKS.md, "Idle memory and worker CPU"). Packed,
//! they take about 22 KB. The executable stays position-independent (ASLR is unchanged).
//!
//! DT_RELR needs glibc ≥ 2.36 at run time and a linker that knows the
//! flag (GNU ld ≥ 2.38, lld ≥ 15). Rather than guess from versions, the
//! script links and runs a tiny position-independent C program with the
//! flag, using the linker cargo would use; only if that works does the
//! binary get the flag. Cross builds (the probe's result would be the
//! host's) and `JETWORKER_NO_RELR=1` skip it.

use std::env;
use std::path::PathBuf;
use std::process::Command;

const FLAG: &str = "-Wl,-z,pack-relative-relocs";

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-env-changed=JETWORKER_NO_RELR");
    println!("cargo:rerun-if-env-changed=RUSTC_LINKER");
    let var = |k: &str| env::var(k).unwrap_or_default();
    if var("CARGO_CFG_TARGET_OS") != "linux"
        || var("CARGO_CFG_TARGET_ENV") != "gnu"
        || var("HOST") != var("TARGET")
        || env::var_os("JETWORKER_NO_RELR").is_some()
    {
        return;
    }
    if probe() {
        println!("cargo:rustc-link-arg-bins={FLAG}");
    }
}

/// Link a PIE with one relative relocation and the flag, then run it.
fn probe() -> bool {
    let Some(out) = env::var_os("OUT_DIR").map(PathBuf::from) else {
        return false;
    };
    let src = out.join("relr_probe.c");
    let exe = out.join("relr_probe");
    let program = "static int x = 7; int *p = &x; int main(void) { return *p == 7 ? 0 : 1; }\n";
    if std::fs::write(&src, program).is_err() {
        return false;
    }
    let cc = env::var("RUSTC_LINKER").unwrap_or_else(|_| "cc".into());
    let linked = Command::new(&cc)
        .args(["-fPIE", "-pie", FLAG, "-o"])
        .arg(&exe)
        .arg(&src)
        .output()
        .is_ok_and(|o| o.status.success());
    linked && Command::new(&exe).status().is_ok_and(|s| s.success())
}
