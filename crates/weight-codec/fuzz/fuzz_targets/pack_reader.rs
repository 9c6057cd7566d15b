//! Fuzzes the pack reader: any input must give `Ok` or a typed error, never a panic;
//! a pack that opens must decode each chunk to its checked bytes or give an error.
#![no_main]

use ballast_weight_codec::PackFile;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(pack) = PackFile::from_bytes(data.to_vec()) else {
        return;
    };
    let _ = (pack.file_len(), pack.gguf_len(), format!("{pack:?}"));
    for t in pack.tensors() {
        for (i, c) in t.chunks.iter().enumerate() {
            // The index may claim large raw chunks; decode only what a fuzz run affords.
            if c.raw_len > 1 << 20 {
                continue;
            }
            let mut out = vec![0u8; c.raw_len as usize];
            let _ = pack.decode_chunk(t, i, &mut out);
        }
    }
    if pack.gguf_len() <= 1 << 24 {
        let _ = pack.to_gguf(1);
    }
});
