//! The whole forward pass on the wgpu backend (one recorded submission per pass) against
//! the CPU backend, on tiny random models: logits, chunked prefill, the KV mirror after
//! a rewind, the greedy id computed on the device, and what the pass reports.
//!
//! Needs a wgpu adapter: under CI (`CI` set) a missing one fails; elsewhere the tests
//! are skipped with a printed reason.

#![cfg(feature = "gpu")]

mod common;

use std::sync::atomic::Ordering;
use std::sync::Arc;

use common::tiny::{all_logits, load, max_rel_diff, IDS};

use ballast_runtime::backend::{Residency, Telemetry};
use ballast_runtime::ggml_type::GgmlType;
use ballast_runtime::gguf::GgufFile;
use ballast_runtime::gpu::GpuContext;
use ballast_runtime::kv::KvPolicy;
use ballast_runtime::kv::{KvCache, KvElement};
use ballast_runtime::model::{load_weights, Logits};
use ballast_runtime::store::PassId;
use ballast_runtime::testing::{reference_spec, TinyModelSpec, TINY_VOCAB};
use ballast_runtime::weights::{ByteSource, GlobalWeights, LayerWeights, WeightBytes};
use ballast_runtime::DenseKv;
use ballast_runtime::{
    Backend, CpuBackend, DenseFfn, Model, ModelConfig, Session, TierBytes, WeightStore, WgpuBackend,
};

/// The test context, its scratch buffers poisoned (NaN), so a tensor of the pass that
/// no op writes fails the comparison.
fn gpu() -> Option<Arc<GpuContext>> {
    let ctx = ballast_runtime::testing::gpu_for_tests()?;
    ctx.set_poison(true);
    Some(ctx)
}

/// Both backends quantize the activations to the same integers; only float summation
/// order differs, which can flip an 8-bit rounding now and then (a jump of one step in
/// one activation), so logits agree to a fraction of a percent, not bit for bit.
fn check_spec(spec: TinyModelSpec, tolerance: f32) {
    let Some(ctx) = gpu() else { return };
    let want = all_logits(&mut load(&spec, Arc::new(CpuBackend::new(2))), &IDS);
    let got = all_logits(&mut load(&spec, Arc::new(WgpuBackend::new(ctx))), &IDS);
    let vocab = spec.vocab_size();
    assert_eq!(got.len(), IDS.len() * vocab);
    for p in 0..IDS.len() {
        let r = p * vocab..(p + 1) * vocab;
        let d = max_rel_diff(&got[r.clone()], &want[r]);
        assert!(
            d < tolerance,
            "{} {:?}: position {p} differs by {d} of the largest logit",
            spec.arch,
            spec.weight_type
        );
    }
}

#[test]
fn llama_q8_0_pass_matches_the_cpu_backend() {
    check_spec(TinyModelSpec::default(), 0.02);
}

// qwen3's per-head Q/K norm runs on the device (the rms_norm kernel over heads as rows);
// Q8_0 adds the activation rounding of the llama case.
#[test]
fn qwen3_with_head_norms_matches_the_cpu_backend() {
    let spec = ballast_runtime::testing::reference_spec("qwen3").unwrap();
    check_spec(spec.clone(), 1e-3);
    check_spec(
        TinyModelSpec {
            weight_type: GgmlType::Q8_0,
            embd_type: GgmlType::Q8_0,
            ..spec
        },
        0.02,
    );
}

// gemma3 on the device: the embedding and query scales, GeGLU, the post-norms, and the
// sliding window (4 tokens on two of its three layers, so ten tokens cross it); Q8_0
// adds the activation rounding of the llama case, and a flip there passes through two
// more norms per layer than in llama (measured 0.021 of the largest logit, hence 0.03).
#[test]
fn gemma3_with_sliding_windows_matches_the_cpu_backend() {
    let spec = ballast_runtime::testing::reference_spec("gemma3").unwrap();
    check_spec(spec.clone(), 1e-3);
    check_spec(
        TinyModelSpec {
            weight_type: GgmlType::Q8_0,
            embd_type: GgmlType::Q8_0,
            ..spec
        },
        0.03,
    );
}

// A device cache whose sliding-window layers keep only their window (and hold buffers
// of the window plus one pass) computes what one keeping every token computes, for
// every element type, through prompt chunks, decoding and rewinds. The freed slots are
// reused, so attention visits keys in another slot order: equal to a rounding, which
// the GELU's f16 table can turn into steps of 2^-11 (measured up to 1.2e-3 of the
// largest logit; another window moves them by over 1e-2: model_forward.rs).
#[test]
fn gemma3_windowed_device_cache_matches_a_full_one() {
    let Some(ctx) = gpu() else { return };
    let spec = ballast_runtime::testing::reference_spec("gemma3").unwrap();
    let model = load(&spec, Arc::new(WgpuBackend::new(ctx)));
    let ids: Vec<u32> = (0..40u32)
        .map(|i| (i * 37 + 11) % TINY_VOCAB as u32)
        .collect();
    for element in [KvElement::F32, KvElement::F16, KvElement::Q8] {
        let windowed_kv = model
            .device_kv_cache_windowed(64, element, 3)
            .unwrap()
            .unwrap();
        let full_kv = model.device_kv_cache(64, element).unwrap().unwrap();
        let (w_bytes, f_bytes) = (
            windowed_kv.held_bytes().total(),
            full_kv.held_bytes().total(),
        );
        assert!(
            w_bytes * 3 < f_bytes * 2,
            "{element:?}: {w_bytes} vs {f_bytes}"
        );
        let mut windowed = Session::with_cache(model.share(), windowed_kv, None);
        let mut full = Session::with_cache(model.share(), full_kv, None);
        windowed.set_batch(3);
        full.set_batch(3);
        let close = |a: &[f32], b: &[f32], what: &str| {
            let d = max_rel_diff(a, b);
            assert!(d < 3e-3, "{element:?} {what}: {d}");
        };
        let a = windowed.feed(&ids[..20]).unwrap().to_vec();
        close(&a, full.feed(&ids[..20]).unwrap(), "prompt");
        for (i, &id) in ids[20..30].iter().enumerate() {
            let a = windowed.feed(&[id]).unwrap().to_vec();
            close(&a, full.feed(&[id]).unwrap(), &format!("step {i}"));
        }
        // Windowed layers (0 and 2) hold at most the window plus a pass less one.
        let mut held = Vec::new();
        windowed.kv().positions(0, 0..usize::MAX, &mut held);
        assert!(
            held.len() <= 6 && held.iter().all(|&p| p + 4 > 27),
            "{held:?}"
        );
        assert_eq!(windowed.kv().len(), 30);
        // A rewind of one token is exact; below what the window dropped it starts over.
        assert_eq!(windowed.rewind(29), 29);
        full.rewind(29);
        let a = windowed.feed(&[5]).unwrap().to_vec();
        close(&a, full.feed(&[5]).unwrap(), "after a rewind");
        assert_eq!(windowed.rewind(10), 0);
        full.rewind(0);
        let a = windowed.feed(&ids[..12]).unwrap().to_vec();
        close(&a, full.feed(&ids[..12]).unwrap(), "after starting over");
        // A pass longer than the room the cache keeps is refused by name.
        let rows = vec![0.0; 4 * model.kv_shape().kv_dim()];
        let err = windowed.kv_mut().append(0, &[12, 13, 14, 15], &rows, &rows);
        let msg = format!("{}", err.unwrap_err());
        assert!(msg.contains("room for 3"), "{msg}");
    }
}

#[test]
fn llama_with_a_sentencepiece_vocabulary_matches_the_cpu_backend() {
    check_spec(
        ballast_runtime::testing::reference_spec("llama-spm").unwrap(),
        1e-3,
    );
}

#[test]
fn qwen2_f32_with_biases_and_neox_rope_matches_the_cpu_backend() {
    check_spec(
        TinyModelSpec {
            arch: "qwen2".into(),
            weight_type: GgmlType::F32,
            embd_type: GgmlType::F32,
            ..Default::default()
        },
        // F32 weights: no activation rounding; what remains is the f16 cache, whose
        // query and running sums the CPU backend rounds to f16 at every key (as
        // llama.cpp does) while the GPU sums in f32.
        1e-3,
    );
}

#[test]
fn llama_k_quants_pass_matches_the_cpu_backend() {
    check_spec(
        TinyModelSpec {
            d_model: 256,
            n_heads: 4,
            n_kv_heads: 1,
            n_ff: 512,
            weight_type: GgmlType::Q4_K,
            embd_type: GgmlType::Q6_K,
            n_layers: 1,
            tied: false,
            ..Default::default()
        },
        0.02,
    );
}

/// Chunked prefill on the device, then decode after a rewind (the device cache masks
/// the dropped tokens' slots and reuses them), ends where feeding token by token ends;
/// the greedy id computed on the device is the argmax of the logits.
#[test]
fn chunks_rewind_and_greedy_agree_on_the_device() {
    let Some(ctx) = gpu() else { return };
    let spec = TinyModelSpec::default();
    let backend = Arc::new(WgpuBackend::new(ctx));
    let mut chunked = Session::new(load(&spec, backend.clone()), 64).unwrap();
    chunked.set_batch(4);
    let a = chunked.feed(&IDS).unwrap().to_vec();
    let report = backend.last_pass().unwrap();
    assert_eq!(report.submissions, 1, "one submission per pass");
    assert_eq!(report.tokens, 2, "the last chunk of 10 in fours");
    assert!(report.weight_bytes_read > 0 && report.kv_bytes_read > 0);

    let mut single = Session::new(load(&spec, backend.clone()), 64).unwrap();
    single.set_batch(1);
    let mut b = Vec::new();
    for &id in &IDS {
        b = single.feed(&[id]).unwrap().to_vec();
    }
    assert!(max_rel_diff(&a, &b) < 0.02, "chunked vs single");

    // Rewind past the last chunk and feed it again: the same computation.
    chunked.rewind(8);
    let c = chunked.feed(&IDS[8..]).unwrap().to_vec();
    assert_eq!(c, a, "the device cache followed the rewind");

    chunked.rewind(9);
    let logits = chunked.feed(&IDS[9..]).unwrap().to_vec();
    chunked.rewind(9);
    let id = chunked.feed_greedy(&IDS[9..]).unwrap();
    let best = logits
        .iter()
        .enumerate()
        .fold((0, f32::MIN), |m, (i, &v)| if v > m.1 { (i, v) } else { m });
    assert_eq!(id as usize, best.0);
    assert_eq!(
        backend.last_pass().unwrap().bytes_read_back,
        4,
        "greedy decode reads back the id only: the keys and values stay on the device"
    );
}

/// Out-of-vocabulary ids and a full context are errors on the device path too.
#[test]
fn bad_input_is_an_error_on_the_device() {
    let Some(ctx) = gpu() else { return };
    let spec = TinyModelSpec::default();
    let mut model = load(&spec, Arc::new(WgpuBackend::new(ctx)));
    let mut kv = DenseKv::new(model.kv_shape(), 4);
    let err = model
        .forward(&[TINY_VOCAB as u32], &[0], &mut kv, None, Logits::Last)
        .unwrap_err();
    assert!(err.to_string().contains("vocabulary"), "{err}");
    let err = model
        .forward(
            &[1, 2, 3, 4, 5],
            &[0, 1, 2, 3, 4],
            &mut kv,
            None,
            Logits::Last,
        )
        .unwrap_err();
    assert!(err.to_string().contains('5'), "{err}");
    assert_eq!(kv.len(), 0, "nothing appended by failed passes");
}

/// Models loaded one after another on one backend each get their own norms and
/// weights on the device (the caches are keyed by host address, which a dropped model
/// frees for reuse).
#[test]
fn successive_models_on_one_backend_use_their_own_weights() {
    let Some(ctx) = gpu() else { return };
    let backend: Arc<dyn Backend> = Arc::new(WgpuBackend::new(ctx));
    for seed in [3, 4, 5] {
        let spec = TinyModelSpec {
            seed,
            ..Default::default()
        };
        let want = all_logits(&mut load(&spec, Arc::new(CpuBackend::new(1))), &IDS);
        let got = all_logits(&mut load(&spec, backend.clone()), &IDS);
        assert!(max_rel_diff(&got, &want) < 0.02, "seed {seed}");
    }
}

/// Every buffer is counted: after a pass the context holds at least the weights (as
/// packed, padded to 4 bytes) plus the KV mirror, and dropping the backend frees
/// exactly the weights and the mirror's keys and values (scratch and the mirror's
/// positions go back to the pool, still held).
#[test]
fn device_memory_counts_weights_kv_and_scratch() {
    if gpu().is_none() {
        return;
    }
    // A context of its own, so the figures are this test's alone.
    let ctx = GpuContext::new().unwrap();
    let spec = TinyModelSpec::default();
    let file = Arc::new(GgufFile::from_bytes(spec.to_gguf_bytes().unwrap()).unwrap());
    let weights: u64 = file
        .tensors()
        .iter()
        .map(|t| t.n_bytes.div_ceil(4) * 4)
        .sum();
    let backend = Arc::new(WgpuBackend::new(ctx.clone()));
    let mut model = Model::load(file, backend.clone(), false).unwrap();
    let capacity = 32;
    let mut kv = DenseKv::new(model.kv_shape(), capacity);
    model
        .forward(&IDS[..4], &[0, 1, 2, 3], &mut kv, None, Logits::Last)
        .unwrap();
    let kv_dim = (spec.n_kv_heads * spec.head_dim()) as u64;
    // Keys and values at their exact size; positions come from the pool.
    let mirror_kv = 2 * spec.n_layers as u64 * capacity as u64 * kv_dim * 4;
    let mirror = mirror_kv + (capacity as u64 * 4).next_power_of_two().max(256);
    let held = ctx.memory().current();
    assert!(
        held >= weights + mirror,
        "{held} bytes held, weights {weights} + KV {mirror}"
    );
    assert!(ctx.memory().peak() >= held);
    drop(model);
    drop(backend);
    assert_eq!(
        held - ctx.memory().current(),
        weights + mirror_kv,
        "the weights and the KV mirror were freed"
    );
}

/// Bytes lent for one use, as a streaming store's slot: a device backend may not cache
/// them. Counts how many lent layers are alive at once.
struct Lent {
    bytes: Vec<u8>,
    live: Arc<LiveCount>,
}

#[derive(Default)]
struct LiveCount {
    now: std::sync::atomic::AtomicUsize,
    max: std::sync::atomic::AtomicUsize,
}

impl ByteSource for Lent {
    fn bytes(&self) -> ballast_runtime::Result<&[u8]> {
        Ok(&self.bytes)
    }
    fn cache_on_device(&self) -> bool {
        false
    }
}

impl Drop for Lent {
    fn drop(&mut self) {
        self.live.now.fetch_sub(1, Ordering::SeqCst);
    }
}

/// A store that copies the layers in `lent` into fresh bytes at every request (as a
/// tiered store's slot holds a different layer each time) and keeps the others
/// resident.
struct LendingStore {
    globals: GlobalWeights,
    layers: Vec<Arc<LayerWeights>>,
    lent: Vec<bool>,
    live: Arc<LiveCount>,
}

impl WeightStore for LendingStore {
    fn n_layers(&self) -> usize {
        self.layers.len()
    }
    fn globals(&self) -> &GlobalWeights {
        &self.globals
    }
    fn layer(&self, _pass: PassId, index: usize) -> ballast_runtime::Result<Arc<LayerWeights>> {
        let l = &self.layers[index];
        if !self.lent[index] {
            return Ok(l.clone());
        }
        let now = self.live.now.fetch_add(1, Ordering::SeqCst) + 1;
        self.live.max.fetch_max(now, Ordering::SeqCst);
        let mut bytes = Vec::new();
        let mut ranges = Vec::new();
        for w in l.weights() {
            ranges.push(bytes.len()..bytes.len() + w.bytes.len());
            bytes.extend_from_slice(w.bytes.as_slice().unwrap());
        }
        let source: Arc<dyn ByteSource> = Arc::new(Lent {
            bytes,
            live: self.live.clone(),
        });
        let mut out = (**l).clone();
        for (w, r) in out.weights_mut().zip(ranges) {
            w.bytes = WeightBytes::new(source.clone(), r)?;
        }
        Ok(Arc::new(out))
    }
    fn held_bytes(&self) -> TierBytes {
        TierBytes::default()
    }
}

/// A policy that never evicts: it only sends the model down the op-by-op path.
struct KeepAll;

impl KvPolicy for KeepAll {
    fn before_pass(&mut self, _: &mut dyn KvCache, _: usize) -> ballast_runtime::Result<()> {
        Ok(())
    }
    fn before_attention(&mut self, _: usize, _: &mut dyn KvCache) -> ballast_runtime::Result<()> {
        Ok(())
    }
}

fn lending_model(
    spec: &TinyModelSpec,
    backend: Arc<dyn Backend>,
    lent: Vec<bool>,
) -> (Model, Arc<LiveCount>) {
    let file = Arc::new(GgufFile::from_bytes(spec.to_gguf_bytes().unwrap()).unwrap());
    let config = ModelConfig::from_gguf(&file).unwrap();
    let (globals, layers) = load_weights(&file, &config).unwrap();
    let live = Arc::new(LiveCount::default());
    let store = LendingStore {
        globals,
        layers: layers.into_iter().map(Arc::new).collect(),
        lent,
        live: live.clone(),
    };
    // The MLP the file describes: dense, or a mixture of experts.
    let ffn = ballast_runtime::ffn::for_config(&config);
    let model = Model::from_parts(config, Box::new(store), backend, ffn);
    (model, live)
}

/// Layers whose bytes may not be cached on the device are uploaded into stream slots
/// per pass: the logits equal the all-resident device pass bit for bit at every slot
/// count, all lent, some lent, and op by op; one submission per `slots` streamed layers;
/// the uploaded bytes are the lent layers' bytes; the backend keeps no lent layer
/// alive (the store gets each slot back before it lends the next).
#[test]
fn streamed_layers_go_through_stream_slots() {
    let Some(ctx) = gpu() else { return };
    let spec = TinyModelSpec {
        n_layers: 5,
        weight_type: GgmlType::Q4_0,
        ..Default::default()
    };
    let resident_backend = Arc::new(WgpuBackend::new(ctx.clone()));
    let want = all_logits(&mut load(&spec, resident_backend), &IDS);
    let layer_bytes: u64 = {
        let file = GgufFile::from_bytes(spec.to_gguf_bytes().unwrap()).unwrap();
        file.tensors()
            .iter()
            .filter(|t| t.name.starts_with("blk.") && t.dims.len() == 2)
            .map(|t| t.n_bytes)
            .sum()
    };
    for (slots, lent) in [
        (1, vec![true; 5]),
        (2, vec![true; 5]),
        (3, vec![true; 5]),
        (1, vec![false, true, false, true, true]),
    ] {
        let backend = Arc::new(WgpuBackend::new(ctx.clone()));
        backend.set_stream_slots(slots);
        let n_lent = lent.iter().filter(|&&l| l).count();
        let (mut model, live) = lending_model(&spec, backend.clone(), lent.clone());
        let got = all_logits(&mut model, &IDS);
        assert!(got == want, "{slots} slots, lent {lent:?}: logits differ");
        let report = backend.last_pass().unwrap();
        assert_eq!(
            report.submissions,
            n_lent.div_ceil(slots),
            "{slots} slots, lent {lent:?}"
        );
        assert_eq!(report.bytes_uploaded, layer_bytes / 5 * n_lent as u64);
        assert_eq!(
            live.max.load(Ordering::SeqCst),
            1,
            "one lent layer alive at a time"
        );
        assert_eq!(
            live.now.load(Ordering::SeqCst),
            0,
            "the backend kept no lent layer"
        );
    }

    // Op by op (a policy sends the model down the host path): the same as resident.
    let op_logits = |model: &mut Model| {
        let mut kv = DenseKv::new(model.kv_shape(), 64);
        let positions: Vec<u32> = (0..IDS.len() as u32).collect();
        let mut policy = KeepAll;
        model
            .forward(&IDS, &positions, &mut kv, Some(&mut policy), Logits::All)
            .unwrap()
            .to_vec()
    };
    let want_ops = op_logits(&mut load(&spec, Arc::new(WgpuBackend::new(ctx.clone()))));
    let (mut model, live) = lending_model(&spec, Arc::new(WgpuBackend::new(ctx)), vec![true; 5]);
    assert!(op_logits(&mut model) == want_ops, "op by op: logits differ");
    assert_eq!(live.now.load(Ordering::SeqCst), 0);
}

/// A lever's MLP: the model's own, run at a host sync point (`Op::FeedForward`) on the
/// backend's host-slice ops, as the sparse MLP runs.
struct AtHostSync(Box<dyn ballast_runtime::ffn::FeedForward>);

impl ballast_runtime::ffn::FeedForward for AtHostSync {
    fn needs_prepare(&self) -> bool {
        false
    }
    fn forward(
        &mut self,
        backend: &dyn Backend,
        weights: &LayerWeights,
        x: &[f32],
        n_tokens: usize,
        out: &mut [f32],
    ) -> ballast_runtime::Result<()> {
        self.0.forward(backend, weights, x, n_tokens, out)
    }
}

/// A lever's MLP computes from its own matrices at its host sync point: the pass puts
/// on the device only the matrices its ops multiply by, so a streamed layer uploads its
/// attention alone (a neuron cache's MLP is then on the device only as the records it
/// wrote), and the logits are the dense device pass's.
#[test]
fn a_lever_mlp_leaves_its_matrices_off_the_device() {
    let Some(ctx) = gpu() else { return };
    let spec = TinyModelSpec {
        n_layers: 3,
        weight_type: GgmlType::Q4_0,
        ..Default::default()
    };
    let want = all_logits(
        &mut load(&spec, Arc::new(WgpuBackend::new(ctx.clone()))),
        &IDS,
    );
    let attention_bytes: u64 = {
        let file = GgufFile::from_bytes(spec.to_gguf_bytes().unwrap()).unwrap();
        file.tensors()
            .iter()
            .filter(|t| t.name.starts_with("blk.") && t.dims.len() == 2)
            .filter(|t| !t.name.contains(".ffn_"))
            .map(|t| t.n_bytes)
            .sum()
    };
    let backend = Arc::new(WgpuBackend::new(ctx));
    let (model, live) = lending_model(&spec, backend.clone(), vec![true; 3]);
    let dense = ballast_runtime::ffn::for_config(model.config());
    let mut model = model.share_with_ffn(Box::new(AtHostSync(dense)));
    let got = all_logits(&mut model, &IDS);
    assert!(
        max_rel_diff(&got, &want) < 1e-5,
        "logits differ by {}",
        max_rel_diff(&got, &want)
    );
    assert_eq!(backend.last_pass().unwrap().bytes_uploaded, attention_bytes);
    assert_eq!(live.now.load(Ordering::SeqCst), 0);
}

/// Keeps the most recent `window` tokens, evicting before each pass only.
struct RecentWindow {
    window: usize,
}

impl KvPolicy for RecentWindow {
    fn before_pass(&mut self, kv: &mut dyn KvCache, n_new: usize) -> ballast_runtime::Result<()> {
        let excess = (kv.len() + n_new).saturating_sub(self.window);
        kv.evict(0..excess);
        Ok(())
    }
    fn before_attention(&mut self, _: usize, _: &mut dyn KvCache) -> ballast_runtime::Result<()> {
        Ok(())
    }
    fn acts_between_layers(&self) -> bool {
        false
    }
}

/// A policy that evicts only before a pass lets the device run the whole pass (one
/// submission): past the window the device's copy of the cache follows the host's
/// evictions, and every step's logits agree with the CPU backend under the same policy.
#[test]
fn a_policy_between_passes_keeps_the_whole_pass_on_the_device() {
    let Some(ctx) = gpu() else { return };
    let spec = TinyModelSpec::default();
    let backend = Arc::new(WgpuBackend::new(ctx));
    let mut gpu_model = load(&spec, backend.clone());
    let mut cpu_model = load(&spec, Arc::new(CpuBackend::new(2)));
    let (mut gpu_kv, mut cpu_kv) = (
        DenseKv::new(gpu_model.kv_shape(), 8),
        DenseKv::new(cpu_model.kv_shape(), 8),
    );
    let (mut gpu_policy, mut cpu_policy) = (RecentWindow { window: 6 }, RecentWindow { window: 6 });
    for (p, &id) in IDS.iter().cycle().take(16).enumerate() {
        let pos = [p as u32];
        let got = gpu_model
            .forward(
                &[id],
                &pos,
                &mut gpu_kv,
                Some(&mut gpu_policy),
                Logits::Last,
            )
            .unwrap()
            .to_vec();
        let want = cpu_model
            .forward(
                &[id],
                &pos,
                &mut cpu_kv,
                Some(&mut cpu_policy),
                Logits::Last,
            )
            .unwrap()
            .to_vec();
        assert!(max_rel_diff(&got, &want) < 0.02, "step {p}");
        assert_eq!(gpu_kv.len(), (p + 1).min(6));
    }
    // The device pass times no op on the host; op by op would have.
    let ops = backend.op_times().snapshot();
    assert_eq!(
        ops.matmul + ops.attention + ops.other,
        std::time::Duration::ZERO,
        "some pass ran op by op"
    );
}

/// An MLP lever that computes on the host (the dense MLP through the backend's ops) and
/// counts the attention inputs it is shown: the shape of a sparse MLP.
struct HostMlp {
    inner: DenseFfn,
    prepared: Arc<std::sync::atomic::AtomicUsize>,
}

impl ballast_runtime::FeedForward for HostMlp {
    fn prepare(&mut self, _layer: usize, x: &[f32], n: usize) -> ballast_runtime::Result<()> {
        assert!(x.len() % n == 0 && x.iter().all(|v| v.is_finite()));
        self.prepared.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }

    fn forward(
        &mut self,
        backend: &dyn Backend,
        weights: &LayerWeights,
        x: &[f32],
        n_tokens: usize,
        out: &mut [f32],
    ) -> ballast_runtime::Result<()> {
        self.inner.forward(backend, weights, x, n_tokens, out)
    }
}

/// A lever MLP keeps the pass on the device: each host sync point (prepare, forward) is
/// one submission with one read-back, not a fall back to op by op, and the logits are
/// those of the dense MLP recorded in the pass.
#[test]
fn a_host_mlp_costs_one_sync_per_point_on_the_device() {
    let Some(ctx) = gpu() else { return };
    let spec = TinyModelSpec::default();
    let backend = Arc::new(WgpuBackend::new(ctx));
    let want = all_logits(&mut load(&spec, backend.clone()), &IDS);
    let prepared = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut lever = load(&spec, backend.clone()).share_with_ffn(Box::new(HostMlp {
        inner: DenseFfn::new(),
        prepared: prepared.clone(),
    }));
    let got = all_logits(&mut lever, &IDS);
    let n_layers = lever.config().n_layers;
    assert_eq!(prepared.load(Ordering::SeqCst), n_layers);
    let report = backend.last_pass().unwrap();
    assert_eq!(
        report.submissions,
        1 + 2 * n_layers,
        "one submission, plus one per host sync point"
    );
    let d = max_rel_diff(&got, &want);
    assert!(d < 1e-5, "host MLP on the device differs by {d}");
}

/// Weights are kept on the device by their stable id (file, offset), and the last handle
/// on a model gives their device memory back; a model loaded again from the same bytes
/// (another file) uploads its own copies and computes the same logits.
#[test]
fn dropping_a_model_releases_its_device_weights() {
    let Some(ctx) = gpu() else { return };
    let spec = TinyModelSpec::default();
    let backend = Arc::new(WgpuBackend::new(ctx));
    let mut model = load(&spec, backend.clone());
    let first = all_logits(&mut model, &IDS);
    let held = backend.bytes().0;
    let matrices: u64 = (0..model.config().n_layers)
        .map(|l| {
            let layer = model.store().layer(PassId(0), l).unwrap();
            layer.weights().map(|w| w.bytes.len() as u64).sum::<u64>()
        })
        .sum();
    let second_handle = model.share();
    drop(model);
    assert_eq!(backend.bytes().0, held, "a handle is still alive");
    drop(second_handle);
    let released = held - backend.bytes().0;
    assert!(
        released >= matrices,
        "released {released} B of device memory, the layers' matrices alone are {matrices} B"
    );
    let again = all_logits(&mut load(&spec, backend.clone()), &IDS);
    assert_eq!(again, first);
}

/// A decode pass binds the buffers the previous one bound (the backend keeps a pass's
/// buffers): once warm, it makes no new bind group.
#[test]
fn decode_passes_reuse_their_bind_groups() {
    if gpu().is_none() {
        return;
    }
    // A context of its own: the count is per context, and other tests run beside this.
    let ctx = GpuContext::new().unwrap();
    let spec = TinyModelSpec::default();
    let backend = Arc::new(WgpuBackend::new(ctx.clone()));
    let mut session = Session::new(load(&spec, backend), 64).unwrap();
    let mut next = session.feed_greedy(&IDS).unwrap();
    let mut made = Vec::new();
    for _ in 0..4 {
        let before = ctx.bind_groups_made();
        next = session.feed_greedy(&[next]).unwrap();
        made.push(ctx.bind_groups_made() - before);
    }
    assert_eq!(
        made[2..],
        [0, 0],
        "bind groups made per decode pass: {made:?}"
    );
}

/// A mixture of experts whose layers stream (their bytes may not be cached on the
/// device): every expert of a layer goes up with it into the stream slot, and the
/// logits equal the resident device pass's bit for bit, with no read-back but the
/// logits.
#[test]
fn streamed_experts_go_up_with_their_layer() {
    let Some(ctx) = gpu() else { return };
    let spec = TinyModelSpec {
        weight_type: GgmlType::Q8_0,
        ..reference_spec("qwen2moe").unwrap()
    };
    let want = all_logits(
        &mut load(&spec, Arc::new(WgpuBackend::new(ctx.clone()))),
        &IDS,
    );
    let backend = Arc::new(WgpuBackend::new(ctx));
    backend.set_stream_slots(1);
    let n_layers = spec.n_layers;
    let (mut model, live) = lending_model(&spec, backend.clone(), vec![true; n_layers]);
    let got = all_logits(&mut model, &IDS);
    assert!(got == want, "streamed experts: logits differ");
    let report = backend.last_pass().unwrap();
    assert_eq!(report.submissions, n_layers, "one per turn of the one slot");
    assert_eq!(live.now.load(Ordering::SeqCst), 0);
}
