//! The native CPU backend: quantized matrix products on the [`crate::quant`] kernels,
//! split across a [`ThreadPool`], and plain loops for the small ops.

use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, RwLock};
use std::time::Instant;

use super::attention::{
    attend_heads, attend_heads_to, merge_partials, split_chunk, split_key_count, tiled, Finish,
    HeadSlot, SPLIT_FROM_CELLS, SPLIT_MIN_KEYS,
};
use super::elementwise;
use super::ops::*;
use super::{AttentionShape, Backend, MatmulJob, OpKind, OpTimes, Rope, Telemetry};
use crate::error::{Error, Result};
use crate::ggml_type::GgmlType;
use crate::kv::{KvRows, KvSegment, KvView};
use crate::quant::{self, QuantizedActivations};
use crate::threadpool::{split_range, ThreadPool};
use crate::weights::Weight;
use ballast_core::backend::check_row_ranges;
use ballast_core::neurons::{axpy_row, check_slots, NeuronLayout, NeuronMlpJob, NeuronOps};

/// Rows a thread takes at a time; keeps every split a whole number of cache lines of
/// output and lets the kernels run several rows per loop iteration.
const ROW_ALIGN: usize = 16;

/// A raw pointer that may cross into the pool's threads. Every use writes a range
/// that no other thread touches during the same region.
#[derive(Clone, Copy)]
struct SyncPtr(*mut f32);
// SAFETY: threads write disjoint ranges (see each use) and the region ends before the
// borrow it came from does.
unsafe impl Send for SyncPtr {}
// SAFETY: as for `Send`: shared between the pool's threads, each writes its own range.
unsafe impl Sync for SyncPtr {}

impl SyncPtr {
    /// The pointer. A method, so closures capture the whole `SyncPtr` (which is `Sync`)
    /// rather than its raw field.
    fn get(self) -> *mut f32 {
        self.0
    }
}

/// Rows `rows` of `weight` against activation set `act`, written into the output at
/// `out` (a row-major `n_tokens × weight.rows()` matrix).
struct RowsPart<'a> {
    weight: &'a Weight,
    act: usize,
    out: SyncPtr,
    rows: std::ops::Range<usize>,
}

impl CpuBackend {
    /// Computes every part's rows on the pool, the rows of all parts split evenly over
    /// the threads (each thread's rows write disjoint output entries).
    fn run_parts(
        &self,
        acts: &[QuantizedActivations],
        n_tokens: usize,
        parts: &[RowsPart<'_>],
    ) -> Result<()> {
        let mut firsts = Vec::with_capacity(parts.len());
        let mut total_rows = 0;
        for part in parts {
            firsts.push(total_rows);
            total_rows += part.rows.len();
        }
        let failure: Mutex<Option<Error>> = Mutex::new(None);
        let waited = self.pool.run(&|thread, n_threads| {
            let mine = split_range(total_rows, ROW_ALIGN, thread, n_threads);
            for (part, &first) in parts.iter().zip(&firsts) {
                let lo = mine.start.max(first);
                let hi = mine.end.min(first + part.rows.len());
                if lo >= hi {
                    continue;
                }
                let rows = part.weight.rows();
                let (r0, r1) = (part.rows.start + lo - first, part.rows.start + hi - first);
                let row_bytes = part.weight.row_bytes();
                let w = match part.weight.bytes.as_slice() {
                    Ok(all) => &all[r0 * row_bytes..r1 * row_bytes],
                    Err(e) => {
                        *failure.lock().unwrap_or_else(|e| e.into_inner()) = Some(e);
                        continue;
                    }
                };
                let act = &acts[part.act];
                let result = if n_tokens == 1 {
                    // SAFETY: rows r0..r1 of this part's output belong to this thread alone.
                    let out =
                        unsafe { std::slice::from_raw_parts_mut(part.out.get().add(r0), r1 - r0) };
                    quant::matmul(part.weight.ty, w, part.weight.cols(), act, out)
                } else {
                    // SAFETY: the output is a row-major `n_tokens x rows` matrix; elements
                    // (t, r0..r1) of every token belong to this thread alone.
                    unsafe {
                        quant::matmul_token_major(
                            part.weight.ty,
                            w,
                            part.weight.cols(),
                            act,
                            part.out.get().add(r0),
                            rows,
                        )
                    }
                };
                if let Err(e) = result {
                    *failure.lock().unwrap_or_else(|e| e.into_inner()) = Some(e);
                }
            }
        });
        if let Some(waited) = waited {
            self.times.add_region_wait(waited);
        }
        match failure.into_inner().unwrap_or_else(|e| e.into_inner()) {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}

/// Values from which an elementwise op or a norm is worth a parallel region (a prompt
/// batch's, not a token's).
const ELEMENTWISE_PARALLEL: usize = 1 << 16;

impl CpuBackend {
    /// `f` over `0..n` items in one range, or, when `values` (what the items hold) reach
    /// [`ELEMENTWISE_PARALLEL`], over one range per thread (aligned to `align` items).
    fn par_ranges(
        &self,
        n: usize,
        align: usize,
        values: usize,
        f: &(dyn Fn(std::ops::Range<usize>) + Sync),
    ) {
        if values < ELEMENTWISE_PARALLEL || self.pool.n_threads() < 2 {
            return f(0..n);
        }
        let waited = self.pool.run(&|thread, n_threads| {
            f(split_range(n, align, thread, n_threads));
        });
        if let Some(waited) = waited {
            self.times.add_region_wait(waited);
        }
    }

    /// A gated activation (`op(gate, up, out)`, elementwise) over the threads in chunks
    /// of whole vectors when the batch is large.
    fn gated(&self, gate: &[f32], up: &[f32], out: &mut [f32], op: fn(&[f32], &[f32], &mut [f32])) {
        let out_ptr = SyncPtr(out.as_mut_ptr());
        self.par_ranges(out.len(), 16, out.len(), &|range| {
            // SAFETY: the threads' ranges are disjoint parts of `out`.
            let dst = unsafe {
                std::slice::from_raw_parts_mut(out_ptr.get().add(range.start), range.len())
            };
            op(&gate[range.clone()], &up[range], dst);
        });
    }
}

thread_local! {
    static SCRATCH: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// The CPU backend.
pub struct CpuBackend {
    pool: ThreadPool,
    times: OpTimes,
    /// Quantized copies of the current matmul input, one per activation type, reused
    /// across calls so decode allocates nothing.
    acts: Mutex<Vec<QuantizedActivations>>,
    /// Neuron stores by number ([`NeuronOps`]).
    neurons: RwLock<HashMap<u64, NeuronStore>>,
    /// A neuron MLP's up values, their token-major copy and the hidden values, reused
    /// across calls.
    neuron_scratch: Mutex<(Vec<f32>, Vec<f32>, Vec<f32>)>,
}

impl CpuBackend {
    /// A backend computing with `n_threads` threads (the caller counts as one).
    pub fn new(n_threads: usize) -> CpuBackend {
        CpuBackend {
            pool: ThreadPool::new(n_threads),
            times: OpTimes::default(),
            acts: Mutex::new(Vec::new()),
            neurons: RwLock::default(),
            neuron_scratch: Mutex::default(),
        }
    }

    /// Threads the backend computes with.
    pub fn n_threads(&self) -> usize {
        self.pool.n_threads()
    }

    fn timed<T>(&self, kind: OpKind, f: impl FnOnce() -> T) -> T {
        let start = Instant::now();
        let out = f();
        self.times.add(kind, start.elapsed());
        out
    }
}

impl Backend for CpuBackend {
    fn name(&self) -> String {
        format!(
            "cpu ({}, {} threads)",
            quant::simd_level(),
            self.pool.n_threads()
        )
    }

    fn telemetry(&self) -> &dyn Telemetry {
        &self.times
    }

    fn neurons(&self) -> Option<&dyn NeuronOps> {
        Some(self)
    }
}

impl LinearOps for CpuBackend {
    fn matmul(&self, x: &[f32], n_tokens: usize, jobs: &mut [MatmulJob<'_>]) -> Result<()> {
        let start = Instant::now();
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
        // Quantize the input once per activation type the weights need.
        let mut acts = self.acts.lock().unwrap_or_else(|e| e.into_inner());
        let mut act_index = Vec::with_capacity(jobs.len());
        let mut act_types: Vec<GgmlType> = Vec::new();
        for job in jobs.iter() {
            let at = quant::activation_type(job.weight.ty);
            let i = match act_types.iter().position(|t| *t == at) {
                Some(i) => i,
                None => {
                    if acts.len() <= act_types.len() {
                        acts.push(QuantizedActivations::default());
                    }
                    let slot = act_types.len();
                    quant::quantize_activations(job.weight.ty, x, n_tokens, k, &mut acts[slot])?;
                    act_types.push(at);
                    slot
                }
            };
            act_index.push(i);
        }
        let parts: Vec<RowsPart<'_>> = jobs
            .iter_mut()
            .zip(&act_index)
            .map(|(job, &act)| RowsPart {
                weight: job.weight,
                act,
                out: SyncPtr(job.out.as_mut_ptr()),
                rows: 0..job.weight.rows(),
            })
            .collect();
        let result = self.run_parts(&acts, n_tokens, &parts);
        self.times.add(OpKind::Matmul, start.elapsed());
        result
    }

    fn matmul_rows(
        &self,
        x: &[f32],
        n_tokens: usize,
        weight: &Weight,
        rows: &[std::ops::Range<usize>],
        out: &mut [f32],
    ) -> Result<()> {
        let start = Instant::now();
        check_row_ranges(weight, x.len(), rows, n_tokens, out.len())?;
        let k = weight.cols();
        let mut acts = self.acts.lock().unwrap_or_else(|e| e.into_inner());
        if acts.is_empty() {
            acts.push(QuantizedActivations::default());
        }
        quant::quantize_activations(weight.ty, x, n_tokens, k, &mut acts[0])?;
        let ptr = out.as_mut_ptr();
        let parts: Vec<RowsPart<'_>> = rows
            .iter()
            .filter(|r| !r.is_empty())
            .map(|r| RowsPart {
                weight,
                act: 0,
                out: SyncPtr(ptr),
                rows: r.clone(),
            })
            .collect();
        let result = self.run_parts(&acts, n_tokens, &parts);
        self.times.add(OpKind::Matmul, start.elapsed());
        result
    }

    fn embed(&self, table: &Weight, ids: &[u32], out: &mut [f32]) -> Result<()> {
        self.timed(OpKind::Other, || {
            let cols = table.cols();
            let rows = table.rows();
            let row_bytes = table.row_bytes();
            for (&id, dst) in ids.iter().zip(out.chunks_exact_mut(cols)) {
                let id = id as usize;
                if id >= rows {
                    return Err(Error::TokenId {
                        id: id as u32,
                        vocab: rows,
                    });
                }
                // Row by row: a table decoded on demand produces only the rows asked.
                let src = table
                    .bytes
                    .range_bytes(id * row_bytes..(id + 1) * row_bytes)?;
                quant::dequantize(table.ty, &src, dst)?;
            }
            Ok(())
        })
    }
}

impl NormOps for CpuBackend {
    fn rms_norm(&self, x: &[f32], scale: &[f32], eps: f32, out: &mut [f32]) -> Result<()> {
        check_rows("RMSNorm input", x.len(), scale.len())?;
        check_len("RMSNorm output", x.len(), out.len())?;
        self.timed(OpKind::Other, || {
            let n = scale.len();
            let out_ptr = SyncPtr(out.as_mut_ptr());
            self.par_ranges(x.len() / n.max(1), 1, x.len(), &|rows| {
                // SAFETY: the threads' row ranges are disjoint parts of `out`.
                let dst = unsafe {
                    std::slice::from_raw_parts_mut(
                        out_ptr.get().add(rows.start * n),
                        rows.len() * n,
                    )
                };
                let src = &x[rows.start * n..rows.end * n];
                for (row, dst) in src.chunks_exact(n).zip(dst.chunks_exact_mut(n)) {
                    // Summed in f64 as ggml does, so long rows round the same way.
                    let sum: f64 = row.iter().map(|&v| (v * v) as f64).sum();
                    let inv = 1.0 / ((sum / n as f64) as f32 + eps).sqrt();
                    for ((d, &v), &s) in dst.iter_mut().zip(row).zip(scale) {
                        *d = (v * inv) * s;
                    }
                }
            });
        });
        Ok(())
    }
}

impl RopeOps for CpuBackend {
    fn rope(
        &self,
        x: &mut [f32],
        positions: &[u32],
        n_heads: usize,
        head_dim: usize,
        rope: &Rope,
    ) -> Result<()> {
        check_len("RoPE input", positions.len() * n_heads * head_dim, x.len())?;
        self.timed(OpKind::Other, || {
            elementwise::rope(x, positions, n_heads, head_dim, rope)
        });
        Ok(())
    }
}

impl AttentionOps for CpuBackend {
    fn attention(
        &self,
        q: &[f32],
        q_positions: &[u32],
        kv: &KvView<'_>,
        shape: &AttentionShape,
        out: &mut [f32],
    ) -> Result<()> {
        let n_tokens = q_positions.len();
        // The threads below write `out` through a raw pointer: its length is checked
        // here, once.
        let width = shape.n_heads * shape.head_dim;
        check_len("attention queries", n_tokens * width, q.len())?;
        check_len("attention output", n_tokens * width, out.len())?;
        if shape.n_kv_heads == 0 || shape.n_heads % shape.n_kv_heads != 0 {
            return Err(Error::InvalidArgument {
                what: format!(
                    "{} query heads cannot share {} key/value heads",
                    shape.n_heads, shape.n_kv_heads
                ),
            });
        }
        if n_tokens == 0 {
            return Ok(());
        }
        let start = Instant::now();
        if tiled::takes(n_tokens, kv) {
            self.attention_tiled(q, q_positions, kv, shape, out);
            self.times.add(OpKind::Attention, start.elapsed());
            return Ok(());
        }
        // A query that decoding alone would split (on several threads, over a long
        // enough prefix) is split here too, over the same prefix, whatever the batch:
        // a verification pass of speculative decoding then gives plain decoding's bits.
        // Each query's prefix is found once (finding it walks the positions).
        let prefixes: Vec<_> = if self.pool.n_threads() > 1 {
            q_positions
                .iter()
                .map(|&p| split_prefix(kv, shape, p))
                .collect()
        } else {
            Vec::new()
        };
        if prefixes.iter().any(Option::is_some) {
            for (t, (&p, prefix)) in q_positions.iter().zip(prefixes).enumerate() {
                let rows = t * width..(t + 1) * width;
                match prefix {
                    Some((view, cells)) => self.attention_split(
                        &q[rows.clone()],
                        p,
                        &view,
                        shape,
                        cells,
                        &mut out[rows],
                    ),
                    None => self.attention_items(
                        &q[rows.clone()],
                        &q_positions[t..t + 1],
                        kv,
                        shape,
                        &mut out[rows],
                    ),
                }
            }
        } else {
            self.attention_items(q, q_positions, kv, shape, out);
        }
        self.times.add(OpKind::Attention, start.elapsed());
        Ok(())
    }
}

/// The view a query at `q_pos` attends over when it is split as llama.cpp splits a
/// decoded token's keys, one chunk per thread (`use_split_kv_path`), with its number of
/// cells; `None` where it is not: keys and values both f32 or both f16, no window, and at
/// least [`SPLIT_FROM_CELLS`] cells up to the query's. The cells are those decoding the
/// token alone would have: positions `0..=q_pos`, one segment in order (llama.cpp's cache
/// of one sequence; its chunks of a window's or a ring's cells follow another layout, and
/// those keep the one-thread order). The caller checks that there are several threads.
fn split_prefix<'a>(
    kv: &KvView<'a>,
    shape: &AttentionShape,
    q_pos: u32,
) -> Option<(KvView<'a>, usize)> {
    let [seg] = kv.segments.as_slice() else {
        return None;
    };
    let floats = matches!(
        (seg.keys, seg.values),
        (KvRows::F32(_), KvRows::F32(_)) | (KvRows::F16(_), KvRows::F16(_))
    );
    let cells = q_pos as usize + 1;
    let row_len = shape.n_kv_heads * shape.head_dim;
    let cheap = window_of(shape) == u32::MAX
        && floats
        && cells >= SPLIT_FROM_CELLS
        && split_key_count(cells) >= SPLIT_MIN_KEYS
        && cells <= seg.positions.len()
        && seg.keys.len().min(seg.values.len()) >= cells * row_len;
    // The walk over the positions last: the cheap tests rule out most calls.
    if !cheap
        || !seg.positions[..cells]
            .iter()
            .enumerate()
            .all(|(i, &p)| p as usize == i)
    {
        return None;
    }
    let view = KvView {
        segments: vec![KvSegment {
            keys: float_rows(seg.keys, 0..cells * row_len),
            values: float_rows(seg.values, 0..cells * row_len),
            positions: &seg.positions[..cells],
        }],
    };
    Some((view, cells))
}

/// Elements `range` of f32 or f16 rows (what [`split_prefix`] lets through).
fn float_rows<'a>(rows: KvRows<'a>, range: std::ops::Range<usize>) -> KvRows<'a> {
    match rows {
        KvRows::F32(v) => KvRows::F32(&v[range]),
        KvRows::F16(v) => KvRows::F16(&v[range]),
        KvRows::Q8 { .. } => unreachable!("split_prefix lets only f32 and f16 rows through"),
    }
}

/// Queries per work item of the tiled attention: few enough that a prompt's items
/// spread over the threads (a later block sees more keys), enough that converting a
/// tile's keys and values once serves many queries. 32 against 16: SmolLM2's pp1943 at
/// 589-591 tokens/s instead of 559-570 (AVX2, 2 threads, alternated); 64 was no faster.
const TILED_BLOCK: usize = 32;

thread_local! {
    static TILED_SCRATCH: RefCell<tiled::BlockScratch> = RefCell::new(Default::default());
}

impl CpuBackend {
    /// [`AttentionOps::attention`] of a batch neither tiled nor split: items of one
    /// token x some query heads of one key/value head. `q` and `out` were checked by
    /// the caller.
    fn attention_items(
        &self,
        q: &[f32],
        q_positions: &[u32],
        kv: &KvView<'_>,
        shape: &AttentionShape,
        out: &mut [f32],
    ) {
        let n_tokens = q_positions.len();
        // Items of one token x some query heads of one key/value head (they read its
        // rows once), taken by the threads as they come free, latest tokens first
        // (under a causal mask they attend to the most keys). A group is cut into parts
        // when there would be fewer than two items per thread.
        let n_kv = shape.n_kv_heads;
        let group = shape.n_heads / n_kv;
        let threads = self.pool.n_threads().max(1);
        let parts = (2 * threads).div_ceil(n_tokens * n_kv).clamp(1, group);
        let per_part = group.div_ceil(parts);
        let parts = group.div_ceil(per_part);
        let work = n_tokens * n_kv * parts;
        let out_ptr = SyncPtr(out.as_mut_ptr());
        let hd = shape.head_dim;
        self.run_items(&SCRATCH, work, |item, scratch| {
            let t = n_tokens - 1 - item / (n_kv * parts);
            let (kv_head, part) = ((item / parts) % n_kv, item % parts);
            let first = kv_head * group + part * per_part;
            let heads = first..(first + per_part).min((kv_head + 1) * group);
            let qs: Vec<&[f32]> = heads
                .clone()
                .map(|h| {
                    let off = (t * shape.n_heads + h) * hd;
                    &q[off..off + hd]
                })
                .collect();
            let mut outs: Vec<&mut [f32]> = heads
                .map(|h| {
                    let off = (t * shape.n_heads + h) * hd;
                    // SAFETY: head h of token t belongs to this item alone, and
                    // `out` holds every token's heads (checked above).
                    unsafe { std::slice::from_raw_parts_mut(out_ptr.get().add(off), hd) }
                })
                .collect();
            let slot = slot_of(shape, kv_head);
            attend_heads(
                &qs,
                q_positions[t],
                kv,
                slot,
                shape.scale,
                scratch,
                &mut outs,
            );
        });
    }

    /// [`AttentionOps::attention`] of one query split as llama.cpp splits a decoded token
    /// ([`split_prefix`]): chunk `c` of the `cells` keys ([`split_chunk`], one per thread)
    /// attended by every query head, each key/value head's group reading its rows once,
    /// into a partial per head and chunk; then each head's partials merged in chunk order
    /// ([`merge_partials`]). Each key's row is read once, where the query heads of one
    /// key/value head split over the threads read it once per thread.
    fn attention_split(
        &self,
        q: &[f32],
        q_pos: u32,
        kv: &KvView<'_>,
        shape: &AttentionShape,
        cells: usize,
        out: &mut [f32],
    ) {
        let chunks = self.pool.n_threads();
        let (hd, n_heads, n_kv) = (shape.head_dim, shape.n_heads, shape.n_kv_heads);
        let group = n_heads / n_kv;
        let part = 2 + hd;
        let row_len = n_kv * hd;
        let seg = kv.segments[0];
        // Head h's partial of chunk c at (h * chunks + c) * part.
        let mut partials = vec![0f32; n_heads * chunks * part];
        let partials_ptr = SyncPtr(partials.as_mut_ptr());
        // A chunk per item, every key/value head of it in turn, taken as threads come
        // free. Items of (key/value head, chunk) spread a thread's work over both chunks
        // and were slower: SmolLM2 at depth 4,096 on two threads decoded 74-77 tokens/s
        // against 85-92 (`ballast bench -p 0 -n 32 -d 4096 -r 2 -t 2`, alternated).
        let level = quant::current_simd_level();
        self.run_items(&SCRATCH, chunks, |chunk, scratch| {
            let keys = split_chunk(cells, chunk, chunks);
            let rows = keys.start * row_len..keys.end * row_len;
            let view = KvView {
                segments: vec![KvSegment {
                    keys: float_rows(seg.keys, rows.clone()),
                    values: float_rows(seg.values, rows),
                    positions: &seg.positions[keys],
                }],
            };
            for kv_head in 0..n_kv {
                let heads = kv_head * group..(kv_head + 1) * group;
                let qs: Vec<&[f32]> = heads.clone().map(|h| &q[h * hd..(h + 1) * hd]).collect();
                let mut outs: Vec<&mut [f32]> = heads
                    .map(|h| {
                        // SAFETY: the partial of head h and this chunk belongs to this
                        // item alone, within `partials`.
                        unsafe {
                            std::slice::from_raw_parts_mut(
                                partials_ptr.get().add((h * chunks + chunk) * part),
                                part,
                            )
                        }
                    })
                    .collect();
                attend_heads_to(
                    level,
                    &qs,
                    q_pos,
                    &view,
                    slot_of(shape, kv_head),
                    shape.scale,
                    scratch,
                    &mut outs,
                    Finish::Partial,
                );
            }
        });
        for (h, head_out) in out.chunks_exact_mut(hd).enumerate().take(n_heads) {
            let head = &partials[h * chunks * part..(h + 1) * chunks * part];
            merge_partials(head.chunks_exact(part), head_out);
        }
    }

    /// [`AttentionOps::attention`] of a batch the tiled path takes ([`tiled::takes`]):
    /// items of [`TILED_BLOCK`] tokens x every query head of one key/value head, the
    /// heaviest (latest) first, taken by the threads as they come free. `q` and `out`
    /// were checked by the caller.
    fn attention_tiled(
        &self,
        q: &[f32],
        q_positions: &[u32],
        kv: &KvView<'_>,
        shape: &AttentionShape,
        out: &mut [f32],
    ) {
        let (hd, n_kv) = (shape.head_dim, shape.n_kv_heads);
        let group = shape.n_heads / n_kv;
        let n_tokens = q_positions.len();
        let blocks = n_tokens.div_ceil(TILED_BLOCK);
        let out_ptr = SyncPtr(out.as_mut_ptr());
        let level = crate::quant::current_simd_level();
        self.run_items(&TILED_SCRATCH, blocks * n_kv, |item, scratch| {
            let (block, kv_head) = (blocks - 1 - item / n_kv, item % n_kv);
            let tokens = block * TILED_BLOCK..((block + 1) * TILED_BLOCK).min(n_tokens);
            let heads = kv_head * group..(kv_head + 1) * group;
            let mut queries = Vec::with_capacity(tokens.len() * group);
            let mut positions = Vec::with_capacity(tokens.len() * group);
            let mut outs = Vec::with_capacity(tokens.len() * group);
            for t in tokens {
                for h in heads.clone() {
                    let off = (t * shape.n_heads + h) * hd;
                    queries.push(&q[off..off + hd]);
                    positions.push(q_positions[t]);
                    // SAFETY: head h of token t belongs to this item alone, and
                    // the caller checked that `out` holds every token's heads.
                    outs.push(unsafe {
                        std::slice::from_raw_parts_mut(out_ptr.get().add(off), hd)
                    });
                }
            }
            let slot = slot_of(shape, kv_head);
            tiled::attend_block(
                level,
                &queries,
                &positions,
                kv,
                slot,
                shape.scale,
                scratch,
                &mut outs,
            );
        });
    }

    /// Runs `item(i, scratch)` for every `i` in `0..items` on the pool, each item taken
    /// by the first thread to come free (in order), with that thread's `scratch`; the
    /// threads' wait goes into the op times.
    fn run_items<S: 'static>(
        &self,
        scratch: &'static std::thread::LocalKey<RefCell<S>>,
        items: usize,
        item: impl Fn(usize, &mut S) + Sync,
    ) {
        let next = AtomicUsize::new(0);
        let waited = self.pool.run(&|_, _| {
            scratch.with(|s| {
                let mut s = s.borrow_mut();
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= items {
                        break;
                    }
                    item(i, &mut s);
                }
            });
        });
        if let Some(waited) = waited {
            self.times.add_region_wait(waited);
        }
    }
}

/// Where key/value head `kv_head` of `shape` sits in a cached row.
fn slot_of(shape: &AttentionShape, kv_head: usize) -> HeadSlot {
    HeadSlot {
        offset: kv_head * shape.head_dim,
        row_len: shape.n_kv_heads * shape.head_dim,
        head_dim: shape.head_dim,
        window: window_of(shape),
    }
}

/// The window of `shape` as [`HeadSlot::window`] takes it (`u32::MAX`: none).
fn window_of(shape: &AttentionShape) -> u32 {
    shape
        .window
        .map_or(u32::MAX, |w| u32::try_from(w).unwrap_or(u32::MAX))
}

/// A neuron store of the CPU backend: `capacity` records of `layout` back to back in RAM.
struct NeuronStore {
    layout: NeuronLayout,
    capacity: usize,
    bytes: Vec<u8>,
}

impl CpuBackend {
    /// Bytes of the neuron stores this backend holds ([`NeuronOps::neuron_slots_create`]
    /// until [`NeuronOps::neuron_slots_free`]).
    pub fn neuron_store_bytes(&self) -> u64 {
        self.neurons
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .values()
            .map(|s| s.bytes.len() as u64)
            .sum()
    }

    fn no_store(store: u64) -> Error {
        Error::InvalidArgument {
            what: format!("no neuron store {store} on this backend"),
        }
    }
}

/// Neuron stores in RAM; the MLP over their slots computed on the pool.
impl NeuronOps for CpuBackend {
    fn neuron_slots_create(
        &self,
        store: u64,
        capacity: usize,
        layout: &NeuronLayout,
    ) -> Result<()> {
        layout.check()?;
        let len =
            capacity
                .checked_mul(layout.record_bytes())
                .ok_or_else(|| Error::InvalidArgument {
                    what: format!("{capacity} neuron slots overflow"),
                })?;
        let mut stores = self.neurons.write().unwrap_or_else(|e| e.into_inner());
        // The old store (if any) goes first, so both are never held at once.
        stores.remove(&store);
        stores.insert(
            store,
            NeuronStore {
                layout: *layout,
                capacity,
                bytes: vec![0; len],
            },
        );
        Ok(())
    }

    fn neuron_slots_write(&self, store: u64, slots: &[u32], records: &[u8]) -> Result<()> {
        let mut stores = self.neurons.write().unwrap_or_else(|e| e.into_inner());
        let s = stores
            .get_mut(&store)
            .ok_or_else(|| Self::no_store(store))?;
        let rb = s.layout.record_bytes();
        check_len("neuron records", slots.len() * rb, records.len())?;
        check_slots(slots, s.capacity)?;
        for (&slot, record) in slots.iter().zip(records.chunks_exact(rb)) {
            s.bytes[slot as usize * rb..][..rb].copy_from_slice(record);
        }
        Ok(())
    }

    fn neuron_slots_free(&self, store: u64) {
        self.neurons
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&store);
    }

    fn neuron_mlp(&self, job: NeuronMlpJob<'_>) -> Result<()> {
        let start = Instant::now();
        let stores = self.neurons.read().unwrap_or_else(|e| e.into_inner());
        let store = stores
            .get(&job.store)
            .ok_or_else(|| Self::no_store(job.store))?;
        let layout = store.layout;
        job.check(&layout, store.capacity)?;
        let (n, k, d) = (job.n_tokens, job.slots.len(), layout.n_embd);
        let (rb, up_bytes) = (layout.record_bytes(), layout.up_bytes());
        let record = |i: usize| &store.bytes[job.slots[i] as usize * rb..][..rb];
        let mut scratch = self
            .neuron_scratch
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        let (up, hidden, h) = &mut *scratch;
        up.clear();
        up.resize(k * n, 0.0);
        hidden.clear();
        hidden.resize(k * n, 0.0);
        let failure: Mutex<Option<Error>> = Mutex::new(None);
        let fail = |e: Error| *failure.lock().unwrap_or_else(|e| e.into_inner()) = Some(e);

        // Up: each neuron's row against the input quantized as `matmul` quantizes it,
        // neuron-major (`up[i * n + t]`), the neurons split over the threads.
        {
            let mut acts = self.acts.lock().unwrap_or_else(|e| e.into_inner());
            if acts.is_empty() {
                acts.push(QuantizedActivations::default());
            }
            quant::quantize_activations(layout.up_type, job.x, n, d, &mut acts[0])?;
            let act = &acts[0];
            let up_ptr = SyncPtr(up.as_mut_ptr());
            let waited = self.pool.run(&|thread, n_threads| {
                let mine = split_range(k, 4, thread, n_threads);
                if mine.is_empty() {
                    return;
                }
                // SAFETY: the values of neurons `mine` belong to this thread alone.
                let dst = unsafe {
                    std::slice::from_raw_parts_mut(up_ptr.get().add(mine.start * n), mine.len() * n)
                };
                let first = mine.start;
                let row = |i: usize| &record(first + i)[..up_bytes];
                if let Err(e) = quant::matmul_gathered(layout.up_type, mine.len(), row, d, act, dst)
                {
                    fail(e);
                }
            });
            if let Some(waited) = waited {
                self.times.add_region_wait(waited);
            }
        }
        if let Some(e) = failure.lock().unwrap_or_else(|e| e.into_inner()).take() {
            return Err(e);
        }
        // SwiGLU token-major, as the gate is given, with the dense MLP's roundings; a
        // neuron a token does not keep adds nothing.
        for t in 0..n {
            for i in 0..k {
                hidden[t * k + i] = up[i * n + t];
            }
        }
        h.clear();
        h.resize(k * n, 0.0);
        elementwise::swiglu(job.gate, hidden, h);
        let h: &[f32] = h;
        // Down: each thread owns a range of output columns and adds the neurons' down
        // columns into it in the order given, token by token.
        let out = job.out;
        out.fill(0.0);
        let out_ptr = SyncPtr(out.as_mut_ptr());
        let down_type = layout.down_type;
        let (block_len, block_bytes) = (down_type.block_len(), down_type.block_bytes());
        let keep = job.keep;
        let waited = self.pool.run(&|thread, n_threads| {
            let cols = split_range(d, 32, thread, n_threads);
            if cols.is_empty() {
                return;
            }
            let bytes = cols.start / block_len * block_bytes..cols.end / block_len * block_bytes;
            for i in 0..k {
                let down = &record(i)[up_bytes..][bytes.clone()];
                for t in 0..n {
                    if !keep[t * k + i] {
                        continue;
                    }
                    // SAFETY: columns `cols` of every token belong to this thread alone.
                    let acc = unsafe {
                        std::slice::from_raw_parts_mut(
                            out_ptr.get().add(t * d + cols.start),
                            cols.len(),
                        )
                    };
                    let scale = h[t * k + i];
                    let r = if down_type == GgmlType::Q8_0 {
                        quant::axpy_q8_0(down, scale, acc)
                    } else {
                        axpy_row(down_type, down, scale, acc)
                    };
                    if let Err(e) = r {
                        fail(e);
                        return;
                    }
                }
            }
        });
        if let Some(waited) = waited {
            self.times.add_region_wait(waited);
        }
        self.times.add(OpKind::Matmul, start.elapsed());
        match failure.into_inner().unwrap_or_else(|e| e.into_inner()) {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}

impl ElementwiseOps for CpuBackend {
    fn swiglu(&self, gate: &[f32], up: &[f32], out: &mut [f32]) -> Result<()> {
        check_len("SwiGLU up", gate.len(), up.len())?;
        check_len("SwiGLU output", gate.len(), out.len())?;
        self.timed(OpKind::Other, || {
            self.gated(gate, up, out, elementwise::swiglu)
        });
        Ok(())
    }

    fn geglu(&self, gate: &[f32], up: &[f32], out: &mut [f32]) -> Result<()> {
        check_len("GeGLU up", gate.len(), up.len())?;
        check_len("GeGLU output", gate.len(), out.len())?;
        self.timed(OpKind::Other, || {
            self.gated(gate, up, out, elementwise::geglu)
        });
        Ok(())
    }

    fn scale(&self, x: &mut [f32], factor: f32) -> Result<()> {
        self.timed(OpKind::Other, || x.iter_mut().for_each(|v| *v *= factor));
        Ok(())
    }

    fn add_assign(&self, x: &mut [f32], y: &[f32]) -> Result<()> {
        check_len("addend", x.len(), y.len())?;
        self.timed(OpKind::Other, || {
            for (a, &b) in x.iter_mut().zip(y) {
                *a += b;
            }
        });
        Ok(())
    }
}

/// `got` must be `expected` long.
pub(crate) fn check_len(what: &str, expected: usize, got: usize) -> Result<()> {
    if expected != got {
        return Err(Error::ShapeMismatch {
            what: what.to_string(),
            expected,
            got,
        });
    }
    Ok(())
}

/// `len` must be whole rows of `row` (a non-empty row).
pub(crate) fn check_rows(what: &str, len: usize, row: usize) -> Result<()> {
    if row == 0 || len % row != 0 {
        return Err(Error::ShapeMismatch {
            what: format!("{what} (rows of {row})"),
            expected: len.div_ceil(row.max(1)) * row,
            got: len,
        });
    }
    Ok(())
}
