//! The rules of a sliding-window layer's cache, shared by the host cache that keeps only
//! the window (`ballast-kv-cache`'s `WindowedKv`) and a device's (the runtime's
//! `DeviceKv`): which keys no later query can see, how far back a rewind stays exact,
//! and how a saved payload is cut to the window.

use std::ops::Range;

use crate::kv_payload::LayerRows;

/// Whether a key at position `p` is past what a layer with a `window` keeps for queries
/// at `q0` or later (`q - p >= window` for every such query `q`).
pub fn outside_window(p: u32, window: usize, q0: u64) -> bool {
    u64::from(p) + window as u64 <= q0
}

/// How far back a layer of `window` that released its first `dropped` tokens can
/// rewind exactly ([`KvCache::exact_rewind_floor`]): after a rewind to `n` the next
/// query sits at `n` and sees keys from `n - window + 1` on.
pub fn rewind_floor(dropped: usize, window: usize) -> usize {
    if dropped == 0 {
        0
    } else {
        dropped + window - 1
    }
}

/// A range of cache indices (counted from the first token ever kept) against a layer
/// that released its first `dropped`: how many of the range it had already released,
/// and the rest as indices into what it holds.
pub fn split_released(range: Range<usize>, dropped: usize) -> (usize, Range<usize>) {
    let already = range.start.min(dropped)..range.end.min(dropped);
    (
        already.len(),
        range.start.max(dropped) - dropped..range.end.max(dropped) - dropped,
    )
}

/// The position after the newest of a saved payload's `layers`: where its next query
/// sits.
pub fn next_position(layers: &[LayerRows]) -> u64 {
    layers
        .iter()
        .flat_map(|l| l.positions.iter().copied())
        .max()
        .map_or(0, |p| u64::from(p) + 1)
}

/// Drops from a saved layer (rows of `row_bytes` per key and per value) the tokens a
/// layer of `window` no longer keeps for a query at `next`.
pub fn keep_window(layer: &mut LayerRows, window: usize, next: u64, row_bytes: usize) {
    let cut = layer
        .positions
        .iter()
        .take_while(|&&p| outside_window(p, window, next))
        .count();
    layer.positions.drain(..cut);
    layer.rows.drain(..cut * 2 * row_bytes);
}
