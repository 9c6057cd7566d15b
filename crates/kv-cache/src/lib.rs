//! Ballast's KV-cache lever: ways to keep attention keys and values in bounded memory.
//!
//! **Status: not implemented yet.** This crate holds only its documentation until its
//! own issue is taken. Nothing here works, and nothing pretends to.
//!
//! What it will hold (see `shared/seeds/001_*` and `002_*`): implementations of
//! `ballast_runtime::KvCache` with three update modes (shift-concat, a pointer-shift
//! ring, a smart mask), f32 / f16 / int8 storage, session save and restore, and
//! `ballast_runtime::KvPolicy` implementations such as StreamingLLM (attention sinks
//! plus a recent window). Until then, `ballast_runtime::DenseKv` is the reference cache.
#![deny(missing_docs)]
