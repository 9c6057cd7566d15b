//! Activation quantization on AVX2: f32 rows to Q8_0 / Q8_1 (the 32-element formats'
//! activations) and Q8_K (the K-quants'), bit for bit as `blocks` does it. Separate from
//! the tile kernels: it runs once per matmul input, not per weight tile, and is called
//! from `quantize_activations` rather than through a dispatch table.

use half::f16;
use std::arch::x86_64::*;

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn hsum_epi32(v: __m256i) -> i32 {
    let s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256::<1>(v));
    let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b01_00_11_10>(s));
    let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b10_11_00_01>(s));
    _mm_cvtsi128_si32(s)
}

/// Quantizes rows to Q8_0 (`Q8_1 == false`) or Q8_1 exactly like
/// `blocks::quantize_activation_blocks` (llama.cpp's x86 rule: scale by `127 / amax`,
/// round half to even; f16 scales rounded to nearest even),
/// appending each block's f32 scales to `scales`.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C; `x.len()` must be a multiple of 32 and `out`
/// exactly the quantized size.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn quantize_q8_avx2<const Q8_1: bool>(
    x: &[f32],
    out: &mut [u8],
    scales: &mut Vec<f32>,
) {
    let bb = if Q8_1 { 36 } else { 34 };
    let qoff = if Q8_1 { 4 } else { 2 };
    let sign = _mm256_set1_ps(-0.0);
    let perm = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (xb, ob) in x.chunks_exact(32).zip(out.chunks_exact_mut(bb)) {
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
            }
        }
    }
}

/// Quantizes rows to Q8_K exactly like `blocks::quantize_blocks` (llama.cpp's
/// `quantize_row_q8_K_ref`: scale `-127 / max` by the signed value of largest magnitude,
/// first one on ties; round half to even; clamp at 127; sums of each 16 quants),
/// appending each block's f32 scale to `scales`.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C; `x.len()` must be a multiple of 256 and `out`
/// exactly the quantized size.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn quantize_q8_k_avx2(x: &[f32], out: &mut [u8], scales: &mut Vec<f32>) {
    let sign = _mm256_set1_ps(-0.0);
    let perm = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    let top = _mm256_set1_epi32(127);
    for (xb, ob) in x.chunks_exact(256).zip(out.chunks_exact_mut(292)) {
        let p = xb.as_ptr();
        let mut m = _mm256_setzero_ps();
        for i in 0..32 {
            // SAFETY: 256 values at p.
            let v = unsafe { _mm256_loadu_ps(p.add(8 * i)) };
            m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v));
        }
        let m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps::<1>(m));
        let m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        let amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
        if amax == 0.0 {
            ob.fill(0);
            scales.push(0.0);
            continue;
        }
        // The scalar scan keeps the first value reaching the largest magnitude.
        let max = xb.iter().copied().find(|v| v.abs() == amax).unwrap_or(amax);
        let iscale = -127.0f32 / max;
        let vs = _mm256_set1_ps(iscale);
        for c in 0..8 {
            let mut q = [_mm256_setzero_si256(); 4];
            for (j, qj) in q.iter_mut().enumerate() {
                // SAFETY: 256 values at p.
                let v = unsafe { _mm256_loadu_ps(p.add(32 * c + 8 * j)) };
                // Round half to even (the default MXCSR mode), as ggml's `nearest_int`
                // for magnitudes below 2^22 (these are at most about 127).
                *qj = _mm256_min_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(v, vs)), top);
            }
            let q01 = _mm256_packs_epi32(q[0], q[1]);
            let q23 = _mm256_packs_epi32(q[2], q[3]);
            let q8 = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(q01, q23), perm);
            // SAFETY: bytes 4 + 32c .. 36 + 32c of the 292-byte block.
            unsafe { _mm256_storeu_si256(ob.as_mut_ptr().add(4 + 32 * c) as *mut __m256i, q8) };
            for h in 0..2 {
                let sum = hsum_epi32(_mm256_add_epi32(q[2 * h], q[2 * h + 1])) as i16;
                let g = 2 * c + h;
                ob[260 + 2 * g..262 + 2 * g].copy_from_slice(&sum.to_le_bytes());
            }
        }
        let d = 1.0 / iscale;
        ob[0..4].copy_from_slice(&d.to_le_bytes());
        scales.push(d);
    }
}
