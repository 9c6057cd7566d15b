//! The tiny reference models (`testing::reference_spec`: SPM-llama, qwen3, gemma3, qwen3moe
//! and Mixtral) against
//! llama.cpp: Ballast's first-step logits within 1e-3 of the largest logit of
//! llama.cpp's, on the CPU and on wgpu. llama.cpp's numbers were recorded once, in
//! `tests/data/llama_cpp_tiny_logits.json`, which says how they were made.

use std::sync::Arc;

use ballast_runtime::gguf::GgufFile;
use ballast_runtime::model::Logits;
use ballast_runtime::testing::{reference_spec, REFERENCE_SPECS};
use ballast_runtime::{Backend, CpuBackend, DenseKv, Model};

/// Largest difference, relative to llama.cpp's largest logit.
const TOLERANCE: f32 = 1e-3;

fn recorded() -> serde_json::Value {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/data/llama_cpp_tiny_logits.json"
    );
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// The last position's logits of one prefill of `ids`, on the default (f16) cache, as
/// llama.cpp computed them.
fn first_step(name: &str, backend: Arc<dyn Backend>, ids: &[u32]) -> Vec<f32> {
    let spec = reference_spec(name).unwrap();
    let file = Arc::new(GgufFile::from_bytes(spec.to_gguf_bytes().unwrap()).unwrap());
    let mut model = Model::load(file, backend, false).unwrap();
    let mut kv = DenseKv::new(model.kv_shape(), 64);
    let positions: Vec<u32> = (0..ids.len() as u32).collect();
    model
        .forward(ids, &positions, &mut kv, None, Logits::Last)
        .unwrap()
        .to_vec()
}

fn check(backend: impl Fn() -> Arc<dyn Backend>, what: &str) {
    let data = recorded();
    let ids: Vec<u32> = serde_json::from_value(data["ids"].clone()).unwrap();
    for name in REFERENCE_SPECS {
        let want: Vec<f32> = serde_json::from_value(data[*name].clone()).unwrap();
        let got = first_step(name, backend(), &ids);
        assert_eq!(got.len(), want.len(), "{name}: vocabulary size");
        let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
        let diff = got
            .iter()
            .zip(&want)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        eprintln!("{name} on {what}: largest difference {diff:.3e} of a largest logit {scale:.3}");
        assert!(
            diff <= TOLERANCE * scale,
            "{name} on {what}: logits differ from llama.cpp's by {diff} (largest logit {scale})"
        );
    }
}

#[test]
fn first_step_logits_match_llama_cpp_on_the_cpu() {
    check(|| Arc::new(CpuBackend::new(2)), "cpu");
}

#[cfg(feature = "gpu")]
#[test]
fn first_step_logits_match_llama_cpp_on_wgpu() {
    let Some(ctx) = ballast_runtime::testing::gpu_for_tests() else {
        return;
    };
    check(
        || Arc::new(ballast_runtime::WgpuBackend::new(ctx.clone())),
        "wgpu",
    );
}
