//! x86-64 kernels: AVX2 (+FMA, F16C) and AVX-512 (F/BW/VL/DQ + VNNI).
//!
//! All kernels compute each block's integer dot product exactly (no saturation for
//! activations produced by [`super::quantize_activations`], whose quants lie in
//! -127..=127) and differ from the scalar path only in the order of f32 accumulation.
//!
//! This file holds what every level shares: CPU feature detection, the dispatch tables
//! ([`kernel_avx2`], [`kernel_avx512`], [`wide_avx512`]), the [`TileFn`] plumbing
//! (`tile_fn!`, [`by_4_tokens`]) and the helpers both levels call (horizontal sum, f16
//! loads, [`prefetch_tile_ahead`], [`k4_scales_mins`]). The kernels live one idea a file:
//!
//! - [`avx2`]: the AVX2 tiles, 32-element formats, K-quants and float weights;
//! - [`avx2_wide`]: the AVX2 prefill kernels of Q8_0, Q4_0 and Q5_0 (rows decoded once,
//!   packed token groups);
//! - [`avx512`]: the AVX-512 tiles of the 32-element formats, decode pairs and the wide
//!   prefill kernels;
//! - [`avx512_k`]: the AVX-512 K-quant tiles (superblock decode, rows, prefill tile);
//! - [`k_wide`]: the K-quant prefill of whole groups of 8 packed tokens, AVX-512 and
//!   AVX2 (a sub-block's products summed in 16 bits before its scale);
//! - [`activations`]: quantizing f32 activations to Q8_0 / Q8_1 / Q8_K;
//! - [`axpy`]: the sparse MLP's neuron axpy over Q8_0 rows.

mod activations;
mod avx2;
mod avx2_wide;
mod avx512;
mod avx512_k;
mod axpy;
mod k_wide;

pub(crate) use activations::{quantize_q8_avx2, quantize_q8_k_avx2};
pub(crate) use axpy::{axpy_q8_0_avx2, axpy_q8_0_avx512};

use super::{QuantizedActivations, TileFn, WideFn, PACK_TOKENS};
use crate::ggml_type::GgmlType;
use std::arch::x86_64::*;

pub(crate) fn has_avx2() -> bool {
    is_x86_feature_detected!("avx2")
        && is_x86_feature_detected!("fma")
        && is_x86_feature_detected!("f16c")
}

pub(crate) fn has_avx512() -> bool {
    has_avx2()
        && is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx512bw")
        && is_x86_feature_detected!("avx512vl")
        && is_x86_feature_detected!("avx512dq")
        && is_x86_feature_detected!("avx512vnni")
}

pub(crate) fn kernel_avx2(ty: GgmlType) -> Option<TileFn> {
    Some(match ty {
        GgmlType::Q4_0 => avx2_wide::tile_q4_0_avx2,
        GgmlType::Q4_1 => avx2_wide::tile_q4_1_avx2,
        GgmlType::Q8_0 => avx2_wide::tile_q8_0_avx2,
        GgmlType::Q5_0 => avx2_wide::tile_q5_0_avx2,
        GgmlType::Q5_1 => avx2_wide::tile_q5_1_avx2,
        GgmlType::Q4_K => k_wide::tile_q4_k_avx2,
        GgmlType::Q5_K => k_wide::tile_q5_k_avx2,
        GgmlType::Q6_K => k_wide::tile_q6_k_avx2,
        GgmlType::F32 => avx2::float_tile::<0>,
        GgmlType::F16 => avx2::float_tile::<1>,
        GgmlType::BF16 => avx2::float_tile::<2>,
        _ => return None,
    })
}

pub(crate) fn kernel_avx512(ty: GgmlType) -> Option<TileFn> {
    Some(match ty {
        GgmlType::Q4_0 => avx512::tile_q4_0_avx512,
        GgmlType::Q4_1 => avx512::tile_q4_1_avx512,
        GgmlType::Q8_0 => avx512::tile_q8_0_avx512,
        GgmlType::Q5_0 => avx512::tile_q5_0_avx512,
        GgmlType::Q5_1 => avx512::tile_q5_1_avx512,
        GgmlType::Q4_K => k_wide::tile_q4_k_avx512,
        GgmlType::Q5_K => k_wide::tile_q5_k_avx512,
        GgmlType::Q6_K => k_wide::tile_q6_k_avx512,
        _ => return None,
    })
}

/// The prefill kernel writing 4 rows x whole groups of 8 tokens through a [`TileOut`]
/// (what `matmul_token_major` calls for those tiles, so results go straight to the
/// batch's layout), for the types that have one.
pub(crate) fn wide_avx512(ty: GgmlType) -> Option<WideFn> {
    Some(match ty {
        GgmlType::Q4_0 => avx512::wide_q4_0_avx512,
        GgmlType::Q4_1 => avx512::wide_q4_1_avx512,
        GgmlType::Q8_0 => avx512::wide_q8_0_avx512,
        GgmlType::Q5_0 => avx512::wide_q5_0_avx512,
        GgmlType::Q5_1 => avx512::wide_q5_1_avx512,
        GgmlType::Q4_K => k_wide::wide_q4_k_avx512,
        GgmlType::Q5_K => k_wide::wide_q5_k_avx512,
        GgmlType::Q6_K => k_wide::wide_q6_k_avx512,
        _ => return None,
    })
}

/// The AVX2 prefill kernel writing up to 16 rows x whole groups of 8 tokens through a
/// [`TileOut`](crate::quant::TileOut), for the types that have one.
pub(crate) fn wide_avx2(ty: GgmlType) -> Option<WideFn> {
    Some(match ty {
        GgmlType::Q4_0 => avx2_wide::wide_q4_0_avx2,
        GgmlType::Q8_0 => avx2_wide::wide_q8_0_avx2,
        GgmlType::Q5_0 => avx2_wide::wide_q5_0_avx2,
        GgmlType::Q4_1 => avx2_wide::wide_q4_1_avx2,
        GgmlType::Q5_1 => avx2_wide::wide_q5_1_avx2,
        GgmlType::Q4_K => k_wide::wide_q4_k_avx2,
        GgmlType::Q5_K => k_wide::wide_q5_k_avx2,
        GgmlType::Q6_K => k_wide::wide_q6_k_avx2,
        _ => return None,
    })
}

/// Whether tokens `t0..t0 + nt` are whole groups of 8, what the wide kernels take.
fn whole_groups(t0: usize, nt: usize) -> bool {
    nt >= PACK_TOKENS && nt % PACK_TOKENS == 0 && t0 % PACK_TOKENS == 0
}

/// Expands a [`TileFn`] that hands a tile to the wide kernel `$wide` (a [`WideFn`]) where
/// it takes it, and otherwise to `$narrow`, the tokens split into groups of at most 4.
macro_rules! wide_or_narrow {
    ($name:ident, $wide:ident, $narrow:ident) => {
        /// # Safety
        /// The CPU must support the kernels' features; `w` and `acts` must be validated.
        pub(super) unsafe fn $name(
            w: &[u8],
            rb: usize,
            acts: &$crate::quant::QuantizedActivations,
            t0: usize,
            nt: usize,
            out: &mut [f32],
            stride: usize,
        ) {
            let rr = w.len() / rb;
            if rr > 0 && out.len() >= (rr - 1) * stride + nt {
                let tile = $crate::quant::TileOut {
                    ptr: out.as_mut_ptr(),
                    rs: stride,
                    ts: 1,
                };
                // SAFETY: forwarded from the caller; every result lands in `out`
                // (checked just above).
                if unsafe { $wide(w, rb, acts, t0, nt, tile) } {
                    return;
                }
            }
            // SAFETY: forwarded from the caller.
            unsafe { $crate::quant::x86::by_4_tokens($narrow, w, rb, acts, t0, nt, out, stride) }
        }
    };
}

use wide_or_narrow;

/// Pointers to the bytes and f32 scales of tokens `t0..t0 + NT`.
#[inline(always)]
fn act_ptrs<const NT: usize>(
    acts: &QuantizedActivations,
    t0: usize,
) -> ([*const u8; NT], [*const f32; NT]) {
    let mut a = [std::ptr::null(); NT];
    let mut s = [std::ptr::null(); NT];
    for i in 0..NT {
        let (b, sc, _) = acts.parts(t0 + i);
        a[i] = b.as_ptr();
        s[i] = sc.as_ptr();
    }
    (a, s)
}

/// Expands a tile kernel generic over rows and tokens into a [`TileFn`]:
/// `tile_fn!(name, kernel, [extra const arguments], block bytes)` calls
/// `kernel::<RR, NT, extra..>` on each tile shape it has (a kernel generic over a format
/// too, as `q41_like_avx2::<RR, NT, FIVE>`, gets one tile per format without a wrapper).
macro_rules! tile_fn {
    ($name:ident, $kern:ident, [$($extra:tt),*], $bb:expr) => {
        /// # Safety
        /// The CPU must support the kernel's features; `w` and `acts` must be validated.
        pub(super) unsafe fn $name(
            w: &[u8],
            rb: usize,
            acts: &$crate::quant::QuantizedActivations,
            t0: usize,
            nt: usize,
            out: &mut [f32],
            stride: usize,
        ) {
            #[inline(always)]
            unsafe fn run<const RR: usize, const NT: usize>(
                w: &[u8],
                rb: usize,
                acts: &$crate::quant::QuantizedActivations,
                t0: usize,
                out: &mut [f32],
                stride: usize,
            ) {
                let mut wp = [std::ptr::null(); RR];
                for (i, p) in wp.iter_mut().enumerate() {
                    *p = w[i * rb..].as_ptr();
                }
                let (a, s) = $crate::quant::x86::act_ptrs::<NT>(acts, t0);
                // SAFETY: forwarded from the caller.
                let res = unsafe { $kern::<RR, NT $(, $extra)*>(wp, rb / $bb, a, s) };
                for (i, row) in res.iter().enumerate() {
                    out[i * stride..i * stride + NT].copy_from_slice(row);
                }
            }
            let rr = w.len() / rb;
            // SAFETY: forwarded from the caller.
            unsafe {
                match (rr, nt) {
                    (8, 1) => run::<8, 1>(w, rb, acts, t0, out, stride),
                    (4, 1) => run::<4, 1>(w, rb, acts, t0, out, stride),
                    (1, 8) => run::<1, 8>(w, rb, acts, t0, out, stride),
                    (2, 4) => run::<2, 4>(w, rb, acts, t0, out, stride),
                    (1, 4) => run::<1, 4>(w, rb, acts, t0, out, stride),
                    (1, 3) => run::<1, 3>(w, rb, acts, t0, out, stride),
                    (1, 2) => run::<1, 2>(w, rb, acts, t0, out, stride),
                    (1, 1) => run::<1, 1>(w, rb, acts, t0, out, stride),
                    _ => {
                        for i in 0..rr {
                            $name(
                                &w[i * rb..(i + 1) * rb],
                                rb,
                                acts,
                                t0,
                                nt,
                                &mut out[i * stride..],
                                stride,
                            );
                        }
                    }
                }
            }
        }
    };
}

use tile_fn;

/// `narrow` over tokens `t0..t0 + nt` in groups of at most 4 (the shapes it has).
///
/// # Safety
/// As for `narrow` on each group.
#[allow(clippy::too_many_arguments)]
unsafe fn by_4_tokens(
    narrow: TileFn,
    w: &[u8],
    rb: usize,
    acts: &QuantizedActivations,
    t0: usize,
    nt: usize,
    out: &mut [f32],
    stride: usize,
) {
    let mut j = 0;
    while j < nt {
        let m = (nt - j).min(4);
        // SAFETY: forwarded from the caller.
        unsafe { narrow(w, rb, acts, t0 + j, m, &mut out[j..], stride) };
        j += m;
    }
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn hsum256(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_movehdup_ps(s));
    _mm_cvtss_f32(s)
}

/// Two f16 at `p` converted: lanes 0 and 1.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn f16x2(p: *const u8) -> __m128 {
    // SAFETY: the caller keeps 4 bytes readable at `p`; the read is unaligned.
    let bits = unsafe { (p as *const i32).read_unaligned() };
    _mm_cvtph_ps(_mm_cvtsi32_si128(bits))
}

/// One f16 at `p` converted into lane 0.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn f16x1(p: *const u8) -> __m128 {
    // SAFETY: the caller keeps 2 bytes readable at `p`; the read is unaligned.
    let bits = unsafe { (p as *const u16).read_unaligned() };
    _mm_cvtph_ps(_mm_cvtsi32_si128(bits as i32))
}

/// Every f16 bit pattern's f32 value, as ggml keeps it (`ggml_table_f32_f16`): a block's
/// scale is then a scalar load a broadcast can take from memory, where converting it
/// in a vector register takes a lane shuffle (the port the dot products need too).
pub(super) fn f16_table() -> &'static [f32; 65536] {
    static TABLE: std::sync::OnceLock<Box<[f32; 65536]>> = std::sync::OnceLock::new();
    TABLE.get_or_init(|| {
        let mut t = Box::new([0f32; 65536]);
        for (i, v) in t.iter_mut().enumerate() {
            *v = half::f16::from_bits(i as u16).to_f32();
        }
        t
    })
}

type Rows<const RR: usize> = [*const u8; RR];

/// How far ahead of the current weight block to prefetch, in bytes (prefetching past the
/// end of the weights is harmless: prefetches never fault).
///
/// A decode tile walks 4 adjacent rows at once, so row 0's pointer plus 2 KiB (the old
/// distance) landed inside the tile's own rows, already on their way: the head of
/// Qwen2.5-Coder (145 MB of Q8_0) streamed at 7.8 GiB/s on one thread. 16 KiB is several
/// tiles ahead of the whole tile, and the same kernel streams at 8.5-10.7 GiB/s
/// (`cargo bench --bench quant -- qwen_head`, 2048 / 4096 / 8192 / 16384 alternated;
/// 32 KiB and more fell back). Tiles that fit in the caches (prefill) do not notice.
const PREFETCH: usize = 16384;

/// Prefetches, at step `(b, r)` of a tile of `RR` adjacent rows of `nb` blocks of `bb`
/// bytes (block `b` of row `r`), the bytes that step covers of the region `PREFETCH`
/// past the tile's end, in address order.
///
/// The rows of a decode tile are read side by side, as `RR` short streams, which the
/// hardware prefetchers follow poorly; a prefetch of the same stride ahead of each row
/// (what this replaced) keeps that pattern. Walking the region ahead as one sequential
/// stream, `RR` blocks per step, streamed a matrix far larger than the caches at 13.6-
/// 14.2 GB/s (Q4_K) and 14.4-16.7 GB/s (Q6_K) on one thread where the per-row prefetch
/// gave 9.0-10.5 and 10.3-10.8 (`BALLAST_BENCH_TABLE=dram cargo bench --bench quant`, an
/// AVX-512 EPYC at AVX2). The rows need not be adjacent for correctness: a prefetch
/// never faults.
#[inline(always)]
fn prefetch_tile_ahead<const RR: usize>(w: &Rows<RR>, nb: usize, bb: usize, b: usize, r: usize) {
    let ahead = w[0].wrapping_add(RR * nb * bb + PREFETCH + (b * RR + r) * bb);
    let mut line = 0;
    while line < bb {
        // SAFETY: prefetching never faults, wherever the address points.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(line) as *const i8) };
        line += 64;
    }
}

/// The eight 6-bit scales and the eight 6-bit mins of a Q4_K / Q5_K superblock from its
/// 12 packed bytes at `p` (the layout `blocks::scale_min_k4` reads one at a time), one byte
/// each in sub-block order.
///
/// # Safety
/// `p` must point to 12 readable bytes.
#[inline(always)]
unsafe fn k4_scales_mins(p: *const u8) -> (u64, u64) {
    // SAFETY: 12 bytes at p, per the contract.
    let [u0, u1, u2] = unsafe {
        [
            (p as *const u32).read_unaligned(),
            (p.add(4) as *const u32).read_unaligned(),
            (p.add(8) as *const u32).read_unaligned(),
        ]
    };
    let (low6, low4, top2) = (0x3f3f_3f3f, 0x0f0f_0f0f, 0x0303_0303);
    // Sub-blocks 0..4 keep the low 6 bits of bytes 0..4 (scales) and 4..8 (mins); 4..8
    // take 4 bits from bytes 8..12 and their top 2 from the top of bytes 0..4 / 4..8.
    let sc_hi = (u2 & low4) | (((u0 >> 6) & top2) << 4);
    let mn_hi = ((u2 >> 4) & low4) | (((u1 >> 6) & top2) << 4);
    (
        (u0 & low6) as u64 | ((sc_hi as u64) << 32),
        (u1 & low6) as u64 | ((mn_hi as u64) << 32),
    )
}

#[cfg(test)]
mod tests {
    use super::avx512::WIDE_MAX_BLOCKS;
    use super::avx512_k::K_MAX_BLOCKS;
    use super::*;
    use crate::quant::{quantize_activations, scalar};
    use half::f16;

    /// Every AVX-512 and AVX2 quantized kernel directly against the scalar one, on every
    /// tile shape `tile_fn!` dispatches (and a 3 x 2 one it splits), bit for bit.
    #[test]
    fn kernels_match_scalar_on_every_tile_shape() {
        let types = [
            GgmlType::Q4_0,
            GgmlType::Q4_1,
            GgmlType::Q5_0,
            GgmlType::Q5_1,
            GgmlType::Q8_0,
            GgmlType::Q4_K,
            GgmlType::Q5_K,
            GgmlType::Q6_K,
        ];
        for ty in types {
            if has_avx512() {
                if let Some(k) = kernel_avx512(ty) {
                    check_kernel(ty, k, "avx512");
                }
            }
            if has_avx2() {
                check_kernel(ty, kernel_avx2(ty).unwrap(), "avx2");
            }
        }
    }

    /// `bytes` random bytes (whole blocks of `ty`) with small finite f16 scale fields.
    fn random_rows(ty: GgmlType, bytes: usize, seed: u64) -> Vec<u8> {
        let mut x = seed;
        let mut w: Vec<u8> = (0..bytes)
            .map(|_| {
                x = x
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                (x >> 56) as u8
            })
            .collect();
        let f16_fields: &[usize] = match ty {
            GgmlType::Q4_0 | GgmlType::Q5_0 | GgmlType::Q8_0 => &[0],
            GgmlType::Q6_K => &[208],
            _ => &[0, 2],
        };
        for (i, b) in w.chunks_exact_mut(ty.block_bytes()).enumerate() {
            for &o in f16_fields {
                let v = ((i * 7 + o) % 13) as f32 / 8.0 - 0.75;
                b[o..o + 2].copy_from_slice(&f16::from_f32(v).to_le_bytes());
            }
        }
        w
    }

    fn check_kernel(ty: GgmlType, kernel: TileFn, level: &str) {
        let bl = ty.block_len();
        // The 32-element formats also have the 4 x 8 prefill tile on AVX-512 (and
        // its wrapper splits other shapes into groups of at most 4 tokens).
        let wide = level == "avx512"
            && matches!(
                super::super::activation_type(ty),
                GgmlType::Q8_0 | GgmlType::Q8_1
            );
        let mut shapes = vec![(4, 1), (2, 4), (1, 4), (1, 3), (1, 2), (1, 1), (3, 2)];
        let (mut blocks, mut tokens) = (vec![1, 2, 3, 7], 1..10);
        if wide {
            // Whole groups of 8 tokens, one or several; rows of more blocks than the
            // kernels decode once for all groups (`WIDE_MAX_BLOCKS`).
            shapes.extend([(4, 8), (1, 8), (4, 5), (2, 7), (4, 16), (4, 24), (1, 16)]);
            blocks.push(WIDE_MAX_BLOCKS + 3);
            tokens = 1..26;
        }
        if level == "avx2" && bl == 32 {
            // Up to 16 rows x whole groups of 8 tokens (any other shape goes narrow), the
            // rows decoded in chunks (several for rows of 100 blocks) or, past what the
            // decode buffer holds two of, not taken.
            shapes.extend([(16, 8), (16, 24), (5, 16), (2, 8), (1, 8), (3, 24), (16, 5)]);
            blocks.extend([100, 672, 673]);
            tokens = 1..26;
        }
        if level == "avx512" && bl == 256 {
            // 2 rows x more than 4 tokens that are not whole groups of 8: the rows
            // decoded once, the tokens 4 at a time and a tail; rows longer than that
            // decodes (`K_MAX_BLOCKS`).
            shapes.extend([(2, 5), (2, 9), (2, 7)]);
            blocks.push(K_MAX_BLOCKS + 1);
        }
        if bl == 256 {
            // Groups of 8 tokens (`k_wide`): rows 5 (AVX2: 2) at a time (AVX-512: two
            // groups a call, an odd one alone) and a tail of 1 to 4; rows too long for 5
            // in the decode buffer go 4 at a time (65 blocks), 2 (129) or one (257), and
            // past what it holds (281) the tile goes narrow.
            shapes.extend([(16, 8), (16, 24), (5, 16), (1, 8), (3, 24), (2, 8), (16, 5)]);
            // A tail after whole groups: as a group filled with zeros where it ends the
            // batch (n equal to the tile's tokens) and is long enough or completes a pair
            // of groups (AVX-512: 10, 11, 26), through the narrow kernel where not.
            shapes.extend([(5, 10), (16, 13), (7, 23), (1, 9), (3, 11), (2, 26)]);
            // A batch of 5 to 7 tokens alone: one group filled with zeros.
            shapes.extend([(6, 6), (16, 7)]);
            blocks.extend([65, 129, 257, 281]);
            tokens = 1..27;
        }
        for nb in blocks {
            let k = bl * nb;
            let rb = ty.block_bytes() * nb;
            // Long rows with a few token counts only: the scalar reference is slow.
            let counts: Vec<usize> = if nb >= 65 {
                vec![8, 17, 24]
            } else {
                tokens.clone().collect()
            };
            for n in counts {
                let rows = shapes.iter().map(|s| s.0).max().unwrap_or(1);
                let wq = random_rows(ty, rows * rb, (nb * 31 + n) as u64);
                let x: Vec<f32> = (0..n * k)
                    .map(|i| ((i * 53 % 89) as f32 - 44.0) / 9.0)
                    .collect();
                let mut acts = QuantizedActivations::new();
                quantize_activations(ty, &x, n, k, &mut acts).unwrap();
                for &(rr, nt) in &shapes {
                    if nt > n {
                        continue;
                    }
                    let mut out = vec![0f32; rr * n];
                    // SAFETY: the kernel's level is supported; the lengths are consistent.
                    unsafe { kernel(&wq[..rr * rb], rb, &acts, 0, nt, &mut out, n) };
                    for r in 0..rr {
                        for t in 0..nt {
                            let (a, s, f) = acts.parts(t);
                            let want = scalar::dot(ty, &wq[r * rb..(r + 1) * rb], a, s, f);
                            let got = out[r * n + t];
                            // Same order as the scalar kernel: same bits.
                            assert_eq!(
                                got.to_bits(),
                                want.to_bits(),
                                "{ty:?} {level} nb={nb} {rr}x{nt} row {r} token {t}: {got} vs {want}"
                            );
                        }
                    }
                }
            }
        }
    }
}
