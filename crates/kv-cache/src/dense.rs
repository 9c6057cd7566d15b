//! [`DenseKv`]: the plain reference cache, one growing buffer per layer, that only
//! evicts when asked.

use std::io::{Read, Write};

use ballast_core::kv::{KvCache, KvElement, KvSegment, KvShape, KvView};
use ballast_core::kv_payload::{self, LayerRows};
use ballast_core::store::TierBytes;
use ballast_core::{Error, KvRows, Result};
use half::f16;
use half::slice::HalfFloatSliceExt;

/// One layer's keys or values in their stored type.
#[derive(Clone, Debug)]
enum Rows {
    F32(Vec<f32>),
    F16(Vec<f16>),
}

impl Rows {
    /// Rows of `element`: f32, else f16 (the only other one [`DenseKv`] accepts).
    fn new(element: KvElement) -> Rows {
        match element {
            KvElement::F32 => Rows::F32(Vec::new()),
            _ => Rows::F16(Vec::new()),
        }
    }

    fn len(&self) -> usize {
        match self {
            Rows::F32(v) => v.len(),
            Rows::F16(v) => v.len(),
        }
    }

    fn view(&self) -> KvRows<'_> {
        match self {
            Rows::F32(v) => KvRows::F32(v),
            Rows::F16(v) => KvRows::F16(v),
        }
    }

    fn push(&mut self, x: &[f32]) {
        match self {
            Rows::F32(v) => v.extend_from_slice(x),
            Rows::F16(v) => {
                let start = v.len();
                v.resize(start + x.len(), f16::ZERO);
                v[start..].convert_from_f32_slice(x);
            }
        }
    }

    fn truncate(&mut self, n: usize) {
        match self {
            Rows::F32(v) => v.truncate(n),
            Rows::F16(v) => v.truncate(n),
        }
    }

    fn drain(&mut self, range: std::ops::Range<usize>) {
        match self {
            Rows::F32(v) => drop(v.drain(range)),
            Rows::F16(v) => drop(v.drain(range)),
        }
    }

    fn bytes(&self) -> &[u8] {
        match self {
            Rows::F32(v) => bytemuck::cast_slice(v),
            Rows::F16(v) => bytemuck::cast_slice(v),
        }
    }

    fn from_bytes(element: KvElement, b: &[u8]) -> Rows {
        match element {
            KvElement::F32 => Rows::F32(bytemuck::pod_collect_to_vec(b)),
            _ => Rows::F16(bytemuck::pod_collect_to_vec(b)),
        }
    }
}

/// The reference cache: one growing buffer per layer (f16 by default, as llama.cpp),
/// nothing evicted unless asked.
#[derive(Clone, Debug)]
pub struct DenseKv {
    shape: KvShape,
    capacity: usize,
    element: KvElement,
    keys: Vec<Rows>,
    values: Vec<Rows>,
    positions: Vec<Vec<u32>>,
    moved: u64,
}

impl DenseKv {
    /// An empty f16 cache of `shape` holding at most `capacity` tokens. Memory grows
    /// with use; nothing is reserved up front.
    pub fn new(shape: KvShape, capacity: usize) -> DenseKv {
        DenseKv::empty(shape, capacity, KvElement::F16)
    }

    /// An empty cache storing keys and values as `element`: f32 or f16 (int8 rows are
    /// `ballast-kv-cache`'s, whose caches quantize them).
    pub fn with_element(shape: KvShape, capacity: usize, element: KvElement) -> Result<DenseKv> {
        if element == KvElement::Q8 {
            return Err(Error::InvalidArgument {
                what: "DenseKv keeps f32 or f16 rows; q8 rows need a ballast-kv-cache cache".into(),
            });
        }
        Ok(DenseKv::empty(shape, capacity, element))
    }

    fn empty(shape: KvShape, capacity: usize, element: KvElement) -> DenseKv {
        DenseKv {
            shape,
            capacity,
            element,
            keys: vec![Rows::new(element); shape.n_layers],
            values: vec![Rows::new(element); shape.n_layers],
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

    fn element(&self) -> KvElement {
        self.element
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
        self.keys[layer].push(keys);
        self.values[layer].push(values);
        self.positions[layer].extend_from_slice(positions);
        self.moved += 2 * self.element.row_bytes(keys.len()) as u64;
        Ok(())
    }

    fn view(&self, layer: usize) -> KvView<'_> {
        if layer >= self.shape.n_layers {
            return KvView::default();
        }
        KvView {
            segments: vec![KvSegment {
                keys: self.keys[layer].view(),
                values: self.values[layer].view(),
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
            self.moved += 2 * self.element.row_bytes((len - end) * dim) as u64;
        }
    }

    fn held_bytes(&self) -> TierBytes {
        let elements: usize = self.keys.iter().chain(&self.values).map(Rows::len).sum();
        let positions: usize = self.positions.iter().map(Vec::len).sum();
        TierBytes {
            device: (self.element.row_bytes(elements) + positions * 4) as u64,
            ..TierBytes::default()
        }
    }

    fn moved_bytes(&self) -> u64 {
        self.moved
    }

    fn save(&self, out: &mut dyn Write) -> Result<()> {
        let layers: Vec<LayerRows> = (0..self.shape.n_layers)
            .map(|l| {
                let row = self.element.row_bytes(self.shape.kv_dim());
                let (k, v) = (self.keys[l].bytes(), self.values[l].bytes());
                let mut rows = Vec::with_capacity(k.len() + v.len());
                for (kr, vr) in k.chunks_exact(row.max(1)).zip(v.chunks_exact(row.max(1))) {
                    rows.extend_from_slice(kr);
                    rows.extend_from_slice(vr);
                }
                LayerRows {
                    positions: self.positions[l].clone(),
                    rows,
                }
            })
            .collect();
        kv_payload::write(out, self.element(), self.shape, &layers)
    }

    fn load(&mut self, input: &mut dyn Read) -> Result<()> {
        let layers = kv_payload::read(input, self.element(), self.shape, self.capacity)?;
        let row = self.element.row_bytes(self.shape.kv_dim());
        let mut loaded = DenseKv::empty(self.shape, self.capacity, self.element);
        for (l, layer) in layers.into_iter().enumerate() {
            let n = layer.positions.len();
            let (mut k, mut v) = (Vec::with_capacity(n * row), Vec::with_capacity(n * row));
            for i in 0..n {
                let (kr, vr) = layer.token(i, row);
                k.extend_from_slice(kr);
                v.extend_from_slice(vr);
            }
            loaded.keys[l] = Rows::from_bytes(self.element, &k);
            loaded.values[l] = Rows::from_bytes(self.element, &v);
            loaded.positions[l] = layer.positions;
        }
        loaded.moved = self.moved;
        *self = loaded;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SHAPE: KvShape = KvShape {
        n_layers: 2,
        n_kv_heads: 1,
        head_dim: 4,
    };

    fn filled(element: KvElement) -> DenseKv {
        let mut kv = DenseKv::with_element(SHAPE, 8, element).unwrap();
        let k: Vec<f32> = (0..12).map(|i| i as f32 * 0.1 + 1.0 / 3.0).collect();
        let v: Vec<f32> = k.iter().map(|x| -x).collect();
        for l in 0..2 {
            kv.append(l, &[0, 1, 2], &k, &v).unwrap();
        }
        kv
    }

    fn first_key(kv: &DenseKv) -> f32 {
        let mut x = [0f32];
        kv.view(0).segments[0].keys.read_f32(0, &mut x);
        x[0]
    }

    #[test]
    fn q8_is_refused_by_name() {
        let err = DenseKv::with_element(SHAPE, 8, KvElement::Q8).unwrap_err();
        assert!(err.to_string().contains("q8"), "{err}");
    }

    #[test]
    fn f16_rounds_and_halves_the_bytes() {
        let (a, b) = (filled(KvElement::F32), filled(KvElement::F16));
        assert_eq!(first_key(&a), 1.0 / 3.0);
        assert_eq!(first_key(&b), f16::from_f32(1.0 / 3.0).to_f32());
        let positions = 2 * 3 * 4;
        assert_eq!(
            a.held_bytes().device - positions,
            2 * (b.held_bytes().device - positions)
        );
    }

    #[test]
    fn save_load_round_trips_and_rejects_mismatches() {
        for element in [KvElement::F32, KvElement::F16] {
            let kv = filled(element);
            let mut bytes = Vec::new();
            kv.save(&mut bytes).unwrap();
            let mut back = DenseKv::with_element(SHAPE, 8, element).unwrap();
            back.load(&mut bytes.as_slice()).unwrap();
            assert_eq!(back.len(), 3);
            assert_eq!(first_key(&back), first_key(&kv));

            // Another element type, or a truncated file: a typed error, cache untouched.
            let other = if element == KvElement::F16 {
                KvElement::F32
            } else {
                KvElement::F16
            };
            let mut wrong = filled(other);
            let err = wrong.load(&mut bytes.as_slice()).unwrap_err();
            assert!(matches!(err, Error::KvFormat { .. }), "{err}");
            assert_eq!(wrong.len(), 3);
            let err = back.load(&mut &bytes[..bytes.len() - 1]).unwrap_err();
            assert!(matches!(err, Error::KvFormat { .. }), "{err}");
            assert_eq!(first_key(&back), first_key(&kv));
        }
    }
}
