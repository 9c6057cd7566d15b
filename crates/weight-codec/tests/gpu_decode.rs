//! The WGSL decoder of the wgpu backend against the CPU decoder: random blocks of each
//! type the GPU computes with, coded into several chunks (odd sizes, a one-symbol
//! alphabet, empty and short chunks, chunks stored raw), decode on the device to the
//! CPU's bytes; malformed streams are refused by chunk; a packed tiny model streamed on
//! wgpu with its layers decoded on the device gives the plain file's logits while
//! uploading fewer bytes, and a chunk changed under it is refused by name.
//!
//! Needs a wgpu adapter: under CI (`CI` set) a missing one fails; elsewhere the tests
//! are skipped with a printed reason.

mod common;

use std::path::Path;
use std::sync::Arc;

use ballast_core::ggml_type::GgmlType;
use ballast_core::weights::{ChunkCoding, CodedChunk};
use ballast_runtime::backend::Telemetry;
use ballast_runtime::gguf::GgufFile;
use ballast_runtime::model::load_weights;
use ballast_runtime::testing::{gpu_for_tests, TinyModelSpec};
use ballast_runtime::{Model, ModelConfig, Session, WgpuBackend};
use ballast_weight_codec::codec::{chunk_len, decode_chunk, encode_chunk};
use ballast_weight_codec::store::skeleton;
use ballast_weight_codec::{
    transform, Codec, CompressedStore, PackFile, PackOptions, StoreOptions, Transform,
};
use proptest::prelude::*;

/// The types the GPU kernels compute with (all but the activation-only Q8_1 and Q8_K).
fn gpu_types() -> Vec<GgmlType> {
    GgmlType::ALL
        .into_iter()
        .filter(|t| !matches!(t, GgmlType::Q8_1 | GgmlType::Q8_K))
        .collect()
}

/// `data` cut into chunks of `chunk` raw bytes (whole blocks of `ty`), each coded with
/// `codec` (stored raw where coding would grow it, as the pack writer does): the stored
/// bytes and codec of each.
fn code(ty: GgmlType, codec: Codec, data: &[u8], chunk: usize) -> Vec<(Vec<u8>, Codec, usize)> {
    data.chunks(chunk_len(ty, chunk).max(1))
        .map(|piece| {
            let mut out = Vec::new();
            encode_chunk(ty, codec, 3, piece, &mut out);
            if out.len() >= piece.len() && !piece.is_empty() {
                (piece.to_vec(), Codec::RAW, piece.len())
            } else {
                (out, codec, piece.len())
            }
        })
        .collect()
}

/// What a store lends for `coded`: one [`CodedChunk`] per chunk.
fn lend<'a>(
    ty: GgmlType,
    coded: &'a [(Vec<u8>, Codec, usize)],
    planes: &'a [ballast_core::weights::Plane],
) -> Vec<CodedChunk<'a>> {
    coded
        .iter()
        .map(|(stored, codec, raw_len)| CodedChunk {
            stored,
            raw_len: *raw_len,
            coding: if codec.coder == ballast_weight_codec::Coder::Raw {
                ChunkCoding::Raw
            } else {
                ChunkCoding::RansLanes
            },
            block_bytes: ty.block_bytes(),
            planes: if codec.transform == Transform::Planes {
                planes
            } else {
                &[]
            },
        })
        .collect()
}

/// Random blocks: uniform bytes, bytes of one value, or skewed like real quants and
/// scale exponents; some whole blocks and a tail that ends mid-block.
fn any_blocks() -> impl Strategy<Value = (GgmlType, Vec<u8>)> {
    (
        proptest::sample::select(gpu_types()),
        0usize..200,
        0usize..40,
        0u8..3,
        any::<u8>(),
        any::<u64>(),
    )
        .prop_map(|(ty, blocks, tail, kind, one, seed)| {
            let n = blocks * ty.block_bytes() + tail.min(ty.block_bytes() - 1);
            let mut x = seed | 1;
            let data = (0..n)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    match kind {
                        0 => x as u8,
                        1 => one,
                        _ if x % 10 < 8 => 0x3c + (x % 3) as u8,
                        _ => (x >> 8) as u8,
                    }
                })
                .collect();
            (ty, data)
        })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(32))]

    /// Random blocks packed with lane-parallel rANS (with and without planes) into
    /// several chunks decode on the device to exactly the CPU decoder's bytes.
    #[test]
    fn device_decode_equals_cpu_decode(
        (ty, data) in any_blocks(),
        chunk in prop_oneof![Just(1usize), 100usize..3000, 5000usize..60_000],
        planes_on in any::<bool>(),
    ) {
        let Some(ctx) = gpu_for_tests() else { return Ok(()) };
        let backend = WgpuBackend::new(ctx);
        let codec = if planes_on { Codec::PLANES_RANS_LANES } else { Codec { transform: Transform::None, ..Codec::PLANES_RANS_LANES } };
        let coded = code(ty, codec, &data, chunk);
        let mut cpu = Vec::new();
        for (stored, c, raw_len) in &coded {
            let mut out = vec![0u8; *raw_len];
            decode_chunk(ty, *c, stored, &mut out).unwrap();
            cpu.extend(out);
        }
        prop_assert_eq!(&cpu, &data);
        let planes = transform::planes(ty);
        let got = backend.decode_coded("w", &lend(ty, &coded, &planes)).unwrap();
        prop_assert!(got == cpu, "{} bytes of {ty} in chunks of {chunk}: device bytes differ", data.len());
    }
}

/// Large chunks use every lane of a workgroup (64 lanes of 4096 symbols and more).
#[test]
fn full_lanes_and_many_chunks_decode_exactly() {
    let Some(ctx) = gpu_for_tests() else { return };
    let backend = WgpuBackend::new(ctx);
    for ty in [GgmlType::Q4_1, GgmlType::Q6_K] {
        let n = 2 * 300_000 / ty.block_bytes() * ty.block_bytes() + 7;
        let data: Vec<u8> = (0..n as u64)
            .map(|i| (i.wrapping_mul(i).wrapping_mul(2_654_435_761) >> 13) as u8 & 0x3f)
            .collect();
        let coded = code(ty, Codec::PLANES_RANS_LANES, &data, 300_000);
        // Two full chunks coded, and a 7-byte one stored raw.
        assert!(coded[..2]
            .iter()
            .all(|(_, c, _)| *c == Codec::PLANES_RANS_LANES));
        let planes = transform::planes(ty);
        let got = backend
            .decode_coded("w", &lend(ty, &coded, &planes))
            .unwrap();
        assert!(got == data, "{ty}: device bytes differ");
    }
}

/// A change to a chunk's stored bytes.
type Breakage = fn(&mut Vec<u8>);

/// Streams that break the coder's rules are refused, naming the tensor and chunk:
/// a wrong length, a lane or segment count out of range, a table that does not sum to
/// the scale, a lane cut short, a raw chunk of the wrong length.
#[test]
fn malformed_chunks_are_refused_by_name() {
    let Some(ctx) = gpu_for_tests() else { return };
    let backend = WgpuBackend::new(ctx);
    let ty = GgmlType::Q8_0;
    let data: Vec<u8> = (0..34 * 400u32).map(|i| (i % 7) as u8).collect();
    let coded = code(ty, Codec::PLANES_RANS_LANES, &data, 34 * 200);
    assert_eq!(coded.len(), 2);
    let planes = transform::planes(ty);
    let breakages: [(&str, Breakage); 5] = [
        ("length", |s| s[0] ^= 1),
        ("lane count", |s| {
            s[4..8].copy_from_slice(&65u32.to_le_bytes())
        }),
        ("segment count", |s| {
            s[8..12].copy_from_slice(&9u32.to_le_bytes())
        }),
        ("table", |s| s[16] ^= 0x01),
        ("lane cut short", |s| {
            s.pop();
        }),
    ];
    for (what, breakage) in breakages {
        let mut broken = coded.clone();
        breakage(&mut broken[1].0);
        let err = backend
            .decode_coded("blk.0.ffn_up.weight", &lend(ty, &broken, &planes))
            .unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.contains("blk.0.ffn_up.weight") && msg.contains("chunk 1"),
            "{what}: {msg}"
        );
    }
    let mut raw = coded.clone();
    raw[0] = (data[..100].to_vec(), Codec::RAW, 34 * 200);
    let err = backend
        .decode_coded("w", &lend(ty, &raw, &planes))
        .unwrap_err();
    assert!(err.to_string().contains("chunk 0"), "{err}");
}

fn tiny_pack(
    dir: &Path,
    weight_type: GgmlType,
    codec: Codec,
) -> (std::path::PathBuf, std::path::PathBuf) {
    // Wide enough for K-quant rows and for several chunks per matrix.
    let spec = TinyModelSpec {
        n_layers: 2,
        d_model: 256,
        n_ff: 512,
        weight_type,
        ..TinyModelSpec::default()
    };
    let opts = PackOptions {
        chunk_bytes: 16 << 10,
        candidates: vec![codec],
        ..PackOptions::default()
    };
    common::pack_tiny_model(dir, &spec, &opts)
}

/// A model over the pack at `path` on `backend`, its layers lent coded to the device
/// when `device_decode`.
fn packed_model(path: &Path, backend: Arc<WgpuBackend>, device_decode: bool) -> Model {
    let pack = Arc::new(PackFile::open(path, true).unwrap());
    let gguf = Arc::new(skeleton(&pack, 1).unwrap());
    let config = ModelConfig::from_gguf(&gguf).unwrap();
    let (globals, layers) = load_weights(&gguf, &config).unwrap();
    let opts = StoreOptions {
        prefetch: false,
        device_decode,
        ..StoreOptions::default()
    };
    let store = CompressedStore::new(pack, globals, layers, opts, true).unwrap();
    let ffn = ballast_runtime::ffn::for_config(&config);
    Model::from_parts(config, Box::new(store), backend, ffn)
}

/// Logits of every step of feeding `prompt` then greedy ids, and the bytes the last
/// pass uploaded.
fn run(model: Model, backend: &WgpuBackend) -> (Vec<Vec<f32>>, u64) {
    let mut s = Session::new(model, 64).unwrap();
    let mut all = vec![s.feed(&[1, 50, 200, 7]).unwrap().to_vec()];
    for _ in 0..3 {
        let id = ballast_runtime::sampler::argmax(all.last().unwrap());
        all.push(s.feed(&[id]).unwrap().to_vec());
    }
    (all, backend.last_pass().unwrap().bytes_uploaded)
}

/// Packed tiny models whose layers the device decodes give the plain file's logits on
/// wgpu, bit for bit, as the CPU-decoded pack does, and upload exactly the coded
/// chunks and their descriptors; random quantized weights hardly compress, but f16
/// ones do (their exponent bytes), and there the device-decoded pack uploads fewer
/// bytes than the CPU-decoded one.
#[test]
fn packed_models_decoded_on_the_device_give_the_plain_logits() {
    let Some(ctx) = gpu_for_tests() else { return };
    for ty in [
        GgmlType::F16,
        GgmlType::Q4_1,
        GgmlType::Q8_0,
        GgmlType::Q4_K,
    ] {
        let dir = tempfile::tempdir().unwrap();
        let (src, packed) = tiny_pack(dir.path(), ty, Codec::PLANES_RANS_LANES);
        let plain_backend = Arc::new(WgpuBackend::new(ctx.clone()));
        let plain = Model::load(
            Arc::new(GgufFile::open(&src, true).unwrap()),
            plain_backend.clone(),
            true,
        )
        .unwrap();
        let (want, _) = run(plain, &plain_backend);

        let cpu_backend = Arc::new(WgpuBackend::new(ctx.clone()));
        let (cpu_decoded, raw_upload) = run(
            packed_model(&packed, cpu_backend.clone(), false),
            &cpu_backend,
        );
        assert!(cpu_decoded == want, "{ty}: CPU-decoded pack: logits differ");

        let backend = Arc::new(WgpuBackend::new(ctx.clone()));
        let (got, coded_upload) = run(packed_model(&packed, backend.clone(), true), &backend);
        assert!(got == want, "{ty}: device-decoded pack: logits differ");
        // Uploaded: each layer matrix's stored chunks (each padded to a word) and a
        // 160-byte descriptor per chunk.
        let pack = PackFile::open(&packed, true).unwrap();
        let coded: u64 = pack
            .tensors()
            .iter()
            .filter(|t| t.name.starts_with("blk.") && !t.name.contains("norm"))
            .flat_map(|t| &t.chunks)
            .map(|c| u64::from(c.stored_len).div_ceil(4) * 4 + 160)
            .sum();
        assert_eq!(coded_upload, coded, "{ty}");
        if ty == GgmlType::F16 {
            assert!(
                coded_upload < raw_upload * 95 / 100,
                "uploaded {coded_upload} coded against {raw_upload} raw"
            );
        }
    }
}

/// A chunk changed in place (the map sees it) after its layer's first request is
/// refused at the next request, naming the tensor and chunk.
#[test]
fn a_chunk_changed_under_a_device_decoded_model_is_refused_by_name() {
    let Some(ctx) = gpu_for_tests() else { return };
    let dir = tempfile::tempdir().unwrap();
    let (_, packed) = tiny_pack(dir.path(), GgmlType::F16, Codec::PLANES_RANS_LANES);
    let backend = Arc::new(WgpuBackend::new(ctx));
    let model = packed_model(&packed, backend, true);
    let mut s = Session::new(model, 64).unwrap();
    s.feed(&[1, 2]).unwrap();
    let pack = PackFile::open(&packed, true).unwrap();
    let t = pack.tensor("blk.1.ffn_down.weight").unwrap().clone();
    assert!(t.chunks.len() > 2);
    let data_start = pack.file_len() - pack.tensors().iter().map(|t| t.stored_len()).sum::<u64>();
    let at = data_start + t.chunks[2].offset + 20;
    let byte = std::fs::read(&packed).unwrap()[at as usize];
    {
        use std::os::unix::fs::FileExt;
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(&packed)
            .unwrap();
        f.write_all_at(&[byte ^ 0x10], at).unwrap();
    }
    let err = s.feed(&[3]).unwrap_err();
    let mut chain = err.to_string();
    let mut e: &dyn std::error::Error = &err;
    while let Some(src) = e.source() {
        chain.push_str(&format!(": {src}"));
        e = src;
    }
    assert!(
        chain.contains("blk.1.ffn_down.weight") && chain.contains("chunk 2"),
        "{chain}"
    );
}
