//! Neuron slot stores on the device and the SwiGLU MLP over some of their records
//! ([`NeuronOps`]): what a sparse MLP with a neuron cache (Tricksy) keeps on the GPU.
//!
//! A store is `capacity` records of its [`NeuronLayout`] in device memory, each at a
//! stride of its bytes rounded up to 4 (queue writes and copies move whole words), split
//! into bindings of whole records where one would exceed the device's limit, as
//! `weights.rs` splits a weight by rows. It stays until freed or replaced. A write
//! uploads only the records it is given, one queue write per run of consecutive slots,
//! and counts those bytes as uploaded: a device pass adds what its host sync points
//! uploaded to its [`crate::backend::PassReport::bytes_uploaded`].
//!
//! [`NeuronOps::neuron_mlp`] is one submission: the input and the job (slots, gate
//! values, keep flags) go up, the input is quantized as the GPU matmul quantizes it for
//! the up rows' type, `neuron_hidden.wgsl` computes each (token, neuron) hidden value
//! with `matmul_rows`' dot product and the element-wise SwiGLU's arithmetic (the same
//! bits), `neuron_down.wgsl` sums `hidden · down` per output element over the neurons
//! in the order listed, and the output comes back.

use std::sync::atomic::Ordering;

use ballast_core::neurons::{check_slots, NeuronLayout, NeuronMlpJob, NeuronOps};

use super::weights::gpu_supports;
use super::*;

/// One binding of a store: `slots` records from slot `first`.
struct StoreChunk {
    buffer: GpuBuffer,
    first: usize,
    slots: usize,
}

/// A neuron store on the device.
pub(crate) struct NeuronStore {
    layout: NeuronLayout,
    capacity: usize,
    /// Bytes from one record to the next: the record's bytes rounded up to 4.
    stride: usize,
    chunks: Vec<StoreChunk>,
}

impl NeuronStore {
    /// The binding holding `slot` and the slot's byte offset in it.
    fn place(&self, slot: usize) -> (usize, usize) {
        let per = self.chunks.first().map_or(1, |c| c.slots.max(1));
        let c = slot / per;
        (c, (slot - self.chunks[c].first) * self.stride)
    }
}

fn no_store(store: u64) -> Error {
    Error::InvalidArgument {
        what: format!("neuron store {store} was not created on this backend (or was freed)"),
    }
}

impl WgpuBackend {
    fn neuron_store(&self, store: u64) -> Result<Arc<NeuronStore>> {
        self.neuron_stores
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&store)
            .cloned()
            .ok_or_else(|| no_store(store))
    }

    /// Bytes of neuron records uploaded by [`NeuronOps::neuron_slots_write`] since the
    /// backend was made.
    pub fn neuron_bytes_uploaded(&self) -> u64 {
        self.neuron_uploads.load(Ordering::Relaxed)
    }

    /// [`NeuronOps::neuron_mlp`], also returning the hidden values it summed:
    /// `n_tokens × k`, `silu(gate) · up` for a kept neuron and 0 for the others (tests
    /// hold them to `matmul_rows` and `swiglu` bit for bit).
    pub fn neuron_mlp_hidden(&self, job: NeuronMlpJob<'_>) -> Result<Vec<f32>> {
        self.run_neuron_mlp(job, true)
    }

    fn run_neuron_mlp(&self, job: NeuronMlpJob<'_>, want_hidden: bool) -> Result<Vec<f32>> {
        let store = self.neuron_store(job.store)?;
        let layout = store.layout;
        job.check(&layout, store.capacity)?;
        let (n, k, n_embd) = (job.n_tokens, job.slots.len(), layout.n_embd);
        if n == 0 {
            return Ok(Vec::new());
        }
        if k == 0 {
            job.out.fill(0.0);
            return Ok(Vec::new());
        }
        self.timed(OpKind::Matmul, || {
            // The job as the kernels read it: slots, gate bits, keep flags.
            let mut words: Vec<u32> = Vec::with_capacity(k + 2 * n * k);
            words.extend_from_slice(job.slots);
            words.extend(job.gate.iter().map(|g| g.to_bits()));
            words.extend(job.keep.iter().map(|&b| u32::from(b)));
            let mut rec = self.recorder();
            let xb = rec.upload("neuron input", bytemuck::cast_slice(job.x))?;
            let jb = rec.upload("neuron job", bytemuck::cast_slice(&words))?;
            let hidden = rec.buffer("neuron hidden values", (n * k * 4) as u64)?;
            let out = rec.buffer("neuron output", (n * n_embd * 4) as u64)?;
            let at = quant::activation_type(layout.up_type);
            let acts = if at == GgmlType::F32 {
                None
            } else {
                Some(self.record_quantize(&mut rec, &xb, n, n_embd, at)?)
            };
            let stride = store.stride as u32;
            for chunk in &store.chunks {
                let params = Params::new(
                    [chunk.slots as u32, n_embd as u32, k as u32, stride],
                    [chunk.first as u32, n as u32, 0, 0],
                    [0.0; 4],
                );
                let (shader, bindings) = match &acts {
                    None => (
                        &NEURON_HIDDEN_F,
                        vec![chunk.buffer.raw(), &xb, &hidden, &jb],
                    ),
                    Some((aq, asc)) => (
                        &NEURON_HIDDEN,
                        vec![chunk.buffer.raw(), aq, asc, &hidden, &jb],
                    ),
                };
                // This binding's share of the up rows read.
                let listed = job
                    .slots
                    .iter()
                    .filter(|&&s| (s as usize).wrapping_sub(chunk.first) < chunk.slots)
                    .count();
                rec.dispatch(
                    shader,
                    "neuron_hidden",
                    &[("WTYPE", layout.up_type.id() as f64)],
                    &bindings,
                    params,
                    [k.div_ceil(MATMUL_ROWS) as u32, 1, n as u32],
                    "neuron hidden",
                    (n * n_embd * 4 + words.len() * 4) as u64,
                    (n * listed * 4) as u64,
                    (n * listed * layout.up_bytes()) as u64,
                );
            }
            // Split over several bindings, the listed records are first copied in order
            // into one buffer, so the down sum still runs over them in the order given.
            let gathered;
            let (records, direct) = if let [only] = store.chunks.as_slice() {
                (only.buffer.raw(), 1)
            } else {
                gathered = rec.buffer("neuron records gathered", (k * store.stride) as u64)?;
                let mut i = 0;
                while i < k {
                    let (c, off) = store.place(job.slots[i] as usize);
                    let mut run = 1;
                    while i + run < k
                        && store.place(job.slots[i + run] as usize) == (c, off + run * store.stride)
                    {
                        run += 1;
                    }
                    rec.copy(
                        store.chunks[c].buffer.raw(),
                        off as u64,
                        &gathered,
                        (i * store.stride) as u64,
                        (run * store.stride) as u64,
                    );
                    i += run;
                }
                (&gathered, 0)
            };
            rec.dispatch(
                &NEURON_DOWN,
                "neuron_down",
                &[("WTYPE", layout.down_type.id() as f64)],
                &[records, &hidden, &jb, &out],
                Params::new(
                    [k as u32, n_embd as u32, n as u32, stride],
                    [layout.up_bytes() as u32, direct, 0, 0],
                    [0.0; 4],
                ),
                [n_embd.div_ceil(64) as u32, 1, n as u32],
                "neuron down",
                (n * k * 4 + words.len() * 4) as u64,
                (n * n_embd * 4) as u64,
                (k * layout.down_bytes()) as u64,
            );
            let out_bytes = (n * n_embd * 4) as u64;
            let mut sources = vec![(&out, 0, out_bytes)];
            if want_hidden {
                sources.push((&hidden, 0, (n * k * 4) as u64));
            }
            let bytes = rec.finish(&sources)?.0;
            let (o, h) = bytes.split_at(out_bytes as usize);
            job.out
                .copy_from_slice(&bytemuck::pod_collect_to_vec::<u8, f32>(o));
            Ok(bytemuck::pod_collect_to_vec(h))
        })
    }
}

impl NeuronOps for WgpuBackend {
    fn neuron_slots_create(
        &self,
        store: u64,
        capacity: usize,
        layout: &NeuronLayout,
    ) -> Result<()> {
        layout.check()?;
        if !gpu_supports(layout.up_type) {
            return Err(Error::GpuUnsupportedType {
                tensor: "neuron records (the up row)".to_string(),
                ty: layout.up_type.name().to_string(),
            });
        }
        let stride = layout.record_bytes().div_ceil(4) * 4;
        if stride as u64 > self.max_chunk_bytes {
            return Err(Error::GpuLimit {
                what: "one neuron record".to_string(),
                needed: stride as u64,
                limit: self.max_chunk_bytes,
            });
        }
        // Drop the store this one replaces first: its memory comes back before the new
        // one is counted.
        self.neuron_slots_free(store);
        let per = (self.max_chunk_bytes as usize / stride).max(1);
        let mut chunks = Vec::new();
        let mut first = 0;
        while first < capacity {
            let slots = per.min(capacity - first);
            let buffer = self.ctx.buffer_with_usage(
                (slots * stride) as u64,
                wgpu::BufferUsages::STORAGE
                    | wgpu::BufferUsages::COPY_DST
                    | wgpu::BufferUsages::COPY_SRC,
                "neuron store",
            )?;
            chunks.push(StoreChunk {
                buffer,
                first,
                slots,
            });
            first += slots;
        }
        let made = NeuronStore {
            layout: *layout,
            capacity,
            stride,
            chunks,
        };
        self.neuron_stores
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(store, Arc::new(made));
        Ok(())
    }

    fn neuron_slots_write(&self, store: u64, slots: &[u32], records: &[u8]) -> Result<()> {
        let s = self.neuron_store(store)?;
        let rb = s.layout.record_bytes();
        if records.len() != slots.len() * rb {
            return Err(Error::ShapeMismatch {
                what: format!("bytes of {} neuron records", slots.len()),
                expected: slots.len() * rb,
                got: records.len(),
            });
        }
        check_slots(slots, s.capacity)?;
        let mut uploaded = 0u64;
        let mut padded = Vec::new();
        let mut i = 0;
        while i < slots.len() {
            let (c, off) = s.place(slots[i] as usize);
            let mut run = 1;
            while i + run < slots.len()
                && s.place(slots[i + run] as usize) == (c, off + run * s.stride)
            {
                run += 1;
            }
            let bytes = &records[i * rb..(i + run) * rb];
            let data = if s.stride == rb {
                bytes
            } else {
                padded.clear();
                for r in bytes.chunks_exact(rb) {
                    padded.extend_from_slice(r);
                    padded.resize(padded.len() + s.stride - rb, 0);
                }
                &padded[..]
            };
            self.ctx
                .queue()
                .write_buffer(s.chunks[c].buffer.raw(), off as u64, data);
            uploaded += data.len() as u64;
            i += run;
        }
        self.neuron_uploads.fetch_add(uploaded, Ordering::Relaxed);
        Ok(())
    }

    fn neuron_slots_free(&self, store: u64) {
        let gone = self
            .neuron_stores
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&store);
        drop(gone);
    }

    fn neuron_mlp(&self, job: NeuronMlpJob<'_>) -> Result<()> {
        self.run_neuron_mlp(job, false).map(drop)
    }
}
