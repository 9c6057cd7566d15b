//! The flags of the weight store and its budgets (the engine builds the store:
//! `ballast::store`), and the measurements `plan` and `bench` print.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use ballast::{ByteSize, CacheKind, CodecOptions, StoreOptions, StreamOptions};
use ballast_runtime::gguf::GgufFile;
use ballast_runtime::model::load_weights;
use ballast_runtime::{Backend, ModelConfig};
use ballast_tier_stream::io::{self, DirectFile, ReadAt};
use ballast_tier_stream::{plan, Plan, PlanRequest, RamTier, Speeds, StreamStats, Tier};
use clap::Args;

pub use ballast::report::{describe, layer_map};
pub use ballast::{human_bytes, human_rate, RamTierKind, StoreKind};

/// Flags that choose the weight store and its budget.
#[derive(Args, Clone, Debug)]
pub struct StoreArgs {
    /// Where weights live: auto, mmap, ram (read into RAM) or tiered (resident layers
    /// within --ram, the rest streamed from disk bypassing the page cache).
    #[arg(long, value_enum, default_value_t = StoreKind::Auto)]
    pub store: StoreKind,
    /// RAM budget for weights, KV cache and activations (e.g. 2G, 512M). Default: the
    /// probed RAM (MemAvailable, or the cgroup limit when one is set).
    #[arg(long)]
    pub ram: Option<ByteSize>,
    /// GPU memory budget for weights, KV cache and activations (e.g. 8G), with
    /// --device gpu: layers that fit stay on the GPU, the others are uploaded per use
    /// from RAM (--ram) or from disk. Needed for tiered streaming on the GPU (wgpu
    /// cannot tell how much memory a GPU has). The CPU backend computes from RAM: use
    /// --ram there.
    #[arg(long)]
    pub vram: Option<ByteSize>,
    /// Prefetch depth of tiered streaming: slots in the ring (2 = double buffering).
    /// The default 3 absorbs scheduling jitter on a busy machine for one more slot.
    #[arg(long, default_value_t = 3)]
    pub prefetch_depth: usize,
    /// Reader threads of tiered streaming (2 keep a read queued while one finishes).
    #[arg(long, default_value_t = 2)]
    pub io_threads: usize,
    /// Read with plain reads plus posix_fadvise(DONTNEED) instead of O_DIRECT.
    #[arg(long)]
    pub no_direct_io: bool,
    /// Mixture of experts, tiered on the CPU: read a streamed layer's experts whole
    /// with the layer, instead of only the experts its tokens choose (the default).
    #[arg(long)]
    pub whole_experts: bool,
    /// Mixture of experts, tiered on the CPU: bytes of recently used experts kept
    /// between tokens (e.g. 256M). Default: what the plan leaves of the RAM budget.
    #[arg(long)]
    pub expert_cache: Option<ByteSize>,
    /// With a pack: how long a decoded layer lives.
    #[arg(long, value_enum, default_value_t = CacheKind::EveryUse)]
    pub cache: CacheKind,
    /// With a pack: keep the first N layers decoded once decoded.
    #[arg(long, default_value_t = 0)]
    pub keep_layers: usize,
    /// With a pack: do not decode layer i+1 on a worker while layer i computes.
    #[arg(long)]
    pub no_prefetch: bool,
    /// With a pack: threads that decode one layer's chunks.
    #[arg(long, default_value_t = 1)]
    pub decode_threads: usize,
    /// With a pack streamed by tiers on the CPU: the form of the layers kept in RAM.
    /// raw: decoded (computed from in place, no decode for them). coded: every kept
    /// layer held compressed and decoded per use by the reader threads, ahead of the
    /// pass (the most layers in the budget and the fewest disk bytes, for a decode of
    /// every layer on every token). auto, the default: decoded layers as raw places
    /// them, and the room left in the budget holds streamed layers compressed instead
    /// of reading them from disk, which never adds a decode (they were decoded after
    /// their read anyway). `ballast plan -m PACK` compares the three on this machine.
    #[arg(long, value_enum, default_value_t = RamTierKind::Auto)]
    pub ram_tier: RamTierKind,
    /// RAM that something else of the run holds beside the model: a resident draft
    /// model (`--draft`). The plan gets the budget less this.
    #[arg(skip)]
    pub beside: Option<ballast::store::Beside>,
}

impl StoreArgs {
    /// The store these flags describe.
    pub fn options(&self) -> StoreOptions {
        StoreOptions {
            kind: self.store,
            ram: self.ram,
            vram: self.vram,
            stream: StreamOptions {
                prefetch_depth: self.prefetch_depth,
                io_threads: self.io_threads,
                direct_io: !self.no_direct_io,
                whole_experts: self.whole_experts,
                expert_cache: self.expert_cache,
            },
            codec: CodecOptions {
                cache: self.cache,
                keep_layers: self.keep_layers,
                prefetch: !self.no_prefetch,
                decode_threads: self.decode_threads,
                ram_tier: self.ram_tier,
            },
            beside: self.beside.clone(),
        }
    }
}

/// One RAM-tier form planned for the same request, with what it costs per token.
pub struct RamTierOption {
    pub ram_tier: RamTier,
    pub plan: Plan,
    pub prediction: ballast_tier_stream::Prediction,
}

/// The request planned with each RAM-tier form (for a pack on the CPU: raw, raw then
/// coded, coded), each predicted at `speeds`; forms the budget refuses are left out.
pub fn ram_tier_options(req: &PlanRequest, speeds: &Speeds, kv_tokens: u64) -> Vec<RamTierOption> {
    [RamTier::Raw, RamTier::RawThenCoded, RamTier::Coded]
        .into_iter()
        .filter_map(|ram_tier| {
            let plan = plan(&PlanRequest {
                ram_tier,
                ..req.clone()
            })
            .ok()?;
            let prediction = plan.predict(speeds, kv_tokens);
            Some(RamTierOption {
                ram_tier,
                plan,
                prediction,
            })
        })
        .collect()
}

/// The RAM-tier forms side by side: layers in RAM decoded and coded, disk bytes and
/// decodes per token, the prediction; then whether holding layers coded pays against
/// reading them from disk.
pub fn describe_ram_tiers(options: &[RamTierOption]) -> String {
    use std::fmt::Write;
    let mut s = String::new();
    let _ = writeln!(
        s,
        "| RAM tier | layers decoded in RAM | layers coded in RAM | on disk | disk read per token | decodes per token | readers busy (decode) | predicted |"
    );
    let _ = writeln!(
        s,
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
    );
    for o in options {
        let (a, b, c) = o.plan.counts();
        let pr = &o.prediction;
        let _ = writeln!(
            s,
            "| {} | {a} | {b} ({}) | {c} | {} | {} | {:.1} ms ({:.1} ms) | {:.1} ms = {:.2} tokens/s |",
            o.ram_tier.name(),
            human_bytes(o.plan.tier_bytes(Tier::Ram)),
            human_bytes(o.plan.bytes_per_token().disk),
            o.plan.decodes_per_token(),
            pr.disk_s * 1e3,
            pr.decode_s * 1e3,
            pr.seconds_per_token * 1e3,
            pr.tokens_per_s(),
        );
    }
    let raw = options.iter().find(|o| o.ram_tier == RamTier::Raw);
    for o in options.iter().filter(|o| o.ram_tier != RamTier::Raw) {
        let Some(raw) = raw else { break };
        let in_ram = |p: &Plan| {
            let (a, b, _) = p.counts();
            a + b
        };
        let more = in_ram(&o.plan) as i64 - in_ram(&raw.plan) as i64;
        let saved = raw.plan.bytes_per_token().disk as i64 - o.plan.bytes_per_token().disk as i64;
        let extra_decodes = o.plan.decodes_per_token() as i64 - raw.plan.decodes_per_token() as i64;
        let (t, t_raw) = (
            o.prediction.seconds_per_token,
            raw.prediction.seconds_per_token,
        );
        let verdict = if more <= 0 && extra_decodes <= 0 {
            "changes nothing here".to_string()
        } else if more <= 0 {
            "does not pay: it holds no more layers, and decodes more".to_string()
        } else if t < t_raw {
            format!(
                "pays: {:.1} ms per token instead of {:.1}",
                t * 1e3,
                t_raw * 1e3
            )
        } else {
            format!(
                "does not pay: {:.1} ms per token instead of {:.1} (decoding costs more than the disk reads it saves)",
                t * 1e3,
                t_raw * 1e3
            )
        };
        let _ = writeln!(
            s,
            "RAM tier {}: {more:+} layers in RAM against raw, {} less read from disk per token, {extra_decodes:+} decodes per token: {verdict}",
            o.ram_tier.name(),
            human_bytes(saved.max(0) as u64),
        );
    }
    s
}

/// Measures the disk's read speed on `path` as tiered streaming reads it: `readers`
/// threads at once (its `--io-threads`), each read one streamed layer long
/// (`read_bytes`, clamped to 1-256 MiB), into buffers already faulted in (streaming
/// reuses its slots), its page cache dropped first. Each reader's first read is not
/// timed; the timed reads then go on until they cover 1 GiB (or the file) and at
/// least 400 ms have passed, or 3 s have.
///
/// The read's length matters as much as the disk: one direct read is split into
/// requests that are in flight together, so on a 2026 cloud volume 32 MiB reads gave
/// 0.94 GB/s and 128 MiB reads (an 8B model's layer) 1.4 GB/s. So do the warm-up and
/// the span: reading 512 MiB into fresh buffers measured 1.05-1.13 GB/s on a virtual
/// disk whose streamed layers came in at 2.3-2.9 GB/s in the same minutes.
pub fn measure_disk(path: &Path, readers: usize, read_bytes: u64) -> Result<f64> {
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::Barrier;
    let f = DirectFile::open(path, true)?;
    let len = f.len() / 4096 * 4096;
    let chunk = read_bytes.clamp(1 << 20, 256 << 20).div_ceil(4096) * 4096;
    anyhow::ensure!(
        len >= chunk,
        "{} is too small to measure the disk",
        path.display()
    );
    let readers = readers.max(1) as u64;
    // Chunks in file order; each reader takes the next one, so the reads in flight are
    // neighbours as a layer's are. The span wraps around the file.
    let chunks_in_file = len / chunk;
    let want = ((1u64 << 30) / chunk).max(2 * readers) + readers;
    let first_chunk = chunks_in_file.saturating_sub(want) / 2;
    let next = AtomicU64::new(0);
    let timed_bytes = AtomicU64::new(0);
    let _ = io::drop_file_cache(path);
    let warmed = Barrier::new(readers as usize);
    let started = std::sync::OnceLock::new();
    std::thread::scope(|scope| {
        let handles: Vec<_> = (0..readers)
            .map(|_| {
                let (f, next, timed_bytes, warmed, started) =
                    (&f, &next, &timed_bytes, &warmed, &started);
                scope.spawn(move || -> Result<()> {
                    let mut buf = io::AlignedBuf::new(chunk as usize);
                    buf.as_mut_slice().fill(1); // fault the pages in, as a slot's are
                    let mut read_one = || -> Result<()> {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        let off = (first_chunk + i) % chunks_in_file * chunk;
                        let n = f.read_at(buf.as_mut_slice(), off)?;
                        anyhow::ensure!(n > 0, "{}: read nothing at {off}", path.display());
                        Ok(())
                    };
                    // The warm-up read is not timed; every reader reaches the barrier
                    // even when it failed, so none waits for ever.
                    let warm_up = read_one();
                    warmed.wait();
                    warm_up?;
                    let t0: &Instant = started.get_or_init(Instant::now);
                    let mut own = 0u64;
                    loop {
                        let done = timed_bytes.load(Ordering::Relaxed);
                        let elapsed = t0.elapsed();
                        if own >= 2 * chunk
                            && ((done >= (1 << 30).min(len)
                                && elapsed >= Duration::from_millis(400))
                                || elapsed >= Duration::from_secs(3))
                        {
                            return Ok(());
                        }
                        read_one()?;
                        own += chunk;
                        timed_bytes.fetch_add(chunk, Ordering::Relaxed);
                    }
                })
            })
            .collect();
        handles.into_iter().try_for_each(|h| {
            h.join()
                .map_err(|_| anyhow::anyhow!("a disk reader panicked"))?
        })
    })?;
    let elapsed = started
        .get()
        .context("no disk reader started")?
        .elapsed()
        .as_secs_f64();
    Ok(timed_bytes.load(Ordering::Relaxed) as f64 / elapsed)
}

/// Measures the backend's decode speed in weight bytes per second: matrix-vector
/// products over one layer's weights (and the head), repeated for at least 200 ms.
pub fn measure_compute(file: &Arc<GgufFile>, backend: &dyn Backend) -> Result<f64> {
    use ballast_runtime::backend::MatmulJob;
    let config = ModelConfig::from_gguf(file)?;
    let (_, layers) = load_weights(file, &config)?;
    let l = layers.first().context("the model has no layers")?;
    let ws: Vec<_> = l.weights().collect();
    let bytes: u64 = ws.iter().map(|w| w.bytes.len() as u64).sum();
    let x = vec![0.5f32; config.d_model.max(config.n_ff).max(config.q_dim())];
    let mut outs: Vec<Vec<f32>> = ws.iter().map(|w| vec![0.0; w.rows()]).collect();
    let mut run = || -> Result<()> {
        for (w, out) in ws.iter().zip(outs.iter_mut()) {
            backend.matmul(&x[..w.cols()], 1, &mut [MatmulJob { weight: w, out }])?;
        }
        Ok(())
    };
    run()?; // warm-up (pages in the weights)
    let t = Instant::now();
    let mut reps = 0u64;
    while t.elapsed() < Duration::from_millis(200) || reps < 3 {
        run()?;
        reps += 1;
    }
    Ok((bytes * reps) as f64 / t.elapsed().as_secs_f64())
}

/// Measured figures of tiered streaming between two snapshots, per token.
pub struct Measured {
    /// Layer and expert bytes read.
    pub disk_bytes_per_token: f64,
    pub stall_per_token: Duration,
    pub read_time_per_token: Duration,
    pub disk_bytes_per_s: f64,
    /// Of a mixture of experts streamed expert by expert: bytes read for the chosen
    /// experts, the share of chosen experts found in the cache, and the wait for them.
    pub expert_bytes_per_token: f64,
    /// The chosen experts' own bytes per token, and those not found in the cache.
    pub expert_chosen_per_token: f64,
    pub expert_missed_per_token: f64,
    pub expert_hit_rate: f64,
    pub expert_stall_per_token: Duration,
}

pub fn measured(before: StreamStats, after: StreamStats, tokens: usize) -> Measured {
    let n = tokens.max(1) as f64;
    let bytes = after.disk_bytes - before.disk_bytes;
    let read = after.read_time.saturating_sub(before.read_time);
    let (eb, ea) = (before.experts, after.experts);
    let expert_bytes = ea.bytes - eb.bytes;
    let (reads, hits) = (ea.reads - eb.reads, ea.hits - eb.hits);
    Measured {
        expert_bytes_per_token: expert_bytes as f64 / n,
        expert_chosen_per_token: (ea.chosen - eb.chosen) as f64 / n,
        expert_missed_per_token: (ea.missed - eb.missed) as f64 / n,
        expert_hit_rate: if reads + hits == 0 {
            0.0
        } else {
            hits as f64 / (reads + hits) as f64
        },
        expert_stall_per_token: ea.stall.saturating_sub(eb.stall).div_f64(n),
        disk_bytes_per_token: (bytes + expert_bytes) as f64 / n,
        stall_per_token: after
            .stall_time
            .saturating_sub(before.stall_time)
            .div_f64(n),
        read_time_per_token: read.div_f64(n),
        // The reader threads' layer bytes over their busy time (expert reads are timed
        // apart, as the wait above).
        disk_bytes_per_s: if read.is_zero() {
            0.0
        } else {
            bytes as f64 / read.as_secs_f64()
        },
    }
}
