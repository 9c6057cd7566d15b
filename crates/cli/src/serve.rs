//! `ballast serve`: the OpenAI-compatible server (`ballast-server`) on a model loaded
//! with the same flags as `run`, before it listens (so `listening on` means ready).

use std::path::Path;

use anyhow::{Context, Result};
use ballast_runtime::Session;
use ballast_server::{Engine, ServerConfig, Speculation};
use clap::Args;

use crate::common::{self, human_bytes, KvArgs, ModelArgs};

/// Flags of `ballast serve`.
#[derive(Args, Debug)]
pub struct ServeArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Port to listen on (0: any free port; the address is printed).
    #[arg(long, default_value_t = 8080)]
    pub port: u16,
    /// Sequences generated at once, each with its own KV cache of --ctx tokens.
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u16).range(1..))]
    pub parallel: u16,
    /// Requests that may wait for a free sequence; more get a 503.
    #[arg(long, default_value_t = 64)]
    pub queue: usize,
    /// Require `Authorization: Bearer KEY` on every route but /health.
    #[arg(long)]
    pub api_key: Option<String>,
    /// Largest request body (e.g. 1M, 64K); larger ones get a 413.
    #[arg(long, default_value = "1M")]
    pub body_limit: String,
    /// The model's name in the API (GET /v1/models, `model` in requests). Default: the
    /// file name without `.gguf`.
    #[arg(long)]
    pub alias: Option<String>,
    /// Context size of each sequence in tokens (prompt plus generation).
    #[arg(short = 'c', long = "ctx", default_value_t = 4096)]
    pub ctx: usize,
    /// Prompt tokens per forward pass (a longer prompt takes several steps, between
    /// which the other sequences decode).
    #[arg(short = 'b', long = "batch", default_value_t = 64)]
    pub batch: usize,
    #[command(flatten)]
    pub kv: KvArgs,
    /// Speculative decoding, each slot drafting for itself (a draft model's weights are
    /// shared by the slots); every client gets the tokens it would get without.
    #[command(flatten)]
    pub draft: crate::draft::DraftArgs,
}

/// The API name of the model at `path`: its file name without `.gguf`.
fn model_name(path: &Path) -> String {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "model".into());
    name.strip_suffix(".gguf")
        .map(str::to_string)
        .unwrap_or(name)
}

pub fn run(mut args: ServeArgs) -> Result<()> {
    let name = match (&args.alias, &args.model.model) {
        (Some(alias), _) => alias.clone(),
        (None, Some(path)) => model_name(path),
        (None, None) => model_name(&ballast_runtime::model_cache::default_model_path()?),
    };
    let body_limit = ballast_tier_stream::probe::parse_size(&args.body_limit)
        .context("--body-limit")?
        .try_into()
        .unwrap_or(usize::MAX);
    let config = ServerConfig {
        model_name: name,
        api_key: args.api_key.clone(),
        max_queue: args.queue,
        body_limit,
        batch: args.batch.max(1),
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        // The HTTP side only parses, tokenizes and forwards events; compute runs on
        // the scheduler thread and the backend's pool.
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    // The model loads before the server listens: a budget or a context that does not
    // fit stops `serve` with its error, instead of a server that says it listens and
    // then dies.
    let parallel = usize::from(args.parallel);
    // A resident draft model shares the RAM budget with the model.
    args.model.store.beside = args.draft.resident_bytes_for(args.ctx, parallel)?;
    let engine = load(&args)?;
    runtime.block_on(async move {
        let addr = format!("{}:{}", args.host, args.port);
        let listener = tokio::net::TcpListener::bind(&addr)
            .await
            .with_context(|| format!("listening on {addr}"))?;
        let local = listener.local_addr()?;
        eprintln!("listening on http://{local}");
        let shutdown = async {
            let _ = tokio::signal::ctrl_c().await;
        };
        ballast_server::serve_engine(listener, config, engine, shutdown)
            .await
            .map_err(anyhow::Error::from)
    })
}

/// Loads the model and gives every slot its session: a handle on the same weights
/// (`Model::share`) with its own KV cache.
fn load(args: &ServeArgs) -> Result<Engine> {
    let parallel = usize::from(args.parallel);
    // Tiered streaming reserves room for every slot's cache.
    let builder = args.model.builder(args.ctx, args.batch)?;
    let engine = common::load(builder.kv(args.kv.options()).sequences(parallel))
        .map_err(|e| per_sequence(e, parallel))?;
    let chat_template = engine
        .file()
        .get_str_opt("tokenizer.chat_template")?
        .map(str::to_string);
    // A slot holds a cache and a history; the passes run on the engine's model below,
    // with its MLP lever (--sparsity), for all slots.
    let sessions = (0..parallel)
        .map(|_| engine.shared_session())
        .collect::<ballast::Result<Vec<Session>>>()?;
    eprintln!(
        "model loaded: {} sequences of {} tokens, {}",
        parallel,
        args.ctx,
        engine.model().backend().name()
    );
    let (model, tokenizer) = engine.into_parts()?;
    let backend = model.backend().clone();
    let drafters = args
        .draft
        .drafters(&tokenizer, backend, args.ctx, args.batch, parallel)?;
    let speculation = (!drafters.is_empty()).then(|| Speculation {
        drafters,
        options: args.draft.options(),
    });
    Ok(Engine {
        model,
        sessions,
        tokenizer,
        chat_template,
        speculation,
    })
}

/// A context too long for the budget, told per sequence: `-c` is each one's, and the
/// budget holds `--parallel` of them.
fn per_sequence(e: anyhow::Error, parallel: usize) -> anyhow::Error {
    let Some(ballast::Error::ContextTooLong(c)) = e.downcast_ref::<ballast::Error>() else {
        return e;
    };
    let each = c.fits / parallel as u64;
    let advice = if each > 0 {
        format!("pass -c {each} with --parallel {parallel}")
    } else {
        format!(
            "lower --parallel (the budget holds {} tokens in all)",
            c.fits
        )
    };
    anyhow::anyhow!(
        "{parallel} sequences of {} tokens do not fit the RAM budget of {} ({}); {} tokens in all do: {advice} (or more memory: --ram, a higher limit)\n  ({})",
        c.ctx / parallel as u64,
        human_bytes(c.budget),
        c.budget_source,
        c.fits,
        c.refusal
    )
}
