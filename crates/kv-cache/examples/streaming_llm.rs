//! StreamingLLM over your own key/value rows: 4 attention sinks and a window of 12,
//! fed 100 tokens one at a time, as a forward pass would.
//!
//! The cache and the policy are this crate's alone. Re-rotating the sinks' keys after
//! an eviction needs a RoPE op, which `StreamingLlm::with_rope` takes as a backend;
//! the runtime's CPU backend (a dev-dependency) lends it here.
//!
//! Run: `cargo run -p ballast-kv-cache --example streaming_llm`

use std::sync::Arc;

use ballast_core::backend::{Rope, RopeOps, RopeStyle};
use ballast_core::{KvCache, KvPolicy, KvShape};
use ballast_kv_cache::{PointerShift, Precision, StreamingLlm};
use ballast_runtime::CpuBackend;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let shape = KvShape {
        n_layers: 2,
        n_kv_heads: 2,
        head_dim: 64,
    };
    let (n_sink, window) = (4, 12);
    let rope = Rope {
        style: RopeStyle::Neox,
        n_dims: 64,
        freq_base: 10_000.0,
        freq_scale: 1.0,
        freq_factors: None,
    };
    let backend = Arc::new(CpuBackend::new(1));
    let mut cache = PointerShift::new(shape, n_sink + window, Precision::F16)?;
    let mut policy = StreamingLlm::new(n_sink, window)?
        .with_rope(backend.clone(), vec![rope.clone(); shape.n_layers]);

    for pos in 0..100u32 {
        policy.before_pass(&mut cache, 1)?; // evicts the oldest token after the sinks
        for layer in 0..shape.n_layers {
            // Your model's key and value of this token, the key rotated to its position.
            let mut key: Vec<f32> = (0..shape.kv_dim())
                .map(|i| ((pos as usize * 7 + i + layer) % 13) as f32 / 13.0)
                .collect();
            backend.rope(&mut key, &[pos], shape.n_kv_heads, shape.head_dim, &rope)?;
            let value = vec![pos as f32; shape.kv_dim()];
            cache.append(layer, &[pos], &key, &value)?;
        }
    }

    let (mut positions, mut keys, mut values) = (vec![], vec![], vec![]);
    cache.read(0, 0..cache.len(), &mut positions, &mut keys, &mut values);
    let tokens: Vec<u32> = values.chunks(shape.kv_dim()).map(|v| v[0] as u32).collect();
    println!(
        "fed 100 tokens; the cache holds {} of them ({n_sink} sinks + a window of {window})",
        cache.len()
    );
    println!("tokens kept:           {tokens:?}");
    println!("positions (re-rotated): {positions:?}");
    println!(
        "bytes held: {} (f16 keys and values, {} layers)",
        cache.held_bytes().total(),
        shape.n_layers
    );
    Ok(())
}
