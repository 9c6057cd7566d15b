//! A sliding-window model served with caches that keep only each windowed layer's window:
//! a prompt sharing a prefix with the slot's last one cannot reuse keys the window
//! dropped, so the slot starts over, and the answer is what a fresh server gives.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ballast_runtime::gguf::GgufFile;
use ballast_runtime::testing::reference_spec;
use ballast_runtime::{CpuBackend, Model, Session, Tokenizer};
use ballast_server::{serve, BoxError, Engine, ServerConfig};

/// The tiny gemma3 (a window of 4 tokens on two of its three layers), one slot whose
/// cache keeps only the window plus a chunk of 4.
fn gemma_engine() -> Engine {
    let spec = reference_spec("gemma3").unwrap();
    let file = Arc::new(GgufFile::from_bytes(spec.to_gguf_bytes().unwrap()).unwrap());
    let tokenizer = Tokenizer::from_gguf(&file).unwrap();
    let model = Model::load(file, Arc::new(CpuBackend::new(1)), false).unwrap();
    Engine {
        sessions: vec![Session::with_batch(model.share(), 64, 4).unwrap()],
        model,
        tokenizer,
        chat_template: None,
        speculation: None,
    }
}

fn post(addr: &str, body: &str) -> serde_json::Value {
    let mut s = TcpStream::connect(addr).unwrap();
    write!(
        s,
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut raw = String::new();
    s.read_to_string(&mut raw).unwrap();
    assert!(raw.starts_with("HTTP/1.1 200"), "{raw}");
    serde_json::from_str(raw.split_once("\r\n\r\n").unwrap().1).unwrap()
}

/// Runs `requests` one after another on a fresh server; their response bodies.
fn serve_each(requests: &[String]) -> Vec<serde_json::Value> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let listener = rt
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let load = || -> Result<Engine, BoxError> { Ok(gemma_engine()) };
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = rt.spawn(serve(listener, ServerConfig::new("gemma"), load, async {
        let _ = stopped.await;
    }));
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut out = Vec::new();
    for body in requests {
        loop {
            // Until the loader has run, requests are 503: retry.
            let mut s = TcpStream::connect(&addr).unwrap();
            write!(
                s,
                "GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
            )
            .unwrap();
            let mut raw = String::new();
            s.read_to_string(&mut raw).unwrap();
            if raw.starts_with("HTTP/1.1 200") {
                break;
            }
            assert!(Instant::now() < deadline, "never ready");
            std::thread::sleep(Duration::from_millis(10));
        }
        out.push(post(&addr, body));
    }
    stop.send(()).unwrap();
    rt.block_on(server).unwrap().unwrap();
    out
}

fn completion(prompt: &[u32]) -> String {
    format!(
        r#"{{"prompt": {prompt:?}, "max_tokens": 6, "ignore_eos": true, "temperature": 0, "logprobs": 1}}"#
    )
}

#[test]
fn a_prefix_the_window_dropped_is_recomputed() {
    let first: Vec<u32> = (0..14u32).map(|i| 40 + (i * 7) % 50).collect();
    let mut second = first[..12].to_vec();
    second.extend([99, 100]);
    let both = serve_each(&[completion(&first), completion(&second)]);
    let fresh = serve_each(&[completion(&second)]);
    // The log-probabilities too, to the bit: the same computation, not a near one.
    let tokens = |v: &serde_json::Value| v["choices"][0]["logprobs"].clone();
    assert!(
        tokens(&fresh[0])["token_logprobs"][5].is_number(),
        "{}",
        fresh[0]
    );
    assert_eq!(
        tokens(&both[1]),
        tokens(&fresh[0]),
        "{} vs {}",
        both[1],
        fresh[0]
    );
    assert_eq!(
        both[1]["choices"][0]["text"],
        fresh[0]["choices"][0]["text"]
    );
    // Twelve prompt tokens are shared, but the windowed layers no longer hold them.
    assert_eq!(
        both[1]["usage"]["prompt_tokens_details"]["cached_tokens"],
        0
    );
}
