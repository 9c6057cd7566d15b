//! Shared helpers of the integration tests: the default model's tokenizer metadata, and
//! tiny models run whole (`tiny`).
#![allow(dead_code)]

pub mod tiny;

use ballast_runtime::gguf::GgufFile;
use ballast_runtime::model_cache;
use ballast_runtime::tokenizer::{Tokenizer, TokenizerSpec};

/// The default model's GGUF file, if it is in the model cache. Under CI (`CI` set) a
/// missing model is a failure; elsewhere the caller skips with the printed reason.
pub fn default_model() -> Option<GgufFile> {
    let path = model_cache::default_model_path().expect("a model cache folder");
    if !path.is_file() {
        if std::env::var_os("CI").is_some() {
            panic!(
                "the default model is not at {} under CI; run `cargo xtask fetch-model`",
                path.display()
            );
        }
        eprintln!(
            "skipped: the default model is not at {} (run `cargo xtask fetch-model`)",
            path.display()
        );
        return None;
    }
    Some(GgufFile::open(&path, true).expect("the default model parses"))
}

/// The SmolLM2 tokenizer metadata, and its chat template under the key
/// `tokenizer.chat_template`.
pub fn smollm_spec() -> Option<(TokenizerSpec, serde_json::Value)> {
    let file = default_model()?;
    let spec = TokenizerSpec::from_gguf(&file).expect("tokenizer metadata");
    let template = file
        .get_str("tokenizer.chat_template")
        .expect("chat template");
    Some((
        spec,
        serde_json::json!({ "tokenizer.chat_template": template }),
    ))
}

/// The SmolLM2 tokenizer, or `None` (with a printed reason) if the model is absent.
pub fn smollm() -> Option<Tokenizer> {
    let (spec, _) = smollm_spec()?;
    Some(Tokenizer::from_spec(spec).expect("SmolLM2 vocabulary builds"))
}
