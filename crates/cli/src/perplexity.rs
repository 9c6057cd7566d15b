//! `ballast perplexity`: perplexity of a text, the way llama-perplexity computes it.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use ballast_runtime::session::perplexity_with_cache;
use ballast_runtime::stream_eval;
use clap::Args;
use serde_json::json;

use ballast::Engine;

use crate::common::{self, human_bytes, KvArgs, ModelArgs};

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
    /// Read the text as one stream, token by token, through the KV cache and policy
    /// of the --kv-* flags (StreamingLLM's evaluation), instead of llama-perplexity's
    /// independent windows. Without a policy the cache holds -c tokens.
    #[arg(long)]
    pub stream: bool,
    /// With --stream: the paper's slow oracle instead of a cache, a sliding window of
    /// --window tokens (plus --sink, to compare with StreamingLLM's budget) recomputed
    /// from scratch for every scored token.
    #[arg(long, requires = "stream")]
    pub recompute: bool,
    /// With --stream: use only the first N tokens of the text.
    #[arg(long, requires = "stream")]
    pub limit: Option<usize>,
    /// With --stream: score predictions from this token index on (default 0).
    #[arg(long, requires = "stream", default_value_t = 0)]
    pub score_from: usize,
    /// With --stream: score predictions before this token index (default: all).
    #[arg(long, requires = "stream")]
    pub score_to: Option<usize>,
    #[command(flatten)]
    pub kv: KvArgs,
}

fn run_stream(args: &PerplexityArgs, engine: &mut Engine, text: &str) -> Result<()> {
    let mut tokens = engine.tokenizer().encode(text, true, false)?;
    if let Some(limit) = args.limit {
        tokens.truncate(limit);
    }
    anyhow::ensure!(tokens.len() >= 2, "the text has fewer than two tokens");
    let predictions = tokens.len() - 1;
    let to = args.score_to.unwrap_or(predictions).min(predictions);
    anyhow::ensure!(
        args.score_from < to,
        "nothing to score: --score-from {} is not below {to}",
        args.score_from
    );
    let bar = indicatif::ProgressBar::new(predictions as u64);
    if args.json {
        bar.set_draw_target(indicatif::ProgressDrawTarget::hidden());
    }
    let kv = args.kv.options();
    let kind = kv.kind(args.ctx);
    let label;
    let (nll, held, moved, seconds);
    if args.recompute {
        let window = kind.budget().unwrap_or(args.ctx);
        label = format!("sliding window of {window} with re-computation");
        bar.set_length((to - args.score_from) as u64);
        let start = std::time::Instant::now();
        let scored = stream_eval::recompute_perplexity(
            engine.model_mut(),
            &tokens,
            window,
            args.score_from..to,
            args.batch,
            |done, _| bar.set_position(done as u64),
        )?;
        seconds = start.elapsed().as_secs_f64();
        nll = {
            let mut v = vec![0.0; args.score_from];
            v.extend(scored);
            v
        };
        held = Vec::new();
        moved = Vec::new();
    } else {
        let (mut cache, mut policy) = kv.build(engine.model(), args.ctx, args.batch)?;
        label = format!(
            "{} policy, {} cache, {} keys and values, capacity {}",
            args.kv.policy.name(),
            args.kv.mode.name(),
            kv.element(engine.model()).name(),
            cache.capacity()
        );
        let report = stream_eval::stream_perplexity(
            engine.model_mut(),
            &tokens,
            cache.as_mut(),
            policy
                .as_deref_mut()
                .map(|p| p as &mut dyn ballast_runtime::KvPolicy),
            |done, _| bar.set_position(done as u64),
        )
        .with_context(|| format!("streaming the text through a {label}"))?;
        seconds = report.elapsed.as_secs_f64();
        nll = report.nll;
        held = report.held_bytes;
        moved = report.moved_bytes;
    }
    bar.finish_and_clear();
    let ppl = stream_eval::perplexity_of(&nll, args.score_from..to);
    // KV bytes held after 1x, 2x, 4x ... the cache size, to show they stop growing.
    let cap = kind.budget().unwrap_or(args.ctx);
    let marks: Vec<(usize, u64)> = (0..)
        .map(|i| cap << i)
        .take_while(|&n| n <= held.len())
        .map(|n| (n, held[n - 1]))
        .chain(held.last().map(|&b| (held.len(), b)))
        .collect();
    if args.json {
        println!(
            "{}",
            json!({
                "file": args.file, "mode": "stream", "setup": label,
                "perplexity": ppl, "score_from": args.score_from, "score_to": to,
                "text_tokens": tokens.len(), "seconds": seconds,
                "kv_bytes_held": marks, "kv_bytes_moved": moved.last(),
            })
        );
    } else {
        println!(
            "perplexity {ppl:.4} over predictions {}..{to} of {} tokens read as one stream ({label}), {seconds:.1} s",
            args.score_from,
            tokens.len(),
        );
        if !marks.is_empty() {
            let shown: Vec<String> = marks
                .iter()
                .map(|(n, b)| format!("{} after {n} tokens", human_bytes(*b)))
                .collect();
            println!("KV bytes held: {}", shown.join(", "));
        }
        if let Some(m) = moved.last() {
            println!("KV bytes moved in all: {}", human_bytes(*m));
        }
    }
    Ok(())
}

pub fn run(args: PerplexityArgs) -> Result<()> {
    let text = std::fs::read_to_string(&args.file)
        .with_context(|| format!("reading {}", args.file.display()))?;
    let mut engine = common::load(args.model.builder(args.ctx, args.batch)?)?;
    if args.stream {
        return run_stream(&args, &mut engine, &text);
    }
    if args.kv.policy != ballast::Eviction::None {
        bail!("--kv-policy needs --stream: llama-perplexity's windows of -c tokens never fill their cache, so nothing is evicted");
    }
    // As llama-perplexity: the whole text with the special tokens the model adds (BOS
    // first when it adds one), then every window starts with BOS.
    let tokenizer = engine.tokenizer().clone();
    let mut tokens = tokenizer.encode(&text, true, false)?;
    let bos = tokenizer.add_bos().then(|| tokenizer.bos_id()).flatten();
    if let Some(bos) = bos {
        for w in tokens.chunks_mut(args.ctx) {
            w[0] = bos;
        }
    }
    let bar = indicatif::ProgressBar::new((tokens.len() / args.ctx.max(1)) as u64);
    if args.json {
        bar.set_draw_target(indicatif::ProgressDrawTarget::hidden());
    }
    // Each window's cache in the --kv-mode and --kv-dtype asked for (on the device
    // where the backend keeps KV rows there).
    let model = engine.model().share();
    let kv = args.kv.options();
    let report = perplexity_with_cache(
        engine.model_mut(),
        &tokens,
        args.ctx,
        args.batch,
        || {
            kv.cache(&model, args.ctx, args.batch).map_err(|e| {
                ballast_runtime::Error::InvalidArgument {
                    what: format!("{e:#}"),
                }
            })
        },
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
