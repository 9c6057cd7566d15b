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
    /// The GGUF file, or a pack (then each tensor's codec and ratio are shown too).
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
    let pack = if ballast_weight_codec::is_pack(&args.model) {
        Some(
            ballast_weight_codec::PackFile::open(&args.model, true)
                .with_context(|| format!("opening the pack {}", args.model.display()))?,
        )
    } else {
        None
    };
    let file = match &pack {
        // Metadata and tensor table only; --graph loads the weights, so decode them.
        Some(p) if args.graph => p.to_gguf(crate::common::threads(None)),
        Some(p) => p.gguf_with(|_| false, 1),
        None => {
            return inspect_file(
                &args,
                GgufFile::open(&args.model, true)
                    .with_context(|| format!("opening {}", args.model.display()))?,
                None,
            )
        }
    }
    .with_context(|| format!("decoding the pack {}", args.model.display()))?;
    inspect_file(&args, file, pack.as_ref())
}

fn inspect_file(
    args: &InspectArgs,
    file: GgufFile,
    pack: Option<&ballast_weight_codec::PackFile>,
) -> Result<()> {
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
    let kind = match pack {
        Some(p) => format!(
            "pack of a GGUF v{} of {} in {} ({:.3}x)",
            file.version(),
            human_bytes(file.file_len()),
            human_bytes(p.file_len()),
            file.file_len() as f64 / p.file_len().max(1) as f64
        ),
        None => format!("GGUF v{}, {}", file.version(), human_bytes(file.file_len())),
    };
    println!(
        "{}: {kind}, {} metadata keys, {} tensors",
        args.model.display(),
        file.metadata().len(),
        file.tensors().len()
    );
    println!("\nmetadata:");
    for (key, value) in file.metadata() {
        println!("  {key:<44} {value}");
    }
    println!("\ntensors:");
    let codec_head = if pack.is_some() {
        format!(
            " {:<12} {:>12} {:>7} {:>6}",
            "codec", "stored", "ratio", "chunks"
        )
    } else {
        String::new()
    };
    println!(
        "  {:<32} {:<6} {:<20} {:>12}{codec_head}",
        "name", "type", "shape", "bytes"
    );
    let (mut total, mut stored) = (0u64, 0u64);
    for t in file.tensors() {
        let shape = format!("{:?}", t.dims);
        let codec = match pack.map(|p| p.tensor(&t.name)).transpose()? {
            Some(pt) => {
                stored += pt.stored_len();
                format!(
                    " {:<12} {:>12} {:>6.3}x {:>6}",
                    pt.codec.name(),
                    pt.stored_len(),
                    pt.ratio(),
                    pt.chunks.len()
                )
            }
            None => String::new(),
        };
        println!(
            "  {:<32} {:<6} {:<20} {:>12}{codec}",
            t.name,
            t.ty.name(),
            shape,
            t.n_bytes
        );
        total += t.n_bytes;
    }
    let codec = if pack.is_some() {
        format!(
            " {:<12} {:>12} {:>6.3}x",
            "",
            stored,
            total as f64 / stored.max(1) as f64
        )
    } else {
        String::new()
    };
    println!(
        "  {:<32} {:<6} {:<20} {:>12}{codec}",
        "total", "", "", total
    );
    Ok(())
}
