//! SwiGLU on NEON, four lanes at a time, lane for lane the operations of
//! [`super::swiglu_impl`] (same bits): every fused multiply-add of
//! [`super::expf_ggml`] is a NEON fused multiply-add, and its `scalef` the same f64
//! product rounded once to f32.

use std::arch::aarch64::*;

/// `j * 2^n` rounded once, as [`super::expf_ggml`] states it: `n` is integral, so `2^n`
/// is exact in f64 and so is the product; narrowing it to f32 is the one rounding
/// (subnormals included). Lanes with `|n| > 192` get some value the caller replaces.
#[inline]
#[target_feature(enable = "neon")]
fn scalef(j: float32x4_t, n: float32x4_t) -> float32x4_t {
    // 2^n as the bits of an f64: the biased exponent `n + 1023` shifted into place.
    let pow2 = |n: float64x2_t| {
        let e = vaddq_s64(vcvtq_s64_f64(n), vdupq_n_s64(1023));
        vreinterpretq_f64_s64(vshlq_n_s64::<52>(e))
    };
    let lo = vmulq_f64(
        vcvt_f64_f32(vget_low_f32(j)),
        pow2(vcvt_f64_f32(vget_low_f32(n))),
    );
    let hi = vmulq_f64(vcvt_high_f64_f32(j), pow2(vcvt_high_f64_f32(n)));
    vcvt_high_f32_f64(vcvt_f32_f64(lo), hi)
}

/// [`super::expf_ggml`] four lanes at a time, operation for operation.
#[inline]
#[target_feature(enable = "neon")]
pub(crate) fn expf(x: float32x4_t) -> float32x4_t {
    let c = |bits: u32| vdupq_n_f32(f32::from_bits(bits));
    let r = c(0x4b40_0000);
    // vfmaq_f32(a, b, c) is a + b * c, one rounding; vfmsq_f32 is a - b * c.
    let z = vfmaq_f32(r, x, c(0x3fb8_aa3b));
    let n = vsubq_f32(z, r);
    let b = vfmsq_f32(vfmsq_f32(x, n, c(0x3f31_7200)), n, c(0x35bf_be8e));
    let far = vcagtq_f32(n, vdupq_n_f32(192.0));
    let u = vmulq_f32(b, b);
    let j = vfmaq_f32(
        vfmaq_f32(vdupq_n_f32(1.0), c(0x3f7f_fff6), b),
        vfmaq_f32(
            vfmaq_f32(c(0x3eff_fedb), c(0x3e2a_af33), b),
            vfmaq_f32(c(0x3d2b_9f17), c(0x3c07_2010), b),
            u,
        ),
        u,
    );
    let res = scalef(j, n);
    if vmaxvq_u32(far) == 0 {
        return res;
    }
    let low = vclezq_f32(n);
    let alt = vbslq_f32(low, vdupq_n_f32(0.0), vdupq_n_f32(f32::INFINITY));
    vbslq_f32(far, alt, res)
}

/// [`super::swiglu_impl`] four lanes at a time (`x / (1 + exp(-x))`, then the product);
/// the tail of fewer than 4 values one at a time, the same operations.
#[target_feature(enable = "neon")]
pub(super) fn swiglu(gate: &[f32], up: &[f32], out: &mut [f32]) {
    let n = out.len().min(gate.len()).min(up.len());
    let whole = n - n % 4;
    let one = vdupq_n_f32(1.0);
    for i in (0..whole).step_by(4) {
        // SAFETY: i + 4 <= n, within all three slices.
        unsafe {
            let g = vld1q_f32(gate.as_ptr().add(i));
            let u = vld1q_f32(up.as_ptr().add(i));
            let e = expf(vnegq_f32(g));
            let silu = vdivq_f32(g, vaddq_f32(one, e));
            vst1q_f32(out.as_mut_ptr().add(i), vmulq_f32(silu, u));
        }
    }
    super::swiglu_impl(&gate[whole..n], &up[whole..n], &mut out[whole..n]);
}
