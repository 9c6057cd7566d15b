//! Transforms that expose the structure of a tensor type to an entropy coder, by
//! moving bytes that follow the same distribution next to each other.
//!
//! A quantized block interleaves fields of different kinds (an f16 scale, an f16 min,
//! packed 4-bit quants, K-quant sub-block scales). [`split`] rewrites a run of whole
//! blocks as planes: for each field, all blocks' copies of it; a field of multi-byte
//! scalars (f16 scales, f32 values) is further split into one plane per byte, since the
//! high byte of an f16 (sign and exponent) is nearly constant across a tensor while the
//! low byte is nearly uniform. Plain f32/f16/bf16 tensors become byte planes (as ZipNN
//! does). Bytes after the last whole block are kept as they are, at the end. [`join`]
//! inverts [`split`] exactly, for any input length.

use ballast_core::ggml_type::GgmlType;
use ballast_core::weights::Plane;

/// One field of a block: `len` bytes at `offset`, made of scalars of `width` bytes.
#[derive(Clone, Copy, Debug)]
struct Field {
    offset: usize,
    len: usize,
    width: usize,
}

/// A [`Field`] literal (a literal, so that the tables below are promoted to statics).
macro_rules! f {
    ($offset:expr, $len:expr, $width:expr) => {
        Field {
            offset: $offset,
            len: $len,
            width: $width,
        }
    };
}

/// The fields of one block of `ty`, in block order (llama.cpp's `block_*` structs).
fn fields(ty: GgmlType) -> &'static [Field] {
    match ty {
        GgmlType::F32 => &[f!(0, 4, 4)],
        GgmlType::F16 | GgmlType::BF16 => &[f!(0, 2, 2)],
        // d, qs
        GgmlType::Q4_0 => &[f!(0, 2, 2), f!(2, 16, 1)],
        // d, m, qs
        GgmlType::Q4_1 => &[f!(0, 2, 2), f!(2, 2, 2), f!(4, 16, 1)],
        // d, qh, qs
        GgmlType::Q5_0 => &[f!(0, 2, 2), f!(2, 4, 1), f!(6, 16, 1)],
        // d, m, qh, qs
        GgmlType::Q5_1 => &[f!(0, 2, 2), f!(2, 2, 2), f!(4, 4, 1), f!(8, 16, 1)],
        // d, qs
        GgmlType::Q8_0 => &[f!(0, 2, 2), f!(2, 32, 1)],
        // d, s, qs
        GgmlType::Q8_1 => &[f!(0, 2, 2), f!(2, 2, 2), f!(4, 32, 1)],
        // d, dmin, scales (6-bit packed), qs
        GgmlType::Q4_K => &[f!(0, 2, 2), f!(2, 2, 2), f!(4, 12, 1), f!(16, 128, 1)],
        // d, dmin, scales, qh, qs
        GgmlType::Q5_K => &[
            f!(0, 2, 2),
            f!(2, 2, 2),
            f!(4, 12, 1),
            f!(16, 32, 1),
            f!(48, 128, 1),
        ],
        // ql, qh, scales (i8), d
        GgmlType::Q6_K => &[f!(0, 128, 1), f!(128, 64, 1), f!(192, 16, 1), f!(208, 2, 2)],
        // d (f32), qs, bsums (i16)
        GgmlType::Q8_K => &[f!(0, 4, 4), f!(4, 256, 1), f!(260, 32, 2)],
    }
}

/// The planes of `ty`'s block as (name, bytes per block), in the order [`split`] writes
/// them: what `ballast inspect` and the measurements name.
pub fn plane_names(ty: GgmlType) -> Vec<(String, usize)> {
    let names: &[&str] = match ty {
        GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => &["value"],
        GgmlType::Q4_0 | GgmlType::Q8_0 => &["d", "qs"],
        GgmlType::Q4_1 | GgmlType::Q8_1 => &["d", "m", "qs"],
        GgmlType::Q5_0 => &["d", "qh", "qs"],
        GgmlType::Q5_1 => &["d", "m", "qh", "qs"],
        GgmlType::Q4_K => &["d", "dmin", "scales", "qs"],
        GgmlType::Q5_K => &["d", "dmin", "scales", "qh", "qs"],
        GgmlType::Q6_K => &["ql", "qh", "scales", "d"],
        GgmlType::Q8_K => &["d", "qs", "bsums"],
    };
    let mut out = Vec::new();
    for (field, name) in fields(ty).iter().zip(names) {
        for k in 0..field.width {
            let n = if field.width > 1 {
                format!("{name}.b{k}")
            } else {
                (*name).to_string()
            };
            out.push((n, field.len / field.width));
        }
    }
    out
}

/// The planes [`split`] writes for `ty`, in order, as a device decoder places their
/// bytes back into blocks (see [`Plane`]).
pub fn planes(ty: GgmlType) -> Vec<Plane> {
    let mut out = Vec::new();
    for f in fields(ty) {
        for byte in 0..f.width {
            out.push(Plane {
                offset: f.offset as u32,
                per_block: (f.len / f.width) as u32,
                stride: f.width as u32,
                byte: byte as u32,
            });
        }
    }
    out
}

/// The lengths of the planes [`split`] writes for `len` bytes of `ty`, in order, then
/// of the bytes after the last whole block.
pub fn plane_lengths(ty: GgmlType, len: usize) -> Vec<usize> {
    let n_blocks = len / ty.block_bytes();
    let mut out: Vec<usize> = planes(ty)
        .iter()
        .map(|p| p.per_block as usize * n_blocks)
        .collect();
    out.push(len - n_blocks * ty.block_bytes());
    out
}

/// Appends `data` rewritten as planes to `out` (`data.len()` bytes).
pub fn split(ty: GgmlType, data: &[u8], out: &mut Vec<u8>) {
    let bb = ty.block_bytes();
    let n_blocks = data.len() / bb;
    let body = &data[..n_blocks * bb];
    out.reserve(data.len());
    for field in fields(ty) {
        if field.width == 1 {
            for block in body.chunks_exact(bb) {
                out.extend_from_slice(&block[field.offset..field.offset + field.len]);
            }
            continue;
        }
        for k in 0..field.width {
            for block in body.chunks_exact(bb) {
                let f = &block[field.offset..field.offset + field.len];
                out.extend(f.iter().skip(k).step_by(field.width));
            }
        }
    }
    out.extend_from_slice(&data[n_blocks * bb..]);
}

/// Writes the bytes whose planes are `planes` into `out` (the inverse of [`split`];
/// `out.len() == planes.len()`).
///
/// # Panics
///
/// If the lengths differ: callers size `out` from the same record as `planes`.
pub fn join(ty: GgmlType, planes: &[u8], out: &mut [u8]) {
    assert_eq!(
        planes.len(),
        out.len(),
        "join: plane and output lengths differ"
    );
    let bb = ty.block_bytes();
    let n_blocks = out.len() / bb;
    let mut at = 0;
    for field in fields(ty) {
        if field.width == 1 {
            let src = &planes[at..at + n_blocks * field.len];
            for (block, s) in out
                .chunks_exact_mut(bb)
                .zip(src.chunks_exact(field.len.max(1)))
            {
                block[field.offset..field.offset + field.len].copy_from_slice(s);
            }
            at += n_blocks * field.len;
            continue;
        }
        let per = field.len / field.width;
        for k in 0..field.width {
            let src = &planes[at..at + n_blocks * per];
            for (block, s) in out.chunks_exact_mut(bb).zip(src.chunks_exact(per.max(1))) {
                let f = &mut block[field.offset..field.offset + field.len];
                for (j, &b) in s.iter().enumerate() {
                    f[j * field.width + k] = b;
                }
            }
            at += n_blocks * per;
        }
    }
    out[n_blocks * bb..].copy_from_slice(&planes[at..]);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fields_cover_each_block_exactly_once() {
        for ty in GgmlType::ALL {
            let mut seen = vec![0u8; ty.block_bytes()];
            for fl in fields(ty) {
                assert_eq!(fl.len % fl.width, 0, "{ty}");
                for b in &mut seen[fl.offset..fl.offset + fl.len] {
                    *b += 1;
                }
            }
            assert!(seen.iter().all(|&c| c == 1), "{ty}: {seen:?}");
            let plane_bytes: usize = plane_names(ty).iter().map(|(_, n)| n).sum();
            assert_eq!(plane_bytes, ty.block_bytes(), "{ty}");
        }
    }

    /// The plane table a device decoder reads puts every byte of [`split`]'s output
    /// back where [`join`] does.
    #[test]
    fn plane_table_places_bytes_as_join_does() {
        for ty in GgmlType::ALL {
            let bb = ty.block_bytes();
            let data: Vec<u8> = (0..3 * bb + bb / 2).map(|i| (i * 31 % 251) as u8).collect();
            let mut split_bytes = Vec::new();
            split(ty, &data, &mut split_bytes);
            let n_blocks = data.len() / bb;
            let mut placed = vec![0u8; data.len()];
            let mut i = 0;
            for pl in planes(ty) {
                for b in 0..n_blocks {
                    for k in 0..pl.per_block as usize {
                        let at = b * bb + pl.offset as usize + k * pl.stride as usize;
                        placed[at + pl.byte as usize] = split_bytes[i];
                        i += 1;
                    }
                }
            }
            placed[i..].copy_from_slice(&split_bytes[i..]);
            assert_eq!(placed, data, "{ty}");
        }
    }

    #[test]
    fn q4_1_planes_put_scale_bytes_together() {
        // Two blocks: d = [1,2] / [3,4], m = [5,6] / [7,8], quants 10.. / 30..
        let mut data = vec![1, 2, 5, 6];
        data.extend(10..26);
        data.extend([3, 4, 7, 8]);
        data.extend(30..46);
        let mut planes = Vec::new();
        split(GgmlType::Q4_1, &data, &mut planes);
        assert_eq!(&planes[..8], &[1, 3, 2, 4, 5, 7, 6, 8]);
        assert_eq!(&planes[8..24], &(10..26).collect::<Vec<u8>>()[..]);
        let mut back = vec![0; data.len()];
        join(GgmlType::Q4_1, &planes, &mut back);
        assert_eq!(back, data);
    }
}
