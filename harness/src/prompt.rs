//! Exact-token prompts: text that the model's tokenizer encodes to exactly N tokens, starting with a token unique
//! to the request, so the server's prefix reuse cannot keep any cell of an earlier prompt and every token is
//! computed (seed 000: "independent prompts with different prefixes").
//!
//! The text is built with the engine's own tokenizer read from the model file (the same code the server runs);
//! the server's own count (`usage.prompt_tokens`) is recorded for each request and checked against N.

use std::path::Path;

use anyhow::{Context, Result, bail};
use strata_engine::gguf::GgufFile;
use strata_engine::tokenizer::Tokenizer;

/// Filler words; each is one token in common BPE vocabularies, but nothing relies on it: counts are checked.
const FILLER: &[&str] = &[
    " the", " river", " runs", " past", " old", " stone", " walls", " and", " green", " fields", " under", " a",
    " quiet", " sky", " while", " birds", " sing", " in", " tall", " trees",
];

/// Prefixes between the first prompts of consecutive cases ([`PromptBuilder::start_case`]): a prime, so cases
/// spread over the whole list; a case with more requests than this reuses words of the next case's, which only
/// matters for two consecutive requests (checked there).
const CASE_STRIDE: usize = 37;

/// Builds exact-token prompts for one model.
pub struct PromptBuilder {
    tokenizer: Tokenizer,
    /// Single-token words usable as unique first tokens, in vocabulary order.
    prefixes: Vec<String>,
    next_prefix: usize,
    /// The prefix of the last prompt built (an index into `prefixes`).
    last_prefix: Option<usize>,
    /// The vocabulary has no merges (every byte is a token, as in the generator's synthetic models): prefixes
    /// are single characters and the filler is cut to the exact number of characters.
    byte_level: bool,
}

impl PromptBuilder {
    /// Starts the prefixes again from the first, so that every matrix combination is sent the same prompts
    /// (each against its own server, so no cell of one combination's prompts is reused by another's).
    pub fn restart(&mut self) {
        self.next_prefix = 0;
        self.last_prefix = None;
    }

    /// Starts case number `case` (its position in the scenario): its prompts' prefixes go on from one chosen by
    /// that position alone, so a case is sent the same prompts in every combination whatever ran before it (a
    /// case that `only:` left out elsewhere, a boundary search's varying probes), and the `same_*_as` checks
    /// compare answers to the same prompts. The first prefix still differs from the last prompt's (then it is
    /// the next one).
    pub fn start_case(&mut self, case: usize) {
        let len = self.prefixes.len();
        let mut next = case.wrapping_mul(CASE_STRIDE) % len;
        if self.last_prefix == Some(next) {
            next = (next + 1) % len;
        }
        self.next_prefix = next;
    }

    /// Reads the tokenizer of the model at `path`.
    ///
    /// Errors: the file is not a GGUF model with a tokenizer; the vocabulary has too few plain words.
    pub fn open(path: &Path) -> Result<PromptBuilder> {
        let gguf = GgufFile::open(path).with_context(|| format!("cannot read {}", path.display()))?;
        let tokenizer = Tokenizer::from_metadata(gguf.metadata())
            .with_context(|| format!("{}: cannot build its tokenizer", path.display()))?;
        let bos = usize::from(tokenizer.add_bos());
        let mut prefixes = Vec::new();
        for id in 0..tokenizer.vocab_size() as u32 {
            let Ok(piece) = tokenizer.decode(&[id]) else { continue };
            let word = piece.trim();
            // A capitalised plain word of 4+ letters, one token on its own at the start of a prompt.
            if word.len() < 4
                || !word.starts_with(|c: char| c.is_ascii_uppercase())
                || !word.chars().all(|c| c.is_ascii_alphabetic())
            {
                continue;
            }
            let text = word.to_string();
            if tokenizer
                .encode(&text, true, false)
                .is_ok_and(|ids| ids.len() == 1 + bos)
            {
                prefixes.push(text);
            }
        }
        let mut byte_level = false;
        if prefixes.len() < 64 {
            // A vocabulary without merges: one token per byte. Any printable ASCII character is then a
            // single-token prefix, and text of n ASCII characters is n tokens.
            let single = |t: &str| {
                tokenizer
                    .encode(t, true, false)
                    .is_ok_and(|ids| ids.len() == t.len() + bos)
            };
            if single("ab the") {
                let chars: Vec<String> = (b'!'..=b'~').map(|c| (c as char).to_string()).collect();
                if chars.iter().all(|c| single(c)) {
                    prefixes = chars;
                    byte_level = true;
                }
            }
        }
        if prefixes.len() < 64 {
            bail!(
                "{}: the vocabulary has only {} plain single-token words to use as unique prompt prefixes",
                path.display(),
                prefixes.len()
            );
        }
        Ok(PromptBuilder {
            tokenizer,
            prefixes,
            next_prefix: 0,
            last_prefix: None,
            byte_level,
        })
    }

    /// The tokenizer in use.
    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    /// Token count of `text` as a completion prompt (BOS included where the model adds one).
    ///
    /// Errors: the tokenizer refused the text.
    pub fn count(&self, text: &str) -> Result<usize> {
        Ok(self.tokenizer.encode(text, true, false)?.len())
    }

    /// A prompt of exactly `n` tokens whose first word differs from every earlier prompt of this builder.
    ///
    /// Errors: `n` is smaller than the prefix (BOS + one word), or no filler reaches exactly `n`.
    pub fn exact(&mut self, n: usize) -> Result<String> {
        let at = self.next_prefix % self.prefixes.len();
        let prefix = self.prefixes[at].clone();
        self.next_prefix = at + 1;
        self.last_prefix = Some(at);
        let base = self.count(&prefix)?;
        if n < base {
            bail!("cannot build a {n}-token prompt: the unique prefix alone is {base} tokens");
        }
        if self.byte_level {
            let filler: String = FILLER.iter().cycle().flat_map(|w| w.chars()).take(n - base).collect();
            let text = format!("{prefix}{filler}");
            let have = self.count(&text)?;
            if have != n {
                bail!("cannot build a prompt of exactly {n} tokens (a byte-level vocabulary gave {have})");
            }
            return Ok(text);
        }
        // Filler words encode independently (the pre-tokenizer splits at spaces), so one round usually lands on
        // `n`; the count is checked each round, and words are added or dropped until it is exact.
        let mut words: Vec<&str> = Vec::new();
        let mut have = base;
        for _ in 0..64 {
            let text = format!("{prefix}{}", words.concat());
            have = self.count(&text)?;
            if have == n {
                return Ok(text);
            }
            if have < n {
                for _ in 0..n - have {
                    words.push(FILLER[words.len() % FILLER.len()]);
                }
            } else {
                let drop = (have - n).max(1).min(words.len());
                words.truncate(words.len() - drop);
            }
        }
        bail!("cannot build a prompt of exactly {n} tokens (reached {have})")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_level_vocabularies_get_exact_prompts_with_unique_first_tokens() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tiny.gguf");
        strata_engine::fixtures::synth::SynthSpec::tiny_qwen3moe()
            .write(&path)
            .unwrap();
        let mut b = PromptBuilder::open(&path).unwrap();
        let mut firsts = std::collections::HashSet::new();
        for n in [1usize, 2, 16, 37, 300] {
            let text = b.exact(n).unwrap();
            let ids = b.tokenizer().encode(&text, true, false).unwrap();
            assert_eq!(ids.len(), n, "{text:?}");
            assert!(firsts.insert(ids[0]), "first token repeated: {text:?}");
        }
        // A case's prompts depend on its position, not on what ran before it; consecutive first words differ.
        b.restart();
        b.start_case(2);
        let third = b.exact(20).unwrap();
        b.restart();
        b.start_case(0);
        b.exact(20).unwrap();
        b.exact(20).unwrap();
        b.start_case(2);
        assert_eq!(b.exact(20).unwrap(), third);
        b.restart();
        b.start_case(1);
        let last = b.exact(5).unwrap();
        for _ in 0..CASE_STRIDE - 1 {
            b.exact(5).unwrap();
        }
        let before = b.exact(5).unwrap();
        b.start_case(2);
        let after = b.exact(5).unwrap();
        assert_ne!(before[..1], after[..1], "{before:?} then {after:?} ({last:?})");
    }
}
