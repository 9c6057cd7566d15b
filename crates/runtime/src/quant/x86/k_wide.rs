//! The prefill kernels of the K-quants (Q4_K, Q5_K, Q6_K x Q8_K) at AVX-512 and AVX2:
//! a few rows decoded once against groups of 8 packed tokens (AVX-512: two groups at a
//! time), a sub-block's integer sums kept apart until its scale is applied. A batch's
//! tail of 4 to 7 tokens goes as a group filled with zeros, a shorter one through the
//! narrow kernel; so does a batch of 5 to 7 tokens alone (`K_GROUP_MIN_TOKENS`: a
//! speculative verification).
//!
//! The narrow kernels ([`super::avx512_k`], [`super::avx2`]) multiply a row's 32 (or 64)
//! quants by one token's, then apply the sub-block's scale: one `maddubs` and one
//! `madd` (or `vpdpwssd`) for every 32 products, which is what bounds them (on Zen 4,
//! two 512-bit multiplies per 64 products). llama.cpp's repacked Q4_K kernels sum four
//! `maddubs` in 16 bits before the scale; their weights are interleaved by 8 rows at
//! load, which Ballast does not do (ARCHITECTURE invariant 4). Here the activations are
//! interleaved instead (`QuantizedActivations::packed_group`: 8 tokens' chunks of 8
//! quants side by side), so one 8-quant chunk of a decoded row, broadcast, meets 8
//! tokens in one 512-bit `maddubs`; on AVX2 the chunks of a sub-block add up in 16 bits
//! (4 for Q4_K's and Q5_K's 32 quants: at most 4 * 2 * 31 * 128 = 31744; 2 for Q6_K's
//! 16), then one `madd` and an add apply the scale for all 8 tokens. That is 5
//! multiplies per 256 products of Q4_K, not 8. AVX-512 sums the chunks with `vpdpbusd`
//! in 32 bits (no separate add) and applies the scale with `vpmulld`; it takes two
//! groups (16 tokens) per call, so each row's chunk is broadcast once for both and the
//! f32 step runs on 16 lanes: Qwen2.5-Coder-1.5B Q4_K_M's pp128 on 2 threads at 305-319
//! tokens/s instead of 268-271 with one group (`ballast bench -p 128 -n 0 -r 3`,
//! alternated, a Zen 4 EPYC), 168-170 instead of 134-140 on one thread, the 8B-shaped
//! file's at 64-66 instead of 53-56.
//!
//! The minimum (Q4_K, Q5_K) and Q6_K's offset of 32 come from the packed sub-block sums,
//! 8 tokens per `madd`. The f32 step is the scalar kernel's, per superblock and
//! (row, token): `acc += d * dy * sumi - dmin * dy * summ` (Q6_K: `acc += d * dy *
//! sumi`), here on 8 tokens at once, so the bits are the same.

use super::avx2::{tile_q4_k_avx2_narrow, tile_q5_k_avx2_narrow, tile_q6_k_avx2_narrow};
use super::avx512_k::{
    tile_q4_k_avx512_two_rows, tile_q5_k_avx512_two_rows, tile_q6_k_avx512_two_rows,
};
use super::{by_4_tokens, f16x1, f16x2, k4_scales_mins, wide_or_narrow};
use crate::quant::q8_k_packed::{DY, QS, SUMS16, SUMS32};
use crate::quant::{QuantizedActivations, TileFn, TileOut, PACKED_BLOCK_Q8_K, PACK_TOKENS};
use std::arch::x86_64::*;
use std::mem::MaybeUninit;

/// A superblock of one row decoded: its 256 quants unsigned in element order (Q6_K's
/// without the offset); each sub-block's scale (8 for Q4_K / Q5_K, 16 for Q6_K); the
/// pairs of words that meet the packed sub-block sums (Q4_K / Q5_K: the mins, Q6_K: 32
/// times the scales), two to an i32; `d` and `dmin`.
#[derive(Clone, Copy)]
#[repr(C, align(32))]
struct Decoded {
    q: [u8; 256],
    scale: [i16; 16],
    pairs: [i32; 8],
    d: f32,
    dmin: f32,
}

/// [`KLevel::PAD_MIN`] of both levels: Qwen2.5-Coder-1.5B's pp13 (a tail of 5) on 2
/// threads at 152-160 tokens/s instead of 134 at AVX-512, 126-127 instead of 98-99 at
/// AVX2; tails of 1 to 3 were slower as groups (pp9 114 instead of 138-145), and a tail
/// of 4 about even.
const PAD_MIN_AVX512: usize = 4;
const PAD_MIN_AVX2: usize = 4;

/// The shortest tail that goes as a padded group when it completes a pair of groups (an
/// odd number of whole groups) at a level that takes pairs: the pair costs little more
/// than the lone group. Qwen2.5-Coder-1.5B on 2 threads at AVX-512: pp10 167-171
/// tokens/s instead of 160-164, pp11 180-181 instead of 157; a tail of 1 was slower
/// (pp9 152-154 instead of 157-158), and so was padding into a third group (pp17 196-198
/// instead of 213-216).
const PAD_MIN_TO_PAIR: usize = 2;

/// Bytes ahead of the superblock being decoded that the decoding asks the memory for.
/// A batch of one group (a speculative verification) streams the weights at the pace
/// of its arithmetic, so the memory must be asked well ahead: Qwen2.5-Coder-1.5B
/// Q4_K_M pp8 on 2 threads 144-147 tokens/s at 1 KiB, 169-179 at 4 KiB, no better at 8
/// or 16 KiB; on 1 thread 76-78 and 94; AVX2 2 threads 128-131 and 142-144; pp128 the
/// same.
const PREFETCH_AHEAD: usize = 4096;

/// Most rows a level's kernel takes at once.
const MAX_ROWS: usize = 5;

/// Superblocks the decode buffer holds (96 KiB): 5 rows of up to 56 (k = 14336, an 8B
/// model's `ffn_down`), fewer rows of longer ones down to one of 280.
const DECODED_CAP: usize = 280;

/// A K-quant format as the wide kernels see it.
trait KFormat {
    /// Bytes per superblock in the file.
    const BYTES: usize;
    /// Q6_K: sub-blocks of 16 with an offset; otherwise sub-blocks of 32 with a minimum.
    const SIX: bool;

    /// Decodes the superblock at `x` into `out` (every field written).
    ///
    /// # Safety
    /// `x` must point to a whole superblock, `out` be valid for a write; the CPU must
    /// support AVX2.
    unsafe fn decode(x: *const u8, out: *mut Decoded);
}

/// Q4_K (`FIVE == false`) or Q5_K.
struct Q45K<const FIVE: bool>;

impl<const FIVE: bool> KFormat for Q45K<FIVE> {
    const BYTES: usize = if FIVE { 176 } else { 144 };
    const SIX: bool = false;

    unsafe fn decode(x: *const u8, out: *mut Decoded) {
        // SAFETY: forwarded from the caller.
        unsafe { decode_q45_k::<FIVE>(x, out) }
    }
}

/// Q6_K.
struct Q6K;

impl KFormat for Q6K {
    const BYTES: usize = 210;
    const SIX: bool = true;

    unsafe fn decode(x: *const u8, out: *mut Decoded) {
        // SAFETY: forwarded from the caller.
        unsafe { decode_q6_k(x, out) }
    }
}

/// The Q4_K / Q5_K superblock at `x` decoded into `out`.
///
/// # Safety
/// As [`KFormat::decode`].
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn decode_q45_k<const FIVE: bool>(x: *const u8, out: *mut Decoded) {
    let m4 = _mm256_set1_epi8(0x0F);
    let one = _mm256_set1_epi8(1);
    // SAFETY: a whole superblock at x, and `out` writable (the contract); the stores
    // write every byte of the arrays (scales and mins widened to words, then zeros: the
    // mins' words in pairs are the i32 pairs).
    unsafe {
        let dd = f16x2(x);
        (*out).d = _mm_cvtss_f32(dd);
        (*out).dmin = _mm_cvtss_f32(_mm_movehdup_ps(dd));
        let (sc, mn) = k4_scales_mins(x.add(4));
        // Eight bytes widened to words, the other eight words zero.
        let widen = |v: u64| _mm256_cvtepu8_epi16(_mm_cvtsi64_si128(v as i64));
        _mm256_storeu_si256((*out).scale.as_mut_ptr() as *mut __m256i, widen(sc));
        _mm256_storeu_si256((*out).pairs.as_mut_ptr() as *mut __m256i, widen(mn));
        let qs = x.add(if FIVE { 48 } else { 16 });
        let qh = _mm256_loadu_si256(x.add(16) as *const __m256i);
        let dst = (*out).q.as_mut_ptr();
        for c in 0..4 {
            // Byte l of chunk c: element 64c + l in the low nibble, 64c + 32 + l in the
            // high one (Q5_K: their fifth bits are bits 2c and 2c + 1 of qh[l]).
            let q = _mm256_loadu_si256(qs.add(32 * c) as *const __m256i);
            let mut lo = _mm256_and_si256(q, m4);
            let mut hi = _mm256_and_si256(_mm256_srli_epi16::<4>(q), m4);
            if FIVE {
                let shift = _mm_cvtsi32_si128(2 * c as i32);
                let b = _mm256_srl_epi16(qh, shift);
                lo = _mm256_or_si256(lo, _mm256_slli_epi16::<4>(_mm256_and_si256(b, one)));
                let b = _mm256_srli_epi16::<1>(b);
                hi = _mm256_or_si256(hi, _mm256_slli_epi16::<4>(_mm256_and_si256(b, one)));
            }
            _mm256_storeu_si256(dst.add(64 * c) as *mut __m256i, lo);
            _mm256_storeu_si256(dst.add(64 * c + 32) as *mut __m256i, hi);
        }
    }
}

/// The Q6_K superblock at `x` decoded into `out`.
///
/// # Safety
/// As [`KFormat::decode`].
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn decode_q6_k(x: *const u8, out: *mut Decoded) {
    let m4 = _mm256_set1_epi8(0x0F);
    let m30 = _mm256_set1_epi8(0x30);
    // SAFETY: a whole superblock at x, and `out` writable (the contract); the stores
    // write the arrays' bytes (the scales widened to words, and 32 times them, whose
    // words in pairs are the i32 pairs).
    unsafe {
        (*out).d = _mm_cvtss_f32(f16x1(x.add(208)));
        (*out).dmin = 0.0;
        let sc = _mm256_cvtepi8_epi16(_mm_loadu_si128(x.add(192) as *const __m128i));
        _mm256_storeu_si256((*out).scale.as_mut_ptr() as *mut __m256i, sc);
        let sc32 = _mm256_slli_epi16::<5>(sc);
        _mm256_storeu_si256((*out).pairs.as_mut_ptr() as *mut __m256i, sc32);
        let dst = (*out).q.as_mut_ptr();
        for n in 0..2 {
            // Elements 128n + l, + 32, + 64, + 96 (l < 32): the low and high nibbles of
            // ql[64n + l] and ql[64n + 32 + l], with bit pairs 0, 2, 4, 6 of qh[32n + l].
            let a = _mm256_loadu_si256(x.add(64 * n) as *const __m256i);
            let b = _mm256_loadu_si256(x.add(64 * n + 32) as *const __m256i);
            let h = _mm256_loadu_si256(x.add(128 + 32 * n) as *const __m256i);
            let parts = [
                (
                    _mm256_and_si256(a, m4),
                    _mm256_and_si256(_mm256_slli_epi16::<4>(h), m30),
                ),
                (
                    _mm256_and_si256(b, m4),
                    _mm256_and_si256(_mm256_slli_epi16::<2>(h), m30),
                ),
                (
                    _mm256_and_si256(_mm256_srli_epi16::<4>(a), m4),
                    _mm256_and_si256(h, m30),
                ),
                (
                    _mm256_and_si256(_mm256_srli_epi16::<4>(b), m4),
                    _mm256_and_si256(_mm256_srli_epi16::<2>(h), m30),
                ),
            ];
            for (m, (low, top)) in parts.into_iter().enumerate() {
                let v = _mm256_or_si256(low, top);
                _mm256_storeu_si256(dst.add(128 * n + 32 * m) as *mut __m256i, v);
            }
        }
    }
}

/// What a level gives the driver: `R` decoded rows against one packed group of 8 tokens.
trait KLevel {
    /// Most rows one call takes.
    const ROWS: usize;
    /// The shortest tail of a batch (after whole groups of 8) that goes as a group of 8
    /// filled with zeros rather than through the narrow kernel.
    const PAD_MIN: usize;

    /// `R` decoded rows (row `r`'s superblock `b` at `x[r * nb + b]`) against the `G`
    /// groups of 8 tokens packed at `yg`: `[row][group][token]`.
    ///
    /// # Safety
    /// The CPU must support the level; `x` holds `R * nb` decoded superblocks and each
    /// of `yg` `nb` packed ones.
    unsafe fn rows<const R: usize, const G: usize, const SIX: bool>(
        x: *const Decoded,
        nb: usize,
        yg: [*const u8; G],
    ) -> [[[f32; 8]; G]; R];

    /// Whether the driver should give the level two groups at a time.
    const PAIRS: bool;
}

/// The AVX-512 (VNNI) kernel: 5 rows against two groups (10 pairs of 32-bit accumulators
/// and sums, 30 of the 32 registers with the two groups' chunk and the lane orders):
/// Qwen2.5-Coder-1.5B's pp128 on 2 threads at 313-319 tokens/s against 305-307 with 4
/// rows, 264-273 with 3 and 305-310 with 6 (which spills).
struct Avx512;

impl KLevel for Avx512 {
    const ROWS: usize = 5;
    const PAIRS: bool = true;
    const PAD_MIN: usize = PAD_MIN_AVX512;

    unsafe fn rows<const R: usize, const G: usize, const SIX: bool>(
        x: *const Decoded,
        nb: usize,
        yg: [*const u8; G],
    ) -> [[[f32; 8]; G]; R] {
        // SAFETY: forwarded from the caller.
        unsafe { rows_avx512::<R, G, SIX>(x, nb, yg) }
    }
}

/// The AVX2 kernel: 2 rows (each row takes four 256-bit accumulators).
struct Avx2;

impl KLevel for Avx2 {
    const ROWS: usize = 2;
    const PAIRS: bool = false;
    const PAD_MIN: usize = PAD_MIN_AVX2;

    unsafe fn rows<const R: usize, const G: usize, const SIX: bool>(
        x: *const Decoded,
        nb: usize,
        yg: [*const u8; G],
    ) -> [[[f32; 8]; G]; R] {
        // One group at a time (the driver gives one: `PAIRS` is false).
        // SAFETY: forwarded from the caller.
        let each = yg.map(|y| unsafe { rows_avx2::<R, SIX>(x, nb, y) });
        std::array::from_fn(|r| std::array::from_fn(|g| each[g][r]))
    }
}

/// The sums of a superblock's packed sub-block sums (pairs at `sums`, `NP` of them)
/// weighted by the row's pairs of words: 8 tokens' `summ` (Q4_K / Q5_K) or offset
/// correction (Q6_K), as i32.
///
/// # Safety
/// The CPU must support AVX2; `NP` pairs of 8 tokens at `sums`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn pair_sums<const NP: usize>(sums: *const u8, pairs: &[i32; 8]) -> __m256i {
    let mut acc = _mm256_setzero_si256();
    for (p, &w) in pairs.iter().enumerate().take(NP) {
        // SAFETY: pair p of the 8 tokens is in bounds (the contract).
        let s = unsafe { _mm256_loadu_si256(sums.add(32 * p) as *const __m256i) };
        acc = _mm256_add_epi32(acc, _mm256_madd_epi16(s, _mm256_set1_epi32(w)));
    }
    acc
}

/// The f32 step of one superblock for 8 tokens (packed at `yb`, with integer sums `si`),
/// the scalar kernel's operations: `acc + ((d * dy) * sumi - (dmin * dy) * summ)`, or
/// for Q6_K `acc + (d * dy) * (sumi - off)`.
///
/// # Safety
/// The CPU must support AVX2; `yb` is a whole packed superblock.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn f32_step<const SIX: bool>(
    acc: __m256,
    x: &Decoded,
    yb: *const u8,
    si: __m256i,
) -> __m256 {
    // SAFETY: the packed superblock at yb holds the sums and scales (the contract).
    let (dy, sm) = unsafe {
        let dy = _mm256_loadu_ps(yb.add(DY) as *const f32);
        if SIX {
            (dy, pair_sums::<8>(yb.add(SUMS16), &x.pairs))
        } else {
            (dy, pair_sums::<4>(yb.add(SUMS32), &x.pairs))
        }
    };
    let dd = _mm256_mul_ps(_mm256_set1_ps(x.d), dy);
    let v = if SIX {
        _mm256_mul_ps(dd, _mm256_cvtepi32_ps(_mm256_sub_epi32(si, sm)))
    } else {
        let dm = _mm256_mul_ps(_mm256_set1_ps(x.dmin), dy);
        _mm256_sub_ps(
            _mm256_mul_ps(dd, _mm256_cvtepi32_ps(si)),
            _mm256_mul_ps(dm, _mm256_cvtepi32_ps(sm)),
        )
    };
    _mm256_add_ps(acc, v)
}

/// Eight f32 lanes as an array.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn lanes(v: __m256) -> [f32; 8] {
    let mut out = [0f32; 8];
    // SAFETY: `out` holds eight f32; the store is unaligned.
    unsafe { _mm256_storeu_ps(out.as_mut_ptr(), v) };
    out
}

/// [`f32_step`] for two packed groups at once (16 tokens, group 0's in the low half).
///
/// # Safety
/// The CPU must support AVX-512; `yb0` and `yb1` are whole packed superblocks.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
unsafe fn f32_step2<const SIX: bool>(
    acc: __m512,
    x: &Decoded,
    yb0: *const u8,
    yb1: *const u8,
    si: __m512i,
) -> __m512 {
    // The 32 bytes at `at` in each group's packed superblock, group 0's low.
    let both = |at: usize| {
        // SAFETY: `at` is a field of the packed superblocks (the scales or a pair of
        // sub-block sums), in bounds by the contract.
        unsafe {
            _mm512_inserti64x4::<1>(
                _mm512_castsi256_si512(_mm256_loadu_si256(yb0.add(at) as *const __m256i)),
                _mm256_loadu_si256(yb1.add(at) as *const __m256i),
            )
        }
    };
    let dy = _mm512_castsi512_ps(both(DY));
    let (at, np) = if SIX { (SUMS16, 8) } else { (SUMS32, 4) };
    let mut sm = _mm512_setzero_si512();
    for (p, &w) in x.pairs.iter().enumerate().take(np) {
        let s = both(at + 32 * p);
        sm = _mm512_add_epi32(sm, _mm512_madd_epi16(s, _mm512_set1_epi32(w)));
    }
    let dd = _mm512_mul_ps(_mm512_set1_ps(x.d), dy);
    let v = if SIX {
        _mm512_mul_ps(dd, _mm512_cvtepi32_ps(_mm512_sub_epi32(si, sm)))
    } else {
        let dm = _mm512_mul_ps(_mm512_set1_ps(x.dmin), dy);
        _mm512_sub_ps(
            _mm512_mul_ps(dd, _mm512_cvtepi32_ps(si)),
            _mm512_mul_ps(dm, _mm512_cvtepi32_ps(sm)),
        )
    };
    _mm512_add_ps(acc, v)
}

/// [`KLevel::rows`] on AVX-512, one or two groups: per 8-quant chunk one 512-bit load of
/// each group's 8 tokens, and per row a broadcast of its chunk (once for both groups)
/// and a `vpdpbusd` per group; per sub-block per row and group one `vpmulld` by the
/// scale. Two groups take the f32 step on 16 lanes.
///
/// # Safety
/// As [`KLevel::rows`]; the CPU must support AVX-512 VNNI; `G` is 1 or 2.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
unsafe fn rows_avx512<const R: usize, const G: usize, const SIX: bool>(
    x: *const Decoded,
    nb: usize,
    yg: [*const u8; G],
) -> [[[f32; 8]; G]; R] {
    const { assert!(G == 1 || G == 2) };
    let (subs, chunks) = if SIX { (16, 2) } else { (8, 4) };
    // Lanes 2t and 2t + 1 of a group's sums are token t's: the even lanes of both
    // groups, then the odd ones.
    let even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    let odd = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
    // One group's f32 sums in the low 8 lanes; two groups' in all 16.
    let mut accf = [_mm512_setzero_ps(); R];
    for b in 0..nb {
        // SAFETY: superblock b of every row and of the packed groups is in bounds (the
        // contract); the packed groups are byte-aligned, so their loads are unaligned.
        unsafe {
            let yb = yg.map(|y| y.add(b * PACKED_BLOCK_Q8_K));
            let xs: [&Decoded; R] = std::array::from_fn(|r| &*x.add(r * nb + b));
            let mut acc = [[_mm512_setzero_si512(); G]; R];
            for j in 0..subs {
                let mut s32 = [[_mm512_setzero_si512(); G]; R];
                for c in 0..chunks {
                    let k = chunks * j + c;
                    let a = yb.map(|y| _mm512_loadu_si512(y.add(QS + 64 * k) as *const __m512i));
                    for r in 0..R {
                        let w8 = (xs[r].q.as_ptr().add(8 * k) as *const i64).read_unaligned();
                        let w = _mm512_set1_epi64(w8);
                        for h in 0..G {
                            s32[r][h] = _mm512_dpbusd_epi32(s32[r][h], w, a[h]);
                        }
                    }
                }
                for r in 0..R {
                    let sc = _mm512_set1_epi32(xs[r].scale[j] as i32);
                    for h in 0..G {
                        acc[r][h] = _mm512_add_epi32(acc[r][h], _mm512_mullo_epi32(s32[r][h], sc));
                    }
                }
            }
            for r in 0..R {
                let (first, last) = (acc[r][0], acc[r][G - 1]);
                if G == 2 {
                    let si = _mm512_add_epi32(
                        _mm512_permutex2var_epi32(first, even, last),
                        _mm512_permutex2var_epi32(first, odd, last),
                    );
                    accf[r] = f32_step2::<SIX>(accf[r], xs[r], yb[0], yb[G - 1], si);
                } else {
                    let si = _mm512_cvtepi64_epi32(_mm512_add_epi32(
                        first,
                        _mm512_srli_epi64::<32>(first),
                    ));
                    let low = f32_step::<SIX>(_mm512_castps512_ps256(accf[r]), xs[r], yb[0], si);
                    accf[r] = _mm512_castps256_ps512(low);
                }
            }
        }
    }
    accf.map(|v| {
        let mut out = [[0f32; 8]; G];
        let mut all = [0f32; 16];
        // SAFETY: `all` holds 16 f32.
        unsafe { _mm512_storeu_ps(all.as_mut_ptr(), v) };
        for (h, o) in out.iter_mut().enumerate() {
            o.copy_from_slice(&all[8 * h..8 * h + 8]);
        }
        out
    })
}

/// [`KLevel::rows`] on AVX2: as [`rows_avx512`] with each 512-bit vector as two 256-bit
/// halves (tokens 0..4 and 4..8), and `madd` plus an add for `vpdpwssd`.
///
/// # Safety
/// As [`KLevel::rows`]; the CPU must support AVX2, FMA and F16C.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn rows_avx2<const R: usize, const SIX: bool>(
    x: *const Decoded,
    nb: usize,
    yg: *const u8,
) -> [[f32; 8]; R] {
    let (subs, chunks) = if SIX { (16, 2) } else { (8, 4) };
    let mut accf = [_mm256_setzero_ps(); R];
    for b in 0..nb {
        // SAFETY: as in `rows_avx512`.
        unsafe {
            let yb = yg.add(b * PACKED_BLOCK_Q8_K);
            let xs: [&Decoded; R] = std::array::from_fn(|r| &*x.add(r * nb + b));
            let mut acc = [[_mm256_setzero_si256(); 2]; R];
            for j in 0..subs {
                let mut s16 = [[_mm256_setzero_si256(); 2]; R];
                for c in 0..chunks {
                    let k = chunks * j + c;
                    let a = [
                        _mm256_loadu_si256(yb.add(QS + 64 * k) as *const __m256i),
                        _mm256_loadu_si256(yb.add(QS + 64 * k + 32) as *const __m256i),
                    ];
                    for r in 0..R {
                        let w8 = (xs[r].q.as_ptr().add(8 * k) as *const i64).read_unaligned();
                        let w = _mm256_set1_epi64x(w8);
                        for h in 0..2 {
                            let p = _mm256_maddubs_epi16(w, a[h]);
                            s16[r][h] = _mm256_add_epi16(s16[r][h], p);
                        }
                    }
                }
                for r in 0..R {
                    let sc = _mm256_set1_epi16(xs[r].scale[j]);
                    for h in 0..2 {
                        acc[r][h] = _mm256_add_epi32(acc[r][h], _mm256_madd_epi16(s16[r][h], sc));
                    }
                }
            }
            for r in 0..R {
                // hadd gives tokens [0, 1, 4, 5 | 2, 3, 6, 7]; the permute orders them.
                let si = _mm256_permute4x64_epi64::<0xD8>(_mm256_hadd_epi32(acc[r][0], acc[r][1]));
                accf[r] = f32_step::<SIX>(accf[r], xs[r], yb, si);
            }
        }
    }
    accf.map(|v| lanes(v))
}

/// Rows `w` (whole rows of `rb` bytes) of format `F` against tokens `t0..t0 + nt` (whole
/// groups of 8, then a tail of up to 7; at least one group or a padded tail) at level `L`, written through
/// `out`. The rows are decoded `L::ROWS` at a time (fewer when that many do not fit the
/// buffer) and each batch meets every group (two at a time where the level takes pairs). Returns false, computing nothing, for a
/// tile it does not take.
///
/// # Safety
/// The CPU must support the level; `w` and `acts` must be validated; `out` valid for
/// every result of the tile.
// Not inlined: its decode buffer (96 KiB) makes a frame whose stack probes cost a decode
// tile (one token, 8 rows) a quarter of its time when the caller's frame held it.
#[inline(never)]
#[allow(clippy::too_many_arguments)]
unsafe fn wide<F: KFormat, L: KLevel, const SIX: bool>(
    w: &[u8],
    rb: usize,
    acts: &QuantizedActivations,
    t0: usize,
    nt: usize,
    out: TileOut,
    narrow: TileFn,
) -> bool {
    const { assert!(F::SIX == SIX) };
    let (rr, nb) = (w.len() / rb, rb / F::BYTES);
    let (whole, tail) = (nt / PACK_TOKENS, nt % PACK_TOKENS);
    // A tail of the batch's last tokens (packed as a group filled with zeros) goes with
    // the groups when it is long enough, or when it completes a pair; a shorter one, or
    // one inside the batch, through the narrow kernel.
    let pairs_up = L::PAIRS && whole % 2 == 1 && tail >= PAD_MIN_TO_PAIR;
    let padded = (tail >= L::PAD_MIN || pairs_up) && t0 + nt == acts.n_tokens();
    let groups = whole + padded as usize;
    if rr == 0 || nb == 0 || nb > DECODED_CAP || t0 % PACK_TOKENS != 0 || groups == 0 {
        return false;
    }
    if tail > 0 && !padded {
        // SAFETY: forwarded from the caller; tokens t0 + 8 * whole.. are the tail.
        unsafe {
            narrow_tail(
                w,
                rb,
                acts,
                t0 + PACK_TOKENS * whole,
                tail,
                out,
                whole,
                narrow,
            )
        };
    }
    let step = (DECODED_CAP / nb).clamp(1, L::ROWS);
    let mut buf = [MaybeUninit::<Decoded>::uninit(); DECODED_CAP];
    let g0 = t0 / PACK_TOKENS;
    for i0 in (0..rr).step_by(step) {
        let n = step.min(rr - i0);
        for i in 0..n {
            for b in 0..nb {
                let x = w[(i0 + i) * rb + b * F::BYTES..].as_ptr();
                // The rows come from memory, once per token block: the decoding waited
                // on them (15% of an 8B-shaped Q4_K_M prompt) until the bytes a few
                // superblocks ahead were asked for. A prefetch does not fault, so past
                // the end of the weights it is harmless.
                let ahead = x.wrapping_add(PREFETCH_AHEAD);
                // SAFETY: a prefetch reads nothing the program sees.
                unsafe {
                    _mm_prefetch::<_MM_HINT_T0>(ahead as *const i8);
                    _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(64) as *const i8);
                    _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(128) as *const i8);
                }
                // SAFETY: superblock b of row i0 + i is in bounds; i * nb + b <
                // step * nb <= DECODED_CAP.
                unsafe { F::decode(x, buf[i * nb + b].as_mut_ptr()) };
            }
        }
        let x = buf.as_ptr() as *const Decoded;
        let mut g = 0;
        while g < groups {
            // Groups g..g + G through the level's kernel, their results through `out`.
            macro_rules! groups_of {
                ($g_count:literal) => {{
                    let yg: [*const u8; $g_count] =
                        std::array::from_fn(|h| acts.packed_group(g0 + g + h).as_ptr());
                    let mut res = [[[0f32; 8]; $g_count]; MAX_ROWS];
                    // SAFETY: rows 0..n of the buffer were decoded above; the packed
                    // groups hold nb superblocks of 8 tokens.
                    unsafe {
                        match n {
                            1 => res[..1].copy_from_slice(&L::rows::<1, $g_count, SIX>(x, nb, yg)),
                            2 => res[..2].copy_from_slice(&L::rows::<2, $g_count, SIX>(x, nb, yg)),
                            3 => res[..3].copy_from_slice(&L::rows::<3, $g_count, SIX>(x, nb, yg)),
                            4 => res[..4].copy_from_slice(&L::rows::<4, $g_count, SIX>(x, nb, yg)),
                            5 => res[..5].copy_from_slice(&L::rows::<5, $g_count, SIX>(x, nb, yg)),
                            _ => unreachable!("at most MAX_ROWS rows"),
                        }
                    }
                    for h in 0..$g_count {
                        let gh = g + h;
                        let real = (nt - PACK_TOKENS * gh).min(PACK_TOKENS);
                        for (r, row) in res.iter().enumerate().take(n) {
                            for (t, &v) in row[h].iter().enumerate().take(real) {
                                // SAFETY: row i0 + r, token 8gh + t of the tile: in `out`
                                // by the contract.
                                unsafe { out.put(i0 + r, PACK_TOKENS * gh + t, v) };
                            }
                        }
                    }
                    g += $g_count;
                }};
            }
            if L::PAIRS && g + 2 <= groups {
                groups_of!(2)
            } else {
                groups_of!(1)
            }
        }
    }
    true
}

/// The tail of a tile (tokens `t0..t0 + tail`, fewer than 8, after `groups` whole
/// groups) through the narrow kernel (4 tokens at most a call), 16 rows at a time into a
/// buffer, then through
/// `out`.
///
/// # Safety
/// As for the narrow kernel and the [`WideFn`](crate::quant::WideFn) that calls this.
#[allow(clippy::too_many_arguments)]
unsafe fn narrow_tail(
    w: &[u8],
    rb: usize,
    acts: &QuantizedActivations,
    t0: usize,
    tail: usize,
    out: TileOut,
    groups: usize,
    narrow: TileFn,
) {
    const ROWS: usize = 16;
    let mut buf = [0f32; ROWS * PACK_TOKENS];
    for (c, rows) in w.chunks(ROWS * rb).enumerate() {
        // SAFETY: forwarded from the caller.
        unsafe { by_4_tokens(narrow, rows, rb, acts, t0, tail, &mut buf, PACK_TOKENS) };
        for r in 0..rows.len() / rb {
            for t in 0..tail {
                let v = buf[r * PACK_TOKENS + t];
                // SAFETY: row 16c + r, token 8 * groups + t of the tile: in `out` by the
                // contract.
                unsafe { out.put(ROWS * c + r, PACK_TOKENS * groups + t, v) };
            }
        }
    }
}

/// Expands the [`WideFn`](crate::quant::WideFn) of one format at one level, and the
/// [`TileFn`](crate::quant::TileFn) that tries it before the narrow kernel.
macro_rules! k_wide_fn {
    ($wide:ident, $tile:ident, $narrow:ident, $format:ty, $level:ty, $six:expr) => {
        /// # Safety
        /// The CPU must support the level; `w` (whole rows of `rb` bytes) and `acts` must
        /// be validated; `out` valid for every result of the tile.
        pub(super) unsafe fn $wide(
            w: &[u8],
            rb: usize,
            acts: &QuantizedActivations,
            t0: usize,
            nt: usize,
            out: TileOut,
        ) -> bool {
            if nt < crate::quant::K_GROUP_MIN_TOKENS {
                // Decode and short batches: the narrow kernel, without a call to `wide`.
                return false;
            }
            // SAFETY: forwarded from the caller.
            unsafe { wide::<$format, $level, $six>(w, rb, acts, t0, nt, out, $narrow) }
        }
        wide_or_narrow!($tile, $wide, $narrow);
    };
}

k_wide_fn!(
    wide_q4_k_avx512,
    tile_q4_k_avx512,
    tile_q4_k_avx512_two_rows,
    Q45K<false>,
    Avx512,
    false
);
k_wide_fn!(
    wide_q5_k_avx512,
    tile_q5_k_avx512,
    tile_q5_k_avx512_two_rows,
    Q45K<true>,
    Avx512,
    false
);
k_wide_fn!(
    wide_q6_k_avx512,
    tile_q6_k_avx512,
    tile_q6_k_avx512_two_rows,
    Q6K,
    Avx512,
    true
);
k_wide_fn!(
    wide_q4_k_avx2,
    tile_q4_k_avx2,
    tile_q4_k_avx2_narrow,
    Q45K<false>,
    Avx2,
    false
);
k_wide_fn!(
    wide_q5_k_avx2,
    tile_q5_k_avx2,
    tile_q5_k_avx2_narrow,
    Q45K<true>,
    Avx2,
    false
);
k_wide_fn!(
    wide_q6_k_avx2,
    tile_q6_k_avx2,
    tile_q6_k_avx2_narrow,
    Q6K,
    Avx2,
    true
);
