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
//! One step runs at a time (the engine's step driver is one thread): the current stage is the split's state.

use std::ops::Range;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use super::Backend;
use super::cuda::select::{AnyBackend, AnyBuf};
use crate::device::Device;

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
    /// The host copy of a carried buffer (crossing between devices through host memory).
    bounce: Mutex<Vec<f32>>,
    /// Buffers carried across a boundary so far, and their values.
    carried: AtomicU64,
    carried_values: AtomicU64,
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
        Split {
            stages,
            cur: AtomicUsize::new(0),
            bounce: Mutex::new(Vec::new()),
            carried: AtomicU64::new(0),
            carried_values: AtomicU64::new(0),
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

    /// [`Backend::enter_layer`]: at layer 0 (the start of a step) the first stage computes again; at a stage's
    /// first layer that stage takes over (after the copies the stages before it made in shared KV blocks), and
    /// the answer is `true`. Within a stage nothing changes (no copies are shared: a stage's copies are made at its
    /// first layer's store, before the next stage takes over).
    pub fn enter_layer(&self, il: usize) -> bool {
        let to = if il == 0 { 0 } else { self.stage_of(il) };
        let from = self.cur.swap(to, Ordering::Relaxed);
        if to == from {
            return false;
        }
        self.share_kv_copies();
        il > 0
    }

    /// [`Backend::carry`]: `len` values of `buf` from the previous stage's buffer into the current one's (sized
    /// by the caller), through host memory.
    pub fn carry(&self, buf: &mut AnyBuf, len: usize) {
        let i = self.cur.load(Ordering::Relaxed);
        assert!(i > 0, "carry: the first stage has no stage before it");
        let AnyBuf::Staged(per) = buf else {
            panic!("carry: a buffer the split did not size")
        };
        let (before, here) = per.split_at_mut(i);
        let mut host = self.bounce.lock().unwrap_or_else(|e| e.into_inner());
        host.resize(len, 0.0);
        self.stages[i - 1].be.download(&before[i - 1], 0, &mut host[..len]);
        self.stages[i].be.upload(&host[..len], &mut here[0]);
        self.carried.fetch_add(1, Ordering::Relaxed);
        self.carried_values.fetch_add(len as u64, Ordering::Relaxed);
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
