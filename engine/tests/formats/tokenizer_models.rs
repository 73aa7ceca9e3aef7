//! Tokenizers of the two real models in the cache (SmolLM2-135M-Instruct, gemma-3-270m): known encodings, special
//! tokens, BOS handling and round trips. Build and encode speed: `cargo bench -p strata-engine --bench tokenizer`.

use std::path::PathBuf;

use strata_engine::gguf::GgufFile;
use strata_engine::models::{DEFAULT_MODEL_FILE, GEMMA3_MODEL_FILE};
use strata_engine::tokenizer::{TokenKind, Tokenizer, TokenizerKind};

fn cached(file: &str) -> PathBuf {
    strata_engine::models::require(file).unwrap_or_else(|e| panic!("{e}"))
}

fn load(file: &str) -> Tokenizer {
    let gguf = GgufFile::open(cached(file)).expect("model GGUF opens");
    Tokenizer::from_metadata(gguf.metadata()).unwrap_or_else(|e| panic!("{file}: {e}"))
}

#[test]
fn smollm2_encodes_known_ids_without_bos() {
    let tok = load(DEFAULT_MODEL_FILE);
    assert_eq!(tok.kind(), TokenizerKind::Bpe { pre: "smollm" });
    assert_eq!(tok.vocab_size(), 49152);
    // The GGUF says tokenizer.ggml.add_bos_token = false, so add_special adds nothing.
    assert!(!tok.add_bos());
    let want = [19556, 905, 28, 5549, 117, 81, 46316, 47];
    assert_eq!(tok.encode("Hello world, ça va?", false, false).unwrap(), want);
    assert_eq!(tok.encode("Hello world, ça va?", true, false).unwrap(), want);
    assert_eq!(tok.decode(&want).unwrap(), "Hello world, ça va?");
}

#[test]
fn smollm2_special_tokens() {
    let tok = load(DEFAULT_MODEL_FILE);
    let im_start = tok.token_id("<|im_start|>").unwrap();
    let im_end = tok.token_id("<|im_end|>").unwrap();
    assert_eq!((im_start, im_end), (1, 2));
    assert_eq!(tok.bos(), Some(1));
    assert_eq!(tok.eos(), Some(2));
    assert_eq!(tok.eot(), Some(im_end));
    assert!(tok.is_eog(im_end));
    assert!(tok.is_eog(tok.token_id("<|endoftext|>").unwrap()));
    assert!(!tok.is_eog(im_start));
    assert_eq!(tok.token_kind(im_start), Some(TokenKind::Control));

    let text = "<|im_start|>user\nHi<|im_end|>\n";
    let parsed = tok.encode(text, false, true).unwrap();
    assert_eq!(parsed.first(), Some(&im_start));
    assert!(parsed.contains(&im_end));
    assert_eq!(tok.decode(&parsed).unwrap(), text);
    // Without parse_special the markers are plain text.
    let plain = tok.encode(text, false, false).unwrap();
    assert!(!plain.contains(&im_start) && !plain.contains(&im_end), "{plain:?}");
    assert_eq!(tok.decode(&plain).unwrap(), text);
    assert_eq!(tok.decode_bytes(&parsed, true).unwrap(), b"user\nHi\n");
    assert_eq!(tok.token_to_piece(im_end).unwrap(), b"<|im_end|>");
    assert!(tok.decode(&[49152]).is_err());
}

/// Oracle: Google's `sentencepiece` 0.2.3 (Python), given a ModelProto built from this GGUF's own tokens, scores
/// and types (BPE, byte fallback, identity normalizer, no dummy prefix: the gemma 3 tokenizer's settings).
/// SentencePiece's BPE merges by piece score, leftmost first, which is what llama.cpp's llm_tokenizer_spm
/// reproduces, so the two must agree. User-defined tokens (whitespace runs, HTML tags) are split off first as
/// llama.cpp does, by the script itself. Script: fixtures/tokenizer/sentencepiece_gemma3.py.
const GEMMA3_CASES: &[(&str, &[u32])] = &[
    ("Hello world, ça va?", &[9259, 1902, 236764, 20924, 5380, 236881]),
    (
        "<table><tr><td>cell</td></tr></table> and <b>bold</b>",
        &[168, 173, 175, 5447, 183, 181, 176, 532, 236743, 200, 15640, 209],
    ),
    ("  leading spaces and trailing  ", &[138, 26016, 9952, 532, 45330, 138]),
    (
        "The quick brown fox jumps over the lazy dog.\n\nNew paragraph:\tTabbed.",
        &[
            818, 3823, 8864, 37423, 38167, 1024, 506, 31770, 4799, 236761, 108, 4199, 15649, 236787, 255968, 7874,
            4250, 236761,
        ],
    ),
    (
        "日本語のテキストと emoji 🦙🚀 mixed",
        &[
            94951, 236945, 95830, 237032, 64334, 236743, 478, 397, 404, 391, 242015, 9726,
        ],
    ),
    (
        "def f(x):\n    return x ** 2  # square",
        &[
            2063, 517, 236769, 236781, 1473, 107, 140, 2060, 1123, 5213, 236743, 236778, 138, 236865, 6281,
        ],
    ),
    (
        "Zürich, Ελληνικά, русский, עברית, العربية",
        &[
            236953, 105214, 236764, 23883, 109959, 42220, 236764, 170362, 236764, 11173, 104154, 237270, 236764, 87595,
        ],
    ),
    (
        "3.14159 + 2718281828 = ?",
        &[
            236800, 236761, 236770, 236812, 236770, 236810, 236819, 900, 236743, 236778, 236832, 236770, 236828,
            236778, 236828, 236770, 236828, 236778, 236828, 578, 2360,
        ],
    ),
    (
        "unbelievably antidisestablishmentarianism",
        &[602, 8145, 20873, 2579, 2314, 33090, 163524, 8225, 1929],
    ),
];

#[test]
fn gemma3_matches_sentencepiece() {
    let tok = load(GEMMA3_MODEL_FILE);
    assert_eq!(tok.kind(), TokenizerKind::Spm);
    assert_eq!(tok.vocab_size(), 262144);
    for (text, want) in GEMMA3_CASES {
        let got = tok.encode(text, false, false).unwrap();
        assert_eq!(&got, want, "{text:?}");
        assert_eq!(&tok.decode(&got).unwrap(), text);
    }
}

#[test]
fn gemma3_bos_and_turn_markers() {
    let tok = load(GEMMA3_MODEL_FILE);
    assert_eq!(tok.bos(), Some(2));
    assert_eq!(tok.eos(), Some(1));
    assert!(tok.add_bos());
    let start = tok.token_id("<start_of_turn>").unwrap();
    let end = tok.token_id("<end_of_turn>").unwrap();
    assert_eq!(tok.eot(), Some(end));
    assert!(tok.is_eog(end) && tok.is_eog(1));

    let ids = tok.encode("Hello world, ça va?", true, false).unwrap();
    assert_eq!(ids, [2, 9259, 1902, 236764, 20924, 5380, 236881]);

    let prompt = "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n";
    let ids = tok.encode(prompt, true, true).unwrap();
    let newline = tok.token_id("\n").unwrap();
    let hi = tok.encode("Hi", false, false).unwrap();
    let user = tok.encode("user", false, false).unwrap();
    let model = tok.encode("model", false, false).unwrap();
    let mut want = vec![2, start];
    want.extend(&user);
    want.push(newline);
    want.extend(&hi);
    want.extend([end, newline, start]);
    want.extend(&model);
    want.push(newline);
    assert_eq!(ids, want);
    assert_eq!(tok.decode(&ids).unwrap(), format!("<bos>{prompt}"));
}
