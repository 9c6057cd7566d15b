//! [`NeuronCache`]: which neuron sits in which slot of a layer's neuron store, what a
//! pass hits, and what it must fetch, evicting the least recently used slots.

use crate::{Error, Result};

/// A slot no neuron holds.
const EMPTY: u32 = u32::MAX;

/// One layer's slots.
#[derive(Clone, Debug)]
struct LayerSlots {
    /// Per slot, the neuron it holds (or [`EMPTY`]).
    owner: Vec<u32>,
    /// Per slot, the pass that last used it (0: never).
    last_used: Vec<u64>,
    /// Per neuron, its slot (or [`EMPTY`]).
    slot_of: Vec<u32>,
}

/// What one pass of one layer needs: a slot per asked neuron, and the fills.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Lookup {
    /// The slot of each asked neuron, in the order asked.
    pub slots: Vec<u32>,
    /// Per asked neuron, whether it was already in its slot.
    pub hit: Vec<bool>,
    /// The (neuron, slot) pairs the caller must write before computing, in the order
    /// asked: each slot is now assigned to its neuron, and its old neuron is gone.
    pub fills: Vec<(u32, u32)>,
}

/// Hits and misses counted over all lookups.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CacheCounts {
    /// Asked neurons found in their slot.
    pub hits: u64,
    /// Asked neurons that had to be fetched.
    pub misses: u64,
    /// Fills that replaced another neuron.
    pub evictions: u64,
}

impl CacheCounts {
    /// Hits over lookups (1 when nothing was asked).
    pub fn hit_rate(&self) -> f64 {
        let asked = self.hits + self.misses;
        if asked == 0 {
            1.0
        } else {
            self.hits as f64 / asked as f64
        }
    }
}

/// Per layer, a fixed number of slots for neuron records (Tricksy's neuron cache, LLM in
/// a Flash's "neurons used over the last few tokens").
///
/// [`NeuronCache::lookup`] takes a pass's active neurons (sorted, distinct), returns
/// each one's slot, and assigns the missing ones to free slots first, then to the slots
/// least recently used by earlier passes: never to a slot this pass needs, so a pass
/// asking more neurons than the layer has slots is an error ([`Error::InvalidArgument`]);
/// the sparse MLP serves such a pass in parts of at most `capacity` neurons.
///
/// The cache only keeps the books: the caller writes the fills into its store
/// (`NeuronOps::neuron_slots_write`) before computing, and calls
/// [`NeuronCache::forget`] if that write failed, so no slot is ever believed to hold a
/// neuron it does not.
#[derive(Clone, Debug)]
pub struct NeuronCache {
    layers: Vec<LayerSlots>,
    n_ff: usize,
    clock: u64,
    counts: CacheCounts,
    /// Scratch: the slots free to take in a lookup, with their last use.
    candidates: Vec<(u64, u32)>,
}

impl NeuronCache {
    /// `n_layers` layers of `n_ff` neurons each, `capacity` slots per layer (at most
    /// `n_ff`: more could never be used).
    pub fn new(n_layers: usize, n_ff: usize, capacity: usize) -> Result<NeuronCache> {
        if capacity == 0 || n_ff == 0 || n_ff >= EMPTY as usize {
            return Err(Error::InvalidArgument {
                what: format!("a neuron cache of {capacity} slots for {n_ff} neurons"),
            });
        }
        let capacity = capacity.min(n_ff);
        Ok(NeuronCache {
            layers: vec![
                LayerSlots {
                    owner: vec![EMPTY; capacity],
                    last_used: vec![0; capacity],
                    slot_of: vec![EMPTY; n_ff],
                };
                n_layers
            ],
            n_ff,
            clock: 1, // 1 is the stamp of a guess ([`NeuronCache::prefetch`]): older than any use
            counts: CacheCounts::default(),
            candidates: Vec::new(),
        })
    }

    /// Slots per layer.
    pub fn capacity(&self) -> usize {
        self.layers.first().map_or(0, |l| l.owner.len())
    }

    /// Neurons per layer.
    pub fn n_ff(&self) -> usize {
        self.n_ff
    }

    /// Hits and misses so far.
    pub fn counts(&self) -> CacheCounts {
        self.counts
    }

    /// The slot of `neuron` of `layer`, if cached.
    pub fn slot_of(&self, layer: usize, neuron: u32) -> Option<u32> {
        let s = *self.layers.get(layer)?.slot_of.get(neuron as usize)?;
        (s != EMPTY).then_some(s)
    }

    /// The neuron in `slot` of `layer`, if any.
    pub fn owner(&self, layer: usize, slot: u32) -> Option<u32> {
        let n = *self.layers.get(layer)?.owner.get(slot as usize)?;
        (n != EMPTY).then_some(n)
    }

    /// Slots of `layer` and neurons of the pass: `active` must be sorted and distinct,
    /// each below `n_ff`, and at most [`NeuronCache::capacity`] of them.
    pub fn lookup(&mut self, layer: usize, active: &[u32], out: &mut Lookup) -> Result<()> {
        self.assign(layer, active, out, false)
    }

    /// As [`NeuronCache::lookup`] for neurons a pass is predicted to use, fetched before
    /// it runs: the fills are booked as the least recently used slots (a wrong guess is
    /// the first to go, before any neuron a pass did use), until a lookup uses them.
    /// Not counted in [`NeuronCache::counts`].
    pub fn prefetch(&mut self, layer: usize, predicted: &[u32], out: &mut Lookup) -> Result<()> {
        self.assign(layer, predicted, out, true)
    }

    fn assign(
        &mut self,
        layer: usize,
        active: &[u32],
        out: &mut Lookup,
        guess: bool,
    ) -> Result<()> {
        let capacity = self.capacity();
        let n_ff = self.n_ff;
        let Some(l) = self.layers.get_mut(layer) else {
            return Err(Error::InvalidArgument {
                what: format!(
                    "layer {layer} of a neuron cache of {} layers",
                    self.layers.len()
                ),
            });
        };
        if active.len() > capacity {
            return Err(Error::InvalidArgument {
                what: format!(
                    "a pass of {} active neurons in layer {layer}, over the cache's {capacity} slots",
                    active.len()
                ),
            });
        }
        if let Some(w) = active.windows(2).find(|w| w[0] >= w[1]) {
            return Err(Error::InvalidArgument {
                what: format!(
                    "active neurons not sorted and distinct ({} then {})",
                    w[0], w[1]
                ),
            });
        }
        if let Some(&n) = active.last().filter(|&&n| n as usize >= n_ff) {
            return Err(Error::InvalidArgument {
                what: format!("neuron {n} of a layer of {n_ff}"),
            });
        }
        self.clock += 1;
        let now = self.clock;
        out.slots.clear();
        out.hit.clear();
        out.fills.clear();
        // Hits first: mark their slots used by this pass, so no fill takes them.
        let mut misses = 0usize;
        for &n in active {
            let s = l.slot_of[n as usize];
            if s != EMPTY {
                l.last_used[s as usize] = now;
            } else {
                misses += 1;
            }
        }
        // The `misses` slots to take: free ones (last use 0) first, then the least
        // recently used, never one used by this pass.
        self.candidates.clear();
        if misses > 0 {
            self.candidates.extend(
                l.last_used
                    .iter()
                    .enumerate()
                    .filter(|&(_, &u)| u != now)
                    .map(|(s, &u)| (if l.owner[s] == EMPTY { 0 } else { u }, s as u32)),
            );
            if misses < self.candidates.len() {
                self.candidates.select_nth_unstable(misses - 1);
                self.candidates.truncate(misses);
            }
            self.candidates.sort_unstable();
        }
        let mut victims = self.candidates.iter();
        for &n in active {
            let s = l.slot_of[n as usize];
            if s != EMPTY {
                out.slots.push(s);
                out.hit.push(true);
                continue;
            }
            let &(_, slot) = victims
                .next()
                .expect("capacity >= active, so enough slots are not used by this pass");
            let old = l.owner[slot as usize];
            if old != EMPTY {
                l.slot_of[old as usize] = EMPTY;
                self.counts.evictions += 1;
            }
            l.owner[slot as usize] = n;
            l.slot_of[n as usize] = slot;
            // A guess is older than any use (1: taken before every used slot, after
            // the free ones).
            l.last_used[slot as usize] = if guess { 1 } else { now };
            out.slots.push(slot);
            out.hit.push(false);
            out.fills.push((n, slot));
        }
        if !guess {
            self.counts.hits += (active.len() - misses) as u64;
            self.counts.misses += misses as u64;
        }
        Ok(())
    }

    /// Forgets the given fills (their write failed): those slots hold no neuron now.
    pub fn forget(&mut self, layer: usize, fills: &[(u32, u32)]) {
        let Some(l) = self.layers.get_mut(layer) else {
            return;
        };
        for &(n, s) in fills {
            if l.owner.get(s as usize) == Some(&n) {
                l.owner[s as usize] = EMPTY;
                l.last_used[s as usize] = 0;
                l.slot_of[n as usize] = EMPTY;
            }
        }
    }

    /// Empties every layer (counts stay).
    pub fn clear(&mut self) {
        for l in &mut self.layers {
            l.owner.fill(EMPTY);
            l.last_used.fill(0);
            l.slot_of.fill(EMPTY);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::{BTreeSet, HashMap};

    proptest! {
        /// Against a model (a map slot -> neuron, the store's content as written): every
        /// asked neuron's slot holds it after the fills are written, slots are distinct,
        /// no slot beyond capacity, hits are exactly the neurons the store already held,
        /// a fill never takes a slot this pass uses, and evictions are least recently used
        /// (a prefetched neuron no pass has used counting as older than any use).
        #[test]
        fn never_serves_a_stale_or_missing_neuron(
            n_ff in 1usize..40,
            capacity in 1usize..40,
            passes in proptest::collection::vec((proptest::collection::vec(0u32..40, 0..40), any::<bool>()), 1..30),
            fail_some in any::<bool>(),
        ) {
            let mut cache = NeuronCache::new(2, n_ff, capacity).unwrap();
            let cap = capacity.min(n_ff);
            prop_assert_eq!(cache.capacity(), cap);
            // What each slot really holds (written), per layer.
            let mut store: Vec<HashMap<u32, u32>> = vec![HashMap::new(); 2];
            let mut last: Vec<HashMap<u32, i64>> = vec![HashMap::new(); 2];
            let mut lookup = Lookup::default();
            for (p, (pass, guess)) in passes.iter().enumerate() {
                let layer = p % 2;
                let active: Vec<u32> = pass.iter().copied().filter(|&n| (n as usize) < n_ff)
                    .collect::<BTreeSet<_>>().into_iter().collect();
                let r = if *guess {
                    cache.prefetch(layer, &active, &mut lookup)
                } else {
                    cache.lookup(layer, &active, &mut lookup)
                };
                if active.len() > cap {
                    prop_assert!(r.is_err());
                    continue;
                }
                r.unwrap();
                prop_assert_eq!(lookup.slots.len(), active.len());
                let distinct: BTreeSet<u32> = lookup.slots.iter().copied().collect();
                prop_assert_eq!(distinct.len(), active.len());
                for (i, &n) in active.iter().enumerate() {
                    let s = lookup.slots[i];
                    prop_assert!((s as usize) < cap);
                    let held = store[layer].get(&s) == Some(&n);
                    prop_assert_eq!(lookup.hit[i], held, "hit iff the store holds it");
                    prop_assert_eq!(lookup.fills.contains(&(n, s)), !held);
                }
                // Evicted slots were the least recently used among those not needed.
                let used_now: BTreeSet<u32> = lookup.slots.iter().copied().collect();
                let evicted: Vec<u32> = lookup.fills.iter().map(|&(_, s)| s).filter(|s| store[layer].contains_key(s)).collect();
                let free_left = (0..cap as u32).filter(|s| !used_now.contains(s) && !store[layer].contains_key(s)).count();
                if !evicted.is_empty() {
                    prop_assert_eq!(free_left, 0, "a free slot was left while one was evicted");
                    let oldest_evicted = evicted.iter().map(|s| last[layer][s]).max().unwrap();
                    for (s, &u) in &last[layer] {
                        if !used_now.contains(s) {
                            prop_assert!(u >= oldest_evicted, "slot {} (used at {}) kept over an evicted one (used at {})", s, u, oldest_evicted);
                        }
                    }
                }
                if fail_some && p % 5 == 4 {
                    // The write failed: the cache forgets the fills, the store keeps
                    // whatever it held (here: the slots are now garbage).
                    cache.forget(layer, &lookup.fills);
                    for &(_, s) in &lookup.fills {
                        store[layer].remove(&s);
                        last[layer].remove(&s);
                    }
                } else {
                    for &(n, s) in &lookup.fills {
                        store[layer].insert(s, n);
                    }
                }
                for (&s, &hit) in lookup.slots.iter().zip(&lookup.hit) {
                    if store[layer].contains_key(&s) {
                        last[layer].insert(s, if *guess && !hit { -1 } else { p as i64 });
                    }
                }
                // The books agree with the store.
                for s in 0..cap as u32 {
                    let n = store[layer].get(&s).copied();
                    prop_assert_eq!(cache.owner(layer, s), n);
                    if let Some(n) = n {
                        prop_assert_eq!(cache.slot_of(layer, n), Some(s));
                    }
                }
            }
            let c = cache.counts();
            prop_assert!(c.hit_rate() >= 0.0 && c.hit_rate() <= 1.0);
        }
    }

    #[test]
    fn bad_passes_are_refused() {
        let mut cache = NeuronCache::new(1, 8, 4).unwrap();
        let mut l = Lookup::default();
        assert!(cache.lookup(0, &[1, 1], &mut l).is_err());
        assert!(cache.lookup(0, &[2, 1], &mut l).is_err());
        assert!(cache.lookup(0, &[8], &mut l).is_err());
        assert!(cache.lookup(1, &[0], &mut l).is_err());
        assert!(cache.lookup(0, &[0, 1, 2, 3, 4], &mut l).is_err());
        assert!(NeuronCache::new(1, 8, 0).is_err());
        cache.lookup(0, &[0, 1, 2, 3], &mut l).unwrap();
        assert_eq!(l.fills.len(), 4);
        cache.lookup(0, &[0, 1, 2, 3], &mut l).unwrap();
        assert!(l.fills.is_empty() && l.hit.iter().all(|&h| h));
        // One new neuron evicts the least recently used: slot of 3? All used at the same
        // pass; then 1, 2, 3 again, and 5 takes 0's slot.
        cache.lookup(0, &[1, 2, 3], &mut l).unwrap();
        let slot0 = cache.slot_of(0, 0).unwrap();
        cache.lookup(0, &[5], &mut l).unwrap();
        assert_eq!(l.fills, vec![(5, slot0)]);
        assert_eq!(cache.slot_of(0, 0), None);
        assert_eq!(cache.counts().hits, 7);
    }

    #[test]
    fn a_wrong_guess_goes_first() {
        let mut cache = NeuronCache::new(1, 8, 5).unwrap();
        let mut l = Lookup::default();
        cache.lookup(0, &[0, 1], &mut l).unwrap();
        cache.lookup(0, &[2], &mut l).unwrap();
        // Predicted 3 and 4: they take the two free slots.
        cache.prefetch(0, &[3, 4], &mut l).unwrap();
        assert_eq!(l.fills.len(), 2);
        assert_eq!(cache.counts().misses, 3, "a prefetch is not a miss");
        // The pass used 3 (a hit now) but not 4; a new neuron takes 4's slot, though 0
        // and 1 were used longer ago.
        cache.lookup(0, &[3], &mut l).unwrap();
        assert!(l.hit[0]);
        let slot4 = cache.slot_of(0, 4).unwrap();
        cache.lookup(0, &[5], &mut l).unwrap();
        assert_eq!(l.fills, vec![(5, slot4)]);
        assert!(cache.slot_of(0, 0).is_some() && cache.slot_of(0, 1).is_some());
    }
}
