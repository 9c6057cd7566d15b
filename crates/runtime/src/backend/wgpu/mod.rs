//! The wgpu backend: every op of the forward pass as a WGSL compute shader (the `.wgsl`
//! files beside this module), dispatched through the runtime's [`GpuContext`].
//!
//! Two ways in:
//!
//! - The [`Backend`] ops, one submission and one read-back each, on host slices. They
//!   exist so the backend test suite (`tests/backend_ops.rs`) holds every kernel to the
//!   CPU reference, and so any lever that calls the trait works on the GPU.
//! - [`DeviceForward`]: a whole forward pass recorded into one command encoder, with
//!   activations, weights and a mirror of the KV cache on the device. Decode of one token
//!   is one submission with one read-back (the logits, or the greedy id, plus the new
//!   keys and values so the host [`KvCache`] stays the complete record).
//!
//! Layers a store streams (their bytes may not be cached on the device) are uploaded
//! into a ring of stream slots as the pass reaches them; before a slot is overwritten
//! the commands recorded so far are submitted, so a pass over streamed layers is one
//! submission per slot-ring turn, still with one read-back.
//!
//! Matrix products read the GGUF blocks directly; activations are quantized on the
//! device exactly as the CPU backend quantizes them (Q8_0, Q8_1, Q8_K), so the integer
//! block sums are identical and only float summation order differs.

mod pass;
mod record;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use super::cpu::{check_len, check_rows};
use super::{
    AttentionShape, Backend, DeviceForward, MatmulJob, OpKind, OpTimes, PassReport, Rope, RopeStyle,
};
use crate::error::{Error, Result};
use crate::ggml_type::GgmlType;
use crate::gpu::{GpuBuffer, GpuContext, Shader};
use crate::kv::{KvCache, KvView};
use crate::quant;
use crate::weights::{Weight, WeightBytes};
use record::{Params, Recorder};

pub(crate) const EMBED: Shader = Shader {
    name: "ballast.embed",
    source: concat!(
        include_str!("params.wgsl"),
        include_str!("embed.wgsl"),
        include_str!("blocks.wgsl")
    ),
};
pub(crate) const MATMUL: Shader = Shader {
    name: "ballast.matmul",
    source: concat!(
        include_str!("params.wgsl"),
        include_str!("matmul.wgsl"),
        include_str!("blocks.wgsl")
    ),
};
pub(crate) const MATMUL_F: Shader = Shader {
    name: "ballast.matmul_f",
    source: concat!(
        include_str!("params.wgsl"),
        include_str!("matmul_f.wgsl"),
        include_str!("blocks.wgsl")
    ),
};
pub(crate) const QUANTIZE: Shader = Shader {
    name: "ballast.quantize",
    source: concat!(include_str!("params.wgsl"), include_str!("quantize.wgsl")),
};
pub(crate) const RMS_NORM: Shader = Shader {
    name: "ballast.rms_norm",
    source: concat!(include_str!("params.wgsl"), include_str!("rms_norm.wgsl")),
};
pub(crate) const ROPE: Shader = Shader {
    name: "ballast.rope",
    source: concat!(include_str!("params.wgsl"), include_str!("rope.wgsl")),
};
pub(crate) const ELEMENTWISE: Shader = Shader {
    name: "ballast.elementwise",
    source: concat!(
        include_str!("params.wgsl"),
        include_str!("elementwise.wgsl")
    ),
};
pub(crate) const ATTENTION: Shader = Shader {
    name: "ballast.attention",
    source: concat!(include_str!("params.wgsl"), include_str!("attention.wgsl")),
};
pub(crate) const ARGMAX: Shader = Shader {
    name: "ballast.argmax",
    source: concat!(include_str!("params.wgsl"), include_str!("argmax.wgsl")),
};

/// Weight types with a GPU kernel.
fn gpu_supports(ty: GgmlType) -> bool {
    !matches!(ty, GgmlType::Q8_1 | GgmlType::Q8_K)
}

/// Floats of activation scales per block for an activation type.
fn scales_per_block(act: GgmlType) -> usize {
    match act {
        GgmlType::Q8_1 => 2,
        GgmlType::Q8_K => 17,
        _ => 1,
    }
}

/// A weight on the device: its rows split into chunks that each fit one binding.
pub(crate) struct DeviceWeight {
    name: String,
    ty: GgmlType,
    rows: usize,
    cols: usize,
    row_bytes: usize,
    chunks: Vec<WeightChunk>,
    /// For a cached weight, keeps the host bytes alive, so the address that keys the
    /// cache is never reused.
    _host: Option<WeightBytes>,
}

struct WeightChunk {
    /// A buffer of its own (cached or one-off weights) or a stream slot's buffer, which
    /// may be larger than the chunk.
    buffer: Arc<GpuBuffer>,
    first_row: usize,
    rows: usize,
}

/// The device buffers of the stream slots: weights that may not be cached on the device
/// are uploaded into one of `depth` slots per use, round robin. A slot is a list of
/// buffers, one per weight chunk in upload order, grown when a layer needs more.
struct StreamRing {
    depth: usize,
    slots: Vec<Vec<Arc<GpuBuffer>>>,
    next: usize,
}

/// Stream slots a new backend uses: double buffering (upload one layer while the
/// previous one computes).
pub const DEFAULT_STREAM_SLOTS: usize = 2;

/// A host vector and its device copy.
type CachedVector = (Arc<[f32]>, Arc<GpuBuffer>);

/// The device's copy of the KV cache, mirroring the host [`KvCache`] of a session. It
/// holds f32: new keys and values stay as computed (the host cache rounds them to its
/// own storage type on append, f16 by default); tokens re-uploaded from the host carry
/// the host's rounding. Rounding the device copy to f16 as well, with attention still
/// summed in f32, was tried: it moved the default model's greedy ids off llama.cpp's
/// at a 0.06 margin, so the device keeps the exact values.
struct KvMirror {
    capacity: usize,
    kv_dim: usize,
    keys: Vec<GpuBuffer>,
    values: Vec<GpuBuffer>,
    positions: GpuBuffer,
    /// Positions of the mirrored tokens (the host cache's layer 0 order).
    host_positions: Vec<u32>,
    /// The address of the host cache mirrored: sessions sharing this backend each have
    /// their own cache and mirror, since equal positions say nothing of equal keys.
    owner: usize,
    /// When the mirror was last used, in passes: the least recent goes first.
    last_use: u64,
}

/// Device KV mirrors a backend keeps at once (one per session recently run).
pub const MAX_KV_MIRRORS: usize = 4;

/// The wgpu backend. Weights are uploaded once, on first use, and kept on the device,
/// unless their bytes say they may not be cached
/// ([`crate::weights::ByteSource::cache_on_device`]: a tiered store's RAM tier and disk
/// slots): those are uploaded per use into a ring of stream slots.
pub struct WgpuBackend {
    ctx: Arc<GpuContext>,
    times: OpTimes,
    weights: Mutex<HashMap<(usize, usize), Arc<DeviceWeight>>>,
    /// Norm scales and biases on the device. Each entry holds the host `Arc`, so its
    /// address (the key) cannot be reused by another vector while cached.
    vectors: Mutex<HashMap<(usize, usize), CachedVector>>,
    /// One device mirror per host cache recently run (sessions sharing the backend),
    /// least recently used first out beyond [`MAX_KV_MIRRORS`].
    kv: Mutex<Vec<KvMirror>>,
    stream: Mutex<StreamRing>,
    /// Largest weight chunk; the binding limit unless a test lowers it.
    max_chunk_bytes: u64,
    profile: std::sync::atomic::AtomicBool,
    report: Mutex<PassReport>,
}

impl WgpuBackend {
    /// A backend on `ctx`.
    pub fn new(ctx: Arc<GpuContext>) -> WgpuBackend {
        let max_chunk_bytes = ctx.max_binding_bytes();
        WgpuBackend::with_chunk_limit(ctx, max_chunk_bytes)
    }

    /// A backend that splits weights into chunks of at most `max_chunk_bytes` (never more
    /// than the device's binding limit): tests use it to exercise the split path.
    pub fn with_chunk_limit(ctx: Arc<GpuContext>, max_chunk_bytes: u64) -> WgpuBackend {
        let max_chunk_bytes = max_chunk_bytes.min(ctx.max_binding_bytes()).max(4);
        WgpuBackend {
            ctx,
            times: OpTimes::default(),
            weights: Mutex::default(),
            vectors: Mutex::default(),
            kv: Mutex::default(),
            stream: Mutex::new(StreamRing {
                depth: DEFAULT_STREAM_SLOTS,
                slots: Vec::new(),
                next: 0,
            }),
            max_chunk_bytes,
            profile: Default::default(),
            report: Mutex::default(),
        }
    }

    /// The GPU context.
    pub fn context(&self) -> &Arc<GpuContext> {
        &self.ctx
    }

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

    /// The device copy of `w`: uploaded on first use and cached when its bytes allow
    /// ([`WeightBytes::cache_on_device`]), else uploaded for this one use.
    pub(crate) fn weight(&self, w: &Weight) -> Result<Arc<DeviceWeight>> {
        let bytes = w.bytes.as_slice();
        let cache = w.bytes.cache_on_device();
        let key = (bytes.as_ptr() as usize, bytes.len());
        if cache {
            if let Some(d) = self
                .weights
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .get(&key)
            {
                return Ok(d.clone());
            }
        }
        let mut d = self.split_weight(w, |piece| {
            Ok(Arc::new(self.ctx.weight_buffer(piece, &w.name)?))
        })?;
        if !cache {
            return Ok(Arc::new(d));
        }
        d._host = Some(w.bytes.clone());
        let d = Arc::new(d);
        self.weights
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(key, d.clone());
        Ok(d)
    }

    /// `w` checked and split by rows into chunks that each fit one binding; `place`
    /// puts each chunk's bytes, in order, in a device buffer.
    fn split_weight(
        &self,
        w: &Weight,
        mut place: impl FnMut(&[u8]) -> Result<Arc<GpuBuffer>>,
    ) -> Result<DeviceWeight> {
        let bytes = w.bytes.as_slice();
        if !gpu_supports(w.ty) {
            return Err(Error::GpuUnsupportedType {
                tensor: w.name.clone(),
                ty: w.ty.name().to_string(),
            });
        }
        let (rows, cols, row_bytes) = (w.rows(), w.cols(), w.row_bytes());
        if bytes.len() != rows * row_bytes {
            return Err(Error::ShapeMismatch {
                what: format!("bytes of {}", w.name),
                expected: rows * row_bytes,
                got: bytes.len(),
            });
        }
        // Split by rows so no chunk exceeds one binding; each chunk starts on a row.
        let rows_per_chunk = ((self.max_chunk_bytes as usize) / row_bytes.max(1)).max(1);
        if row_bytes as u64 > self.max_chunk_bytes {
            return Err(Error::GpuLimit {
                what: format!("one row of {}", w.name),
                needed: row_bytes as u64,
                limit: self.max_chunk_bytes,
            });
        }
        let mut chunks = Vec::new();
        let mut first_row = 0;
        while first_row < rows {
            let n = rows_per_chunk.min(rows - first_row);
            let buffer = place(&bytes[first_row * row_bytes..(first_row + n) * row_bytes])?;
            chunks.push(WeightChunk {
                buffer,
                first_row,
                rows: n,
            });
            first_row += n;
        }
        Ok(DeviceWeight {
            name: w.name.clone(),
            ty: w.ty,
            rows,
            cols,
            row_bytes,
            chunks,
            _host: None,
        })
    }

    /// The device weights of `layer`'s matrices, in table order, for one device pass.
    /// Cacheable ones come from the cache; the others are uploaded into the next stream
    /// slot, after submitting what `rec` holds if that slot is still in use by recorded
    /// commands (`in_use`: slots written since the last submission).
    fn layer_weights(
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

    /// The device copy of a small f32 vector (a norm scale, a bias), uploaded once.
    fn vector(&self, v: &Arc<[f32]>) -> Result<Arc<GpuBuffer>> {
        let key = (v.as_ptr() as usize, v.len());
        let mut cache = self.vectors.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((_, b)) = cache.get(&key) {
            return Ok(b.clone());
        }
        let b = Arc::new(self.ctx.weight_buffer(bytemuck::cast_slice(v), "vector")?);
        cache.insert(key, (v.clone(), b.clone()));
        Ok(b)
    }

    /// A pooled buffer holding `data`.
    fn upload(&self, data: &[u8], label: &str) -> Result<GpuBuffer> {
        let b = self.ctx.buffer(data.len() as u64, label)?;
        if !data.is_empty() {
            self.ctx.queue().write_buffer(b.raw(), 0, data);
        }
        Ok(b)
    }

    fn scratch(&self, bytes: usize, label: &str) -> Result<GpuBuffer> {
        self.ctx.buffer(bytes as u64, label)
    }

    fn recorder(&self) -> Recorder<'_> {
        Recorder::new(
            &self.ctx,
            self.profile.load(std::sync::atomic::Ordering::Relaxed),
        )
    }

    /// Records quantization of `x` (`n` rows of `k`) for each activation type `jobs`
    /// need, then one matrix product per job into its output buffer.
    fn record_matmul(
        &self,
        rec: &mut Recorder<'_>,
        x: &wgpu::Buffer,
        n: usize,
        k: usize,
        jobs: &[(&DeviceWeight, &wgpu::Buffer)],
    ) -> Result<()> {
        let mut acts: Vec<(GgmlType, wgpu::Buffer, wgpu::Buffer)> = Vec::new();
        for &(w, out) in jobs {
            if w.cols != k {
                return Err(Error::ShapeMismatch {
                    what: format!("input of {}", w.name),
                    expected: w.cols,
                    got: k,
                });
            }
            let at = quant::activation_type(w.ty);
            let float = at == GgmlType::F32;
            if !float && !acts.iter().any(|a| a.0 == at) {
                let bl = at.block_len();
                if k % bl != 0 {
                    return Err(Error::QuantBlockAlign {
                        ty: at,
                        len: k,
                        block_len: bl,
                    });
                }
                let nb = n * k / bl;
                // One pair per activation type: a batch may need two at once.
                let tag = at.id();
                let aq = rec.scratch("quantized activations", tag, (n * k * 4) as u64)?;
                let asc = rec.scratch(
                    "activation scales",
                    tag,
                    (nb * scales_per_block(at) * 4) as u64,
                )?;
                rec.dispatch(
                    &QUANTIZE,
                    "quantize",
                    &[("ATYPE", at.id() as f64)],
                    &[x, &aq, &asc],
                    Params::new([n as u32, k as u32, 0, 0], [0; 4], [0.0; 4]),
                    [nb.div_ceil(64) as u32, 1, 1],
                    "quantize",
                    (n * k * 4) as u64,
                    (n * k * 4 + nb * scales_per_block(at) * 4) as u64,
                    0,
                );
                acts.push((at, aq, asc));
            }
            let rows_total = w.rows as u32;
            for chunk in &w.chunks {
                let params = Params::new(
                    [chunk.rows as u32, k as u32, n as u32, rows_total],
                    [chunk.first_row as u32, w.row_bytes as u32, 0, 0],
                    [0.0; 4],
                );
                let groups = [chunk.rows.div_ceil(8) as u32, 1, n as u32];
                let wbytes = (chunk.rows * w.row_bytes * n) as u64;
                let written = (chunk.rows * n * 4) as u64;
                if float {
                    rec.dispatch(
                        &MATMUL_F,
                        "matmul_f",
                        &[("WTYPE", w.ty.id() as f64)],
                        &[chunk.buffer.raw(), x, out],
                        params,
                        groups,
                        "matmul",
                        (n * k * 4) as u64,
                        written,
                        wbytes,
                    );
                } else {
                    let (_, aq, asc) = acts.iter().find(|a| a.0 == at).expect("quantized above");
                    rec.dispatch(
                        &MATMUL,
                        "matmul_q",
                        &[("WTYPE", w.ty.id() as f64)],
                        &[chunk.buffer.raw(), aq, asc, out],
                        params,
                        groups,
                        "matmul",
                        (n * k * 4) as u64,
                        written,
                        wbytes,
                    );
                }
            }
        }
        Ok(())
    }

    fn record_embed(
        &self,
        rec: &mut Recorder<'_>,
        table: &DeviceWeight,
        ids: &wgpu::Buffer,
        n: usize,
        out: &wgpu::Buffer,
    ) {
        for chunk in &table.chunks {
            rec.dispatch(
                &EMBED,
                "embed",
                &[("WTYPE", table.ty.id() as f64)],
                &[chunk.buffer.raw(), ids, out],
                Params::new(
                    [
                        n as u32,
                        table.cols as u32,
                        chunk.first_row as u32,
                        chunk.rows as u32,
                    ],
                    [table.row_bytes as u32, 0, 0, 0],
                    [0.0; 4],
                ),
                [(n * table.cols).div_ceil(64) as u32, 1, 1],
                "embed",
                (n * 4) as u64,
                (n * table.cols * 4) as u64,
                (n * table.row_bytes) as u64 / table.chunks.len() as u64,
            );
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn record_rms_norm(
        &self,
        rec: &mut Recorder<'_>,
        x: &wgpu::Buffer,
        first_row: usize,
        rows: usize,
        scale: &wgpu::Buffer,
        n: usize,
        eps: f32,
        out: &wgpu::Buffer,
    ) {
        rec.dispatch(
            &RMS_NORM,
            "rms_norm",
            &[],
            &[x, scale, out],
            Params::new(
                [rows as u32, n as u32, first_row as u32, 0],
                [0; 4],
                [eps, 0.0, 0.0, 0.0],
            ),
            [rows as u32, 1, 1],
            "rms_norm",
            (rows * n * 8 + n * 4) as u64,
            (rows * n * 4) as u64,
            0,
        );
    }

    #[allow(clippy::too_many_arguments)]
    fn record_rope(
        &self,
        rec: &mut Recorder<'_>,
        x: &wgpu::Buffer,
        cos_sin: &wgpu::Buffer,
        n_tokens: usize,
        n_heads: usize,
        head_dim: usize,
        rope: &Rope,
    ) {
        let n_dims = rope.n_dims.min(head_dim);
        let pairs = n_tokens * n_heads * (n_dims / 2);
        rec.dispatch(
            &ROPE,
            "rope",
            &[],
            &[x, cos_sin],
            Params::new(
                [
                    n_tokens as u32,
                    n_heads as u32,
                    head_dim as u32,
                    n_dims as u32,
                ],
                [u32::from(rope.style == RopeStyle::Neox), 0, 0, 0],
                [0.0; 4],
            ),
            [pairs.div_ceil(64) as u32, 1, 1],
            "rope",
            (pairs * 16) as u64,
            (pairs * 8) as u64,
            0,
        );
    }

    fn record_elementwise(
        &self,
        rec: &mut Recorder<'_>,
        entry: &'static str,
        bindings: &[&wgpu::Buffer],
        len: usize,
        period: usize,
    ) {
        let inputs = bindings.len() as u64;
        rec.dispatch(
            &ELEMENTWISE,
            entry,
            &[],
            bindings,
            Params::new([len as u32, period as u32, 0, 0], [0; 4], [0.0; 4]),
            [len.div_ceil(64) as u32, 1, 1],
            entry,
            len as u64 * 4 * inputs,
            len as u64 * 4,
            0,
        );
    }

    #[allow(clippy::too_many_arguments)]
    fn record_attention(
        &self,
        rec: &mut Recorder<'_>,
        q: &wgpu::Buffer,
        keys: &wgpu::Buffer,
        values: &wgpu::Buffer,
        kpos: &wgpu::Buffer,
        qpos: &wgpu::Buffer,
        n_tokens: usize,
        n_cached: usize,
        shape: &AttentionShape,
        out: &wgpu::Buffer,
    ) -> Result<()> {
        let stride = n_cached.max(1);
        let scores = rec.scratch(
            "attention scores",
            0,
            (n_tokens * shape.n_heads * stride * 4) as u64,
        )?;
        let kv_read = (n_tokens * shape.n_heads * n_cached * shape.head_dim * 2 * 4) as u64;
        rec.dispatch(
            &ATTENTION,
            "attention",
            &[],
            &[q, keys, values, kpos, qpos, &scores, out],
            Params::new(
                [
                    n_tokens as u32,
                    shape.n_heads as u32,
                    shape.n_kv_heads as u32,
                    shape.head_dim as u32,
                ],
                [n_cached as u32, stride as u32, 0, 0],
                [1.0 / (shape.head_dim as f32).sqrt(), 0.0, 0.0, 0.0],
            ),
            [shape.n_heads as u32, n_tokens as u32, 1],
            "attention",
            (n_tokens * shape.n_heads * shape.head_dim * 4) as u64,
            (n_tokens * shape.n_heads * shape.head_dim * 4) as u64,
            0,
        );
        rec.add_kv_read(kv_read);
        Ok(())
    }

    fn timed<T>(&self, kind: OpKind, f: impl FnOnce() -> Result<T>) -> Result<T> {
        let start = Instant::now();
        let r = f();
        self.times.add(kind, start.elapsed());
        r
    }

    fn read_f32(&self, rec: Recorder<'_>, src: &wgpu::Buffer, len: usize) -> Result<Vec<f32>> {
        let bytes = rec.finish(&[(src, 0, (len * 4) as u64)])?.0;
        Ok(bytemuck::pod_collect_to_vec(&bytes))
    }

    /// Runs one op on host data: `f` records it, `out` receives `len` floats.
    fn host_op(
        &self,
        kind: OpKind,
        out: &mut [f32],
        f: impl FnOnce(&mut Recorder<'_>) -> Result<GpuBuffer>,
    ) -> Result<()> {
        self.timed(kind, || {
            let mut rec = self.recorder();
            let dst = f(&mut rec)?;
            let got = self.read_f32(rec, dst.raw(), out.len())?;
            out.copy_from_slice(&got);
            Ok(())
        })
    }
}

/// The cos/sin factors of each (token, pair), by the CPU backend's f32 recurrence
/// (`theta` starts at the position and is multiplied by `freq_base^(-2/n_dims)`).
fn rope_table(positions: &[u32], head_dim: usize, rope: &Rope) -> Vec<f32> {
    let n_dims = rope.n_dims.min(head_dim);
    let theta_scale = rope.freq_base.powf(-2.0 / n_dims as f32);
    let mut out = Vec::with_capacity(positions.len() * n_dims);
    for &pos in positions {
        let mut theta = pos as f32;
        for _ in 0..n_dims / 2 {
            out.push(theta.cos());
            out.push(theta.sin());
            theta *= theta_scale;
        }
    }
    out
}

/// Cached keys, values and positions of `kv` as flat host f32 arrays.
fn flatten_view(kv: &KvView<'_>) -> (Vec<f32>, Vec<f32>, Vec<u32>) {
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

impl Backend for WgpuBackend {
    fn name(&self) -> String {
        format!("wgpu ({})", self.ctx.adapter())
    }

    fn n_threads(&self) -> usize {
        1
    }

    fn op_times(&self) -> &OpTimes {
        &self.times
    }

    fn matmul(&self, x: &[f32], n_tokens: usize, jobs: &mut [MatmulJob<'_>]) -> Result<()> {
        let Some(first) = jobs.first() else {
            return Ok(());
        };
        let k = first.weight.cols();
        if x.len() != n_tokens * k {
            return Err(Error::ShapeMismatch {
                what: format!("input of {}", first.weight.name),
                expected: n_tokens * k,
                got: x.len(),
            });
        }
        for job in jobs.iter() {
            if job.weight.cols() != k || job.out.len() != n_tokens * job.weight.rows() {
                return Err(Error::ShapeMismatch {
                    what: format!("matmul with {}", job.weight.name),
                    expected: n_tokens * job.weight.rows(),
                    got: job.out.len(),
                });
            }
        }
        self.timed(OpKind::Matmul, || {
            let weights: Vec<Arc<DeviceWeight>> = jobs
                .iter()
                .map(|j| self.weight(j.weight))
                .collect::<Result<_>>()?;
            let xb = self.upload(bytemuck::cast_slice(x), "matmul input")?;
            let outs: Vec<GpuBuffer> = jobs
                .iter()
                .map(|j| self.scratch(j.out.len() * 4, "matmul output"))
                .collect::<Result<_>>()?;
            let mut rec = self.recorder();
            let pairs: Vec<(&DeviceWeight, &wgpu::Buffer)> = weights
                .iter()
                .zip(&outs)
                .map(|(w, o)| (w.as_ref(), o.raw()))
                .collect();
            self.record_matmul(&mut rec, xb.raw(), n_tokens, k, &pairs)?;
            let sources: Vec<(&wgpu::Buffer, u64, u64)> = outs
                .iter()
                .zip(jobs.iter())
                .map(|(o, j)| (o.raw(), 0, (j.out.len() * 4) as u64))
                .collect();
            let bytes = rec.finish(&sources)?.0;
            let mut at = 0;
            for job in jobs.iter_mut() {
                let len = job.out.len() * 4;
                job.out
                    .copy_from_slice(&bytemuck::pod_collect_to_vec::<u8, f32>(
                        &bytes[at..at + len],
                    ));
                at += len;
            }
            Ok(())
        })
    }

    fn embed(&self, table: &Weight, ids: &[u32], out: &mut [f32]) -> Result<()> {
        if let Some(&id) = ids.iter().find(|&&id| id as usize >= table.rows()) {
            return Err(Error::TokenId {
                id,
                vocab: table.rows(),
            });
        }
        if out.len() != ids.len() * table.cols() {
            return Err(Error::ShapeMismatch {
                what: format!("embedding rows of {}", table.name),
                expected: ids.len() * table.cols(),
                got: out.len(),
            });
        }
        self.timed(OpKind::Other, || {
            let t = self.weight(table)?;
            let idb = self.upload(bytemuck::cast_slice(ids), "token ids")?;
            let dst = self.scratch(out.len() * 4, "embeddings")?;
            let mut rec = self.recorder();
            self.record_embed(&mut rec, &t, idb.raw(), ids.len(), dst.raw());
            let got = self.read_f32(rec, dst.raw(), out.len())?;
            out.copy_from_slice(&got);
            Ok(())
        })
    }

    fn rms_norm(&self, x: &[f32], scale: &[f32], eps: f32, out: &mut [f32]) -> Result<()> {
        check_rows("RMSNorm input", x.len(), scale.len())?;
        check_len("RMSNorm output", x.len(), out.len())?;
        let n = scale.len();
        let rows = x.len() / n.max(1);
        self.host_op(OpKind::Other, out, |rec| {
            let xb = self.upload(bytemuck::cast_slice(x), "norm input")?;
            let sb = self.upload(bytemuck::cast_slice(scale), "norm scale")?;
            let dst = self.scratch(rows * n * 4, "norm output")?;
            self.record_rms_norm(rec, xb.raw(), 0, rows, sb.raw(), n, eps, dst.raw());
            rec.keep(xb);
            rec.keep(sb);
            Ok(dst)
        })
    }

    fn rope(
        &self,
        x: &mut [f32],
        positions: &[u32],
        n_heads: usize,
        head_dim: usize,
        rope: &Rope,
    ) -> Result<()> {
        check_len("RoPE input", positions.len() * n_heads * head_dim, x.len())?;
        let input = x.to_vec();
        self.host_op(OpKind::Other, x, |rec| {
            let xb = self.upload(bytemuck::cast_slice(&input), "rope input")?;
            let table = rope_table(positions, head_dim, rope);
            let cs = self.upload(bytemuck::cast_slice(&table), "rope table")?;
            self.record_rope(
                rec,
                xb.raw(),
                cs.raw(),
                positions.len(),
                n_heads,
                head_dim,
                rope,
            );
            rec.keep(cs);
            Ok(xb)
        })
    }

    fn attention(
        &self,
        q: &[f32],
        q_positions: &[u32],
        kv: &KvView<'_>,
        shape: &AttentionShape,
        out: &mut [f32],
    ) -> Result<()> {
        let width = shape.n_heads * shape.head_dim;
        check_len("attention queries", q_positions.len() * width, q.len())?;
        check_len("attention output", q.len(), out.len())?;
        let (k, v, p) = flatten_view(kv);
        self.host_op(OpKind::Attention, out, |rec| {
            let qb = self.upload(bytemuck::cast_slice(q), "queries")?;
            let kb = self.upload(bytemuck::cast_slice(&k), "keys")?;
            let vb = self.upload(bytemuck::cast_slice(&v), "values")?;
            let kp = self.upload(bytemuck::cast_slice(&p), "key positions")?;
            let qp = self.upload(bytemuck::cast_slice(q_positions), "query positions")?;
            let dst = self.scratch(q.len() * 4, "attention output")?;
            self.record_attention(
                rec,
                qb.raw(),
                kb.raw(),
                vb.raw(),
                kp.raw(),
                qp.raw(),
                q_positions.len(),
                p.len(),
                shape,
                dst.raw(),
            )?;
            for b in [qb, kb, vb, kp, qp] {
                rec.keep(b);
            }
            Ok(dst)
        })
    }

    fn swiglu(&self, gate: &[f32], up: &[f32], out: &mut [f32]) -> Result<()> {
        check_len("SwiGLU up", gate.len(), up.len())?;
        check_len("SwiGLU output", gate.len(), out.len())?;
        self.host_op(OpKind::Other, out, |rec| {
            let g = self.upload(bytemuck::cast_slice(gate), "gate")?;
            let u = self.upload(bytemuck::cast_slice(up), "up")?;
            let dst = self.scratch(gate.len() * 4, "swiglu output")?;
            self.record_elementwise(rec, "swiglu", &[dst.raw(), g.raw(), u.raw()], gate.len(), 1);
            rec.keep(g);
            rec.keep(u);
            Ok(dst)
        })
    }

    fn add_assign(&self, x: &mut [f32], y: &[f32]) -> Result<()> {
        check_len("addend", x.len(), y.len())?;
        let input = x.to_vec();
        self.host_op(OpKind::Other, x, |rec| {
            let xb = self.upload(bytemuck::cast_slice(&input), "sum")?;
            let yb = self.upload(bytemuck::cast_slice(y), "addend")?;
            self.record_elementwise(rec, "add", &[xb.raw(), yb.raw()], input.len(), 1);
            rec.keep(yb);
            Ok(xb)
        })
    }

    fn add_bias(&self, x: &mut [f32], bias: &[f32]) -> Result<()> {
        check_rows("biased rows", x.len(), bias.len())?;
        let input = x.to_vec();
        self.host_op(OpKind::Other, x, |rec| {
            let xb = self.upload(bytemuck::cast_slice(&input), "biased")?;
            let bb = self.upload(bytemuck::cast_slice(bias), "bias")?;
            self.record_elementwise(
                rec,
                "add_bias",
                &[xb.raw(), bb.raw()],
                input.len(),
                bias.len(),
            );
            rec.keep(bb);
            Ok(xb)
        })
    }

    fn device_forward(&self) -> Option<&dyn DeviceForward> {
        Some(self)
    }

    fn set_profiling(&self, on: bool) {
        self.profile.store(on, std::sync::atomic::Ordering::Relaxed);
    }

    fn last_pass(&self) -> Option<PassReport> {
        Some(
            self.report
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .clone(),
        )
    }

    fn device_bytes(&self) -> Option<(u64, u64)> {
        Some((self.ctx.memory().current(), self.ctx.memory().peak()))
    }

    fn set_stream_slots(&self, n: usize) {
        WgpuBackend::set_stream_slots(self, n);
    }
}

impl WgpuBackend {
    /// Brings the device mirror of `kv` up to date (same capacity and shape, and the
    /// same tokens, re-uploading what differs from the host cache), making one if `kv`
    /// has none; returns its index in `mirrors`.
    fn sync_kv(
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
