//! The AVX-512 VNNI tile kernels of the K-quants (Q4_K, Q5_K, Q6_K x Q8_K): each
//! superblock decoded once into vectors (quants as unsigned bytes, scales in the word
//! lanes that meet them), then the integer dots of a tile's (row, token) pairs by
//! `vpmaddubsw` + `vpdpwssd`, four pairs reduced together for the f32 step: decode, and
//! the tokens of a batch that are not a whole group of 8 (whole groups go to
//! [`super::k_wide`]). Its two-row tile decodes the rows once for all its tokens.
//! Separate from [`super::avx512`]: the
//! 256-value superblocks share nothing with the 32-element formats but the level.

use super::{
    act_ptrs, by_4_tokens, f16x1, f16x2, k4_scales_mins, prefetch_tile_ahead, tile_fn, Rows,
};
use crate::quant::QuantizedActivations;
use std::arch::x86_64::*;

tile_fn!(tile_q4_k_avx512_narrow, q45_k_avx512, [false], 144);
tile_fn!(tile_q5_k_avx512_narrow, q45_k_avx512, [true], 176);
tile_fn!(tile_q6_k_avx512_narrow, q6_k_avx512, [], 210);

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
pub(super) const K_MAX_BLOCKS: usize = 32;

/// The tile of Q4_K (`FIVE == false`) or Q5_K: [`q45_k_rows`] on superblocks decoded
/// from the weights as it goes.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
unsafe fn q45_k_avx512<const RR: usize, const NT: usize, const FIVE: bool>(
    w: Rows<RR>,
    nb: usize,
    a: [*const u8; NT],
    s: [*const f32; NT],
) -> [[f32; NT]; RR] {
    let bb = if FIVE { 176 } else { 144 };
    // SAFETY: forwarded from the caller.
    unsafe {
        q45_k_rows::<RR, NT>(
            |r, b| {
                prefetch_tile_ahead(&w, nb, bb, b, r);
                q45_k_decode::<FIVE>(w[r].add(b * bb))
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
        pub(super) unsafe fn $name(
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
    tile_q4_k_avx512_two_rows,
    tile_q4_k_avx512_narrow,
    K45Block,
    q45_k_decode::<false>,
    q45_k_rows,
    144
);
tile_k_wide_fn!(
    tile_q5_k_avx512_two_rows,
    tile_q5_k_avx512_narrow,
    K45Block,
    q45_k_decode::<true>,
    q45_k_rows,
    176
);
tile_k_wide_fn!(
    tile_q6_k_avx512_two_rows,
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
