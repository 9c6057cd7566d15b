//! [`KvCache`]: where attention keys and values live, [`KvPolicy`]: what may evict
//! them, and [`DenseKv`], the plain reference cache that only grows.

use std::io::{Read, Write};

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

/// A contiguous run of cached tokens of one layer: `n_tokens` rows of keys and values,
/// each `kv_dim` long, and the position of each token.
#[derive(Clone, Copy, Debug)]
pub struct KvSegment<'a> {
    /// Keys, `positions.len() * kv_dim` values, token-major.
    pub keys: &'a [f32],
    /// Values, same layout as the keys.
    pub values: &'a [f32],
    /// Position of each token (what RoPE rotated it with).
    pub positions: &'a [u32],
}

/// The live tokens of one layer, in order, as one or more contiguous segments (a
/// ring buffer presents its live region as at most two).
#[derive(Clone, Debug, Default)]
pub struct KvView<'a> {
    /// The segments, oldest tokens first.
    pub segments: Vec<KvSegment<'a>>,
}

impl KvView<'_> {
    /// Number of tokens in the view.
    pub fn len(&self) -> usize {
        self.segments.iter().map(|s| s.positions.len()).sum()
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
    /// Keep only the first `n_tokens` tokens of every layer (speculative decoding,
    /// regenerating an answer).
    fn rewind(&mut self, n_tokens: usize);
    /// Drop the tokens at indices `range` (in cache order) from every layer.
    fn evict(&mut self, range: std::ops::Range<usize>);
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
    /// Runs after the new tokens of `layer` were appended and before attention reads
    /// `cache`.
    fn before_attention(&mut self, layer: usize, cache: &mut dyn KvCache) -> Result<()>;
}

/// The reference cache: one growing f32 buffer per layer, nothing evicted unless asked.
#[derive(Clone, Debug)]
pub struct DenseKv {
    shape: KvShape,
    capacity: usize,
    keys: Vec<Vec<f32>>,
    values: Vec<Vec<f32>>,
    positions: Vec<Vec<u32>>,
    moved: u64,
}

const DENSE_KV_MAGIC: &[u8; 8] = b"BLSTDKV1";

impl DenseKv {
    /// An empty cache of `shape` holding at most `capacity` tokens. Memory grows with
    /// use; nothing is reserved up front.
    pub fn new(shape: KvShape, capacity: usize) -> DenseKv {
        DenseKv {
            shape,
            capacity,
            keys: vec![Vec::new(); shape.n_layers],
            values: vec![Vec::new(); shape.n_layers],
            positions: vec![Vec::new(); shape.n_layers],
            moved: 0,
        }
    }

    fn check_layer(&self, layer: usize) -> Result<()> {
        if layer >= self.shape.n_layers {
            return Err(Error::LayerIndex {
                index: layer,
                n_layers: self.shape.n_layers,
            });
        }
        Ok(())
    }
}

impl KvCache for DenseKv {
    fn shape(&self) -> KvShape {
        self.shape
    }

    fn capacity(&self) -> usize {
        self.capacity
    }

    fn len(&self) -> usize {
        self.positions.first().map_or(0, Vec::len)
    }

    fn append(
        &mut self,
        layer: usize,
        positions: &[u32],
        keys: &[f32],
        values: &[f32],
    ) -> Result<()> {
        self.check_layer(layer)?;
        let dim = self.shape.kv_dim();
        let n = positions.len();
        if keys.len() != n * dim || values.len() != n * dim {
            return Err(Error::KvShape {
                expected: n * dim,
                keys: keys.len(),
                values: values.len(),
            });
        }
        let have = self.positions[layer].len();
        if have + n > self.capacity {
            return Err(Error::ContextFull {
                needed: have + n,
                capacity: self.capacity,
            });
        }
        self.keys[layer].extend_from_slice(keys);
        self.values[layer].extend_from_slice(values);
        self.positions[layer].extend_from_slice(positions);
        self.moved += (2 * keys.len() * 4) as u64;
        Ok(())
    }

    fn view(&self, layer: usize) -> KvView<'_> {
        if layer >= self.shape.n_layers {
            return KvView::default();
        }
        KvView {
            segments: vec![KvSegment {
                keys: &self.keys[layer],
                values: &self.values[layer],
                positions: &self.positions[layer],
            }],
        }
    }

    fn rewind(&mut self, n_tokens: usize) {
        let dim = self.shape.kv_dim();
        for l in 0..self.shape.n_layers {
            let n = n_tokens.min(self.positions[l].len());
            self.positions[l].truncate(n);
            self.keys[l].truncate(n * dim);
            self.values[l].truncate(n * dim);
        }
    }

    fn evict(&mut self, range: std::ops::Range<usize>) {
        let dim = self.shape.kv_dim();
        for l in 0..self.shape.n_layers {
            let len = self.positions[l].len();
            let start = range.start.min(len);
            let end = range.end.clamp(start, len);
            self.positions[l].drain(start..end);
            self.keys[l].drain(start * dim..end * dim);
            self.values[l].drain(start * dim..end * dim);
            self.moved += (2 * (len - end) * dim * 4) as u64;
        }
    }

    fn held_bytes(&self) -> TierBytes {
        let floats: usize = self.keys.iter().chain(&self.values).map(Vec::len).sum();
        let positions: usize = self.positions.iter().map(Vec::len).sum();
        TierBytes {
            device: (floats * 4 + positions * 4) as u64,
            ..TierBytes::default()
        }
    }

    fn moved_bytes(&self) -> u64 {
        self.moved
    }

    fn save(&self, out: &mut dyn Write) -> Result<()> {
        let mut buf = Vec::new();
        buf.extend_from_slice(DENSE_KV_MAGIC);
        for v in [
            self.shape.n_layers,
            self.shape.n_kv_heads,
            self.shape.head_dim,
        ] {
            buf.extend_from_slice(&(v as u64).to_le_bytes());
        }
        for l in 0..self.shape.n_layers {
            buf.extend_from_slice(&(self.positions[l].len() as u64).to_le_bytes());
            buf.extend_from_slice(bytemuck::cast_slice(&self.positions[l]));
            buf.extend_from_slice(bytemuck::cast_slice(&self.keys[l]));
            buf.extend_from_slice(bytemuck::cast_slice(&self.values[l]));
        }
        out.write_all(&buf).map_err(|source| Error::Io {
            what: "writing a KV cache".into(),
            source,
        })
    }

    fn load(&mut self, input: &mut dyn Read) -> Result<()> {
        let mut buf = Vec::new();
        input.read_to_end(&mut buf).map_err(|source| Error::Io {
            what: "reading a KV cache".into(),
            source,
        })?;
        let bad = |why: &str| Error::KvFormat {
            why: why.to_string(),
        };
        let mut rest: &[u8] = &buf;
        let mut take = |n: usize| -> Result<&[u8]> {
            if rest.len() < n {
                return Err(bad("truncated"));
            }
            let (head, tail) = rest.split_at(n);
            rest = tail;
            Ok(head)
        };
        if take(8)? != DENSE_KV_MAGIC {
            return Err(bad("bad magic"));
        }
        let mut dims = [0usize; 3];
        for d in &mut dims {
            *d = u64::from_le_bytes(take(8)?.try_into().expect("8 bytes")) as usize;
        }
        if dims
            != [
                self.shape.n_layers,
                self.shape.n_kv_heads,
                self.shape.head_dim,
            ]
        {
            return Err(bad("shape differs from this model's"));
        }
        let dim = self.shape.kv_dim();
        let mut loaded = DenseKv::new(self.shape, self.capacity);
        for l in 0..self.shape.n_layers {
            let n = u64::from_le_bytes(take(8)?.try_into().expect("8 bytes")) as usize;
            if n > self.capacity {
                return Err(bad("more tokens than the capacity"));
            }
            loaded.positions[l] = bytemuck::pod_collect_to_vec(take(n * 4)?);
            loaded.keys[l] = bytemuck::pod_collect_to_vec(take(n * dim * 4)?);
            loaded.values[l] = bytemuck::pod_collect_to_vec(take(n * dim * 4)?);
        }
        if !rest.is_empty() {
            return Err(bad("trailing bytes"));
        }
        loaded.moved = self.moved;
        *self = loaded;
        Ok(())
    }
}
