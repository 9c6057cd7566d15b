//! `ballast plan`: where each layer would live and the speed to expect.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use ballast::ByteSize;
use ballast_runtime::CpuBackend;
use ballast_tier_stream::{
    plan, probe, Budgets, ModelShape, PlanRequest, Prediction, Speeds, Tier,
};
use clap::Args;
use serde_json::json;

use crate::common::{self, human_bytes};
use crate::tiered::{self, describe, human_rate};

/// A named model shape: (name, layers, hidden, heads, kv heads, MLP width, vocabulary,
/// bits per layer weight, bits per head weight).
type Preset = (&'static str, u64, u64, u64, u64, u64, u64, f64, f64);

/// Named model shapes.
const PRESETS: &[Preset] = &[
    (
        "llama-70b-q6_k",
        80,
        8192,
        64,
        8,
        28672,
        128256,
        6.5625,
        6.5625,
    ),
    (
        "llama-70b-q4_k",
        80,
        8192,
        64,
        8,
        28672,
        128256,
        4.5,
        6.5625,
    ),
    ("llama-8b-q8_0", 32, 4096, 32, 8, 14336, 128256, 8.5, 8.5),
    (
        "llama-13b-q4_k",
        40,
        5120,
        40,
        40,
        13824,
        32000,
        4.5,
        6.5625,
    ),
    (
        "mistral-7b-q4_k",
        32,
        4096,
        32,
        8,
        14336,
        32768,
        4.5,
        6.5625,
    ),
];

/// Flags of `ballast plan`.
#[derive(Args, Debug)]
#[command(after_help = "Examples:
  ballast plan                                   # the default model on this machine
  ballast plan -m big.gguf --ram 8G              # a model file under a RAM budget
  ballast plan --preset llama-70b-q6_k --vram 24G --ram 48G --h2d 6.5GB/s --disk 3GB/s -c 4096
  ballast plan --layers 80 --hidden 8192 --heads 64 --kv-heads 8 --ff 28672 --bits 6.5625 --vram 24G --ram 48G
  ballast plan --vram 64M --h2d 6.5GB/s --uploaded-per-token 1.2M   # a measured upload per token

Presets: llama-70b-q6_k, llama-70b-q4_k, llama-8b-q8_0, llama-13b-q4_k, mistral-7b-q4_k.")]
pub struct PlanArgs {
    /// GGUF model file (its real layer sizes). Default: the default model, unless a
    /// preset or --layers describes one.
    #[arg(short = 'm', long)]
    pub model: Option<PathBuf>,
    /// A named model shape instead of a file (see below).
    #[arg(long)]
    pub preset: Option<String>,
    /// Model shape: transformer blocks.
    #[arg(long)]
    pub layers: Option<u64>,
    /// Model shape: residual width.
    #[arg(long, default_value_t = 4096)]
    pub hidden: u64,
    /// Model shape: attention heads.
    #[arg(long, default_value_t = 32)]
    pub heads: u64,
    /// Model shape: key/value heads.
    #[arg(long, default_value_t = 8)]
    pub kv_heads: u64,
    /// Model shape: MLP width.
    #[arg(long, default_value_t = 14336)]
    pub ff: u64,
    /// Model shape: vocabulary.
    #[arg(long, default_value_t = 128256)]
    pub vocab: u64,
    /// Model shape: bits per weight of the layers (Q4_K 4.5, Q6_K 6.5625, Q8_0 8.5).
    #[arg(long, default_value_t = 4.5)]
    pub bits: f64,
    /// Every layer this many bytes (e.g. 669MiB), whatever the shape says.
    #[arg(long)]
    pub layer_bytes: Option<ByteSize>,
    /// Device (GPU) memory, e.g. 24G. Without it the backend computes from RAM.
    #[arg(long)]
    pub vram: Option<ByteSize>,
    /// RAM for this process, e.g. 48G. Default: probed (MemAvailable, cgroup limit).
    #[arg(long)]
    pub ram: Option<ByteSize>,
    /// Host-to-device bandwidth, e.g. 6.5GB/s (PCIe 3.0 x8). Default 13GB/s (assumed).
    #[arg(long)]
    pub h2d: Option<String>,
    /// Disk read bandwidth, e.g. 3GB/s. Default: measured on the model file with
    /// direct I/O, or 3GB/s (assumed) without a file.
    #[arg(long)]
    pub disk: Option<String>,
    /// Weight bytes per second the backend computes over in decode, e.g. 900GB/s.
    /// Default: measured with the CPU backend on the model file; 900GB/s (assumed)
    /// with --vram; 20GB/s (assumed) otherwise.
    #[arg(long)]
    pub compute: Option<String>,
    /// Host-to-device bytes per token measured for a scheme this plan does not place
    /// (e.g. 1.2M: every MLP uploaded per use, a neuron cache's misses): predicts that
    /// scheme instead, every layer computed on the device and these bytes over the link
    /// (--h2d) per token, overlapped with the compute (a transfer hidden under it where
    /// it can be) and serial (each one waited for, as at a host sync point).
    #[arg(long)]
    pub uploaded_per_token: Option<ByteSize>,
    /// Context size in tokens (sizes the KV cache).
    #[arg(short = 'c', long = "ctx", default_value_t = 2048)]
    pub ctx: u64,
    /// Prompt tokens per forward pass (sizes the activations).
    #[arg(short = 'b', long = "batch", default_value_t = 64)]
    pub batch: u64,
    /// Prefetch depth (slots in the ring; `ballast run` uses 3 by default, the seed's
    /// double buffering is 2).
    #[arg(long, default_value_t = 3)]
    pub prefetch_depth: usize,
    /// With a pack on the CPU: the form of the layers kept in RAM (see `ballast run
    /// --help`); the plan shows all three side by side.
    #[arg(long, value_enum, default_value_t = tiered::RamTierKind::Auto)]
    pub ram_tier: tiered::RamTierKind,
    /// Threads for the compute measurement. Default: every core.
    #[arg(short = 't', long)]
    pub threads: Option<usize>,
    /// Speculative decoding with this draft model (a file or a known name) held in
    /// RAM beside the model: the plan splits the budget between the two and predicts
    /// tokens/s for --acceptance, against plain decoding with the whole budget.
    /// `ngram` (prompt lookup) holds nothing and drafts for free.
    #[arg(long, value_name = "MODEL|ngram")]
    pub draft: Option<String>,
    /// With --draft: the share of drafted tokens the model accepts (code a draft knows
    /// well: 0.8-0.9; prose: 0.5-0.7).
    #[arg(long, default_value_t = 0.8, value_parser = acceptance)]
    pub acceptance: f64,
    /// With --draft: the draft model's logits over the first N tokens of the
    /// vocabulary only, as `run --draft-vocab` (0: all).
    #[arg(long = "draft-vocab", default_value_t = crate::draft::DEFAULT_DRAFT_VOCAB, value_name = "N")]
    pub draft_vocab: usize,
    /// One JSON object instead of text.
    #[arg(long)]
    pub json: bool,
}

/// A scheme that computes every layer on the device and moves a measured number of bytes
/// over the link per token (--uploaded-per-token).
struct Uploaded {
    bytes: u64,
    compute_s: f64,
    h2d_s: f64,
}

impl Uploaded {
    fn predict(bytes: u64, compute_s: f64, h2d: f64) -> Uploaded {
        Uploaded {
            bytes,
            compute_s,
            h2d_s: if h2d > 0.0 { bytes as f64 / h2d } else { 0.0 },
        }
    }
    /// The busier of the two: transfers hidden under the compute.
    fn overlapped_s(&self) -> f64 {
        self.compute_s.max(self.h2d_s)
    }
    /// Each transfer waited for.
    fn serial_s(&self) -> f64 {
        self.compute_s + self.h2d_s
    }
}

fn acceptance(s: &str) -> std::result::Result<f64, String> {
    match s.parse::<f64>() {
        Ok(a) if (0.0..1.0).contains(&a) => Ok(a),
        _ => Err(format!("expected a share in [0, 1), got {s:?}")),
    }
}

/// Each drafted token a verification pass scores adds this share of one token's
/// compute to the pass: a pass over several tokens reads the weights once, and on the
/// CPU its matrix products cost more per row than a decode's (Qwen2.5-Coder-1.5B on 2
/// AVX-512 cores: 96 ms for one token, 368 ms for ten).
const DRAFTED_TOKEN_COMPUTE: f64 = 0.3;

/// Speculative decoding's prediction for one draft length.
struct Speculative {
    draft_len: usize,
    tokens_per_pass: f64,
    pass_s: f64,
}

impl Speculative {
    /// Expected tokens per pass when each drafted token is accepted with probability
    /// `a` independently (Leviathan et al.): `(1 - a^(k+1)) / (1 - a)`; a pass over
    /// `k` drafted tokens costs the model's pass (`base`, its compute growing with the
    /// tokens) and `k` draft tokens.
    fn predict(k: usize, a: f64, base: &Prediction, draft_token_s: f64) -> Speculative {
        let tokens_per_pass = (1.0 - a.powi(k as i32 + 1)) / (1.0 - a);
        let compute = base.compute_s * (1.0 + DRAFTED_TOKEN_COMPUTE * k as f64);
        Speculative {
            draft_len: k,
            tokens_per_pass,
            pass_s: base.seconds_per_token.max(compute) + k as f64 * draft_token_s,
        }
    }

    fn tokens_per_s(&self) -> f64 {
        self.tokens_per_pass / self.pass_s
    }
}

pub fn run(args: PlanArgs) -> Result<()> {
    let mut notes: Vec<String> = Vec::new();
    let (mut shape, file, label) = if let Some(name) = &args.preset {
        let Some(p) = PRESETS.iter().find(|p| p.0 == name.as_str()) else {
            bail!(
                "unknown preset '{name}'; known: {}",
                PRESETS.iter().map(|p| p.0).collect::<Vec<_>>().join(", ")
            );
        };
        let shape = ModelShape::from_dims(p.1, p.2, p.3, p.4, p.5, p.6, p.7, p.8);
        (shape, None, format!("preset {}", p.0))
    } else if let Some(layers) = args.layers {
        anyhow::ensure!(
            layers > 0 && args.heads > 0,
            "--layers and --heads must be positive"
        );
        let shape = ModelShape::from_dims(
            layers,
            args.hidden,
            args.heads,
            args.kv_heads,
            args.ff,
            args.vocab,
            args.bits,
            args.bits,
        );
        (shape, None, "shape from flags".to_string())
    } else {
        let path = common::resolve_model(args.model.as_deref())?;
        // A pack is planned as tiered streaming streams it: stored sizes, decode speed;
        // a GPU plan (for Ballast's wgpu backend) with where its embedding table goes.
        let (shape, opened) = ballast::store::planned_shape(&path, args.vram.is_some())?;
        if opened.pack.is_some() {
            notes.push("decode speed measured".into());
        }
        let label = path.display().to_string();
        (shape, Some((opened.file, path)), label)
    };
    if args.vram.is_some() && file.is_none() {
        // A GPU plan is for Ballast's wgpu backend.
        ballast::store::on_wgpu_device(&mut shape, None);
    }
    if let Some(b) = args.layer_bytes.map(ByteSize::bytes) {
        shape.layer_bytes.iter_mut().for_each(|x| *x = b);
    }
    let device = args.vram.map(ByteSize::bytes);
    let own = ballast::store::process_reserve(
        file.as_ref().map(|(f, _)| f.as_ref()),
        common::threads(args.threads),
    );
    let ballast::RamBudget {
        bytes: ram,
        source: ram_source,
    } = ballast::store::ram_budget(args.ram, own)?;
    let h2d = match &args.h2d {
        Some(r) => probe::parse_rate(r)?,
        None => {
            if device.is_some() {
                notes.push("host to device assumed".into());
            }
            13e9
        }
    };
    let disk = match (&args.disk, &file) {
        (Some(r), _) => probe::parse_rate(r)?,
        (None, Some((_, path))) => {
            notes.push("disk measured".into());
            // As tiered streaming reads: its default readers (--io-threads), a
            // streamed layer per read.
            let read = if shape.stored_bytes.is_empty() {
                &shape.layer_bytes
            } else {
                &shape.stored_bytes
            };
            let layer = read.iter().copied().max().unwrap_or(0);
            tiered::measure_disk(path, 2, layer)?
        }
        (None, None) => {
            notes.push("disk assumed".into());
            3e9
        }
    };
    let compute = match (&args.compute, &file, device) {
        (Some(r), _, _) => probe::parse_rate(r)?,
        (None, _, Some(_)) => {
            notes.push("compute assumed".into());
            900e9
        }
        (None, Some((f, _)), None) => {
            let threads = common::threads(args.threads);
            notes.push(format!("compute measured at {threads} threads"));
            tiered::measure_compute(f, &CpuBackend::new(threads))?
        }
        (None, None, None) => {
            notes.push("compute assumed".into());
            20e9
        }
    };
    let request = PlanRequest {
        shape: shape.clone(),
        budgets: Budgets { device, ram },
        ctx: args.ctx,
        batch: args.batch,
        depth: args.prefetch_depth.max(1),
        ram_tier: args.ram_tier.for_plan(),
    };
    let p = plan(&request)?;
    let speeds = Speeds {
        compute_bytes_per_s: compute,
        h2d_bytes_per_s: h2d,
        disk_bytes_per_s: disk,
    };
    // A pack on the CPU may hold layers coded: each form, side by side.
    let ram_tiers = if device.is_none() && !shape.stored_bytes.is_empty() {
        tiered::ram_tier_options(&request, &speeds, args.ctx)
    } else {
        Vec::new()
    };
    let pr = p.predict(&speeds, args.ctx);
    // Speculative decoding: the model planned again in what the draft leaves.
    let speculative = match &args.draft {
        None => None,
        Some(draft) => {
            let draft_args = crate::draft::DraftArgs {
                draft: Some(draft.clone()),
                draft_max: 16,
                draft_min: 0,
                draft_p_min: 0.75,
                draft_vocab: args.draft_vocab,
            };
            // Prompt lookup holds nothing and drafts for free: the model keeps the
            // whole budget.
            let beside =
                draft_args
                    .resident_bytes(args.ctx as usize)?
                    .unwrap_or(ballast::store::Beside {
                        bytes: 0,
                        what: "prompt lookup".into(),
                    });
            let with_draft = if beside.bytes == 0 {
                p.clone()
            } else {
                let ram_left = ballast::store::budget_beside(
                    ballast::store::RamBudget {
                        bytes: ram,
                        source: ram_source.clone(),
                    },
                    Some(&beside),
                )?
                .bytes;
                let request = PlanRequest {
                    budgets: Budgets {
                        device,
                        ram: ram_left,
                    },
                    ..request.clone()
                };
                plan(&request).with_context(|| {
                    format!(
                        "the model does not fit the {} that {} leaves of the budget",
                        human_bytes(ram_left),
                        beside.what
                    )
                })?
            };
            let base = with_draft.predict(&speeds, args.ctx);
            // The draft decodes from RAM at the backend's speed, reading its layers and
            // its head's first --draft-vocab rows.
            let draft_read = draft_args.read_per_token()?.unwrap_or(0);
            let draft_token_s = draft_read as f64 / compute;
            let rows: Vec<Speculative> = [1, 2, 4, 8, 16]
                .into_iter()
                .map(|k| Speculative::predict(k, args.acceptance, &base, draft_token_s))
                .collect();
            Some((beside, with_draft, base, rows))
        }
    };
    let uploaded = args
        .uploaded_per_token
        .map(|bytes| bytes.bytes())
        .map(|bytes| Uploaded::predict(bytes, pr.compute_s, h2d));
    let (a, b, c) = p.counts();
    if let (true, Some(u)) = (args.json, &uploaded) {
        println!(
            "{}",
            json!({
                "model": label, "layers": shape.n_layers(),
                "uploaded_bytes_per_token": u.bytes,
                "speeds": {"compute": compute, "h2d": h2d},
                "predicted": {"seconds_per_token": u.overlapped_s(), "serial_seconds_per_token": u.serial_s(),
                    "compute_s": u.compute_s, "h2d_s": u.h2d_s},
            })
        );
        return Ok(());
    }
    if args.json {
        let bpt = p.bytes_per_token();
        println!(
            "{}",
            json!({
                "model": label, "layers": shape.n_layers(),
                "layer_bytes_total": shape.total_layer_bytes(), "head_bytes": shape.head_bytes,
                "budgets": {"device": device, "ram": ram},
                "ctx": args.ctx,
                "split": {"device": a, "ram": b, "disk": c},
                "layer_map": tiered::layer_map(&p),
                "head_on_disk": p.head_on_disk,
                "streamed_expert_bytes": (0..p.tiers.len())
                    .filter(|&i| p.tiers[i] == Tier::Disk)
                    .map(|i| p.expert_bytes.get(i).copied().unwrap_or(0))
                    .sum::<u64>(),
                "expert_share": p.expert_share,
                "bytes_per_token": {"device": bpt.device, "host_to_device": bpt.host_to_device, "disk": bpt.disk},
                "speeds": {"compute": compute, "h2d": h2d, "disk": disk},
                "predicted": {"seconds_per_token": pr.seconds_per_token, "tokens_per_s": pr.tokens_per_s(),
                    "compute_s": pr.compute_s, "h2d_s": pr.h2d_s, "disk_s": pr.disk_s,
                    "decode_s": pr.decode_s, "bottleneck": pr.bottleneck.name()},
                "speculative": speculative.as_ref().map(|(ballast::store::Beside { bytes: held, what }, with_draft, base, rows)| json!({
                    "draft": what, "draft_bytes": held, "acceptance": args.acceptance,
                    "layer_map": tiered::layer_map(with_draft),
                    "plain_tokens_per_s": base.tokens_per_s(),
                    "draft_lengths": rows.iter().map(|r| json!({
                        "draft_length": r.draft_len, "tokens_per_pass": r.tokens_per_pass,
                        "seconds_per_pass": r.pass_s, "tokens_per_s": r.tokens_per_s(),
                    })).collect::<Vec<_>>(),
                })),
                "ram_tier": args.ram_tier.for_plan().name(),
                "ram_tiers": ram_tiers.iter().map(|o| {
                    let (a, b, c) = o.plan.counts();
                    json!({"ram_tier": o.ram_tier.name(), "split": {"device": a, "ram_coded": b, "disk": c},
                        "ram_coded_bytes": o.plan.tier_bytes(Tier::Ram),
                        "disk_bytes_per_token": o.plan.bytes_per_token().disk,
                        "decodes_per_token": o.plan.decodes_per_token(),
                        "seconds_per_token": o.prediction.seconds_per_token})
                }).collect::<Vec<_>>(),
            })
        );
        return Ok(());
    }
    println!(
        "model: {label}: {} layers, {} of layers (largest {}), output head {}",
        shape.n_layers(),
        human_bytes(shape.total_layer_bytes()),
        human_bytes(shape.layer_bytes.iter().copied().max().unwrap_or(0)),
        human_bytes(shape.head_bytes)
    );
    println!(
        "machine: {}, RAM {} ({}), context {} tokens",
        device.map_or("CPU backend (device = RAM)".to_string(), |d| format!(
            "device {}",
            human_bytes(d)
        )),
        human_bytes(ram),
        if args.ram.is_some() {
            "given".to_string()
        } else {
            ram_source
        },
        args.ctx
    );
    if let Some(u) = &uploaded {
        println!(
            "{} uploaded per token over {}/s: compute {:.2} ms, link {:.2} ms per token; predicted {:.1} tokens/s with the transfers overlapped, {:.1} tokens/s serial ({})",
            human_bytes(u.bytes),
            human_rate(h2d),
            u.compute_s * 1e3,
            u.h2d_s * 1e3,
            1.0 / u.overlapped_s(),
            1.0 / u.serial_s(),
            notes.join(", ")
        );
        return Ok(());
    }
    print!(
        "{}",
        describe(&p, Some((&speeds, args.ctx)), Some(&notes.join(", ")))
    );
    if let Some((ballast::store::Beside { bytes: held, what }, with_draft, base, rows)) =
        &speculative
    {
        println!(
            "with {what} in RAM ({}): the model gets {} of the budget, {}",
            human_bytes(*held),
            human_bytes(ram.saturating_sub(*held)),
            tiered::layer_map(with_draft)
        );
        println!(
            "predicted at acceptance {:.2} (plain decoding with the whole budget: {:.2} tokens/s; with the draft's share, {:.2}):",
            args.acceptance,
            pr.tokens_per_s(),
            base.tokens_per_s()
        );
        println!("| draft length | tokens per pass | ms per pass | tokens/s | vs plain |");
        println!("| ---: | ---: | ---: | ---: | ---: |");
        for r in rows {
            println!(
                "| {} | {:.2} | {:.0} | {:.2} | {:.2}x |",
                r.draft_len,
                r.tokens_per_pass,
                r.pass_s * 1e3,
                r.tokens_per_s(),
                r.tokens_per_s() / pr.tokens_per_s()
            );
        }
    }
    if !ram_tiers.is_empty() {
        println!(
            "the pack's RAM tier (--ram-tier; this plan: {}):",
            args.ram_tier.for_plan().name()
        );
        print!("{}", tiered::describe_ram_tiers(&ram_tiers));
    }
    Ok(())
}
