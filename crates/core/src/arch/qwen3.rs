//! qwen3 (Qwen3): qwen2 without the biases, with an RMSNorm of each query and key head
//! before RoPE and the head size from `attention.key_length`.

use super::{llama, Arch, Pass, TensorSpec};
use crate::backend::RopeStyle;
use crate::config::ModelConfig;
use crate::ffn::FeedForward;
use crate::graph::Graph;

/// Qwen3.
pub(super) struct Qwen3;

impl Arch for Qwen3 {
    fn name(&self) -> &'static str {
        "qwen3"
    }

    fn rope_style(&self) -> RopeStyle {
        RopeStyle::Neox
    }

    fn qk_norm(&self) -> bool {
        true
    }

    fn layer_tensors(&self, config: &ModelConfig, layer: usize) -> Vec<TensorSpec> {
        llama::layer_tensors(config, layer, false)
    }

    fn build(&self, config: &ModelConfig, pass: &Pass<'_>, ffn: &dyn FeedForward) -> Graph {
        llama::build(config, pass, ffn)
    }
}
