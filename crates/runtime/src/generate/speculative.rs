//! Speculative decoding: something cheap proposes the next few tokens (a [`Drafter`]),
//! one pass of the model scores them all ([`Session::feed_scored`]), and the
//! [`Generator`](super::Generator) keeps the longest prefix the model itself would have
//! produced, plus the model's own next token. The output is exactly what plain decoding
//! gives: greedy decoding accepts a drafted token while it is the model's argmax;
//! sampling uses speculative sampling (Leviathan et al. 2023, Chen et al. 2023), which
//! accepts a token drawn from the draft's distribution `q` with probability
//! `min(1, p/q)` and otherwise draws from the normalized `max(0, p - q)`, so every token
//! still follows the model's distribution `p`.
//!
//! A pass costs about the same for one token as for several while reading the weights
//! dominates (a streamed model, whose layers come from the disk each pass; a memory-bound
//! CPU), so every accepted token is a pass saved.
//!
//! Two drafters: [`PromptLookup`] copies what followed the latest earlier occurrence of
//! the context's last few tokens (no second model, no memory: it pays where the output
//! repeats its input, as an edit does), and [`DraftModel`], a smaller model with the
//! same vocabulary.

use std::time::Duration;

use crate::error::{Error, Result};
use crate::sampler::{Distribution, Sampler, SamplerConfig};
use crate::session::Session;
use crate::tokenizer::Tokenizer;

/// How many tokens to draft per pass, as llama.cpp's `--draft-max`, `--draft-min` and
/// `--draft-p-min`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DraftOptions {
    /// Most tokens drafted for one verification pass.
    pub max: usize,
    /// Fewest: a shorter draft is not verified (the step decodes one token plainly).
    pub min: usize,
    /// A draft model stops drafting when its most likely next token is less likely
    /// than this (0 drafts `max` tokens whatever the confidence).
    pub p_min: f32,
}

impl Default for DraftOptions {
    /// llama.cpp's defaults: up to 16 tokens, no minimum, stop below 0.75.
    fn default() -> DraftOptions {
        DraftOptions {
            max: 16,
            min: 0,
            p_min: 0.75,
        }
    }
}

/// One drafted token.
#[derive(Clone, Debug, PartialEq)]
pub struct Proposal {
    /// The token.
    pub id: u32,
    /// The distribution it was drawn from (speculative sampling needs it); `None`: the
    /// drafter chose it deterministically (probability 1).
    pub dist: Option<Distribution>,
}

impl Proposal {
    /// A token chosen deterministically.
    pub fn certain(id: u32) -> Proposal {
        Proposal { id, dist: None }
    }

    /// The probability the drafter gave `id` when it drew this proposal.
    pub fn prob(&self, id: u32) -> f64 {
        match &self.dist {
            Some(dist) => dist.prob(id),
            None if id == self.id => 1.0,
            None => 0.0,
        }
    }
}

/// Something that proposes the tokens likely to follow a context.
pub trait Drafter: Send {
    /// What it is, for reports (`"prompt lookup"`, the draft model's name).
    fn name(&self) -> String;

    /// Appends to `out` up to `max` tokens proposed to follow `context` (the whole
    /// token history, prompt included). `sampler` is the generation's: greedy (its
    /// temperature `<= 0`) wants the likeliest tokens; sampling wants tokens drawn from
    /// a distribution the proposal carries. Proposing nothing is allowed.
    fn draft(
        &mut self,
        context: &[u32],
        max: usize,
        sampler: &SamplerConfig,
        out: &mut Vec<Proposal>,
    ) -> Result<()>;
}

/// Prompt lookup decoding (Saxena 2023; llama.cpp's `--draft ngram` family): find the
/// latest earlier occurrence of the context's last `n` tokens, for `n` from
/// `ngram_max` down to `ngram_min`, and propose what followed it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PromptLookup {
    /// The longest suffix looked up.
    pub ngram_max: usize,
    /// The shortest (at least 1).
    pub ngram_min: usize,
}

impl Default for PromptLookup {
    /// Suffixes of 3, 2, then 1 token, as the prompt lookup reference does.
    fn default() -> PromptLookup {
        PromptLookup {
            ngram_max: 3,
            ngram_min: 1,
        }
    }
}

impl Drafter for PromptLookup {
    fn name(&self) -> String {
        "prompt lookup".into()
    }

    fn draft(
        &mut self,
        context: &[u32],
        max: usize,
        _sampler: &SamplerConfig,
        out: &mut Vec<Proposal>,
    ) -> Result<()> {
        let len = context.len();
        for n in (self.ngram_min.max(1)..=self.ngram_max).rev() {
            if len <= n {
                continue;
            }
            let suffix = &context[len - n..];
            // The latest occurrence that ends before the suffix itself does.
            let found = (0..len - n)
                .rev()
                .find(|&start| &context[start..start + n] == suffix);
            if let Some(start) = found {
                let follows = &context[start + n..(start + n + max).min(len)];
                out.extend(follows.iter().map(|&id| Proposal::certain(id)));
                return Ok(());
            }
        }
        Ok(())
    }
}

/// A smaller model with the target's vocabulary, drafting from a session of its own
/// that follows the target's history (rewound to what the two share, then fed the
/// rest, before each draft).
pub struct DraftModel {
    name: String,
    session: Session,
    p_min: f32,
    /// Seeded from the generation's seed (another stream than the target's) and made
    /// again when the generation's sampler changes.
    sampler: Option<Sampler>,
}

impl DraftModel {
    /// A drafter over `session` (its model and cache; the cache must hold the target's
    /// context plus a draft). `draft` and `target` are the two vocabularies, refused
    /// with the first difference when they differ ([`check_compatible`]); `p_min` as
    /// [`DraftOptions::p_min`].
    pub fn new(
        name: impl Into<String>,
        session: Session,
        draft: &Tokenizer,
        target: &Tokenizer,
        p_min: f32,
    ) -> Result<DraftModel> {
        check_compatible(draft, target)?;
        Ok(DraftModel {
            name: name.into(),
            session,
            p_min,
            sampler: None,
        })
    }

    /// The draft's session.
    pub fn session(&self) -> &Session {
        &self.session
    }

    /// Brings the draft's session to `context` with the logits after its last token.
    /// False when the draft's cache cannot hold it (the caller then drafts nothing).
    fn follow(&mut self, context: &[u32]) -> Result<bool> {
        let held = self.session.tokens();
        let mut shared = held.iter().zip(context).take_while(|(a, b)| a == b).count();
        if shared == context.len() && held.len() == shared && !self.session.logits().is_empty() {
            return Ok(true);
        }
        // The last token is fed again to get the logits after it.
        shared = shared.min(context.len().saturating_sub(1));
        let kept = self.session.rewind(shared);
        match self.session.feed(&context[kept..]) {
            Ok(_) => Ok(true),
            Err(Error::ContextFull { .. }) => {
                self.session.rewind(0);
                Ok(false)
            }
            Err(e) => Err(e),
        }
    }
}

impl Drafter for DraftModel {
    fn name(&self) -> String {
        self.name.clone()
    }

    fn draft(
        &mut self,
        context: &[u32],
        max: usize,
        sampler: &SamplerConfig,
        out: &mut Vec<Proposal>,
    ) -> Result<()> {
        if max == 0 || context.is_empty() || !self.follow(context)? {
            return Ok(());
        }
        let greedy = sampler.temperature <= 0.0;
        if !greedy
            && self
                .sampler
                .as_ref()
                .is_none_or(|s| s.config() != &draft_sampler(sampler))
        {
            self.sampler = Some(Sampler::new(draft_sampler(sampler)));
        }
        for j in 0..max {
            let logits = self.session.logits();
            let proposal = match self.sampler.as_mut().filter(|_| !greedy) {
                Some(s) => {
                    let dist = s.distribution(logits, &[]);
                    if dist.probs.first().is_none_or(|&p| (p as f32) < self.p_min) {
                        break;
                    }
                    let id = s.draw(&dist);
                    Proposal {
                        id,
                        dist: Some(dist),
                    }
                }
                None => {
                    let id = crate::sampler::argmax(logits);
                    if crate::sampler::log_softmax_at(logits, id).exp() < self.p_min {
                        break;
                    }
                    Proposal::certain(id)
                }
            };
            let id = proposal.id;
            out.push(proposal);
            if j + 1 < max {
                match self.session.feed(&[id]) {
                    Ok(_) => {}
                    Err(Error::ContextFull { .. }) => break,
                    Err(e) => return Err(e),
                }
            }
        }
        Ok(())
    }
}

/// The draft's own sampler: the generation's filters and temperature without the
/// repetition penalty (the draft's distribution may be anything; the verification
/// makes the output the target's), on another stream of random numbers.
fn draft_sampler(target: &SamplerConfig) -> SamplerConfig {
    SamplerConfig {
        repeat_penalty: 1.0,
        seed: target.seed ^ 0x5EC_DEC0DE,
        ..*target
    }
}

/// Whether `draft` can draft for `target`: as llama.cpp checks, the same kind of
/// vocabulary, the same beginning and end tokens, sizes within 128 of each other, and
/// the same text for every token both have from id 5 on (a few control tokens may
/// differ). The error names the first difference.
pub fn check_compatible(draft: &Tokenizer, target: &Tokenizer) -> Result<()> {
    let refuse = |what: String| {
        Err(Error::InvalidArgument {
            what: format!("the draft model's vocabulary differs from the model's: {what}"),
        })
    };
    if draft.is_sentencepiece() != target.is_sentencepiece() {
        let kind = |t: &Tokenizer| {
            if t.is_sentencepiece() {
                "SentencePiece"
            } else {
                "BPE"
            }
        };
        return refuse(format!(
            "the draft's is {}, the model's {}",
            kind(draft),
            kind(target)
        ));
    }
    for (what, d, t) in [
        ("beginning-of-sequence", draft.bos_id(), target.bos_id()),
        ("end-of-sequence", draft.eos_id(), target.eos_id()),
    ] {
        if d != t {
            return refuse(format!(
                "the {what} token is {d:?} in the draft, {t:?} in the model"
            ));
        }
    }
    let (nd, nt) = (draft.vocab_size(), target.vocab_size());
    if nd.abs_diff(nt) > 128 {
        return refuse(format!("{nd} tokens in the draft, {nt} in the model"));
    }
    for id in 5..nd.min(nt) as u32 {
        let (d, t) = (draft.token_bytes(id), target.token_bytes(id));
        if d != t {
            return refuse(format!(
                "token {id} is {:?} in the draft, {:?} in the model",
                String::from_utf8_lossy(d),
                String::from_utf8_lossy(t)
            ));
        }
    }
    Ok(())
}

/// What speculation did over a generation.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct SpeculationStats {
    /// Verification passes (each scored a draft and gave at least one token).
    pub passes: usize,
    /// Tokens drafted for them.
    pub drafted: usize,
    /// Drafted tokens accepted.
    pub accepted: usize,
    /// Tokens the passes gave (accepted ones and the model's own after them).
    pub tokens: usize,
    /// Steps decoded plainly (no draft, or one shorter than the minimum).
    pub plain_steps: usize,
    /// Time spent drafting.
    pub draft_time: Duration,
    /// Time spent in verification passes.
    pub verify_time: Duration,
}

impl SpeculationStats {
    /// Accepted drafted tokens per drafted token (0 before any draft).
    pub fn acceptance(&self) -> f64 {
        if self.drafted == 0 {
            0.0
        } else {
            self.accepted as f64 / self.drafted as f64
        }
    }

    /// Tokens per pass of the model, plain steps included.
    pub fn tokens_per_pass(&self) -> f64 {
        let passes = self.passes + self.plain_steps;
        if passes == 0 {
            0.0
        } else {
            (self.tokens + self.plain_steps) as f64 / passes as f64
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lookup(context: &[u32], max: usize) -> Vec<u32> {
        let mut out = Vec::new();
        PromptLookup::default()
            .draft(context, max, &SamplerConfig::default(), &mut out)
            .unwrap();
        out.iter().map(|p| p.id).collect()
    }

    #[test]
    fn prompt_lookup_copies_what_followed_the_latest_match() {
        // "1 2 3" occurred twice; the latest one was followed by 7 8.
        assert_eq!(
            lookup(&[1, 2, 3, 4, 5, 1, 2, 3, 7, 8, 9, 1, 2, 3], 2),
            [7, 8]
        );
        // Only a 1-token suffix matches.
        assert_eq!(lookup(&[5, 6, 7, 9, 5], 4), [6, 7, 9, 5]);
        assert!(lookup(&[1, 2, 3], 4).is_empty());
        assert!(lookup(&[], 4).is_empty());
        assert!(lookup(&[1, 2, 1, 2], 0).is_empty());
    }

    #[test]
    fn proposals_without_a_distribution_are_certain() {
        let p = Proposal::certain(4);
        assert_eq!((p.prob(4), p.prob(5)), (1.0, 0.0));
        let s = SpeculationStats {
            passes: 2,
            drafted: 8,
            accepted: 6,
            tokens: 8,
            plain_steps: 2,
            ..SpeculationStats::default()
        };
        assert_eq!(s.acceptance(), 0.75);
        assert_eq!(s.tokens_per_pass(), 2.5);
    }
}
