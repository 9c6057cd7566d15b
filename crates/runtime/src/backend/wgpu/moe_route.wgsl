// Mixture-of-experts routing, one workgroup of 64 per token row (llama.cpp's build_moe_ffn
// with softmax gating, as ballast_core::moe::route): softmax of the router logits, the
// n_expert_used largest, renormalized to sum to one (the sum clamped below at 2^-14)
// if asked, times the weights' scale. Writes each row's expert ids and weights, in the
// order of the choice.
//
// Experts are chosen in the order of their logits, ties to the lower index: the order
// of the probabilities the host sorts, without their rounding (exp and the product by
// 1/sum never reverse two logits, but may merge two close ones into one probability).
//
// The maximum, the sum and each choice are reductions over the workgroup: one
// invocation per row walking the experts k + 2 times took 79 µs per call on an H200
// (128 experts, 8 chosen: 18% of a decoded token of a 30B-A3B).

// a: (n_tokens, n_expert, n_expert_used, 1 to renormalize); f.x: the scale (1: none).
@group(0) @binding(1) var<storage, read> logits: array<f32>;
@group(0) @binding(2) var<storage, read_write> ids: array<u32>;
@group(0) @binding(3) var<storage, read_write> weights: array<f32>;

// The smallest sum of the chosen probabilities llama.cpp divides by (2^-14).
const MIN_WEIGHT_SUM: f32 = 6.1035156e-5;

var<workgroup> red_l: array<f32, 64>;
var<workgroup> red_e: array<u32, 64>;

// Whether (l, e) comes before (l2, e2) in the choice order: larger logit, then lower
// index; e == NONE (no candidate) comes last.
fn before(l: f32, e: u32, l2: f32, e2: u32, none: u32) -> bool {
    if (e == none) {
        return false;
    }
    return e2 == none || l > l2 || (l == l2 && e < e2);
}

@compute @workgroup_size(64)
fn moe_route(@builtin(local_invocation_id) lid3: vec3<u32>,
             @builtin(workgroup_id) wid: vec3<u32>,
             @builtin(num_workgroups) nwg: vec3<u32>) {
    let lid = lid3.x;
    let t = wid.x + wid.y * nwg.x;
    let ne = p.a.y;
    let k = p.a.z;
    if (t >= p.a.x || ne == 0u) {
        return;
    }
    let base = t * ne;
    var mx = -3.0e38;
    for (var e = lid; e < ne; e += 64u) {
        mx = max(mx, logits[base + e]);
    }
    red_l[lid] = mx;
    workgroupBarrier();
    for (var stride = 32u; stride > 0u; stride >>= 1u) {
        if (lid < stride) {
            red_l[lid] = max(red_l[lid], red_l[lid + stride]);
        }
        workgroupBarrier();
    }
    mx = red_l[0];
    workgroupBarrier();
    var part = 0.0;
    for (var e = lid; e < ne; e += 64u) {
        part += exp(logits[base + e] - mx);
    }
    red_l[lid] = part;
    workgroupBarrier();
    for (var stride = 32u; stride > 0u; stride >>= 1u) {
        if (lid < stride) {
            red_l[lid] += red_l[lid + stride];
        }
        workgroupBarrier();
    }
    let inv = 1.0 / red_l[0];
    workgroupBarrier();
    // Each pass takes the largest (logit, -index) after the previous pass's choice.
    var prev_l = 0.0;
    var prev_e = 0u;
    var chosen_sum = 0.0;
    for (var j = 0u; j < k; j++) {
        var best = ne;
        var best_l = 0.0;
        for (var e = lid; e < ne; e += 64u) {
            let l = logits[base + e];
            let after = j == 0u || l < prev_l || (l == prev_l && e > prev_e);
            if (after && before(l, e, best_l, best, ne)) {
                best = e;
                best_l = l;
            }
        }
        red_l[lid] = best_l;
        red_e[lid] = best;
        workgroupBarrier();
        for (var stride = 32u; stride > 0u; stride >>= 1u) {
            if (lid < stride) {
                let o = lid + stride;
                if (before(red_l[o], red_e[o], red_l[lid], red_e[lid], ne)) {
                    red_l[lid] = red_l[o];
                    red_e[lid] = red_e[o];
                }
            }
            workgroupBarrier();
        }
        prev_l = red_l[0];
        prev_e = red_e[0];
        workgroupBarrier();
        let w = exp(prev_l - mx) * inv;
        if (lid == 0u) {
            ids[t * k + j] = prev_e;
            weights[t * k + j] = w;
        }
        chosen_sum += w;
    }
    if (lid == 0u) {
        let norm = max(chosen_sum, MIN_WEIGHT_SUM);
        for (var j = 0u; j < k; j++) {
            var w = weights[t * k + j];
            if (p.a.w == 1u) {
                w = w / norm;
            }
            weights[t * k + j] = w * p.f.x;
        }
    }
}
