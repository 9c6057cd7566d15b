//! What the model tests share: tiny models, greedy runs, calibration.
#![allow(dead_code)]

use std::sync::Arc;

use ballast_runtime::ggml_type::GgmlType;
use ballast_runtime::gguf::GgufFile;
use ballast_runtime::store::PassId;
use ballast_runtime::testing::TinyModelSpec;
use ballast_runtime::{Backend, CpuBackend, Model, Session};
use ballast_sparse_mlp::{Predictor, SparseFfn, SparsityProfile};

/// A tiny llama of 3 layers of 256 neurons with weights of `weight_type`.
pub fn tiny(seed: u64, weight_type: GgmlType) -> Model {
    tiny_on(seed, weight_type, Arc::new(CpuBackend::new(2)))
}

/// [`tiny`] on `backend`.
pub fn tiny_on(seed: u64, weight_type: GgmlType, backend: Arc<dyn Backend>) -> Model {
    let spec = TinyModelSpec {
        n_layers: 3,
        n_ff: 256,
        seed,
        weight_type,
        ..TinyModelSpec::default()
    };
    let file = Arc::new(GgufFile::from_bytes(spec.to_gguf_bytes().unwrap()).unwrap());
    Model::load(file, backend, false).unwrap()
}

/// Logits after `prompt` fed `chunk` tokens at a time (the last chunk's), then after
/// each of `steps` greedy tokens.
pub fn run_chunked(model: Model, prompt: &[u32], chunk: usize, steps: usize) -> Vec<Vec<f32>> {
    let mut session = Session::new(model, 64).unwrap();
    let mut out = Vec::new();
    for c in prompt.chunks(chunk) {
        out.push(session.feed(c).unwrap().to_vec());
    }
    for _ in 0..steps {
        let last = out.last().unwrap();
        let next = (0..last.len())
            .max_by(|&a, &b| last[a].total_cmp(&last[b]))
            .unwrap() as u32;
        out.push(session.feed(&[next]).unwrap().to_vec());
    }
    out
}

/// Logits after `prompt`, then after each of `steps` greedy tokens.
pub fn run(model: Model, prompt: &[u32], steps: usize) -> Vec<Vec<f32>> {
    run_chunked(model, prompt, prompt.len(), steps)
}

/// The sparsity profile of `model` on `text`.
pub fn calibrate(model: &Model, text: &[u32]) -> SparsityProfile {
    let (ffn, calibration) = SparseFfn::calibrating();
    let mut session = Session::new(model.share_with_ffn(Box::new(ffn)), 64).unwrap();
    session.feed(text).unwrap();
    calibration.profile(1, text.len() as u64)
}

/// A calibration text of 48 tokens.
pub fn text() -> Vec<u32> {
    (0..48).map(|i| (i * 37 % 250) as u32 + 3).collect()
}

pub const PROMPT: [u32; 6] = [72, 101, 108, 108, 111, 44];

/// The profile of `text` with predictors of rank `rank` fitted on it: from the MLP
/// input, and from the attention input.
pub fn calibrate_with_predictor(model: &Model, text: &[u32], rank: usize) -> SparsityProfile {
    let (ffn, calibration) = SparseFfn::calibrating_with_moments();
    let mut session = Session::new(model.share_with_ffn(Box::new(ffn)), 64).unwrap();
    session.feed(text).unwrap();
    let mut profile = calibration.profile(1, text.len() as u64);
    let backend = model.backend().as_ref();
    let (mut mlp, mut attention) = (Vec::new(), Vec::new());
    for l in 0..model.config().n_layers {
        let weights = model.store().layer(PassId(0), l).unwrap();
        let gate = weights.matrix("ffn_gate.weight").unwrap();
        mlp.push(calibration.fit_predictor(backend, l, gate, rank).unwrap());
        attention.push(
            calibration
                .fit_attention_predictor(backend, l, gate, rank)
                .unwrap(),
        );
    }
    profile.predictor = Some(Predictor { layers: mlp });
    profile.attention_predictor = Some(Predictor { layers: attention });
    profile
}
