//! The generation loop: stop strings across tokens, penalties, end-of-generation
//! tokens, the token limit and the context bound of `Continuation` and `Generator`, and
//! greedy `Generator` ids equal to a plain feed-and-argmax loop over a session (the
//! path `ballast run` took before the generator), on the CPU and on wgpu.

use std::sync::Arc;

use ballast_runtime::generate::{
    Continuation, FinishReason, GenerateOptions, Generator, Step, Token,
};
use ballast_runtime::gguf::GgufFile;
use ballast_runtime::sampler::{argmax, log_softmax_at};
use ballast_runtime::testing::{TinyModelSpec, TINY_VOCAB};
use ballast_runtime::{Backend, CpuBackend, Model, SamplerConfig, Session, Tokenizer};

/// End-of-sequence id of the tiny byte-level vocabulary (`<|endoftext|>`).
const EOS: u32 = 256;

fn tiny_file() -> Arc<GgufFile> {
    let spec = TinyModelSpec {
        n_layers: 3,
        ..TinyModelSpec::default()
    };
    Arc::new(GgufFile::from_bytes(spec.to_gguf_bytes().unwrap()).unwrap())
}

fn tokenizer() -> Tokenizer {
    Tokenizer::from_gguf(&tiny_file()).unwrap()
}

fn model(backend: Arc<dyn Backend>) -> Model {
    Model::load(tiny_file(), backend, false).unwrap()
}

fn greedy() -> SamplerConfig {
    SamplerConfig {
        temperature: 0.0,
        ..SamplerConfig::default()
    }
}

/// The token id of each byte of `text` (the tiny vocabulary has one token per byte).
fn ids_of(tok: &Tokenizer, text: &str) -> Vec<u32> {
    let ids = tok.encode(text, false, false).unwrap();
    assert_eq!(ids.len(), text.len(), "one token per byte");
    ids
}

/// Logits that make `id` the greedy choice.
fn one_hot(id: u32) -> Vec<f32> {
    let mut logits = vec![0.0; TINY_VOCAB];
    logits[id as usize] = 10.0;
    logits
}

/// Hands `ids` to a continuation one at a time (through greedy sampling of one-hot
/// logits); returns the tokens, the text including the end's, and the end.
fn drive(
    tok: &Tokenizer,
    options: GenerateOptions,
    ids: &[u32],
) -> (Vec<Token>, String, Option<FinishReason>) {
    let mut c = Continuation::new(options).unwrap();
    let mut tokens = Vec::new();
    let mut text = String::new();
    for &id in ids {
        match c.choose(tok, &one_hot(id), &[], None) {
            Step::Token(t) => {
                text.push_str(&t.text);
                tokens.push(t);
            }
            Step::Done(end) => {
                text.push_str(&end.text);
                return (tokens, text, Some(end.reason));
            }
        }
        if let Some(end) = c.finish() {
            text.push_str(&end.text);
            return (tokens, text, Some(end.reason));
        }
    }
    (tokens, text, None)
}

#[test]
fn a_stop_string_across_tokens_ends_the_text_where_it_starts() {
    let tok = tokenizer();
    let options = GenerateOptions {
        sampler: greedy(),
        stop: vec!["END".into()],
        ..GenerateOptions::default()
    };
    let ids = ids_of(&tok, "abcENDxyz");
    let (tokens, text, end) = drive(&tok, options.clone(), &ids);
    assert_eq!(end, Some(FinishReason::StopString));
    assert_eq!(text, "abc");
    // The tokens up to the one completing the stop are generated; the `E` and `N` are
    // held back (empty text) until `D` shows they start the stop.
    assert_eq!(tokens.len(), 6);
    let texts: Vec<&str> = tokens.iter().map(|t| t.text.as_str()).collect();
    assert_eq!(texts, ["a", "b", "c", "", "", ""]);

    // A false start is released with the token that rules it out; a tail that may
    // still begin the stop is held back, and released when the generation ends.
    let (tokens, text, end) = drive(&tok, options.clone(), &ids_of(&tok, "aENbEN"));
    assert_eq!(end, None);
    assert_eq!(tokens[3].text, "ENb");
    assert_eq!(text, "aENb", "`EN` may still begin the stop");
    let limited = GenerateOptions {
        max_tokens: Some(6),
        ..options
    };
    let (_, text, end) = drive(&tok, limited, &ids_of(&tok, "aENbEN"));
    assert_eq!(end, Some(FinishReason::MaxTokens));
    assert_eq!(text, "aENbEN");
}

#[test]
fn a_character_split_over_tokens_comes_out_whole() {
    let tok = tokenizer();
    let options = GenerateOptions {
        sampler: greedy(),
        max_tokens: Some(3),
        ..GenerateOptions::default()
    };
    // "é" is two bytes, so two tokens.
    let (tokens, text, end) = drive(&tok, options.clone(), &ids_of(&tok, "aé"));
    assert_eq!(end, Some(FinishReason::MaxTokens));
    assert_eq!(text, "aé");
    assert_eq!(tokens[1].text, "", "half a character is held back");
    assert_eq!(tokens[2].text, "é");
    // Ended by the limit inside a character, the incomplete bytes come with the end.
    let ids = ids_of(&tok, "abé");
    let (_, text, end) = drive(&tok, options, &ids);
    assert_eq!(end, Some(FinishReason::MaxTokens));
    assert_eq!(text, "ab\u{FFFD}");
}

#[test]
fn an_end_of_generation_token_stops_unless_ignored() {
    let tok = tokenizer();
    assert!(tok.is_end_of_generation(EOS));
    let options = GenerateOptions {
        sampler: greedy(),
        ..GenerateOptions::default()
    };
    let ids = [ids_of(&tok, "ab"), vec![EOS], ids_of(&tok, "c")].concat();
    let (tokens, text, end) = drive(&tok, options.clone(), &ids);
    assert_eq!(end, Some(FinishReason::EndOfGeneration));
    assert_eq!(
        tokens.len(),
        2,
        "the end-of-generation token is not returned"
    );
    assert_eq!(text, "ab");

    let ignoring = GenerateOptions {
        ignore_eos: true,
        ..options
    };
    let (tokens, _, end) = drive(&tok, ignoring, &ids);
    assert_eq!(end, None);
    assert_eq!(tokens.len(), 4);
    assert_eq!(tokens[2].id, EOS);
}

#[test]
fn presence_and_frequency_penalties_lower_generated_tokens() {
    let tok = tokenizer();
    let [a, b] = ids_of(&tok, "ab")[..] else {
        unreachable!()
    };
    // `a` leads `b` by 1.5.
    let mut logits = vec![0.0; TINY_VOCAB];
    logits[a as usize] = 5.0;
    logits[b as usize] = 3.5;
    let run = |presence: f32, frequency: f32, n: usize| -> Vec<u32> {
        let mut c = Continuation::new(GenerateOptions {
            sampler: greedy(),
            presence_penalty: presence,
            frequency_penalty: frequency,
            ..GenerateOptions::default()
        })
        .unwrap();
        (0..n)
            .map(|_| match c.choose(&tok, &logits, &[], None) {
                Step::Token(t) => t.id,
                Step::Done(end) => panic!("ended: {end:?}"),
            })
            .collect()
    };
    assert_eq!(run(0.0, 0.0, 4), [a, a, a, a]);
    // Presence: `a` loses 2 once it occurred (3 < 3.5), then `b` does too (1.5), and
    // neither loses more for occurring again.
    assert_eq!(run(2.0, 0.0, 4), [a, b, a, a]);
    // Frequency: each occurrence costs 1: a (5), a (4 > 3.5), b (3 < 3.5), then a
    // (3 > 2.5), b...
    assert_eq!(run(0.0, 1.0, 5), [a, a, b, a, b]);
    // The prompt's tokens do not count (unlike the repetition penalty's history).
    let mut c = Continuation::new(GenerateOptions {
        sampler: greedy(),
        presence_penalty: 2.0,
        ..GenerateOptions::default()
    })
    .unwrap();
    let Step::Token(t) = c.choose(&tok, &logits, &[a, a, a], None) else {
        panic!()
    };
    assert_eq!(t.id, a);
    // The repetition penalty reads the history: 5 / 4 < 3.5.
    let mut c = Continuation::new(GenerateOptions {
        sampler: SamplerConfig {
            repeat_penalty: 4.0,
            ..greedy()
        },
        ..GenerateOptions::default()
    })
    .unwrap();
    let Step::Token(t) = c.choose(&tok, &logits, &[a], None) else {
        panic!()
    };
    assert_eq!(t.id, b);
    // A penalty that is no number is refused.
    assert!(Continuation::new(GenerateOptions {
        presence_penalty: f32::NAN,
        ..GenerateOptions::default()
    })
    .is_err());
}

#[test]
fn log_probabilities_are_of_the_unpenalized_logits_when_asked() {
    let tok = tokenizer();
    let logits: Vec<f32> = (0..TINY_VOCAB).map(|i| (i % 7) as f32 * 0.5).collect();
    let mut c = Continuation::new(GenerateOptions {
        sampler: greedy(),
        logprobs: true,
        frequency_penalty: 0.5,
        ..GenerateOptions::default()
    })
    .unwrap();
    let Step::Token(t) = c.choose(&tok, &logits, &[], None) else {
        panic!()
    };
    assert_eq!(t.id, argmax(&logits));
    assert_eq!(t.logprob, Some(log_softmax_at(&logits, t.id)));
    let mut c = Continuation::new(GenerateOptions::default()).unwrap();
    let Step::Token(t) = c.choose(&tok, &logits, &[], None) else {
        panic!()
    };
    assert_eq!(t.logprob, None);
}

/// Greedy ids the way `ballast run` computed them before the generator: feed the
/// prompt, then take the argmax of each step's logits and feed it.
fn feed_and_argmax(session: &mut Session, prompt: &[u32], n: usize) -> Vec<u32> {
    let mut next = argmax(session.feed(prompt).unwrap());
    let mut out = vec![next];
    while out.len() < n {
        next = argmax(session.feed(&[next]).unwrap());
        out.push(next);
    }
    out
}

/// Runs `generator` to its end; returns the ids and the end.
fn generate_all(generator: &mut Generator) -> (Vec<u32>, String, FinishReason) {
    let mut ids = Vec::new();
    let mut text = String::new();
    loop {
        match generator.step().unwrap() {
            Step::Token(t) => {
                ids.push(t.id);
                text += &t.text;
            }
            Step::Done(end) => {
                text += &end.text;
                return (ids, text, end.reason);
            }
        }
    }
}

const PROMPT: &[u32] = &[72, 101, 108, 108, 111, 44, 32];

fn check_greedy_ids_match_the_plain_loop(backend: Arc<dyn Backend>) {
    let tok = Arc::new(tokenizer());
    let n = 12;
    let expected = feed_and_argmax(
        &mut Session::new(model(backend.clone()), 64).unwrap(),
        PROMPT,
        n,
    );
    for (logprobs, keep_logits) in [(false, false), (true, false), (false, true)] {
        let options = GenerateOptions {
            sampler: greedy(),
            max_tokens: Some(n),
            ignore_eos: true,
            logprobs,
            keep_logits,
            ..GenerateOptions::default()
        };
        let session = Session::new(model(backend.clone()), 64).unwrap();
        let mut generator = Generator::new(session, tok.clone(), options).unwrap();
        generator.prompt(PROMPT).unwrap();
        let (ids, text, end) = generate_all(&mut generator);
        assert_eq!(
            ids, expected,
            "logprobs {logprobs}, keep_logits {keep_logits}"
        );
        assert_eq!(end, FinishReason::MaxTokens);
        assert_eq!(text, tok.decode(&ids));
        // The last token was not fed; feeding it completes the history.
        assert_eq!(generator.session().tokens().len(), PROMPT.len() + n - 1);
        assert!(generator.feed_last_token().unwrap());
        assert!(!generator.feed_last_token().unwrap());
        assert_eq!(
            generator.session().tokens(),
            [PROMPT, &expected[..]].concat()
        );
        assert!(matches!(generator.step().unwrap(), Step::Done(_)));
    }
}

#[test]
fn greedy_generator_ids_equal_a_plain_feed_and_argmax_loop_on_the_cpu() {
    check_greedy_ids_match_the_plain_loop(Arc::new(CpuBackend::new(1)));
}

/// On wgpu, plain greedy decoding takes the argmax on the device (one id read back per
/// token): the same ids as the host's argmax of the logits.
#[cfg(feature = "gpu")]
#[test]
fn greedy_generator_ids_equal_a_plain_feed_and_argmax_loop_on_wgpu() {
    let Some(ctx) = ballast_runtime::testing::gpu_for_tests() else {
        return;
    };
    check_greedy_ids_match_the_plain_loop(Arc::new(ballast_runtime::WgpuBackend::new(ctx)));
}

#[test]
fn the_context_bounds_the_generation_so_every_token_fits() {
    let tok = Arc::new(tokenizer());
    let options = GenerateOptions {
        sampler: greedy(),
        ignore_eos: true,
        ..GenerateOptions::default()
    };
    let context = 16;
    let session = Session::new(model(Arc::new(CpuBackend::new(1))), context).unwrap();
    let mut generator = Generator::new(session, tok, options).unwrap();
    generator.prompt(PROMPT).unwrap();
    let (ids, _, end) = generate_all(&mut generator);
    assert_eq!(end, FinishReason::ContextFull);
    assert_eq!(ids.len(), context - PROMPT.len());
    assert!(generator.feed_last_token().unwrap());
    assert_eq!(generator.session().kv().len(), context);
    // A full cache gives no token at all.
    generator.prompt(&[]).unwrap();
    let (ids, _, end) = generate_all(&mut generator);
    assert_eq!((ids.len(), end), (0, FinishReason::ContextFull));
}

#[test]
fn each_prompt_starts_a_new_generation_and_an_empty_one_continues() {
    let tok = Arc::new(tokenizer());
    let options = GenerateOptions {
        sampler: SamplerConfig {
            seed: 7,
            ..SamplerConfig::default()
        },
        max_tokens: Some(5),
        ignore_eos: true,
        ..GenerateOptions::default()
    };
    let backend: Arc<dyn Backend> = Arc::new(CpuBackend::new(1));
    let fresh = |options: &GenerateOptions| {
        Generator::new(
            Session::new(model(backend.clone()), 64).unwrap(),
            tok.clone(),
            options.clone(),
        )
        .unwrap()
    };
    // Nothing to continue from.
    let mut g = fresh(&options);
    assert!(g.prompt(&[]).is_err());
    assert!(g.step().is_err());

    // Seeded sampling repeats; a second prompt on the same generator resets the limit.
    g.prompt(PROMPT).unwrap();
    let (first, _, _) = generate_all(&mut g);
    let mut again = fresh(&options);
    again.prompt(PROMPT).unwrap();
    assert_eq!(generate_all(&mut again).0, first);
    g.feed_last_token().unwrap();
    g.prompt(&[10]).unwrap();
    let (second, _, end) = generate_all(&mut g);
    assert_eq!((second.len(), end), (5, FinishReason::MaxTokens));
    assert_eq!(g.generated(), 5);

    // A zero limit generates nothing.
    let mut none = fresh(&GenerateOptions {
        max_tokens: Some(0),
        ..options
    });
    none.prompt(PROMPT).unwrap();
    let (ids, _, end) = generate_all(&mut none);
    assert_eq!((ids.len(), end), (0, FinishReason::MaxTokens));
}
