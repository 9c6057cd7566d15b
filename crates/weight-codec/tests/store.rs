//! `CompressedStore` gives the forward pass the exact weights of the plain file, under
//! each cache policy, and its counters say how often it decoded.

mod common;

use std::path::Path;
use std::sync::Arc;

use ballast_core::ggml_type::GgmlType;
use ballast_core::store::PassId;
use ballast_core::weights::{LayerWeights, Weight};
use ballast_core::WeightStore;
use ballast_runtime::gguf::GgufFile;
use ballast_runtime::model::load_weights;
use ballast_runtime::testing::TinyModelSpec;
use ballast_runtime::{CpuBackend, DenseFfn, Model, ModelConfig, Session};
use ballast_weight_codec::store::skeleton;
use ballast_weight_codec::{
    write_pack, CachePolicy, Codec, CompressedStore, PackFile, PackOptions, StoreOptions,
};

/// A model over the pack at `path` with a `CompressedStore`, and its counters.
fn compressed_model(
    path: &Path,
    opts: StoreOptions,
) -> (Model, ballast_weight_codec::store::StatsHandle) {
    let pack = Arc::new(PackFile::open(path, true).unwrap());
    let gguf = Arc::new(skeleton(&pack, 2).unwrap());
    let config = ModelConfig::from_gguf(&gguf).unwrap();
    let (globals, layers) = load_weights(&gguf, &config).unwrap();
    let store = CompressedStore::new(pack, globals, layers, opts, true).unwrap();
    let stats = store.stats_handle();
    let model = Model::from_parts(
        config,
        Box::new(store),
        Arc::new(CpuBackend::new(2)),
        Box::new(DenseFfn::new()),
    );
    (model, stats)
}

/// Greedy ids of `model` after `prompt`, for `n` steps.
fn greedy(model: Model, prompt: &[u32], n: usize) -> Vec<u32> {
    let mut s = Session::new(model, 256).unwrap();
    let mut id = s.feed_greedy(prompt).unwrap();
    let mut out = vec![id];
    for _ in 1..n {
        id = s.feed_greedy(&[id]).unwrap();
        out.push(id);
    }
    out
}

fn pack_tiny(dir: &Path, weight_type: GgmlType) -> (std::path::PathBuf, std::path::PathBuf) {
    // K-quant rows are whole blocks of 256 values.
    let width = weight_type.block_len().max(64);
    let spec = TinyModelSpec {
        n_layers: 4,
        d_model: width,
        n_ff: 2 * width,
        weight_type,
        ..TinyModelSpec::default()
    };
    let opts = PackOptions {
        chunk_bytes: 1000,
        ..PackOptions::default()
    };
    common::pack_tiny_model(dir, &spec, &opts)
}

#[test]
fn every_policy_gives_the_plain_files_logits_and_counts_its_decodes() {
    let dir = tempfile::tempdir().unwrap();
    for ty in [GgmlType::Q8_0, GgmlType::Q4_K] {
        let (src, packed) = pack_tiny(dir.path(), ty);
        let plain = Model::load(
            Arc::new(GgufFile::open(&src, true).unwrap()),
            Arc::new(CpuBackend::new(2)),
            true,
        )
        .unwrap();
        let prompt = [1u32, 50, 200, 7, 9];
        let steps = 6;
        let want = greedy(plain, &prompt, steps);
        let passes = steps as u64; // one pass for the prompt, one per further step
        for (policy, keep, prefetch, per_pass) in [
            (CachePolicy::PerPass, 0, false, 4.0),
            (CachePolicy::PerPass, 0, true, 4.0),
            (CachePolicy::EveryUse, 0, false, 4.0),
            (CachePolicy::EveryUse, 0, true, 4.0),
            (CachePolicy::EveryUse, 2, true, 2.0 + 2.0 / passes as f64),
            (CachePolicy::Keep, 0, false, 4.0 / passes as f64),
        ] {
            let opts = StoreOptions {
                policy,
                keep_layers: keep,
                prefetch,
                decode_threads: 2,
                ..StoreOptions::default()
            };
            let (model, stats) = compressed_model(&packed, opts.clone());
            let got = greedy(model, &prompt, steps);
            assert_eq!(got, want, "{ty} {opts:?}");
            let s = stats.get();
            assert_eq!(s.passes, passes, "{opts:?}");
            assert_eq!(s.requests, 4 * passes, "{opts:?}");
            // A prefetch may decode layer 0 for a pass that never comes.
            let extra = s.decompressions as f64 - per_pass * passes as f64;
            assert!(
                (0.0..=if prefetch { 1.0 } else { 0.0 }).contains(&extra),
                "{ty} {opts:?}: {} decompressions in {passes} passes",
                s.decompressions
            );
        }
    }
}

#[test]
fn per_pass_holds_a_pass_and_every_use_holds_a_layer_or_two() {
    let dir = tempfile::tempdir().unwrap();
    let (_, packed) = pack_tiny(dir.path(), GgmlType::Q8_0);
    let pack = PackFile::open(&packed, true).unwrap();
    let layer_bytes: u64 = pack
        .tensors()
        .iter()
        .filter(|t| t.name.starts_with("blk.0.") && t.raw_len > 1000)
        .map(|t| t.raw_len)
        .sum();
    let peak = |policy| {
        let opts = StoreOptions {
            policy,
            prefetch: false,
            ..StoreOptions::default()
        };
        let (model, stats) = compressed_model(&packed, opts);
        greedy(model, &[3, 4, 5], 3);
        stats.get().decoded_bytes_peak
    };
    let (per_pass, every_use) = (peak(CachePolicy::PerPass), peak(CachePolicy::EveryUse));
    assert!(
        per_pass >= 4 * layer_bytes,
        "{per_pass} < 4 x {layer_bytes}"
    );
    assert!(
        every_use < 2 * layer_bytes + 256,
        "{every_use} vs {layer_bytes}"
    );
}

#[test]
fn a_corrupt_layer_is_an_error_naming_tensor_and_chunk() {
    let dir = tempfile::tempdir().unwrap();
    let (_, packed) = pack_tiny(dir.path(), GgmlType::Q8_0);
    let pack = PackFile::open(&packed, false).unwrap();
    let t = pack.tensor("blk.2.ffn_up.weight").unwrap().clone();
    let data_start = pack.file_len() - pack.tensors().iter().map(|t| t.stored_len()).sum::<u64>();
    let mut bytes = std::fs::read(&packed).unwrap();
    bytes[(data_start + t.chunks[1].offset) as usize] ^= 1;
    std::fs::write(&packed, bytes).unwrap();
    let (model, _) = compressed_model(
        &packed,
        StoreOptions {
            prefetch: true,
            ..StoreOptions::default()
        },
    );
    let mut s = Session::new(model, 64).unwrap();
    let err = s.feed_greedy(&[1, 2]).unwrap_err();
    let msg = format!("{err:#}");
    let chain = {
        let mut all = msg.clone();
        let mut e: &dyn std::error::Error = &err;
        while let Some(src) = e.source() {
            all.push_str(&format!(": {src}"));
            e = src;
        }
        all
    };
    assert!(chain.contains("blk.2.ffn_up.weight, chunk 1"), "{chain}");
}

/// The default model packed: the same greedy ids as the plain file on the CPU.
#[test]
fn packed_default_model_gives_the_plain_files_greedy_ids() {
    let path = ballast_runtime::model_cache::default_model_path().unwrap();
    if !path.is_file() {
        assert!(
            std::env::var_os("CI").is_none(),
            "the default model is missing under CI"
        );
        eprintln!("skipped: the default model is not at {}", path.display());
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let gguf = GgufFile::open(&path, true).unwrap();
    let packed = dir.path().join("smollm2.pack");
    let reports = write_pack(&gguf, &packed, &PackOptions::default(), &mut |_| {}).unwrap();
    let stored: u64 = reports.iter().map(|r| r.stored_len()).sum();
    let raw: u64 = reports.iter().map(|r| r.raw_len).sum();
    assert!(stored < raw, "{stored} stored for {raw}");
    let plain = Model::load(Arc::new(gguf), Arc::new(CpuBackend::new(2)), true).unwrap();
    let prompt = [1u32, 9690, 314, 253, 1789, 30, 2];
    let want = greedy(plain, &prompt, 12);
    let (model, stats) = compressed_model(&packed, StoreOptions::default());
    assert_eq!(greedy(model, &prompt, 12), want);
    let s = stats.get();
    assert_eq!(s.requests, 30 * 12);
    // And the whole file decoded back is the plain file, byte for byte.
    let pack = PackFile::open(&packed, true).unwrap();
    let plain = GgufFile::open(&path, true).unwrap();
    assert!(pack.to_gguf(2).unwrap().as_bytes() == plain.as_bytes());
}

/// A store over a mapped pack of the tiny model (Q8_0, split in planes and rANS-coded
/// lane by lane so that a device could decode it), lending layers coded
/// (`device_decode`) unless told not to; no prefetch, so only the layers asked for are
/// read.
fn mapped_store(dir: &Path, device_decode: bool) -> (std::path::PathBuf, CompressedStore) {
    store_over_pack(dir, device_decode, false)
}

/// [`mapped_store`], its chunks read from the file instead of the map if `from_disk`.
fn store_over_pack(
    dir: &Path,
    device_decode: bool,
    from_disk: bool,
) -> (std::path::PathBuf, CompressedStore) {
    let spec = TinyModelSpec {
        n_layers: 4,
        ..TinyModelSpec::default()
    };
    let opts = PackOptions {
        chunk_bytes: 1000,
        candidates: vec![Codec::PLANES_RANS_LANES],
        ..PackOptions::default()
    };
    let (_, packed) = common::pack_tiny_model(dir, &spec, &opts);
    let pack = Arc::new(PackFile::open(&packed, true).unwrap());
    if from_disk {
        pack.read_chunks_from_disk().unwrap();
    }
    let gguf = Arc::new(skeleton(&pack, 1).unwrap());
    let config = ModelConfig::from_gguf(&gguf).unwrap();
    let (globals, layers) = load_weights(&gguf, &config).unwrap();
    let opts = StoreOptions {
        prefetch: false,
        device_decode,
        ..StoreOptions::default()
    };
    let store = CompressedStore::new(pack, globals, layers, opts, true).unwrap();
    (packed, store)
}

/// Cuts the file at `path` to half its length, as a pack shrinking under a reader.
fn cut_to_half(path: &Path) {
    let len = std::fs::metadata(path).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(path)
        .unwrap()
        .set_len(len / 2)
        .unwrap();
}

/// `err` and its sources, one line.
fn chain(err: &dyn std::error::Error) -> String {
    let mut all = err.to_string();
    let mut e = err;
    while let Some(src) = e.source() {
        all.push_str(&format!(": {src}"));
        e = src;
    }
    all
}

/// Layer 2 as a device would get it after its first pass: lent coded, its host bytes
/// not yet decoded; and its `ffn_up` matrix.
fn lent_coded(store: &CompressedStore) -> (Arc<LayerWeights>, Weight) {
    store.layer(PassId(1), 2).unwrap();
    let layer = store.layer(PassId(2), 2).unwrap();
    let up = layer
        .weights()
        .find(|w| w.name == "blk.2.ffn_up.weight")
        .unwrap()
        .clone();
    assert!(up.bytes.coded().is_some(), "layer 2 is lent coded");
    (layer, up)
}

/// A chunk changed in place (the map sees it) after a layer was lent coded: asking for
/// that layer's host bytes is an error naming the pack, tensor and chunk (it used to
/// panic), and so is the layer's next request.
#[test]
fn a_pack_changed_under_a_lent_layer_is_an_error_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let (packed, store) = mapped_store(dir.path(), true);
    let (_layer, up) = lent_coded(&store);
    let pack = PackFile::open(&packed, false).unwrap();
    let t = pack.tensor("blk.2.ffn_up.weight").unwrap().clone();
    let data_start = pack.file_len() - pack.tensors().iter().map(|t| t.stored_len()).sum::<u64>();
    let at = data_start + t.chunks[1].offset + 3;
    let byte = std::fs::read(&packed).unwrap()[at as usize];
    {
        use std::os::unix::fs::FileExt;
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(&packed)
            .unwrap();
        f.write_all_at(&[byte ^ 0x21], at).unwrap();
    }
    let err = up.bytes.as_slice().unwrap_err();
    let msg = chain(&err);
    assert!(
        msg.contains(&packed.display().to_string()) && msg.contains("blk.2.ffn_up.weight, chunk 1"),
        "{msg}"
    );
    let err = store.layer(PassId(3), 2).unwrap_err();
    assert!(
        chain(&err).contains("blk.2.ffn_up.weight, chunk 1"),
        "{err}"
    );
}

/// A pack cut short under an open store: the lent layer's host bytes, and any layer
/// asked for after, are an error naming the file (reading the map past the file's new
/// end would otherwise kill the process with SIGBUS), with layers lent coded or not.
#[test]
fn a_pack_cut_short_under_an_open_store_is_an_error_naming_it() {
    for device_decode in [true, false] {
        let dir = tempfile::tempdir().unwrap();
        let (packed, store) = mapped_store(dir.path(), device_decode);
        let lent = device_decode.then(|| lent_coded(&store));
        if !device_decode {
            store.layer(PassId(1), 2).unwrap();
        }
        cut_to_half(&packed);
        let name = packed.display().to_string();
        if let Some((_layer, up)) = &lent {
            let msg = chain(&up.bytes.as_slice().unwrap_err());
            assert!(msg.contains(&name) && msg.contains("cut short"), "{msg}");
        }
        for index in [1, 2, 3] {
            let msg = chain(&store.layer(PassId(10 + index as u64), index).unwrap_err());
            assert!(msg.contains(&name) && msg.contains("cut short"), "{msg}");
        }
    }
}

/// A layer read and decoded piece by piece (what a tiered store's reader does, holding a
/// span of the coded form instead of all of it) gives the bytes the store lends, for any
/// span, from the map and from the file, and says it read the whole coded form.
#[test]
fn read_decode_gives_the_layers_bytes_whatever_the_span() {
    use ballast_core::store::CodedLayers;
    for from_disk in [false, true] {
        let dir = tempfile::tempdir().unwrap();
        let (packed, store) = store_over_pack(dir.path(), false, from_disk);
        let mut last = Vec::new();
        for index in 0..store.n_layers() {
            let layer = store.layer(PassId(1 + index as u64), index).unwrap();
            let want: Vec<Vec<u8>> = layer
                .weights()
                .map(|w| w.bytes.as_slice().unwrap().to_vec())
                .collect();
            assert!(
                want.iter().map(Vec::len).sum::<usize>() > 3000,
                "several chunks"
            );
            for span in [1, 1000, 2500, u64::MAX] {
                let mut got: Vec<Vec<u8>> = want.iter().map(|w| vec![0xA5; w.len()]).collect();
                let mut out: Vec<&mut [u8]> = got.iter_mut().map(Vec::as_mut_slice).collect();
                let read = store.read_decode_in_spans(index, &mut out, span).unwrap();
                assert_eq!(read, store.coded_len(index), "layer {index}, span {span}");
                assert!(
                    got == want,
                    "layer {index}, span {span}, from disk {from_disk}"
                );
            }
            let mut got: Vec<Vec<u8>> = want.iter().map(|w| vec![0; w.len()]).collect();
            let mut out: Vec<&mut [u8]> = got.iter_mut().map(Vec::as_mut_slice).collect();
            store.read_decode(index, &mut out).unwrap();
            assert!(got == want, "layer {index} through the trait");
            assert!(store.read_decode_held(index) <= store.coded_len(index));
            // Too few places to decode into: an error naming the layer, nothing written.
            let mut short: Vec<&mut [u8]> = got.iter_mut().skip(1).map(Vec::as_mut_slice).collect();
            let msg = chain(&store.read_decode(index, &mut short).unwrap_err());
            assert!(msg.contains(&format!("layer {index}")), "{msg}");
            last = want.iter().map(Vec::len).collect();
        }
        // The pack cut short under the store: an error naming it, not a panic.
        cut_to_half(&packed);
        let mut got: Vec<Vec<u8>> = last.iter().map(|&n| vec![0; n]).collect();
        let mut out: Vec<&mut [u8]> = got.iter_mut().map(Vec::as_mut_slice).collect();
        let index = store.n_layers() - 1;
        let msg = chain(&store.read_decode(index, &mut out).unwrap_err());
        assert!(msg.contains(&packed.display().to_string()), "{msg}");
    }
}

/// An untied embedding table stays coded in the pack and a lookup decodes only the
/// chunks its rows lie in: the skeleton leaves the table as zero pages, and the store's
/// table gives the plain file's rows, bytes and greedy ids all the same.
#[test]
fn an_untied_embedding_is_decoded_row_by_row() {
    let dir = tempfile::tempdir().unwrap();
    let spec = TinyModelSpec {
        n_layers: 2,
        tied: false,
        ..TinyModelSpec::default()
    };
    let opts = PackOptions {
        chunk_bytes: 1000,
        ..PackOptions::default()
    };
    let (src, packed) = common::pack_tiny_model(dir.path(), &spec, &opts);
    let plain_file = Arc::new(GgufFile::open(&src, true).unwrap());
    let plain_embd = plain_file.tensor("token_embd.weight").unwrap().clone();
    let want = plain_file.tensor_data(&plain_embd).to_vec();

    let pack = Arc::new(PackFile::open(&packed, true).unwrap());
    let gguf = skeleton(&pack, 1).unwrap();
    let skeleton_embd = gguf.tensor("token_embd.weight").unwrap().clone();
    let undecoded = gguf.tensor_data(&skeleton_embd).to_vec();
    assert!(
        undecoded.iter().all(|&b| b == 0),
        "the skeleton left it coded"
    );
    let config = ModelConfig::from_gguf(&gguf).unwrap();
    let (globals, layers) = load_weights(&Arc::new(gguf), &config).unwrap();
    let store = CompressedStore::new(pack, globals, layers, StoreOptions::default(), true).unwrap();
    assert!(store.embedding_rows_held() > 0);
    let table = &store.globals().token_embd().bytes;
    let row = store.globals().token_embd().row_bytes();
    for id in [0usize, 1, 37, 200, 255] {
        let got = table.range_bytes(id * row..(id + 1) * row).unwrap();
        assert_eq!(&got[..], &want[id * row..(id + 1) * row], "row {id}");
    }
    // Across chunk boundaries, and the whole table.
    let got = table.range_bytes(900..2100).unwrap();
    assert_eq!(&got[..], &want[900..2100]);
    assert!(table.range_bytes(0..want.len() + 1).is_err());
    assert_eq!(table.as_slice().unwrap(), &want[..]);

    let plain = Model::load(plain_file, Arc::new(CpuBackend::new(2)), true).unwrap();
    let prompt = [1u32, 50, 200, 7, 9];
    let want_ids = greedy(plain, &prompt, 6);
    let (model, _) = compressed_model(&packed, StoreOptions::default());
    assert_eq!(greedy(model, &prompt, 6), want_ids);
}
