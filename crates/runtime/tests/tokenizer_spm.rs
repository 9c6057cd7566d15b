//! The SentencePiece tokenizer (`tokenizer.ggml.model = "llama"`): llama.cpp's merge
//! order, space prefix, byte fallback, special tokens, detokenization and its errors, on
//! the tiny SPM vocabulary of `ballast_runtime::testing` and on hand-made ones.

use ballast_runtime::error::Error;
use ballast_runtime::gguf::{GgufFile, Value};
use ballast_runtime::testing::{spm_vocab, TinyModelSpec, TinyVocab};
use ballast_runtime::tokenizer::{StreamDecoder, Tokenizer, TokenizerSpec};
use proptest::prelude::*;

/// The tiny SPM vocabulary as the GGUF writer stores it, read back like any model's.
fn tiny_spm_file(extra: &[(&str, Value)]) -> GgufFile {
    let spec = TinyModelSpec {
        vocab: TinyVocab::SentencePiece,
        n_layers: 1,
        ..TinyModelSpec::default()
    };
    let mut w = spec.writer().unwrap();
    for (k, v) in extra {
        w.add_metadata(*k, v.clone()).unwrap();
    }
    GgufFile::from_bytes(w.to_bytes()).unwrap()
}

fn tiny() -> Tokenizer {
    Tokenizer::from_gguf(&tiny_spm_file(&[])).unwrap()
}

fn id(tok: &Tokenizer, text: &str) -> u32 {
    tok.id_of(text)
        .unwrap_or_else(|| panic!("{text:?} in the vocabulary"))
}

fn pieces(tok: &Tokenizer, text: &str) -> Vec<String> {
    tok.encode(text, false, false)
        .unwrap()
        .iter()
        .map(|&i| tok.token_text(i).unwrap().to_string())
        .collect()
}

/// A spec of the given pieces and scores (all normal tokens) after `<unk>`, `<s>`,
/// `</s>` and the 256 byte tokens.
fn spec_with(pieces: &[(&str, f32)]) -> TokenizerSpec {
    let mut tokens: Vec<String> = ["<unk>", "<s>", "</s>"].map(String::from).to_vec();
    let mut token_types = vec![2, 3, 3];
    tokens.extend((0..=255u8).map(|b| format!("<0x{b:02X}>")));
    token_types.extend([6; 256]);
    let mut scores = vec![0.0; tokens.len()];
    for (p, s) in pieces {
        tokens.push(p.to_string());
        token_types.push(1);
        scores.push(*s);
    }
    TokenizerSpec {
        model: "llama".into(),
        tokens,
        token_types,
        scores,
        bos_id: Some(1),
        eos_id: Some(2),
        add_bos: true,
        add_space_prefix: true,
        ..TokenizerSpec::default()
    }
}

#[test]
fn gguf_defaults_bos_and_the_space_prefix() {
    let tok = tiny();
    assert!(tok.is_sentencepiece());
    assert_eq!(tok.bos_id(), Some(1));
    assert_eq!(tok.eos_id(), Some(2));
    assert!(tok.add_bos());
    // The space prefix is on without an add_space_prefix key, as in llama.cpp.
    let ids = tok.encode("Hello world", true, false).unwrap();
    assert_eq!(
        ids,
        vec![1, id(&tok, "\u{2581}Hello"), id(&tok, "\u{2581}world")]
    );
    assert_eq!(tok.decode(&ids[1..]), " Hello world");
    assert_eq!(tok.detokenize(&ids[1..], false), "Hello world");
    // BOS, EOS and `</s>` end generation.
    assert!(tok.is_end_of_generation(2));
    assert!(!tok.is_end_of_generation(1));
    // Empty text: BOS alone with special tokens, nothing without.
    assert_eq!(tok.encode("", true, false).unwrap(), vec![1]);
    assert!(tok.encode("", false, false).unwrap().is_empty());
}

#[test]
fn the_gguf_flag_turns_the_space_prefix_off_and_bos_is_as_the_gguf_says() {
    let file = tiny_spm_file(&[("tokenizer.ggml.add_space_prefix", Value::Bool(false))]);
    let tok = Tokenizer::from_gguf(&file).unwrap();
    assert_eq!(pieces(&tok, "Hello"), ["H", "ello"]);
    assert_eq!(
        tok.detokenize(&tok.encode("Hello", false, false).unwrap(), true),
        "Hello"
    );

    let mut spec = spec_with(&[]);
    spec.add_bos = false;
    let tok = Tokenizer::from_spec(spec).unwrap();
    // No BOS; and with no ▁ piece, the space prefix is spelled in the bytes of ▁.
    let bytes: Vec<u32> = [0xE2, 0x96, 0x81, b'a']
        .iter()
        .map(|b| 3 + *b as u32)
        .collect();
    assert_eq!(tok.encode("a", true, false).unwrap(), bytes);
}

#[test]
fn highest_score_merges_first_and_ties_go_left() {
    // "abc": ab and bc score the same, so the leftmost pair merges.
    let tie = Tokenizer::from_spec(spec_with(&[
        ("a", -10.0),
        ("b", -10.0),
        ("c", -10.0),
        ("ab", -1.0),
        ("bc", -1.0),
        ("\u{2581}", -10.0),
    ]))
    .unwrap();
    assert_eq!(pieces(&tie, "abc"), ["\u{2581}", "ab", "c"]);
    // A better bc wins over ab whatever the position.
    let right = Tokenizer::from_spec(spec_with(&[
        ("a", -10.0),
        ("b", -10.0),
        ("c", -10.0),
        ("ab", -2.0),
        ("bc", -1.0),
        ("\u{2581}", -10.0),
    ]))
    .unwrap();
    assert_eq!(pieces(&right, "abc"), ["\u{2581}", "a", "bc"]);
    // Merges chain: ▁t + he beats ▁th + e once ▁t and he are there.
    let tok = tiny();
    assert_eq!(pieces(&tok, "the"), ["\u{2581}the"]);
    // ▁t outscores ▁▁, so of three spaces before "the" the last goes with it.
    assert_eq!(
        pieces(&tok, "Hello  the"),
        ["\u{2581}Hello", "\u{2581}", "\u{2581}the"]
    );
}

#[test]
fn characters_outside_the_vocabulary_fall_back_to_byte_tokens() {
    let tok = tiny();
    // 日 is a piece, 本 is not: its three UTF-8 bytes come out as <0xNN> tokens.
    assert_eq!(
        pieces(&tok, "日本"),
        ["\u{2581}", "\u{65e5}", "<0xE6>", "<0x9C>", "<0xAC>"]
    );
    // Newlines and tabs are bytes; only spaces become ▁.
    assert_eq!(
        pieces(&tok, "a\n\tb"),
        ["\u{2581}a", "<0x0A>", "<0x09>", "b"]
    );
    let ids = tok.encode("日本\n", false, false).unwrap();
    assert_eq!(tok.decode(&ids), " 日本\n");
    assert_eq!(tok.token_bytes(id(&tok, "<0xE6>")), &[0xE6]);
}

#[test]
fn special_tokens_and_the_space_after_them() {
    let tok = tiny();
    let (s, mask) = (id(&tok, "<s>"), id(&tok, "<mask>"));
    // Parsed: a control token, and text after it gets the space prefix again.
    assert_eq!(
        tok.encode("<s>Hello", false, true).unwrap(),
        vec![s, id(&tok, "\u{2581}Hello")]
    );
    // Not parsed: its characters are text.
    let ids = tok.encode("<s>", false, false).unwrap();
    assert!(!ids.contains(&s));
    assert_eq!(tok.detokenize(&ids, true), "<s>");
    // A user-defined token is matched whole either way.
    assert_eq!(
        tok.encode("a<mask>a", false, false).unwrap(),
        vec![id(&tok, "\u{2581}a"), mask, id(&tok, "\u{2581}a"),]
    );
    // Control tokens render only when asked; unused ones never.
    assert_eq!(tok.decode_with(&[s, id(&tok, "\u{2581}a")], false), " a");
    assert_eq!(tok.decode_with(&[s, id(&tok, "\u{2581}a")], true), "<s> a");
    assert!(tok.token_piece(id(&tok, "<unused0>"), true).is_empty());
}

#[test]
fn streaming_holds_byte_pieces_until_their_character_is_complete() {
    let tok = tiny();
    let ids = tok.encode("本日", false, false).unwrap();
    let mut s = StreamDecoder::new();
    let shown: Vec<String> = ids.iter().map(|&i| s.push(&tok, i)).collect();
    // ▁, then the three bytes of 本 (shown at the third), then 日.
    assert_eq!(shown, [" ", "", "", "本", "日"]);
    assert!(!s.has_pending());
    assert_eq!(shown.concat(), tok.decode(&ids));
}

#[test]
fn malformed_vocabularies_are_named_errors() {
    let err = |spec: TokenizerSpec| Tokenizer::from_spec(spec).unwrap_err();
    let mut spec = spec_with(&[("a", 0.0)]);
    spec.scores.pop();
    assert!(
        matches!(err(spec), Error::TokenizerInvalidVocab { reason } if reason.contains("tokenizer.ggml.scores"))
    );
    let mut spec = spec_with(&[("<0xZZ>", 0.0)]);
    *spec.token_types.last_mut().unwrap() = 6;
    assert!(
        matches!(err(spec), Error::TokenizerInvalidVocab { reason } if reason.contains("<0xZZ>"))
    );
    let mut spec = spec_with(&[]);
    spec.pre = Some("llama3".into());
    assert!(matches!(err(spec), Error::TokenizerUnsupportedPre { pre } if pre == "llama3"));
    let mut spec = spec_with(&[]);
    spec.bos_id = Some(100_000);
    assert!(matches!(err(spec), Error::TokenizerInvalidVocab { reason } if reason.contains("bos")));
    let mut spec = spec_with(&[]);
    spec.model = "t5".into();
    assert!(matches!(err(spec), Error::TokenizerUnsupportedModel { model } if model == "t5"));
    // A vocabulary without byte tokens cannot spell what it has no piece for: an error
    // naming the byte at encode time, not a panic.
    let tok = Tokenizer::from_spec(TokenizerSpec {
        model: "llama".into(),
        tokens: vec!["<unk>".into(), "\u{2581}".into(), "a".into()],
        token_types: vec![2, 1, 1],
        add_space_prefix: true,
        ..TokenizerSpec::default()
    })
    .unwrap();
    assert_eq!(tok.encode("a", false, false).unwrap(), vec![1, 2]);
    match tok.encode("a\u{e9}", false, false) {
        Err(Error::TokenizerEncode { message }) => assert!(message.contains("0xC3"), "{message}"),
        other => panic!("unexpected: {other:?}"),
    }
}

#[test]
fn the_tiny_vocabulary_is_what_the_writer_stores() {
    let (tokens, scores, types) = spm_vocab();
    let file = tiny_spm_file(&[]);
    let spec = TokenizerSpec::from_gguf(&file).unwrap();
    assert_eq!(spec.tokens, tokens);
    assert_eq!(spec.scores, scores);
    assert_eq!(spec.token_types, types);
    assert!(spec.add_space_prefix && spec.add_bos && !spec.add_eos);
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 500, ..ProptestConfig::default() })]

    // Arbitrary text (without the ▁ marker itself, which SentencePiece reads as a
    // space) comes back from its tokens, pieces and byte fallback alike, and a stream
    // of the tokens shows the same text.
    #[test]
    fn encode_detokenize_round_trip(text in "[^\u{2581}]{0,60}|[ a-zHWTe日本\n]{0,40}") {
        let tok = tiny();
        let ids = tok.encode(&text, false, false).unwrap();
        prop_assert_eq!(tok.detokenize(&ids, true), text.clone());
        let mut s = StreamDecoder::new();
        let mut out = String::new();
        for &i in &ids {
            out += &s.push(&tok, i);
        }
        out += &s.finish();
        prop_assert_eq!(out, tok.decode(&ids));
        if !text.is_empty() {
            prop_assert_eq!(tok.decode(&ids), format!(" {text}"));
        }
    }
}

// llama.cpp's ids for the tiny SPM vocabulary, recorded once with
//   cargo xtask tiny-model llama-spm llama-spm.gguf
//   printf '%s' "$TEXT" | llama-tokenize -m llama-spm.gguf --stdin --no-escape --ids \
//       --log-disable [--no-bos] [--no-parse-special]
// (llama.cpp from the llama-cpp-python 0.3.36 sdist, vendor/llama.cpp; llama-tokenize
// adds BOS and parses special tokens unless told not to). Columns: text, add_special,
// parse_special, ids.
const LLAMA_CPP_IDS: &[(&str, bool, bool, &[u32])] = &[
    ("Hello world", true, true, &[1, 286, 288]),
    (
        "Hello  the world is in the hello",
        true,
        true,
        &[1, 286, 298, 264, 288, 290, 291, 264, 298, 260, 273, 302],
    ),
    (
        "  leading spaces and trailing  ",
        true,
        true,
        &[
            1, 292, 298, 308, 299, 301, 309, 293, 271, 317, 301, 311, 277, 297, 259, 307, 301, 303,
            308, 293, 292,
        ],
    ),
    (
        "日本語のテキスト, é and naïve!",
        true,
        true,
        &[
            1, 298, 331, 233, 159, 175, 235, 173, 161, 230, 132, 177, 230, 134, 137, 230, 133, 176,
            230, 133, 188, 230, 134, 139, 322, 298, 330, 297, 298, 304, 301, 198, 178, 320, 299,
            323,
        ],
    ),
    (
        "line one\nline two\n\n\ttabbed",
        true,
        true,
        &[
            1, 298, 308, 262, 299, 298, 266, 299, 13, 308, 262, 299, 259, 313, 302, 13, 13, 12,
            300, 301, 318, 318, 299, 309,
        ],
    ),
    (
        "<s>Hello</s> world<mask>again <unused0>",
        true,
        true,
        &[
            1, 1, 286, 2, 298, 288, 332, 261, 315, 301, 262, 298, 63, 310, 304, 310, 305, 299, 309,
            51, 65,
        ],
    ),
    (
        "<s>Hello</s> world<mask>again <unused0>",
        true,
        false,
        &[
            1, 298, 63, 305, 65, 327, 283, 63, 50, 305, 65, 288, 332, 261, 315, 301, 262, 298, 63,
            310, 304, 310, 305, 299, 309, 51, 65,
        ],
    ),
    ("x<unk>y</s>", false, true, &[298, 123, 0, 298, 314, 2]),
    (
        "The weather is what it is; water, wood and worn walls.",
        true,
        true,
        &[
            1, 298, 326, 260, 272, 299, 268, 260, 307, 290, 272, 306, 268, 298, 276, 290, 62, 272,
            268, 263, 322, 272, 302, 302, 309, 297, 287, 304, 272, 301, 273, 305, 321,
        ],
    ),
    ("Hello world", false, true, &[286, 288]),
    ("", true, true, &[1]),
    (
        "▁ marker and ééé 😀 emoji",
        true,
        true,
        &[
            1, 292, 298, 312, 301, 307, 319, 263, 297, 298, 330, 330, 330, 298, 243, 162, 155, 131,
            298, 299, 312, 302, 109, 303,
        ],
    ),
];

#[test]
fn ids_equal_llama_tokenize_on_the_tiny_vocabulary() {
    let spec = ballast_runtime::testing::reference_spec("llama-spm").unwrap();
    let file = GgufFile::from_bytes(spec.to_gguf_bytes().unwrap()).unwrap();
    let tok = Tokenizer::from_gguf(&file).unwrap();
    for &(text, add_special, parse_special, want) in LLAMA_CPP_IDS {
        let got = tok.encode(text, add_special, parse_special).unwrap();
        assert_eq!(
            got, want,
            "{text:?} add_special {add_special} parse_special {parse_special}"
        );
    }
}
