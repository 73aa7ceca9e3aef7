//! Pre-tokenizers of byte-level BPE vocabularies, chosen by `tokenizer.ggml.pre`.
//!
//! Each entry is the list of regexes that llama.cpp's `llm_tokenizer_bpe` applies for that pre-tokenizer type
//! (llama-vocab.cpp), written here in the form the model's own `tokenizer.json` uses, which Oniguruma reads as is.
//! The regexes split in sequence: each one cuts every piece left by the previous one into matches and the text
//! between them, and both are kept (the `Isolated` split behaviour). The pieces are then byte-level encoded.
//!
//! A row is data: adding a pre-tokenizer is adding a row. [`PRE_TOKENIZERS`] says which rows are checked against
//! llama.cpp's test vectors (`engine/tests/formats/tokenizer_vectors.rs`); the others are transcriptions not yet checked
//! against any vector.

/// GPT-2's word splitter: contractions, letters, digits, other symbols, each with an optional leading space.
const GPT2: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";

/// Llama 3's splitter: case-insensitive contractions, digits in runs of at most three, newlines kept together.
const LLAMA3: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Qwen 2's splitter: Llama 3's with single digits.
const QWEN2: &str =
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Qwen 3.5's splitter: Qwen 2's with combining marks (`\p{M}`) kept inside words.
const QWEN35: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// The o200k splitter (GPT-4o, Llama 4): words split at lower-to-upper case changes.
const GPT4O: &str = r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Mistral's Tekken splitter: the o200k one without contractions and with single digits.
const TEKKEN: &str = r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// CJK ideographs, a stretch of rare scripts, and Hangul (DeepSeek's tokenizers).
const DEEPSEEK_CJK: &str = "[\u{4e00}-\u{9fa5}\u{0800}-\u{4e00}\u{ac00}-\u{d7ff}]+";

/// DeepSeek LLM's Latin, Greek, Cyrillic, Armenian, Georgian, Cherokee... letter class, from its tokenizer.json.
const DEEPSEEK_LLM_LETTERS: &str = concat!(
    r"\s?[A-Za-z",
    "\u{b5}\u{c0}-\u{d6}\u{d8}-\u{f6}\u{f8}-\u{1ba}\u{1bc}-\u{1bf}\u{1c4}-\u{293}\u{295}-\u{2af}\u{370}-\u{373}",
    "\u{376}\u{377}\u{37b}-\u{37d}\u{37f}\u{386}\u{388}-\u{38a}\u{38c}\u{38e}-\u{3a1}\u{3a3}-\u{3f5}\u{3f7}-\u{481}",
    "\u{48a}-\u{52f}\u{531}-\u{556}\u{10a0}-\u{10c5}\u{13a0}-\u{13f5}\u{13f8}-\u{13fd}\u{1c90}-\u{1cba}\u{1cbd}-\u{1cbf}",
    "\u{1d00}-\u{1d2b}\u{1d6b}-\u{1d77}\u{1d79}-\u{1d9a}\u{1e00}-\u{1f15}\u{1f18}-\u{1f1d}\u{1f20}-\u{1f45}\u{1f48}-\u{1f4d}",
    "\u{1f50}-\u{1f57}\u{1f59}\u{1f5b}\u{1f5d}\u{1f5f}-\u{1f7d}\u{1f80}-\u{1fb4}\u{1fb6}-\u{1fbc}\u{1fbe}\u{1fc2}-\u{1fc4}",
    "\u{1fc6}-\u{1fcc}\u{1fd0}-\u{1fd3}\u{1fd6}-\u{1fdb}\u{1fe0}-\u{1fec}\u{1ff2}-\u{1ff4}\u{1ff6}-\u{1ffc}\u{2102}\u{2107}",
    "\u{210a}-\u{2113}\u{2115}\u{2119}-\u{211d}\u{2124}\u{2126}\u{2128}\u{212a}-\u{212d}\u{212f}-\u{2134}\u{2139}",
    "\u{213c}-\u{213f}\u{2145}-\u{2149}\u{214e}\u{2183}\u{2184}\u{2c00}-\u{2c7b}\u{2c7e}-\u{2ce4}\u{2ceb}-\u{2cee}",
    "\u{2cf2}\u{2cf3}\u{a640}-\u{a66d}\u{a680}-\u{a69b}\u{a722}-\u{a76f}\u{a771}-\u{a787}\u{a78b}-\u{a78e}\u{ab70}-\u{abbf}",
    "\u{fb00}-\u{fb06}\u{fb13}-\u{fb17}\u{ff21}-\u{ff3a}\u{ff41}-\u{ff5a}\u{10400}-\u{1044f}\u{104b0}-\u{104d3}",
    "\u{104d8}-\u{104fb}\u{10c80}-\u{10cb2}\u{10cc0}-\u{10cf2}\u{118a0}-\u{118df}\u{1e900}-\u{1e943}]+",
);

/// One pre-tokenizer: the `tokenizer.ggml.pre` names that select it and what it does.
#[derive(Debug)]
pub(crate) struct PreTokenizer {
    /// Values of `tokenizer.ggml.pre` that select this row (the first is its canonical name).
    pub names: &'static [&'static str],
    /// Split regexes, applied in order.
    pub regexes: &'static [&'static str],
    /// Whether a pre-token that is itself in the vocabulary is emitted whole, without merges (llama.cpp's
    /// `ignore_merges`, tokenizer.json's `"ignore_merges": true`).
    pub ignore_merges: bool,
    /// Whether llama.cpp adds BOS by default for this type (before `tokenizer.ggml.add_bos_token` overrides it).
    pub add_bos: bool,
}

const fn row(names: &'static [&'static str], regexes: &'static [&'static str]) -> PreTokenizer {
    PreTokenizer {
        names,
        regexes,
        ignore_merges: false,
        add_bos: false,
    }
}

/// Every supported pre-tokenizer. Missing `tokenizer.ggml.pre` means `default`, as in llama.cpp.
/// Verified against llama.cpp's vectors: the gpt-2 row (gpt-2, mpt), llama-bpe, qwen2, qwen35, the smollm row
/// (starcoder, refact, command-r; smollm itself by SmolLM2's known ids), falcon, deepseek-coder, deepseek-llm.
/// Unverified (no vector in the sdist): default, the dbrx row, the poro row, gpt-4o, tekken.
pub(crate) static PRE_TOKENIZERS: &[PreTokenizer] = &[
    row(
        &["default"],
        &[r"[\p{P}\$\+<=>\^~\|]+", GPT2, r"\p{N}+", "[0-9][0-9][0-9]"],
    ),
    row(
        &[
            "gpt-2",
            "phi-2",
            "mpt",
            "olmo",
            "jais",
            "trillion",
            "gigachat",
            "mellum",
            "roberta-bpe",
        ],
        &[GPT2],
    ),
    PreTokenizer {
        names: &[
            "llama-bpe",
            "llama3",
            "llama-v3",
            "falcon3",
            "falcon-h1",
            "pixtral",
            "midm-2.0",
            "lfm2",
        ],
        regexes: &[LLAMA3],
        ignore_merges: true,
        add_bos: true,
    },
    row(&["dbrx", "smaug-bpe", "chatglm-bpe"], &[LLAMA3]),
    row(
        &["qwen2", "deepseek-r1-qwen", "stablelm2", "hunyuan", "grok-2"],
        &[QWEN2],
    ),
    row(&["qwen35"], &[QWEN35]),
    row(
        &[
            "smollm",
            "starcoder",
            "refact",
            "command-r",
            "codeshell",
            "exaone",
            "minerva-7b",
        ],
        &[r"\p{N}", GPT2],
    ),
    row(&["falcon"], &[r"[\p{P}\$\+<=>\^~\|`]+", GPT2, "[0-9][0-9][0-9]"]),
    row(
        &["deepseek-coder"],
        &["[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", DEEPSEEK_CJK, r"\p{N}"],
    ),
    row(
        &["deepseek-llm"],
        &[
            "[\r\n]",
            DEEPSEEK_LLM_LETTERS,
            r"\s?[!-/:-~！-／：-～‘-‟　-。]+",
            r"\s+$",
            DEEPSEEK_CJK,
            r"\p{N}+",
        ],
    ),
    row(&["poro-chat", "bloom", "gpt3-finnish"], &[r" ?[^(\s|.,!?…。，、।۔،)]+"]),
    PreTokenizer {
        names: &["gpt-4o", "llama4"],
        regexes: &[GPT4O],
        ignore_merges: false,
        add_bos: false,
    },
    PreTokenizer {
        names: &["tekken"],
        regexes: &[TEKKEN],
        ignore_merges: true,
        add_bos: true,
    },
];

/// The row selected by `name`, or `None` when no row has it.
pub(crate) fn find(name: &str) -> Option<&'static PreTokenizer> {
    PRE_TOKENIZERS.iter().find(|p| p.names.contains(&name))
}

/// Every accepted name, comma-separated, for error messages.
pub(crate) fn supported_names() -> String {
    PRE_TOKENIZERS
        .iter()
        .flat_map(|p| p.names.iter().copied())
        .collect::<Vec<_>>()
        .join(", ")
}
