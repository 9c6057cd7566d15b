//! Decode speed per codec on one chunk-sized slice of real weights of each type of the
//! default model (synthetic Q4_1-like blocks if it is not in the model cache):
//! `cargo bench -p ballast-weight-codec`. The end-to-end table (ratios per type, GB/s
//! on one and two threads) is `cargo xtask bench-codec`.

use ballast_core::ggml_type::GgmlType;
use ballast_core::gguf::GgufFile;
use ballast_weight_codec::codec::{chunk_len, decode_chunk, encode_chunk};
use ballast_weight_codec::Codec;
use criterion::{criterion_group, criterion_main, Criterion, Throughput};

fn samples() -> Vec<(GgmlType, Vec<u8>)> {
    let path = ballast_runtime::model_cache::default_model_path().ok();
    if let Some(file) = path
        .filter(|p| p.is_file())
        .and_then(|p| GgufFile::open(&p, true).ok())
    {
        let mut out: Vec<(GgmlType, Vec<u8>)> = Vec::new();
        for t in file.tensors() {
            if out.iter().all(|(ty, _)| *ty != t.ty) && t.n_bytes >= 256 << 10 {
                let n = chunk_len(t.ty, 256 << 10);
                out.push((t.ty, file.tensor_data(t)[..n].to_vec()));
            }
        }
        return out;
    }
    let mut x = 7u32;
    let data = (0..(256 << 10) / 20 * 20)
        .map(|i| {
            x = x.wrapping_mul(1664525).wrapping_add(1013904223);
            if i % 20 == 1 || i % 20 == 3 {
                0x2c
            } else {
                (x >> 24) as u8
            }
        })
        .collect();
    vec![(GgmlType::Q4_1, data)]
}

fn decode(c: &mut Criterion) {
    for (ty, raw) in samples() {
        let mut group = c.benchmark_group(format!("decode_{ty}"));
        group.throughput(Throughput::Bytes(raw.len() as u64));
        for codec in [Codec::ZSTD, Codec::PLANES_ZSTD, Codec::PLANES_RANS] {
            let mut stored = Vec::new();
            encode_chunk(ty, codec, 9, &raw, &mut stored);
            let mut out = vec![0u8; raw.len()];
            group.bench_function(codec.name(), |b| {
                b.iter(|| decode_chunk(ty, codec, &stored, &mut out).unwrap())
            });
        }
        group.finish();
    }
}

criterion_group!(benches, decode);
criterion_main!(benches);
