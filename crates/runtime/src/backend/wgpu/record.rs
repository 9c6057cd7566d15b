//! [`Recorder`]: records dispatches and copies of one pass into one command encoder,
//! counts the bytes each moves, optionally times each with timestamp queries, and
//! submits them all at once with the one read-back.

use std::collections::HashMap;
use std::sync::Mutex;

use crate::backend::{KernelTime, PassReport};
use crate::error::Result;
use crate::gpu::{GpuBuffer, GpuContext, Shader};

/// The uniform block every kernel takes: two vectors of sizes and offsets, one of floats.
#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
pub(crate) struct Params {
    a: [u32; 4],
    b: [u32; 4],
    f: [f32; 4],
    c: [u32; 4],
}

impl Params {
    pub(crate) fn new(a: [u32; 4], b: [u32; 4], f: [f32; 4]) -> Params {
        Params { a, b, f, c: [0; 4] }
    }

    /// With a third vector of sizes and offsets, for kernels that need more than `a`
    /// and `b`.
    pub(crate) fn with_c(self, c: [u32; 4]) -> Params {
        Params { c, ..self }
    }
}

const PARAMS_SIZE: u64 = std::mem::size_of::<Params>() as u64;
/// Parameter slots per uniform buffer.
const SLOTS_PER_CHUNK: u64 = 64;
/// wgpu's cap on queries per query set.
const MAX_QUERIES: u32 = 4096;

struct ParamChunk {
    buffer: wgpu::Buffer,
    /// The buffer when the pass owns it (no arena).
    _owned: Option<GpuBuffer>,
    bytes: Vec<u8>,
}

/// Device buffers a backend keeps from one pass to the next: a pass's activations,
/// inputs and parameter slots, found again by what they are for, their order among the
/// requests for that purpose, and their size. A decode pass then binds the buffers the
/// previous one bound, so its bind groups come from the context's cache instead of being
/// made anew every token.
#[derive(Default)]
pub(crate) struct PassArena {
    buffers: Mutex<HashMap<(&'static str, u32, u64), GpuBuffer>>,
}

/// Buffers an arena keeps at most; past it, it starts again at the next pass (prefill
/// chunks of many sizes would otherwise each keep a set).
const MAX_ARENA_BUFFERS: usize = 1024;

impl PassArena {
    /// The buffer of `key`, made on first use. Only between passes may the arena drop
    /// buffers ([`PassArena::begin_pass`]): a pass holds plain handles to them.
    fn get(&self, ctx: &GpuContext, key: (&'static str, u32, u64)) -> Result<wgpu::Buffer> {
        let mut map = self.buffers.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(b) = map.get(&key) {
            ctx.poison_if_on(b);
            return Ok(b.raw().clone());
        }
        let b = ctx.buffer(key.2, key.0)?;
        let raw = b.raw().clone();
        map.insert(key, b);
        Ok(raw)
    }

    /// Called before a pass: drops every buffer if the arena has grown past its bound.
    fn begin_pass(&self) {
        let mut map = self.buffers.lock().unwrap_or_else(|p| p.into_inner());
        if map.len() > MAX_ARENA_BUFFERS {
            map.clear();
        }
    }
}

struct Timer {
    queries: wgpu::QuerySet,
    resolve: GpuBuffer,
    labels: Vec<&'static str>,
}

/// One pass being recorded.
pub(crate) struct Recorder<'c> {
    ctx: &'c GpuContext,
    /// The compute pass consecutive untimed dispatches share (declared before the
    /// encoder it locks, so it ends first). A pass per dispatch cost the host more than
    /// the kernels took on a real GPU; wgpu orders the dispatches of one pass by the
    /// buffers they read and write as it orders passes.
    pass: Option<wgpu::ComputePass<'static>>,
    encoder: wgpu::CommandEncoder,
    params: Vec<ParamChunk>,
    align: u64,
    kept: Vec<GpuBuffer>,
    /// Scratch buffers reused by every dispatch of the pass that asks for the same
    /// purpose and size (quantized activations, attention scores): dispatches run in
    /// order, so one buffer per purpose is enough, where one per dispatch would hold
    /// a pass's worth of them at once.
    scratch: Vec<((&'static str, u32, u64), GpuBuffer)>,
    report: PassReport,
    timer: Option<Timer>,
    /// Where the pass's buffers come from and go back to, if the backend keeps them.
    arena: Option<&'c PassArena>,
    /// Requests so far per purpose, for the arena's keys.
    requests: HashMap<&'static str, u32>,
    /// The context's bind-group count when the pass began.
    bind_groups_before: u64,
}

impl<'c> Recorder<'c> {
    /// A recorder; with `profile`, each dispatch is timed if the device has timestamps.
    pub(crate) fn new(ctx: &'c GpuContext, profile: bool) -> Recorder<'c> {
        let encoder = ctx
            .device()
            .create_command_encoder(&wgpu::CommandEncoderDescriptor {
                label: Some("ballast pass"),
            });
        let timer = if profile && ctx.has_timestamps() {
            ctx.buffer_with_usage(
                u64::from(MAX_QUERIES) * 8,
                wgpu::BufferUsages::QUERY_RESOLVE | wgpu::BufferUsages::COPY_SRC,
                "timestamps",
            )
            .ok()
            .map(|resolve| Timer {
                queries: ctx.device().create_query_set(&wgpu::QuerySetDescriptor {
                    label: Some("kernel timestamps"),
                    ty: wgpu::QueryType::Timestamp,
                    count: MAX_QUERIES,
                }),
                resolve,
                labels: Vec::new(),
            })
        } else {
            None
        };
        let report = PassReport {
            timestamps: ctx.has_timestamps(),
            ..PassReport::default()
        };
        Recorder {
            ctx,
            pass: None,
            encoder,
            params: Vec::new(),
            align: u64::from(ctx.limits().min_uniform_buffer_offset_alignment).max(PARAMS_SIZE),
            kept: Vec::new(),
            scratch: Vec::new(),
            report,
            timer,
            arena: None,
            requests: HashMap::new(),
            bind_groups_before: ctx.bind_groups_made(),
        }
    }

    /// A recorder whose buffers come from `arena` and stay there after the pass.
    pub(crate) fn with_arena(
        ctx: &'c GpuContext,
        profile: bool,
        arena: &'c PassArena,
    ) -> Recorder<'c> {
        arena.begin_pass();
        Recorder {
            arena: Some(arena),
            ..Recorder::new(ctx, profile)
        }
    }

    /// A buffer of `bytes` for `purpose`, alive until the pass has run (and, with an
    /// arena, handed to the same request of the next pass).
    pub(crate) fn buffer(&mut self, purpose: &'static str, bytes: u64) -> Result<wgpu::Buffer> {
        match self.arena {
            Some(arena) => {
                let n = self.requests.entry(purpose).or_insert(0);
                let key = (purpose, *n, bytes);
                *n += 1;
                arena.get(self.ctx, key)
            }
            None => {
                let b = self.ctx.buffer(bytes, purpose)?;
                let raw = b.raw().clone();
                self.kept.push(b);
                Ok(raw)
            }
        }
    }

    /// A buffer holding `data` (whole 4-byte words), written before the pass's commands.
    pub(crate) fn upload(&mut self, purpose: &'static str, data: &[u8]) -> Result<wgpu::Buffer> {
        let b = self.buffer(purpose, (data.len() as u64).max(4))?;
        if !data.is_empty() {
            self.ctx.queue().write_buffer(&b, 0, data);
        }
        Ok(b)
    }

    /// Keeps `buffer` out of the pool until the pass has run.
    pub(crate) fn keep(&mut self, buffer: GpuBuffer) {
        self.kept.push(buffer);
    }

    /// A scratch buffer of at least `bytes` for `purpose` (told apart further by
    /// `tag`: an activation type, say), shared with the other dispatches of this pass
    /// that ask for the same, alive until the pass has run.
    pub(crate) fn scratch(
        &mut self,
        purpose: &'static str,
        tag: u32,
        bytes: u64,
    ) -> Result<wgpu::Buffer> {
        if let Some(arena) = self.arena {
            return arena.get(self.ctx, (purpose, tag, bytes));
        }
        let key = (purpose, tag, bytes);
        if let Some((_, b)) = self.scratch.iter().find(|(k, _)| *k == key) {
            return Ok(b.raw().clone());
        }
        let b = self.ctx.buffer(bytes, purpose)?;
        let raw = b.raw().clone();
        self.scratch.push((key, b));
        Ok(raw)
    }

    /// Counts weight bytes uploaded from the host for this pass.
    pub(crate) fn add_upload(&mut self, bytes: u64) {
        self.report.bytes_uploaded += bytes;
    }

    /// Submits what is recorded so far and goes on in a new encoder: a pass that must
    /// overwrite a buffer its earlier commands read (a stream slot) does this first,
    /// since queue writes land before the next submission's commands.
    pub(crate) fn flush(&mut self) -> Result<()> {
        self.pass = None;
        self.write_params()?;
        let next = self
            .ctx
            .device()
            .create_command_encoder(&wgpu::CommandEncoderDescriptor {
                label: Some("ballast pass"),
            });
        let done = std::mem::replace(&mut self.encoder, next);
        self.ctx.queue().submit([done.finish()]);
        self.report.submissions += 1;
        self.ctx.check()
    }

    /// Submits what is recorded so far, reads back `bytes` of `src` from `offset` (a host
    /// sync point: a lever looks at an activation), and goes on in a new encoder. A
    /// queue write after this (the lever's result) lands before the commands recorded
    /// next.
    pub(crate) fn read_now(
        &mut self,
        src: &wgpu::Buffer,
        offset: u64,
        bytes: u64,
    ) -> Result<Vec<u8>> {
        self.pass = None;
        self.write_params()?;
        let next = self
            .ctx
            .device()
            .create_command_encoder(&wgpu::CommandEncoderDescriptor {
                label: Some("ballast pass"),
            });
        let done = std::mem::replace(&mut self.encoder, next);
        let out = self.ctx.submit_and_read(done, &[(src, offset, bytes)])?;
        self.report.submissions += 1;
        self.report.bytes_read_back += bytes;
        Ok(out)
    }

    /// Returns a recording error, else queues the kernels' parameters for the next
    /// submission.
    fn write_params(&mut self) -> Result<()> {
        if let Some(what) = self.report.error.take() {
            return Err(crate::Error::Gpu { what });
        }
        for chunk in &self.params {
            self.ctx
                .queue()
                .write_buffer(&chunk.buffer, 0, &chunk.bytes);
        }
        Ok(())
    }

    /// Counts bytes of keys and values read.
    pub(crate) fn add_kv_read(&mut self, bytes: u64) {
        self.report.kv_bytes_read += bytes;
    }

    fn param_slot(&mut self, params: Params) -> Result<(usize, u64)> {
        let full = self
            .params
            .last()
            .is_none_or(|c| c.bytes.len() as u64 >= SLOTS_PER_CHUNK * self.align);
        if full {
            let size = SLOTS_PER_CHUNK * self.align;
            let (buffer, owned) = match self.arena {
                Some(arena) => {
                    let at = self.params.len() as u32;
                    (arena.get(self.ctx, ("kernel parameters", at, size))?, None)
                }
                None => {
                    let b = self.ctx.buffer(size, "kernel parameters")?;
                    (b.raw().clone(), Some(b))
                }
            };
            self.params.push(ParamChunk {
                buffer,
                _owned: owned,
                bytes: Vec::new(),
            });
        }
        let chunk = self.params.len() - 1;
        let bytes = &mut self.params[chunk].bytes;
        let offset = bytes.len() as u64;
        bytes.extend_from_slice(bytemuck::bytes_of(&params));
        bytes.resize((offset + self.align) as usize, 0);
        Ok((chunk, offset))
    }

    /// Records one dispatch of `entry` of `shader` (with its override `constants`):
    /// binding 0 is `params`, bindings 1.. are `bindings` in order. `groups[0]` may
    /// exceed the per-dimension limit when `groups[1]` is 1: it is folded into y, and
    /// the kernels index with `wid.x + wid.y * nwg.x`. `reads`, `writes` and
    /// `weights` are the bytes the kernel moves, for the pass's traffic figures.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn dispatch(
        &mut self,
        shader: &Shader,
        entry: &'static str,
        constants: &[(&'static str, f64)],
        bindings: &[&wgpu::Buffer],
        params: Params,
        groups: [u32; 3],
        label: &'static str,
        reads: u64,
        writes: u64,
        weights: u64,
    ) {
        if groups.contains(&0) {
            return;
        }
        let (chunk, offset) = match self.param_slot(params) {
            Ok(s) => s,
            Err(e) => {
                self.report.error.get_or_insert(e.to_string());
                return;
            }
        };
        let pipeline = self.ctx.pipeline(shader, entry, constants);
        let bind_group = self.ctx.bind_group(
            &pipeline,
            &self.params[chunk].buffer,
            offset,
            PARAMS_SIZE,
            bindings,
            label,
        );
        let max = self
            .ctx
            .limits()
            .max_compute_workgroups_per_dimension
            .max(1);
        let [mut x, mut y, z] = groups;
        if x > max && y == 1 {
            y = x.div_ceil(max);
            x = max;
        }
        let timestamp_writes = match &mut self.timer {
            Some(t) if (t.labels.len() as u32 + 1) * 2 <= MAX_QUERIES => {
                let i = t.labels.len() as u32;
                t.labels.push(label);
                Some(wgpu::ComputePassTimestampWrites {
                    query_set: &t.queries,
                    beginning_of_pass_write_index: Some(2 * i),
                    end_of_pass_write_index: Some(2 * i + 1),
                })
            }
            _ => None,
        };
        // A timed dispatch has a pass of its own, whose ends the timestamps mark.
        if timestamp_writes.is_some() {
            self.pass = None;
        }
        let timed = timestamp_writes.is_some();
        let pass = match &mut self.pass {
            Some(pass) => pass,
            open => open.insert(
                self.encoder
                    .begin_compute_pass(&wgpu::ComputePassDescriptor {
                        label: Some(if timed { label } else { "ballast kernels" }),
                        timestamp_writes,
                    })
                    .forget_lifetime(),
            ),
        };
        pass.set_pipeline(&pipeline);
        pass.set_bind_group(0, &bind_group, &[]);
        pass.dispatch_workgroups(x, y, z);
        if timed {
            self.pass = None;
        }
        self.report.dispatches += 1;
        self.report.weight_bytes_read += weights;
        self.report.activation_bytes_read += reads;
        self.report.bytes_written += writes;
    }

    /// Records zeroing the first `bytes` (whole words) of `buffer`.
    pub(crate) fn clear(&mut self, buffer: &wgpu::Buffer, bytes: u64) {
        self.pass = None;
        self.encoder.clear_buffer(buffer, 0, Some(bytes));
        self.report.bytes_written += bytes;
    }

    /// Records a buffer-to-buffer copy (a KV-cache append, a read-back source).
    pub(crate) fn copy(
        &mut self,
        src: &wgpu::Buffer,
        src_offset: u64,
        dst: &wgpu::Buffer,
        dst_offset: u64,
        bytes: u64,
    ) {
        self.pass = None;
        self.encoder
            .copy_buffer_to_buffer(src, src_offset, dst, dst_offset, bytes);
        self.report.bytes_written += bytes;
        self.report.activation_bytes_read += bytes;
    }

    /// Uploads the parameters, submits everything recorded as one submission, and reads
    /// back `sources` (plus the timestamps, if timed) with the one read-back.
    pub(crate) fn finish(
        mut self,
        sources: &[(&wgpu::Buffer, u64, u64)],
    ) -> Result<(Vec<u8>, PassReport)> {
        self.pass = None;
        self.write_params()?;
        let mut all: Vec<(&wgpu::Buffer, u64, u64)> = sources.to_vec();
        let n_queries = self.timer.as_ref().map_or(0, |t| 2 * t.labels.len() as u32);
        if let Some(t) = &self.timer {
            if n_queries > 0 {
                self.encoder
                    .resolve_query_set(&t.queries, 0..n_queries, t.resolve.raw(), 0);
                all.push((t.resolve.raw(), 0, u64::from(n_queries) * 8));
            }
        }
        let user_bytes: u64 = sources.iter().map(|s| s.2).sum();
        let mut bytes = self.ctx.submit_and_read(self.encoder, &all)?;
        self.report.submissions += 1;
        self.report.bytes_read_back += user_bytes;
        self.report.bind_groups_made = self.ctx.bind_groups_made() - self.bind_groups_before;
        if let Some(t) = &self.timer {
            if n_queries > 0 {
                let stamps: Vec<u64> = bytemuck::pod_collect_to_vec(&bytes[user_bytes as usize..]);
                let period = f64::from(self.ctx.timestamp_period());
                let mut kernels: Vec<KernelTime> = Vec::new();
                for (i, label) in t.labels.iter().enumerate() {
                    let ns = stamps[2 * i + 1].saturating_sub(stamps[2 * i]) as f64 * period;
                    match kernels.iter_mut().find(|k| k.name == *label) {
                        Some(k) => {
                            k.count += 1;
                            k.nanos += ns;
                        }
                        None => kernels.push(KernelTime {
                            name: label.to_string(),
                            count: 1,
                            nanos: ns,
                        }),
                    }
                }
                self.report.kernels = kernels;
            }
        }
        bytes.truncate(user_bytes as usize);
        drop(self.kept);
        drop(self.scratch);
        Ok((bytes, self.report))
    }
}
