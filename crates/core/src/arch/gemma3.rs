//! gemma3 (Gemma 3), as llama.cpp's `src/models/gemma3.cpp` composes it from the same
//! shared blocks as llama: embeddings scaled by `sqrt(d_model)`, per-head Q/K norm,
//! norms after attention and after the MLP as well as before, a GELU-gated MLP, queries
//! scaled before attention, sliding-window layers interleaved with global ones (each
//! kind with its RoPE base), NeoX RoPE, tied output.
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

use super::{Arch, Pass, TensorSpec};
use crate::backend::RopeStyle;
use crate::blocks::{self, *};
use crate::config::{ArchKeys, ModelConfig};
use crate::error::Result;
use crate::ffn::FeedForward;
use crate::gguf::{Array, Value};
use crate::graph::{Graph, Op, WeightRef};

/// Gemma 3.
pub(super) struct Gemma3;

impl Arch for Gemma3 {
    fn name(&self) -> &'static str {
        "gemma3"
    }

    fn rope_style(&self) -> RopeStyle {
        RopeStyle::Neox
    }

    fn qk_norm(&self) -> bool {
        true
    }

    fn configure(&self, keys: &ArchKeys<'_>, c: &mut ModelConfig) -> Result<()> {
        let q_scale = query_scale(c.n_layers, c.d_model, c.n_heads, c.head_dim);
        for spec in &mut c.layer_attention {
            // llama.cpp scales the queries and then the scores by 1.
            spec.shape.scale = 1.0;
            spec.q_scale = Some(q_scale);
        }
        // Features of other gemma3 files that this pass does not compute: refused,
        // never run wrong.
        if let Some(cap) = keys
            .f32_opt("final_logit_softcapping")?
            .filter(|&c| c != 0.0)
        {
            return Err(keys.invalid(
                "final_logit_softcapping",
                format!("{cap}: logit soft-capping is not implemented"),
            ));
        }
        let window = keys
            .usize_opt("attention.sliding_window")?
            .filter(|&w| w > 0);
        if let Some(w) = window {
            if w > c.context_length {
                return Err(keys.invalid(
                    "attention.sliding_window",
                    format!("{w} is larger than the context length {}", c.context_length),
                ));
            }
            let swa = swa_layers(keys, c.n_layers)?;
            let local_base = keys.f32_opt("rope.freq_base_swa")?.unwrap_or(10000.0);
            if !(local_base.is_finite() && local_base > 0.0) {
                return Err(keys.invalid(
                    "rope.freq_base_swa",
                    format!("{local_base} is not a positive base"),
                ));
            }
            for (spec, _) in c.layer_attention.iter_mut().zip(swa).filter(|(_, s)| *s) {
                spec.shape.window = Some(w);
                spec.rope.freq_base = local_base;
                // llama.cpp scales only the global layers (its freq_scale for sliding
                // layers is 1 in gemma3).
                spec.rope.freq_scale = 1.0;
            }
            c.sliding_window = Some(w);
        }
        c.ffn_act = Activation::GeluTanh;
        c.embed_scale = Some((c.d_model as f32).sqrt());
        Ok(())
    }

    fn layer_tensors(&self, c: &ModelConfig, layer: usize) -> Vec<TensorSpec> {
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

    fn build(&self, c: &ModelConfig, pass: &Pass<'_>, ffn: &dyn FeedForward) -> Graph {
        let eps = c.rms_eps;
        let mut g = Graph::new(pass.tokens);
        let x = blocks::embed(&mut g, pass.tokens, c.d_model, c.embed_scale);
        for (layer, spec) in c.layer_attention.iter().enumerate() {
            let h = blocks::layer_input(&mut g, layer, x, eps, ffn);
            let attn = blocks::attention(&mut g, layer, h, spec, pass.policy_between_layers);
            let post = WeightRef::layer(ATTN_POST_NORM);
            let attn = blocks::rms_norm(&mut g, attn, post, eps, "attn_post_norm");
            g.push(Op::Add { x, y: attn });
            let out = blocks::mlp(&mut g, layer, x, eps, c.n_ff, ffn);
            let post = WeightRef::layer(FFN_POST_NORM);
            let out = blocks::rms_norm(&mut g, out, post, eps, "ffn_post_norm");
            g.push(Op::Add { x, y: out });
            g.push(Op::EndLayer);
        }
        blocks::output(&mut g, x, pass.head, pass.greedy, eps, c.vocab_size);
        g
    }
}

/// The query scale of gemma3, as llama.cpp derives it (no GGUF key holds it):
/// `1/sqrt(head_dim)`, except for the 27B model (62 layers), whose
/// `query_pre_attn_scalar` is `d_model / n_heads`.
fn query_scale(n_layers: usize, d_model: usize, n_heads: usize, head_dim: usize) -> f32 {
    if n_layers == 62 {
        1.0 / ((d_model / n_heads) as f32).sqrt()
    } else {
        1.0 / (head_dim as f32).sqrt()
    }
}

/// Which layers use the sliding window, as llama.cpp reads
/// `{arch}.attention.sliding_window_pattern`: an array of one bool per layer, or a
/// period `n` (default 6) where layer `i` slides unless `i % n == n - 1` (`n = 0`: all
/// slide).
fn swa_layers(keys: &ArchKeys<'_>, n_layers: usize) -> Result<Vec<bool>> {
    const PATTERN: &str = "attention.sliding_window_pattern";
    if let Some(Value::Array(Array::Bool(v))) = keys.get(PATTERN) {
        if v.len() != n_layers {
            return Err(keys.invalid(
                PATTERN,
                format!("{} entries for {n_layers} layers", v.len()),
            ));
        }
        return Ok(v.clone());
    }
    let n = keys.usize_opt(PATTERN)?.unwrap_or(6);
    Ok((0..n_layers).map(|i| n == 0 || i % n < n - 1).collect())
}
