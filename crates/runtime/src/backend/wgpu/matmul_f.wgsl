// out[t][row] = dot(weight row, x[t]) for float weights (F32, F16, BF16), which take the
// f32 activations as the CPU backend does. Same grid as matmul.wgsl.

// a: (rows in this weight chunk, k, n_tokens, output row stride);
// b: (first output row of the chunk, row bytes, 0, 0).
@group(0) @binding(1) var<storage, read> w: array<u32>;
@group(0) @binding(2) var<storage, read> xf: array<f32>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;

override WTYPE: u32;

// Tokens per workgroup in `matmul_rows` (matmul.wgsl's tile).
const TILE: u32 = 8u;
var<workgroup> partial: array<f32, 512>;

// This lane's share of the dot product of the weight row at byte `base` with x[t].
fn row_dot(base: u32, t: u32, lane: u32) -> f32 {
    let k = p.a.y;
    let bb = block_bytes();
    var acc = 0.0;
    for (var j = lane; j < k; j += LANES) {
        acc += dequant(base + j * bb, 0u) * xf[t * k + j];
    }
    return acc;
}

// Each lane's share for activation rows t0..t0+nt-1 (nt <= TILE), one at a time.
fn row_dot_n(base: u32, t0: u32, nt: u32, lane: u32) -> array<f32, TILE> {
    var acc: array<f32, TILE>;
    for (var i = 0u; i < TILE; i++) {
        if (i < nt) {
            acc[i] = row_dot(base, t0 + i, lane);
        }
    }
    return acc;
}


// The expert ids of `matmul_rows_id` (matmul_rows.wgsl).
@group(0) @binding(4) var<storage, read> ids: array<u32>;
