//! `ballast run`: generate text from a prompt.

use std::io::Write;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use ballast_kv_cache::{load_session, model_fingerprint, save_session, SessionMeta};
use ballast_runtime::memory::peak_rss_kib;
use ballast_runtime::{GenerateOptions, Generator, Step};
use clap::Args;
use serde_json::json;

use crate::common::{self, KvArgs, ModelArgs, SamplingArgs};

/// Flags of `ballast run`.
#[derive(Args, Debug)]
pub struct RunArgs {
    /// The prompt. Special tokens written in it (such as `<|im_start|>`) are parsed
    /// as those tokens, as llama.cpp does.
    pub prompt: String,
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub sampling: SamplingArgs,
    /// Tokens to generate (stops earlier at an end-of-generation token).
    #[arg(short = 'n', long = "n-predict", default_value_t = 128)]
    pub n_predict: usize,
    /// Context size in tokens (prompt plus generation).
    #[arg(short = 'c', long = "ctx", default_value_t = 2048)]
    pub ctx: usize,
    /// Prompt tokens per forward pass. Default: 256 when the weights are resident and
    /// the RAM budget has room for it (else 64); when layers stream from disk up to 512,
    /// as the RAM budget allows, since every pass reads the streamed layers once.
    #[arg(short = 'b', long = "batch")]
    pub batch: Option<usize>,
    /// Keep generating past end-of-generation tokens.
    #[arg(long)]
    pub ignore_eos: bool,
    /// Do not echo the prompt before the generation.
    #[arg(long)]
    pub no_echo: bool,
    /// One JSON object per line instead of text: one per generated token (id, text,
    /// logprob), then one with the timings.
    #[arg(long)]
    pub json: bool,
    /// Session file: if it exists, resume from it (its cache, tokens and logits; the
    /// prompt, which may then be empty, is appended without recomputing what came
    /// before), and save the whole conversation to it at the end (atomically). A file
    /// from another model, a corrupted or truncated one, or one with another
    /// --kv-dtype is refused with an error naming the cause.
    #[arg(long)]
    pub session: Option<std::path::PathBuf>,
    #[command(flatten)]
    pub kv: KvArgs,
    #[command(flatten)]
    pub draft: crate::draft::DraftArgs,
}

/// Speeds and memory of one generation.
pub struct Timings {
    pub prompt_tokens: usize,
    pub prompt_time: Duration,
    pub generated_tokens: usize,
    pub generation_time: Duration,
}

impl Timings {
    fn per_s(n: usize, t: Duration) -> f64 {
        if t.is_zero() {
            0.0
        } else {
            n as f64 / t.as_secs_f64()
        }
    }

    pub fn prompt_tps(&self) -> f64 {
        Timings::per_s(self.prompt_tokens, self.prompt_time)
    }

    pub fn generation_tps(&self) -> f64 {
        // The first generated token comes from the prompt's logits; the rest each cost
        // one forward pass, which is what the generation time measured.
        Timings::per_s(
            self.generated_tokens.saturating_sub(1),
            self.generation_time,
        )
    }
}

pub fn run(mut args: RunArgs) -> Result<()> {
    let threads = common::threads(args.model.threads);
    // A resident draft model shares the RAM budget with the model.
    args.model.store.beside = args.draft.resident_bytes(args.ctx)?;
    let kv = args.kv.options();
    let engine = common::load(args.model.builder(args.ctx, args.batch)?.kv(kv.clone()))?;
    let ballast::Report {
        tiered, compressed, ..
    } = engine.report().clone();
    let tokenizer = engine.tokenizer().clone();
    let meta = SessionMeta {
        fingerprint: model_fingerprint(engine.file()),
        precision: kv.element(engine.model()),
        mode: args.kv.mode,
    };
    let backend_name = engine.model().backend().name();
    let batch = engine.batch();
    let mut session = engine.session()?;
    if let Some(path) = args.session.as_deref().filter(|p| p.exists()) {
        let saved = load_session(path, meta, session.kv_mut())
            .with_context(|| format!("resuming the session {}", path.display()))?;
        // Without a policy the cache alone continues (a policy's state is then moot).
        if let Some(policy) = session.policy_mut() {
            policy
                .restore_state(&saved.policy_state)
                .with_context(|| format!("resuming the session {}", path.display()))?;
        }
        session.restore(saved.tokens, saved.logits);
    }
    let resumed = !session.tokens().is_empty();
    let prompt_ids = tokenizer
        .encode(&args.prompt, !resumed, true)
        .context("tokenizing the prompt")?;
    anyhow::ensure!(!prompt_ids.is_empty() || resumed, "the prompt is empty");
    let has_policy = args.kv.policy != ballast::Eviction::None;
    let used = session.kv().len() + prompt_ids.len();
    anyhow::ensure!(
        has_policy || used < args.ctx,
        "the prompt is {} tokens, which with the {} cached does not fit the context of {} (raise -c, or evict with --kv-policy)",
        prompt_ids.len(),
        session.kv().len(),
        args.ctx
    );
    let backend = session.model().backend().clone();
    let options = GenerateOptions {
        sampler: args.sampling.config(),
        max_tokens: Some(args.n_predict),
        ignore_eos: args.ignore_eos,
        logprobs: args.json,
        // A session file stores the logits after the last token.
        keep_logits: args.session.is_some(),
        ..GenerateOptions::default()
    };
    let generator = Generator::new(session, tokenizer.clone(), options)?;
    let mut generator = args
        .draft
        .apply(generator, backend.clone(), args.ctx, batch)?;
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    if !args.json && !args.no_echo {
        write!(out, "{}", args.prompt)?;
        out.flush()?;
    }
    let start = Instant::now();
    generator.prompt(&prompt_ids)?;
    let prompt_time = start.elapsed();
    let stream_before = tiered.as_ref().map(|t| t.stats.get());
    let gen_start = Instant::now();
    let tail = loop {
        match generator.step()? {
            Step::Token(token) if args.json => {
                let piece = String::from_utf8_lossy(tokenizer.token_bytes(token.id));
                writeln!(
                    out,
                    "{}",
                    json!({"id": token.id, "text": piece, "logprob": token.logprob})
                )?;
            }
            Step::Token(token) => {
                write!(out, "{}", token.text)?;
                out.flush()?;
            }
            Step::Done(end) => break end.text,
        }
    };
    let generated = generator.generated();
    if let Some(path) = &args.session {
        // The last token shown was not fed (nothing came after it): feed it, so the
        // file holds the whole conversation and a resumed run continues right after it.
        generator.feed_last_token()?;
        let session = generator.session();
        let policy_state = session.policy().map(|p| p.state()).unwrap_or_default();
        save_session(
            path,
            meta,
            session.kv(),
            session.tokens(),
            session.logits(),
            &policy_state,
        )
        .with_context(|| format!("saving the session {}", path.display()))?;
    }
    let timings = Timings {
        prompt_tokens: prompt_ids.len(),
        prompt_time,
        generated_tokens: generated,
        generation_time: gen_start.elapsed(),
    };
    let peak = peak_rss_kib();
    // Streaming figures of the generation (each generated token after the first is one
    // forward pass).
    let streaming = tiered.as_ref().zip(stream_before).map(|(t, before)| {
        let m = crate::tiered::measured(before, t.stats.get(), generated.saturating_sub(1));
        // With a separate device, the last decode pass's uploads (tiers B and C).
        let uploaded = (!t.plan.unified)
            .then(|| backend.telemetry().last_pass().map(|r| r.bytes_uploaded))
            .flatten();
        (
            m,
            t.non_resident_bytes(),
            t.plan.tier_bytes(ballast_tier_stream::Tier::Device),
            uploaded,
        )
    });
    // The last decode step on a device: its submissions and what came back (the KV
    // rows stay on the device).
    let last_pass = (generated > 1)
        .then(|| backend.telemetry().last_pass())
        .flatten();
    if args.json {
        writeln!(
            out,
            "{}",
            json!({"timings": {
                "device_decode_step": last_pass.as_ref().map(|r| json!({
                    "submissions": r.submissions,
                    "bytes_read_back": r.bytes_read_back,
                    "kv_device_bytes": r.kv_device_bytes,
                })),
                "prompt_tokens": timings.prompt_tokens,
                "prompt_ms": timings.prompt_time.as_secs_f64() * 1e3,
                "prompt_tokens_per_s": timings.prompt_tps(),
                "generated_tokens": timings.generated_tokens,
                "generation_ms": timings.generation_time.as_secs_f64() * 1e3,
                "generation_tokens_per_s": timings.generation_tps(),
                "peak_rss_kib": peak,
                "speculation": args.draft.draft.is_some()
                    .then(|| crate::draft::to_json(&generator.speculation_stats())),
                "threads": threads,
                "backend": backend_name,
                "streaming": streaming.as_ref().map(|(m, non_resident, resident, uploaded)| json!({
                    "disk_bytes_per_token": m.disk_bytes_per_token,
                    "uploaded_bytes_per_token": uploaded,
                    "non_resident_bytes": non_resident,
                    "resident_bytes_per_token": resident,
                    "stall_ms_per_token": m.stall_per_token.as_secs_f64() * 1e3,
                    "read_ms_per_token": m.read_time_per_token.as_secs_f64() * 1e3,
                })),
                "peak_device_bytes": backend.residency().map(|m| m.bytes().1),
                "compressed": compressed.as_ref().map(|h| {
                    let c = h.get();
                    json!({
                        "passes": c.passes,
                        "decompressions": c.decompressions,
                        "decompressions_per_pass": c.decompressions_per_pass(),
                        "bytes_decoded": c.bytes_decoded,
                        "bytes_read": c.bytes_read,
                        "decode_ms": c.decode_time.as_secs_f64() * 1e3,
                        "stall_ms": c.stall_time.as_secs_f64() * 1e3,
                        "decoded_bytes_peak": c.decoded_bytes_peak,
                        // Layers lent coded, decoded on the device (a `--codec gpu`
                        // pack on --device gpu), and what the last decode step uploaded.
                        "coded_lends": c.coded_lends,
                        "uploaded_bytes_per_token": last_pass.as_ref().map(|r| r.bytes_uploaded),
                    })
                }),
            }})
        )?;
    } else {
        write!(out, "{tail}")?;
        writeln!(out)?;
        out.flush()?;
        eprintln!(
            "\nprompt: {} tokens, {:.1} tokens/s | generation: {} tokens, {:.1} tokens/s | peak memory {} | {}",
            timings.prompt_tokens,
            timings.prompt_tps(),
            timings.generated_tokens,
            timings.generation_tps(),
            peak.map_or("unknown".into(), |k| common::human_bytes(k * 1024)),
            backend_name,
        );
        if args.draft.draft.is_some() {
            eprintln!("{}", crate::draft::describe(&generator.speculation_stats()));
        }
        if let Some((m, non_resident, resident, uploaded)) = &streaming {
            let in_place = match uploaded {
                Some(u) => format!(
                    "{} uploaded to the GPU (tiers B and C), {} read in place from GPU memory",
                    common::human_bytes(*u),
                    common::human_bytes(*resident)
                ),
                None => format!("{} read in place from RAM", common::human_bytes(*resident)),
            };
            eprintln!(
                "streaming per generated token: {} read from disk (non-resident layers: {}), {in_place}, stalled {:.2} ms, disk busy {:.2} ms",
                common::human_bytes(m.disk_bytes_per_token as u64),
                common::human_bytes(*non_resident),
                m.stall_per_token.as_secs_f64() * 1e3,
                m.read_time_per_token.as_secs_f64() * 1e3,
            );
            if m.expert_bytes_per_token > 0.0 || m.expert_hit_rate > 0.0 {
                eprintln!(
                    "experts per generated token: {} read for the chosen experts (in the figure above), {:.0}% of the chosen found in the expert cache, waited {:.2} ms for them after the router",
                    common::human_bytes(m.expert_bytes_per_token as u64),
                    m.expert_hit_rate * 100.0,
                    m.expert_stall_per_token.as_secs_f64() * 1e3,
                );
            }
        }
        if let Some(c) = compressed.as_ref().map(|h| h.get()) {
            eprintln!(
                "compressed store: {} passes, {} decompressions ({:.1} per pass), {} decoded from {} stored, decoding {:.1} ms, waited {:.1} ms, at most {} decoded at once",
                c.passes,
                c.decompressions,
                c.decompressions_per_pass(),
                common::human_bytes(c.bytes_decoded),
                common::human_bytes(c.bytes_read),
                c.decode_time.as_secs_f64() * 1e3,
                c.stall_time.as_secs_f64() * 1e3,
                common::human_bytes(c.decoded_bytes_peak),
            );
            if c.coded_lends > 0 {
                eprintln!(
                    "{} layers lent coded and decoded on the device; the last decode step uploaded {}",
                    c.coded_lends,
                    common::human_bytes(last_pass.as_ref().map_or(0, |r| r.bytes_uploaded)),
                );
            }
        }
        if let Some((_, device_peak)) = backend.residency().map(|m| m.bytes()) {
            eprintln!("peak device memory: {}", common::human_bytes(device_peak));
        }
        if let Some(r) = &last_pass {
            eprintln!(
                "last decode step on the device: {} submission(s), {} read back, KV cache on the device {}",
                r.submissions,
                common::human_bytes(r.bytes_read_back),
                common::human_bytes(r.kv_device_bytes),
            );
        }
    }
    Ok(())
}
