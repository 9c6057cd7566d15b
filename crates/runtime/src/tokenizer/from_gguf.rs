//! Building a [`Tokenizer`] from a GGUF file's own `tokenizer.ggml.*` metadata.

use super::{Tokenizer, TokenizerSpec};
use crate::error::Result;
use crate::gguf::GgufFile;

impl TokenizerSpec {
    /// Reads the tokenizer metadata of `file`. Missing required keys and keys of the
    /// wrong type give errors naming the key.
    ///
    /// Where a key is absent, the defaults are llama.cpp's for the family: a
    /// SentencePiece vocabulary (`llama`) has BOS 1 and EOS 2 (when the vocabulary is
    /// that large), adds BOS and has the space prefix; byte-level BPE adds nothing.
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
        let model = file.get_str("tokenizer.ggml.model")?;
        let sentencepiece = model == "llama";
        let tokens: Vec<String> = file
            .get_str_array("tokenizer.ggml.tokens")?
            .into_iter()
            .map(str::to_string)
            .collect();
        let default_id = |id: u32| (sentencepiece && (id as usize) < tokens.len()).then_some(id);
        Ok(TokenizerSpec {
            model: model.to_string(),
            pre: file.get_str_opt("tokenizer.ggml.pre")?.map(str::to_string),
            bos_id: file
                .get_u32_opt("tokenizer.ggml.bos_token_id")?
                .or(default_id(1)),
            eos_id: file
                .get_u32_opt("tokenizer.ggml.eos_token_id")?
                .or(default_id(2)),
            tokens,
            token_types: file
                .get_i32_array_opt("tokenizer.ggml.token_type")?
                .unwrap_or_default(),
            merges: strings("tokenizer.ggml.merges")?,
            scores: file
                .get_f32_array_opt("tokenizer.ggml.scores")?
                .unwrap_or_default(),
            add_space_prefix: file
                .get_bool_opt("tokenizer.ggml.add_space_prefix")?
                .unwrap_or(sentencepiece),
            eot_id: file.get_u32_opt("tokenizer.ggml.eot_token_id")?,
            eog_ids,
            add_bos: file
                .get_bool_opt("tokenizer.ggml.add_bos_token")?
                .unwrap_or(sentencepiece),
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
