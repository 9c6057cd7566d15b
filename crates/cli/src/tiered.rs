//! The weight store a command uses: the plain memory map, the file read into RAM, or
//! tiered streaming (`ballast-tier-stream`) planned from `--ram` (or the probed RAM),
//! and the figures it reports.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use ballast_runtime::gguf::{Array, GgufFile, Value};
use ballast_runtime::model::load_weights;
use ballast_runtime::weights::GlobalWeights;
use ballast_runtime::{Backend, Model, ModelConfig, ResidentStore};
use ballast_tier_stream::io::{self, DirectFile, ReadAt};
use ballast_tier_stream::probe::{ProcessReserve, RamProbe};
use ballast_tier_stream::{
    largest_context, model_shape, plan, probe, Budgets, ModelShape, Plan, PlanRequest, RamTier,
    Reserve, Speeds, StatsHandle, StreamStats, Tier, TieredOptions, TieredStore,
};
use clap::{Args, ValueEnum};

use crate::common::human_bytes;

/// How the weights are held.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum StoreKind {
    /// Tiered if --ram is given or the model does not fit the probed RAM, else mmap.
    Auto,
    /// Memory-map the file; the kernel pages weights in and out (llama.cpp's default).
    Mmap,
    /// Read the whole file into RAM.
    Ram,
    /// Keep what fits the budget resident, stream the rest from disk with prefetch.
    Tiered,
    /// For a pack (`ballast pack`): keep the layers compressed, decode each when a
    /// forward pass needs it (see --cache). The default for a pack.
    Compressed,
}

/// How long the compressed store keeps a decoded layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum CacheKind {
    /// Decoded for each use and dropped after: the least memory.
    EveryUse,
    /// Decoded on first use in a forward pass, dropped when the next pass starts.
    PerPass,
    /// Decoded once and kept (as much memory as the plain file).
    Keep,
}

/// The form of the layers a tiered pack keeps in RAM.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum RamTierKind {
    /// Decoded layers first; what the budget leaves holds streamed layers compressed.
    Auto,
    /// Every kept layer decoded.
    Raw,
    /// Every kept layer compressed, decoded per use.
    Coded,
}

impl RamTierKind {
    /// The planner's form.
    pub fn for_plan(self) -> RamTier {
        match self {
            RamTierKind::Auto => RamTier::RawThenCoded,
            RamTierKind::Raw => RamTier::Raw,
            RamTierKind::Coded => RamTier::Coded,
        }
    }
}

/// Flags that choose the weight store and its budget.
#[derive(Args, Clone, Debug)]
pub struct StoreArgs {
    /// Where weights live: auto, mmap, ram (read into RAM) or tiered (resident layers
    /// within --ram, the rest streamed from disk bypassing the page cache).
    #[arg(long, value_enum, default_value_t = StoreKind::Auto)]
    pub store: StoreKind,
    /// RAM budget for weights, KV cache and activations (e.g. 2G, 512M). Default: the
    /// probed RAM (MemAvailable, or the cgroup limit when one is set).
    #[arg(long)]
    pub ram: Option<String>,
    /// GPU memory budget for weights, KV cache and activations (e.g. 8G), with
    /// --device gpu: layers that fit stay on the GPU, the others are uploaded per use
    /// from RAM (--ram) or from disk. Needed for tiered streaming on the GPU (wgpu
    /// cannot tell how much memory a GPU has). The CPU backend computes from RAM: use
    /// --ram there.
    #[arg(long)]
    pub vram: Option<String>,
    /// Prefetch depth of tiered streaming: slots in the ring (2 = double buffering).
    /// The default 3 absorbs scheduling jitter on a busy machine for one more slot.
    #[arg(long, default_value_t = 3)]
    pub prefetch_depth: usize,
    /// Reader threads of tiered streaming (2 keep a read queued while one finishes).
    #[arg(long, default_value_t = 2)]
    pub io_threads: usize,
    /// Read with plain reads plus posix_fadvise(DONTNEED) instead of O_DIRECT.
    #[arg(long)]
    pub no_direct_io: bool,
    /// Mixture of experts, tiered on the CPU: read a streamed layer's experts whole
    /// with the layer, instead of only the experts its tokens choose (the default).
    #[arg(long)]
    pub whole_experts: bool,
    /// Mixture of experts, tiered on the CPU: bytes of recently used experts kept
    /// between tokens (e.g. 256M). Default: what the plan leaves of the RAM budget.
    #[arg(long)]
    pub expert_cache: Option<String>,
    /// With a pack: how long a decoded layer lives.
    #[arg(long, value_enum, default_value_t = CacheKind::EveryUse)]
    pub cache: CacheKind,
    /// With a pack: keep the first N layers decoded once decoded.
    #[arg(long, default_value_t = 0)]
    pub keep_layers: usize,
    /// With a pack: do not decode layer i+1 on a worker while layer i computes.
    #[arg(long)]
    pub no_prefetch: bool,
    /// With a pack: threads that decode one layer's chunks.
    #[arg(long, default_value_t = 1)]
    pub decode_threads: usize,
    /// With a pack streamed by tiers on the CPU: the form of the layers kept in RAM.
    /// raw: decoded (computed from in place, no decode for them). coded: every kept
    /// layer held compressed and decoded per use by the reader threads, ahead of the
    /// pass (the most layers in the budget and the fewest disk bytes, for a decode of
    /// every layer on every token). auto, the default: decoded layers as raw places
    /// them, and the room left in the budget holds streamed layers compressed instead
    /// of reading them from disk, which never adds a decode (they were decoded after
    /// their read anyway). `ballast plan -m PACK` compares the three on this machine.
    #[arg(long, value_enum, default_value_t = RamTierKind::Auto)]
    pub ram_tier: RamTierKind,
    /// RAM that something else of the run holds beside the model, and what: a
    /// resident draft model (`--draft`). The plan gets the budget less this.
    #[arg(skip)]
    pub beside: Option<(u64, String)>,
}

/// `budget` less what `beside` holds (a draft model), or an error with the numbers
/// when nothing would be left for the model.
pub fn budget_beside(
    budget: (u64, String),
    beside: Option<&(u64, String)>,
) -> Result<(u64, String)> {
    let Some((held, what)) = beside else {
        return Ok(budget);
    };
    let (ram, source) = budget;
    anyhow::ensure!(
        *held < ram,
        "{what} needs {} of the RAM budget of {} ({source}), which leaves nothing for the model: more memory (--ram, a higher limit), or a smaller draft",
        human_bytes(*held),
        human_bytes(ram)
    );
    Ok((
        ram - held,
        format!("{source}, less {} for {what}", human_bytes(*held)),
    ))
}

/// What a tiered model reports.
pub struct TieredInfo {
    pub plan: Plan,
    pub stats: StatsHandle,
    pub read_mode: &'static str,
    pub shape: ModelShape,
}

impl TieredInfo {
    /// Bytes of the layers that are not resident.
    pub fn non_resident_bytes(&self) -> u64 {
        self.plan.tier_bytes(Tier::Disk)
    }
}

/// A model built with the store the flags ask for.
pub struct Built {
    pub model: Model,
    pub tiered: Option<TieredInfo>,
    pub compressed: Option<ballast_weight_codec::store::StatsHandle>,
    pub store_name: &'static str,
    /// The RAM budget the store was sized from and its source, when one was (tiered
    /// streaming, or the automatic choice of a store).
    pub ram_budget: Option<(u64, String)>,
}

/// What this process holds besides what a plan places, for the model `file` (its
/// metadata and tokenizer live in the heap; `None`: no model file) computed with
/// `threads`.
pub fn process_reserve(file: Option<&GgufFile>, threads: usize) -> ProcessReserve {
    let count = |key: &str| match file.and_then(|f| f.get(key)) {
        Some(Value::Array(Array::String(items))) => items.len() as u64,
        _ => 0,
    };
    ProcessReserve {
        threads,
        vocab: count("tokenizer.ggml.tokens"),
        merges: count("tokenizer.ggml.merges"),
    }
}

/// The RAM budget and where it came from: the flag, else the probe less what the
/// process holds itself (`own`).
pub fn ram_budget(flag: Option<&str>, own: ProcessReserve) -> Result<(u64, String)> {
    if let Some(s) = flag {
        return Ok((probe::parse_size(s)?, "given".into()));
    }
    sized_budget(&probe::probe_ram(), own)
        .context("cannot probe RAM (no /proc/meminfo); pass --ram")
}

/// The budget `probe` gives a process that holds `own` itself, and its source. The
/// same probe and reserve give the same budget: nothing resident is subtracted (what
/// the cgroup holds counts the mapped model's pages, which come and go).
fn sized_budget(probe: &RamProbe, own: ProcessReserve) -> Option<(u64, String)> {
    let reserve = own.bytes();
    let budget = probe.budget(reserve)?;
    let source = match &probe.cgroup_limit {
        Some((limit, file)) if probe.limit_decides(reserve) => format!(
            "{budget} bytes: the cgroup limit {} in {} less {} for the process itself ({} threads, {} tokens, {} merges)",
            human_bytes(*limit),
            file.display(),
            human_bytes(reserve),
            own.threads,
            own.vocab,
            own.merges
        ),
        _ => format!("{budget} bytes: MemAvailable"),
    };
    Some((budget, source))
}

/// A context the RAM budget cannot hold beside the model, with the longest one it
/// can: the caller names the flag that sets it.
#[derive(Debug)]
pub struct ContextTooLong {
    /// The context asked for, in tokens (all sequences together).
    pub ctx: u64,
    /// The longest context the budget holds.
    pub fits: u64,
    /// The budget in bytes.
    pub budget: u64,
    /// Where the budget came from.
    pub source: String,
    /// The planner's refusal at `ctx`.
    pub refusal: String,
}

impl std::fmt::Display for ContextTooLong {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "a context of {} tokens does not fit the RAM budget of {} ({}); {} tokens do: pass -c {} (or more memory: --ram, a higher limit)\n  ({})",
            self.ctx,
            human_bytes(self.budget),
            self.source,
            self.fits,
            self.fits,
            self.refusal
        )
    }
}

impl std::error::Error for ContextTooLong {}

/// Builds the model of `file` with the store `args` ask for, sized for a context of
/// `ctx` tokens and prompt chunks of `batch`; `quiet` keeps the plan off stderr.
#[allow(clippy::too_many_arguments)] // each is a separate fact about the run
pub fn build(
    file: &Arc<GgufFile>,
    pack: Option<&Arc<ballast_weight_codec::PackFile>>,
    path: &Path,
    backend: Arc<dyn Backend>,
    args: &StoreArgs,
    mapped: bool,
    ctx: usize,
    batch: usize,
    quiet: bool,
    neuron_cache: Option<u64>,
) -> Result<Built> {
    // A pass never holds more tokens than the context.
    let batch = batch.clamp(1, ctx.max(1));
    // A backend with its own device (wgpu) gets a plan with a device tier.
    let separate_device = backend.device_forward().is_some();
    if args.vram.is_some() && !separate_device {
        bail!("--vram is GPU memory, and this run computes on the CPU, from RAM: use --ram, or --device gpu");
    }
    let config =
        ModelConfig::from_gguf(file).with_context(|| format!("loading {}", path.display()))?;
    let (globals, mut layers) =
        load_weights(file, &config).with_context(|| format!("loading {}", path.display()))?;
    let mut shape = model_shape(&config, &globals, &layers);
    if separate_device {
        on_wgpu_device(&mut shape, Some(&globals));
    }
    if args.whole_experts {
        // Streamed layers are read whole, experts and all: their slots hold them.
        shape.expert_bytes.clear();
    }
    // A pack streamed by tiers: the tiered store's readers decode each streamed layer
    // into its slot, from the pack's chunks read from disk or from the chunks it holds
    // in RAM (a coded RAM tier), so decoding runs in the prefetch pipeline.
    let tiered_pack = match (pack, args.store) {
        (Some(pack), StoreKind::Tiered) => Some(pack.clone()),
        (Some(pack), StoreKind::Auto) if args.ram.is_some() || args.vram.is_some() => {
            Some(pack.clone())
        }
        _ => None,
    };
    match (pack, args.store) {
        _ if tiered_pack.is_some() => {}
        (Some(pack), StoreKind::Auto | StoreKind::Compressed) => {
            use ballast_weight_codec::{CachePolicy, CompressedStore, StoreOptions};
            let opts = StoreOptions {
                policy: match args.cache {
                    CacheKind::EveryUse => CachePolicy::EveryUse,
                    CacheKind::PerPass => CachePolicy::PerPass,
                    CacheKind::Keep => CachePolicy::Keep,
                },
                keep_layers: args.keep_layers,
                prefetch: !args.no_prefetch,
                decode_threads: args.decode_threads.max(1),
                // A device of its own decodes what it can (a pack made with
                // `--codec gpu`): streamed layers go up coded.
                device_decode: separate_device,
            };
            let store = CompressedStore::new(pack.clone(), globals, layers, opts, mapped)
                .with_context(|| format!("loading {}", path.display()))?;
            if separate_device {
                // Decoded layers are lent per pass: the device uploads them into slots.
                if let Some(memory) = backend.device_memory() {
                    memory.set_stream_slots(2);
                }
            }
            let stats = store.stats_handle();
            return Ok(Built {
                model: {
                    let ffn = ballast_runtime::ffn::for_config(&config);
                    Model::from_parts(config, Box::new(store), backend, ffn)
                },
                tiered: None,
                compressed: Some(stats),
                store_name: "compressed",
                ram_budget: None,
            });
        }
        (None, StoreKind::Compressed) => bail!(
            "{}: --store compressed needs a pack (make one with `ballast pack`)",
            path.display()
        ),
        _ => {}
    }
    let own = process_reserve(Some(file), backend.n_threads());
    // Sized once: the choice of a store and the plan see the same budget.
    let mut sized = None;
    let kind = match args.store {
        StoreKind::Auto if args.ram.is_some() || args.vram.is_some() => StoreKind::Tiered,
        StoreKind::Auto => {
            let (ram, _) =
                sized.insert(budget_beside(ram_budget(None, own)?, args.beside.as_ref())?);
            let ram = *ram;
            // Resident when the weights fit beside what the context needs (KV cache,
            // activations, the margin), else a mapped model would thrash: tiered.
            let need = (shape.total_layer_bytes() + shape.head_bytes).saturating_add(
                Reserve::for_context(&shape, ctx as u64, batch as u64, ram).total(),
            );
            if need > ram {
                StoreKind::Tiered
            } else if mapped {
                StoreKind::Mmap
            } else {
                StoreKind::Ram
            }
        }
        k => k,
    };
    if kind != StoreKind::Tiered {
        let store_name = if mapped { "mmap" } else { "ram" };
        if let (false, Some((ram, source))) = (quiet, &sized) {
            eprintln!(
                "RAM budget {} ({source}): the model and a context of {ctx} tokens fit, {store_name}",
                human_bytes(*ram)
            );
        }
        let store = ResidentStore::new(globals, layers, mapped);
        return Ok(Built {
            model: {
                let ffn = ballast_runtime::ffn::for_config(&config);
                Model::from_parts(config, Box::new(store), backend, ffn)
            },
            tiered: None,
            compressed: None,
            store_name,
            ram_budget: sized,
        });
    }
    let (ram, source) = match sized {
        Some(sized) => sized,
        None => budget_beside(ram_budget(args.ram.as_deref(), own)?, args.beside.as_ref())?,
    };
    // The MLP out of core (the sparse MLP's neuron mode): no layer holds its up and
    // down matrices, which the neuron file serves neuron by neuron into a cache that
    // lives inside the RAM budget.
    let neuron_cache = match neuron_cache {
        Some(bytes) if tiered_pack.is_none() && !separate_device => {
            use ballast_runtime::blocks::{FFN_DOWN, FFN_UP};
            for l in &mut layers {
                l.matrices
                    .retain(|(role, _)| role != FFN_UP && role != FFN_DOWN);
            }
            let kv_windows = shape.kv_windows.clone();
            shape = model_shape(&config, &globals, &layers);
            shape.kv_windows = kv_windows;
            if args.whole_experts {
                shape.expert_bytes.clear();
            }
            if bytes >= ram {
                bail!(
                    "the neuron cache ({}) does not fit the RAM budget ({}): lower --neuron-slots",
                    human_bytes(bytes),
                    human_bytes(ram)
                );
            }
            Some(bytes)
        }
        _ => None,
    };
    let ram_for_weights = ram - neuron_cache.unwrap_or(0);
    let device = if separate_device {
        let vram = args.vram.as_deref().context(
            "tiered streaming on the GPU needs --vram (wgpu cannot tell how much memory the GPU has)",
        )?;
        Some(probe::parse_size(vram)?)
    } else {
        None
    };
    let mut compressed = None;
    let beneath_pack = match &tiered_pack {
        Some(pack) => {
            // The streamed layers' chunks come from disk as the plain file's layers do:
            // read directly, not kept in the page cache (unless --no-direct-io).
            if !args.no_direct_io {
                pack.read_chunks_from_disk()
                    .with_context(|| format!("opening {}", path.display()))?;
            }
            let (store, decode_bytes_per_s) =
                decoding_store(pack, globals.clone(), layers.clone(), mapped)
                    .with_context(|| format!("loading {}", path.display()))?;
            shape.stored_bytes = store.stored_bytes_per_layer();
            shape.decode_bytes_per_s = decode_bytes_per_s;
            // Experts are read one by one from a file, not from a pack.
            shape.expert_bytes.clear();
            compressed = Some(store.stats_handle());
            Some(store)
        }
        None => None,
    };
    let request = PlanRequest {
        shape: shape.clone(),
        budgets: Budgets {
            device,
            ram: ram_for_weights,
        },
        ctx: ctx as u64,
        batch: batch as u64,
        depth: args.prefetch_depth.max(1),
        ram_tier: args.ram_tier.for_plan(),
    };
    let p = match plan(&request) {
        Ok(p) => p,
        // The KV cache grows with the context: say which context would fit.
        Err(e) => {
            return Err(match largest_context(&request) {
                Some(fits) if device.is_none() && fits < request.ctx => {
                    anyhow::Error::new(ContextTooLong {
                        ctx: request.ctx,
                        fits,
                        budget: ram,
                        source,
                        refusal: e.to_string(),
                    })
                }
                _ => anyhow::Error::new(e)
                    .context(format!("RAM budget {} ({source})", human_bytes(ram))),
            })
        }
    };
    let options = TieredOptions {
        io_threads: args.io_threads.max(1),
        whole_experts: args.whole_experts,
        expert_cache_bytes: match args.expert_cache.as_deref() {
            Some(size) => probe::parse_size(size)?,
            None if p.unified => ram.saturating_sub(p.device_used()),
            None => 0,
        },
    };
    let store = match beneath_pack {
        Some(inner) => TieredStore::over_coded(Arc::new(inner), &p, options)?,
        None => {
            let reader = DirectFile::open(path, !args.no_direct_io)
                .with_context(|| format!("opening {} for streaming", path.display()))?;
            TieredStore::new(file, globals, layers, &p, Arc::new(reader), options)?
        }
    };
    if !p.unified {
        // Tiers B and C are uploaded per use into the device slots the plan sized.
        if let Some(memory) = backend.device_memory() {
            memory.set_stream_slots(p.device_slots.max(1));
        }
    }
    // Loading touched each layer's norms through the memory map: let those pages go.
    // Not a pack's: its GGUF is an anonymous map (decoded head and norms), which
    // MADV_DONTNEED would zero.
    if tiered_pack.is_none() {
        io::release_mapped_pages(file.as_bytes());
        let _ = io::drop_file_cache(path);
    }
    let info = TieredInfo {
        plan: p,
        stats: store.stats_handle(),
        read_mode: store.read_mode(),
        shape,
    };
    if !quiet {
        if let Some(d) = device {
            eprintln!("GPU budget {} (given)", human_bytes(d));
        }
        eprintln!("RAM budget {} ({source})", human_bytes(ram));
        if let Some(bytes) = neuron_cache {
            eprintln!(
                "MLP up/down out of core: neuron cache {} of it, the rest planned for the other weights",
                human_bytes(bytes)
            );
        }
        eprint!("{}", describe(&info.plan, None, None));
        eprintln!("disk reads: {}", info.read_mode);
    }
    Ok(Built {
        model: {
            let ffn = ballast_runtime::ffn::for_config(&config);
            Model::from_parts(config, Box::new(store), backend, ffn)
        },
        tiered: Some(info),
        compressed,
        ram_budget: Some((ram, source)),
        store_name: if tiered_pack.is_some() {
            "tiered over a pack"
        } else {
            "tiered"
        },
    })
}

/// The store a tiered store streams a pack from: it decodes a layer on every request
/// (the tiered store keeps what it keeps), on one thread per request, with no prefetch
/// of its own (the tiered store's readers prefetch). Returns it with its decode speed,
/// measured now on the largest layer (decoded bytes per second).
pub fn decoding_store(
    pack: &Arc<ballast_weight_codec::PackFile>,
    globals: ballast_runtime::weights::GlobalWeights,
    layers: Vec<ballast_runtime::weights::LayerWeights>,
    mapped: bool,
) -> Result<(ballast_weight_codec::CompressedStore, f64)> {
    use ballast_runtime::WeightStore;
    use ballast_weight_codec::{CachePolicy, CompressedStore, StoreOptions};
    let largest = (0..layers.len())
        .max_by_key(|&i| layers[i].byte_size())
        .unwrap_or(0);
    let store = CompressedStore::new(
        pack.clone(),
        globals,
        layers,
        StoreOptions {
            policy: CachePolicy::EveryUse,
            keep_layers: 0,
            prefetch: false,
            decode_threads: 1,
            device_decode: false,
        },
        mapped,
    )?;
    let before = store.stats();
    let passes = ballast_runtime::store::PassCounter::default();
    for _ in 0..3 {
        drop(store.layer(passes.next(), largest)?);
    }
    let after = store.stats();
    let time = after.decode_time.saturating_sub(before.decode_time);
    let bytes = after.bytes_decoded - before.bytes_decoded;
    let speed = if time.is_zero() {
        0.0
    } else {
        bytes as f64 / time.as_secs_f64()
    };
    Ok((store, speed))
}

/// What the wgpu backend keeps on its device beyond the layers: the session's KV cache,
/// counted at f32 (the default there; an upper bound for f16 and q8) and held there
/// alone (a `DeviceKv`: no host record), and it looks tokens up on the device, so an
/// embedding table that is not the output head is uploaded whole beside it (`globals`,
/// when the model is known).
pub fn on_wgpu_device(shape: &mut ModelShape, globals: Option<&GlobalWeights>) {
    shape.kv_value_bytes = 4;
    shape.kv_on_device_only = true;
    if let Some(g) = globals.filter(|g| g.token_embd.name != g.output.name) {
        shape.head_bytes += g.token_embd.bytes.len() as u64;
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

/// One RAM-tier form planned for the same request, with what it costs per token.
pub struct RamTierOption {
    pub ram_tier: RamTier,
    pub plan: Plan,
    pub prediction: ballast_tier_stream::Prediction,
}

/// The request planned with each RAM-tier form (for a pack on the CPU: raw, raw then
/// coded, coded), each predicted at `speeds`; forms the budget refuses are left out.
pub fn ram_tier_options(req: &PlanRequest, speeds: &Speeds, kv_tokens: u64) -> Vec<RamTierOption> {
    [RamTier::Raw, RamTier::RawThenCoded, RamTier::Coded]
        .into_iter()
        .filter_map(|ram_tier| {
            let plan = plan(&PlanRequest {
                ram_tier,
                ..req.clone()
            })
            .ok()?;
            let prediction = plan.predict(speeds, kv_tokens);
            Some(RamTierOption {
                ram_tier,
                plan,
                prediction,
            })
        })
        .collect()
}

/// The RAM-tier forms side by side: layers in RAM decoded and coded, disk bytes and
/// decodes per token, the prediction; then whether holding layers coded pays against
/// reading them from disk.
pub fn describe_ram_tiers(options: &[RamTierOption]) -> String {
    use std::fmt::Write;
    let mut s = String::new();
    let _ = writeln!(
        s,
        "| RAM tier | layers decoded in RAM | layers coded in RAM | on disk | disk read per token | decodes per token | readers busy (decode) | predicted |"
    );
    let _ = writeln!(
        s,
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
    );
    for o in options {
        let (a, b, c) = o.plan.counts();
        let pr = &o.prediction;
        let _ = writeln!(
            s,
            "| {} | {a} | {b} ({}) | {c} | {} | {} | {:.1} ms ({:.1} ms) | {:.1} ms = {:.2} tokens/s |",
            o.ram_tier.name(),
            human_bytes(o.plan.tier_bytes(Tier::Ram)),
            human_bytes(o.plan.bytes_per_token().disk),
            o.plan.decodes_per_token(),
            pr.disk_s * 1e3,
            pr.decode_s * 1e3,
            pr.seconds_per_token * 1e3,
            pr.tokens_per_s(),
        );
    }
    let raw = options.iter().find(|o| o.ram_tier == RamTier::Raw);
    for o in options.iter().filter(|o| o.ram_tier != RamTier::Raw) {
        let Some(raw) = raw else { break };
        let in_ram = |p: &Plan| {
            let (a, b, _) = p.counts();
            a + b
        };
        let more = in_ram(&o.plan) as i64 - in_ram(&raw.plan) as i64;
        let saved = raw.plan.bytes_per_token().disk as i64 - o.plan.bytes_per_token().disk as i64;
        let extra_decodes = o.plan.decodes_per_token() as i64 - raw.plan.decodes_per_token() as i64;
        let (t, t_raw) = (
            o.prediction.seconds_per_token,
            raw.prediction.seconds_per_token,
        );
        let verdict = if more <= 0 && extra_decodes <= 0 {
            "changes nothing here".to_string()
        } else if more <= 0 {
            "does not pay: it holds no more layers, and decodes more".to_string()
        } else if t < t_raw {
            format!(
                "pays: {:.1} ms per token instead of {:.1}",
                t * 1e3,
                t_raw * 1e3
            )
        } else {
            format!(
                "does not pay: {:.1} ms per token instead of {:.1} (decoding costs more than the disk reads it saves)",
                t * 1e3,
                t_raw * 1e3
            )
        };
        let _ = writeln!(
            s,
            "RAM tier {}: {more:+} layers in RAM against raw, {} less read from disk per token, {extra_decodes:+} decodes per token: {verdict}",
            o.ram_tier.name(),
            human_bytes(saved.max(0) as u64),
        );
    }
    s
}

/// A rate in decimal units, as disks and links are quoted.
pub fn human_rate(bytes_per_s: f64) -> String {
    if bytes_per_s >= 1e9 {
        format!("{:.2} GB", bytes_per_s / 1e9)
    } else {
        format!("{:.0} MB", bytes_per_s / 1e6)
    }
}

/// Measures the disk: reads up to 256 MiB of `path` with direct I/O in 4 MiB requests
/// (from the middle of the file, where the layers are).
pub fn measure_disk(path: &Path) -> Result<f64> {
    let f = DirectFile::open(path, true)?;
    let len = f.len();
    let chunk = 4u64 << 20;
    let total = len.min(256 << 20) / 4096 * 4096;
    anyhow::ensure!(
        total > 0,
        "{} is too small to measure the disk",
        path.display()
    );
    let start_at = (len - total) / 2 / 4096 * 4096;
    let mut buf = io::AlignedBuf::new(chunk as usize);
    let _ = io::drop_file_cache(path);
    let t = Instant::now();
    let mut off = 0;
    while off < total {
        let want = (total - off).min(chunk) as usize;
        let n = f.read_at(&mut buf.as_mut_slice()[..want], start_at + off)?;
        anyhow::ensure!(
            n > 0,
            "{}: read nothing at {}",
            path.display(),
            start_at + off
        );
        off += n as u64;
    }
    Ok(total as f64 / t.elapsed().as_secs_f64())
}

/// Measures the backend's decode speed in weight bytes per second: matrix-vector
/// products over one layer's weights (and the head), repeated for at least 200 ms.
pub fn measure_compute(file: &Arc<GgufFile>, backend: &dyn Backend) -> Result<f64> {
    use ballast_runtime::backend::MatmulJob;
    let config = ModelConfig::from_gguf(file)?;
    let (_, layers) = load_weights(file, &config)?;
    let l = layers.first().context("the model has no layers")?;
    let ws: Vec<_> = l.weights().collect();
    let bytes: u64 = ws.iter().map(|w| w.bytes.len() as u64).sum();
    let x = vec![0.5f32; config.d_model.max(config.n_ff).max(config.q_dim())];
    let mut outs: Vec<Vec<f32>> = ws.iter().map(|w| vec![0.0; w.rows()]).collect();
    let mut run = || -> Result<()> {
        for (w, out) in ws.iter().zip(outs.iter_mut()) {
            backend.matmul(&x[..w.cols()], 1, &mut [MatmulJob { weight: w, out }])?;
        }
        Ok(())
    };
    run()?; // warm-up (pages in the weights)
    let t = Instant::now();
    let mut reps = 0u64;
    while t.elapsed() < Duration::from_millis(200) || reps < 3 {
        run()?;
        reps += 1;
    }
    Ok((bytes * reps) as f64 / t.elapsed().as_secs_f64())
}

/// Measured figures of tiered streaming between two snapshots, per token.
pub struct Measured {
    /// Layer and expert bytes read.
    pub disk_bytes_per_token: f64,
    pub stall_per_token: Duration,
    pub read_time_per_token: Duration,
    pub disk_bytes_per_s: f64,
    /// Of a mixture of experts streamed expert by expert: bytes read for the chosen
    /// experts, the share of chosen experts found in the cache, and the wait for them.
    pub expert_bytes_per_token: f64,
    /// The chosen experts' own bytes per token, and those not found in the cache.
    pub expert_chosen_per_token: f64,
    pub expert_missed_per_token: f64,
    pub expert_hit_rate: f64,
    pub expert_stall_per_token: Duration,
}

pub fn measured(before: StreamStats, after: StreamStats, tokens: usize) -> Measured {
    let n = tokens.max(1) as f64;
    let bytes = after.disk_bytes - before.disk_bytes;
    let read = after.read_time.saturating_sub(before.read_time);
    let (eb, ea) = (before.experts, after.experts);
    let expert_bytes = ea.bytes - eb.bytes;
    let (reads, hits) = (ea.reads - eb.reads, ea.hits - eb.hits);
    Measured {
        expert_bytes_per_token: expert_bytes as f64 / n,
        expert_chosen_per_token: (ea.chosen - eb.chosen) as f64 / n,
        expert_missed_per_token: (ea.missed - eb.missed) as f64 / n,
        expert_hit_rate: if reads + hits == 0 {
            0.0
        } else {
            hits as f64 / (reads + hits) as f64
        },
        expert_stall_per_token: ea.stall.saturating_sub(eb.stall).div_f64(n),
        disk_bytes_per_token: (bytes + expert_bytes) as f64 / n,
        stall_per_token: after
            .stall_time
            .saturating_sub(before.stall_time)
            .div_f64(n),
        read_time_per_token: read.div_f64(n),
        // The reader threads' layer bytes over their busy time (expert reads are timed
        // apart, as the wait above).
        disk_bytes_per_s: if read.is_zero() {
            0.0
        } else {
            bytes as f64 / read.as_secs_f64()
        },
    }
}
