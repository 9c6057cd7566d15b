//! Incremental detokenization that never splits a UTF-8 character.

use super::Tokenizer;

/// Turns a stream of token ids into text pieces, holding back an incomplete UTF-8
/// character until the tokens that complete it arrive.
///
/// The concatenation of every [`push`](StreamDecoder::push) result followed by
/// [`finish`](StreamDecoder::finish) equals [`Tokenizer::decode`] of the whole sequence.
#[derive(Debug, Default, Clone)]
pub struct StreamDecoder {
    pending: Vec<u8>,
}

impl StreamDecoder {
    /// Creates an empty decoder.
    pub fn new() -> StreamDecoder {
        StreamDecoder::default()
    }

    /// Feeds one token and returns the text that is complete so far (possibly empty).
    pub fn push(&mut self, tokenizer: &Tokenizer, id: u32) -> String {
        self.push_bytes(tokenizer.token_bytes(id))
    }

    /// Feeds raw bytes and returns the text that is complete so far (possibly empty).
    /// Bytes that can never start or continue a valid character become U+FFFD, exactly
    /// as [`String::from_utf8_lossy`] would replace them.
    pub fn push_bytes(&mut self, bytes: &[u8]) -> String {
        self.pending.extend_from_slice(bytes);
        let mut out = String::new();
        let mut start = 0;
        loop {
            match std::str::from_utf8(&self.pending[start..]) {
                Ok(s) => {
                    out.push_str(s);
                    start = self.pending.len();
                    break;
                }
                Err(e) => {
                    let valid = e.valid_up_to();
                    // SAFETY-free: the prefix was just validated.
                    out.push_str(
                        std::str::from_utf8(&self.pending[start..start + valid])
                            .unwrap_or_default(),
                    );
                    start += valid;
                    match e.error_len() {
                        Some(bad) => {
                            out.push('\u{FFFD}');
                            start += bad;
                        }
                        None => break, // incomplete character at the end: hold it
                    }
                }
            }
        }
        self.pending.drain(..start);
        out
    }

    /// Whether bytes of an incomplete character are being held back.
    pub fn has_pending(&self) -> bool {
        !self.pending.is_empty()
    }

    /// Flushes held-back bytes (as U+FFFD) and resets the decoder.
    pub fn finish(&mut self) -> String {
        let out = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        out
    }
}
