//! Weights on the device: uploaded as the file packs them, split by rows where one
//! binding would exceed the device's limit, kept by their stable id (file, offset) when
//! the store's bytes allow ([`crate::weights::WeightBytes::cache_on_device`]) until the file is released
//! ([`crate::backend::Residency::release_file`]); small f32 vectors (norm scales,
//! biases) uploaded once.

use super::*;

/// Weight types with a GPU kernel.
pub(super) fn gpu_supports(ty: GgmlType) -> bool {
    !matches!(ty, GgmlType::Q8_1 | GgmlType::Q8_K)
}

/// A weight on the device: its rows split into chunks that each fit one binding.
pub(crate) struct DeviceWeight {
    pub(super) name: String,
    pub(super) ty: GgmlType,
    pub(super) rows: usize,
    pub(super) cols: usize,
    pub(super) row_bytes: usize,
    pub(super) chunks: Vec<WeightChunk>,
}

pub(super) struct WeightChunk {
    /// A buffer of its own (cached or one-off weights) or a stream slot's buffer, which
    /// may be larger than the chunk.
    pub(super) buffer: Arc<GpuBuffer>,
    pub(super) first_row: usize,
    pub(super) rows: usize,
}

/// A host vector and its device copy.
pub(super) type CachedVector = (Arc<[f32]>, Arc<GpuBuffer>);

impl WgpuBackend {
    /// Drops the device copies of every weight read from file `file`.
    pub(super) fn release_weights_of(&self, file: u64) {
        self.weights
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .retain(|id, _| id.file != file);
    }

    /// The device copy of `w`: uploaded on first use and cached when its bytes allow
    /// ([`WeightBytes::cache_on_device`]), else uploaded for this one use.
    pub(crate) fn weight(&self, w: &Weight) -> Result<Arc<DeviceWeight>> {
        let cache = w.bytes.cache_on_device();
        let key = w.id;
        if cache {
            if let Some(d) = self
                .weights
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .get(&key)
            {
                return Ok(d.clone());
            }
        }
        let d = Arc::new(self.split_weight(w, |piece| {
            Ok(Arc::new(self.ctx.weight_buffer(piece, &w.name)?))
        })?);
        if !cache {
            return Ok(d);
        }
        self.weights
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(key, d.clone());
        Ok(d)
    }

    /// `w`'s geometry (rows, columns, bytes per row), checked: a type with a kernel,
    /// bytes that are whole rows, a row that fits one binding.
    fn checked_geometry(&self, w: &Weight) -> Result<(usize, usize, usize)> {
        if !gpu_supports(w.ty) {
            return Err(Error::GpuUnsupportedType {
                tensor: w.name.clone(),
                ty: w.ty.name().to_string(),
            });
        }
        let (rows, cols, row_bytes) = (w.rows(), w.cols(), w.row_bytes());
        if w.bytes.len() != rows * row_bytes {
            return Err(Error::ShapeMismatch {
                what: format!("bytes of {}", w.name),
                expected: rows * row_bytes,
                got: w.bytes.len(),
            });
        }
        if row_bytes as u64 > self.max_chunk_bytes {
            return Err(Error::GpuLimit {
                what: format!("one row of {}", w.name),
                needed: row_bytes as u64,
                limit: self.max_chunk_bytes,
            });
        }
        Ok((rows, cols, row_bytes))
    }

    /// `w` checked and split by rows into chunks that each fit one binding; `place`
    /// puts each chunk's bytes, in order, in a device buffer.
    pub(super) fn split_weight(
        &self,
        w: &Weight,
        place: impl FnMut(&[u8]) -> Result<Arc<GpuBuffer>>,
    ) -> Result<DeviceWeight> {
        self.split_weight_by(w, place, true)
    }

    /// [`WgpuBackend::split_weight`]; without `split`, one chunk of every row, whose
    /// buffer `place` gives without looking at the bytes (they are not asked for).
    fn split_weight_by(
        &self,
        w: &Weight,
        mut place: impl FnMut(&[u8]) -> Result<Arc<GpuBuffer>>,
        split: bool,
    ) -> Result<DeviceWeight> {
        let (rows, cols, row_bytes) = self.checked_geometry(w)?;
        let bytes: &[u8] = if split { w.bytes.as_slice()? } else { &[] };
        // Split by rows so no chunk exceeds one binding; each chunk starts on a row.
        let rows_per_chunk = if split {
            ((self.max_chunk_bytes as usize) / row_bytes.max(1)).max(1)
        } else {
            rows.max(1)
        };
        let mut chunks = Vec::new();
        let mut first_row = 0;
        while first_row < rows {
            let n = rows_per_chunk.min(rows - first_row);
            let buffer = place(
                bytes
                    .get(first_row * row_bytes..(first_row + n) * row_bytes)
                    .unwrap_or(&[]),
            )?;
            chunks.push(WeightChunk {
                buffer,
                first_row,
                rows: n,
            });
            first_row += n;
        }
        Ok(DeviceWeight {
            name: w.name.clone(),
            ty: w.ty,
            rows,
            cols,
            row_bytes,
            chunks,
        })
    }

    /// `w` checked, whole in `buffer` (its bytes fit one binding; the caller fills the
    /// buffer, a decoder on the device, say).
    pub(super) fn whole_weight(&self, w: &Weight, buffer: Arc<GpuBuffer>) -> Result<DeviceWeight> {
        self.split_weight_by(w, |_| Ok(buffer.clone()), false)
    }

    /// The device copy of a small f32 vector (a norm scale, a bias), uploaded once.
    pub(super) fn vector(&self, v: &Arc<[f32]>) -> Result<Arc<GpuBuffer>> {
        let key = (v.as_ptr() as usize, v.len());
        let mut cache = self.vectors.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((_, b)) = cache.get(&key) {
            return Ok(b.clone());
        }
        let b = Arc::new(self.ctx.weight_buffer(bytemuck::cast_slice(v), "vector")?);
        cache.insert(key, (v.clone(), b.clone()));
        Ok(b)
    }
}
