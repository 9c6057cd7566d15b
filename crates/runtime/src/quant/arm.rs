//! aarch64 NEON kernels for the default model's types: Q8_0 x Q8_0 and Q4_1 x Q8_1, one
//! row and token at a time; every other type uses the scalar kernels.
//!
//! Each block's integer sum is exact (i8 x i8 products fit i16 and are widened pairwise
//! into i32) and the f32 expression per block is the scalar kernel's, so results equal
//! the scalar path. (Not compiled on the x86-64 build machine.)

use super::blocks::f16_at;
use super::{QuantizedActivations, TileFn};
use crate::ggml_type::GgmlType;
use std::arch::aarch64::*;

/// The NEON tile kernel for `ty`, if there is one.
pub(crate) fn kernel_neon(ty: GgmlType) -> Option<TileFn> {
    match ty {
        GgmlType::Q8_0 => Some(tile_q8_0),
        GgmlType::Q4_1 => Some(tile_q4_1),
        _ => None,
    }
}

/// `acc` plus the pairwise-widened products of 16 signed bytes.
#[inline]
#[target_feature(enable = "neon")]
unsafe fn dot16(acc: int32x4_t, x: int8x16_t, y: int8x16_t) -> int32x4_t {
    // SAFETY: NEON is enabled for this function.
    unsafe {
        let acc = vpadalq_s16(acc, vmull_s8(vget_low_s8(x), vget_low_s8(y)));
        vpadalq_s16(acc, vmull_s8(vget_high_s8(x), vget_high_s8(y)))
    }
}

#[target_feature(enable = "neon")]
unsafe fn dot_q8_0(w: &[u8], a: &[u8], s: &[f32]) -> f32 {
    let mut sum = 0f32;
    for (b, (x, y)) in w.chunks_exact(34).zip(a.chunks_exact(34)).enumerate() {
        let xp = x[2..].as_ptr() as *const i8;
        let yp = y[2..].as_ptr() as *const i8;
        // SAFETY: both blocks have 32 quant bytes after their scale.
        let si = unsafe {
            let mut acc = vdupq_n_s32(0);
            acc = dot16(acc, vld1q_s8(xp), vld1q_s8(yp));
            acc = dot16(acc, vld1q_s8(xp.add(16)), vld1q_s8(yp.add(16)));
            vaddvq_s32(acc)
        };
        sum += si as f32 * (f16_at(x, 0) * s[b]);
    }
    sum
}

#[target_feature(enable = "neon")]
unsafe fn dot_q4_1(w: &[u8], a: &[u8], s: &[f32]) -> f32 {
    let mut sum = 0f32;
    for (b, (x, y)) in w.chunks_exact(20).zip(a.chunks_exact(36)).enumerate() {
        let yp = y[4..].as_ptr() as *const i8;
        // SAFETY: the weight block has 16 quant bytes at 4, the activation block 32 at 4.
        let si = unsafe {
            let qs = vld1q_u8(x[4..].as_ptr());
            let lo = vreinterpretq_s8_u8(vandq_u8(qs, vdupq_n_u8(0x0F)));
            let hi = vreinterpretq_s8_u8(vshrq_n_u8::<4>(qs));
            let mut acc = vdupq_n_s32(0);
            acc = dot16(acc, lo, vld1q_s8(yp));
            acc = dot16(acc, hi, vld1q_s8(yp.add(16)));
            vaddvq_s32(acc)
        };
        sum += si as f32 * (f16_at(x, 0) * s[2 * b]) + f16_at(x, 2) * s[2 * b + 1];
    }
    sum
}

unsafe fn tile_q8_0(
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
            // SAFETY: NEON support was checked by the caller.
            out[i * stride + j] = unsafe { dot_q8_0(row, a, s) };
        }
    }
}

unsafe fn tile_q4_1(
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
            // SAFETY: NEON support was checked by the caller.
            out[i * stride + j] = unsafe { dot_q4_1(row, a, s) };
        }
    }
}
