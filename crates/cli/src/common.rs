//! What every command shares: finding the model, loading it, sampling flags.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result};
use ballast::{Engine, EngineBuilder, Eviction, KvOptions, SparseMode, SparseOptions};
use ballast_kv_cache::{KvElement, UpdateMode};
use ballast_runtime::gpu::DeviceChoice;
use ballast_runtime::{model_cache, SamplerConfig};
use clap::Args;

pub use ballast::human_bytes;

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
    #[arg(long, value_enum, default_value_t = SparseMode::Auto)]
    pub sparse_mode: SparseMode,
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
    /// The engine these flags describe, for the model they name (fetched first if it
    /// is a known model not cached yet), planned for a context of `ctx` tokens and
    /// prompt chunks of `batch` (`None`: the engine's default for its store).
    pub fn builder(&self, ctx: usize, batch: impl Into<Option<usize>>) -> Result<EngineBuilder> {
        let path = resolve_model(self.model.as_deref())?;
        Ok(Engine::builder(path)
            .device(self.device)
            .threads(self.threads)
            .mmap(!self.no_mmap)
            .store_options(self.store.options())
            .sparse(self.sparse.options())
            .context(ctx)
            .batch(batch))
    }
}

impl SparsityArgs {
    /// The sparse MLP these flags ask for (`None` without `--sparsity`).
    pub fn options(&self) -> Option<SparseOptions> {
        Some(SparseOptions {
            sparsity: self.sparsity?,
            profile: self.sparsity_profile.clone(),
            predictor_margin: self.predictor_margin,
            use_predictor: !self.no_predictor,
            prefetch: self.prefetch,
            measure_recall: self.measure_recall,
            mode: self.sparse_mode,
            neuron_file: self.neuron_file.clone(),
            neuron_slots: self.neuron_slots,
            neuron_readers: self.neuron_readers,
        })
    }
}

/// Builds the engine, with what choosing the device said and the plan on stderr.
pub fn load(builder: EngineBuilder) -> Result<Engine> {
    let engine = builder.build()?;
    let report = engine.report();
    for line in &report.device_notes {
        eprintln!("{line}");
    }
    eprint!("{report}");
    Ok(engine)
}

/// Parses `--device`.
pub fn parse_device(s: &str) -> std::result::Result<DeviceChoice, String> {
    s.parse().map_err(|e: ballast_runtime::Error| e.to_string())
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

/// Threads to use: the flag, else every core.
pub fn threads(flag: Option<usize>) -> usize {
    flag.unwrap_or_else(ballast::default_threads).max(1)
}

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
    pub dtype: Option<KvElement>,
    /// What to evict: `none` (the cache grows to the context, then an error),
    /// `window` (the most recent --window tokens), `streaming` (StreamingLLM: --sink
    /// first tokens plus the most recent --window).
    #[arg(long = "kv-policy", value_enum, default_value_t = Eviction::None)]
    pub policy: Eviction,
    /// Attention sinks kept by `--kv-policy streaming`.
    #[arg(long, default_value_t = 4)]
    pub sink: usize,
    /// Recent tokens kept by `--kv-policy window|streaming`. Default: the context
    /// minus the sinks.
    #[arg(long)]
    pub window: Option<usize>,
}

impl KvArgs {
    /// The KV cache these flags describe.
    pub fn options(&self) -> KvOptions {
        KvOptions {
            mode: self.mode,
            dtype: self.dtype,
            policy: self.policy,
            sink: self.sink,
            window: self.window,
        }
    }
}
