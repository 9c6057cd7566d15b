//! [`Report`]: what an engine was built with (the device, the store, the budgets, the
//! plan of tiered streaming), and the plan as text.

use std::fmt;

use ballast_tier_stream::{Plan, Speeds, Tier};

use crate::size::{human_bytes, human_rate};
use crate::sparse::SparseCounters;
use crate::store::{RamBudget, TieredInfo};

/// What [`EngineBuilder::build`](crate::EngineBuilder::build) chose and planned. Its
/// [`Display`](fmt::Display) is the plan as the `ballast` command prints it: the
/// budgets and, when the layers stream, where each one lives.
#[derive(Clone)]
pub struct Report {
    /// What choosing the device said (the adapter, or why `auto` fell back to the CPU).
    pub device_notes: Vec<String>,
    /// The backend's name.
    pub backend: String,
    /// Threads the CPU computes with.
    pub threads: usize,
    /// The store: `mmap`, `ram`, `compressed`, `tiered` or `tiered over a pack`.
    pub store: &'static str,
    /// The context planned for, in tokens (all sequences together).
    pub planned_context: usize,
    /// The RAM budget the store was sized from, when one was (tiered streaming, or the
    /// automatic choice of a store).
    pub ram_budget: Option<RamBudget>,
    /// The GPU budget of tiered streaming on a GPU.
    pub vram_budget: Option<u64>,
    /// The sparse MLP's neuron cache, when the MLP streams out of core: its share of
    /// the RAM budget.
    pub neuron_cache: Option<u64>,
    /// The plan and counters of tiered streaming.
    pub tiered: Option<TieredInfo>,
    /// The counters of the compressed store, when the model is a pack.
    pub compressed: Option<ballast_weight_codec::store::StatsHandle>,
    /// The counters of the sparse MLP, when one is installed.
    pub sparse: Option<SparseCounters>,
}

impl Report {
    /// The plan of tiered streaming, when the layers stream.
    pub fn plan(&self) -> Option<&Plan> {
        self.tiered.as_ref().map(|t| &t.plan)
    }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let Some(budget) = &self.ram_budget else {
            return Ok(());
        };
        let Some(info) = &self.tiered else {
            return writeln!(
                f,
                "RAM budget {} ({}): the model and a context of {} tokens fit, {}",
                human_bytes(budget.bytes),
                budget.source,
                self.planned_context,
                self.store
            );
        };
        if let Some(d) = self.vram_budget {
            writeln!(f, "GPU budget {} (given)", human_bytes(d))?;
        }
        writeln!(
            f,
            "RAM budget {} ({})",
            human_bytes(budget.bytes),
            budget.source
        )?;
        if let Some(bytes) = self.neuron_cache {
            writeln!(
                f,
                "MLP up/down out of core: neuron cache {} of it, the rest planned for the other weights",
                human_bytes(bytes)
            )?;
        }
        write!(f, "{}", describe(&info.plan, None, None))?;
        writeln!(f, "disk reads: {}", info.read_mode)
    }
}

/// One letter per layer: `A` device (RAM on the CPU), `B` RAM, `C` disk.
pub fn layer_map(p: &Plan) -> String {
    p.tiers
        .iter()
        .map(|t| match t {
            Tier::Device => 'A',
            Tier::Ram => 'B',
            Tier::Disk => 'C',
        })
        .collect()
}

/// The plan as text: the split, the reserves, the bytes per tier per token, and (given
/// speeds) the prediction.
pub fn describe(p: &Plan, speeds: Option<(&Speeds, u64)>, notes: Option<&str>) -> String {
    use std::fmt::Write;
    let mut s = String::new();
    let (a, b, c) = p.counts();
    let dev = if p.unified {
        "A device (= RAM, CPU)"
    } else {
        "A device"
    };
    let _ = writeln!(s, "| tier | layers | bytes held | moved per token |");
    let _ = writeln!(s, "| --- | ---: | ---: | ---: |");
    let bpt = p.bytes_per_token();
    let _ = writeln!(
        s,
        "| {dev} | {a} | {} | read in place |",
        human_bytes(p.tier_bytes(Tier::Device))
    );
    if !p.unified {
        let _ = writeln!(
            s,
            "| B RAM | {b} | {} | {} uploaded (B and C) |",
            human_bytes(p.tier_bytes(Tier::Ram)),
            human_bytes(bpt.host_to_device)
        );
    }
    if p.unified && b > 0 {
        let raw: u64 = (0..p.tiers.len())
            .filter(|&i| p.tiers[i] == Tier::Ram)
            .map(|i| p.layer_bytes[i])
            .sum();
        let _ = writeln!(
            s,
            "| B RAM, coded | {b} | {} ({} decoded) | decoded in the readers |",
            human_bytes(p.tier_bytes(Tier::Ram)),
            human_bytes(raw)
        );
    }
    let _ = writeln!(
        s,
        "| C disk | {c} | {} | {} read |",
        human_bytes(p.tier_bytes(Tier::Disk)),
        human_bytes(bpt.disk)
    );
    let _ = writeln!(s, "layers: {}", layer_map(p));
    if !p.stored_bytes.is_empty() && p.counts().2 > 0 {
        let disk: Vec<usize> = (0..p.tiers.len())
            .filter(|&i| p.tiers[i] == Tier::Disk)
            .collect();
        let stored: u64 = disk.iter().map(|&i| p.stored_bytes[i]).sum();
        let raw: u64 = disk.iter().map(|&i| p.layer_bytes[i]).sum();
        let _ = writeln!(
            s,
            "pack: the streamed layers read {} compressed instead of {} ({:.3}x), decoded at {}/s in the readers",
            human_bytes(stored),
            human_bytes(raw),
            raw as f64 / stored.max(1) as f64,
            human_rate(p.decode_bytes_per_s),
        );
        if let Some((decode, saved)) =
            speeds.and_then(|(sp, _)| p.compression_trade(sp.disk_bytes_per_s))
        {
            let _ =
                writeln!(
                s,
                "compression {}: decoding adds {:.2} ms per token, the smaller reads save {:.2} ms",
                if saved > decode { "pays" } else { "does not pay" },
                decode * 1e3,
                saved * 1e3,
            );
        }
    }
    let streamed_experts: u64 = (0..p.tiers.len())
        .filter(|&i| p.tiers[i] == Tier::Disk)
        .map(|i| p.expert_bytes.get(i).copied().unwrap_or(0))
        .sum();
    if streamed_experts > 0 {
        let _ = writeln!(
            s,
            "experts: {} of the streamed layers are experts, read expert by expert: a token reads {:.1}% of them ({}) once the router has chosen",
            human_bytes(streamed_experts),
            p.expert_share * 100.0,
            human_bytes((streamed_experts as f64 * p.expert_share) as u64),
        );
    }
    let r = &p.device_reserve;
    let pool = if p.unified { "RAM" } else { "device" };
    let _ = writeln!(
        s,
        "{pool} budget {}: reserve {} (KV cache {}, activations {}, scratch {}, margin {}), output head {}, {} slot(s) of {}, resident layers {} = {} used",
        human_bytes(p.budgets.device.unwrap_or(p.budgets.ram)),
        human_bytes(r.total()),
        human_bytes(r.kv),
        human_bytes(r.activations),
        human_bytes(r.scratch),
        human_bytes(r.margin),
        if p.head_on_disk {
            format!("{} on disk (mapped: it does not fit)", human_bytes(p.head_bytes))
        } else {
            human_bytes(p.head_bytes)
        },
        p.device_slots,
        human_bytes(p.device_slot_bytes),
        human_bytes(p.tier_bytes(Tier::Device)),
        human_bytes(p.device_used()),
    );
    let windowed: Vec<u64> = p.kv_windows.iter().flatten().copied().collect();
    if let Some(&widest) = windowed.iter().max() {
        let _ = writeln!(
            s,
            "KV cache: {} of {} layers slide a window of {widest} tokens and keep only it (plus one prompt chunk); the others keep the whole context",
            windowed.len(),
            p.kv_windows.len(),
        );
    }
    if !p.unified {
        let _ = writeln!(
            s,
            "RAM budget {}: KV cache {}, margin {}, {} staging buffer(s) of {}, tier B {} = {} used",
            human_bytes(p.budgets.ram),
            human_bytes(p.ram_reserve.kv),
            human_bytes(p.ram_reserve.margin),
            p.staging_slots,
            human_bytes(p.staging_slot_bytes),
            human_bytes(p.tier_bytes(Tier::Ram)),
            human_bytes(p.ram_used()),
        );
    }
    if p.device_slots > 0 && p.device_slots < p.requested_depth {
        let _ = writeln!(
            s,
            "note: prefetch depth cut from {} to {} slot(s) to fit the budget",
            p.requested_depth, p.device_slots
        );
    }
    if let Some((sp, kv_tokens)) = speeds {
        let pr = p.predict(sp, kv_tokens);
        let _ = writeln!(
            s,
            "speeds: compute {}/s, host to device {}/s, disk {}/s{}",
            human_rate(sp.compute_bytes_per_s),
            human_rate(sp.h2d_bytes_per_s),
            human_rate(sp.disk_bytes_per_s),
            notes
                .filter(|n| !n.is_empty())
                .map(|n| format!(" ({n})"))
                .unwrap_or_default()
        );
        let _ = writeln!(
            s,
            "predicted: {:.1} ms per token = {:.3} tokens/s at {kv_tokens} cached tokens; busy per token: compute {:.1} ms, PCIe {:.1} ms, disk {:.1} ms; bottleneck: {}",
            pr.seconds_per_token * 1e3,
            pr.tokens_per_s(),
            pr.compute_s * 1e3,
            pr.h2d_s * 1e3,
            pr.disk_s * 1e3,
            pr.bottleneck.name()
        );
    }
    s
}
