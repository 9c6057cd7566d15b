//! `ballast inspect`: a GGUF file's metadata and tensors, or (`--graph`) the ops of one
//! forward pass of its model.

use std::path::PathBuf;

use anyhow::{Context, Result};
use std::io::Write;
use std::sync::Arc;

use ballast_runtime::gguf::GgufFile;
use ballast_runtime::model::Logits;
use ballast_runtime::{CpuBackend, Model};
use clap::Args;

use crate::common::human_bytes;

/// Flags of `ballast inspect`.
#[derive(Args, Debug)]
pub struct InspectArgs {
    /// The GGUF file.
    pub model: PathBuf,
    /// Print the ops of one forward pass instead (as the architecture's builder emits
    /// them: every tensor named with its shape, every weight by its role), for
    /// `--tokens` tokens with greedy output.
    #[arg(long)]
    pub graph: bool,
    /// Tokens in the pass printed by `--graph`.
    #[arg(long, default_value_t = 1, requires = "graph")]
    pub tokens: usize,
}

pub fn run(args: InspectArgs) -> Result<()> {
    let file = GgufFile::open(&args.model, true)
        .with_context(|| format!("opening {}", args.model.display()))?;
    if args.graph {
        anyhow::ensure!(args.tokens > 0, "--tokens must be at least 1");
        let model = Model::load(Arc::new(file), Arc::new(CpuBackend::new(1)), true)
            .with_context(|| format!("loading {}", args.model.display()))?;
        let text = model
            .pass_graph(args.tokens, Logits::Greedy, None)
            .to_string();
        // A closed pipe (`| head`) ends the listing quietly.
        return match std::io::stdout().lock().write_all(text.as_bytes()) {
            Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
            r => r.context("writing the graph"),
        };
    }
    println!(
        "{}: GGUF v{}, {}, {} metadata keys, {} tensors",
        args.model.display(),
        file.version(),
        human_bytes(file.file_len()),
        file.metadata().len(),
        file.tensors().len()
    );
    println!("\nmetadata:");
    for (key, value) in file.metadata() {
        println!("  {key:<44} {value}");
    }
    println!("\ntensors:");
    println!(
        "  {:<32} {:<6} {:<20} {:>12}",
        "name", "type", "shape", "bytes"
    );
    let mut total = 0u64;
    for t in file.tensors() {
        let shape = format!("{:?}", t.dims);
        println!(
            "  {:<32} {:<6} {:<20} {:>12}",
            t.name,
            t.ty.name(),
            shape,
            t.n_bytes
        );
        total += t.n_bytes;
    }
    println!("  {:<32} {:<6} {:<20} {:>12}", "total", "", "", total);
    Ok(())
}
