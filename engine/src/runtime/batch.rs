//! Continuous batching: many sequences over one model and backend, computed together step by step (issue 20).
//!
//! The scheduler holds `parallel` slots, each a [`Session`] (a sequence with its own KV cache, kept between
//! requests for prefix reuse). A request waits until a slot is free, then takes the free slot whose cache shares
//! the longest prefix with its prompt (the least recently used among equals), as llama-server picks slots. Each
//! [`Batcher::step`] is one forward pass that carries:
//!
//! - one token of every sequence that is decoding, then
//! - prompt chunks of the sequences still in prefill, oldest first, while the step's token budget lasts (chunked
//!   prefill, vLLM's scheduling: decode tokens first, so a long prompt delays the others' next tokens by one
//!   chunk, never by its whole prefill).
//!
//! A request joins at the next step after it arrives and leaves at the step it ends (end of generation, a stop
//! string, its token limit, its context, a cancel, an error); its slot is free at once. A step of one sequence is
//! exactly the single-sequence path (`Session`: CUDA graphs, the backend's top-logits selection), so one client
//! runs as fast as before. Each sequence samples, detokenizes and checks stop strings with its own
//! [`Decoding`], as `generate` does.
//!
//! KV blocks: the slots' caches take blocks from one pool ([`crate::state::kv::KvPool`], `--kv-tokens`). Before a
//! step the scheduler counts the blocks its parts will take; when the pool lacks them it drops idle slots'
//! cached prompts (least recently used first), then preempts the newest running request (vLLM's recompute
//! preemption): its blocks go back, and it waits ahead of new requests. When it has a slot again, its prompt and
//! the tokens it generated so far are computed again as a prompt, and it goes on with the token it was about to
//! feed, its sampler and stop state as they were. A preempted request's tokens are those it would have had without
//! the preemption (tests/cpu: `preempted_sequences_give_the_tokens_and_logits_of_each_alone`; on CUDA with
//! batch-invariant kernels, cuda_parity: `paged_kv_on_the_device_shares_prefixes_and_preempts_as_alone`). The
//! blocks are host memory on the CPU and rows of the pool's arrays in VRAM on a GPU (`backend::cuda::kv`).
//!
//! Every op but attention treats a step's tokens as independent rows, and attention reads each sequence's own
//! cache ([`crate::state::batch::BatchLayout`]), so on the CPU a token's result does not depend on the batch it is
//! computed in (tests/cpu: `batched_sequences_give_the_tokens_and_logits_of_each_alone`).

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use crate::backend::Backend;
use crate::device::fault::GemmFault;
use crate::model::{Logits, Scratch};
use crate::runtime::generate::{
    Decoding, Finished, GenerateError, GenerateOptions, GenerateStats, Next, StopReason, TokenSampler,
};
use crate::runtime::sampling::TokenLogprob;
use crate::runtime::session::{PrefillStats, Session, SessionError, step_together};
use crate::state::kv::KV_BLOCK_CELLS;
use crate::tokenizer::Tokenizer;
use rayon::prelude::*;

/// One request for the scheduler: prompt ids, generation settings, its sampler, and a flag another thread sets
/// to cancel it (read at every step).
pub struct BatchJob {
    pub id: u64,
    pub prompt: Vec<u32>,
    pub opts: GenerateOptions,
    pub sampler: Box<dyn TokenSampler + Send>,
    pub cancel: Arc<AtomicBool>,
}

/// What a step did for one request, in order per request: `Progress`* and `Text`*, then one `Done` or `Failed`.
pub enum BatchEvent<'a> {
    /// `read` of `total` prompt tokens not reused from the cache are computed (after every chunk but the last).
    Progress { id: u64, read: usize, total: usize },
    /// A piece of generated text: whole UTF-8 characters, stop strings held back; with
    /// [`GenerateOptions::logprobs`], the log-probabilities of the tokens it completes (a last piece may have
    /// no text: tokens whose text is never printed).
    Text {
        id: u64,
        text: &'a str,
        logprobs: Vec<TokenLogprob>,
    },
    /// The request ended normally (cancelled included: `stats.stop`).
    Done { id: u64, stats: GenerateStats },
    /// The request could not run: its prompt (empty, over the context, an id outside the vocabulary), a token
    /// that cannot be detokenized, or a failed prefill GEMM with the fallback off
    /// ([`crate::runtime::session::SessionError::GemmFault`]: `strata serve`'s worker dies on it, as the original).
    Failed { id: u64, error: GenerateError },
}

/// What one [`Batcher::step`] computed.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StepReport {
    /// Sequences in the step (0: nothing to do).
    pub sequences: usize,
    /// Tokens in the step: decode tokens and prompt tokens.
    pub tokens: usize,
    /// Of `sequences`, those that decoded a token.
    pub decoding: usize,
    /// The forward pass and reading its logits back, ms.
    pub forward_ms: f64,
    /// Sampling, detokenizing and stop strings of every sequence, ms.
    pub sample_ms: f64,
}

/// One slot as `GET /slots` shows it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct SlotState {
    /// The slot's index.
    pub id: usize,
    pub state: SlotPhase,
    /// The request in the slot (the worker's id), if any.
    pub request: Option<u64>,
    /// Tokens the slot's KV cache holds at most.
    pub n_ctx: usize,
    /// Tokens its KV cache holds now (an idle slot keeps its last request's, for prefix reuse).
    pub cached_tokens: usize,
    /// The request's prompt tokens, of which `prompt_reused` were kept from the cache and `prompt_read` computed.
    pub prompt_tokens: usize,
    pub prompt_reused: usize,
    pub prompt_read: usize,
    /// Tokens the request has generated.
    pub generated: usize,
}

/// The KV pool of a scheduler's slots ([`Batcher::kv_usage`]): `GET /slots` and `/metrics` show it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
pub struct KvUsage {
    /// Blocks of [`KV_BLOCK_CELLS`] tokens the slots' caches hold (a shared block once).
    pub blocks_used: usize,
    /// Blocks the pool may hold (`--kv-tokens`); `None`: no limit.
    pub blocks_total: Option<usize>,
    /// Blocks held by several slots (a common prompt prefix).
    pub blocks_shared: usize,
    /// Requests preempted for blocks so far.
    pub preemptions: u64,
    /// Preempted requests waiting for a slot now.
    pub waiting_preempted: usize,
}

/// What a slot is doing (`idle`, `prefill`, `decode` in JSON).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SlotPhase {
    Idle,
    /// Its request's prompt is being read.
    Prefill,
    Decode,
}

/// A request in a slot.
struct Running {
    job: BatchJob,
    /// Prompt tokens kept from the slot's cache.
    reused: usize,
    /// Prompt tokens computed so far (after the reused ones).
    read: usize,
    started: Instant,
    prefill_ms: f64,
    gemm_fallback: Option<GemmFault>,
    /// Set once the prompt is computed: the generation, the token to compute next, and when decoding began.
    decoding: Option<(Decoding, u32, Instant)>,
    /// Admission order (prefill chunks go to the oldest first).
    order: u64,
    /// Waited for a slot, ms.
    queued_ms: f64,
    /// Steps that computed this request's tokens, and the sequences in them, summed.
    steps: u64,
    step_sequences: u64,
    /// After a preemption in decode: the tokens to compute again (the prompt and the tokens generated and fed so
    /// far), until the cache holds them all again.
    recompute: Option<Vec<u32>>,
    /// Times preempted, and tokens computed again since.
    preempted: u32,
    recomputed: usize,
    /// Since when it waits preempted (for a slot and KV blocks), and its waits so far in its prompt and in its
    /// decode, ms: counted in `queued_ms`, not in the prompt's or the decode's time.
    parked: Option<Instant>,
    parked_prefill_ms: f64,
    parked_decode_ms: f64,
}

impl Running {
    /// `job` starting now, admitted `order`-th, submitted at `submitted`.
    fn new(job: BatchJob, order: u64, submitted: Instant) -> Running {
        Running {
            job,
            reused: 0,
            read: 0,
            started: Instant::now(),
            prefill_ms: 0.0,
            gemm_fallback: None,
            decoding: None,
            order,
            queued_ms: ms_since(submitted),
            steps: 0,
            step_sequences: 0,
            recompute: None,
            preempted: 0,
            recomputed: 0,
            parked: None,
            parked_prefill_ms: 0.0,
            parked_decode_ms: 0.0,
        }
    }

    /// Back in a slot after a preemption: its wait counts as queued, not as prompt or decode time.
    fn unpark(&mut self) {
        if let Some(t) = self.parked.take() {
            let waited = ms_since(t);
            self.queued_ms += waited;
            match self.decoding {
                Some(_) => self.parked_decode_ms += waited,
                None => self.parked_prefill_ms += waited,
            }
        }
    }

    /// The tokens its slot's cache must hold before its next step: the prompt, or after a preemption in decode
    /// what it had computed.
    fn target(&self) -> &[u32] {
        self.recompute.as_deref().unwrap_or(&self.job.prompt)
    }

    /// Whether its next part is prompt (or recomputed) tokens, not a decode token.
    fn reading(&self) -> bool {
        self.decoding.is_none() || self.recompute.is_some()
    }

    /// The prompt's numbers (its time so far when it ends before its prompt was read), `cancelled` as given.
    fn prefill_stats(&self, cancelled: bool) -> PrefillStats {
        PrefillStats {
            prompt_tokens: self.job.prompt.len(),
            reused: self.reused,
            read: self.read,
            ms: match self.decoding {
                Some(_) => self.prefill_ms,
                None => ms_since(self.started) - self.parked_prefill_ms,
            },
            gemm_fallback: self.gemm_fallback.clone(),
            cancelled,
        }
    }

    /// Sequences per step over the steps that computed this request's tokens (1 before any).
    fn batch_mean(&self) -> f64 {
        if self.steps == 0 {
            1.0
        } else {
            self.step_sequences as f64 / self.steps as f64
        }
    }
}

struct Slot<'m, B: Backend> {
    session: Session<'m, B>,
    running: Option<Running>,
    /// When the slot last took a request (for least-recently-used choice among free slots).
    last_used: u64,
}

/// The tokens one sequence contributes to a step.
struct Part {
    slot: usize,
    tokens: Vec<u32>,
    /// The last prompt chunk, or a decode token: the step's logits for this part are sampled.
    sample: bool,
}

/// The continuous-batching scheduler over `parallel` sequences (see the module doc).
pub struct Batcher<'m, B: Backend> {
    slots: Vec<Slot<'m, B>>,
    /// Requests waiting for a slot, with when they were submitted.
    waiting: VecDeque<(BatchJob, Instant)>,
    /// Preempted requests, oldest admission first: they take free slots before `waiting`.
    preempted: VecDeque<Running>,
    /// Preemptions so far.
    preemptions: u64,
    scratch: Scratch<B>,
    /// Most tokens a step carries (decode tokens count).
    budget: usize,
    clock: u64,
}

impl<'m, B: Backend> Batcher<'m, B> {
    /// A scheduler over `sessions` (one slot each; at least one), whose steps carry at most `budget` tokens (at
    /// least one prompt token is computed per step while a prompt waits, whatever the decode tokens).
    ///
    /// Panics if `sessions` is empty.
    pub fn new(sessions: Vec<Session<'m, B>>, budget: usize) -> Batcher<'m, B> {
        assert!(!sessions.is_empty(), "Batcher: no slot");
        Batcher {
            slots: sessions
                .into_iter()
                .map(|session| Slot {
                    session,
                    running: None,
                    last_used: 0,
                })
                .collect(),
            waiting: VecDeque::new(),
            preempted: VecDeque::new(),
            preemptions: 0,
            scratch: Scratch::default(),
            budget: budget.max(1),
            clock: 0,
        }
    }

    /// Queues a request; it joins the batch at a step once a slot is free.
    pub fn submit(&mut self, job: BatchJob) {
        self.waiting.push_back((job, Instant::now()));
    }

    /// Whether nothing is running or waiting.
    pub fn is_idle(&self) -> bool {
        self.waiting.is_empty() && self.preempted.is_empty() && self.slots.iter().all(|s| s.running.is_none())
    }

    /// The slots' KV pool as it stands: blocks held, the pool's size, blocks shared by several slots, and
    /// preemptions so far.
    pub fn kv_usage(&self) -> KvUsage {
        let pool = self.pool();
        let mut shared = std::collections::HashSet::new();
        for s in &self.slots {
            s.session.kv().shared_blocks(&mut shared);
        }
        KvUsage {
            blocks_used: pool.held_blocks(),
            blocks_total: pool.capacity_blocks(),
            blocks_shared: shared.len(),
            preemptions: self.preemptions,
            waiting_preempted: self.preempted.len(),
        }
    }

    /// Every slot's state, in slot order.
    pub fn slots(&self) -> Vec<SlotState> {
        self.slots
            .iter()
            .enumerate()
            .map(|(id, s)| {
                let r = s.running.as_ref();
                SlotState {
                    id,
                    state: match r {
                        None => SlotPhase::Idle,
                        Some(r) if r.reading() => SlotPhase::Prefill,
                        Some(_) => SlotPhase::Decode,
                    },
                    request: r.map(|r| r.job.id),
                    n_ctx: s.session.n_ctx(),
                    cached_tokens: s.session.tokens().len(),
                    prompt_tokens: r.map_or(0, |r| r.job.prompt.len()),
                    prompt_reused: r.map_or(0, |r| r.reused),
                    prompt_read: r.map_or(0, |r| r.read),
                    generated: r.and_then(|r| r.decoding.as_ref()).map_or(0, |(d, _, _)| d.generated()),
                }
            })
            .collect()
    }

    /// The ids of the requests in a slot, in slot order, then of those preempted, then of those waiting, in
    /// arrival order.
    pub fn ids(&self) -> impl Iterator<Item = u64> + '_ {
        let running = self.slots.iter().filter_map(|s| s.running.as_ref().map(|r| r.job.id));
        running
            .chain(self.preempted.iter().map(|r| r.job.id))
            .chain(self.waiting.iter().map(|(j, _)| j.id))
    }

    /// One step: admits waiting requests to free slots, ends cancelled ones, computes one forward pass of every
    /// running sequence's next tokens (see the module doc), and samples where a sequence's logits are due. Each
    /// request's progress, text and end go to `on_event` as they happen.
    pub fn step(&mut self, tokenizer: &Tokenizer, on_event: &mut dyn FnMut(BatchEvent<'_>)) -> StepReport {
        self.end_cancelled(on_event);
        self.admit(on_event);
        let mut parts = self.plan(on_event);
        self.fit(&mut parts, on_event);
        if parts.is_empty() {
            return StepReport::default();
        }
        let mut report = StepReport {
            sequences: parts.len(),
            tokens: parts.iter().map(|p| p.tokens.len()).sum(),
            decoding: parts
                .iter()
                .filter(|p| self.slots[p.slot].running.as_ref().is_some_and(|r| !r.reading()))
                .count(),
            ..StepReport::default()
        };
        for p in &parts {
            if let Some(r) = self.slots[p.slot].running.as_mut() {
                r.steps += 1;
                r.step_sequences += parts.len() as u64;
            }
        }
        let (forward_ms, sample_ms) = if let [part] = &parts[..] {
            self.step_one(part, tokenizer, on_event)
        } else {
            self.step_many(&parts, tokenizer, on_event)
        };
        report.forward_ms = forward_ms;
        report.sample_ms = sample_ms;
        report
    }

    /// Before slot `i` takes `prompt`: when another slot (running or idle) holds a longer prefix of it than slot
    /// `i` does, slot `i` shares those cells' blocks with it ([`Session::adopt_prefix`]), so a prefix that any
    /// sequence computed (a system prompt, earlier turns) is not computed again. The last prompt
    /// token is always computed (its logits are sampled).
    fn share_prefix(&mut self, i: usize, prompt: &[u32]) {
        let Some((n, j)) = self.prefix_source(i, prompt).1 else {
            return;
        };
        let (to, from) = if i < j {
            let (a, b) = self.slots.split_at_mut(j);
            (&mut a[i], &b[0])
        } else {
            let (a, b) = self.slots.split_at_mut(i);
            (&mut b[0], &a[j])
        };
        to.session.adopt_prefix(&from.session, n);
    }

    /// The tokens of `prompt` slot `i` holds, and the other slot holding more of them with how many (at most all but
    /// the last), if any: what [`Batcher::share_prefix`] takes.
    fn prefix_source(&self, i: usize, prompt: &[u32]) -> (usize, Option<(usize, usize)>) {
        let own = self.slots[i].session.common_prefix(prompt);
        let best = (0..self.slots.len())
            .filter(|&j| j != i)
            .map(|j| (self.slots[j].session.common_prefix(prompt).min(prompt.len() - 1), j))
            .max();
        (own, best.filter(|&(n, _)| n > own))
    }

    /// The KV pool the slots' caches share.
    fn pool(&self) -> &Arc<crate::state::kv::KvPool> {
        self.slots[0].session.kv().pool()
    }

    /// The idle slots whose caches hold blocks, least recently used first: the caches the scheduler may drop
    /// for room.
    fn idle_caches(&self) -> Vec<usize> {
        let mut idle: Vec<usize> = (0..self.slots.len())
            .filter(|&j| self.slots[j].running.is_none() && self.slots[j].session.kv().held_blocks() > 0)
            .collect();
        idle.sort_by_key(|&j| self.slots[j].last_used);
        idle
    }

    /// The free slot whose cache holds the longest prefix of `tokens` (the least recently used among equals).
    fn free_slot(&self, tokens: &[u32]) -> Option<usize> {
        (0..self.slots.len())
            .filter(|&i| self.slots[i].running.is_none())
            .max_by_key(|&i| {
                let s = &self.slots[i];
                (s.session.common_prefix(tokens), std::cmp::Reverse(s.last_used))
            })
    }

    /// Whether a request that must hold `tokens` may take free slot `i` now: with the KV pool bounded, the pool has
    /// free blocks for those tokens and the one after, or nothing runs. Blocks it keeps (slot `i`'s prefix of them,
    /// or another slot's it shares, [`Batcher::share_prefix`]) are not needed again, and slot `i`'s blocks past
    /// what it keeps count as free. When idle slots' cached prompts make the difference, they are dropped, least
    /// recently used first (never the slot it shares from); when they would not, nothing is dropped and it waits. A
    /// request admitted without that room would preempt another at once, or be preempted itself, and compute its
    /// prompt again and again (vLLM admits a request only with its blocks free too).
    fn room_for(&mut self, tokens: &[u32], i: usize) -> bool {
        let pool = self.pool().clone();
        let Some(free) = pool.free_rows() else {
            return true;
        };
        let (own, source) = self.prefix_source(i, tokens);
        let kept = source.map_or(own, |(n, _)| n);
        let need = ((tokens.len() + 1).div_ceil(KV_BLOCK_CELLS) - kept / KV_BLOCK_CELLS) * pool.rows_per_block();
        let kv = |j: usize| self.slots[j].session.kv();
        let mut free = free + kv(i).rows_freed_by_truncate(if source.is_some() { 0 } else { own });
        if free >= need {
            return true;
        }
        // Each droppable cache with the rows dropping it gives back.
        let idle: Vec<(usize, usize)> = self
            .idle_caches()
            .into_iter()
            .filter(|&j| j != i && source.is_none_or(|(_, s)| s != j))
            .map(|j| (j, kv(j).rows_freed_by_truncate(0)))
            .collect();
        if free + idle.iter().map(|&(_, rows)| rows).sum::<usize>() < need {
            return self.slots.iter().all(|s| s.running.is_none());
        }
        for (j, rows) in idle {
            if free >= need {
                break;
            }
            free += rows;
            self.slots[j].session.clear();
        }
        true
    }

    /// Gives free slots to preempted requests (oldest first), then to waiting ones, each to the free slot holding
    /// the longest prefix of what it must compute, while the KV pool has room for it ([`Batcher::room_for`]): a
    /// request never passes an older one.
    fn admit(&mut self, on_event: &mut dyn FnMut(BatchEvent<'_>)) {
        while let Some(r) = self.preempted.front() {
            let Some(i) = self.free_slot(r.target()) else {
                return;
            };
            let target = r.target().to_vec();
            if !self.room_for(&target, i) {
                return;
            }
            let mut r = self.preempted.pop_front().expect("checked");
            r.unpark();
            self.share_prefix(i, &target);
            self.clock += 1;
            let slot = &mut self.slots[i];
            slot.last_used = self.clock;
            match slot.session.begin_prompt(&target) {
                Ok(kept) => {
                    if r.decoding.is_none() {
                        // Preempted in its prompt: what it had read past `kept` is read again.
                        r.recomputed += (r.reused + r.read).saturating_sub(kept);
                        r.reused = r.reused.min(kept);
                        r.read = kept - r.reused;
                    }
                    slot.running = Some(r);
                }
                // It was held in a cache of this engine before: only a broken invariant gets here.
                Err(e) => on_event(BatchEvent::Failed {
                    id: r.job.id,
                    error: e.into(),
                }),
            }
        }
        while !self.waiting.is_empty() {
            let Some(i) = self.free_slot(&self.waiting[0].0.prompt) else {
                return;
            };
            if !self.room_for(&self.waiting[0].0.prompt.clone(), i) {
                return;
            }
            let (job, submitted) = self.waiting.pop_front().expect("checked");
            self.share_prefix(i, &job.prompt);
            self.clock += 1;
            let slot = &mut self.slots[i];
            slot.last_used = self.clock;
            match slot.session.begin_prompt(&job.prompt) {
                Ok(reused) => {
                    let mut r = Running::new(job, self.clock, submitted);
                    r.reused = reused;
                    slot.running = Some(r);
                }
                Err(e) => {
                    // A prompt refused before anything was computed: the slot's cache is as it was.
                    on_event(BatchEvent::Failed {
                        id: job.id,
                        error: e.into(),
                    });
                }
            }
        }
    }

    /// Ends every running, preempted or waiting request whose cancel flag is set, with [`StopReason::Cancelled`] (a
    /// client that left frees its place in the queue at once).
    fn end_cancelled(&mut self, on_event: &mut dyn FnMut(BatchEvent<'_>)) {
        let (gone, kept): (Vec<_>, Vec<_>) = std::mem::take(&mut self.waiting)
            .into_iter()
            .partition(|(job, _)| job.cancel.load(Ordering::Relaxed));
        self.waiting = kept.into();
        for (job, submitted) in gone {
            finish(Running::new(job, 0, submitted), StopReason::Cancelled, on_event);
        }
        let (gone, kept): (Vec<Running>, Vec<Running>) = std::mem::take(&mut self.preempted)
            .into_iter()
            .partition(|r| r.job.cancel.load(Ordering::Relaxed));
        self.preempted = kept.into();
        for r in gone {
            finish(r, StopReason::Cancelled, on_event);
        }
        for slot in &mut self.slots {
            if slot
                .running
                .as_ref()
                .is_some_and(|r| r.job.cancel.load(Ordering::Relaxed))
            {
                let r = slot.running.take().expect("checked");
                finish(r, StopReason::Cancelled, on_event);
            }
        }
    }

    /// The step's parts: every decoding sequence's next token, then prompt chunks, oldest request first, while
    /// the budget lasts. A request whose prefill cannot run (a failed GEMM with the fallback off) ends here.
    fn plan(&mut self, on_event: &mut dyn FnMut(BatchEvent<'_>)) -> Vec<Part> {
        let mut parts: Vec<Part> = Vec::new();
        for (i, slot) in self.slots.iter().enumerate() {
            if let Some((_, next, _)) = slot
                .running
                .as_ref()
                .filter(|r| !r.reading())
                .and_then(|r| r.decoding.as_ref())
            {
                parts.push(Part {
                    slot: i,
                    tokens: vec![*next],
                    sample: true,
                });
            }
        }
        let mut left = self.budget.saturating_sub(parts.len()).max(1);
        let mut prefilling: Vec<usize> = (0..self.slots.len())
            .filter(|&i| self.slots[i].running.as_ref().is_some_and(Running::reading))
            .collect();
        prefilling.sort_by_key(|&i| self.slots[i].running.as_ref().map_or(0, |r| r.order));
        let mut switch_to = None;
        for i in prefilling {
            if left == 0 {
                break;
            }
            let slot = &mut self.slots[i];
            let r = slot.running.as_mut().expect("filtered");
            let done = slot.session.tokens().len();
            let remaining = r.target().len() - done;
            match slot.session.next_batch_rows(remaining) {
                Ok((rows, switched)) => {
                    if let Some(f) = switched {
                        // The switch to the fallback holds for the engine: every sequence's prefill is capped.
                        switch_to = Some(f.limit);
                        r.gemm_fallback = Some(f);
                    }
                    let rows = rows.min(left);
                    left -= rows;
                    parts.push(Part {
                        slot: i,
                        tokens: r.target()[done..done + rows].to_vec(),
                        // Recomputed tokens are not sampled again: the token to feed next was sampled before.
                        sample: rows == remaining && r.recompute.is_none(),
                    });
                }
                Err(e) => {
                    let r = slot.running.take().expect("filtered");
                    slot.session.clear();
                    on_event(BatchEvent::Failed {
                        id: r.job.id,
                        error: e.into(),
                    });
                }
            }
            if let Some(limit) = switch_to.take() {
                for slot in &mut self.slots {
                    slot.session.cap_prefill_rows(limit);
                }
            }
        }
        parts
    }

    /// Makes room in the KV pool for the step's `parts` (see the module doc): while the blocks they will take
    /// pass what the pool has free, drops the least recently used idle slot's cached prompt, else preempts the
    /// newest running request (its part leaves the step). A request alone in the engine that still does not fit
    /// (a pool smaller than its context, which the engine refuses at start) fails instead of waiting for ever.
    fn fit(&mut self, parts: &mut Vec<Part>, on_event: &mut dyn FnMut(BatchEvent<'_>)) {
        loop {
            let Some(free) = self.pool().free_rows() else {
                return;
            };
            let need: usize = parts
                .iter()
                .map(|p| {
                    let s = &self.slots[p.slot].session;
                    let at = s.tokens().len();
                    s.kv().rows_needed(at, at + p.tokens.len())
                })
                .sum();
            if need <= free {
                return;
            }
            if let Some(&i) = self.idle_caches().first() {
                self.slots[i].session.clear();
                continue;
            }
            let running: Vec<usize> = (0..self.slots.len())
                .filter(|&i| self.slots[i].running.is_some())
                .collect();
            let Some(&victim) = running
                .iter()
                .max_by_key(|&&i| self.slots[i].running.as_ref().map_or(0, |r| r.order))
            else {
                return;
            };
            if running.len() == 1 {
                let slot = &mut self.slots[victim];
                let r = slot.running.take().expect("running");
                let needed = slot.session.tokens().len() + parts.iter().map(|p| p.tokens.len()).sum::<usize>();
                slot.session.clear();
                let pool = slot.session.kv().pool();
                on_event(BatchEvent::Failed {
                    id: r.job.id,
                    error: SessionError::KvPool {
                        needed,
                        capacity: pool.capacity_blocks().unwrap_or(0) * KV_BLOCK_CELLS,
                    }
                    .into(),
                });
            } else {
                self.preempt(victim);
            }
            parts.retain(|p| p.slot != victim);
        }
    }

    /// Preempts the request in slot `i`: its cache's blocks go back to the pool, and it waits among the preempted
    /// in admission order, with what it must compute again. A request whose prompt had not started is only put
    /// back (nothing is lost, so it is not counted).
    fn preempt(&mut self, i: usize) {
        let slot = &mut self.slots[i];
        let mut r = slot.running.take().expect("running");
        if r.decoding.is_some() && r.recompute.is_none() {
            r.recompute = Some(slot.session.tokens().to_vec());
        }
        slot.session.clear();
        if r.decoding.is_some() || r.read > 0 {
            r.preempted += 1;
            self.preemptions += 1;
        }
        r.parked = Some(Instant::now());
        let at = self.preempted.partition_point(|p| p.order < r.order);
        self.preempted.insert(at, r);
    }

    /// A step of one sequence: the single-sequence path, with its graphs and top-logits selection; a prompt
    /// chunk on the CPU also stops between layers when its request is cancelled (the chunk is then dropped).
    fn step_one(&mut self, part: &Part, tokenizer: &Tokenizer, on_event: &mut dyn FnMut(BatchEvent<'_>)) -> (f64, f64) {
        let t0 = Instant::now();
        let Slot { session, running, .. } = &mut self.slots[part.slot];
        let r = running.as_mut().expect("planned");
        let prefill = r.reading();
        let want = match prefill {
            false if r.job.opts.wants_top(&*r.job.sampler) => Logits::Top,
            false => Logits::Last,
            true if part.sample => Logits::Last,
            true => Logits::None,
        };
        crate::backend::progress::take_aborted();
        let computed = {
            let _scope = prefill.then(|| session.cancel_scope(&r.job.cancel)).flatten();
            session.step_alone(&part.tokens, want)
        };
        let forward_ms = ms_since(t0);
        if !computed {
            // Cancelled inside the chunk: nothing was kept; the next step ends the request.
            return (forward_ms, 0.0);
        }
        let t1 = Instant::now();
        let room = session.tokens().len() < session.n_ctx();
        if let Some(r) = ready_to_sample(running, part, session.tokens().len(), on_event) {
            let (dec, _, _) = r.decoding.as_mut().expect("ready");
            let tok = dec.sample(session.step_logits(), &mut *r.job.sampler);
            if accept(running, tok, room, tokenizer, on_event) == Outcome::Failed {
                session.clear();
            }
        }
        (forward_ms, ms_since(t1))
    }

    /// A step of several sequences: one forward pass over all their tokens, then every sequence due samples from
    /// its row (in parallel: each has its own sampler), then each takes its token in slot order.
    fn step_many(
        &mut self,
        parts: &[Part],
        tokenizer: &Tokenizer,
        on_event: &mut dyn FnMut(BatchEvent<'_>),
    ) -> (f64, f64) {
        let t0 = Instant::now();
        // Candidates only when every sequence that samples this step can sample from them.
        let top = parts.iter().all(|p| {
            let r = self.slots[p.slot].running.as_ref().expect("planned");
            !p.sample || r.job.opts.wants_top(&*r.job.sampler)
        });
        let want = if top { Logits::Top } else { Logits::Last };
        // Decode tokens first, then prompt chunks: a backend attends over the leading one-token runs in one launch.
        let mut chosen: Vec<(&mut Session<'m, B>, &[u32])> = Vec::with_capacity(parts.len());
        let mut runs: Vec<&mut Option<Running>> = Vec::with_capacity(parts.len());
        let mut which: Vec<&Part> = Vec::with_capacity(parts.len());
        let mut later = Vec::new();
        for (i, slot) in self.slots.iter_mut().enumerate() {
            if let Some(p) = parts.iter().find(|p| p.slot == i) {
                if p.tokens.len() == 1 {
                    chosen.push((&mut slot.session, &p.tokens[..]));
                    runs.push(&mut slot.running);
                    which.push(p);
                } else {
                    later.push((slot, p));
                }
            }
        }
        for (slot, p) in later {
            chosen.push((&mut slot.session, &p.tokens[..]));
            runs.push(&mut slot.running);
            which.push(p);
        }
        let rows = step_together(&mut chosen, &mut self.scratch, want);
        let forward_ms = ms_since(t0);
        let t1 = Instant::now();
        let mut due: Vec<(usize, &mut Running)> = Vec::with_capacity(parts.len());
        for (k, running) in runs.iter_mut().enumerate() {
            if let Some(r) = ready_to_sample(running, which[k], chosen[k].0.tokens().len(), on_event) {
                due.push((k, r));
            }
        }
        let sampled: Vec<(usize, Option<u32>)> = due
            .into_par_iter()
            .map(|(k, r)| {
                let (dec, _, _) = r.decoding.as_mut().expect("ready");
                (k, dec.sample(rows.row(k), &mut *r.job.sampler))
            })
            .collect();
        for (k, tok) in sampled {
            let session = &mut chosen[k].0;
            let room = session.tokens().len() < session.n_ctx();
            if accept(runs[k], tok, room, tokenizer, on_event) == Outcome::Failed {
                session.clear();
            }
        }
        (forward_ms, ms_since(t1))
    }
}

fn ms_since(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1e3
}

/// What the steps of a period did, for the worker's periodic log line.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StepTotals {
    pub steps: u64,
    pub sequences: u64,
    pub max_sequences: usize,
    pub tokens: u64,
    pub forward_ms: f64,
    pub sample_ms: f64,
}

impl StepTotals {
    /// Adds one step (an empty one is not counted).
    pub fn add(&mut self, r: &StepReport) {
        if r.sequences == 0 {
            return;
        }
        self.steps += 1;
        self.sequences += r.sequences as u64;
        self.max_sequences = self.max_sequences.max(r.sequences);
        self.tokens += r.tokens as u64;
        self.forward_ms += r.forward_ms;
        self.sample_ms += r.sample_ms;
    }

    /// `N steps in S s: mean M sequences a step (most X), T tokens a step; forward F ms, sampling P ms a step`.
    pub fn line(&self, seconds: f64) -> String {
        let n = self.steps.max(1) as f64;
        format!(
            "{} steps in {seconds:.1} s: {:.1} sequences a step (most {}), {:.1} tokens a step; forward and logits {:.2} ms, sampling {:.2} ms a step",
            self.steps,
            self.sequences as f64 / n,
            self.max_sequences,
            self.tokens as f64 / n,
            self.forward_ms / n,
            self.sample_ms / n
        )
    }
}

/// How a request fared in a step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Outcome {
    Going,
    Ended,
    /// It failed: its cache may hold tokens its generation never finished with, so the slot's next request starts
    /// from scratch.
    Failed,
}

/// After a part of `running`'s request was computed (its cache now holds `held` tokens): records prompt progress
/// (a chunk that is not the last) or recomputation after a preemption, starts the generation after the last
/// chunk, and ends a request cancelled meanwhile. Returns the request when its logits are due to be sampled.
fn ready_to_sample<'r>(
    running: &'r mut Option<Running>,
    part: &Part,
    held: usize,
    on_event: &mut dyn FnMut(BatchEvent<'_>),
) -> Option<&'r mut Running> {
    let r = running.as_mut().expect("planned");
    if let Some(target) = &r.recompute {
        r.recomputed += part.tokens.len();
        if held >= target.len() {
            r.recompute = None;
        }
        return None;
    }
    if r.decoding.is_none() {
        r.read += part.tokens.len();
        if !part.sample {
            let total = r.job.prompt.len() - r.reused;
            on_event(BatchEvent::Progress {
                id: r.job.id,
                read: r.read,
                total,
            });
            return None;
        }
        r.prefill_ms = ms_since(r.started) - r.parked_prefill_ms;
        r.decoding = Some((Decoding::new(&r.job.prompt, &r.job.opts), 0, Instant::now()));
    }
    if r.job.cancel.load(Ordering::Relaxed) {
        let r = running.take().expect("checked");
        finish(r, StopReason::Cancelled, on_event);
        return None;
    }
    running.as_mut()
}

/// Takes the token `running`'s request sampled (`None`: its limit was reached): prints it, and ends the request when
/// its generation stopped or failed.
fn accept(
    running: &mut Option<Running>,
    tok: Option<u32>,
    room: bool,
    tokenizer: &Tokenizer,
    on_event: &mut dyn FnMut(BatchEvent<'_>),
) -> Outcome {
    let r = running.as_mut().expect("sampled");
    let id = r.job.id;
    let (dec, next, _) = r.decoding.as_mut().expect("sampled");
    match dec.accept(tok, tokenizer, room, &mut |text, logprobs| {
        on_event(BatchEvent::Text { id, text, logprobs })
    }) {
        Ok(Next::Feed(tok)) => {
            *next = tok;
            Outcome::Going
        }
        Ok(Next::Stopped(why)) => {
            let r = running.take().expect("checked");
            finish(r, why, on_event);
            Outcome::Ended
        }
        Err(e) => {
            running.take();
            on_event(BatchEvent::Failed { id, error: e.into() });
            Outcome::Failed
        }
    }
}

/// Ends request `r` with `stop`: flushes its held-back text and sends `Done` with its numbers.
fn finish(mut r: Running, stop: StopReason, on_event: &mut dyn FnMut(BatchEvent<'_>)) {
    // Ended while preempted (cancelled): its wait counts as queued too.
    r.unpark();
    let id = r.job.id;
    let prefill = r.prefill_stats(r.decoding.is_none() && stop == StopReason::Cancelled);
    let (queued_ms, batch_mean, preempted, recomputed) = (r.queued_ms, r.batch_mean(), r.preempted, r.recomputed);
    let parked_decode_ms = r.parked_decode_ms;
    let (end, decode_ms) = match r.decoding {
        Some((dec, _, t0)) => (
            dec.finish(stop, &mut |text, logprobs| {
                on_event(BatchEvent::Text { id, text, logprobs })
            }),
            ms_since(t0) - parked_decode_ms,
        ),
        None => (Finished::default(), 0.0),
    };
    on_event(BatchEvent::Done {
        id,
        stats: GenerateStats {
            prefill,
            generated: end.tokens.len(),
            decode_ms,
            stop,
            tokens: end.tokens,
            logits_digests: end.digests,
            queued_ms,
            batch_mean,
            stop_word: end.stop_word,
            preempted,
            recomputed,
        },
    });
}
