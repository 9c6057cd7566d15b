//! `cargo xtask bench-codec`: per tensor type of a GGUF model, the ratio of each codec
//! of `ballast-weight-codec` (zstd alone, planes + zstd, planes + rANS, and planes +
//! lane-parallel rANS, what a GPU decodes; in chunks of 256 KiB) and its decode speed
//! on one and on two threads (the CPU decoder), plus zstd over the whole file in one
//! frame for comparison.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Instant;

use anyhow::{Context, Result};
use ballast_runtime::ggml_type::GgmlType;
use ballast_runtime::gguf::GgufFile;
use ballast_weight_codec::codec::{chunk_len, decode_chunk, encode_chunk};
use ballast_weight_codec::Codec;

const CHUNK: usize = 256 << 10;

/// One codec's chunks of one type: (raw bytes, stored bytes) per chunk.
struct Coded {
    chunks: Vec<(Vec<u8>, Vec<u8>)>,
}

fn code(ty: GgmlType, codec: Codec, level: i32, raws: &[&[u8]]) -> Coded {
    let mut chunks = Vec::new();
    for raw in raws {
        for piece in raw.chunks(chunk_len(ty, CHUNK)) {
            let mut stored = Vec::new();
            encode_chunk(ty, codec, level, piece, &mut stored);
            chunks.push((piece.to_vec(), stored));
        }
    }
    Coded { chunks }
}

/// Raw bytes decoded per second on `threads` threads (chunks split between them),
/// repeated for at least 0.5 s; every output checked once.
fn speed(ty: GgmlType, codec: Codec, coded: &Coded, threads: usize) -> f64 {
    let per = coded.chunks.len().div_ceil(threads);
    let t0 = Instant::now();
    let mut bytes = 0u64;
    let mut first = true;
    while first || t0.elapsed().as_secs_f64() < 0.5 {
        std::thread::scope(|s| {
            for group in coded.chunks.chunks(per.max(1)) {
                s.spawn(move || {
                    let mut out = Vec::new();
                    for (raw, stored) in group {
                        out.resize(raw.len(), 0);
                        decode_chunk(ty, codec, stored, &mut out).expect("decodes");
                        if first {
                            assert!(out == *raw, "{ty} {codec}: decoded bytes differ");
                        }
                    }
                });
            }
        });
        bytes += coded
            .chunks
            .iter()
            .map(|(r, _)| r.len() as u64)
            .sum::<u64>();
        first = false;
    }
    bytes as f64 / t0.elapsed().as_secs_f64()
}

pub fn run(model: &Path, level: i32) -> Result<()> {
    let file =
        GgufFile::open(model, true).with_context(|| format!("opening {}", model.display()))?;
    let mut by_type: BTreeMap<&str, (GgmlType, Vec<&[u8]>)> = BTreeMap::new();
    for t in file.tensors() {
        by_type
            .entry(t.ty.name())
            .or_insert_with(|| (t.ty, Vec::new()))
            .1
            .push(file.tensor_data(t));
    }
    println!(
        "{}: {} bytes; chunks of {} KiB; zstd level {level}; decode speed in GB/s of raw bytes on 1 / 2 threads",
        model.display(),
        file.file_len(),
        CHUNK >> 10
    );
    println!("\n| type | tensors | raw bytes | zstd | planes+zstd | planes+rans | planes+rans-lanes | zstd GB/s 1t / 2t | planes+zstd GB/s 1t / 2t | planes+rans GB/s 1t / 2t | planes+rans-lanes GB/s 1t / 2t |");
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    let mut totals = [0u64; 4];
    let mut total_raw = 0u64;
    let mut best_total = 0u64;
    for (name, (ty, raws)) in &by_type {
        let raw: u64 = raws.iter().map(|r| r.len() as u64).sum();
        total_raw += raw;
        let mut ratios = Vec::new();
        let mut speeds = Vec::new();
        let mut best = u64::MAX;
        for (k, codec) in [
            Codec::ZSTD,
            Codec::PLANES_ZSTD,
            Codec::PLANES_RANS,
            Codec::PLANES_RANS_LANES,
        ]
        .into_iter()
        .enumerate()
        {
            let coded = code(*ty, codec, level, raws);
            let stored: u64 = coded.chunks.iter().map(|(_, s)| s.len() as u64).sum();
            totals[k] += stored;
            // The best of what `ballast pack` chooses from by default.
            if Codec::CANDIDATES.contains(&codec) {
                best = best.min(stored);
            }
            ratios.push(format!("{:.3}x", raw as f64 / stored as f64));
            speeds.push(format!(
                "{:.2} / {:.2}",
                speed(*ty, codec, &coded, 1) / 1e9,
                speed(*ty, codec, &coded, 2) / 1e9
            ));
        }
        best_total += best;
        println!(
            "| {name} | {} | {raw} | {} | {} |",
            raws.len(),
            ratios.join(" | "),
            speeds.join(" | ")
        );
    }
    let all: Vec<String> = totals
        .iter()
        .map(|&t| format!("{:.3}x", total_raw as f64 / t as f64))
        .collect();
    println!("| all | | {total_raw} | {} | | | | |", all.join(" | "));
    println!(
        "\nbest codec per type: {:.3}x over the tensors",
        total_raw as f64 / best_total as f64
    );
    let t0 = Instant::now();
    let whole = zstd::bulk::compress(file.as_bytes(), level).context("zstd")?;
    println!(
        "zstd level {level} over the whole file in one frame: {:.3}x ({:.1} s)",
        file.file_len() as f64 / whole.len() as f64,
        t0.elapsed().as_secs_f64()
    );
    Ok(())
}
