//! x86-64 kernels: AVX2 (+FMA, F16C) and AVX-512 (F/BW/VL/DQ + VNNI).
//!
//! All kernels compute each block's integer dot product exactly (no saturation for
//! activations produced by [`super::quantize_activations`], whose quants lie in
//! -127..=127) and differ from the scalar path only in the order of f32 accumulation.

use super::{QuantizedActivations, TileFn};
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

fn has_vbmi() -> bool {
    use std::sync::OnceLock;
    static V: OnceLock<bool> = OnceLock::new();
    *V.get_or_init(|| is_x86_feature_detected!("avx512vbmi"))
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
        GgmlType::Q4_1 if has_vbmi() => tile_q4_1_avx512_vbmi,
        GgmlType::Q4_1 => tile_q4_1_avx512,
        GgmlType::Q8_0 => tile_q8_0_avx512,
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
// The one-block-per-step Q4_1 kernel as a tile, for tests (it runs the odd last block).
#[cfg(test)]
tile_fn!(tile_q4_1_avx2_plain, q4_1_avx2, 20);
tile_fn!(tile_q8_0_avx2, q8_0_avx2, 34);
tile_fn!(tile_q5_0_avx2, q5_0_avx2, 22);
tile_fn!(tile_q5_1_avx2, q5_1_avx2, 24);
tile_fn!(tile_q4_k_avx2, q4_k_avx2, 144);
tile_fn!(tile_q5_k_avx2, q5_k_avx2, 176);
tile_fn!(tile_q6_k_avx2, q6_k_avx2, 210);
tile_fn!(tile_q4_0_avx512, q4_0_avx512, 18);
tile_fn!(tile_q4_1_avx512, q4_1_avx512, 20);
tile_fn!(tile_q8_0_avx512, q8_0_avx512, 34);

/// Like `tile_fn!`, for Q4_1 kernels that also read the regrouped Q8_1 quants.
macro_rules! tile_fn_packed {
    ($name:ident, $kern:ident) => {
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
                let mut pk = [std::ptr::null(); NT];
                for (i, p) in pk.iter_mut().enumerate() {
                    *p = acts.packed(t0 + i).as_ptr();
                }
                // SAFETY: forwarded from the caller.
                let res = unsafe { $kern::<RR, NT>(wp, rb / 20, a, s, pk) };
                for (i, row) in res.iter().enumerate() {
                    out[i * stride..i * stride + NT].copy_from_slice(row);
                }
            }
            let rr = w.len() / rb;
            // SAFETY: forwarded from the caller.
            unsafe {
                match (rr, nt) {
                    (4, 1) => run::<4, 1>(w, rb, acts, t0, out, stride),
                    (2, 4) => run::<2, 4>(w, rb, acts, t0, out, stride),
                    (1, 4) => run::<1, 4>(w, rb, acts, t0, out, stride),
                    (1, 3) => run::<1, 3>(w, rb, acts, t0, out, stride),
                    (1, 2) => run::<1, 2>(w, rb, acts, t0, out, stride),
                    (1, 1) => run::<1, 1>(w, rb, acts, t0, out, stride),
                    _ => {
                        for i in 0..rr {
                            let wi = &w[i * rb..(i + 1) * rb];
                            $name(wi, rb, acts, t0, nt, &mut out[i * stride..], stride);
                        }
                    }
                }
            }
        }
    };
}

tile_fn_packed!(tile_q4_1_avx512_vbmi, q4_1_avx512_vbmi);
tile_fn_packed!(tile_q4_1_avx2, q4_1_avx2_packed);

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn hsum256(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_movehdup_ps(s));
    _mm_cvtss_f32(s)
}

#[inline]
#[target_feature(enable = "avx512f,avx512dq,avx2,fma,f16c")]
fn hsum512(v: __m512) -> f32 {
    let lo = _mm512_castps512_ps256(v);
    let hi = _mm512_extractf32x8_ps::<1>(v);
    hsum256(_mm256_add_ps(lo, hi))
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
    _mm_cvtph_ps(_mm_cvtsi32_si128(unsafe {
        (p as *const i32).read_unaligned()
    }))
}

/// One f16 at `p` converted into lane 0.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn f16x1(p: *const u8) -> __m128 {
    _mm_cvtph_ps(_mm_cvtsi32_si128(
        unsafe { (p as *const u16).read_unaligned() } as i32,
    ))
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn nibbles16(p: *const u8) -> __m256i {
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
const PREFETCH: usize = 2048;

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
    unsafe { q41_like_avx2::<RR, NT, false>(w, nb, a, s) }
}

/// Q4_1 x Q8_1 on AVX2, two blocks per step against the regrouped activations: the
/// loaded pair of blocks needs only a mask and a shift, and one `madd` per pair.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q4_1_avx2_packed<const RR: usize, const NT: usize>(
    w: Rows<RR>,
    nb: usize,
    a: [*const u8; NT],
    s: [*const f32; NT],
    pk: [*const u8; NT],
) -> [[f32; NT]; RR] {
    let ones = _mm256_set1_epi16(1);
    let m4 = _mm256_set1_epi8(0x0F);
    let sidx = _mm256_set_epi32(2, 2, 2, 2, 0, 0, 0, 0);
    let mut acc = [[_mm256_setzero_ps(); NT]; RR];
    let mut accm = [[_mm_setzero_ps(); NT]; RR];
    for j in 0..nb / 2 {
        let b = 2 * j;
        let off = 128 * (j / 2) + 32 * (j % 2);
        // SAFETY: blocks b, b + 1 are in bounds; the regrouped activations hold pair j at
        // `off` (low halves) and `off + 64` (high halves).
        unsafe {
            for r in 0..RR {
                let wa = w[r].add(b * 20);
                _mm_prefetch::<_MM_HINT_T0>(wa.wrapping_add(PREFETCH) as *const i8);
                let dm = _mm_cvtph_ps(_mm_set_epi32(
                    0,
                    0,
                    (wa.add(20) as *const i32).read_unaligned(),
                    (wa as *const i32).read_unaligned(),
                ));
                let q =
                    _mm256_loadu2_m128i(wa.add(24) as *const __m128i, wa.add(4) as *const __m128i);
                let lo = _mm256_and_si256(q, m4);
                let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(q), m4);
                for t in 0..NT {
                    let ylo = _mm256_loadu_si256(pk[t].add(off) as *const __m256i);
                    let yhi = _mm256_loadu_si256(pk[t].add(off + 64) as *const __m256i);
                    let p16 = _mm256_add_epi16(
                        _mm256_maddubs_epi16(lo, ylo),
                        _mm256_maddubs_epi16(hi, yhi),
                    );
                    let p = _mm256_madd_epi16(p16, ones);
                    let ds = _mm_mul_ps(dm, _mm_loadu_ps(s[t].add(2 * b)));
                    let sc = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(ds), sidx);
                    acc[r][t] = _mm256_fmadd_ps(sc, _mm256_cvtepi32_ps(p), acc[r][t]);
                    accm[r][t] = _mm_add_ps(accm[r][t], ds);
                }
            }
        }
    }
    let mut res = [[0f32; NT]; RR];
    if nb % 2 == 1 {
        let b = nb - 1;
        let mut wr = [std::ptr::null(); RR];
        let mut ar = [std::ptr::null(); NT];
        let mut sr = [std::ptr::null(); NT];
        // SAFETY: block b is the last one of each row.
        unsafe {
            for r in 0..RR {
                wr[r] = w[r].add(20 * b);
            }
            for t in 0..NT {
                ar[t] = a[t].add(36 * b);
                sr[t] = s[t].add(2 * b);
            }
            res = q4_1_avx2::<RR, NT>(wr, 1, ar, sr);
        }
    }
    for r in 0..RR {
        for t in 0..NT {
            let m = accm[r][t];
            let m = _mm_cvtss_f32(_mm_movehdup_ps(m))
                + _mm_cvtss_f32(_mm_movehdup_ps(_mm_movehl_ps(m, m)));
            res[r][t] += hsum256(acc[r][t]) + m;
        }
    }
    res
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q5_1_avx2<const RR: usize, const NT: usize>(
    w: Rows<RR>,
    nb: usize,
    a: [*const u8; NT],
    s: [*const f32; NT],
) -> [[f32; NT]; RR] {
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
                _mm_prefetch::<_MM_HINT_T0>(wb.wrapping_add(PREFETCH) as *const i8);
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
                    let ds = _mm_mul_ps(
                        dm,
                        _mm_castpd_ps(_mm_load_sd(s[t].add(2 * b) as *const f64)),
                    );
                    acc[r][t] = _mm256_fmadd_ps(
                        _mm256_broadcastss_ps(ds),
                        _mm256_cvtepi32_ps(p),
                        acc[r][t],
                    );
                    accm[r][t] = _mm_add_ps(accm[r][t], ds);
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
                _mm_prefetch::<_MM_HINT_T0>(wb.wrapping_add(PREFETCH) as *const i8);
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
    unsafe { q8_0_like_avx2::<RR, NT, 0>(w, nb, a, s) }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q4_0_avx2<const RR: usize, const NT: usize>(
    w: Rows<RR>,
    nb: usize,
    a: [*const u8; NT],
    s: [*const f32; NT],
) -> [[f32; NT]; RR] {
    unsafe { q8_0_like_avx2::<RR, NT, 1>(w, nb, a, s) }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q5_0_avx2<const RR: usize, const NT: usize>(
    w: Rows<RR>,
    nb: usize,
    a: [*const u8; NT],
    s: [*const f32; NT],
) -> [[f32; NT]; RR] {
    unsafe { q8_0_like_avx2::<RR, NT, 2>(w, nb, a, s) }
}

/// Reads the 16 i16 block sums of a Q8_K block.
#[inline(always)]
unsafe fn bsums(y: *const u8) -> [i32; 16] {
    let mut out = [0i32; 16];
    for (g, o) in out.iter_mut().enumerate() {
        // SAFETY: the sums are the last 32 bytes of the 292-byte block.
        *o = unsafe { (y.add(260 + 2 * g) as *const i16).read_unaligned() } as i32;
    }
    out
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q4_k_avx2<const RR: usize, const NT: usize>(
    w: Rows<RR>,
    nb: usize,
    a: [*const u8; NT],
    s: [*const f32; NT],
) -> [[f32; NT]; RR] {
    unsafe { q45_k_avx2::<RR, NT, false>(w, nb, a, s) }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q5_k_avx2<const RR: usize, const NT: usize>(
    w: Rows<RR>,
    nb: usize,
    a: [*const u8; NT],
    s: [*const f32; NT],
) -> [[f32; NT]; RR] {
    unsafe { q45_k_avx2::<RR, NT, true>(w, nb, a, s) }
}

/// Q4_K / Q5_K x Q8_K: integer sums per 32-value sub-block weighted by the 6-bit scales
/// (in `madd`), the mins applied through the Q8_K block sums.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q45_k_avx2<const RR: usize, const NT: usize, const FIVE: bool>(
    w: Rows<RR>,
    nb: usize,
    a: [*const u8; NT],
    s: [*const f32; NT],
) -> [[f32; NT]; RR] {
    let bb = if FIVE { 176 } else { 144 };
    let m4 = _mm256_set1_epi8(0x0F);
    let one = _mm256_set1_epi8(1);
    let mut acc = [[0f32; NT]; RR];
    for b in 0..nb {
        // SAFETY: superblock b of each row and activation row is in bounds.
        unsafe {
            for r in 0..RR {
                let x = w[r].add(b * bb);
                let hd = f16x2(x);
                let d = _mm_cvtss_f32(hd);
                let dmin = _mm_cvtss_f32(_mm_movehdup_ps(hd));
                let sc = std::slice::from_raw_parts(x.add(4), 12);
                let mut scales = [0i16; 8];
                let mut mins = [0i32; 8];
                for j in 0..8 {
                    let (a, m) = super::blocks::scale_min_k4(j, sc);
                    scales[j] = a as i16;
                    mins[j] = m as i32;
                }
                let qs = x.add(if FIVE { 48 } else { 16 });
                let qh = if FIVE {
                    _mm256_loadu_si256(x.add(16) as *const __m256i)
                } else {
                    _mm256_setzero_si256()
                };
                for t in 0..NT {
                    let y = a[t].add(b * 292);
                    let mut sumi = _mm256_setzero_si256();
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
                        let ylo = _mm256_loadu_si256(y.add(4 + 64 * c) as *const __m256i);
                        let yhi = _mm256_loadu_si256(y.add(4 + 64 * c + 32) as *const __m256i);
                        let plo = _mm256_madd_epi16(
                            _mm256_maddubs_epi16(lo, ylo),
                            _mm256_set1_epi16(scales[2 * c]),
                        );
                        let phi = _mm256_madd_epi16(
                            _mm256_maddubs_epi16(hi, yhi),
                            _mm256_set1_epi16(scales[2 * c + 1]),
                        );
                        sumi = _mm256_add_epi32(sumi, _mm256_add_epi32(plo, phi));
                    }
                    let bs = bsums(y);
                    let mut sm = 0i32;
                    for j in 0..8 {
                        sm += mins[j] * (bs[2 * j] + bs[2 * j + 1]);
                    }
                    let dy = *s[t].add(b);
                    // Same f32 expression as the scalar kernel: bit-identical per superblock.
                    acc[r][t] += d * dy * hsum_epi32(sumi) as f32 - dmin * dy * sm as f32;
                }
            }
        }
    }
    let mut res = [[0f32; NT]; RR];
    for r in 0..RR {
        for t in 0..NT {
            res[r][t] = acc[r][t];
        }
    }
    res
}

/// Q6_K x Q8_K: unsigned 6-bit quants times activations, weighted per 16 values by the
/// i8 scales in `madd`; the -32 offset is applied through the Q8_K block sums.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q6_k_avx2<const RR: usize, const NT: usize>(
    w: Rows<RR>,
    nb: usize,
    a: [*const u8; NT],
    s: [*const f32; NT],
) -> [[f32; NT]; RR] {
    let m4 = _mm256_set1_epi8(0x0F);
    let m2 = _mm256_set1_epi8(0x03);
    let mut acc = [[0f32; NT]; RR];
    for b in 0..nb {
        // SAFETY: superblock b of each row and activation row is in bounds.
        unsafe {
            for r in 0..RR {
                let x = w[r].add(b * 210);
                let d = _mm_cvtss_f32(f16x1(x.add(208)));
                let mut sc = [0i16; 16];
                for (i, v) in sc.iter_mut().enumerate() {
                    *v = *x.add(192 + i) as i8 as i16;
                }
                let scv =
                    |i: usize| _mm256_set_m128i(_mm_set1_epi16(sc[i + 1]), _mm_set1_epi16(sc[i]));
                for t in 0..NT {
                    let y = a[t].add(b * 292);
                    let mut sumi = _mm256_setzero_si256();
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
                            _mm256_slli_epi16::<4>(_mm256_and_si256(
                                _mm256_srli_epi16::<2>(qh),
                                m2,
                            )),
                        );
                        let q3 = _mm256_or_si256(
                            _mm256_and_si256(_mm256_srli_epi16::<4>(ql0), m4),
                            _mm256_slli_epi16::<4>(_mm256_and_si256(
                                _mm256_srli_epi16::<4>(qh),
                                m2,
                            )),
                        );
                        let q4 = _mm256_or_si256(
                            _mm256_and_si256(_mm256_srli_epi16::<4>(ql1), m4),
                            _mm256_slli_epi16::<4>(_mm256_and_si256(
                                _mm256_srli_epi16::<6>(qh),
                                m2,
                            )),
                        );
                        let yb = y.add(4 + 128 * n);
                        for (g, q) in [q1, q2, q3, q4].into_iter().enumerate() {
                            let yv = _mm256_loadu_si256(yb.add(32 * g) as *const __m256i);
                            let p =
                                _mm256_madd_epi16(_mm256_maddubs_epi16(q, yv), scv(8 * n + 2 * g));
                            sumi = _mm256_add_epi32(sumi, p);
                        }
                    }
                    let bs = bsums(y);
                    let mut corr = 0i32;
                    for i in 0..16 {
                        corr += sc[i] as i32 * bs[i];
                    }
                    let dy = *s[t].add(b);
                    // Same f32 expression as the scalar kernel: bit-identical per superblock.
                    acc[r][t] += d * dy * (hsum_epi32(sumi) - 32 * corr) as f32;
                }
            }
        }
    }
    let mut res = [[0f32; NT]; RR];
    for r in 0..RR {
        for t in 0..NT {
            res[r][t] = acc[r][t];
        }
    }
    res
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

/// Spreads two lanes of a 4-lane vector (chosen by `idx`) across the low and high 8 lanes
/// of a 512-bit vector.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
fn spread2(v: __m128, idx: __m512i) -> __m512 {
    _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(v))
}

/// Sixteen 4-bit quants of two blocks at `pa` and `pb`, as 64 bytes in ggml's element
/// order: [a low nibbles, a high nibbles, b low nibbles, b high nibbles].
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
unsafe fn nibbles_pair(pa: *const u8, pb: *const u8) -> __m512i {
    let q256 = unsafe { _mm256_loadu2_m128i(pb as *const __m128i, pa as *const __m128i) };
    let z = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(q256), _mm256_srli_epi16::<4>(q256));
    let z = _mm512_and_si512(z, _mm512_set1_epi8(0x0F));
    _mm512_shuffle_i64x2::<0xD8>(z, z)
}

/// 32 quant bytes of two consecutive blocks (`stride` bytes apart) in one vector.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
unsafe fn load_pair(p: *const u8, stride: usize) -> __m512i {
    unsafe {
        _mm512_inserti64x4::<1>(
            _mm512_castsi256_si512(_mm256_loadu_si256(p as *const __m256i)),
            _mm256_loadu_si256(p.add(stride) as *const __m256i),
        )
    }
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
unsafe fn q4_1_avx512<const RR: usize, const NT: usize>(
    w: Rows<RR>,
    nb: usize,
    a: [*const u8; NT],
    s: [*const f32; NT],
) -> [[f32; NT]; RR] {
    let idx = _mm512_set_epi32(2, 2, 2, 2, 2, 2, 2, 2, 0, 0, 0, 0, 0, 0, 0, 0);
    let zero = _mm512_setzero_si512();
    let mut acc = [[_mm512_setzero_ps(); NT]; RR];
    let mut accm = [[_mm_setzero_ps(); NT]; RR];
    for pi in 0..nb / 2 {
        let b = 2 * pi;
        // SAFETY: blocks b and b + 1 are in bounds for each row and activation row.
        unsafe {
            let mut y = [zero; NT];
            let mut sy = [_mm_setzero_ps(); NT];
            for t in 0..NT {
                y[t] = load_pair(a[t].add(b * 36 + 4), 36);
                sy[t] = _mm_loadu_ps(s[t].add(2 * b));
            }
            for r in 0..RR {
                let wa = w[r].add(b * 20);
                let dm = _mm_cvtph_ps(_mm_set_epi32(
                    0,
                    0,
                    (wa.add(20) as *const i32).read_unaligned(),
                    (wa as *const i32).read_unaligned(),
                ));
                let q = nibbles_pair(wa.add(4), wa.add(24));
                for t in 0..NT {
                    let p = _mm512_dpbusd_epi32(zero, q, y[t]);
                    let ds = _mm_mul_ps(dm, sy[t]);
                    acc[r][t] = _mm512_fmadd_ps(spread2(ds, idx), _mm512_cvtepi32_ps(p), acc[r][t]);
                    accm[r][t] = _mm_add_ps(accm[r][t], ds);
                }
            }
        }
    }
    let mut tail = [[0f32; NT]; RR];
    if nb % 2 == 1 {
        let b = nb - 1;
        // SAFETY: block b is in bounds.
        unsafe {
            for r in 0..RR {
                let wb = w[r].add(b * 20);
                let dm = f16x2(wb);
                let q = nibbles16(wb.add(4));
                for t in 0..NT {
                    let y = _mm256_loadu_si256(a[t].add(b * 36 + 4) as *const __m256i);
                    let p = _mm256_dpbusd_epi32(_mm256_setzero_si256(), q, y);
                    let ds = _mm_mul_ps(
                        dm,
                        _mm_castpd_ps(_mm_load_sd(s[t].add(2 * b) as *const f64)),
                    );
                    tail[r][t] = hsum256(_mm256_mul_ps(
                        _mm256_broadcastss_ps(ds),
                        _mm256_cvtepi32_ps(p),
                    )) + _mm_cvtss_f32(_mm_movehdup_ps(ds));
                }
            }
        }
    }
    let mut res = [[0f32; NT]; RR];
    for r in 0..RR {
        for t in 0..NT {
            let m = accm[r][t];
            let m = _mm_cvtss_f32(_mm_movehdup_ps(m))
                + _mm_cvtss_f32(_mm_movehdup_ps(_mm_movehl_ps(m, m)));
            res[r][t] = hsum512(acc[r][t]) + m + tail[r][t];
        }
    }
    res
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
unsafe fn q8_0_like_avx512<const RR: usize, const NT: usize, const Q4: bool>(
    w: Rows<RR>,
    nb: usize,
    a: [*const u8; NT],
    s: [*const f32; NT],
) -> [[f32; NT]; RR] {
    let bb = if Q4 { 18 } else { 34 };
    let idx = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    let bias = _mm512_set1_epi8(-128);
    let eight = _mm512_set1_epi8(8);
    let zero = _mm512_setzero_si512();
    let mut acc = [[_mm512_setzero_ps(); NT]; RR];
    for pi in 0..nb / 2 {
        let b = 2 * pi;
        // SAFETY: blocks b and b + 1 are in bounds for each row and activation row.
        unsafe {
            // Activations as unsigned: y + 128.
            let mut y = [zero; NT];
            let mut dy = [_mm_setzero_ps(); NT];
            for t in 0..NT {
                y[t] = _mm512_xor_si512(load_pair(a[t].add(b * 34 + 2), 34), bias);
                dy[t] = _mm_castpd_ps(_mm_load_sd(s[t].add(b) as *const f64));
            }
            for r in 0..RR {
                let wa = w[r].add(b * bb);
                let wb = wa.add(bb);
                _mm_prefetch::<_MM_HINT_T0>(wa.wrapping_add(PREFETCH) as *const i8);
                let h = (wa as *const u16).read_unaligned() as i32
                    | (((wb as *const u16).read_unaligned() as i32) << 16);
                let d2 = _mm_cvtph_ps(_mm_cvtsi32_si128(h));
                let x = if Q4 {
                    _mm512_sub_epi8(nibbles_pair(wa.add(2), wb.add(2)), eight)
                } else {
                    load_pair(wa.add(2), bb)
                };
                // (y + 128) . x - 128 * sum(x) = y . x
                let neg_corr = _mm512_sub_epi32(zero, _mm512_dpbusd_epi32(zero, bias, x));
                for t in 0..NT {
                    let p = _mm512_dpbusd_epi32(neg_corr, y[t], x);
                    let ds = _mm_mul_ps(d2, dy[t]);
                    acc[r][t] = _mm512_fmadd_ps(spread2(ds, idx), _mm512_cvtepi32_ps(p), acc[r][t]);
                }
            }
        }
    }
    let mut tail = [[0f32; NT]; RR];
    if nb % 2 == 1 {
        let b = nb - 1;
        // SAFETY: block b is in bounds.
        unsafe {
            let bias = _mm256_set1_epi8(-128);
            let z = _mm256_setzero_si256();
            for r in 0..RR {
                let wb = w[r].add(b * bb);
                let dx = f16x1(wb);
                let x = if Q4 {
                    _mm256_sub_epi8(nibbles16(wb.add(2)), _mm256_set1_epi8(8))
                } else {
                    _mm256_loadu_si256(wb.add(2) as *const __m256i)
                };
                let neg_corr = _mm256_sub_epi32(z, _mm256_dpbusd_epi32(z, bias, x));
                for t in 0..NT {
                    let y = _mm256_loadu_si256(a[t].add(b * 34 + 2) as *const __m256i);
                    let p = _mm256_dpbusd_epi32(neg_corr, _mm256_xor_si256(y, bias), x);
                    let d = _mm_mul_ss(dx, _mm_load_ss(s[t].add(b)));
                    tail[r][t] = hsum256(_mm256_mul_ps(
                        _mm256_broadcastss_ps(d),
                        _mm256_cvtepi32_ps(p),
                    ));
                }
            }
        }
    }
    let mut res = [[0f32; NT]; RR];
    for r in 0..RR {
        for t in 0..NT {
            res[r][t] = hsum512(acc[r][t]) + tail[r][t];
        }
    }
    res
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
unsafe fn q8_0_avx512<const RR: usize, const NT: usize>(
    w: Rows<RR>,
    nb: usize,
    a: [*const u8; NT],
    s: [*const f32; NT],
) -> [[f32; NT]; RR] {
    unsafe { q8_0_like_avx512::<RR, NT, false>(w, nb, a, s) }
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
unsafe fn q4_0_avx512<const RR: usize, const NT: usize>(
    w: Rows<RR>,
    nb: usize,
    a: [*const u8; NT],
    s: [*const f32; NT],
) -> [[f32; NT]; RR] {
    unsafe { q8_0_like_avx512::<RR, NT, true>(w, nb, a, s) }
}

/// Q4_1 x Q8_1 with AVX-512 VBMI: four weight blocks per step, gathered with one byte
/// permute; the activations come regrouped (low halves, then high halves), so each
/// loaded weight vector needs only a mask and a shift.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx512vbmi,avx2,fma,f16c")]
unsafe fn q4_1_avx512_vbmi<const RR: usize, const NT: usize>(
    w: Rows<RR>,
    nb: usize,
    _a: [*const u8; NT],
    s: [*const f32; NT],
    pk: [*const u8; NT],
) -> [[f32; NT]; RR] {
    // Byte indices of the quants of blocks 0..4 within the 80 bytes at the group start
    // (blocks are 20 bytes: d, m, then 16 quant bytes).
    let mut qidx = [0u8; 64];
    for (i, v) in qidx.iter_mut().enumerate() {
        *v = (20 * (i / 16) + 4 + i % 16) as u8;
    }
    let qidx = unsafe { _mm512_loadu_si512(qidx.as_ptr() as *const _) };
    // u32 index of each block's (d, m) pair: 0, 5, 10, 15.
    let didx = _mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 15, 10, 5, 0);
    // Spread the products d_w * d_a of blocks 0..4 (even lanes of 8) over 4 lanes each.
    let sidx = _mm512_set_epi32(6, 6, 6, 6, 4, 4, 4, 4, 2, 2, 2, 2, 0, 0, 0, 0);
    let m4 = _mm512_set1_epi8(0x0F);
    let zero = _mm512_setzero_si512();
    let mut acc = [[_mm512_setzero_ps(); NT]; RR];
    let mut accm = [[_mm256_setzero_ps(); NT]; RR];
    let full = nb / 4;
    for g in 0..nb.div_ceil(4) {
        // Blocks in this group: 4, or 1..=3 for the last, partial group.
        let nblk = (nb - 4 * g).min(4);
        // SAFETY: blocks 4g..4g+nblk are in bounds; loads of a partial group (and the second
        // weight load of a full one) are masked to bytes that belong to it; the regrouped
        // activations are padded to whole groups.
        unsafe {
            // Activations are (re)loaded per row from L1: hoisting them for all tokens would
            // not fit the register file next to the RR x NT accumulators.
            let smask = if g < full {
                0xFF
            } else {
                ((1u32 << (2 * nblk)) - 1) as u8
            };
            for r in 0..RR {
                let wg = w[r].add(80 * g);
                _mm_prefetch::<_MM_HINT_T0>(wg.wrapping_add(PREFETCH) as *const i8);
                _mm_prefetch::<_MM_HINT_T0>(wg.wrapping_add(PREFETCH + 64) as *const i8);
                let (z0, z1) = if g < full {
                    (
                        _mm512_loadu_si512(wg as *const _),
                        _mm512_maskz_loadu_epi8(0xFFFF, wg.add(64) as *const i8),
                    )
                } else {
                    (
                        _mm512_maskz_loadu_epi8((1u64 << (20 * nblk)) - 1, wg as *const i8),
                        zero,
                    )
                };
                let q = _mm512_permutex2var_epi8(z0, qidx, z1);
                let dm =
                    _mm256_cvtph_ps(_mm512_castsi512_si128(_mm512_permutexvar_epi32(didx, z0)));
                let lo = _mm512_and_si512(q, m4);
                let hi = _mm512_and_si512(_mm512_srli_epi16::<4>(q), m4);
                for t in 0..NT {
                    let ylo = _mm512_loadu_si512(pk[t].add(128 * g) as *const _);
                    let yhi = _mm512_loadu_si512(pk[t].add(128 * g + 64) as *const _);
                    let sy = _mm256_maskz_loadu_ps(smask, s[t].add(8 * g));
                    let p = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(zero, lo, ylo), hi, yhi);
                    let ds = _mm256_mul_ps(dm, sy);
                    let sc = _mm512_permutexvar_ps(sidx, _mm512_castps256_ps512(ds));
                    acc[r][t] = _mm512_fmadd_ps(sc, _mm512_cvtepi32_ps(p), acc[r][t]);
                    accm[r][t] = _mm256_add_ps(accm[r][t], ds);
                }
            }
        }
    }
    let mut res = [[0f32; NT]; RR];
    // Keep only the odd lanes (the m * s terms) of the min accumulators.
    let odd = _mm256_castsi256_ps(_mm256_set_epi32(-1, 0, -1, 0, -1, 0, -1, 0));
    for r in 0..RR {
        for t in 0..NT {
            res[r][t] += hsum512(acc[r][t]) + hsum256(_mm256_and_ps(accm[r][t], odd));
        }
    }
    res
}

// ---------------------------------------------------------------- activation quantization

/// Quantizes rows to Q8_0 (`Q8_1 == false`) or Q8_1 exactly like
/// `blocks::quantize_activation_blocks` (llama.cpp's x86 rule: scale by `127 / amax`,
/// round half to even; f16 scales rounded to nearest even),
/// appending each block's f32 scales to `scales` and, for Q8_1, writing the regrouped
/// quants to `packed` (`packed.len()` = rows * `k.div_ceil(128) * 128`, zeroed).
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C; `x.len()` must be a multiple of `k`, `k` a
/// multiple of 32, and `out` exactly the quantized size.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn quantize_q8_avx2<const Q8_1: bool>(
    x: &[f32],
    k: usize,
    out: &mut [u8],
    scales: &mut Vec<f32>,
    packed: &mut [u8],
) {
    let bb = if Q8_1 { 36 } else { 34 };
    let qoff = if Q8_1 { 4 } else { 2 };
    let nb_row = k / 32;
    let prow = k.div_ceil(128) * 128;
    let sign = _mm256_set1_ps(-0.0);
    let perm = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (bi, (xb, ob)) in x.chunks_exact(32).zip(out.chunks_exact_mut(bb)).enumerate() {
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
                let (row, b) = (bi / nb_row, bi % nb_row);
                let base = row * prow + 128 * (b / 4) + 16 * (b % 4);
                let pp = packed.as_mut_ptr();
                _mm_storeu_si128(pp.add(base) as *mut __m128i, _mm256_castsi256_si128(q8));
                _mm_storeu_si128(
                    pp.add(base + 64) as *mut __m128i,
                    _mm256_extracti128_si256::<1>(q8),
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::{quantize, quantize_activations, scalar};

    /// The AVX-512 Q4_1 kernel without VBMI is not selected on CPUs that have VBMI, and the
    /// one-block AVX2 kernel only runs odd last blocks, so test both directly against the
    /// scalar kernel.
    #[test]
    fn q4_1_fallback_kernels_match_scalar() {
        for which in 0..2 {
            if (which == 0 && !has_avx512()) || !has_avx2() {
                continue;
            }
            check_q4_1_kernel(which);
        }
    }

    fn check_q4_1_kernel(which: usize) {
        for nb in 1..8 {
            let k = 32 * nb;
            for n in 1..6 {
                let rows = 5;
                let w: Vec<f32> = (0..rows * k)
                    .map(|i| ((i * 37 % 101) as f32 - 50.0) / 17.0)
                    .collect();
                let x: Vec<f32> = (0..n * k)
                    .map(|i| ((i * 53 % 89) as f32 - 44.0) / 9.0)
                    .collect();
                let wq = quantize(GgmlType::Q4_1, &w).unwrap();
                let mut acts = QuantizedActivations::new();
                quantize_activations(GgmlType::Q4_1, &x, n, k, &mut acts).unwrap();
                let rb = 20 * nb;
                for (rr, nt) in [(4, 1), (2, 4), (1, 4), (1, 3), (1, 2), (1, 1), (3, 2)] {
                    if nt > n {
                        continue;
                    }
                    let mut out = vec![0f32; rr * n];
                    // SAFETY: AVX-512 support was checked; the lengths are consistent.
                    unsafe {
                        if which == 0 {
                            tile_q4_1_avx512(&wq[..rr * rb], rb, &acts, 0, nt, &mut out, n)
                        } else {
                            tile_q4_1_avx2_plain(&wq[..rr * rb], rb, &acts, 0, nt, &mut out, n)
                        }
                    };
                    for r in 0..rr {
                        for t in 0..nt {
                            let (a, s, f) = acts.parts(t);
                            let want =
                                scalar::dot(GgmlType::Q4_1, &wq[r * rb..(r + 1) * rb], a, s, f);
                            let got = out[r * n + t];
                            assert!(
                                (got - want).abs() <= 1e-4 * (1.0 + want.abs()),
                                "{got} vs {want}"
                            );
                        }
                    }
                }
            }
        }
    }
}
