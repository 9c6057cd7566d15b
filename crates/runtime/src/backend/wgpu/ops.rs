//! The encoders: each records one op's dispatches (with the bytes it moves) into a
//! [`Recorder`]. The device pass and the host-slice ops both use them.

use super::*;

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
        for _ in 0..n_dims / 2 {
            out.push(theta.cos());
            out.push(theta.sin());
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
    pub(super) fn record_attention(
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
}
