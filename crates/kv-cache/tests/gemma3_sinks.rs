//! StreamingLLM on gemma3, whose sliding-window layers rotate with another RoPE base
//! (10,000) than its global ones (1,000,000, and scaled on the larger models): after
//! evictions, every layer's sinks hold the keys a fresh pass computes for the same
//! tokens at the sinks' new positions. Re-rotating a sliding layer's sinks with the
//! model-wide base would put them at other angles and fail this.

use std::sync::Arc;

use ballast_kv_cache::{new_cache, KvElement, PolicyKind, StreamingLlm, UpdateMode};
use ballast_runtime::gguf::GgufFile;
use ballast_runtime::model::Logits;
use ballast_runtime::testing::reference_spec;
use ballast_runtime::{CpuBackend, KvCache, KvPolicy, Model};

const N_SINK: usize = 2;
const WINDOW: usize = 6;
/// Enough tokens for several evictions, each moving the sinks again.
const N_TOKENS: usize = 15;

fn load(spec: &str) -> Model {
    let spec = reference_spec(spec).unwrap();
    let file = Arc::new(GgufFile::from_bytes(spec.to_gguf_bytes().unwrap()).unwrap());
    Model::load(file, Arc::new(CpuBackend::new(1)), false).unwrap()
}

/// Positions and keys (f32) of cache indices `0..n` of `layer`.
fn rows(cache: &dyn KvCache, layer: usize, n: usize) -> (Vec<u32>, Vec<f32>) {
    let (mut positions, mut keys, mut values) = (Vec::new(), Vec::new(), Vec::new());
    cache.read(layer, 0..n, &mut positions, &mut keys, &mut values);
    (positions, keys)
}

/// The largest difference between `a` and `b`, relative to `b`'s largest magnitude.
fn max_rel_diff(a: &[f32], b: &[f32]) -> f32 {
    let scale = b.iter().fold(1e-6f32, |m, v| m.max(v.abs()));
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
        / scale
}

/// Streams `N_TOKENS` through a StreamingLLM cache of `N_SINK + WINDOW` tokens whose
/// sinks are re-rotated with each layer's own RoPE (`use_model_ropes`) or with the
/// global layers' RoPE for all, then compares each layer's sink keys with those of a
/// fresh pass over the sink tokens at their new positions. Returns the largest
/// relative difference of each layer.
fn sink_key_errors(model: &mut Model, use_model_ropes: bool) -> Vec<f32> {
    let config = model.config().clone();
    let layer_ropes = if use_model_ropes {
        config.layer_ropes()
    } else {
        // The bug this guards against: the global layers' RoPE for every layer.
        let global = config
            .layer_attention
            .iter()
            .find(|spec| spec.shape.window.is_none())
            .expect("gemma3 has global layers")
            .rope
            .clone();
        vec![global; config.n_layers]
    };
    let tokens: Vec<u32> = (0..N_TOKENS as u32).map(|t| 40 + 7 * t).collect();
    let kind = PolicyKind::Streaming {
        n_sink: N_SINK,
        window: WINDOW,
    };
    let mut policy = StreamingLlm::from_kind(kind, model.backend().clone(), layer_ropes)
        .unwrap()
        .unwrap();
    let mut cache = new_cache(
        UpdateMode::PointerShift,
        model.kv_shape(),
        N_SINK + WINDOW,
        KvElement::F32,
    )
    .unwrap();
    for (t, &id) in tokens.iter().enumerate() {
        model
            .forward(
                &[id],
                &[t as u32],
                cache.as_mut(),
                Some(&mut policy as &mut dyn KvPolicy),
                Logits::Last,
            )
            .unwrap();
    }
    let (sink_positions, _) = rows(cache.as_ref(), 0, N_SINK);
    let first_window = rows(cache.as_ref(), 0, N_SINK + 1).0[N_SINK];
    let moved: Vec<u32> = (0..N_SINK as u32)
        .map(|i| first_window - N_SINK as u32 + i)
        .collect();
    assert_eq!(
        sink_positions, moved,
        "the sinks sit just before the window"
    );
    assert!(moved[0] > 0, "the stream evicted");

    let mut fresh = new_cache(
        UpdateMode::PointerShift,
        model.kv_shape(),
        N_SINK,
        KvElement::F32,
    )
    .unwrap();
    model
        .forward(
            &tokens[..N_SINK],
            &moved,
            fresh.as_mut(),
            None,
            Logits::None,
        )
        .unwrap();
    (0..config.n_layers)
        .map(|layer| {
            let (positions, streamed) = rows(cache.as_ref(), layer, N_SINK);
            let (want_positions, want) = rows(fresh.as_ref(), layer, N_SINK);
            assert_eq!(positions, want_positions, "layer {layer}");
            max_rel_diff(&streamed, &want)
        })
        .collect()
}

#[test]
fn gemma3_sinks_turn_with_their_own_layers_rope() {
    for spec in ["gemma3", "gemma3-scaled"] {
        let mut model = load(spec);
        let sliding: Vec<bool> = model
            .config()
            .layer_attention
            .iter()
            .map(|s| s.shape.window.is_some())
            .collect();
        assert!(
            sliding.contains(&true) && sliding.contains(&false),
            "{spec}: {sliding:?}"
        );
        let errors = sink_key_errors(&mut model, true);
        for (layer, e) in errors.iter().enumerate() {
            assert!(
                *e < 1e-4,
                "{spec} layer {layer} (sliding: {}): sink keys off the recomputed ones by {e}",
                sliding[layer]
            );
        }
        // The same check sees the model-wide base on the sliding layers: the comparison
        // above is sharp enough to catch it.
        let wrong = sink_key_errors(&mut model, false);
        for (layer, e) in wrong.iter().enumerate() {
            if sliding[layer] {
                assert!(*e > 0.05, "{spec} layer {layer}: the global base gave {e}");
            }
        }
    }
}
