//! [`KvCache`]: where attention keys and values live, [`KvPolicy`]: what may evict
//! them, and the types they exchange. The host caches are `ballast-kv-cache`'s.

use std::io::{Read, Write};

use half::f16;
use half::slice::HalfFloatSliceExt;

use crate::error::{Error, Result};
use crate::store::TierBytes;

/// The shape of the keys and values of every layer of a model.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvShape {
    /// Number of layers.
    pub n_layers: usize,
    /// Number of key/value heads.
    pub n_kv_heads: usize,
    /// Size of one head.
    pub head_dim: usize,
}

impl KvShape {
    /// Values per token per layer, for keys (and again for values).
    pub fn kv_dim(&self) -> usize {
        self.n_kv_heads * self.head_dim
    }
}

/// The element type a cache stores keys and values in, as [`KvRows`] shows them: the
/// one such type of the workspace, what every host cache, a device cache and a saved
/// session name (`--kv-dtype` parses into it).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum KvElement {
    /// 4 bytes per element: exact.
    F32,
    /// 2 bytes per element, rounded to nearest even: llama.cpp's default, and ours.
    #[default]
    F16,
    /// int8 with one f16 scale per [`Q8_BLOCK`] consecutive elements of a row
    /// (llama.cpp's `q8_0` geometry): 34 bytes per 32 elements. Approximate: measured
    /// by perplexity against f16, not assumed.
    Q8,
}

impl KvElement {
    /// Bytes a row of `dim` elements takes: 4, 2 or 34/32 per element.
    pub fn row_bytes(self, dim: usize) -> usize {
        match self {
            KvElement::F32 => 4 * dim,
            KvElement::F16 => 2 * dim,
            KvElement::Q8 => dim + 2 * dim.div_ceil(Q8_BLOCK),
        }
    }

    /// The name used on the command line and in errors: `f32`, `f16` or `q8`.
    pub fn name(self) -> &'static str {
        match self {
            KvElement::F32 => "f32",
            KvElement::F16 => "f16",
            KvElement::Q8 => "q8",
        }
    }

    /// The byte saved session files record it as.
    pub fn tag(self) -> u8 {
        match self {
            KvElement::F32 => 0,
            KvElement::F16 => 1,
            KvElement::Q8 => 2,
        }
    }

    /// The element [`KvElement::tag`] gave `tag`, if any.
    pub fn from_tag(tag: u8) -> Option<KvElement> {
        [KvElement::F32, KvElement::F16, KvElement::Q8]
            .into_iter()
            .find(|e| e.tag() == tag)
    }
}

impl std::str::FromStr for KvElement {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<KvElement, String> {
        match s {
            "f32" => Ok(KvElement::F32),
            "f16" => Ok(KvElement::F16),
            "q8" | "int8" | "q8_0" => Ok(KvElement::Q8),
            other => Err(format!(
                "unknown KV element type '{other}' (f32, f16 or q8)"
            )),
        }
    }
}

/// Elements per scale of [`KvRows::Q8`]: the rows are cut into blocks of this many
/// consecutive elements (counted from the start of the slice), each with one scale.
pub const Q8_BLOCK: usize = 32;

/// The position of a slot that holds no token (a masked slot of a cache that reuses
/// slots in place). Attention skips it, as it skips every position after the query's.
pub const MASKED_POSITION: u32 = u32::MAX;

/// Cached rows of keys or values, token-major, in their stored element type.
#[derive(Clone, Copy, Debug)]
pub enum KvRows<'a> {
    /// f32 elements.
    F32(&'a [f32]),
    /// f16 elements.
    F16(&'a [f16]),
    /// int8 elements, element `i` worth `quants[i] * scales[i / Q8_BLOCK]` (llama.cpp's
    /// `q8_0` geometry: 34 bytes per 32 elements). The slice starts on a block.
    Q8 {
        /// The quantized elements.
        quants: &'a [i8],
        /// One scale per [`Q8_BLOCK`] elements.
        scales: &'a [f16],
    },
}

impl KvRows<'_> {
    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            KvRows::F32(v) => v.len(),
            KvRows::F16(v) => v.len(),
            KvRows::Q8 { quants, .. } => quants.len(),
        }
    }

    /// True if there are no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Elements `range` as f32 into `out` (`out.len() == range.len()`).
    pub fn read_f32(&self, start: usize, out: &mut [f32]) {
        match self {
            KvRows::F32(v) => out.copy_from_slice(&v[start..start + out.len()]),
            KvRows::F16(v) => v[start..start + out.len()].convert_to_f32_slice(out),
            KvRows::Q8 { quants, scales } => {
                for (i, o) in out.iter_mut().enumerate() {
                    let e = start + i;
                    *o = quants[e] as f32 * scales[e / Q8_BLOCK].to_f32();
                }
            }
        }
    }
}

/// A contiguous run of cached tokens of one layer: `n_tokens` rows of keys and values,
/// each `kv_dim` long, and the position of each token.
#[derive(Clone, Copy, Debug)]
pub struct KvSegment<'a> {
    /// Keys, `positions.len() * kv_dim` elements, token-major.
    pub keys: KvRows<'a>,
    /// Values, same layout as the keys.
    pub values: KvRows<'a>,
    /// Position of each token (what RoPE rotated it with), or [`MASKED_POSITION`] for
    /// a slot that holds no token.
    pub positions: &'a [u32],
}

/// The live tokens of one layer, in order, as one or more contiguous segments (a
/// ring buffer presents its live region as at most two). A cache that reuses slots in
/// place may present masked slots ([`MASKED_POSITION`]) and tokens out of order;
/// attention does not depend on the order beyond f32 rounding.
#[derive(Clone, Debug, Default)]
pub struct KvView<'a> {
    /// The segments, oldest tokens first.
    pub segments: Vec<KvSegment<'a>>,
}

impl KvView<'_> {
    /// Number of tokens in the view (masked slots not counted).
    pub fn len(&self) -> usize {
        self.segments
            .iter()
            .map(|s| {
                s.positions
                    .iter()
                    .filter(|&&p| p != MASKED_POSITION)
                    .count()
            })
            .sum()
    }

    /// True if no token is cached.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Per-layer keys and values of the tokens seen so far.
///
/// The forward pass appends the new tokens' keys and values of layer `l` (after RoPE)
/// with [`KvCache::append`], calls the [`KvPolicy`] if any, then attends over
/// [`KvCache::view`]. All layers hold the same tokens once a pass has finished.
pub trait KvCache: Send {
    /// Shape of the cached keys and values.
    fn shape(&self) -> KvShape;
    /// The element type rows are stored in.
    fn element(&self) -> KvElement;
    /// Most tokens this cache can hold.
    fn capacity(&self) -> usize;
    /// Number of tokens cached in layer 0 (all layers, between passes).
    fn len(&self) -> usize;
    /// True if nothing is cached.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Append `positions.len()` tokens to `layer`: keys and values are token-major,
    /// `kv_dim` values each. Fails with [`Error::ContextFull`] past the capacity.
    fn append(
        &mut self,
        layer: usize,
        positions: &[u32],
        keys: &[f32],
        values: &[f32],
    ) -> Result<()>;
    /// The live tokens of `layer`.
    fn view(&self, layer: usize) -> KvView<'_>;
    /// Appends to `positions`, `keys` and `values` the tokens of `layer` at indices
    /// `range` (in cache order; clamped to what is cached), keys and values as f32 after
    /// the storage rounding. The default walks [`KvCache::view`], skipping masked
    /// slots; a cache whose view is not in cache order overrides it.
    fn read(
        &self,
        layer: usize,
        range: std::ops::Range<usize>,
        positions: &mut Vec<u32>,
        keys: &mut Vec<f32>,
        values: &mut Vec<f32>,
    ) {
        let dim = self.shape().kv_dim();
        let mut index = 0;
        for seg in self.view(layer).segments {
            for (i, &p) in seg.positions.iter().enumerate() {
                if p == MASKED_POSITION {
                    continue;
                }
                if range.contains(&index) {
                    positions.push(p);
                    for (rows, out) in [(&seg.keys, &mut *keys), (&seg.values, &mut *values)] {
                        let start = out.len();
                        out.resize(start + dim, 0.0);
                        rows.read_f32(i * dim, &mut out[start..]);
                    }
                }
                index += 1;
            }
        }
    }
    /// Appends to `out` the positions of the tokens of `layer` at indices `range` (in
    /// cache order; clamped to what is cached): [`KvCache::read`] without the rows, which
    /// a cache whose rows live on a device answers without reading them back.
    fn positions(&self, layer: usize, range: std::ops::Range<usize>, out: &mut Vec<u32>) {
        let live = self
            .view(layer)
            .segments
            .into_iter()
            .flat_map(|s| s.positions.iter().copied())
            .filter(|&p| p != MASKED_POSITION);
        out.extend(live.skip(range.start).take(range.len()));
    }
    /// The backend's own row store, when the rows live on a device: the backend that
    /// made the cache recognises it (by downcasting) and runs attention over it in
    /// place. `None` (the default) for a cache in host memory.
    fn device_rows(&mut self) -> Option<&mut dyn std::any::Any> {
        None
    }
    /// Keep only the first `n_tokens` tokens of every layer (speculative decoding,
    /// regenerating an answer).
    fn rewind(&mut self, n_tokens: usize);
    /// The smallest `n > 0` for which [`KvCache::rewind`]`(n)` leaves the cache as if
    /// the tokens after `n` had never been fed (`rewind(0)` always does). 0 for a cache
    /// that keeps every token; a cache that dropped tokens no later query would see (a
    /// sliding-window layer's past) cannot rewind below them exactly, and a caller
    /// rewinding further starts over instead.
    fn exact_rewind_floor(&self) -> usize {
        0
    }
    /// Most tokens one pass may append (a sliding-window layer keeps room for its
    /// window plus one pass); callers split longer prompts into passes of this size.
    fn pass_limit(&self) -> usize {
        usize::MAX
    }
    /// Drop the tokens at indices `range` (in cache order) from every layer.
    fn evict(&mut self, range: std::ops::Range<usize>);
    /// Replace the keys and positions of the `positions.len()` tokens of `layer` that
    /// start at index `start` (in cache order); values stay. A policy that moves tokens
    /// to new positions (re-rotating their keys, as llama.cpp's context shift does)
    /// writes them back with this. Caches that cannot rewrite say so with an error.
    fn rewrite_keys(
        &mut self,
        layer: usize,
        start: usize,
        positions: &[u32],
        keys: &[f32],
    ) -> Result<()> {
        let _ = (layer, start, positions, keys);
        Err(Error::InvalidArgument {
            what: "this KV cache cannot rewrite keys in place".into(),
        })
    }
    /// Drop everything.
    fn clear(&mut self) {
        self.rewind(0);
    }
    /// Bytes held per tier.
    fn held_bytes(&self) -> TierBytes;
    /// Bytes moved by appends and evictions since the cache was made.
    fn moved_bytes(&self) -> u64;
    /// Write the cached tokens of every layer.
    fn save(&self, out: &mut dyn Write) -> Result<()>;
    /// Replace the contents with what [`KvCache::save`] wrote.
    fn load(&mut self, input: &mut dyn Read) -> Result<()>;
}

/// Called before attention in each layer; may evict tokens from the cache.
/// StreamingLLM (attention sinks plus a recent window) is one such policy. With no
/// policy the cache only grows until it is full.
pub trait KvPolicy: Send {
    /// Runs once at the start of each forward pass, before `n_new` tokens are appended
    /// to every layer; may evict so that they fit (a bounded cache never grows past its
    /// capacity). Does nothing by default.
    fn before_pass(&mut self, cache: &mut dyn KvCache, n_new: usize) -> Result<()> {
        let _ = (cache, n_new);
        Ok(())
    }
    /// Runs after the new tokens of `layer` were appended and before attention reads
    /// `cache`.
    fn before_attention(&mut self, layer: usize, cache: &mut dyn KvCache) -> Result<()>;
    /// Whether [`KvPolicy::before_attention`] may change the cache. A policy that acts
    /// only in [`KvPolicy::before_pass`] says `false`: the cache a pass attends over is
    /// then fixed when the pass starts, so a device backend may run the whole pass at
    /// once (its copy of the cache follows the host's) instead of op by op.
    fn acts_between_layers(&self) -> bool {
        true
    }
    /// What of the policy's own state a saved session must carry to continue exactly
    /// as an uninterrupted run would (empty when the cache alone is enough).
    fn state(&self) -> Vec<u8> {
        Vec::new()
    }
    /// Takes back what [`KvPolicy::state`] gave; an error (and no change) if `state`
    /// is not something this policy wrote.
    fn restore_state(&mut self, state: &[u8]) -> Result<()> {
        if state.is_empty() {
            return Ok(());
        }
        Err(Error::InvalidArgument {
            what: format!(
                "a KV policy state of {} bytes, for a policy that keeps none",
                state.len()
            ),
        })
    }
}
