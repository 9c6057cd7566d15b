//! [`TieredStore`]: a [`WeightStore`] that keeps the layers a [`Plan`] makes resident
//! in memory and streams the others from the model file through a ring of slots, with
//! reader threads prefetching the next layers while the current one computes.

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use ballast_core::gguf::GgufFile;
use ballast_core::store::PassId;
use ballast_core::weights::{ByteSource, ExpertFetch, GlobalWeights, LayerWeights, WeightBytes};
use ballast_core::{CodedLayers, ModelConfig, TierBytes, WeightStore};
use crossbeam_channel::{Receiver, Sender};

use crate::experts::{
    is_expert_role, ExpertCache, ExpertCounters, ExpertStats, ExpertTensor, LayerExperts,
};
use crate::io::{AlignedBuf, ReadAt};
use crate::plan::{Plan, Tier, IO_ALIGN};
use crate::{Error, ModelShape, Result};

/// Tensors of one layer closer than this in the file are read in one request.
const MERGE_GAP: u64 = 64 << 10;

/// One aligned read of a layer: `len` bytes at `file_offset` into the slot at
/// `buf_offset`; the layer's bytes end `needed` bytes into it (the rest is padding the
/// file may not have).
#[derive(Clone, Debug)]
struct Extent {
    file_offset: u64,
    len: u64,
    needed: u64,
    buf_offset: u64,
}

/// Where a layer's tensors are in the file and in its slot.
struct LayerLayout {
    template: LayerWeights,
    extents: Vec<Extent>,
    /// For each matrix of the layer's table, in table order: its byte range
    /// in the slot.
    ranges: Vec<std::ops::Range<usize>>,
    /// Bytes of a slot holding this layer.
    slot_len: u64,
    /// Real bytes of the layer's tensors.
    bytes: u64,
    /// The stacked expert tensors left out of the slot, read expert by expert when
    /// the router has chosen (empty unless the layer streams its experts).
    experts: Arc<Vec<ExpertTensor>>,
}

impl LayerLayout {
    /// Where `template`'s tensors are in `file` and in a slot; with `stream_experts`,
    /// its stacked expert tensors stay out of the slot.
    fn new(
        file: &GgufFile,
        mut template: LayerWeights,
        stream_experts: bool,
    ) -> Result<LayerLayout> {
        let bytes = template.byte_size() as u64;
        let mut experts = Vec::new();
        if stream_experts {
            for (role, w) in &template.matrices {
                if is_expert_role(role) {
                    experts.push(ExpertTensor::new(file, role, w)?);
                }
            }
            template.matrices.retain(|(role, _)| !is_expert_role(role));
        }
        let mut spans: Vec<(u64, u64, usize)> = Vec::new();
        for (k, w) in template.weights().enumerate() {
            let info = file.tensor(&w.name)?;
            spans.push((info.offset, info.n_bytes, k));
        }
        spans.sort();
        let mut extents: Vec<Extent> = Vec::new();
        let mut ranges = vec![0..0; template.matrices.len()];
        let mut buf_end = 0u64;
        for &(off, len, k) in &spans {
            let merge = extents
                .last()
                .is_some_and(|e| off <= e.file_offset + e.needed + MERGE_GAP);
            if !merge {
                let start = off / IO_ALIGN * IO_ALIGN;
                extents.push(Extent {
                    file_offset: start,
                    len: 0,
                    needed: 0,
                    buf_offset: buf_end,
                });
            }
            let e = extents.last_mut().expect("pushed above");
            e.needed = e.needed.max(off + len - e.file_offset);
            e.len = e.needed.div_ceil(IO_ALIGN) * IO_ALIGN;
            buf_end = e.buf_offset + e.len;
            let at = (e.buf_offset + off - e.file_offset) as usize;
            ranges[k] = at..at + len as usize;
        }
        Ok(LayerLayout {
            bytes,
            template,
            extents,
            ranges,
            slot_len: buf_end,
            experts: Arc::new(experts),
        })
    }

    /// A layout for a layer fetched from another store: its matrices packed one
    /// after another (each on a 64-byte boundary) in a slot. The template keeps the
    /// names, types, shapes, norms and biases, not the bytes.
    fn packed(layer: &LayerWeights) -> LayerLayout {
        let mut ranges = Vec::with_capacity(layer.matrices.len());
        let mut end = 0usize;
        for w in layer.weights() {
            let at = end.div_ceil(64) * 64;
            ranges.push(at..at + w.bytes.len());
            end = at + w.bytes.len();
        }
        let mut template = layer.clone();
        for w in template.weights_mut() {
            w.bytes = WeightBytes::from_vec(Vec::new());
        }
        LayerLayout {
            bytes: layer.byte_size() as u64,
            template,
            extents: Vec::new(),
            ranges,
            slot_len: (end as u64).div_ceil(IO_ALIGN) * IO_ALIGN,
            experts: Arc::default(),
        }
    }

    /// The layer's weights pointing into `source`, a buffer this layout was read into.
    fn weights(&self, source: Arc<dyn ByteSource>) -> Result<LayerWeights> {
        let mut l = self.template.clone();
        for (w, r) in l.weights_mut().zip(&self.ranges) {
            w.bytes = WeightBytes::new(source.clone(), r.clone())?;
        }
        Ok(l)
    }
}

/// What a read is for, in error messages.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Part {
    /// A transformer layer.
    Layer(usize),
    /// The output head.
    Head,
    /// One expert of a layer's mixture of experts (one matrix of a stacked tensor).
    Expert {
        /// The layer.
        layer: usize,
        /// The expert.
        index: usize,
    },
}

impl std::fmt::Display for Part {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Part::Layer(i) => write!(f, "layer {i}"),
            Part::Head => write!(f, "the output head"),
            Part::Expert { layer, index } => write!(f, "expert {index} of layer {layer}"),
        }
    }
}

/// Reads `needed` bytes at `file_offset` (aligned) into the start of `buf` (aligned
/// and large enough).
pub(crate) fn read_range(
    reader: &dyn ReadAt,
    part: Part,
    file_offset: u64,
    needed: u64,
    buf: &mut AlignedBuf,
) -> Result<()> {
    let extent = Extent {
        file_offset,
        len: buf.len() as u64,
        needed,
        buf_offset: 0,
    };
    read_extents(reader, part, &[extent], buf)
}

/// Reads `extents` into `buf` through `reader`.
fn read_extents(
    reader: &dyn ReadAt,
    part: Part,
    extents: &[Extent],
    buf: &mut AlignedBuf,
) -> Result<()> {
    for e in extents {
        let dst = &mut buf.as_mut_slice()[e.buf_offset as usize..(e.buf_offset + e.len) as usize];
        let mut got = 0u64;
        while got < e.needed {
            let n = reader
                .read_at(&mut dst[got as usize..], e.file_offset + got)
                .map_err(|source| Error::LayerRead {
                    part,
                    path: reader.path().to_path_buf(),
                    offset: e.file_offset + got,
                    source,
                })?;
            got += n as u64;
            // The file ended early: nothing more, or a piece that is not whole blocks
            // (direct I/O cannot continue from there).
            if n == 0 || (got < e.needed && got % IO_ALIGN != 0) {
                return Err(Error::ShortRead {
                    part,
                    path: reader.path().to_path_buf(),
                    offset: e.file_offset,
                    wanted: e.needed,
                    got,
                });
            }
        }
    }
    Ok(())
}

/// Where a [`TieredStore`] gets the layers it does not keep: the model file (aligned
/// reads that bypass the page cache), another [`WeightStore`] beneath it (a store that
/// decompresses on demand, say), whose layers are copied into the slots, or a store with
/// a coded form of each layer ([`CodedLayers`]), decoded straight into the slots from
/// the coded bytes this store holds (its coded RAM tier) or reads from the store.
enum Beneath {
    File(Arc<dyn ReadAt>),
    Store {
        inner: Arc<dyn WeightStore>,
        passes: ballast_core::store::PassCounter,
    },
    Coded {
        inner: Arc<dyn CodedLayers>,
        passes: ballast_core::store::PassCounter,
        /// The coded form of each layer the plan holds coded in RAM.
        held: Vec<Option<Vec<u8>>>,
    },
}

/// The slices of `buf` at `ranges` (ascending and disjoint, as a packed layout puts a
/// layer's matrices), one per matrix.
fn matrix_slices<'a>(
    mut buf: &'a mut [u8],
    ranges: &[std::ops::Range<usize>],
) -> Vec<&'a mut [u8]> {
    let mut slices = Vec::with_capacity(ranges.len());
    let mut base = 0;
    for r in ranges {
        let (_, tail) = std::mem::take(&mut buf).split_at_mut(r.start - base);
        let (matrix, tail) = tail.split_at_mut(r.len());
        slices.push(matrix);
        buf = tail;
        base = r.end;
    }
    slices
}

impl Beneath {
    /// Fills `buf` with layer `index`'s bytes where `layout` puts them; returns the
    /// bytes moved from beneath (a coded layer held in RAM moves none).
    fn fetch(&self, index: usize, layout: &LayerLayout, buf: &mut AlignedBuf) -> Result<u64> {
        match self {
            Beneath::Coded { inner, held, .. } => {
                let mut out = matrix_slices(buf.as_mut_slice(), &layout.ranges);
                match held.get(index).and_then(Option::as_ref) {
                    Some(coded) => {
                        inner.decode_coded(index, coded, &mut out)?;
                        Ok(0)
                    }
                    // Read and decoded piece by piece: a reader holds a piece of the
                    // coded form, not all of it.
                    None => Ok(inner.read_decode(index, &mut out)?),
                }
            }
            Beneath::File(reader) => {
                read_extents(reader.as_ref(), Part::Layer(index), &layout.extents, buf)?;
                Ok(layout.extents.iter().map(|e| e.len).sum())
            }
            Beneath::Store { inner, passes } => {
                let layer = inner.layer(passes.next(), index)?;
                let mut moved = 0u64;
                for (w, r) in layer.weights().zip(&layout.ranges) {
                    let bytes = w.bytes.as_slice()?;
                    if bytes.len() != r.len() {
                        return Err(Error::PlanMismatch {
                            why: format!(
                                "the store beneath gave {} bytes for {}, {} when the store was made",
                                bytes.len(),
                                w.name,
                                r.len()
                            ),
                        });
                    }
                    buf.as_mut_slice()[r.clone()].copy_from_slice(bytes);
                    moved += bytes.len() as u64;
                }
                Ok(moved)
            }
        }
    }

    /// Layer `index` as it is beneath: the file's memory-mapped bytes (`layout`'s
    /// template), or the store beneath's answer. A separate device keeps its device tier
    /// this way: the backend uploads it once.
    fn as_loaded(&self, index: usize, layout: &LayerLayout) -> Result<Arc<LayerWeights>> {
        match self {
            Beneath::File(_) => Ok(Arc::new(layout.template.clone())),
            Beneath::Store { inner, passes } => Ok(inner.layer(passes.next(), index)?),
            Beneath::Coded { inner, passes, .. } => Ok(inner.layer(passes.next(), index)?),
        }
    }

    /// The file read, for error messages (the store beneath has none).
    fn path(&self) -> PathBuf {
        match self {
            Beneath::File(reader) => reader.path().to_path_buf(),
            Beneath::Store { .. } | Beneath::Coded { .. } => PathBuf::from("<the store beneath>"),
        }
    }

    fn mode(&self) -> &'static str {
        match self {
            Beneath::File(reader) => reader.mode(),
            Beneath::Store { .. } => "copied from the store beneath",
            Beneath::Coded { .. } => "decoded from the store beneath's coded form",
        }
    }

    /// Bytes of the coded layers held in RAM.
    fn held_coded_bytes(&self) -> u64 {
        match self {
            Beneath::Coded { held, .. } => held.iter().flatten().map(|c| c.len() as u64).sum(),
            _ => 0,
        }
    }
}

/// Bytes that stay in memory for the life of the store: where the CPU backend computes
/// (`on_device`), or a GPU plan's RAM tier, which a device backend uploads per use and
/// must not cache on the device.
struct Resident {
    buf: AlignedBuf,
    on_device: bool,
}

impl ByteSource for Resident {
    fn bytes(&self) -> ballast_core::Result<&[u8]> {
        Ok(self.buf.as_slice())
    }

    fn cache_on_device(&self) -> bool {
        self.on_device
    }
}

/// A slot handed to the forward pass: its buffer goes back to the ring when the last
/// weight pointing into it is dropped.
struct Slot {
    buf: Option<AlignedBuf>,
    home: Sender<AlignedBuf>,
}

impl ByteSource for Slot {
    fn bytes(&self) -> ballast_core::Result<&[u8]> {
        Ok(self.buf.as_ref().map_or(&[], |b| b.as_slice()))
    }

    /// Lent for one use: the slot holds another layer next time.
    fn cache_on_device(&self) -> bool {
        false
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        if let Some(b) = self.buf.take() {
            // The store may be gone already; then the buffer is simply freed.
            let _ = self.home.send(b);
        }
    }
}

struct Job {
    layer: usize,
    buf: AlignedBuf,
}

struct Done {
    layer: usize,
    buf: AlignedBuf,
    result: Result<()>,
}

/// What the consumer side of the pipeline knows.
#[derive(Default)]
struct Ring {
    free: Vec<AlignedBuf>,
    ready: HashMap<usize, AlignedBuf>,
    failed: HashMap<usize, Error>,
    in_flight: HashSet<usize>,
    handed_out: usize,
}

/// Counters of a [`TieredStore`], cumulative since it was made.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StreamStats {
    /// Bytes read from the model file by the reader threads (aligned reads).
    pub disk_bytes: u64,
    /// Layer reads done.
    pub disk_reads: u64,
    /// Time at least one reader thread was reading: the disk link's busy time (with
    /// several reader threads, overlapping reads count once).
    pub read_time: Duration,
    /// Time the forward pass waited for a layer that was not loaded yet.
    pub stall_time: Duration,
    /// Layer bytes handed out from resident memory.
    pub resident_bytes_served: u64,
    /// Layer bytes handed out from streamed slots.
    pub streamed_bytes_served: u64,
    /// Prefetched layers dropped unused (access was not in the predicted order).
    pub evictions: u64,
    /// Experts read one by one for the layers that stream their experts.
    pub experts: ExpertStats,
}

#[derive(Default)]
struct Counters {
    disk_bytes: AtomicU64,
    disk_reads: AtomicU64,
    /// Readers reading now, since when, and the busy time of the finished periods.
    link: Mutex<(usize, Option<Instant>, Duration)>,
    stall_ns: AtomicU64,
    resident_served: AtomicU64,
    streamed_served: AtomicU64,
    evictions: AtomicU64,
    experts: Arc<ExpertCounters>,
}

impl Counters {
    fn link(&self) -> std::sync::MutexGuard<'_, (usize, Option<Instant>, Duration)> {
        self.link.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn link_start(&self) {
        let mut l = self.link();
        if l.0 == 0 {
            l.1 = Some(Instant::now());
        }
        l.0 += 1;
    }

    fn link_end(&self) {
        let mut l = self.link();
        l.0 = l.0.saturating_sub(1);
        if l.0 == 0 {
            if let Some(since) = l.1.take() {
                l.2 += since.elapsed();
            }
        }
    }

    fn link_busy(&self) -> Duration {
        let l = self.link();
        l.2 + l.1.map_or(Duration::ZERO, |s| s.elapsed())
    }
}

/// Options of a [`TieredStore`].
#[derive(Clone, Copy, Debug)]
pub struct TieredOptions {
    /// Reader threads (one is enough for one disk; more keep an NVMe queue fuller).
    pub io_threads: usize,
    /// On the CPU, read a streamed layer's experts (a mixture of experts) whole with
    /// the layer, instead of only those the router chooses.
    pub whole_experts: bool,
    /// Bytes of experts kept between uses (the most recently used, over all layers).
    pub expert_cache_bytes: u64,
}

impl Default for TieredOptions {
    fn default() -> Self {
        TieredOptions {
            io_threads: 1,
            whole_experts: false,
            expert_cache_bytes: 0,
        }
    }
}

/// A [`WeightStore`] over a GGUF file placed by a [`Plan`]: resident layers are read
/// once into RAM (bypassing the page cache), streamed layers are read from the file per
/// use into a ring of `plan.device_slots` slots, prefetched in the model's layer order
/// (cyclically, so the next token's first layers load while this token ends). Any
/// access order is answered: a layer that was not prefetched is read on demand, and
/// prefetched layers nobody asked for are evicted when a slot is needed.
///
/// On the CPU backend (a unified plan) device and RAM are the same memory:
/// [`Tier::Device`] layers are read once into RAM, and the slots are what the CPU
/// computes from.
///
/// With a separate device (the wgpu backend), [`Tier::Device`] layers and the head are
/// handed out as loaded (memory-mapped): the backend uploads them once and keeps them.
/// [`Tier::Ram`] layers are read once into RAM and [`Tier::Disk`] layers stream through
/// `plan.staging_slots` RAM slots; the bytes of both say they may not be cached on the
/// device (`ByteSource::cache_on_device`), so the backend uploads them per use into its
/// own `plan.device_slots` stream slots (`WgpuBackend::set_stream_slots`).
pub struct TieredStore {
    globals: GlobalWeights,
    layouts: Arc<Vec<LayerLayout>>,
    resident: Vec<Option<Arc<LayerWeights>>>,
    tiers: Vec<Tier>,
    /// Streamed layers in layer order: the predicted access order.
    streamed: Vec<usize>,
    slots: usize,
    slot_len: u64,
    /// Bytes held where the backend computes: resident layers (RAM on the CPU) and the
    /// head.
    resident_bytes: u64,
    head_bytes: u64,
    /// The head's bytes when the plan leaves it on disk (mapped), else zero.
    head_disk_bytes: u64,
    /// A GPU plan's RAM tier.
    ram_bytes: u64,
    /// A CPU plan's RAM tier, held coded.
    coded_bytes: u64,
    unified: bool,
    path: PathBuf,
    ring: Mutex<Ring>,
    jobs: Option<Sender<Job>>,
    done: Receiver<Done>,
    home_tx: Sender<AlignedBuf>,
    home_rx: Receiver<AlignedBuf>,
    counters: Arc<Counters>,
    threads: Vec<JoinHandle<()>>,
    mode: &'static str,
    /// The file, for experts read one by one.
    reader: Option<Arc<dyn ReadAt>>,
    expert_cache: Arc<ExpertCache>,
}

/// The real byte sizes of a model's layers and head, for the planner.
pub fn model_shape(
    config: &ModelConfig,
    globals: &GlobalWeights,
    layers: &[LayerWeights],
) -> ModelShape {
    ModelShape {
        layer_bytes: layers.iter().map(|l| l.byte_size() as u64).collect(),
        head_bytes: globals.output().bytes.len() as u64 + globals.output_norm().len() as u64 * 4,
        embd_row_bytes: globals.token_embd().row_bytes() as u64,
        d_model: config.d_model as u64,
        q_dim: config.q_dim() as u64,
        kv_dim: config.kv_dim() as u64,
        n_ff: config.n_ff as u64,
        vocab: config.vocab_size as u64,
        kv_value_bytes: ballast_core::kv::KvElement::default().row_bytes(1) as u64,
        kv_on_device_only: false,
        expert_bytes: layers
            .iter()
            .map(|l| {
                l.matrices
                    .iter()
                    .filter(|(role, _)| is_expert_role(role))
                    .map(|(_, w)| w.bytes.len() as u64)
                    .sum()
            })
            .collect(),
        expert_share: config
            .moe
            .map_or(1.0, |m| m.n_expert_used as f64 / m.n_expert as f64),
        stored_bytes: Vec::new(),
        decode_bytes_per_s: 0.0,
        decode_readers: 1,
        // The host caches keep only a windowed layer's window (the runtime's
        // `WindowedKv`); a caller whose cache keeps every token clears this.
        kv_windows: config
            .layer_attention
            .iter()
            .map(|a| a.shape.window.map(|w| w as u64))
            .collect(),
    }
}

/// Checks that `plan` places `n_layers` layers and has a RAM tier only with a separate
/// device, or held coded over a store with a coded form (`coded_form`).
fn check_plan(plan: &Plan, n_layers: usize, coded_form: bool) -> Result<()> {
    if plan.ram_coded && !coded_form && plan.tiers.contains(&Tier::Ram) {
        return Err(Error::PlanMismatch {
            why: "the plan holds layers coded, and this store has no coded form of them (see TieredStore::over_coded)".into(),
        });
    }
    if plan.ram_coded && !plan.unified && plan.tiers.contains(&Tier::Ram) {
        return Err(Error::PlanMismatch {
            why: "only a plan without a separate device holds its RAM tier coded".into(),
        });
    }
    if plan.tiers.len() != n_layers {
        return Err(Error::PlanMismatch {
            why: format!(
                "the plan places {} layers, the model has {n_layers}",
                plan.tiers.len()
            ),
        });
    }
    if plan.unified && !plan.ram_coded && plan.tiers.contains(&Tier::Ram) {
        return Err(Error::PlanMismatch {
            why: "a plan without a separate device has no RAM tier".into(),
        });
    }
    Ok(())
}

/// Layouts of `inner`'s layers packed in slots (each layer asked for once, with pass
/// ids from `passes`).
fn packed_layouts(
    inner: &dyn WeightStore,
    passes: &ballast_core::store::PassCounter,
) -> Result<Vec<LayerLayout>> {
    (0..inner.n_layers())
        .map(|i| Ok(LayerLayout::packed(&*inner.layer(passes.next(), i)?)))
        .collect()
}

/// The layers `plan` keeps, as this store holds them: on the CPU (a unified plan) the
/// device tier is fetched once into RAM the CPU computes from; with a separate device
/// it is handed out as loaded (the backend uploads it once and keeps it); a RAM tier
/// is fetched once into RAM that the backend uploads per use. Returns them with the
/// bytes held for the device tier and for the RAM tier.
#[allow(clippy::type_complexity)]
fn place_layers(
    layouts: &[LayerLayout],
    plan: &Plan,
    beneath: &Beneath,
) -> Result<(Vec<Option<Arc<LayerWeights>>>, u64, u64)> {
    let mut resident = Vec::with_capacity(layouts.len());
    let (mut device_bytes, mut ram_bytes) = (0u64, 0u64);
    for (i, layout) in layouts.iter().enumerate() {
        let in_ram = match (plan.tiers[i], plan.unified) {
            (Tier::Disk, _) => {
                resident.push(None);
                continue;
            }
            (Tier::Device, false) => {
                device_bytes += layout.bytes;
                resident.push(Some(beneath.as_loaded(i, layout)?));
                continue;
            }
            (Tier::Device, true) => false,
            // On the CPU a RAM tier is held coded (by the store beneath's `Coded`) and
            // streams through the slots.
            (Tier::Ram, true) => {
                resident.push(None);
                continue;
            }
            (Tier::Ram, false) => true,
        };
        let mut buf = AlignedBuf::new(layout.slot_len as usize);
        beneath.fetch(i, layout, &mut buf)?;
        // What is allocated (aligned reads), not only the tensors' bytes.
        if in_ram {
            ram_bytes += buf.len() as u64;
        } else {
            device_bytes += buf.len() as u64;
        }
        let source: Arc<dyn ByteSource> = Arc::new(Resident {
            buf,
            on_device: !in_ram,
        });
        resident.push(Some(Arc::new(layout.weights(source)?)));
    }
    Ok((resident, device_bytes, ram_bytes))
}

impl TieredStore {
    /// A store for the weights `globals` and `layers` of `file` (as
    /// `ballast_runtime::model::load_weights` returns them), placed by `plan`, reading
    /// through `reader` (normally a [`crate::io::DirectFile`] of the same file).
    pub fn new(
        file: &GgufFile,
        mut globals: GlobalWeights,
        layers: Vec<LayerWeights>,
        plan: &Plan,
        reader: Arc<dyn ReadAt>,
        options: TieredOptions,
    ) -> Result<TieredStore> {
        check_plan(plan, layers.len(), false)?;
        // On the CPU a streamed layer leaves its experts out of its slot: the router
        // chooses which are read.
        let stream_experts =
            |i: usize| plan.unified && !options.whole_experts && plan.tiers[i] == Tier::Disk;
        let layouts: Vec<LayerLayout> = layers
            .into_iter()
            .enumerate()
            .map(|(i, l)| LayerLayout::new(file, l, stream_experts(i)))
            .collect::<Result<_>>()?;
        if plan.unified && !plan.head_on_disk {
            // The head is read whole by every token: read it once into RAM. A tied
            // embedding is the same tensor; an untied one stays memory-mapped (a token
            // reads one row of it). A head the plan leaves on disk stays mapped too.
            let head_info = file.tensor(&globals.output().name)?.clone();
            let tied = globals.tied();
            let mut head_buf = AlignedBuf::new((head_info.n_bytes + 2 * IO_ALIGN) as usize);
            let head_layout = Extent {
                file_offset: head_info.offset / IO_ALIGN * IO_ALIGN,
                needed: head_info.offset % IO_ALIGN + head_info.n_bytes,
                len: (head_info.offset % IO_ALIGN + head_info.n_bytes).div_ceil(IO_ALIGN)
                    * IO_ALIGN,
                buf_offset: 0,
            };
            read_extents(reader.as_ref(), Part::Head, &[head_layout], &mut head_buf)?;
            let head_source: Arc<dyn ByteSource> = Arc::new(Resident {
                buf: head_buf,
                on_device: true,
            });
            let at = (head_info.offset % IO_ALIGN) as usize;
            globals.output_mut().bytes =
                WeightBytes::new(head_source, at..at + head_info.n_bytes as usize)?;
            if tied {
                globals.token_embd_mut().bytes = globals.output().bytes.clone();
            }
        } else if plan.head_on_disk {
            crate::io::advise_sequential(globals.output().bytes.as_slice()?);
        }
        if !globals.tied() {
            // A token reads one row of an untied embedding table, which stays mapped.
            crate::io::advise_random(globals.token_embd().bytes.as_slice()?);
        }
        TieredStore::start(globals, layouts, plan, Beneath::File(reader), options)
    }

    /// A store over another store `inner` (one that decompresses layers on demand, say),
    /// placed by `plan` (made from `inner`'s layer sizes): the layers the plan keeps are
    /// fetched from `inner` once, the streamed ones are fetched from it per use by the
    /// reader threads into the ring of slots, ahead of the forward pass, exactly as
    /// they would be read from a file. `inner` is asked for each layer with pass ids of
    /// its own, and sees only this store's reads. The counters' "disk" figures are
    /// then bytes fetched from `inner`.
    pub fn over_store(
        inner: Arc<dyn WeightStore>,
        plan: &Plan,
        options: TieredOptions,
    ) -> Result<TieredStore> {
        check_plan(plan, inner.n_layers(), false)?;
        let passes = ballast_core::store::PassCounter::default();
        let layouts = packed_layouts(&*inner, &passes)?;
        let globals = inner.globals().clone();
        let beneath = Beneath::Store { inner, passes };
        TieredStore::start(globals, layouts, plan, beneath, options)
    }

    /// A store over `inner`, a store with a coded form of each layer (a compressed
    /// pack's), placed by `plan` (made from `inner`'s layer sizes and, for a coded RAM
    /// tier, its coded sizes as [`ModelShape::stored_bytes`]). As
    /// [`TieredStore::over_store`], except that the reader threads decode each layer
    /// straight into its slot: from the coded form read from `inner` for a
    /// [`Tier::Disk`] layer, from the coded form this store holds in RAM for a
    /// [`Tier::Ram`] layer of a plan that holds them coded ([`Plan::ram_coded`]). The
    /// counters' "disk" figures are the coded bytes read from `inner`.
    pub fn over_coded(
        inner: Arc<dyn CodedLayers>,
        plan: &Plan,
        options: TieredOptions,
    ) -> Result<TieredStore> {
        check_plan(plan, inner.n_layers(), true)?;
        let passes = ballast_core::store::PassCounter::default();
        let layouts = packed_layouts(&*inner, &passes)?;
        let held = (0..layouts.len())
            .map(|i| {
                let coded = plan.ram_coded && plan.tiers[i] == Tier::Ram;
                coded.then(|| inner.read_coded(i)).transpose()
            })
            .collect::<ballast_core::Result<_>>()?;
        let globals = inner.globals().clone();
        let beneath = Beneath::Coded {
            inner,
            passes,
            held,
        };
        TieredStore::start(globals, layouts, plan, beneath, options)
    }

    /// Places the layers `plan` keeps, then starts the reader threads and the ring of
    /// slots for the streamed ones.
    fn start(
        globals: GlobalWeights,
        layouts: Vec<LayerLayout>,
        plan: &Plan,
        beneath: Beneath,
        options: TieredOptions,
    ) -> Result<TieredStore> {
        // Through the slots: layers read per use, and layers held coded (decoded per
        // use).
        let streamed: Vec<usize> = (0..layouts.len())
            .filter(|&i| {
                plan.tiers[i] == Tier::Disk || (plan.ram_coded && plan.tiers[i] == Tier::Ram)
            })
            .collect();
        let slot_len = streamed
            .iter()
            .map(|&i| layouts[i].slot_len)
            .max()
            .unwrap_or(0);
        // Reads land in the slots the backend computes from (CPU), or in RAM staging
        // slots that a device backend uploads from.
        let (ring_slots, ring_slot_bytes) = if plan.unified {
            (plan.device_slots, plan.device_slot_bytes)
        } else {
            (plan.staging_slots, plan.staging_slot_bytes)
        };
        if !streamed.is_empty() && slot_len > ring_slot_bytes {
            return Err(Error::PlanMismatch {
                why: format!(
                    "a streamed layer's tensors span {slot_len} bytes, more than the plan's slot of {ring_slot_bytes} bytes"
                ),
            });
        }
        let (resident, resident_bytes, ram_bytes) = place_layers(&layouts, plan, &beneath)?;
        let mut head_bytes = if plan.head_on_disk {
            // Held by the page cache, as much of it as the kernel keeps.
            globals.output_norm().len() as u64 * 4
        } else {
            globals.output().bytes.len() as u64 + globals.output_norm().len() as u64 * 4
        };
        let head_disk_bytes = if plan.head_on_disk {
            globals.output().bytes.len() as u64
        } else {
            0
        };
        if !plan.unified && !globals.tied() {
            // A device backend uploads an untied embedding table beside the head.
            head_bytes += globals.token_embd().bytes.len() as u64;
        }
        let beneath = Arc::new(beneath);
        let layouts = Arc::new(layouts);
        let slots = if streamed.is_empty() {
            0
        } else {
            ring_slots.max(1)
        };
        let ring = Ring {
            free: (0..slots)
                .map(|_| AlignedBuf::new(slot_len as usize))
                .collect(),
            ..Ring::default()
        };
        let (jobs_tx, jobs_rx) = crossbeam_channel::unbounded::<Job>();
        let (done_tx, done_rx) = crossbeam_channel::unbounded::<Done>();
        let (home_tx, home_rx) = crossbeam_channel::unbounded::<AlignedBuf>();
        let counters = Arc::new(Counters::default());
        let reader = match &*beneath {
            Beneath::File(r) => Some(r.clone()),
            Beneath::Store { .. } | Beneath::Coded { .. } => None,
        };
        let coded_bytes = beneath.held_coded_bytes();
        let mut threads = Vec::new();
        if slots > 0 {
            for t in 0..options.io_threads.max(1) {
                let (jobs_rx, done_tx) = (jobs_rx.clone(), done_tx.clone());
                let (beneath, layouts, counters) =
                    (beneath.clone(), layouts.clone(), counters.clone());
                let handle = std::thread::Builder::new()
                    .name(format!("ballast-read-{t}"))
                    .spawn(move || {
                        for mut job in jobs_rx {
                            counters.link_start();
                            let layout = &layouts[job.layer];
                            let result = beneath.fetch(job.layer, layout, &mut job.buf);
                            counters.link_end();
                            let result = result.map(|n| {
                                counters.disk_bytes.fetch_add(n, Ordering::Relaxed);
                                counters.disk_reads.fetch_add(1, Ordering::Relaxed);
                            });
                            if done_tx
                                .send(Done {
                                    layer: job.layer,
                                    buf: job.buf,
                                    result,
                                })
                                .is_err()
                            {
                                break;
                            }
                        }
                    })
                    .map_err(|source| Error::Thread { source })?;
                threads.push(handle);
            }
        }
        Ok(TieredStore {
            globals,
            layouts,
            resident,
            tiers: plan.tiers.clone(),
            streamed,
            slots,
            slot_len,
            resident_bytes,
            head_bytes,
            head_disk_bytes,
            ram_bytes,
            coded_bytes,
            unified: plan.unified,
            path: beneath.path(),
            ring: Mutex::new(ring),
            jobs: Some(jobs_tx),
            done: done_rx,
            home_tx,
            home_rx,
            counters,
            threads,
            mode: beneath.mode(),
            reader,
            expert_cache: Arc::new(ExpertCache::new(options.expert_cache_bytes)),
        })
    }

    /// The counters so far.
    pub fn stats(&self) -> StreamStats {
        self.stats_handle().get()
    }
}

/// Reads the counters of a [`TieredStore`] after it moved into a model.
#[derive(Clone)]
pub struct StatsHandle(Arc<Counters>);

impl StatsHandle {
    /// The counters so far.
    pub fn get(&self) -> StreamStats {
        let c = &self.0;
        StreamStats {
            disk_bytes: c.disk_bytes.load(Ordering::Relaxed),
            disk_reads: c.disk_reads.load(Ordering::Relaxed),
            read_time: c.link_busy(),
            stall_time: Duration::from_nanos(c.stall_ns.load(Ordering::Relaxed)),
            resident_bytes_served: c.resident_served.load(Ordering::Relaxed),
            streamed_bytes_served: c.streamed_served.load(Ordering::Relaxed),
            evictions: c.evictions.load(Ordering::Relaxed),
            experts: c.experts.get(),
        }
    }
}

impl TieredStore {
    /// A handle on the counters that outlives moving the store into a model.
    pub fn stats_handle(&self) -> StatsHandle {
        StatsHandle(self.counters.clone())
    }

    /// How reads bypass the page cache (`O_DIRECT`, or the `fadvise` fallback).
    pub fn read_mode(&self) -> &'static str {
        self.mode
    }

    /// Slots in the ring and the bytes of each.
    pub fn slots(&self) -> (usize, u64) {
        (self.slots, self.slot_len)
    }

    /// Takes finished reads and returned slots into the ring without waiting.
    fn collect(&self, ring: &mut Ring) {
        while let Ok(b) = self.home_rx.try_recv() {
            ring.handed_out = ring.handed_out.saturating_sub(1);
            ring.free.push(b);
        }
        while let Ok(d) = self.done.try_recv() {
            self.finish(ring, d);
        }
    }

    fn finish(&self, ring: &mut Ring, d: Done) {
        ring.in_flight.remove(&d.layer);
        match d.result {
            Ok(()) => {
                ring.ready.insert(d.layer, d.buf);
            }
            Err(e) => {
                ring.free.push(d.buf);
                ring.failed.insert(d.layer, e);
            }
        }
    }

    /// Waits for a read to finish or a slot to come back, counting the wait as stall.
    fn wait(&self, ring: &mut Ring) -> Result<()> {
        let start = Instant::now();
        crossbeam_channel::select! {
            recv(self.done) -> d => {
                let d = d.map_err(|_| Error::PipelineClosed)?;
                self.finish(ring, d);
            }
            recv(self.home_rx) -> b => {
                let b = b.map_err(|_| Error::PipelineClosed)?;
                ring.handed_out = ring.handed_out.saturating_sub(1);
                ring.free.push(b);
            }
        }
        self.counters
            .stall_ns
            .fetch_add(start.elapsed().as_nanos() as u64, Ordering::Relaxed);
        Ok(())
    }

    fn issue(&self, ring: &mut Ring, layer: usize, buf: AlignedBuf) -> Result<()> {
        ring.in_flight.insert(layer);
        self.jobs
            .as_ref()
            .ok_or(Error::PipelineClosed)?
            .send(Job { layer, buf })
            .map_err(|_| Error::PipelineClosed)
    }

    /// Streamed layers after `after` in the predicted (cyclic layer) order.
    fn predicted(&self, after: usize) -> impl Iterator<Item = usize> + '_ {
        let start = self.streamed.partition_point(|&i| i <= after);
        let n = self.streamed.len();
        (0..n).map(move |k| self.streamed[(start + k) % n])
    }

    /// Fills free slots with the next layers in the predicted order.
    fn prefetch(&self, ring: &mut Ring, after: usize) -> Result<()> {
        let wanted: Vec<usize> = self.predicted(after).take(self.slots).collect();
        for layer in wanted {
            if ring.free.is_empty() {
                break;
            }
            if ring.ready.contains_key(&layer) || ring.in_flight.contains(&layer) {
                continue;
            }
            let buf = ring.free.pop().expect("checked non-empty");
            self.issue(ring, layer, buf)?;
        }
        Ok(())
    }

    fn streamed_layer(&self, index: usize) -> Result<Arc<LayerWeights>> {
        let mut ring = self.ring.lock().unwrap_or_else(|p| p.into_inner());
        self.collect(&mut ring);
        let buf = loop {
            if let Some(buf) = ring.ready.remove(&index) {
                break buf;
            }
            if let Some(e) = ring.failed.remove(&index) {
                return Err(e);
            }
            if ring.in_flight.contains(&index) {
                self.wait(&mut ring)?;
                continue;
            }
            // Not predicted: read it on demand. Take a free slot, else evict the
            // prefetched layer predicted last, else wait for a read or a returned slot.
            if let Some(buf) = ring.free.pop() {
                self.issue(&mut ring, index, buf)?;
                continue;
            }
            let victim = self
                .predicted(index)
                .filter(|l| ring.ready.contains_key(l))
                .last();
            if let Some(v) = victim {
                let buf = ring.ready.remove(&v).expect("ready");
                self.counters.evictions.fetch_add(1, Ordering::Relaxed);
                self.issue(&mut ring, index, buf)?;
                continue;
            }
            if ring.in_flight.is_empty() && ring.handed_out >= self.slots {
                return Err(Error::SlotsExhausted {
                    slots: self.slots,
                    layer: index,
                });
            }
            self.wait(&mut ring)?;
        };
        ring.handed_out += 1;
        self.prefetch(&mut ring, index)?;
        drop(ring);
        let layout = &self.layouts[index];
        self.counters
            .streamed_served
            .fetch_add(layout.bytes, Ordering::Relaxed);
        let source: Arc<dyn ByteSource> = Arc::new(Slot {
            buf: Some(buf),
            home: self.home_tx.clone(),
        });
        let mut weights = layout.weights(source)?;
        if let (false, Some(reader)) = (layout.experts.is_empty(), &self.reader) {
            weights.experts = Some(ExpertFetch(Arc::new(LayerExperts {
                layer: index,
                tensors: layout.experts.clone(),
                reader: reader.clone(),
                cache: self.expert_cache.clone(),
                counters: self.counters.experts.clone(),
            })));
        }
        Ok(Arc::new(weights))
    }
}

impl WeightStore for TieredStore {
    fn n_layers(&self) -> usize {
        self.layouts.len()
    }

    fn globals(&self) -> &GlobalWeights {
        &self.globals
    }

    fn layer(&self, _pass: PassId, index: usize) -> ballast_core::Result<Arc<LayerWeights>> {
        if index >= self.tiers.len() {
            return Err(ballast_core::Error::LayerIndex {
                index,
                n_layers: self.tiers.len(),
            });
        }
        if let Some(l) = self.resident[index].clone() {
            self.counters
                .resident_served
                .fetch_add(self.layouts[index].bytes, Ordering::Relaxed);
            if self.slots > 0 {
                let mut ring = self.ring.lock().unwrap_or_else(|p| p.into_inner());
                self.collect(&mut ring);
                self.prefetch(&mut ring, index)
                    .map_err(|e| ballast_core::Error::Store {
                        source: Box::new(e),
                    })?;
            }
            return Ok(l);
        }
        self.streamed_layer(index)
            .map_err(|e| ballast_core::Error::Store {
                source: Box::new(e),
            })
    }

    fn held_bytes(&self) -> TierBytes {
        let streamed: u64 = (0..self.tiers.len())
            .filter(|&i| self.tiers[i] == Tier::Disk)
            .map(|i| self.layouts[i].bytes)
            .sum::<u64>()
            + self.head_disk_bytes;
        let slots = self.slot_len * self.slots as u64;
        if self.unified {
            // The coded RAM tier is RAM the CPU does not compute from, but the same
            // memory: counted with the rest, as the plan counts it.
            TierBytes {
                device: self.resident_bytes
                    + self.coded_bytes
                    + self.head_bytes
                    + slots
                    + self.expert_cache.held(),
                ram: 0,
                disk: streamed,
            }
        } else {
            // The device tier and head are counted where they end up: the backend
            // uploads them once (their mapped pages are the file's).
            TierBytes {
                device: self.resident_bytes + self.head_bytes,
                ram: self.ram_bytes + slots,
                disk: streamed,
            }
        }
    }

    fn moved_bytes(&self) -> u64 {
        self.counters.disk_bytes.load(Ordering::Relaxed) + self.counters.experts.get().bytes
    }
}

impl Drop for TieredStore {
    fn drop(&mut self) {
        // Closing the job channel ends the reader threads once their current read is
        // done; the completion channel stays open until then, so none blocks.
        self.jobs = None;
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

impl std::fmt::Debug for TieredStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TieredStore")
            .field("path", &self.path)
            .field("tiers", &self.tiers)
            .field("slots", &self.slots)
            .field("slot_len", &self.slot_len)
            .finish()
    }
}
