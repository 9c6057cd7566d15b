// The second step of split attention (attention.wgsl's `attention_split`): for each
// (query head, token), the splits' sums rescaled to the largest score of all and
// divided by their total; a query that sees no key gets zeros, as in `attention`.

// a: (n_tokens, n_heads, splits, head_dim); c.x: the first row of the output.
@group(0) @binding(1) var<storage, read> parts: array<f32>;
@group(0) @binding(2) var<storage, read_write> out: array<f32>;

@compute @workgroup_size(64)
fn attention_combine(@builtin(local_invocation_id) lid: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>) {
    let h = wid.x;
    let t = wid.y;
    let n_heads = p.a.y;
    let splits = p.a.z;
    let hd = p.a.w;
    let stride = hd + 2u;
    let first = (t * n_heads + h) * splits * stride;
    // A split that saw a key has a sum of at least 1 (its largest score's exp(0)).
    var mx = -3.0e38;
    for (var s = 0u; s < splits; s++) {
        if (parts[first + s * stride + 1u] > 0.0) {
            mx = max(mx, parts[first + s * stride]);
        }
    }
    var total = 0.0;
    for (var s = 0u; s < splits; s++) {
        let l = parts[first + s * stride + 1u];
        if (l > 0.0) {
            total += l * exp(parts[first + s * stride] - mx);
        }
    }
    let inv = select(0.0, 1.0 / total, total > 0.0);
    let qo = ((p.c.x + t) * n_heads + h) * hd;
    for (var d = lid.x; d < hd; d += 64u) {
        var acc = 0.0;
        for (var s = 0u; s < splits; s++) {
            let at = first + s * stride;
            if (parts[at + 1u] > 0.0) {
                acc += parts[at + 2u + d] * exp(parts[at] - mx);
            }
        }
        out[qo + d] = acc * inv;
    }
}
