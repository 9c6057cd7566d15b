//! [`SparseFfn`]: the SwiGLU MLP computing only the up-projection rows of the neurons a
//! token uses, by a CATS-style threshold on the gate activation.

use std::ops::Range;
use std::sync::{Arc, Mutex, Weak};

use ballast_core::backend::{Backend, MatmulJob};
use ballast_core::blocks::{FFN_DOWN, FFN_GATE, FFN_UP};
use ballast_core::neurons::{NeuronMlpJob, NeuronOps};
use ballast_core::weights::LayerWeights;
use ballast_core::FeedForward;

use crate::cache::{Lookup, NeuronCache};
use crate::predictor::{self, silu, ActiveRegion, LayerPredictor, Predictor};
use crate::profile::{MagnitudeHistogram, SparsityProfile};
use crate::source::NeuronSource;

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
    /// Gate-projection rows a dense MLP would compute (per pass).
    pub gate_rows: u64,
    /// Of those, the rows computed: all of them without a predictor, else the rows of
    /// neurons the predictor chose for some token of the pass.
    pub gate_rows_computed: u64,
    /// Weight bytes of the gate rows skipped.
    pub gate_bytes_skipped: u64,
    /// Weight bytes the predictor read (its two thin matrices, once per pass).
    pub predictor_bytes: u64,
    /// With recall measured ([`SparseFfn::measure_recall`]): (token, neuron) pairs the
    /// dense gate says pass the threshold.
    pub truly_active: u64,
    /// Of those, the ones whose gate row the predictor skipped (lost neurons).
    pub missed: u64,
    /// Neuron mode: weight bytes of the down projection not read against a dense MLP
    /// (the dense down matrix, less the down columns of the neurons computed; negative
    /// if the records' columns are wider than the model's blocks).
    pub down_bytes_skipped: i64,
    /// Neuron mode: active neurons found in the cache.
    pub neuron_hits: u64,
    /// Neuron mode: active neurons the cache lacked, whose records were fetched.
    pub neuron_misses: u64,
    /// Neuron mode: record bytes fetched from the [`NeuronSource`] (what it read from
    /// its file; records already in RAM count their size), prefetches included.
    pub bytes_fetched: u64,
    /// Neuron mode with a prefetch predictor ([`SparseFfn::with_prefetch`]): records
    /// fetched while attention ran, for the neurons predicted from the attention input
    /// that the cache lacked.
    pub prefetched: u64,
    /// Of those, the ones the pass then used (active).
    pub prefetch_used: u64,
    /// Record bytes of the prefetches (part of [`SparseStats::bytes_fetched`]).
    pub prefetch_bytes: u64,
}

impl SparseStats {
    /// The fraction of neurons skipped.
    pub fn sparsity(&self) -> f64 {
        1.0 - self.active as f64 / self.neurons.max(1) as f64
    }

    /// The predictor's recall: of the neurons the threshold keeps on the dense gate, the
    /// fraction whose rows it computed (1 without a predictor; measured only with
    /// [`SparseFfn::measure_recall`]).
    pub fn recall(&self) -> f64 {
        1.0 - self.missed as f64 / self.truly_active.max(1) as f64
    }

    /// Adds another pass's counts.
    fn add(&mut self, o: &SparseStats) {
        self.neurons += o.neurons;
        self.active += o.active;
        self.up_rows += o.up_rows;
        self.up_rows_computed += o.up_rows_computed;
        self.up_bytes_skipped += o.up_bytes_skipped;
        self.down_blocks += o.down_blocks;
        self.down_blocks_idle += o.down_blocks_idle;
        self.gate_rows += o.gate_rows;
        self.gate_rows_computed += o.gate_rows_computed;
        self.gate_bytes_skipped += o.gate_bytes_skipped;
        self.predictor_bytes += o.predictor_bytes;
        self.truly_active += o.truly_active;
        self.missed += o.missed;
        self.down_bytes_skipped += o.down_bytes_skipped;
        self.neuron_hits += o.neuron_hits;
        self.neuron_misses += o.neuron_misses;
        self.bytes_fetched += o.bytes_fetched;
        self.prefetched += o.prefetched;
        self.prefetch_used += o.prefetch_used;
        self.prefetch_bytes += o.prefetch_bytes;
    }

    /// Neuron mode: the fraction of active neurons found in the cache.
    pub fn hit_rate(&self) -> f64 {
        let asked = self.neuron_hits + self.neuron_misses;
        self.neuron_hits as f64 / asked.max(1) as f64
    }

    /// MLP weight bytes not read against a dense MLP (gate and up rows skipped, less
    /// what the predictor read), over the passes counted.
    pub fn bytes_saved(&self) -> i64 {
        (self.gate_bytes_skipped + self.up_bytes_skipped) as i64 - self.predictor_bytes as i64
            + self.down_bytes_skipped
    }
}

/// The activation magnitudes a calibration run collects, per layer, and, for a
/// predictor, the second moment of each layer's MLP input.
#[derive(Clone, Debug, Default)]
pub struct Calibration {
    histograms: Arc<Mutex<Vec<MagnitudeHistogram>>>,
    n_ff: Arc<Mutex<usize>>,
    /// Per layer, when collected.
    moments: Option<Arc<Mutex<Vec<InputMoment>>>>,
    /// Per layer, how many tokens each neuron was active for, when counted.
    activity: Option<Arc<Mutex<Activity>>>,
    /// Per layer, the moments of the attention input, collected with `moments`.
    attention: Option<Arc<Mutex<Vec<AttentionMoments>>>>,
}

/// `Σ a aᵀ` and `Σ x aᵀ` (`d × d` each, row-major; `x` the MLP input, `a` the same
/// layer's attention input) over the tokens of one layer, and how many.
#[derive(Clone, Debug, Default)]
struct AttentionMoments {
    aa: Vec<f64>,
    xa: Vec<f64>,
    tokens: u64,
}

/// `Σₜ left[t] right[t]ᵀ` (`d × d`, row-major) over `n_tokens` rows of `d` each, as an
/// f32 product on `backend`.
fn outer_sum(
    backend: &dyn Backend,
    left: &[f32],
    right: &[f32],
    n_tokens: usize,
) -> ballast_core::Result<Vec<f32>> {
    let d = left.len() / n_tokens.max(1);
    let transpose = |m: &[f32]| -> Vec<f32> {
        (0..d * n_tokens)
            .map(|at| m[(at % n_tokens) * d + at / n_tokens])
            .collect()
    };
    let left_t = transpose(left);
    // Row j of the weight is coordinate j of `right` over the tokens.
    let right_t = predictor::f32_matrix(&transpose(right), n_tokens, d);
    let mut product = vec![0f32; d * d];
    backend.matmul(
        &left_t,
        d,
        &mut [MatmulJob {
            weight: &right_t,
            out: &mut product,
        }],
    )?;
    Ok(product)
}

/// A sum over `tokens` tokens as their mean.
fn mean(sum: &[f64], tokens: u64) -> Vec<f64> {
    sum.iter().map(|v| v / tokens as f64).collect()
}

/// Adds `product` (f32) into `sum` (f64), sized to it.
fn accumulate(sum: &mut Vec<f64>, product: &[f32]) {
    sum.resize(product.len(), 0.0);
    for (s, &p) in sum.iter_mut().zip(product) {
        *s += f64::from(p);
    }
}

/// Per layer, a threshold and, per neuron, the tokens whose `|silu(gate)|` passed it.
#[derive(Clone, Debug, Default)]
struct Activity {
    thresholds: Vec<f32>,
    counts: Vec<Vec<u64>>,
}

/// `Σ x xᵀ` (`d × d`, row-major) over the MLP inputs of one layer, and how many.
#[derive(Clone, Debug, Default)]
struct InputMoment {
    sum: Vec<f64>,
    tokens: u64,
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
            predictor: None,
            attention_predictor: None,
        }
    }

    /// Per layer, per neuron, the tokens for which the neuron was active (its
    /// `|silu(gate)|` above the layer's threshold of [`SparseFfn::counting_activity`]);
    /// empty if activity was not counted, a layer the text never reached all zeros.
    pub fn active_counts(&self) -> Vec<Vec<u64>> {
        self.activity.as_ref().map_or_else(Vec::new, |a| {
            a.lock().unwrap_or_else(|p| p.into_inner()).counts.clone()
        })
    }

    /// Records one pass of layer `layer`: its gate values, and `x`'s `Σ x xᵀ` when
    /// moments are collected (computed on `backend` as an f32 product of `xᵀ` with
    /// itself), with the attention input `attn` (the same tokens') its `Σ a aᵀ` and
    /// `Σ x aᵀ`.
    #[allow(clippy::too_many_arguments)]
    fn record(
        &self,
        backend: &dyn Backend,
        layer: usize,
        x: &[f32],
        n_tokens: usize,
        gate: &[f32],
        n_ff: usize,
        attn: Option<&[f32]>,
    ) -> ballast_core::Result<()> {
        {
            let mut h = self.histograms.lock().unwrap_or_else(|p| p.into_inner());
            if h.len() <= layer {
                h.resize(layer + 1, MagnitudeHistogram::default());
            }
            h[layer].add(gate.iter().map(|&g| silu(g)));
            *self.n_ff.lock().unwrap_or_else(|p| p.into_inner()) = n_ff;
        }
        if let Some(activity) = &self.activity {
            let mut a = activity.lock().unwrap_or_else(|p| p.into_inner());
            if let Some(&t) = a.thresholds.get(layer) {
                if a.counts.len() <= layer {
                    a.counts.resize(layer + 1, Vec::new());
                }
                let counts = &mut a.counts[layer];
                counts.resize(n_ff, 0);
                for row in gate.chunks_exact(n_ff) {
                    for (c, &g) in counts.iter_mut().zip(row) {
                        *c += u64::from(silu(g).abs() > t);
                    }
                }
            }
        }
        let Some(moments) = &self.moments else {
            return Ok(());
        };
        let product = outer_sum(backend, x, x, n_tokens)?;
        {
            let mut m = moments.lock().unwrap_or_else(|p| p.into_inner());
            if m.len() <= layer {
                m.resize(layer + 1, InputMoment::default());
            }
            accumulate(&mut m[layer].sum, &product);
            m[layer].tokens += n_tokens as u64;
        }
        let (Some(attention), Some(a)) = (&self.attention, attn) else {
            return Ok(());
        };
        if a.len() != x.len() {
            return Err(ballast_core::Error::InvalidArgument {
                what: format!(
                    "layer {layer}'s attention input has {} values, its MLP input {}",
                    a.len(),
                    x.len()
                ),
            });
        }
        let aa = outer_sum(backend, a, a, n_tokens)?;
        let xa = outer_sum(backend, x, a, n_tokens)?;
        let mut m = attention.lock().unwrap_or_else(|p| p.into_inner());
        if m.len() <= layer {
            m.resize(layer + 1, AttentionMoments::default());
        }
        accumulate(&mut m[layer].aa, &aa);
        accumulate(&mut m[layer].xa, &xa);
        m[layer].tokens += n_tokens as u64;
        Ok(())
    }

    /// Fits layer `layer`'s predictor of rank `rank` for its gate projection `gate`
    /// from the inputs seen ([`SparseFfn::calibrating_with_moments`]).
    pub fn fit_predictor(
        &self,
        backend: &dyn Backend,
        layer: usize,
        gate: &ballast_core::weights::Weight,
        rank: usize,
    ) -> crate::Result<LayerPredictor> {
        let moments = self
            .moments
            .as_ref()
            .ok_or_else(|| crate::Error::InvalidArgument {
                what: "the calibration did not collect input moments (calibrating_with_moments)"
                    .into(),
            })?;
        let m = moments.lock().unwrap_or_else(|p| p.into_inner());
        let Some(moment) = m.get(layer).filter(|m| m.tokens > 0) else {
            return Err(crate::Error::InvalidArgument {
                what: format!("the calibration saw no input of layer {layer}"),
            });
        };
        predictor::fit_layer(
            backend,
            layer,
            gate,
            &mean(&moment.sum, moment.tokens),
            rank,
        )
    }

    /// Fits layer `layer`'s predictor of rank `rank` for its gate projection `gate`
    /// from the layer's attention input ([`predictor::fit_attention_layer`]), from the
    /// moments [`SparseFfn::calibrating_with_moments`] collected: what
    /// [`SparseFfn::with_prefetch`] uses.
    pub fn fit_attention_predictor(
        &self,
        backend: &dyn Backend,
        layer: usize,
        gate: &ballast_core::weights::Weight,
        rank: usize,
    ) -> crate::Result<LayerPredictor> {
        let none = |what: String| crate::Error::InvalidArgument { what };
        let (Some(moments), Some(attention)) = (&self.moments, &self.attention) else {
            return Err(none(
                "the calibration did not collect input moments (calibrating_with_moments)".into(),
            ));
        };
        let m = moments.lock().unwrap_or_else(|p| p.into_inner());
        let a = attention.lock().unwrap_or_else(|p| p.into_inner());
        let (Some(xx), Some(att)) = (
            m.get(layer).filter(|m| m.tokens > 0),
            a.get(layer).filter(|a| a.tokens > 0),
        ) else {
            return Err(none(format!(
                "the calibration saw no attention and MLP input of layer {layer}"
            )));
        };
        predictor::fit_attention_layer(
            backend,
            layer,
            gate,
            &mean(&xx.sum, xx.tokens),
            &mean(&att.xa, att.tokens),
            &mean(&att.aa, att.tokens),
            rank,
        )
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
    predictor: Option<(Predictor, f32)>,
    regions: Vec<Option<ActiveRegion>>,
    measure_recall: bool,
    predicted: Vec<f32>,
    predictor_hidden: Vec<f32>,
    dense_gate: Vec<f32>,
    neurons: Option<NeuronMode>,
    /// Calibrating with moments: the attention input [`FeedForward::prepare`] saw, and
    /// its layer, for the same layer's MLP pass.
    attn_input: Vec<f32>,
    attn_layer: Option<usize>,
}

/// The neuron mode ([`SparseFfn::with_neurons`]): records, the cache's books, and the
/// backend's slot stores (one per layer, made at the layer's first sparse pass, freed
/// when the mode is dropped).
struct NeuronMode {
    source: Arc<dyn NeuronSource>,
    cache: NeuronCache,
    /// The backend the stores live on. Weak: the MLP must not keep a device alive,
    /// and a backend gone has taken its stores with it.
    backend: Weak<dyn Backend>,
    /// Store number of layer 0; layer `l` is `store_base + l`.
    store_base: u64,
    created: Vec<bool>,
    active: Vec<u32>,
    lookup: Lookup,
    fill_neurons: Vec<u32>,
    fill_slots: Vec<u32>,
    records: Vec<u8>,
    gate: Vec<f32>,
    keep: Vec<bool>,
    part: Vec<f32>,
    prefetch: Option<Prefetch>,
    /// Reads of records at once ([`SparseFfn::with_readers`]).
    readers: usize,
}

/// The neuron mode's prefetch ([`SparseFfn::with_prefetch`]): a predictor from the
/// attention input, and the read it started.
struct Prefetch {
    predictor: Predictor,
    margin: f32,
    regions: Vec<Option<ActiveRegion>>,
    hidden: Vec<f32>,
    predicted: Vec<f32>,
    /// Per neuron: how deep its prediction lies in the active region, in error scales
    /// (predicted for the layer's pass when above `-margin`).
    score: Vec<f32>,
    /// The layer `score` is for.
    chosen_layer: Option<usize>,
    wanted: Vec<u32>,
    lookup: Lookup,
    pending: Option<PendingFetch>,
    /// The buffer of the last read, back from its thread to serve the next.
    spare: Vec<u8>,
    /// The layer and neurons of the last prefetch written, to count the used ones.
    landed: (usize, Vec<u32>),
}

/// Records being read on another thread while attention runs, for slots the cache has
/// already given them: they must be written before any pass reads those slots.
struct PendingFetch {
    layer: usize,
    fills: Vec<(u32, u32)>,
    read: std::thread::JoinHandle<crate::Result<(Vec<u8>, u64)>>,
}

impl NeuronMode {
    /// The number of `layer`'s slot store on the backend, made at its first use.
    fn ensure_store(&mut self, backend: &dyn Backend, layer: usize) -> ballast_core::Result<u64> {
        let store = self.store_base + layer as u64;
        if !self.created[layer] {
            neuron_ops(backend)?.neuron_slots_create(
                store,
                self.cache.capacity(),
                &self.source.layout(),
            )?;
            self.created[layer] = true;
        }
        Ok(store)
    }

    /// Waits for the prefetch in flight, if any, and writes its records to their slots
    /// (forgetting them if the read or the write failed), counting it in `stats`.
    fn finish_prefetch(
        &mut self,
        backend: &dyn Backend,
        stats: &mut SparseStats,
    ) -> ballast_core::Result<()> {
        let Some(pending) = self.prefetch.as_mut().and_then(|p| p.pending.take()) else {
            return Ok(());
        };
        // Its layer's store exists unless the pass that started it failed before its
        // MLP, in the model's first pass.
        let store = match self.ensure_store(backend, pending.layer) {
            Ok(store) => store,
            Err(e) => {
                let _ = pending.read.join();
                self.cache.forget(pending.layer, &pending.fills);
                return Err(e);
            }
        };
        let written = match pending.read.join() {
            Ok(Ok((records, read))) => {
                let slots: Vec<u32> = pending.fills.iter().map(|&(_, s)| s).collect();
                let written = neuron_ops(backend)
                    .and_then(|ops| ops.neuron_slots_write(store, &slots, &records))
                    .map(|()| if read > 0 { read } else { records.len() as u64 });
                if let Some(pf) = self.prefetch.as_mut() {
                    pf.spare = records;
                    pf.landed.0 = pending.layer;
                    pf.landed.1.clear();
                    pf.landed.1.extend(pending.fills.iter().map(|&(n, _)| n));
                }
                written
            }
            Ok(Err(e)) => Err(to_core(e)),
            Err(_) => Err(ballast_core::Error::InvalidArgument {
                what: "the neuron prefetch thread panicked".into(),
            }),
        };
        match written {
            Ok(bytes) => {
                stats.prefetched += pending.fills.len() as u64;
                stats.prefetch_bytes += bytes;
                stats.bytes_fetched += bytes;
                Ok(())
            }
            Err(e) => {
                self.cache.forget(pending.layer, &pending.fills);
                Err(e)
            }
        }
    }
}

impl Drop for NeuronMode {
    fn drop(&mut self) {
        if let Some(pending) = self.prefetch.as_mut().and_then(|p| p.pending.take()) {
            // Its slots are about to go: only the thread must not outlive the mode.
            let _ = pending.read.join();
        }
        // The stores are the cache's memory (`slots` records per layer, on a device
        // its buffers): without this they would stay on the backend, unreachable, for
        // as long as it lives.
        if let Some(ops) = self.backend.upgrade().as_deref().and_then(|b| b.neurons()) {
            for (layer, _) in self.created.iter().enumerate().filter(|(_, &c)| c) {
                ops.neuron_slots_free(self.store_base + layer as u64);
            }
        }
    }
}

/// The backend's neuron stores, or an error saying it has none.
fn neuron_ops(backend: &dyn Backend) -> ballast_core::Result<&dyn NeuronOps> {
    backend
        .neurons()
        .ok_or_else(|| ballast_core::Error::InvalidArgument {
            what: format!("the backend {} has no neuron stores", backend.name()),
        })
}

/// Store numbers of the neuron stores of all sparse MLPs made by this process: 2^16
/// per MLP, so two MLPs sharing a backend never write each other's slots.
static NEXT_STORE_BASE: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1 << 32);

/// This crate's error as the engine's (a neuron file's error keeps its words).
fn to_core(e: crate::Error) -> ballast_core::Error {
    match e {
        crate::Error::Core(e) => e,
        e => ballast_core::Error::Store {
            source: Box::new(e),
        },
    }
}

/// Neurons per reader below which a read stays on the calling thread.
const NEURONS_PER_READER: usize = 8;
/// Readers at once by default ([`SparseFfn::with_readers`]).
pub const DEFAULT_READERS: usize = 8;

/// Reads the records of `neurons` of `layer` from `source` into `out` (appended, in
/// the order asked), as [`NeuronSource::read`]; a long list is split into up to
/// `readers` runs of consecutive asks, read at once on scoped threads. Out of core
/// the records are scattered 4 KiB reads whose latency, one at a time, bounds the
/// neuron mode: several in flight let the disk serve them side by side.
fn read_records(
    source: &dyn NeuronSource,
    layer: usize,
    neurons: &[u32],
    out: &mut Vec<u8>,
    readers: usize,
) -> crate::Result<u64> {
    let readers = (neurons.len() / NEURONS_PER_READER).min(readers);
    if readers <= 1 {
        return source.read(layer, neurons, out);
    }
    let chunk = neurons.len().div_ceil(readers);
    let parts: Vec<crate::Result<(Vec<u8>, u64)>> = std::thread::scope(|scope| {
        let handles: Vec<_> = neurons
            .chunks(chunk)
            .map(|part| {
                scope.spawn(move || {
                    let mut records = Vec::new();
                    let read = source.read(layer, part, &mut records)?;
                    Ok((records, read))
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join().unwrap_or_else(|_| {
                    Err(crate::Error::InvalidArgument {
                        what: "a neuron reader thread panicked".into(),
                    })
                })
            })
            .collect()
    });
    let mut read = 0;
    let base = out.len();
    for part in parts {
        match part {
            Ok((records, bytes)) => {
                out.extend_from_slice(&records);
                read += bytes;
            }
            Err(e) => {
                // Nothing of a failed read is left in `out`.
                out.truncate(base);
                return Err(e);
            }
        }
    }
    Ok(read)
}

/// The runs of `true` in `keep`, as ranges, into `ranges`.
fn runs_of(keep: &[bool], ranges: &mut Vec<Range<usize>>) {
    ranges.clear();
    let mut j = 0;
    while j < keep.len() {
        if keep[j] {
            let start = j;
            while j < keep.len() && keep[j] {
                j += 1;
            }
            ranges.push(start..j);
        } else {
            j += 1;
        }
    }
}

/// The whole gate projection of `x` into `gate`.
fn dense_gate(
    backend: &dyn Backend,
    x: &[f32],
    n_tokens: usize,
    weight: &ballast_core::weights::Weight,
    gate: &mut [f32],
) -> ballast_core::Result<()> {
    backend.matmul(x, n_tokens, &mut [MatmulJob { weight, out: gate }])
}

/// Per (token, neuron): whether `|silu(gate)|` passes `threshold` (CATS).
fn keep_of(gate: &[f32], threshold: f32, keep: &mut Vec<bool>) {
    keep.clear();
    keep.extend(gate.iter().map(|&g| silu(g).abs() > threshold));
}

/// Per neuron: whether any token of `token_keep` (`n_ff` per token) keeps it.
fn union_of(token_keep: &[bool], n_ff: usize, keep: &mut Vec<bool>) {
    keep.clear();
    keep.resize(n_ff, false);
    for row in token_keep.chunks_exact(n_ff) {
        for (k, &t) in keep.iter_mut().zip(row) {
            *k |= t;
        }
    }
}

/// `out` = `weight`'s rows in `ranges` for `n_tokens` rows of `x`, the other rows 0;
/// one dense product when the ranges cover every row.
fn rows_or_all(
    backend: &dyn Backend,
    x: &[f32],
    n_tokens: usize,
    weight: &ballast_core::weights::Weight,
    ranges: &[Range<usize>],
    out: &mut [f32],
) -> ballast_core::Result<usize> {
    let computed: usize = ranges.iter().map(Range::len).sum();
    if computed == weight.rows() {
        backend.matmul(x, n_tokens, &mut [MatmulJob { weight, out }])?;
    } else {
        out.fill(0.0);
        backend.matmul_rows(x, n_tokens, weight, ranges, out)?;
    }
    Ok(computed)
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
            predictor: None,
            regions: Vec::new(),
            measure_recall: false,
            predicted: Vec::new(),
            predictor_hidden: Vec::new(),
            dense_gate: Vec::new(),
            neurons: None,
            attn_input: Vec::new(),
            attn_layer: None,
        }
    }

    /// The neuron mode: each sparse layer computes its MLP over neuron records
    /// ([`ballast_core::neurons`]) held in `slots` slots per layer of the backend's
    /// neuron store, fetching from `source` only the active neurons the cache lacks
    /// ([`NeuronCache`], least recently used out). The gate is computed whole from the
    /// model (it decides); the up and down weights read are the active neurons'
    /// records only. A layer at sparsity 0 (negative threshold) stays on the dense
    /// path, bit for bit, unless it comes without its `ffn_up`/`ffn_down` (a tiered
    /// store streaming the MLP from the neuron file): then every neuron is computed
    /// from its record. A pass whose tokens use more neurons than `slots` is served
    /// in parts of `slots` neurons (their outputs added). The row mode's predictor is
    /// not used in this mode; [`SparseFfn::with_prefetch`] adds one that fetches
    /// during attention.
    ///
    /// The stores live on `backend`, the one the model runs on (a pass on another is
    /// refused), and are freed there when the MLP is dropped.
    pub fn with_neurons(
        mut self,
        source: Arc<dyn NeuronSource>,
        slots: usize,
        backend: &Arc<dyn Backend>,
    ) -> crate::Result<SparseFfn> {
        let n_layers = source.n_layers();
        if n_layers >= 1 << 16 {
            return Err(crate::Error::InvalidArgument {
                what: format!("{n_layers} layers of neurons"),
            });
        }
        let cache = NeuronCache::new(n_layers, source.n_ff(), slots)?;
        let store_base = NEXT_STORE_BASE.fetch_add(1 << 16, std::sync::atomic::Ordering::Relaxed);
        self.neurons = Some(NeuronMode {
            source,
            cache,
            backend: Arc::downgrade(backend),
            store_base,
            created: vec![false; n_layers],
            active: Vec::new(),
            lookup: Lookup::default(),
            fill_neurons: Vec::new(),
            fill_slots: Vec::new(),
            records: Vec::new(),
            gate: Vec::new(),
            keep: Vec::new(),
            part: Vec::new(),
            prefetch: None,
            readers: DEFAULT_READERS,
        });
        Ok(self)
    }

    /// In the neuron mode, reads up to `readers` parts of a fetch at once (at least 1;
    /// [`DEFAULT_READERS`] unless set): out of core, the disk serves scattered reads
    /// side by side, which one at a time leave it waiting on each one's latency.
    /// Results do not depend on it.
    pub fn with_readers(mut self, readers: usize) -> SparseFfn {
        if let Some(nm) = self.neurons.as_mut() {
            nm.readers = readers.max(1);
        }
        self
    }

    /// In the neuron mode, fetches while attention runs (Tricksy, Deja Vu): at each
    /// layer's attention input, `predictor` (fitted on the attention input,
    /// [`Calibration::fit_attention_predictor`]) picks the neurons whose gate may pass
    /// the threshold within `margin` of its error scale, the cache assigns slots to those
    /// it lacks, and their records are read on another thread; the MLP pass writes them
    /// to the slots, then decides the active neurons on the whole gate as before and
    /// fetches the ones the predictor missed. Results do not depend on the predictor:
    /// it only moves reads earlier (and a wrong guess reads a record for nothing).
    /// A pass that predicts more neurons than the layer has slots (a long prompt, or a
    /// cache smaller than a token's neurons) prefetches the most confident ones. Call
    /// after [`SparseFfn::with_neurons`].
    pub fn with_prefetch(mut self, predictor: Predictor, margin: f32) -> crate::Result<SparseFfn> {
        let regions = self
            .thresholds
            .iter()
            .map(|&t| (t >= 0.0).then(|| ActiveRegion::for_threshold(t)))
            .collect();
        let Some(nm) = self.neurons.as_mut() else {
            return Err(crate::Error::InvalidArgument {
                what: "a prefetch needs the neuron mode (with_neurons)".into(),
            });
        };
        if let Some((layer, p)) = predictor
            .layers
            .iter()
            .enumerate()
            .find(|(_, p)| p.sigma.len() != nm.source.n_ff())
        {
            return Err(crate::Error::InvalidArgument {
                what: format!(
                    "layer {layer}'s prefetch predictor is for {} neurons, the records for {}",
                    p.sigma.len(),
                    nm.source.n_ff()
                ),
            });
        }
        nm.prefetch = Some(Prefetch {
            predictor,
            margin: margin.max(0.0),
            regions,
            hidden: Vec::new(),
            predicted: Vec::new(),
            score: Vec::new(),
            chosen_layer: None,
            wanted: Vec::new(),
            lookup: Lookup::default(),
            pending: None,
            spare: Vec::new(),
            landed: (0, Vec::new()),
        });
        Ok(self)
    }

    /// Predicts layer `layer`'s neurons from its attention input `a` and starts reading
    /// the records the cache lacks ([`SparseFfn::with_prefetch`]).
    fn start_prefetch(
        &mut self,
        layer: usize,
        a: &[f32],
        n_tokens: usize,
    ) -> ballast_core::Result<()> {
        let Some(nm) = self.neurons.as_mut() else {
            return Ok(());
        };
        let Some(backend) = nm.backend.upgrade() else {
            return Ok(());
        };
        // A read left by a pass that failed before its MLP: its slots must hold it.
        nm.finish_prefetch(backend.as_ref(), &mut SparseStats::default())?;
        let Some(pf) = nm.prefetch.as_mut() else {
            return Ok(());
        };
        pf.chosen_layer = None;
        let (Some(p), Some(region)) = (
            pf.predictor.layers.get(layer),
            pf.regions.get(layer).copied().flatten(),
        ) else {
            return Ok(());
        };
        let n_ff = nm.source.n_ff();
        if layer >= nm.created.len() {
            return Ok(());
        }
        pf.predicted.resize(n_tokens * n_ff, 0.0);
        p.predict(
            backend.as_ref(),
            a,
            n_tokens,
            &mut pf.hidden,
            &mut pf.predicted,
        )?;
        // Per neuron, its most confident token: how deep the prediction lies in the
        // active region, in error scales.
        pf.score.clear();
        pf.score.resize(n_ff, f32::NEG_INFINITY);
        for row in pf.predicted.chunks_exact(n_ff) {
            for ((c, &g), &sigma) in pf.score.iter_mut().zip(row).zip(&p.sigma) {
                *c = c.max(region.depth(g) / sigma.max(f32::MIN_POSITIVE));
            }
        }
        pf.chosen_layer = Some(layer);
        pf.wanted.clear();
        pf.wanted
            .extend((0..n_ff as u32).filter(|&j| pf.score[j as usize] > -pf.margin));
        let capacity = nm.cache.capacity();
        if pf.wanted.len() > capacity {
            // More than the slots: keep every predicted neuron the cache holds (a fill
            // must not evict one), and fetch the most confident of the others into the
            // slots left, those of neurons predicted idle. The rest are counted as
            // predicted for the recall, but not fetched early.
            let cache = &nm.cache;
            let score = &pf.score;
            let (mut held, mut lacking): (Vec<u32>, Vec<u32>) = pf
                .wanted
                .iter()
                .partition(|&&j| cache.slot_of(layer, j).is_some());
            let room = capacity - held.len();
            if room < lacking.len() {
                if room > 0 {
                    lacking.select_nth_unstable_by(room - 1, |&a, &b| {
                        score[b as usize].total_cmp(&score[a as usize])
                    });
                }
                lacking.truncate(room);
            }
            held.append(&mut lacking);
            held.sort_unstable();
            pf.wanted = held;
        }
        if pf.wanted.is_empty() {
            return Ok(());
        }
        nm.cache
            .prefetch(layer, &pf.wanted, &mut pf.lookup)
            .map_err(to_core)?;
        if pf.lookup.fills.is_empty() {
            return Ok(());
        }
        let fills = pf.lookup.fills.clone();
        let neurons: Vec<u32> = fills.iter().map(|&(n, _)| n).collect();
        let source = nm.source.clone();
        let readers = nm.readers;
        let mut records = std::mem::take(&mut pf.spare);
        records.clear();
        let read = std::thread::Builder::new()
            .name("neuron prefetch".into())
            .spawn(move || {
                let read = read_records(source.as_ref(), layer, &neurons, &mut records, readers)?;
                Ok((records, read))
            });
        match read {
            Ok(read) => {
                pf.pending = Some(PendingFetch { layer, fills, read });
                Ok(())
            }
            Err(e) => {
                nm.cache.forget(layer, &fills);
                Err(ballast_core::Error::Io {
                    what: "starting the neuron prefetch thread".into(),
                    source: e,
                })
            }
        }
    }

    /// The MLP of one layer in the neuron mode (see [`SparseFfn::with_neurons`]).
    #[allow(clippy::too_many_arguments)]
    fn forward_neurons(
        &mut self,
        backend: &dyn Backend,
        weights: &LayerWeights,
        x: &[f32],
        n_tokens: usize,
        out: &mut [f32],
        threshold: f32,
    ) -> ballast_core::Result<()> {
        let gate_w = weights.matrix(FFN_GATE)?;
        let (n_ff, layer) = (gate_w.rows(), weights.index);
        let nm = self.neurons.as_mut().expect("called in the neuron mode");
        if !std::ptr::addr_eq(backend as *const dyn Backend, nm.backend.as_ptr()) {
            // Its stores are on the other one (and would never be freed on this one).
            return Err(to_core(crate::Error::InvalidArgument {
                what: "a neuron-mode MLP runs on the backend it was made with".into(),
            }));
        }
        let layout = nm.source.layout();
        if nm.source.n_ff() != n_ff || layout.n_embd != gate_w.cols() || layer >= nm.created.len() {
            return Err(to_core(crate::Error::InvalidArgument {
                what: format!(
                    "neuron records of {} layers of {} neurons of width {} for layer {layer} of {n_ff} neurons of width {}",
                    nm.source.n_layers(),
                    nm.source.n_ff(),
                    layout.n_embd,
                    gate_w.cols()
                ),
            }));
        }
        let mut stats = SparseStats::default();
        let store = nm.ensure_store(backend, layer)?;
        // The records read during attention go to their slots before anything reads
        // the store.
        nm.finish_prefetch(backend, &mut stats)?;
        self.gate.resize(n_tokens * n_ff, 0.0);
        dense_gate(backend, x, n_tokens, gate_w, &mut self.gate)?;
        keep_of(&self.gate, threshold, &mut self.token_keep);
        union_of(&self.token_keep, n_ff, &mut self.keep);
        nm.active.clear();
        nm.active
            .extend((0..n_ff as u32).filter(|&j| self.keep[j as usize]));
        if let Some(pf) = nm.prefetch.as_mut() {
            if pf.chosen_layer == Some(layer) {
                stats.truly_active += nm.active.len() as u64;
                stats.missed += nm
                    .active
                    .iter()
                    .filter(|&&j| pf.score[j as usize] <= -pf.margin)
                    .count() as u64;
                pf.chosen_layer = None;
            }
            if pf.landed.0 == layer {
                stats.prefetch_used += pf
                    .landed
                    .1
                    .iter()
                    .filter(|&&j| self.keep[j as usize])
                    .count() as u64;
                pf.landed.1.clear();
            }
        }
        let d = layout.n_embd;
        if nm.active.is_empty() {
            out.fill(0.0);
        }
        let active = std::mem::take(&mut nm.active);
        for (p, part) in active.chunks(nm.cache.capacity()).enumerate() {
            nm.cache
                .lookup(layer, part, &mut nm.lookup)
                .map_err(to_core)?;
            if !nm.lookup.fills.is_empty() {
                nm.fill_neurons.clear();
                nm.fill_slots.clear();
                for &(n, s) in &nm.lookup.fills {
                    nm.fill_neurons.push(n);
                    nm.fill_slots.push(s);
                }
                nm.records.clear();
                let written = read_records(
                    nm.source.as_ref(),
                    layer,
                    &nm.fill_neurons,
                    &mut nm.records,
                    nm.readers,
                )
                .map_err(to_core)
                .and_then(|read| {
                    neuron_ops(backend)?.neuron_slots_write(store, &nm.fill_slots, &nm.records)?;
                    Ok(read)
                });
                match written {
                    Ok(read) => {
                        stats.bytes_fetched += if read > 0 {
                            read
                        } else {
                            nm.records.len() as u64
                        };
                    }
                    Err(e) => {
                        nm.cache.forget(layer, &nm.lookup.fills);
                        nm.active = active;
                        return Err(e);
                    }
                }
            }
            stats.neuron_misses += nm.lookup.fills.len() as u64;
            stats.neuron_hits += (part.len() - nm.lookup.fills.len()) as u64;
            let k = part.len();
            nm.gate.clear();
            nm.keep.clear();
            for t in 0..n_tokens {
                for &j in part {
                    nm.gate.push(self.gate[t * n_ff + j as usize]);
                    nm.keep.push(self.token_keep[t * n_ff + j as usize]);
                }
            }
            let target: &mut [f32] = if p == 0 {
                out
            } else {
                nm.part.resize(n_tokens * d, 0.0);
                &mut nm.part
            };
            neuron_ops(backend)?.neuron_mlp(NeuronMlpJob {
                store,
                x,
                n_tokens,
                slots: &nm.lookup.slots,
                gate: &nm.gate,
                keep: &nm.keep,
                out: target,
            })?;
            if p > 0 {
                for (o, v) in out.iter_mut().zip(&nm.part) {
                    *o += v;
                }
            }
            debug_assert_eq!(k, nm.lookup.slots.len());
        }
        let k = active.len();
        nm.active = active;
        let dense_down = weights
            .matrix(FFN_DOWN)
            .map(|w| w.bytes.len())
            .unwrap_or(n_ff * layout.down_bytes());
        let up_row = weights
            .matrix(FFN_UP)
            .map(|w| w.row_bytes())
            .unwrap_or(layout.up_bytes());
        stats.neurons = (n_tokens * n_ff) as u64;
        stats.active = self.token_keep.iter().filter(|&&k| k).count() as u64;
        stats.up_rows = n_ff as u64;
        stats.up_rows_computed = k as u64;
        stats.up_bytes_skipped = ((n_ff - k) * up_row) as u64;
        stats.down_bytes_skipped = dense_down as i64 - (k * layout.down_bytes()) as i64;
        stats.gate_rows = n_ff as u64;
        stats.gate_rows_computed = n_ff as u64;
        self.stats
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .add(&stats);
        Ok(())
    }

    /// A dense MLP that records the distribution of `|silu(gate)|` of each layer: run
    /// a model with it over a text, then take [`Calibration::profile`].
    pub fn calibrating() -> (SparseFfn, Calibration) {
        let calibration = Calibration::default();
        let mut ffn = SparseFfn::new(Vec::new());
        ffn.calibration = Some(calibration.clone());
        (ffn, calibration)
    }

    /// As [`SparseFfn::calibrating`], also counting per layer how many tokens each
    /// neuron is active for at the layer's threshold in `thresholds`
    /// ([`Calibration::active_counts`]): how `ballast sparsify --neurons` ranks the
    /// neurons to store the hot ones first ([`crate::hot_first`]).
    pub fn counting_activity(thresholds: Vec<f32>) -> (SparseFfn, Calibration) {
        let (mut ffn, mut calibration) = SparseFfn::calibrating();
        calibration.activity = Some(Arc::new(Mutex::new(Activity {
            thresholds,
            counts: Vec::new(),
        })));
        ffn.calibration = Some(calibration.clone());
        (ffn, calibration)
    }

    /// As [`SparseFfn::calibrating`], also summing each layer's `x xᵀ` so that a
    /// predictor can be fitted ([`Calibration::fit_predictor`]), and, from the attention
    /// input `a` each layer's [`FeedForward::prepare`] sees, `a aᵀ` and `x aᵀ` for the
    /// attention-input predictor ([`Calibration::fit_attention_predictor`]): three
    /// `d × d` sums per layer, in f64.
    pub fn calibrating_with_moments() -> (SparseFfn, Calibration) {
        let (mut ffn, mut calibration) = SparseFfn::calibrating();
        calibration.moments = Some(Arc::default());
        calibration.attention = Some(Arc::default());
        ffn.calibration = Some(calibration.clone());
        (ffn, calibration)
    }

    /// Uses `predictor` to choose the gate rows to compute: a neuron's row is computed
    /// when a gate value within `margin` of its error scale from the prediction would
    /// pass the threshold. A layer whose threshold is negative (sparsity 0) ignores it
    /// and stays exact.
    pub fn with_predictor(mut self, predictor: Predictor, margin: f32) -> SparseFfn {
        self.regions = self
            .thresholds
            .iter()
            .map(|&t| (t >= 0.0).then(|| ActiveRegion::for_threshold(t)))
            .collect();
        self.predictor = Some((predictor, margin.max(0.0)));
        self
    }

    /// Also computes the dense gate of every layer the predictor serves, to count the
    /// neurons it loses ([`SparseStats::recall`]). For measurement: it reads the
    /// whole gate again.
    pub fn measure_recall(mut self) -> SparseFfn {
        self.measure_recall = true;
        self
    }

    /// The counters, shared: read them while the MLP is installed in a model.
    pub fn stats(&self) -> Arc<Mutex<SparseStats>> {
        self.stats.clone()
    }
}

impl FeedForward for SparseFfn {
    fn needs_prepare(&self) -> bool {
        let calibrating = self
            .calibration
            .as_ref()
            .is_some_and(|c| c.attention.is_some());
        let prefetching = self
            .neurons
            .as_ref()
            .is_some_and(|nm| nm.prefetch.is_some());
        calibrating || prefetching
    }

    fn prepare(
        &mut self,
        layer: usize,
        attn_input: &[f32],
        n_tokens: usize,
    ) -> ballast_core::Result<()> {
        if self
            .calibration
            .as_ref()
            .is_some_and(|c| c.attention.is_some())
        {
            self.attn_input.clear();
            self.attn_input.extend_from_slice(attn_input);
            self.attn_layer = Some(layer);
            return Ok(());
        }
        self.start_prefetch(layer, attn_input, n_tokens)
    }

    fn forward(
        &mut self,
        backend: &dyn Backend,
        weights: &LayerWeights,
        x: &[f32],
        n_tokens: usize,
        out: &mut [f32],
    ) -> ballast_core::Result<()> {
        if self.neurons.is_some() && self.calibration.is_none() {
            let threshold = self.thresholds.get(weights.index).copied().unwrap_or(-1.0);
            // A layer lent without its up and down matrices (out of core: they live in
            // the neuron file only) takes the neuron path at any sparsity.
            if threshold >= 0.0 || weights.matrix(FFN_UP).is_err() {
                return self.forward_neurons(backend, weights, x, n_tokens, out, threshold);
            }
        }
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
        let mut stats = SparseStats::default();

        // The gate rows to compute: every one, or the neurons the predictor chose for
        // some token of the pass.
        let region = self.regions.get(layer).copied().flatten();
        let predictor = self
            .predictor
            .as_ref()
            .and_then(|(p, margin)| Some((p.layers.get(layer)?, *margin, region?)));
        let gate_rows_computed = if let Some((p, margin, region)) = predictor {
            self.predicted.resize(n_tokens * n_ff, 0.0);
            p.predict(
                backend,
                x,
                n_tokens,
                &mut self.predictor_hidden,
                &mut self.predicted,
            )?;
            stats.predictor_bytes += p.bytes() as u64;
            self.keep.clear();
            self.keep.resize(n_ff, false);
            for row in self.predicted.chunks_exact(n_ff) {
                for ((k, &g), &sigma) in self.keep.iter_mut().zip(row).zip(&p.sigma) {
                    *k |= region.meets(g - margin * sigma, g + margin * sigma);
                }
            }
            runs_of(&self.keep, &mut self.ranges);
            let computed = rows_or_all(backend, x, n_tokens, gate_w, &self.ranges, &mut self.gate)?;
            if self.measure_recall {
                self.dense_gate.resize(n_tokens * n_ff, 0.0);
                backend.matmul(
                    x,
                    n_tokens,
                    &mut [MatmulJob {
                        weight: gate_w,
                        out: &mut self.dense_gate,
                    }],
                )?;
                for row in self.dense_gate.chunks_exact(n_ff) {
                    for (&g, &k) in row.iter().zip(&self.keep) {
                        let active = silu(g).abs() > threshold;
                        stats.truly_active += u64::from(active);
                        stats.missed += u64::from(active && !k);
                    }
                }
            }
            computed
        } else {
            dense_gate(backend, x, n_tokens, gate_w, &mut self.gate)?;
            n_ff
        };
        if let Some(c) = &self.calibration {
            let attn = (self.attn_layer.take() == Some(layer)).then_some(&self.attn_input[..]);
            c.record(backend, layer, x, n_tokens, &self.gate, n_ff, attn)?;
        }
        // Which (token, neuron) pairs are kept, decided once on the gate rows computed
        // (a row not computed holds 0, which no threshold keeps); a neuron's up row is
        // computed if any token keeps it.
        keep_of(&self.gate, threshold, &mut self.token_keep);
        if gate_rows_computed < n_ff {
            for row in self.token_keep.chunks_exact_mut(n_ff) {
                for (t, &k) in row.iter_mut().zip(&self.keep) {
                    *t &= k;
                }
            }
        }
        let active = self.token_keep.iter().filter(|&&k| k).count() as u64;
        union_of(&self.token_keep, n_ff, &mut self.keep);
        runs_of(&self.keep, &mut self.ranges);
        let computed = rows_or_all(backend, x, n_tokens, up_w, &self.ranges, &mut self.up)?;
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
        stats.neurons = (n_tokens * n_ff) as u64;
        stats.active = active;
        stats.up_rows = n_ff as u64;
        stats.up_rows_computed = computed as u64;
        stats.up_bytes_skipped = ((n_ff - computed) * up_w.row_bytes()) as u64;
        stats.gate_rows = n_ff as u64;
        stats.gate_rows_computed = gate_rows_computed as u64;
        stats.gate_bytes_skipped = ((n_ff - gate_rows_computed) * gate_w.row_bytes()) as u64;
        stats.down_blocks = (n_tokens * n_ff.div_ceil(block)) as u64;
        stats.down_blocks_idle = idle_blocks;
        self.stats
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .add(&stats);
        Ok(())
    }
}
