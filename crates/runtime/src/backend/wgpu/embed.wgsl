// Embedding lookup: rows `ids` of a quantized table, dequantized to f32.

// a: (n_tokens, cols, first row of this table chunk, rows in the chunk); b.x: row bytes.
@group(0) @binding(1) var<storage, read> w: array<u32>;
@group(0) @binding(2) var<storage, read> ids: array<u32>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;

override WTYPE: u32;

@compute @workgroup_size(64)
fn embed(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = gid.x + gid.y * nwg.x * 64u;
    if (i >= p.a.x * p.a.y) {
        return;
    }
    let t = i / p.a.y;
    let j = i % p.a.y;
    let id = ids[t];
    if (id < p.a.z || id >= p.a.z + p.a.w) {
        return;
    }
    let bl = block_len();
    let o = (id - p.a.z) * p.b.x + (j / bl) * block_bytes();
    out[i] = dequant(o, j % bl);
}
