//! Tiny random models run whole: load one on a backend, take every position's logits,
//! compare two rows of logits.

use std::sync::Arc;

use ballast_runtime::gguf::GgufFile;
use ballast_runtime::model::Logits;
use ballast_runtime::testing::TinyModelSpec;
use ballast_runtime::DenseKv;
use ballast_runtime::{Backend, Model};

/// The tokens the whole-model tests feed (bytes and two special ids of the tiny
/// vocabulary).
pub const IDS: [u32; 10] = [72, 101, 108, 108, 111, 44, 32, 119, 256, 3];

/// `spec` written as a GGUF in memory and loaded on `backend`.
pub fn load(spec: &TinyModelSpec, backend: Arc<dyn Backend>) -> Model {
    let file = Arc::new(GgufFile::from_bytes(spec.to_gguf_bytes().unwrap()).unwrap());
    Model::load(file, backend, false).unwrap()
}

/// Logits of every position of `ids`, from an empty f16 cache.
pub fn all_logits(model: &mut Model, ids: &[u32]) -> Vec<f32> {
    let mut kv = DenseKv::new(model.kv_shape(), 64);
    let positions: Vec<u32> = (0..ids.len() as u32).collect();
    model
        .forward(ids, &positions, &mut kv, None, Logits::All)
        .unwrap()
        .to_vec()
}

/// Largest difference relative to the row's largest logit.
pub fn max_rel_diff(a: &[f32], b: &[f32]) -> f32 {
    let scale = b.iter().fold(1e-3f32, |m, v| m.max(v.abs()));
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
        / scale
}
