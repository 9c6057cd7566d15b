//! qwen3moe (Qwen3-30B-A3B, Qwen3-235B-A22B): qwen3's attention, and a mixture of
//! experts in every layer whose chosen weights are renormalized.

use super::{llama, Arch, ExpertLayout, Pass, TensorSpec};
use crate::backend::RopeStyle;
use crate::config::ModelConfig;
use crate::ffn::FeedForward;
use crate::graph::Graph;

/// Qwen3-MoE.
pub(super) struct Qwen3Moe;

impl Arch for Qwen3Moe {
    fn name(&self) -> &'static str {
        "qwen3moe"
    }

    fn rope_style(&self) -> RopeStyle {
        RopeStyle::Neox
    }

    fn qk_norm(&self) -> bool {
        true
    }

    fn experts(&self) -> Option<ExpertLayout> {
        Some(ExpertLayout {
            required: true,
            own_width: true,
            shared_expert: false,
            renormalize: true,
        })
    }

    fn layer_tensors(&self, config: &ModelConfig, layer: usize) -> Vec<TensorSpec> {
        llama::layer_tensors(config, layer, false)
    }

    fn build(&self, config: &ModelConfig, pass: &Pass<'_>, ffn: &dyn FeedForward) -> Graph {
        llama::build(config, pass, ffn)
    }
}
