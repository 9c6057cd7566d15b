//! [`WindowedKv`]: a KV cache whose sliding-window layers hold only their window.
//!
//! A layer with a sliding window of `w` tokens (gemma3's local layers) lets a query at
//! position `q` see only the keys at `q - w + 1 ..= q`. Keeping every older key, masked,
//! is exact but costs memory that grows with the context on every such layer (5 of 6
//! on gemma3). `WindowedKv` splits the layers over two caches of any kind: the global
//! layers in one of the full context, the windowed layers in one that holds at most
//! `w - 1` tokens before a pass plus the tokens the pass appends (`chunk` at most, as
//! llama.cpp sizes its SWA cache: window plus one micro-batch). Before the first
//! windowed layer of a pass appends, the tokens no query of the pass can see (position
//! `p` with `p + w <= q0`, `q0` the pass's first position) are evicted from every
//! windowed layer at once. Attention then reads the same keys in the same order as
//! over the masked full cache, so the logits are the same bit for bit.
//!
//! What it cannot do: rewind below what it dropped. [`KvCache::exact_rewind_floor`]
//! says how far back a rewind stays exact; a session rewinding further starts over.
//!
//! ```
//! use ballast_core::kv::{KvCache, KvShape};
//! use ballast_kv_cache::{DenseKv, WindowedKv};
//!
//! let shape = KvShape { n_layers: 2, n_kv_heads: 1, head_dim: 4 };
//! // Layer 0 has a window of 3 tokens, layer 1 sees everything; passes of 1 token.
//! let mut kv = WindowedKv::new(shape, 100, &[Some(3), None], 1, |s, c| {
//!     Ok(Box::new(DenseKv::new(s, c)))
//! })?;
//! for p in 0..10u32 {
//!     let row = [p as f32; 4];
//!     kv.append(0, &[p], &row, &row)?;
//!     kv.append(1, &[p], &row, &row)?;
//! }
//! assert_eq!(kv.len(), 10);
//! assert_eq!(kv.view(0).len(), 3); // positions 7, 8, 9: what a query at 9 sees
//! assert_eq!(kv.view(1).len(), 10);
//! # Ok::<(), ballast_core::Error>(())
//! ```

use std::io::{Read, Write};
use std::ops::Range;

use ballast_core::kv::{KvCache, KvElement, KvShape, KvView, MASKED_POSITION};
use ballast_core::kv_payload::{self, LayerRows};
use ballast_core::kv_window::{
    keep_window, next_position, outside_window, rewind_floor, split_released,
};
use ballast_core::store::TierBytes;
use ballast_core::{Error, Result};

/// Where a layer of the model lives: its index in the global or the windowed cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Part {
    Global(usize),
    Windowed(usize),
}

/// Makes one of the two inner caches: `(shape, capacity)` to a cache.
pub type MakeCache<'a> = dyn FnMut(KvShape, usize) -> Result<Box<dyn KvCache>> + 'a;

/// A cache whose windowed layers keep only their window (see the module doc).
pub struct WindowedKv {
    shape: KvShape,
    capacity: usize,
    /// The window the windowed layers keep (the largest of theirs: keeping more than a
    /// layer's own window is still exact, attention skips the rest).
    window: usize,
    /// Most tokens one pass appends.
    chunk: usize,
    parts: Vec<Part>,
    global: Option<Box<dyn KvCache>>,
    windowed: Box<dyn KvCache>,
    /// Tokens dropped from the front of the windowed layers: the windowed cache holds
    /// the tokens at indices `dropped..` of the global layers' cache order.
    dropped: usize,
}

impl WindowedKv {
    /// A cache of `shape` for `capacity` tokens whose layer `l` keeps only the last
    /// `windows[l]` tokens (`None`: every token), for passes of at most `chunk` tokens;
    /// `make` builds the two inner caches (any update mode, element type or device).
    /// An error if `windows` does not give one entry per layer or none has a window.
    pub fn new(
        shape: KvShape,
        capacity: usize,
        windows: &[Option<usize>],
        chunk: usize,
        mut make: impl FnMut(KvShape, usize) -> Result<Box<dyn KvCache>>,
    ) -> Result<WindowedKv> {
        if windows.len() != shape.n_layers {
            return Err(Error::InvalidArgument {
                what: format!(
                    "{} sliding windows for a KV cache of {} layers",
                    windows.len(),
                    shape.n_layers
                ),
            });
        }
        let window = windows.iter().flatten().copied().max().unwrap_or(0);
        if window == 0 {
            return Err(Error::InvalidArgument {
                what: "a windowed KV cache needs a layer with a sliding window".into(),
            });
        }
        let chunk = chunk.max(1);
        let (mut n_global, mut n_windowed) = (0, 0);
        let parts = windows
            .iter()
            .map(|w| match w {
                Some(_) => {
                    n_windowed += 1;
                    Part::Windowed(n_windowed - 1)
                }
                None => {
                    n_global += 1;
                    Part::Global(n_global - 1)
                }
            })
            .collect();
        let with_layers = |n_layers| KvShape { n_layers, ..shape };
        let global = match n_global {
            0 => None,
            n => Some(make(with_layers(n), capacity)?),
        };
        let windowed = make(with_layers(n_windowed), Self::room(window, chunk, capacity))?;
        Ok(WindowedKv {
            shape,
            capacity,
            window,
            chunk,
            parts,
            global,
            windowed,
            dropped: 0,
        })
    }

    /// Tokens a windowed layer may hold: the `window - 1` a pass's first query still
    /// sees, plus the pass's own.
    fn room(window: usize, chunk: usize, capacity: usize) -> usize {
        (window - 1 + chunk).min(capacity)
    }

    /// The window the windowed layers keep.
    pub fn window(&self) -> usize {
        self.window
    }

    fn part(&self, layer: usize) -> Result<Part> {
        self.parts.get(layer).copied().ok_or(Error::LayerIndex {
            index: layer,
            n_layers: self.shape.n_layers,
        })
    }

    /// Evicts from every windowed layer the oldest tokens no query at `q0` or later
    /// sees.
    fn trim(&mut self, layer: usize, q0: u32) {
        let mut out = 0;
        'scan: for seg in self.windowed.view(layer).segments {
            for &p in seg.positions {
                if p == MASKED_POSITION {
                    continue;
                }
                if !outside_window(p, self.window, u64::from(q0)) {
                    break 'scan;
                }
                out += 1;
            }
        }
        if out > 0 {
            self.windowed.evict(0..out);
            self.dropped += out;
        }
    }

    fn inner_shape(&self, n_layers: usize) -> KvShape {
        KvShape {
            n_layers,
            ..self.shape
        }
    }

    /// Each inner cache's payload layers, in the model's layer order.
    fn split_layers(&self, layers: Vec<LayerRows>) -> (Vec<LayerRows>, Vec<LayerRows>) {
        let (mut global, mut windowed) = (Vec::new(), Vec::new());
        for (part, rows) in self.parts.iter().zip(layers) {
            match part {
                Part::Global(_) => global.push(rows),
                Part::Windowed(_) => windowed.push(rows),
            }
        }
        (global, windowed)
    }
}

/// The payload layers `cache` saves.
fn saved_layers(cache: &dyn KvCache) -> Result<Vec<LayerRows>> {
    let mut bytes = Vec::new();
    cache.save(&mut bytes)?;
    kv_payload::decode(&bytes, cache.element(), cache.shape(), cache.capacity())
}

impl KvCache for WindowedKv {
    fn shape(&self) -> KvShape {
        self.shape
    }

    fn element(&self) -> KvElement {
        self.windowed.element()
    }

    fn capacity(&self) -> usize {
        self.capacity
    }

    fn len(&self) -> usize {
        match &self.global {
            Some(global) => global.len(),
            None => self.dropped + self.windowed.len(),
        }
    }

    fn append(
        &mut self,
        layer: usize,
        positions: &[u32],
        keys: &[f32],
        values: &[f32],
    ) -> Result<()> {
        match self.part(layer)? {
            Part::Global(l) => match &mut self.global {
                Some(global) => global.append(l, positions, keys, values),
                None => unreachable!("a global layer without a global cache"),
            },
            Part::Windowed(l) => {
                if positions.len() > self.chunk {
                    return Err(Error::InvalidArgument {
                        what: format!(
                            "a pass of {} tokens into a KV cache whose sliding-window layers \
                             keep room for {} new tokens per pass",
                            positions.len(),
                            self.chunk
                        ),
                    });
                }
                if let Some(&q0) = positions.iter().min() {
                    self.trim(l, q0);
                }
                self.windowed.append(l, positions, keys, values)
            }
        }
    }

    fn view(&self, layer: usize) -> KvView<'_> {
        match self.parts.get(layer) {
            Some(&Part::Global(l)) => self
                .global
                .as_ref()
                .map_or_else(KvView::default, |g| g.view(l)),
            Some(&Part::Windowed(l)) => self.windowed.view(l),
            None => KvView::default(),
        }
    }

    /// On a windowed layer, `range` counts the tokens it holds (index 0 is its oldest
    /// kept token), not the global layers' cache order.
    fn read(
        &self,
        layer: usize,
        range: Range<usize>,
        positions: &mut Vec<u32>,
        keys: &mut Vec<f32>,
        values: &mut Vec<f32>,
    ) {
        match self.parts.get(layer) {
            Some(&Part::Global(l)) => {
                if let Some(g) = &self.global {
                    g.read(l, range, positions, keys, values)
                }
            }
            Some(&Part::Windowed(l)) => self.windowed.read(l, range, positions, keys, values),
            None => {}
        }
    }

    fn positions(&self, layer: usize, range: Range<usize>, out: &mut Vec<u32>) {
        match self.parts.get(layer) {
            Some(&Part::Global(l)) => {
                if let Some(g) = &self.global {
                    g.positions(l, range, out)
                }
            }
            Some(&Part::Windowed(l)) => self.windowed.positions(l, range, out),
            None => {}
        }
    }

    fn rewind(&mut self, n_tokens: usize) {
        if let Some(global) = &mut self.global {
            global.rewind(n_tokens);
        }
        // Below what was dropped a rewind is not exact (see `exact_rewind_floor`): the
        // windowed layers then start over from here.
        let (already, kept) = split_released(n_tokens..usize::MAX, self.dropped);
        self.dropped -= already;
        self.windowed.rewind(kept.start);
    }

    fn exact_rewind_floor(&self) -> usize {
        let inner = self.global.as_ref().map_or(0, |g| g.exact_rewind_floor());
        // After a rewind to n the next query sits at n and sees keys from n - w + 1 on;
        // the windowed layers hold from `dropped` on.
        inner.max(rewind_floor(self.dropped, self.window))
    }

    fn pass_limit(&self) -> usize {
        self.chunk
    }

    fn evict(&mut self, range: Range<usize>) {
        if let Some(global) = &mut self.global {
            global.evict(range.clone());
        }
        // Evicted tokens the windowed layers had already dropped just lower the count.
        let (already, held) = split_released(range, self.dropped);
        self.windowed.evict(held);
        self.dropped -= already;
    }

    fn rewrite_keys(
        &mut self,
        layer: usize,
        start: usize,
        positions: &[u32],
        keys: &[f32],
    ) -> Result<()> {
        match self.part(layer)? {
            Part::Global(l) => match &mut self.global {
                Some(global) => global.rewrite_keys(l, start, positions, keys),
                None => unreachable!("a global layer without a global cache"),
            },
            Part::Windowed(l) => {
                // Tokens before the window's start are gone: skip their part.
                let skip = self.dropped.saturating_sub(start).min(positions.len());
                let dim = self.shape.kv_dim();
                self.windowed.rewrite_keys(
                    l,
                    start.saturating_sub(self.dropped),
                    &positions[skip..],
                    &keys[skip * dim..],
                )
            }
        }
    }

    fn clear(&mut self) {
        if let Some(global) = &mut self.global {
            global.clear();
        }
        self.windowed.clear();
        self.dropped = 0;
    }

    fn held_bytes(&self) -> TierBytes {
        let global = self
            .global
            .as_ref()
            .map_or_else(TierBytes::default, |g| g.held_bytes());
        global + self.windowed.held_bytes()
    }

    fn moved_bytes(&self) -> u64 {
        self.global.as_ref().map_or(0, |g| g.moved_bytes()) + self.windowed.moved_bytes()
    }

    /// The payload every cache writes: per layer the tokens it holds (a windowed layer
    /// fewer), so a session resumes in a windowed cache of the same model.
    fn save(&self, out: &mut dyn Write) -> Result<()> {
        let mut global = match &self.global {
            Some(g) => saved_layers(g.as_ref())?.into_iter(),
            None => Vec::new().into_iter(),
        };
        let mut windowed = saved_layers(self.windowed.as_ref())?.into_iter();
        let mut layers = Vec::with_capacity(self.shape.n_layers);
        for part in &self.parts {
            let next = match part {
                Part::Global(_) => global.next(),
                Part::Windowed(_) => windowed.next(),
            };
            layers.push(next.unwrap_or_default());
        }
        kv_payload::write(out, self.element(), self.shape, &layers)
    }

    /// Loads any payload of this shape: a windowed layer keeps the last tokens its
    /// window needs (a session saved from a full cache loads too). A bad payload
    /// leaves the cache as it was.
    fn load(&mut self, input: &mut dyn Read) -> Result<()> {
        let layers = kv_payload::read(input, self.element(), self.shape, self.capacity)?;
        let total = layers.iter().map(|l| l.positions.len()).max().unwrap_or(0);
        let (global, mut windowed) = self.split_layers(layers);
        let row = self.element().row_bytes(self.shape.kv_dim());
        let next = next_position(&windowed);
        let mut kept = None;
        for l in &mut windowed {
            keep_window(l, self.window, next, row);
            kept.get_or_insert(l.positions.len());
        }
        let element = self.element();
        if let Some(g) = &mut self.global {
            let bytes = kv_payload::encode(element, g.shape(), &global);
            g.load(&mut bytes.as_slice())?;
        }
        let bytes = kv_payload::encode(element, self.inner_shape(windowed.len()), &windowed);
        self.windowed.load(&mut bytes.as_slice())?;
        let base = match &self.global {
            Some(g) => g.len(),
            None => total,
        };
        self.dropped = base.saturating_sub(kept.unwrap_or(0));
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::DenseKv;
    use ballast_core::kv::KvElement;
    use proptest::prelude::*;

    const SHAPE: KvShape = KvShape {
        n_layers: 3,
        n_kv_heads: 1,
        head_dim: 2,
    };
    const WINDOWS: [Option<usize>; 3] = [Some(4), None, Some(4)];

    fn windowed(chunk: usize) -> WindowedKv {
        WindowedKv::new(SHAPE, 64, &WINDOWS, chunk, |s, c| {
            Ok(Box::new(DenseKv::with_element(s, c, KvElement::F32)?))
        })
        .unwrap()
    }

    /// Appends the tokens at `positions` to every layer of both caches.
    fn feed(kv: &mut dyn KvCache, positions: &[u32]) {
        for layer in 0..SHAPE.n_layers {
            let row = |p: u32| [p as f32 + layer as f32 / 8.0, -(p as f32)];
            let keys: Vec<f32> = positions.iter().flat_map(|&p| row(p)).collect();
            let values: Vec<f32> = keys.iter().map(|k| k * 3.0).collect();
            kv.append(layer, positions, &keys, &values).unwrap();
        }
    }

    /// Positions and keys of `layer` a query at `q0` or later may see, in cache order.
    fn seen(kv: &dyn KvCache, layer: usize, q0: u32) -> Vec<(u32, f32)> {
        let (mut pos, mut keys, mut values) = (Vec::new(), Vec::new(), Vec::new());
        kv.read(layer, 0..usize::MAX, &mut pos, &mut keys, &mut values);
        let window = WINDOWS[layer].map_or(u64::MAX, |w| w as u64);
        pos.iter()
            .zip(keys.chunks(2))
            .filter(|(&p, _)| u64::from(p).saturating_add(window) > u64::from(q0))
            .map(|(&p, k)| (p, k[0]))
            .collect()
    }

    fn same_as_full(kv: &WindowedKv, full: &DenseKv, q0: u32) {
        for layer in 0..SHAPE.n_layers {
            assert_eq!(seen(kv, layer, q0), seen(full, layer, q0), "layer {layer}");
        }
        assert_eq!(kv.len(), full.len());
    }

    proptest! {
        /// After every pass the windowed layers hold exactly the tokens a query of the
        /// pass (or a later one) can see, in the full cache's order, and never more
        /// than the window plus one pass; rewinds at or above the floor stay exact.
        #[test]
        fn holds_what_the_window_sees(
            steps in proptest::collection::vec((1usize..6, 0usize..4), 1..24),
            chunk in 5usize..8,
        ) {
            let mut kv = windowed(chunk);
            let mut full = DenseKv::with_element(SHAPE, 64, KvElement::F32).unwrap();
            for (n, rewind) in steps {
                if full.len() + n > 64 {
                    break;
                }
                let q0 = full.len() as u32;
                let positions: Vec<u32> = (q0..q0 + n as u32).collect();
                feed(&mut kv, &positions);
                feed(&mut full, &positions);
                same_as_full(&kv, &full, q0);
                for l in [0, 2] {
                    prop_assert!(kv.view(l).len() < WINDOWS[l].unwrap() + chunk);
                }
                // Rewind by up to 3 tokens where that is exact; otherwise start over.
                let target = full.len().saturating_sub(rewind);
                if rewind > 0 {
                    if target == 0 || target >= kv.exact_rewind_floor() {
                        kv.rewind(target);
                        full.rewind(target);
                        same_as_full(&kv, &full, target as u32);
                    } else {
                        kv.rewind(0);
                        full.rewind(0);
                        prop_assert_eq!(kv.len(), 0);
                    }
                }
            }
        }
    }

    #[test]
    fn refuses_passes_past_its_room_and_bad_windows() {
        let mut kv = windowed(2);
        let err = kv.append(0, &[0, 1, 2], &[0.0; 6], &[0.0; 6]).unwrap_err();
        assert!(err.to_string().contains("room for 2"), "{err}");
        let err = WindowedKv::new(SHAPE, 8, &[None; 3], 1, |s, c| {
            Ok(Box::new(DenseKv::new(s, c)))
        })
        .err()
        .unwrap();
        assert!(err.to_string().contains("sliding window"), "{err}");
        let err = WindowedKv::new(SHAPE, 8, &[Some(2)], 1, |s, c| {
            Ok(Box::new(DenseKv::new(s, c)))
        })
        .err()
        .unwrap();
        assert!(err.to_string().contains("1 sliding windows"), "{err}");
    }

    #[test]
    fn memory_stops_growing_on_windowed_layers() {
        let mut kv = windowed(1);
        let mut held = Vec::new();
        for p in 0..40u32 {
            feed(&mut kv, &[p]);
            held.push(kv.held_bytes().total());
        }
        // Past the window only the global layer grows: one token's row pair a step.
        let step = 2 * 2 * 4 + 4;
        assert!(
            held.windows(2).skip(8).all(|w| w[1] - w[0] == step),
            "{held:?}"
        );
        assert_eq!(kv.view(0).len(), 4);
        assert_eq!(kv.exact_rewind_floor(), 36 + 3);
    }

    #[test]
    fn sessions_round_trip_and_full_payloads_load() {
        let mut kv = windowed(3);
        let mut full = DenseKv::with_element(SHAPE, 64, KvElement::F32).unwrap();
        for q0 in (0..15u32).step_by(3) {
            let positions: Vec<u32> = (q0..q0 + 3).collect();
            feed(&mut kv, &positions);
            feed(&mut full, &positions);
        }
        let mut saved = Vec::new();
        kv.save(&mut saved).unwrap();
        let mut back = windowed(3);
        back.load(&mut saved.as_slice()).unwrap();
        same_as_full(&back, &full, 15);
        // It keeps what the next query sees, so it may rewind less far back than before.
        assert!(back.exact_rewind_floor() >= kv.exact_rewind_floor());
        let mut from_full = Vec::new();
        full.save(&mut from_full).unwrap();
        let mut loaded = windowed(3);
        loaded.load(&mut from_full.as_slice()).unwrap();
        same_as_full(&loaded, &full, 15);
        assert!(loaded.view(0).len() < 4);
        // And the next pass continues as in the full cache.
        feed(&mut loaded, &[15, 16]);
        feed(&mut full, &[15, 16]);
        same_as_full(&loaded, &full, 15);
        let err = loaded.load(&mut &saved[..10]).unwrap_err();
        assert!(err.to_string().contains("KV"), "{err}");
        same_as_full(&loaded, &full, 15);
    }
}
