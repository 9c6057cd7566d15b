//! aarch64 NEON kernels for the 32-element block formats (Q4_0, Q4_1, Q5_0, Q5_1,
//! Q8_0), one row and token at a time; the K-quants and plain types use the scalar
//! kernels.
//!
//! They sum in the scalar reference's order ([`super::scalar`]'s `lanes_dot`, which is
//! llama.cpp's x86 order): each block's 32 integer products are summed in eight groups
//! of four (exact in i32), group `j` goes into f32 lane `j` by one fused multiply-add
//! with `d_w · d_a`, and the lanes are added as `((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7))`,
//! then the minimum terms. So every level gives the same bits, which a test run under
//! qemu checks (`cargo xtask test` when the aarch64 target and qemu are installed).

use super::blocks::f16_at;
use super::{QuantizedActivations, TileFn};
use crate::ggml_type::GgmlType;
use std::arch::aarch64::*;

/// The NEON tile kernel for `ty`, if there is one.
pub(crate) fn kernel_neon(ty: GgmlType) -> Option<TileFn> {
    match ty {
        GgmlType::Q4_0 => Some(tile::<KIND_Q4_0>),
        GgmlType::Q4_1 => Some(tile::<KIND_Q4_1>),
        GgmlType::Q5_0 => Some(tile::<KIND_Q5_0>),
        GgmlType::Q5_1 => Some(tile::<KIND_Q5_1>),
        GgmlType::Q8_0 => Some(tile::<KIND_Q8_0>),
        _ => None,
    }
}

const KIND_Q4_0: u8 = 0;
const KIND_Q4_1: u8 = 1;
const KIND_Q5_0: u8 = 2;
const KIND_Q5_1: u8 = 3;
const KIND_Q8_0: u8 = 4;

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

/// One weight row (`w`) against one quantized activation row (`a`, its scales `s`).
///
/// # Safety
/// `w` must be whole blocks of `KIND` and `a`/`s` at least as many activation blocks.
#[target_feature(enable = "neon")]
unsafe fn dot<const KIND: u8>(w: &[u8], a: &[u8], s: &[f32]) -> f32 {
    let (wb, ab, per_block) = geometry(KIND);
    let mut lanes_lo = vdupq_n_f32(0.0);
    let mut lanes_hi = vdupq_n_f32(0.0);
    let mut mins = 0f32;
    for (b, (x, y)) in w.chunks_exact(wb).zip(a.chunks_exact(ab)).enumerate() {
        // SAFETY: `x` is a whole block; `y`'s last 32 bytes are its quants.
        let (q_lo, q_hi, d, m) = unsafe { unpack::<KIND>(x) };
        let yq = &y[ab - 32..];
        // SAFETY: `yq` is 32 bytes.
        let (y_lo, y_hi) = unsafe {
            (
                vld1q_s8(yq.as_ptr() as *const i8),
                vld1q_s8(yq[16..].as_ptr() as *const i8),
            )
        };
        let dd = vdupq_n_f32(d * s[per_block * b]);
        lanes_lo = vfmaq_f32(lanes_lo, vcvtq_f32_s32(group_sums(q_lo, y_lo)), dd);
        lanes_hi = vfmaq_f32(lanes_hi, vcvtq_f32_s32(group_sums(q_hi, y_hi)), dd);
        if per_block == 2 {
            mins = m.mul_add(s[2 * b + 1], mins);
        }
    }
    // [l0+l4, l1+l5, l2+l6, l3+l7], then ((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7)).
    let t = vaddq_f32(lanes_lo, lanes_hi);
    let (t0, t1, t2, t3) = (
        vgetq_lane_f32::<0>(t),
        vgetq_lane_f32::<1>(t),
        vgetq_lane_f32::<2>(t),
        vgetq_lane_f32::<3>(t),
    );
    (t0 + t2) + (t1 + t3) + mins
}

unsafe fn tile<const KIND: u8>(
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
            let (a, s, _) = acts.parts(t0 + j);
            // SAFETY: NEON support was checked by the caller; `row` is whole blocks and
            // the activations were quantized for this type and width.
            out[i * stride + j] = unsafe { dot::<KIND>(row, a, s) };
        }
    }
}
