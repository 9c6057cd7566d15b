//! `cargo xtask bench-tricksy`: Tricksy's comparison (issue 15) on wgpu, on the default
//! model, with the same device memory for each scheme:
//!
//! - **naive offload**: attention, norms and the head stay on the device; every MLP
//!   matrix is uploaded per use (its bytes lent as not cacheable, so the backend puts
//!   them in its stream slots);
//! - **partial dense offload**: the tiered store's plan for the device budget (as
//!   `ballast bench --device gpu --store tiered --vram X`): as many whole layers as fit
//!   stay on the device, the others are uploaded per use from RAM;
//! - **neuron cache with diff fetch**: the sparse MLP's neuron mode
//!   ([`SparseFfn::with_neurons`]) at a host sync point computes the gate (resident),
//!   keeps the neurons whose `|silu(gate)|` passes the layer's threshold at the given
//!   sparsity (the model's sparsity profile: CATS; the gate is exact, so no predictor
//!   and a recall of 1), and runs them through the backend's `NeuronOps`: one neuron
//!   store per layer of `capacity` records, least recently used out, only the missing
//!   records written (the diff) from the records held in RAM.
//!
//! The device budget is what the neuron cache's run held at its peak; the partial dense
//! plan gets it as `--vram`. Each scheme runs on a GPU context of its own (its own
//! device byte count): a prompt, then greedy decode; per decoded token the bytes the
//! pass uploaded ([`ballast_runtime::backend::PassReport::bytes_uploaded`], neuron
//! records included), the time, and for the neuron cache its hits and misses. Then
//! `ballast plan --h2d 6.5GB/s` for each from the measured bytes. On lavapipe an upload
//! is a memcpy, so the plan's figures are the ones a real PCIe link would see.

use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use anyhow::{Context, Result};
use ballast_runtime::backend::Telemetry;
use ballast_runtime::ggml_type::GgmlType;
use ballast_runtime::gguf::GgufFile;
use ballast_runtime::gpu::GpuContext;
use ballast_runtime::model::blocks::{FFN_DOWN, FFN_GATE, FFN_UP};
use ballast_runtime::model::{load_weights, Model, ModelConfig};
use ballast_runtime::neurons::NeuronLayout;
use ballast_runtime::store::{PassId, ResidentStore, TierBytes, WeightStore};
use ballast_runtime::tokenizer::Tokenizer;
use ballast_runtime::weights::{ByteSource, GlobalWeights, LayerWeights, WeightBytes};
use ballast_runtime::{Backend, Session, WgpuBackend};
use ballast_sparse_mlp::{layer_records, MemoryNeurons, NeuronSource, SparseFfn, SparseStats};
use ballast_tier_stream::io::DirectFile;
use ballast_tier_stream::{
    model_shape, plan, Budgets, PlanRequest, RamTier, TieredOptions, TieredStore,
};

const MIB: f64 = (1u64 << 20) as f64;
/// The prompt: plain English, so the neurons a token uses are a real text's.
const PROMPT: &str = "Making pesto from scratch can be done with these ingredients in 4 simple steps: basil, pine nuts, garlic, parmesan and olive oil. Step 1";
/// Context of every run (sizes the KV cache and the plan's reserve).
const CTX: usize = 256;

/// Flags of the task.
pub struct Options {
    /// Decoded tokens per run.
    pub n_gen: usize,
    /// The neuron cache's sparsity (a quantile of the profile's `|silu(gate)|`).
    pub sparsity: f32,
    /// Neuron slots per layer, as a share of the MLP width.
    pub cache: f64,
}

/// What one run measured.
struct Run {
    scheme: String,
    peak_device: u64,
    uploaded_per_token: f64,
    tokens_per_s: f64,
    ids: Vec<u32>,
    hit_rate: Option<f64>,
    note: String,
}

/// Bytes lent for one use: the backend uploads them per use into its stream slots.
struct NotCached(WeightBytes);

impl ByteSource for NotCached {
    fn bytes(&self) -> ballast_runtime::Result<&[u8]> {
        self.0.as_slice()
    }
    fn cache_on_device(&self) -> bool {
        false
    }
}

/// Naive offload: every layer as loaded, its MLP matrices' bytes not cacheable.
struct MlpOffload {
    inner: ResidentStore,
    layers: Vec<Arc<LayerWeights>>,
}

impl MlpOffload {
    fn new(globals: GlobalWeights, layers: Vec<LayerWeights>) -> Result<MlpOffload> {
        let mut lent = Vec::new();
        for l in &layers {
            let mut l = l.clone();
            for (role, w) in l.matrices.iter_mut() {
                if [FFN_GATE, FFN_UP, FFN_DOWN].contains(&role.as_str()) {
                    let len = w.bytes.len();
                    w.bytes = WeightBytes::new(Arc::new(NotCached(w.bytes.clone())), 0..len)?;
                }
            }
            lent.push(Arc::new(l));
        }
        Ok(MlpOffload {
            inner: ResidentStore::new(globals, layers, true),
            layers: lent,
        })
    }
}

impl WeightStore for MlpOffload {
    fn n_layers(&self) -> usize {
        self.layers.len()
    }
    fn globals(&self) -> &GlobalWeights {
        self.inner.globals()
    }
    fn layer(&self, _pass: PassId, index: usize) -> ballast_runtime::Result<Arc<LayerWeights>> {
        Ok(self.layers[index].clone())
    }
    fn held_bytes(&self) -> TierBytes {
        self.inner.held_bytes()
    }
}

/// Every neuron's record of every layer, in RAM (Tricksy keeps the MLPs in CPU RAM):
/// the up row as stored, the down column as Q8_0 ([`layer_records`]).
fn neuron_records(layers: &[LayerWeights], n_embd: usize) -> Result<MemoryNeurons> {
    let mut layout = None;
    let mut all = Vec::new();
    let mut n_ff = 0;
    for l in layers {
        let (up, down) = (l.matrix(FFN_UP)?, l.matrix(FFN_DOWN)?);
        n_ff = up.rows();
        let lay = NeuronLayout {
            n_embd,
            up_type: up.ty,
            down_type: GgmlType::Q8_0,
        };
        let mut dense = vec![0f32; down.rows() * down.cols()];
        ballast_runtime::quant::dequantize(down.ty, down.bytes.as_slice()?, &mut dense)?;
        let mut records = Vec::with_capacity(n_ff * lay.record_bytes());
        layer_records(&lay, up.bytes.as_slice()?, &dense, n_ff, &mut records)?;
        layout = Some(lay);
        all.push(records);
    }
    let layout = layout.context("a model without layers")?;
    Ok(MemoryNeurons::new(layout, n_ff, all)?)
}

/// Runs the prompt, then `n_gen` greedy tokens, on `model` (on `backend`, whose context
/// `ctx` counts the device bytes).
/// [`measure`] of a model over `store` with the architecture's dense MLP.
fn measure_dense(
    scheme: &str,
    config: &ModelConfig,
    store: Box<dyn WeightStore>,
    (backend, ctx): (&Arc<WgpuBackend>, &GpuContext),
    prompt: &[u32],
    n_gen: usize,
) -> Result<Run> {
    let model = Model::from_parts(
        config.clone(),
        store,
        backend.clone(),
        ballast_runtime::ffn::for_config(config),
    );
    measure(scheme, model, backend, ctx, prompt, n_gen, None)
}

fn measure(
    scheme: &str,
    model: Model,
    backend: &WgpuBackend,
    ctx: &GpuContext,
    prompt: &[u32],
    n_gen: usize,
    stats: Option<&Arc<Mutex<SparseStats>>>,
) -> Result<Run> {
    let mut session = Session::new(model, CTX)?;
    let mut next = session.feed_greedy(prompt)?;
    let mut ids = vec![next];
    let hits_misses = || {
        stats.map(|s| {
            let s = s.lock().unwrap_or_else(|p| p.into_inner());
            (s.neuron_hits, s.neuron_misses)
        })
    };
    let before = hits_misses();
    let mut uploaded = 0u64;
    let start = Instant::now();
    for _ in 0..n_gen {
        next = session.feed_greedy(&[next])?;
        ids.push(next);
        uploaded += backend.last_pass().map_or(0, |r| r.bytes_uploaded);
    }
    let secs = start.elapsed().as_secs_f64();
    let hit_rate = before
        .zip(hits_misses())
        .map(|((h0, m0), (h1, m1))| (h1 - h0) as f64 / ((h1 - h0) + (m1 - m0)).max(1) as f64);
    Ok(Run {
        scheme: scheme.to_string(),
        peak_device: ctx.memory().peak(),
        uploaded_per_token: uploaded as f64 / n_gen as f64,
        tokens_per_s: n_gen as f64 / secs,
        ids,
        hit_rate,
        note: String::new(),
    })
}

fn fresh_backend() -> Result<(Arc<GpuContext>, Arc<WgpuBackend>)> {
    let ctx = GpuContext::new().context("a wgpu adapter")?;
    Ok((ctx.clone(), Arc::new(WgpuBackend::new(ctx))))
}

/// `ballast plan`'s seconds per token on a 6.5 GB/s link: for the partial dense plan its
/// own streamed layers, for the others the bytes they uploaded per token.
fn plan_seconds(ballast: &Path, model: &Path, vram: u64, uploaded: Option<f64>) -> Result<String> {
    let mut cmd = std::process::Command::new(ballast);
    cmd.args([
        "plan",
        "--json",
        "--h2d",
        "6.5GB/s",
        "-c",
        &CTX.to_string(),
        "-m",
    ])
    .arg(model)
    .args([
        "--vram",
        &vram.to_string(),
        "--ram",
        "8G",
        "--disk",
        "3GB/s",
    ]);
    if let Some(b) = uploaded {
        cmd.args(["--uploaded-per-token", &format!("{}", b.round() as u64)]);
    }
    let out = cmd.output().context("running ballast plan")?;
    anyhow::ensure!(
        out.status.success(),
        "ballast plan failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    let p = &v["predicted"];
    let tps = |k: &str| p[k].as_f64().map(|s| 1.0 / s);
    Ok(
        match (tps("seconds_per_token"), tps("serial_seconds_per_token")) {
            (Some(a), Some(b)) => format!("{a:.0} (overlapped) / {b:.0} (serial)"),
            (Some(a), None) => format!("{a:.0}"),
            _ => "-".into(),
        },
    )
}

pub fn run(ballast: &Path, model_path: &Path, opts: &Options) -> Result<()> {
    let file = Arc::new(GgufFile::open(model_path, true)?);
    let config = ModelConfig::from_gguf(&file)?;
    let tokenizer = Tokenizer::from_gguf(&file)?;
    let prompt = tokenizer.encode(PROMPT, true, false)?;
    let profile_path = ballast_sparse_mlp::SparsityProfile::path_for(model_path);
    let profile = ballast_sparse_mlp::SparsityProfile::load(
        &profile_path,
        ballast_kv_cache::model_fingerprint(&file),
        config.n_layers,
        config.n_ff,
    )
    .with_context(|| format!("the sparsity profile {}", profile_path.display()))?;
    let thresholds = profile.thresholds(opts.sparsity)?;
    let n_gen = opts.n_gen;
    let (globals, layers) = load_weights(&file, &config)?;
    let mlp_bytes: u64 = layers
        .iter()
        .flat_map(|l| l.matrices.iter())
        .filter(|(r, _)| [FFN_GATE, FFN_UP, FFN_DOWN].contains(&r.as_str()))
        .map(|(_, w)| w.bytes.len() as u64)
        .sum();
    let capacity = ((config.n_ff as f64 * opts.cache).round() as usize).clamp(1, config.n_ff);
    let records = neuron_records(&layers, config.d_model)?;
    let layout = records.layout();
    println!(
        "\n## Tricksy's comparison on wgpu ({})\n",
        fresh_backend()?.1.name()
    );
    println!(
        "model {} ({} layers, MLP {} wide; MLP matrices {:.1} MiB); prompt {} tokens, then {n_gen} greedy tokens, context {CTX}; neuron records {} bytes (up row {:?}, down column Q8_0); neuron cache: sparsity {} (CATS on the gate, thresholds from {}), {capacity} slots per layer ({:.0}% of the MLP)\n",
        model_path.display(),
        config.n_layers,
        config.n_ff,
        mlp_bytes as f64 / MIB,
        prompt.len(),
        layout.record_bytes(),
        layout.up_type,
        opts.sparsity,
        profile_path.display(),
        opts.cache * 100.0,
    );

    let mut runs = Vec::new();
    // The neuron cache first: its peak device bytes are everyone's budget.
    {
        let (ctx, backend) = fresh_backend()?;
        let on: Arc<dyn Backend> = backend.clone();
        let ffn =
            SparseFfn::new(thresholds.clone()).with_neurons(Arc::new(records), capacity, &on)?;
        let stats = ffn.stats();
        let store = ResidentStore::new(globals.clone(), layers.clone(), true);
        let model = Model::from_parts(
            config.clone(),
            Box::new(store),
            backend.clone(),
            Box::new(ffn),
        );
        let mut r = measure(
            "neuron cache, diff fetch (LRU)",
            model,
            &backend,
            &ctx,
            &prompt,
            n_gen,
            Some(&stats),
        )?;
        r.note = format!("sparsity {}, {capacity} slots/layer", opts.sparsity);
        runs.push(r);
    }
    let budget = runs[0].peak_device;
    {
        let (ctx, backend) = fresh_backend()?;
        let store = MlpOffload::new(globals.clone(), layers.clone())?;
        let mut r = measure_dense(
            "naive offload (every MLP per use)",
            &config,
            Box::new(store),
            (&backend, &ctx),
            &prompt,
            n_gen,
        )?;
        r.note = "attention and head resident".into();
        runs.push(r);
    }
    {
        let (ctx, backend) = fresh_backend()?;
        let mut shape = model_shape(&config, &globals, &layers);
        // As `ballast --device gpu` plans: the KV cache on the device alone, at f32.
        shape.kv_value_bytes = 4;
        shape.kv_on_device_only = true;
        let p = plan(&PlanRequest {
            shape,
            budgets: Budgets {
                device: Some(budget),
                ram: 8 << 30,
            },
            ctx: CTX as u64,
            batch: prompt.len() as u64,
            depth: 3,
            ram_tier: RamTier::Raw,
        })?;
        let (a, b, c) = p.counts();
        let reader = DirectFile::open(model_path, true)?;
        let store = TieredStore::new(
            &file,
            globals.clone(),
            layers.clone(),
            &p,
            Arc::new(reader),
            TieredOptions::default(),
        )?;
        backend.set_stream_slots(p.device_slots.max(1));
        let mut r = measure_dense(
            "partial dense offload (tiered)",
            &config,
            Box::new(store),
            (&backend, &ctx),
            &prompt,
            n_gen,
        )?;
        r.note = format!(
            "{a} layers on the device, {} streamed ({c} from disk), {} slots",
            b + c,
            p.device_slots
        );
        runs.push(r);
    }

    println!("| scheme | device bytes (peak) | uploaded per token | tokens/s | cache hit rate | greedy ids as dense (from the start) | plan, 6.5 GB/s: tokens/s | notes |");
    println!("| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |");
    let dense_ids = runs[1].ids.clone();
    for (i, r) in runs.iter().enumerate() {
        let same = r
            .ids
            .iter()
            .zip(&dense_ids)
            .take_while(|(a, b)| a == b)
            .count();
        let predicted = plan_seconds(
            ballast,
            model_path,
            budget,
            (i != 2).then_some(r.uploaded_per_token),
        )
        .unwrap_or_else(|e| format!("({e:#})"));
        println!(
            "| {} | {:.2} MiB | {:.3} MiB | {:.2} | {} | {same} of {} | {predicted} | {} |",
            r.scheme,
            r.peak_device as f64 / MIB,
            r.uploaded_per_token / MIB,
            r.tokens_per_s,
            r.hit_rate
                .map_or("-".into(), |h| format!("{:.1}%", h * 100.0)),
            r.ids.len(),
            r.note
        );
    }
    Ok(())
}
