//! The streaming store: exact bytes in any access order under random read delays and
//! split reads (with and without a separate device); the same logits as the resident
//! store on the CPU and on wgpu (device, RAM and disk tiers); read errors and short
//! reads that name the layer and the file.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use ballast_runtime::backend::Telemetry;
use ballast_runtime::gguf::GgufFile;
use ballast_runtime::gpu::GpuContext;
use ballast_runtime::model::{load_weights, Logits};
use ballast_runtime::store::PassId;
use ballast_runtime::testing::TinyModelSpec;
use ballast_runtime::weights::LayerWeights;
use ballast_runtime::DenseKv;
use ballast_runtime::{
    Backend, CpuBackend, DenseFfn, Model, ModelConfig, ResidentStore, WeightStore, WgpuBackend,
};
use ballast_tier_stream::io::ReadAt;
use ballast_tier_stream::{
    model_shape, plan, Budgets, Plan, PlanRequest, RamTier, Tier, TieredOptions, TieredStore,
};
use proptest::prelude::*;

mod common;

/// A file in memory whose reads sleep a random while, may return fewer (aligned) bytes
/// than asked, and may fail or end early past a given offset.
struct FlakyReader {
    bytes: Arc<Vec<u8>>,
    path: PathBuf,
    seed: AtomicU64,
    max_delay_us: u64,
    split_reads: bool,
    fail_at: Option<u64>,
    truncate_at: Option<u64>,
}

impl FlakyReader {
    fn new(bytes: Arc<Vec<u8>>, seed: u64, max_delay_us: u64) -> FlakyReader {
        FlakyReader {
            bytes,
            path: PathBuf::from("/models/flaky.gguf"),
            seed: AtomicU64::new(seed | 1),
            max_delay_us,
            split_reads: true,
            fail_at: None,
            truncate_at: None,
        }
    }

    fn next(&self) -> u64 {
        let mut x = self
            .seed
            .fetch_add(0x9e37_79b9_7f4a_7c15, Ordering::Relaxed);
        x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        x ^ (x >> 31)
    }
}

impl ReadAt for FlakyReader {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<usize> {
        assert_eq!(offset % 4096, 0, "reads must be aligned");
        assert_eq!(buf.len() % 4096, 0, "read lengths must be aligned");
        assert_eq!(buf.as_ptr() as usize % 4096, 0, "buffers must be aligned");
        if self.max_delay_us > 0 {
            std::thread::sleep(Duration::from_micros(self.next() % self.max_delay_us));
        }
        let end_of_file = self.truncate_at.unwrap_or(self.bytes.len() as u64);
        if let Some(f) = self.fail_at {
            if offset + buf.len() as u64 > f {
                return Err(std::io::Error::other("injected I/O error"));
            }
        }
        if offset >= end_of_file {
            return Ok(0);
        }
        let mut n = buf.len().min((end_of_file - offset) as usize);
        if self.split_reads && n > 4096 && self.next() % 2 == 0 {
            // A partial read of whole blocks, as a disk may return.
            n = (1 + self.next() as usize % (n / 4096)) * 4096;
        }
        buf[..n].copy_from_slice(&self.bytes[offset as usize..offset as usize + n]);
        Ok(n)
    }

    fn path(&self) -> &Path {
        &self.path
    }

    fn len(&self) -> u64 {
        self.bytes.len() as u64
    }

    fn mode(&self) -> &'static str {
        "test"
    }
}

fn fnv(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
        (h ^ b as u64).wrapping_mul(0x0100_0000_01b3)
    })
}

fn layer_checksum(l: &LayerWeights) -> u64 {
    l.weights().fold(0u64, |h, w| {
        h.rotate_left(7) ^ fnv(w.bytes.as_slice().unwrap())
    })
}

struct Fixture {
    bytes: Arc<Vec<u8>>,
    file: Arc<GgufFile>,
    config: ModelConfig,
}

fn fixture(n_layers: usize, seed: u64) -> Fixture {
    let spec = TinyModelSpec {
        n_layers,
        d_model: 128,
        n_ff: 256,
        seed,
        ..TinyModelSpec::default()
    };
    let bytes = spec.to_gguf_bytes().unwrap();
    let file = Arc::new(GgufFile::from_bytes(bytes.clone()).unwrap());
    let config = ModelConfig::from_gguf(&file).unwrap();
    Fixture {
        bytes: Arc::new(bytes),
        file,
        config,
    }
}

/// A plan with the given tiers and `slots` slots big enough for any layer.
fn plan_with(fx: &Fixture, tiers: Vec<Tier>, slots: usize) -> Plan {
    let (g, l) = load_weights(&fx.file, &fx.config).unwrap();
    let shape = model_shape(&fx.config, &g, &l);
    let slot_bytes = fx.bytes.len() as u64 + 8192;
    common::plan_with_tiers(shape, tiers, slots, slot_bytes, RamTier::Raw)
}

/// Like [`plan_with`], for a separate device: `tiers` may hold [`Tier::Ram`], disk reads
/// go through `slots` staging slots.
fn plan_with_device(fx: &Fixture, tiers: Vec<Tier>, slots: usize) -> Plan {
    let mut p = plan_with(fx, tiers, slots);
    p.unified = false;
    p.budgets.device = Some(1 << 40);
    p.staging_slots = slots;
    p.staging_slot_bytes = p.device_slot_bytes;
    p
}

fn store(fx: &Fixture, p: &Plan, reader: FlakyReader, io_threads: usize) -> TieredStore {
    let (g, l) = load_weights(&fx.file, &fx.config).unwrap();
    TieredStore::new(
        &fx.file,
        g,
        l,
        p,
        Arc::new(reader),
        TieredOptions {
            io_threads,
            ..TieredOptions::default()
        },
    )
    .unwrap()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    #[test]
    fn exact_bytes_in_any_order_under_random_delays(
        n_layers in 1usize..7,
        tier_picks in prop::collection::vec(0u8..3, 7),
        separate_device in any::<bool>(),
        slots in 1usize..4,
        io_threads in 1usize..3,
        order in prop::collection::vec(0usize..7, 1..40),
        hold in prop::collection::vec(0usize..3, 40),
        seed in 0u64..1000,
    ) {
        let fx = fixture(n_layers, 7);
        // Without a separate device there is no RAM tier.
        let tiers: Vec<Tier> = tier_picks[..n_layers]
            .iter()
            .map(|t| match t {
                0 => Tier::Device,
                1 if separate_device => Tier::Ram,
                _ => Tier::Disk,
            })
            .collect();
        let p = if separate_device {
            plan_with_device(&fx, tiers, slots)
        } else {
            plan_with(&fx, tiers, slots)
        };
        let s = store(&fx, &p, FlakyReader::new(fx.bytes.clone(), seed, 400), io_threads);
        let (_, expected) = load_weights(&fx.file, &fx.config).unwrap();
        let expected: Vec<u64> = expected.iter().map(layer_checksum).collect();
        // Hold some earlier layers while asking for the next, fewer than the slots.
        let mut held: Vec<Arc<LayerWeights>> = Vec::new();
        for (k, &i) in order.iter().enumerate() {
            let i = i % n_layers;
            let keep = hold[k % hold.len()].min(slots - 1);
            while held.len() > keep {
                held.remove(0);
            }
            let l = s.layer(PassId(k as u64), i).unwrap();
            prop_assert_eq!(l.index, i);
            prop_assert_eq!(layer_checksum(&l), expected[i], "layer {}", i);
            // A device backend may cache only what stays put on the device tier.
            let cacheable = l.matrix("attn_q.weight").unwrap().bytes.cache_on_device();
            prop_assert_eq!(
                cacheable,
                p.tiers[i] == Tier::Device,
                "layer {} on {:?}",
                i,
                p.tiers[i]
            );
            held.push(l);
        }
        drop(held);
        let stats = s.stats();
        let streamed_asks = order.iter().filter(|&&i| p.tiers[i % n_layers] == Tier::Disk).count();
        prop_assert!(stats.disk_reads as usize >= streamed_asks.min(1));
    }
}

/// Prefill, then three decode steps (several passes through the ring): the logits.
fn run_passes(fx: &Fixture, store: Box<dyn WeightStore>, backend: Arc<dyn Backend>) -> Vec<f32> {
    common::passes_logits(&fx.config, store, backend)
}

#[test]
fn same_logits_as_the_resident_store_in_every_mode() {
    let fx = fixture(6, 3);
    let run = |store: Box<dyn WeightStore>| run_passes(&fx, store, Arc::new(CpuBackend::new(1)));
    let (g, l) = load_weights(&fx.file, &fx.config).unwrap();
    let reference = run(Box::new(ResidentStore::new(g, l, false)));
    let modes: [(&str, Vec<Tier>, usize); 4] = [
        ("all resident", vec![Tier::Device; 6], 2),
        ("all streamed", vec![Tier::Disk; 6], 2),
        ("all streamed, the head on disk", vec![Tier::Disk; 6], 2),
        (
            "mixed, one slot",
            vec![
                Tier::Device,
                Tier::Disk,
                Tier::Device,
                Tier::Disk,
                Tier::Disk,
                Tier::Device,
            ],
            1,
        ),
    ];
    for (name, tiers, slots) in modes {
        let mut p = plan_with(&fx, tiers, slots);
        p.head_on_disk = name.contains("head on disk");
        let s = store(&fx, &p, FlakyReader::new(fx.bytes.clone(), 5, 200), 1);
        let held = s.held_bytes();
        if p.head_on_disk {
            assert!(
                held.disk > p.layer_bytes.iter().sum::<u64>(),
                "{name}: {held:?}"
            );
        }
        let got = run(Box::new(s));
        assert_eq!(
            got, reference,
            "{name}: logits differ from the resident store"
        );
    }
}

fn gpu() -> Option<Arc<GpuContext>> {
    ballast_runtime::testing::gpu_for_tests()
}

/// With a separate device (wgpu), layers on the device tier are uploaded once, RAM-tier
/// and disk-tier layers are uploaded per use through the backend's stream slots: the
/// logits equal the resident store's on the same backend bit for bit, in every mix,
/// and the backend uploads exactly the RAM and disk tiers' bytes per pass.
#[test]
fn same_logits_on_wgpu_with_device_ram_and_disk_tiers() {
    let Some(ctx) = gpu() else { return };
    let fx = fixture(6, 3);
    let (g, l) = load_weights(&fx.file, &fx.config).unwrap();
    let reference = run_passes(
        &fx,
        Box::new(ResidentStore::new(g, l, true)),
        Arc::new(WgpuBackend::new(ctx.clone())),
    );
    use Tier::{Device as A, Disk as C, Ram as B};
    let modes: [(&str, Vec<Tier>, usize, usize); 4] = [
        ("all on the device", vec![A; 6], 2, 2),
        ("all in RAM", vec![B; 6], 1, 2),
        ("all streamed from disk", vec![C; 6], 2, 1),
        ("mixed", vec![A, C, B, C, B, A], 2, 3),
    ];
    for (name, tiers, staging, device_slots) in modes {
        let p = plan_with_device(&fx, tiers.clone(), staging);
        let s = store(&fx, &p, FlakyReader::new(fx.bytes.clone(), 5, 200), 1);
        let backend = Arc::new(WgpuBackend::new(ctx.clone()));
        backend.set_stream_slots(device_slots);
        let got = run_passes(&fx, Box::new(s), backend.clone());
        assert!(
            got == reference,
            "{name}: logits differ from the resident store"
        );
        let uploaded: u64 = tiers
            .iter()
            .zip(&p.layer_bytes)
            .filter(|(t, _)| **t != A)
            .map(|(_, b)| b - 2 * 4 * fx.config.d_model as u64)
            .sum();
        let report = backend.last_pass().unwrap();
        assert_eq!(
            report.bytes_uploaded, uploaded,
            "{name}: bytes uploaded per pass"
        );
    }
}

#[test]
fn streamed_bytes_read_match_the_non_resident_bytes() {
    let fx = fixture(8, 4);
    let tiers: Vec<Tier> = (0..8)
        .map(|i| if i % 2 == 1 { Tier::Disk } else { Tier::Device })
        .collect();
    let p = plan_with(&fx, tiers.clone(), 2);
    let s = store(&fx, &p, FlakyReader::new(fx.bytes.clone(), 1, 0), 1);
    for pass in 0..5u64 {
        for i in 0..8 {
            drop(s.layer(PassId(pass), i).unwrap());
        }
    }
    let non_resident: u64 = (0..8)
        .filter(|&i| tiers[i] == Tier::Disk)
        .map(|i| p.layer_bytes[i])
        .sum();
    let per_pass = s.stats().disk_bytes as f64 / 5.0;
    // Aligned reads cost at most two extra blocks per layer (plus the prefetch of the
    // next pass's first layers, here at most the two slots).
    let slack = (4 * 2 * 4096 + 2 * p.device_slot_bytes.min(1 << 20)) as f64;
    assert!(
        per_pass >= non_resident as f64,
        "{per_pass} < {non_resident}"
    );
    assert!(
        per_pass <= non_resident as f64 + slack / 5.0 + 2.0 * 8192.0,
        "{per_pass} vs {non_resident}"
    );
    assert_eq!(s.stats().evictions, 0, "in-order access never evicts");
}

#[test]
fn read_errors_name_the_layer_and_the_file() {
    let fx = fixture(3, 5);
    let p = plan_with(&fx, vec![Tier::Device, Tier::Device, Tier::Disk], 2);
    let start_of_last = fx
        .file
        .tensor("blk.2.attn_q.weight")
        .unwrap()
        .offset
        .min(fx.file.tensor("blk.2.ffn_down.weight").unwrap().offset);
    // An I/O error inside layer 2.
    let mut r = FlakyReader::new(fx.bytes.clone(), 1, 0);
    r.split_reads = false;
    r.fail_at = Some(fx.bytes.len() as u64 - 1);
    let s = store(&fx, &p, r, 1);
    let e = s.layer(PassId(0), 2).unwrap_err().to_string();
    assert!(
        e.contains("layer 2") && e.contains("/models/flaky.gguf") && e.contains("injected"),
        "{e}"
    );
    // A file that ends inside layer 2.
    let mut r = FlakyReader::new(fx.bytes.clone(), 1, 0);
    r.truncate_at = Some(start_of_last + 100);
    let s = store(&fx, &p, r, 1);
    let e = s.layer(PassId(0), 2).unwrap_err().to_string();
    assert!(
        e.contains("short read") && e.contains("layer 2") && e.contains("/models/flaky.gguf"),
        "{e}"
    );
    // The failure is reported, not cached forever: the other layers still answer.
    assert!(s.layer(PassId(1), 0).is_ok());
}

#[test]
fn resident_layers_that_cannot_be_read_fail_at_open() {
    let fx = fixture(2, 6);
    let p = plan_with(&fx, vec![Tier::Device, Tier::Device], 2);
    let (g, l) = load_weights(&fx.file, &fx.config).unwrap();
    let mut r = FlakyReader::new(fx.bytes.clone(), 1, 0);
    r.truncate_at = Some(fx.bytes.len() as u64 / 2);
    let e = TieredStore::new(&fx.file, g, l, &p, Arc::new(r), TieredOptions::default())
        .unwrap_err()
        .to_string();
    assert!(e.contains("short read") && e.contains("flaky.gguf"), "{e}");
}

#[test]
fn holding_every_slot_and_asking_for_more_is_an_error_not_a_hang() {
    let fx = fixture(3, 8);
    let p = plan_with(&fx, vec![Tier::Disk; 3], 2);
    let s = store(&fx, &p, FlakyReader::new(fx.bytes.clone(), 1, 0), 1);
    let a = s.layer(PassId(0), 0).unwrap();
    let b = s.layer(PassId(0), 1).unwrap();
    let e = s.layer(PassId(0), 2).unwrap_err().to_string();
    assert!(e.contains("slots are held"), "{e}");
    drop((a, b));
    assert_eq!(s.layer(PassId(0), 2).unwrap().index, 2);
}

#[test]
fn held_bytes_fit_the_planned_budget() {
    let fx = fixture(10, 9);
    let (g, l) = load_weights(&fx.file, &fx.config).unwrap();
    let shape = model_shape(&fx.config, &g, &l);
    let total: u64 = shape.layer_bytes.iter().sum();
    let budget = total / 2 + shape.head_bytes + (9 << 20);
    let p = plan(&PlanRequest {
        shape,
        budgets: Budgets {
            device: None,
            ram: budget,
        },
        ctx: 64,
        batch: 8,
        depth: 2,
        ram_tier: RamTier::Raw,
    })
    .unwrap();
    let (_, _, c) = p.counts();
    assert!(c > 0, "the budget streams some layers");
    let s = TieredStore::new(
        &fx.file,
        g,
        l,
        &p,
        Arc::new(FlakyReader::new(fx.bytes.clone(), 1, 0)),
        TieredOptions::default(),
    )
    .unwrap();
    let held = s.held_bytes();
    assert!(
        held.device + p.device_reserve.total() <= budget,
        "{} + {} > {budget}",
        held.device,
        p.device_reserve.total()
    );
    let streamed: u64 = (0..10)
        .filter(|&i| p.tiers[i] == Tier::Disk)
        .map(|i| p.layer_bytes[i])
        .sum();
    assert_eq!(held.disk, streamed);
}

/// A store that fails for one layer once it has been asked `ok_asks` times.
struct FailingStore {
    inner: ResidentStore,
    layer: usize,
    ok_asks: usize,
    asks: std::sync::atomic::AtomicUsize,
}

impl WeightStore for FailingStore {
    fn n_layers(&self) -> usize {
        self.inner.n_layers()
    }
    fn globals(&self) -> &ballast_runtime::weights::GlobalWeights {
        self.inner.globals()
    }
    fn layer(&self, pass: PassId, index: usize) -> ballast_runtime::Result<Arc<LayerWeights>> {
        if index == self.layer && self.asks.fetch_add(1, Ordering::SeqCst) >= self.ok_asks {
            return Err(ballast_runtime::Error::InvalidArgument {
                what: format!("layer {index} is gone"),
            });
        }
        self.inner.layer(pass, index)
    }
    fn held_bytes(&self) -> ballast_runtime::TierBytes {
        self.inner.held_bytes()
    }
}

/// Stacked over another store (here the resident store of the same model): the same
/// logits as that store alone, with layers kept and streamed, the streamed ones fetched
/// from the store beneath per use (and a little ahead); an error of the store beneath
/// reaches the forward pass as an error, not a hang.
#[test]
fn over_another_store_gives_that_stores_logits() {
    let fx = fixture(6, 3);
    let resident = || {
        let (g, l) = load_weights(&fx.file, &fx.config).unwrap();
        ResidentStore::new(g, l, false)
    };
    let cpu = || -> Arc<dyn Backend> { Arc::new(CpuBackend::new(1)) };
    let reference = run_passes(&fx, Box::new(resident()), cpu());
    use Tier::{Device as A, Disk as C};
    for (tiers, slots) in [
        (vec![A; 6], 2),
        (vec![C; 6], 2),
        (vec![A, C, A, C, C, A], 1),
    ] {
        let p = plan_with(&fx, tiers.clone(), slots);
        let s = TieredStore::over_store(
            Arc::new(resident()),
            &p,
            TieredOptions {
                io_threads: 2,
                ..TieredOptions::default()
            },
        )
        .unwrap();
        let stats = s.stats_handle();
        let got = run_passes(&fx, Box::new(s), cpu());
        assert!(
            got == reference,
            "{tiers:?}: logits differ from the store beneath"
        );
        let streamed: u64 = (0..6)
            .filter(|&i| tiers[i] == C)
            .map(|i| p.layer_bytes[i] - 2 * 4 * fx.config.d_model as u64)
            .sum();
        let fetched = stats.get().disk_bytes;
        let ahead = slots as u64 * p.layer_bytes.iter().max().unwrap();
        assert!(
            fetched >= 4 * streamed && fetched <= 4 * streamed + ahead,
            "{tiers:?}: {fetched} bytes fetched for 4 passes over {streamed} streamed bytes"
        );
    }

    let failing = FailingStore {
        inner: resident(),
        layer: 4,
        ok_asks: 2,
        asks: Default::default(),
    };
    let p = plan_with(&fx, vec![C; 6], 2);
    let s = TieredStore::over_store(Arc::new(failing), &p, TieredOptions::default()).unwrap();
    let mut model = Model::from_parts(
        fx.config.clone(),
        Box::new(s),
        cpu(),
        Box::new(DenseFfn::new()),
    );
    let mut kv = DenseKv::new(model.kv_shape(), 64);
    let err = (0..4u32)
        .find_map(|t| model.forward(&[t], &[t], &mut kv, None, Logits::Last).err())
        .expect("the store beneath fails for layer 4");
    assert!(err.to_string().contains("layer 4 is gone"), "{err}");
}

/// With a separate device, the store counts on the device what the backend will hold
/// there for it: the device-tier layers, the head and, when the model has an output
/// head of its own, the whole embedding table (the wgpu backend looks tokens up on the
/// device).
#[test]
fn a_separate_device_holds_the_device_tier_the_head_and_an_untied_embedding() {
    for tied in [true, false] {
        let spec = TinyModelSpec {
            n_layers: 4,
            d_model: 128,
            n_ff: 256,
            tied,
            ..TinyModelSpec::default()
        };
        let bytes = spec.to_gguf_bytes().unwrap();
        let file = Arc::new(GgufFile::from_bytes(bytes.clone()).unwrap());
        let config = ModelConfig::from_gguf(&file).unwrap();
        let fx = Fixture {
            bytes: Arc::new(bytes),
            file,
            config,
        };
        use Tier::{Device as A, Disk as C, Ram as B};
        let p = plan_with_device(&fx, vec![A, B, C, A], 2);
        let s = store(&fx, &p, FlakyReader::new(fx.bytes.clone(), 1, 0), 1);
        let (g, _) = load_weights(&fx.file, &fx.config).unwrap();
        let mut want = p.layer_bytes[0]
            + p.layer_bytes[3]
            + g.output().bytes.len() as u64
            + g.output_norm().len() as u64 * 4;
        if !tied {
            want += g.token_embd().bytes.len() as u64;
        }
        assert_eq!(s.held_bytes().device, want, "tied {tied}");
    }
}

/// A mixture of experts streamed on the CPU: each decode step reads, per streamed
/// layer, only the experts its token chose (two of eight, three matrices each), and the
/// logits equal the resident store's; with an expert cache, repeated choices are not
/// read again; with `whole_experts`, the layers are read whole and no expert alone.
#[test]
fn a_streamed_moe_layer_reads_only_the_chosen_experts() {
    let spec = TinyModelSpec {
        arch: "qwen3moe".into(),
        n_layers: 3,
        d_model: 128,
        head_dim: Some(32),
        n_ff: 256,
        experts: Some((8, 2, 64)),
        seed: 21,
        ..TinyModelSpec::default()
    };
    let bytes = spec.to_gguf_bytes().unwrap();
    let file = Arc::new(GgufFile::from_bytes(bytes.clone()).unwrap());
    let config = ModelConfig::from_gguf(&file).unwrap();
    let fx = Fixture {
        bytes: Arc::new(bytes),
        file,
        config,
    };
    let ids = [10u32, 200, 33, 7, 99];
    // Prefill, then decode steps; the logits, and the stats after the prefill and at
    // the end.
    let run = |store: Box<dyn WeightStore>, stats: Option<ballast_tier_stream::StatsHandle>| {
        let config = fx.config.clone();
        let ffn = ballast_runtime::ffn::for_config(&config);
        let mut model = Model::from_parts(config, store, Arc::new(CpuBackend::new(1)), ffn);
        let mut kv = DenseKv::new(model.kv_shape(), 64);
        let pos: Vec<u32> = (0..ids.len() as u32).collect();
        let mut out = model
            .forward(&ids, &pos, &mut kv, None, Logits::Last)
            .unwrap()
            .to_vec();
        let after_prefill = stats.as_ref().map(|s| s.get());
        for step in 0..4u32 {
            let p = ids.len() as u32 + step;
            let next = ballast_runtime::sampler::argmax(&out[out.len() - 257..]);
            out.extend_from_slice(
                model
                    .forward(&[next], &[p], &mut kv, None, Logits::Last)
                    .unwrap(),
            );
        }
        (out, after_prefill, stats.map(|s| s.get()))
    };
    let (g, l) = load_weights(&fx.file, &fx.config).unwrap();
    let shape = model_shape(&fx.config, &g, &l);
    assert!(shape.expert_bytes.iter().all(|&b| b > 0));
    assert_eq!(shape.expert_share, 0.25);
    let (reference, _, _) = run(Box::new(ResidentStore::new(g, l, false)), None);
    for (whole, cache) in [(false, 0u64), (false, 1 << 30), (true, 0)] {
        let p = plan_with(&fx, vec![Tier::Disk; 3], 2);
        let (g, l) = load_weights(&fx.file, &fx.config).unwrap();
        let store = TieredStore::new(
            &fx.file,
            g,
            l,
            &p,
            Arc::new(FlakyReader::new(fx.bytes.clone(), 3, 100)),
            TieredOptions {
                io_threads: 1,
                whole_experts: whole,
                expert_cache_bytes: cache,
            },
        )
        .unwrap();
        let stats = store.stats_handle();
        let (got, prefill, end) = run(Box::new(store), Some(stats));
        let what = format!("whole experts {whole}, cache {cache}");
        assert_eq!(got, reference, "{what}: logits");
        let (prefill, end) = (prefill.unwrap().experts, end.unwrap().experts);
        if whole {
            assert_eq!(end.reads + end.hits, 0, "{what}");
            continue;
        }
        // Four decode steps: 3 layers x 3 matrices x 2 experts each, read or cached.
        let step_uses = (end.reads + end.hits) - (prefill.reads + prefill.hits);
        assert_eq!(step_uses, 4 * 3 * 3 * 2, "{what}");
        // Every use counts the matrix's own bytes as chosen; misses also as missed.
        let each = shape.expert_bytes[0] / (3 * 8);
        assert_eq!(end.chosen, (end.reads + end.hits) * each, "{what}");
        assert_eq!(end.missed, end.reads * each, "{what}");
        assert!(
            end.bytes >= end.missed,
            "{what}: aligned reads cover the missed bytes"
        );
        if cache == 0 {
            assert_eq!(end.hits, 0, "{what}");
        } else {
            // The prefill read at most every expert once; later uses hit.
            assert!(end.reads <= 3 * 3 * 8, "{what}: {end:?}");
            assert!(end.hits > 0, "{what}: {end:?}");
        }
    }
}
