//! The one error type of `ballast-kv-cache`.

use std::path::PathBuf;

/// What can go wrong saving or loading a session, or evaluating a stream. Every
/// variant that concerns a file names it; a failed load leaves the running session
/// as it was.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// Reading or writing the file failed.
    #[error("{}: {source}", .path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// The file is not a Ballast session file.
    #[error("{}: not a Ballast session file (bad magic)", .path.display())]
    BadMagic {
        /// The file.
        path: PathBuf,
    },
    /// A session file version this build cannot read.
    #[error("{}: session file version {found}, this build reads version {supported}", .path.display())]
    Version {
        /// The file.
        path: PathBuf,
        /// Version in the file.
        found: u32,
        /// Version this build reads.
        supported: u32,
    },
    /// The file ends early.
    #[error("{}: truncated session file: {what} needs {needed} bytes, {left} left", .path.display())]
    Truncated {
        /// The file.
        path: PathBuf,
        /// The field being read.
        what: &'static str,
        /// Bytes it needs.
        needed: u64,
        /// Bytes left.
        left: u64,
    },
    /// The checksum does not match the contents.
    #[error("{}: session file corrupted: checksum {found:016x}, contents hash to {computed:016x}", .path.display())]
    Checksum {
        /// The file.
        path: PathBuf,
        /// Checksum stored.
        found: u64,
        /// Checksum of the contents.
        computed: u64,
    },
    /// The session was saved with another model.
    #[error("{}: session was saved with another model (fingerprint {found:016x}, this model's is {expected:016x})", .path.display())]
    WrongModel {
        /// The file.
        path: PathBuf,
        /// Fingerprint in the file.
        found: u64,
        /// Fingerprint of the loaded model.
        expected: u64,
    },
    /// The session stores keys and values in another precision.
    #[error("{}: session stores keys and values as {found}, this cache holds {expected} (use --kv-dtype {found})", .path.display())]
    DtypeMismatch {
        /// The file.
        path: PathBuf,
        /// KvElement in the file.
        found: String,
        /// KvElement of the running cache.
        expected: String,
    },
    /// A header field holds an impossible value.
    #[error("{}: invalid session file: {why}", .path.display())]
    Invalid {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        why: String,
    },
    /// A forward pass or cache operation failed (`ballast-core`'s error, which the
    /// runtime shares).
    #[error(transparent)]
    Runtime(#[from] ballast_core::Error),
}

/// `Result` with this crate's [`Error`].
pub type Result<T> = std::result::Result<T, Error>;
