//! The three update modes, each a [`KvCache`]: [`ShiftConcat`], [`PointerShift`] and
//! [`SmartMask`]. They hold the same tokens after the same calls and differ in how
//! much they move: see [`UpdateMode`].

use std::collections::VecDeque;
use std::io::{Read, Write};
use std::ops::Range;

use ballast_core::kv_payload::{self, LayerRows};
use ballast_core::store::TierBytes;
use ballast_core::{
    Error, KvCache, KvElement, KvSegment, KvShape, KvView, Result, MASKED_POSITION,
};

use crate::rows::Rows;

/// How a cache lays out its tokens and what eviction costs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum UpdateMode {
    /// One contiguous buffer per layer; eviction moves the kept tokens after the
    /// evicted range down (memmove): O(kept) bytes moved per eviction.
    ShiftConcat,
    /// A fixed ring per layer; eviction of the oldest tokens only moves an offset, and
    /// eviction inside (after the attention sinks) moves the shorter side, the sinks:
    /// O(min(before, after)) bytes. Attention reads at most two segments.
    #[default]
    PointerShift,
    /// A fixed buffer with a validity mask: evicted slots are masked out
    /// ([`MASKED_POSITION`]) and reused by later appends. Zero bytes moved.
    SmartMask,
}

impl UpdateMode {
    /// The name used on the command line and in session files.
    pub fn name(self) -> &'static str {
        match self {
            UpdateMode::ShiftConcat => "shift",
            UpdateMode::PointerShift => "ring",
            UpdateMode::SmartMask => "mask",
        }
    }

    pub(crate) fn tag(self) -> u8 {
        match self {
            UpdateMode::ShiftConcat => 0,
            UpdateMode::PointerShift => 1,
            UpdateMode::SmartMask => 2,
        }
    }

    pub(crate) fn from_tag(tag: u8) -> Option<UpdateMode> {
        UpdateMode::ALL.into_iter().find(|m| m.tag() == tag)
    }

    /// Every mode.
    pub const ALL: [UpdateMode; 3] = [
        UpdateMode::ShiftConcat,
        UpdateMode::PointerShift,
        UpdateMode::SmartMask,
    ];
}

impl std::str::FromStr for UpdateMode {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<UpdateMode, String> {
        match s {
            "shift" | "shift-concat" => Ok(UpdateMode::ShiftConcat),
            "ring" | "pointer-shift" => Ok(UpdateMode::PointerShift),
            "mask" | "smart-mask" => Ok(UpdateMode::SmartMask),
            other => Err(format!(
                "unknown KV update mode '{other}' (shift, ring or mask)"
            )),
        }
    }
}

/// A cache of any mode, boxed, for callers that pick the mode at run time.
pub fn new_cache(
    mode: UpdateMode,
    shape: KvShape,
    capacity: usize,
    precision: KvElement,
) -> Result<Box<dyn KvCache>> {
    Ok(match mode {
        UpdateMode::ShiftConcat => Box::new(ShiftConcat::new(shape, capacity, precision)?),
        UpdateMode::PointerShift => Box::new(PointerShift::new(shape, capacity, precision)?),
        UpdateMode::SmartMask => Box::new(SmartMask::new(shape, capacity, precision)?),
    })
}

/// One layer's slots: keys, values, and the position held in each slot.
#[derive(Clone, Debug)]
struct Slots {
    keys: Rows,
    values: Rows,
    positions: Vec<u32>,
}

impl Slots {
    fn new(precision: KvElement, dim: usize) -> Slots {
        Slots {
            keys: Rows::new(precision, dim),
            values: Rows::new(precision, dim),
            positions: Vec::new(),
        }
    }

    fn ensure(&mut self, n: usize) {
        self.keys.ensure(n);
        self.values.ensure(n);
        if self.positions.len() < n {
            self.positions.resize(n, MASKED_POSITION);
        }
    }

    /// Writes `positions.len()` tokens into consecutive slots from `slot`.
    fn write(&mut self, slot: usize, positions: &[u32], keys: &[f32], values: &[f32]) {
        self.ensure(slot + positions.len());
        self.keys.write(slot, keys);
        self.values.write(slot, values);
        self.positions[slot..slot + positions.len()].copy_from_slice(positions);
    }

    fn copy_within(&mut self, src: Range<usize>, dst: usize) {
        self.keys.copy_within(src.clone(), dst);
        self.values.copy_within(src.clone(), dst);
        self.positions.copy_within(src, dst);
    }

    fn segment(&self, range: Range<usize>) -> KvSegment<'_> {
        KvSegment {
            keys: self.keys.view(range.clone()),
            values: self.values.view(range.clone()),
            positions: &self.positions[range],
        }
    }
}

/// What every mode shares: shape, capacity, precision, the layers' slots, byte counts.
#[derive(Clone, Debug)]
struct Core {
    shape: KvShape,
    capacity: usize,
    precision: KvElement,
    layers: Vec<Slots>,
    moved: u64,
}

impl Core {
    fn new(shape: KvShape, capacity: usize, precision: KvElement) -> Result<Core> {
        let dim = shape.kv_dim();
        if precision == KvElement::Q8 && dim % ballast_core::Q8_BLOCK != 0 {
            return Err(Error::InvalidArgument {
                what: format!(
                    "an int8 KV cache needs rows of a multiple of {} values; this model's are {dim}",
                    ballast_core::Q8_BLOCK
                ),
            });
        }
        Ok(Core {
            shape,
            capacity,
            precision,
            layers: vec![Slots::new(precision, dim); shape.n_layers],
            moved: 0,
        })
    }

    /// Bytes of one token in one layer: key and value rows plus its position.
    fn token_bytes(&self) -> u64 {
        (2 * self.precision.row_bytes(self.shape.kv_dim()) + 4) as u64
    }

    fn check_append(
        &self,
        layer: usize,
        have: usize,
        positions: &[u32],
        keys: &[f32],
        values: &[f32],
    ) -> Result<()> {
        if layer >= self.shape.n_layers {
            return Err(Error::LayerIndex {
                index: layer,
                n_layers: self.shape.n_layers,
            });
        }
        let expected = positions.len() * self.shape.kv_dim();
        if keys.len() != expected || values.len() != expected {
            return Err(Error::KvShape {
                expected,
                keys: keys.len(),
                values: values.len(),
            });
        }
        if positions.contains(&MASKED_POSITION) {
            return Err(Error::InvalidArgument {
                what: format!("position {MASKED_POSITION} is reserved for masked slots"),
            });
        }
        if have + positions.len() > self.capacity {
            return Err(Error::ContextFull {
                needed: have + positions.len(),
                capacity: self.capacity,
            });
        }
        Ok(())
    }

    fn held(&self) -> TierBytes {
        let slots: usize = self.layers.iter().map(|l| l.keys.slots()).sum();
        TierBytes {
            device: slots as u64 * self.token_bytes(),
            ..TierBytes::default()
        }
    }
}

/// Threads that spread an update of many layers (0: the machine's parallelism, at most
/// 4).
static UPDATE_THREADS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// Sets how many threads an update that moves many bytes (a `ShiftConcat` eviction's
/// memmoves) spreads its layers over; `0` (the default) means the machine's
/// parallelism, at most 4. Smaller updates stay on the calling thread.
pub fn set_update_threads(n: usize) {
    UPDATE_THREADS.store(n, std::sync::atomic::Ordering::Relaxed);
}

/// Runs `f` on every layer, on several threads when the work is large enough to pay
/// for them (memmoves of many tokens).
fn for_each_layer<T: Send>(items: &mut [T], big: bool, f: impl Fn(&mut T) + Sync) {
    let threads = match UPDATE_THREADS.load(std::sync::atomic::Ordering::Relaxed) {
        0 => std::thread::available_parallelism()
            .map_or(1, |n| n.get())
            .min(4),
        n => n,
    };
    if !big || threads < 2 || items.len() < 2 {
        items.iter_mut().for_each(f);
        return;
    }
    let per = items.len().div_ceil(threads);
    std::thread::scope(|s| {
        for chunk in items.chunks_mut(per) {
            let f = &f;
            s.spawn(move || chunk.iter_mut().for_each(f));
        }
    });
}

/// Work above this many bytes moved per call goes to several threads. Measured with
/// `cargo xtask bench-kv` (30 layers, f16): spreading a 5.8 MB or 23.6 MB eviction over
/// 2 threads made it slower (the threads' start cost more than they saved), a 94.8 MB
/// one faster.
const PARALLEL_BYTES: u64 = 64 << 20;

/// Clamps `range` to `0..len`.
fn clamp(range: Range<usize>, len: usize) -> Range<usize> {
    let start = range.start.min(len);
    start..range.end.clamp(start, len)
}

// ---- ShiftConcat -------------------------------------------------------------------

/// One contiguous buffer per layer: tokens `0..len` live in slots `0..len`. Eviction
/// moves every kept token after the evicted range down (O(kept) bytes moved), as
/// GENIE's `SHIFT_CONCAT` does with `memmove`.
#[derive(Clone, Debug)]
pub struct ShiftConcat {
    core: Core,
    len: Vec<usize>,
}

impl ShiftConcat {
    /// An empty cache of at most `capacity` tokens per layer.
    pub fn new(shape: KvShape, capacity: usize, precision: KvElement) -> Result<ShiftConcat> {
        Ok(ShiftConcat {
            core: Core::new(shape, capacity, precision)?,
            len: vec![0; shape.n_layers],
        })
    }
}

// ---- PointerShift ------------------------------------------------------------------

/// A ring of `capacity` slots per layer: token `i` lives in slot `(start + i) %
/// capacity`. Appends write at the head; evicting the oldest tokens moves only
/// `start`; evicting a range inside moves the shorter side (for StreamingLLM, the
/// attention sinks: a constant number of rows per step). Attention reads the live
/// region as at most two segments.
#[derive(Clone, Debug)]
pub struct PointerShift {
    core: Core,
    start: Vec<usize>,
    len: Vec<usize>,
}

impl PointerShift {
    /// An empty ring of `capacity` slots per layer (allocated as they are first used).
    pub fn new(shape: KvShape, capacity: usize, precision: KvElement) -> Result<PointerShift> {
        if capacity == 0 {
            return Err(Error::InvalidArgument {
                what: "a ring KV cache needs a capacity of at least one token".into(),
            });
        }
        Ok(PointerShift {
            core: Core::new(shape, capacity, precision)?,
            start: vec![0; shape.n_layers],
            len: vec![0; shape.n_layers],
        })
    }

    fn slot(&self, layer: usize, index: usize) -> usize {
        (self.start[layer] + index) % self.core.capacity
    }
}

// ---- SmartMask ---------------------------------------------------------------------

/// A buffer of slots with a validity mask: evicted slots get [`MASKED_POSITION`]
/// (attention skips them) and go to a free list that later appends reuse. Nothing
/// moves. The order of the tokens is kept as a list of slot indices (4 bytes per
/// token, not counted as KV bytes moved); attention reads the slots in slot order,
/// which after reuse differs from cache order (same result within rounding).
#[derive(Clone, Debug)]
pub struct SmartMask {
    core: Core,
    order: Vec<VecDeque<u32>>,
    free: Vec<Vec<u32>>,
}

impl SmartMask {
    /// An empty masked buffer of at most `capacity` slots per layer.
    pub fn new(shape: KvShape, capacity: usize, precision: KvElement) -> Result<SmartMask> {
        Ok(SmartMask {
            core: Core::new(shape, capacity, precision)?,
            order: vec![VecDeque::new(); shape.n_layers],
            free: vec![Vec::new(); shape.n_layers],
        })
    }

    /// Masks the slots of the tokens at `range` (cache order) of every layer.
    fn release(&mut self, range: Range<usize>) {
        for ((order, free), slots) in self
            .order
            .iter_mut()
            .zip(&mut self.free)
            .zip(&mut self.core.layers)
        {
            let range = clamp(range.clone(), order.len());
            for slot in order.drain(range) {
                slots.positions[slot as usize] = MASKED_POSITION;
                free.push(slot);
            }
            // Reuse the lowest slots first, so the buffer stays compact.
            free.sort_unstable_by(|a, b| b.cmp(a));
        }
    }
}

/// The slot-level operations that differ between modes; the [`KvCache`] methods that
/// do not (read, save, load, byte counts) are written once on top of them.
trait Layout: Sized + Clone {
    fn core(&self) -> &Core;
    fn core_mut(&mut self) -> &mut Core;
    /// An empty cache like this one.
    fn empty(&self) -> Self;
    fn layer_len(&self, layer: usize) -> usize;
    /// Slot of the token at `index` (cache order) of `layer`.
    fn slot_of(&self, layer: usize, index: usize) -> usize;
    /// Appends after checking; returns nothing, counts bytes.
    fn push(&mut self, layer: usize, positions: &[u32], keys: &[f32], values: &[f32]);
    fn view_of(&self, layer: usize) -> KvView<'_>;
    fn rewind_to(&mut self, n: usize);
    fn evict_range(&mut self, range: Range<usize>);
}

impl Layout for ShiftConcat {
    fn core(&self) -> &Core {
        &self.core
    }
    fn core_mut(&mut self) -> &mut Core {
        &mut self.core
    }
    fn empty(&self) -> Self {
        ShiftConcat {
            core: Core {
                layers: vec![
                    Slots::new(self.core.precision, self.core.shape.kv_dim());
                    self.core.shape.n_layers
                ],
                moved: 0,
                ..self.core.clone_meta()
            },
            len: vec![0; self.core.shape.n_layers],
        }
    }
    fn layer_len(&self, layer: usize) -> usize {
        self.len[layer]
    }
    fn slot_of(&self, _layer: usize, index: usize) -> usize {
        index
    }
    fn push(&mut self, layer: usize, positions: &[u32], keys: &[f32], values: &[f32]) {
        let at = self.len[layer];
        self.core.layers[layer].write(at, positions, keys, values);
        self.len[layer] += positions.len();
        self.core.moved += positions.len() as u64 * self.core.token_bytes();
    }
    fn view_of(&self, layer: usize) -> KvView<'_> {
        KvView {
            segments: vec![self.core.layers[layer].segment(0..self.len[layer])],
        }
    }
    fn rewind_to(&mut self, n: usize) {
        self.len.iter_mut().for_each(|l| *l = (*l).min(n));
    }
    fn evict_range(&mut self, range: Range<usize>) {
        let token = self.core.token_bytes();
        let mut moved = 0;
        let mut jobs: Vec<(&mut Slots, &mut usize)> =
            self.core.layers.iter_mut().zip(&mut self.len).collect();
        for (_, len) in &jobs {
            let r = clamp(range.clone(), **len);
            moved += (**len - r.end) as u64 * token;
        }
        for_each_layer(&mut jobs, moved > PARALLEL_BYTES, |(slots, len)| {
            let r = clamp(range.clone(), **len);
            slots.copy_within(r.end..**len, r.start);
            **len -= r.len();
        });
        self.core.moved += moved;
    }
}

impl Core {
    /// A copy of everything but the layers' contents.
    fn clone_meta(&self) -> Core {
        Core {
            shape: self.shape,
            capacity: self.capacity,
            precision: self.precision,
            layers: Vec::new(),
            moved: self.moved,
        }
    }
}

impl Layout for PointerShift {
    fn core(&self) -> &Core {
        &self.core
    }
    fn core_mut(&mut self) -> &mut Core {
        &mut self.core
    }
    fn empty(&self) -> Self {
        PointerShift {
            core: Core {
                layers: vec![
                    Slots::new(self.core.precision, self.core.shape.kv_dim());
                    self.core.shape.n_layers
                ],
                moved: 0,
                ..self.core.clone_meta()
            },
            start: vec![0; self.core.shape.n_layers],
            len: vec![0; self.core.shape.n_layers],
        }
    }
    fn layer_len(&self, layer: usize) -> usize {
        self.len[layer]
    }
    fn slot_of(&self, layer: usize, index: usize) -> usize {
        self.slot(layer, index)
    }
    fn push(&mut self, layer: usize, positions: &[u32], keys: &[f32], values: &[f32]) {
        let cap = self.core.capacity;
        let dim = self.core.shape.kv_dim();
        let head = self.slot(layer, self.len[layer]);
        // At most two contiguous pieces: up to the end of the ring, then from slot 0.
        let first = positions.len().min(cap - head);
        let slots = &mut self.core.layers[layer];
        slots.write(
            head,
            &positions[..first],
            &keys[..first * dim],
            &values[..first * dim],
        );
        if first < positions.len() {
            slots.write(
                0,
                &positions[first..],
                &keys[first * dim..],
                &values[first * dim..],
            );
        }
        self.len[layer] += positions.len();
        self.core.moved += positions.len() as u64 * self.core.token_bytes();
    }
    fn view_of(&self, layer: usize) -> KvView<'_> {
        let (start, len, cap) = (self.start[layer], self.len[layer], self.core.capacity);
        let slots = &self.core.layers[layer];
        let mut segments = vec![slots.segment(start..(start + len).min(cap))];
        if start + len > cap {
            segments.push(slots.segment(0..start + len - cap));
        }
        KvView { segments }
    }
    fn rewind_to(&mut self, n: usize) {
        self.len.iter_mut().for_each(|l| *l = (*l).min(n));
    }
    fn evict_range(&mut self, range: Range<usize>) {
        let token = self.core.token_bytes();
        let cap = self.core.capacity;
        for layer in 0..self.core.shape.n_layers {
            let len = self.len[layer];
            let r = clamp(range.clone(), len);
            let k = r.len();
            if k == 0 {
                continue;
            }
            if r.start <= len - r.end {
                // Move the tokens before the range forward by k, newest first, then
                // advance the start past the freed slots.
                for i in (0..r.start).rev() {
                    let (from, to) = (self.slot(layer, i), self.slot(layer, i + k));
                    self.core.layers[layer].copy_within(from..from + 1, to);
                }
                self.start[layer] = (self.start[layer] + k) % cap;
                self.core.moved += r.start as u64 * token;
            } else {
                for i in r.end..len {
                    let (from, to) = (self.slot(layer, i), self.slot(layer, i - k));
                    self.core.layers[layer].copy_within(from..from + 1, to);
                }
                self.core.moved += (len - r.end) as u64 * token;
            }
            self.len[layer] = len - k;
        }
    }
}

impl Layout for SmartMask {
    fn core(&self) -> &Core {
        &self.core
    }
    fn core_mut(&mut self) -> &mut Core {
        &mut self.core
    }
    fn empty(&self) -> Self {
        SmartMask {
            core: Core {
                layers: vec![
                    Slots::new(self.core.precision, self.core.shape.kv_dim());
                    self.core.shape.n_layers
                ],
                moved: 0,
                ..self.core.clone_meta()
            },
            order: vec![VecDeque::new(); self.core.shape.n_layers],
            free: vec![Vec::new(); self.core.shape.n_layers],
        }
    }
    fn layer_len(&self, layer: usize) -> usize {
        self.order[layer].len()
    }
    fn slot_of(&self, layer: usize, index: usize) -> usize {
        self.order[layer][index] as usize
    }
    fn push(&mut self, layer: usize, positions: &[u32], keys: &[f32], values: &[f32]) {
        let dim = self.core.shape.kv_dim();
        let slots = &mut self.core.layers[layer];
        let mut i = 0;
        while i < positions.len() {
            // A run of fresh slots at the end is written in one piece; reused slots
            // one by one.
            let (slot, run) = match self.free[layer].pop() {
                Some(s) => (s as usize, 1),
                None => (slots.keys.slots(), positions.len() - i),
            };
            slots.write(
                slot,
                &positions[i..i + run],
                &keys[i * dim..(i + run) * dim],
                &values[i * dim..(i + run) * dim],
            );
            self.order[layer].extend((slot..slot + run).map(|s| s as u32));
            i += run;
        }
        self.core.moved += positions.len() as u64 * self.core.token_bytes();
    }
    fn view_of(&self, layer: usize) -> KvView<'_> {
        let slots = &self.core.layers[layer];
        KvView {
            segments: vec![slots.segment(0..slots.keys.slots())],
        }
    }
    fn rewind_to(&mut self, n: usize) {
        self.release(n..usize::MAX);
    }
    fn evict_range(&mut self, range: Range<usize>) {
        self.release(range);
    }
}

/// Writes the cache's tokens in the shared session payload ([`kv_payload`]: per layer
/// positions and stored rows in cache order, so a file saved from one mode, or from a
/// device cache, loads into another).
fn save_layout<L: Layout>(cache: &L, out: &mut dyn Write) -> Result<()> {
    let core = cache.core();
    let layers: Vec<LayerRows> = (0..core.shape.n_layers)
        .map(|layer| {
            let slots: Vec<usize> = (0..cache.layer_len(layer))
                .map(|i| cache.slot_of(layer, i))
                .collect();
            let l = &core.layers[layer];
            let mut rows = Vec::new();
            for &s in &slots {
                l.keys.raw_row(s, &mut rows);
                l.values.raw_row(s, &mut rows);
            }
            LayerRows {
                positions: slots.iter().map(|&s| l.positions[s]).collect(),
                rows,
            }
        })
        .collect();
    let element = core.precision;
    kv_payload::write(out, element, core.shape, &layers)
}

fn load_layout<L: Layout>(cache: &mut L, input: &mut dyn Read) -> Result<()> {
    let core = cache.core();
    let (shape, capacity) = (core.shape, core.capacity);
    let element = core.precision;
    let layers = kv_payload::read(input, element, shape, capacity)?;
    let row = element.row_bytes(shape.kv_dim());
    let mut loaded = cache.empty();
    let zeros = vec![0f32; shape.kv_dim()];
    for (layer, rows) in layers.iter().enumerate() {
        // Place the tokens with an ordinary append (zeros), then overwrite the stored
        // bytes: the layout stays the mode's own.
        for (i, &p) in rows.positions.iter().enumerate() {
            let z = &zeros[..];
            loaded.push(layer, &[p], z, z);
            let slot = loaded.slot_of(layer, i);
            let (k, v) = rows.token(i, row);
            let l = &mut loaded.core_mut().layers[layer];
            l.keys.set_raw_row(slot, k);
            l.values.set_raw_row(slot, v);
        }
    }
    loaded.core_mut().moved = cache.core().moved;
    *cache = loaded;
    Ok(())
}

macro_rules! kv_cache_impl {
    ($t:ty) => {
        impl KvCache for $t {
            fn shape(&self) -> KvShape {
                self.core.shape
            }
            fn capacity(&self) -> usize {
                self.core.capacity
            }
            fn len(&self) -> usize {
                if self.core.shape.n_layers == 0 {
                    0
                } else {
                    self.layer_len(0)
                }
            }
            fn append(
                &mut self,
                layer: usize,
                positions: &[u32],
                keys: &[f32],
                values: &[f32],
            ) -> Result<()> {
                let have = if layer < self.core.shape.n_layers {
                    self.layer_len(layer)
                } else {
                    0
                };
                self.core
                    .check_append(layer, have, positions, keys, values)?;
                self.push(layer, positions, keys, values);
                Ok(())
            }
            fn view(&self, layer: usize) -> KvView<'_> {
                if layer >= self.core.shape.n_layers {
                    return KvView::default();
                }
                self.view_of(layer)
            }
            fn read(
                &self,
                layer: usize,
                range: Range<usize>,
                positions: &mut Vec<u32>,
                keys: &mut Vec<f32>,
                values: &mut Vec<f32>,
            ) {
                if layer >= self.core.shape.n_layers {
                    return;
                }
                let dim = self.core.shape.kv_dim();
                let l = &self.core.layers[layer];
                for i in clamp(range, self.layer_len(layer)) {
                    let s = self.slot_of(layer, i);
                    positions.push(l.positions[s]);
                    for (rows, out) in [(&l.keys, &mut *keys), (&l.values, &mut *values)] {
                        let at = out.len();
                        out.resize(at + dim, 0.0);
                        rows.view(s..s + 1).read_f32(0, &mut out[at..]);
                    }
                }
            }
            fn positions(&self, layer: usize, range: Range<usize>, out: &mut Vec<u32>) {
                if layer >= self.core.shape.n_layers {
                    return;
                }
                let l = &self.core.layers[layer];
                out.extend(
                    clamp(range, self.layer_len(layer)).map(|i| l.positions[self.slot_of(layer, i)]),
                );
            }
            fn rewind(&mut self, n_tokens: usize) {
                self.rewind_to(n_tokens);
            }
            fn evict(&mut self, range: Range<usize>) {
                if !range.is_empty() {
                    self.evict_range(range);
                }
            }
            fn rewrite_keys(
                &mut self,
                layer: usize,
                start: usize,
                positions: &[u32],
                keys: &[f32],
            ) -> Result<()> {
                let dim = self.core.shape.kv_dim();
                let len = if layer < self.core.shape.n_layers {
                    self.layer_len(layer)
                } else {
                    0
                };
                if layer >= self.core.shape.n_layers
                    || start + positions.len() > len
                    || keys.len() != positions.len() * dim
                {
                    return Err(Error::InvalidArgument {
                        what: format!(
                            "rewriting {} keys from token {start} of layer {layer}, which holds {len}",
                            positions.len()
                        ),
                    });
                }
                for (i, &p) in positions.iter().enumerate() {
                    let s = self.slot_of(layer, start + i);
                    let l = &mut self.core.layers[layer];
                    l.keys.write(s, &keys[i * dim..(i + 1) * dim]);
                    l.positions[s] = p;
                }
                self.core.moved +=
                    (positions.len() * (self.core.precision.row_bytes(dim) + 4)) as u64;
                Ok(())
            }
            fn element(&self) -> KvElement {
                self.core.precision
            }
            fn held_bytes(&self) -> TierBytes {
                self.core.held()
            }
            fn moved_bytes(&self) -> u64 {
                self.core.moved
            }
            fn save(&self, out: &mut dyn Write) -> Result<()> {
                save_layout(self, out)
            }
            fn load(&mut self, input: &mut dyn Read) -> Result<()> {
                load_layout(self, input)
            }
        }
    };
}

kv_cache_impl!(ShiftConcat);
kv_cache_impl!(PointerShift);
kv_cache_impl!(SmartMask);
