//! Ballast's compressed-weights lever: hold and move fewer bytes per weight, losslessly.
//!
//! - [`transform`]: per tensor type, rearranges blocks into planes (f16 scales and mins
//!   split into byte planes, quants together; byte planes for f32/f16/bf16), so that an
//!   entropy coder sees bytes of one distribution at a time.
//! - [`rans`]: an order-0 byte coder (rANS, a frequency table per chunk).
//! - [`codec`]: a [`Codec`] is a transform plus a coder (zstd, rANS or raw); tensors
//!   are cut into chunks of whole blocks that decode independently.
//! - [`pack`]: the pack file ([`write_pack`], [`PackFile`]): the GGUF header, an index
//!   (codec, chunk offsets and sizes, a CRC-32 of the stored and of the raw bytes of
//!   every chunk) and the chunks; a corrupt or truncated pack gives an [`Error`] naming
//!   the tensor and chunk, never wrong weights. [`PackFile::gguf_with`] gives the GGUF
//!   file it decodes to, so everything that opens a GGUF opens a pack.
//! - [`store`]: [`CompressedStore`], a `WeightStore` that keeps layers coded and
//!   decodes each on first use in a forward pass (the seed's per-pass cache), with a
//!   worker decoding the next layer while this one computes, and counters.
//!
//! Lossless means bit-identical: every decoded chunk is checked against the CRC-32 of
//! the bytes that were packed.
//!
//! # Example
//!
//! A tiny GGUF file packed, reopened, and decoded back to the same bytes:
//!
//! ```
//! use ballast_core::ggml_type::GgmlType;
//! use ballast_core::gguf::{GgufFile, GgufWriter};
//! use ballast_weight_codec::{write_pack, PackFile, PackOptions};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let mut w = GgufWriter::new();
//! w.add_metadata("general.architecture", "llama")?;
//! // 64 Q8_0 blocks: an f16 scale and 32 quants each.
//! let blocks: Vec<u8> = (0..64 * 34).map(|i| if i % 34 < 2 { 0x3c } else { (i % 5) as u8 }).collect();
//! w.add_tensor("w", GgmlType::Q8_0, &[256, 8], blocks.clone())?;
//! let gguf_path = std::env::temp_dir().join(format!("doc-{}.gguf", std::process::id()));
//! w.write_to_file(&gguf_path)?;
//! let gguf = GgufFile::open(&gguf_path, true)?;
//!
//! let pack_path = gguf_path.with_extension("pack");
//! let report = write_pack(&gguf, &pack_path, &PackOptions::default(), &mut |_| {})?;
//! assert!(report[0].stored_len() < blocks.len() as u64);
//!
//! let pack = PackFile::open(&pack_path, true)?;
//! let decoded = pack.to_gguf(2)?;
//! assert_eq!(decoded.as_bytes(), gguf.as_bytes());
//! # std::fs::remove_file(gguf_path)?;
//! # std::fs::remove_file(pack_path)?;
//! # Ok(())
//! # }
//! ```
#![deny(missing_docs)]

pub mod codec;
pub mod error;
pub mod pack;
pub mod rans;
pub mod store;
pub mod transform;

pub use codec::{Codec, Coder, Transform};
pub use error::{Corruption, Error, Result};
pub use pack::{is_pack, write_pack, PackFile, PackOptions, PackedTensor, TensorReport};
pub use store::{CachePolicy, CompressedStats, CompressedStore, StoreOptions};
