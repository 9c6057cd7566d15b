//! `ballast synth`: a synthetic model at a real model's shape, for benchmarks at the
//! sizes people run (see `ballast_runtime::synth`).

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result};
use ballast_runtime::synth::{SynthMix, SynthModel, SHAPES};
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};

use crate::common::human_bytes;

/// Flags of `ballast synth`.
#[derive(Args, Debug)]
#[command(
    after_help = "The weights are random (deterministic), at a trained model's \
magnitude; speed does not depend on their values, so the file stands in for the real one \
in memory, streaming and throughput measurements. The vocabulary is byte-level padded to \
the real size. A mixture of experts over random weights routes without locality: the \
worst case for an expert cache."
)]
pub struct SynthArgs {
    /// The shape (--list shows them): llama-3.1-8b, qwen2.5-7b, qwen3-30b-a3b, ...
    #[arg(long, required_unless_present = "list")]
    pub shape: Option<String>,
    /// The tensor types: q4_k_m (llama.cpp's mix), q8_0 or bf16.
    #[arg(long = "type", default_value = "q4_k_m", value_parser = mix)]
    pub mix: SynthMix,
    /// Where to write the GGUF (written to a temporary file, then renamed).
    #[arg(required_unless_present = "list")]
    pub out: Option<PathBuf>,
    /// List the shapes and the size of each in each mix.
    #[arg(long)]
    pub list: bool,
}

fn mix(s: &str) -> std::result::Result<SynthMix, String> {
    SynthMix::parse(s).ok_or_else(|| format!("expected one of {}, got {s:?}", SynthMix::NAMES))
}

pub fn run(args: SynthArgs) -> Result<()> {
    if args.list {
        for shape in SHAPES {
            let size = |m| SynthModel::new(shape, m).file_bytes().map(human_bytes);
            println!(
                "{:<15} q4_k_m {:>10}  q8_0 {:>10}  bf16 {:>10}  {}",
                shape.name,
                size(SynthMix::Q4KM)?,
                size(SynthMix::Q8_0)?,
                size(SynthMix::BF16)?,
                shape.description
            );
        }
        return Ok(());
    }
    let (Some(name), Some(out)) = (args.shape.as_deref(), args.out.as_deref()) else {
        anyhow::bail!("give --shape and the output file (or --list)");
    };
    let shape = SynthModel::shape(name)?;
    let model = SynthModel::new(shape, args.mix);
    let total = model.file_bytes()?;
    if let Some(free) = out
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .and_then(fs_free)
    {
        anyhow::ensure!(
            free > total,
            "{} needs {} and the disk holding it has {} free",
            out.display(),
            human_bytes(total),
            human_bytes(free)
        );
    }
    let bar = ProgressBar::new(total).with_style(
        ProgressStyle::with_template(
            "{msg} [{bar:30}] {bytes}/{total_bytes} {bytes_per_sec} eta {eta}",
        )
        .expect("a valid template")
        .progress_chars("=> "),
    );
    bar.set_message(format!("writing {name}"));
    let start = Instant::now();
    model
        .write(out, |done, _| bar.set_position(done))
        .with_context(|| format!("writing {}", out.display()))?;
    bar.finish_and_clear();
    let secs = start.elapsed().as_secs_f64();
    eprintln!(
        "wrote {} ({name}, {:?}): {} in {secs:.1} s, {}/s",
        out.display(),
        args.mix,
        human_bytes(total),
        human_bytes((total as f64 / secs.max(1e-9)) as u64)
    );
    Ok(())
}

/// Free bytes on the file system holding `dir` (`df`), when it can tell.
fn fs_free(dir: &std::path::Path) -> Option<u64> {
    let out = std::process::Command::new("df")
        .args(["--output=avail", "-B1"])
        .arg(dir)
        .output()
        .ok()?;
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .nth(1)?
        .trim()
        .parse()
        .ok()
}
