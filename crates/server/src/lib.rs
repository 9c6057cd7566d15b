//! `ballast-server`: an OpenAI-compatible HTTP server over Ballast sessions, the
//! library behind `ballast serve`.
//!
//! [`serve`] listens at once (so `GET /health` answers 503 while the model loads),
//! loads the model with the closure it is given, then serves; [`serve_engine`] serves
//! an engine loaded already, ready from the first request (`ballast serve` loads
//! before it listens, so a model that does not fit stops it with its error). Both
//! serve:
//!
//! - `POST /v1/chat/completions` (the GGUF's chat template) and `POST /v1/completions`,
//!   one response or server-sent events (`stream: true`), with `max_tokens`,
//!   `temperature`, `top_p`, `top_k`, `min_p`, `seed`, `stop`, the penalties, `logprobs`;
//! - `GET /v1/models`, `GET /health`, `GET /metrics` (Prometheus text, see
//!   [`metrics::Metrics`]).
//!
//! Errors are OpenAI's `{"error": {"message", "type", "code"}}` ([`api::ApiError`]):
//! 400 for a bad request, 401 without the key, 413 over the body limit, 503 while
//! loading or when the queue is full. CORS is open to any origin.
//!
//! An [`Engine`] holds one [`Session`] per slot, each on its own
//! [`Model::share`](ballast_runtime::Model::share) handle and KV cache. The
//! scheduler runs up to that many sequences: each step gives every running sequence
//! one pass (a chunk of its prompt, or one token), one after another; requests join
//! between steps; a client that goes away frees its slot at its next turn. A request
//! whose prompt starts with what a free slot's cache holds (the next turn of a chat)
//! reuses those keys and values.
//!
//! [`router`] gives the same routes over an engine already loaded, as an axum
//! `Router` to nest in another app (`examples/embedded.rs`).
//!
//! # Examples
//!
//! The routes under `/llm` of your own axum app, over a tiny random model (a real one
//! is `GgufFile::open("model.gguf".as_ref(), true)?`):
//!
//! ```
//! use std::sync::Arc;
//!
//! use ballast_runtime::gguf::GgufFile;
//! use ballast_runtime::testing::TinyModelSpec;
//! use ballast_runtime::{CpuBackend, Model, Session, Tokenizer};
//! use ballast_server::{router, Engine, ServerConfig};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let file = Arc::new(GgufFile::from_bytes(TinyModelSpec::default().to_gguf_bytes()?)?);
//! let tokenizer = Tokenizer::from_gguf(&file)?;
//! let model = Model::load(file, Arc::new(CpuBackend::new(1)), false)?;
//! let sessions = vec![Session::new(model.share(), 64)?];
//! let engine = Engine { model, sessions, tokenizer, chat_template: None, speculation: None };
//! let app: axum::Router = axum::Router::new().nest("/llm", router(ServerConfig::new("tiny"), engine)?);
//! # drop(app);
//! # Ok(())
//! # }
//! ```
//!
//! A server of its own, which answers `/health` with a 503 while the model loads:
//!
//! ```no_run
//! use std::sync::Arc;
//!
//! use ballast_runtime::gguf::GgufFile;
//! use ballast_runtime::{CpuBackend, Model, Session, Tokenizer};
//! use ballast_server::{serve, Engine, ServerConfig};
//!
//! # async fn example() -> Result<(), ballast_server::Error> {
//! let listener = tokio::net::TcpListener::bind("127.0.0.1:8080").await?;
//! let config = ServerConfig::new("SmolLM2-135M-Instruct");
//! let load = || -> Result<Engine, ballast_server::BoxError> {
//!     let file = Arc::new(GgufFile::open("model.gguf".as_ref(), true)?);
//!     let tokenizer = Tokenizer::from_gguf(&file)?;
//!     let chat_template = file.get_str_opt("tokenizer.chat_template")?.map(String::from);
//!     let model = Model::load(file, Arc::new(CpuBackend::new(2)), true)?;
//!     // Two slots: two sessions on the same weights, each with its own KV cache.
//!     let sessions = vec![Session::new(model.share(), 2048)?, Session::new(model.share(), 2048)?];
//!     Ok(Engine { model, sessions, tokenizer, chat_template, speculation: None })
//! };
//! serve(listener, config, load, std::future::pending()).await
//! # }
//! ```
#![deny(missing_docs)]

pub mod api;
mod http;
pub mod metrics;
mod scheduler;

use std::future::Future;
use std::sync::{Arc, Mutex};

use ballast_runtime::chat::ChatTemplate;
use ballast_runtime::generate::{DraftOptions, Drafter};
use ballast_runtime::{Model, Session, Tokenizer};

/// An error of the loader, in whatever type it has.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// What can stop [`serve`].
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Listening or serving failed.
    #[error("serving HTTP: {0}")]
    Io(#[from] std::io::Error),
    /// The loader failed. Its message is in this one's (not also a source, which an
    /// error chain would print twice).
    #[error("loading the model: {0}")]
    Load(BoxError),
    /// The loader gave no session.
    #[error("the engine has no session: serving needs at least one slot")]
    NoSession,
    /// Speculation needs one drafter per slot.
    #[error("{drafters} drafters for {slots} slots: speculative decoding needs one per slot")]
    Drafters {
        /// Drafters given.
        drafters: usize,
        /// Slots (sessions).
        slots: usize,
    },
}

/// What the loader gives: the sessions (one per slot; `Model::share` handles on the
/// same weights, each with its own KV cache), the tokenizer, the chat template.
pub struct Engine {
    /// The handle every step's one pass runs on, for all running sequences (a
    /// [`Model::share`] of the sessions' weights); its MLP lever serves them all.
    pub model: Model,
    /// One per slot: as many sequences run at once, each with its own KV cache.
    pub sessions: Vec<Session>,
    /// The model's tokenizer.
    pub tokenizer: Tokenizer,
    /// The GGUF's `tokenizer.chat_template`; without one, chat completions are
    /// refused.
    pub chat_template: Option<String>,
    /// Speculative decoding: a drafter per slot, and how long its drafts are.
    pub speculation: Option<Speculation>,
}

/// Speculative decoding in the server: each slot's sequence is drafted for by its own
/// drafter, and a step verifies every slot's draft in its one pass. Each client gets
/// exactly the tokens it would get without.
pub struct Speculation {
    /// One per slot (as many as [`Engine::sessions`]).
    pub drafters: Vec<Box<dyn Drafter>>,
    /// Draft lengths.
    pub options: DraftOptions,
}

/// How the server behaves.
#[derive(Clone, Debug)]
pub struct ServerConfig {
    /// The name `GET /v1/models` lists and requests may give as `model`.
    pub model_name: String,
    /// When set, every route but `/health` needs `Authorization: Bearer KEY`.
    pub api_key: Option<String>,
    /// Requests that may wait for a slot; more are refused with a 503.
    pub max_queue: usize,
    /// Largest request body in bytes; larger ones get a 413.
    pub body_limit: usize,
    /// Prompt tokens per pass (a longer prompt takes several steps).
    pub batch: usize,
}

impl ServerConfig {
    /// Defaults: no key, 64 waiting requests, 1 MiB bodies, 64-token prompt chunks.
    pub fn new(model_name: impl Into<String>) -> ServerConfig {
        ServerConfig {
            model_name: model_name.into(),
            api_key: None,
            max_queue: 64,
            body_limit: 1 << 20,
            batch: ballast_runtime::session::DEFAULT_BATCH,
        }
    }
}

/// Serves on `listener` until `shutdown` completes: answers at once (503 while
/// loading), runs `load` on the scheduler thread, then serves the engine it gives.
/// Returns the loader's error if it fails.
pub async fn serve<L, S>(
    listener: tokio::net::TcpListener,
    config: ServerConfig,
    load: L,
    shutdown: S,
) -> Result<(), Error>
where
    L: FnOnce() -> Result<Engine, BoxError> + Send + 'static,
    S: Future<Output = ()> + Send + 'static,
{
    let shared = Arc::new(scheduler::Shared::new(config.max_queue));
    let batch = config.batch;
    let state = Arc::new(http::AppState::new(config, shared.clone()));
    let (failed_tx, failed_rx) = tokio::sync::oneshot::channel::<Error>();
    let loader_state = state.clone();
    std::thread::Builder::new()
        .name("ballast-scheduler".into())
        .spawn(move || {
            let engine = match load() {
                Ok(e) => e,
                Err(e) => {
                    let _ = failed_tx.send(Error::Load(e));
                    return;
                }
            };
            match make_ready(engine, &loader_state) {
                Ok(ready) => ready.run(batch),
                Err(e) => {
                    let _ = failed_tx.send(e);
                }
            }
        })?;
    serve_until(listener, state, shared, failed_rx, shutdown).await
}

/// Serves the loaded `engine` on `listener` until `shutdown` completes: ready from
/// the first request (`GET /health` answers 200), with no loading state.
pub async fn serve_engine<S>(
    listener: tokio::net::TcpListener,
    config: ServerConfig,
    engine: Engine,
    shutdown: S,
) -> Result<(), Error>
where
    S: Future<Output = ()> + Send + 'static,
{
    let shared = Arc::new(scheduler::Shared::new(config.max_queue));
    let batch = config.batch;
    let state = Arc::new(http::AppState::new(config, shared.clone()));
    let ready = make_ready(engine, &state)?;
    // Nothing loads: the channel of a loader's failure never fires.
    let (_never, failed_rx) = tokio::sync::oneshot::channel::<Error>();
    std::thread::Builder::new()
        .name("ballast-scheduler".into())
        .spawn(move || ready.run(batch))?;
    serve_until(listener, state, shared, failed_rx, shutdown).await
}

/// An engine whose handlers are ready: what the scheduler runs.
struct Scheduled {
    model: Model,
    sessions: Vec<Session>,
    speculation: Option<Speculation>,
    tokenizer: Arc<Tokenizer>,
    shared: Arc<scheduler::Shared>,
}

impl Scheduled {
    /// Runs the scheduler on this thread until the server shuts down.
    fn run(self, batch: usize) {
        scheduler::run(
            self.model,
            self.sessions,
            self.speculation,
            self.tokenizer,
            batch,
            self.shared,
        );
    }
}

/// Makes `state` ready for `engine` (its tokenizer, chat template and context), so
/// the handlers may queue requests, which the scheduler takes at its first turn.
fn make_ready(engine: Engine, state: &http::AppState) -> Result<Scheduled, Error> {
    if engine.sessions.is_empty() {
        return Err(Error::NoSession);
    }
    if let Some(spec) = &engine.speculation {
        if spec.drafters.len() != engine.sessions.len() {
            return Err(Error::Drafters {
                drafters: spec.drafters.len(),
                slots: engine.sessions.len(),
            });
        }
    }
    let tokenizer = Arc::new(engine.tokenizer);
    let template = match engine.chat_template.as_deref() {
        None => Err("the model has no chat template".to_string()),
        Some(src) => ChatTemplate::new(src)
            .map_err(|e| format!("the model's chat template does not compile: {e}")),
    };
    let text = |id: Option<u32>| id.map(|id| tokenizer.decode(&[id])).unwrap_or_default();
    let context = engine
        .sessions
        .iter()
        .map(scheduler::context_of)
        .min()
        .flatten();
    let ready = http::Ready {
        bos: text(tokenizer.bos_id()),
        eos: text(tokenizer.eos_id()),
        tokenizer: tokenizer.clone(),
        template,
        context,
    };
    // Slots first: a handler that sees `ready` may queue at once.
    state.shared.set_slots(engine.sessions.len());
    let _ = state.ready.set(ready);
    Ok(Scheduled {
        model: engine.model,
        sessions: engine.sessions,
        speculation: engine.speculation,
        tokenizer,
        shared: state.shared.clone(),
    })
}

/// Serves `state` on `listener` until `shutdown` completes or a loader fails
/// (`failed`), then stops the scheduler.
async fn serve_until<S>(
    listener: tokio::net::TcpListener,
    state: Arc<http::AppState>,
    shared: Arc<scheduler::Shared>,
    failed_rx: tokio::sync::oneshot::Receiver<Error>,
    shutdown: S,
) -> Result<(), Error>
where
    S: Future<Output = ()> + Send + 'static,
{
    let failure: Arc<Mutex<Option<Error>>> = Arc::default();
    let failure_slot = failure.clone();
    let stop = async move {
        let load_failed = async {
            match failed_rx.await {
                Ok(e) => e,
                // The loader succeeded: this never fires.
                Err(_) => std::future::pending().await,
            }
        };
        tokio::select! {
            () = shutdown => {}
            e = load_failed => {
                *failure_slot.lock().unwrap_or_else(|p| p.into_inner()) = Some(e);
            }
        }
    };
    let app = http::router(state);
    let served = axum::serve(listener, app)
        .with_graceful_shutdown(stop)
        .await;
    shared.shutdown();
    if let Some(e) = failure.lock().unwrap_or_else(|p| p.into_inner()).take() {
        return Err(e);
    }
    served.map_err(Error::Io)
}

/// The server's routes over an engine already loaded, as an axum [`Router`] another
/// app can nest or merge (`Router::new().nest("/llm", router)`): starts the scheduler
/// thread, which serves the routes' requests until the process exits.
///
/// [`Router`]: axum::Router
pub fn router(config: ServerConfig, engine: Engine) -> Result<axum::Router, Error> {
    let batch = config.batch;
    let shared = Arc::new(scheduler::Shared::new(config.max_queue));
    let state = Arc::new(http::AppState::new(config, shared));
    let ready = make_ready(engine, &state)?;
    std::thread::Builder::new()
        .name("ballast-scheduler".into())
        .spawn(move || ready.run(batch))?;
    Ok(http::router(state))
}

#[cfg(test)]
mod tests {
    use super::*;
    use ballast_runtime::gguf::GgufFile;
    use ballast_runtime::testing::TinyModelSpec;
    use ballast_runtime::CpuBackend;

    /// A handler may queue as soon as the engine is ready, before the scheduler thread
    /// has run at all: the slots must already be counted, or a server with no queue
    /// refuses its first request as "busy" (seen once in CI).
    #[test]
    fn a_ready_engine_takes_a_request_before_the_scheduler_runs() {
        let file = Arc::new(
            GgufFile::from_bytes(TinyModelSpec::default().to_gguf_bytes().unwrap()).unwrap(),
        );
        let tokenizer = Tokenizer::from_gguf(&file).unwrap();
        let model = Model::load(file, Arc::new(CpuBackend::new(1)), false).unwrap();
        let engine = Engine {
            sessions: vec![Session::new(model.share(), 64).unwrap()],
            model,
            tokenizer,
            chat_template: None,
            speculation: None,
        };
        let mut config = ServerConfig::new("tiny");
        config.max_queue = 0;
        let shared = Arc::new(scheduler::Shared::new(config.max_queue));
        let state = http::AppState::new(config, shared.clone());
        let _scheduled = make_ready(engine, &state).unwrap();
        let generation = api::parse_request(
            br#"{"prompt": [1, 2], "max_tokens": 1}"#,
            api::Endpoint::Completion,
            "tiny",
        )
        .unwrap();
        let job = |events| scheduler::Job {
            prompt: vec![1, 2],
            generation: generation.clone(),
            events,
        };
        let (events, _rx) = tokio::sync::mpsc::unbounded_channel();
        assert!(shared.submit(job(events.clone())).is_ok());
        // One slot, no queue: the second is the one refused.
        assert_eq!(shared.submit(job(events)).unwrap_err().status, 503);
    }
}
