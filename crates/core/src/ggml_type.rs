//! The tensor element types of GGUF (ggml's `ggml_type`), with their block geometry.

use std::fmt;

/// A tensor element type as numbered by ggml (`enum ggml_type`).
///
/// Quantized types store values in blocks: [`GgmlType::block_len`] values packed into
/// [`GgmlType::block_bytes`] bytes. Plain types have a block of one value.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum GgmlType {
    /// 32-bit IEEE float.
    F32,
    /// 16-bit IEEE float.
    F16,
    /// bfloat16.
    BF16,
    /// 32 values: f16 scale `d`, 16 bytes of 4-bit quants; `x = d * (q - 8)`.
    Q4_0,
    /// 32 values: f16 `d`, f16 min `m`, 16 bytes of 4-bit quants; `x = d * q + m`.
    Q4_1,
    /// 32 values: f16 `d`, 4 bytes of high bits, 16 bytes of low nibbles; `x = d * (q - 16)`.
    Q5_0,
    /// 32 values: f16 `d`, f16 `m`, 4 bytes of high bits, 16 bytes of low nibbles; `x = d * q + m`.
    Q5_1,
    /// 32 values: f16 `d`, 32 signed bytes; `x = d * q`.
    Q8_0,
    /// 32 values: f16 `d`, f16 `s = d * sum(q)`, 32 signed bytes (activations for Q4_1/Q5_1).
    Q8_1,
    /// 256 values in 8 sub-blocks of 32 with 6-bit scales and mins.
    Q4_K,
    /// 256 values in 8 sub-blocks of 32 with 6-bit scales and mins, 5-bit quants.
    Q5_K,
    /// 256 values in 16 sub-blocks of 16 with 8-bit scales, 6-bit quants.
    Q6_K,
    /// 256 values: f32 `d`, 256 signed bytes, 16 i16 sums of 16 (activations for K-quants).
    Q8_K,
}

impl GgmlType {
    /// Every type this crate knows.
    pub const ALL: [GgmlType; 13] = [
        GgmlType::F32,
        GgmlType::F16,
        GgmlType::BF16,
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q5_0,
        GgmlType::Q5_1,
        GgmlType::Q8_0,
        GgmlType::Q8_1,
        GgmlType::Q4_K,
        GgmlType::Q5_K,
        GgmlType::Q6_K,
        GgmlType::Q8_K,
    ];

    /// The type for ggml's numeric id, or `None` for an id this crate does not support.
    pub fn from_id(id: u32) -> Option<GgmlType> {
        Some(match id {
            0 => GgmlType::F32,
            1 => GgmlType::F16,
            2 => GgmlType::Q4_0,
            3 => GgmlType::Q4_1,
            6 => GgmlType::Q5_0,
            7 => GgmlType::Q5_1,
            8 => GgmlType::Q8_0,
            9 => GgmlType::Q8_1,
            12 => GgmlType::Q4_K,
            13 => GgmlType::Q5_K,
            14 => GgmlType::Q6_K,
            15 => GgmlType::Q8_K,
            30 => GgmlType::BF16,
            _ => return None,
        })
    }

    /// ggml's numeric id of this type.
    pub fn id(self) -> u32 {
        match self {
            GgmlType::F32 => 0,
            GgmlType::F16 => 1,
            GgmlType::Q4_0 => 2,
            GgmlType::Q4_1 => 3,
            GgmlType::Q5_0 => 6,
            GgmlType::Q5_1 => 7,
            GgmlType::Q8_0 => 8,
            GgmlType::Q8_1 => 9,
            GgmlType::Q4_K => 12,
            GgmlType::Q5_K => 13,
            GgmlType::Q6_K => 14,
            GgmlType::Q8_K => 15,
            GgmlType::BF16 => 30,
        }
    }

    /// Number of values in one block.
    pub fn block_len(self) -> usize {
        match self {
            GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => 1,
            GgmlType::Q4_0
            | GgmlType::Q4_1
            | GgmlType::Q5_0
            | GgmlType::Q5_1
            | GgmlType::Q8_0
            | GgmlType::Q8_1 => 32,
            GgmlType::Q4_K | GgmlType::Q5_K | GgmlType::Q6_K | GgmlType::Q8_K => 256,
        }
    }

    /// Number of bytes in one block.
    pub fn block_bytes(self) -> usize {
        match self {
            GgmlType::F32 => 4,
            GgmlType::F16 | GgmlType::BF16 => 2,
            GgmlType::Q4_0 => 18,
            GgmlType::Q4_1 => 20,
            GgmlType::Q5_0 => 22,
            GgmlType::Q5_1 => 24,
            GgmlType::Q8_0 => 34,
            GgmlType::Q8_1 => 36,
            GgmlType::Q4_K => 144,
            GgmlType::Q5_K => 176,
            GgmlType::Q6_K => 210,
            GgmlType::Q8_K => 292,
        }
    }

    /// Bytes taken by `n_values` values, or `None` if `n_values` is not a whole number of
    /// blocks or the size overflows.
    pub fn bytes_for(self, n_values: u64) -> Option<u64> {
        let len = self.block_len() as u64;
        if n_values % len != 0 {
            return None;
        }
        (n_values / len).checked_mul(self.block_bytes() as u64)
    }

    /// The name ggml and llama.cpp print for this type (`"Q4_1"`, `"F32"`, ...).
    pub fn name(self) -> &'static str {
        match self {
            GgmlType::F32 => "F32",
            GgmlType::F16 => "F16",
            GgmlType::BF16 => "BF16",
            GgmlType::Q4_0 => "Q4_0",
            GgmlType::Q4_1 => "Q4_1",
            GgmlType::Q5_0 => "Q5_0",
            GgmlType::Q5_1 => "Q5_1",
            GgmlType::Q8_0 => "Q8_0",
            GgmlType::Q8_1 => "Q8_1",
            GgmlType::Q4_K => "Q4_K",
            GgmlType::Q5_K => "Q5_K",
            GgmlType::Q6_K => "Q6_K",
            GgmlType::Q8_K => "Q8_K",
        }
    }
}

impl fmt::Display for GgmlType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}
