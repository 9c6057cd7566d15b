//! The light core of Ballast: the traits the forward pass is written against and the
//! levers plug into, the types they exchange, and the GGUF file format. It depends on no
//! other workspace crate and on no GPU, tokenizer or template library, so a lever crate
//! built on it stays small. `ballast-runtime` implements the backends and the model on
//! top of it and re-exports every module here at the same path.
//!
//! - [`Backend`]: the ops of the forward pass ([`backend`]), and what a backend may
//!   also offer: [`DeviceExecutor`] for whole passes on a device, [`Residency`] for its
//!   memory, [`Telemetry`] for where the time went, [`neurons::NeuronOps`] for the
//!   sparse MLP's neuron stores.
//! - [`WeightStore`]: hands each layer's weights ([`weights`]) to one forward pass
//!   ([`store`]); [`ResidentStore`] keeps them all resident.
//! - [`KvCache`] and [`KvPolicy`]: keys and values of the tokens seen, and what to evict
//!   ([`kv`]); the host caches that hold them are `ballast-kv-cache`'s.
//! - [`FeedForward`]: the MLP block ([`ffn`]); [`DenseFfn`] is exact.
//! - [`graph`]: one pass as a list of ops over tensor handles, and its host executor;
//!   [`blocks`]: the shared blocks builders compose a pass from, and the tensor roles.
//! - [`gguf`]: the GGUF reader (every length checked before use) and writer;
//!   [`ggml_type`]: the tensor types; [`config`]: hyper-parameters from the metadata.
//! - [`arch`]: the architectures, one file each, listed once: what each reads from the
//!   metadata, its tensor tables and its builder.
//! - [`Error`]: the one error type, shared with the runtime.
//!
//! # Example
//!
//! A tensor written to an in-memory GGUF file, read back, and handed out as a
//! [`weights::Weight`] pointing into the file's bytes:
//!
//! ```
//! use std::sync::Arc;
//! use ballast_core::ggml_type::GgmlType;
//! use ballast_core::gguf::{GgufFile, GgufWriter};
//! use ballast_core::weights::{Weight, WeightBytes, WeightId};
//!
//! # fn main() -> ballast_core::Result<()> {
//! let mut w = GgufWriter::new();
//! w.add_metadata("general.architecture", "llama")?;
//! w.add_tensor_f32("output.weight", &[3, 2], &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0])?;
//! let file = Arc::new(GgufFile::from_bytes(w.to_bytes())?);
//!
//! let info = file.tensor("output.weight")?;
//! let range = info.offset as usize..(info.offset + info.n_bytes) as usize;
//! let weight = Weight {
//!     name: info.name.clone(),
//!     id: WeightId { file: file.id(), offset: info.offset },
//!     ty: info.ty,
//!     dims: vec![3, 2],
//!     bytes: WeightBytes::new(file.clone(), range)?,
//! };
//! assert_eq!((weight.ty, weight.rows(), weight.cols()), (GgmlType::F32, 2, 3));
//! assert_eq!(&weight.bytes.as_slice()?[..4], &1.0f32.to_le_bytes());
//! # Ok(())
//! # }
//! ```
#![deny(missing_docs)]

pub mod arch;
pub mod backend;
pub mod blocks;
pub mod config;
pub mod error;
pub mod ffn;
pub mod fingerprint;
pub mod ggml_type;
pub mod gguf;
pub mod graph;
pub mod kv;
pub mod kv_payload;
pub mod kv_window;
pub mod moe;
pub mod neurons;
pub mod store;
pub mod weights;

pub use backend::{Backend, DeviceExecutor, Residency, Telemetry};
pub use config::ModelConfig;
pub use error::{Error, Result};
pub use ffn::{DenseFfn, FeedForward};
pub use kv::{
    KvCache, KvElement, KvPolicy, KvRows, KvSegment, KvShape, KvView, MASKED_POSITION, Q8_BLOCK,
};
pub use store::{CodedLayers, ResidentStore, TierBytes, WeightStore};
