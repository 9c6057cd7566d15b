//! [`Error`]: what building or running an engine can fail with.

use std::path::PathBuf;

use crate::size::human_bytes;

/// The facade's error: the crates' own errors, and what the engine adds (the file it
/// was reading, the option that was refused, a context too long for the budget).
///
/// Messages name the `ballast` command's flag for each builder option (`--ram` for
/// [`EngineBuilder::ram_budget`](crate::EngineBuilder::ram_budget)), since that is where
/// most users meet them.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The runtime's error (GGUF parsing, the model, a backend, sessions).
    #[error(transparent)]
    Runtime(#[from] ballast_runtime::Error),
    /// A KV cache or policy refused its options.
    #[error(transparent)]
    KvCache(#[from] ballast_kv_cache::Error),
    /// Tiered streaming: the planner, the RAM probe, the store (boxed: it is large).
    #[error(transparent)]
    TierStream(Box<ballast_tier_stream::Error>),
    /// A pack or the compressed store.
    #[error(transparent)]
    WeightCodec(#[from] ballast_weight_codec::Error),
    /// The sparse MLP: its profile, its neuron file.
    #[error(transparent)]
    SparseMlp(#[from] ballast_sparse_mlp::Error),
    /// An operating-system error.
    #[error(transparent)]
    Io(#[from] std::io::Error),
    /// Something failed while working on a file: what was done, the file, the cause.
    #[error("{action} {}", path.display())]
    File {
        /// What was being done: `"opening"`, `"loading"`, `"decoding the pack"`.
        action: &'static str,
        /// The file.
        path: PathBuf,
        /// Why it failed.
        #[source]
        source: Box<Error>,
    },
    /// An option's value was refused by the crate that uses it.
    #[error("{option}")]
    Option {
        /// The option, as the command line names it (`--sparsity`, `--device cpu`).
        option: String,
        /// Why it was refused.
        #[source]
        source: Box<Error>,
    },
    /// The planner could not place the model within a RAM budget.
    #[error("RAM budget {} ({budget_source})", human_bytes(*budget))]
    Budget {
        /// The budget in bytes.
        budget: u64,
        /// Where the budget came from.
        budget_source: String,
        /// The planner's refusal.
        #[source]
        source: Box<ballast_tier_stream::Error>,
    },
    /// A context that does not fit the RAM budget beside the model.
    #[error(transparent)]
    ContextTooLong(#[from] ContextTooLong),
    /// Options that do not go together, a value out of range, or a file an option needs
    /// that does not exist; the message says which and what to do.
    #[error("{0}")]
    Invalid(String),
}

impl From<ballast_tier_stream::Error> for Error {
    fn from(e: ballast_tier_stream::Error) -> Error {
        Error::TierStream(Box::new(e))
    }
}

/// The facade's result.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Adds the file a step was working on to its error.
pub(crate) trait AtFile<T> {
    /// `self` with its error wrapped as [`Error::File`].
    fn at(self, action: &'static str, path: &std::path::Path) -> Result<T>;
}

impl<T, E: Into<Error>> AtFile<T> for std::result::Result<T, E> {
    fn at(self, action: &'static str, path: &std::path::Path) -> Result<T> {
        self.map_err(|e| Error::File {
            action,
            path: path.to_path_buf(),
            source: Box::new(e.into()),
        })
    }
}

/// Refuses with [`Error::Invalid`] unless `cond` holds.
macro_rules! ensure {
    ($cond:expr, $($arg:tt)+) => {
        if !$cond {
            return Err($crate::Error::Invalid(format!($($arg)+)));
        }
    };
}
pub(crate) use ensure;

/// A context the RAM budget cannot hold beside the model, with the longest one it
/// can: the caller names the option that sets it.
#[derive(Clone, Debug, thiserror::Error)]
#[error(
    "a context of {ctx} tokens does not fit the RAM budget of {} ({budget_source}); {fits} tokens do: pass -c {fits} (or more memory: --ram, a higher limit)\n  ({refusal})",
    human_bytes(*budget)
)]
pub struct ContextTooLong {
    /// The context asked for, in tokens (all sequences together).
    pub ctx: u64,
    /// The longest context the budget holds.
    pub fits: u64,
    /// The budget in bytes.
    pub budget: u64,
    /// Where the budget came from.
    pub budget_source: String,
    /// The planner's refusal at `ctx`.
    pub refusal: String,
}
