//! Mapping from `tokenizer.ggml.pre` names to the pre-tokenizer regexes llama.cpp uses
//! (`src/llama-vocab.cpp`, `llm_tokenizer_bpe`). Regexes are applied in order: each one
//! splits every piece produced so far, keeping both matched and unmatched spans.

/// GPT-2 pre-tokenizer regex.
const GPT2: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)";
/// Llama 3 pre-tokenizer regex (case-insensitive contractions spelled out).
const LLAMA3: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Qwen 2 pre-tokenizer regex (single digits).
const QWEN2: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// How a named pre-tokenizer is configured.
#[derive(Debug, Clone)]
pub(crate) struct PreConfig {
    /// Regexes applied in sequence.
    pub regexes: Vec<&'static str>,
    /// Whether a pre-token that is itself a vocabulary entry skips BPE merging.
    pub ignore_merges: bool,
}

/// Looks up a pre-tokenizer by its GGUF name; `None` (missing key) means `default`.
pub(crate) fn lookup(pre: Option<&str>) -> Option<PreConfig> {
    let cfg = |regexes: Vec<&'static str>, ignore_merges: bool| {
        Some(PreConfig {
            regexes,
            ignore_merges,
        })
    };
    match pre.unwrap_or("default") {
        "default" => cfg(
            vec![r"[\p{P}\$\+<=>\^~\|]+", GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"],
            false,
        ),
        "llama3" | "llama-v3" | "llama-bpe" | "falcon3" | "falcon-h1" | "pixtral" | "midm-2.0"
        | "lfm2" | "jina-v5-nano" => cfg(vec![LLAMA3], true),
        "dbrx" | "smaug-bpe" | "glm4" | "chatglm-bpe" => cfg(vec![LLAMA3], false),
        "gpt-2" | "phi-2" | "jina-es" | "jina-de" | "gigachat" | "jina-v2-es" | "jina-v2-de"
        | "a.x-4.0" | "mellum" | "modern-bert" | "exaone4" | "mpt" | "olmo" | "jais"
        | "trillion" | "granite-docling" | "jina-v1-en" | "jina-v2-code" | "roberta-bpe" => {
            cfg(vec![GPT2], false)
        }
        "smollm" | "starcoder" | "refact" | "command-r" | "codeshell" | "exaone" | "minerva-7b"
        | "mellum2" => cfg(vec![r"\p{N}", GPT2], false),
        "qwen2" | "deepseek-r1-qwen" | "kormo" | "f2llmv2" | "megrez" | "stablelm2" | "hunyuan"
        | "solar-open" => cfg(vec![QWEN2], false),
        "falcon" => cfg(
            vec![
                r"[\p{P}\$\+<=>\^~\|`]+",
                r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)",
                r"[0-9][0-9][0-9]",
            ],
            false,
        ),
        _ => None,
    }
}
