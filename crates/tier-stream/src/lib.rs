//! Ballast's tiered-streaming lever: run a model larger than device memory, or RAM.
//!
//! **Status: not implemented yet.** This crate holds only its documentation until its
//! own issue is taken. Nothing here works, and nothing pretends to.
//!
//! What it will hold (see `shared/seeds/003_*`): a `TieredStore` implementing
//! `ballast_runtime::WeightStore` that places layers on the device, in RAM or on disk
//! from a plan sized from the hardware, and streams them through device slots with
//! prefetch while earlier layers compute. Until then, `ballast_runtime::ResidentStore`
//! keeps every weight resident (memory-mapped).
#![deny(missing_docs)]
