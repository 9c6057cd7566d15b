//! Sampler tests.

use ballast_runtime::sampler::{
    apply_repeat_penalty, argmax, argmax_in_order, log_softmax_at, Sampler, SamplerConfig,
};
use proptest::prelude::*;

fn greedy() -> SamplerConfig {
    SamplerConfig {
        temperature: 0.0,
        ..SamplerConfig::default()
    }
}

#[test]
fn defaults_match_llama_cpp_cli() {
    let c = SamplerConfig::default();
    assert_eq!(
        (c.temperature, c.top_k, c.top_p, c.min_p),
        (0.8, 40, 0.95, 0.05)
    );
    assert_eq!((c.repeat_penalty, c.repeat_last_n), (1.0, 64));
}

#[test]
fn greedy_is_argmax_lowest_id_on_ties() {
    let mut s = Sampler::new(greedy());
    assert_eq!(s.sample(&[0.1, 2.0, -3.0, 1.9], &[]), 1);
    assert_eq!(s.sample(&[1.0, 5.0, 5.0, 5.0], &[]), 1);
    assert_eq!(s.sample(&[-1.0], &[]), 0);
}

#[test]
fn same_seed_same_sequence() {
    let logits: Vec<f32> = (0..100).map(|i| ((i * 37 % 11) as f32) * 0.3).collect();
    let cfg = SamplerConfig {
        temperature: 1.5,
        top_k: 0,
        top_p: 1.0,
        min_p: 0.0,
        seed: 7,
        ..SamplerConfig::default()
    };
    let run = |cfg| {
        let mut s = Sampler::new(cfg);
        (0..50).map(|_| s.sample(&logits, &[])).collect::<Vec<_>>()
    };
    let a = run(cfg);
    assert_eq!(a, run(cfg));
    assert_ne!(a, run(SamplerConfig { seed: 8, ..cfg }));
    assert!(
        a.iter().collect::<std::collections::HashSet<_>>().len() > 1,
        "should not be degenerate"
    );
}

#[test]
fn top_k_one_equals_greedy() {
    let logits = [0.3f32, 0.2, 0.9, 0.85, -1.0];
    let mut g = Sampler::new(greedy());
    let mut k1 = Sampler::new(SamplerConfig {
        top_k: 1,
        temperature: 2.0,
        seed: 3,
        ..SamplerConfig::default()
    });
    for _ in 0..20 {
        assert_eq!(k1.sample(&logits, &[]), g.sample(&logits, &[]));
    }
}

#[test]
fn repetition_penalty_like_llama_cpp() {
    let mut logits = vec![2.0f32, -2.0, 1.0, 0.0];
    apply_repeat_penalty(&mut logits, &[0, 1, 1, 3], 2.0, 64);
    assert_eq!(logits, vec![1.0, -4.0, 1.0, 0.0]);
    // Only the last `last_n` tokens count.
    let mut logits = vec![2.0f32, -2.0];
    apply_repeat_penalty(&mut logits, &[0, 1], 2.0, 1);
    assert_eq!(logits, vec![2.0, -4.0]);
    // Greedy sees penalized logits.
    let cfg = SamplerConfig {
        temperature: 0.0,
        repeat_penalty: 4.0,
        ..SamplerConfig::default()
    };
    assert_eq!(Sampler::new(cfg).sample(&[3.0, 2.0], &[0]), 1);
}

#[test]
fn log_softmax_is_stable() {
    let l = [1000.0f32, 1000.0];
    assert!((log_softmax_at(&l, 0) - (-std::f32::consts::LN_2)).abs() < 1e-6);
    let l = [0.0f32, -1e30, 5.0];
    let total: f64 = (0..3).map(|i| (log_softmax_at(&l, i) as f64).exp()).sum();
    assert!((total - 1.0).abs() < 1e-6);
    assert_eq!(log_softmax_at(&l, 9), f32::NEG_INFINITY);
}

fn probs(logits: &[f32]) -> Vec<f64> {
    let m = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let e: Vec<f64> = logits.iter().map(|&l| (l as f64 - m).exp()).collect();
    let s: f64 = e.iter().sum();
    e.into_iter().map(|x| x / s).collect()
}

/// A logit drawn mostly from a few values (so that ties are common), with infinities,
/// signed zeros and, rarely, NaN.
fn tricky_logit() -> impl Strategy<Value = f32> {
    prop_oneof![
        8 => (-3i32..4).prop_map(|v| v as f32),
        4 => -100.0f32..100.0,
        1 => Just(0.0f32),
        1 => Just(-0.0f32),
        1 => Just(f32::INFINITY),
        1 => Just(f32::NEG_INFINITY),
        1 => Just(f32::NAN),
    ]
}

proptest! {
    /// The vectorized argmax picks the index the in-order loop picks, ties, signed zeros,
    /// infinities and NaNs included, at lengths around its 16-lane chunks.
    #[test]
    fn argmax_equals_the_in_order_loop(
        logits in proptest::collection::vec(tricky_logit(), 0..80),
        nan_free in any::<bool>(),
    ) {
        let logits: Vec<f32> = if nan_free {
            logits.into_iter().map(|x| if x.is_nan() { 1.5 } else { x }).collect()
        } else {
            logits
        };
        prop_assert_eq!(argmax(&logits), argmax_in_order(&logits));
    }

    #[test]
    fn sampled_token_survives_filters(
        logits in proptest::collection::vec(-10.0f32..10.0, 1..200),
        top_k in 0usize..20,
        top_p in 0.1f32..1.0,
        min_p in 0.0f32..0.5,
        temperature in 0.1f32..3.0,
        seed in any::<u64>(),
    ) {
        let cfg = SamplerConfig { temperature, top_k, top_p, min_p, repeat_penalty: 1.0, repeat_last_n: 64, seed };
        let mut s = Sampler::new(cfg);
        let p = probs(&logits);
        let pmax = p.iter().copied().fold(0.0, f64::max);
        for _ in 0..5 {
            let id = s.sample(&logits, &[]) as usize;
            prop_assert!(id < logits.len());
            // never outside top-k
            if top_k > 0 {
                let better = logits.iter().filter(|&&l| l > logits[id]).count();
                prop_assert!(better < top_k);
            }
            // never below min_p * p_max (small tolerance for float rounding)
            prop_assert!(p[id] >= (min_p as f64) * pmax * (1.0 - 1e-4));
            // never outside the top-p nucleus: mass strictly above it is below top_p
            let above: f64 = p.iter().filter(|&&q| q > p[id]).sum();
            prop_assert!(above < top_p as f64 + 1e-6);
        }
    }

    #[test]
    fn greedy_property(logits in proptest::collection::vec(-100.0f32..100.0, 1..300)) {
        let id = Sampler::new(SamplerConfig { temperature: 0.0, ..SamplerConfig::default() }).sample(&logits, &[]) as usize;
        prop_assert!(logits.iter().all(|&l| l <= logits[id]));
        prop_assert!(logits[..id].iter().all(|&l| l < logits[id]));
    }
}
