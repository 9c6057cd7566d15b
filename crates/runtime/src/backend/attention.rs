//! Attention of one query head over the cache, in the float order of llama.cpp's CPU
//! flash-attention kernel (`ggml_compute_forward_flash_attn_ext_f16_one_chunk`, built
//! for AVX-512), so that our logits land on llama.cpp's to the last bit.
//!
//! That kernel, for an f16 cache: rounds the query to f16; takes each score as ggml's
//! f16 dot product (four 16-lane accumulators over steps of 64 elements, one FMA each,
//! reduced pairwise); scales it; runs an online softmax whose running sum of values is
//! kept in f16 (every update `acc = f16(fma(v, w, acc))`, every rescale
//! `acc = f16(acc * m)`); and divides by the running sum at the end (as a multiplication
//! by its inverse). The running sum is updated as `fma(S, ms, vs)`, as gcc contracts it.
//! An f32 cache follows the same steps without the f16 roundings.
//!
//! That is llama.cpp's kernel for batches of fewer than 64 queries (decode among them);
//! from 64 it takes a tiled one, which [`tiled`] follows.
//!
//! [`attend_head_reference`] is the plain statement of it; [`attend_head_at`] picks an
//! AVX2 or NEON version with the same results when the CPU has it (AVX2 keeps ggml's
//! 16-lane accumulators as pairs of 8-lane ones, NEON as quadruples of 4-lane ones, so
//! they add the same lanes in the same order). AVX-512 machines run the AVX2 version: a
//! 16-lane one (removed) was slower on a Zen 4 EPYC, 18.8-19.5 ms of attention per
//! SmolLM2 token at depth 2048 against 15.8-16.1 (`ballast bench -p 0 -n 32 -d 2048 -t
//! 1`, alternated).

use half::f16;

use crate::kv::{KvRows, KvView};

/// Accumulators × lanes of ggml's AVX-512 dot product: one step covers 64 elements.
const STEP: usize = 64;

/// Where one head's keys and values sit in a cache row.
#[derive(Clone, Copy, Debug)]
pub struct HeadSlot {
    /// Offset of the head's first element in a row.
    pub offset: usize,
    /// Elements per cached row (all KV heads).
    pub row_len: usize,
    /// Elements per head.
    pub head_dim: usize,
    /// Sliding window: a query at `p` sees keys at `p - window + 1 ..= p` only
    /// (`u32::MAX`: every key at or before `p`).
    pub window: u32,
}

/// True if a query at `q_pos` skips the key at `p` (later, masked, or out of the
/// window).
#[inline(always)]
fn skipped(p: u32, q_pos: u32, window: u32) -> bool {
    p > q_pos || q_pos - p >= window
}

/// The online softmax's factors of a run of scores, in order: `(ms, 1, true)` where a
/// score raises the running maximum `max` (the sums so far are scaled by `ms`, the key
/// weighs 1), else `(1, vs, false)` (the key's weight). The vector kernels take them in
/// a pass of their own, so that no `expf` call sits among their vector registers.
fn softmax_factors(scores: &[f32], max: &mut f32, factors: &mut [(f32, f32, bool)]) {
    for (&s, f) in scores.iter().zip(factors.iter_mut()) {
        *f = if s > *max {
            let ms = (*max - s).exp();
            *max = s;
            (ms, 1.0, true)
        } else {
            (1.0, (s - *max).exp(), false)
        };
    }
}

fn round_f16(x: f32) -> f32 {
    f16::from_f32(x).to_f32()
}

fn read_row(rows: &KvRows<'_>, start: usize, out: &mut [f32]) {
    rows.read_f32(start, out)
}

/// ggml's AVX-512 `ggml_vec_dot_f16` / `ggml_vec_dot_f32` order, stated lane by lane.
fn dot_reference(x: &[f32], y: &[f32]) -> f32 {
    let n = x.len();
    let np = n - n % STEP;
    let mut acc = [[0f32; 16]; 4];
    for i in (0..np).step_by(STEP) {
        for (j, a) in acc.iter_mut().enumerate() {
            for (l, lane) in a.iter_mut().enumerate() {
                let k = i + 16 * j + l;
                *lane = x[k].mul_add(y[k], *lane);
            }
        }
    }
    // x[0] += x[2]; x[1] += x[3]; x[0] += x[1]; then gcc's _mm512_reduce_add_ps.
    let mut r = [0f32; 16];
    for l in 0..16 {
        r[l] = (acc[0][l] + acc[2][l]) + (acc[1][l] + acc[3][l]);
    }
    let mut t8 = [0f32; 8];
    for i in 0..8 {
        t8[i] = r[i] + r[i + 8];
    }
    let t4: [f32; 4] = std::array::from_fn(|i| t8[i] + t8[i + 4]);
    let mut sum = ((t4[0] + t4[2]) + (t4[1] + t4[3])) as f64;
    for k in np..n {
        sum += (x[k] * y[k]) as f64;
    }
    sum as f32
}

/// The plain statement of the kernel for one query head `q` (at position `q_pos`) over
/// the cached tokens at or before `q_pos`; `out` gets the head's output. `tmp` is
/// scratch of at least `3 * head_dim`.
pub fn attend_head_reference(
    q: &[f32],
    q_pos: u32,
    kv: &KvView<'_>,
    slot: HeadSlot,
    scale: f32,
    tmp: &mut Vec<f32>,
    out: &mut [f32],
) {
    attend_head_reference_to(q, q_pos, kv, slot, scale, tmp, out, Finish::Normalized)
}

/// [`attend_head_reference`] with what it writes chosen by `finish`.
#[allow(clippy::too_many_arguments)]
fn attend_head_reference_to(
    q: &[f32],
    q_pos: u32,
    kv: &KvView<'_>,
    slot: HeadSlot,
    scale: f32,
    tmp: &mut Vec<f32>,
    out: &mut [f32],
    finish: Finish,
) {
    let hd = slot.head_dim;
    tmp.resize(3 * hd, 0.0);
    let (qh, rest) = tmp.split_at_mut(hd);
    let (row, acc) = rest.split_at_mut(hd);
    let half = matches!(kv.segments.first().map(|s| s.keys), Some(KvRows::F16(_)));
    let round = |x: f32| if half { round_f16(x) } else { x };
    for (d, &s) in qh.iter_mut().zip(q) {
        *d = round(s);
    }
    acc.fill(0.0);
    let mut max = f32::NEG_INFINITY;
    let mut sum = 0f32;
    for seg in &kv.segments {
        for (i, &p) in seg.positions.iter().enumerate() {
            if skipped(p, q_pos, slot.window) {
                continue;
            }
            let start = i * slot.row_len + slot.offset;
            read_row(&seg.keys, start, row);
            let s = dot_reference(row, qh) * scale;
            let (mut ms, mut vs) = (1f32, 1f32);
            if s > max {
                ms = (max - s).exp();
                max = s;
                for a in acc.iter_mut() {
                    *a = round(*a * ms);
                }
            } else {
                vs = (s - max).exp();
            }
            read_row(&seg.values, start, row);
            for (a, &v) in acc.iter_mut().zip(row.iter()) {
                *a = round(v.mul_add(vs, *a));
            }
            sum = sum.mul_add(ms, vs);
        }
    }
    finish.write(max, sum, acc.iter().copied(), out);
}

/// What a head's kernel writes when its keys are done.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Finish {
    /// The head's output: the weighted sum of the values times the reciprocal of the sum
    /// of the weights.
    Normalized,
    /// llama.cpp's partial result of a chunk of the keys, `[max, sum, values...]`
    /// (`2 + head_dim` floats; the f16 accumulator as f32), which [`merge_partials`]
    /// combines.
    Partial,
}

impl Finish {
    /// Writes the end state of one head (`max`, `sum`, the accumulator `acc`) to `out`.
    fn write(self, max: f32, sum: f32, acc: impl Iterator<Item = f32>, out: &mut [f32]) {
        match self {
            Finish::Normalized => {
                let inv = if sum == 0.0 { 0.0 } else { 1.0 / sum };
                for (o, a) in out.iter_mut().zip(acc) {
                    *o = a * inv;
                }
            }
            Finish::Partial => {
                out[0] = max;
                out[1] = sum;
                for (o, a) in out[2..].iter_mut().zip(acc) {
                    *o = a;
                }
            }
        }
    }
}

/// Fewest keys (llama.cpp's padded count, [`split_key_count`]) at which a decoded token's
/// attention is split into one chunk of keys per thread, as llama.cpp's
/// `use_split_kv_path`.
pub const SPLIT_MIN_KEYS: usize = 512;

/// Fewest cached cells at which a decoded token's attention is split. llama.cpp splits
/// from 257 ([`SPLIT_MIN_KEYS`] once padded), but cuts its chunks from the padded count,
/// so below some 700 cells the last chunk holds little and the split was slower than
/// handing the query heads to the threads. One layer at SmolLM2's shape, f16 cache larger
/// than the caches, two threads, split against not (`cargo bench --bench attention`,
/// alternated, µs): 28.1 / 22.3 at 400 cells, 38 / 33 at 600, 37 / 44-47 at 768, 57 /
/// 75-84 at 1,100, 105 / 181-201 at 2,000, 257 / 369-385 at 4,100. Between the two, two
/// threads give the one-thread order's bits, not llama.cpp's split ones.
pub const SPLIT_FROM_CELLS: usize = 768;

/// The number of keys llama.cpp's flash attention sees for a cache of `cells` used cells
/// (`llama_kv_cache::get_n_kv`: padded to a multiple of 256, at least 256). The chunks
/// of a split decode are cut from this count; the padding is masked.
pub fn split_key_count(cells: usize) -> usize {
    cells.div_ceil(256).max(1) * 256
}

/// The keys `[start, end)` of chunk `chunk` of `n_chunks` of a split decode over `cells`
/// cached cells (llama.cpp's `chunk_size = ceil(n_kv / nth)`), clipped to the cells:
/// empty where the chunk holds only padding.
pub fn split_chunk(cells: usize, chunk: usize, n_chunks: usize) -> std::ops::Range<usize> {
    let size = split_key_count(cells).div_ceil(n_chunks);
    let start = (chunk * size).min(cells);
    start..((chunk + 1) * size).min(cells)
}

/// Combines the partials of one query head's chunks, in chunk order, into its output:
/// llama.cpp's `ggml_flash_attn_ext_reduce_partials` operation for operation (each sum
/// of two products contracted as gcc does, the first product fused:
/// `fma(acc, scale_old, chunk * scale_new)`). Chunks whose sum is 0 (no key) are skipped.
pub fn merge_partials<'p>(chunks: impl IntoIterator<Item = &'p [f32]>, out: &mut [f32]) {
    let mut max = f32::NEG_INFINITY;
    let mut sum = 0f32;
    out.fill(0.0);
    for partial in chunks {
        let (m, s, acc) = (partial[0], partial[1], &partial[2..]);
        if s == 0.0 {
            continue;
        }
        let new_max = max.max(m);
        let scale_old = (max - new_max).exp();
        let scale_new = (m - new_max).exp();
        for (o, &a) in out.iter_mut().zip(acc) {
            *o = o.mul_add(scale_old, a * scale_new);
        }
        sum = sum.mul_add(scale_old, s * scale_new);
        max = new_max;
    }
    if sum != 0.0 {
        let inv = 1.0 / sum;
        for o in out.iter_mut() {
            *o *= inv;
        }
    }
}

/// [`attend_heads_at`] at the SIMD level in use.
pub(crate) fn attend_heads(
    qs: &[&[f32]],
    q_pos: u32,
    kv: &KvView<'_>,
    slot: HeadSlot,
    scale: f32,
    tmp: &mut Vec<f32>,
    outs: &mut [&mut [f32]],
) {
    let level = crate::quant::current_simd_level();
    attend_heads_at(level, qs, q_pos, kv, slot, scale, tmp, outs)
}

/// True if every segment of `kv` holds a whole row for each of its positions, its keys
/// and values of one type, and `q` and `out` a whole head: what the vector kernels
/// read and write unchecked.
fn fits(q: &[f32], kv: &KvView<'_>, slot: HeadSlot, out: &[f32]) -> bool {
    let head_end = slot.offset + slot.head_dim;
    q.len() >= slot.head_dim
        && out.len() >= slot.head_dim
        && head_end <= slot.row_len
        && kv.segments.iter().all(|seg| {
            let need = seg.positions.len().checked_mul(slot.row_len);
            std::mem::discriminant(&seg.keys) == std::mem::discriminant(&seg.values)
                && need.is_some_and(|n| seg.keys.len() >= n && seg.values.len() >= n)
        })
}

/// [`attend_head_reference`] at `level`, in its float order (same results, bit for
/// bit): the AVX2 version on AVX2 and AVX-512, NEON's on NEON, when the CPU has it
/// and the head size is a multiple of 64 (at most 256), else the reference. A level the
/// CPU lacks runs the reference.
#[allow(clippy::too_many_arguments)]
pub fn attend_head_at(
    level: crate::quant::SimdLevel,
    q: &[f32],
    q_pos: u32,
    kv: &KvView<'_>,
    slot: HeadSlot,
    scale: f32,
    tmp: &mut Vec<f32>,
    out: &mut [f32],
) {
    attend_heads_at(level, &[q], q_pos, kv, slot, scale, tmp, &mut [out])
}

/// [`attend_head_at`] for several query heads that share one key/value head (`slot`):
/// `outs[i]` gets head `qs[i]`'s output, the same bits as each head alone. The AVX2 and
/// NEON versions read each cached row once for all of them.
#[allow(clippy::too_many_arguments)]
pub fn attend_heads_at(
    level: crate::quant::SimdLevel,
    qs: &[&[f32]],
    q_pos: u32,
    kv: &KvView<'_>,
    slot: HeadSlot,
    scale: f32,
    tmp: &mut Vec<f32>,
    outs: &mut [&mut [f32]],
) {
    attend_heads_to(
        level,
        qs,
        q_pos,
        kv,
        slot,
        scale,
        tmp,
        outs,
        Finish::Normalized,
    )
}

/// [`attend_heads_at`] with what each head writes chosen by `finish`
/// ([`Finish::Partial`]: `outs[i]` holds `2 + head_dim` floats).
#[allow(clippy::too_many_arguments)]
pub fn attend_heads_to(
    level: crate::quant::SimdLevel,
    qs: &[&[f32]],
    q_pos: u32,
    kv: &KvView<'_>,
    slot: HeadSlot,
    scale: f32,
    tmp: &mut Vec<f32>,
    outs: &mut [&mut [f32]],
    finish: Finish,
) {
    assert_eq!(qs.len(), outs.len(), "one output per query head");
    let out_len = match finish {
        Finish::Normalized => slot.head_dim,
        Finish::Partial => 2 + slot.head_dim,
    };
    assert!(
        outs.iter().all(|o| o.len() >= out_len),
        "each output holds {out_len} floats"
    );
    let all_fit = || {
        qs.iter()
            .zip(outs.iter())
            .all(|(q, o)| fits(q, kv, slot, o))
    };
    #[cfg(target_arch = "x86_64")]
    {
        use crate::quant::SimdLevel;
        let vector = slot.head_dim % STEP == 0
            && slot.head_dim <= x86::MAX_HEAD
            && level.is_supported()
            && matches!(level, SimdLevel::Avx2 | SimdLevel::Avx512)
            && all_fit();
        if vector {
            // SAFETY: AVX2 (with FMA and F16C) support was just checked, and `fits`
            // that every row read and every head written are in bounds.
            unsafe { x86::attend_heads_avx2(qs, q_pos, kv, slot, scale, outs, finish) };
            return;
        }
    }
    #[cfg(target_arch = "aarch64")]
    if level == crate::quant::SimdLevel::Neon
        && slot.head_dim % STEP == 0
        && slot.head_dim <= arm::MAX_HEAD
        && level.is_supported()
        && all_fit()
    {
        // SAFETY: NEON support was just checked, and `fits` that every row read and
        // every head written are in bounds.
        unsafe { arm::attend_heads_neon(qs, q_pos, kv, slot, scale, outs, finish) };
        return;
    }
    #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
    let _ = (level, all_fit);
    for (q, out) in qs.iter().zip(outs.iter_mut()) {
        attend_head_reference_to(q, q_pos, kv, slot, scale, tmp, out, finish)
    }
}

#[cfg(target_arch = "aarch64")]
mod arm;
pub(crate) mod tiled;

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::{Finish, HeadSlot};
    use crate::kv::{KvRows, KvView, Q8_BLOCK};

    /// Largest head size of the vector paths.
    pub(super) const MAX_HEAD: usize = 256;
    /// Most 8-lane vectors a head holds on the AVX2 path.
    const MAX_VECS8: usize = MAX_HEAD / 8;
    /// Keys per run of [`segment`]'s three passes. Short runs: with 256, one layer at
    /// SmolLM2's shape over 4,100 keys took 455 µs on one thread, with 8 340 (64: 419,
    /// 16: 348, 4: 346, 2: 375; `cargo bench --bench attention`), and SmolLM2 at depth
    /// 4,096 decoded 66-69 tokens/s instead of 53 (`ballast bench -p 0 -n 32 -d 4096`,
    /// alternated).
    const RUN: usize = 8;

    /// Rows of one element type, read eight elements at a time (one code path per type,
    /// so the kernel's loop holds no match).
    trait Rows8: Copy {
        /// Elements `at..at + 8` as f32.
        ///
        /// # Safety
        /// `at + 8` is within the rows, and the CPU has AVX2 and F16C.
        unsafe fn load8(self, at: usize) -> __m256;
    }

    impl Rows8 for &[f32] {
        #[inline]
        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn load8(self, at: usize) -> __m256 {
            // SAFETY: the caller keeps `at + 8` within the rows.
            unsafe { _mm256_loadu_ps(self.as_ptr().add(at)) }
        }
    }

    impl Rows8 for &[half::f16] {
        #[inline]
        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn load8(self, at: usize) -> __m256 {
            // SAFETY: the caller keeps `at + 8` within the rows and the CPU has F16C.
            unsafe { _mm256_cvtph_ps(_mm_loadu_si128(self.as_ptr().add(at) as *const __m128i)) }
        }
    }

    /// int8 rows and their scales.
    #[derive(Clone, Copy)]
    struct Q8Rows<'a>(&'a [i8], &'a [half::f16]);

    impl Rows8 for Q8Rows<'_> {
        #[inline]
        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn load8(self, at: usize) -> __m256 {
            // SAFETY: the caller keeps `at + 8` within the rows and the CPU has AVX2.
            // Eight elements never straddle two scales: heads start on multiples of 64 on
            // this path, and blocks are 32 long.
            unsafe {
                let q = _mm256_cvtepi8_epi32(_mm_loadl_epi64(
                    self.0.as_ptr().add(at) as *const __m128i
                ));
                let d = _mm256_set1_ps(self.1[at / Q8_BLOCK].to_f32());
                _mm256_mul_ps(_mm256_cvtepi32_ps(q), d)
            }
        }
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn round8(x: __m256, half: bool) -> __m256 {
        if half {
            _mm256_cvtph_ps(_mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(x))
        } else {
            x
        }
    }

    /// The state of one head's online softmax: the query, the running sum of values, the
    /// running maximum and the running sum of weights.
    struct State<const NV: usize> {
        q: [__m256; NV],
        acc: [__m256; NV],
        max: f32,
        sum: f32,
    }

    /// The keys of one segment against the state, `NV` vectors of 8 per head.
    #[allow(clippy::too_many_arguments)]
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn segment<const NV: usize, R: Rows8>(
        states: &mut [State<NV>],
        keys: R,
        values: R,
        positions: &[u32],
        q_pos: u32,
        slot: HeadSlot,
        scale: f32,
        half: bool,
    ) {
        let zero = _mm256_setzero_ps();
        // Three passes over each run of keys, so that no `expf` call sits between the
        // vector state and its registers (a call clobbers every vector register): the
        // scores; then, in order, the running maximum and each key's two factors; then
        // the sums. Each key's and value's row is read once for every head of the group
        // (they share it). The same operations in the same order as one head alone in
        // one pass.
        let g = states.len();
        let mut scores = vec![0f32; g * RUN];
        let mut factors = vec![(1f32, 1f32, false); g * RUN];
        let mut rows = [0usize; RUN];
        for run in (0..positions.len()).step_by(RUN) {
            let mut n = 0;
            for (i, &p) in positions.iter().enumerate().skip(run).take(RUN) {
                if super::skipped(p, q_pos, slot.window) {
                    continue;
                }
                let start = i * slot.row_len + slot.offset;
                // SAFETY: the segment holds this row (checked by the dispatcher).
                let k: [__m256; NV] = std::array::from_fn(|j| unsafe { keys.load8(start + 8 * j) });
                for (h, st) in states.iter().enumerate() {
                    let mut s8 = [zero; 8];
                    for j in 0..NV {
                        s8[j % 8] = _mm256_fmadd_ps(k[j], st.q[j], s8[j % 8]);
                    }
                    // The halves of (acc0 + acc2) + (acc1 + acc3), then lower + upper half.
                    let lo =
                        _mm256_add_ps(_mm256_add_ps(s8[0], s8[4]), _mm256_add_ps(s8[2], s8[6]));
                    let hi =
                        _mm256_add_ps(_mm256_add_ps(s8[1], s8[5]), _mm256_add_ps(s8[3], s8[7]));
                    let t8 = _mm256_add_ps(lo, hi);
                    let t4 = _mm_add_ps(_mm256_castps256_ps128(t8), _mm256_extractf128_ps::<1>(t8));
                    let t2 = _mm_add_ps(t4, _mm_movehl_ps(t4, t4));
                    scores[h * RUN + n] =
                        _mm_cvtss_f32(_mm_add_ss(t2, _mm_movehdup_ps(t2))) * scale;
                }
                rows[n] = start;
                n += 1;
            }
            for (h, st) in states.iter_mut().enumerate() {
                let span = h * RUN..h * RUN + n;
                super::softmax_factors(&scores[span.clone()], &mut st.max, &mut factors[span]);
            }
            for (m, &start) in rows.iter().enumerate().take(n) {
                // SAFETY: the segment holds this row (checked by the dispatcher).
                let v: [__m256; NV] =
                    std::array::from_fn(|j| unsafe { values.load8(start + 8 * j) });
                for (h, st) in states.iter_mut().enumerate() {
                    let (ms, vs, rescale) = factors[h * RUN + m];
                    if rescale {
                        let f = _mm256_set1_ps(ms);
                        for a in st.acc.iter_mut() {
                            *a = round8(_mm256_mul_ps(*a, f), half);
                        }
                    }
                    let w = _mm256_set1_ps(vs);
                    for (a, &v) in st.acc.iter_mut().zip(&v) {
                        *a = round8(_mm256_fmadd_ps(v, w, *a), half);
                    }
                    st.sum = st.sum.mul_add(ms, vs);
                }
            }
        }
    }

    /// ggml's AVX-512 kernel eight lanes at a time: its four 16-lane accumulators
    /// are eight 8-lane ones (accumulator `j` of 16 lanes is the pair `2j`, `2j + 1`),
    /// so vector `j` of the head goes into accumulator `j % 8`, and the reduction adds
    /// the same lanes in the same order as `_mm512_reduce_add_ps`. One code path per
    /// head size and element type, so the state stays in registers where it fits.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn attend_heads_avx2(
        qs: &[&[f32]],
        q_pos: u32,
        kv: &KvView<'_>,
        slot: HeadSlot,
        scale: f32,
        outs: &mut [&mut [f32]],
        finish: Finish,
    ) {
        // SAFETY: the caller's contract, passed on; `heads` takes only these sizes.
        unsafe {
            match slot.head_dim / 8 {
                8 => heads::<8>(qs, q_pos, kv, slot, scale, outs, finish),
                16 => heads::<16>(qs, q_pos, kv, slot, scale, outs, finish),
                24 => heads::<24>(qs, q_pos, kv, slot, scale, outs, finish),
                _ => heads::<{ MAX_VECS8 }>(qs, q_pos, kv, slot, scale, outs, finish),
            }
        }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn heads<const NV: usize>(
        qs: &[&[f32]],
        q_pos: u32,
        kv: &KvView<'_>,
        slot: HeadSlot,
        scale: f32,
        outs: &mut [&mut [f32]],
        finish: Finish,
    ) {
        debug_assert!(slot.head_dim == 8 * NV && NV <= MAX_VECS8);
        let half = matches!(kv.segments.first().map(|s| s.keys), Some(KvRows::F16(_)));
        let zero = _mm256_setzero_ps();
        let mut states: Vec<State<NV>> = qs
            .iter()
            .map(|q| State::<NV> {
                q: std::array::from_fn(|j| {
                    // SAFETY: q holds hd values (the caller's contract).
                    let v = unsafe { _mm256_loadu_ps(q.as_ptr().add(8 * j)) };
                    round8(v, half)
                }),
                acc: [zero; NV],
                max: f32::NEG_INFINITY,
                sum: 0.0,
            })
            .collect();
        for seg in &kv.segments {
            let (pos, sl, st) = (seg.positions, slot, &mut states[..]);
            // SAFETY: the dispatcher checked that every segment holds its rows.
            unsafe {
                match (seg.keys, seg.values) {
                    (KvRows::F32(k), KvRows::F32(v)) => {
                        segment(st, k, v, pos, q_pos, sl, scale, half)
                    }
                    (KvRows::F16(k), KvRows::F16(v)) => {
                        segment(st, k, v, pos, q_pos, sl, scale, half)
                    }
                    (
                        KvRows::Q8 {
                            quants: kq,
                            scales: ks,
                        },
                        KvRows::Q8 {
                            quants: vq,
                            scales: vs,
                        },
                    ) => segment(
                        st,
                        Q8Rows(kq, ks),
                        Q8Rows(vq, vs),
                        pos,
                        q_pos,
                        sl,
                        scale,
                        half,
                    ),
                    // Keys and values of two types: the dispatcher sent such a view to
                    // the reference.
                    _ => unreachable!("keys and values of one segment differ in type"),
                }
            }
        }
        for (st, out) in states.iter().zip(outs.iter_mut()) {
            if finish == Finish::Partial {
                let mut acc = [0f32; MAX_HEAD];
                for (j, a) in st.acc.iter().enumerate() {
                    // SAFETY: 8 * NV <= MAX_HEAD floats.
                    unsafe { _mm256_storeu_ps(acc.as_mut_ptr().add(8 * j), *a) };
                }
                finish.write(st.max, st.sum, acc[..8 * NV].iter().copied(), out);
                continue;
            }
            let inv = _mm256_set1_ps(if st.sum == 0.0 { 0.0 } else { 1.0 / st.sum });
            for (j, a) in st.acc.iter().enumerate() {
                // SAFETY: out holds hd values (the caller's contract).
                unsafe { _mm256_storeu_ps(out.as_mut_ptr().add(8 * j), _mm256_mul_ps(*a, inv)) };
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::{KvElement, KvSegment, Q8_BLOCK};

    fn lcg(seed: &mut u64) -> f32 {
        *seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((*seed >> 40) as f32 / (1u64 << 24) as f32) * 4.0 - 2.0
    }

    /// Blocks of 32: scale `amax / 127`, quants rounded to nearest.
    fn quantize_q8(x: &[f32]) -> (Vec<i8>, Vec<f16>) {
        let mut q = Vec::with_capacity(x.len());
        let mut s = Vec::new();
        for b in x.chunks(Q8_BLOCK) {
            let amax = b.iter().fold(0f32, |m, v| m.max(v.abs()));
            let d = f16::from_f32(amax / 127.0);
            let inv = if d.to_f32() == 0.0 {
                0.0
            } else {
                1.0 / d.to_f32()
            };
            q.extend(
                b.iter()
                    .map(|v| (v * inv).round().clamp(-127.0, 127.0) as i8),
            );
            s.push(d);
        }
        (q, s)
    }

    /// The kernel of every level this CPU has equals the reference bit for bit, for f16,
    /// f32 and int8 caches, several head sizes, grouped heads, masked (future) positions
    /// and a sliding window.
    #[test]
    fn dispatched_kernel_equals_reference() {
        let mut seed = 7u64;
        for hd in [64usize, 128, 48] {
            for dtype in [KvElement::F16, KvElement::F32, KvElement::Q8] {
                let (n_tok, n_kv) = (37usize, 2usize);
                let row_len = n_kv * hd;
                let k: Vec<f32> = (0..n_tok * row_len).map(|_| lcg(&mut seed)).collect();
                let v: Vec<f32> = (0..n_tok * row_len).map(|_| lcg(&mut seed)).collect();
                let q: Vec<f32> = (0..hd).map(|_| lcg(&mut seed) * 3.0).collect();
                let (k16, v16): (Vec<f16>, Vec<f16>) = (
                    k.iter().map(|&x| f16::from_f32(x)).collect(),
                    v.iter().map(|&x| f16::from_f32(x)).collect(),
                );
                let positions: Vec<u32> = (0..n_tok as u32).collect();
                let (kq, ks) = quantize_q8(&k);
                let (vq, vs) = quantize_q8(&v);
                let (keys, values) = match dtype {
                    KvElement::F16 => (KvRows::F16(&k16), KvRows::F16(&v16)),
                    KvElement::F32 => (KvRows::F32(&k), KvRows::F32(&v)),
                    KvElement::Q8 => (
                        KvRows::Q8 {
                            quants: &kq,
                            scales: &ks,
                        },
                        KvRows::Q8 {
                            quants: &vq,
                            scales: &vs,
                        },
                    ),
                };
                let view = KvView {
                    segments: vec![KvSegment {
                        keys,
                        values,
                        positions: &positions,
                    }],
                };
                for kv_head in 0..n_kv {
                    let slot = HeadSlot {
                        offset: kv_head * hd,
                        row_len,
                        head_dim: hd,
                        window: u32::MAX,
                    };
                    for window in [u32::MAX, 9] {
                        let slot = HeadSlot { window, ..slot };
                        let mut a = vec![f32::NAN; hd];
                        let mut tmp = Vec::new();
                        attend_head_reference(&q, 30, &view, slot, 0.125, &mut tmp, &mut a);
                        assert!(a.iter().all(|x| x.is_finite()));
                        for level in crate::quant::available_simd_levels() {
                            let mut b = vec![f32::NAN; hd];
                            attend_head_at(level, &q, 30, &view, slot, 0.125, &mut tmp, &mut b);
                            assert_eq!(
                                a.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                                b.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                                "head_dim {hd}, {dtype:?}, window {window}, {level:?}"
                            );
                        }
                    }
                }
            }
        }
    }
}
