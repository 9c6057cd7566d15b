//! `cargo xtask bench-pack`: the compressed-weights lever on the default model, packed
//! with `ballast pack` into a scratch folder.
//!
//! 1. The seed's table (`shared/seeds/000_*`): `ballast run --store compressed` with
//!    `--cache per-pass`, `every-use` and `keep`, and the plain file memory-mapped, in
//!    rounds whose order alternates: decompressions per pass, peak RSS, tokens/s.
//! 2. Under a memory cgroup where tiered streaming is disk-bound: `ballast bench
//!    --store tiered` of the plain file and of the pack with each `--ram-tier` (raw,
//!    auto, coded), in alternating rounds, the page cache of both files dropped before
//!    each run: layers held decoded, coded and on disk, bytes read per token,
//!    tokens/s.
//!
//! Nothing is written outside the scratch folder (`$TMPDIR/ballast-pack-bench`).

use std::path::Path;
use std::process::Command;

use anyhow::{bail, Context, Result};

use crate::tier_bench::{ballast_json, bench_json, private_copy, written_back, Cgroup};

const MIB: f64 = (1u64 << 20) as f64;

/// The prompt of the cache table: a chat turn of the default model.
const PROMPT: &str = "<|im_start|>user\nWrite a short story about a lighthouse keeper.<|im_end|>\n<|im_start|>assistant\n";

/// Runs `ballast run --json` of the prompt, greedy, and returns its timings object.
fn run_json(ballast: &Path, model: &Path, args: &[&str]) -> Result<serde_json::Value> {
    let args: Vec<String> = [PROMPT, "--temp", "0", "--ignore-eos"]
        .iter()
        .chain(args)
        .map(|s| s.to_string())
        .collect();
    ballast_json(ballast, None, "run", &args, model)?
        .into_iter()
        .find_map(|v| v.get("timings").cloned())
        .context("ballast run --json printed no timings")
}

/// Each round's order of `n` runs: forwards, then backwards, and so on, so that no
/// run always meets the machine as the previous one left it.
pub(crate) fn alternating(rounds: usize, n: usize) -> impl Iterator<Item = usize> {
    (0..rounds)
        .flat_map(move |round| (0..n).map(move |k| if round % 2 == 0 { k } else { n - 1 - k }))
}

/// Each run's median tokens/s with `digits` decimals, comma-separated.
pub(crate) fn per_round(runs: &[serde_json::Value], digits: usize) -> String {
    runs.iter()
        .filter_map(|r| r["tokens_per_s_median"].as_f64())
        .map(|t| format!("{t:.digits$}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// The median of a figure over runs (NaN when no run has it).
pub(crate) fn median_of(
    runs: &[serde_json::Value],
    figure: impl Fn(&serde_json::Value) -> Option<f64>,
) -> f64 {
    let mut v: Vec<f64> = runs.iter().filter_map(figure).collect();
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

pub fn run(ballast: &Path, default_model: &Path, quick: bool) -> Result<()> {
    let work = std::env::temp_dir().join("ballast-pack-bench");
    let model = private_copy(default_model, &work)?;
    let pack = work.join("model.pack");
    if !pack.exists() {
        let status = Command::new(ballast)
            .arg("pack")
            .arg(&model)
            .arg(&pack)
            .status()
            .context("running ballast pack")?;
        if !status.success() {
            bail!("ballast pack failed ({status})");
        }
        written_back(&pack)?;
    }
    let (model_len, pack_len) = (
        std::fs::metadata(&model)?.len(),
        std::fs::metadata(&pack)?.len(),
    );
    let rounds = if quick { 1 } else { 3 };
    let n_gen = if quick { "32" } else { "64" };

    println!("\n## Per-pass cache against decode-every-use and decode-once-keep\n");
    println!(
        "{} ({:.1} MiB) packed to {:.1} MiB ({:.3}x); `ballast run` of a chat prompt, {n_gen} tokens, 2 threads, greedy; {rounds} round(s), order alternating; medians\n",
        model.display(),
        model_len as f64 / MIB,
        pack_len as f64 / MIB,
        model_len as f64 / pack_len as f64
    );
    let sides: [(&str, &Path, &[&str]); 4] = [
        ("plain file, mmap", &model, &["--store", "mmap"]),
        (
            "pack, --cache every-use",
            &pack,
            &["--store", "compressed", "--cache", "every-use"],
        ),
        (
            "pack, --cache per-pass",
            &pack,
            &["--store", "compressed", "--cache", "per-pass"],
        ),
        (
            "pack, --cache keep",
            &pack,
            &["--store", "compressed", "--cache", "keep"],
        ),
    ];
    let mut figures: Vec<Vec<serde_json::Value>> = vec![Vec::new(); sides.len()];
    for k in alternating(rounds, sides.len()) {
        let (_, file, flags) = sides[k];
        let args = [&["-n", n_gen, "-t", "2"][..], flags].concat();
        figures[k].push(run_json(ballast, file, &args)?);
    }
    println!("| store | passes | decompressions | per pass | decoded at once (peak) | peak RSS | generation tokens/s |");
    println!("| --- | ---: | ---: | ---: | ---: | ---: | ---: |");
    for ((label, _, _), runs) in sides.iter().zip(&figures) {
        let c = &runs.last().context("no run")?["compressed"];
        let num =
            |v: &serde_json::Value, f: &dyn Fn(f64) -> String| v.as_f64().map_or("-".into(), f);
        println!(
            "| {label} | {} | {} | {} | {} | {:.1} MiB | {:.1} |",
            num(&c["passes"], &|x| format!("{x:.0}")),
            num(&c["decompressions"], &|x| format!("{x:.0}")),
            num(&c["decompressions_per_pass"], &|x| format!("{x:.1}")),
            num(&c["decoded_bytes_peak"], &|x| format!("{:.1} MiB", x / MIB)),
            median_of(runs, |r| r["peak_rss_kib"].as_f64()) / 1024.0,
            median_of(runs, |r| r["generation_tokens_per_s"].as_f64()),
        );
    }

    println!("\n## The RAM tier held coded, under a memory limit\n");
    // The earlier measurement's budget (52M in 96 MiB: the head leaves room for two
    // layers) and a larger one, where holding layers coded fits more of them.
    for (limit_mib, ram) in [(96u64, "52M"), (116, "72M")] {
        ram_tiers(ballast, &model, &pack, limit_mib << 20, ram, rounds)?;
    }
    Ok(())
}

/// The plain file and the pack with each `--ram-tier`, tiered in a cgroup of `limit`
/// bytes with `--ram ram`: one table.
fn ram_tiers(
    ballast: &Path,
    model: &Path,
    pack: &Path,
    limit: u64,
    ram: &str,
    rounds: usize,
) -> Result<()> {
    let cg = match Cgroup::create(&format!("ballast-pack-bench-{}", std::process::id()), limit) {
        Ok(cg) => Some(cg),
        Err(e) => {
            println!("cgroup: not available ({e:#}); running WITHOUT a memory limit\n");
            None
        }
    };
    println!(
        "cgroup memory limit {} MiB; `ballast bench -p 0 -n 16 -r 3 -t 2 --store tiered --ram {ram}`; the page cache of both files dropped before each run; {rounds} round(s), order alternating\n",
        limit >> 20
    );
    let sides: [(&str, &Path, &[&str]); 4] = [
        ("plain file", model, &[]),
        ("pack, --ram-tier raw", pack, &["--ram-tier", "raw"]),
        ("pack, --ram-tier auto", pack, &["--ram-tier", "auto"]),
        ("pack, --ram-tier coded", pack, &["--ram-tier", "coded"]),
    ];
    let common = [
        "-p", "0", "-n", "16", "-r", "3", "-t", "2", "--store", "tiered", "--ram", ram,
    ];
    let mut figures: Vec<Vec<serde_json::Value>> = vec![Vec::new(); sides.len()];
    for k in alternating(rounds, sides.len()) {
        let (_, file, flags) = sides[k];
        // Both files' caches dropped: neither run starts warm from the other.
        for f in [model, pack] {
            ballast_tier_stream::io::drop_file_cache(f)
                .with_context(|| format!("dropping the cache of {}", f.display()))?;
        }
        let args: Vec<String> = common.iter().chain(flags).map(|s| s.to_string()).collect();
        let tg = bench_json(ballast, cg.as_ref(), &args, file)?
            .into_iter()
            .find(|v| v["test"].as_str().is_some_and(|t| t.starts_with("tg")))
            .context("no generation figures")?;
        figures[k].push(tg);
    }
    println!("| run | layers (A decoded, B coded, C disk) | coded in RAM | read per token (/proc) | streamed per token | tokens/s per round | median | peak RSS |");
    println!("| --- | --- | ---: | ---: | ---: | --- | ---: | ---: |");
    for ((label, _, _), runs) in sides.iter().zip(&figures) {
        let s = &runs.last().context("no run")?["streaming"];
        let each = per_round(runs, 2);
        let map = s["layer_map"].as_str().unwrap_or("");
        let count = |c: char| map.chars().filter(|&x| x == c).count();
        println!(
            "| {label} | {} {} {} (`{map}`) | {:.1} MiB | {:.1} MiB | {:.1} MiB | {each} | {:.2} | {:.1} MiB |",
            count('A'),
            count('B'),
            count('C'),
            s["coded_ram_bytes"].as_f64().unwrap_or(0.0) / MIB,
            median_of(runs, |r| r["process_read_bytes_per_token"].as_f64()) / MIB,
            median_of(runs, |r| r["streaming"]["disk_bytes_per_token"].as_f64()) / MIB,
            median_of(runs, |r| r["tokens_per_s_median"].as_f64()),
            median_of(runs, |r| r["peak_rss_kib"].as_f64()) / 1024.0,
        );
    }
    Ok(())
}
