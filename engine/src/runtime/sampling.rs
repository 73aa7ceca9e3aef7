//! Token sampling: one decode step's logits in, the next token id out, following llama.cpp's default sampler
//! chain; and [`StopMatcher`], which finds stop strings in streamed text without printing half of one.
//!
//! | entry | what | errors |
//! |---|---|---|
//! | [`SamplingParams`] | temperature, top-k, top-p, min-p, penalties, seed, logit bias; `llama-cli` defaults | bad value |
//! | [`Sampler::new`] | a sampler for one generation, scratch sized to the vocabulary | bad parameter |
//! | [`Sampler::sample`] | logits + token history to a token id (never fails; fallbacks documented) | none |
//! | [`Sampler::try_sample`] | the same, reporting a wrong logits length or no usable logit | [`SamplingError`] |
//! | [`Sampler::try_sample_top`] | the same from a step's [`TopLogits`] (the GPU's selection), when [`Sampler::can_use_top`] | as above |
//! | [`StopMatcher`] | stop strings over decoded pieces: text safe to print now, and whether a stop matched | none |
//!
//! Source: llama.cpp `src/llama-sampling.cpp` (samplers `penalties`, `top-k`, `top-p`, `min-p`, `temp`, `dist`)
//! and the default chain in `common/common.h` (`common_params_sampling::samplers`: penalties, DRY, top-n-σ,
//! top-k, typical-p, top-p, min-p, XTC, temperature, then `dist`). Strata implements the samplers of that chain
//! that are on by default or asked for by users, in the same order; DRY, top-n-σ, typical-p and XTC are off in
//! llama.cpp's defaults and absent here. The random draws are not bit-compatible with llama.cpp (it uses
//! `std::mt19937`, we use xoshiro256\*\*), so only greedy output can match it token for token.

use std::hash::BuildHasher;

pub use crate::backend::top::{TOP_LOGITS, TopLogits};

/// The knobs of the sampler chain. [`Default`] gives `llama-cli`'s defaults; [`SamplingParams::greedy`] gives
/// argmax decoding (what the llama.cpp goldens use).
///
/// Source: llama.cpp `common/common.h` `common_params_sampling` (field names there in parentheses).
///
/// It is also the worker protocol's sampling object (`strata serve`): absent fields take [`Default`]'s values.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(default)]
pub struct SamplingParams {
    /// Softmax temperature (`temp`, `--temp`, default 0.8). Logits are divided by it after the filters; 0 means
    /// greedy (argmax of the penalised logits, ties to the lowest id). Must be finite and ≥ 0.
    pub temperature: f32,
    /// Keep only the `top_k` highest logits (`top_k`, `--top-k`, default 40); 0 disables.
    pub top_k: usize,
    /// Nucleus: keep the smallest set of most likely tokens whose probability sums to at least `top_p`
    /// (`top_p`, `--top-p`, default 0.95). Must be in [0, 1]; 1 disables, 0 keeps only the most likely token
    /// (greedy, as OpenAI's API reads `top_p: 0`).
    pub top_p: f32,
    /// Keep tokens whose probability is at least `min_p` times the most likely one's (`min_p`, `--min-p`,
    /// default 0.05). Must be in [0, 1]; 0 disables, 1 keeps only the most likely token (greedy).
    pub min_p: f32,
    /// Repetition penalty (`penalty_repeat`, `--repeat-penalty`, default 1.0 = off): a token seen in the last
    /// `repeat_last_n` tokens has a positive logit divided by it and a non-positive one multiplied by it.
    /// Must be finite and > 0.
    pub repeat_penalty: f32,
    /// How many of the most recent history tokens the three penalties look at (`penalty_last_n`,
    /// `--repeat-last-n`, default 64); 0 disables the penalties, -1 means the whole history.
    pub repeat_last_n: i32,
    /// Subtracted once from the logit of every token seen in the window (`penalty_present`,
    /// `--presence-penalty`, default 0). Must be finite; negative values encourage repetition.
    pub presence_penalty: f32,
    /// Subtracted `count` times from the logit of a token seen `count` times in the window (`penalty_freq`,
    /// `--frequency-penalty`, default 0). Must be finite.
    pub frequency_penalty: f32,
    /// Seed of the random draw. The same seed, logits and history give the same tokens; `None` seeds from the
    /// clock and process entropy (llama.cpp's `LLAMA_DEFAULT_SEED`), and [`Sampler::seed`] tells which seed.
    pub seed: Option<u64>,
    /// Added to the logits of these token ids before anything else (`logit_bias`, llama.cpp's `logit_bias`
    /// sampler, first in its chain; OpenAI's `logit_bias`, where -100 in effect bans a token and 100 forces it).
    /// Each bias must be finite and each id below the vocabulary size ([`Sampler::new`]); an id listed twice gets
    /// both biases.
    pub logit_bias: Vec<(u32, f32)>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.8,
            top_k: 40,
            top_p: 0.95,
            min_p: 0.05,
            repeat_penalty: 1.0,
            repeat_last_n: 64,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            seed: None,
            logit_bias: Vec::new(),
        }
    }
}

impl SamplingParams {
    /// Greedy decoding: temperature 0 and every filter and penalty off, so [`Sampler::sample`] returns the argmax
    /// of the raw logits (lowest id on ties).
    pub fn greedy() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repeat_penalty: 1.0,
            repeat_last_n: 0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            seed: Some(0),
            logit_bias: Vec::new(),
        }
    }

    /// Checks every field's range. The error names the first bad field, its value and the accepted range.
    pub fn validate(&self) -> Result<(), SamplingError> {
        fn bad(name: &'static str, value: impl std::fmt::Display, expected: &'static str) -> SamplingError {
            SamplingError::InvalidParam {
                name,
                value: value.to_string(),
                expected,
            }
        }
        let t = self.temperature;
        if !(t.is_finite() && t >= 0.0) {
            return Err(bad("temperature", t, "a finite number >= 0 (0 = greedy)"));
        }
        if !(self.top_p >= 0.0 && self.top_p <= 1.0) {
            return Err(bad("top_p", self.top_p, "in [0, 1] (1 = off, 0 = greedy)"));
        }
        if !(self.min_p >= 0.0 && self.min_p <= 1.0) {
            return Err(bad("min_p", self.min_p, "in [0, 1] (0 = off, 1 = greedy)"));
        }
        if !(self.repeat_penalty.is_finite() && self.repeat_penalty > 0.0) {
            return Err(bad(
                "repeat_penalty",
                self.repeat_penalty,
                "a finite number > 0 (1 = off)",
            ));
        }
        if self.repeat_last_n < -1 {
            return Err(bad(
                "repeat_last_n",
                self.repeat_last_n,
                ">= -1 (0 = penalties off, -1 = whole history)",
            ));
        }
        if !self.presence_penalty.is_finite() {
            return Err(bad(
                "presence_penalty",
                self.presence_penalty,
                "a finite number (0 = off)",
            ));
        }
        if !self.frequency_penalty.is_finite() {
            return Err(bad(
                "frequency_penalty",
                self.frequency_penalty,
                "a finite number (0 = off)",
            ));
        }
        if let Some(&(id, b)) = self.logit_bias.iter().find(|(_, b)| !b.is_finite()) {
            return Err(bad("logit_bias", format!("{b} for token {id}"), "a finite number"));
        }
        Ok(())
    }

    /// Whether the chain keeps exactly one token, the argmax of the penalised logits (lowest id on ties):
    /// temperature 0, `top_p` 0 (the nucleus of the most likely token alone) or `min_p` 1 (only tokens as likely
    /// as the most likely one; ties go to the lowest id, as greedy's do).
    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0 || self.top_p == 0.0 || self.min_p >= 1.0
    }

    fn penalties_active(&self) -> bool {
        self.repeat_last_n != 0
            && (self.repeat_penalty != 1.0 || self.frequency_penalty != 0.0 || self.presence_penalty != 0.0)
    }
}

/// An error from building a [`Sampler`] or from [`Sampler::try_sample`].
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SamplingError {
    /// A sampling parameter is out of range; `name` is the [`SamplingParams`] field (or `vocab_size`).
    #[error("sampling parameter {name} must be {expected}, got {value}")]
    InvalidParam {
        name: &'static str,
        value: String,
        expected: &'static str,
    },
    /// The logits slice does not have one entry per vocabulary token.
    #[error("the sampler was built for {expected} tokens but got {got} logits")]
    LogitsLength { expected: usize, got: usize },
    /// After the penalties every logit is NaN or -inf, so no token has any probability.
    #[error("every logit is NaN or -inf: the model output is broken (check the weights and the forward pass)")]
    NoUsableLogit,
}

/// One surviving token of the chain: its id and its (penalised) logit, always finite.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Candidate {
    id: u32,
    logit: f32,
}

/// Descending logit, then ascending id, so every ordering (and therefore every draw) is deterministic. -0 and +0
/// are one value here (adding +0 turns -0 into +0), as they are to the greedy argmax.
fn by_logit_desc(a: &Candidate, b: &Candidate) -> std::cmp::Ordering {
    (b.logit + 0.0).total_cmp(&(a.logit + 0.0)).then(a.id.cmp(&b.id))
}

/// A candidate ordered so that a max-heap keeps the worst on top: the greatest under [`by_logit_desc`].
#[derive(Debug, Clone, Copy)]
struct Worst(Candidate);

impl PartialEq for Worst {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == std::cmp::Ordering::Equal
    }
}

impl Eq for Worst {}

impl PartialOrd for Worst {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Worst {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        by_logit_desc(&self.0, &other.0)
    }
}

/// Samples one token per decode step with llama.cpp's default chain (see [`Sampler::sample`]).
///
/// One sampler serves one generation (one sequence); it owns its random state and scratch buffers.
#[derive(Debug, Clone)]
pub struct Sampler {
    params: SamplingParams,
    seed: u64,
    rng: Xoshiro256StarStar,
    // Scratch, sized to the vocabulary in `new`: `sample` runs once per generated token and never allocates.
    /// The step's logits after penalties, indexed by token id.
    logits: Vec<f32>,
    /// Occurrences of each token id in the penalty window; all zero between calls.
    counts: Vec<u32>,
    /// The distinct ids with a non-zero count, so the counts can be reset in O(window).
    seen: Vec<u32>,
    /// Tokens still in the running after each filter.
    candidates: Vec<Candidate>,
    /// Top-k's running selection: the best `top_k` finite logits seen so far, worst on top.
    best: std::collections::BinaryHeap<Worst>,
}

impl Sampler {
    /// A sampler for a vocabulary of `vocab_size` tokens (the length of every logits slice it will get).
    ///
    /// Errors: a parameter out of range ([`SamplingParams::validate`]), or `vocab_size` 0 or above `u32::MAX`.
    pub fn new(params: SamplingParams, vocab_size: usize) -> Result<Sampler, SamplingError> {
        params.validate()?;
        if vocab_size == 0 || vocab_size > u32::MAX as usize {
            return Err(SamplingError::InvalidParam {
                name: "vocab_size",
                value: vocab_size.to_string(),
                expected: "between 1 and 2^32 - 1",
            });
        }
        if let Some(&(id, _)) = params.logit_bias.iter().find(|(id, _)| *id as usize >= vocab_size) {
            return Err(SamplingError::InvalidParam {
                name: "logit_bias",
                value: format!("token {id}"),
                expected: "token ids below the vocabulary size",
            });
        }
        let seed = params.seed.unwrap_or_else(entropy_seed);
        let heap = params.top_k.min(vocab_size) + 1;
        Ok(Sampler {
            params,
            seed,
            rng: Xoshiro256StarStar::from_seed(seed),
            logits: vec![0.0; vocab_size],
            counts: vec![0; vocab_size],
            seen: Vec::with_capacity(vocab_size),
            candidates: Vec::with_capacity(vocab_size),
            best: std::collections::BinaryHeap::with_capacity(heap),
        })
    }

    /// The parameters this sampler was built with.
    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// The seed in use: [`SamplingParams::seed`], or the one drawn from entropy when that was `None` (print it so
    /// a run can be repeated).
    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// The last step's logits after the penalties (what the filters saw), when the last call got whole logits
    /// ([`Sampler::try_sample`]; zeros before the first).
    pub fn penalised_logits(&self) -> &[f32] {
        &self.logits
    }

    /// The number of tokens (logits per call) this sampler expects.
    pub fn vocab_size(&self) -> usize {
        self.logits.len()
    }

    /// Picks the next token from one step's `logits` (one per vocabulary id) given `history`, the tokens so far
    /// (prompt and generated, oldest first; llama.cpp's CLI feeds the prompt to the penalties too).
    ///
    /// The chain, in llama.cpp's default order (`common_params_sampling::samplers`, then `llama_sampler_dist`),
    /// after `logit_bias` (added first, as llama.cpp's `logit_bias` sampler heads its chain):
    /// 1. **penalties** (`llama_sampler_penalties`): over the last `repeat_last_n` history tokens, a token seen
    ///    `c` times gets `logit / repeat_penalty` if its logit is > 0, else `logit * repeat_penalty`, then
    ///    `- c * frequency_penalty - presence_penalty`;
    /// 2. **top-k** (`llama_sampler_top_k`): the `top_k` highest logits;
    /// 3. **top-p** (`llama_sampler_top_p`): the shortest prefix, by descending probability at temperature 1, whose
    ///    probability sums to ≥ `top_p`;
    /// 4. **min-p** (`llama_sampler_min_p`): tokens with `logit ≥ max_logit + ln(min_p)`, i.e. probability at
    ///    temperature 1 at least `min_p` times the largest;
    /// 5. **temperature** (`llama_sampler_temp`): logits divided by `temperature`;
    /// 6. **softmax and draw** (`llama_sampler_dist`): one uniform draw from the seeded generator.
    ///
    /// With `temperature == 0` (or `top_p == 0`, or `min_p == 1`: [`SamplingParams::is_greedy`]) steps 2–6 reduce
    /// to the argmax of the penalised logits (llama.cpp's `temp` sampler
    /// keeps only the maximum, and every filter keeps the maximum), so that is computed directly. Ties go to the
    /// lowest id.
    ///
    /// NaN logits are never chosen and -inf ones have probability 0. A +inf logit takes all the probability: the
    /// lowest such id is returned. Fallback when every logit is NaN or -inf (a broken model; [`Sampler::try_sample`]
    /// reports it as [`SamplingError::NoUsableLogit`]): the lowest id whose logit is not NaN, or 0.
    ///
    /// History ids outside the vocabulary are ignored. Does not allocate.
    ///
    /// # Panics
    /// If `logits.len()` is not [`Sampler::vocab_size`] (a wiring bug; `try_sample` returns an error instead).
    pub fn sample(&mut self, logits: &[f32], history: &[u32]) -> u32 {
        match self.try_sample(logits, history) {
            Ok(id) => id,
            Err(SamplingError::NoUsableLogit) => logits.iter().position(|l| !l.is_nan()).unwrap_or(0) as u32,
            Err(e) => panic!("Sampler::sample: {e}"),
        }
    }

    /// [`Sampler::sample`], with a wrong logits length reported as [`SamplingError::LogitsLength`] and all-NaN/-inf
    /// logits as [`SamplingError::NoUsableLogit`] instead of the documented fallback.
    pub fn try_sample(&mut self, logits: &[f32], history: &[u32]) -> Result<u32, SamplingError> {
        if logits.len() != self.logits.len() {
            return Err(SamplingError::LogitsLength {
                expected: self.logits.len(),
                got: logits.len(),
            });
        }
        self.logits.copy_from_slice(logits);
        for &(id, b) in &self.params.logit_bias {
            self.logits[id as usize] += b;
        }
        self.apply_penalties(history);

        let best = argmax(&self.logits).ok_or(SamplingError::NoUsableLogit)?;
        let best_logit = self.logits[best as usize];
        if best_logit == f32::NEG_INFINITY {
            return Err(SamplingError::NoUsableLogit);
        }
        if self.params.is_greedy() || best_logit == f32::INFINITY {
            return Ok(best);
        }

        self.filter();
        Ok(self.draw())
    }

    /// Whether [`Sampler::try_sample_top`] gives this sampler's token: the penalties and the logit bias are off, and the chain is
    /// greedy or keeps at most `top_k <= TOP_LOGITS` tokens.
    pub fn can_use_top(&self) -> bool {
        let p = &self.params;
        !p.penalties_active() && p.logit_bias.is_empty() && (p.is_greedy() || (1..=TOP_LOGITS).contains(&p.top_k))
    }

    /// [`Sampler::try_sample`] from a step's [`TopLogits`] instead of its logits: the same token and the same
    /// random draw, provided [`Sampler::can_use_top`] (the candidates that can survive top-k are all in `top`).
    /// The history is not needed (no penalties).
    ///
    /// Errors: [`SamplingError::NoUsableLogit`] as `try_sample`; [`SamplingError::InvalidParam`] (`top_k`) when
    /// `can_use_top` is false.
    pub fn try_sample_top(&mut self, top: &TopLogits) -> Result<u32, SamplingError> {
        if !self.can_use_top() {
            return Err(SamplingError::InvalidParam {
                name: "top_k",
                value: self.params.top_k.to_string(),
                expected: "between 1 and 64 with the penalties off, for a device-side selection",
            });
        }
        let best = top.argmax().ok_or(SamplingError::NoUsableLogit)?;
        let best_logit = top.entries[0].1;
        if best_logit == f32::NEG_INFINITY {
            return Err(SamplingError::NoUsableLogit);
        }
        if self.params.is_greedy() || best_logit == f32::INFINITY {
            return Ok(best);
        }
        // No +inf here, so the finite entries come first, best first.
        let k = self.params.top_k;
        self.candidates.clear();
        let finite = top.entries.iter().filter(|e| e.1.is_finite());
        let sorted = k < top.n_finite;
        if sorted {
            self.candidates
                .extend(finite.take(k).map(|&(id, logit)| Candidate { id, logit }));
        } else {
            // Every finite logit survives top-k (at most k <= TOP_LOGITS of them): in id order, as the chain
            // collects them.
            self.candidates
                .extend(finite.map(|&(id, logit)| Candidate { id, logit }));
            self.candidates.sort_unstable_by_key(|c| c.id);
        }
        self.nucleus_and_min_p(sorted);
        Ok(self.draw())
    }

    /// [`Sampler::try_sample_top`] with [`Sampler::sample`]'s fallback for no usable logit (the lowest id that is
    /// not NaN, or 0).
    ///
    /// # Panics
    /// If [`Sampler::can_use_top`] is false (a wiring bug).
    pub fn sample_top(&mut self, top: &TopLogits) -> u32 {
        match self.try_sample_top(top) {
            Ok(id) => id,
            Err(SamplingError::NoUsableLogit) => top.entries.iter().map(|e| e.0).min().unwrap_or(0),
            Err(e) => panic!("Sampler::sample_top: {e}"),
        }
    }

    /// Step 1 on `self.logits`, in place.
    fn apply_penalties(&mut self, history: &[u32]) {
        if !self.params.penalties_active() {
            return;
        }
        let window = match usize::try_from(self.params.repeat_last_n) {
            Ok(n) => &history[history.len().saturating_sub(n)..],
            Err(_) => history, // -1: the whole history
        };
        for &id in window {
            let Some(count) = self.counts.get_mut(id as usize) else {
                continue;
            };
            if *count == 0 {
                self.seen.push(id);
            }
            *count += 1;
        }
        let (repeat, freq, presence) = (
            self.params.repeat_penalty,
            self.params.frequency_penalty,
            self.params.presence_penalty,
        );
        for &id in &self.seen {
            let count = std::mem::take(&mut self.counts[id as usize]);
            let logit = &mut self.logits[id as usize];
            if *logit <= 0.0 {
                *logit *= repeat;
            } else {
                *logit /= repeat;
            }
            *logit -= count as f32 * freq + presence;
        }
        self.seen.clear();
    }

    /// Steps 2–4: leaves the surviving tokens in `self.candidates` (never empty: the maximum always survives).
    /// Only called when at least one logit is finite and none is +inf.
    fn filter(&mut self) {
        let candidates = &mut self.candidates;
        candidates.clear();
        let k = self.params.top_k;
        let mut sorted = false;
        if k == 0 {
            candidates.extend(
                self.logits
                    .iter()
                    .enumerate()
                    .filter(|(_, l)| l.is_finite())
                    .map(|(id, &logit)| Candidate { id: id as u32, logit }),
            );
        } else {
            // Top-k in one pass: a heap of the best k so far, worst on top; a logit below the worst's cannot
            // enter (ties go to `by_logit_desc`, lower id first). The same survivors as ordering every finite
            // logit, without touching the others twice.
            let best = &mut self.best;
            best.clear();
            let mut finite = 0usize;
            let mut floor = f32::NEG_INFINITY;
            for (id, &logit) in self.logits.iter().enumerate() {
                if !logit.is_finite() {
                    continue;
                }
                finite += 1;
                let c = Candidate { id: id as u32, logit };
                if best.len() < k {
                    best.push(Worst(c));
                    if best.len() == k {
                        floor = best.peek().map_or(f32::NEG_INFINITY, |w| w.0.logit);
                    }
                } else if logit >= floor
                    && best
                        .peek()
                        .is_some_and(|w| by_logit_desc(&c, &w.0) == std::cmp::Ordering::Less)
                {
                    if let Some(mut worst) = best.peek_mut() {
                        *worst = Worst(c); // sifted down when `worst` drops
                    }
                    floor = best.peek().map_or(f32::NEG_INFINITY, |w| w.0.logit);
                }
            }
            candidates.extend(best.drain().map(|w| w.0));
            if k < finite {
                candidates.sort_unstable_by(by_logit_desc);
                sorted = true;
            } else {
                // Every finite logit survives top-k: in id order, as the chain collects them.
                candidates.sort_unstable_by_key(|c| c.id);
            }
        }
        self.nucleus_and_min_p(sorted);
    }

    /// Steps 3–4 on `self.candidates` (`sorted`: already in `by_logit_desc` order).
    fn nucleus_and_min_p(&mut self, mut sorted: bool) {
        let candidates = &mut self.candidates;
        let top_p = self.params.top_p;
        if top_p < 1.0 {
            if !sorted {
                candidates.sort_unstable_by(by_logit_desc);
                sorted = true;
            }
            let max = candidates[0].logit;
            let total: f64 = candidates.iter().map(|c| ((c.logit - max) as f64).exp()).sum();
            let mut cumulative = 0.0f64;
            for i in 0..candidates.len() {
                cumulative += ((candidates[i].logit - max) as f64).exp() / total;
                if cumulative >= top_p as f64 {
                    candidates.truncate(i + 1);
                    break;
                }
            }
        }

        let min_p = self.params.min_p;
        if min_p > 0.0 {
            let max = if sorted {
                candidates[0].logit
            } else {
                candidates.iter().map(|c| c.logit).fold(f32::NEG_INFINITY, f32::max)
            };
            let threshold = max + min_p.ln();
            candidates.retain(|c| c.logit >= threshold);
        }
    }

    /// Steps 5–6 over `self.candidates` (non-empty, finite logits, temperature > 0).
    fn draw(&mut self) -> u32 {
        let candidates = &self.candidates;
        let temperature = self.params.temperature as f64;
        let max = candidates.iter().map(|c| c.logit).fold(f32::NEG_INFINITY, f32::max) as f64;
        let weight = |c: &Candidate| ((c.logit as f64 - max) / temperature).exp();
        let total: f64 = candidates.iter().map(weight).sum();
        let target = self.rng.next_f64() * total;
        let mut cumulative = 0.0f64;
        let mut last_positive = candidates[0].id;
        for c in candidates {
            let w = weight(c);
            if w > 0.0 {
                last_positive = c.id;
            }
            cumulative += w;
            if cumulative > target {
                return c.id;
            }
        }
        // Rounding can leave `cumulative` a hair under `target` when the draw is close to 1.
        last_positive
    }
}

/// The most alternatives a request may ask log-probabilities for (OpenAI's `top_logprobs` range).
pub const MAX_TOP_LOGPROBS: usize = 20;

/// The log-probability OpenAI reports for a token that has none (probability 0): JSON has no -inf.
pub const LOGPROB_FLOOR: f32 = -9999.0;

/// One generated token's log-probability and the most likely alternatives at its step.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct TokenLogprob {
    /// The token generated.
    pub id: u32,
    /// Its natural-log probability (≤ 0; [`LOGPROB_FLOOR`] when it had none).
    pub logprob: f32,
    /// The most likely tokens of the step, most likely first (ties: lower id), with their log-probabilities.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub top: Vec<(u32, f32)>,
}

/// Log-probabilities of one step (OpenAI's `logprobs`): `ln softmax(logits)` at temperature 1 over the whole
/// vocabulary, for `token` and the `top_n` most likely tokens. `logits` are the step's logits after the
/// penalties, i.e. the distribution the sampler's filters and temperature then act on; with the penalties off
/// they are the model's own (vLLM's and llama.cpp server's default logprobs). NaN and -inf logits have
/// [`LOGPROB_FLOOR`].
pub fn logprobs(logits: &[f32], token: u32, top_n: usize) -> TokenLogprob {
    let max = logits
        .iter()
        .copied()
        .filter(|l| l.is_finite())
        .fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = logits
        .iter()
        .filter(|l| l.is_finite())
        .map(|&l| ((l - max) as f64).exp())
        .sum();
    let lse = max as f64 + sum.ln();
    let lp = |l: f32| {
        if l.is_finite() {
            ((l as f64 - lse) as f32).max(LOGPROB_FLOOR)
        } else {
            LOGPROB_FLOOR
        }
    };
    let mut top: Vec<Candidate> = Vec::new();
    if top_n > 0 {
        top = logits
            .iter()
            .enumerate()
            .filter(|(_, l)| l.is_finite())
            .map(|(id, &logit)| Candidate { id: id as u32, logit })
            .collect();
        let n = top_n.min(top.len());
        if n > 0 && n < top.len() {
            top.select_nth_unstable_by(n - 1, by_logit_desc);
        }
        top.truncate(n);
        top.sort_unstable_by(by_logit_desc);
    }
    TokenLogprob {
        id: token,
        logprob: logits.get(token as usize).map_or(LOGPROB_FLOOR, |&l| lp(l)),
        top: top.iter().map(|c| (c.id, lp(c.logit))).collect(),
    }
}

/// Index of the largest non-NaN value, lowest index on ties; `None` if every value is NaN.
fn argmax(values: &[f32]) -> Option<u32> {
    let mut best: Option<(usize, f32)> = None;
    for (i, &v) in values.iter().enumerate() {
        if v.is_nan() {
            continue;
        }
        match best {
            Some((_, b)) if v <= b => {}
            _ => best = Some((i, v)),
        }
    }
    best.map(|(i, _)| i as u32)
}

/// A seed for `seed: None`: the clock mixed with the process's hash keys (which the standard library draws from
/// the OS), so two samplers built in the same nanosecond still differ.
fn entropy_seed() -> u64 {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    std::collections::hash_map::RandomState::new().hash_one(nanos)
}

/// xoshiro256\*\* (Blackman and Vigna, <https://prng.di.unimi.it/>), seeded through SplitMix64 as its authors
/// recommend. Small, fast, and plenty for drawing tokens; not cryptographic.
#[derive(Debug, Clone)]
struct Xoshiro256StarStar {
    s: [u64; 4],
}

impl Xoshiro256StarStar {
    fn from_seed(seed: u64) -> Self {
        let mut sm = crate::rng::SplitMix64::new(seed);
        Xoshiro256StarStar {
            s: [sm.next_u64(), sm.next_u64(), sm.next_u64(), sm.next_u64()],
        }
    }

    fn next_u64(&mut self) -> u64 {
        let s = &mut self.s;
        let result = s[1].wrapping_mul(5).rotate_left(7).wrapping_mul(9);
        let t = s[1] << 17;
        s[2] ^= s[0];
        s[3] ^= s[1];
        s[1] ^= s[2];
        s[0] ^= s[3];
        s[2] ^= t;
        s[3] = s[3].rotate_left(45);
        result
    }

    /// Uniform in [0, 1), 53 random bits.
    fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }
}

/// What [`StopMatcher::feed`] says about one piece of text.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StopStep<'a> {
    /// Text that is safe to print now. It never contains a stop string or any part of one that may still
    /// complete; once a stop matched it is the text before the stop string.
    pub text: &'a str,
    /// A stop string matched: generation should end. The stop string and anything after it are dropped.
    pub stopped: bool,
}

/// Finds stop strings in a stream of decoded text pieces, so a streaming caller prints everything before the stop
/// string and never a part of it.
///
/// Each [`StopMatcher::feed`] returns the text safe to print now, holding back only the longest tail that is the
/// start of some stop string (it is released as soon as the next piece shows it is not one). When several stop
/// strings are found in the same piece, the one that starts first wins. When generation ends another way (EOS,
/// token limit), [`StopMatcher::finish`] releases the held-back tail.
///
/// Source: the same contract as llama.cpp's server (`find_stopping_strings` with partial matches held back).
#[derive(Debug, Clone)]
pub struct StopMatcher {
    stops: Vec<String>,
    /// Text received but not yet released: a possible partial stop string.
    pending: String,
    /// The text returned by the last call (kept here so the returned `&str` needs no allocation per piece).
    released: String,
    /// Index in `stops` of the stop string that matched, since the last [`StopMatcher::finish`].
    matched: Option<usize>,
}

impl StopMatcher {
    /// A matcher for `stop_strings`; empty strings are ignored, and with none left it passes text straight through.
    pub fn new<I, S>(stop_strings: I) -> StopMatcher
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        let stops: Vec<String> = stop_strings
            .into_iter()
            .map(Into::into)
            .filter(|s| !s.is_empty())
            .collect();
        StopMatcher {
            stops,
            pending: String::new(),
            released: String::new(),
            matched: None,
        }
    }

    /// Feeds the next decoded piece. After a stop matched, every further call returns empty text and
    /// `stopped: true`.
    pub fn feed(&mut self, piece: &str) -> StopStep<'_> {
        self.released.clear();
        if self.matched.is_some() {
            return StopStep {
                text: "",
                stopped: true,
            };
        }
        self.pending.push_str(piece);

        // The earliest match wins; among stop strings matching at the same place, the first given.
        let earliest = self
            .stops
            .iter()
            .enumerate()
            .filter_map(|(i, stop)| self.pending.find(stop.as_str()).map(|at| (at, i)))
            .min();
        if let Some((at, i)) = earliest {
            self.released.push_str(&self.pending[..at]);
            self.pending.clear();
            self.matched = Some(i);
            return StopStep {
                text: &self.released,
                stopped: true,
            };
        }

        let cut = self.pending.len() - self.partial_tail_len();
        self.released.push_str(&self.pending[..cut]);
        self.pending.drain(..cut);
        StopStep {
            text: &self.released,
            stopped: false,
        }
    }

    /// Releases the held-back tail at the end of generation (nothing if a stop matched: it was part of the stop
    /// string). The matcher is then empty and can be reused for a new generation.
    pub fn finish(&mut self) -> &str {
        self.released.clear();
        if self.matched.is_none() {
            std::mem::swap(&mut self.released, &mut self.pending);
        }
        self.pending.clear();
        self.matched = None;
        &self.released
    }

    /// Whether a stop string has matched since the last [`StopMatcher::finish`].
    pub fn is_stopped(&self) -> bool {
        self.matched.is_some()
    }

    /// The stop string that matched since the last [`StopMatcher::finish`] (Anthropic's `stop_sequence`,
    /// llama.cpp server's `stopping_word`).
    pub fn matched(&self) -> Option<&str> {
        self.matched.map(|i| self.stops[i].as_str())
    }

    /// Length in bytes of the longest tail of `pending` that is a proper prefix of some stop string.
    fn partial_tail_len(&self) -> usize {
        let longest_stop = self.stops.iter().map(String::len).max().unwrap_or(0);
        let len = self.pending.len();
        let first = len.saturating_sub(longest_stop.saturating_sub(1));
        (first..len)
            .filter(|&start| self.pending.is_char_boundary(start))
            .map(|start| &self.pending[start..])
            .find(|tail| {
                self.stops
                    .iter()
                    .any(|stop| stop.len() > tail.len() && stop.starts_with(tail))
            })
            .map_or(0, str::len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Temperature-1 sampling with every filter and penalty off.
    fn plain(seed: u64) -> SamplingParams {
        SamplingParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repeat_penalty: 1.0,
            repeat_last_n: 64,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            seed: Some(seed),
            logit_bias: Vec::new(),
        }
    }

    /// `logit_bias` is added before everything else: -100 takes the argmax out of greedy decoding and a positive
    /// bias makes a token the argmax; the top-logits shortcut is off with a bias; biased logits are what the
    /// filters saw; a bias on an id past the vocabulary or not finite is refused.
    #[test]
    fn logit_bias_moves_the_choice() {
        let logits = [1.0f32, 3.0, 2.0, 0.5];
        let greedy = |bias: Vec<(u32, f32)>| {
            let params = SamplingParams {
                logit_bias: bias,
                ..SamplingParams::greedy()
            };
            let mut s = Sampler::new(params, logits.len()).unwrap();
            (s.sample(&logits, &[]), s.can_use_top(), s.penalised_logits().to_vec())
        };
        assert_eq!(greedy(vec![]).0, 1);
        assert!(greedy(vec![]).1);
        let (id, top, seen) = greedy(vec![(1, -100.0)]);
        assert_eq!((id, top), (2, false));
        assert_eq!(seen, vec![1.0, -97.0, 2.0, 0.5]);
        assert_eq!(greedy(vec![(3, 5.0)]).0, 3);
        // Listed twice: both biases.
        assert_eq!(greedy(vec![(0, 1.5), (0, 1.0)]).0, 0);
        // Sampling at temperature 1 never draws a token biased by -100 among four.
        let params = SamplingParams {
            logit_bias: vec![(1, -100.0)],
            ..plain(7)
        };
        let mut s = Sampler::new(params, logits.len()).unwrap();
        assert!((0..500).all(|_| s.sample(&logits, &[]) != 1));
        let past = SamplingParams {
            logit_bias: vec![(4, 1.0)],
            ..plain(1)
        };
        assert!(matches!(
            Sampler::new(past, logits.len()),
            Err(SamplingError::InvalidParam { name: "logit_bias", .. })
        ));
        let nan = SamplingParams {
            logit_bias: vec![(0, f32::NAN)],
            ..plain(1)
        };
        assert!(matches!(
            nan.validate(),
            Err(SamplingError::InvalidParam { name: "logit_bias", .. })
        ));
    }

    fn softmax(logits: &[f32]) -> Vec<f64> {
        let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
        let e: Vec<f64> = logits.iter().map(|&l| (l as f64 - max).exp()).collect();
        let sum: f64 = e.iter().sum();
        e.iter().map(|x| x / sum).collect()
    }

    /// Logits whose softmax is exactly `probs`.
    fn logits_of(probs: &[f64]) -> Vec<f32> {
        probs.iter().map(|p| p.ln() as f32).collect()
    }

    /// Pseudo-random logits in [-4, 4) from a seed, for tests that need many distinct steps.
    fn random_logits(rng: &mut Xoshiro256StarStar, n: usize) -> Vec<f32> {
        (0..n).map(|_| (rng.next_f64() * 8.0 - 4.0) as f32).collect()
    }

    /// The ids that survive penalties and filters (steps 1–4), ascending.
    fn survivors(params: SamplingParams, logits: &[f32], history: &[u32]) -> Vec<u32> {
        let mut s = Sampler::new(params, logits.len()).unwrap();
        s.logits.copy_from_slice(logits);
        s.apply_penalties(history);
        s.filter();
        let mut ids: Vec<u32> = s.candidates.iter().map(|c| c.id).collect();
        ids.sort();
        ids
    }

    /// The logits after step 1.
    fn penalised(params: SamplingParams, logits: &[f32], history: &[u32]) -> Vec<f32> {
        let mut s = Sampler::new(params, logits.len()).unwrap();
        s.logits.copy_from_slice(logits);
        s.apply_penalties(history);
        assert!(
            s.counts.iter().all(|&c| c == 0) && s.seen.is_empty(),
            "penalty scratch not reset"
        );
        s.logits
    }

    fn assert_close(got: &[f32], want: &[f32]) {
        assert_eq!(got.len(), want.len());
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            assert!((g - w).abs() < 1e-6, "logit {i}: got {g}, want {w} (all: {got:?})");
        }
    }

    /// Top-k's one-pass selection keeps the candidates, in the order, that ordering every finite logit gives
    /// (select the k-th, keep k, sort; with at most k finite logits all of them in id order): logits with many
    /// ties, ±0, -inf and NaN (`filter` never sees +inf: `try_sample` returns first), k from 1 to past the vocabulary, over many steps of one sampler (its heap reused).
    #[test]
    fn top_k_in_one_pass_keeps_the_candidates_of_a_full_ordering() {
        let mut rng = Xoshiro256StarStar::from_seed(5);
        for &k in &[1usize, 2, 3, 7, 40, 64, 199, 200, 201, 1000] {
            let params = SamplingParams {
                top_k: k,
                top_p: 1.0,
                min_p: 0.0,
                seed: Some(1),
                ..SamplingParams::default()
            };
            let mut s = Sampler::new(params, 200).unwrap();
            for step in 0..50 {
                // Few distinct values (many ties), some of them specials.
                let logits: Vec<f32> = (0..200)
                    .map(|_| match rng.next_u64() % 12 {
                        0 => f32::NAN,
                        1 => f32::NEG_INFINITY,
                        2 if step % 5 == 0 => f32::INFINITY,
                        3 => -0.0,
                        4 => 0.0,
                        r => (r as f32 - 8.0) * 0.5 + if step % 2 == 0 { 0.0 } else { rng.next_f64() as f32 },
                    })
                    .map(|l| if l == f32::INFINITY { 3.0 } else { l })
                    .collect();
                let mut want: Vec<Candidate> = logits
                    .iter()
                    .enumerate()
                    .filter(|(_, l)| l.is_finite())
                    .map(|(id, &logit)| Candidate { id: id as u32, logit })
                    .collect();
                if k < want.len() {
                    want.select_nth_unstable_by(k - 1, by_logit_desc);
                    want.truncate(k);
                    want.sort_unstable_by(by_logit_desc);
                }
                s.logits.copy_from_slice(&logits);
                s.filter();
                let got: Vec<(u32, u32)> = s.candidates.iter().map(|c| (c.id, c.logit.to_bits())).collect();
                let want: Vec<(u32, u32)> = want.iter().map(|c| (c.id, c.logit.to_bits())).collect();
                assert_eq!(got, want, "top_k {k}, step {step}");
            }
        }
    }

    /// The device-side path (top 64 candidates) draws exactly the full chain's tokens, step after step with one
    /// random stream each, for every parameter set it serves: logits with ties, ±0, infinities, NaN, and fewer
    /// finite values than `top_k`.
    #[test]
    fn sampling_from_the_top_candidates_gives_the_full_chains_tokens() {
        let mut rng = Xoshiro256StarStar::from_seed(11);
        let params = [
            SamplingParams::greedy(),
            SamplingParams {
                seed: Some(3),
                ..SamplingParams::default()
            },
            SamplingParams {
                top_k: 64,
                top_p: 1.0,
                min_p: 0.0,
                seed: Some(4),
                ..SamplingParams::default()
            },
            SamplingParams {
                top_k: 1,
                seed: Some(5),
                ..SamplingParams::default()
            },
            SamplingParams {
                top_k: 20,
                top_p: 0.5,
                min_p: 0.2,
                temperature: 1.7,
                seed: Some(6),
                ..SamplingParams::default()
            },
            SamplingParams {
                temperature: 0.0,
                top_k: 0,
                ..plain(7)
            },
        ];
        let vocab = 3000;
        for (pi, p) in params.iter().enumerate() {
            let (mut full, mut top) = (
                Sampler::new(p.clone(), vocab).unwrap(),
                Sampler::new(p.clone(), vocab).unwrap(),
            );
            assert!(top.can_use_top(), "params {pi}");
            for step in 0..200 {
                let mut logits = random_logits(&mut rng, vocab);
                match step % 8 {
                    // Coarse values: many ties, some at the 64th place.
                    1 => logits.iter_mut().for_each(|l| *l = (*l * 2.0).round()),
                    2 => (0..vocab).step_by(7).for_each(|i| logits[i] = f32::NAN),
                    3 => (0..vocab).step_by(5).for_each(|i| logits[i] = f32::NEG_INFINITY),
                    // As many finite logits as top_k, or fewer: the survivors come back in id order.
                    4 => {
                        let keep = [9, 20, 40, 64, 65][step / 8 % 5];
                        logits.iter_mut().skip(keep).for_each(|l| *l = f32::NEG_INFINITY)
                    }
                    5 => {
                        logits.iter_mut().for_each(|l| *l = -(*l).abs() * 0.0);
                        logits[17] = 0.0;
                    }
                    6 => logits[vocab - 3] = f32::INFINITY,
                    7 => logits.iter_mut().for_each(|l| *l = f32::NAN),
                    _ => {}
                }
                let t = TopLogits::from_logits(&logits);
                assert!(t.entries.len() <= TOP_LOGITS);
                assert_eq!(
                    full.try_sample(&logits, &[]),
                    top.try_sample_top(&t),
                    "params {pi} step {step}: {:?}",
                    &t.entries[..t.entries.len().min(8)]
                );
            }
        }
        // Penalties, or a top_k the candidates cannot serve, keep the full path.
        for p in [
            SamplingParams {
                repeat_penalty: 1.1,
                ..SamplingParams::default()
            },
            SamplingParams {
                top_k: 0,
                ..SamplingParams::default()
            },
            SamplingParams {
                top_k: TOP_LOGITS + 1,
                ..SamplingParams::default()
            },
        ] {
            let mut s = Sampler::new(p, 10).unwrap();
            assert!(!s.can_use_top());
            assert!(matches!(
                s.try_sample_top(&TopLogits::default()),
                Err(SamplingError::InvalidParam { .. })
            ));
        }
    }

    /// Keys order logits as the chain does and decode back to the same (id, logit).
    #[test]
    fn top_logit_keys_round_trip_in_chain_order() {
        let vals = [f32::NEG_INFINITY, -3.5, -1e-30, 0.0, 1e-30, 2.0, f32::INFINITY];
        for w in vals.windows(2) {
            assert!(TopLogits::key(w[0], 0) < TopLogits::key(w[1], 0), "{} < {}", w[0], w[1]);
        }
        assert!(
            TopLogits::key(1.0, 5) > TopLogits::key(1.0, 6),
            "lower id first among equal logits"
        );
        assert_eq!(
            TopLogits::key(-0.0, 9),
            TopLogits::key(0.0, 9),
            "-0 and +0 are one value"
        );
        assert!(TopLogits::key(f32::NAN, 0) < TopLogits::key(f32::NEG_INFINITY, u32::MAX - 1));
        for (i, &v) in vals.iter().enumerate() {
            let got = TopLogits::from_key(TopLogits::key(v, i as u32 * 1000)).unwrap();
            assert_eq!((got.0, got.1.to_bits()), (i as u32 * 1000, v.to_bits()));
        }
        assert_eq!(TopLogits::from_key(TopLogits::key(f32::NAN, 3)), None);
        let t = TopLogits::from_logits(&[0.5, f32::NAN, 0.0, -0.0, 2.0, 2.0]);
        assert_eq!(t.entries, vec![(4, 2.0), (5, 2.0), (0, 0.5), (2, 0.0), (3, 0.0)]);
        assert_eq!((t.n_finite, t.argmax()), (5, Some(4)));
        let z = TopLogits::from_logits(&[-0.0, 0.0]);
        assert_eq!(z.argmax(), Some(0), "-0 and +0 tie: the lowest id");
        // More +0 maxima than candidates and a -0 of a lower id: the -0 token is still the greedy one.
        let mut l = vec![-1.0f32; 200];
        l[0] = -0.0;
        l[1..=TOP_LOGITS].iter_mut().for_each(|v| *v = 0.0);
        let mut g = Sampler::new(SamplingParams::greedy(), l.len()).unwrap();
        assert_eq!(g.try_sample(&l, &[]), Ok(0));
        assert_eq!(g.try_sample_top(&TopLogits::from_logits(&l)), Ok(0));
    }

    #[test]
    fn xoshiro_matches_reference_vectors() {
        // Reference C implementation from state {1, 2, 3, 4}.
        let mut rng = Xoshiro256StarStar { s: [1, 2, 3, 4] };
        assert_eq!([rng.next_u64(), rng.next_u64(), rng.next_u64()], [11520, 0, 1509978240]);
        // SplitMix64's first output from seed 0.
        assert_eq!(Xoshiro256StarStar::from_seed(0).s[0], 0xe220_a839_7b1d_cdaf);
    }

    #[test]
    fn defaults_are_llama_cli_defaults() {
        let p = SamplingParams::default();
        assert_eq!((p.temperature, p.top_k, p.top_p, p.min_p), (0.8, 40, 0.95, 0.05));
        assert_eq!(
            (
                p.repeat_penalty,
                p.repeat_last_n,
                p.presence_penalty,
                p.frequency_penalty
            ),
            (1.0, 64, 0.0, 0.0)
        );
        assert!(p.validate().is_ok() && SamplingParams::greedy().validate().is_ok());
    }

    #[test]
    fn greedy_picks_argmax_lowest_id_on_ties_and_skips_nan() {
        let mut s = Sampler::new(SamplingParams::greedy(), 5).unwrap();
        assert_eq!(s.sample(&[0.1, 2.0, -1.0, 1.5, 0.0], &[]), 1);
        assert_eq!(s.sample(&[0.1, 2.0, -1.0, 2.0, 0.0], &[]), 1);
        assert_eq!(s.sample(&[f32::NAN, 2.0, -1.0, f32::NAN, 3.0], &[]), 4);
        assert_eq!(s.sample(&[1.0, f32::NAN, f32::NAN, f32::NAN, f32::NAN], &[]), 0);
        // Default parameters at temperature 0 are greedy too (after penalties).
        let params = SamplingParams {
            temperature: 0.0,
            seed: Some(7),
            ..SamplingParams::default()
        };
        let mut s = Sampler::new(params, 5).unwrap();
        assert_eq!(s.sample(&[0.1, 2.0, -1.0, 1.5, 0.0], &[]), 1);
    }

    #[test]
    fn greedy_applies_penalties_first() {
        let params = SamplingParams {
            repeat_penalty: 2.0,
            repeat_last_n: 64,
            ..SamplingParams::greedy()
        };
        let mut s = Sampler::new(params, 3).unwrap();
        // Token 1 (2.0) is halved to 1.0, below token 2 (1.5).
        assert_eq!(s.sample(&[0.0, 2.0, 1.5], &[1]), 2);
        assert_eq!(s.sample(&[0.0, 2.0, 1.5], &[]), 1);
    }

    #[test]
    fn same_seed_same_sequence_different_seed_differs() {
        let run = |seed: u64| {
            let mut s = Sampler::new(
                SamplingParams {
                    seed: Some(seed),
                    ..SamplingParams::default()
                },
                64,
            )
            .unwrap();
            let mut logits_rng = Xoshiro256StarStar::from_seed(99);
            let mut history = Vec::new();
            for _ in 0..200 {
                let logits: Vec<f32> = random_logits(&mut logits_rng, 64).iter().map(|l| l * 0.3).collect();
                let id = s.sample(&logits, &history);
                history.push(id);
            }
            history
        };
        let a = run(1);
        assert_eq!(a, run(1));
        assert_ne!(a, run(2));
        assert!(
            a.iter().collect::<std::collections::HashSet<_>>().len() > 5,
            "draws should vary: {a:?}"
        );
        // Unseeded samplers report the seed they drew, and that seed reproduces them.
        let s = Sampler::new(SamplingParams::default(), 64).unwrap();
        assert_eq!(
            Sampler::new(
                SamplingParams {
                    seed: Some(s.seed()),
                    ..SamplingParams::default()
                },
                64
            )
            .unwrap()
            .seed(),
            s.seed()
        );
    }

    #[test]
    fn top_k_one_is_greedy() {
        let mut logits_rng = Xoshiro256StarStar::from_seed(5);
        for seed in 0..20 {
            let params = SamplingParams {
                top_k: 1,
                temperature: 1.5,
                seed: Some(seed),
                ..plain(seed)
            };
            let mut s = Sampler::new(params, 100).unwrap();
            let mut g = Sampler::new(SamplingParams::greedy(), 100).unwrap();
            for _ in 0..20 {
                let logits = random_logits(&mut logits_rng, 100);
                assert_eq!(s.sample(&logits, &[]), g.sample(&logits, &[]));
            }
        }
    }

    /// `top_p: 0` and `min_p: 1` keep the most likely token alone, as clients of OpenAI's API expect: the same
    /// tokens as greedy at any temperature, ties included (lowest id), from the whole logits and from the top
    /// candidates alike.
    #[test]
    fn top_p_zero_and_min_p_one_are_greedy() {
        let mut logits_rng = Xoshiro256StarStar::from_seed(9);
        for (top_p, min_p) in [(0.0, 0.0), (1.0, 1.0), (0.0, 1.0)] {
            let params = SamplingParams {
                top_p,
                min_p,
                temperature: 2.0,
                top_k: 0,
                ..plain(3)
            };
            assert!(params.is_greedy());
            let mut s = Sampler::new(params, 100).unwrap();
            assert!(s.can_use_top(), "no penalties: the device's candidates suffice");
            let mut g = Sampler::new(SamplingParams::greedy(), 100).unwrap();
            for step in 0..50 {
                let mut logits = random_logits(&mut logits_rng, 100);
                if step % 5 == 0 {
                    // A tie for the maximum: the lowest id wins.
                    logits[70] = 9.0;
                    logits[20] = 9.0;
                }
                let want = g.sample(&logits, &[]);
                assert_eq!(s.sample(&logits, &[]), want, "top_p {top_p} min_p {min_p}");
                let top = TopLogits::from_logits(&logits);
                assert_eq!(s.sample_top(&top), want);
            }
        }
        // Just above 0 is not greedy: a high temperature then draws other tokens.
        let params = SamplingParams {
            top_p: 0.999,
            ..plain(4)
        };
        assert!(!params.is_greedy());
    }

    /// The matcher names the stop string that matched: the earliest in the text, across pieces, and the first
    /// given among those matching at the same place.
    #[test]
    fn the_matched_stop_string_is_named() {
        let mut m = StopMatcher::new(["END", "\n\n", "E"]);
        assert_eq!(m.matched(), None);
        assert!(!m.feed("one\n").stopped);
        assert!(m.feed("\nEND").stopped);
        assert_eq!(m.matched(), Some("\n\n"));
        m.finish();
        assert_eq!(m.matched(), None, "finish resets it");
        assert!(m.feed("xxEND").stopped);
        assert_eq!(
            m.matched(),
            Some("END"),
            "END and E match at the same place: the first given"
        );
    }

    /// `logprobs` is ln softmax over the finite logits (checked against an f64 reference), the alternatives most
    /// likely first with ties to the lower id, and no probability reads as the floor.
    #[test]
    fn logprobs_are_the_log_softmax() {
        let logits = [1.0f32, 3.0, f32::NEG_INFINITY, 3.0, -2.0, f32::NAN];
        let finite: Vec<f32> = vec![1.0, 3.0, 3.0, -2.0];
        let p = softmax(&finite);
        let lp = logprobs(&logits, 0, 3);
        assert!((lp.logprob as f64 - p[0].ln()).abs() < 1e-6, "{lp:?}");
        assert_eq!(lp.top.iter().map(|t| t.0).collect::<Vec<_>>(), [1, 3, 0]);
        assert!((lp.top[0].1 as f64 - p[1].ln()).abs() < 1e-6);
        assert_eq!(lp.top[0].1, lp.top[1].1);
        assert_eq!(logprobs(&logits, 2, 0).logprob, LOGPROB_FLOOR);
        assert_eq!(logprobs(&logits, 5, 0).logprob, LOGPROB_FLOOR);
        assert!(logprobs(&logits, 1, 0).top.is_empty());
        assert_eq!(
            logprobs(&logits, 1, 20).top.len(),
            4,
            "only finite logits are alternatives"
        );
    }

    #[test]
    fn top_k_keeps_the_k_highest() {
        let logits = [0.5, 3.0, -1.0, 2.0, 2.5, 0.0];
        assert_eq!(
            survivors(SamplingParams { top_k: 3, ..plain(0) }, &logits, &[]),
            vec![1, 3, 4]
        );
        assert_eq!(
            survivors(SamplingParams { top_k: 0, ..plain(0) }, &logits, &[]),
            vec![0, 1, 2, 3, 4, 5]
        );
        assert_eq!(
            survivors(SamplingParams { top_k: 99, ..plain(0) }, &logits, &[]),
            vec![0, 1, 2, 3, 4, 5]
        );
    }

    #[test]
    fn top_p_keeps_the_minimal_nucleus() {
        // Probabilities 0.5, 0.3, 0.15, 0.05 (shuffled ids): cumulative 0.5, 0.8, 0.95, 1.0.
        let logits = logits_of(&[0.15, 0.5, 0.05, 0.3]);
        let at = |p: f32| survivors(SamplingParams { top_p: p, ..plain(0) }, &logits, &[]);
        assert_eq!(at(0.45), vec![1]);
        assert_eq!(at(0.75), vec![1, 3]);
        assert_eq!(at(0.85), vec![0, 1, 3]);
        assert_eq!(at(0.97), vec![0, 1, 2, 3]);
        assert_eq!(at(1.0), vec![0, 1, 2, 3]);
        // Probabilities are taken before temperature (llama.cpp order), so temperature does not change the set.
        let hot = survivors(
            SamplingParams {
                top_p: 0.75,
                temperature: 5.0,
                ..plain(0)
            },
            &logits,
            &[],
        );
        assert_eq!(hot, vec![1, 3]);
        // And the draws stay inside the nucleus.
        let mut s = Sampler::new(
            SamplingParams {
                top_p: 0.75,
                ..plain(3)
            },
            4,
        )
        .unwrap();
        let mut seen = [0u32; 4];
        for _ in 0..2000 {
            seen[s.sample(&logits, &[]) as usize] += 1;
        }
        assert_eq!((seen[0], seen[2]), (0, 0), "{seen:?}");
        assert!(seen[1] > 0 && seen[3] > 0, "{seen:?}");
    }

    #[test]
    fn min_p_threshold_is_relative_to_the_top_probability() {
        // Probabilities 0.5, 0.3, 0.15, 0.05: min_p 0.2 keeps p ≥ 0.1, min_p 0.35 keeps p ≥ 0.175.
        let logits = logits_of(&[0.5, 0.3, 0.15, 0.05]);
        let at = |p: f32| survivors(SamplingParams { min_p: p, ..plain(0) }, &logits, &[]);
        assert_eq!(at(0.0), vec![0, 1, 2, 3]);
        assert_eq!(at(0.05), vec![0, 1, 2, 3]);
        assert_eq!(at(0.2), vec![0, 1, 2]);
        assert_eq!(at(0.35), vec![0, 1]);
        assert_eq!(at(0.9), vec![0]);
        assert_eq!(at(1.0), vec![0]);
    }

    #[test]
    fn filters_chain_in_order() {
        // top-k 3 drops id 4; top-p 0.9 over the renormalised three (0.5, 0.3, 0.15)/0.95 keeps all three
        // (cumulative 0.526, 0.842, 1.0); min-p 0.35 then drops id 2 (0.15 < 0.35 * 0.5).
        let logits = logits_of(&[0.5, 0.3, 0.15, 0.001, 0.049]);
        let params = SamplingParams {
            top_k: 3,
            top_p: 0.9,
            min_p: 0.35,
            ..plain(0)
        };
        assert_eq!(survivors(params, &logits, &[]), vec![0, 1]);
    }

    #[test]
    fn repeat_penalty_divides_positive_and_multiplies_negative() {
        let logits = [2.0, -1.0, 0.5, 3.0, 0.0];
        let params = SamplingParams {
            repeat_penalty: 2.0,
            ..plain(0)
        };
        // Tokens 0, 1, 4 seen; token 1 twice (the count does not matter to the repeat penalty). 0 * 2 = 0.
        assert_close(&penalised(params, &logits, &[0, 1, 1, 4]), &[1.0, -2.0, 0.5, 3.0, 0.0]);
    }

    #[test]
    fn frequency_and_presence_penalties_use_counts_in_the_window() {
        let logits = [2.0, -1.0, 0.5, 3.0];
        let params = SamplingParams {
            frequency_penalty: 0.5,
            presence_penalty: 0.25,
            ..plain(0)
        };
        // counts: 0 → 1, 1 → 3, 2 → 0, 3 → 2.
        let history = [1, 0, 3, 1, 3, 1];
        assert_close(
            &penalised(params.clone(), &logits, &history),
            &[2.0 - 0.5 - 0.25, -1.0 - 1.5 - 0.25, 0.5, 3.0 - 1.0 - 0.25],
        );
        // All three together: repeat first, then subtract.
        let all = SamplingParams {
            repeat_penalty: 1.25,
            ..params.clone()
        };
        assert_close(
            &penalised(all, &logits, &history),
            // Token 1: -1.0 * 1.25 = -1.25, then - 3 * 0.5 - 0.25.
            &[2.0 / 1.25 - 0.75, -1.25 - 1.75, 0.5, 3.0 / 1.25 - 1.25],
        );
        // Only the last `repeat_last_n` tokens count: [3, 1] → 1 once, 3 once.
        let last2 = SamplingParams {
            repeat_last_n: 2,
            ..params.clone()
        };
        assert_close(
            &penalised(last2, &logits, &history),
            &[2.0, -1.0 - 0.75, 0.5, 3.0 - 0.75],
        );
        // 0 disables; -1 is the whole history; ids outside the vocabulary are ignored.
        let off = SamplingParams {
            repeat_last_n: 0,
            ..params.clone()
        };
        assert_close(&penalised(off, &logits, &history), &logits);
        let whole = SamplingParams {
            repeat_last_n: -1,
            ..params
        };
        let long: Vec<u32> = std::iter::repeat_n(2, 100).chain([7, 1_000_000]).collect();
        assert_close(&penalised(whole, &logits, &long), &[2.0, -1.0, 0.5 - 50.0 - 0.25, 3.0]);
    }

    #[test]
    fn draws_at_temperature_one_match_softmax() {
        let logits = [1.0, 0.0, 2.0, -0.5];
        let want = softmax(&logits);
        let mut s = Sampler::new(plain(12345), 4).unwrap();
        let n = 20_000;
        let mut counts = [0usize; 4];
        for _ in 0..n {
            counts[s.sample(&logits, &[]) as usize] += 1;
        }
        for i in 0..4 {
            let got = counts[i] as f64 / n as f64;
            assert!(
                (got - want[i]).abs() < 0.02,
                "token {i}: {got:.4} drawn vs {:.4} softmax ({counts:?})",
                want[i]
            );
        }
    }

    #[test]
    fn temperature_sharpens_and_flattens() {
        // At temperature T the draw follows softmax(logits / T).
        let logits = [1.0, 0.0, 2.0, -0.5];
        for t in [0.5f32, 2.0] {
            let want = softmax(&logits.map(|l| l / t));
            let mut s = Sampler::new(
                SamplingParams {
                    temperature: t,
                    ..plain(77)
                },
                4,
            )
            .unwrap();
            let n = 20_000;
            let mut counts = [0usize; 4];
            for _ in 0..n {
                counts[s.sample(&logits, &[]) as usize] += 1;
            }
            for i in 0..4 {
                let got = counts[i] as f64 / n as f64;
                assert!(
                    (got - want[i]).abs() < 0.02,
                    "T={t} token {i}: {got:.4} vs {:.4}",
                    want[i]
                );
            }
        }
    }

    #[test]
    fn bad_params_are_errors_naming_the_parameter() {
        let d = SamplingParams::default;
        let cases = [
            (
                "temperature",
                SamplingParams {
                    temperature: -0.1,
                    ..d()
                },
            ),
            (
                "temperature",
                SamplingParams {
                    temperature: f32::NAN,
                    ..d()
                },
            ),
            (
                "temperature",
                SamplingParams {
                    temperature: f32::INFINITY,
                    ..d()
                },
            ),
            ("top_p", SamplingParams { top_p: -0.01, ..d() }),
            ("top_p", SamplingParams { top_p: 1.5, ..d() }),
            ("top_p", SamplingParams { top_p: f32::NAN, ..d() }),
            ("min_p", SamplingParams { min_p: -0.1, ..d() }),
            ("min_p", SamplingParams { min_p: 1.01, ..d() }),
            ("min_p", SamplingParams { min_p: f32::NAN, ..d() }),
            (
                "repeat_penalty",
                SamplingParams {
                    repeat_penalty: 0.0,
                    ..d()
                },
            ),
            (
                "repeat_penalty",
                SamplingParams {
                    repeat_penalty: f32::NAN,
                    ..d()
                },
            ),
            (
                "repeat_last_n",
                SamplingParams {
                    repeat_last_n: -2,
                    ..d()
                },
            ),
            (
                "presence_penalty",
                SamplingParams {
                    presence_penalty: f32::INFINITY,
                    ..d()
                },
            ),
            (
                "frequency_penalty",
                SamplingParams {
                    frequency_penalty: f32::NAN,
                    ..d()
                },
            ),
        ];
        for (name, params) in cases {
            let err = Sampler::new(params.clone(), 10).unwrap_err();
            assert!(
                matches!(&err, SamplingError::InvalidParam { name: n, .. } if *n == name),
                "{params:?}: {err}"
            );
            assert!(err.to_string().contains(name), "{err}");
        }
        let err = Sampler::new(d(), 0).unwrap_err();
        assert!(err.to_string().contains("vocab_size"), "{err}");
        // Negative penalties and a huge top_k are allowed, as in llama.cpp.
        assert!(
            SamplingParams {
                presence_penalty: -1.0,
                frequency_penalty: -0.5,
                top_k: 1 << 30,
                ..d()
            }
            .validate()
            .is_ok()
        );
    }

    #[test]
    fn nan_and_infinite_logits() {
        let mut s = Sampler::new(plain(4), 4).unwrap();
        for _ in 0..500 {
            // NaN and -inf are never drawn.
            let id = s.sample(&[f32::NAN, 0.0, f32::NEG_INFINITY, 0.5], &[]);
            assert!(id == 1 || id == 3, "{id}");
            // +inf takes all the mass; the lowest +inf id wins.
            assert_eq!(s.sample(&[0.0, f32::INFINITY, 3.0, f32::INFINITY], &[]), 1);
        }
        // Nothing usable: try_sample says so, sample falls back to the lowest non-NaN id (or 0).
        let dead = [f32::NAN, f32::NEG_INFINITY, f32::NAN, f32::NEG_INFINITY];
        assert_eq!(s.try_sample(&dead, &[]), Err(SamplingError::NoUsableLogit));
        assert_eq!(s.sample(&dead, &[]), 1);
        assert_eq!(s.sample(&[f32::NAN; 4], &[]), 0);
        let mut g = Sampler::new(SamplingParams::greedy(), 4).unwrap();
        assert_eq!(g.try_sample(&dead, &[]), Err(SamplingError::NoUsableLogit));
        // A wrong length is an error from try_sample.
        assert_eq!(
            s.try_sample(&[0.0; 3], &[]),
            Err(SamplingError::LogitsLength { expected: 4, got: 3 })
        );
    }

    #[test]
    #[should_panic(expected = "built for 4 tokens but got 5 logits")]
    fn sample_panics_on_wrong_length() {
        Sampler::new(plain(0), 4).unwrap().sample(&[0.0; 5], &[]);
    }

    #[test]
    fn scratch_does_not_grow_while_sampling() {
        let params = SamplingParams {
            repeat_penalty: 1.1,
            repeat_last_n: -1,
            frequency_penalty: 0.1,
            top_k: 0,
            ..SamplingParams::default()
        };
        let mut s = Sampler::new(params, 1000).unwrap();
        let caps = (
            s.logits.capacity(),
            s.counts.capacity(),
            s.seen.capacity(),
            s.candidates.capacity(),
        );
        let mut logits_rng = Xoshiro256StarStar::from_seed(1);
        let history: Vec<u32> = (0..5000).map(|i| (i * 7919) % 1000).collect();
        for _ in 0..50 {
            let logits = random_logits(&mut logits_rng, 1000);
            s.sample(&logits, &history);
        }
        assert_eq!(
            caps,
            (
                s.logits.capacity(),
                s.counts.capacity(),
                s.seen.capacity(),
                s.candidates.capacity()
            )
        );
    }

    /// Feeds all pieces, returning (everything released, whether a stop matched) and checking that no released
    /// chunk ever contains a stop string.
    fn run_stop(stops: &[&str], pieces: &[&str]) -> (Vec<String>, bool) {
        let mut m = StopMatcher::new(stops.iter().copied());
        let mut out = Vec::new();
        let mut stopped = false;
        for piece in pieces {
            let step = m.feed(piece);
            out.push(step.text.to_string());
            stopped = step.stopped;
        }
        out.push(m.finish().to_string());
        (out, stopped)
    }

    #[test]
    fn stop_string_split_over_three_pieces() {
        let (out, stopped) = run_stop(&["</end>"], &["Hello <", "/en", "d> ignored", " also ignored"]);
        assert!(stopped);
        assert_eq!(out, ["Hello ", "", "", "", ""]);
    }

    #[test]
    fn partial_match_that_fails_is_released() {
        let (out, stopped) = run_stop(&["</end>"], &["a <", "/e", "x", "t"]);
        assert!(!stopped);
        assert_eq!(out, ["a ", "", "</ex", "t", ""]);
        // A held-back tail is released by finish when generation ends another way.
        let (out, _) = run_stop(&["</end>"], &["a </en"]);
        assert_eq!(out, ["a ", "</en"]);
        // A failed partial that is itself followed by a real start keeps holding the new start only.
        let (out, stopped) = run_stop(&["ab"], &["xa", "a", "b"]);
        assert_eq!(
            (out, stopped),
            (vec!["x".into(), "a".into(), "".into(), "".into()], true)
        );
    }

    #[test]
    fn stop_matcher_edge_cases() {
        // The stop string inside one piece, with text on both sides.
        assert_eq!(
            run_stop(&["STOP"], &["abcSTOPdef"]),
            (vec!["abc".into(), "".into()], true)
        );
        // The earliest of several stop strings wins.
        assert_eq!(run_stop(&["cd", "b"], &["abcd"]), (vec!["a".into(), "".into()], true));
        // Holding back uses the longest stop string that could still match.
        assert_eq!(
            run_stop(&["x", "<|im_end|>"], &["hi <|im", "_end|>"]),
            (vec!["hi ".into(), "".into(), "".into()], true)
        );
        // Multi-byte text: never split inside a character.
        assert_eq!(
            run_stop(&["é!"], &["café", "!", "?"]),
            (vec!["caf".into(), "".into(), "".into(), "".into()], true)
        );
        assert_eq!(
            run_stop(&["é!"], &["café", "?"]),
            (vec!["caf".into(), "é?".into(), "".into()], false)
        );
        // No stop strings (or only empty ones): pass-through.
        assert_eq!(
            run_stop(&[""], &["a", "b"]),
            (vec!["a".into(), "b".into(), "".into()], false)
        );
        // Feeding after a stop returns nothing; finish makes the matcher reusable.
        let mut m = StopMatcher::new(["\n\n"]);
        assert_eq!(
            m.feed("one\n\ntwo"),
            StopStep {
                text: "one",
                stopped: true
            }
        );
        assert_eq!(
            m.feed("more"),
            StopStep {
                text: "",
                stopped: true
            }
        );
        assert!(m.is_stopped());
        assert_eq!(m.finish(), "");
        assert!(!m.is_stopped());
        assert_eq!(
            m.feed("again\n"),
            StopStep {
                text: "again",
                stopped: false
            }
        );
        assert_eq!(m.finish(), "\n");
    }
}
