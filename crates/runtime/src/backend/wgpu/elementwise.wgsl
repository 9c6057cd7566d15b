// Element-wise ops: SwiGLU (silu.wgsl), GeGLU, residual add, bias add, scaling.

// a: (n elements, bias length, 0, 0); f.x: the factor of `scale`
@group(0) @binding(1) var<storage, read_write> x: array<f32>;
@group(0) @binding(2) var<storage, read> y: array<f32>;
@group(0) @binding(3) var<storage, read> z: array<f32>;

fn index(gid: vec3<u32>, nwg: vec3<u32>) -> u32 {
    return gid.x + gid.y * nwg.x * 64u;
}

// x = silu(y) * z
@compute @workgroup_size(64)
fn swiglu(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = index(gid, nwg);
    if (i < p.a.x) {
        x[i] = swiglu_of(y[i], z[i]);
    }
}

// x += y
@compute @workgroup_size(64)
fn add(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = index(gid, nwg);
    if (i < p.a.x) {
        x[i] = x[i] + y[i];
    }
}

// x[row][j] += y[j]
@compute @workgroup_size(64)
fn add_bias(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = index(gid, nwg);
    if (i < p.a.x) {
        x[i] = x[i] + y[i % p.a.y];
    }
}

// GELU, tanh form, of the gate rounded to f16, rounded to f16: what ggml's f16 table
// holds (backend/elementwise.rs). The tanh argument is clamped to +-9, where tanh is
// +-1 in f32 already, so no implementation overflows inside it.
fn gelu_f16(v: f32) -> f32 {
    let g = quantizeToF16(v);
    let inner = clamp(0.7978846 * g * fma(0.044715 * g, g, 1.0), -9.0, 9.0);
    return quantizeToF16(0.5 * g * (1.0 + tanh(inner)));
}

// x = gelu(y) * z, with ggml's clamps: 0 at or below -10, y itself at or above 10.
@compute @workgroup_size(64)
fn geglu(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = index(gid, nwg);
    if (i < p.a.x) {
        let g = y[i];
        var h = gelu_f16(g);
        if (g <= -10.0) {
            h = 0.0;
        } else if (g >= 10.0) {
            h = g;
        }
        x[i] = h * z[i];
    }
}

// x *= f.x
@compute @workgroup_size(64)
fn scale(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = index(gid, nwg);
    if (i < p.a.x) {
        x[i] = x[i] * p.f.x;
    }
}
