// RMSNorm of each row, times a scale vector: out = (x * 1/sqrt(mean(x^2) + eps)) * scale.
// One workgroup of 256 per row. The squares are summed by 64 of them, each over the
// values j = lane, lane + 64, ... in order, then across the 64; all 256 load the row,
// 1,024 values at a time into workgroup memory, so no invocation waits on one load
// after another (64 loading for themselves took 25-48 µs per 4096-value row on an
// H200). More summing invocations would change the order of the sums, and so, rarely,
// a bit of the mean. The CPU backend sums the f32 squares in f64 (as ggml does);
// here the sum is kept as an unevaluated pair of f32 (hi + lo, error-free additions),
// which is as exact for these lengths, so both round the mean to the same f32.

// a: (rows, row length, first input row, 0); f.x: eps.
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read> scale: array<f32>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;

var<workgroup> red: array<vec2<f32>, 64>;
var<workgroup> squares: array<f32, 1024>;

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

@compute @workgroup_size(256)
fn rms_norm(@builtin(local_invocation_id) lid: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>) {
    let n = p.a.y;
    let src = (wid.x + p.a.z) * n;
    var s = vec2<f32>(0.0, 0.0);
    for (var c = 0u; c < n; c += 1024u) {
        for (var i = 0u; i < 4u; i++) {
            let j = c + lid.x + 256u * i;
            var v = 0.0;
            if (j < n) {
                v = x[src + j];
            }
            squares[lid.x + 256u * i] = v * v;
        }
        workgroupBarrier();
        if (lid.x < 64u) {
            for (var i = 0u; i < 16u; i++) {
                if (c + lid.x + 64u * i < n) {
                    s = add_pair(s, vec2<f32>(squares[lid.x + 64u * i], 0.0));
                }
            }
        }
        workgroupBarrier();
    }
    if (lid.x < 64u) {
        red[lid.x] = s;
    }
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
    for (var j = lid.x; j < n; j += 256u) {
        out[dst + j] = (x[src + j] * inv) * scale[j];
    }
}
