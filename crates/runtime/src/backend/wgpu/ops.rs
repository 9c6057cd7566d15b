//! The encoders: each records one op's dispatches (with the bytes it moves) into a
//! [`Recorder`]. The device pass and the host-slice ops both use them. Also the device
//! layout of cached keys and values in their stored type ([`DeviceKvLayout`]), which the
//! attention and KV-write kernels share.

use super::*;
use crate::kv::{KvElement, Q8_BLOCK};

/// The expert indirection of a product over stacked experts' matrices
/// ([`WgpuBackend::record_matmul_with`]).
pub(super) struct ExpertRows<'a> {
    /// One expert id (u32) per output row.
    pub(super) ids: &'a wgpu::Buffer,
    /// Experts in the stack: each one's matrix is `rows / n_expert` rows of it.
    pub(super) n_expert: usize,
    /// Output rows: (token, choice) pairs.
    pub(super) n_out: usize,
    /// Output rows per activation row: the choices per token when every choice reads
    /// the token's row, 1 when each choice has its own row.
    pub(super) per_input: usize,
}

/// Tokens whose products one workgroup of `matmul_rows` computes, reading each weight
/// row once for all of them (`TILE` in matmul.wgsl and matmul_f.wgsl).
const MATMUL_TILE: usize = 8;

/// Keys per workgroup of split attention (attention.wgsl's `WG`).
const ATTENTION_SPLIT_KEYS: usize = 256;

/// Split attention runs when the (query head, token) pairs are fewer than this: a
/// decoded token's 32 heads as 32 workgroups, each over every key, left most of an H200
/// idle (0.5 ms per layer at 1,500 keys).
const ATTENTION_SPLIT_BELOW: usize = 256;

/// Floats of activation scales per block for an activation type.
pub(super) fn scales_per_block(act: GgmlType) -> usize {
    match act {
        GgmlType::Q8_1 => 2,
        GgmlType::Q8_K => 17,
        _ => 1,
    }
}

/// The cos/sin factors of each (token, pair), by the CPU backend's f32 recurrence
/// (`theta` starts at the position and is multiplied by `freq_base^(-2/n_dims)`).
pub(super) fn rope_table(positions: &[u32], head_dim: usize, rope: &Rope) -> Vec<f32> {
    let n_dims = rope.n_dims.min(head_dim);
    let theta_scale = rope.freq_base.powf(-2.0 / n_dims as f32);
    let mut out = Vec::with_capacity(positions.len() * n_dims);
    for &pos in positions {
        let mut theta = pos as f32;
        for pair in 0..n_dims / 2 {
            let scaled = rope.angle(pair, theta);
            out.push(scaled.cos());
            out.push(scaled.sin());
            theta *= theta_scale;
        }
    }
    out
}

impl WgpuBackend {
    /// Records quantization of `x` (`n` rows of `k`) for each activation type `jobs`
    /// need, then one matrix product per job into its output buffer.
    pub(super) fn record_matmul(
        &self,
        rec: &mut Recorder<'_>,
        x: &wgpu::Buffer,
        n: usize,
        k: usize,
        jobs: &[(&DeviceWeight, &wgpu::Buffer)],
    ) -> Result<()> {
        self.record_matmul_with(rec, x, n, k, jobs, None)
    }

    /// [`Self::record_matmul`], or with `experts` the product of each job's stack of
    /// experts' matrices by the expert each output row names (ggml's `mul_mat_id`):
    /// output row `i` is expert `ids[i]`'s rows times activation row
    /// `i / experts.per_input`, `w.rows / experts.n_expert` values wide.
    pub(super) fn record_matmul_with(
        &self,
        rec: &mut Recorder<'_>,
        x: &wgpu::Buffer,
        n: usize,
        k: usize,
        jobs: &[(&DeviceWeight, &wgpu::Buffer)],
        experts: Option<&ExpertRows<'_>>,
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
                let (aq, asc) = self.record_quantize(rec, x, n, k, at)?;
                acts.push((at, aq, asc));
            }
            let rows_total = w.rows as u32;
            for chunk in &w.chunks {
                // Without experts: all the chunk's rows for each of the n tokens. With
                // them: each output row's expert rows, for the rows in this chunk.
                let (params, groups, wbytes, written) = match experts {
                    None => (
                        Params::new(
                            [chunk.rows as u32, k as u32, n as u32, rows_total],
                            [chunk.first_row as u32, w.row_bytes as u32, 0, 0],
                            [0.0; 4],
                        ),
                        [
                            chunk.rows.div_ceil(MATMUL_ROWS) as u32,
                            1,
                            n.div_ceil(MATMUL_TILE) as u32,
                        ],
                        (chunk.rows * w.row_bytes * n.div_ceil(MATMUL_TILE)) as u64,
                        (chunk.rows * n * 4) as u64,
                    ),
                    Some(e) => {
                        let per_expert = w.rows / e.n_expert.max(1);
                        // This chunk's share of the chosen rows (all of them when whole).
                        let share = |bytes: usize| (bytes * chunk.rows / w.rows.max(1)) as u64;
                        (
                            Params::new(
                                [
                                    chunk.rows as u32,
                                    k as u32,
                                    e.n_out as u32,
                                    per_expert as u32,
                                ],
                                [
                                    chunk.first_row as u32,
                                    w.row_bytes as u32,
                                    e.per_input as u32,
                                    0,
                                ],
                                [0.0; 4],
                            ),
                            [per_expert.div_ceil(MATMUL_ROWS) as u32, 1, e.n_out as u32],
                            share(e.n_out * per_expert * w.row_bytes),
                            share(e.n_out * per_expert * 4),
                        )
                    }
                };
                // Both shaders share their entry points (matmul_rows.wgsl).
                let entry = match experts {
                    Some(_) => "matmul_rows_id",
                    None => "matmul_rows",
                };
                let ids = experts.map(|e| e.ids);
                if float {
                    let mut bindings = vec![chunk.buffer.raw(), x, out];
                    bindings.extend(ids);
                    rec.dispatch(
                        &MATMUL_F,
                        entry,
                        &[("WTYPE", w.ty.id() as f64)],
                        &bindings,
                        params,
                        groups,
                        "matmul",
                        (n * k * 4) as u64,
                        written,
                        wbytes,
                    );
                } else {
                    let (_, aq, asc) = acts.iter().find(|a| a.0 == at).expect("quantized above");
                    let mut bindings = vec![chunk.buffer.raw(), aq, asc, out];
                    bindings.extend(ids);
                    rec.dispatch(
                        &MATMUL,
                        entry,
                        &[("WTYPE", w.ty.id() as f64)],
                        &bindings,
                        params,
                        groups,
                        "matmul",
                        (n * k) as u64,
                        written,
                        wbytes,
                    );
                }
            }
        }
        Ok(())
    }

    /// Records the quantization of `x` (`n` rows of `k`) to activation type `at` (Q8_0,
    /// Q8_1 or Q8_K) as the CPU backend quantizes it: the quantized values and their
    /// scales, in scratch buffers shared by the pass's products of that type.
    pub(super) fn record_quantize(
        &self,
        rec: &mut Recorder<'_>,
        x: &wgpu::Buffer,
        n: usize,
        k: usize,
        at: GgmlType,
    ) -> Result<(wgpu::Buffer, wgpu::Buffer)> {
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
        // Four 8-bit values to a word (quantize.wgsl).
        let aq = rec.scratch("quantized activations", tag, (n * k) as u64)?;
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
            // A Q8_K block is one workgroup; eight 32-value blocks share one.
            [if bl == 256 { nb } else { nb.div_ceil(8) } as u32, 1, 1],
            "quantize",
            (n * k * 4) as u64,
            (n * k + nb * scales_per_block(at) * 4) as u64,
            0,
        );
        Ok((aq, asc))
    }

    pub(super) fn record_embed(
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
    pub(super) fn record_rms_norm(
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
    pub(super) fn record_rope(
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

    pub(super) fn record_elementwise(
        &self,
        rec: &mut Recorder<'_>,
        entry: &'static str,
        bindings: &[&wgpu::Buffer],
        len: usize,
        period: usize,
    ) {
        self.record_elementwise_by(rec, entry, bindings, len, period, 0.0)
    }

    /// [`Self::record_elementwise`] with the factor an entry reads (`scale`).
    pub(super) fn record_elementwise_by(
        &self,
        rec: &mut Recorder<'_>,
        entry: &'static str,
        bindings: &[&wgpu::Buffer],
        len: usize,
        period: usize,
        factor: f32,
    ) {
        let inputs = bindings.len() as u64;
        rec.dispatch(
            &ELEMENTWISE,
            entry,
            &[],
            bindings,
            Params::new(
                [len as u32, period as u32, 0, 0],
                [0; 4],
                [factor, 0.0, 0.0, 0.0],
            ),
            [len.div_ceil(64) as u32, 1, 1],
            entry,
            len as u64 * 4 * inputs,
            len as u64 * 4,
            0,
        );
    }

    /// Records attention of `n_tokens` queries over `n_cached` rows of keys and values
    /// read in their stored type (the kernel dequantizes as it reads), counting the
    /// stored bytes as KV bytes read.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn record_attention_stored(
        &self,
        rec: &mut Recorder<'_>,
        q: &wgpu::Buffer,
        keys: KvBinding<'_>,
        values: KvBinding<'_>,
        kpos: &wgpu::Buffer,
        qpos: &wgpu::Buffer,
        rows: std::ops::Range<usize>,
        n_cached: usize,
        shape: &AttentionShape,
        out: &wgpu::Buffer,
    ) -> Result<()> {
        let (first_row, n_tokens) = (rows.start, rows.len());
        // The kernel reads the window as the bits of a u32 (u32::MAX: none).
        let window = shape
            .window
            .map_or(u32::MAX, |w| u32::try_from(w).unwrap_or(u32::MAX));
        // A power of two, so the buffer's size (and the bind group with it) changes only
        // as often as the cache doubles.
        let stride = n_cached.max(1).next_power_of_two();
        let scores = rec.scratch(
            "attention scores",
            0,
            (n_tokens * shape.n_heads * stride * 4) as u64,
        )?;
        // Every (query head, token) reads its KV head's rows.
        let elems = n_tokens * shape.n_heads * n_cached * shape.head_dim;
        let kv_read = keys.elem.read_bytes(elems) + values.elem.read_bytes(elems);
        let splits = n_cached.div_ceil(ATTENTION_SPLIT_KEYS);
        if splits > 1 && n_tokens * shape.n_heads < ATTENTION_SPLIT_BELOW {
            let parts = rec.scratch(
                "attention partials",
                0,
                (n_tokens * shape.n_heads * splits.next_power_of_two() * (shape.head_dim + 2) * 4)
                    as u64,
            )?;
            let params = |a: [u32; 4]| {
                Params::new(
                    a,
                    [
                        n_cached as u32,
                        0,
                        keys.scale_word as u32,
                        values.scale_word as u32,
                    ],
                    [shape.scale, f32::from_bits(window), 0.0, 0.0],
                )
                .with_c([first_row as u32, 0, splits as u32, 0])
            };
            let (heads, tokens) = (shape.n_heads as u32, n_tokens as u32);
            let (q_bytes, part_bytes) = (
                (n_tokens * shape.n_heads * shape.head_dim * 4) as u64,
                (n_tokens * shape.n_heads * splits * (shape.head_dim + 2) * 4) as u64,
            );
            rec.dispatch(
                &ATTENTION,
                "attention_split",
                &[
                    ("KTYPE", keys.elem.kernel_type()),
                    ("VTYPE", values.elem.kernel_type()),
                ],
                &[q, keys.buffer, values.buffer, kpos, qpos, &parts],
                params([
                    tokens,
                    heads,
                    shape.n_kv_heads as u32,
                    shape.head_dim as u32,
                ]),
                [heads, tokens, splits as u32],
                "attention",
                q_bytes,
                part_bytes,
                0,
            );
            rec.dispatch(
                &ATTENTION_COMBINE,
                "attention_combine",
                &[],
                &[&parts, out],
                params([tokens, heads, splits as u32, shape.head_dim as u32]),
                [heads, tokens, 1],
                "attention",
                part_bytes,
                q_bytes,
                0,
            );
            rec.add_kv_read(kv_read);
            return Ok(());
        }
        rec.dispatch(
            &ATTENTION,
            "attention",
            &[
                ("KTYPE", keys.elem.kernel_type()),
                ("VTYPE", values.elem.kernel_type()),
            ],
            &[q, keys.buffer, values.buffer, kpos, qpos, &scores, out],
            Params::new(
                [
                    n_tokens as u32,
                    shape.n_heads as u32,
                    shape.n_kv_heads as u32,
                    shape.head_dim as u32,
                ],
                [
                    n_cached as u32,
                    stride as u32,
                    keys.scale_word as u32,
                    values.scale_word as u32,
                ],
                [shape.scale, f32::from_bits(window), 0.0, 0.0],
            )
            .with_c([first_row as u32, 0, 0, 0]),
            [shape.n_heads as u32, n_tokens as u32, 1],
            "attention",
            (n_tokens * shape.n_heads * shape.head_dim * 4) as u64,
            (n_tokens * shape.n_heads * shape.head_dim * 4) as u64,
            0,
        );
        rec.add_kv_read(kv_read);
        Ok(())
    }

    /// Test hook for the KV-write kernel (`tests/kv_write.rs`): uploads `cache` (whole
    /// rows of `dim`, in their stored type), writes the f32 `rows` at the distinct
    /// `slots` with [`record_kv_write`], and returns the buffer's bytes in
    /// the device layout: elements little-endian, and for q8 the quants, then from the
    /// next 4-byte boundary the scales.
    #[doc(hidden)]
    pub fn write_kv_rows_for_test(
        &self,
        cache: KvRows<'_>,
        dim: usize,
        rows: &[f32],
        slots: &[u32],
    ) -> Result<Vec<u8>> {
        check_len("KV rows to write", slots.len() * dim, rows.len())?;
        let capacity = cache.len() / dim.max(1);
        check_len("KV cache rows", capacity * dim, cache.len())?;
        if let Some(&s) = slots.iter().find(|&&s| s as usize >= capacity) {
            return Err(Error::InvalidArgument {
                what: format!("KV slot {s} is past the capacity, {capacity} rows"),
            });
        }
        let packed = PackedRows::new("rows", &[cache])?;
        let buf = self.upload(&packed.bytes, "kv rows")?;
        let src = self.upload(bytemuck::cast_slice(rows), "kv rows to write")?;
        let sb = self.upload(bytemuck::cast_slice(slots), "kv slots")?;
        let mut rec = self.recorder();
        record_kv_write(
            &mut rec,
            packed.elem,
            src.raw(),
            0,
            slots.len(),
            dim,
            sb.raw(),
            buf.raw(),
            capacity,
        )?;
        let bytes = rec.finish(&[(buf.raw(), 0, packed.bytes.len() as u64)])?.0;
        Ok(bytes)
    }
}

/// Records the conversion of `n` f32 rows of `dim` values (rows `first_row..` of `src`) into
/// `elem` and their write at row slots `slots[..n]` (u32; distinct) of `dst`, a
/// buffer of `capacity` rows in `elem`'s layout ([`DeviceKvLayout::buffer_bytes`]). Rounds
/// exactly as the host cache does, so the device rows equal the host's bit for bit.
/// Slots at or past `capacity` are skipped. q8 rows must be a multiple of
/// [`Q8_BLOCK`] long (as the cache requires), so each row's quants start on a word.
#[allow(clippy::too_many_arguments)]
pub(super) fn record_kv_write(
    rec: &mut Recorder<'_>,
    elem: KvElement,
    src: &wgpu::Buffer,
    first_row: usize,
    n: usize,
    dim: usize,
    slots: &wgpu::Buffer,
    dst: &wgpu::Buffer,
    capacity: usize,
) -> Result<()> {
    if elem == KvElement::Q8 && dim % Q8_BLOCK != 0 {
        return Err(Error::InvalidArgument {
            what: format!("q8 KV rows must be a multiple of {Q8_BLOCK} long, these are {dim}"),
        });
    }
    let (entry, invocations) = match elem {
        KvElement::F32 => ("kv_write_f32", n * dim),
        KvElement::F16 => ("kv_write_f16", n * (dim / 2 + 1)),
        KvElement::Q8 => ("kv_write_q8", n * dim / Q8_BLOCK),
    };
    rec.dispatch(
        &KV_WRITE,
        entry,
        &[],
        &[src, slots, dst],
        Params::new(
            [
                n as u32,
                dim as u32,
                elem.scale_word(capacity * dim) as u32,
                capacity as u32,
            ],
            [first_row as u32, 0, 0, 0],
            [0.0; 4],
        ),
        [invocations.div_ceil(64) as u32, 1, 1],
        "kv_write",
        (n * (dim + 1) * 4) as u64,
        elem.read_bytes(n * dim),
        0,
    );
    Ok(())
}

/// The device layout of cached keys and values of each [`KvElement`] (what
/// attention.wgsl reads and kv_write.wgsl writes), for a buffer of `n` elements: f32,
/// one per word; f16, two per word, the lower half first; q8, four int8 per word,
/// lowest byte first, then from word [`DeviceKvLayout::scale_word`] one f16 scale per
/// [`Q8_BLOCK`] elements, two per word ([`KvRows::Q8`] with the scales after the
/// quants). Each part is padded to a whole word.
pub(super) trait DeviceKvLayout {
    /// The kernels' override constant (KTYPE, VTYPE).
    fn kernel_type(self) -> f64;
    /// First word of the q8 scales in a buffer of `elems` elements (0 for the others).
    fn scale_word(self, elems: usize) -> usize;
    /// Bytes of a buffer of `elems` elements.
    fn buffer_bytes(self, elems: usize) -> usize;
    /// Bytes `elems` elements take as stored: 4, 2, or 34 per 32 (1.0625 each).
    fn read_bytes(self, elems: usize) -> u64;
}

impl DeviceKvLayout for KvElement {
    fn kernel_type(self) -> f64 {
        match self {
            KvElement::F32 => 0.0,
            KvElement::F16 => 1.0,
            KvElement::Q8 => 2.0,
        }
    }

    fn scale_word(self, elems: usize) -> usize {
        match self {
            KvElement::Q8 => elems.div_ceil(4),
            _ => 0,
        }
    }

    fn buffer_bytes(self, elems: usize) -> usize {
        match self {
            KvElement::F32 => 4 * elems,
            KvElement::F16 => 4 * elems.div_ceil(2),
            KvElement::Q8 => 4 * (self.scale_word(elems) + elems.div_ceil(Q8_BLOCK).div_ceil(2)),
        }
    }

    fn read_bytes(self, elems: usize) -> u64 {
        self.row_bytes(elems) as u64
    }
}

/// The element type `rows` are stored in.
pub(super) fn element_of(rows: &KvRows<'_>) -> KvElement {
    match rows {
        KvRows::F32(_) => KvElement::F32,
        KvRows::F16(_) => KvElement::F16,
        KvRows::Q8 { .. } => KvElement::Q8,
    }
}

/// A keys or values buffer as the attention kernel reads it.
#[derive(Clone, Copy)]
pub(super) struct KvBinding<'a> {
    pub(super) buffer: &'a wgpu::Buffer,
    pub(super) elem: KvElement,
    /// First word of the q8 scales ([`DeviceKvLayout::scale_word`] of the buffer's elements).
    pub(super) scale_word: usize,
}

/// Cached rows of several segments, concatenated as stored (no conversion) in the
/// device layout of [`KvElement`], for upload.
pub(super) struct PackedRows {
    pub(super) elem: KvElement,
    pub(super) elems: usize,
    pub(super) bytes: Vec<u8>,
}

impl PackedRows {
    /// Packs `parts` (the keys, or the values, of a view's segments: `what` says which,
    /// for errors). Parts of different types are an error naming the segment, and so
    /// are q8 parts that cannot be concatenated: scales not one per block, or a part
    /// other than the last ending inside a block (the next part's blocks would shift).
    pub(super) fn new(what: &str, parts: &[KvRows<'_>]) -> Result<PackedRows> {
        let elem = parts.first().map_or(KvElement::F32, element_of);
        let elems: usize = parts.iter().map(KvRows::len).sum();
        let mut bytes = Vec::with_capacity(elem.buffer_bytes(elems));
        for (i, rows) in parts.iter().enumerate() {
            let other = element_of(rows);
            if other != elem {
                return Err(Error::InvalidArgument {
                    what: format!(
                        "the KV view mixes element types: {what} of segment {i} are {}, of \
                         segment 0 {}",
                        other.name(),
                        elem.name()
                    ),
                });
            }
            match rows {
                KvRows::F32(v) => bytes.extend_from_slice(bytemuck::cast_slice(v)),
                KvRows::F16(v) => bytes.extend_from_slice(bytemuck::cast_slice(v)),
                KvRows::Q8 { quants, scales } => {
                    check_len(
                        &format!("scales of the q8 {what} of KV segment {i}"),
                        quants.len().div_ceil(Q8_BLOCK),
                        scales.len(),
                    )?;
                    if i + 1 < parts.len() && quants.len() % Q8_BLOCK != 0 {
                        return Err(Error::InvalidArgument {
                            what: format!(
                                "the q8 {what} of KV segment {i} end inside a block ({} \
                                 elements): only the last segment may",
                                quants.len()
                            ),
                        });
                    }
                    bytes.extend_from_slice(bytemuck::cast_slice(quants));
                }
            }
        }
        if elem == KvElement::Q8 {
            bytes.resize(elem.scale_word(elems) * 4, 0);
            for rows in parts {
                if let KvRows::Q8 { scales, .. } = rows {
                    bytes.extend_from_slice(bytemuck::cast_slice(scales));
                }
            }
        }
        bytes.resize(elem.buffer_bytes(elems), 0);
        Ok(PackedRows { elem, elems, bytes })
    }

    /// These rows, uploaded to `buffer`, as the attention kernel binds them.
    pub(super) fn binding<'a>(&self, buffer: &'a wgpu::Buffer) -> KvBinding<'a> {
        KvBinding {
            buffer,
            elem: self.elem,
            scale_word: self.elem.scale_word(self.elems),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::KvSegment;
    use half::f16;

    /// A two-segment view of `rows` rows of `dim` in `elem`, positions 0.., and its
    /// element count per side.
    fn with_view<R>(
        elem: KvElement,
        rows: usize,
        dim: usize,
        f: impl FnOnce(&KvView<'_>) -> R,
    ) -> R {
        let n = rows * dim;
        let full: Vec<f32> = (0..n).map(|i| i as f32 * 0.01).collect();
        let halves: Vec<f16> = full.iter().map(|&v| f16::from_f32(v)).collect();
        let quants: Vec<i8> = (0..n).map(|i| (i % 100) as i8).collect();
        let scales = vec![f16::from_f32(0.01); n.div_ceil(Q8_BLOCK)];
        let positions: Vec<u32> = (0..rows as u32).collect();
        let cut = rows / 2;
        let part = |r: std::ops::Range<usize>| match elem {
            KvElement::F32 => KvRows::F32(&full[r]),
            KvElement::F16 => KvRows::F16(&halves[r]),
            KvElement::Q8 => KvRows::Q8 {
                scales: &scales[r.start / Q8_BLOCK..r.end / Q8_BLOCK],
                quants: &quants[r],
            },
        };
        let seg = |r: std::ops::Range<usize>| KvSegment {
            keys: part(r.start * dim..r.end * dim),
            values: part(r.start * dim..r.end * dim),
            positions: &positions[r],
        };
        f(&KvView {
            segments: vec![seg(0..cut), seg(cut..rows)],
        })
    }

    /// A view goes up as stored: 4, 2 and 1.0625 bytes per element for f32, f16 and
    /// q8, the q8 scales after all the quants.
    #[test]
    fn views_pack_as_stored() {
        let (rows, dim) = (6, 64);
        for (elem, per_16) in [
            (KvElement::F32, 64),
            (KvElement::F16, 32),
            (KvElement::Q8, 17),
        ] {
            with_view(elem, rows, dim, |view| {
                let keys: Vec<KvRows<'_>> = view.segments.iter().map(|s| s.keys).collect();
                let packed = PackedRows::new("keys", &keys).unwrap();
                assert_eq!(packed.elem, elem);
                assert_eq!(packed.bytes.len(), rows * dim * per_16 / 16, "{elem:?}");
                assert_eq!(
                    elem.read_bytes(rows * dim),
                    (rows * dim * per_16 / 16) as u64
                );
                if elem == KvElement::Q8 {
                    assert_eq!(
                        packed.bytes[..rows * dim],
                        (0..rows * dim).map(|i| (i % 100) as u8).collect::<Vec<_>>()
                    );
                    assert_eq!(
                        &packed.bytes[rows * dim..rows * dim + 2],
                        &f16::from_f32(0.01).to_le_bytes()
                    );
                }
            });
        }
    }

    /// The KV bytes a pass reports reading are the stored bytes of the rows each
    /// (query head, token) reads.
    #[test]
    fn attention_counts_the_stored_bytes_it_reads() {
        let Some(ctx) = crate::testing::gpu_for_tests() else {
            return;
        };
        let be = WgpuBackend::new(ctx);
        let shape = AttentionShape::new(4, 2, 32);
        let (rows, n_tokens) = (5, 2);
        for elem in [KvElement::F32, KvElement::F16, KvElement::Q8] {
            let report = with_view(elem, rows, shape.n_kv_heads * shape.head_dim, |view| {
                let part = |values: bool| -> Vec<KvRows<'_>> {
                    view.segments
                        .iter()
                        .map(|s| if values { s.values } else { s.keys })
                        .collect()
                };
                let keys = PackedRows::new("keys", &part(false)).unwrap();
                let values = PackedRows::new("values", &part(true)).unwrap();
                let q = vec![0.5f32; n_tokens * shape.n_heads * shape.head_dim];
                let upload = |b: &[u8]| be.upload(b, "test").unwrap();
                let (qb, kb, vb) = (
                    upload(bytemuck::cast_slice(&q)),
                    upload(&keys.bytes),
                    upload(&values.bytes),
                );
                let kp = upload(bytemuck::cast_slice(&[0u32, 1, 2, 3, 4]));
                let qp = upload(bytemuck::cast_slice(&[3u32, 4]));
                let out = be.scratch(q.len() * 4, "out").unwrap();
                let mut rec = be.recorder();
                be.record_attention_stored(
                    &mut rec,
                    qb.raw(),
                    keys.binding(kb.raw()),
                    values.binding(vb.raw()),
                    kp.raw(),
                    qp.raw(),
                    0..n_tokens,
                    rows,
                    &shape,
                    out.raw(),
                )
                .unwrap();
                rec.finish(&[(out.raw(), 0, 4)]).unwrap().1
            });
            let elems = (n_tokens * shape.n_heads * rows * shape.head_dim) as u64;
            let per_16 = match elem {
                KvElement::F32 => 64,
                KvElement::F16 => 32,
                KvElement::Q8 => 17,
            };
            assert_eq!(report.kv_bytes_read, 2 * elems * per_16 / 16, "{elem:?}");
        }
    }
}
