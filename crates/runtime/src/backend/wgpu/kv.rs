//! The device mirrors of host KV caches handed to a device pass (a cache of the
//! backend's own, [`super::DeviceKv`], needs none): one per host cache recently run,
//! synced from it where they differ, appended to by the pass itself, whose new keys
//! and values are then read back into the host cache.

use super::*;
use crate::kv::{KvElement, Q8_BLOCK};
use ops::DeviceKvLayout;

/// The device's copy of the KV cache, mirroring the host [`KvCache`] of a session, in
/// the element type [`mirror_element`] gives: the pass writes new rows into it with
/// `kv_write` (rounded exactly as the host rounds them) and attention reads it as
/// stored, so the device holds what the host holds.
pub(super) struct KvMirror {
    pub(super) elem: KvElement,
    pub(super) capacity: usize,
    pub(super) kv_dim: usize,
    pub(super) keys: Vec<GpuBuffer>,
    pub(super) values: Vec<GpuBuffer>,
    pub(super) positions: GpuBuffer,
    /// Positions of the mirrored tokens (the host cache's layer 0 order).
    pub(super) host_positions: Vec<u32>,
    /// The address of the host cache mirrored: sessions sharing this backend each have
    /// their own cache and mirror, since equal positions say nothing of equal keys.
    pub(super) owner: usize,
    /// When the mirror was last used, in passes: the least recent goes first.
    pub(super) last_use: u64,
}

/// Device KV mirrors a backend keeps at once (one per session recently run).
pub const MAX_KV_MIRRORS: usize = 4;

/// The element type a device mirror of a host cache of `host` elements stores: the
/// same, except f16, which the device keeps in f32, exact as computed. Rounding the
/// device copy to f16 with attention summed in f32 moved the default model's greedy ids
/// off llama.cpp's at a 0.06 margin (the CPU backend rounds the query and the running
/// sums to f16 at every key, as llama.cpp does); an attention kernel in that exact order
/// (online softmax, f16 running sums, ggml's 64-lane dot order) was tried too and still
/// moved them (a step where llama.cpp's margin is wide came out at a 0.0005 gap: the
/// device's matmul order differs anyway, and the f32 copy happens to stay on the path).
/// So an f16 cache costs f32 on the device until the device pass is held to llama.cpp
/// by something less brittle than greedy ids.
pub(super) fn mirror_element(host: KvElement) -> KvElement {
    match host {
        KvElement::F32 | KvElement::F16 => KvElement::F32,
        KvElement::Q8 => KvElement::Q8,
    }
}

/// Writes rows `from..rows` of `packed` (a cache's `rows` rows of `dim` elements, as
/// stored) into a mirror buffer of `capacity` rows. Starts at an even row, so every
/// region starts on a 4-byte boundary, and pads the tail to whole words (the rows after
/// `rows` are unused).
fn write_rows(
    queue: &wgpu::Queue,
    buffer: &wgpu::Buffer,
    packed: &PackedRows,
    rows: usize,
    from: usize,
    dim: usize,
    capacity: usize,
) {
    let write = |at: usize, bytes: &[u8]| {
        if bytes.is_empty() {
            return;
        }
        if bytes.len() % 4 == 0 {
            queue.write_buffer(buffer, at as u64, bytes);
        } else {
            let mut padded = bytes.to_vec();
            padded.resize(bytes.len().next_multiple_of(4), 0);
            queue.write_buffer(buffer, at as u64, &padded);
        }
    };
    let from = from & !1;
    match packed.elem {
        KvElement::F32 => write(
            from * dim * 4,
            &packed.bytes[from * dim * 4..rows * dim * 4],
        ),
        KvElement::F16 => write(
            from * dim * 2,
            &packed.bytes[from * dim * 2..rows * dim * 2],
        ),
        KvElement::Q8 => {
            write(from * dim, &packed.bytes[from * dim..rows * dim]);
            let per_row = 2 * dim.div_ceil(Q8_BLOCK);
            let src = KvElement::Q8.scale_word(rows * dim) * 4;
            let dst = KvElement::Q8.scale_word(capacity * dim) * 4;
            write(
                dst + from * per_row,
                &packed.bytes[src + from * per_row..src + rows * per_row],
            );
        }
    }
}

/// Cached keys, values and positions of `kv` as flat host f32 arrays.
pub(super) fn flatten_view(kv: &KvView<'_>) -> (Vec<f32>, Vec<f32>, Vec<u32>) {
    let (mut k, mut v, mut p) = (Vec::new(), Vec::new(), Vec::new());
    for seg in &kv.segments {
        for (rows, out) in [(&seg.keys, &mut k), (&seg.values, &mut v)] {
            let start = out.len();
            out.resize(start + rows.len(), 0.0);
            rows.read_f32(0, &mut out[start..]);
        }
        p.extend_from_slice(seg.positions);
    }
    (k, v, p)
}
impl WgpuBackend {
    /// Brings the device mirror of `kv` up to date (same capacity and shape, and the
    /// same tokens, re-uploading what differs from the host cache), making one if `kv`
    /// has none, without evicting the mirrors of `in_pass` (the owners of caches
    /// already bound in this pass); returns `kv`'s owner key (its mirror's index may
    /// change as later ones are made).
    pub(super) fn sync_kv(
        &self,
        mirrors: &mut Vec<KvMirror>,
        kv: &dyn KvCache,
        n_layers: usize,
        kv_dim: usize,
        in_pass: &[usize],
    ) -> Result<usize> {
        let capacity = kv.capacity();
        let owner = kv as *const dyn KvCache as *const () as usize;
        let clock = mirrors.iter().map(|m| m.last_use).max().unwrap_or(0) + 1;
        let elem = mirror_element(kv.element());
        let found = mirrors.iter().position(|m| {
            m.owner == owner
                && m.elem == elem
                && m.capacity == capacity
                && m.kv_dim == kv_dim
                && m.keys.len() == n_layers
        });
        let at = match found {
            Some(at) => at,
            None => {
                mirrors.retain(|m| m.owner != owner);
                if mirrors.len() >= MAX_KV_MIRRORS {
                    // A batched pass keeps one mirror per sequence, however many.
                    if let Some(oldest) = (0..mirrors.len())
                        .filter(|&i| !in_pass.contains(&mirrors[i].owner))
                        .min_by_key(|&i| mirrors[i].last_use)
                    {
                        mirrors.remove(oldest);
                    }
                }
                // Exact sizes, not the pool's powers of two: the mirror is the largest
                // buffer set after the weights, and a plan reserves what it needs.
                let bytes = elem.buffer_bytes(capacity.max(1) * kv_dim) as u64;
                let usage = wgpu::BufferUsages::STORAGE
                    | wgpu::BufferUsages::COPY_DST
                    | wgpu::BufferUsages::COPY_SRC;
                let mut keys = Vec::with_capacity(n_layers);
                let mut values = Vec::with_capacity(n_layers);
                for _ in 0..n_layers {
                    keys.push(self.ctx.buffer_with_usage(bytes, usage, "kv keys")?);
                    values.push(self.ctx.buffer_with_usage(bytes, usage, "kv values")?);
                }
                mirrors.push(KvMirror {
                    elem,
                    capacity,
                    kv_dim,
                    keys,
                    values,
                    positions: self
                        .ctx
                        .buffer((capacity.max(1) * 4) as u64, "kv positions")?,
                    host_positions: Vec::new(),
                    owner,
                    last_use: clock,
                });
                mirrors.len() - 1
            }
        };
        let mirror = &mut mirrors[at];
        mirror.last_use = clock;
        let view0 = kv.view(0);
        let host_positions: Vec<u32> = view0
            .segments
            .iter()
            .flat_map(|s| s.positions.iter().copied())
            .collect();
        // The mirror is right up to the first token where it differs from the host.
        let same = mirror
            .host_positions
            .iter()
            .zip(&host_positions)
            .take_while(|(a, b)| a == b)
            .count();
        if same == host_positions.len() && same == mirror.host_positions.len() {
            return Ok(owner);
        }
        let queue = self.ctx.queue();
        for l in 0..n_layers {
            let view = kv.view(l);
            let rows: usize = view.segments.iter().map(|s| s.positions.len()).sum();
            if rows != host_positions.len() {
                return Err(Error::KvFormat {
                    why: format!("layer {l} holds a different number of tokens than layer 0"),
                });
            }
            if same >= rows {
                continue;
            }
            let (k, v) = if elem == KvElement::F32 {
                // An f16 host cache widened to the f32 mirror (see mirror_element).
                let (k, v, _) = flatten_view(&view);
                let as_packed = |x: Vec<f32>| PackedRows {
                    elem,
                    elems: x.len(),
                    bytes: bytemuck::cast_slice(&x).to_vec(),
                };
                (as_packed(k), as_packed(v))
            } else {
                let keys: Vec<KvRows<'_>> = view.segments.iter().map(|s| s.keys).collect();
                let values: Vec<KvRows<'_>> = view.segments.iter().map(|s| s.values).collect();
                (
                    PackedRows::new("keys", &keys)?,
                    PackedRows::new("values", &values)?,
                )
            };
            for (packed, buffer) in [(&k, &mirror.keys[l]), (&v, &mirror.values[l])] {
                if packed.elem != elem {
                    return Err(Error::KvFormat {
                        why: format!("layer {l}'s rows are not stored as the cache says"),
                    });
                }
                write_rows(
                    queue,
                    buffer.raw(),
                    packed,
                    rows,
                    same,
                    kv_dim,
                    mirror.capacity,
                );
            }
        }
        if same < host_positions.len() {
            queue.write_buffer(
                mirror.positions.raw(),
                (same * 4) as u64,
                bytemuck::cast_slice(&host_positions[same..]),
            );
        }
        mirror.host_positions = host_positions;
        Ok(owner)
    }
}
