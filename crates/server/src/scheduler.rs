//! The scheduler: one thread that owns the sessions (one per slot, each with its own
//! KV cache) and runs the running sequences step by step (continuous batching). A step
//! is one forward pass over every running sequence ([`feed_batch`]): one decoded token
//! of each generating sequence, plus prompt chunks of those still reading their prompt
//! (at most `batch` prompt tokens per step in all, so a long prompt does not hold up the
//! others' tokens). Each layer's weights are read once per step for all sequences. New
//! requests join between steps, and a sequence whose client went away is dropped at the
//! next step.

use std::collections::VecDeque;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Instant;

use ballast_runtime::generate::{
    accept_scored, draft_limit, Continuation, DraftOptions, Drafter, Finish,
    FinishReason as Reason, GenerateOptions, Proposal, Step, Token,
};
use ballast_runtime::sampler::log_softmax_at;
use ballast_runtime::{feed_batch, BatchFeed, Model, Session, TierBytes, Tokenizer};
use tokio::sync::mpsc::UnboundedSender;

use crate::api::{ApiError, FinishReason, Generation, TokenLogprob, TopLogprob, Usage};
use crate::metrics::Metrics;

/// What the scheduler tells the handler of a request.
#[derive(Debug)]
pub enum Event {
    /// New text (possibly empty when only log-probabilities are new).
    Delta {
        /// Text to append.
        text: String,
        /// Log-probabilities of the tokens of this step.
        logprobs: Vec<TokenLogprob>,
    },
    /// The end.
    Done {
        /// Why.
        finish: FinishReason,
        /// Token counts.
        usage: Usage,
    },
    /// The engine failed (not the request's fault).
    Failed(String),
}

/// A request waiting for a slot.
pub struct Job {
    /// Prompt token ids.
    pub prompt: Vec<u32>,
    /// Its parameters.
    pub generation: Generation,
    /// Where its events go; closed when the client went away.
    pub events: UnboundedSender<Event>,
}

struct QueueState {
    waiting: VecDeque<Job>,
    /// Sequences holding a slot (updated under the lock, so admission sees them).
    running: usize,
    shutdown: bool,
}

/// The queue between the handlers and the scheduler thread, and the metrics.
pub struct Shared {
    state: Mutex<QueueState>,
    wake: Condvar,
    /// Counters for `/metrics`.
    pub metrics: Metrics,
    /// Most requests waiting beyond the ones holding a slot.
    max_queue: usize,
    /// Slots (set once the model is loaded).
    parallel: std::sync::atomic::AtomicUsize,
}

impl Shared {
    /// An empty queue that takes `max_queue` requests beyond the running ones.
    pub fn new(max_queue: usize) -> Shared {
        Shared {
            state: Mutex::new(QueueState {
                waiting: VecDeque::new(),
                running: 0,
                shutdown: false,
            }),
            wake: Condvar::new(),
            metrics: Metrics::default(),
            max_queue,
            parallel: 0.into(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, QueueState> {
        // A poisoned lock means a panic elsewhere; the queue itself stays consistent
        // (every change is one push or pop), so keep serving.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Requests waiting for a slot, and sequences holding one.
    pub fn load(&self) -> (usize, usize) {
        let q = self.lock();
        (q.waiting.len(), q.running)
    }

    /// Queues `job`, or refuses it with a 503 when every slot is busy and the queue full.
    pub fn submit(&self, job: Job) -> Result<(), ApiError> {
        let mut q = self.lock();
        let parallel = self.parallel.load(Relaxed);
        if q.waiting.len() + q.running >= parallel + self.max_queue {
            return Err(ApiError {
                status: 503,
                message: format!(
                    "the server is busy: {} sequences running and {} requests queued (the most \
                     it takes); retry later",
                    q.running,
                    q.waiting.len()
                ),
                kind: "unavailable_error",
                code: Some("queue_full"),
            });
        }
        q.waiting.push_back(job);
        self.wake.notify_one();
        Ok(())
    }

    /// Sets the number of slots. Called before the handlers may queue anything: a
    /// request that came before it would find no slot and a zero-length queue full.
    pub(crate) fn set_slots(&self, slots: usize) {
        self.parallel.store(slots, Relaxed);
    }

    /// Asks the scheduler thread to stop.
    pub fn shutdown(&self) {
        self.lock().shutdown = true;
        self.wake.notify_all();
    }
}

/// A sequence in a slot.
struct Sequence {
    job: Job,
    /// Prompt tokens still to feed.
    pending: VecDeque<u32>,
    prompt_tokens: usize,
    cached_tokens: usize,
    /// Sampling, penalties, detokenizer and stop rules: the generator's per-token half,
    /// handed this sequence's logits after each batched pass.
    continuation: Continuation,
    /// The sampled token not yet fed.
    next: Option<u32>,
    /// The tokens drafted after it this step (verified in the step's pass).
    proposals: Vec<Proposal>,
}

struct Slot {
    session: Session,
    seq: Option<Sequence>,
    /// Drafts this slot's tokens when decoding speculatively.
    drafter: Option<Box<dyn Drafter>>,
    /// The eviction policy's state before the first sequence, restored for each new
    /// one (a policy remembers the sinks it saw first).
    fresh_policy: Option<Vec<u8>>,
}

/// Tokens a session's cache can hold, or `None` when a policy evicts (no limit).
pub fn context_of(session: &Session) -> Option<usize> {
    session.policy().is_none().then(|| session.kv().capacity())
}

/// Runs the scheduler on this thread until [`Shared::shutdown`].
pub fn run(
    model: Model,
    sessions: Vec<Session>,
    speculation: Option<crate::Speculation>,
    tokenizer: Arc<Tokenizer>,
    batch: usize,
    shared: Arc<Shared>,
) {
    let capacity: usize = sessions.iter().map(|s| s.kv().capacity()).sum();
    shared.metrics.kv_capacity.store(capacity as u64, Relaxed);
    let (mut drafters, draft) = match speculation {
        Some(s) => (s.drafters, s.options),
        None => (Vec::new(), DraftOptions::default()),
    };
    drafters.truncate(sessions.len());
    let mut drafters = drafters.into_iter();
    let mut slots: Vec<Slot> = sessions
        .into_iter()
        .map(|session| Slot {
            fresh_policy: session.policy().map(|p| p.state()),
            session,
            seq: None,
            drafter: drafters.next(),
        })
        .collect();
    let mut sched = Scheduler {
        model,
        tokenizer,
        batch: batch.max(1),
        shared,
        draft,
    };
    loop {
        if !sched.admit(&mut slots) {
            return;
        }
        sched.step(&mut slots);
        sched.gauges(&slots);
    }
}

struct Scheduler {
    /// The handle the steps' passes run on.
    model: Model,
    tokenizer: Arc<Tokenizer>,
    batch: usize,
    shared: Arc<Shared>,
    /// Draft lengths of the slots' drafters.
    draft: DraftOptions,
}

/// What one slot feeds in a step.
struct StepInput {
    slot: usize,
    ids: Vec<u32>,
    /// The prompt is done after these tokens (or this is a generated token): sample.
    sample: bool,
    prompt: bool,
    /// A generated token and a draft after it: every row's logits, verified.
    verify: bool,
}

/// Tokens two sequences share at the start.
fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

impl Scheduler {
    /// Gives waiting requests the free slots; waits while nothing runs. False on
    /// shutdown.
    fn admit(&mut self, slots: &mut [Slot]) -> bool {
        let mut q = self.shared.lock();
        loop {
            if q.shutdown {
                return false;
            }
            let busy = slots.iter().filter(|s| s.seq.is_some()).count();
            if busy > 0 || !q.waiting.is_empty() {
                break;
            }
            q = self.shared.wake.wait(q).unwrap_or_else(|e| e.into_inner());
        }
        while slots.iter().any(|s| s.seq.is_none()) {
            let Some(job) = q.waiting.pop_front() else {
                break;
            };
            if job.events.is_closed() {
                self.shared.metrics.cancelled.fetch_add(1, Relaxed);
                continue;
            }
            // The free slot whose cache shares the longest start with the prompt (the
            // previous turn of the same chat, most often); among equals the emptiest,
            // which keeps longer caches for the requests that may continue them.
            let slot = slots
                .iter_mut()
                .filter(|s| s.seq.is_none())
                .max_by_key(|s| {
                    let shared = if context_of(&s.session).is_some() {
                        common_prefix(s.session.tokens(), &job.prompt)
                    } else {
                        0
                    };
                    (shared, std::cmp::Reverse(s.session.tokens().len()))
                })
                .expect("a free slot exists");
            if self.start(slot, job) {
                q.running += 1;
            }
        }
        true
    }

    /// Puts `job` in `slot`; false if the slot could not be readied (the job was told).
    fn start(&self, slot: &mut Slot, job: Job) -> bool {
        let session = &mut slot.session;
        // Reuse the cached keys and values of the prompt's start, but feed at least its
        // last token: its logits give the first generated token. A cache with an
        // eviction policy is not a prefix of its history, so it starts over; so does
        // one whose sliding-window layers dropped what the prompt's next token sees
        // (`rewind` then keeps nothing).
        let reusable = if context_of(session).is_some() {
            common_prefix(session.tokens(), &job.prompt).min(job.prompt.len() - 1)
        } else {
            0
        };
        let cached = session.rewind(reusable);
        if let (Some(policy), Some(fresh)) = (session.policy_mut(), &slot.fresh_policy) {
            if let Err(e) = policy.restore_state(fresh) {
                let _ = job.events.send(Event::Failed(e.to_string()));
                return false;
            }
        }
        let g = &job.generation;
        let options = GenerateOptions {
            sampler: g.sampler,
            max_tokens: g.max_tokens,
            stop: g.stop.clone(),
            ignore_eos: g.ignore_eos,
            presence_penalty: g.presence_penalty,
            frequency_penalty: g.frequency_penalty,
            // The log-probabilities (with the alternatives) are read off the logits here.
            logprobs: false,
            keep_logits: true,
        };
        let continuation = match Continuation::new(options) {
            Ok(c) => c,
            Err(e) => {
                let _ = job.events.send(Event::Failed(e.to_string()));
                return false;
            }
        };
        let seq = Sequence {
            pending: job.prompt[cached..].iter().copied().collect(),
            prompt_tokens: job.prompt.len(),
            cached_tokens: cached,
            continuation,
            next: None,
            proposals: Vec::new(),
            job,
        };
        self.shared
            .metrics
            .cached_tokens
            .fetch_add(cached as u64, Relaxed);
        slot.seq = Some(seq);
        true
    }

    /// One pass over every running sequence: a generated token of each that has one,
    /// and prompt chunks, at most `batch` prompt tokens in all.
    fn step(&mut self, slots: &mut [Slot]) {
        let shared = self.shared.clone();
        let m = &shared.metrics;
        let mut inputs = Vec::new();
        let mut prompt_budget = self.batch;
        for (i, slot) in slots.iter_mut().enumerate() {
            let Some(seq) = slot.seq.as_mut() else {
                continue;
            };
            if seq.job.events.is_closed() {
                m.cancelled.fetch_add(1, Relaxed);
                self.release(slot);
                continue;
            }
            if let Some(id) = seq.next.take() {
                seq.proposals.clear();
                if let Some(drafter) = slot.drafter.as_mut() {
                    if let Err(e) = draft(drafter.as_mut(), &self.draft, &slot.session, seq, id) {
                        let _ = seq.job.events.send(Event::Failed(e.to_string()));
                        self.release(slot);
                        continue;
                    }
                }
                let mut ids = vec![id];
                ids.extend(seq.proposals.iter().map(|p| p.id));
                inputs.push(StepInput {
                    slot: i,
                    verify: ids.len() > 1,
                    ids,
                    sample: true,
                    prompt: false,
                });
            } else if !seq.pending.is_empty() && prompt_budget > 0 {
                let room = slot.session.kv().pass_limit();
                let n = prompt_budget.min(seq.pending.len()).min(room);
                prompt_budget -= n;
                let ids: Vec<u32> = seq.pending.drain(..n).collect();
                inputs.push(StepInput {
                    slot: i,
                    ids,
                    sample: seq.pending.is_empty(),
                    prompt: true,
                    verify: false,
                });
            }
        }
        if inputs.is_empty() {
            return;
        }
        let t = Instant::now();
        let result = {
            let mut wanted: Vec<Option<&mut Slot>> = slots.iter_mut().map(Some).collect();
            let mut feeds: Vec<BatchFeed<'_>> = inputs
                .iter()
                .map(|input| BatchFeed {
                    session: &mut wanted[input.slot]
                        .take()
                        .expect("one input per slot")
                        .session,
                    ids: &input.ids,
                    logits: input.sample,
                    scored: input.verify,
                })
                .collect();
            feed_batch(&mut self.model, &mut feeds)
        };
        // The pass's time, split between prompt and generation by their tokens.
        let elapsed = t.elapsed();
        let rows: usize = inputs.iter().map(|i| i.ids.len()).sum();
        let prompt_rows: usize = inputs
            .iter()
            .filter(|i| i.prompt)
            .map(|i| i.ids.len())
            .sum();
        let share = |n: usize| elapsed.mul_f64(n as f64 / rows as f64);
        Metrics::add_time(&m.prompt_nanos, share(prompt_rows));
        Metrics::add_time(&m.generation_nanos, share(rows - prompt_rows));
        m.prompt_tokens.fetch_add(prompt_rows as u64, Relaxed);
        m.steps.fetch_add(1, Relaxed);
        m.step_sequences.fetch_add(inputs.len() as u64, Relaxed);
        if result.is_ok() {
            if let Some(pass) = self.model.backend().telemetry().last_pass() {
                m.device_bytes_uploaded
                    .fetch_add(pass.bytes_uploaded, Relaxed);
            }
        }
        if let Err(e) = result {
            for input in &inputs {
                let slot = &mut slots[input.slot];
                if let Some(seq) = slot.seq.as_ref() {
                    let _ = seq.job.events.send(Event::Failed(e.to_string()));
                }
                // The pass may have written part of its keys: start the cache over.
                slot.session.rewind(0);
                self.release(slot);
            }
            return;
        }
        for input in inputs.iter().filter(|i| i.sample) {
            let slot = &mut slots[input.slot];
            let end = if input.verify {
                self.after_verification(slot)
            } else {
                self.after_logits(slot)
            };
            if let Some(finish) = end {
                self.finish(slot, finish);
            }
        }
    }

    /// Chooses the next token from the session's logits and sends its text. Returns
    /// how the generation ends, if it does.
    fn after_logits(&mut self, slot: &mut Slot) -> Option<Finish> {
        let seq = slot.seq.as_mut()?;
        let session = &slot.session;
        let logits = session.logits();
        let room = context_of(session).map(|ctx| ctx.saturating_sub(session.kv().len()));
        let token = match seq
            .continuation
            .choose(&self.tokenizer, logits, session.tokens(), room)
        {
            Step::Token(token) => token,
            Step::Done(end) => return Some(end),
        };
        let logprobs = seq.job.generation.logprobs;
        let logprobs = logprobs.map(|top| token_logprob(&self.tokenizer, logits, token.id, top));
        let id = token.id;
        self.emit(seq, token, logprobs);
        Self::next_or_end(seq, id)
    }

    /// Sends a generated token's text (and log-probabilities).
    fn emit(&self, seq: &mut Sequence, token: Token, logprobs: Option<TokenLogprob>) {
        self.shared.metrics.generated_tokens.fetch_add(1, Relaxed);
        let logprobs: Vec<TokenLogprob> = logprobs.into_iter().collect();
        if !token.text.is_empty() || !logprobs.is_empty() {
            let _ = seq.job.events.send(Event::Delta {
                text: token.text,
                logprobs,
            });
        }
    }

    /// After the last token a step gave (`id`): the end when it ended the generation,
    /// else the token to feed next.
    fn next_or_end(seq: &mut Sequence, id: u32) -> Option<Finish> {
        let end = seq.continuation.finish();
        if end.is_none() {
            seq.next = Some(id);
        }
        end
    }

    /// Takes the tokens of a verification pass (the generated token and the draft
    /// after it): the accepted drafted tokens and the model's own after them, each sent
    /// as a plain step would send it; the rejected rows leave the cache.
    fn after_verification(&mut self, slot: &mut Slot) -> Option<Finish> {
        let seq = slot.seq.as_mut()?;
        let result = accept_scored(
            &mut seq.continuation,
            &self.tokenizer,
            &mut slot.session,
            &seq.proposals,
        );
        let (steps, accepted) = match result {
            Ok(r) => r,
            Err(e) => {
                let _ = seq.job.events.send(Event::Failed(e.to_string()));
                slot.session.rewind(0);
                self.release(slot);
                return None;
            }
        };
        let m = &self.shared.metrics;
        m.drafted_tokens
            .fetch_add(seq.proposals.len() as u64, Relaxed);
        m.accepted_tokens.fetch_add(accepted as u64, Relaxed);
        let vocab = slot.session.model().config().vocab_size;
        let mut last = None;
        for (row, step) in steps.into_iter().enumerate() {
            let token = match step {
                Step::Token(token) => token,
                Step::Done(end) => return Some(end),
            };
            let logprobs = seq.job.generation.logprobs.map(|top| {
                let logits = &slot.session.scored()[row * vocab..(row + 1) * vocab];
                token_logprob(&self.tokenizer, logits, token.id, top)
            });
            last = Some(token.id);
            self.emit(seq, token, logprobs);
        }
        // The continuation saw every step: an end after the last token shows now.
        match last {
            Some(id) => Self::next_or_end(seq, id),
            None => seq.continuation.finish(),
        }
    }

    /// Sends the text held back and the end, and frees the slot.
    fn finish(&mut self, slot: &mut Slot, end: Finish) {
        let Some(seq) = slot.seq.as_mut() else {
            return;
        };
        if !end.text.is_empty() {
            let _ = seq.job.events.send(Event::Delta {
                text: end.text,
                logprobs: Vec::new(),
            });
        }
        let finish = match end.reason {
            Reason::EndOfGeneration | Reason::StopString => FinishReason::Stop,
            Reason::MaxTokens | Reason::ContextFull => FinishReason::Length,
        };
        let generated = seq.continuation.generated();
        let usage = Usage {
            prompt_tokens: seq.prompt_tokens,
            completion_tokens: generated,
            total_tokens: seq.prompt_tokens + generated,
            prompt_tokens_details: crate::api::PromptTokensDetails {
                cached_tokens: seq.cached_tokens,
            },
        };
        let events = seq.job.events.clone();
        // The slot is free before the client hears of the end, so its next request
        // finds it free.
        self.release(slot);
        let _ = events.send(Event::Done { finish, usage });
    }

    fn release(&mut self, slot: &mut Slot) {
        slot.seq = None;
        // Its cache no longer counts as in use (the gauges of the step come later).
        let m = &self.shared.metrics;
        let held = slot.session.kv().len() as u64;
        let _ = m
            .kv_tokens
            .fetch_update(Relaxed, Relaxed, |v| Some(v.saturating_sub(held)));
        let mut q = self.shared.lock();
        q.running = q.running.saturating_sub(1);
    }

    fn gauges(&self, slots: &[Slot]) {
        let m = &self.shared.metrics;
        let running = slots.iter().filter(|s| s.seq.is_some());
        m.kv_tokens
            .store(running.map(|s| s.session.kv().len() as u64).sum(), Relaxed);
        let kv = slots
            .iter()
            .map(|s| s.session.kv().held_bytes())
            .fold(TierBytes::default(), |a, b| a + b);
        if let Some(first) = slots.first() {
            let store = first.session.model().store();
            m.set_bytes(store.held_bytes(), store.moved_bytes(), kv);
        }
    }
}

/// Fills `seq.proposals` with what `drafter` proposes after `next` (the token this
/// step feeds), cut to what the slot's cache takes without evicting and to the tokens
/// the generation may still give, and emptied when shorter than the minimum.
fn draft(
    drafter: &mut dyn Drafter,
    options: &DraftOptions,
    session: &Session,
    seq: &mut Sequence,
    next: u32,
) -> ballast_runtime::Result<()> {
    let max = draft_limit(session, &seq.continuation, options);
    if max == 0 {
        return Ok(());
    }
    let mut context = session.tokens().to_vec();
    context.push(next);
    let sampler = seq.continuation.options().sampler;
    drafter.draft(&context, max, &sampler, &mut seq.proposals)?;
    seq.proposals.truncate(max);
    if seq.proposals.len() < options.min {
        seq.proposals.clear();
    }
    Ok(())
}

/// The log-probability of `id` and the `top` most likely tokens under `logits`.
fn token_logprob(tokenizer: &Tokenizer, logits: &[f32], id: u32, top: usize) -> TokenLogprob {
    let text = |id: u32| {
        let bytes = tokenizer.token_piece(id, true).to_vec();
        (String::from_utf8_lossy(&bytes).into_owned(), bytes)
    };
    let mut best: Vec<u32> = Vec::new();
    if top > 0 && !logits.is_empty() {
        let mut ids: Vec<u32> = (0..logits.len() as u32).collect();
        let by_logit = |a: &u32, b: &u32| {
            logits[*b as usize]
                .total_cmp(&logits[*a as usize])
                .then(a.cmp(b))
        };
        let k = top.min(ids.len());
        ids.select_nth_unstable_by(k - 1, by_logit);
        ids.truncate(k);
        ids.sort_unstable_by(by_logit);
        best = ids;
    }
    let (token, bytes) = text(id);
    TokenLogprob {
        token,
        logprob: log_softmax_at(logits, id),
        bytes,
        top_logprobs: best
            .into_iter()
            .map(|alt| {
                let (token, bytes) = text(alt);
                TopLogprob {
                    token,
                    logprob: log_softmax_at(logits, alt),
                    bytes,
                }
            })
            .collect(),
    }
}
