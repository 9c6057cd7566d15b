//! Quantized CPU kernels: ggml-compatible block formats, activation quantization and
//! quantized matrix multiplication with run-time SIMD selection.
//!
//! Block layouts match llama.cpp's `ggml-common.h` bit for bit. Weights stay in their
//! quantized form; activations are quantized per row to the type llama.cpp pairs with the
//! weight type ([`activation_type`]) and the dot products are computed on integers block by
//! block, then scaled in f32.
//!
//! The kernel level (AVX-512 VNNI, AVX2, NEON or scalar) is chosen once at first use; the
//! environment variable `BALLAST_SIMD=scalar|avx2|avx512|neon` forces a level (an
//! unsupported request falls back to the best available one). [`simd_level`] reports it.
//!
//! | level | types with their own kernels (others use the next lower level) | activation quantization | attention, SwiGLU (`backend`) |
//! |---|---|---|---|
//! | avx512 (F/BW/VL/DQ + VNNI) | Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K | AVX2's | AVX2's attention (measured faster), own SwiGLU |
//! | avx2 (+ FMA, F16C) | Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, F32, F16, BF16 | own | own |
//! | neon | Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K | own | own |
//! | scalar | all weight types | reference | reference |
//!
//! Every kernel computes each block's integer dot product exactly. For the quantized
//! types every level also accumulates f32 in the same order, so all levels give the same
//! bits: the 32-element formats in llama.cpp's x86 order (eight lanes of FMAs per row, then
//! its horizontal sum), the K-quants one `+=` per superblock. Only the float types (F32,
//! F16, BF16) differ between levels in the order of f32 accumulation (see the tests for the
//! bound). Activation quantization to Q8_0/Q8_1/Q8_K also has AVX2 and NEON paths, byte for
//! byte the scalar reference's ([`quantize_activations_at`] picks one).
//!
//! [`matmul`] writes `out[r * n_tokens + t]`, so callers can split weight rows across
//! threads (each thread passes whole rows and gets a contiguous output chunk);
//! [`matmul_token_major`] writes `out[t * ld + r]` (a batch's layout) through a pointer,
//! for threads sharing one output. Decode (one token) processes 4 rows at a time; prefill
//! reuses each decoded weight block for several tokens: on AVX-512 the 32-element formats
//! take 4 rows x every whole group of 8 tokens against activations repacked once per batch
//! (8 tokens' blocks side by side; Q8_0, Q4_0 and Q5_0 decode the 4 rows once for all the
//! groups), the K-quants 2 rows x all tokens (the rows' superblocks decoded once, then 4
//! tokens at a time); on AVX2 the 32-element formats take up to 16 rows decoded once x
//! every whole group of 8 packed tokens, the K-quants 1 row x 8 tokens. Decoding once
//! changes no float operation.
//!
//! # Example
//!
//! ```
//! use ballast_runtime::ggml_type::GgmlType;
//! use ballast_runtime::quant::{self, QuantizedActivations};
//!
//! let k = 64;
//! // Two weight rows, quantized to Q4_1.
//! let w: Vec<f32> = (0..2 * k).map(|i| (i as f32 * 0.37).sin()).collect();
//! let wq = quant::quantize(GgmlType::Q4_1, &w).unwrap();
//! assert_eq!(wq.len(), 2 * quant::row_bytes(GgmlType::Q4_1, k).unwrap());
//!
//! // Three activation rows (tokens).
//! let x: Vec<f32> = (0..3 * k).map(|i| (i as f32 * 0.11).cos()).collect();
//! let mut acts = QuantizedActivations::new();
//! quant::quantize_activations(GgmlType::Q4_1, &x, 3, k, &mut acts).unwrap();
//!
//! let mut out = vec![0f32; 2 * 3];
//! quant::matmul(GgmlType::Q4_1, &wq, k, &acts, &mut out).unwrap();
//! // out[r * n_tokens + t] is the dot product of weight row r with token t.
//! let exact: f32 = (0..k).map(|i| w[k + i] * x[2 * k + i]).sum();
//! assert!((out[3 + 2] - exact).abs() < 0.5);
//! ```

#[cfg(target_arch = "aarch64")]
mod arm;
mod blocks;
mod scalar;
#[cfg(target_arch = "x86_64")]
mod x86;

use crate::error::{Error, Result};
use crate::ggml_type::GgmlType;
use std::sync::OnceLock;

/// A kernel implementation level.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SimdLevel {
    /// Portable Rust, no intrinsics.
    Scalar,
    /// x86-64 AVX2 + FMA + F16C (`maddubs`-based integer dots).
    Avx2,
    /// x86-64 AVX-512 F/BW/VL/DQ with VNNI (`vpdpbusd`), plus the AVX2 requirements.
    Avx512,
    /// aarch64 NEON.
    Neon,
}

impl SimdLevel {
    /// The level's name as accepted by `BALLAST_SIMD`.
    pub fn name(self) -> &'static str {
        match self {
            SimdLevel::Scalar => "scalar",
            SimdLevel::Avx2 => "avx2",
            SimdLevel::Avx512 => "avx512",
            SimdLevel::Neon => "neon",
        }
    }

    /// Whether this CPU can run the level.
    pub fn is_supported(self) -> bool {
        match self {
            SimdLevel::Scalar => true,
            #[cfg(target_arch = "x86_64")]
            SimdLevel::Avx2 => x86::has_avx2(),
            #[cfg(target_arch = "x86_64")]
            SimdLevel::Avx512 => x86::has_avx512(),
            #[cfg(target_arch = "aarch64")]
            SimdLevel::Neon => std::arch::is_aarch64_feature_detected!("neon"),
            #[allow(unreachable_patterns)]
            _ => false,
        }
    }
}

/// Every level this CPU supports, best last.
pub fn available_simd_levels() -> Vec<SimdLevel> {
    [
        SimdLevel::Scalar,
        SimdLevel::Neon,
        SimdLevel::Avx2,
        SimdLevel::Avx512,
    ]
    .into_iter()
    .filter(|l| l.is_supported())
    .collect()
}

fn best_level() -> SimdLevel {
    *available_simd_levels().last().unwrap_or(&SimdLevel::Scalar)
}

/// The level in use: the best supported one, or the one `BALLAST_SIMD` asks for if supported.
pub fn current_simd_level() -> SimdLevel {
    static LEVEL: OnceLock<SimdLevel> = OnceLock::new();
    *LEVEL.get_or_init(|| {
        let wanted = match std::env::var("BALLAST_SIMD").ok().as_deref().map(str::trim) {
            Some("scalar") => Some(SimdLevel::Scalar),
            Some("avx2") => Some(SimdLevel::Avx2),
            Some("avx512") => Some(SimdLevel::Avx512),
            Some("neon") => Some(SimdLevel::Neon),
            _ => None,
        };
        match wanted {
            Some(l) if l.is_supported() => l,
            Some(SimdLevel::Avx512) if SimdLevel::Avx2.is_supported() => SimdLevel::Avx2,
            _ => best_level(),
        }
    })
}

/// The name of the kernel level in use (`"scalar"`, `"avx2"`, `"avx512"` or `"neon"`).
pub fn simd_level() -> &'static str {
    current_simd_level().name()
}

/// The activation type llama.cpp pairs with a weight type (its `vec_dot_type`).
///
/// Q4_0/Q5_0/Q8_0 take Q8_0, Q4_1/Q5_1 take Q8_1, the K-quants take Q8_K and the plain
/// float types take F32. The activation types themselves (Q8_1, Q8_K) map to themselves;
/// they are not weight types and [`matmul`] rejects them.
pub fn activation_type(weight: GgmlType) -> GgmlType {
    match weight {
        GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => GgmlType::F32,
        GgmlType::Q4_0 | GgmlType::Q5_0 | GgmlType::Q8_0 => GgmlType::Q8_0,
        GgmlType::Q4_1 | GgmlType::Q5_1 => GgmlType::Q8_1,
        GgmlType::Q4_K | GgmlType::Q5_K | GgmlType::Q6_K => GgmlType::Q8_K,
        GgmlType::Q8_1 => GgmlType::Q8_1,
        GgmlType::Q8_K => GgmlType::Q8_K,
    }
}

fn is_weight_type(ty: GgmlType) -> bool {
    !matches!(ty, GgmlType::Q8_1 | GgmlType::Q8_K)
}

fn check_values(ty: GgmlType, n: usize) -> Result<usize> {
    let bl = ty.block_len();
    if !n.is_multiple_of(bl) {
        return Err(Error::QuantBlockAlign {
            ty,
            len: n,
            block_len: bl,
        });
    }
    (n / bl)
        .checked_mul(ty.block_bytes())
        .ok_or_else(|| Error::QuantValueCount {
            what: "values (byte size overflows usize)",
            expected: (usize::MAX / ty.block_bytes()).saturating_mul(bl),
            got: n,
        })
}

/// Bytes in one row of `k` values of type `ty`.
///
/// Errors if `k` is zero or not a multiple of the block length.
pub fn row_bytes(ty: GgmlType, k: usize) -> Result<usize> {
    if k == 0 {
        return Err(Error::QuantEmptyRow);
    }
    check_values(ty, k)
}

/// Dequantizes `dst.len()` values of type `ty` from `src` into `dst`.
///
/// `src` must hold exactly the bytes of `dst.len()` values, and `dst.len()` must be a
/// multiple of the block length.
pub fn dequantize(ty: GgmlType, src: &[u8], dst: &mut [f32]) -> Result<()> {
    let expected = check_values(ty, dst.len())?;
    if src.len() != expected {
        return Err(Error::QuantLength {
            ty,
            expected,
            got: src.len(),
        });
    }
    blocks::dequantize_blocks(ty, src, dst);
    Ok(())
}

/// Quantizes `src` to type `ty` (any type, including Q8_0/Q8_1/Q8_K with llama.cpp's
/// reference rounding). For the K-quants a simple per-sub-block min/max quantizer is used,
/// not llama.cpp's optimal search; the layout is the same.
pub fn quantize(ty: GgmlType, src: &[f32]) -> Result<Vec<u8>> {
    let n = check_values(ty, src.len())?;
    let mut out = vec![0u8; n];
    blocks::quantize_blocks(ty, src, &mut out);
    Ok(out)
}

/// Activation rows prepared for [`matmul`]: quantized to [`activation_type`] of the weight
/// type (or kept as f32 for float weights). Reuse one across calls to avoid allocation.
#[derive(Clone, Debug)]
pub struct QuantizedActivations {
    ty: GgmlType,
    n_tokens: usize,
    k: usize,
    row_bytes: usize,
    bytes: Vec<u8>,
    /// f32 copies of each block's stored scales: `d` per block (and `s` after it for Q8_1).
    scales: Vec<f32>,
    /// Q8_0 and Q8_1: each whole group of [`PACK_TOKENS`] tokens repacked block by block
    /// for the AVX-512 prefill kernels (see [`QuantizedActivations::packed_group`]).
    packed: Vec<u8>,
    f32s: Vec<f32>,
}

impl Default for QuantizedActivations {
    fn default() -> Self {
        Self::new()
    }
}

impl QuantizedActivations {
    /// An empty buffer (zero tokens).
    pub fn new() -> Self {
        QuantizedActivations {
            ty: GgmlType::F32,
            n_tokens: 0,
            k: 0,
            row_bytes: 0,
            bytes: Vec::new(),
            scales: Vec::new(),
            packed: Vec::new(),
            f32s: Vec::new(),
        }
    }

    /// The activation type held (Q8_0, Q8_1, Q8_K or F32).
    pub fn ty(&self) -> GgmlType {
        self.ty
    }

    /// Number of activation rows (tokens).
    pub fn n_tokens(&self) -> usize {
        self.n_tokens
    }

    /// Values per row.
    pub fn k(&self) -> usize {
        self.k
    }

    /// Bytes per quantized row (0 for F32 activations).
    pub fn row_bytes(&self) -> usize {
        self.row_bytes
    }

    /// All quantized rows, back to back, in ggml's block layout (empty for F32).
    pub fn bytes(&self) -> &[u8] {
        &self.bytes
    }

    /// The quantized bytes of row `t` (empty for F32 activations).
    pub fn row(&self, t: usize) -> Result<&[u8]> {
        if t >= self.n_tokens {
            return Err(Error::QuantTokenIndex {
                token: t,
                n_tokens: self.n_tokens,
            });
        }
        Ok(&self.bytes[t * self.row_bytes..(t + 1) * self.row_bytes])
    }

    /// The f32 activations (only for F32 activations; empty otherwise).
    pub fn f32s(&self) -> &[f32] {
        &self.f32s
    }

    fn scales_per_row(&self) -> usize {
        match self.ty {
            GgmlType::Q8_1 => 2 * (self.k / 32),
            GgmlType::Q8_0 => self.k / 32,
            GgmlType::Q8_K => self.k / 256,
            _ => 0,
        }
    }

    /// Tokens `8 * g .. 8 * g + 8` (a whole group) repacked: per block `b`, at byte
    /// `b * packed_block`, the 8 tokens' 32 quants (256 bytes); then for Q8_0
    /// ([`PACKED_BLOCK`] bytes a block) per token the negated sums of its 8 groups of four
    /// quants times 16 as i32 (256 bytes; the offset correction of the unsigned-weight
    /// kernels, computed once per batch instead of once per weight tile, and Q5_0's as it
    /// stands) and the 8 tokens' f32
    /// scales; for Q8_1 ([`PACKED_BLOCK_Q8_1`] bytes) the 8 tokens' f32 `d` and `s`
    /// pairs; for Q8_K ([`PACKED_BLOCK_Q8_K`] bytes a superblock) the layout
    /// [`q8_k_packed`] describes. One pointer and constant offsets serve the whole tile.
    /// Empty unless Q8_0, Q8_1 or (on x86) Q8_K with at least 8 tokens; `g` must be a
    /// whole group.
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    #[inline]
    pub(crate) fn packed_group(&self, g: usize) -> &[u8] {
        let len = match self.ty {
            GgmlType::Q8_1 => self.k / 32 * PACKED_BLOCK_Q8_1,
            GgmlType::Q8_K => self.k / 256 * PACKED_BLOCK_Q8_K,
            _ => self.k / 32 * PACKED_BLOCK,
        };
        &self.packed[g * len..(g + 1) * len]
    }

    /// Parts of token `t`: (bytes, scales, f32s). `t` must be in range.
    #[inline]
    pub(crate) fn parts(&self, t: usize) -> (&[u8], &[f32], &[f32]) {
        let spr = self.scales_per_row();
        let b = &self.bytes[t * self.row_bytes..(t + 1) * self.row_bytes];
        let s = &self.scales[t * spr..(t + 1) * spr];
        let f = if self.ty == GgmlType::F32 {
            &self.f32s[t * self.k..(t + 1) * self.k]
        } else {
            &[][..]
        };
        (b, s, f)
    }
}

/// Quantizes `n_tokens` activation rows of `k` values (`x`, row-major) for weights of type
/// `weight`, into `out` (its buffers are reused). Rounding follows llama.cpp's x86
/// `quantize_row_q8_0` / `quantize_row_q8_1` (scale by `127 / amax`, round half to even)
/// and `quantize_row_q8_K_ref` (`nearest_int`, ties to even), on every SIMD level, so that
/// results do not depend on the level and match llama.cpp's reference outputs.
pub fn quantize_activations(
    weight: GgmlType,
    x: &[f32],
    n_tokens: usize,
    k: usize,
    out: &mut QuantizedActivations,
) -> Result<()> {
    quantize_activations_at(current_simd_level(), weight, x, n_tokens, k, out)
}

/// [`quantize_activations`] at a given kernel level (for tests); every level gives the
/// same bytes. A level the CPU does not support runs the scalar code.
pub fn quantize_activations_at(
    level: SimdLevel,
    weight: GgmlType,
    x: &[f32],
    n_tokens: usize,
    k: usize,
    out: &mut QuantizedActivations,
) -> Result<()> {
    if !is_weight_type(weight) {
        return Err(Error::QuantUnsupported {
            ty: weight,
            op: "use as a weight type",
        });
    }
    let ty = activation_type(weight);
    row_bytes(weight, k)?;
    let rb = if ty == GgmlType::F32 {
        0
    } else {
        row_bytes(ty, k)?
    };
    let total = n_tokens.checked_mul(k).ok_or(Error::QuantValueCount {
        what: "activations",
        expected: usize::MAX,
        got: x.len(),
    })?;
    if x.len() != total {
        return Err(Error::QuantValueCount {
            what: "activations",
            expected: total,
            got: x.len(),
        });
    }
    out.ty = ty;
    out.n_tokens = n_tokens;
    out.k = k;
    out.row_bytes = rb;
    out.bytes.clear();
    out.scales.clear();
    out.packed.clear();
    out.f32s.clear();
    if ty == GgmlType::F32 {
        out.f32s.extend_from_slice(x);
        return Ok(());
    }
    out.bytes.resize(rb * n_tokens, 0);
    #[cfg(target_arch = "x86_64")]
    {
        let simd = matches!(level, SimdLevel::Avx2 | SimdLevel::Avx512) && level.is_supported();
        if simd && matches!(ty, GgmlType::Q8_0 | GgmlType::Q8_1) {
            // SAFETY: the level guarantees AVX2/FMA/F16C; the sizes were validated above.
            unsafe {
                if ty == GgmlType::Q8_1 {
                    x86::quantize_q8_avx2::<true>(x, &mut out.bytes, &mut out.scales);
                } else {
                    x86::quantize_q8_avx2::<false>(x, &mut out.bytes, &mut out.scales);
                }
            }
            out.fill_packed();
            return Ok(());
        }
        if simd && ty == GgmlType::Q8_K {
            // SAFETY: the level guarantees AVX2/FMA/F16C; the sizes were validated above.
            unsafe { x86::quantize_q8_k_avx2(x, &mut out.bytes, &mut out.scales) };
            out.fill_packed();
            return Ok(());
        }
    }
    #[cfg(target_arch = "aarch64")]
    if level == SimdLevel::Neon && level.is_supported() {
        let (bytes, scales) = (&mut out.bytes, &mut out.scales);
        if matches!(ty, GgmlType::Q8_0 | GgmlType::Q8_1) {
            // SAFETY: NEON support was just checked; the sizes were validated above.
            unsafe {
                if ty == GgmlType::Q8_1 {
                    arm::quantize_q8_neon::<true>(x, bytes, scales);
                } else {
                    arm::quantize_q8_neon::<false>(x, bytes, scales);
                }
            }
            out.fill_packed();
            return Ok(());
        }
        if ty == GgmlType::Q8_K {
            // SAFETY: as above.
            unsafe { arm::quantize_q8_k_neon(x, bytes, scales) };
            return Ok(());
        }
    }
    #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
    let _ = level;
    blocks::quantize_activation_blocks(ty, x, &mut out.bytes);
    let bb = ty.block_bytes();
    for b in out.bytes.chunks_exact(bb) {
        match ty {
            GgmlType::Q8_0 => out.scales.push(blocks::f16_at(b, 0)),
            GgmlType::Q8_1 => {
                out.scales.push(blocks::f16_at(b, 0));
                out.scales.push(blocks::f16_at(b, 2));
            }
            _ => out.scales.push(blocks::f32_at(b, 0)),
        }
    }
    out.fill_packed();
    Ok(())
}

/// The fewest tokens of a batch that the K-quant prefill kernels (`x86::k_wide`) take as
/// a group of 8 filled with zeros; shorter batches go to the narrow kernels. A
/// speculative verification pass is such a batch. Qwen2.5-Coder-1.5B Q4_K_M on 2
/// threads, tokens/s of batches of 4 to 7 as a group against narrow: AVX-512 pp4 76
/// against 106, pp5 94 against 92, pp6 111 against 96-102, pp7 127-129 against 105;
/// AVX2 pp2-pp4 worse as a group (31-68 against 58-74), pp5 83 against 64, pp6 97
/// against 70, pp7 113 against 63-72. Batches of 2 to 4 as the first half of a group
/// (256-bit multiplies, half the work of 8) were slower than narrow too, at AVX-512: pp2
/// 47 against 70, pp3 68-71 against 82, pp4 91-92 against 85-106.
pub(crate) const K_GROUP_MIN_TOKENS: usize = 5;

/// Tokens per group of [`QuantizedActivations::packed_group`].
pub(crate) const PACK_TOKENS: usize = 8;
/// Bytes per block of a packed group: quants, negated group sums (times 16), scales.
pub(crate) const PACKED_BLOCK: usize = PACK_TOKENS * (32 + 32 + 4);
/// Bytes per block of a packed Q8_1 group: quants, then `d` and `s` of each token.
pub(crate) const PACKED_BLOCK_Q8_1: usize = PACK_TOKENS * (32 + 8);
/// Bytes per superblock of a packed Q8_K group (see [`q8_k_packed`]).
pub(crate) const PACKED_BLOCK_Q8_K: usize = q8_k_packed::DY + 4 * PACK_TOKENS;

/// The layout of a superblock of 8 packed Q8_K tokens, for the K-quant prefill kernels
/// that multiply one weight row's 8 quants by 8 tokens' at once (`x86::k_wide`):
///
/// - at [`QS`](q8_k_packed::QS): the quants in 32 chunks of 8 per token, chunk `c` of
///   token `t` at `64 * c + 8 * t`, so one 64-byte load holds 8 tokens' chunk;
/// - at [`SUMS32`](q8_k_packed::SUMS32): the sums of each 32-quant sub-block (Q4_K's and
///   Q5_K's) as i16, in pairs of sub-blocks `(2p, 2p + 1)` per token: pair `p` of token
///   `t` at `32 * p + 4 * t`, so that one `madd` with a pair of mins serves 8 tokens;
/// - at [`SUMS16`](q8_k_packed::SUMS16): the stored sums of each 16 quants (Q6_K's
///   sub-blocks), paired the same way: pair `p` of token `t` at `32 * p + 4 * t`;
/// - at [`DY`](q8_k_packed::DY): the 8 tokens' f32 scales.
pub(crate) mod q8_k_packed {
    /// Offset of the chunked quants.
    pub const QS: usize = 0;
    /// Offset of the paired 32-quant sums.
    pub const SUMS32: usize = 2048;
    /// Offset of the paired 16-quant sums.
    pub const SUMS16: usize = SUMS32 + 128;
    /// Offset of the scales.
    pub const DY: usize = SUMS16 + 256;
}

impl QuantizedActivations {
    /// Builds `packed` from the quantized bytes and scales (Q8_0, Q8_1 and, on x86, Q8_K).
    fn fill_packed(&mut self) {
        if self.ty == GgmlType::Q8_1 && self.n_tokens >= PACK_TOKENS {
            return self.fill_packed_q8_1();
        }
        if self.ty == GgmlType::Q8_K && self.n_tokens >= K_GROUP_MIN_TOKENS {
            return self.fill_packed_q8_k();
        }
        if self.ty != GgmlType::Q8_0 || self.n_tokens < PACK_TOKENS {
            return;
        }
        let nb = self.k / 32;
        let groups = self.n_tokens / PACK_TOKENS;
        self.packed.resize(groups * nb * PACKED_BLOCK, 0);
        for (g, dst) in self.packed.chunks_exact_mut(nb * PACKED_BLOCK).enumerate() {
            for (b, blk) in dst.chunks_exact_mut(PACKED_BLOCK).enumerate() {
                let (qs, rest) = blk.split_at_mut(PACK_TOKENS * 32);
                let (sums, scales) = rest.split_at_mut(PACK_TOKENS * 32);
                for j in 0..PACK_TOKENS {
                    let t = g * PACK_TOKENS + j;
                    let src = &self.bytes[t * self.row_bytes + b * 34 + 2..][..32];
                    qs[32 * j..32 * j + 32].copy_from_slice(src);
                    for (i, four) in src.chunks_exact(4).enumerate() {
                        let s: i32 = four.iter().map(|&q| q as i8 as i32).sum();
                        sums[32 * j + 4 * i..32 * j + 4 * i + 4]
                            .copy_from_slice(&(-16 * s).to_le_bytes());
                    }
                    let sc = self.scales[t * nb + b];
                    scales[4 * j..4 * j + 4].copy_from_slice(&sc.to_le_bytes());
                }
            }
        }
    }

    /// [`Self::fill_packed`] for Q8_K: only the x86 kernels read it.
    fn fill_packed_q8_k(&mut self) {
        use q8_k_packed::{DY, QS, SUMS16, SUMS32};
        if !cfg!(target_arch = "x86_64") {
            return;
        }
        let nb = self.k / 256;
        // A last partial group too, its missing tokens all zero (quants, sums and
        // scales), so the kernels can take a batch's tail as a group.
        let groups = self.n_tokens.div_ceil(PACK_TOKENS);
        self.packed.resize(groups * nb * PACKED_BLOCK_Q8_K, 0);
        for (g, dst) in self
            .packed
            .chunks_exact_mut(nb * PACKED_BLOCK_Q8_K)
            .enumerate()
        {
            for (b, blk) in dst.chunks_exact_mut(PACKED_BLOCK_Q8_K).enumerate() {
                for t in 0..PACK_TOKENS.min(self.n_tokens - g * PACK_TOKENS) {
                    let tok = g * PACK_TOKENS + t;
                    let src = &self.bytes[tok * self.row_bytes + b * 292..][..292];
                    for (c, chunk) in src[4..260].chunks_exact(8).enumerate() {
                        blk[QS + 64 * c + 8 * t..][..8].copy_from_slice(chunk);
                    }
                    let bsum = |i: usize| i16::from_le_bytes([src[260 + 2 * i], src[261 + 2 * i]]);
                    for i in 0..16 {
                        let at = SUMS16 + 32 * (i / 2) + 4 * t + 2 * (i % 2);
                        blk[at..at + 2].copy_from_slice(&bsum(i).to_le_bytes());
                    }
                    for j in 0..8 {
                        // At most 32 * 128 in magnitude: no overflow.
                        let s = bsum(2 * j) + bsum(2 * j + 1);
                        let at = SUMS32 + 32 * (j / 2) + 4 * t + 2 * (j % 2);
                        blk[at..at + 2].copy_from_slice(&s.to_le_bytes());
                    }
                    let dy = self.scales[tok * nb + b];
                    blk[DY + 4 * t..DY + 4 * t + 4].copy_from_slice(&dy.to_le_bytes());
                }
            }
        }
    }

    /// [`Self::fill_packed`] for Q8_1.
    fn fill_packed_q8_1(&mut self) {
        let nb = self.k / 32;
        let groups = self.n_tokens / PACK_TOKENS;
        self.packed.resize(groups * nb * PACKED_BLOCK_Q8_1, 0);
        for (g, dst) in self
            .packed
            .chunks_exact_mut(nb * PACKED_BLOCK_Q8_1)
            .enumerate()
        {
            for (b, blk) in dst.chunks_exact_mut(PACKED_BLOCK_Q8_1).enumerate() {
                let (qs, scales) = blk.split_at_mut(PACK_TOKENS * 32);
                for j in 0..PACK_TOKENS {
                    let t = g * PACK_TOKENS + j;
                    let src = &self.bytes[t * self.row_bytes + b * 36 + 4..][..32];
                    qs[32 * j..32 * j + 32].copy_from_slice(src);
                    let (d, s) = (
                        self.scales[2 * (t * nb + b)],
                        self.scales[2 * (t * nb + b) + 1],
                    );
                    scales[8 * j..8 * j + 4].copy_from_slice(&d.to_le_bytes());
                    scales[8 * j + 4..8 * j + 8].copy_from_slice(&s.to_le_bytes());
                }
            }
        }
    }
}

fn check_matmul(
    ty: GgmlType,
    weights: &[u8],
    k: usize,
    acts: &QuantizedActivations,
    out: &[f32],
) -> Result<usize> {
    check_matmul_sizes(ty, weights, k, acts, out.len())
}

/// [`check_matmul`] for an output of `out_len` values.
fn check_matmul_sizes(
    ty: GgmlType,
    weights: &[u8],
    k: usize,
    acts: &QuantizedActivations,
    out_len: usize,
) -> Result<usize> {
    if !is_weight_type(ty) {
        return Err(Error::QuantUnsupported { ty, op: "matmul" });
    }
    let rb = row_bytes(ty, k)?;
    let expected = activation_type(ty);
    if acts.ty != expected {
        return Err(Error::QuantActivationType {
            weight: ty,
            expected,
            got: acts.ty,
        });
    }
    if acts.k != k {
        return Err(Error::QuantActivationK {
            expected: k,
            got: acts.k,
        });
    }
    if !weights.len().is_multiple_of(rb) {
        return Err(Error::QuantRowBytes {
            ty,
            row_bytes: rb,
            got: weights.len(),
        });
    }
    let rows = weights.len() / rb;
    let n = rows.saturating_mul(acts.n_tokens);
    if out_len != n {
        return Err(Error::QuantValueCount {
            what: "matmul output",
            expected: n,
            got: out_len,
        });
    }
    Ok(rb)
}

/// Signature of a tile kernel: weight rows `w` (1..=8 rows of `rb` bytes) against tokens
/// `t0..t0 + nt` (`nt` in 1..=4, or 8 for the tile shapes `tile_shape` gives), writing
/// `out[i * stride + j]` for row `i`, token `t0 + j`.
pub(crate) type TileFn = unsafe fn(
    w: &[u8],
    rb: usize,
    acts: &QuantizedActivations,
    t0: usize,
    nt: usize,
    out: &mut [f32],
    stride: usize,
);

/// Where a wide tile's results go: row `i`, token `j` at `ptr + i * rs + j * ts` (a
/// row-major tile: `rs` = stride, `ts` = 1; a batch's token-major output: `rs` = 1,
/// `ts` = values per token).
#[derive(Clone, Copy)]
pub(crate) struct TileOut {
    pub ptr: *mut f32,
    pub rs: usize,
    pub ts: usize,
}

impl TileOut {
    /// Writes the result of row `i`, token `j`.
    ///
    /// # Safety
    /// The element must be valid for writes and not accessed by another thread.
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    #[inline(always)]
    pub(crate) unsafe fn put(self, i: usize, j: usize, v: f32) {
        // SAFETY: the caller's contract.
        unsafe { *self.ptr.add(i * self.rs + j * self.ts) = v };
    }
}

/// Signature of a wide prefill kernel: weight rows `w` against tokens `t0..t0 + nt`,
/// written through `out`. It returns false, computing nothing, for a tile it does not
/// take (the 32-element formats' AVX-512 ones take 4 rows, their AVX2 ones up to 16,
/// both whole groups of [`PACK_TOKENS`] tokens; the K-quants' also take a batch's tail,
/// or a batch of [`K_GROUP_MIN_TOKENS`] to 7 tokens, as a group filled with zeros); the
/// caller then uses the narrow kernel.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
pub(crate) type WideFn = unsafe fn(
    w: &[u8],
    rb: usize,
    acts: &QuantizedActivations,
    t0: usize,
    nt: usize,
    out: TileOut,
) -> bool;

#[allow(clippy::too_many_arguments)]
fn scalar_tile(
    ty: GgmlType,
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
            let (a, s, f) = acts.parts(t0 + j);
            out[i * stride + j] = scalar::dot(ty, row, a, s, f);
        }
    }
}

/// The tile kernel for `ty` at `level`.
///
/// AVX-512 decode once took the AVX2 kernels of Q4_0, Q5_0, Q8_0 and the K-quants, which
/// streamed faster then; the AVX-512 ones have since overtaken them (Q5_0 37 GB/s against
/// 14, Q6_K 47 against 30, Q8_0 41 against 36 on Qwen2.5-Coder-0.5B's shapes,
/// `BALLAST_BENCH_TABLE=1 cargo bench --bench quant`), so every level uses its own.
fn tile_kernel(level: SimdLevel, ty: GgmlType) -> Option<TileFn> {
    match level {
        #[cfg(target_arch = "x86_64")]
        SimdLevel::Avx512 => x86::kernel_avx512(ty).or_else(|| x86::kernel_avx2(ty)),
        #[cfg(target_arch = "x86_64")]
        SimdLevel::Avx2 => x86::kernel_avx2(ty),
        #[cfg(target_arch = "aarch64")]
        SimdLevel::Neon => arm::kernel_neon(ty),
        _ => None,
    }
}

/// Multiplies weight rows by activation rows: `out[r * n_tokens + t] = dot(row r, token t)`.
///
/// `weights` holds R whole rows of `k` values of type `ty` (R = `weights.len()` /
/// [`row_bytes`]); `acts` must come from [`quantize_activations`] for `ty` with the same `k`;
/// `out` must have R * n_tokens values. Uses the level of [`current_simd_level`].
pub fn matmul(
    ty: GgmlType,
    weights: &[u8],
    k: usize,
    acts: &QuantizedActivations,
    out: &mut [f32],
) -> Result<()> {
    matmul_at(current_simd_level(), ty, weights, k, acts, out)
}

/// [`matmul`] at a given kernel level (for tests and benchmarks). A level the CPU does not
/// support, or that has no kernel for `ty`, falls back to a lower one.
pub fn matmul_at(
    level: SimdLevel,
    ty: GgmlType,
    weights: &[u8],
    k: usize,
    acts: &QuantizedActivations,
    out: &mut [f32],
) -> Result<()> {
    let rb = check_matmul(ty, weights, k, acts, out)?;
    let n = acts.n_tokens;
    if n == 0 {
        return Ok(());
    }
    let level = if level.is_supported() {
        level
    } else {
        best_level()
    };
    let kernel = tile_kernel(level, ty);
    let rows = weights.len() / rb;
    for_each_blocked_tile(level, ty, rows, acts, |r, rr, t0, nt| {
        let w = &weights[r * rb..(r + rr) * rb];
        let dst = &mut out[r * n + t0..];
        match kernel {
            // SAFETY: the kernel was selected for a level this CPU supports, and the
            // lengths of `w` and the activation rows were validated above.
            Some(f) => unsafe { f(w, rb, acts, t0, nt, dst, n) },
            None => scalar_tile(ty, w, rb, acts, t0, nt, dst, n),
        }
    });
    Ok(())
}

/// [`matmul`] over rows that need not be adjacent: `row(i)` for `i` in `0..n_rows` is
/// row `i` (`row_bytes(ty, k)` bytes), and `out[i * n_tokens + t]` its product with
/// token `t`. Each row is computed by the kernel [`matmul`] uses, one row at a time, so
/// a row's values equal what [`matmul`] gives for it in any matrix (the kernels
/// accumulate each row alone, whatever the tile).
pub fn matmul_gathered<'a>(
    ty: GgmlType,
    n_rows: usize,
    row: impl Fn(usize) -> &'a [u8],
    k: usize,
    acts: &QuantizedActivations,
    out: &mut [f32],
) -> Result<()> {
    let n = acts.n_tokens;
    if out.len() != n_rows.saturating_mul(n) {
        return Err(Error::QuantValueCount {
            what: "gathered matmul output",
            expected: n_rows.saturating_mul(n),
            got: out.len(),
        });
    }
    if n == 0 || n_rows == 0 {
        return Ok(());
    }
    let level = current_simd_level();
    let kernel = tile_kernel(level, ty);
    let shape = tile_shape(level, ty, n);
    for (i, dst) in out.chunks_exact_mut(n).enumerate() {
        let w = row(i);
        let rb = check_matmul_sizes(ty, w, k, acts, n)?;
        for_each_tile(1, n, shape, |_, _, t0, nt| match kernel {
            // SAFETY: the kernel was selected for a level this CPU supports, and the
            // lengths of `w` (one row) and the activation rows were validated above.
            Some(f) => unsafe { f(w, rb, acts, t0, nt, &mut dst[t0..], n) },
            None => scalar_tile(ty, w, rb, acts, t0, nt, &mut dst[t0..], n),
        });
    }
    Ok(())
}

/// `acc += scale · row` for a Q8_0 row of `acc.len()` values (the down sum of a neuron
/// MLP): on the SIMD level in use, bit for bit what
/// [`ballast_core::neurons::axpy_row`] gives (the product `(d · scale) · q` and the
/// add rounded apart).
pub fn axpy_q8_0(row: &[u8], scale: f32, acc: &mut [f32]) -> Result<()> {
    axpy_q8_0_at(current_simd_level(), row, scale, acc)
}

/// [`axpy_q8_0`] at a given level (tests); an unsupported level falls back to scalar.
pub fn axpy_q8_0_at(level: SimdLevel, row: &[u8], scale: f32, acc: &mut [f32]) -> Result<()> {
    if acc.len() % 32 != 0 || row.len() != acc.len() / 32 * 34 {
        return Err(Error::QuantLength {
            ty: GgmlType::Q8_0,
            expected: acc.len().div_ceil(32) * 34,
            got: row.len(),
        });
    }
    match level {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the level is supported and the lengths were checked above.
        SimdLevel::Avx512 if level.is_supported() => unsafe {
            x86::axpy_q8_0_avx512(row, scale, acc)
        },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        SimdLevel::Avx2 | SimdLevel::Avx512 if SimdLevel::Avx2.is_supported() => unsafe {
            x86::axpy_q8_0_avx2(row, scale, acc)
        },
        _ => ballast_core::neurons::axpy_row(GgmlType::Q8_0, row, scale, acc)?,
    }
    Ok(())
}

/// Walks `rows` x `n` outputs in tiles of `(rows, tokens)` = `shape` where they fit:
/// whole tiles of rows, then one tile of the rows left; whole tiles of tokens, then tails of at most
/// 4 tokens (every kernel has those shapes). Calls `tile(first row, rows, first token,
/// tokens)` for each.
fn for_each_tile(
    rows: usize,
    n: usize,
    (rr_pref, nt_pref): (usize, usize),
    mut tile: impl FnMut(usize, usize, usize, usize),
) {
    let mut r = 0;
    while r < rows {
        let rr = rr_pref.min(rows - r);
        let mut t0 = 0;
        while t0 < n {
            let nt = if n - t0 >= nt_pref {
                nt_pref
            } else {
                (n - t0).min(4)
            };
            tile(r, rr, t0, nt);
            t0 += nt;
        }
        r += rr;
    }
}

/// Bytes of quantized activations a block of tokens may take, so that they stay in L2
/// while every row passes over them: a quarter of Zen 4's 1 MiB, half of the 512 KiB
/// of older cores.
const ACTIVATION_BLOCK_BYTES: usize = 256 << 10;

/// [`ACTIVATION_BLOCK_BYTES`] for the K-quants' Q8_K activations. Their prefill
/// kernels (`x86::k_wide`) decode each row once per block, at a cost of several token
/// groups' products, so a larger block pays even from L3: Llama-3.1-8B-shaped Q4_K_M's
/// pp512 on 2 threads at 49 tokens/s instead of 44-45 with 256 KiB (its `ffn_down`
/// rows, 14,336 long, had 16 tokens a block).
const K_ACTIVATION_BLOCK_BYTES: usize = 1 << 20;

/// Tokens per block of [`for_each_blocked_tile`]: whole groups of [`PACK_TOKENS`]
/// whose activations fit [`ACTIVATION_BLOCK_BYTES`] (at least one group).
fn token_block(acts: &QuantizedActivations) -> usize {
    let budget = if acts.ty == GgmlType::Q8_K {
        K_ACTIVATION_BLOCK_BYTES
    } else {
        ACTIVATION_BLOCK_BYTES
    };
    (budget / acts.row_bytes.max(1) / PACK_TOKENS * PACK_TOKENS).max(PACK_TOKENS)
}

/// [`for_each_tile`] over the tokens of `acts` in blocks of [`token_block`], each block
/// tiled with the shape [`tile_shape`] gives it.
///
/// A tile reads its tokens' activations once for the rows it computes, so with all
/// 512 tokens of an 8B model's MLP in one pass (8.4 MB of Q8_K) the rows streamed
/// them from L3 two thousand times; a block stays in L2. Blocks are whole groups of 8
/// tokens, a multiple of every tile's tokens, and each kernel computes a (row, token)
/// pair alone whatever the tile, so the outputs keep their bits.
fn for_each_blocked_tile(
    level: SimdLevel,
    ty: GgmlType,
    rows: usize,
    acts: &QuantizedActivations,
    mut tile: impl FnMut(usize, usize, usize, usize),
) {
    let n = acts.n_tokens;
    let block = if n == 1 { 1 } else { token_block(acts) };
    for b0 in (0..n).step_by(block) {
        let len = (n - b0).min(block);
        // A last block of one token is still prefill: the kernel was chosen for `n`
        // tokens, and the decode shape's rows would not fit the caller's buffer.
        let shape = tile_shape(level, ty, if n == 1 { 1 } else { len.max(2) });
        for_each_tile(rows, len, shape, |r, rr, t, nt| tile(r, rr, b0 + t, nt));
    }
}

/// [`matmul`] writing token-major output: `out[t * ld + r]` for weight row `r` and
/// token `t` (the layout of a batch of activations, `ld` values per token), so a thread
/// computing some rows of a matrix writes its share of the batch's output directly.
/// Each tile is computed into a small buffer, then stored.
///
/// # Safety
/// For every row `r` of `weights` and token `t` of `acts`, `out + t * ld + r` must be
/// valid for a write of an f32, and no other thread may access those elements during
/// the call.
pub unsafe fn matmul_token_major(
    ty: GgmlType,
    weights: &[u8],
    k: usize,
    acts: &QuantizedActivations,
    out: *mut f32,
    ld: usize,
) -> Result<()> {
    let rb = row_bytes(ty, k)?;
    let rows = weights.len() / rb;
    let n = acts.n_tokens;
    // The shapes are checked against an output of the row-major size.
    check_matmul_sizes(ty, weights, k, acts, rows.saturating_mul(n))?;
    if n == 0 || rows == 0 {
        return Ok(());
    }
    let level = current_simd_level();
    let kernel = tile_kernel(level, ty);
    let shape = tile_shape(level, ty, token_block(acts).min(n));
    // The tile's rows at stride `st` in `buf` (rr <= shape.0, nt <= st).
    let st = shape.1.max(4);
    let mut small = [0f32; 32];
    let mut large = Vec::new();
    let buf: &mut [f32] = if shape.0 * st <= small.len() {
        &mut small
    } else {
        large.resize(shape.0 * st, 0f32);
        &mut large
    };
    #[cfg(target_arch = "x86_64")]
    let wide = match level {
        SimdLevel::Avx512 => x86::wide_avx512(ty),
        SimdLevel::Avx2 => x86::wide_avx2(ty),
        _ => None,
    };
    #[cfg(not(target_arch = "x86_64"))]
    let wide: Option<WideFn> = None;
    for_each_blocked_tile(level, ty, rows, acts, |r, rr, t0, nt| {
        let w = &weights[r * rb..(r + rr) * rb];
        if let Some(f) = wide {
            // The kernel writes its tokens from the first: token t0 of row r.
            let out = TileOut {
                // SAFETY: row r of token t0 is in the caller's region.
                ptr: unsafe { out.add(t0 * ld + r) },
                rs: 1,
                ts: ld,
            };
            // SAFETY: the kernel was selected for a level this CPU supports; every
            // (t, r + i) it writes is in the caller's region by the contract.
            if unsafe { f(w, rb, acts, t0, nt, out) } {
                return;
            }
        }
        match kernel {
            // SAFETY: the kernel was selected for a level this CPU supports, and the
            // lengths of `w` and the activation rows were validated above.
            Some(f) => unsafe { f(w, rb, acts, t0, nt, buf, st) },
            None => scalar_tile(ty, w, rb, acts, t0, nt, buf, st),
        }
        for j in 0..nt {
            for i in 0..rr {
                // SAFETY: row r + i < rows and token t0 + j < n: in the caller's
                // region by the contract.
                unsafe { *out.add((t0 + j) * ld + r + i) = buf[i * st + j] };
            }
        }
    });
    Ok(())
}

/// The (rows, tokens) tile `matmul_at` hands a kernel. Decode (one token): 8 rows on
/// AVX-512 (4 below) share each activation block load, its offset correction and the
/// final reductions (with 4, these were a fifth of a Q5_0 block's work). AVX2 takes 8
/// rows too except for Q4_1 and Q5_1, whose two accumulators per row do not fit its 16
/// registers 8 times, and 2 rows x 4 tokens in prefill for the Q8_0-like formats
/// (`BALLAST_BENCH_TABLE=1 cargo bench --bench quant`, thread CPU time: Q8_0 decode
/// 25 → 29 GB/s, prefill 69k → 89k tokens/s on SmolLM2's q_o; Q4_K decode 17 → 19 GB/s;
/// Q4_1 decode 16.3 → 15.2 with 8 rows, so it keeps 4). In prefill of at least 8 tokens
/// the AVX2 32-element formats take up to 16 rows x all whole groups of 8 tokens (the rows
/// decoded once, `avx2_wide`): Qwen2.5-Coder-0.5B's pp128 (mostly Q5_0) at 147-150 tokens/s
/// instead of 101-104 on one thread, Gemma 3 270M's at 431-449 instead of 319-326
/// (`BALLAST_SIMD=avx2 ballast bench -p 128 -n 0 -r 3 -t 1`, alternated, a Zen 4 EPYC);
/// fewer tokens keep 2 rows x 4 tokens. Q4_1 and Q5_1 too: SmolLM2's pp128 at 434-435
/// tokens/s instead of 320-322. From 8 tokens the K-quants take 16 rows x all the block's
/// tokens at both levels (`x86::k_wide`: rows decoded once, a sub-block's products
/// summed in 16 bits before its scale, a tail of 1 to 7 tokens handled inside):
/// Qwen2.5-Coder-1.5B Q4_K_M's pp128 at 125 tokens/s instead of 80 on one thread at
/// AVX-512, 90 instead of 50 at AVX2 (`ballast bench -p 128 -n 0 -r 2`, a Zen 4 EPYC).
/// Prefill reuses each decoded weight block for several tokens: on AVX-512 the 32-element formats take 4 rows x all
/// whole groups of 8 tokens (two 512-bit row pairs, sixteen accumulators per group; the
/// Q8_0-like kernels decode the 4 rows once for every group), the K-quants under 8 tokens
/// 2 rows x all tokens (the rows decoded once, the tokens taken 4 at a time). "All
/// tokens" is a block of [`for_each_blocked_tile`]: as many as keep their activations in
/// L2 (the K-quants' in 1 MiB).
fn tile_shape(level: SimdLevel, ty: GgmlType, n: usize) -> (usize, usize) {
    let is_k_quant = |ty| matches!(ty, GgmlType::Q4_K | GgmlType::Q5_K | GgmlType::Q6_K);
    match (n, level) {
        (1, SimdLevel::Avx512) => (8, 1),
        // Q5_0's 8-row tile spilled registers on AVX2 (its fifth bits take four
        // constants): 4 rows decode at 20.2-20.9 GB/s, 8 at 19.4-19.6.
        (1, SimdLevel::Avx2) if !matches!(ty, GgmlType::Q4_1 | GgmlType::Q5_1 | GgmlType::Q5_0) => {
            (8, 1)
        }
        (1, _) => (4, 1),
        (_, SimdLevel::Avx512)
            if matches!(activation_type(ty), GgmlType::Q8_0 | GgmlType::Q8_1) =>
        {
            (4, (n / PACK_TOKENS * PACK_TOKENS).max(PACK_TOKENS))
        }
        (_, SimdLevel::Avx512 | SimdLevel::Avx2) if n >= K_GROUP_MIN_TOKENS && is_k_quant(ty) => {
            (16, n)
        }
        (_, SimdLevel::Avx512) => (2, n),
        (_, SimdLevel::Avx2) if n >= PACK_TOKENS && ty.block_len() == 32 => {
            (16, n / PACK_TOKENS * PACK_TOKENS)
        }
        (_, SimdLevel::Avx2) if matches!(ty, GgmlType::Q8_0 | GgmlType::Q4_0 | GgmlType::Q5_0) => {
            (2, 4)
        }
        (_, SimdLevel::Avx2) if matches!(ty, GgmlType::Q4_K | GgmlType::Q5_K | GgmlType::Q6_K) => {
            (1, 8)
        }
        // A row's blocks unpacked once for eight tokens (`arm::TOKENS`).
        (_, SimdLevel::Neon) => (1, 8),
        _ => (1, 4),
    }
}

/// Scalar dot product of one weight row (`row_bytes(ty, acts.k())` bytes) with activation
/// row `token` of `acts` (quantized for `ty`). Uses the portable kernel whatever the level.
pub fn vec_dot(
    ty: GgmlType,
    weight_row: &[u8],
    acts: &QuantizedActivations,
    token: usize,
) -> Result<f32> {
    if token >= acts.n_tokens {
        return Err(Error::QuantTokenIndex {
            token,
            n_tokens: acts.n_tokens,
        });
    }
    let rb = row_bytes(ty, acts.k)?;
    if weight_row.len() != rb {
        return Err(Error::QuantLength {
            ty,
            expected: rb,
            got: weight_row.len(),
        });
    }
    let mut out = [0f32];
    check_matmul(ty, weight_row, acts.k, acts, &[0f32; 0][..]).or_else(|e| match e {
        // One row against all tokens would need n_tokens outputs; only one is computed.
        Error::QuantValueCount { .. } => Ok(rb),
        e => Err(e),
    })?;
    scalar_tile(ty, weight_row, rb, acts, token, 1, &mut out, 1);
    Ok(out[0])
}
