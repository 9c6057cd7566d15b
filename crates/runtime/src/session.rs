//! [`Session`]: a model, its KV cache and the tokens seen so far; prefill in chunks,
//! then one token per step. Also [`perplexity`], computed the way `llama-perplexity`
//! does.

use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::kv::{KvCache, KvPolicy};
use crate::model::{BatchSequence, Logits, Model};
use crate::sampler::log_softmax_at;
use crate::DenseKv;

/// Tokens per forward pass during prefill, unless the caller says otherwise.
pub const DEFAULT_BATCH: usize = 64;

/// A conversation with a model: the cache, the policy that may evict from it, and the
/// token history (whose length is the position of the next token).
pub struct Session {
    model: Model,
    kv: Box<dyn KvCache>,
    policy: Option<Box<dyn KvPolicy>>,
    tokens: Vec<u32>,
    batch: usize,
    positions: Vec<u32>,
    logits: Vec<f32>,
    /// Every token's logits from the last [`Session::feed_scored`].
    scored: Vec<f32>,
}

impl Session {
    /// A session over `model` with a cache of `context` tokens in the model's default
    /// element type ([`Model::default_kv_element`]): on the model's device where its
    /// backend keeps KV rows there ([`Model::device_kv_cache`]), else an f16
    /// [`DenseKv`] (whose sliding-window layers keep only their window:
    /// [`Model::host_kv_cache`]); prompts go in chunks of [`DEFAULT_BATCH`].
    pub fn new(model: Model, context: usize) -> Result<Session> {
        Session::with_batch(model, context, DEFAULT_BATCH)
    }

    /// [`Session::new`] with prompts fed in chunks of `batch` tokens (the cache's
    /// sliding-window layers keep room for one such chunk).
    pub fn with_batch(model: Model, context: usize, batch: usize) -> Result<Session> {
        let element = model.default_kv_element();
        let kv = match model.device_kv_cache_windowed(context, element, batch)? {
            Some(kv) => kv,
            None => model.host_kv_cache(context, batch, |shape, capacity| {
                Ok(Box::new(DenseKv::new(shape, capacity)))
            })?,
        };
        let mut session = Session::with_cache(model, kv, None);
        session.set_batch(batch);
        Ok(session)
    }

    /// A session over `model` with any cache and policy.
    pub fn with_cache(
        model: Model,
        kv: Box<dyn KvCache>,
        policy: Option<Box<dyn KvPolicy>>,
    ) -> Session {
        Session {
            model,
            kv,
            policy,
            tokens: Vec::new(),
            batch: DEFAULT_BATCH,
            positions: Vec::new(),
            logits: Vec::new(),
            scored: Vec::new(),
        }
    }

    /// Sets the prefill chunk size (at least one token; at most what the cache takes
    /// per pass, [`KvCache::pass_limit`], is used).
    pub fn set_batch(&mut self, batch: usize) {
        self.batch = batch.max(1);
    }

    /// The model.
    pub fn model(&self) -> &Model {
        &self.model
    }

    /// The cache.
    pub fn kv(&self) -> &dyn KvCache {
        self.kv.as_ref()
    }

    /// The logits after the last token fed (empty before the first feed).
    pub fn logits(&self) -> &[f32] {
        &self.logits
    }

    /// Every token fed so far.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// Feeds `ids` (a prompt in chunks of the batch size, or one generated token) and
    /// returns the logits after the last of them.
    pub fn feed(&mut self, ids: &[u32]) -> Result<&[f32]> {
        let mut logits = std::mem::take(&mut self.logits);
        let r = self.feed_chunks(ids, |model, chunk, positions, kv, policy, last| {
            let mode = if last { Logits::Last } else { Logits::None };
            let out = model.forward(chunk, positions, kv, policy, mode)?;
            if last {
                logits.clear();
                logits.extend_from_slice(out);
            }
            Ok(())
        });
        self.logits = logits;
        r?;
        Ok(&self.logits)
    }

    /// Runs `ids` in chunks of the batch size through `pass` (told whether the chunk is
    /// the last), then records them as fed.
    fn feed_chunks(
        &mut self,
        ids: &[u32],
        mut pass: impl FnMut(
            &mut Model,
            &[u32],
            &[u32],
            &mut dyn KvCache,
            Option<&mut dyn KvPolicy>,
            bool,
        ) -> Result<()>,
    ) -> Result<()> {
        if ids.is_empty() {
            return Err(Error::EmptyInput);
        }
        self.check_room(ids.len())?;
        let chunks: Vec<&[u32]> = ids.chunks(self.batch.min(self.kv.pass_limit())).collect();
        for (i, chunk) in chunks.iter().enumerate() {
            let start = self.tokens.len() as u32;
            self.positions.clear();
            self.positions
                .extend((0..chunk.len() as u32).map(|j| start + j));
            let last = i + 1 == chunks.len();
            let policy = self.policy.as_deref_mut().map(|p| p as &mut dyn KvPolicy);
            pass(
                &mut self.model,
                chunk,
                &self.positions,
                self.kv.as_mut(),
                policy,
                last,
            )?;
            self.tokens.extend_from_slice(chunk);
        }
        Ok(())
    }

    /// Feeds `ids` like [`Session::feed`] and returns the logits after each of them,
    /// one vocabulary-wide row per token (a speculative step's verification: the rows
    /// say what the model would have chosen after every drafted token).
    /// [`Session::logits`] holds the last row.
    pub fn feed_scored(&mut self, ids: &[u32]) -> Result<&[f32]> {
        let mut rows = std::mem::take(&mut self.scored);
        rows.clear();
        let r = self.feed_chunks(ids, |model, chunk, positions, kv, policy, _| {
            let out = model.forward(chunk, positions, kv, policy, Logits::All)?;
            rows.extend_from_slice(out);
            Ok(())
        });
        self.scored = rows;
        r?;
        let vocab = self.model.config().vocab_size;
        self.logits.clear();
        self.logits
            .extend_from_slice(&self.scored[self.scored.len() - vocab..]);
        Ok(&self.scored)
    }

    /// Every token's logits from the last [`Session::feed_scored`], one row per token.
    pub fn scored(&self) -> &[f32] {
        &self.scored
    }

    /// Keeps the first `n_tokens` of the tokens the last [`Session::feed_scored`] fed
    /// and forgets the rest, as if only those had been fed: the cache drops the
    /// others' rows and [`Session::logits`] becomes the kept last token's row. A
    /// rejected draft's tokens are rolled back this way. False (and the session then
    /// holds nothing, as [`Session::rewind`] leaves it) when the cache could not
    /// rewind exactly.
    pub fn keep_scored(&mut self, n_tokens: usize) -> bool {
        let vocab = self.model.config().vocab_size;
        let fed = self.scored.len() / vocab.max(1);
        if fed == 0 {
            return true;
        }
        let n_tokens = n_tokens.clamp(1, fed);
        let target = self.tokens.len() - (fed - n_tokens);
        if self.rewind(target) != target {
            return false;
        }
        self.logits
            .extend_from_slice(&self.scored[(n_tokens - 1) * vocab..n_tokens * vocab]);
        true
    }

    /// Refuses `n` more tokens when the cache cannot hold them and no policy evicts.
    fn check_room(&self, n: usize) -> Result<()> {
        let needed = self.kv.len() + n;
        if needed > self.kv.capacity() && self.policy.is_none() {
            return Err(Error::ContextFull {
                needed,
                capacity: self.kv.capacity(),
            });
        }
        Ok(())
    }

    /// Feeds `ids` like [`Session::feed`] and returns the greedy next id (largest logit,
    /// lowest id on ties) instead of the logits: on a device backend only that id is read
    /// back. [`Session::logits`] is cleared (it would no longer follow the last token).
    pub fn feed_greedy(&mut self, ids: &[u32]) -> Result<u32> {
        self.logits.clear();
        let mut greedy = None;
        self.feed_chunks(ids, |model, chunk, positions, kv, policy, last| {
            if last {
                greedy = Some(model.forward_greedy(chunk, positions, kv, policy)?);
                Ok(())
            } else {
                model.forward(chunk, positions, kv, policy, Logits::None)?;
                Ok(())
            }
        })?;
        greedy.ok_or(Error::EmptyInput)
    }

    /// Forgets everything after the first `n_tokens` tokens and returns how many it
    /// kept. The cache drops as many of its newest tokens (after an eviction it holds
    /// fewer than the history). A cache that cannot rewind that far exactly (a
    /// sliding-window layer dropped keys the next token would see:
    /// [`KvCache::exact_rewind_floor`]) is cleared instead and 0 tokens are kept: the
    /// caller feeds them again.
    pub fn rewind(&mut self, n_tokens: usize) -> usize {
        let dropped = self.tokens.len().saturating_sub(n_tokens);
        let target = self.kv.len().saturating_sub(dropped);
        let kept = if target > 0 && target < self.kv.exact_rewind_floor() {
            self.kv.clear();
            0
        } else {
            self.kv.rewind(target);
            n_tokens.min(self.tokens.len())
        };
        self.tokens.truncate(kept);
        self.logits.clear();
        kept
    }

    /// The policy that may evict from the cache, if any.
    pub fn policy(&self) -> Option<&dyn KvPolicy> {
        self.policy.as_deref()
    }

    /// The policy, to restore its state with the cache's (see
    /// [`KvPolicy::restore_state`]).
    pub fn policy_mut(&mut self) -> Option<&mut (dyn KvPolicy + 'static)> {
        self.policy.as_deref_mut()
    }

    /// The cache, to save or load it. The token history must keep matching it: see
    /// [`Session::restore`].
    pub fn kv_mut(&mut self) -> &mut dyn KvCache {
        self.kv.as_mut()
    }

    /// Sets the token history and the logits after its last token, after the cache was
    /// loaded with what a saved session held (resuming without recomputing the prompt).
    pub fn restore(&mut self, tokens: Vec<u32>, logits: Vec<f32>) {
        self.tokens = tokens;
        self.logits = logits;
    }
}

/// One session's share of a batched step ([`feed_batch`]).
pub struct BatchFeed<'s> {
    /// The session.
    pub session: &'s mut Session,
    /// Its tokens this step: a prompt chunk (at most its batch size) or one token.
    pub ids: &'s [u32],
    /// Whether the logits after them are wanted (then [`Session::logits`] has them).
    pub logits: bool,
    /// Whether the logits after each of them are wanted, as [`Session::feed_scored`]
    /// gives them (then [`Session::scored`] has them, and [`Session::logits`] the
    /// last row).
    pub scored: bool,
}

/// Feeds several sessions in one pass of `model` (continuous batching): each layer's
/// weights are read once for all of them, and each session's cache gets its own keys
/// and values, exactly as [`Session::feed`] of one chunk would. `model` must be a handle
/// on the sessions' weights ([`Model::share`]); its MLP lever serves the pass.
///
/// A session whose chunk does not fit its cache is refused before anything runs. If
/// the pass fails, the sessions' caches may hold part of it: rewind them.
pub fn feed_batch(model: &mut Model, feeds: &mut [BatchFeed<'_>]) -> Result<()> {
    for feed in feeds.iter() {
        let session = &*feed.session;
        if !model.shares_weights_with(&session.model) {
            return Err(Error::InvalidArgument {
                what: "a batched step's model must share the sessions' weights".into(),
            });
        }
        if feed.ids.is_empty() {
            return Err(Error::EmptyInput);
        }
        session.check_room(feed.ids.len())?;
    }
    let mut sequences = Vec::with_capacity(feeds.len());
    for feed in feeds.iter_mut() {
        let session = &mut *feed.session;
        let start = session.tokens.len() as u32;
        session.positions.clear();
        session
            .positions
            .extend((0..feed.ids.len() as u32).map(|j| start + j));
        sequences.push(BatchSequence {
            ids: feed.ids,
            positions: &session.positions,
            kv: session.kv.as_mut(),
            policy: match session.policy.as_deref_mut() {
                Some(p) => Some(p),
                None => None,
            },
            logits: feed.logits || feed.scored,
            every_row: feed.scored,
        });
    }
    let vocab = model.config().vocab_size;
    let logits = model.forward_batch(sequences)?;
    let mut at = 0;
    for feed in feeds.iter_mut() {
        let session = &mut *feed.session;
        let n_rows = if feed.scored {
            feed.ids.len()
        } else {
            usize::from(feed.logits)
        };
        if n_rows > 0 {
            let rows =
                logits
                    .get(at * vocab..(at + n_rows) * vocab)
                    .ok_or(Error::ShapeMismatch {
                        what: "logits of a batched step".into(),
                        expected: (at + n_rows) * vocab,
                        got: logits.len(),
                    })?;
            at += n_rows;
            if feed.scored {
                session.scored.clear();
                session.scored.extend_from_slice(rows);
            }
            session.logits.clear();
            session
                .logits
                .extend_from_slice(&rows[(n_rows - 1) * vocab..]);
        }
        session.tokens.extend_from_slice(feed.ids);
    }
    Ok(())
}

/// The result of [`perplexity`].
#[derive(Clone, Debug, PartialEq)]
pub struct PerplexityReport {
    /// `exp(mean negative log-likelihood)`.
    pub perplexity: f64,
    /// Windows evaluated.
    pub chunks: usize,
    /// Tokens scored.
    pub scored_tokens: usize,
    /// Tokens in the whole text.
    pub text_tokens: usize,
    /// Wall time of the evaluation.
    pub elapsed: Duration,
}

/// Perplexity the way `llama-perplexity` computes it: the tokens are cut into
/// `floor(n / ctx)` non-overlapping windows, each evaluated from an empty cache, and in
/// each window the positions `i` in `[ctx/2, ctx-2]` are scored against token `i + 1`.
/// `progress(done, total)` is called after each window. The cache is a [`DenseKv`] (f16,
/// as llama.cpp's); [`perplexity_with_cache`] takes any.
pub fn perplexity(
    model: &mut Model,
    tokens: &[u32],
    ctx: usize,
    batch: usize,
    progress: impl FnMut(usize, usize),
) -> Result<PerplexityReport> {
    let shape = model.kv_shape();
    perplexity_with_cache(
        model,
        tokens,
        ctx,
        batch,
        || Ok(Box::new(DenseKv::new(shape, ctx))),
        progress,
    )
}

/// [`perplexity`] with each window's cache made by `new_cache` (of at least `ctx`
/// tokens): another precision or layout of the keys and values.
pub fn perplexity_with_cache(
    model: &mut Model,
    tokens: &[u32],
    ctx: usize,
    batch: usize,
    mut new_cache: impl FnMut() -> Result<Box<dyn KvCache>>,
    mut progress: impl FnMut(usize, usize),
) -> Result<PerplexityReport> {
    if ctx < 4 {
        return Err(Error::InvalidArgument {
            what: format!("perplexity context {ctx} is too small (at least 4)"),
        });
    }
    let n_chunks = tokens.len() / ctx;
    if n_chunks == 0 {
        return Err(Error::InvalidArgument {
            what: format!(
                "the text has {} tokens, fewer than one window of {ctx}",
                tokens.len()
            ),
        });
    }
    let start = Instant::now();
    let vocab = model.config().vocab_size;
    let mut nll = 0.0f64;
    let mut count = 0usize;
    let batch = batch.max(1);
    for c in 0..n_chunks {
        let window = &tokens[c * ctx..(c + 1) * ctx];
        let mut kv = new_cache()?;
        let mut done = 0;
        while done < ctx {
            let end = (done + batch).min(ctx);
            let positions: Vec<u32> = (done as u32..end as u32).collect();
            let logits = model.forward(
                &window[done..end],
                &positions,
                kv.as_mut(),
                None,
                Logits::All,
            )?;
            for i in done..end {
                if i >= ctx / 2 && i + 1 < ctx {
                    let row = &logits[(i - done) * vocab..(i - done + 1) * vocab];
                    nll -= log_softmax_at(row, window[i + 1]) as f64;
                    count += 1;
                }
            }
            done = end;
        }
        progress(c + 1, n_chunks);
    }
    Ok(PerplexityReport {
        perplexity: (nll / count as f64).exp(),
        chunks: n_chunks,
        scored_tokens: count,
        text_tokens: tokens.len(),
        elapsed: start.elapsed(),
    })
}
