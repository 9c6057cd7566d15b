// out[t][row] = dot(weight row, activation row t), reading the GGUF blocks directly.
//
// Quantized weights (this file) take activations quantized the way llama.cpp's CPU path
// pairs them (quantize.wgsl): Q8_0 for Q4_0/Q5_0/Q8_0, Q8_1 for Q4_1/Q5_1, Q8_K for the
// K-quants, and sum exact integer dots in f32. Float weights (matmul_f.wgsl) take the
// f32 activations. A workgroup computes ROWS rows, LANES lanes per row (matmul_rows.wgsl).
//
// A row is cut into items: a 32-value block, or a quarter of a K-quant super-block (64
// values under one pair of scales). Lane l takes items l, l + LANES, ...; the weights of an
// item are read as whole words, laid out as 8-bit integers four to a word (a nibble
// plane is `word & 0x0f0f0f0f`), and multiplied by the activations' words with
// `dot4I8Packed` (one instruction where the device has integer dot products). The
// item's integer sums become f32 once, so every token's value is the same sum of
// per-item terms whichever entry point computes it, for one token or a tile of them:
// a tile decodes an item's weights once for all its tokens.

// a: (rows in this weight chunk, k, n_tokens, output row stride);
// b: (first output row of the chunk, row bytes, 0, 0).
@group(0) @binding(1) var<storage, read> w: array<u32>;
// Four words (16 values) per element: an item's activations are whole 16-byte runs, so
// each is one load, where four single words were.
@group(0) @binding(2) var<storage, read> aq: array<vec4<u32>>;
@group(0) @binding(3) var<storage, read> asc: array<f32>;
@group(0) @binding(4) var<storage, read_write> out: array<f32>;

override WTYPE: u32;

// Tokens per workgroup in `matmul_rows`, and the sums each lane keeps.
const TILE: u32 = 8u;
var<workgroup> partial: array<f32, 512>;

const NIB: u32 = 0x0f0f0f0fu;
const ONES: u32 = 0x01010101u;

// The word at an even byte offset (blocks of 18, 22, 34 or 210 bytes start at one).
fn ww(off: u32) -> u32 {
    let i = off >> 2u;
    if ((off & 2u) == 0u) {
        return w[i];
    }
    return (w[i] >> 16u) | (w[i + 1u] << 16u);
}

// Bits 0..3 of x, one to the low bit of each byte.
fn spread4(x: u32) -> u32 {
    return (x & 1u) | ((x & 2u) << 7u) | ((x & 4u) << 14u) | ((x & 8u) << 21u);
}

// A 32-value block (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) at byte `o`, block b of the row.
fn item_q32(o: u32, b: u32, t0: u32, nt: u32, acc: ptr<function, array<f32, TILE>>) {
    let nb = p.a.y / 32u;
    // Values 4j..4j+3 in q[j]; `bias` is what was added to each (8 or 16), `qs` where
    // the quants start.
    var q: array<u32, 8>;
    var bias = 0i;
    switch WTYPE {
        case 2u, 3u: {
            let qs = select(o + 2u, o + 4u, WTYPE == 3u);
            for (var j = 0u; j < 4u; j++) {
                let x = ww(qs + 4u * j);
                q[j] = x & NIB;
                q[j + 4u] = (x >> 4u) & NIB;
            }
            bias = select(8i, 0i, WTYPE == 3u);
        }
        case 6u, 7u: {
            let one = WTYPE == 7u;
            let qh = ww(select(o + 2u, o + 4u, one));
            let qs = select(o + 6u, o + 8u, one);
            for (var j = 0u; j < 4u; j++) {
                let x = ww(qs + 4u * j);
                q[j] = (x & NIB) | (spread4(qh >> (4u * j)) << 4u);
                q[j + 4u] = ((x >> 4u) & NIB) | (spread4(qh >> (16u + 4u * j)) << 4u);
            }
            bias = select(16i, 0i, one);
        }
        default: {
            // Q8_0
            for (var j = 0u; j < 8u; j++) {
                q[j] = ww(o + 2u + 4u * j);
            }
        }
    }
    let d = wf16(o);
    for (var i = 0u; i < TILE; i++) {
        if (i < nt) {
            let t = t0 + i;
            let ab = t * p.a.y + b * 32u;
            var si = 0i;
            var sa = 0i;
            for (var h = 0u; h < 2u; h++) {
                let a = aq[(ab >> 4u) + h];
                for (var j = 0u; j < 4u; j++) {
                    si += dot4I8Packed(q[4u * h + j], a[j]);
                    if (bias != 0i) {
                        sa += dot4I8Packed(ONES, a[j]);
                    }
                }
            }
            si -= bias * sa;
            if (WTYPE == 3u || WTYPE == 7u) {
                let s = 2u * (t * nb + b);
                (*acc)[i] += f32(si) * (d * asc[s]) + wf16(o + 2u) * asc[s + 1u];
            } else {
                (*acc)[i] += f32(si) * (d * asc[t * nb + b]);
            }
        }
    }
}

// Quarter c of a Q4_K/Q5_K super-block at byte `o` (values 64c..64c+63: sub-blocks 2c
// and 2c + 1, low and high nibbles of the same 32 bytes), block b of the row.
fn item_q45k(o: u32, b: u32, c: u32, t0: u32, nt: u32, acc: ptr<function, array<f32, TILE>>) {
    let nb = p.a.y / 256u;
    let five = WTYPE == 13u;
    let qs = select(o + 16u, o + 48u, five) + 32u * c;
    var lo: array<u32, 8>;
    var hi: array<u32, 8>;
    for (var j = 0u; j < 8u; j++) {
        let x = w[(qs >> 2u) + j];
        lo[j] = x & NIB;
        hi[j] = (x >> 4u) & NIB;
        if (five) {
            let h = w[((o + 16u) >> 2u) + j];
            lo[j] |= ((h >> (2u * c)) & ONES) << 4u;
            hi[j] |= ((h >> (2u * c + 1u)) & ONES) << 4u;
        }
    }
    let a1 = scale_min_k4(2u * c, o + 4u);
    let a2 = scale_min_k4(2u * c + 1u, o + 4u);
    let d = wf16(o);
    let dmin = wf16(o + 2u);
    for (var i = 0u; i < TILE; i++) {
        if (i < nt) {
            let t = t0 + i;
            let ab = (t * p.a.y + b * 256u + 64u * c) >> 4u;
            var s1 = 0i;
            var s2 = 0i;
            for (var h = 0u; h < 2u; h++) {
                let a1 = aq[ab + h];
                let a2 = aq[ab + 2u + h];
                for (var j = 0u; j < 4u; j++) {
                    s1 += dot4I8Packed(lo[4u * h + j], a1[j]);
                    s2 += dot4I8Packed(hi[4u * h + j], a2[j]);
                }
            }
            let sb = (t * nb + b) * 17u + 1u + 4u * c;
            let bs1 = i32(asc[sb]) + i32(asc[sb + 1u]);
            let bs2 = i32(asc[sb + 2u]) + i32(asc[sb + 3u]);
            let si = i32(a1.x) * s1 + i32(a2.x) * s2;
            let sm = i32(a1.y) * bs1 + i32(a2.y) * bs2;
            let dy = asc[(t * nb + b) * 17u];
            (*acc)[i] += d * dy * f32(si) - dmin * dy * f32(sm);
        }
    }
}

// Quarter c of a Q6_K super-block at byte `o`: half n = c / 2 of the block, positions
// l = 16h..16h+15 (h = c % 2) of each of its four 32-value runs, whose scales are
// sc[h], sc[h + 2], sc[h + 4] and sc[h + 6]; block b of the row.
fn item_q6k(o: u32, b: u32, c: u32, t0: u32, nt: u32, acc: ptr<function, array<f32, TILE>>) {
    let nb = p.a.y / 256u;
    let n = c / 2u;
    let h = c % 2u;
    let ql = o + 64u * n + 16u * h;
    let qh = o + 128u + 32u * n + 16u * h;
    var q: array<u32, 16>;
    for (var j = 0u; j < 4u; j++) {
        let a = ww(ql + 4u * j);
        let e = ww(ql + 32u + 4u * j);
        let x = ww(qh + 4u * j);
        q[j] = (a & NIB) | ((x & 0x03030303u) << 4u);
        q[4u + j] = (e & NIB) | (((x >> 2u) & 0x03030303u) << 4u);
        q[8u + j] = ((a >> 4u) & NIB) | (((x >> 4u) & 0x03030303u) << 4u);
        q[12u + j] = ((e >> 4u) & NIB) | (((x >> 6u) & 0x03030303u) << 4u);
    }
    var sc: array<i32, 4>;
    for (var r = 0u; r < 4u; r++) {
        sc[r] = wi8(o + 192u + 8u * n + h + 2u * r);
    }
    let d = wf16(o + 208u);
    for (var i = 0u; i < TILE; i++) {
        if (i < nt) {
            let t = t0 + i;
            let ab = t * p.a.y + b * 256u + 128u * n + 16u * h;
            let sb = (t * nb + b) * 17u;
            var si = 0i;
            for (var r = 0u; r < 4u; r++) {
                var s = 0i;
                let a = aq[(ab + 32u * r) >> 4u];
                for (var j = 0u; j < 4u; j++) {
                    s += dot4I8Packed(q[4u * r + j], a[j]);
                }
                // The quants are stored plus 32: take 32 times the run's activations off.
                let run_sum = i32(asc[sb + 1u + 8u * n + h + 2u * r]);
                si += sc[r] * (s - 32 * run_sum);
            }
            (*acc)[i] += d * asc[sb] * f32(si);
        }
    }
}

// Each lane's share of the dot products of the weight row at byte `base` with
// activation rows t0..t0+nt-1 (nt <= TILE): items lane, lane + LANES, ...
fn row_dot_n(base: u32, t0: u32, nt: u32, lane: u32) -> array<f32, TILE> {
    var acc: array<f32, TILE>;
    let bl = block_len();
    let bb = block_bytes();
    let nb = p.a.y / bl;
    let per = select(1u, 4u, bl == 256u);
    for (var it = lane; it < nb * per; it += LANES) {
        let b = it / per;
        let o = base + b * bb;
        switch WTYPE {
            case 12u, 13u: {
                item_q45k(o, b, it % per, t0, nt, &acc);
            }
            case 14u: {
                item_q6k(o, b, it % per, t0, nt, &acc);
            }
            default: {
                item_q32(o, b, t0, nt, &acc);
            }
        }
    }
    return acc;
}

// This lane's share of the dot product of the weight row at byte `base` with
// activation row t: `row_dot_n`'s for one token, the same bits.
fn row_dot(base: u32, t: u32, lane: u32) -> f32 {
    return row_dot_n(base, t, 1u, lane)[0];
}


// The expert ids of `matmul_rows_id` (matmul_rows.wgsl).
@group(0) @binding(5) var<storage, read> ids: array<u32>;
