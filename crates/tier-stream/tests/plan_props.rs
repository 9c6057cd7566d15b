//! The planner's promises, for any layer sizes, budgets and reserves: it never assigns
//! a tier more than its budget, it assigns every layer, and when it refuses, the error
//! says how much is needed (and that is more than the budget).

use ballast_tier_stream::plan::{align_up, slot_bytes, spread};
use ballast_tier_stream::{
    largest_context, plan, Budgets, Error, ModelShape, PlanRequest, RamTier, Reserve, Speeds, Tier,
};
use proptest::prelude::*;

fn shape(layers: Vec<u64>, head: u64, kv_dim: u64) -> ModelShape {
    ModelShape {
        layer_bytes: layers,
        head_bytes: head,
        embd_row_bytes: 64,
        d_model: 64,
        q_dim: 64,
        kv_dim,
        n_ff: 128,
        vocab: 1000,
        kv_value_bytes: 4,
        kv_on_device_only: false,
        expert_bytes: Vec::new(),
        expert_share: 1.0,
        stored_bytes: Vec::new(),
        decode_bytes_per_s: 0.0,
        decode_readers: 1,
        kv_windows: Vec::new(),
    }
}

fn budgets() -> impl Strategy<Value = Budgets> {
    (
        prop::option::of(0u64..(1u64 << 34)),
        0u64..(1u64 << 34),
        prop::bool::ANY,
    )
        .prop_map(|(device, ram, huge)| Budgets {
            device: if huge {
                device.map(|d| d.saturating_mul(1 << 20))
            } else {
                device
            },
            ram,
        })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn never_over_budget_and_every_layer_placed(
        layers in prop::collection::vec(0u64..(1u64 << 30), 0..96),
        head in 0u64..(1u64 << 30),
        kv_dim in 0u64..4096,
        ctx in 0u64..100_000,
        batch in 0u64..1024,
        depth in 0usize..6,
        budgets in budgets(),
    ) {
        let req = PlanRequest { shape: shape(layers.clone(), head, kv_dim), budgets, ctx, batch, depth, ram_tier: RamTier::Raw };
        match plan(&req) {
            Ok(p) => {
                prop_assert_eq!(p.tiers.len(), layers.len());
                let device_budget = budgets.device.unwrap_or(budgets.ram);
                prop_assert!(p.device_used() <= device_budget,
                    "device used {} > budget {}", p.device_used(), device_budget);
                if budgets.device.is_some() {
                    prop_assert!(p.ram_used() <= budgets.ram, "ram used {} > budget {}", p.ram_used(), budgets.ram);
                } else {
                    prop_assert!(!p.tiers.contains(&Tier::Ram), "unified plans have no RAM tier");
                }
                // Slots hold the largest streamed layer.
                for (i, &t) in p.tiers.iter().enumerate() {
                    if t != Tier::Device {
                        prop_assert!(p.device_slots >= 1);
                        prop_assert!(align_up(layers[i]) <= p.device_slot_bytes);
                    }
                    if t == Tier::Disk && budgets.device.is_some() {
                        prop_assert!(p.staging_slots >= 1);
                        prop_assert!(align_up(layers[i]) <= p.staging_slot_bytes);
                    }
                }
                prop_assert!(p.device_slots <= depth.max(1));
                let bpt = p.bytes_per_token();
                let total: u64 = layers.iter().fold(0u64, |a, &b| a.saturating_add(b));
                prop_assert_eq!(
                    p.tier_bytes(Tier::Device).saturating_add(p.tier_bytes(Tier::Ram)).saturating_add(p.tier_bytes(Tier::Disk)),
                    total
                );
                prop_assert!(bpt.disk >= p.tier_bytes(Tier::Disk));
                if p.head_on_disk {
                    // Only on the CPU, only when the head would leave no room for a slot,
                    // and then every token reads it.
                    prop_assert!(budgets.device.is_none());
                    let max_slot = layers.iter().map(|&b| slot_bytes(b)).max().unwrap_or(0);
                    prop_assert!(p.device_reserve.total().saturating_add(head).saturating_add(max_slot) > budgets.ram);
                    prop_assert_eq!(bpt.disk, p.tier_bytes(Tier::Disk) + 64 + head);
                }
            }
            Err(Error::BudgetTooSmall { needed, budget, .. }) => {
                prop_assert!(needed > budget, "refused although {needed} <= {budget}");
            }
            Err(e) => prop_assert!(false, "unexpected error {e}"),
        }
    }

    #[test]
    fn prediction_is_at_least_every_resource_busy_time(
        layers in prop::collection::vec(1u64..(1u64 << 28), 1..40),
        ram in (1u64 << 26)..(1u64 << 33),
        device in prop::option::of((1u64 << 26)..(1u64 << 33)),
        depth in 1usize..4,
        compute in 1e8f64..1e12,
        disk in 1e7f64..1e10,
        h2d in 1e8f64..1e11,
    ) {
        let req = PlanRequest { shape: shape(layers, 1 << 20, 256), budgets: Budgets { device, ram }, ctx: 256, batch: 1, depth, ram_tier: RamTier::Raw };
        if let Ok(p) = plan(&req) {
            let pr = p.predict(&Speeds { compute_bytes_per_s: compute, h2d_bytes_per_s: h2d, disk_bytes_per_s: disk }, 128);
            let bound = pr.compute_s.max(pr.disk_s).max(pr.h2d_s);
            prop_assert!(pr.seconds_per_token >= bound * (1.0 - 1e-9), "{} < {}", pr.seconds_per_token, bound);
            // Never worse than doing everything one after the other.
            prop_assert!(pr.seconds_per_token <= (pr.compute_s + pr.disk_s + pr.h2d_s) * (1.0 + 1e-9));
        }
    }

    #[test]
    fn the_largest_context_fits_and_one_more_token_does_not(
        layers in prop::collection::vec(1u64..(1u64 << 24), 1..32),
        head in 0u64..(1u64 << 24),
        kv_dim in 1u64..2048,
        ctx in 1u64..100_000,
        batch in 1u64..512,
        depth in 1usize..4,
        ram in 0u64..(1u64 << 31),
    ) {
        let req = PlanRequest { shape: shape(layers, head, kv_dim), budgets: Budgets { device: None, ram }, ctx, batch, depth, ram_tier: RamTier::Raw };
        let at = |ctx: u64| plan(&PlanRequest { ctx, batch: batch.min(ctx), ..req.clone() });
        match largest_context(&req) {
            Some(fits) => {
                prop_assert!(fits >= 1 && fits <= ctx);
                prop_assert!(at(fits).is_ok(), "{fits} tokens were said to fit");
                if fits < ctx {
                    prop_assert!(at(fits + 1).is_err(), "{} tokens fit too", fits + 1);
                }
            }
            None => prop_assert!(at(1).is_err(), "one token fits"),
        }
    }

    #[test]
    fn spread_picks_distinct_layers(n in 0usize..200, k in 0usize..200) {
        let s = spread(n, k);
        prop_assert_eq!(s.len(), k.min(n));
        prop_assert!(s.windows(2).all(|w| w[0] < w[1]));
        prop_assert!(s.iter().all(|&i| i < n));
    }
}

#[test]
fn too_small_says_how_much_is_needed() {
    let req = PlanRequest {
        shape: shape(vec![100 << 20; 4], 10 << 20, 256),
        budgets: Budgets {
            device: None,
            ram: 50 << 20,
        },
        ctx: 512,
        batch: 1,
        depth: 2,
        ram_tier: RamTier::Raw,
    };
    let e = plan(&req).unwrap_err();
    let msg = e.to_string();
    assert!(
        msg.contains("too small") && msg.contains("one slot"),
        "{msg}"
    );
    match e {
        Error::BudgetTooSmall { needed, .. } => assert!(needed > 100 << 20),
        other => panic!("{other}"),
    }
}

#[test]
fn a_head_too_big_for_the_budget_stays_on_disk() {
    // SmolLM2's proportions: 30 layers of 2 MiB, a 29 MiB head, a 28 MiB budget.
    let shape = shape(vec![2 << 20; 30], 29 << 20, 192);
    let req = |ram| PlanRequest {
        shape: shape.clone(),
        budgets: Budgets { device: None, ram },
        ctx: 320,
        batch: 8,
        depth: 3,
        ram_tier: RamTier::Raw,
    };
    let p = plan(&req(28 << 20)).unwrap();
    assert!(p.head_on_disk);
    assert!(p.device_used() <= 28 << 20);
    let bpt = p.bytes_per_token();
    assert_eq!(bpt.disk, p.tier_bytes(Tier::Disk) + 64 + (29 << 20));
    assert_eq!(bpt.device, p.tier_bytes(Tier::Device));
    let speeds = Speeds {
        compute_bytes_per_s: 20e9,
        h2d_bytes_per_s: 13e9,
        disk_bytes_per_s: 1e9,
    };
    let pr = p.predict(&speeds, 64);
    assert!(pr.disk_s >= bpt.disk as f64 / 1e9 - 1e-3, "{pr:?}");
    // With room for it, the head stays in RAM.
    let p = plan(&req(128 << 20)).unwrap();
    assert!(!p.head_on_disk);
    // On a separate device the head must fit: no mapped fallback there.
    let e = plan(&PlanRequest {
        budgets: Budgets {
            device: Some(28 << 20),
            ram: 1 << 30,
        },
        ..req(0)
    })
    .unwrap_err();
    assert!(e.to_string().contains("output head"), "{e}");
}

#[test]
fn half_the_ram_streams_about_half_the_layers_spread_out() {
    let layers = vec![3 << 20; 30];
    let total: u64 = layers.iter().sum();
    let shape = shape(layers, 28 << 20, 192);
    // Half the layers, the head and the reserve at this budget (the margin grows with
    // the budget, so ask with a first guess and then add its margin).
    let guess = total / 2 + (28 << 20);
    let reserve = Reserve::for_context(&shape, 256, 32, guess).total();
    let req = PlanRequest {
        shape,
        budgets: Budgets {
            device: None,
            ram: guess + reserve + Reserve::margin_for(guess + reserve)
                - Reserve::margin_for(guess),
        },
        ctx: 256,
        batch: 32,
        depth: 2,
        ram_tier: RamTier::Raw,
    };
    let p = plan(&req).unwrap();
    let (a, b, c) = p.counts();
    assert_eq!(b, 0);
    // Two slots of one layer each come out of the resident half.
    assert!((15..=18).contains(&c), "{a} resident, {c} streamed");
    // Spread: no two streamed layers are adjacent when fewer than half stream.
    let streamed: Vec<usize> = (0..30).filter(|&i| p.tiers[i] == Tier::Disk).collect();
    let longest_run = streamed
        .windows(2)
        .fold((1, 1), |(best, run), w| {
            let run = if w[1] == w[0] + 1 { run + 1 } else { 1 };
            (best.max(run), run)
        })
        .0;
    assert!(longest_run <= 2, "streamed layers bunch up: {streamed:?}");
}

#[test]
fn seed_machine_is_bound_by_pcie() {
    let shape = ModelShape::from_dims(80, 8192, 64, 8, 28672, 128256, 6.5625, 6.5625);
    for ctx in [512, 4096] {
        let p = plan(&PlanRequest {
            shape: shape.clone(),
            budgets: Budgets {
                device: Some(24 << 30),
                ram: 48 << 30,
            },
            ctx,
            batch: 1,
            depth: 2,
            ram_tier: RamTier::Raw,
        })
        .unwrap();
        let pr = p.predict(
            &Speeds {
                compute_bytes_per_s: 936e9,
                h2d_bytes_per_s: 6.5e9,
                disk_bytes_per_s: 3e9,
            },
            ctx,
        );
        assert_eq!(pr.bottleneck.name(), "PCIe (host to device)");
        assert!(pr.tokens_per_s() > 0.1 && pr.tokens_per_s() < 0.5);
    }
}

// A layer whose cache keeps only its window reserves the window plus one prompt chunk,
// not the context, and its attention costs at most the window.
#[test]
fn windowed_layers_reserve_and_read_only_their_window() {
    let mut windowed = shape(vec![1 << 20; 3], 1 << 20, 256);
    windowed.kv_windows = vec![Some(512), None, Some(512)];
    let full = shape(vec![1 << 20; 3], 1 << 20, 256);
    let per_token = full.kv_bytes_per_token_layer();
    assert_eq!(full.kv_bytes(8192, 64), 3 * 8192 * per_token);
    assert_eq!(
        windowed.kv_bytes(8192, 64),
        (8192 + 2 * (511 + 64)) * per_token
    );
    // A context shorter than the window: every token, as a full cache.
    assert_eq!(windowed.kv_bytes(100, 64), full.kv_bytes(100, 64));
    let request = |shape: ModelShape| PlanRequest {
        shape,
        budgets: Budgets {
            device: None,
            ram: 1 << 30,
        },
        ctx: 8192,
        batch: 64,
        depth: 2,
        ram_tier: RamTier::Raw,
    };
    let (w, f) = (
        plan(&request(windowed)).unwrap(),
        plan(&request(full)).unwrap(),
    );
    assert!(w.device_reserve.kv < f.device_reserve.kv);
    let speeds = Speeds {
        compute_bytes_per_s: 1e9,
        h2d_bytes_per_s: 1e9,
        disk_bytes_per_s: 1e9,
    };
    let (pw, pf) = (w.predict(&speeds, 8000), f.predict(&speeds, 8000));
    let saved = (pf.compute_s - pw.compute_s) * 1e9;
    let expected = (2 * (8000 - 512) * per_token) as f64;
    assert!((saved - expected).abs() < 1.0, "{saved} vs {expected}");
}

/// `layers` with a stored (coded) size of each at most its raw size, as a pack gives.
fn coded_shape(layers: Vec<(u64, u64)>, head: u64) -> ModelShape {
    let mut s = shape(layers.iter().map(|&(raw, _)| raw).collect(), head, 64);
    s.stored_bytes = layers.iter().map(|&(raw, pct)| raw / 100 * pct).collect();
    s.decode_bytes_per_s = 600e6;
    s
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// A CPU plan over a store with a coded form: under each RAM-tier form the layers,
    /// the coded RAM tier counted at its stored sizes, the slots, the head and the
    /// reserve fit the budget; `Coded` decodes nothing in place; `RawThenCoded` holds
    /// at least as many layers in RAM as `Raw`, with no more disk bytes and no more
    /// decodes per token.
    #[test]
    fn a_coded_ram_tier_counts_stored_sizes_and_fits_the_budget(
        layers in prop::collection::vec((1u64..(64u64 << 20), 50u64..=100), 1..48),
        head in 0u64..(16u64 << 20),
        ram in 0u64..(2u64 << 30),
        depth in 1usize..4,
    ) {
        let request = |ram_tier| PlanRequest {
            shape: coded_shape(layers.clone(), head),
            budgets: Budgets { device: None, ram },
            ctx: 256,
            batch: 8,
            depth,
            ram_tier,
        };
        let raw = plan(&request(RamTier::Raw));
        for ram_tier in [RamTier::Raw, RamTier::Coded, RamTier::RawThenCoded] {
            let Ok(p) = plan(&request(ram_tier)) else { continue };
            prop_assert!(p.device_used() <= ram, "{ram_tier:?}: used {} > budget {ram}", p.device_used());
            let held: u64 = (0..layers.len())
                .filter(|&i| p.tiers[i] == Tier::Ram)
                .map(|i| layers[i].0 / 100 * layers[i].1)
                .sum();
            prop_assert_eq!(p.tier_bytes(Tier::Ram), held);
            prop_assert_eq!(p.ram_coded, ram_tier != RamTier::Raw);
            for (i, &t) in p.tiers.iter().enumerate() {
                if t != Tier::Device {
                    prop_assert!(align_up(layers[i].0) <= p.device_slot_bytes);
                }
            }
            match ram_tier {
                RamTier::Raw => prop_assert!(!p.tiers.contains(&Tier::Ram)),
                RamTier::Coded => prop_assert!(!p.tiers.contains(&Tier::Device)),
                RamTier::RawThenCoded => {
                    let raw = raw.as_ref().expect("raw plans whenever raw-then-coded does");
                    let (a, b, _) = p.counts();
                    let (ra, _, _) = raw.counts();
                    prop_assert_eq!(a, ra, "the decoded layers are raw's");
                    prop_assert!(p.bytes_per_token().disk <= raw.bytes_per_token().disk);
                    prop_assert!(p.decodes_per_token() <= raw.decodes_per_token());
                    prop_assert!(a + b >= ra);
                }
            }
        }
    }
}

/// Room for two coded layers beside the resident ones: raw-then-coded holds them coded
/// and reads two fewer layers from disk; coded holds every layer coded.
#[test]
fn the_room_left_holds_streamed_layers_coded() {
    let mb = 1u64 << 20;
    let layers = vec![(10 * mb, 40); 10];
    let stored = 10 * mb / 100 * 40;
    let request = |ram_tier, ram| PlanRequest {
        shape: coded_shape(layers.clone(), mb),
        budgets: Budgets { device: None, ram },
        ctx: 16,
        batch: 1,
        depth: 2,
        ram_tier,
    };
    // Beside the reserve, the head and two slots: 5 raw layers and 9 MiB, room for two
    // coded layers of 4 MiB but not for a sixth raw one.
    let probe = plan(&request(RamTier::Raw, 1 << 30)).unwrap();
    let fixed = probe.device_reserve.total() - probe.device_reserve.margin + mb;
    let want_avail = 50 * mb + 2 * slot_bytes(10 * mb) + 9 * mb;
    // The margin grows with the budget: find the smallest budget that leaves it.
    let mut ram = fixed + want_avail;
    while Reserve::margin_for(ram) + fixed + want_avail > ram {
        ram += 1 << 12;
    }
    let raw = plan(&request(RamTier::Raw, ram)).unwrap();
    assert_eq!(raw.counts(), (5, 0, 5), "{:?}", raw.tiers);
    let mixed = plan(&request(RamTier::RawThenCoded, ram)).unwrap();
    assert_eq!(mixed.counts(), (5, 2, 3), "{:?}", mixed.tiers);
    assert_eq!(mixed.tier_bytes(Tier::Ram), 2 * stored);
    assert_eq!(
        raw.bytes_per_token().disk - mixed.bytes_per_token().disk,
        2 * stored
    );
    assert_eq!(mixed.decodes_per_token(), raw.decodes_per_token());
    // Every layer coded: 10 x 4 MiB fit where 5 x 10 MiB + 9 MiB did.
    let coded = plan(&request(RamTier::Coded, ram)).unwrap();
    assert_eq!(coded.counts(), (0, 10, 0), "{:?}", coded.tiers);
    assert_eq!(coded.decodes_per_token(), 10);
    assert_eq!(
        coded.bytes_per_token().disk,
        raw.bytes_per_token().disk - 5 * stored
    );
}

/// A streamed layer of a pack is read and decoded piece by piece by its reader while
/// the other reader reads: with two readers and a decode faster than the disk, a token
/// takes the reads alone; with one reader, the reads and the decodes one after the
/// other; with a decode slower than the disk, the readers' share of both.
#[test]
fn two_readers_overlap_decoding_with_reads() {
    let mb = 1u64 << 20;
    let layers = vec![(100 * mb, 50); 8];
    let predict = |readers: usize, decode_bytes_per_s: f64| {
        let mut shape = coded_shape(layers.clone(), mb);
        shape.decode_readers = readers;
        shape.decode_bytes_per_s = decode_bytes_per_s;
        let p = plan(&PlanRequest {
            shape,
            budgets: Budgets {
                device: None,
                ram: 512 * mb,
            },
            ctx: 16,
            batch: 1,
            depth: 3,
            ram_tier: RamTier::Raw,
        })
        .unwrap();
        let streamed = p.tiers.iter().filter(|&&t| t == Tier::Disk).count() as f64;
        assert!(streamed >= 4.0, "{:?}", p.tiers);
        let speeds = Speeds {
            compute_bytes_per_s: 1e12,
            h2d_bytes_per_s: 0.0,
            disk_bytes_per_s: 200e6,
        };
        let read = (50 * mb) as f64 / 200e6;
        (p.predict(&speeds, 16).seconds_per_token, streamed, read)
    };
    // Decoding 100 MiB at 1 GB/s takes about half a read of 50 MiB at 200 MB/s.
    let (two, n, read) = predict(2, 1e9);
    let decode = (100 * mb) as f64 / 1e9;
    assert!(
        (two - n * read).abs() < 0.05 * n * read,
        "{two} vs reads {}",
        n * read
    );
    let (one, n, _) = predict(1, 1e9);
    assert!(
        (one - n * (read + decode)).abs() < 0.05 * n * (read + decode),
        "{one}"
    );
    // A decode at 100 MB/s is slower than the read: the two readers' share of both.
    let (slow, n, _) = predict(2, 100e6);
    let decode = (100 * mb) as f64 / 100e6;
    let want = n * (read + decode) / 2.0;
    assert!((slow - want).abs() < 0.05 * want, "{slow} vs {want}");
}
