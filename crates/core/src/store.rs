//! [`WeightStore`]: how the forward pass gets each layer's weights, and
//! [`ResidentStore`], the store that keeps every weight resident.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crate::error::{Error, Result};
use crate::weights::{GlobalWeights, LayerWeights};

/// Identifies one forward pass. Ids increase monotonically over the life of a model,
/// so a store can decide "decompress once per pass" or "prefetch layer i+1 while
/// layer i computes" by comparing ids.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PassId(pub u64);

/// A source of monotonically increasing [`PassId`]s.
#[derive(Debug, Default)]
pub struct PassCounter(AtomicU64);

impl PassCounter {
    /// The id of the next pass.
    pub fn next(&self) -> PassId {
        PassId(self.0.fetch_add(1, Ordering::Relaxed))
    }
}

/// Bytes per memory tier. Stores and caches report what they hold this way, and the
/// engine reports the peaks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TierBytes {
    /// Bytes in the memory the backend computes from (GPU memory on wgpu; on the CPU
    /// backend this is RAM and `ram` stays zero).
    pub device: u64,
    /// Bytes in host RAM that are not device memory.
    pub ram: u64,
    /// Bytes left on disk, read on use (memory-mapped pages count here until touched).
    pub disk: u64,
}

impl TierBytes {
    /// The sum over the tiers.
    pub fn total(&self) -> u64 {
        self.device + self.ram + self.disk
    }
}

impl std::ops::Add for TierBytes {
    type Output = TierBytes;
    fn add(self, o: TierBytes) -> TierBytes {
        TierBytes {
            device: self.device + o.device,
            ram: self.ram + o.ram,
            disk: self.disk + o.disk,
        }
    }
}

/// Hands the forward pass each layer's weights, resident on the backend, for the
/// duration of one forward pass.
///
/// The model calls [`WeightStore::globals`] and then [`WeightStore::layer`] for
/// `0..n_layers()` in order within one pass; a store may rely on that order to
/// prefetch, but must also answer any other order correctly.
pub trait WeightStore: Send + Sync {
    /// Number of transformer blocks.
    fn n_layers(&self) -> usize;
    /// The embedding table, final norm and output head.
    fn globals(&self) -> &GlobalWeights;
    /// Layer `index`'s weights for pass `pass`. The returned value keeps the bytes alive
    /// for as long as the caller holds it.
    fn layer(&self, pass: PassId, index: usize) -> Result<Arc<LayerWeights>>;
    /// Bytes held per tier now.
    fn held_bytes(&self) -> TierBytes;
    /// Bytes this store has moved between tiers since it was made.
    fn moved_bytes(&self) -> u64 {
        0
    }
}

/// A [`WeightStore`] whose layers have a coded (compressed) form, smaller than their
/// bytes, that it can hand out and decode: what lets a store above it keep layers coded
/// in RAM (more of them fit a budget) and decode each per use where it likes, such as
/// the prefetch pipeline of a tiered store (`ballast-tier-stream`), instead of asking
/// [`WeightStore::layer`] for bytes already decoded. A compressed pack's store
/// (`ballast-weight-codec`) is one.
///
/// The coded form of a layer is opaque to the caller: it holds the bytes and gives them
/// back to [`CodedLayers::decode_coded`] of the same store.
pub trait CodedLayers: WeightStore {
    /// Bytes of layer `index`'s coded form (what [`CodedLayers::read_coded`] returns).
    fn coded_len(&self, index: usize) -> u64;
    /// Layer `index`'s coded form, read from wherever the store keeps it (a pack on
    /// disk, say).
    fn read_coded(&self, index: usize) -> Result<Vec<u8>>;
    /// Decodes `coded`, layer `index`'s coded form, into `out`: one slice per matrix of
    /// the layer's table (`LayerWeights::weights`, in that order), each exactly that
    /// matrix's byte length. Decodes to the exact bytes [`WeightStore::layer`] gives, or
    /// fails (a coded form that is not this layer's is an error, never wrong bytes).
    fn decode_coded(&self, index: usize, coded: &[u8], out: &mut [&mut [u8]]) -> Result<()>;
    /// Reads layer `index`'s coded form and decodes it into `out` (as
    /// [`CodedLayers::decode_coded`]), returning the coded bytes read. The default reads
    /// the whole coded form first; a store that can read it piece by piece overrides
    /// this to hold at most [`CodedLayers::read_decode_held`] bytes of it at a time.
    fn read_decode(&self, index: usize, out: &mut [&mut [u8]]) -> Result<u64> {
        let coded = self.read_coded(index)?;
        self.decode_coded(index, &coded, out)?;
        Ok(coded.len() as u64)
    }
    /// The most coded bytes one [`CodedLayers::read_decode`] of layer `index` holds at
    /// once (the default: the whole coded form), which a budget pays for per reader.
    fn read_decode_held(&self, index: usize) -> u64 {
        self.coded_len(index)
    }
}

/// Keeps every layer resident: the bytes of a memory-mapped file (pages the kernel
/// loads on first touch), or of a file read into RAM.
pub struct ResidentStore {
    globals: GlobalWeights,
    layers: Vec<Arc<LayerWeights>>,
    mapped: bool,
}

impl ResidentStore {
    /// A store over weights already in memory. `mapped` says whether their bytes are a
    /// memory map (reported under `disk` until the kernel pages them in) or RAM.
    pub fn new(globals: GlobalWeights, layers: Vec<LayerWeights>, mapped: bool) -> ResidentStore {
        ResidentStore {
            globals,
            layers: layers.into_iter().map(Arc::new).collect(),
            mapped,
        }
    }
}

impl WeightStore for ResidentStore {
    fn n_layers(&self) -> usize {
        self.layers.len()
    }

    fn globals(&self) -> &GlobalWeights {
        &self.globals
    }

    fn layer(&self, _pass: PassId, index: usize) -> Result<Arc<LayerWeights>> {
        self.layers.get(index).cloned().ok_or(Error::LayerIndex {
            index,
            n_layers: self.layers.len(),
        })
    }

    fn held_bytes(&self) -> TierBytes {
        let mut bytes = self.globals.byte_size() as u64;
        bytes += self
            .layers
            .iter()
            .map(|l| l.byte_size() as u64)
            .sum::<u64>();
        // Mapped pages are file-backed: the kernel may drop and re-read them, so they
        // count as disk. Bytes read into RAM are what the CPU backend computes from.
        if self.mapped {
            TierBytes {
                disk: bytes,
                ..TierBytes::default()
            }
        } else {
            TierBytes {
                device: bytes,
                ..TierBytes::default()
            }
        }
    }
}
