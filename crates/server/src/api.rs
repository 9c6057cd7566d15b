//! The wire format: requests as clients send them (unknown fields accepted), their
//! validation into [`Generation`] parameters, and the responses and stream chunks.
//!
//! Parsing is a pure function of the body ([`parse_request`]), so it is tested
//! without a server: any byte string gives a request or a 400 [`ApiError`], never a
//! panic.

use ballast_runtime::SamplerConfig;
use serde::{Deserialize, Serialize};

/// An error answered to a client: HTTP status plus OpenAI's error object
/// (`{"error": {"message", "type", "code"}}`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ApiError {
    /// HTTP status code.
    pub status: u16,
    /// What went wrong, for a person.
    pub message: String,
    /// OpenAI's error `type`, e.g. `invalid_request_error`.
    pub kind: &'static str,
    /// A machine-readable `code`, when one applies.
    pub code: Option<&'static str>,
}

impl ApiError {
    /// A 400: the request itself is wrong.
    pub fn invalid(message: impl Into<String>) -> ApiError {
        ApiError {
            status: 400,
            message: message.into(),
            kind: "invalid_request_error",
            code: None,
        }
    }

    /// Sets the `code`.
    pub fn with_code(mut self, code: &'static str) -> ApiError {
        self.code = Some(code);
        self
    }

    /// The JSON body.
    pub fn body(&self) -> serde_json::Value {
        serde_json::json!({"error": {
            "message": self.message,
            "type": self.kind,
            "code": self.code,
        }})
    }
}

/// `messages[i].content`: a string, or a list of content parts (only text parts can be
/// read by a text model).
#[derive(Clone, Debug, Deserialize)]
#[serde(untagged)]
pub enum Content {
    /// Plain text.
    Text(String),
    /// Content parts, `{"type": "text", "text": "..."}`.
    Parts(Vec<ContentPart>),
}

/// One content part.
#[derive(Clone, Debug, Deserialize)]
pub struct ContentPart {
    /// `"text"` is the only type a text model reads.
    #[serde(rename = "type")]
    pub kind: String,
    /// The text of a text part.
    pub text: Option<String>,
}

/// One message of a chat request.
#[derive(Clone, Debug, Deserialize)]
pub struct Message {
    /// `system`, `user`, `assistant`, ...
    pub role: String,
    /// The text (null for an assistant message that only called tools).
    pub content: Option<Content>,
}

/// `prompt` of a text completion: a string, or token ids. A list of several prompts
/// is a batch, which this server refuses like `n > 1`.
#[derive(Clone, Debug, Deserialize)]
#[serde(untagged)]
pub enum Prompt {
    /// One prompt.
    Text(String),
    /// Prompts (only one is served).
    Texts(Vec<String>),
    /// One prompt as token ids.
    Tokens(Vec<u32>),
    /// Prompts as token ids (only one is served).
    TokenLists(Vec<Vec<u32>>),
}

/// `stop`: one string or several.
#[derive(Clone, Debug, Deserialize)]
#[serde(untagged)]
pub enum Stop {
    /// One stop string.
    One(String),
    /// Several.
    Many(Vec<String>),
}

/// `logprobs`: a boolean on chat completions, a count of alternatives on text ones.
#[derive(Clone, Copy, Debug, Deserialize)]
#[serde(untagged)]
pub enum LogprobsField {
    /// Chat: whether to return them (`top_logprobs` says how many alternatives).
    Enabled(bool),
    /// Text completions: how many alternatives per token.
    Count(u32),
}

/// `stream_options`.
#[derive(Clone, Copy, Debug, Default, Deserialize)]
pub struct StreamOptions {
    /// Send a last chunk with the token counts.
    pub include_usage: Option<bool>,
}

/// A chat or text completion request. Both endpoints share it: `messages` is read by
/// `/v1/chat/completions`, `prompt` by `/v1/completions`. Fields this server does not
/// know are ignored, as OpenAI-compatible servers do.
#[derive(Clone, Debug, Default, Deserialize)]
pub struct CompletionRequest {
    /// The model asked for; must be the served one when given.
    pub model: Option<String>,
    /// The conversation (chat).
    pub messages: Option<Vec<Message>>,
    /// The prompt (text completion).
    pub prompt: Option<Prompt>,
    /// Most tokens to generate.
    pub max_tokens: Option<u64>,
    /// The newer name of `max_tokens` (it wins when both are given).
    pub max_completion_tokens: Option<u64>,
    /// Softmax temperature, 0 for greedy.
    pub temperature: Option<f32>,
    /// Nucleus sampling mass in `[0, 1]`.
    pub top_p: Option<f32>,
    /// Keep the k most likely tokens (0: all).
    pub top_k: Option<u64>,
    /// Drop tokens below `min_p` times the most likely one's probability.
    pub min_p: Option<f32>,
    /// Seed of the sampler (same seed, same text).
    pub seed: Option<i64>,
    /// Strings that end the generation; they are not returned.
    pub stop: Option<Stop>,
    /// OpenAI's presence penalty in `[-2, 2]`: subtracted from the logit of every token
    /// already generated.
    pub presence_penalty: Option<f32>,
    /// OpenAI's frequency penalty in `[-2, 2]`: subtracted once per earlier occurrence.
    pub frequency_penalty: Option<f32>,
    /// llama.cpp's repetition penalty (1: none).
    pub repeat_penalty: Option<f32>,
    /// How many last tokens the repetition penalty looks at.
    pub repeat_last_n: Option<u64>,
    /// Keep generating past end-of-generation tokens (llama-server's extension).
    pub ignore_eos: Option<bool>,
    /// Server-sent events instead of one response.
    pub stream: Option<bool>,
    /// Streaming options.
    pub stream_options: Option<StreamOptions>,
    /// Completions per prompt; only 1 is served.
    pub n: Option<u64>,
    /// Log-probabilities (see [`LogprobsField`]).
    pub logprobs: Option<LogprobsField>,
    /// Alternatives per token with chat `logprobs: true`, at most 20.
    pub top_logprobs: Option<u64>,
}

/// Which endpoint a request came to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Endpoint {
    /// `/v1/chat/completions`.
    Chat,
    /// `/v1/completions`.
    Completion,
}

/// What the model is asked to continue.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Input {
    /// A conversation, to render with the chat template.
    Chat(Vec<(String, String)>),
    /// Text, to tokenize.
    Text(String),
    /// Token ids, fed as given.
    Tokens(Vec<u32>),
}

/// The validated parameters of one generation.
#[derive(Clone, Debug, PartialEq)]
pub struct Generation {
    /// What to continue.
    pub input: Input,
    /// Most tokens to generate (the context bounds it too).
    pub max_tokens: Option<usize>,
    /// The sampler; its seed is `None`'s replacement when the request gave none.
    pub sampler: SamplerConfig,
    /// Whether the request named a seed.
    pub seeded: bool,
    /// Stop strings (non-empty ones).
    pub stop: Vec<String>,
    /// OpenAI's presence penalty.
    pub presence_penalty: f32,
    /// OpenAI's frequency penalty.
    pub frequency_penalty: f32,
    /// Alternatives per token when log-probabilities are asked for.
    pub logprobs: Option<usize>,
    /// Keep going past end-of-generation tokens.
    pub ignore_eos: bool,
    /// Stream as server-sent events.
    pub stream: bool,
    /// Send the usage chunk at the end of a stream.
    pub include_usage: bool,
}

/// Most stop strings a request may give (OpenAI allows 4; llama-server more).
pub const MAX_STOPS: usize = 16;
/// Most alternatives per token.
pub const MAX_TOP_LOGPROBS: usize = 20;

fn range(name: &str, v: Option<f32>, lo: f32, hi: f32) -> Result<Option<f32>, ApiError> {
    match v {
        Some(x) if !(x.is_finite() && (lo..=hi).contains(&x)) => Err(ApiError::invalid(format!(
            "`{name}` must be between {lo} and {hi}, got {x}"
        ))),
        _ => Ok(v),
    }
}

/// Parses and validates a request body for `endpoint`, serving the model `served`.
/// Every failure is a 400 [`ApiError`] naming the field.
pub fn parse_request(
    body: &[u8],
    endpoint: Endpoint,
    served: &str,
) -> Result<Generation, ApiError> {
    let req: CompletionRequest = serde_json::from_slice(body)
        .map_err(|e| ApiError::invalid(format!("the body is not a valid request: {e}")))?;
    validate(req, endpoint, served)
}

/// Validates a parsed request (see [`parse_request`]).
pub fn validate(
    req: CompletionRequest,
    endpoint: Endpoint,
    served: &str,
) -> Result<Generation, ApiError> {
    if let Some(model) = &req.model {
        if !model_matches(model, served) {
            return Err(ApiError::invalid(format!(
                "the model `{model}` is not served here; this server serves `{served}`"
            ))
            .with_code("model_not_found"));
        }
    }
    if let Some(n) = req.n {
        if n != 1 {
            return Err(ApiError::invalid(format!(
                "`n` must be 1 (one completion per request), got {n}"
            )));
        }
    }
    let input = match endpoint {
        Endpoint::Chat => {
            let messages = req
                .messages
                .ok_or_else(|| ApiError::invalid("`messages` is required"))?;
            if messages.is_empty() {
                return Err(ApiError::invalid("`messages` must not be empty"));
            }
            let mut out = Vec::with_capacity(messages.len());
            for (i, m) in messages.into_iter().enumerate() {
                let text = match m.content {
                    None => String::new(),
                    Some(Content::Text(t)) => t,
                    Some(Content::Parts(parts)) => {
                        let mut text = String::new();
                        for p in parts {
                            match (p.kind.as_str(), p.text) {
                                ("text", Some(t)) => text.push_str(&t),
                                (kind, _) => {
                                    return Err(ApiError::invalid(format!(
                                    "messages[{i}]: content parts of type `{kind}` (without text) \
                                     cannot be read by a text model"
                                )))
                                }
                            }
                        }
                        text
                    }
                };
                out.push((m.role, text));
            }
            Input::Chat(out)
        }
        Endpoint::Completion => match req.prompt {
            None => return Err(ApiError::invalid("`prompt` is required")),
            Some(Prompt::Text(t)) => Input::Text(t),
            Some(Prompt::Tokens(t)) => Input::Tokens(t),
            Some(Prompt::Texts(mut v)) if v.len() == 1 => Input::Text(v.remove(0)),
            Some(Prompt::TokenLists(mut v)) if v.len() == 1 => Input::Tokens(v.remove(0)),
            Some(_) => {
                return Err(ApiError::invalid(
                    "`prompt` must be one prompt (a batch of prompts is not served)",
                ))
            }
        },
    };
    let defaults = SamplerConfig::default();
    let temperature = range("temperature", req.temperature, 0.0, f32::MAX)?;
    let top_p = range("top_p", req.top_p, 0.0, 1.0)?;
    let min_p = range("min_p", req.min_p, 0.0, 1.0)?;
    let presence = range("presence_penalty", req.presence_penalty, -2.0, 2.0)?;
    let frequency = range("frequency_penalty", req.frequency_penalty, -2.0, 2.0)?;
    let repeat = range("repeat_penalty", req.repeat_penalty, 0.0, f32::MAX)?;
    if repeat == Some(0.0) {
        return Err(ApiError::invalid("`repeat_penalty` must be positive"));
    }
    let max_tokens = match req.max_completion_tokens.or(req.max_tokens) {
        Some(0) => return Err(ApiError::invalid("`max_tokens` must be at least 1")),
        Some(n) => Some(usize::try_from(n).unwrap_or(usize::MAX)),
        None => None,
    };
    let stop = match req.stop {
        None => Vec::new(),
        Some(Stop::One(s)) => vec![s],
        Some(Stop::Many(v)) => v,
    };
    if stop.len() > MAX_STOPS {
        return Err(ApiError::invalid(format!(
            "`stop` has {} strings, at most {MAX_STOPS} are allowed",
            stop.len()
        )));
    }
    let stop: Vec<String> = stop.into_iter().filter(|s| !s.is_empty()).collect();
    let logprobs = match (endpoint, req.logprobs) {
        (_, None) | (_, Some(LogprobsField::Enabled(false))) => None,
        (Endpoint::Chat, Some(LogprobsField::Enabled(true))) => Some(req.top_logprobs.unwrap_or(0)),
        (Endpoint::Completion, Some(LogprobsField::Count(n))) => Some(u64::from(n)),
        (Endpoint::Chat, Some(LogprobsField::Count(_))) => {
            return Err(ApiError::invalid(
                "`logprobs` must be a boolean here (`top_logprobs` gives the count)",
            ))
        }
        (Endpoint::Completion, Some(LogprobsField::Enabled(true))) => {
            return Err(ApiError::invalid(
                "`logprobs` must be an integer here (alternatives per token)",
            ))
        }
    };
    if let Some(n) = logprobs {
        if n > MAX_TOP_LOGPROBS as u64 {
            return Err(ApiError::invalid(format!(
                "at most {MAX_TOP_LOGPROBS} alternatives per token, got {n}"
            )));
        }
    }
    let stream = req.stream.unwrap_or(false);
    Ok(Generation {
        input,
        max_tokens,
        sampler: SamplerConfig {
            temperature: temperature.unwrap_or(defaults.temperature),
            top_k: req
                .top_k
                .map_or(defaults.top_k, |k| usize::try_from(k).unwrap_or(0)),
            top_p: top_p.unwrap_or(defaults.top_p),
            min_p: min_p.unwrap_or(defaults.min_p),
            repeat_penalty: repeat.unwrap_or(defaults.repeat_penalty),
            repeat_last_n: req
                .repeat_last_n
                .map_or(defaults.repeat_last_n, |n| usize::try_from(n).unwrap_or(0)),
            seed: req.seed.map_or(defaults.seed, |s| s as u64),
        },
        seeded: req.seed.is_some(),
        stop,
        presence_penalty: presence.unwrap_or(0.0),
        frequency_penalty: frequency.unwrap_or(0.0),
        logprobs: logprobs.map(|n| n as usize),
        ignore_eos: req.ignore_eos.unwrap_or(false),
        stream,
        include_usage: stream
            && req
                .stream_options
                .and_then(|o| o.include_usage)
                .unwrap_or(false),
    })
}

/// Whether a request's `model` names the served one: its name, or the file name.
fn model_matches(asked: &str, served: &str) -> bool {
    asked == served || asked.strip_suffix(".gguf") == Some(served)
}

/// Token counts of a response.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Usage {
    /// Tokens of the prompt (after the chat template).
    pub prompt_tokens: usize,
    /// Tokens generated.
    pub completion_tokens: usize,
    /// The sum.
    pub total_tokens: usize,
    /// Of the prompt tokens, how many were found in the cache.
    pub prompt_tokens_details: PromptTokensDetails,
}

/// `usage.prompt_tokens_details`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct PromptTokensDetails {
    /// Prompt tokens whose keys and values were reused from an earlier request.
    pub cached_tokens: usize,
}

/// Why a generation ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// An end-of-generation token or a stop string.
    Stop,
    /// `max_tokens` or the context.
    Length,
}

/// One alternative token and its log-probability (chat format).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct TopLogprob {
    /// The token's text.
    pub token: String,
    /// Natural log of its probability.
    pub logprob: f32,
    /// The token's UTF-8 bytes.
    pub bytes: Vec<u8>,
}

/// A generated token with its log-probability and the most likely alternatives (chat
/// format).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct TokenLogprob {
    /// The token's text.
    pub token: String,
    /// Natural log of its probability.
    pub logprob: f32,
    /// The token's UTF-8 bytes.
    pub bytes: Vec<u8>,
    /// The most likely tokens at this step, most likely first.
    pub top_logprobs: Vec<TopLogprob>,
}

/// `choices[i].logprobs` of a chat completion.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ChatLogprobs {
    /// One entry per generated token.
    pub content: Vec<TokenLogprob>,
}

/// `choices[i].logprobs` of a text completion (the legacy layout).
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct TextLogprobs {
    /// Token texts.
    pub tokens: Vec<String>,
    /// Their log-probabilities.
    pub token_logprobs: Vec<f32>,
    /// The alternatives at each step, text to log-probability.
    pub top_logprobs: Vec<std::collections::BTreeMap<String, f32>>,
    /// Where each token starts in the returned text.
    pub text_offset: Vec<usize>,
}

impl TextLogprobs {
    /// The legacy layout of `entries`, the first of which starts at `offset`.
    pub fn from_entries(entries: &[TokenLogprob], mut offset: usize) -> TextLogprobs {
        let mut out = TextLogprobs::default();
        for e in entries {
            out.tokens.push(e.token.clone());
            out.token_logprobs.push(e.logprob);
            out.top_logprobs.push(
                e.top_logprobs
                    .iter()
                    .map(|t| (t.token.clone(), t.logprob))
                    .collect(),
            );
            out.text_offset.push(offset);
            offset += e.token.len();
        }
        out
    }
}

/// The assistant's message.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ResponseMessage {
    /// Always `assistant`.
    pub role: &'static str,
    /// The generated text.
    pub content: String,
}

/// One choice of a chat completion.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ChatChoice {
    /// Always 0 (one choice per request).
    pub index: usize,
    /// The answer.
    pub message: ResponseMessage,
    /// Log-probabilities, when asked for.
    pub logprobs: Option<ChatLogprobs>,
    /// Why it ended.
    pub finish_reason: FinishReason,
}

/// A chat completion (`object: "chat.completion"`).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ChatCompletion {
    /// `chatcmpl-...`.
    pub id: String,
    /// `chat.completion`.
    pub object: &'static str,
    /// Unix seconds.
    pub created: u64,
    /// The served model.
    pub model: String,
    /// One choice.
    pub choices: Vec<ChatChoice>,
    /// Token counts.
    pub usage: Usage,
}

/// The delta of a chat stream chunk.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Delta {
    /// `assistant` in the first chunk only.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub role: Option<&'static str>,
    /// New text.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
}

/// One choice of a chat stream chunk.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ChunkChoice {
    /// Always 0.
    pub index: usize,
    /// What is new.
    pub delta: Delta,
    /// Log-probabilities of the tokens of this chunk, when asked for.
    pub logprobs: Option<ChatLogprobs>,
    /// Set in the last chunk of the choice.
    pub finish_reason: Option<FinishReason>,
}

/// A chat stream chunk (`object: "chat.completion.chunk"`).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ChatCompletionChunk {
    /// The same for every chunk of a stream.
    pub id: String,
    /// `chat.completion.chunk`.
    pub object: &'static str,
    /// Unix seconds.
    pub created: u64,
    /// The served model.
    pub model: String,
    /// One choice; none in the usage chunk.
    pub choices: Vec<ChunkChoice>,
    /// Token counts, in the usage chunk only (null before it when asked for).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
}

/// One choice of a text completion or of its stream chunk.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct TextChoice {
    /// Always 0.
    pub index: usize,
    /// The generated text (of this chunk when streaming).
    pub text: String,
    /// Log-probabilities, when asked for.
    pub logprobs: Option<TextLogprobs>,
    /// Why it ended (in the last chunk when streaming).
    pub finish_reason: Option<FinishReason>,
}

/// A text completion, or one chunk of its stream (`object: "text_completion"`).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct TextCompletion {
    /// `cmpl-...`, the same for every chunk of a stream.
    pub id: String,
    /// `text_completion`.
    pub object: &'static str,
    /// Unix seconds.
    pub created: u64,
    /// The served model.
    pub model: String,
    /// One choice; none in the usage chunk.
    pub choices: Vec<TextChoice>,
    /// Token counts (in a stream, in the usage chunk only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
}

/// `GET /v1/models`.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ModelList {
    /// `list`.
    pub object: &'static str,
    /// The served model.
    pub data: Vec<ModelCard>,
}

/// One model of [`ModelList`].
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ModelCard {
    /// The name requests use.
    pub id: String,
    /// `model`.
    pub object: &'static str,
    /// Unix seconds when the server started.
    pub created: u64,
    /// `ballast`.
    pub owned_by: &'static str,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chat(body: &str) -> Result<Generation, ApiError> {
        parse_request(body.as_bytes(), Endpoint::Chat, "m")
    }

    #[test]
    fn content_parts_and_unknown_fields_are_read() {
        let g = chat(
            r#"{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]}],"tools":[],"user":"x"}"#,
        )
        .unwrap();
        assert_eq!(g.input, Input::Chat(vec![("user".into(), "ab".into())]));
    }

    #[test]
    fn out_of_range_and_wrong_types_are_400() {
        for body in [
            r#"{"messages":[{"role":"user","content":"a"}],"top_p":2}"#,
            r#"{"messages":[{"role":"user","content":"a"}],"temperature":-1}"#,
            r#"{"messages":[{"role":"user","content":"a"}],"temperature":"hot"}"#,
            r#"{"messages":[{"role":"user","content":"a"}],"n":2}"#,
            r#"{"messages":[{"role":"user","content":"a"}],"model":"other"}"#,
            r#"{"messages":[]}"#,
            r#"{"messages":"#,
            r#"{"messages":[{"role":"user","content":[{"type":"image_url"}]}]}"#,
        ] {
            let e = chat(body).unwrap_err();
            assert_eq!(e.status, 400, "{body}");
        }
    }

    #[test]
    fn max_completion_tokens_wins_and_stop_accepts_a_string_or_a_list() {
        let g = parse_request(
            br#"{"prompt":"x","max_tokens":5,"max_completion_tokens":3,"stop":"\n"}"#,
            Endpoint::Completion,
            "m",
        )
        .unwrap();
        assert_eq!(g.max_tokens, Some(3));
        assert_eq!(g.stop, vec!["\n".to_string()]);
        let g = parse_request(
            br#"{"prompt":["x"],"stop":["a","","b"]}"#,
            Endpoint::Completion,
            "m",
        )
        .unwrap();
        assert_eq!(g.stop, vec!["a".to_string(), "b".to_string()]);
        assert_eq!(g.input, Input::Text("x".into()));
    }
}
