//! Fuzzes the sparsity-profile reader (versions 1 to 3, with the MLP-input and the
//! attention-input predictors): any bytes must parse or give a typed error naming the
//! file, never a panic; a profile that parses must give thresholds for any sparsity in
//! [0, 1), one per layer, and write back to bytes that parse to the same profile. Each
//! input is tried as it is and with its last 8 bytes replaced by the checksum of the
//! rest, so that the fuzzer reaches the sections behind the checksum.
#![no_main]

use std::path::Path;

use ballast_core::fingerprint::checksum;
use ballast_sparse_mlp::SparsityProfile;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    check(data);
    if data.len() >= 8 {
        let mut summed = data.to_vec();
        let body = summed.len() - 8;
        let sum = checksum(&summed[..body]);
        summed[body..].copy_from_slice(&sum.to_le_bytes());
        check(&summed);
    }
});

fn check(data: &[u8]) {
    let path = Path::new("fuzz.sparsity");
    let profile = match SparsityProfile::from_bytes(data, path) {
        Ok(p) => p,
        Err(e) => {
            assert!(e.to_string().contains("fuzz.sparsity"), "{e}");
            return;
        }
    };
    for s in [0.0, 0.15, 0.5, 0.995] {
        let t = profile.thresholds(s).expect("a sparsity in [0, 1)");
        assert_eq!(t.len(), profile.layers.len());
    }
    let again = SparsityProfile::from_bytes(&profile.to_bytes(), path).expect("its own bytes");
    assert!(again == profile);
}
