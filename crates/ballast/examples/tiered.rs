//! Text generation with the layers that do not fit 96 MiB of RAM streamed from disk:
//! `cargo run --release -p ballast --example tiered [MODEL]` (default: the default model).
use ballast::{ByteSize, Engine, GenerateOptions, Step, StoreKind};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let path = match std::env::args_os().nth(1) {
        Some(path) => path.into(),
        None => ballast::runtime::model_cache::default_model_path()?,
    };
    let budget: ByteSize = "96M".parse()?;
    let tiered = Engine::builder(path).store(StoreKind::Tiered);
    let engine = tiered.ram_budget(budget).context(512).build()?;
    eprint!("{}", engine.report()); // which layers stay in RAM, which stream
    let prompt = engine
        .tokenizer()
        .encode("The capital of France is", true, true)?;
    let options = GenerateOptions {
        max_tokens: Some(32),
        ..Default::default()
    };
    let mut generator = engine.generator(options)?;
    generator.prompt(&prompt)?;
    loop {
        match generator.step()? {
            Step::Token(token) => print!("{}", token.text),
            Step::Done(end) => break println!("{}", end.text),
        }
    }
    Ok(())
}
