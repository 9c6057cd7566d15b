//! Ballast's sparse-MLP lever: skip the MLP neurons a token does not use.
//!
//! **Status: not implemented yet.** This crate holds only its documentation until its
//! own issue is taken. Nothing here works, and nothing pretends to.
//!
//! What it will hold (see `shared/seeds/004_*`): an implementation of
//! `ballast_core::FeedForward` that predicts the active neurons of each MLP block
//! from the attention input, keeps the hot ones resident and fetches the rest, and
//! computes only those. It is approximate, and will be measured by perplexity and
//! token agreement against `ballast_core::DenseFfn`, which is exact.
#![deny(missing_docs)]
