//! `ballast inspect`: a GGUF file's metadata and tensors.

use std::path::PathBuf;

use anyhow::{Context, Result};
use ballast_runtime::gguf::GgufFile;
use clap::Args;

use crate::common::human_bytes;

/// Flags of `ballast inspect`.
#[derive(Args, Debug)]
pub struct InspectArgs {
    /// The GGUF file.
    pub model: PathBuf,
}

pub fn run(args: InspectArgs) -> Result<()> {
    let file = GgufFile::open(&args.model, true)
        .with_context(|| format!("opening {}", args.model.display()))?;
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
