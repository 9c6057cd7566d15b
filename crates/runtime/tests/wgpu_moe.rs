//! The mixture of experts inside the wgpu device pass (`backend/wgpu/moe.rs`) against
//! the CPU: every row of a prefill chunk, in one submission that reads back only the
//! logits; the routing kernel's choice on tied router logits; layers whose experts are
//! fetched on demand, at a host sync point.
//!
//! Its own test binary: the device-memory figures `wgpu_model.rs` checks are the whole
//! context's, which these tests' buffers would move.

#![cfg(feature = "gpu")]

mod common;

use std::sync::Arc;

use common::tiny::{all_logits, load, max_rel_diff, IDS};

use ballast_runtime::backend::{MatmulJob, Telemetry};
use ballast_runtime::blocks::FFN_GATE_INP;
use ballast_runtime::ggml_type::GgmlType;
use ballast_runtime::gguf::GgufFile;
use ballast_runtime::model::{load_weights, Logits, MoeSpec};
use ballast_runtime::moe::{route, MoeFfn};
use ballast_runtime::store::PassId;
use ballast_runtime::testing::{reference_spec, TinyModelSpec};
use ballast_runtime::weights::{ExpertFetch, ExpertSource, GlobalWeights, LayerWeights, Weight};
use ballast_runtime::{
    Backend, CpuBackend, FeedForward, KvElement, Model, ModelConfig, TierBytes, WeightStore,
    WgpuBackend,
};

/// The CPU's mixture of experts, recording the experts each token chose (by the host's
/// `route` over the router's logits) before computing it.
struct RecordChoices {
    inner: MoeFfn,
    chosen: Arc<std::sync::Mutex<Vec<Vec<usize>>>>,
}

impl FeedForward for RecordChoices {
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
        let spec = *self.inner.spec();
        let mut logits = vec![0f32; n_tokens * spec.n_expert];
        backend.matmul(
            x,
            n_tokens,
            &mut [MatmulJob {
                weight: weights.matrix(FFN_GATE_INP)?,
                out: &mut logits,
            }],
        )?;
        let mut chosen = self.chosen.lock().unwrap();
        for row in logits.chunks_exact(spec.n_expert) {
            chosen.push(route(&spec, row).iter().map(|c| c.0).collect());
        }
        self.inner.forward(backend, weights, x, n_tokens, out)
    }
}

/// The tiny mixtures of experts (qwen3moe; mixtral; qwen2moe with its shared expert),
/// F32 as llama.cpp ran them and Q8_0 (quantized activations): a prefill chunk of ten
/// tokens, which choose different experts, gives every row's logits within tolerance of
/// the CPU's in one submission that reads back only the logits; so does a backend
/// whose weight chunks cut the stacked experts mid-expert.
#[test]
fn a_mixture_of_experts_runs_inside_the_device_pass() {
    let Some(ctx) = ballast_runtime::testing::gpu_for_tests() else {
        return;
    };
    for name in ["qwen3moe", "mixtral", "qwen2moe"] {
        // Q8_0: the rest of the pass already differs by up to ~0.02 (an activation
        // rounding the other way); the comparison with the host-synced MLP is the tight
        // one.
        for (ty, tolerance) in [(GgmlType::F32, 2e-3), (GgmlType::Q8_0, 0.03)] {
            let spec = TinyModelSpec {
                weight_type: ty,
                ..reference_spec(name).unwrap()
            };
            let cpu = load(&spec, Arc::new(CpuBackend::new(2)));
            let chosen = Arc::new(std::sync::Mutex::new(Vec::new()));
            let mut recorder = cpu.share_with_ffn(Box::new(RecordChoices {
                inner: MoeFfn::new(cpu.config().moe.unwrap()),
                chosen: chosen.clone(),
            }));
            let want = all_logits(&mut recorder, &IDS);
            let sets: std::collections::HashSet<Vec<usize>> =
                chosen.lock().unwrap().iter().cloned().collect();
            assert!(
                sets.len() >= 3,
                "{name}: the tokens chose too few expert sets to test: {sets:?}"
            );
            let vocab = cpu.config().vocab_size;
            let what = format!("{name} {ty:?}");
            // The same MLP at a host sync point on wgpu (how the device ran it before
            // it had its own kernels): the rest of the pass computes as in the device
            // pass, so the two differ only by the experts' float order.
            let synced = {
                let m = load(&spec, Arc::new(WgpuBackend::new(ctx.clone())));
                let mut m = m.share_with_ffn(Box::new(RecordChoices {
                    inner: MoeFfn::new(cpu.config().moe.unwrap()),
                    chosen: Arc::new(std::sync::Mutex::new(Vec::new())),
                }));
                all_logits(&mut m, &IDS)
            };
            for backend in [
                WgpuBackend::new(ctx.clone()),
                // Chunks of a few rows: expert boundaries fall inside chunks.
                WgpuBackend::with_chunk_limit(ctx.clone(), 1000),
            ] {
                let backend = Arc::new(backend);
                let mut model = load(&spec, backend.clone());
                let mut kv = model
                    .device_kv_cache(64, KvElement::F32)
                    .unwrap()
                    .expect("a device cache on wgpu");
                let positions: Vec<u32> = (0..IDS.len() as u32).collect();
                let got = model
                    .forward(&IDS, &positions, kv.as_mut(), None, Logits::All)
                    .unwrap()
                    .to_vec();
                assert_eq!(got.len(), want.len());
                let rows = |a: &[f32], b: &[f32]| {
                    a.chunks(vocab)
                        .zip(b.chunks(vocab))
                        .map(|(x, y)| max_rel_diff(x, y))
                        .fold(0f32, f32::max)
                };
                let (to_cpu, to_synced) = (rows(&got, &want), rows(&got, &synced));
                eprintln!(
                    "{what}: largest difference to the CPU {to_cpu:.2e}, to the host-synced \
                     MLP {to_synced:.2e}, of a row's largest logit"
                );
                assert!(to_cpu < tolerance, "{what}: {to_cpu} from the CPU");
                assert!(
                    to_synced < 1e-4,
                    "{what}: {to_synced} from the host-synced MLP"
                );
                let report = backend.last_pass().unwrap();
                assert_eq!(report.submissions, 1, "{what}: one submission");
                assert_eq!(
                    report.bytes_read_back,
                    (IDS.len() * vocab * 4) as u64,
                    "{what}: only the logits come back"
                );
            }
        }
    }
}

/// Router logits with ties (all equal, equal pairs, small integers) choose on the device
/// the experts the host's `route` chooses, lowest index first among equals, with the
/// same weights (renormalized or not, scaled or not).
#[test]
fn device_routing_breaks_ties_as_the_host_does() {
    let Some(ctx) = ballast_runtime::testing::gpu_for_tests() else {
        return;
    };
    let backend = WgpuBackend::new(ctx);
    let n_expert = 8;
    let mut rows: Vec<Vec<f32>> = vec![
        vec![0.0; n_expert],
        vec![1.0, 2.0, 2.0, 0.0, 2.0, -1.0, 1.0, 1.0],
        vec![3.0, 3.0, 1.0, 1.0, 5.0, 5.0, -2.0, -2.0],
        vec![-1.0, -1.0, -1.0, -1.0, -1.0, -1.0, -1.0, 4.0],
    ];
    // Small integers from a fixed generator: many ties, in every position.
    let mut state = 0x2545_f491_u32;
    for _ in 0..60 {
        rows.push(
            (0..n_expert)
                .map(|_| {
                    state ^= state << 13;
                    state ^= state >> 17;
                    state ^= state << 5;
                    (state % 4) as f32 - 1.5
                })
                .collect(),
        );
    }
    let logits: Vec<f32> = rows.concat();
    for k in [1, 2, 3, 8] {
        for (norm_weights, weights_scale) in [(true, None), (false, None), (true, Some(2.5))] {
            let spec = MoeSpec {
                n_expert,
                n_expert_used: k,
                n_ff_expert: 32,
                norm_weights,
                weights_scale,
                shared_ff: None,
            };
            let (ids, weights) = backend.route_for_test(&spec, &logits).unwrap();
            for (t, row) in rows.iter().enumerate() {
                let want = route(&spec, row);
                let got_ids: Vec<usize> = ids[t * k..(t + 1) * k]
                    .iter()
                    .map(|&e| e as usize)
                    .collect();
                let want_ids: Vec<usize> = want.iter().map(|c| c.0).collect();
                assert_eq!(got_ids, want_ids, "k {k}, row {row:?}");
                for (g, (_, w)) in weights[t * k..(t + 1) * k].iter().zip(&want) {
                    assert!(
                        (g - w).abs() <= 1e-6 * w.abs().max(1.0),
                        "k {k}, row {row:?}: {g} vs {w}"
                    );
                }
            }
        }
    }
}

/// The stacked experts of a layer, served one matrix at a time as a store that fetches
/// the chosen experts on demand serves them.
struct Stacks(Vec<(String, Weight)>);

impl ExpertSource for Stacks {
    fn expert(&self, role: &str, index: usize) -> ballast_runtime::Result<Weight> {
        let (_, stack) = self.0.iter().find(|(r, _)| r == role).expect("a stack");
        stack.stacked(index)
    }
}

/// A store whose layers come without their stacked experts, which an [`ExpertFetch`]
/// gives on demand (as tier-stream's expert streaming does on the CPU).
struct FetchingStore {
    globals: GlobalWeights,
    layers: Vec<Arc<LayerWeights>>,
}

impl WeightStore for FetchingStore {
    fn n_layers(&self) -> usize {
        self.layers.len()
    }
    fn globals(&self) -> &GlobalWeights {
        &self.globals
    }
    fn layer(&self, _pass: PassId, index: usize) -> ballast_runtime::Result<Arc<LayerWeights>> {
        let mut layer = (*self.layers[index]).clone();
        let (stacks, rest) = layer
            .matrices
            .into_iter()
            .partition(|(_, w)| w.dims.len() == 3);
        layer.matrices = rest;
        layer.experts = Some(ExpertFetch(Arc::new(Stacks(stacks))));
        Ok(Arc::new(layer))
    }
    fn held_bytes(&self) -> TierBytes {
        TierBytes::default()
    }
}

/// Layers without their stacked experts (fetched on demand) cannot be routed on the
/// device: the device pass computes their mixture at a host sync point (one more
/// submission per layer) and gives the logits of the same MLP on the host path.
#[test]
fn experts_fetched_on_demand_run_at_a_host_sync_point() {
    let Some(ctx) = ballast_runtime::testing::gpu_for_tests() else {
        return;
    };
    let spec = reference_spec("qwen2moe").unwrap();
    let want = all_logits(&mut load(&spec, Arc::new(CpuBackend::new(2))), &IDS);
    let file = Arc::new(GgufFile::from_bytes(spec.to_gguf_bytes().unwrap()).unwrap());
    let config = ModelConfig::from_gguf(&file).unwrap();
    let (globals, layers) = load_weights(&file, &config).unwrap();
    let n_layers = layers.len();
    let store = FetchingStore {
        globals,
        layers: layers.into_iter().map(Arc::new).collect(),
    };
    let backend = Arc::new(WgpuBackend::new(ctx));
    let ffn = ballast_runtime::ffn::for_config(&config);
    let mut model = Model::from_parts(config, Box::new(store), backend.clone(), ffn);
    let got = all_logits(&mut model, &IDS);
    let d = max_rel_diff(&got, &want);
    assert!(
        d < 2e-3,
        "fetched experts on wgpu differ from the CPU by {d}"
    );
    let report = backend.last_pass().unwrap();
    assert_eq!(
        report.submissions,
        1 + n_layers,
        "one more per layer's sync"
    );
}
