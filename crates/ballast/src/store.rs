//! The weight store an engine uses: the plain memory map, the file read into RAM, a
//! pack's compressed store, or tiered streaming (`ballast-tier-stream`) planned from
//! the RAM budget (given, or probed).

use std::path::Path;
use std::sync::Arc;

use ballast_runtime::gguf::{Array, GgufFile, Value};
use ballast_runtime::model::load_weights;
use ballast_runtime::session::DEFAULT_BATCH;
use ballast_runtime::weights::{GlobalWeights, LayerWeights};
use ballast_runtime::{Backend, Model, ModelConfig, ResidentStore};
use ballast_tier_stream::io::{self, DirectFile};
use ballast_tier_stream::probe::{ProcessReserve, RamProbe};
use ballast_tier_stream::{
    largest_context, model_shape, plan, probe, Budgets, ModelShape, Plan, PlanRequest, RamTier,
    Reserve, StatsHandle, Tier, TieredOptions, TieredStore,
};
use ballast_weight_codec::{CachePolicy, CompressedStore, PackFile};

use crate::error::{ensure, AtFile, ContextTooLong, Error, Result};
use crate::size::{human_bytes, ByteSize};

/// How the weights are held.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
pub enum StoreKind {
    /// Tiered if --ram is given or the model does not fit the probed RAM, else mmap.
    #[default]
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
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
pub enum CacheKind {
    /// Decoded for each use and dropped after: the least memory.
    #[default]
    EveryUse,
    /// Decoded on first use in a forward pass, dropped when the next pass starts.
    PerPass,
    /// Decoded once and kept (as much memory as the plain file).
    Keep,
}

impl CacheKind {
    /// The compressed store's policy.
    pub fn policy(self) -> CachePolicy {
        match self {
            CacheKind::EveryUse => CachePolicy::EveryUse,
            CacheKind::PerPass => CachePolicy::PerPass,
            CacheKind::Keep => CachePolicy::Keep,
        }
    }
}

/// The form of the layers a tiered pack keeps in RAM.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
pub enum RamTierKind {
    /// Decoded layers first; what the budget leaves holds streamed layers compressed.
    #[default]
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

/// How tiered streaming runs (`ballast-tier-stream`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StreamOptions {
    /// Slots in the prefetch ring (2 = double buffering). Default 3.
    pub prefetch_depth: usize,
    /// Reader threads (2 keep a read queued while one finishes). Default 2.
    pub io_threads: usize,
    /// Read with O_DIRECT (default), else with plain reads plus
    /// posix_fadvise(DONTNEED).
    pub direct_io: bool,
    /// Mixture of experts on the CPU: read a streamed layer's experts whole with the
    /// layer, instead of only the experts its tokens choose.
    pub whole_experts: bool,
    /// Mixture of experts on the CPU: bytes of recently used experts kept between
    /// tokens. `None`: what the plan leaves of the RAM budget.
    pub expert_cache: Option<ByteSize>,
}

impl Default for StreamOptions {
    fn default() -> StreamOptions {
        StreamOptions {
            prefetch_depth: 3,
            io_threads: 2,
            direct_io: true,
            whole_experts: false,
            expert_cache: None,
        }
    }
}

/// How a pack (`ballast-weight-codec`) is decoded.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CodecOptions {
    /// How long the compressed store keeps a decoded layer.
    pub cache: CacheKind,
    /// Keep the first N layers decoded once decoded.
    pub keep_layers: usize,
    /// Decode layer i+1 on a worker while layer i computes (default).
    pub prefetch: bool,
    /// Threads that decode one layer's chunks. Default 1.
    pub decode_threads: usize,
    /// A pack streamed by tiers on the CPU: the form of the layers kept in RAM.
    pub ram_tier: RamTierKind,
}

impl Default for CodecOptions {
    fn default() -> CodecOptions {
        CodecOptions {
            cache: CacheKind::EveryUse,
            keep_layers: 0,
            prefetch: true,
            decode_threads: 1,
            ram_tier: RamTierKind::Auto,
        }
    }
}

/// Where the weights live and within what: the store and its options, the budgets.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StoreOptions {
    /// The store.
    pub kind: StoreKind,
    /// RAM budget for weights, KV cache and activations. `None`: the probed RAM.
    pub ram: Option<ByteSize>,
    /// GPU memory budget, for tiered streaming on a GPU.
    pub vram: Option<ByteSize>,
    /// Tiered streaming.
    pub stream: StreamOptions,
    /// A pack's decoding.
    pub codec: CodecOptions,
    /// RAM that something else of the process holds beside the model (a resident draft
    /// model): the model's plan gets the budget less this.
    pub beside: Option<Beside>,
}

/// RAM held beside the model, and by what.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Beside {
    /// Bytes held.
    pub bytes: u64,
    /// What holds them, for messages ("the draft model x.gguf").
    pub what: String,
}

/// `budget` less what `beside` holds, or an error with the numbers when nothing would
/// be left for the model.
pub fn budget_beside(budget: RamBudget, beside: Option<&Beside>) -> Result<RamBudget> {
    let Some(Beside { bytes, what }) = beside else {
        return Ok(budget);
    };
    if *bytes >= budget.bytes {
        return Err(Error::Invalid(format!(
            "{what} needs {} of the RAM budget of {} ({}), which leaves nothing for the model: more memory (--ram, a higher limit), or a smaller draft",
            human_bytes(*bytes),
            human_bytes(budget.bytes),
            budget.source
        )));
    }
    Ok(RamBudget {
        bytes: budget.bytes - bytes,
        source: format!("{}, less {} for {what}", budget.source, human_bytes(*bytes)),
    })
}

/// A RAM budget and where it came from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RamBudget {
    /// The budget in bytes.
    pub bytes: u64,
    /// `"given"`, or the probe that sized it.
    pub source: String,
}

/// What a tiered model reports.
#[derive(Clone)]
pub struct TieredInfo {
    /// Where each layer lives.
    pub plan: Plan,
    /// The store's counters.
    pub stats: StatsHandle,
    /// How the store reads the disk.
    pub read_mode: &'static str,
    /// The model's shape as planned.
    pub shape: ModelShape,
}

impl TieredInfo {
    /// Bytes of the layers that are not resident.
    pub fn non_resident_bytes(&self) -> u64 {
        self.plan.tier_bytes(Tier::Disk)
    }
}

/// A model file opened: a GGUF, or a pack with the GGUF it decodes to.
#[derive(Clone)]
pub struct Opened {
    /// The GGUF file (for a pack: decoded in memory; with the compressed store or auto,
    /// without the layers' matrices, which the compressed store decodes per use).
    pub file: Arc<GgufFile>,
    /// The pack, when the file is one.
    pub pack: Option<Arc<PackFile>>,
}

/// Opens `path` as a GGUF file or, if it is a pack, as the GGUF it decodes to: whole
/// for the stores that read a plain file (mmap, ram), without the layers' matrices for
/// the stores that decode them from the pack (compressed, tiered, or auto).
pub fn open_model(path: &Path, mapped: bool, store: StoreKind) -> Result<Opened> {
    if !ballast_weight_codec::is_pack(path) {
        let file = GgufFile::open(path, mapped).at("opening", path)?;
        return Ok(Opened {
            file: Arc::new(file),
            pack: None,
        });
    }
    let pack = PackFile::open(path, mapped).at("opening the pack", path)?;
    let t = crate::default_threads();
    if store == StoreKind::Tiered && mapped {
        // Tiered streaming reads the pack's chunks from disk, not through the map: the
        // head and norms decoded now leave no mapped pages of the pack behind, which
        // would hold memory (and a cgroup's page cache) outside the budget.
        pack.read_chunks_from_disk().at("opening the pack", path)?;
    }
    // The stores that decode layers on demand (compressed, and tiered, which streams
    // from one) need only the skeleton.
    let file = match store {
        StoreKind::Auto | StoreKind::Compressed | StoreKind::Tiered => {
            ballast_weight_codec::store::skeleton(&pack, t)
        }
        StoreKind::Mmap | StoreKind::Ram => pack.to_gguf(t),
    }
    .at("decoding the pack", path)?;
    Ok(Opened {
        file: Arc::new(file),
        pack: Some(Arc::new(pack)),
    })
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

/// The RAM budget: `given`, else the probe less what the process holds itself (`own`).
pub fn ram_budget(given: Option<ByteSize>, own: ProcessReserve) -> Result<RamBudget> {
    if let Some(size) = given {
        return Ok(RamBudget {
            bytes: size.bytes(),
            source: "given".into(),
        });
    }
    sized_budget(&probe::probe_ram(), own)
        .ok_or_else(|| Error::Invalid("cannot probe RAM (no /proc/meminfo); pass --ram".into()))
}

/// The budget `probe` gives a process that holds `own` itself, and its source. The
/// same probe and reserve give the same budget: nothing resident is subtracted (what
/// the cgroup holds counts the mapped model's pages, which come and go).
fn sized_budget(probe: &RamProbe, own: ProcessReserve) -> Option<RamBudget> {
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
    Some(RamBudget {
        bytes: budget,
        source,
    })
}

/// A model built with the store the options ask for.
pub(crate) struct Built {
    pub model: Model,
    pub tiered: Option<TieredInfo>,
    pub compressed: Option<ballast_weight_codec::store::StatsHandle>,
    pub store_name: &'static str,
    /// The RAM budget the store was sized from, when one was (tiered streaming, or the
    /// automatic choice of a store).
    pub ram_budget: Option<RamBudget>,
    /// The GPU budget of tiered streaming on a GPU.
    pub vram_budget: Option<u64>,
    /// The neuron cache's share of the RAM budget, when the MLP streams out of core.
    pub neuron_cache: Option<u64>,
    /// Prompt tokens per pass: the caller's, or the default for this store.
    pub batch: usize,
}

/// The default prompt tokens per pass when layers stream from disk: the largest of
/// 512, 256 and 128 (at most the context) whose activations and scratch take at most
/// an eighth of the RAM budget `ram`, else [`DEFAULT_BATCH`].
///
/// A pass reads every streamed layer once, whatever its tokens, so a prompt of 2,000
/// tokens in chunks of 64 reads the streamed weights 32 times, in chunks of 512 four
/// times. 512 is llama.cpp's micro-batch; an eighth keeps the chunk from taking the
/// layers' room in a small budget (in a 64 MiB cgroup SmolLM2 stays at 64).
pub fn streamed_batch(shape: &ModelShape, ctx: usize, ram: u64) -> usize {
    let ctx = ctx.max(1);
    [512usize, 256, 128]
        .into_iter()
        .map(|b| b.min(ctx))
        .find(|&b| {
            let r = Reserve::for_context(shape, ctx as u64, b as u64, ram);
            r.activations.saturating_add(r.scratch) <= ram / 8
        })
        .unwrap_or(DEFAULT_BATCH.min(ctx))
}

/// Prompt tokens per pass of a resident model when its reserve has room for them.
///
/// With 64 (the [`DEFAULT_BATCH`] a small budget keeps) a long prompt spends more of its
/// time outside the matrix products: SmolLM2's 1,943-token prompt ran at 485-502 tokens/s
/// at AVX2 on two threads, at 546-559 with 256 or 512 (at AVX-512, 698-737 against
/// 770-806; `ballast run -b B -n 1 -c 4096 -t 2`, alternated).
pub const RESIDENT_BATCH: usize = 256;

/// The default prompt tokens per pass of a resident model: [`RESIDENT_BATCH`] (at most
/// the context) when the weights and the context's reserve at that batch fit the RAM
/// budget `ram`, else `fallback`.
fn resident_batch(shape: &ModelShape, ctx: usize, ram: u64, fallback: usize) -> usize {
    let batch = RESIDENT_BATCH.min(ctx.max(1));
    let need = (shape.total_layer_bytes() + shape.head_bytes)
        .saturating_add(Reserve::for_context(shape, ctx as u64, batch as u64, ram).total());
    if need <= ram {
        batch
    } else {
        fallback
    }
}

/// What [`build`] works on: the model's file (and pack), where it lives, how it is
/// computed, for what context.
pub(crate) struct Source<'a> {
    pub file: &'a Arc<GgufFile>,
    pub pack: Option<&'a Arc<PackFile>>,
    pub path: &'a Path,
    pub mapped: bool,
    pub ctx: usize,
    /// Prompt tokens per pass; `None`: [`RESIDENT_BATCH`] resident where the budget
    /// sized for the store's choice has room, else [`DEFAULT_BATCH`]; [`streamed_batch`]
    /// when layers stream.
    pub batch: Option<usize>,
    /// Threads the process computes with (each holds scratch the budget reserves).
    pub threads: usize,
}

/// Builds the model of `src` with the store `opts` ask for, sized for its context and
/// prompt chunks, on `backend`; `neuron_cache`: the bytes the sparse MLP's neuron mode
/// takes from the RAM budget (its layers then stream without their up and down
/// matrices).
pub(crate) fn build(
    src: &Source<'_>,
    backend: Arc<dyn Backend>,
    opts: &StoreOptions,
    neuron_cache: Option<u64>,
) -> Result<Built> {
    let Source {
        file,
        pack,
        path,
        mapped,
        ctx,
        threads,
        ..
    } = *src;
    // A pass never holds more tokens than the context.
    let batch = src.batch.unwrap_or(DEFAULT_BATCH).clamp(1, ctx.max(1));
    // A backend with its own device (wgpu) gets a plan with a device tier.
    let separate_device = backend.executor().is_some();
    ensure!(
        opts.vram.is_none() || separate_device,
        "--vram is GPU memory, and this run computes on the CPU, from RAM: use --ram, or --device gpu"
    );
    let config = ModelConfig::from_gguf(file).at("loading", path)?;
    let (globals, mut layers) = load_weights(file, &config).at("loading", path)?;
    let mut shape = model_shape(&config, &globals, &layers);
    if separate_device {
        on_wgpu_device(&mut shape, Some(&globals));
    }
    let stream = &opts.stream;
    if stream.whole_experts {
        // Streamed layers are read whole, experts and all: their slots hold them.
        shape.expert_bytes.clear();
    }
    let budgeted = opts.ram.is_some() || opts.vram.is_some();
    // A pack streamed by tiers: the tiered store's readers decode each streamed layer
    // into its slot, from the pack's chunks read from disk or from the chunks it holds
    // in RAM (a coded RAM tier), so decoding runs in the prefetch pipeline.
    let tiered_pack = match (pack, opts.kind) {
        (Some(pack), StoreKind::Tiered) => Some(pack.clone()),
        (Some(pack), StoreKind::Auto) if budgeted => Some(pack.clone()),
        _ => None,
    };
    let finish = |config: ModelConfig, store: Box<dyn ballast_runtime::WeightStore>| {
        let ffn = ballast_runtime::ffn::for_config(&config);
        Model::from_parts(config, store, backend.clone(), ffn)
    };
    match (pack, opts.kind) {
        _ if tiered_pack.is_some() => {}
        (Some(pack), StoreKind::Auto | StoreKind::Compressed) => {
            let codec = &opts.codec;
            let store_opts = ballast_weight_codec::StoreOptions {
                policy: codec.cache.policy(),
                keep_layers: codec.keep_layers,
                prefetch: codec.prefetch,
                decode_threads: codec.decode_threads.max(1),
                // A device of its own decodes what it can (a pack made with
                // `--codec gpu`): streamed layers go up coded.
                device_decode: separate_device,
            };
            let store = CompressedStore::new(pack.clone(), globals, layers, store_opts, mapped)
                .at("loading", path)?;
            if separate_device {
                // Decoded layers are lent per pass: the device uploads them into slots.
                if let Some(memory) = backend.residency() {
                    memory.set_stream_slots(2);
                }
            }
            let stats = store.stats_handle();
            return Ok(Built {
                model: finish(config, Box::new(store)),
                tiered: None,
                compressed: Some(stats),
                store_name: "compressed",
                ram_budget: None,
                vram_budget: None,
                neuron_cache: None,
                batch,
            });
        }
        (None, StoreKind::Compressed) => {
            return Err(Error::Invalid(format!(
                "{}: --store compressed needs a pack (make one with `ballast pack`)",
                path.display()
            )))
        }
        _ => {}
    }
    let own = process_reserve(Some(file), threads);
    // Sized once: the choice of a store and the plan see the same budget.
    let mut sized = None;
    let kind = match opts.kind {
        StoreKind::Auto if budgeted => StoreKind::Tiered,
        StoreKind::Auto => {
            let ram = sized
                .insert(budget_beside(ram_budget(None, own)?, opts.beside.as_ref())?)
                .bytes;
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
        // A budget sized for the choice above may allow longer prompt chunks.
        let batch = match (src.batch, sized.as_ref()) {
            (None, Some(budget)) => resident_batch(&shape, ctx, budget.bytes, batch),
            _ => batch,
        };
        let store = ResidentStore::new(globals, layers, mapped);
        return Ok(Built {
            model: finish(config, Box::new(store)),
            tiered: None,
            compressed: None,
            store_name: if mapped { "mmap" } else { "ram" },
            ram_budget: sized,
            vram_budget: None,
            neuron_cache: None,
            batch,
        });
    }
    let RamBudget { bytes: ram, source } = match sized {
        Some(sized) => sized,
        None => budget_beside(ram_budget(opts.ram, own)?, opts.beside.as_ref())?,
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
            if stream.whole_experts {
                shape.expert_bytes.clear();
            }
            ensure!(
                bytes < ram,
                "the neuron cache ({}) does not fit the RAM budget ({}): lower --neuron-slots",
                human_bytes(bytes),
                human_bytes(ram)
            );
            Some(bytes)
        }
        _ => None,
    };
    let ram_for_weights = ram - neuron_cache.unwrap_or(0);
    let batch = match src.batch {
        Some(_) => batch,
        None => streamed_batch(&shape, ctx, ram_for_weights),
    };
    let device = if separate_device {
        let vram = opts.vram.ok_or_else(|| {
            Error::Invalid("tiered streaming on the GPU needs --vram (wgpu cannot tell how much memory the GPU has)".into())
        })?;
        Some(vram.bytes())
    } else {
        None
    };
    let mut compressed = None;
    let beneath_pack = match &tiered_pack {
        Some(pack) => {
            // The streamed layers' chunks come from disk as the plain file's layers do:
            // read directly, not kept in the page cache (unless direct I/O is off).
            if stream.direct_io {
                pack.read_chunks_from_disk().at("opening", path)?;
            }
            let (store, decode_bytes_per_s) =
                decoding_store(pack, globals.clone(), layers.clone(), mapped)
                    .at("loading", path)?;
            shape.stored_bytes = store.stored_bytes_per_layer();
            shape.decode_bytes_per_s = decode_bytes_per_s;
            shape.decode_readers = stream.io_threads.max(1);
            // Experts are read one by one from a file, not from a pack.
            shape.expert_bytes.clear();
            compressed = Some(store.stats_handle());
            Some(store)
        }
        None => None,
    };
    // Streaming a pack holds more than its layers: the embedding rows it decodes on
    // demand (a few chunks; a head tied to the table is the same tensor, counted with
    // the head), and in each reader the piece of coded form it reads and decodes at
    // once. The budget pays for both.
    let pack_held = match &beneath_pack {
        Some(store) => {
            use ballast_runtime::store::{CodedLayers, WeightStore};
            // An untied table's rows are decoded on demand (a tied one is the head); a
            // device uploads the table whole, decoded whole on the host first.
            let embedding = if separate_device && !globals.tied() {
                globals.token_embd().bytes.len() as u64
            } else {
                store.embedding_rows_held()
            };
            let piece = (0..store.n_layers())
                .map(|i| store.read_decode_held(i))
                .max()
                .unwrap_or(0);
            embedding + stream.io_threads.max(1) as u64 * piece
        }
        None => 0,
    };
    ensure!(
        pack_held < ram_for_weights,
        "streaming the pack holds {} beside its layers (decoded embedding rows and a piece of coded layer per reader), more than the RAM budget ({}): stream the plain file instead",
        human_bytes(pack_held),
        human_bytes(ram_for_weights)
    );
    let ram_for_weights = ram_for_weights - pack_held;
    let request = PlanRequest {
        shape: shape.clone(),
        budgets: Budgets {
            device,
            ram: ram_for_weights,
        },
        ctx: ctx as u64,
        batch: batch as u64,
        depth: stream.prefetch_depth.max(1),
        ram_tier: opts.codec.ram_tier.for_plan(),
    };
    let p = match plan(&request) {
        Ok(p) => p,
        // The KV cache grows with the context: say which context would fit.
        Err(e) => {
            return Err(match largest_context(&request) {
                Some(fits) if device.is_none() && fits < request.ctx => {
                    Error::ContextTooLong(ContextTooLong {
                        ctx: request.ctx,
                        fits,
                        budget: ram,
                        budget_source: source,
                        refusal: e.to_string(),
                    })
                }
                _ => Error::Budget {
                    budget: ram,
                    budget_source: source,
                    source: Box::new(e),
                },
            })
        }
    };
    let options = TieredOptions {
        io_threads: stream.io_threads.max(1),
        whole_experts: stream.whole_experts,
        expert_cache_bytes: match stream.expert_cache {
            Some(size) => size.bytes(),
            None if p.unified => ram.saturating_sub(p.device_used()),
            None => 0,
        },
    };
    let store = match beneath_pack {
        Some(inner) => TieredStore::over_coded(Arc::new(inner), &p, options)?,
        None => {
            let reader = DirectFile::open(path, stream.direct_io).at("streaming from", path)?;
            TieredStore::new(file, globals, layers, &p, Arc::new(reader), options)?
        }
    };
    if !p.unified {
        // Tiers B and C are uploaded per use into the device slots the plan sized.
        if let Some(memory) = backend.residency() {
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
    Ok(Built {
        model: finish(config, Box::new(store)),
        tiered: Some(info),
        compressed,
        ram_budget: Some(RamBudget { bytes: ram, source }),
        vram_budget: device,
        neuron_cache,
        batch,
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
    pack: &Arc<PackFile>,
    globals: GlobalWeights,
    layers: Vec<LayerWeights>,
    mapped: bool,
) -> Result<(CompressedStore, f64)> {
    use ballast_runtime::WeightStore;
    let largest = (0..layers.len())
        .max_by_key(|&i| layers[i].byte_size())
        .unwrap_or(0);
    let store = CompressedStore::new(
        pack.clone(),
        globals,
        layers,
        ballast_weight_codec::StoreOptions {
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

/// The shape tiered streaming plans for the model file at `path` (`ballast plan`'s
/// question: where would each layer live), as [`EngineBuilder::build`] sees it: a pack
/// with its stored sizes and a decode speed measured now; `on_gpu`: with what the wgpu
/// backend keeps on its device. Returns the shape and the file opened.
///
/// [`EngineBuilder::build`]: crate::EngineBuilder::build
pub fn planned_shape(path: &Path, on_gpu: bool) -> Result<(ModelShape, Opened)> {
    let opened = open_model(path, true, StoreKind::Tiered)?;
    let config = ModelConfig::from_gguf(&opened.file).at("loading", path)?;
    let (globals, layers) = load_weights(&opened.file, &config).at("loading", path)?;
    let mut shape = model_shape(&config, &globals, &layers);
    if let Some(pack) = &opened.pack {
        let (store, decode) =
            decoding_store(pack, globals.clone(), layers, true).at("loading", path)?;
        shape.stored_bytes = store.stored_bytes_per_layer();
        shape.decode_bytes_per_s = decode;
        // The readers a tiered store runs by default read and decode side by side.
        shape.decode_readers = StreamOptions::default().io_threads;
        shape.expert_bytes.clear();
    }
    if on_gpu {
        on_wgpu_device(&mut shape, Some(&globals));
    }
    Ok((shape, opened))
}

/// What the wgpu backend keeps on its device beyond the layers: the session's KV cache,
/// counted at f32 (the default there; an upper bound for f16 and q8) and held there
/// alone (a `DeviceKv`: no host record), and it looks tokens up on the device, so an
/// embedding table that is not the output head is uploaded whole beside it (`globals`,
/// when the model is known).
pub fn on_wgpu_device(shape: &mut ModelShape, globals: Option<&GlobalWeights>) {
    shape.kv_value_bytes = 4;
    shape.kv_on_device_only = true;
    if let Some(g) = globals.filter(|g| !g.tied()) {
        shape.head_bytes += g.token_embd().bytes.len() as u64;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    /// Llama-3.1-8B's shape at about 4.8 bits per weight.
    fn llama_8b() -> ModelShape {
        ModelShape::from_dims(32, 4096, 32, 8, 14336, 128256, 4.8, 6.5)
    }

    /// SmolLM2-135M's shape.
    fn smollm2() -> ModelShape {
        ModelShape::from_dims(30, 576, 9, 3, 1536, 49152, 4.5, 8.5)
    }

    #[test]
    fn streamed_batch_is_512_when_the_budget_has_room() {
        assert_eq!(streamed_batch(&llama_8b(), 4096, 2048 * MIB), 512);
        assert_eq!(streamed_batch(&llama_8b(), 4096, 1024 * MIB), 512);
    }

    #[test]
    fn streamed_batch_shrinks_with_the_budget_and_the_context() {
        // 512 tokens of an 8B's activations and scratch are about 120 MiB.
        assert_eq!(streamed_batch(&llama_8b(), 4096, 768 * MIB), 256);
        assert_eq!(streamed_batch(&llama_8b(), 4096, 200 * MIB), DEFAULT_BATCH);
        // What a 64 MiB cgroup leaves SmolLM2 keeps the resident default.
        assert_eq!(streamed_batch(&smollm2(), 196, 18 * MIB), DEFAULT_BATCH);
        // Never more than the context.
        assert_eq!(streamed_batch(&llama_8b(), 100, 2048 * MIB), 100);
        assert_eq!(streamed_batch(&smollm2(), 40, 18 * MIB), 40);
    }

    #[test]
    fn resident_batch_is_longer_only_where_the_budget_has_room() {
        let shape = smollm2();
        assert_eq!(resident_batch(&shape, 4096, 2048 * MIB, 64), RESIDENT_BATCH);
        // Never more than the context.
        assert_eq!(resident_batch(&shape, 100, 2048 * MIB, 64), 100);
        // Where the weights and the reserve at 256 tokens do not fit, the fallback.
        for ram in [MIB, 64 * MIB, shape.total_layer_bytes() + shape.head_bytes] {
            assert_eq!(resident_batch(&shape, 4096, ram, 64), 64, "{ram} bytes");
        }
    }

    #[test]
    fn streamed_batch_keeps_its_share_of_the_budget() {
        for ram_mib in [16u64, 64, 256, 1024, 4096] {
            let shape = llama_8b();
            let ram = ram_mib * MIB;
            let b = streamed_batch(&shape, 8192, ram);
            let r = Reserve::for_context(&shape, 8192, b as u64, ram);
            assert!(
                b == DEFAULT_BATCH || r.activations + r.scratch <= ram / 8,
                "{b} tokens at {ram_mib} MiB"
            );
        }
    }
}
