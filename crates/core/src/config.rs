//! Model hyper-parameters, read from the GGUF metadata (never from constants).

use crate::arch::{self, Arch};
use crate::backend::{AttentionShape, Rope};
use crate::blocks::{Activation, AttentionSpec, TOKEN_EMBD};
use crate::error::{Error, Result};
use crate::gguf::{GgufFile, Value};

/// The shape and constants of a model.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    /// The architecture ([`crate::arch::ARCHITECTURES`]): its tensor tables and builder.
    pub arch: &'static dyn Arch,
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
        ModelConfig::read(file, TensorsIn::File)
    }

    /// Reads the hyper-parameters of `file`, a file of metadata alone, for a model of
    /// `vocab_size` tokens: what a writer derives a model's tensors from before it has
    /// written them. What only tensors say (`rope_freqs.weight`) is absent.
    pub fn from_metadata(file: &GgufFile, vocab_size: usize) -> Result<ModelConfig> {
        ModelConfig::read(file, TensorsIn::None { vocab_size })
    }

    /// The keys every transformer has, then what the architecture reads beyond them
    /// ([`Arch::configure`]) and its mixture of experts.
    fn read(file: &GgufFile, tensors: TensorsIn) -> Result<ModelConfig> {
        let arch_name = file.get_str("general.architecture")?;
        let arch = arch::by_name(arch_name).ok_or_else(|| Error::UnsupportedArchitecture {
            arch: arch_name.to_string(),
            supported: arch::names(),
        })?;
        let keys = ArchKeys {
            file,
            prefix: arch.name(),
        };
        let get = |k: &str| -> Result<usize> { Ok(file.get_u32(&keys.key(k))? as usize) };
        let n_layers = get("block_count")?;
        let d_model = get("embedding_length")?;
        let n_ff = get("feed_forward_length")?;
        let n_heads = get("attention.head_count")?;
        let n_kv_heads = keys
            .usize_opt("attention.head_count_kv")?
            .unwrap_or(n_heads);
        if n_heads == 0 || d_model == 0 || n_layers == 0 || n_ff == 0 {
            return Err(keys.invalid("attention.head_count", "zero-sized model".into()));
        }
        if n_kv_heads == 0 || n_heads % n_kv_heads != 0 {
            return Err(keys.invalid(
                "attention.head_count_kv",
                format!("{n_kv_heads} does not divide head_count {n_heads}"),
            ));
        }
        let head_dim = match keys.usize_opt("attention.key_length")? {
            Some(v) => v,
            None => {
                if d_model % n_heads != 0 {
                    return Err(keys.invalid(
                        "embedding_length",
                        format!("{d_model} is not a multiple of head_count {n_heads}"),
                    ));
                }
                d_model / n_heads
            }
        };
        // Keys and values share one head size in every architecture here; a file that
        // says otherwise would attend with the wrong value width.
        if let Some(v) = keys
            .usize_opt("attention.value_length")?
            .filter(|&v| v != head_dim)
        {
            return Err(keys.invalid(
                "attention.value_length",
                format!("{v} differs from the key head size {head_dim}"),
            ));
        }
        let n_rot = keys.usize_opt("rope.dimension_count")?.unwrap_or(head_dim);
        if n_rot > head_dim || n_rot % 2 != 0 || head_dim == 0 {
            return Err(keys.invalid(
                "rope.dimension_count",
                format!("{n_rot} must be even and at most the head size {head_dim}"),
            ));
        }
        let freq_base = keys.f32_opt("rope.freq_base")?.unwrap_or(10000.0);
        let rms_eps = keys
            .f32_opt("attention.layer_norm_rms_epsilon")?
            .unwrap_or(1e-5);
        let context_length = keys.usize_opt("context_length")?.unwrap_or(2048);
        let vocab_size = match tensors {
            TensorsIn::File => {
                let embd = file.tensor(TOKEN_EMBD)?;
                embd.dims.get(1).copied().unwrap_or(0) as usize
            }
            TensorsIn::None { vocab_size } => vocab_size,
        };
        let rope = Rope {
            style: arch.rope_style(),
            n_dims: n_rot,
            freq_base,
            freq_scale: rope_freq_scale(&keys)?,
            freq_factors: match tensors {
                TensorsIn::File => rope_freq_factors(file, n_rot)?,
                TensorsIn::None { .. } => None,
            },
        };
        let spec = AttentionSpec {
            shape: AttentionShape::new(n_heads, n_kv_heads, head_dim),
            rope,
            qk_norm: arch.qk_norm().then_some(rms_eps),
            q_scale: None,
        };
        let mut config = ModelConfig {
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
            layer_attention: vec![spec; n_layers],
            ffn_act: Activation::Silu,
            embed_scale: None,
            sliding_window: None,
            moe: None,
        };
        arch.configure(&keys, &mut config)?;
        config.moe = moe_spec(&keys, arch, n_ff)?;
        if !(freq_base.is_finite() && freq_base > 0.0) {
            return Err(keys.invalid(
                "rope.freq_base",
                format!("{freq_base} is not a positive base"),
            ));
        }
        Ok(config)
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
fn rope_freq_scale(keys: &ArchKeys<'_>) -> Result<f32> {
    let invalid = |k: &str, why: String| keys.invalid(k, why);
    let kind = match keys.get("rope.scaling.type") {
        None => "linear",
        Some(Value::String(s)) => s.as_str(),
        Some(other) => {
            return Err(invalid(
                "rope.scaling.type",
                format!("{other} is not a string"),
            ))
        }
    };
    let factor = match keys.f32_opt("rope.scaling.factor")? {
        Some(f) => f,
        None => keys.f32_opt("rope.scale_linear")?.unwrap_or(0.0),
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

/// The mixture of experts of the file `keys` reads, from `{arch}.expert_*`, as the
/// architecture's [`Arch::experts`] lays it out: required (qwen3moe), allowed (a llama
/// file with experts: Mixtral), or refused; the variants this pass does not compute
/// (shared experts where the layout has none, a gating function other than softmax)
/// are refused too.
fn moe_spec(keys: &ArchKeys<'_>, arch: &dyn Arch, n_ff: usize) -> Result<Option<MoeSpec>> {
    let invalid = |k: &str, why: String| keys.invalid(k, why);
    let n_expert = keys.usize_opt("expert_count")?.unwrap_or(0);
    let layout = match (arch.experts(), n_expert) {
        (Some(layout), 0) if layout.required => {
            return Err(invalid(
                "expert_count",
                format!("{} needs experts (missing or 0)", arch.name()),
            ))
        }
        (_, 0) => return Ok(None),
        (Some(layout), _) => layout,
        (None, n) => {
            let with: Vec<&str> = arch::ARCHITECTURES
                .iter()
                .filter(|a| a.experts().is_some())
                .map(|a| a.name())
                .collect();
            return Err(invalid(
                "expert_count",
                format!(
                    "{n} experts: a mixture of experts is implemented for {}, not {}",
                    with.join(", "),
                    arch.name()
                ),
            ));
        }
    };
    let n_expert_used = keys.usize_opt("expert_used_count")?.unwrap_or(0);
    if n_expert_used == 0 || n_expert_used > n_expert {
        return Err(invalid(
            "expert_used_count",
            format!("{n_expert_used} is not between 1 and expert_count {n_expert}"),
        ));
    }
    let n_ff_expert = match (
        layout.own_width,
        keys.usize_opt("expert_feed_forward_length")?,
    ) {
        (true, Some(n)) => n,
        // llama.cpp's fallback when the key is absent.
        (true, None) => n_ff / n_expert_used,
        (false, _) => n_ff,
    };
    if n_ff_expert == 0 {
        return Err(invalid(
            "expert_feed_forward_length",
            "zero-sized experts".into(),
        ));
    }
    if let Some(n) = keys.usize_opt("expert_shared_count")?.filter(|&n| n > 0) {
        return Err(invalid(
            "expert_shared_count",
            format!("{n}: shared experts are not implemented"),
        ));
    }
    // llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE: 1 softmax (the default), 2 sigmoid.
    if let Some(g) = keys.usize_opt("expert_gating_func")?.filter(|&g| g != 1) {
        return Err(invalid(
            "expert_gating_func",
            format!("{g}: only softmax gating (1) is implemented"),
        ));
    }
    let shared_ff = match layout.shared_expert {
        true => Some(
            keys.usize_opt("expert_shared_feed_forward_length")?
                .unwrap_or(n_ff),
        ),
        false => None,
    };
    if shared_ff == Some(0) {
        return Err(invalid(
            "expert_shared_feed_forward_length",
            "a zero-sized shared expert".into(),
        ));
    }
    let norm_weights = match keys.get("expert_weights_norm") {
        // llama.cpp renormalizes Mixtral's and qwen3moe's weights, not qwen2moe's.
        None => layout.renormalize,
        Some(Value::Bool(b)) => *b,
        Some(other) => {
            return Err(invalid(
                "expert_weights_norm",
                format!("{other} is not a bool"),
            ))
        }
    };
    let weights_scale = keys
        .f32_opt("expert_weights_scale")?
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

/// Where the hyper-parameters that only tensors carry come from.
#[derive(Clone, Copy)]
enum TensorsIn {
    /// The file's tensors (the vocabulary from the embedding table's rows).
    File,
    /// None: a file of metadata alone, for a model of `vocab_size` tokens.
    None { vocab_size: usize },
}

/// A file's metadata as an architecture reads it ([`Arch::configure`]): keys under the
/// architecture's prefix (`{arch}.{key}`), and errors that name them.
pub struct ArchKeys<'a> {
    file: &'a GgufFile,
    prefix: &'a str,
}

impl ArchKeys<'_> {
    /// The full name of `key`: `{arch}.{key}`.
    pub fn key(&self, key: &str) -> String {
        format!("{}.{key}", self.prefix)
    }

    /// The value of `key`, if present.
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.file.get(&self.key(key))
    }

    /// `key` as an integer that fits a u32, if present.
    pub fn usize_opt(&self, key: &str) -> Result<Option<usize>> {
        Ok(self.file.get_u32_opt(&self.key(key))?.map(|v| v as usize))
    }

    /// `key` as an f32, if present.
    pub fn f32_opt(&self, key: &str) -> Result<Option<f32>> {
        self.file.get_f32_opt(&self.key(key))
    }

    /// The error for a value of `key` this model cannot run with, and why.
    pub fn invalid(&self, key: &str, why: String) -> Error {
        Error::InvalidHyperParameter {
            key: self.key(key),
            why,
        }
    }
}
