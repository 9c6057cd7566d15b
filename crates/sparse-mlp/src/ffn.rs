//! [`SparseFfn`]: the SwiGLU MLP computing only the up-projection rows of the neurons a
//! token uses, by a CATS-style threshold on the gate activation.

use std::ops::Range;
use std::sync::{Arc, Mutex};

use ballast_core::backend::{Backend, MatmulJob};
use ballast_core::blocks::{FFN_DOWN, FFN_GATE, FFN_UP};
use ballast_core::weights::LayerWeights;
use ballast_core::FeedForward;

use crate::profile::{MagnitudeHistogram, SparsityProfile};

/// What the sparse MLP did, summed over the passes since it was made.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SparseStats {
    /// (token, neuron) pairs seen.
    pub neurons: u64,
    /// Of those, the ones kept (their `|silu(gate)|` above the layer's threshold).
    pub active: u64,
    /// Up-projection rows a dense MLP would compute (per pass, not per token).
    pub up_rows: u64,
    /// Of those, the rows computed (a row is computed if any token of the pass keeps
    /// its neuron).
    pub up_rows_computed: u64,
    /// Weight bytes of the up-projection rows skipped.
    pub up_bytes_skipped: u64,
    /// Blocks of the down projection's input (one quantization block of the down
    /// weight, 32 neurons for Q4_0/Q4_1/Q8_0, 256 for the K-quants) per token.
    pub down_blocks: u64,
    /// Of those, the blocks whose neurons were all skipped: only these could be skipped
    /// in the down projection, since a block's weights serve all its neurons together.
    pub down_blocks_idle: u64,
}

impl SparseStats {
    /// The fraction of neurons skipped.
    pub fn sparsity(&self) -> f64 {
        1.0 - self.active as f64 / self.neurons.max(1) as f64
    }
}

/// The activation magnitudes a calibration run collects, per layer.
#[derive(Clone, Debug, Default)]
pub struct Calibration {
    histograms: Arc<Mutex<Vec<MagnitudeHistogram>>>,
    n_ff: Arc<Mutex<usize>>,
}

impl Calibration {
    /// The profile of what was seen, for the model of `fingerprint`, after `tokens`
    /// tokens.
    pub fn profile(&self, fingerprint: u64, tokens: u64) -> SparsityProfile {
        let h = self.histograms.lock().unwrap_or_else(|p| p.into_inner());
        SparsityProfile {
            fingerprint,
            n_ff: *self.n_ff.lock().unwrap_or_else(|p| p.into_inner()),
            tokens,
            layers: h.iter().map(MagnitudeHistogram::quantiles).collect(),
        }
    }
}

/// The MLP with neurons skipped where `|silu(gate(x))|` is at most the layer's
/// threshold (CATS, Lee et al. 2024: thresholding the gate activation of a SwiGLU
/// MLP, no training). Approximate: measured by perplexity and greedy agreement
/// against the dense MLP, which it equals bit for bit at sparsity 0.
///
/// Per layer: the gate projection is computed whole (it decides); the up projection
/// only for the rows of neurons some token of the pass keeps ([`Backend::matmul_rows`]:
/// rows are independent, so a neuron is skipped on its own); the down projection is
/// computed over the hidden vector with the skipped neurons zeroed. Its weights for one
/// neuron lie inside quantization blocks shared with the block's other neurons (32 or
/// 256), so a block can be skipped only when all of its neurons are: [`SparseStats`]
/// counts how often that happens, which says what a block-skipping kernel would gain.
pub struct SparseFfn {
    thresholds: Vec<f32>,
    calibration: Option<Calibration>,
    stats: Arc<Mutex<SparseStats>>,
    gate: Vec<f32>,
    up: Vec<f32>,
    hidden: Vec<f32>,
    keep: Vec<bool>,
    token_keep: Vec<bool>,
    ranges: Vec<Range<usize>>,
}

/// SiLU as the mask sees it (the product itself is the backend's `swiglu`).
fn silu(g: f32) -> f32 {
    g / (1.0 + (-g).exp())
}

impl SparseFfn {
    /// A sparse MLP with one threshold per layer ([`SparsityProfile::thresholds`]); a
    /// layer without one is dense.
    pub fn new(thresholds: Vec<f32>) -> SparseFfn {
        SparseFfn {
            thresholds,
            calibration: None,
            stats: Arc::default(),
            gate: Vec::new(),
            up: Vec::new(),
            hidden: Vec::new(),
            keep: Vec::new(),
            token_keep: Vec::new(),
            ranges: Vec::new(),
        }
    }

    /// A dense MLP that records the distribution of `|silu(gate)|` of each layer: run
    /// a model with it over a text, then take [`Calibration::profile`].
    pub fn calibrating() -> (SparseFfn, Calibration) {
        let calibration = Calibration::default();
        let mut ffn = SparseFfn::new(Vec::new());
        ffn.calibration = Some(calibration.clone());
        (ffn, calibration)
    }

    /// The counters, shared: read them while the MLP is installed in a model.
    pub fn stats(&self) -> Arc<Mutex<SparseStats>> {
        self.stats.clone()
    }
}

impl FeedForward for SparseFfn {
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
    ) -> ballast_core::Result<()> {
        let (gate_w, up_w, down_w) = (
            weights.matrix(FFN_GATE)?,
            weights.matrix(FFN_UP)?,
            weights.matrix(FFN_DOWN)?,
        );
        let n_ff = gate_w.rows();
        let layer = weights.index;
        let threshold = self.thresholds.get(layer).copied().unwrap_or(-1.0);
        self.gate.resize(n_tokens * n_ff, 0.0);
        self.up.resize(n_tokens * n_ff, 0.0);
        self.hidden.resize(n_tokens * n_ff, 0.0);
        backend.matmul(
            x,
            n_tokens,
            &mut [MatmulJob {
                weight: gate_w,
                out: &mut self.gate,
            }],
        )?;
        if let Some(c) = &self.calibration {
            let mut h = c.histograms.lock().unwrap_or_else(|p| p.into_inner());
            if h.len() <= layer {
                h.resize(layer + 1, MagnitudeHistogram::default());
            }
            h[layer].add(self.gate.iter().map(|&g| silu(g)));
            *c.n_ff.lock().unwrap_or_else(|p| p.into_inner()) = n_ff;
        }
        // Which (token, neuron) pairs are kept, decided once; a neuron's up row is
        // computed if any token keeps it.
        self.token_keep.clear();
        self.token_keep
            .extend(self.gate.iter().map(|&g| silu(g).abs() > threshold));
        let active = self.token_keep.iter().filter(|&&k| k).count() as u64;
        self.keep.clear();
        self.keep.resize(n_ff, false);
        for row in self.token_keep.chunks_exact(n_ff) {
            for (k, &t) in self.keep.iter_mut().zip(row) {
                *k |= t;
            }
        }
        self.ranges.clear();
        let mut j = 0;
        while j < n_ff {
            if self.keep[j] {
                let start = j;
                while j < n_ff && self.keep[j] {
                    j += 1;
                }
                self.ranges.push(start..j);
            } else {
                j += 1;
            }
        }
        let computed: usize = self.ranges.iter().map(Range::len).sum();
        if computed == n_ff {
            backend.matmul(
                x,
                n_tokens,
                &mut [MatmulJob {
                    weight: up_w,
                    out: &mut self.up,
                }],
            )?;
        } else {
            self.up.fill(0.0);
            backend.matmul_rows(x, n_tokens, up_w, &self.ranges, &mut self.up)?;
        }
        backend.swiglu(&self.gate, &self.up, &mut self.hidden)?;
        // Each token keeps only its own active neurons.
        let mut idle_blocks = 0u64;
        let block = down_w.ty.block_len().max(1);
        for (h, kept) in self
            .hidden
            .chunks_exact_mut(n_ff)
            .zip(self.token_keep.chunks_exact(n_ff))
        {
            for (hv, &k) in h.iter_mut().zip(kept) {
                if !k {
                    *hv = 0.0;
                }
            }
            idle_blocks += h
                .chunks(block)
                .filter(|b| b.iter().all(|&v| v == 0.0))
                .count() as u64;
        }
        backend.matmul(
            &self.hidden,
            n_tokens,
            &mut [MatmulJob {
                weight: down_w,
                out,
            }],
        )?;
        let mut s = self.stats.lock().unwrap_or_else(|p| p.into_inner());
        s.neurons += (n_tokens * n_ff) as u64;
        s.active += active;
        s.up_rows += n_ff as u64;
        s.up_rows_computed += computed as u64;
        s.up_bytes_skipped += ((n_ff - computed) * up_w.row_bytes()) as u64;
        s.down_blocks += (n_tokens * n_ff.div_ceil(block)) as u64;
        s.down_blocks_idle += idle_blocks;
        Ok(())
    }
}
