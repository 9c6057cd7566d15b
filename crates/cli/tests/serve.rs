//! `ballast serve` end to end: a real server process on the default model, driven
//! with plain HTTP/1.1 over a socket (so every status, header and byte of a stream is
//! seen as a client sees it).
//!
//! The default model must be in the model cache (`cargo xtask fetch-model`). Without
//! it these tests fail under CI (`CI` set) and are skipped with a printed reason
//! elsewhere. Generations are short (a few tokens) to keep the suite fast.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

/// The default model's path, or `None` (skip) outside CI when it is not cached.
fn default_model() -> Option<String> {
    let path = ballast_runtime::model_cache::default_model_path().expect("a model cache");
    if path.is_file() {
        return Some(path.to_string_lossy().into_owned());
    }
    if std::env::var_os("CI").is_some() {
        panic!(
            "the default model is not at {} under CI; run `cargo xtask fetch-model`",
            path.display()
        );
    }
    eprintln!(
        "skipped: the default model is not at {} (run `cargo xtask fetch-model`)",
        path.display()
    );
    None
}

/// A `ballast serve` process on a free port, killed when dropped.
struct Server {
    child: Child,
    addr: String,
    model: String,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts a server on the default model with `extra` flags and waits until it is
/// ready. `None` when the model is not cached (outside CI).
fn server(extra: &[&str]) -> Option<Server> {
    let model = default_model()?;
    let mut child = Command::new(env!("CARGO_BIN_EXE_ballast"))
        .args(["serve", "-m", &model, "--port", "0", "-t", "2"])
        .args(extra)
        .stderr(Stdio::piped())
        .stdout(Stdio::null())
        .spawn()
        .expect("starting ballast serve");
    let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
    let addr = loop {
        let line = lines
            .next()
            .expect("ballast serve exited before listening")
            .unwrap();
        if let Some(a) = line.strip_prefix("listening on http://") {
            break a.to_string();
        }
    };
    // Keep reading stderr so the server never blocks on a full pipe.
    std::thread::spawn(move || for _ in lines.by_ref() {});
    let server = Server {
        child,
        addr,
        model: "SmolLM2-135M-Instruct.Q4_1".into(),
    };
    let deadline = Instant::now() + Duration::from_secs(300);
    loop {
        if server.get("/health").status == 200 {
            break;
        }
        assert!(Instant::now() < deadline, "the server never became ready");
        std::thread::sleep(Duration::from_millis(50));
    }
    Some(server)
}

/// One HTTP response.
#[derive(Debug)]
struct Response {
    status: u16,
    headers: Vec<(String, String)>,
    body: String,
}

impl Response {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("not JSON ({e}): {}", self.body))
    }

    /// The `data:` payloads of a server-sent event stream.
    fn events(&self) -> Vec<String> {
        self.body
            .lines()
            .filter_map(|l| l.strip_prefix("data: "))
            .map(str::to_string)
            .collect()
    }
}

/// Removes chunked transfer encoding.
fn dechunk(mut raw: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    loop {
        let Some(end) = raw.windows(2).position(|w| w == b"\r\n") else {
            return out;
        };
        let size = std::str::from_utf8(&raw[..end]).unwrap().trim();
        let size = usize::from_str_radix(size.split(';').next().unwrap(), 16).unwrap();
        if size == 0 {
            return out;
        }
        out.extend_from_slice(&raw[end + 2..end + 2 + size]);
        raw = &raw[end + 2 + size + 2..];
    }
}

/// Sends a request (closing the connection after it) and returns the head and the
/// raw stream of the body.
fn send(addr: &str, method: &str, path: &str, headers: &[(&str, &str)], body: &[u8]) -> TcpStream {
    let mut s = TcpStream::connect(addr).expect("connecting");
    let mut head = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Length: {}\r\n",
        body.len()
    );
    for (k, v) in headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    head.push_str("\r\n");
    s.write_all(head.as_bytes()).unwrap();
    s.write_all(body).unwrap();
    s
}

fn parse(raw: &[u8]) -> Response {
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .expect("a complete head");
    let head = String::from_utf8_lossy(&raw[..split]).into_owned();
    let mut lines = head.lines();
    let status = lines
        .next()
        .unwrap()
        .split(' ')
        .nth(1)
        .unwrap()
        .parse()
        .unwrap();
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_string(), v.trim().to_string()))
        .collect();
    let mut body = raw[split + 4..].to_vec();
    if headers
        .iter()
        .any(|(k, v)| k.eq_ignore_ascii_case("transfer-encoding") && v.contains("chunked"))
    {
        body = dechunk(&body);
    }
    Response {
        status,
        headers,
        body: String::from_utf8(body).expect("a UTF-8 body"),
    }
}

impl Server {
    fn request(&self, method: &str, path: &str, headers: &[(&str, &str)], body: &[u8]) -> Response {
        let mut s = send(&self.addr, method, path, headers, body);
        let mut raw = Vec::new();
        s.read_to_end(&mut raw).expect("reading the response");
        parse(&raw)
    }

    fn get(&self, path: &str) -> Response {
        self.request("GET", path, &[], b"")
    }

    fn post(&self, path: &str, body: &Value) -> Response {
        self.request(
            "POST",
            path,
            &[("Content-Type", "application/json")],
            body.to_string().as_bytes(),
        )
    }

    /// A metric's value from `/metrics`.
    fn metric(&self, name: &str) -> f64 {
        let text = self.get("/metrics").body;
        text.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
            .unwrap_or_else(|| panic!("no metric {name} in\n{text}"))
    }

    /// Greedy text completion of `prompt`, `n` tokens at most.
    fn greedy(&self, prompt: &str, n: usize) -> Value {
        let r = self.post(
            "/v1/completions",
            &json!({"model": self.model, "prompt": prompt, "max_tokens": n, "temperature": 0}),
        );
        assert_eq!(r.status, 200, "{}", r.body);
        r.json()
    }
}

fn check_usage(v: &Value, completion_tokens: Option<u64>) {
    let u = &v["usage"];
    let (p, c, t) = (
        u["prompt_tokens"].as_u64().unwrap(),
        u["completion_tokens"].as_u64().unwrap(),
        u["total_tokens"].as_u64().unwrap(),
    );
    assert!(p > 0, "{v}");
    assert_eq!(p + c, t, "{v}");
    if let Some(n) = completion_tokens {
        assert_eq!(c, n, "{v}");
    }
}

const CHAT: &str = "/v1/chat/completions";
const COMPLETIONS: &str = "/v1/completions";

fn user(text: &str) -> Value {
    json!([{"role": "user", "content": text}])
}

#[test]
fn responses_have_openai_shapes_and_usage() {
    let Some(s) = server(&["--parallel", "1"]) else {
        return;
    };
    let models = s.get("/v1/models").json();
    assert_eq!(models["object"], "list");
    assert_eq!(models["data"][0]["id"], s.model.as_str());

    let r = s.post(
        CHAT,
        &json!({"model": s.model, "messages": user("Say hello."), "max_tokens": 4, "temperature": 0, "ignore_eos": true}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    assert_eq!(v["object"], "chat.completion");
    assert!(v["id"].as_str().unwrap().starts_with("chatcmpl-"), "{v}");
    assert!(v["created"].as_u64().is_some(), "{v}");
    assert_eq!(v["model"], s.model.as_str());
    let choice = &v["choices"][0];
    assert_eq!(choice["message"]["role"], "assistant");
    assert!(!choice["message"]["content"].as_str().unwrap().is_empty());
    assert_eq!(choice["finish_reason"], "length");
    check_usage(&v, Some(4));

    // Content parts are read like a string.
    let parts = json!([{"role": "user", "content": [{"type": "text", "text": "Say hello."}]}]);
    let r2 = s.post(
        CHAT,
        &json!({"messages": parts, "max_tokens": 4, "temperature": 0, "ignore_eos": true}),
    );
    assert_eq!(r2.json()["choices"][0]["message"], choice["message"]);

    let v = s.greedy("The capital of France is", 3);
    assert_eq!(v["object"], "text_completion");
    assert!(v["id"].as_str().unwrap().starts_with("cmpl-"), "{v}");
    assert!(v["choices"][0]["text"].is_string());
    check_usage(&v, None);

    // Log-probabilities: one entry per token, the chosen one the most likely under
    // greedy decoding, alternatives sorted.
    let r = s.post(
        CHAT,
        &json!({"messages": user("Hi"), "max_tokens": 3, "temperature": 0, "ignore_eos": true, "logprobs": true, "top_logprobs": 3}),
    );
    let v = r.json();
    let content = v["choices"][0]["logprobs"]["content"].as_array().unwrap();
    assert_eq!(content.len(), 3, "{v}");
    for t in content {
        let top = t["top_logprobs"].as_array().unwrap();
        assert_eq!(top.len(), 3);
        assert_eq!(top[0]["token"], t["token"], "{t}");
        assert!(top[0]["logprob"].as_f64() >= top[1]["logprob"].as_f64());
        assert!(t["logprob"].as_f64().unwrap() <= 0.0);
    }
}

#[test]
fn streams_send_the_role_first_the_finish_last_one_id_then_done() {
    let Some(s) = server(&["--parallel", "1"]) else {
        return;
    };
    let r = s.post(
        CHAT,
        &json!({"messages": user("Count to five."), "max_tokens": 5, "temperature": 0, "ignore_eos": true,
                "stream": true, "stream_options": {"include_usage": true}}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    assert!(r
        .header("content-type")
        .unwrap()
        .starts_with("text/event-stream"));
    let events = r.events();
    assert_eq!(events.last().unwrap(), "[DONE]");
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    let id = &chunks[0]["id"];
    assert!(chunks
        .iter()
        .all(|c| &c["id"] == id && c["object"] == "chat.completion.chunk"));
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    // The usage chunk comes after the finish, with no choice.
    let usage = chunks.last().unwrap();
    assert_eq!(usage["choices"].as_array().unwrap().len(), 0);
    check_usage(usage, Some(5));
    let finish = &chunks[chunks.len() - 2];
    assert_eq!(finish["choices"][0]["finish_reason"], "length");
    let middle = &chunks[1..chunks.len() - 2];
    assert!(middle
        .iter()
        .all(|c| c["choices"][0]["finish_reason"].is_null()
            && c["choices"][0]["delta"]["role"].is_null()));
    let streamed: String = middle
        .iter()
        .map(|c| c["choices"][0]["delta"]["content"].as_str().unwrap())
        .collect();
    // The same request in one response gives the same text.
    let whole = s.post(
        CHAT,
        &json!({"messages": user("Count to five."), "max_tokens": 5, "temperature": 0, "ignore_eos": true}),
    );
    assert_eq!(
        whole.json()["choices"][0]["message"]["content"],
        streamed.as_str()
    );

    // Text completions stream too; without include_usage there is no usage chunk.
    let r = s.post(
        COMPLETIONS,
        &json!({"prompt": "One, two,", "max_tokens": 3, "temperature": 0, "ignore_eos": true, "stream": true}),
    );
    let events = r.events();
    assert_eq!(events.last().unwrap(), "[DONE]");
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    assert!(chunks
        .iter()
        .all(|c| c["object"] == "text_completion" && c.get("usage").is_none()));
    assert_eq!(
        chunks.last().unwrap()["choices"][0]["finish_reason"],
        "length"
    );
}

#[test]
fn stop_strings_end_the_text_across_tokens_and_are_not_returned() {
    let Some(s) = server(&["--parallel", "1"]) else {
        return;
    };
    let prompt = "Once upon a time, there was a little";
    // The tokens of the greedy continuation, to pick a stop string that spans two.
    let r = s.post(
        COMPLETIONS,
        &json!({"prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": true, "logprobs": 0}),
    );
    let v = r.json();
    let text = v["choices"][0]["text"].as_str().unwrap().to_string();
    let tokens: Vec<String> = v["choices"][0]["logprobs"]["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_str().unwrap().to_string())
        .collect();
    assert_eq!(tokens.concat(), text);
    // The first pair of neighbours with at least two characters each.
    let i = (2..tokens.len() - 1)
        .find(|&i| tokens[i].chars().count() >= 2 && tokens[i + 1].chars().count() >= 2)
        .expect("two neighbouring tokens of two characters");
    let tail: String = tokens[i]
        .chars()
        .rev()
        .take(2)
        .collect::<Vec<_>>()
        .into_iter()
        .rev()
        .collect();
    let head: String = tokens[i + 1].chars().take(2).collect();
    let stop = format!("{tail}{head}");
    let expected = &text[..text.find(&stop).unwrap()];
    for stream in [false, true] {
        let r = s.post(
            COMPLETIONS,
            &json!({"prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": true,
                    "stop": ["NEVER SEEN", stop], "stream": stream}),
        );
        let (got, finish) = if stream {
            let events = r.events();
            let chunks: Vec<Value> = events[..events.len() - 1]
                .iter()
                .map(|e| serde_json::from_str(e).unwrap())
                .collect();
            let text: String = chunks
                .iter()
                .map(|c| c["choices"][0]["text"].as_str().unwrap())
                .collect();
            (
                text,
                chunks.last().unwrap()["choices"][0]["finish_reason"].clone(),
            )
        } else {
            let v = r.json();
            (
                v["choices"][0]["text"].as_str().unwrap().to_string(),
                v["choices"][0]["finish_reason"].clone(),
            )
        };
        assert_eq!(got, expected, "stop {stop:?}, stream {stream}");
        assert_eq!(finish, "stop");
    }
}

#[test]
fn greedy_output_equals_ballast_run() {
    let Some(s) = server(&["--parallel", "2"]) else {
        return;
    };
    let prompt = "The three primary colors are";
    let n = 16;
    let out = Command::new(env!("CARGO_BIN_EXE_ballast"))
        .args([
            "run",
            "-m",
            &default_model().unwrap(),
            prompt,
            "-n",
            &n.to_string(),
            "--temp",
            "0",
            "--no-echo",
            "-t",
            "2",
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let run = String::from_utf8(out.stdout).unwrap();
    let run = run.strip_suffix('\n').unwrap();
    let v = s.greedy(prompt, n);
    assert_eq!(v["choices"][0]["text"].as_str().unwrap(), run);

    // The same prompt again reuses the cached prompt and gives the same text.
    let again = s.greedy(prompt, n);
    assert_eq!(again["choices"][0]["text"], v["choices"][0]["text"]);
    let cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert!(cached > 0, "{again}");
    assert!(s.metric("ballast_prompt_tokens_cached_total") >= cached as f64);
}

#[test]
fn four_concurrent_clients_get_their_own_answers() {
    let Some(s) = server(&["--parallel", "4"]) else {
        return;
    };
    let prompts = ["Paris is", "Water boils at", "The moon", "def fib(n):"];
    let alone: Vec<Value> = prompts
        .iter()
        .map(|p| s.greedy(p, 6)["choices"][0]["text"].clone())
        .collect();
    let together: Vec<Value> = std::thread::scope(|scope| {
        let handles: Vec<_> = prompts
            .iter()
            .map(|p| {
                let s = &s;
                scope.spawn(move || s.greedy(p, 6)["choices"][0]["text"].clone())
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(together, alone);
    // Alone, each pass served one sequence; together, some served several.
    let steps = s.metric("ballast_steps_total");
    let served = s.metric("ballast_step_sequences_total");
    assert!(served > steps, "{served} sequences in {steps} passes");
    assert!(s.metric("ballast_requests_total") >= 8.0);
    assert_eq!(s.metric("ballast_request_errors_total"), 0.0);
}

fn check_error(r: &Response, status: u16) -> Value {
    assert_eq!(r.status, status, "{}", r.body);
    let v = r.json();
    let e = &v["error"];
    assert!(e["message"].as_str().is_some_and(|m| !m.is_empty()), "{v}");
    assert!(e["type"].is_string(), "{v}");
    assert!(e.get("code").is_some(), "{v}");
    v
}

#[test]
fn bad_requests_get_400_with_an_error_object_and_never_a_5xx() {
    let Some(s) = server(&["--parallel", "1", "-c", "64", "--body-limit", "4K"]) else {
        return;
    };
    let raw = |body: &str| {
        s.request(
            "POST",
            CHAT,
            &[("Content-Type", "application/json")],
            body.as_bytes(),
        )
    };
    check_error(&raw("{\"messages\": ["), 400);
    check_error(&raw("not json"), 400);
    check_error(&raw("[]"), 400);
    let m = user("hi");
    for body in [
        json!({"messages": "hi"}),
        json!({"messages": m, "temperature": "hot"}),
        json!({"messages": m, "max_tokens": -1}),
        json!({"messages": m, "top_p": 2}),
        json!({"messages": m, "temperature": -0.5}),
        json!({"messages": m, "n": 2}),
        json!({"messages": m, "stop": 5}),
        json!({"messages": m, "model": "gpt-4o"}),
        json!({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}),
        json!({"prompt": "no messages"}),
    ] {
        let r = s.post(CHAT, &body);
        check_error(&r, 400);
    }
    let long = "word ".repeat(200);
    let v = check_error(&s.post(COMPLETIONS, &json!({"prompt": long})), 400);
    assert_eq!(v["error"]["code"], "context_length_exceeded");
    check_error(&s.post(COMPLETIONS, &json!({"prompt": ["a", "b"]})), 400);
    check_error(&s.post(COMPLETIONS, &json!({"prompt": [999999]})), 400);
    // Over the body limit.
    let big = json!({"prompt": "x".repeat(8 << 10)});
    check_error(&s.post(COMPLETIONS, &big), 413);
    check_error(&s.get("/v1/nothing"), 404);
    // The server is still fine, and counted the errors.
    assert_eq!(
        s.greedy("Hello", 2)["choices"][0]["finish_reason"],
        "length"
    );
    assert!(s.metric("ballast_request_errors_total") >= 10.0);
}

#[test]
fn the_api_key_is_required_when_set_and_cors_preflights_pass() {
    let Some(s) = server(&["--parallel", "1", "--api-key", "sekret"]) else {
        return;
    };
    let body = json!({"prompt": "Hi", "max_tokens": 1}).to_string();
    let post = |headers: &[(&str, &str)]| s.request("POST", COMPLETIONS, headers, body.as_bytes());
    let v = check_error(&post(&[]), 401);
    assert_eq!(v["error"]["type"], "authentication_error");
    check_error(&post(&[("Authorization", "Bearer wrong")]), 401);
    check_error(&s.get("/v1/models"), 401);
    assert_eq!(post(&[("Authorization", "Bearer sekret")]).status, 200);
    assert_eq!(s.get("/health").status, 200);

    // A browser's preflight needs no key, and answers allow the origin.
    let r = s.request(
        "OPTIONS",
        CHAT,
        &[
            ("Origin", "http://example.com"),
            ("Access-Control-Request-Method", "POST"),
            (
                "Access-Control-Request-Headers",
                "authorization, content-type",
            ),
        ],
        b"",
    );
    assert!((200..300).contains(&r.status), "{r:?}");
    assert!(r.header("access-control-allow-origin").is_some(), "{r:?}");
    assert!(
        r.header("access-control-allow-methods")
            .is_some_and(|m| m.contains("POST") || m == "*"),
        "{r:?}"
    );
    let r = s.request(
        "POST",
        COMPLETIONS,
        &[
            ("Origin", "http://example.com"),
            ("Authorization", "Bearer sekret"),
        ],
        body.as_bytes(),
    );
    assert!(r.header("access-control-allow-origin").is_some(), "{r:?}");
}

#[test]
fn a_full_queue_is_503_and_an_aborted_stream_frees_its_sequence() {
    let Some(s) = server(&["--parallel", "1", "--queue", "0"]) else {
        return;
    };
    let body = json!({"prompt": "Tell me a long story.", "max_tokens": 3000, "ignore_eos": true, "stream": true});
    let mut stream = send(
        &s.addr,
        "POST",
        COMPLETIONS,
        &[],
        body.to_string().as_bytes(),
    );
    // Read until the first token arrives: the sequence is running.
    let mut seen = Vec::new();
    let mut buf = [0u8; 4096];
    while seen.windows(6).filter(|w| w == b"data: ").count() < 2 {
        let n = stream.read(&mut buf).unwrap();
        // What came before the end says why (seen once, under load, in a fresh clone).
        assert!(
            n > 0,
            "the stream ended early after: {}",
            String::from_utf8_lossy(&seen)
        );
        seen.extend_from_slice(&buf[..n]);
    }
    assert_eq!(s.metric("ballast_requests_running"), 1.0);
    let v = check_error(
        &s.post(COMPLETIONS, &json!({"prompt": "Hi", "max_tokens": 1})),
        503,
    );
    assert_eq!(v["error"]["code"], "queue_full");
    // The client goes away: its sequence is dropped at its next turn.
    drop(stream);
    let deadline = Instant::now() + Duration::from_secs(60);
    while s.metric("ballast_requests_running") != 0.0 {
        assert!(
            Instant::now() < deadline,
            "the aborted stream kept its sequence"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(s.metric("ballast_requests_cancelled_total"), 1.0);
    assert!(s.metric("ballast_generation_tokens_total") < 3000.0);
    assert_eq!(s.greedy("Hi", 1)["usage"]["completion_tokens"], 1);

    // A client waiting for one whole response that goes away frees its sequence too.
    let body = json!({"prompt": "Tell me a long story.", "max_tokens": 3000, "ignore_eos": true});
    let conn = send(
        &s.addr,
        "POST",
        COMPLETIONS,
        &[],
        body.to_string().as_bytes(),
    );
    let deadline = Instant::now() + Duration::from_secs(60);
    while s.metric("ballast_requests_running") != 1.0 {
        assert!(Instant::now() < deadline, "the request never started");
        std::thread::sleep(Duration::from_millis(20));
    }
    drop(conn);
    let deadline = Instant::now() + Duration::from_secs(60);
    while s.metric("ballast_requests_running") != 0.0 {
        assert!(
            Instant::now() < deadline,
            "the abandoned request kept its sequence"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(s.metric("ballast_requests_cancelled_total"), 2.0);
}

#[test]
fn metrics_name_the_gauges_schedulers_read() {
    let Some(s) = server(&["--parallel", "2"]) else {
        return;
    };
    s.greedy("Hello", 2);
    let r = s.get("/metrics");
    assert_eq!(r.status, 200);
    assert!(r.header("content-type").unwrap().starts_with("text/plain"));
    for name in [
        "ballast_requests_waiting",
        "ballast_requests_running",
        "ballast_kv_cache_usage_ratio",
        "ballast_prompt_tokens_per_second",
        "ballast_generation_tokens_per_second",
    ] {
        assert!(
            r.body.contains(&format!("# TYPE {name} gauge")),
            "{name}:\n{}",
            r.body
        );
    }
    assert_eq!(s.metric("ballast_requests_total"), 1.0);
    assert_eq!(s.metric("ballast_generation_tokens_total"), 2.0);
    assert!(s.metric("ballast_prompt_tokens_per_second") > 0.0);
    // Nothing runs now: no KV in use.
    assert_eq!(s.metric("ballast_kv_cache_usage_ratio"), 0.0);
    assert!(
        s.metric("ballast_weight_bytes{tier=\"device\"}")
            + s.metric("ballast_weight_bytes{tier=\"disk\"}")
            > 0.0
    );
}

/// On the GPU with layers streamed from RAM (`--store tiered --vram`), a step over
/// four sequences is one device pass: each streamed layer is uploaded once per step
/// whatever the number of sequences, and each answer is the one it gets alone.
#[test]
fn on_the_gpu_a_step_uploads_each_streamed_layer_once_for_every_sequence() {
    if ballast_runtime::testing::gpu_for_tests().is_none() {
        return;
    }
    let Some(s) = server(&[
        "--parallel",
        "4",
        "--device",
        "gpu",
        "--store",
        "tiered",
        "--vram",
        "100M",
        "--ram",
        "200M",
        "-c",
        "64",
    ]) else {
        return;
    };
    let counters = |s: &Server| {
        (
            s.metric("ballast_device_weight_bytes_uploaded_total"),
            s.metric("ballast_steps_total"),
        )
    };
    let prompts = ["Paris is", "Water boils at", "The moon", "def fib(n):"];
    let (u0, s0) = counters(&s);
    let alone: Vec<Value> = prompts
        .iter()
        .map(|p| s.greedy(p, 4)["choices"][0]["text"].clone())
        .collect();
    let (u1, s1) = counters(&s);
    let solo = (u1 - u0) / (s1 - s0);
    assert!(solo > 0.0, "the plan streams some layers");
    let together: Vec<Value> = std::thread::scope(|scope| {
        let handles: Vec<_> = prompts
            .iter()
            .map(|p| {
                let s = &s;
                scope.spawn(move || s.greedy(p, 4)["choices"][0]["text"].clone())
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let (u2, s2) = counters(&s);
    let (batched, steps) = ((u2 - u1) / (s2 - s1), s2 - s1);
    assert_eq!(together, alone);
    assert_eq!(batched, solo, "bytes uploaded per step");
    assert!(steps < 4.0 * 5.0, "{steps} steps");
}

/// `--draft ngram`: each slot drafts for itself and every step verifies each slot's
/// draft in its one pass; concurrent clients get the text a server without
/// speculation gives them, and `/metrics` says how many drafted tokens were accepted.
#[test]
fn speculative_slots_give_each_client_the_plain_text() {
    let Some(plain) = server(&["--parallel", "3"]) else {
        return;
    };
    let Some(spec) = server(&["--parallel", "3", "--draft", "ngram", "--draft-max", "4"]) else {
        return;
    };
    let prompts = [
        "one two three, one two three, one two",
        "def add(a, b):\n    return a + b\n\ndef add(a, b):",
        "The cat sat. The cat sat. The",
    ];
    let texts = |s: &Server| -> Vec<Value> {
        std::thread::scope(|scope| {
            let handles: Vec<_> = prompts
                .iter()
                .map(|p| scope.spawn(move || s.greedy(p, 24)["choices"][0]["text"].clone()))
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        })
    };
    assert_eq!(texts(&spec), texts(&plain));
    let drafted = spec.metric("ballast_draft_tokens_total");
    let accepted = spec.metric("ballast_draft_tokens_accepted_total");
    assert!(
        drafted > 0.0 && accepted <= drafted,
        "{accepted} of {drafted}"
    );
    let ratio = spec.metric("ballast_draft_acceptance_ratio");
    assert!((ratio - accepted / drafted).abs() < 1e-9, "{ratio}");
    assert_eq!(plain.metric("ballast_draft_tokens_total"), 0.0);
    assert_eq!(spec.metric("ballast_request_errors_total"), 0.0);
}
