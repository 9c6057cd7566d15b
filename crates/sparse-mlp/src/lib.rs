//! Ballast's sparse-MLP lever: skip the MLP neurons a token does not use, on SwiGLU
//! models, without training.
//!
//! - [`SparsityProfile`]: per layer, the distribution of `|silu(gate(x))|` on a
//!   calibration text (kept beside the model in a small file with a checksum and the
//!   model's fingerprint), from which a target sparsity gives one threshold per layer.
//! - [`SparseFfn`]: a [`ballast_core::FeedForward`] that computes the gate projection,
//!   keeps the neurons above the threshold (CATS), computes the up projection for
//!   those rows only, and the down projection over the kept neurons. Exact at
//!   sparsity 0; approximate above, measured by perplexity against the dense MLP.
//! - [`SparseFfn::calibrating`]: the dense MLP that records the distribution, to make a
//!   profile; [`SparseFfn::calibrating_with_moments`] also records each layer's input
//!   second moment, from which [`Calibration::fit_predictor`] fits a [`Predictor`].
//! - [`Predictor`]: per layer, a rank-`r` approximation of the gate projection on the
//!   calibration inputs (closed form, no training) with each neuron's error scale, so
//!   that [`SparseFfn::with_predictor`] computes only the gate rows of the neurons it
//!   predicts active, within a margin; [`SparseStats::recall`] measures what it loses.
//! - [`SparseFfn::with_neurons`]: the neuron mode, computing the MLP over neuron
//!   records (one neuron's up row and down column side by side) held in a per-layer
//!   [`NeuronCache`] of the backend's slots, fetching only the active neurons it lacks
//!   from a [`NeuronSource`]: the [`NeuronFile`] beside the model (a record of up to
//!   4 KiB never crosses a page, so one alone is one page read), whose layers store their records in
//!   neuron order or hot first ([`hot_first`] of
//!   [`Calibration::active_counts`]; measured not to save reads).
//! - [`SparseFfn::with_prefetch`]: in the neuron mode, a second predictor of the same
//!   gates, fitted on each layer's *attention* input by reduced-rank regression
//!   ([`fit_attention_layer`], Deja Vu's lookahead), picks at the attention input the
//!   neurons to fetch; their records are read on another thread while attention runs
//!   (Tricksy's diff fetch) and booked in the cache as its least recently used slots,
//!   so a wrong guess goes first. The MLP still decides on the whole gate: results do
//!   not change, only when reads happen.
//!
//! The granularity is one neuron for the up projection (a weight row) and, for the down
//! projection, one quantization block of its input (32 neurons, 256 for K-quants),
//! since the block's scale serves all its neurons; [`SparseStats`] counts how many such
//! blocks go idle.
//!
//! ```
//! use ballast_sparse_mlp::{SparseFfn, SparsityProfile, QUANTILES};
//!
//! // A profile of two layers whose activations spread evenly over 0..2.
//! let quantiles: Vec<f32> = (0..=QUANTILES).map(|i| 2.0 * i as f32 / QUANTILES as f32).collect();
//! let profile = SparsityProfile { fingerprint: 7, n_ff: 64, tokens: 1, layers: vec![quantiles; 2], predictor: None, attention_predictor: None };
//! let thresholds = profile.thresholds(0.4).unwrap();
//! assert!((thresholds[0] - 0.8).abs() < 1e-6);
//! let ffn = SparseFfn::new(thresholds); // install with Model::share_with_ffn
//! # drop(ffn);
//! ```
#![deny(missing_docs)]

mod cache;
pub mod error;
mod ffn;
mod file;
mod linalg;
mod predictor;
mod profile;
mod source;

pub use cache::{CacheCounts, Lookup, NeuronCache};
pub use error::{Error, Result};
pub use ffn::{Calibration, SparseFfn, SparseStats, DEFAULT_READERS};
pub use file::{
    hot_first, neuron_file_path, NeuronFile, NeuronFileHeader, NeuronFileWriter, HEADER_BYTES,
    NEURON_FILE_VERSION,
};
pub use predictor::{fit_attention_layer, fit_layer, ActiveRegion, LayerPredictor, Predictor};
pub use profile::{MagnitudeHistogram, SparsityProfile, Wanted, QUANTILES};
pub use source::{layer_records, MemoryNeurons, NeuronSource};
