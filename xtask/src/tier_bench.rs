//! `cargo xtask bench-tiered`: tiered streaming against plain mmap under a memory
//! limit smaller than the model, a synthetic model of more than 2 GB under a 1 GB
//! limit, and `ballast plan` for the seed's machine.
//!
//! The limit is a cgroup this task creates below its own (v2 `memory.max`, or v1
//! `memory.limit_in_bytes`), where the system lets it (root, a writable memory
//! controller); otherwise it says so and runs without one. Each run works on a private
//! copy of the model whose page cache is dropped first, so pages cached by other
//! processes (and charged to their cgroups) cannot make the mmap baseline look better
//! than it is.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};
use ballast_runtime::ggml_type::GgmlType;
use ballast_runtime::testing::TinyModelSpec;

const MIB: u64 = 1 << 20;

/// A memory cgroup made for one bench, removed on drop.
pub(crate) struct Cgroup {
    dir: PathBuf,
}

impl Cgroup {
    /// A child of this process's memory cgroup limited to `limit` bytes.
    pub(crate) fn create(name: &str, limit: u64) -> Result<Cgroup> {
        let text =
            std::fs::read_to_string("/proc/self/cgroup").context("reading /proc/self/cgroup")?;
        let mut v1 = None;
        let mut v2 = None;
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
        let unified = Path::new("/sys/fs/cgroup/cgroup.controllers");
        let v2_has_memory = std::fs::read_to_string(unified)
            .is_ok_and(|c| c.split_whitespace().any(|x| x == "memory"));
        let (dir, files): (PathBuf, Vec<(&str, String)>) = match (v2, v1) {
            (Some(p), _) if v2_has_memory => (
                Path::new("/sys/fs/cgroup").join(p).join(name),
                vec![
                    ("memory.max", limit.to_string()),
                    ("memory.swap.max", "0".into()),
                ],
            ),
            (_, Some(p)) => (
                Path::new("/sys/fs/cgroup/memory").join(p).join(name),
                vec![
                    ("memory.limit_in_bytes", limit.to_string()),
                    ("memory.memsw.limit_in_bytes", limit.to_string()),
                ],
            ),
            _ => bail!("no memory cgroup controller (neither v2 with memory nor v1 memory)"),
        };
        std::fs::create_dir(&dir).with_context(|| format!("creating cgroup {}", dir.display()))?;
        let cg = Cgroup { dir };
        for (i, (file, value)) in files.iter().enumerate() {
            let r = std::fs::write(cg.dir.join(file), value);
            // The first file is the limit itself; the swap limit may not exist.
            if i == 0 {
                r.with_context(|| format!("writing {} of {}", file, cg.dir.display()))?;
            }
        }
        Ok(cg)
    }

    /// `cmd` run inside the cgroup (a shell joins it, then execs the command).
    pub(crate) fn wrap(&self, program: &Path, args: &[String]) -> Command {
        let mut c = Command::new("sh");
        c.arg("-c")
            .arg(format!(
                "echo $$ > '{}' && exec \"$0\" \"$@\"",
                self.dir.join("cgroup.procs").display()
            ))
            .arg(program)
            .args(args);
        c
    }
}

impl Drop for Cgroup {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir(&self.dir);
    }
}

/// Flushes a file just written to disk. Its pages are dirty until then, and
/// `posix_fadvise(DONTNEED)` leaves dirty pages in the page cache, charged to this
/// process's group, not to the benchmark's cgroup: the first run would read a warm
/// cache that the limit does not see.
pub(crate) fn written_back(path: &Path) -> Result<()> {
    std::fs::File::open(path)
        .and_then(|f| f.sync_all())
        .with_context(|| format!("flushing {}", path.display()))
}

/// A copy of `model` in the folder `work` (made if missing, kept while its size
/// matches): its page cache is the bench's to drop, and is charged to the bench's
/// cgroup rather than shared with other processes.
pub(crate) fn private_copy(model: &Path, work: &Path) -> Result<PathBuf> {
    std::fs::create_dir_all(work)?;
    let copy = work.join("model.gguf");
    if std::fs::metadata(&copy).map(|m| m.len()).ok()
        != std::fs::metadata(model).map(|m| m.len()).ok()
    {
        std::fs::copy(model, &copy).context("copying the default model")?;
        written_back(&copy)?;
    }
    Ok(copy)
}

/// Runs `ballast bench --json` (in `cg` if any) and returns its JSON lines.
pub(crate) fn bench_json(
    ballast: &Path,
    cg: Option<&Cgroup>,
    args: &[String],
    model: &Path,
) -> Result<Vec<serde_json::Value>> {
    ballast_json(ballast, cg, "bench", args, model)
}

/// Runs `ballast COMMAND --json -m MODEL ARGS` (in `cg` if any), the page cache of
/// `model` dropped first, and returns its JSON lines.
pub(crate) fn ballast_json(
    ballast: &Path,
    cg: Option<&Cgroup>,
    command: &str,
    args: &[String],
    model: &Path,
) -> Result<Vec<serde_json::Value>> {
    ballast_tier_stream::io::drop_file_cache(model)
        .with_context(|| format!("dropping the cache of {}", model.display()))?;
    let mut all = vec![
        command.to_string(),
        "--json".into(),
        "-m".into(),
        model.display().to_string(),
    ];
    all.extend_from_slice(args);
    let mut cmd = match cg {
        Some(cg) => cg.wrap(ballast, &all),
        None => {
            let mut c = Command::new(ballast);
            c.args(&all);
            c
        }
    };
    eprintln!("    $ ballast {}", all.join(" "));
    let out = cmd
        .output()
        .with_context(|| format!("running ballast {command}"))?;
    if !out.status.success() {
        bail!(
            "ballast {command} failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| l.starts_with('{'))
        .map(|l| {
            serde_json::from_str(l).with_context(|| format!("parsing ballast {command} --json"))
        })
        .collect()
}

pub(crate) fn row(label: &str, v: &serde_json::Value) {
    let tps = v["tokens_per_s_median"].as_f64().unwrap_or(0.0);
    let read = v["process_read_bytes_per_token"]
        .as_f64()
        .unwrap_or(f64::NAN);
    let s = &v["streaming"];
    let (disk, nonres, stall, pred, meas, bottleneck) = if s.is_object() {
        (
            format!(
                "{:.2} MiB",
                s["disk_bytes_per_token"].as_f64().unwrap_or(0.0) / MIB as f64
            ),
            format!(
                "{:.2} MiB",
                s["non_resident_bytes"].as_f64().unwrap_or(0.0) / MIB as f64
            ),
            format!("{:.2}", s["stall_ms_per_token"].as_f64().unwrap_or(0.0)),
            format!("{:.2}", s["predicted_ms_per_token"].as_f64().unwrap_or(0.0)),
            s["measured_ms_per_token"].as_f64().unwrap_or(0.0),
            s["bottleneck"].as_str().unwrap_or("").to_string(),
        )
    } else {
        (
            "-".into(),
            "-".into(),
            "-".into(),
            "-".into(),
            1e3 / tps.max(1e-12),
            "-".into(),
        )
    };
    let ratio = pred
        .parse::<f64>()
        .map_or("-".to_string(), |p| format!("{:.2}x", meas / p.max(1e-9)));
    println!(
        "| {label} | {} | {:.3} | {:.1} | {:.2} MiB | {disk} | {nonres} | {stall} | {pred} | {ratio} | {bottleneck} | {:.1} MiB |",
        v["threads"],
        tps,
        1e3 / tps.max(1e-12),
        read / MIB as f64,
        v["peak_rss_kib"].as_f64().unwrap_or(f64::NAN) / 1024.0
    );
}

pub(crate) fn header() {
    println!("| run | threads | t/s (median) | ms/token | storage read/token (/proc) | streamed read/token | non-resident | stall ms/token | plan bound ms | measured/bound | bottleneck | peak RSS |");
    println!("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: |");
}

/// The synthetic model: Q8_0 layers of 2048 wide with an MLP of 5632 (about 48 MB a
/// layer), 44 layers: a little over 2 GB.
fn synthetic_spec() -> TinyModelSpec {
    TinyModelSpec {
        n_layers: 44,
        d_model: 2048,
        n_heads: 16,
        n_kv_heads: 4,
        n_ff: 5632,
        weight_type: GgmlType::Q8_0,
        embd_type: GgmlType::Q8_0,
        tied: true,
        context_length: 512,
        seed: 11,
        ..TinyModelSpec::default()
    }
}

pub fn run(ballast: &Path, default_model: &Path, quick: bool) -> Result<()> {
    let work = std::env::temp_dir().join("ballast-tier-bench");
    let model = private_copy(default_model, &work)?;
    let size = std::fs::metadata(&model)?.len();
    let limit = 88 * MIB;
    let ram = "74M";
    let threads = ["1", "2"];
    let n_gen = if quick { "16" } else { "32" };
    println!("\n## Tiered streaming vs plain mmap under a memory limit\n");
    println!(
        "model {} ({:.1} MiB); limit {} MiB (cgroup, set below); tiered --ram {ram}",
        model.display(),
        size as f64 / MIB as f64,
        limit / MIB
    );
    let cg = match Cgroup::create(&format!("ballast-bench-{}", std::process::id()), limit) {
        Ok(cg) => {
            println!(
                "cgroup: {} (memory limit {} bytes)\n",
                cg.dir.display(),
                limit
            );
            Some(cg)
        }
        Err(e) => {
            println!("cgroup: not available ({e:#}); running WITHOUT a memory limit\n");
            None
        }
    };
    header();
    for t in threads {
        let common = ["-p", "0", "-n", n_gen, "-r", "3", "-t", t].map(String::from);
        let mmap = bench_json(
            ballast,
            cg.as_ref(),
            &[&common[..], &["--store".into(), "mmap".into()]].concat(),
            &model,
        )?;
        let tiered = bench_json(
            ballast,
            cg.as_ref(),
            &[
                &common[..],
                &[
                    "--store".into(),
                    "tiered".into(),
                    "--ram".into(),
                    ram.into(),
                ],
            ]
            .concat(),
            &model,
        )?;
        // The seed's double buffering with one reader, for the effect of the depth.
        let double = bench_json(
            ballast,
            cg.as_ref(),
            &[
                &common[..],
                &[
                    "--store",
                    "tiered",
                    "--ram",
                    ram,
                    "--prefetch-depth",
                    "2",
                    "--io-threads",
                    "1",
                ]
                .map(String::from),
            ]
            .concat(),
            &model,
        )?;
        if let (Some(m), Some(s)) = (mmap.first(), tiered.first()) {
            row("plain mmap", m);
            row("tiered (depth 3, 2 readers)", s);
            if let Some(d) = double.first() {
                row("tiered (depth 2, 1 reader)", d);
            }
            let (a, b) = (
                m["tokens_per_s_median"].as_f64().unwrap_or(0.0),
                s["tokens_per_s_median"].as_f64().unwrap_or(0.0),
            );
            println!(
                "| tiered / mmap at {t} threads | | {:.1}x | | | | | | | | | |",
                b / a.max(1e-12)
            );
        }
    }
    drop(cg);
    // Tiered streaming without a limit is what the default model does with room.
    println!("\nthe same model with no limit (everything resident, for reference):\n");
    header();
    for t in threads {
        let v = bench_json(
            ballast,
            None,
            &[
                "-p", "0", "-n", n_gen, "-r", "3", "-t", t, "--store", "mmap",
            ]
            .map(String::from),
            &model,
        )?;
        if let Some(v) = v.first() {
            row("mmap, no limit", v);
        }
    }

    println!("\n## A synthetic model of more than 2 GB under a 1 GiB limit\n");
    let big = work.join("synthetic-2g.gguf");
    if !big.is_file() {
        eprintln!(
            "    writing {} (random Q8_0 weights; takes a while)",
            big.display()
        );
        synthetic_spec().writer()?.write_to_file(&big)?;
        written_back(&big)?;
    }
    let big_size = std::fs::metadata(&big)?.len();
    println!("model {} ({:.2} GiB, 44 layers), limit 1 GiB; --ram not given: the budget is probed from the cgroup\n", big.display(), big_size as f64 / (1u64 << 30) as f64);
    let cg = Cgroup::create(
        &format!("ballast-bench-big-{}", std::process::id()),
        1 << 30,
    )
    .ok();
    if cg.is_none() {
        println!("(no cgroup available: running without a limit, --ram 1G instead)");
    }
    let ram_flag: Vec<String> = if cg.is_some() {
        vec![]
    } else {
        vec!["--ram".into(), "1G".into()]
    };
    // The plan the run will use, as ballast run prints it (stderr of a 1-token run).
    let mut plan_cmd_args: Vec<String> = [
        "run",
        "-m",
        &big.display().to_string(),
        "hello",
        "-n",
        "1",
        "-c",
        "64",
        "--store",
        "tiered",
        "--temp",
        "0",
    ]
    .map(String::from)
    .to_vec();
    plan_cmd_args.extend(ram_flag.iter().cloned());
    let out = match &cg {
        Some(cg) => cg.wrap(ballast, &plan_cmd_args).output()?,
        None => Command::new(ballast).args(&plan_cmd_args).output()?,
    };
    println!("```\n{}```", String::from_utf8_lossy(&out.stderr));
    header();
    for t in threads {
        let mut args: Vec<String> = [
            "-p", "0", "-n", "4", "-r", "2", "-t", t, "--store", "tiered",
        ]
        .map(String::from)
        .to_vec();
        args.extend(ram_flag.iter().cloned());
        let v = bench_json(ballast, cg.as_ref(), &args, &big)?;
        if let Some(v) = v.first() {
            row("synthetic 2 GB, tiered", v);
        }
    }
    if !quick {
        let args: Vec<String> = [
            "-p", "0", "-n", "2", "-r", "1", "-t", "2", "--store", "mmap",
        ]
        .map(String::from)
        .to_vec();
        match bench_json(ballast, cg.as_ref(), &args, &big) {
            Ok(v) => {
                if let Some(v) = v.first() {
                    row("synthetic 2 GB, plain mmap", v);
                }
            }
            Err(e) => println!("plain mmap of the synthetic model failed: {e:#}"),
        }
    }
    drop(cg);

    println!(
        "\n## ballast plan for the seed's machine (70B Q6_K, 24 GB GPU, 48 GB RAM, Gen3 x8; double buffering as the seed)\n"
    );
    for ctx in ["512", "4096"] {
        let args = [
            "plan",
            "--preset",
            "llama-70b-q6_k",
            "--vram",
            "24G",
            "--ram",
            "48G",
            "--h2d",
            "6.5GB/s",
            "--disk",
            "3GB/s",
            "--compute",
            "936GB/s",
            "--prefetch-depth",
            "2",
            "-c",
            ctx,
        ];
        println!("$ ballast {}", args.join(" "));
        let out = Command::new(ballast).args(args).output()?;
        println!("```\n{}```", String::from_utf8_lossy(&out.stdout));
    }
    println!("seed's measured table: ctx 4096: A 24, B 54, C 2, 0.2 tok/s, 23.0 GB VRAM; ctx 512: A 29, B 51, C 0, 0.2 tok/s, 23.1 GB VRAM");
    Ok(())
}
