//! [`super::attend_head_reference`] on NEON, four lanes at a time, with the same
//! results bit for bit, for the query heads that share a key/value head together (each
//! cached row read once for all of them, as on AVX2).
//!
//! ggml's four 16-lane accumulators are sixteen 4-lane ones here: element `e` of a row
//! goes to 16-lane accumulator `(e / 16) % 4`, lane `e % 16`, which is 4-lane vector
//! `e % 16 / 4` of that accumulator. The reduction then adds the same lanes in the same
//! order as the reference (and `_mm512_reduce_add_ps`), and every other step is the
//! reference's operation lane by lane: one fused multiply-add per score and value
//! update, plain products for the rescale and the final division.

use std::arch::aarch64::*;
use std::arch::asm;

use half::f16;

use super::{Finish, HeadSlot};
use crate::kv::{KvRows, KvView, Q8_BLOCK};

/// Largest head size of the vector path.
pub(super) const MAX_HEAD: usize = 256;
/// Most groups of 16 elements a head holds.
const MAX_GROUPS: usize = MAX_HEAD / 16;

/// Sixteen consecutive elements as four vectors (one lane group of a 16-lane
/// accumulator).
type V16 = [float32x4_t; 4];

/// Eight f16 values (as bits) widened to f32: exact. Written in assembly because the
/// f16 conversion intrinsics (`vcvt_f32_f16`) are stable only since Rust 1.94, newer
/// than the workspace's `rust-version`.
#[inline]
#[target_feature(enable = "neon")]
fn widen_f16(h: uint16x8_t) -> (float32x4_t, float32x4_t) {
    let (lo, hi): (float32x4_t, float32x4_t);
    // SAFETY: `fcvtl`/`fcvtl2` read and write only the named vector registers (`out`
    // keeps `lo` apart from `h`, which the second instruction still reads).
    unsafe {
        asm!(
            "fcvtl {lo:v}.4s, {h:v}.4h",
            "fcvtl2 {hi:v}.4s, {h:v}.8h",
            h = in(vreg) h,
            lo = out(vreg) lo,
            hi = out(vreg) hi,
            options(pure, nomem, nostack, preserves_flags),
        );
    }
    (lo, hi)
}

/// Each lane rounded to f16 (to nearest, ties to even: the default FPCR mode, as
/// `half::f16::from_f32`) and back, with `half` set; else `x`. Assembly for the
/// reason given at [`widen_f16`].
#[inline]
#[target_feature(enable = "neon")]
fn round4(x: float32x4_t, half: bool) -> float32x4_t {
    if !half {
        return x;
    }
    let y: float32x4_t;
    // SAFETY: `fcvtn`/`fcvtl` read and write only the named vector registers.
    unsafe {
        asm!(
            "fcvtn {t:v}.4h, {x:v}.4s",
            "fcvtl {y:v}.4s, {t:v}.4h",
            x = in(vreg) x,
            t = out(vreg) _,
            y = lateout(vreg) y,
            options(pure, nomem, nostack, preserves_flags),
        );
    }
    y
}

/// Rows of one element type, read sixteen elements at a time (one code path per type,
/// so the kernel's loop holds no match).
trait Rows16: Copy {
    /// Elements `at..at + 16` as f32.
    ///
    /// # Safety
    /// `at + 16` is within the rows.
    unsafe fn load16(self, at: usize) -> V16;
}

impl Rows16 for &[f32] {
    #[inline]
    #[target_feature(enable = "neon")]
    unsafe fn load16(self, at: usize) -> V16 {
        // SAFETY: the caller keeps `at + 16` within the rows.
        unsafe {
            let p = self.as_ptr().add(at);
            [
                vld1q_f32(p),
                vld1q_f32(p.add(4)),
                vld1q_f32(p.add(8)),
                vld1q_f32(p.add(12)),
            ]
        }
    }
}

impl Rows16 for &[f16] {
    #[inline]
    #[target_feature(enable = "neon")]
    unsafe fn load16(self, at: usize) -> V16 {
        // SAFETY: the caller keeps `at + 16` within the rows; `f16` is a `u16`.
        let (a, b) = unsafe {
            let p = self.as_ptr().add(at) as *const u16;
            (vld1q_u16(p), vld1q_u16(p.add(8)))
        };
        let (a0, a1) = widen_f16(a);
        let (b0, b1) = widen_f16(b);
        [a0, a1, b0, b1]
    }
}

/// int8 rows and their scales.
#[derive(Clone, Copy)]
struct Q8Rows<'a>(&'a [i8], &'a [f16]);

impl Rows16 for Q8Rows<'_> {
    #[inline]
    #[target_feature(enable = "neon")]
    unsafe fn load16(self, at: usize) -> V16 {
        // SAFETY: the caller keeps `at + 16` within the rows.
        let q = unsafe { vld1q_s8(self.0.as_ptr().add(at)) };
        // Sixteen elements never straddle two scales: heads start on multiples of 64 on
        // this path, and blocks are 32 long. `q * d`, as `KvRows::read_f32`.
        let d = vdupq_n_f32(self.1[at / Q8_BLOCK].to_f32());
        let (lo, hi) = (vmovl_s8(vget_low_s8(q)), vmovl_s8(vget_high_s8(q)));
        let f = |v: int16x4_t| vmulq_f32(vcvtq_f32_s32(vmovl_s16(v)), d);
        [
            f(vget_low_s16(lo)),
            f(vget_high_s16(lo)),
            f(vget_low_s16(hi)),
            f(vget_high_s16(hi)),
        ]
    }
}

/// The state of one head's online softmax: the query, the running sum of values, the
/// running maximum and the running sum of weights.
struct State<const NG: usize> {
    q: [V16; NG],
    acc: [V16; NG],
    max: f32,
    sum: f32,
}

/// Keys per run of [`segment`]'s three passes (the AVX2 kernel's, measured there).
const RUN: usize = 8;

/// The reference's `dot_reference` of a row (`k`, loaded) with the query: group `j` of
/// 16 elements into accumulator `j % 4`, then its reduction.
#[inline]
#[target_feature(enable = "neon")]
fn score<const NG: usize>(q: &[V16; NG], k: &[V16; NG]) -> f32 {
    let zero = vdupq_n_f32(0.0);
    let mut s = [[zero; 4]; 4];
    for (j, (qj, kj)) in q.iter().zip(k).enumerate() {
        for m in 0..4 {
            s[j % 4][m] = vfmaq_f32(s[j % 4][m], kj[m], qj[m]);
        }
    }
    // r = (acc0 + acc2) + (acc1 + acc3), lanes 4m..4m+3 in r[m].
    let r: [float32x4_t; 4] = std::array::from_fn(|m| {
        vaddq_f32(vaddq_f32(s[0][m], s[2][m]), vaddq_f32(s[1][m], s[3][m]))
    });
    // Lanes i + (i + 8), then i + (i + 4), then (0 + 2) + (1 + 3).
    let t4 = vaddq_f32(vaddq_f32(r[0], r[2]), vaddq_f32(r[1], r[3]));
    (vgetq_lane_f32::<0>(t4) + vgetq_lane_f32::<2>(t4))
        + (vgetq_lane_f32::<1>(t4) + vgetq_lane_f32::<3>(t4))
}

/// The keys of one segment against the states of the query heads that share its
/// key/value head, `NG` groups of 16 per head. Three passes over each run of keys, so
/// that no `expf` call sits between the vector state and its registers (a call keeps
/// only the low halves of v8-v15): the scores; then, in order, the running maximum and
/// each key's two factors; then the sums. Each key's and value's row is read once for
/// every head of the group. The same operations in the same order as one head alone in
/// one pass.
#[allow(clippy::too_many_arguments)]
#[inline]
#[target_feature(enable = "neon")]
unsafe fn segment<const NG: usize, R: Rows16>(
    states: &mut [State<NG>],
    keys: R,
    values: R,
    positions: &[u32],
    q_pos: u32,
    slot: HeadSlot,
    scale: f32,
    half: bool,
) {
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
            let k: [V16; NG] = std::array::from_fn(|j| unsafe { keys.load16(start + 16 * j) });
            for (h, st) in states.iter().enumerate() {
                scores[h * RUN + n] = score(&st.q, &k) * scale;
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
            let v: [V16; NG] = std::array::from_fn(|j| unsafe { values.load16(start + 16 * j) });
            for (h, st) in states.iter_mut().enumerate() {
                let (ms, vs, rescale) = factors[h * RUN + m];
                if rescale {
                    let f = vdupq_n_f32(ms);
                    for a in st.acc.iter_mut().flatten() {
                        *a = round4(vmulq_f32(*a, f), half);
                    }
                }
                let w = vdupq_n_f32(vs);
                for (a, v) in st.acc.iter_mut().zip(&v) {
                    for (a, &v) in a.iter_mut().zip(v) {
                        *a = round4(vfmaq_f32(*a, v, w), half);
                    }
                }
                st.sum = st.sum.mul_add(ms, vs);
            }
        }
    }
}

/// [`super::attend_head_reference`] on NEON for the query heads `qs` that share one
/// key/value head (`outs[i]` gets head `qs[i]`'s output, the same bits as each alone).
/// One code path per head size and element type, so the loops have constant bounds.
///
/// # Safety
/// The CPU has NEON; the head size is a multiple of 64 and at most [`MAX_HEAD`]; every
/// segment's keys and values are of one type and hold a whole row per position, and
/// each of `qs` and `outs` a whole head (what the dispatcher's `fits` checks).
#[target_feature(enable = "neon")]
pub(super) unsafe fn attend_heads_neon(
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
        match slot.head_dim / 16 {
            4 => heads::<4>(qs, q_pos, kv, slot, scale, outs, finish),
            8 => heads::<8>(qs, q_pos, kv, slot, scale, outs, finish),
            12 => heads::<12>(qs, q_pos, kv, slot, scale, outs, finish),
            _ => heads::<{ MAX_GROUPS }>(qs, q_pos, kv, slot, scale, outs, finish),
        }
    }
}

#[target_feature(enable = "neon")]
unsafe fn heads<const NG: usize>(
    qs: &[&[f32]],
    q_pos: u32,
    kv: &KvView<'_>,
    slot: HeadSlot,
    scale: f32,
    outs: &mut [&mut [f32]],
    finish: Finish,
) {
    debug_assert!(slot.head_dim == 16 * NG && NG <= MAX_GROUPS);
    let half = matches!(kv.segments.first().map(|s| s.keys), Some(KvRows::F16(_)));
    let zero = [vdupq_n_f32(0.0); 4];
    let mut states: Vec<State<NG>> = qs
        .iter()
        .map(|q| State::<NG> {
            // SAFETY: q holds the head's 16 * NG values.
            q: std::array::from_fn(|j| unsafe { q[..].load16(16 * j) }.map(|x| round4(x, half))),
            acc: [zero; NG],
            max: f32::NEG_INFINITY,
            sum: 0.0,
        })
        .collect();
    for seg in &kv.segments {
        let (pos, sl, st) = (seg.positions, slot, &mut states[..]);
        // SAFETY: the dispatcher checked that every segment holds its rows.
        unsafe {
            match (seg.keys, seg.values) {
                (KvRows::F32(k), KvRows::F32(v)) => segment(st, k, v, pos, q_pos, sl, scale, half),
                (KvRows::F16(k), KvRows::F16(v)) => segment(st, k, v, pos, q_pos, sl, scale, half),
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
                // Keys and values of two types: the dispatcher sent such a view to the
                // reference.
                _ => unreachable!("keys and values of one segment differ in type"),
            }
        }
    }
    for (st, out) in states.iter().zip(outs.iter_mut()) {
        if finish == Finish::Partial {
            let mut acc = [0f32; MAX_HEAD];
            for (j, a) in st.acc.iter().enumerate() {
                for (m, a) in a.iter().enumerate() {
                    // SAFETY: 16 * NG <= MAX_HEAD floats.
                    unsafe { vst1q_f32(acc.as_mut_ptr().add(16 * j + 4 * m), *a) };
                }
            }
            finish.write(st.max, st.sum, acc[..16 * NG].iter().copied(), out);
            continue;
        }
        let inv = vdupq_n_f32(if st.sum == 0.0 { 0.0 } else { 1.0 / st.sum });
        for (j, a) in st.acc.iter().enumerate() {
            for (m, a) in a.iter().enumerate() {
                // SAFETY: out holds the head's 16 * NG values.
                unsafe { vst1q_f32(out.as_mut_ptr().add(16 * j + 4 * m), vmulq_f32(*a, inv)) };
            }
        }
    }
}
