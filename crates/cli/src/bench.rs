//! `ballast bench`: prompt-processing and generation speed, with llama-bench's flags.

use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use ballast_runtime::backend::OpTimesSnapshot;
use ballast_runtime::backend::PassReport;
use ballast_runtime::generate::{Drafter, SpeculationStats};
use ballast_runtime::gpu::DeviceChoice;
use ballast_runtime::memory::peak_rss_kib;
use ballast_runtime::{GenerateOptions, Generator, SamplerConfig, Session, Step, Tokenizer};
use clap::Args;
use serde_json::json;

use crate::common::{self, human_bytes};
use crate::draft::DraftArgs;
use crate::tiered::{self, StoreArgs, StoreKind};
use ballast_kv_cache::{KvElement, UpdateMode};
use ballast_runtime::blocks::{FFN_DOWN, FFN_GATE, FFN_UP};

/// Flags of `ballast bench` (as llama-bench's).
#[derive(Args, Debug)]
pub struct BenchArgs {
    /// GGUF model file. Default: the default model, fetched on first use.
    #[arg(short = 'm', long)]
    pub model: Option<std::path::PathBuf>,
    #[command(flatten)]
    pub sparse: crate::common::SparsityArgs,
    /// Prompt tokens to process per repetition (0 to skip).
    #[arg(short = 'p', long = "n-prompt", default_value_t = 512)]
    pub n_prompt: usize,
    /// Tokens to generate per repetition (0 to skip).
    #[arg(short = 'n', long = "n-gen", default_value_t = 128)]
    pub n_gen: usize,
    /// Tokens already in the KV cache before each test (llama-bench's depth): decode
    /// at depth is where attention costs most.
    #[arg(short = 'd', long = "n-depth", default_value_t = 0)]
    pub n_depth: usize,
    /// Repetitions of each test.
    #[arg(short = 'r', long = "repetitions", default_value_t = 5)]
    pub repetitions: usize,
    /// Thread counts to test, comma-separated (e.g. 1,2).
    #[arg(short = 't', long = "threads", value_delimiter = ',')]
    pub threads: Vec<usize>,
    /// Read the weights into RAM instead of memory-mapping the file.
    #[arg(long)]
    pub no_mmap: bool,
    /// Print one JSON object per test instead of a table.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub store: StoreArgs,
    /// Where to compute: cpu, gpu or auto (see `ballast run --help`). On a GPU the
    /// thread count only matters to the host side, and the bench also reports device
    /// memory, bytes moved per decoded token and time per kernel.
    #[arg(long, default_value = "cpu", value_parser = common::parse_device)]
    pub device: DeviceChoice,
    /// With `--draft`, a speculative test besides pp and tg: `-n` greedy tokens after
    /// a built-in prompt (a code prompt for a draft model, an editing prompt for
    /// `ngram`), decoded plainly and speculatively in turn, `-r` times each.
    #[command(flatten)]
    pub draft: DraftArgs,
    /// The speculative test's prompt, instead of the built-in one.
    #[arg(long, value_name = "FILE", requires = "draft")]
    pub prompt_file: Option<std::path::PathBuf>,
}

struct TestResult {
    test: String,
    threads: usize,
    tokens_per_s: Vec<f64>,
    per_token: Option<OpTimesSnapshot>,
    io: Option<IoFigures>,
}

/// What a generation test moved, per token.
/// What the sparse MLP did over the decode test of one thread count.
struct SparseFigures {
    threads: usize,
    sparsity: f32,
    /// Fraction of (token, neuron) pairs skipped.
    skipped: f64,
    /// MLP weight bytes read per decoded token, and a dense MLP's.
    mlp_bytes_per_token: f64,
    dense_mlp_bytes: u64,
    /// Fraction of the gate rows computed (1 without a predictor).
    gate_rows_computed: f64,
    /// The predictor's recall while decoding, when measured.
    recall: Option<f64>,
    /// Fraction of the down projection's input blocks whose neurons were all skipped.
    idle_down_blocks: f64,
    /// Neuron mode: (fraction of active neurons found in the cache, record bytes
    /// fetched per decoded token).
    neurons: Option<(f64, f64)>,
    /// Neuron mode with the prefetch: per decoded token, the records fetched during
    /// attention, the fraction of them the MLP then used, their bytes, and the records
    /// still fetched in the MLP (the predictor's misses the cache lacked).
    prefetch: Option<PrefetchFigures>,
}

struct PrefetchFigures {
    prefetched: f64,
    used: f64,
    bytes: f64,
    fetched_in_mlp: f64,
}

struct IoFigures {
    /// `read_bytes` of /proc/self/io (any store: page faults count too).
    process_read_per_token: Option<f64>,
    /// Tiered streaming's own figures and the plan's bound from measured speeds.
    streaming: Option<StreamingFigures>,
}

struct StreamingFigures {
    disk_bytes_per_token: f64,
    /// Of a mixture of experts streamed expert by expert.
    expert_bytes_per_token: f64,
    expert_chosen_per_token: f64,
    expert_missed_per_token: f64,
    expert_hit_rate: f64,
    expert_stall_ms: f64,
    non_resident_bytes: u64,
    /// The plan's layers: one letter each (A resident, B held coded in RAM, C disk).
    layer_map: String,
    /// Bytes of the layers held coded in RAM.
    coded_ram_bytes: u64,
    stall_ms: f64,
    read_ms: f64,
    disk_bytes_per_s: f64,
    /// The plan's bound, from the compute and disk speeds measured in the run: `None`
    /// on a device backend, whose whole-pass submissions time no op on the host (and
    /// whose host-to-device speed is not measured).
    bound: Option<PlanBound>,
}

struct PlanBound {
    compute_bytes_per_s: f64,
    predicted_ms: f64,
    bottleneck: &'static str,
}

fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    let n = s.len();
    if n == 0 {
        0.0
    } else if n % 2 == 1 {
        s[n / 2]
    } else {
        (s[n / 2 - 1] + s[n / 2]) / 2.0
    }
}

/// Deterministic pseudo-random prompt tokens (llama-bench also uses random tokens).
fn prompt_tokens(n: usize, vocab: usize) -> Vec<u32> {
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    (0..n)
        .map(|_| {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((state >> 33) % vocab as u64) as u32
        })
        .collect()
}

fn per_token(t: OpTimesSnapshot, n: usize) -> OpTimesSnapshot {
    let n = n.max(1) as u32;
    OpTimesSnapshot {
        matmul: t.matmul / n,
        attention: t.attention / n,
        other: t.other / n,
        regions: t.regions / n as u64,
        thread_wait: t.thread_wait / n,
    }
}

pub fn run(mut args: BenchArgs) -> Result<()> {
    let path = common::resolve_model(args.model.as_deref())?;
    let mapped = !args.no_mmap && args.store.store != StoreKind::Ram;
    let opened = ballast::open_model(&path, mapped, args.store.store)?;
    let file = opened.file.clone();
    let threads = if args.threads.is_empty() {
        vec![common::threads(None)]
    } else {
        args.threads.clone()
    };
    anyhow::ensure!(args.repetitions > 0, "-r must be at least 1");
    let size: u64 = file.tensors().iter().map(|t| t.n_bytes).sum();
    let speculative = match args.draft.draft.as_deref() {
        Some(draft) => Some(SpecPrompt::new(
            draft,
            args.prompt_file.as_deref(),
            &Tokenizer::from_gguf(&file)?,
        )?),
        None => None,
    };
    let depth = args.n_depth;
    // The speculative test's prompt, its tokens and a draft beyond them.
    let spec_ctx = speculative
        .as_ref()
        .map_or(0, |s| s.ids.len() + args.n_gen + args.draft.draft_max + 2);
    let ctx = (depth + args.n_prompt.max(args.n_gen) + 1).max(spec_ctx);
    // Prompt tokens per pass: the pp test's, and chunks of up to 512 to fill the depth;
    // a verification pass scores a whole draft at once.
    let verify = speculative.as_ref().map_or(1, |_| args.draft.draft_max + 1);
    let batch = args.n_prompt.max(depth.min(512)).max(verify);
    // A resident draft model shares the RAM budget with the model.
    args.store.beside = args.draft.resident_bytes(ctx)?;
    let mut spec_results: Vec<SpecResult> = Vec::new();
    let mut results = Vec::new();
    let mut backend_name = String::new();
    let mut store_name = "";
    let mut plan_text = None;
    let mut budget_text: Option<String> = None;
    // One spinner line on stderr while the tests run; stdout holds only the results.
    let progress = indicatif::ProgressBar::new_spinner();
    progress.enable_steady_tick(std::time::Duration::from_millis(120));
    let mut device_report: Option<DeviceReport> = None;
    let mut sparse_figures: Vec<SparseFigures> = Vec::new();
    // Tokens cached and KV bytes held at the end of the last decode run.
    let mut kv_held: Option<(usize, u64)> = None;
    for &t in &threads {
        let engine = ballast::Engine::builder(&path)
            .opened(opened.clone())
            .device(args.device)
            .threads(t)
            .mmap(!args.no_mmap)
            .store_options(args.store.options())
            .sparse(args.sparse.options())
            .context(ctx)
            .batch(batch)
            .build()
            .map_err(|e| match e {
                // The context is -d plus the longer of -p and -n, plus one.
                ballast::Error::ContextTooLong(c) => anyhow::anyhow!(
                    "-d {depth} with -p {} / -n {} need a context of {} tokens, which does not fit the RAM budget of {} ({}); {} tokens do: lower -d plus the larger of -p and -n to at most {}\n  ({})",
                    args.n_prompt,
                    args.n_gen,
                    c.ctx,
                    human_bytes(c.budget),
                    c.budget_source,
                    c.fits,
                    c.fits.saturating_sub(1),
                    c.refusal
                ),
                e => e.into(),
            })?;
        let report = engine.report().clone();
        report
            .device_notes
            .iter()
            .for_each(|line| eprintln!("{line}"));
        if let Some(ram) = &report.ram_budget {
            budget_text.get_or_insert_with(|| {
                format!("RAM budget {} ({})", human_bytes(ram.bytes), ram.source)
            });
        }
        let tokenizer = engine.tokenizer().clone();
        let (model, sparse) = (engine.into_model(), report.sparse);
        let backend = model.backend().clone();
        let on_device = backend.executor().is_some();
        // Dense MLP weight bytes a decoded token reads, for the sparse MLP's figures.
        let dense_mlp_bytes: u64 = file
            .tensors()
            .iter()
            .filter(|t| {
                [FFN_GATE, FFN_UP, FFN_DOWN]
                    .iter()
                    .any(|r| t.name.ends_with(r))
            })
            .map(|t| t.n_bytes)
            .sum();
        let tiered_info = report.tiered;
        store_name = report.store;
        if let Some(info) = &tiered_info {
            plan_text.get_or_insert_with(|| {
                format!(
                    "{}disk reads: {}\n",
                    tiered::describe(&info.plan, None, None),
                    info.read_mode
                )
            });
        }
        backend_name = model.backend().name();
        let vocab = model.config().vocab_size;
        let session = Session::with_batch(model, ctx, batch)?;
        // Every test goes through the generation loop: pp is its prompt, tg its greedy
        // decoding of -n tokens, one pass each.
        let mut generator = Generator::new(session, tokenizer.clone(), greedy(args.n_gen))?;
        // The context every test starts from: `depth` tokens, processed once per thread
        // count; each repetition rewinds to it.
        let at_depth = |test: String| {
            if depth > 0 {
                format!("{test} @ d{depth}")
            } else {
                test
            }
        };
        if depth > 0 {
            progress.set_message(format!(
                "filling the context to depth {depth} at {t} threads"
            ));
            generator.prompt(&prompt_tokens(depth, vocab))?;
        }
        if args.n_prompt > 0 {
            progress.set_message(format!("pp{} at {t} threads", args.n_prompt));
            generator.session_mut().set_batch(args.n_prompt);
            let prompt = prompt_tokens(args.n_prompt, vocab);
            generator.prompt(&prompt)?; // warm-up
            let mut speeds = Vec::new();
            for _ in 0..args.repetitions {
                generator.session_mut().rewind(depth);
                let start = Instant::now();
                generator.prompt(&prompt)?;
                speeds.push(args.n_prompt as f64 / start.elapsed().as_secs_f64());
            }
            results.push(TestResult {
                test: at_depth(format!("pp{}", args.n_prompt)),
                threads: t,
                tokens_per_s: speeds,
                per_token: None,
                io: None,
            });
        }
        if args.n_gen > 0 {
            progress.set_message(format!("tg{} at {t} threads", args.n_gen));
            // A one-token prompt, then a token per pass: -n passes.
            let first = prompt_tokens(1, vocab);
            generator.session_mut().rewind(depth);
            generator.prompt(&first)?; // warm-up
            let mut speeds = Vec::new();
            let mut busy = OpTimesSnapshot::default();
            let mut wall = Duration::ZERO;
            let stream_before = tiered_info.as_ref().map(|i| i.stats.get());
            let read_before = ballast_tier_stream::io::process_read_bytes();
            let sparse_before = sparse
                .as_ref()
                .map(|s| *s.lock().unwrap_or_else(|p| p.into_inner()));
            for _ in 0..args.repetitions {
                generator.session_mut().rewind(depth);
                backend.telemetry().op_times().reset();
                let start = Instant::now();
                // On a device, greedy decoding reads back one id per token.
                generator.prompt(&first)?;
                let generated = decode(&mut generator)?.len();
                let elapsed = start.elapsed();
                anyhow::ensure!(
                    generated == args.n_gen,
                    "tg{} generated {generated} tokens",
                    args.n_gen
                );
                wall += elapsed;
                let kv = generator.session().kv();
                kv_held = Some((kv.len(), kv.held_bytes().total()));
                let s = backend.telemetry().op_times().snapshot();
                busy.matmul += s.matmul;
                busy.attention += s.attention;
                busy.other += s.other;
                busy.regions += s.regions;
                busy.thread_wait += s.thread_wait;
                speeds.push(args.n_gen as f64 / elapsed.as_secs_f64());
            }
            let n = args.n_gen * args.repetitions;
            if let (Some(now), Some(before)) = (
                sparse
                    .as_ref()
                    .map(|s| *s.lock().unwrap_or_else(|p| p.into_inner())),
                sparse_before,
            ) {
                sparse_figures.push(SparseFigures {
                    threads: t,
                    sparsity: args.sparse.sparsity.unwrap_or(0.0),
                    skipped: 1.0
                        - (now.active - before.active) as f64
                            / (now.neurons - before.neurons).max(1) as f64,
                    mlp_bytes_per_token: dense_mlp_bytes as f64
                        - (now.bytes_saved() - before.bytes_saved()) as f64 / n as f64,
                    gate_rows_computed: (now.gate_rows_computed - before.gate_rows_computed) as f64
                        / (now.gate_rows - before.gate_rows).max(1) as f64,
                    recall: (now.truly_active > before.truly_active).then(|| {
                        1.0 - (now.missed - before.missed) as f64
                            / (now.truly_active - before.truly_active) as f64
                    }),
                    dense_mlp_bytes,
                    idle_down_blocks: (now.down_blocks_idle - before.down_blocks_idle) as f64
                        / (now.down_blocks - before.down_blocks).max(1) as f64,
                    neurons: {
                        let (hits, misses) = (
                            now.neuron_hits - before.neuron_hits,
                            now.neuron_misses - before.neuron_misses,
                        );
                        (hits + misses > 0).then(|| {
                            (
                                hits as f64 / (hits + misses) as f64,
                                (now.bytes_fetched - before.bytes_fetched) as f64 / n as f64,
                            )
                        })
                    },
                    prefetch: {
                        let prefetched = now.prefetched - before.prefetched;
                        (prefetched > 0 || now.truly_active > before.truly_active).then(|| {
                            PrefetchFigures {
                                prefetched: prefetched as f64 / n as f64,
                                used: (now.prefetch_used - before.prefetch_used) as f64
                                    / prefetched.max(1) as f64,
                                bytes: (now.prefetch_bytes - before.prefetch_bytes) as f64
                                    / n as f64,
                                fetched_in_mlp: (now.neuron_misses - before.neuron_misses) as f64
                                    / n as f64,
                            }
                        })
                    },
                });
            }
            let process_read_per_token = ballast_tier_stream::io::process_read_bytes()
                .zip(read_before)
                .map(|(a, b)| (a - b) as f64 / n as f64);
            let streaming = tiered_info
                .as_ref()
                .zip(stream_before)
                .map(|(info, before)| {
                    let m = tiered::measured(before, info.stats.get(), n);
                    // The plan's bound from the speeds measured in this run: compute from
                    // the backend's busy time per token, disk from the readers' time.
                    let busy_s =
                        (busy.matmul + busy.attention + busy.other).as_secs_f64() / n as f64;
                    let weights = info.shape.total_computed_bytes() + info.shape.head_bytes;
                    let bound = (info.plan.unified && busy_s > 0.0).then(|| {
                        let compute = weights as f64 / busy_s;
                        let speeds = ballast_tier_stream::Speeds {
                            compute_bytes_per_s: compute,
                            h2d_bytes_per_s: 0.0,
                            disk_bytes_per_s: m.disk_bytes_per_s,
                        };
                        // Attention is in the measured compute already: no extra KV bytes.
                        let pr = info.plan.predict(&speeds, 0);
                        PlanBound {
                            compute_bytes_per_s: compute,
                            predicted_ms: pr.seconds_per_token * 1e3,
                            bottleneck: pr.bottleneck.name(),
                        }
                    });
                    StreamingFigures {
                        disk_bytes_per_token: m.disk_bytes_per_token,
                        expert_bytes_per_token: m.expert_bytes_per_token,
                        expert_chosen_per_token: m.expert_chosen_per_token,
                        expert_missed_per_token: m.expert_missed_per_token,
                        expert_hit_rate: m.expert_hit_rate,
                        expert_stall_ms: m.expert_stall_per_token.as_secs_f64() * 1e3,
                        non_resident_bytes: info.non_resident_bytes(),
                        layer_map: tiered::layer_map(&info.plan),
                        coded_ram_bytes: if info.plan.ram_coded {
                            info.plan.tier_bytes(ballast_tier_stream::Tier::Ram)
                        } else {
                            0
                        },
                        stall_ms: m.stall_per_token.as_secs_f64() * 1e3,
                        read_ms: m.read_time_per_token.as_secs_f64() * 1e3,
                        disk_bytes_per_s: m.disk_bytes_per_s,
                        bound,
                    }
                });
            let mut pt = per_token(busy, n);
            // Whatever no op accounted for (the argmax, the detokenizer) is engine
            // overhead; show it with "other".
            let accounted = busy.matmul + busy.attention + busy.other;
            pt.other += wall.saturating_sub(accounted) / n.max(1) as u32;
            results.push(TestResult {
                test: at_depth(format!("tg{}", args.n_gen)),
                threads: t,
                tokens_per_s: speeds,
                per_token: Some(pt),
                io: Some(IoFigures {
                    process_read_per_token,
                    streaming,
                }),
            });
        }
        if on_device {
            // One more decoded token at the end of a full context of the depth and n_gen
            // tokens, to read what the backend counted, then the same token profiled
            // per kernel.
            let tokens = prompt_tokens(depth + args.n_gen.max(1), vocab);
            let session = generator.session_mut();
            session.rewind(0);
            if tokens.len() > 1 {
                session.feed(&tokens[..tokens.len() - 1])?;
            }
            let at = session.tokens().len();
            session.feed_greedy(&tokens[tokens.len() - 1..])?;
            let telemetry = backend.telemetry();
            let last = || telemetry.last_pass().unwrap_or_default();
            let plain = last();
            session.rewind(at);
            telemetry.set_profiling(true);
            session.feed_greedy(&tokens[tokens.len() - 1..])?;
            telemetry.set_profiling(false);
            let profiled = last();
            let peak = backend.residency().map_or(0, |m| m.bytes().1);
            // The device's KV cache per element type: one short pass on a cache of
            // each (same context), reading what the pass says it attended over.
            let shape = session.model().kv_shape();
            let mut kv_device = Vec::new();
            for p in [KvElement::F32, KvElement::F16, KvElement::Q8] {
                let model = session.model();
                let cache = match model.device_kv_cache(ctx, p)? {
                    Some(cache) => cache,
                    None => ballast_kv_cache::new_cache(UpdateMode::PointerShift, shape, ctx, p)?,
                };
                let mut s = Session::with_cache(session.model().share(), cache, None);
                s.feed_greedy(&tokens[..tokens.len().min(2)])?;
                kv_device.push((p.name(), last().kv_device_bytes));
            }
            device_report = Some(DeviceReport {
                plain,
                profiled,
                peak,
                context: ctx,
                kv_device,
            });
        }
        if let Some(prompt) = speculative.as_ref().filter(|_| args.n_gen > 0) {
            progress.set_message(format!(
                "tg{} plain and speculative at {t} threads",
                args.n_gen
            ));
            let drafter = args
                .draft
                .drafter(&tokenizer, backend.clone(), ctx, batch)?
                .context("--draft gave no drafter")?;
            let stream = tiered_info.as_ref().map(|i| i.stats.clone());
            let read = || {
                stream.as_ref().map(|s| {
                    let s = s.get();
                    s.disk_bytes + s.experts.bytes
                })
            };
            let mut session = generator.into_session();
            session.rewind(0);
            session.set_batch(batch);
            spec_results.push(speculative_test(
                &args, prompt, session, tokenizer, drafter, &read, t,
            )?);
        }
    }
    // KV-cache memory per cached token (keys and values of every layer that keeps the
    // whole context) per precision; a host cache's sliding-window layers keep only
    // their window, a fixed amount however long the context.
    let config = ballast_runtime::ModelConfig::from_gguf(&file)?;
    // Before the roofline's buffer raises it.
    let peak_rss = peak_rss_kib();
    // Not for a streaming store: its weights are not all in RAM, so RAM bandwidth is
    // not its bound, and the roofline's 256 MiB buffer would break the memory budget
    // (a cgroup limit below it kills the process).
    let streaming = store_name.starts_with("tiered");
    let roofline = roofline(
        &file,
        &results,
        backend_name.starts_with("cpu") && !streaming,
    );
    let kv_dim = config.n_kv_heads * config.head_dim;
    let windows: Vec<usize> = config
        .layer_attention
        .iter()
        .filter_map(|a| a.shape.window)
        .collect();
    let growing = config.n_layers - windows.len();
    let kv_per_token: Vec<(&str, usize)> = [KvElement::F32, KvElement::F16, KvElement::Q8]
        .into_iter()
        .map(|p| (p.name(), 2 * growing * p.row_bytes(kv_dim)))
        .collect();
    let model_name = path
        .file_name()
        .map_or_else(String::new, |n| n.to_string_lossy().into_owned());
    if args.json {
        for r in &results {
            let spread = (
                r.tokens_per_s.iter().copied().fold(f64::INFINITY, f64::min),
                r.tokens_per_s.iter().copied().fold(0.0, f64::max),
            );
            let mut obj = json!({
                "model": model_name, "size_bytes": size, "backend": backend_name, "store": store_name,
                "threads": r.threads, "test": r.test,
                "tokens_per_s_median": median(&r.tokens_per_s),
                "tokens_per_s_min": spread.0, "tokens_per_s_max": spread.1,
                "samples": r.tokens_per_s,
                "peak_rss_kib": peak_rss,
            });
            if let Some(rf) = roofline.iter().find(|f| f.threads == r.threads) {
                if r.test.starts_with("tg") {
                    obj["weight_bytes_per_token"] = json!(rf.weight_bytes_per_token);
                    obj["weight_bytes_per_s"] =
                        json!(rf.weight_bytes_per_token as f64 * median(&r.tokens_per_s));
                    obj["read_bandwidth_bytes_per_s"] = json!(rf.read_bytes_per_s);
                }
            }
            if let Some(pt) = r.per_token {
                obj["per_token_ms"] = json!({
                    "matmul": pt.matmul.as_secs_f64() * 1e3,
                    "attention": pt.attention.as_secs_f64() * 1e3,
                    "rest": pt.other.as_secs_f64() * 1e3,
                });
            }
            if let Some(f) = sparse_figures
                .iter()
                .find(|f| f.threads == r.threads && r.test.starts_with("tg"))
            {
                obj["sparse"] = json!({
                    "sparsity": f.sparsity,
                    "skipped": f.skipped,
                    "mlp_bytes_per_token": f.mlp_bytes_per_token,
                    "dense_mlp_bytes": f.dense_mlp_bytes,
                    "neuron_hit_rate": f.neurons.map(|n| n.0),
                    "neuron_bytes_fetched_per_token": f.neurons.map(|n| n.1),
                    "recall": f.recall,
                    "prefetched_per_token": f.prefetch.as_ref().map(|p| p.prefetched),
                    "prefetch_used": f.prefetch.as_ref().map(|p| p.used),
                    "prefetch_bytes_per_token": f.prefetch.as_ref().map(|p| p.bytes),
                    "fetched_in_mlp_per_token": f.prefetch.as_ref().map(|p| p.fetched_in_mlp),
                });
            }
            if let Some(io) = &r.io {
                obj["process_read_bytes_per_token"] = json!(io.process_read_per_token);
                if let Some(s) = &io.streaming {
                    obj["streaming"] = json!({
                        "disk_bytes_per_token": s.disk_bytes_per_token,
                        "non_resident_bytes": s.non_resident_bytes,
                        "layer_map": s.layer_map,
                        "coded_ram_bytes": s.coded_ram_bytes,
                        "stall_ms_per_token": s.stall_ms,
                        "read_ms_per_token": s.read_ms,
                        "disk_bytes_per_s": s.disk_bytes_per_s,
                        "compute_bytes_per_s": s.bound.as_ref().map(|b| b.compute_bytes_per_s),
                        "predicted_ms_per_token": s.bound.as_ref().map(|b| b.predicted_ms),
                        "measured_ms_per_token": 1e3 / median(&r.tokens_per_s),
                        "bottleneck": s.bound.as_ref().map(|b| b.bottleneck),
                    });
                    if s.expert_bytes_per_token > 0.0 || s.expert_hit_rate > 0.0 {
                        obj["streaming"]["expert_bytes_per_token"] =
                            json!(s.expert_bytes_per_token);
                        obj["streaming"]["expert_hit_rate"] = json!(s.expert_hit_rate);
                        obj["streaming"]["expert_chosen_bytes_per_token"] =
                            json!(s.expert_chosen_per_token);
                        obj["streaming"]["expert_missed_bytes_per_token"] =
                            json!(s.expert_missed_per_token);
                        obj["streaming"]["expert_stall_ms_per_token"] = json!(s.expert_stall_ms);
                    }
                }
            }
            println!("{obj}");
        }
        if let Some(prompt) = &speculative {
            for r in &spec_results {
                let (draft_ms, verify_ms) = r.ms_per_token();
                let mut speculation = crate::draft::to_json(&r.stats);
                speculation["draft_ms_per_token"] = json!(draft_ms);
                speculation["verify_ms_per_token"] = json!(verify_ms);
                println!(
                    "{}",
                    json!({
                        "model": model_name, "size_bytes": size, "backend": backend_name,
                        "store": store_name, "threads": r.threads,
                        "test": format!("tg{} speculative", args.n_gen),
                        "draft": args.draft.draft, "drafter": r.drafter,
                        "draft_max": args.draft.draft_max, "draft_min": args.draft.draft_min,
                        "draft_p_min": args.draft.draft_p_min,
                        "prompt": prompt.what, "prompt_tokens": prompt.ids.len(),
                        "plain_tokens_per_s_median": median(&r.plain),
                        "speculative_tokens_per_s_median": median(&r.speculative),
                        "plain_samples": r.plain, "speculative_samples": r.speculative,
                        "speedup": r.speedup(),
                        "same_output": r.same_output,
                        "speculation": speculation,
                        "storage_bytes_per_token": r.storage.map(|(plain, spec)| json!({
                            "plain": plain, "speculative": spec,
                        })),
                    })
                );
            }
        }
        let kv: serde_json::Map<String, serde_json::Value> = kv_per_token
            .iter()
            .map(|(name, b)| (name.to_string(), json!(b)))
            .collect();
        // Before the device report, which stays the last line.
        let mut line = json!({ "kv_bytes_per_token": kv });
        if !windows.is_empty() {
            line["kv_windowed_layers"] = json!(windows.len());
            line["kv_window"] = json!(windows.iter().max());
        }
        if let Some((tokens, bytes)) = kv_held {
            line["kv_held"] = json!({ "tokens": tokens, "bytes": bytes });
        }
        println!("{line}");
        if let Some(DeviceReport {
            plain,
            profiled,
            peak,
            kv_device,
            ..
        }) = &device_report
        {
            let kernels: Vec<_> = profiled
                .kernels
                .iter()
                .map(|k| json!({"kernel": k.name, "dispatches": k.count, "ms": k.nanos / 1e6}))
                .collect();
            println!(
                "{}",
                json!({
                    "backend": backend_name,
                    "peak_device_bytes": peak,
                    "device_kv_bytes": kv_device
                        .iter()
                        .map(|(name, b)| (name.to_string(), json!(b)))
                        .collect::<serde_json::Map<String, serde_json::Value>>(),
                    "decode_token": {
                        "context_tokens": plain.tokens + args.n_gen.max(1) - 1,
                        "submissions": plain.submissions,
                        "dispatches": plain.dispatches,
                        "bind_groups_made": plain.bind_groups_made,
                        "bytes_moved": plain.bytes_moved(),
                        "weight_bytes_read": plain.weight_bytes_read,
                        "kv_bytes_read": plain.kv_bytes_read,
                        "activation_bytes_read": plain.activation_bytes_read,
                        "bytes_written": plain.bytes_written,
                        "bytes_read_back": plain.bytes_read_back,
                        "bytes_uploaded": plain.bytes_uploaded,
                    },
                    "timestamps": profiled.timestamps,
                    "kernels": kernels,
                })
            );
        }
        return Ok(());
    }
    println!(
        "| model | size | backend | store | threads | test | t/s (median) | spread (min - max) |"
    );
    println!("| --- | ---: | --- | --- | ---: | --- | ---: | ---: |");
    for r in &results {
        let lo = r.tokens_per_s.iter().copied().fold(f64::INFINITY, f64::min);
        let hi = r.tokens_per_s.iter().copied().fold(0.0, f64::max);
        println!(
            "| {} | {} | {} | {} | {} | {} | {:.2} | {:.2} - {:.2} |",
            model_name,
            human_bytes(size),
            backend_name.split(" (").next().unwrap_or("cpu"),
            store_name,
            r.threads,
            r.test,
            median(&r.tokens_per_s),
            lo,
            hi
        );
    }
    if let Some(prompt) = &speculative {
        for r in &spec_results {
            print_speculative(r, prompt, &args);
        }
    }
    for f in &sparse_figures {
        println!(
            "sparse MLP at --sparsity {} ({} threads): {:.1}% of neurons skipped while decoding; MLP weights read per token {} of {} dense ({:.1}%); down-projection input blocks with every neuron skipped: {:.2}%",
            f.sparsity,
            f.threads,
            100.0 * f.skipped,
            human_bytes(f.mlp_bytes_per_token as u64),
            human_bytes(f.dense_mlp_bytes),
            100.0 * f.mlp_bytes_per_token / f.dense_mlp_bytes.max(1) as f64,
            100.0 * f.idle_down_blocks,
        );
        if let Some((hit_rate, fetched)) = f.neurons {
            println!(
                "neuron mode ({} threads): {:.1}% of active neurons found in the cache while decoding; {} of records fetched per token",
                f.threads,
                100.0 * hit_rate,
                human_bytes(fetched as u64)
            );
        }
        if let Some(p) = &f.prefetch {
            println!(
                "prefetch ({} threads): {:.1} records ({}) per token fetched during attention, {:.1}% of them used; {:.1} per token still fetched in the MLP; recall {:.2}% of the active neurons predicted",
                f.threads,
                p.prefetched,
                human_bytes(p.bytes as u64),
                100.0 * p.used,
                p.fetched_in_mlp,
                100.0 * f.recall.unwrap_or(1.0)
            );
        } else if f.gate_rows_computed < 1.0 || f.recall.is_some() {
            println!(
                "predictor ({} threads): {:.1}% of gate rows computed while decoding{}",
                f.threads,
                100.0 * f.gate_rows_computed,
                f.recall
                    .map(|r| format!(
                        "; recall {:.2}% of the neurons the dense gate keeps",
                        100.0 * r
                    ))
                    .unwrap_or_default()
            );
        }
    }
    for rf in &roofline {
        for r in results
            .iter()
            .filter(|r| r.threads == rf.threads && r.test.starts_with("tg"))
        {
            let achieved = rf.weight_bytes_per_token as f64 * median(&r.tokens_per_s);
            println!(
                "roofline, {} threads: {} reads {} of weights per token, {}/s achieved; this machine reads memory at {}/s with {} threads: {:.0}% of it",
                r.threads,
                r.test,
                human_bytes(rf.weight_bytes_per_token),
                tiered::human_rate(achieved),
                tiered::human_rate(rf.read_bytes_per_s),
                r.threads,
                100.0 * achieved / rf.read_bytes_per_s.max(1.0),
            );
        }
    }
    println!("\nwhere a generated token's time goes (mean per token):");
    for r in &results {
        if let Some(pt) = r.per_token {
            let total = pt.matmul + pt.attention + pt.other;
            if device_report.is_some() {
                // The ops ran inside the device's pass: the host saw only the whole.
                println!(
                    "  {:.3} ms per token on the device (its kernels: the table below)",
                    total.as_secs_f64() * 1e3
                );
                continue;
            }
            let pct = |d: Duration| 100.0 * d.as_secs_f64() / total.as_secs_f64().max(1e-12);
            println!(
                "  {} threads: matrix products {:.3} ms ({:.0}%), attention {:.3} ms ({:.0}%), the rest {:.3} ms ({:.0}%)",
                r.threads,
                pt.matmul.as_secs_f64() * 1e3,
                pct(pt.matmul),
                pt.attention.as_secs_f64() * 1e3,
                pct(pt.attention),
                pt.other.as_secs_f64() * 1e3,
                pct(pt.other),
            );
            if pt.regions > 0 {
                println!(
                    "  {} threads: {} parallel regions per token; the calling thread waited {:.2} µs per region for the other threads after its share (the barrier's cost: {:.3} ms per token, {:.1}% of it)",
                    r.threads,
                    pt.regions,
                    pt.thread_wait.as_secs_f64() * 1e6 / pt.regions as f64,
                    pt.thread_wait.as_secs_f64() * 1e3,
                    pct(pt.thread_wait),
                );
            }
        }
    }
    for r in &results {
        let Some(io) = &r.io else { continue };
        if let Some(b) = io.process_read_per_token {
            println!(
                "  {} threads: the process read {} per generated token from storage (/proc/self/io)",
                r.threads,
                human_bytes(b as u64)
            );
        }
        if let Some(s) = &io.streaming {
            let measured_ms = 1e3 / median(&r.tokens_per_s);
            println!(
                "  {} threads, streaming per token: {} read from disk (non-resident layers {}, {:+.1}%), stalled {:.2} ms, disk busy {:.2} ms; disk {}/s measured",
                r.threads,
                human_bytes(s.disk_bytes_per_token as u64),
                human_bytes(s.non_resident_bytes),
                100.0 * (s.disk_bytes_per_token / s.non_resident_bytes.max(1) as f64 - 1.0),
                s.stall_ms,
                s.read_ms,
                tiered::human_rate(s.disk_bytes_per_s),
            );
            if s.expert_bytes_per_token > 0.0 || s.expert_hit_rate > 0.0 {
                println!(
                    "  {} threads, experts per token: {} read for the chosen experts (in the figure above), {:.0}% of the chosen found in the expert cache, waited {:.2} ms for them after the router",
                    r.threads,
                    human_bytes(s.expert_bytes_per_token as u64),
                    s.expert_hit_rate * 100.0,
                    s.expert_stall_ms,
                );
            }
            match &s.bound {
                Some(b) => println!(
                    "  {} threads: {:.2} ms per token measured (median) vs {:.2} ms the plan predicts from the disk speed and compute {}/s measured ({:.2}x); bottleneck {}",
                    r.threads,
                    measured_ms,
                    b.predicted_ms,
                    tiered::human_rate(b.compute_bytes_per_s),
                    measured_ms / b.predicted_ms.max(1e-9),
                    b.bottleneck
                ),
                None => println!(
                    "  {} threads: {:.2} ms per token measured (median); no plan bound on a device backend (its compute and upload speeds are not measured here)",
                    r.threads, measured_ms
                ),
            }
        }
    }
    if let Some(text) = &budget_text {
        println!("{text}");
    }
    if let Some(text) = &plan_text {
        println!("plan used:\n{text}");
    }
    if let Some(kib) = peak_rss {
        println!("peak resident memory: {}", human_bytes(kib * 1024));
    }
    if let Some(report) = &device_report {
        print_device_report(report, args.n_depth + args.n_gen.max(1));
    }
    let shown: Vec<String> = kv_per_token
        .iter()
        .map(|(name, b)| format!("{name} {}", human_bytes(*b as u64)))
        .collect();
    if windows.is_empty() {
        println!("KV cache per token (--kv-dtype): {}", shown.join(", "));
    } else {
        println!(
            "KV cache per token (--kv-dtype) on the {growing} layers that keep the whole context: {}; the {} sliding-window layers keep at most their window of {} tokens plus one prompt chunk (host caches)",
            shown.join(", "),
            windows.len(),
            windows.iter().max().copied().unwrap_or(0),
        );
    }
    if let Some((tokens, bytes)) = kv_held {
        println!(
            "KV cache held after the last decode run: {} for {tokens} tokens",
            human_bytes(bytes)
        );
    }
    println!("backend: {backend_name}");
    Ok(())
}

fn print_speculative(r: &SpecResult, prompt: &SpecPrompt, args: &BenchArgs) {
    let s = &r.stats;
    println!(
        "speculative decoding, {} threads: --draft {} ({}) on {} ({} tokens), {} greedy tokens, medians of {}",
        r.threads,
        args.draft.draft.as_deref().unwrap_or_default(),
        r.drafter,
        prompt.what,
        prompt.ids.len(),
        args.n_gen,
        args.repetitions,
    );
    println!(
        "  plain {:.2} t/s, speculative {:.2} t/s: {:.2}x; {}",
        median(&r.plain),
        median(&r.speculative),
        r.speedup(),
        if r.same_output {
            "the same tokens as plain decoding"
        } else {
            "NOT the tokens of plain decoding"
        }
    );
    println!(
        "  {:.0}% of drafted tokens accepted ({} of {}), {:.2} tokens per pass of the model ({} verification passes, {} plain steps)",
        100.0 * s.acceptance(),
        s.accepted,
        s.drafted,
        s.tokens_per_pass(),
        s.passes,
        s.plain_steps,
    );
    let (draft_ms, verify_ms) = r.ms_per_token();
    println!("  per generated token: drafting {draft_ms:.3} ms, verifying {verify_ms:.3} ms");
    if let Some((plain, spec)) = r.storage {
        println!(
            "  read from storage per generated token: plain {}, speculative {}",
            human_bytes(plain as u64),
            human_bytes(spec as u64)
        );
    }
}

/// What the device backend reported: a decoded token as is and profiled, the peak
/// device memory, and the device's KV cache per element type at `context` tokens.
struct DeviceReport {
    plain: PassReport,
    profiled: PassReport,
    peak: u64,
    context: usize,
    kv_device: Vec<(&'static str, u64)>,
}

fn print_device_report(report: &DeviceReport, context: usize) {
    let (plain, profiled) = (&report.plain, &report.profiled);
    println!(
        "peak device memory: {} (every buffer the backend allocated)",
        human_bytes(report.peak)
    );
    let kv: Vec<String> = report
        .kv_device
        .iter()
        .map(|(name, b)| format!("{name} {}", human_bytes(*b)))
        .collect();
    println!(
        "device KV cache at a context of {} tokens (--kv-dtype): {}",
        report.context,
        kv.join(", ")
    );
    println!(
        "one decoded token at context {context}: {} submission(s), {} dispatches ({} new bind \
         groups), {} moved (weights {}, KV {}, activations {}, writes {}), {} read back, {} \
         of streamed weights uploaded",
        plain.submissions,
        plain.dispatches,
        plain.bind_groups_made,
        human_bytes(plain.bytes_moved()),
        human_bytes(plain.weight_bytes_read),
        human_bytes(plain.kv_bytes_read),
        human_bytes(plain.activation_bytes_read),
        human_bytes(plain.bytes_written),
        human_bytes(plain.bytes_read_back),
        human_bytes(plain.bytes_uploaded),
    );
    if !profiled.timestamps {
        println!("per-kernel timings: this adapter has no timestamp queries");
        return;
    }
    let total: f64 = profiled.kernels.iter().map(|k| k.nanos).sum();
    println!(
        "device time per kernel for that token (timestamp queries, {:.3} ms in all):",
        total / 1e6
    );
    let mut kernels = profiled.kernels.clone();
    kernels.sort_by(|a, b| b.nanos.total_cmp(&a.nanos));
    for k in kernels {
        println!(
            "  {:<10} {:>4} dispatches {:>9.3} ms ({:.0}%)",
            k.name,
            k.count,
            k.nanos / 1e6,
            100.0 * k.nanos / total.max(1.0)
        );
    }
}

/// The memory roofline of one thread count: what a decode step reads and how fast the
/// machine reads memory with that many threads.
struct Roofline {
    threads: usize,
    weight_bytes_per_token: u64,
    read_bytes_per_s: f64,
}

/// Bytes of weights a decode step of a dense model reads (every tensor once; the
/// embedding table only for its one row, unless it is also the output head), and the
/// machine's read bandwidth at each thread count a decode test ran with, measured after
/// the tests. Empty off the CPU: a device's bandwidth is not the host's.
fn roofline(
    file: &ballast_runtime::gguf::GgufFile,
    results: &[TestResult],
    on_cpu: bool,
) -> Vec<Roofline> {
    if !on_cpu {
        return Vec::new();
    }
    let tensors = file.tensors();
    let separate_head = tensors.iter().any(|t| t.name == "output.weight");
    let weight_bytes_per_token = tensors
        .iter()
        .filter(|t| !(separate_head && t.name == "token_embd.weight"))
        .map(|t| t.n_bytes)
        .sum();
    let mut threads: Vec<usize> = results
        .iter()
        .filter(|r| r.test.starts_with("tg"))
        .map(|r| r.threads)
        .collect();
    threads.dedup();
    threads
        .into_iter()
        .map(|t| Roofline {
            threads: t,
            weight_bytes_per_token,
            read_bytes_per_s: ballast_runtime::memory::read_bandwidth(256 << 20, t),
        })
        .collect()
}

/// Greedy decoding of `n` tokens, end-of-generation tokens included (as llama-bench's
/// tg, which generates a fixed count).
fn greedy(n: usize) -> GenerateOptions {
    GenerateOptions {
        sampler: SamplerConfig {
            temperature: 0.0,
            ..SamplerConfig::default()
        },
        max_tokens: Some(n),
        ignore_eos: true,
        ..GenerateOptions::default()
    }
}

/// Steps `generator` to the end of its generation: the tokens' ids.
fn decode(generator: &mut Generator) -> Result<Vec<u32>> {
    let mut ids = Vec::with_capacity(generator.options().max_tokens.unwrap_or(0));
    loop {
        match generator.step()? {
            Step::Token(token) => ids.push(token.id),
            Step::Done(_) => return Ok(ids),
        }
    }
}

/// The speculative test's default prompt for a draft model: code to continue.
const CODE_PROMPT: &str = r#"```python
# Utilities for a small inventory system.
from dataclasses import dataclass, field
from typing import Dict, List, Optional


@dataclass
class Item:
    name: str
    quantity: int
    unit_price: float
    tags: List[str] = field(default_factory=list)


class Inventory:
    """Items by name: add, remove, search by tag, restock and value the stock."""

    def __init__(self) -> None:
"#;

/// The speculative test's default prompt for prompt lookup: an edit, which repeats a
/// given function with one change.
const EDIT_PROMPT: &str = r#"Here is a Python function:

```python
def summarize_orders(orders, min_total=0.0):
    """Group orders by customer and return per-customer totals, counts and averages."""
    totals = {}
    counts = {}
    for order in orders:
        customer = order["customer"]
        amount = order["quantity"] * order["unit_price"]
        if order.get("discount"):
            amount -= amount * order["discount"]
        totals[customer] = totals.get(customer, 0.0) + amount
        counts[customer] = counts.get(customer, 0) + 1
    summary = []
    for customer, total in totals.items():
        if total < min_total:
            continue
        average = total / counts[customer]
        summary.append(
            {
                "customer": customer,
                "total": round(total, 2),
                "orders": counts[customer],
                "average": round(average, 2),
            }
        )
    summary.sort(key=lambda row: row["total"], reverse=True)
    return summary
```

Write the same function again with one change: the default of `min_total` becomes 10.0. Keep everything else exactly as it is.

```python
"#;

/// The speculative test's prompt.
struct SpecPrompt {
    /// Where it comes from, for the report.
    what: String,
    ids: Vec<u32>,
}

impl SpecPrompt {
    /// `file`'s text, else the built-in prompt suited to `draft` (`ngram` or a model).
    fn new(draft: &str, file: Option<&std::path::Path>, tokenizer: &Tokenizer) -> Result<Self> {
        let (what, text) = match file {
            Some(path) => (
                path.display().to_string(),
                std::fs::read_to_string(path)
                    .with_context(|| format!("reading the prompt {}", path.display()))?,
            ),
            None if draft == "ngram" => ("the built-in editing prompt".into(), EDIT_PROMPT.into()),
            None => ("the built-in code prompt".into(), CODE_PROMPT.into()),
        };
        let ids = tokenizer
            .encode(&text, true, true)
            .context("tokenizing the prompt")?;
        anyhow::ensure!(!ids.is_empty(), "the prompt is empty");
        Ok(SpecPrompt { what, ids })
    }
}

/// The speculative test at one thread count.
struct SpecResult {
    threads: usize,
    drafter: String,
    /// Tokens per second of each repetition: plain, speculative.
    plain: Vec<f64>,
    speculative: Vec<f64>,
    /// Over every speculative repetition.
    stats: SpeculationStats,
    /// Tokens each repetition timed.
    tokens: usize,
    /// Whether every speculative repetition gave the plain one's tokens.
    same_output: bool,
    /// Bytes read from storage per generated token (tiered streaming): plain,
    /// speculative.
    storage: Option<(f64, f64)>,
}

impl SpecResult {
    fn speedup(&self) -> f64 {
        median(&self.speculative) / median(&self.plain).max(1e-12)
    }

    /// Milliseconds per generated token spent drafting, and verifying.
    fn ms_per_token(&self) -> (f64, f64) {
        let n = (self.tokens * self.plain.len()).max(1) as f64;
        (
            self.stats.draft_time.as_secs_f64() * 1e3 / n,
            self.stats.verify_time.as_secs_f64() * 1e3 / n,
        )
    }
}

/// `-n` greedy tokens after `prompt` on `session`, decoded plainly then with `drafter`,
/// `-r` times. Only the decoding is timed: the prompt, and the draft model's reading
/// of it, come before the clock starts. The first token comes with the prompt's
/// logits, so `-n + 1` are generated and the `-n` after it timed. `read`: bytes the
/// store has read from storage so far, when it streams.
fn speculative_test(
    args: &BenchArgs,
    prompt: &SpecPrompt,
    session: Session,
    tokenizer: std::sync::Arc<Tokenizer>,
    drafter: Box<dyn Drafter>,
    read: &dyn Fn() -> Option<u64>,
    threads: usize,
) -> Result<SpecResult> {
    let mut generator = Generator::new(session, tokenizer, greedy(args.n_gen + 1))?;
    let sampler = generator.options().sampler;
    let (drafter_name, options) = (drafter.name(), args.draft.options());
    let mut drafter = Some(drafter);
    let mut result = SpecResult {
        threads,
        drafter: drafter_name,
        plain: Vec::new(),
        speculative: Vec::new(),
        stats: SpeculationStats::default(),
        tokens: args.n_gen,
        same_output: true,
        storage: None,
    };
    let mut bytes = [0u64; 2];
    let mut scratch = Vec::new();
    for _ in 0..args.repetitions {
        let mut outputs = [Vec::new(), Vec::new()];
        for (k, speculative) in [false, true].into_iter().enumerate() {
            generator.session_mut().rewind(0);
            if speculative {
                let mut d = drafter.take().context("the drafter was lost")?;
                // A draft model reads the prompt now (one token drafted and dropped).
                scratch.clear();
                d.draft(&prompt.ids, 1, &sampler, &mut scratch)?;
                generator = generator.with_drafter(d, options);
            }
            generator.prompt(&prompt.ids)?;
            let before = read();
            let start = Instant::now();
            let ids = decode(&mut generator)?;
            let elapsed = start.elapsed();
            if let (Some(a), Some(b)) = (read(), before) {
                bytes[k] += a - b;
            }
            anyhow::ensure!(
                ids.len() == args.n_gen + 1,
                "the speculative test generated {} tokens of {}",
                ids.len(),
                args.n_gen + 1
            );
            let rate = args.n_gen as f64 / elapsed.as_secs_f64();
            if speculative {
                result.speculative.push(rate);
                drafter = generator.take_drafter().map(|(d, _)| d);
            } else {
                result.plain.push(rate);
            }
            outputs[k] = ids;
        }
        result.same_output &= outputs[0] == outputs[1];
    }
    result.stats = generator.speculation_stats();
    let n = (args.n_gen * args.repetitions).max(1) as f64;
    result.storage = read().map(|_| (bytes[0] as f64 / n, bytes[1] as f64 / n));
    Ok(result)
}
