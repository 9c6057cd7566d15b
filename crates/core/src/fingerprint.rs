//! Checksums and model fingerprints for the small files levers keep beside a model
//! (saved sessions, sparsity profiles): a file made for one model is refused by
//! another.

use crate::gguf::GgufFile;

/// A 64-bit checksum: FNV-1a over little-endian 64-bit words (the tail zero-padded),
/// then the length. Catches flipped bits and truncation; not a cryptographic hash.
pub fn checksum(bytes: &[u8]) -> u64 {
    const PRIME: u64 = 0x0000_0100_0000_01b3;
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut words = bytes.chunks_exact(8);
    for w in &mut words {
        h = (h ^ u64::from_le_bytes(w.try_into().expect("8 bytes"))).wrapping_mul(PRIME);
        h ^= h >> 29;
    }
    let mut tail = [0u8; 8];
    tail[..words.remainder().len()].copy_from_slice(words.remainder());
    h = (h ^ u64::from_le_bytes(tail)).wrapping_mul(PRIME);
    (h ^ bytes.len() as u64).wrapping_mul(PRIME)
}

/// A fingerprint of a model file: its tensor table (names, types, shapes, offsets) and
/// the first 4 KiB of every tensor's data. Two different models (or two quantizations
/// of one) differ; reading it costs about a millisecond.
pub fn model_fingerprint(file: &GgufFile) -> u64 {
    let mut buf = Vec::new();
    for t in file.tensors() {
        buf.extend_from_slice(t.name.as_bytes());
        buf.extend_from_slice(t.ty.name().as_bytes());
        for d in &t.dims {
            buf.extend_from_slice(&d.to_le_bytes());
        }
        buf.extend_from_slice(&t.offset.to_le_bytes());
        let data = file.tensor_data(t);
        buf.extend_from_slice(&data[..data.len().min(4096)]);
    }
    checksum(&buf)
}
