//! The crate's error type.

use std::path::PathBuf;

/// What can go wrong calibrating, saving or applying sparsity.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Reading or writing a profile file failed.
    #[error("{}: {source}", .path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// A profile file that is not one, is damaged, or is for another model.
    #[error("{}: {why}", .path.display())]
    Profile {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        why: String,
    },
    /// A neuron file that is not one, is damaged, or is for another model or layout.
    #[error("{}: {why}", .path.display())]
    NeuronFile {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        why: String,
    },
    /// A record of a neuron file whose checksum does not match.
    #[error("{}: the record of neuron {neuron} of layer {layer} is damaged (checksum mismatch)", .path.display())]
    DamagedRecord {
        /// The file.
        path: PathBuf,
        /// The layer.
        layer: usize,
        /// The neuron.
        neuron: usize,
    },
    /// A sparsity outside [0, 1), or a profile that does not fit the model.
    #[error("{what}")]
    InvalidArgument {
        /// What is wrong.
        what: String,
    },
    /// An error of the engine underneath (a kernel, a missing tensor).
    #[error(transparent)]
    Core(#[from] ballast_core::Error),
}

/// The crate's result type.
pub type Result<T> = std::result::Result<T, Error>;
