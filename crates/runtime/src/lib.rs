//! The Ballast runtime: GGUF loading, quantized CPU kernels, the tokenizer, the
//! transformer forward pass, sampling, the generation loop ([`Generator`]), and the
//! backends.
//!
//! The forward pass ([`Model::forward`]) is emitted once per architecture as a
//! [`graph::Graph`] of ops (the builder in `model/`, `ballast inspect --graph` prints
//! it), which a backend executes: the CPU op by op, wgpu recorded as one submission.
//! It is written against five traits, defined in `ballast-core` and re-exported here
//! with the rest of that crate's modules (`error`, `ggml_type`, `gguf`, `weights`,
//! `store`, `kv`, `graph`, `ffn`, and `backend`'s traits and types; `model::blocks` and
//! `ModelConfig`), at the same paths:
//!
//! - [`Backend`]: the op families (matrix products on quantized weights, norms, RoPE,
//!   attention, element-wise) and, for a device, its memory. [`CpuBackend`] is native
//!   and the numerical reference.
//! - [`WeightStore`]: hands each layer's weights to one forward pass.
//!   [`ResidentStore`] keeps them all resident (memory-mapped by default).
//! - [`KvCache`]: keys and values of the tokens seen. [`DenseKv`] (from
//!   `ballast-kv-cache`, with the other host caches) only grows.
//! - [`KvPolicy`]: may evict from the cache before attention (none by default).
//! - [`FeedForward`]: the MLP block. [`DenseFfn`] is exact.
//!
//! A [`Model`] is a handle on shared read-only weights: [`Model::share`] gives another
//! for another [`Session`] (each owns its KV cache, activations and positions; sessions
//! may run from different threads), and the weights are held once.
//!
//! The `gpu` feature (on by default) adds [`WgpuBackend`] and the [`gpu`] context:
//! the same ops as WGSL compute shaders through wgpu. Without it (`default-features =
//! false`) the crate is CPU only and does not compile wgpu.
//!
//! The lever crates (`ballast-kv-cache`, `ballast-tier-stream`,
//! `ballast-weight-codec`, `ballast-sparse-mlp`) implement those traits on
//! `ballast-core` alone; nothing in the model changes when one is swapped in.
//!
//! # Example
//!
//! Greedy generation of a few tokens with the default model (fetched into the model
//! cache on first use), through the [`Generator`] (the [`generate`] module has an
//! example that runs on a tiny model):
//!
//! ```no_run
//! use std::sync::Arc;
//! use ballast_runtime::{gguf::GgufFile, model_cache, CpuBackend, GenerateOptions, Generator,
//!     Model, SamplerConfig, Session, Step, Tokenizer};
//!
//! # fn main() -> Result<(), ballast_runtime::Error> {
//! let path = model_cache::ensure_default_model(|line| eprintln!("{line}"))?;
//! let file = Arc::new(GgufFile::open(&path, true)?);
//! let tokenizer = Arc::new(Tokenizer::from_gguf(&file)?);
//! let model = Model::load(file, Arc::new(CpuBackend::new(2)), true)?;
//! let options = GenerateOptions {
//!     sampler: SamplerConfig { temperature: 0.0, ..Default::default() },
//!     max_tokens: Some(8),
//!     ..Default::default()
//! };
//! let mut generator = Generator::new(Session::new(model, 512)?, tokenizer.clone(), options)?;
//! generator.prompt(&tokenizer.encode("Once upon a time", true, false)?)?;
//! while let Step::Token(token) = generator.step()? {
//!     print!("{}", token.text);
//! }
//! # Ok(())
//! # }
//! ```
#![deny(missing_docs)]

pub mod backend;
pub mod chat;
pub mod generate;
#[cfg(feature = "gpu")]
pub mod gpu;
pub mod memory;
pub mod model;
pub mod model_cache;
pub mod quant;
pub mod sampler;
pub mod session;
pub mod stream_eval;
pub mod synth;
pub mod testing;
pub mod threadpool;
pub mod tokenizer;

// The traits, the types they exchange, GGUF and the error type live in `ballast-core`
// (which the lever crates build on without this crate); they keep their paths here.
pub use ballast_core::{
    arch, blocks, error, ffn, ggml_type, gguf, graph, kv, kv_payload, moe, neurons, store, weights,
};

pub use backend::{Backend, CpuBackend};
#[cfg(feature = "gpu")]
pub use backend::{DeviceKv, WgpuBackend};
pub use ballast_kv_cache::{DenseKv, WindowedKv};
pub use error::{Error, Result};
pub use ffn::{DenseFfn, FeedForward};
pub use generate::{Continuation, Finish, FinishReason, GenerateOptions, Generator, Step, Token};
pub use kv::{
    KvCache, KvElement, KvPolicy, KvRows, KvSegment, KvShape, KvView, MASKED_POSITION, Q8_BLOCK,
};
pub use model::{Model, ModelConfig};
pub use sampler::{Sampler, SamplerConfig};
pub use session::{feed_batch, BatchFeed, Session};
pub use store::{CodedLayers, ResidentStore, TierBytes, WeightStore};
pub use tokenizer::Tokenizer;
