//! [`Generator`]: the generation loop. A [`Session`], a [`Sampler`], the incremental
//! detokenizer ([`StreamDecoder`]), stop rules (end-of-generation tokens, stop strings,
//! a token limit, the context) and penalties (repetition, presence, frequency), turning
//! a prompt into tokens `{id, text, logprob}` and a [`FinishReason`]. `ballast run`,
//! `ballast chat` and the server all generate through it.
//!
//! Its per-token half, [`Continuation`], holds everything but the session: a caller
//! that computes logits itself (the server's scheduler, which runs the decode steps of
//! several sessions in one batched pass) hands each sequence's logits to its own
//! `Continuation` and gets the same tokens, stops and text as a `Generator` would give.
//!
//! # Example
//!
//! Eight greedy tokens from a tiny random-weight model (the test-model writer's):
//!
//! ```
//! use std::sync::Arc;
//! use ballast_runtime::generate::{FinishReason, GenerateOptions, Generator, Step};
//! use ballast_runtime::gguf::GgufFile;
//! use ballast_runtime::testing::TinyModelSpec;
//! use ballast_runtime::{CpuBackend, Model, SamplerConfig, Session, Tokenizer};
//!
//! # fn main() -> Result<(), ballast_runtime::Error> {
//! let file = Arc::new(GgufFile::from_bytes(TinyModelSpec::default().to_gguf_bytes()?)?);
//! let tokenizer = Arc::new(Tokenizer::from_gguf(&file)?);
//! let model = Model::load(file, Arc::new(CpuBackend::new(1)), false)?;
//! let options = GenerateOptions {
//!     sampler: SamplerConfig { temperature: 0.0, ..SamplerConfig::default() },
//!     max_tokens: Some(8),
//!     ignore_eos: true,
//!     ..GenerateOptions::default()
//! };
//! let mut generator = Generator::new(Session::new(model, 64)?, tokenizer.clone(), options)?;
//! generator.prompt(&tokenizer.encode("Hello", true, false)?)?;
//! let mut text = String::new();
//! let reason = loop {
//!     match generator.step()? {
//!         Step::Token(token) => text += &token.text,
//!         Step::Done(end) => {
//!             text += &end.text;
//!             break end.reason;
//!         }
//!     }
//! };
//! assert_eq!(reason, FinishReason::MaxTokens);
//! assert_eq!(generator.generated(), 8);
//! # Ok(())
//! # }
//! ```

mod speculative;
mod stop;

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::Instant;

pub use speculative::{
    check_compatible, DraftModel, DraftOptions, Drafter, PromptLookup, Proposal, SpeculationStats,
};
pub use stop::StopMatcher;

use crate::error::{Error, Result};
use crate::sampler::{log_softmax_at, Distribution, Sampler, SamplerConfig};
use crate::session::Session;
use crate::tokenizer::{StreamDecoder, Tokenizer};

/// What a generation does: how it samples, what it penalizes, when it stops.
#[derive(Clone, Debug, PartialEq)]
pub struct GenerateOptions {
    /// The sampler (its temperature `<= 0` is greedy decoding; its repetition
    /// penalty looks at the whole session's history).
    pub sampler: SamplerConfig,
    /// Most tokens to generate; `None`: until another rule stops (the context bounds
    /// a session without an eviction policy).
    pub max_tokens: Option<usize>,
    /// Stop strings: the generation ends where one starts, and neither it nor anything
    /// after it is returned (empty strings are ignored).
    pub stop: Vec<String>,
    /// Keep going past end-of-generation tokens (they are then returned like others).
    pub ignore_eos: bool,
    /// OpenAI's presence penalty: subtracted from the logit of every token generated
    /// so far (the prompt's tokens are not counted).
    pub presence_penalty: f32,
    /// OpenAI's frequency penalty: subtracted once per earlier occurrence of the token
    /// in the generation.
    pub frequency_penalty: f32,
    /// Give each token's log-probability (under the model's logits, before any
    /// penalty). Without it, plain greedy decoding on a device backend reads back one
    /// id per token instead of the logits.
    pub logprobs: bool,
    /// Keep [`Session::logits`] current after every token (to save the session), which
    /// also rules out taking the argmax on the device.
    pub keep_logits: bool,
}

impl Default for GenerateOptions {
    fn default() -> GenerateOptions {
        GenerateOptions {
            sampler: SamplerConfig::default(),
            max_tokens: None,
            stop: Vec::new(),
            ignore_eos: false,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            logprobs: false,
            keep_logits: false,
        }
    }
}

impl GenerateOptions {
    /// Refuses penalties that are not finite numbers (they would turn every logit into
    /// NaN).
    fn check(&self) -> Result<()> {
        for (name, value) in [
            ("presence penalty", self.presence_penalty),
            ("frequency penalty", self.frequency_penalty),
            ("repeat penalty", self.sampler.repeat_penalty),
            ("temperature", self.sampler.temperature),
        ] {
            if !value.is_finite() {
                return Err(Error::InvalidArgument {
                    what: format!("the {name} must be a finite number, got {value}"),
                });
            }
        }
        Ok(())
    }

    /// Whether the next token is the largest logit, with nothing to compute from the
    /// logits but that: a device may then pick it and read back only the id.
    fn plain_greedy(&self) -> bool {
        let s = &self.sampler;
        s.temperature <= 0.0
            && (s.repeat_penalty == 1.0 || s.repeat_last_n == 0)
            && self.presence_penalty == 0.0
            && self.frequency_penalty == 0.0
            && !self.logprobs
    }
}

/// One generated token.
#[derive(Clone, Debug, PartialEq)]
pub struct Token {
    /// Its id.
    pub id: u32,
    /// The text it completes: its own bytes after those of earlier tokens that ended
    /// inside a UTF-8 character (empty while a character is incomplete), minus text held
    /// back because it may begin a stop string (released with a later token, or at the
    /// end).
    pub text: String,
    /// Its log-probability under the logits it was chosen from, when
    /// [`GenerateOptions::logprobs`] asked for it.
    pub logprob: Option<f32>,
}

/// Why a generation ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// The model chose an end-of-generation token (not returned).
    EndOfGeneration,
    /// The text reached a stop string.
    StopString,
    /// [`GenerateOptions::max_tokens`] tokens were generated.
    MaxTokens,
    /// The session's cache has no room for another token (no eviction policy).
    ContextFull,
}

/// The end of a generation.
#[derive(Clone, Debug, PartialEq)]
pub struct Finish {
    /// Why it ended.
    pub reason: FinishReason,
    /// The text still held back (bytes of an incomplete character, shown as U+FFFD;
    /// text that could have begun a stop string), to append after the last token's.
    pub text: String,
}

/// What one step of a generation gives.
#[derive(Clone, Debug, PartialEq)]
pub enum Step {
    /// The next token.
    Token(Token),
    /// The generation is over (every later step says so again, with no text).
    Done(Finish),
}

/// The per-token half of a generation, apart from the session that computes the
/// logits: the sampler, the penalties, the detokenizer and the stop rules. Hand it the
/// logits after each fed token ([`Continuation::choose`]); feed the token it returns
/// unless it also ended the generation ([`Continuation::finish_reason`]).
#[derive(Debug)]
pub struct Continuation {
    options: GenerateOptions,
    sampler: Sampler,
    decoder: StreamDecoder,
    stop: StopMatcher,
    /// How often each generated token occurred (presence and frequency penalties).
    counts: HashMap<u32, u32>,
    generated: usize,
    finish: Option<FinishReason>,
    /// Whether the held-back text was handed out with the end.
    flushed: bool,
    /// Scratch for the penalized logits.
    penalized: Vec<f32>,
}

impl Continuation {
    /// A fresh generation under `options`.
    pub fn new(options: GenerateOptions) -> Result<Continuation> {
        options.check()?;
        Ok(Continuation {
            sampler: Sampler::new(options.sampler),
            stop: StopMatcher::new(options.stop.clone()),
            options,
            decoder: StreamDecoder::new(),
            counts: HashMap::new(),
            generated: 0,
            finish: None,
            flushed: false,
            penalized: Vec::new(),
        })
    }

    /// The options.
    pub fn options(&self) -> &GenerateOptions {
        &self.options
    }

    /// Tokens generated so far.
    pub fn generated(&self) -> usize {
        self.generated
    }

    /// Why the generation ended, once it has.
    pub fn finish_reason(&self) -> Option<FinishReason> {
        self.finish
    }

    /// Whether the next token is the plain argmax of the logits (greedy, no penalty,
    /// no log-probability), which a device backend can pick itself
    /// ([`Session::feed_greedy`]); then hand the id to [`Continuation::accept`].
    pub fn is_plain_greedy(&self) -> bool {
        self.options.plain_greedy()
    }

    /// Chooses the next token from `logits` (after the last token of `history`, the
    /// session's whole token history, which the repetition penalty reads). `room`:
    /// tokens the session's cache can still take, `None` when an eviction policy makes
    /// room. Once the generation has ended this returns [`Step::Done`] again.
    pub fn choose(
        &mut self,
        tokenizer: &Tokenizer,
        logits: &[f32],
        history: &[u32],
        room: Option<usize>,
    ) -> Step {
        if self.ended(room) {
            return Step::Done(self.end());
        }
        let id = if self.penalize(logits) {
            self.sampler.sample(&self.penalized, history)
        } else {
            self.sampler.sample(logits, history)
        };
        let logprob = self.options.logprobs.then(|| log_softmax_at(logits, id));
        self.accept(tokenizer, id, logprob, room)
    }

    /// [`Continuation::choose`] for a drafted token (speculative decoding): the next
    /// token from `logits`, the drafted one when the model accepts it. Greedy decoding
    /// accepts it when it is the token `choose` would pick; sampling accepts it with
    /// probability `min(1, p/q)` (`p` the model's probability after the sampler's
    /// filters, `q` the draft's) and otherwise draws from `max(0, p - q)`, so the token
    /// follows the model's distribution either way. Returns the step and whether the
    /// draft was accepted (generation then goes on with the next drafted token).
    pub fn verify(
        &mut self,
        tokenizer: &Tokenizer,
        logits: &[f32],
        history: &[u32],
        draft: &Proposal,
        room: Option<usize>,
    ) -> (Step, bool) {
        if self.ended(room) {
            return (Step::Done(self.end()), false);
        }
        let penalized = self.penalize(logits);
        let scored = if penalized {
            &self.penalized[..]
        } else {
            logits
        };
        let (id, accepted) = if self.sampler.config().temperature <= 0.0 {
            let id = self.sampler.sample(scored, history);
            (id, id == draft.id)
        } else {
            let p = self.sampler.distribution(scored, history);
            let (p_draft, q_draft) = (p.prob(draft.id), draft.prob(draft.id));
            if q_draft > 0.0 && self.sampler.uniform() < p_draft / q_draft {
                (draft.id, true)
            } else {
                // The correction: what `p` has beyond the draft's `q`.
                let residual = Distribution {
                    probs: p
                        .ids
                        .iter()
                        .zip(&p.probs)
                        .map(|(&id, &pi)| (pi - draft.prob(id)).max(0.0))
                        .collect(),
                    ids: p.ids.clone(),
                };
                let id = if residual.probs.iter().sum::<f64>() > 0.0 {
                    self.sampler.draw(&residual)
                } else {
                    self.sampler.draw(&p)
                };
                (id, false)
            }
        };
        let logprob = self.options.logprobs.then(|| log_softmax_at(logits, id));
        let step = self.accept(tokenizer, id, logprob, room);
        let accepted = accepted && matches!(step, Step::Token(_));
        (step, accepted)
    }

    /// Whether the generation has ended before choosing another token (the token
    /// limit, no room for it), recording why.
    fn ended(&mut self, room: Option<usize>) -> bool {
        if self.finish.is_none() && self.generated >= self.limit() {
            self.finish = Some(FinishReason::MaxTokens);
        }
        if self.finish.is_none() && room == Some(0) {
            self.finish = Some(FinishReason::ContextFull);
        }
        self.finish.is_some()
    }

    /// Puts `logits` with the presence and frequency penalties into the scratch
    /// buffer when either applies; false (and nothing written) otherwise.
    fn penalize(&mut self, logits: &[f32]) -> bool {
        if self.options.presence_penalty == 0.0 && self.options.frequency_penalty == 0.0 {
            return false;
        }
        self.penalized.clear();
        self.penalized.extend_from_slice(logits);
        apply_presence_frequency_penalties(
            &mut self.penalized,
            &self.counts,
            self.options.presence_penalty,
            self.options.frequency_penalty,
        );
        true
    }

    /// Takes `id` as the next token, chosen elsewhere (a device's argmax when
    /// [`Continuation::is_plain_greedy`]), and applies the stop rules: an
    /// end-of-generation token ends the generation ([`Step::Done`]); any other is
    /// returned, and may end it too (a stop string, the token limit, no room in the
    /// cache for the token after it), which [`Continuation::finish_reason`] then says.
    pub fn accept(
        &mut self,
        tokenizer: &Tokenizer,
        id: u32,
        logprob: Option<f32>,
        room: Option<usize>,
    ) -> Step {
        if self.finish.is_some() {
            return Step::Done(self.end());
        }
        if !self.options.ignore_eos && tokenizer.is_end_of_generation(id) {
            self.finish = Some(FinishReason::EndOfGeneration);
            return Step::Done(self.end());
        }
        self.generated += 1;
        *self.counts.entry(id).or_default() += 1;
        let piece = self.decoder.push(tokenizer, id);
        let (text, stopped) = self.stop.push(&piece);
        let limit = self.limit();
        // The token after this one needs this one fed first, then a slot of its own.
        let no_room = room.is_some_and(|r| r < 2);
        self.finish = if stopped {
            Some(FinishReason::StopString)
        } else if self.generated >= limit {
            Some(FinishReason::MaxTokens)
        } else if no_room {
            Some(FinishReason::ContextFull)
        } else {
            None
        };
        Step::Token(Token { id, text, logprob })
    }

    fn limit(&self) -> usize {
        self.options.max_tokens.unwrap_or(usize::MAX)
    }

    /// The end (call once the generation ended): the reason, and the first time the
    /// text held back. A stop string ends the text where it starts, so nothing after
    /// it is released; else the decoder's incomplete bytes and text held back for a
    /// stop are, unless they complete a stop string themselves.
    fn end(&mut self) -> Finish {
        let mut reason = self.finish.unwrap_or(FinishReason::ContextFull);
        let mut text = String::new();
        if !self.flushed && reason != FinishReason::StopString {
            let (t, stopped) = self.stop.push(&self.decoder.finish());
            text = t;
            if stopped {
                reason = FinishReason::StopString;
                self.finish = Some(reason);
            } else {
                text.push_str(&self.stop.finish());
            }
        }
        self.flushed = true;
        Finish { reason, text }
    }

    /// [`Step::Done`] once the generation has ended (see [`Continuation::choose`]).
    pub fn finish(&mut self) -> Option<Finish> {
        self.finish.is_some().then(|| self.end())
    }
}

/// OpenAI's presence and frequency penalties, in place: the logit of each token that
/// occurred `count` times is lowered by `presence + frequency * count`.
pub fn apply_presence_frequency_penalties(
    logits: &mut [f32],
    counts: &HashMap<u32, u32>,
    presence: f32,
    frequency: f32,
) {
    for (&tok, &count) in counts {
        if let Some(l) = logits.get_mut(tok as usize) {
            *l -= presence + frequency * count as f32;
        }
    }
}

/// The most tokens worth drafting after the unfed token of `session`: the
/// verification feeds it and the draft, which must all fit the cache without an
/// eviction (an eviction cannot be undone for rejected tokens), and drafting past the
/// generation's token limit is wasted. 0 when below `options.min`: decode plainly.
pub fn draft_limit(session: &Session, state: &Continuation, options: &DraftOptions) -> usize {
    let kv = session.kv();
    let free = kv.capacity().saturating_sub(kv.len());
    let remaining = state
        .options()
        .max_tokens
        .map_or(usize::MAX, |m| m.saturating_sub(state.generated()));
    let max = options
        .max
        .min(free.saturating_sub(1))
        .min(remaining.saturating_sub(1));
    if max < options.min {
        0
    } else {
        max
    }
}

/// Decides the tokens of a verification pass: `session` was just fed the unfed token
/// and `proposals` in one [`Session::feed_scored`]. Each row of logits goes through
/// `state` ([`Continuation::verify`] for a drafted token, [`Continuation::choose`]
/// after the last), up to the first rejection or the end; the session keeps the tokens
/// before the last step's token (which stays unfed, as after a plain step) and drops
/// the rest from its cache. Returns the steps (step `j` was chosen from row `j` of
/// [`Session::scored`]) and how many drafted tokens were accepted.
pub fn accept_scored(
    state: &mut Continuation,
    tokenizer: &Tokenizer,
    session: &mut Session,
    proposals: &[Proposal],
) -> Result<(Vec<Step>, usize)> {
    let n = proposals.len() + 1;
    let vocab = session.model().config().vocab_size;
    let rows = session.scored();
    if rows.len() != n * vocab {
        return Err(Error::ShapeMismatch {
            what: "logits of a verification pass".into(),
            expected: n * vocab,
            got: rows.len(),
        });
    }
    let history = session.tokens();
    let held = history.len() - n;
    let cached = session.kv().len() - n;
    let capacity = session.kv().capacity();
    let bounded = session.policy().is_none();
    let mut steps = Vec::with_capacity(n);
    let mut accepted = 0;
    // Row `i` holds the logits after the unfed token and `i` drafted ones.
    for i in 0..n {
        let logits = &rows[i * vocab..(i + 1) * vocab];
        let history = &history[..held + i + 1];
        let room = bounded.then(|| capacity.saturating_sub(cached + i + 1));
        let (step, goes_on) = match proposals.get(i) {
            Some(draft) => state.verify(tokenizer, logits, history, draft, room),
            None => (state.choose(tokenizer, logits, history, room), false),
        };
        steps.push(step);
        if goes_on && state.finish_reason().is_none() {
            accepted += 1;
        } else {
            break;
        }
    }
    let keep = steps.len();
    // Only a cache that drops tokens (sliding-window layers) may fail to rewind.
    let kept = (session.kv().exact_rewind_floor() > 0).then(|| history[..held + keep].to_vec());
    if !session.keep_scored(keep) {
        // It could not drop the rejected rows exactly: start over.
        session.feed(&kept.unwrap_or_default())?;
    }
    Ok((steps, accepted))
}

/// A generation loop over a session: feed a prompt ([`Generator::prompt`], in chunks
/// of the session's batch size), then call [`Generator::step`] for each token until
/// [`Step::Done`]. The session stays usable afterwards (a chat's next turn, saving
/// it): the last token returned is not fed unless [`Generator::feed_last_token`] is
/// called, since no further logits were needed.
pub struct Generator {
    session: Session,
    tokenizer: Arc<Tokenizer>,
    options: GenerateOptions,
    state: Continuation,
    /// The last token returned, not fed yet.
    unfed: Option<u32>,
    /// The drafter and its options, when decoding speculatively.
    speculation: Option<(Box<dyn Drafter>, DraftOptions)>,
    /// Steps a verification pass gave beyond the first, handed out one per call.
    pending: VecDeque<Step>,
    /// Scratch: drafted tokens, and the context they follow.
    proposals: Vec<Proposal>,
    context: Vec<u32>,
    stats: SpeculationStats,
}

impl Generator {
    /// A generator over `session` (which may already hold tokens and their logits, as
    /// a restored session does). Refuses options with a non-finite penalty.
    pub fn new(
        session: Session,
        tokenizer: Arc<Tokenizer>,
        options: GenerateOptions,
    ) -> Result<Generator> {
        let state = Continuation::new(options.clone())?;
        Ok(Generator {
            session,
            tokenizer,
            options,
            state,
            unfed: None,
            speculation: None,
            pending: VecDeque::new(),
            proposals: Vec::new(),
            context: Vec::new(),
            stats: SpeculationStats::default(),
        })
    }

    /// Decodes speculatively from now on: before each token, `drafter` proposes up to
    /// `options.max` more and one pass of the model verifies them all. The tokens are
    /// exactly those plain decoding gives (greedy: the same ids and log-probabilities;
    /// sampling: the same distribution). A draft is cut to what the cache holds
    /// without evicting (an eviction cannot be undone for the rejected tokens), so a
    /// full cache under an eviction policy decodes plainly.
    pub fn with_drafter(mut self, drafter: Box<dyn Drafter>, options: DraftOptions) -> Generator {
        self.speculation = Some((drafter, options));
        self
    }

    /// Decodes plainly from now on: the drafter and its options back (`None` without
    /// one), to draft with again later ([`Generator::with_drafter`]), as a benchmark
    /// alternating plain and speculative decoding on one session does. Tokens already
    /// verified are still handed out.
    pub fn take_drafter(&mut self) -> Option<(Box<dyn Drafter>, DraftOptions)> {
        self.speculation.take()
    }

    /// What speculation did so far (all zero without a drafter).
    pub fn speculation_stats(&self) -> SpeculationStats {
        self.stats
    }

    /// Feeds `ids` (may be empty to continue from the session's current logits, as
    /// after restoring a saved session) and starts a new generation after them: the
    /// sampler reseeded, counts, stop matcher and token limit reset. A token returned
    /// by the previous generation and not fed is dropped.
    pub fn prompt(&mut self, ids: &[u32]) -> Result<()> {
        self.unfed = None;
        self.pending.clear();
        self.state = Continuation::new(self.options.clone())?;
        if ids.is_empty() {
            if self.session.logits().is_empty() {
                return Err(Error::EmptyInput);
            }
            return Ok(());
        }
        self.session.feed(ids)?;
        Ok(())
    }

    /// The next token, or the end. Feeds the previous token first (one forward pass),
    /// unless it was the last.
    pub fn step(&mut self) -> Result<Step> {
        if let Some(step) = self.pending.pop_front() {
            return Ok(step);
        }
        if let Some(end) = self.state.finish() {
            return Ok(Step::Done(end));
        }
        if self.unfed.is_some() && self.speculation.is_some() {
            if let Some(step) = self.speculative_step()? {
                return Ok(step);
            }
            self.stats.plain_steps += 1;
        }
        if let Some(prev) = self.unfed.take() {
            if self.greedy_on_device() {
                // Only the id comes back from the device: no logits, no log-probability.
                let id = self.session.feed_greedy(&[prev])?;
                let room = self.room();
                let step = self.state.accept(&self.tokenizer, id, None, room);
                return Ok(self.returned(step));
            }
            self.session.feed(&[prev])?;
        } else if self.session.logits().is_empty() {
            return Err(Error::InvalidArgument {
                what: "nothing to generate from: feed a prompt first".into(),
            });
        }
        let room = self.room();
        let step = self.state.choose(
            &self.tokenizer,
            self.session.logits(),
            self.session.tokens(),
            room,
        );
        Ok(self.returned(step))
    }

    /// Drafts after the unfed token and verifies the draft in one pass; `None` (and
    /// nothing changed) when the draft is too short to verify.
    fn speculative_step(&mut self) -> Result<Option<Step>> {
        let Some(prev) = self.unfed else {
            return Ok(None);
        };
        let Some((drafter, options)) = self.speculation.as_mut() else {
            return Ok(None);
        };
        let max = draft_limit(&self.session, &self.state, options);
        if max == 0 {
            return Ok(None);
        }
        self.context.clear();
        self.context.extend_from_slice(self.session.tokens());
        self.context.push(prev);
        self.proposals.clear();
        let started = Instant::now();
        drafter.draft(
            &self.context,
            max,
            &self.options.sampler,
            &mut self.proposals,
        )?;
        self.stats.draft_time += started.elapsed();
        self.proposals.truncate(max);
        if self.proposals.is_empty() || self.proposals.len() < options.min {
            return Ok(None);
        }

        let started = Instant::now();
        let mut fed = Vec::with_capacity(self.proposals.len() + 1);
        fed.push(prev);
        fed.extend(self.proposals.iter().map(|p| p.id));
        self.session.feed_scored(&fed)?;
        let (steps, accepted) = accept_scored(
            &mut self.state,
            &self.tokenizer,
            &mut self.session,
            &self.proposals,
        )?;
        self.stats.passes += 1;
        self.stats.drafted += self.proposals.len();
        self.stats.accepted += accepted;
        self.stats.tokens += steps.iter().filter(|s| matches!(s, Step::Token(_))).count();
        self.stats.verify_time += started.elapsed();
        self.unfed = match steps.last() {
            Some(Step::Token(t)) => Some(t.id),
            _ => None,
        };
        let mut steps = steps.into_iter();
        let first = steps.next();
        self.pending.extend(steps);
        Ok(first)
    }

    /// Remembers a returned token as not fed yet.
    fn returned(&mut self, step: Step) -> Step {
        if let Step::Token(token) = &step {
            self.unfed = Some(token.id);
        }
        step
    }

    /// Feeds the last token returned if it was not (the generation ended after it), so
    /// the session holds the whole text; true if it fed one.
    pub fn feed_last_token(&mut self) -> Result<bool> {
        let Some(id) = self.unfed.take() else {
            return Ok(false);
        };
        self.session.feed(&[id])?;
        Ok(true)
    }

    /// Whether the next token is taken as the argmax on the device.
    fn greedy_on_device(&self) -> bool {
        !self.options.keep_logits
            && self.state.is_plain_greedy()
            && self.session.model().backend().executor().is_some()
    }

    /// Tokens the cache can still take; `None` when a policy evicts to make room.
    fn room(&self) -> Option<usize> {
        let kv = self.session.kv();
        self.session
            .policy()
            .is_none()
            .then(|| kv.capacity().saturating_sub(kv.len()))
    }

    /// Tokens generated since the last prompt.
    pub fn generated(&self) -> usize {
        self.state.generated()
    }

    /// Why the generation ended, once it has.
    pub fn finish_reason(&self) -> Option<FinishReason> {
        self.state.finish_reason()
    }

    /// The options.
    pub fn options(&self) -> &GenerateOptions {
        &self.options
    }

    /// The tokenizer.
    pub fn tokenizer(&self) -> &Arc<Tokenizer> {
        &self.tokenizer
    }

    /// The session.
    pub fn session(&self) -> &Session {
        &self.session
    }

    /// The session, to rewind or restore it between generations (then call
    /// [`Generator::prompt`] before the next step).
    pub fn session_mut(&mut self) -> &mut Session {
        self.unfed = None;
        self.pending.clear();
        &mut self.session
    }

    /// The session back.
    pub fn into_session(self) -> Session {
        self.session
    }
}
