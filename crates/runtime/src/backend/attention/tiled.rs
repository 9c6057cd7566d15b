//! Attention of a prompt's queries in the float order of llama.cpp's tiled CPU flash
//! attention (`ggml_compute_forward_flash_attn_ext_tiled`, built for AVX-512), which
//! llama.cpp takes for a batch of at least [`TILED_MIN_QUERIES`] queries over an f32 or
//! f16 cache; fewer queries (decode among them) take the one-query kernel of
//! [`super::attend_head_reference`].
//!
//! For one query that kernel: keeps the query and a running sum of values in f32; cuts
//! the cached rows into tiles of [`KV_TILE`] (from the first row of the view); per tile
//! that the query sees at least one key of, takes each score as one FMA chain over the
//! head (`simd_gemm`), times the scale, masked keys `-inf`; takes the tile's maximum,
//! and when it raises the running maximum rescales the sum of values and of weights by
//! `expf` of the difference; turns the scores into weights with ggml's vector `expf`
//! (`ggml_v_expf`, AVX-512 form, as SiLU takes it) and adds their total to the running
//! sum in f64 (sixteen lanes at a time, each group summed as `_mm512_reduce_add_ps`
//! does); adds the weighted values to the running sum with one FMA chain over the tile's
//! rows (`simd_gemm` again); and at the end multiplies by the inverse of the sum.
//!
//! Against the one-query kernel it needs no f16 rounding per key and no `expf` call per
//! key, and a tile's keys and values are converted once for every query of a block:
//! [`attend_block`] computes a block of queries of every head that shares a key/value
//! head, with AVX2 or NEON where the CPU has it (same results, bit for bit), else the
//! reference ([`attend_tiled_reference`]); AVX-512 takes four queries at a time and
//! AVX2 three, each tile's keys and values read once for them: an 8B-shaped model's
//! 1,999-token prompt at 49-51 tokens/s instead of 47-48, SmolLM2's 1,943-token one at
//! 920-940 instead of 798-812, at AVX2 605-612 instead of 551-576 (`ballast bench -p
//! 1999 -n 0`, `ballast run -c 4096 -n 1`, 2 threads, alternated, a Zen 4 EPYC).

use crate::kv::{KvRows, KvView, MASKED_POSITION};
use crate::quant::SimdLevel;

use super::{skipped, HeadSlot};
use crate::backend::elementwise::expf_ggml;

/// Queries in one batch from which llama.cpp's CPU flash attention takes the tiled path
/// (its `GGML_FA_TILE_Q`).
pub const TILED_MIN_QUERIES: usize = 64;

/// Cached rows per tile (llama.cpp's `GGML_FA_TILE_KV`).
pub const KV_TILE: usize = 64;

/// Sixteen lanes summed in the order of gcc's `_mm512_reduce_add_ps`: halves, then
/// quarters, then `(0 + 2) + (1 + 3)`.
fn reduce_add16(v: &[f32]) -> f32 {
    let t8: [f32; 8] = std::array::from_fn(|i| v[i] + v[i + 8]);
    let t4: [f32; 4] = std::array::from_fn(|i| t8[i] + t8[i + 4]);
    (t4[0] + t4[2]) + (t4[1] + t4[3])
}

/// One cached row of the view: its keys and values and where the head starts in them,
/// and its position.
#[derive(Clone, Copy)]
struct Row<'a> {
    keys: KvRows<'a>,
    values: KvRows<'a>,
    start: usize,
    pos: u32,
}

/// The view's rows in order, cut into tiles of [`KV_TILE`].
fn tiles<'a>(kv: &KvView<'a>, slot: HeadSlot) -> Vec<Vec<Row<'a>>> {
    let rows = kv.segments.iter().flat_map(|seg| {
        seg.positions.iter().enumerate().map(move |(i, &pos)| Row {
            keys: seg.keys,
            values: seg.values,
            start: i * slot.row_len + slot.offset,
            pos,
        })
    });
    let mut tiles = Vec::new();
    let mut tile = Vec::with_capacity(KV_TILE);
    for row in rows {
        tile.push(row);
        if tile.len() == KV_TILE {
            tiles.push(std::mem::replace(&mut tile, Vec::with_capacity(KV_TILE)));
        }
    }
    if !tile.is_empty() {
        tiles.push(tile);
    }
    tiles
}

/// How much of a tile a query sees.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Sight {
    /// No key.
    None,
    /// Some keys.
    Some,
    /// Every row (no masked slot, none later than the query or out of its window).
    All,
}

/// The positions a tile spans, to tell most queries' [`Sight`] without a look at every
/// row.
struct TileSpan {
    min: u32,
    max: u32,
    masked: bool,
}

impl TileSpan {
    fn of(tile: &[Row<'_>]) -> TileSpan {
        let live = tile.iter().map(|r| r.pos).filter(|&p| p != MASKED_POSITION);
        TileSpan {
            min: live.clone().min().unwrap_or(u32::MAX),
            max: live.max().unwrap_or(0),
            masked: tile.iter().any(|r| r.pos == MASKED_POSITION),
        }
    }

    /// What a query at `q_pos` sees of `tile`, with a sliding window `window`.
    fn sight(&self, tile: &[Row<'_>], q_pos: u32, window: u32) -> Sight {
        if !self.masked && self.max <= q_pos && q_pos - self.min < window {
            Sight::All
        } else if tile.iter().any(|r| !skipped(r.pos, q_pos, window)) {
            Sight::Some
        } else {
            Sight::None
        }
    }
}

/// The running state of one query beside its sum of weighted values: its maximum score
/// and sum of weights.
#[derive(Clone, Copy)]
struct Running {
    max: f32,
    sum: f32,
}

impl Running {
    const START: Running = Running {
        max: f32::NEG_INFINITY,
        sum: 0.0,
    };

    /// Takes a tile's masked, scaled scores (`-inf` where masked or past the tile's
    /// rows): raises the maximum (rescaling `acc`, the sum of values, and the sum of
    /// weights) and turns the scores into weights, in place, adding their total to the
    /// sum. False if the query sees no key of the tile (nothing changes).
    fn weigh(&mut self, acc: &mut [f32], scores: &mut [f32; KV_TILE], level: SimdLevel) -> bool {
        let tile_max = scores
            .iter()
            .fold(f32::NEG_INFINITY, |m, &s| if m > s { m } else { s });
        if tile_max == f32::NEG_INFINITY {
            return false;
        }
        let new_max = self.max.max(tile_max);
        if new_max > self.max {
            let ms = (self.max - new_max).exp();
            for a in acc.iter_mut() {
                *a *= ms;
            }
            self.sum *= ms;
        }
        self.max = new_max;
        let total = exp_scores(scores, new_max, level);
        self.sum = (self.sum as f64 + total) as f32;
        true
    }

    /// The output: the sum of values `acc` times the inverse of the sum of weights.
    fn finish(&self, acc: &[f32], out: &mut [f32]) {
        let inv = if self.sum == 0.0 { 0.0 } else { 1.0 / self.sum };
        for (o, &a) in out.iter_mut().zip(acc.iter()) {
            *o = a * inv;
        }
    }
}

/// `scores[i] = expf_ggml(scores[i] - max)`, returning their total as
/// `ggml_vec_soft_max_f32` sums it (groups of sixteen, each reduced in f32, added in
/// f64).
fn exp_scores(scores: &mut [f32; KV_TILE], max: f32, level: SimdLevel) -> f64 {
    #[cfg(target_arch = "x86_64")]
    if matches!(level, SimdLevel::Avx2 | SimdLevel::Avx512) && level.is_supported() {
        // SAFETY: AVX2, FMA and F16C were just checked.
        return unsafe { x86::exp_scores(scores, max) };
    }
    #[cfg(target_arch = "aarch64")]
    if level == SimdLevel::Neon && level.is_supported() {
        // SAFETY: NEON was just checked.
        return unsafe { arm::exp_scores(scores, max) };
    }
    let _ = level;
    let mut total = 0f64;
    for group in scores.chunks_exact_mut(16) {
        for s in group.iter_mut() {
            *s = expf_ggml(*s - max);
        }
        total += reduce_add16(group) as f64;
    }
    total
}

/// The scaled, masked scores of query `q` (at `q_pos`) against one tile.
fn scores_reference(
    q: &[f32],
    q_pos: u32,
    tile: &[Row<'_>],
    slot: HeadSlot,
    scale: f32,
    row: &mut [f32],
) -> [f32; KV_TILE] {
    let mut scores = [f32::NEG_INFINITY; KV_TILE];
    for (s, r) in scores.iter_mut().zip(tile) {
        if skipped(r.pos, q_pos, slot.window) {
            continue;
        }
        r.keys.read_f32(r.start, row);
        let dot = q
            .iter()
            .zip(row.iter())
            .fold(0f32, |acc, (&a, &b)| a.mul_add(b, acc));
        // `+ 0.0`: the mask's zero, as ggml adds it.
        *s = dot * scale + 0.0;
    }
    scores
}

/// The plain statement of the tiled kernel for one query head `q` (at `q_pos`); `out`
/// gets the head's output. `tmp` is scratch.
pub fn attend_tiled_reference(
    q: &[f32],
    q_pos: u32,
    kv: &KvView<'_>,
    slot: HeadSlot,
    scale: f32,
    tmp: &mut Vec<f32>,
    out: &mut [f32],
) {
    let hd = slot.head_dim;
    tmp.resize(2 * hd, 0.0);
    let (acc, row) = tmp.split_at_mut(hd);
    acc.fill(0.0);
    let mut run = Running::START;
    for tile in tiles(kv, slot) {
        let mut scores = scores_reference(&q[..hd], q_pos, &tile, slot, scale, row);
        if !run.weigh(acc, &mut scores, SimdLevel::Scalar) {
            continue;
        }
        // Every row of the tile, a masked one with weight 0, as ggml's product does.
        for (&w, r) in scores.iter().zip(&tile) {
            r.values.read_f32(r.start, row);
            for (a, &v) in acc.iter_mut().zip(row.iter()) {
                *a = w.mul_add(v, *a);
            }
        }
    }
    run.finish(acc, &mut out[..hd]);
}

/// Whether the tiled path takes a batch of `n_queries` over `kv`: llama.cpp's rule (at
/// least [`TILED_MIN_QUERIES`] queries, keys and values f32 or f16 alike).
pub fn takes(n_queries: usize, kv: &KvView<'_>) -> bool {
    n_queries >= TILED_MIN_QUERIES
        && kv.segments.iter().all(|s| {
            matches!(
                (s.keys, s.values),
                (KvRows::F32(_), KvRows::F32(_)) | (KvRows::F16(_), KvRows::F16(_))
            )
        })
}

/// Scratch of [`attend_block`], reused across calls.
#[derive(Default)]
pub struct BlockScratch {
    /// The tile's keys, transposed: element `d` of row `j` at `d * KV_TILE + j`.
    keys_t: Vec<f32>,
    /// The tile's values, row-major.
    values: Vec<f32>,
    /// Each query's running sum of values.
    acc: Vec<f32>,
    /// Each query's scores against the tile, then its weights.
    scores: Vec<[f32; KV_TILE]>,
    /// A row read from the cache.
    row: Vec<f32>,
}

/// Queries `queries[i]` (one head each, at `positions[i]`) against one key/value head
/// of `kv` (`slot`), in the tiled order at `level`: AVX2 (on AVX2 and AVX-512) where
/// the CPU has it and the head size is a multiple of 8, NEON where it is a multiple of
/// 4, else the reference. `out[i]`
/// gets query `i`'s output. The tile's keys and values are converted once for all
/// queries.
#[allow(clippy::too_many_arguments)]
pub fn attend_block(
    level: SimdLevel,
    queries: &[&[f32]],
    positions: &[u32],
    kv: &KvView<'_>,
    slot: HeadSlot,
    scale: f32,
    scratch: &mut BlockScratch,
    out: &mut [&mut [f32]],
) {
    let hd = slot.head_dim;
    let n = queries.len();
    assert!(positions.len() == n && out.len() == n);
    assert!(queries.iter().all(|q| q.len() >= hd) && out.iter().all(|o| o.len() >= hd));
    let vector = level.is_supported()
        && ((cfg!(target_arch = "x86_64")
            && matches!(level, SimdLevel::Avx2 | SimdLevel::Avx512)
            && hd % 8 == 0)
            || (cfg!(target_arch = "aarch64") && level == SimdLevel::Neon && hd % 4 == 0));
    // Queries a pass of the vector kernels takes: AVX-512 four, AVX2 three (what its 16
    // registers hold), so a tile's keys and values (64 KiB at a head of 128) are read
    // once for several queries, not once for each.
    let group = if !cfg!(target_arch = "x86_64") || !vector {
        1
    } else if level == SimdLevel::Avx512 && hd % 16 == 0 {
        4
    } else {
        3
    };
    let BlockScratch {
        keys_t,
        values,
        acc,
        scores,
        row,
    } = scratch;
    keys_t.resize(hd * KV_TILE, 0.0);
    values.resize(hd * KV_TILE, 0.0);
    row.resize(hd, 0.0);
    acc.clear();
    acc.resize(n * hd, 0.0);
    scores.resize(n, [0.0; KV_TILE]);
    let mut runs = vec![Running::START; n];
    let mut seen = Vec::with_capacity(n);
    let mut live = Vec::with_capacity(n);
    let mut weighed = Vec::with_capacity(n);
    for tile in tiles(kv, slot) {
        let span = TileSpan::of(&tile);
        seen.clear();
        seen.extend(positions.iter().map(|&p| span.sight(&tile, p, slot.window)));
        live.clear();
        live.extend((0..n).filter(|&i| seen[i] != Sight::None));
        if live.is_empty() {
            continue;
        }
        for (j, r) in tile.iter().enumerate() {
            r.keys.read_f32(r.start, row);
            for (d, &k) in row.iter().enumerate() {
                keys_t[d * KV_TILE + j] = k;
            }
            r.values
                .read_f32(r.start, &mut values[j * hd..(j + 1) * hd]);
        }
        // Scaled, plus the mask's zero.
        scores_of(vector, group, queries, hd, &live, keys_t, scale, scores);
        weighed.clear();
        for &i in &live {
            let s = &mut scores[i];
            // The keys the query does not see.
            s[tile.len()..].fill(f32::NEG_INFINITY);
            if seen[i] == Sight::Some {
                for (s, r) in s.iter_mut().zip(&tile) {
                    if skipped(r.pos, positions[i], slot.window) {
                        *s = f32::NEG_INFINITY;
                    }
                }
            }
            if runs[i].weigh(&mut acc[i * hd..(i + 1) * hd], s, level) {
                weighed.push(i);
            }
        }
        add_weighted_of(vector, group, acc, hd, &weighed, scores, values, tile.len());
    }
    for (i, o) in out.iter_mut().enumerate() {
        runs[i].finish(&acc[i * hd..(i + 1) * hd], &mut o[..hd]);
    }
}

/// The scores of queries `which` (heads of `hd`) against the tile's transposed keys
/// into `scores`: `group` at a time (4: AVX-512, 3: AVX2, as the caller checked), else
/// one at a time ([`scores_at`]).
#[allow(clippy::too_many_arguments)]
fn scores_of(
    vector: bool,
    group: usize,
    queries: &[&[f32]],
    hd: usize,
    which: &[usize],
    keys_t: &[f32],
    scale: f32,
    scores: &mut [[f32; KV_TILE]],
) {
    let grouped = if group > 1 {
        which.len() / group * group
    } else {
        0
    };
    #[cfg(target_arch = "x86_64")]
    for g in which[..grouped].chunks_exact(group) {
        assert!(keys_t.len() >= hd * KV_TILE);
        if let [a, b, c, d] = *g {
            let q = [a, b, c, d].map(|i| &queries[i][..hd]);
            // SAFETY: the caller checked AVX-512 (a group of 4); the transposed keys
            // hold `hd` rows of KV_TILE (asserted), each query `hd` values.
            let s = unsafe { x86::scores4(q, keys_t, scale) };
            for (&i, s) in g.iter().zip(s) {
                scores[i] = s;
            }
        } else if let [a, b, c] = *g {
            let q = [a, b, c].map(|i| &queries[i][..hd]);
            // SAFETY: the caller checked AVX2, FMA and F16C (`vector`); the transposed
            // keys hold `hd` rows of KV_TILE (asserted), each query `hd` values.
            let s = unsafe { x86::scores3(q, keys_t, scale) };
            for (&i, s) in g.iter().zip(s) {
                scores[i] = s;
            }
        }
    }
    for &i in &which[grouped..] {
        scores[i] = scores_at(vector, &queries[i][..hd], keys_t, scale);
    }
}

/// [`add_weighted_at`] for queries `which` (`acc` holds every query's sum, `hd` each;
/// `weights[i]` query `i`'s over the tile's first `n_keys` rows): `group` at a time as
/// [`scores_of`].
#[allow(clippy::too_many_arguments)]
fn add_weighted_of(
    vector: bool,
    group: usize,
    acc: &mut [f32],
    hd: usize,
    which: &[usize],
    weights: &[[f32; KV_TILE]],
    values: &[f32],
    n_keys: usize,
) {
    let grouped = if group > 1 {
        which.len() / group * group
    } else {
        0
    };
    #[cfg(target_arch = "x86_64")]
    for g in which[..grouped].chunks_exact(group) {
        assert!(hd % 8 == 0 && values.len() >= n_keys * hd);
        assert!(g.iter().all(|&i| (i + 1) * hd <= acc.len()));
        assert!(
            g.windows(2).all(|w| w[0] < w[1]),
            "queries in order, no repeats"
        );
        if let [a, b, c, d] = *g {
            assert!(hd % 16 == 0);
            // SAFETY: the caller checked AVX-512 (a group of 4); the four sums are
            // distinct (ascending indices) runs of `hd` inside `acc`, and `values` holds
            // `n_keys` rows of `hd` (asserted).
            unsafe {
                x86::add_weighted4(
                    acc.as_mut_ptr(),
                    [a, b, c, d].map(|i| i * hd),
                    [a, b, c, d].map(|i| &weights[i][..n_keys]),
                    values,
                    hd,
                )
            };
        } else if let [a, b, c] = *g {
            // SAFETY: the caller checked AVX2, FMA and F16C (`vector`); the three sums
            // are distinct runs of `hd` inside `acc`, and `values` holds `n_keys` rows of
            // `hd` (asserted).
            unsafe {
                x86::add_weighted3(
                    acc.as_mut_ptr(),
                    [a, b, c].map(|i| i * hd),
                    [a, b, c].map(|i| &weights[i][..n_keys]),
                    values,
                    hd,
                )
            };
        }
    }
    for &i in &which[grouped..] {
        add_weighted_at(
            vector,
            &mut acc[i * hd..(i + 1) * hd],
            &weights[i][..n_keys],
            values,
            hd,
        );
    }
}

/// The scaled scores of query `q` against the tile's transposed keys (`keys_t`, `q.len()`
/// rows of [`KV_TILE`]), plus the mask's zero, with AVX2 if `vector` (checked by the
/// caller).
fn scores_at(vector: bool, q: &[f32], keys_t: &[f32], scale: f32) -> [f32; KV_TILE] {
    #[cfg(target_arch = "x86_64")]
    if vector {
        assert!(keys_t.len() >= q.len() * KV_TILE);
        // SAFETY: the caller checked AVX2, FMA and F16C (`vector`); the transposed keys
        // hold `q.len()` rows of KV_TILE (asserted).
        return unsafe { x86::scores(q, keys_t, scale) };
    }
    #[cfg(target_arch = "aarch64")]
    if vector {
        assert!(keys_t.len() >= q.len() * KV_TILE);
        // SAFETY: the caller checked NEON (`vector`); the transposed keys hold
        // `q.len()` rows of KV_TILE (asserted).
        return unsafe { arm::scores(q, keys_t, scale) };
    }
    let _ = vector;
    let mut scores = [0f32; KV_TILE];
    for (j, s) in scores.iter_mut().enumerate() {
        let mut dot = 0f32;
        for (d, &qd) in q.iter().enumerate() {
            dot = qd.mul_add(keys_t[d * KV_TILE + j], dot);
        }
        *s = dot * scale + 0.0;
    }
    scores
}

/// `acc += Σ_j weights[j] · values[j]` (rows of `hd`), one FMA chain over the rows per
/// element, with AVX2 if `vector` (checked by the caller, with `hd` a multiple of 8).
fn add_weighted_at(vector: bool, acc: &mut [f32], weights: &[f32], values: &[f32], hd: usize) {
    #[cfg(target_arch = "x86_64")]
    if vector {
        assert!(acc.len() == hd && hd % 8 == 0 && values.len() >= weights.len() * hd);
        // SAFETY: the caller checked AVX2, FMA and F16C; the lengths were just asserted.
        return unsafe { x86::add_weighted(acc, weights, values, hd) };
    }
    #[cfg(target_arch = "aarch64")]
    if vector {
        assert!(acc.len() == hd && hd % 4 == 0 && values.len() >= weights.len() * hd);
        // SAFETY: the caller checked NEON; the lengths were just asserted.
        return unsafe { arm::add_weighted(acc, weights, values, hd) };
    }
    let _ = vector;
    for (j, &w) in weights.iter().enumerate() {
        for (a, &v) in acc.iter_mut().zip(&values[j * hd..(j + 1) * hd]) {
            *a = w.mul_add(v, *a);
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::KV_TILE;
    use crate::backend::elementwise::expf_ggml8;

    /// [`super::exp_scores`] eight lanes at a time; each group of sixteen reduced as
    /// `_mm512_reduce_add_ps` (halves, quarters, then `(0 + 2) + (1 + 3)`).
    ///
    /// # Safety
    /// The CPU must support AVX2, FMA and F16C.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn exp_scores(scores: &mut [f32; KV_TILE], max: f32) -> f64 {
        let m = _mm256_set1_ps(max);
        let mut total = 0f64;
        for group in scores.chunks_exact_mut(16) {
            let p = group.as_mut_ptr();
            // SAFETY: the group holds sixteen f32.
            unsafe {
                let lo = expf_ggml8(_mm256_sub_ps(_mm256_loadu_ps(p), m));
                let hi = expf_ggml8(_mm256_sub_ps(_mm256_loadu_ps(p.add(8)), m));
                _mm256_storeu_ps(p, lo);
                _mm256_storeu_ps(p.add(8), hi);
                let t8 = _mm256_add_ps(lo, hi);
                let t4 = _mm_add_ps(_mm256_castps256_ps128(t8), _mm256_extractf128_ps::<1>(t8));
                let t2 = _mm_add_ps(t4, _mm_movehl_ps(t4, t4));
                total += _mm_cvtss_f32(_mm_add_ss(t2, _mm_movehdup_ps(t2))) as f64;
            }
        }
        total
    }

    /// The scaled scores of query `q` against the tile's transposed keys: one FMA chain
    /// over the head per key, eight keys to a vector.
    ///
    /// # Safety
    /// The CPU must support AVX2, FMA and F16C; `keys_t` holds `q.len()` rows of
    /// [`KV_TILE`].
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn scores(q: &[f32], keys_t: &[f32], scale: f32) -> [f32; KV_TILE] {
        let mut acc = [_mm256_setzero_ps(); KV_TILE / 8];
        for (d, &qd) in q.iter().enumerate() {
            let qv = _mm256_set1_ps(qd);
            let k = keys_t[d * KV_TILE..].as_ptr();
            for (v, a) in acc.iter_mut().enumerate() {
                // SAFETY: row d of the transposed keys holds KV_TILE values.
                *a = _mm256_fmadd_ps(qv, unsafe { _mm256_loadu_ps(k.add(8 * v)) }, *a);
            }
        }
        let mut out = [0f32; KV_TILE];
        let s = _mm256_set1_ps(scale);
        for (v, a) in acc.iter().enumerate() {
            // Plus the mask's zero, as ggml adds it (-0 becomes +0).
            let scaled = _mm256_add_ps(_mm256_mul_ps(*a, s), _mm256_setzero_ps());
            // SAFETY: `out` holds KV_TILE values.
            unsafe { _mm256_storeu_ps(out.as_mut_ptr().add(8 * v), scaled) };
        }
        out
    }

    /// Writes a level's kernels for `Q` queries at once: `$scores` ([`scores`] of the
    /// `Q`, the tile in passes of four vectors of keys) and `$add` ([`add_weighted`] of
    /// the `Q`, four vectors of each sum held at once). Each row of the transposed keys,
    /// and each value row, is loaded once for the `Q` queries; every (query, key) score
    /// and (query, element) sum is the same FMA chain as the one-query kernels', so the
    /// bits are theirs.
    macro_rules! multi_query {
        (
            $scores:ident, $add:ident, $q:literal, $feature:literal, $lanes:literal, $vec:ty,
            $zero:ident, $set1:ident, $load:ident, $store:ident, $fma:ident, $mul:ident,
            $addv:ident
        ) => {
            /// The scaled scores of `Q` queries against the tile's transposed keys.
            ///
            /// # Safety
            /// The CPU must support the target features; each query holds `hd` values
            /// and `keys_t` `hd` rows of [`KV_TILE`].
            #[target_feature(enable = $feature)]
            pub(super) unsafe fn $scores(
                q: [&[f32]; $q],
                keys_t: &[f32],
                scale: f32,
            ) -> [[f32; KV_TILE]; $q] {
                const V: usize = 4;
                let hd = q[0].len();
                let mut out = [[0f32; KV_TILE]; $q];
                let s = $set1(scale);
                for pass in 0..KV_TILE / ($lanes * V) {
                    let first = $lanes * V * pass;
                    let mut acc: [[$vec; V]; $q] = [[$zero(); V]; $q];
                    for d in 0..hd {
                        // The queries' broadcasts, then one key vector at a time: on AVX2
                        // twelve sums, three broadcasts and the key fill the 16 registers.
                        let b = q.map(|q| $set1(q[d]));
                        for v in 0..V {
                            // SAFETY: row d of the transposed keys holds KV_TILE values
                            // (the contract).
                            let k = unsafe {
                                $load(keys_t.as_ptr().add(d * KV_TILE + first + $lanes * v))
                            };
                            for (a, b) in acc.iter_mut().zip(&b) {
                                a[v] = $fma(*b, k, a[v]);
                            }
                        }
                    }
                    for (o, a) in out.iter_mut().zip(&acc) {
                        for (v, a) in a.iter().enumerate() {
                            // Plus the mask's zero, as ggml adds it (-0 becomes +0).
                            let scaled = $addv($mul(*a, s), $zero());
                            // SAFETY: `o` holds KV_TILE values.
                            unsafe { $store(o.as_mut_ptr().add(first + $lanes * v), scaled) };
                        }
                    }
                }
                out
            }

            /// The sums at `acc + at[k]` (`hd` each) take `Σ_j weights[k][j] ·
            /// values[j]`.
            ///
            /// # Safety
            /// The CPU must support the target features; `hd` is a multiple of the
            /// lanes; the runs of `hd` at `acc + at[k]` are valid for reads and writes
            /// and do not overlap; `values` holds `weights[k].len()` rows of `hd` (the
            /// same count for all).
            #[target_feature(enable = $feature)]
            pub(super) unsafe fn $add(
                acc: *mut f32,
                at: [usize; $q],
                weights: [&[f32]; $q],
                values: &[f32],
                hd: usize,
            ) {
                const HELD: usize = 4;
                let n_keys = weights[0].len();
                let mut d0 = 0;
                while d0 < hd {
                    let nv = ((hd - d0) / $lanes).min(HELD);
                    let mut a: [[$vec; HELD]; $q] = [[$zero(); HELD]; $q];
                    // SAFETY: elements d0..d0 + lanes * nv of each sum and of each value
                    // row exist (the contract).
                    unsafe {
                        for (a, &at) in a.iter_mut().zip(&at) {
                            for (v, a) in a.iter_mut().enumerate().take(nv) {
                                *a = $load(acc.add(at + d0 + $lanes * v));
                            }
                        }
                        for j in 0..n_keys {
                            let row = values.as_ptr().add(j * hd + d0);
                            let w = weights.map(|w| $set1(w[j]));
                            for v in 0..nv {
                                let x = $load(row.add($lanes * v));
                                for (a, w) in a.iter_mut().zip(&w) {
                                    a[v] = $fma(*w, x, a[v]);
                                }
                            }
                        }
                        for (a, &at) in a.iter().zip(&at) {
                            for (v, a) in a.iter().enumerate().take(nv) {
                                $store(acc.add(at + d0 + $lanes * v), *a);
                            }
                        }
                    }
                    d0 += $lanes * nv;
                }
            }
        };
    }

    // AVX2: three queries (twelve sums and three broadcasts of its 16 registers).
    multi_query!(
        scores3,
        add_weighted3,
        3,
        "avx2,fma,f16c",
        8,
        __m256,
        _mm256_setzero_ps,
        _mm256_set1_ps,
        _mm256_loadu_ps,
        _mm256_storeu_ps,
        _mm256_fmadd_ps,
        _mm256_mul_ps,
        _mm256_add_ps
    );
    // AVX-512: four queries, sixteen keys or elements to a vector.
    multi_query!(
        scores4,
        add_weighted4,
        4,
        "avx512f,avx2,fma,f16c",
        16,
        __m512,
        _mm512_setzero_ps,
        _mm512_set1_ps,
        _mm512_loadu_ps,
        _mm512_storeu_ps,
        _mm512_fmadd_ps,
        _mm512_mul_ps,
        _mm512_add_ps
    );

    /// `acc += Σ_j weights[j] · values[j]`, one FMA chain over the rows per element, eight
    /// elements to a vector, up to eight vectors held at once.
    ///
    /// # Safety
    /// The CPU must support AVX2, FMA and F16C; `acc.len() == hd`, a multiple of 8, and
    /// `values` holds `weights.len()` rows of `hd`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn add_weighted(acc: &mut [f32], weights: &[f32], values: &[f32], hd: usize) {
        const HELD: usize = 8;
        let mut d0 = 0;
        while d0 < hd {
            let nv = ((hd - d0) / 8).min(HELD);
            let mut a = [_mm256_setzero_ps(); HELD];
            // SAFETY: elements d0..d0 + 8 * nv of `acc` and of each value row exist.
            unsafe {
                for (v, a) in a.iter_mut().enumerate().take(nv) {
                    *a = _mm256_loadu_ps(acc.as_ptr().add(d0 + 8 * v));
                }
                for (j, &w) in weights.iter().enumerate() {
                    let wv = _mm256_set1_ps(w);
                    let row = values.as_ptr().add(j * hd + d0);
                    for (v, a) in a.iter_mut().enumerate().take(nv) {
                        *a = _mm256_fmadd_ps(wv, _mm256_loadu_ps(row.add(8 * v)), *a);
                    }
                }
                for (v, a) in a.iter().enumerate().take(nv) {
                    _mm256_storeu_ps(acc.as_mut_ptr().add(d0 + 8 * v), *a);
                }
            }
            d0 += 8 * nv;
        }
    }
}

#[cfg(target_arch = "aarch64")]
mod arm {
    use std::arch::aarch64::*;

    use super::KV_TILE;
    use crate::backend::elementwise::expf_ggml4;

    /// [`super::exp_scores`] four lanes at a time; each group of sixteen reduced as
    /// `_mm512_reduce_add_ps` (halves, quarters, then `(0 + 2) + (1 + 3)`).
    ///
    /// # Safety
    /// The CPU must support NEON.
    #[target_feature(enable = "neon")]
    pub(super) unsafe fn exp_scores(scores: &mut [f32; KV_TILE], max: f32) -> f64 {
        let m = vdupq_n_f32(max);
        let mut total = 0f64;
        for group in scores.chunks_exact_mut(16) {
            let p = group.as_mut_ptr();
            // SAFETY: the group holds sixteen f32.
            let e: [float32x4_t; 4] = std::array::from_fn(|i| unsafe {
                let v = expf_ggml4(vsubq_f32(vld1q_f32(p.add(4 * i)), m));
                vst1q_f32(p.add(4 * i), v);
                v
            });
            // Lanes i + (i + 8), then i + (i + 4), then (0 + 2) + (1 + 3).
            let t4 = vaddq_f32(vaddq_f32(e[0], e[2]), vaddq_f32(e[1], e[3]));
            total += ((vgetq_lane_f32::<0>(t4) + vgetq_lane_f32::<2>(t4))
                + (vgetq_lane_f32::<1>(t4) + vgetq_lane_f32::<3>(t4))) as f64;
        }
        total
    }

    /// The scaled scores of query `q` against the tile's transposed keys: one FMA chain
    /// over the head per key, four keys to a vector.
    ///
    /// # Safety
    /// The CPU must support NEON; `keys_t` holds `q.len()` rows of [`KV_TILE`].
    #[target_feature(enable = "neon")]
    pub(super) unsafe fn scores(q: &[f32], keys_t: &[f32], scale: f32) -> [f32; KV_TILE] {
        let mut acc = [vdupq_n_f32(0.0); KV_TILE / 4];
        for (d, &qd) in q.iter().enumerate() {
            let qv = vdupq_n_f32(qd);
            let k = keys_t[d * KV_TILE..].as_ptr();
            for (v, a) in acc.iter_mut().enumerate() {
                // SAFETY: row d of the transposed keys holds KV_TILE values.
                *a = vfmaq_f32(*a, qv, unsafe { vld1q_f32(k.add(4 * v)) });
            }
        }
        let mut out = [0f32; KV_TILE];
        let s = vdupq_n_f32(scale);
        for (v, a) in acc.iter().enumerate() {
            // Plus the mask's zero, as ggml adds it (-0 becomes +0).
            let scaled = vaddq_f32(vmulq_f32(*a, s), vdupq_n_f32(0.0));
            // SAFETY: `out` holds KV_TILE values.
            unsafe { vst1q_f32(out.as_mut_ptr().add(4 * v), scaled) };
        }
        out
    }

    /// `acc += Σ_j weights[j] · values[j]`, one FMA chain over the rows per element, four
    /// elements to a vector, up to sixteen vectors held at once.
    ///
    /// # Safety
    /// The CPU must support NEON; `acc.len() == hd`, a multiple of 4, and `values` holds
    /// `weights.len()` rows of `hd`.
    #[target_feature(enable = "neon")]
    pub(super) unsafe fn add_weighted(acc: &mut [f32], weights: &[f32], values: &[f32], hd: usize) {
        const HELD: usize = 16;
        let mut d0 = 0;
        while d0 < hd {
            let nv = ((hd - d0) / 4).min(HELD);
            let mut a = [vdupq_n_f32(0.0); HELD];
            // SAFETY: elements d0..d0 + 4 * nv of `acc` and of each value row exist.
            unsafe {
                for (v, a) in a.iter_mut().enumerate().take(nv) {
                    *a = vld1q_f32(acc.as_ptr().add(d0 + 4 * v));
                }
                for (j, &w) in weights.iter().enumerate() {
                    let wv = vdupq_n_f32(w);
                    let row = values.as_ptr().add(j * hd + d0);
                    for (v, a) in a.iter_mut().enumerate().take(nv) {
                        *a = vfmaq_f32(*a, wv, vld1q_f32(row.add(4 * v)));
                    }
                }
                for (v, a) in a.iter().enumerate().take(nv) {
                    vst1q_f32(acc.as_mut_ptr().add(d0 + 4 * v), *a);
                }
            }
            d0 += 4 * nv;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every vector level's weights and their total are the scalar ones, bit for bit,
    /// subnormal weights and the specials included.
    #[test]
    fn vector_weights_match_scalar() {
        // Normal results, subnormal ones (below about -87.3), zeros, the specials.
        let mut xs: Vec<f32> = (-4200..=1000).map(|i| i as f32 * 0.025 + 0.0031).collect();
        xs.extend([0.0, -0.0, -87.3, -88.0, -103.9, -104.5, 88.3, 89.0, 200.0]);
        xs.extend([f32::NEG_INFINITY, f32::INFINITY, -1e30, 1e30]);
        for level in crate::quant::available_simd_levels() {
            for (c, chunk) in xs.chunks(KV_TILE).enumerate() {
                let mut scores = [f32::NEG_INFINITY; KV_TILE];
                scores[..chunk.len()].copy_from_slice(chunk);
                // Half the tiles against a maximum above every score, as the softmax has.
                let max = if c % 2 == 0 { 0.0 } else { 3.0 };
                let (mut a, mut b) = (scores, scores);
                let ta = exp_scores(&mut a, max, SimdLevel::Scalar);
                let tb = exp_scores(&mut b, max, level);
                assert_eq!(ta.to_bits(), tb.to_bits(), "{level:?}: total of tile {c}");
                for (x, (p, q)) in scores.iter().zip(a.iter().zip(&b)) {
                    assert!(
                        p.to_bits() == q.to_bits() || (p.is_nan() && q.is_nan()),
                        "{level:?}: {x}: {p} vs {q}"
                    );
                }
            }
        }
    }
}
