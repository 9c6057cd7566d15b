//! x86-64 kernels: AVX2 (+FMA, F16C) and AVX-512 (F/BW/VL/DQ + VNNI).
//!
//! All kernels compute each block's integer dot product exactly (no saturation for
//! activations produced by [`super::quantize_activations`], whose quants lie in
//! -127..=127) and differ from the scalar path only in the order of f32 accumulation.

use super::{
    QuantizedActivations, TileFn, TileOut, WideFn, PACKED_BLOCK, PACKED_BLOCK_Q8_1, PACK_TOKENS,
};
use crate::ggml_type::GgmlType;
use half::f16;
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
        GgmlType::Q4_0 => tile_q4_0_avx2,
        GgmlType::Q4_1 => tile_q4_1_avx2,
        GgmlType::Q8_0 => tile_q8_0_avx2,
        GgmlType::Q5_0 => tile_q5_0_avx2,
        GgmlType::Q5_1 => tile_q5_1_avx2,
        GgmlType::Q4_K => tile_q4_k_avx2,
        GgmlType::Q5_K => tile_q5_k_avx2,
        GgmlType::Q6_K => tile_q6_k_avx2,
        GgmlType::F32 => tile_f32_avx2,
        GgmlType::F16 => tile_f16_avx2,
        GgmlType::BF16 => tile_bf16_avx2,
        _ => return None,
    })
}

pub(crate) fn kernel_avx512(ty: GgmlType) -> Option<TileFn> {
    Some(match ty {
        GgmlType::Q4_0 => tile_q4_0_avx512,
        GgmlType::Q4_1 => tile_q4_1_avx512,
        GgmlType::Q8_0 => tile_q8_0_avx512,
        GgmlType::Q5_0 => tile_q5_0_avx512,
        GgmlType::Q5_1 => tile_q5_1_avx512,
        GgmlType::Q4_K => tile_q4_k_avx512,
        GgmlType::Q5_K => tile_q5_k_avx512,
        GgmlType::Q6_K => tile_q6_k_avx512,
        _ => return None,
    })
}

/// The prefill kernel writing 4 rows x whole groups of 8 tokens through a [`TileOut`]
/// (what `matmul_token_major` calls for those tiles, so results go straight to the
/// batch's layout), for the types that have one.
pub(crate) fn wide_avx512(ty: GgmlType) -> Option<WideFn> {
    Some(match ty {
        GgmlType::Q4_0 => wide_q4_0_avx512,
        GgmlType::Q4_1 => wide_q4_1_avx512,
        GgmlType::Q8_0 => wide_q8_0_avx512,
        GgmlType::Q5_0 => wide_q5_0_avx512,
        GgmlType::Q5_1 => wide_q5_1_avx512,
        _ => return None,
    })
}

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

/// Expands a tile kernel generic over rows and tokens into a [`TileFn`].
macro_rules! tile_fn {
    ($name:ident, $kern:ident, $bb:expr) => {
        /// # Safety
        /// The CPU must support the kernel's features; `w` and `acts` must be validated.
        unsafe fn $name(
            w: &[u8],
            rb: usize,
            acts: &QuantizedActivations,
            t0: usize,
            nt: usize,
            out: &mut [f32],
            stride: usize,
        ) {
            #[inline(always)]
            unsafe fn run<const RR: usize, const NT: usize>(
                w: &[u8],
                rb: usize,
                acts: &QuantizedActivations,
                t0: usize,
                out: &mut [f32],
                stride: usize,
            ) {
                let mut wp = [std::ptr::null(); RR];
                for (i, p) in wp.iter_mut().enumerate() {
                    *p = w[i * rb..].as_ptr();
                }
                let (a, s) = act_ptrs::<NT>(acts, t0);
                // SAFETY: forwarded from the caller.
                let res = unsafe { $kern::<RR, NT>(wp, rb / $bb, a, s) };
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

tile_fn!(tile_q4_0_avx2, q4_0_avx2, 18);
tile_fn!(tile_q4_1_avx2, q4_1_avx2, 20);
tile_fn!(tile_q8_0_avx2, q8_0_avx2, 34);
tile_fn!(tile_q5_0_avx2, q5_0_avx2, 22);
tile_fn!(tile_q5_1_avx2, q5_1_avx2, 24);
tile_fn!(tile_q4_k_avx2, q4_k_avx2, 144);
tile_fn!(tile_q5_k_avx2, q5_k_avx2, 176);
tile_fn!(tile_q6_k_avx2, q6_k_avx2, 210);
tile_fn!(tile_q4_0_avx512_narrow, q4_0_avx512, 18);
tile_fn!(tile_q4_1_avx512_narrow, q4_1_avx512, 20);
tile_fn!(tile_q8_0_avx512_narrow, q8_0_avx512, 34);
tile_fn!(tile_q5_0_avx512_narrow, q5_0_avx512, 22);
tile_fn!(tile_q5_1_avx512_narrow, q5_1_avx512, 24);
tile_fn!(tile_q4_k_avx512_narrow, q4_k_avx512, 144);
tile_fn!(tile_q5_k_avx512_narrow, q5_k_avx512, 176);
tile_fn!(tile_q6_k_avx512_narrow, q6_k_avx512, 210);

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

/// Expands the prefill tile of a 32-element format: 4 rows x whole groups of 8 tokens
/// through its wide kernel (`$wide_name`, also called by itself for the token-major
/// output: [`q8_0_like_wide_avx512`], [`q41_like_wide_groups`]), any other shape through
/// the narrow kernel (tokens split into groups of at most 4).
macro_rules! tile_wide_fn {
    ($name:ident, $wide_name:ident, $narrow:ident, $wide:expr, $bb:expr) => {
        /// # Safety
        /// The CPU must support AVX-512 VNNI; `w` (4 rows) and `acts` must be validated;
        /// `t0` and `nt` whole groups of 8 tokens; `out` valid for every result.
        unsafe fn $wide_name(
            w: &[u8],
            rb: usize,
            acts: &QuantizedActivations,
            t0: usize,
            nt: usize,
            out: TileOut,
        ) {
            let wp: Rows<4> = std::array::from_fn(|i| w[i * rb..].as_ptr());
            let g0 = t0 / PACK_TOKENS;
            let y = |g: usize| acts.packed_group(g0 + g).as_ptr();
            // SAFETY: forwarded from the caller; each packed group holds every block.
            unsafe { $wide(wp, rb / $bb, y, nt / PACK_TOKENS, out) };
        }

        /// # Safety
        /// The CPU must support AVX-512 VNNI; `w` and `acts` must be validated.
        unsafe fn $name(
            w: &[u8],
            rb: usize,
            acts: &QuantizedActivations,
            t0: usize,
            nt: usize,
            out: &mut [f32],
            stride: usize,
        ) {
            let rr = w.len() / rb;
            if rr == 4 && nt >= PACK_TOKENS && nt % PACK_TOKENS == 0 && t0 % PACK_TOKENS == 0 {
                assert!(out.len() >= 3 * stride + nt);
                let out = TileOut {
                    ptr: out.as_mut_ptr(),
                    rs: stride,
                    ts: 1,
                };
                // SAFETY: forwarded from the caller; every result lands in `out`
                // (checked just above).
                unsafe { $wide_name(w, rb, acts, t0, nt, out) };
                return;
            }
            // SAFETY: forwarded from the caller.
            unsafe { by_4_tokens($narrow, w, rb, acts, t0, nt, out, stride) }
        }
    };
}

tile_wide_fn!(
    tile_q8_0_avx512,
    wide_q8_0_avx512,
    tile_q8_0_avx512_narrow,
    q8_0_like_wide_avx512::<0>,
    34
);
tile_wide_fn!(
    tile_q4_0_avx512,
    wide_q4_0_avx512,
    tile_q4_0_avx512_narrow,
    q8_0_like_wide_avx512::<1>,
    18
);
tile_wide_fn!(
    tile_q5_0_avx512,
    wide_q5_0_avx512,
    tile_q5_0_avx512_narrow,
    q8_0_like_wide_avx512::<2>,
    22
);
tile_wide_fn!(
    tile_q4_1_avx512,
    wide_q4_1_avx512,
    tile_q4_1_avx512_narrow,
    q41_like_wide_groups::<false>,
    20
);
tile_wide_fn!(
    tile_q5_1_avx512,
    wide_q5_1_avx512,
    tile_q5_1_avx512_narrow,
    q41_like_wide_groups::<true>,
    24
);

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn hsum256(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_movehdup_ps(s));
    _mm_cvtss_f32(s)
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn hsum_epi32(v: __m256i) -> i32 {
    let s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256::<1>(v));
    let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b01_00_11_10>(s));
    let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b10_11_00_01>(s));
    _mm_cvtsi128_si32(s)
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

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn nibbles16(p: *const u8) -> __m256i {
    // SAFETY: the caller keeps 16 bytes readable at `p`; the load is unaligned.
    let qs = unsafe { _mm_loadu_si128(p as *const __m128i) };
    _mm256_and_si256(
        _mm256_set_m128i(_mm_srli_epi16::<4>(qs), qs),
        _mm256_set1_epi8(0x0F),
    )
}

// ---------------------------------------------------------------- AVX2

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

/// The 32 high bits `qh` (bit i for element i) as bytes 0x10 / 0x00.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn high_bits32(qh: u32) -> __m256i {
    let tmp = _mm256_set1_epi32(qh as i32);
    let shuf = _mm256_set_epi64x(
        0x0303_0303_0303_0303,
        0x0202_0202_0202_0202,
        0x0101_0101_0101_0101,
        0,
    );
    let bytes = _mm256_or_si256(
        _mm256_shuffle_epi8(tmp, shuf),
        _mm256_set1_epi64x(0x7fbf_dfef_f7fb_fdfe),
    );
    _mm256_and_si256(
        _mm256_cmpeq_epi8(bytes, _mm256_set1_epi64x(-1)),
        _mm256_set1_epi8(0x10),
    )
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q4_1_avx2<const RR: usize, const NT: usize>(
    w: Rows<RR>,
    nb: usize,
    a: [*const u8; NT],
    s: [*const f32; NT],
) -> [[f32; NT]; RR] {
    // SAFETY: `q41_like_avx2`'s contract is this wrapper's (the caller keeps
    // `nb` blocks readable at each row and activation pointer), and this wrapper enables
    // its target features.
    unsafe { q41_like_avx2::<RR, NT, false>(w, nb, a, s) }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q5_1_avx2<const RR: usize, const NT: usize>(
    w: Rows<RR>,
    nb: usize,
    a: [*const u8; NT],
    s: [*const f32; NT],
) -> [[f32; NT]; RR] {
    // SAFETY: `q41_like_avx2`'s contract is this wrapper's (the caller keeps
    // `nb` blocks readable at each row and activation pointer), and this wrapper enables
    // its target features.
    unsafe { q41_like_avx2::<RR, NT, true>(w, nb, a, s) }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q41_like_avx2<const RR: usize, const NT: usize, const FIVE: bool>(
    w: Rows<RR>,
    nb: usize,
    a: [*const u8; NT],
    s: [*const f32; NT],
) -> [[f32; NT]; RR] {
    let ones = _mm256_set1_epi16(1);
    let bb = if FIVE { 24 } else { 20 };
    let mut acc = [[_mm256_setzero_ps(); NT]; RR];
    let mut accm = [[_mm_setzero_ps(); NT]; RR];
    for b in 0..nb {
        // SAFETY: block b of each row and of each activation row is in bounds.
        unsafe {
            for r in 0..RR {
                let wb = w[r].add(b * bb);
                prefetch_tile_ahead(&w, nb, bb, b, r);
                let dm = f16x2(wb);
                let q = if FIVE {
                    let qh = (wb.add(4) as *const u32).read_unaligned();
                    _mm256_or_si256(nibbles16(wb.add(8)), high_bits32(qh))
                } else {
                    nibbles16(wb.add(4))
                };
                for t in 0..NT {
                    let y = _mm256_loadu_si256(a[t].add(b * 36 + 4) as *const __m256i);
                    let p = _mm256_madd_epi16(_mm256_maddubs_epi16(q, y), ones);
                    let sy = _mm_castpd_ps(_mm_load_sd(s[t].add(2 * b) as *const f64));
                    let ds = _mm_mul_ps(dm, sy);
                    acc[r][t] = _mm256_fmadd_ps(
                        _mm256_broadcastss_ps(ds),
                        _mm256_cvtepi32_ps(p),
                        acc[r][t],
                    );
                    // Lane 1: m_w * s_a, fused as gcc contracts llama.cpp's `summs += m * s`.
                    accm[r][t] = _mm_fmadd_ps(dm, sy, accm[r][t]);
                }
            }
        }
    }
    let mut res = [[0f32; NT]; RR];
    for r in 0..RR {
        for t in 0..NT {
            res[r][t] = hsum256(acc[r][t]) + _mm_cvtss_f32(_mm_movehdup_ps(accm[r][t]));
        }
    }
    res
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q8_0_like_avx2<const RR: usize, const NT: usize, const KIND: u8>(
    w: Rows<RR>,
    nb: usize,
    a: [*const u8; NT],
    s: [*const f32; NT],
) -> [[f32; NT]; RR] {
    let ones = _mm256_set1_epi16(1);
    let bb = [34, 18, 22][KIND as usize];
    let mut acc = [[_mm256_setzero_ps(); NT]; RR];
    for b in 0..nb {
        // SAFETY: block b of each row and of each activation row is in bounds.
        unsafe {
            for r in 0..RR {
                let wb = w[r].add(b * bb);
                prefetch_tile_ahead(&w, nb, bb, b, r);
                let dx = f16x1(wb);
                let x = match KIND {
                    1 => _mm256_sub_epi8(nibbles16(wb.add(2)), _mm256_set1_epi8(8)),
                    2 => {
                        let qh = (wb.add(2) as *const u32).read_unaligned();
                        let q = _mm256_or_si256(nibbles16(wb.add(6)), high_bits32(qh));
                        _mm256_sub_epi8(q, _mm256_set1_epi8(16))
                    }
                    _ => _mm256_loadu_si256(wb.add(2) as *const __m256i),
                };
                let ax = _mm256_sign_epi8(x, x);
                for t in 0..NT {
                    let y = _mm256_loadu_si256(a[t].add(b * 34 + 2) as *const __m256i);
                    let sy = _mm256_sign_epi8(y, x);
                    let p = _mm256_madd_epi16(_mm256_maddubs_epi16(ax, sy), ones);
                    let d = _mm_mul_ss(dx, _mm_load_ss(s[t].add(b)));
                    acc[r][t] =
                        _mm256_fmadd_ps(_mm256_broadcastss_ps(d), _mm256_cvtepi32_ps(p), acc[r][t]);
                }
            }
        }
    }
    let mut res = [[0f32; NT]; RR];
    for r in 0..RR {
        for t in 0..NT {
            res[r][t] = hsum256(acc[r][t]);
        }
    }
    res
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q8_0_avx2<const RR: usize, const NT: usize>(
    w: Rows<RR>,
    nb: usize,
    a: [*const u8; NT],
    s: [*const f32; NT],
) -> [[f32; NT]; RR] {
    // SAFETY: `q8_0_like_avx2`'s contract is this wrapper's (the caller keeps
    // `nb` blocks readable at each row and activation pointer), and this wrapper enables
    // its target features.
    unsafe { q8_0_like_avx2::<RR, NT, 0>(w, nb, a, s) }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q4_0_avx2<const RR: usize, const NT: usize>(
    w: Rows<RR>,
    nb: usize,
    a: [*const u8; NT],
    s: [*const f32; NT],
) -> [[f32; NT]; RR] {
    // SAFETY: `q8_0_like_avx2`'s contract is this wrapper's (the caller keeps
    // `nb` blocks readable at each row and activation pointer), and this wrapper enables
    // its target features.
    unsafe { q8_0_like_avx2::<RR, NT, 1>(w, nb, a, s) }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q5_0_avx2<const RR: usize, const NT: usize>(
    w: Rows<RR>,
    nb: usize,
    a: [*const u8; NT],
    s: [*const f32; NT],
) -> [[f32; NT]; RR] {
    // SAFETY: `q8_0_like_avx2`'s contract is this wrapper's (the caller keeps
    // `nb` blocks readable at each row and activation pointer), and this wrapper enables
    // its target features.
    unsafe { q8_0_like_avx2::<RR, NT, 2>(w, nb, a, s) }
}

/// The tile shapes the K-quant kernels take: at most 8 (row, token) pairs, one f32 lane
/// each in the final step.
const K_LANES: usize = 8;

/// Sums the eight i32 lanes of each of the first `n` vectors of `v` (n <= 8): lane i of
/// the result is `v[i]`'s total (lanes past `n` are meaningless). Integer sums are exact,
/// so the order is free.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn lane_totals(v: &[__m256i; K_LANES], n: usize) -> __m256i {
    // hadd twice leaves [v0..v3 partial over the low 128 bits | v0..v3 over the high].
    let q0 = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
    if n <= 4 {
        let t = _mm_add_epi32(
            _mm256_castsi256_si128(q0),
            _mm256_extracti128_si256::<1>(q0),
        );
        return _mm256_castsi128_si256(t);
    }
    let q1 = _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]), _mm256_hadd_epi32(v[6], v[7]));
    _mm256_add_epi32(
        _mm256_permute2x128_si256::<0x20>(q0, q1),
        _mm256_permute2x128_si256::<0x31>(q0, q1),
    )
}

/// [`lane_totals`] for vectors of four i32 lanes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn lane_totals128(v: &[__m128i; K_LANES], n: usize) -> __m256i {
    let t0 = _mm_hadd_epi32(_mm_hadd_epi32(v[0], v[1]), _mm_hadd_epi32(v[2], v[3]));
    if n <= 4 {
        return _mm256_castsi128_si256(t0);
    }
    let t1 = _mm_hadd_epi32(_mm_hadd_epi32(v[4], v[5]), _mm_hadd_epi32(v[6], v[7]));
    _mm256_set_m128i(t1, t0)
}

/// A `pshufb` pattern that copies i16 lane `i` of each 128-bit half to its eight lanes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn broadcast_word(i: usize) -> __m256i {
    let lo = 2 * i as i16;
    _mm256_set1_epi16(lo | ((lo + 1) << 8))
}

/// A `pshufb` pattern that copies byte `i` to bytes 0..8 and byte `i + 1` to 8..16.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn pair_of_bytes(i: usize) -> __m128i {
    _mm_set_epi64x(
        0x0101_0101_0101_0101 * (i as i64 + 1),
        0x0101_0101_0101_0101 * i as i64,
    )
}

/// The per-lane f32 inputs of a K-quant tile's final step, lane `r * NT + t` for row `r`
/// and token `t`: the weight's scale (and minimum's scale) and the activation's.
#[inline(always)]
fn lane_scales<const RR: usize, const NT: usize>(
    d: &[f32; K_LANES],
    y: impl Fn(usize) -> f32,
) -> ([f32; K_LANES], [f32; K_LANES]) {
    let (mut dw, mut dy) = ([0f32; K_LANES], [0f32; K_LANES]);
    for r in 0..RR {
        for t in 0..NT {
            dw[r * NT + t] = d[r];
            dy[r * NT + t] = y(t);
        }
    }
    (dw, dy)
}

/// The f32 totals of a K-quant tile, lane `r * NT + t`, as rows x tokens.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn k_tile_result<const RR: usize, const NT: usize>(acc: __m256) -> [[f32; NT]; RR] {
    let mut lanes = [0f32; K_LANES];
    // SAFETY: `lanes` holds eight f32; the store is unaligned.
    unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), acc) };
    let mut res = [[0f32; NT]; RR];
    for (r, row) in res.iter_mut().enumerate() {
        row.copy_from_slice(&lanes[r * NT..(r + 1) * NT]);
    }
    res
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q4_k_avx2<const RR: usize, const NT: usize>(
    w: Rows<RR>,
    nb: usize,
    a: [*const u8; NT],
    s: [*const f32; NT],
) -> [[f32; NT]; RR] {
    // SAFETY: `q45_k_avx2`'s contract is this wrapper's (the caller keeps
    // `nb` blocks readable at each row and activation pointer), and this wrapper enables
    // its target features.
    unsafe { q45_k_avx2::<RR, NT, false>(w, nb, a, s) }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q5_k_avx2<const RR: usize, const NT: usize>(
    w: Rows<RR>,
    nb: usize,
    a: [*const u8; NT],
    s: [*const f32; NT],
) -> [[f32; NT]; RR] {
    // SAFETY: `q45_k_avx2`'s contract is this wrapper's (the caller keeps
    // `nb` blocks readable at each row and activation pointer), and this wrapper enables
    // its target features.
    unsafe { q45_k_avx2::<RR, NT, true>(w, nb, a, s) }
}

/// Q4_K / Q5_K x Q8_K: integer sums per 32-value sub-block weighted by the 6-bit scales
/// (in `madd`), the mins applied through the Q8_K block sums. The integer totals of every
/// (row, token) pair of the tile are gathered into one vector, lane `r * NT + t`, so that
/// the scalar kernel's f32 expression, `acc + ((d·dy)·si − (dmin·dy)·sm)`, runs for the
/// whole tile in one set of vector operations (the same operations per lane, hence the
/// same bits; no FMA, as the scalar code has none).
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q45_k_avx2<const RR: usize, const NT: usize, const FIVE: bool>(
    w: Rows<RR>,
    nb: usize,
    a: [*const u8; NT],
    s: [*const f32; NT],
) -> [[f32; NT]; RR] {
    const { assert!(RR * NT <= K_LANES) };
    let bb = if FIVE { 176 } else { 144 };
    let m4 = _mm256_set1_epi8(0x0F);
    let one = _mm256_set1_epi8(1);
    let mut acc = _mm256_setzero_ps();
    for b in 0..nb {
        // SAFETY: superblock b of each row and activation row is in bounds.
        unsafe {
            // The activation's sums per 32 values (pairs of its 16-value block sums),
            // which the mins multiply.
            let mut pair_sums = [_mm_setzero_si128(); NT];
            for (t, ps) in pair_sums.iter_mut().enumerate() {
                let bs = _mm256_loadu_si256(a[t].add(b * 292 + 260) as *const __m256i);
                *ps = _mm_hadd_epi16(
                    _mm256_castsi256_si128(bs),
                    _mm256_extracti128_si256::<1>(bs),
                );
            }
            let mut sums = [_mm256_setzero_si256(); K_LANES];
            let mut min_sums = [_mm_setzero_si128(); K_LANES];
            let (mut d, mut dmin) = ([0f32; K_LANES], [0f32; K_LANES]);
            for r in 0..RR {
                let x = w[r].add(b * bb);
                prefetch_tile_ahead(&w, nb, bb, b, r);
                let hd = f16x2(x);
                d[r] = _mm_cvtss_f32(hd);
                dmin[r] = _mm_cvtss_f32(_mm_movehdup_ps(hd));
                let (sc, mn) = k4_scales_mins(x.add(4));
                let scales_mins = _mm256_cvtepu8_epi16(_mm_set_epi64x(mn as i64, sc as i64));
                let sc128 = _mm256_castsi256_si128(scales_mins);
                let scales = _mm256_set_m128i(sc128, sc128);
                let mins = _mm256_extracti128_si256::<1>(scales_mins);
                let qs = x.add(if FIVE { 48 } else { 16 });
                let qh = if FIVE {
                    _mm256_loadu_si256(x.add(16) as *const __m256i)
                } else {
                    _mm256_setzero_si256()
                };
                let mut sumi = [_mm256_setzero_si256(); NT];
                for c in 0..4 {
                    let q = _mm256_loadu_si256(qs.add(32 * c) as *const __m256i);
                    let mut lo = _mm256_and_si256(q, m4);
                    let mut hi = _mm256_and_si256(_mm256_srli_epi16::<4>(q), m4);
                    if FIVE {
                        let sh_lo = _mm_cvtsi32_si128(2 * c as i32);
                        let sh_hi = _mm_cvtsi32_si128(2 * c as i32 + 1);
                        let hb_lo = _mm256_and_si256(_mm256_srl_epi16(qh, sh_lo), one);
                        let hb_hi = _mm256_and_si256(_mm256_srl_epi16(qh, sh_hi), one);
                        lo = _mm256_or_si256(lo, _mm256_slli_epi16::<4>(hb_lo));
                        hi = _mm256_or_si256(hi, _mm256_slli_epi16::<4>(hb_hi));
                    }
                    let scale_lo = _mm256_shuffle_epi8(scales, broadcast_word(2 * c));
                    let scale_hi = _mm256_shuffle_epi8(scales, broadcast_word(2 * c + 1));
                    for (t, acc_i) in sumi.iter_mut().enumerate() {
                        let y = a[t].add(b * 292 + 4 + 64 * c);
                        let ylo = _mm256_loadu_si256(y as *const __m256i);
                        let yhi = _mm256_loadu_si256(y.add(32) as *const __m256i);
                        let plo = _mm256_madd_epi16(_mm256_maddubs_epi16(lo, ylo), scale_lo);
                        let phi = _mm256_madd_epi16(_mm256_maddubs_epi16(hi, yhi), scale_hi);
                        *acc_i = _mm256_add_epi32(*acc_i, _mm256_add_epi32(plo, phi));
                    }
                }
                for t in 0..NT {
                    sums[r * NT + t] = sumi[t];
                    min_sums[r * NT + t] = _mm_madd_epi16(mins, pair_sums[t]);
                }
            }
            let si = _mm256_cvtepi32_ps(lane_totals(&sums, RR * NT));
            let sm = _mm256_cvtepi32_ps(lane_totals128(&min_sums, RR * NT));
            let (dw, dy) = lane_scales::<RR, NT>(&d, |t| *s[t].add(b));
            let (dm, _) = lane_scales::<RR, NT>(&dmin, |_| 0.0);
            let dy = _mm256_loadu_ps(dy.as_ptr());
            let scaled = _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(dw.as_ptr()), dy), si);
            let mins = _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(dm.as_ptr()), dy), sm);
            acc = _mm256_add_ps(acc, _mm256_sub_ps(scaled, mins));
        }
    }
    k_tile_result::<RR, NT>(acc)
}

/// Q6_K x Q8_K: unsigned 6-bit quants times activations, weighted per 16 values by the
/// i8 scales in `madd`; the -32 offset is applied through the Q8_K block sums. As in
/// [`q45_k_avx2`], the tile's integer totals share one vector for the final f32 step,
/// `acc + (d·dy)·si`.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q6_k_avx2<const RR: usize, const NT: usize>(
    w: Rows<RR>,
    nb: usize,
    a: [*const u8; NT],
    s: [*const f32; NT],
) -> [[f32; NT]; RR] {
    const { assert!(RR * NT <= K_LANES) };
    let m4 = _mm256_set1_epi8(0x0F);
    let m2 = _mm256_set1_epi8(0x03);
    let mut acc = _mm256_setzero_ps();
    for b in 0..nb {
        // SAFETY: superblock b of each row and activation row is in bounds.
        unsafe {
            let mut block_sums = [_mm256_setzero_si256(); NT];
            for (t, bs) in block_sums.iter_mut().enumerate() {
                *bs = _mm256_loadu_si256(a[t].add(b * 292 + 260) as *const __m256i);
            }
            let mut sums = [_mm256_setzero_si256(); K_LANES];
            let mut d = [0f32; K_LANES];
            for r in 0..RR {
                let x = w[r].add(b * 210);
                prefetch_tile_ahead(&w, nb, 210, b, r);
                d[r] = _mm_cvtss_f32(f16x1(x.add(208)));
                let scales = _mm_loadu_si128(x.add(192) as *const __m128i);
                let mut sumi = [_mm256_setzero_si256(); NT];
                // The offset: 32 · Σ scale_i · (sum of the activation's block i).
                let scales16 = _mm256_cvtepi8_epi16(scales);
                for t in 0..NT {
                    let offset = _mm256_madd_epi16(scales16, block_sums[t]);
                    sumi[t] = _mm256_sub_epi32(sumi[t], _mm256_slli_epi32::<5>(offset));
                }
                for n in 0..2 {
                    let ql0 = _mm256_loadu_si256(x.add(64 * n) as *const __m256i);
                    let ql1 = _mm256_loadu_si256(x.add(64 * n + 32) as *const __m256i);
                    let qh = _mm256_loadu_si256(x.add(128 + 32 * n) as *const __m256i);
                    let q1 = _mm256_or_si256(
                        _mm256_and_si256(ql0, m4),
                        _mm256_slli_epi16::<4>(_mm256_and_si256(qh, m2)),
                    );
                    let q2 = _mm256_or_si256(
                        _mm256_and_si256(ql1, m4),
                        _mm256_slli_epi16::<4>(_mm256_and_si256(_mm256_srli_epi16::<2>(qh), m2)),
                    );
                    let q3 = _mm256_or_si256(
                        _mm256_and_si256(_mm256_srli_epi16::<4>(ql0), m4),
                        _mm256_slli_epi16::<4>(_mm256_and_si256(_mm256_srli_epi16::<4>(qh), m2)),
                    );
                    let q4 = _mm256_or_si256(
                        _mm256_and_si256(_mm256_srli_epi16::<4>(ql1), m4),
                        _mm256_slli_epi16::<4>(_mm256_and_si256(_mm256_srli_epi16::<6>(qh), m2)),
                    );
                    for (g, q) in [q1, q2, q3, q4].into_iter().enumerate() {
                        // Scales 8n + 2g and 8n + 2g + 1, for the 16 values each half covers.
                        let scale = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(
                            scales,
                            pair_of_bytes(8 * n + 2 * g),
                        ));
                        for (t, acc_i) in sumi.iter_mut().enumerate() {
                            let y = a[t].add(b * 292 + 4 + 128 * n + 32 * g);
                            let yv = _mm256_loadu_si256(y as *const __m256i);
                            let p = _mm256_madd_epi16(_mm256_maddubs_epi16(q, yv), scale);
                            *acc_i = _mm256_add_epi32(*acc_i, p);
                        }
                    }
                }
                for t in 0..NT {
                    sums[r * NT + t] = sumi[t];
                }
            }
            let si = _mm256_cvtepi32_ps(lane_totals(&sums, RR * NT));
            let (dw, dy) = lane_scales::<RR, NT>(&d, |t| *s[t].add(b));
            let dwy = _mm256_mul_ps(_mm256_loadu_ps(dw.as_ptr()), _mm256_loadu_ps(dy.as_ptr()));
            acc = _mm256_add_ps(acc, _mm256_mul_ps(dwy, si));
        }
    }
    k_tile_result::<RR, NT>(acc)
}

/// Plain float weights: one row and token at a time.
unsafe fn float_tile<const KIND: u8>(
    w: &[u8],
    rb: usize,
    acts: &QuantizedActivations,
    t0: usize,
    nt: usize,
    out: &mut [f32],
    stride: usize,
) {
    for (i, row) in w.chunks_exact(rb).enumerate() {
        for j in 0..nt {
            let (_, _, f) = acts.parts(t0 + j);
            // SAFETY: AVX2 support was checked by the caller; lengths were validated.
            out[i * stride + j] = unsafe { float_dot_avx2::<KIND>(row, f) };
        }
    }
}

unsafe fn tile_f32_avx2(
    w: &[u8],
    rb: usize,
    acts: &QuantizedActivations,
    t0: usize,
    nt: usize,
    out: &mut [f32],
    stride: usize,
) {
    // SAFETY: this tile kernel's caller checked AVX2 and the sizes, as `float_tile` needs.
    unsafe { float_tile::<0>(w, rb, acts, t0, nt, out, stride) }
}

unsafe fn tile_f16_avx2(
    w: &[u8],
    rb: usize,
    acts: &QuantizedActivations,
    t0: usize,
    nt: usize,
    out: &mut [f32],
    stride: usize,
) {
    // SAFETY: this tile kernel's caller checked AVX2 and the sizes, as `float_tile` needs.
    unsafe { float_tile::<1>(w, rb, acts, t0, nt, out, stride) }
}

unsafe fn tile_bf16_avx2(
    w: &[u8],
    rb: usize,
    acts: &QuantizedActivations,
    t0: usize,
    nt: usize,
    out: &mut [f32],
    stride: usize,
) {
    // SAFETY: this tile kernel's caller checked AVX2 and the sizes, as `float_tile` needs.
    unsafe { float_tile::<2>(w, rb, acts, t0, nt, out, stride) }
}

/// Dot product of a float row (`KIND` 0: f32, 1: f16, 2: bf16) with f32 activations.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn float_dot_avx2<const KIND: u8>(w: &[u8], x: &[f32]) -> f32 {
    let k = x.len();
    let load = |i: usize| -> __m256 {
        // SAFETY: i + 8 <= k, within both rows.
        unsafe {
            match KIND {
                1 => _mm256_cvtph_ps(_mm_loadu_si128(w.as_ptr().add(i * 2) as *const __m128i)),
                2 => {
                    let h = _mm_loadu_si128(w.as_ptr().add(i * 2) as *const __m128i);
                    _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h)))
                }
                _ => _mm256_loadu_ps(w.as_ptr().add(i * 4) as *const f32),
            }
        }
    };
    let mut acc0 = _mm256_setzero_ps();
    let mut acc1 = _mm256_setzero_ps();
    let mut i = 0;
    // SAFETY: all loads stay below k values.
    unsafe {
        while i + 16 <= k {
            acc0 = _mm256_fmadd_ps(load(i), _mm256_loadu_ps(x.as_ptr().add(i)), acc0);
            acc1 = _mm256_fmadd_ps(load(i + 8), _mm256_loadu_ps(x.as_ptr().add(i + 8)), acc1);
            i += 16;
        }
        while i + 8 <= k {
            acc0 = _mm256_fmadd_ps(load(i), _mm256_loadu_ps(x.as_ptr().add(i)), acc0);
            i += 8;
        }
    }
    let mut sum = hsum256(_mm256_add_ps(acc0, acc1));
    while i < k {
        let wv = match KIND {
            1 => half::f16::from_bits(u16::from_le_bytes([w[i * 2], w[i * 2 + 1]])).to_f32(),
            2 => f32::from_bits((u16::from_le_bytes([w[i * 2], w[i * 2 + 1]]) as u32) << 16),
            _ => f32::from_le_bytes([w[i * 4], w[i * 4 + 1], w[i * 4 + 2], w[i * 4 + 3]]),
        };
        sum += wv * x[i];
        i += 1;
    }
    sum
}

// ---------------------------------------------------------------- AVX-512 VNNI

/// Sixteen 4-bit quants of two blocks at `pa` and `pb`, as 64 bytes in ggml's element
/// order: [a low nibbles, a high nibbles, b low nibbles, b high nibbles].
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
unsafe fn nibbles_pair(pa: *const u8, pb: *const u8) -> __m512i {
    // SAFETY: forwarded from the caller (16 readable bytes at each).
    _mm512_and_si512(unsafe { nibbles_pair_high(pa, pb) }, _mm512_set1_epi8(0x0F))
}

/// [`nibbles_pair`] before masking: each byte holds its quant in the low nibble and
/// stray bits above (for a caller that masks and adds the fifth bit in one operation).
///
/// Broadcast loads and a masked shift: no lane shuffle, since those share one port with
/// the dot products and limited the 4- and 5-bit decode kernels.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
unsafe fn nibbles_pair_high(pa: *const u8, pb: *const u8) -> __m512i {
    // SAFETY: 16 readable bytes at pa and at pb (the caller's contract).
    let (a, b) = unsafe {
        (
            _mm_loadu_si128(pa as *const __m128i),
            _mm_loadu_si128(pb as *const __m128i),
        )
    };
    // [a, a, b, b] in the four 128-bit lanes, then lanes 1 and 3 shifted to their high
    // nibbles.
    let z = _mm512_mask_broadcast_i32x4(_mm512_broadcast_i32x4(a), 0xFF00, b);
    _mm512_mask_srli_epi16(z, 0xFF00_FF00, z, 4)
}

/// The two rows of pair `p` of a tile: `2p` and `2p + 1`, or `2p` twice when `RR` is odd
/// and `p` is the last pair (its high half is then computed and dropped).
#[inline(always)]
fn pair_rows<const RR: usize>(p: usize) -> (usize, usize) {
    (2 * p, (2 * p + 1).min(RR - 1))
}

/// Every f16 bit pattern's f32 value, as ggml keeps it (`ggml_table_f32_f16`): a block's
/// scale is then a scalar load a broadcast can take from memory, where converting it
/// in a vector register takes a lane shuffle (the port the dot products need too).
fn f16_table() -> &'static [f32; 65536] {
    static TABLE: std::sync::OnceLock<Box<[f32; 65536]>> = std::sync::OnceLock::new();
    TABLE.get_or_init(|| {
        let mut t = Box::new([0f32; 65536]);
        for (i, v) in t.iter_mut().enumerate() {
            *v = half::f16::from_bits(i as u16).to_f32();
        }
        t
    })
}

/// The f16 scales at the start of blocks `wa` and `wb` as f32, `wa`'s in the low 256
/// bits, `wb`'s in the high.
///
/// # Safety
/// `wa` and `wb` must each point to 2 readable bytes.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
unsafe fn scale_pair(f16s: &[f32; 65536], wa: *const u8, wb: *const u8) -> __m512 {
    // SAFETY: 2 readable bytes at each (the caller's contract).
    let (ha, hb) = unsafe {
        (
            (wa as *const u16).read_unaligned(),
            (wb as *const u16).read_unaligned(),
        )
    };
    _mm512_mask_mov_ps(
        _mm512_set1_ps(f16s[ha as usize]),
        0xFF00,
        _mm512_set1_ps(f16s[hb as usize]),
    )
}

/// `[a, a, a, a, a, a, a, a, b, b, b, b, b, b, b, b]` from lanes `a` and `b` of `v`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
fn halves(v: __m128, idx: __m512i) -> __m512 {
    _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(v))
}

/// The 32 activation quants of one block in both 256-bit halves.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
unsafe fn broadcast32(p: *const u8) -> __m512i {
    // SAFETY: the caller keeps 32 bytes readable at `p`; the load is unaligned.
    let q = unsafe { _mm256_loadu_si256(p as *const __m256i) };
    _mm512_broadcast_i64x4(q)
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
unsafe fn q4_1_avx512<const RR: usize, const NT: usize>(
    w: Rows<RR>,
    nb: usize,
    a: [*const u8; NT],
    s: [*const f32; NT],
) -> [[f32; NT]; RR] {
    // SAFETY: `q41_like_avx512`'s contract is this wrapper's (the caller keeps
    // `nb` blocks readable at each row and activation pointer), and this wrapper enables
    // its target features.
    unsafe { q41_like_avx512::<RR, NT, false>(w, nb, a, s) }
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
unsafe fn q5_1_avx512<const RR: usize, const NT: usize>(
    w: Rows<RR>,
    nb: usize,
    a: [*const u8; NT],
    s: [*const f32; NT],
) -> [[f32; NT]; RR] {
    // SAFETY: `q41_like_avx512`'s contract is this wrapper's (the caller keeps
    // `nb` blocks readable at each row and activation pointer), and this wrapper enables
    // its target features.
    unsafe { q41_like_avx512::<RR, NT, true>(w, nb, a, s) }
}

/// The high bits of the 5-bit quants of two blocks as 0x10 / 0x00 bytes, in the element
/// order of [`nibbles_pair`]: bit i of `qh_a` for byte i, bit i of `qh_b` for byte 32 + i.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
fn high_bits_pair(qh_a: u32, qh_b: u32) -> __m512i {
    _mm512_maskz_mov_epi8(qh_a as u64 | ((qh_b as u64) << 32), _mm512_set1_epi8(0x10))
}

/// Q4_1 / Q5_1 x Q8_1 in llama.cpp's summation order (`ggml_vec_dot_q4_1_q8_1`, AVX2 path):
/// per row and token, eight f32 lanes where lane j takes `d_w * d_a * (sum of elements
/// 4j..4j+3)` of each block by one FMA, block after block; then ggml's horizontal sum, plus
/// the `m_w * s_a` terms accumulated by FMA. One 512-bit vector carries two rows, so the
/// order per row is exactly the 256-bit one.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
unsafe fn q41_like_avx512<const RR: usize, const NT: usize, const FIVE: bool>(
    w: Rows<RR>,
    nb: usize,
    a: [*const u8; NT],
    s: [*const f32; NT],
) -> [[f32; NT]; RR] {
    let bb = if FIVE { 24 } else { 20 };
    let np = RR.div_ceil(2);
    // Lanes 0 (d of the first row) and 2 (d of the second) of [d0, m0, d1, m1].
    let idx = _mm512_set_epi32(2, 2, 2, 2, 2, 2, 2, 2, 0, 0, 0, 0, 0, 0, 0, 0);
    let zero = _mm512_setzero_si512();
    let mut acc = [[_mm512_setzero_ps(); NT]; RR];
    // Lanes 1 and 3 accumulate m * s of the two rows.
    let mut accm = [[_mm_setzero_ps(); NT]; RR];
    for b in 0..nb {
        // SAFETY: block b of each row and of each activation row is in bounds.
        unsafe {
            for p in 0..np {
                let (r0, r1) = pair_rows::<RR>(p);
                let (wa, wb) = (w[r0].add(b * bb), w[r1].add(b * bb));
                prefetch_tile_ahead(&w, nb, bb, b, r0);
                prefetch_tile_ahead(&w, nb, bb, b, r1);
                let dm = _mm_cvtph_ps(_mm_set_epi32(
                    0,
                    0,
                    (wb as *const i32).read_unaligned(),
                    (wa as *const i32).read_unaligned(),
                ));
                let d = halves(dm, idx);
                let q = if FIVE {
                    let qa = (wa.add(4) as *const u32).read_unaligned();
                    let qb = (wb.add(4) as *const u32).read_unaligned();
                    _mm512_or_si512(nibbles_pair(wa.add(8), wb.add(8)), high_bits_pair(qa, qb))
                } else {
                    nibbles_pair(wa.add(4), wb.add(4))
                };
                for t in 0..NT {
                    let y = broadcast32(a[t].add(b * 36 + 4));
                    // [d_a, s_a, d_a, s_a]
                    let ds = _mm_castpd_ps(_mm_load1_pd(s[t].add(2 * b) as *const f64));
                    let dd = _mm512_mul_ps(d, _mm512_set1_ps(_mm_cvtss_f32(ds)));
                    let xy = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(zero, q, y));
                    acc[p][t] = _mm512_fmadd_ps(dd, xy, acc[p][t]);
                    accm[p][t] = _mm_fmadd_ps(dm, ds, accm[p][t]);
                }
            }
        }
    }
    let mut res = [[0f32; NT]; RR];
    for p in 0..np {
        let (r0, r1) = pair_rows::<RR>(p);
        for t in 0..NT {
            let m = accm[p][t];
            res[r1][t] = hsum256(_mm512_extractf32x8_ps::<1>(acc[p][t]))
                + _mm_cvtss_f32(_mm_movehdup_ps(_mm_movehl_ps(m, m)));
            res[r0][t] =
                hsum256(_mm512_castps512_ps256(acc[p][t])) + _mm_cvtss_f32(_mm_movehdup_ps(m));
        }
    }
    res
}

/// Block `b` (of `bb` bytes) of each of 4 rows, each prefetched `PREFETCH` bytes ahead.
///
/// # Safety
/// Block `b` of each row must be in bounds.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn blocks4(w: Rows<4>, b: usize, bb: usize) -> [*const u8; 4] {
    // SAFETY: block b of each row is in bounds (the contract).
    let wb: [*const u8; 4] = std::array::from_fn(|r| unsafe { w[r].add(b * bb) });
    for p in wb {
        _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(PREFETCH) as *const i8);
    }
    wb
}

/// [`q41_like_wide_avx512`] for each of `groups` groups of 8 tokens, group `g` (packed at
/// `y(g)`) written to tokens `8 * g ..` of `out`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
unsafe fn q41_like_wide_groups<const FIVE: bool>(
    w: Rows<4>,
    nb: usize,
    y: impl Fn(usize) -> *const u8,
    groups: usize,
    out: TileOut,
) {
    for g in 0..groups {
        // SAFETY: forwarded from the caller.
        let res = unsafe { q41_like_wide_avx512::<FIVE>(w, nb, y(g)) };
        for (i, row) in res.iter().enumerate() {
            for (j, &v) in row.iter().enumerate() {
                // SAFETY: the caller's `out` holds rows 0..4 of tokens 0..8 * groups.
                unsafe { out.put(i, PACK_TOKENS * g + j, v) };
            }
        }
    }
}

/// The prefill form of [`q41_like_avx512`]: rows 0..4 (two 512-bit pairs) against 8
/// tokens of packed Q8_1 activations (`QuantizedActivations::packed_group`), with the
/// same per-row f32 operations in the same order, so the same bits. The `m_w * s_a`
/// terms of all four rows and two tokens share one vector: lanes 2i and 2i + 1 of each
/// half hold `d` and `m` of row i, the low half token 2u, the high half token 2u + 1.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
unsafe fn q41_like_wide_avx512<const FIVE: bool>(
    w: Rows<4>,
    nb: usize,
    y: *const u8,
) -> [[f32; PACK_TOKENS]; 4] {
    const NT: usize = PACK_TOKENS;
    let bb = if FIVE { 24 } else { 20 };
    // d of rows 0 / 1 (lanes 0 / 2 of [d0, m0, d1, m1, d2, m2, d3, m3]) and rows 2 / 3.
    let idx = [
        _mm512_set_epi32(2, 2, 2, 2, 2, 2, 2, 2, 0, 0, 0, 0, 0, 0, 0, 0),
        _mm512_set_epi32(6, 6, 6, 6, 6, 6, 6, 6, 4, 4, 4, 4, 4, 4, 4, 4),
    ];
    // [d_a, s_a] of token 2u four times, then of token 2u + 1, from [d, s, d', s'].
    let ds_idx = _mm512_set_epi32(3, 2, 3, 2, 3, 2, 3, 2, 1, 0, 1, 0, 1, 0, 1, 0);
    let zero = _mm512_setzero_si512();
    let mut acc = [[_mm512_setzero_ps(); NT]; 2];
    let mut accm = [_mm512_setzero_ps(); NT / 2];
    for b in 0..nb {
        // SAFETY: block b of each row and of the packed activations is in bounds.
        unsafe {
            let yb = y.add(b * PACKED_BLOCK_Q8_1);
            let wb = blocks4(w, b, bb);
            let h = _mm_set_epi32(
                (wb[3] as *const i32).read_unaligned(),
                (wb[2] as *const i32).read_unaligned(),
                (wb[1] as *const i32).read_unaligned(),
                (wb[0] as *const i32).read_unaligned(),
            );
            let dm8 = _mm256_cvtph_ps(h);
            let dm = _mm512_broadcast_f32x8(dm8);
            let d = [
                _mm512_permutexvar_ps(idx[0], dm),
                _mm512_permutexvar_ps(idx[1], dm),
            ];
            let x: [__m512i; 2] = std::array::from_fn(|p| {
                let (wa, wb) = (wb[2 * p], wb[2 * p + 1]);
                if FIVE {
                    let qa = (wa.add(4) as *const u32).read_unaligned();
                    let qb = (wb.add(4) as *const u32).read_unaligned();
                    _mm512_or_si512(nibbles_pair(wa.add(8), wb.add(8)), high_bits_pair(qa, qb))
                } else {
                    nibbles_pair(wa.add(4), wb.add(4))
                }
            });
            let sc = yb.add(32 * NT) as *const f32;
            for (u, accm) in accm.iter_mut().enumerate() {
                let ds = _mm512_permutexvar_ps(
                    ds_idx,
                    _mm512_castps128_ps512(_mm_loadu_ps(sc.add(4 * u))),
                );
                // Lane 2i + 1: m_i * s_a, fused as gcc contracts llama.cpp's `summs += m * s`.
                *accm = _mm512_fmadd_ps(dm, ds, *accm);
            }
            // `t` also gives the byte offsets of the token in the packed block.
            #[allow(clippy::needless_range_loop)]
            for t in 0..NT {
                let yv = broadcast32(yb.add(32 * t));
                let da = _mm512_set1_ps(*sc.add(2 * t));
                for p in 0..2 {
                    let xy = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(zero, x[p], yv));
                    acc[p][t] = _mm512_fmadd_ps(_mm512_mul_ps(d[p], da), xy, acc[p][t]);
                }
            }
        }
    }
    let mut lanes = [[0f32; 16]; NT / 2];
    for (l, v) in lanes.iter_mut().zip(accm) {
        // SAFETY: 16 f32 of room.
        unsafe { _mm512_storeu_ps(l.as_mut_ptr(), v) };
    }
    let mut res = [[0f32; NT]; 4];
    for (p, acc) in acc.iter().enumerate() {
        for t in 0..NT {
            let m = |r: usize| lanes[t / 2][8 * (t % 2) + 2 * r + 1];
            res[2 * p + 1][t] = hsum256(_mm512_extractf32x8_ps::<1>(acc[t])) + m(2 * p + 1);
            res[2 * p][t] = hsum256(_mm512_castps512_ps256(acc[t])) + m(2 * p);
        }
    }
    res
}

/// Q8_0 / Q4_0 / Q5_0 (`KIND` 0, 1, 2) x Q8_0 in llama.cpp's summation order
/// (`ggml_vec_dot_q8_0_q8_0`, AVX2 path): eight f32 lanes per row and token, one FMA per
/// block, ggml's horizontal sum. One 512-bit vector carries two rows.
///
/// `vpdpbusd` multiplies unsigned by signed bytes, so the weights go in unsigned with an
/// offset (`x + 128` for Q8_0, the stored 4- or 5-bit quants for Q4_0 / Q5_0) and
/// `offset * (sum of the activations)` per group of four, computed once per token and
/// block for all rows, starts the accumulation negated: exactly `x . y`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
unsafe fn q8_0_like_avx512<const RR: usize, const NT: usize, const KIND: u8>(
    w: Rows<RR>,
    nb: usize,
    a: [*const u8; NT],
    s: [*const f32; NT],
) -> [[f32; NT]; RR] {
    let bb = [34, 18, 22][KIND as usize];
    let offset = _mm512_set1_epi8([-128i8, 8, 16][KIND as usize]);
    let np = RR.div_ceil(2);
    let f16s = f16_table();
    let zero = _mm512_setzero_si512();
    let mut acc = [[_mm512_setzero_ps(); NT]; RR];
    for b in 0..nb {
        // SAFETY: block b of each row and of each activation row is in bounds.
        unsafe {
            let mut y = [zero; NT];
            let mut neg_corr = [zero; NT];
            let mut sy = [_mm512_setzero_ps(); NT];
            for t in 0..NT {
                y[t] = broadcast32(a[t].add(b * 34 + 2));
                neg_corr[t] = _mm512_sub_epi32(zero, _mm512_dpbusd_epi32(zero, offset, y[t]));
                sy[t] = _mm512_set1_ps(*s[t].add(b));
            }
            for (p, acc) in acc.iter_mut().enumerate().take(np) {
                let (r0, r1) = pair_rows::<RR>(p);
                let (wa, wb) = (w[r0].add(b * bb), w[r1].add(b * bb));
                prefetch_tile_ahead(&w, nb, bb, b, r0);
                prefetch_tile_ahead(&w, nb, bb, b, r1);
                let d = scale_pair(f16s, wa, wb);
                let x = q8_0_like_pair::<KIND>(wa, wb);
                for t in 0..NT {
                    let xy = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(neg_corr[t], x, y[t]));
                    acc[t] = _mm512_fmadd_ps(_mm512_mul_ps(d, sy[t]), xy, acc[t]);
                }
            }
        }
    }
    let mut res = [[0f32; NT]; RR];
    for (p, acc) in acc.iter().enumerate().take(np) {
        let (r0, r1) = pair_rows::<RR>(p);
        for t in 0..NT {
            res[r1][t] = hsum256(_mm512_extractf32x8_ps::<1>(acc[t]));
            res[r0][t] = hsum256(_mm512_castps512_ps256(acc[t]));
        }
    }
    res
}

/// Most blocks per row [`q8_0_like_wide_avx512`] decodes once for all token groups (k up
/// to 2048; the decoded rows take 16 KiB of stack). Longer rows decode per group.
const WIDE_MAX_BLOCKS: usize = 64;

/// Block `b` of rows 0..4 of a 32-element format with a Q8_0-like dot (`KIND` 0, 1, 2:
/// Q8_0, Q4_0, Q5_0) decoded for [`q8_0_like_wide_avx512`]: the scales `d` of rows
/// 0 / 1 and 2 / 3 in the two 256-bit halves of each vector, and the weights plus the
/// offset as unsigned bytes, rows 0 / 1 and 2 / 3 side by side.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
unsafe fn q8_0_like_decode4<const KIND: u8>(w: Rows<4>, b: usize) -> ([__m512; 2], [__m512i; 2]) {
    let bb = [34, 18, 22][KIND as usize];
    // Lanes 0 / 2 (d of rows 0 / 2) and 1 / 3 (rows 1 / 3) in the two 256-bit halves.
    let idx = [
        _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0),
        _mm512_set_epi32(3, 3, 3, 3, 3, 3, 3, 3, 2, 2, 2, 2, 2, 2, 2, 2),
    ];
    // SAFETY: block b of each row is in bounds (the caller's contract).
    unsafe {
        let wb = blocks4(w, b, bb);
        let h = _mm_set_epi16(
            0,
            0,
            0,
            0,
            (wb[3] as *const i16).read_unaligned(),
            (wb[2] as *const i16).read_unaligned(),
            (wb[1] as *const i16).read_unaligned(),
            (wb[0] as *const i16).read_unaligned(),
        );
        let d4 = _mm512_castps128_ps512(_mm_cvtph_ps(h));
        let d = [
            _mm512_permutexvar_ps(idx[0], d4),
            _mm512_permutexvar_ps(idx[1], d4),
        ];
        let x: [__m512i; 2] =
            std::array::from_fn(|p| q8_0_like_pair::<KIND>(wb[2 * p], wb[2 * p + 1]));
        (d, x)
    }
}

/// One block of [`q8_0_like_wide_avx512`]: the decoded rows `(d, x)` against the 8
/// tokens of packed block `yb`, one FMA per pair, token and lane.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
unsafe fn q8_0_like_wide_block<const KIND: u8>(
    d: [__m512; 2],
    x: [__m512i; 2],
    yb: *const u8,
    acc: &mut [[__m512; PACK_TOKENS]; 2],
) {
    const NT: usize = PACK_TOKENS;
    // `t` also gives the byte offsets of the token in the packed block.
    #[allow(clippy::needless_range_loop)]
    for t in 0..NT {
        // SAFETY: the packed block holds 8 tokens' quants, sums and scales.
        unsafe {
            let y = broadcast32(yb.add(32 * t));
            let sums = broadcast32(yb.add(32 * NT + 32 * t));
            // -offset * (sum of each group of four activations); the packed sums are
            // already times 16 (Q5_0's offset).
            let corr = match KIND {
                1 => _mm512_srai_epi32::<1>(sums),
                2 => sums,
                _ => _mm512_slli_epi32::<3>(sums),
            };
            let sy = _mm512_set1_ps((yb.add(64 * NT + 4 * t) as *const f32).read_unaligned());
            for p in 0..2 {
                let xy = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(corr, x[p], y));
                acc[p][t] = _mm512_fmadd_ps(_mm512_mul_ps(d[p], sy), xy, acc[p][t]);
            }
        }
    }
}

/// The 32 weights of blocks `wa` and `wb` (`KIND` 0, 1, 2: Q8_0, Q4_0, Q5_0) plus the
/// format's offset (128, 8, 16) as unsigned bytes, `wa`'s in the low 256 bits.
///
/// # Safety
/// `wa` and `wb` must each point to a whole block.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
unsafe fn q8_0_like_pair<const KIND: u8>(wa: *const u8, wb: *const u8) -> __m512i {
    // SAFETY: whole blocks at wa and wb (the contract).
    unsafe {
        match KIND {
            1 => nibbles_pair(wa.add(2), wb.add(2)),
            2 => {
                let qa = (wa.add(2) as *const u32).read_unaligned();
                let qb = (wb.add(2) as *const u32).read_unaligned();
                let q = nibbles_pair_high(wa.add(6), wb.add(6));
                // (q & 0x0F) | high bits, in one ternary-logic operation.
                _mm512_ternarylogic_epi32::<0xEA>(q, _mm512_set1_epi8(0x0F), high_bits_pair(qa, qb))
            }
            _ => _mm512_xor_si512(
                _mm512_inserti64x4::<1>(
                    _mm512_castsi256_si512(_mm256_loadu_si256(wa.add(2) as *const __m256i)),
                    _mm256_loadu_si256(wb.add(2) as *const __m256i),
                ),
                _mm512_set1_epi8(-128),
            ),
        }
    }
}

/// The prefill form of [`q8_0_like_avx512`]: rows 0..4 (two 512-bit pairs) against
/// `groups` groups of 8 tokens, each decoded weight block used for all 8 tokens of a
/// group and each activation block for both pairs; the same per-row f32 operations in
/// the same order (one `d_w * d_a` product and one FMA per block and lane, then ggml's
/// horizontal sum), so the same bits. Rows of at most [`WIDE_MAX_BLOCKS`] blocks are
/// decoded once (weights and scales, into a buffer on the stack) for every group rather
/// than once per group. The activations come packed
/// (`QuantizedActivations::packed_group`: one pointer, constant offsets); the offset
/// correction is their precomputed negated group sums times 16, shifted to the offset
/// (128, 8 and 16 are powers of two), not recomputed per tile. Group `g` writes tokens
/// `8 * g ..` of `out` as it ends (stores spread over the work, not in one burst).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
unsafe fn q8_0_like_wide_avx512<const KIND: u8>(
    w: Rows<4>,
    nb: usize,
    y: impl Fn(usize) -> *const u8,
    groups: usize,
    out: TileOut,
) {
    const NT: usize = PACK_TOKENS;
    let cached = nb <= WIDE_MAX_BLOCKS;
    let mut rows =
        [std::mem::MaybeUninit::<([__m512; 2], [__m512i; 2])>::uninit(); WIDE_MAX_BLOCKS];
    if cached {
        for (b, r) in rows.iter_mut().enumerate().take(nb) {
            // SAFETY: block b < nb of each row is in bounds.
            r.write(unsafe { q8_0_like_decode4::<KIND>(w, b) });
        }
    }
    for g in 0..groups {
        let yg = y(g);
        let mut acc = [[_mm512_setzero_ps(); NT]; 2];
        // `b` indexes the decoded rows only when they were cached.
        #[allow(clippy::needless_range_loop)]
        for b in 0..nb {
            // SAFETY: blocks 0..nb were written above when `cached`; block b of each
            // row and of the packed group is in bounds.
            unsafe {
                let (d, x) = if cached {
                    rows[b].assume_init()
                } else {
                    q8_0_like_decode4::<KIND>(w, b)
                };
                q8_0_like_wide_block::<KIND>(d, x, yg.add(b * PACKED_BLOCK), &mut acc);
            }
        }
        for (p, acc) in acc.iter().enumerate() {
            for (t, &v) in acc.iter().enumerate() {
                // SAFETY: the caller's `out` holds rows 0..4 of tokens 0..8 * groups.
                unsafe {
                    out.put(
                        2 * p + 1,
                        NT * g + t,
                        hsum256(_mm512_extractf32x8_ps::<1>(v)),
                    );
                    out.put(2 * p, NT * g + t, hsum256(_mm512_castps512_ps256(v)));
                }
            }
        }
    }
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
unsafe fn q8_0_avx512<const RR: usize, const NT: usize>(
    w: Rows<RR>,
    nb: usize,
    a: [*const u8; NT],
    s: [*const f32; NT],
) -> [[f32; NT]; RR] {
    // SAFETY: `q8_0_like_avx512`'s contract is this wrapper's (the caller keeps
    // `nb` blocks readable at each row and activation pointer), and this wrapper enables
    // its target features.
    unsafe { q8_0_like_avx512::<RR, NT, 0>(w, nb, a, s) }
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
unsafe fn q4_0_avx512<const RR: usize, const NT: usize>(
    w: Rows<RR>,
    nb: usize,
    a: [*const u8; NT],
    s: [*const f32; NT],
) -> [[f32; NT]; RR] {
    // SAFETY: `q8_0_like_avx512`'s contract is this wrapper's (the caller keeps
    // `nb` blocks readable at each row and activation pointer), and this wrapper enables
    // its target features.
    unsafe { q8_0_like_avx512::<RR, NT, 1>(w, nb, a, s) }
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
unsafe fn q5_0_avx512<const RR: usize, const NT: usize>(
    w: Rows<RR>,
    nb: usize,
    a: [*const u8; NT],
    s: [*const f32; NT],
) -> [[f32; NT]; RR] {
    // SAFETY: `q8_0_like_avx512`'s contract is this wrapper's (the caller keeps
    // `nb` blocks readable at each row and activation pointer), and this wrapper enables
    // its target features.
    unsafe { q8_0_like_avx512::<RR, NT, 2>(w, nb, a, s) }
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

/// Sums the 16 i32 lanes of each of four vectors: `[sum v[0], .., sum v[3]]`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
fn reduce4_epi32(v: [__m512i; 4]) -> __m128i {
    // 128-bit lanes [v0 (2 lanes), v1 (2 lanes)], then [v0, v1, v2, v3] with one lane each.
    let fold = |x: __m512i, y: __m512i| {
        _mm512_add_epi32(
            _mm512_shuffle_i64x2::<0x44>(x, y),
            _mm512_shuffle_i64x2::<0xEE>(x, y),
        )
    };
    let (x01, x23) = (fold(v[0], v[1]), fold(v[2], v[3]));
    let y = _mm512_add_epi32(
        _mm512_shuffle_i64x2::<0x88>(x01, x23),
        _mm512_shuffle_i64x2::<0xDD>(x01, x23),
    );
    // Each 128-bit lane's total in all four of its i32, then lanes 0, 4, 8, 12 gathered.
    let y = _mm512_add_epi32(y, _mm512_shuffle_epi32::<0x4E>(y));
    let y = _mm512_add_epi32(y, _mm512_shuffle_epi32::<0xB1>(y));
    let idx = _mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
    _mm512_castsi512_si128(_mm512_permutexvar_epi32(idx, y))
}

/// Sums the four i32 lanes of each of four vectors: `[sum v[0], .., sum v[3]]`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
fn reduce4_epi32_128(v: [__m128i; 4]) -> __m128i {
    _mm_hadd_epi32(_mm_hadd_epi32(v[0], v[1]), _mm_hadd_epi32(v[2], v[3]))
}

/// A `vpermw` index vector: word lane i takes word `f(i)`.
#[inline(always)]
fn word_index(f: impl Fn(usize) -> usize) -> __m512i {
    let lanes: [i16; 32] = std::array::from_fn(|i| f(i) as i16);
    // SAFETY: 64 readable bytes; an unaligned load.
    unsafe { _mm512_loadu_si512(lanes.as_ptr() as *const __m512i) }
}

/// Up to 8 (row, token) pairs of a tile, `c = r * NT + t`, handled four at a time.
const K_GROUPS: usize = 2;

/// A Q4_K / Q5_K superblock decoded for [`q45_k_rows`]: the 256 quants as unsigned
/// bytes, each 512-bit vector holding sub-blocks `2c` and `2c + 1` (side by side in the
/// activations too); each sub-block's 6-bit scale in the word lanes that meet it; the
/// eight mins as words; `d` and `dmin`.
#[derive(Clone, Copy)]
struct K45Block {
    wv: [__m512i; 4],
    sv: [__m512i; 4],
    mn: __m128i,
    d: f32,
    dmin: f32,
}

/// Decodes the Q4_K (`FIVE == false`) or Q5_K superblock at `x`.
///
/// # Safety
/// `x` must point to a whole superblock; the CPU must support AVX-512 VNNI.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
unsafe fn q45_k_decode<const FIVE: bool>(x: *const u8) -> K45Block {
    let m4 = _mm512_set1_epi8(0x0F);
    // SAFETY: a whole superblock at x (the contract).
    unsafe {
        let hd = f16x2(x);
        let (sc, mn) = k4_scales_mins(x.add(4));
        let sc = _mm512_castsi128_si512(_mm_cvtepu8_epi16(_mm_cvtsi64_si128(sc as i64)));
        let qs = x.add(if FIVE { 48 } else { 16 });
        let mut wv = [_mm512_setzero_si512(); 4];
        for h in 0..2 {
            // Bytes of chunks 2h and 2h + 1: low nibbles are sub-blocks 4h and 4h + 2,
            // high nibbles 4h + 1 and 4h + 3.
            let q = _mm512_loadu_si512(qs.add(64 * h) as *const __m512i);
            let lo = _mm512_and_si512(q, m4);
            let hi = _mm512_and_si512(_mm512_srli_epi16::<4>(q), m4);
            wv[2 * h] = _mm512_shuffle_i64x2::<0x44>(lo, hi);
            wv[2 * h + 1] = _mm512_shuffle_i64x2::<0xEE>(lo, hi);
        }
        if FIVE {
            let sixteen = _mm512_set1_epi8(16);
            let qh = _mm512_broadcast_i64x4(_mm256_loadu_si256(x.add(16) as *const __m256i));
            for (c, v) in wv.iter_mut().enumerate() {
                // The fifth bit of sub-block j is bit j of qh[l].
                let hmask = _mm512_inserti64x4::<1>(
                    _mm512_set1_epi8((1u8 << (2 * c)) as i8),
                    _mm256_set1_epi8((1u8 << (2 * c + 1)) as i8),
                );
                let k = _mm512_test_epi8_mask(qh, hmask);
                *v = _mm512_mask_add_epi8(*v, k, *v, sixteen);
            }
        }
        // Word lanes 0..16 take scale 2c, lanes 16..32 scale 2c + 1.
        let sv =
            std::array::from_fn(|c| _mm512_permutexvar_epi16(word_index(|i| 2 * c + i / 16), sc));
        K45Block {
            wv,
            sv,
            mn: _mm_cvtepu8_epi16(_mm_cvtsi64_si128(mn as i64)),
            d: _mm_cvtss_f32(hd),
            dmin: _mm_cvtss_f32(_mm_movehdup_ps(hd)),
        }
    }
}

/// A Q6_K superblock decoded for [`q6_k_rows`]: the 256 unsigned 6-bit quants, 64
/// consecutive ones per vector (each 128-bit lane 16 of one scale); each scale in the
/// word lanes that meet it; `-32 * scale` in the word lanes of the Q8_K block sums; `d`.
#[derive(Clone, Copy)]
struct K6Block {
    wv: [__m512i; 4],
    sv: [__m512i; 4],
    neg32: __m512i,
    d: f32,
}

/// Decodes the Q6_K superblock at `x`.
///
/// # Safety
/// `x` must point to a whole superblock; the CPU must support AVX-512 VNNI.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
unsafe fn q6_k_decode(x: *const u8) -> K6Block {
    let m4 = _mm512_set1_epi8(0x0F);
    let m30 = _mm512_set1_epi8(0x30);
    // Bits (0, 1) of qh to (4, 5) for the first 32 quants, bits (2, 3) for the next 32;
    // then bits (4, 5) where they are and (6, 7) down by two.
    let shl_a = _mm512_inserti64x4::<1>(_mm512_set1_epi16(4), _mm256_set1_epi16(2));
    let shr_b = _mm512_inserti64x4::<1>(_mm512_set1_epi16(0), _mm256_set1_epi16(2));
    // SAFETY: a whole superblock at x (the contract).
    unsafe {
        let d = _mm_cvtss_f32(f16x1(x.add(208)));
        let sc = _mm256_cvtepi8_epi16(_mm_loadu_si128(x.add(192) as *const __m128i));
        let neg32 = _mm512_zextsi256_si512(_mm256_sub_epi16(
            _mm256_setzero_si256(),
            _mm256_slli_epi16::<5>(sc),
        ));
        let sc = _mm512_zextsi256_si512(sc);
        let mut wv = [_mm512_setzero_si512(); 4];
        for n in 0..2 {
            // ql[64n..64n + 64]: low nibbles are quants 128n + 0..64, high nibbles
            // 128n + 64..128; qh[32n..32n + 32] gives both halves their top bits.
            let ql = _mm512_loadu_si512(x.add(64 * n) as *const __m512i);
            let qh =
                _mm512_broadcast_i64x4(_mm256_loadu_si256(x.add(128 + 32 * n) as *const __m256i));
            let lo = _mm512_and_si512(ql, m4);
            let hi = _mm512_and_si512(_mm512_srli_epi16::<4>(ql), m4);
            // a | (b & c)
            wv[2 * n] = _mm512_ternarylogic_epi32::<0xF8>(lo, _mm512_sllv_epi16(qh, shl_a), m30);
            wv[2 * n + 1] =
                _mm512_ternarylogic_epi32::<0xF8>(hi, _mm512_srlv_epi16(qh, shr_b), m30);
        }
        // Word lanes of vector g: scale 4g + lane / 8.
        let sv =
            std::array::from_fn(|g| _mm512_permutexvar_epi16(word_index(|i| 4 * g + i / 8), sc));
        K6Block { wv, sv, neg32, d }
    }
}

/// Most superblocks per row the K-quant prefill tile decodes once for all its tokens
/// (k up to 8192; 2 rows take about 36 KiB of stack). Longer rows decode per 4 tokens.
const K_MAX_BLOCKS: usize = 32;

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
unsafe fn q4_k_avx512<const RR: usize, const NT: usize>(
    w: Rows<RR>,
    nb: usize,
    a: [*const u8; NT],
    s: [*const f32; NT],
) -> [[f32; NT]; RR] {
    // SAFETY: forwarded from the caller.
    unsafe {
        q45_k_rows::<RR, NT>(
            |r, b| {
                prefetch_tile_ahead(&w, nb, 144, b, r);
                q45_k_decode::<false>(w[r].add(b * 144))
            },
            nb,
            a,
            s,
        )
    }
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
unsafe fn q5_k_avx512<const RR: usize, const NT: usize>(
    w: Rows<RR>,
    nb: usize,
    a: [*const u8; NT],
    s: [*const f32; NT],
) -> [[f32; NT]; RR] {
    // SAFETY: forwarded from the caller.
    unsafe {
        q45_k_rows::<RR, NT>(
            |r, b| {
                prefetch_tile_ahead(&w, nb, 176, b, r);
                q45_k_decode::<true>(w[r].add(b * 176))
            },
            nb,
            a,
            s,
        )
    }
}

/// Q4_K / Q5_K x Q8_K with the f32 arithmetic of the scalar and AVX2 kernels (one
/// `acc += d * dy * sumi - dmin * dy * summ` per superblock, so the same bits), the
/// integers computed 64 quants per instruction pair: `vpmaddubsw` of unsigned quants and
/// activations (pairs at most 2 * 31 * 128, no saturation), then `vpdpwssd` with the
/// sub-block's scale. The integer totals of four (row, token) pairs are reduced together
/// and the f32 step runs on four lanes. `blk(r, b)` gives superblock `b` of row `r`
/// decoded (from the weights, or from rows decoded once for many tokens).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
unsafe fn q45_k_rows<const RR: usize, const NT: usize>(
    blk: impl Fn(usize, usize) -> K45Block,
    nb: usize,
    a: [*const u8; NT],
    s: [*const f32; NT],
) -> [[f32; NT]; RR] {
    const { assert!(RR * NT <= 4 * K_GROUPS) };
    let pairs = RR * NT;
    let mut acc = [_mm_setzero_ps(); K_GROUPS];
    for b in 0..nb {
        // SAFETY: superblock b of each row and activation row is in bounds.
        unsafe {
            let mut q8s = [_mm_setzero_si128(); NT];
            let mut dy = [0f32; NT];
            let mut y = [std::ptr::null::<u8>(); NT];
            for t in 0..NT {
                y[t] = a[t].add(b * 292);
                dy[t] = *s[t].add(b);
                // Sums of the activations of each 32-value sub-block.
                let bs = _mm256_loadu_si256(y[t].add(260) as *const __m256i);
                q8s[t] = _mm_hadd_epi16(
                    _mm256_castsi256_si128(bs),
                    _mm256_extracti128_si256::<1>(bs),
                );
            }
            let mut sums = [[_mm512_setzero_si512(); NT]; RR];
            let mut msums = [[_mm_setzero_si128(); NT]; RR];
            let mut d = [0f32; RR];
            let mut dmin = [0f32; RR];
            for r in 0..RR {
                let x = blk(r, b);
                d[r] = x.d;
                dmin[r] = x.dmin;
                for t in 0..NT {
                    let yq = y[t].add(4);
                    let mut sum = _mm512_setzero_si512();
                    for c in 0..4 {
                        let yv = _mm512_loadu_si512(yq.add(64 * c) as *const __m512i);
                        sum = _mm512_dpwssd_epi32(sum, _mm512_maddubs_epi16(x.wv[c], yv), x.sv[c]);
                    }
                    sums[r][t] = sum;
                    msums[r][t] = _mm_madd_epi16(x.mn, q8s[t]);
                }
            }
            for (g, acc) in acc.iter_mut().enumerate().take(pairs.div_ceil(4)) {
                let mut si = [_mm512_setzero_si512(); 4];
                let mut sm = [_mm_setzero_si128(); 4];
                let mut dd = [0f32; 4];
                let mut dm = [0f32; 4];
                for k in 0..4 {
                    let c = 4 * g + k;
                    if c < pairs {
                        let (r, t) = (c / NT, c % NT);
                        si[k] = sums[r][t];
                        sm[k] = msums[r][t];
                        dd[k] = d[r] * dy[t];
                        dm[k] = dmin[r] * dy[t];
                    }
                }
                let fsi = _mm_cvtepi32_ps(reduce4_epi32(si));
                let fsm = _mm_cvtepi32_ps(reduce4_epi32_128(sm));
                let v = _mm_sub_ps(
                    _mm_mul_ps(_mm_loadu_ps(dd.as_ptr()), fsi),
                    _mm_mul_ps(_mm_loadu_ps(dm.as_ptr()), fsm),
                );
                *acc = _mm_add_ps(*acc, v);
            }
        }
    }
    k_results(acc)
}

/// Expands the prefill tile of a K-quant on AVX-512: 2 rows x any number of tokens with
/// the rows decoded once (up to [`K_MAX_BLOCKS`] superblocks) and the tokens taken 4 at
/// a time (then a tail of 1 to 3) through `$rows`; any other shape through `$narrow`,
/// the tokens split into groups of at most 4.
macro_rules! tile_k_wide_fn {
    ($name:ident, $narrow:ident, $block:ty, $decode:expr, $rows:ident, $bb:expr) => {
        /// # Safety
        /// The CPU must support AVX-512 VNNI; `w` and `acts` must be validated.
        unsafe fn $name(
            w: &[u8],
            rb: usize,
            acts: &QuantizedActivations,
            t0: usize,
            nt: usize,
            out: &mut [f32],
            stride: usize,
        ) {
            let (rr, nb) = (w.len() / rb, rb / $bb);
            if rr != 2 || nt <= 4 || nb > K_MAX_BLOCKS {
                // SAFETY: forwarded from the caller.
                return unsafe { by_4_tokens($narrow, w, rb, acts, t0, nt, out, stride) };
            }
            let mut rows = [[std::mem::MaybeUninit::<$block>::uninit(); K_MAX_BLOCKS]; 2];
            for (r, row) in rows.iter_mut().enumerate() {
                for (b, x) in row.iter_mut().enumerate().take(nb) {
                    // SAFETY: superblock b < nb of row r is in bounds.
                    x.write(unsafe { $decode(w[r * rb + b * $bb..].as_ptr()) });
                }
            }
            // SAFETY: blocks 0..nb of both rows were written above.
            let blk = |r: usize, b: usize| unsafe { rows[r][b].assume_init() };
            #[inline(always)]
            unsafe fn run<const NT: usize>(
                blk: impl Fn(usize, usize) -> $block,
                nb: usize,
                acts: &QuantizedActivations,
                t0: usize,
                out: &mut [f32],
                stride: usize,
            ) {
                let (a, s) = act_ptrs::<NT>(acts, t0);
                // SAFETY: forwarded from the caller.
                let res = unsafe { $rows::<2, NT>(blk, nb, a, s) };
                for (i, row) in res.iter().enumerate() {
                    out[i * stride..i * stride + NT].copy_from_slice(row);
                }
            }
            let mut j = 0;
            // SAFETY: forwarded from the caller.
            unsafe {
                while j + 4 <= nt {
                    run::<4>(&blk, nb, acts, t0 + j, &mut out[j..], stride);
                    j += 4;
                }
                match nt - j {
                    3 => run::<3>(&blk, nb, acts, t0 + j, &mut out[j..], stride),
                    2 => run::<2>(&blk, nb, acts, t0 + j, &mut out[j..], stride),
                    1 => run::<1>(&blk, nb, acts, t0 + j, &mut out[j..], stride),
                    _ => {}
                }
            }
        }
    };
}

tile_k_wide_fn!(
    tile_q4_k_avx512,
    tile_q4_k_avx512_narrow,
    K45Block,
    q45_k_decode::<false>,
    q45_k_rows,
    144
);
tile_k_wide_fn!(
    tile_q5_k_avx512,
    tile_q5_k_avx512_narrow,
    K45Block,
    q45_k_decode::<true>,
    q45_k_rows,
    176
);
tile_k_wide_fn!(
    tile_q6_k_avx512,
    tile_q6_k_avx512_narrow,
    K6Block,
    q6_k_decode,
    q6_k_rows,
    210
);

/// The f32 lanes of the pair groups as `[row][token]` (pair `c = r * NT + t`).
#[inline(always)]
fn k_results<const RR: usize, const NT: usize>(acc: [__m128; K_GROUPS]) -> [[f32; NT]; RR] {
    let mut lanes = [0f32; 4 * K_GROUPS];
    for (g, v) in acc.iter().enumerate() {
        // SAFETY: `lanes` has room for four f32 at 4g.
        unsafe { _mm_storeu_ps(lanes.as_mut_ptr().add(4 * g), *v) };
    }
    std::array::from_fn(|r| std::array::from_fn(|t| lanes[r * NT + t]))
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
unsafe fn q6_k_avx512<const RR: usize, const NT: usize>(
    w: Rows<RR>,
    nb: usize,
    a: [*const u8; NT],
    s: [*const f32; NT],
) -> [[f32; NT]; RR] {
    // SAFETY: forwarded from the caller.
    unsafe {
        q6_k_rows::<RR, NT>(
            |r, b| {
                prefetch_tile_ahead(&w, nb, 210, b, r);
                q6_k_decode(w[r].add(b * 210))
            },
            nb,
            a,
            s,
        )
    }
}

/// Q6_K x Q8_K with the f32 arithmetic of the scalar and AVX2 kernels (one
/// `acc += d * dy * sumi` per superblock, so the same bits). The unsigned 6-bit quants go
/// through `vpmaddubsw` (pairs at most 2 * 63 * 128) and `vpdpwssd` with their i8 scale;
/// the -32 offset is one more `vpdpwssd` of the Q8_K block sums with `-32 * scale`.
/// `blk(r, b)` gives superblock `b` of row `r` decoded.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
unsafe fn q6_k_rows<const RR: usize, const NT: usize>(
    blk: impl Fn(usize, usize) -> K6Block,
    nb: usize,
    a: [*const u8; NT],
    s: [*const f32; NT],
) -> [[f32; NT]; RR] {
    const { assert!(RR * NT <= 4 * K_GROUPS) };
    let pairs = RR * NT;
    let mut acc = [_mm_setzero_ps(); K_GROUPS];
    for b in 0..nb {
        // SAFETY: superblock b of each row and activation row is in bounds.
        unsafe {
            let mut bs = [_mm512_setzero_si512(); NT];
            let mut dy = [0f32; NT];
            let mut y = [std::ptr::null::<u8>(); NT];
            for t in 0..NT {
                y[t] = a[t].add(b * 292);
                dy[t] = *s[t].add(b);
                bs[t] = _mm512_zextsi256_si512(_mm256_loadu_si256(y[t].add(260) as *const __m256i));
            }
            let mut sums = [[_mm512_setzero_si512(); NT]; RR];
            let mut d = [0f32; RR];
            for r in 0..RR {
                let x = blk(r, b);
                d[r] = x.d;
                for t in 0..NT {
                    let yq = y[t].add(4);
                    let mut sum = _mm512_dpwssd_epi32(_mm512_setzero_si512(), bs[t], x.neg32);
                    for g in 0..4 {
                        let yv = _mm512_loadu_si512(yq.add(64 * g) as *const __m512i);
                        sum = _mm512_dpwssd_epi32(sum, _mm512_maddubs_epi16(x.wv[g], yv), x.sv[g]);
                    }
                    sums[r][t] = sum;
                }
            }
            for (g, acc) in acc.iter_mut().enumerate().take(pairs.div_ceil(4)) {
                let mut si = [_mm512_setzero_si512(); 4];
                let mut dd = [0f32; 4];
                for k in 0..4 {
                    let c = 4 * g + k;
                    if c < pairs {
                        let (r, t) = (c / NT, c % NT);
                        si[k] = sums[r][t];
                        dd[k] = d[r] * dy[t];
                    }
                }
                let fsi = _mm_cvtepi32_ps(reduce4_epi32(si));
                *acc = _mm_add_ps(*acc, _mm_mul_ps(_mm_loadu_ps(dd.as_ptr()), fsi));
            }
        }
    }
    k_results(acc)
}

// ---------------------------------------------------------------- activation quantization

/// Quantizes rows to Q8_0 (`Q8_1 == false`) or Q8_1 exactly like
/// `blocks::quantize_activation_blocks` (llama.cpp's x86 rule: scale by `127 / amax`,
/// round half to even; f16 scales rounded to nearest even),
/// appending each block's f32 scales to `scales`.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C; `x.len()` must be a multiple of 32 and `out`
/// exactly the quantized size.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn quantize_q8_avx2<const Q8_1: bool>(
    x: &[f32],
    out: &mut [u8],
    scales: &mut Vec<f32>,
) {
    let bb = if Q8_1 { 36 } else { 34 };
    let qoff = if Q8_1 { 4 } else { 2 };
    let sign = _mm256_set1_ps(-0.0);
    let perm = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (xb, ob) in x.chunks_exact(32).zip(out.chunks_exact_mut(bb)) {
        // SAFETY: `xb` has 32 values and `ob` one block.
        unsafe {
            let p = xb.as_ptr();
            let v = [
                _mm256_loadu_ps(p),
                _mm256_loadu_ps(p.add(8)),
                _mm256_loadu_ps(p.add(16)),
                _mm256_loadu_ps(p.add(24)),
            ];
            let mut m = _mm256_andnot_ps(sign, v[0]);
            for vi in &v[1..] {
                m = _mm256_max_ps(m, _mm256_andnot_ps(sign, *vi));
            }
            let m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps::<1>(m));
            let m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
            let m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
            let amax = _mm_cvtss_f32(m4);
            let d = amax / 127.0;
            let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
            let dh = _mm_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(_mm_set_ss(d));
            let dh16 = _mm_extract_epi16::<0>(dh) as u16;
            ob[0..2].copy_from_slice(&dh16.to_le_bytes());
            let vid = _mm256_set1_ps(id);
            let mut q = [_mm256_setzero_si256(); 4];
            for j in 0..4 {
                // Round half to even, as llama.cpp's `_mm256_round_ps(.., _MM_ROUND_NEAREST)`.
                let y = _mm256_mul_ps(v[j], vid);
                let r = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(y);
                q[j] = _mm256_cvtps_epi32(r);
            }
            let q01 = _mm256_packs_epi32(q[0], q[1]);
            let q23 = _mm256_packs_epi32(q[2], q[3]);
            let q8 = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(q01, q23), perm);
            _mm256_storeu_si256(ob.as_mut_ptr().add(qoff) as *mut __m256i, q8);
            scales.push(f16::from_bits(dh16).to_f32());
            if Q8_1 {
                let s32 =
                    _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
                let sum = hsum_epi32(s32);
                let sh = _mm_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(_mm_set_ss(sum as f32 * d));
                let sh16 = _mm_extract_epi16::<0>(sh) as u16;
                ob[2..4].copy_from_slice(&sh16.to_le_bytes());
                scales.push(f16::from_bits(sh16).to_f32());
            }
        }
    }
}

/// Quantizes rows to Q8_K exactly like `blocks::quantize_blocks` (llama.cpp's
/// `quantize_row_q8_K_ref`: scale `-127 / max` by the signed value of largest magnitude,
/// first one on ties; round half to even; clamp at 127; sums of each 16 quants),
/// appending each block's f32 scale to `scales`.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C; `x.len()` must be a multiple of 256 and `out`
/// exactly the quantized size.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn quantize_q8_k_avx2(x: &[f32], out: &mut [u8], scales: &mut Vec<f32>) {
    let sign = _mm256_set1_ps(-0.0);
    let perm = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    let top = _mm256_set1_epi32(127);
    for (xb, ob) in x.chunks_exact(256).zip(out.chunks_exact_mut(292)) {
        let p = xb.as_ptr();
        let mut m = _mm256_setzero_ps();
        for i in 0..32 {
            // SAFETY: 256 values at p.
            let v = unsafe { _mm256_loadu_ps(p.add(8 * i)) };
            m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v));
        }
        let m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps::<1>(m));
        let m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        let amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
        if amax == 0.0 {
            ob.fill(0);
            scales.push(0.0);
            continue;
        }
        // The scalar scan keeps the first value reaching the largest magnitude.
        let max = xb.iter().copied().find(|v| v.abs() == amax).unwrap_or(amax);
        let iscale = -127.0f32 / max;
        let vs = _mm256_set1_ps(iscale);
        for c in 0..8 {
            let mut q = [_mm256_setzero_si256(); 4];
            for (j, qj) in q.iter_mut().enumerate() {
                // SAFETY: 256 values at p.
                let v = unsafe { _mm256_loadu_ps(p.add(32 * c + 8 * j)) };
                // Round half to even (the default MXCSR mode), as ggml's `nearest_int`
                // for magnitudes below 2^22 (these are at most about 127).
                *qj = _mm256_min_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(v, vs)), top);
            }
            let q01 = _mm256_packs_epi32(q[0], q[1]);
            let q23 = _mm256_packs_epi32(q[2], q[3]);
            let q8 = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(q01, q23), perm);
            // SAFETY: bytes 4 + 32c .. 36 + 32c of the 292-byte block.
            unsafe { _mm256_storeu_si256(ob.as_mut_ptr().add(4 + 32 * c) as *mut __m256i, q8) };
            for h in 0..2 {
                let sum = hsum_epi32(_mm256_add_epi32(q[2 * h], q[2 * h + 1])) as i16;
                let g = 2 * c + h;
                ob[260 + 2 * g..262 + 2 * g].copy_from_slice(&sum.to_le_bytes());
            }
        }
        let d = 1.0 / iscale;
        ob[0..4].copy_from_slice(&d.to_le_bytes());
        scales.push(d);
    }
}

/// `acc += (d · scale) · q` for each Q8_0 block of `row`, 32 values of `acc` a block
/// (`acc.len() == row.len() / 34 * 32`): the product and the add rounded apart, as the
/// scalar reference [`ballast_core::neurons::axpy_row`] does, so the result is the same
/// bit for bit.
///
/// # Safety
/// The CPU must support AVX-512 F/BW/VL/DQ; `acc` must hold 32 values per block.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
pub(crate) unsafe fn axpy_q8_0_avx512(row: &[u8], scale: f32, acc: &mut [f32]) {
    debug_assert_eq!(row.len() / 34 * 32, acc.len());
    for (block, a) in row.chunks_exact(34).zip(acc.chunks_exact_mut(32)) {
        let d = _mm512_set1_ps(f16::from_le_bytes([block[0], block[1]]).to_f32() * scale);
        // SAFETY: a block holds 32 quants after its 2-byte scale and `a` 32 values;
        // unaligned loads and stores.
        unsafe {
            let q = _mm256_loadu_si256(block.as_ptr().add(2) as *const __m256i);
            let lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(q)));
            let hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(q, 1)));
            let p = a.as_mut_ptr();
            let v0 = _mm512_add_ps(_mm512_loadu_ps(p), _mm512_mul_ps(d, lo));
            let v1 = _mm512_add_ps(_mm512_loadu_ps(p.add(16)), _mm512_mul_ps(d, hi));
            _mm512_storeu_ps(p, v0);
            _mm512_storeu_ps(p.add(16), v1);
        }
    }
}

/// [`axpy_q8_0_avx512`] on AVX2, eight values at a time.
///
/// # Safety
/// The CPU must support AVX2; `acc` must hold 32 values per block.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn axpy_q8_0_avx2(row: &[u8], scale: f32, acc: &mut [f32]) {
    debug_assert_eq!(row.len() / 34 * 32, acc.len());
    for (block, a) in row.chunks_exact(34).zip(acc.chunks_exact_mut(32)) {
        let d = _mm256_set1_ps(f16::from_le_bytes([block[0], block[1]]).to_f32() * scale);
        // SAFETY: a block holds 32 quants after its 2-byte scale and `a` 32 values;
        // unaligned loads and stores of 8 bytes / 8 floats within them.
        unsafe {
            for i in 0..4 {
                let q8 = _mm_loadl_epi64(block.as_ptr().add(2 + 8 * i) as *const __m128i);
                let q = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q8));
                let p = a.as_mut_ptr().add(8 * i);
                _mm256_storeu_ps(p, _mm256_add_ps(_mm256_loadu_ps(p), _mm256_mul_ps(d, q)));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::{quantize_activations, scalar};

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
        if level == "avx512" && bl == 256 {
            // 2 rows x more than 4 tokens: the rows decoded once, the tokens 4 at a time
            // and a tail; rows longer than that decodes (`K_MAX_BLOCKS`).
            shapes.extend([(2, 5), (2, 8), (2, 9), (2, 7)]);
            blocks.push(K_MAX_BLOCKS + 1);
        }
        for nb in blocks {
            let k = bl * nb;
            let rb = ty.block_bytes() * nb;
            for n in tokens.clone() {
                let rows = 5;
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
