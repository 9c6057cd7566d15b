//! Ballast's KV-cache lever: attention keys and values in bounded memory, for
//! generating far past a model's context.
//!
//! - Three update modes, each a [`ballast_core::KvCache`] (see [`UpdateMode`]):
//!   [`ShiftConcat`] (one buffer, eviction memmoves the kept tokens), [`PointerShift`]
//!   (a ring: eviction moves an offset; attention reads at most two segments) and
//!   [`SmartMask`] (evicted slots are masked and reused; nothing moves). All append a
//!   chunk or one token without re-layout, rewind, clear, evict, report their positions
//!   and the bytes they hold and moved.
//! - Three storage precisions ([`KvElement`]): f32, f16 (llama.cpp's default) and int8
//!   with an f16 scale per 32 values (llama.cpp's `q8_0` geometry, 1.0625 bytes per
//!   value).
//! - Policies ([`StreamingLlm`], [`PolicyKind`]): StreamingLLM (attention sinks plus a
//!   recent window, positions inside the cache), the plain sliding window, or none.
//! - Session files ([`save_session`], [`load_session`]): header, checksum, atomic
//!   write, typed errors that leave the running cache untouched.
//!
//! The crate depends on `ballast-core` alone. StreamingLLM's evaluation, which runs a
//! model (`stream_perplexity`, `recompute_perplexity`), is in the runtime's
//! `stream_eval` module.
//!
//! Eviction and int8 storage are approximate: they change what attention sees, and are
//! measured by perplexity against exact runs, never assumed harmless.
//!
//! # Example
//!
//! A ring cache of 8 tokens under a plain sliding window (no sinks), driven by hand as
//! the forward pass would; `examples/streaming_llm.rs` adds attention sinks:
//!
//! ```
//! use ballast_kv_cache::{PointerShift, KvElement, StreamingLlm};
//! use ballast_core::{KvCache, KvPolicy, KvShape};
//!
//! let shape = KvShape { n_layers: 1, n_kv_heads: 1, head_dim: 32 };
//! let mut cache = PointerShift::new(shape, 8, KvElement::F16).unwrap();
//! let mut policy = StreamingLlm::new(0, 8).unwrap(); // a plain window of 8
//! for pos in 0..20u32 {
//!     policy.before_pass(&mut cache, 1).unwrap();
//!     let row = vec![pos as f32; 32];
//!     cache.append(0, &[pos], &row, &row).unwrap();
//! }
//! assert_eq!(cache.len(), 8);
//! let (mut p, mut k, mut v) = (vec![], vec![], vec![]);
//! cache.read(0, 0..8, &mut p, &mut k, &mut v);
//! assert_eq!(p, (12..20).collect::<Vec<u32>>());
//! ```
#![deny(missing_docs)]

mod dense;
mod error;
mod modes;
mod persist;
mod policy;
mod rows;
mod window;

pub use ballast_core::KvElement;
pub use dense::DenseKv;
pub use error::{Error, Result};
pub use modes::{new_cache, set_update_threads, PointerShift, ShiftConcat, SmartMask, UpdateMode};
pub use persist::{
    checksum, load_session, model_fingerprint, save_session, SavedSession, SessionMeta,
    SESSION_VERSION,
};
pub use policy::{PolicyKind, StreamingLlm};
pub use window::{MakeCache, WindowedKv};
