//! The AVX2 prefill kernels of the 32-element formats (Q8_0, Q4_0, Q5_0; Q4_1, Q5_1): up
//! to [`WIDE_ROWS`] rows decoded once against whole groups of 8 packed tokens.
//!
//! The narrow kernel ([`super::avx2`]) decodes a block of 2 rows for every 4 tokens and
//! looks each token's block up through its own pointer: for Qwen2.5-Coder-0.5B's Q5_0
//! matrices that was 70% of a prompt's time at 1 thread, some 11 vector operations per
//! (row, token, block). Here the rows are decoded once per tile into a buffer that stays
//! in L1 (unsigned quants and f32 scales), and the activations come packed
//! (`QuantizedActivations::packed_group`: 8 tokens' quants, their group sums and scales
//! at constant offsets), so a (row, token, block) costs six: `maddubs`, `madd`, the
//! offset correction (or Q8_0's `sign`), the conversion, the scale product and the FMA.
//! Those are the narrow kernel's f32 operations in its order (one `d_w * d_a` product and
//! one FMA per block and lane, then its horizontal sum), on the same integer lane sums,
//! so the bits are the same.

use super::avx2::{
    high_bits32, nibbles16, tile_q4_0_avx2_narrow, tile_q4_1_avx2_narrow, tile_q5_0_avx2_narrow,
    tile_q5_1_avx2_narrow, tile_q8_0_avx2_narrow,
};
use super::{f16x1, f16x2, hsum256, whole_groups, wide_or_narrow};
use crate::quant::{QuantizedActivations, TileOut, PACKED_BLOCK, PACKED_BLOCK_Q8_1, PACK_TOKENS};
use std::arch::x86_64::*;
use std::mem::MaybeUninit;

/// Most rows one call decodes and computes together.
pub(super) const WIDE_ROWS: usize = 16;

/// Blocks the decode buffer holds (32 quant bytes and one f32 scale each, 43 KiB): two
/// rows of up to 672 blocks (k = 21504), the least a tile decodes.
const DECODED_BLOCKS: usize = 1344;

/// Bytes of decoded rows a tile aims for, so that they stay in L1 beside 4 tokens'
/// packed activations while every token group passes over them.
const DECODED_L1_BYTES: usize = 16 << 10;

/// Offsets in a packed block: the 8 tokens' quants, then their negated group sums times
/// 16 (i32 per group of four), then their f32 scales.
const SUMS: usize = 32 * PACK_TOKENS;
const SCALES: usize = 64 * PACK_TOKENS;

/// Whether the wide kernel takes a tile of `rr` rows of `nb` blocks over tokens
/// `t0..t0 + nt`: whole groups of 8 tokens, at most [`WIDE_ROWS`] rows, two of which fit
/// the decode buffer.
fn takes(rr: usize, nb: usize, t0: usize, nt: usize) -> bool {
    (1..=WIDE_ROWS).contains(&rr) && 2 * nb <= DECODED_BLOCKS && whole_groups(t0, nt)
}

/// Expands the wide entry point of one format (blocks of `$bb` bytes, computed by
/// `$kernel`) as a [`WideFn`](crate::quant::WideFn).
macro_rules! wide_fn {
    ($name:ident, $kernel:expr, $bb:expr) => {
        /// # Safety
        /// The CPU must support AVX2, FMA and F16C; `w` (whole rows of `rb` bytes) and
        /// `acts` must be validated; `out` valid for every result of the tile.
        pub(super) unsafe fn $name(
            w: &[u8],
            rb: usize,
            acts: &QuantizedActivations,
            t0: usize,
            nt: usize,
            out: TileOut,
        ) -> bool {
            let (rr, nb) = (w.len() / rb, rb / $bb);
            if !takes(rr, nb, t0, nt) {
                return false;
            }
            let g0 = t0 / PACK_TOKENS;
            let y = |g: usize| acts.packed_group(g0 + g).as_ptr();
            // SAFETY: forwarded from the caller; each packed group holds every block.
            unsafe { $kernel(w, rb, nb, y, nt / PACK_TOKENS, out) };
            true
        }
    };
}

wide_fn!(wide_q8_0_avx2, wide_avx2::<Q8_0Like<0>>, 34);
wide_fn!(wide_q4_0_avx2, wide_avx2::<Q8_0Like<1>>, 18);
wide_fn!(wide_q5_0_avx2, wide_avx2::<Q8_0Like<2>>, 22);
wide_or_narrow!(tile_q8_0_avx2, wide_q8_0_avx2, tile_q8_0_avx2_narrow);
wide_or_narrow!(tile_q4_0_avx2, wide_q4_0_avx2, tile_q4_0_avx2_narrow);
wide_or_narrow!(tile_q5_0_avx2, wide_q5_0_avx2, tile_q5_0_avx2_narrow);

/// Block `b` of a row at `row` (`KIND` 0, 1, 2: Q8_0, Q4_0, Q5_0) decoded: its quants
/// (Q8_0's signed, Q4_0's and Q5_0's unsigned, without the offset) and its scale.
///
/// # Safety
/// Block `b` must be in bounds.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn decode<const KIND: u8>(row: *const u8, b: usize) -> (__m256i, f32) {
    let bb = [34, 18, 22][KIND as usize];
    // SAFETY: block b of the row is in bounds (the contract).
    unsafe {
        let wb = row.add(b * bb);
        let q = match KIND {
            1 => nibbles16(wb.add(2)),
            2 => {
                let qh = (wb.add(2) as *const u32).read_unaligned();
                _mm256_or_si256(nibbles16(wb.add(6)), high_bits32(qh))
            }
            _ => _mm256_loadu_si256(wb.add(2) as *const __m256i),
        };
        (q, _mm_cvtss_f32(f16x1(wb)))
    }
}

/// What the wide driver needs of a format: its blocks decoded (quants and the side
/// data its f32 step reads), and `R` decoded rows against 4 packed tokens.
trait Wide {
    /// A decoded block's scale (and min).
    type Side: Copy;

    /// Block `b` of the row at `row` decoded.
    ///
    /// # Safety
    /// The CPU must support AVX2, FMA and F16C; block `b` must be in bounds.
    unsafe fn decode(row: *const u8, b: usize) -> (__m256i, Self::Side);

    /// `R` decoded rows (quants at `q`, sides at `side`, `nb` blocks a row) against tokens
    /// `t0..t0 + 4` of the group packed at `yg`.
    ///
    /// # Safety
    /// The CPU must support AVX2, FMA and F16C; `q` and `side` hold `R * nb` blocks; the
    /// packed group holds the 4 tokens.
    unsafe fn rows_x4<const R: usize>(
        q: *const __m256i,
        side: *const Self::Side,
        nb: usize,
        yg: *const u8,
        t0: usize,
    ) -> [[f32; 4]; R];
}

/// Q8_0, Q4_0 or Q5_0 (`KIND` 0, 1, 2) against Q8_0.
struct Q8_0Like<const KIND: u8>;

impl<const KIND: u8> Wide for Q8_0Like<KIND> {
    type Side = f32;

    unsafe fn decode(row: *const u8, b: usize) -> (__m256i, f32) {
        // SAFETY: forwarded from the caller.
        unsafe { decode::<KIND>(row, b) }
    }

    unsafe fn rows_x4<const R: usize>(
        q: *const __m256i,
        side: *const f32,
        nb: usize,
        yg: *const u8,
        t0: usize,
    ) -> [[f32; 4]; R] {
        // SAFETY: forwarded from the caller.
        unsafe { rows_x4::<KIND, R>(q, side, nb, yg, t0) }
    }
}

/// Q4_1 or Q5_1 (`FIVE`) against Q8_1.
struct Q41Like<const FIVE: bool>;

impl<const FIVE: bool> Wide for Q41Like<FIVE> {
    type Side = u64;

    unsafe fn decode(row: *const u8, b: usize) -> (__m256i, u64) {
        // SAFETY: forwarded from the caller.
        unsafe { decode_q41::<FIVE>(row, b) }
    }

    unsafe fn rows_x4<const R: usize>(
        q: *const __m256i,
        side: *const u64,
        nb: usize,
        yg: *const u8,
        t0: usize,
    ) -> [[f32; 4]; R] {
        // SAFETY: forwarded from the caller.
        unsafe { q41_rows_x4::<R>(q, side, nb, yg, t0) }
    }
}

/// Rows `w` (whole rows of `rb` bytes, `nb` blocks each) of format `F` against `groups`
/// groups of 8 packed tokens (group `g` at `y(g)`), written through `out`. The rows are
/// decoded in chunks that fit [`DECODED_L1_BYTES`] (at least two); each chunk meets every
/// group, 4 tokens and 2 rows at a time (8 accumulators).
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C; `w` holds `w.len() / rb` rows, at most
/// [`WIDE_ROWS`], of `nb` blocks with `2 * nb <= DECODED_BLOCKS`; every packed group
/// holds `nb` blocks; `out` is valid for every row and token.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn wide_avx2<F: Wide>(
    w: &[u8],
    rb: usize,
    nb: usize,
    y: impl Fn(usize) -> *const u8,
    groups: usize,
    out: TileOut,
) {
    let rr = w.len() / rb;
    let decoded = 32 + std::mem::size_of::<F::Side>();
    let chunk = (DECODED_L1_BYTES / (decoded * nb)).clamp(2, WIDE_ROWS);
    let mut quants = [MaybeUninit::<__m256i>::uninit(); DECODED_BLOCKS];
    let mut sides = [MaybeUninit::<F::Side>::uninit(); DECODED_BLOCKS];
    for c0 in (0..rr).step_by(chunk) {
        let c1 = (c0 + chunk).min(rr);
        for i in c0..c1 {
            for b in 0..nb {
                // SAFETY: (i - c0) * nb + b < chunk * nb <= DECODED_BLOCKS (the chunk
                // is at most two rows or DECODED_L1_BYTES); block b of row i is in bounds.
                let (q, side) = unsafe { F::decode(w.as_ptr().add(i * rb), b) };
                quants[(i - c0) * nb + b].write(q);
                sides[(i - c0) * nb + b].write(side);
            }
        }
        let (q, side) = (
            quants.as_ptr() as *const __m256i,
            sides.as_ptr() as *const F::Side,
        );
        for g in 0..groups {
            let yg = y(g);
            for half in 0..2 {
                let mut i = c0;
                while i < c1 {
                    let rows = if c1 - i >= 2 { 2 } else { 1 };
                    let at = (i - c0) * nb;
                    // SAFETY: rows i..i + rows of the chunk were decoded above; the
                    // group packed at yg holds tokens 4 * half .. + 4.
                    let res = unsafe {
                        if rows == 2 {
                            F::rows_x4::<2>(q.add(at), side.add(at), nb, yg, 4 * half)
                        } else {
                            let [r] = F::rows_x4::<1>(q.add(at), side.add(at), nb, yg, 4 * half);
                            [r, [0.0; 4]]
                        }
                    };
                    for (r, row) in res.iter().enumerate().take(rows) {
                        for (t, &v) in row.iter().enumerate() {
                            // SAFETY: row i + r, token 8g + 4half + t of the tile: in
                            // `out` by the contract.
                            unsafe { out.put(i + r, PACK_TOKENS * g + 4 * half + t, v) };
                        }
                    }
                    i += rows;
                }
            }
        }
    }
}

/// `R` decoded rows (quants at `q`, scales at `d`, `nb` blocks a row) against tokens
/// `t0..t0 + 4` of the group packed at `yg`.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C; `q` and `d` hold `R * nb` decoded blocks;
/// the packed blocks hold the 4 tokens.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn rows_x4<const KIND: u8, const R: usize>(
    q: *const __m256i,
    d: *const f32,
    nb: usize,
    yg: *const u8,
    t0: usize,
) -> [[f32; 4]; R] {
    let ones = _mm256_set1_epi16(1);
    let mut acc = [[_mm256_setzero_ps(); 4]; R];
    for b in 0..nb {
        // SAFETY: block b < nb of each decoded row and of the packed tokens (the
        // contract); the packed parts are 4-byte aligned only, so the loads are
        // unaligned.
        unsafe {
            let yb = yg.add(b * PACKED_BLOCK);
            let x: [__m256i; R] = std::array::from_fn(|r| *q.add(r * nb + b));
            let dw: [__m256; R] = std::array::from_fn(|r| _mm256_set1_ps(*d.add(r * nb + b)));
            let ax = if KIND == 0 {
                x.map(|x| _mm256_sign_epi8(x, x))
            } else {
                x
            };
            // `j` indexes the accumulators and gives the token's offsets.
            #[allow(clippy::needless_range_loop)]
            for j in 0..4 {
                let t = t0 + j;
                let yv = _mm256_loadu_si256(yb.add(32 * t) as *const __m256i);
                // The unsigned quants' products less offset * (sum of each group of four
                // activations): the packed sums are -16 * sum.
                let sums = _mm256_loadu_si256(yb.add(SUMS + 32 * t) as *const __m256i);
                let corr = if KIND == 1 {
                    _mm256_srai_epi32::<1>(sums)
                } else {
                    sums
                };
                let dy = _mm256_set1_ps((yb.add(SCALES + 4 * t) as *const f32).read_unaligned());
                for r in 0..R {
                    let p = if KIND == 0 {
                        _mm256_madd_epi16(
                            _mm256_maddubs_epi16(ax[r], _mm256_sign_epi8(yv, x[r])),
                            ones,
                        )
                    } else {
                        _mm256_add_epi32(
                            _mm256_madd_epi16(_mm256_maddubs_epi16(x[r], yv), ones),
                            corr,
                        )
                    };
                    acc[r][j] =
                        _mm256_fmadd_ps(_mm256_mul_ps(dw[r], dy), _mm256_cvtepi32_ps(p), acc[r][j]);
                }
            }
        }
    }
    let mut res = [[0f32; 4]; R];
    for (row, acc) in res.iter_mut().zip(&acc) {
        for (v, &a) in row.iter_mut().zip(acc) {
            *v = hsum256(a);
        }
    }
    res
}

wide_fn!(wide_q4_1_avx2, wide_avx2::<Q41Like<false>>, 20);
wide_fn!(wide_q5_1_avx2, wide_avx2::<Q41Like<true>>, 24);
wide_or_narrow!(tile_q4_1_avx2, wide_q4_1_avx2, tile_q4_1_avx2_narrow);
wide_or_narrow!(tile_q5_1_avx2, wide_q5_1_avx2, tile_q5_1_avx2_narrow);

/// Block `b` of a Q4_1 (`FIVE == false`) or Q5_1 row at `row` decoded: its unsigned
/// quants and its `d` and `m` side by side.
///
/// # Safety
/// Block `b` must be in bounds.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn decode_q41<const FIVE: bool>(row: *const u8, b: usize) -> (__m256i, u64) {
    let bb = if FIVE { 24 } else { 20 };
    // SAFETY: block b of the row is in bounds (the contract).
    unsafe {
        let wb = row.add(b * bb);
        let q = if FIVE {
            let qh = (wb.add(4) as *const u32).read_unaligned();
            _mm256_or_si256(nibbles16(wb.add(8)), high_bits32(qh))
        } else {
            nibbles16(wb.add(4))
        };
        let dm = f16x2(wb);
        (q, _mm_cvtsi128_si64(_mm_castps_si128(dm)) as u64)
    }
}

/// `R` decoded Q4_1 / Q5_1 rows (quants at `q`, `d` and `m` at `dm`, `nb` blocks a row)
/// against tokens `t0..t0 + 4` of the Q8_1 group packed at `yg`, with the narrow kernel's
/// f32 operations: per block and lane `acc += (d_w * d_a) * sum`, and beside it
/// `m_w * s_a` accumulated by FMA, here for the 4 tokens at once (lanes `2t + 1` of one
/// vector per row).
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C; `q` and `dm` hold `R * nb` blocks; the
/// packed blocks hold the 4 tokens.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q41_rows_x4<const R: usize>(
    q: *const __m256i,
    dm: *const u64,
    nb: usize,
    yg: *const u8,
    t0: usize,
) -> [[f32; 4]; R] {
    let ones = _mm256_set1_epi16(1);
    let mut acc = [[_mm256_setzero_ps(); 4]; R];
    let mut acc_m = [_mm256_setzero_ps(); R];
    for b in 0..nb {
        // SAFETY: block b < nb of each decoded row and of the packed tokens (the
        // contract); the packed parts are 4-byte aligned only, so the loads are
        // unaligned.
        unsafe {
            let yb = yg.add(b * PACKED_BLOCK_Q8_1);
            // d_a and s_a of the 4 tokens, in pairs.
            let ds = _mm256_loadu_ps(yb.add(32 * PACK_TOKENS + 8 * t0) as *const f32);
            for (r, (acc, acc_m)) in acc.iter_mut().zip(&mut acc_m).enumerate() {
                let x = *q.add(r * nb + b);
                let pair = *dm.add(r * nb + b);
                let dw = f32::from_bits(pair as u32);
                let dm4 = _mm256_castpd_ps(_mm256_set1_pd(f64::from_bits(pair)));
                // Lane 2t + 1: m_w * s_a, fused as in the narrow kernel.
                *acc_m = _mm256_fmadd_ps(dm4, ds, *acc_m);
                for (j, acc) in acc.iter_mut().enumerate() {
                    let t = t0 + j;
                    let yv = _mm256_loadu_si256(yb.add(32 * t) as *const __m256i);
                    let p = _mm256_madd_epi16(_mm256_maddubs_epi16(x, yv), ones);
                    let dy = (yb.add(32 * PACK_TOKENS + 8 * t) as *const f32).read_unaligned();
                    *acc = _mm256_fmadd_ps(_mm256_set1_ps(dw * dy), _mm256_cvtepi32_ps(p), *acc);
                }
            }
        }
    }
    let mut res = [[0f32; 4]; R];
    for ((row, acc), acc_m) in res.iter_mut().zip(&acc).zip(&acc_m) {
        let mut m = [0f32; 8];
        // SAFETY: `m` holds eight f32; the store is unaligned.
        unsafe { _mm256_storeu_ps(m.as_mut_ptr(), *acc_m) };
        for (j, (v, &a)) in row.iter_mut().zip(acc).enumerate() {
            *v = hsum256(a) + m[2 * j + 1];
        }
    }
    res
}
