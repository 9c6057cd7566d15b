//! Model hyper-parameters: `ballast_core::config`, re-exported here at its old path.

pub use ballast_core::config::{ModelConfig, MoeSpec};
