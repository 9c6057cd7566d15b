//! Tokenizers built from a GGUF vocabulary, reproducing llama.cpp's `llama_tokenize` /
//! `llama_token_to_piece` behaviour for two families (`tokenizer.ggml.model`):
//!
//! - `gpt2`: byte-level BPE. The merge loop is delegated to the Hugging Face
//!   `tokenizers` crate; the pre-tokenizer regexes (`tokenizer.ggml.pre`) follow
//!   `src/llama-vocab.cpp`.
//! - `llama`: SentencePiece (`spm`): scores-based merges of adjacent pieces, `▁` for
//!   spaces, a space prefix as `tokenizer.ggml.add_space_prefix` says, byte fallback
//!   `<0xNN>`; BOS added by default, as llama.cpp does for this family.
//!
//! The special-token partitioning, BOS/EOS handling and the end-of-generation set are
//! shared, and follow `src/llama-vocab.cpp`. Other models and unknown pre-tokenizers are
//! refused with an error naming them.
//!
//! # Example
//! ```
//! use ballast_runtime::tokenizer::{StreamDecoder, Tokenizer, TokenizerSpec};
//!
//! // A toy byte-level vocabulary: the byte characters for "a", "b", "Ġ" (space) plus one merge.
//! let tokens: Vec<String> = ["<|end|>", "a", "b", "Ġ", "ab"].iter().map(|s| s.to_string()).collect();
//! let spec = TokenizerSpec {
//!     model: "gpt2".into(),
//!     pre: Some("gpt-2".into()),
//!     token_types: vec![3, 1, 1, 1, 1],
//!     tokens,
//!     merges: vec!["a b".into()],
//!     bos_id: None,
//!     eos_id: Some(0),
//!     eot_id: None,
//!     eog_ids: vec![],
//!     add_bos: false,
//!     add_eos: false,
//!     ..TokenizerSpec::default()
//! };
//! let tok = Tokenizer::from_spec(spec)?;
//! let ids = tok.encode("ab a<|end|>", false, true)?;
//! assert_eq!(ids, vec![4, 3, 1, 0]);
//! assert_eq!(tok.decode(&ids), "ab a<|end|>");
//! assert!(tok.is_end_of_generation(0));
//!
//! let mut stream = StreamDecoder::new();
//! let mut text = String::new();
//! for &id in &ids {
//!     text += &stream.push(&tok, id);
//! }
//! text += &stream.finish();
//! assert_eq!(text, tok.decode(&ids));
//! # Ok::<(), ballast_runtime::error::Error>(())
//! ```

mod byte_level;
mod from_gguf;
mod pre;
mod spm;
mod stream;

pub use stream::StreamDecoder;

use std::collections::{HashMap, HashSet};

use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::{SplitDelimiterBehavior, Tokenizer as HfTokenizer};

use crate::error::{Error, Result};

/// GGUF token type: normal token.
pub const TOKEN_TYPE_NORMAL: i32 = 1;
/// GGUF token type: unknown token.
pub const TOKEN_TYPE_UNKNOWN: i32 = 2;
/// GGUF token type: control token (BOS, EOS, `<|im_start|>`...).
pub const TOKEN_TYPE_CONTROL: i32 = 3;
/// GGUF token type: user-defined token (always matched as a whole).
pub const TOKEN_TYPE_USER_DEFINED: i32 = 4;
/// GGUF token type: unused token.
pub const TOKEN_TYPE_UNUSED: i32 = 5;
/// GGUF token type: byte token.
pub const TOKEN_TYPE_BYTE: i32 = 6;

/// Token texts llama.cpp treats as end-of-generation whatever their declared type
/// (`special_eog_ids` in `llama-vocab.cpp`).
const EOG_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<|flush|>",
    "<|calls|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "</s>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "[EOS]",
    "<|end_of_text|>",
    "<end_of_utterance>",
    "<eos>",
    "<turn|>",
    "<|tool_response>",
    "<｜end▁of▁sentence｜>",
    "[e~[",
];

/// FIM pad / repo / file-separator token texts that llama.cpp also adds to the EOG set.
const FIM_EOG_TEXTS: &[&str] = &[
    "<|fim_pad|>",
    "<fim-pad>",
    "<fim_pad>",
    "<|fim_repo|>",
    "<|repo_name|>",
    "<fim-repo>",
    "<REPO>",
    "<|file_sep|>",
];

/// Tokenizer metadata as read from a GGUF file (`tokenizer.ggml.*` keys).
#[derive(Debug, Clone, Default)]
pub struct TokenizerSpec {
    /// `tokenizer.ggml.model`: `"gpt2"` (byte-level BPE) or `"llama"` (SentencePiece).
    pub model: String,
    /// `tokenizer.ggml.pre`, e.g. `"smollm"`; `None` means llama.cpp's `default`.
    pub pre: Option<String>,
    /// `tokenizer.ggml.tokens`: token texts (byte-level encoded for gpt2 vocabularies).
    pub tokens: Vec<String>,
    /// `tokenizer.ggml.token_type`: 1 normal, 2 unknown, 3 control, 4 user-defined,
    /// 5 unused, 6 byte. May be empty (all normal).
    pub token_types: Vec<i32>,
    /// `tokenizer.ggml.merges`: `"left right"` pairs, highest priority first (BPE).
    pub merges: Vec<String>,
    /// `tokenizer.ggml.scores`: one per token, higher merges first (SentencePiece). May
    /// be empty (all zero).
    pub scores: Vec<f32>,
    /// `tokenizer.ggml.add_space_prefix` (SentencePiece): a space before text that
    /// starts the input or follows a special token.
    pub add_space_prefix: bool,
    /// `tokenizer.ggml.bos_token_id`.
    pub bos_id: Option<u32>,
    /// `tokenizer.ggml.eos_token_id`.
    pub eos_id: Option<u32>,
    /// `tokenizer.ggml.eot_token_id`.
    pub eot_id: Option<u32>,
    /// Extra end-of-generation ids (e.g. `tokenizer.ggml.eom_token_id`), added to the EOG set.
    pub eog_ids: Vec<u32>,
    /// `tokenizer.ggml.add_bos_token`.
    pub add_bos: bool,
    /// `tokenizer.ggml.add_eos_token`.
    pub add_eos: bool,
}

/// Per-token attributes derived from the GGUF token types.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Normal,
    Unknown,
    Control,
    UserDefined,
    Unused,
    Byte,
}

impl Kind {
    fn from_type(t: i32) -> Kind {
        match t {
            TOKEN_TYPE_UNKNOWN => Kind::Unknown,
            TOKEN_TYPE_CONTROL => Kind::Control,
            TOKEN_TYPE_USER_DEFINED => Kind::UserDefined,
            TOKEN_TYPE_UNUSED => Kind::Unused,
            TOKEN_TYPE_BYTE => Kind::Byte,
            _ => Kind::Normal,
        }
    }
}

/// The byte-level BPE engine for `token_to_id`, `merges` and the pre-tokenizer `pre`.
fn bpe(
    token_to_id: &HashMap<String, u32>,
    merges_in: &[String],
    pre: &pre::PreConfig,
) -> Result<HfTokenizer> {
    // BPE model. The BPE engine rejects merges whose parts or result are not in the
    // vocabulary, so they are skipped. (llama.cpp would still apply such a merge and then
    // emit byte tokens for the unknown result; only malformed vocabularies have them.)
    let vocab: Vocab = token_to_id.iter().map(|(k, &v)| (k.clone(), v)).collect();
    let mut merges = Vec::with_capacity(merges_in.len());
    for m in merges_in {
        // llama.cpp splits at the first space after the first byte.
        let Some(pos) = m.bytes().skip(1).position(|b| b == b' ').map(|p| p + 1) else {
            continue;
        };
        let (a, b) = (&m[..pos], &m[pos + 1..]);
        if token_to_id.contains_key(a)
            && token_to_id.contains_key(b)
            && token_to_id.contains_key(&format!("{a}{b}"))
        {
            merges.push((a.to_string(), b.to_string()));
        }
    }
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .ignore_merges(pre.ignore_merges)
        .build()
        .map_err(|e| Error::TokenizerBuild {
            message: e.to_string(),
        })?;

    let mut steps: Vec<PreTokenizerWrapper> = Vec::with_capacity(pre.regexes.len() + 1);
    for re in &pre.regexes {
        let split = Split::new(
            SplitPattern::Regex((*re).to_string()),
            SplitDelimiterBehavior::Isolated,
            false,
        )
        .map_err(|e| Error::TokenizerBuild {
            message: format!("regex {re:?}: {e}"),
        })?;
        steps.push(split.into());
    }
    steps.push(ByteLevel::new(false, false, false).into());
    let mut hf = HfTokenizer::new(bpe);
    hf.with_pre_tokenizer(Some(Sequence::new(steps)));

    Ok(hf)
}

/// A tokenizer equivalent to llama.cpp's for the supported pre-tokenizers.
///
/// Cheap to share: it is `Send + Sync` and every method takes `&self`.
pub struct Tokenizer {
    engine: Engine,
    tokens: Vec<String>,
    kinds: Vec<Kind>,
    pieces: Vec<Vec<u8>>,
    token_to_id: HashMap<String, u32>,
    /// Special tokens (control, user-defined, unknown), longest text first.
    specials: Vec<u32>,
    eog: HashSet<u32>,
    bos_id: Option<u32>,
    eos_id: Option<u32>,
    eot_id: Option<u32>,
    add_bos: bool,
    add_eos: bool,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab_size", &self.tokens.len())
            .field("special_tokens", &self.specials.len())
            .field("bos_id", &self.bos_id)
            .field("eos_id", &self.eos_id)
            .field("eot_id", &self.eot_id)
            .field("eog", &self.eog)
            .field("add_bos", &self.add_bos)
            .field("add_eos", &self.add_eos)
            .finish_non_exhaustive()
    }
}

/// The merge loop of the vocabulary's family.
enum Engine {
    /// Byte-level BPE (`gpt2`).
    Bpe(Box<HfTokenizer>),
    /// SentencePiece (`llama`).
    Spm(spm::Spm),
}

enum Fragment {
    Text(usize, usize),
    Token(u32),
}

fn parse_hex_byte(text: &str) -> Option<u8> {
    let hex = text.strip_prefix("<0x")?.strip_suffix('>')?;
    if hex.len() != 2 {
        return None;
    }
    u8::from_str_radix(hex, 16).ok()
}

impl Tokenizer {
    /// Builds the tokenizer from GGUF metadata.
    ///
    /// Errors: [`Error::TokenizerUnsupportedModel`] when `model` is not `gpt2`,
    /// [`Error::TokenizerUnsupportedPre`] for an unknown `pre`,
    /// [`Error::TokenizerInvalidVocab`] for inconsistent metadata,
    /// [`Error::TokenizerMissingSpecialToken`] when `add_bos`/`add_eos` is set without an id.
    pub fn from_spec(spec: TokenizerSpec) -> Result<Tokenizer> {
        let sentencepiece = match spec.model.as_str() {
            "gpt2" => false,
            "llama" => true,
            _ => return Err(Error::TokenizerUnsupportedModel { model: spec.model }),
        };
        let unsupported_pre = || Error::TokenizerUnsupportedPre {
            pre: spec.pre.clone().unwrap_or_default(),
        };
        let pre = if sentencepiece {
            // llama.cpp gives SentencePiece no pre-tokenizer; a file naming one expects
            // something this engine would not do, so only `default` passes.
            match spec.pre.as_deref() {
                None | Some("default") => None,
                Some(_) => return Err(unsupported_pre()),
            }
        } else {
            Some(pre::lookup(spec.pre.as_deref()).ok_or_else(unsupported_pre)?)
        };
        let n = spec.tokens.len();
        if n == 0 {
            return Err(Error::TokenizerInvalidVocab {
                reason: "empty token list".into(),
            });
        }
        if u32::try_from(n).is_err() {
            return Err(Error::TokenizerInvalidVocab {
                reason: format!("too many tokens ({n})"),
            });
        }
        if !spec.token_types.is_empty() && spec.token_types.len() < n {
            return Err(Error::TokenizerInvalidVocab {
                reason: format!("{} token types for {} tokens", spec.token_types.len(), n),
            });
        }
        for (name, id) in [
            ("bos", spec.bos_id),
            ("eos", spec.eos_id),
            ("eot", spec.eot_id),
        ] {
            if let Some(id) = id.filter(|&id| id as usize >= n) {
                return Err(Error::TokenizerInvalidVocab {
                    reason: format!("{name} id {id} out of range (vocabulary has {n} tokens)"),
                });
            }
        }
        if spec.add_bos && spec.bos_id.is_none() {
            return Err(Error::TokenizerMissingSpecialToken { which: "bos" });
        }
        if spec.add_eos && spec.eos_id.is_none() {
            return Err(Error::TokenizerMissingSpecialToken { which: "eos" });
        }

        let mut tokens = spec.tokens;
        let mut token_to_id = HashMap::with_capacity(n);
        for (i, t) in tokens.iter_mut().enumerate() {
            if t.is_empty() {
                // llama.cpp renames empty tokens so that they never match.
                *t = format!("[EMPTY_{i}]");
            }
            if let Some(prev) = token_to_id.insert(t.clone(), i as u32) {
                return Err(Error::TokenizerInvalidVocab {
                    reason: format!("duplicate token '{t}' with ids {prev} and {i}"),
                });
            }
        }
        let mut kinds: Vec<Kind> = (0..n)
            .map(|i| {
                spec.token_types
                    .get(i)
                    .copied()
                    .map_or(Kind::Normal, Kind::from_type)
            })
            .collect();

        // End-of-generation set, as llama.cpp builds `special_eog_ids`.
        let mut eog = HashSet::new();
        for text in EOG_TEXTS.iter().chain(FIM_EOG_TEXTS) {
            if let Some(&id) = token_to_id.get(*text) {
                eog.insert(id);
                // llama.cpp forces such tokens to be control tokens.
                kinds[id as usize] = Kind::Control;
            }
        }
        // Auto-detected EOT when the GGUF does not name one (first match in vocabulary order).
        let eot_id = spec.eot_id.or_else(|| {
            (0..n as u32).find(|&i| {
                matches!(
                    tokens[i as usize].as_str(),
                    "<|eot_id|>"
                        | "<|im_end|>"
                        | "<|end|>"
                        | "<end_of_turn>"
                        | "<|endoftext|>"
                        | "<|end_of_text|>"
                        | "<EOT>"
                        | "_<EOT>"
                        | "[EOT]"
                        | "<｜end▁of▁sentence｜>"
                        | "<end_of_utterance>"
                )
            })
        });
        eog.extend(spec.eos_id);
        eog.extend(eot_id);
        for &id in &spec.eog_ids {
            if (id as usize) < n {
                eog.insert(id);
            }
        }

        // Raw bytes of every token (llama.cpp's token-to-piece cache with special=true).
        let table = byte_level::bytes_to_chars();
        let chars_to_bytes: HashMap<char, u8> = table
            .iter()
            .enumerate()
            .map(|(b, &c)| (c, b as u8))
            .collect();
        let pieces = tokens
            .iter()
            .zip(&kinds)
            .map(|(t, k)| match k {
                Kind::Control | Kind::UserDefined | Kind::Unknown => Ok(t.as_bytes().to_vec()),
                // llama.cpp reads the two hex digits of a SentencePiece byte token
                // without checking them; a token that has none is refused here.
                Kind::Byte if sentencepiece => {
                    parse_hex_byte(t)
                        .map(|b| vec![b])
                        .ok_or_else(|| Error::TokenizerInvalidVocab {
                            reason: format!("byte token '{t}' is not of the form <0xNN>"),
                        })
                }
                Kind::Byte => {
                    Ok(parse_hex_byte(t).map_or_else(|| t.as_bytes().to_vec(), |b| vec![b]))
                }
                Kind::Normal if sentencepiece => Ok(t.replace(spm::SPACE, " ").into_bytes()),
                Kind::Normal => Ok(byte_level::decode_token_text(t, &chars_to_bytes)),
                // llama.cpp renders unused tokens as nothing.
                Kind::Unused => Ok(Vec::new()),
            })
            .collect::<Result<Vec<Vec<u8>>>>()?;

        let mut specials: Vec<u32> = (0..n as u32)
            .filter(|&i| {
                matches!(
                    kinds[i as usize],
                    Kind::Control | Kind::UserDefined | Kind::Unknown
                )
            })
            .collect();
        specials.sort_by(|&a, &b| {
            tokens[b as usize]
                .len()
                .cmp(&tokens[a as usize].len())
                .then(a.cmp(&b))
        });

        let engine = match pre {
            None => Engine::Spm(spm::Spm::new(
                &token_to_id,
                n,
                spec.scores,
                spec.add_space_prefix,
            )?),
            Some(pre) => Engine::Bpe(Box::new(bpe(&token_to_id, &spec.merges, &pre)?)),
        };
        Ok(Tokenizer {
            engine,
            tokens,
            kinds,
            pieces,
            token_to_id,
            specials,
            eog,
            bos_id: spec.bos_id,
            eos_id: spec.eos_id,
            eot_id,
            add_bos: spec.add_bos,
            add_eos: spec.add_eos,
        })
    }

    /// Tokenizes `text` like `llama_tokenize(vocab, text, add_special, parse_special)`.
    ///
    /// `add_special` adds BOS/EOS according to the GGUF's `add_bos`/`add_eos` flags.
    /// With `parse_special`, control and unknown tokens written literally in the text
    /// (e.g. `<|im_start|>`) become single tokens; user-defined tokens are always
    /// matched whole, as in llama.cpp.
    pub fn encode(&self, text: &str, add_special: bool, parse_special: bool) -> Result<Vec<u32>> {
        let mut out = Vec::with_capacity(text.len() / 3 + 2);
        if add_special && self.add_bos {
            out.extend(self.bos_id);
        }
        // SentencePiece: text that starts the input or follows a special token gets
        // the space prefix (llama.cpp's `is_prev_special`).
        let mut prev_special = true;
        for frag in self.partition(text, parse_special) {
            match (frag, &self.engine) {
                (Fragment::Token(id), _) => {
                    out.push(id);
                    prev_special = true;
                }
                (Fragment::Text(s, e), Engine::Bpe(hf)) => {
                    let enc = hf.encode_fast(&text[s..e], false).map_err(|err| {
                        Error::TokenizerEncode {
                            message: err.to_string(),
                        }
                    })?;
                    out.extend_from_slice(enc.get_ids());
                }
                (Fragment::Text(s, e), Engine::Spm(spm)) => {
                    let piece = &text[s..e];
                    if spm.add_space_prefix && prev_special {
                        spm.encode(&format!(" {piece}"), &self.token_to_id, &mut out)?;
                    } else {
                        spm.encode(piece, &self.token_to_id, &mut out)?;
                    }
                    prev_special = false;
                }
            }
        }
        if add_special && self.add_eos {
            out.extend(self.eos_id);
        }
        Ok(out)
    }

    /// Splits text around special tokens (llama.cpp's `tokenizer_st_partition`).
    fn partition(&self, text: &str, parse_special: bool) -> Vec<Fragment> {
        if text.is_empty() {
            return Vec::new();
        }
        let mut frags = vec![Fragment::Text(0, text.len())];
        for &id in &self.specials {
            let kind = self.kinds[id as usize];
            if !parse_special && matches!(kind, Kind::Control | Kind::Unknown) {
                continue;
            }
            let needle = self.tokens[id as usize].as_str();
            if !text.contains(needle) {
                continue;
            }
            let mut next = Vec::with_capacity(frags.len() + 2);
            for frag in frags {
                match frag {
                    Fragment::Token(_) => next.push(frag),
                    Fragment::Text(mut s, e) => {
                        while let Some(pos) = text[s..e].find(needle) {
                            if pos > 0 {
                                next.push(Fragment::Text(s, s + pos));
                            }
                            next.push(Fragment::Token(id));
                            s += pos + needle.len();
                        }
                        if s < e {
                            next.push(Fragment::Text(s, e));
                        }
                    }
                }
            }
            frags = next;
        }
        frags
    }

    /// Raw bytes of a token: byte-level decoded for normal tokens, the literal text for
    /// control, user-defined and unknown tokens. Out-of-range ids give an empty slice.
    pub fn token_bytes(&self, id: u32) -> &[u8] {
        self.pieces.get(id as usize).map_or(&[], Vec::as_slice)
    }

    /// Like llama.cpp's `token_to_piece(id, special)`: with `special == false`, control and
    /// unknown tokens render as nothing (what `llama-cli` prints by default); with
    /// `special == true` this is [`token_bytes`](Self::token_bytes).
    pub fn token_piece(&self, id: u32, special: bool) -> &[u8] {
        if !special
            && matches!(
                self.kinds.get(id as usize),
                Some(Kind::Control | Kind::Unknown)
            )
        {
            return &[];
        }
        self.token_bytes(id)
    }

    /// Decodes ids to text (special tokens rendered as their text): the concatenation of
    /// the tokens' pieces, which is what a [`StreamDecoder`] shows, without llama.cpp's
    /// `llama_detokenize` space clean-up (see [`detokenize`](Self::detokenize)). Invalid
    /// UTF-8, such as a character cut off at the end, becomes U+FFFD.
    pub fn decode(&self, ids: &[u32]) -> String {
        self.decode_with(ids, true)
    }

    /// The inverse of [`encode`](Self::encode) without special tokens added, as
    /// llama.cpp's `llama_detokenize(remove_special = false)`: like
    /// [`decode_with`](Self::decode_with), except that a SentencePiece vocabulary with
    /// the space prefix drops one leading space of the first token's piece (the space
    /// `encode` put there). For byte-level BPE it is `decode_with`.
    pub fn detokenize(&self, ids: &[u32], special: bool) -> String {
        let strip = matches!(&self.engine, Engine::Spm(spm) if spm.add_space_prefix);
        let mut bytes = Vec::with_capacity(ids.len() * 4);
        for (i, &id) in ids.iter().enumerate() {
            let piece = self.token_piece(id, special);
            let piece = match piece {
                [b' ', rest @ ..] if strip && i == 0 => rest,
                _ => piece,
            };
            bytes.extend_from_slice(piece);
        }
        match String::from_utf8(bytes) {
            Ok(s) => s,
            Err(e) => String::from_utf8_lossy(e.as_bytes()).into_owned(),
        }
    }

    /// True for a SentencePiece vocabulary (`tokenizer.ggml.model = "llama"`).
    pub fn is_sentencepiece(&self) -> bool {
        matches!(self.engine, Engine::Spm(_))
    }

    /// Decodes ids to text; `special` chooses whether control/unknown tokens are rendered
    /// (see [`token_piece`](Self::token_piece)).
    pub fn decode_with(&self, ids: &[u32], special: bool) -> String {
        let mut bytes = Vec::with_capacity(ids.len() * 4);
        for &id in ids {
            bytes.extend_from_slice(self.token_piece(id, special));
        }
        match String::from_utf8(bytes) {
            Ok(s) => s,
            Err(e) => String::from_utf8_lossy(e.as_bytes()).into_owned(),
        }
    }

    /// Number of tokens in the vocabulary.
    pub fn vocab_size(&self) -> usize {
        self.tokens.len()
    }

    /// Whether [`Tokenizer::encode`] with `add_special` starts with BOS
    /// (`tokenizer.ggml.add_bos_token`).
    pub fn add_bos(&self) -> bool {
        self.add_bos
    }

    /// Beginning-of-sequence token id, if any.
    pub fn bos_id(&self) -> Option<u32> {
        self.bos_id
    }

    /// End-of-sequence token id, if any.
    pub fn eos_id(&self) -> Option<u32> {
        self.eos_id
    }

    /// End-of-turn token id: the GGUF's, or auto-detected by text as llama.cpp does.
    pub fn eot_id(&self) -> Option<u32> {
        self.eot_id
    }

    /// Whether generation should stop at this token (llama.cpp's `llama_vocab_is_eog`).
    pub fn is_end_of_generation(&self, id: u32) -> bool {
        self.eog.contains(&id)
    }

    /// All end-of-generation ids, sorted.
    pub fn eog_ids(&self) -> Vec<u32> {
        let mut ids: Vec<u32> = self.eog.iter().copied().collect();
        ids.sort_unstable();
        ids
    }

    /// Whether the token is a control token (not shown by llama.cpp unless asked).
    pub fn is_control(&self, id: u32) -> bool {
        matches!(self.kinds.get(id as usize), Some(Kind::Control))
    }

    /// The id of a token given its vocabulary text (byte-level form for normal tokens,
    /// e.g. `"Ġthe"`; literal for special tokens such as `"<|im_end|>"`).
    pub fn id_of(&self, token: &str) -> Option<u32> {
        self.token_to_id.get(token).copied()
    }

    /// The vocabulary text of a token, if the id is in range.
    pub fn token_text(&self, id: u32) -> Option<&str> {
        self.tokens.get(id as usize).map(String::as_str)
    }
}
