//! StreamingLLM's evaluation: the perplexity of a text read as one stream, token by
//! token, through any cache and policy ([`stream_perplexity`], e.g. a
//! `ballast-kv-cache` cache under its `StreamingLlm` policy), and the paper's slow
//! oracle, a sliding window recomputed from scratch for every token
//! ([`recompute_perplexity`]). Compare [`crate::session::perplexity`], which scores
//! independent windows the way `llama-perplexity` does.

use std::ops::Range;
use std::time::{Duration, Instant};

use crate::model::Logits;
use crate::sampler::log_softmax_at;
use crate::{DenseKv, KvCache, KvPolicy, Model, Result};

/// Per-token results of a stream.
#[derive(Clone, Debug, Default)]
pub struct StreamReport {
    /// `nll[i]`: negative log-likelihood of token `i + 1` given what came before it.
    pub nll: Vec<f64>,
    /// KV bytes held after each token was fed (same indexing as `nll`).
    pub held_bytes: Vec<u64>,
    /// KV bytes moved after each token was fed (cumulative).
    pub moved_bytes: Vec<u64>,
    /// Wall time.
    pub elapsed: Duration,
}

impl StreamReport {
    /// `exp(mean nll)` over the predictions `range` (indices into `nll`, clamped).
    pub fn perplexity(&self, range: Range<usize>) -> f64 {
        perplexity_of(&self.nll, range)
    }
}

/// `exp(mean)` of `nll[range]` (clamped; NaN if empty).
pub fn perplexity_of(nll: &[f64], range: Range<usize>) -> f64 {
    let end = range.end.min(nll.len());
    let start = range.start.min(end);
    let s = &nll[start..end];
    (s.iter().sum::<f64>() / s.len() as f64).exp()
}

/// Feeds `tokens` one at a time at positions `0, 1, 2, ...` into `cache` (with
/// `policy` evicting, if any) and scores each next token. `progress(done, total)`
/// is called every 16 tokens.
pub fn stream_perplexity(
    model: &mut Model,
    tokens: &[u32],
    cache: &mut dyn KvCache,
    mut policy: Option<&mut dyn KvPolicy>,
    mut progress: impl FnMut(usize, usize),
) -> Result<StreamReport> {
    let start = Instant::now();
    let total = tokens.len().saturating_sub(1);
    let mut report = StreamReport::default();
    for i in 0..total {
        let logits = model.forward(
            &tokens[i..i + 1],
            &[i as u32],
            cache,
            policy.as_mut().map(|p| &mut **p as &mut dyn KvPolicy),
            Logits::Last,
        )?;
        report
            .nll
            .push(-(log_softmax_at(logits, tokens[i + 1]) as f64));
        report.held_bytes.push(cache.held_bytes().device);
        report.moved_bytes.push(cache.moved_bytes());
        if (i + 1) % 16 == 0 || i + 1 == total {
            progress(i + 1, total);
        }
    }
    report.elapsed = start.elapsed();
    Ok(report)
}

/// The paper's oracle, "sliding window with re-computation": for each prediction `i`
/// in `range`, a fresh cache is filled with the `window` tokens ending at `i` (at
/// positions `0..window`, in passes of `batch`) and token `i + 1` is scored. Exact
/// for a window, and `window` times slower than a stream. Returns `nll` for `range`.
pub fn recompute_perplexity(
    model: &mut Model,
    tokens: &[u32],
    window: usize,
    range: Range<usize>,
    batch: usize,
    mut progress: impl FnMut(usize, usize),
) -> Result<Vec<f64>> {
    let end = range.end.min(tokens.len().saturating_sub(1));
    let start = range.start.min(end);
    let mut nll = Vec::with_capacity(end - start);
    let batch = batch.max(1);
    for i in start..end {
        let first = (i + 1).saturating_sub(window);
        let ctx = &tokens[first..=i];
        let mut kv = DenseKv::new(model.kv_shape(), window.max(1));
        let mut done = 0;
        let mut last = Vec::new();
        while done < ctx.len() {
            let stop = (done + batch).min(ctx.len());
            let positions: Vec<u32> = (done as u32..stop as u32).collect();
            let mode = if stop == ctx.len() {
                Logits::Last
            } else {
                Logits::None
            };
            let logits = model.forward(&ctx[done..stop], &positions, &mut kv, None, mode)?;
            if stop == ctx.len() {
                last = logits.to_vec();
            }
            done = stop;
        }
        nll.push(-(log_softmax_at(&last, tokens[i + 1]) as f64));
        progress(i + 1 - start, end - start);
    }
    Ok(nll)
}
