//! Lossless means bit-identical: any bytes of any tensor type, through every codec and
//! through a pack, decode to exactly the bytes that went in.

use ballast_core::ggml_type::GgmlType;
use ballast_core::gguf::{GgufFile, GgufWriter};
use ballast_weight_codec::codec::{decode_chunk, encode_chunk};
use ballast_weight_codec::{transform, write_pack, Codec, Coder, PackFile, PackOptions, Transform};
use proptest::prelude::*;

fn any_type() -> impl Strategy<Value = GgmlType> {
    proptest::sample::select(GgmlType::ALL.to_vec())
}

fn any_codec() -> impl Strategy<Value = Codec> {
    (
        proptest::sample::select(vec![Transform::None, Transform::Planes]),
        proptest::sample::select(vec![Coder::Raw, Coder::Zstd, Coder::Rans, Coder::RansLanes]),
    )
        .prop_map(|(transform, coder)| Codec { transform, coder })
}

/// Bytes that are sometimes uniform, sometimes heavily skewed (as real quants and
/// scale exponents are), so both the coded and the raw-fallback paths are taken.
fn any_bytes() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        proptest::collection::vec(any::<u8>(), 0..3000),
        proptest::collection::vec(prop_oneof![9 => Just(0x3cu8), 1 => any::<u8>()], 0..3000),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    #[test]
    fn planes_invert_exactly(ty in any_type(), data in any_bytes()) {
        let mut planes = Vec::new();
        transform::split(ty, &data, &mut planes);
        prop_assert_eq!(planes.len(), data.len());
        let mut back = vec![0u8; data.len()];
        transform::join(ty, &planes, &mut back);
        prop_assert_eq!(back, data);
    }

    #[test]
    fn every_codec_round_trips(ty in any_type(), codec in any_codec(), data in any_bytes()) {
        let mut stored = Vec::new();
        encode_chunk(ty, codec, 3, &data, &mut stored);
        let mut back = vec![0u8; data.len()];
        decode_chunk(ty, codec, &stored, &mut back).unwrap();
        prop_assert_eq!(back, data);
    }

    /// A stream decoded into a buffer of the wrong length is an error, not a panic.
    #[test]
    fn wrong_length_is_an_error(ty in any_type(), codec in any_codec(), data in any_bytes(), extra in 1usize..40) {
        let mut stored = Vec::new();
        encode_chunk(ty, codec, 3, &data, &mut stored);
        let mut longer = vec![0u8; data.len() + extra];
        prop_assert!(decode_chunk(ty, codec, &stored, &mut longer).is_err());
    }

    /// Garbage handed to a decoder gives an error or some bytes, never a panic.
    #[test]
    fn garbage_streams_do_not_panic(ty in any_type(), codec in any_codec(), junk in proptest::collection::vec(any::<u8>(), 0..2000), len in 0usize..4000) {
        let mut out = vec![0u8; len];
        let _ = decode_chunk(ty, codec, &junk, &mut out);
    }

    /// A GGUF file of tensors of random types and bytes, packed in small chunks,
    /// decodes to the identical file.
    #[test]
    fn packs_round_trip(
        tensors in proptest::collection::vec((any_type(), 1usize..40, any::<bool>(), any::<u64>()), 1..6),
        chunk in 1usize..2000,
    ) {
        let mut w = GgufWriter::new();
        w.add_metadata("general.architecture", "llama").unwrap();
        for (i, (ty, blocks, skewed, seed)) in tensors.iter().enumerate() {
            let n = blocks * ty.block_len();
            let bytes = ty.bytes_for(n as u64).unwrap() as usize;
            let mut x = *seed | 1;
            let data: Vec<u8> = (0..bytes)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    if *skewed && x % 8 != 0 { 7 } else { x as u8 }
                })
                .collect();
            w.add_tensor(format!("t{i}"), *ty, &[n as u64], data).unwrap();
        }
        let dir = tempfile::tempdir().unwrap();
        let src = dir.path().join("m.gguf");
        w.write_to_file(&src).unwrap();
        let gguf = GgufFile::open(&src, false).unwrap();
        let out = dir.path().join("m.pack");
        let opts = PackOptions { chunk_bytes: chunk, threads: 2, ..PackOptions::default() };
        let reports = write_pack(&gguf, &out, &opts, &mut |_| {}).unwrap();
        prop_assert_eq!(reports.len(), tensors.len());
        let pack = PackFile::open(&out, true).unwrap();
        for (r, t) in reports.iter().zip(pack.tensors()) {
            prop_assert_eq!(r.chosen, t.codec);
            prop_assert_eq!(r.stored_len(), t.stored_len());
        }
        let decoded = pack.to_gguf(2).unwrap();
        prop_assert_eq!(decoded.as_bytes(), gguf.as_bytes());
        // Only a temp file and the pack were ever in the folder: no temp file is left.
        prop_assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 2);
    }
}

/// Skewed f16 data (the exponent byte nearly constant) shrinks more with byte planes
/// than without: the transform exposes what zstd alone does not see.
#[test]
fn byte_planes_help_f16() {
    let mut x = 12345u64;
    let data: Vec<u8> = (0..32768)
        .flat_map(|_| {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let v = half::f16::from_f32(((x >> 33) as f32 / (1u64 << 31) as f32 - 0.5) * 0.1);
            v.to_le_bytes()
        })
        .collect();
    let size = |c: Codec| {
        let mut s = Vec::new();
        encode_chunk(GgmlType::F16, c, 9, &data, &mut s);
        s.len()
    };
    let (plain, planes) = (size(Codec::ZSTD), size(Codec::PLANES_ZSTD));
    assert!(planes < plain, "planes+zstd {planes} bytes, zstd {plain}");
}
