//! The one error type of this crate.

use std::path::PathBuf;

/// Why one chunk of a packed tensor did not decode to the bytes that were packed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Corruption {
    /// The stored (compressed) bytes do not match their checksum: the file was changed
    /// after it was written.
    #[error("stored bytes fail their checksum (crc32 {found:08x}, expected {expected:08x})")]
    StoredChecksum {
        /// CRC-32 recorded in the index.
        expected: u32,
        /// CRC-32 of the bytes found.
        found: u32,
    },
    /// The decoded bytes do not match the checksum of the bytes that were packed.
    #[error("decoded bytes fail their checksum (crc32 {found:08x}, expected {expected:08x})")]
    DecodedChecksum {
        /// CRC-32 recorded in the index.
        expected: u32,
        /// CRC-32 of the bytes decoded.
        found: u32,
    },
    /// The entropy coder refused the stored bytes.
    #[error("{coder} stream is malformed: {detail}")]
    Stream {
        /// `zstd` or `rans`.
        coder: &'static str,
        /// What was wrong.
        detail: String,
    },
    /// The stored bytes decoded to the wrong number of bytes.
    #[error("decoded {got} bytes, expected {expected}")]
    Length {
        /// Raw bytes the index records for the chunk.
        expected: usize,
        /// Bytes the stream gave.
        got: usize,
    },
}

/// Everything that can go wrong in `ballast-weight-codec`. Each variant names the file,
/// tensor, chunk or limit concerned.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// Reading or writing a file failed.
    #[error("{}: I/O error: {source}", .path.display())]
    Io {
        /// The file concerned.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// The file does not start with the pack magic.
    #[error("{}: not a ballast pack: magic bytes are {found:02x?}", .path.display())]
    NotAPack {
        /// The file concerned.
        path: PathBuf,
        /// The first bytes found (up to 8).
        found: Vec<u8>,
    },
    /// A pack of a format version this reader does not know.
    #[error("{}: unsupported pack version {version} (this reader knows version {known})", .path.display())]
    UnsupportedVersion {
        /// The file concerned.
        path: PathBuf,
        /// The version found.
        version: u32,
        /// The version this reader reads.
        known: u32,
    },
    /// The file ends before a part the header promises.
    #[error("{}: pack truncated: {what} needs bytes up to {needed}, the file has {len}", .path.display())]
    Truncated {
        /// The file concerned.
        path: PathBuf,
        /// The part that does not fit.
        what: String,
        /// End offset the part needs.
        needed: u64,
        /// Length of the file.
        len: u64,
    },
    /// The header or the index does not match its checksum.
    #[error("{}: pack header and index fail their checksum (crc32 {found:08x}, expected {expected:08x})", .path.display())]
    HeaderChecksum {
        /// The file concerned.
        path: PathBuf,
        /// CRC-32 recorded in the file.
        expected: u32,
        /// CRC-32 of the bytes found.
        found: u32,
    },
    /// The index is inconsistent (with itself, with the embedded GGUF header, or with
    /// the file's length).
    #[error("{}: bad pack index: {detail}", .path.display())]
    BadIndex {
        /// The file concerned.
        path: PathBuf,
        /// What is wrong, naming the tensor and chunk when one is concerned.
        detail: String,
    },
    /// A chunk of a tensor is corrupt: it never decodes to wrong weights silently.
    #[error("{}: tensor {tensor}, chunk {chunk}: {kind}", .path.display())]
    Corrupt {
        /// The file concerned.
        path: PathBuf,
        /// The tensor's GGUF name.
        tensor: String,
        /// Index of the chunk in the tensor.
        chunk: usize,
        /// What failed.
        #[source]
        kind: Corruption,
    },
    /// Packing needs the bytes between tensors of the GGUF file to be zero (the pack
    /// does not store them, and a rebuilt file has zeros there).
    #[error("{}: byte {offset} of the data section, between tensors, is not zero; this file cannot be packed losslessly", .path.display())]
    NonZeroPadding {
        /// The GGUF file concerned.
        path: PathBuf,
        /// Offset in the data section.
        offset: u64,
    },
    /// A layer or tensor the caller asked for does not exist in the pack.
    #[error("{}: no tensor named {name} in the pack", .path.display())]
    NoSuchTensor {
        /// The file concerned.
        path: PathBuf,
        /// The name asked for.
        name: String,
    },
    /// An option out of its range.
    #[error("invalid option: {0}")]
    InvalidOption(String),
    /// An error of the GGUF layer (the embedded header, or the input file when packing).
    #[error(transparent)]
    Core(#[from] ballast_core::Error),
}

/// `Result` with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl From<Error> for ballast_core::Error {
    /// A store's error reaches the model as `ballast_core::Error::Store`.
    fn from(e: Error) -> ballast_core::Error {
        match e {
            Error::Core(c) => c,
            other => ballast_core::Error::Store {
                source: Box::new(other),
            },
        }
    }
}
