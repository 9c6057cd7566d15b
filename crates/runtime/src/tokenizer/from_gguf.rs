//! Building a [`Tokenizer`] from a GGUF file's own `tokenizer.ggml.*` metadata.

use super::{Tokenizer, TokenizerSpec};
use crate::error::Result;
use crate::gguf::GgufFile;

impl TokenizerSpec {
    /// Reads the tokenizer metadata of `file`. Missing required keys and keys of the
    /// wrong type give errors naming the key.
    pub fn from_gguf(file: &GgufFile) -> Result<TokenizerSpec> {
        let strings = |key: &str| -> Result<Vec<String>> {
            Ok(file
                .get_str_array_opt(key)?
                .unwrap_or_default()
                .into_iter()
                .map(str::to_string)
                .collect())
        };
        let eog_ids = ["tokenizer.ggml.eom_token_id"]
            .iter()
            .filter_map(|k| file.get_u32_opt(k).transpose())
            .collect::<Result<Vec<u32>>>()?;
        Ok(TokenizerSpec {
            model: file.get_str("tokenizer.ggml.model")?.to_string(),
            pre: file.get_str_opt("tokenizer.ggml.pre")?.map(str::to_string),
            tokens: file
                .get_str_array("tokenizer.ggml.tokens")?
                .into_iter()
                .map(str::to_string)
                .collect(),
            token_types: file
                .get_i32_array_opt("tokenizer.ggml.token_type")?
                .unwrap_or_default(),
            merges: strings("tokenizer.ggml.merges")?,
            bos_id: file.get_u32_opt("tokenizer.ggml.bos_token_id")?,
            eos_id: file.get_u32_opt("tokenizer.ggml.eos_token_id")?,
            eot_id: file.get_u32_opt("tokenizer.ggml.eot_token_id")?,
            eog_ids,
            add_bos: file
                .get_bool_opt("tokenizer.ggml.add_bos_token")?
                .unwrap_or(false),
            add_eos: file
                .get_bool_opt("tokenizer.ggml.add_eos_token")?
                .unwrap_or(false),
        })
    }
}

impl Tokenizer {
    /// The tokenizer of a GGUF file, built from its own vocabulary and merges.
    pub fn from_gguf(file: &GgufFile) -> Result<Tokenizer> {
        Tokenizer::from_spec(TokenizerSpec::from_gguf(file)?)
    }
}
