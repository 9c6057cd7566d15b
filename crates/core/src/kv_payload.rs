//! The bytes [`KvCache::save`](crate::KvCache::save) writes: per layer the positions
//! and the stored rows of its tokens in cache order. Every cache writes and reads this
//! one layout, whatever it keeps in memory or on a device, so a session saved from one
//! cache (a host update mode, a device cache) loads into any other of the same element
//! type and shape.
//!
//! Layout (little-endian): magic `BLKVROWS`, element tag `u8` ([`KvElement::tag`]),
//! layers / KV heads / head size `u64` each, then per layer the token count `u64`, the
//! positions (`u32` each) and per token its key row then its value row as stored
//! ([`KvElement::row_bytes`]; an int8 row is its quants, then its f16 scales).

use crate::error::{Error, Result};
use crate::kv::{KvElement, KvShape, MASKED_POSITION};

const MAGIC: &[u8; 8] = b"BLKVROWS";

/// One layer of a payload: its tokens' positions and their stored rows.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LayerRows {
    /// Position of each token, in cache order.
    pub positions: Vec<u32>,
    /// Per token, its key row then its value row, as stored.
    pub rows: Vec<u8>,
}

impl LayerRows {
    /// The stored key and value rows of token `i` (rows of `row_bytes` bytes).
    pub fn token(&self, i: usize, row_bytes: usize) -> (&[u8], &[u8]) {
        let at = 2 * row_bytes * i;
        (
            &self.rows[at..at + row_bytes],
            &self.rows[at + row_bytes..at + 2 * row_bytes],
        )
    }
}

/// The payload of a cache of `element` rows and `shape` holding `layers`.
pub fn encode(element: KvElement, shape: KvShape, layers: &[LayerRows]) -> Vec<u8> {
    let size: usize = layers
        .iter()
        .map(|l| 8 + 4 * l.positions.len() + l.rows.len())
        .sum();
    let mut buf = Vec::with_capacity(33 + size);
    buf.extend_from_slice(MAGIC);
    buf.push(element.tag());
    for v in [shape.n_layers, shape.n_kv_heads, shape.head_dim] {
        buf.extend_from_slice(&(v as u64).to_le_bytes());
    }
    for l in layers {
        buf.extend_from_slice(&(l.positions.len() as u64).to_le_bytes());
        for p in &l.positions {
            buf.extend_from_slice(&p.to_le_bytes());
        }
        buf.extend_from_slice(&l.rows);
    }
    buf
}

/// Reads a payload [`encode`] wrote into a cache of `element` rows, `shape` and at most
/// `capacity` tokens per layer; an [`Error::KvFormat`] naming what disagrees (magic,
/// element type, shape, a count past the capacity, a masked position, truncation,
/// trailing bytes) and nothing read otherwise.
pub fn decode(
    bytes: &[u8],
    element: KvElement,
    shape: KvShape,
    capacity: usize,
) -> Result<Vec<LayerRows>> {
    let bad = |why: String| Error::KvFormat { why };
    let mut rest = bytes;
    let mut take = |n: usize, what: &str| -> Result<&[u8]> {
        if rest.len() < n {
            return Err(bad(format!(
                "truncated: {what} needs {n} bytes, {} left",
                rest.len()
            )));
        }
        let (head, tail) = rest.split_at(n);
        rest = tail;
        Ok(head)
    };
    let u64_at = |b: &[u8]| u64::from_le_bytes(b.try_into().expect("8 bytes"));
    if take(8, "magic")? != MAGIC {
        return Err(bad("not a KV cache payload (bad magic)".into()));
    }
    let tag = take(1, "element type")?[0];
    if tag != element.tag() {
        let found = KvElement::from_tag(tag).map_or("unknown", KvElement::name);
        return Err(bad(format!(
            "keys and values are stored as {found}, this cache holds {}",
            element.name()
        )));
    }
    let mut dims = [0u64; 3];
    for d in &mut dims {
        *d = u64_at(take(8, "shape")?);
    }
    let want = [shape.n_layers, shape.n_kv_heads, shape.head_dim].map(|v| v as u64);
    if dims != want {
        return Err(bad(format!(
            "shape (layers, kv heads, head size) {dims:?} differs from this model's {want:?}"
        )));
    }
    let row = element.row_bytes(shape.kv_dim());
    let mut layers = Vec::with_capacity(shape.n_layers);
    for layer in 0..shape.n_layers {
        let n = u64_at(take(8, "token count")?);
        if n > capacity as u64 {
            return Err(bad(format!(
                "layer {layer} holds {n} tokens, more than this cache's capacity {capacity}"
            )));
        }
        let n = n as usize;
        let positions: Vec<u32> = take(4 * n, "positions")?
            .chunks_exact(4)
            .map(|b| u32::from_le_bytes(b.try_into().expect("4 bytes")))
            .collect();
        if positions.contains(&MASKED_POSITION) {
            return Err(bad(format!("layer {layer} holds a masked position")));
        }
        let rows = take(2 * row * n, "rows")?.to_vec();
        layers.push(LayerRows { positions, rows });
    }
    if !rest.is_empty() {
        return Err(bad(format!("{} trailing bytes", rest.len())));
    }
    Ok(layers)
}

/// [`encode`]s `layers` and writes them to `out`: what [`crate::KvCache::save`] does.
pub fn write(
    out: &mut dyn std::io::Write,
    element: KvElement,
    shape: KvShape,
    layers: &[LayerRows],
) -> Result<()> {
    out.write_all(&encode(element, shape, layers))
        .map_err(|source| Error::Io {
            what: "writing a KV cache".into(),
            source,
        })
}

/// Reads all of `input` and [`decode`]s it: what [`crate::KvCache::load`] does before
/// it touches the cache, so a bad payload leaves the cache as it was.
pub fn read(
    input: &mut dyn std::io::Read,
    element: KvElement,
    shape: KvShape,
    capacity: usize,
) -> Result<Vec<LayerRows>> {
    let mut buf = Vec::new();
    input.read_to_end(&mut buf).map_err(|source| Error::Io {
        what: "reading a KV cache".into(),
        source,
    })?;
    decode(&buf, element, shape, capacity)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const SHAPE: KvShape = KvShape {
        n_layers: 2,
        n_kv_heads: 1,
        head_dim: 32,
    };

    fn sample(element: KvElement) -> Vec<LayerRows> {
        let row = element.row_bytes(SHAPE.kv_dim());
        (0..SHAPE.n_layers)
            .map(|l| LayerRows {
                positions: (0..3).map(|p| p + l as u32).collect(),
                rows: (0..2 * row * 3).map(|i| (i * 7 + l) as u8).collect(),
            })
            .collect()
    }

    #[test]
    fn round_trips_and_names_what_disagrees() {
        for element in [KvElement::F32, KvElement::F16, KvElement::Q8] {
            let layers = sample(element);
            let bytes = encode(element, SHAPE, &layers);
            assert_eq!(decode(&bytes, element, SHAPE, 3).unwrap(), layers);
            let small = decode(&bytes, element, SHAPE, 2).unwrap_err().to_string();
            assert!(small.contains("capacity 2"), "{small}");
            let other = KvElement::from_tag((element.tag() + 1) % 3).unwrap();
            let wrong = decode(&bytes, other, SHAPE, 3).unwrap_err().to_string();
            assert!(wrong.contains(element.name()), "{wrong}");
            let shape = KvShape {
                head_dim: 64,
                ..SHAPE
            };
            let err = decode(&bytes, element, shape, 3).unwrap_err().to_string();
            assert!(err.contains("shape"), "{err}");
        }
    }

    proptest! {
        /// Any truncation or trailing byte is an error, never a panic or a short read.
        #[test]
        fn truncated_or_padded_payloads_are_refused(cut in 0usize..700, extra in 1usize..4) {
            let bytes = encode(KvElement::Q8, SHAPE, &sample(KvElement::Q8));
            let cut = cut.min(bytes.len() - 1);
            prop_assert!(decode(&bytes[..cut], KvElement::Q8, SHAPE, 8).is_err());
            let mut longer = bytes.clone();
            longer.extend(std::iter::repeat_n(0u8, extra));
            prop_assert!(decode(&longer, KvElement::Q8, SHAPE, 8).is_err());
        }

        /// Arbitrary bytes are refused or read, never a panic.
        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..200)) {
            let _ = decode(&bytes, KvElement::F16, SHAPE, 8);
        }
    }
}
