//! The KV cache's element type on the wgpu device: a q8 cache is q8 on the device too
//! (the pass rounds new rows into it as the host does, attention reads it as stored),
//! its logits follow the CPU's over the same cache, it takes under half the device bytes
//! of an f32 cache, and StreamingLLM over it decodes each token in one submission.
//!
//! Needs a wgpu adapter: under CI (`CI` set) a missing one fails; elsewhere the tests
//! are skipped with a printed reason.

use std::sync::Arc;

use ballast_kv_cache::{new_cache, Precision, StreamingLlm, UpdateMode};
use ballast_runtime::backend::DeviceMemory;
use ballast_runtime::gguf::GgufFile;
use ballast_runtime::testing::TinyModelSpec;
use ballast_runtime::{Backend, CpuBackend, KvPolicy, Model, Session, WgpuBackend};

const PROMPT: [u32; 10] = [72, 101, 108, 108, 111, 44, 32, 119, 256, 3];

fn load(backend: Arc<dyn Backend>) -> Model {
    let spec = TinyModelSpec::default();
    let file = Arc::new(GgufFile::from_bytes(spec.to_gguf_bytes().unwrap()).unwrap());
    Model::load(file, backend, false).unwrap()
}

fn session(backend: Arc<dyn Backend>, precision: Precision, policy: bool) -> Session {
    let model = load(backend.clone());
    let cache = new_cache(UpdateMode::PointerShift, model.kv_shape(), 16, precision).unwrap();
    let policy: Option<Box<dyn KvPolicy>> = policy.then(|| {
        let rope = model.config().rope;
        Box::new(StreamingLlm::new(4, 12).unwrap().with_rope(backend, rope)) as Box<dyn KvPolicy>
    });
    Session::with_cache(model, cache, policy)
}

/// The largest logit's id (lowest on ties).
fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in logits.iter().enumerate() {
        if v > logits[best] {
            best = i;
        }
    }
    best as u32
}

fn max_rel_diff(a: &[f32], b: &[f32]) -> f32 {
    let scale = b.iter().fold(1e-3f32, |m, v| m.max(v.abs()));
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
        / scale
}

#[test]
fn a_q8_cache_is_q8_on_the_device() {
    let Some(ctx) = ballast_runtime::testing::gpu_for_tests() else {
        return;
    };
    let gpu = Arc::new(WgpuBackend::new(ctx));
    let mut device_bytes = Vec::new();
    for precision in [Precision::F32, Precision::Q8] {
        let mut on_cpu = session(Arc::new(CpuBackend::new(1)), precision, false);
        let mut on_gpu = session(gpu.clone(), precision, false);
        let mut next = 5u32;
        for step in 0..4 {
            let ids: &[u32] = if step == 0 { &PROMPT } else { &[next] };
            let want = on_cpu.feed(ids).unwrap().to_vec();
            let got = on_gpu.feed(ids).unwrap().to_vec();
            let d = max_rel_diff(&got, &want);
            assert!(d < 0.02, "{precision:?} step {step}: logits differ by {d}");
            next = argmax(&want);
        }
        let report = gpu.last_pass().unwrap();
        assert_eq!(report.submissions, 1);
        device_bytes.push(report.kv_device_bytes);
    }
    assert!(
        2 * device_bytes[1] < device_bytes[0],
        "q8 on the device takes {} B, f32 {} B",
        device_bytes[1],
        device_bytes[0]
    );
}

/// Past the cache's capacity StreamingLLM evicts before every pass; the device follows
/// and still decodes each token in one submission, as the CPU does token for token.
#[test]
fn streaming_over_a_q8_cache_decodes_in_one_submission_per_token() {
    let Some(ctx) = ballast_runtime::testing::gpu_for_tests() else {
        return;
    };
    let gpu = Arc::new(WgpuBackend::new(ctx));
    let mut on_cpu = session(Arc::new(CpuBackend::new(1)), Precision::Q8, true);
    let mut on_gpu = session(gpu.clone(), Precision::Q8, true);
    let mut next = on_cpu.feed_greedy(&PROMPT).unwrap();
    assert_eq!(on_gpu.feed_greedy(&PROMPT).unwrap(), next);
    for step in 0..20 {
        let want = on_cpu.feed(&[next]).unwrap().to_vec();
        let got = on_gpu.feed(&[next]).unwrap().to_vec();
        let d = max_rel_diff(&got, &want);
        assert!(d < 0.02, "step {step}: logits differ by {d}");
        assert_eq!(gpu.last_pass().unwrap().submissions, 1, "step {step}");
        assert!(on_gpu.kv().len() <= 16);
        next = argmax(&want);
    }
}
