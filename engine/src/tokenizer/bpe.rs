//! Byte-level BPE (`tokenizer.ggml.model` = `gpt2`): llama.cpp's `llm_tokenizer_bpe`, built on the `tokenizers`
//! crate's BPE model and Split/ByteLevel pre-tokenizers.

use std::sync::OnceLock;

use tokenizers::SplitDelimiterBehavior;
use tokenizers::models::bpe::{BPE, Vocab};
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};

use super::pre::PreTokenizer;
use super::{KEY_MERGES, KEY_PRE, TokenizerError};

/// GPT-2's byte-to-character table (`bytes_to_unicode` in GPT-2's encoder.py): printable Latin-1 bytes stand for
/// themselves, the other 68 bytes map to U+0100.. in byte order, so every byte has a visible character.
fn byte_chars() -> &'static [char; 256] {
    static TABLE: OnceLock<[char; 256]> = OnceLock::new();
    TABLE.get_or_init(|| {
        let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
        let mut table = ['\0'; 256];
        let mut next_extra = 0x100u32;
        for b in 0..=255u8 {
            table[b as usize] = if printable(b) {
                char::from(b)
            } else {
                let c = char::from_u32(next_extra).expect("U+0100..U+0143 are chars");
                next_extra += 1;
                c
            };
        }
        table
    })
}

/// The byte a byte-level character stands for, or `None` for a character outside the table.
fn char_byte(c: char) -> Option<u8> {
    static REVERSE: OnceLock<Vec<i16>> = OnceLock::new();
    let reverse = REVERSE.get_or_init(|| {
        let mut r = vec![-1i16; 0x144];
        for (b, &c) in byte_chars().iter().enumerate() {
            r[c as usize] = b as i16;
        }
        r
    });
    reverse.get(c as usize).copied().filter(|&b| b >= 0).map(|b| b as u8)
}

/// The bytes a byte-level token text stands for (llama.cpp's `llama_decode_text`). A character outside the table,
/// which a well-formed vocabulary never has, is kept as its UTF-8.
pub(crate) fn decode_byte_level(text: &str) -> Vec<u8> {
    let mut out = Vec::with_capacity(text.len());
    for c in text.chars() {
        match char_byte(c) {
            Some(b) => out.push(b),
            None => out.extend_from_slice(c.encode_utf8(&mut [0; 4]).as_bytes()),
        }
    }
    out
}

/// The two parts of a merge, "left right". The separator is the first space after the first byte: a left part
/// may itself be a space (llama.cpp looks for ' ' from offset 1 the same way).
fn split_merge(merge: &str) -> Option<(&str, &str)> {
    let split = merge.char_indices().skip(1).find(|&(_, c)| c == ' ').map(|(i, _)| i)?;
    Some((&merge[..split], &merge[split + 1..]))
}

/// A byte-level BPE encoder for one vocabulary: pre-tokenizer regexes, byte-level mapping and ranked merges.
pub(crate) struct BpeEncoder {
    inner: tokenizers::Tokenizer,
}

impl BpeEncoder {
    /// Builds the encoder from the vocabulary (`tokenizer.ggml.tokens`, index = id) and
    /// `tokenizer.ggml.merges` ("left right" strings, rank = index).
    ///
    /// Errors: a merge without a space separator, or naming a token (or producing a merged token) that is not in
    /// the vocabulary; a regex Oniguruma rejects.
    pub(crate) fn new(
        texts: &[String],
        merges: &[&str],
        pre: &'static PreTokenizer,
    ) -> Result<BpeEncoder, TokenizerError> {
        let vocab: Vocab = texts.iter().enumerate().map(|(i, t)| (t.clone(), i as u32)).collect();
        let mut pairs = Vec::with_capacity(merges.len());
        let mut joined = String::new();
        for (index, merge) in merges.iter().enumerate() {
            let bad = |reason: String| TokenizerError::BadMerge {
                index,
                merge: merge.to_string(),
                reason,
            };
            let (left, right) = split_merge(merge).ok_or_else(|| bad("no space separates the two parts".into()))?;
            // Checked here, not left to the builder: it panics on a merged token longer than every token.
            joined.clear();
            joined.push_str(left);
            joined.push_str(right);
            for (part, what) in [(left, ""), (right, ""), (joined.as_str(), "the merged token ")] {
                if !vocab.contains_key(part) {
                    return Err(bad(format!("{what}`{part}` is not in {}", super::KEY_TOKENS)));
                }
            }
            pairs.push((left.to_string(), right.to_string()));
        }
        let model = BPE::builder()
            .vocab_and_merges(vocab, pairs)
            .ignore_merges(pre.ignore_merges)
            .build()
            .map_err(|e| TokenizerError::Build {
                key: KEY_MERGES,
                reason: e.to_string(),
            })?;

        let mut steps = Vec::with_capacity(pre.regexes.len() + 1);
        for regex in pre.regexes {
            let split = Split::new(
                SplitPattern::Regex(regex.to_string()),
                SplitDelimiterBehavior::Isolated,
                false,
            )
            .map_err(|e| TokenizerError::Build {
                key: KEY_PRE,
                reason: format!("pre-tokenizer `{}`: regex {regex:?}: {e}", pre.names[0]),
            })?;
            steps.push(PreTokenizerWrapper::Split(split));
        }
        steps.push(PreTokenizerWrapper::ByteLevel(ByteLevel::new(false, false, false)));
        let mut inner = tokenizers::Tokenizer::new(model);
        inner.with_pre_tokenizer(Some(PreTokenizerWrapper::Sequence(Sequence::new(steps))));
        Ok(BpeEncoder { inner })
    }

    /// Appends the ids of `text` (no special-token handling) to `out`.
    pub(crate) fn encode(&self, text: &str, out: &mut Vec<u32>) -> Result<(), TokenizerError> {
        if text.is_empty() {
            return Ok(());
        }
        let encoding = self
            .inner
            .encode_fast(text, false)
            .map_err(|e| TokenizerError::Encode(e.to_string()))?;
        out.extend_from_slice(encoding.get_ids());
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_table_matches_gpt2() {
        let t = byte_chars();
        assert_eq!(t[b' ' as usize], 'Ġ');
        assert_eq!(t[b'\n' as usize], 'Ċ');
        assert_eq!(t[b'a' as usize], 'a');
        assert_eq!(t[0xAD], '\u{143}');
        for b in 0..=255u8 {
            assert_eq!(char_byte(t[b as usize]), Some(b));
        }
        assert_eq!(decode_byte_level("ĠhelloĊ"), b" hello\n");
    }
}
