//! The server in process on a tiny random model: 503 while the loader runs, 200 once
//! it is done; a loader's error ends `serve` with that error.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ballast_runtime::gguf::GgufFile;
use ballast_runtime::testing::TinyModelSpec;
use ballast_runtime::{CpuBackend, Model, Session, Tokenizer};
use ballast_server::{serve, BoxError, Engine, Error, ServerConfig};

fn tiny_engine() -> Engine {
    let file =
        Arc::new(GgufFile::from_bytes(TinyModelSpec::default().to_gguf_bytes().unwrap()).unwrap());
    let tokenizer = Tokenizer::from_gguf(&file).unwrap();
    let model = Model::load(file, Arc::new(CpuBackend::new(1)), false).unwrap();
    Engine {
        sessions: vec![
            Session::new(model.share(), 64).unwrap(),
            Session::new(model.share(), 64).unwrap(),
        ],
        model,
        tokenizer,
        chat_template: None,
        speculation: None,
    }
}

/// Status and body of one request.
fn request(addr: &str, method: &str, path: &str, body: &str) -> (u16, serde_json::Value) {
    let mut s = TcpStream::connect(addr).unwrap();
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut raw = String::new();
    s.read_to_string(&mut raw).unwrap();
    let status = raw.split(' ').nth(1).unwrap().parse().unwrap();
    let body = raw.split_once("\r\n\r\n").unwrap().1;
    (
        status,
        serde_json::from_str(body).unwrap_or(serde_json::Value::Null),
    )
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap()
}

#[test]
fn health_is_503_while_loading_then_200() {
    let rt = runtime();
    let listener = rt
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let (go, wait) = std::sync::mpsc::channel::<()>();
    let load = move || -> Result<Engine, BoxError> {
        wait.recv().unwrap();
        Ok(tiny_engine())
    };
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = rt.spawn(serve(listener, ServerConfig::new("tiny"), load, async {
        let _ = stopped.await;
    }));

    let (status, body) = request(&addr, "GET", "/health", "");
    assert_eq!(status, 503);
    assert_eq!(body["error"]["type"], "unavailable_error");
    let completion =
        r#"{"prompt": [72, 105], "max_tokens": 3, "ignore_eos": true, "temperature": 0}"#;
    let (status, body) = request(&addr, "POST", "/v1/completions", completion);
    assert_eq!(status, 503, "{body}");
    assert_eq!(body["error"]["code"], "loading");
    // The model list does not need the model.
    let (status, body) = request(&addr, "GET", "/v1/models", "");
    assert_eq!((status, &body["data"][0]["id"]), (200, &"tiny".into()));

    go.send(()).unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    while request(&addr, "GET", "/health", "").0 != 200 {
        assert!(Instant::now() < deadline, "never ready");
        std::thread::sleep(Duration::from_millis(10));
    }
    let (status, body) = request(&addr, "POST", "/v1/completions", completion);
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["usage"]["completion_tokens"], 3);
    assert_eq!(body["usage"]["prompt_tokens"], 2);
    // No chat template in this model: chat is refused as a request the model cannot
    // serve, not as a server failure.
    let (status, body) = request(
        &addr,
        "POST",
        "/v1/chat/completions",
        r#"{"messages": [{"role": "user", "content": "hi"}]}"#,
    );
    assert_eq!(status, 400, "{body}");
    assert_eq!(body["error"]["code"], "no_chat_template");

    stop.send(()).unwrap();
    rt.block_on(server).unwrap().unwrap();
}

#[test]
fn a_loader_error_ends_serve_with_it() {
    let rt = runtime();
    let listener = rt
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .unwrap();
    let load = || -> Result<Engine, BoxError> { Err("no such model file".into()) };
    let r = rt.block_on(serve(
        listener,
        ServerConfig::new("x"),
        load,
        std::future::pending(),
    ));
    match r {
        Err(e @ Error::Load(_)) => assert!(e.to_string().contains("no such model file"), "{e}"),
        other => panic!("expected a load error, got {other:?}"),
    }
    let empty = || -> Result<Engine, BoxError> {
        let mut e = tiny_engine();
        e.sessions.clear();
        Ok(e)
    };
    let listener = rt
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .unwrap();
    let r = rt.block_on(serve(
        listener,
        ServerConfig::new("x"),
        empty,
        std::future::pending(),
    ));
    assert!(matches!(r, Err(Error::NoSession)), "{r:?}");
}
