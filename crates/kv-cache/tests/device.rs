//! The KV cache's element type on the wgpu device: a q8 cache is q8 on the device too
//! (the pass rounds new rows into it as the host does, attention reads it as stored),
//! its logits follow the CPU's over the same cache, it takes under half the device bytes
//! of an f32 cache, and StreamingLLM over it decodes each token in one submission.
//!
//! Needs a wgpu adapter: under CI (`CI` set) a missing one fails; elsewhere the tests
//! are skipped with a printed reason.

use std::sync::Arc;

use ballast_kv_cache::{new_cache, KvElement, StreamingLlm, UpdateMode};
use ballast_runtime::backend::{DeviceExecutor, Telemetry};
use ballast_runtime::gguf::GgufFile;
use ballast_runtime::testing::TinyModelSpec;
use ballast_runtime::{
    Backend, CpuBackend, KvCache, KvPolicy, KvShape, Model, Session, WgpuBackend,
};

const PROMPT: [u32; 10] = [72, 101, 108, 108, 111, 44, 32, 119, 256, 3];

fn load(backend: Arc<dyn Backend>) -> Model {
    let spec = TinyModelSpec::default();
    let file = Arc::new(GgufFile::from_bytes(spec.to_gguf_bytes().unwrap()).unwrap());
    Model::load(file, backend, false).unwrap()
}

fn session(backend: Arc<dyn Backend>, precision: KvElement, policy: bool) -> Session {
    let model = load(backend.clone());
    let cache = new_cache(UpdateMode::PointerShift, model.kv_shape(), 16, precision).unwrap();
    let policy: Option<Box<dyn KvPolicy>> = policy.then(|| {
        let layer_ropes = model.config().layer_ropes();
        Box::new(
            StreamingLlm::new(4, 12)
                .unwrap()
                .with_rope(backend, layer_ropes),
        ) as Box<dyn KvPolicy>
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
    for precision in [KvElement::F32, KvElement::Q8] {
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
    let mut on_cpu = session(Arc::new(CpuBackend::new(1)), KvElement::Q8, true);
    let mut on_gpu = session(gpu.clone(), KvElement::Q8, true);
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

/// Every layer's tokens as f32 after the storage rounding: positions, keys, values.
fn contents(cache: &dyn KvCache) -> Vec<(Vec<u32>, Vec<f32>, Vec<f32>)> {
    (0..cache.shape().n_layers)
        .map(|l| {
            let (mut p, mut k, mut v) = (Vec::new(), Vec::new(), Vec::new());
            cache.read(l, 0..usize::MAX, &mut p, &mut k, &mut v);
            let mut only = Vec::new();
            cache.positions(l, 0..usize::MAX, &mut only);
            assert_eq!(only, p, "positions() and read() of layer {l} agree");
            (p, k, v)
        })
        .collect()
}

/// Deterministic rows for `n` tokens from `seed`.
fn rows(n: usize, dim: usize, seed: usize) -> Vec<f32> {
    (0..n * dim)
        .map(|i| (((i + 1) * 37 + seed * 101) % 211) as f32 / 50.0 - 2.1)
        .collect()
}

/// A device cache and a host cache of each mode take the same appends, evictions,
/// rewinds and key rewrites and hold the same tokens, rounded to the same bits; a
/// session payload saved from either loads into the other.
#[test]
fn a_device_cache_holds_what_a_host_cache_holds() {
    let Some(ctx) = ballast_runtime::testing::gpu_for_tests() else {
        return;
    };
    let gpu = WgpuBackend::new(ctx);
    let shape = KvShape {
        n_layers: 2,
        n_kv_heads: 2,
        head_dim: 32,
    };
    let dim = shape.kv_dim();
    for precision in [KvElement::F32, KvElement::F16, KvElement::Q8] {
        for mode in UpdateMode::ALL {
            let mut host = new_cache(mode, shape, 12, precision).unwrap();
            let mut device = gpu
                .new_kv_cache(shape, 12, precision)
                .unwrap()
                .expect("wgpu keeps KV rows on the device");
            let mut next_pos = 0u32;
            let steps: [(&str, usize); 8] = [
                ("append", 5),
                ("evict", 1),
                ("append", 3),
                ("rewrite", 2),
                ("rewind", 6),
                ("append", 4),
                ("evict", 2),
                ("append", 2),
            ];
            for (i, (op, n)) in steps.into_iter().enumerate() {
                for cache in [host.as_mut(), device.as_mut()] {
                    match op {
                        "append" => {
                            let pos: Vec<u32> = (next_pos..next_pos + n as u32).collect();
                            for l in 0..shape.n_layers {
                                let (k, v) = (rows(n, dim, i + l), rows(n, dim, i + l + 50));
                                cache.append(l, &pos, &k, &v).unwrap();
                            }
                        }
                        "evict" => cache.evict(2..2 + n),
                        "rewind" => cache.rewind(n),
                        _ => {
                            let pos: Vec<u32> = (100..100 + n as u32).collect();
                            for l in 0..shape.n_layers {
                                cache.rewrite_keys(l, 1, &pos, &rows(n, dim, 77)).unwrap();
                            }
                        }
                    }
                }
                if op == "append" {
                    next_pos += n as u32;
                }
                assert_eq!(device.len(), host.len(), "{precision:?} {mode:?} step {i}");
                assert_eq!(
                    contents(device.as_ref()),
                    contents(host.as_ref()),
                    "{precision:?} {mode:?} after step {i} ({op} {n})"
                );
            }
            // Session payloads cross both ways.
            let (mut from_device, mut from_host) = (Vec::new(), Vec::new());
            device.save(&mut from_device).unwrap();
            host.save(&mut from_host).unwrap();
            let mut host_back = new_cache(mode, shape, 12, precision).unwrap();
            host_back.load(&mut from_device.as_slice()).unwrap();
            assert_eq!(contents(host_back.as_ref()), contents(host.as_ref()));
            let mut device_back = gpu.new_kv_cache(shape, 12, precision).unwrap().unwrap();
            device_back.load(&mut from_host.as_slice()).unwrap();
            assert_eq!(contents(device_back.as_ref()), contents(host.as_ref()));
            // A payload for another shape is refused, and the cache keeps its tokens.
            let mut other = gpu
                .new_kv_cache(
                    KvShape {
                        n_layers: 3,
                        ..shape
                    },
                    12,
                    precision,
                )
                .unwrap()
                .unwrap();
            other
                .append(0, &[0], &rows(1, dim, 1), &rows(1, dim, 2))
                .unwrap();
            let err = other.load(&mut from_host.as_slice()).unwrap_err();
            assert!(err.to_string().contains("shape"), "{err}");
            assert_eq!(other.len(), 1);
        }
    }
}

/// A session on a device cache: the same logits as the CPU over a host cache of the
/// same type, token for token, through StreamingLLM's evictions; each decode step is
/// one submission that reads back the logits and no keys or values; the device holds
/// f16 in half the bytes of f32 and q8 in under half.
#[test]
fn a_session_on_a_device_cache_reads_back_only_logits() {
    let Some(ctx) = ballast_runtime::testing::gpu_for_tests() else {
        return;
    };
    let gpu = Arc::new(WgpuBackend::new(ctx));
    let mut device_bytes = Vec::new();
    for precision in [KvElement::F32, KvElement::F16, KvElement::Q8] {
        let mut on_cpu = session(Arc::new(CpuBackend::new(1)), precision, true);
        let model = load(gpu.clone());
        let cache = gpu
            .new_kv_cache(model.kv_shape(), 16, precision)
            .unwrap()
            .unwrap();
        let layer_ropes = model.config().layer_ropes();
        let policy = StreamingLlm::new(4, 12)
            .unwrap()
            .with_rope(gpu.clone(), layer_ropes);
        let vocab = model.config().vocab_size;
        let mut on_gpu = Session::with_cache(model, cache, Some(Box::new(policy)));
        let mut next = on_cpu.feed_greedy(&PROMPT).unwrap();
        assert_eq!(on_gpu.feed_greedy(&PROMPT).unwrap(), next, "{precision:?}");
        for step in 0..12 {
            let want = on_cpu.feed(&[next]).unwrap().to_vec();
            let got = on_gpu.feed(&[next]).unwrap().to_vec();
            let d = max_rel_diff(&got, &want);
            assert!(d < 0.02, "{precision:?} step {step}: logits differ by {d}");
            let report = gpu.last_pass().unwrap();
            assert_eq!(report.submissions, 1, "{precision:?} step {step}");
            assert_eq!(
                report.bytes_read_back,
                (vocab * 4) as u64,
                "{precision:?} step {step}: only the logits come back"
            );
            next = argmax(&want);
        }
        assert_eq!(
            contents(on_gpu.kv())
                .iter()
                .map(|l| &l.0)
                .collect::<Vec<_>>(),
            contents(on_cpu.kv())
                .iter()
                .map(|l| &l.0)
                .collect::<Vec<_>>(),
            "{precision:?}: the same positions after the evictions"
        );
        device_bytes.push(gpu.last_pass().unwrap().kv_device_bytes);
    }
    let [f32_bytes, f16_bytes, q8_bytes] = device_bytes[..] else {
        unreachable!()
    };
    assert!(
        f16_bytes < f32_bytes * 6 / 10,
        "f16 {f16_bytes} B, f32 {f32_bytes} B"
    );
    assert!(
        2 * q8_bytes < f32_bytes,
        "q8 {q8_bytes} B, f32 {f32_bytes} B"
    );
}
