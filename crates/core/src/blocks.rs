//! The shared blocks architecture builders compose a pass from, as llama.cpp's graph
//! builders compose `build_norm`, `build_attn` and `build_ffn`: each appends its ops
//! to a [`Graph`] and names the tensors it reads by their GGUF role.

use crate::backend::{AttentionShape, Rope};
use crate::ffn::FeedForward;
use crate::graph::{Graph, Op, TensorId, WeightRef};

/// `attn_norm.weight`: RMSNorm scale before attention.
pub const ATTN_NORM: &str = "attn_norm.weight";
/// `attn_q.weight`: query projection.
pub const ATTN_Q: &str = "attn_q.weight";
/// `attn_k.weight`: key projection.
pub const ATTN_K: &str = "attn_k.weight";
/// `attn_v.weight`: value projection.
pub const ATTN_V: &str = "attn_v.weight";
/// `attn_q.bias` (qwen2).
pub const ATTN_Q_BIAS: &str = "attn_q.bias";
/// `attn_k.bias` (qwen2).
pub const ATTN_K_BIAS: &str = "attn_k.bias";
/// `attn_v.bias` (qwen2).
pub const ATTN_V_BIAS: &str = "attn_v.bias";
/// `attn_q_norm.weight` (qwen3, gemma3): RMSNorm scale of each query head, before RoPE.
pub const ATTN_Q_NORM: &str = "attn_q_norm.weight";
/// `attn_k_norm.weight` (qwen3, gemma3): RMSNorm scale of each key head, before RoPE.
pub const ATTN_K_NORM: &str = "attn_k_norm.weight";
/// `attn_output.weight`: attention output projection.
pub const ATTN_OUTPUT: &str = "attn_output.weight";
/// `post_attention_norm.weight` (gemma3): RMSNorm scale of the attention's output,
/// before the residual add.
pub const ATTN_POST_NORM: &str = "post_attention_norm.weight";
/// `post_ffw_norm.weight` (gemma3): RMSNorm scale of the MLP's output, before the
/// residual add.
pub const FFN_POST_NORM: &str = "post_ffw_norm.weight";
/// `ffn_norm.weight`: RMSNorm scale before the MLP.
pub const FFN_NORM: &str = "ffn_norm.weight";
/// `ffn_gate.weight`: MLP gate projection.
pub const FFN_GATE: &str = "ffn_gate.weight";
/// `ffn_up.weight`: MLP up projection.
pub const FFN_UP: &str = "ffn_up.weight";
/// `ffn_down.weight`: MLP down projection.
pub const FFN_DOWN: &str = "ffn_down.weight";
/// Mixture of experts, qwen2moe's shared expert: the gate's weights (`[d_model]`: one
/// logit per token, through a sigmoid).
pub const FFN_GATE_INP_SHEXP: &str = "ffn_gate_inp_shexp.weight";
/// The shared expert's gate projection (`[d_model, n_ff_shared]`).
pub const FFN_GATE_SHEXP: &str = "ffn_gate_shexp.weight";
/// The shared expert's up projection (`[d_model, n_ff_shared]`).
pub const FFN_UP_SHEXP: &str = "ffn_up_shexp.weight";
/// The shared expert's down projection (`[n_ff_shared, d_model]`).
pub const FFN_DOWN_SHEXP: &str = "ffn_down_shexp.weight";
/// Mixture of experts: the router (`[d_model, n_expert]`: one logit per expert).
pub const FFN_GATE_INP: &str = "ffn_gate_inp.weight";
/// Mixture of experts: the experts' gate projections stacked (`[d_model, n_ff_expert,
/// n_expert]`: expert `e` is rows `e * n_ff_expert ..` of the matrix).
pub const FFN_GATE_EXPS: &str = "ffn_gate_exps.weight";
/// Mixture of experts: the experts' up projections stacked, as [`FFN_GATE_EXPS`].
pub const FFN_UP_EXPS: &str = "ffn_up_exps.weight";
/// Mixture of experts: the experts' down projections stacked (`[n_ff_expert, d_model,
/// n_expert]`).
pub const FFN_DOWN_EXPS: &str = "ffn_down_exps.weight";
/// `token_embd.weight`: the embedding table.
pub const TOKEN_EMBD: &str = "token_embd.weight";
/// `output_norm.weight`: the final RMSNorm scale.
pub const OUTPUT_NORM: &str = "output_norm.weight";
/// `output.weight`: the output head (the embedding table when tied).
pub const OUTPUT: &str = "output.weight";

/// How one layer attends: head sizes and RoPE. Read from the GGUF per layer, so an
/// architecture whose layers differ (a RoPE base per layer kind) states it here.
#[derive(Clone, Debug, PartialEq)]
pub struct AttentionSpec {
    /// Heads.
    pub shape: AttentionShape,
    /// RoPE of queries and keys.
    pub rope: Rope,
    /// `Some(eps)`: each query and key head is RMS-normed with `attn_q_norm` /
    /// `attn_k_norm` (one scale of the head size) before RoPE (qwen3, gemma3).
    pub qk_norm: Option<f32>,
    /// `Some(s)`: the queries are multiplied by `s` after RoPE (gemma3, whose scores
    /// then take a `shape.scale` of 1, as llama.cpp's graph does).
    pub q_scale: Option<f32>,
}

/// The activation of a gated MLP: `down(act(gate(x)) * up(x))`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Activation {
    /// SiLU (SwiGLU: llama, qwen).
    #[default]
    Silu,
    /// GELU, tanh approximation (GeGLU: gemma).
    GeluTanh,
}

/// The residual stream of a pass over `n` tokens (`x`, `n × d_model`): their rows of
/// the embedding table, times `scale` when the architecture scales them (gemma3).
pub fn embed(g: &mut Graph, n: usize, d_model: usize, scale: Option<f32>) -> TensorId {
    let x = g.tensor("x", n, d_model);
    g.push(Op::Embed {
        table: WeightRef::global(TOKEN_EMBD),
        out: x,
    });
    if let Some(factor) = scale {
        g.push(Op::Scale { x, factor });
    }
    x
}

/// The start of layer `layer`: its weights fetched (`BeginLayer`), the residual `x`
/// normed with `attn_norm`, and on that the MLP lever's prepare point, where a lever
/// that predicts from the attention's input starts its work. Returns the normed input.
pub fn layer_input(
    g: &mut Graph,
    layer: usize,
    x: TensorId,
    eps: f32,
    ffn: &dyn FeedForward,
) -> TensorId {
    g.push(Op::BeginLayer { layer });
    let h = rms_norm(g, x, WeightRef::layer(ATTN_NORM), eps, "attn_norm");
    if ffn.needs_prepare() {
        g.push(Op::FfnPrepare { layer, x: h });
    }
    h
}

/// The MLP of layer `layer` on the residual `x` normed with `ffn_norm`, as the lever
/// `ffn` emits it (`n_ff` hidden values per token). Returns its output (`ffn_out`).
pub fn mlp(
    g: &mut Graph,
    layer: usize,
    x: TensorId,
    eps: f32,
    n_ff: usize,
    ffn: &dyn FeedForward,
) -> TensorId {
    let d = g.desc(x).clone();
    let h = rms_norm(g, x, WeightRef::layer(FFN_NORM), eps, "ffn_norm");
    let out = g.scratch("ffn_out", d.rows, d.width);
    ffn.emit_ops(g, layer, h, n_ff, out);
    out
}

/// RMSNorm of `x` with the scale `scale`, into the scratch tensor `name`.
pub fn rms_norm(
    g: &mut Graph,
    x: TensorId,
    scale: WeightRef,
    eps: f32,
    name: &'static str,
) -> TensorId {
    let d = g.desc(x).clone();
    let out = g.scratch(name, d.rows, d.width);
    g.push(Op::RmsNorm { x, scale, eps, out });
    out
}

/// RMSNorm of each `head_dim`-wide head of each row of `x` with the scale `scale` (one
/// value per head element, shared by the heads), into the scratch tensor `name`.
pub fn head_rms_norm(
    g: &mut Graph,
    x: TensorId,
    head_dim: usize,
    scale: WeightRef,
    eps: f32,
    name: &'static str,
) -> TensorId {
    let d = g.desc(x).clone();
    let out = g.scratch(name, d.rows, d.width);
    g.push(Op::HeadRmsNorm {
        x,
        head_dim,
        scale,
        eps,
        out,
    });
    out
}

/// Self-attention of layer `layer` on the normed input `h`: q/k/v (with their biases
/// when the layer has them), the per-head Q/K norm when the spec has one, RoPE, the KV
/// write, the policy's host sync point when it
/// acts between layers, attention over the cache, and the output projection. Returns
/// the projected output (`n_tokens × width of h`).
pub fn attention(
    g: &mut Graph,
    layer: usize,
    h: TensorId,
    spec: &AttentionSpec,
    policy_between_layers: bool,
) -> TensorId {
    let n = g.desc(h).rows;
    let d = g.desc(h).width;
    let s = spec.shape;
    let (qd, kvd) = (s.n_heads * s.head_dim, s.n_kv_heads * s.head_dim);
    let q = g.scratch("q", n, qd);
    let k = g.scratch("k", n, kvd);
    let v = g.scratch("v", n, kvd);
    g.push(Op::Matmul {
        x: h,
        jobs: vec![
            (WeightRef::layer(ATTN_Q), q),
            (WeightRef::layer(ATTN_K), k),
            (WeightRef::layer(ATTN_V), v),
        ],
    });
    for (x, bias) in [(q, ATTN_Q_BIAS), (k, ATTN_K_BIAS), (v, ATTN_V_BIAS)] {
        g.push(Op::AddBias {
            x,
            bias: WeightRef::layer(bias),
        });
    }
    let (q, k) = match spec.qk_norm {
        Some(eps) => (
            head_rms_norm(
                g,
                q,
                s.head_dim,
                WeightRef::layer(ATTN_Q_NORM),
                eps,
                "q_normed",
            ),
            head_rms_norm(
                g,
                k,
                s.head_dim,
                WeightRef::layer(ATTN_K_NORM),
                eps,
                "k_normed",
            ),
        ),
        None => (q, k),
    };
    for (x, n_heads) in [(q, s.n_heads), (k, s.n_kv_heads)] {
        g.push(Op::Rope {
            x,
            n_heads,
            head_dim: s.head_dim,
            rope: spec.rope.clone(),
        });
    }
    if let Some(factor) = spec.q_scale {
        g.push(Op::Scale { x: q, factor });
    }
    g.push(Op::KvWrite { layer, k, v });
    if policy_between_layers {
        g.push(Op::KvPolicy { layer });
    }
    let attn = g.scratch("attn", n, qd);
    g.push(Op::Attention {
        layer,
        q,
        shape: s,
        out: attn,
    });
    let out = g.scratch("attn_out", n, d);
    g.push(Op::Matmul {
        x: attn,
        jobs: vec![(WeightRef::layer(ATTN_OUTPUT), out)],
    });
    out
}

/// The dense SwiGLU MLP: `out = down(silu(gate(x)) * up(x))`, `n_ff` hidden values
/// per token.
pub fn ffn_swiglu(g: &mut Graph, x: TensorId, n_ff: usize, out: TensorId) {
    ffn_gated(g, x, n_ff, Activation::Silu, out)
}

/// The dense gated MLP: `out = down(act(gate(x)) * up(x))`, `n_ff` hidden values per
/// token.
pub fn ffn_gated(g: &mut Graph, x: TensorId, n_ff: usize, act: Activation, out: TensorId) {
    let n = g.desc(x).rows;
    let gate = g.scratch("ffn_gate", n, n_ff);
    let up = g.scratch("ffn_up", n, n_ff);
    let hidden = g.scratch("ffn_hidden", n, n_ff);
    g.push(Op::Matmul {
        x,
        jobs: vec![
            (WeightRef::layer(FFN_GATE), gate),
            (WeightRef::layer(FFN_UP), up),
        ],
    });
    g.push(match act {
        Activation::Silu => Op::Swiglu {
            gate,
            up,
            out: hidden,
        },
        Activation::GeluTanh => Op::Geglu {
            gate,
            up,
            out: hidden,
        },
    });
    g.push(Op::Matmul {
        x: hidden,
        jobs: vec![(WeightRef::layer(FFN_DOWN), out)],
    });
}

/// Which rows of the residual stream the head computes logits for.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum HeadRows {
    /// Rows `first..first + rows`.
    Range {
        /// The first.
        first: usize,
        /// How many.
        rows: usize,
    },
    /// These rows, in this order (the last row of each sequence of a batched pass).
    Pick(Vec<usize>),
}

/// The end of a pass: the logits of the rows `which` of the residual stream `x`
/// ([`head`]) as the pass's output (only their argmax when `greedy`); nothing when
/// `which` is `None`.
pub fn output(
    g: &mut Graph,
    x: TensorId,
    which: Option<&HeadRows>,
    greedy: bool,
    eps: f32,
    vocab: usize,
) {
    if let Some(rows) = which {
        let logits = head(g, x, rows, eps, vocab);
        g.set_output(logits, greedy);
    }
}

/// The final norm and the output head over the rows `which` of the residual stream
/// `x`; returns the logits tensor (one row of `vocab` per row picked).
pub fn head(g: &mut Graph, x: TensorId, which: &HeadRows, eps: f32, vocab: usize) -> TensorId {
    let d = g.desc(x).clone();
    let (src, rows) = match which {
        HeadRows::Range { first: 0, rows } if *rows == d.rows => (x, *rows),
        HeadRows::Range { first, rows } => {
            let picked = g.tensor("head_rows", *rows, d.width);
            g.push(Op::Rows {
                x,
                first: *first,
                out: picked,
            });
            (picked, *rows)
        }
        HeadRows::Pick(list) => {
            let picked = g.tensor("head_rows", list.len(), d.width);
            g.push(Op::Gather {
                x,
                rows: list.clone(),
                out: picked,
            });
            (picked, list.len())
        }
    };
    let normed = rms_norm(g, src, WeightRef::global(OUTPUT_NORM), eps, "output_norm");
    let logits = g.tensor("logits", rows, vocab);
    g.push(Op::Matmul {
        x: normed,
        jobs: vec![(WeightRef::global(OUTPUT), logits)],
    });
    logits
}
