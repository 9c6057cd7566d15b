//! [`Backend`]: the ops of the forward pass, and where their time goes.
//!
//! The model is written once against this trait (defined in `ballast-core`, re-exported
//! here). [`CpuBackend`] is the native implementation and the numerical reference that
//! every other backend is tested against. Weights arrive quantized, exactly as packed in
//! the GGUF file; a backend dequantizes inside its kernels and never keeps an f32 copy
//! of a weight.

mod attention;
mod cpu;
mod elementwise;
#[cfg(feature = "gpu")]
mod wgpu;

pub use ballast_core::backend::{
    ops, AttentionOps, AttentionShape, Backend, DeviceExecutor, DeviceForwardInput, ElementwiseOps,
    KernelTime, LayerSource, LinearOps, MatmulJob, NormOps, OpKind, OpTimes, OpTimesSnapshot,
    PassReport, Residency, Rope, RopeOps, RopeStyle, Telemetry,
};

#[cfg(feature = "gpu")]
pub use self::wgpu::{DeviceKv, WgpuBackend};
pub use cpu::CpuBackend;

/// The CPU backend's attention and SwiGLU kernels at a chosen SIMD level, as
/// [`crate::quant::matmul_at`] is for products: for tests and benches that hold every
/// level to the scalar reference (each gives the same bits at every level).
pub mod cpu_kernels {
    pub use super::attention::tiled::{
        attend_block, attend_tiled_reference, BlockScratch, KV_TILE, TILED_MIN_QUERIES,
    };
    pub use super::attention::{
        attend_head_at, attend_head_reference, attend_heads_at, attend_heads_to, merge_partials,
        split_chunk, split_key_count, Finish, HeadSlot, SPLIT_FROM_CELLS, SPLIT_MIN_KEYS,
    };
    pub use super::elementwise::swiglu_at;
}
