//! End to end on the default model against llama.cpp's reference outputs
//! (`tests/data/llama_cpp_smollm2-135m-q4_1.json`, copied from `shared/golden/`).
//!
//! The default model must be in the model cache (`cargo xtask fetch-model`; `cargo
//! xtask test` does it). Without it these tests fail under CI (`CI` set) and are
//! skipped with a printed reason elsewhere.

mod common;

use std::sync::Arc;

use ballast_runtime::gguf::GgufFile;
use ballast_runtime::session::perplexity;
#[cfg(feature = "gpu")]
use ballast_runtime::WgpuBackend;
use ballast_runtime::{
    Backend, CpuBackend, GenerateOptions, Generator, Model, SamplerConfig, Session, Step, Tokenizer,
};
use serde_json::Value;
use sha2::{Digest, Sha256};

fn golden() -> Value {
    serde_json::from_str(include_str!("data/llama_cpp_smollm2-135m-q4_1.json")).unwrap()
}

fn default_model() -> Option<Arc<GgufFile>> {
    common::default_model().map(Arc::new)
}

/// How far our first-step logits may be from llama.cpp's (the golden file's bar).
///
/// The CPU backend follows llama.cpp's AVX-512 float order op for op (matmul lanes,
/// flash attention over an f16 cache, RoPE and SiLU roundings), so today the logits
/// agree to the last bit and the golden figures, printed to four decimals, are met
/// within their rounding. Without that, 8-bit activation quantization makes logits
/// jump by up to about 0.5 when one value rounds the other way.
const FIRST_STEP_TOLERANCE: f64 = 0.05;

/// The same bound for the wgpu backend. It quantizes activations to the same integers
/// but sums floats in its own order (block sums, attention over the cache in f32), so
/// it is one of the "two correct implementations" above: a few activations round the
/// other way and the logits move by up to about 0.5. Its ids must still match.
#[cfg(feature = "gpu")]
const GPU_FIRST_STEP_TOLERANCE: f64 = 0.6;

/// How far below the wgpu backend's top logit llama.cpp's choice may be for the step to
/// count as a near-tie it may break another way (then the comparison stops). The same
/// rounding that moves its logits moves the margins: at step 12 of one prompt
/// llama.cpp's top two are over 0.1 apart, and products summed over 16 or 32 lanes per
/// row (instead of 8) put another token first, llama.cpp's 0.10 and 0.16 below it.
#[cfg(feature = "gpu")]
const GPU_NEAR_TIE: f32 = 0.25;

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

/// The ids in decreasing logit order (ties: lower id first).
fn ranked(logits: &[f32]) -> Vec<usize> {
    let mut order: Vec<usize> = (0..logits.len()).collect();
    order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
    order
}

#[test]
fn greedy_generation_matches_llama_cpp() {
    let Some(file) = default_model() else { return };
    check_greedy_generation(
        file,
        Arc::new(CpuBackend::new(2)),
        FIRST_STEP_TOLERANCE,
        None,
    );
}

/// The same on the wgpu backend (lavapipe in CI): the whole pass on the device.
#[test]
#[cfg(feature = "gpu")]
fn greedy_generation_on_wgpu_matches_llama_cpp() {
    let Some(file) = default_model() else { return };
    let Some(ctx) = ballast_runtime::testing::gpu_for_tests() else {
        return;
    };
    check_greedy_generation(
        file,
        Arc::new(WgpuBackend::new(ctx)),
        GPU_FIRST_STEP_TOLERANCE,
        Some(GPU_NEAR_TIE),
    );
}

/// Greedy ids against llama.cpp's. With `rounding_margin` (a backend that rounds
/// differently), the golden README's rule: every id up to the first near-tie, and there
/// either of the two if our margin is also under 0.1; and also ours where llama.cpp's
/// choice is less than `rounding_margin` below it. The CPU backend, which
/// reproduces llama.cpp's rounding, is held further, to every id up to a near-tie
/// where it differs.
fn check_greedy_generation(
    file: Arc<GgufFile>,
    backend: Arc<dyn Backend>,
    tolerance: f64,
    rounding_margin: Option<f32>,
) {
    let stop_at_first_near_tie = rounding_margin.is_some();
    let tokenizer = Tokenizer::from_gguf(&file).unwrap();
    let golden = golden();
    for case in golden["greedy"].as_array().unwrap() {
        let prompt = case["prompt"].as_str().unwrap();
        let want_prompt = ids(&case["prompt_ids"]);
        let prompt_ids = tokenizer.encode(prompt, true, false).unwrap();
        assert_eq!(prompt_ids, want_prompt, "prompt ids of {prompt:?}");

        let model = Model::load(file.clone(), backend.clone(), true).unwrap();
        let mut session = Session::new(model, 512).unwrap();
        let mut logits = session.feed(&prompt_ids).unwrap().to_vec();
        // First step: the same top token, and llama.cpp's top five logits within
        // FIRST_STEP_TOLERANCE.
        let top = ranked(&logits);
        let golden_top = &case["step0_top5_logits"];
        assert_eq!(
            top[0] as u64,
            golden_top[0][0].as_u64().unwrap(),
            "{prompt:?}: top token"
        );
        for pair in golden_top.as_array().unwrap() {
            let (id, value) = (
                pair[0].as_u64().unwrap() as usize,
                pair[1].as_f64().unwrap(),
            );
            let diff = (logits[id] as f64 - value).abs();
            eprintln!(
                "{prompt:?}: logit of {id}: {} (llama.cpp {value})",
                logits[id]
            );
            assert!(
                diff < tolerance,
                "{prompt:?}: logit of {id} is {} (llama.cpp {value})",
                logits[id]
            );
        }
        let want = ids(&case["generated_ids"]);
        let near_ties: Vec<(usize, u32, u32)> = case["near_ties"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| {
                (
                    t["step"].as_u64().unwrap() as usize,
                    t["chosen"].as_u64().unwrap() as u32,
                    t["runner_up"].as_u64().unwrap() as u32,
                )
            })
            .collect();
        for (step, &expected) in want.iter().enumerate() {
            let order = ranked(&logits);
            let got = order[0] as u32;
            if got != expected {
                // Every id must match up to llama.cpp's first near-tie (top two within
                // 0.1). There the runner-up is acceptable if our own margin is also under
                // 0.1 (the golden README's rule), and the comparison ends.
                let tie = near_ties.iter().find(|t| t.0 == step);
                let gap = logits[order[0]] - logits[expected as usize];
                let our_near_tie = rounding_margin.is_some_and(|m| gap < m);
                assert!(
                    (tie.is_some_and(|t| t.2 == got) && gap < 0.1) || our_near_tie,
                    "{prompt:?}: step {step} chose {got}, llama.cpp {expected} (our gap {gap})"
                );
                eprintln!(
                    "{prompt:?}: at the near-tie of step {step} we chose {got}, llama.cpp {expected} \
                     ({gap:.3} below ours); the comparison stops there"
                );
                break;
            }
            if stop_at_first_near_tie && near_ties.iter().any(|t| t.0 == step) {
                eprintln!("{prompt:?}: matched every id up to the first near-tie (step {step})");
                break;
            }
            logits = session.feed(&[got]).unwrap().to_vec();
        }
    }
}

/// `ballast run --temp 0` generates through the `Generator` (argmax on the host on the
/// CPU): its ids are llama.cpp's, up to a near-tie where it may take the runner-up (as
/// `greedy_generation_matches_llama_cpp` allows, which also checks our margin there).
#[test]
fn generator_greedy_ids_match_llama_cpp() {
    let Some(file) = default_model() else { return };
    let tokenizer = Arc::new(Tokenizer::from_gguf(&file).unwrap());
    for case in golden()["greedy"].as_array().unwrap() {
        let prompt = case["prompt"].as_str().unwrap();
        let want = ids(&case["generated_ids"]);
        let model = Model::load(file.clone(), Arc::new(CpuBackend::new(2)), true).unwrap();
        let options = GenerateOptions {
            sampler: SamplerConfig {
                temperature: 0.0,
                ..SamplerConfig::default()
            },
            max_tokens: Some(want.len()),
            ignore_eos: true,
            ..GenerateOptions::default()
        };
        let session = Session::new(model, 512).unwrap();
        let mut generator = Generator::new(session, tokenizer.clone(), options).unwrap();
        generator
            .prompt(&tokenizer.encode(prompt, true, false).unwrap())
            .unwrap();
        let mut got = Vec::new();
        while let Step::Token(token) = generator.step().unwrap() {
            got.push(token.id);
        }
        assert_eq!(got.len(), want.len(), "{prompt:?}");
        if let Some(step) = got.iter().zip(&want).position(|(a, b)| a != b) {
            let runner_up_at_a_tie = case["near_ties"].as_array().unwrap().iter().any(|t| {
                t["step"].as_u64() == Some(step as u64)
                    && t["runner_up"].as_u64() == Some(got[step] as u64)
            });
            assert!(
                runner_up_at_a_tie,
                "{prompt:?}: step {step} chose {}, llama.cpp {}",
                got[step], want[step]
            );
        }
    }
}

fn gpl3() -> Option<String> {
    let path = golden()["tokenize_file"]["path"]
        .as_str()
        .unwrap()
        .to_string();
    match std::fs::read_to_string(&path) {
        Ok(text) => Some(text),
        Err(e) if std::env::var_os("CI").is_some() => panic!("{path}: {e}"),
        Err(e) => {
            eprintln!("skipped: {path}: {e}");
            None
        }
    }
}

#[test]
fn gpl3_tokenizes_to_llama_cpp_ids() {
    let Some(file) = default_model() else { return };
    let Some(text) = gpl3() else { return };
    let tokenizer = Tokenizer::from_gguf(&file).unwrap();
    let g = golden();
    let t = &g["tokenize_file"];
    let got = tokenizer.encode(&text, true, false).unwrap();
    assert_eq!(got.len() as u64, t["n_tokens"].as_u64().unwrap());
    assert_eq!(got[..40], ids(&t["first_40_ids"])[..]);
    assert_eq!(got[got.len() - 10..], ids(&t["last_10_ids"])[..]);
    let joined = got.iter().map(u32::to_string).collect::<Vec<_>>().join(" ");
    let hash: String = Sha256::digest(joined.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    assert_eq!(hash, t["ids_sha256"].as_str().unwrap());
    assert_eq!(tokenizer.decode(&got), text, "decoding gives the text back");
}

#[test]
fn perplexity_matches_llama_cpp() {
    let Some(file) = default_model() else { return };
    let Some(text) = gpl3() else { return };
    let g = golden();
    let ctx = g["perplexity"]["ctx"].as_u64().unwrap() as usize;
    let want = g["perplexity"]["ppl"].as_f64().unwrap();
    let tokenizer = Tokenizer::from_gguf(&file).unwrap();
    let tokens = tokenizer.encode(&text, false, false).unwrap();
    let mut model = Model::load(file, Arc::new(CpuBackend::new(2)), true).unwrap();
    let report = perplexity(&mut model, &tokens, ctx, ctx, |_, _| {}).unwrap();
    let rel = (report.perplexity - want).abs() / want;
    eprintln!(
        "perplexity {:.4} (llama.cpp {want}), {} windows",
        report.perplexity, report.chunks
    );
    assert!(
        rel < 0.01,
        "perplexity {} vs llama.cpp {want}",
        report.perplexity
    );
    // The windows are batches of 256 queries, which llama.cpp's CPU flash attention
    // computes in its tiled order, as Ballast does: llama.cpp 0.3.36 (the PyPI sdist's
    // vendor/llama.cpp, built with GGML_NATIVE on an AVX-512 Zen 4) prints the same
    // perplexity to its four decimals (`llama-perplexity -f GPL-3 -c 256 -b 256 -fa on
    // -t 2`: "Final estimate: PPL = 20.8533"; the one-query order gave 20.8646).
    assert_eq!(format!("{:.4}", report.perplexity), "20.8533");
}
