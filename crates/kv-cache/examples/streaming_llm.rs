//! StreamingLLM over your own key/value rows: 4 attention sinks and a window of 12,
//! fed 100 tokens one at a time, as a forward pass would.
//!
//! Nothing here needs the runtime: the cache and the policy are this crate's, and the
//! RoPE op that re-rotates the sinks' keys after an eviction (`StreamingLlm::with_rope`
//! takes any `RopeOps`; a runtime backend is one) is the few lines of `NeoxRope` below.
//!
//! Run: `cargo run -p ballast-kv-cache --example streaming_llm`

use std::sync::Arc;

use ballast_core::backend::{Rope, RopeOps, RopeStyle};
use ballast_core::{KvCache, KvPolicy, KvShape};
use ballast_kv_cache::{KvElement, PointerShift, StreamingLlm};

/// NeoX-style RoPE on the host: pairs `(x[i], x[i + n_dims / 2])` of each head.
struct NeoxRope;

impl RopeOps for NeoxRope {
    fn rope(
        &self,
        x: &mut [f32],
        positions: &[u32],
        n_heads: usize,
        head_dim: usize,
        rope: &Rope,
    ) -> ballast_core::Result<()> {
        let half = rope.n_dims / 2;
        for (row, &pos) in x.chunks_exact_mut(n_heads * head_dim).zip(positions) {
            for head in row.chunks_exact_mut(head_dim) {
                for i in 0..half {
                    let theta =
                        pos as f32 * rope.freq_base.powf(-2.0 * i as f32 / rope.n_dims as f32);
                    let (sin, cos) = rope.angle(i, theta).sin_cos();
                    let (a, b) = (head[i], head[i + half]);
                    head[i] = a * cos - b * sin;
                    head[i + half] = a * sin + b * cos;
                }
            }
        }
        Ok(())
    }
}

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
    let backend = Arc::new(NeoxRope);
    let mut cache = PointerShift::new(shape, n_sink + window, KvElement::F16)?;
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
