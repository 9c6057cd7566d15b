//! Tiny random-weight models, written as real GGUF files, for tests of this crate and
//! of the lever crates.
//!
//! ```
//! use ballast_runtime::testing::TinyModelSpec;
//! use ballast_runtime::gguf::GgufFile;
//!
//! let bytes = TinyModelSpec::default().to_gguf_bytes().unwrap();
//! let file = GgufFile::from_bytes(bytes).unwrap();
//! assert_eq!(file.get_str("general.architecture").unwrap(), "llama");
//! ```

use crate::arch::TensorSpec;
use crate::blocks::*;
use crate::error::Result;
use crate::ggml_type::GgmlType;
use crate::gguf::{Array, GgufWriter, Value};
use crate::model::ModelConfig;
use crate::quant;

/// The order in which tiny models have always had their layers' tensors, by role: kept
/// so that each file, and the llama.cpp logits recorded from some
/// (`tests/data/llama_cpp_logits.json`), stay the same byte for byte (each kind of
/// value draws from its own stream, in file order). A role not listed follows these,
/// in the architecture's table order.
const WRITE_ORDER: &[&str] = &[
    ATTN_NORM,
    FFN_NORM,
    ATTN_Q,
    ATTN_K,
    ATTN_V,
    ATTN_OUTPUT,
    FFN_GATE,
    FFN_UP,
    FFN_DOWN,
    FFN_GATE_INP,
    FFN_GATE_EXPS,
    FFN_UP_EXPS,
    FFN_DOWN_EXPS,
    ATTN_Q_NORM,
    ATTN_K_NORM,
    ATTN_POST_NORM,
    FFN_POST_NORM,
    FFN_GATE_INP_SHEXP,
    FFN_GATE_SHEXP,
    FFN_UP_SHEXP,
    FFN_DOWN_SHEXP,
    ATTN_Q_BIAS,
    ATTN_K_BIAS,
    ATTN_V_BIAS,
];

/// The vocabulary of a tiny model.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum TinyVocab {
    /// GPT-2 style byte-level BPE: the 256 byte tokens (no merges) and one control
    /// token, `<|endoftext|>` (id 256), which is also the end-of-sequence token
    /// ([`TINY_VOCAB`] tokens).
    #[default]
    ByteLevel,
    /// SentencePiece ([`spm_vocab`]): `<unk>`, `<s>` (BOS, added), `</s>` (EOS), the 256
    /// byte tokens `<0x00>`..`<0xFF>`, then scored pieces with `▁` for spaces, one
    /// user-defined and one unused token; no `add_space_prefix` key, so the default
    /// (true) applies.
    SentencePiece,
    /// The byte-level vocabulary padded to this many tokens with normal tokens no text
    /// encodes to (a real model's vocabulary size, for its embedding table and output
    /// head: [`crate::synth`]).
    ByteLevelPadded(usize),
}

/// Chooses a deferred matrix's type from its name, the spec's type for it and its dims
/// ([`TinyModelSpec::deferred_writer`]).
pub type TypeOf<'a> = dyn Fn(&str, GgmlType, &[u64]) -> GgmlType + 'a;

/// The shape and types of a tiny model.
#[derive(Clone, Debug)]
pub struct TinyModelSpec {
    /// An architecture of [`crate::arch::ARCHITECTURES`] (`"llama"`, `"qwen2"`,
    /// `"qwen3"`, `"gemma3"`, ...): the file has the tensors its tables list for the
    /// shape below. The writer refuses any other name, as the loader would.
    pub arch: String,
    /// Transformer blocks.
    pub n_layers: usize,
    /// Residual width.
    pub d_model: usize,
    /// Query heads.
    pub n_heads: usize,
    /// Size of one head, written as `attention.key_length` and `value_length`; `None`:
    /// `d_model / n_heads`, and no such keys.
    pub head_dim: Option<usize>,
    /// The vocabulary.
    pub vocab: TinyVocab,
    /// Key/value heads.
    pub n_kv_heads: usize,
    /// MLP width.
    pub n_ff: usize,
    /// Type of the projection matrices.
    pub weight_type: GgmlType,
    /// Type of the embedding table.
    pub embd_type: GgmlType,
    /// Tie the output head to the embedding table (no `output.weight`).
    pub tied: bool,
    /// `rope.freq_base`.
    pub rope_base: f32,
    /// `context_length`.
    pub context_length: usize,
    /// gemma3: `attention.sliding_window`, `attention.sliding_window_pattern` (every
    /// `n`-th layer global) and `rope.freq_base_swa` (the local layers' RoPE base);
    /// `None`: none of these keys.
    pub sliding_window: Option<(usize, u32, f32)>,
    /// A mixture of experts instead of the dense MLP: `(experts, experts used per
    /// token, width of one expert)`. qwen3moe writes the width as
    /// `expert_feed_forward_length`; a llama file (Mixtral) has experts `n_ff` wide.
    pub experts: Option<(usize, usize, usize)>,
    /// Linear RoPE scaling: `rope.scaling.type = "linear"` and this
    /// `rope.scaling.factor`.
    pub rope_scaling: Option<f32>,
    /// qwen2moe's shared expert, this wide (`expert_shared_feed_forward_length`), with
    /// its gate vector.
    pub shared_expert: Option<usize>,
    /// A `rope_freqs.weight` tensor as Llama 3.1 has: one divisor per rotated pair,
    /// from 1 (the fastest pairs) rising to 8 (the slowest).
    pub rope_freqs: bool,
    /// Seed of the weights.
    pub seed: u64,
}

impl Default for TinyModelSpec {
    fn default() -> Self {
        TinyModelSpec {
            arch: "llama".into(),
            n_layers: 2,
            d_model: 64,
            n_heads: 4,
            head_dim: None,
            vocab: TinyVocab::ByteLevel,
            n_kv_heads: 2,
            n_ff: 128,
            weight_type: GgmlType::Q8_0,
            embd_type: GgmlType::Q8_0,
            tied: true,
            rope_base: 10000.0,
            context_length: 256,
            sliding_window: None,
            experts: None,
            rope_scaling: None,
            rope_freqs: false,
            shared_expert: None,
            seed: 1,
        }
    }
}

/// Vocabulary size of a tiny model with the byte-level vocabulary: 256 byte tokens and
/// `<|endoftext|>`.
pub const TINY_VOCAB: usize = 257;

/// Normal pieces of the tiny SentencePiece vocabulary, best score first. Scores fall by
/// one every two pieces, so equal scores (where the leftmost pair wins) are common.
const SPM_PIECES: &[&str] = &[
    "\u{2581}t",
    "he",
    "\u{2581}a",
    "in",
    "er",
    "\u{2581}the",
    "\u{2581}th",
    "on",
    "re",
    "at",
    "en",
    "nd",
    "\u{2581}s",
    "\u{2581}w",
    "ll",
    "\u{2581}o",
    "is",
    "it",
    "es",
    "or",
    "\u{2581}h",
    "lo",
    "el",
    "ell",
    "ello",
    "\u{2581}H",
    "\u{2581}He",
    "\u{2581}Hello",
    "\u{2581}wor",
    "\u{2581}world",
    "ld",
    "\u{2581}is",
    "\u{2581}in",
    "\u{2581}\u{2581}",
    "ing",
    "\u{2581}of",
    "of",
    "an",
    "\u{2581}and",
    "\u{2581}",
    "e",
    "t",
    "a",
    "o",
    "i",
    "n",
    "s",
    "h",
    "r",
    "l",
    "d",
    "u",
    "c",
    "m",
    "w",
    "y",
    "g",
    "f",
    "p",
    "b",
    "k",
    "v",
    ".",
    ",",
    "!",
    "?",
    "'",
    "T",
    "H",
    "W",
    "I",
    "\u{e9}",
    "\u{65e5}",
];

/// The tiny SentencePiece vocabulary: token texts, scores and GGUF token types.
pub fn spm_vocab() -> (Vec<String>, Vec<f32>, Vec<i32>) {
    let mut tokens: Vec<String> = ["<unk>", "<s>", "</s>"].map(String::from).to_vec();
    let mut types = vec![2, 3, 3];
    tokens.extend((0..=255u8).map(|b| format!("<0x{b:02X}>")));
    types.extend([6; 256]);
    let mut scores = vec![0.0; tokens.len()];
    for (i, piece) in SPM_PIECES.iter().enumerate() {
        tokens.push(piece.to_string());
        types.push(1);
        scores.push(-((i / 2) as f32));
    }
    for (text, ty) in [("<mask>", 4), ("<unused0>", 5)] {
        tokens.push(text.into());
        types.push(ty);
        scores.push(0.0);
    }
    (tokens, scores, types)
}

/// GPT-2's byte-to-character map: printable bytes stand for themselves, the others
/// for the characters from U+0100 on, in order.
pub fn gpt2_byte_char(byte: u8) -> char {
    let printable = |b: u8| (b'!'..=b'~').contains(&b) || (0xA1..=0xAC).contains(&b) || b >= 0xAE;
    if printable(byte) {
        return byte as char;
    }
    let n = (0..byte).filter(|&b| !printable(b)).count() as u32;
    char::from_u32(256 + n).expect("in the Latin Extended range")
}

/// A deterministic generator of uniform values (splitmix64).
struct Rng(u64);

impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in [-1, 1).
    fn uniform(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }

    fn values(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.uniform() * scale).collect()
    }
}

impl TinyModelSpec {
    /// Size of one head.
    pub fn head_dim(&self) -> usize {
        self.head_dim.unwrap_or(self.d_model / self.n_heads)
    }

    /// Tokens of the vocabulary.
    pub fn vocab_size(&self) -> usize {
        match self.vocab {
            TinyVocab::ByteLevel => TINY_VOCAB,
            TinyVocab::ByteLevelPadded(n) => n.max(TINY_VOCAB),
            TinyVocab::SentencePiece => spm_vocab().0.len(),
        }
    }

    /// The model as the bytes of a GGUF v3 file.
    pub fn to_gguf_bytes(&self) -> Result<Vec<u8>> {
        Ok(self.writer()?.to_bytes())
    }

    /// The model in a [`GgufWriter`], to add or change entries before writing.
    pub fn writer(&self) -> Result<GgufWriter> {
        self.build_writer(None)
    }

    /// The model with its matrices deferred ([`GgufWriter::add_tensor_deferred`]): each
    /// of the type `type_of(name, the spec's type, dims)` gives, its bytes made when the
    /// file is written with [`GgufWriter::write_streaming`]. Vectors (norms, biases)
    /// are written as usual.
    pub fn deferred_writer(&self, type_of: &TypeOf<'_>) -> Result<GgufWriter> {
        self.build_writer(Some(type_of))
    }

    fn build_writer(&self, deferred: Option<&TypeOf<'_>>) -> Result<GgufWriter> {
        let mut w = GgufWriter::new();
        let a = self.arch.as_str();
        let hd = self.head_dim();
        w.add_metadata("general.architecture", Value::String(a.into()))?;
        w.add_metadata("general.name", Value::String("tiny random model".into()))?;
        w.add_metadata(format!("{a}.block_count"), Value::U32(self.n_layers as u32))?;
        w.add_metadata(
            format!("{a}.context_length"),
            Value::U32(self.context_length as u32),
        )?;
        w.add_metadata(
            format!("{a}.embedding_length"),
            Value::U32(self.d_model as u32),
        )?;
        w.add_metadata(
            format!("{a}.feed_forward_length"),
            Value::U32(self.n_ff as u32),
        )?;
        w.add_metadata(
            format!("{a}.attention.head_count"),
            Value::U32(self.n_heads as u32),
        )?;
        w.add_metadata(
            format!("{a}.attention.head_count_kv"),
            Value::U32(self.n_kv_heads as u32),
        )?;
        w.add_metadata(format!("{a}.rope.freq_base"), Value::F32(self.rope_base))?;
        w.add_metadata(format!("{a}.rope.dimension_count"), Value::U32(hd as u32))?;
        if self.head_dim.is_some() {
            for k in ["key_length", "value_length"] {
                w.add_metadata(format!("{a}.attention.{k}"), Value::U32(hd as u32))?;
            }
        }
        w.add_metadata(
            format!("{a}.attention.layer_norm_rms_epsilon"),
            Value::F32(1e-5),
        )?;
        if let Some((window, pattern, local_base)) = self.sliding_window {
            w.add_metadata(
                format!("{a}.attention.sliding_window"),
                Value::U32(window as u32),
            )?;
            w.add_metadata(
                format!("{a}.attention.sliding_window_pattern"),
                Value::U32(pattern),
            )?;
            w.add_metadata(format!("{a}.rope.freq_base_swa"), Value::F32(local_base))?;
        }
        if let Some(factor) = self.rope_scaling {
            w.add_metadata(
                format!("{a}.rope.scaling.type"),
                Value::String("linear".into()),
            )?;
            w.add_metadata(format!("{a}.rope.scaling.factor"), Value::F32(factor))?;
        }
        if let Some((n_expert, n_used, n_ff_expert)) = self.experts {
            w.add_metadata(format!("{a}.expert_count"), Value::U32(n_expert as u32))?;
            w.add_metadata(format!("{a}.expert_used_count"), Value::U32(n_used as u32))?;
            let own_width = crate::arch::by_name(a)
                .and_then(|arch| arch.experts())
                .is_some_and(|layout| layout.own_width);
            if own_width {
                w.add_metadata(
                    format!("{a}.expert_feed_forward_length"),
                    Value::U32(n_ff_expert as u32),
                )?;
            }
            if let Some(sf) = self.shared_expert {
                w.add_metadata(
                    format!("{a}.expert_shared_feed_forward_length"),
                    Value::U32(sf as u32),
                )?;
            }
        }
        match self.vocab {
            TinyVocab::ByteLevel | TinyVocab::ByteLevelPadded(_) => {
                let mut tokens: Vec<String> =
                    (0..=255u8).map(|b| gpt2_byte_char(b).to_string()).collect();
                tokens.push("<|endoftext|>".into());
                let mut types = vec![1i32; 256];
                types.push(3);
                for i in tokens.len()..self.vocab_size() {
                    tokens.push(format!("pad{i}"));
                    types.push(1);
                }
                w.add_metadata("tokenizer.ggml.model", Value::String("gpt2".into()))?;
                w.add_metadata("tokenizer.ggml.pre", Value::String("gpt-2".into()))?;
                w.add_metadata("tokenizer.ggml.tokens", Value::Array(Array::String(tokens)))?;
                w.add_metadata("tokenizer.ggml.token_type", Value::Array(Array::I32(types)))?;
                w.add_metadata(
                    "tokenizer.ggml.merges",
                    Value::Array(Array::String(Vec::new())),
                )?;
                w.add_metadata("tokenizer.ggml.eos_token_id", Value::U32(256))?;
                w.add_metadata("tokenizer.ggml.bos_token_id", Value::U32(256))?;
                w.add_metadata("tokenizer.ggml.add_bos_token", Value::Bool(false))?;
            }
            TinyVocab::SentencePiece => {
                let (tokens, scores, types) = spm_vocab();
                w.add_metadata("tokenizer.ggml.model", Value::String("llama".into()))?;
                w.add_metadata("tokenizer.ggml.tokens", Value::Array(Array::String(tokens)))?;
                w.add_metadata("tokenizer.ggml.scores", Value::Array(Array::F32(scores)))?;
                w.add_metadata("tokenizer.ggml.token_type", Value::Array(Array::I32(types)))?;
                w.add_metadata("tokenizer.ggml.unknown_token_id", Value::U32(0))?;
                w.add_metadata("tokenizer.ggml.bos_token_id", Value::U32(1))?;
                w.add_metadata("tokenizer.ggml.eos_token_id", Value::U32(2))?;
                w.add_metadata("tokenizer.ggml.add_bos_token", Value::Bool(true))?;
                w.add_metadata("tokenizer.ggml.add_eos_token", Value::Bool(false))?;
            }
        }

        // The tensors are the architecture's, for the shape the metadata above gives.
        let config = ModelConfig::from_metadata(
            &crate::gguf::GgufFile::from_bytes(w.to_bytes())?,
            self.vocab_size(),
        )?;
        let mut rng = Rng(self.seed);
        let mut vectors = Rng(self.seed ^ 0x5555);
        let mut biases = Rng(self.seed ^ 0xaaaa);
        let mut add = |w: &mut GgufWriter, name: &str, spec: &TensorSpec| -> Result<()> {
            let dims: Vec<u64> = spec.dims.iter().map(|&d| d as u64).collect();
            if let &[n] = &dims[..] {
                let v: Vec<f32> = if spec.role.ends_with(".bias") {
                    biases.values(n as usize, 0.1)
                } else if spec.role.contains("norm") {
                    (0..n).map(|_| 1.0 + 0.1 * vectors.uniform()).collect()
                } else {
                    // A gate vector (qwen2moe's shared expert's).
                    biases.values(n as usize, 1.0 / (n as f32).sqrt())
                };
                return w.add_tensor_f32(name, &dims, &v);
            }
            let ty = match spec.role {
                TOKEN_EMBD => self.embd_type,
                // The router in f32, as converted files have it.
                FFN_GATE_INP => GgmlType::F32,
                _ => self.weight_type,
            };
            if let Some(type_of) = deferred {
                return w.add_tensor_deferred(name, type_of(name, ty, &dims), &dims);
            }
            let n = dims.iter().product::<u64>() as usize;
            let values = rng.values(n, 1.0 / (dims[0] as f32).sqrt());
            w.add_tensor(name, ty, &dims, quant::quantize(ty, &values)?)
        };
        // The file has what the architecture requires, and an output head unless tied.
        let written = |spec: &TensorSpec| spec.required || (spec.role == OUTPUT && !self.tied);
        for spec in config.arch.global_tensors(&config) {
            if written(&spec) {
                add(&mut w, spec.role, &spec)?;
            }
        }
        for l in 0..self.n_layers {
            let mut table = config.arch.layer_tensors(&config, l);
            table.sort_by_key(|s| {
                WRITE_ORDER
                    .iter()
                    .position(|r| *r == s.role)
                    .unwrap_or(WRITE_ORDER.len())
            });
            for spec in table.iter().filter(|s| written(s)) {
                add(&mut w, &format!("blk.{l}.{}", spec.role), spec)?;
            }
        }
        if self.rope_freqs {
            let pairs = hd / 2;
            let factors: Vec<f32> = (0..pairs)
                .map(|i| {
                    let x = i as f32 / (pairs - 1).max(1) as f32;
                    1.0 + 7.0 * x * x
                })
                .collect();
            w.add_tensor_f32("rope_freqs.weight", &[pairs as u64], &factors)?;
        }
        Ok(w)
    }
}

/// The GPU context tests share, or `None` with the reason printed, where the machine
/// has no wgpu adapter. Under CI (`CI` set) a missing adapter is a failure, not a skip:
/// CI installs one (Mesa's lavapipe), so a test that would silently skip there panics.
#[cfg(feature = "gpu")]
pub fn gpu_for_tests() -> Option<std::sync::Arc<crate::gpu::GpuContext>> {
    use std::sync::{Arc, OnceLock};
    static CTX: OnceLock<Option<Arc<crate::gpu::GpuContext>>> = OnceLock::new();
    CTX.get_or_init(|| match crate::gpu::GpuContext::new() {
        Ok(ctx) => {
            eprintln!("wgpu adapter: {}", ctx.adapter());
            Some(ctx)
        }
        Err(e) if std::env::var_os("CI").is_some() => {
            panic!("CI needs a wgpu adapter (install mesa-vulkan-drivers): {e}")
        }
        Err(e) => {
            eprintln!("skipped: {e}");
            None
        }
    })
    .clone()
}

/// The tiny models whose first-step logits were also computed by llama.cpp (recorded
/// in `tests/data/llama_cpp_logits.json`; `cargo xtask tiny-model NAME FILE` writes
/// one): `llama-spm` (the TinyLlama / Mistral layout: llama with the SentencePiece
/// vocabulary), `qwen3` (per-head Q/K norm, a head size that is not
/// `d_model / n_heads`) and `gemma3` (three layers, the middle one global, the others
/// with a window of 4 tokens and their own RoPE base, so ten tokens cross the window),
/// `qwen3moe` (eight experts of 32, two per token) and `mixtral` (llama with four
/// experts as wide as `n_ff`, two per token).
/// F32 weights, so no activation is quantized on either side.
pub fn reference_spec(name: &str) -> Option<TinyModelSpec> {
    let base = TinyModelSpec {
        weight_type: GgmlType::F32,
        embd_type: GgmlType::F32,
        vocab: TinyVocab::SentencePiece,
        tied: false,
        seed: 13,
        ..TinyModelSpec::default()
    };
    match name {
        "llama-spm" => Some(base),
        "qwen3" => Some(TinyModelSpec {
            arch: "qwen3".into(),
            head_dim: Some(32),
            rope_base: 1_000_000.0,
            tied: true,
            ..base.clone()
        }),
        "gemma3" => Some(TinyModelSpec {
            arch: "gemma3".into(),
            n_layers: 3,
            head_dim: Some(32),
            rope_base: 1_000_000.0,
            sliding_window: Some((4, 2, 10_000.0)),
            tied: true,
            ..base
        }),
        // Eight experts of 32, two per token, after qwen3's attention.
        "qwen3moe" => Some(TinyModelSpec {
            arch: "qwen3moe".into(),
            head_dim: Some(32),
            rope_base: 1_000_000.0,
            experts: Some((8, 2, 32)),
            ..base.clone()
        }),
        // gemma3 with linear RoPE scaling (4B and larger): global layers' angles / 8.
        "gemma3-scaled" => Some(TinyModelSpec {
            arch: "gemma3".into(),
            n_layers: 3,
            head_dim: Some(32),
            rope_base: 1_000_000.0,
            sliding_window: Some((4, 2, 10_000.0)),
            rope_scaling: Some(8.0),
            tied: true,
            seed: 14,
            ..base.clone()
        }),
        // Llama 3.1's layout: llama with per-pair RoPE frequency factors.
        "llama-freqs" => Some(TinyModelSpec {
            rope_freqs: true,
            rope_base: 500_000.0,
            seed: 15,
            ..base.clone()
        }),
        // Qwen1.5-MoE's layout: qwen2's attention (biases), eight experts of 32, two
        // per token, not renormalized, and a shared expert of 96 behind a sigmoid gate.
        "qwen2moe" => Some(TinyModelSpec {
            arch: "qwen2moe".into(),
            rope_base: 1_000_000.0,
            experts: Some((8, 2, 32)),
            shared_expert: Some(96),
            seed: 16,
            ..base.clone()
        }),
        // Mixtral's layout: llama with four experts as wide as n_ff, two per token.
        "mixtral" => Some(TinyModelSpec {
            experts: Some((4, 2, 128)),
            ..base
        }),
        _ => None,
    }
}

/// Names [`reference_spec`] knows.
pub const REFERENCE_SPECS: &[&str] = &[
    "llama-spm",
    "qwen3",
    "gemma3",
    "qwen3moe",
    "mixtral",
    "gemma3-scaled",
    "llama-freqs",
    "qwen2moe",
];

/// Deterministic values in [-scale, scale) from a seed (xorshift), for tests.
pub fn seeded_values(seed: u64, n: usize, scale: f32) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
        })
        .collect()
}

/// A `rows × cols` weight of `ty` named `name`, of [`seeded_values`] in [-1, 1).
pub fn seeded_weight(
    name: &str,
    ty: crate::ggml_type::GgmlType,
    rows: usize,
    cols: usize,
    seed: u64,
) -> crate::weights::Weight {
    let bytes = crate::quant::quantize(ty, &seeded_values(seed, rows * cols, 1.0))
        .expect("a weight type and whole blocks");
    crate::weights::Weight {
        name: name.to_string(),
        id: crate::weights::WeightId::fresh(),
        ty,
        dims: vec![cols, rows],
        bytes: crate::weights::WeightBytes::from_vec(bytes),
    }
}
