//! Single-thread throughput of the quantized matmul kernels on SmolLM2-135M's and
//! Qwen2.5-Coder-0.5B's shapes.
//!
//! n_tokens = 1 reports weight bytes per second (matvec, decode); n_tokens = 128 reports
//! tokens per second through one matrix (prompt processing). Every supported SIMD level is
//! measured in the same run. Times are this thread's CPU time (the build machine is shared). Filter with e.g. `cargo bench --bench quant -- Q4_1/q`.

use ballast_runtime::ggml_type::GgmlType;
use ballast_runtime::quant::{self, QuantizedActivations, SimdLevel};
use criterion::{criterion_group, BenchmarkId, Criterion, Throughput};
use std::time::{Duration, Instant};

/// CPU time of this thread in ns (from `/proc/thread-self/schedstat`), so that other
/// processes competing for the cores do not inflate the measurements; `None` off Linux.
fn thread_cpu_ns() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/thread-self/schedstat").ok()?;
    s.split_whitespace().next()?.parse().ok()
}

/// Runs `f` `iters` times and returns the thread CPU time it took (wall time as fallback,
/// also when the CPU time did not advance: the kernel updates it at ticks and context
/// switches, so a short run can read as taking no time at all).
fn cpu_time(iters: u64, mut f: impl FnMut()) -> Duration {
    let (c0, t0) = (thread_cpu_ns(), Instant::now());
    for _ in 0..iters {
        f();
    }
    match (c0, thread_cpu_ns()) {
        (Some(a), Some(b)) if b > a => Duration::from_nanos(b - a),
        _ => t0.elapsed(),
    }
}

/// (name, rows, k) of SmolLM2-135M's matrices.
const SHAPES: [(&str, usize, usize); 5] = [
    ("q_o", 576, 576),
    ("k_v", 192, 576),
    ("gate_up", 1536, 576),
    ("down", 576, 1536),
    ("head", 49152, 576),
];

/// (name, rows, k) of Qwen2.5-Coder-0.5B's matrices: Q5_0 (and Q8_0) where k = 896, the
/// K-quants only in `ffn_down` (k = 4864; 896 is not a multiple of 256).
const QWEN_SHAPES: [(&str, usize, usize); 3] = [
    ("qwen_q_o", 896, 896),
    ("qwen_gate_up", 4864, 896),
    ("qwen_down", 896, 4864),
];

/// Qwen2.5-Coder-0.5B's tied output head (Q8_0, 145 MB): far larger than any core's
/// private caches, so its decode figure is a streaming rate, what a token pays for the
/// head and, at that rate, for the layers.
const QWEN_HEAD: (&str, usize, usize) = ("qwen_head", 151_936, 896);

/// Every (type, shape) measured: SmolLM2's Q4_1 / Q8_0 (the head only in Q8_0), and the
/// other types on the Qwen shapes their rows fit.
fn cases() -> Vec<(GgmlType, &'static str, usize, usize)> {
    let mut out = Vec::new();
    for ty in [GgmlType::Q4_1, GgmlType::Q8_0] {
        for &(name, rows, k) in SHAPES.iter() {
            if name != "head" || ty == GgmlType::Q8_0 {
                out.push((ty, name, rows, k));
            }
        }
    }
    for ty in [
        GgmlType::Q5_0,
        GgmlType::Q5_1,
        GgmlType::Q4_K,
        GgmlType::Q5_K,
        GgmlType::Q6_K,
    ] {
        for &(name, rows, k) in QWEN_SHAPES.iter() {
            if k % ty.block_len() == 0 && (ty.block_len() == 256 || name != "qwen_down") {
                out.push((ty, name, rows, k));
            }
        }
    }
    let (name, rows, k) = QWEN_HEAD;
    out.push((GgmlType::Q8_0, name, rows, k));
    // A matrix of 96-150 MB of each decode kernel's type: far larger than the caches, so
    // what a token pays for streaming that type from memory (the prefetch pattern).
    for ty in [
        GgmlType::Q4_K,
        GgmlType::Q6_K,
        GgmlType::Q5_0,
        GgmlType::Q4_1,
        GgmlType::Q8_0,
    ] {
        out.push((ty, "dram_1536", 65536, 1536));
    }
    out
}

fn data(n: usize, seed: u32) -> Vec<f32> {
    (0..n)
        .map(|i| {
            ((i as u32).wrapping_mul(2654435761).wrapping_add(seed) as f32 / u32::MAX as f32) - 0.5
        })
        .collect()
}

fn bench(c: &mut Criterion) {
    let mut g = c.benchmark_group("matmul");
    g.warm_up_time(Duration::from_millis(200))
        .measurement_time(Duration::from_millis(600))
        .sample_size(10);
    for (ty, name, rows, k) in cases() {
        let w = quant::quantize(ty, &data(rows * k, 1)).unwrap();
        // The head's prefill is the same kernel as the other Q8_0 shapes', and a
        // prompt's logits are only needed for its last token.
        let token_counts: &[usize] = if name == QWEN_HEAD.0 || name.starts_with("dram") {
            &[1]
        } else {
            &[1, 128]
        };
        for &n in token_counts {
            let mut acts = QuantizedActivations::new();
            quant::quantize_activations(ty, &data(n * k, 7), n, k, &mut acts).unwrap();
            let mut out = vec![0f32; rows * n];
            if n == 1 {
                g.throughput(Throughput::Bytes(w.len() as u64));
            } else {
                g.throughput(Throughput::Elements(n as u64));
            }
            for level in quant::available_simd_levels() {
                if level == SimdLevel::Scalar && n > 1 && name == "head" {
                    continue;
                }
                let id = BenchmarkId::new(format!("{}/{name}/n{n}", ty.name()), level.name());
                g.bench_function(id, |b| {
                    b.iter_custom(|iters| {
                        cpu_time(iters, || {
                            quant::matmul_at(level, ty, &w, k, &acts, &mut out).unwrap()
                        })
                    })
                });
            }
        }
    }
    g.finish();

    let mut g = c.benchmark_group("quantize_activations");
    g.warm_up_time(Duration::from_millis(200))
        .measurement_time(Duration::from_millis(400))
        .sample_size(10);
    for ty in [GgmlType::Q4_1, GgmlType::Q8_0, GgmlType::Q4_K] {
        for n in [1usize, 128] {
            let k = 1536;
            let x = data(n * k, 3);
            let mut acts = QuantizedActivations::new();
            g.throughput(Throughput::Elements((n * k) as u64));
            g.bench_function(format!("{}/k{k}/n{n}", ty.name()), |b| {
                b.iter_custom(|iters| {
                    cpu_time(iters, || {
                        quant::quantize_activations(ty, &x, n, k, &mut acts).unwrap()
                    })
                })
            });
        }
    }
    g.finish();
}

/// `BALLAST_BENCH_TABLE=1 cargo bench --bench quant`: instead of criterion, prints a
/// (`BALLAST_BENCH_TABLE=Q8_0/head` restricts it to matching `type/shape` names)
/// markdown table of the best (minimum CPU time) of several short runs per configuration,
/// which is robust to other processes sharing the machine.
fn table() {
    let levels = quant::available_simd_levels();
    print!("| type | shape (rows x k) | n_tokens | unit |");
    for l in &levels {
        print!(" {} |", l.name());
    }
    println!();
    println!("|---|---|---|---|{}", "---|".repeat(levels.len()));
    for (ty, name, rows, k) in cases() {
        let filter = std::env::var("BALLAST_BENCH_TABLE").unwrap_or_default();
        if !format!("{}/{name}", ty.name()).contains(filter.trim_start_matches('1')) {
            continue;
        }
        let w = quant::quantize(ty, &data(rows * k, 1)).unwrap();
        // The head's prefill is the same kernel as the other Q8_0 shapes', and a
        // prompt's logits are only needed for its last token.
        let token_counts: &[usize] = if name == QWEN_HEAD.0 || name.starts_with("dram") {
            &[1]
        } else {
            &[1, 128]
        };
        for &n in token_counts {
            let mut acts = QuantizedActivations::new();
            quant::quantize_activations(ty, &data(n * k, 7), n, k, &mut acts).unwrap();
            let mut out = vec![0f32; rows * n];
            let unit = if n == 1 { "GB/s" } else { "tok/s" };
            print!("| {} | {name} {rows}x{k} | {n} | {unit} |", ty.name());
            for &level in &levels {
                let mut run = || quant::matmul_at(level, ty, &w, k, &acts, &mut out).unwrap();
                if level == SimdLevel::Scalar && n > 1 && name == "head" {
                    print!(" - |");
                    continue;
                }
                let t = Instant::now();
                run();
                let once = t.elapsed().as_secs_f64().max(1e-6);
                // Runs of at least 0.1 s: on some machines the thread CPU time advances
                // by scheduler ticks (4 ms), which would quantize shorter runs.
                let iters = ((0.1 / once) as u64).clamp(1, 10_000);
                let reps = if once > 0.2 { 2 } else { 5 };
                let best = (0..reps)
                    .map(|_| cpu_time(iters, &mut run).as_secs_f64() / iters as f64)
                    .fold(f64::MAX, f64::min);
                if n == 1 {
                    print!(" {:.2} |", w.len() as f64 / best / 1e9);
                } else {
                    print!(" {:.0} |", n as f64 / best);
                }
            }
            println!();
        }
    }
}

criterion_group!(benches, bench);

fn main() {
    if std::env::var_os("BALLAST_BENCH_TABLE").is_some() {
        table();
        return;
    }
    benches();
    Criterion::default().configure_from_args().final_summary();
}
