//! The tasks that run the workspace's crates in-process (benches, fetch-model,
//! tiny-model): built only with xtask's `full` feature, so that `cargo xtask test`
//! compiles none of the workspace before the tests build it once.

use std::process::Command;

use anyhow::{bail, Context, Result};
use ballast_runtime::backend::ops::*;

use crate::{
    cargo, codec_bench, moe_bench, neuron_bench, pack_bench, serve_bench, step, tier_bench,
    tricksy_bench, USAGE,
};

pub fn run(args: &[String]) -> Result<()> {
    match args.first().map(String::as_str) {
        Some("fetch-model") => match args.get(1) {
            Some(name) => fetch_named(name),
            None => fetch_model(),
        }
        .map(|_| ()),
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
        Some(other) => bail!("unknown task '{other}'\n\n{USAGE}"),
        None => bail!("no task\n\n{USAGE}"),
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

pub fn fetch_model() -> Result<std::path::PathBuf> {
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
    speed_table(&ballast, None, std::env::var_os("LLAMA_BENCH"), quick)?;
    // On an AVX-512 machine, the AVX2 kernels against a llama.cpp built without
    // AVX-512: what most users' machines run.
    if let Some(llama_avx2) = std::env::var_os("LLAMA_BENCH_AVX2") {
        speed_table(&ballast, Some("avx2"), Some(llama_avx2), quick)?;
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

/// `ballast bench` and llama-bench (when given) with the same flags, alternated, on the
/// default model and a K-quant one, as one table; `level` forces Ballast's kernel level
/// (`BALLAST_SIMD`), to be compared with a llama-bench built for that level.
fn speed_table(
    ballast: &std::path::Path,
    level: Option<&str>,
    llama: Option<std::ffi::OsString>,
    quick: bool,
) -> Result<()> {
    let reps = if quick { "3" } else { "5" };
    let rounds = if quick { 1 } else { 2 };
    let short = ["-p", "128", "-n", "128", "-r", reps, "-t", "1,2"];
    // Decode after 4,096 tokens of context, where attention costs most.
    let deep = ["-p", "0", "-n", "64", "-d", "4096", "-r", reps, "-t", "1,2"];
    let mut table = Vec::new();
    // The default model (Q4_1), a K-quant mix with Q5_0 where rows are not whole
    // superblocks, a Q4_K_M file (Q4_K and Q6_K layers, a Q8_0 head), and the default
    // model again at depth.
    let runs: [(&str, &[&str]); 4] = [
        ("smollm2-135m", &short),
        ("qwen2.5-coder-0.5b", &short),
        ("gemma3-270m", &short),
        ("smollm2-135m", &deep),
    ];
    for (name, flags) in runs {
        let model = fetch_named(name)?;
        let (mut ours, mut theirs) = (Speeds::new(), Speeds::new());
        let mut roof = std::collections::BTreeMap::new();
        for round in 0..rounds {
            // Alternate which goes first, so neither always meets a warm or a hot machine.
            for side in [round % 2, 1 - round % 2] {
                if side == 0 {
                    eprintln!("==> ballast bench {name} (round {})", round + 1);
                    let mut cmd = Command::new(ballast);
                    if let Some(level) = level {
                        cmd.env("BALLAST_SIMD", level);
                    }
                    let out = cmd
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
                        // Named as `ballast bench` names a test at depth.
                        let test = match r["n_depth"].as_u64() {
                            Some(d) if d > 0 => format!("{test} @ d{d}"),
                            _ => test,
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
    let level = level.map_or("the best this CPU has".to_string(), |l| {
        format!("forced to {l}")
    });
    println!("\n== Ballast and llama.cpp, same machine, same run, kernel level {level} ({rounds} round(s), alternated; t/s per round, ratio of the medians)");
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
    Ok(())
}

/// One decode step as the cache sees it, per mode and cache size: the update (evict the
/// token after 4 sinks, append one token to each of 30 layers) and then attention with
/// 9 query heads per layer, timed apart, at 1 and 2 threads (the update spreads large
/// memmoves over the threads, attention its heads). Prints medians and the KV bytes
/// moved per step.
fn bench_kv() -> Result<()> {
    use ballast_kv_cache::{new_cache, set_update_threads, KvElement, UpdateMode};
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
                let mut cache = new_cache(mode, shape, n, KvElement::F16)?;
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
