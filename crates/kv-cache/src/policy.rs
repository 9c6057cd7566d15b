//! Policies ([`KvPolicy`]): StreamingLLM (attention sinks plus a recent window) and the
//! plain sliding window (no sinks) it is compared against. No policy at all (`None`)
//! is the third baseline: the cache grows until it is full, then a clear error.

use std::sync::Arc;

use ballast_core::backend::{Rope, RopeOps};
use ballast_core::{Error, KvCache, KvPolicy, Result};

/// Which tokens a bounded cache keeps.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PolicyKind {
    /// Nothing is evicted; past the capacity the forward pass fails with
    /// [`Error::ContextFull`].
    None,
    /// The most recent `window` tokens.
    Window {
        /// Tokens kept.
        window: usize,
    },
    /// StreamingLLM: the first `n_sink` tokens and the most recent `window`.
    Streaming {
        /// Attention sinks (the paper uses 4).
        n_sink: usize,
        /// Recent tokens (252 for a 256-token cache).
        window: usize,
    },
}

impl PolicyKind {
    /// Tokens the cache must hold: sinks plus window (`None`: unbounded).
    pub fn budget(self) -> Option<usize> {
        match self {
            PolicyKind::None => None,
            PolicyKind::Window { window } => Some(window),
            PolicyKind::Streaming { n_sink, window } => Some(n_sink + window),
        }
    }
}

/// Keeps the first `n_sink` tokens and the most recent `window`, evicting the oldest
/// tokens after the sinks before each forward pass so that the new ones fit: the cache
/// never holds more than `n_sink + window` tokens (with `n_sink == 0` this is the plain
/// sliding window).
///
/// **Positions.** As in the paper, attention sees positions inside the cache, not in
/// the text. Keys are stored after RoPE (the model rotates them with their absolute
/// position), and RoPE scores depend only on the distance between query and key. The
/// window is contiguous, so its distances to the query are already the in-cache ones;
/// only the sinks are wrong after an eviction. This policy re-rotates the sinks'
/// keys so that they sit just before the window (`w0 - n_sink + i`, where `w0` is the
/// position of the oldest window token), which gives every query-key pair exactly the
/// paper's in-cache distance. Each layer's sinks turn with that layer's own RoPE
/// (gemma3's sliding layers use another base than its global ones). Cost: `n_sink` key rows per layer per eviction (a
/// constant, unlike llama.cpp's context shift, which re-rotates the whole window).
/// Each rotation starts from the sinks' keys as first seen, so rounding does not
/// accumulate over a long stream. Approximate like every eviction: measured by
/// perplexity (`ballast perplexity --stream`).
pub struct StreamingLlm {
    n_sink: usize,
    window: usize,
    /// The RoPE op that rotates (a backend's), and each layer's RoPE.
    rope: Option<(Arc<dyn RopeOps + Send + Sync>, Vec<Rope>)>,
    anchors: Vec<Option<SinkAnchor>>,
    scratch: (Vec<u32>, Vec<f32>, Vec<f32>),
}

/// The sinks' keys of one layer as first seen, and the positions last written.
#[derive(Clone, Debug)]
struct SinkAnchor {
    positions: Vec<u32>,
    keys: Vec<f32>,
    written: Vec<u32>,
}

impl StreamingLlm {
    /// Sinks and window. With sinks, [`StreamingLlm::with_rope`] must be given too
    /// (to re-rotate them).
    pub fn new(n_sink: usize, window: usize) -> Result<StreamingLlm> {
        if window == 0 {
            return Err(Error::InvalidArgument {
                what: "a KV window must hold at least one token".into(),
            });
        }
        Ok(StreamingLlm {
            n_sink,
            window,
            rope: None,
            anchors: Vec::new(),
            scratch: Default::default(),
        })
    }

    /// The policy `kind` describes (`None` for [`PolicyKind::None`]), re-rotating
    /// sinks with `backend`'s RoPE op (any [`ballast_core::Backend`], or any other
    /// [`RopeOps`]) and `layer_ropes`, the RoPE of each layer.
    pub fn from_kind(
        kind: PolicyKind,
        backend: Arc<dyn RopeOps + Send + Sync>,
        layer_ropes: Vec<Rope>,
    ) -> Result<Option<StreamingLlm>> {
        Ok(match kind {
            PolicyKind::None => None,
            PolicyKind::Window { window } => Some(StreamingLlm::new(0, window)?),
            PolicyKind::Streaming { n_sink, window } => {
                Some(StreamingLlm::new(n_sink, window)?.with_rope(backend, layer_ropes))
            }
        })
    }

    /// Re-rotates the sinks with `backend`'s RoPE op and `layer_ropes`: the settings
    /// each layer rotated its keys with, one per layer of the cache (a model's
    /// `ModelConfig::layer_ropes`). Any [`ballast_core::Backend`] is a [`RopeOps`]
    /// (an `Arc<dyn Backend>` coerces to the argument); a caller without one
    /// implements [`RopeOps`] alone.
    pub fn with_rope(
        mut self,
        backend: Arc<dyn RopeOps + Send + Sync>,
        layer_ropes: Vec<Rope>,
    ) -> StreamingLlm {
        self.rope = Some((backend, layer_ropes));
        self
    }

    /// Moves the sinks of every layer next to the window (see the type's docs).
    fn reanchor_sinks(&mut self, cache: &mut dyn KvCache) -> Result<()> {
        let shape = cache.shape();
        let dim = shape.kv_dim();
        let Some((backend, ropes)) = &self.rope else {
            return Err(Error::InvalidArgument {
                what: "StreamingLLM with attention sinks needs the model's RoPE to re-rotate them (StreamingLlm::with_rope)".into(),
            });
        };
        if ropes.len() != shape.n_layers {
            return Err(Error::InvalidArgument {
                what: format!(
                    "StreamingLLM was given the RoPE of {} layers for a cache of {}",
                    ropes.len(),
                    shape.n_layers
                ),
            });
        }
        self.anchors.resize(shape.n_layers, None);
        let (positions, keys, values) = &mut self.scratch;
        // One RoPE per layer (checked above).
        for (layer, rope) in ropes.iter().enumerate() {
            positions.clear();
            // Positions first: with the sinks' anchor kept, their rows are not needed
            // (a cache on a device would otherwise read them back every step).
            cache.positions(layer, 0..self.n_sink + 1, positions);
            if positions.len() <= self.n_sink {
                continue;
            }
            let w0 = positions[self.n_sink];
            let Some(base) = w0.checked_sub(self.n_sink as u32) else {
                continue;
            };
            let target: Vec<u32> = (0..self.n_sink as u32).map(|i| base + i).collect();
            if positions[..self.n_sink] == target[..] {
                continue;
            }
            let anchor = match &self.anchors[layer] {
                Some(a) if a.written[..] == positions[..self.n_sink] => a.clone(),
                _ => {
                    positions.clear();
                    keys.clear();
                    values.clear();
                    cache.read(layer, 0..self.n_sink, positions, keys, values);
                    SinkAnchor {
                        positions: positions[..self.n_sink].to_vec(),
                        keys: keys[..self.n_sink * dim].to_vec(),
                        written: positions[..self.n_sink].to_vec(),
                    }
                }
            };
            let mut rotated = anchor.keys.clone();
            for (i, row) in rotated.chunks_exact_mut(dim).enumerate() {
                let delta = target[i].checked_sub(anchor.positions[i]).ok_or_else(|| {
                    Error::InvalidArgument {
                        what: format!(
                            "attention sink {i} of layer {layer} would move back from position {} to {}",
                            anchor.positions[i], target[i]
                        ),
                    }
                })?;
                backend.rope(row, &[delta], shape.n_kv_heads, shape.head_dim, rope)?;
            }
            cache.rewrite_keys(layer, 0, &target, &rotated)?;
            self.anchors[layer] = Some(SinkAnchor {
                written: target,
                ..anchor
            });
        }
        Ok(())
    }
}

impl KvPolicy for StreamingLlm {
    fn before_pass(&mut self, cache: &mut dyn KvCache, n_new: usize) -> Result<()> {
        let budget = self.n_sink + self.window;
        let len = cache.len();
        if len + n_new <= budget {
            return Ok(());
        }
        if n_new > self.window {
            return Err(Error::InvalidArgument {
                what: format!(
                    "a forward pass of {n_new} tokens does not fit a KV window of {} tokens (lower the batch size)",
                    self.window
                ),
            });
        }
        let excess = len + n_new - budget;
        let sinks = self.n_sink.min(len);
        cache.evict(sinks..sinks + excess);
        if self.n_sink > 0 {
            self.reanchor_sinks(cache)?;
        }
        Ok(())
    }

    fn before_attention(&mut self, _layer: usize, _cache: &mut dyn KvCache) -> Result<()> {
        Ok(())
    }

    /// Evictions and re-rotations happen in `before_pass` only.
    fn acts_between_layers(&self) -> bool {
        false
    }

    /// The sinks' keys as first seen, per layer: a resumed session re-rotates from
    /// them as the uninterrupted run would (the cache holds only their rotated,
    /// rounded copies). Layout (little-endian): `n_sink` and layer count `u32`, then
    /// per layer a present byte and, if 1, the first-seen positions, the written
    /// positions (`n_sink` `u32` each), the key count `u32` and the keys (`f32`).
    fn state(&self) -> Vec<u8> {
        if self.anchors.iter().all(Option::is_none) {
            return Vec::new();
        }
        let mut out = Vec::new();
        out.extend_from_slice(&(self.n_sink as u32).to_le_bytes());
        out.extend_from_slice(&(self.anchors.len() as u32).to_le_bytes());
        for anchor in &self.anchors {
            let Some(a) = anchor else {
                out.push(0);
                continue;
            };
            out.push(1);
            for p in a.positions.iter().chain(&a.written) {
                out.extend_from_slice(&p.to_le_bytes());
            }
            out.extend_from_slice(&(a.keys.len() as u32).to_le_bytes());
            for k in &a.keys {
                out.extend_from_slice(&k.to_le_bytes());
            }
        }
        out
    }

    fn restore_state(&mut self, state: &[u8]) -> Result<()> {
        if state.is_empty() {
            self.anchors.clear();
            return Ok(());
        }
        let bad = |why: String| Error::InvalidArgument {
            what: format!("StreamingLLM state: {why}"),
        };
        let mut rest = state;
        let mut take = |n: usize, what: &str| -> Result<&[u8]> {
            if rest.len() < n {
                return Err(bad(format!("ends inside {what}")));
            }
            let (head, tail) = rest.split_at(n);
            rest = tail;
            Ok(head)
        };
        let u32s = |b: &[u8]| -> Vec<u32> {
            b.chunks_exact(4)
                .map(|c| u32::from_le_bytes(c.try_into().expect("4 bytes")))
                .collect()
        };
        let n_sink = u32s(take(4, "the sink count")?)[0] as usize;
        if n_sink != self.n_sink {
            return Err(bad(format!(
                "saved with {n_sink} attention sinks, this run has {}",
                self.n_sink
            )));
        }
        let n_layers = u32s(take(4, "the layer count")?)[0] as usize;
        let mut anchors = Vec::with_capacity(n_layers.min(4096));
        for layer in 0..n_layers {
            match take(1, "a layer's flag")?[0] {
                0 => anchors.push(None),
                1 => {
                    let positions = u32s(take(4 * n_sink, "sink positions")?);
                    let written = u32s(take(4 * n_sink, "sink positions")?);
                    let n_keys = u32s(take(4, "the key count")?)[0] as usize;
                    if n_sink == 0 || n_keys % n_sink != 0 {
                        return Err(bad(format!(
                            "layer {layer} has {n_keys} key values for {n_sink} sinks"
                        )));
                    }
                    let keys = take(n_keys.saturating_mul(4), "sink keys")?
                        .chunks_exact(4)
                        .map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes")))
                        .collect();
                    anchors.push(Some(SinkAnchor {
                        positions,
                        keys,
                        written,
                    }));
                }
                flag => return Err(bad(format!("layer {layer} has flag {flag}"))),
            }
        }
        if !rest.is_empty() {
            return Err(bad(format!("{} bytes after the last layer", rest.len())));
        }
        self.anchors = anchors;
        Ok(())
    }
}
