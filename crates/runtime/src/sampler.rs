//! Token sampling following llama.cpp's default sampler chain
//! (`common/sampling.cpp`): repetition penalty → top-k → top-p → min-p →
//! temperature → draw from the softmax with a seeded PRNG. Temperature `<= 0` is
//! greedy decoding.
//!
//! The random draws use a self-contained xoshiro256** generator, so a given seed
//! always gives the same samples (they are not the same draws as llama.cpp's
//! `std::mt19937`).
//!
//! # Example
//! ```
//! use ballast_runtime::sampler::{log_softmax_at, Sampler, SamplerConfig};
//!
//! let logits = [0.5f32, 3.0, -1.0, 2.5];
//! let mut greedy = Sampler::new(SamplerConfig { temperature: 0.0, ..SamplerConfig::default() });
//! assert_eq!(greedy.sample(&logits, &[]), 1);
//!
//! let mut a = Sampler::new(SamplerConfig { seed: 42, ..SamplerConfig::default() });
//! let mut b = Sampler::new(SamplerConfig { seed: 42, ..SamplerConfig::default() });
//! assert_eq!(a.sample(&logits, &[]), b.sample(&logits, &[]));
//!
//! assert!(log_softmax_at(&logits, 1) < 0.0);
//! ```

/// Sampling parameters. [`Default`] matches llama.cpp's CLI defaults.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SamplerConfig {
    /// Softmax temperature; `<= 0` means greedy (argmax, lowest id on exact ties).
    pub temperature: f32,
    /// Keep only the `top_k` most likely tokens; `0` disables.
    pub top_k: usize,
    /// Nucleus sampling: keep the smallest prefix whose probability mass reaches `top_p`; `>= 1` disables.
    pub top_p: f32,
    /// Drop tokens whose probability is below `min_p` times the most likely one's; `<= 0` disables.
    pub min_p: f32,
    /// Repetition penalty (positive logits divided, negative multiplied); `1.0` disables.
    pub repeat_penalty: f32,
    /// How many of the most recent history tokens the penalty looks at; `0` disables.
    pub repeat_last_n: usize,
    /// PRNG seed. The default, `0xFFFF_FFFF`, is llama.cpp's `LLAMA_DEFAULT_SEED`, which
    /// llama.cpp replaces by a random seed; here it is used as-is (callers wanting a random
    /// seed pick one themselves).
    pub seed: u64,
}

impl Default for SamplerConfig {
    fn default() -> SamplerConfig {
        SamplerConfig {
            temperature: 0.8,
            top_k: 40,
            top_p: 0.95,
            min_p: 0.05,
            repeat_penalty: 1.0,
            repeat_last_n: 64,
            seed: 0xFFFF_FFFF,
        }
    }
}

/// xoshiro256** PRNG seeded through splitmix64.
#[derive(Debug, Clone)]
struct Rng {
    s: [u64; 4],
}

impl Rng {
    fn new(seed: u64) -> Rng {
        let mut x = seed;
        let mut next = || {
            x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = x;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^ (z >> 31)
        };
        Rng {
            s: [next(), next(), next(), next()],
        }
    }

    fn next_u64(&mut self) -> u64 {
        let result = self.s[1].wrapping_mul(5).rotate_left(7).wrapping_mul(9);
        let t = self.s[1] << 17;
        self.s[2] ^= self.s[0];
        self.s[3] ^= self.s[1];
        self.s[1] ^= self.s[2];
        self.s[0] ^= self.s[3];
        self.s[2] ^= t;
        self.s[3] = self.s[3].rotate_left(45);
        result
    }

    /// Uniform in `[0, 1)` with 53 bits of precision.
    fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }
}

/// A stateful sampler (the PRNG state advances with every non-greedy draw).
#[derive(Debug, Clone)]
pub struct Sampler {
    config: SamplerConfig,
    rng: Rng,
}

#[derive(Debug, Clone, Copy)]
struct Candidate {
    id: u32,
    logit: f32,
}

/// Applies llama.cpp's repetition penalty in place: for every distinct token among the
/// last `last_n` of `history`, a positive logit is divided by `penalty` and a
/// non-positive one multiplied by it.
pub fn apply_repeat_penalty(logits: &mut [f32], history: &[u32], penalty: f32, last_n: usize) {
    if last_n == 0 || penalty == 1.0 {
        return;
    }
    let window = &history[history.len().saturating_sub(last_n)..];
    let mut seen = std::collections::HashSet::with_capacity(window.len());
    for &id in window {
        if !seen.insert(id) {
            continue;
        }
        if let Some(l) = logits.get_mut(id as usize) {
            if *l <= 0.0 {
                *l *= penalty;
            } else {
                *l /= penalty;
            }
        }
    }
}

/// Index of the largest finite-or-not logit, lowest index on exact ties; 0 if empty.
///
/// A greedy step runs this over the whole vocabulary (Gemma 3's 262,144 logits): the
/// one-at-a-time loop, whose every step waits on the previous best, took 8% of Gemma 3
/// 270M's decoded token. Without NaNs it takes sixteen running maxima, which the compiler
/// vectorizes, then the first index of their maximum: the same index. With a NaN the
/// plain loop decides ([`argmax_in_order`]).
pub fn argmax(logits: &[f32]) -> u32 {
    const LANES: usize = 16;
    let mut lanes = [f32::NEG_INFINITY; LANES];
    let mut nan = false;
    let chunks = logits.chunks_exact(LANES);
    let rest = chunks.remainder();
    for chunk in chunks {
        for (m, &x) in lanes.iter_mut().zip(chunk) {
            nan |= x.is_nan();
            *m = if x > *m { x } else { *m };
        }
    }
    for &x in rest {
        nan |= x.is_nan();
        lanes[0] = if x > lanes[0] { x } else { lanes[0] };
    }
    if nan {
        return argmax_in_order(logits);
    }
    let max = lanes
        .iter()
        .fold(f32::NEG_INFINITY, |a, &b| if b > a { b } else { a });
    // -0.0 == 0.0: the first of either, as the in-order loop (neither is greater).
    logits.iter().position(|&x| x == max).unwrap_or(0) as u32
}

/// [`argmax`] one logit at a time: a later logit wins when it is greater than the best so
/// far, or when the best so far is NaN.
pub fn argmax_in_order(logits: &[f32]) -> u32 {
    let mut best = 0usize;
    for (i, &l) in logits.iter().enumerate() {
        if l > logits[best] || logits[best].is_nan() {
            best = i;
        }
    }
    best as u32
}

impl Sampler {
    /// Creates a sampler; the PRNG is seeded from `config.seed`.
    pub fn new(config: SamplerConfig) -> Sampler {
        Sampler {
            config,
            rng: Rng::new(config.seed),
        }
    }

    /// The configuration in use.
    pub fn config(&self) -> &SamplerConfig {
        &self.config
    }

    /// Picks the next token from `logits` (one per vocabulary entry). `history` is every
    /// token seen so far (prompt and generated); its last `repeat_last_n` entries are
    /// penalized. Returns 0 for empty logits.
    pub fn sample(&mut self, logits: &[f32], history: &[u32]) -> u32 {
        if logits.is_empty() {
            return 0;
        }
        let penalized = self.penalized(logits, history);
        let logits = penalized.as_deref().unwrap_or(logits);
        if self.config.temperature <= 0.0 {
            return argmax(logits);
        }
        let dist = self.candidates(logits);
        self.draw(&dist)
    }

    /// The distribution [`Sampler::sample`] draws from: after the repetition penalty,
    /// top-k, top-p, min-p and temperature, the surviving tokens, most likely first,
    /// with their probabilities (summing to 1 up to rounding). Greedy decoding gives
    /// the argmax with probability 1. Empty for empty logits.
    pub fn distribution(&self, logits: &[f32], history: &[u32]) -> Distribution {
        if logits.is_empty() {
            return Distribution::default();
        }
        let penalized = self.penalized(logits, history);
        let logits = penalized.as_deref().unwrap_or(logits);
        if self.config.temperature <= 0.0 {
            return Distribution::certain(argmax(logits));
        }
        self.candidates(logits)
    }

    /// Draws a token from `dist` (as [`Sampler::sample`] does from its own); the most
    /// likely token of an empty or all-zero distribution's support, or 0.
    pub fn draw(&mut self, dist: &Distribution) -> u32 {
        let total: f64 = dist.probs.iter().sum();
        let r = self.rng.next_f64() * total;
        let mut cum = 0.0f64;
        for (&id, p) in dist.ids.iter().zip(&dist.probs) {
            cum += p;
            if r < cum {
                return id;
            }
        }
        dist.ids
            .iter()
            .zip(&dist.probs)
            .rev()
            .find(|(_, p)| **p > 0.0)
            .map_or(dist.ids.first().copied().unwrap_or(0), |(&id, _)| id)
    }

    /// A uniform draw in `[0, 1)` from the sampler's generator (speculative sampling's
    /// acceptance test).
    pub fn uniform(&mut self) -> f64 {
        self.rng.next_f64()
    }

    /// The logits after the repetition penalty, when it applies.
    fn penalized(&self, logits: &[f32], history: &[u32]) -> Option<Vec<f32>> {
        let cfg = self.config;
        (cfg.repeat_penalty != 1.0 && cfg.repeat_last_n > 0 && !history.is_empty()).then(|| {
            let mut penalized = logits.to_vec();
            apply_repeat_penalty(
                &mut penalized,
                history,
                cfg.repeat_penalty,
                cfg.repeat_last_n,
            );
            penalized
        })
    }

    /// top-k, top-p, min-p and temperature over non-empty `logits`.
    fn candidates(&self, logits: &[f32]) -> Distribution {
        let cfg = self.config;
        let mut cands: Vec<Candidate> = logits
            .iter()
            .enumerate()
            .map(|(i, &logit)| Candidate {
                id: i as u32,
                logit,
            })
            .collect();
        // Sort by logit descending, ties by id (deterministic).
        let by_logit =
            |a: &Candidate, b: &Candidate| b.logit.total_cmp(&a.logit).then(a.id.cmp(&b.id));

        // top-k
        if cfg.top_k > 0 && cfg.top_k < cands.len() {
            cands.select_nth_unstable_by(cfg.top_k - 1, by_logit);
            cands.truncate(cfg.top_k);
        }
        cands.sort_unstable_by(by_logit);

        // top-p (on the softmax of the current candidates; keeps at least one)
        if cfg.top_p < 1.0 {
            let probs = softmax(&cands);
            let mut cum = 0.0f64;
            let mut keep = cands.len();
            for (i, p) in probs.iter().enumerate() {
                cum += p;
                if cum >= cfg.top_p as f64 {
                    keep = i + 1;
                    break;
                }
            }
            cands.truncate(keep.max(1));
        }

        // min-p (in logit space: logit >= max_logit + ln(min_p); keeps at least one)
        if cfg.min_p > 0.0 && cands.len() > 1 {
            let min_logit = cands[0].logit + cfg.min_p.ln();
            let keep = cands.iter().take_while(|c| c.logit >= min_logit).count();
            cands.truncate(keep.max(1));
        }

        // temperature
        for c in &mut cands {
            c.logit /= cfg.temperature;
        }
        Distribution {
            probs: softmax(&cands),
            ids: cands.iter().map(|c| c.id).collect(),
        }
    }
}

/// Tokens and their probabilities, most likely first: what a [`Sampler`] draws from.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Distribution {
    /// The tokens with a non-zero chance.
    pub ids: Vec<u32>,
    /// Their probabilities, in the same order.
    pub probs: Vec<f64>,
}

impl Distribution {
    /// `id` with probability 1.
    pub fn certain(id: u32) -> Distribution {
        Distribution {
            ids: vec![id],
            probs: vec![1.0],
        }
    }

    /// The probability of `id` (0 outside the support).
    pub fn prob(&self, id: u32) -> f64 {
        self.ids
            .iter()
            .position(|&i| i == id)
            .map_or(0.0, |at| self.probs[at])
    }
}

/// Softmax over candidates (expects them sorted with the maximum first, or any order).
fn softmax(cands: &[Candidate]) -> Vec<f64> {
    let max = cands
        .iter()
        .map(|c| c.logit)
        .fold(f32::NEG_INFINITY, f32::max) as f64;
    if !max.is_finite() {
        // All -inf (or +inf present): put all mass on the maxima.
        let n = cands
            .iter()
            .filter(|c| c.logit as f64 == max)
            .count()
            .max(1) as f64;
        return cands
            .iter()
            .map(|c| if c.logit as f64 == max { 1.0 / n } else { 0.0 })
            .collect();
    }
    let exps: Vec<f64> = cands.iter().map(|c| (c.logit as f64 - max).exp()).collect();
    let sum: f64 = exps.iter().sum();
    exps.into_iter().map(|e| e / sum).collect()
}

/// Log-probability of token `id` under the softmax of `logits` (computed in f64 with the
/// max-subtraction trick). Returns `f32::NEG_INFINITY` for an out-of-range id.
pub fn log_softmax_at(logits: &[f32], id: u32) -> f32 {
    let Some(&x) = logits.get(id as usize) else {
        return f32::NEG_INFINITY;
    };
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    if !max.is_finite() {
        return if x as f64 == max {
            0.0
        } else {
            f32::NEG_INFINITY
        };
    }
    let sum: f64 = logits.iter().map(|&l| (l as f64 - max).exp()).sum();
    (x as f64 - max - sum.ln()) as f32
}
