//! StreamingLLM's positions: after any number of evictions, attention over the
//! streamed cache equals attention over the same tokens placed at in-cache positions
//! `0..n` from scratch (the paper's definition), for sinks and for the plain window.

use std::sync::Arc;

use ballast_kv_cache::{new_cache, KvElement, StreamingLlm, UpdateMode};
use ballast_runtime::backend::ops::*;
use ballast_runtime::backend::{AttentionShape, Rope, RopeStyle};
use ballast_runtime::{CpuBackend, DenseKv, KvCache, KvPolicy, KvShape};

const SHAPE: KvShape = KvShape {
    n_layers: 2,
    n_kv_heads: 1,
    head_dim: 32,
};

fn rope() -> Rope {
    Rope {
        style: RopeStyle::Normal,
        n_dims: 32,
        freq_base: 10000.0,
        freq_scale: 1.0,
        freq_factors: None,
    }
}

fn raw(t: usize, salt: usize) -> Vec<f32> {
    (0..32)
        .map(|e| (((t * 131 + e * 17 + salt * 7) % 101) as f32 / 29.0 - 1.7).sin())
        .collect()
}

fn rotated(backend: &CpuBackend, x: &[f32], pos: u32) -> Vec<f32> {
    let mut y = x.to_vec();
    backend.rope(&mut y, &[pos], 1, 32, &rope()).unwrap();
    y
}

fn attend(
    backend: &CpuBackend,
    cache: &dyn KvCache,
    layer: usize,
    q: &[f32],
    pos: u32,
) -> Vec<f32> {
    let shape = AttentionShape::new(1, 1, 32);
    let mut out = vec![0f32; 32];
    backend
        .attention(q, &[pos], &cache.view(layer), &shape, &mut out)
        .unwrap();
    out
}

#[test]
fn streamed_attention_equals_in_cache_positions() {
    let backend = Arc::new(CpuBackend::new(1));
    let n_tokens = 40;
    for (n_sink, window) in [(2usize, 6usize), (0, 8), (4, 5)] {
        for mode in UpdateMode::ALL {
            let mut cache = new_cache(mode, SHAPE, n_sink + window, KvElement::F32).unwrap();
            let mut policy = StreamingLlm::new(n_sink, window)
                .unwrap()
                .with_rope(backend.clone(), vec![rope(); SHAPE.n_layers]);
            for t in 0..n_tokens {
                policy.before_pass(cache.as_mut(), 1).unwrap();
                for layer in 0..SHAPE.n_layers {
                    let k = rotated(&backend, &raw(t, layer), t as u32);
                    cache
                        .append(layer, &[t as u32], &k, &raw(t, layer + 9))
                        .unwrap();
                }
            }
            assert_eq!(cache.len(), n_sink + window);
            // The paper's cache: sinks then the window, at positions 0..n from scratch.
            let kept: Vec<usize> = (0..n_sink).chain(n_tokens - window..n_tokens).collect();
            let mut fresh = DenseKv::with_element(SHAPE, kept.len(), KvElement::F32).unwrap();
            for layer in 0..SHAPE.n_layers {
                for (i, &t) in kept.iter().enumerate() {
                    let k = rotated(&backend, &raw(t, layer), i as u32);
                    fresh
                        .append(layer, &[i as u32], &k, &raw(t, layer + 9))
                        .unwrap();
                }
            }
            let q = raw(999, 3);
            for layer in 0..SHAPE.n_layers {
                let last = (n_tokens - 1) as u32;
                let got = attend(
                    &backend,
                    cache.as_ref(),
                    layer,
                    &rotated(&backend, &q, last),
                    last,
                );
                let in_cache = (kept.len() - 1) as u32;
                let want = attend(
                    &backend,
                    &fresh,
                    layer,
                    &rotated(&backend, &q, in_cache),
                    in_cache,
                );
                for (a, b) in got.iter().zip(&want) {
                    assert!(
                        (a - b).abs() < 1e-4,
                        "sinks {n_sink}, window {window}, {mode:?}, layer {layer}: {a} vs {b}"
                    );
                }
            }
        }
    }
}

/// Without a policy a bounded cache fills, then the forward pass gets a clear error;
/// a pass bigger than the window is refused with a message naming the batch.
#[test]
fn no_policy_fills_then_errors_and_big_chunks_are_refused() {
    let mut cache = new_cache(UpdateMode::PointerShift, SHAPE, 4, KvElement::F16).unwrap();
    let row = vec![0.5f32; 32];
    for t in 0..4u32 {
        cache.append(0, &[t], &row, &row).unwrap();
    }
    let err = cache.append(0, &[4], &row, &row).unwrap_err();
    assert!(err.to_string().contains("4"), "{err}");
    let mut policy = StreamingLlm::new(4, 8).unwrap();
    let err = policy.before_pass(cache.as_mut(), 64).unwrap_err();
    assert!(err.to_string().contains("batch"), "{err}");
}

/// Streams `n_tokens` through a sink-2 window-6 policy over an f16 ring and returns the
/// policy and cache.
fn streamed(backend: &Arc<CpuBackend>, n_tokens: usize) -> (StreamingLlm, Box<dyn KvCache>) {
    let mut cache = new_cache(UpdateMode::PointerShift, SHAPE, 8, KvElement::F16).unwrap();
    let mut policy = StreamingLlm::new(2, 6)
        .unwrap()
        .with_rope(backend.clone(), vec![rope(); SHAPE.n_layers]);
    for t in 0..n_tokens {
        policy.before_pass(cache.as_mut(), 1).unwrap();
        for layer in 0..SHAPE.n_layers {
            let k = rotated(backend, &raw(t, layer), t as u32);
            cache
                .append(layer, &[t as u32], &k, &raw(t, layer + 9))
                .unwrap();
        }
    }
    (policy, cache)
}

/// The sinks' first-seen keys survive a save and restore of the policy's state: a
/// policy restored into a copy of the cache evicts and re-rotates exactly as the
/// original goes on doing (a fresh policy, which re-anchors on the rotated f16 copies,
/// does not); malformed states are errors that change nothing.
#[test]
fn the_policy_state_restores_the_sinks_exactly() {
    let backend = Arc::new(CpuBackend::new(1));
    let (mut original, mut cache) = streamed(&backend, 20);
    let state = original.state();
    assert!(!state.is_empty(), "evictions anchored the sinks");

    let copy_of = |cache: &dyn KvCache| {
        let mut bytes = Vec::new();
        cache.save(&mut bytes).unwrap();
        let mut c = new_cache(UpdateMode::PointerShift, SHAPE, 8, KvElement::F16).unwrap();
        c.load(&mut &bytes[..]).unwrap();
        c
    };
    let mut restored_cache = copy_of(cache.as_ref());
    let mut fresh_cache = copy_of(cache.as_ref());
    let mut restored = StreamingLlm::new(2, 6)
        .unwrap()
        .with_rope(backend.clone(), vec![rope(); SHAPE.n_layers]);
    restored.restore_state(&state).unwrap();
    assert_eq!(restored.state(), state);
    let mut fresh = StreamingLlm::new(2, 6)
        .unwrap()
        .with_rope(backend.clone(), vec![rope(); SHAPE.n_layers]);

    let sinks = |c: &dyn KvCache| {
        let (mut p, mut k, mut v) = (vec![], vec![], vec![]);
        c.read(0, 0..2, &mut p, &mut k, &mut v);
        (p, k)
    };
    let mut fresh_differs = false;
    for t in 20..30usize {
        for (policy, c) in [
            (&mut original as &mut dyn KvPolicy, &mut cache),
            (&mut restored, &mut restored_cache),
            (&mut fresh, &mut fresh_cache),
        ] {
            policy.before_pass(c.as_mut(), 1).unwrap();
            for layer in 0..SHAPE.n_layers {
                let k = rotated(&backend, &raw(t, layer), t as u32);
                c.append(layer, &[t as u32], &k, &raw(t, layer + 9))
                    .unwrap();
            }
        }
        assert_eq!(
            sinks(restored_cache.as_ref()),
            sinks(cache.as_ref()),
            "token {t}"
        );
        fresh_differs |= sinks(fresh_cache.as_ref()) != sinks(cache.as_ref());
    }
    assert!(
        fresh_differs,
        "a policy without the state re-anchors on rounded keys"
    );

    let mut other = StreamingLlm::new(3, 6).unwrap();
    let err = other.restore_state(&state).unwrap_err().to_string();
    assert!(err.contains("2 attention sinks"), "{err}");
    for bad in [&state[..state.len() - 1], &state[..9]] {
        let before = restored.state();
        let err = restored.restore_state(bad).unwrap_err().to_string();
        assert!(err.contains("StreamingLLM state"), "{err}");
        assert_eq!(
            restored.state(),
            before,
            "a failed restore changed the policy"
        );
    }
    let mut flagged = state.clone();
    flagged[8] = 7;
    assert!(restored.restore_state(&flagged).is_err());
}
