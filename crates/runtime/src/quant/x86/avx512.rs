//! The AVX-512 VNNI tile kernels of the 32-element formats (Q4_0, Q4_1, Q5_0, Q5_1,
//! Q8_0): the narrow kernels, two rows to a 512-bit vector, for decode and small tiles,
//! and the wide prefill kernels (4 rows x groups of 8 packed tokens) that
//! `matmul_token_major` also calls through [`super::wide_avx512`]. Separate from the
//! AVX2 kernels (another instruction set and register width) and from the AVX-512
//! K-quants in [`super::avx512_k`] (another block layout and activation type).

use super::{f16_table, hsum256, prefetch_tile_ahead, tile_fn, Rows, PREFETCH};
use crate::quant::{QuantizedActivations, TileOut, PACKED_BLOCK, PACKED_BLOCK_Q8_1, PACK_TOKENS};
use std::arch::x86_64::*;

tile_fn!(tile_q4_0_avx512_narrow, q8_0_like_avx512, [1], 18);
tile_fn!(tile_q4_1_avx512_narrow, q41_like_avx512, [false], 20);
tile_fn!(tile_q8_0_avx512_narrow, q8_0_like_avx512, [0], 34);
tile_fn!(tile_q5_0_avx512_narrow, q8_0_like_avx512, [2], 22);
tile_fn!(tile_q5_1_avx512_narrow, q41_like_avx512, [true], 24);

/// Expands the wide prefill kernel of a 32-element format (`$wide_name`, a
/// [`WideFn`](crate::quant::WideFn): 4 rows x whole groups of 8 tokens through `$wide`,
/// [`q8_0_like_wide_avx512`] or [`q41_like_wide_groups`]) and its tile (`$name`: that
/// kernel where it takes the tile, else `$narrow`, the tokens split into groups of at
/// most 4).
macro_rules! tile_wide_fn {
    ($name:ident, $wide_name:ident, $narrow:ident, $wide:expr, $bb:expr) => {
        /// # Safety
        /// The CPU must support AVX-512 VNNI; `w` and `acts` must be validated; `out`
        /// valid for every result of the tile.
        pub(super) unsafe fn $wide_name(
            w: &[u8],
            rb: usize,
            acts: &QuantizedActivations,
            t0: usize,
            nt: usize,
            out: TileOut,
        ) -> bool {
            if w.len() / rb != 4 || !super::whole_groups(t0, nt) {
                return false;
            }
            let wp: Rows<4> = std::array::from_fn(|i| w[i * rb..].as_ptr());
            let g0 = t0 / PACK_TOKENS;
            let y = |g: usize| acts.packed_group(g0 + g).as_ptr();
            // SAFETY: forwarded from the caller; each packed group holds every block.
            unsafe { $wide(wp, rb / $bb, y, nt / PACK_TOKENS, out) };
            true
        }

        super::wide_or_narrow!($name, $wide_name, $narrow);
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
pub(super) const WIDE_MAX_BLOCKS: usize = 64;

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
