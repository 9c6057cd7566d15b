// Rotary position embedding with a cos/sin table computed on the host (the same f32
// recurrence as the CPU backend, so both rotate by identical factors). One invocation
// per (token, head, pair).

// a: (n_tokens, n_heads, head_dim, n_dims); b.x: 0 = Normal (adjacent pairs), 1 = NeoX.
@group(0) @binding(1) var<storage, read_write> x: array<f32>;
@group(0) @binding(2) var<storage, read> cs: array<f32>;

@compute @workgroup_size(64)
fn rope(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let half = p.a.w / 2u;
    let i = gid.x + gid.y * nwg.x * 64u;
    if (i >= p.a.x * p.a.y * half) {
        return;
    }
    let pair = i % half;
    let head = (i / half) % p.a.y;
    let t = i / (half * p.a.y);
    let base = (t * p.a.y + head) * p.a.z;
    var ia = base + 2u * pair;
    var ib = ia + 1u;
    if (p.b.x == 1u) {
        ia = base + pair;
        ib = ia + half;
    }
    let c = cs[2u * (t * half + pair)];
    let s = cs[2u * (t * half + pair) + 1u];
    let x0 = x[ia];
    let x1 = x[ib];
    // The x1 product rounded, the x0 product fused, as gcc contracts ggml's rotate_pairs
    // (and the CPU backend computes it).
    x[ia] = fma(x0, c, -(x1 * s));
    x[ib] = fma(x0, s, x1 * c);
}
