//! The stream-slot ring: weights whose bytes may not be cached on the device (a tiered
//! store's RAM and disk tiers) are uploaded per use into one of `depth` slots, round
//! robin; a pass submits before it overwrites a slot its recorded commands still read.

use super::*;

/// The device buffers of the stream slots: weights that may not be cached on the device
/// are uploaded into one of `depth` slots per use, round robin. A slot is a list of
/// buffers, one per weight chunk in upload order, grown when a layer needs more.
pub(super) struct StreamRing {
    pub(super) depth: usize,
    pub(super) slots: Vec<Vec<Arc<GpuBuffer>>>,
    pub(super) next: usize,
}

/// Stream slots a new backend uses: double buffering (upload one layer while the
/// previous one computes).
pub const DEFAULT_STREAM_SLOTS: usize = 2;

impl WgpuBackend {
    /// Sets the number of stream slots (at least 1): device buffers that layers whose
    /// weights may not be cached on the device (a tiered store's RAM and disk tiers) are
    /// uploaded into, one layer per slot. A device pass submits its commands so far
    /// before it reuses a slot, so `n` slots mean one submission per `n` streamed
    /// layers. Device memory: `n` times the largest streamed layer.
    pub fn set_stream_slots(&self, n: usize) {
        let mut ring = self.stream.lock().unwrap_or_else(|p| p.into_inner());
        let depth = n.max(1);
        ring.depth = depth;
        ring.slots.truncate(depth);
        ring.next = 0;
    }

    /// The device weights of `layer`'s matrices, in table order, for one device pass.
    /// Cacheable ones come from the cache; the others are uploaded into the next stream
    /// slot, after submitting what `rec` holds if that slot is still in use by recorded
    /// commands (`in_use`: slots written since the last submission).
    pub(super) fn layer_weights(
        &self,
        rec: &mut Recorder<'_>,
        layer: &crate::weights::LayerWeights,
        in_use: &mut Vec<bool>,
    ) -> Result<Vec<Arc<DeviceWeight>>> {
        let mats: Vec<&Weight> = layer.weights().collect();
        let streamed = mats.iter().any(|w| !w.bytes.cache_on_device());
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
            Some(slot)
        } else {
            None
        };
        let mut next_buffer = 0usize;
        let mut out = Vec::with_capacity(mats.len());
        for w in mats {
            let d = match slot {
                Some(slot) if !w.bytes.cache_on_device() => {
                    let buffers = &mut ring.slots[slot];
                    Arc::new(self.split_weight(w, |piece| {
                        let size = (piece.len() as u64).div_ceil(4).max(1) * 4;
                        let j = next_buffer;
                        next_buffer += 1;
                        if buffers.len() <= j || buffers[j].size() < size {
                            let b = Arc::new(self.ctx.buffer_with_usage(
                                size,
                                wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_DST,
                                "stream slot",
                            )?);
                            if buffers.len() <= j {
                                buffers.push(b);
                            } else {
                                buffers[j] = b;
                            }
                        }
                        // Copies must be whole 4-byte words (Q4_0 rows are 18 bytes).
                        if piece.len() as u64 == size {
                            self.ctx.queue().write_buffer(buffers[j].raw(), 0, piece);
                        } else {
                            let mut padded = piece.to_vec();
                            padded.resize(size as usize, 0);
                            self.ctx.queue().write_buffer(buffers[j].raw(), 0, &padded);
                        }
                        rec.add_upload(piece.len() as u64);
                        Ok(buffers[j].clone())
                    })?)
                }
                _ => self.weight(w)?,
            };
            out.push(d);
        }
        Ok(out)
    }
}
