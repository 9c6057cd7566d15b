//! Block layouts (bit-compatible with ggml): scalar dequantizers and quantizers.

use crate::ggml_type::GgmlType;
use half::{bf16, f16};

#[inline(always)]
pub(crate) fn f16_at(b: &[u8], off: usize) -> f32 {
    f16::from_bits(u16::from_le_bytes([b[off], b[off + 1]])).to_f32()
}

#[inline(always)]
fn put_f16(b: &mut [u8], off: usize, v: f32) -> f32 {
    let h = f16::from_f32(v);
    b[off..off + 2].copy_from_slice(&h.to_bits().to_le_bytes());
    h.to_f32()
}

#[inline(always)]
pub(crate) fn f32_at(b: &[u8], off: usize) -> f32 {
    f32::from_le_bytes([b[off], b[off + 1], b[off + 2], b[off + 3]])
}

/// ggml's `get_scale_min_k4`: the 6-bit scale and min of sub-block `j` (0..8).
#[inline(always)]
pub(crate) fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

/// Dequantizes whole blocks; `src` and `dst` sizes are already validated.
pub(crate) fn dequantize_blocks(ty: GgmlType, src: &[u8], dst: &mut [f32]) {
    let bl = ty.block_len();
    let bb = ty.block_bytes();
    match ty {
        GgmlType::F32 => {
            for (d, s) in dst.iter_mut().zip(src.chunks_exact(4)) {
                *d = f32_at(s, 0);
            }
        }
        GgmlType::F16 => {
            for (d, s) in dst.iter_mut().zip(src.chunks_exact(2)) {
                *d = f16_at(s, 0);
            }
        }
        GgmlType::BF16 => {
            for (d, s) in dst.iter_mut().zip(src.chunks_exact(2)) {
                *d = bf16::from_bits(u16::from_le_bytes([s[0], s[1]])).to_f32();
            }
        }
        _ => {
            for (y, b) in dst.chunks_exact_mut(bl).zip(src.chunks_exact(bb)) {
                dequantize_block(ty, b, y);
            }
        }
    }
}

fn dequantize_block(ty: GgmlType, b: &[u8], y: &mut [f32]) {
    match ty {
        GgmlType::Q4_0 => {
            let d = f16_at(b, 0);
            for j in 0..16 {
                y[j] = ((b[2 + j] & 0xF) as i32 - 8) as f32 * d;
                y[j + 16] = ((b[2 + j] >> 4) as i32 - 8) as f32 * d;
            }
        }
        GgmlType::Q4_1 => {
            let (d, m) = (f16_at(b, 0), f16_at(b, 2));
            for j in 0..16 {
                y[j] = (b[4 + j] & 0xF) as f32 * d + m;
                y[j + 16] = (b[4 + j] >> 4) as f32 * d + m;
            }
        }
        GgmlType::Q5_0 => {
            let d = f16_at(b, 0);
            let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
            for j in 0..16 {
                let h0 = ((qh >> j) & 1) << 4;
                let h1 = ((qh >> (j + 16)) & 1) << 4;
                y[j] = (((b[6 + j] & 0xF) as u32 | h0) as i32 - 16) as f32 * d;
                y[j + 16] = (((b[6 + j] >> 4) as u32 | h1) as i32 - 16) as f32 * d;
            }
        }
        GgmlType::Q5_1 => {
            let (d, m) = (f16_at(b, 0), f16_at(b, 2));
            let qh = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
            for j in 0..16 {
                let h0 = ((qh >> j) & 1) << 4;
                let h1 = ((qh >> (j + 16)) & 1) << 4;
                y[j] = ((b[8 + j] & 0xF) as u32 | h0) as f32 * d + m;
                y[j + 16] = ((b[8 + j] >> 4) as u32 | h1) as f32 * d + m;
            }
        }
        GgmlType::Q8_0 => {
            let d = f16_at(b, 0);
            for j in 0..32 {
                y[j] = b[2 + j] as i8 as f32 * d;
            }
        }
        GgmlType::Q8_1 => {
            let d = f16_at(b, 0);
            for j in 0..32 {
                y[j] = b[4 + j] as i8 as f32 * d;
            }
        }
        GgmlType::Q8_K => {
            let d = f32_at(b, 0);
            for j in 0..256 {
                y[j] = b[4 + j] as i8 as f32 * d;
            }
        }
        GgmlType::Q4_K | GgmlType::Q5_K => {
            let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
            let scales = &b[4..16];
            let five = ty == GgmlType::Q5_K;
            let (qh, qs) = if five {
                (&b[16..48], &b[48..176])
            } else {
                (&b[0..0], &b[16..144])
            };
            for c in 0..4 {
                let (sc1, m1) = scale_min_k4(2 * c, scales);
                let (sc2, m2) = scale_min_k4(2 * c + 1, scales);
                let (d1, mm1) = (d * sc1 as f32, dmin * m1 as f32);
                let (d2, mm2) = (d * sc2 as f32, dmin * m2 as f32);
                for l in 0..32 {
                    let q = qs[32 * c + l];
                    let (mut lo, mut hi) = ((q & 0xF) as u32, (q >> 4) as u32);
                    if five {
                        lo |= (((qh[l] >> (2 * c)) & 1) as u32) << 4;
                        hi |= (((qh[l] >> (2 * c + 1)) & 1) as u32) << 4;
                    }
                    y[64 * c + l] = d1 * lo as f32 - mm1;
                    y[64 * c + 32 + l] = d2 * hi as f32 - mm2;
                }
            }
        }
        GgmlType::Q6_K => {
            let (ql, qh, sc) = (&b[0..128], &b[128..192], &b[192..208]);
            let d = f16_at(b, 208);
            for n in 0..2 {
                let (ql, qh, sc) = (&ql[64 * n..], &qh[32 * n..], &sc[8 * n..]);
                let y = &mut y[128 * n..];
                for l in 0..32 {
                    let is = l / 16;
                    let q1 = ((ql[l] & 0xF) | ((qh[l] & 3) << 4)) as i32 - 32;
                    let q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32;
                    let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32;
                    let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32;
                    y[l] = d * (sc[is] as i8) as f32 * q1 as f32;
                    y[l + 32] = d * (sc[is + 2] as i8) as f32 * q2 as f32;
                    y[l + 64] = d * (sc[is + 4] as i8) as f32 * q3 as f32;
                    y[l + 96] = d * (sc[is + 6] as i8) as f32 * q4 as f32;
                }
            }
        }
        GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => unreachable!("plain types"),
    }
}

/// Quantizes whole blocks; sizes already validated, `dst` zeroed and of the right size.
pub(crate) fn quantize_blocks(ty: GgmlType, src: &[f32], dst: &mut [u8]) {
    let bl = ty.block_len();
    let bb = ty.block_bytes();
    match ty {
        GgmlType::F32 => {
            for (d, s) in dst.chunks_exact_mut(4).zip(src) {
                d.copy_from_slice(&s.to_le_bytes());
            }
        }
        GgmlType::F16 => {
            for (d, s) in dst.chunks_exact_mut(2).zip(src) {
                d.copy_from_slice(&f16::from_f32(*s).to_bits().to_le_bytes());
            }
        }
        GgmlType::BF16 => {
            for (d, s) in dst.chunks_exact_mut(2).zip(src) {
                d.copy_from_slice(&bf16::from_f32(*s).to_bits().to_le_bytes());
            }
        }
        _ => {
            for (x, b) in src.chunks_exact(bl).zip(dst.chunks_exact_mut(bb)) {
                quantize_block(ty, x, b);
            }
        }
    }
}

/// ggml's `nearest_int`: round half to even (exact for |v| < 2^22, like ggml's trick).
#[inline(always)]
fn nearest_int(v: f32) -> i32 {
    if v.abs() < 4_194_304.0 {
        let t = (v + 12_582_912.0).to_bits();
        (t & 0x007f_ffff) as i32 - 0x0040_0000
    } else {
        v.round_ties_even() as i32
    }
}

/// C's `roundf` (half away from zero) for values that fit an i32, without a libm call.
#[inline(always)]
fn roundf_i32(v: f32) -> i32 {
    if v.abs() < 8_388_608.0 {
        let t = v as i32; // truncates toward zero
        let frac = v - t as f32; // exact
        if frac >= 0.5 {
            t + 1
        } else if frac <= -0.5 {
            t - 1
        } else {
            t
        }
    } else {
        v.round() as i32
    }
}

/// Quantizes activation rows to Q8_0 / Q8_1 (or Q8_K) the way llama.cpp does on the
/// CPUs its reference outputs come from: its x86 (AVX/AVX2/AVX-512) `quantize_row_q8_0`
/// and `quantize_row_q8_1` scale by `127 / amax` and round half to even
/// (`_mm256_round_ps`), unlike the portable `_ref` quantizers used for weights (`1 / d`,
/// `roundf`). The logits of a quantized model are sensitive to single rounding flips, so
/// matching llama.cpp token for token needs the same rule here, on every SIMD level.
pub(crate) fn quantize_activation_blocks(ty: GgmlType, src: &[f32], dst: &mut [u8]) {
    if !matches!(ty, GgmlType::Q8_0 | GgmlType::Q8_1) {
        return quantize_blocks(ty, src, dst);
    }
    let bb = ty.block_bytes();
    let qs = if ty == GgmlType::Q8_1 { 4 } else { 2 };
    for (x, b) in src.chunks_exact(32).zip(dst.chunks_exact_mut(bb)) {
        let amax = x.iter().fold(0.0f32, |a, v| a.max(v.abs()));
        let d = amax / 127.0;
        let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
        put_f16(b, 0, d);
        let mut sum = 0i32;
        for j in 0..32 {
            let q = (x[j] * id).round_ties_even() as i32 as i8;
            sum += q as i32;
            b[qs + j] = q as u8;
        }
        if ty == GgmlType::Q8_1 {
            put_f16(b, 2, sum as f32 * d);
        }
    }
}

fn min_max(x: &[f32]) -> (f32, f32) {
    let mut mn = f32::MAX;
    let mut mx = -f32::MAX;
    for &v in x {
        mn = mn.min(v);
        mx = mx.max(v);
    }
    (mn, mx)
}

/// The value of largest magnitude, with its sign (first one on ties), and its magnitude.
fn signed_max(x: &[f32]) -> (f32, f32) {
    let (mut amax, mut max) = (0.0f32, 0.0f32);
    for &v in x {
        if v.abs() > amax {
            amax = v.abs();
            max = v;
        }
    }
    (max, amax)
}

fn quantize_block(ty: GgmlType, x: &[f32], b: &mut [u8]) {
    match ty {
        GgmlType::Q4_0 | GgmlType::Q5_0 => {
            let five = ty == GgmlType::Q5_0;
            let (max, _) = signed_max(x);
            let (levels, top) = if five { (-16.0, 31u8) } else { (-8.0, 15u8) };
            let d = max / levels;
            let id = if d != 0.0 { 1.0 / d } else { 0.0 };
            put_f16(b, 0, d);
            let off = if five { 16.5 } else { 8.5 };
            let mut qh = 0u32;
            let qs = if five { 6 } else { 2 };
            for j in 0..16 {
                let x0 = ((x[j] * id + off) as i32).clamp(0, top as i32) as u8;
                let x1 = ((x[j + 16] * id + off) as i32).clamp(0, top as i32) as u8;
                b[qs + j] = (x0 & 0xF) | ((x1 & 0xF) << 4);
                qh |= (((x0 >> 4) & 1) as u32) << j;
                qh |= (((x1 >> 4) & 1) as u32) << (j + 16);
            }
            if five {
                b[2..6].copy_from_slice(&qh.to_le_bytes());
            }
        }
        GgmlType::Q4_1 | GgmlType::Q5_1 => {
            let five = ty == GgmlType::Q5_1;
            let (mn, mx) = min_max(x);
            let top = if five { 31 } else { 15 };
            let d = (mx - mn) / top as f32;
            let id = if d != 0.0 { 1.0 / d } else { 0.0 };
            put_f16(b, 0, d);
            put_f16(b, 2, mn);
            let qs = if five { 8 } else { 4 };
            let mut qh = 0u32;
            for j in 0..16 {
                let x0 = (((x[j] - mn) * id + 0.5) as i32).clamp(0, top) as u8;
                let x1 = (((x[j + 16] - mn) * id + 0.5) as i32).clamp(0, top) as u8;
                b[qs + j] = (x0 & 0xF) | ((x1 & 0xF) << 4);
                qh |= (((x0 >> 4) & 1) as u32) << j;
                qh |= (((x1 >> 4) & 1) as u32) << (j + 16);
            }
            if five {
                b[4..8].copy_from_slice(&qh.to_le_bytes());
            }
        }
        GgmlType::Q8_0 | GgmlType::Q8_1 => {
            let amax = x.iter().fold(0.0f32, |a, v| a.max(v.abs()));
            let d = amax / 127.0;
            let id = if d != 0.0 { 1.0 / d } else { 0.0 };
            put_f16(b, 0, d);
            let qs = if ty == GgmlType::Q8_1 { 4 } else { 2 };
            let mut sum = 0i32;
            for j in 0..32 {
                let q = roundf_i32(x[j] * id) as i8;
                sum += q as i32;
                b[qs + j] = q as u8;
            }
            if ty == GgmlType::Q8_1 {
                put_f16(b, 2, sum as f32 * d);
            }
        }
        GgmlType::Q8_K => {
            let (max, amax) = signed_max(x);
            if amax == 0.0 {
                b.fill(0);
                return;
            }
            let iscale = -127.0f32 / max;
            for j in 0..256 {
                b[4 + j] = nearest_int(iscale * x[j]).min(127) as i8 as u8;
            }
            for g in 0..16 {
                let s: i32 = (0..16).map(|i| b[4 + 16 * g + i] as i8 as i32).sum();
                b[260 + 2 * g..262 + 2 * g].copy_from_slice(&(s as i16).to_le_bytes());
            }
            b[0..4].copy_from_slice(&(1.0 / iscale).to_le_bytes());
        }
        GgmlType::Q4_K | GgmlType::Q5_K => quantize_kq45(ty == GgmlType::Q5_K, x, b),
        GgmlType::Q6_K => quantize_q6k(x, b),
        GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => unreachable!("plain types"),
    }
}

/// A simple (not llama.cpp's optimal) Q4_K/Q5_K quantizer: per sub-block min/max.
fn quantize_kq45(five: bool, x: &[f32], b: &mut [u8]) {
    let top = if five { 31.0 } else { 15.0 };
    let mut scale = [0f32; 8];
    let mut mins = [0f32; 8];
    for j in 0..8 {
        let (mn, mx) = min_max(&x[32 * j..32 * j + 32]);
        let mn = mn.min(0.0);
        scale[j] = (mx - mn) / top;
        mins[j] = -mn;
    }
    let max_scale = scale.iter().fold(0f32, |a, &v| a.max(v));
    let max_min = mins.iter().fold(0f32, |a, &v| a.max(v));
    let d = put_f16(b, 0, max_scale / 63.0);
    let dmin = put_f16(b, 2, max_min / 63.0);
    let mut ls = [0u8; 8];
    let mut lm = [0u8; 8];
    for j in 0..8 {
        ls[j] = if d > 0.0 {
            nearest_int(scale[j] / d).clamp(0, 63) as u8
        } else {
            0
        };
        // Round the min up so values stay representable.
        lm[j] = if dmin > 0.0 {
            ((mins[j] / dmin).ceil() as i32).clamp(0, 63) as u8
        } else {
            0
        };
    }
    let sc = &mut b[4..16];
    for j in 0..4 {
        sc[j] = (ls[j] & 63) | ((ls[j + 4] >> 4) << 6);
        sc[j + 4] = (lm[j] & 63) | ((lm[j + 4] >> 4) << 6);
        sc[j + 8] = (ls[j + 4] & 0xF) | ((lm[j + 4] & 0xF) << 4);
    }
    let mut q = [0u8; 256];
    for j in 0..8 {
        let dl = d * ls[j] as f32;
        let ml = dmin * lm[j] as f32;
        for l in 0..32 {
            let v = x[32 * j + l];
            q[32 * j + l] = if dl > 0.0 {
                nearest_int((v + ml) / dl).clamp(0, top as i32) as u8
            } else {
                0
            };
        }
    }
    let (qh_off, qs_off) = if five { (16, 48) } else { (0, 16) };
    for c in 0..4 {
        for l in 0..32 {
            let lo = q[64 * c + l];
            let hi = q[64 * c + 32 + l];
            b[qs_off + 32 * c + l] = (lo & 0xF) | ((hi & 0xF) << 4);
            if five {
                b[qh_off + l] |= ((lo >> 4) << (2 * c)) | ((hi >> 4) << (2 * c + 1));
            }
        }
    }
}

/// A simple Q6_K quantizer: per 16-value sub-block signed max, i8 scales.
fn quantize_q6k(x: &[f32], b: &mut [u8]) {
    let mut scale = [0f32; 16];
    for j in 0..16 {
        let (max, _) = signed_max(&x[16 * j..16 * j + 16]);
        scale[j] = max / -32.0;
    }
    let (smax, samax) = signed_max(&scale);
    let d = if samax > 0.0 {
        put_f16(b, 208, smax / -128.0)
    } else {
        put_f16(b, 208, 0.0)
    };
    let mut q = [0u8; 256];
    for j in 0..16 {
        let ls = if d != 0.0 {
            nearest_int(scale[j] / d).clamp(-128, 127)
        } else {
            0
        };
        b[192 + j] = ls as i8 as u8;
        let dl = d * ls as f32;
        for l in 0..16 {
            let v = x[16 * j + l];
            q[16 * j + l] = if dl != 0.0 {
                (nearest_int(v / dl).clamp(-32, 31) + 32) as u8
            } else {
                32
            };
        }
    }
    for n in 0..2 {
        for l in 0..32 {
            let q1 = q[128 * n + l];
            let q2 = q[128 * n + l + 32];
            let q3 = q[128 * n + l + 64];
            let q4 = q[128 * n + l + 96];
            b[64 * n + l] = (q1 & 0xF) | ((q3 & 0xF) << 4);
            b[64 * n + l + 32] = (q2 & 0xF) | ((q4 & 0xF) << 4);
            b[128 + 32 * n + l] =
                (q1 >> 4) | ((q2 >> 4) << 2) | ((q3 >> 4) << 4) | ((q4 >> 4) << 6);
        }
    }
}
