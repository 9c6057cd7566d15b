// GGUF block access shared by embed.wgsl and matmul.wgsl. The including shader declares
// `w: array<u32>`, the raw bytes of a weight (little-endian), and `override WTYPE: u32`,
// the ggml type id. Layouts are llama.cpp's, bit for bit.

fn wbyte(off: u32) -> u32 {
    return (w[off >> 2u] >> ((off & 3u) * 8u)) & 0xffu;
}

fn wi8(off: u32) -> i32 {
    return (i32(wbyte(off)) << 24u) >> 24u;
}

// A 16-bit field at an even offset.
fn wu16(off: u32) -> u32 {
    return (w[off >> 2u] >> ((off & 2u) * 8u)) & 0xffffu;
}

// A 32-bit field at an even offset.
fn wu32(off: u32) -> u32 {
    return wu16(off) | (wu16(off + 2u) << 16u);
}

// Exact f16 -> f32, subnormals included (some drivers flush them in unpack2x16float).
fn f16_bits_to_f32(h: u32) -> f32 {
    let e = (h >> 10u) & 0x1fu;
    let m = h & 0x3ffu;
    let s = (h & 0x8000u) << 16u;
    if (e == 0u) {
        let v = f32(m) * 5.9604645e-8;
        return select(v, -v, s != 0u);
    }
    if (e == 31u) {
        return bitcast<f32>(s | 0x7f800000u | (m << 13u));
    }
    return bitcast<f32>(s | ((e + 112u) << 23u) | (m << 13u));
}

fn wf16(off: u32) -> f32 {
    return f16_bits_to_f32(wu16(off));
}

// Q4_K/Q5_K packed 6-bit scale and min of sub-block j (llama.cpp get_scale_min_k4).
fn scale_min_k4(j: u32, q: u32) -> vec2<u32> {
    if (j < 4u) {
        return vec2<u32>(wbyte(q + j) & 63u, wbyte(q + j + 4u) & 63u);
    }
    let sc = (wbyte(q + j + 4u) & 0xfu) | ((wbyte(q + j - 4u) >> 6u) << 4u);
    let m = (wbyte(q + j + 4u) >> 4u) | ((wbyte(q + j) >> 6u) << 4u);
    return vec2<u32>(sc, m);
}

// Values per block and bytes per block of WTYPE.
fn block_len() -> u32 {
    switch WTYPE {
        case 0u, 1u, 30u: { return 1u; }
        case 12u, 13u, 14u: { return 256u; }
        default: { return 32u; }
    }
}

fn block_bytes() -> u32 {
    switch WTYPE {
        case 0u: { return 4u; }
        case 1u, 30u: { return 2u; }
        case 2u: { return 18u; }
        case 3u: { return 20u; }
        case 6u: { return 22u; }
        case 7u: { return 24u; }
        case 8u: { return 34u; }
        case 12u: { return 144u; }
        case 13u: { return 176u; }
        default: { return 210u; }
    }
}

// Value j of the block at byte `o`, as llama.cpp's dequantize_row_* computes it.
fn dequant(o: u32, j: u32) -> f32 {
    switch WTYPE {
        case 0u: { return bitcast<f32>(wu32(o)); }
        case 1u: { return wf16(o); }
        case 30u: { return bitcast<f32>(wu16(o) << 16u); }
        case 2u: {
            let b = wbyte(o + 2u + (j & 15u));
            let q = select(b & 15u, b >> 4u, j >= 16u);
            return f32(i32(q) - 8) * wf16(o);
        }
        case 3u: {
            let b = wbyte(o + 4u + (j & 15u));
            let q = select(b & 15u, b >> 4u, j >= 16u);
            return f32(q) * wf16(o) + wf16(o + 2u);
        }
        case 6u: {
            let b = wbyte(o + 6u + (j & 15u));
            let q = select(b & 15u, b >> 4u, j >= 16u) | (((wu32(o + 2u) >> j) & 1u) << 4u);
            return f32(i32(q) - 16) * wf16(o);
        }
        case 7u: {
            let b = wbyte(o + 8u + (j & 15u));
            let q = select(b & 15u, b >> 4u, j >= 16u) | (((wu32(o + 4u) >> j) & 1u) << 4u);
            return f32(q) * wf16(o) + wf16(o + 2u);
        }
        case 8u: { return f32(wi8(o + 2u + j)) * wf16(o); }
        case 12u, 13u: {
            let five = WTYPE == 13u;
            let c = j / 64u;
            let hi = (j % 64u) >= 32u;
            let l = j % 32u;
            let sub = 2u * c + select(0u, 1u, hi);
            let sm = scale_min_k4(sub, o + 4u);
            let qs = select(o + 16u, o + 48u, five);
            let b = wbyte(qs + 32u * c + l);
            var q = select(b & 15u, b >> 4u, hi);
            if (five) {
                q = q | (((wbyte(o + 16u + l) >> sub) & 1u) << 4u);
            }
            return (wf16(o) * f32(sm.x)) * f32(q) - wf16(o + 2u) * f32(sm.y);
        }
        default: {
            // Q6_K
            let n = j / 128u;
            let r = j % 128u;
            let quarter = r / 32u;
            let l = r % 32u;
            let ql = o + 64u * n + l + select(0u, 32u, (quarter & 1u) == 1u);
            let lb = wbyte(ql);
            let low = select(lb & 15u, lb >> 4u, quarter >= 2u);
            let hb = (wbyte(o + 128u + 32u * n + l) >> (2u * quarter)) & 3u;
            let q = i32(low | (hb << 4u)) - 32;
            let sc = wi8(o + 192u + 8u * n + l / 16u + 2u * quarter);
            return wf16(o + 208u) * f32(sc) * f32(q);
        }
    }
}
