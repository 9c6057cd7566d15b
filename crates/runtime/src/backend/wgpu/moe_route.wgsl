// Mixture-of-experts routing, one invocation per token row (llama.cpp's build_moe_ffn
// with softmax gating, as ballast_core::moe::route): softmax of the router logits, the
// n_expert_used largest, renormalized to sum to one (the sum clamped below at 2^-14)
// if asked, times the weights' scale. Writes each row's expert ids and weights, in the
// order of the choice.
//
// Experts are chosen in the order of their logits, ties to the lower index: the order
// of the probabilities the host sorts, without their rounding (exp and the product by
// 1/sum never reverse two logits, but may merge two close ones into one probability).

// a: (n_tokens, n_expert, n_expert_used, 1 to renormalize); f.x: the scale (1: none).
@group(0) @binding(1) var<storage, read> logits: array<f32>;
@group(0) @binding(2) var<storage, read_write> ids: array<u32>;
@group(0) @binding(3) var<storage, read_write> weights: array<f32>;

// The smallest sum of the chosen probabilities llama.cpp divides by (2^-14).
const MIN_WEIGHT_SUM: f32 = 6.1035156e-5;

@compute @workgroup_size(64)
fn moe_route(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let t = gid.x + gid.y * nwg.x * 64u;
    let ne = p.a.y;
    let k = p.a.z;
    if (t >= p.a.x || ne == 0u) {
        return;
    }
    let base = t * ne;
    var mx = logits[base];
    for (var e = 1u; e < ne; e++) {
        mx = max(mx, logits[base + e]);
    }
    var sum = 0.0;
    for (var e = 0u; e < ne; e++) {
        sum += exp(logits[base + e] - mx);
    }
    let inv = 1.0 / sum;
    // Each pass takes the largest (logit, -index) below the previous pass's choice.
    var prev_l = 0.0;
    var prev_e = 0u;
    var chosen_sum = 0.0;
    for (var j = 0u; j < k; j++) {
        var best = ne;
        var best_l = 0.0;
        for (var e = 0u; e < ne; e++) {
            let l = logits[base + e];
            let after = j == 0u || l < prev_l || (l == prev_l && e > prev_e);
            // Strictly larger: an equal logit later in the scan keeps the lower index.
            if (after && (best == ne || l > best_l)) {
                best = e;
                best_l = l;
            }
        }
        prev_l = best_l;
        prev_e = best;
        let w = exp(best_l - mx) * inv;
        ids[t * k + j] = best;
        weights[t * k + j] = w;
        chosen_sum += w;
    }
    let norm = max(chosen_sum, MIN_WEIGHT_SUM);
    for (var j = 0u; j < k; j++) {
        var w = weights[t * k + j];
        if (p.a.w == 1u) {
            w = w / norm;
        }
        weights[t * k + j] = w * p.f.x;
    }
}
