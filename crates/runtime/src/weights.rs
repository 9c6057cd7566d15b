//! Weight tensors as the forward pass sees them: a type, a shape and shared bytes.

use std::ops::Range;
use std::sync::Arc;

use crate::error::{Error, Result};
use crate::ggml_type::GgmlType;

/// Anything that owns a block of bytes that weights can point into: a memory-mapped
/// GGUF file, a buffer read into RAM, a decompressed layer.
pub trait ByteSource: Send + Sync {
    /// All the bytes of the source.
    fn bytes(&self) -> &[u8];

    /// Whether a backend with its own memory may keep a device copy of these bytes for
    /// as long as the source lives (uploaded once, found again by address). A store
    /// returns `false` for bytes it lends for one use (a streaming slot, reused for
    /// another layer afterwards) and for bytes it keeps in host RAM on purpose (a RAM
    /// tier): the backend then uploads them per use into slots of its own.
    fn cache_on_device(&self) -> bool {
        true
    }
}

impl ByteSource for Vec<u8> {
    fn bytes(&self) -> &[u8] {
        self
    }
}

/// A range of a shared [`ByteSource`]. Cloning is cheap (one reference count), so a
/// store can hand the same bytes to every forward pass without copying them.
#[derive(Clone)]
pub struct WeightBytes {
    source: Arc<dyn ByteSource>,
    range: Range<usize>,
}

impl WeightBytes {
    /// The bytes `range` of `source`; an error if the range lies outside it.
    pub fn new(source: Arc<dyn ByteSource>, range: Range<usize>) -> Result<WeightBytes> {
        let len = source.bytes().len();
        if range.start > range.end || range.end > len {
            return Err(Error::WeightRange {
                start: range.start,
                end: range.end,
                len,
            });
        }
        Ok(WeightBytes { source, range })
    }

    /// Bytes owned by this value alone.
    pub fn from_vec(bytes: Vec<u8>) -> WeightBytes {
        let range = 0..bytes.len();
        WeightBytes {
            source: Arc::new(bytes),
            range,
        }
    }

    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        &self.source.bytes()[self.range.clone()]
    }

    /// See [`ByteSource::cache_on_device`].
    pub fn cache_on_device(&self) -> bool {
        self.source.cache_on_device()
    }

    /// Number of bytes.
    pub fn len(&self) -> usize {
        self.range.len()
    }

    /// True if there are no bytes.
    pub fn is_empty(&self) -> bool {
        self.range.is_empty()
    }
}

impl std::fmt::Debug for WeightBytes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "WeightBytes({:?})", self.range)
    }
}

/// One weight tensor: its GGUF name, element type, shape and bytes.
///
/// `dims` are in ggml order: `dims[0]` is the length of a row (the input size of a
/// matrix product), `dims[1]` the number of rows (its output size).
#[derive(Clone, Debug)]
pub struct Weight {
    /// The tensor's name in the GGUF file, for error messages and tables.
    pub name: String,
    /// Element type.
    pub ty: GgmlType,
    /// Shape in ggml order (row length first).
    pub dims: Vec<usize>,
    /// The packed bytes, exactly as in the file.
    pub bytes: WeightBytes,
}

impl Weight {
    /// Length of one row (the input size of a matrix product with this weight).
    pub fn cols(&self) -> usize {
        self.dims.first().copied().unwrap_or(1)
    }

    /// Number of rows (the output size of a matrix product with this weight).
    pub fn rows(&self) -> usize {
        self.dims.iter().skip(1).product()
    }

    /// Bytes of one row.
    pub fn row_bytes(&self) -> usize {
        self.bytes.len() / self.rows().max(1)
    }
}

/// The weights of one transformer block, as a [`crate::WeightStore`] hands them to one
/// forward pass.
#[derive(Clone, Debug)]
pub struct LayerWeights {
    /// Index of the block.
    pub index: usize,
    /// RMSNorm scale before attention.
    pub attn_norm: Arc<[f32]>,
    /// Query projection.
    pub wq: Weight,
    /// Key projection.
    pub wk: Weight,
    /// Value projection.
    pub wv: Weight,
    /// Query bias (qwen2).
    pub bq: Option<Arc<[f32]>>,
    /// Key bias (qwen2).
    pub bk: Option<Arc<[f32]>>,
    /// Value bias (qwen2).
    pub bv: Option<Arc<[f32]>>,
    /// Attention output projection.
    pub wo: Weight,
    /// RMSNorm scale before the MLP.
    pub ffn_norm: Arc<[f32]>,
    /// MLP gate projection.
    pub w_gate: Weight,
    /// MLP up projection.
    pub w_up: Weight,
    /// MLP down projection.
    pub w_down: Weight,
}

impl LayerWeights {
    /// Bytes of all the tensors of this block.
    pub fn byte_size(&self) -> usize {
        let norms = (self.attn_norm.len() + self.ffn_norm.len()) * 4;
        let biases = [&self.bq, &self.bk, &self.bv]
            .iter()
            .map(|b| b.as_ref().map_or(0, |b| b.len() * 4))
            .sum::<usize>();
        let mats = [
            &self.wq,
            &self.wk,
            &self.wv,
            &self.wo,
            &self.w_gate,
            &self.w_up,
            &self.w_down,
        ]
        .iter()
        .map(|w| w.bytes.len())
        .sum::<usize>();
        norms + biases + mats
    }
}

/// The weights outside the transformer blocks.
#[derive(Clone, Debug)]
pub struct GlobalWeights {
    /// Token embedding table (`token_embd.weight`), one row per token.
    pub token_embd: Weight,
    /// Final RMSNorm scale.
    pub output_norm: Arc<[f32]>,
    /// Output head; the embedding table itself when the model ties them.
    pub output: Weight,
}
