//! The device mirrors of host KV caches: one per session cache recently run, synced
//! from the host cache where they differ, appended to by the pass itself.

use super::*;

/// The device's copy of the KV cache, mirroring the host [`KvCache`] of a session. It
/// holds f32: new keys and values stay as computed (the host cache rounds them to its
/// own storage type on append, f16 by default); tokens re-uploaded from the host carry
/// the host's rounding. Rounding the device copy to f16 as well, with attention still
/// summed in f32, was tried: it moved the default model's greedy ids off llama.cpp's
/// at a 0.06 margin, so the device keeps the exact values.
pub(super) struct KvMirror {
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
    /// has none; returns its index in `mirrors`.
    pub(super) fn sync_kv(
        &self,
        mirrors: &mut Vec<KvMirror>,
        kv: &dyn KvCache,
        n_layers: usize,
        kv_dim: usize,
    ) -> Result<usize> {
        let capacity = kv.capacity();
        let owner = kv as *const dyn KvCache as *const () as usize;
        let clock = mirrors.iter().map(|m| m.last_use).max().unwrap_or(0) + 1;
        let found = mirrors.iter().position(|m| {
            m.owner == owner
                && m.capacity == capacity
                && m.kv_dim == kv_dim
                && m.keys.len() == n_layers
        });
        let at = match found {
            Some(at) => at,
            None => {
                mirrors.retain(|m| m.owner != owner);
                if mirrors.len() >= MAX_KV_MIRRORS {
                    let oldest = (0..mirrors.len())
                        .min_by_key(|&i| mirrors[i].last_use)
                        .expect("not empty");
                    mirrors.remove(oldest);
                }
                // Exact sizes, not the pool's powers of two: the mirror is the largest
                // buffer set after the weights, and a plan reserves what it needs.
                let bytes = (capacity.max(1) * kv_dim * 4) as u64;
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
            return Ok(at);
        }
        let queue = self.ctx.queue();
        for l in 0..n_layers {
            let (k, v, _) = flatten_view(&kv.view(l));
            if k.len() != host_positions.len() * kv_dim {
                return Err(Error::KvFormat {
                    why: format!("layer {l} holds a different number of tokens than layer 0"),
                });
            }
            let from = same * kv_dim;
            if from < k.len() {
                queue.write_buffer(
                    mirror.keys[l].raw(),
                    (from * 4) as u64,
                    bytemuck::cast_slice(&k[from..]),
                );
                queue.write_buffer(
                    mirror.values[l].raw(),
                    (from * 4) as u64,
                    bytemuck::cast_slice(&v[from..]),
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
        Ok(at)
    }
}
