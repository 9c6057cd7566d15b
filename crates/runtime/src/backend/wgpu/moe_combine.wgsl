// Mixture of experts, the weighted sum of each token's chosen experts in the order of
// the choice (as llama.cpp adds them): out[t] = y[t, 0] * w[t, 0] + y[t, 1] * w[t, 1] +
// ...; with qwen2moe's shared expert, then out[t] += shared[t] * sigmoid(gate[t]).
// One invocation per output value.

// a: (n_tokens * d_model, d_model, n_expert_used, 0)
@group(0) @binding(1) var<storage, read_write> out: array<f32>;
// Each (token, choice)'s expert output, d_model values each.
@group(0) @binding(2) var<storage, read> y: array<f32>;
@group(0) @binding(3) var<storage, read> weights: array<f32>;
// The shared expert's output, and its gate's logit per token.
@group(0) @binding(4) var<storage, read> shared_y: array<f32>;
@group(0) @binding(5) var<storage, read> shared_gate: array<f32>;

fn experts_sum(i: u32) -> f32 {
    let d = p.a.y;
    let k = p.a.z;
    let t = i / d;
    let c = i % d;
    var acc = y[t * k * d + c] * weights[t * k];
    for (var j = 1u; j < k; j++) {
        acc += y[(t * k + j) * d + c] * weights[t * k + j];
    }
    return acc;
}

@compute @workgroup_size(64)
fn moe_combine(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = gid.x + gid.y * nwg.x * 64u;
    if (i < p.a.x) {
        out[i] = experts_sum(i);
    }
}

@compute @workgroup_size(64)
fn moe_combine_shared(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = gid.x + gid.y * nwg.x * 64u;
    if (i < p.a.x) {
        let g = 1.0 / (1.0 + exp(-shared_gate[i / p.a.y]));
        out[i] = experts_sum(i) + shared_y[i] * g;
    }
}
