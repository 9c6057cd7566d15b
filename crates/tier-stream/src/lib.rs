//! Ballast's tiered-streaming lever: run a model larger than device memory, or than RAM.
//!
//! Three tiers, sized from the hardware (after the seed `shared/seeds/003_*`):
//!
//! | tier | where | cost per token |
//! |---|---|---|
//! | A, [`Tier::Device`] | where the backend computes (GPU memory; RAM on the CPU) | none |
//! | B, [`Tier::Ram`] | host RAM, uploaded to a device slot per use; on the CPU, layers held coded (a pack), decoded into a slot per use | one upload; one decode |
//! | C, [`Tier::Disk`] | the model file, read per use bypassing the page cache | one read (+ upload) |
//!
//! - [`plan()`] places every layer from its real byte size, the budgets ([`Budgets`],
//!   given or probed with [`probe::probe_ram`]: `MemAvailable`, and a cgroup limit
//!   wins) and the reserves the model needs at its context ([`Reserve`]: KV cache,
//!   activations, scratch, a margin). The placement rule and its reason are in the
//!   [`plan`](mod@plan) module. [`Plan::predict`] simulates the pipeline and gives
//!   the time per token and the bottleneck for given [`Speeds`].
//! - [`TieredStore`] implements `ballast_core::WeightStore`: resident layers are
//!   read once, streamed ones are read per use by reader threads into a ring of slots
//!   (prefetch depth = slots), through [`io::DirectFile`] (`O_DIRECT`, or reads plus
//!   `posix_fadvise(DONTNEED)`), so the page cache does not silently spend the budget.
//!   [`TieredStore::over_store`] stacks the same tiers over another `WeightStore`
//!   instead of the file (a store that decompresses on demand, say): the layers it
//!   streams are fetched from the store beneath by the same reader threads, ahead of
//!   the forward pass. [`TieredStore::over_coded`] does the same over a store whose
//!   layers have a coded form (`ballast_core::CodedLayers`: a compressed pack): its
//!   RAM tier may hold layers coded ([`RamTier`]), so more of them fit the budget, and
//!   the reader threads decode them into slots ahead of use, as they decode the layers
//!   they read from disk.
//!
//! **Backends.** On the CPU backend tiers A and B are the same RAM: a plan made with
//! `Budgets { device: None, .. }` has only [`Tier::Device`] (resident in RAM) and
//! [`Tier::Disk`] layers, plus [`Tier::Ram`] layers held coded when the plan asks for a
//! coded RAM tier ([`Plan::ram_coded`]), and slots are RAM buffers the CPU computes from. With a
//! separate device (`Budgets { device: Some(..), .. }`, the wgpu backend), tier A
//! layers and the head are uploaded once by the backend and kept; tier B layers are
//! read once into RAM and tier C layers into RAM staging slots, and both are uploaded
//! per use into the backend's ring of device slots (their bytes say they may not be
//! cached on the device: `ByteSource::cache_on_device`; the slot count comes from
//! `plan.device_slots` through `WgpuBackend::set_stream_slots`). The device pass
//! submits its work so far before it overwrites a slot, so uploads and compute
//! alternate within a pass.
//!
//! # Example
//!
//! ```
//! use ballast_tier_stream::{plan, Budgets, ModelShape, PlanRequest, RamTier, Speeds, Tier};
//!
//! // The seed's machine: 70B Q6_K (80 layers), 24 GiB GPU, 48 GiB RAM, PCIe at 6.5 GB/s.
//! let shape = ModelShape::from_dims(80, 8192, 64, 8, 28672, 128256, 6.5625, 6.5625);
//! let p = plan(&PlanRequest {
//!     shape,
//!     budgets: Budgets { device: Some(24 << 30), ram: 48 << 30 },
//!     ctx: 512,
//!     batch: 1,
//!     depth: 2,
//!     ram_tier: RamTier::Raw,
//! })?;
//! let (a, b, c) = p.counts();
//! assert_eq!(a + b + c, 80);
//! assert!(a > 20 && c == 0);
//! let speed = Speeds { compute_bytes_per_s: 900e9, h2d_bytes_per_s: 6.5e9, disk_bytes_per_s: 3e9 };
//! let pred = p.predict(&speed, 512);
//! assert!(pred.tokens_per_s() < 1.0); // bound by PCIe
//! # Ok::<(), ballast_tier_stream::Error>(())
//! ```
#![deny(missing_docs)]

pub mod experts;
pub mod io;
pub mod plan;
pub mod probe;
mod store;

use std::path::PathBuf;

pub use experts::ExpertStats;
pub use plan::{
    largest_context, plan, Bottleneck, Budgets, BytesPerToken, ModelShape, Plan, PlanRequest,
    Prediction, RamTier, Reserve, Speeds, Tier,
};
pub use store::{model_shape, Part, StatsHandle, StreamStats, TieredOptions, TieredStore};

/// Errors of this crate. Read errors name the layer and the file.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A budget cannot hold even one slot with the reserves.
    #[error("the {tier} budget of {budget} bytes is too small: at least {needed} bytes are needed ({what})")]
    BudgetTooSmall {
        /// `"device"` or `"RAM"`.
        tier: &'static str,
        /// The budget.
        budget: u64,
        /// The least that would do.
        needed: u64,
        /// What the needed bytes are made of.
        what: String,
    },
    /// Reading a layer from the model file failed.
    #[error("reading {part} from {} at byte {offset}: {source}", .path.display())]
    LayerRead {
        /// The layer (or head) being read.
        part: Part,
        /// The file.
        path: PathBuf,
        /// Where the failing read started.
        offset: u64,
        /// The OS error.
        source: std::io::Error,
    },
    /// The file ended before a layer's bytes did.
    #[error("short read of {part} from {}: {wanted} bytes wanted at byte {offset}, the file gave {got}", .path.display())]
    ShortRead {
        /// The layer (or head) being read.
        part: Part,
        /// The file.
        path: PathBuf,
        /// Start of the read.
        offset: u64,
        /// Bytes wanted.
        wanted: u64,
        /// Bytes read.
        got: u64,
    },
    /// Every slot is held by the caller, so another streamed layer cannot be loaded.
    #[error("layer {layer}: all {slots} slots are held by the caller; drop a layer's weights before asking for more, or plan a deeper ring")]
    SlotsExhausted {
        /// Slots in the ring.
        slots: usize,
        /// The layer asked for.
        layer: usize,
    },
    /// The plan does not fit this model or this store.
    #[error("the plan does not fit: {why}")]
    PlanMismatch {
        /// Why.
        why: String,
    },
    /// A size or rate on the command line could not be read.
    #[error("bad {what} '{text}': expected {expected}")]
    BadQuantity {
        /// `"size"` or `"rate"`.
        what: &'static str,
        /// The text given.
        text: String,
        /// What is accepted.
        expected: &'static str,
    },
    /// A reader thread could not be started.
    #[error("starting a reader thread: {source}")]
    Thread {
        /// The OS error.
        source: std::io::Error,
    },
    /// The reader threads are gone (one panicked).
    #[error("the prefetch pipeline stopped")]
    PipelineClosed,
    /// An error of `ballast-core` (a tensor missing from the file, a bad range), the
    /// error type the runtime shares.
    #[error(transparent)]
    Runtime(#[from] ballast_core::Error),
}

/// This crate's result.
pub type Result<T, E = Error> = std::result::Result<T, E>;
