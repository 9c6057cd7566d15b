//! The wgpu backend: every op of the forward pass as a WGSL compute shader (the `.wgsl`
//! files beside this module), dispatched through the runtime's [`GpuContext`].
//!
//! Two ways in:
//!
//! - The [`Backend`] ops, one submission and one read-back each, on host slices. They
//!   exist so the backend test suite (`tests/backend_ops.rs`) holds every kernel to the
//!   CPU reference, and so any lever that calls the trait works on the GPU.
//! - [`DeviceExecutor`]: a whole forward pass recorded into one command encoder, with
//!   activations, weights and the KV rows on the device. With a [`DeviceKv`] (the cache
//!   sessions get on this backend) the rows live only there, in the cache's element
//!   type, and decode of one token is one submission reading back the logits or only
//!   the greedy id. A host [`KvCache`] handed to a pass gets a device mirror instead,
//!   and its new keys and values come back with the logits so the host copy stays the
//!   complete record.
//!
//! Layers a store streams (their bytes may not be cached on the device) are uploaded
//! into a ring of stream slots as the pass reaches them; before a slot is overwritten
//! the commands recorded so far are submitted, so a pass over streamed layers is one
//! submission per slot-ring turn, still with one read-back.
//!
//! Matrix products read the GGUF blocks directly; activations are quantized on the
//! device exactly as the CPU backend quantizes them (Q8_0, Q8_1, Q8_K), so the integer
//! block sums are identical and only float summation order differs.
//!
//! The module is split by idea: `weights` (device copies of weights and vectors),
//! `stream` (the stream-slot ring), `decode` (coded weights decoded into a stream
//! slot), `device_kv` (the device-resident KV cache), `kv` (device mirrors of host
//! caches), `ops` (one encoder per op), `moe` (a mixture of experts inside the pass:
//! routing and expert-id products), `neurons` (neuron slot stores and the SwiGLU MLP
//! over some of their records), `record` (the command encoder, traffic counts,
//! timestamps), `pass` (a `Graph` recorded whole), `host` (the `Backend` ops on host
//! slices). Every kernel takes the parameter block of `params.wgsl`, prepended to its
//! source.
//!
//! # Shaders
//!
//! The kernels are compiled without wgpu's runtime checks ([`Shader::trusted`]), all
//! but the pack decoder (`decode.wgsl`, which parses stored bytes). What that asks was
//! checked for each: local and workgroup arrays are indexed by counters of loops with
//! constant bounds, or by the invocation index below the workgroup size the array
//! matches; every loop has a constant bound, or a bound from the dispatch's parameters
//! and a constant non-zero stride; every buffer index comes from shapes the host checked
//! against the buffers it binds. `BALLAST_WGPU_CHECKED=1` puts the checks back, to
//! tell a kernel's bug from a missing check.

mod decode;
mod device_kv;
mod host;
mod kv;
mod moe;
mod neurons;
mod ops;
mod pass;
mod record;
mod stream;
mod weights;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use super::cpu::{check_len, check_rows};
use super::ops::*;
use super::{
    AttentionShape, Backend, DeviceExecutor, MatmulJob, OpKind, OpTimes, PassReport, Residency,
    Rope, RopeStyle, Telemetry,
};
use crate::error::{Error, Result};
use crate::ggml_type::GgmlType;
use crate::gpu::{GpuBuffer, GpuContext, Shader};
use crate::kv::{KvCache, KvRows, KvView};
use crate::quant;
use crate::weights::{Weight, WeightId};
pub use device_kv::DeviceKv;
use kv::KvMirror;
use ops::{rope_table, ExpertRows, PackedRows};
use record::{Params, PassArena, Recorder};
use stream::StreamRing;
pub use stream::DEFAULT_STREAM_SLOTS;
use weights::{CachedVector, DeviceWeight};

// SAFETY: checked as `Shader::trusted` asks (the module's "Shaders").
pub(crate) const EMBED: Shader = unsafe {
    Shader::trusted(
        "ballast.embed",
        concat!(
            include_str!("params.wgsl"),
            include_str!("embed.wgsl"),
            include_str!("blocks.wgsl")
        ),
    )
};
/// Lanes that share one output row of a weight product (the shaders' `LANES`; 64 / it
/// rows per workgroup). One macro so the WGSL constant and the dispatch counts agree.
macro_rules! matmul_lanes {
    () => {
        16
    };
}
/// The WGSL declaration of `LANES`, put before `matmul_rows.wgsl` in each shader that
/// includes it.
macro_rules! lanes_decl {
    () => {
        concat!("const LANES: u32 = ", matmul_lanes!(), "u;\n")
    };
}
/// [`matmul_lanes`] for Rust.
pub(super) const MATMUL_LANES: usize = matmul_lanes!();
/// Output rows per workgroup of a weight product.
pub(super) const MATMUL_ROWS: usize = 64 / MATMUL_LANES;

// SAFETY: checked as `Shader::trusted` asks (the module's "Shaders").
pub(crate) const MATMUL: Shader = unsafe {
    Shader::trusted(
        "ballast.matmul",
        concat!(
            include_str!("params.wgsl"),
            include_str!("matmul.wgsl"),
            lanes_decl!(),
            include_str!("matmul_rows.wgsl"),
            include_str!("blocks.wgsl")
        ),
    )
};
// SAFETY: checked as `Shader::trusted` asks (the module's "Shaders").
pub(crate) const MATMUL_F: Shader = unsafe {
    Shader::trusted(
        "ballast.matmul_f",
        concat!(
            include_str!("params.wgsl"),
            include_str!("matmul_f.wgsl"),
            lanes_decl!(),
            include_str!("matmul_rows.wgsl"),
            include_str!("blocks.wgsl")
        ),
    )
};
// SAFETY: checked as `Shader::trusted` asks (the module's "Shaders").
pub(crate) const QUANTIZE: Shader = unsafe {
    Shader::trusted(
        "ballast.quantize",
        concat!(include_str!("params.wgsl"), include_str!("quantize.wgsl")),
    )
};
// SAFETY: checked as `Shader::trusted` asks (the module's "Shaders").
pub(crate) const RMS_NORM: Shader = unsafe {
    Shader::trusted(
        "ballast.rms_norm",
        concat!(include_str!("params.wgsl"), include_str!("rms_norm.wgsl")),
    )
};
// SAFETY: checked as `Shader::trusted` asks (the module's "Shaders").
pub(crate) const ROPE: Shader = unsafe {
    Shader::trusted(
        "ballast.rope",
        concat!(include_str!("params.wgsl"), include_str!("rope.wgsl")),
    )
};
// SAFETY: checked as `Shader::trusted` asks (the module's "Shaders").
pub(crate) const ELEMENTWISE: Shader = unsafe {
    Shader::trusted(
        "ballast.elementwise",
        concat!(
            include_str!("params.wgsl"),
            include_str!("elementwise.wgsl"),
            include_str!("silu.wgsl")
        ),
    )
};
// SAFETY: checked as `Shader::trusted` asks (the module's "Shaders").
pub(crate) const NEURON_HIDDEN: Shader = unsafe {
    Shader::trusted(
        "ballast.neuron_hidden",
        concat!(
            include_str!("params.wgsl"),
            include_str!("matmul.wgsl"),
            lanes_decl!(),
            include_str!("matmul_rows.wgsl"),
            include_str!("neuron_hidden.wgsl"),
            include_str!("blocks.wgsl"),
            include_str!("silu.wgsl")
        ),
    )
};
// SAFETY: checked as `Shader::trusted` asks (the module's "Shaders").
pub(crate) const NEURON_HIDDEN_F: Shader = unsafe {
    Shader::trusted(
        "ballast.neuron_hidden_f",
        concat!(
            include_str!("params.wgsl"),
            include_str!("matmul_f.wgsl"),
            lanes_decl!(),
            include_str!("matmul_rows.wgsl"),
            include_str!("neuron_hidden.wgsl"),
            include_str!("blocks.wgsl"),
            include_str!("silu.wgsl")
        ),
    )
};
// SAFETY: checked as `Shader::trusted` asks (the module's "Shaders").
pub(crate) const NEURON_DOWN: Shader = unsafe {
    Shader::trusted(
        "ballast.neuron_down",
        concat!(
            include_str!("params.wgsl"),
            include_str!("neuron_down.wgsl"),
            include_str!("blocks.wgsl")
        ),
    )
};
// SAFETY: checked as `Shader::trusted` asks (the module's "Shaders").
pub(crate) const ATTENTION: Shader = unsafe {
    Shader::trusted(
        "ballast.attention",
        concat!(include_str!("params.wgsl"), include_str!("attention.wgsl")),
    )
};
// SAFETY: checked as `Shader::trusted` asks (the module's "Shaders").
pub(crate) const ATTENTION_COMBINE: Shader = unsafe {
    Shader::trusted(
        "ballast.attention_combine",
        concat!(
            include_str!("params.wgsl"),
            include_str!("attention_combine.wgsl")
        ),
    )
};
// SAFETY: checked as `Shader::trusted` asks (the module's "Shaders").
pub(crate) const KV_WRITE: Shader = unsafe {
    Shader::trusted(
        "ballast.kv_write",
        concat!(include_str!("params.wgsl"), include_str!("kv_write.wgsl")),
    )
};
// SAFETY: checked as `Shader::trusted` asks (the module's "Shaders").
pub(crate) const ARGMAX: Shader = unsafe {
    Shader::trusted(
        "ballast.argmax",
        concat!(include_str!("params.wgsl"), include_str!("argmax.wgsl")),
    )
};

/// The wgpu backend. Weights are uploaded once, on first use, and kept on the device,
/// unless their bytes say they may not be cached
/// ([`crate::weights::ByteSource::cache_on_device`]: a tiered store's RAM tier and disk
/// slots): those are uploaded per use into a ring of stream slots.
pub struct WgpuBackend {
    ctx: Arc<GpuContext>,
    times: OpTimes,
    weights: Mutex<HashMap<WeightId, Arc<DeviceWeight>>>,
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
    /// The device pass's buffers, kept from one pass to the next.
    arena: PassArena,
    /// Neuron slot stores by number (`neurons.rs`).
    neuron_stores: Mutex<HashMap<u64, Arc<neurons::NeuronStore>>>,
    /// Bytes of neuron records uploaded so far: a device pass counts what its host sync
    /// points uploaded as its own.
    neuron_uploads: std::sync::atomic::AtomicU64,
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
                coded: Vec::new(),
                next: 0,
            }),
            max_chunk_bytes,
            profile: Default::default(),
            report: Mutex::default(),
            arena: PassArena::default(),
            neuron_stores: Mutex::default(),
            neuron_uploads: Default::default(),
        }
    }

    /// The GPU context.
    pub fn context(&self) -> &Arc<GpuContext> {
        &self.ctx
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

    /// A recorder for a device pass: its buffers come from the backend's arena, so the
    /// next pass binds the same ones.
    fn pass_recorder(&self) -> Recorder<'_> {
        Recorder::with_arena(
            &self.ctx,
            self.profile.load(std::sync::atomic::Ordering::Relaxed),
            &self.arena,
        )
    }
}
