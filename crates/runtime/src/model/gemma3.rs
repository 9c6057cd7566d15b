//! The gemma3 builder (Gemma 3): the layer table it reads and the pass it emits, from
//! the same shared blocks as llama, as llama.cpp's `src/models/gemma3.cpp` composes it.
//!
//! ```text
//! x = embed * sqrt(d_model)
//! per layer: x += post_attention_norm(attn_output(attention(
//!                  rope(head_norm(q, k)) with q * q_scale, v of rms_norm(x))))
//!            x += post_ffw_norm(ffn_down(gelu(ffn_gate(h)) * ffn_up(h))), h = rms_norm(x)
//! logits = output(rms_norm(x))   (output = token_embd when the file has no output)
//! ```
//!
//! What differs per layer sits in its attention spec (`ModelConfig::layer_attention`):
//! a sliding-window layer has its window and the local RoPE base, a global one neither.
//! The norm weights are used as stored: llama.cpp's converter has already added
//! Gemma's `1 +` to them.

use super::blocks::{self, *};
use super::{HeadRows, ModelConfig, TensorSpec};
use crate::ffn::FeedForward;
use crate::graph::{Graph, Op, WeightRef};

/// The tensors of layer `layer`: role, shape in ggml order, whether the file must have
/// it.
pub(super) fn layer_tensors(c: &ModelConfig, layer: usize) -> Vec<TensorSpec> {
    let s = c.layer_attention[layer].shape;
    let (d, ff) = (c.d_model, c.n_ff);
    let (q, kv) = (s.n_heads * s.head_dim, s.n_kv_heads * s.head_dim);
    vec![
        TensorSpec::required(ATTN_NORM, &[d]),
        TensorSpec::required(ATTN_Q, &[d, q]),
        TensorSpec::required(ATTN_K, &[d, kv]),
        TensorSpec::required(ATTN_V, &[d, kv]),
        TensorSpec::required(ATTN_Q_NORM, &[s.head_dim]),
        TensorSpec::required(ATTN_K_NORM, &[s.head_dim]),
        TensorSpec::required(ATTN_OUTPUT, &[q, d]),
        TensorSpec::required(ATTN_POST_NORM, &[d]),
        TensorSpec::required(FFN_NORM, &[d]),
        TensorSpec::required(FFN_GATE, &[d, ff]),
        TensorSpec::required(FFN_UP, &[d, ff]),
        TensorSpec::required(FFN_DOWN, &[ff, d]),
        TensorSpec::required(FFN_POST_NORM, &[d]),
    ]
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
    if let Some(factor) = c.embed_scale {
        g.push(Op::Scale { x, factor });
    }
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
        let attn = blocks::rms_norm(
            &mut g,
            attn,
            WeightRef::layer(ATTN_POST_NORM),
            c.rms_eps,
            "attn_post_norm",
        );
        g.push(Op::Add { x, y: attn });
        let h = blocks::rms_norm(&mut g, x, WeightRef::layer(FFN_NORM), c.rms_eps, "ffn_norm");
        let out = g.scratch("ffn_out", n, c.d_model);
        ffn.emit_ops(&mut g, layer, h, c.n_ff, out);
        let out = blocks::rms_norm(
            &mut g,
            out,
            WeightRef::layer(FFN_POST_NORM),
            c.rms_eps,
            "ffn_post_norm",
        );
        g.push(Op::Add { x, y: out });
        g.push(Op::EndLayer);
    }
    if let Some(rows) = head {
        let out = blocks::head(&mut g, x, rows, c.rms_eps, c.vocab_size);
        g.set_output(out, greedy);
    }
    g
}
