//! Architectures: one [`Arch`] per `general.architecture`, each in its own file,
//! listed once in [`ARCHITECTURES`]. An architecture says what it reads from the
//! metadata beyond the keys every transformer has ([`Arch::configure`]), which tensors
//! a file of it holds ([`Arch::global_tensors`], [`Arch::layer_tensors`]) and the pass
//! it computes ([`Arch::build`], composed from [`crate::blocks`]). Config parsing, the
//! weight loader, the model and the test-model writer all go through it, so a new
//! architecture whose ops exist is one new file here plus its tests.
//!
//! ```
//! use ballast_core::arch;
//!
//! let llama = arch::by_name("llama").unwrap();
//! assert_eq!(llama.name(), "llama");
//! assert!(arch::by_name("mamba").is_none());
//! ```

mod gemma3;
mod llama;
mod qwen2;
mod qwen2moe;
mod qwen3;
mod qwen3moe;

use crate::backend::RopeStyle;
use crate::blocks::{HeadRows, OUTPUT, OUTPUT_NORM, TOKEN_EMBD};
use crate::config::{ArchKeys, ModelConfig};
use crate::error::Result;
use crate::ffn::FeedForward;
use crate::graph::Graph;

/// Every architecture the forward pass implements: the one list a new one joins.
pub static ARCHITECTURES: &[&dyn Arch] = &[
    &llama::Llama,
    &qwen2::Qwen2,
    &qwen3::Qwen3,
    &gemma3::Gemma3,
    &qwen3moe::Qwen3Moe,
    &qwen2moe::Qwen2Moe,
];

/// The architecture whose `general.architecture` string is `name`.
pub fn by_name(name: &str) -> Option<&'static dyn Arch> {
    ARCHITECTURES.iter().copied().find(|a| a.name() == name)
}

/// The names of [`ARCHITECTURES`], comma-separated (for error messages).
pub fn names() -> String {
    let names: Vec<&str> = ARCHITECTURES.iter().map(|a| a.name()).collect();
    names.join(", ")
}

/// One model architecture (llama.cpp's `src/models/<arch>.cpp` and its rows of the
/// tensor and hyper-parameter tables).
pub trait Arch: Send + Sync {
    /// The `general.architecture` string; also the prefix of its metadata keys.
    fn name(&self) -> &'static str;

    /// The RoPE pairing llama.cpp's rope-type table gives this architecture.
    fn rope_style(&self) -> RopeStyle;

    /// Whether each query and key head is RMS-normed (`attn_q_norm`, `attn_k_norm`)
    /// before RoPE.
    fn qk_norm(&self) -> bool {
        false
    }

    /// The mixture of experts this architecture's MLP may be; `None`: a file with
    /// experts is refused.
    fn experts(&self) -> Option<ExpertLayout> {
        None
    }

    /// Reads what this architecture has beyond the keys every transformer has (window,
    /// query scale, activation, embedding scale) into `config`, which holds what those
    /// keys say, every layer alike; refuses by key what its pass does not compute.
    fn configure(&self, keys: &ArchKeys<'_>, config: &mut ModelConfig) -> Result<()> {
        let _ = (keys, config);
        Ok(())
    }

    /// The tensors outside the blocks. The default is the head every architecture
    /// here ends in ([`head_tensors`]).
    fn global_tensors(&self, config: &ModelConfig) -> Vec<TensorSpec> {
        head_tensors(config)
    }

    /// The tensors of layer `layer`, by role (the GGUF name without `blk.N.`).
    fn layer_tensors(&self, config: &ModelConfig, layer: usize) -> Vec<TensorSpec>;

    /// The ops of `pass`, with `ffn` emitting each layer's MLP.
    fn build(&self, config: &ModelConfig, pass: &Pass<'_>, ffn: &dyn FeedForward) -> Graph;
}

impl std::fmt::Debug for dyn Arch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Two architectures are the same when their names are: there is one of each.
impl PartialEq for dyn Arch {
    fn eq(&self, other: &Self) -> bool {
        self.name() == other.name()
    }
}

/// What a pass is built for besides the model.
#[derive(Clone, Copy, Debug)]
pub struct Pass<'a> {
    /// Tokens of the pass.
    pub tokens: usize,
    /// The rows the head computes logits for; `None`: no head.
    pub head: Option<&'a HeadRows>,
    /// Only the argmax of the logits is wanted.
    pub greedy: bool,
    /// A KV policy acts between layers (a host sync point after each KV write).
    pub policy_between_layers: bool,
}

/// The mixture of experts an architecture's MLP may be, and how its metadata says so.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExpertLayout {
    /// A file must have experts (`expert_count` > 0); else it may (llama: Mixtral).
    pub required: bool,
    /// One expert's width is `expert_feed_forward_length` (else
    /// `feed_forward_length`, as Mixtral's).
    pub own_width: bool,
    /// A shared expert behind a sigmoid gate, beside the chosen ones (qwen2moe).
    pub shared_expert: bool,
    /// The chosen experts' weights are divided by their sum when
    /// `expert_weights_norm` is absent.
    pub renormalize: bool,
}

/// One tensor of an architecture's table: its role (the GGUF name, without the
/// `blk.N.` prefix in a layer), its shape in ggml order, and whether the file must
/// have it.
#[derive(Clone, Debug)]
pub struct TensorSpec {
    /// `attn_q.weight`, `attn_q.bias`, ...
    pub role: &'static str,
    /// Shape in ggml order; one dimension means a vector (dequantized to f32).
    pub dims: Vec<usize>,
    /// False for tensors a file may lack (a llama file's biases, an output head tied
    /// to the embedding table).
    pub required: bool,
}

impl TensorSpec {
    /// A tensor the file must have.
    pub fn required(role: &'static str, dims: &[usize]) -> TensorSpec {
        TensorSpec {
            role,
            dims: dims.to_vec(),
            required: true,
        }
    }

    /// A tensor read when the file has it.
    pub fn optional(role: &'static str, dims: &[usize]) -> TensorSpec {
        TensorSpec {
            required: false,
            ..TensorSpec::required(role, dims)
        }
    }
}

/// The tensors of the head every architecture here ends in ([`crate::blocks::head`]):
/// the embedding table, the output head (absent when tied to the embedding table,
/// which then serves as both) and the final norm.
pub fn head_tensors(c: &ModelConfig) -> Vec<TensorSpec> {
    let (d, vocab) = (c.d_model, c.vocab_size);
    vec![
        TensorSpec::required(TOKEN_EMBD, &[d, vocab]),
        TensorSpec::optional(OUTPUT, &[d, vocab]),
        TensorSpec::required(OUTPUT_NORM, &[d]),
    ]
}
