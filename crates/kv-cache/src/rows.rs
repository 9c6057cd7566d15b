//! The slot storage every update mode is built on: one layer's keys
//! or values as fixed-size rows ("slots") in f32, f16 or int8.

use std::ops::Range;

use ballast_core::{KvElement, KvRows, Q8_BLOCK};
use half::f16;
use half::slice::HalfFloatSliceExt;

/// Quantizes one block as ggml's `quantize_row_q8_0`: scale `amax / 127` (stored as
/// f16), quants `round(x * 127 / amax)`.
fn quantize_block(x: &[f32], q: &mut [i8]) -> f16 {
    let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
    let d = amax / 127.0;
    let id = if d == 0.0 { 0.0 } else { 1.0 / d };
    for (o, v) in q.iter_mut().zip(x) {
        *o = (v * id).round() as i8;
    }
    f16::from_f32(d)
}

#[derive(Clone, Debug)]
enum Data {
    F32(Vec<f32>),
    F16(Vec<f16>),
    Q8 { quants: Vec<i8>, scales: Vec<f16> },
}

/// Rows of `dim` elements in one precision. Slots are allocated on first use and
/// never freed while the cache lives (so a bounded cache stops growing once full).
#[derive(Clone, Debug)]
pub(crate) struct Rows {
    dim: usize,
    slots: usize,
    data: Data,
}

impl Rows {
    pub(crate) fn new(precision: KvElement, dim: usize) -> Rows {
        let data = match precision {
            KvElement::F32 => Data::F32(Vec::new()),
            KvElement::F16 => Data::F16(Vec::new()),
            KvElement::Q8 => Data::Q8 {
                quants: Vec::new(),
                scales: Vec::new(),
            },
        };
        Rows {
            dim,
            slots: 0,
            data,
        }
    }

    fn scales_per_row(&self) -> usize {
        self.dim.div_ceil(Q8_BLOCK)
    }

    /// Slots allocated.
    pub(crate) fn slots(&self) -> usize {
        self.slots
    }

    /// Makes slots `0..n` exist.
    pub(crate) fn ensure(&mut self, n: usize) {
        if n <= self.slots {
            return;
        }
        let (dim, spr) = (self.dim, self.scales_per_row());
        match &mut self.data {
            Data::F32(v) => v.resize(n * dim, 0.0),
            Data::F16(v) => v.resize(n * dim, f16::ZERO),
            Data::Q8 { quants, scales } => {
                quants.resize(n * dim, 0);
                scales.resize(n * spr, f16::ZERO);
            }
        }
        self.slots = n;
    }

    /// Writes `src` (whole rows) into the slots from `slot` on, rounding to the storage type.
    pub(crate) fn write(&mut self, slot: usize, src: &[f32]) {
        let (dim, spr) = (self.dim, self.scales_per_row());
        let n = src.len() / dim;
        debug_assert!(slot + n <= self.slots);
        match &mut self.data {
            Data::F32(v) => v[slot * dim..(slot + n) * dim].copy_from_slice(src),
            Data::F16(v) => v[slot * dim..(slot + n) * dim].convert_from_f32_slice(src),
            Data::Q8 { quants, scales } => {
                for r in 0..n {
                    let row = &src[r * dim..(r + 1) * dim];
                    let q = &mut quants[(slot + r) * dim..(slot + r + 1) * dim];
                    let s = &mut scales[(slot + r) * spr..(slot + r + 1) * spr];
                    for ((x, q), s) in row.chunks(Q8_BLOCK).zip(q.chunks_mut(Q8_BLOCK)).zip(s) {
                        *s = quantize_block(x, q);
                    }
                }
            }
        }
    }

    /// Copies the slots `src` to the slots starting at `dst` (they may overlap).
    pub(crate) fn copy_within(&mut self, src: Range<usize>, dst: usize) {
        let (dim, spr) = (self.dim, self.scales_per_row());
        let scaled = |r: &Range<usize>, k: usize| r.start * k..r.end * k;
        match &mut self.data {
            Data::F32(v) => v.copy_within(scaled(&src, dim), dst * dim),
            Data::F16(v) => v.copy_within(scaled(&src, dim), dst * dim),
            Data::Q8 { quants, scales } => {
                quants.copy_within(scaled(&src, dim), dst * dim);
                scales.copy_within(scaled(&src, spr), dst * spr);
            }
        }
    }

    /// The slots `range` as the attention kernel reads them.
    pub(crate) fn view(&self, range: Range<usize>) -> KvRows<'_> {
        let (dim, spr) = (self.dim, self.scales_per_row());
        match &self.data {
            Data::F32(v) => KvRows::F32(&v[range.start * dim..range.end * dim]),
            Data::F16(v) => KvRows::F16(&v[range.start * dim..range.end * dim]),
            Data::Q8 { quants, scales } => KvRows::Q8 {
                quants: &quants[range.start * dim..range.end * dim],
                scales: &scales[range.start * spr..range.end * spr],
            },
        }
    }

    /// Appends the stored bytes of `slot` to `out` (elements, then scales for int8).
    pub(crate) fn raw_row(&self, slot: usize, out: &mut Vec<u8>) {
        let (dim, spr) = (self.dim, self.scales_per_row());
        match &self.data {
            Data::F32(v) => out.extend_from_slice(bytemuck::cast_slice(&v[slot * dim..][..dim])),
            Data::F16(v) => out.extend_from_slice(bytemuck::cast_slice(&v[slot * dim..][..dim])),
            Data::Q8 { quants, scales } => {
                out.extend_from_slice(bytemuck::cast_slice(&quants[slot * dim..][..dim]));
                out.extend_from_slice(bytemuck::cast_slice(&scales[slot * spr..][..spr]));
            }
        }
    }

    /// Sets `slot` from bytes [`Rows::raw_row`] wrote (`bytes.len()` is one row's).
    pub(crate) fn set_raw_row(&mut self, slot: usize, bytes: &[u8]) {
        let (dim, spr) = (self.dim, self.scales_per_row());
        match &mut self.data {
            Data::F32(v) => bytemuck::cast_slice_mut::<f32, u8>(&mut v[slot * dim..][..dim])
                .copy_from_slice(bytes),
            Data::F16(v) => bytemuck::cast_slice_mut::<f16, u8>(&mut v[slot * dim..][..dim])
                .copy_from_slice(bytes),
            Data::Q8 { quants, scales } => {
                let (q, s) = bytes.split_at(dim);
                bytemuck::cast_slice_mut::<i8, u8>(&mut quants[slot * dim..][..dim])
                    .copy_from_slice(q);
                bytemuck::cast_slice_mut::<f16, u8>(&mut scales[slot * spr..][..spr])
                    .copy_from_slice(s);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// int8 rows come back within half a quantization step of each block's scale.
    #[test]
    fn q8_error_is_within_half_a_step() {
        let dim = 64;
        let mut rows = Rows::new(KvElement::Q8, dim);
        rows.ensure(2);
        let x: Vec<f32> = (0..2 * dim)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.03)
            .collect();
        rows.write(0, &x);
        let mut back = vec![0f32; 2 * dim];
        rows.view(0..2).read_f32(0, &mut back);
        for (b, (xs, ys)) in x.chunks(32).zip(back.chunks(32)).enumerate() {
            let amax = xs.iter().fold(0f32, |m, v| m.max(v.abs()));
            for (a, y) in xs.iter().zip(ys) {
                assert!(
                    (a - y).abs() <= amax / 127.0 * 0.5 + amax * 1e-3,
                    "block {b}"
                );
            }
        }
        assert_eq!(KvElement::Q8.row_bytes(dim), 68);
    }
}
