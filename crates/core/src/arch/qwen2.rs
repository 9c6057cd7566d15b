//! qwen2 (Qwen2, Qwen2.5): llama's graph with Q/K/V biases and NeoX-style RoPE.

use super::{llama, Arch, Pass, TensorSpec};
use crate::backend::RopeStyle;
use crate::config::ModelConfig;
use crate::ffn::FeedForward;
use crate::graph::Graph;

/// Qwen2 and Qwen2.5.
pub(super) struct Qwen2;

impl Arch for Qwen2 {
    fn name(&self) -> &'static str {
        "qwen2"
    }

    fn rope_style(&self) -> RopeStyle {
        RopeStyle::Neox
    }

    fn layer_tensors(&self, config: &ModelConfig, layer: usize) -> Vec<TensorSpec> {
        llama::layer_tensors(config, layer, true)
    }

    fn build(&self, config: &ModelConfig, pass: &Pass<'_>, ffn: &dyn FeedForward) -> Graph {
        llama::build(config, pass, ffn)
    }
}
