//! What several test files of this crate share.

use std::path::{Path, PathBuf};

use ballast_runtime::gguf::GgufFile;
use ballast_runtime::testing::TinyModelSpec;
use ballast_weight_codec::{write_pack, PackOptions};

/// Writes the tiny model `spec` to `dir/tiny.gguf` and packs it with `opts` into
/// `dir/tiny.pack`; returns both paths.
pub fn pack_tiny_model(dir: &Path, spec: &TinyModelSpec, opts: &PackOptions) -> (PathBuf, PathBuf) {
    let src = dir.join("tiny.gguf");
    std::fs::write(&src, spec.to_gguf_bytes().unwrap()).unwrap();
    let gguf = GgufFile::open(&src, true).unwrap();
    let out = dir.join("tiny.pack");
    write_pack(&gguf, &out, opts, &mut |_| {}).unwrap();
    (src, out)
}
