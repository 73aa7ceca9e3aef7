//! Tokenizers and chat templates from GGUF metadata.
//!
//! [`Tokenizer`] turns text into token ids and back exactly as llama.cpp's `llama_tokenize` /
//! `llama_token_to_piece` do for the same GGUF, for the two vocabulary types of the models Strata runs:
//!
//! - `tokenizer.ggml.model` = `gpt2`: byte-level BPE (llama.cpp's `llm_tokenizer_bpe`), pre-tokenized by the
//!   regexes that `tokenizer.ggml.pre` selects, built on the `tokenizers` crate;
//! - `tokenizer.ggml.model` = `llama`: SentencePiece BPE with scores and `<0xXX>` byte fallback (llama.cpp's
//!   `llm_tokenizer_spm`), our own implementation.
//!
//! [`ChatTemplate`] renders `tokenizer.chat_template` (Jinja) with minijinja.
//!
//! Source for the keys: the GGUF specification, "Tokenizer" section (ggml/docs/gguf.md), and llama.cpp's
//! `llama_vocab::impl::load` (llama-vocab.cpp) for the defaults and the token attributes.

mod bpe;
mod pre;
mod special;
mod spm;
pub mod template;

pub use special::{GUARD, unguard};
pub use template::{
    ChatContent, ChatMessage, ChatPrompt, ChatRequest, ChatTemplate, ContentPart, PromptError, TemplateError,
};

use std::collections::HashMap;
use std::fmt;

use crate::gguf::{Metadata, MetadataError, Value};

use bpe::BpeEncoder;
use special::{Fragment, SpecialTokens};

/// `tokenizer.ggml.model`: `gpt2` (byte-level BPE) or `llama` (SentencePiece).
pub const KEY_MODEL: &str = "tokenizer.ggml.model";
/// `tokenizer.ggml.pre`: the pre-tokenizer of a `gpt2` vocabulary (`smollm`, `llama-bpe`, `qwen2`...).
pub const KEY_PRE: &str = "tokenizer.ggml.pre";
/// `tokenizer.ggml.tokens`: the token texts; the index is the id.
pub const KEY_TOKENS: &str = "tokenizer.ggml.tokens";
/// `tokenizer.ggml.scores`: one score per token (SentencePiece merge priority).
pub const KEY_SCORES: &str = "tokenizer.ggml.scores";
/// `tokenizer.ggml.token_type`: one type per token (1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused,
/// 6 byte).
pub const KEY_TOKEN_TYPE: &str = "tokenizer.ggml.token_type";
/// `tokenizer.ggml.merges`: BPE merges, "left right", highest priority first.
pub const KEY_MERGES: &str = "tokenizer.ggml.merges";
/// `tokenizer.ggml.add_bos_token`: whether encoding with `add_special` starts with BOS.
pub const KEY_ADD_BOS: &str = "tokenizer.ggml.add_bos_token";
/// `tokenizer.ggml.add_eos_token`: whether encoding with `add_special` ends with EOS.
pub const KEY_ADD_EOS: &str = "tokenizer.ggml.add_eos_token";
/// `tokenizer.ggml.add_space_prefix`: whether SentencePiece text gets a leading space.
pub const KEY_ADD_SPACE_PREFIX: &str = "tokenizer.ggml.add_space_prefix";
/// `tokenizer.ggml.bos_token_id`.
pub const KEY_BOS_ID: &str = "tokenizer.ggml.bos_token_id";
/// `tokenizer.ggml.eos_token_id`.
pub const KEY_EOS_ID: &str = "tokenizer.ggml.eos_token_id";
/// `tokenizer.ggml.eot_token_id`: end of turn; found by text (`<|im_end|>`, `<end_of_turn>`...) when absent.
pub const KEY_EOT_ID: &str = "tokenizer.ggml.eot_token_id";
/// `tokenizer.ggml.eom_token_id`: end of message (`<|eom_id|>`).
pub const KEY_EOM_ID: &str = "tokenizer.ggml.eom_token_id";
/// `tokenizer.ggml.unknown_token_id`.
pub const KEY_UNK_ID: &str = "tokenizer.ggml.unknown_token_id";
/// `tokenizer.ggml.padding_token_id`.
pub const KEY_PAD_ID: &str = "tokenizer.ggml.padding_token_id";

// Token attributes, as llama.cpp's `llama_token_attr` bit flags.
pub(crate) const ATTR_UNKNOWN: u32 = 1 << 0;
pub(crate) const ATTR_UNUSED: u32 = 1 << 1;
pub(crate) const ATTR_NORMAL: u32 = 1 << 2;
pub(crate) const ATTR_CONTROL: u32 = 1 << 3;
pub(crate) const ATTR_USER_DEFINED: u32 = 1 << 4;
pub(crate) const ATTR_BYTE: u32 = 1 << 5;
pub(crate) const ATTR_LSTRIP: u32 = 1 << 7;
pub(crate) const ATTR_RSTRIP: u32 = 1 << 8;

/// Texts that mark a token as end-of-generation (llama.cpp's list in `llama_vocab::impl::load`).
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

/// Texts of an end-of-turn token when `tokenizer.ggml.eot_token_id` is absent, in order of preference.
const EOT_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "<｜end▁of▁sentence｜>",
    "<end_of_utterance>",
];

/// Texts of fill-in-the-middle pad, repo and file-separator tokens, which llama.cpp also treats as
/// end-of-generation.
const FIM_EOG_TEXTS: &[&[&str]] = &[
    &["<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"],
    &["<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"],
    &["<|file_sep|>"],
];

/// Why a tokenizer could not be built from metadata, or could not encode or decode.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    /// A key is missing or holds the wrong type (the message names the key).
    #[error(transparent)]
    Metadata(#[from] MetadataError),
    #[error(
        "{KEY_MODEL} is `{model}`, which Strata does not tokenize; supported: gpt2 (byte-level BPE), llama (SentencePiece)"
    )]
    UnsupportedModel { model: String },
    #[error("{KEY_PRE} is `{pre}`, an unknown pre-tokenizer; supported: {supported}")]
    UnknownPre { pre: String, supported: String },
    #[error("{key} has {len} entries but {KEY_TOKENS} has {n_tokens}")]
    LengthMismatch {
        key: &'static str,
        len: usize,
        n_tokens: usize,
    },
    #[error("{key}[{index}] is {value}, expected {expected}")]
    BadEntry {
        key: &'static str,
        index: usize,
        value: String,
        expected: &'static str,
    },
    #[error("{KEY_TOKENS} holds `{text}` twice, at ids {first} and {second}")]
    DuplicateToken { text: String, first: u32, second: u32 },
    #[error("{KEY_MERGES}[{index}] `{merge}`: {reason}")]
    BadMerge {
        index: usize,
        merge: String,
        reason: String,
    },
    #[error("building the tokenizer from {key} failed: {reason}")]
    Build { key: &'static str, reason: String },
    #[error("this model adds a {what} token ({key}) but has none in range")]
    MissingSpecial { what: &'static str, key: &'static str },
    #[error("byte 0x{byte:02X} has no <0x{byte:02X}> token and the vocabulary has no unknown token")]
    NoByteToken { byte: u8 },
    #[error("token id {id} is out of range: the vocabulary has {vocab_size} tokens")]
    TokenOutOfRange { id: u32, vocab_size: usize },
    #[error("encoding failed: {0}")]
    Encode(String),
}

/// What a token is, from `tokenizer.ggml.token_type` (and llama.cpp's overrides for end-of-generation tokens).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TokenKind {
    /// Ordinary text.
    Normal,
    /// The unknown token (`<unk>`).
    Unknown,
    /// A control token (`<s>`, `<|im_end|>`...): matched in text only with `parse_special`, rendered by `decode`.
    Control,
    /// A user-defined token: always matched in text as a unit, before the tokenizer runs.
    UserDefined,
    /// A SentencePiece byte token `<0xXX>`.
    Byte,
    /// Marked unused.
    Unused,
    /// No type recorded.
    Undefined,
}

/// Which algorithm a [`Tokenizer`] runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TokenizerKind {
    /// Byte-level BPE (`gpt2`), with the pre-tokenizer named by `tokenizer.ggml.pre`.
    Bpe { pre: &'static str },
    /// SentencePiece with scores (`llama`).
    Spm,
}

/// The vocabulary: texts, scores and attributes by id, and ids by text.
pub(crate) struct Vocab {
    pub(crate) texts: Vec<String>,
    ids: HashMap<String, u32>,
    pub(crate) scores: Vec<f32>,
    pub(crate) attrs: Vec<u32>,
}

impl Vocab {
    pub(crate) fn id(&self, text: &str) -> Option<u32> {
        self.ids.get(text).copied()
    }

    /// The token of a raw byte in a SentencePiece vocabulary: `<0xXX>`, else the one-byte text (llama.cpp's
    /// `byte_to_token`).
    pub(crate) fn byte_token(&self, b: u8) -> Option<u32> {
        self.id(&format!("<0x{b:02X}>")).or_else(|| {
            if b.is_ascii() {
                self.id(&char::from(b).to_string())
            } else {
                None
            }
        })
    }

    fn is_partitioned(&self, id: u32) -> bool {
        self.attrs[id as usize] & (ATTR_CONTROL | ATTR_USER_DEFINED | ATTR_UNKNOWN) != 0
    }
}

enum Encoder {
    Bpe(Box<BpeEncoder>),
    Spm,
}

/// A tokenizer built from a GGUF's `tokenizer.*` metadata, matching llama.cpp's `llama_tokenize` and
/// `llama_token_to_piece`.
///
/// Building one from a 150k-token vocabulary takes about a tenth of a second (see the tests); encoding is
/// O(n log n) in the text length.
pub struct Tokenizer {
    vocab: Vocab,
    encoder: Encoder,
    kind: TokenizerKind,
    specials: SpecialTokens,
    /// Bytes of each token as `token_to_piece` renders it with specials shown (llama.cpp's
    /// `cache_token_to_piece`).
    pieces: Vec<Box<[u8]>>,
    bos: Option<u32>,
    eos: Option<u32>,
    eot: Option<u32>,
    eom: Option<u32>,
    unk: Option<u32>,
    pad: Option<u32>,
    /// End-of-generation ids, sorted.
    eog: Vec<u32>,
    add_bos: bool,
    add_eos: bool,
    add_space_prefix: bool,
}

impl fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Tokenizer")
            .field("kind", &self.kind)
            .field("vocab_size", &self.vocab_size())
            .field("bos", &self.bos)
            .field("eos", &self.eos)
            .field("eot", &self.eot)
            .field("eog", &self.eog)
            .field("add_bos", &self.add_bos)
            .field("add_eos", &self.add_eos)
            .finish()
    }
}

/// An optional boolean key.
fn opt_bool(meta: &Metadata, key: &str) -> Result<Option<bool>, MetadataError> {
    if meta.contains(key) {
        meta.get_bool(key).map(Some)
    } else {
        Ok(None)
    }
}

/// An optional per-token numeric array, checked to cover every token.
fn per_token<'a>(meta: &'a Metadata, key: &'static str, n: usize) -> Result<Option<&'a [Value]>, TokenizerError> {
    if !meta.contains(key) {
        return Ok(None);
    }
    let items = meta.get_array(key)?;
    // Longer is accepted, as llama.cpp does; shorter leaves tokens without a value.
    if items.len() < n {
        return Err(TokenizerError::LengthMismatch {
            key,
            len: items.len(),
            n_tokens: n,
        });
    }
    Ok(Some(items))
}

/// Ids by text, scores and attributes of every token, from `tokenizer.ggml.scores` and `.token_type`.
type Tables = (HashMap<String, u32>, Vec<f32>, Vec<u32>);

fn vocab_tables(meta: &Metadata, texts: &[String]) -> Result<Tables, TokenizerError> {
    let n = texts.len();
    let mut ids = HashMap::with_capacity(n);
    for (i, text) in texts.iter().enumerate() {
        if let Some(first) = ids.insert(text.clone(), i as u32) {
            return Err(TokenizerError::DuplicateToken {
                text: text.clone(),
                first,
                second: i as u32,
            });
        }
    }
    let mut scores = vec![0.0f32; n];
    if let Some(items) = per_token(meta, KEY_SCORES, n)? {
        for (i, v) in items.iter().take(n).enumerate() {
            scores[i] = v.as_f64().ok_or_else(|| TokenizerError::BadEntry {
                key: KEY_SCORES,
                index: i,
                value: v.to_string(),
                expected: "a number",
            })? as f32;
        }
    }
    let mut attrs = vec![ATTR_NORMAL; n];
    if let Some(items) = per_token(meta, KEY_TOKEN_TYPE, n)? {
        for (i, v) in items.iter().take(n).enumerate() {
            let ty = v.as_i64().ok_or_else(|| TokenizerError::BadEntry {
                key: KEY_TOKEN_TYPE,
                index: i,
                value: v.to_string(),
                expected: "an integer token type",
            })?;
            attrs[i] = match ty {
                1 => ATTR_NORMAL,
                2 => ATTR_UNKNOWN,
                3 => ATTR_CONTROL,
                4 => ATTR_USER_DEFINED,
                5 => ATTR_UNUSED,
                6 => ATTR_BYTE,
                _ => 0,
            };
        }
    }
    Ok((ids, scores, attrs))
}

impl Tokenizer {
    /// Builds the tokenizer of a GGUF from its metadata.
    ///
    /// Reads `tokenizer.ggml.model`, `.pre`, `.tokens`, `.scores`, `.token_type`, `.merges`, the special token ids
    /// (`.bos_token_id`, `.eos_token_id`, `.eot_token_id`, `.eom_token_id`, `.unknown_token_id`,
    /// `.padding_token_id`), `.add_bos_token`, `.add_eos_token` and `.add_space_prefix`, with llama.cpp's
    /// defaults for absent keys (SentencePiece: BOS 1, EOS 2, UNK 0, add BOS, add space prefix; BPE: BOS = EOS =
    /// 11, add BOS only for Llama-3-style pre-tokenizers). A special id out of range falls back to the default,
    /// as in llama.cpp. End-of-turn and end-of-generation tokens are also found by their text, as llama.cpp does.
    ///
    /// Errors: a missing or mistyped key, an unsupported model or pre-tokenizer (the message lists the
    /// supported ones), per-token arrays shorter than the vocabulary, a non-numeric score or type, a token text
    /// present twice, a merge that names an unknown token.
    pub fn from_metadata(meta: &Metadata) -> Result<Tokenizer, TokenizerError> {
        let model = meta.get_str(KEY_MODEL)?;
        let pre_row = match model {
            "gpt2" => {
                let name = if meta.contains(KEY_PRE) {
                    meta.get_str(KEY_PRE)?
                } else {
                    "default"
                };
                Some(pre::find(name).ok_or_else(|| TokenizerError::UnknownPre {
                    pre: name.to_string(),
                    supported: pre::supported_names(),
                })?)
            }
            "llama" => None,
            other => {
                return Err(TokenizerError::UnsupportedModel {
                    model: other.to_string(),
                });
            }
        };

        let raw_tokens = meta.get_str_array(KEY_TOKENS)?;
        let n = raw_tokens.len();
        // llama.cpp names empty tokens this way so that they stay unique and never match text.
        let texts: Vec<String> = raw_tokens
            .into_iter()
            .enumerate()
            .map(|(i, t)| {
                if t.is_empty() {
                    format!("[EMPTY_{i}]")
                } else {
                    t.to_string()
                }
            })
            .collect();
        let merges = match pre_row {
            Some(_) => meta.get_str_array(KEY_MERGES)?,
            None => Vec::new(),
        };

        // The BPE model (the slow part: hash maps over every token and merge) builds on a second thread while
        // this one builds the lookup tables.
        let (tables, encoder) = std::thread::scope(|scope| {
            let bpe = pre_row.map(|row| scope.spawn(|| BpeEncoder::new(&texts, &merges, row)));
            let tables = vocab_tables(meta, &texts);
            let encoder = match bpe {
                Some(handle) => handle
                    .join()
                    .unwrap_or_else(|_| {
                        Err(TokenizerError::Build {
                            key: KEY_MERGES,
                            reason: "the BPE builder panicked".into(),
                        })
                    })
                    .map(|b| Some(Encoder::Bpe(Box::new(b)))),
                None => Ok(None),
            };
            (tables, encoder)
        });
        let (ids, scores, attrs) = tables?;
        let encoder = encoder?.unwrap_or(Encoder::Spm);
        let kind = match pre_row {
            Some(row) => TokenizerKind::Bpe { pre: row.names[0] },
            None => TokenizerKind::Spm,
        };
        let mut vocab = Vocab {
            texts,
            ids,
            scores,
            attrs,
        };

        let is_spm = kind == TokenizerKind::Spm;

        let in_range = |id: u32| ((id as usize) < n).then_some(id);
        let special_id = |key: &str, default: Option<u32>| -> Result<Option<u32>, TokenizerError> {
            let default = default.and_then(in_range);
            if !meta.contains(key) {
                return Ok(default);
            }
            Ok(in_range(meta.get_u32(key)?).or(default))
        };
        let (bos_default, eos_default, unk_default) = if is_spm { (1, 2, Some(0)) } else { (11, 11, None) };
        let bos = special_id(KEY_BOS_ID, Some(bos_default))?;
        let eos = special_id(KEY_EOS_ID, Some(eos_default))?;
        let unk = special_id(KEY_UNK_ID, unk_default)?;
        let pad = special_id(KEY_PAD_ID, None)?;
        let mut eot = special_id(KEY_EOT_ID, None)?;
        let mut eom = special_id(KEY_EOM_ID, None)?;

        let add_bos = opt_bool(meta, KEY_ADD_BOS)?.unwrap_or(is_spm || pre_row.is_some_and(|r| r.add_bos));
        let add_eos = opt_bool(meta, KEY_ADD_EOS)?.unwrap_or(false);
        let add_space_prefix = is_spm && opt_bool(meta, KEY_ADD_SPACE_PREFIX)?.unwrap_or(true);

        // End-of-turn, end-of-message and end-of-generation tokens found by text are control tokens, whatever
        // their recorded type (llama.cpp overrides it the same way, which matters for `parse_special`).
        let mut overridden = Vec::new();
        if eot.is_none() {
            eot = EOT_TEXTS.iter().find_map(|t| vocab.id(t));
            overridden.extend(eot);
        }
        if eom.is_none() {
            eom = vocab.id("<|eom_id|>");
            overridden.extend(eom);
        }
        let mut eog: Vec<u32> = Vec::new();
        for group in FIM_EOG_TEXTS {
            eog.extend(group.iter().find_map(|t| vocab.id(t)));
        }
        eog.extend(EOG_TEXTS.iter().filter_map(|t| vocab.id(t)));
        overridden.extend(&eog);
        for id in overridden {
            vocab.attrs[id as usize] |= ATTR_CONTROL;
        }
        eog.extend(eos.iter().chain(&eot).chain(&eom));
        // OpenAI harmony vocabularies end a message with <|end|> but a generation with <|return|> or <|call|>.
        let has = |t: &str| vocab.id(t).is_some_and(|id| eog.contains(&id));
        if has("<|end|>") && ((has("<|return|>") && has("<|call|>")) || (has("<|calls|>") && has("<|flush|>"))) {
            let end = vocab.id("<|end|>").expect("checked above");
            eog.retain(|&id| id != end);
            vocab.attrs[end as usize] = ATTR_USER_DEFINED;
        }
        eog.sort_unstable();
        eog.dedup();

        let specials_before_strip: Vec<u32> = (0..n as u32).filter(|&id| vocab.is_partitioned(id)).collect();
        // Phi-3's special tokens swallow the whitespace after them (llama.cpp sets this by model name).
        let name = meta
            .get("general.name")
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_lowercase();
        if name.contains("phi-3") || name.contains("phi3") {
            for id in specials_before_strip {
                vocab.attrs[id as usize] |= ATTR_RSTRIP;
            }
            for (text, on) in [
                ("</s>", true),
                ("<unk>", false),
                ("<s>", false),
                ("<|endoftext|>", false),
            ] {
                if let Some(id) = vocab.id(text) {
                    let a = &mut vocab.attrs[id as usize];
                    *a = if on { *a | ATTR_RSTRIP } else { *a & !ATTR_RSTRIP };
                }
            }
        }

        let specials = SpecialTokens::new(&vocab);
        let pieces = (0..n)
            .map(|id| render_piece(&vocab, id, is_spm).into_boxed_slice())
            .collect();
        Ok(Tokenizer {
            vocab,
            encoder,
            kind,
            specials,
            pieces,
            bos,
            eos,
            eot,
            eom,
            unk,
            pad,
            eog,
            add_bos,
            add_eos,
            add_space_prefix,
        })
    }

    /// Encodes `text` (llama.cpp's `llama_tokenize`).
    ///
    /// `add_special` adds BOS and EOS where the model asks for them (`tokenizer.ggml.add_bos_token`,
    /// `add_eos_token`, or the defaults described in [`Tokenizer::from_metadata`]). `parse_special` lets control
    /// tokens written in the text (`<|im_start|>`) become their ids; without it they are tokenized as plain
    /// text. User-defined tokens are always recognized.
    ///
    /// Errors: BOS or EOS is wanted but the model has none ([`TokenizerError::MissingSpecial`]); a SentencePiece
    /// vocabulary lacks a byte token and an unknown token ([`TokenizerError::NoByteToken`]).
    pub fn encode(&self, text: &str, add_special: bool, parse_special: bool) -> Result<Vec<u32>, TokenizerError> {
        self.encode_fragments(text, add_special, parse_special, false)
    }

    /// `text` with every control token written in it made harmless for [`Tokenizer::encode_chat`]: a
    /// [`special::GUARD`] mark goes inside each occurrence, so it is tokenized as plain text. Apply it to every
    /// string a chat template prints that does not come from the template itself (message contents, tool
    /// definitions), so that a user cannot forge a turn by typing `<|im_end|>`.
    pub fn guard_specials<'t>(&self, text: &'t str) -> std::borrow::Cow<'t, str> {
        self.specials.guard(&self.vocab, text)
    }

    /// Encodes a rendered chat prompt: control tokens written by the template become their ids; those guarded by
    /// [`Tokenizer::guard_specials`] are plain text, and the guard marks are dropped. `add_special` as in
    /// [`Tokenizer::encode`].
    ///
    /// Errors: as [`Tokenizer::encode`].
    pub fn encode_chat(&self, text: &str, add_special: bool) -> Result<Vec<u32>, TokenizerError> {
        self.encode_fragments(text, add_special, true, true)
    }

    fn encode_fragments(
        &self,
        text: &str,
        add_special: bool,
        parse_special: bool,
        drop_guards: bool,
    ) -> Result<Vec<u32>, TokenizerError> {
        let fragments = self.specials.partition(&self.vocab, text, parse_special);
        let mut out = Vec::with_capacity(text.len() / 3 + 2);
        if add_special && self.add_bos {
            out.push(self.bos.ok_or(TokenizerError::MissingSpecial {
                what: "BOS",
                key: KEY_BOS_ID,
            })?);
        }
        let mut prev_special = true;
        let mut escaped = String::new();
        for fragment in fragments {
            match fragment {
                Fragment::Token(id) => {
                    out.push(id);
                    prev_special = true;
                }
                Fragment::Text(range) => {
                    let piece = &text[range];
                    let unguarded;
                    let piece = if drop_guards {
                        unguarded = special::unguard(piece);
                        unguarded.as_ref()
                    } else {
                        piece
                    };
                    match &self.encoder {
                        Encoder::Bpe(bpe) => bpe.encode(piece, &mut out)?,
                        Encoder::Spm => {
                            // SentencePiece sees spaces as U+2581, and a leading one at the start and after each
                            // special token when add_space_prefix is set.
                            escaped.clear();
                            if self.add_space_prefix && prev_special {
                                escaped.push('\u{2581}');
                            }
                            escaped.extend(piece.chars().map(|c| if c == ' ' { '\u{2581}' } else { c }));
                            spm::encode(&self.vocab, &escaped, self.unk, &mut out)?;
                        }
                    }
                    prev_special = false;
                }
            }
        }
        if add_special && self.add_eos {
            out.push(self.eos.ok_or(TokenizerError::MissingSpecial {
                what: "EOS",
                key: KEY_EOS_ID,
            })?);
        }
        Ok(out)
    }

    /// Decodes ids to text, control tokens included as their text; invalid UTF-8 (a character cut between
    /// tokens) becomes U+FFFD. For SentencePiece vocabularies with a space prefix, the one leading space the
    /// encoder added is removed, so `decode(encode(t, false, false)) == t` for any text `t` (llama.cpp's
    /// `llama_detokenize` without its `clean_spaces` pass, which is not lossless).
    ///
    /// Errors: an id out of range ([`TokenizerError::TokenOutOfRange`]).
    pub fn decode(&self, ids: &[u32]) -> Result<String, TokenizerError> {
        Ok(String::from_utf8_lossy(&self.decode_bytes(ids, false)?).into_owned())
    }

    /// Decodes ids to bytes, which need not be valid UTF-8 (streaming output cut mid-character).
    /// `skip_special` leaves out control and unknown tokens (llama.cpp's `special = false`).
    ///
    /// Errors: an id out of range ([`TokenizerError::TokenOutOfRange`]).
    pub fn decode_bytes(&self, ids: &[u32], skip_special: bool) -> Result<Vec<u8>, TokenizerError> {
        let mut out = Vec::with_capacity(ids.len() * 4);
        for (i, &id) in ids.iter().enumerate() {
            let mut piece = self.token_to_piece(id)?;
            if skip_special && self.vocab.attrs[id as usize] & (ATTR_CONTROL | ATTR_UNKNOWN) != 0 {
                continue;
            }
            if i == 0 && self.add_space_prefix && piece.first() == Some(&b' ') {
                piece = &piece[1..];
            }
            out.extend_from_slice(piece);
        }
        Ok(out)
    }

    /// The bytes a token stands for: byte-level BPE decoded, U+2581 as space, `<0xXX>` as its byte, special tokens
    /// as their text (llama.cpp's `llama_token_to_piece` with `special = true`). Unused and undefined tokens are
    /// empty.
    ///
    /// Errors: an id out of range.
    pub fn token_to_piece(&self, id: u32) -> Result<&[u8], TokenizerError> {
        self.pieces
            .get(id as usize)
            .map(|p| &p[..])
            .ok_or(TokenizerError::TokenOutOfRange {
                id,
                vocab_size: self.vocab_size(),
            })
    }

    /// The token's text as stored in `tokenizer.ggml.tokens` (byte-level or U+2581-escaped), if `id` is in range.
    pub fn token_text(&self, id: u32) -> Option<&str> {
        self.vocab.texts.get(id as usize).map(String::as_str)
    }

    /// The id of the token whose stored text is exactly `text` (`<|im_end|>`, `Ġhello`, `▁hello`).
    pub fn token_id(&self, text: &str) -> Option<u32> {
        self.vocab.id(text)
    }

    /// What kind of token `id` is, if in range.
    pub fn token_kind(&self, id: u32) -> Option<TokenKind> {
        let a = *self.vocab.attrs.get(id as usize)?;
        Some(if a & ATTR_UNKNOWN != 0 {
            TokenKind::Unknown
        } else if a & ATTR_CONTROL != 0 {
            TokenKind::Control
        } else if a & ATTR_USER_DEFINED != 0 {
            TokenKind::UserDefined
        } else if a & ATTR_BYTE != 0 {
            TokenKind::Byte
        } else if a & ATTR_UNUSED != 0 {
            TokenKind::Unused
        } else if a & ATTR_NORMAL != 0 {
            TokenKind::Normal
        } else {
            TokenKind::Undefined
        })
    }

    /// Number of tokens in the vocabulary.
    pub fn vocab_size(&self) -> usize {
        self.vocab.texts.len()
    }

    /// The algorithm (and for BPE the pre-tokenizer) in use.
    pub fn kind(&self) -> TokenizerKind {
        self.kind
    }

    /// Beginning-of-sequence token.
    pub fn bos(&self) -> Option<u32> {
        self.bos
    }

    /// End-of-sequence token.
    pub fn eos(&self) -> Option<u32> {
        self.eos
    }

    /// End-of-turn token (`<|im_end|>`, `<end_of_turn>`, `<|eot_id|>`...): `tokenizer.ggml.eot_token_id`, else
    /// found by text.
    pub fn eot(&self) -> Option<u32> {
        self.eot
    }

    /// End-of-message token (`<|eom_id|>`), if any.
    pub fn eom(&self) -> Option<u32> {
        self.eom
    }

    /// Unknown token, if any.
    pub fn unk(&self) -> Option<u32> {
        self.unk
    }

    /// Padding token, if any.
    pub fn pad(&self) -> Option<u32> {
        self.pad
    }

    /// Whether generation stops at `id`: EOS, EOT, EOM and the tokens llama.cpp treats as end-of-generation
    /// (`llama_vocab_is_eog`).
    pub fn is_eog(&self, id: u32) -> bool {
        self.eog.binary_search(&id).is_ok()
    }

    /// Every end-of-generation id, ascending.
    pub fn eog_ids(&self) -> &[u32] {
        &self.eog
    }

    /// Whether `encode` with `add_special` starts with BOS.
    pub fn add_bos(&self) -> bool {
        self.add_bos
    }

    /// Whether `encode` with `add_special` ends with EOS.
    pub fn add_eos(&self) -> bool {
        self.add_eos
    }
}

/// The bytes of token `id` (llama.cpp's `token_to_piece` with `special = true`, cached at load).
fn render_piece(vocab: &Vocab, id: usize, is_spm: bool) -> Vec<u8> {
    let (text, attr) = (&vocab.texts[id], vocab.attrs[id]);
    if attr & (ATTR_UNKNOWN | ATTR_CONTROL | ATTR_USER_DEFINED) != 0 {
        text.as_bytes().to_vec()
    } else if attr & ATTR_NORMAL != 0 {
        if is_spm {
            text.replace('\u{2581}', " ").into_bytes()
        } else {
            bpe::decode_byte_level(text)
        }
    } else if attr & ATTR_BYTE != 0 {
        let hex = text.strip_prefix("<0x").and_then(|h| h.strip_suffix('>'));
        match hex.and_then(|h| u8::from_str_radix(h, 16).ok()) {
            Some(b) => vec![b],
            None => text.as_bytes().to_vec(),
        }
    } else {
        Vec::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf::ValueType;

    fn strings(items: &[&str]) -> Value {
        Value::Array(
            ValueType::String,
            items.iter().map(|s| Value::String(s.to_string())).collect(),
        )
    }

    /// A tiny byte-level BPE vocabulary: every byte-level character of "hello world" plus two merges.
    fn bpe_metadata() -> Metadata {
        let mut m = Metadata::new();
        m.insert(KEY_MODEL, Value::String("gpt2".into()));
        m.insert(KEY_PRE, Value::String("gpt-2".into()));
        m.insert(
            KEY_TOKENS,
            strings(&["h", "e", "l", "o", "Ġ", "w", "r", "d", "he", "hel", "<|end|>"]),
        );
        m.insert(KEY_MERGES, strings(&["h e", "he l"]));
        m.insert(
            KEY_TOKEN_TYPE,
            Value::Array(
                ValueType::I32,
                [1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 3].map(Value::I32).to_vec(),
            ),
        );
        m
    }

    #[test]
    fn tiny_bpe_encodes_and_decodes() {
        let tok = Tokenizer::from_metadata(&bpe_metadata()).unwrap();
        let ids = tok.encode("hello world", false, false).unwrap();
        assert_eq!(ids, [9, 2, 3, 4, 5, 3, 6, 2, 7]);
        assert_eq!(tok.decode(&ids).unwrap(), "hello world");
        assert_eq!(tok.encode("hel<|end|>", false, true).unwrap(), [9, 10]);
        assert!(tok.is_eog(10));
        let err = tok.decode(&[11]).unwrap_err();
        assert!(
            matches!(err, TokenizerError::TokenOutOfRange { id: 11, vocab_size: 11 }),
            "{err}"
        );
    }

    fn error_of(m: &Metadata) -> String {
        Tokenizer::from_metadata(m).unwrap_err().to_string()
    }

    #[test]
    fn errors_name_the_key_and_the_problem() {
        let mut m = bpe_metadata();
        m.insert(KEY_PRE, Value::String("klingon".into()));
        let e = error_of(&m);
        assert!(
            e.contains(KEY_PRE) && e.contains("klingon") && e.contains("llama-bpe") && e.contains("qwen2"),
            "{e}"
        );

        let mut m = bpe_metadata();
        m.insert(KEY_MERGES, strings(&["h e", "he x"]));
        let e = error_of(&m);
        assert!(e.contains("tokenizer.ggml.merges[1]") && e.contains("`x`"), "{e}");

        let mut m = bpe_metadata();
        m.insert(KEY_MERGES, strings(&["l o"]));
        let e = error_of(&m);
        assert!(e.contains("merged token `lo`"), "{e}");

        let mut m = bpe_metadata();
        m.insert(KEY_MERGES, strings(&["he"]));
        assert!(error_of(&m).contains("no space"));

        let mut m = bpe_metadata();
        m.insert(KEY_TOKEN_TYPE, Value::Array(ValueType::I32, vec![Value::I32(1); 3]));
        let e = error_of(&m);
        assert!(
            e.contains(KEY_TOKEN_TYPE) && e.contains("3 entries") && e.contains("11"),
            "{e}"
        );

        let mut m = bpe_metadata();
        m.insert(KEY_TOKENS, strings(&["h", "e", "h"]));
        assert!(error_of(&m).contains("twice"));

        let mut m = bpe_metadata();
        m.insert(KEY_MODEL, Value::String("rwkv".into()));
        assert!(error_of(&m).contains("rwkv"));

        let mut m = Metadata::new();
        m.insert(KEY_MODEL, Value::String("llama".into()));
        assert!(error_of(&m).contains(KEY_TOKENS));
    }

    #[test]
    fn spm_merges_by_score_with_byte_fallback() {
        let mut m = Metadata::new();
        m.insert(KEY_MODEL, Value::String("llama".into()));
        let mut tokens = vec!["<unk>", "<s>", "</s>", "▁", "a", "b", "▁a", "ab", "▁ab"];
        let hex: Vec<String> = (0..=255u8).map(|b| format!("<0x{b:02X}>")).collect();
        tokens.extend(hex.iter().map(String::as_str));
        m.insert(KEY_TOKENS, strings(&tokens));
        let mut scores = vec![0.0, 0.0, 0.0, -1.0, -1.0, -1.0, -3.0, -2.0, -4.0];
        scores.resize(tokens.len(), 0.0);
        m.insert(
            KEY_SCORES,
            Value::Array(ValueType::F32, scores.into_iter().map(Value::F32).collect()),
        );
        let mut types = vec![2, 3, 3, 1, 1, 1, 1, 1, 1];
        types.resize(tokens.len(), 6);
        m.insert(
            KEY_TOKEN_TYPE,
            Value::Array(ValueType::I32, types.into_iter().map(Value::I32).collect()),
        );
        let tok = Tokenizer::from_metadata(&m).unwrap();
        // "▁ab": "ab" (score -2) merges before "▁a" (-3), then "▁" + "ab" = "▁ab".
        assert_eq!(tok.encode("ab", true, false).unwrap(), [1, 8]);
        // "é" is not a token: its two UTF-8 bytes become <0xC3> <0xA9>.
        let ids = tok.encode("é", false, false).unwrap();
        assert_eq!(ids, [3, 9 + 0xC3, 9 + 0xA9]);
        assert_eq!(tok.decode(&ids).unwrap(), "é");
        assert_eq!(tok.decode(&[1, 8]).unwrap(), "<s> ab");
    }
}
