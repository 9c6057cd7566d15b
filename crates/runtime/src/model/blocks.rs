//! The shared blocks architecture builders compose a pass from, and the tensor role
//! names: `ballast_core::blocks`, re-exported here at its old path.

pub use ballast_core::blocks::*;
