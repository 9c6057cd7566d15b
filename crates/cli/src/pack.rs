//! `ballast pack IN.gguf OUT`: a compressed model file (`ballast-weight-codec`), opened
//! by every command like a GGUF.

use std::collections::BTreeMap;
use std::path::PathBuf;

use anyhow::{Context, Result};
use ballast_runtime::gguf::GgufFile;
use ballast_weight_codec::{write_pack, Codec, PackOptions};
use clap::Args;

use crate::common::human_bytes;

/// Flags of `ballast pack`.
#[derive(Args, Debug)]
pub struct PackArgs {
    /// The GGUF file to pack.
    pub input: PathBuf,
    /// The pack to write (replaced atomically if it exists).
    pub output: PathBuf,
    /// Raw bytes per chunk (rounded down to whole blocks); chunks decode independently.
    #[arg(long, default_value = "256K")]
    pub chunk: String,
    /// zstd level (1-22).
    #[arg(long, default_value_t = 9)]
    pub level: i32,
    /// Codecs to try on each tensor (the smallest wins): auto (zstd, planes+zstd,
    /// planes+rans), zstd, planes+zstd, planes+rans, planes+rans-lanes, rans-lanes, raw;
    /// comma-separated. `gpu` (= planes+rans-lanes,rans-lanes) makes a pack whose tensors a GPU
    /// decodes itself: `--device gpu` then uploads the coded bytes of streamed layers
    /// and decodes them in WGSL (a pack written with it has format version 2).
    #[arg(long, default_value = "auto")]
    pub codec: String,
    /// Threads that code chunks. Default: every core.
    #[arg(short = 't', long)]
    pub threads: Option<usize>,
}

fn parse_codecs(s: &str) -> Result<Vec<Codec>> {
    match s {
        "auto" => return Ok(Codec::CANDIDATES.to_vec()),
        "gpu" => return Ok(Codec::GPU_CANDIDATES.to_vec()),
        _ => {}
    }
    s.split(',')
        .map(|name| {
            [
                Codec::ZSTD,
                Codec::PLANES_ZSTD,
                Codec::PLANES_RANS,
                Codec::PLANES_RANS_LANES,
                Codec::RANS_LANES,
                Codec::RAW,
            ]
            .into_iter()
            .find(|c| c.name() == name.trim())
            .with_context(|| {
                format!("--codec {name}: expected auto, gpu, zstd, planes+zstd, planes+rans, planes+rans-lanes, rans-lanes or raw")
            })
        })
        .collect()
}

/// Per tensor type: raw bytes, stored bytes per candidate codec, stored bytes of the
/// choices, and how many tensors chose each codec.
type TypeSums = (u64, Vec<(Codec, u64)>, u64, BTreeMap<String, usize>);

pub fn run(args: PackArgs) -> Result<()> {
    let input = GgufFile::open(&args.input, true)
        .with_context(|| format!("opening {}", args.input.display()))?;
    let chunk = ballast_tier_stream::probe::parse_size(&args.chunk)
        .with_context(|| format!("--chunk {}", args.chunk))?;
    let opts = PackOptions {
        chunk_bytes: usize::try_from(chunk).context("--chunk is too large")?,
        zstd_level: args.level,
        candidates: parse_codecs(&args.codec)?,
        threads: crate::common::threads(args.threads),
    };
    let total: u64 = input.tensors().iter().map(|t| t.n_bytes).sum();
    let bar = indicatif::ProgressBar::new(total);
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "{bar:40} {bytes}/{total_bytes} {bytes_per_sec} eta {eta} {msg}",
        )
        .expect("a valid template"),
    );
    let t0 = std::time::Instant::now();
    let reports = write_pack(&input, &args.output, &opts, &mut |p| {
        bar.set_position(p.done);
        bar.set_message(p.tensor.to_string());
    });
    bar.finish_and_clear();
    let reports = reports.with_context(|| format!("packing into {}", args.output.display()))?;
    let packed = std::fs::metadata(&args.output)
        .with_context(|| format!("reading {}", args.output.display()))?
        .len();
    println!(
        "{} -> {}: {} -> {} ({:.3}x whole file) in {:.1} s",
        args.input.display(),
        args.output.display(),
        human_bytes(input.file_len()),
        human_bytes(packed),
        input.file_len() as f64 / packed.max(1) as f64,
        t0.elapsed().as_secs_f64()
    );
    // Per type: ratio of each candidate and of the choice, over the tensors' bytes.
    let mut by_type: BTreeMap<String, TypeSums> = BTreeMap::new();
    for r in &reports {
        let e = by_type
            .entry(r.ty.name().to_string())
            .or_insert_with(|| (0, Vec::new(), 0, BTreeMap::new()));
        e.0 += r.raw_len;
        for &(c, n) in &r.candidates {
            match e.1.iter_mut().find(|(k, _)| *k == c) {
                Some((_, m)) => *m += n,
                None => e.1.push((c, n)),
            }
        }
        e.2 += r.stored_len();
        *e.3.entry(r.chosen.name()).or_default() += 1;
    }
    let names: Vec<String> = opts.candidates.iter().map(|c| c.name()).collect();
    println!(
        "\n| type | tensors | raw | {} | chosen | codecs chosen |",
        names.join(" | ")
    );
    println!("|---|---:|---:|{}---:|---|", "---:|".repeat(names.len()));
    for (ty, (raw, cands, stored, chosen)) in &by_type {
        let cols: Vec<String> = opts
            .candidates
            .iter()
            .map(|c| {
                cands
                    .iter()
                    .find(|(k, _)| k == c)
                    .map_or("-".into(), |(_, n)| {
                        format!("{:.3}x", *raw as f64 / *n as f64)
                    })
            })
            .collect();
        let n: usize = chosen.values().sum();
        let chosen_s: Vec<String> = chosen.iter().map(|(k, v)| format!("{k} {v}")).collect();
        println!(
            "| {ty} | {n} | {} | {} | {:.3}x | {} |",
            human_bytes(*raw),
            cols.join(" | "),
            *raw as f64 / *stored as f64,
            chosen_s.join(", ")
        );
    }
    Ok(())
}
