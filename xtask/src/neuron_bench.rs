//! `cargo xtask bench-neurons`: the sparse MLP's neuron mode on the default model (or
//! `--model PATH`), against the dense MLP, in one run with alternating order.
//!
//! 1. Resident (`--store ram`): decode tokens/s at 1 and 2 threads, dense and at each
//!    sparsity in the neuron mode (the neuron cache holds every neuron, so after the
//!    first tokens it only hits), and the MLP weight bytes read per token.
//! 2. Under a memory cgroup where dense tiered streaming is disk-bound: `--store tiered`
//!    dense, and at each sparsity with the MLP out of core (the layers without their
//!    up and down matrices, a neuron cache of `--neuron-slots` inside the budget, the
//!    rest fetched from the neuron file): bytes read from storage per token
//!    (`/proc/self/io` `read_bytes`), tokens/s, the cache's hit rate; the page caches
//!    of the model and the neuron file dropped before each run.
//!
//! With `--prefetch M`, the out-of-core table also has, at each sparsity, the neuron
//! mode with `--prefetch --predictor-margin M` (records of the neurons predicted from
//! the attention input fetched while attention runs): every sparse row then uses a
//! profile made with `ballast sparsify --rank R` (`--rank`, default 64), so that the
//! rows share their thresholds.
//!
//! The model is copied into `$TMPDIR/ballast-neuron-bench/NAME` with its sparsity profile
//! (made there by `ballast sparsify` if the model has none beside it) and its neuron
//! file (`ballast sparsify --neurons`).

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};

use crate::pack_bench::{alternating, median_of, per_round};
use crate::tier_bench::{bench_json, private_copy, written_back, Cgroup};

const MIB: f64 = (1u64 << 20) as f64;
const SPARSITIES: [&str; 5] = ["0.15", "0.25", "0.4", "0.5", "0.6"];

/// Runs `ballast ARGS` and fails with its stderr if it fails.
fn ballast(bin: &Path, args: &[&str]) -> Result<()> {
    let out = Command::new(bin)
        .args(args)
        .output()
        .context("running ballast")?;
    if !out.status.success() {
        bail!(
            "ballast {} failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(())
}

/// The out-of-core table's settings.
pub struct OutOfCore {
    /// The cgroup's memory limit.
    pub limit_mib: u64,
    /// `--ram` of the runs.
    pub ram: String,
    /// `--neuron-slots` of the sparse runs.
    pub slots: String,
    /// With prefetch rows: their `--predictor-margin`, and the profile's rank.
    pub prefetch: Option<(String, usize)>,
}

impl Default for OutOfCore {
    /// SmolLM2-135M's: dense tiered streaming is disk-bound in 88 MiB.
    fn default() -> Self {
        OutOfCore {
            limit_mib: 88,
            ram: "74M".into(),
            slots: "0.6".into(),
            prefetch: None,
        }
    }
}

/// The model copied into `work` with its profile and neuron file beside it.
fn prepare(bin: &Path, model: &Path, work: &Path) -> Result<PathBuf> {
    let copy = private_copy(model, work)?;
    let m = copy.to_str().context("a UTF-8 path")?;
    let profile = PathBuf::from(format!("{m}.sparsity"));
    let theirs = PathBuf::from(format!("{}.sparsity", model.display()));
    if !profile.exists() {
        if theirs.exists() {
            std::fs::copy(&theirs, &profile).context("copying the sparsity profile")?;
        } else {
            ballast(bin, &["sparsify", "-m", m])?;
        }
    }
    let neurons = PathBuf::from(format!("{m}.neurons"));
    if !neurons.exists() {
        ballast(bin, &["sparsify", "-m", m, "--neurons"])?;
        written_back(&neurons)?;
    }
    Ok(copy)
}

/// The decode figures of one `ballast bench` run.
fn decode(
    bin: &Path,
    cg: Option<&Cgroup>,
    model: &Path,
    args: &[String],
) -> Result<serde_json::Value> {
    let neurons = PathBuf::from(format!("{}.neurons", model.display()));
    ballast_tier_stream::io::drop_file_cache(&neurons)
        .with_context(|| format!("dropping the cache of {}", neurons.display()))?;
    bench_json(bin, cg, args, model)?
        .into_iter()
        .find(|v| v["test"].as_str().is_some_and(|t| t.starts_with("tg")))
        .context("no generation figures")
}

pub fn run(
    bin: &Path,
    default_model: &Path,
    quick: bool,
    tiered_only: bool,
    model: Option<PathBuf>,
    ooc: &OutOfCore,
) -> Result<()> {
    let source = model.unwrap_or_else(|| default_model.to_path_buf());
    // One folder per model: its profile and neuron file are named for the copy.
    let name = source
        .file_name()
        .context("the model's path names no file")?;
    let work = std::env::temp_dir().join("ballast-neuron-bench").join(name);
    let model = prepare(bin, &source, &work)?;
    let ranked = match &ooc.prefetch {
        Some((_, rank)) => {
            let ranked = work.join(format!("rank{rank}.sparsity"));
            if !ranked.exists() {
                let (m, r) = (
                    model.to_str().context("a UTF-8 path")?,
                    ranked.to_str().context("a UTF-8 path")?,
                );
                ballast(
                    bin,
                    &["sparsify", "-m", m, "--rank", &rank.to_string(), "-o", r],
                )?;
            }
            Some(ranked)
        }
        None => None,
    };
    let rounds = if quick { 1 } else { 3 };
    let n_gen = if quick { "16" } else { "32" };
    if !tiered_only {
        resident(bin, &source, &model, rounds, n_gen)?;
    }
    out_of_core(bin, &model, rounds, n_gen, ooc, ranked.as_deref())
}

fn load() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|l| l.split_whitespace().next().unwrap_or("?").to_string())
        .unwrap_or_default()
}

/// The resident table.
fn resident(bin: &Path, source: &Path, model: &Path, rounds: usize, n_gen: &str) -> Result<()> {
    println!("\n## The neuron mode, resident\n");
    println!(
        "{}; `ballast bench -p 0 -n {n_gen} -r 3 --store ram -t T` dense, and with `--sparsity S --sparse-mode neurons` (every neuron may stay cached); {rounds} round(s), order alternating, medians; load average {} at the start\n",
        source.display(),
        load()
    );
    let mut sides: Vec<(String, Vec<&str>)> = vec![("dense".into(), vec![])];
    for s in SPARSITIES {
        sides.push((
            format!("neurons {s}"),
            vec!["--sparsity", s, "--sparse-mode", "neurons"],
        ));
    }
    println!("| MLP | threads | tokens/s (median) | per round | vs dense | MLP bytes read per token | neurons skipped | cache hits |");
    println!("| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: |");
    for threads in ["1", "2"] {
        let mut figures: Vec<Vec<serde_json::Value>> = vec![Vec::new(); sides.len()];
        for k in alternating(rounds, sides.len()) {
            let args: Vec<String> = [
                "-p", "0", "-n", n_gen, "-r", "3", "--store", "ram", "-t", threads,
            ]
            .iter()
            .chain(&sides[k].1)
            .map(|s| s.to_string())
            .collect();
            figures[k].push(decode(bin, None, model, &args)?);
        }
        let dense = median_of(&figures[0], |r| r["tokens_per_s_median"].as_f64());
        for ((label, _), runs) in sides.iter().zip(&figures) {
            let tps = median_of(runs, |r| r["tokens_per_s_median"].as_f64());
            let each = per_round(runs, 1);
            let sparse = &runs.last().context("no run")?["sparse"];
            let (bytes, skipped, hits) = if sparse.is_object() {
                (
                    format!(
                        "{:.2} MiB of {:.2}",
                        sparse["mlp_bytes_per_token"].as_f64().unwrap_or(0.0) / MIB,
                        sparse["dense_mlp_bytes"].as_f64().unwrap_or(0.0) / MIB
                    ),
                    format!("{:.1}%", 100.0 * sparse["skipped"].as_f64().unwrap_or(0.0)),
                    sparse["neuron_hit_rate"]
                        .as_f64()
                        .map_or("-".into(), |h| format!("{:.1}%", 100.0 * h)),
                )
            } else {
                ("dense".into(), "0%".into(), "-".into())
            };
            println!(
                "| {label} | {threads} | {tps:.2} | {each} | {:.2}x | {bytes} | {skipped} | {hits} |",
                tps / dense
            );
        }
    }

    Ok(())
}

/// The out-of-core table.
fn out_of_core(
    bin: &Path,
    model: &Path,
    rounds: usize,
    n_gen: &str,
    ooc: &OutOfCore,
    ranked: Option<&Path>,
) -> Result<()> {
    let (limit, ram, slots) = (ooc.limit_mib << 20, ooc.ram.as_str(), ooc.slots.as_str());
    let ranked = ranked
        .map(|p| p.to_str().context("a UTF-8 path"))
        .transpose()?;
    println!("\n## The neuron mode out of core, under a memory limit\n");
    let cg = match Cgroup::create(
        &format!("ballast-neuron-bench-{}", std::process::id()),
        limit,
    ) {
        Ok(cg) => Some(cg),
        Err(e) => {
            println!("cgroup: not available ({e:#}); running WITHOUT a memory limit\n");
            None
        }
    };
    println!(
        "cgroup memory limit {} MiB; `ballast bench -p 0 -n {n_gen} -r 3 -t 2 --store tiered --ram {ram}` dense, and with `--sparsity S --sparse-mode neurons --neuron-slots {slots}` (no layer holds its up and down matrices; the neuron cache is counted in the budget); page caches of the model and the neuron file dropped before each run; {rounds} round(s), order alternating, medians; load average {} at the start\n",
        limit >> 20,
        load()
    );
    let mut sides: Vec<(String, Vec<&str>)> = vec![("dense".into(), vec![])];
    for s in SPARSITIES {
        let mut args = vec![
            "--sparsity",
            s,
            "--sparse-mode",
            "neurons",
            "--neuron-slots",
            slots,
        ];
        if let Some(r) = ranked {
            args.extend(["--sparsity-profile", r]);
        }
        sides.push((format!("neurons {s}"), args.clone()));
        if let Some((margin, _)) = &ooc.prefetch {
            args.extend(["--prefetch", "--predictor-margin", margin]);
            sides.push((format!("neurons {s}, prefetch"), args));
        }
    }
    let mut figures: Vec<Vec<serde_json::Value>> = vec![Vec::new(); sides.len()];
    for k in alternating(rounds, sides.len()) {
        let args: Vec<String> = [
            "-p", "0", "-n", n_gen, "-r", "3", "-t", "2", "--store", "tiered", "--ram", ram,
        ]
        .iter()
        .chain(&sides[k].1)
        .map(|s| s.to_string())
        .collect();
        figures[k].push(decode(bin, cg.as_ref(), model, &args)?);
    }
    println!("| MLP | layers (A resident, C disk) | storage read per token (/proc) | layers streamed per token | neuron records fetched per token | cache hits | prefetched per token (used) | fetched in the MLP per token | recall | tokens/s (median) | per round | vs dense | peak RSS |");
    println!(
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: |"
    );
    let dense = median_of(&figures[0], |r| r["tokens_per_s_median"].as_f64());
    for ((label, _), runs) in sides.iter().zip(&figures) {
        let last = runs.last().context("no run")?;
        let map = last["streaming"]["layer_map"].as_str().unwrap_or("");
        let count = |c: char| map.chars().filter(|&x| x == c).count();
        let tps = median_of(runs, |r| r["tokens_per_s_median"].as_f64());
        let each = per_round(runs, 2);
        let sparse = &last["sparse"];
        let prefetch = sparse["prefetched_per_token"]
            .as_f64()
            .map_or("-".into(), |p| {
                format!(
                    "{p:.0} ({:.1}%)",
                    100.0 * sparse["prefetch_used"].as_f64().unwrap_or(0.0)
                )
            });
        let in_mlp = sparse["fetched_in_mlp_per_token"]
            .as_f64()
            .map_or("-".into(), |f| format!("{f:.0}"));
        let recall = sparse["recall"]
            .as_f64()
            .map_or("-".into(), |r| format!("{:.1}%", 100.0 * r));
        println!(
            "| {label} | {} {} (`{map}`) | {:.2} MiB | {:.2} MiB | {} | {} | {prefetch} | {in_mlp} | {recall} | {tps:.2} | {each} | {:.2}x | {:.1} MiB |",
            count('A'),
            count('C'),
            median_of(runs, |r| r["process_read_bytes_per_token"].as_f64()) / MIB,
            median_of(runs, |r| r["streaming"]["disk_bytes_per_token"].as_f64()) / MIB,
            sparse["neuron_bytes_fetched_per_token"]
                .as_f64()
                .map_or("-".into(), |b| format!("{:.2} MiB", b / MIB)),
            sparse["neuron_hit_rate"]
                .as_f64()
                .map_or("-".into(), |h| format!("{:.1}%", 100.0 * h)),
            tps / dense,
            median_of(runs, |r| r["peak_rss_kib"].as_f64()) / 1024.0,
        );
    }
    Ok(())
}
