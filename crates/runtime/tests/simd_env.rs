//! `BALLAST_SIMD` forces the kernel level (its own test binary: the level is chosen once
//! per process).

use ballast_runtime::ggml_type::GgmlType;
use ballast_runtime::quant::{self, QuantizedActivations};

#[test]
fn ballast_simd_env_forces_scalar() {
    // Set before the first use of the kernels in this process (the only test here).
    // SAFETY: no other thread reads the environment yet (`unsafe` from edition 2024 on).
    #[allow(unused_unsafe)]
    unsafe {
        std::env::set_var("BALLAST_SIMD", "scalar")
    };
    assert_eq!(quant::simd_level(), "scalar");
    // Still computes correctly.
    let w = quant::quantize(GgmlType::Q4_1, &[0.5f32; 64]).unwrap();
    let mut acts = QuantizedActivations::new();
    quant::quantize_activations(GgmlType::Q4_1, &[1.0f32; 64], 1, 64, &mut acts).unwrap();
    let mut out = [0f32; 1];
    quant::matmul(GgmlType::Q4_1, &w, 64, &acts, &mut out).unwrap();
    assert!((out[0] - 32.0).abs() < 0.1, "{}", out[0]);
}
