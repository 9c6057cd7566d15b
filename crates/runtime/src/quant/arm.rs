//! aarch64 NEON kernels for the quantized formats the real models use (Q4_0, Q4_1,
//! Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K; the plain types use the scalar kernels), and
//! activation quantization to Q8_0, Q8_1 and Q8_K with the scalar code's bytes. Each
//! block of a weight row is unpacked once for up to eight tokens (a prompt's tile), and
//! the integer products go through `sdot` where the CPU has it. Their speed has not been
//! measured on an ARM machine (none was at hand): only their bits, under qemu.
//!
//! They sum in the scalar reference's order, so every level gives the same bits, which
//! a test run under qemu checks (`cargo xtask test` when the aarch64 target and qemu
//! are installed):
//! - the 32-element formats as [`super::scalar`]'s `lanes_dot` (llama.cpp's x86 order):
//!   each block's 32 integer products summed in eight groups of four (exact in i32),
//!   group `j` into f32 lane `j` by one fused multiply-add with `d_w · d_a`, the lanes
//!   added as `((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7))`, then the minimum terms;
//! - the K-quants block by block: the block's integer sums with NEON (exact), then the
//!   scalar kernel's f32 expression.

use super::blocks::{f16_at, f32_at, scale_min_k4};
use super::{QuantizedActivations, TileFn};
use crate::ggml_type::GgmlType;
use std::arch::aarch64::*;

/// The NEON tile kernel for `ty`, if there is one: with `sdot` where the CPU has the
/// dot-product instructions (Apple M1 and later, Graviton 2 and later, Cortex-A76 and
/// later), else the widening multiplies.
pub(crate) fn kernel_neon(ty: GgmlType) -> Option<TileFn> {
    if std::arch::is_aarch64_feature_detected!("dotprod") {
        kernel_for::<true>(ty)
    } else {
        kernel_for::<false>(ty)
    }
}

fn kernel_for<const DOT: bool>(ty: GgmlType) -> Option<TileFn> {
    let kernel: TileFn = match ty {
        GgmlType::Q4_0 => tile::<KIND_Q4_0, DOT>,
        GgmlType::Q4_1 => tile::<KIND_Q4_1, DOT>,
        GgmlType::Q5_0 => tile::<KIND_Q5_0, DOT>,
        GgmlType::Q5_1 => tile::<KIND_Q5_1, DOT>,
        GgmlType::Q8_0 => tile::<KIND_Q8_0, DOT>,
        GgmlType::Q4_K => tile::<KIND_Q4_K, DOT>,
        GgmlType::Q5_K => tile::<KIND_Q5_K, DOT>,
        GgmlType::Q6_K => tile::<KIND_Q6_K, DOT>,
        _ => return None,
    };
    Some(kernel)
}

const KIND_Q4_0: u8 = 0;
const KIND_Q4_1: u8 = 1;
const KIND_Q5_0: u8 = 2;
const KIND_Q5_1: u8 = 3;
const KIND_Q8_0: u8 = 4;
const KIND_Q4_K: u8 = 5;
const KIND_Q5_K: u8 = 6;
const KIND_Q6_K: u8 = 7;

/// Weight block bytes, activation block bytes (Q8_0: 34, Q8_1: 36) and activation
/// scales per block (Q8_1 also carries `d · Σq`, the minimum's factor) of a kind.
const fn geometry(kind: u8) -> (usize, usize, usize) {
    match kind {
        KIND_Q4_0 => (18, 34, 1),
        KIND_Q4_1 => (20, 36, 2),
        KIND_Q5_0 => (22, 34, 1),
        KIND_Q5_1 => (24, 36, 2),
        _ => (34, 34, 1),
    }
}

/// Four sums of four adjacent products of 16 signed bytes: `[Σ 0..3, Σ 4..7, Σ 8..11,
/// Σ 12..15]` (each product fits i16, each sum i32: exact).
#[inline]
#[target_feature(enable = "neon")]
fn group_sums(x: int8x16_t, y: int8x16_t) -> int32x4_t {
    let lo = vpaddlq_s16(vmull_s8(vget_low_s8(x), vget_low_s8(y)));
    let hi = vpaddlq_s16(vmull_s8(vget_high_s8(x), vget_high_s8(y)));
    vpaddq_s32(lo, hi)
}

/// The fifth bit of 16 elements from 16 bits of `qh` (bit `i` for element `i`), as 0
/// or 0x10 per byte.
#[inline]
#[target_feature(enable = "neon")]
fn fifth_bits(qh: u16) -> uint8x16_t {
    const BIT: [u8; 16] = [1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128];
    let bytes = vcombine_u8(vdup_n_u8(qh as u8), vdup_n_u8((qh >> 8) as u8));
    // SAFETY: BIT is 16 bytes.
    let bit = unsafe { vld1q_u8(BIT.as_ptr()) };
    vandq_u8(vtstq_u8(bytes, bit), vdupq_n_u8(0x10))
}

/// A weight block's 32 integer weights (elements 0..15, then 16..31) and its `d` and
/// `m` (0 for the formats without a minimum).
///
/// # Safety
/// `x` must hold a whole block of `KIND`.
#[inline]
#[target_feature(enable = "neon")]
unsafe fn unpack<const KIND: u8>(x: &[u8]) -> (int8x16_t, int8x16_t, f32, f32) {
    let d = f16_at(x, 0);
    // SAFETY: the caller passes a whole block; every load below reads inside it.
    unsafe {
        match KIND {
            KIND_Q8_0 => (
                vld1q_s8(x[2..].as_ptr() as *const i8),
                vld1q_s8(x[18..].as_ptr() as *const i8),
                d,
                0.0,
            ),
            KIND_Q4_0 | KIND_Q4_1 => {
                let at = if KIND == KIND_Q4_0 { 2 } else { 4 };
                let qs = vld1q_u8(x[at..].as_ptr());
                let lo = vandq_u8(qs, vdupq_n_u8(0x0F));
                let hi = vshrq_n_u8::<4>(qs);
                if KIND == KIND_Q4_0 {
                    let eight = vdupq_n_s8(8);
                    (
                        vsubq_s8(vreinterpretq_s8_u8(lo), eight),
                        vsubq_s8(vreinterpretq_s8_u8(hi), eight),
                        d,
                        0.0,
                    )
                } else {
                    (
                        vreinterpretq_s8_u8(lo),
                        vreinterpretq_s8_u8(hi),
                        d,
                        f16_at(x, 2),
                    )
                }
            }
            _ => {
                // Q5_0 / Q5_1: 4 bytes of fifth bits, then the nibbles.
                let at = if KIND == KIND_Q5_0 { 2 } else { 4 };
                let qh = u32::from_le_bytes([x[at], x[at + 1], x[at + 2], x[at + 3]]);
                let qs = vld1q_u8(x[at + 4..].as_ptr());
                let lo = vorrq_u8(vandq_u8(qs, vdupq_n_u8(0x0F)), fifth_bits(qh as u16));
                let hi = vorrq_u8(vshrq_n_u8::<4>(qs), fifth_bits((qh >> 16) as u16));
                if KIND == KIND_Q5_0 {
                    let sixteen = vdupq_n_s8(16);
                    (
                        vsubq_s8(vreinterpretq_s8_u8(lo), sixteen),
                        vsubq_s8(vreinterpretq_s8_u8(hi), sixteen),
                        d,
                        0.0,
                    )
                } else {
                    (
                        vreinterpretq_s8_u8(lo),
                        vreinterpretq_s8_u8(hi),
                        d,
                        f16_at(x, 2),
                    )
                }
            }
        }
    }
}

/// Sums of four adjacent products of 16 signed bytes added to `acc`: `sdot` where the
/// CPU has the dot-product instructions (`DOT`), else [`group_sums`]. Exact in i32 either
/// way, so both give the same bits.
///
/// # Safety
/// With `DOT`, the CPU must have the `dotprod` feature.
#[inline]
#[target_feature(enable = "neon")]
unsafe fn sums4<const DOT: bool>(acc: int32x4_t, x: int8x16_t, y: int8x16_t) -> int32x4_t {
    if DOT {
        // SAFETY: the caller's contract.
        unsafe { sdot(acc, x, y) }
    } else {
        vaddq_s32(acc, group_sums(x, y))
    }
}

/// `sdot`: lane `i` of `acc` plus the four products of bytes `4i..4i + 4`. Inline
/// assembly, as the intrinsic (`vdotq_s32`) is not stable in Rust; the directive lets
/// the assembler take the instruction in functions compiled without `dotprod`, so that
/// the kernels inline it (`#[inline(always)]` and `#[target_feature]` do not combine).
///
/// # Safety
/// The CPU must have the `dotprod` feature.
#[inline(always)]
unsafe fn sdot(mut acc: int32x4_t, x: int8x16_t, y: int8x16_t) -> int32x4_t {
    // SAFETY: `sdot` reads and writes only these registers; the caller checked the
    // feature.
    unsafe {
        std::arch::asm!(
            ".arch_extension dotprod",
            "sdot {acc:v}.4s, {x:v}.16b, {y:v}.16b",
            acc = inout(vreg) acc,
            x = in(vreg) x,
            y = in(vreg) y,
            options(pure, nomem, nostack, preserves_flags),
        );
    }
    acc
}

/// The sum of the products of two 32-byte halves (`x0 . y0 + x1 . y1`), exact in i32.
///
/// # Safety
/// As [`sums4`].
#[inline]
#[target_feature(enable = "neon")]
unsafe fn dot32<const DOT: bool>(
    x0: int8x16_t,
    y0: int8x16_t,
    x1: int8x16_t,
    y1: int8x16_t,
) -> i32 {
    // SAFETY: the caller's contract.
    unsafe { vaddvq_s32(sums4::<DOT>(sums4::<DOT>(vdupq_n_s32(0), x0, y0), x1, y1)) }
}

/// The sum of the 16 products of two vectors of signed bytes, exact in i32.
///
/// # Safety
/// As [`sums4`].
#[inline]
#[target_feature(enable = "neon")]
unsafe fn dot16<const DOT: bool>(x: int8x16_t, y: int8x16_t) -> i32 {
    // SAFETY: the caller's contract.
    unsafe { vaddvq_s32(sums4::<DOT>(vdupq_n_s32(0), x, y)) }
}

/// Loads 16 signed bytes at `p[at..]`.
///
/// # Safety
/// `p` must hold at least `at + 16` bytes.
#[inline]
#[target_feature(enable = "neon")]
unsafe fn load16(p: &[u8], at: usize) -> int8x16_t {
    debug_assert!(p.len() >= at + 16);
    // SAFETY: the caller guarantees 16 bytes at `at`.
    unsafe { vld1q_s8(p.as_ptr().add(at) as *const i8) }
}

/// Most tokens a weight row's blocks are unpacked for at once: their accumulators and a
/// block's unpacked quants stay in the 32 vector registers.
const TOKENS: usize = 8;

/// Each row of `w` against tokens `t0..t0 + nt`: each block of the row unpacked once for
/// up to [`TOKENS`] tokens, every (row, token) pair summed in its own accumulators in the
/// reference's order (so the same bits as one pair at a time); `DOT` takes the integer
/// products through `sdot`.
///
/// # Safety
/// The CPU must have NEON, and `dotprod` with `DOT`; `w` must be whole rows of `rb`
/// bytes of `KIND`, and tokens `t0..t0 + nt` of `acts` quantized for it at the same
/// width.
#[target_feature(enable = "neon")]
unsafe fn tile<const KIND: u8, const DOT: bool>(
    w: &[u8],
    rb: usize,
    acts: &QuantizedActivations,
    t0: usize,
    nt: usize,
    out: &mut [f32],
    stride: usize,
) {
    for (i, row) in w.chunks_exact(rb).enumerate() {
        let mut t = 0;
        while t < nt {
            let dst = &mut out[i * stride + t..];
            let first = t0 + t;
            // SAFETY: the caller's contract, passed on.
            t += unsafe {
                match nt - t {
                    n if n >= TOKENS => row_tokens::<KIND, DOT, TOKENS>(row, acts, first, dst),
                    n if n >= 4 => row_tokens::<KIND, DOT, 4>(row, acts, first, dst),
                    3 => row_tokens::<KIND, DOT, 3>(row, acts, first, dst),
                    2 => row_tokens::<KIND, DOT, 2>(row, acts, first, dst),
                    _ => row_tokens::<KIND, DOT, 1>(row, acts, first, dst),
                }
            };
        }
    }
}

/// One row against `NT` tokens from `first`, written to `dst[..NT]`; returns `NT`.
#[inline]
#[target_feature(enable = "neon")]
unsafe fn row_tokens<const KIND: u8, const DOT: bool, const NT: usize>(
    row: &[u8],
    acts: &QuantizedActivations,
    first: usize,
    dst: &mut [f32],
) -> usize {
    let a: [(&[u8], &[f32]); NT] = std::array::from_fn(|j| {
        let (a, s, _) = acts.parts(first + j);
        (a, s)
    });
    // SAFETY: the caller's contract, passed on.
    let sums = unsafe {
        match KIND {
            KIND_Q4_K => row_q45_k::<false, DOT, NT>(row, &a),
            KIND_Q5_K => row_q45_k::<true, DOT, NT>(row, &a),
            KIND_Q6_K => row_q6_k::<DOT, NT>(row, &a),
            _ => row32::<KIND, DOT, NT>(row, &a),
        }
    };
    dst[..NT].copy_from_slice(&sums);
    NT
}

/// A row of a 32-element format against `NT` activation rows (`a`: quants, scales).
///
/// # Safety
/// `row` must be whole blocks of `KIND` and each activation row at least as many
/// activation blocks; with `DOT`, as [`sums4`].
#[inline]
#[target_feature(enable = "neon")]
unsafe fn row32<const KIND: u8, const DOT: bool, const NT: usize>(
    row: &[u8],
    a: &[(&[u8], &[f32]); NT],
) -> [f32; NT] {
    let (wb, ab, per_block) = geometry(KIND);
    let mut lanes_lo = [vdupq_n_f32(0.0); NT];
    let mut lanes_hi = [vdupq_n_f32(0.0); NT];
    let mut mins = [0f32; NT];
    for (b, x) in row.chunks_exact(wb).enumerate() {
        // SAFETY: `x` is a whole block.
        let (q_lo, q_hi, d, m) = unsafe { unpack::<KIND>(x) };
        for (t, &(y, s)) in a.iter().enumerate() {
            // The block's last 32 bytes are its quants.
            let yq = &y[b * ab + ab - 32..b * ab + ab];
            // SAFETY: `yq` is 32 bytes; `sums4`'s contract is the caller's.
            let (lo, hi) = unsafe {
                (
                    sums4::<DOT>(vdupq_n_s32(0), q_lo, load16(yq, 0)),
                    sums4::<DOT>(vdupq_n_s32(0), q_hi, load16(yq, 16)),
                )
            };
            let dd = vdupq_n_f32(d * s[per_block * b]);
            lanes_lo[t] = vfmaq_f32(lanes_lo[t], vcvtq_f32_s32(lo), dd);
            lanes_hi[t] = vfmaq_f32(lanes_hi[t], vcvtq_f32_s32(hi), dd);
            if per_block == 2 {
                mins[t] = m.mul_add(s[2 * b + 1], mins[t]);
            }
        }
    }
    // [l0+l4, l1+l5, l2+l6, l3+l7], then ((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7)).
    std::array::from_fn(|t| {
        let v = vaddq_f32(lanes_lo[t], lanes_hi[t]);
        let (t0, t1, t2, t3) = (
            vgetq_lane_f32::<0>(v),
            vgetq_lane_f32::<1>(v),
            vgetq_lane_f32::<2>(v),
            vgetq_lane_f32::<3>(v),
        );
        (t0 + t2) + (t1 + t3) + mins[t]
    })
}

/// A Q4_K (or, with `FIVE`, Q5_K) row against `NT` Q8_K rows: per block the integer
/// sums of the scalar kernel, `si` (scales times sub-block dot products) and `sm`
/// (minimums times the activations' 16-element sums), then its f32 expression. The
/// block's quants are unpacked once for the tokens.
///
/// # Safety
/// `row` must be whole blocks and each activation row at least as many Q8_K blocks; with
/// `DOT`, as [`sums4`].
#[inline]
#[target_feature(enable = "neon")]
unsafe fn row_q45_k<const FIVE: bool, const DOT: bool, const NT: usize>(
    row: &[u8],
    a: &[(&[u8], &[f32]); NT],
) -> [f32; NT] {
    let bb = if FIVE { 176 } else { 144 };
    let qs_at = if FIVE { 48 } else { 16 };
    let low = vdupq_n_u8(0x0F);
    let mut sum = [0f32; NT];
    for (b, x) in row.chunks_exact(bb).enumerate() {
        // Sub-block 2c's quants are lo[c] (two halves of 16), 2c + 1's hi[c].
        let mut lo = [[vdupq_n_s8(0); 2]; 4];
        let mut hi = [[vdupq_n_s8(0); 2]; 4];
        let mut sc = [[0i32; 2]; 4];
        let mut mn = [[0i32; 2]; 4];
        for c in 0..4 {
            let (sc1, m1) = scale_min_k4(2 * c, &x[4..16]);
            let (sc2, m2) = scale_min_k4(2 * c + 1, &x[4..16]);
            sc[c] = [sc1 as i32, sc2 as i32];
            mn[c] = [m1 as i32, m2 as i32];
            for half in 0..2 {
                let l = 16 * half;
                // SAFETY: the block holds 128 quant bytes at `qs_at` and, for Q5_K, 32
                // bytes of fifth bits at 16.
                let (qs, qh) = unsafe {
                    (
                        vld1q_u8(x.as_ptr().add(qs_at + 32 * c + l)),
                        if FIVE {
                            vld1q_u8(x.as_ptr().add(16 + l))
                        } else {
                            vdupq_n_u8(0)
                        },
                    )
                };
                let mut l4 = vandq_u8(qs, low);
                let mut h4 = vshrq_n_u8::<4>(qs);
                if FIVE {
                    let bit = |b: u8| vandq_u8(vtstq_u8(qh, vdupq_n_u8(b)), vdupq_n_u8(0x10));
                    l4 = vorrq_u8(l4, bit(1 << (2 * c)));
                    h4 = vorrq_u8(h4, bit(1 << (2 * c + 1)));
                }
                lo[c][half] = vreinterpretq_s8_u8(l4);
                hi[c][half] = vreinterpretq_s8_u8(h4);
            }
        }
        let (d, dmin) = (f16_at(x, 0), f16_at(x, 2));
        for (t, &(act, _)) in a.iter().enumerate() {
            let y = &act[b * 292..(b + 1) * 292];
            let mut si = 0i32;
            let mut sm = 0i32;
            for c in 0..4 {
                let q = 4 + 64 * c;
                // SAFETY: `y` holds 256 quants at 4; `sums4`'s contract is the caller's.
                let (s1, s2) = unsafe {
                    (
                        dot32::<DOT>(lo[c][0], load16(y, q), lo[c][1], load16(y, q + 16)),
                        dot32::<DOT>(hi[c][0], load16(y, q + 32), hi[c][1], load16(y, q + 48)),
                    )
                };
                si += sc[c][0] * s1 + sc[c][1] * s2;
                let bs = |g: usize| i16::from_le_bytes([y[260 + 2 * g], y[261 + 2 * g]]) as i32;
                sm += mn[c][0] * (bs(4 * c) + bs(4 * c + 1))
                    + mn[c][1] * (bs(4 * c + 2) + bs(4 * c + 3));
            }
            let dy = f32_at(y, 0);
            sum[t] += d * dy * si as f32 - dmin * dy * sm as f32;
        }
    }
    sum
}

/// A Q6_K row against `NT` Q8_K rows: per block the scalar kernel's sixteen 16-element
/// integer sums, times their scales, then its f32 expression. The block's quants are
/// unpacked once for the tokens.
///
/// # Safety
/// `row` must be whole blocks and each activation row at least as many Q8_K blocks; with
/// `DOT`, as [`sums4`].
#[inline]
#[target_feature(enable = "neon")]
unsafe fn row_q6_k<const DOT: bool, const NT: usize>(
    row: &[u8],
    a: &[(&[u8], &[f32]); NT],
) -> [f32; NT] {
    let low = vdupq_n_u8(0x0F);
    let three = vdupq_n_u8(3);
    let offset = vdupq_n_s8(32);
    let mut sum = [0f32; NT];
    for (b, x) in row.chunks_exact(210).enumerate() {
        // q[n][half][i]: the 16 quants that meet activations 128 n + 32 i + 16 half.
        let mut q = [[[vdupq_n_s8(0); 4]; 2]; 2];
        for (n, qn) in q.iter_mut().enumerate() {
            let (ql, qh) = (64 * n, 128 + 32 * n);
            for (half, qv) in qn.iter_mut().enumerate() {
                let l = 16 * half;
                // SAFETY: the block holds 64 bytes of low bits at `ql`, 32 of high bits
                // at `qh`.
                let (ql0, ql1, h) = unsafe {
                    (
                        vld1q_u8(x.as_ptr().add(ql + l)),
                        vld1q_u8(x.as_ptr().add(ql + 32 + l)),
                        vld1q_u8(x.as_ptr().add(qh + l)),
                    )
                };
                let six = |nib: uint8x16_t, high: uint8x16_t| {
                    vsubq_s8(
                        vreinterpretq_s8_u8(vorrq_u8(nib, vshlq_n_u8::<4>(vandq_u8(high, three)))),
                        offset,
                    )
                };
                *qv = [
                    six(vandq_u8(ql0, low), h),
                    six(vandq_u8(ql1, low), vshrq_n_u8::<2>(h)),
                    six(vshrq_n_u8::<4>(ql0), vshrq_n_u8::<4>(h)),
                    six(vshrq_n_u8::<4>(ql1), vshrq_n_u8::<6>(h)),
                ];
            }
        }
        let d = f16_at(x, 208);
        for (t, &(act, _)) in a.iter().enumerate() {
            let y = &act[b * 292..(b + 1) * 292];
            let mut si = 0i32;
            for (n, qn) in q.iter().enumerate() {
                let (sc, yq) = (192 + 8 * n, 4 + 128 * n);
                let scale = |i: usize| x[sc + i] as i8 as i32;
                for (half, qv) in qn.iter().enumerate() {
                    let l = 16 * half;
                    // SAFETY: `y` holds 128 quants at `yq`; `sums4`'s contract is the
                    // caller's.
                    si += unsafe {
                        scale(half) * dot16::<DOT>(qv[0], load16(y, yq + l))
                            + scale(half + 2) * dot16::<DOT>(qv[1], load16(y, yq + 32 + l))
                            + scale(half + 4) * dot16::<DOT>(qv[2], load16(y, yq + 64 + l))
                            + scale(half + 6) * dot16::<DOT>(qv[3], load16(y, yq + 96 + l))
                    };
                }
            }
            sum[t] += d * f32_at(y, 0) * si as f32;
        }
    }
    sum
}

// ---------------------------------------------------------------- activation quantization

/// Largest magnitude of `x` (a multiple of 16 values), as the scalar fold
/// `a.max(v.abs())`: `fmaxnm` skips NaN as `f32::max` does, and a maximum is exact in
/// any order.
///
/// # Safety
/// `x.len()` is a multiple of 16.
#[inline]
#[target_feature(enable = "neon")]
unsafe fn amax(x: &[f32]) -> f32 {
    let mut m = [vdupq_n_f32(0.0); 4];
    for c in x.chunks_exact(16) {
        for (i, mi) in m.iter_mut().enumerate() {
            // SAFETY: `c` holds 16 values.
            let v = unsafe { vld1q_f32(c.as_ptr().add(4 * i)) };
            *mi = vmaxnmq_f32(*mi, vabsq_f32(v));
        }
    }
    vmaxnmvq_f32(vmaxnmq_f32(
        vmaxnmq_f32(m[0], m[1]),
        vmaxnmq_f32(m[2], m[3]),
    ))
}

/// Sixteen values times `s`, rounded half to even to i32 (saturating, NaN to 0: Rust's
/// `as i32`), each then capped at `top`, and narrowed to i8 by truncation (Rust's
/// `as i8`).
///
/// # Safety
/// `x` holds at least 16 values.
#[inline]
#[target_feature(enable = "neon")]
unsafe fn round16(x: &[f32], s: float32x4_t, top: i32) -> int8x16_t {
    let q: [int32x4_t; 4] = std::array::from_fn(|i| {
        // SAFETY: `x` holds 16 values.
        let v = unsafe { vld1q_f32(x.as_ptr().add(4 * i)) };
        vminq_s32(vcvtnq_s32_f32(vmulq_f32(v, s)), vdupq_n_s32(top))
    });
    let lo = vcombine_s16(vmovn_s32(q[0]), vmovn_s32(q[1]));
    let hi = vcombine_s16(vmovn_s32(q[2]), vmovn_s32(q[3]));
    vcombine_s8(vmovn_s16(lo), vmovn_s16(hi))
}

/// Quantizes rows to Q8_0 (`Q8_1 == false`) or Q8_1 with the bytes of
/// `blocks::quantize_activation_blocks` (scale by `127 / amax`, round half to even; the
/// scale and, for Q8_1, `d · Σq` rounded to f16 by `half`, as the scalar code does),
/// appending each block's f32 scales to `scales`.
///
/// # Safety
/// The CPU must support NEON; `x.len()` must be a multiple of 32 and `out` exactly the
/// quantized size.
#[target_feature(enable = "neon")]
pub(crate) unsafe fn quantize_q8_neon<const Q8_1: bool>(
    x: &[f32],
    out: &mut [u8],
    scales: &mut Vec<f32>,
) {
    let bb = if Q8_1 { 36 } else { 34 };
    let qoff = if Q8_1 { 4 } else { 2 };
    for (xb, ob) in x.chunks_exact(32).zip(out.chunks_exact_mut(bb)) {
        // SAFETY: `xb` holds 32 values.
        let amax = unsafe { amax(xb) };
        let d = amax / 127.0;
        let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
        let dh = half::f16::from_f32(d);
        ob[0..2].copy_from_slice(&dh.to_le_bytes());
        scales.push(dh.to_f32());
        let vid = vdupq_n_f32(id);
        // The cap at i32::MAX changes nothing: `as i32` already saturates there.
        // SAFETY: `xb` holds 32 values and `ob` 32 quants at `qoff`.
        let (lo, hi) = unsafe {
            let q = (
                round16(xb, vid, i32::MAX),
                round16(&xb[16..], vid, i32::MAX),
            );
            vst1q_s8(ob.as_mut_ptr().add(qoff) as *mut i8, q.0);
            vst1q_s8(ob.as_mut_ptr().add(qoff + 16) as *mut i8, q.1);
            q
        };
        if Q8_1 {
            // The sum of the stored i8 quants, as the scalar code adds them (exact).
            let sum = vaddlvq_s8(lo) as i32 + vaddlvq_s8(hi) as i32;
            let sh = half::f16::from_f32(sum as f32 * d);
            ob[2..4].copy_from_slice(&sh.to_le_bytes());
            scales.push(sh.to_f32());
        }
    }
}

/// Quantizes rows to Q8_K with the bytes of `blocks::quantize_blocks` (llama.cpp's
/// `quantize_row_q8_K_ref`: scale `-127 / max` by the signed value of largest
/// magnitude, first one on ties; round half to even, as its `nearest_int`; cap at 127;
/// sums of each 16 quants), appending each block's f32 scale to `scales`.
///
/// # Safety
/// The CPU must support NEON; `x.len()` must be a multiple of 256 and `out` exactly the
/// quantized size.
#[target_feature(enable = "neon")]
pub(crate) unsafe fn quantize_q8_k_neon(x: &[f32], out: &mut [u8], scales: &mut Vec<f32>) {
    for (xb, ob) in x.chunks_exact(256).zip(out.chunks_exact_mut(292)) {
        // SAFETY: `xb` holds 256 values.
        let amax = unsafe { amax(xb) };
        if amax == 0.0 {
            ob.fill(0);
            scales.push(0.0);
            continue;
        }
        // The scalar scan keeps the first value reaching the largest magnitude.
        let max = xb.iter().copied().find(|v| v.abs() == amax).unwrap_or(amax);
        let iscale = -127.0f32 / max;
        let vs = vdupq_n_f32(iscale);
        for g in 0..16 {
            // SAFETY: 16 values at `16 g` of `xb`, 16 quants at `4 + 16 g` of the
            // 292-byte block.
            let q = unsafe {
                let q = round16(&xb[16 * g..], vs, 127);
                vst1q_s8(ob.as_mut_ptr().add(4 + 16 * g) as *mut i8, q);
                q
            };
            let sum = vaddlvq_s8(q);
            ob[260 + 2 * g..262 + 2 * g].copy_from_slice(&sum.to_le_bytes());
        }
        let d = 1.0 / iscale;
        ob[0..4].copy_from_slice(&d.to_le_bytes());
        scales.push(d);
    }
}
