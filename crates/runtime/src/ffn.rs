//! [`FeedForward`]: the MLP block of a transformer layer, and [`DenseFfn`], the exact
//! SwiGLU MLP.

use crate::backend::{Backend, MatmulJob};
use crate::error::Result;
use crate::weights::LayerWeights;

/// The MLP block. The model calls [`FeedForward::prepare`] with the attention input of
/// a layer before attention runs (so a sparse implementation can predict the active
/// neurons and fetch them meanwhile), then [`FeedForward::forward`] with the MLP input.
pub trait FeedForward: Send {
    /// Starts any work that can overlap attention. The default does nothing.
    fn prepare(&mut self, layer: usize, attn_input: &[f32], n_tokens: usize) -> Result<()> {
        let _ = (layer, attn_input, n_tokens);
        Ok(())
    }

    /// True if this is exactly the dense SwiGLU MLP, so a device backend may run it
    /// inside its own recorded pass. The default is false.
    fn is_exact(&self) -> bool {
        false
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

/// The exact MLP: every neuron, every token.
#[derive(Debug, Default)]
pub struct DenseFfn {
    gate: Vec<f32>,
    up: Vec<f32>,
    hidden: Vec<f32>,
}

impl DenseFfn {
    /// A dense MLP with empty scratch buffers (they grow on first use).
    pub fn new() -> DenseFfn {
        DenseFfn::default()
    }
}

impl FeedForward for DenseFfn {
    fn is_exact(&self) -> bool {
        true
    }

    fn forward(
        &mut self,
        backend: &dyn Backend,
        weights: &LayerWeights,
        x: &[f32],
        n_tokens: usize,
        out: &mut [f32],
    ) -> Result<()> {
        let n_ff = weights.w_gate.rows();
        self.gate.resize(n_tokens * n_ff, 0.0);
        self.up.resize(n_tokens * n_ff, 0.0);
        self.hidden.resize(n_tokens * n_ff, 0.0);
        backend.matmul(
            x,
            n_tokens,
            &mut [
                MatmulJob {
                    weight: &weights.w_gate,
                    out: &mut self.gate,
                },
                MatmulJob {
                    weight: &weights.w_up,
                    out: &mut self.up,
                },
            ],
        )?;
        backend.swiglu(&self.gate, &self.up, &mut self.hidden)?;
        backend.matmul(
            &self.hidden,
            n_tokens,
            &mut [MatmulJob {
                weight: &weights.w_down,
                out,
            }],
        )
    }
}
