//! The stream-slot ring: weights whose bytes may not be cached on the device (a tiered
//! store's RAM and disk tiers) are uploaded per use into one of `depth` slots, round
//! robin; a pass submits before it overwrites a slot its recorded commands still read.
//! A weight whose store lends its coded chunks goes up coded and is decoded into its
//! slot on the device (`decode`).

use super::decode::{record_decode, CodedLayout, DecodeBuffers};
use super::*;

/// The device buffers of the stream slots: weights that may not be cached on the device
/// are uploaded into one of `depth` slots per use, round robin. A slot is a list of
/// buffers, one per weight chunk in upload order, grown when a layer needs more.
pub(super) struct StreamRing {
    pub(super) depth: usize,
    pub(super) slots: Vec<Vec<Arc<GpuBuffer>>>,
    /// Per slot, per coded weight in upload order: the buffers its coded chunks go up
    /// in (stored bytes, descriptors, the decoder's status).
    pub(super) coded: Vec<Vec<CodedSlot>>,
    pub(super) next: usize,
}

/// The buffers one coded weight of a slot goes up in.
pub(super) struct CodedSlot {
    stored: Arc<GpuBuffer>,
    descriptors: Arc<GpuBuffer>,
    status: Arc<GpuBuffer>,
}

/// `kept` if it holds `size` bytes, else a new slot buffer that does.
fn grown(
    ctx: &GpuContext,
    kept: Option<&Arc<GpuBuffer>>,
    size: u64,
    label: &str,
) -> Result<Arc<GpuBuffer>> {
    match kept {
        Some(b) if b.size() >= size => Ok(b.clone()),
        _ => Ok(Arc::new(ctx.buffer_with_usage(
            size,
            wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_DST,
            label,
        )?)),
    }
}

/// Buffer `j` of `buffers`, made (or remade larger) to hold at least `size` bytes.
fn slot_buffer(
    ctx: &GpuContext,
    buffers: &mut Vec<Arc<GpuBuffer>>,
    j: usize,
    size: u64,
) -> Result<Arc<GpuBuffer>> {
    let b = grown(ctx, buffers.get(j), size, "stream slot")?;
    match buffers.get_mut(j) {
        Some(kept) => *kept = b.clone(),
        None => buffers.push(b.clone()),
    }
    Ok(b)
}

/// Coded buffers `k` of `coded`, grown to hold `layout`.
fn coded_slot<'a>(
    ctx: &GpuContext,
    coded: &'a mut Vec<CodedSlot>,
    k: usize,
    layout: &CodedLayout,
) -> Result<&'a CodedSlot> {
    let kept = coded.get(k);
    let slot = CodedSlot {
        stored: grown(
            ctx,
            kept.map(|c| &c.stored),
            (layout.stored.len() as u64).max(4),
            "coded slot",
        )?,
        descriptors: grown(
            ctx,
            kept.map(|c| &c.descriptors),
            (layout.descriptors.len() as u64 * 4).max(4),
            "coded slot",
        )?,
        status: grown(
            ctx,
            kept.map(|c| &c.status),
            u64::from(layout.n_chunks).max(1) * 4,
            "coded slot",
        )?,
    };
    if coded.len() <= k {
        coded.push(slot);
    } else {
        coded[k] = slot;
    }
    Ok(&coded[k])
}

/// Stream slots a new backend uses: double buffering (upload one layer while the
/// previous one computes).
pub const DEFAULT_STREAM_SLOTS: usize = 2;

impl WgpuBackend {
    /// Sets the number of stream slots (at least 1): device buffers that layers whose
    /// weights may not be cached on the device (a tiered store's RAM and disk tiers) are
    /// uploaded into, one layer per slot. A device pass submits its commands so far
    /// before it reuses a slot, so `n` slots mean one submission per `n` streamed
    /// layers. Device memory: `n` times the largest streamed layer (plus, for layers
    /// that go up coded, their coded chunks).
    pub fn set_stream_slots(&self, n: usize) {
        let mut ring = self.stream.lock().unwrap_or_else(|p| p.into_inner());
        let depth = n.max(1);
        ring.depth = depth;
        ring.slots.truncate(depth);
        ring.coded.truncate(depth);
        ring.next = 0;
    }

    /// The device weights of `layer`'s matrices, in table order, for one device pass:
    /// those whose role is in `used` (what the pass's ops multiply by; a lever's MLP
    /// computes its own at a host sync point, so its matrices are not put on the device
    /// here), `None` for the others. Cacheable ones come from the cache; the others are
    /// uploaded into the next stream slot, after submitting what `rec` holds if that
    /// slot is still in use by recorded commands (`in_use`: slots written since the
    /// last submission).
    pub(super) fn layer_weights(
        &self,
        rec: &mut Recorder<'_>,
        layer: &crate::weights::LayerWeights,
        used: &[&str],
        in_use: &mut Vec<bool>,
    ) -> Result<Vec<Option<Arc<DeviceWeight>>>> {
        let mats: Vec<Option<&Weight>> = layer
            .matrices
            .iter()
            .map(|(role, w)| used.contains(&role.as_str()).then_some(w))
            .collect();
        let streamed = mats.iter().flatten().any(|w| !w.bytes.cache_on_device());
        let mut ring = self.stream.lock().unwrap_or_else(|p| p.into_inner());
        let slot = if streamed {
            let slot = ring.next;
            ring.next = (ring.next + 1) % ring.depth;
            in_use.resize(ring.depth, false);
            if in_use[slot] {
                rec.flush()?;
                in_use.iter_mut().for_each(|u| *u = false);
            }
            in_use[slot] = true;
            if ring.slots.len() <= slot {
                ring.slots.resize_with(slot + 1, Vec::new);
            }
            if ring.coded.len() <= slot {
                ring.coded.resize_with(slot + 1, Vec::new);
            }
            Some(slot)
        } else {
            None
        };
        let mut next_buffer = 0usize;
        let mut next_coded = 0usize;
        let mut out = Vec::with_capacity(mats.len());
        for w in mats {
            let Some(w) = w else {
                out.push(None);
                continue;
            };
            let d = match slot {
                Some(slot) if !w.bytes.cache_on_device() => {
                    let ring = &mut *ring;
                    let coded = self.coded_layout(w);
                    let buffers = &mut ring.slots[slot];
                    if let Some(layout) = coded {
                        let target = slot_buffer(
                            &self.ctx,
                            buffers,
                            next_buffer,
                            layout.raw_len.div_ceil(4).max(1) * 4,
                        )?;
                        next_buffer += 1;
                        let staging =
                            coded_slot(&self.ctx, &mut ring.coded[slot], next_coded, &layout)?;
                        next_coded += 1;
                        self.upload_and_decode(rec, &layout, staging, &target);
                        out.push(Some(Arc::new(self.whole_weight(w, target)?)));
                        continue;
                    }
                    Arc::new(self.split_weight(w, |piece| {
                        let size = (piece.len() as u64).div_ceil(4).max(1) * 4;
                        let j = next_buffer;
                        next_buffer += 1;
                        let target = slot_buffer(&self.ctx, buffers, j, size)?;
                        // Copies must be whole 4-byte words (Q4_0 rows are 18 bytes).
                        if piece.len() as u64 == size {
                            self.ctx.queue().write_buffer(target.raw(), 0, piece);
                        } else {
                            let mut padded = piece.to_vec();
                            padded.resize(size as usize, 0);
                            self.ctx.queue().write_buffer(target.raw(), 0, &padded);
                        }
                        rec.add_upload(piece.len() as u64);
                        Ok(target)
                    })?)
                }
                _ => self.weight(w)?,
            };
            out.push(Some(d));
        }
        Ok(out)
    }

    /// Writes `layout`'s coded chunks and descriptors into `staging` and records their
    /// decode into `target`, counting the coded bytes as uploaded.
    fn upload_and_decode(
        &self,
        rec: &mut Recorder<'_>,
        layout: &CodedLayout,
        staging: &CodedSlot,
        target: &GpuBuffer,
    ) {
        let queue = self.ctx.queue();
        if !layout.stored.is_empty() {
            queue.write_buffer(staging.stored.raw(), 0, &layout.stored);
        }
        queue.write_buffer(
            staging.descriptors.raw(),
            0,
            bytemuck::cast_slice(&layout.descriptors),
        );
        rec.add_upload(layout.upload_bytes());
        record_decode(
            rec,
            layout,
            &DecodeBuffers {
                stored: staging.stored.raw(),
                descriptors: staging.descriptors.raw(),
                status: staging.status.raw(),
                out: target.raw(),
            },
        );
    }

    /// `w`'s coded chunks laid out for the device decoder, when its store lends them
    /// and they decode into one binding; `None` sends the raw bytes up instead.
    fn coded_layout(&self, w: &Weight) -> Option<CodedLayout> {
        if !weights::gpu_supports(w.ty) || w.bytes.len() as u64 > self.max_chunk_bytes {
            return None;
        }
        let layout = CodedLayout::new(&w.bytes.coded()?)?;
        (layout.raw_len == w.bytes.len() as u64).then_some(layout)
    }
}
