// RMSNorm of each row, times a scale vector: out = (x * 1/sqrt(mean(x^2) + eps)) * scale.
// One workgroup per row. The CPU backend sums the f32 squares in f64 (as ggml does);
// here the sum is kept as an unevaluated pair of f32 (hi + lo, error-free additions),
// which is as exact for these lengths, so both round the mean to the same f32.

// a: (rows, row length, first input row, 0); f.x: eps.
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read> scale: array<f32>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;

var<workgroup> red: array<vec2<f32>, 64>;

// a + b as (sum, rounding error), exactly.
fn two_sum(a: f32, b: f32) -> vec2<f32> {
    let s = a + b;
    let bb = s - a;
    return vec2<f32>(s, (a - (s - bb)) + (b - bb));
}

fn add_pair(x: vec2<f32>, y: vec2<f32>) -> vec2<f32> {
    let s = two_sum(x.x, y.x);
    return two_sum(s.x, s.y + x.y + y.y);
}

@compute @workgroup_size(64)
fn rms_norm(@builtin(local_invocation_id) lid: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>) {
    let n = p.a.y;
    let src = (wid.x + p.a.z) * n;
    var s = vec2<f32>(0.0, 0.0);
    for (var j = lid.x; j < n; j += 64u) {
        let v = x[src + j];
        s = add_pair(s, vec2<f32>(v * v, 0.0));
    }
    red[lid.x] = s;
    workgroupBarrier();
    for (var stride = 32u; stride > 0u; stride >>= 1u) {
        if (lid.x < stride) {
            red[lid.x] = add_pair(red[lid.x], red[lid.x + stride]);
        }
        workgroupBarrier();
    }
    // mean = (hi + lo) / n, rounded once: q + (remainder + lo) / n.
    let total = red[0];
    let nf = f32(n);
    let q = total.x / nf;
    let r = fma(-q, nf, total.x);
    let mean = q + (r + total.y) / nf;
    let inv = 1.0 / sqrt(mean + p.f.x);
    let dst = wid.x * n;
    for (var j = lid.x; j < n; j += 64u) {
        out[dst + j] = (x[src + j] * inv) * scale[j];
    }
}
