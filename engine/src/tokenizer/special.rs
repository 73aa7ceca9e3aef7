//! Splitting text around special tokens before the tokenizer proper runs: llama.cpp's
//! `tokenizer_st_partition`.
//!
//! Control, user-defined and unknown tokens are matched as literal text, longest token first over the whole text
//! (so a longer token wins over a shorter one it overlaps). Control and unknown tokens are matched only when the
//! caller asks to parse specials; user-defined tokens always are (the `tokenizers` crate's added tokens behave the
//! same). A token with the lstrip (rstrip) attribute swallows ASCII whitespace to its left (right).
//!
//! Cost: one pass over the text with a byte trie of the special tokens finds which of them occur; only those are
//! then split on, so a vocabulary with thousands of control tokens (gemma 3 has 6,249) costs O(text) per call plus
//! O(text) per special token actually present.

use std::borrow::Cow;
use std::ops::Range;

use super::{ATTR_CONTROL, ATTR_LSTRIP, ATTR_RSTRIP, ATTR_UNKNOWN, Vocab};

/// The mark [`SpecialTokens::guard`] writes inside control-token texts that come from outside the template (a
/// message's content): U+FDD0, a Unicode noncharacter, reserved for a program's internal use and in no
/// vocabulary. [`super::Tokenizer::encode_chat`] drops it before tokenizing the text around it ([`unguard`]).
pub const GUARD: char = '\u{FDD0}';

/// Text written by [`SpecialTokens::guard`] back as it was: a [`GUARD`] alone (a mark) is dropped, a doubled one
/// (one the text held) is one. A mark always sits between two other characters (after the first character of a
/// control token's text, before its second), so the two never run together.
pub fn unguard(text: &str) -> Cow<'_, str> {
    if !text.contains(GUARD) {
        return Cow::Borrowed(text);
    }
    let mut out = String::with_capacity(text.len());
    let mut run = 0usize;
    for c in text.chars() {
        if c == GUARD {
            run += 1;
            continue;
        }
        out.extend(std::iter::repeat_n(GUARD, run / 2));
        run = 0;
        out.push(c);
    }
    out.extend(std::iter::repeat_n(GUARD, run / 2));
    Cow::Owned(out)
}

/// A piece of the input: text still to tokenize, or a special token already recognized.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Fragment {
    Text(Range<usize>),
    Token(u32),
}

#[derive(Default)]
struct Node {
    /// (byte, child node index), sorted by byte.
    children: Vec<(u8, u32)>,
    /// Rank (index in `SpecialTokens::order`) of the token ending here.
    rank: Option<u32>,
}

/// The special tokens of a vocabulary in matching order, with a trie to find which occur in a text.
pub(crate) struct SpecialTokens {
    /// Token ids, longest text first (ties: lower id first).
    order: Vec<u32>,
    trie: Vec<Node>,
}

impl SpecialTokens {
    /// Collects the tokens whose attributes include control, user-defined or unknown.
    pub(crate) fn new(vocab: &Vocab) -> SpecialTokens {
        let mut order: Vec<u32> = (0..vocab.texts.len() as u32)
            .filter(|&id| vocab.is_partitioned(id))
            .collect();
        order.sort_by(|&a, &b| {
            vocab.texts[b as usize]
                .len()
                .cmp(&vocab.texts[a as usize].len())
                .then(a.cmp(&b))
        });
        let mut trie = vec![Node::default()];
        for (rank, &id) in order.iter().enumerate() {
            let mut node = 0usize;
            for &byte in vocab.texts[id as usize].as_bytes() {
                node = match trie[node].children.binary_search_by_key(&byte, |&(b, _)| b) {
                    Ok(i) => trie[node].children[i].1 as usize,
                    Err(i) => {
                        let child = trie.len();
                        trie.push(Node::default());
                        trie[node].children.insert(i, (byte, child as u32));
                        child
                    }
                };
            }
            trie[node].rank.get_or_insert(rank as u32);
        }
        SpecialTokens { order, trie }
    }

    /// Ranks of the special tokens that occur somewhere in `text`, ascending (that is, in matching order).
    fn present(&self, text: &[u8]) -> Vec<u32> {
        let mut found = Vec::new();
        if self.order.is_empty() {
            return found;
        }
        for start in 0..text.len() {
            let mut node = 0usize;
            for &byte in &text[start..] {
                match self.trie[node].children.binary_search_by_key(&byte, |&(b, _)| b) {
                    Ok(i) => node = self.trie[node].children[i].1 as usize,
                    Err(_) => break,
                }
                if let Some(rank) = self.trie[node].rank {
                    found.push(rank);
                }
            }
        }
        found.sort_unstable();
        found.dedup();
        found
    }

    /// `text` with [`GUARD`] written after the first character of every occurrence of a control or unknown
    /// token's text, so that no control token can be read from it even with `parse_special`; [`GUARD`]
    /// characters already in `text` are doubled, so [`unguard`] gives them back. Borrowed when there is nothing
    /// to change.
    ///
    /// Every occurrence is broken: one that starts at byte `s` gets a mark after its first character, and the
    /// mark is in no token's text.
    pub(crate) fn guard<'t>(&self, vocab: &Vocab, text: &'t str) -> Cow<'t, str> {
        let clean: Cow<'t, str> = if text.contains(GUARD) {
            Cow::Owned(text.replace(GUARD, "\u{FDD0}\u{FDD0}"))
        } else {
            Cow::Borrowed(text)
        };
        let guarded = |rank: u32| {
            let id = self.order[rank as usize];
            vocab.attrs[id as usize] & (ATTR_CONTROL | ATTR_UNKNOWN) != 0
        };
        if !self.present(clean.as_bytes()).into_iter().any(guarded) {
            return clean;
        }
        let bytes = clean.as_bytes();
        let mut out = String::with_capacity(clean.len() + 16);
        let mut copied = 0;
        let mut start = 0;
        while start < bytes.len() {
            let mut node = 0usize;
            let mut hit = false;
            for &byte in &bytes[start..] {
                match self.trie[node].children.binary_search_by_key(&byte, |&(b, _)| b) {
                    Ok(i) => node = self.trie[node].children[i].1 as usize,
                    Err(_) => break,
                }
                if self.trie[node].rank.is_some_and(guarded) {
                    hit = true;
                    break;
                }
            }
            let first = clean[start..].chars().next().map_or(1, char::len_utf8);
            if hit {
                out.push_str(&clean[copied..start + first]);
                out.push(GUARD);
                copied = start + first;
            }
            start += first;
        }
        out.push_str(&clean[copied..]);
        Cow::Owned(out)
    }

    /// Splits `text` into fragments around the special tokens it contains.
    pub(crate) fn partition(&self, vocab: &Vocab, text: &str, parse_special: bool) -> Vec<Fragment> {
        if text.is_empty() {
            return Vec::new();
        }
        let bytes = text.as_bytes();
        let mut fragments = vec![Fragment::Text(0..text.len())];
        for rank in self.present(bytes) {
            let id = self.order[rank as usize];
            let attr = vocab.attrs[id as usize];
            if !parse_special && attr & (ATTR_CONTROL | ATTR_UNKNOWN) != 0 {
                continue;
            }
            let needle = vocab.texts[id as usize].as_bytes();
            let mut next = Vec::with_capacity(fragments.len() + 2);
            for fragment in fragments {
                let Fragment::Text(mut rest) = fragment else {
                    next.push(fragment);
                    continue;
                };
                while let Some(at) = find(&bytes[rest.clone()], needle).map(|i| rest.start + i) {
                    let mut left = rest.start..at;
                    if attr & ATTR_LSTRIP != 0 {
                        while left.end > left.start && bytes[left.end - 1].is_ascii_whitespace_c() {
                            left.end -= 1;
                        }
                    }
                    if !left.is_empty() {
                        next.push(Fragment::Text(left));
                    }
                    next.push(Fragment::Token(id));
                    rest.start = at + needle.len();
                    if attr & ATTR_RSTRIP != 0 {
                        while rest.start < rest.end && bytes[rest.start].is_ascii_whitespace_c() {
                            rest.start += 1;
                        }
                    }
                }
                if !rest.is_empty() {
                    next.push(Fragment::Text(rest));
                }
            }
            fragments = next;
        }
        fragments
    }
}

/// C's `isspace` in the "C" locale: space, \t, \n, \v, \f, \r (Rust's `is_ascii_whitespace` omits \v).
trait CSpace {
    fn is_ascii_whitespace_c(&self) -> bool;
}

impl CSpace for u8 {
    fn is_ascii_whitespace_c(&self) -> bool {
        matches!(self, b' ' | b'\t' | b'\n' | 0x0B | 0x0C | b'\r')
    }
}

/// Byte offset of the first occurrence of `needle` (non-empty) in `haystack`.
fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    if needle.len() > haystack.len() {
        return None;
    }
    let first = needle[0];
    let last_start = haystack.len() - needle.len();
    let mut i = 0;
    while i <= last_start {
        let off = haystack[i..=last_start].iter().position(|&b| b == first)?;
        i += off;
        if &haystack[i..i + needle.len()] == needle {
            return Some(i);
        }
        i += 1;
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn find_matches_std() {
        let hay = b"abcabcabd";
        assert_eq!(find(hay, b"abd"), Some(6));
        assert_eq!(find(hay, b"c"), Some(2));
        assert_eq!(find(hay, b"x"), None);
        assert_eq!(find(b"ab", b"abc"), None);
    }
}
