// SwiGLU's value as the CPU backend computes it (ggml's vectorized expf), shared by the
// element-wise SwiGLU (elementwise.wgsl) and the neuron MLP (neuron_hidden.wgsl), so a
// neuron's hidden value is the same bits in both.

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

// silu(g) * u
fn swiglu_of(g: f32, u: f32) -> f32 {
    return g / (1.0 + expf_ggml(-g)) * u;
}
