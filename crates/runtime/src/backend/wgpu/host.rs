//! The [`Backend`] ops on host slices, one submission and one read-back each: the
//! backend test suite holds every kernel to the CPU reference through them, and any
//! lever that calls the trait works on the GPU.

use super::*;
use ballast_core::neurons::NeuronOps;

impl WgpuBackend {
    pub(super) fn timed<T>(&self, kind: OpKind, f: impl FnOnce() -> Result<T>) -> Result<T> {
        let start = Instant::now();
        let r = f();
        self.times.add(kind, start.elapsed());
        r
    }

    pub(super) fn read_f32(
        &self,
        rec: Recorder<'_>,
        src: &wgpu::Buffer,
        len: usize,
    ) -> Result<Vec<f32>> {
        let bytes = rec.finish(&[(src, 0, (len * 4) as u64)])?.0;
        Ok(bytemuck::pod_collect_to_vec(&bytes))
    }

    /// Runs one op on host data: `f` records it, `out` receives `len` floats.
    pub(super) fn host_op(
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

impl Backend for WgpuBackend {
    fn name(&self) -> String {
        format!("wgpu ({})", self.ctx.adapter())
    }

    fn telemetry(&self) -> &dyn Telemetry {
        self
    }

    fn executor(&self) -> Option<&dyn DeviceExecutor> {
        Some(self)
    }

    fn residency(&self) -> Option<&dyn Residency> {
        Some(self)
    }

    fn neurons(&self) -> Option<&dyn NeuronOps> {
        Some(self)
    }
}

impl LinearOps for WgpuBackend {
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

    /// Only the asked rows are read and computed: the weight is taken as a stack of
    /// one-row "experts" and each (token, asked row) pair is one output of the
    /// mixture-of-experts product (`matmul_rows_id`), which runs each row's dot product
    /// exactly as the dense product does, so the values are the same bits.
    fn matmul_rows(
        &self,
        x: &[f32],
        n_tokens: usize,
        weight: &Weight,
        rows: &[std::ops::Range<usize>],
        out: &mut [f32],
    ) -> Result<()> {
        ballast_core::backend::check_row_ranges(weight, x.len(), rows, n_tokens, out.len())?;
        let k = weight.cols();
        let listed: Vec<u32> = rows
            .iter()
            .flat_map(|r| r.clone())
            .map(|r| r as u32)
            .collect();
        if listed.is_empty() || n_tokens == 0 {
            return Ok(());
        }
        self.timed(OpKind::Matmul, || {
            let w = self.weight(weight)?;
            let n_out = n_tokens * listed.len();
            let ids: Vec<u32> = (0..n_tokens).flat_map(|_| listed.iter().copied()).collect();
            let xb = self.upload(bytemuck::cast_slice(x), "matmul input")?;
            let idb = self.upload(bytemuck::cast_slice(&ids), "asked rows")?;
            let ob = self.scratch(n_out * 4, "asked rows output")?;
            let mut rec = self.recorder();
            let one_row_each = ExpertRows {
                ids: idb.raw(),
                n_expert: weight.rows(),
                n_out,
                per_input: listed.len(),
            };
            self.record_matmul_with(
                &mut rec,
                xb.raw(),
                n_tokens,
                k,
                &[(w.as_ref(), ob.raw())],
                Some(&one_row_each),
            )?;
            let bytes = rec.finish(&[(ob.raw(), 0, (n_out * 4) as u64)])?.0;
            let values: Vec<f32> = bytemuck::pod_collect_to_vec(&bytes[..n_out * 4]);
            let n_rows = weight.rows();
            for (t, got) in values.chunks_exact(listed.len()).enumerate() {
                for (&r, &v) in listed.iter().zip(got) {
                    out[t * n_rows + r as usize] = v;
                }
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
}

impl NormOps for WgpuBackend {
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
}

impl RopeOps for WgpuBackend {
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
}

impl AttentionOps for WgpuBackend {
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
        // Keys and values go up as stored (4, 2 or 1.0625 bytes per element) and the
        // kernel dequantizes them: no f32 copy of a cache is made.
        let row_len = shape.n_kv_heads * shape.head_dim;
        for (i, seg) in kv.segments.iter().enumerate() {
            for (what, rows) in [("keys", &seg.keys), ("values", &seg.values)] {
                check_len(
                    &format!("{what} of KV segment {i}"),
                    seg.positions.len() * row_len,
                    rows.len(),
                )?;
            }
        }
        let part = |values: bool| -> Vec<KvRows<'_>> {
            kv.segments
                .iter()
                .map(|s| if values { s.values } else { s.keys })
                .collect()
        };
        let keys = PackedRows::new("keys", &part(false))?;
        let values = PackedRows::new("values", &part(true))?;
        let p: Vec<u32> = kv
            .segments
            .iter()
            .flat_map(|s| s.positions.iter().copied())
            .collect();
        self.host_op(OpKind::Attention, out, |rec| {
            let qb = self.upload(bytemuck::cast_slice(q), "queries")?;
            let kb = self.upload(&keys.bytes, "keys")?;
            let vb = self.upload(&values.bytes, "values")?;
            let kp = self.upload(bytemuck::cast_slice(&p), "key positions")?;
            let qp = self.upload(bytemuck::cast_slice(q_positions), "query positions")?;
            let dst = self.scratch(q.len() * 4, "attention output")?;
            self.record_attention_stored(
                rec,
                qb.raw(),
                keys.binding(kb.raw()),
                values.binding(vb.raw()),
                kp.raw(),
                qp.raw(),
                0..q_positions.len(),
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
}

impl ElementwiseOps for WgpuBackend {
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

    fn geglu(&self, gate: &[f32], up: &[f32], out: &mut [f32]) -> Result<()> {
        check_len("GeGLU up", gate.len(), up.len())?;
        check_len("GeGLU output", gate.len(), out.len())?;
        self.host_op(OpKind::Other, out, |rec| {
            let g = self.upload(bytemuck::cast_slice(gate), "gate")?;
            let u = self.upload(bytemuck::cast_slice(up), "up")?;
            let dst = self.scratch(gate.len() * 4, "geglu output")?;
            self.record_elementwise(rec, "geglu", &[dst.raw(), g.raw(), u.raw()], gate.len(), 1);
            rec.keep(g);
            rec.keep(u);
            Ok(dst)
        })
    }

    fn scale(&self, x: &mut [f32], factor: f32) -> Result<()> {
        let input = x.to_vec();
        self.host_op(OpKind::Other, x, |rec| {
            let xb = self.upload(bytemuck::cast_slice(&input), "scaled")?;
            self.record_elementwise_by(rec, "scale", &[xb.raw()], input.len(), 1, factor);
            Ok(xb)
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
}

impl Telemetry for WgpuBackend {
    fn op_times(&self) -> &OpTimes {
        &self.times
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
}

impl Residency for WgpuBackend {
    fn bytes(&self) -> (u64, u64) {
        (self.ctx.memory().current(), self.ctx.memory().peak())
    }

    fn set_stream_slots(&self, n: usize) {
        WgpuBackend::set_stream_slots(self, n);
    }

    fn release_file(&self, file: u64) {
        self.release_weights_of(file);
    }
}
