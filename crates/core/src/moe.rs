//! [`MoeFfn`]: the mixture-of-experts MLP of Mixtral and Qwen3-MoE, as llama.cpp
//! computes it (`build_moe_ffn` with softmax gating).
//!
//! Per token: router logits (`ffn_gate_inp`), softmax, the `n_expert_used` most probable
//! experts, their probabilities renormalized to sum to one ([`MoeSpec::norm_weights`];
//! the sum clamped below at 2^-14 as llama.cpp does) and optionally scaled, then the
//! weighted sum, in the order of the choice, of those experts' SwiGLU MLPs. Only the
//! chosen experts are computed: the tokens of a pass are grouped by expert, and each
//! chosen expert's three matrices (one matrix of each stacked tensor, see
//! [`Weight::stacked`]) multiply the rows of its tokens at once.
//!
//! In a pass it is one op, [`Op::Moe`]: the host executor calls
//! [`FeedForward::forward`] (the above); a device backend records the router, the
//! routing, the chosen experts' rows of the stacked tensors and the weighted sum inside
//! its one submission, without reading anything back.
//!
//! ```
//! use ballast_core::config::MoeSpec;
//! use ballast_core::moe::route;
//!
//! let spec = MoeSpec {
//!     n_expert: 4,
//!     n_expert_used: 2,
//!     n_ff_expert: 8,
//!     norm_weights: true,
//!     weights_scale: None,
//!     shared_ff: None,
//! };
//! // Experts 2 and 0 are the most probable; their weights are renormalized.
//! let chosen = route(&spec, &[1.0, -1.0, 2.0, 0.0]);
//! assert_eq!(chosen.iter().map(|c| c.0).collect::<Vec<_>>(), vec![2, 0]);
//! assert!((chosen[0].1 + chosen[1].1 - 1.0).abs() < 1e-6);
//! ```

use crate::backend::{Backend, MatmulJob};
use crate::blocks::{
    FFN_DOWN_EXPS, FFN_DOWN_SHEXP, FFN_GATE_EXPS, FFN_GATE_INP, FFN_GATE_INP_SHEXP, FFN_GATE_SHEXP,
    FFN_UP_EXPS, FFN_UP_SHEXP,
};
use crate::config::MoeSpec;
use crate::error::{Error, Result};
use crate::ffn::{gated_mlp, FeedForward, MlpScratch};
use crate::graph::{Graph, MoeWeights, Op, SharedExpertWeights, TensorId, WeightRef};
use crate::weights::{LayerWeights, Weight};

/// The smallest sum of the chosen probabilities llama.cpp divides by (2^-14, the
/// smallest normal f16).
const MIN_WEIGHT_SUM: f32 = 6.103_515_6e-5;

/// The experts one token uses and their weights, from its router logits: softmax (the
/// exponentials summed in f64 and scaled by the f32 reciprocal, as ggml's soft_max),
/// the `n_expert_used` largest probabilities (ties to the lower index), renormalized
/// and scaled as `spec` says.
pub fn route(spec: &MoeSpec, logits: &[f32]) -> Vec<(usize, f32)> {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let exps: Vec<f32> = logits.iter().map(|&l| (l - max).exp()).collect();
    let sum: f64 = exps.iter().map(|&e| e as f64).sum();
    let inv = (1.0 / sum) as f32;
    let probs: Vec<f32> = exps.iter().map(|&e| e * inv).collect();
    let mut order: Vec<usize> = (0..probs.len()).collect();
    order.sort_by(|&a, &b| probs[b].total_cmp(&probs[a]).then(a.cmp(&b)));
    let mut chosen: Vec<(usize, f32)> = order
        .into_iter()
        .take(spec.n_expert_used)
        .map(|e| (e, probs[e]))
        .collect();
    if spec.norm_weights {
        let sum = chosen.iter().map(|c| c.1 as f64).sum::<f64>() as f32;
        let sum = sum.max(MIN_WEIGHT_SUM);
        for c in &mut chosen {
            c.1 /= sum;
        }
    }
    if let Some(s) = spec.weights_scale {
        for c in &mut chosen {
            c.1 *= s;
        }
    }
    chosen
}

/// The mixture-of-experts MLP (see the module doc). It emits one [`Op::Moe`]: the
/// host executor calls [`FeedForward::forward`]; a device backend computes it inside
/// its pass (routing on the device, only the chosen experts' rows multiplied).
#[derive(Debug)]
pub struct MoeFfn {
    spec: MoeSpec,
    logits: Vec<f32>,
    /// Per token and choice, the chosen expert's output times its weight.
    weighted: Vec<f32>,
    mlp: MlpScratch,
}

impl MoeFfn {
    /// The MLP of `spec`.
    pub fn new(spec: MoeSpec) -> MoeFfn {
        MoeFfn {
            spec,
            logits: Vec::new(),
            weighted: Vec::new(),
            mlp: MlpScratch::default(),
        }
    }

    /// Expert counts and sizes.
    pub fn spec(&self) -> &MoeSpec {
        &self.spec
    }
}

/// `w` has the shape `dims` or an error names it.
fn check_dims(w: &Weight, dims: &[usize]) -> Result<()> {
    if w.dims != dims {
        return Err(Error::ShapeMismatch {
            what: format!("{} (dims {:?}, expected {dims:?})", w.name, w.dims),
            expected: dims.iter().product(),
            got: w.dims.iter().product(),
        });
    }
    Ok(())
}

impl MoeFfn {
    /// qwen2moe's shared expert: `out += swiglu_mlp(x) * sigmoid(gate · x)` per token.
    #[allow(clippy::too_many_arguments)]
    fn add_shared_expert(
        &mut self,
        backend: &dyn Backend,
        weights: &LayerWeights,
        x: &[f32],
        n_tokens: usize,
        d: usize,
        ff: usize,
        out: &mut [f32],
    ) -> Result<()> {
        let gate_inp = weights.vector(FFN_GATE_INP_SHEXP)?;
        let (gate, up, down) = (
            weights.matrix(FFN_GATE_SHEXP)?,
            weights.matrix(FFN_UP_SHEXP)?,
            weights.matrix(FFN_DOWN_SHEXP)?,
        );
        if gate_inp.len() != d {
            return Err(Error::ShapeMismatch {
                what: format!("the shared expert's gate of layer {}", weights.index),
                expected: d,
                got: gate_inp.len(),
            });
        }
        check_dims(gate, &[d, ff])?;
        check_dims(up, &[d, ff])?;
        check_dims(down, &[ff, d])?;
        let mut y = vec![0f32; n_tokens * d];
        let act = crate::blocks::Activation::Silu;
        gated_mlp(
            backend,
            gate,
            up,
            down,
            act,
            x,
            n_tokens,
            &mut self.mlp,
            &mut y,
        )?;
        for ((o, xr), yr) in out
            .chunks_exact_mut(d)
            .zip(x.chunks_exact(d))
            .zip(y.chunks_exact(d))
        {
            let logit: f32 = xr.iter().zip(gate_inp.iter()).map(|(a, b)| a * b).sum();
            let gate = 1.0 / (1.0 + (-logit).exp());
            for (a, &b) in o.iter_mut().zip(yr) {
                *a += b * gate;
            }
        }
        Ok(())
    }
}

impl FeedForward for MoeFfn {
    fn emit_ops(&self, graph: &mut Graph, layer: usize, x: TensorId, n_ff: usize, out: TensorId) {
        // The experts' width is the spec's, not the dense MLP's.
        let _ = n_ff;
        let l = WeightRef::layer;
        let shared = self.spec.shared_ff.map(|_| SharedExpertWeights {
            gate_inp: l(FFN_GATE_INP_SHEXP),
            gate: l(FFN_GATE_SHEXP),
            up: l(FFN_UP_SHEXP),
            down: l(FFN_DOWN_SHEXP),
        });
        graph.push(Op::Moe {
            layer,
            x,
            out,
            weights: MoeWeights {
                router: l(FFN_GATE_INP),
                gate: l(FFN_GATE_EXPS),
                up: l(FFN_UP_EXPS),
                down: l(FFN_DOWN_EXPS),
                shared,
            },
            spec: self.spec,
        });
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
        let s = self.spec;
        let router = weights.matrix(FFN_GATE_INP)?;
        let d = router.cols();
        check_dims(router, &[d, s.n_expert])?;
        if x.len() != n_tokens * d || out.len() != n_tokens * d {
            return Err(Error::ShapeMismatch {
                what: "the input and output of a mixture of experts".into(),
                expected: n_tokens * d,
                got: x.len().min(out.len()),
            });
        }
        self.logits.resize(n_tokens * s.n_expert, 0.0);
        backend.matmul(
            x,
            n_tokens,
            &mut [MatmulJob {
                weight: router,
                out: &mut self.logits,
            }],
        )?;
        let k = s.n_expert_used;
        let chosen: Vec<Vec<(usize, f32)>> = self
            .logits
            .chunks_exact(s.n_expert)
            .map(|l| route(&s, l))
            .collect();
        self.weighted.resize(n_tokens * k * d, 0.0);
        // Every chosen expert's three matrices, asked for at once: a store that reads
        // them from disk reads them together, as soon as the router has chosen.
        let mut used: Vec<usize> = chosen.iter().flatten().map(|c| c.0).collect();
        used.sort_unstable();
        used.dedup();
        const ROLES: [&str; 3] = [FFN_GATE_EXPS, FFN_UP_EXPS, FFN_DOWN_EXPS];
        let wanted: Vec<(&str, usize)> = used.iter().flat_map(|&e| ROLES.map(|r| (r, e))).collect();
        let matrices = weights.experts_of(&wanted)?;
        let (mut rows, mut slots) = (Vec::new(), Vec::new());
        let mut y = Vec::new();
        for (i_used, &e) in used.iter().enumerate() {
            // The tokens that chose expert e, and where each one's result goes.
            rows.clear();
            slots.clear();
            for (t, c) in chosen.iter().enumerate() {
                if let Some(j) = c.iter().position(|&(ce, _)| ce == e) {
                    rows.extend_from_slice(&x[t * d..(t + 1) * d]);
                    slots.push((t * k + j, c[j].1));
                }
            }
            if slots.is_empty() {
                continue;
            }
            let m = slots.len();
            let (ge, ue, de) = (
                &matrices[3 * i_used],
                &matrices[3 * i_used + 1],
                &matrices[3 * i_used + 2],
            );
            check_dims(ge, &[d, s.n_ff_expert])?;
            check_dims(ue, &[d, s.n_ff_expert])?;
            check_dims(de, &[s.n_ff_expert, d])?;
            y.resize(m * d, 0.0);
            let act = crate::blocks::Activation::Silu;
            gated_mlp(backend, ge, ue, de, act, &rows, m, &mut self.mlp, &mut y)?;
            for (i, &(slot, w)) in slots.iter().enumerate() {
                let dst = &mut self.weighted[slot * d..(slot + 1) * d];
                for (o, &v) in dst.iter_mut().zip(&y[i * d..(i + 1) * d]) {
                    *o = v * w;
                }
            }
        }
        // The chosen experts added in the order of the choice, as llama.cpp adds them.
        for (t, o) in out.chunks_exact_mut(d).enumerate() {
            o.copy_from_slice(&self.weighted[t * k * d..(t * k + 1) * d]);
            for j in 1..k {
                let slot = t * k + j;
                for (a, &b) in o.iter_mut().zip(&self.weighted[slot * d..(slot + 1) * d]) {
                    *a += b;
                }
            }
        }
        if let Some(ff) = s.shared_ff {
            self.add_shared_expert(backend, weights, x, n_tokens, d, ff, out)?;
        }
        Ok(())
    }
}
