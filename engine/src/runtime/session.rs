//! A session: one sequence over a loaded model and a backend it shares with other sessions: its KV cache (its
//! slot), scratch buffers, chunked prefill, decode steps and prefix reuse across consecutive requests. It is also
//! the step driver: it decides each step's [`StepKey`] and whether a backend replays a recorded step (the forward
//! pass knows nothing of graphs).
//!
//! Prefix reuse: a new prompt keeps the cached cells of the longest common token prefix with what the cache
//! holds and computes only the rest ("R reused + X read"). At least the last prompt token is always read, so
//! the session has its logits.

use std::time::Instant;

use crate::backend::{ATTN_SPAN_BLOCK, Backend, StepKey, TopLogits};
use crate::device::fault::{FaultPlan, GemmFault};
use crate::model::{Logits, Model, Scratch, TRACE_TENSORS};
use crate::state::batch::BatchLayout;
use crate::state::kv::{KvCache, KvError, KvPool, KvType};
use std::sync::Arc;

pub use crate::memory::{AUTO_PREFILL_CHUNK, DEFAULT_MAX_CONTEXT, context_cells, parse_prefill_chunk};

/// Why a session step failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SessionError {
    #[error(
        "the request needs {needed} tokens of context but the context holds {n_ctx} (--max-context); shorten the prompt or raise --max-context"
    )]
    ContextOverflow { needed: usize, n_ctx: usize },
    #[error("the prompt is empty: at least one token is needed")]
    EmptyPrompt,
    #[error("token id {id} is outside the model's vocabulary of {vocab}")]
    BadToken { id: u32, vocab: usize },
    #[error(transparent)]
    Kv(#[from] KvError),
    /// The KV pool cannot hold this sequence even with every other sequence's blocks given back (a pool smaller
    /// than a context; `strata serve` refuses such a `--kv-tokens` at start).
    #[error(
        "the KV cache pool holds {capacity} tokens (--kv-tokens) and this sequence needs {needed}: raise --kv-tokens"
    )]
    KvPool { needed: usize, capacity: usize },
    /// A prefill GEMM failed (injected by `STRATA_FAULT`) and the GEMM fallback is off: the original engine
    /// died here, so the worker treats it as fatal.
    #[error("prefill gemm failed: {0}")]
    GemmFault(GemmFault),
}

/// Session settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SessionConfig {
    /// Largest context, in tokens; capped by the model's `context_length`.
    pub max_context: usize,
    pub kv: KvType,
    /// Tokens per prefill chunk; `None`: [`AUTO_PREFILL_CHUNK`].
    pub prefill_chunk: Option<usize>,
}

impl Default for SessionConfig {
    fn default() -> Self {
        SessionConfig {
            max_context: DEFAULT_MAX_CONTEXT,
            kv: KvType::F16,
            prefill_chunk: None,
        }
    }
}

/// What a prefill did.
#[derive(Debug, Clone, PartialEq)]
pub struct PrefillStats {
    pub prompt_tokens: usize,
    /// Tokens whose cache cells were kept from the previous request.
    pub reused: usize,
    /// Tokens computed.
    pub read: usize,
    pub ms: f64,
    /// Set on the one prefill whose GEMM failed and switched the session to its own kernel path for good
    /// (batches of at most `limit` rows): the caller reports it once, as a `fallback` event.
    pub gemm_fallback: Option<GemmFault>,
    /// The prefill stopped between two chunks because it was cancelled ([`Session::prefill_cancellable`]): the
    /// cache holds the prompt's first `reused + read` tokens, and no logits were computed.
    pub cancelled: bool,
}

/// One step's output for the sampler: the last token's logits, or the best of them as the backend selected them
/// ([`Session::decode_top`]).
#[derive(Debug, Clone, Copy)]
pub enum StepLogits<'a> {
    /// `vocab` values.
    Full(&'a [f32]),
    /// The best [`crate::runtime::sampling::TOP_LOGITS`] candidates.
    Top(&'a TopLogits),
}

/// The key of a step of `n` tokens at positions `pos0..`: the sequence's slot, and a shape made of the tokens, the
/// logits wanted and the attention span in blocks of [`ATTN_SPAN_BLOCK`] cells (what a step's launches depend on).
fn step_key(slot: crate::state::kv::SeqSlot, pos0: usize, n: usize, want: Logits) -> StepKey {
    let span = (pos0 + n).div_ceil(ATTN_SPAN_BLOCK) as u64;
    StepKey {
        slot,
        shape: span << 32 | (n as u64) << 2 | want as u64,
    }
}

/// One sequence over a model, computed on a backend it borrows (several sessions may share one).
pub struct Session<'m, B: Backend> {
    model: &'m Model,
    backend: &'m B,
    kv: KvCache,
    scratch: Scratch<B>,
    /// The tokens whose keys and values the cache holds, in position order.
    tokens: Vec<u32>,
    chunk: usize,
    vocab: usize,
    faults: FaultPlan,
    /// Whether a failed library GEMM falls back to our own kernel path (`--gemm-fallback`).
    gemm_fallback: bool,
    /// Called after each prefill chunk with (tokens read so far, tokens to read); see
    /// [`Session::on_prefill_progress`].
    progress: Option<Box<dyn FnMut(usize, usize) + Send>>,
    /// The last step left candidates (`scratch.top`), not logits.
    top_last: bool,
    /// The layout of the current step (one run: this sequence).
    layout: BatchLayout,
}

impl<'m, B: Backend> Session<'m, B> {
    /// A session with an empty cache of `min(config.max_context, context_length)` cells, in a KV pool of its own
    /// with no limit.
    ///
    /// Errors: a zero context; an int8 cache for a head width that is not a multiple of 32.
    pub fn new(model: &'m Model, backend: &'m B, config: SessionConfig) -> Result<Session<'m, B>, SessionError> {
        let shape = model.hp.kv_shape();
        Session::new_in(
            model,
            backend,
            config,
            &KvPool::placed(&shape, None, backend.kv_on_device()),
        )
    }

    /// [`Session::new`] whose cache takes its blocks from `pool` (made for this model: an engine's sequences
    /// share one, so they share prompt prefixes and `--kv-tokens` bounds them together).
    ///
    /// Errors: as [`Session::new`].
    pub fn new_in(
        model: &'m Model,
        backend: &'m B,
        config: SessionConfig,
        pool: &Arc<KvPool>,
    ) -> Result<Session<'m, B>, SessionError> {
        let n_ctx = context_cells(config.max_context, model.hp.n_ctx_train);
        let kv = KvCache::new_in(&model.hp.kv_shape(), n_ctx, config.kv, pool)?;
        Ok(Session {
            model,
            backend,
            kv,
            scratch: Scratch::default(),
            tokens: Vec::new(),
            chunk: config.prefill_chunk.unwrap_or(AUTO_PREFILL_CHUNK).max(1),
            vocab: model.weights.output.rows,
            faults: FaultPlan::default(),
            gemm_fallback: true,
            progress: None,
            top_last: false,
            layout: BatchLayout::default(),
        })
    }

    /// Calls `f(read, total)` after every prefill chunk but the last, `read` of the `total` prompt tokens not
    /// reused from the cache having been computed. `strata serve`'s worker turns it into `progress` messages,
    /// which also tell its watchdog that a long prefill is alive.
    pub fn on_prefill_progress(&mut self, f: impl FnMut(usize, usize) + Send + 'static) {
        self.progress = Some(Box::new(f));
    }

    /// Sets the injected faults and whether a failed prefill GEMM falls back to our own kernel path (the
    /// default: no faults, fallback on).
    ///
    /// A backend with a fallback kernel of its own (CUDA) applies the policy itself: its library GEMM fails
    /// as the plan says, and the backend either switches to its own kernel for good (one `fallback` event) or
    /// fails the request. Otherwise (the CPU) the session caps its prefill batches.
    pub fn set_fault_policy(&mut self, faults: FaultPlan, gemm_fallback: bool) {
        if self.backend.set_fault_policy(faults.clone(), gemm_fallback) {
            self.faults = FaultPlan::default();
            self.gemm_fallback = true;
        } else {
            self.faults = faults;
            self.gemm_fallback = gemm_fallback;
        }
    }

    /// Rows of the next prefill batch out of `remaining` tokens. A batch whose library GEMM fails either
    /// switches the session to batches of at most the failing limit (fallback on; the switch is returned once)
    /// or is an error (fallback off).
    pub(crate) fn next_batch_rows(&mut self, remaining: usize) -> Result<(usize, Option<GemmFault>), SessionError> {
        let rows = remaining.min(self.chunk);
        if !self.faults.prefill_gemm_fails(rows) {
            return Ok((rows, None));
        }
        let limit = self.faults.prefill_gemm_max_rows.unwrap_or(1);
        let n_embd = self.model.hp.n_embd as usize;
        let fault = GemmFault {
            m: rows,
            k: n_embd,
            n: (self.model.hp.n_head * self.model.hp.head_dim) as usize,
            limit,
            vendor_error: self.faults.prefill_gemm_error.clone(),
        };
        if !self.gemm_fallback {
            return Err(SessionError::GemmFault(fault));
        }
        self.chunk = self.chunk.min(limit);
        Ok((remaining.min(self.chunk), Some(fault)))
    }

    /// Caps the prefill batches at `rows` (another sequence of the same engine switched to the GEMM fallback:
    /// the switch holds for the engine, [`Session::next_batch_rows`] reports it once).
    pub(crate) fn cap_prefill_rows(&mut self, rows: usize) {
        self.chunk = self.chunk.min(rows.max(1));
    }

    /// The backend the session computes on.
    pub fn backend(&self) -> &'m B {
        self.backend
    }

    pub fn model(&self) -> &'m Model {
        self.model
    }

    /// Cells in the cache: the longest sequence, in tokens.
    pub fn n_ctx(&self) -> usize {
        self.kv.n_ctx()
    }

    pub fn kv(&self) -> &KvCache {
        &self.kv
    }

    /// Tokens currently cached, in order.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// Forgets the cached tokens and gives their KV blocks back to the pool.
    pub fn clear(&mut self) {
        self.tokens.clear();
        self.kv.truncate(0);
    }

    /// One forward step of `tokens` at the next positions (the caller checked them): the step driver. A step
    /// that wants logits is first offered to the backend as a replay of a recorded step of the same key; otherwise
    /// the forward pass runs, bracketed by [`Backend::step_begin`] / [`Backend::step_end`] so the backend may
    /// record it. Tensor tracing (`STRATA_TRACE_TENSORS`) reads tensors mid-step, so it records nothing.
    fn run_step(&mut self, tokens: &[u32], want: Logits) -> &[f32] {
        let (be, n, pos0) = (self.backend, tokens.len(), self.tokens.len());
        let key = step_key(self.kv.slot(), pos0, n, want);
        // Tensor tracing and --dump-routing read data back mid-step: such steps are never graphs.
        let graphable = !*TRACE_TENSORS && !self.model.dumps_routing();
        self.layout.clear();
        self.layout.push(0, pos0, n);
        let layout = &self.layout;
        if graphable && want != Logits::None {
            // A replayed step stores its keys and values with no forward pass on the host: its cells first.
            be.reserve_kv(&self.kv, pos0, pos0 + n);
            if be.replay_step(key, tokens, layout.positions()) {
                return self
                    .model
                    .read_logits(be, &mut self.scratch, want, layout, want == Logits::Top);
            }
        }
        if graphable {
            be.step_begin(n, key);
        }
        let out = self
            .model
            .forward(be, tokens, layout, &mut [&mut self.kv], &mut self.scratch, want);
        if graphable {
            be.step_end();
        }
        // A forward pass cancelled between layers computed no logits to read.
        let want = if crate::backend::progress::aborted() {
            Logits::None
        } else {
            want
        };
        self.model.read_logits(be, &mut self.scratch, want, layout, out.topped)
    }

    fn check_tokens(&self, ids: &[u32]) -> Result<(), SessionError> {
        let vocab = self.model.weights.token_embd.rows;
        match ids.iter().find(|&&id| id as usize >= vocab) {
            Some(&id) => Err(SessionError::BadToken { id, vocab }),
            None => Ok(()),
        }
    }

    /// Makes the cache hold `prompt`, reusing the longest common prefix with what it holds, and leaves the
    /// last prompt token's logits in [`Session::logits`].
    ///
    /// Errors: an empty prompt; a prompt longer than the context (never truncated); an id outside the
    /// vocabulary.
    pub fn prefill(&mut self, prompt: &[u32]) -> Result<PrefillStats, SessionError> {
        self.prefill_cancellable(prompt, &std::sync::atomic::AtomicBool::new(false))
    }

    /// [`Session::prefill`] that stops once `cancel` is set (`strata serve` sets it when the client leaves):
    /// before its next chunk, and on the CPU also between two layers of the running chunk (which is then dropped
    /// whole); what was computed stays cached for a request with the same prefix ([`PrefillStats::cancelled`]).
    ///
    /// Errors: as [`Session::prefill`].
    pub fn prefill_cancellable(
        &mut self,
        prompt: &[u32],
        cancel: &std::sync::atomic::AtomicBool,
    ) -> Result<PrefillStats, SessionError> {
        let start = Instant::now();
        let reused = self.begin_prompt(prompt)?;
        let rest = &prompt[reused..];
        let mut gemm_fallback = None;
        let mut done = 0;
        let mut cancelled = false;
        let _scope = self.cancel_scope(cancel);
        crate::backend::progress::take_aborted();
        while done < rest.len() {
            if done > 0 && cancel.load(std::sync::atomic::Ordering::Relaxed) {
                cancelled = true;
                break;
            }
            let (rows, switched) = self.next_batch_rows(rest.len() - done)?;
            gemm_fallback = gemm_fallback.or(switched);
            let chunk = &rest[done..done + rows];
            done += rows;
            let want = if done == rest.len() { Logits::Last } else { Logits::None };
            if !self.step_alone(chunk, want) {
                done -= rows;
                cancelled = true;
                break;
            }
            if done < rest.len()
                && let Some(f) = self.progress.as_mut()
            {
                f(done, rest.len());
            }
        }
        Ok(PrefillStats {
            prompt_tokens: prompt.len(),
            reused,
            read: done,
            ms: start.elapsed().as_secs_f64() * 1e3,
            gemm_fallback,
            cancelled,
        })
    }

    /// Starts a prompt: checks it, keeps the cached cells of its longest common prefix with what the cache holds
    /// (at most all but its last token, so its last token's logits are computed) and forgets the rest. Returns the
    /// tokens kept; the caller computes `prompt[kept..]`.
    ///
    /// Errors: an empty prompt; a prompt longer than the context; an id outside the vocabulary.
    pub(crate) fn begin_prompt(&mut self, prompt: &[u32]) -> Result<usize, SessionError> {
        if prompt.is_empty() {
            return Err(SessionError::EmptyPrompt);
        }
        if prompt.len() > self.n_ctx() {
            return Err(SessionError::ContextOverflow {
                needed: prompt.len(),
                n_ctx: self.n_ctx(),
            });
        }
        self.check_tokens(prompt)?;
        self.top_last = false;
        let reused = self.common_prefix(prompt).min(prompt.len() - 1);
        self.tokens.truncate(reused);
        self.kv.truncate(reused);
        Ok(reused)
    }

    /// Arms `cancel` for this thread's forward passes where a prompt chunk stops between layers: on the CPU, where a
    /// chunk can take seconds, its forward pass stops between layers and the chunk is dropped whole (its cells past
    /// the cached tokens are rewritten by the next prefill). A GPU's chunk is queued in milliseconds, and its steps
    /// may be captured in graphs: it stops between chunks only (`None`).
    pub(crate) fn cancel_scope<'c>(
        &self,
        cancel: &'c std::sync::atomic::AtomicBool,
    ) -> Option<crate::backend::progress::CancelScope<'c>> {
        (self.backend.name() == "cpu").then(|| crate::backend::progress::cancel_scope(cancel))
    }

    /// Takes the first `n` tokens of `other`'s cache as this sequence's own (a prompt prefix the other sequence
    /// computed: `strata serve`'s slots share a system prompt or earlier turns), when the two caches share a KV
    /// pool ([`KvCache::share_prefix_from`]: the blocks are shared, on the host or on a device); this sequence then
    /// holds exactly those `n` tokens. Returns whether it did; `false` leaves it as it was.
    ///
    /// Panics if `other` holds fewer than `n` tokens.
    pub fn adopt_prefix(&mut self, other: &Session<'m, B>, n: usize) -> bool {
        assert!(
            n <= other.tokens.len(),
            "adopt_prefix: {n} of {} tokens",
            other.tokens.len()
        );
        if n > self.n_ctx() || other.kv.ty() != self.kv.ty() || !Arc::ptr_eq(other.kv.pool(), self.kv.pool()) {
            return false;
        }
        self.kv.share_prefix_from(&other.kv, n);
        self.tokens.clear();
        self.tokens.extend_from_slice(&other.tokens[..n]);
        true
    }

    /// Tokens of `prompt` the cache holds already: the longest common prefix.
    pub fn common_prefix(&self, prompt: &[u32]) -> usize {
        self.tokens.iter().zip(prompt).take_while(|(a, b)| a == b).count()
    }

    /// One step of this sequence alone: `tokens` (checked by the caller, with room in the cache) at the next
    /// positions, leaving `want`'s output for [`Session::step_logits`]. Returns false when the step was cancelled
    /// between layers (`backend::progress`): nothing was appended and no logits were computed.
    pub(crate) fn step_alone(&mut self, tokens: &[u32], want: Logits) -> bool {
        let full = self.run_step(tokens, want).is_empty();
        if crate::backend::progress::take_aborted() {
            // The chunk's cells written before the stop are dropped with it.
            self.kv.truncate(self.tokens.len());
            return false;
        }
        self.top_last = want == Logits::Top && full;
        self.tokens.extend_from_slice(tokens);
        true
    }

    /// Appends `token` and computes its logits ([`Session::logits`]).
    ///
    /// Errors: the context is full; an id outside the vocabulary.
    pub fn decode(&mut self, token: u32) -> Result<&[f32], SessionError> {
        self.step(token, Logits::Last)?;
        Ok(self.logits())
    }

    /// [`Session::decode`] that asks the backend for the best candidates only ([`Logits::Top`]): a GPU selects
    /// them on the device and returns 64 of them instead of the vocabulary; a backend that does not select
    /// returns the logits. Either way, the step's output is [`Session::step_logits`].
    ///
    /// Errors: as [`Session::decode`].
    pub fn decode_top(&mut self, token: u32) -> Result<StepLogits<'_>, SessionError> {
        self.step(token, Logits::Top)?;
        Ok(self.step_logits())
    }

    /// One decode step of `token` with the output `want` asks for; records whether only candidates came back.
    fn step(&mut self, token: u32, want: Logits) -> Result<(), SessionError> {
        self.check_room(token)?;
        self.step_alone(&[token], want);
        Ok(())
    }

    /// Whether `token` may be decoded next: the cache has a cell for it and it is in the vocabulary.
    ///
    /// Errors: [`SessionError::ContextOverflow`], [`SessionError::BadToken`].
    fn check_room(&self, token: u32) -> Result<(), SessionError> {
        if self.tokens.len() >= self.n_ctx() {
            return Err(SessionError::ContextOverflow {
                needed: self.tokens.len() + 1,
                n_ctx: self.n_ctx(),
            });
        }
        self.check_tokens(&[token])
    }

    /// The last step's output: its candidates after a [`Session::decode_top`] the backend selected for, else the
    /// last token's logits.
    pub fn step_logits(&self) -> StepLogits<'_> {
        if self.top_last {
            StepLogits::Top(&self.scratch.top)
        } else {
            StepLogits::Full(self.logits())
        }
    }

    /// The logits of the last token computed (`vocab` values).
    ///
    /// # Panics
    /// After a [`Session::decode_top`] whose candidates the backend selected (no logits came back: read
    /// [`Session::step_logits`]).
    pub fn logits(&self) -> &[f32] {
        assert!(
            !self.top_last,
            "Session::logits after a decode_top step: read step_logits"
        );
        &self.scratch.logits[..self.vocab]
    }

    /// Teacher forcing: clears the cache, runs `tokens` in prefill chunks and returns every position's
    /// logits, `[tokens.len()][vocab]` (position t predicts token t + 1).
    ///
    /// Errors: as [`Session::prefill`].
    pub fn logits_all(&mut self, tokens: &[u32]) -> Result<Vec<f32>, SessionError> {
        if tokens.is_empty() {
            return Err(SessionError::EmptyPrompt);
        }
        if tokens.len() > self.n_ctx() {
            return Err(SessionError::ContextOverflow {
                needed: tokens.len(),
                n_ctx: self.n_ctx(),
            });
        }
        self.check_tokens(tokens)?;
        self.clear();
        self.top_last = false;
        let mut out = Vec::with_capacity(tokens.len() * self.vocab);
        for chunk in tokens.chunks(self.chunk) {
            let lg = self.run_step(chunk, Logits::All);
            out.extend_from_slice(lg);
            self.tokens.extend_from_slice(chunk);
        }
        Ok(out)
    }
}

/// What a step of several sequences left for sampling: each sequence's last-token logits, or the candidates the
/// backend selected for each ([`Logits::Top`]).
pub(crate) enum StepRows<'s> {
    Full { logits: &'s [f32], vocab: usize },
    Top(&'s [TopLogits]),
}

impl<'s> StepRows<'s> {
    /// Sequence `k`'s output, in the parts' order.
    pub(crate) fn row(&self, k: usize) -> StepLogits<'s> {
        match *self {
            StepRows::Full { logits, vocab } => StepLogits::Full(&logits[k * vocab..(k + 1) * vocab]),
            StepRows::Top(t) => StepLogits::Top(&t[k]),
        }
    }
}

/// One forward step of several sequences together (continuous batching): `parts[i].1` are the tokens of
/// sequence `parts[i].0` at its next positions (a decode token, or a prefill chunk; checked by the caller, with
/// room in each cache). Every sequence's tokens are appended to it, and the last token of each part gets
/// `want`'s output ([`Logits::Last`], or [`Logits::Top`]: the backend's candidates where it selects them), in
/// `parts`' order. `scratch` holds the step's activations (one for every batched step). A step of several
/// sequences is never recorded as a CUDA graph (a graph belongs to one sequence's buffers).
///
/// Panics if `parts` is empty or names a sequence twice.
pub(crate) fn step_together<'s, 'm, B: Backend>(
    parts: &mut [(&mut Session<'m, B>, &[u32])],
    scratch: &'s mut Scratch<B>,
    want: Logits,
) -> StepRows<'s> {
    assert!(!parts.is_empty(), "step_together: no sequence");
    let (model, be) = (parts[0].0.model, parts[0].0.backend);
    let mut layout = BatchLayout::default();
    let mut tokens = Vec::new();
    for (i, (s, t)) in parts.iter().enumerate() {
        layout.push(i, s.tokens.len(), t.len());
        tokens.extend_from_slice(t);
    }
    let mut kvs: Vec<&mut KvCache> = Vec::with_capacity(parts.len());
    for (s, _) in parts.iter_mut() {
        s.top_last = false;
        kvs.push(&mut s.kv);
    }
    // --dump-routing reads the router's choices mid-step: such a step decides its experts on the host (as a
    // single sequence's, which is then not a graph).
    let bracket = !model.dumps_routing();
    if bracket {
        be.batch_step_begin(tokens.len(), layout.runs().len());
    }
    let out = model.forward(be, &tokens, &layout, &mut kvs, scratch, want);
    if bracket {
        be.batch_step_end();
    }
    drop(kvs);
    for (s, t) in parts.iter_mut() {
        s.tokens.extend_from_slice(t);
    }
    let vocab = model.weights.output.rows;
    if model.read_logits(be, scratch, want, &layout, out.topped).is_empty() && out.topped {
        return StepRows::Top(&scratch.tops[..parts.len()]);
    }
    StepRows::Full {
        logits: &scratch.logits[..parts.len() * vocab],
        vocab,
    }
}

/// One decode step of several sequences together, as a step of `strata serve`'s batches computes it (`strata bench
/// --sequences`): sequence `i` of `sessions` reads `tokens[i]` at its next position, and `each(i, output)` gets its
/// next-token output (the backend's candidates where it selects them, [`Logits::Top`]). One sequence takes the
/// single-sequence path ([`Session::decode_top`]), as the scheduler does.
///
/// Errors: a sequence's cache is full or its token is outside the vocabulary; nothing is computed then.
///
/// Panics if `sessions` is empty or `tokens` is not one token per sequence.
pub fn decode_together<B: Backend>(
    sessions: &mut [Session<'_, B>],
    tokens: &[u32],
    scratch: &mut Scratch<B>,
    mut each: impl FnMut(usize, StepLogits<'_>),
) -> Result<(), SessionError> {
    assert!(
        !sessions.is_empty() && tokens.len() == sessions.len(),
        "decode_together: one token per sequence"
    );
    for (s, &t) in sessions.iter().zip(tokens) {
        s.check_room(t)?;
    }
    if let [one] = sessions {
        each(0, one.decode_top(tokens[0])?);
        return Ok(());
    }
    let mut parts: Vec<(&mut Session<'_, B>, &[u32])> = sessions.iter_mut().zip(tokens.chunks(1)).collect();
    let rows = step_together(&mut parts, scratch, Logits::Top);
    for i in 0..tokens.len() {
        each(i, rows.row(i));
    }
    Ok(())
}

impl<B: Backend> Drop for Session<'_, B> {
    /// The sequence ends: the backend forgets what it kept for its slot.
    fn drop(&mut self) {
        self.backend.release_slot(self.kv.slot());
    }
}
