//! The counters and gauges behind `GET /metrics`, in Prometheus' text format.

use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use ballast_runtime::TierBytes;

/// Counters the handlers and the scheduler bump; read by `GET /metrics`.
#[derive(Debug, Default)]
pub struct Metrics {
    /// Generation requests received.
    pub requests: AtomicU64,
    /// Requests answered with an error status.
    pub errors: AtomicU64,
    /// Generations whose client went away before the end.
    pub cancelled: AtomicU64,
    /// Prompt tokens computed.
    pub prompt_tokens: AtomicU64,
    /// Prompt tokens reused from a cache instead.
    pub cached_tokens: AtomicU64,
    /// Tokens generated.
    pub generated_tokens: AtomicU64,
    /// Time spent on prompt passes, nanoseconds.
    pub prompt_nanos: AtomicU64,
    /// Time spent on decode passes, nanoseconds.
    pub generation_nanos: AtomicU64,
    /// Forward passes (steps) run; each serves every sequence running then.
    pub steps: AtomicU64,
    /// Sequences served, summed over the steps (over `steps`: the mean batch).
    pub step_sequences: AtomicU64,
    /// Tokens the running sequences hold in their KV caches.
    pub kv_tokens: AtomicU64,
    /// Tokens all KV caches can hold.
    pub kv_capacity: AtomicU64,
    /// Bytes the KV caches hold, per tier (device, RAM, disk).
    pub kv_bytes: [AtomicU64; 3],
    /// Bytes the weight store holds, per tier.
    pub weight_bytes: [AtomicU64; 3],
    /// Bytes the weight store moved between tiers.
    pub weight_bytes_moved: AtomicU64,
    /// Weight bytes uploaded to the device (GPU) by the passes: streamed layers, once
    /// per step for every sequence in it.
    pub device_bytes_uploaded: AtomicU64,
    /// Tokens drafted for speculative verification passes.
    pub drafted_tokens: AtomicU64,
    /// Drafted tokens the model accepted.
    pub accepted_tokens: AtomicU64,
}

fn store(cell: &[AtomicU64; 3], b: TierBytes) {
    cell[0].store(b.device, Relaxed);
    cell[1].store(b.ram, Relaxed);
    cell[2].store(b.disk, Relaxed);
}

impl Metrics {
    /// Records what the weight store and the caches hold.
    pub fn set_bytes(&self, weights: TierBytes, moved: u64, kv: TierBytes) {
        store(&self.weight_bytes, weights);
        store(&self.kv_bytes, kv);
        self.weight_bytes_moved.store(moved, Relaxed);
    }

    /// Adds `d` to a nanosecond counter.
    pub fn add_time(cell: &AtomicU64, d: std::time::Duration) {
        cell.fetch_add(d.as_nanos().min(u64::MAX as u128) as u64, Relaxed);
    }

    /// The text exposition, with `waiting` requests in the queue and `running`
    /// sequences.
    pub fn render(&self, waiting: usize, running: usize) -> String {
        let mut out = String::new();
        let mut metric = |name: &str, kind: &str, help: &str, samples: &[(&str, f64)]| {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
            for (labels, v) in samples {
                let _ = writeln!(out, "{name}{labels} {v}");
            }
        };
        let get = |c: &AtomicU64| c.load(Relaxed) as f64;
        let per_s = |n: &AtomicU64, t: &AtomicU64| {
            let secs = get(t) / 1e9;
            if secs > 0.0 {
                get(n) / secs
            } else {
                0.0
            }
        };
        let tiers = |c: &[AtomicU64; 3]| {
            [
                ("{tier=\"device\"}", get(&c[0])),
                ("{tier=\"ram\"}", get(&c[1])),
                ("{tier=\"disk\"}", get(&c[2])),
            ]
        };
        metric(
            "ballast_requests_total",
            "counter",
            "Generation requests received.",
            &[("", get(&self.requests))],
        );
        metric(
            "ballast_request_errors_total",
            "counter",
            "Generation requests answered with an error status.",
            &[("", get(&self.errors))],
        );
        metric(
            "ballast_requests_cancelled_total",
            "counter",
            "Generations stopped because the client went away.",
            &[("", get(&self.cancelled))],
        );
        metric(
            "ballast_prompt_tokens_total",
            "counter",
            "Prompt tokens computed.",
            &[("", get(&self.prompt_tokens))],
        );
        metric(
            "ballast_prompt_tokens_cached_total",
            "counter",
            "Prompt tokens reused from an earlier request's KV cache.",
            &[("", get(&self.cached_tokens))],
        );
        metric(
            "ballast_generation_tokens_total",
            "counter",
            "Tokens generated.",
            &[("", get(&self.generated_tokens))],
        );
        metric(
            "ballast_draft_tokens_total",
            "counter",
            "Tokens drafted for speculative decoding (--draft).",
            &[("", get(&self.drafted_tokens))],
        );
        metric(
            "ballast_draft_tokens_accepted_total",
            "counter",
            "Drafted tokens the model accepted.",
            &[("", get(&self.accepted_tokens))],
        );
        let drafted = get(&self.drafted_tokens);
        metric(
            "ballast_draft_acceptance_ratio",
            "gauge",
            "Drafted tokens accepted over tokens drafted, 0 to 1, since the start (0 before \
             any draft).",
            &[(
                "",
                if drafted > 0.0 {
                    get(&self.accepted_tokens) / drafted
                } else {
                    0.0
                },
            )],
        );
        metric(
            "ballast_requests_waiting",
            "gauge",
            "Requests in the queue, not yet given a sequence (the Gateway API Inference \
             Extension's TotalQueuedRequests).",
            &[("", waiting as f64)],
        );
        metric(
            "ballast_requests_running",
            "gauge",
            "Sequences being processed.",
            &[("", running as f64)],
        );
        let capacity = get(&self.kv_capacity);
        metric(
            "ballast_kv_cache_usage_ratio",
            "gauge",
            "Fraction of the KV cache held by running sequences, 0 to 1 (the Gateway API \
             Inference Extension's KVCacheUtilization).",
            &[(
                "",
                if capacity > 0.0 {
                    get(&self.kv_tokens) / capacity
                } else {
                    0.0
                },
            )],
        );
        metric(
            "ballast_kv_cache_tokens",
            "gauge",
            "Tokens held in the KV caches of running sequences.",
            &[("", get(&self.kv_tokens))],
        );
        metric(
            "ballast_prompt_tokens_per_second",
            "gauge",
            "Prompt tokens per second of prompt processing, since the start.",
            &[("", per_s(&self.prompt_tokens, &self.prompt_nanos))],
        );
        metric(
            "ballast_generation_tokens_per_second",
            "gauge",
            "Generated tokens per second of decoding, since the start.",
            &[("", per_s(&self.generated_tokens, &self.generation_nanos))],
        );
        metric(
            "ballast_steps_total",
            "counter",
            "Forward passes run; one pass serves every running sequence (continuous \
             batching).",
            &[("", get(&self.steps))],
        );
        metric(
            "ballast_step_sequences_total",
            "counter",
            "Sequences served, summed over the passes: over ballast_steps_total, the mean \
             number of sequences per pass.",
            &[("", get(&self.step_sequences))],
        );
        metric(
            "ballast_weight_bytes",
            "gauge",
            "Bytes of weights held per memory tier.",
            &tiers(&self.weight_bytes),
        );
        metric(
            "ballast_weight_bytes_moved_total",
            "counter",
            "Bytes of weights moved between tiers (streamed layers).",
            &[("", get(&self.weight_bytes_moved))],
        );
        metric(
            "ballast_device_weight_bytes_uploaded_total",
            "counter",
            "Bytes of weights uploaded to the GPU by the passes (streamed layers; zero on \
             the CPU or when every layer is resident on the device).",
            &[("", get(&self.device_bytes_uploaded))],
        );
        metric(
            "ballast_kv_cache_bytes",
            "gauge",
            "Bytes the KV caches hold per memory tier.",
            &tiers(&self.kv_bytes),
        );
        out
    }
}
