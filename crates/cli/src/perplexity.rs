//! `ballast perplexity`: perplexity of a text, the way llama-perplexity computes it.

use std::path::PathBuf;

use anyhow::{Context, Result};
use ballast_runtime::session::perplexity;
use clap::Args;
use serde_json::json;

use crate::common::{self, ModelArgs};

/// Flags of `ballast perplexity`.
#[derive(Args, Debug)]
pub struct PerplexityArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// The text file to evaluate.
    #[arg(short = 'f', long = "file")]
    pub file: PathBuf,
    /// Window size in tokens; the second half of each window is scored.
    #[arg(short = 'c', long = "ctx", default_value_t = 512)]
    pub ctx: usize,
    /// Tokens per forward pass.
    #[arg(short = 'b', long = "batch", default_value_t = 256)]
    pub batch: usize,
    /// Print one JSON object instead of text.
    #[arg(long)]
    pub json: bool,
}

pub fn run(args: PerplexityArgs) -> Result<()> {
    let threads = common::threads(args.model.threads);
    let text = std::fs::read_to_string(&args.file)
        .with_context(|| format!("reading {}", args.file.display()))?;
    let mut loaded = common::load(&args.model, threads, args.ctx, args.batch)?;
    let mut tokens = loaded.tokenizer.encode(&text, false, false)?;
    // llama-perplexity starts every window with BOS when the model adds one.
    let bos = loaded
        .tokenizer
        .add_bos()
        .then(|| loaded.tokenizer.bos_id())
        .flatten();
    if let Some(bos) = bos {
        for w in tokens.chunks_mut(args.ctx) {
            w[0] = bos;
        }
    }
    let bar = indicatif::ProgressBar::new((tokens.len() / args.ctx.max(1)) as u64);
    if args.json {
        bar.set_draw_target(indicatif::ProgressDrawTarget::hidden());
    }
    let report = perplexity(
        &mut loaded.model,
        &tokens,
        args.ctx,
        args.batch,
        |done, _| bar.set_position(done as u64),
    )?;
    bar.finish_and_clear();
    if args.json {
        println!(
            "{}",
            json!({
                "file": args.file, "ctx": args.ctx, "perplexity": report.perplexity,
                "chunks": report.chunks, "scored_tokens": report.scored_tokens,
                "text_tokens": report.text_tokens, "seconds": report.elapsed.as_secs_f64(),
            })
        );
    } else {
        println!(
            "perplexity {:.4} over {} windows of {} tokens ({} tokens scored, {} in the text), {:.1} s",
            report.perplexity,
            report.chunks,
            args.ctx,
            report.scored_tokens,
            report.text_tokens,
            report.elapsed.as_secs_f64()
        );
    }
    Ok(())
}
