// Element-wise ops: SwiGLU (with ggml's vectorized expf, as the CPU backend), GeGLU,
// residual add, bias add, scaling.

// a: (n elements, bias length, 0, 0); f.x: the factor of `scale`
@group(0) @binding(1) var<storage, read_write> x: array<f32>;
@group(0) @binding(2) var<storage, read> y: array<f32>;
@group(0) @binding(3) var<storage, read> z: array<f32>;

fn index(gid: vec3<u32>, nwg: vec3<u32>) -> u32 {
    return gid.x + gid.y * nwg.x * 64u;
}

// exp(v) as ggml's AVX-512 ggml_v_expf: 2^n range reduction, a degree-5 polynomial,
// then j * 2^n (backend/elementwise.rs states the same steps).
fn expf_ggml(v: f32) -> f32 {
    // ggml rounds with fma(v, log2e, 0x1.8p23) - 0x1.8p23; shader compilers may fold
    // that subtraction away, so round explicitly (the same integer unless v*log2e is
    // within an ulp of a half-integer).
    let n = round(v * bitcast<f32>(0x3fb8aa3bu));
    let b = fma(-n, bitcast<f32>(0x35bfbe8eu), fma(-n, bitcast<f32>(0x3f317200u), v));
    let u = b * b;
    let j = fma(
        fma(fma(bitcast<f32>(0x3c072010u), b, bitcast<f32>(0x3d2b9f17u)), u,
            fma(bitcast<f32>(0x3e2aaf33u), b, bitcast<f32>(0x3efffedbu))),
        u,
        fma(bitcast<f32>(0x3f7ffff6u), b, 1.0));
    if (n > 127.0) {
        // Overflow: silu's 1 + e is then as good as infinite.
        return 3.0e38;
    }
    if (n < -126.0) {
        return 0.0;
    }
    return ldexp(j, i32(n));
}

// x = silu(y) * z
@compute @workgroup_size(64)
fn swiglu(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = index(gid, nwg);
    if (i < p.a.x) {
        let g = y[i];
        x[i] = g / (1.0 + expf_ggml(-g)) * z[i];
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
