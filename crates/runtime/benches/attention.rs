//! A decoded token's attention on the CPU backend, at SmolLM2-135M's shape (9 query
//! heads, 3 key/value heads of 64, an f16 cache), over 30 layers' caches of their own
//! (94 MB at 4,096 keys, more than the last-level cache, as in a real decode where the
//! weights stream through between two visits of a layer), on 1 and 2 threads.
//!
//! `cargo bench --bench attention` prints the median time of one layer's attention over
//! many rounds of the 30 layers, at 300, 1,000 and 4,100 cached keys, or at the counts
//! given: `cargo bench --bench attention -- 400 768`.

use ballast_runtime::backend::AttentionShape;
use ballast_runtime::kv::{KvRows, KvSegment, KvView};
use ballast_runtime::{Backend, CpuBackend};
use half::f16;
use std::time::Instant;

const LAYERS: usize = 30;

fn main() {
    // Numbers among the arguments are the cell counts to measure (cargo passes its own
    // flags, such as `--bench`, which are not).
    let mut sizes: Vec<usize> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    if sizes.is_empty() {
        sizes = vec![300, 1000, 4100];
    }
    let shape = AttentionShape::new(9, 3, 64);
    let kv_dim = 3 * 64;
    println!("| keys | threads | µs per layer (median) |");
    println!("|---:|---:|---:|");
    for cells in sizes {
        let mut seed = 1u32;
        let mut rand = || {
            seed = seed.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            f16::from_f32((seed >> 8) as f32 / (1u32 << 24) as f32 * 2.0 - 1.0)
        };
        let caches: Vec<(Vec<f16>, Vec<f16>)> = (0..LAYERS)
            .map(|_| {
                let k = (0..cells * kv_dim).map(|_| rand()).collect();
                let v = (0..cells * kv_dim).map(|_| rand()).collect();
                (k, v)
            })
            .collect();
        let positions: Vec<u32> = (0..cells as u32).collect();
        let q: Vec<f32> = (0..9 * 64)
            .map(|i| ((i * 37 % 101) as f32 / 50.0) - 1.0)
            .collect();
        let mut out = vec![0f32; q.len()];
        for threads in [1usize, 2] {
            let be: Box<dyn Backend> = Box::new(CpuBackend::new(threads));
            let mut per_layer = Vec::new();
            let rounds = (200_000 / cells).clamp(5, 200);
            for round in 0..rounds + 2 {
                let t = Instant::now();
                for (k, v) in &caches {
                    let view = KvView {
                        segments: vec![KvSegment {
                            keys: KvRows::F16(k),
                            values: KvRows::F16(v),
                            positions: &positions,
                        }],
                    };
                    be.attention(&q, &[cells as u32 - 1], &view, &shape, &mut out)
                        .expect("attention");
                }
                // The first two rounds warm up.
                if round >= 2 {
                    per_layer.push(t.elapsed().as_secs_f64() / LAYERS as f64);
                }
            }
            per_layer.sort_by(f64::total_cmp);
            println!(
                "| {cells} | {threads} | {:.1} |",
                per_layer[per_layer.len() / 2] * 1e6
            );
        }
    }
}
