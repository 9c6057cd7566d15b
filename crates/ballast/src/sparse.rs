//! The sparse MLP lever (`ballast-sparse-mlp`): its options, what its neuron mode takes
//! from the RAM budget, and its installation on a model.

use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::Arc;

use ballast_runtime::gguf::GgufFile;
use ballast_runtime::model::ModelConfig;
use ballast_runtime::Model;
use ballast_sparse_mlp::{NeuronFile, NeuronSource, SparseFfn, SparsityProfile, Wanted};

use crate::error::{ensure, Error, Result};

/// How the sparse MLP computes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
pub enum SparseMode {
    /// The neuron mode when the neuron file exists, else the row mode.
    #[default]
    Auto,
    /// The row mode: the model's own up rows of the active neurons, the down
    /// projection dense.
    Rows,
    /// The neuron mode: each layer's active neurons are read from the neuron file into
    /// a cache of [`SparseOptions::neuron_slots`] per layer, and the MLP is computed
    /// over them.
    Neurons,
}

impl FromStr for SparseMode {
    type Err = Error;

    fn from_str(s: &str) -> Result<SparseMode> {
        match s {
            "auto" => Ok(SparseMode::Auto),
            "rows" => Ok(SparseMode::Rows),
            "neurons" => Ok(SparseMode::Neurons),
            _ => Err(Error::Invalid(format!(
                "unknown sparse mode `{s}`: auto, rows or neurons"
            ))),
        }
    }
}

/// The sparse MLP (approximate: measure it with perplexity): skip the MLP neurons whose
/// gate activation is smallest, by the thresholds of the model's sparsity profile.
#[derive(Clone, Debug, PartialEq)]
pub struct SparseOptions {
    /// The fraction of neurons to skip (0 to below 1).
    pub sparsity: f32,
    /// The sparsity profile (`ballast sparsify`). `None`: MODEL.sparsity beside the
    /// model.
    pub profile: Option<PathBuf>,
    /// With a predictor: compute (or fetch) a neuron when a gate value within this many
    /// of its error scales of the prediction would pass the threshold. Default 1.
    pub predictor_margin: f32,
    /// Use the profile's predictor, when it has one (default).
    pub use_predictor: bool,
    /// Neuron mode: fetch the records of the neurons predicted from each layer's
    /// attention input while attention runs.
    pub prefetch: bool,
    /// Also compute the whole gate, to count the neurons the predictor loses.
    pub measure_recall: bool,
    /// Rows, neurons, or auto.
    pub mode: SparseMode,
    /// The neuron file of the neuron mode. `None`: MODEL.neurons beside the model.
    pub neuron_file: Option<PathBuf>,
    /// Neuron mode: slots of the neuron cache per layer, as a fraction of the layer's
    /// neurons (above 0, at most 1). Default 1.
    pub neuron_slots: f64,
    /// Neuron mode: reads of records in flight at once. `None`: 8 when the layers
    /// stream, else 1.
    pub neuron_readers: Option<usize>,
}

impl SparseOptions {
    /// Skip `sparsity` of the neurons, with every other option at its default.
    pub fn new(sparsity: f32) -> SparseOptions {
        SparseOptions {
            sparsity,
            profile: None,
            predictor_margin: 1.0,
            use_predictor: true,
            prefetch: false,
            measure_recall: false,
            mode: SparseMode::Auto,
            neuron_file: None,
            neuron_slots: 1.0,
            neuron_readers: None,
        }
    }

    /// The sparsity profile these options read for the model at `model`.
    fn profile_path(&self, model: &Path) -> PathBuf {
        self.profile
            .clone()
            .unwrap_or_else(|| SparsityProfile::path_for(model))
    }

    /// The neuron file when the neuron mode runs (`auto`: if the file exists), else
    /// `None`.
    fn neurons_path(&self, model: &Path) -> Result<Option<PathBuf>> {
        let neurons_path = self
            .neuron_file
            .clone()
            .unwrap_or_else(|| ballast_sparse_mlp::neuron_file_path(model));
        match self.mode {
            SparseMode::Rows => return Ok(None),
            SparseMode::Auto if !neurons_path.exists() => return Ok(None),
            _ => {}
        }
        ensure!(
            neurons_path.exists(),
            "--sparse-mode neurons needs the neuron file, and {} does not exist: make it with `ballast sparsify -m {} --neurons`",
            neurons_path.display(),
            model.display()
        );
        Ok(Some(neurons_path))
    }

    /// The neuron cache's slots per layer of `n_ff` neurons.
    fn slots(&self, n_ff: usize) -> Result<usize> {
        ensure!(
            self.neuron_slots > 0.0 && self.neuron_slots <= 1.0,
            "--neuron-slots {}: a fraction of the layer's neurons, above 0 and at most 1",
            self.neuron_slots
        );
        Ok(((n_ff as f64 * self.neuron_slots).ceil() as usize).max(1))
    }
}

/// The counters of an installed sparse MLP.
pub type SparseCounters = Arc<std::sync::Mutex<ballast_sparse_mlp::SparseStats>>;

/// What the neuron mode takes from the RAM budget, worked out before the model is built.
#[derive(Default)]
pub(crate) struct NeuronReserve {
    /// With tiered streaming in the neuron mode: the bytes of the neuron cache (layers ×
    /// slots × a record, and with the prefetch its predictor), which the plan counts
    /// inside the RAM budget; the layers then stream without their up and down
    /// matrices.
    pub bytes: Option<u64>,
    /// The sparsity profile (with the prefetch its predictor), read here so that its
    /// file (tens of MB with predictors) is not read on top of the model's budget.
    pub profile: Option<SparsityProfile>,
}

/// The [`NeuronReserve`] of `sparse` for the model at `path`, whose layers stream when
/// `tiered`.
pub(crate) fn neuron_reserve(
    sparse: Option<&SparseOptions>,
    tiered: bool,
    path: &Path,
    file: &GgufFile,
) -> Result<NeuronReserve> {
    let Some(sparse) = sparse.filter(|_| tiered) else {
        return Ok(NeuronReserve::default());
    };
    let Some(neurons_path) = sparse.neurons_path(path)? else {
        return Ok(NeuronReserve::default());
    };
    let config = ModelConfig::from_gguf(file)?;
    let f = open_neurons(&neurons_path, file, &config)?;
    let cache = (config.n_layers * sparse.slots(config.n_ff)?) as u64
        * f.header().layout.record_bytes() as u64;
    let profile_path = sparse.profile_path(path);
    let profile = if profile_path.exists() {
        Some(SparsityProfile::load_wanting(
            &profile_path,
            ballast_kv_cache::model_fingerprint(file),
            config.n_layers,
            config.n_ff,
            Wanted {
                predictor: false,
                attention_predictor: sparse.prefetch,
            },
        )?)
    } else {
        // `apply` names what is missing.
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

/// `model` (read from `path`) with the sparse MLP of `args` installed (its profile read
/// and checked against the model; its predictor unless told not to) and its counters.
/// `out_of_core`: the layers stream (tiered), so the neuron file is read from the disk
/// rather than from the page cache (the default number of readers). `preloaded`: the
/// profile if [`neuron_reserve`] read it already (before the model took its budget),
/// else it is read here.
pub(crate) fn apply(
    args: &SparseOptions,
    path: &Path,
    file: &GgufFile,
    model: Model,
    out_of_core: bool,
    preloaded: Option<SparsityProfile>,
) -> Result<(Model, SparseCounters)> {
    ensure_silu_mlp(&model, path)?;
    let profile_path = args.profile_path(path);
    ensure!(
        profile_path.exists(),
        "--sparsity needs the model's sparsity profile, and {} does not exist: make it with `ballast sparsify -m {}`",
        profile_path.display(),
        path.display()
    );
    ensure!(
        args.predictor_margin.is_finite() && args.predictor_margin >= 0.0,
        "--predictor-margin {}: it must be a number of at least 0",
        args.predictor_margin
    );
    let config = model.config();
    // Only the predictor the mode uses is built: the neuron mode's prefetch, or the row
    // mode's (a predictor of a larger model is tens of MB).
    let neurons = args.neurons_path(path)?;
    let profile = match preloaded {
        Some(profile) => profile,
        None => SparsityProfile::load_wanting(
            &profile_path,
            ballast_kv_cache::model_fingerprint(file),
            config.n_layers,
            config.n_ff,
            Wanted {
                predictor: neurons.is_none() && args.use_predictor,
                attention_predictor: neurons.is_some() && args.prefetch,
            },
        )?,
    };
    let thresholds = profile
        .thresholds(args.sparsity)
        .map_err(|e| Error::Option {
            option: "--sparsity".into(),
            source: Box::new(e.into()),
        })?;
    let mut ffn = SparseFfn::new(thresholds);
    if let Some(neurons) = neurons {
        let source: Arc<dyn NeuronSource> = Arc::new(open_neurons(&neurons, file, config)?);
        // Out of core a fetch waits on the disk, and reads in flight side by side pay;
        // from the page cache they are copies, which threads only slow (SmolLM2 at
        // sparsity 0.4 with 60% of slots: 47.6 t/s with 1, 35.4 with 8).
        let readers = args.neuron_readers.unwrap_or(if out_of_core {
            ballast_sparse_mlp::DEFAULT_READERS
        } else {
            1
        });
        ensure!(readers >= 1, "--neuron-readers {readers}: at least 1");
        ffn = ffn
            .with_neurons(source, args.slots(config.n_ff)?, model.backend())?
            .with_readers(readers);
        ensure!(
            args.prefetch || !args.measure_recall,
            "--measure-recall in the neuron mode measures the prefetch's predictor: add --prefetch"
        );
        if args.prefetch {
            let predictor = profile.attention_predictor.ok_or_else(|| {
                Error::Invalid(format!(
                    "--prefetch needs the attention-input predictor, and {} has none: make the profile again with `ballast sparsify --rank R`",
                    profile_path.display()
                ))
            })?;
            ffn = ffn.with_prefetch(predictor, args.predictor_margin)?;
        }
        let stats = ffn.stats();
        return Ok((model.share_with_ffn(Box::new(ffn)), stats));
    }
    ensure!(
        !args.prefetch,
        "--prefetch fetches neuron records: it needs the neuron mode (--sparse-mode neurons and the neuron file, `ballast sparsify -m {} --neurons`)",
        path.display()
    );
    match profile.predictor {
        Some(predictor) if args.use_predictor => {
            ffn = ffn.with_predictor(predictor, args.predictor_margin);
            if args.measure_recall {
                ffn = ffn.measure_recall();
            }
        }
        _ => ensure!(
            !args.measure_recall,
            "--measure-recall needs a predictor: {} has none (`ballast sparsify --rank`)",
            profile_path.display()
        ),
    }
    let stats = ffn.stats();
    Ok((model.share_with_ffn(Box::new(ffn)), stats))
}

/// The neuron file at `neurons`, checked against the model of `file`.
fn open_neurons(neurons: &Path, file: &GgufFile, config: &ModelConfig) -> Result<NeuronFile> {
    // The up type from the file's tensor table: asking a streaming store for a layer
    // outside a pass would disturb its pipeline.
    Ok(NeuronFile::open(
        neurons,
        ballast_kv_cache::model_fingerprint(file),
        config.n_layers,
        config.n_ff,
        config.d_model,
        file.tensor("blk.0.ffn_up.weight")?.ty,
    )?)
}

/// The sparse MLP thresholds `|silu(gate)|`: a model whose MLP has another activation
/// (gemma3's GELU) is refused, never run wrong. `path` names the model in the error.
pub fn ensure_silu_mlp(model: &Model, path: &Path) -> Result<()> {
    let config = model.config();
    ensure!(
        config.ffn_act == ballast_runtime::model::blocks::Activation::Silu,
        "{}: the sparse MLP is for SiLU-gated MLPs, and this {} model's MLP is {:?}-gated",
        path.display(),
        config.arch.name(),
        config.ffn_act
    );
    Ok(())
}
