//! Speculative decoding over every cache kind this crate has, under StreamingLLM: the
//! greedy tokens and log-probabilities equal plain decoding's, bit for bit, while the
//! window fills (drafts verified, rejected rows rolled back) and after it is full
//! (where a verification would have to evict, the generator decodes plainly).

use std::sync::Arc;

use ballast_kv_cache::{new_cache, KvElement, StreamingLlm, UpdateMode};
use ballast_runtime::generate::{DraftOptions, GenerateOptions, Generator, PromptLookup, Step};
use ballast_runtime::gguf::GgufFile;
use ballast_runtime::testing::TinyModelSpec;
use ballast_runtime::{Backend, CpuBackend, Model, SamplerConfig, Session, Tokenizer};

const N_SINK: usize = 2;
const WINDOW: usize = 30;

fn generate(mode: UpdateMode, speculate: bool) -> (Vec<(u32, u32)>, usize) {
    let spec = TinyModelSpec {
        n_layers: 2,
        seed: 5,
        ..TinyModelSpec::default()
    };
    let file = Arc::new(GgufFile::from_bytes(spec.to_gguf_bytes().unwrap()).unwrap());
    let tokenizer = Arc::new(Tokenizer::from_gguf(&file).unwrap());
    let backend: Arc<dyn Backend> = Arc::new(CpuBackend::new(1));
    let model = Model::load(file, backend.clone(), false).unwrap();
    let policy = StreamingLlm::new(N_SINK, WINDOW)
        .unwrap()
        .with_rope(backend, model.config().layer_ropes());
    let cache = new_cache(mode, model.kv_shape(), N_SINK + WINDOW, KvElement::F16).unwrap();
    let session = Session::with_cache(model, cache, Some(Box::new(policy)));
    let options = GenerateOptions {
        sampler: SamplerConfig {
            temperature: 0.0,
            ..SamplerConfig::default()
        },
        max_tokens: Some(60),
        ignore_eos: true,
        logprobs: true,
        ..GenerateOptions::default()
    };
    let mut g = Generator::new(session, tokenizer, options).unwrap();
    if speculate {
        let draft = DraftOptions {
            max: 6,
            min: 0,
            p_min: 0.0,
        };
        g = g.with_drafter(Box::new(PromptLookup::default()), draft);
    }
    // A repetitive prompt, so prompt lookup has something to copy.
    g.prompt(&[7, 8, 9, 7, 8, 9, 7, 8]).unwrap();
    let mut out = Vec::new();
    while let Step::Token(t) = g.step().unwrap() {
        out.push((t.id, t.logprob.unwrap().to_bits()));
    }
    (out, g.speculation_stats().passes)
}

#[test]
fn greedy_speculation_under_streaming_llm_equals_plain_decoding() {
    for mode in [
        UpdateMode::ShiftConcat,
        UpdateMode::PointerShift,
        UpdateMode::SmartMask,
    ] {
        let (want, _) = generate(mode, false);
        let (got, passes) = generate(mode, true);
        assert_eq!(got, want, "{mode:?}");
        assert!(passes > 0, "{mode:?}: some drafts were verified");
    }
}
