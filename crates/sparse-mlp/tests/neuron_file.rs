//! The neuron file: write/read round trip in any order of the records (proptest), any
//! single flipped byte refused (but padding's), every malformed-file class refused with
//! an error naming the file (and the layer and neuron of a damaged record, the layer of a
//! damaged order), version 3's records never crossing a 4 KiB page, version 1 (neuron
//! order) and version 2 (back to back) files still read, and the hot-first order.

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
/// Widths: small records, many to a page; 480 with Q8_0 up rows makes a stride of
/// exactly 1024; 1024 with F32 up rows one over 4096.
const WIDTHS: [usize; 4] = [32, 64, 480, 1024];

/// The bytes a read of `places` (sorted, distinct) of `layer` reads: each run of adjacent
/// places from its first record to the end of its last one's CRC-32.
fn run_bytes(h: &NeuronFileHeader, layer: usize, places: &[usize]) -> u64 {
    let mut bytes = 0;
    let mut i = 0;
    while i < places.len() {
        let mut end = i + 1;
        while end < places.len() && places[end] == places[end - 1] + 1 {
            end += 1;
        }
        bytes += h.record_offset(layer, places[end - 1]) + h.stride() as u64
            - h.record_offset(layer, places[i]);
        i = end;
    }
    bytes
}

/// Per byte of the file of `h`, whether it is padding (in no header, order or record).
fn padding(h: &NeuronFileHeader) -> Vec<bool> {
    let mut pad = vec![true; h.file_len() as usize];
    let orders_end = HEADER_BYTES + h.n_layers * (h.n_ff * 4 + 4);
    pad[..orders_end].fill(false);
    for l in 0..h.n_layers {
        for p in 0..h.n_ff {
            let at = h.record_offset(l, p) as usize;
            pad[at..at + h.stride()].fill(false);
        }
    }
    pad
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(32))]

    /// Any subset of neurons reads back exactly as written, whatever the order the
    /// records are stored in (bytes read = records asked + their checksums), and the
    /// order reads back as written.
    #[test]
    fn round_trip(n_layers in 1usize..4, n_ff in 1usize..24, width in 0..WIDTHS.len(), up in 0..UP.len(),
                  picks in proptest::collection::vec(any::<bool>(), 24), seed in any::<u64>()) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m.gguf.neurons");
        let h = header(n_layers, n_ff, WIDTHS[width], UP[up]);
        let orders = shuffled(&h, seed ^ 0x5555);
        let layers = write_ordered(&path, &h, orders.clone(), seed);
        prop_assert!(!dir.path().join("m.gguf.neurons.tmp").exists());
        prop_assert_eq!(std::fs::metadata(&path).unwrap().len(), h.file_len());
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
            let order = &orders[l];
            let mut places: Vec<usize> = (0..n_ff).filter(|&p| picks[order[p] as usize]).collect();
            places.sort_unstable();
            prop_assert_eq!(read, run_bytes(&h, l, &places));
            prop_assert!(read as usize >= chosen.len() * (rb + 4));
            let want: Vec<u8> = chosen.iter().flat_map(|&j| records[j as usize * rb..][..rb].to_vec()).collect();
            prop_assert_eq!(out, want);
        }
    }

    /// Any single flipped byte is refused: in the header or an order when opening (an
    /// order's naming its layer), in a record or its checksum when reading that record,
    /// naming its layer and neuron (the neuron the order puts at that place). A flipped
    /// byte of padding changes nothing read.
    #[test]
    fn any_flipped_byte_is_refused(at in any::<prop::sample::Index>(), bit in 0u8..8, in_padding in any::<bool>(),
                                   width in 0..WIDTHS.len(), seed in any::<u64>()) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m.gguf.neurons");
        let h = header(2, 5, WIDTHS[width], GgmlType::Q4_1);
        let orders = shuffled(&h, seed);
        let layers = write_ordered(&path, &h, orders.clone(), seed);
        let mut bytes = std::fs::read(&path).unwrap();
        let pad = padding(&h);
        let candidates: Vec<usize> = (0..bytes.len()).filter(|&i| pad[i] == in_padding).collect();
        prop_assert!(!candidates.is_empty(), "a version 3 file of 5 records to a layer has padding");
        let i = candidates[at.index(candidates.len())];
        bytes[i] ^= 1 << bit;
        std::fs::write(&path, &bytes).unwrap();
        let orders_end = HEADER_BYTES + 2 * (5 * 4 + 4);
        prop_assert_eq!(h.records_start(), 4096);
        match open(&path, &h) {
            Err(e) => {
                prop_assert!(i < orders_end, "byte {} refused at open: {}", i, e);
                let e = e.to_string();
                prop_assert!(e.contains("m.gguf.neurons"), "{}", e);
                if i >= HEADER_BYTES {
                    let layer = (i - HEADER_BYTES) / (5 * 4 + 4);
                    prop_assert!(e.contains(&format!("layer {layer}'s neuron order")), "{}", e);
                }
            }
            Ok(f) if in_padding => prop_assert_eq!(read_all(&f).unwrap(), layers),
            Ok(f) => {
                prop_assert!(i >= orders_end);
                let (layer, place) = (0..2)
                    .flat_map(|l| (0..5).map(move |p| (l, p)))
                    .find(|&(l, p)| (h.record_offset(l, p) as usize..h.record_offset(l, p) as usize + h.stride()).contains(&i))
                    .expect("a byte of a record");
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
    let mut v4 = bytes.clone();
    v4[8] = 4;
    let crc = crc32(&v4[..44]);
    v4[44..48].copy_from_slice(&crc.to_le_bytes());
    refused(&v4, &h, "version 4");
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
    for version in [1, 2] {
        let old = NeuronFileHeader { version, ..h };
        assert!(NeuronFileWriter::create(&other, old, shuffled(&h, 1)).is_err());
    }
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

/// The records section of a version 2 file, built byte by byte: per layer, per place,
/// the record of the neuron `orders` puts there (`layers`: records in neuron order)
/// and its CRC-32, back to back.
fn back_to_back(h: &NeuronFileHeader, orders: &[Vec<u32>], layers: &[Vec<u8>]) -> Vec<u8> {
    let rb = h.layout.record_bytes();
    let mut bytes = Vec::new();
    for (l, (order, records)) in orders.iter().zip(layers).enumerate() {
        for &j in order {
            let record = &records[j as usize * rb..][..rb];
            let mut crc_in = (l as u32).to_le_bytes().to_vec();
            crc_in.extend_from_slice(&j.to_le_bytes());
            crc_in.extend_from_slice(record);
            bytes.extend_from_slice(record);
            bytes.extend_from_slice(&crc32(&crc_in).to_le_bytes());
        }
    }
    bytes
}

/// In a version 3 file, every layer's records start on a page and no record with its
/// CRC-32 crosses a 4096-byte boundary (records over 4096 bytes: back to back from the
/// layer's page), the file is whole pages, and the writer puts each record where the
/// header says: for the strides of SmolLM2-135M (976) and Qwen2.5-Coder-0.5B (1572), strides
/// dividing 4096 (256, 1024: no padding within a layer), a small one and one over 4096.
#[test]
fn version_3_records_do_not_cross_pages() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.gguf.neurons");
    for (up, down, n_embd, stride) in [
        (GgmlType::Q4_1, GgmlType::Q8_0, 576, 976),
        (GgmlType::Q5_0, GgmlType::Q8_0, 896, 1572),
        (GgmlType::Q4_1, GgmlType::F16, 96, 256),
        (GgmlType::Q8_0, GgmlType::Q8_0, 480, 1024),
        (GgmlType::Q4_1, GgmlType::Q8_0, 32, 58),
        (GgmlType::F32, GgmlType::Q8_0, 1024, 5188),
    ] {
        let mut h = header(3, 37, n_embd, up);
        h.layout.down_type = down;
        assert_eq!(h.stride(), stride);
        assert_eq!(h.records_start(), 4096);
        assert_eq!(h.file_len() % 4096, 0);
        let per_page = (4096 / stride).max(1);
        for l in 0..h.n_layers {
            assert_eq!(
                h.record_offset(l, 0) % 4096,
                0,
                "stride {stride}, layer {l}"
            );
            for p in 0..h.n_ff {
                let (at, end) = (h.record_offset(l, p), h.record_offset(l, p) + stride as u64);
                if stride <= 4096 {
                    assert_eq!(at / 4096, (end - 1) / 4096, "stride {stride}: place {p}");
                    assert_eq!(at % 4096, (p % per_page * stride) as u64);
                } else if p > 0 {
                    assert_eq!(at, h.record_offset(l, p - 1) + stride as u64);
                }
                if 4096 % stride == 0 {
                    assert_eq!(at, h.record_offset(l, 0) + (p * stride) as u64);
                }
                let next = if p + 1 < h.n_ff {
                    h.record_offset(l, p + 1)
                } else {
                    h.record_offset(l + 1, 0)
                };
                assert!(
                    end <= next && next <= h.file_len(),
                    "stride {stride}: place {p}"
                );
            }
        }
        // The sections are whole pages, as few as hold the records.
        let pages = (h.file_len() - h.records_start()) / 4096 / 3;
        let want = if stride <= 4096 {
            37usize.div_ceil(per_page)
        } else {
            (37 * stride).div_ceil(4096)
        };
        assert_eq!(pages as usize, want, "stride {stride}");
        let orders = shuffled(&h, 5);
        let layers = write_ordered(&path, &h, orders.clone(), stride as u64);
        let bytes = std::fs::read(&path).unwrap();
        assert_eq!(bytes.len() as u64, h.file_len());
        let rb = h.layout.record_bytes();
        for (l, order) in orders.iter().enumerate() {
            for (p, &j) in order.iter().enumerate() {
                let at = h.record_offset(l, p) as usize;
                assert_eq!(&bytes[at..at + rb], &layers[l][j as usize * rb..][..rb]);
            }
        }
        let pad = padding(&h);
        assert!(
            bytes.iter().zip(&pad).all(|(&b, &p)| !p || b == 0),
            "padding is zeros"
        );
        assert_eq!(read_all(&open(&path, &h).unwrap()).unwrap(), layers);
    }
}

/// A version 2 file (the files of the previous build: records back to back after the
/// orders), built byte by byte here, reads bit for bit as the version 3 file of the same
/// orders and records does, each run of adjacent places in one read of its records.
#[test]
fn version_2_files_still_read() {
    let dir = tempfile::tempdir().unwrap();
    let (v2_path, v3_path) = (dir.path().join("v2.neurons"), dir.path().join("v3.neurons"));
    let h3 = header(3, 40, 576, GgmlType::Q4_1);
    let h2 = NeuronFileHeader { version: 2, ..h3 };
    let orders = shuffled(&h3, 11);
    let layers = write_ordered(&v3_path, &h3, orders.clone(), 12);
    let mut bytes = h2.to_bytes().to_vec();
    for (l, order) in orders.iter().enumerate() {
        let order: Vec<u8> = order.iter().flat_map(|j| j.to_le_bytes()).collect();
        let mut crc_in = (l as u32).to_le_bytes().to_vec();
        crc_in.extend_from_slice(&order);
        bytes.extend_from_slice(&order);
        bytes.extend_from_slice(&crc32(&crc_in).to_le_bytes());
    }
    assert_eq!(bytes.len() as u64, h2.records_start());
    bytes.extend(back_to_back(&h2, &orders, &layers));
    assert_eq!(bytes.len() as u64, h2.file_len());
    assert!(h2.file_len() < h3.file_len());
    std::fs::write(&v2_path, &bytes).unwrap();
    let (v2, v3) = (open(&v2_path, &h2).unwrap(), open(&v3_path, &h3).unwrap());
    assert_eq!(v2.header(), &h2);
    assert_eq!(read_all(&v2).unwrap(), layers);
    let stride = h2.stride() as u64;
    for (l, order) in orders.iter().enumerate() {
        assert_eq!(v2.order(l), v3.order(l));
        assert_eq!(
            h2.record_offset(l, 7),
            h2.records_start() + (l * 40 + 7) as u64 * stride
        );
        // A run of the first 9 places is one read: of 9 records in version 2; in
        // version 3 (4 to a page), of two whole pages and the ninth record.
        let mut run: Vec<u32> = order[..9].to_vec();
        run.sort_unstable();
        let (mut a, mut b) = (Vec::new(), Vec::new());
        assert_eq!(v2.read(l, &run, &mut a).unwrap(), 9 * stride);
        assert_eq!(v3.read(l, &run, &mut b).unwrap(), 2 * 4096 + stride);
        assert_eq!(a, b);
        let odd: Vec<u32> = (0..40).filter(|j| j % 3 == 1).collect();
        let (mut a, mut b) = (Vec::new(), Vec::new());
        v2.read(l, &odd, &mut a).unwrap();
        v3.read(l, &odd, &mut b).unwrap();
        assert_eq!(a, b);
    }
    // Damaged, the record is named by the version 2 layout.
    let at = h2.record_offset(2, 13) as usize + 1;
    bytes[at] ^= 4;
    std::fs::write(&v2_path, &bytes).unwrap();
    let v2 = open(&v2_path, &h2).unwrap();
    match read_all(&v2) {
        Err(Error::DamagedRecord { layer, neuron, .. }) => {
            assert_eq!((layer, neuron), (2, orders[2][13] as usize))
        }
        other => panic!("{:?}", other.map(|_| ())),
    }
}

/// A version 3 file cut short (even by its last page's padding alone, every record
/// whole) or extended is refused naming the file; its padding is not checked, so
/// damaged padding reads as before.
#[test]
fn version_3_length_is_checked_and_padding_is_not() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.gguf.neurons");
    let h = header(2, 10, 576, GgmlType::Q4_1);
    let layers = write(&path, &h, 3);
    let bytes = std::fs::read(&path).unwrap();
    let records_end = (h.record_offset(1, 9) + h.stride() as u64) as usize;
    assert!(records_end < bytes.len());
    for cut in [
        &bytes[..bytes.len() - 1],
        &bytes[..records_end],
        &bytes[..4096],
    ] {
        std::fs::write(&path, cut).unwrap();
        let e = open(&path, &h).err().expect("refused").to_string();
        assert!(
            e.contains("m.gguf.neurons") && e.contains("truncated or extended"),
            "{e}"
        );
        assert!(
            e.contains(&format!("the header says {}", h.file_len())),
            "{e}"
        );
    }
    std::fs::write(&path, [bytes.clone(), vec![0; 4096]].concat()).unwrap();
    assert!(open(&path, &h).is_err());
    let mut padded = bytes.clone();
    for (b, p) in padded.iter_mut().zip(padding(&h)) {
        if p {
            *b = 0xa5;
        }
    }
    std::fs::write(&path, &padded).unwrap();
    let f = open(&path, &h).unwrap();
    assert_eq!(read_all(&f).unwrap(), layers);
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
