//! Generation: prefill a prompt, then decode token by token until end-of-generation, a stop string or the
//! token limit, streaming text as it is produced.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use crate::backend::Backend;
use crate::runtime::sampling::{Sampler, StopMatcher, TokenLogprob, logprobs};
use crate::runtime::session::{PrefillStats, Session, SessionError, StepLogits};
use crate::tokenizer::{Tokenizer, TokenizerError};

/// Why generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StopReason {
    /// An end-of-generation token (EOS, EOT...), not printed.
    Eog,
    /// A stop string matched; it and what follows are not printed.
    StopString,
    /// `max_tokens` reached.
    Limit,
    /// The context is full.
    Context,
    /// The caller's cancel flag was set (a client went away); checked once per token.
    Cancelled,
}

/// Counts and timings of one request (the summary line's numbers).
#[derive(Debug, Clone, PartialEq)]
pub struct GenerateStats {
    pub prefill: PrefillStats,
    /// Tokens sampled (including a final end-of-generation token).
    pub generated: usize,
    pub decode_ms: f64,
    pub stop: StopReason,
    /// The generated token ids ([`generate`] returns them too).
    pub tokens: Vec<u32>,
    /// With [`GenerateOptions::logits_digest`]: [`logits_digest`] of each sampled token's logits, in order.
    pub logits_digests: Vec<u64>,
    /// Milliseconds waited for a slot of the batch scheduler (0 through [`generate`]).
    pub queued_ms: f64,
    /// Sequences per forward step over this request's steps (1 through [`generate`]).
    pub batch_mean: f64,
    /// The stop string that ended the generation ([`StopReason::StopString`]), as the request gave it.
    pub stop_word: Option<String>,
    /// Times the batch scheduler preempted the request for KV blocks (its cells were dropped and computed again
    /// later; 0 through [`generate`]).
    pub preempted: u32,
    /// Tokens computed again after those preemptions (prompt and generated tokens).
    pub recomputed: usize,
}

impl StopReason {
    /// The reason's name in events and the worker protocol (`eog`, `stop_string`, `limit`, `context`,
    /// `cancelled`).
    pub fn name(self) -> &'static str {
        match self {
            StopReason::Eog => "eog",
            StopReason::StopString => "stop_string",
            StopReason::Limit => "limit",
            StopReason::Context => "context",
            StopReason::Cancelled => "cancelled",
        }
    }
}

impl GenerateStats {
    /// The `request` event of these numbers, for request `id`.
    pub fn request_event(&self, id: u64) -> crate::events::Request {
        let p = &self.prefill;
        crate::events::Request {
            id,
            prompt_tokens: p.prompt_tokens,
            reused: p.reused,
            read: p.read,
            prefill_ms: p.ms,
            generated: self.generated,
            decode_ms: self.decode_ms,
            stop: self.stop.name().to_string(),
            tokens: self.tokens.clone(),
            logits_fnv: self.logits_digests.iter().map(|d| format!("{d:016x}")).collect(),
            queued_ms: self.queued_ms,
            batch_mean: self.batch_mean,
            preempted: self.preempted,
            recomputed: self.recomputed,
        }
    }

    /// The summary in the seeds' style, without the `strata:` prefix (the `request` event's human line):
    /// `prompt 53 tokens = 0 reused + 53 read in 634 ms (83.6 tok/s), 47 generated in 775 ms (60.6 tok/s)`.
    pub fn summary(&self) -> String {
        self.request_event(0).to_string()
    }
}

#[derive(Debug, thiserror::Error)]
pub enum GenerateError {
    #[error(transparent)]
    Session(#[from] SessionError),
    #[error(transparent)]
    Tokenizer(#[from] TokenizerError),
}

/// Picks the next token from a step's logits (or the backend's best candidates) and the token history.
pub trait TokenSampler {
    /// The next token. `logits` is [`StepLogits::Top`] only when [`TokenSampler::top_suffices`] said so.
    fn next_token(&mut self, logits: StepLogits<'_>, history: &[u32]) -> u32;

    /// Whether the best [`crate::runtime::sampling::TOP_LOGITS`] candidates decide this sampler's token exactly
    /// as the whole logits would: decode steps then ask the backend for those only ([`Session::decode_top`]).
    fn top_suffices(&self) -> bool {
        false
    }

    /// The logits the last [`TokenSampler::next_token`] drew from after its own adjustments (the penalties), for
    /// log-probabilities; `None`: the logits it was given.
    fn adjusted_logits(&self) -> Option<&[f32]> {
        None
    }
}

impl TokenSampler for Sampler {
    fn next_token(&mut self, logits: StepLogits<'_>, history: &[u32]) -> u32 {
        match logits {
            StepLogits::Full(l) => self.sample(l, history),
            StepLogits::Top(t) => self.sample_top(t),
        }
    }

    fn top_suffices(&self) -> bool {
        self.can_use_top()
    }

    fn adjusted_logits(&self) -> Option<&[f32]> {
        Some(self.penalised_logits())
    }
}

/// Argmax, ties to the lowest id.
#[derive(Debug, Default, Clone, Copy)]
pub struct Greedy;

impl TokenSampler for Greedy {
    fn next_token(&mut self, logits: StepLogits<'_>, _history: &[u32]) -> u32 {
        match logits {
            StepLogits::Full(l) => argmax(l),
            StepLogits::Top(t) => t.argmax().unwrap_or(0),
        }
    }

    fn top_suffices(&self) -> bool {
        true
    }
}

/// Index of the largest value, the lowest index among ties (NaN never wins).
pub fn argmax(x: &[f32]) -> u32 {
    let mut best: Option<usize> = None;
    for (i, &v) in x.iter().enumerate() {
        if !v.is_nan() && best.is_none_or(|b| v > x[b]) {
            best = Some(i);
        }
    }
    best.unwrap_or(0) as u32
}

/// Generation settings.
#[derive(Debug, Clone, Default)]
pub struct GenerateOptions {
    pub max_tokens: usize,
    pub stop: Vec<String>,
    /// Digest every sampled token's logits ([`GenerateStats::logits_digests`]; `STRATA_LOGITS_DIGEST`): decode
    /// steps then read whole logits back ([`Session::decode`]), never only the best candidates.
    pub logits_digest: bool,
    /// Report each sampled token's log-probability and this many alternatives
    /// ([`crate::runtime::sampling::logprobs`]); decode steps then read whole logits back.
    pub logprobs: Option<usize>,
}

impl GenerateOptions {
    /// Whether a decode step may return the backend's best candidates only ([`Session::decode_top`]) for
    /// `sampler`: it needs no more, and no logits digest is asked for.
    pub fn wants_top(&self, sampler: &dyn TokenSampler) -> bool {
        sampler.top_suffices() && !self.logits_digest && self.logprobs.is_none()
    }

    /// `max_tokens` and `stop`, with [`GenerateOptions::logits_digest`] as `STRATA_LOGITS_DIGEST` says.
    pub fn new(max_tokens: usize, stop: Vec<String>) -> GenerateOptions {
        GenerateOptions {
            max_tokens,
            stop,
            logits_digest: crate::switches::flag(crate::switches::LOGITS_DIGEST, false),
            logprobs: None,
        }
    }
}

/// FNV-1a (64 bits) of `logits`' f32 values as little-endian bytes: equal for bit-identical logits, so two runs'
/// steps can be compared without keeping `vocab` floats per token.
pub fn logits_digest(logits: &[f32]) -> u64 {
    use std::hash::Hasher;
    let mut h = fnv::FnvHasher::default();
    for v in logits {
        h.write(&v.to_le_bytes());
    }
    h.finish()
}

/// What [`Decoding::advance`] decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Next {
    /// Generation goes on: compute this token's logits next.
    Feed(u32),
    /// Generation ended (the last token sampled is in [`Decoding::finish`]'s ids already).
    Stopped(StopReason),
}

/// The decode half of one generation, one sampled token at a time: sampling, detokenizing into whole UTF-8
/// characters, stop strings, the token limit and the context limit. [`generate`] drives it for one sequence; the
/// batch scheduler ([`crate::runtime::batch`]) drives one per sequence of a batch, so a sequence produces the same
/// text whichever way it is computed.
pub struct Decoding {
    history: Vec<u32>,
    out: Vec<u32>,
    /// Bytes of a UTF-8 character cut between tokens, held until it is whole.
    bytes: Vec<u8>,
    stops: StopMatcher,
    max_tokens: usize,
    digest: bool,
    digests: Vec<u64>,
    /// [`GenerateOptions::logprobs`].
    logprobs: Option<usize>,
    /// Log-probabilities of the tokens whose text has not been printed yet.
    pending: Vec<TokenLogprob>,
}

/// What [`Decoding`] prints: a piece of text (whole UTF-8 characters, stop strings held back) and, with
/// [`GenerateOptions::logprobs`], the log-probabilities of the tokens whose text it completes.
pub type OnPiece<'a> = dyn FnMut(&str, Vec<TokenLogprob>) + 'a;

impl Decoding {
    /// A generation after `prompt` with `opts`' limits and stop strings.
    pub fn new(prompt: &[u32], opts: &GenerateOptions) -> Decoding {
        Decoding {
            history: prompt.to_vec(),
            out: Vec::new(),
            bytes: Vec::new(),
            stops: StopMatcher::new(opts.stop.iter().cloned()),
            max_tokens: opts.max_tokens,
            digest: opts.logits_digest,
            digests: Vec::new(),
            logprobs: opts.logprobs,
            pending: Vec::new(),
        }
    }

    /// Tokens sampled so far.
    pub fn generated(&self) -> usize {
        self.out.len()
    }

    /// Samples the next token from the step's `logits` and prints what it completes through `on_text`
    /// ([`Decoding::sample`], then [`Decoding::accept`]), and says whether generation goes on. `room`: the context
    /// has a cell for the sampled token (else the generation ends with [`StopReason::Context`] once the token is
    /// printed).
    ///
    /// Errors: the token cannot be detokenized.
    pub fn advance(
        &mut self,
        logits: StepLogits<'_>,
        sampler: &mut dyn TokenSampler,
        tokenizer: &Tokenizer,
        room: bool,
        on_text: &mut OnPiece<'_>,
    ) -> Result<Next, TokenizerError> {
        let tok = self.sample(logits, sampler);
        self.accept(tok, tokenizer, room, on_text)
    }

    /// Samples the next token from the step's `logits` (`None` once `max_tokens` are out: nothing is sampled).
    /// Touches nothing shared, so the sequences of a batch sample in parallel.
    pub fn sample(&mut self, logits: StepLogits<'_>, sampler: &mut dyn TokenSampler) -> Option<u32> {
        if self.out.len() >= self.max_tokens {
            return None;
        }
        if self.digest
            && let StepLogits::Full(l) = logits
        {
            self.digests.push(logits_digest(l));
        }
        let tok = sampler.next_token(logits, &self.history);
        if let (Some(n), StepLogits::Full(l)) = (self.logprobs, logits) {
            let basis = sampler.adjusted_logits().filter(|a| a.len() == l.len()).unwrap_or(l);
            self.pending.push(logprobs(basis, tok, n));
        }
        self.out.push(tok);
        self.history.push(tok);
        Some(tok)
    }

    /// Takes the token [`Decoding::sample`] gave: prints what it completes through `on_text` and says whether
    /// generation goes on (see [`Decoding::advance`]).
    ///
    /// Errors: the token cannot be detokenized.
    pub fn accept(
        &mut self,
        tok: Option<u32>,
        tokenizer: &Tokenizer,
        room: bool,
        on_text: &mut OnPiece<'_>,
    ) -> Result<Next, TokenizerError> {
        let Some(tok) = tok else {
            return Ok(Next::Stopped(StopReason::Limit));
        };
        if tokenizer.is_eog(tok) {
            // An end-of-generation token is not part of the answer (OpenAI reports none for it).
            self.pending.pop_if(|lp| lp.id == tok);
            return Ok(Next::Stopped(StopReason::Eog));
        }
        self.bytes.extend_from_slice(&tokenizer.decode_bytes(&[tok], true)?);
        let valid = match std::str::from_utf8(&self.bytes) {
            Ok(s) => s.len(),
            Err(e) if e.error_len().is_none() => e.valid_up_to(),
            // Invalid bytes (not a cut character) are printed lossily now.
            Err(_) => self.bytes.len(),
        };
        let piece = String::from_utf8_lossy(&self.bytes[..valid]).into_owned();
        self.bytes.drain(..valid);
        let step = self.stops.feed(&piece);
        if !step.text.is_empty() {
            on_text(step.text, std::mem::take(&mut self.pending));
        }
        Ok(if step.stopped {
            Next::Stopped(StopReason::StopString)
        } else if self.out.len() == self.max_tokens {
            Next::Stopped(StopReason::Limit)
        } else if !room {
            Next::Stopped(StopReason::Context)
        } else {
            Next::Feed(tok)
        })
    }

    /// Ends the generation for `stop`: text held back for a possible stop string is printed, unless a stop string
    /// matched or the generation was cancelled; then the log-probabilities of tokens whose text was never printed
    /// go out with empty text. The bytes of a character the last token left unfinished are
    /// dropped, never printed as U+FFFD (llama.cpp's server drops them too). Returns the sampled ids, their logits'
    /// digests ([`GenerateOptions::logits_digest`]) and the stop string that matched.
    pub fn finish(mut self, stop: StopReason, on_text: &mut OnPiece<'_>) -> Finished {
        // `accept` prints invalid bytes at once, so what is left is the start of a cut character.
        self.bytes.clear();
        let stop_word = self.stops.matched().map(str::to_string);
        if stop != StopReason::StopString && stop != StopReason::Cancelled {
            let rest = self.stops.finish();
            if !rest.is_empty() {
                on_text(rest, std::mem::take(&mut self.pending));
            }
        }
        if !self.pending.is_empty() {
            // Tokens whose text is never printed (a stop string's, a character left unfinished): their
            // log-probabilities still go out, with no text.
            on_text("", std::mem::take(&mut self.pending));
        }
        Finished {
            tokens: self.out,
            digests: self.digests,
            stop_word,
        }
    }
}

/// What a [`Decoding`] leaves when it ends.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Finished {
    /// The sampled ids, a final end-of-generation token included.
    pub tokens: Vec<u32>,
    /// [`logits_digest`] of each sampled token's logits, with [`GenerateOptions::logits_digest`].
    pub digests: Vec<u64>,
    /// The stop string that ended the generation, if one did.
    pub stop_word: Option<String>,
}

/// Prefills `prompt`, then samples up to `opts.max_tokens` tokens, calling `on_text` with each printable
/// piece of text (whole UTF-8 characters; end-of-generation tokens and stop strings are not printed).
/// Returns the generated ids (an end-of-generation token included) and the stats.
///
/// Errors: the prompt does not fit the context or is empty ([`SessionError`]); a token cannot be decoded.
pub fn generate<B: Backend>(
    session: &mut Session<'_, B>,
    tokenizer: &Tokenizer,
    prompt: &[u32],
    opts: &GenerateOptions,
    sampler: &mut dyn TokenSampler,
    on_text: &mut dyn FnMut(&str),
) -> Result<(Vec<u32>, GenerateStats), GenerateError> {
    generate_cancellable(
        session,
        tokenizer,
        prompt,
        opts,
        sampler,
        &AtomicBool::new(false),
        on_text,
    )
}

/// [`generate`] that also ends, with [`StopReason::Cancelled`], once `cancel` is set: it is read between prefill
/// chunks and before each token is sampled, so at most one more chunk or token is computed after it is set (`strata serve` sets it from another
/// thread when a client closes its stream). Text held back for a possible stop string is dropped on cancel.
///
/// Errors: as [`generate`].
pub fn generate_cancellable<B: Backend>(
    session: &mut Session<'_, B>,
    tokenizer: &Tokenizer,
    prompt: &[u32],
    opts: &GenerateOptions,
    sampler: &mut dyn TokenSampler,
    cancel: &AtomicBool,
    on_text: &mut dyn FnMut(&str),
) -> Result<(Vec<u32>, GenerateStats), GenerateError> {
    generate_pieces(session, tokenizer, prompt, opts, sampler, cancel, &mut |t, _| {
        if !t.is_empty() {
            on_text(t)
        }
    })
}

/// [`generate_cancellable`] printing through [`OnPiece`]: each piece of text with the log-probabilities of the
/// tokens it completes ([`GenerateOptions::logprobs`]).
///
/// Errors: as [`generate`].
pub fn generate_pieces<B: Backend>(
    session: &mut Session<'_, B>,
    tokenizer: &Tokenizer,
    prompt: &[u32],
    opts: &GenerateOptions,
    sampler: &mut dyn TokenSampler,
    cancel: &AtomicBool,
    on_text: &mut OnPiece<'_>,
) -> Result<(Vec<u32>, GenerateStats), GenerateError> {
    let prefill = session.prefill_cancellable(prompt, cancel)?;
    let start = Instant::now();
    if prefill.cancelled {
        return Ok((
            vec![],
            GenerateStats {
                prefill,
                generated: 0,
                decode_ms: 0.0,
                stop: StopReason::Cancelled,
                tokens: vec![],
                logits_digests: vec![],
                queued_ms: 0.0,
                batch_mean: 1.0,
                stop_word: None,
                preempted: 0,
                recomputed: 0,
            },
        ));
    }
    let mut dec = Decoding::new(prompt, opts);
    let stop = loop {
        if cancel.load(Ordering::Relaxed) {
            break StopReason::Cancelled;
        }
        let room = session.tokens().len() < session.n_ctx();
        match dec.advance(session.step_logits(), sampler, tokenizer, room, on_text)? {
            Next::Stopped(why) => break why,
            Next::Feed(tok) if opts.wants_top(sampler) => {
                session.decode_top(tok)?;
            }
            Next::Feed(tok) => {
                session.decode(tok)?;
            }
        }
    };
    let end = dec.finish(stop, on_text);
    Ok((
        end.tokens.clone(),
        GenerateStats {
            prefill,
            generated: end.tokens.len(),
            decode_ms: start.elapsed().as_secs_f64() * 1e3,
            stop,
            tokens: end.tokens,
            logits_digests: end.digests,
            queued_ms: 0.0,
            batch_mean: 1.0,
            stop_word: end.stop_word,
            preempted: 0,
            recomputed: 0,
        },
    ))
}
