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

/// Qwen3-MoE's shape, scaled down: 8 layers of 1024 wide, 32 experts of 512, 4 per
/// token (Qwen3-30B-A3B: 128 of 768, 8 per token); Q8_0; about 430 MB.
fn synthetic_moe() -> TinyModelSpec {
    TinyModelSpec {
        arch: "qwen3moe".into(),
        n_layers: 8,
        d_model: 1024,
        n_heads: 16,
        n_kv_heads: 4,
        head_dim: Some(64),
        n_ff: 2048,
        experts: Some((32, 4, 512)),
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
    let model = work.join("synthetic-moe.gguf");
    if !model.is_file() {
        eprintln!("    writing {} (random Q8_0 weights)", model.display());
        synthetic_moe().writer()?.write_to_file(&model)?;
        written_back(&model)?;
    }
    let size = std::fs::metadata(&model)?.len();
    let limit = 160 * MIB;
    let ram = "100M";
    let n_gen = if quick { "8" } else { "24" };
    println!("\n## A mixture of experts streamed expert by expert vs whole layers\n");
    println!(
        "model {} ({:.0} MiB: qwen3moe, 8 layers, 32 experts of 512 per layer, 4 per token, Q8_0); cgroup limit {} MiB; --store tiered --ram {ram}; -p 0 -n {n_gen} -r 2 -t 2, alternated twice\n",
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
                if let Some(e) = v["streaming"].get("expert_bytes_per_token") {
                    println!(
                        "|  of which chosen experts: {:.2} MiB/token, {:.0}% cache hits, waited {:.2} ms/token | | | | | | | | | | | |",
                        e.as_f64().unwrap_or(0.0) / MIB as f64,
                        v["streaming"]["expert_hit_rate"].as_f64().unwrap_or(0.0) * 100.0,
                        v["streaming"]["expert_stall_ms_per_token"].as_f64().unwrap_or(0.0),
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
