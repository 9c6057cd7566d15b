//! qwen2moe (Qwen1.5-MoE, Qwen2-57B-A14B): qwen2's attention (biases), and a mixture of
//! experts whose weights are not renormalized, plus a shared expert gated by a
//! sigmoid.

use super::{llama, Arch, ExpertLayout, Pass, TensorSpec};
use crate::backend::RopeStyle;
use crate::config::ModelConfig;
use crate::ffn::FeedForward;
use crate::graph::Graph;

/// Qwen2-MoE.
pub(super) struct Qwen2Moe;

impl Arch for Qwen2Moe {
    fn name(&self) -> &'static str {
        "qwen2moe"
    }

    fn rope_style(&self) -> RopeStyle {
        RopeStyle::Neox
    }

    fn experts(&self) -> Option<ExpertLayout> {
        Some(ExpertLayout {
            required: true,
            own_width: true,
            shared_expert: true,
            renormalize: false,
        })
    }

    fn layer_tensors(&self, config: &ModelConfig, layer: usize) -> Vec<TensorSpec> {
        llama::layer_tensors(config, layer, true)
    }

    fn build(&self, config: &ModelConfig, pass: &Pass<'_>, ffn: &dyn FeedForward) -> Graph {
        llama::build(config, pass, ffn)
    }
}
