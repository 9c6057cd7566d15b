//! SentencePiece (`tokenizer.ggml.model = "llama"`) encoding with llama.cpp's semantics
//! (`llm_tokenizer_spm_session` in `src/llama-vocab.cpp`): spaces become `▁`, the text
//! is split into UTF-8 characters, and the adjacent pair whose concatenation is a
//! vocabulary entry with the highest score is merged, again and again (ties: the
//! leftmost pair). A character that is no token falls back to its byte tokens `<0xNN>`.
//!
//! llama.cpp also keeps a reverse map of merges to split a final symbol that is no
//! token. Every merge it makes is a token, so such a symbol is always one unmerged
//! character, which no two symbols (each at least one character) can have formed: that
//! branch never runs, and this engine goes straight to the bytes.

use std::cmp::Ordering;
use std::collections::{BinaryHeap, HashMap};

use crate::error::{Error, Result};

/// The space marker of SentencePiece vocabularies (U+2581).
pub(crate) const SPACE: &str = "\u{2581}";

/// What the SPM merge loop needs besides the vocabulary map.
#[derive(Debug, Clone)]
pub(crate) struct Spm {
    /// `tokenizer.ggml.scores`, one per token (0 when the GGUF has none, as llama.cpp).
    scores: Vec<f32>,
    /// The token of each byte: `<0xNN>`, else the byte itself as a one-character token
    /// (llama.cpp's `byte_to_token`); `None` where the vocabulary has neither.
    byte_tokens: Vec<Option<u32>>,
    /// `tokenizer.ggml.add_space_prefix`: a space before text that starts the input or
    /// follows a special token.
    pub(crate) add_space_prefix: bool,
}

/// A symbol of the merge loop: a byte range of the escaped text, linked to its
/// neighbours (`None` at the ends).
#[derive(Clone, Copy)]
struct Symbol {
    start: usize,
    len: usize,
    prev: Option<usize>,
    next: Option<usize>,
}

/// A candidate merge of two adjacent symbols.
#[derive(Clone, Copy)]
struct Bigram {
    left: usize,
    right: usize,
    score: f32,
    /// Bytes of the merged text: a candidate whose symbols changed since it was queued
    /// no longer adds up to it and is skipped.
    size: usize,
}

/// Highest score first; equal scores, leftmost first (llama.cpp's comparator). NaN
/// scores, which only a malformed vocabulary has, order by `total_cmp` instead of
/// breaking the heap.
impl Ord for Bigram {
    fn cmp(&self, other: &Self) -> Ordering {
        self.score
            .total_cmp(&other.score)
            .then_with(|| other.left.cmp(&self.left))
    }
}

impl PartialOrd for Bigram {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl PartialEq for Bigram {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}

impl Eq for Bigram {}

impl Spm {
    /// The engine for a vocabulary `token_to_id` of `n` tokens with `scores` (empty: all
    /// zero). Scores of another length are an error naming both lengths.
    pub(crate) fn new(
        token_to_id: &HashMap<String, u32>,
        n: usize,
        scores: Vec<f32>,
        add_space_prefix: bool,
    ) -> Result<Spm> {
        let scores = match scores.len() {
            0 => vec![0.0; n],
            len if len == n => scores,
            len => {
                return Err(Error::TokenizerInvalidVocab {
                    reason: format!("tokenizer.ggml.scores has {len} entries for {n} tokens"),
                })
            }
        };
        let mut byte_tokens = vec![None; 256];
        for (b, slot) in byte_tokens.iter_mut().enumerate() {
            let hex = format!("<0x{b:02X}>");
            *slot = token_to_id.get(&hex).copied().or_else(|| {
                // A lone byte is a one-character token only where it is ASCII.
                (b < 0x80)
                    .then(|| token_to_id.get(&(b as u8 as char).to_string()).copied())
                    .flatten()
            });
        }
        Ok(Spm {
            scores,
            byte_tokens,
            add_space_prefix,
        })
    }

    /// Appends the tokens of `text` (one fragment between special tokens, with the
    /// space prefix already added) to `out`. A character that is no token and has no
    /// byte token is an error naming the byte (llama.cpp aborts there).
    pub(crate) fn encode(
        &self,
        text: &str,
        token_to_id: &HashMap<String, u32>,
        out: &mut Vec<u32>,
    ) -> Result<()> {
        let text = text.replace(' ', SPACE);
        let mut symbols: Vec<Symbol> = Vec::with_capacity(text.len());
        let mut chars = text.char_indices().peekable();
        while let Some((start, c)) = chars.next() {
            let i = symbols.len();
            symbols.push(Symbol {
                start,
                len: c.len_utf8(),
                prev: i.checked_sub(1),
                next: chars.peek().map(|_| i + 1),
            });
        }
        if symbols.is_empty() {
            return Ok(());
        }
        let mut queue = BinaryHeap::new();
        let try_add =
            |symbols: &[Symbol], queue: &mut BinaryHeap<Bigram>, left: Option<usize>, right| {
                let (Some(left), Some(right)) = (left, right) else {
                    return;
                };
                let (l, r): (Symbol, Symbol) = (symbols[left], symbols[right]);
                let piece = &text[l.start..l.start + l.len + r.len];
                if let Some(&id) = token_to_id.get(piece) {
                    queue.push(Bigram {
                        left,
                        right,
                        score: self.scores[id as usize],
                        size: piece.len(),
                    });
                }
            };
        for i in 1..symbols.len() {
            try_add(&symbols, &mut queue, Some(i - 1), Some(i));
        }
        while let Some(b) = queue.pop() {
            let (l, r) = (symbols[b.left], symbols[b.right]);
            if l.len == 0 || r.len == 0 || l.len + r.len != b.size {
                continue;
            }
            symbols[b.left].len += r.len;
            symbols[b.right].len = 0;
            symbols[b.left].next = r.next;
            if let Some(next) = r.next {
                symbols[next].prev = Some(b.left);
            }
            try_add(&symbols, &mut queue, l.prev, Some(b.left));
            try_add(&symbols, &mut queue, Some(b.left), symbols[b.left].next);
        }
        let mut at = Some(0);
        while let Some(i) = at {
            let s = symbols[i];
            let piece = &text[s.start..s.start + s.len];
            match token_to_id.get(piece) {
                Some(&id) => out.push(id),
                None => {
                    for &b in piece.as_bytes() {
                        let id =
                            self.byte_tokens[b as usize].ok_or_else(|| Error::TokenizerEncode {
                                message: format!(
                                    "{piece:?} is no token and the vocabulary has no byte token <0x{b:02X}>"
                                ),
                            })?;
                        out.push(id);
                    }
                }
            }
            at = s.next;
        }
        Ok(())
    }
}
