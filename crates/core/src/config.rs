//! Model hyper-parameters, read from the GGUF metadata (never from constants).

use crate::backend::{AttentionShape, Rope, RopeStyle};
use crate::blocks::{Activation, AttentionSpec};
use crate::error::{Error, Result};
use crate::gguf::{Array, GgufFile, Value};

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
    /// Gemma 3: embeddings scaled by `sqrt(d_model)`, per-head Q/K norm, norms after
    /// attention and after the MLP as well as before, a GELU-gated MLP, queries scaled
    /// before attention, sliding-window layers interleaved with global ones (each kind
    /// with its RoPE base), NeoX RoPE, tied output.
    Gemma3,
    /// Qwen3-MoE: qwen3's attention, and a mixture-of-experts MLP in every layer.
    Qwen3Moe,
    /// Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): qwen2's attention, and a mixture of
    /// experts whose weights are not renormalized, plus a shared expert gated by a
    /// sigmoid.
    Qwen2Moe,
}

impl Architecture {
    /// The `general.architecture` string.
    pub fn name(self) -> &'static str {
        match self {
            Architecture::Llama => "llama",
            Architecture::Qwen2 => "qwen2",
            Architecture::Qwen3 => "qwen3",
            Architecture::Gemma3 => "gemma3",
            Architecture::Qwen3Moe => "qwen3moe",
            Architecture::Qwen2Moe => "qwen2moe",
        }
    }

    /// The RoPE pairing llama.cpp's rope-type table gives this architecture.
    pub fn rope_style(self) -> RopeStyle {
        match self {
            Architecture::Llama => RopeStyle::Normal,
            Architecture::Qwen2
            | Architecture::Qwen3
            | Architecture::Gemma3
            | Architecture::Qwen3Moe
            | Architecture::Qwen2Moe => RopeStyle::Neox,
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
    /// RMSNorm epsilon (`{arch}.attention.layer_norm_rms_epsilon`).
    pub rms_eps: f32,
    /// Context the model was trained for (`{arch}.context_length`).
    pub context_length: usize,
    /// Vocabulary size (rows of the embedding table).
    pub vocab_size: usize,
    /// How each layer attends (heads, RoPE, window), one entry per layer. There is no
    /// model-wide RoPE: gemma3's sliding layers rotate with another base than its
    /// global ones, so whatever rotates keys (a KV policy re-rotating its sinks) takes
    /// each layer's own ([`ModelConfig::layer_ropes`]).
    pub layer_attention: Vec<AttentionSpec>,
    /// The activation of the gated MLP (GELU for gemma3, SiLU for the others).
    pub ffn_act: Activation,
    /// `Some(s)`: the embeddings are multiplied by `s` (gemma3: `sqrt(d_model)`).
    pub embed_scale: Option<f32>,
    /// Sliding window of the layers that have one (`{arch}.attention.sliding_window`).
    pub sliding_window: Option<usize>,
    /// The mixture of experts every layer's MLP is, if the model has one (qwen3moe; a
    /// llama file with `expert_count`: Mixtral).
    pub moe: Option<MoeSpec>,
}

/// A mixture-of-experts MLP as llama.cpp computes it for Mixtral and Qwen3-MoE: router
/// logits, softmax, the `n_expert_used` most probable experts, their probabilities
/// renormalized to sum to one (unless the file says not to) and optionally scaled, and
/// the weighted sum of those experts' SwiGLU MLPs.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MoeSpec {
    /// Experts per layer (`{arch}.expert_count`).
    pub n_expert: usize,
    /// Experts each token uses (`{arch}.expert_used_count`).
    pub n_expert_used: usize,
    /// Hidden width of one expert (`{arch}.expert_feed_forward_length`; Mixtral's
    /// experts are `feed_forward_length` wide).
    pub n_ff_expert: usize,
    /// Whether the chosen experts' probabilities are divided by their sum
    /// (`{arch}.expert_weights_norm`, true when absent, as llama.cpp has it for these
    /// architectures).
    pub norm_weights: bool,
    /// A factor on the experts' weights (`{arch}.expert_weights_scale`, none when
    /// absent, 0 or 1).
    pub weights_scale: Option<f32>,
    /// qwen2moe's shared expert, its hidden width
    /// (`{arch}.expert_shared_feed_forward_length`, default `feed_forward_length`):
    /// every token's SwiGLU MLP, times the sigmoid of a per-token gate, added to the
    /// chosen experts' sum.
    pub shared_ff: Option<usize>,
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
            "gemma3" => Architecture::Gemma3,
            "qwen3moe" => Architecture::Qwen3Moe,
            "qwen2moe" => Architecture::Qwen2Moe,
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
            freq_scale: rope_freq_scale(file, &key)?,
            freq_factors: rope_freq_factors(file, n_rot)?,
        };
        let gemma = arch == Architecture::Gemma3;
        let shape = AttentionShape::new(n_heads, n_kv_heads, head_dim);
        let spec = AttentionSpec {
            shape: if gemma {
                // llama.cpp scales the queries (below) and then the scores by 1.
                AttentionShape {
                    scale: 1.0,
                    ..shape
                }
            } else {
                shape
            },
            rope,
            qk_norm: matches!(
                arch,
                Architecture::Qwen3 | Architecture::Gemma3 | Architecture::Qwen3Moe
            )
            .then_some(rms_eps),
            q_scale: None,
        };
        let mut layer_attention = vec![spec; n_layers];
        let mut sliding_window = None;
        if gemma {
            let q_scale = gemma3_query_scale(n_layers, d_model, n_heads, head_dim);
            for spec in &mut layer_attention {
                spec.q_scale = Some(q_scale);
            }
            // Features of other gemma3 files that this pass does not compute: refused,
            // never run wrong.
            if let Some(cap) = file
                .get_f32_opt(&key("final_logit_softcapping"))?
                .filter(|&c| c != 0.0)
            {
                return Err(invalid(
                    "final_logit_softcapping",
                    format!("{cap}: logit soft-capping is not implemented"),
                ));
            }
            let window = get_opt("attention.sliding_window")?.filter(|&w| w > 0);
            if let Some(w) = window {
                if w > context_length {
                    return Err(invalid(
                        "attention.sliding_window",
                        format!("{w} is larger than the context length {context_length}"),
                    ));
                }
                let swa = swa_layers(file, &key("attention.sliding_window_pattern"), n_layers)?;
                let local_base = file
                    .get_f32_opt(&key("rope.freq_base_swa"))?
                    .unwrap_or(10000.0);
                if !(local_base.is_finite() && local_base > 0.0) {
                    return Err(invalid(
                        "rope.freq_base_swa",
                        format!("{local_base} is not a positive base"),
                    ));
                }
                for (spec, _) in layer_attention.iter_mut().zip(swa).filter(|(_, s)| *s) {
                    spec.shape.window = Some(w);
                    spec.rope.freq_base = local_base;
                    // llama.cpp scales only the global layers (its freq_scale for
                    // sliding layers is 1 in gemma3).
                    spec.rope.freq_scale = 1.0;
                }
                sliding_window = Some(w);
            }
        }
        let moe = moe_spec(file, arch, &key, n_ff)?;
        if !(freq_base.is_finite() && freq_base > 0.0) {
            return Err(invalid(
                "rope.freq_base",
                format!("{freq_base} is not a positive base"),
            ));
        }
        Ok(ModelConfig {
            arch,
            n_layers,
            d_model,
            n_ff,
            n_heads,
            n_kv_heads,
            head_dim,
            rms_eps,
            context_length,
            vocab_size,
            layer_attention,
            ffn_act: if gemma {
                Activation::GeluTanh
            } else {
                Activation::Silu
            },
            embed_scale: gemma.then(|| (d_model as f32).sqrt()),
            sliding_window,
            moe,
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

    /// The RoPE each layer rotates its queries and keys with, one per layer (from
    /// [`ModelConfig::layer_attention`]).
    pub fn layer_ropes(&self) -> Vec<Rope> {
        self.layer_attention
            .iter()
            .map(|spec| spec.rope.clone())
            .collect()
    }
}

/// The RoPE angle factor of `file`, as llama.cpp reads it: `rope.scaling.type`
/// (default linear; `none` never scales) and `rope.scaling.factor` (or the older
/// `rope.scale_linear`; 0 or absent: 1). YaRN and other types that change more than the
/// angle are refused by name.
fn rope_freq_scale(file: &GgufFile, key: &dyn Fn(&str) -> String) -> Result<f32> {
    let invalid = |k: &str, why: String| Error::InvalidHyperParameter { key: key(k), why };
    let kind = match file.get(&key("rope.scaling.type")) {
        None => "linear",
        Some(Value::String(s)) => s.as_str(),
        Some(other) => {
            return Err(invalid(
                "rope.scaling.type",
                format!("{other} is not a string"),
            ))
        }
    };
    let factor = match file.get_f32_opt(&key("rope.scaling.factor"))? {
        Some(f) => f,
        None => file.get_f32_opt(&key("rope.scale_linear"))?.unwrap_or(0.0),
    };
    match kind {
        "none" => Ok(1.0),
        _ if factor == 0.0 || factor == 1.0 => Ok(1.0),
        "linear" if factor.is_finite() && factor > 0.0 => Ok(1.0 / factor),
        "linear" => Err(invalid(
            "rope.scaling.factor",
            format!("{factor} is not a positive factor"),
        )),
        other => Err(invalid(
            "rope.scaling.type",
            format!("'{other}' RoPE scaling (factor {factor}) is not implemented (linear is)"),
        )),
    }
}

/// `rope_freqs.weight` (Llama 3.1 and later: a divisor of each rotated pair's angle),
/// if the file has it: f32, one per pair, each positive.
fn rope_freq_factors(file: &GgufFile, n_rot: usize) -> Result<Option<std::sync::Arc<[f32]>>> {
    const NAME: &str = "rope_freqs.weight";
    let Some(t) = file.tensors().iter().find(|t| t.name == NAME) else {
        return Ok(None);
    };
    let bad = |why: String| Error::InvalidHyperParameter {
        key: NAME.into(),
        why,
    };
    if t.ty != crate::ggml_type::GgmlType::F32
        || t.dims.iter().product::<u64>() != (n_rot / 2) as u64
    {
        return Err(bad(format!(
            "{} {:?}: expected f32 [{}], one per rotated pair",
            t.ty,
            t.dims,
            n_rot / 2
        )));
    }
    let factors: Vec<f32> = file
        .tensor_data(t)
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    if let Some(f) = factors.iter().find(|f| !(f.is_finite() && **f > 0.0)) {
        return Err(bad(format!("{f} is not a positive factor")));
    }
    Ok(Some(factors.into()))
}

/// The mixture of experts of `file`, read from `{arch}.expert_*` (`key` makes the
/// names): required for qwen3moe, present in a llama file that has experts (Mixtral),
/// refused elsewhere and for the variants this pass does not compute (shared experts,
/// a gating function other than softmax).
fn moe_spec(
    file: &GgufFile,
    arch: Architecture,
    key: &dyn Fn(&str) -> String,
    n_ff: usize,
) -> Result<Option<MoeSpec>> {
    let invalid = |k: &str, why: String| Error::InvalidHyperParameter { key: key(k), why };
    let n_expert = file.get_u32_opt(&key("expert_count"))?.unwrap_or(0) as usize;
    match (arch, n_expert) {
        (Architecture::Qwen3Moe | Architecture::Qwen2Moe, 0) => {
            return Err(invalid(
                "expert_count",
                format!("{} needs experts (missing or 0)", arch.name()),
            ))
        }
        (Architecture::Llama | Architecture::Qwen3Moe | Architecture::Qwen2Moe, _)
            if n_expert > 0 => {}
        (_, 0) => return Ok(None),
        (other, n) => {
            return Err(invalid(
                "expert_count",
                format!(
                "{n} experts: a mixture of experts is implemented for llama and qwen3moe, not {}",
                other.name()
            ),
            ))
        }
    }
    let n_expert_used = file.get_u32_opt(&key("expert_used_count"))?.unwrap_or(0) as usize;
    if n_expert_used == 0 || n_expert_used > n_expert {
        return Err(invalid(
            "expert_used_count",
            format!("{n_expert_used} is not between 1 and expert_count {n_expert}"),
        ));
    }
    let n_ff_expert = match (arch, file.get_u32_opt(&key("expert_feed_forward_length"))?) {
        (Architecture::Qwen3Moe | Architecture::Qwen2Moe, Some(n)) => n as usize,
        // llama.cpp's fallback when the key is absent.
        (Architecture::Qwen3Moe | Architecture::Qwen2Moe, None) => n_ff / n_expert_used,
        (_, _) => n_ff,
    };
    if n_ff_expert == 0 {
        return Err(invalid(
            "expert_feed_forward_length",
            "zero-sized experts".into(),
        ));
    }
    if let Some(n) = file
        .get_u32_opt(&key("expert_shared_count"))?
        .filter(|&n| n > 0)
    {
        return Err(invalid(
            "expert_shared_count",
            format!("{n}: shared experts are not implemented"),
        ));
    }
    // llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE: 1 softmax (the default), 2 sigmoid.
    if let Some(g) = file
        .get_u32_opt(&key("expert_gating_func"))?
        .filter(|&g| g != 1)
    {
        return Err(invalid(
            "expert_gating_func",
            format!("{g}: only softmax gating (1) is implemented"),
        ));
    }
    let shared_ff = match arch {
        Architecture::Qwen2Moe => Some(
            file.get_u32_opt(&key("expert_shared_feed_forward_length"))?
                .map_or(n_ff, |n| n as usize),
        ),
        _ => None,
    };
    if shared_ff == Some(0) {
        return Err(invalid(
            "expert_shared_feed_forward_length",
            "a zero-sized shared expert".into(),
        ));
    }
    let norm_weights = match file.get(&key("expert_weights_norm")) {
        // llama.cpp renormalizes Mixtral's and qwen3moe's weights, not qwen2moe's.
        None => arch != Architecture::Qwen2Moe,
        Some(Value::Bool(b)) => *b,
        Some(other) => {
            return Err(invalid(
                "expert_weights_norm",
                format!("{other} is not a bool"),
            ))
        }
    };
    let weights_scale = file
        .get_f32_opt(&key("expert_weights_scale"))?
        .filter(|&s| s != 0.0 && s != 1.0);
    if let Some(s) = weights_scale.filter(|s| !s.is_finite()) {
        return Err(invalid(
            "expert_weights_scale",
            format!("{s} is not finite"),
        ));
    }
    Ok(Some(MoeSpec {
        n_expert,
        n_expert_used,
        n_ff_expert,
        norm_weights,
        weights_scale,
        shared_ff,
    }))
}

/// The query scale of gemma3, as llama.cpp derives it (no GGUF key holds it):
/// `1/sqrt(head_dim)`, except for the 27B model (62 layers), whose
/// `query_pre_attn_scalar` is `d_model / n_heads`.
fn gemma3_query_scale(n_layers: usize, d_model: usize, n_heads: usize, head_dim: usize) -> f32 {
    if n_layers == 62 {
        1.0 / ((d_model / n_heads) as f32).sqrt()
    } else {
        1.0 / (head_dim as f32).sqrt()
    }
}

/// Which layers use the sliding window, as llama.cpp reads `key`
/// (`{arch}.attention.sliding_window_pattern`): an array of one bool per layer, or a
/// period `n` (default 6) where layer `i` slides unless `i % n == n - 1` (`n = 0`: all
/// slide).
fn swa_layers(file: &GgufFile, key: &str, n_layers: usize) -> Result<Vec<bool>> {
    let invalid = |why: String| Error::InvalidHyperParameter {
        key: key.to_string(),
        why,
    };
    if let Some(Value::Array(Array::Bool(v))) = file.get(key) {
        if v.len() != n_layers {
            return Err(invalid(format!(
                "{} entries for {n_layers} layers",
                v.len()
            )));
        }
        return Ok(v.clone());
    }
    let n = file.get_u32_opt(key)?.unwrap_or(6) as usize;
    Ok((0..n_layers).map(|i| n == 0 || i % n < n - 1).collect())
}
