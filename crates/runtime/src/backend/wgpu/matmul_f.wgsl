// out[t][row] = dot(weight row, x[t]) for float weights (F32, F16, BF16), which take the
// f32 activations as the CPU backend does. Same grid as matmul.wgsl.

// a: (rows in this weight chunk, k, n_tokens, output row stride);
// b: (first output row of the chunk, row bytes, 0, 0).
@group(0) @binding(1) var<storage, read> w: array<u32>;
@group(0) @binding(2) var<storage, read> xf: array<f32>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;

override WTYPE: u32;

var<workgroup> partial: array<f32, 64>;

// As matmul.wgsl's.
fn finish(lid: u32, keep: bool, at: u32, acc: f32) {
    partial[lid] = acc;
    workgroupBarrier();
    if ((lid & 7u) == 0u && keep) {
        var s = 0.0;
        for (var i = 0u; i < 8u; i++) {
            s += partial[lid + i];
        }
        out[at] = s;
    }
}

// This lane's share of the dot product of the weight row at byte `base` with x[t].
fn row_dot(base: u32, t: u32, lane: u32) -> f32 {
    let k = p.a.y;
    let bb = block_bytes();
    var acc = 0.0;
    for (var j = lane; j < k; j += 8u) {
        acc += dequant(base + j * bb, 0u) * xf[t * k + j];
    }
    return acc;
}

@compute @workgroup_size(64)
fn matmul_f(@builtin(local_invocation_id) lid: vec3<u32>,
            @builtin(workgroup_id) wid: vec3<u32>,
            @builtin(num_workgroups) nwg: vec3<u32>) {
    let row = (wid.x + wid.y * nwg.x) * 8u + lid.x / 8u;
    let t = wid.z;
    var acc = 0.0;
    if (row < p.a.x) {
        acc = row_dot(row * p.b.y, t, lid.x & 7u);
    }
    finish(lid.x, row < p.a.x, t * p.a.w + p.b.x + row, acc);
}

// The expert-id product of matmul.wgsl's matmul_q_id for float weights; same
// parameters.
@group(0) @binding(4) var<storage, read> ids: array<u32>;

fn id_row(row: u32, i: u32) -> vec2<u32> {
    let g = ids[i] * p.a.w + row;
    let inside = row < p.a.w && g >= p.b.x && g - p.b.x < p.a.x;
    return vec2<u32>(select(0u, 1u, inside), g - p.b.x);
}

@compute @workgroup_size(64)
fn matmul_f_id(@builtin(local_invocation_id) lid: vec3<u32>,
               @builtin(workgroup_id) wid: vec3<u32>,
               @builtin(num_workgroups) nwg: vec3<u32>) {
    let row = (wid.x + wid.y * nwg.x) * 8u + lid.x / 8u;
    let i = wid.z;
    let r = id_row(row, i);
    var acc = 0.0;
    if (r.x == 1u) {
        acc = row_dot(r.y * p.b.y, i / p.b.z, lid.x & 7u);
    }
    finish(lid.x, r.x == 1u, i * p.a.w + row, acc);
}
