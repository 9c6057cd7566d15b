//! What every command shares: finding the model, loading it, sampling flags.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use ballast_kv_cache::{new_cache, PolicyKind, Precision, StreamingLlm, UpdateMode};
use ballast_runtime::gguf::GgufFile;
use ballast_runtime::gpu::{DeviceChoice, GpuContext};
use ballast_runtime::{
    model_cache, Backend, CpuBackend, KvCache, KvPolicy, Model, SamplerConfig, Tokenizer,
    WgpuBackend,
};
use ballast_sparse_mlp::{SparseFfn, SparsityProfile};
use clap::Args;

/// Flags that choose and load a model.
#[derive(Args, Clone, Debug)]
pub struct ModelArgs {
    /// GGUF model file, a pack made by `ballast pack`, or the name of a model
    /// `ballast fetch-model --list` shows (fetched on first use). Default: the default
    /// model (smollm2-135m), fetched on first use.
    #[arg(short = 'm', long)]
    pub model: Option<PathBuf>,
    /// Threads to compute with. Default: every core.
    #[arg(short = 't', long)]
    pub threads: Option<usize>,
    /// Read the weights into RAM instead of memory-mapping the file.
    #[arg(long)]
    pub no_mmap: bool,
    /// Where to compute: cpu, gpu (wgpu: Vulkan, Metal or DX12; a real GPU before a
    /// software one) or auto (a real GPU, else a software one, else the CPU).
    #[arg(long, default_value = "cpu", value_parser = parse_device)]
    pub device: DeviceChoice,
    #[command(flatten)]
    pub store: crate::tiered::StoreArgs,
    #[command(flatten)]
    pub sparse: SparsityArgs,
}

/// The sparse MLP's flags, shared by every command that runs a model.
#[derive(Args, Debug, Clone, Default)]
pub struct SparsityArgs {
    /// Skip this fraction of MLP neurons (0 to below 1), those whose gate activation is
    /// smallest (CATS thresholds per layer; approximate: see `ballast perplexity`).
    /// `--sparsity` alone means 0.15, the most that kept SmolLM2's perplexity on GPL-3
    /// within 3% of dense (+1.2%; 0.2 gave +3.1%). Needs the model's sparsity profile,
    /// which `ballast sparsify` makes; if the profile has a predictor (`sparsify
    /// --rank`), only the gate rows of the neurons it predicts are computed (row mode).
    /// With the neuron file (`ballast sparsify --neurons`) the neuron mode is used (see
    /// --sparse-mode): with --store tiered it keeps the MLP's up and down weights out of
    /// core and reads only the active neurons a cache lacks. Both modes read fewer MLP
    /// bytes but decode slower than dense when the weights are resident.
    #[arg(long, num_args = 0..=1, default_missing_value = "0.15")]
    pub sparsity: Option<f32>,
    /// The sparsity profile for --sparsity. Default: MODEL.sparsity beside the model.
    #[arg(long)]
    pub sparsity_profile: Option<PathBuf>,
    /// With a predictor: compute a neuron's gate row (row mode), or fetch its record
    /// while attention runs (neuron mode, --prefetch), when a gate value within this many of its
    /// error scales (standard deviations on the calibration text) of the prediction
    /// would pass the threshold. Larger loses fewer neurons and reads more.
    #[arg(long, default_value_t = 1.0)]
    pub predictor_margin: f32,
    /// Ignore the profile's predictor: compute every gate row (row mode).
    #[arg(long)]
    pub no_predictor: bool,
    /// Neuron mode: fetch the records of the neurons predicted from each layer's
    /// attention input while attention runs (Tricksy, Deja Vu), with the profile's
    /// attention-input predictor (`ballast sparsify --rank`) and --predictor-margin.
    /// Results are the same; it moves reads earlier. Measured on SmolLM2 it does not
    /// pay: the predictor's guesses read more than they save (see the README).
    #[arg(long)]
    pub prefetch: bool,
    /// Also compute the whole gate, to count the neurons the predictor loses (its
    /// recall, printed by `bench`). For measurement: it reads the gate twice.
    #[arg(long)]
    pub measure_recall: bool,
    /// How --sparsity computes: `neurons` (the neuron mode: each layer's active neurons
    /// are read from the neuron file MODEL.neurons, which `ballast sparsify --neurons`
    /// writes, into a cache of --neuron-slots per layer, and the MLP is computed over
    /// them, up row and down column of a neuron read together), `rows` (the row mode:
    /// the model's own up rows of the active neurons, the down projection dense), or
    /// `auto`: neurons when the neuron file exists, else rows.
    #[arg(long, default_value = "auto", value_parser = ["auto", "rows", "neurons"])]
    pub sparse_mode: String,
    /// The neuron file for the neuron mode. Default: MODEL.neurons beside the model.
    #[arg(long)]
    pub neuron_file: Option<PathBuf>,
    /// Neuron mode: slots of the neuron cache per layer, as a fraction of the layer's
    /// neurons (1: every neuron can stay cached; less: the least recently used are
    /// evicted and fetched again from the file when a token needs them).
    #[arg(long, default_value_t = 1.0)]
    pub neuron_slots: f64,
    /// Neuron mode: reads of records in flight at once when a layer fetches many (1:
    /// one at a time). Out of core a record is a scattered 4 KiB read, and a disk
    /// serves several side by side; from the page cache a read is a copy. Default: 8
    /// when the layers stream (--store tiered), else 1.
    #[arg(long)]
    pub neuron_readers: Option<usize>,
}

impl ModelArgs {
    /// Whether to memory-map the file (tiered streaming maps it for its header only).
    pub fn mapped(&self) -> bool {
        !self.no_mmap && self.store.store != crate::tiered::StoreKind::Ram
    }
}

/// Parses `--device`.
pub fn parse_device(s: &str) -> std::result::Result<DeviceChoice, String> {
    s.parse().map_err(|e: ballast_runtime::Error| e.to_string())
}

/// The backend `device` asks for, computing with `threads` threads on the CPU. With a
/// GPU, the adapter is named on stderr; `auto` says so when it falls back to the CPU.
pub fn backend(device: DeviceChoice, threads: usize) -> Result<Arc<dyn Backend>> {
    let gpu = GpuContext::choose(device, &mut |line| eprintln!("{line}"))
        .with_context(|| format!("--device {device}"))?;
    Ok(match gpu {
        Some(ctx) => {
            eprintln!("device: {} (wgpu)", ctx.adapter());
            Arc::new(WgpuBackend::new(ctx))
        }
        None => Arc::new(CpuBackend::new(threads)),
    })
}

/// Flags of the sampler (llama.cpp's names and defaults).
#[derive(Args, Clone, Debug)]
pub struct SamplingArgs {
    /// Temperature; 0 is greedy (always the most likely token).
    #[arg(long, default_value_t = 0.8, value_parser = non_negative)]
    pub temp: f32,
    /// Keep only the k most likely tokens (0: all).
    #[arg(long, default_value_t = 40)]
    pub top_k: usize,
    /// Keep the smallest set of tokens whose probability adds up to p (1.0: all).
    #[arg(long, default_value_t = 0.95, value_parser = unit_interval)]
    pub top_p: f32,
    /// Drop tokens less likely than min-p times the most likely one (0: none).
    #[arg(long, default_value_t = 0.05, value_parser = unit_interval)]
    pub min_p: f32,
    /// Penalty for repeating any of the last tokens (1.0: none).
    #[arg(long, default_value_t = 1.0, value_parser = positive)]
    pub repeat_penalty: f32,
    /// How many last tokens the repeat penalty looks at.
    #[arg(long, default_value_t = 64)]
    pub repeat_last_n: usize,
    /// Random seed (same seed, same text).
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
}

fn finite(s: &str) -> std::result::Result<f32, String> {
    match s.parse::<f32>() {
        Ok(v) if v.is_finite() => Ok(v),
        _ => Err(format!("`{s}` is not a finite number")),
    }
}

/// A number at least 0 (a temperature).
fn non_negative(s: &str) -> std::result::Result<f32, String> {
    let v = finite(s)?;
    if v < 0.0 {
        return Err(format!("{v} is negative; 0 is greedy"));
    }
    Ok(v)
}

/// A probability, from 0 to 1.
fn unit_interval(s: &str) -> std::result::Result<f32, String> {
    let v = finite(s)?;
    if !(0.0..=1.0).contains(&v) {
        return Err(format!("{v} is not between 0 and 1"));
    }
    Ok(v)
}

/// A number above 0 (a penalty divides by it).
fn positive(s: &str) -> std::result::Result<f32, String> {
    let v = finite(s)?;
    if v <= 0.0 {
        return Err(format!("{v} is not above 0; 1 is no penalty"));
    }
    Ok(v)
}

impl SamplingArgs {
    /// The sampler configuration these flags describe.
    pub fn config(&self) -> SamplerConfig {
        SamplerConfig {
            temperature: self.temp,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            repeat_penalty: self.repeat_penalty,
            repeat_last_n: self.repeat_last_n,
            seed: self.seed,
        }
    }
}

/// The model file to use: the file named, a known model's name (fetched into the cache
/// if needed), or the default model (likewise), with a spinner on stderr while fetching.
pub fn resolve_model(named: Option<&Path>) -> Result<PathBuf> {
    let known = match named {
        None => &model_cache::DEFAULT_MODEL,
        Some(p) if p.is_file() => return Ok(p.to_path_buf()),
        Some(p) => match p.to_str().and_then(model_cache::known_model) {
            Some(known) => known,
            None => anyhow::bail!(
                "model file {} does not exist (nor is it a model `ballast fetch-model` knows: {})",
                p.display(),
                known_model_names()
            ),
        },
    };
    fetch_known(known)
}

/// The names `fetch-model` and `-m` accept, comma-separated.
pub fn known_model_names() -> String {
    let names: Vec<&str> = model_cache::KNOWN_MODELS.iter().map(|m| m.name).collect();
    names.join(", ")
}

/// The cached path of a known model, fetched first (with a spinner) if needed.
pub fn fetch_known(known: &model_cache::KnownModel) -> Result<PathBuf> {
    let cached = model_cache::model_path(known)?;
    if cached.is_file() {
        return Ok(cached);
    }
    let bar = indicatif::ProgressBar::new_spinner();
    bar.enable_steady_tick(Duration::from_millis(120));
    let path = model_cache::ensure_model(known, |line| bar.set_message(line.to_string()));
    bar.finish_and_clear();
    let path = path.with_context(|| format!("fetching the model {}", known.name))?;
    eprintln!("{} cached at {}", known.name, path.display());
    Ok(path)
}

/// A loaded model with its tokenizer and file.
pub struct Loaded {
    pub file: Arc<GgufFile>,
    pub tokenizer: Tokenizer,
    pub model: Model,
    /// The plan and counters when the weights stream.
    pub tiered: Option<crate::tiered::TieredInfo>,
    /// The counters of the compressed store, when the model is a pack.
    pub compressed: Option<ballast_weight_codec::store::StatsHandle>,
}

/// A model file opened: a GGUF, or a pack with the GGUF it decodes to.
pub struct Opened {
    /// The GGUF file (for a pack: decoded in memory; with `--store compressed` or
    /// auto, without the layers' matrices, which the compressed store decodes per use).
    pub file: Arc<GgufFile>,
    /// The pack, when the file is one.
    pub pack: Option<Arc<ballast_weight_codec::PackFile>>,
}

/// Opens `path` as a GGUF file or, if it is a pack, as the GGUF it decodes to: whole
/// for the stores that read a plain file (mmap, ram), without the layers' matrices for
/// the stores that decode them from the pack (`--store compressed`, tiered, or auto).
pub fn open_model(path: &Path, mapped: bool, store: crate::tiered::StoreKind) -> Result<Opened> {
    use crate::tiered::StoreKind;
    if !ballast_weight_codec::is_pack(path) {
        let file =
            GgufFile::open(path, mapped).with_context(|| format!("opening {}", path.display()))?;
        return Ok(Opened {
            file: Arc::new(file),
            pack: None,
        });
    }
    let pack = ballast_weight_codec::PackFile::open(path, mapped)
        .with_context(|| format!("opening the pack {}", path.display()))?;
    let t = threads(None);
    if store == StoreKind::Tiered && mapped {
        // Tiered streaming reads the pack's chunks from disk, not through the map: the
        // head and norms decoded now leave no mapped pages of the pack behind, which
        // would hold memory (and a cgroup's page cache) outside the budget.
        pack.read_chunks_from_disk()
            .with_context(|| format!("opening the pack {}", path.display()))?;
    }
    // The stores that decode layers on demand (compressed, and tiered, which streams
    // from one) need only the skeleton.
    let file = match store {
        StoreKind::Auto | StoreKind::Compressed | StoreKind::Tiered => {
            ballast_weight_codec::store::skeleton(&pack, t)
        }
        StoreKind::Mmap | StoreKind::Ram => pack.to_gguf(t),
    }
    .with_context(|| format!("decoding the pack {}", path.display()))?;
    Ok(Opened {
        file: Arc::new(file),
        pack: Some(Arc::new(pack)),
    })
}

/// Threads to use: the flag, else every core.
pub fn threads(flag: Option<usize>) -> usize {
    flag.unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
        .max(1)
}

/// Opens, parses and loads a model for `threads` threads, a context of `ctx` tokens
/// and prompt chunks of `batch` (which size the reserves of tiered streaming).
pub fn load(args: &ModelArgs, threads: usize, ctx: usize, batch: usize) -> Result<Loaded> {
    let path = resolve_model(args.model.as_deref())?;
    let Opened { file, pack } = open_model(&path, args.mapped(), args.store.store)?;
    let tokenizer = Tokenizer::from_gguf(&file)
        .with_context(|| format!("building the tokenizer of {}", path.display()))?;
    let backend = backend(args.device, threads)?;
    let reserve = neuron_reserve(&args.sparse, &args.store, &path, &file)?;
    let built = crate::tiered::build(
        &file,
        pack.as_ref(),
        &path,
        backend,
        &args.store,
        args.mapped(),
        ctx,
        batch,
        false,
        reserve.bytes,
    )?;
    let out_of_core = built.tiered.is_some();
    let (model, _) = apply_sparsity(
        &args.sparse,
        &path,
        &file,
        built.model,
        out_of_core,
        reserve.profile,
    )?;
    Ok(Loaded {
        file,
        tokenizer,
        model,
        tiered: built.tiered,
        compressed: built.compressed,
    })
}

/// `model` (read from `path`) with the sparse MLP of `args` installed (the profile at
/// `--sparsity-profile`, else beside the model, read and checked against the model;
/// its predictor unless `--no-predictor`) and its counters, or the model as it is
/// without a sparsity. `out_of_core`: the layers stream (tiered), so the neuron file is
/// read from the disk rather than from the page cache (the default of
/// `--neuron-readers`). `preloaded`: the profile if [`neuron_reserve`] read it already
/// (before the model took its budget), else it is read here.
pub fn apply_sparsity(
    args: &SparsityArgs,
    path: &Path,
    file: &GgufFile,
    model: Model,
    out_of_core: bool,
    preloaded: Option<SparsityProfile>,
) -> Result<(Model, Option<SparseCounters>)> {
    let Some(sparsity) = args.sparsity else {
        return Ok((model, None));
    };
    ensure_silu_mlp(&model, path)?;
    let profile_path = profile_path(args, path);
    anyhow::ensure!(
        profile_path.exists(),
        "--sparsity needs the model's sparsity profile, and {} does not exist: make it with `ballast sparsify -m {}`",
        profile_path.display(),
        path.display()
    );
    anyhow::ensure!(
        args.predictor_margin.is_finite() && args.predictor_margin >= 0.0,
        "--predictor-margin {}: it must be a number of at least 0",
        args.predictor_margin
    );
    let config = model.config();
    // Only the predictor the mode uses is built: the neuron mode's prefetch, or the row
    // mode's (a predictor of a larger model is tens of MB).
    let neuron_mode = neurons_path(args, path)?.is_some();
    let profile = match preloaded {
        Some(profile) => profile,
        None => SparsityProfile::load_wanting(
            &profile_path,
            ballast_kv_cache::model_fingerprint(file),
            config.n_layers,
            config.n_ff,
            ballast_sparse_mlp::Wanted {
                predictor: !neuron_mode && !args.no_predictor,
                attention_predictor: neuron_mode && args.prefetch,
            },
        )?,
    };
    let thresholds = profile.thresholds(sparsity).context("--sparsity")?;
    let mut ffn = SparseFfn::new(thresholds);
    if let Some(source) = neuron_source(args, path, file, &model)? {
        let attention_predictor = profile.attention_predictor;
        // Out of core a fetch waits on the disk, and reads in flight side by side pay;
        // from the page cache they are copies, which threads only slow (SmolLM2 at
        // sparsity 0.4 with 60% of slots: 47.6 t/s with 1, 35.4 with 8).
        let readers = args.neuron_readers.unwrap_or(if out_of_core {
            ballast_sparse_mlp::DEFAULT_READERS
        } else {
            1
        });
        anyhow::ensure!(readers >= 1, "--neuron-readers {readers}: at least 1");
        ffn = ffn
            .with_neurons(source, neuron_slots(args, config.n_ff)?, model.backend())?
            .with_readers(readers);
        anyhow::ensure!(
            args.prefetch || !args.measure_recall,
            "--measure-recall in the neuron mode measures the prefetch's predictor: add --prefetch"
        );
        if args.prefetch {
            let predictor = attention_predictor.with_context(|| {
                format!(
                    "--prefetch needs the attention-input predictor, and {} has none: make the profile again with `ballast sparsify --rank R`",
                    profile_path.display()
                )
            })?;
            ffn = ffn.with_prefetch(predictor, args.predictor_margin)?;
        }
        let stats = ffn.stats();
        return Ok((model.share_with_ffn(Box::new(ffn)), Some(stats)));
    }
    anyhow::ensure!(
        !args.prefetch,
        "--prefetch fetches neuron records: it needs the neuron mode (--sparse-mode neurons and the neuron file, `ballast sparsify -m {} --neurons`)",
        path.display()
    );
    match profile.predictor {
        Some(predictor) if !args.no_predictor => {
            ffn = ffn.with_predictor(predictor, args.predictor_margin);
            if args.measure_recall {
                ffn = ffn.measure_recall();
            }
        }
        _ => anyhow::ensure!(
            !args.measure_recall,
            "--measure-recall needs a predictor: {} has none (`ballast sparsify --rank`)",
            profile_path.display()
        ),
    }
    let stats = ffn.stats();
    Ok((model.share_with_ffn(Box::new(ffn)), Some(stats)))
}

/// The neuron file when `--sparsity` runs in the neuron mode (`--sparse-mode`; `auto`:
/// if the file exists), else `None`.
fn neurons_path(args: &SparsityArgs, path: &Path) -> Result<Option<PathBuf>> {
    if args.sparsity.is_none() {
        return Ok(None);
    }
    let neurons_path = args
        .neuron_file
        .clone()
        .unwrap_or_else(|| ballast_sparse_mlp::neuron_file_path(path));
    match args.sparse_mode.as_str() {
        "rows" => return Ok(None),
        "auto" if !neurons_path.exists() => return Ok(None),
        _ => {}
    }
    anyhow::ensure!(
        neurons_path.exists(),
        "--sparse-mode neurons needs the neuron file, and {} does not exist: make it with `ballast sparsify -m {} --neurons`",
        neurons_path.display(),
        path.display()
    );
    Ok(Some(neurons_path))
}

/// What the neuron mode takes from the RAM budget, worked out before the model is built.
#[derive(Default)]
pub struct NeuronReserve {
    /// With tiered streaming (`--store tiered`, or `--ram`) in the neuron mode: the
    /// bytes of the neuron cache (layers × `--neuron-slots` of their neurons × a record,
    /// and with `--prefetch` its predictor), which the plan counts inside the RAM
    /// budget; the layers then stream without their up and down matrices.
    pub bytes: Option<u64>,
    /// The sparsity profile (with `--prefetch` its predictor), read here so that its
    /// file (tens of MB with predictors) is not read on top of the model's budget: hand
    /// it to [`apply_sparsity`].
    pub profile: Option<SparsityProfile>,
}

/// The [`NeuronReserve`] of `sparse` and `store` for the model at `path`.
pub fn neuron_reserve(
    sparse: &SparsityArgs,
    store: &crate::tiered::StoreArgs,
    path: &Path,
    file: &GgufFile,
) -> Result<NeuronReserve> {
    use crate::tiered::StoreKind;
    let tiered = match store.store {
        StoreKind::Tiered => true,
        StoreKind::Auto => store.ram.is_some(),
        _ => false,
    };
    if !tiered {
        return Ok(NeuronReserve::default());
    }
    let Some(neurons_path) = neurons_path(sparse, path)? else {
        return Ok(NeuronReserve::default());
    };
    let config = ballast_runtime::model::ModelConfig::from_gguf(file)?;
    let f = open_neurons(&neurons_path, file, &config)?;
    let cache = (config.n_layers * neuron_slots(sparse, config.n_ff)?) as u64
        * f.header().layout.record_bytes() as u64;
    let profile_path = profile_path(sparse, path);
    let profile = if profile_path.exists() {
        Some(SparsityProfile::load_wanting(
            &profile_path,
            ballast_kv_cache::model_fingerprint(file),
            config.n_layers,
            config.n_ff,
            ballast_sparse_mlp::Wanted {
                predictor: false,
                attention_predictor: sparse.prefetch,
            },
        )?)
    } else {
        // `apply_sparsity` names what is missing.
        None
    };
    let predictor_bytes: u64 = profile
        .as_ref()
        .and_then(|p| p.attention_predictor.as_ref())
        .map_or(0, |p| {
            p.layers
                .iter()
                .map(|l| (l.bytes() + l.sigma.len() * 4) as u64)
                .sum()
        });
    Ok(NeuronReserve {
        bytes: Some(cache + predictor_bytes),
        profile,
    })
}

/// The sparsity profile `--sparsity` reads: `--sparsity-profile`, else beside the model.
fn profile_path(args: &SparsityArgs, model: &Path) -> PathBuf {
    args.sparsity_profile
        .clone()
        .unwrap_or_else(|| SparsityProfile::path_for(model))
}

/// The neuron file at `neurons`, checked against the model of `file`.
fn open_neurons(
    neurons: &Path,
    file: &GgufFile,
    config: &ballast_runtime::model::ModelConfig,
) -> Result<ballast_sparse_mlp::NeuronFile> {
    // The up type from the file's tensor table: asking a streaming store for a layer
    // outside a pass would disturb its pipeline.
    Ok(ballast_sparse_mlp::NeuronFile::open(
        neurons,
        ballast_kv_cache::model_fingerprint(file),
        config.n_layers,
        config.n_ff,
        config.d_model,
        file.tensor("blk.0.ffn_up.weight")?.ty,
    )?)
}

/// `--neuron-slots` as slots per layer of `n_ff` neurons.
fn neuron_slots(args: &SparsityArgs, n_ff: usize) -> Result<usize> {
    anyhow::ensure!(
        args.neuron_slots > 0.0 && args.neuron_slots <= 1.0,
        "--neuron-slots {}: a fraction of the layer's neurons, above 0 and at most 1",
        args.neuron_slots
    );
    Ok(((n_ff as f64 * args.neuron_slots).ceil() as usize).max(1))
}

/// The neuron file `--sparse-mode` asks for (`auto`: if it exists), opened and checked
/// against the model, or `None` for the row mode.
fn neuron_source(
    args: &SparsityArgs,
    path: &Path,
    file: &GgufFile,
    model: &Model,
) -> Result<Option<Arc<dyn ballast_sparse_mlp::NeuronSource>>> {
    let Some(neurons_path) = neurons_path(args, path)? else {
        return Ok(None);
    };
    let f = open_neurons(&neurons_path, file, model.config())?;
    Ok(Some(Arc::new(f)))
}

/// The sparse MLP thresholds `|silu(gate)|`: a model whose MLP has another activation
/// (gemma3's GELU) is refused, never run wrong.
pub fn ensure_silu_mlp(model: &Model, path: &Path) -> Result<()> {
    let config = model.config();
    anyhow::ensure!(
        config.ffn_act == ballast_runtime::model::blocks::Activation::Silu,
        "{}: the sparse MLP is for SiLU-gated MLPs, and this {} model's MLP is {:?}-gated",
        path.display(),
        config.arch.name(),
        config.ffn_act
    );
    Ok(())
}

/// The counters of an installed sparse MLP.
pub type SparseCounters = Arc<std::sync::Mutex<ballast_sparse_mlp::SparseStats>>;

/// `n` bytes in a human unit.
pub fn human_bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = n as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{n} B")
    } else {
        format!("{v:.1} {}", UNITS[u])
    }
}

/// A KV cache and the policy that may evict from it.
pub type CacheAndPolicy = (Box<dyn KvCache>, Option<Box<dyn KvPolicy>>);

/// Flags that choose the KV cache: update mode, precision, eviction policy.
#[derive(Args, Clone, Debug)]
pub struct KvArgs {
    /// How the cache updates: `ring` (pointer shift: eviction moves an offset),
    /// `shift` (shift-concat: eviction memmoves the kept tokens), `mask` (smart mask:
    /// evicted slots are masked and reused).
    #[arg(long = "kv-mode", default_value = "ring")]
    pub mode: UpdateMode,
    /// Element type of cached keys and values: f32, f16 or q8 (int8 with an f16 scale
    /// per 32 values; approximate). Default: f16 on the CPU (llama.cpp's default); f32
    /// on a GPU, where the device's own summation order over f16 rows moves greedy ids
    /// off llama.cpp's on the golden prompts. On a GPU the rows live on the device in
    /// this type (q8: 34 bytes per 32 values there too).
    #[arg(long = "kv-dtype")]
    pub dtype: Option<Precision>,
    /// What to evict: `none` (the cache grows to the context, then an error),
    /// `window` (the most recent --window tokens), `streaming` (StreamingLLM: --sink
    /// first tokens plus the most recent --window).
    #[arg(long = "kv-policy", default_value = "none", value_parser = ["none", "window", "streaming"])]
    pub policy: String,
    /// Attention sinks kept by `--kv-policy streaming`.
    #[arg(long, default_value_t = 4)]
    pub sink: usize,
    /// Recent tokens kept by `--kv-policy window|streaming`. Default: the context
    /// minus the sinks.
    #[arg(long)]
    pub window: Option<usize>,
}

impl KvArgs {
    /// The element type asked for, else the model's default for its backend.
    pub fn precision(&self, model: &Model) -> Precision {
        self.dtype
            .unwrap_or_else(|| Precision::of(model.default_kv_element()))
    }

    /// An empty cache of `capacity` tokens for `model`, fed passes of at most `chunk`
    /// tokens: on its device where the backend keeps KV rows there (the --kv-mode then
    /// does not apply: the device masks evicted slots and moves nothing), else in host
    /// memory in the --kv-mode asked for; either way its sliding-window layers
    /// (gemma3's local ones) keep only their window when no policy evicts.
    pub fn cache(&self, model: &Model, capacity: usize, chunk: usize) -> Result<Box<dyn KvCache>> {
        let precision = self.precision(model);
        let element = precision.element();
        // A policy evicts by cache index across every layer: its caches keep every
        // token of a windowed layer (masked past the window).
        let windowed = matches!(self.kind(capacity), PolicyKind::None);
        let device = if windowed {
            model.device_kv_cache_windowed(capacity, element, chunk)?
        } else {
            model.device_kv_cache(capacity, element)?
        };
        if let Some(cache) = device {
            return Ok(cache);
        }
        let mode = self.mode;
        let make = |shape, capacity| new_cache(mode, shape, capacity, precision);
        Ok(if windowed {
            model.host_kv_cache(capacity, chunk, make)?
        } else {
            make(model.kv_shape(), capacity)?
        })
    }

    /// The policy these flags describe, for a context of `ctx` tokens.
    pub fn kind(&self, ctx: usize) -> PolicyKind {
        match self.policy.as_str() {
            "window" => PolicyKind::Window {
                window: self.window.unwrap_or(ctx),
            },
            "streaming" => PolicyKind::Streaming {
                n_sink: self.sink,
                window: self.window.unwrap_or(ctx.saturating_sub(self.sink)),
            },
            _ => PolicyKind::None,
        }
    }

    /// A cache and a policy for `model`: with a policy the cache holds exactly its
    /// budget (sinks plus window), without one `ctx` tokens.
    pub fn build(&self, model: &Model, ctx: usize, chunk: usize) -> Result<CacheAndPolicy> {
        let kind = self.kind(ctx);
        let capacity = kind.budget().unwrap_or(ctx);
        let cache = self.cache(model, capacity, chunk)?;
        // Each layer's own RoPE: gemma3's sliding layers turn with another base.
        let layer_ropes = model.config().layer_ropes();
        let policy = StreamingLlm::from_kind(kind, model.backend().clone(), layer_ropes)?
            .map(|p| Box::new(p) as Box<dyn KvPolicy>);
        Ok((cache, policy))
    }
}
