//! `ballast sparsify`: calibrate the sparse MLP on a text and save the model's
//! sparsity profile beside it.

use std::path::PathBuf;

use anyhow::{Context, Result};
use ballast::Engine;
use ballast_runtime::{Model, Session};
use ballast_sparse_mlp::{SparseFfn, SparsityProfile};
use clap::Args;

use crate::common::{self, ModelArgs};

/// The sparsity at whose thresholds `--neurons` counts how often each neuron is
/// active: the middle of the range the neuron mode is measured at (0.15 to 0.6). A
/// neuron's count there is the share of tokens that read its record, which is what
/// decides the pages a token touches; a mean of `|silu(gate)|` would rank a neuron
/// with rare large activations above one that is moderately active on every token.
const HOT_SPARSITY: f32 = 0.4;

/// Record how each layer's MLP gate activations are distributed on a text, and save
/// that (the sparsity profile) beside the model as MODEL.sparsity, for --sparsity.
#[derive(Args, Debug)]
pub struct SparsifyArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Text to calibrate on. Default: the GNU FDL 1.3 from
    /// /usr/share/common-licenses (every Debian machine has it; not the GPL-3 that the
    /// perplexity figures use).
    #[arg(long)]
    pub text: Option<PathBuf>,
    /// Tokens of the text to run at most, in windows of --ctx from an empty cache.
    #[arg(long, default_value_t = 4096)]
    pub tokens: usize,
    /// Window length.
    #[arg(short = 'c', long, default_value_t = 256)]
    pub ctx: usize,
    /// Where to save the profile. Default: MODEL.sparsity beside the model.
    #[arg(short = 'o', long)]
    pub output: Option<PathBuf>,
    /// Also fit a predictor of this rank (0: none): per layer, the best rank-R
    /// approximation of the gate projection on the text's MLP inputs, so that
    /// --sparsity computes only the gate rows of the neurons it predicts. It reads
    /// about R × (width + neurons) × 2 bytes per layer and token. At most the model
    /// width. Measured on SmolLM2 (rank 64) and Qwen2.5-Coder-0.5B (rank 128) it does
    /// not pay: where it keeps over 95% of the neurons it computes almost every gate
    /// row and, with its own bytes, reads about what the dense MLP reads. The same rank
    /// also fits a second predictor of the gate from each layer's attention input
    /// (reduced-rank regression), which the neuron mode uses to fetch the records of
    /// the neurons it predicts while attention runs.
    #[arg(long, default_value_t = 0)]
    pub rank: usize,
    /// Instead of making the profile, write the neuron file MODEL.neurons (or -o):
    /// each MLP neuron's up row as stored and its down column as Q8_0 side by side,
    /// with a checksum per neuron, so that --sparsity reads a neuron's weights in one
    /// place (the neuron mode). About the size of the model's up and down projections,
    /// plus the padding that keeps every record within a 4 KiB page (5% more for
    /// SmolLM2, 30% for Qwen2.5-Coder-0.5B).
    /// Each layer's records are in neuron order, or hot first (--neuron-order).
    #[arg(long)]
    pub neurons: bool,
    /// With --neurons: the order of each layer's records. id (the default): neuron
    /// order, no calibration run. hot: most active first, by how many tokens of the
    /// text activate them at the thresholds of sparsity 0.4 (from the profile beside
    /// the model or --sparsity-profile; made in memory first if there is none). Hot
    /// first read more 4 KiB pages than neuron order on SmolLM2 at sparsity 0.15 and
    /// 0.25 and about as many above: the hottest neurons stay in the neuron cache, and
    /// the misses of a pass served in parts come as runs of adjacent ids.
    #[arg(long, value_enum, default_value_t = NeuronOrder::Id)]
    pub neuron_order: NeuronOrder,
}

/// How `--neurons` orders a layer's records.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum NeuronOrder {
    /// Most active on the calibration text first.
    Hot,
    /// Neuron order.
    Id,
}

/// The calibration text of `args`, as at most `--tokens` tokens of `loaded`'s
/// tokenizer, and its path.
fn calibration_ids(args: &SparsifyArgs, loaded: &Engine) -> Result<(Vec<u32>, PathBuf)> {
    let text_path = args
        .text
        .clone()
        .unwrap_or_else(|| PathBuf::from("/usr/share/common-licenses/GFDL-1.3"));
    let text = std::fs::read_to_string(&text_path)
        .with_context(|| format!("reading the calibration text {}", text_path.display()))?;
    let mut ids = loaded.tokenizer().encode(&text, false, false)?;
    let all = ids.len();
    ids.truncate(args.tokens);
    anyhow::ensure!(
        ids.len() >= 2,
        "{} gives {all} tokens: too short to calibrate on",
        text_path.display(),
    );
    Ok((ids, text_path))
}

/// Runs `model` with the calibrating MLP `ffn` over `ids` in windows of `--ctx`, each
/// from an empty cache.
fn run_windows(
    args: &SparsifyArgs,
    model: &Model,
    ffn: SparseFfn,
    ids: &[u32],
    what: &str,
) -> Result<()> {
    let mut session = Session::with_batch(model.share_with_ffn(Box::new(ffn)), args.ctx, args.ctx)?;
    let windows: Vec<&[u32]> = ids.chunks(args.ctx).collect();
    let bar = indicatif::ProgressBar::new(windows.len() as u64);
    bar.set_message(what.to_string());
    for w in &windows {
        session.rewind(0);
        session.feed(w)?;
        bar.inc(1);
    }
    bar.finish_and_clear();
    Ok(())
}

/// Per layer, the hot-first order of its neurons on the calibration text (see
/// `--neuron-order`).
fn hot_first_orders(
    args: &SparsifyArgs,
    loaded: &Engine,
    path: &std::path::Path,
) -> Result<Vec<Vec<u32>>> {
    let config = loaded.model().config();
    let fingerprint = ballast_kv_cache::model_fingerprint(loaded.file());
    let (ids, text_path) = calibration_ids(args, loaded)?;
    let profile_path = args
        .model
        .sparse
        .sparsity_profile
        .clone()
        .unwrap_or_else(|| SparsityProfile::path_for(path));
    let profile = if profile_path.exists() {
        SparsityProfile::load(&profile_path, fingerprint, config.n_layers, config.n_ff)?
    } else {
        let (ffn, calibration) = SparseFfn::calibrating();
        run_windows(args, loaded.model(), ffn, &ids, "calibrating")?;
        calibration.profile(fingerprint, ids.len() as u64)
    };
    let (ffn, calibration) = SparseFfn::counting_activity(profile.thresholds(HOT_SPARSITY)?);
    run_windows(args, loaded.model(), ffn, &ids, "ranking neurons")?;
    let counts = calibration.active_counts();
    eprintln!(
        "neurons ranked by activity at sparsity {HOT_SPARSITY} over {} tokens of {}",
        ids.len(),
        text_path.display()
    );
    Ok((0..config.n_layers)
        .map(|l| match counts.get(l) {
            Some(c) if c.len() == config.n_ff => ballast_sparse_mlp::hot_first(c),
            _ => (0..config.n_ff as u32).collect(),
        })
        .collect())
}

/// Writes the neuron file of the model of `args` (`sparsify --neurons`).
fn write_neurons(args: &SparsifyArgs) -> Result<()> {
    use ballast_runtime::blocks::{FFN_DOWN, FFN_UP};
    use ballast_sparse_mlp::{layer_records, NeuronFileHeader, NeuronFileWriter};
    let loaded = common::load(args.model.builder(args.ctx, args.ctx)?)?;
    let path = loaded.path().to_path_buf();
    ballast::ensure_silu_mlp(loaded.model(), &path)?;
    let config = loaded.model().config().clone();
    let orders = match args.neuron_order {
        NeuronOrder::Hot => hot_first_orders(args, &loaded, &path)?,
        NeuronOrder::Id => vec![(0..config.n_ff as u32).collect(); config.n_layers],
    };
    let out = args
        .output
        .clone()
        .unwrap_or_else(|| ballast_sparse_mlp::neuron_file_path(&path));
    let store = loaded.model().store();
    let first = store.layer(ballast_runtime::store::PassId(u64::MAX), 0)?;
    let layout = ballast_runtime::neurons::NeuronLayout {
        n_embd: config.d_model,
        up_type: first.matrix(FFN_UP)?.ty,
        down_type: ballast_runtime::ggml_type::GgmlType::Q8_0,
    };
    drop(first);
    let header = NeuronFileHeader {
        version: ballast_sparse_mlp::NEURON_FILE_VERSION,
        fingerprint: ballast_kv_cache::model_fingerprint(loaded.file()),
        n_layers: config.n_layers,
        n_ff: config.n_ff,
        layout,
    };
    let mut writer = NeuronFileWriter::create(&out, header, orders)?;
    let bar = indicatif::ProgressBar::new(config.n_layers as u64);
    bar.set_message("writing neuron records");
    let mut down = Vec::new();
    let mut records = Vec::new();
    for l in 0..config.n_layers {
        let w = store.layer(ballast_runtime::store::PassId(u64::MAX), l)?;
        let (up, down_w) = (w.matrix(FFN_UP)?, w.matrix(FFN_DOWN)?);
        anyhow::ensure!(
            up.ty == layout.up_type,
            "layer {l}'s ffn_up is {:?}, layer 0's {:?}: the neuron file holds one up type",
            up.ty,
            layout.up_type
        );
        down.resize(down_w.rows() * down_w.cols(), 0.0);
        ballast_runtime::quant::dequantize(down_w.ty, down_w.bytes.as_slice()?, &mut down)?;
        records.clear();
        layer_records(
            &layout,
            up.bytes.as_slice()?,
            &down,
            config.n_ff,
            &mut records,
        )?;
        writer.write_layer(&records)?;
        bar.inc(1);
    }
    writer.finish()?;
    bar.finish_and_clear();
    eprintln!(
        "wrote {} ({}: {} layers of {} neurons {}, {} bytes a record: {:?} up row, Q8_0 down column)",
        out.display(),
        common::human_bytes(header.file_len()),
        config.n_layers,
        config.n_ff,
        match args.neuron_order {
            NeuronOrder::Hot => "hot first",
            NeuronOrder::Id => "in neuron order",
        },
        layout.record_bytes(),
        layout.up_type
    );
    Ok(())
}

pub fn run(args: SparsifyArgs) -> Result<()> {
    anyhow::ensure!(
        args.model.sparse.sparsity.is_none(),
        "calibration runs the dense MLP: drop --sparsity"
    );
    anyhow::ensure!(args.ctx >= 2, "--ctx must be at least 2");
    if args.neurons {
        return write_neurons(&args);
    }
    let loaded = common::load(args.model.builder(args.ctx, args.ctx)?)?;
    let path = loaded.path().to_path_buf();
    ballast::ensure_silu_mlp(loaded.model(), &path)?;
    let (ids, text_path) = calibration_ids(&args, &loaded)?;
    let n = ids.len();
    let config = loaded.model().config().clone();
    anyhow::ensure!(
        args.rank <= config.d_model,
        "--rank {}: at most the model width, {}",
        args.rank,
        config.d_model
    );
    let (ffn, calibration) = if args.rank > 0 {
        SparseFfn::calibrating_with_moments()
    } else {
        SparseFfn::calibrating()
    };
    run_windows(&args, loaded.model(), ffn, &ids, "calibrating")?;
    let fingerprint = ballast_kv_cache::model_fingerprint(loaded.file());
    let mut profile = calibration.profile(fingerprint, n as u64);
    if args.rank > 0 {
        let bar = indicatif::ProgressBar::new(config.n_layers as u64);
        bar.set_style(
            indicatif::ProgressStyle::with_template("{msg} {bar:30} {pos}/{len} layers ({eta})")
                .expect("a valid template"),
        );
        bar.set_message(format!("fitting rank-{} predictors", args.rank));
        let mut layers = Vec::with_capacity(config.n_layers);
        let mut attention = Vec::with_capacity(config.n_layers);
        for l in 0..config.n_layers {
            let weights = loaded
                .model()
                .store()
                .layer(ballast_runtime::store::PassId(u64::MAX), l)?;
            let gate = weights.matrix(ballast_runtime::blocks::FFN_GATE)?;
            let backend = loaded.model().backend().as_ref();
            layers.push(calibration.fit_predictor(backend, l, gate, args.rank)?);
            attention.push(calibration.fit_attention_predictor(backend, l, gate, args.rank)?);
            bar.inc(1);
        }
        bar.finish_and_clear();
        let bytes: usize = layers.iter().map(|l| l.bytes()).sum();
        eprintln!(
            "predictor of rank {}: {} read per token",
            args.rank,
            common::human_bytes(bytes as u64)
        );
        profile.predictor = Some(ballast_sparse_mlp::Predictor { layers });
        profile.attention_predictor = Some(ballast_sparse_mlp::Predictor { layers: attention });
    }
    let out = args
        .output
        .clone()
        .unwrap_or_else(|| SparsityProfile::path_for(&path));
    profile.save(&out)?;
    eprintln!(
        "calibrated on {n} tokens of {}; saved {}",
        text_path.display(),
        out.display()
    );
    println!("| layer | threshold at 25% | 40% | 50% | 60% |");
    println!("| ---: | ---: | ---: | ---: | ---: |");
    let at: Vec<Vec<f32>> = [0.25, 0.4, 0.5, 0.6]
        .iter()
        .map(|&s| profile.thresholds(s))
        .collect::<ballast_sparse_mlp::Result<_>>()?;
    for l in 0..profile.layers.len() {
        let row: Vec<String> = at.iter().map(|t| format!("{:.4}", t[l])).collect();
        println!("| {l} | {} |", row.join(" | "));
    }
    Ok(())
}
