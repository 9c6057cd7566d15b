//! The neuron file: write/read round trip (proptest), any single flipped byte refused,
//! and every malformed-file class refused with an error naming the file (and the layer
//! and neuron of a damaged record).

use std::path::Path;

use ballast_runtime::ggml_type::GgmlType;
use ballast_runtime::neurons::NeuronLayout;
use ballast_sparse_mlp::{
    Error, NeuronFile, NeuronFileHeader, NeuronFileWriter, NeuronSource, HEADER_BYTES,
};
use proptest::prelude::*;

fn header(n_layers: usize, n_ff: usize, n_embd: usize, up_type: GgmlType) -> NeuronFileHeader {
    NeuronFileHeader {
        fingerprint: 0x1234_5678_9abc_def0,
        n_layers,
        n_ff,
        layout: NeuronLayout {
            n_embd,
            up_type,
            down_type: GgmlType::Q8_0,
        },
    }
}

/// Writes a file of `h` whose records are seeded bytes; returns the records per layer.
fn write(path: &Path, h: &NeuronFileHeader, seed: u64) -> Vec<Vec<u8>> {
    let mut w = NeuronFileWriter::create(path, *h).unwrap();
    let rb = h.layout.record_bytes();
    let mut s = seed | 1;
    let layers: Vec<Vec<u8>> = (0..h.n_layers)
        .map(|_| {
            (0..h.n_ff * rb)
                .map(|_| {
                    s ^= s << 13;
                    s ^= s >> 7;
                    s ^= s << 17;
                    s as u8
                })
                .collect()
        })
        .collect();
    for l in &layers {
        w.write_layer(l).unwrap();
    }
    w.finish().unwrap();
    layers
}

fn open(path: &Path, h: &NeuronFileHeader) -> ballast_sparse_mlp::Result<NeuronFile> {
    NeuronFile::open(
        path,
        h.fingerprint,
        h.n_layers,
        h.n_ff,
        h.layout.n_embd,
        h.layout.up_type,
    )
}

/// Reads every record of every layer.
fn read_all(f: &NeuronFile) -> ballast_sparse_mlp::Result<Vec<Vec<u8>>> {
    (0..f.n_layers())
        .map(|l| {
            let mut out = Vec::new();
            let all: Vec<u32> = (0..f.n_ff() as u32).collect();
            f.read(l, &all, &mut out)?;
            Ok(out)
        })
        .collect()
}

const UP: [GgmlType; 3] = [GgmlType::Q4_1, GgmlType::Q8_0, GgmlType::F32];

proptest! {
    #![proptest_config(ProptestConfig::with_cases(32))]

    /// Any subset of neurons reads back exactly as written, in one read per run of
    /// adjacent neurons (bytes read = records asked + their checksums).
    #[test]
    fn round_trip(n_layers in 1usize..4, n_ff in 1usize..24, wide in any::<bool>(), up in 0..UP.len(),
                  picks in proptest::collection::vec(any::<bool>(), 24), seed in any::<u64>()) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m.gguf.neurons");
        let h = header(n_layers, n_ff, if wide { 64 } else { 32 }, UP[up]);
        let layers = write(&path, &h, seed);
        prop_assert!(!dir.path().join("m.gguf.neurons.tmp").exists());
        let f = open(&path, &h).unwrap();
        prop_assert_eq!(f.header(), &h);
        prop_assert_eq!(read_all(&f).unwrap(), layers.clone());
        let rb = h.layout.record_bytes();
        let chosen: Vec<u32> = (0..n_ff as u32).filter(|&j| picks[j as usize]).collect();
        for (l, records) in layers.iter().enumerate() {
            let mut out = Vec::new();
            let read = f.read(l, &chosen, &mut out).unwrap();
            prop_assert_eq!(read as usize, chosen.len() * (rb + 4));
            let want: Vec<u8> = chosen.iter().flat_map(|&j| records[j as usize * rb..][..rb].to_vec()).collect();
            prop_assert_eq!(out, want);
        }
    }

    /// Any single flipped byte is refused: in the header when opening, in a record or
    /// its checksum when reading that record, naming its layer and neuron.
    #[test]
    fn any_flipped_byte_is_refused(at in any::<prop::sample::Index>(), bit in 0u8..8, seed in any::<u64>()) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m.gguf.neurons");
        let h = header(2, 5, 32, GgmlType::Q4_1);
        write(&path, &h, seed);
        let mut bytes = std::fs::read(&path).unwrap();
        let i = at.index(bytes.len());
        bytes[i] ^= 1 << bit;
        std::fs::write(&path, &bytes).unwrap();
        match open(&path, &h) {
            Err(e) => prop_assert!(i < HEADER_BYTES, "byte {} refused at open: {}", i, e),
            Ok(f) => {
                prop_assert!(i >= HEADER_BYTES);
                let stride = h.stride();
                let (layer, neuron) = ((i - HEADER_BYTES) / stride / 5, (i - HEADER_BYTES) / stride % 5);
                match read_all(&f) {
                    Err(Error::DamagedRecord { layer: l, neuron: n, path: p }) => {
                        prop_assert_eq!((l, n), (layer, neuron));
                        prop_assert_eq!(p, path.clone());
                    }
                    other => prop_assert!(false, "byte {} gave {:?}", i, other.map(|_| ())),
                }
            }
        }
    }
}

#[test]
fn malformed_files_are_refused_with_a_reason() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.gguf.neurons");
    let h = header(2, 4, 32, GgmlType::Q4_1);
    write(&path, &h, 7);
    let bytes = std::fs::read(&path).unwrap();
    let refused = |bytes: &[u8], h: &NeuronFileHeader, why: &str| {
        std::fs::write(&path, bytes).unwrap();
        let e = open(&path, h).err().expect("refused").to_string();
        assert!(e.contains(why) && e.contains("m.gguf.neurons"), "{e}");
    };
    refused(&bytes[..bytes.len() - 1], &h, "truncated");
    refused(
        &[bytes.clone(), vec![0]].concat(),
        &h,
        "truncated or extended",
    );
    refused(&bytes[..20], &h, "shorter than the");
    refused(&[], &h, "shorter than the");
    refused(
        b"GGUF and something else, long enough to be a header......",
        &h,
        "not a neuron file",
    );
    let other_model = NeuronFileHeader {
        fingerprint: 1,
        ..h
    };
    refused(&bytes, &other_model, "another model");
    refused(&bytes, &header(2, 4, 32, GgmlType::Q8_0), "Q4_1 up rows");
    refused(&bytes, &header(2, 4, 64, GgmlType::Q4_1), "width 32");
    refused(&bytes, &header(3, 4, 32, GgmlType::Q4_1), "2 layers");
    // A version from the future, its header checksum made right.
    let mut v2 = bytes.clone();
    v2[8] = 2;
    let crc = crc32(&v2[..44]);
    v2[44..48].copy_from_slice(&crc.to_le_bytes());
    refused(&v2, &h, "version 2");
    // An unfinished file (no finish) leaves nothing at the path.
    let other = dir.path().join("x.neurons");
    let mut w = NeuronFileWriter::create(&other, h).unwrap();
    w.write_layer(&vec![0; 4 * h.layout.record_bytes()])
        .unwrap();
    assert!(w.write_layer(&[0; 3]).is_err());
    drop(w);
    assert!(!other.exists());
    // Reads out of range.
    std::fs::write(&path, &bytes).unwrap();
    let f = open(&path, &h).unwrap();
    let mut out = Vec::new();
    assert!(f.read(2, &[0], &mut out).is_err());
    assert!(f.read(0, &[4], &mut out).is_err());
    assert!(f.read(0, &[1, 1], &mut out).is_err());
}

/// CRC-32 (IEEE), bitwise: the test's own, not the crate's.
fn crc32(bytes: &[u8]) -> u32 {
    let mut c = !0u32;
    for &b in bytes {
        c ^= u32::from(b);
        for _ in 0..8 {
            c = if c & 1 != 0 {
                (c >> 1) ^ 0xedb8_8320
            } else {
                c >> 1
            };
        }
    }
    !c
}
