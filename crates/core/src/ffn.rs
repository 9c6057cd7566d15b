//! [`FeedForward`]: the MLP block of a transformer layer, and [`DenseFfn`], the exact
//! gated MLP (SwiGLU, or GeGLU for gemma).

use crate::backend::{Backend, MatmulJob};
use crate::blocks;
use crate::error::Result;
use crate::graph::{Graph, Op, TensorId};
use crate::weights::LayerWeights;

/// The MLP block. An implementation emits its part of the pass
/// ([`FeedForward::emit_ops`]): the dense MLP emits ops that every backend runs (a
/// device backend inside its one submission), the mixture of experts one
/// [`Op::Moe`] (likewise); the default emits a host sync point that
/// calls [`FeedForward::forward`] with the MLP input. [`FeedForward::prepare`] sees a
/// layer's attention input before attention runs (so a sparse implementation can
/// predict the active neurons and fetch them meanwhile), unless
/// [`FeedForward::needs_prepare`] says it need not.
pub trait FeedForward: Send {
    /// Emits the MLP of layer `layer` from `x` into `out` (`n_ff` hidden values per
    /// token) into `graph`. The default emits one host sync point,
    /// [`Op::FeedForward`], which calls [`FeedForward::forward`].
    fn emit_ops(&self, graph: &mut Graph, layer: usize, x: TensorId, n_ff: usize, out: TensorId) {
        let _ = n_ff;
        graph.push(Op::FeedForward { layer, x, out });
    }

    /// True if [`FeedForward::prepare`] must see each layer's attention input, a host
    /// sync point before attention ([`Op::FfnPrepare`]). The default is true.
    fn needs_prepare(&self) -> bool {
        true
    }

    /// Starts any work that can overlap attention. The default does nothing.
    fn prepare(&mut self, layer: usize, attn_input: &[f32], n_tokens: usize) -> Result<()> {
        let _ = (layer, attn_input, n_tokens);
        Ok(())
    }

    /// `out = down(silu(gate(x)) * up(x))` for `n_tokens` rows of `x`, or an
    /// approximation of it that the implementation documents.
    fn forward(
        &mut self,
        backend: &dyn Backend,
        weights: &LayerWeights,
        x: &[f32],
        n_tokens: usize,
        out: &mut [f32],
    ) -> Result<()>;
}

/// The MLP `config` describes: [`crate::moe::MoeFfn`] for a mixture of experts, else
/// the [`DenseFfn`] with the model's activation.
pub fn for_config(config: &crate::ModelConfig) -> Box<dyn FeedForward> {
    match config.moe {
        Some(spec) => Box::new(crate::moe::MoeFfn::new(spec)),
        None => Box::new(DenseFfn::with_activation(config.ffn_act)),
    }
}

/// Hidden-layer buffers of [`gated_mlp`], kept between calls so decode allocates
/// nothing.
#[derive(Debug, Default)]
pub struct MlpScratch {
    gate: Vec<f32>,
    up: Vec<f32>,
    hidden: Vec<f32>,
}

/// `out = down(act(gate(x)) * up(x))` for `n_tokens` rows of `x` on `backend`: the gated
/// MLP of the dense lever, of each expert of a mixture and of its shared expert.
#[allow(clippy::too_many_arguments)]
pub fn gated_mlp(
    backend: &dyn Backend,
    gate: &crate::weights::Weight,
    up: &crate::weights::Weight,
    down: &crate::weights::Weight,
    act: blocks::Activation,
    x: &[f32],
    n_tokens: usize,
    scratch: &mut MlpScratch,
    out: &mut [f32],
) -> Result<()> {
    let n_ff = gate.rows();
    scratch.gate.resize(n_tokens * n_ff, 0.0);
    scratch.up.resize(n_tokens * n_ff, 0.0);
    scratch.hidden.resize(n_tokens * n_ff, 0.0);
    backend.matmul(
        x,
        n_tokens,
        &mut [
            MatmulJob {
                weight: gate,
                out: &mut scratch.gate,
            },
            MatmulJob {
                weight: up,
                out: &mut scratch.up,
            },
        ],
    )?;
    match act {
        blocks::Activation::Silu => {
            backend.swiglu(&scratch.gate, &scratch.up, &mut scratch.hidden)?
        }
        blocks::Activation::GeluTanh => {
            backend.geglu(&scratch.gate, &scratch.up, &mut scratch.hidden)?
        }
    }
    backend.matmul(
        &scratch.hidden,
        n_tokens,
        &mut [MatmulJob { weight: down, out }],
    )
}

/// The exact MLP: every neuron, every token. It emits its ops into the pass
/// ([`blocks::ffn_swiglu`]); [`FeedForward::forward`] computes the same on host slices
/// for callers outside a pass.
#[derive(Debug, Default)]
pub struct DenseFfn {
    act: blocks::Activation,
    scratch: MlpScratch,
}

impl DenseFfn {
    /// A dense SwiGLU MLP with empty scratch buffers (they grow on first use).
    pub fn new() -> DenseFfn {
        DenseFfn::default()
    }

    /// A dense MLP with the activation `act` ([`crate::ModelConfig::ffn_act`]).
    pub fn with_activation(act: blocks::Activation) -> DenseFfn {
        DenseFfn {
            act,
            ..DenseFfn::default()
        }
    }
}

impl FeedForward for DenseFfn {
    fn emit_ops(&self, graph: &mut Graph, _layer: usize, x: TensorId, n_ff: usize, out: TensorId) {
        blocks::ffn_gated(graph, x, n_ff, self.act, out);
    }

    fn needs_prepare(&self) -> bool {
        false
    }

    fn forward(
        &mut self,
        backend: &dyn Backend,
        weights: &LayerWeights,
        x: &[f32],
        n_tokens: usize,
        out: &mut [f32],
    ) -> Result<()> {
        gated_mlp(
            backend,
            weights.matrix(blocks::FFN_GATE)?,
            weights.matrix(blocks::FFN_UP)?,
            weights.matrix(blocks::FFN_DOWN)?,
            self.act,
            x,
            n_tokens,
            &mut self.scratch,
            out,
        )
    }
}
