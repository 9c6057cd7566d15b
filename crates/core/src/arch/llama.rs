//! llama (Llama 2/3, SmolLM2, TinyLlama, Mistral; with experts, Mixtral): RMSNorm,
//! RoPE with normal pairing, GQA, SwiGLU. Its layer table and builder are the ones the
//! qwen architectures share: qwen2 is this graph with Q/K/V biases, which
//! [`blocks::attention`] adds when a layer has them; qwen3 the same graph with the
//! per-head Q/K norm its attention spec asks for, and no biases; Mixtral, qwen3moe and
//! qwen2moe have a mixture of experts for the MLP, which the model's MLP lever
//! (`ffn::for_config`) emits.
//!
//! ```text
//! embed
//! per layer: x += attn_output(attention(rope([head_norm](q, k)), v of rms_norm(x)))
//!            x += ffn(rms_norm(x))
//! logits = output(rms_norm(x))
//! ```

use super::{Arch, ExpertLayout, Pass, TensorSpec};
use crate::backend::RopeStyle;
use crate::blocks::{self, *};
use crate::config::ModelConfig;
use crate::ffn::FeedForward;
use crate::graph::{Graph, Op};

/// Llama 2/3, SmolLM2, Mistral, and Mixtral when the file has experts.
pub(super) struct Llama;

impl Arch for Llama {
    fn name(&self) -> &'static str {
        "llama"
    }

    fn rope_style(&self) -> RopeStyle {
        RopeStyle::Normal
    }

    fn experts(&self) -> Option<ExpertLayout> {
        Some(ExpertLayout {
            required: false,
            own_width: false,
            shared_expert: false,
            renormalize: true,
        })
    }

    fn layer_tensors(&self, config: &ModelConfig, layer: usize) -> Vec<TensorSpec> {
        layer_tensors(config, layer, false)
    }

    fn build(&self, config: &ModelConfig, pass: &Pass<'_>, ffn: &dyn FeedForward) -> Graph {
        build(config, pass, ffn)
    }
}

/// The tensors of layer `layer`: the Q/K norms when the layer's attention has them,
/// else the Q/K/V biases (required when `biases`, else read if the file has them, as
/// llama.cpp reads a llama file's); the experts when the model has them.
pub(super) fn layer_tensors(c: &ModelConfig, layer: usize, biases: bool) -> Vec<TensorSpec> {
    let spec = &c.layer_attention[layer];
    let s = spec.shape;
    let (d, ff) = (c.d_model, c.n_ff);
    let (q, kv) = (s.n_heads * s.head_dim, s.n_kv_heads * s.head_dim);
    let mut table = vec![
        TensorSpec::required(ATTN_NORM, &[d]),
        TensorSpec::required(ATTN_Q, &[d, q]),
        TensorSpec::required(ATTN_K, &[d, kv]),
        TensorSpec::required(ATTN_V, &[d, kv]),
    ];
    if spec.qk_norm.is_some() {
        // qwen3: llama.cpp reads no biases there, so a file's biases are not read either.
        table.push(TensorSpec::required(ATTN_Q_NORM, &[s.head_dim]));
        table.push(TensorSpec::required(ATTN_K_NORM, &[s.head_dim]));
    } else {
        let bias = match biases {
            true => TensorSpec::required,
            false => TensorSpec::optional,
        };
        table.push(bias(ATTN_Q_BIAS, &[q]));
        table.push(bias(ATTN_K_BIAS, &[kv]));
        table.push(bias(ATTN_V_BIAS, &[kv]));
    }
    table.extend([
        TensorSpec::required(ATTN_OUTPUT, &[q, d]),
        TensorSpec::required(FFN_NORM, &[d]),
    ]);
    match c.moe {
        // Mixtral, qwen3moe: a router and the experts' matrices stacked.
        Some(m) => {
            table.extend([
                TensorSpec::required(FFN_GATE_INP, &[d, m.n_expert]),
                TensorSpec::required(FFN_GATE_EXPS, &[d, m.n_ff_expert, m.n_expert]),
                TensorSpec::required(FFN_UP_EXPS, &[d, m.n_ff_expert, m.n_expert]),
                TensorSpec::required(FFN_DOWN_EXPS, &[m.n_ff_expert, d, m.n_expert]),
            ]);
            // qwen2moe's shared expert and its gate.
            if let Some(sf) = m.shared_ff {
                table.extend([
                    TensorSpec::required(FFN_GATE_INP_SHEXP, &[d]),
                    TensorSpec::required(FFN_GATE_SHEXP, &[d, sf]),
                    TensorSpec::required(FFN_UP_SHEXP, &[d, sf]),
                    TensorSpec::required(FFN_DOWN_SHEXP, &[sf, d]),
                ]);
            }
        }
        None => table.extend([
            TensorSpec::required(FFN_GATE, &[d, ff]),
            TensorSpec::required(FFN_UP, &[d, ff]),
            TensorSpec::required(FFN_DOWN, &[ff, d]),
        ]),
    }
    table
}

/// The pass.
pub(super) fn build(c: &ModelConfig, pass: &Pass<'_>, ffn: &dyn FeedForward) -> Graph {
    let mut g = Graph::new(pass.tokens);
    let x = blocks::embed(&mut g, pass.tokens, c.d_model, None);
    for (layer, spec) in c.layer_attention.iter().enumerate() {
        let h = blocks::layer_input(&mut g, layer, x, c.rms_eps, ffn);
        let attn = blocks::attention(&mut g, layer, h, spec, pass.policy_between_layers);
        g.push(Op::Add { x, y: attn });
        let out = blocks::mlp(&mut g, layer, x, c.rms_eps, c.n_ff, ffn);
        g.push(Op::Add { x, y: out });
        g.push(Op::EndLayer);
    }
    blocks::output(&mut g, x, pass.head, pass.greedy, c.rms_eps, c.vocab_size);
    g
}
