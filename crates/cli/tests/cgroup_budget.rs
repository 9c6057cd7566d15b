//! `run`, `serve` and `bench` with no `--ram` inside a memory cgroup, as a new user
//! would start them in a container: each sizes its RAM budget from the limit, the
//! same way on every run; a context that does not fit is refused before anything
//! listens, with the `-c` that would fit; the one that fits runs within the limit.
//!
//! Each test makes a child of this process's memory cgroup (cgroup v2 `memory.max`,
//! or v1 `memory.limit_in_bytes`), which needs root and a writable memory controller:
//! where there is none the tests are skipped with the reason printed. They need the
//! default model in the model cache (`cargo xtask fetch-model`): without it they fail
//! under CI (`CI` set) and are skipped with a printed reason elsewhere.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

const MIB: u64 = 1 << 20;

/// A memory cgroup made for one test, removed on drop.
struct Cgroup {
    dir: PathBuf,
    limit: u64,
}

impl Cgroup {
    /// A child of this process's memory cgroup limited to `limit` bytes (swap too), or
    /// why there can be none here.
    fn create(limit: u64) -> Result<Cgroup, String> {
        static SEQUENCE: AtomicUsize = AtomicUsize::new(0);
        let text = std::fs::read_to_string("/proc/self/cgroup")
            .map_err(|e| format!("no /proc/self/cgroup ({e})"))?;
        let (mut v1, mut v2) = (None, None);
        for line in text.lines() {
            let mut p = line.splitn(3, ':');
            let (Some(id), Some(ctrls), Some(path)) = (p.next(), p.next(), p.next()) else {
                continue;
            };
            if id == "0" && ctrls.is_empty() {
                v2 = Some(path.trim_start_matches('/').to_string());
            } else if ctrls.split(',').any(|c| c == "memory") {
                v1 = Some(path.trim_start_matches('/').to_string());
            }
        }
        let v2_has_memory = std::fs::read_to_string("/sys/fs/cgroup/cgroup.controllers")
            .is_ok_and(|c| c.split_whitespace().any(|x| x == "memory"));
        let name = format!(
            "ballast-budget-test-{}-{}",
            std::process::id(),
            SEQUENCE.fetch_add(1, Ordering::Relaxed)
        );
        let (dir, limit_file, swap_file) = match (v2, v1) {
            (Some(p), _) if v2_has_memory => (
                Path::new("/sys/fs/cgroup").join(p).join(name),
                "memory.max",
                "memory.swap.max",
            ),
            (_, Some(p)) => (
                Path::new("/sys/fs/cgroup/memory").join(p).join(name),
                "memory.limit_in_bytes",
                "memory.memsw.limit_in_bytes",
            ),
            _ => return Err("no memory cgroup controller (neither v2 nor v1)".into()),
        };
        std::fs::create_dir(&dir)
            .map_err(|e| format!("cannot create the cgroup {} ({e})", dir.display()))?;
        let cg = Cgroup { dir, limit };
        std::fs::write(cg.dir.join(limit_file), limit.to_string())
            .map_err(|e| format!("cannot set {limit_file} ({e})"))?;
        // No swap to spill into (v2: none; v1: memory and swap together at the limit);
        // the file may not exist without swap accounting.
        let swap = if swap_file == "memory.swap.max" {
            "0".to_string()
        } else {
            limit.to_string()
        };
        let _ = std::fs::write(cg.dir.join(swap_file), swap);
        Ok(cg)
    }

    /// `ballast ARGS` inside the cgroup (a shell joins it, then execs the binary).
    fn ballast(&self, args: &[&str]) -> Command {
        let mut c = Command::new("sh");
        c.arg("-c")
            .arg(format!(
                "echo $$ > '{}' && exec \"$0\" \"$@\"",
                self.dir.join("cgroup.procs").display()
            ))
            .arg(env!("CARGO_BIN_EXE_ballast"))
            .args(args);
        c
    }

    /// Whether the kernel killed a process of the group for memory.
    fn oom_killed(&self) -> bool {
        std::fs::read_to_string(self.dir.join("memory.oom_control"))
            .or_else(|_| std::fs::read_to_string(self.dir.join("memory.events")))
            .map(|t| {
                t.lines().any(|l| {
                    l.strip_prefix("oom_kill ")
                        .is_some_and(|n| n.trim().parse::<u64>().is_ok_and(|n| n > 0))
                })
            })
            .unwrap_or(false)
    }
}

impl Drop for Cgroup {
    fn drop(&mut self) {
        // The group empties when its processes have exited; retry while it drains.
        for _ in 0..50 {
            if std::fs::remove_dir(&self.dir).is_ok() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// The cgroup and the default model, or `None` (skipped, the reason printed).
fn setup(limit: u64) -> Option<(Cgroup, String)> {
    let path = ballast_runtime::model_cache::default_model_path().expect("a model cache");
    if !path.is_file() {
        assert!(
            std::env::var_os("CI").is_none(),
            "the default model is not at {} under CI; run `cargo xtask fetch-model`",
            path.display()
        );
        eprintln!(
            "skipped: the default model is not at {} (run `cargo xtask fetch-model`)",
            path.display()
        );
        return None;
    }
    match Cgroup::create(limit) {
        Ok(cg) => Some((cg, path.to_string_lossy().into_owned())),
        Err(why) => {
            eprintln!("skipped: no memory cgroup of {} MiB: {why}", limit / MIB);
            None
        }
    }
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// The budget in bytes: the first `(N bytes: ...` in `text`, which is how a `RAM
/// budget 17.3 MiB (18188736 bytes: the cgroup limit ...)` line and a refusal give it.
fn budget_of(text: &str) -> u64 {
    text.match_indices('(')
        .find_map(|(at, _)| {
            let rest = &text[at + 1..];
            let digits = rest.find(|c: char| !c.is_ascii_digit())?;
            rest[digits..]
                .starts_with(" bytes:")
                .then(|| rest[..digits].parse().ok())
                .flatten()
        })
        .unwrap_or_else(|| panic!("no budget in bytes in\n{text}"))
}

/// The `-c N` an error tells to pass.
fn context_advised(err: &str) -> usize {
    let at = err
        .find("pass -c ")
        .unwrap_or_else(|| panic!("no -c advised in\n{err}"));
    err[at + 8..]
        .split(|c: char| !c.is_ascii_digit())
        .next()
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no number after -c in\n{err}"))
}

/// `ballast run` in `cg`: its output, checked for no OOM kill.
fn run(cg: &Cgroup, model: &str, extra: &[&str]) -> Output {
    let o = cg
        .ballast(&["run", "-m", model, "Hello", "-t", "2", "--temp", "0"])
        .args(extra)
        .output()
        .expect("running ballast");
    assert!(!cg.oom_killed(), "OOM-killed in {} MiB", cg.limit / MIB);
    o
}

#[test]
fn run_in_64_mib_names_the_context_that_fits_and_runs_it_with_the_same_budget() {
    let Some((cg, model)) = setup(64 * MIB) else {
        return;
    };
    // The default context (2,048 tokens) does not fit: refused, with a context that
    // does, and the same budget each time.
    let refused: Vec<Output> = (0..2).map(|_| run(&cg, &model, &["-n", "4"])).collect();
    for o in &refused {
        assert!(!o.status.success(), "{}", stderr(o));
        assert!(stderr(o).contains("does not fit"), "{}", stderr(o));
    }
    let (a, b) = (stderr(&refused[0]), stderr(&refused[1]));
    let fits = context_advised(&a);
    assert!((17..2048).contains(&fits), "{a}");
    assert_eq!(fits, context_advised(&b), "{a}\n{b}");
    let budget = budget_of(&a);
    assert_eq!(budget, budget_of(&b), "{a}\n{b}");
    assert!(budget < 64 * MIB, "{a}");
    // The context advised runs, within the limit, on that budget.
    let c = fits.to_string();
    let o = run(&cg, &model, &["-c", &c, "-n", "8", "--ignore-eos"]);
    let err = stderr(&o);
    assert!(o.status.success(), "{err}");
    assert!(err.contains("generation: 8 tokens"), "{err}");
    assert_eq!(budget_of(&err), budget, "{err}");
}

#[test]
fn run_in_2_gib_gets_the_same_budget_on_every_run() {
    let Some((cg, model)) = setup(2048 * MIB) else {
        return;
    };
    let budgets: Vec<u64> = (0..2)
        .map(|_| {
            let o = run(&cg, &model, &["-n", "8", "--ignore-eos"]);
            let err = stderr(&o);
            assert!(o.status.success(), "{err}");
            assert!(err.contains("generation: 8 tokens"), "{err}");
            assert!(err.contains("cgroup limit 2.0 GiB"), "{err}");
            budget_of(&err)
        })
        .collect();
    assert_eq!(budgets[0], budgets[1]);
    assert!(budgets[0] > 1024 * MIB && budgets[0] < 2048 * MIB);
}

#[test]
fn bench_in_64_mib_and_2_gib_runs_with_a_probed_budget() {
    for limit in [64 * MIB, 2048 * MIB] {
        let Some((cg, model)) = setup(limit) else {
            return;
        };
        let bench = |extra: &[&str]| {
            let o = cg
                .ballast(&["bench", "-m", &model, "-t", "2", "-r", "1"])
                .args(extra)
                .output()
                .expect("running ballast bench");
            assert!(!cg.oom_killed(), "OOM-killed in {} MiB", limit / MIB);
            o
        };
        let runs: Vec<Output> = (0..2).map(|_| bench(&["-p", "16", "-n", "8"])).collect();
        let mut budgets = Vec::new();
        for o in &runs {
            let out = String::from_utf8_lossy(&o.stdout).into_owned();
            assert!(o.status.success(), "{}", stderr(o));
            assert!(out.contains("pp16") && out.contains("tg8"), "{out}");
            budgets.push(budget_of(&out));
        }
        assert_eq!(budgets[0], budgets[1], "{} MiB", limit / MIB);
        if limit == 64 * MIB {
            // A prompt of 4,096 tokens does not fit 64 MiB: refused with what does.
            let o = bench(&["-p", "4096", "-n", "8"]);
            assert!(!o.status.success());
            assert!(
                stderr(&o).contains("lower -d plus the larger of -p and -n to at most"),
                "{}",
                stderr(&o)
            );
        }
    }
}

/// A `ballast serve` process, killed when dropped.
struct Server(Child);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A request on a fresh connection (closed after it): the status and the body.
fn request(addr: &str, method: &str, path: &str, body: &str) -> (u16, String) {
    let mut s = TcpStream::connect(addr).expect("connecting");
    s.set_read_timeout(Some(Duration::from_secs(300))).unwrap();
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut raw = String::new();
    s.read_to_string(&mut raw).expect("reading the response");
    let status = raw
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let body = raw
        .split_once("\r\n\r\n")
        .map_or("", |(_, b)| b)
        .to_string();
    (status, body)
}

/// Starts `ballast serve` in `cg`; its stderr up to `listening on`, and the address.
/// `Err` with the whole stderr when it exits first.
fn serve(cg: &Cgroup, model: &str, extra: &[&str]) -> Result<(Server, String, String), String> {
    let mut child = cg
        .ballast(&["serve", "-m", model, "--port", "0", "-t", "2"])
        .args(extra)
        .stderr(Stdio::piped())
        .stdout(Stdio::null())
        .spawn()
        .expect("starting ballast serve");
    let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
    let server = Server(child);
    let mut seen = String::new();
    for line in lines.by_ref() {
        let line = line.unwrap();
        seen.push_str(&line);
        seen.push('\n');
        if let Some(addr) = line.strip_prefix("listening on http://") {
            let addr = addr.to_string();
            // Keep reading stderr so the server never blocks on a full pipe.
            std::thread::spawn(move || for _ in lines.by_ref() {});
            return Ok((server, seen, addr));
        }
    }
    Err(seen)
}

#[test]
fn serve_loads_before_it_listens_and_answers_in_64_mib_and_2_gib() {
    for limit in [64 * MIB, 2048 * MIB] {
        let Some((cg, model)) = setup(limit) else {
            return;
        };
        let extra: Vec<String> = if limit == 64 * MIB {
            // 8 sequences of 128 tokens do not fit: refused before listening, with the
            // -c that fits 8 sequences.
            let refused = serve(&cg, &model, &["--parallel", "8", "-c", "128"]);
            let err = refused
                .err()
                .expect("serve listened with a context that does not fit");
            assert!(err.contains("do not fit"), "{err}");
            let c = context_advised(&err);
            assert!((1..128).contains(&c), "{err}");
            vec!["--parallel".into(), "8".into(), "-c".into(), c.to_string()]
        } else {
            Vec::new()
        };
        let extra: Vec<&str> = extra.iter().map(String::as_str).collect();
        let (server, loaded, addr) =
            serve(&cg, &model, &extra).unwrap_or_else(|err| panic!("serve exited:\n{err}"));
        assert!(loaded.contains("model loaded"), "{loaded}");
        budget_of(&loaded);
        // Loaded before listening: ready at once.
        let (status, body) = request(&addr, "GET", "/health", "");
        assert_eq!(status, 200, "{body}");
        let (status, body) = request(
            &addr,
            "POST",
            "/v1/completions",
            r#"{"prompt": "Hello", "max_tokens": 4, "temperature": 0}"#,
        );
        assert_eq!(status, 200, "{body}");
        let v: serde_json::Value = serde_json::from_str(&body).expect("a JSON body");
        let generated = v["usage"]["completion_tokens"].as_u64().unwrap_or(0);
        assert!((1..=4).contains(&generated), "{body}");
        drop(server);
        assert!(!cg.oom_killed(), "OOM-killed in {} MiB", limit / MIB);
    }
}
