//! SentencePiece-style BPE with scores (`tokenizer.ggml.model` = `llama`), the way llama.cpp's
//! `llm_tokenizer_spm_session` does it.
//!
//! The text (spaces already escaped to U+2581) starts as one symbol per UTF-8 character. Every adjacent pair whose
//! concatenation is a vocabulary token is a candidate; the candidate whose token has the highest score merges first
//! (ties: the leftmost), and the new neighbours become candidates. A final symbol that is a token is emitted; one
//! that is not (always a single character) becomes its bytes' `<0xXX>` tokens. The `tokenizers` crate's Unigram
//! model would choose by Viterbi over the whole string instead, which gives different ids, so this is our own.
//!
//! Cost: O(n log n) in the number of characters (a binary heap of candidates; stale ones are skipped when popped).

use std::cmp::Ordering;
use std::collections::BinaryHeap;

use super::{TokenizerError, Vocab};

#[derive(Clone, Copy)]
struct Symbol {
    /// Byte offset of the symbol in the text.
    start: usize,
    /// Length in bytes; 0 once merged into its left neighbour.
    len: usize,
    prev: Option<usize>,
    next: Option<usize>,
}

/// A merge candidate: symbols `left` and `left`'s next, whose concatenation (of `len` bytes) has score `score`.
struct Candidate {
    score: f32,
    left: usize,
    right: usize,
    len: usize,
}

impl Ord for Candidate {
    /// Highest score first; among equal scores the leftmost (llama.cpp's `llm_bigram_spm::comparator`).
    fn cmp(&self, other: &Self) -> Ordering {
        self.score
            .total_cmp(&other.score)
            .then_with(|| other.left.cmp(&self.left))
    }
}

impl PartialOrd for Candidate {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl PartialEq for Candidate {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}

impl Eq for Candidate {}

/// Appends the ids of `text` (spaces already escaped) to `out`.
///
/// Errors: a character that is not a token and one of whose bytes has neither a `<0xXX>` token nor a one-byte
/// token, and there is no `unk` to stand in ([`TokenizerError::NoByteToken`]; llama.cpp aborts there). A
/// SentencePiece vocabulary with byte fallback never lacks them.
pub(crate) fn encode(vocab: &Vocab, text: &str, unk: Option<u32>, out: &mut Vec<u32>) -> Result<(), TokenizerError> {
    if text.is_empty() {
        return Ok(());
    }
    let mut symbols: Vec<Symbol> = Vec::with_capacity(text.len());
    for (start, c) in text.char_indices() {
        let index = symbols.len();
        let len = c.len_utf8();
        let next = (start + len < text.len()).then_some(index + 1);
        symbols.push(Symbol {
            start,
            len,
            prev: index.checked_sub(1),
            next,
        });
    }

    let mut queue = BinaryHeap::with_capacity(symbols.len());
    let candidate = |symbols: &[Symbol], left: usize, right: usize| -> Option<Candidate> {
        let (l, r) = (symbols[left], symbols[right]);
        let len = l.len + r.len;
        let id = vocab.id(&text[l.start..l.start + len])?;
        Some(Candidate {
            score: vocab.scores[id as usize],
            left,
            right,
            len,
        })
    };
    for i in 1..symbols.len() {
        queue.extend(candidate(&symbols, i - 1, i));
    }

    while let Some(c) = queue.pop() {
        let (l, r) = (symbols[c.left], symbols[c.right]);
        // Stale: one side was merged away, or grew since this candidate was made.
        if l.len == 0 || r.len == 0 || l.len + r.len != c.len {
            continue;
        }
        symbols[c.left].len = c.len;
        symbols[c.left].next = r.next;
        symbols[c.right].len = 0;
        if let Some(n) = r.next {
            symbols[n].prev = Some(c.left);
        }
        if let Some(p) = l.prev {
            queue.extend(candidate(&symbols, p, c.left));
        }
        if let Some(n) = r.next {
            queue.extend(candidate(&symbols, c.left, n));
        }
    }

    let mut i = Some(0);
    while let Some(index) = i {
        let s = symbols[index];
        let piece = &text[s.start..s.start + s.len];
        match vocab.id(piece) {
            Some(id) => out.push(id),
            None => {
                for &b in piece.as_bytes() {
                    out.push(
                        vocab
                            .byte_token(b)
                            .or(unk)
                            .ok_or(TokenizerError::NoByteToken { byte: b })?,
                    );
                }
            }
        }
        i = s.next;
    }
    Ok(())
}
