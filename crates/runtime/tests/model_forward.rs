//! The forward pass against an independent f64 reference on tiny random models, and
//! the properties the engine promises (chunked prefill, thread counts, errors).

use std::sync::Arc;

use ballast_runtime::ggml_type::GgmlType;
use ballast_runtime::gguf::{GgufFile, GgufWriter, Value};
use ballast_runtime::kv::KvElement;
use ballast_runtime::model::Logits;
use ballast_runtime::quant;
use ballast_runtime::testing::{reference_spec, TinyModelSpec, TINY_VOCAB};
use ballast_runtime::DenseKv;
use ballast_runtime::{CpuBackend, Error, Model, Session};
use proptest::prelude::*;

fn load(spec: &TinyModelSpec, threads: usize) -> Model {
    let file = Arc::new(GgufFile::from_bytes(spec.to_gguf_bytes().unwrap()).unwrap());
    Model::load(file, Arc::new(CpuBackend::new(threads)), false).unwrap()
}

/// A tensor of the file as f64 values.
fn tensor(file: &GgufFile, name: &str) -> Vec<f64> {
    let info = file.tensor(name).unwrap().clone();
    let mut out = vec![0f32; info.n_elements() as usize];
    quant::dequantize(info.ty, file.tensor_data(&info), &mut out).unwrap();
    out.into_iter().map(f64::from).collect()
}

/// `W x` for a ggml-order weight of `rows` rows of `x.len()`.
fn matvec(w: &[f64], x: &[f64]) -> Vec<f64> {
    w.chunks_exact(x.len())
        .map(|row| row.iter().zip(x).map(|(a, b)| a * b).sum())
        .collect()
}

fn rms_norm(x: &[f64], scale: &[f64], eps: f64) -> Vec<f64> {
    let ms = x.iter().map(|v| v * v).sum::<f64>() / x.len() as f64;
    let inv = 1.0 / (ms + eps).sqrt();
    x.iter().zip(scale).map(|(v, s)| v * inv * s).collect()
}

fn rope(x: &mut [f64], pos: usize, head_dim: usize, base: f64, neox: bool) {
    for head in x.chunks_exact_mut(head_dim) {
        for i in 0..head_dim / 2 {
            let theta = pos as f64 * base.powf(-2.0 * i as f64 / head_dim as f64);
            let (a, b) = if neox {
                (i, i + head_dim / 2)
            } else {
                (2 * i, 2 * i + 1)
            };
            let (x0, x1) = (head[a], head[b]);
            head[a] = x0 * theta.cos() - x1 * theta.sin();
            head[b] = x0 * theta.sin() + x1 * theta.cos();
        }
    }
}

/// The logits of every position of `ids`, computed directly from the definition.
fn reference_logits(spec: &TinyModelSpec, ids: &[u32]) -> Vec<Vec<f64>> {
    let file = GgufFile::from_bytes(spec.to_gguf_bytes().unwrap()).unwrap();
    let (d, hd) = (spec.d_model, spec.head_dim());
    let group = spec.n_heads / spec.n_kv_heads;
    let gemma = spec.arch == "gemma3";
    let neox = spec.arch == "qwen2" || spec.arch == "qwen3" || gemma;
    let biases = spec.arch == "qwen2";
    let qk_norm = spec.arch == "qwen3" || gemma;
    let embd = tensor(&file, "token_embd.weight");
    let out_w = if spec.tied {
        embd.clone()
    } else {
        tensor(&file, "output.weight")
    };
    let mut xs: Vec<Vec<f64>> = ids
        .iter()
        .map(|&id| embd[id as usize * d..(id as usize + 1) * d].to_vec())
        .collect();
    if gemma {
        // gemma3 scales the embeddings by sqrt(d_model).
        for x in &mut xs {
            x.iter_mut().for_each(|v| *v *= (d as f64).sqrt());
        }
    }
    for l in 0..spec.n_layers {
        // gemma3: a layer slides its window unless it is every pattern-th one, and has the
        // local RoPE base.
        let (window, base) = match spec.sliding_window {
            Some((w, n, local)) if (l as u32) % n < n - 1 => (w, local as f64),
            _ => (usize::MAX, spec.rope_base as f64),
        };
        let t = |s: &str| tensor(&file, &format!("blk.{l}.{s}"));
        let bias = |s: &str, n: usize| {
            if biases {
                t(s)
            } else {
                vec![0.0; n]
            }
        };
        let (wq, wk, wv, wo) = (
            t("attn_q.weight"),
            t("attn_k.weight"),
            t("attn_v.weight"),
            t("attn_output.weight"),
        );
        let (bq, bk, bv) = (
            bias("attn_q.bias", spec.n_heads * hd),
            bias("attn_k.bias", spec.n_kv_heads * hd),
            bias("attn_v.bias", spec.n_kv_heads * hd),
        );
        let add = |a: Vec<f64>, b: &[f64]| a.iter().zip(b).map(|(x, y)| x + y).collect::<Vec<_>>();
        let mut qs = Vec::new();
        let mut ks = Vec::new();
        let mut vs = Vec::new();
        for (p, x) in xs.iter().enumerate() {
            let h = rms_norm(x, &t("attn_norm.weight"), 1e-5);
            let mut q = add(matvec(&wq, &h), &bq);
            let mut k = add(matvec(&wk, &h), &bk);
            if qk_norm {
                // Each head on its own, with one scale of the head size.
                let (qn, kn) = (t("attn_q_norm.weight"), t("attn_k_norm.weight"));
                q = q.chunks(hd).flat_map(|h| rms_norm(h, &qn, 1e-5)).collect();
                k = k.chunks(hd).flat_map(|h| rms_norm(h, &kn, 1e-5)).collect();
            }
            rope(&mut q, p, hd, base, neox);
            rope(&mut k, p, hd, base, neox);
            qs.push(q);
            ks.push(k);
            vs.push(add(matvec(&wv, &h), &bv));
        }
        for (p, x) in xs.iter_mut().enumerate() {
            let mut attn = vec![0.0; spec.n_heads * hd];
            for h in 0..spec.n_heads {
                let kvh = h / group;
                let q = &qs[p][h * hd..(h + 1) * hd];
                let first = (p + 1).saturating_sub(window);
                let scores: Vec<f64> = (first..=p)
                    .map(|j| {
                        q.iter()
                            .zip(&ks[j][kvh * hd..(kvh + 1) * hd])
                            .map(|(a, b)| a * b)
                            .sum::<f64>()
                            / (hd as f64).sqrt()
                    })
                    .collect();
                let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
                let sum: f64 = e.iter().sum();
                for (j, w) in (first..=p).zip(&e) {
                    for i in 0..hd {
                        attn[h * hd + i] += w / sum * vs[j][kvh * hd + i];
                    }
                }
            }
            let mut o = matvec(&wo, &attn);
            if gemma {
                o = rms_norm(&o, &t("post_attention_norm.weight"), 1e-5);
            }
            for (a, b) in x.iter_mut().zip(&o) {
                *a += b;
            }
            let h = rms_norm(x, &t("ffn_norm.weight"), 1e-5);
            let g = matvec(&t("ffn_gate.weight"), &h);
            let u = matvec(&t("ffn_up.weight"), &h);
            let act: Vec<f64> = g
                .iter()
                .zip(&u)
                .map(|(&g, u)| {
                    if gemma {
                        let c = (2.0 / std::f64::consts::PI).sqrt();
                        0.5 * g * (1.0 + (c * (g + 0.044715 * g * g * g)).tanh()) * u
                    } else {
                        g / (1.0 + (-g).exp()) * u
                    }
                })
                .collect();
            let mut down = matvec(&t("ffn_down.weight"), &act);
            if gemma {
                down = rms_norm(&down, &t("post_ffw_norm.weight"), 1e-5);
            }
            for (a, b) in x.iter_mut().zip(&down) {
                *a += b;
            }
        }
    }
    let norm = tensor(&file, "output_norm.weight");
    xs.iter()
        .map(|x| matvec(&out_w, &rms_norm(x, &norm, 1e-5)))
        .collect()
}

fn max_abs_diff(a: &[f32], b: &[f64]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (*x as f64 - y).abs())
        .fold(0.0, f64::max)
}

/// Logits of every position, with an f32 cache (the f64 reference keeps keys and values
/// exact; the default f16 cache is checked against the f32 one separately).
fn all_logits(model: &mut Model, ids: &[u32]) -> Vec<f32> {
    all_logits_with(model, ids, KvElement::F32)
}

fn all_logits_with(model: &mut Model, ids: &[u32], element: KvElement) -> Vec<f32> {
    let mut kv = DenseKv::with_element(model.kv_shape(), 64, element).unwrap();
    let positions: Vec<u32> = (0..ids.len() as u32).collect();
    model
        .forward(ids, &positions, &mut kv, None, Logits::All)
        .unwrap()
        .to_vec()
}

fn check_against_reference(spec: TinyModelSpec, tolerance: f64) {
    let ids = [72u32, 101, 108, 108, 111, 44, 32, 119, 256, 3];
    let reference = reference_logits(&spec, &ids);
    let mut model = load(&spec, 2);
    let got = all_logits(&mut model, &ids);
    let vocab = spec.vocab_size();
    for (p, want) in reference.iter().enumerate() {
        let row = &got[p * vocab..(p + 1) * vocab];
        let diff = max_abs_diff(row, want);
        assert!(
            diff < tolerance,
            "{} {:?}: position {p} differs by {diff}",
            spec.arch,
            spec.weight_type
        );
    }
}

/// The default f16 cache rounds keys and values to 11 significant bits: the logits move,
/// but only by that rounding's reach.
#[test]
fn f16_cache_stays_close_to_f32_cache() {
    let spec = TinyModelSpec {
        weight_type: GgmlType::F32,
        embd_type: GgmlType::F32,
        ..Default::default()
    };
    let ids = [72u32, 101, 108, 108, 111, 44, 32, 119, 256, 3];
    let mut model = load(&spec, 1);
    let exact = all_logits_with(&mut model, &ids, KvElement::F32);
    let half = all_logits_with(&mut model, &ids, KvElement::F16);
    let diff = exact
        .iter()
        .zip(&half)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    assert!(diff > 0.0, "the f16 cache rounds something");
    assert!(diff < 2e-2, "f16 cache moved a logit by {diff}");
}

// F32 weights keep f32 activations: only f32 rounding separates the engine from the
// f64 reference.
#[test]
fn llama_f32_matches_reference() {
    let spec = TinyModelSpec {
        weight_type: GgmlType::F32,
        embd_type: GgmlType::F32,
        tied: false,
        ..Default::default()
    };
    check_against_reference(spec, 1e-3);
}

// qwen3: a per-head RMSNorm of queries and keys before RoPE, a head size (32) that is
// not d_model / n_heads (16), no biases.
#[test]
fn qwen3_with_head_norms_and_key_length_matches_reference() {
    let spec = TinyModelSpec {
        arch: "qwen3".into(),
        head_dim: Some(32),
        weight_type: GgmlType::F32,
        embd_type: GgmlType::F32,
        ..Default::default()
    };
    check_against_reference(spec.clone(), 1e-3);
    check_against_reference(
        TinyModelSpec {
            weight_type: GgmlType::Q8_0,
            embd_type: GgmlType::Q8_0,
            ..spec
        },
        0.05,
    );
}

// gemma3: embeddings scaled, per-head Q/K norms, post-norms, GeGLU, queries scaled, and
// three layers of which the first and last slide a window of 4 over the ten tokens with
// their own RoPE base. The GELU goes through ggml's f16 table (about 2^-11 relative).
#[test]
fn gemma3_with_sliding_windows_matches_reference() {
    let spec = reference_spec("gemma3").unwrap();
    check_against_reference(spec.clone(), 1e-2);
    // A window wider than the text gives the same first four rows, bit for bit, and
    // other last rows: the test above does see the window.
    let wide = TinyModelSpec {
        sliding_window: spec.sliding_window.map(|(_, n, base)| (256, n, base)),
        ..spec.clone()
    };
    let ids = [72u32, 101, 108, 108, 111, 44, 32, 119, 256, 3];
    let windowed = all_logits(&mut load(&spec, 1), &ids);
    let full = all_logits(&mut load(&wide, 1), &ids);
    let vocab = spec.vocab_size();
    assert_eq!(windowed[..4 * vocab], full[..4 * vocab]);
    let diff = windowed[9 * vocab..]
        .iter()
        .zip(&full[9 * vocab..])
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    assert!(
        diff > 1e-2,
        "the window moved the last logits by only {diff}"
    );
}

// Llama with the SentencePiece vocabulary (TinyLlama / Mistral layout): the vocabulary
// changes only the table's rows.
#[test]
fn llama_with_a_sentencepiece_vocabulary_matches_reference() {
    let spec = ballast_runtime::testing::reference_spec("llama-spm").unwrap();
    check_against_reference(spec, 1e-3);
}

#[test]
fn qwen2_with_biases_and_neox_rope_matches_reference() {
    let spec = TinyModelSpec {
        arch: "qwen2".into(),
        weight_type: GgmlType::F32,
        embd_type: GgmlType::F32,
        ..Default::default()
    };
    check_against_reference(spec, 1e-3);
}

// Q8_0 weights: the activations are quantized to 8 bits before each product (as
// llama.cpp does), which costs about 1% relative error per product.
#[test]
fn llama_q8_0_matches_reference_within_activation_rounding() {
    check_against_reference(TinyModelSpec::default(), 0.05);
}

#[test]
fn llama_q4_k_runs_and_matches_reference_loosely() {
    let spec = TinyModelSpec {
        d_model: 256,
        n_heads: 4,
        n_kv_heads: 1,
        n_ff: 512,
        weight_type: GgmlType::Q4_K,
        embd_type: GgmlType::Q6_K,
        n_layers: 1,
        ..Default::default()
    };
    check_against_reference(spec, 0.1);
}

#[test]
fn thread_count_does_not_change_results() {
    let spec = TinyModelSpec::default();
    let ids = [1u32, 2, 3, 4, 5, 6, 7, 8, 9];
    let one = all_logits(&mut load(&spec, 1), &ids);
    let two = all_logits(&mut load(&spec, 2), &ids);
    let three = all_logits(&mut load(&spec, 3), &ids);
    assert_eq!(one, two);
    assert_eq!(one, three);
}

/// A batch's SwiGLU, large enough to be split over the threads (and of a length no
/// vector width divides), gives the one-thread bits.
#[test]
fn swiglu_on_threads_equals_one_thread() {
    use ballast_runtime::backend::ops::ElementwiseOps;
    let n = 70_001;
    let gate: Vec<f32> = (0..n)
        .map(|i| ((i * 37 % 1001) as f32 - 500.0) * 0.021)
        .collect();
    let up: Vec<f32> = (0..n)
        .map(|i| ((i * 11 % 97) as f32 - 48.0) * 0.13)
        .collect();
    let run = |threads| {
        let mut out = vec![f32::NAN; n];
        CpuBackend::new(threads)
            .swiglu(&gate, &up, &mut out)
            .unwrap();
        out.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
    };
    let one = run(1);
    assert_eq!(one, run(2));
    assert_eq!(one, run(3));
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    /// Prefill in chunks of any size, then decode, ends with the same logits as feeding
    /// one token at a time.
    #[test]
    fn chunked_prefill_equals_token_by_token(
        ids in proptest::collection::vec(0u32..TINY_VOCAB as u32, 1..40),
        batch in 1usize..17,
    ) {
        let spec = TinyModelSpec::default();
        let mut chunked = Session::new(load(&spec, 2), 64).unwrap();
        chunked.set_batch(batch);
        let a = chunked.feed(&ids).unwrap().to_vec();
        let mut single = Session::new(load(&spec, 1), 64).unwrap();
        let mut b = Vec::new();
        for &id in &ids {
            b = single.feed(&[id]).unwrap().to_vec();
        }
        let diff = a.iter().zip(&b).map(|(x, y)| (x - y).abs()).fold(0.0f32, f32::max);
        prop_assert!(diff < 1e-3, "differs by {}", diff);
    }
}

#[test]
fn a_full_context_is_an_error_naming_the_limit() {
    let mut session = Session::new(load(&TinyModelSpec::default(), 1), 8).unwrap();
    let err = session.feed(&[1; 9]).unwrap_err();
    assert!(
        matches!(
            err,
            Error::ContextFull {
                needed: 9,
                capacity: 8
            }
        ),
        "{err}"
    );
    session.feed(&[1; 8]).unwrap();
    assert!(matches!(
        session.feed(&[1]).unwrap_err(),
        Error::ContextFull { .. }
    ));
}

#[test]
fn a_token_outside_the_vocabulary_is_an_error() {
    let mut session = Session::new(load(&TinyModelSpec::default(), 1), 8).unwrap();
    let err = session.feed(&[TINY_VOCAB as u32]).unwrap_err();
    assert!(matches!(err, Error::TokenId { .. }), "{err}");
}

#[test]
fn an_unknown_architecture_is_named() {
    // The writer refuses it as the loader does; a llama file renamed is loaded.
    let spec = TinyModelSpec {
        arch: "mamba".into(),
        ..Default::default()
    };
    let err = spec.to_gguf_bytes().unwrap_err();
    assert!(err.to_string().contains("mamba"), "{err}");
    let name = Value::String("mamba".into());
    let file = with_metadata(&TinyModelSpec::default(), "general.architecture", name);
    let err = Model::load(file, Arc::new(CpuBackend::new(1)), false)
        .err()
        .unwrap();
    assert!(err.to_string().contains("mamba"), "{err}");
    assert!(err.to_string().contains("qwen3moe"), "{err}");
}

/// Every registered architecture is written by the test-model writer from its own
/// tables, loads through the registry, and runs a pass: what a new architecture gets
/// without a line in `testing.rs`.
#[test]
fn every_registered_architecture_writes_loads_and_runs() {
    for arch in ballast_runtime::arch::ARCHITECTURES {
        let required = arch.experts().is_some_and(|layout| layout.required);
        let spec = TinyModelSpec {
            arch: arch.name().into(),
            head_dim: Some(32),
            experts: required.then_some((4, 2, 32)),
            ..Default::default()
        };
        let mut session = Session::new(load(&spec, 1), 8).unwrap();
        let logits = session.feed(&[116, 105, 110, 121]).unwrap();
        assert_eq!(logits.len(), TINY_VOCAB, "{}", arch.name());
        assert!(logits.iter().all(|l| l.is_finite()), "{}", arch.name());
    }
    let names: std::collections::HashSet<_> = ballast_runtime::arch::ARCHITECTURES
        .iter()
        .map(|a| a.name())
        .collect();
    assert_eq!(names.len(), ballast_runtime::arch::ARCHITECTURES.len());
}

/// `spec`'s file with metadata `key` set to `value` (tensors unchanged).
fn with_metadata(spec: &TinyModelSpec, key: &str, value: Value) -> Arc<GgufFile> {
    let file = GgufFile::from_bytes(spec.to_gguf_bytes().unwrap()).unwrap();
    let mut w = GgufWriter::new();
    for (k, v) in file.metadata() {
        w.add_metadata(k.clone(), if k == key { value.clone() } else { v.clone() })
            .unwrap();
    }
    for t in file.tensors() {
        w.add_tensor(t.name.clone(), t.ty, &t.dims, file.tensor_data(t).to_vec())
            .unwrap();
    }
    Arc::new(GgufFile::from_bytes(w.to_bytes()).unwrap())
}

#[test]
fn a_missing_tensor_is_named() {
    // Two layers announced, one present.
    let spec = TinyModelSpec {
        n_layers: 1,
        ..Default::default()
    };
    let file = with_metadata(&spec, "llama.block_count", Value::U32(2));
    let err = Model::load(file, Arc::new(CpuBackend::new(1)), false)
        .err()
        .unwrap();
    assert!(err.to_string().contains("blk.1.attn_norm.weight"), "{err}");
}

#[test]
fn a_wrongly_shaped_tensor_is_named() {
    // An MLP width that the tensors were not made for.
    let file = with_metadata(
        &TinyModelSpec::default(),
        "llama.feed_forward_length",
        Value::U32(96),
    );
    let err = Model::load(file, Arc::new(CpuBackend::new(1)), false)
        .err()
        .unwrap();
    assert!(
        matches!(err, Error::TensorShape { ref tensor, .. } if tensor == "blk.0.ffn_gate.weight"),
        "{err}"
    );
}

/// `spec`'s file rewritten without the tensor `drop` and with `meta` overriding or
/// adding metadata values.
fn rewritten(spec: &TinyModelSpec, drop: &str, meta: &[(&str, Value)]) -> Arc<GgufFile> {
    let file = GgufFile::from_bytes(spec.to_gguf_bytes().unwrap()).unwrap();
    let mut w = GgufWriter::new();
    for (k, v) in file.metadata() {
        let v = meta
            .iter()
            .find(|(m, _)| m == k)
            .map_or(v.clone(), |(_, v)| v.clone());
        w.add_metadata(k.clone(), v).unwrap();
    }
    for (k, v) in meta {
        if !file.metadata().iter().any(|(m, _)| m == k) {
            w.add_metadata(*k, v.clone()).unwrap();
        }
    }
    for t in file.tensors().iter().filter(|t| t.name != drop) {
        w.add_tensor(&t.name, t.ty, &t.dims, file.tensor_data(t).to_vec())
            .unwrap();
    }
    Arc::new(GgufFile::from_bytes(w.to_bytes()).unwrap())
}

// A qwen3 file without a layer's head norm, with a head norm of the wrong size, or with
// a value head size other than the key's, is refused by an error naming it.
#[test]
fn a_qwen3_file_missing_or_misshaping_its_head_norms_is_a_named_error() {
    let spec = TinyModelSpec {
        arch: "qwen3".into(),
        head_dim: Some(32),
        n_layers: 2,
        ..Default::default()
    };
    let cpu = || -> Arc<dyn ballast_runtime::Backend> { Arc::new(CpuBackend::new(1)) };
    let file = rewritten(&spec, "blk.1.attn_k_norm.weight", &[]);
    match Model::load(file, cpu(), false).err().expect("refused") {
        Error::GgufMissingTensor { tensor, .. } => assert_eq!(tensor, "blk.1.attn_k_norm.weight"),
        other => panic!("unexpected: {other}"),
    }
    let file = rewritten(
        &spec,
        "",
        &[("qwen3.attention.value_length", Value::U32(16))],
    );
    match Model::load(file, cpu(), false).err().expect("refused") {
        Error::InvalidHyperParameter { key, .. } => {
            assert_eq!(key, "qwen3.attention.value_length")
        }
        other => panic!("unexpected: {other}"),
    }
    // key_length 16 makes the q norm of 32 the wrong size (and attn_q too: the first
    // tensor of the table that disagrees is named).
    let file = rewritten(
        &spec,
        "",
        &[
            ("qwen3.attention.key_length", Value::U32(16)),
            ("qwen3.attention.value_length", Value::U32(16)),
            ("qwen3.rope.dimension_count", Value::U32(16)),
        ],
    );
    match Model::load(file, cpu(), false).err().expect("refused") {
        Error::TensorShape { tensor, .. } => assert_eq!(tensor, "blk.0.attn_q.weight"),
        other => panic!("unexpected: {other}"),
    }
}

// A gemma3 file with a bad window, window pattern or unsupported feature, or without
// one of its norms, is refused by an error naming the key or tensor.
#[test]
fn a_malformed_gemma3_file_is_a_named_error() {
    let spec = reference_spec("gemma3").unwrap();
    let cpu = || -> Arc<dyn ballast_runtime::Backend> { Arc::new(CpuBackend::new(1)) };
    let key_error = |meta: &[(&str, Value)], want: &str| match Model::load(
        rewritten(&spec, "", meta),
        cpu(),
        false,
    )
    .err()
    .expect("refused")
    {
        Error::InvalidHyperParameter { key, why } => {
            assert_eq!(key, want, "{why}");
            eprintln!("{key}: {why}");
        }
        Error::GgufWrongType { key, .. } => assert_eq!(key, want),
        other => panic!("unexpected: {other}"),
    };
    // A window larger than the context.
    key_error(
        &[("gemma3.attention.sliding_window", Value::U32(4096))],
        "gemma3.attention.sliding_window",
    );
    // A window that is not a number.
    key_error(
        &[(
            "gemma3.attention.sliding_window",
            Value::String("wide".into()),
        )],
        "gemma3.attention.sliding_window",
    );
    // A per-layer pattern of the wrong length.
    key_error(
        &[(
            "gemma3.attention.sliding_window_pattern",
            Value::Array(ballast_runtime::gguf::Array::Bool(vec![true, false])),
        )],
        "gemma3.attention.sliding_window_pattern",
    );
    // A local RoPE base that is no base.
    key_error(
        &[("gemma3.rope.freq_base_swa", Value::F32(-1.0))],
        "gemma3.rope.freq_base_swa",
    );
    // Features this pass does not compute.
    key_error(
        &[("gemma3.final_logit_softcapping", Value::F32(30.0))],
        "gemma3.final_logit_softcapping",
    );
    key_error(
        &[
            ("gemma3.rope.scaling.type", Value::String("yarn".into())),
            ("gemma3.rope.scaling.factor", Value::F32(8.0)),
        ],
        "gemma3.rope.scaling.type",
    );
    key_error(
        &[("gemma3.rope.scaling.factor", Value::F32(-2.0))],
        "gemma3.rope.scaling.factor",
    );
    for missing in [
        "blk.1.post_attention_norm.weight",
        "blk.2.post_ffw_norm.weight",
        "blk.0.attn_q_norm.weight",
    ] {
        match Model::load(rewritten(&spec, missing, &[]), cpu(), false)
            .err()
            .expect("refused")
        {
            Error::GgufMissingTensor { tensor, .. } => assert_eq!(tensor, missing),
            other => panic!("unexpected: {other}"),
        }
    }
    // A per-layer pattern of the right length is read as given.
    let file = rewritten(
        &spec,
        "",
        &[(
            "gemma3.attention.sliding_window_pattern",
            Value::Array(ballast_runtime::gguf::Array::Bool(vec![false, true, true])),
        )],
    );
    let model = Model::load(file, cpu(), false).unwrap();
    let windows: Vec<Option<usize>> = model
        .config()
        .layer_attention
        .iter()
        .map(|a| a.shape.window)
        .collect();
    assert_eq!(windows, [None, Some(4), Some(4)]);
}

// A mixture-of-experts file with impossible expert counts, a variant this pass does not
// compute, or a missing or misshapen expert tensor is refused by an error naming the
// key or tensor; experts in an architecture without them are refused too.
#[test]
fn a_malformed_moe_file_is_a_named_error() {
    let cpu = || -> Arc<dyn ballast_runtime::Backend> { Arc::new(CpuBackend::new(1)) };
    let refusal = |spec: &TinyModelSpec, drop: &str, meta: &[(&str, Value)]| {
        Model::load(rewritten(spec, drop, meta), cpu(), false)
            .err()
            .expect("refused")
    };
    let (qwen3moe, qwen2moe, qwen3) = (
        reference_spec("qwen3moe").unwrap(),
        reference_spec("qwen2moe").unwrap(),
        reference_spec("qwen3").unwrap(),
    );
    // One key each: impossible counts, variants not computed, a zero-sized shared
    // expert, and experts in an architecture without them.
    for (spec, key, value) in [
        (&qwen3moe, "qwen3moe.expert_count", Value::U32(0)),
        (&qwen3moe, "qwen3moe.expert_used_count", Value::U32(9)),
        (&qwen3moe, "qwen3moe.expert_used_count", Value::U32(0)),
        (&qwen3moe, "qwen3moe.expert_shared_count", Value::U32(1)),
        (&qwen3moe, "qwen3moe.expert_gating_func", Value::U32(2)),
        (&qwen3moe, "qwen3moe.expert_weights_norm", Value::U32(1)),
        (
            &qwen2moe,
            "qwen2moe.expert_shared_feed_forward_length",
            Value::U32(0),
        ),
        (&qwen3, "qwen3.expert_count", Value::U32(4)),
    ] {
        match refusal(spec, "", &[(key, value)]) {
            Error::InvalidHyperParameter { key: got, why } => {
                assert_eq!(got, key, "{why}");
                eprintln!("{got}: {why}");
            }
            other => panic!("unexpected: {other}"),
        }
    }
    // A missing expert tensor, and qwen2moe without its shared expert's gate.
    for (spec, tensor) in [
        (&qwen3moe, "blk.1.ffn_up_exps.weight"),
        (&qwen2moe, "blk.0.ffn_gate_inp_shexp.weight"),
    ] {
        match refusal(spec, tensor, &[]) {
            Error::GgufMissingTensor { tensor: got, .. } => assert_eq!(got, tensor),
            other => panic!("unexpected: {other}"),
        }
    }
    // Experts half as wide as the tensors are.
    match refusal(
        &qwen3moe,
        "",
        &[("qwen3moe.expert_feed_forward_length", Value::U32(16))],
    ) {
        Error::TensorShape { tensor, .. } => assert_eq!(tensor, "blk.0.ffn_gate_exps.weight"),
        other => panic!("unexpected: {other}"),
    }
}

// Each token's experts: the most probable ones, renormalized; without renormalization
// the softmax probabilities themselves; a scale multiplies them.
#[test]
fn moe_routing_follows_the_file() {
    use ballast_runtime::moe::route;
    let mut spec = ballast_runtime::ModelConfig::from_gguf(
        &GgufFile::from_bytes(reference_spec("qwen3moe").unwrap().to_gguf_bytes().unwrap())
            .unwrap(),
    )
    .unwrap()
    .moe
    .expect("a mixture of experts");
    assert_eq!(
        (spec.n_expert, spec.n_expert_used, spec.n_ff_expert),
        (8, 2, 32)
    );
    assert!(spec.norm_weights && spec.weights_scale.is_none());
    let logits = [0.5f32, 3.0, -1.0, 2.0, 0.0, 0.0, 1.0, -2.0];
    let chosen = route(&spec, &logits);
    assert_eq!(chosen.iter().map(|c| c.0).collect::<Vec<_>>(), vec![1, 3]);
    let (a, b) = (chosen[0].1, chosen[1].1);
    assert!((a + b - 1.0).abs() < 1e-6 && (a / b - 1f32.exp()).abs() < 1e-5);
    spec.norm_weights = false;
    let total: f32 = logits.iter().map(|l| (l - 3.0).exp()).sum();
    let raw = route(&spec, &logits);
    assert!((raw[0].1 - 1.0 / total).abs() < 1e-6, "{raw:?}");
    spec.weights_scale = Some(2.5);
    let scaled = route(&spec, &logits);
    assert!((scaled[1].1 - 2.5 * raw[1].1).abs() < 1e-6);
}

// Only the chosen experts are computed: with a router that always picks experts 1 and
// 3, the other experts' matrices may hold NaN and the MLP's output does not change.
#[test]
fn moe_reads_only_the_chosen_experts() {
    use ballast_runtime::blocks::{FFN_DOWN_EXPS, FFN_GATE_EXPS, FFN_GATE_INP, FFN_UP_EXPS};
    use ballast_runtime::model::MoeSpec;
    use ballast_runtime::moe::MoeFfn;
    use ballast_runtime::weights::{LayerWeights, Weight, WeightBytes, WeightId};
    use ballast_runtime::FeedForward;
    let (d, ff, ne) = (32usize, 16usize, 4usize);
    let spec = MoeSpec {
        n_expert: ne,
        n_expert_used: 2,
        n_ff_expert: ff,
        norm_weights: true,
        weights_scale: None,
        shared_ff: None,
    };
    let f32_weight = |name: &str, dims: Vec<usize>, values: Vec<f32>| Weight {
        name: name.into(),
        id: WeightId::fresh(),
        ty: GgmlType::F32,
        dims,
        bytes: WeightBytes::from_vec(bytemuck::cast_slice(&values).to_vec()),
    };
    // Router rows: experts 1 and 3 see the (positive) input, the others its opposite.
    let mut router = vec![0f32; d * ne];
    for e in 0..ne {
        let sign = if e % 2 == 1 { 1.0 } else { -1.0 };
        router[e * d..(e + 1) * d].fill(sign * (1.0 + e as f32 * 0.1));
    }
    let layer = |unused: f32| {
        let stack = |per: usize| -> Vec<f32> {
            (0..per * ne)
                .map(|i| {
                    let e = i / per;
                    if e % 2 == 1 {
                        ((i * 7919) % 13) as f32 / 13.0 - 0.5
                    } else {
                        unused
                    }
                })
                .collect()
        };
        LayerWeights::new(
            0,
            vec![
                (
                    FFN_GATE_INP.into(),
                    f32_weight(FFN_GATE_INP, vec![d, ne], router.clone()),
                ),
                (
                    FFN_GATE_EXPS.into(),
                    f32_weight(FFN_GATE_EXPS, vec![d, ff, ne], stack(d * ff)),
                ),
                (
                    FFN_UP_EXPS.into(),
                    f32_weight(FFN_UP_EXPS, vec![d, ff, ne], stack(d * ff)),
                ),
                (
                    FFN_DOWN_EXPS.into(),
                    f32_weight(FFN_DOWN_EXPS, vec![ff, d, ne], stack(ff * d)),
                ),
            ],
            Vec::new(),
        )
    };
    let n = 3;
    let x: Vec<f32> = (0..n * d).map(|i| 0.1 + (i % 5) as f32 * 0.05).collect();
    let backend = CpuBackend::new(1);
    let run = |w: &LayerWeights| {
        let mut out = vec![0f32; n * d];
        MoeFfn::new(spec)
            .forward(&backend, w, &x, n, &mut out)
            .unwrap();
        out
    };
    let clean = run(&layer(0.0));
    let poisoned = run(&layer(f32::NAN));
    assert!(clean.iter().any(|&v| v != 0.0));
    assert_eq!(clean, poisoned);
}

// RoPE frequency factors of the wrong length or with a factor that divides by nothing
// are refused by an error naming the tensor.
#[test]
fn bad_rope_frequency_factors_are_a_named_error() {
    let spec = reference_spec("llama-freqs").unwrap();
    let file = GgufFile::from_bytes(spec.to_gguf_bytes().unwrap()).unwrap();
    let rebuilt = |factors: &[f32]| {
        let mut w = GgufWriter::new();
        for (k, v) in file.metadata() {
            w.add_metadata(k.clone(), v.clone()).unwrap();
        }
        for t in file.tensors() {
            if t.name == "rope_freqs.weight" {
                w.add_tensor_f32(&t.name, &[factors.len() as u64], factors)
                    .unwrap();
            } else {
                w.add_tensor(&t.name, t.ty, &t.dims, file.tensor_data(t).to_vec())
                    .unwrap();
            }
        }
        Arc::new(GgufFile::from_bytes(w.to_bytes()).unwrap())
    };
    let pairs = spec.head_dim() / 2;
    for (factors, what) in [
        (vec![1.0; pairs - 1], "one short"),
        (vec![0.0; pairs], "zero factors"),
        (vec![f32::NAN; pairs], "NaN factors"),
    ] {
        match Model::load(rebuilt(&factors), Arc::new(CpuBackend::new(1)), false)
            .err()
            .expect("refused")
        {
            Error::InvalidHyperParameter { key, .. } => {
                assert_eq!(key, "rope_freqs.weight", "{what}")
            }
            other => panic!("{what}: unexpected {other}"),
        }
    }
    // The factors as written load.
    let good: Vec<f32> = (0..pairs).map(|i| 1.0 + i as f32).collect();
    assert!(Model::load(rebuilt(&good), Arc::new(CpuBackend::new(1)), false).is_ok());
}

// A session of a sliding-window model keeps only the window on its windowed layers
// (`Session::with_batch` on the CPU) and computes what a cache keeping every token
// computes, bit for bit, through prompt chunks, decoding and rewinds.
#[test]
fn gemma3_windowed_cache_equals_a_full_one() {
    let spec = reference_spec("gemma3").unwrap();
    let ids: Vec<u32> = (0..40u32)
        .map(|i| (i * 37 + 11) % TINY_VOCAB as u32)
        .collect();
    let model = load(&spec, 1);
    let mut windowed = Session::with_batch(model.share(), 64, 3).unwrap();
    let full_kv = Box::new(DenseKv::new(model.kv_shape(), 64));
    let mut full = Session::with_cache(model, full_kv, None);
    full.set_batch(3);
    assert_eq!(
        windowed.feed(&ids[..20]).unwrap(),
        full.feed(&ids[..20]).unwrap()
    );
    for &id in &ids[20..30] {
        assert_eq!(windowed.feed(&[id]).unwrap(), full.feed(&[id]).unwrap());
    }
    // Layers 0 and 2 keep at most the window (4) plus a pass (3) less one.
    assert!(windowed.kv().view(0).len() <= 6);
    assert_eq!(windowed.kv().view(1).len(), 30);
    let (w, f) = (
        windowed.kv().held_bytes().total(),
        full.kv().held_bytes().total(),
    );
    assert!(w * 2 < f, "windowed {w} bytes, full {f}");
    // A rewind of a token is exact; past the floor the session starts over.
    assert_eq!(windowed.rewind(29), 29);
    full.rewind(29);
    assert_eq!(windowed.feed(&[5]).unwrap(), full.feed(&[5]).unwrap());
    assert_eq!(windowed.rewind(10), 0);
    assert!(windowed.tokens().is_empty());
    full.rewind(0);
    assert_eq!(
        windowed.feed(&ids[..12]).unwrap(),
        full.feed(&ids[..12]).unwrap()
    );
}

/// A head over part of the vocabulary (a draft model's, `Model::load_with_vocab`) gives
/// exactly the first logits of the whole head, tied to the embedding table or not, and
/// none is refused.
#[test]
fn a_head_over_part_of_the_vocabulary_gives_the_first_logits() {
    for tied in [false, true] {
        let spec = TinyModelSpec {
            tied,
            seed: 11,
            ..TinyModelSpec::default()
        };
        let file = Arc::new(GgufFile::from_bytes(spec.to_gguf_bytes().unwrap()).unwrap());
        let backend = Arc::new(CpuBackend::new(2));
        let mut full = Model::load(file.clone(), backend.clone(), false).unwrap();
        let vocab = full.config().vocab_size;
        let part = vocab / 3;
        let mut head = Model::load_with_vocab(file.clone(), backend.clone(), false, part).unwrap();
        assert_eq!(head.config().vocab_size, part);
        // A separate head counts its part only; a tied one is inside the table, which
        // is counted once, whole.
        let (held, whole) = (
            head.store().globals().byte_size(),
            full.store().globals().byte_size(),
        );
        let head_row = full.store().globals().output().row_bytes();
        match tied {
            false => assert_eq!(held, whole - (vocab - part) * head_row),
            true => assert_eq!(held, whole),
        }
        let ids = [3, 9, 27, 1, 40];
        let all = all_logits(&mut full, &ids);
        let got = all_logits(&mut head, &ids);
        assert_eq!(got.len(), ids.len() * part);
        for (row, want) in got.chunks(part).zip(all.chunks(vocab)) {
            assert_eq!(row, &want[..part], "tied {tied}");
        }
        // A draft's load (its matrices copied into RAM, the table left in the file)
        // computes the same.
        let mut draft = Model::load_draft(file.clone(), backend.clone(), part).unwrap();
        assert_eq!(all_logits(&mut draft, &ids), got, "tied {tied}");
        // A limit past the vocabulary keeps all of it; none at all is an error.
        let same = Model::load_with_vocab(file.clone(), backend.clone(), false, vocab + 5).unwrap();
        assert_eq!(same.config().vocab_size, vocab);
        assert!(Model::load_with_vocab(file, backend, false, 0).is_err());
    }
}
