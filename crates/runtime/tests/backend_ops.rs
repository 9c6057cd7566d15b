//! One backend test suite, written once and instantiated per backend by
//! `backend_suite!` (as cubecl and candle do): every op of [`Backend`] on fresh random
//! inputs of random shapes, against the CPU backend (the numerical reference) within a
//! tolerance stated per dtype, and against an independent f64 computation. Outputs are
//! poisoned with NaN first (host slices, and on the GPU every scratch buffer), so an
//! element a kernel forgets to write fails the test.
//!
//! The wgpu instance needs an adapter: under CI (`CI` set) a missing one fails the
//! tests; elsewhere they are skipped with a printed reason.

#[cfg(feature = "gpu")]
use ballast_runtime::backend::ops::*;
use std::sync::{Arc, OnceLock};

use ballast_runtime::backend::{AttentionShape, MatmulJob, Rope, RopeStyle};
use ballast_runtime::ggml_type::GgmlType;
#[cfg(feature = "gpu")]
use ballast_runtime::gpu::GpuContext;
use ballast_runtime::kv::{
    KvCache, KvElement, KvRows, KvSegment, KvShape, KvView, MASKED_POSITION, Q8_BLOCK,
};
use ballast_runtime::quant;
use ballast_runtime::weights::Weight;
use ballast_runtime::DenseKv;
#[cfg(feature = "gpu")]
use ballast_runtime::WgpuBackend;
use ballast_runtime::{Backend, CpuBackend};
use half::f16;
use proptest::prelude::*;
use proptest::test_runner::TestCaseError;

fn cpu() -> Option<Arc<dyn Backend>> {
    static CPU: OnceLock<Arc<CpuBackend>> = OnceLock::new();
    Some(CPU.get_or_init(|| Arc::new(CpuBackend::new(2))).clone())
}

#[cfg(feature = "gpu")]
fn gpu_context() -> Option<Arc<GpuContext>> {
    ballast_runtime::testing::gpu_for_tests()
}

#[cfg(feature = "gpu")]
fn wgpu() -> Option<Arc<dyn Backend>> {
    static BACKEND: OnceLock<Option<Arc<WgpuBackend>>> = OnceLock::new();
    BACKEND
        .get_or_init(|| {
            gpu_context().map(|ctx| {
                // Every scratch buffer starts as NaN: an output element a kernel leaves
                // unwritten fails the comparison.
                ctx.set_poison(true);
                Arc::new(WgpuBackend::new(ctx))
            })
        })
        .clone()
        .map(|b| b as Arc<dyn Backend>)
}

/// The reference every backend is held to.
fn reference() -> Arc<dyn Backend> {
    cpu().expect("the CPU backend always exists")
}

fn values(seed: u64, n: usize, scale: f32) -> Vec<f32> {
    ballast_runtime::testing::seeded_values(seed, n, scale)
}

fn weight(ty: GgmlType, rows: usize, cols: usize, seed: u64) -> Weight {
    ballast_runtime::testing::seeded_weight(
        &format!("test.{}.weight", ty.name()),
        ty,
        rows,
        cols,
        seed,
    )
}

fn dequantized(w: &Weight) -> Vec<f32> {
    let mut out = vec![0.0; w.rows() * w.cols()];
    quant::dequantize(w.ty, w.bytes.as_slice().unwrap(), &mut out).unwrap();
    out
}

/// Every type the backends must multiply by.
const WEIGHT_TYPES: [GgmlType; 11] = [
    GgmlType::F32,
    GgmlType::F16,
    GgmlType::BF16,
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q8_0,
    GgmlType::Q4_K,
    GgmlType::Q5_K,
    GgmlType::Q6_K,
];

/// How far two correct backends may differ, relative to `sum |terms|` of the
/// element: f32 summation order for float weights; for quantized weights both
/// backends quantize the activations to the same integers, so only the order in which
/// the f32 block sums are added (and fused multiply-adds) differ.
fn backend_tolerance(ty: GgmlType) -> f64 {
    match ty {
        GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => 1e-5,
        _ => 2e-5,
    }
}

fn check_close(
    what: &str,
    got: &[f32],
    want: &[f32],
    scale: &[f64],
    rel: f64,
) -> Result<(), TestCaseError> {
    prop_assert_eq!(got.len(), want.len());
    for i in 0..got.len() {
        let tol = rel * scale[i] + 1e-6;
        let diff = (got[i] as f64 - want[i] as f64).abs();
        prop_assert!(
            diff <= tol,
            "{}: element {} is {} (reference {}), tolerance {}",
            what,
            i,
            got[i],
            want[i],
            tol
        );
    }
    Ok(())
}

fn matmul_case(
    be: &dyn Backend,
    ty: GgmlType,
    other: GgmlType,
    rows: usize,
    blocks: usize,
    n: usize,
    seed: u64,
) -> Result<(), TestCaseError> {
    // A shared input length both types can take.
    let cols = 256 * blocks;
    let w1 = weight(ty, rows, cols, seed);
    let w2 = weight(other, rows + 3, cols, seed + 1);
    let x = values(seed + 2, n * cols, 2.0);
    let run = |be: &dyn Backend| {
        let mut o1 = vec![f32::NAN; n * w1.rows()];
        let mut o2 = vec![f32::NAN; n * w2.rows()];
        be.matmul(
            &x,
            n,
            &mut [
                MatmulJob {
                    weight: &w1,
                    out: &mut o1,
                },
                MatmulJob {
                    weight: &w2,
                    out: &mut o2,
                },
            ],
        )
        .unwrap();
        (o1, o2)
    };
    let (g1, g2) = run(be);
    let (r1, r2) = run(reference().as_ref());
    for (w, got, want) in [(&w1, &g1, &r1), (&w2, &g2, &r2)] {
        // sum |w x| per element, and the f64 product with unquantized activations.
        let wf = dequantized(w);
        let mut scale = vec![0.0; n * w.rows()];
        let mut exact = vec![0.0f64; n * w.rows()];
        for t in 0..n {
            for r in 0..w.rows() {
                for j in 0..cols {
                    let p = wf[r * cols + j] as f64 * x[t * cols + j] as f64;
                    scale[t * w.rows() + r] += p.abs();
                    exact[t * w.rows() + r] += p;
                }
            }
        }
        check_close(
            &format!("{} vs the CPU backend", w.name),
            got,
            want,
            &scale,
            backend_tolerance(w.ty),
        )?;
        // 8-bit activations round each value by at most half a step (amax/254 of
        // its block); |w| <= 1 and the block amax <= 2, so |error| <= cols*2/254 ...
        // bounded far tighter by sum |w| * amax / 254. Float weights are exact.
        let act_err = if quant::activation_type(w.ty) == GgmlType::F32 {
            1e-5
        } else {
            1.0 / 200.0
        };
        for i in 0..got.len() {
            let wabs: f64 = (0..cols)
                .map(|j| wf[(i % w.rows()) * cols + j].abs() as f64)
                .sum();
            let tol = act_err * 2.0 * wabs + 1e-4 * scale[i] + 1e-5;
            prop_assert!(
                (got[i] as f64 - exact[i]).abs() <= tol,
                "{}: element {} is {}, exact {} (tolerance {})",
                w.name,
                i,
                got[i],
                exact[i],
                tol
            );
        }
    }
    Ok(())
}

/// `matmul_rows` gives exactly `matmul`'s value for every asked row and leaves the
/// others alone (the sparse MLP relies on both).
fn matmul_rows_case(
    be: &dyn Backend,
    ty: GgmlType,
    rows: usize,
    n: usize,
    cuts: &[usize],
    seed: u64,
) -> Result<(), TestCaseError> {
    let cols = 256;
    let w = weight(ty, rows, cols, seed);
    let x = values(seed + 1, n * cols, 2.0);
    let mut full = vec![0f32; n * rows];
    be.matmul(
        &x,
        n,
        &mut [MatmulJob {
            weight: &w,
            out: &mut full,
        }],
    )
    .unwrap();
    // Every other span between sorted cut points is asked for.
    let mut points: Vec<usize> = cuts.iter().map(|c| c % (rows + 1)).collect();
    points.extend([0, rows]);
    points.sort_unstable();
    points.dedup();
    let ranges: Vec<std::ops::Range<usize>> =
        points.windows(2).step_by(2).map(|p| p[0]..p[1]).collect();
    let mut got = vec![f32::NAN; n * rows];
    be.matmul_rows(&x, n, &w, &ranges, &mut got).unwrap();
    for t in 0..n {
        for r in 0..rows {
            let (g, f) = (got[t * rows + r], full[t * rows + r]);
            if ranges.iter().any(|rg| rg.contains(&r)) {
                prop_assert_eq!(g.to_bits(), f.to_bits(), "token {} row {}", t, r);
            } else {
                prop_assert!(g.is_nan(), "token {} row {} was written", t, r);
            }
        }
    }
    // Overlapping or out-of-range rows are refused.
    let err = be.matmul_rows(&x, n, &w, &[0..rows, 0..1], &mut got);
    prop_assert!(err.is_err());
    let past_the_end = std::ops::Range {
        start: 0,
        end: rows + 1,
    };
    let err = be.matmul_rows(&x, n, &w, std::slice::from_ref(&past_the_end), &mut got);
    prop_assert!(err.is_err());
    Ok(())
}

fn embed_case(
    be: &dyn Backend,
    ty: GgmlType,
    rows: usize,
    blocks: usize,
    n: usize,
    seed: u64,
) -> Result<(), TestCaseError> {
    let cols = 256 * blocks;
    let table = weight(ty, rows, cols, seed);
    let ids: Vec<u32> = values(seed + 1, n, 1.0)
        .iter()
        .map(|v| ((v.abs() * rows as f32) as usize).min(rows - 1) as u32)
        .collect();
    let mut got = vec![f32::NAN; n * cols];
    be.embed(&table, &ids, &mut got).unwrap();
    let wf = dequantized(&table);
    let want: Vec<f32> = ids
        .iter()
        .flat_map(|&id| wf[id as usize * cols..(id as usize + 1) * cols].to_vec())
        .collect();
    // Dequantization is exact arithmetic on both sides: bit-identical.
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        prop_assert!(
            g.to_bits() == w.to_bits(),
            "{}: element {} is {} not {}",
            table.name,
            i,
            g,
            w
        );
    }
    let bad = [rows as u32];
    let mut out = vec![0.0; cols];
    prop_assert!(be.embed(&table, &bad, &mut out).is_err());
    Ok(())
}

fn rms_norm_case(be: &dyn Backend, rows: usize, n: usize, seed: u64) -> Result<(), TestCaseError> {
    let x = values(seed, rows * n, 3.0);
    let scale = values(seed + 1, n, 1.5);
    let mut got = vec![f32::NAN; rows * n];
    let mut want = vec![f32::NAN; rows * n];
    be.rms_norm(&x, &scale, 1e-5, &mut got).unwrap();
    reference().rms_norm(&x, &scale, 1e-5, &mut want).unwrap();
    let mag: Vec<f64> = want.iter().map(|v| v.abs() as f64 + 1e-3).collect();
    check_close("rms_norm", &got, &want, &mag, 1e-5)
}

/// The per-head Q/K norm (`Op::HeadRmsNorm`, qwen3): every executor runs it as the
/// RMSNorm with a scale of one head, over `tokens × heads` rows. Held to an f64 norm of
/// each head and to the CPU backend.
fn head_norm_case(
    be: &dyn Backend,
    tokens: usize,
    heads: usize,
    head_dim: usize,
    seed: u64,
) -> Result<(), TestCaseError> {
    let x = values(seed, tokens * heads * head_dim, 3.0);
    let scale = values(seed + 1, head_dim, 1.5);
    let mut got = vec![f32::NAN; x.len()];
    let mut cpu = vec![f32::NAN; x.len()];
    be.rms_norm(&x, &scale, 1e-6, &mut got).unwrap();
    reference().rms_norm(&x, &scale, 1e-6, &mut cpu).unwrap();
    let exact: Vec<f32> = x
        .chunks(head_dim)
        .flat_map(|h| {
            let ms = h.iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / head_dim as f64;
            let inv = 1.0 / (ms + 1e-6).sqrt();
            h.iter()
                .zip(&scale)
                .map(move |(&v, &s)| (v as f64 * inv * s as f64) as f32)
        })
        .collect();
    let mag: Vec<f64> = exact.iter().map(|v| v.abs() as f64 + 1e-3).collect();
    check_close("head norm vs f64", &got, &exact, &mag, 1e-5)?;
    check_close("head norm vs cpu", &got, &cpu, &mag, 1e-5)
}

#[allow(clippy::too_many_arguments)]
fn rope_case(
    be: &dyn Backend,
    neox: bool,
    n: usize,
    heads: usize,
    half_dim: usize,
    partial: bool,
    start: u32,
    seed: u64,
) -> Result<(), TestCaseError> {
    let head_dim = 2 * half_dim;
    let rope = Rope {
        style: if neox {
            RopeStyle::Neox
        } else {
            RopeStyle::Normal
        },
        n_dims: if partial {
            head_dim / 2 * 2 / 2
        } else {
            head_dim
        },
        freq_base: 10000.0,
        freq_scale: 1.0,
        freq_factors: None,
    };
    let positions: Vec<u32> = (0..n as u32).map(|i| start + 3 * i).collect();
    let x = values(seed, n * heads * head_dim, 2.0);
    let mut got = x.clone();
    let mut want = x.clone();
    be.rope(&mut got, &positions, heads, head_dim, &rope)
        .unwrap();
    reference()
        .rope(&mut want, &positions, heads, head_dim, &rope)
        .unwrap();
    // Both rotate by the same host-computed factors: only fused multiply-adds differ.
    let mag: Vec<f64> = x.iter().map(|_| 4.0).collect();
    check_close("rope", &got, &want, &mag, 1e-6)
}

/// The element type of the cache in an attention case.
fn kv_elem() -> impl Strategy<Value = KvElement> {
    prop_oneof![
        Just(KvElement::F32),
        Just(KvElement::F16),
        Just(KvElement::Q8)
    ]
}

#[allow(clippy::too_many_arguments)]
fn attention_case(
    be: &dyn Backend,
    n_kv_heads: usize,
    group: usize,
    head_dim: usize,
    cached: usize,
    n: usize,
    split: usize,
    elem: KvElement,
    seed: u64,
) -> Result<(), TestCaseError> {
    // A q8 cache holds whole blocks per row (the cache refuses other lengths), so each
    // segment starts on a block.
    let head_dim = match elem {
        KvElement::Q8 => head_dim.div_ceil(Q8_BLOCK) * Q8_BLOCK,
        _ => head_dim,
    };
    let total = cached + n;
    // One case in three slides a window over the cache (gemma3's local layers).
    let shape = AttentionShape {
        window: (seed % 3 == 0).then(|| 1 + (seed / 3) as usize % total),
        ..AttentionShape::new(n_kv_heads * group, n_kv_heads, head_dim)
    };
    let kv_dim = n_kv_heads * head_dim;
    let keys = values(seed, total * kv_dim, 1.0);
    let vals = values(seed + 1, total * kv_dim, 1.0);
    // About one slot in six masked, as a cache that reuses slots in place shows them.
    let masks = values(seed + 3, total, 1.0);
    let positions: Vec<u32> = (0..total as u32)
        .zip(&masks)
        .map(|(p, &m)| if m > 0.66 { MASKED_POSITION } else { p })
        .collect();
    let q = values(seed + 2, n * shape.n_heads * head_dim, 2.0);
    let q_pos: Vec<u32> = (cached as u32..total as u32).collect();
    let keys16: Vec<f16> = keys.iter().map(|&v| f16::from_f32(v)).collect();
    let vals16: Vec<f16> = vals.iter().map(|&v| f16::from_f32(v)).collect();
    // Any quants and scales are a valid q8 cache: no need to quantize.
    let quants = |x: &[f32]| -> Vec<i8> { x.iter().map(|&v| (v * 127.0) as i8).collect() };
    let scales = |s: u64| -> Vec<f16> {
        values(s, (total * kv_dim).div_ceil(Q8_BLOCK), 0.5)
            .iter()
            .map(|&v| f16::from_f32((v + 1.0) / 127.0))
            .collect()
    };
    let (keys8, vals8) = (quants(&keys), quants(&vals));
    let (kscales, vscales) = (scales(seed + 4), scales(seed + 5));
    let rows = |f: &'static str, r: std::ops::Range<usize>| -> KvRows<'_> {
        let (a, b, q, s) = if f == "k" {
            (&keys, &keys16, &keys8, &kscales)
        } else {
            (&vals, &vals16, &vals8, &vscales)
        };
        match elem {
            KvElement::F32 => KvRows::F32(&a[r]),
            KvElement::F16 => KvRows::F16(&b[r]),
            KvElement::Q8 => KvRows::Q8 {
                scales: &s[r.start / Q8_BLOCK..r.end.div_ceil(Q8_BLOCK)],
                quants: &q[r],
            },
        }
    };
    // Two segments, as a ring buffer presents its live region.
    let cut = split.min(total);
    let view = KvView {
        segments: vec![
            KvSegment {
                keys: rows("k", 0..cut * kv_dim),
                values: rows("v", 0..cut * kv_dim),
                positions: &positions[..cut],
            },
            KvSegment {
                keys: rows("k", cut * kv_dim..total * kv_dim),
                values: rows("v", cut * kv_dim..total * kv_dim),
                positions: &positions[cut..],
            },
        ],
    };
    let mut got = vec![f32::NAN; q.len()];
    let mut want = vec![f32::NAN; q.len()];
    be.attention(&q, &q_pos, &view, &shape, &mut got).unwrap();
    reference()
        .attention(&q, &q_pos, &view, &shape, &mut want)
        .unwrap();
    // An f32 cache: float order only; a q8 cache too (both dequantize to the same
    // `q * scale` and sum in f32). An f16 cache: the CPU backend follows llama.cpp and
    // rounds the query and its running sums to f16 at every key (the GPU keeps f32 sums
    // over the same f16 keys and values), so about 2^-11 per key, relative.
    let tolerance = match elem {
        KvElement::F16 => 5e-3,
        KvElement::F32 | KvElement::Q8 => 1e-5,
    };
    let mag: Vec<f64> = want.iter().map(|_| 1.0).collect();
    check_close("attention", &got, &want, &mag, tolerance)?;
    if elem == KvElement::F32 {
        // Against an f64 statement of the mask: causal, masked slots skipped, and for a
        // window only the keys within it.
        let kv_of = |h: usize| h / group;
        let mut exact = vec![0f64; q.len()];
        for (t, &qp) in q_pos.iter().enumerate() {
            for h in 0..shape.n_heads {
                let qo = (t * shape.n_heads + h) * head_dim;
                let ko = kv_of(h) * head_dim;
                let seen: Vec<usize> = (0..total)
                    .filter(|&i| {
                        let kp = positions[i];
                        kp <= qp && shape.window.is_none_or(|w| ((qp - kp) as usize) < w)
                    })
                    .collect();
                let scores: Vec<f64> = seen
                    .iter()
                    .map(|&i| {
                        (0..head_dim)
                            .map(|d| q[qo + d] as f64 * keys[i * kv_dim + ko + d] as f64)
                            .sum::<f64>()
                            * shape.scale as f64
                    })
                    .collect();
                let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let w: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
                let sum: f64 = w.iter().sum();
                for d in 0..head_dim {
                    exact[qo + d] = seen
                        .iter()
                        .zip(&w)
                        .map(|(&i, &wi)| wi / sum * vals[i * kv_dim + ko + d] as f64)
                        .sum();
                }
            }
        }
        let exact: Vec<f32> = exact.iter().map(|&v| v as f32).collect();
        check_close("attention vs f64", &got, &exact, &mag, 1e-4)?;
    }
    Ok(())
}

fn elementwise_case(
    be: &dyn Backend,
    rows: usize,
    n: usize,
    seed: u64,
) -> Result<(), TestCaseError> {
    let len = rows * n;
    let a = values(seed, len, 4.0);
    let b = values(seed + 1, len, 4.0);
    let bias = values(seed + 2, n, 1.0);
    let mag: Vec<f64> = a
        .iter()
        .zip(&b)
        .map(|(x, y)| (x * y).abs() as f64 + 1.0)
        .collect();

    let mut got = vec![f32::NAN; len];
    let mut want = vec![f32::NAN; len];
    be.swiglu(&a, &b, &mut got).unwrap();
    reference().swiglu(&a, &b, &mut want).unwrap();
    check_close("swiglu", &got, &want, &mag, 1e-6)?;

    // GeGLU: ggml's f16 table on the CPU, the same roundings with the device's tanh on
    // a GPU; both within f16 rounding of the f64 formula.
    let mut got = vec![f32::NAN; len];
    let mut want = vec![f32::NAN; len];
    be.geglu(&a, &b, &mut got).unwrap();
    reference().geglu(&a, &b, &mut want).unwrap();
    check_close("geglu", &got, &want, &mag, 1e-3)?;
    let exact: Vec<f32> = a
        .iter()
        .zip(&b)
        .map(|(&g, &u)| {
            let g = g as f64;
            let gelu = 0.5
                * g
                * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (g + 0.044715 * g * g * g)).tanh());
            (gelu * u as f64) as f32
        })
        .collect();
    check_close("geglu vs f64", &got, &exact, &mag, 3e-3)?;

    let mut got = a.clone();
    be.scale(&mut got, 0.0625).unwrap();
    let want: Vec<f32> = a.iter().map(|x| x * 0.0625).collect();
    prop_assert_eq!(&got, &want);

    let mut got = a.clone();
    be.add_assign(&mut got, &b).unwrap();
    let want: Vec<f32> = a.iter().zip(&b).map(|(x, y)| x + y).collect();
    prop_assert_eq!(&got, &want);

    let mut got = a.clone();
    be.add_bias(&mut got, &bias).unwrap();
    let want: Vec<f32> = a.iter().enumerate().map(|(i, x)| x + bias[i % n]).collect();
    prop_assert_eq!(&got, &want);
    Ok(())
}

fn weight_type() -> impl Strategy<Value = GgmlType> {
    proptest::sample::select(WEIGHT_TYPES.to_vec())
}

/// The suite, for one backend: `$make` returns it, or `None` to skip.
macro_rules! backend_suite {
    ($name:ident, $make:expr) => {
        mod $name {
            use super::*;

            proptest! {
                #![proptest_config(ProptestConfig { cases: 12, ..ProptestConfig::default() })]

                #[test]
                fn matmul_matches_the_reference(
                    ty in weight_type(),
                    other in weight_type(),
                    rows in 1usize..20,
                    blocks in 1usize..3,
                    n in 1usize..12,
                    seed in any::<u64>(),
                ) {
                    let Some(be) = $make() else { return Ok(()) };
                    matmul_case(be.as_ref(), ty, other, rows, blocks, n, seed)?;
                }

                #[test]
                fn matmul_rows_computes_only_the_asked_rows(
                    ty in weight_type(),
                    rows in 1usize..40,
                    n in 1usize..4,
                    cuts in proptest::collection::vec(0usize..64, 0..6),
                    seed in any::<u64>(),
                ) {
                    let Some(be) = $make() else { return Ok(()) };
                    matmul_rows_case(be.as_ref(), ty, rows, n, &cuts, seed)?;
                }

                #[test]
                fn embed_dequantizes_rows_exactly(
                    ty in weight_type(),
                    rows in 1usize..40,
                    blocks in 1usize..3,
                    n in 1usize..6,
                    seed in any::<u64>(),
                ) {
                    let Some(be) = $make() else { return Ok(()) };
                    embed_case(be.as_ref(), ty, rows, blocks, n, seed)?;
                }

                #[test]
                fn rms_norm_matches_the_reference(
                    rows in 1usize..6,
                    n in 1usize..300,
                    seed in any::<u64>(),
                ) {
                    let Some(be) = $make() else { return Ok(()) };
                    rms_norm_case(be.as_ref(), rows, n, seed)?;
                }

                #[test]
                fn head_norm_matches_the_reference(
                    tokens in 1usize..4,
                    heads in 1usize..9,
                    head_dim in prop_oneof![Just(32usize), Just(64), Just(128), Just(256)],
                    seed in any::<u64>(),
                ) {
                    let Some(be) = $make() else { return Ok(()) };
                    head_norm_case(be.as_ref(), tokens, heads, head_dim, seed)?;
                }

                #[test]
                fn rope_matches_the_reference(
                    neox in any::<bool>(),
                    n in 1usize..5,
                    heads in 1usize..5,
                    half_dim in 1usize..40,
                    partial in any::<bool>(),
                    start in 0u32..2000,
                    seed in any::<u64>(),
                ) {
                    let Some(be) = $make() else { return Ok(()) };
                    rope_case(be.as_ref(), neox, n, heads, half_dim, partial, start, seed)?;
                }

                #[test]
                fn attention_matches_the_reference(
                    n_kv_heads in 1usize..4,
                    group in 1usize..4,
                    head_dim in 1usize..80,
                    cached in 0usize..40,
                    n in 1usize..5,
                    split in 0usize..50,
                    elem in kv_elem(),
                    seed in any::<u64>(),
                ) {
                    let Some(be) = $make() else { return Ok(()) };
                    attention_case(be.as_ref(), n_kv_heads, group, head_dim, cached, n, split, elem, seed)?;
                }

                // Over 256 cached keys with few queries the wgpu backend splits the
                // keys between workgroups and combines their sums (flash decoding).
                #[test]
                fn attention_over_many_keys_matches_the_reference(
                    n_kv_heads in 1usize..3,
                    group in 1usize..3,
                    head_dim in 1usize..70,
                    cached in 250usize..800,
                    n in 1usize..3,
                    split in 0usize..800,
                    elem in kv_elem(),
                    seed in any::<u64>(),
                ) {
                    let Some(be) = $make() else { return Ok(()) };
                    attention_case(be.as_ref(), n_kv_heads, group, head_dim, cached, n, split, elem, seed)?;
                }

                #[test]
                fn elementwise_ops_match_the_reference(
                    rows in 1usize..5,
                    n in 1usize..200,
                    seed in any::<u64>(),
                ) {
                    let Some(be) = $make() else { return Ok(()) };
                    elementwise_case(be.as_ref(), rows, n, seed)?;
                }
            }

            #[test]
            fn mismatched_lengths_are_errors_that_leave_the_output_alone() {
                let Some(be) = $make() else { return };
                mismatched_lengths_case(be.as_ref());
            }
        }
    };
}

/// Every op given a buffer of the wrong length returns `Error::ShapeMismatch` naming
/// what was wrong, and writes nothing.
fn mismatched_lengths_case(be: &dyn Backend) {
    let named = |r: ballast_runtime::Result<()>, what: &str| {
        let err = r.expect_err(what).to_string();
        assert!(err.contains(what), "{err}");
    };
    let mut out = vec![7.0f32; 10];
    named(
        be.rms_norm(&[1.0; 12], &[1.0; 4], 1e-5, &mut out),
        "RMSNorm output",
    );
    named(
        be.rms_norm(&[1.0; 10], &[1.0; 4], 1e-5, &mut out),
        "RMSNorm input",
    );
    named(be.swiglu(&[1.0; 10], &[1.0; 9], &mut out), "SwiGLU up");
    named(be.add_assign(&mut out, &[1.0; 3]), "addend");
    let rope = Rope {
        style: RopeStyle::Normal,
        n_dims: 4,
        freq_base: 10000.0,
        freq_scale: 1.0,
        freq_factors: None,
    };
    named(be.rope(&mut out, &[0, 1], 1, 4, &rope), "RoPE input");
    let shape = AttentionShape::new(2, 1, 4);
    let kv = DenseKv::new(
        KvShape {
            n_layers: 1,
            n_kv_heads: 1,
            head_dim: 4,
        },
        4,
    );
    named(
        be.attention(&[1.0; 8], &[0], &kv.view(0), &shape, &mut out),
        "attention output",
    );
    assert!(
        out.iter().all(|&v| v == 7.0),
        "an op wrote despite the error"
    );
}

/// llama.cpp's merge of a head's chunk partials (`ggml_flash_attn_ext_reduce_partials`),
/// stated in f32 as gcc compiles it: each sum of two products with the first fused.
fn merge_like_llama_cpp(partials: &[Vec<f32>], hd: usize) -> Vec<f32> {
    let (mut max, mut sum, mut acc) = (f32::NEG_INFINITY, 0f32, vec![0f32; hd]);
    for p in partials {
        if p[1] == 0.0 {
            continue;
        }
        let m = max.max(p[0]);
        let (old, new) = ((max - m).exp(), (p[0] - m).exp());
        for (a, &v) in acc.iter_mut().zip(&p[2..]) {
            *a = a.mul_add(old, v * new);
        }
        sum = sum.mul_add(old, p[1] * new);
        max = m;
    }
    if sum != 0.0 {
        acc.iter_mut().for_each(|a| *a *= 1.0 / sum);
    }
    acc
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    /// A decoded token over at least `SPLIT_FROM_CELLS` cached keys, on several threads,
    /// is split as llama.cpp splits it: one chunk of its padded key count per thread,
    /// each query head's chunk attended alone (the scalar statement's partial), the
    /// partials merged in chunk order; on one thread, and below that many keys, nothing
    /// is split. Each query of a batch (fewer than 64) gets the bits of decoding it alone.
    #[test]
    fn decode_attention_splits_the_keys_as_llama_cpp(
        n_kv_heads in 1usize..4,
        group in 1usize..4,
        head_dim in prop_oneof![Just(64usize), Just(128), 1usize..80],
        cells in 600usize..1400,
        threads in 2usize..5,
        half in any::<bool>(),
        seed in any::<u64>(),
    ) {
        use ballast_runtime::backend::cpu_kernels::{attend_heads_to, Finish, HeadSlot, SPLIT_FROM_CELLS};
        let shape = AttentionShape::new(n_kv_heads * group, n_kv_heads, head_dim);
        let kv_dim = n_kv_heads * head_dim;
        let keys = values(seed, cells * kv_dim, 3.0);
        let vals = values(seed + 1, cells * kv_dim, 1.0);
        let (keys16, vals16): (Vec<f16>, Vec<f16>) = (
            keys.iter().map(|&v| f16::from_f32(v)).collect(),
            vals.iter().map(|&v| f16::from_f32(v)).collect(),
        );
        let rows = |r: std::ops::Range<usize>, k: bool| match (half, k) {
            (true, true) => KvRows::F16(&keys16[r]),
            (true, false) => KvRows::F16(&vals16[r]),
            (false, true) => KvRows::F32(&keys[r]),
            (false, false) => KvRows::F32(&vals[r]),
        };
        let positions: Vec<u32> = (0..cells as u32).collect();
        let view_of = |r: std::ops::Range<usize>| KvView {
            segments: vec![KvSegment {
                keys: rows(r.start * kv_dim..r.end * kv_dim, true),
                values: rows(r.start * kv_dim..r.end * kv_dim, false),
                positions: &positions[r],
            }],
        };
        let q = values(seed + 2, shape.n_heads * head_dim, 2.0);
        let q_pos = cells as u32 - 1;
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        let mut got = vec![f32::NAN; q.len()];
        let be: Arc<dyn Backend> = Arc::new(CpuBackend::new(threads));
        be.attention(&q, &[q_pos], &view_of(0..cells), &shape, &mut got).unwrap();
        let mut alone = vec![f32::NAN; q.len()];
        let one: Arc<dyn Backend> = Arc::new(CpuBackend::new(1));
        one.attention(&q, &[q_pos], &view_of(0..cells), &shape, &mut alone).unwrap();
        if cells < SPLIT_FROM_CELLS {
            prop_assert_eq!(bits(&got), bits(&alone), "{} keys are not split", cells);
            return Ok(());
        }
        // llama.cpp's chunks: ceil(n_kv / threads) of the padded count, n_kv = 256 *
        // ceil(cells / 256).
        let n_kv = cells.div_ceil(256) * 256;
        let size = n_kv.div_ceil(threads);
        let mut tmp = Vec::new();
        let mut want = Vec::new();
        for h in 0..shape.n_heads {
            let kv_head = h / group;
            let slot = HeadSlot {
                offset: kv_head * head_dim,
                row_len: kv_dim,
                head_dim,
                window: u32::MAX,
            };
            let qh = &q[h * head_dim..(h + 1) * head_dim];
            let partials: Vec<Vec<f32>> = (0..threads)
                .map(|c| {
                    let r = (c * size).min(cells)..((c + 1) * size).min(cells);
                    let mut p = vec![f32::NAN; 2 + head_dim];
                    attend_heads_to(quant::SimdLevel::Scalar, &[qh], q_pos, &view_of(r), slot,
                        shape.scale, &mut tmp, &mut [p.as_mut_slice()], Finish::Partial);
                    p
                })
                .collect();
            want.extend(merge_like_llama_cpp(&partials, head_dim));
        }
        prop_assert_eq!(bits(&got), bits(&want), "{} keys on {} threads", cells, threads);
        // A batch of the last few queries (a verification pass of speculative
        // decoding) gives each query the bits of decoding it alone over the cells it
        // had then.
        let batch = 1 + (seed % 4) as usize;
        let first = cells - batch;
        let q_batch = values(seed + 5, batch * shape.n_heads * head_dim, 2.0);
        let positions_batch: Vec<u32> = (first as u32..cells as u32).collect();
        let mut together = vec![f32::NAN; q_batch.len()];
        be.attention(&q_batch, &positions_batch, &view_of(0..cells), &shape, &mut together).unwrap();
        let width = shape.n_heads * head_dim;
        for (i, &p) in positions_batch.iter().enumerate() {
            let mut single = vec![f32::NAN; width];
            be.attention(&q_batch[i * width..(i + 1) * width], &[p], &view_of(0..p as usize + 1), &shape, &mut single).unwrap();
            prop_assert_eq!(bits(&together[i * width..(i + 1) * width]), bits(&single), "query {} of a batch of {}", i, batch);
        }
        // The same attention, up to rounding, as the one-thread order (an f16
        // accumulator rounds at every key, in other places when split).
        let tolerance = if half { 3e-2 } else { 1e-4 };
        for (a, b) in got.iter().zip(&alone) {
            prop_assert!((a - b).abs() <= tolerance * (1.0 + b.abs()), "{} against {}", a, b);
        }
    }
}

/// Attention over no queries does nothing and succeeds (the CPU backend sizes its work
/// from the number of queries).
#[test]
fn attention_of_no_queries_is_empty() {
    let be = cpu().expect("the CPU backend");
    let shape = AttentionShape::new(2, 1, 4);
    let kv = DenseKv::new(
        KvShape {
            n_layers: 1,
            n_kv_heads: 1,
            head_dim: 4,
        },
        4,
    );
    let mut out: [f32; 0] = [];
    be.attention(&[], &[], &kv.view(0), &shape, &mut out)
        .unwrap();
}

backend_suite!(cpu_backend, cpu);
#[cfg(feature = "gpu")]
backend_suite!(wgpu_backend, wgpu);

/// Weights larger than one binding allows are split by rows; the split backend gives
/// the same products and embeddings as the unsplit one.
#[test]
#[cfg(feature = "gpu")]
fn weights_split_across_bindings_give_the_same_results() {
    let Some(ctx) = gpu_context() else { return };
    let whole = WgpuBackend::new(ctx.clone());
    // Three rows of Q4_1 (160 bytes each at 256 columns) per chunk.
    let split = WgpuBackend::with_chunk_limit(ctx, 3 * 160 + 10);
    let w = weight(GgmlType::Q4_1, 11, 256, 7);
    let x = values(8, 2 * 256, 1.0);
    let mut a = vec![f32::NAN; 22];
    let mut b = vec![f32::NAN; 22];
    for (be, out) in [(&whole, &mut a), (&split, &mut b)] {
        be.matmul(
            &x,
            2,
            &mut [MatmulJob {
                weight: &w,
                out: &mut *out,
            }],
        )
        .unwrap();
    }
    assert_eq!(a, b);
    let ids = [0u32, 10, 4, 3];
    let mut ea = vec![f32::NAN; 4 * 256];
    let mut eb = vec![f32::NAN; 4 * 256];
    whole.embed(&w, &ids, &mut ea).unwrap();
    split.embed(&w, &ids, &mut eb).unwrap();
    assert_eq!(ea, eb);
}

/// A weight type without a GPU kernel is an error naming the tensor, not a panic.
#[test]
#[cfg(feature = "gpu")]
fn an_activation_type_as_weight_is_a_named_error() {
    let Some(be) = wgpu() else { return };
    let w = Weight {
        name: "blk.0.odd.weight".into(),
        id: ballast_runtime::weights::WeightId::fresh(),
        ty: GgmlType::Q8_K,
        dims: vec![256, 1],
        bytes: ballast_runtime::weights::WeightBytes::from_vec(vec![
            0;
            GgmlType::Q8_K.block_bytes()
        ]),
    };
    let mut out = vec![0.0; 1];
    let err = be
        .matmul(
            &[0.0; 256],
            1,
            &mut [MatmulJob {
                weight: &w,
                out: &mut out,
            }],
        )
        .unwrap_err();
    assert!(err.to_string().contains("blk.0.odd.weight"), "{err}");
}

/// The wgpu backend uploads a view's rows as stored, so a view whose segments mix
/// element types is an error naming the segment, not a silent conversion.
#[test]
#[cfg(feature = "gpu")]
fn a_view_mixing_element_types_is_a_named_error() {
    let Some(be) = wgpu() else { return };
    let shape = AttentionShape::new(1, 1, 32);
    let full = [0.5f32; 32];
    let halves = [f16::from_f32(0.5); 32];
    let view = KvView {
        segments: vec![
            KvSegment {
                keys: KvRows::F32(&full),
                values: KvRows::F32(&full),
                positions: &[0],
            },
            KvSegment {
                keys: KvRows::F16(&halves),
                values: KvRows::F32(&full),
                positions: &[1],
            },
        ],
    };
    let mut out = vec![7.0f32; 32];
    let err = be
        .attention(&[1.0; 32], &[1], &view, &shape, &mut out)
        .unwrap_err()
        .to_string();
    assert!(err.contains("keys of segment 1 are f16"), "{err}");
    assert!(
        out.iter().all(|&v| v == 7.0),
        "the op wrote despite the error"
    );
}

/// On several threads every matrix product is one parallel region, counted with the
/// time its barrier cost the calling thread; on one thread there is no region, and a
/// reset clears the count.
#[test]
fn parallel_regions_are_counted_with_their_barrier_wait() {
    use ballast_runtime::backend::ops::LinearOps;
    let w = weight(GgmlType::Q8_0, 64, 256, 7);
    let x = values(8, 2 * 256, 1.0);
    let mut out = vec![0f32; 2 * 64];
    for (threads, regions) in [(1, 0), (2, 3)] {
        let be = CpuBackend::new(threads);
        for _ in 0..3 {
            be.matmul(
                &x,
                2,
                &mut [MatmulJob {
                    weight: &w,
                    out: &mut out,
                }],
            )
            .unwrap();
        }
        let s = be.telemetry().op_times().snapshot();
        assert_eq!(s.regions, regions, "{threads} threads");
        assert!(
            s.thread_wait <= s.matmul,
            "the wait is part of the products' time"
        );
        be.telemetry().op_times().reset();
        assert_eq!(be.telemetry().op_times().snapshot().regions, 0);
    }
}
