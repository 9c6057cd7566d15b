//! Ballast's compressed-weights lever: hold and move fewer bytes per weight.
//!
//! **Status: not implemented yet.** This crate holds only its documentation until its
//! own issue is taken. Nothing here works, and nothing pretends to.
//!
//! What it will hold (see `shared/seeds/000_*`): a `CompressedStore` implementing
//! `ballast_core::WeightStore` that keeps layers losslessly compressed (decoding to
//! the exact packed bytes) and decompresses them on demand, at most once per forward
//! pass, under a caching policy.
#![deny(missing_docs)]
