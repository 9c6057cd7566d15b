//! Weight tensors as the forward pass sees them: a type, a shape and shared bytes.

use std::borrow::Cow;
use std::ops::Range;
use std::sync::Arc;

use crate::blocks;
use crate::error::{Error, Result};
use crate::ggml_type::GgmlType;
use crate::gguf::GgufFile;

/// Anything that owns a block of bytes that weights can point into: a memory-mapped
/// GGUF file, a buffer read into RAM, a decompressed layer.
pub trait ByteSource: Send + Sync {
    /// All the bytes of the source, or why they cannot be had: a source that produces
    /// them on demand (a layer lent coded, decoded on first use) fails with a typed
    /// error, naming the file, when what it reads from has changed underneath.
    fn bytes(&self) -> Result<&[u8]>;

    /// Whether a backend with its own memory may keep a device copy of these bytes for
    /// as long as the source lives (uploaded once, found again by address). A store
    /// returns `false` for bytes it lends for one use (a streaming slot, reused for
    /// another layer afterwards) and for bytes it keeps in host RAM on purpose (a RAM
    /// tier): the backend then uploads them per use into slots of its own.
    fn cache_on_device(&self) -> bool {
        true
    }

    /// The number of bytes, without producing them (a source that decodes on demand
    /// knows its length before it has decoded anything, and overrides this).
    fn byte_len(&self) -> usize {
        self.bytes().map_or(0, <[u8]>::len)
    }

    /// The bytes `range` alone: the default borrows them from [`ByteSource::bytes`]; a
    /// source that decodes on demand overrides this to produce only what covers the
    /// range (an embedding table whose lookups read a row each), without holding the
    /// rest.
    fn range(&self, range: Range<usize>) -> Result<Cow<'_, [u8]>> {
        let all = self.bytes()?;
        let len = all.len();
        all.get(range.clone())
            .map(Cow::Borrowed)
            .ok_or(Error::WeightRange {
                start: range.start,
                end: range.end,
                len,
            })
    }

    /// The bytes `range` as they are stored coded, chunk by chunk in order, for a
    /// device that decodes them itself and so moves only the coded bytes; `None` (the
    /// default) when they are not stored coded, when a device could not decode one of
    /// the chunks, or when `range` is not a whole coded tensor. The chunks' raw lengths
    /// sum to `range.len()`. A source that answers has checked the stored bytes (their
    /// checksums) before lending them.
    fn coded(&self, range: Range<usize>) -> Option<Vec<CodedChunk<'_>>> {
        let _ = range;
        None
    }
}

/// How a device decodes the stored bytes of a [`CodedChunk`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ChunkCoding {
    /// The symbols are the stored bytes (a chunk that coding would have grown).
    Raw,
    /// Lane-parallel order-0 rANS: the layout `ballast-weight-codec`'s
    /// `rans::encode_lanes` documents.
    RansLanes,
}

/// One plane of a block transform: for each block, in block order, `per_block` bytes,
/// the `k`-th of which goes to byte `offset + k * stride + byte` of its block. A
/// quantized block's one-byte fields are planes with `stride` 1; a field of f16 or f32
/// scalars is split into one plane per byte (`stride` 2 or 4, `byte` which of them).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Plane {
    /// Offset of the field in the block.
    pub offset: u32,
    /// Bytes of this plane per block.
    pub per_block: u32,
    /// Distance between this plane's consecutive bytes in the block.
    pub stride: u32,
    /// Which byte of each scalar of the field.
    pub byte: u32,
}

/// One chunk of a weight's bytes as stored coded (see [`ByteSource::coded`]). Decoding
/// gives `raw_len` symbols; with `planes`, the symbols come plane by plane (all whole
/// blocks' bytes of the first plane, then of the next), and the bytes after the last
/// whole block of `block_bytes` follow as they are; without, symbols are the bytes in
/// order.
#[derive(Clone, Copy, Debug)]
pub struct CodedChunk<'a> {
    /// The stored bytes.
    pub stored: &'a [u8],
    /// Decoded bytes.
    pub raw_len: usize,
    /// How the stored bytes code the symbols.
    pub coding: ChunkCoding,
    /// Bytes of one block of the weight's type.
    pub block_bytes: usize,
    /// The order the symbols come in; empty for the bytes in order.
    pub planes: &'a [Plane],
}

impl ByteSource for Vec<u8> {
    fn bytes(&self) -> Result<&[u8]> {
        Ok(self)
    }
}

/// A GGUF file's bytes (memory-mapped or read into RAM): the weights loaded from it
/// point into it.
impl ByteSource for GgufFile {
    fn bytes(&self) -> Result<&[u8]> {
        Ok(self.as_bytes())
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
        let len = source.byte_len();
        if range.start > range.end || range.end > len {
            return Err(Error::WeightRange {
                start: range.start,
                end: range.end,
                len,
            });
        }
        Ok(WeightBytes { source, range })
    }

    /// Bytes `range` of these bytes (relative to their start), sharing the source.
    pub fn slice(&self, range: Range<usize>) -> Result<WeightBytes> {
        if range.start > range.end || range.end > self.range.len() {
            return Err(Error::WeightRange {
                start: range.start,
                end: range.end,
                len: self.range.len(),
            });
        }
        Ok(WeightBytes {
            source: self.source.clone(),
            range: self.range.start + range.start..self.range.start + range.end,
        })
    }

    /// Bytes owned by this value alone.
    pub fn from_vec(bytes: Vec<u8>) -> WeightBytes {
        let range = 0..bytes.len();
        WeightBytes {
            source: Arc::new(bytes),
            range,
        }
    }

    /// The bytes, or the source's error if it could not produce them (see
    /// [`ByteSource::bytes`]).
    pub fn as_slice(&self) -> Result<&[u8]> {
        let all = self.source.bytes()?;
        all.get(self.range.clone()).ok_or(Error::WeightRange {
            start: self.range.start,
            end: self.range.end,
            len: all.len(),
        })
    }

    /// Bytes `range` of these bytes (relative to their start) alone, as
    /// [`ByteSource::range`] produces them: what a lookup of a few rows asks for.
    pub fn range_bytes(&self, range: Range<usize>) -> Result<Cow<'_, [u8]>> {
        if range.start > range.end || range.end > self.range.len() {
            return Err(Error::WeightRange {
                start: range.start,
                end: range.end,
                len: self.range.len(),
            });
        }
        let start = self.range.start;
        self.source.range(start + range.start..start + range.end)
    }

    /// See [`ByteSource::cache_on_device`].
    pub fn cache_on_device(&self) -> bool {
        self.source.cache_on_device()
    }

    /// These bytes as stored coded, if their source lends them so (see
    /// [`ByteSource::coded`]).
    pub fn coded(&self) -> Option<Vec<CodedChunk<'_>>> {
        self.source.coded(self.range.clone())
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

/// A weight's stable identity: the opened file it was read from and its byte offset
/// there. A device keeps weight copies by this key, which no other weight can take
/// (unlike an address, which a freed buffer hands to the next allocation).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct WeightId {
    /// [`crate::gguf::GgufFile::id`], or a [`next_file_id`] for weights made in memory.
    pub file: u64,
    /// Offset of the tensor's data in the file.
    pub offset: u64,
}

impl WeightId {
    /// An id of its own, for a weight made in memory (tests, tools).
    pub fn fresh() -> WeightId {
        WeightId {
            file: next_file_id(),
            offset: 0,
        }
    }
}

/// A new file identity, unique in the process.
pub fn next_file_id() -> u64 {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

/// One weight tensor: its GGUF name, element type, shape and bytes.
///
/// `dims` are in ggml order: `dims[0]` is the length of a row (the input size of a
/// matrix product), `dims[1]` the number of rows (its output size).
#[derive(Clone, Debug)]
pub struct Weight {
    /// The tensor's name in the GGUF file, for error messages and tables.
    pub name: String,
    /// Stable identity (file, offset): what a device keys its copy by. A store that
    /// moves the bytes (into a slot, into RAM) keeps the id.
    pub id: WeightId,
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

    /// Matrix `index` of a stack of matrices (`dims` `[cols, rows, n]`, as a mixture
    /// of experts stores its experts): a weight of its own over the same bytes, with
    /// its own [`WeightId`] (the stack's offset plus the matrix's, plus one: tensors
    /// start on aligned offsets, so no tensor, the stack included, has that id) so that
    /// a device keeps each one apart.
    pub fn stacked(&self, index: usize) -> Result<Weight> {
        let (&[cols, rows, n], true) = (
            &self.dims[..],
            index < self.dims.get(2).copied().unwrap_or(0),
        ) else {
            return Err(Error::ShapeMismatch {
                what: format!("matrix {index} of the stack {} {:?}", self.name, self.dims),
                expected: index + 1,
                got: self.dims.get(2).copied().unwrap_or(0),
            });
        };
        let each = self.bytes.len() / n;
        Ok(Weight {
            name: format!("{}[{index}]", self.name),
            id: WeightId {
                file: self.id.file,
                offset: self.id.offset + (index * each) as u64 + 1,
            },
            ty: self.ty,
            dims: vec![cols, rows],
            bytes: self.bytes.slice(index * each..(index + 1) * each)?,
        })
    }
}

impl Weight {
    /// The first `rows` rows alone (all of them if there are fewer): a weight of its
    /// own over the same bytes, with an id of its own, since a device must not take it
    /// for the whole tensor. What a draft model's head over part of the vocabulary
    /// multiplies by.
    pub fn first_rows(&self, rows: usize) -> Result<Weight> {
        let all = self.rows();
        if rows >= all {
            return Ok(self.clone());
        }
        let (&[cols, _], true) = (&self.dims[..], rows > 0) else {
            return Err(Error::ShapeMismatch {
                what: format!("the first {rows} rows of {} {:?}", self.name, self.dims),
                expected: 2,
                got: self.dims.len(),
            });
        };
        Ok(Weight {
            name: format!("{}[..{rows}]", self.name),
            id: WeightId::fresh(),
            ty: self.ty,
            dims: vec![cols, rows],
            bytes: self.bytes.slice(0..rows * self.row_bytes())?,
        })
    }
}

/// The weights of one transformer block, as a [`crate::WeightStore`] hands them to one
/// forward pass: a table of named tensors, as the GGUF file names them without the
/// `blk.N.` prefix (`attn_q.weight`, `attn_norm.weight`, `attn_q.bias`, ...).
///
/// Matrices stay as packed in the file; one-dimensional tensors (norm scales, biases)
/// are dequantized to f32 when loaded, since they are tiny. Which roles a layer has is
/// the architecture's business (its builder asks for them); stores, planners and
/// backends only iterate the table.
#[derive(Clone, Debug)]
pub struct LayerWeights {
    /// Index of the block.
    pub index: usize,
    /// Matrices by role (`attn_q.weight`, `ffn_down.weight`, ...), in file order.
    pub matrices: Vec<(String, Weight)>,
    /// Vectors by role (`attn_norm.weight`, `attn_q.bias`, ...).
    pub vectors: Vec<(String, Arc<[f32]>)>,
    /// Where the experts of a mixture of experts come from when their stacked tensors
    /// are not in `matrices` (a store that reads only the experts a token chose).
    pub experts: Option<ExpertFetch>,
}

/// Fetches one expert's matrix on demand: a store that streams a layer without its
/// experts reads the chosen ones when the router has chosen them.
pub trait ExpertSource: Send + Sync {
    /// Matrix `index` of the stacked tensor `role` (`ffn_gate_exps.weight`, ...), as
    /// [`Weight::stacked`] gives it (same name, id, type and dims).
    fn expert(&self, role: &str, index: usize) -> Result<Weight>;

    /// Several experts at once (`(role, index)` pairs), in order: a source that reads
    /// from disk may read them in parallel. The default asks one at a time.
    fn experts(&self, wanted: &[(&str, usize)]) -> Result<Vec<Weight>> {
        wanted.iter().map(|&(r, i)| self.expert(r, i)).collect()
    }
}

/// A shared [`ExpertSource`].
#[derive(Clone)]
pub struct ExpertFetch(pub Arc<dyn ExpertSource>);

impl std::fmt::Debug for ExpertFetch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ExpertFetch")
    }
}

impl LayerWeights {
    /// A layer of `matrices` and `vectors` whose experts, if any, are in `matrices`.
    pub fn new(
        index: usize,
        matrices: Vec<(String, Weight)>,
        vectors: Vec<(String, Arc<[f32]>)>,
    ) -> LayerWeights {
        LayerWeights {
            index,
            matrices,
            vectors,
            experts: None,
        }
    }

    /// Expert `index` of the stacked tensor `role`: cut from the tensor when the layer
    /// holds it, else fetched from [`LayerWeights::experts`].
    pub fn expert(&self, role: &str, index: usize) -> Result<Weight> {
        match (self.matrix(role), &self.experts) {
            (Ok(stack), _) => stack.stacked(index),
            (Err(_), Some(fetch)) => fetch.0.expert(role, index),
            (Err(e), None) => Err(e),
        }
    }

    /// Several experts (`(role, index)` pairs), in order, as [`LayerWeights::expert`]
    /// gives them; fetched together (in parallel, where the source reads from disk)
    /// when the layer does not hold them.
    pub fn experts_of(&self, wanted: &[(&str, usize)]) -> Result<Vec<Weight>> {
        let held = wanted.iter().all(|(r, _)| self.matrix(r).is_ok());
        match (&self.experts, held) {
            (Some(fetch), false) => fetch.0.experts(wanted),
            _ => wanted.iter().map(|&(r, i)| self.expert(r, i)).collect(),
        }
    }

    /// The matrix of `role`, or an error naming the layer and role.
    pub fn matrix(&self, role: &str) -> Result<&Weight> {
        self.matrices
            .iter()
            .find(|(r, _)| r == role)
            .map(|(_, w)| w)
            .ok_or_else(|| Error::LayerTensorMissing {
                layer: self.index,
                role: role.to_string(),
            })
    }

    /// The vector of `role`, if the layer has one.
    pub fn find_vector(&self, role: &str) -> Option<&Arc<[f32]>> {
        self.vectors.iter().find(|(r, _)| r == role).map(|(_, v)| v)
    }

    /// The vector of `role`, or an error naming the layer and role.
    pub fn vector(&self, role: &str) -> Result<&Arc<[f32]>> {
        self.find_vector(role)
            .ok_or_else(|| Error::LayerTensorMissing {
                layer: self.index,
                role: role.to_string(),
            })
    }

    /// The matrices, in table order.
    pub fn weights(&self) -> impl Iterator<Item = &Weight> {
        self.matrices.iter().map(|(_, w)| w)
    }

    /// The matrices, in table order, to replace their bytes (a store pointing them into
    /// a slot).
    pub fn weights_mut(&mut self) -> impl Iterator<Item = &mut Weight> {
        self.matrices.iter_mut().map(|(_, w)| w)
    }

    /// Bytes of all the tensors of this block.
    pub fn byte_size(&self) -> usize {
        let vectors = self.vectors.iter().map(|(_, v)| v.len() * 4).sum::<usize>();
        vectors + self.weights().map(|w| w.bytes.len()).sum::<usize>()
    }
}

/// The weights outside the transformer blocks, a table of named tensors like
/// [`LayerWeights`]': the roles the architecture's global table lists
/// (`token_embd.weight`, `output.weight`, `output_norm.weight`, ...), the output head
/// being the embedding table itself when the model ties them.
///
/// Every architecture ends in the same head ([`crate::blocks::head`]), so
/// [`GlobalWeights::new`] checks that its three roles are there, and stores and
/// planners reach them without a lookup that could fail.
#[derive(Clone, Debug)]
pub struct GlobalWeights {
    matrices: Vec<(String, Weight)>,
    vectors: Vec<(String, Arc<[f32]>)>,
    /// Where the head's roles sit in the tables.
    token_embd: usize,
    output: usize,
    output_norm: usize,
}

impl GlobalWeights {
    /// The table of `matrices` and `vectors` by role; an error naming the first of
    /// `token_embd.weight`, `output.weight` and `output_norm.weight` it lacks.
    pub fn new(
        matrices: Vec<(String, Weight)>,
        vectors: Vec<(String, Arc<[f32]>)>,
    ) -> Result<GlobalWeights> {
        fn at<T>(table: &[(String, T)], role: &str) -> Result<usize> {
            table
                .iter()
                .position(|(r, _)| r == role)
                .ok_or_else(|| Error::GlobalTensorMissing {
                    role: role.to_string(),
                })
        }
        Ok(GlobalWeights {
            token_embd: at(&matrices, blocks::TOKEN_EMBD)?,
            output: at(&matrices, blocks::OUTPUT)?,
            output_norm: at(&vectors, blocks::OUTPUT_NORM)?,
            matrices,
            vectors,
        })
    }

    /// The matrix of `role`, or an error naming it.
    pub fn matrix(&self, role: &str) -> Result<&Weight> {
        self.matrices
            .iter()
            .find(|(r, _)| r == role)
            .map(|(_, w)| w)
            .ok_or_else(|| Error::GlobalTensorMissing {
                role: role.to_string(),
            })
    }

    /// The vector of `role`, or an error naming it.
    pub fn vector(&self, role: &str) -> Result<&Arc<[f32]>> {
        self.vectors
            .iter()
            .find(|(r, _)| r == role)
            .map(|(_, v)| v)
            .ok_or_else(|| Error::GlobalTensorMissing {
                role: role.to_string(),
            })
    }

    /// The embedding table (`token_embd.weight`), one row per token.
    pub fn token_embd(&self) -> &Weight {
        &self.matrices[self.token_embd].1
    }

    /// The output head (`output.weight`; the embedding table when tied).
    pub fn output(&self) -> &Weight {
        &self.matrices[self.output].1
    }

    /// The final RMSNorm scale (`output_norm.weight`).
    pub fn output_norm(&self) -> &Arc<[f32]> {
        &self.vectors[self.output_norm].1
    }

    /// The embedding table, to point its bytes elsewhere (a store reading it into RAM).
    pub fn token_embd_mut(&mut self) -> &mut Weight {
        &mut self.matrices[self.token_embd].1
    }

    /// The output head, to point its bytes elsewhere.
    pub fn output_mut(&mut self) -> &mut Weight {
        &mut self.matrices[self.output].1
    }

    /// Keeps the output head's first `rows` rows only (logits for the first `rows`
    /// tokens of the vocabulary); see [`Weight::first_rows`]. A tied head keeps the
    /// embedding table's name, so that the table is still counted once.
    pub fn truncate_output(&mut self, rows: usize) -> Result<()> {
        let tied = self.tied();
        let mut head = self.output().first_rows(rows)?;
        if tied {
            head.name = self.token_embd().name.clone();
        }
        self.matrices[self.output].1 = head;
        Ok(())
    }

    /// Whether the output head is the embedding table (one tensor, held once).
    pub fn tied(&self) -> bool {
        self.output().name == self.token_embd().name
    }

    /// The matrices, each tensor once (a tied head is the embedding table).
    pub fn weights(&self) -> impl Iterator<Item = &Weight> {
        let tied = self.tied().then_some(self.output);
        self.matrices
            .iter()
            .enumerate()
            .filter(move |(i, _)| Some(*i) != tied)
            .map(|(_, (_, w))| w)
    }

    /// Bytes of all the tensors, each once.
    pub fn byte_size(&self) -> usize {
        let vectors = self.vectors.iter().map(|(_, v)| v.len() * 4).sum::<usize>();
        vectors + self.weights().map(|w| w.bytes.len()).sum::<usize>()
    }
}
