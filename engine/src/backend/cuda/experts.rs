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
//! on the compute stream before it (decode steps included). On the device's slot table ([`DeviceTable`]), in a
//! step of one token, a layer's misses are fetched and computed on the backend's second stream while its hits are
//! computed on the first; the layer's sum waits for both (`Gpu::fork`, `Gpu::join`; `STRATA_FETCH_OVERLAP=0`, and
//! steps of several tokens: one stream, the fetch first).

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaEvent, CudaStream, PinnedHostSlice};

use super::buffer::DevBuf;
use super::error::CudaError;
use super::join::CpuJoin;
use crate::backend::Experts;
use crate::backend::cpu::spin::SpinPool;
use crate::backend::cpu::{CpuBackend, ExpertRate, ExpertRowsScratch, Workers};
use crate::experts::cache::{Access, CacheStats, Policy, SlotCache};
use crate::experts::miss::{DecodePath, MissPlan, MissPolicy, PathChooser};
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
    /// Experts each token chooses (top-k).
    pub k: usize,
    /// The page-locked expert arena as kernels address it, when the experts are in one: decode steps (of one token,
    /// and of several that fit [`DeviceTable::tokens_max`]) then keep the slot table on the device
    /// ([`DeviceTable`]), reading misses from it in place.
    pub arena: Option<HostMapping>,
    /// Whether such steps may use the device's table (`STRATA_DEVICE_SLOT_TABLE`; off: every decode step decides
    /// on the host, layer by layer).
    pub device_table: bool,
    /// At most this many misses of a MoE layer in a decode step take a cache slot (`--upload-cap`); the others
    /// are staged for that step alone, or computed by the CPU. `u32::MAX`: no cap.
    pub upload_cap: u32,
    /// On the device's table, in a step of one token, a layer's misses are copied in and computed on a second
    /// stream while its hits are computed (`STRATA_FETCH_OVERLAP`; off, and in steps of several tokens: copied in
    /// before any expert of the layer is computed).
    pub fetch_overlap: bool,
    /// There, the CPU computes its share of a layer's misses by the miss plan inside the step's graph
    /// ([`super::join`], `STRATA_CPU_JOIN`; off: a plan that uses the CPU takes the host's path, a round trip per
    /// layer).
    pub cpu_join: bool,
    /// Width of the model's activations (the CPU's joined jobs read a token's).
    pub n_embd: usize,
    /// On the device's table, once a layer's experts are computed, the next MoE layer's router is applied to this
    /// layer's input and the experts it picks that are not cached are copied in beside the rest of the step
    /// (`--expert-prefetch`; [`ExpertPool::table_prefetch`]).
    pub prefetch: bool,
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
    /// Experts the prefetch copied in before their layer's lookup (`--expert-prefetch`), into a cache slot (then
    /// counted in `cache.admitted` too, and a use is a cache hit) or a prefetch staging slot (then a use is a
    /// bypassed lookup, reported as staged); their bytes are in `bytes_uploaded`.
    pub prefetched: u64,
    /// Of those, the ones their layer's lookup then used (the others were wasted: `prefetched - prefetch_used`).
    pub prefetch_used: u64,
}

/// The cache's counts by phase since it was made, or since [`super::CudaBackend::take_expert_cache_stats`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct ExpertCacheStats {
    pub prefill: PhaseStats,
    pub decode: PhaseStats,
}

impl PhaseStats {
    /// Adds `o`'s counts (another cache's: a layer split's stages).
    pub fn add(&mut self, o: &PhaseStats) {
        self.cache += o.cache;
        self.bytes_uploaded += o.bytes_uploaded;
        self.cpu_computed += o.cpu_computed;
        self.cpu_us += o.cpu_us;
        self.prefetched += o.prefetched;
        self.prefetch_used += o.prefetch_used;
    }
}

impl ExpertCacheStats {
    /// Adds `o`'s counts, phase by phase.
    pub fn add(&mut self, o: &ExpertCacheStats) {
        self.prefill.add(&o.prefill);
        self.decode.add(&o.decode);
    }
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
fn pinned<'a, T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits>(
    slot: &'a mut Option<PinnedHostSlice<T>>,
    ctx: &Arc<CudaContext>,
    n: usize,
) -> Result<&'a mut [T], CudaError> {
    if slot.as_ref().is_none_or(|b| b.len() < n) {
        *slot = None;
        // SAFETY: the values are written (by a copy or the CPU) before anything reads them.
        *slot = Some(
            unsafe { ctx.alloc_pinned_with_flags::<T>(n.max(1024), 0) }.map_err(CudaError::driver(format!(
                "page-locked buffer of {} bytes",
                n * std::mem::size_of::<T>()
            )))?,
        );
    }
    slot.as_mut()
        .expect("just sized")
        .as_mut_slice()
        .map_err(CudaError::driver("page-locked buffer"))
}

/// `expert_lookup`'s log codes (kernels/experts.cu): a hit's slot, an admission's slot | `LOOKUP_ADMITTED`, or
/// `LOOKUP_STAGED`.
const LOOKUP_ADMITTED: u32 = 0x8000_0000;
const LOOKUP_STAGED: u32 = u32::MAX;
/// An expert id outside the model (nothing was looked up or fetched for it).
const LOOKUP_BAD: u32 = u32::MAX - 1;
/// A miss the CPU computes (`cpu_join`).
const LOOKUP_CPU: u32 = u32::MAX - 2;
/// A log word no lookup wrote (the step did not run that layer).
const LOG_EMPTY: u32 = u32::MAX;
/// `expert_prefetch`'s log codes besides an admission's slot | [`LOOKUP_ADMITTED`] (kernels/experts.cu).
const PREFETCH_CACHED: u32 = u32::MAX - 3;
const PREFETCH_SKIPPED: u32 = u32::MAX - 4;
const PREFETCH_STAGED: u32 = u32::MAX - 5;
/// `expert_lookup`'s code for a miss read from the prefetch's staging slot.
const LOOKUP_PREFETCHED: u32 = u32::MAX - 6;
/// `expert_lookup`'s code for an expert an earlier routing slot of the layer-step looked up (read where that one
/// is; not a lookup of its own).
const LOOKUP_REPEAT: u32 = u32::MAX - 7;
/// `expert_lookup`'s code for a miss past the staging slots (a step the host should not have run on the table).
const LOOKUP_NO_ROOM: u32 = u32::MAX - 8;
/// Blocks per matrix of `expert_fetch` unless `STRATA_FETCH_BLOCKS` says otherwise (two waves of 256 threads on
/// 132 SMs: enough loads in flight for the link).
const FETCH_BLOCKS: u32 = 264;

/// `expert_fetch`'s blocks per matrix: `STRATA_FETCH_BLOCKS` when it is a number from 1 to 4096, else
/// [`FETCH_BLOCKS`].
fn fetch_blocks() -> u32 {
    crate::switches::usize_in(crate::switches::FETCH_BLOCKS, 1..=4096).map_or(FETCH_BLOCKS, |n| n as u32)
}

/// Most tokens of a step on the device's slot table ([`DeviceTable::tokens_max`]) for a pool of `staging` staging
/// slots, `n_expert` experts a layer and top-`k`: as many as the staging slots hold the distinct experts of
/// (`staging / k`; any number when they hold one layer's every expert), at most [`super::MOE_DEVICE_TOKENS_MAX`]
/// and 1,024 routing slots (`expert_lookup`'s block, and what `moe_groups` groups).
fn tokens_on_table(staging: usize, n_expert: usize, k: usize) -> usize {
    let k = k.max(1);
    let staged = match staging >= n_expert {
        true => usize::MAX,
        false => staging / k,
    };
    staged
        .min(super::MOE_DEVICE_TOKENS_MAX)
        .min(super::MOE_GROUP_MAX_SLOTS / k)
        .max(1)
}

/// The device's copy of the slot table, for decode steps whose experts are in a mapped page-locked arena (DESIGN.md
/// section 3, "Expert cache": a step that hits decides on the device, inside the CUDA graph): steps of one token,
/// and steps of up to [`DeviceTable::tokens_max`] tokens (several sequences' decode tokens, or a short prompt
/// chunk), which are not graphs but keep their routing on the device too.
///
/// Each MoE layer of such a step launches `expert_lookup`, which maps the router's experts to slots through the
/// table (an expert several tokens chose, once) and gives each miss one of the free slots the host set aside
/// (entering the table) or, when none is left, a staging slot; then `expert_fetch`, which copies the misses from the arena, read in place over the link, into
/// their slots; then the expert kernels read every expert from its slot, so the results are the resident run's
/// bit for bit. No host round trip is needed, so a step of one token is one CUDA graph.
///
/// The host's [`SlotCache`] stays the one bookkeeper: before such a step ([`ExpertPool::table_step_begin`]) it
/// replays the last step's lookup log ([`SlotCache::replay`]: the same hits, admissions and staged misses, in
/// the device's order), frees slots for the step's misses by evicting its policy's victims, and uploads its table
/// and free slots; the device admits only into those, in that order. Every host-side step (prefill, steps the
/// table does not take, the CPU's misses) replays a pending log first, so both tables always agree.
struct DeviceTable {
    /// `[n_layer * n_expert]` slot table (i32, -1: none), then `free_max` free slots, then (free slots, taken).
    ctl: DevBuf,
    /// `ctl`'s contents as uploaded (rewritten once `uploaded` has passed).
    ctl_host: Option<PinnedHostSlice<u32>>,
    uploaded: CudaEvent,
    /// Most tokens of a step on the table: the staging slots hold their distinct experts (`staging / k` tokens,
    /// any number when they hold a layer's every expert), at most [`super::MOE_DEVICE_TOKENS_MAX`] and 1,024
    /// routing slots (`expert_lookup`'s block).
    tokens_max: usize,
    /// Tokens of the current step, or of the last one while its log is pending.
    tokens: usize,
    /// Steps begun on the table: of one token, and of several.
    steps: [u64; 2],
    /// The current layer's misses: their count, then (expert, slot) pairs.
    fetch: DevBuf,
    /// The step's lookups, `[n_layer][tokens * k]` (expert, code) pairs; [`LOG_EMPTY`] where no lookup ran.
    log: DevBuf,
    log_host: Option<PinnedHostSlice<u32>>,
    /// Recorded after the log's read-back.
    logged: CudaEvent,
    /// A step's log is read back (or queued) and not replayed yet.
    log_pending: bool,
    /// A trace's routing of the step, `[n_layer][tokens * k]`, uploaded before it (`--routing-trace`).
    replay: DevBuf,
    replay_host: Option<PinnedHostSlice<u32>>,
    arena: HostMapping,
    /// Per layer, one expert's bytes (0: not seen yet): what a miss moves over the link.
    layer_bytes: Vec<u64>,
    free_max: usize,
    /// Misses per step, exponentially averaged: the free slots set aside for the next step.
    misses: f64,
    /// Whether the current step uses the table.
    active: bool,
    /// `expert_fetch`'s blocks per matrix ([`fetch_blocks`]).
    fetch_blocks: u32,
    /// The CPU's share of the misses (a miss plan that may use the CPU, and [`ExpertCacheConfig::cpu_join`]).
    join: Option<CpuJoin>,
    /// The prefetch's fetch list (as `fetch`) and its log, `[n_layer][k]` (expert, code) pairs by the layer
    /// prefetched for ([`LOG_EMPTY`] where none ran), read back with the lookups' log.
    pf_fetch: DevBuf,
    pf_log: DevBuf,
    /// The experts the prefetch put in its staging slots: `[0]` the layer, then one per routing slot (`MOE_SKIP`:
    /// none), then the slots it admitted (the layer's upload cap counts them); and the first of those `k` staging
    /// slots (staging slots `k..2 k`; -1 when the staging area is smaller).
    pf_list: DevBuf,
    pf_staging: i32,
    pf_log_host: Option<PinnedHostSlice<u32>>,
    /// The layer the step's last prefetch was for, until that layer's lookup (its hits wait for the copies).
    prefetched_for: Option<usize>,
    /// Whether the current step prefetches ([`DecodePath::DevicePrefetch`]).
    prefetching: bool,
    /// At most this many experts prefetched per layer ([`PREFETCH_MAX`], `STRATA_PREFETCH_MAX`).
    prefetch_max: usize,
    /// Experts prefetched per step, exponentially averaged: free slots set aside for them too.
    prefetches: f64,
    /// Per layer, where `expert_fetch` reads its experts, once a lookup of the layer has run (a prefetch copies a
    /// layer's experts before the layer runs).
    sources: Vec<Option<FetchSource>>,
}

/// Experts prefetched per layer at most, unless `STRATA_PREFETCH_MAX` says otherwise: the link is idle about one
/// expert's copy per layer (attention, the router); more delays the layer's own misses behind guesses.
const PREFETCH_MAX: usize = 2;

/// `expert_fetch`'s arguments for one layer's experts: each matrix's address in the mapped arena, its bytes per
/// expert and its offset in a slot, and which of the three may be copied in 16-byte words.
#[derive(Debug, Clone, Copy)]
struct FetchSource {
    src: [u64; 3],
    bytes: [usize; 3],
    offsets: [usize; 3],
    vec16: i32,
}

impl DeviceTable {
    fn new(stream: &Arc<CudaStream>, config: &ExpertCacheConfig, arena: HostMapping) -> Result<DeviceTable, CudaError> {
        let ctx = stream.context();
        let ev = || ctx.new_event(None).map_err(CudaError::driver("event creation"));
        let cells = config.n_layer * config.n_expert;
        let tokens_max = tokens_on_table(config.staging, config.n_expert, config.k);
        let routed = tokens_max * config.k;
        // A step's lookups, and as many prefetches (steps of one token).
        let free_max = config
            .slots
            .min(config.n_layer * config.k * tokens_max.max(if config.prefetch { 2 } else { 1 }));
        Ok(DeviceTable {
            ctl: DevBuf::alloc(stream, (cells + free_max + 2) * 4)?,
            ctl_host: None,
            uploaded: ev()?,
            tokens_max,
            tokens: 1,
            steps: [0; 2],
            fetch: DevBuf::alloc(stream, (1 + 2 * routed) * 4)?,
            log: DevBuf::alloc(stream, config.n_layer * routed * 2 * 4)?,
            log_host: None,
            logged: ev()?,
            log_pending: false,
            replay: DevBuf::alloc(stream, config.n_layer * routed * 4)?,
            replay_host: None,
            arena,
            layer_bytes: vec![0; config.n_layer],
            free_max,
            misses: (config.n_layer * config.k) as f64 / 4.0,
            active: false,
            fetch_blocks: fetch_blocks(),
            join: None,
            pf_fetch: DevBuf::alloc(stream, (1 + 2 * config.k) * 4)?,
            pf_log: DevBuf::alloc(stream, config.n_layer * config.k * 2 * 4)?,
            pf_list: DevBuf::alloc(stream, (2 + config.k) * 4)?,
            pf_staging: if config.staging >= 2 * config.k {
                (config.slots + config.k) as i32
            } else {
                -1
            },
            pf_log_host: None,
            prefetched_for: None,
            prefetching: false,
            prefetch_max: crate::switches::usize_in(crate::switches::PREFETCH_MAX, 1..=64).unwrap_or(PREFETCH_MAX),
            prefetches: 0.0,
            sources: vec![None; config.n_layer],
        })
    }

    /// Free slots to set aside for the next step: the recent misses and prefetches and one layer's worth more, at
    /// most `free_max` (a step's lookups, twice that with the prefetch) and a quarter of the cache (slots held
    /// free hold no expert).
    fn free_target(&self, slots: usize, k: usize) -> usize {
        ((self.misses + self.prefetches).ceil() as usize + k)
            .min(self.free_max)
            .min(slots / 4)
    }
}

impl ExpertPool {
    /// Starts a forward step of `n_tok` tokens (before any of its launches) and says whether it decides its
    /// experts on the device's slot table ([`DeviceTable`]), when its experts are in a mapped arena and the table
    /// is not switched off:
    /// - a step of one token, unless the miss policy is `cpu` and the CPU cannot join the table ([`CpuJoin`]);
    ///   under `auto`, when the [`PathChooser`] says so by the step times it measures;
    /// - a step of several tokens (sequences' decode tokens, a short prompt chunk) of at most
    ///   [`DeviceTable::tokens_max`] and `most` (the most tokens the resident experts' run takes on the decode
    ///   kernels for the step: the same kernels give the same bits), unless the miss policy is `cpu`: its misses
    ///   are all uploaded (the CPU joins steps of one token only), with no prefetch.
    ///
    /// Such a step is prepared with [`ExpertPool::table_step_begin`]. Called again before the step ends, it only
    /// repeats the answer.
    ///
    /// Errors: as [`ExpertPool::table_step_begin`]; a step time could not be read.
    pub(super) fn decode_step_begin(
        &mut self,
        stream: &Arc<CudaStream>,
        n_tok: usize,
        most: usize,
        replay: Option<&mut crate::experts::trace::RoutingReplay>,
    ) -> Result<bool, CudaError> {
        if self.step_open {
            return Ok(self.table_active());
        }
        self.step_open = true;
        let on_table = self.config.device_table && self.table.as_ref().is_some_and(|t| n_tok <= t.tokens_max.min(most));
        if n_tok != 1 || !on_table {
            // A prompt's chunk (or a step of several tokens) between measured decode steps: the cache it leaves
            // is not the one they measured, so `auto`'s round starts over.
            self.chooser.interrupt();
            if let Some(j) = self.join() {
                j.disarm();
            }
            let several = on_table && n_tok > 1 && self.miss.policy != MissPolicy::Cpu;
            if several {
                self.table_step_begin(stream, n_tok, replay, false)?;
            }
            return Ok(several);
        }
        // Outside `auto`'s measured choice, `--expert-prefetch` alone says whether the device's table prefetches.
        let device = if self.config.prefetch {
            DecodePath::DevicePrefetch
        } else {
            DecodePath::Device
        };
        let path = match (self.miss.policy, self.miss.cost) {
            (MissPolicy::Cpu, _) if !self.table_joins() => DecodePath::Host,
            (MissPolicy::Cpu, _) => device,
            // Without measured rates the host's path uploads every miss too, a round trip per layer dearer.
            (MissPolicy::Upload, _) | (MissPolicy::Auto, None) => device,
            (MissPolicy::Auto, Some(_)) => self.choose_path(stream)?,
        };
        if path.on_device() {
            self.table_step_begin(stream, 1, replay, path == DecodePath::DevicePrefetch)?;
        } else if let Some(j) = self.join() {
            j.disarm();
        }
        Ok(path.on_device())
    }

    /// `auto`'s path for this step: the last timed step's device time goes to the chooser first, and the choice
    /// is logged when it changes. This step is timed from now to [`ExpertPool::decode_step_end`].
    fn choose_path(&mut self, stream: &Arc<CudaStream>) -> Result<DecodePath, CudaError> {
        let e = || CudaError::driver("timing a decode step");
        let ctx = stream.context();
        if self.step_events.is_none() {
            let timed = || {
                ctx.new_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT))
                    .map_err(e())
            };
            self.step_events = Some([timed()?, timed()?]);
        }
        let [t0, t1] = self.step_events.as_ref().expect("made");
        if std::mem::take(&mut self.step_timed) {
            self.chooser.record(f64::from(t0.elapsed_ms(t1).map_err(e())?) / 1e3);
        }
        let before = self.chooser.chosen();
        let path = self.chooser.next();
        let joined = self.table_joins();
        let medians = self.chooser.medians();
        if let Some(now) = self.chooser.chosen()
            && before != Some(now)
            && let Some(&(_, ms)) = medians.iter().find(|&&(p, _)| p == now)
        {
            let others: Vec<String> = medians
                .iter()
                .filter(|&&(p, _)| p != now)
                .map(|&(p, m)| {
                    format!(
                        "{:.2} ms {}",
                        1e3 * m,
                        match p {
                            DecodePath::Host => "on the host",
                            DecodePath::Device => "on the device's table",
                            DecodePath::DevicePrefetch => "prefetching",
                        }
                    )
                })
                .collect();
            eprintln!(
                "strata: expert misses auto: decode steps decide {} ({:.2} ms a step{}{})",
                now.describe(joined),
                1e3 * ms,
                if others.is_empty() { "" } else { ", " },
                others.join(", ")
            );
        }
        t0.record(stream).map_err(e())?;
        self.timing_step = true;
        Ok(path)
    }

    /// Ends the step [`ExpertPool::decode_step_begin`] started (its launches, or its graph, are queued).
    ///
    /// Errors: as [`ExpertPool::table_step_end`]; the step's end could not be timed.
    pub(super) fn decode_step_end(&mut self, stream: &Arc<CudaStream>) -> Result<(), CudaError> {
        if !std::mem::take(&mut self.step_open) {
            return Ok(());
        }
        self.table_step_end(stream)?;
        if std::mem::take(&mut self.timing_step)
            && let Some([_, t1]) = &self.step_events
        {
            t1.record(stream).map_err(CudaError::driver("timing a decode step"))?;
            self.step_timed = true;
        }
        Ok(())
    }

    /// Whether the current step uses the device's table (between [`ExpertPool::table_step_begin`] and
    /// [`ExpertPool::table_step_end`]).
    pub(super) fn table_active(&self) -> bool {
        self.table.as_ref().is_some_and(|t| t.active)
    }

    /// Prepares a step of `n_tok` tokens (at most [`DeviceTable::tokens_max`]) that uses the device's table:
    /// replays the last step's log, frees slots for this step's misses, and queues the upload of the table, the
    /// free slots and (with `replay`) the trace's routing of the step on `stream`, before any of the step's
    /// launches. `prefetch`: the step prefetches (one token only).
    ///
    /// Errors: a copy or event failed; the device's last step and the host's bookkeeping disagree.
    fn table_step_begin(
        &mut self,
        stream: &Arc<CudaStream>,
        n_tok: usize,
        replay: Option<&mut crate::experts::trace::RoutingReplay>,
        prefetch: bool,
    ) -> Result<(), CudaError> {
        self.sync_log()?;
        let (slots, k, n_layer) = (self.config.slots, self.config.k, self.config.n_layer);
        let t = self.table.as_mut().expect("a device table");
        if t.active {
            return Ok(());
        }
        assert!(n_tok >= 1 && n_tok <= t.tokens_max, "a table step of {n_tok} tokens");
        t.tokens = n_tok;
        t.steps[(n_tok > 1) as usize] += 1;
        let target = t.free_target(slots, k);
        self.cache.reserve_free(target);
        self.stats.decode.cache += self.cache.take_stats();
        let e = || CudaError::driver("uploading the expert slot table");
        t.uploaded.synchronize().map_err(e())?;
        let table = self.cache.table();
        let n = table.len() + t.free_max + 2;
        let ctx = stream.context();
        let h = pinned(&mut t.ctl_host, ctx, n)?;
        for (d, &v) in h.iter_mut().zip(table) {
            *d = v as u32;
        }
        let mut free = 0;
        for (d, slot) in h[table.len()..table.len() + t.free_max]
            .iter_mut()
            .zip(self.cache.free_slots())
        {
            *d = slot;
            free += 1;
        }
        h[n - 2] = free;
        h[n - 1] = 0;
        // SAFETY: `ctl` holds `n` words; `h` is page-locked and rewritten only after `uploaded` (recorded below)
        // has passed.
        unsafe { cudarc::driver::result::memcpy_htod_async(t.ctl.ptr, &h[..n], stream.cu_stream()) }.map_err(e())?;
        if let Some(r) = replay {
            let routed = n_tok * k;
            let h = pinned(&mut t.replay_host, ctx, n_layer * routed)?;
            let mut ids = Vec::with_capacity(routed);
            for l in 0..n_layer {
                r.next(l, n_tok, &mut ids);
                h[l * routed..(l + 1) * routed].copy_from_slice(&ids);
            }
            // SAFETY: as above (`replay` holds `n_layer * tokens_max * k` words).
            unsafe {
                cudarc::driver::result::memcpy_htod_async(t.replay.ptr, &h[..n_layer * routed], stream.cu_stream())
            }
            .map_err(e())?;
        }
        // The CPU joins steps of one token alone.
        if let Some(j) = t.join.as_ref().filter(|_| n_tok == 1) {
            j.arm();
        }
        t.uploaded.record(stream).map_err(e())?;
        // The step's part of the log, and the prefetch's.
        let log_bytes = n_layer * n_tok * k * 2 * 4;
        for (b, bytes) in [
            (&t.log, log_bytes),
            (&t.pf_log, t.pf_log.bytes),
            (&t.pf_list, t.pf_list.bytes),
        ] {
            // SAFETY: each buffer holds at least `bytes` bytes of device memory (`log`: `tokens_max` tokens).
            unsafe { cudarc::driver::result::memset_d8_async(b.ptr, 0xFF, bytes, stream.cu_stream()) }.map_err(e())?;
        }
        t.prefetched_for = None;
        t.prefetching = prefetch && self.config.prefetch && n_tok == 1;
        t.active = true;
        Ok(())
    }

    /// Ends a step begun by [`ExpertPool::table_step_begin`] (its launches, or its graph, are queued): queues the
    /// read-back of its lookup log, which the next use of the cache replays.
    ///
    /// Errors: the copy or the event failed.
    fn table_step_end(&mut self, stream: &Arc<CudaStream>) -> Result<(), CudaError> {
        let Some(t) = self.table.as_mut().filter(|t| t.active) else {
            return Ok(());
        };
        t.active = false;
        let e = || CudaError::driver("reading the expert lookup log back");
        let k = self.config.k;
        let words = |tokens: usize| self.config.n_layer * tokens * k * 2;
        for (log, host, n) in [
            (&t.log, &mut t.log_host, words(t.tokens)),
            (&t.pf_log, &mut t.pf_log_host, words(1)),
        ] {
            let h = pinned(host, stream.context(), n)?;
            // SAFETY: `log` holds `n` words; `h` is read only after `logged` has passed.
            unsafe { cudarc::driver::result::memcpy_dtoh_async(&mut h[..n], log.ptr, stream.cu_stream()) }
                .map_err(e())?;
        }
        t.logged.record(stream).map_err(e())?;
        t.log_pending = true;
        Ok(())
    }

    /// Replays the last device step's lookup log into the host's bookkeeping (waiting for its read-back), and
    /// counts it as decode lookups. Nothing when none is pending.
    ///
    /// Errors: waiting failed; the log disagrees with the host's table (named).
    pub(super) fn sync_log(&mut self) -> Result<(), CudaError> {
        let Some(t) = self.table.as_mut().filter(|t| t.log_pending) else {
            return Ok(());
        };
        t.log_pending = false;
        t.logged
            .synchronize()
            .map_err(CudaError::driver("waiting for the expert lookup log"))?;
        let k = self.config.k;
        let log = t
            .log_host
            .as_ref()
            .expect("read back")
            .as_slice()
            .map_err(CudaError::driver("page-locked buffer"))?;
        let pf_log = t
            .pf_log_host
            .as_ref()
            .expect("read back")
            .as_slice()
            .map_err(CudaError::driver("page-locked buffer"))?;
        let (mut misses, mut prefetches) = (0usize, 0usize);
        let phase = &mut self.stats.decode;
        let mut fetched: Vec<u32> = Vec::with_capacity(k);
        let routed = t.tokens * k;
        // The experts the current layer-step looked up (a repeat names one of them): marks, and their list.
        let (mut looked, mut looked_list) = (vec![false; self.config.n_expert], Vec::with_capacity(routed));
        for (layer, region) in log[..self.config.n_layer * routed * 2]
            .chunks_exact(routed * 2)
            .enumerate()
        {
            for e in looked_list.drain(..) {
                looked[e as usize] = false;
            }
            // The prefetch for this layer ran after the previous layer's lookups and before this one's.
            fetched.clear();
            let pf = &pf_log[layer * k * 2..(layer + 1) * k * 2];
            if pf[0] != LOG_EMPTY {
                for pair in pf.chunks_exact(2) {
                    let (expert, code) = (pair[0], pair[1]);
                    if code == PREFETCH_STAGED {
                        phase.prefetched += 1;
                        phase.bytes_uploaded += t.layer_bytes[layer];
                        continue;
                    }
                    if code == PREFETCH_CACHED || code == PREFETCH_SKIPPED || code & LOOKUP_ADMITTED == 0 {
                        continue;
                    }
                    let id = ExpertId {
                        layer: layer as u32,
                        expert,
                    };
                    let slot = code & !LOOKUP_ADMITTED;
                    if expert as usize >= self.config.n_expert || self.cache.pin(id) != Some(slot) {
                        return Err(CudaError::ExpertTable(format!(
                            "the device prefetched {id:?} into slot {slot}, which the host's table does not give it"
                        )));
                    }
                    fetched.push(expert);
                    prefetches += 1;
                    phase.prefetched += 1;
                    phase.bytes_uploaded += t.layer_bytes[layer];
                }
            }
            if region[0] == LOG_EMPTY {
                continue;
            }
            for (j, pair) in region.chunks_exact(2).enumerate() {
                let (expert, code) = (pair[0], pair[1]);
                if code == LOOKUP_BAD {
                    return Err(CudaError::ExpertTable(format!(
                        "layer {layer}'s router chose expert {expert} of {}",
                        self.config.n_expert
                    )));
                }
                if code == LOOKUP_NO_ROOM {
                    return Err(CudaError::ExpertTable(format!(
                        "a step of {} tokens at layer {layer} missed more experts than the {} staging slots hold",
                        t.tokens, self.config.staging
                    )));
                }
                if code == LOOKUP_REPEAT {
                    // Another token's routing slot looked it up in this layer-step.
                    if !looked.get(expert as usize).copied().unwrap_or(false) {
                        return Err(CudaError::ExpertTable(format!(
                            "layer {layer}: routing slot {j} repeats expert {expert}, which no earlier slot looked up"
                        )));
                    }
                    continue;
                }
                let seen = match code {
                    LOOKUP_STAGED | LOOKUP_CPU | LOOKUP_PREFETCHED => Access::Bypassed,
                    c if c & LOOKUP_ADMITTED != 0 => Access::Admitted {
                        slot: c & !LOOKUP_ADMITTED,
                        evicted: None,
                    },
                    c => Access::Hit { slot: c },
                };
                let id = ExpertId {
                    layer: layer as u32,
                    expert,
                };
                if expert as usize >= self.config.n_expert {
                    return Err(CudaError::ExpertTable(format!(
                        "the device looked up {id:?}, outside the model"
                    )));
                }
                looked[expert as usize] = true;
                looked_list.push(expert);
                self.cache.replay(id, seen).map_err(CudaError::ExpertTable)?;
                if code == LOOKUP_PREFETCHED || matches!(seen, Access::Hit { .. }) && fetched.contains(&expert) {
                    phase.prefetch_used += 1;
                }
                if code == LOOKUP_CPU {
                    phase.cpu_computed += 1;
                } else if code != LOOKUP_PREFETCHED && !matches!(seen, Access::Hit { .. }) {
                    // (A prefetched expert's bytes counted when the prefetch copied it.)
                    misses += 1;
                    phase.bytes_uploaded += t.layer_bytes[layer];
                }
            }
        }
        phase.cache += self.cache.take_stats();
        t.misses = 0.75 * t.misses + 0.25 * misses as f64;
        t.prefetches = 0.75 * t.prefetches + 0.25 * prefetches as f64;
        if let Some(j) = &t.join {
            phase.cpu_us += j.take_busy_us();
            if let Some(why) = j.failure() {
                return Err(CudaError::ExpertTable(format!(
                    "the CPU's share of a decode step's expert misses: {why}"
                )));
            }
        }
        Ok(())
    }

    /// Queues the lookup of a layer-step in the device's table (in a step begun by
    /// [`ExpertPool::table_step_begin`], of `n_tok` tokens): `ids` holds the router's `n_tok * k` experts; the
    /// slots they are read from go to `slot_ids` (`3 n_tok k` words: every slot, then the hits' alone and the
    /// misses' alone, the others `MOE_SKIP`, kernels/experts.cu), and the misses to the fetch list that
    /// [`ExpertPool::table_fetch`] copies in. With a routing trace (`replayed`), its experts for the layer
    /// (uploaded by [`ExpertPool::table_step_begin`]) are looked up instead of the router's. In a step of one
    /// token with a [`CpuJoin`], the CPU's share of the misses (by the miss plan) is published with the token's
    /// activations `x` (`[n_embd]` f32), and left out of all three parts and the fetch list:
    /// [`ExpertPool::table_cpu_join`] writes their rows.
    ///
    /// Errors: a launch failed.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn table_lookup(
        &mut self,
        gpu: &super::Gpu,
        ex: &Experts<'_>,
        n_tok: usize,
        ids: u64,
        x: u64,
        slot_ids: u64,
        replayed: bool,
    ) -> Result<(), CudaError> {
        use super::launch::Arg;
        let k = self.config.k;
        let stride = self.config.slot_bytes;
        let (_, span) = layout(ex);
        assert!(
            span <= stride && ex.n_expert == self.config.n_expert && ex.layer < self.config.n_layer,
            "layer {}'s experts ({span} bytes) do not fit the pool's slots ({stride} bytes)",
            ex.layer
        );
        let t = self.table.as_mut().expect("a device table");
        assert_eq!(n_tok, t.tokens, "a layer-step of the table's step");
        t.layer_bytes[ex.layer] = ex.expert_bytes();
        let (one, routed) = (n_tok == 1, n_tok * k);
        // A routing trace's experts for this layer-step were uploaded with the table: read them in place of the
        // router's (nothing after the lookup reads the router's ids).
        let ids = if replayed {
            t.replay.ptr + (ex.layer * routed * 4) as u64
        } else {
            ids
        };
        let cells = self.config.n_layer * self.config.n_expert;
        assert!(
            k <= 64 && routed <= 1024,
            "expert_lookup serves 1,024 routing slots, top-k of at most 64"
        );
        let [take, join_dev, join_host, join_x] = match t.join.as_mut().filter(|_| one) {
            Some(j) => {
                j.register(&gpu.stream, ex)?;
                j.lookup_args(ex.layer)
            }
            None => [0; 4],
        };
        gpu.launch(
            "expert_lookup",
            (1, 1, 1),
            (routed.next_multiple_of(32).max(64) as u32, 1, 1),
            &[
                Arg::P(ids),
                Arg::I(routed as i32),
                Arg::I(ex.layer as i32),
                Arg::I(ex.n_expert as i32),
                Arg::P(t.ctl.ptr),
                Arg::P(t.ctl.ptr + (cells * 4) as u64),
                Arg::P(t.ctl.ptr + ((cells + t.free_max) * 4) as u64),
                Arg::P(slot_ids),
                Arg::P(t.fetch.ptr),
                Arg::P(t.log.ptr + (ex.layer * routed * 2 * 4) as u64),
                Arg::I(self.config.slots as i32),
                Arg::I(self.config.staging as i32),
                Arg::I(self.config.upload_cap.min(i32::MAX as u32) as i32),
                Arg::P(take),
                Arg::P(x),
                Arg::I(ex.gate.cols as i32),
                Arg::P(join_dev),
                Arg::P(join_host),
                Arg::P(join_x),
                Arg::P(if self.config.prefetch && one { t.pf_list.ptr } else { 0 }),
                Arg::I(t.pf_staging),
            ],
        )
    }

    /// Steps begun on the device's table ([`ExpertPool::table_step_begin`]) since the pool was made: of one token,
    /// and of several.
    pub(super) fn table_steps(&self) -> [u64; 2] {
        self.table.as_ref().map_or([0; 2], |t| t.steps)
    }

    /// Most tokens of a step on the device's slot table (0 without one): [`ExpertPool::decode_step_begin`] puts
    /// no larger step there.
    pub(super) fn table_tokens(&self) -> usize {
        self.table.as_ref().map_or(0, |t| t.tokens_max)
    }

    /// Whether [`ExpertPool::table_lookup`] may give the CPU misses in a step of one token (then
    /// [`ExpertPool::table_cpu_join`] follows the layer's expert launches).
    pub(super) fn table_joins(&self) -> bool {
        self.join().is_some()
    }

    /// Whether the CPU join expects a step's requests: the step queued now may wait on the CPU's answers.
    pub(super) fn join_armed(&self) -> bool {
        self.join().is_some_and(CpuJoin::armed)
    }

    /// The CPU's side of the device's table, when it joins it.
    fn join(&self) -> Option<&CpuJoin> {
        self.table.as_ref().and_then(|t| t.join.as_ref())
    }

    /// Queues `cpu_join` on the current stream: it waits for the CPU's rows of the layer-step's misses (if the
    /// lookup gave the CPU any) and writes them into `dp` (`[k][n_embd]` f32, the experts' outputs).
    ///
    /// Errors: a launch failed.
    pub(super) fn table_cpu_join(&self, gpu: &super::Gpu, dp: u64, n_embd: usize) -> Result<(), CudaError> {
        use super::launch::Arg;
        let j = self.join().expect("a CPU join (table_joins)");
        let [dev, words, rows] = j.join_args();
        gpu.launch(
            "cpu_join",
            (super::join::JOIN_BLOCKS, 1, 1),
            (256, 1, 1),
            &[
                Arg::P(dev),
                Arg::P(words),
                Arg::P(rows),
                Arg::P(dp),
                Arg::I(n_embd as i32),
                Arg::L(super::join::TIMEOUT_NS),
            ],
        )
    }

    /// Queues the copy of the misses [`ExpertPool::table_lookup`] listed for layer `ex` into their slots, read
    /// from the mapped arena over the link (`expert_fetch`), on the current stream.
    ///
    /// Errors: a launch failed.
    pub(super) fn table_fetch(&mut self, gpu: &super::Gpu, ex: &Experts<'_>) -> Result<(), CudaError> {
        let (offsets, _) = layout(ex);
        let bytes = layout_bytes(ex);
        let stride = self.config.slot_bytes;
        let t = self.table.as_mut().expect("a device table");
        let src = [&ex.gate, &ex.up, &ex.down].map(|w| {
            t.arena
                .device_of(w.data)
                .expect("a mapped arena holds every routed expert")
        });
        // Per matrix (bit m): 16-byte words when its size, source and slot offset all allow them.
        let vec16 = (0..3)
            .filter(|&m| bytes[m] % 16 == 0 && offsets[m] % 16 == 0 && src[m] % 16 == 0 && stride % 16 == 0)
            .fold(0, |bits, m| bits | 1 << m);
        let source = FetchSource {
            src,
            bytes,
            offsets,
            vec16,
        };
        t.sources[ex.layer] = Some(source);
        self.launch_fetch(gpu, self.table.as_ref().expect("a device table").fetch.ptr, &source)
    }

    /// Queues `expert_fetch` of the experts fetch list `list` names (a lookup's or a prefetch's), from `source`.
    ///
    /// Errors: a launch failed.
    fn launch_fetch(&self, gpu: &super::Gpu, list: u64, source: &FetchSource) -> Result<(), CudaError> {
        use super::launch::Arg;
        let t = self.table.as_ref().expect("a device table");
        let FetchSource {
            src,
            bytes,
            offsets,
            vec16,
        } = *source;
        gpu.launch(
            "expert_fetch",
            (t.fetch_blocks, 3, 1),
            (256, 1, 1),
            &[
                Arg::P(list),
                Arg::P(src[0]),
                Arg::P(src[1]),
                Arg::P(src[2]),
                Arg::L(bytes[0] as i64),
                Arg::L(bytes[1] as i64),
                Arg::L(bytes[2] as i64),
                Arg::P(self.buf.ptr),
                Arg::L(self.config.slot_bytes as i64),
                Arg::L(offsets[0] as i64),
                Arg::L(offsets[1] as i64),
                Arg::L(offsets[2] as i64),
                Arg::I(vec16),
            ],
        )
    }

    /// Whether [`ExpertPool::table_prefetch`] can prefetch for layer `layer` in this step: the prefetch is on, the
    /// step uses the device's table, and a lookup of that layer has run before (where its experts are is known).
    pub(super) fn can_prefetch(&self, layer: usize) -> bool {
        self.table
            .as_ref()
            .is_some_and(|t| t.active && t.prefetching && t.sources.get(layer).is_some_and(Option::is_some))
    }

    /// Queues the prefetch of layer `layer`'s experts `ids` (`k` u32 on the device: the next layer's router
    /// applied to the current layer's input): `expert_prefetch` gives the uncached ones free slots in the table,
    /// then, on the side stream, `expert_fetch` copies them in while the stream goes on, up to a mark the layer's
    /// hits wait for ([`ExpertPool::wait_prefetch`]). Needs [`ExpertPool::can_prefetch`].
    ///
    /// Errors: a launch failed.
    pub(super) fn table_prefetch(&mut self, gpu: &super::Gpu, layer: usize, ids: u64) -> Result<(), CudaError> {
        use super::launch::Arg;
        let k = self.config.k;
        let cells = self.config.n_layer * self.config.n_expert;
        let t = self.table.as_ref().expect("a device table");
        let source = t.sources[layer].expect("can_prefetch");
        gpu.launch(
            "expert_prefetch",
            (1, 1, 1),
            (64, 1, 1),
            &[
                Arg::P(ids),
                Arg::I(k as i32),
                Arg::I(layer as i32),
                Arg::I(self.config.n_expert as i32),
                Arg::P(t.ctl.ptr),
                Arg::P(t.ctl.ptr + (cells * 4) as u64),
                Arg::P(t.ctl.ptr + ((cells + t.free_max) * 4) as u64),
                Arg::P(t.pf_fetch.ptr),
                Arg::P(t.pf_log.ptr + (layer * k * 2 * 4) as u64),
                Arg::I(self.config.upload_cap.min(i32::MAX as u32) as i32),
                Arg::P(t.pf_list.ptr),
                Arg::I(t.pf_staging),
                Arg::I(t.prefetch_max as i32),
            ],
        )?;
        gpu.fork()?;
        self.launch_fetch(gpu, t.pf_fetch.ptr, &source)?;
        gpu.mark()?;
        gpu.to_main()?;
        self.table.as_mut().expect("a device table").prefetched_for = Some(layer);
        Ok(())
    }

    /// Whether the current step prefetches (on the device's table, [`DecodePath::DevicePrefetch`]).
    pub(super) fn prefetching(&self) -> bool {
        self.table.as_ref().is_some_and(|t| t.active && t.prefetching)
    }

    /// Whether a prefetch of this step was queued and its layer's lookup never came (then the caller joins the
    /// side stream); forgets it.
    pub(super) fn take_open_prefetch(&mut self) -> bool {
        self.table.as_mut().is_some_and(|t| t.prefetched_for.take().is_some())
    }

    /// Before the first launch of layer `layer` that reads its experts' slots: the stream waits for the prefetch's
    /// copies, when one was queued for this layer ([`ExpertPool::table_prefetch`]).
    ///
    /// Errors: the wait could not be queued.
    pub(super) fn wait_prefetch(&mut self, gpu: &super::Gpu, layer: usize) -> Result<(), CudaError> {
        let Some(t) = self.table.as_mut() else {
            return Ok(());
        };
        if t.prefetched_for == Some(layer) {
            t.prefetched_for = None;
            gpu.wait_mark()?;
        }
        Ok(())
    }
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
    /// Misses given a cache slot in this layer-step (decode: at most [`ExpertCacheConfig::upload_cap`]).
    admitted: u32,
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
    /// The device's copy of the slot table (decode steps, experts in a mapped arena).
    table: Option<DeviceTable>,
    /// Between [`ExpertPool::decode_step_begin`] and [`ExpertPool::decode_step_end`].
    step_open: bool,
    /// `auto`'s choice of [`DecodePath`], and the events that time a step for it (the step's start and end).
    chooser: PathChooser,
    step_events: Option<[CudaEvent; 2]>,
    /// The open step is timed (its start recorded; [`ExpertPool::decode_step_end`] records its end).
    timing_step: bool,
    /// A step was timed, start and end, whose time the chooser has not had yet.
    step_timed: bool,
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
            admitted: 0,
            layer: 0,
            stats: ExpertCacheStats::default(),
            miss: MissPlan::default(),
            cpu: CpuMisses::default(),
            table: match config.arena {
                // expert_lookup takes top-k of at most 64 (its block), and stages routing slot j's miss in
                // staging slot j.
                Some(a) if config.device_table && config.k <= 64 && config.staging >= config.k => {
                    Some(DeviceTable::new(stream, &config, a)?)
                }
                _ => None,
            },
            step_open: false,
            chooser: PathChooser::new(config.prefetch),
            step_events: None,
            timing_step: false,
            step_timed: false,
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
        let c = &self.config;
        if let Some(t) = self.table.as_mut() {
            if plan.policy == MissPolicy::Upload || !c.cpu_join {
                t.join = None;
            } else if let Some(j) = t.join.as_mut() {
                if let Err(e) = j.set_plan(self.copy.context(), plan) {
                    eprintln!("strata: expert misses: the CPU leaves the device's slot table ({e})");
                    t.join = None;
                }
            } else {
                // Its own workers, two fewer than rayon's threads: the answering thread works beside them, and the
                // stepping thread waits for the step (spinning, under CUDA's default scheduling).
                let workers = SpinPool::new(rayon::current_num_threads().saturating_sub(2))?;
                match CpuJoin::new(&self.copy, c.n_layer, c.k, c.n_embd, plan, workers).and_then(|j| {
                    self.copy
                        .synchronize()
                        .map_err(CudaError::driver("copy stream synchronize"))?;
                    Ok(j)
                }) {
                    Ok(j) => t.join = Some(j),
                    Err(e) => eprintln!(
                        "strata: expert misses: the CPU cannot join the device's slot table ({e}); decode steps that give the CPU misses decide on the host"
                    ),
                }
            }
        }
        Ok(())
    }

    /// How fast the CPU computes `ex`'s experts on the workers misses use ([`CpuBackend::expert_rate`]): the CPU
    /// join's when it joins the device's table (the path `auto` mostly keeps), else the host path's.
    pub(super) fn cpu_expert_rate(&self, ex: &Experts<'_>, k: usize) -> ExpertRate {
        CpuBackend.expert_rate(ex, k, self.miss_workers())
    }

    /// The threads [`ExpertPool::cpu_expert_rate`] measures.
    pub(super) fn miss_workers(&self) -> Workers<'_> {
        match self.join() {
            Some(j) => Workers::Spin(j.workers()),
            None => Workers::of(self.cpu.workers.as_ref()),
        }
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
        // The host decides this layer-step: the device's last lookups first.
        self.sync_log()?;
        for &e in &self.placed {
            self.slot_of[e as usize] = UNSET;
        }
        self.placed.clear();
        self.staged = 0;
        self.admitted = 0;
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
                self.admitted += 1;
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

    /// Whether a miss now may take a cache slot: a free one always (at decode, below the upload cap); at decode,
    /// the policy's victim unless this layer-step uses it.
    fn can_admit(&self) -> bool {
        if self.decoding && self.admitted >= self.config.upload_cap {
            return false;
        }
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

    /// Fills free slots with the first experts of `ranked` (most used first: an expert profile's ranking) that
    /// `experts` has (it gives a layer's experts where the store keeps them; `None` for a layer without any), as
    /// [`SlotCache::prefill`] places them, and uploads them. The uploads are not counted as a request's. Returns
    /// how many experts were placed.
    ///
    /// Errors: an upload failed.
    pub(super) fn prefill_profile<'m>(
        &mut self,
        stream: &Arc<CudaStream>,
        experts: impl Fn(usize) -> Option<Experts<'m>>,
        ranked: &[ExpertId],
    ) -> Result<usize, CudaError> {
        self.sync_log()?;
        let ranked: Vec<ExpertId> = ranked
            .iter()
            .copied()
            .filter(|id| (id.layer as usize) < self.config.n_layer && experts(id.layer as usize).is_some())
            .collect();
        let placed = self.cache.prefill(&ranked);
        self.cache.take_stats();
        let decoding = std::mem::replace(&mut self.decoding, true);
        let uploaded = placed.iter().try_for_each(|&(id, slot)| {
            let ex = experts(id.layer as usize).expect("filtered above");
            self.layer = id.layer;
            self.upload(stream, &ex, id.expert, slot)
        });
        self.decoding = decoding;
        uploaded?;
        stream
            .synchronize()
            .map_err(CudaError::driver("waiting for the profile's uploads"))?;
        Ok(placed.len())
    }

    /// Lookups of each expert since the pool was made, `[layer * n_expert + expert]` (the device's last step's
    /// included): the profile the cache learned.
    ///
    /// Errors: as [`ExpertPool::sync_log`].
    pub(super) fn lookups(&mut self) -> Result<Vec<u64>, CudaError> {
        self.sync_log()?;
        Ok(self.cache.uses().to_vec())
    }

    /// The counts so far (the device's last step's lookups included), and zero them.
    ///
    /// Errors: as [`ExpertPool::sync_log`].
    pub(super) fn take_stats(&mut self) -> Result<ExpertCacheStats, CudaError> {
        self.sync_log()?;
        Ok(std::mem::take(&mut self.stats))
    }

    /// The counts so far (the device's last step's lookups included).
    ///
    /// Errors: as [`ExpertPool::sync_log`].
    pub(super) fn stats(&mut self) -> Result<ExpertCacheStats, CudaError> {
        self.sync_log()?;
        Ok(self.stats)
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
    /// The device address of `ptr`, when the range is mapped.
    device: Option<u64>,
    ctx: Arc<cudarc::driver::CudaContext>,
}

impl HostPin {
    pub(super) fn new(gpu: &super::Gpu, bytes: &[u8]) -> Result<HostPin, CudaError> {
        gpu.ctx
            .bind_to_thread()
            .map_err(CudaError::driver("binding the context"))?;
        // Mapped as well, so kernels read it in place over the link (`expert_fetch`); where the driver refuses the
        // mapping, locked alone (uploads still run at the pinned rate; the device's slot table is not used).
        let portable = cudarc::driver::sys::CU_MEMHOSTREGISTER_PORTABLE;
        let register = |flags| {
            // SAFETY: `bytes` is a live host allocation; the guard unregisters it before its owner frees it
            // (`runtime::Engine` drops the guard first).
            unsafe { cudarc::driver::sys::cuMemHostRegister_v2(bytes.as_ptr() as *mut _, bytes.len(), flags).result() }
        };
        let mapped = register(portable | cudarc::driver::sys::CU_MEMHOSTREGISTER_DEVICEMAP).is_ok();
        if !mapped {
            register(portable).map_err(CudaError::driver(format!("cuMemHostRegister of {} bytes", bytes.len())))?;
        }
        let mut pin = HostPin {
            ptr: bytes.as_ptr() as usize,
            bytes: bytes.len(),
            device: None,
            ctx: gpu.ctx.clone(),
        };
        let mut device = 0;
        // SAFETY: the memory is registered (with DEVICEMAP when `mapped`).
        if mapped
            && unsafe { cudarc::driver::sys::cuMemHostGetDevicePointer_v2(&mut device, bytes.as_ptr() as *mut _, 0) }
                .result()
                .is_ok()
        {
            pin.device = Some(device);
        }
        Ok(pin)
    }

    /// Bytes locked.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// The locked range as kernels address it (host start, bytes, device address of the start), when the driver
    /// mapped it.
    pub fn mapping(&self) -> Option<HostMapping> {
        self.device.map(|device| HostMapping {
            host: self.ptr,
            bytes: self.bytes,
            device,
        })
    }
}

/// Page-locked host memory mapped into the device's address space ([`HostPin::mapping`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HostMapping {
    /// Host address of the first byte.
    pub host: usize,
    pub bytes: usize,
    /// Device address of the first byte.
    pub device: u64,
}

impl HostMapping {
    /// The device address of `data`, when all of it lies in the mapped range.
    fn device_of(&self, data: &[u8]) -> Option<u64> {
        let start = data.as_ptr() as usize;
        (start >= self.host && start + data.len() <= self.host + self.bytes)
            .then(|| self.device + (start - self.host) as u64)
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

#[cfg(test)]
mod tests {
    use super::tokens_on_table;

    /// The device's slot table takes the steps whose distinct experts its staging slots hold: `staging / k` tokens,
    /// or, when they hold a layer's every expert, any step of up to 64 tokens and 1,024 routing slots.
    #[test]
    fn the_table_takes_the_steps_whose_experts_the_staging_slots_hold() {
        // The 30B shape: 128 experts, top-8.
        assert_eq!(tokens_on_table(32, 128, 8), 4);
        assert_eq!(tokens_on_table(64, 128, 8), 8);
        assert_eq!(tokens_on_table(128, 128, 8), 64);
        // 1,024 routing slots at most.
        assert_eq!(tokens_on_table(128, 128, 64), 16);
        // The parity tests' model: 32 experts, top-2.
        assert_eq!(tokens_on_table(8, 32, 2), 4);
        assert_eq!(tokens_on_table(32, 32, 2), 64);
    }
}
