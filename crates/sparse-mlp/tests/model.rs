//! The sparse MLP in a real forward pass on tiny random models: exact at sparsity 0,
//! at the calibrated sparsity elsewhere, fewer up-projection rows computed.

use ballast_runtime::ggml_type::GgmlType;
use ballast_runtime::weights::{Weight, WeightBytes, WeightId};
use ballast_runtime::CpuBackend;
use ballast_runtime::{Model, Session};
use ballast_sparse_mlp::{fit_attention_layer, SparseFfn};
use proptest::prelude::*;

mod common;
use common::{calibrate, calibrate_with_predictor, run, text, tiny, PROMPT};

fn model(seed: u64) -> Model {
    tiny(seed, ballast_runtime::ggml_type::GgmlType::Q8_0)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 6, ..ProptestConfig::default() })]

    /// At sparsity 0 the sparse MLP is the dense one, bit for bit, prompt and decode.
    #[test]
    fn sparsity_zero_is_dense_bit_for_bit(seed in any::<u64>()) {
        let dense = model(seed);
        let profile = calibrate(&dense, &PROMPT);
        let sparse = dense.share_with_ffn(Box::new(SparseFfn::new(profile.thresholds(0.0).unwrap())));
        let (a, b) = (run(dense, &PROMPT, 4), run(sparse, &PROMPT, 4));
        for (x, y) in a.iter().zip(&b) {
            prop_assert!(x.iter().zip(y).all(|(p, q)| p.to_bits() == q.to_bits()));
        }
    }
}

/// Calibrated to 50% on a text, the MLP skips about half the neurons on that text and
/// computes fewer up rows when decoding, and the logits move but stay close.
#[test]
fn calibrated_sparsity_skips_that_share_of_neurons() {
    let dense = model(3);
    let text: Vec<u32> = (0..48).map(|i| (i * 37 % 250) as u32 + 3).collect();
    let profile = calibrate(&dense, &text);
    assert_eq!(profile.layers.len(), 3);
    assert_eq!(profile.n_ff, 256);
    let ffn = SparseFfn::new(profile.thresholds(0.5).unwrap());
    let stats = ffn.stats();
    let mut session = Session::new(dense.share_with_ffn(Box::new(ffn)), 64).unwrap();
    session.feed(&text).unwrap();
    let s = *stats.lock().unwrap();
    assert!(
        (s.sparsity() - 0.5).abs() < 0.05,
        "{:.3} of the neurons skipped on the calibration text",
        s.sparsity()
    );
    let before = s.up_rows_computed;
    session.feed(&[5]).unwrap();
    let s = *stats.lock().unwrap();
    let decode_rows = s.up_rows_computed - before;
    assert!(
        decode_rows < 3 * 256 * 7 / 10,
        "one decoded token computed {decode_rows} of {} up rows",
        3 * 256
    );
    assert!(s.up_bytes_skipped > 0);

    let want = run(model(3), &PROMPT, 0).remove(0);
    let sparse =
        model(3).share_with_ffn(Box::new(SparseFfn::new(profile.thresholds(0.5).unwrap())));
    let got = run(sparse, &PROMPT, 0).remove(0);
    assert_ne!(got, want, "half the neurons skipped changes the logits");
    let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
    let diff = got
        .iter()
        .zip(&want)
        .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
    assert!(diff < scale, "logits moved by {diff} (scale {scale})");
}

/// A full-rank predictor is the gate itself (to f16): it loses almost no neuron, and
/// it skips gate rows while decoding. A low rank loses some, and recall says how many.
#[test]
fn predictor_recall_and_gate_rows_skipped() {
    let dense = model(5);
    let text = text();
    for (rank, least_recall) in [(64, 0.99), (8, 0.5)] {
        let profile = calibrate_with_predictor(&dense, &text, rank);
        let predictor = profile.predictor.clone().unwrap();
        assert_eq!(predictor.layers[0].rank(), rank);
        let ffn = SparseFfn::new(profile.thresholds(0.5).unwrap())
            .with_predictor(predictor, 1.0)
            .measure_recall();
        let stats = ffn.stats();
        let mut session = Session::new(dense.share_with_ffn(Box::new(ffn)), 64).unwrap();
        session.feed(&text[..16]).unwrap();
        for t in [7, 9, 11, 13] {
            session.feed(&[t]).unwrap();
        }
        let s = *stats.lock().unwrap();
        assert!(
            s.recall() >= least_recall,
            "rank {rank}: recall {:.3} ({} of {} lost)",
            s.recall(),
            s.missed,
            s.truly_active
        );
        assert!(s.truly_active > 0);
        assert!(
            s.gate_rows_computed < s.gate_rows,
            "rank {rank}: {} of {} gate rows computed",
            s.gate_rows_computed,
            s.gate_rows
        );
        assert!(s.predictor_bytes > 0 && s.gate_bytes_skipped > 0);
    }
}

/// With a margin so wide that every neuron is predicted, the predictor changes
/// nothing: the logits equal the sparse MLP's without it, bit for bit; and at sparsity
/// 0 it is not used at all (dense, bit for bit).
#[test]
fn predictor_that_keeps_everything_changes_nothing() {
    let dense = model(6);
    let profile = calibrate_with_predictor(&dense, &text(), 16);
    let predictor = profile.predictor.clone().unwrap();
    let thresholds = profile.thresholds(0.5).unwrap();
    let plain = run(
        dense.share_with_ffn(Box::new(SparseFfn::new(thresholds.clone()))),
        &PROMPT,
        3,
    );
    let wide = SparseFfn::new(thresholds).with_predictor(predictor.clone(), 1e6);
    let stats = wide.stats();
    let with = run(dense.share_with_ffn(Box::new(wide)), &PROMPT, 3);
    let s = *stats.lock().unwrap();
    assert_eq!(s.gate_rows_computed, s.gate_rows);
    for (a, b) in plain.iter().zip(&with) {
        assert!(a.iter().zip(b).all(|(p, q)| p.to_bits() == q.to_bits()));
    }
    let zero = SparseFfn::new(profile.thresholds(0.0).unwrap()).with_predictor(predictor, 0.0);
    let got = run(dense.share_with_ffn(Box::new(zero)), &PROMPT, 3);
    let want = run(dense, &PROMPT, 3);
    for (a, b) in want.iter().zip(&got) {
        assert!(a.iter().zip(b).all(|(p, q)| p.to_bits() == q.to_bits()));
    }
}

/// The attention-input fit is a (ridge) regression of the gate on the attention input:
/// when the MLP input is an exact linear map of it (`x = A a`), a full-rank fit predicts
/// the gate `W A a` from `a` alone, within the ridge's shrinkage and f16, and its error
/// scales are small.
#[test]
fn attention_fit_recovers_a_linear_map() {
    let (d, n_ff, samples) = (8usize, 16usize, 400usize);
    let mut seed = 0x9e37_79b9_u64;
    let mut next = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        (seed >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0
    };
    let w: Vec<f32> = (0..n_ff * d).map(|_| next() as f32).collect();
    let a_map: Vec<f64> = (0..d * d).map(|_| next()).collect();
    let inputs: Vec<Vec<f64>> = (0..samples)
        .map(|_| (0..d).map(|_| next()).collect())
        .collect();
    let mapped = |a: &[f64]| -> Vec<f64> {
        (0..d)
            .map(|i| (0..d).map(|j| a_map[i * d + j] * a[j]).sum())
            .collect()
    };
    let (mut aa, mut xa, mut xx) = (vec![0f64; d * d], vec![0f64; d * d], vec![0f64; d * d]);
    for a in &inputs {
        let x = mapped(a);
        for i in 0..d {
            for j in 0..d {
                aa[i * d + j] += a[i] * a[j] / samples as f64;
                xa[i * d + j] += x[i] * a[j] / samples as f64;
                xx[i * d + j] += x[i] * x[j] / samples as f64;
            }
        }
    }
    let gate = Weight {
        name: "gate".into(),
        id: WeightId::fresh(),
        ty: GgmlType::F32,
        dims: vec![d, n_ff],
        bytes: WeightBytes::from_vec(w.iter().flat_map(|v| v.to_le_bytes()).collect()),
    };
    let backend = CpuBackend::new(1);
    let p = fit_attention_layer(&backend, 0, &gate, &xx, &xa, &aa, d).unwrap();
    let (mut worst, mut scale) = (0f64, 0f64);
    for a in inputs.iter().take(20) {
        let x = mapped(a);
        let a32: Vec<f32> = a.iter().map(|&v| v as f32).collect();
        let (mut hidden, mut got) = (Vec::new(), vec![0f32; n_ff]);
        p.predict(&backend, &a32, 1, &mut hidden, &mut got).unwrap();
        for j in 0..n_ff {
            let want: f64 = (0..d).map(|i| f64::from(w[j * d + i]) * x[i]).sum();
            worst = worst.max((f64::from(got[j]) - want).abs());
            scale = scale.max(want.abs());
        }
    }
    assert!(
        worst < 0.05 * scale,
        "predictions off by {worst} (scale {scale})"
    );
    let sigma = p.sigma.iter().fold(0f32, |m, &s| m.max(s));
    assert!(
        f64::from(sigma) < 0.25 * scale,
        "error scale {sigma} (scale {scale})"
    );
}
