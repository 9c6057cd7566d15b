//! Synthetic models at the shapes people run: a GGUF with the metadata, tensor names,
//! shapes and types of a real model (Llama-3.1-8B, Qwen2.5-7B, Qwen3-30B-A3B, ...) and
//! deterministic random weights, written at the disk's speed without holding the file
//! in memory. Speed does not depend on the weights' values, so these stand in for the
//! real files in benchmarks of memory, streaming and throughput. Their vocabulary is
//! byte-level padded to the real size (texts encode to byte tokens), and a mixture of
//! experts over random weights routes without locality: the worst case for an expert
//! cache.
//!
//! ```
//! use ballast_runtime::gguf::GgufFile;
//! use ballast_runtime::synth::{SynthMix, SynthModel, SHAPES};
//!
//! # fn main() -> Result<(), ballast_runtime::Error> {
//! let shape = SHAPES.iter().find(|s| s.name == "tiny-llama").unwrap();
//! let model = SynthModel::new(shape, SynthMix::Q4KM);
//! let dir = std::env::temp_dir().join(format!("synth-doc-{}", std::process::id()));
//! std::fs::create_dir_all(&dir).unwrap();
//! let path = dir.join("tiny.gguf");
//! model.write(&path, |_, _| {})?;
//! let file = GgufFile::open(&path, true)?;
//! assert_eq!(file.get_str("general.architecture")?, "llama");
//! assert_eq!(std::fs::metadata(&path).unwrap().len(), model.file_bytes()?);
//! std::fs::remove_dir_all(&dir).unwrap();
//! # Ok(())
//! # }
//! ```

use std::path::Path;

use half::f16;

use crate::error::{Error, Result};
use crate::ggml_type::GgmlType;
use crate::gguf::{GgufWriter, TensorPart};
use crate::testing::{TinyModelSpec, TinyVocab};

/// A named real model's shape.
#[derive(Clone, Copy, Debug)]
pub struct SynthShape {
    /// The name `ballast synth --shape` takes.
    pub name: &'static str,
    /// What it is.
    pub description: &'static str,
    /// `general.architecture`.
    pub arch: &'static str,
    /// Transformer blocks.
    pub n_layers: usize,
    /// Residual width.
    pub d_model: usize,
    /// Query heads.
    pub n_heads: usize,
    /// Key/value heads.
    pub n_kv_heads: usize,
    /// Size of one head, when not `d_model / n_heads` (written as `key_length`).
    pub head_dim: Option<usize>,
    /// MLP width (of the dense MLP; a MoE model's is unused).
    pub n_ff: usize,
    /// Vocabulary.
    pub vocab: usize,
    /// `(experts, used per token, width of one expert)`.
    pub experts: Option<(usize, usize, usize)>,
    /// The output head is the embedding table.
    pub tied: bool,
    /// `rope.freq_base`.
    pub rope_base: f32,
    /// `context_length`.
    pub context: usize,
    /// Llama 3.1's `rope_freqs.weight`.
    pub rope_freqs: bool,
}

/// The shapes [`SynthModel`] knows, from the models' own configurations.
pub const SHAPES: &[SynthShape] = &[
    SynthShape {
        name: "llama-3.1-8b",
        description: "Llama-3.1-8B: 32 layers, 4096 wide, 32/8 heads, MLP 14336, 128256 tokens",
        arch: "llama",
        n_layers: 32,
        d_model: 4096,
        n_heads: 32,
        n_kv_heads: 8,
        head_dim: None,
        n_ff: 14336,
        vocab: 128_256,
        experts: None,
        tied: false,
        rope_base: 500_000.0,
        context: 131_072,
        rope_freqs: true,
    },
    SynthShape {
        name: "qwen2.5-7b",
        description: "Qwen2.5-7B: 28 layers, 3584 wide, 28/4 heads, MLP 18944, 152064 tokens, QKV biases",
        arch: "qwen2",
        n_layers: 28,
        d_model: 3584,
        n_heads: 28,
        n_kv_heads: 4,
        head_dim: None,
        n_ff: 18944,
        vocab: 152_064,
        experts: None,
        tied: false,
        rope_base: 1_000_000.0,
        context: 32_768,
        rope_freqs: false,
    },
    SynthShape {
        name: "qwen3-30b-a3b",
        description: "Qwen3-30B-A3B: 48 layers, 2048 wide, 32/4 heads of 128, 128 experts of 768 (8 per token), 151936 tokens",
        arch: "qwen3moe",
        n_layers: 48,
        d_model: 2048,
        n_heads: 32,
        n_kv_heads: 4,
        head_dim: Some(128),
        n_ff: 6144,
        vocab: 151_936,
        experts: Some((128, 8, 768)),
        tied: false,
        rope_base: 1_000_000.0,
        context: 40_960,
        rope_freqs: false,
    },
    SynthShape {
        name: "smollm2-135m",
        description: "SmolLM2-135M: 30 layers, 576 wide, 9/3 heads, MLP 1536, 49152 tokens, tied",
        arch: "llama",
        n_layers: 30,
        d_model: 576,
        n_heads: 9,
        n_kv_heads: 3,
        head_dim: None,
        n_ff: 1536,
        vocab: 49_152,
        experts: None,
        tied: true,
        rope_base: 100_000.0,
        context: 8192,
        rope_freqs: false,
    },
    SynthShape {
        name: "tiny-llama",
        description: "a 2-layer llama of 256 wide (tests)",
        arch: "llama",
        n_layers: 2,
        d_model: 256,
        n_heads: 4,
        n_kv_heads: 2,
        head_dim: None,
        n_ff: 512,
        vocab: 512,
        experts: None,
        tied: false,
        rope_base: 10_000.0,
        context: 2048,
        rope_freqs: false,
    },
];

/// The types of the tensors, as llama.cpp's quantization presets give them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SynthMix {
    /// llama.cpp's Q4_K_M: Q4_K, with Q6_K for the output head and for `attn_v` and
    /// `ffn_down` in the first and last eighth of the layers and every third between.
    Q4KM,
    /// Every matrix Q8_0.
    Q8_0,
    /// Every matrix BF16 (a stand-in for an unquantized model).
    BF16,
}

impl SynthMix {
    /// The names `--type` takes.
    pub const NAMES: &'static str = "q4_k_m, q8_0, bf16";

    /// The mix named `s` (`q4_k_m`, `q8_0`, `bf16`, any case).
    pub fn parse(s: &str) -> Option<SynthMix> {
        match s.to_ascii_lowercase().as_str() {
            "q4_k_m" => Some(SynthMix::Q4KM),
            "q8_0" => Some(SynthMix::Q8_0),
            "bf16" => Some(SynthMix::BF16),
            _ => None,
        }
    }

    /// The type of the matrix `name` in a model of `n_layers`.
    pub fn type_of(self, name: &str, n_layers: usize) -> GgmlType {
        match self {
            SynthMix::Q8_0 => GgmlType::Q8_0,
            SynthMix::BF16 => GgmlType::BF16,
            SynthMix::Q4KM => {
                if name == "output.weight" {
                    return GgmlType::Q6_K;
                }
                let layer = name
                    .strip_prefix("blk.")
                    .and_then(|r| r.split('.').next())
                    .and_then(|l| l.parse::<usize>().ok());
                let more_bits = |i: usize| {
                    let n = n_layers;
                    i < n / 8 || i >= 7 * n / 8 || (i - n / 8) % 3 == 2
                };
                let sensitive = name.contains("attn_v.") || name.contains("ffn_down");
                match layer {
                    Some(i) if sensitive && more_bits(i) => GgmlType::Q6_K,
                    _ => GgmlType::Q4_K,
                }
            }
        }
    }
}

/// A synthetic model: a shape and a mix.
#[derive(Clone, Debug)]
pub struct SynthModel {
    shape: SynthShape,
    mix: SynthMix,
}

impl SynthModel {
    /// The model of `shape` in `mix`.
    pub fn new(shape: &SynthShape, mix: SynthMix) -> SynthModel {
        SynthModel { shape: *shape, mix }
    }

    /// The shape named `name`, or an error listing the names.
    pub fn shape(name: &str) -> Result<&'static SynthShape> {
        SHAPES
            .iter()
            .find(|s| s.name == name)
            .ok_or_else(|| Error::InvalidArgument {
                what: format!(
                    "unknown shape {name:?}: one of {}",
                    SHAPES.iter().map(|s| s.name).collect::<Vec<_>>().join(", ")
                ),
            })
    }

    fn spec(&self) -> TinyModelSpec {
        let s = &self.shape;
        TinyModelSpec {
            arch: s.arch.into(),
            n_layers: s.n_layers,
            d_model: s.d_model,
            n_heads: s.n_heads,
            head_dim: s.head_dim,
            vocab: TinyVocab::ByteLevelPadded(s.vocab),
            n_kv_heads: s.n_kv_heads,
            n_ff: s.n_ff,
            weight_type: GgmlType::Q8_0,
            embd_type: GgmlType::Q8_0,
            tied: s.tied,
            rope_base: s.rope_base,
            context_length: s.context,
            sliding_window: None,
            experts: s.experts,
            rope_scaling: None,
            rope_freqs: s.rope_freqs,
            shared_expert: None,
            seed: 1,
        }
    }

    fn writer(&self) -> Result<GgufWriter> {
        let (mix, n_layers) = (self.mix, self.shape.n_layers);
        self.spec().deferred_writer(&|name, ty, dims| {
            // The router stays f32, as converted files keep it.
            if ty == GgmlType::F32 {
                return ty;
            }
            let ty = mix.type_of(name, n_layers);
            // Rows that are not whole super-blocks take llama.cpp's fallback types.
            match ty {
                GgmlType::Q4_K if dims[0] % 256 != 0 => GgmlType::Q5_0,
                GgmlType::Q6_K if dims[0] % 256 != 0 => GgmlType::Q8_0,
                ty => ty,
            }
        })
    }

    /// Bytes of the file [`SynthModel::write`] writes.
    pub fn file_bytes(&self) -> Result<u64> {
        Ok(self.writer()?.file_bytes())
    }

    /// Writes the model to `path` (atomically), calling `progress(done, total)` with
    /// the bytes of tensor data written so far.
    pub fn write(&self, path: &Path, mut progress: impl FnMut(u64, u64)) -> Result<()> {
        let w = self.writer()?;
        let total = w.file_bytes();
        let mut done = 0u64;
        w.write_streaming(path, 8 << 20, |part, buf| {
            fill(part, buf);
            done += buf.len() as u64;
            progress(done, total);
            Ok(())
        })?;
        Ok(())
    }
}

/// Random weights of a trained model's magnitude (about 0.02) for one part of a
/// tensor, the same for the same tensor and offset.
fn fill(part: TensorPart<'_>, buf: &mut [u8]) {
    let mut seed = part.offset ^ 0x9e37_79b9_7f4a_7c15;
    for b in part.name.bytes() {
        seed = (seed ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
    }
    let mut rng = SplitMix(seed);
    for chunk in buf.chunks_mut(8) {
        let x = rng.next().to_le_bytes();
        chunk.copy_from_slice(&x[..chunk.len()]);
    }
    let put_f16 = |b: &mut [u8], v: f32| b.copy_from_slice(&f16::from_f32(v).to_le_bytes());
    match part.ty {
        // d, dmin, 12 bytes of 6-bit scales and mins, 128 of nibbles.
        GgmlType::Q4_K => buf.chunks_exact_mut(144).for_each(|b| {
            put_f16(&mut b[0..2], 4e-5);
            put_f16(&mut b[2..4], 2e-5);
        }),
        // 128 bytes of low bits, 64 of high, 16 signed scales, d last.
        GgmlType::Q6_K => buf
            .chunks_exact_mut(210)
            .for_each(|b| put_f16(&mut b[208..210], 5e-6)),
        GgmlType::Q8_0 => buf
            .chunks_exact_mut(34)
            .for_each(|b| put_f16(&mut b[0..2], 2e-4)),
        GgmlType::BF16 => buf.chunks_exact_mut(2).for_each(|b| {
            let v = (i16::from_le_bytes([b[0], b[1]]) as f32) * (0.03 / 32768.0);
            b.copy_from_slice(&((v.to_bits() >> 16) as u16).to_le_bytes());
        }),
        GgmlType::F32 => buf.chunks_exact_mut(4).for_each(|b| {
            let v = (i32::from_le_bytes([b[0], b[1], b[2], b[3]]) as f32) * (0.03 / 2.1e9);
            b.copy_from_slice(&v.to_le_bytes());
        }),
        // Other types are not in any mix; their random bytes are left as they are.
        _ => {}
    }
}

/// splitmix64: fast, and good enough for weights nobody reads.
struct SplitMix(u64);

impl SplitMix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn q4_k_m_gives_the_sensitive_layers_more_bits() {
        let m = SynthMix::Q4KM;
        assert_eq!(m.type_of("output.weight", 32), GgmlType::Q6_K);
        assert_eq!(m.type_of("token_embd.weight", 32), GgmlType::Q4_K);
        assert_eq!(m.type_of("blk.0.attn_v.weight", 32), GgmlType::Q6_K);
        assert_eq!(m.type_of("blk.0.attn_q.weight", 32), GgmlType::Q4_K);
        assert_eq!(m.type_of("blk.4.ffn_down.weight", 32), GgmlType::Q4_K);
        assert_eq!(m.type_of("blk.6.ffn_down.weight", 32), GgmlType::Q6_K);
        assert_eq!(m.type_of("blk.31.ffn_down_exps.weight", 32), GgmlType::Q6_K);
        assert_eq!(SynthMix::parse("Q8_0"), Some(SynthMix::Q8_0));
        assert_eq!(SynthMix::parse("q5"), None);
    }

    #[test]
    fn the_real_shapes_have_the_real_sizes() {
        let gib = |name: &str, mix| {
            let shape = SynthModel::shape(name).unwrap();
            SynthModel::new(shape, mix).file_bytes().unwrap() as f64 / (1u64 << 30) as f64
        };
        // llama.cpp's files: 4.58 GiB, 7.95 GiB (Q8_0), 4.36 GiB, 17.3 GiB.
        let q4 = gib("llama-3.1-8b", SynthMix::Q4KM);
        assert!((4.4..4.8).contains(&q4), "{q4}");
        let q8 = gib("llama-3.1-8b", SynthMix::Q8_0);
        assert!((7.8..8.1).contains(&q8), "{q8}");
        let qwen = gib("qwen2.5-7b", SynthMix::Q4KM);
        assert!((4.2..4.6).contains(&qwen), "{qwen}");
        let moe = gib("qwen3-30b-a3b", SynthMix::Q4KM);
        assert!((16.5..18.0).contains(&moe), "{moe}");
        assert!(SynthModel::shape("llama-9b").is_err());
    }
}
