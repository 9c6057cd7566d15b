//! The neuron file: write/read round trip in any order of the records (proptest), any
//! single flipped byte refused, every malformed-file class refused with an error naming
//! the file (and the layer and neuron of a damaged record, the layer of a damaged
//! order), version 1 files (neuron order) still read, and the hot-first order.

use std::path::Path;

use ballast_runtime::ggml_type::GgmlType;
use ballast_runtime::neurons::NeuronLayout;
use ballast_sparse_mlp::{
    hot_first, Error, NeuronFile, NeuronFileHeader, NeuronFileWriter, NeuronSource, HEADER_BYTES,
    NEURON_FILE_VERSION,
};
use proptest::prelude::*;

fn header(n_layers: usize, n_ff: usize, n_embd: usize, up_type: GgmlType) -> NeuronFileHeader {
    NeuronFileHeader {
        version: NEURON_FILE_VERSION,
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

/// A xorshift generator.
fn next(s: &mut u64) -> u64 {
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    *s
}

/// Per layer of `h`, a seeded shuffle of its neurons.
fn shuffled(h: &NeuronFileHeader, seed: u64) -> Vec<Vec<u32>> {
    let mut s = seed | 1;
    (0..h.n_layers)
        .map(|_| {
            let mut order: Vec<u32> = (0..h.n_ff as u32).collect();
            for i in (1..order.len()).rev() {
                order.swap(i, (next(&mut s) % (i as u64 + 1)) as usize);
            }
            order
        })
        .collect()
}

/// Writes a file of `h` whose records are seeded bytes, each layer in the order of
/// `orders`; returns the records per layer, in neuron order.
fn write_ordered(
    path: &Path,
    h: &NeuronFileHeader,
    orders: Vec<Vec<u32>>,
    seed: u64,
) -> Vec<Vec<u8>> {
    let mut w = NeuronFileWriter::create(path, *h, orders).unwrap();
    let rb = h.layout.record_bytes();
    let mut s = seed | 1;
    let layers: Vec<Vec<u8>> = (0..h.n_layers)
        .map(|_| (0..h.n_ff * rb).map(|_| next(&mut s) as u8).collect())
        .collect();
    for l in &layers {
        w.write_layer(l).unwrap();
    }
    w.finish().unwrap();
    layers
}

/// [`write_ordered`] in a seeded shuffle of each layer.
fn write(path: &Path, h: &NeuronFileHeader, seed: u64) -> Vec<Vec<u8>> {
    write_ordered(path, h, shuffled(h, seed), seed)
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

    /// Any subset of neurons reads back exactly as written, whatever the order the
    /// records are stored in (bytes read = records asked + their checksums), and the
    /// order reads back as written.
    #[test]
    fn round_trip(n_layers in 1usize..4, n_ff in 1usize..24, wide in any::<bool>(), up in 0..UP.len(),
                  picks in proptest::collection::vec(any::<bool>(), 24), seed in any::<u64>()) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m.gguf.neurons");
        let h = header(n_layers, n_ff, if wide { 64 } else { 32 }, UP[up]);
        let orders = shuffled(&h, seed ^ 0x5555);
        let layers = write_ordered(&path, &h, orders.clone(), seed);
        prop_assert!(!dir.path().join("m.gguf.neurons.tmp").exists());
        let f = open(&path, &h).unwrap();
        prop_assert_eq!(f.header(), &h);
        for (l, order) in orders.iter().enumerate() {
            prop_assert_eq!(f.order(l), Some(order.clone()));
        }
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

    /// Any single flipped byte is refused: in the header or an order when opening (an
    /// order's naming its layer), in a record or its checksum when reading that record,
    /// naming its layer and neuron (the neuron the order puts at that place).
    #[test]
    fn any_flipped_byte_is_refused(at in any::<prop::sample::Index>(), bit in 0u8..8, seed in any::<u64>()) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m.gguf.neurons");
        let h = header(2, 5, 32, GgmlType::Q4_1);
        let orders = shuffled(&h, seed);
        write_ordered(&path, &h, orders.clone(), seed);
        let mut bytes = std::fs::read(&path).unwrap();
        let i = at.index(bytes.len());
        bytes[i] ^= 1 << bit;
        std::fs::write(&path, &bytes).unwrap();
        let start = h.records_start() as usize;
        prop_assert_eq!(start, HEADER_BYTES + 2 * (5 * 4 + 4));
        match open(&path, &h) {
            Err(e) => {
                prop_assert!(i < start, "byte {} refused at open: {}", i, e);
                let e = e.to_string();
                prop_assert!(e.contains("m.gguf.neurons"), "{}", e);
                if i >= HEADER_BYTES {
                    let layer = (i - HEADER_BYTES) / (5 * 4 + 4);
                    prop_assert!(e.contains(&format!("layer {layer}'s neuron order")), "{}", e);
                }
            }
            Ok(f) => {
                prop_assert!(i >= start);
                let stride = h.stride();
                let (layer, place) = ((i - start) / stride / 5, (i - start) / stride % 5);
                let neuron = orders[layer][place] as usize;
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
    let mut v3 = bytes.clone();
    v3[8] = 3;
    let crc = crc32(&v3[..44]);
    v3[44..48].copy_from_slice(&crc.to_le_bytes());
    refused(&v3, &h, "version 3");
    // An order that is not a permutation (neuron 0 twice), its checksum made right.
    let mut twice = bytes.clone();
    let order1 = HEADER_BYTES + 4 * 4 + 4;
    twice[order1..order1 + 8].copy_from_slice(&[0, 0, 0, 0, 0, 0, 0, 0]);
    let mut crc_in = 1u32.to_le_bytes().to_vec();
    crc_in.extend_from_slice(&twice[order1..order1 + 16]);
    let crc = crc32(&crc_in);
    twice[order1 + 16..order1 + 20].copy_from_slice(&crc.to_le_bytes());
    refused(&twice, &h, "layer 1's neuron order is not a permutation");
    // The writer takes only permutations, and writes only the current version.
    let other = dir.path().join("x.neurons");
    let e = NeuronFileWriter::create(&other, h, vec![vec![0, 1, 2, 3], vec![0, 1, 1, 3]])
        .err()
        .expect("refused")
        .to_string();
    assert!(e.contains("layer 1's neuron order"), "{e}");
    assert!(NeuronFileWriter::create(&other, h, vec![vec![0, 1, 2, 3]]).is_err());
    let v1 = NeuronFileHeader { version: 1, ..h };
    assert!(NeuronFileWriter::create(&other, v1, shuffled(&h, 1)).is_err());
    // An unfinished file (no finish) leaves nothing at the path.
    let mut w = NeuronFileWriter::create(&other, h, shuffled(&h, 1)).unwrap();
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

/// A version 1 file (records in neuron order, no order section; the files of earlier
/// builds), built byte by byte here, reads as written and in neuron order; damaged, it
/// is refused naming the record.
#[test]
fn version_1_files_still_read() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.gguf.neurons");
    let h = NeuronFileHeader {
        version: 1,
        ..header(2, 6, 32, GgmlType::Q4_1)
    };
    let rb = h.layout.record_bytes();
    let mut bytes = h.to_bytes().to_vec();
    let mut s = 99u64;
    let layers: Vec<Vec<u8>> = (0..2)
        .map(|_| (0..6 * rb).map(|_| next(&mut s) as u8).collect())
        .collect();
    for (l, records) in layers.iter().enumerate() {
        for (j, record) in records.chunks_exact(rb).enumerate() {
            let mut crc_in = (l as u32).to_le_bytes().to_vec();
            crc_in.extend_from_slice(&(j as u32).to_le_bytes());
            crc_in.extend_from_slice(record);
            bytes.extend_from_slice(record);
            bytes.extend_from_slice(&crc32(&crc_in).to_le_bytes());
        }
    }
    std::fs::write(&path, &bytes).unwrap();
    let f = open(&path, &h).unwrap();
    assert_eq!(f.header().version, 1);
    assert_eq!(f.order(1), Some((0..6).collect()));
    assert_eq!(read_all(&f).unwrap(), layers);
    let mut out = Vec::new();
    assert_eq!(
        f.read(1, &[2, 3, 5], &mut out).unwrap(),
        3 * (rb as u64 + 4)
    );
    assert_eq!(
        out,
        [2, 3, 5]
            .iter()
            .flat_map(|&j| layers[1][j * rb..][..rb].to_vec())
            .collect::<Vec<u8>>()
    );
    // Neuron 4 of layer 1 damaged: named when read, and nothing of the read is left.
    let at = HEADER_BYTES + (6 + 4) * (rb + 4) + 3;
    bytes[at] ^= 1;
    std::fs::write(&path, &bytes).unwrap();
    let f = open(&path, &h).unwrap();
    let mut out = vec![7u8];
    match f.read(1, &[3, 4], &mut out) {
        Err(Error::DamagedRecord { layer, neuron, .. }) => assert_eq!((layer, neuron), (1, 4)),
        other => panic!("{:?}", other.map(|_| ())),
    }
    assert_eq!(out, vec![7u8]);
}

proptest! {
    /// The hot-first order is a permutation, counts never rise along it, and ties are
    /// in neuron order.
    #[test]
    fn hot_first_ranks_by_count(counts in proptest::collection::vec(0u64..6, 0..64)) {
        let order = hot_first(&counts);
        let mut sorted = order.clone();
        sorted.sort_unstable();
        prop_assert_eq!(sorted, (0..counts.len() as u32).collect::<Vec<_>>());
        for w in order.windows(2) {
            let (a, b) = (counts[w[0] as usize], counts[w[1] as usize]);
            prop_assert!(a > b || (a == b && w[0] < w[1]), "{:?}", order);
        }
    }
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
