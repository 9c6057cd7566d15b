//! Tokenizer tests against llama.cpp reference ids for SmolLM2-135M-Instruct.

mod common;

use std::sync::OnceLock;

use ballast_runtime::error::Error;
use ballast_runtime::tokenizer::{StreamDecoder, Tokenizer, TokenizerSpec};
use proptest::prelude::*;
use sha2::{Digest, Sha256};

fn tok() -> Option<&'static Tokenizer> {
    static TOK: OnceLock<Option<Tokenizer>> = OnceLock::new();
    TOK.get_or_init(common::smollm).as_ref()
}

#[test]
fn smollm_short_texts_match_llama_cpp() {
    let Some(tok) = tok() else { return };
    assert_eq!(
        tok.encode("Once upon a time, there was a little", true, false)
            .unwrap(),
        vec![6403, 1980, 253, 655, 28, 665, 436, 253, 1838]
    );
    assert_eq!(
        tok.encode("def fibonacci(n):", true, false).unwrap(),
        vec![1604, 3987, 46477, 24, 94, 727]
    );
    assert_eq!(
        tok.decode(&[1604, 3987, 46477, 24, 94, 727]),
        "def fibonacci(n):"
    );
    assert_eq!(tok.vocab_size(), 49152);
    assert_eq!(tok.bos_id(), Some(1));
    assert_eq!(tok.eos_id(), Some(2));
    assert!(tok.encode("", true, true).unwrap().is_empty());
}

#[test]
fn smollm_gpl3_matches_llama_cpp() {
    let Some(tok) = tok() else { return };
    let path = "/usr/share/common-licenses/GPL-3";
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("skipping: cannot read {path}: {e}");
            return;
        }
    };
    let start = std::time::Instant::now();
    let ids = tok.encode(&text, true, false).unwrap();
    let elapsed = start.elapsed();
    eprintln!(
        "GPL-3: {} bytes -> {} ids in {:?}",
        text.len(),
        ids.len(),
        elapsed
    );
    assert_eq!(ids.len(), 7639);
    assert_eq!(
        &ids[..40],
        &[
            42185, 28807, 35185, 49126, 35696, 45581, 41026, 16997, 13867, 216, 35, 28, 216, 34,
            41, 4019, 216, 34, 32, 32, 39, 1116, 10504, 365, 51, 25, 216, 34, 32, 32, 39, 7664,
            12316, 6208, 28, 5829, 30, 2067, 4687, 1742
        ]
    );
    assert_eq!(
        &ids[ids.len() - 10..],
        &[29, 1766, 29, 92, 87, 439, 30, 5699, 19369, 198]
    );
    let joined = ids.iter().map(u32::to_string).collect::<Vec<_>>().join(" ");
    let digest = Sha256::digest(joined.as_bytes());
    let hex: String = digest.iter().map(|b| format!("{b:02x}")).collect();
    assert_eq!(
        hex,
        "f19dd14bf7574b4aca4268db91efad21427436a9f9c9fda34cf46737402d5a99"
    );
    assert_eq!(tok.decode(&ids), text);
    // Speed is only meaningful with optimizations (`cargo test --release`).
    if !cfg!(debug_assertions) {
        assert!(elapsed.as_secs_f64() < 1.0, "tokenizing took {elapsed:?}");
    }
}

#[test]
fn smollm_special_tokens() {
    let Some(tok) = tok() else { return };
    let text = "<|im_start|>user\nhi<|im_end|>";
    let ids = tok.encode(text, true, true).unwrap();
    assert_eq!(ids.first(), Some(&1));
    assert_eq!(ids.last(), Some(&2));
    assert_eq!(ids.iter().filter(|&&i| i == 1 || i == 2).count(), 2);
    assert_eq!(tok.decode(&ids), text);
    let plain = tok.encode(text, true, false).unwrap();
    assert!(!plain.contains(&1) && !plain.contains(&2), "{plain:?}");
    assert_eq!(tok.decode(&plain), text);
    assert_eq!(tok.id_of("<|im_end|>"), Some(2));
    assert_eq!(tok.token_bytes(2), b"<|im_end|>");
    assert!(tok.is_control(1));
    // End of generation: eos, and <|endoftext|> (auto-detected like llama.cpp).
    assert!(tok.is_end_of_generation(2));
    assert!(tok.is_end_of_generation(0));
    assert!(!tok.is_end_of_generation(1));
    assert!(!tok.is_end_of_generation(6403));
    assert_eq!(tok.eog_ids(), vec![0, 2]);
}

#[test]
fn tokenizer_is_send_and_sync() {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<Tokenizer>();
    assert_send_sync::<StreamDecoder>();
}

#[test]
fn unsupported_model_and_pre_are_typed_errors() {
    let spec = TokenizerSpec {
        model: "gpt2".into(),
        pre: Some("no-such-pre".into()),
        tokens: vec!["a".into()],
        ..TokenizerSpec::default()
    };
    match Tokenizer::from_spec(spec.clone()) {
        Err(Error::TokenizerUnsupportedPre { pre }) => assert_eq!(pre, "no-such-pre"),
        other => panic!("unexpected: {other:?}"),
    }
    let spec = TokenizerSpec {
        model: "bert".into(),
        ..spec
    };
    match Tokenizer::from_spec(spec) {
        Err(Error::TokenizerUnsupportedModel { model }) => assert_eq!(model, "bert"),
        other => panic!("unexpected: {other:?}"),
    }
}

fn toy_spec(pre: &str) -> TokenizerSpec {
    // Every single-byte token, in GPT-2 byte-char form, plus a few merges.
    let mut tokens = vec!["<|endoftext|>".to_string()];
    let table: Vec<char> = {
        let mut t = Vec::new();
        let mut extra = 0u32;
        for b in 0u32..256 {
            let printable = (0x21..=0x7E).contains(&b)
                || (0xA1..=0xAC).contains(&b)
                || (0xAE..=0xFF).contains(&b);
            t.push(
                char::from_u32(if printable {
                    b
                } else {
                    extra += 1;
                    255 + extra
                })
                .unwrap(),
            );
        }
        t
    };
    tokens.extend(table.iter().map(|c| c.to_string()));
    tokens.extend(["he", "ll", "hell", "hello", "Ġw"].map(String::from));
    let n = tokens.len();
    let mut token_types = vec![1; n];
    token_types[0] = 3;
    TokenizerSpec {
        model: "gpt2".into(),
        pre: Some(pre.into()),
        tokens,
        token_types,
        merges: ["h e", "l l", "he ll", "hell o", "Ġ w"]
            .map(String::from)
            .to_vec(),
        bos_id: Some(0),
        eos_id: Some(0),
        add_bos: true,
        ..TokenizerSpec::default()
    }
}

#[test]
fn toy_vocab_all_supported_pres_build_and_round_trip() {
    for pre in [
        "smollm",
        "gpt-2",
        "default",
        "llama3",
        "llama-bpe",
        "qwen2",
        "starcoder",
        "falcon",
    ] {
        let tok = Tokenizer::from_spec(toy_spec(pre)).unwrap();
        let text = "hello world 123 é😀\n\n  x<|endoftext|>";
        let ids = tok.encode(text, true, true).unwrap();
        assert_eq!(ids[0], 0, "{pre}: BOS");
        assert_eq!(*ids.last().unwrap(), 0, "{pre}: special token");
        assert_eq!(tok.decode(&ids[1..]), text, "{pre}");
        assert_eq!(ids[1], tok.id_of("hello").unwrap(), "{pre}");
    }
}

fn toy_with_merges(pre: &str, extra: &[&str]) -> Tokenizer {
    let mut spec = toy_spec(pre);
    let mut merges: Vec<String> = extra.iter().map(|s| s.to_string()).collect();
    for m in extra {
        let joined = m.replace(' ', "");
        if !spec.tokens.contains(&joined) {
            spec.tokens.push(joined);
            spec.token_types.push(1);
        }
    }
    merges.extend(spec.merges);
    spec.merges = merges;
    Tokenizer::from_spec(spec).unwrap()
}

fn pieces(tok: &Tokenizer, text: &str) -> Vec<String> {
    tok.encode(text, false, false)
        .unwrap()
        .iter()
        .map(|&id| String::from_utf8_lossy(tok.token_bytes(id)).into_owned())
        .collect()
}

#[test]
fn digit_and_contraction_splitting_per_pre_type() {
    let merges = ["3 4", "1 2", "12 3", "4 5", "' M"];
    let p = |pre: &str, text: &str| pieces(&toy_with_merges(pre, &merges), text);
    // gpt-2: digit runs are one pre-token; smollm / qwen2: one digit each; llama3: groups of three.
    assert_eq!(p("gpt-2", "1234"), ["12", "34"]);
    assert_eq!(p("smollm", "1234"), ["1", "2", "3", "4"]);
    assert_eq!(p("qwen2", "1234"), ["1", "2", "3", "4"]);
    assert_eq!(p("llama3", "1234"), ["123", "4"]);
    // Contractions are case-insensitive only for llama3 / qwen2.
    assert_eq!(p("gpt-2", "I'M"), ["I", "'", "M"]);
    assert_eq!(p("llama3", "I'M"), ["I", "'M"]);
    assert_eq!(p("qwen2", "I'M"), ["I", "'M"]);
}

#[test]
fn llama3_ignores_merges_for_whole_vocabulary_words() {
    for (pre, expected) in [("llama3", 1usize), ("gpt-2", 3)] {
        let mut spec = toy_spec(pre);
        spec.tokens.push("xyz".into());
        spec.token_types.push(1);
        let tok = Tokenizer::from_spec(spec).unwrap();
        assert_eq!(
            tok.encode("xyz", false, false).unwrap().len(),
            expected,
            "{pre}"
        );
    }
}

#[test]
fn special_rendering_choice() {
    let tok = Tokenizer::from_spec(toy_spec("gpt-2")).unwrap();
    let ids = tok.encode("hello<|endoftext|>", false, true).unwrap();
    assert_eq!(tok.decode_with(&ids, false), "hello");
    assert_eq!(tok.decode_with(&ids, true), "hello<|endoftext|>");
    assert!(tok.token_piece(0, false).is_empty());
}

#[test]
fn stream_decoder_holds_split_characters() {
    let Some(tok) = tok() else { return };
    // "é" is two bytes; find byte-level single-byte tokens for 0xC3 and 0xA9.
    let c3 = tok.id_of("Ã").expect("byte token 0xC3");
    let a9 = tok.id_of("©").expect("byte token 0xA9");
    let mut s = StreamDecoder::new();
    assert_eq!(s.push(tok, c3), "");
    assert!(s.has_pending());
    assert_eq!(s.push(tok, a9), "é");
    assert_eq!(s.finish(), "");
    // A dangling lead byte is flushed lossily, like decode.
    let mut s = StreamDecoder::new();
    let mut out = s.push(tok, c3);
    out += &s.finish();
    assert_eq!(out, tok.decode(&[c3]));
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]

    #[test]
    fn stream_decoder_matches_decode(ids in proptest::collection::vec(
        prop_oneof![0u32..49152, 120u32..300, 0u32..20], 0..40)) {
        let Some(tok) = tok() else { return Ok(()) };
        let mut s = StreamDecoder::new();
        let mut out = String::new();
        for &id in &ids {
            let chunk = s.push(tok, id);
            prop_assert!(std::str::from_utf8(chunk.as_bytes()).is_ok());
            out.push_str(&chunk);
        }
        out.push_str(&s.finish());
        prop_assert_eq!(out, tok.decode(&ids));
    }

    #[test]
    fn stream_decoder_bytes_match_lossy(chunks in proptest::collection::vec(
        proptest::collection::vec(prop_oneof![any::<u8>(), 0x80u8..0xC0, 0xC2u8..0xF5], 0..5), 0..30)) {
        let mut s = StreamDecoder::new();
        let mut out = String::new();
        let mut all = Vec::new();
        for c in &chunks {
            all.extend_from_slice(c);
            out.push_str(&s.push_bytes(c));
        }
        out.push_str(&s.finish());
        prop_assert_eq!(out, String::from_utf8_lossy(&all).into_owned());
    }

    #[test]
    fn encode_decode_round_trip(text in "\\PC{0,60}") {
        let Some(tok) = tok() else { return Ok(()) };
        let ids = tok.encode(&text, false, false).unwrap();
        prop_assert_eq!(tok.decode(&ids), text);
    }
}
