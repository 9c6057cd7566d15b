//! The AVX2 (+FMA, F16C) tile kernels: the 32-element formats (Q4_0, Q4_1, Q5_0, Q5_1,
//! Q8_0, in llama.cpp's `maddubs` order), the K-quants (Q4_K, Q5_K, Q6_K, one f32 lane
//! per (row, token) pair in the final step) and the plain float weights (F32, F16,
//! BF16). Separate from AVX-512 because it is a level of its own: the one every x86-64
//! CPU since Haswell runs, and AVX-512's fallback for the types it has no kernel for.

use super::{f16_table, f16x1, f16x2, hsum256, k4_scales_mins, prefetch_tile_ahead, tile_fn, Rows};
use crate::quant::QuantizedActivations;
use std::arch::x86_64::*;

// A kernel shared by several formats takes the format as its last const argument.
// Prefill of the 32-element formats in whole token groups goes to `avx2_wide`.
tile_fn!(tile_q4_0_avx2_narrow, q8_0_like_avx2, [1], 18);
tile_fn!(tile_q4_1_avx2_narrow, q41_like_avx2, [false], 20);
tile_fn!(tile_q8_0_avx2_narrow, q8_0_like_avx2, [0], 34);
tile_fn!(tile_q5_0_avx2_narrow, q8_0_like_avx2, [2], 22);
tile_fn!(tile_q5_1_avx2_narrow, q41_like_avx2, [true], 24);
tile_fn!(tile_q4_k_avx2_narrow, q45_k_avx2, [false], 144);
tile_fn!(tile_q5_k_avx2_narrow, q45_k_avx2, [true], 176);
tile_fn!(tile_q6_k_avx2_narrow, q6_k_avx2, [], 210);

/// The 32 4-bit quants at `p` (16 bytes) as bytes in ggml's element order: the low
/// nibbles, then the high ones.
///
/// The bytes are loaded into both 128-bit lanes (a load, no shuffle) and the high lane
/// shifted by 4 in the same operation: two vector operations where a shift, a lane insert
/// and a mask took three.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn nibbles16(p: *const u8) -> __m256i {
    // SAFETY: the caller keeps 16 bytes readable at `p`; the load is unaligned.
    let qs = _mm256_broadcastsi128_si256(unsafe { _mm_loadu_si128(p as *const __m128i) });
    _mm256_and_si256(
        _mm256_srlv_epi64(qs, _mm256_set_epi64x(4, 4, 0, 0)),
        _mm256_set1_epi8(0x0F),
    )
}

/// The 32 high bits `qh` (bit i for element i) as bytes 0x10 / 0x00.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn high_bits32(qh: u32) -> __m256i {
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

/// Q4_1 (`FIVE == false`) or Q5_1 x Q8_1.
///
/// The scales come from ggml's f16 table as broadcast loads (no shuffle), `d_w * d_a` as
/// the product of two broadcasts (the same product in every lane), and `m_w * s_a` is
/// accumulated in scalar f32 by FMA, as gcc contracts llama.cpp's `summs += m * s`.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q41_like_avx2<const RR: usize, const NT: usize, const FIVE: bool>(
    w: Rows<RR>,
    nb: usize,
    a: [*const u8; NT],
    s: [*const f32; NT],
) -> [[f32; NT]; RR] {
    let ones = _mm256_set1_epi16(1);
    let bb = if FIVE { 24 } else { 20 };
    let f16s = f16_table();
    let mut acc = [[_mm256_setzero_ps(); NT]; RR];
    let mut accm = [[0f32; NT]; RR];
    for b in 0..nb {
        // SAFETY: block b of each row and of each activation row is in bounds.
        unsafe {
            let y: [__m256i; NT] =
                std::array::from_fn(|t| _mm256_loadu_si256(a[t].add(b * 36 + 4) as *const __m256i));
            let dy: [__m256; NT] = std::array::from_fn(|t| _mm256_set1_ps(*s[t].add(2 * b)));
            let sy: [f32; NT] = std::array::from_fn(|t| *s[t].add(2 * b + 1));
            for r in 0..RR {
                let wb = w[r].add(b * bb);
                prefetch_tile_ahead(&w, nb, bb, b, r);
                let d = _mm256_set1_ps(f16s[(wb as *const u16).read_unaligned() as usize]);
                let m = f16s[(wb.add(2) as *const u16).read_unaligned() as usize];
                let q = if FIVE {
                    let qh = (wb.add(4) as *const u32).read_unaligned();
                    _mm256_or_si256(nibbles16(wb.add(8)), high_bits32(qh))
                } else {
                    nibbles16(wb.add(4))
                };
                for t in 0..NT {
                    let p = _mm256_madd_epi16(_mm256_maddubs_epi16(q, y[t]), ones);
                    acc[r][t] =
                        _mm256_fmadd_ps(_mm256_mul_ps(d, dy[t]), _mm256_cvtepi32_ps(p), acc[r][t]);
                    accm[r][t] = m.mul_add(sy[t], accm[r][t]);
                }
            }
        }
    }
    let mut res = [[0f32; NT]; RR];
    for r in 0..RR {
        for t in 0..NT {
            res[r][t] = hsum256(acc[r][t]) + accm[r][t];
        }
    }
    res
}

/// Q8_0 / Q4_0 / Q5_0 (`KIND` 0, 1, 2) x Q8_0.
///
/// Q4_0 and Q5_0 multiply their stored quants (0..15, 0..31) unsigned by the activations
/// and subtract `offset * (sum of each four activations)` (offset 8, 16), computed once
/// per block and token for all rows: the same integers as `(q - offset) . y` without
/// llama.cpp's two sign operations per row (Q8_0's quants reach 255 with the offset, and
/// `maddubs` would saturate, so it keeps them).
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q8_0_like_avx2<const RR: usize, const NT: usize, const KIND: u8>(
    w: Rows<RR>,
    nb: usize,
    a: [*const u8; NT],
    s: [*const f32; NT],
) -> [[f32; NT]; RR] {
    let ones = _mm256_set1_epi16(1);
    let offset = _mm256_set1_epi8([0, 8, 16][KIND as usize]);
    let bb = [34, 18, 22][KIND as usize];
    let f16s = f16_table();
    let mut acc = [[_mm256_setzero_ps(); NT]; RR];
    for b in 0..nb {
        // SAFETY: block b of each row and of each activation row is in bounds.
        unsafe {
            let y: [__m256i; NT] =
                std::array::from_fn(|t| _mm256_loadu_si256(a[t].add(b * 34 + 2) as *const __m256i));
            let corr: [__m256i; NT] = std::array::from_fn(|t| {
                if KIND == 0 {
                    _mm256_setzero_si256()
                } else {
                    _mm256_madd_epi16(_mm256_maddubs_epi16(offset, y[t]), ones)
                }
            });
            let dy: [__m256; NT] = std::array::from_fn(|t| _mm256_set1_ps(*s[t].add(b)));
            for r in 0..RR {
                let wb = w[r].add(b * bb);
                prefetch_tile_ahead(&w, nb, bb, b, r);
                // Broadcast from memory (a load, no shuffle); the product of two
                // broadcasts is the broadcast product.
                let dx = _mm256_set1_ps(f16s[(wb as *const u16).read_unaligned() as usize]);
                let (x, signed) = match KIND {
                    1 => (nibbles16(wb.add(2)), false),
                    2 => {
                        let qh = (wb.add(2) as *const u32).read_unaligned();
                        (
                            _mm256_or_si256(nibbles16(wb.add(6)), high_bits32(qh)),
                            false,
                        )
                    }
                    _ => (_mm256_loadu_si256(wb.add(2) as *const __m256i), true),
                };
                let ax = if signed { _mm256_sign_epi8(x, x) } else { x };
                for t in 0..NT {
                    let p = if signed {
                        let sy = _mm256_sign_epi8(y[t], x);
                        _mm256_madd_epi16(_mm256_maddubs_epi16(ax, sy), ones)
                    } else {
                        _mm256_sub_epi32(
                            _mm256_madd_epi16(_mm256_maddubs_epi16(ax, y[t]), ones),
                            corr[t],
                        )
                    };
                    acc[r][t] =
                        _mm256_fmadd_ps(_mm256_mul_ps(dx, dy[t]), _mm256_cvtepi32_ps(p), acc[r][t]);
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

/// Per-row values spread over a K-quant tile's lanes (lane `r * NT + t` for row `r` and
/// token `t`) for its final f32 step, as a vector.
#[inline(always)]
fn row_lanes<const RR: usize, const NT: usize>(per_row: &[f32; K_LANES]) -> __m256 {
    let mut lanes = [0f32; K_LANES];
    for r in 0..RR {
        lanes[r * NT..(r + 1) * NT].fill(per_row[r]);
    }
    // SAFETY: `lanes` holds eight f32; the load is unaligned.
    unsafe { _mm256_loadu_ps(lanes.as_ptr()) }
}

/// [`row_lanes`] for per-token values (`per_token(t)`, the activation's scale).
#[inline(always)]
fn token_lanes<const RR: usize, const NT: usize>(per_token: impl Fn(usize) -> f32) -> __m256 {
    let mut lanes = [0f32; K_LANES];
    for r in 0..RR {
        for t in 0..NT {
            lanes[r * NT + t] = per_token(t);
        }
    }
    // SAFETY: `lanes` holds eight f32; the load is unaligned.
    unsafe { _mm256_loadu_ps(lanes.as_ptr()) }
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
            let dy = token_lanes::<RR, NT>(|t| *s[t].add(b));
            let scaled = _mm256_mul_ps(_mm256_mul_ps(row_lanes::<RR, NT>(&d), dy), si);
            let mins = _mm256_mul_ps(_mm256_mul_ps(row_lanes::<RR, NT>(&dmin), dy), sm);
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
            let dy = token_lanes::<RR, NT>(|t| *s[t].add(b));
            let dwy = _mm256_mul_ps(row_lanes::<RR, NT>(&d), dy);
            acc = _mm256_add_ps(acc, _mm256_mul_ps(dwy, si));
        }
    }
    k_tile_result::<RR, NT>(acc)
}

/// The [`TileFn`](super::TileFn) of plain float weights (`KIND` 0: f32, 1: f16, 2: bf16):
/// one row and token at a time.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C; `w` and `acts` must be validated.
pub(super) unsafe fn float_tile<const KIND: u8>(
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
