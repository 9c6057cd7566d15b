//! The routes: generation endpoints (one response or server-sent events), models,
//! health, metrics; the API key, the body limit and CORS around them.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, OnceLock};
use std::time::{SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::{self, Next};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use ballast_runtime::chat::{ChatMessage, ChatTemplate};
use ballast_runtime::Tokenizer;
use tokio::sync::mpsc::UnboundedReceiver;
use tower_http::cors::CorsLayer;

use crate::api::{
    parse_request, ApiError, ChatChoice, ChatCompletion, ChatCompletionChunk, ChatLogprobs,
    ChunkChoice, Delta, Endpoint, FinishReason, Generation, Input, ModelCard, ModelList,
    ResponseMessage, TextChoice, TextCompletion, TextLogprobs, TokenLogprob, Usage,
};
use crate::scheduler::{Event, Job, Shared};
use crate::ServerConfig;

/// What the handlers need once the model is loaded.
pub struct Ready {
    pub tokenizer: Arc<Tokenizer>,
    /// The chat template, or why there is none.
    pub template: Result<ChatTemplate, String>,
    pub bos: String,
    pub eos: String,
    /// Tokens a sequence can hold, `None` when a KV policy evicts.
    pub context: Option<usize>,
}

/// State shared by the handlers.
pub struct AppState {
    pub config: ServerConfig,
    pub shared: Arc<Shared>,
    pub ready: OnceLock<Ready>,
    pub started: u64,
    ids: AtomicU64,
}

impl AppState {
    pub fn new(config: ServerConfig, shared: Arc<Shared>) -> AppState {
        AppState {
            config,
            shared,
            ready: OnceLock::new(),
            started: unix_now(),
            ids: AtomicU64::new(0),
        }
    }

    /// A fresh response id.
    fn next_id(&self, prefix: &str) -> String {
        let n = self.ids.fetch_add(1, Relaxed);
        format!("{prefix}-{:x}{n:06x}", self.started)
    }
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = StatusCode::from_u16(self.status).unwrap_or(StatusCode::BAD_REQUEST);
        (status, Json(self.body())).into_response()
    }
}

fn loading() -> ApiError {
    ApiError {
        status: 503,
        message: "the model is loading".into(),
        kind: "unavailable_error",
        code: Some("loading"),
    }
}

/// The router with every route and layer.
pub fn router(state: Arc<AppState>) -> Router {
    let limit = state.config.body_limit;
    Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .fallback(not_found)
        .layer(middleware::from_fn_with_state(state.clone(), auth))
        .layer(DefaultBodyLimit::max(limit))
        // Outermost, so preflights are answered before the key is asked for and error
        // responses carry the CORS headers too.
        .layer(CorsLayer::permissive())
        .with_state(state)
}

async fn not_found(req: Request) -> ApiError {
    ApiError {
        status: 404,
        message: format!("no route {} {}", req.method(), req.uri().path()),
        kind: "invalid_request_error",
        code: Some("not_found"),
    }
}

/// Compares in time independent of where the strings differ.
fn same_secret(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

async fn auth(State(state): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    let Some(key) = state.config.api_key.as_deref() else {
        return next.run(req).await;
    };
    // Health stays open: load balancers and orchestrators probe it without secrets.
    if req.uri().path() == "/health" {
        return next.run(req).await;
    }
    let given = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim);
    match given {
        Some(g) if same_secret(g.as_bytes(), key.as_bytes()) => next.run(req).await,
        _ => ApiError {
            status: 401,
            message: "a valid API key is required (Authorization: Bearer KEY)".into(),
            kind: "authentication_error",
            code: Some("invalid_api_key"),
        }
        .into_response(),
    }
}

async fn health(State(state): State<Arc<AppState>>) -> Response {
    match state.ready.get() {
        Some(_) => Json(serde_json::json!({"status": "ok"})).into_response(),
        None => loading().into_response(),
    }
}

async fn models(State(state): State<Arc<AppState>>) -> Json<ModelList> {
    Json(ModelList {
        object: "list",
        data: vec![ModelCard {
            id: state.config.model_name.clone(),
            object: "model",
            created: state.started,
            owned_by: "ballast",
        }],
    })
}

async fn metrics(State(state): State<Arc<AppState>>) -> Response {
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], {
        let (waiting, running) = state.shared.load();
        state.shared.metrics.render(waiting, running)
    })
        .into_response()
}

async fn chat(State(state): State<Arc<AppState>>, body: Result<Bytes, BytesRejection>) -> Response {
    generate(state, Endpoint::Chat, body).await
}

async fn completions(
    State(state): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    generate(state, Endpoint::Completion, body).await
}

async fn generate(
    state: Arc<AppState>,
    endpoint: Endpoint,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    state.shared.metrics.requests.fetch_add(1, Relaxed);
    match start(&state, endpoint, body) {
        Ok((generation, events)) => {
            if generation.stream {
                stream(state, endpoint, generation, events).into_response()
            } else {
                match collect(&state, endpoint, &generation, events).await {
                    Ok(r) => r,
                    Err(e) => {
                        state.shared.metrics.errors.fetch_add(1, Relaxed);
                        e.into_response()
                    }
                }
            }
        }
        Err(e) => {
            state.shared.metrics.errors.fetch_add(1, Relaxed);
            e.into_response()
        }
    }
}

/// Validates a request, tokenizes its prompt and queues it.
fn start(
    state: &AppState,
    endpoint: Endpoint,
    body: Result<Bytes, BytesRejection>,
) -> Result<(Generation, UnboundedReceiver<Event>), ApiError> {
    let body = body.map_err(|r| {
        let status = r.status().as_u16();
        ApiError {
            status,
            message: r.body_text(),
            kind: "invalid_request_error",
            code: (status == 413).then_some("request_too_large"),
        }
    })?;
    let ready = state.ready.get().ok_or_else(loading)?;
    let mut generation = parse_request(&body, endpoint, &state.config.model_name)?;
    let prompt = prompt_ids(ready, &generation.input)?;
    if prompt.is_empty() {
        return Err(ApiError::invalid("the prompt is empty"));
    }
    if let Some(ctx) = ready.context {
        if prompt.len() >= ctx {
            return Err(ApiError::invalid(format!(
                "the prompt is {} tokens, which does not leave room for one more in the \
                 context of {ctx} tokens",
                prompt.len()
            ))
            .with_code("context_length_exceeded"));
        }
    }
    if !generation.seeded {
        generation.sampler.seed = random_seed();
    }
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    state.shared.submit(Job {
        prompt,
        generation: generation.clone(),
        events: tx,
    })?;
    Ok((generation, rx))
}

fn random_seed() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    h.finish()
}

fn prompt_ids(ready: &Ready, input: &Input) -> Result<Vec<u32>, ApiError> {
    let tok = &ready.tokenizer;
    let text = match input {
        Input::Tokens(ids) => {
            if let Some(bad) = ids.iter().find(|&&id| id as usize >= tok.vocab_size()) {
                return Err(ApiError::invalid(format!(
                    "token id {bad} is outside the vocabulary of {} tokens",
                    tok.vocab_size()
                )));
            }
            return Ok(ids.clone());
        }
        Input::Text(t) => t.clone(),
        Input::Chat(messages) => {
            let template = ready.template.as_ref().map_err(|why| {
                ApiError::invalid(format!("{why}; use /v1/completions"))
                    .with_code("no_chat_template")
            })?;
            let messages: Vec<ChatMessage> = messages
                .iter()
                .map(|(role, content)| ChatMessage::new(role.clone(), content.clone()))
                .collect();
            template
                .render(&messages, true, &ready.bos, &ready.eos)
                .map_err(|e| ApiError::invalid(format!("the chat template refused: {e}")))?
        }
    };
    // As `ballast run` does: the model's own start token, special tokens written in
    // the text parsed as such (a chat template writes them).
    tok.encode(&text, true, true)
        .map_err(|e| ApiError::invalid(format!("cannot tokenize the prompt: {e}")))
}

/// Waits for the whole generation and answers it in one response.
async fn collect(
    state: &AppState,
    endpoint: Endpoint,
    generation: &Generation,
    mut events: UnboundedReceiver<Event>,
) -> Result<Response, ApiError> {
    let mut text = String::new();
    let mut logprobs: Vec<TokenLogprob> = Vec::new();
    let (finish, usage) = loop {
        match events.recv().await {
            Some(Event::Delta {
                text: t,
                logprobs: l,
            }) => {
                text.push_str(&t);
                logprobs.extend(l);
            }
            Some(Event::Done { finish, usage }) => break (finish, usage),
            Some(Event::Failed(why)) => return Err(server_error(why)),
            None => return Err(server_error("the generation ended early".into())),
        }
    };
    let model = state.config.model_name.clone();
    let created = unix_now();
    let asked = generation.logprobs.is_some();
    Ok(match endpoint {
        Endpoint::Chat => Json(ChatCompletion {
            id: state.next_id("chatcmpl"),
            object: "chat.completion",
            created,
            model,
            choices: vec![ChatChoice {
                index: 0,
                message: ResponseMessage {
                    role: "assistant",
                    content: text,
                },
                logprobs: asked.then_some(ChatLogprobs { content: logprobs }),
                finish_reason: finish,
            }],
            usage,
        })
        .into_response(),
        Endpoint::Completion => Json(TextCompletion {
            id: state.next_id("cmpl"),
            object: "text_completion",
            created,
            model,
            choices: vec![TextChoice {
                index: 0,
                text,
                logprobs: asked.then(|| TextLogprobs::from_entries(&logprobs, 0)),
                finish_reason: Some(finish),
            }],
            usage: Some(usage),
        })
        .into_response(),
    })
}

fn server_error(message: String) -> ApiError {
    ApiError {
        status: 500,
        message,
        kind: "server_error",
        code: None,
    }
}

/// Builds the chunks of one stream.
struct Chunker {
    endpoint: Endpoint,
    id: String,
    created: u64,
    model: String,
    logprobs: bool,
    include_usage: bool,
    /// Bytes of text sent, for the legacy `text_offset`.
    offset: usize,
}

fn data<T: serde::Serialize>(value: &T) -> SseEvent {
    SseEvent::default().data(serde_json::to_string(value).unwrap_or_default())
}

impl Chunker {
    fn chat(
        &self,
        delta: Delta,
        logprobs: Option<Vec<TokenLogprob>>,
        finish: Option<FinishReason>,
    ) -> SseEvent {
        data(&ChatCompletionChunk {
            id: self.id.clone(),
            object: "chat.completion.chunk",
            created: self.created,
            model: self.model.clone(),
            choices: vec![ChunkChoice {
                index: 0,
                delta,
                logprobs: logprobs.map(|content| ChatLogprobs { content }),
                finish_reason: finish,
            }],
            usage: None,
        })
    }

    fn text(
        &self,
        text: String,
        logprobs: Option<TextLogprobs>,
        finish: Option<FinishReason>,
    ) -> SseEvent {
        data(&TextCompletion {
            id: self.id.clone(),
            object: "text_completion",
            created: self.created,
            model: self.model.clone(),
            choices: vec![TextChoice {
                index: 0,
                text,
                logprobs,
                finish_reason: finish,
            }],
            usage: None,
        })
    }

    /// The first event: the chat role (text completions have none).
    fn first(&self) -> Option<SseEvent> {
        (self.endpoint == Endpoint::Chat).then(|| {
            self.chat(
                Delta {
                    role: Some("assistant"),
                    content: Some(String::new()),
                },
                None,
                None,
            )
        })
    }

    fn delta(&mut self, text: String, logprobs: Vec<TokenLogprob>) -> SseEvent {
        let lp = self.logprobs.then_some(logprobs);
        match self.endpoint {
            Endpoint::Chat => self.chat(
                Delta {
                    role: None,
                    content: Some(text),
                },
                lp,
                None,
            ),
            Endpoint::Completion => {
                let lp = lp.map(|l| TextLogprobs::from_entries(&l, self.offset));
                self.offset += text.len();
                self.text(text, lp, None)
            }
        }
    }

    /// The last events: the finish reason, the usage when asked for, `[DONE]`.
    fn end(&self, finish: FinishReason, usage: Usage) -> Vec<SseEvent> {
        let mut out = vec![match self.endpoint {
            Endpoint::Chat => self.chat(Delta::default(), None, Some(finish)),
            Endpoint::Completion => self.text(String::new(), None, Some(finish)),
        }];
        if self.include_usage {
            out.push(match self.endpoint {
                Endpoint::Chat => data(&ChatCompletionChunk {
                    id: self.id.clone(),
                    object: "chat.completion.chunk",
                    created: self.created,
                    model: self.model.clone(),
                    choices: Vec::new(),
                    usage: Some(usage),
                }),
                Endpoint::Completion => data(&TextCompletion {
                    id: self.id.clone(),
                    object: "text_completion",
                    created: self.created,
                    model: self.model.clone(),
                    choices: Vec::new(),
                    usage: Some(usage),
                }),
            });
        }
        out.push(SseEvent::default().data("[DONE]"));
        out
    }
}

/// Server-sent events of a generation. Dropping the stream (the client went away)
/// closes `events`, which the scheduler sees at the sequence's next turn.
fn stream(
    state: Arc<AppState>,
    endpoint: Endpoint,
    generation: Generation,
    events: UnboundedReceiver<Event>,
) -> impl IntoResponse {
    let prefix = match endpoint {
        Endpoint::Chat => "chatcmpl",
        Endpoint::Completion => "cmpl",
    };
    let chunker = Chunker {
        endpoint,
        id: state.next_id(prefix),
        created: unix_now(),
        model: state.config.model_name.clone(),
        logprobs: generation.logprobs.is_some(),
        include_usage: generation.include_usage,
        offset: 0,
    };
    let pending: VecDeque<SseEvent> = chunker.first().into_iter().collect();
    let init = (events, chunker, pending, false, state);
    let s = futures_util::stream::unfold(
        init,
        |(mut events, mut chunker, mut pending, mut done, state)| async move {
            loop {
                if let Some(e) = pending.pop_front() {
                    return Some((
                        Ok::<_, Infallible>(e),
                        (events, chunker, pending, done, state),
                    ));
                }
                if done {
                    return None;
                }
                match events.recv().await {
                    Some(Event::Delta { text, logprobs }) => {
                        pending.push_back(chunker.delta(text, logprobs));
                    }
                    Some(Event::Done { finish, usage }) => {
                        pending.extend(chunker.end(finish, usage));
                        done = true;
                    }
                    Some(Event::Failed(why)) => {
                        state.shared.metrics.errors.fetch_add(1, Relaxed);
                        pending.push_back(data(&server_error(why).body()));
                        pending.push_back(SseEvent::default().data("[DONE]"));
                        done = true;
                    }
                    None => return None,
                }
            }
        },
    );
    Sse::new(s).keep_alive(KeepAlive::default())
}
