//! Portable scalar dot products. Each block's integer sum is exact. The 32-element
//! formats (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) accumulate floats in llama.cpp's order (see
//! [`lanes_dot`]), so every SIMD level gives the same bits for them; the K-quants
//! accumulate block by block.

use super::blocks::{f16_at, f32_at, scale_min_k4};
use crate::ggml_type::GgmlType;
use half::{bf16, f16};

/// Dot product of one weight row with one activation row.
///
/// `a` holds the activation row bytes (Q8_0/Q8_1/Q8_K), `s` its f32 block scales
/// (`d` per block, plus `s` for Q8_1), `af` the f32 activations for plain weight types.
pub(crate) fn dot(ty: GgmlType, w: &[u8], a: &[u8], s: &[f32], af: &[f32]) -> f32 {
    match ty {
        GgmlType::F32 => w
            .chunks_exact(4)
            .zip(af)
            .map(|(w, a)| f32_at(w, 0) * a)
            .sum(),
        GgmlType::F16 => w
            .chunks_exact(2)
            .zip(af)
            .map(|(w, a)| f16::from_bits(u16::from_le_bytes([w[0], w[1]])).to_f32() * a)
            .sum(),
        GgmlType::BF16 => w
            .chunks_exact(2)
            .zip(af)
            .map(|(w, a)| bf16::from_bits(u16::from_le_bytes([w[0], w[1]])).to_f32() * a)
            .sum(),
        GgmlType::Q4_0 => lanes_dot(
            w,
            18,
            a,
            34,
            |x, e| {
                let q = if e < 16 {
                    x[2 + e] & 0xF
                } else {
                    x[2 + e - 16] >> 4
                };
                (q as i32 - 8, f16_at(x, 0), 0.0)
            },
            s,
            1,
        ),
        GgmlType::Q4_1 => lanes_dot(
            w,
            20,
            a,
            36,
            |x, e| {
                let q = if e < 16 {
                    x[4 + e] & 0xF
                } else {
                    x[4 + e - 16] >> 4
                };
                (q as i32, f16_at(x, 0), f16_at(x, 2))
            },
            s,
            2,
        ),
        GgmlType::Q5_0 => lanes_dot(
            w,
            22,
            a,
            34,
            |x, e| {
                let qh = u32::from_le_bytes([x[2], x[3], x[4], x[5]]);
                let q = if e < 16 {
                    x[6 + e] & 0xF
                } else {
                    x[6 + e - 16] >> 4
                } as u32;
                ((q | ((qh >> e) & 1) << 4) as i32 - 16, f16_at(x, 0), 0.0)
            },
            s,
            1,
        ),
        GgmlType::Q5_1 => lanes_dot(
            w,
            24,
            a,
            36,
            |x, e| {
                let qh = u32::from_le_bytes([x[4], x[5], x[6], x[7]]);
                let q = if e < 16 {
                    x[8 + e] & 0xF
                } else {
                    x[8 + e - 16] >> 4
                } as u32;
                (
                    (q | ((qh >> e) & 1) << 4) as i32,
                    f16_at(x, 0),
                    f16_at(x, 2),
                )
            },
            s,
            2,
        ),
        GgmlType::Q8_0 => lanes_dot(
            w,
            34,
            a,
            34,
            |x, e| (x[2 + e] as i8 as i32, f16_at(x, 0), 0.0),
            s,
            1,
        ),
        GgmlType::Q4_K | GgmlType::Q5_K => {
            let five = ty == GgmlType::Q5_K;
            let bb = ty.block_bytes();
            let mut sum = 0f32;
            for (x, y) in w.chunks_exact(bb).zip(a.chunks_exact(292)) {
                let (qh, qs) = if five {
                    (&x[16..48], &x[48..176])
                } else {
                    (&x[0..0], &x[16..144])
                };
                let yq = &y[4..260];
                let mut si = 0i32;
                let mut sm = 0i32;
                for c in 0..4 {
                    let (sc1, m1) = scale_min_k4(2 * c, &x[4..16]);
                    let (sc2, m2) = scale_min_k4(2 * c + 1, &x[4..16]);
                    let (mut s1, mut s2) = (0i32, 0i32);
                    for l in 0..32 {
                        let q = qs[32 * c + l];
                        let (mut lo, mut hi) = ((q & 0xF) as i32, (q >> 4) as i32);
                        if five {
                            lo |= (((qh[l] >> (2 * c)) & 1) as i32) << 4;
                            hi |= (((qh[l] >> (2 * c + 1)) & 1) as i32) << 4;
                        }
                        s1 += lo * yq[64 * c + l] as i8 as i32;
                        s2 += hi * yq[64 * c + 32 + l] as i8 as i32;
                    }
                    si += sc1 as i32 * s1 + sc2 as i32 * s2;
                    let bs = |g: usize| i16::from_le_bytes([y[260 + 2 * g], y[261 + 2 * g]]) as i32;
                    sm += m1 as i32 * (bs(4 * c) + bs(4 * c + 1))
                        + m2 as i32 * (bs(4 * c + 2) + bs(4 * c + 3));
                }
                let dy = f32_at(y, 0);
                sum += f16_at(x, 0) * dy * si as f32 - f16_at(x, 2) * dy * sm as f32;
            }
            sum
        }
        GgmlType::Q6_K => {
            let mut sum = 0f32;
            for (x, y) in w.chunks_exact(210).zip(a.chunks_exact(292)) {
                let yq = &y[4..260];
                let mut si = 0i32;
                for n in 0..2 {
                    let (ql, qh, sc) = (&x[64 * n..], &x[128 + 32 * n..], &x[192 + 8 * n..]);
                    let yq = &yq[128 * n..];
                    let mut part = [0i32; 8];
                    for l in 0..32 {
                        let is = l / 16;
                        let q1 = ((ql[l] & 0xF) | ((qh[l] & 3) << 4)) as i32 - 32;
                        let q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32;
                        let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32;
                        let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32;
                        part[is] += q1 * yq[l] as i8 as i32;
                        part[is + 2] += q2 * yq[l + 32] as i8 as i32;
                        part[is + 4] += q3 * yq[l + 64] as i8 as i32;
                        part[is + 6] += q4 * yq[l + 96] as i8 as i32;
                    }
                    for (i, p) in part.iter().enumerate() {
                        si += sc[i] as i8 as i32 * p;
                    }
                }
                sum += f16_at(x, 208) * f32_at(y, 0) * si as f32;
            }
            sum
        }
        GgmlType::Q8_1 | GgmlType::Q8_K => unreachable!("not a weight type"),
    }
}

/// A dot product of one row of a 32-element block format in llama.cpp's x86 order
/// (`ggml_vec_dot_q4_1_q8_1` and its siblings): eight f32 lanes, where lane j takes
/// `d_w * d_a * (integer sum of elements 4j..4j+3)` of each block by one FMA, block after
/// block; then ggml's horizontal sum `((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7))`; plus, for
/// the formats with a minimum (`per_block_scales == 2`), the sum of `m_w * s_a` over the
/// blocks, each added by one FMA.
///
/// `quant(block, e)` gives element `e`'s integer weight and the block's `d` and `m`;
/// `wb`/`ab` are the weight and activation block sizes (activation quants at byte
/// `ab - 32`), `s` the activation blocks' f32 scales, `per_block_scales` of them each.
fn lanes_dot(
    w: &[u8],
    wb: usize,
    a: &[u8],
    ab: usize,
    quant: impl Fn(&[u8], usize) -> (i32, f32, f32),
    s: &[f32],
    per_block_scales: usize,
) -> f32 {
    let mut lanes = [0f32; 8];
    let mut mins = 0f32;
    for (b, (x, y)) in w.chunks_exact(wb).zip(a.chunks_exact(ab)).enumerate() {
        let yq = &y[ab - 32..];
        let (mut d, mut m) = (0.0, 0.0);
        let mut sums = [0i32; 8];
        for e in 0..32 {
            let (q, dw, mw) = quant(x, e);
            (d, m) = (dw, mw);
            sums[e / 4] += q * yq[e] as i8 as i32;
        }
        let dd = d * s[per_block_scales * b];
        for (lane, &sum) in lanes.iter_mut().zip(&sums) {
            *lane = dd.mul_add(sum as f32, *lane);
        }
        if per_block_scales == 2 {
            mins = m.mul_add(s[2 * b + 1], mins);
        }
    }
    let l = lanes;
    ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7])) + mins
}
