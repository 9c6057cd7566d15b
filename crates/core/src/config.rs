//! Model hyper-parameters, read from the GGUF metadata (never from constants).

use crate::backend::{AttentionShape, Rope, RopeStyle};
use crate::blocks::AttentionSpec;
use crate::error::{Error, Result};
use crate::gguf::GgufFile;

/// The architectures the forward pass implements.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Architecture {
    /// Llama 2/3, SmolLM2, Mistral: RMSNorm, RoPE (normal pairing), GQA, SwiGLU.
    Llama,
    /// Qwen2: as llama, plus Q/K/V biases and NeoX-style RoPE.
    Qwen2,
    /// Qwen3: as qwen2 without the biases, with an RMSNorm of each query and key head
    /// before RoPE and the head size from `attention.key_length`.
    Qwen3,
}

impl Architecture {
    /// The `general.architecture` string.
    pub fn name(self) -> &'static str {
        match self {
            Architecture::Llama => "llama",
            Architecture::Qwen2 => "qwen2",
            Architecture::Qwen3 => "qwen3",
        }
    }

    /// The RoPE pairing llama.cpp's rope-type table gives this architecture.
    pub fn rope_style(self) -> RopeStyle {
        match self {
            Architecture::Llama => RopeStyle::Normal,
            Architecture::Qwen2 | Architecture::Qwen3 => RopeStyle::Neox,
        }
    }
}

/// The shape and constants of a model.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    /// Architecture.
    pub arch: Architecture,
    /// Transformer blocks (`{arch}.block_count`).
    pub n_layers: usize,
    /// Width of the residual stream (`{arch}.embedding_length`).
    pub d_model: usize,
    /// MLP hidden width (`{arch}.feed_forward_length`).
    pub n_ff: usize,
    /// Query heads (`{arch}.attention.head_count`).
    pub n_heads: usize,
    /// Key/value heads (`{arch}.attention.head_count_kv`, default `n_heads`).
    pub n_kv_heads: usize,
    /// Size of one head (`{arch}.attention.key_length`, default `d_model / n_heads`).
    pub head_dim: usize,
    /// RoPE parameters.
    pub rope: Rope,
    /// RMSNorm epsilon (`{arch}.attention.layer_norm_rms_epsilon`).
    pub rms_eps: f32,
    /// Context the model was trained for (`{arch}.context_length`).
    pub context_length: usize,
    /// Vocabulary size (rows of the embedding table).
    pub vocab_size: usize,
    /// How each layer attends (heads, RoPE), one entry per layer.
    pub layer_attention: Vec<AttentionSpec>,
}

impl ModelConfig {
    /// Reads the hyper-parameters of `file`. Unknown architectures and inconsistent
    /// values give an error naming the key.
    pub fn from_gguf(file: &GgufFile) -> Result<ModelConfig> {
        let arch_name = file.get_str("general.architecture")?;
        let arch = match arch_name {
            "llama" => Architecture::Llama,
            "qwen2" => Architecture::Qwen2,
            "qwen3" => Architecture::Qwen3,
            other => {
                return Err(Error::UnsupportedArchitecture {
                    arch: other.to_string(),
                })
            }
        };
        let key = |k: &str| format!("{arch_name}.{k}");
        let get = |k: &str| -> Result<usize> { Ok(file.get_u32(&key(k))? as usize) };
        let get_opt = |k: &str| -> Result<Option<usize>> {
            Ok(file.get_u32_opt(&key(k))?.map(|v| v as usize))
        };
        let n_layers = get("block_count")?;
        let d_model = get("embedding_length")?;
        let n_ff = get("feed_forward_length")?;
        let n_heads = get("attention.head_count")?;
        let n_kv_heads = get_opt("attention.head_count_kv")?.unwrap_or(n_heads);
        let invalid = |k: &str, why: String| Error::InvalidHyperParameter { key: key(k), why };
        if n_heads == 0 || d_model == 0 || n_layers == 0 || n_ff == 0 {
            return Err(invalid("attention.head_count", "zero-sized model".into()));
        }
        if n_kv_heads == 0 || n_heads % n_kv_heads != 0 {
            return Err(invalid(
                "attention.head_count_kv",
                format!("{n_kv_heads} does not divide head_count {n_heads}"),
            ));
        }
        let head_dim = match get_opt("attention.key_length")? {
            Some(v) => v,
            None => {
                if d_model % n_heads != 0 {
                    return Err(invalid(
                        "embedding_length",
                        format!("{d_model} is not a multiple of head_count {n_heads}"),
                    ));
                }
                d_model / n_heads
            }
        };
        // Keys and values share one head size in every architecture here; a file that
        // says otherwise would attend with the wrong value width.
        if let Some(v) = get_opt("attention.value_length")?.filter(|&v| v != head_dim) {
            return Err(invalid(
                "attention.value_length",
                format!("{v} differs from the key head size {head_dim}"),
            ));
        }
        let n_rot = get_opt("rope.dimension_count")?.unwrap_or(head_dim);
        if n_rot > head_dim || n_rot % 2 != 0 || head_dim == 0 {
            return Err(invalid(
                "rope.dimension_count",
                format!("{n_rot} must be even and at most the head size {head_dim}"),
            ));
        }
        let freq_base = file.get_f32_opt(&key("rope.freq_base"))?.unwrap_or(10000.0);
        let rms_eps = file
            .get_f32_opt(&key("attention.layer_norm_rms_epsilon"))?
            .unwrap_or(1e-5);
        let context_length = get_opt("context_length")?.unwrap_or(2048);
        let embd = file.tensor("token_embd.weight")?;
        let vocab_size = embd.dims.get(1).copied().unwrap_or(0) as usize;
        let rope = Rope {
            style: arch.rope_style(),
            n_dims: n_rot,
            freq_base,
        };
        let spec = AttentionSpec {
            shape: AttentionShape {
                n_heads,
                n_kv_heads,
                head_dim,
            },
            rope,
            qk_norm: (arch == Architecture::Qwen3).then_some(rms_eps),
        };
        Ok(ModelConfig {
            arch,
            n_layers,
            d_model,
            n_ff,
            n_heads,
            n_kv_heads,
            head_dim,
            rope,
            rms_eps,
            context_length,
            vocab_size,
            layer_attention: vec![spec; n_layers],
        })
    }

    /// Query width: `n_heads * head_dim`.
    pub fn q_dim(&self) -> usize {
        self.n_heads * self.head_dim
    }

    /// Key/value width: `n_kv_heads * head_dim`.
    pub fn kv_dim(&self) -> usize {
        self.n_kv_heads * self.head_dim
    }
}
