//! Reference tests of the quantized kernels against independent bit unpacking and f64 math.

use ballast_runtime::backend::cpu_kernels::{
    attend_block, attend_head_at, attend_head_reference, attend_heads_at, attend_heads_to,
    attend_tiled_reference, merge_partials, swiglu_at, BlockScratch, Finish, HeadSlot,
};
use ballast_runtime::ggml_type::GgmlType;
use ballast_runtime::kv::{KvRows, KvSegment, KvView, MASKED_POSITION};
use ballast_runtime::quant::{self, QuantizedActivations, SimdLevel};
use half::{bf16, f16};
use proptest::prelude::*;

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

/// splitmix64: deterministic random numbers from a proptest seed.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in [-1, 1).
    fn unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

fn h(b: &[u8], off: usize) -> f64 {
    f16::from_bits(u16::from_le_bytes([b[off], b[off + 1]])).to_f32() as f64
}

/// A finite random f16 scale, sometimes negative, sometimes zero.
fn rand_scale(r: &mut Rng) -> [u8; 2] {
    let v = match r.below(10) {
        0 => 0.0,
        _ => r.unit() * 2.0,
    };
    f16::from_f32(v).to_bits().to_le_bytes()
}

/// Random bytes for `nblocks` blocks of `ty`, with finite scale fields.
fn rand_blocks(ty: GgmlType, nblocks: usize, r: &mut Rng) -> Vec<u8> {
    let bb = ty.block_bytes();
    let mut out = Vec::with_capacity(nblocks * bb);
    for _ in 0..nblocks {
        let mut b: Vec<u8> = (0..bb).map(|_| r.next() as u8).collect();
        let f16_fields: &[usize] = match ty {
            GgmlType::F16 | GgmlType::Q4_0 | GgmlType::Q5_0 | GgmlType::Q8_0 => &[0],
            GgmlType::Q4_1 | GgmlType::Q5_1 | GgmlType::Q8_1 | GgmlType::Q4_K | GgmlType::Q5_K => {
                &[0, 2]
            }
            GgmlType::Q6_K => &[208],
            _ => &[],
        };
        for &o in f16_fields {
            b[o..o + 2].copy_from_slice(&rand_scale(r));
        }
        match ty {
            GgmlType::F32 => b.copy_from_slice(&(r.unit() * 4.0).to_le_bytes()),
            GgmlType::Q8_K => b[0..4].copy_from_slice(&(r.unit() * 0.05).to_le_bytes()),
            GgmlType::BF16 => {
                b.copy_from_slice(&bf16::from_f32(r.unit() * 4.0).to_bits().to_le_bytes())
            }
            _ => {}
        }
        out.extend_from_slice(&b);
    }
    out
}

/// Independent dequantization of one block, element by element, straight from the layout.
/// Returns (value, magnitude of the offset/min term) per element.
fn ref_block(ty: GgmlType, b: &[u8]) -> Vec<(f64, f64)> {
    let nib = |qs: &[u8], i: usize| -> u32 {
        if i < 16 {
            (qs[i] & 0x0F) as u32
        } else {
            (qs[i - 16] >> 4) as u32
        }
    };
    match ty {
        GgmlType::F32 => vec![(f32::from_le_bytes([b[0], b[1], b[2], b[3]]) as f64, 0.0)],
        GgmlType::F16 => vec![(h(b, 0), 0.0)],
        GgmlType::BF16 => vec![(
            f32::from_bits((u16::from_le_bytes([b[0], b[1]]) as u32) << 16) as f64,
            0.0,
        )],
        GgmlType::Q4_0 => (0..32)
            .map(|i| ((nib(&b[2..], i) as f64 - 8.0) * h(b, 0), 0.0))
            .collect(),
        GgmlType::Q4_1 => (0..32)
            .map(|i| (nib(&b[4..], i) as f64 * h(b, 0) + h(b, 2), h(b, 2).abs()))
            .collect(),
        GgmlType::Q5_0 | GgmlType::Q5_1 => {
            let one = ty == GgmlType::Q5_1;
            let qh_off = if one { 4 } else { 2 };
            let qh = u32::from_le_bytes(b[qh_off..qh_off + 4].try_into().unwrap());
            (0..32)
                .map(|i| {
                    let q = nib(&b[qh_off + 4..], i) | (((qh >> i) & 1) << 4);
                    if one {
                        (q as f64 * h(b, 0) + h(b, 2), h(b, 2).abs())
                    } else {
                        ((q as f64 - 16.0) * h(b, 0), 0.0)
                    }
                })
                .collect()
        }
        GgmlType::Q8_0 => (0..32)
            .map(|i| (b[2 + i] as i8 as f64 * h(b, 0), 0.0))
            .collect(),
        GgmlType::Q8_1 => (0..32)
            .map(|i| (b[4 + i] as i8 as f64 * h(b, 0), 0.0))
            .collect(),
        GgmlType::Q8_K => {
            let d = f32::from_le_bytes([b[0], b[1], b[2], b[3]]) as f64;
            (0..256).map(|i| (b[4 + i] as i8 as f64 * d, 0.0)).collect()
        }
        GgmlType::Q4_K | GgmlType::Q5_K => {
            let five = ty == GgmlType::Q5_K;
            let s = &b[4..16];
            let qs = if five { &b[48..176] } else { &b[16..144] };
            (0..256)
                .map(|i| {
                    let j = i / 32; // sub-block
                    let l = i % 32;
                    let byte = qs[32 * (j / 2) + l];
                    let mut q = if j % 2 == 0 { byte & 0x0F } else { byte >> 4 } as u32;
                    if five {
                        q |= (((b[16 + l] >> j) & 1) as u32) << 4;
                    }
                    // 6-bit scale and min of sub-block j.
                    let (sc, m) = if j < 4 {
                        (s[j] & 0x3F, s[j + 4] & 0x3F)
                    } else {
                        (
                            (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4),
                            (s[j + 4] >> 4) | ((s[j] >> 6) << 4),
                        )
                    };
                    let off = h(b, 2) * m as f64;
                    (h(b, 0) * sc as f64 * q as f64 - off, off.abs())
                })
                .collect()
        }
        GgmlType::Q6_K => {
            let d = h(b, 208);
            (0..256)
                .map(|i| {
                    let n = i / 128;
                    let g = (i % 128) / 32;
                    let l = i % 32;
                    let ql = b[64 * n + 32 * (g % 2) + l];
                    let lo = if g < 2 { ql & 0x0F } else { ql >> 4 };
                    let hi = (b[128 + 32 * n + l] >> (2 * g)) & 3;
                    let q = (lo | (hi << 4)) as i32 - 32;
                    let sc = b[192 + i / 16] as i8;
                    (d * sc as f64 * q as f64, 0.0)
                })
                .collect()
        }
    }
}

fn ref_dequant(ty: GgmlType, bytes: &[u8]) -> Vec<(f64, f64)> {
    bytes
        .chunks_exact(ty.block_bytes())
        .flat_map(|b| ref_block(ty, b))
        .collect()
}

fn check_dequant(ty: GgmlType, seed: u64, nblocks: usize) {
    let mut r = Rng(seed);
    let bytes = rand_blocks(ty, nblocks, &mut r);
    let n = nblocks * ty.block_len();
    let mut got = vec![0f32; n];
    quant::dequantize(ty, &bytes, &mut got).unwrap();
    let want = ref_dequant(ty, &bytes);
    for (i, (g, (w, off))) in got.iter().zip(&want).enumerate() {
        // f32 evaluation of d*sc*q - m: at most 3 roundings relative to the terms' size.
        let tol = 4.0 * f32::EPSILON as f64 * (w.abs() + 2.0 * off) + 1e-30;
        assert!(
            (*g as f64 - w).abs() <= tol,
            "{ty:?} element {i}: got {g}, want {w}"
        );
    }
}

/// Random weights (raw random blocks) and activations for a matmul test.
struct Case {
    ty: GgmlType,
    k: usize,
    rows: usize,
    n_tokens: usize,
    w: Vec<u8>,
    acts: QuantizedActivations,
}

fn make_case(ty: GgmlType, seed: u64) -> Case {
    let mut r = Rng(seed);
    let bl = ty.block_len().max(32);
    // One case in eight of a 32-element format has rows of more than 64 blocks (those the
    // AVX-512 prefill kernels decode per group of tokens rather than once).
    let blocks = match (bl, r.below(8)) {
        (256, _) => 1 + r.below(3),
        (_, 0) => 65 + r.below(4),
        _ => 1 + r.below(7),
    };
    let k = bl * blocks;
    // Up to 19 rows and 27 tokens: whole decode tiles (8 rows on AVX-512, 4 below), whole
    // prefill tiles (4 rows x 1 to 3 groups of 8 tokens on AVX-512) and tails of rows
    // and tokens not divisible by the tile.
    let rows = 1 + r.below(19);
    let n_tokens = 1 + r.below(27);
    let scale = [0.0, 1e-3, 1.0, 100.0][r.below(4)];
    random_case(ty, rows, k, n_tokens, scale, &mut r)
}

/// f64 reference dot products of the dequantized weights and dequantized activations, with
/// an error bound for each.
///
/// Tolerance: both sides use the same quantized integers and scales, so the only differences
/// are f32 rounding in the kernels (products of scales, conversion of block sums, and the
/// accumulation over `nb` blocks, or `k` values for F32/F16/BF16): bounded by
/// `(nb + 16) * eps_f32 * M`, where
/// `M = sum |a_i| * (|w_i| + |min term_i|)` bounds every partial sum. For Q4_1/Q5_1 the
/// Q8_1 block sum `s = sum(q) * d` is computed by llama.cpp from the f32 `d` before that is
/// rounded to f16, then stored as f16 itself; each of those roundings is at most 2^-11
/// relative or 2^-25 absolute (f16 subnormals), so the kernel's `m * s` differs from
/// `m * d_f16 * sum(q)` by up to `|m| * (|s| 2^-11 + 2^-25 + |sum(q)| max(|d| 2^-11, 2^-25))`.
fn reference(c: &Case) -> Vec<(f64, f64)> {
    let rb = quant::row_bytes(c.ty, c.k).unwrap();
    // Terms accumulated in f32: blocks, or single values for the plain float types.
    let nb = (c.k / c.ty.block_len()) as f64;
    let mut out = Vec::new();
    for row in c.w.chunks_exact(rb) {
        let wd = ref_dequant(c.ty, row);
        for t in 0..c.n_tokens {
            let (a, s_terms): (Vec<f64>, f64) = if quant::activation_type(c.ty) == GgmlType::F32 {
                (
                    c.acts.f32s()[t * c.k..(t + 1) * c.k]
                        .iter()
                        .map(|&v| v as f64)
                        .collect(),
                    0.0,
                )
            } else {
                let at = quant::activation_type(c.ty);
                let ab = c.acts.row(t).unwrap();
                let a: Vec<f64> = ref_dequant(at, ab).into_iter().map(|v| v.0).collect();
                let mut s_terms = 0.0;
                if at == GgmlType::Q8_1 {
                    for (bi, blk) in ab.chunks_exact(36).enumerate() {
                        let sq: i32 = blk[4..36].iter().map(|&q| q as i8 as i32).sum();
                        let d_err = (h(blk, 0).abs() * 2f64.powi(-11)).max(2f64.powi(-25));
                        let s_err = h(blk, 2).abs() * 2f64.powi(-11)
                            + 2f64.powi(-25)
                            + sq.abs() as f64 * d_err;
                        s_terms += wd[bi * 32].1 * s_err;
                    }
                }
                (a, s_terms)
            };
            let dot: f64 = wd.iter().zip(&a).map(|(w, a)| w.0 * a).sum();
            let m: f64 = wd
                .iter()
                .zip(&a)
                .map(|(w, a)| a.abs() * (w.0.abs() + w.1))
                .sum();
            let tol = (nb + 16.0) * f32::EPSILON as f64 * m + s_terms + 1e-30;
            out.push((dot, tol));
        }
    }
    out
}

/// A case of `rows` random weight rows of `k` values against `n_tokens` random
/// activations in [-scale, scale).
fn random_case(
    ty: GgmlType,
    rows: usize,
    k: usize,
    n_tokens: usize,
    scale: f32,
    r: &mut Rng,
) -> Case {
    let w = rand_blocks(ty, rows * k / ty.block_len(), r);
    let x: Vec<f32> = (0..n_tokens * k).map(|_| r.unit() * scale).collect();
    let mut acts = QuantizedActivations::new();
    quant::quantize_activations(ty, &x, n_tokens, k, &mut acts).unwrap();
    Case {
        ty,
        k,
        rows,
        n_tokens,
        w,
        acts,
    }
}

/// Positions for segments of `lens` tokens, in order, one slot in eight masked; and the
/// position after the last.
fn random_positions(r: &mut Rng, lens: &[usize]) -> (Vec<Vec<u32>>, u32) {
    let mut next = 0u32;
    let positions = lens
        .iter()
        .map(|&n| {
            (0..n)
                .map(|_| {
                    next += 1;
                    if r.below(8) == 0 {
                        MASKED_POSITION
                    } else {
                        next - 1
                    }
                })
                .collect()
        })
        .collect();
    (positions, next)
}

fn run(c: &Case, level: SimdLevel) -> Vec<f32> {
    let mut out = vec![f32::NAN; c.rows * c.n_tokens];
    quant::matmul_at(level, c.ty, &c.w, c.k, &c.acts, &mut out).unwrap();
    out
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn dequantize_matches_reference(seed in any::<u64>(), nblocks in 1usize..4) {
        for ty in GgmlType::ALL {
            check_dequant(ty, seed, nblocks);
        }
    }

    #[test]
    fn matmul_matches_f64_reference(seed in any::<u64>()) {
        for ty in WEIGHT_TYPES {
            let c = make_case(ty, seed ^ ty.id() as u64);
            let want = reference(&c);
            let got = run(&c, quant::current_simd_level());
            for (i, (g, (w, tol))) in got.iter().zip(&want).enumerate() {
                prop_assert!((*g as f64 - w).abs() <= *tol,
                    "{:?} k={} out[{}]: got {}, want {} (tol {})", ty, c.k, i, g, w, tol);
            }
            // The scalar vec_dot agrees with the reference too.
            let rb = quant::row_bytes(ty, c.k).unwrap();
            let v = quant::vec_dot(ty, &c.w[..rb], &c.acts, 0).unwrap();
            prop_assert!((v as f64 - want[0].0).abs() <= want[0].1);
        }
    }

    /// Every SIMD level agrees with the scalar kernels. Both compute each block's integer
    /// sum exactly. The quantized formats accumulate f32 in one order on every level (the
    /// 32-element ones in llama.cpp's, the K-quants superblock by superblock): there the
    /// results are the same bits. The float formats differ only in the f32 accumulation
    /// order, bounded by the same `(nb + 16) * eps_f32 * M` as above. The cases have 1 to 11
    /// rows and 1 to 27 tokens, so every tile shape and its tails are reached.
    #[test]
    fn simd_levels_agree_with_scalar(seed in any::<u64>()) {
        for ty in WEIGHT_TYPES {
            let c = make_case(ty, seed.rotate_left(7) ^ ty.id() as u64);
            let want = reference(&c);
            let scalar = run(&c, SimdLevel::Scalar);
            let same_order = !matches!(ty, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16);
            for level in quant::available_simd_levels() {
                let got = run(&c, level);
                if same_order {
                    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    prop_assert_eq!(bits(&got), bits(&scalar), "{:?} {:?}", ty, level);
                }
                for (i, ((g, s), (_, tol))) in got.iter().zip(&scalar).zip(&want).enumerate() {
                    prop_assert!((*g as f64 - *s as f64).abs() <= *tol,
                        "{:?} {:?} out[{}]: {} vs scalar {}", ty, level, i, g, s);
                }
            }
        }
    }

    /// Every SIMD level's attention (scores, online softmax, weighted sum of values)
    /// gives the scalar reference's bits: f32, f16 and int8 caches; head sizes the
    /// vector paths take (64, 128, 256) and one they leave to the reference (48); grouped
    /// heads; two segments; masked slots, future positions and a sliding window.
    #[test]
    fn attention_levels_agree_with_scalar(seed in any::<u64>()) {
        let mut r = Rng(seed);
        let hd = [64usize, 128, 256, 48][r.below(4)];
        let n_kv = 1 + r.below(3);
        let row_len = n_kv * hd;
        let lens = [r.below(40), 1 + r.below(40)];
        let dtype = r.below(3);
        // Values up to 8 in magnitude, so scores spread and the running maximum moves.
        let mut vals = |n: usize| (0..n).map(|_| 8.0 * r.unit()).collect::<Vec<f32>>();
        let data: Vec<(Vec<f32>, Vec<f32>)> =
            lens.iter().map(|&n| (vals(n * row_len), vals(n * row_len))).collect();
        let q = vals(hd);
        let f16s = |v: &[f32]| v.iter().map(|&x| half::f16::from_f32(x)).collect::<Vec<_>>();
        let q8s = |v: &[f32]| {
            let quants: Vec<i8> = v.iter().map(|&x| (x * 15.0) as i8).collect();
            let scales: Vec<half::f16> =
                (0..v.len().div_ceil(32)).map(|b| half::f16::from_f32(0.01 + b as f32 * 1e-3)).collect();
            (quants, scales)
        };
        let halves: Vec<_> = data.iter().map(|(k, v)| (f16s(k), f16s(v))).collect();
        let bytes: Vec<_> = data.iter().map(|(k, v)| (q8s(k), q8s(v))).collect();
        let (positions, next) = random_positions(&mut r, &lens);
        let rows = |s: usize, value: usize| match dtype {
            0 => KvRows::F32(if value == 0 { &data[s].0 } else { &data[s].1 }),
            1 => KvRows::F16(if value == 0 { &halves[s].0 } else { &halves[s].1 }),
            _ => {
                let (quants, scales) = if value == 0 { &bytes[s].0 } else { &bytes[s].1 };
                KvRows::Q8 { quants, scales }
            }
        };
        let segments = (0..2)
            .map(|s| KvSegment { keys: rows(s, 0), values: rows(s, 1), positions: &positions[s] })
            .collect();
        let view = KvView { segments };
        let window = if r.below(3) == 0 { 1 + r.below(20) as u32 } else { u32::MAX };
        let slot = HeadSlot { offset: r.below(n_kv) * hd, row_len, head_dim: hd, window };
        let q_pos = r.below(next as usize + 2) as u32;
        let scale = 1.0 / (hd as f32).sqrt();
        let mut tmp = Vec::new();
        let mut want = vec![f32::NAN; hd];
        attend_head_reference(&q, q_pos, &view, slot, scale, &mut tmp, &mut want);
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        // Query heads sharing the key/value head, computed together: each as alone.
        let group: Vec<Vec<f32>> = (0..1 + r.below(4))
            .map(|i| q.iter().map(|&x| x * (1.0 - 0.3 * i as f32)).collect())
            .collect();
        let group_want: Vec<Vec<f32>> = group
            .iter()
            .map(|g| {
                let mut o = vec![f32::NAN; hd];
                attend_head_reference(g, q_pos, &view, slot, scale, &mut tmp, &mut o);
                o
            })
            .collect();
        for level in quant::available_simd_levels() {
            let mut got = vec![f32::NAN; hd];
            attend_head_at(level, &q, q_pos, &view, slot, scale, &mut tmp, &mut got);
            prop_assert_eq!(bits(&got), bits(&want), "{:?} head_dim {} dtype {}", level, hd, dtype);
            let qs: Vec<&[f32]> = group.iter().map(|g| g.as_slice()).collect();
            let mut outs = vec![vec![f32::NAN; hd]; group.len()];
            let mut out_refs: Vec<&mut [f32]> = outs.iter_mut().map(|o| o.as_mut_slice()).collect();
            attend_heads_at(level, &qs, q_pos, &view, slot, scale, &mut tmp, &mut out_refs);
            for (i, (g, w)) in outs.iter().zip(&group_want).enumerate() {
                prop_assert_eq!(bits(g), bits(w), "{:?} head_dim {} dtype {} group head {}", level, hd, dtype, i);
            }
            // The partial of all the keys (llama.cpp's split decode on one thread):
            // the scalar statement's at every level, and merged alone it is the
            // output itself.
            let mut parts = vec![vec![f32::NAN; 2 + hd]; group.len()];
            let mut part_refs: Vec<&mut [f32]> = parts.iter_mut().map(|o| o.as_mut_slice()).collect();
            attend_heads_to(level, &qs, q_pos, &view, slot, scale, &mut tmp, &mut part_refs, Finish::Partial);
            for (i, (p, w)) in parts.iter().zip(&group_want).enumerate() {
                let mut want_part = vec![f32::NAN; 2 + hd];
                attend_heads_to(SimdLevel::Scalar, &[group[i].as_slice()], q_pos, &view, slot, scale, &mut tmp, &mut [want_part.as_mut_slice()], Finish::Partial);
                prop_assert_eq!(bits(p), bits(&want_part), "{:?} partial of group head {}", level, i);
                let mut merged = vec![f32::NAN; hd];
                merge_partials([p.as_slice()], &mut merged);
                prop_assert_eq!(bits(&merged), bits(w), "{:?} one partial merged, group head {}", level, i);
            }
        }
    }

    /// The tiled prompt attention (llama.cpp's order for batches of 64 queries and
    /// more) gives the scalar statement's bits at every level, for a block of queries
    /// computed together: f32 and f16 caches; head sizes the AVX2 path takes (64, 128,
    /// 256) and ones it leaves to the reference (40, 12); several tiles and a partial
    /// one; masked slots, future positions, sliding windows; scores spread far enough
    /// that weights underflow to subnormals and zero.
    #[test]
    fn tiled_attention_levels_agree_with_scalar(seed in any::<u64>()) {
        let mut r = Rng(seed);
        let hd = [64usize, 128, 256, 40, 12][r.below(5)];
        let n_kv = 1 + r.below(2);
        let row_len = n_kv * hd;
        let lens = [r.below(100), 1 + r.below(120)];
        let half = r.below(2) == 1;
        let spread = [8.0f32, 40.0][r.below(2)];
        let n_q = 1 + r.below(6);
        let mut vals = |n: usize| (0..n).map(|_| spread * r.unit()).collect::<Vec<f32>>();
        let data: Vec<(Vec<f32>, Vec<f32>)> =
            lens.iter().map(|&n| (vals(n * row_len), vals(n * row_len))).collect();
        let queries: Vec<Vec<f32>> = (0..n_q).map(|_| vals(hd)).collect();
        let f16s = |v: &[f32]| v.iter().map(|&x| f16::from_f32(x)).collect::<Vec<_>>();
        let halves: Vec<_> = data.iter().map(|(k, v)| (f16s(k), f16s(v))).collect();
        let (positions, next) = random_positions(&mut r, &lens);
        let rows = |s: usize, value: usize| match (half, value) {
            (false, 0) => KvRows::F32(&data[s].0),
            (false, _) => KvRows::F32(&data[s].1),
            (true, 0) => KvRows::F16(&halves[s].0),
            (true, _) => KvRows::F16(&halves[s].1),
        };
        let segments = (0..2)
            .map(|s| KvSegment { keys: rows(s, 0), values: rows(s, 1), positions: &positions[s] })
            .collect();
        let view = KvView { segments };
        let window = if r.below(3) == 0 { 1 + r.below(80) as u32 } else { u32::MAX };
        let slot = HeadSlot { offset: r.below(n_kv) * hd, row_len, head_dim: hd, window };
        let q_pos: Vec<u32> = (0..n_q).map(|_| r.below(next as usize + 2) as u32).collect();
        let scale = 1.0 / (hd as f32).sqrt();
        let mut tmp = Vec::new();
        let want: Vec<Vec<f32>> = (0..n_q)
            .map(|i| {
                let mut o = vec![f32::NAN; hd];
                attend_tiled_reference(&queries[i], q_pos[i], &view, slot, scale, &mut tmp, &mut o);
                o
            })
            .collect();
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        let mut scratch = BlockScratch::default();
        for level in quant::available_simd_levels() {
            let mut got = vec![vec![f32::NAN; hd]; n_q];
            let qs: Vec<&[f32]> = queries.iter().map(|q| q.as_slice()).collect();
            let mut outs: Vec<&mut [f32]> = got.iter_mut().map(|o| o.as_mut_slice()).collect();
            attend_block(level, &qs, &q_pos, &view, slot, scale, &mut scratch, &mut outs);
            for i in 0..n_q {
                prop_assert_eq!(bits(&got[i]), bits(&want[i]),
                    "{:?} head_dim {} half {} query {}", level, hd, half, i);
            }
        }
    }

    /// Every SIMD level's SwiGLU gives the scalar statement's bits, over gates of every
    /// size the model sees (and saturating ones), with tails shorter than a vector.
    #[test]
    fn swiglu_levels_agree_with_scalar(seed in any::<u64>()) {
        let mut r = Rng(seed);
        let n = r.below(300);
        let gate: Vec<f32> = (0..n).map(|_| r.unit() * [1.0, 20.0, 200.0][r.below(3)]).collect();
        let up: Vec<f32> = (0..n).map(|_| r.unit() * 4.0).collect();
        let mut want = vec![f32::NAN; n];
        swiglu_at(SimdLevel::Scalar, &gate, &up, &mut want);
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        for level in quant::available_simd_levels() {
            let mut got = vec![f32::NAN; n];
            swiglu_at(level, &gate, &up, &mut got);
            prop_assert_eq!(bits(&got), bits(&want), "{:?}", level);
        }
    }

    /// The token-major product (the CPU backend's batch path) holds the same bits as
    /// `matmul`, transposed, and writes nothing outside its rows.
    #[test]
    fn token_major_matmul_is_the_transpose(seed in any::<u64>()) {
        for ty in WEIGHT_TYPES {
            let c = make_case(ty, seed.rotate_left(11) ^ ty.id() as u64);
            let want = run(&c, quant::current_simd_level());
            // Two padding columns on each side of the rows.
            let ld = c.rows + 4;
            let mut out = vec![f32::NAN; c.n_tokens * ld];
            // SAFETY: every (t, r) lands at t * ld + 2 + r < out.len(), written by this
            // thread alone.
            unsafe {
                quant::matmul_token_major(c.ty, &c.w, c.k, &c.acts, out.as_mut_ptr().add(2), ld)
                    .unwrap()
            };
            for t in 0..c.n_tokens {
                for j in 0..ld {
                    let got = out[t * ld + j];
                    if (2..2 + c.rows).contains(&j) {
                        let w = want[(j - 2) * c.n_tokens + t];
                        prop_assert_eq!(got.to_bits(), w.to_bits(), "{:?} t={} r={}", ty, t, j - 2);
                    } else {
                        prop_assert!(got.is_nan(), "{:?} wrote padding at t={} j={}", ty, t, j);
                    }
                }
            }
        }
    }

    /// `quantize_activations` at every SIMD level gives exactly the bytes of the rule
    /// llama.cpp's x86 activation quantizers follow (see `x86_activation_reference`),
    /// including on ties (multiples of d / 2), and the same block scales (a dot product
    /// that reads them gives the same bits). Some blocks are all zeros, some hold a ±0
    /// and a repeated largest magnitude of both signs (Q8_K's scale takes the sign of
    /// the first), some are half-integers under an amax of 127 (ties at every other
    /// value).
    #[test]
    fn activation_quantization_matches_reference(seed in any::<u64>()) {
        let mut r = Rng(seed);
        for weight in [GgmlType::Q8_0, GgmlType::Q4_1, GgmlType::Q6_K] {
            let at = quant::activation_type(weight);
            let k = 256 * (1 + r.below(3));
            let n = 1 + r.below(4);
            let scale = [1e-6f32, 1e-3, 1.0, 1e4][r.below(4)];
            let mut x: Vec<f32> = (0..n * k)
                .map(|_| match r.below(3) {
                    // Halves of the integer grid of an amax = 127 block: exact ties.
                    0 => (r.below(255) as f32 - 127.0) * 0.5,
                    _ => r.unit() * scale,
                })
                .collect();
            let bl = if at == GgmlType::Q8_K { 256 } else { 32 };
            for block in x.chunks_exact_mut(bl) {
                match r.below(8) {
                    0 => block.fill(0.0),
                    1 => {
                        let m = 2.0 * scale;
                        block[r.below(bl)] = m;
                        block[r.below(bl)] = -m;
                        block[r.below(bl)] = -0.0;
                    }
                    // Amax 127, so the scale is 1 and every half-integer is a tie.
                    2 => {
                        for v in block.iter_mut() {
                            *v = (r.below(509) as f32 - 254.0) * 0.5;
                        }
                        block[r.below(bl)] = 127.0;
                    }
                    _ => {}
                }
            }
            let want = if at == GgmlType::Q8_K {
                quant::quantize(at, &x).unwrap()
            } else {
                x86_activation_reference(at, &x)
            };
            let w = quant::quantize(weight, &vec![0.37f32; k]).unwrap();
            let mut scalar = QuantizedActivations::new();
            quant::quantize_activations_at(SimdLevel::Scalar, weight, &x, n, k, &mut scalar)
                .unwrap();
            for level in quant::available_simd_levels() {
                let mut acts = QuantizedActivations::new();
                quant::quantize_activations_at(level, weight, &x, n, k, &mut acts).unwrap();
                prop_assert_eq!(acts.bytes(), &want[..], "{:?} {:?}", weight, level);
                for t in 0..n {
                    let got = quant::vec_dot(weight, &w, &acts, t).unwrap();
                    let exp = quant::vec_dot(weight, &w, &scalar, t).unwrap();
                    prop_assert_eq!(got.to_bits(), exp.to_bits(), "{:?} {:?}", weight, level);
                }
            }
        }
    }

    #[test]
    fn round_trip_error_is_bounded(seed in any::<u64>()) {
        let mut r = Rng(seed);
        for ty in GgmlType::ALL {
            let bl = ty.block_len().max(32);
            let n = bl * (1 + r.below(3));
            let scale = [1e-3f32, 1.0, 50.0][r.below(3)];
            let x: Vec<f32> = (0..n).map(|_| r.unit() * scale).collect();
            let q = quant::quantize(ty, &x).unwrap();
            let mut y = vec![0f32; n];
            quant::dequantize(ty, &q, &mut y).unwrap();
            for (xb, yb) in x.chunks(bl).zip(y.chunks(bl)) {
                let amax = xb.iter().fold(0f32, |a, v| a.max(v.abs()));
                let (lo, hi) = xb.iter().fold((f32::MAX, f32::MIN), |(a, b), &v| (a.min(v), b.max(v)));
                let range = hi - lo;
                // Half a quantization step (a whole one where llama.cpp's Q4_0/Q5_0 clamp the
                // top level), plus the f16 rounding of the scale (2^-11 relative, times up to
                // the number of levels); `abs` covers f16 scales/mins that fall in the
                // subnormal range (2^-25 absolute error, times up to 127 levels, plus the min).
                // The K-quants also quantize their sub-block scales/mins to 6 or 8 bits, and a
                // subnormal super-block scale errs by 2^-25 times (scale * quant) levels.
                let kabs = |levels: f32| levels * 2f32.powi(-25);
                let abs = 130.0 * 2f32.powi(-25);
                let bound = match ty {
                    GgmlType::F32 => 0.0,
                    GgmlType::F16 => amax * 1e-3,
                    GgmlType::BF16 => amax * 8e-3,
                    GgmlType::Q4_0 => amax / 8.0 * 1.01 + abs,
                    GgmlType::Q4_1 => range / 30.0 * 1.02 + amax * 1e-3 + abs,
                    GgmlType::Q5_0 => amax / 16.0 * 1.01 + abs,
                    GgmlType::Q5_1 => range / 62.0 * 1.04 + amax * 1e-3 + abs,
                    GgmlType::Q8_0 | GgmlType::Q8_1 => amax / 254.0 * 1.13 + abs,
                    GgmlType::Q8_K => amax / 254.0 * 1.01,
                    GgmlType::Q4_K => amax * 0.15 + kabs(63.0 * 16.0),
                    GgmlType::Q5_K => amax * 0.08 + kabs(63.0 * 32.0),
                    GgmlType::Q6_K => amax * 0.04 + kabs(128.0 * 32.0),
                };
                for (a, b) in xb.iter().zip(yb) {
                    prop_assert!((a - b).abs() <= bound + 1e-30, "{:?}: {} -> {} (bound {})", ty, a, b, bound);
                }
            }
        }
    }
}

/// llama.cpp's x86 `quantize_row_q8_0` / `quantize_row_q8_1`, written from its
/// description: `d = amax / 127` stored as f16, `q = round_half_even(x * (127 / amax))`,
/// and for Q8_1 `s = f16(d * sum(q))`.
fn x86_activation_reference(ty: GgmlType, x: &[f32]) -> Vec<u8> {
    let mut out = Vec::new();
    for block in x.chunks(32) {
        let amax = block.iter().fold(0f32, |a, v| a.max(v.abs()));
        let d = amax / 127.0;
        let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
        let q: Vec<i8> = block
            .iter()
            .map(|v| (v * id).round_ties_even() as i8)
            .collect();
        out.extend_from_slice(&f16::from_f32(d).to_le_bytes());
        if ty == GgmlType::Q8_1 {
            let sum: i32 = q.iter().map(|&v| v as i32).sum();
            out.extend_from_slice(&f16::from_f32(d * sum as f32).to_le_bytes());
        }
        out.extend(q.iter().map(|&v| v as u8));
    }
    out
}

#[test]
fn activation_rounding_is_llama_cpp_x86_half_to_even() {
    let mut x = vec![0f32; 32];
    x[..8].copy_from_slice(&[127.0, 63.5, -63.5, 0.5, -0.5, 2.5, -2.5, 1.49]);
    for weight in [GgmlType::Q8_0, GgmlType::Q4_1] {
        let mut acts = QuantizedActivations::new();
        quant::quantize_activations(weight, &x, 1, 32, &mut acts).unwrap();
        let off = if weight == GgmlType::Q4_1 { 4 } else { 2 };
        let qs: Vec<i8> = acts.bytes()[off..off + 8]
            .iter()
            .map(|&b| b as i8)
            .collect();
        assert_eq!(qs, [127, 64, -64, 0, 0, 2, -2, 1], "{weight:?}");
    }
}

#[test]
fn q8_rounding_matches_llama_cpp() {
    // Q8_0: d = amax / 127 = 1, q = roundf(x / d): ties away from zero.
    let mut x = vec![0f32; 32];
    x[..8].copy_from_slice(&[127.0, 63.5, -63.5, 0.5, -0.5, 2.5, -2.5, 1.49]);
    let q = quant::quantize(GgmlType::Q8_0, &x).unwrap();
    assert_eq!(
        f16::from_bits(u16::from_le_bytes([q[0], q[1]])).to_f32(),
        1.0
    );
    let qs: Vec<i8> = q[2..10].iter().map(|&b| b as i8).collect();
    assert_eq!(qs, [127, 64, -64, 1, -1, 3, -3, 1]);

    // Q8_1: same rounding, s = f16(sum(q) * d).
    let q = quant::quantize(GgmlType::Q8_1, &x).unwrap();
    let qs: Vec<i8> = q[4..12].iter().map(|&b| b as i8).collect();
    assert_eq!(qs, [127, 64, -64, 1, -1, 3, -3, 1]);
    assert_eq!(
        f16::from_bits(u16::from_le_bytes([q[2], q[3]])).to_f32(),
        128.0
    );

    // Zero blocks: d = 0 and zero quants.
    let z = quant::quantize(GgmlType::Q8_0, &[0f32; 32]).unwrap();
    assert!(z.iter().all(|&b| b == 0));
    let z = quant::quantize(GgmlType::Q8_1, &[0f32; 32]).unwrap();
    assert!(z.iter().all(|&b| b == 0));
    let z = quant::quantize(GgmlType::Q8_K, &[0f32; 256]).unwrap();
    assert!(z.iter().all(|&b| b == 0));

    // Q8_K: iscale = -127 / max (signed max), q = nearest_int (ties to even), d = 1 / iscale.
    let mut x = vec![0f32; 256];
    x[..6].copy_from_slice(&[-127.0, 2.5, 3.5, -2.5, 0.5, 1.5]);
    let q = quant::quantize(GgmlType::Q8_K, &x).unwrap();
    assert_eq!(f32::from_le_bytes([q[0], q[1], q[2], q[3]]), 1.0);
    let qs: Vec<i8> = q[4..10].iter().map(|&b| b as i8).collect();
    assert_eq!(qs, [-127, 2, 4, -2, 0, 2]);
    let bsum0 = i16::from_le_bytes([q[260], q[261]]);
    assert_eq!(bsum0, -127 + 2 + 4 - 2 + 2);
    // Positive max: iscale = -1, so the quants flip sign and d = -1.
    let mut x = vec![0f32; 256];
    x[..3].copy_from_slice(&[127.0, 2.5, -3.5]);
    let q = quant::quantize(GgmlType::Q8_K, &x).unwrap();
    assert_eq!(f32::from_le_bytes([q[0], q[1], q[2], q[3]]), -1.0);
    let qs: Vec<i8> = q[4..7].iter().map(|&b| b as i8).collect();
    assert_eq!(qs, [-127, -2, 4]);

    // quantize_activations produces the same bytes as quantize.
    let x: Vec<f32> = (0..64).map(|i| (i as f32 - 31.5) * 0.25).collect();
    let mut acts = QuantizedActivations::new();
    quant::quantize_activations(GgmlType::Q4_1, &x, 2, 32, &mut acts).unwrap();
    assert_eq!(
        acts.bytes(),
        &quant::quantize(GgmlType::Q8_1, &x).unwrap()[..]
    );
    quant::quantize_activations(GgmlType::Q4_K, &vec![0.5; 256], 1, 256, &mut acts).unwrap();
    assert_eq!(
        acts.bytes(),
        &quant::quantize(GgmlType::Q8_K, &[0.5; 256]).unwrap()[..]
    );
}

#[test]
fn malformed_input_gives_errors() {
    use ballast_runtime::error::Error;
    let mut dst = vec![0f32; 32];
    assert!(matches!(
        quant::dequantize(GgmlType::Q4_1, &[0u8; 19], &mut dst),
        Err(Error::QuantLength { .. })
    ));
    assert!(matches!(
        quant::dequantize(GgmlType::Q4_1, &[0u8; 21], &mut dst),
        Err(Error::QuantLength { .. })
    ));
    let mut dst = vec![0f32; 33];
    assert!(matches!(
        quant::dequantize(GgmlType::Q4_1, &[0u8; 20], &mut dst),
        Err(Error::QuantBlockAlign { .. })
    ));
    assert!(quant::dequantize(GgmlType::Q4_K, &[], &mut []).is_ok());
    assert!(matches!(
        quant::quantize(GgmlType::Q6_K, &[0.0; 100]),
        Err(Error::QuantBlockAlign { .. })
    ));
    assert!(matches!(
        quant::row_bytes(GgmlType::Q8_0, 0),
        Err(Error::QuantEmptyRow)
    ));
    assert!(matches!(
        quant::row_bytes(GgmlType::Q8_0, usize::MAX - 31),
        Err(Error::QuantValueCount { .. })
    ));
    let mut acts0 = QuantizedActivations::new();
    assert!(
        quant::quantize_activations(GgmlType::Q8_0, &[0.0; 32], usize::MAX, 64, &mut acts0)
            .is_err()
    );
    assert!(matches!(
        quant::row_bytes(GgmlType::Q8_0, 40),
        Err(Error::QuantBlockAlign { .. })
    ));

    let mut acts = QuantizedActivations::new();
    assert!(quant::quantize_activations(GgmlType::Q4_1, &[0.0; 63], 2, 32, &mut acts).is_err());
    assert!(quant::quantize_activations(GgmlType::Q4_K, &[0.0; 64], 2, 32, &mut acts).is_err());
    assert!(quant::quantize_activations(GgmlType::Q8_1, &[0.0; 32], 1, 32, &mut acts).is_err());
    quant::quantize_activations(GgmlType::Q4_1, &[0.5; 128], 2, 64, &mut acts).unwrap();

    let w = vec![0u8; 2 * 40];
    let mut out = vec![0f32; 4];
    quant::matmul(GgmlType::Q4_1, &w, 64, &acts, &mut out).unwrap();
    assert!(matches!(
        quant::matmul(GgmlType::Q4_1, &w[..79], 64, &acts, &mut out),
        Err(Error::QuantRowBytes { .. })
    ));
    assert!(matches!(
        quant::matmul(GgmlType::Q4_1, &w, 64, &acts, &mut out[..3]),
        Err(Error::QuantValueCount { .. })
    ));
    assert!(matches!(
        quant::matmul(GgmlType::Q4_1, &w, 32, &acts, &mut [0.0; 8]),
        Err(Error::QuantActivationK { .. })
    ));
    assert!(matches!(
        quant::matmul(GgmlType::Q4_0, &w, 64, &acts, &mut out),
        Err(Error::QuantActivationType { .. })
    ));
    assert!(matches!(
        quant::matmul(GgmlType::Q8_K, &w, 64, &acts, &mut out),
        Err(Error::QuantUnsupported { .. })
    ));
    assert!(quant::matmul(GgmlType::Q4_1, &w, 0, &acts, &mut out).is_err());
    assert!(quant::vec_dot(GgmlType::Q4_1, &w[..39], &acts, 0).is_err());
    assert!(matches!(
        quant::vec_dot(GgmlType::Q4_1, &w[..40], &acts, 2),
        Err(Error::QuantTokenIndex { .. })
    ));
    assert!(quant::vec_dot(GgmlType::Q4_1, &w[..40], &acts, 1).is_ok());
    assert!(acts.row(2).is_err());
    for level in quant::available_simd_levels() {
        assert!(quant::matmul_at(level, GgmlType::Q4_1, &w[..41], 64, &acts, &mut out).is_err());
    }
}

#[test]
fn simd_level_is_reported() {
    let name = quant::simd_level();
    assert!(["scalar", "avx2", "avx512", "neon"].contains(&name));
    assert!(quant::current_simd_level().is_supported());
}

/// The default model's shapes (k = 576 and 1536) and Qwen2.5-0.5B's (k = 896 and 4864),
/// with several row and token tails, through every level: against the f64 reference with
/// the same bound as the proptests, and bit for bit against the scalar kernels for the
/// quantized formats.
#[test]
fn model_shapes_agree_across_levels() {
    let mut r = Rng(42);
    for ty in [
        GgmlType::Q4_1,
        GgmlType::Q8_0,
        GgmlType::Q4_0,
        GgmlType::Q5_0,
        GgmlType::Q5_1,
        GgmlType::Q4_K,
        GgmlType::Q5_K,
        GgmlType::Q6_K,
    ] {
        let shapes = [
            (9, 576, 1),
            (7, 576, 7),
            (5, 1536, 1),
            (3, 1536, 9),
            (7, 896, 1),
            (5, 896, 6),
            (6, 4864, 1),
            (3, 4864, 5),
            (9, 896, 24),
            (5, 2080, 17),
        ];
        for (rows, k, n) in shapes {
            if k % ty.block_len() != 0 {
                continue;
            }
            let c = random_case(ty, rows, k, n, 1.0, &mut r);
            let want = reference(&c);
            let scalar = run(&c, SimdLevel::Scalar);
            for level in quant::available_simd_levels() {
                let got = run(&c, level);
                for (i, (g, (w, tol))) in got.iter().zip(&want).enumerate() {
                    assert!(
                        (*g as f64 - w).abs() <= *tol,
                        "{ty:?} {level:?} {rows}x{k} n={n} out[{i}]: {g} vs {w}"
                    );
                    assert_eq!(
                        g.to_bits(),
                        scalar[i].to_bits(),
                        "{ty:?} {level:?} {rows}x{k} n={n} out[{i}]: {g} vs scalar {}",
                        scalar[i]
                    );
                }
            }
        }
    }
}

/// A batch longer than the block of tokens the kernels keep in L2 (256 KiB of
/// activations: 896 tokens of a 256-wide Q8_K row, 960 of Q8_0, 904 of Q8_1, 256 of
/// f32) is computed block by block: every output is still there, right to the f64
/// reference, and each level's bits still equal the scalar kernels'. The lengths give
/// each activation type a last block of one token (which once got the decode tile) and
/// one of many.
#[test]
fn batches_longer_than_a_block_of_tokens() {
    for (ty, n_tokens) in WEIGHT_TYPES
        .into_iter()
        .flat_map(|ty| [257, 897, 905, 961, 1100].map(|n| (ty, n)))
    {
        let mut r = Rng(0x5eed ^ ty.id() as u64 ^ n_tokens as u64);
        let (k, rows) = (256, 9);
        let c = random_case(ty, rows, k, n_tokens, 1.0, &mut r);
        let want = reference(&c);
        let scalar = run(&c, SimdLevel::Scalar);
        let same_order = !matches!(ty, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16);
        for level in quant::available_simd_levels() {
            let got = run(&c, level);
            for (i, (g, (w, tol))) in got.iter().zip(&want).enumerate() {
                assert!(
                    (*g as f64 - w).abs() <= *tol,
                    "{ty:?} {level:?} out[{i}]: got {g}, want {w} (tol {tol})"
                );
            }
            if same_order {
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&got), bits(&scalar), "{ty:?} {level:?}");
            }
        }
        // The backend's token-major product (its tiles go through a buffer) gives the
        // same bits as the row-major one at the level in use.
        let row_major = run(&c, quant::current_simd_level());
        let mut token_major = vec![f32::NAN; rows * n_tokens];
        // SAFETY: `token_major` holds rows x n_tokens values at stride `rows`, and no
        // other thread sees it.
        unsafe { quant::matmul_token_major(ty, &c.w, k, &c.acts, token_major.as_mut_ptr(), rows) }
            .unwrap();
        for r in 0..rows {
            for t in 0..n_tokens {
                assert_eq!(
                    token_major[t * rows + r].to_bits(),
                    row_major[r * n_tokens + t].to_bits(),
                    "{ty:?} row {r} token {t} of {n_tokens}"
                );
            }
        }
    }
}
