// out[t][row] = dot(weight row, x[t]) for float weights (F32, F16, BF16), which take the
// f32 activations as the CPU backend does. Same grid as matmul.wgsl.

// a: (rows in this weight chunk, k, n_tokens, output row stride);
// b: (first output row of the chunk, row bytes, 0, 0).
@group(0) @binding(1) var<storage, read> w: array<u32>;
@group(0) @binding(2) var<storage, read> xf: array<f32>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;

override WTYPE: u32;

var<workgroup> partial: array<f32, 64>;

fn finish(lid: u32, row: u32, t: u32, acc: f32) {
    partial[lid] = acc;
    workgroupBarrier();
    if ((lid & 7u) == 0u && row < p.a.x) {
        var s = 0.0;
        for (var i = 0u; i < 8u; i++) {
            s += partial[lid + i];
        }
        out[t * p.a.w + p.b.x + row] = s;
    }
}

@compute @workgroup_size(64)
fn matmul_f(@builtin(local_invocation_id) lid: vec3<u32>,
            @builtin(workgroup_id) wid: vec3<u32>,
            @builtin(num_workgroups) nwg: vec3<u32>) {
    let lane = lid.x & 7u;
    let row = (wid.x + wid.y * nwg.x) * 8u + lid.x / 8u;
    let t = wid.z;
    var acc = 0.0;
    if (row < p.a.x) {
        let k = p.a.y;
        let base = row * p.b.y;
        let bb = block_bytes();
        for (var j = lane; j < k; j += 8u) {
            acc += dequant(base + j * bb, 0u) * xf[t * k + j];
        }
    }
    finish(lid.x, row, t, acc);
}
