//! Fuzzes the neuron-file reader (versions 1, 2 and 3): any bytes must open or give a
//! typed error, and a file that opens must give each layer's order as a permutation,
//! place every record inside the file (in version 3 within one 4 KiB page when it fits
//! in one, each layer's records on a page), and read every record (all of a layer at
//! once, every other one, and the first half of the layer's places, which are runs in
//! file order, in version 3 across padding) or give a typed error, never a panic.
#![no_main]

use std::path::PathBuf;
use std::sync::OnceLock;

use ballast_sparse_mlp::{NeuronFile, NeuronFileHeader, NeuronSource};
use libfuzzer_sys::fuzz_target;

fn path() -> &'static PathBuf {
    static PATH: OnceLock<PathBuf> = OnceLock::new();
    PATH.get_or_init(|| {
        let dir = std::env::var_os("NEURON_FUZZ_DIR").unwrap_or_else(|| "/dev/shm".into());
        PathBuf::from(dir).join(format!("ballast-neuron-fuzz-{}", std::process::id()))
    })
}

fuzz_target!(|data: &[u8]| {
    let path = path();
    if std::fs::write(path, data).is_err() {
        return;
    }
    let Ok(h) = NeuronFileHeader::from_bytes(data, path) else {
        return;
    };
    // Open with the header's own shape, and with another fingerprint (refused).
    let open = |fp| NeuronFile::open(path, fp, h.n_layers, h.n_ff, h.layout.n_embd, h.layout.up_type);
    assert!(open(h.fingerprint ^ 1).is_err());
    let Ok(file) = open(h.fingerprint) else {
        return;
    };
    if h.file_len() > 1 << 24 {
        return;
    }
    let stride = h.stride() as u64;
    for layer in 0..h.n_layers {
        for place in 0..h.n_ff {
            let at = h.record_offset(layer, place);
            assert!(at >= h.records_start() && at + stride <= h.file_len());
            if h.version >= 3 && stride <= 4096 {
                assert_eq!(at / 4096, (at + stride - 1) / 4096, "a record crosses a page");
            }
        }
        if h.version >= 3 {
            assert_eq!(h.record_offset(layer, 0) % 4096, 0);
        }
    }
    let mut out = Vec::new();
    for layer in 0..file.n_layers() {
        let all: Vec<u32> = (0..file.n_ff() as u32).collect();
        out.clear();
        let _ = file.read(layer, &all, &mut out);
        let odd: Vec<u32> = all.iter().copied().filter(|n| n % 2 == 1).collect();
        out.clear();
        let _ = file.read(layer, &odd, &mut out);
        let order = file.order(layer).expect("a layer of the file");
        let mut sorted = order.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, all, "an order that opened is a permutation");
        let mut hot: Vec<u32> = order[..order.len() / 2].to_vec();
        hot.sort_unstable();
        out.clear();
        if file.read(layer, &hot, &mut out).is_ok() {
            assert_eq!(out.len(), hot.len() * h.layout.record_bytes());
        }
    }
    assert!(file.order(file.n_layers()).is_none());
    let _ = file.read(file.n_layers(), &[0], &mut out);
});
