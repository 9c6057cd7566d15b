//! `cargo xtask bench-serve`: `ballast serve` on the default model under load.
//!
//! 1. Aggregate decode speed with 1, 2, 4 and 8 concurrent clients (greedy, fixed
//!    length, `--parallel 8`), the weights resident; then the same with the weights
//!    streamed from disk (`--store tiered`) in a 64 MiB memory cgroup, with the disk
//!    bytes per generated token (as the store counts its reads, and as the kernel
//!    counts every read of the process): one pass per step serves every sequence, so
//!    each streamed layer, and the output head the budget leaves on disk, is read once
//!    for all of them.
//!    Then on the GPU (`--device gpu --store tiered --vram 100M --ram 200M`): the
//!    weight bytes uploaded per generated token, which one device pass per step
//!    divides among the sequences.
//! 2. A load run: 32 concurrent clients, 10 requests each (3 with `--quick`), prompts of
//!    mixed lengths, every fifth request streamed and dropped after its first tokens.
//!    It fails on any error response; it prints p50/p99 latency, aggregate tokens/s
//!    and the server's resident set after a first round (which touches the caches'
//!    pages) and after a second, measured one (which should come back within 5%).

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde_json::{json, Value};

use crate::tier_bench::{written_back, Cgroup};

struct Server {
    child: Child,
    addr: String,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start(ballast: &Path, parallel: usize) -> Result<Server> {
    start_with(ballast, parallel, &[], None)
}

/// `ballast serve` with `extra` flags, in `cgroup` if given.
fn start_with(
    ballast: &Path,
    parallel: usize,
    extra: &[&str],
    cgroup: Option<&Cgroup>,
) -> Result<Server> {
    use std::io::BufRead;
    let mut args: Vec<String> = ["serve", "--port", "0", "-t", "2", "--queue", "1024"]
        .map(String::from)
        .to_vec();
    args.extend(["--parallel".to_string(), parallel.to_string()]);
    args.extend(extra.iter().map(|a| a.to_string()));
    let mut cmd = match cgroup {
        Some(cg) => cg.wrap(ballast, &args),
        None => {
            let mut c = Command::new(ballast);
            c.args(&args);
            c
        }
    };
    let mut child = cmd
        .stderr(Stdio::piped())
        .stdout(Stdio::null())
        .spawn()
        .with_context(|| format!("starting {}", ballast.display()))?;
    let mut lines = std::io::BufReader::new(child.stderr.take().unwrap()).lines();
    let addr = loop {
        let Some(line) = lines.next() else {
            bail!("ballast serve exited before listening");
        };
        if let Some(a) = line?.strip_prefix("listening on http://") {
            break a.to_string();
        }
    };
    // The server's last words, for the error when it stops.
    let said = std::sync::Arc::new(std::sync::Mutex::new(String::new()));
    let said_in = said.clone();
    std::thread::spawn(move || {
        for line in lines.by_ref().map_while(Result::ok) {
            *said_in.lock().unwrap() = line;
        }
    });
    let mut server = Server { child, addr };
    let deadline = Instant::now() + Duration::from_secs(300);
    while request(&server.addr, "GET", "/health", "").map_or(true, |r| r.0 != 200) {
        if let Some(status) = server.child.try_wait()? {
            std::thread::sleep(Duration::from_millis(100));
            bail!(
                "ballast serve exited ({status}) before it was ready: {}",
                said.lock().unwrap()
            );
        }
        if Instant::now() > deadline {
            bail!("the server never became ready");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(server)
}

/// Status and body of one request (the connection closes after it).
fn request(addr: &str, method: &str, path: &str, body: &str) -> Result<(u16, String)> {
    let mut s = TcpStream::connect(addr)?;
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )?;
    let mut raw = String::new();
    s.read_to_string(&mut raw)?;
    let status = raw
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .context("no status line")?;
    let body = raw
        .split_once("\r\n\r\n")
        .map_or("", |(_, b)| b)
        .to_string();
    Ok((status, body))
}

/// A streamed request dropped once `events` data events arrived. Returns the status.
fn cancelled_stream(addr: &str, body: &str, events: usize) -> Result<u16> {
    let mut s = TcpStream::connect(addr)?;
    write!(
        s,
        "POST /v1/completions HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )?;
    let mut seen = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        let n = s.read(&mut buf)?;
        seen.extend_from_slice(&buf[..n]);
        let head = String::from_utf8_lossy(&seen);
        let status: u16 = head
            .split(' ')
            .nth(1)
            .and_then(|s| s.parse().ok())
            .unwrap_or(0);
        if n == 0 || status != 200 || head.matches("data: ").count() >= events {
            return Ok(status);
        }
    }
}

fn metric(addr: &str, name: &str) -> Result<f64> {
    let (_, text) = request(addr, "GET", "/metrics", "")?;
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
        .with_context(|| format!("no metric {name}"))
}

/// Bytes the kernel read from storage for process `pid`: the store's direct reads and
/// the page faults of a mapped head alike.
fn storage_read_bytes(pid: u32) -> Result<u64> {
    ballast_tier_stream::io::read_bytes_of(pid).context("no read_bytes in /proc/PID/io")
}

fn rss_kib(pid: u32) -> Result<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .context("no VmRSS")
}

/// Completion tokens of a response body.
fn completion_tokens(body: &str) -> u64 {
    serde_json::from_str::<Value>(body)
        .ok()
        .and_then(|v| v["usage"]["completion_tokens"].as_u64())
        .unwrap_or(0)
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i]
}

pub fn run(ballast: &Path, quick: bool) -> Result<()> {
    let server = start(ballast, 8)?;
    let addr = server.addr.clone();
    eprintln!("==> aggregate decode speed (greedy, 32 tokens per request, --parallel 8)");
    aggregate(&server, 32)?;
    tiered(ballast, quick)?;
    gpu_tiered(ballast, quick)?;

    let (clients, per_client) = if quick { (32, 3) } else { (32, 10) };
    eprintln!(
        "==> load run: {clients} clients x {per_client} requests, mixed prompts, every fifth streamed and dropped"
    );
    let pid = server.child.id();
    let rss_start = rss_kib(pid)?;
    // The first round touches what the later ones reuse (the caches' pages, the
    // allocator's arenas of the handler threads): the RSS to come back to is the one
    // after it.
    load_round(&addr, clients, per_client)?;
    let rss_before = rss_kib(pid)?;
    let (outcomes, wall) = load_round(&addr, clients, per_client)?;
    let rss_after = rss_kib(pid)?;
    let mut latencies: Vec<Duration> = outcomes.iter().flat_map(|o| o.0.clone()).collect();
    latencies.sort();
    let tokens: u64 = outcomes.iter().map(|o| o.1).sum();
    let cancelled: usize = outcomes.iter().map(|o| o.2).sum();
    let errors: Vec<&String> = outcomes.iter().flat_map(|o| &o.3).collect();
    println!(
        "load run: {} requests answered, {cancelled} streams dropped, {} errors; latency p50 {:.2} s, p99 {:.2} s; {tokens} tokens in {wall:.1} s = {:.1} tokens/s aggregate",
        latencies.len(),
        errors.len(),
        percentile(&latencies, 0.5).as_secs_f64(),
        percentile(&latencies, 0.99).as_secs_f64(),
        tokens as f64 / wall,
    );
    let change = (rss_after as f64 - rss_before as f64) / rss_before as f64 * 100.0;
    println!(
        "server RSS: {rss_start} KiB at the start, {rss_before} KiB after a first round, {rss_after} KiB after the measured one ({change:+.1}%); cancelled per the server: {}",
        metric(&addr, "ballast_requests_cancelled_total")?
    );
    if let Some(e) = errors.first() {
        bail!("{} error responses, the first: {e}", errors.len());
    }
    Ok(())
}

type Outcome = (Vec<Duration>, u64, usize, Vec<String>);

/// One round of the load run: each client's latencies, tokens, dropped streams and
/// errors, and the wall time; returns once no sequence runs.
fn load_round(addr: &str, clients: usize, per_client: usize) -> Result<(Vec<Outcome>, f64)> {
    let words = |n: usize| "the quick brown fox jumps over the lazy dog ".repeat(n / 9 + 1);
    let start = Instant::now();
    let outcomes: Vec<Outcome> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..clients)
            .map(|c| {
                s.spawn(move || {
                    let mut latencies = Vec::new();
                    let mut tokens = 0;
                    let mut cancelled = 0;
                    let mut errors = Vec::new();
                    for r in 0..per_client {
                        let i = c * per_client + r;
                        let prompt = words([4, 40, 200][i % 3]);
                        let max_tokens = [8, 16, 32][(i / 3) % 3];
                        if i % 5 == 4 {
                            let body = json!({"prompt": prompt, "max_tokens": 256,
                                "ignore_eos": true, "stream": true})
                            .to_string();
                            match cancelled_stream(addr, &body, 3) {
                                Ok(200) => cancelled += 1,
                                Ok(status) => errors.push(format!("stream: status {status}")),
                                Err(e) => errors.push(format!("stream: {e}")),
                            }
                            continue;
                        }
                        let body = json!({"prompt": prompt, "max_tokens": max_tokens,
                            "temperature": 0.7, "seed": i, "ignore_eos": true})
                        .to_string();
                        let t = Instant::now();
                        match request(addr, "POST", "/v1/completions", &body) {
                            Ok((200, b)) => {
                                latencies.push(t.elapsed());
                                tokens += completion_tokens(&b);
                            }
                            Ok((status, b)) => errors.push(format!("status {status}: {b}")),
                            Err(e) => errors.push(e.to_string()),
                        }
                    }
                    (latencies, tokens, cancelled, errors)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let wall = start.elapsed().as_secs_f64();
    // Dropped streams free their sequences at their next turn.
    let deadline = Instant::now() + Duration::from_secs(120);
    while metric(addr, "ballast_requests_running")? > 0.0 {
        if Instant::now() > deadline {
            bail!("sequences still running two minutes after the last client");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    Ok((outcomes, wall))
}

/// Aggregate decode speed with 1, 2, 4 and 8 concurrent clients, each sending two
/// greedy requests of `max_tokens`; with the disk bytes per generated token when the
/// server streams weights.
fn aggregate(server: &Server, max_tokens: usize) -> Result<Vec<f64>> {
    let addr = server.addr.as_str();
    let pid = server.child.id();
    println!(
        "| clients | requests | generated tokens | wall s | aggregate tokens/s | sequences per pass | store reads MiB per token | kernel storage reads MiB per token | uploaded to the GPU MiB per token |"
    );
    println!("|---|---|---|---|---|---|---|---|---|");
    let body = json!({"prompt": "Once upon a time, there was a little", "max_tokens": max_tokens,
                      "temperature": 0, "ignore_eos": true})
    .to_string();
    // Warm up (first touches of the mapped weights).
    request(addr, "POST", "/v1/completions", &body)?;
    let mut speeds = Vec::new();
    for clients in [1usize, 2, 4, 8] {
        let per_client = 2;
        let moved = metric(addr, "ballast_weight_bytes_moved_total")?;
        let storage = storage_read_bytes(pid)?;
        let uploaded = metric(addr, "ballast_device_weight_bytes_uploaded_total")?;
        let steps = metric(addr, "ballast_steps_total")?;
        let served = metric(addr, "ballast_step_sequences_total")?;
        let start = Instant::now();
        let tokens: Result<Vec<u64>> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..clients)
                .map(|_| {
                    s.spawn(|| -> Result<u64> {
                        let mut n = 0;
                        for _ in 0..per_client {
                            let (status, b) = request(addr, "POST", "/v1/completions", &body)?;
                            if status != 200 {
                                bail!("status {status}: {b}");
                            }
                            n += completion_tokens(&b);
                        }
                        Ok(n)
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let tokens: u64 = tokens?.iter().sum();
        let wall = start.elapsed().as_secs_f64();
        let moved = metric(addr, "ballast_weight_bytes_moved_total")? - moved;
        let storage = storage_read_bytes(pid)? - storage;
        let uploaded = metric(addr, "ballast_device_weight_bytes_uploaded_total")? - uploaded;
        let steps = metric(addr, "ballast_steps_total")? - steps;
        let served = metric(addr, "ballast_step_sequences_total")? - served;
        let speed = tokens as f64 / wall;
        speeds.push(speed);
        println!(
            "| {clients} | {} | {tokens} | {wall:.1} | {speed:.1} | {:.2} | {:.2} | {:.2} | {:.2} |",
            clients * per_client,
            served / steps.max(1.0),
            moved / tokens.max(1) as f64 / (1u64 << 20) as f64,
            storage as f64 / tokens.max(1) as f64 / (1u64 << 20) as f64,
            uploaded / tokens.max(1) as f64 / (1u64 << 20) as f64,
        );
    }
    Ok(speeds)
}

/// The aggregate table on the GPU with half the layers uploaded per use from RAM
/// (`--device gpu --store tiered --vram 100M --ram 200M`): one device pass per step
/// uploads each streamed layer once for every sequence. Skipped, said so, without a
/// wgpu adapter. On a software driver only the bytes mean anything, not the speed.
fn gpu_tiered(ballast: &Path, quick: bool) -> Result<()> {
    let max_tokens = if quick { 8 } else { 16 };
    eprintln!("==> GPU: --device gpu --store tiered --vram 100M --ram 200M -c 64, {max_tokens} tokens per request");
    let server = match start_with(
        ballast,
        8,
        &[
            "--device", "gpu", "--store", "tiered", "--vram", "100M", "--ram", "200M", "-c", "64",
        ],
        None,
    ) {
        Ok(s) => s,
        Err(e) => {
            println!("\nGPU section skipped: {e:#}");
            return Ok(());
        }
    };
    println!(
        "\nOn the GPU, layers uploaded per use from RAM: `--device gpu --store tiered --vram 100M --ram 200M -c 64`\n"
    );
    aggregate(&server, max_tokens)?;
    Ok(())
}

/// The aggregate table with the weights streamed from disk in a 64 MiB cgroup (or
/// without a limit, said so, where no cgroup can be made).
fn tiered(ballast: &Path, quick: bool) -> Result<()> {
    // 64 MiB: the weight budget holds eight caches, the reserve and the streaming
    // slots, and leaves the 29 MiB output head on disk (mapped: the page cache keeps
    // what the limit allows, the rest is read again every step, once for the whole
    // batch); the rest of the process (tokenizer tables, runtime, buffers per
    // sequence: 11-22 MiB of anonymous memory measured) comes on top.
    const LIMIT: u64 = 64 << 20;
    let model = crate::full::fetch_model()?;
    // A private copy: its page cache is ours to drop and is charged to our cgroup.
    let work = std::env::temp_dir().join("ballast-serve-bench");
    std::fs::create_dir_all(&work)?;
    let copy = work.join("model.gguf");
    if std::fs::metadata(&copy).map(|m| m.len()).ok()
        != std::fs::metadata(&model).map(|m| m.len()).ok()
    {
        std::fs::copy(&model, &copy).context("copying the default model")?;
        written_back(&copy)?;
    }
    ballast_tier_stream::io::drop_file_cache(&copy)
        .with_context(|| format!("dropping the cache of {}", copy.display()))?;
    let cg = match Cgroup::create(
        &format!("ballast-serve-bench-{}", std::process::id()),
        LIMIT,
    ) {
        Ok(cg) => Some(cg),
        Err(e) => {
            println!("\ncgroup: not available ({e:#}); running WITHOUT a memory limit");
            None
        }
    };
    // Eight caches of 40 tokens (f16: 0.9 MiB each) and the streaming slots fit the
    // budget; the head does not: nearly every layer and the head come from disk.
    let ram = "28M";
    let max_tokens = if quick { 16 } else { 24 };
    eprintln!(
        "==> tiered: --store tiered --ram {ram} -c 40, 64 MiB cgroup, {max_tokens} tokens per request"
    );
    println!(
        "\nWeights streamed from disk: `--store tiered --ram {ram} -c 40`, cgroup memory limit {} MiB{}\n",
        LIMIT >> 20,
        if cg.is_some() { "" } else { " (NOT applied)" }
    );
    let copy_arg = copy.display().to_string();
    let server = start_with(
        ballast,
        8,
        &[
            "-m", &copy_arg, "--store", "tiered", "--ram", ram, "-c", "40",
        ],
        cg.as_ref(),
    )?;
    let speeds = aggregate(&server, max_tokens)?;
    if let (Some(one), Some(eight)) = (speeds.first(), speeds.last()) {
        println!(
            "\n8 clients against 1: {:.2}x the aggregate tokens/s",
            eight / one
        );
    }
    Ok(())
}
