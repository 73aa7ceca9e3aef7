//! The VRAM expert cache (DESIGN.md section 3, "Expert cache"): one device allocation of `slots + staging` slots,
//! each holding one expert of one layer (gate, up and down, laid out by [`crate::experts::slot_layout`]), and the
//! host-side slot table and policy ([`SlotCache`]) that decide which expert a slot holds.
//!
//! A MoE layer's step reads its routing back, then asks [`ExpertPool::slot`] for each expert it needs: a cached
//! expert is used in place; a missing one is uploaded from the host store (the page-locked arena, or the mapped
//! GGUF) into a cache slot (admitted: decode steps evict the policy's victim unless the step itself uses it;
//! prefill steps take free slots only, so a prompt does not flush what decode learned) or a staging slot (for this
//! step only). Kernels then reach every expert by slot id, so results are the bytes' results: bit-identical to
//! the all-resident path.
//!
//! At decode a miss may instead be computed by the CPU ([`MissPlan`], `--miss-policy`):
//! [`ExpertPool::choose_cpu_misses`] picks which, the GPU reads a placeholder slot for those routing slots, and the
//! CPU's rows (computed on spinning workers while this thread queues the GPU's launches:
//! [`CpuMisses::compute_beside`]) replace what it wrote before the experts are summed. Such results differ from
//! the all-resident run by the two backends' rounding (the CPU's int8 dot products against the GPU's), never by
//! more.
//!
//! Ordering. Decode uploads go on the compute stream, in order with the launches around them. Prefill uploads go
//! on a copy stream, double-buffered: the staging slots are two halves, and while the compute stream runs the
//! GEMMs of one group of experts (one half), the copy stream uploads the next group into the other half. Events
//! keep it safe: a group's launches wait for its uploads ([`ExpertPool::ready`]); an upload into a half waits for
//! the launches that last read it ([`ExpertPool::group_done`]); a layer's first upload waits for everything queued
//! on the compute stream before it (decode steps included).

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaEvent, CudaStream, PinnedHostSlice};

use super::buffer::DevBuf;
use super::error::CudaError;
use crate::backend::Experts;
use crate::backend::cpu::spin::SpinPool;
use crate::backend::cpu::{CpuBackend, ExpertRate, ExpertRowsScratch, Workers};
use crate::experts::cache::{Access, CacheStats, Policy, SlotCache};
use crate::experts::miss::{MissPlan, MissPolicy};
use crate::experts::{ExpertId, slot_layout};

/// What the pool is made for (sized by the memory plan: `memory::ExpertPlacement::Cache`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExpertCacheConfig {
    /// Layers of the model (dense layers included: the slot table is indexed by layer).
    pub n_layer: usize,
    pub n_expert: usize,
    /// Cache slots (0: every expert is staged).
    pub slots: usize,
    /// Staging slots (at least the distinct experts of one decode step).
    pub staging: usize,
    /// Bytes per slot (a multiple of [`crate::experts::SLOT_ALIGN`]).
    pub slot_bytes: usize,
    pub policy: Policy,
}

/// What the cache did in one phase: the slot cache's counts, and the bytes uploaded (admitted and staged
/// experts alike).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct PhaseStats {
    #[serde(flatten)]
    pub cache: CacheStats,
    /// Bytes copied from host memory to the device.
    pub bytes_uploaded: u64,
    /// Misses computed by the CPU (each one (layer, expert) of a step; counted among `cache.bypassed`).
    pub cpu_computed: u64,
    /// Wall time the CPU spent computing them, microseconds (the GPU works on the hits meanwhile).
    pub cpu_us: u64,
}

/// The cache's counts by phase since it was made, or since [`super::CudaBackend::take_expert_cache_stats`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct ExpertCacheStats {
    pub prefill: PhaseStats,
    pub decode: PhaseStats,
}

const UNSET: u32 = u32::MAX;
/// `slot_of`'s value for an expert the CPU computes in this layer-step.
const ON_CPU: u32 = u32::MAX - 1;

/// A decode layer-step's misses computed by the CPU: the jobs, their results, and the host buffers they use.
#[derive(Default)]
pub(super) struct CpuMisses {
    /// `(expert, token)` of each job.
    jobs: Vec<(u32, u32)>,
    /// The routing slot of each job (whose row of the experts' outputs the job's result replaces).
    routing_slots: Vec<u32>,
    /// The step's activations read back (page-locked, so the copy is queued beside the routing's),
    /// `[n_tok][n_embd]` in the first `x_len` values.
    x: Option<PinnedHostSlice<f32>>,
    x_len: usize,
    /// Page-locked, so its upload is asynchronous: `[jobs][n_embd]` results, then the routing slots as `u32`
    /// bits (what `scatter_rows_f32` reads). Written only after the stream has passed its last upload (each
    /// decode layer-step first reads its routing back, which waits for the stream).
    out: Option<PinnedHostSlice<f32>>,
    /// Values of `out` the current jobs fill.
    len: usize,
    scratch: ExpertRowsScratch,
    /// The threads that compute them (made when a miss plan may use the CPU; else rayon's).
    workers: Option<SpinPool>,
    /// Wall time of [`CpuMisses::compute_beside`] calls since the pool last counted it, microseconds.
    busy_us: u64,
}

impl CpuMisses {
    /// Jobs of the current layer-step.
    pub(super) fn rows(&self) -> usize {
        self.jobs.len()
    }

    /// Queues a copy of the step's activations (`n` values at device address `src`) into the page-locked buffer
    /// (grown in `ctx` when short). The caller waits for the stream before [`CpuMisses::compute_beside`] reads them
    /// (the routing's read-back does).
    ///
    /// Errors: the buffer could not be allocated, or the copy queued.
    pub(super) fn queue_x_read(
        &mut self,
        ctx: &Arc<CudaContext>,
        stream: &Arc<CudaStream>,
        src: u64,
        n: usize,
    ) -> Result<(), CudaError> {
        let x = pinned(&mut self.x, ctx, n)?;
        // SAFETY: `src` holds the step's `n` activations; `x` holds at least `n` page-locked values, read by the
        // host only after the stream is waited for, and not freed before (a larger buffer replaces it only here,
        // when the stream has passed the copy: the last read-back waited for it).
        unsafe { cudarc::driver::result::memcpy_dtoh_async(&mut x[..n], src, stream.cu_stream()) }
            .map_err(CudaError::driver("reading the activations back for the CPU's experts"))?;
        self.x_len = n;
        Ok(())
    }

    /// Computes the jobs from `x` into the page-locked buffer (grown in `ctx` when short) while `beside` runs on
    /// this thread ([`CpuBackend::expert_rows`]). Returns `beside`'s value.
    ///
    /// Errors: the page-locked buffer could not be allocated (then nothing was computed and `beside` did not run).
    pub(super) fn compute_beside<R>(
        &mut self,
        ctx: &Arc<CudaContext>,
        ex: &Experts<'_>,
        beside: impl FnOnce() -> R,
    ) -> Result<R, CudaError> {
        let n_embd = ex.gate.cols;
        let rows = self.jobs.len() * n_embd;
        self.len = rows + self.jobs.len();
        let out = pinned(&mut self.out, ctx, self.len)?;
        let workers = Workers::of(self.workers.as_ref());
        let x = self
            .x
            .as_ref()
            .expect("read back before computed")
            .as_slice()
            .map_err(CudaError::driver("page-locked buffer"))?;
        let t = std::time::Instant::now();
        let r = CpuBackend.expert_rows(
            ex,
            &x[..self.x_len],
            &self.jobs,
            &mut out[..rows],
            &mut self.scratch,
            workers,
            beside,
        );
        for (o, &j) in out[rows..self.len].iter_mut().zip(&self.routing_slots) {
            *o = f32::from_bits(j);
        }
        self.busy_us += t.elapsed().as_micros() as u64;
        Ok(r)
    }
}

/// The page-locked buffer in `slot`, grown in `ctx` to at least `n` values; its values as a slice.
///
/// Errors: the allocation failed.
fn pinned<'a>(
    slot: &'a mut Option<PinnedHostSlice<f32>>,
    ctx: &Arc<CudaContext>,
    n: usize,
) -> Result<&'a mut [f32], CudaError> {
    if slot.as_ref().is_none_or(|b| b.len() < n) {
        *slot = None;
        // SAFETY: the values are written (by a copy or the CPU) before anything reads them.
        *slot = Some(
            unsafe { ctx.alloc_pinned_with_flags::<f32>(n.max(1024), 0) }
                .map_err(CudaError::driver(format!("page-locked buffer of {} bytes", n * 4)))?,
        );
    }
    slot.as_mut()
        .expect("just sized")
        .as_mut_slice()
        .map_err(CudaError::driver("page-locked buffer"))
}

/// The device slots and their bookkeeping.
pub struct ExpertPool {
    buf: DevBuf,
    cache: SlotCache,
    config: ExpertCacheConfig,
    /// This layer-step's slot of each expert of the layer, or [`UNSET`].
    slot_of: Vec<u32>,
    /// The experts `slot_of` names (to clear it).
    placed: Vec<u32>,
    /// Staging slots taken in this layer-step (or group of a prefill step).
    staged: usize,
    layer: u32,
    stats: ExpertCacheStats,
    /// Prefill uploads run here.
    copy: Arc<CudaStream>,
    /// Recorded on `copy` after a group's uploads; the compute stream waits on it.
    ready: CudaEvent,
    /// Per staging half: recorded on the compute stream after the launches of the last group in it.
    done: [CudaEvent; 2],
    /// Whether `done[h]` was recorded in this layer-step.
    done_recorded: [bool; 2],
    /// The staging half prefill groups fill now.
    half: usize,
    /// Whether the copy stream waits for `done[half]` already (in this group).
    copy_waits: bool,
    /// Uploads on `copy` the compute stream has not waited for.
    pending: bool,
    /// Whether this layer-step is a decode step's.
    decoding: bool,
    /// Recorded on the compute stream when a prefill layer-step begins.
    begun: CudaEvent,
    /// Where decode misses are computed.
    miss: MissPlan,
    /// This layer-step's CPU-computed misses.
    pub(super) cpu: CpuMisses,
}

impl ExpertPool {
    /// Allocates the slots.
    ///
    /// Errors: the device cannot allocate them.
    pub(super) fn new(stream: &Arc<CudaStream>, config: ExpertCacheConfig) -> Result<ExpertPool, CudaError> {
        assert!(
            config.staging > 0 && config.n_expert > 0,
            "an expert pool needs staging slots"
        );
        let bytes = (config.slots + config.staging)
            .checked_mul(config.slot_bytes)
            .expect("the plan sized the pool");
        let ctx = stream.context();
        let ev = || ctx.new_event(None).map_err(CudaError::driver("event creation"));
        Ok(ExpertPool {
            copy: ctx.new_stream().map_err(CudaError::driver("copy stream creation"))?,
            ready: ev()?,
            done: [ev()?, ev()?],
            begun: ev()?,
            done_recorded: [false; 2],
            half: 0,
            copy_waits: false,
            pending: false,
            decoding: false,
            buf: DevBuf::alloc(stream, bytes)?,
            cache: SlotCache::new(config.n_layer, config.n_expert, config.slots, config.policy),
            config,
            slot_of: vec![UNSET; config.n_expert],
            placed: Vec::new(),
            staged: 0,
            layer: 0,
            stats: ExpertCacheStats::default(),
            miss: MissPlan::default(),
            cpu: CpuMisses::default(),
        })
    }

    /// Where decode misses are computed from now on. A plan that may use the CPU starts its spinning workers
    /// (one fewer than rayon's threads: the stepping thread works beside them).
    ///
    /// Errors: the OS refused a thread.
    pub(super) fn set_miss_plan(&mut self, plan: MissPlan) -> std::io::Result<()> {
        if plan.policy != MissPolicy::Upload && self.cpu.workers.is_none() {
            self.cpu.workers = Some(SpinPool::new(rayon::current_num_threads().saturating_sub(1))?);
        }
        self.miss = plan;
        Ok(())
    }

    /// How fast the CPU computes `ex`'s experts on the workers misses use ([`CpuBackend::expert_rate`]).
    pub(super) fn cpu_expert_rate(&self, ex: &Experts<'_>, k: usize) -> ExpertRate {
        CpuBackend.expert_rate(ex, k, Workers::of(self.cpu.workers.as_ref()))
    }

    /// Whether the miss plan could give the CPU any of `ex`'s experts in a step of `slots` routing slots (when
    /// every one of them misses).
    pub(super) fn may_use_cpu(&self, ex: &Experts<'_>, slots: usize) -> bool {
        self.miss.cpu_count(slots, ex.expert_bytes()) > 0
    }

    pub(super) fn config(&self) -> &ExpertCacheConfig {
        &self.config
    }

    /// Bytes of device memory the slots take.
    pub(super) fn bytes(&self) -> usize {
        self.buf.bytes
    }

    /// The device address of matrix `m` (0 gate, 1 up, 2 down) of slot 0 for `ex`'s layout: slot `s` is
    /// `slot_bytes * s` further.
    pub(super) fn base(&self, ex: &Experts<'_>, m: usize) -> u64 {
        self.buf.ptr + layout(ex).0[m] as u64
    }

    /// Bytes from one slot to the next.
    pub(super) fn stride(&self) -> usize {
        self.config.slot_bytes
    }

    /// Starts a layer-step of `ex`'s layer (`decode`: a decode step's, whose uploads go on the compute stream):
    /// no expert has a slot for it yet.
    ///
    /// Errors: recording or waiting on an event failed.
    pub(super) fn begin(&mut self, stream: &Arc<CudaStream>, ex: &Experts<'_>, decode: bool) -> Result<(), CudaError> {
        for &e in &self.placed {
            self.slot_of[e as usize] = UNSET;
        }
        self.placed.clear();
        self.staged = 0;
        self.layer = ex.layer as u32;
        self.decoding = decode;
        self.half = 0;
        self.done_recorded = [false; 2];
        self.copy_waits = false;
        if !decode {
            // The copy stream starts after everything queued before this layer (earlier reads of any slot).
            let e = || CudaError::driver("ordering the copy stream");
            self.begun.record(stream).map_err(e())?;
            self.copy.wait(&self.begun).map_err(e())?;
        }
        let (_, span) = layout(ex);
        assert!(
            span <= self.config.slot_bytes && ex.n_expert == self.config.n_expert && ex.layer < self.config.n_layer,
            "layer {}'s experts ({span} bytes) do not fit the pool's slots ({} bytes)",
            ex.layer,
            self.config.slot_bytes
        );
        Ok(())
    }

    /// Staging slots a group may take: all of them at decode, one half in prefill.
    fn group_capacity(&self) -> usize {
        if self.decoding {
            self.config.staging
        } else {
            (self.config.staging / 2).max(1)
        }
    }

    /// Makes the compute stream wait for the uploads queued on the copy stream (before launches that read them).
    ///
    /// Errors: recording or waiting on an event failed.
    pub(super) fn ready(&mut self, stream: &Arc<CudaStream>) -> Result<(), CudaError> {
        if self.pending {
            let e = || CudaError::driver("waiting for expert uploads");
            self.ready.record(&self.copy).map_err(e())?;
            stream.wait(&self.ready).map_err(e())?;
            self.pending = false;
        }
        Ok(())
    }

    /// Ends a prefill group whose launches are queued: the next group stages into the other half, once the
    /// launches that last read it are done.
    ///
    /// Errors: recording the event failed.
    pub(super) fn group_done(&mut self, stream: &Arc<CudaStream>) -> Result<(), CudaError> {
        self.done[self.half]
            .record(stream)
            .map_err(CudaError::driver("recording a group's end"))?;
        self.done_recorded[self.half] = true;
        // One staging slot (a model of one expert) has one half.
        self.half = if self.config.staging >= 2 {
            (self.half + 1) % 2
        } else {
            0
        };
        self.copy_waits = false;
        self.reset_staging();
        Ok(())
    }

    /// Staging slots are free again: the launches that read them are queued (`group_done`'s event guards them).
    fn reset_staging(&mut self) {
        for &e in &self.placed {
            if self.slot_of[e as usize] as usize >= self.config.slots {
                self.slot_of[e as usize] = UNSET;
            }
        }
        self.placed.retain(|&e| self.slot_of[e as usize] != UNSET);
        self.staged = 0;
    }

    /// The slot expert `e` of the current layer is in for this step, uploading it from `ex`'s host bytes when it
    /// is not cached. At decode a miss may evict the policy's victim (unless this step uses it); in prefill only a
    /// free slot is taken. `Ok(None)`: it must be staged and the group's staging slots are taken (make the group's
    /// launches wait with [`ExpertPool::ready`], queue them, then [`ExpertPool::group_done`]).
    ///
    /// Errors: an upload failed.
    pub(super) fn slot(
        &mut self,
        stream: &Arc<CudaStream>,
        ex: &Experts<'_>,
        e: u32,
    ) -> Result<Option<u32>, CudaError> {
        if self.slot_of[e as usize] != UNSET {
            return Ok(Some(self.slot_of[e as usize]));
        }
        let id = ExpertId {
            layer: self.layer,
            expert: e,
        };
        let cached = self.cache.slot_of(id).is_some();
        let admit = !cached && self.can_admit();
        if !cached && !admit && self.staged == self.group_capacity() {
            return Ok(None);
        }
        let access = self.cache.access(id, admit);
        let slot = match access {
            Access::Hit { slot } => slot,
            Access::Admitted { slot, .. } => {
                self.upload(stream, ex, e, slot)?;
                slot
            }
            Access::Bypassed => {
                let first = if self.decoding {
                    0
                } else {
                    self.half * self.group_capacity()
                };
                let slot = (self.config.slots + first + self.staged) as u32;
                self.staged += 1;
                self.upload(stream, ex, e, slot)?;
                slot
            }
        };
        let phase = if self.decoding {
            &mut self.stats.decode
        } else {
            &mut self.stats.prefill
        };
        phase.cache += self.cache.take_stats();
        if !matches!(access, Access::Hit { .. }) {
            phase.bytes_uploaded += ex.expert_bytes();
        }
        self.slot_of[e as usize] = slot;
        self.placed.push(e);
        Ok(Some(slot))
    }

    /// Whether a miss now may take a cache slot: a free one always; at decode, the policy's victim unless this
    /// layer-step uses it.
    fn can_admit(&self) -> bool {
        if self.cache.has_free_slot() {
            return true;
        }
        self.decoding
            && self
                .cache
                .would_evict()
                .is_some_and(|v| v.layer != self.layer || self.slot_of[v.expert as usize] == UNSET)
    }

    /// Copies expert `e`'s gate, up and down rows into `slot`: on the compute stream at decode, else on the copy
    /// stream (into a staging half once the launches that last read it are done).
    fn upload(&mut self, stream: &Arc<CudaStream>, ex: &Experts<'_>, e: u32, slot: u32) -> Result<(), CudaError> {
        if !self.decoding {
            if slot as usize >= self.config.slots && self.done_recorded[self.half] && !self.copy_waits {
                self.copy
                    .wait(&self.done[self.half])
                    .map_err(CudaError::driver("ordering a staging upload"))?;
                self.copy_waits = true;
            }
            self.pending = true;
        }
        let stream = if self.decoding { stream } else { &self.copy };
        let (offsets, _) = layout(ex);
        let bytes = layout_bytes(ex);
        let dst = self.buf.ptr + slot as u64 * self.config.slot_bytes as u64;
        for (m, (w, (&off, &len))) in [&ex.gate, &ex.up, &ex.down]
            .iter()
            .zip(offsets.iter().zip(bytes.iter()))
            .enumerate()
        {
            let src = &w.data[e as usize * len..(e as usize + 1) * len];
            // SAFETY: `dst + off` is inside the pool (slot < slots + staging, the layout fits a slot: `begin`);
            // `src` is the expert store's host memory, which outlives the step (the model owns it and the stream
            // is drained before a model is dropped).
            unsafe { cudarc::driver::result::memcpy_htod_async(dst + off as u64, src, stream.cu_stream()) }.map_err(
                CudaError::driver(format!("uploading expert {e} of layer {} (matrix {m})", self.layer)),
            )?;
        }
        Ok(())
    }

    /// Chooses which of a decode layer-step's misses the CPU computes (after [`ExpertPool::begin`], before any
    /// [`ExpertPool::place_decode`]): `ids` holds each routing slot's expert (`[n_tok][k]`). The miss plan gives
    /// the CPU some of the step's distinct misses (those fewest tokens chose, the router's last choices first);
    /// each of their routing slots becomes a job of [`ExpertPool::cpu`].
    /// Nothing is queued on the device, so the caller can read the step's activations back into `cpu.x` without
    /// waiting for uploads. Returns whether the CPU has jobs (then compute them with [`CpuMisses::compute_beside`]
    /// and upload them with [`ExpertPool::upload_cpu_rows`]).
    pub(super) fn choose_cpu_misses(&mut self, ex: &Experts<'_>, ids: &[u32], k: usize) -> bool {
        self.cpu.jobs.clear();
        self.cpu.routing_slots.clear();
        let layer = self.layer;
        // The step's distinct misses with their token counts, in the order the CPU takes them: the fewest tokens
        // first (the CPU computes an expert once per token, the link carries it once), later in routing order
        // first among equals (the router's first choices keep the link and the cache).
        let mut misses: Vec<(u32, usize)> = Vec::new();
        for &e in ids.iter().rev() {
            if self.cache.slot_of(ExpertId { layer, expert: e }).is_some() {
                continue;
            }
            match misses.iter_mut().find(|(m, _)| *m == e) {
                Some((_, n)) => *n += 1,
                None => misses.push((e, 1)),
            }
        }
        misses.sort_by_key(|&(_, n)| n);
        let tokens: Vec<usize> = misses.iter().map(|&(_, n)| n).collect();
        let n_cpu = self.miss.cpu_take(&tokens, ex.expert_bytes());
        for &(e, _) in &misses[..n_cpu] {
            let access = self.cache.access(ExpertId { layer, expert: e }, false);
            debug_assert_eq!(access, Access::Bypassed);
            self.slot_of[e as usize] = ON_CPU;
            self.placed.push(e);
            self.stats.decode.cache += self.cache.take_stats();
            self.stats.decode.cpu_computed += 1;
        }
        for (j, &e) in ids.iter().enumerate() {
            if self.slot_of[e as usize] == ON_CPU {
                self.cpu.jobs.push((e, (j / k) as u32));
                self.cpu.routing_slots.push(j as u32);
            }
        }
        !self.cpu.jobs.is_empty()
    }

    /// Rewrites each routing slot's expert in `ids` to the slot the kernels read it from (after
    /// [`ExpertPool::choose_cpu_misses`]): hits in place, other misses uploaded as [`ExpertPool::slot`] does, and
    /// the CPU's a placeholder slot whose output the CPU's rows replace.
    ///
    /// Errors: an upload failed.
    pub(super) fn place_decode(
        &mut self,
        stream: &Arc<CudaStream>,
        ex: &Experts<'_>,
        ids: &mut [u32],
    ) -> Result<(), CudaError> {
        for e in ids.iter_mut() {
            *e = if self.slot_of[*e as usize] == ON_CPU {
                // Any slot the kernels may read.
                self.config.slots as u32
            } else {
                self.slot(stream, ex, *e)?
                    .expect("the staging slots hold a decode step's experts")
            };
        }
        Ok(())
    }

    /// Queues the upload of the CPU's results ([`CpuMisses::compute_beside`]) to `dst`: `rows * (n_embd + 1)` values,
    /// the rows then their routing slots; and counts the CPU's busy time.
    ///
    /// Errors: the copy could not be queued.
    pub(super) fn upload_cpu_rows(&mut self, stream: &Arc<CudaStream>, dst: u64) -> Result<(), CudaError> {
        self.stats.decode.cpu_us += std::mem::take(&mut self.cpu.busy_us);
        let c = &mut self.cpu;
        let out = c
            .out
            .as_mut()
            .expect("computed before uploaded")
            .as_mut_slice()
            .map_err(CudaError::driver("page-locked buffer"))?;
        // SAFETY: `dst` holds `len` values (the caller sized it); `out` is page-locked and not written again
        // before the stream has passed this copy (the next layer-step reads its routing back first; the pool is
        // dropped only after the stream is drained).
        unsafe { cudarc::driver::result::memcpy_htod_async(dst, &out[..c.len], stream.cu_stream()) }
            .map_err(CudaError::driver("uploading the CPU's expert rows"))
    }

    /// The counts so far, and zero them.
    pub(super) fn take_stats(&mut self) -> ExpertCacheStats {
        std::mem::take(&mut self.stats)
    }

    pub(super) fn stats(&self) -> ExpertCacheStats {
        self.stats
    }

    /// Waits for the copy stream's uploads.
    ///
    /// Errors: an upload failed.
    pub(super) fn synchronize(&self) -> Result<(), CudaError> {
        self.copy
            .synchronize()
            .map_err(CudaError::driver("copy stream synchronize"))
    }
}

impl Drop for ExpertPool {
    /// Uploads still queued on the copy stream read host memory and write the slots: wait for them first.
    fn drop(&mut self) {
        let _ = self.copy.synchronize();
    }
}

/// One expert's gate, up and down bytes in `ex`'s stacked tensors.
fn layout_bytes(ex: &Experts<'_>) -> [usize; 3] {
    [&ex.gate, &ex.up, &ex.down].map(|w| w.data.len() / ex.n_expert)
}

/// The slot layout of `ex`'s experts.
fn layout(ex: &Experts<'_>) -> ([usize; 3], usize) {
    slot_layout(layout_bytes(ex))
}

/// Host memory page-locked for the device (`cuMemHostRegister`): the expert arena, so uploads from it are
/// asynchronous and run at the link's pinned rate. Unlocked on drop.
pub struct HostPin {
    ptr: usize,
    bytes: usize,
    ctx: Arc<cudarc::driver::CudaContext>,
}

impl HostPin {
    pub(super) fn new(gpu: &super::Gpu, bytes: &[u8]) -> Result<HostPin, CudaError> {
        gpu.ctx
            .bind_to_thread()
            .map_err(CudaError::driver("binding the context"))?;
        let flags = cudarc::driver::sys::CU_MEMHOSTREGISTER_PORTABLE;
        // SAFETY: `bytes` is a live host allocation; the guard unregisters it before its owner frees it
        // (`runtime::Engine` drops the guard first).
        unsafe {
            cudarc::driver::sys::cuMemHostRegister_v2(bytes.as_ptr() as *mut _, bytes.len(), flags)
                .result()
                .map_err(CudaError::driver(format!("cuMemHostRegister of {} bytes", bytes.len())))?;
        }
        Ok(HostPin {
            ptr: bytes.as_ptr() as usize,
            bytes: bytes.len(),
            ctx: gpu.ctx.clone(),
        })
    }

    /// Bytes locked.
    pub fn bytes(&self) -> usize {
        self.bytes
    }
}

impl Drop for HostPin {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: `ptr` was registered by `new` and is still allocated (see there).
            let _ = unsafe { cudarc::driver::sys::cuMemHostUnregister(self.ptr as *mut _) };
        }
    }
}
