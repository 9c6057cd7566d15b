//! Ballast as a library: an [`Engine`] built in a few lines from a GGUF file (or a pack
//! made by `ballast pack`), the memory it may use and the levers it pulls.
//!
//! [`Engine::builder`] takes the model's path; its options are the device
//! ([`EngineBuilder::device`]), the RAM and GPU budgets ([`EngineBuilder::ram_budget`],
//! [`EngineBuilder::vram_budget`], as [`ByteSize`]s), the weight store
//! ([`StoreOptions`]: memory map, RAM, tiered streaming, a pack's compressed store,
//! [`CodecOptions`]), the KV cache ([`KvOptions`]: update mode, element type,
//! StreamingLLM) and the sparse MLP ([`SparseOptions`]). [`EngineBuilder::build`] does
//! what the `ballast` command does: it probes the machine's RAM when no budget is
//! given, plans where each layer lives (device, RAM, disk), builds the store, installs
//! the levers, and reports what it chose ([`Report`], whose text is the plan the
//! command prints). [`Engine::generator`] then gives the one generation loop,
//! [`Generator`]; [`Engine::session`] a bare [`Session`].
//!
//! # Example
//!
//! A tiny random-weight model (the test-model writer's), streamed by tiers within a RAM
//! budget of 64 MiB, generating eight greedy tokens:
//!
//! ```
//! use ballast::{ByteSize, Engine, GenerateOptions, SamplerConfig, Step, StoreKind};
//! use ballast::runtime::testing::TinyModelSpec;
//!
//! # fn main() -> Result<(), ballast::Error> {
//! let dir = tempfile::tempdir()?;
//! let path = dir.path().join("tiny.gguf");
//! std::fs::write(&path, TinyModelSpec::default().to_gguf_bytes()?)?;
//!
//! let engine = Engine::builder(&path)
//!     .store(StoreKind::Tiered)
//!     .ram_budget("64M".parse::<ByteSize>()?)
//!     .context(128)
//!     .build()?;
//! assert_eq!(engine.report().store, "tiered");
//! println!("{}", engine.report()); // the plan: which layers stream from disk
//!
//! let prompt = engine.tokenizer().encode("Hello", true, false)?;
//! let options = GenerateOptions {
//!     sampler: SamplerConfig { temperature: 0.0, ..SamplerConfig::default() },
//!     max_tokens: Some(8),
//!     ignore_eos: true,
//!     ..GenerateOptions::default()
//! };
//! let mut generator = engine.generator(options)?;
//! generator.prompt(&prompt)?;
//! let mut text = String::new();
//! loop {
//!     match generator.step()? {
//!         Step::Token(token) => text += &token.text,
//!         Step::Done(end) => break text += &end.text,
//!     }
//! }
//! assert_eq!(generator.generated(), 8);
//! # Ok(())
//! # }
//! ```

#![deny(missing_docs)]

mod error;
mod kv;
pub mod report;
mod size;
mod sparse;
pub mod store;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use ballast_runtime::gguf::GgufFile;
use ballast_runtime::gpu::GpuContext;
use ballast_runtime::{Backend, CpuBackend, WgpuBackend};
use ballast_weight_codec::PackFile;

pub use ballast_kv_cache::{KvElement, UpdateMode};
pub use ballast_runtime::gpu::DeviceChoice;
pub use ballast_runtime::{
    FinishReason, GenerateOptions, Generator, Model, SamplerConfig, Session, Step, Token, Tokenizer,
};
pub use error::{ContextTooLong, Error, Result};
pub use kv::{CacheAndPolicy, Eviction, KvOptions};
pub use report::Report;
pub use size::{human_bytes, human_rate, ByteSize};
pub use sparse::{ensure_silu_mlp, SparseCounters, SparseMode, SparseOptions};
pub use store::{
    open_model, CacheKind, CodecOptions, Opened, RamBudget, RamTierKind, StoreKind, StoreOptions,
    StreamOptions, TieredInfo,
};

/// The crates the engine is built from, for what the facade does not re-export.
pub use {
    ballast_kv_cache as kv_cache, ballast_runtime as runtime, ballast_sparse_mlp as sparse_mlp,
    ballast_tier_stream as tier_stream, ballast_weight_codec as weight_codec,
};

use error::AtFile;

/// Threads to compute with when none are asked for: every core.
pub fn default_threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// The options of an [`Engine`]; [`EngineBuilder::build`] builds it.
#[derive(Clone)]
#[must_use]
pub struct EngineBuilder {
    path: PathBuf,
    device: DeviceChoice,
    threads: Option<usize>,
    mmap: bool,
    store: StoreOptions,
    kv: Option<KvOptions>,
    sparse: Option<SparseOptions>,
    context: usize,
    batch: Option<usize>,
    sequences: usize,
    opened: Option<Opened>,
}

impl EngineBuilder {
    /// Where to compute: the CPU (default), a GPU through wgpu, or `auto`.
    pub fn device(mut self, device: DeviceChoice) -> Self {
        self.device = device;
        self
    }

    /// Threads the CPU computes with. Default: every core.
    pub fn threads(mut self, threads: impl Into<Option<usize>>) -> Self {
        self.threads = threads.into();
        self
    }

    /// Memory-map the file (default), or read what the store keeps into RAM.
    pub fn mmap(mut self, mmap: bool) -> Self {
        self.mmap = mmap;
        self
    }

    /// The RAM budget for weights, KV cache and activations. Given one, the automatic
    /// store streams by tiers within it. Default (`None`): the probed RAM (MemAvailable,
    /// or the cgroup limit when one is set).
    pub fn ram_budget(mut self, budget: impl Into<Option<ByteSize>>) -> Self {
        self.store.ram = budget.into();
        self
    }

    /// The GPU memory budget for tiered streaming on a GPU (wgpu cannot tell how much
    /// memory a GPU has).
    pub fn vram_budget(mut self, budget: impl Into<Option<ByteSize>>) -> Self {
        self.store.vram = budget.into();
        self
    }

    /// The weight store. Default: [`StoreKind::Auto`].
    pub fn store(mut self, kind: StoreKind) -> Self {
        self.store.kind = kind;
        self
    }

    /// Every store option at once: the store, the budgets, tiered streaming and a
    /// pack's decoding (replacing what [`EngineBuilder::store`] and the budgets set).
    pub fn store_options(mut self, options: StoreOptions) -> Self {
        self.store = options;
        self
    }

    /// How tiered streaming runs.
    pub fn stream(mut self, options: StreamOptions) -> Self {
        self.store.stream = options;
        self
    }

    /// How a pack is decoded.
    pub fn codec(mut self, options: CodecOptions) -> Self {
        self.store.codec = options;
        self
    }

    /// The KV cache of the engine's sessions. Default (`None`): the model's own cache
    /// for its backend (dense, of the backend's element type, no eviction).
    pub fn kv(mut self, options: impl Into<Option<KvOptions>>) -> Self {
        self.kv = options.into();
        self
    }

    /// The sparse MLP (approximate). Default (`None`): the exact MLP.
    pub fn sparse(mut self, options: impl Into<Option<SparseOptions>>) -> Self {
        self.sparse = options.into();
        self
    }

    /// Context of each session in tokens (prompt plus generation). Default 2048.
    pub fn context(mut self, tokens: usize) -> Self {
        self.context = tokens;
        self
    }

    /// Prompt tokens per forward pass. Default (`None`): 64 when the weights are
    /// resident; when layers stream from disk, up to 512 ([`store::streamed_batch`]),
    /// since every pass reads the streamed layers once whatever its tokens.
    pub fn batch(mut self, tokens: impl Into<Option<usize>>) -> Self {
        self.batch = tokens.into();
        self
    }

    /// Sessions that will run at once (a server's slots): tiered streaming reserves
    /// room for all their caches. Default 1.
    pub fn sequences(mut self, n: usize) -> Self {
        self.sequences = n.max(1);
        self
    }

    /// The model file opened already (by [`open_model`] with the same path, memory
    /// mapping and store), for a caller that builds several engines from one file.
    pub fn opened(mut self, opened: Opened) -> Self {
        self.opened = Some(opened);
        self
    }

    /// Opens the model, chooses the device, plans and builds the store and installs
    /// the levers.
    pub fn build(self) -> Result<Engine> {
        let path = self.path.as_path();
        let threads = self.threads.unwrap_or_else(default_threads).max(1);
        let mapped = self.mmap && self.store.kind != StoreKind::Ram;
        let Opened { file, pack } = match self.opened {
            Some(opened) => opened,
            None => open_model(path, mapped, self.store.kind)?,
        };
        let tokenizer = Tokenizer::from_gguf(&file).at("building the tokenizer of", path)?;
        let mut device_notes = Vec::new();
        let backend = backend(self.device, threads, &mut device_notes)?;
        let tiered = match self.store.kind {
            StoreKind::Tiered => true,
            StoreKind::Auto => self.store.ram.is_some(),
            _ => false,
        };
        let reserve = sparse::neuron_reserve(self.sparse.as_ref(), tiered, path, &file)?;
        let planned_context = self.context * self.sequences;
        let source = store::Source {
            file: &file,
            pack: pack.as_ref(),
            path,
            mapped,
            ctx: planned_context,
            batch: self.batch,
            threads,
        };
        let built = store::build(&source, backend, &self.store, reserve.bytes)?;
        let out_of_core = built.tiered.is_some();
        let built_batch = built.batch;
        let (model, sparse) = match &self.sparse {
            Some(options) => {
                let (model, counters) = sparse::apply(
                    options,
                    path,
                    &file,
                    built.model,
                    out_of_core,
                    reserve.profile,
                )?;
                (model, Some(counters))
            }
            None => (built.model, None),
        };
        let report = Report {
            device_notes,
            backend: model.backend().name(),
            threads,
            store: built.store_name,
            planned_context,
            ram_budget: built.ram_budget,
            vram_budget: built.vram_budget,
            neuron_cache: built.neuron_cache,
            tiered: built.tiered,
            compressed: built.compressed,
            sparse,
        };
        Ok(Engine {
            path: self.path,
            file,
            pack,
            tokenizer: Arc::new(tokenizer),
            model,
            kv: self.kv,
            context: self.context,
            batch: built_batch,
            report,
        })
    }
}

/// The backend `device` asks for, computing with `threads` threads on the CPU; what
/// choosing it said goes to `notes` (the adapter of a GPU, or why `auto` fell back).
fn backend(
    device: DeviceChoice,
    threads: usize,
    notes: &mut Vec<String>,
) -> Result<Arc<dyn Backend>> {
    let gpu =
        GpuContext::choose(device, &mut |line| notes.push(line.to_string())).map_err(|e| {
            Error::Option {
                option: format!("--device {device}"),
                source: Box::new(e.into()),
            }
        })?;
    Ok(match gpu {
        Some(ctx) => {
            notes.push(format!("device: {} (wgpu)", ctx.adapter()));
            Arc::new(WgpuBackend::new(ctx))
        }
        None => Arc::new(CpuBackend::new(threads)),
    })
}

/// A model loaded with its store, backend and levers, ready to make sessions.
pub struct Engine {
    path: PathBuf,
    file: Arc<GgufFile>,
    pack: Option<Arc<PackFile>>,
    tokenizer: Arc<Tokenizer>,
    model: Model,
    kv: Option<KvOptions>,
    context: usize,
    batch: usize,
    report: Report,
}

impl Engine {
    /// The options of an engine for the model at `path` (a GGUF file or a pack), at
    /// their defaults: the CPU, every core, the automatic store within the probed RAM,
    /// the model's own KV cache, the exact MLP, a context of 2048 tokens.
    pub fn builder(path: impl Into<PathBuf>) -> EngineBuilder {
        EngineBuilder {
            path: path.into(),
            device: DeviceChoice::Cpu,
            threads: None,
            mmap: true,
            store: StoreOptions::default(),
            kv: None,
            sparse: None,
            context: 2048,
            batch: None,
            sequences: 1,
            opened: None,
        }
    }

    /// The model file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The GGUF file (a pack's decoded skeleton for the stores that decode layers).
    pub fn file(&self) -> &Arc<GgufFile> {
        &self.file
    }

    /// The pack, when the model file is one.
    pub fn pack(&self) -> Option<&Arc<PackFile>> {
        self.pack.as_ref()
    }

    /// The model's tokenizer.
    pub fn tokenizer(&self) -> &Arc<Tokenizer> {
        &self.tokenizer
    }

    /// The model: weights, store, backend, and the MLP lever the builder installed.
    pub fn model(&self) -> &Model {
        &self.model
    }

    /// The model, to run passes on it directly (perplexity, calibration).
    pub fn model_mut(&mut self) -> &mut Model {
        &mut self.model
    }

    /// The model, without the engine.
    pub fn into_model(self) -> Model {
        self.model
    }

    /// The model and the tokenizer, without the engine (for a caller that wants the
    /// tokenizer by value, as `ballast-server`'s engine does).
    pub fn into_parts(self) -> Result<(Model, Tokenizer)> {
        let tokenizer = match Arc::try_unwrap(self.tokenizer) {
            Ok(tokenizer) => tokenizer,
            // Shared with a generator made before: build another from the file.
            Err(_) => {
                Tokenizer::from_gguf(&self.file).at("building the tokenizer of", &self.path)?
            }
        };
        Ok((self.model, tokenizer))
    }

    /// What the builder chose and planned.
    pub fn report(&self) -> &Report {
        &self.report
    }

    /// Context of each session, in tokens.
    pub fn context(&self) -> usize {
        self.context
    }

    /// Prompt tokens per forward pass (the builder's, or the default it chose).
    pub fn batch(&self) -> usize {
        self.batch
    }

    /// The KV options of the engine's sessions (`None`: the model's own cache).
    pub fn kv_options(&self) -> Option<&KvOptions> {
        self.kv.as_ref()
    }

    /// The session the engine was built for: the engine's model, its MLP lever
    /// included (a sparse MLP's neuron cache is sized for one handle, so the model
    /// moves into the session), with a KV cache of the builder's options for the
    /// context, fed prompts in chunks of the batch.
    pub fn session(self) -> Result<Session> {
        let (context, batch) = (self.context, self.batch);
        session_on(self.model, self.kv.as_ref(), context, batch)
    }

    /// A [`Generator`] over [`Engine::session`], with the engine's tokenizer.
    pub fn generator(self, options: GenerateOptions) -> Result<Generator> {
        let tokenizer = self.tokenizer.clone();
        Ok(Generator::new(self.session()?, tokenizer, options)?)
    }

    /// One more session on the engine's weights, for a caller that runs several (a
    /// server's slots): a handle with the exact MLP ([`Model::share`]) and its own KV
    /// cache. Its passes may run on the engine's model instead (batched, with the
    /// lever), as the server's do.
    pub fn shared_session(&self) -> Result<Session> {
        session_on(
            self.model.share(),
            self.kv.as_ref(),
            self.context,
            self.batch,
        )
    }
}

/// A session on `model` for `context` tokens fed in chunks of `batch`: with the cache
/// and policy of `kv`, else the model's own cache.
fn session_on(
    model: Model,
    kv: Option<&KvOptions>,
    context: usize,
    batch: usize,
) -> Result<Session> {
    let Some(kv) = kv else {
        return Ok(Session::with_batch(model, context, batch)?);
    };
    let (cache, policy) = kv.build(&model, context, batch)?;
    let mut session = Session::with_cache(model, cache, policy);
    session.set_batch(batch);
    Ok(session)
}
