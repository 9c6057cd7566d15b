//! [`Backend`]: the ops of the forward pass, and where their time goes.
//!
//! The model is written once against this trait. `ballast-runtime` implements it: its
//! CPU backend is the numerical reference that every other backend is tested against,
//! and its wgpu backend runs whole passes on a GPU ([`DeviceExecutor`]). Weights arrive
//! quantized, exactly as packed in the GGUF file; a backend dequantizes inside its
//! kernels and never keeps an f32 copy of a weight.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use crate::error::Result;
use crate::ffn::FeedForward;
use crate::graph::Graph;
use crate::kv::{KvCache, KvElement, KvShape, KvView};
use crate::neurons::NeuronOps;
use crate::weights::{GlobalWeights, LayerWeights, Weight};

/// How RoPE pairs the dimensions it rotates; llama.cpp's rope-type table assigns one
/// per architecture.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopeStyle {
    /// Adjacent pairs `(x[2i], x[2i+1])` (`LLAMA_ROPE_TYPE_NORM`: llama).
    Normal,
    /// Pairs `(x[i], x[i + n/2])` (`LLAMA_ROPE_TYPE_NEOX`: qwen2, gemma).
    Neox,
}

/// Rotary position embedding parameters, from the GGUF metadata.
#[derive(Clone, Debug, PartialEq)]
pub struct Rope {
    /// Pairing of the rotated dimensions.
    pub style: RopeStyle,
    /// Number of leading dimensions of each head that are rotated.
    pub n_dims: usize,
    /// `rope.freq_base`.
    pub freq_base: f32,
    /// Linear RoPE scaling: angles are multiplied by this (`1 / rope.scaling.factor`;
    /// 1 without scaling), as llama.cpp's `freq_scale` with no YaRN extension.
    pub freq_scale: f32,
    /// Per rotated pair, a divisor of its angle (`rope_freqs.weight`: Llama 3.1's
    /// long-context frequencies), as ggml's `freq_factors`.
    pub freq_factors: Option<std::sync::Arc<[f32]>>,
}

impl Rope {
    /// The angle of pair `pair` from its unscaled angle `theta`: divided by the pair's
    /// frequency factor, then scaled (exactly `theta` without either).
    #[inline(always)]
    pub fn angle(&self, pair: usize, theta: f32) -> f32 {
        let theta = match &self.freq_factors {
            Some(f) => theta / f[pair],
            None => theta,
        };
        self.freq_scale * theta
    }
}

/// The head layout of attention, the scale of its scores and its mask.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AttentionShape {
    /// Query heads.
    pub n_heads: usize,
    /// Key/value heads (grouped-query attention when fewer than `n_heads`).
    pub n_kv_heads: usize,
    /// Size of one head.
    pub head_dim: usize,
    /// What each score `q·k` is multiplied by before the softmax (llama.cpp's
    /// `kq_scale`): `1/sqrt(head_dim)` ([`AttentionShape::new`]), or 1 when the
    /// architecture scales the queries itself (gemma3).
    pub scale: f32,
    /// `Some(w)`: sliding-window attention; a query at position `p` sees only the keys
    /// at positions `p - w + 1 ..= p` (llama.cpp's `LLAMA_SWA_TYPE_STANDARD`). `None`:
    /// every key at or before `p`.
    pub window: Option<usize>,
}

impl AttentionShape {
    /// Causal attention over every earlier key, scores scaled by `1/sqrt(head_dim)`.
    pub fn new(n_heads: usize, n_kv_heads: usize, head_dim: usize) -> AttentionShape {
        AttentionShape {
            n_heads,
            n_kv_heads,
            head_dim,
            scale: 1.0 / (head_dim as f32).sqrt(),
            window: None,
        }
    }

    /// True if a query at `q_pos` attends to a key at `k_pos` (a masked slot,
    /// [`crate::kv::MASKED_POSITION`], never).
    pub fn sees(&self, q_pos: u32, k_pos: u32) -> bool {
        k_pos <= q_pos && self.window.is_none_or(|w| ((q_pos - k_pos) as usize) < w)
    }
}

/// One matrix product in a batch: `out = x · weightᵀ`.
pub struct MatmulJob<'a> {
    /// The weight, `rows × cols`.
    pub weight: &'a Weight,
    /// Output, `n_tokens × rows`, token-major.
    pub out: &'a mut [f32],
}

/// Where the time of the forward pass went, by op family.
#[derive(Debug, Default)]
pub struct OpTimes {
    matmul_ns: AtomicU64,
    attention_ns: AtomicU64,
    other_ns: AtomicU64,
    regions: AtomicU64,
    wait_ns: AtomicU64,
}

/// A snapshot of [`OpTimes`].
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct OpTimesSnapshot {
    /// Matrix products, activation quantization included.
    pub matmul: Duration,
    /// Attention over the cache (scores, softmax, weighted sum).
    pub attention: Duration,
    /// Everything else: norms, RoPE, SwiGLU, residuals, embedding.
    pub other: Duration,
    /// Parallel regions run on several threads (each ends at a barrier).
    pub regions: u64,
    /// Time the calling thread waited at those barriers for the other threads, after
    /// its own share (uneven shares, wake-up latency): what a region's barrier costs.
    /// Part of the times above.
    pub thread_wait: Duration,
}

/// The op family a timing belongs to.
#[derive(Clone, Copy, Debug)]
pub enum OpKind {
    /// Matrix products.
    Matmul,
    /// Attention.
    Attention,
    /// The rest.
    Other,
}

impl OpTimes {
    /// Adds `elapsed` to `kind`.
    pub fn add(&self, kind: OpKind, elapsed: Duration) {
        let slot = match kind {
            OpKind::Matmul => &self.matmul_ns,
            OpKind::Attention => &self.attention_ns,
            OpKind::Other => &self.other_ns,
        };
        slot.fetch_add(elapsed.as_nanos() as u64, Ordering::Relaxed);
    }

    /// Counts one parallel region whose calling thread then waited `waited` for the
    /// others.
    pub fn add_region_wait(&self, waited: Duration) {
        self.regions.fetch_add(1, Ordering::Relaxed);
        self.wait_ns
            .fetch_add(waited.as_nanos() as u64, Ordering::Relaxed);
    }

    /// The totals so far.
    pub fn snapshot(&self) -> OpTimesSnapshot {
        let d = |a: &AtomicU64| Duration::from_nanos(a.load(Ordering::Relaxed));
        OpTimesSnapshot {
            matmul: d(&self.matmul_ns),
            attention: d(&self.attention_ns),
            other: d(&self.other_ns),
            regions: self.regions.load(Ordering::Relaxed),
            thread_wait: d(&self.wait_ns),
        }
    }

    /// Sets every total back to zero.
    pub fn reset(&self) {
        for a in [
            &self.matmul_ns,
            &self.attention_ns,
            &self.other_ns,
            &self.regions,
            &self.wait_ns,
        ] {
            a.store(0, Ordering::Relaxed);
        }
    }
}

/// Matrix products on quantized weights, and the embedding lookup (rows of a
/// quantized table). Weights stay as packed in the file; kernels dequantize inside.
pub trait LinearOps {
    /// Matrix products that share one input: for each job, `job.out = x · job.weightᵀ`
    /// (`x` is `n_tokens × cols`). Batching q/k/v or gate/up this way quantizes `x`
    /// once and runs one parallel region.
    fn matmul(&self, x: &[f32], n_tokens: usize, jobs: &mut [MatmulJob<'_>]) -> Result<()>;
    /// Only some rows of `x · weightᵀ`: for each range in `rows` (in bounds, disjoint),
    /// `out[t * weight.rows() + r] = x[t] · weight.row(r)`; the other entries of `out`
    /// (`n_tokens × weight.rows()`) are left as they are. Each computed value is exactly
    /// what [`LinearOps::matmul`] gives for it. A sparse MLP skips the rows of inactive
    /// neurons this way. The default computes every row and copies the asked ones; a
    /// backend that can skip rows overrides it.
    fn matmul_rows(
        &self,
        x: &[f32],
        n_tokens: usize,
        weight: &Weight,
        rows: &[std::ops::Range<usize>],
        out: &mut [f32],
    ) -> Result<()> {
        let n_rows = weight.rows();
        check_row_ranges(weight, x.len(), rows, n_tokens, out.len())?;
        let mut all = vec![0f32; n_tokens * n_rows];
        self.matmul(
            x,
            n_tokens,
            &mut [MatmulJob {
                weight,
                out: &mut all,
            }],
        )?;
        for t in 0..n_tokens {
            for r in rows {
                let span = t * n_rows + r.start..t * n_rows + r.end;
                out[span.clone()].copy_from_slice(&all[span]);
            }
        }
        Ok(())
    }
    /// Rows of `table` for `ids`, dequantized into `out` (`ids.len() × cols`).
    fn embed(&self, table: &Weight, ids: &[u32], out: &mut [f32]) -> Result<()>;
}

/// Checks the arguments of [`LinearOps::matmul_rows`]: `x` of `n_tokens ×
/// weight.cols()`, ranges in bounds, ascending and disjoint, `out` of `n_tokens ×
/// weight.rows()`.
pub fn check_row_ranges(
    weight: &Weight,
    x_len: usize,
    rows: &[std::ops::Range<usize>],
    n_tokens: usize,
    out_len: usize,
) -> Result<()> {
    if x_len != n_tokens * weight.cols() {
        return Err(crate::Error::ShapeMismatch {
            what: format!("input of {}", weight.name),
            expected: n_tokens * weight.cols(),
            got: x_len,
        });
    }
    let n_rows = weight.rows();
    if out_len != n_tokens * n_rows {
        return Err(crate::Error::ShapeMismatch {
            what: format!("output of the row-selected product with {}", weight.name),
            expected: n_tokens * n_rows,
            got: out_len,
        });
    }
    let mut end = 0;
    for r in rows {
        if r.start < end || r.start > r.end || r.end > n_rows {
            return Err(crate::Error::InvalidArgument {
                what: format!(
                    "row range {r:?} of {} ({n_rows} rows): ranges must be in bounds, ascending and disjoint",
                    weight.name
                ),
            });
        }
        end = r.end;
    }
    Ok(())
}

/// Normalization.
pub trait NormOps {
    /// RMSNorm of each row of `x` (rows of `scale.len()`), times `scale`, into `out`.
    fn rms_norm(&self, x: &[f32], scale: &[f32], eps: f32, out: &mut [f32]) -> Result<()>;
}

/// Rotary position embedding.
pub trait RopeOps {
    /// Rotates each head of each row of `x` (`positions.len()` rows of
    /// `n_heads × head_dim`) by its token's position.
    fn rope(
        &self,
        x: &mut [f32],
        positions: &[u32],
        n_heads: usize,
        head_dim: usize,
        rope: &Rope,
    ) -> Result<()>;
}

/// Attention over a KV cache.
pub trait AttentionOps {
    /// Causal attention of the queries `q` (`q_positions.len()` rows of
    /// `n_heads × head_dim`) over the cached tokens whose position is at most the
    /// query's, into `out` (same layout as `q`).
    fn attention(
        &self,
        q: &[f32],
        q_positions: &[u32],
        kv: &KvView<'_>,
        shape: &AttentionShape,
        out: &mut [f32],
    ) -> Result<()>;
}

/// Element-wise ops: activations and residuals.
pub trait ElementwiseOps {
    /// `out[i] = silu(gate[i]) * up[i]`.
    fn swiglu(&self, gate: &[f32], up: &[f32], out: &mut [f32]) -> Result<()>;
    /// `out[i] = gelu(gate[i]) * up[i]`, GELU in its tanh form (gemma's gated MLP).
    fn geglu(&self, gate: &[f32], up: &[f32], out: &mut [f32]) -> Result<()>;
    /// `x[i] *= factor`.
    fn scale(&self, x: &mut [f32], factor: f32) -> Result<()>;
    /// `x[i] += y[i]`.
    fn add_assign(&self, x: &mut [f32], y: &[f32]) -> Result<()>;
    /// Adds `bias` to each row of `x`.
    fn add_bias(&self, x: &mut [f32], bias: &[f32]) -> Result<()> {
        for row in x.chunks_exact_mut(bias.len().max(1)) {
            self.add_assign(row, bias)?;
        }
        Ok(())
    }
}

/// A compute backend: the op families of the forward pass on token-major f32 rows
/// (`n_tokens × width`) in host memory, and the optional capabilities a caller asks
/// for by name, each a trait of its own so a caller sees only what it needs:
///
/// - [`Backend::telemetry`]: where the time went (op times; a device's pass reports);
/// - [`Backend::executor`]: whole forward passes on the backend's own device, and the
///   KV caches whose rows live there (a GPU; `None` on the CPU, where the model runs
///   the pass op by op on host memory);
/// - [`Backend::residency`]: the device memory weights are held in (stream slots,
///   bytes, release);
/// - [`Backend::neurons`]: stores of neuron records and the MLP over them, for the
///   sparse-MLP lever.
///
/// Bring the families into scope to call them on a `&dyn Backend`:
/// `use ballast_core::backend::ops::*;`.
pub trait Backend:
    LinearOps + NormOps + RopeOps + AttentionOps + ElementwiseOps + Send + Sync
{
    /// A human-readable name: the device, and the SIMD level or adapter.
    fn name(&self) -> String;
    /// Where the backend's time goes.
    fn telemetry(&self) -> &dyn Telemetry;
    /// A way to run whole forward passes on the backend's own device, keeping
    /// activations and a mirror of the KV cache there. `None` (the default): the
    /// model runs the pass op by op on host memory.
    fn executor(&self) -> Option<&dyn DeviceExecutor> {
        None
    }
    /// The backend's own memory, if it computes from memory other than the host's.
    fn residency(&self) -> Option<&dyn Residency> {
        None
    }
    /// Neuron stores and the neuron MLP, if the backend has them (the sparse-MLP
    /// lever's fast path; without them it uses row-selected products).
    fn neurons(&self) -> Option<&dyn NeuronOps> {
        None
    }
}

/// The op families, to bring into scope at once: `use ballast_core::backend::ops::*;`.
pub mod ops {
    pub use super::{AttentionOps, ElementwiseOps, LinearOps, NormOps, RopeOps};
}

/// Where a backend's time goes: op times by family, and on a device the figures of
/// its last pass.
pub trait Telemetry: Send + Sync {
    /// Time spent per op family.
    fn op_times(&self) -> &OpTimes;
    /// Asks for per-kernel timings in [`Telemetry::last_pass`] (where the device has
    /// timestamp queries). Nothing by default.
    fn set_profiling(&self, on: bool) {
        let _ = on;
    }
    /// Figures of the last device pass: traffic, dispatches, kernel timings. `None`
    /// where nothing runs as a device pass.
    fn last_pass(&self) -> Option<PassReport> {
        None
    }
}

/// Op times are a host backend's whole telemetry.
impl Telemetry for OpTimes {
    fn op_times(&self) -> &OpTimes {
        self
    }
}

/// The memory of a backend that computes from a device of its own (a GPU): the
/// stream slots streamed layers are uploaded into, and the bytes it holds.
pub trait Residency: Send + Sync {
    /// Sets how many streamed layers the device holds at once: the slots that layers
    /// whose bytes may not be cached on the device are uploaded into (a tiered store's
    /// plan sizes them).
    fn set_stream_slots(&self, n: usize);
    /// Device bytes held now and at the peak.
    fn bytes(&self) -> (u64, u64);
    /// Drops the device copies of the weights read from file `file`
    /// ([`crate::weights::WeightId::file`]): a model going away gives its weights' device
    /// memory back.
    fn release_file(&self, file: u64);
}

/// Hands a device pass layer `i`'s weights for this pass (the model asks its
/// [`crate::WeightStore`]). The pass drops each layer's `Arc` before asking for the
/// next, so a streaming store gets its slot back.
pub type LayerSource<'a> = dyn FnMut(usize) -> Result<std::sync::Arc<LayerWeights>> + 'a;

/// What a device pass needs besides its [`Graph`]: the tokens and the global weights.
/// Layers come one at a time from a [`LayerSource`].
pub struct DeviceForwardInput<'a> {
    /// Embedding table, final norm, output head.
    pub globals: &'a GlobalWeights,
    /// Token ids.
    pub ids: &'a [u32],
    /// Their positions.
    pub positions: &'a [u32],
}

/// Whole forward passes recorded and submitted at once on a device, over KV caches
/// whose rows live there.
pub trait DeviceExecutor: Send + Sync {
    /// Records the ops of `graph` over `sequences` (consecutive rows of the pass, each
    /// with its own cache; one for a single session, several for a batched step),
    /// taking layers from `layers` as [`crate::graph::Op::BeginLayer`] asks: each
    /// layer's weights are read (or uploaded) once for every sequence, and each
    /// sequence's new keys and values are appended to its cache (in place when it is
    /// the backend's own device cache, see [`DeviceExecutor::new_kv_cache`]). Puts the
    /// graph's logits in `out` (or returns the greedy id when the graph wants only
    /// that). The sequences' policies are not run here. The MLP lever's host sync points ([`crate::graph::Op::FfnPrepare`],
    /// [`crate::graph::Op::FeedForward`]) cost one read-back each, and `ffn`'s output is
    /// uploaded back; a graph with a [`crate::graph::Op::KvPolicy`] is refused (it runs
    /// on the host executor). Weights whose bytes may not be cached on the device
    /// ([`crate::weights::ByteSource::cache_on_device`]) are uploaded into the backend's
    /// stream slots for this pass only.
    fn forward(
        &self,
        graph: &Graph,
        input: &DeviceForwardInput<'_>,
        layers: &mut LayerSource<'_>,
        sequences: &mut [crate::graph::PassSequence<'_>],
        ffn: &mut dyn FeedForward,
        out: &mut Vec<f32>,
    ) -> Result<Option<u32>>;
    /// A KV cache whose rows live on this device, in `element`, for `capacity` tokens
    /// of `shape`: device passes write and attend over it in place and read back no
    /// keys or values. `None` (the default) where the device keeps no rows of its own;
    /// the caller then uses a host cache.
    fn new_kv_cache(
        &self,
        shape: KvShape,
        capacity: usize,
        element: KvElement,
    ) -> Result<Option<Box<dyn KvCache>>> {
        let _ = (shape, capacity, element);
        Ok(None)
    }
    /// [`DeviceExecutor::new_kv_cache`] whose layer `l` keeps only the last `windows[l]`
    /// tokens when that is `Some` (a sliding-window layer: room for the window plus
    /// one pass of at most `chunk` tokens). The default keeps every token.
    fn new_windowed_kv_cache(
        &self,
        shape: KvShape,
        capacity: usize,
        element: KvElement,
        windows: &[Option<usize>],
        chunk: usize,
    ) -> Result<Option<Box<dyn KvCache>>> {
        let _ = (windows, chunk);
        self.new_kv_cache(shape, capacity, element)
    }
}

/// Time of one kernel over a pass, from timestamp queries.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct KernelTime {
    /// Kernel name.
    pub name: String,
    /// Dispatches in the pass.
    pub count: u32,
    /// Total device time in nanoseconds.
    pub nanos: f64,
}

/// What one device pass did: bytes moved (as the kernels read and write them),
/// submissions, dispatches and, when profiling with timestamps, time per kernel.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PassReport {
    /// Tokens in the pass.
    pub tokens: usize,
    /// Wall time from the call to the read-back.
    pub wall: Duration,
    /// Command submissions (one per pass).
    pub submissions: usize,
    /// Compute dispatches.
    pub dispatches: usize,
    /// Bind groups made on the device context while the pass was recorded (the others
    /// came from its cache).
    pub bind_groups_made: u64,
    /// Weight bytes read by the matrix products and the embedding lookup.
    pub weight_bytes_read: u64,
    /// Key and value bytes read by attention.
    pub kv_bytes_read: u64,
    /// Activation bytes read (inputs, norms, biases, quantized activations).
    pub activation_bytes_read: u64,
    /// Bytes written by kernels and copies (KV appends included).
    pub bytes_written: u64,
    /// Bytes copied back to the host.
    pub bytes_read_back: u64,
    /// Weight bytes uploaded from the host for this pass (streamed layers: a store's RAM
    /// tier or disk slots); zero when every weight is resident on the device.
    pub bytes_uploaded: u64,
    /// Device bytes of the KV cache the pass attended over (keys, values and positions
    /// of every layer, at the cache's capacity, in the device's element type).
    pub kv_device_bytes: u64,
    /// True if the device has timestamp queries.
    pub timestamps: bool,
    /// Time per kernel (empty unless profiling on a device with timestamps).
    pub kernels: Vec<KernelTime>,
    /// A recording error, reported when the pass is submitted.
    pub error: Option<String>,
}

impl PassReport {
    /// Every byte the pass moved through device memory.
    pub fn bytes_moved(&self) -> u64 {
        self.weight_bytes_read
            + self.kv_bytes_read
            + self.activation_bytes_read
            + self.bytes_written
    }
}
