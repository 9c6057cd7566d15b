//! Reading and writing GGUF files (versions 2 and 3, little-endian).
//!
//! A GGUF file is a header (magic `GGUF`, version, tensor count, metadata count), metadata
//! key/value entries, tensor descriptions (name, dimensions in ggml order, element type,
//! offset), padding to the alignment (`general.alignment`, default 32), then the tensor
//! data, each tensor's offset being relative to the start of the data section.
//!
//! [`GgufFile`] validates everything before use: every count and length is checked against
//! the bytes left in the file before anything is allocated, arrays may nest at most
//! [`MAX_ARRAY_DEPTH`] deep, tensors have at most [`MAX_DIMS`] dimensions, element counts and
//! byte sizes are computed with checked arithmetic, rows are whole blocks, offsets are
//! aligned and all tensor data lies inside the file without overlapping; keys and tensor
//! names are unique. Dimensions of 0 are accepted (as llama.cpp does): such a tensor has no
//! data. A first pass validates the whole header allocating nothing larger than the input,
//! so a malformed file never causes a large allocation. Tensors need not be packed in order
//! (llama.cpp requires that; this reader only requires aligned, in-bounds, non-overlapping
//! data), and a tensor's rows (`dims[0]`) must be whole blocks of its type, as llama.cpp checks.
//!
//! [`GgufWriter`] builds GGUF v3 files, e.g. tiny models for tests.
//!
//! # Example
//!
//! ```
//! use ballast_core::ggml_type::GgmlType;
//! use ballast_core::gguf::{GgufFile, GgufWriter, Value};
//!
//! # fn main() -> ballast_core::error::Result<()> {
//! let mut w = GgufWriter::new();
//! w.add_metadata("general.architecture", "llama")?;
//! w.add_metadata("llama.block_count", 2u32)?;
//! w.add_metadata("tokenizer.ggml.tokens", vec!["<s>", "</s>"])?;
//! // A 3x2 matrix: rows of 3 values (ne0 = 3), 2 rows.
//! w.add_tensor_f32("output.weight", &[3, 2], &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0])?;
//!
//! let f = GgufFile::from_bytes(w.to_bytes())?;
//! assert_eq!(f.version(), 3);
//! assert_eq!(f.get_str("general.architecture")?, "llama");
//! assert_eq!(f.get_u32("llama.block_count")?, 2);
//! assert_eq!(f.get_str_array("tokenizer.ggml.tokens")?, ["<s>", "</s>"]);
//! assert_eq!(f.get("llama.block_count"), Some(&Value::U32(2)));
//! let t = f.tensor("output.weight")?;
//! assert_eq!((t.ty, t.dims.as_slice(), t.n_bytes), (GgmlType::F32, &[3u64, 2][..], 24));
//! assert_eq!(&f.tensor_data(t)[..4], &1.0f32.to_le_bytes());
//! assert!(f.tensor("missing").is_err());
//! # Ok(())
//! # }
//! ```

mod reader;
mod value;
mod writer;

pub use reader::{GgufFile, TensorInfo, MEMORY_PATH};
pub use value::{Array, Value, ValueType};
pub use writer::{GgufWriter, TensorPart};

/// The four bytes every GGUF file starts with.
pub const MAGIC: [u8; 4] = *b"GGUF";
/// The metadata key holding the data alignment.
pub const KEY_ALIGNMENT: &str = "general.alignment";
/// Alignment of tensor data when `general.alignment` is absent.
pub const DEFAULT_ALIGNMENT: u64 = 32;
/// Most dimensions a tensor may have (ggml's `GGML_MAX_DIMS`).
pub const MAX_DIMS: u32 = 4;
/// Deepest nesting of arrays in a metadata value (a plain array has depth 1).
pub const MAX_ARRAY_DEPTH: usize = 8;
