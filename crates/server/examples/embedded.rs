//! `ballast-server` inside another axum app: the OpenAI-compatible routes under
//! `/llm`, beside the app's own `/`. The example asks itself three requests and exits;
//! with `--serve` it keeps serving until Ctrl-C.
//!
//! Run: `cargo run -p ballast-server --example embedded -- [MODEL.gguf] [--serve]`
//! (without a model file, a tiny random model: the text is noise, the plumbing real).

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;

use axum::routing::get;
use ballast_runtime::gguf::GgufFile;
use ballast_runtime::testing::TinyModelSpec;
use ballast_runtime::{CpuBackend, Model, Session, Tokenizer};
use ballast_server::{Engine, ServerConfig};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

fn load(path: Option<&str>) -> Result<Engine, BoxError> {
    let file = Arc::new(match path {
        Some(path) => GgufFile::open(path.as_ref(), true)?,
        None => GgufFile::from_bytes(TinyModelSpec::default().to_gguf_bytes()?)?,
    });
    let tokenizer = Tokenizer::from_gguf(&file)?;
    let chat_template = file
        .get_str_opt("tokenizer.chat_template")?
        .map(String::from);
    let model = Model::load(file, Arc::new(CpuBackend::new(2)), true)?;
    let sessions = vec![Session::new(model.share(), 512)?]; // one slot
    Ok(Engine {
        model,
        sessions,
        tokenizer,
        chat_template,
        speculation: None,
    })
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let model = args
        .iter()
        .find(|a| !a.starts_with("--"))
        .map(String::as_str);
    let engine = load(model)?;
    let llm = ballast_server::router(ServerConfig::new("my-model"), engine)?;
    let app = axum::Router::new()
        .route("/", get(|| async { "my app\n" }))
        .nest("/llm", llm);

    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    println!("serving on http://{addr} (the model under /llm)");
    let server = tokio::spawn(async move { axum::serve(listener, app).await });
    if args.iter().any(|a| a == "--serve") {
        return Ok(server.await??);
    }
    let completion =
        r#"{"model": "my-model", "prompt": "Once upon a time", "max_tokens": 8, "seed": 1}"#;
    for (method, path, body) in [
        ("GET", "/", ""),
        ("GET", "/llm/v1/models", ""),
        ("POST", "/llm/v1/completions", completion),
    ] {
        let response = tokio::task::spawn_blocking(move || ask(addr, method, path, body)).await??;
        let status = response.lines().next().unwrap_or_default();
        let body = response
            .split_once("\r\n\r\n")
            .map_or("", |(_, b)| b)
            .trim();
        println!("{method} {path} -> {status}\n  {body}");
    }
    Ok(())
}

/// One HTTP/1.1 request, the whole response as text.
fn ask(addr: SocketAddr, method: &str, path: &str, body: &str) -> std::io::Result<String> {
    let mut stream = TcpStream::connect(addr)?;
    let head = format!("{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n", body.len());
    stream.write_all(head.as_bytes())?;
    stream.write_all(body.as_bytes())?;
    let mut response = String::new();
    stream.read_to_string(&mut response)?;
    Ok(response)
}
