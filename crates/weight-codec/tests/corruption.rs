//! A corrupt or truncated pack is refused with an error naming what is wrong (the
//! tensor and chunk, for a chunk), never decoded to other bytes.

use ballast_core::ggml_type::GgmlType;
use ballast_core::gguf::{GgufFile, GgufWriter};
use ballast_weight_codec::{write_pack, Error, PackFile, PackOptions};
use proptest::prelude::*;

/// A pack of three tensors (Q4_1, Q8_0, F32) in small chunks, and the GGUF bytes it
/// decodes to.
fn sample_pack() -> (Vec<u8>, Vec<u8>) {
    let mut w = GgufWriter::new();
    w.add_metadata("general.architecture", "llama").unwrap();
    let mut x = 99u32;
    let mut next = || {
        x = x.wrapping_mul(1103515245).wrapping_add(12345);
        (x >> 16) as u8
    };
    let q41: Vec<u8> = (0..40 * 20)
        .map(|i| if i % 20 < 4 { 0x2c } else { next() & 0x77 })
        .collect();
    w.add_tensor("blk.0.a", GgmlType::Q4_1, &[32 * 40], q41)
        .unwrap();
    let q8: Vec<u8> = (0..30 * 34).map(|_| next() % 9).collect();
    w.add_tensor("blk.0.b", GgmlType::Q8_0, &[32 * 30], q8)
        .unwrap();
    w.add_tensor_f32("c", &[50], &(0..50).map(|i| i as f32).collect::<Vec<_>>())
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("m.gguf");
    w.write_to_file(&src).unwrap();
    let gguf = GgufFile::open(&src, false).unwrap();
    let out = dir.path().join("m.pack");
    let opts = PackOptions {
        chunk_bytes: 200,
        threads: 1,
        ..PackOptions::default()
    };
    write_pack(&gguf, &out, &opts, &mut |_| {}).unwrap();
    (std::fs::read(out).unwrap(), gguf.as_bytes().to_vec())
}

/// Opens `bytes` as a pack and decodes it whole.
fn decode(bytes: Vec<u8>) -> Result<Vec<u8>, Error> {
    let pack = PackFile::from_bytes(bytes)?;
    Ok(pack.to_gguf(1)?.as_bytes().to_vec())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(400))]

    /// Any byte changed anywhere: an error, or (never, with checksums on every part)
    /// the original bytes.
    #[test]
    fn any_flipped_byte_is_detected(at in any::<prop::sample::Index>(), xor in 1u8..=255) {
        let (pack, gguf) = sample_pack();
        let mut bad = pack.clone();
        let i = at.index(bad.len());
        bad[i] ^= xor;
        match decode(bad) {
            Err(_) => {}
            Ok(bytes) => prop_assert!(false, "byte {i} changed, decoded anyway (same bytes: {})", bytes == gguf),
        }
    }

    /// Any truncation is refused as such.
    #[test]
    fn any_truncation_is_refused(cut in any::<prop::sample::Index>()) {
        let (pack, _) = sample_pack();
        let len = cut.index(pack.len());
        let err = decode(pack[..len].to_vec()).unwrap_err();
        prop_assert!(
            matches!(err, Error::Truncated { .. } | Error::NotAPack { .. }),
            "{len} bytes: {err}"
        );
    }
}

#[test]
fn the_intact_pack_decodes_and_a_changed_chunk_names_its_tensor_and_chunk() {
    let (pack, gguf) = sample_pack();
    assert_eq!(decode(pack.clone()).unwrap(), gguf);
    // The last byte of the file is in the last chunk of the last tensor, "c".
    let mut bad = pack;
    let n = bad.len();
    bad[n - 1] ^= 0x40;
    let p = PackFile::from_bytes(bad).unwrap();
    let last = p.tensors().last().unwrap().clone();
    let err = p.to_gguf(1).unwrap_err();
    let chunk = last.chunks.len() - 1;
    assert!(
        matches!(&err, Error::Corrupt { tensor, chunk: c, .. } if tensor == "c" && *c == chunk),
        "{err}"
    );
    assert!(err.to_string().contains("tensor c, chunk"), "{err}");
}

#[test]
fn a_gguf_file_is_not_a_pack() {
    let (_, gguf) = sample_pack();
    assert!(matches!(decode(gguf), Err(Error::NotAPack { .. })));
}

// Chunks read from the file (`read_chunks_from_disk`, as tiered streaming does) decode to
// the same bytes as through the map, and a chunk corrupted on disk after the pack was
// opened is still caught by its checksum, naming tensor and chunk.
#[test]
fn chunks_read_from_disk_decode_alike_and_are_checked() {
    let (pack_bytes, gguf) = sample_pack();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.pack");
    std::fs::write(&path, &pack_bytes).unwrap();
    let pack = PackFile::open(&path, true).unwrap();
    pack.read_chunks_from_disk().unwrap();
    assert_eq!(pack.to_gguf(1).unwrap().as_bytes(), &gguf[..]);
    // Flip a byte of the first chunk of "blk.0.b" in the file itself.
    let tensor = pack.tensor("blk.0.b").unwrap().clone();
    let first = &tensor.chunks[0];
    let stored_at = data_offset(&pack_bytes, pack.stored(first));
    let mut bad = pack_bytes.clone();
    bad[stored_at] ^= 0x5a;
    std::fs::write(&path, &bad).unwrap();
    let mut out = vec![0u8; first.raw_len as usize];
    let err = pack
        .decode_chunk(&tensor, 0, &mut out)
        .unwrap_err()
        .to_string();
    assert!(err.contains("blk.0.b") && err.contains("chunk 0"), "{err}");
}

/// Where `stored` (a slice of the pack's bytes as opened) starts in `pack`.
fn data_offset(pack: &[u8], stored: &[u8]) -> usize {
    pack.windows(stored.len())
        .position(|w| w == stored)
        .expect("the chunk's bytes are in the pack")
}
