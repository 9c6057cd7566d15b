//! `cargo xtask bench-moe`: a synthetic mixture of experts larger than a memory cgroup,
//! streamed from disk on the CPU expert by expert (only the experts the router chooses
//! are read) against whole layers (`--whole-experts`), same limit, same budget, runs
//! alternated: tokens/s, bytes read per token (as the store counts them and as the
//! kernel does), the wait for the chosen experts, and the plan's bound.

use std::path::Path;

use anyhow::{Context, Result};
use ballast_runtime::ggml_type::GgmlType;
use ballast_runtime::testing::TinyModelSpec;

use crate::tier_bench::{bench_json, header, row, written_back, Cgroup};

const MIB: u64 = 1 << 20;

/// Qwen3-MoE's shape, scaled down: 24 layers of 1024 wide, 40 experts of 512, 4 per
/// token (Qwen3-30B-A3B: 48 layers, 128 experts of 768, 8 per token); Q8_0; about
/// 1.6 GB (the issue asks for at least 1.5 GB).
fn synthetic_moe() -> TinyModelSpec {
    TinyModelSpec {
        arch: "qwen3moe".into(),
        n_layers: 24,
        d_model: 1024,
        n_heads: 16,
        n_kv_heads: 4,
        head_dim: Some(64),
        n_ff: 2048,
        experts: Some((40, 4, 512)),
        weight_type: GgmlType::Q8_0,
        embd_type: GgmlType::Q8_0,
        tied: true,
        context_length: 512,
        seed: 17,
        ..TinyModelSpec::default()
    }
}

pub fn run(ballast: &Path, quick: bool) -> Result<()> {
    let work = std::env::temp_dir().join("ballast-moe-bench");
    std::fs::create_dir_all(&work)?;
    let model = work.join("synthetic-moe-24x40.gguf");
    if !model.is_file() {
        eprintln!("    writing {} (random Q8_0 weights)", model.display());
        synthetic_moe().writer()?.write_to_file(&model)?;
        written_back(&model)?;
    }
    let size = std::fs::metadata(&model)?.len();
    // A third of the file, as the issue asks; the budget leaves the page cache and the
    // process's own memory the rest.
    let limit = size / 3 / MIB * MIB;
    let ram = format!("{}M", limit / MIB - 128);
    let ram = ram.as_str();
    let n_gen = if quick { "8" } else { "24" };
    println!("\n## A mixture of experts streamed expert by expert vs whole layers\n");
    println!(
        "model {} ({:.0} MiB: qwen3moe, 24 layers, 40 experts of 512 per layer, 4 per token, Q8_0); cgroup limit {} MiB (a third of the file); --store tiered --ram {ram}; -p 0 -n {n_gen} -r 2 -t 2, alternated twice\n",
        model.display(),
        size as f64 / MIB as f64,
        limit / MIB
    );
    let cg = match Cgroup::create(&format!("ballast-moe-bench-{}", std::process::id()), limit) {
        Ok(cg) => Some(cg),
        Err(e) => {
            println!("cgroup: not available ({e:#}); running WITHOUT a memory limit\n");
            None
        }
    };
    let common: Vec<String> = [
        "-p", "0", "-n", n_gen, "-r", "2", "-t", "2", "--store", "tiered", "--ram", ram,
    ]
    .map(String::from)
    .to_vec();
    header();
    let mut speeds: [Vec<f64>; 2] = [Vec::new(), Vec::new()];
    for round in 0..2 {
        for (k, (label, extra)) in [
            ("experts chosen by the router", &[][..]),
            (
                "whole layers (--whole-experts)",
                &["--whole-experts".to_string()][..],
            ),
        ]
        .into_iter()
        .enumerate()
        {
            let v = bench_json(ballast, cg.as_ref(), &[&common[..], extra].concat(), &model)
                .with_context(|| format!("round {round}: {label}"))?;
            if let Some(v) = v.first() {
                row(label, v);
                speeds[k].push(v["tokens_per_s_median"].as_f64().unwrap_or(0.0));
                let st = &v["streaming"];
                if let Some(e) = st.get("expert_bytes_per_token") {
                    let f = |k: &str| st[k].as_f64().unwrap_or(0.0);
                    // What the disk read for the experts: the kernel's count less the
                    // store's reads of everything else (attention, norms, router).
                    let kernel = v["process_read_bytes_per_token"].as_f64().unwrap_or(0.0);
                    let others = f("disk_bytes_per_token") - e.as_f64().unwrap_or(0.0);
                    let expert_disk = kernel - others;
                    let (chosen, missed) = (
                        f("expert_chosen_bytes_per_token"),
                        f("expert_missed_bytes_per_token"),
                    );
                    println!(
                        "|  experts: the router chose {:.2} MiB/token, {:.2} MiB of them not cached ({:.0}% hits); the disk read {:.2} MiB/token for experts = {:.3}x the uncached chosen bytes; waited {:.2} ms/token after the router | | | | | | | | | | | |",
                        chosen / MIB as f64,
                        missed / MIB as f64,
                        f("expert_hit_rate") * 100.0,
                        expert_disk / MIB as f64,
                        expert_disk / missed.max(1.0),
                        f("expert_stall_ms_per_token"),
                    );
                }
            }
        }
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        match v.len() {
            0 => 0.0,
            n if n % 2 == 0 => (v[n / 2 - 1] + v[n / 2]) / 2.0,
            n => v[n / 2],
        }
    };
    let (a, b) = (median(&mut speeds[0]), median(&mut speeds[1]));
    println!(
        "\nexpert streaming / whole layers: {:.2}x the tokens/s ({a:.2} against {b:.2}, medians of the rounds)",
        a / b.max(1e-12)
    );
    Ok(())
}
