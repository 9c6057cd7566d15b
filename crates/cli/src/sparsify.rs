//! `ballast sparsify`: calibrate the sparse MLP on a text and save the model's
//! sparsity profile beside it.

use std::path::PathBuf;

use anyhow::{Context, Result};
use ballast_runtime::Session;
use ballast_sparse_mlp::{SparseFfn, SparsityProfile};
use clap::Args;

use crate::common::{self, ModelArgs};

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
    /// row and, with its own bytes, reads about what the dense MLP reads.
    #[arg(long, default_value_t = 0)]
    pub rank: usize,
    /// Instead of calibrating, write the neuron file MODEL.neurons (or -o): each MLP
    /// neuron's up row as stored and its down column as Q8_0 side by side, with a
    /// checksum per neuron, so that --sparsity reads a neuron's weights in one place
    /// (the neuron mode). About the size of the model's up and down projections.
    #[arg(long)]
    pub neurons: bool,
}

/// Writes the neuron file of the model of `args` (`sparsify --neurons`).
fn write_neurons(args: &SparsifyArgs) -> Result<()> {
    use ballast_runtime::blocks::{FFN_DOWN, FFN_UP};
    use ballast_sparse_mlp::{layer_records, NeuronFileHeader, NeuronFileWriter};
    let path = common::resolve_model(args.model.model.as_deref())?;
    let threads = common::threads(args.model.threads);
    let loaded = common::load(&args.model, threads, 16, 16)?;
    common::ensure_silu_mlp(&loaded.model, &path)?;
    let config = loaded.model.config().clone();
    let out = args
        .output
        .clone()
        .unwrap_or_else(|| ballast_sparse_mlp::neuron_file_path(&path));
    let store = loaded.model.store();
    let first = store.layer(ballast_runtime::store::PassId(u64::MAX), 0)?;
    let layout = ballast_runtime::neurons::NeuronLayout {
        n_embd: config.d_model,
        up_type: first.matrix(FFN_UP)?.ty,
        down_type: ballast_runtime::ggml_type::GgmlType::Q8_0,
    };
    drop(first);
    let header = NeuronFileHeader {
        fingerprint: ballast_kv_cache::model_fingerprint(&loaded.file),
        n_layers: config.n_layers,
        n_ff: config.n_ff,
        layout,
    };
    let mut writer = NeuronFileWriter::create(&out, header)?;
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
        ballast_runtime::quant::dequantize(down_w.ty, down_w.bytes.as_slice(), &mut down)?;
        records.clear();
        layer_records(
            &layout,
            up.bytes.as_slice(),
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
        "wrote {} ({}: {} layers of {} neurons, {} bytes a record: {:?} up row, Q8_0 down column)",
        out.display(),
        common::human_bytes(header.file_len()),
        config.n_layers,
        config.n_ff,
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
    if args.neurons {
        return write_neurons(&args);
    }
    anyhow::ensure!(args.ctx >= 2, "--ctx must be at least 2");
    let path = common::resolve_model(args.model.model.as_deref())?;
    let text_path = args
        .text
        .clone()
        .unwrap_or_else(|| PathBuf::from("/usr/share/common-licenses/GFDL-1.3"));
    let text = std::fs::read_to_string(&text_path)
        .with_context(|| format!("reading the calibration text {}", text_path.display()))?;
    let threads = common::threads(args.model.threads);
    let loaded = common::load(&args.model, threads, args.ctx, args.ctx)?;
    common::ensure_silu_mlp(&loaded.model, &path)?;
    let ids = loaded.tokenizer.encode(&text, false, false)?;
    let n = ids.len().min(args.tokens);
    anyhow::ensure!(
        n >= 2,
        "{} gives {} tokens: too short to calibrate on",
        text_path.display(),
        ids.len()
    );
    let config = loaded.model.config().clone();
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
    let mut session = Session::with_batch(
        loaded.model.share_with_ffn(Box::new(ffn)),
        args.ctx,
        args.ctx,
    )?;
    let windows: Vec<&[u32]> = ids[..n].chunks(args.ctx).collect();
    let bar = indicatif::ProgressBar::new(windows.len() as u64);
    bar.set_message("calibrating");
    for w in &windows {
        session.rewind(0);
        session.feed(w)?;
        bar.inc(1);
    }
    bar.finish_and_clear();
    let fingerprint = ballast_kv_cache::model_fingerprint(&loaded.file);
    let mut profile = calibration.profile(fingerprint, n as u64);
    if args.rank > 0 {
        let bar = indicatif::ProgressBar::new(config.n_layers as u64);
        bar.set_message(format!("fitting rank-{} predictors", args.rank));
        let mut layers = Vec::with_capacity(config.n_layers);
        for l in 0..config.n_layers {
            let weights = loaded
                .model
                .store()
                .layer(ballast_runtime::store::PassId(u64::MAX), l)?;
            let gate = weights.matrix(ballast_runtime::blocks::FFN_GATE)?;
            layers.push(calibration.fit_predictor(
                loaded.model.backend().as_ref(),
                l,
                gate,
                args.rank,
            )?);
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
