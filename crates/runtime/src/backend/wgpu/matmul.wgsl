// out[t][row] = dot(weight row, activation row t), reading the GGUF blocks directly.
//
// Quantized weights (this file) take activations quantized the way llama.cpp's CPU path
// pairs them (quantize.wgsl): Q8_0 for Q4_0/Q5_0/Q8_0, Q8_1 for Q4_1/Q5_1, Q8_K for the
// K-quants, and sum exact integer block dots in f32 as quant::scalar does. Float weights
// (matmul_f.wgsl) take the f32 activations. A workgroup computes 8 rows of one token, 8
// invocations per row striding over the blocks.

// a: (rows in this weight chunk, k, n_tokens, output row stride);
// b: (first output row of the chunk, row bytes, 0, 0).
@group(0) @binding(1) var<storage, read> w: array<u32>;
@group(0) @binding(2) var<storage, read> aq: array<i32>;
@group(0) @binding(3) var<storage, read> asc: array<f32>;
@group(0) @binding(4) var<storage, read_write> out: array<f32>;

override WTYPE: u32;

var<workgroup> partial: array<f32, 64>;

// Q8_0/Q8_1-paired 32-value blocks: integer dot of block b of row `o` with token t.
fn dot_q32(o: u32, t: u32, b: u32) -> f32 {
    let nb = p.a.y / 32u;
    let ab = t * p.a.y + b * 32u;
    var si = 0i;
    switch WTYPE {
        case 2u: {
            for (var j = 0u; j < 16u; j++) {
                let q = wbyte(o + 2u + j);
                si += (i32(q & 15u) - 8) * aq[ab + j] + (i32(q >> 4u) - 8) * aq[ab + 16u + j];
            }
            return f32(si) * (wf16(o) * asc[t * nb + b]);
        }
        case 3u: {
            for (var j = 0u; j < 16u; j++) {
                let q = wbyte(o + 4u + j);
                si += i32(q & 15u) * aq[ab + j] + i32(q >> 4u) * aq[ab + 16u + j];
            }
            let s = 2u * (t * nb + b);
            return f32(si) * (wf16(o) * asc[s]) + wf16(o + 2u) * asc[s + 1u];
        }
        case 6u: {
            let qh = wu32(o + 2u);
            for (var j = 0u; j < 16u; j++) {
                let q = wbyte(o + 6u + j);
                let lo = i32((q & 15u) | (((qh >> j) & 1u) << 4u)) - 16;
                let hi = i32((q >> 4u) | (((qh >> (j + 16u)) & 1u) << 4u)) - 16;
                si += lo * aq[ab + j] + hi * aq[ab + 16u + j];
            }
            return f32(si) * (wf16(o) * asc[t * nb + b]);
        }
        case 7u: {
            let qh = wu32(o + 4u);
            for (var j = 0u; j < 16u; j++) {
                let q = wbyte(o + 8u + j);
                let lo = i32((q & 15u) | (((qh >> j) & 1u) << 4u));
                let hi = i32((q >> 4u) | (((qh >> (j + 16u)) & 1u) << 4u));
                si += lo * aq[ab + j] + hi * aq[ab + 16u + j];
            }
            let s = 2u * (t * nb + b);
            return f32(si) * (wf16(o) * asc[s]) + wf16(o + 2u) * asc[s + 1u];
        }
        default: {
            // Q8_0
            for (var j = 0u; j < 32u; j++) {
                si += wi8(o + 2u + j) * aq[ab + j];
            }
            return f32(si) * (wf16(o) * asc[t * nb + b]);
        }
    }
}

// K-quant super-blocks of 256 with Q8_K activations (d, then 16 block sums).
fn dot_k(o: u32, t: u32, b: u32) -> f32 {
    let nb = p.a.y / 256u;
    let ab = t * p.a.y + b * 256u;
    let sb = (t * nb + b) * 17u;
    let dy = asc[sb];
    if (WTYPE == 14u) {
        var si = 0i;
        for (var n = 0u; n < 2u; n++) {
            let ql = o + 64u * n;
            let qh = o + 128u + 32u * n;
            let sc = o + 192u + 8u * n;
            let ya = ab + 128u * n;
            var part = array<i32, 8>(0, 0, 0, 0, 0, 0, 0, 0);
            for (var l = 0u; l < 32u; l++) {
                let is = l / 16u;
                let a = wbyte(ql + l);
                let c = wbyte(ql + l + 32u);
                let h = wbyte(qh + l);
                let q1 = i32((a & 15u) | ((h & 3u) << 4u)) - 32;
                let q2 = i32((c & 15u) | (((h >> 2u) & 3u) << 4u)) - 32;
                let q3 = i32((a >> 4u) | (((h >> 4u) & 3u) << 4u)) - 32;
                let q4 = i32((c >> 4u) | (((h >> 6u) & 3u) << 4u)) - 32;
                part[is] += q1 * aq[ya + l];
                part[is + 2u] += q2 * aq[ya + l + 32u];
                part[is + 4u] += q3 * aq[ya + l + 64u];
                part[is + 6u] += q4 * aq[ya + l + 96u];
            }
            for (var i = 0u; i < 8u; i++) {
                si += wi8(sc + i) * part[i];
            }
        }
        return wf16(o + 208u) * dy * f32(si);
    }
    let five = WTYPE == 13u;
    let qs = select(o + 16u, o + 48u, five);
    var si = 0i;
    var sm = 0i;
    for (var c = 0u; c < 4u; c++) {
        let a1 = scale_min_k4(2u * c, o + 4u);
        let a2 = scale_min_k4(2u * c + 1u, o + 4u);
        var s1 = 0i;
        var s2 = 0i;
        for (var l = 0u; l < 32u; l++) {
            let q = wbyte(qs + 32u * c + l);
            var lo = q & 15u;
            var hi = q >> 4u;
            if (five) {
                let h = wbyte(o + 16u + l);
                lo |= ((h >> (2u * c)) & 1u) << 4u;
                hi |= ((h >> (2u * c + 1u)) & 1u) << 4u;
            }
            s1 += i32(lo) * aq[ab + 64u * c + l];
            s2 += i32(hi) * aq[ab + 64u * c + 32u + l];
        }
        si += i32(a1.x) * s1 + i32(a2.x) * s2;
        let bs = i32(asc[sb + 1u + 4u * c]) + i32(asc[sb + 2u + 4u * c]);
        let bs2 = i32(asc[sb + 3u + 4u * c]) + i32(asc[sb + 4u + 4u * c]);
        sm += i32(a1.y) * bs + i32(a2.y) * bs2;
    }
    return wf16(o) * dy * f32(si) - wf16(o + 2u) * dy * f32(sm);
}

// This lane's share of the dot product of the weight row at byte `base` with
// activation row t: blocks lane, lane + 8, ...
fn row_dot(base: u32, t: u32, lane: u32) -> f32 {
    let bl = block_len();
    let bb = block_bytes();
    let nb = p.a.y / bl;
    var acc = 0.0;
    for (var b = lane; b < nb; b += 8u) {
        if (bl == 256u) {
            acc += dot_k(base + b * bb, t, b);
        } else {
            acc += dot_q32(base + b * bb, t, b);
        }
    }
    return acc;
}


// The expert ids of `matmul_rows_id` (matmul_rows.wgsl).
@group(0) @binding(5) var<storage, read> ids: array<u32>;
