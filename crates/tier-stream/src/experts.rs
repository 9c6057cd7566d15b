//! Expert-granular streaming for a mixture of experts: a streamed layer's slot holds
//! its attention and router only, and each expert the router chooses is read on its own
//! (one contiguous range per stacked matrix), through an expert cache shared by every
//! layer that keeps the most recently used experts within a byte budget.
//!
//! A token reads `n_expert_used / n_expert` of a layer's expert bytes (less what the
//! cache holds) instead of all of them: on Qwen3-30B-A3B, 8 of 128 experts.
//! The price is a read that cannot start before the router has run (the pass waits for
//! it), counted as [`ExpertStats::stall`].

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ballast_core::gguf::GgufFile;
use ballast_core::weights::{ByteSource, ExpertSource, Weight, WeightBytes, WeightId};

use crate::io::{AlignedBuf, ReadAt};
use crate::plan::IO_ALIGN;
use crate::{Error, Result};

/// Whether `role` names a stacked expert tensor (`ffn_gate_exps.weight`, ...).
pub fn is_expert_role(role: &str) -> bool {
    role.ends_with("_exps.weight")
}

/// One stacked expert tensor of a layer: its shape and where it is in the file.
#[derive(Clone, Debug)]
pub(crate) struct ExpertTensor {
    pub(crate) role: String,
    /// The stacked weight (bytes unused: they stay on disk).
    template: Weight,
    file_offset: u64,
    n_expert: usize,
    /// Bytes of one expert's matrix.
    each: u64,
}

impl ExpertTensor {
    pub(crate) fn new(file: &GgufFile, role: &str, w: &Weight) -> Result<ExpertTensor> {
        let info = file.tensor(&w.name)?;
        let n_expert = w.dims.get(2).copied().unwrap_or(0);
        if w.dims.len() != 3 || n_expert == 0 || info.n_bytes % n_expert as u64 != 0 {
            return Err(Error::PlanMismatch {
                why: format!("{} {:?} is not a stack of experts", w.name, w.dims),
            });
        }
        let mut template = w.clone();
        template.bytes = WeightBytes::from_vec(Vec::new());
        Ok(ExpertTensor {
            role: role.to_string(),
            template,
            file_offset: info.offset,
            n_expert,
            each: info.n_bytes / n_expert as u64,
        })
    }
}

/// Counters of expert reads, cumulative.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ExpertStats {
    /// Bytes read from the file for experts (aligned reads).
    pub bytes: u64,
    /// Expert matrices read.
    pub reads: u64,
    /// Expert matrices found in the cache.
    pub hits: u64,
    /// Bytes of every expert matrix the router chose, found in the cache or not (the
    /// matrices' own sizes, not the aligned reads): what a token needs of the experts.
    pub chosen: u64,
    /// Of `chosen`, the bytes not found in the cache: what had to come from the file.
    pub missed: u64,
    /// Time the forward pass waited for expert reads (they start only once the router
    /// has chosen).
    pub stall: Duration,
}

#[derive(Default)]
pub(crate) struct ExpertCounters {
    bytes: AtomicU64,
    reads: AtomicU64,
    hits: AtomicU64,
    chosen: AtomicU64,
    missed: AtomicU64,
    stall_ns: AtomicU64,
}

impl ExpertCounters {
    pub(crate) fn get(&self) -> ExpertStats {
        ExpertStats {
            bytes: self.bytes.load(Ordering::Relaxed),
            reads: self.reads.load(Ordering::Relaxed),
            hits: self.hits.load(Ordering::Relaxed),
            chosen: self.chosen.load(Ordering::Relaxed),
            missed: self.missed.load(Ordering::Relaxed),
            stall: Duration::from_nanos(self.stall_ns.load(Ordering::Relaxed)),
        }
    }
}

/// An expert's bytes read from the file (aligned), alive while a pass or the cache
/// holds them.
struct ExpertBuf(AlignedBuf);

impl ByteSource for ExpertBuf {
    fn bytes(&self) -> ballast_core::Result<&[u8]> {
        Ok(self.0.as_slice())
    }

    /// Read per use: the device must not keep it.
    fn cache_on_device(&self) -> bool {
        false
    }
}

/// Key of a cached expert: (layer, tensor of the layer, expert).
type Key = (usize, usize, usize);

/// The most recently used experts of every layer, within `budget` bytes.
pub(crate) struct ExpertCache {
    budget: u64,
    inner: Mutex<CacheInner>,
}

#[derive(Default)]
struct CacheInner {
    used: u64,
    clock: u64,
    entries: HashMap<Key, (Arc<ExpertBuf>, u64)>,
}

impl ExpertCache {
    pub(crate) fn new(budget: u64) -> ExpertCache {
        ExpertCache {
            budget,
            inner: Mutex::default(),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, CacheInner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn get(&self, key: Key) -> Option<Arc<ExpertBuf>> {
        let mut c = self.lock();
        c.clock += 1;
        let now = c.clock;
        c.entries.get_mut(&key).map(|(b, used)| {
            *used = now;
            b.clone()
        })
    }

    /// Keeps `buf`, dropping the least recently used entries until it fits; a buffer
    /// larger than the whole budget is not kept.
    fn put(&self, key: Key, buf: Arc<ExpertBuf>) {
        let len = buf.0.len() as u64;
        if len > self.budget {
            return;
        }
        let mut c = self.lock();
        while c.used + len > self.budget {
            let Some((&oldest, _)) = c.entries.iter().min_by_key(|(_, (_, used))| *used) else {
                break;
            };
            if let Some((b, _)) = c.entries.remove(&oldest) {
                c.used -= b.0.len() as u64;
            }
        }
        c.clock += 1;
        let now = c.clock;
        c.used += len;
        if let Some((old, _)) = c.entries.insert(key, (buf, now)) {
            c.used -= old.0.len() as u64;
        }
    }

    /// Bytes held now.
    pub(crate) fn held(&self) -> u64 {
        self.lock().used
    }
}

/// The experts of one streamed layer, read on demand (an [`ExpertSource`]).
pub(crate) struct LayerExperts {
    pub(crate) layer: usize,
    pub(crate) tensors: Arc<Vec<ExpertTensor>>,
    pub(crate) reader: Arc<dyn ReadAt>,
    pub(crate) cache: Arc<ExpertCache>,
    pub(crate) counters: Arc<ExpertCounters>,
}

impl LayerExperts {
    fn read(&self, t: &ExpertTensor, index: usize) -> Result<ExpertBuf> {
        let start = t.file_offset + index as u64 * t.each;
        let aligned = start / IO_ALIGN * IO_ALIGN;
        let needed = start + t.each - aligned;
        let len = needed.div_ceil(IO_ALIGN) * IO_ALIGN;
        let mut buf = AlignedBuf::new(len as usize);
        let part = crate::store::Part::Expert {
            layer: self.layer,
            index,
        };
        crate::store::read_range(self.reader.as_ref(), part, aligned, needed, &mut buf)?;
        self.counters.bytes.fetch_add(len, Ordering::Relaxed);
        self.counters.reads.fetch_add(1, Ordering::Relaxed);
        Ok(ExpertBuf(buf))
    }
}

/// Reads running at once for the experts of one layer (they are independent; a disk
/// serves several queued reads faster than one at a time).
const PARALLEL_READS: usize = 4;

fn to_core(e: Error) -> ballast_core::Error {
    ballast_core::Error::Store {
        source: Box::new(e),
    }
}

impl LayerExperts {
    /// The tensor of `role` and its position in the layer, checking `index`.
    fn tensor(&self, role: &str, index: usize) -> ballast_core::Result<(usize, &ExpertTensor)> {
        let (k, t) = self
            .tensors
            .iter()
            .enumerate()
            .find(|(_, t)| t.role == role)
            .ok_or_else(|| ballast_core::Error::LayerTensorMissing {
                layer: self.layer,
                role: role.to_string(),
            })?;
        if index >= t.n_expert {
            return Err(to_core(Error::PlanMismatch {
                why: format!(
                    "expert {index} of {}: it has {}",
                    t.template.name, t.n_expert
                ),
            }));
        }
        Ok((k, t))
    }

    /// The weight of expert `index` of `t`, whose bytes `buf` holds.
    fn weight(
        &self,
        t: &ExpertTensor,
        index: usize,
        buf: Arc<ExpertBuf>,
    ) -> ballast_core::Result<Weight> {
        let start = t.file_offset + index as u64 * t.each;
        let at = (start % IO_ALIGN) as usize;
        let source: Arc<dyn ByteSource> = buf;
        let w = &t.template;
        Ok(Weight {
            name: format!("{}[{index}]", w.name),
            // As Weight::stacked names it, so a device keeps it under the same key.
            id: WeightId {
                file: w.id.file,
                offset: w.id.offset + index as u64 * t.each + 1,
            },
            ty: w.ty,
            dims: vec![w.dims[0], w.dims[1]],
            bytes: WeightBytes::new(source, at..at + t.each as usize)?,
        })
    }
}

impl ExpertSource for LayerExperts {
    fn expert(&self, role: &str, index: usize) -> ballast_core::Result<Weight> {
        Ok(self.experts(&[(role, index)])?.remove(0))
    }

    /// The cached ones from the cache; the others read from the file,
    /// [`PARALLEL_READS`] at a time, the wait counted as stall.
    fn experts(&self, wanted: &[(&str, usize)]) -> ballast_core::Result<Vec<Weight>> {
        // Each wanted expert: its tensor, its cache key, and its bytes if cached.
        let mut found = Vec::with_capacity(wanted.len());
        for &(role, index) in wanted {
            let (k, t) = self.tensor(role, index)?;
            let key = (self.layer, k, index);
            let hit = self.cache.get(key);
            self.counters.chosen.fetch_add(t.each, Ordering::Relaxed);
            if hit.is_some() {
                self.counters.hits.fetch_add(1, Ordering::Relaxed);
            } else {
                self.counters.missed.fetch_add(t.each, Ordering::Relaxed);
            }
            found.push((t, index, key, hit));
        }
        let missing: Vec<usize> = (0..found.len()).filter(|&i| found[i].3.is_none()).collect();
        if !missing.is_empty() {
            let started = Instant::now();
            let lanes = missing.len().min(PARALLEL_READS);
            let read: Vec<Result<Vec<(usize, ExpertBuf)>>> = std::thread::scope(|scope| {
                let handles: Vec<_> = (0..lanes)
                    .map(|lane| {
                        let found = &found;
                        let mine = missing.iter().copied().skip(lane).step_by(lanes);
                        scope.spawn(move || -> Result<Vec<(usize, ExpertBuf)>> {
                            mine.map(|i| Ok((i, self.read(found[i].0, found[i].1)?)))
                                .collect()
                        })
                    })
                    .collect();
                handles
                    .into_iter()
                    .map(|h| h.join().unwrap_or(Err(Error::PipelineClosed)))
                    .collect()
            });
            self.counters
                .stall_ns
                .fetch_add(started.elapsed().as_nanos() as u64, Ordering::Relaxed);
            for lane in read {
                for (i, buf) in lane.map_err(to_core)? {
                    let buf = Arc::new(buf);
                    self.cache.put(found[i].2, buf.clone());
                    found[i].3 = Some(buf);
                }
            }
        }
        found
            .into_iter()
            .map(|(t, index, _, buf)| self.weight(t, index, buf.expect("found or read")))
            .collect()
    }
}
