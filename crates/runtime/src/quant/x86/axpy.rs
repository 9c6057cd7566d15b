//! The neuron MLP's down sum, `acc += (d · scale) · q` over one Q8_0 row, on AVX-512 and
//! AVX2. Separate from the tile kernels: it adds a weight row scaled by one neuron's
//! activation into f32 values, where they take dot products with quantized activations.

use half::f16;
use std::arch::x86_64::*;

/// `acc += (d · scale) · q` for each Q8_0 block of `row`, 32 values of `acc` a block
/// (`acc.len() == row.len() / 34 * 32`): the product and the add rounded apart, as the
/// scalar reference [`ballast_core::neurons::axpy_row`] does, so the result is the same
/// bit for bit.
///
/// # Safety
/// The CPU must support AVX-512 F/BW/VL/DQ; `acc` must hold 32 values per block.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
pub(crate) unsafe fn axpy_q8_0_avx512(row: &[u8], scale: f32, acc: &mut [f32]) {
    debug_assert_eq!(row.len() / 34 * 32, acc.len());
    for (block, a) in row.chunks_exact(34).zip(acc.chunks_exact_mut(32)) {
        let d = _mm512_set1_ps(f16::from_le_bytes([block[0], block[1]]).to_f32() * scale);
        // SAFETY: a block holds 32 quants after its 2-byte scale and `a` 32 values;
        // unaligned loads and stores.
        unsafe {
            let q = _mm256_loadu_si256(block.as_ptr().add(2) as *const __m256i);
            let lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(q)));
            let hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(q, 1)));
            let p = a.as_mut_ptr();
            let v0 = _mm512_add_ps(_mm512_loadu_ps(p), _mm512_mul_ps(d, lo));
            let v1 = _mm512_add_ps(_mm512_loadu_ps(p.add(16)), _mm512_mul_ps(d, hi));
            _mm512_storeu_ps(p, v0);
            _mm512_storeu_ps(p.add(16), v1);
        }
    }
}

/// [`axpy_q8_0_avx512`] on AVX2, eight values at a time.
///
/// # Safety
/// The CPU must support AVX2; `acc` must hold 32 values per block.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn axpy_q8_0_avx2(row: &[u8], scale: f32, acc: &mut [f32]) {
    debug_assert_eq!(row.len() / 34 * 32, acc.len());
    for (block, a) in row.chunks_exact(34).zip(acc.chunks_exact_mut(32)) {
        let d = _mm256_set1_ps(f16::from_le_bytes([block[0], block[1]]).to_f32() * scale);
        // SAFETY: a block holds 32 quants after its 2-byte scale and `a` 32 values;
        // unaligned loads and stores of 8 bytes / 8 floats within them.
        unsafe {
            for i in 0..4 {
                let q8 = _mm_loadl_epi64(block.as_ptr().add(2 + 8 * i) as *const __m128i);
                let q = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q8));
                let p = a.as_mut_ptr().add(8 * i);
                _mm256_storeu_ps(p, _mm256_add_ps(_mm256_loadu_ps(p), _mm256_mul_ps(d, q)));
            }
        }
    }
}
