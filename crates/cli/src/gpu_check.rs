//! `ballast gpu-check`: everything a session lent a real GPU should learn in one
//! command, with nothing to build there: the adapter; every reference architecture's
//! greedy tokens and logits on the GPU against the CPU; and prompt and decode speed on
//! synthetic models at real shapes (`ballast synth`), with the bytes a token reads and
//! the share of the device's memory bandwidth that makes.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, Result};
use ballast_runtime::gguf::GgufFile;
use ballast_runtime::gpu::GpuContext;
use ballast_runtime::synth::{SynthMix, SynthModel};
use ballast_runtime::testing::{reference_spec, REFERENCE_SPECS};
use ballast_runtime::{Backend, CpuBackend, Model, Session, WgpuBackend};
use clap::Args;
use serde_json::json;

use crate::common::human_bytes;

/// Flags of `ballast gpu-check`.
#[derive(Args, Debug)]
pub struct GpuCheckArgs {
    /// Where the synthetic models are written (deleted afterwards). Default: a folder
    /// in the system's temporary directory.
    #[arg(long)]
    pub work: Option<PathBuf>,
    /// Decoded tokens per speed run.
    #[arg(short = 'n', long, default_value_t = 32)]
    pub n_gen: usize,
    /// Prompt tokens per prompt-processing run (one pass in chunks of the session's
    /// batch, after an 8-token warm-up).
    #[arg(short = 'p', long, default_value_t = 512)]
    pub n_prompt: usize,
    /// The device's peak memory bandwidth in GB/s, for the share a decode uses.
    /// Default: from the adapter's name for the GPUs it knows (H100, H200, A100, L4,
    /// RTX 4090), else none.
    #[arg(long)]
    pub peak_gbs: Option<f64>,
    /// Also the 8B-shaped models on a software adapter (slow); a real GPU always runs
    /// them.
    #[arg(long)]
    pub full: bool,
    /// One JSON object at the end instead of text.
    #[arg(long)]
    pub json: bool,
}

/// Peak memory bandwidth (GB/s) of the GPUs whose names say which they are.
fn known_bandwidth(name: &str) -> Option<f64> {
    let n = name.to_ascii_uppercase();
    [
        ("H200", 4800.0),
        ("H100 PCIE", 2000.0),
        ("H100", 3350.0),
        ("A100", 2039.0),
        ("L4", 300.0),
        ("RTX 4090", 1008.0),
    ]
    .into_iter()
    .find(|(key, _)| n.contains(key))
    .map(|(_, gbs)| gbs)
}

pub fn run(args: GpuCheckArgs) -> Result<()> {
    let ctx = GpuContext::new().context("no wgpu adapter")?;
    let adapter = ctx.adapter().clone();
    let peak = args.peak_gbs.or_else(|| known_bandwidth(&adapter.name));
    eprintln!(
        "adapter: {} ({}, {}, driver {}); peak bandwidth {}",
        adapter.name,
        adapter.backend,
        adapter.device_type,
        adapter.driver,
        peak.map_or("unknown (--peak-gbs)".into(), |p| format!("{p} GB/s"))
    );
    let gpu: Arc<dyn Backend> = Arc::new(WgpuBackend::new(ctx.clone()));
    let cpu: Arc<dyn Backend> = Arc::new(CpuBackend::new(crate::common::threads(None)));

    // The reference architectures: greedy ids and the largest logit difference.
    let mut correctness = Vec::new();
    let mut all_equal = true;
    for name in REFERENCE_SPECS {
        let spec = reference_spec(name).expect("a known reference spec");
        let file = Arc::new(GgufFile::from_bytes(spec.to_gguf_bytes()?)?);
        let prompt: Vec<u32> = (0..10).map(|i| 3 + (i * 7) % 200).collect();
        let run = |backend: &Arc<dyn Backend>| -> Result<(Vec<u32>, Vec<f32>)> {
            let model = Model::load(file.clone(), backend.clone(), false)?;
            let mut session = Session::new(model, 64)?;
            let first = session.feed(&prompt)?.to_vec();
            let mut ids = vec![ballast_runtime::sampler::argmax(&first)];
            for _ in 0..15 {
                let logits = session.feed(&ids[ids.len() - 1..])?;
                ids.push(ballast_runtime::sampler::argmax(logits));
            }
            Ok((ids, first))
        };
        let (want_ids, want) = run(&cpu)?;
        let (got_ids, got) = run(&gpu).with_context(|| format!("{name} on the GPU"))?;
        let scale = want.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-6);
        let diff = want
            .iter()
            .zip(&got)
            .fold(0f32, |m, (a, b)| m.max((a - b).abs()))
            / scale;
        let equal = want_ids == got_ids;
        all_equal &= equal;
        eprintln!(
            "{name:<14} greedy ids {} the CPU's, first logits within {:.4}% of the largest",
            if equal { "equal" } else { "DIFFER from" },
            diff * 100.0
        );
        correctness.push(json!({"model": name, "ids_equal": equal, "max_rel_diff": diff}));
    }

    // Decode speed on synthetic models at real shapes.
    let work = match &args.work {
        Some(w) => w.clone(),
        None => std::env::temp_dir().join(format!("ballast-gpu-check-{}", std::process::id())),
    };
    std::fs::create_dir_all(&work).with_context(|| format!("creating {}", work.display()))?;
    let mut shapes = vec![
        ("smollm2-135m", SynthMix::Q4KM),
        ("smollm2-135m", SynthMix::Q8_0),
    ];
    if !adapter.is_software() || args.full {
        shapes.push(("llama-3.1-8b", SynthMix::Q4KM));
        shapes.push(("llama-3.1-8b", SynthMix::Q8_0));
    } else {
        eprintln!("(a software adapter: the 8B-shaped models only with --full)");
    }
    let mut speeds = Vec::new();
    let result = (|| -> Result<()> {
        for (shape, mix) in shapes {
            let path = work.join(format!("{shape}-{mix:?}.gguf"));
            let synth = SynthModel::new(SynthModel::shape(shape)?, mix);
            let t = Instant::now();
            synth.write(&path, |_, _| {})?;
            let write_s = t.elapsed().as_secs_f64();
            let file = Arc::new(GgufFile::open(&path, true)?);
            let t = Instant::now();
            let model = Model::load(file, gpu.clone(), true)?;
            let mut session = Session::new(model, 8 + args.n_prompt + args.n_gen + 1)?;
            let warm: Vec<u32> = (0..8).map(|i| 40 + i).collect();
            session.feed_greedy(&warm)?;
            let load_s = t.elapsed().as_secs_f64();
            let prompt: Vec<u32> = (0..args.n_prompt as u32).map(|i| 50 + i % 1000).collect();
            let t = Instant::now();
            let mut next = session.feed_greedy(&prompt)?;
            let pp_tps = args.n_prompt as f64 / t.elapsed().as_secs_f64();
            let t = Instant::now();
            let mut bytes = 0u64;
            for _ in 0..args.n_gen {
                next = session.feed_greedy(&[next])?;
                if let Some(r) = gpu.telemetry().last_pass() {
                    bytes += r.weight_bytes_read + r.kv_bytes_read + r.activation_bytes_read;
                }
            }
            let secs = t.elapsed().as_secs_f64();
            let tps = args.n_gen as f64 / secs;
            let per_token = bytes / args.n_gen.max(1) as u64;
            let gbs = per_token as f64 * tps / 1e9;
            let share = peak.map(|p| gbs / p);
            eprintln!(
                "{shape} {mix:?}: {} written in {write_s:.1} s; load and 8-token warm-up {load_s:.1} s; prompt ({} tokens) {pp_tps:.1} tokens/s; decode {tps:.2} tokens/s, {} read per token = {gbs:.1} GB/s{}",
                human_bytes(synth.file_bytes()?),
                args.n_prompt,
                human_bytes(per_token),
                share.map_or(String::new(), |s| format!(" ({:.0}% of peak)", s * 100.0))
            );
            speeds.push(
                json!({"shape": shape, "mix": format!("{mix:?}"), "tokens_per_s": tps,
                "bytes_per_token": per_token, "gb_per_s": gbs, "share_of_peak": share,
                "write_s": write_s, "load_and_warm_up_s": load_s,
                "prompt_tokens": args.n_prompt, "prompt_tokens_per_s": pp_tps}),
            );
            std::fs::remove_file(&path).with_context(|| format!("removing {}", path.display()))?;
        }
        Ok(())
    })();
    if args.work.is_none() {
        let _ = std::fs::remove_dir_all(&work);
    }
    result?;
    if args.json {
        println!(
            "{}",
            json!({"adapter": {"name": adapter.name, "backend": adapter.backend,
                "device_type": adapter.device_type, "driver": adapter.driver},
                "peak_gb_per_s": peak, "reference_models": correctness, "decode": speeds})
        );
    }
    anyhow::ensure!(
        all_equal,
        "the GPU's greedy ids differ from the CPU's on a reference model (above)"
    );
    Ok(())
}
