//! The CPU computing a decode step's expert misses beside the GPU, on the device's slot table and inside the
//! step's CUDA graph (DESIGN.md section 3, "Expert cache": "a miss is uploaded over PCIe on a copy stream or
//! computed by the CPU while the GPU computes the hits").
//!
//! Without a host round trip per layer, the GPU asks and the CPU answers through mapped page-locked memory:
//!
//! 1. `expert_lookup` (kernels/experts.cu) splits a layer-step's misses by the per-layer table [`CpuJoin`] keeps
//!    on the device (of `m` misses the CPU takes the last `take[m]` in routing order, [`MissPlan::cpu_count`]),
//!    copies the token's activations and the CPU's jobs into the mapped words, then writes the request's sequence
//!    number last (`JOIN_REQ`).
//! 2. A thread of this module, spinning while decode steps run, sees the number, computes the jobs with
//!    [`CpuBackend::expert_rows`] on spinning workers of its own (the host path's kernels, bit for bit),
//!    writes the rows, then the number to `JOIN_DONE`.
//! 3. Meanwhile the GPU fetches and computes the other misses and the hits; `cpu_join` then waits for `JOIN_DONE`
//!    and writes the CPU's rows into the experts' outputs before they are summed. A wait past [`TIMEOUT_NS`]
//!    writes `JOIN_FAILED`, and the host fails the step when it replays the step's log.
//!
//! One request is in flight at a time: the next layer's lookup runs after this layer's `cpu_join`.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use cudarc::driver::{CudaContext, CudaStream, PinnedHostSlice};

use super::buffer::DevBuf;
use super::error::CudaError;
use crate::backend::Experts;
use crate::backend::cpu::spin::SpinPool;
use crate::backend::cpu::{CpuBackend, ExpertRowsScratch, Workers};
use crate::experts::miss::{MissCost, MissPlan};

/// Word offsets in the mapped words (kernels/experts.cu's `JOIN_*`; the request and the answers on cache lines
/// of their own).
const REQ: usize = 0;
const LAYER: usize = 1;
const JOBS: usize = 2;
const DONE: usize = 32;
const FAILED: usize = 64;
const PAIRS: usize = 96;
/// `cpu_join` stops waiting for the CPU after this long (ns): a request the thread never saw.
pub(super) const TIMEOUT_NS: i64 = 2_000_000_000;
/// The thread spins this long after its last request or wake-up, then parks until the next step wakes it.
const SPIN: Duration = Duration::from_millis(50);
/// The cost model's round trip of a layer-step's CPU share through the mapped words unless
/// `STRATA_JOIN_ROUND_TRIP_US` says otherwise, seconds: `expert_lookup`'s writes reaching host memory, the
/// thread's wake, the rows read over the link and `cpu_join`'s polls.
const ROUND_TRIP_S: f64 = 20e-6;

/// [`ROUND_TRIP_S`], or `STRATA_JOIN_ROUND_TRIP_US` when it is a number from 0 to 1000.
fn round_trip_s() -> f64 {
    let name = crate::switches::JOIN_ROUND_TRIP_US;
    let Some(v) = crate::switches::text_lossy(name) else {
        return ROUND_TRIP_S;
    };
    match v.parse::<f64>() {
        Ok(us) if (0.0..=1000.0).contains(&us) => us * 1e-6,
        _ => {
            eprintln!(
                "strata: {name}={v:?} is not a number from 0 to 1000: the cost model keeps {} us",
                ROUND_TRIP_S * 1e6
            );
            ROUND_TRIP_S
        }
    }
}

/// `cost` on the device's table with the CPU joining it ([`MissCost::joined`] with [`round_trip_s`]).
pub(super) fn joined_cost(cost: MissCost) -> MissCost {
    cost.joined(round_trip_s())
}

/// `cpu_join`'s blocks (each polls the answer, then copies its share of the rows).
pub(super) const JOIN_BLOCKS: u32 = 16;

/// The mapped words' layout for top-`k` and `n_embd`: offsets of the activations and of the rows, and the total.
fn layout(k: usize, n_embd: usize) -> (usize, usize, usize) {
    let x = (PAIRS + 2 * k).next_multiple_of(32);
    let rows = (x + n_embd).next_multiple_of(32);
    (x, rows, rows + k * n_embd)
}

/// What the thread shares with the backend.
struct Shared {
    /// Host address of the mapped words.
    words: usize,
    k: usize,
    n_embd: usize,
    /// Each MoE layer's experts, as the step's lookups last named them (`None`: not seen yet).
    layers: Mutex<Vec<Option<Experts<'static>>>>,
    stop: AtomicBool,
    /// Steps on the device's table are running: the thread spins (else it parks, leaving the cores to the host's
    /// path and to prefill).
    armed: AtomicBool,
    /// Wall time spent computing requests since [`CpuJoin::take_busy_us`] last took it, microseconds.
    busy_us: AtomicU64,
    /// Why the thread could not compute a request, once one failed.
    failure: Mutex<Option<String>>,
}

impl Shared {
    fn word(&self, i: usize) -> &AtomicU32 {
        // SAFETY: `words` is a live page-locked allocation of at least `layout(..).2` u32 words, aligned (the
        // driver's allocation), owned by the `CpuJoin` that joins this thread before freeing it; the GPU writes
        // it too, which is why every access is atomic.
        unsafe { AtomicU32::from_ptr((self.words as *mut u32).add(i)) }
    }

    /// Computes request `seq` into the rows; an error names what was wrong with it.
    fn compute(&self, scratch: &mut ExpertRowsScratch, workers: &SpinPool) -> Result<(), String> {
        let (layer, jobs) = (
            self.word(LAYER).load(Ordering::Relaxed) as usize,
            self.word(JOBS).load(Ordering::Relaxed) as usize,
        );
        if jobs == 0 || jobs > self.k {
            return Err(format!("layer {layer}'s request holds {jobs} jobs of top-{}", self.k));
        }
        let ex = self
            .layers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(layer)
            .copied()
            .flatten()
            .ok_or_else(|| format!("layer {layer} asked for the CPU before its experts were named"))?;
        let pairs: Vec<(u32, u32)> = (0..jobs)
            .map(|q| {
                (
                    self.word(PAIRS + 2 * q).load(Ordering::Relaxed),
                    self.word(PAIRS + 2 * q + 1).load(Ordering::Relaxed),
                )
            })
            .collect();
        if let Some(&(e, t)) = pairs.iter().find(|&&(e, t)| e as usize >= ex.n_expert || t != 0) {
            return Err(format!(
                "layer {layer}'s request names expert {e} of {} (token {t})",
                ex.n_expert
            ));
        }
        let (xo, ro, _) = layout(self.k, self.n_embd);
        // SAFETY: the mapped words hold `n_embd` activations at `xo` and `k * n_embd` rows at `ro` (`layout`); the
        // GPU wrote the activations before the request's number (a system fence between) and reads the rows only
        // after `DONE` is written, so for the length of this call nothing else touches either range.
        let (x, out) = unsafe {
            let base = self.words as *mut u32;
            (
                std::slice::from_raw_parts(base.add(xo) as *const f32, self.n_embd),
                std::slice::from_raw_parts_mut(base.add(ro) as *mut f32, jobs * self.n_embd),
            )
        };
        CpuBackend.expert_rows(&ex, x, &pairs, out, scratch, Workers::Spin(workers), || ());
        Ok(())
    }
}

/// The thread's loop: spin on the request word while steps run, compute each new request, answer it.
fn serve(s: &Shared, workers: &SpinPool) {
    let mut scratch = ExpertRowsScratch::default();
    let mut answered = s.word(DONE).load(Ordering::Acquire);
    let mut idle_since = Instant::now();
    while !s.stop.load(Ordering::Acquire) {
        let seq = s.word(REQ).load(Ordering::Acquire);
        if seq == 0 || seq == answered {
            if s.armed.load(Ordering::Relaxed) && idle_since.elapsed() < SPIN {
                std::hint::spin_loop();
            } else {
                // Woken by the next step's `arm` (or by drop); a bounded park, in case a wake-up raced the park.
                std::thread::park_timeout(Duration::from_millis(10));
                idle_since = Instant::now();
            }
            continue;
        }
        let t = Instant::now();
        if let Err(why) = s.compute(&mut scratch, workers) {
            s.failure.lock().unwrap_or_else(|e| e.into_inner()).get_or_insert(why);
            s.word(FAILED).store(seq, Ordering::Relaxed);
        }
        s.busy_us.fetch_add(t.elapsed().as_micros() as u64, Ordering::Relaxed);
        // The rows (written above) before the answer: the GPU reads them once it sees it.
        s.word(DONE).store(seq, Ordering::Release);
        answered = seq;
        idle_since = Instant::now();
    }
}

/// The CPU's side of the device's slot table (module docs): the mapped words, the device's words and split
/// table, and the thread that answers.
pub(super) struct CpuJoin {
    /// The mapped words ([`layout`]); `words_dev` is their device address.
    _words: PinnedHostSlice<u32>,
    words_dev: u64,
    /// `[0]` last sequence number, `[1]` the one `cpu_join` waits for, `[2]` jobs, `[3..3 + k]` routing slots.
    dev: DevBuf,
    /// `[n_layer][k + 1]` i32: of `m` misses, how many the CPU takes; `take_host` stages its uploads and
    /// `take_bytes[l]` is the expert size layer `l`'s row was computed for (0: none yet).
    take: DevBuf,
    take_host: PinnedHostSlice<i32>,
    take_bytes: Vec<u64>,
    plan: MissPlan,
    k: usize,
    n_embd: usize,
    shared: Arc<Shared>,
    /// The thread's workers (shared with [`CpuJoin::workers`], which measures them while no step runs).
    workers: Arc<SpinPool>,
    thread: Option<JoinHandle<()>>,
}

impl CpuJoin {
    /// The mapped words and device buffers for `n_layer` layers, top-`k` and width `n_embd`, and the answering
    /// thread (computing on `workers`, beside them).
    ///
    /// Errors: an allocation, the mapping or the thread failed.
    pub(super) fn new(
        stream: &Arc<CudaStream>,
        n_layer: usize,
        k: usize,
        n_embd: usize,
        plan: MissPlan,
        workers: SpinPool,
    ) -> Result<CpuJoin, CudaError> {
        let ctx: &Arc<CudaContext> = stream.context();
        let (_, _, n) = layout(k, n_embd);
        let map = cudarc::driver::sys::CU_MEMHOSTALLOC_DEVICEMAP | cudarc::driver::sys::CU_MEMHOSTALLOC_PORTABLE;
        let e = |what: &'static str| CudaError::driver(format!("the CPU's expert join: {what}"));
        // SAFETY: zeroed below before any reader starts.
        let mut words = unsafe { ctx.alloc_pinned_with_flags::<u32>(n, map) }.map_err(e("page-locked words"))?;
        let host = words.as_mut_ptr().map_err(e("page-locked words"))?;
        // SAFETY: `host` holds `n` words, unshared until the thread below starts.
        unsafe { std::ptr::write_bytes(host, 0, n) };
        let mut words_dev = 0;
        // SAFETY: `host` was allocated with DEVICEMAP.
        unsafe { cudarc::driver::sys::cuMemHostGetDevicePointer_v2(&mut words_dev, host as *mut _, 0) }
            .result()
            .map_err(e("mapping the page-locked words"))?;
        let dev = DevBuf::alloc(stream, (3 + k) * 4)?;
        // SAFETY: `dev` is this many bytes of device memory.
        unsafe { cudarc::driver::result::memset_d8_async(dev.ptr, 0, dev.bytes, stream.cu_stream()) }
            .map_err(e("clearing its device words"))?;
        let cells = n_layer * (k + 1);
        let take = DevBuf::alloc(stream, cells * 4)?;
        // SAFETY: `take` is this many bytes (zeros: no CPU job until a layer's row is uploaded).
        unsafe { cudarc::driver::result::memset_d8_async(take.ptr, 0, take.bytes, stream.cu_stream()) }
            .map_err(e("clearing its split table"))?;
        // SAFETY: written (zeros, then rows) before every upload.
        let mut take_host = unsafe { ctx.alloc_pinned_with_flags::<i32>(cells, 0) }.map_err(e("page-locked table"))?;
        take_host.as_mut_slice().map_err(e("page-locked table"))?.fill(0);
        let shared = Arc::new(Shared {
            words: host as usize,
            k,
            n_embd,
            layers: Mutex::new(vec![None; n_layer]),
            stop: AtomicBool::new(false),
            armed: AtomicBool::new(false),
            busy_us: AtomicU64::new(0),
            failure: Mutex::new(None),
        });
        let (s, workers) = (shared.clone(), Arc::new(workers));
        let w = workers.clone();
        let thread = std::thread::Builder::new()
            .name("strata-cpu-join".into())
            .spawn(move || serve(&s, &w))
            .map_err(|err| CudaError::ExpertTable(format!("the CPU's expert join thread: {err}")))?;
        Ok(CpuJoin {
            _words: words,
            words_dev,
            dev,
            take,
            take_host,
            take_bytes: vec![0; n_layer],
            plan: plan.joined(round_trip_s()),
            k,
            n_embd,
            shared,
            workers,
            thread: Some(thread),
        })
    }

    /// The split from now on, with the mapped round trip for the host path's copies ([`MissPlan::joined`]; rows are recomputed as layers are seen, after the uploads of the old ones).
    ///
    /// Errors: waiting for the device failed.
    pub(super) fn set_plan(&mut self, ctx: &Arc<CudaContext>, plan: MissPlan) -> Result<(), CudaError> {
        let plan = plan.joined(round_trip_s());
        if plan != self.plan {
            ctx.synchronize().map_err(CudaError::driver("context synchronize"))?;
            self.plan = plan;
            self.take_bytes.fill(0);
        }
        Ok(())
    }

    /// Names layer `ex`'s experts for the thread (what a request of that layer computes), and, when the layer is
    /// new or its experts' size changed, fills its row of the split table from the plan and queues the row's
    /// upload on `stream` (before the layer's lookup, which reads it; the graph of a later step reads the table in
    /// place).
    ///
    /// Errors: the copy could not be queued.
    ///
    /// Panics if `ex` is wider than the join was made for, or its layer out of range.
    pub(super) fn register(&mut self, stream: &Arc<CudaStream>, ex: &Experts<'_>) -> Result<(), CudaError> {
        assert!(
            ex.gate.cols == self.n_embd && ex.layer < self.take_bytes.len(),
            "cpu join: layer shape"
        );
        {
            let mut layers = self.shared.layers.lock().unwrap_or_else(|e| e.into_inner());
            let slot = &mut layers[ex.layer];
            if slot.is_none_or(|s| s.gate.data.as_ptr() != ex.gate.data.as_ptr()) {
                // SAFETY (of the lifetime): the thread reads these weights only for requests of steps that use
                // the device's table, whose kernels read the same bytes through the arena's mapping; the arena
                // outlives every step of the backend (`HostPin`'s contract: the engine drops the pin, then the
                // model), and the thread is joined when the backend drops its pool.
                *slot = Some(unsafe { std::mem::transmute::<Experts<'_>, Experts<'static>>(*ex) });
            }
        }
        let bytes = ex.expert_bytes();
        if self.take_bytes[ex.layer] == bytes {
            return Ok(());
        }
        self.take_bytes[ex.layer] = bytes;
        let k = self.k;
        let row = ex.layer * (k + 1)..(ex.layer + 1) * (k + 1);
        let h = self
            .take_host
            .as_mut_slice()
            .map_err(CudaError::driver("page-locked table"))?;
        for (m, v) in h[row.clone()].iter_mut().enumerate() {
            *v = self.plan.cpu_count(m, bytes) as i32;
        }
        // SAFETY: `take` holds the whole table; the row's staging is page-locked and rewritten only when the
        // layer's row changes again: after a new plan ([`CpuJoin::set_plan`] waits for the stream first).
        unsafe {
            cudarc::driver::result::memcpy_htod_async(
                self.take.ptr + (row.start * 4) as u64,
                &h[row],
                stream.cu_stream(),
            )
        }
        .map_err(CudaError::driver("uploading the CPU's share of expert misses"))
    }

    /// Wakes the thread for a step's requests: it spins until [`CpuJoin::disarm`], or [`SPIN`] after its last
    /// request.
    pub(super) fn arm(&self) {
        self.shared.armed.store(true, Ordering::Relaxed);
        if let Some(t) = &self.thread {
            t.thread().unpark();
        }
    }

    /// Whether a step's requests are expected ([`CpuJoin::arm`] without a [`CpuJoin::disarm`] since).
    pub(super) fn armed(&self) -> bool {
        self.shared.armed.load(Ordering::Relaxed)
    }

    /// The spinning workers the thread computes with (the caller of a job on them works beside them).
    pub(super) fn workers(&self) -> &SpinPool {
        &self.workers
    }

    /// Lets the thread park (a step that gives it no request: the host's path, a prompt's chunk), so it does not
    /// take a core the step's own threads need. A request that still comes is answered, at a park's delay.
    pub(super) fn disarm(&self) {
        self.shared.armed.store(false, Ordering::Relaxed);
    }

    /// `expert_lookup`'s pointers for layer `layer`: its split row, the device words, the mapped words and the
    /// mapped activations (kernels/experts.cu).
    pub(super) fn lookup_args(&self, layer: usize) -> [u64; 4] {
        let (xo, _, _) = layout(self.k, self.n_embd);
        [
            self.take.ptr + (layer * (self.k + 1) * 4) as u64,
            self.dev.ptr,
            self.words_dev,
            self.words_dev + (xo * 4) as u64,
        ]
    }

    /// `cpu_join`'s pointers: the device words, the mapped words and the mapped rows.
    pub(super) fn join_args(&self) -> [u64; 3] {
        let (_, ro, _) = layout(self.k, self.n_embd);
        [self.dev.ptr, self.words_dev, self.words_dev + (ro * 4) as u64]
    }

    /// Wall time the thread spent computing since the last call, microseconds.
    pub(super) fn take_busy_us(&self) -> u64 {
        self.shared.busy_us.swap(0, Ordering::Relaxed)
    }

    /// After a step's end has passed: why a request failed, or the GPU stopped waiting for one (then the step's
    /// results are wrong), if either happened since the last call.
    pub(super) fn failure(&self) -> Option<String> {
        let failed = self.shared.word(FAILED).swap(0, Ordering::AcqRel);
        if failed == 0 {
            return None;
        }
        Some(
            self.shared
                .failure
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .take()
                .unwrap_or_else(|| {
                    format!(
                        "the GPU waited {} s for the CPU's expert misses (request {failed}) and gave up",
                        TIMEOUT_NS / 1_000_000_000
                    )
                }),
        )
    }
}

impl Drop for CpuJoin {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            t.thread().unpark();
            let _ = t.join();
        }
    }
}
