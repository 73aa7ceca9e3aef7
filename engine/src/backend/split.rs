//! A pipeline (layer) split over several backends: each stage computes a contiguous run of the model's layers on
//! its own backend (its own device, or its own stream on a shared one), with its dense weights, its layers' KV
//! arrays and, on a GPU, an expert cache for its layers' experts. The first stage also computes the embeddings, the
//! last the output norm and head; the hidden state crosses once per boundary per step (llama.cpp's
//! `--split-mode layer`; GPipe, Huang et al. 2019, without micro-batches: one step runs the stages in turn).
//!
//! The forward pass is the model's own: it tells the backend where each layer starts ([`Backend::enter_layer`]),
//! and at a stage's first layer sizes that stage's scratch and carries the residual stream into it
//! ([`Backend::carry`]). Every op between goes to the current stage ([`Split::current`]); an activation buffer
//! of the split holds one buffer per stage ([`AnyBuf::Staged`]).
//!
//! Sequences' KV caches are shared by the stages: one block table per sequence (the host's), and per stage the
//! arrays of its layers. The first stage whose step writes a block another sequence shares takes it in the table
//! and copies its own layers' rows; the copies it made are handed to the other stages before they run
//! ([`Split::share_kv_copies`]).
//!
//! A step ([`Backend::step_begin`] to [`Backend::step_end`]) is one step of each stage in turn: the stage's
//! expert cache decides the step as on one card, and a decode step is a CUDA graph of the stage's launches. A
//! stage's step ends before its values are carried out, and the next one's begins after they were carried in
//! ([`Backend::carried`]), so no copy falls inside a stage's graph. The copy runs on the sending stage's stream,
//! after the receiving stage's earlier work, and the receiving stage waits for it (events both ways): the host
//! does not wait between stages. A decode
//! step whose every stage has a verified graph is replayed whole ([`Backend::replay_step`]): each stage's graph in
//! turn, the carried buffers copied between them by the addresses the last forward pass of that key used.
//!
//! One step runs at a time (the engine's step driver is one thread): the current stage is the split's state.

use std::collections::HashMap;
use std::ops::Range;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use super::cuda::Link;
use super::cuda::select::{AnyBackend, AnyBuf};
use super::{Backend, StepKey};
use crate::device::Device;
use crate::state::kv::SeqSlot;

/// One stage of a split: the layers it computes, on which backend.
pub struct Stage {
    /// The device it computes on, as named on the command line (`cuda:1`).
    pub device: Device,
    /// The layers it computes, `start..end` of the model's.
    pub layers: Range<usize>,
    pub be: AnyBackend,
}

/// The stages of a split and the one computing now. See the module docs.
pub struct Split {
    stages: Vec<Stage>,
    cur: AtomicUsize,
    /// How the values cross into stage `i` (index `i`; `None` at 0 and where either side is not a GPU, whose
    /// buffers cross through host memory).
    links: Vec<Option<Link>>,
    /// The host copy of a carried buffer, where a boundary has no device copy (a CPU stage, or a link that
    /// could not be set up).
    bounce: Mutex<Vec<f32>>,
    /// Buffers carried across a boundary so far, and their values.
    carried: AtomicU64,
    carried_values: AtomicU64,
    /// The step begun ([`Split::step_begin`]) and the stage whose part of it is open, if one is.
    step: Mutex<StepState>,
    /// Per step key, the buffers its last forward pass carried (GPU stages only): what a whole-step replay
    /// copies between the stages' graphs.
    replays: Mutex<HashMap<StepKey, Vec<Carried>>>,
    /// Steps replayed whole so far.
    replayed: AtomicU64,
}

/// One buffer carried into stage `into` by a forward pass: `len` f32 values from device address `src` of the
/// stage before to `dst` of `into`.
#[derive(Clone, Copy, Debug)]
struct Carried {
    into: usize,
    src: u64,
    dst: u64,
    len: usize,
}

/// A split's step: its shape and key, between [`Split::step_begin`] and [`Split::step_end`], and the stage whose
/// own step is open.
#[derive(Default)]
struct StepState {
    step: Option<(usize, StepKey)>,
    open: Option<usize>,
    /// What the step carried so far.
    carried: Vec<Carried>,
}

impl Split {
    /// A split over `backends` (each with its device's name), in pipeline order, before its layers are placed
    /// ([`Split::place`]: the engine sizes the split once the model's header is read).
    ///
    /// Panics with fewer than two backends.
    pub fn new(backends: Vec<(Device, AnyBackend)>) -> Split {
        assert!(backends.len() >= 2, "a split has at least two stages");
        let stages: Vec<Stage> = backends
            .into_iter()
            .map(|(device, be)| Stage {
                device,
                layers: 0..0,
                be,
            })
            .collect();
        for s in &stages {
            if let Some(c) = s.be.cuda() {
                c.share_kv_copies();
            }
        }
        let links = (0..stages.len())
            .map(|i| {
                let (a, b) = (stages[i.checked_sub(1)?].be.cuda()?, stages[i].be.cuda()?);
                match a.link_to(b) {
                    Ok(link) => Some(link),
                    Err(e) => {
                        eprintln!(
                            "strata: layer split: {} to {}: the hidden state crosses through host memory ({e})",
                            stages[i - 1].device,
                            stages[i].device
                        );
                        None
                    }
                }
            })
            .collect();
        Split {
            stages,
            cur: AtomicUsize::new(0),
            links,
            bounce: Mutex::new(Vec::new()),
            carried: AtomicU64::new(0),
            carried_values: AtomicU64::new(0),
            step: Mutex::new(StepState::default()),
            replays: Mutex::new(HashMap::new()),
            replayed: AtomicU64::new(0),
        }
    }

    /// Gives each stage its layers.
    ///
    /// Panics unless there is one range per stage, non-empty, contiguous and starting at 0
    /// ([`crate::memory::split::LayerSplit::ranges`] computes them).
    pub fn place(&mut self, layers: &[Range<usize>]) {
        assert!(
            layers.len() == self.stages.len()
                && layers.first().is_some_and(|r| r.start == 0)
                && layers.iter().all(|r| !r.is_empty())
                && layers.windows(2).all(|w| w[0].end == w[1].start),
            "a split's layers are one contiguous run per stage from 0: {layers:?}"
        );
        for (s, r) in self.stages.iter_mut().zip(layers) {
            s.layers = r.clone();
        }
    }

    /// The stages, in pipeline order.
    pub fn stages(&self) -> &[Stage] {
        &self.stages
    }

    /// The stage that computes layer `il` (the last for a layer past the end).
    pub fn stage_of(&self, il: usize) -> usize {
        self.stages
            .iter()
            .position(|s| s.layers.contains(&il))
            .unwrap_or(self.stages.len() - 1)
    }

    /// The stage computing now and its backend.
    pub fn current(&self) -> (usize, &AnyBackend) {
        let i = self.cur.load(Ordering::Relaxed);
        (i, &self.stages[i].be)
    }

    /// [`Backend::enter_layer`]: at layer 0 (the start of a step) the first stage computes again and begins its
    /// part of the step; at a stage's first layer the stage before ends its part (its graph runs), that stage
    /// takes over (after the copies the stages before it made in shared KV blocks) and the answer is `true` (its
    /// part begins at [`Split::carried_in`]). Within a stage nothing changes (no copies are shared: a stage's copies are made at its
    /// first layer's store, before the next stage takes over).
    pub fn enter_layer(&self, il: usize) -> bool {
        let to = if il == 0 { 0 } else { self.stage_of(il) };
        let from = self.cur.swap(to, Ordering::Relaxed);
        if to != from {
            // The stage left ends its part of the step (its graph runs) before its values are read back.
            self.end_stage_step();
            self.share_kv_copies();
        }
        if il == 0 {
            // The first stage has nothing carried in: its part of the step begins now.
            self.begin_stage_step();
        }
        to != from && il > 0
    }

    /// [`Backend::carried`]: the current stage begins its part of the step, once the carried values are in.
    pub fn carried_in(&self) {
        self.begin_stage_step();
    }

    /// [`Backend::step_begin`]: remembered, and begun on each stage in turn as the forward pass reaches it.
    pub fn step_begin(&self, n_tok: usize, key: StepKey) {
        self.end_stage_step();
        let mut st = self.lock_step();
        st.step = Some((n_tok, key));
        st.carried.clear();
    }

    /// [`Backend::step_end`]: the open stage's part of the step ends (on the last stage, its graph runs), and
    /// what the step carried is kept for a whole-step replay of its key.
    pub fn step_end(&self) {
        self.end_stage_step();
        let mut st = self.lock_step();
        if let Some((_, key)) = st.step.take() {
            let carried = std::mem::take(&mut st.carried);
            drop(st);
            let mut replays = self.replays.lock().unwrap_or_else(|e| e.into_inner());
            match carried.is_empty() {
                true => replays.remove(&key),
                false => replays.insert(key, carried),
            };
        }
    }

    fn lock_step(&self) -> std::sync::MutexGuard<'_, StepState> {
        self.step.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Begins the step on the current stage, if a step is under way and no stage's part of it is open.
    fn begin_stage_step(&self) {
        let mut st = self.lock_step();
        if let (Some((n_tok, key)), None) = (st.step, st.open) {
            let i = self.cur.load(Ordering::Relaxed);
            self.stages[i].be.step_begin(n_tok, key);
            st.open = Some(i);
        }
    }

    /// Ends the open stage's part of the step, if one is open.
    fn end_stage_step(&self) {
        let open = self.lock_step().open.take();
        if let Some(i) = open {
            self.stages[i].be.step_end();
        }
    }

    /// How the hidden state crosses into stage `i` (`None`: through host memory, or `i` is 0).
    pub fn link(&self, i: usize) -> Option<Link> {
        self.links.get(i).copied().flatten()
    }

    /// The time one crossing into each stage after the first takes, carrying `bytes` ([`Split::link`] by
    /// [`crate::backend::cuda::CudaBackend::measure_send`]; `None` for a crossing through host memory).
    ///
    /// Errors: an allocation or a copy failed.
    pub fn measure_links(&self, bytes: usize) -> Result<Vec<Option<f64>>, super::cuda::error::CudaError> {
        (1..self.stages.len())
            .map(
                |i| match (self.link(i), self.stages[i - 1].be.cuda(), self.stages[i].be.cuda()) {
                    (Some(_), Some(a), Some(b)) => a.measure_send(b, bytes).map(Some),
                    _ => Ok(None),
                },
            )
            .collect()
    }

    /// [`Backend::carry`]: `len` values of `buf` from the previous stage's buffer into the current one's (sized
    /// by the caller): a device copy where [`Split::link`] has one (the next stage's stream waits for it, no host
    /// round trip), else through host memory.
    pub fn carry(&self, buf: &mut AnyBuf, len: usize) {
        let i = self.cur.load(Ordering::Relaxed);
        assert!(i > 0, "carry: the first stage has no stage before it");
        let AnyBuf::Staged(per) = buf else {
            panic!("carry: a buffer the split did not size")
        };
        let (before, here) = per.split_at_mut(i);
        let device = match (&before[i - 1], &here[0], self.link(i)) {
            (AnyBuf::Dev(src), AnyBuf::Dev(dst), Some(_)) => {
                assert!(
                    len <= src.capacity() && len <= dst.capacity(),
                    "carry: {len} values from a buffer of {} into one of {}",
                    src.capacity(),
                    dst.capacity()
                );
                Some((src.ptr(), dst.ptr()))
            }
            _ => None,
        };
        match device {
            Some((src, dst)) => {
                self.send(i, src, dst, len);
                // Kept for a whole-step replay of this key: decode steps only (one token), the ones it takes.
                let mut st = self.lock_step();
                if st.step.is_some_and(|(n_tok, _)| n_tok == 1) {
                    st.carried.push(Carried { into: i, src, dst, len });
                }
            }
            None => {
                let mut host = self.bounce.lock().unwrap_or_else(|e| e.into_inner());
                host.resize(len, 0.0);
                self.stages[i - 1].be.download(&before[i - 1], 0, &mut host[..len]);
                self.stages[i].be.upload(&host[..len], &mut here[0]);
            }
        }
        self.count_carry(len);
    }

    /// `len` values from address `src` of stage `i - 1` to `dst` of stage `i`, by [`Split::link`]'s device copy
    /// (there is one: both stages are GPUs).
    fn send(&self, i: usize, src: u64, dst: u64, len: usize) {
        let (a, b) = (
            self.stages[i - 1].be.cuda().expect("a GPU stage"),
            self.stages[i].be.cuda().expect("a GPU stage"),
        );
        a.send_f32(src, b, dst, len);
    }

    fn count_carry(&self, len: usize) {
        self.carried.fetch_add(1, Ordering::Relaxed);
        self.carried_values.fetch_add(len as u64, Ordering::Relaxed);
    }

    /// [`Backend::replay_step`]: when every stage holds a verified graph of `key` (no device allocation since,
    /// so the carried buffers' addresses still hold), every boundary has a device copy ([`Split::link`]), the
    /// last forward pass of `key` carried into every stage
    /// after the first, and every stage's expert cache decides this step as its graph was recorded, each stage's
    /// graph runs in turn, with the carried values copied between them. `false` (nothing launched) otherwise:
    /// the forward pass then runs, and the stages that had decided keep their open decisions
    /// ([`crate::backend::cuda::CudaBackend::replay_ready`]), so no stage counts or routes the step twice.
    pub fn replay_step(&self, key: StepKey, ids: &[u32], positions: &[u32]) -> bool {
        let replays = self.replays.lock().unwrap_or_else(|e| e.into_inner());
        let Some(carried) = replays.get(&key) else {
            return false;
        };
        // A link into every stage after the first makes every stage a GPU.
        let n = self.stages.len();
        if !(1..n).all(|i| self.link(i).is_some() && carried.iter().any(|b| b.into == i)) {
            return false;
        }
        let cuda = |i: usize| self.stages[i].be.cuda().expect("a GPU stage");
        // Every stage decides first; only then does any graph run.
        if !(0..n).all(|i| cuda(i).replay_ready(key)) {
            return false;
        }
        for i in 0..n {
            for b in carried.iter().filter(|b| b.into == i) {
                self.send(i, b.src, b.dst, b.len);
                self.count_carry(b.len);
            }
            self.cur.store(i, Ordering::Relaxed);
            cuda(i).replay_now(key, ids, positions);
        }
        self.replayed.fetch_add(1, Ordering::Relaxed);
        true
    }

    /// Steps replayed whole ([`Split::replay_step`]) since the split was made.
    pub fn replayed(&self) -> u64 {
        self.replayed.load(Ordering::Relaxed)
    }

    /// [`Backend::release_slot`]'s part here: the replays of sequence `slot`'s steps are dropped.
    pub fn forget_slot(&self, slot: SeqSlot) {
        self.replays
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .retain(|k, _| k.slot != slot);
    }

    /// Buffers carried across a boundary since the split was made, and their values (f32 each).
    pub fn carried(&self) -> (u64, u64) {
        (
            self.carried.load(Ordering::Relaxed),
            self.carried_values.load(Ordering::Relaxed),
        )
    }

    /// Hands the copy-on-write copies each GPU stage made to every other one (each makes them in its own layers'
    /// arrays before its next kernels).
    pub fn share_kv_copies(&self) {
        let made: Vec<_> = self
            .stages
            .iter()
            .map(|s| s.be.cuda().map(|c| c.take_kv_copies()).unwrap_or_default())
            .collect();
        for (i, copies) in made.iter().enumerate() {
            for (j, s) in self.stages.iter().enumerate() {
                if let (true, Some(c)) = (i != j, s.be.cuda()) {
                    c.make_kv_copies(copies);
                }
            }
        }
    }

    /// [`Backend::reserve_kv`]: every stage's, each seeing the copies the ones before it made.
    pub fn reserve_kv(&self, kv: &crate::state::kv::KvCache, from: usize, to: usize) {
        for s in &self.stages {
            s.be.reserve_kv(kv, from, to);
            self.share_kv_copies();
        }
    }
}
