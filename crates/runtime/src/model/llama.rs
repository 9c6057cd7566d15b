//! The llama builder (Llama 2/3, SmolLM2, TinyLlama, Mistral; qwen2 is the same graph
//! with Q/K/V biases, which [`blocks::attention`] adds when a layer has them; qwen3 is
//! the same graph with the per-head Q/K norm its attention spec asks for, and no
//! biases; Mixtral and qwen3moe are llama and qwen3 with a mixture of experts for the
//! MLP, which the model's MLP lever, `ffn::for_config`, emits): the layer table it reads
//! and the pass it emits.
//!
//! ```text
//! embed
//! per layer: x += attn_output(attention(rope([head_norm](q, k)), v of rms_norm(x)))
//!            x += ffn(rms_norm(x))
//! logits = output(rms_norm(x))
//! ```

use super::blocks::{self, *};
use super::{HeadRows, ModelConfig, TensorSpec};
use crate::ffn::FeedForward;
use crate::graph::{Graph, Op, WeightRef};

/// The tensors of layer `layer`: role, shape in ggml order, whether the file must have
/// it.
pub(super) fn layer_tensors(c: &ModelConfig, layer: usize) -> Vec<TensorSpec> {
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
        table.push(TensorSpec::optional(ATTN_Q_BIAS, &[q]));
        table.push(TensorSpec::optional(ATTN_K_BIAS, &[kv]));
        table.push(TensorSpec::optional(ATTN_V_BIAS, &[kv]));
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

/// The pass over `n` tokens.
pub(super) fn build(
    c: &ModelConfig,
    n: usize,
    head: Option<&HeadRows>,
    greedy: bool,
    policy_between_layers: bool,
    ffn: &dyn FeedForward,
) -> Graph {
    let mut g = Graph::new(n);
    let x = g.tensor("x", n, c.d_model);
    g.push(Op::Embed {
        table: WeightRef::global(TOKEN_EMBD),
        out: x,
    });
    for (layer, spec) in c.layer_attention.iter().enumerate() {
        g.push(Op::BeginLayer { layer });
        let h = blocks::rms_norm(
            &mut g,
            x,
            WeightRef::layer(ATTN_NORM),
            c.rms_eps,
            "attn_norm",
        );
        if ffn.needs_prepare() {
            g.push(Op::FfnPrepare { layer, x: h });
        }
        let attn = blocks::attention(&mut g, layer, h, spec, policy_between_layers);
        g.push(Op::Add { x, y: attn });
        let h = blocks::rms_norm(&mut g, x, WeightRef::layer(FFN_NORM), c.rms_eps, "ffn_norm");
        let out = g.scratch("ffn_out", n, c.d_model);
        ffn.emit_ops(&mut g, layer, h, c.n_ff, out);
        g.push(Op::Add { x, y: out });
        g.push(Op::EndLayer);
    }
    if let Some(rows) = head {
        let out = blocks::head(&mut g, x, rows, c.rms_eps, c.vocab_size);
        g.set_output(out, greedy);
    }
    g
}
