//! [`CompressedStore`]: a [`WeightStore`] that keeps each layer's matrices coded (in
//! the pack, memory-mapped or read into RAM) and decodes a layer when a forward pass
//! asks for it.
//!
//! [`CachePolicy`] decides how long a decoded layer lives:
//! - [`CachePolicy::PerPass`] (the seed's): decoded on first use in a pass, reused for
//!   the rest of that pass, dropped when a later pass starts. At most one decode per
//!   layer per pass; at the peak, every layer of a pass is decoded at once.
//! - [`CachePolicy::EveryUse`]: decoded for each request and dropped once the pass lets
//!   go of it; the least memory (a layer or two decoded at a time).
//! - [`CachePolicy::Keep`]: decoded once and kept (as much memory as the plain file).
//!
//! [`StoreOptions::keep_layers`] keeps the first `k` layers decoded under any policy
//! (a budget of layers kept decoded), and with [`StoreOptions::prefetch`] a worker
//! thread decodes layer `i + 1` (cyclically) while layer `i` computes. The model asks
//! for each layer once per pass, in order, so the prefetched layer is the next one
//! asked for; any other order is still answered, by decoding on the caller's thread.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{channel, Sender};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use ballast_core::gguf::GgufFile;
use ballast_core::store::PassId;
use ballast_core::weights::{ByteSource, GlobalWeights, LayerWeights, WeightBytes};
use ballast_core::{CodedLayers, TierBytes, WeightStore};

use crate::error::{Error, Result};
use crate::pack::{run_split, PackFile, PackedTensor};

/// How long a decoded layer lives. See the [module docs](self).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CachePolicy {
    /// Decoded once per forward pass, dropped when a later pass starts.
    PerPass,
    /// Decoded for every request.
    EveryUse,
    /// Decoded once, kept for the life of the store.
    Keep,
}

/// How a [`CompressedStore`] decodes.
#[derive(Clone, Debug)]
pub struct StoreOptions {
    /// How long a decoded layer lives.
    pub policy: CachePolicy,
    /// Layers `0..keep_layers` stay decoded once decoded, under any policy.
    pub keep_layers: usize,
    /// Decode layer `i + 1` on a worker thread while layer `i` computes.
    pub prefetch: bool,
    /// Threads that decode one layer's chunks.
    pub decode_threads: usize,
}

impl Default for StoreOptions {
    fn default() -> StoreOptions {
        StoreOptions {
            policy: CachePolicy::EveryUse,
            keep_layers: 0,
            prefetch: true,
            decode_threads: 1,
        }
    }
}

/// The store's counters (the seed's, plus timings).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CompressedStats {
    /// Forward passes seen (distinct pass ids).
    pub passes: u64,
    /// Layer requests answered.
    pub requests: u64,
    /// Layers decoded (on the worker and on callers' threads).
    pub decompressions: u64,
    /// Raw bytes decoded.
    pub bytes_decoded: u64,
    /// Stored bytes read to decode them.
    pub bytes_read: u64,
    /// Time spent decoding (summed over threads).
    pub decode_time: Duration,
    /// Time requests waited for a decode (on the caller's thread or the worker).
    pub stall_time: Duration,
    /// Decoded bytes alive now (held by the store or by a pass).
    pub decoded_bytes_now: u64,
    /// The most decoded bytes alive at once.
    pub decoded_bytes_peak: u64,
}

impl CompressedStats {
    /// Decompressions per forward pass.
    pub fn decompressions_per_pass(&self) -> f64 {
        self.decompressions as f64 / self.passes.max(1) as f64
    }
}

#[derive(Default)]
struct Counters {
    passes: AtomicU64,
    requests: AtomicU64,
    decompressions: AtomicU64,
    bytes_decoded: AtomicU64,
    bytes_read: AtomicU64,
    decode_ns: AtomicU64,
    stall_ns: AtomicU64,
    live: AtomicU64,
    peak: AtomicU64,
}

impl Counters {
    /// Counts one decode of the layer `plan` describes, begun at `t0`.
    fn count_decode(&self, plan: &LayerPlan, t0: Instant) {
        self.decompressions.fetch_add(1, Ordering::Relaxed);
        self.bytes_decoded
            .fetch_add(plan.raw as u64, Ordering::Relaxed);
        self.bytes_read.fetch_add(plan.stored, Ordering::Relaxed);
        self.decode_ns
            .fetch_add(t0.elapsed().as_nanos() as u64, Ordering::Relaxed);
    }
}

/// A decoded layer's bytes: counted while alive, lent per pass (a device backend
/// uploads them per use rather than keeping a copy by id).
struct Decoded {
    bytes: Vec<u8>,
    counters: Arc<Counters>,
    cache_on_device: bool,
}

impl ByteSource for Decoded {
    fn bytes(&self) -> &[u8] {
        &self.bytes
    }
    fn cache_on_device(&self) -> bool {
        self.cache_on_device
    }
}

impl Drop for Decoded {
    fn drop(&mut self) {
        self.counters
            .live
            .fetch_sub(self.bytes.len() as u64, Ordering::Relaxed);
    }
}

/// Where a layer's matrices come from in the pack and go in its decoded buffer.
struct LayerPlan {
    template: LayerWeights,
    /// Per matrix of the template, in table order: its packed tensor's index.
    tensors: Vec<usize>,
    /// Per matrix: its byte range in the decoded buffer.
    ranges: Vec<std::ops::Range<usize>>,
    raw: usize,
    stored: u64,
}

enum Slot {
    Empty,
    Decoding,
    Ready {
        layer: Arc<LayerWeights>,
        /// The pass that used it; `None` while only prefetched.
        pass: Option<PassId>,
    },
}

struct State {
    slots: Vec<Slot>,
    pass: Option<PassId>,
}

struct Inner {
    pack: Arc<PackFile>,
    globals: GlobalWeights,
    layers: Vec<LayerPlan>,
    opts: StoreOptions,
    state: Mutex<State>,
    ready: Condvar,
    counters: Arc<Counters>,
    mapped: bool,
}

/// A [`WeightStore`] over a pack whose layers stay coded until a pass asks for them.
/// See the [module docs](self).
pub struct CompressedStore {
    inner: Arc<Inner>,
    prefetch: Option<(Sender<usize>, JoinHandle<()>)>,
}

/// The GGUF file a [`CompressedStore`] is built from: `pack` decoded except the
/// layers' matrices (`blk.*` tensors of two or more dimensions), which stay zero pages
/// that take no memory. Load the model's weights from it, then hand them to
/// [`CompressedStore::new`].
pub fn skeleton(pack: &PackFile, threads: usize) -> Result<GgufFile> {
    let bare = pack.gguf_with(|_| false, 1)?;
    let coded: std::collections::HashSet<&str> = bare
        .tensors()
        .iter()
        .filter(|t| t.name.starts_with("blk.") && t.dims.len() >= 2)
        .map(|t| t.name.as_str())
        .collect();
    pack.gguf_with(|t| !coded.contains(t.name.as_str()), threads)
}

impl CompressedStore {
    /// A store over `pack` for the weights `globals` and `layers` (loaded from
    /// [`skeleton`]`(pack)`): the layers' matrices are decoded from the pack on demand.
    /// `mapped` says whether the pack is memory-mapped (its bytes then count as disk).
    pub fn new(
        pack: Arc<PackFile>,
        globals: GlobalWeights,
        layers: Vec<LayerWeights>,
        opts: StoreOptions,
        mapped: bool,
    ) -> Result<CompressedStore> {
        let mut plans = Vec::with_capacity(layers.len());
        for template in layers {
            let mut tensors = Vec::new();
            let mut ranges = Vec::new();
            let mut at = 0usize;
            let mut stored = 0u64;
            for w in template.weights() {
                let k = pack
                    .tensors()
                    .iter()
                    .position(|t| t.name == w.name)
                    .ok_or_else(|| Error::NoSuchTensor {
                        path: pack.path().to_path_buf(),
                        name: w.name.clone(),
                    })?;
                let t = &pack.tensors()[k];
                if t.ty != w.ty || t.raw_len != w.bytes.len() as u64 {
                    return Err(Error::BadIndex {
                        path: pack.path().to_path_buf(),
                        detail: format!(
                            "tensor {}: {} bytes of {} in the pack, {} bytes of {} in the model",
                            w.name,
                            t.raw_len,
                            t.ty,
                            w.bytes.len(),
                            w.ty
                        ),
                    });
                }
                tensors.push(k);
                // 64-byte alignment for each matrix, as the SIMD kernels like it.
                at = at.div_ceil(64) * 64;
                ranges.push(at..at + w.bytes.len());
                at += w.bytes.len();
                stored += t.stored_len();
            }
            plans.push(LayerPlan {
                template,
                tensors,
                ranges,
                raw: at,
                stored,
            });
        }
        let n = plans.len();
        let inner = Arc::new(Inner {
            pack,
            globals,
            layers: plans,
            opts: StoreOptions {
                decode_threads: opts.decode_threads.max(1),
                ..opts
            },
            state: Mutex::new(State {
                slots: (0..n).map(|_| Slot::Empty).collect(),
                pass: None,
            }),
            ready: Condvar::new(),
            counters: Arc::new(Counters::default()),
            mapped,
        });
        let prefetch = if inner.opts.prefetch && n > 1 {
            let (tx, rx) = channel::<usize>();
            let worker = inner.clone();
            let handle = std::thread::Builder::new()
                .name("ballast-decode".into())
                .spawn(move || {
                    while let Ok(i) = rx.recv() {
                        let decoded = worker.decode(i);
                        let mut st = worker.lock();
                        // An error leaves the slot empty: the caller decodes again and
                        // meets the error itself, with its names.
                        st.slots[i] = match decoded {
                            Ok(layer) => Slot::Ready { layer, pass: None },
                            Err(_) => Slot::Empty,
                        };
                        drop(st);
                        worker.ready.notify_all();
                    }
                })
                .map_err(|source| Error::Io {
                    path: inner.pack.path().to_path_buf(),
                    source,
                })?;
            Some((tx, handle))
        } else {
            None
        };
        Ok(CompressedStore { inner, prefetch })
    }

    /// The counters so far.
    pub fn stats(&self) -> CompressedStats {
        let c = &self.inner.counters;
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        CompressedStats {
            passes: g(&c.passes),
            requests: g(&c.requests),
            decompressions: g(&c.decompressions),
            bytes_decoded: g(&c.bytes_decoded),
            bytes_read: g(&c.bytes_read),
            decode_time: Duration::from_nanos(g(&c.decode_ns)),
            stall_time: Duration::from_nanos(g(&c.stall_ns)),
            decoded_bytes_now: g(&c.live),
            decoded_bytes_peak: g(&c.peak),
        }
    }

    /// A handle that reads the counters after the store has moved into a model.
    pub fn stats_handle(&self) -> StatsHandle {
        StatsHandle(self.inner.clone())
    }

    /// Stored (coded) bytes of all layers.
    pub fn stored_layer_bytes(&self) -> u64 {
        self.inner.layers.iter().map(|l| l.stored).sum()
    }

    /// Stored (coded) bytes of each layer, in layer order: what streaming a layer
    /// from the pack reads.
    pub fn stored_bytes_per_layer(&self) -> Vec<u64> {
        self.inner.layers.iter().map(|l| l.stored).collect()
    }

    /// Raw bytes of all layers.
    pub fn raw_layer_bytes(&self) -> u64 {
        self.inner.layers.iter().map(|l| l.raw as u64).sum()
    }
}

/// Reads a [`CompressedStore`]'s counters from outside the model that owns it.
#[derive(Clone)]
pub struct StatsHandle(Arc<Inner>);

impl StatsHandle {
    /// The counters so far.
    pub fn get(&self) -> CompressedStats {
        CompressedStore {
            inner: self.0.clone(),
            prefetch: None,
        }
        .stats()
    }
}

impl Inner {
    /// Layer `index`'s plan, or an error naming the index.
    fn layer_plan(&self, index: usize) -> ballast_core::Result<&LayerPlan> {
        self.layers
            .get(index)
            .ok_or(ballast_core::Error::LayerIndex {
                index,
                n_layers: self.layers.len(),
            })
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn kept(&self, index: usize) -> bool {
        self.opts.policy == CachePolicy::Keep || index < self.opts.keep_layers
    }

    /// Decodes layer `index` into a fresh buffer.
    fn decode(&self, index: usize) -> Result<Arc<LayerWeights>> {
        let t0 = Instant::now();
        let plan = &self.layers[index];
        let mut bytes = vec![0u8; plan.raw];
        {
            let mut pieces: Vec<(&PackedTensor, usize, &mut [u8])> = Vec::new();
            let mut rest: &mut [u8] = &mut bytes;
            let mut base = 0;
            for (&k, r) in plan.tensors.iter().zip(&plan.ranges) {
                let t = &self.pack.tensors()[k];
                let tail = std::mem::take(&mut rest);
                let (_, tail) = tail.split_at_mut(r.start - base);
                let (dst, tail) = tail.split_at_mut(r.len());
                rest = tail;
                base = r.end;
                for (i, piece) in dst.chunks_mut(t.chunk_raw.max(1) as usize).enumerate() {
                    pieces.push((t, i, piece));
                }
            }
            run_split(pieces, self.opts.decode_threads, |(t, i, piece)| {
                self.pack.decode_chunk(t, i, piece)
            })?;
        }
        let c = &self.counters;
        let live = c.live.fetch_add(plan.raw as u64, Ordering::Relaxed) + plan.raw as u64;
        c.peak.fetch_max(live, Ordering::Relaxed);
        let source: Arc<dyn ByteSource> = Arc::new(Decoded {
            bytes,
            counters: c.clone(),
            cache_on_device: self.kept(index),
        });
        let mut layer = plan.template.clone();
        for (w, r) in layer.weights_mut().zip(&plan.ranges) {
            w.bytes = WeightBytes::new(source.clone(), r.clone())?;
        }
        c.count_decode(plan, t0);
        Ok(Arc::new(layer))
    }

    /// Layer `index` for `pass`: from the cache, from the worker, or decoded here.
    fn get(&self, pass: PassId, index: usize) -> Result<(Arc<LayerWeights>, bool)> {
        let mut st = self.lock();
        if st.pass.is_none_or(|p| pass > p) {
            st.pass = Some(pass);
            self.counters.passes.fetch_add(1, Ordering::Relaxed);
            if self.opts.policy == CachePolicy::PerPass {
                for (i, slot) in st.slots.iter_mut().enumerate() {
                    if !self.kept(i)
                        && matches!(slot, Slot::Ready { pass: Some(p), .. } if *p < pass)
                    {
                        *slot = Slot::Empty;
                    }
                }
            }
        }
        let waited = Instant::now();
        let mut stalled = false;
        loop {
            match &mut st.slots[index] {
                Slot::Ready { layer, pass: used } => {
                    let layer = layer.clone();
                    let fresh = used.is_none() || *used == Some(pass) || self.kept(index);
                    if fresh {
                        if self.opts.policy == CachePolicy::EveryUse && !self.kept(index) {
                            st.slots[index] = Slot::Empty;
                        } else {
                            *used = Some(pass);
                        }
                        if stalled {
                            self.counters
                                .stall_ns
                                .fetch_add(waited.elapsed().as_nanos() as u64, Ordering::Relaxed);
                        }
                        return Ok((layer, st.pass == Some(pass)));
                    }
                    // Decoded for an earlier pass (a pass id out of order): decode anew.
                    st.slots[index] = Slot::Empty;
                }
                Slot::Decoding => {
                    stalled = true;
                    st = self.ready.wait(st).unwrap_or_else(|p| p.into_inner());
                }
                Slot::Empty => {
                    st.slots[index] = Slot::Decoding;
                    drop(st);
                    let decoded = self.decode(index);
                    let mut st = self.lock();
                    let keep = self.opts.policy != CachePolicy::EveryUse || self.kept(index);
                    st.slots[index] = match &decoded {
                        Ok(layer) if keep => Slot::Ready {
                            layer: layer.clone(),
                            pass: Some(pass),
                        },
                        _ => Slot::Empty,
                    };
                    let current = st.pass == Some(pass);
                    drop(st);
                    self.ready.notify_all();
                    self.counters
                        .stall_ns
                        .fetch_add(waited.elapsed().as_nanos() as u64, Ordering::Relaxed);
                    return decoded.map(|l| (l, current));
                }
            }
        }
    }
}

/// A layer's coded form is its matrices' stored chunks, one after another in table
/// order: what the pack holds for it, read once and decoded per use by a store above
/// (a tiered store keeping its RAM tier coded). Decoding checks every chunk's
/// checksums, as a decode from the pack does, and counts in the same counters.
impl CodedLayers for CompressedStore {
    fn coded_len(&self, index: usize) -> u64 {
        self.inner.layers.get(index).map_or(0, |l| l.stored)
    }

    fn read_coded(&self, index: usize) -> ballast_core::Result<Vec<u8>> {
        let plan = self.inner.layer_plan(index)?;
        let pack = &self.inner.pack;
        let mut coded = Vec::with_capacity(plan.stored as usize);
        for &k in &plan.tensors {
            let t = &pack.tensors()[k];
            for i in 0..t.chunks.len() {
                coded.extend_from_slice(&pack.read_stored(t, i)?);
            }
        }
        Ok(coded)
    }

    fn decode_coded(
        &self,
        index: usize,
        coded: &[u8],
        out: &mut [&mut [u8]],
    ) -> ballast_core::Result<()> {
        let t0 = Instant::now();
        let inner = &self.inner;
        let plan = inner.layer_plan(index)?;
        let pack = &inner.pack;
        let wrong = |detail: String| Error::BadIndex {
            path: pack.path().to_path_buf(),
            detail: format!("decoding layer {index}'s coded form: {detail}"),
        };
        if coded.len() as u64 != plan.stored || out.len() != plan.tensors.len() {
            return Err(wrong(format!(
                "{} coded bytes into {} matrices, the layer has {} bytes in {}",
                coded.len(),
                out.len(),
                plan.stored,
                plan.tensors.len()
            ))
            .into());
        }
        let mut pieces: Vec<(&PackedTensor, usize, &[u8], &mut [u8])> = Vec::new();
        let mut rest = coded;
        for (&k, dst) in plan.tensors.iter().zip(out.iter_mut()) {
            let t = &pack.tensors()[k];
            let step = t.chunk_raw.max(1) as usize;
            // The index was checked at open; a chunk count that does not cover the
            // matrix would leave bytes undecoded, so it is refused here too.
            if dst.len() as u64 != t.raw_len || dst.len().div_ceil(step) != t.chunks.len() {
                return Err(wrong(format!(
                    "{} bytes for {}, which has {}",
                    dst.len(),
                    t.name,
                    t.raw_len
                ))
                .into());
            }
            for (i, (piece, c)) in dst.chunks_mut(step).zip(&t.chunks).enumerate() {
                let (stored, tail) = rest.split_at(c.stored_len as usize);
                rest = tail;
                pieces.push((t, i, stored, piece));
            }
        }
        run_split(
            pieces,
            inner.opts.decode_threads,
            |(t, i, stored, piece)| pack.decode_stored(t, i, stored, piece),
        )?;
        inner.counters.count_decode(plan, t0);
        Ok(())
    }
}

impl WeightStore for CompressedStore {
    fn n_layers(&self) -> usize {
        self.inner.layers.len()
    }

    fn globals(&self) -> &GlobalWeights {
        &self.inner.globals
    }

    fn layer(&self, pass: PassId, index: usize) -> ballast_core::Result<Arc<LayerWeights>> {
        let n = self.inner.layers.len();
        if index >= n {
            return Err(ballast_core::Error::LayerIndex { index, n_layers: n });
        }
        self.inner.counters.requests.fetch_add(1, Ordering::Relaxed);
        let (layer, _) = self.inner.get(pass, index)?;
        if let Some((tx, _)) = &self.prefetch {
            let next = (index + 1) % n;
            let mut st = self.inner.lock();
            let stale = match &st.slots[next] {
                Slot::Empty => true,
                // Used in an earlier pass and not kept: the next pass needs it again.
                Slot::Ready { pass: Some(p), .. } => {
                    *p < pass
                        && !self.inner.kept(next)
                        && self.inner.opts.policy != CachePolicy::Keep
                }
                _ => false,
            };
            if stale && tx.send(next).is_ok() {
                st.slots[next] = Slot::Decoding;
            }
        }
        Ok(layer)
    }

    fn held_bytes(&self) -> TierBytes {
        let g = &self.inner.globals;
        let mut globals = (g.token_embd.bytes.len() + g.output_norm.len() * 4) as u64;
        if g.output.name != g.token_embd.name {
            globals += g.output.bytes.len() as u64;
        }
        let vectors: u64 = self
            .inner
            .layers
            .iter()
            .map(|l| {
                l.template
                    .vectors
                    .iter()
                    .map(|(_, v)| v.len() as u64 * 4)
                    .sum::<u64>()
            })
            .sum();
        let live = self.inner.counters.live.load(Ordering::Relaxed);
        let coded = self.stored_layer_bytes();
        if self.inner.mapped {
            TierBytes {
                device: globals + vectors + live,
                ram: 0,
                disk: coded,
            }
        } else {
            TierBytes {
                device: globals + vectors + live + coded,
                ..TierBytes::default()
            }
        }
    }

    fn moved_bytes(&self) -> u64 {
        self.inner.counters.bytes_read.load(Ordering::Relaxed)
    }
}

impl Drop for CompressedStore {
    fn drop(&mut self) {
        if let Some((tx, handle)) = self.prefetch.take() {
            drop(tx);
            let _ = handle.join();
        }
    }
}
