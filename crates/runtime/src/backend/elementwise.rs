//! The CPU backend's element-wise ops, rounded exactly as llama.cpp's AVX-512 build
//! rounds them, so that the 8-bit activation quantization downstream sees the same
//! bits (a value that rounds the other way moves a logit by up to half a unit).
//!
//! - RoPE: `x0*cos - x1*sin` and `x0*sin + x1*cos`, each with its `x1` product rounded
//!   and its `x0` product fused, as gcc contracts ggml's `rotate_pairs` (checked against
//!   llama.cpp's output bit for bit).
//! - SiLU: ggml's vectorized `ggml_v_expf` (a degree-5 polynomial after a
//!   `2^n` range reduction, ending in `scalef`), not libm's `expf`.
//!
//! Each op is written once as plain Rust on `f32::mul_add`; on x86-64 with FMA the same
//! code is compiled a second time with the FMA feature on, so `mul_add` is one
//! instruction instead of a libm call. Both give the same bits. SwiGLU also has AVX2,
//! AVX-512 and NEON versions, lane for lane the same operations (same bits).

use super::{Rope, RopeStyle};

#[cfg(target_arch = "aarch64")]
mod arm;

/// `exp(x)` as ggml's AVX-512 `ggml_v_expf` computes it.
#[inline(always)]
pub(crate) fn expf_ggml(x: f32) -> f32 {
    let f = f32::from_bits;
    let r = f(0x4b40_0000); // 0x1.8p23: adding it rounds to an integer
    let z = x.mul_add(f(0x3fb8_aa3b), r); // x * log2(e)
    let n = z - r;
    // b = x - n * ln2, in two parts (0x1.62e4p-1 + 0x1.7f7d1cp-20).
    let b = (-n).mul_add(f(0x35bf_be8e), (-n).mul_add(f(0x3f31_7200), x));
    let u = b * b;
    let j = f(0x3c07_2010)
        .mul_add(b, f(0x3d2b_9f17))
        .mul_add(u, f(0x3e2a_af33).mul_add(b, f(0x3eff_fedb)))
        .mul_add(u, f(0x3f7f_fff6).mul_add(b, 1.0));
    if n.abs() > 192.0 {
        return if n <= 0.0 { 0.0 } else { f32::INFINITY };
    }
    // scalef(j, n) = j * 2^n with one rounding: exact in f64, then rounded once.
    (j as f64 * (n as f64).exp2()) as f32
}

/// `silu(gate) * up`, as ggml's AVX-512 `ggml_vec_swiglu_f32`.
#[inline(always)]
fn swiglu_one(gate: f32, up: f32) -> f32 {
    gate / (1.0 + expf_ggml(-gate)) * up
}

#[inline(always)]
fn swiglu_impl(gate: &[f32], up: &[f32], out: &mut [f32]) {
    for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
        *o = swiglu_one(g, u);
    }
}

#[inline(always)]
fn rope_impl(x: &mut [f32], positions: &[u32], n_heads: usize, head_dim: usize, rope: &Rope) {
    let n_dims = rope.n_dims.min(head_dim);
    let theta_scale = rope.freq_base.powf(-2.0 / n_dims as f32);
    let row_len = n_heads * head_dim;
    let mut cos_sin = [(0f32, 0f32); 256];
    let pairs = n_dims / 2;
    for (row, &pos) in x.chunks_exact_mut(row_len).zip(positions) {
        // ggml_rope_cache_init: theta starts at the position and is multiplied by
        // theta_scale per pair, in f32.
        let mut theta = pos as f32;
        for (pair, cs) in cos_sin.iter_mut().take(pairs).enumerate() {
            // ggml's rope_yarn without extension: the angle over the pair's frequency
            // factor, times freq_scale (exactly the angle without either).
            let scaled = rope.angle(pair, theta);
            *cs = (scaled.cos(), scaled.sin());
            theta *= theta_scale;
        }
        for head in row.chunks_exact_mut(head_dim) {
            for (i, &(c, s)) in cos_sin.iter().take(pairs).enumerate() {
                let (a, b) = match rope.style {
                    RopeStyle::Normal => (2 * i, 2 * i + 1),
                    RopeStyle::Neox => (i, i + pairs),
                };
                let (x0, x1) = (head[a], head[b]);
                head[a] = x0.mul_add(c, -(x1 * s));
                head[b] = x0.mul_add(s, x1 * c);
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod fma {
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn swiglu(gate: &[f32], up: &[f32], out: &mut [f32]) {
        super::swiglu_impl(gate, up, out)
    }

    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn rope(
        x: &mut [f32],
        positions: &[u32],
        n_heads: usize,
        head_dim: usize,
        rope: &super::Rope,
    ) {
        super::rope_impl(x, positions, n_heads, head_dim, rope)
    }
}

#[cfg(target_arch = "x86_64")]
fn has_fma() -> bool {
    use std::sync::OnceLock;
    static FMA: OnceLock<bool> = OnceLock::new();
    *FMA.get_or_init(|| is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma"))
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    /// ggml's AVX-512 `ggml_v_expf`, lane for lane the operations of [`super::expf_ggml`]
    /// (which states it one value at a time, its `scalef` done in f64).
    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma")]
    fn expf(x: __m512) -> __m512 {
        let c = |bits: u32| _mm512_set1_ps(f32::from_bits(bits));
        let r = c(0x4b40_0000);
        let z = _mm512_fmadd_ps(x, c(0x3fb8_aa3b), r);
        let n = _mm512_sub_ps(z, r);
        let b = _mm512_fnmadd_ps(n, c(0x35bf_be8e), _mm512_fnmadd_ps(n, c(0x3f31_7200), x));
        let far = _mm512_cmp_ps_mask::<_CMP_GT_OQ>(_mm512_abs_ps(n), _mm512_set1_ps(192.0));
        let u = _mm512_mul_ps(b, b);
        let j = _mm512_fmadd_ps(
            _mm512_fmadd_ps(
                _mm512_fmadd_ps(c(0x3c07_2010), b, c(0x3d2b_9f17)),
                u,
                _mm512_fmadd_ps(c(0x3e2a_af33), b, c(0x3eff_fedb)),
            ),
            u,
            _mm512_fmadd_ps(c(0x3f7f_fff6), b, _mm512_set1_ps(1.0)),
        );
        let res = _mm512_scalef_ps(j, n);
        if far == 0 {
            return res;
        }
        let low = _mm512_cmp_ps_mask::<_CMP_LE_OQ>(n, _mm512_setzero_ps());
        let alt = _mm512_mask_blend_ps(low, _mm512_set1_ps(f32::INFINITY), _mm512_setzero_ps());
        _mm512_mask_blend_ps(far, res, alt)
    }

    /// `silu(gate) * up` sixteen lanes at a time as ggml's AVX-512
    /// `ggml_vec_swiglu_f32` (`x / (1 + exp(-x))`, then the product); the tail of fewer
    /// than 16 values one at a time, the same operations.
    #[target_feature(enable = "avx512f,avx2,fma")]
    pub(super) fn swiglu(gate: &[f32], up: &[f32], out: &mut [f32]) {
        let n = out.len().min(gate.len()).min(up.len());
        let whole = n - n % 16;
        let one = _mm512_set1_ps(1.0);
        for i in (0..whole).step_by(16) {
            // SAFETY: i + 16 <= n, within all three slices.
            unsafe {
                let g = _mm512_loadu_ps(gate.as_ptr().add(i));
                let u = _mm512_loadu_ps(up.as_ptr().add(i));
                let e = expf(_mm512_sub_ps(_mm512_setzero_ps(), g));
                let silu = _mm512_div_ps(g, _mm512_add_ps(one, e));
                _mm512_storeu_ps(out.as_mut_ptr().add(i), _mm512_mul_ps(silu, u));
            }
        }
        super::swiglu_impl(&gate[whole..n], &up[whole..n], &mut out[whole..n]);
    }
}

#[cfg(target_arch = "x86_64")]
pub(crate) use avx2::expf as expf_ggml8;

#[cfg(target_arch = "aarch64")]
pub(crate) use arm::expf as expf_ggml4;

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    /// `j * 2^n` rounded once, as AVX-512's `scalef` (and [`super::expf_ggml`]'s f64
    /// statement of it): `n` is integral, so `2^n` is exact in f64 and so is the
    /// product; converting it to f32 is the one rounding (subnormals included). Lanes
    /// with `|n| > 192` get some value the caller replaces.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn scalef(j: __m256, n: __m256) -> __m256 {
        let ni = _mm256_cvtps_epi32(n);
        let bias = _mm256_set1_epi64x(1023);
        let pow2 = |e: __m128i| {
            _mm256_castsi256_pd(_mm256_slli_epi64::<52>(_mm256_add_epi64(
                _mm256_cvtepi32_epi64(e),
                bias,
            )))
        };
        let lo = _mm256_mul_pd(
            _mm256_cvtps_pd(_mm256_castps256_ps128(j)),
            pow2(_mm256_castsi256_si128(ni)),
        );
        let hi = _mm256_mul_pd(
            _mm256_cvtps_pd(_mm256_extractf128_ps::<1>(j)),
            pow2(_mm256_extracti128_si256::<1>(ni)),
        );
        _mm256_set_m128(_mm256_cvtpd_ps(hi), _mm256_cvtpd_ps(lo))
    }

    /// [`super::expf_ggml`] eight lanes at a time, operation for operation.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub(crate) fn expf(x: __m256) -> __m256 {
        let c = |bits: u32| _mm256_set1_ps(f32::from_bits(bits));
        let r = c(0x4b40_0000);
        let z = _mm256_fmadd_ps(x, c(0x3fb8_aa3b), r);
        let n = _mm256_sub_ps(z, r);
        let b = _mm256_fnmadd_ps(n, c(0x35bf_be8e), _mm256_fnmadd_ps(n, c(0x3f31_7200), x));
        let abs_n = _mm256_andnot_ps(_mm256_set1_ps(-0.0), n);
        let far = _mm256_cmp_ps::<_CMP_GT_OQ>(abs_n, _mm256_set1_ps(192.0));
        let u = _mm256_mul_ps(b, b);
        let j = _mm256_fmadd_ps(
            _mm256_fmadd_ps(
                _mm256_fmadd_ps(c(0x3c07_2010), b, c(0x3d2b_9f17)),
                u,
                _mm256_fmadd_ps(c(0x3e2a_af33), b, c(0x3eff_fedb)),
            ),
            u,
            _mm256_fmadd_ps(c(0x3f7f_fff6), b, _mm256_set1_ps(1.0)),
        );
        let res = scalef(j, n);
        if _mm256_movemask_ps(far) == 0 {
            return res;
        }
        let low = _mm256_cmp_ps::<_CMP_LE_OQ>(n, _mm256_setzero_ps());
        let alt = _mm256_blendv_ps(_mm256_set1_ps(f32::INFINITY), _mm256_setzero_ps(), low);
        _mm256_blendv_ps(res, alt, far)
    }

    /// [`super::swiglu_impl`] eight lanes at a time (`x / (1 + exp(-x))`, then the
    /// product); the tail of fewer than 8 values one at a time, the same operations.
    #[target_feature(enable = "avx2,fma")]
    pub(super) fn swiglu(gate: &[f32], up: &[f32], out: &mut [f32]) {
        let n = out.len().min(gate.len()).min(up.len());
        let whole = n - n % 8;
        let one = _mm256_set1_ps(1.0);
        let sign = _mm256_set1_ps(-0.0);
        for i in (0..whole).step_by(8) {
            // SAFETY: i + 8 <= n, within all three slices.
            unsafe {
                let g = _mm256_loadu_ps(gate.as_ptr().add(i));
                let u = _mm256_loadu_ps(up.as_ptr().add(i));
                let e = expf(_mm256_xor_ps(g, sign));
                let silu = _mm256_div_ps(g, _mm256_add_ps(one, e));
                _mm256_storeu_ps(out.as_mut_ptr().add(i), _mm256_mul_ps(silu, u));
            }
        }
        super::swiglu_impl(&gate[whole..n], &up[whole..n], &mut out[whole..n]);
    }
}

/// `out[i] = silu(gate[i]) * up[i]`, at the SIMD level in use ([`swiglu_at`]).
pub(crate) fn swiglu(gate: &[f32], up: &[f32], out: &mut [f32]) {
    swiglu_at(crate::quant::current_simd_level(), gate, up, out)
}

/// `out[i] = silu(gate[i]) * up[i]` at `level` (every level gives the same bits): on
/// AVX-512 sixteen lanes at a time, on AVX2 eight, on NEON four; else (or at a level
/// the CPU lacks) one value at a time, compiled with FMA when the CPU has it.
pub fn swiglu_at(level: crate::quant::SimdLevel, gate: &[f32], up: &[f32], out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    {
        use crate::quant::SimdLevel;
        if level == SimdLevel::Avx512 && level.is_supported() {
            // SAFETY: the AVX-512 level implies AVX-512F, AVX2 and FMA.
            return unsafe { avx512::swiglu(gate, up, out) };
        }
        if level == SimdLevel::Avx2 && level.is_supported() {
            // SAFETY: the AVX2 level implies AVX2 and FMA.
            return unsafe { avx2::swiglu(gate, up, out) };
        }
        if has_fma() {
            // SAFETY: AVX2 and FMA were detected.
            return unsafe { fma::swiglu(gate, up, out) };
        }
    }
    #[cfg(target_arch = "aarch64")]
    if level == crate::quant::SimdLevel::Neon && level.is_supported() {
        // SAFETY: NEON support was just checked.
        return unsafe { arm::swiglu(gate, up, out) };
    }
    #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
    let _ = level;
    swiglu_impl(gate, up, out)
}

/// GELU, tanh form, as ggml's `ggml_gelu_f32` states it (gcc fuses `1 + a*x*x`).
pub(crate) fn gelu_tanh(x: f32) -> f32 {
    const GELU_COEF_A: f32 = 0.044715;
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    let inner = SQRT_2_OVER_PI * x * (GELU_COEF_A * x).mul_add(x, 1.0);
    0.5 * x * (1.0 + inner.tanh())
}

/// ggml's `ggml_table_gelu_f16`: GELU of every f16 value, rounded to f16.
fn gelu_table() -> &'static [half::f16] {
    use std::sync::OnceLock;
    static TABLE: OnceLock<Vec<half::f16>> = OnceLock::new();
    TABLE.get_or_init(|| {
        (0..=u16::MAX)
            .map(|b| half::f16::from_f32(gelu_tanh(half::f16::from_bits(b).to_f32())))
            .collect()
    })
}

/// `out[i] = gelu(gate[i]) * up[i]`, as ggml's CPU `ggml_vec_geglu_f32` (built with
/// `GGML_GELU_FP16`): 0 at or below -10, the gate itself at or above 10, else the
/// f16 table's GELU of the gate rounded to f16.
pub(crate) fn geglu(gate: &[f32], up: &[f32], out: &mut [f32]) {
    let table = gelu_table();
    for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
        *o = if g <= -10.0 {
            0.0
        } else if g >= 10.0 {
            g * u
        } else {
            table[half::f16::from_f32(g).to_bits() as usize].to_f32() * u
        };
    }
}

/// Rotates each head of each row of `x` by its token's position. At most 512 rotated
/// dimensions per head.
pub(crate) fn rope(x: &mut [f32], positions: &[u32], n_heads: usize, head_dim: usize, rope: &Rope) {
    #[cfg(target_arch = "x86_64")]
    if has_fma() {
        // SAFETY: AVX2 and FMA were detected.
        return unsafe { fma::rope(x, positions, n_heads, head_dim, rope) };
    }
    rope_impl(x, positions, n_heads, head_dim, rope)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `expf_ggml` is within a few ulps of libm's `exp` over the range SiLU uses,
    /// and saturates like ggml's.
    #[test]
    fn expf_ggml_is_close_to_exp() {
        let mut x = -80.0f32;
        while x < 80.0 {
            let (got, want) = (expf_ggml(x), x.exp());
            assert!(
                ((got - want) / want).abs() < 4e-7,
                "exp({x}): {got} vs {want}"
            );
            x += 0.0137;
        }
        assert_eq!(expf_ggml(-200.0), 0.0);
        assert_eq!(expf_ggml(200.0), f32::INFINITY);
    }

    /// The SwiGLU of every level this CPU has gives the one-value-at-a-time statement's
    /// bits on gates spread over every exponent (both signs, the saturation at
    /// |n| > 192, subnormal results, infinities and NaN), with a tail shorter than a
    /// vector.
    #[test]
    fn swiglu_levels_equal_scalar() {
        let mut gate: Vec<f32> = (0..2_000_003u32)
            .map(|i| f32::from_bits(i.wrapping_mul(2147)))
            .collect();
        gate.extend([
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            0.0,
            -0.0,
            88.7,
            -88.7,
        ]);
        gate.extend((0..4000).map(|i| (i as f32 - 2000.0) * 0.0537));
        let up: Vec<f32> = (0..gate.len())
            .map(|i| ((i % 97) as f32 - 48.0) * 0.31)
            .collect();
        let mut want = vec![0f32; gate.len()];
        swiglu_impl(&gate, &up, &mut want);
        for level in crate::quant::available_simd_levels() {
            let mut got = vec![f32::NAN; gate.len()];
            swiglu_at(level, &gate, &up, &mut got);
            for i in 0..gate.len() {
                assert!(
                    got[i].to_bits() == want[i].to_bits() || (got[i].is_nan() && want[i].is_nan()),
                    "{level:?}: gate {} up {}: {} vs {}",
                    gate[i],
                    up[i],
                    got[i],
                    want[i]
                );
            }
        }
    }

    /// GELU at known points; GeGLU through the f16 table is within f16 rounding of the
    /// f32 formula, and follows ggml's clamps.
    #[test]
    fn geglu_follows_gelu() {
        assert_eq!(gelu_tanh(0.0), 0.0);
        assert!((gelu_tanh(1.0) - 0.841_192).abs() < 1e-5);
        assert!((gelu_tanh(-1.0) + 0.158_808).abs() < 1e-5);
        let gate: Vec<f32> = (0..2000).map(|i| (i as f32 - 1000.0) * 0.0123).collect();
        let up: Vec<f32> = (0..2000).map(|i| (i as f32 * 0.7).sin()).collect();
        let mut out = vec![f32::NAN; 2000];
        geglu(&gate, &up, &mut out);
        for ((&g, &u), &o) in gate.iter().zip(&up).zip(&out) {
            let want = if g <= -10.0 {
                0.0
            } else if g >= 10.0 {
                g * u
            } else {
                gelu_tanh(g) * u
            };
            // The gate rounded to f16 moves it by up to |g| 2^-11 (GELU's slope is below
            // 1.13), and the GELU rounded to f16 by |gelu| 2^-11.
            let tol = (1.13 * g.abs() + gelu_tanh(g).abs()) * u.abs() / 2048.0 + 1e-7;
            assert!((o - want).abs() <= tol, "{g}: {o} vs {want}");
        }
    }

    /// The FMA-compiled ops give the same bits as the portable ones.
    #[test]
    fn compiled_twice_same_bits() {
        let gate: Vec<f32> = (0..1000).map(|i| (i as f32 - 500.0) * 0.037).collect();
        let up: Vec<f32> = (0..1000).map(|i| (i as f32 * 0.7).sin()).collect();
        let (mut a, mut b) = (vec![0f32; 1000], vec![0f32; 1000]);
        swiglu_impl(&gate, &up, &mut a);
        swiglu(&gate, &up, &mut b);
        assert_eq!(a, b);
        for style in [RopeStyle::Normal, RopeStyle::Neox] {
            let r = Rope {
                style,
                n_dims: 64,
                freq_base: 10000.0,
                freq_scale: 1.0,
                freq_factors: None,
            };
            let mut x: Vec<f32> = (0..4 * 128).map(|i| (i as f32 * 0.31).cos()).collect();
            let mut y = x.clone();
            let pos = [0, 3, 17, 400];
            rope_impl(&mut x, &pos, 2, 64, &r);
            rope(&mut y, &pos, 2, 64, &r);
            assert_eq!(x, y);
        }
    }
}
