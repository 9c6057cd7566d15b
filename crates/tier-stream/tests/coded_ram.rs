//! A tiered store over a compressed pack (`TieredStore::over_coded`) whose RAM tier
//! holds layers coded: the same bytes as the plain file for any placement, access order
//! and slot count; the same logits as the plain file bit for bit; coded layers held in
//! RAM read nothing from disk; held bytes count the coded sizes.

use std::sync::Arc;

use ballast_runtime::gguf::GgufFile;
use ballast_runtime::model::load_weights;
use ballast_runtime::store::PassId;
use ballast_runtime::testing::TinyModelSpec;
use ballast_runtime::weights::LayerWeights;
use ballast_runtime::{CodedLayers, CpuBackend, ModelConfig, ResidentStore, WeightStore};
use ballast_tier_stream::{model_shape, Plan, RamTier, Tier, TieredOptions, TieredStore};
use ballast_weight_codec::store::skeleton;
use ballast_weight_codec::{
    write_pack, CachePolicy, CompressedStore, PackFile, PackOptions, StoreOptions,
};
use proptest::prelude::*;

mod common;

/// A tiny model as a plain GGUF file and as a pack of it.
struct Fixture {
    _dir: tempfile::TempDir,
    file: Arc<GgufFile>,
    config: ModelConfig,
    pack: Arc<PackFile>,
}

fn fixture(n_layers: usize) -> Fixture {
    let dir = tempfile::tempdir().unwrap();
    let spec = TinyModelSpec {
        n_layers,
        d_model: 128,
        n_ff: 256,
        seed: 11,
        ..TinyModelSpec::default()
    };
    let gguf_path = dir.path().join("tiny.gguf");
    std::fs::write(&gguf_path, spec.to_gguf_bytes().unwrap()).unwrap();
    let file = Arc::new(GgufFile::open(&gguf_path, true).unwrap());
    let config = ModelConfig::from_gguf(&file).unwrap();
    let pack_path = dir.path().join("tiny.pack");
    write_pack(&file, &pack_path, &PackOptions::default(), &mut |_| {}).unwrap();
    let pack = Arc::new(PackFile::open(&pack_path, true).unwrap());
    Fixture {
        _dir: dir,
        file,
        config,
        pack,
    }
}

/// The pack's store that decodes on every request, as the CLI stacks the tiers on.
fn decoding_store(fx: &Fixture) -> CompressedStore {
    let skel = Arc::new(skeleton(&fx.pack, 1).unwrap());
    let (g, l) = load_weights(&skel, &fx.config).unwrap();
    CompressedStore::new(
        fx.pack.clone(),
        g,
        l,
        StoreOptions {
            policy: CachePolicy::EveryUse,
            keep_layers: 0,
            prefetch: false,
            decode_threads: 1,
            ..StoreOptions::default()
        },
        true,
    )
    .unwrap()
}

/// A CPU plan with the given tiers (`Tier::Ram`: held coded) and `slots` slots big
/// enough for any layer.
fn plan_with(fx: &Fixture, store: &CompressedStore, tiers: Vec<Tier>, slots: usize) -> Plan {
    let (g, l) = load_weights(&fx.file, &fx.config).unwrap();
    let mut shape = model_shape(&fx.config, &g, &l);
    shape.stored_bytes = store.stored_bytes_per_layer();
    let slot_bytes = fx.file.file_len() + 8192;
    common::plan_with_tiers(shape, tiers, slots, slot_bytes, RamTier::Coded)
}

fn layer_bytes(l: &LayerWeights) -> Vec<Vec<u8>> {
    l.weights()
        .map(|w| w.bytes.as_slice().unwrap().to_vec())
        .collect()
}

fn tiers_from(picks: &[u8]) -> Vec<Tier> {
    picks
        .iter()
        .map(|t| match t {
            0 => Tier::Device,
            1 => Tier::Ram,
            _ => Tier::Disk,
        })
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(16))]

    /// Any placement over device (decoded), RAM (coded) and disk, any access order,
    /// any slot count: every layer's matrices are the plain file's bytes, and layers
    /// held coded read nothing from disk. With a separate device (RAM tier raw, as a
    /// GPU plan holds it), the same bytes.
    #[test]
    fn a_coded_ram_tier_serves_the_plain_files_bytes(
        n_layers in 1usize..6,
        picks in prop::collection::vec(0u8..3, 6),
        slots in 1usize..4,
        io_threads in 1usize..3,
        order in prop::collection::vec(0usize..6, 1..24),
        separate_device in any::<bool>(),
    ) {
        let fx = fixture(n_layers);
        let inner = decoding_store(&fx);
        let mut p = plan_with(&fx, &inner, tiers_from(&picks[..n_layers]), slots);
        if separate_device {
            p.unified = false;
            p.ram_coded = false;
            p.budgets.device = Some(1 << 40);
            p.staging_slots = slots;
            p.staging_slot_bytes = p.device_slot_bytes;
        }
        let stored = inner.stored_bytes_per_layer();
        let inner: Arc<dyn CodedLayers> = Arc::new(inner);
        let options = TieredOptions { io_threads, ..TieredOptions::default() };
        let s = TieredStore::over_coded(inner.clone(), &p, options).unwrap();
        let (_, plain) = load_weights(&fx.file, &fx.config).unwrap();
        for (k, &i) in order.iter().enumerate() {
            let i = i % n_layers;
            let l = s.layer(PassId(k as u64), i).unwrap();
            prop_assert_eq!(l.index, i);
            prop_assert!(layer_bytes(&l) == layer_bytes(&plain[i]), "layer {} on {:?}", i, p.tiers[i]);
        }
        let read = s.stats().disk_bytes;
        drop(s);
        // Disk reads are the coded bytes of disk-tier layers only (whole layers, some
        // read ahead and maybe evicted): a store whose streamed layers are all held
        // coded reads nothing.
        if !p.tiers.contains(&Tier::Disk) {
            prop_assert_eq!(read, 0);
        }
        if separate_device {
            return Ok(());
        }
        let s = TieredStore::over_coded(inner, &p, options).unwrap();
        let held = s.held_bytes();
        let coded: u64 = (0..n_layers).filter(|&i| p.tiers[i] == Tier::Ram).map(|i| stored[i]).sum();
        let on_disk: u64 = (0..n_layers).filter(|&i| p.tiers[i] == Tier::Disk).map(|i| p.layer_bytes[i]).sum();
        prop_assert_eq!(held.disk, on_disk);
        prop_assert!(held.device >= coded);
    }
}

/// Prefill, then three decode steps: the logits.
fn logits(fx: &Fixture, store: Box<dyn WeightStore>) -> Vec<f32> {
    common::passes_logits(&fx.config, store, Arc::new(CpuBackend::new(1)))
}

/// Streamed with a coded RAM tier (every layer coded, or mixed with decoded and disk
/// layers): the plain file's logits, bit for bit; each coded layer is decoded once per
/// pass and read from disk never.
#[test]
fn a_coded_ram_tier_gives_the_plain_files_logits_bit_for_bit() {
    let fx = fixture(6);
    let (g, l) = load_weights(&fx.file, &fx.config).unwrap();
    let reference = logits(&fx, Box::new(ResidentStore::new(g, l, true)));
    use Tier::{Device as A, Disk as C, Ram as B};
    for (tiers, slots) in [
        (vec![B; 6], 2),
        (vec![A, B, C, B, A, C], 1),
        (vec![B, C, B, C, B, C], 3),
    ] {
        let inner = decoding_store(&fx);
        let decodes = inner.stats_handle();
        let p = plan_with(&fx, &inner, tiers.clone(), slots);
        let s = TieredStore::over_coded(Arc::new(inner), &p, TieredOptions::default()).unwrap();
        let stats = s.stats_handle();
        let before = decodes.get().decompressions;
        let got = logits(&fx, Box::new(s));
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(
            bits(&got),
            bits(&reference),
            "{tiers:?}: logits differ from the plain file"
        );
        // Four passes: every coded or streamed layer decoded at least once per pass
        // (prefetch may decode a layer ahead that the last pass never asks for).
        let through = tiers.iter().filter(|&&t| t != A).count() as u64;
        let n = decodes.get().decompressions - before;
        assert!(
            n >= 4 * through && n <= 4 * through + slots as u64,
            "{tiers:?}: {n} decodes"
        );
        if !tiers.contains(&C) {
            assert_eq!(stats.get().disk_bytes, 0, "{tiers:?}");
        }
    }
}

/// A plan that holds layers coded needs a store with a coded form: over a plain store
/// it is refused, not served wrong.
#[test]
fn a_coded_plan_over_a_store_without_a_coded_form_is_refused() {
    let fx = fixture(3);
    let inner = decoding_store(&fx);
    let p = plan_with(&fx, &inner, vec![Tier::Ram, Tier::Disk, Tier::Device], 1);
    let (g, l) = load_weights(&fx.file, &fx.config).unwrap();
    let e = TieredStore::over_store(
        Arc::new(ResidentStore::new(g, l, true)),
        &p,
        TieredOptions::default(),
    )
    .unwrap_err();
    assert!(e.to_string().contains("coded"), "{e}");
}
