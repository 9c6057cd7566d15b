//! [`DeviceKv`]: a KV cache whose rows live on the device, in the cache's element type,
//! where the attention of a device pass reads them. The host keeps only positions and
//! slot bookkeeping; a decode step reads back no keys or values, and the rows come to
//! the host only when something there asks (a view for host attention, a saved
//! session).
//!
//! Tokens sit in slots. Eviction and rewind mask slots (their position becomes
//! [`MASKED_POSITION`], which the attention kernel skips) and new tokens fill the
//! lowest free slots (a sliding-window layer's go to slot `position mod rows`, so the
//! same window sits in the same slots however it was reached), so nothing is ever
//! moved on the device: whatever update mode a host cache would use, the device cache
//! behaves as the masking one. With evictions, attention then visits the live tokens in
//! slot order rather than cache order, which changes only the float summation order.

use std::cell::OnceCell;
use std::io::{Read, Write};
use std::ops::Range;
use std::sync::Arc;

use half::f16;

use super::ops::{record_kv_write, DeviceKvLayout};
use super::record::Recorder;
use crate::error::{Error, Result};
use crate::gpu::{GpuBuffer, GpuContext};
use crate::kv::{KvCache, KvElement, KvRows, KvSegment, KvShape, KvView, MASKED_POSITION};
use crate::kv_payload::{self, LayerRows};
use crate::store::TierBytes;
use ballast_core::kv_window::{
    keep_window, next_position, outside_window, rewind_floor, split_released,
};
use ballast_core::Q8_BLOCK;

/// One layer's rows on the device and its slot bookkeeping on the host.
struct DeviceLayer {
    keys: GpuBuffer,
    values: GpuBuffer,
    /// The position of every slot as attention reads it (masked when free).
    positions: GpuBuffer,
    /// The host's copy of `positions` for the slots ever used: its length is how many
    /// slots attention scans.
    slot_positions: Vec<u32>,
    /// Slots of the live tokens, in cache order.
    order: Vec<u32>,
    /// The live rows as read back, made on the first host view after a change.
    host: OnceCell<HostLayer>,
    /// Rows the buffers hold: the cache's capacity, or for a windowed layer its
    /// window plus one pass.
    rows: usize,
    /// The sliding window this layer keeps only (older tokens are released before a
    /// pass appends).
    window: Option<usize>,
    /// Tokens released by the window: the layer holds cache indices `dropped..`.
    dropped: usize,
}

/// A layer's live tokens on the host, in cache order and stored type.
struct HostLayer {
    positions: Vec<u32>,
    keys: HostRows,
    values: HostRows,
}

enum HostRows {
    F32(Vec<f32>),
    F16(Vec<f16>),
    Q8 { quants: Vec<i8>, scales: Vec<f16> },
}

impl HostRows {
    fn view(&self) -> KvRows<'_> {
        match self {
            HostRows::F32(v) => KvRows::F32(v),
            HostRows::F16(v) => KvRows::F16(v),
            HostRows::Q8 { quants, scales } => KvRows::Q8 { quants, scales },
        }
    }
}

/// What a device pass binds for one layer of a [`DeviceKv`].
pub(super) struct DeviceLayerKv<'a> {
    pub(super) keys: &'a wgpu::Buffer,
    pub(super) values: &'a wgpu::Buffer,
    pub(super) positions: &'a wgpu::Buffer,
    /// Slots attention scans (live or masked).
    pub(super) n_slots: usize,
    /// Rows the buffers hold (where an int8 cache's scales start).
    pub(super) rows: usize,
}

/// A [`KvCache`] whose keys and values live in device buffers of the cache's element
/// type (f32, f16 or q8 as [`KvElement`] says; a q8 cache holds 34 bytes per 32
/// values on the device too). Made by the wgpu backend
/// ([`crate::backend::DeviceExecutor::new_kv_cache`]); its device passes write new rows
/// in place and read back none. Host reads ([`KvCache::view`], [`KvCache::read`],
/// [`KvCache::save`]) read the rows back on demand; host writes
/// ([`KvCache::append`], [`KvCache::rewrite_keys`], [`KvCache::load`]) upload and
/// convert them with the same kernel a pass uses, so rows round exactly as a host
/// cache rounds them.
pub struct DeviceKv {
    ctx: Arc<GpuContext>,
    shape: KvShape,
    element: KvElement,
    capacity: usize,
    /// Most tokens a pass appends when a layer slides a window (else unbounded).
    chunk: usize,
    layers: Vec<DeviceLayer>,
    moved: u64,
}

impl DeviceKv {
    /// An empty cache of `shape` holding at most `capacity` tokens as `element`, its
    /// buffers allocated on `ctx`'s device now (a plan reserves them).
    pub fn new(
        ctx: Arc<GpuContext>,
        shape: KvShape,
        capacity: usize,
        element: KvElement,
    ) -> Result<DeviceKv> {
        DeviceKv::windowed(ctx, shape, capacity, element, &[], usize::MAX)
    }

    /// [`DeviceKv::new`] whose layer `l` keeps only the last `windows[l]` tokens when
    /// that is `Some` (a sliding-window layer: its buffers hold the window plus one
    /// pass of at most `chunk` tokens, and the tokens no later query sees are released
    /// before each pass appends); `windows` empty: every layer keeps every token.
    pub fn windowed(
        ctx: Arc<GpuContext>,
        shape: KvShape,
        capacity: usize,
        element: KvElement,
        windows: &[Option<usize>],
        chunk: usize,
    ) -> Result<DeviceKv> {
        if !windows.is_empty() && windows.len() != shape.n_layers {
            return Err(Error::InvalidArgument {
                what: format!(
                    "{} sliding windows for a KV cache of {} layers",
                    windows.len(),
                    shape.n_layers
                ),
            });
        }
        let chunk = chunk.max(1);
        let dim = shape.kv_dim();
        if element == KvElement::Q8 && dim % Q8_BLOCK != 0 {
            return Err(Error::InvalidArgument {
                what: format!(
                    "an int8 KV cache needs rows of a multiple of {Q8_BLOCK} values; this model's are {dim}"
                ),
            });
        }
        let elem = element;
        let usage = wgpu::BufferUsages::STORAGE
            | wgpu::BufferUsages::COPY_DST
            | wgpu::BufferUsages::COPY_SRC;
        let mut layers = Vec::with_capacity(shape.n_layers);
        for l in 0..shape.n_layers {
            let window = windows.get(l).copied().flatten().filter(|&w| w > 0);
            let rows = match window {
                Some(w) => (w - 1).saturating_add(chunk).min(capacity),
                None => capacity,
            };
            let bytes = elem.buffer_bytes(rows.max(1) * dim) as u64;
            let positions =
                ctx.buffer_with_usage((rows.max(1) * 4) as u64, usage, "device kv positions")?;
            layers.push(DeviceLayer {
                keys: ctx.buffer_with_usage(bytes, usage, "device kv keys")?,
                values: ctx.buffer_with_usage(bytes, usage, "device kv values")?,
                positions,
                slot_positions: Vec::new(),
                order: Vec::new(),
                host: OnceCell::new(),
                rows,
                window,
                dropped: 0,
            });
        }
        let windowed = layers.iter().any(|l| l.window.is_some());
        Ok(DeviceKv {
            ctx,
            shape,
            element,
            capacity,
            chunk: if windowed { chunk } else { usize::MAX },
            layers,
            moved: 0,
        })
    }

    /// Whether this cache's buffers belong to `ctx`'s device.
    pub(super) fn is_on(&self, ctx: &Arc<GpuContext>) -> bool {
        Arc::ptr_eq(&self.ctx, ctx)
    }

    pub(super) fn elem(&self) -> KvElement {
        self.element
    }

    /// The buffers and scan length a pass binds for `layer`.
    pub(super) fn layer(&self, layer: usize) -> Option<DeviceLayerKv<'_>> {
        self.layers.get(layer).map(|l| DeviceLayerKv {
            keys: l.keys.raw(),
            values: l.values.raw(),
            positions: l.positions.raw(),
            n_slots: l.slot_positions.len(),
            rows: l.rows,
        })
    }

    fn check_layer(&self, layer: usize) -> Result<()> {
        if layer >= self.shape.n_layers {
            return Err(Error::LayerIndex {
                index: layer,
                n_layers: self.shape.n_layers,
            });
        }
        Ok(())
    }

    /// Takes slots for `positions.len()` new tokens of `layer` (a windowed layer's by
    /// position, see `take_slots`; else the lowest free ones first), records their positions on both sides, and returns them. The rows are
    /// the caller's to write. A windowed layer first releases the tokens no query at
    /// these positions or later sees.
    pub(super) fn reserve(&mut self, layer: usize, positions: &[u32]) -> Result<Vec<u32>> {
        self.check_layer(layer)?;
        if let Some(w) = self.layers[layer].window {
            if positions.len() > self.chunk {
                return Err(Error::InvalidArgument {
                    what: format!(
                        "a pass of {} tokens into a KV cache whose sliding-window layers keep room for {} new tokens per pass",
                        positions.len(),
                        self.chunk
                    ),
                });
            }
            // Release what no query of this pass or a later one sees.
            if let Some(&q0) = positions.iter().min() {
                let l = &self.layers[layer];
                let out = l
                    .order
                    .iter()
                    .take_while(|&&s| {
                        outside_window(l.slot_positions[s as usize], w, u64::from(q0))
                    })
                    .count();
                if out > 0 {
                    self.mask_layer(layer, 0..out);
                    self.layers[layer].dropped += out;
                }
            }
        }
        self.take_slots(layer, positions)
    }

    /// [`DeviceKv::reserve`] without the window.
    fn take_slots(&mut self, layer: usize, positions: &[u32]) -> Result<Vec<u32>> {
        if positions.contains(&MASKED_POSITION) {
            return Err(Error::InvalidArgument {
                what: format!("position {MASKED_POSITION} is reserved for masked slots"),
            });
        }
        let l = &mut self.layers[layer];
        let total = l.dropped + l.order.len() + positions.len();
        if total > self.capacity || l.order.len() + positions.len() > l.rows {
            return Err(Error::ContextFull {
                needed: total,
                capacity: self.capacity,
            });
        }
        let mut slots = Vec::with_capacity(positions.len());
        for &p in positions {
            let is_free = |s: usize| {
                l.slot_positions
                    .get(s)
                    .is_none_or(|&q| q == MASKED_POSITION)
            };
            // A windowed layer puts position `p` in slot `p mod rows`: the window's
            // positions are consecutive, so they never collide, and the keys a query
            // sees sit in the same slots (attention sums them in the same order) however
            // the passes before it were cut and rolled back. Speculative decoding then
            // gives plain decoding's bits. Anything else takes the lowest free slot.
            let home = (l.window.is_some() && l.rows > 0).then(|| p as usize % l.rows);
            let s = match home.filter(|&s| is_free(s)) {
                Some(s) => s,
                None => (0..)
                    .find(|&s| is_free(s))
                    .unwrap_or(l.slot_positions.len()),
            };
            if s >= l.slot_positions.len() {
                l.slot_positions.resize(s + 1, MASKED_POSITION);
            }
            l.slot_positions[s] = p;
            slots.push(s as u32);
        }
        l.order.extend_from_slice(&slots);
        l.host = OnceCell::new();
        write_positions(&self.ctx, l, &slots);
        Ok(slots)
    }

    /// Masks the live tokens at cache indices `range` of every layer.
    fn release(&mut self, range: Range<usize>) {
        for layer in 0..self.layers.len() {
            self.release_layer(layer, range.clone());
        }
    }

    /// Masks the live tokens at cache indices `range` of `layer` (counted from the
    /// first token ever kept: a windowed layer holds indices `dropped..`).
    fn release_layer(&mut self, layer: usize, range: Range<usize>) {
        // Tokens the window already released only lower the count (a rewind below
        // them cannot bring them back: see `exact_rewind_floor`).
        let (already, held) = split_released(range, self.layers[layer].dropped);
        self.layers[layer].dropped -= already;
        self.mask_layer(layer, held);
    }

    /// Masks the live tokens at positions `range` of `layer`'s slot order.
    fn mask_layer(&mut self, layer: usize, range: Range<usize>) {
        let l = &mut self.layers[layer];
        let start = range.start.min(l.order.len());
        let end = range.end.clamp(start, l.order.len());
        if start == end {
            return;
        }
        let freed: Vec<u32> = l.order.drain(start..end).collect();
        for &s in &freed {
            l.slot_positions[s as usize] = MASKED_POSITION;
        }
        write_positions(&self.ctx, l, &freed);
        // Masked slots at the end need no scanning.
        while l.slot_positions.last() == Some(&MASKED_POSITION) {
            l.slot_positions.pop();
        }
        l.host = OnceCell::new();
    }

    /// Uploads `rows` (f32, one row per slot) into `slots` of `dst` with the KV-write
    /// kernel, submitted at once (no wait).
    fn write_rows(
        &self,
        dst: &wgpu::Buffer,
        layer_rows: usize,
        slots: &[u32],
        rows: &[f32],
    ) -> Result<()> {
        if slots.is_empty() {
            return Ok(());
        }
        let mut rec = Recorder::new(&self.ctx, false);
        let src = rec.upload("kv rows to write", bytemuck::cast_slice(rows))?;
        let slot_buf = rec.upload("kv slots", bytemuck::cast_slice(slots))?;
        record_kv_write(
            &mut rec,
            self.elem(),
            &src,
            0,
            slots.len(),
            self.shape.kv_dim(),
            &slot_buf,
            dst,
            layer_rows,
        )?;
        rec.flush()
    }

    /// Reads back the live rows of `layer` in cache order.
    fn read_layer(&self, layer: usize) -> Result<HostLayer> {
        let l = &self.layers[layer];
        let dim = self.shape.kv_dim();
        let (kb, vb) = (l.keys.size(), l.values.size());
        let encoder = self
            .ctx
            .device()
            .create_command_encoder(&wgpu::CommandEncoderDescriptor {
                label: Some("device kv read-back"),
            });
        let bytes = self
            .ctx
            .submit_and_read(encoder, &[(l.keys.raw(), 0, kb), (l.values.raw(), 0, vb)])?;
        let (kbytes, vbytes) = bytes.split_at(kb as usize);
        let elem = self.elem();
        let gather = |raw: &[u8]| -> HostRows {
            match elem {
                KvElement::F32 | KvElement::F16 => {
                    let size = if elem == KvElement::F32 { 4 } else { 2 };
                    let mut out = Vec::with_capacity(l.order.len() * dim * size);
                    for &s in &l.order {
                        out.extend_from_slice(&raw[s as usize * dim * size..][..dim * size]);
                    }
                    if elem == KvElement::F32 {
                        HostRows::F32(bytemuck::pod_collect_to_vec(&out))
                    } else {
                        HostRows::F16(bytemuck::pod_collect_to_vec(&out))
                    }
                }
                KvElement::Q8 => {
                    let spr = dim / Q8_BLOCK;
                    let scale_at = elem.scale_word(l.rows.max(1) * dim) * 4;
                    let mut quants = Vec::with_capacity(l.order.len() * dim);
                    let mut scales = Vec::with_capacity(l.order.len() * spr * 2);
                    for &s in &l.order {
                        let s = s as usize;
                        quants.extend_from_slice(&raw[s * dim..][..dim]);
                        scales.extend_from_slice(&raw[scale_at + s * spr * 2..][..spr * 2]);
                    }
                    HostRows::Q8 {
                        quants: bytemuck::pod_collect_to_vec(&quants),
                        scales: bytemuck::pod_collect_to_vec(&scales),
                    }
                }
            }
        };
        Ok(HostLayer {
            positions: l
                .order
                .iter()
                .map(|&s| l.slot_positions[s as usize])
                .collect(),
            keys: gather(kbytes),
            values: gather(vbytes),
        })
    }

    /// Writes stored rows (as a session payload holds them) into the slots
    /// `take_slots` gives them in `layer`, which must be empty.
    fn upload_stored(&mut self, layer: usize, rows: &LayerRows) -> Result<()> {
        let dim = self.shape.kv_dim();
        let row = self.element.row_bytes(dim);
        let slots = self.take_slots(layer, &rows.positions)?;
        // Slots `0..span` are written whole; the ones no token took stay masked.
        let span = slots.iter().max().map_or(0, |&s| s as usize + 1);
        let elem = self.elem();
        let queue = self.ctx.queue();
        let l = &self.layers[layer];
        for (which, buffer) in [(0, &l.keys), (1, &l.values)] {
            let token = |i: usize| {
                let (k, v) = rows.token(i, row);
                if which == 0 {
                    k
                } else {
                    v
                }
            };
            match elem {
                KvElement::F32 | KvElement::F16 => {
                    let mut data = vec![0u8; (span * row).next_multiple_of(4)];
                    for (i, &s) in slots.iter().enumerate() {
                        let at = s as usize * row;
                        data[at..at + row].copy_from_slice(token(i));
                    }
                    if !data.is_empty() {
                        queue.write_buffer(buffer.raw(), 0, &data);
                    }
                }
                KvElement::Q8 => {
                    let scale_row = row - dim;
                    let mut quants = vec![0u8; (span * dim).next_multiple_of(4)];
                    let mut scales = vec![0u8; (span * scale_row).next_multiple_of(4)];
                    for (i, &s) in slots.iter().enumerate() {
                        let s = s as usize;
                        quants[s * dim..(s + 1) * dim].copy_from_slice(&token(i)[..dim]);
                        scales[s * scale_row..(s + 1) * scale_row]
                            .copy_from_slice(&token(i)[dim..]);
                    }
                    let scale_at = (elem.scale_word(l.rows.max(1) * dim) * 4) as u64;
                    if !slots.is_empty() {
                        queue.write_buffer(buffer.raw(), 0, &quants);
                        queue.write_buffer(buffer.raw(), scale_at, &scales);
                    }
                }
            }
        }
        Ok(())
    }

    /// Bytes of the device buffers.
    pub fn device_bytes(&self) -> u64 {
        self.layers
            .iter()
            .map(|l| l.keys.size() + l.values.size() + l.positions.size())
            .sum()
    }
}

/// Writes the positions of `slots` (taken from the host copy; past its end, masked)
/// to the device, as one write covering them.
fn write_positions(ctx: &GpuContext, l: &DeviceLayer, slots: &[u32]) {
    let (Some(&lo), Some(&hi)) = (slots.iter().min(), slots.iter().max()) else {
        return;
    };
    let (lo, hi) = (lo as usize, hi as usize);
    let span: Vec<u32> = (lo..=hi)
        .map(|s| l.slot_positions.get(s).copied().unwrap_or(MASKED_POSITION))
        .collect();
    ctx.queue().write_buffer(
        l.positions.raw(),
        (lo * 4) as u64,
        bytemuck::cast_slice(&span),
    );
}

impl KvCache for DeviceKv {
    fn shape(&self) -> KvShape {
        self.shape
    }

    fn element(&self) -> KvElement {
        self.element
    }

    fn capacity(&self) -> usize {
        self.capacity
    }

    fn len(&self) -> usize {
        self.layers.first().map_or(0, |l| l.dropped + l.order.len())
    }

    fn append(
        &mut self,
        layer: usize,
        positions: &[u32],
        keys: &[f32],
        values: &[f32],
    ) -> Result<()> {
        self.check_layer(layer)?;
        let expected = positions.len() * self.shape.kv_dim();
        if keys.len() != expected || values.len() != expected {
            return Err(Error::KvShape {
                expected,
                keys: keys.len(),
                values: values.len(),
            });
        }
        let slots = self.reserve(layer, positions)?;
        let l = &self.layers[layer];
        let written = self
            .write_rows(l.keys.raw(), l.rows, &slots, keys)
            .and_then(|()| self.write_rows(l.values.raw(), l.rows, &slots, values));
        if let Err(e) = written {
            let keep = self.layers[layer].order.len() - slots.len();
            self.mask_layer(layer, keep..usize::MAX);
            return Err(e);
        }
        self.moved += 2 * (slots.len() * self.element.row_bytes(self.shape.kv_dim())) as u64;
        Ok(())
    }

    fn view(&self, layer: usize) -> KvView<'_> {
        let Some(l) = self.layers.get(layer) else {
            return KvView::default();
        };
        // A view cannot fail; a device that cannot be read shows an empty layer, and
        // `save`, which can fail, reports the error itself.
        let host = l.host.get_or_init(|| {
            self.read_layer(layer).unwrap_or(HostLayer {
                positions: Vec::new(),
                keys: HostRows::F32(Vec::new()),
                values: HostRows::F32(Vec::new()),
            })
        });
        KvView {
            segments: vec![KvSegment {
                keys: host.keys.view(),
                values: host.values.view(),
                positions: &host.positions,
            }],
        }
    }

    fn positions(&self, layer: usize, range: Range<usize>, out: &mut Vec<u32>) {
        if let Some(l) = self.layers.get(layer) {
            let start = range.start.min(l.order.len());
            let end = range.end.clamp(start, l.order.len());
            out.extend(
                l.order[start..end]
                    .iter()
                    .map(|&s| l.slot_positions[s as usize]),
            );
        }
    }

    fn device_rows(&mut self) -> Option<&mut dyn std::any::Any> {
        Some(self)
    }

    fn rewind(&mut self, n_tokens: usize) {
        self.release(n_tokens..usize::MAX);
    }

    fn exact_rewind_floor(&self) -> usize {
        self.layers
            .iter()
            .filter_map(|l| l.window.map(|w| rewind_floor(l.dropped, w)))
            .max()
            .unwrap_or(0)
    }

    fn pass_limit(&self) -> usize {
        self.chunk
    }

    fn evict(&mut self, range: Range<usize>) {
        self.release(range);
    }

    fn rewrite_keys(
        &mut self,
        layer: usize,
        start: usize,
        positions: &[u32],
        keys: &[f32],
    ) -> Result<()> {
        let dim = self.shape.kv_dim();
        let len = self.layers.get(layer).map_or(0, |l| l.order.len());
        if layer >= self.shape.n_layers
            || start + positions.len() > len
            || keys.len() != positions.len() * dim
            || positions.contains(&MASKED_POSITION)
        {
            return Err(Error::InvalidArgument {
                what: format!(
                    "rewriting {} keys from token {start} of layer {layer}, which holds {len}",
                    positions.len()
                ),
            });
        }
        let slots = self.layers[layer].order[start..start + positions.len()].to_vec();
        let l = &self.layers[layer];
        self.write_rows(l.keys.raw(), l.rows, &slots, keys)?;
        let l = &mut self.layers[layer];
        for (&s, &p) in slots.iter().zip(positions) {
            l.slot_positions[s as usize] = p;
        }
        write_positions(&self.ctx, l, &slots);
        l.host = OnceCell::new();
        self.moved += (positions.len() * (self.element.row_bytes(dim) + 4)) as u64;
        Ok(())
    }

    fn held_bytes(&self) -> TierBytes {
        TierBytes {
            device: self.device_bytes(),
            ..TierBytes::default()
        }
    }

    fn moved_bytes(&self) -> u64 {
        self.moved
    }

    fn save(&self, out: &mut dyn Write) -> Result<()> {
        let row = self.element.row_bytes(self.shape.kv_dim());
        let mut layers = Vec::with_capacity(self.shape.n_layers);
        for layer in 0..self.shape.n_layers {
            let host = self.read_layer(layer)?;
            let (k, v) = (host.keys.view(), host.values.view());
            let mut rows = Vec::with_capacity(2 * row * host.positions.len());
            for i in 0..host.positions.len() {
                for r in [&k, &v] {
                    stored_row(r, i, self.shape.kv_dim(), &mut rows);
                }
            }
            layers.push(LayerRows {
                positions: host.positions,
                rows,
            });
        }
        kv_payload::write(out, self.element, self.shape, &layers)
    }

    /// Loads any payload of this shape; a windowed layer keeps the last tokens its
    /// window needs (so a session saved from a cache keeping every token loads too).
    fn load(&mut self, input: &mut dyn Read) -> Result<()> {
        let mut layers = kv_payload::read(input, self.element, self.shape, self.capacity)?;
        let total = layers.iter().map(|l| l.positions.len()).max().unwrap_or(0);
        let next = next_position(&layers);
        let row = self.element.row_bytes(self.shape.kv_dim());
        for (l, rows) in self.layers.iter().zip(&mut layers) {
            if let Some(w) = l.window {
                keep_window(rows, w, next, row);
            }
        }
        self.release(0..usize::MAX);
        for (layer, rows) in layers.iter().enumerate() {
            self.upload_stored(layer, rows)?;
            let l = &mut self.layers[layer];
            l.dropped = total - rows.positions.len();
        }
        Ok(())
    }
}

/// Appends token `i`'s stored row of `rows` (rows of `dim`) to `out`: elements, then
/// for int8 the scales.
fn stored_row(rows: &KvRows<'_>, i: usize, dim: usize, out: &mut Vec<u8>) {
    match rows {
        KvRows::F32(v) => out.extend_from_slice(bytemuck::cast_slice(&v[i * dim..][..dim])),
        KvRows::F16(v) => out.extend_from_slice(bytemuck::cast_slice(&v[i * dim..][..dim])),
        KvRows::Q8 { quants, scales } => {
            let spr = dim / Q8_BLOCK;
            out.extend_from_slice(bytemuck::cast_slice(&quants[i * dim..][..dim]));
            out.extend_from_slice(bytemuck::cast_slice(&scales[i * spr..][..spr]));
        }
    }
}
