//! Pack and unpack alone: write a small GGUF file, pack it, open the pack and check
//! that every tensor decodes to exactly the bytes that were packed. Files go to the
//! temp directory and are removed at the end.
//!
//! Run: `cargo run -p ballast-weight-codec --example pack_unpack`

use ballast_core::ggml_type::GgmlType;
use ballast_core::gguf::{GgufFile, GgufWriter};
use ballast_weight_codec::{write_pack, PackFile, PackOptions};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut w = GgufWriter::new();
    w.add_metadata("general.architecture", "llama")?;
    // Made-up weights shaped like real ones: Q8_0 blocks (an f16 scale, then 32 quants
    // clustered around zero), f32 norms near 1, f16 embeddings of small magnitude.
    let mut rng = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    let mut q8 = Vec::new();
    for _ in 0..512 {
        q8.extend_from_slice(&(0x2000 + (next() % 256) as u16).to_le_bytes());
        q8.extend((0..32).map(|_| ((next() % 32) as i8 + (next() % 32) as i8 - 31) as u8));
    }
    let norm: Vec<u8> = (0..4096)
        .flat_map(|_| (1.0 + (next() % 1000) as f32 / 4000.0).to_le_bytes())
        .collect();
    let f16: Vec<u8> = (0..8192)
        .flat_map(|_| {
            ((0x2000 + (next() % 0x1000) as u16) | (next() as u16 & 0x8000)).to_le_bytes()
        })
        .collect();
    w.add_tensor("blk.0.ffn_up.weight", GgmlType::Q8_0, &[4096, 4], q8)?;
    w.add_tensor("blk.0.ffn_norm.weight", GgmlType::F32, &[4096], norm)?;
    w.add_tensor("token_embd.weight", GgmlType::F16, &[1024, 8], f16)?;

    let dir = std::env::temp_dir().join(format!("ballast-pack-example-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let result = pack_and_check(&w, &dir);
    std::fs::remove_dir_all(&dir)?;
    result
}

fn pack_and_check(w: &GgufWriter, dir: &std::path::Path) -> Result<(), Box<dyn std::error::Error>> {
    let (gguf_path, pack_path) = (dir.join("tiny.gguf"), dir.join("tiny.pack"));
    w.write_to_file(&gguf_path)?;
    let gguf = GgufFile::open(&gguf_path, true)?;
    write_pack(&gguf, &pack_path, &PackOptions::default(), &mut |_| {})?;

    let pack = PackFile::open(&pack_path, true)?;
    for tensor in pack.tensors() {
        let mut decoded = vec![0u8; tensor.raw_len as usize];
        pack.decode_tensor(tensor, &mut decoded, 2)?;
        let info = gguf
            .tensors()
            .iter()
            .find(|t| t.name == tensor.name)
            .ok_or("tensor missing from the GGUF")?;
        assert_eq!(
            decoded,
            gguf.tensor_data(info),
            "{} decodes to other bytes",
            tensor.name
        );
        println!(
            "{:<22} {:>5?} {:>6} -> {:>6} bytes  x{:.2}  ({}), bytes identical",
            tensor.name,
            tensor.ty,
            tensor.raw_len,
            tensor.stored_len(),
            tensor.ratio(),
            tensor.codec
        );
    }
    let (gguf_len, pack_len) = (std::fs::metadata(&gguf_path)?.len(), pack.file_len());
    println!(
        "file: {gguf_len} bytes of GGUF -> {pack_len} bytes of pack (x{:.2})",
        gguf_len as f64 / pack_len as f64
    );
    Ok(())
}
