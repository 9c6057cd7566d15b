//! Speculative decoding is exact. Greedy: the ids and log-probabilities equal plain
//! decoding's, bit for bit, for random tiny models and drafts that go wrong at every
//! position (so every rejection length is rolled back), with a dense cache, a
//! sliding-window one and on wgpu (whose sliding-window layers keep each position in
//! the same slot however the passes were cut), and with a draft model of its own. Sampling: the
//! tokens follow the model's distribution (a chi-square test over many seeds, which
//! fails when the correction draw after a rejection is left out).

use std::sync::Arc;

use ballast_runtime::generate::{
    DraftModel, DraftOptions, Drafter, GenerateOptions, Generator, PromptLookup, Proposal, Step,
};
use ballast_runtime::gguf::GgufFile;
use ballast_runtime::testing::TinyModelSpec;
use ballast_runtime::{Backend, CpuBackend, Model, SamplerConfig, Session, Tokenizer};
use proptest::prelude::*;

fn file(spec: &TinyModelSpec) -> Arc<GgufFile> {
    Arc::new(GgufFile::from_bytes(spec.to_gguf_bytes().unwrap()).unwrap())
}

fn session(spec: &TinyModelSpec, backend: Arc<dyn Backend>, context: usize) -> Session {
    Session::with_batch(Model::load(file(spec), backend, false).unwrap(), context, 8).unwrap()
}

fn greedy_options(max_tokens: usize) -> GenerateOptions {
    GenerateOptions {
        sampler: SamplerConfig {
            temperature: 0.0,
            ..SamplerConfig::default()
        },
        max_tokens: Some(max_tokens),
        ignore_eos: true,
        logprobs: true,
        ..GenerateOptions::default()
    }
}

/// Every token of a generation: `(id, logprob bits)`, and the tokens the session holds
/// after the last one is fed.
fn generate(mut generator: Generator, prompt: &[u32]) -> (Vec<(u32, u32)>, Vec<u32>) {
    generator.prompt(prompt).unwrap();
    let mut out = Vec::new();
    while let Step::Token(t) = generator.step().unwrap() {
        out.push((t.id, t.logprob.unwrap().to_bits()));
    }
    generator.feed_last_token().unwrap();
    let held = generator.session().tokens().to_vec();
    (out, held)
}

/// Drafts the true continuation (a plain run's tokens) with a wrong token every
/// `wrong_every`-th position, counted from `phase`: rejections at every position of
/// the draft over a run.
struct Scripted {
    truth: Vec<u32>,
    wrong_every: usize,
    phase: usize,
    calls: usize,
}

impl Drafter for Scripted {
    fn name(&self) -> String {
        "scripted".into()
    }

    fn draft(
        &mut self,
        context: &[u32],
        max: usize,
        _sampler: &SamplerConfig,
        out: &mut Vec<Proposal>,
    ) -> ballast_runtime::Result<()> {
        self.calls += 1;
        for (j, &id) in self.truth.iter().skip(context.len()).take(max).enumerate() {
            let wrong = (self.calls + j + self.phase) % self.wrong_every == 0;
            out.push(Proposal::certain(if wrong { (id + 1) % 256 } else { id }));
        }
        Ok(())
    }
}

fn spec_for(arch: usize, seed: u64) -> TinyModelSpec {
    match arch {
        0 => TinyModelSpec {
            seed,
            ..TinyModelSpec::default()
        },
        1 => TinyModelSpec {
            arch: "qwen2".into(),
            seed,
            ..TinyModelSpec::default()
        },
        // Sliding-window layers of 8 tokens (the cache keeps only their window).
        _ => TinyModelSpec {
            arch: "gemma3".into(),
            n_layers: 3,
            sliding_window: Some((8, 3, 10_000.0)),
            seed,
            ..TinyModelSpec::default()
        },
    }
}

/// Where drafts go wrong: every `wrong_every`-th drafted token, counted from `phase`.
#[derive(Clone, Copy)]
struct Wrong {
    every: usize,
    phase: usize,
}

fn check_greedy_is_exact(
    spec: &TinyModelSpec,
    backend: Arc<dyn Backend>,
    prompt: &[u32],
    n: usize,
    draft: DraftOptions,
    wrong: Wrong,
) {
    let context = 96;
    let tokenizer = Arc::new(Tokenizer::from_gguf(&file(spec)).unwrap());
    let plain = Generator::new(
        session(spec, backend.clone(), context),
        tokenizer.clone(),
        greedy_options(n),
    )
    .unwrap();
    let (want, want_held) = generate(plain, prompt);
    let mut truth = prompt.to_vec();
    truth.extend(want.iter().map(|t| t.0));
    let drafter = Scripted {
        truth,
        wrong_every: wrong.every,
        phase: wrong.phase,
        calls: 0,
    };
    let spec_gen = Generator::new(
        session(spec, backend, context),
        tokenizer,
        greedy_options(n),
    )
    .unwrap()
    .with_drafter(Box::new(drafter), draft);
    let (got, got_held) = generate(spec_gen, prompt);
    assert_eq!(got, want, "{} speculative tokens", spec.arch);
    assert_eq!(got_held, want_held, "the session's tokens afterwards");
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    #[test]
    fn greedy_speculative_decoding_equals_plain_decoding(
        arch in 0usize..3,
        seed in 1u64..1000,
        prompt in proptest::collection::vec(0u32..256, 1..20),
        n in 1usize..40,
        max in 1usize..9,
        wrong_every in 2usize..7,
        phase in 0usize..7,
    ) {
        let spec = spec_for(arch, seed);
        let draft = DraftOptions { max, min: 0, p_min: 0.0 };
        check_greedy_is_exact(&spec, Arc::new(CpuBackend::new(1)), &prompt, n, draft, Wrong { every: wrong_every, phase });
    }
}

/// The context bound: a draft never runs past the cache, and the end is the same.
#[test]
fn greedy_speculation_stops_at_the_context_like_plain_decoding() {
    let spec = spec_for(0, 7);
    let tokenizer = Arc::new(Tokenizer::from_gguf(&file(&spec)).unwrap());
    let run = |drafter: Option<Box<dyn Drafter>>| {
        let mut g = Generator::new(
            session(&spec, Arc::new(CpuBackend::new(1)), 24),
            tokenizer.clone(),
            greedy_options(100),
        )
        .unwrap();
        if let Some(d) = drafter {
            g = g.with_drafter(d, DraftOptions::default());
        }
        g.prompt(&[1, 2, 3, 1, 2, 3, 1, 2]).unwrap();
        let mut ids = Vec::new();
        loop {
            match g.step().unwrap() {
                Step::Token(t) => ids.push(t.id),
                Step::Done(end) => return (ids, end.reason),
            }
        }
    };
    assert_eq!(run(Some(Box::new(PromptLookup::default()))), run(None));
}

/// A tiny draft model (other weights, the same vocabulary) drafting for the target:
/// exact, and it reports what it did.
#[test]
fn a_draft_model_gives_the_targets_greedy_tokens() {
    let target = spec_for(0, 3);
    let draft_spec = TinyModelSpec {
        n_layers: 1,
        seed: 4,
        ..TinyModelSpec::default()
    };
    let tokenizer = Arc::new(Tokenizer::from_gguf(&file(&target)).unwrap());
    let draft_tokenizer = Tokenizer::from_gguf(&file(&draft_spec)).unwrap();
    let backend: Arc<dyn Backend> = Arc::new(CpuBackend::new(1));
    let prompt = [10, 20, 30, 40, 10, 20, 30];
    let plain = Generator::new(
        session(&target, backend.clone(), 96),
        tokenizer.clone(),
        greedy_options(30),
    )
    .unwrap();
    let (want, _) = generate(plain, &prompt);
    let drafter = DraftModel::new(
        "tiny draft",
        session(&draft_spec, backend.clone(), 128),
        &draft_tokenizer,
        &tokenizer,
        0.0,
    )
    .unwrap();
    // The target drafting for itself: every draft is accepted.
    let self_drafter = DraftModel::new(
        "itself",
        session(&target, backend.clone(), 128),
        &tokenizer,
        &tokenizer,
        0.0,
    )
    .unwrap();
    // The target drafting for itself over the first half of the vocabulary
    // (`Model::load_with_vocab`): it never drafts the rest, and the output is the same.
    let half = tokenizer.vocab_size() / 2;
    let half_model = Model::load_with_vocab(file(&target), backend.clone(), false, half).unwrap();
    let half_drafter = DraftModel::new(
        "itself, half the vocabulary",
        Session::with_batch(half_model, 128, 8).unwrap(),
        &tokenizer,
        &tokenizer,
        0.0,
    )
    .unwrap();
    assert!(
        want.iter().any(|&(id, _)| id as usize >= half),
        "the run must need a token the half head cannot draft"
    );
    for (drafter, all_accepted) in [
        (Box::new(drafter) as Box<dyn Drafter>, false),
        (Box::new(self_drafter), true),
        (Box::new(half_drafter), false),
    ] {
        let options = DraftOptions {
            max: 4,
            min: 0,
            p_min: 0.0,
        };
        let mut g = Generator::new(
            session(&target, backend.clone(), 96),
            tokenizer.clone(),
            greedy_options(30),
        )
        .unwrap()
        .with_drafter(drafter, options);
        g.prompt(&prompt).unwrap();
        let mut got = Vec::new();
        while let Step::Token(t) = g.step().unwrap() {
            got.push((t.id, t.logprob.unwrap().to_bits()));
        }
        assert_eq!(got, want);
        let stats = g.speculation_stats();
        assert!(stats.passes > 0 && stats.drafted > 0);
        if all_accepted {
            assert_eq!(stats.accepted, stats.drafted);
            assert!(stats.tokens_per_pass() > 4.0);
        }
    }
}

#[test]
fn a_draft_with_another_vocabulary_is_refused_by_name() {
    let byte = Tokenizer::from_gguf(&file(&TinyModelSpec::default())).unwrap();
    let spm = Tokenizer::from_gguf(&file(&TinyModelSpec {
        vocab: ballast_runtime::testing::TinyVocab::SentencePiece,
        ..TinyModelSpec::default()
    }))
    .unwrap();
    let backend: Arc<dyn Backend> = Arc::new(CpuBackend::new(1));
    let err = DraftModel::new(
        "spm",
        session(&TinyModelSpec::default(), backend, 32),
        &spm,
        &byte,
        0.0,
    )
    .err()
    .expect("refused")
    .to_string();
    assert!(
        err.contains("vocabulary") && err.contains("SentencePiece"),
        "{err}"
    );
}

/// Drafts by sampling the target model itself at another temperature: a distribution
/// close to the model's but not equal, so drafts are often accepted and often not, and
/// a rejected one leaves the correction draw to decide.
struct Sharper {
    session: Session,
    sampler: ballast_runtime::Sampler,
}

impl Drafter for Sharper {
    fn name(&self) -> String {
        "sharper".into()
    }

    fn draft(
        &mut self,
        context: &[u32],
        max: usize,
        _sampler: &SamplerConfig,
        out: &mut Vec<Proposal>,
    ) -> ballast_runtime::Result<()> {
        self.session.rewind(0);
        let mut logits = self.session.feed(context)?.to_vec();
        for j in 0..max {
            let dist = self.sampler.distribution(&logits, &[]);
            let id = self.sampler.draw(&dist);
            out.push(Proposal {
                id,
                dist: Some(dist),
            });
            if j + 1 < max {
                logits = self.session.feed(&[id])?.to_vec();
            }
        }
        Ok(())
    }
}

/// The distribution of the first two generated tokens over many seeds (the second one
/// decided by a verification) against the exact one computed from the model's logits.
#[test]
fn speculative_sampling_keeps_the_models_distribution() {
    let spec = spec_for(0, 11);
    let gguf = file(&spec);
    let tokenizer = Arc::new(Tokenizer::from_gguf(&gguf).unwrap());
    let backend: Arc<dyn Backend> = Arc::new(CpuBackend::new(1));
    let new_session = || {
        Session::new(
            Model::load(gguf.clone(), backend.clone(), false).unwrap(),
            32,
        )
        .unwrap()
    };
    let sampler = SamplerConfig {
        temperature: 1.0,
        top_k: 4,
        top_p: 1.0,
        min_p: 0.0,
        ..SamplerConfig::default()
    };
    let prompt = [72u32, 101, 108, 108, 111];
    // The exact joint distribution of the first two tokens.
    let mut model = new_session();
    model.feed(&prompt).unwrap();
    let first = ballast_runtime::Sampler::new(sampler).distribution(model.logits(), &prompt);
    let mut exact = std::collections::HashMap::new();
    for (&a, &pa) in first.ids.iter().zip(&first.probs) {
        model.rewind(0);
        model.feed(&prompt).unwrap();
        let logits = model.feed(&[a]).unwrap();
        let second = ballast_runtime::Sampler::new(sampler).distribution(logits, &[]);
        for (&b, &pb) in second.ids.iter().zip(&second.probs) {
            exact.insert((a, b), pa * pb);
        }
    }
    let samples = 4000;
    let mut counts = std::collections::HashMap::new();
    let mut stats = ballast_runtime::generate::SpeculationStats::default();
    for seed in 0..samples {
        let options = GenerateOptions {
            sampler: SamplerConfig { seed, ..sampler },
            // The second token comes from verifying a one-token draft (the third is
            // the pass's own, unused).
            max_tokens: Some(3),
            ignore_eos: true,
            ..GenerateOptions::default()
        };
        let drafter = Sharper {
            session: new_session(),
            sampler: ballast_runtime::Sampler::new(SamplerConfig {
                temperature: 0.4,
                seed: seed + 1_000_000,
                ..sampler
            }),
        };
        let mut g = Generator::new(new_session(), tokenizer.clone(), options)
            .unwrap()
            .with_drafter(
                Box::new(drafter),
                DraftOptions {
                    max: 1,
                    min: 0,
                    p_min: 0.0,
                },
            );
        g.prompt(&prompt).unwrap();
        let mut ids = Vec::new();
        while let Step::Token(t) = g.step().unwrap() {
            ids.push(t.id);
        }
        *counts.entry((ids[0], ids[1])).or_insert(0usize) += 1;
        let s = g.speculation_stats();
        stats.drafted += s.drafted;
        stats.accepted += s.accepted;
    }
    // Both outcomes of the acceptance test happened often.
    let acceptance = stats.acceptance();
    assert!((0.2..0.9).contains(&acceptance), "acceptance {acceptance}");
    // Pearson's chi-square over the pairs the model can produce (pairs it cannot
    // produce must not occur at all).
    for pair in counts.keys() {
        assert!(
            exact.contains_key(pair),
            "{pair:?} cannot follow the prompt"
        );
    }
    let chi2: f64 = exact
        .iter()
        .map(|(pair, &p)| {
            let expected = p * samples as f64;
            let observed = *counts.get(pair).unwrap_or(&0) as f64;
            (observed - expected).powi(2) / expected
        })
        .sum();
    // 15 degrees of freedom at most (16 pairs); the 99.9th percentile is 37.7.
    assert!(exact.len() <= 16);
    assert!(
        chi2 < 37.7,
        "chi-square {chi2:.1} over {} pairs, acceptance {acceptance}",
        exact.len()
    );
}

/// On wgpu the keys and values live on the device: a verification is one pass there
/// and the rejected rows are dropped from the device's cache.
#[cfg(feature = "gpu")]
#[test]
fn greedy_speculative_decoding_equals_plain_decoding_on_wgpu() {
    let Some(ctx) = ballast_runtime::testing::gpu_for_tests() else {
        return;
    };
    let backend: Arc<dyn Backend> = Arc::new(ballast_runtime::WgpuBackend::new(ctx));
    let draft = DraftOptions {
        max: 5,
        min: 0,
        p_min: 0.0,
    };
    for (arch, wrong_every, phase) in [(0, 2, 0), (0, 3, 1), (1, 4, 2), (2, 3, 0), (2, 5, 3)] {
        let spec = spec_for(arch, 21 + arch as u64);
        let prompt: Vec<u32> = (0..11).map(|i| (i * 37 + 5) % 256).collect();
        check_greedy_is_exact(
            &spec,
            backend.clone(),
            &prompt,
            30,
            draft,
            Wrong {
                every: wrong_every,
                phase,
            },
        );
    }
    // A verification is one submission that reads back every row; dropping the
    // rejected rows only moves the device cache's length (no transfer), and the next
    // pass attends over the kept rows alone.
    let wgpu = Arc::new(ballast_runtime::WgpuBackend::new(
        ballast_runtime::testing::gpu_for_tests().unwrap(),
    ));
    let spec = spec_for(0, 5);
    let mut verified = session(&spec, wgpu.clone(), 64);
    verified.feed(&[1, 2, 3]).unwrap();
    verified.feed_scored(&[4, 5, 6, 7, 8]).unwrap();
    let report = wgpu.telemetry().last_pass().unwrap();
    assert_eq!((report.submissions, report.tokens), (1, 5));
    assert!(verified.keep_scored(2));
    let kept = verified.logits().to_vec();
    let after = verified.feed(&[9]).unwrap().to_vec();
    let mut plain = session(&spec, wgpu.clone(), 64);
    plain.feed(&[1, 2, 3, 4]).unwrap();
    assert_eq!(plain.feed(&[5]).unwrap(), &kept[..]);
    assert_eq!(plain.feed(&[9]).unwrap(), &after[..]);
}
