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
//!
//! With [`StoreOptions::device_decode`] (for a backend with its own device), a layer
//! whose every matrix is coded with a coder the device decodes ([`Coder::device_decodable`]:
//! `rans-lanes` or raw) and that is not kept decoded is not decoded here: it is lent
//! coded ([`ByteSource::coded`]), so the device uploads the stored chunks and decodes
//! them itself. Its chunks are checked against their stored CRC-32 at every request,
//! and the first request of each layer decodes it once on the CPU against the raw
//! CRC-32, so the device only ever decodes streams the CPU decoder has accepted. Its
//! host bytes, if anything asks for them, are decoded on first use.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{channel, Sender};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use ballast_core::gguf::GgufFile;
use ballast_core::store::PassId;
use ballast_core::weights::{
    ByteSource, ChunkCoding, CodedChunk, GlobalWeights, LayerWeights, Plane, WeightBytes,
};
use ballast_core::{CodedLayers, TierBytes, WeightStore};

use crate::codec::{Coder, Transform};
use crate::error::{Error, Result};
use crate::pack::{run_split, PackFile, PackedTensor};
use crate::transform;

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
    /// Lend layers coded to a device that decodes them (see the [module docs](self)).
    pub device_decode: bool,
}

impl Default for StoreOptions {
    fn default() -> StoreOptions {
        StoreOptions {
            policy: CachePolicy::EveryUse,
            keep_layers: 0,
            prefetch: true,
            decode_threads: 1,
            device_decode: false,
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
    /// Layers lent coded, for a device to decode ([`StoreOptions::device_decode`]).
    pub coded_lends: u64,
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
    coded_lends: AtomicU64,
}

impl Counters {
    /// Counts `bytes` decoded bytes coming alive.
    fn add_live(&self, bytes: usize) {
        let live = self.live.fetch_add(bytes as u64, Ordering::Relaxed) + bytes as u64;
        self.peak.fetch_max(live, Ordering::Relaxed);
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
    fn bytes(&self) -> ballast_core::Result<&[u8]> {
        Ok(&self.bytes)
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
    /// Per matrix: the planes of its type (what its plane-coded chunks decode to).
    planes: Vec<Vec<Plane>>,
    /// Every chunk of every matrix is coded with a coder a device decodes.
    device_decodable: bool,
    /// The layer has been decoded once on the CPU and its raw checksums held.
    validated: AtomicBool,
}

/// A layer lent coded: the pack's stored chunks of each matrix, for a device that
/// decodes them itself ([`ByteSource::coded`]); its host bytes are decoded on first use.
struct CodedLayer {
    pack: Arc<PackFile>,
    /// Per matrix, in table order: its packed tensor's index, its byte range in the
    /// layer, its planes.
    tensors: Vec<usize>,
    ranges: Vec<std::ops::Range<usize>>,
    planes: Vec<Vec<Plane>>,
    raw: usize,
    decoded: OnceLock<Vec<u8>>,
    counters: Arc<Counters>,
}

impl ByteSource for CodedLayer {
    /// The layer decoded on the CPU, on first use. The chunks passed their stored
    /// checksums when this layer was lent, and the CPU decoder accepted the same stored
    /// bytes at the layer's first request; decoding them again fails only if the pack
    /// was changed or cut short under the map since, which is an error naming the
    /// file, tensor and chunk (and is asked again on the next call).
    fn bytes(&self) -> ballast_core::Result<&[u8]> {
        if let Some(bytes) = self.decoded.get() {
            return Ok(bytes);
        }
        let mut bytes = vec![0u8; self.raw];
        decode_layer(&self.pack, &self.tensors, &self.ranges, &mut bytes, 1)?;
        // Two threads may decode at once: the first kept is counted, the other dropped.
        Ok(self.decoded.get_or_init(|| {
            self.counters.add_live(self.raw);
            bytes
        }))
    }

    fn byte_len(&self) -> usize {
        self.raw
    }

    fn cache_on_device(&self) -> bool {
        false
    }

    fn coded(&self, range: std::ops::Range<usize>) -> Option<Vec<CodedChunk<'_>>> {
        let m = self.ranges.iter().position(|r| *r == range)?;
        let t = &self.pack.tensors()[self.tensors[m]];
        t.chunks
            .iter()
            .map(|c| {
                let coding = match c.codec.coder {
                    Coder::Raw => ChunkCoding::Raw,
                    Coder::RansLanes => ChunkCoding::RansLanes,
                    Coder::Zstd | Coder::Rans => return None,
                };
                Some(CodedChunk {
                    stored: self.pack.stored(c),
                    raw_len: c.raw_len as usize,
                    coding,
                    block_bytes: t.ty.block_bytes(),
                    planes: match c.codec.transform {
                        Transform::Planes => &self.planes[m],
                        Transform::None => &[],
                    },
                })
            })
            .collect()
    }
}

impl Drop for CodedLayer {
    fn drop(&mut self) {
        if self.decoded.get().is_some() {
            self.counters
                .live
                .fetch_sub(self.raw as u64, Ordering::Relaxed);
        }
    }
}

/// `plan`'s layer with its matrices' bytes in `source`.
fn lend(plan: &LayerPlan, source: Arc<dyn ByteSource>) -> Result<Arc<LayerWeights>> {
    let mut layer = plan.template.clone();
    for (w, r) in layer.weights_mut().zip(&plan.ranges) {
        w.bytes = WeightBytes::new(source.clone(), r.clone())?;
    }
    Ok(Arc::new(layer))
}

/// Decodes the packed tensors `tensors` of `pack` into their `ranges` of `bytes`, on
/// `threads` threads.
fn decode_layer(
    pack: &PackFile,
    tensors: &[usize],
    ranges: &[std::ops::Range<usize>],
    bytes: &mut [u8],
    threads: usize,
) -> Result<()> {
    let mut pieces: Vec<(&PackedTensor, usize, &mut [u8])> = Vec::new();
    let mut rest: &mut [u8] = bytes;
    let mut base = 0;
    for (&k, r) in tensors.iter().zip(ranges) {
        let t = &pack.tensors()[k];
        let tail = std::mem::take(&mut rest);
        let (_, tail) = tail.split_at_mut(r.start - base);
        let (dst, tail) = tail.split_at_mut(r.len());
        rest = tail;
        base = r.end;
        for (i, piece) in dst.chunks_mut(t.chunk_raw.max(1) as usize).enumerate() {
            pieces.push((t, i, piece));
        }
    }
    run_split(pieces, threads, |(t, i, piece)| {
        pack.decode_chunk(t, i, piece)
    })
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
    /// The most bytes of decoded embedding rows held at once (0: the table is tied to
    /// the head and decoded with it).
    rows_on_demand: u64,
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
    let mut coded: std::collections::HashSet<&str> = bare
        .tensors()
        .iter()
        .filter(|t| t.name.starts_with("blk.") && t.dims.len() >= 2)
        .map(|t| t.name.as_str())
        .collect();
    // An embedding table that is not also the output head is read a row per token:
    // `CompressedStore::new` decodes its rows on demand instead (see `RowsOnDemand`).
    if bare.tensor(OUTPUT).is_ok() && bare.tensor(TOKEN_EMBD).is_ok() {
        coded.insert(TOKEN_EMBD);
    }
    pack.gguf_with(|t| !coded.contains(t.name.as_str()), threads)
}

const TOKEN_EMBD: &str = "token_embd.weight";
const OUTPUT: &str = "output.weight";

/// A tensor of a pack decoded on demand: a range by the chunks that cover it (the last
/// few kept, as a lookup's next rows are often nearby), the whole only when something
/// asks for all of it (a device uploading the table), decoded then and kept. What an
/// untied embedding table is in a [`CompressedStore`]: a token reads one row, where a
/// table decoded whole when the pack opens would hold a layer's worth of RAM or more.
struct RowsOnDemand {
    pack: Arc<PackFile>,
    tensor: usize,
    whole: OnceLock<Vec<u8>>,
    recent: Mutex<std::collections::VecDeque<(usize, Arc<Vec<u8>>)>>,
}

/// Decoded chunks a [`RowsOnDemand`] keeps (at most 256 KiB each by default).
const RECENT_CHUNKS: usize = 16;

impl RowsOnDemand {
    fn tensor(&self) -> &PackedTensor {
        &self.pack.tensors()[self.tensor]
    }

    /// Chunk `index` decoded, from the recent ones or decoded now.
    fn chunk(&self, index: usize) -> ballast_core::Result<Arc<Vec<u8>>> {
        let lock = || self.recent.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((_, c)) = lock().iter().find(|(i, _)| *i == index) {
            return Ok(c.clone());
        }
        let t = self.tensor();
        let raw = self.pack.chunk(t, index)?.raw_len as usize;
        let mut out = vec![0u8; raw];
        self.pack.decode_chunk(t, index, &mut out)?;
        let out = Arc::new(out);
        let mut recent = lock();
        if recent.len() == RECENT_CHUNKS {
            recent.pop_front();
        }
        recent.push_back((index, out.clone()));
        Ok(out)
    }
}

impl ByteSource for RowsOnDemand {
    fn bytes(&self) -> ballast_core::Result<&[u8]> {
        if let Some(all) = self.whole.get() {
            return Ok(all);
        }
        let t = self.tensor();
        let mut all = vec![0u8; t.raw_len as usize];
        self.pack.decode_tensor(t, &mut all, 1)?;
        // Two threads may both decode; either result is the same bytes.
        Ok(self.whole.get_or_init(|| all))
    }

    fn byte_len(&self) -> usize {
        self.tensor().raw_len as usize
    }

    fn range(
        &self,
        range: std::ops::Range<usize>,
    ) -> ballast_core::Result<std::borrow::Cow<'_, [u8]>> {
        use std::borrow::Cow;
        let t = self.tensor();
        let len = t.raw_len as usize;
        if range.start > range.end || range.end > len {
            return Err(ballast_core::Error::WeightRange {
                start: range.start,
                end: range.end,
                len,
            });
        }
        if let Some(all) = self.whole.get() {
            return Ok(Cow::Borrowed(&all[range]));
        }
        let step = t.chunk_raw.max(1) as usize;
        let mut out = Vec::with_capacity(range.len());
        let mut at = range.start;
        while at < range.end {
            let index = at / step;
            let chunk = self.chunk(index)?;
            let from = at - index * step;
            let to = (range.end - index * step).min(chunk.len());
            if to <= from {
                return Err(Error::BadIndex {
                    path: self.pack.path().to_path_buf(),
                    detail: format!("chunk {index} of {} ends before byte {at}", t.name),
                }
                .into());
            }
            out.extend_from_slice(&chunk[from..to]);
            at = index * step + to;
        }
        Ok(Cow::Owned(out))
    }
}

impl CompressedStore {
    /// A store over `pack` for the weights `globals` and `layers` (loaded from
    /// [`skeleton`]`(pack)`): the layers' matrices are decoded from the pack on demand.
    /// `mapped` says whether the pack is memory-mapped (its bytes then count as disk).
    pub fn new(
        pack: Arc<PackFile>,
        mut globals: GlobalWeights,
        layers: Vec<LayerWeights>,
        opts: StoreOptions,
        mapped: bool,
    ) -> Result<CompressedStore> {
        // The skeleton leaves an untied embedding table undecoded: its rows come from
        // the pack as lookups ask for them.
        let mut rows_on_demand = 0;
        if !globals.tied() {
            let embd = globals.token_embd();
            if let Some(k) = pack.tensors().iter().position(|t| t.name == embd.name) {
                if pack.tensors()[k].raw_len != embd.bytes.len() as u64 {
                    return Err(Error::BadIndex {
                        path: pack.path().to_path_buf(),
                        detail: format!(
                            "tensor {}: {} bytes in the pack, {} in the model",
                            embd.name,
                            pack.tensors()[k].raw_len,
                            embd.bytes.len()
                        ),
                    });
                }
                let source: Arc<dyn ByteSource> = Arc::new(RowsOnDemand {
                    pack: pack.clone(),
                    tensor: k,
                    whole: OnceLock::new(),
                    recent: Mutex::default(),
                });
                let len = embd.bytes.len();
                globals.token_embd_mut().bytes = WeightBytes::new(source, 0..len)?;
                rows_on_demand = RECENT_CHUNKS as u64 * u64::from(pack.tensors()[k].chunk_raw);
            }
        }
        let mut plans = Vec::with_capacity(layers.len());
        for template in layers {
            let mut tensors = Vec::new();
            let mut ranges = Vec::new();
            let mut at = 0usize;
            let mut stored = 0u64;
            let mut planes = Vec::new();
            let mut device_decodable = true;
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
                planes.push(transform::planes(t.ty));
                device_decodable &= t.chunks.iter().all(|c| c.codec.coder.device_decodable());
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
                planes,
                device_decodable,
                validated: AtomicBool::new(false),
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
            rows_on_demand,
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
            coded_lends: g(&c.coded_lends),
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
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Layer `index`'s plan, or an error naming the index.
    fn layer_plan(&self, index: usize) -> ballast_core::Result<&LayerPlan> {
        self.layers
            .get(index)
            .ok_or(ballast_core::Error::LayerIndex {
                index,
                n_layers: self.layers.len(),
            })
    }

    fn kept(&self, index: usize) -> bool {
        self.opts.policy == CachePolicy::Keep || index < self.opts.keep_layers
    }

    /// Layer `index`, decoded into a fresh buffer, or lent coded to a device that
    /// decodes it (checked as the [module docs](self) say).
    fn decode(&self, index: usize) -> Result<Arc<LayerWeights>> {
        let plan = &self.layers[index];
        if !(self.opts.device_decode && plan.device_decodable && !self.kept(index)) {
            return self.decode_here(index);
        }
        let decoded = OnceLock::new();
        if !plan.validated.load(Ordering::Relaxed) {
            // The first pass's device decodes the layer too; its host bytes are these.
            let t0 = Instant::now();
            let bytes = self.decode_bytes(plan)?;
            self.count_decode(plan, t0);
            plan.validated.store(true, Ordering::Relaxed);
            decoded.set(bytes).expect("a fresh cell is empty");
        } else {
            for &k in &plan.tensors {
                let t = &self.pack.tensors()[k];
                for i in 0..t.chunks.len() {
                    self.pack.checked_stored(t, i)?;
                }
            }
            self.counters
                .bytes_read
                .fetch_add(plan.stored, Ordering::Relaxed);
        }
        let layer = lend(
            plan,
            Arc::new(CodedLayer {
                pack: self.pack.clone(),
                tensors: plan.tensors.clone(),
                ranges: plan.ranges.clone(),
                planes: plan.planes.clone(),
                raw: plan.raw,
                decoded,
                counters: self.counters.clone(),
            }),
        )?;
        self.counters.coded_lends.fetch_add(1, Ordering::Relaxed);
        Ok(layer)
    }

    /// Decodes layer `index` into a fresh buffer.
    fn decode_here(&self, index: usize) -> Result<Arc<LayerWeights>> {
        let t0 = Instant::now();
        let plan = &self.layers[index];
        let bytes = self.decode_bytes(plan)?;
        let layer = lend(
            plan,
            Arc::new(Decoded {
                bytes,
                counters: self.counters.clone(),
                cache_on_device: self.kept(index),
            }),
        )?;
        self.count_decode(plan, t0);
        Ok(layer)
    }

    /// `plan`'s layer decoded on the CPU, counted alive.
    fn decode_bytes(&self, plan: &LayerPlan) -> Result<Vec<u8>> {
        let mut bytes = vec![0u8; plan.raw];
        decode_layer(
            &self.pack,
            &plan.tensors,
            &plan.ranges,
            &mut bytes,
            self.opts.decode_threads,
        )?;
        self.counters.add_live(plan.raw);
        Ok(bytes)
    }

    /// Counts one decode of `plan`'s layer on the CPU, begun at `t0`.
    fn count_decode(&self, plan: &LayerPlan, t0: Instant) {
        let c = &self.counters;
        c.decompressions.fetch_add(1, Ordering::Relaxed);
        c.bytes_decoded
            .fetch_add(plan.raw as u64, Ordering::Relaxed);
        c.bytes_read.fetch_add(plan.stored, Ordering::Relaxed);
        c.decode_ns
            .fetch_add(t0.elapsed().as_nanos() as u64, Ordering::Relaxed);
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

impl CompressedStore {
    /// Bytes this store holds beside its layers and the skeleton: the decoded chunks of
    /// an untied embedding table whose rows it decodes on demand (at most
    /// `RECENT_CHUNKS` of them; the whole table only if a device asks for it whole).
    pub fn embedding_rows_held(&self) -> u64 {
        self.inner.rows_on_demand
    }

    /// [`CodedLayers::read_decode`] in spans of at most `span` stored bytes (a chunk
    /// larger than that is read alone): the same bytes whatever the span.
    pub fn read_decode_in_spans(
        &self,
        index: usize,
        out: &mut [&mut [u8]],
        span: u64,
    ) -> ballast_core::Result<u64> {
        let t0 = Instant::now();
        let inner = &self.inner;
        let plan = inner.layer_plan(index)?;
        let pack = &inner.pack;
        if out.len() != plan.tensors.len() {
            return Err(Error::BadIndex {
                path: pack.path().to_path_buf(),
                detail: format!(
                    "decoding layer {index} into {} matrices, the layer has {}",
                    out.len(),
                    plan.tensors.len()
                ),
            }
            .into());
        }
        // Every chunk of the layer with the place it decodes to, in table order.
        let mut pieces: Vec<(&PackedTensor, usize, &mut [u8])> = Vec::new();
        for (&k, dst) in plan.tensors.iter().zip(out.iter_mut()) {
            let t = &pack.tensors()[k];
            let step = t.chunk_raw.max(1) as usize;
            if dst.len() as u64 != t.raw_len || dst.len().div_ceil(step) != t.chunks.len() {
                return Err(Error::BadIndex {
                    path: pack.path().to_path_buf(),
                    detail: format!(
                        "decoding layer {index}: {} bytes for {}, which has {}",
                        dst.len(),
                        t.name,
                        t.raw_len
                    ),
                }
                .into());
            }
            for (i, piece) in dst.chunks_mut(step).enumerate() {
                pieces.push((t, i, piece));
            }
        }
        // Spans read from the file go into one buffer per thread, kept for the thread's
        // life: a tiered store's reader allocates it once, where a buffer per layer let
        // the allocator keep two or three spans' worth beside it.
        thread_local! {
            static SPAN_BUF: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
        }
        SPAN_BUF
            .with_borrow_mut(|buf| {
                if buf.capacity() < span.min(plan.stored) as usize {
                    *buf = Vec::with_capacity(span.min(plan.stored) as usize);
                }
                self.decode_spans(pieces, span, buf)
            })
            .inspect(|_| inner.count_decode(plan, t0))
    }

    /// Reads `pieces` (a layer's chunks with their places) in spans of at most
    /// `span` stored bytes through `buf`, decoding each span before reading the next.
    fn decode_spans(
        &self,
        pieces: Vec<(&PackedTensor, usize, &mut [u8])>,
        span: u64,
        buf: &mut Vec<u8>,
    ) -> ballast_core::Result<u64> {
        let inner = &self.inner;
        let pack = &inner.pack;
        let mut read = 0u64;
        let mut rest = pieces.into_iter().peekable();
        while let Some(first) = rest.next() {
            let start = first.0.chunks[first.1].offset;
            let mut end = start + u64::from(first.0.chunks[first.1].stored_len);
            let mut group = vec![first];
            // The next chunks while they follow in the file and the span has room.
            while let Some((t, i, _)) = rest.peek() {
                let c = &t.chunks[*i];
                if c.offset != end || end - start + u64::from(c.stored_len) > span {
                    break;
                }
                end += u64::from(c.stored_len);
                group.extend(rest.next());
            }
            let stored = match pack.stored_span_in(start, (end - start) as usize, buf)? {
                Some(bytes) => bytes,
                None => &buf[..],
            };
            read += end - start;
            let jobs: Vec<_> = group
                .into_iter()
                .map(|(t, i, piece)| {
                    let c = &t.chunks[i];
                    let at = (c.offset - start) as usize;
                    (t, i, &stored[at..at + c.stored_len as usize], piece)
                })
                .collect();
            run_split(jobs, inner.opts.decode_threads, |(t, i, s, piece)| {
                pack.decode_stored(t, i, s, piece)
            })?;
        }
        Ok(read)
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
        inner.count_decode(plan, t0);
        Ok(())
    }

    /// Reads the layer's chunks in spans of consecutive chunks of at most
    /// [`READ_DECODE_SPAN`] stored bytes (one read each), decoding each span into its
    /// place before reading the next: a reader holds one span, not the coded layer.
    fn read_decode(&self, index: usize, out: &mut [&mut [u8]]) -> ballast_core::Result<u64> {
        self.read_decode_in_spans(index, out, READ_DECODE_SPAN)
    }

    fn read_decode_held(&self, index: usize) -> u64 {
        // A span, or one chunk where a chunk is larger.
        let largest = self.inner.layer_plan(index).ok().map_or(0, |plan| {
            plan.tensors
                .iter()
                .flat_map(|&k| &self.inner.pack.tensors()[k].chunks)
                .map(|c| u64::from(c.stored_len))
                .max()
                .unwrap_or(0)
        });
        largest.max(READ_DECODE_SPAN).min(self.coded_len(index))
    }
}

/// Stored bytes [`CompressedStore`]'s `read_decode` reads at once: large enough that a
/// read costs the disk's throughput, not its latency; small beside a layer.
pub const READ_DECODE_SPAN: u64 = 8 << 20;

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
        let globals = g.byte_size() as u64;
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
