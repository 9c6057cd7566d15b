//! The wgpu neuron stores and the neuron MLP (`backend/wgpu/neurons.rs`):
//!
//! - random records (every up type the GPU multiplies by; Q8_0, F16 and F32 down
//!   columns), 1 to a few hundred neurons, 1 to 4 tokens, random keep flags, slots in
//!   any order, the store rewritten between calls, in one binding and split over many:
//!   the output against a plain f32 reference (the up row dequantized and dotted with
//!   the input, `silu · u`, `axpy_row` for the down sum) within a bound derived from
//!   the activation quantization the GPU matmul applies, and the hidden values bit for
//!   bit equal to the backend's own `matmul_rows` and `swiglu`;
//! - a store rewritten after a call never serves the old record;
//! - malformed jobs and writes (a slot past the store, wrong lengths, an unknown or freed
//!   store, types records cannot hold) are errors that name the problem and write
//!   nothing;
//! - the store's device bytes and the uploaded bytes are counted exactly.
//!
//! Needs a wgpu adapter: under CI (`CI` set) a missing one fails; elsewhere the tests
//! skip with a printed reason.
#![cfg(feature = "gpu")]

use std::sync::{Arc, OnceLock};

use ballast_runtime::backend::ops::*;
use ballast_runtime::backend::Residency;
use ballast_runtime::ggml_type::GgmlType;
use ballast_runtime::neurons::{axpy_row, quantize_q8_0, NeuronLayout, NeuronMlpJob, NeuronOps};
use ballast_runtime::quant;
use ballast_runtime::weights::{Weight, WeightBytes, WeightId};
use ballast_runtime::WgpuBackend;
use proptest::prelude::*;
use proptest::test_runner::{RngAlgorithm, TestCaseError, TestRng};

/// The backend (every scratch buffer poisoned with NaN first), and one whose stores are
/// split over bindings of at most 7 records of the largest layout the tests use.
fn backends() -> Option<(Arc<WgpuBackend>, Arc<WgpuBackend>)> {
    static BACKENDS: OnceLock<Option<(Arc<WgpuBackend>, Arc<WgpuBackend>)>> = OnceLock::new();
    BACKENDS
        .get_or_init(|| {
            ballast_runtime::testing::gpu_for_tests().map(|ctx| {
                ctx.set_poison(true);
                (
                    Arc::new(WgpuBackend::new(ctx.clone())),
                    Arc::new(WgpuBackend::with_chunk_limit(ctx, 7 * 1024)),
                )
            })
        })
        .clone()
}

/// Up types the GPU matmul multiplies by: every weight type (not the activation types
/// Q8_1 and Q8_K).
fn up_types() -> Vec<GgmlType> {
    GgmlType::ALL
        .into_iter()
        .filter(|t| !matches!(t, GgmlType::Q8_1 | GgmlType::Q8_K))
        .collect()
}
const DOWN_TYPES: [GgmlType; 3] = [GgmlType::Q8_0, GgmlType::F16, GgmlType::F32];

/// Random values from a proptest seed.
struct Draws(TestRng);

impl Draws {
    fn new(seed: u64) -> Draws {
        let mut bytes = [0u8; 32];
        bytes[..8].copy_from_slice(&seed.to_le_bytes());
        Draws(TestRng::from_seed(RngAlgorithm::ChaCha, &bytes))
    }
    fn next(&mut self) -> u64 {
        self.0.next_u64()
    }
    /// In [-scale, scale).
    fn value(&mut self, scale: f32) -> f32 {
        ((self.next() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
    fn values(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.value(scale)).collect()
    }
}

/// A random record of `layout`: an up row quantized to its type, a down column in its.
fn record(layout: &NeuronLayout, rng: &mut Draws) -> Vec<u8> {
    let n = layout.n_embd;
    let mut r = quant::quantize(layout.up_type, &rng.values(n, 1.0)).unwrap();
    let down = rng.values(n, 1.0);
    match layout.down_type {
        GgmlType::Q8_0 => quantize_q8_0(&down, &mut r),
        GgmlType::F16 => r.extend(
            down.iter()
                .flat_map(|v| half::f16::from_f32(*v).to_le_bytes()),
        ),
        _ => r.extend(down.iter().flat_map(|v| v.to_le_bytes())),
    }
    assert_eq!(r.len(), layout.record_bytes());
    r
}

fn silu(g: f32) -> f64 {
    let g = f64::from(g);
    g / (1.0 + (-g).exp())
}

/// The plain reference of a neuron MLP over `records` (in the job's order): for token t,
/// `Σ_i keep · silu(g) · (up_i · x_t) · down_i`, the up row dequantized, the down sum by
/// `axpy_row`. Also a bound on each output's distance from what the GPU computes: the
/// GPU quantizes the activations for a quantized up row (Q8_0/Q8_1 to f16 scales of
/// `amax/127`, Q8_K to `max/127`), which moves each input by at most 0.6 of its block's
/// step, plus Q8_1's sum rounded to f16 times the row's minimum; the rest is f32
/// rounding, well within 1e-5 of the sum of the terms' magnitudes.
fn reference(
    layout: &NeuronLayout,
    records: &[&[u8]],
    x: &[f32],
    n: usize,
    gate: &[f32],
    keep: &[bool],
) -> (Vec<f32>, Vec<f64>) {
    let (ne, k) = (layout.n_embd, records.len());
    let act = quant::activation_type(layout.up_type);
    let ab = if act == GgmlType::F32 {
        ne
    } else {
        act.block_len()
    };
    let mut out = vec![0f32; n * ne];
    let mut bound = vec![1e-6f64; n * ne];
    for t in 0..n {
        let xt = &x[t * ne..(t + 1) * ne];
        for (i, rec) in records.iter().enumerate() {
            if !keep[t * k + i] {
                continue;
            }
            let (up_bytes, down_bytes) = rec.split_at(layout.up_bytes());
            let mut up = vec![0f32; ne];
            quant::dequantize(layout.up_type, up_bytes, &mut up).unwrap();
            let u: f32 = up.iter().zip(xt).map(|(w, v)| w * v).sum();
            let mut tol_u: f64 = up
                .iter()
                .zip(xt)
                .map(|(w, v)| f64::from((w * v).abs()))
                .sum::<f64>()
                * 1e-5;
            if act != GgmlType::F32 {
                for (wb, xb) in up.chunks(ab).zip(xt.chunks(ab)) {
                    let amax = xb.iter().fold(0f32, |m, v| m.max(v.abs()));
                    let step = f64::from(amax) / 127.0;
                    let wsum: f64 = wb.iter().map(|w| f64::from(w.abs())).sum();
                    tol_u += 0.6 * step * wsum;
                    if act == GgmlType::Q8_1 {
                        let wmax = wb.iter().fold(0f32, |m, w| m.max(w.abs()));
                        tol_u += f64::from(wmax) * 32.0 * f64::from(amax) / 1024.0;
                    }
                }
            }
            let s = silu(gate[t * k + i]);
            let h = (s * f64::from(u)) as f32;
            let o = &mut out[t * ne..(t + 1) * ne];
            axpy_row(layout.down_type, down_bytes, h, o).unwrap();
            let mut d = vec![0f32; ne];
            axpy_row(layout.down_type, down_bytes, 1.0, &mut d).unwrap();
            for (b, dv) in bound[t * ne..(t + 1) * ne].iter_mut().zip(&d) {
                let dv = f64::from(dv.abs());
                *b += s.abs() * tol_u * dv + 1e-5 * f64::from(h.abs()) * dv;
            }
        }
    }
    (out, bound)
}

/// The hidden values the backend's own ops give: `matmul_rows` over the listed records'
/// up rows as one matrix, then `swiglu`, 0 where not kept.
fn hidden_by_ops(
    be: &WgpuBackend,
    layout: &NeuronLayout,
    records: &[&[u8]],
    x: &[f32],
    n: usize,
    gate: &[f32],
    keep: &[bool],
) -> Vec<f32> {
    let k = records.len();
    let mut bytes = Vec::new();
    for r in records {
        bytes.extend_from_slice(&r[..layout.up_bytes()]);
    }
    let w = Weight {
        name: "neuron up rows".into(),
        id: WeightId::fresh(),
        ty: layout.up_type,
        dims: vec![layout.n_embd, k],
        bytes: WeightBytes::from_vec(bytes),
    };
    let mut u = vec![0f32; n * k];
    let all = 0..k;
    be.matmul_rows(x, n, &w, std::slice::from_ref(&all), &mut u)
        .unwrap();
    let mut h = vec![0f32; n * k];
    be.swiglu(gate, &u, &mut h).unwrap();
    for (v, &kept) in h.iter_mut().zip(keep) {
        if !kept {
            *v = 0.0;
        }
    }
    h
}

/// A job's inputs, to make jobs of with one output or another.
#[derive(Clone, Copy)]
struct Inputs<'a> {
    store: u64,
    x: &'a [f32],
    n: usize,
    slots: &'a [u32],
    gate: &'a [f32],
    keep: &'a [bool],
}

impl<'a> Inputs<'a> {
    fn job<'b>(&self, out: &'b mut [f32]) -> NeuronMlpJob<'b>
    where
        'a: 'b,
    {
        NeuronMlpJob {
            store: self.store,
            x: self.x,
            n_tokens: self.n,
            slots: self.slots,
            gate: self.gate,
            keep: self.keep,
            out,
        }
    }
}

/// One call checked: the output against the reference, the hidden values against the
/// backend's ops bit for bit.
#[allow(clippy::too_many_arguments)]
fn check_call(
    be: &WgpuBackend,
    store: u64,
    layout: &NeuronLayout,
    contents: &[Vec<u8>],
    slots: &[u32],
    n: usize,
    rng: &mut Draws,
    what: &str,
) -> Result<(), TestCaseError> {
    let (ne, k) = (layout.n_embd, slots.len());
    let x = rng.values(n * ne, 1.0);
    let gate = rng.values(n * k, 4.0);
    let keep: Vec<bool> = (0..n * k).map(|_| rng.below(4) != 0).collect();
    let inputs = Inputs {
        store,
        x: &x,
        n,
        slots,
        gate: &gate,
        keep: &keep,
    };
    let mut out = vec![f32::NAN; n * ne];
    let hidden = be
        .neuron_mlp_hidden(inputs.job(&mut out))
        .map_err(|e| TestCaseError::fail(format!("{what}: {e}")))?;
    let records: Vec<&[u8]> = slots.iter().map(|&s| &contents[s as usize][..]).collect();
    let (want, bound) = reference(layout, &records, &x, n, &gate, &keep);
    for (j, ((g, w), b)) in out.iter().zip(&want).zip(&bound).enumerate() {
        let err = (f64::from(*g) - f64::from(*w)).abs();
        prop_assert!(
            err <= *b,
            "{what}: output {j} (token {}, element {}) is {g}, the reference {w}, bound {b}",
            j / ne,
            j % ne
        );
    }
    let by_ops = hidden_by_ops(be, layout, &records, &x, n, &gate, &keep);
    prop_assert_eq!(hidden.len(), by_ops.len());
    for (j, (a, b)) in hidden.iter().zip(&by_ops).enumerate() {
        prop_assert!(
            a.to_bits() == b.to_bits(),
            "{}: hidden value {} (token {}, neuron {}) is {} but matmul_rows + swiglu give {}",
            what,
            j,
            j / k,
            j % k,
            a,
            b
        );
    }
    // The plain call gives the same bits as the one that also read the hidden values.
    let mut again = vec![f32::NAN; n * ne];
    be.neuron_mlp(inputs.job(&mut again))
        .map_err(|e| TestCaseError::fail(format!("{what}: {e}")))?;
    prop_assert!(
        out.iter()
            .zip(&again)
            .all(|(a, b)| a.to_bits() == b.to_bits()),
        "{what}: two runs of one job differ"
    );
    Ok(())
}

/// Writes `slots` of `store` (and `contents`) with fresh records, in the given order.
fn write(
    be: &WgpuBackend,
    store: u64,
    layout: &NeuronLayout,
    contents: &mut [Vec<u8>],
    slots: &[u32],
    rng: &mut Draws,
) {
    let mut bytes = Vec::new();
    for &s in slots {
        let r = record(layout, rng);
        bytes.extend_from_slice(&r);
        contents[s as usize] = r;
    }
    be.neuron_slots_write(store, slots, &bytes).unwrap();
}

/// `k` distinct slots of `capacity`, in a random order with some consecutive runs.
fn pick_slots(capacity: usize, k: usize, rng: &mut Draws) -> Vec<u32> {
    let mut all: Vec<u32> = (0..capacity as u32).collect();
    // Shuffle runs of up to 4 slots, so writes and gathers see runs and jumps.
    let mut runs: Vec<Vec<u32>> = all.chunks(1 + rng.below(4)).map(|c| c.to_vec()).collect();
    for i in (1..runs.len()).rev() {
        runs.swap(i, rng.below(i + 1));
    }
    all = runs.concat();
    all.truncate(k);
    all
}

fn layout_case(up_type: GgmlType, down_type: GgmlType, blocks: usize) -> NeuronLayout {
    NeuronLayout {
        n_embd: blocks * up_type.block_len().max(32),
        up_type,
        down_type,
    }
}

fn mlp_case(
    be: &WgpuBackend,
    store: u64,
    layout: NeuronLayout,
    k: usize,
    n: usize,
    extra: usize,
    seed: u64,
) -> Result<(), TestCaseError> {
    let mut rng = Draws::new(seed);
    let capacity = k + extra;
    be.neuron_slots_create(store, capacity, &layout).unwrap();
    let mut contents = vec![Vec::new(); capacity];
    let order = pick_slots(capacity, capacity, &mut rng);
    write(be, store, &layout, &mut contents, &order, &mut rng);
    let slots = pick_slots(capacity, k, &mut rng);
    let what = format!("{layout:?}, k {k}, {n} tokens, capacity {capacity}");
    check_call(be, store, &layout, &contents, &slots, n, &mut rng, &what)?;
    // Rewrite some of the slots just used (and others), then call again over a new
    // list: the new records are served, never the old ones.
    let rewrite = pick_slots(capacity, 1 + rng.below(capacity), &mut rng);
    write(be, store, &layout, &mut contents, &rewrite, &mut rng);
    let slots = pick_slots(capacity, k, &mut rng);
    check_call(
        be,
        store,
        &layout,
        &contents,
        &slots,
        n,
        &mut rng,
        &format!("{what}, rewritten"),
    )?;
    be.neuron_slots_free(store);
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 40, ..ProptestConfig::default() })]

    #[test]
    fn neuron_mlp_follows_the_reference_and_the_backend_ops(
        up in prop::sample::select(up_types()),
        down in prop::sample::select(DOWN_TYPES.to_vec()),
        blocks in 1usize..=3,
        k in prop_oneof![1usize..=16, 17usize..=300],
        n in 1usize..=4,
        extra in 0usize..=40,
        split in any::<bool>(),
        seed in any::<u64>(),
    ) {
        let Some((whole, small)) = backends() else { return Ok(()) };
        let layout = layout_case(up, down, blocks);
        let be = if split { small } else { whole };
        mlp_case(&be, 1, layout, k, n, extra, seed)?;
    }
}

/// Every up type, every down type, one binding and split: each pair at least once,
/// whatever the random cases above drew.
#[test]
fn every_type_pair_runs() {
    let Some((whole, small)) = backends() else {
        return;
    };
    for (i, up) in up_types().into_iter().enumerate() {
        for (j, down) in DOWN_TYPES.into_iter().enumerate() {
            let layout = layout_case(up, down, 1);
            let seed = (i * 3 + j) as u64;
            mlp_case(&whole, 2, layout, 37, 2, 5, seed).unwrap();
            mlp_case(&small, 2, layout, 37, 3, 5, seed + 100).unwrap();
        }
    }
}

/// The store is split over several bindings where it must be: a record stride of 108
/// bytes (Q4_1 up, Q8_0 down, 64 wide) and a limit of 7 KiB give bindings of 66 records.
#[test]
fn a_store_past_the_binding_limit_is_split_and_still_sums_in_order() {
    let Some((_, small)) = backends() else {
        return;
    };
    let layout = NeuronLayout {
        n_embd: 64,
        up_type: GgmlType::Q4_1,
        down_type: GgmlType::Q8_0,
    };
    assert_eq!(layout.record_bytes(), 108);
    // 300 slots: five bindings; the slots listed come from all of them, out of order.
    mlp_case(&small, 3, layout, 250, 4, 50, 7).unwrap();
}

/// Errors name what is wrong and write nothing: the output keeps its values.
#[test]
fn malformed_jobs_and_writes_are_refused() {
    let Some((be, _)) = backends() else {
        return;
    };
    let layout = NeuronLayout {
        n_embd: 64,
        up_type: GgmlType::Q8_0,
        down_type: GgmlType::F16,
    };
    be.neuron_slots_create(10, 4, &layout).unwrap();
    let mut rng = Draws::new(5);
    let mut contents = vec![Vec::new(); 4];
    write(&be, 10, &layout, &mut contents, &[0, 1, 2, 3], &mut rng);
    let x = rng.values(2 * 64, 1.0);
    let gate = vec![1.0f32; 4];
    let keep = vec![true; 4];
    let err =
        |store: u64, x: &[f32], slots: &[u32], gate: &[f32], keep: &[bool], out_len: usize| {
            let mut out = vec![7.0f32; out_len];
            let inputs = Inputs {
                store,
                x,
                n: 2,
                slots,
                gate,
                keep,
            };
            let e = be.neuron_mlp(inputs.job(&mut out)).unwrap_err().to_string();
            assert!(out.iter().all(|&v| v == 7.0), "{e}: the output was written");
            e
        };
    let e = err(10, &x, &[0, 4], &gate, &keep, 128);
    assert!(e.contains("slot 4") && e.contains("4 slots"), "{e}");
    let e = err(10, &x[..100], &[0, 1], &gate, &keep, 128);
    assert!(e.contains("input"), "{e}");
    let e = err(10, &x, &[0, 1], &gate[..3], &keep, 128);
    assert!(e.contains("gate"), "{e}");
    let e = err(10, &x, &[0, 1], &gate, &keep[..1], 128);
    assert!(e.contains("keep"), "{e}");
    let e = err(10, &x, &[0, 1], &gate, &keep, 64);
    assert!(e.contains("output"), "{e}");
    let e = err(77, &x, &[0, 1], &gate, &keep, 128);
    assert!(e.contains("neuron store 77"), "{e}");

    let rb = layout.record_bytes();
    let refused = |r: ballast_runtime::error::Result<()>, wanted: &str| {
        let e = r.unwrap_err().to_string();
        assert!(e.contains(wanted), "{e}");
    };
    refused(
        be.neuron_slots_write(10, &[0, 1], &vec![0u8; rb]),
        "neuron records",
    );
    refused(be.neuron_slots_write(10, &[9], &vec![0u8; rb]), "slot 9");
    refused(
        be.neuron_slots_write(78, &[0], &vec![0u8; rb]),
        "neuron store 78",
    );
    let bad_down = NeuronLayout {
        down_type: GgmlType::Q4_0,
        ..layout
    };
    refused(be.neuron_slots_create(11, 4, &bad_down), "Q4_0");
    let no_kernel = NeuronLayout {
        up_type: GgmlType::Q8_1,
        ..layout
    };
    refused(be.neuron_slots_create(11, 4, &no_kernel), "Q8_1");

    // Freed, the store is unknown; the good job ran before.
    let mut out = vec![0f32; 128];
    let good = Inputs {
        store: 10,
        x: &x,
        n: 2,
        slots: &[3, 1],
        gate: &gate,
        keep: &keep,
    };
    be.neuron_mlp(good.job(&mut out)).unwrap();
    be.neuron_slots_free(10);
    let e = err(10, &x, &[0, 1], &gate, &keep, 128);
    assert!(e.contains("neuron store 10"), "{e}");
}

/// No neurons, or no tokens: the output is zeros (nothing to add), not an error.
#[test]
fn an_empty_job_gives_zeros() {
    let Some((be, _)) = backends() else {
        return;
    };
    let layout = NeuronLayout {
        n_embd: 32,
        up_type: GgmlType::Q4_0,
        down_type: GgmlType::Q8_0,
    };
    be.neuron_slots_create(20, 2, &layout).unwrap();
    let x = vec![1.0f32; 32];
    let mut out = vec![f32::NAN; 32];
    let empty = Inputs {
        store: 20,
        x: &x,
        n: 1,
        slots: &[],
        gate: &[],
        keep: &[],
    };
    be.neuron_mlp(empty.job(&mut out)).unwrap();
    assert!(out.iter().all(|&v| v == 0.0));
    let no_tokens = Inputs {
        store: 20,
        x: &[],
        n: 0,
        slots: &[1, 0],
        gate: &[],
        keep: &[],
    };
    be.neuron_mlp(no_tokens.job(&mut [])).unwrap();
    be.neuron_slots_free(20);
}

/// The store's device bytes are counted while it lives, and each write counts its
/// records as uploaded, padded to whole words (a record of 54 bytes is stored in 56).
#[test]
fn device_and_uploaded_bytes_are_counted() {
    if backends().is_none() {
        return;
    }
    // A context of its own: the counts are per context, and other tests run beside this.
    let be = WgpuBackend::new(ballast_runtime::gpu::GpuContext::new().unwrap());
    let layout = NeuronLayout {
        n_embd: 32,
        up_type: GgmlType::Q4_1,
        down_type: GgmlType::Q8_0,
    };
    assert_eq!(layout.record_bytes(), 54);
    let (before, _) = be.bytes();
    be.neuron_slots_create(1, 100, &layout).unwrap();
    let (held, _) = be.bytes();
    assert_eq!(held - before, 100 * 56);
    let mut rng = Draws::new(3);
    let mut contents = vec![Vec::new(); 100];
    let up0 = be.neuron_bytes_uploaded();
    write(&be, 1, &layout, &mut contents, &[5, 6, 7, 50, 2], &mut rng);
    assert_eq!(be.neuron_bytes_uploaded() - up0, 5 * 56);
    be.neuron_slots_free(1);
    assert_eq!(be.bytes().0, before);
}
