//! The CUDA backend: the [`Backend`] ops as CUDA kernels (kernels/*.cu, compiled by NVRTC at start).
//!
//! Activations live on the device ([`DevVec`], the backend's buffer type): a forward pass uploads token ids
//! and downloads logits, nothing else crosses PCIe. Every weight matrix is copied once, on first use, into a
//! [`weights::WeightStore`] (all resident in VRAM here; a MoE layer's stacked expert tensors are one buffer each,
//! an expert being a row range of it). KV caches are paged on the device ([`kv`]): a pool's blocks are rows of one array per
//! layer's keys or values, each sequence has a page table (released with its slot), and the device holds the cache's
//! only copy of the data (the host `KvCache` keeps the block numbers). The forward pass stays the one of
//! `model::forward`. Weight types without a kernel (the IQ types) run on the CPU backend through host copies.
//!
//! MoE: the router's softmax and top-k run on the device (`moe_route`; at decode with an f32 router in the router's
//! own launch, `router_route`). At decode the experts are reached by id from the device (`mmv_moe_*`: no host round
//! trip) and their sum, the residual add and the next norm are one launch (`moe_combine_add_rms_norm`); in prefill
//! the routing is read back once per layer to group the tokens by expert, each group running as a GEMM.
//!
//! Semantics follow the CPU backend (`backend::cpu`), including the f16 rounding of queries and probabilities
//! against an f16 cache. Q4_K and Q6_K rows of up to 4096 values multiply Q8_K activations as the CPU's do; other
//! quantized weights multiply f32 activations (the CPU quantizes them to int8 first). The parity test
//! (engine/tests/cuda_parity.rs) states each op's tolerance.
//!
//! Prefill GEMM: weights dequantized to f16, activations converted to f16, cuBLAS `GemmEx` with f32 accumulation.
//! When the library fails, the backend falls back for good to our own tensor-core kernel (`gemm_*`,
//! kernels/gemm.cu: quantized tiles dequantized in shared memory, mma.sync) after one `fallback` event (seed
//! 000). A MoE layer's experts always run on that kernel, every expert in one launch per matrix. `STRATA_FAULT=prefill_gemm:m>N` (given through [`Backend::set_fault_policy`])
//! makes the library "fail" for batches over N tokens, to exercise that path on real hardware; with
//! `--gemm-fallback off` the failure is a `fault` and the op panics, as the original crashed.
//!
//! Errors: the trait has no error path, so a failed kernel panics after writing its `fault` event (the serve
//! worker's panic hook then exits and the server restarts it, DESIGN.md section 3).
//!
//! Files, one job each: [`context`] opens a [`Gpu`], [`compile`] builds and caches its kernels, [`launch`]
//! launches them (checked, PDL, profiling), `graph` records and replays decode steps; the ops are in `attention`,
//! `matmul`, `moe`, `kv` and `sampling`, the measured ceilings in `ceilings`; [`buffer`] and [`weights`] hold
//! device memory and the weight store, [`select`] the CPU-or-CUDA backend, [`error`] the error type. This file
//! has the types they share and the [`Backend`] impl, which calls into them.

mod attention;
pub use attention::{DECODE_MAX_DK, DECODE_MAX_DV};
pub mod buffer;
mod ceilings;
pub mod compile;
pub mod context;
pub mod error;
pub mod experts;
mod graph;
mod join;
mod kv;
pub mod launch;
mod matmul;
mod moe;
mod sampling;
pub mod select;
pub mod weights;

use std::collections::HashMap;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};

use cudarc::cublas::CudaBlas;
use cudarc::driver::{CudaContext, CudaFunction, CudaStream};

use super::cpu::CpuBackend;
use super::{AttnParams, Backend, Experts, GluKind, MoeScratch, QMat, RopeKind, RopeParams, StepKey};
use crate::device::fault::{FaultPlan, OP_PREFILL_GEMM};
use crate::events::{self, EventKind, Fallback};
use crate::experts::trace::RoutingReplay;
use crate::quant::{self, GgmlType};
use crate::state::kv::{BlockCopy, KvLayer, SeqSlot};
use buffer::DevBuf;
use compile::CompileReport;
use error::CudaError;
use experts::{ExpertCacheConfig, ExpertCacheStats, ExpertPool, HostPin};
use graph::Graphs;
use kv::{DevPool, DevTable};
use launch::{Arg, Profile};
use weights::{ResidentStore, WeightStore};

/// Most tokens a matmul runs as matrix-vector products; larger batches use the GEMM.
const MMV_MAX_TOKENS: usize = 4;
/// Most tokens a dense matmul runs as matrix-vector products by default (`STRATA_MMV_DENSE_TOKENS`) on dp4a
/// (`STRATA_MMQ=0`): Q4_K and Q6_K matrices read each row once for 8 tokens (`mmvt_*`), where the GEMM first
/// writes an f16 copy of the matrix; on an H100 with the 30B shape, 16 sequences decoding together 1,340 tok/s at
/// 16 against 1,234 at 8, and 32 no faster at 32 (`reports/2026-12-06-h100-mmvt.md`).
const MMV_DENSE_TOKENS: usize = 16;
/// The same on the integer tensor cores (`mmq_*`, `STRATA_MMQ` on): on an H100 with the 30B shape, against 16
/// (the f16 copy and cuBLAS past it), pp32 +17%, pp64 +7%, 32 sequences decoding together +12%, pp128 the same,
/// pp256 -9% and pp512 -16% with 512 (`reports/2026-12-07-h100-mmq-dense/`).
const MMV_DENSE_TOKENS_MMQ: usize = 64;
/// Most tokens `STRATA_MMV_DENSE_TOKENS` may name: a prompt step of up to 512 tokens on `mmq_*` (a tuning knob).
const MMV_DENSE_TOKENS_MAX: usize = 512;

/// Fewest rows of a prefill GEMM tile by default (`STRATA_GEMM_MIN_TILE`): a tile of at most 32 rows (an
/// expert's tokens in a short prompt) is computed 32 rows high, one of 33 to 64 rows 64 high, else 128 high.
const GEMM_MIN_TILE: usize = 32;

/// Fewest tokens of a step whose experts are grouped by expert with `STRATA_MOE_GROUPS` on: on an H100 with the
/// 30B shape, 4 sequences decoding together 741 tok/s grouped against 789 per slot, 8: 1,122 against 1,116,
/// 32: 1,818 against 1,606 (`reports/2026-12-06-h100-mmvt.md`).
const MOE_GROUP_MIN_TOKENS: usize = 8;

/// The kernel-name suffix of a weight type the GPU computes with; `None`: the CPU runs that matmul.
pub fn kernel_type(ty: GgmlType) -> Option<&'static str> {
    Some(match ty {
        GgmlType::F32 => "f32",
        GgmlType::F16 => "f16",
        GgmlType::BF16 => "bf16",
        GgmlType::Q4_0 => "q4_0",
        GgmlType::Q4_1 => "q4_1",
        GgmlType::Q5_0 => "q5_0",
        GgmlType::Q5_1 => "q5_1",
        GgmlType::Q8_0 => "q8_0",
        GgmlType::Q2_K => "q2_k",
        GgmlType::Q3_K => "q3_k",
        GgmlType::Q4_K => "q4_k",
        GgmlType::Q5_K => "q5_k",
        GgmlType::Q6_K => "q6_k",
        _ => return None,
    })
}

/// Whether the GPU computes with `w` (a supported type in whole 32-value chunks).
pub fn gpu_computes(w: &QMat<'_>) -> bool {
    kernel_type(w.ty).is_some() && w.cols.is_multiple_of(32)
}

/// `&'static str` kernel names for the per-type kernels (the launcher keys kernels by static names).
fn typed(prefix: &str, ty: GgmlType) -> &'static str {
    let suffix = kernel_type(ty).expect("caller checked the type");
    compile::KERNEL_NAMES
        .iter()
        .find(|n| n.strip_prefix(prefix) == Some(suffix))
        .expect("every type of kernel_type has its kernels")
}

/// Scratch buffers of the backend, grown on demand.
#[derive(Clone, Copy)]
enum Slot {
    Pos = 0,
    Scores,
    Part,
    WF16,
    XF16,
    Idx,
    MoeIds,
    MoeW,
    MoeGate,
    MoeUp,
    MoeDown,
    MoeRows,
    Tiles,
    SplitMax,
    SplitSum,
    TopCand,
    TopOut,
    GF16,
    /// Zeroed once, then kept at zero by the kernels that count their finished blocks in it (`block_is_last`).
    Counters,
    /// A decode step's routing slots by expert-cache slot id.
    MoeSlotIds,
    /// The rows the CPU computed for a decode step's expert misses, then their routing slots.
    MoeCpuRows,
    /// The expert prefetch's router logits, experts and weights (the next MoE layer's router on this layer's
    /// input).
    PrefetchLogits,
    PrefetchIds,
    PrefetchW,
    /// The candidates and selections of a step of several sequences (`top_logits_rows`), apart from a decode
    /// step's (its graph keeps [`Slot::TopCand`] and [`Slot::TopOut`]).
    TopCandRows,
    TopOutRows,
    /// Each decode token's key and value cache addresses, for a step of several sequences (`attend_decode_runs`).
    KvTable,
    /// A step's routing slots grouped by expert (`moe_groups`, read by `mmv_moe_group_*`).
    MoeGroups,
    /// A step's activation rows quantized to Q8_K (`q8k_stage`, read by `mmvt_*`).
    Q8k,
    /// A prefill step's work list of experts with few tokens (`mmq_moe_*`), its tokens quantized to Q8_K, and
    /// its gated rows quantized to Q8_K for the down projection.
    MmqTiles,
    MoeQ8k,
    MoeQ8kDown,
}
const SLOTS: usize = 32;
/// Counters in [`Slot::Counters`] (one per token of a decode step).
const COUNTERS: usize = 64;
/// Routing slots that share one weight read in `mmv_moe_group_*`, the ints of a group in the table `moe_groups`
/// writes, and the most slots it groups (kernels/common.cuh holds the same numbers: change both together).
const MOE_GROUP_T: usize = 4;
const MOE_GROUP_INTS: usize = 2 + MOE_GROUP_T;
const MOE_GROUP_MAX_SLOTS: usize = 1024;
/// The most tokens a step's experts may run on the device's routing (`STRATA_MOE_DEVICE_TOKENS`): the router's
/// counters.
pub const MOE_DEVICE_TOKENS_MAX: usize = COUNTERS;
const _: () = assert!(MMV_MAX_TOKENS <= COUNTERS);
// A decode step's distinct experts must fit the expert cache's staging slots, which the plan sizes for this many
// tokens.
const _: () = assert!(MMV_MAX_TOKENS <= crate::experts::STAGING_TOKENS);

/// How values cross from one CUDA device to another ([`CudaBackend::link_to`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Link {
    /// Both backends share one device (and context): a device-to-device copy.
    SameDevice,
    /// Two devices with peer access enabled both ways: a copy over the peer link (NVLink or PCIe P2P).
    Peer,
    /// Two devices without peer access: the driver stages the copy through host memory.
    Staged,
}

impl std::fmt::Display for Link {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Link::SameDevice => "a device-to-device copy (one card)",
            Link::Peer => "a peer copy (peer access on)",
            Link::Staged => "a copy staged through host memory by the driver (no peer access)",
        })
    }
}

/// An f32 activation buffer on the device: the CUDA backend's [`Backend::Buf`].
#[derive(Default)]
pub struct DevVec {
    buf: Option<DevBuf>,
}

impl DevVec {
    /// The device address (0 before the first [`Backend::reserve`]).
    pub fn ptr(&self) -> u64 {
        self.buf.as_ref().map_or(0, |b| b.ptr)
    }

    /// Values it holds.
    pub fn capacity(&self) -> usize {
        self.buf.as_ref().map_or(0, |b| b.bytes / 4)
    }

    fn at(&self, offset: usize) -> u64 {
        self.ptr() + (offset * 4) as u64
    }
}

struct Inner {
    weights: Box<dyn WeightStore>,
    /// The KV pools' rows on the device, by pool ([`crate::state::kv::KvPool::id`]; freed once the pool is).
    kv_pools: HashMap<u32, DevPool>,
    /// Each sequence's page table on the device (released with the slot).
    kv_tables: HashMap<SeqSlot, DevTable>,
    /// A stage of a layer split ([`CudaBackend::share_kv_copies`]): the copy-on-write block copies this backend's
    /// steps made (the pool, the copy), for the other stages to make in their layers' arrays.
    kv_copies_out: Option<Vec<(u32, BlockCopy)>>,
    slots: Vec<Option<DevBuf>>,
    /// The positions last uploaded to [`Slot::Pos`] (a decode step changes one value).
    pos: Vec<u32>,
    blas: Option<CudaBlas>,
    blas_failed: bool,
    /// `prefill_gemm:m>N` of `STRATA_FAULT`: the library GEMM "fails" for batches over N tokens.
    fault_gemm_above: Option<usize>,
    /// `--gemm-fallback`: whether a failed library GEMM falls back to our kernel (else the op fails).
    gemm_fallback: bool,
    /// The VRAM expert cache, when the experts do not all stay resident.
    experts: Option<ExpertPool>,
    /// `--routing-trace`: the routers' choices replaced by a trace's.
    replay: Option<RoutingReplay>,
    /// The last MoE op ran on the CPU backend through host copies (its routing is in the op's scratch), not on
    /// the device (its routing is in [`Slot::MoeIds`]).
    moe_on_host: bool,
    /// Fewest tokens of a step whose routing slots are grouped by expert ([`MOE_GROUP_MIN_TOKENS`] with
    /// `STRATA_MOE_GROUPS` on, read at start; `usize::MAX`: never; tests set 2 and compare both ways).
    moe_groups_from: usize,
    /// Most tokens of a prefill step whose experts run on `mmq_moe_*` (`STRATA_MMQ_PREFILL_TOKENS`, read at start,
    /// default [`crate::memory::MMQ_MOE_TOKENS`], at most [`crate::memory::MMQ_MOE_TOKENS_MAX`]; tests set it).
    mmq_moe_tokens: usize,
    /// Most tokens of a step of several sequences without an expert cache whose experts run on the device's
    /// routing (`STRATA_MOE_DEVICE_TOKENS`, read at start, at most [`MOE_DEVICE_TOKENS_MAX`]).
    moe_device_tokens: usize,
    /// The sequences the running forward pass carries ([`Backend::step_sequences`]); it holds until the next
    /// forward pass (a replayed graph is a one-token step, which takes the device's routing either way).
    step_sequences: usize,
    /// Most tokens a dense matmul runs as matrix-vector products (`STRATA_MMV_DENSE_TOKENS`, read at start, at
    /// least [`MMV_MAX_TOKENS`], at most [`MMV_DENSE_TOKENS_MAX`]); `None`: [`Inner::mmv_dense_tokens`]'s
    /// default. Larger steps take the GEMM.
    mmv_dense_tokens: Option<usize>,
    /// Fewest rows of a tile of our prefill GEMM (`STRATA_GEMM_MIN_TILE`, read at start: 32, 64 or 128): each
    /// tile runs at the smallest height of 32, 64 and 128 that holds its rows and is at least this
    /// ([`Inner::gemm_own`]).
    gemm_min_tile: usize,
    /// Q4_K and Q6_K products of several tokens on the integer tensor cores (`mmq_*` for dense matrices,
    /// `mmq_moe_*` for the experts of prompt steps of up to `STRATA_MMQ_PREFILL_TOKENS`; `STRATA_MMQ`, read at
    /// start; tests compare both ways).
    mmq: bool,
    /// `--batch-invariant`: every step's tokens take the kernels of a lone decode step, each token's arithmetic
    /// in one order whatever else the step carries ([`CudaBackend::set_batch_invariant`]).
    batch_invariant: bool,
    /// [`CudaBackend::set_batch_invariant_scores`].
    bi_scores: usize,
    /// Per layer, its router when `router_route` routes it, once a step has run the layer: the device address of
    /// the f32 matrix and its shape (rows = experts, columns = width; `(0, 0, 0)`: not known). What the expert
    /// prefetch applies ahead of the layer.
    routers: Vec<(u64, usize, usize)>,
}

/// The CUDA backend over one device (see the module docs).
pub struct CudaBackend {
    gpu: Arc<Gpu>,
    inner: Mutex<Inner>,
    cpu: CpuBackend,
    /// A step of several sequences attends over their decode tokens in one launch (`STRATA_BATCH_ATTENTION`).
    batch_attention: std::sync::atomic::AtomicBool,
    /// Prefill attention over an int8 cache on the tensor cores (`STRATA_INT8_FLASH`, read at start; tests compare
    /// both ways).
    int8_flash: std::sync::atomic::AtomicBool,
    /// A step of several sequences whose longest decode span is over this many cells attends split over the keys
    /// (`STRATA_BATCH_SPLIT_CELLS`, read at start, default [`BATCH_SPLIT_CELLS`]: never; tests set it).
    batch_split_cells: std::sync::atomic::AtomicUsize,
}

/// Most cells of the longest decode span a step of several sequences attends over in one attn_decode launch (a
/// block per query head and token over all its keys) by default; past it the step splits over the keys, a block
/// per KV head's GQA group, token and split (`STRATA_BATCH_SPLIT_CELLS`). By default no step splits: on the H200,
/// 32 sequences at depth 4,096 decoded at 576 tok/s split into 64-cell splits against 803 in one launch
/// (reports/2026-12-05-h200-batch-split.md).
pub const BATCH_SPLIT_CELLS: usize = usize::MAX;

/// An open device with the kernels loaded: opened in [`context`], launching in [`launch`] and `graph`.
pub struct Gpu {
    pub ctx: Arc<CudaContext>,
    /// The device's compute capability, as the speed switches' defaults read it.
    pub target: crate::switches::Target,
    pub stream: Arc<CudaStream>,
    /// A second stream for work beside `stream`'s inside a step ([`Gpu::fork`], [`Gpu::join`]).
    side: Arc<CudaStream>,
    /// Recorded on `stream` at a fork (the side waits for it), and on `side` at a join (`stream` waits for it).
    fork_ev: cudarc::driver::CudaEvent,
    join_ev: cudarc::driver::CudaEvent,
    /// Recorded on `side` at a [`Gpu::mark`], waited for by `stream` at a [`Gpu::wait_mark`].
    mark_ev: cudarc::driver::CudaEvent,
    /// Created with `CU_EVENT_BLOCKING_SYNC`: [`Gpu::wait_asleep`]'s wait sleeps in the driver instead of spinning.
    asleep_ev: cudarc::driver::CudaEvent,
    /// Launches go to `side` (between a fork and the next [`Gpu::to_main`] or join).
    on_side: std::sync::atomic::AtomicBool,
    funcs: HashMap<&'static str, CudaFunction>,
    calls: AtomicU64,
    sync_launches: bool,
    /// `STRATA_FAULT=sticky:KERNEL@N` or `trap:KERNEL@N` (seed 003), once armed ([`CudaBackend::arm_sticky`]).
    sticky: std::sync::OnceLock<crate::device::fault::LaunchGate>,
    /// Kernels are launched with programmatic dependent launch (sm_90 and later, unless `STRATA_PDL=0`): each may
    /// start while the one before it finishes, and waits in `pdl_enter()` (kernels/common.cuh) for its writes.
    pdl: bool,
    /// `STRATA_SKIP_KERNELS=a,b`: kernels left out of the decode-step graphs (a timing diagnostic, METHOD.md's
    /// "leave one stage out": a replayed step's time without them; the recording step runs them, so every buffer
    /// holds values of the right kind, but replayed steps compute wrong tokens). Empty unless set.
    skip: Vec<String>,
    /// `STRATA_PROFILE_KERNELS=1`: every launch between two timing events (see [`Gpu::kernel_profile`]).
    profile: Mutex<Profile>,
    profiling: std::sync::atomic::AtomicBool,
    /// Decode steps as CUDA graphs (see [`Gpu::step_begin`]).
    graphs: Mutex<Graphs>,
    pub compile: CompileReport,
    pub ordinal: usize,
    /// Streaming multiprocessors (launch sizing).
    pub sms: usize,
}

/// Widest activation row the Q4_K/Q6_K matrix-vector kernels stage in shared memory (kernels/matvec.cu MMV_X_MAX).
const MMV_X_MAX: usize = 4096;

/// Rows one block of a matrix-vector kernel computes (kernels/matvec.cu): 8 warps of one row, or of
/// MMV_R = 4 rows for the Q4_K and Q6_K kernels.
fn mmv_rows_per_block(ty: GgmlType) -> usize {
    match ty {
        GgmlType::Q4_K | GgmlType::Q6_K => 32,
        _ => 8,
    }
}

/// Rows one block of `mmv_moe_*` computes (kernels/matvec.cu, STRATA_MMV_MOE_FAST): for Q4_K and Q6_K, 64 when a
/// row has at most four super-blocks (1,024 values: two rows per group of eight lanes, MMV_MOE_RG_SHORT), else 32;
/// 8 for the other types.
fn mmv_moe_rows_per_block(ty: GgmlType, cols: usize) -> usize {
    match ty {
        GgmlType::Q4_K | GgmlType::Q6_K if cols <= 1024 => 64,
        _ => mmv_rows_per_block(ty),
    }
}

fn grid1(n: usize, block: u32) -> (u32, u32, u32) {
    ((n as u64).div_ceil(block as u64).max(1) as u32, 1, 1)
}

fn f32_bytes(x: &[f32]) -> &[u8] {
    bytemuck::cast_slice(x)
}

/// Threads of a norm block over rows of `n`: two values each, whole warps, 32 to 1024.
fn norm_threads(n: usize) -> u32 {
    (n.div_ceil(2).next_multiple_of(32)).clamp(32, 1024) as u32
}

/// `gate[..len] = act(gate) * up` on device buffers (the `glu` kernel).
fn glu_dev(gpu: &Gpu, gate: u64, up: u64, len: usize, act: GluKind) -> Result<(), CudaError> {
    gpu.launch(
        "glu",
        grid1(len, 256),
        (256, 1, 1),
        &[Arg::P(gate), Arg::P(up), Arg::L(len as i64), Arg::I(glu_code(act))],
    )
}

fn glu_code(act: GluKind) -> i32 {
    match act {
        GluKind::SwiGlu => 0,
        GluKind::GeGlu => 1,
    }
}

impl CudaBackend {
    /// Opens device `ordinal` with every weight resident in VRAM.
    ///
    /// Errors: CUDA unavailable, no such device, the kernels do not compile or load.
    pub fn new(ordinal: usize) -> Result<CudaBackend, CudaError> {
        let gpu = Arc::new(Gpu::open(ordinal)?);
        let blas = if crate::device::cuda_libs::load()?.cublas.is_some() {
            CudaBlas::new(gpu.stream.clone()).ok()
        } else {
            None
        };
        if blas.is_none() {
            events::emit(EventKind::Fallback(Fallback {
                op: OP_PREFILL_GEMM.into(),
                from: "blas".into(),
                to: "gemm_tensor_core".into(),
                why: "cuBLAS not found or not initialised".into(),
                shape: None,
                max_rows: None,
            }));
        }
        let batch_attention = crate::switches::speed_on(crate::switches::BATCH_ATTENTION, &gpu.target);
        let moe_groups_from = match crate::switches::speed_on(crate::switches::MOE_GROUPS, &gpu.target) {
            true => MOE_GROUP_MIN_TOKENS,
            false => usize::MAX,
        };
        let int8_flash = crate::switches::speed_on(crate::switches::INT8_FLASH, &gpu.target);
        let mmq = crate::switches::speed_on(crate::switches::MMQ, &gpu.target);
        let mmq_moe_tokens = crate::switches::usize_in(
            crate::switches::MMQ_PREFILL_TOKENS,
            1..=crate::memory::MMQ_MOE_TOKENS_MAX,
        )
        .unwrap_or(crate::memory::MMQ_MOE_TOKENS);
        let moe_device_tokens =
            crate::switches::usize_in(crate::switches::MOE_DEVICE_TOKENS, 1..=MOE_DEVICE_TOKENS_MAX)
                .unwrap_or(MOE_DEVICE_TOKENS_MAX);
        let mmv_dense_tokens =
            crate::switches::usize_in(crate::switches::MMV_DENSE_TOKENS, MMV_MAX_TOKENS..=MMV_DENSE_TOKENS_MAX);
        let gemm_min_tile = match crate::switches::usize_in(crate::switches::GEMM_MIN_TILE, 32..=128) {
            Some(n @ (32 | 64 | 128)) => n,
            Some(n) => {
                eprintln!(
                    "strata: {}={n} is not 32, 64 or 128: ignored",
                    crate::switches::GEMM_MIN_TILE
                );
                GEMM_MIN_TILE
            }
            None => GEMM_MIN_TILE,
        };
        let batch_split_cells = match crate::switches::text_lossy(crate::switches::BATCH_SPLIT_CELLS) {
            Some(v) if v.trim() == "never" => usize::MAX,
            _ => crate::switches::usize_in(crate::switches::BATCH_SPLIT_CELLS, 0..=usize::MAX)
                .unwrap_or(BATCH_SPLIT_CELLS),
        };
        Ok(CudaBackend {
            gpu,
            inner: Mutex::new(Inner {
                weights: Box::new(ResidentStore::default()),
                kv_pools: HashMap::new(),
                kv_copies_out: None,
                kv_tables: HashMap::new(),
                slots: (0..SLOTS).map(|_| None).collect(),
                pos: Vec::new(),
                blas_failed: blas.is_none(),
                blas,
                fault_gemm_above: None,
                gemm_fallback: true,
                experts: None,
                replay: None,
                moe_on_host: false,
                moe_groups_from,
                mmq_moe_tokens,
                moe_device_tokens,
                step_sequences: 1,
                mmv_dense_tokens,
                gemm_min_tile,
                mmq,
                batch_invariant: false,
                bi_scores: attention::BATCH_INVARIANT_SCORES,
                routers: Vec::new(),
            }),
            cpu: CpuBackend,
            batch_attention: std::sync::atomic::AtomicBool::new(batch_attention),
            int8_flash: std::sync::atomic::AtomicBool::new(int8_flash),
            batch_split_cells: std::sync::atomic::AtomicUsize::new(batch_split_cells),
        })
    }

    /// Most cells of the longest decode span a step of several sequences attends over in one attn_decode launch;
    /// past it the step splits over the keys (`STRATA_BATCH_SPLIT_CELLS`, read at start, unset: never; 0: always,
    /// `usize::MAX`: never).
    pub fn set_batch_split_cells(&self, cells: usize) {
        self.batch_split_cells
            .store(cells, std::sync::atomic::Ordering::Relaxed);
    }

    /// Whether a step of several sequences attends over their decode tokens in one launch
    /// (`STRATA_BATCH_ATTENTION`, read at start; tests compare both ways).
    pub fn set_batch_attention(&self, on: bool) {
        self.batch_attention.store(on, std::sync::atomic::Ordering::Relaxed);
    }

    /// Whether prefill attention over an int8 (Q8_0) cache runs on the tensor cores, dequantized to f16 tiles
    /// (`STRATA_INT8_FLASH`, read at start; not the CPU's rounding: tests compare both ways by KL divergence).
    pub fn set_int8_flash(&self, on: bool) {
        self.int8_flash.store(on, std::sync::atomic::Ordering::Relaxed);
    }

    /// Whether every step of several tokens groups its routing slots by expert, each expert's rows read once per
    /// group (off: none does). At start `STRATA_MOE_GROUPS` decides, for steps of [`MOE_GROUP_MIN_TOKENS`] or
    /// more; the results are the same bit for bit (tests compare both ways).
    pub fn set_moe_groups(&self, on: bool) {
        self.lock().moe_groups_from = if on { 2 } else { usize::MAX };
    }

    /// The most tokens of a prefill step whose Q4_K and Q6_K experts run on the integer tensor cores (`mmq_moe_*`,
    /// with `STRATA_MMQ` on outside `--batch-invariant`; longer steps take the f16 GEMM), `n` clamped to
    /// 1..=[`crate::memory::MMQ_MOE_TOKENS_MAX`] (`STRATA_MMQ_PREFILL_TOKENS`, read at start; tests set it).
    pub fn set_mmq_prefill_tokens(&self, n: usize) {
        self.lock().mmq_moe_tokens = n.clamp(1, crate::memory::MMQ_MOE_TOKENS_MAX);
    }

    /// The most tokens of a step of several sequences without an expert cache whose experts run on the device's
    /// routing (a lone sequence's steps take at most [`MMV_MAX_TOKENS`] there), `n` clamped
    /// to 1..=[`MOE_DEVICE_TOKENS_MAX`] (`STRATA_MOE_DEVICE_TOKENS`, read at start; tests set it).
    pub fn set_moe_device_tokens(&self, n: usize) {
        self.lock().moe_device_tokens = n.clamp(1, MOE_DEVICE_TOKENS_MAX);
    }

    /// Batch-invariant kernels (`--batch-invariant`; off by default): each token of every step takes the kernels
    /// of a lone decode step, whose arithmetic for one token does not depend on the step's other tokens, so a
    /// sequence gets the same logits bits alone and inside any batch of other sequences, whatever its prompt's
    /// chunks. Dense matrices (the output head included) and experts run as matrix-vector products (no GEMM: the
    /// library picks its tiling and split by the step's size), experts on the device's routing in groups of up
    /// to `STRATA_MOE_DEVICE_TOKENS` tokens, and every query attends in one attn_decode block over its keys in
    /// order (no split over the keys, which depends on the span; no fused RoPE, whose dot products sum in another
    /// order; no tensor-core prefill attention). Prompts read slower: `strata bench --batch-invariant` measures
    /// it. Recorded decode graphs are dropped, so none recorded under the other setting replays. Outside the
    /// guarantee, which the engine refuses together with it: an expert cache (misses the CPU computes take its
    /// arithmetic), a routing dump (it reads a step's routing back whole, which these steps route in groups), a
    /// routing trace (its experts follow the order of the steps' tokens), heads wider than attn_decode stages
    /// (`head_dim` over 512 or `head_dim_v` over 256).
    ///
    /// Source: the batch-invariant kernels of "Defeating Nondeterminism in LLM Inference" (He and Thinking
    /// Machines, 2025): a reduction order fixed per token, not per batch.
    pub fn set_batch_invariant(&self, on: bool) {
        self.lock().batch_invariant = on;
        self.gpu.forget_graphs();
    }

    /// Most bytes of scores a batch-invariant attention launch stages for queries whose spans pass shared memory
    /// (default [`attention::BATCH_INVARIANT_SCORES`], 256 MiB; longer steps take several launches). Tests make
    /// it small to run several.
    pub fn set_batch_invariant_scores(&self, bytes: usize) {
        self.lock().bi_scores = bytes.max(1);
    }

    /// The most tokens a dense matmul runs as matrix-vector products, `n` clamped to
    /// [`MMV_MAX_TOKENS`]..=[`MMV_DENSE_TOKENS_MAX`] (`STRATA_MMV_DENSE_TOKENS`, read at start; unset, 64 while
    /// `mmq_*` is on and 16 while it is off; tests set it).
    pub fn set_mmv_dense_tokens(&self, n: usize) {
        self.lock().mmv_dense_tokens = Some(n.clamp(MMV_MAX_TOKENS, MMV_DENSE_TOKENS_MAX));
    }

    /// Whether a dense Q4_K or Q6_K matrix times several tokens (2 to `STRATA_MMV_DENSE_TOKENS`, not
    /// batch-invariant) runs on the integer tensor cores (`mmq_*`) or on dp4a (`mmvt_*`), and whether a prompt
    /// step of up to `STRATA_MMQ_PREFILL_TOKENS` tokens runs its experts there (`mmq_moe_*`) or on the f16
    /// GEMM: `STRATA_MMQ`, read at start, on by default. The routes sum in different orders (the GEMM's f16
    /// activations sit further from the CPU); tests compare them.
    pub fn set_mmq(&self, on: bool) {
        self.lock().mmq = on;
    }

    /// The fewest rows of a prefill GEMM tile: each tile runs at the smallest height of 32, 64 and 128 that
    /// holds its rows and is at least `n` (`STRATA_GEMM_MIN_TILE`, read at start, default [`GEMM_MIN_TILE`]; 128:
    /// every tile computed 128 rows high, as before). Each height gives the same bits. Tests set it. Panics unless
    /// `n` is 32, 64 or 128.
    pub fn set_gemm_min_tile(&self, n: usize) {
        assert!(matches!(n, 32 | 64 | 128), "gemm tile height {n}: 32, 64 or 128");
        self.lock().gemm_min_tile = n;
    }

    /// The device and how its kernels were obtained.
    pub fn gpu(&self) -> &Gpu {
        &self.gpu
    }

    /// How values cross from this backend's device to `to`'s ([`CudaBackend::send_f32`]), enabling peer access
    /// both ways where the two devices allow it (`cuDeviceCanAccessPeer`; `cuCtxEnablePeerAccess`).
    ///
    /// Errors: a driver call failed.
    pub fn link_to(&self, to: &CudaBackend) -> Result<Link, CudaError> {
        use cudarc::driver::sys;
        let (a, b) = (&self.gpu.ctx, &to.gpu.ctx);
        if a.cu_ctx() == b.cu_ctx() {
            return Ok(Link::SameDevice);
        }
        let mut can = [0i32; 2];
        for (i, (x, y)) in [(a, b), (b, a)].into_iter().enumerate() {
            // SAFETY: `can[i]` is a live int the call writes; both devices are open.
            unsafe { sys::cuDeviceCanAccessPeer(&mut can[i], x.cu_device(), y.cu_device()) }
                .result()
                .map_err(CudaError::driver("cuDeviceCanAccessPeer"))?;
        }
        if can != [1, 1] {
            return Ok(Link::Staged);
        }
        for (x, y) in [(a, b), (b, a)] {
            x.bind_to_thread().map_err(CudaError::driver("bind context"))?;
            // SAFETY: `y`'s context is alive (held by its backend); enabling twice answers ALREADY_ENABLED.
            match unsafe { sys::cuCtxEnablePeerAccess(y.cu_ctx(), 0) } {
                sys::CUresult::CUDA_SUCCESS | sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED => {}
                e => {
                    let err = e.result().expect_err("not CUDA_SUCCESS");
                    return Err(CudaError::driver("cuCtxEnablePeerAccess")(err));
                }
            }
        }
        Ok(Link::Peer)
    }

    /// Copies `len` f32 values from device address `src` (inside a buffer of this backend) to `dst` (inside a
    /// buffer of `to`, on this device or another) after everything queued on this backend's stream, and makes
    /// `to`'s stream wait for the copy: no host round trip. The copy itself waits for the work already queued on
    /// `to`'s stream (which may still read or write the destination). `cuMemcpyPeerAsync` moves them over the peer link
    /// where [`CudaBackend::link_to`] enabled it, through host memory inside the driver otherwise. A layer split
    /// carries the hidden state between its stages this way, by the addresses of its buffers.
    ///
    /// Panics (after a `fault` event) on a failed copy.
    pub fn send_f32(&self, src: u64, to: &CudaBackend, dst: u64, len: usize) {
        Self::check(self.gpu.poisoned("device-to-device copy"));
        if len == 0 {
            return;
        }
        Self::check((|| {
            // The copy writes `to`'s buffer: it waits for everything queued on `to`'s stream first (its last use
            // of that buffer, a step still running there, the buffer's allocation on that stream). The wait
            // leaves this backend's context current, as the copy below needs.
            self.gpu
                .stream
                .join(&to.gpu.stream)
                .map_err(CudaError::driver("stream wait"))?;
            // SAFETY: the caller names live device ranges of `len` f32 values on each side; the copy is ordered
            // on this stream after `to`'s earlier work, and `to`'s stream waits for it before its next work.
            unsafe {
                cudarc::driver::result::memcpy_peer_async(
                    to.gpu.ctx.cu_ctx(),
                    dst,
                    self.gpu.ctx.cu_ctx(),
                    src,
                    len * 4,
                    self.gpu.stream.cu_stream(),
                )
            }
            .map_err(CudaError::driver("device-to-device copy"))?;
            to.gpu
                .stream
                .join(&self.gpu.stream)
                .map_err(CudaError::driver("stream wait"))
        })());
    }

    /// Arms a sticky fault: the rule's launch fails (`sticky:`, the driver's `CUDA_ERROR_LAUNCH_FAILED` injected
    /// at it, or at the next call when launches are not synchronised) or traps (`trap:`, a real poisoned
    /// context), and every later launch, copy and synchronisation fails. Decode steps run without CUDA graphs from
    /// here on, so every launch is counted. Returns whether launches are synchronised.
    ///
    /// Errors: the kernel is not in the module (the message lists the module's kernels); already armed.
    pub fn arm_sticky(&self, rule: &crate::device::fault::StickyRule) -> Result<bool, String> {
        let g = &*self.gpu;
        if !g.funcs.contains_key(rule.kernel.as_str()) || rule.kernel == "strata_trap" {
            let mut names: Vec<&str> = g.funcs.keys().copied().filter(|k| *k != "strata_trap").collect();
            names.sort_unstable();
            return Err(format!(
                "{rule}: cuda:{} has no kernel `{}`; its kernels: {}",
                g.ordinal,
                rule.kernel,
                names.join(", ")
            ));
        }
        let gate = crate::device::fault::LaunchGate::new(
            rule.clone(),
            g.sync_launches,
            "DriverError(CUDA_ERROR_LAUNCH_FAILED, \"unspecified launch failure\")",
        );
        g.sticky
            .set(gate)
            .map_err(|_| format!("{rule}: a sticky fault is armed already"))?;
        g.graphs_off();
        Ok(g.sync_launches)
    }

    /// Makes the VRAM expert cache the memory plan sized (`memory::ExpertPlacement::Cache`): from now on a MoE
    /// layer's experts come from its slots, uploaded from the host store when missing, and are never made
    /// resident. Returns the bytes of device memory the slots take.
    ///
    /// Errors: the device cannot allocate the slots.
    pub fn configure_expert_cache(&self, config: ExpertCacheConfig) -> Result<usize, CudaError> {
        let mut s = self.lock();
        // The old pool's buffers (slots, page-locked rows) may still be read by queued work.
        self.gpu
            .stream
            .synchronize()
            .map_err(CudaError::driver("stream synchronize"))?;
        s.experts = None;
        let pool = ExpertPool::new(&self.gpu.stream, config)?;
        let bytes = pool.bytes();
        s.experts = Some(pool);
        Ok(bytes)
    }

    /// Where the expert cache computes a decode step's misses from now on (`--miss-policy`; the default uploads
    /// every miss). Nothing without a cache.
    ///
    /// Errors: the CPU's worker threads could not be started.
    pub fn set_miss_plan(&self, plan: crate::experts::miss::MissPlan) -> std::io::Result<()> {
        match self.lock().experts.as_mut() {
            Some(p) => p.set_miss_plan(plan),
            None => Ok(()),
        }
    }

    /// How fast the CPU computes `ex`'s experts at decode on the threads the expert cache's misses use (`k` at a
    /// time, [`crate::backend::cpu::CpuBackend::expert_rate`]); `None` without a cache.
    pub fn cpu_expert_rate(&self, ex: &Experts<'_>, k: usize) -> Option<crate::backend::cpu::ExpertRate> {
        self.lock().experts.as_ref().map(|p| p.cpu_expert_rate(ex, k))
    }

    /// Of `misses` missing experts of `bytes` each, how many the CPU computes on the device's table with the CPU
    /// joining it, under `cost` ([`MissCost::joined`] with the join's round trip).
    pub fn joined_cpu_count(&self, cost: crate::experts::miss::MissCost, misses: usize, bytes: u64) -> usize {
        join::joined_cost(cost).cpu_count(misses, bytes)
    }

    /// Threads that compute expert misses at decode (what [`CudaBackend::cpu_expert_rate`] measures); 0 without a
    /// cache.
    pub fn cpu_expert_threads(&self) -> usize {
        self.lock().experts.as_ref().map_or(0, |p| p.miss_workers().threads())
    }

    /// Makes every MoE layer route as `replay` says instead of by its router (`--routing-trace`: benchmarks of
    /// random-weight models; the logits are not the model's). Steps with it run without CUDA graphs.
    pub fn set_routing_replay(&self, replay: Option<RoutingReplay>) {
        self.lock().replay = replay;
    }

    /// The expert cache's settings, if the backend has one.
    pub fn expert_cache_config(&self) -> Option<ExpertCacheConfig> {
        self.lock().experts.as_ref().map(|p| *p.config())
    }

    /// What the expert cache did since it was made or last taken (`None` without a cache).
    pub fn expert_cache_stats(&self) -> Option<ExpertCacheStats> {
        self.lock().experts.as_mut().map(|p| Self::check(p.stats()))
    }

    /// [`CudaBackend::expert_cache_stats`], and zero them (per request).
    pub fn take_expert_cache_stats(&self) -> Option<ExpertCacheStats> {
        self.lock().experts.as_mut().map(|p| Self::check(p.take_stats()))
    }

    /// Pre-fills the expert cache's free slots with the first experts of `ranked` (an expert profile's ranking,
    /// most used first) and uploads them from `model`'s expert store; returns how many were placed (0 without a
    /// cache).
    ///
    /// Errors: an upload failed.
    pub fn prefill_expert_cache(
        &self,
        model: &crate::model::Model,
        ranked: &[crate::experts::ExpertId],
    ) -> Result<usize, CudaError> {
        let mut s = self.lock();
        match s.experts.as_mut() {
            Some(p) => p.prefill_profile(&self.gpu.stream, |il| model.layer_experts(il), ranked),
            None => Ok(0),
        }
    }

    /// Forward steps that decided their experts on the expert cache's device slot table since it was made: of one
    /// token, and of several (`None` without a cache).
    pub fn expert_table_steps(&self) -> Option<[u64; 2]> {
        self.lock().experts.as_ref().map(ExpertPool::table_steps)
    }

    /// The expert cache's lookups of each expert since it was made, `[layer * n_expert + expert]` (`None`
    /// without a cache).
    pub fn expert_lookups(&self) -> Option<Vec<u64>> {
        self.lock().experts.as_mut().map(|p| Self::check(p.lookups()))
    }

    /// Page-locks `bytes` (the expert arena) so uploads from it run at the link's pinned rate and overlap
    /// compute; unlocked when the returned guard drops (drop it before the memory is freed).
    ///
    /// Errors: the driver refused (`cuMemHostRegister`: not enough lockable memory, or unsupported).
    pub fn pin_host(&self, bytes: &[u8]) -> Result<HostPin, CudaError> {
        HostPin::new(&self.gpu, bytes)
    }

    /// Copies `weights` (host views the forward pass will hand the backend) to the device now rather than on first
    /// use, so the memory a model needs is taken, and measured, at start.
    ///
    /// Errors: an allocation or copy failed.
    pub fn preload(&self, weights: &[&[u8]]) -> Result<(), CudaError> {
        {
            let mut s = self.lock();
            for w in weights {
                s.weights.device_ptr(&self.gpu.stream, w)?;
            }
        }
        self.synchronize()
    }

    /// The host-to-device copy rates from `src` (the expert store's memory: page-locked or not), GB/s (1e9
    /// bytes): one untimed copy, then three timed ones, each waited for. A reading above the link's peak is a probe
    /// bug (DESIGN.md section 1, seed 000's readings): the caller checks them ([`crate::device::probe::check`]).
    /// `unsynced` (`STRATA_FAULT=probe:unsynced`) times each copy without waiting for it, the bug that makes a
    /// probe read terabytes per second from page-locked memory.
    ///
    /// Errors: the buffer could not be allocated or a copy failed.
    pub fn measure_upload(&self, src: &[u8], unsynced: bool) -> Result<Vec<f64>, CudaError> {
        if src.is_empty() {
            return Ok(vec![]);
        }
        let dst = DevBuf::alloc(&self.gpu.stream, src.len())?;
        let stream = &self.gpu.stream;
        let sync = || stream.synchronize().map_err(CudaError::driver("stream synchronize"));
        let mut readings = Vec::with_capacity(3);
        let copies = (|| {
            for i in 0..4 {
                sync()?;
                let t = std::time::Instant::now();
                // SAFETY: `dst` holds `src.len()` bytes; every copy is waited for before this function returns
                // (the synchronize after this closure runs on every path), so `src` outlives them.
                unsafe { cudarc::driver::result::memcpy_htod_async(dst.ptr, src, stream.cu_stream()) }
                    .map_err(CudaError::driver("host-to-device probe copy"))?;
                if !unsynced {
                    sync()?;
                }
                let secs = t.elapsed().as_secs_f64();
                if i > 0 {
                    readings.push(src.len() as f64 / secs.max(1e-9) / 1e9);
                }
            }
            Ok::<(), CudaError>(())
        })();
        let waited = sync();
        copies?;
        waited?;
        Ok(readings)
    }

    /// The PCI address of the device (`0000:19:00.0`), as Linux sysfs names it; `None` if the driver does not say.
    pub fn pci_bus_id(&self) -> Option<String> {
        use cudarc::driver::sys::CUdevice_attribute as A;
        let ctx = &self.gpu.ctx;
        let domain = ctx.attribute(A::CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID).ok()?;
        let bus = ctx.attribute(A::CU_DEVICE_ATTRIBUTE_PCI_BUS_ID).ok()?;
        let dev = ctx.attribute(A::CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID).ok()?;
        Some(format!("{domain:04x}:{bus:02x}:{dev:02x}.0"))
    }

    /// Bytes of weights resident on the device.
    pub fn resident_weight_bytes(&self) -> usize {
        self.lock().weights.resident_bytes()
    }

    /// Waits for every queued kernel (benchmarks and event timings).
    ///
    /// Errors: a kernel failed.
    pub fn synchronize(&self) -> Result<(), CudaError> {
        self.gpu.poisoned("stream synchronize")?;
        if let Some(p) = self.lock().experts.as_ref() {
            p.synchronize()?;
        }
        self.gpu
            .stream
            .synchronize()
            .map_err(CudaError::driver("stream synchronize"))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Unwraps an op's result: the trait has no error path (module docs).
    fn check<T>(r: Result<T, CudaError>) -> T {
        r.unwrap_or_else(|e| panic!("CUDA backend: {e}"))
    }

    /// `len` values of `buf` from `offset`, on the host (the CPU fallback of ops without a kernel).
    fn to_host(&self, buf: &DevVec, offset: usize, len: usize) -> Vec<f32> {
        let mut v = vec![0.0f32; len];
        Backend::download(self, buf, offset, &mut v);
        v
    }
}

impl Inner {
    /// Slot `s` with at least `bytes` bytes; its device address.
    fn slot(&mut self, gpu: &Gpu, s: Slot, bytes: usize) -> Result<u64, CudaError> {
        let cur = &mut self.slots[s as usize];
        if cur.as_ref().is_none_or(|b| b.bytes < bytes) {
            // Grow by half again so a batch that creeps up does not reallocate every call.
            let want = bytes.max(cur.as_ref().map_or(0, |b| b.bytes + b.bytes / 2));
            *cur = None;
            *cur = Some(DevBuf::alloc(&gpu.stream, want)?);
        }
        Ok(cur.as_ref().expect("just set").ptr)
    }

    /// The device address of a norm's weights (copied on first use like every weight), or 0 for none.
    fn norm_weights(&mut self, gpu: &Gpu, w: Option<&[f32]>) -> Result<u64, CudaError> {
        w.map_or(Ok(0), |w| self.weights.device_ptr(&gpu.stream, f32_bytes(w)))
    }

    /// [`Slot::Counters`], zeroed when first allocated (the kernels leave it zeroed).
    fn counters(&mut self, gpu: &Gpu) -> Result<u64, CudaError> {
        match &self.slots[Slot::Counters as usize] {
            Some(b) => Ok(b.ptr),
            None => self.upload(gpu, Slot::Counters, &[0u8; COUNTERS * 4]),
        }
    }

    fn upload(&mut self, gpu: &Gpu, s: Slot, data: &[u8]) -> Result<u64, CudaError> {
        let p = self.slot(gpu, s, data.len())?;
        self.slots[s as usize]
            .as_mut()
            .expect("sized")
            .write(&gpu.stream, data)?;
        Ok(p)
    }

    /// The positions on the device, uploaded only when they differ from the last ones.
    fn positions(&mut self, gpu: &Gpu, positions: &[u32]) -> Result<u64, CudaError> {
        if self.pos != positions || self.slots[Slot::Pos as usize].is_none() {
            self.pos.clear();
            self.pos.extend_from_slice(positions);
            return self.upload(gpu, Slot::Pos, bytemuck::cast_slice(positions));
        }
        Ok(self.slots[Slot::Pos as usize].as_ref().expect("uploaded").ptr)
    }

    fn read_slot<T: bytemuck::Pod>(&self, gpu: &Gpu, s: Slot, out: &mut [T]) -> Result<(), CudaError> {
        gpu.flush_step()?;
        self.slots[s as usize]
            .as_ref()
            .expect("slot written before it is read")
            .read(&gpu.stream, bytemuck::cast_slice_mut(out))
    }
}

impl CudaBackend {
    /// [`Backend::replay_step`] once it is known the recorded graph may run: uploads the step's token ids and
    /// positions, then launches the graph.
    fn replay_recorded(&self, key: StepKey, ids: &[u32], positions: &[u32]) -> bool {
        let g = &*self.gpu;
        let mut s = self.lock();
        // The recorded step read its token ids from the Idx slot and its positions from the Pos slot; both are
        // still the buffers it was recorded with (no allocation since), and neither write allocates.
        Self::check((|| {
            s.upload(g, Slot::Idx, bytemuck::cast_slice(ids))?;
            s.pos.clear();
            s.upload(g, Slot::Pos, bytemuck::cast_slice(positions))?;
            s.pos.extend_from_slice(positions);
            g.replay_verified(key)
        })());
        true
    }

    /// The first half of [`Backend::replay_step`]: whether `key`'s verified graph can run as this decode step.
    /// With an expert cache the step's decision is made here and stays open; when the answer is `false`, the
    /// forward pass that runs instead keeps it ([`ExpertPool::decode_step_begin`] answers the open step's).
    pub fn replay_ready(&self, key: StepKey) -> bool {
        if !self.gpu.can_replay(key) {
            return false;
        }
        // With an expert cache, a recorded step reads the device's slot table: replay it only when this step
        // uses the table too (else the step runs, and decides on the host).
        if !self.decode_step_begin(1, 1) && self.lock().experts.is_some() {
            return false;
        }
        // The path just chosen sets the step's variant: the graph must be of the same one.
        self.gpu.can_replay(key)
    }

    /// The second half of [`Backend::replay_step`], after [`CudaBackend::replay_ready`] answered `true`: the
    /// step's inputs written, its graph launched and the expert cache's step ended.
    pub fn replay_now(&self, key: StepKey, ids: &[u32], positions: &[u32]) -> bool {
        let replayed = self.replay_recorded(key, ids, positions);
        self.decode_step_end();
        replayed
    }

    /// Starts a forward step of `n_tok` tokens of `sequences` sequences for the expert cache, if there is one
    /// ([`ExpertPool::decode_step_begin`]): whether the step decides its experts on the device's slot table.
    fn decode_step_begin(&self, n_tok: usize, sequences: usize) -> bool {
        let mut s = self.lock();
        let s = &mut *s;
        // The most tokens such a step's resident experts would take on the decode kernels (the forward pass tells
        // the backend its sequences again).
        s.step_sequences = sequences;
        let most = match s.experts.as_ref() {
            Some(p) => s.device_routed_tokens(None, p.config().k),
            None => 0,
        };
        match s.experts.as_mut() {
            Some(p) => {
                let table = Self::check(p.decode_step_begin(&self.gpu.stream, n_tok, most, s.replay.as_mut()));
                // With and without the prefetch a decode step launches other kernels: graphs of their own.
                self.gpu.set_step_variant(p.prefetching() as u8);
                table
            }
            None => false,
        }
    }

    /// A prefetch whose layer never ran (a step that stopped early) leaves its copies on the side stream: the
    /// stream joins it (a step's graph holds no branch that is not joined).
    fn join_open_prefetch(&self) {
        if self.lock().experts.as_mut().is_some_and(ExpertPool::take_open_prefetch) {
            Self::check(self.gpu.join());
        }
    }

    /// Ends the step [`CudaBackend::decode_step_begin`] started ([`ExpertPool::decode_step_end`]).
    fn decode_step_end(&self) {
        if let Some(p) = self.lock().experts.as_mut() {
            Self::check(p.decode_step_end(&self.gpu.stream));
        }
    }
}

impl Backend for CudaBackend {
    type Buf = DevVec;

    fn name(&self) -> &'static str {
        "cuda"
    }

    fn reserve(&self, buf: &mut DevVec, len: usize) {
        if buf.capacity() < len {
            buf.buf = None;
            buf.buf = Some(Self::check(DevBuf::alloc(&self.gpu.stream, len * 4)));
        }
    }

    fn upload(&self, src: &[f32], dst: &mut DevVec) {
        assert!(
            src.len() <= dst.capacity(),
            "upload: {} values into {}",
            src.len(),
            dst.capacity()
        );
        Self::check(self.gpu.poisoned("host-to-device copy"));
        // Host-computed data in the middle of a step (a CPU fallback): the step must not become a graph.
        Self::check(self.gpu.flush_step());
        if let Some(b) = dst.buf.as_mut() {
            Self::check(b.write(&self.gpu.stream, f32_bytes(src)));
        }
    }

    fn download(&self, src: &DevVec, offset: usize, dst: &mut [f32]) {
        if dst.is_empty() {
            return;
        }
        let b = src.buf.as_ref().expect("download: a buffer never sized");
        Self::check(self.gpu.poisoned("device-to-host copy"));
        Self::check(self.gpu.flush_step());
        if self.lock().experts.as_ref().is_some_and(|p| p.join_armed()) {
            // The step's CPU join answers on every core but one: wait for the step asleep, not spinning on a core.
            Self::check(self.gpu.wait_asleep());
        }
        Self::check(b.read_at(&self.gpu.stream, offset * 4, bytemuck::cast_slice_mut(dst)));
    }

    fn copy(&self, src: &DevVec, src_offset: usize, dst: &mut DevVec, dst_offset: usize, len: usize) {
        assert!(
            src_offset + len <= src.capacity() && dst_offset + len <= dst.capacity(),
            "copy: out of bounds"
        );
        Self::check(self.gpu.launch(
            "copy_f32",
            grid1(len, 256),
            (256, 1, 1),
            &[
                Arg::P(src.at(src_offset)),
                Arg::P(dst.at(dst_offset)),
                Arg::L(len as i64),
            ],
        ));
    }

    fn top_logits(&self, logits: &DevVec, n: usize) -> bool {
        self.top_logits_dev(logits, n)
    }

    fn read_top_logits(&self, n: usize, out: &mut crate::backend::top::TopLogits) -> bool {
        self.read_top_logits_dev(n, out)
    }

    fn top_logits_rows(&self, logits: &DevVec, rows: usize, n: usize) -> bool {
        self.top_logits_rows_dev(logits, rows, n)
    }

    fn read_top_logits_rows(&self, n: usize, out: &mut [crate::backend::top::TopLogits]) -> bool {
        self.read_top_logits_rows_dev(n, out)
    }

    fn get_rows(&self, table: &QMat<'_>, ids: &[u32], out: &mut DevVec) {
        let n = ids.len() * table.cols;
        assert!(n <= out.capacity(), "get_rows: output");
        if !gpu_computes(table) {
            let mut host = vec![0.0f32; n];
            for (t, &id) in ids.iter().enumerate() {
                quant::dequantize(
                    table.ty,
                    table.row(id as usize),
                    &mut host[t * table.cols..][..table.cols],
                )
                .expect("embedding table checked at load");
            }
            return Backend::upload(self, &host, out);
        }
        let g = &*self.gpu;
        let mut s = self.lock();
        Self::check((|| {
            let wp = s.weights.device_ptr(&g.stream, table.data)?;
            let ip = s.upload(g, Slot::Idx, bytemuck::cast_slice(ids))?;
            g.launch(
                typed("get_rows_", table.ty),
                grid1(n / 32, 256),
                (256, 1, 1),
                &[
                    Arg::P(wp),
                    Arg::P(ip),
                    Arg::P(out.ptr()),
                    Arg::I(ids.len() as i32),
                    Arg::I(table.cols as i32),
                    Arg::L(table.row_bytes as i64),
                ],
            )
        })());
    }

    fn matmul(&self, w: &QMat<'_>, x: &DevVec, n_tok: usize, out: &mut DevVec) {
        assert!(x.capacity() >= n_tok * w.cols, "matmul: activations");
        assert!(out.capacity() >= n_tok * w.rows, "matmul: output");
        if !gpu_computes(w) {
            let xh = self.to_host(x, 0, n_tok * w.cols);
            let mut yh = vec![0.0f32; n_tok * w.rows];
            self.cpu.matmul(w, &xh, n_tok, &mut yh);
            return Backend::upload(self, &yh, out);
        }
        let g = &*self.gpu;
        let mut s = self.lock();
        Self::check((|| {
            let wp = s.weights.device_ptr(&g.stream, w.data)?;
            s.matmul_dev(g, w, wp, x.ptr(), n_tok, out.ptr())
        })());
    }

    fn matmul_many(&self, ws: &[QMat<'_>], x: &DevVec, n_tok: usize, outs: &mut [&mut DevVec]) {
        assert_eq!(ws.len(), outs.len(), "matmul_many: one output per matrix");
        // Batch-invariant steps fuse at every size, so each matrix takes the same kernel (chosen by the launch's
        // rows) whatever the step's tokens.
        let fusable = {
            let s = self.lock();
            n_tok <= MMV_MAX_TOKENS
                || s.batch_invariant
                || (n_tok <= s.mmv_dense_tokens() && ws.iter().all(matmul::mmvt_fits))
        } && (1..=3).contains(&ws.len())
            && ws
                .iter()
                .all(|w| gpu_computes(w) && w.ty == ws[0].ty && w.cols == ws[0].cols);
        if !fusable {
            for (w, o) in ws.iter().zip(outs.iter_mut()) {
                Backend::matmul(self, w, x, n_tok, o);
            }
            return;
        }
        for (w, o) in ws.iter().zip(outs.iter()) {
            assert!(o.capacity() >= n_tok * w.rows, "matmul_many: output");
        }
        assert!(x.capacity() >= n_tok * ws[0].cols, "matmul_many: activations");
        let g = &*self.gpu;
        let mut s = self.lock();
        Self::check((|| {
            let mut mats = Vec::with_capacity(3);
            for (w, o) in ws.iter().zip(outs.iter()) {
                mats.push((w, s.weights.device_ptr(&g.stream, w.data)?, o.ptr()));
            }
            s.mmv(g, &mats, x.ptr(), n_tok)
        })());
    }

    fn rms_norm(&self, x: &mut DevVec, rows: usize, w: &[f32], eps: f32) {
        let p = x.ptr();
        self.norm(p, p, rows, w, eps, x.capacity());
    }

    fn rms_norm_into(&self, x: &DevVec, out: &mut DevVec, rows: usize, w: &[f32], eps: f32) {
        assert!(out.capacity() >= rows * w.len(), "rms_norm_into: output");
        self.norm(x.ptr(), out.ptr(), rows, w, eps, x.capacity());
    }

    fn rope(&self, x: &mut DevVec, n_head: usize, head_dim: usize, positions: &[u32], p: &RopeParams) {
        assert!(x.capacity() >= positions.len() * n_head * head_dim, "rope: shape");
        assert!(p.n_rot <= head_dim && p.n_rot.is_multiple_of(2), "rope: n_rot");
        let g = &*self.gpu;
        let mut s = self.lock();
        let theta_scale = p.theta_scale();
        Self::check((|| {
            let pp = s.positions(g, positions)?;
            let n = positions.len() * n_head * (p.n_rot / 2);
            g.launch(
                "rope",
                grid1(n, 256),
                (256, 1, 1),
                &[
                    Arg::P(x.ptr()),
                    Arg::P(pp),
                    Arg::I(positions.len() as i32),
                    Arg::I(n_head as i32),
                    Arg::I(head_dim as i32),
                    Arg::I(p.n_rot as i32),
                    Arg::F(theta_scale),
                    Arg::F(p.freq_scale),
                    Arg::I((p.kind == RopeKind::Neox) as i32),
                ],
            )
        })());
    }

    fn scale(&self, x: &mut DevVec, len: usize, sc: f32) {
        assert!(x.capacity() >= len, "scale: length");
        Self::check(self.gpu.launch(
            "scale_f32",
            grid1(len, 256),
            (256, 1, 1),
            &[Arg::P(x.ptr()), Arg::F(sc), Arg::L(len as i64)],
        ));
    }

    fn add(&self, x: &mut DevVec, y: &DevVec, len: usize) {
        assert!(x.capacity() >= len && y.capacity() >= len, "add: lengths");
        Self::check(self.gpu.launch(
            "add_f32",
            grid1(len, 256),
            (256, 1, 1),
            &[Arg::P(x.ptr()), Arg::P(y.ptr()), Arg::L(len as i64)],
        ));
    }

    fn store_kv(&self, kv: &mut KvLayer, k: &DevVec, v: &DevVec, positions: &[u32]) {
        self.store_kv_dev(kv, k, v, positions);
    }

    fn attention(&self, q: &DevVec, kv: &KvLayer, positions: &[u32], p: &AttnParams, out: &mut DevVec) {
        self.attention_dev(q, kv, positions, p, out, None);
    }

    fn rope_store_attention(
        &self,
        q: &mut DevVec,
        k: &mut DevVec,
        v: &DevVec,
        kv: &mut KvLayer,
        norms: (Option<&[f32]>, Option<&[f32]>),
        eps: f32,
        positions: &[u32],
        rope: &RopeParams,
        p: &AttnParams,
        out: &mut DevVec,
    ) {
        self.rope_store_attention_dev(q, k, v, kv, norms, eps, positions, rope, p, out);
    }
    /// With `STRATA_BATCH_ATTENTION`, the step's leading one-token runs (decode tokens; the batch scheduler puts
    /// them first) in one attn_decode launch over their sequences' caches ([`CudaBackend::attend_decode_runs`]);
    /// the other runs (all of them without it) one by one.
    fn attend_runs(
        &self,
        q: &mut DevVec,
        k: &mut DevVec,
        v: &DevVec,
        kvs: &mut [&mut crate::state::kv::KvCache],
        layer: usize,
        layout: &crate::state::batch::BatchLayout,
        a: &crate::backend::AttnOp<'_>,
        out: &mut DevVec,
        tmp: &mut crate::backend::RunBufs<DevVec>,
    ) {
        let runs = layout.runs();
        let nd = runs.iter().take_while(|r| r.len == 1).count();
        // Batch-invariant steps store and rotate first, then attend unfused, as their steps alone do.
        let invariant = self.lock().batch_invariant;
        let rest = if self.batch_attention.load(std::sync::atomic::Ordering::Relaxed)
            && self.attend_decode_runs(q, k, v, kvs, layer, &runs[..nd], layout.positions(), a, out, invariant)
        {
            &runs[nd..]
        } else {
            runs
        };
        crate::backend::attend_runs_one_by_one(self, q, k, v, kvs, layer, rest, layout.positions(), a, out, tmp);
    }
    fn glu(&self, gate: &mut DevVec, up: &DevVec, len: usize, act: GluKind) {
        assert!(gate.capacity() >= len && up.capacity() >= len, "glu: lengths");
        Self::check(glu_dev(&self.gpu, gate.ptr(), up.ptr(), len, act));
    }

    fn moe(
        &self,
        ex: &Experts<'_>,
        logits: &mut DevVec,
        x: &DevVec,
        n_tok: usize,
        k: usize,
        normalize: bool,
        out: &mut DevVec,
        scratch: &mut MoeScratch,
    ) {
        self.moe_dev(ex, logits, x, n_tok, k, normalize, out, scratch);
    }

    fn moe_add_rms_norm(
        &self,
        router: &QMat<'_>,
        ex: &Experts<'_>,
        logits: &mut DevVec,
        h: &mut DevVec,
        n_tok: usize,
        k: usize,
        normalize: bool,
        tmp: &mut DevVec,
        x: &mut DevVec,
        norm: Option<&[f32]>,
        eps: f32,
        scratch: &mut MoeScratch,
    ) {
        self.moe_add_rms_norm_dev(router, ex, logits, h, n_tok, k, normalize, tmp, x, norm, eps, scratch);
    }

    fn step_sequences(&self, n: usize) {
        self.lock().step_sequences = n;
    }

    fn step_begin(&self, n_tok: usize, key: StepKey) {
        self.decode_step_begin(n_tok, 1);
        self.gpu.step_begin(key, n_tok == 1);
    }

    fn step_end(&self) {
        self.join_open_prefetch();
        Self::check(self.gpu.step_end());
        self.decode_step_end();
    }

    fn batch_step_begin(&self, n_tok: usize, sequences: usize) {
        self.decode_step_begin(n_tok, sequences);
    }

    fn batch_step_end(&self) {
        self.join_open_prefetch();
        self.decode_step_end();
    }

    fn routed_experts(&self, scratch: &MoeScratch, n_tok: usize, k: usize, out: &mut Vec<u32>) {
        let s = self.lock();
        if s.moe_on_host {
            drop(s);
            out.clear();
            out.extend_from_slice(&scratch.routing.ids[..n_tok * k]);
            return;
        }
        out.clear();
        out.resize(n_tok * k, 0);
        Self::check(s.read_slot(&self.gpu, Slot::MoeIds, out));
    }

    fn kv_on_device(&self) -> bool {
        true
    }

    fn reserve_kv(&self, kv: &crate::state::kv::KvCache, from: usize, to: usize) {
        self.reserve_kv_dev(kv, from, to)
    }

    fn release_slot(&self, slot: SeqSlot) {
        self.gpu.forget_slot(slot);
        self.lock().kv_tables.remove(&slot);
    }

    fn replay_step(&self, key: StepKey, ids: &[u32], positions: &[u32]) -> bool {
        self.replay_ready(key) && self.replay_now(key, ids, positions)
    }

    fn add_rms_norm_into(&self, x: &mut DevVec, y: &DevVec, out: &mut DevVec, rows: usize, w: &[f32], eps: f32) {
        let n = w.len();
        assert!(
            x.capacity() >= rows * n && y.capacity() >= rows * n && out.capacity() >= rows * n,
            "add_rms_norm_into: shapes"
        );
        let g = &*self.gpu;
        let mut s = self.lock();
        Self::check((|| {
            let wp = s.weights.device_ptr(&g.stream, f32_bytes(w))?;
            g.launch(
                "add_rms_norm",
                (rows as u32, 1, 1),
                (norm_threads(n), 1, 1),
                &[
                    Arg::P(x.ptr()),
                    Arg::P(y.ptr()),
                    Arg::P(out.ptr()),
                    Arg::P(wp),
                    Arg::I(n as i32),
                    Arg::F(eps),
                ],
            )
        })());
    }

    fn qk_norm_rope(
        &self,
        q: &mut DevVec,
        k: &mut DevVec,
        n_head: usize,
        n_head_kv: usize,
        head_dim: usize,
        norms: (Option<&[f32]>, Option<&[f32]>),
        eps: f32,
        positions: &[u32],
        p: &RopeParams,
    ) {
        self.qk_norm_rope_dev(q, k, None, n_head, n_head_kv, head_dim, norms, eps, positions, p);
    }

    fn qk_norm_rope_store(
        &self,
        q: &mut DevVec,
        k: &mut DevVec,
        v: &DevVec,
        kv: &mut KvLayer,
        n_head: usize,
        head_dim: usize,
        norms: (Option<&[f32]>, Option<&[f32]>),
        eps: f32,
        positions: &[u32],
        p: &RopeParams,
    ) {
        let n_head_kv = kv.k.heads();
        if kv.k.ty() != GgmlType::F16 || kv.v.ty() != GgmlType::F16 || kv.k.head_dim() != head_dim {
            self.qk_norm_rope(q, k, n_head, n_head_kv, head_dim, norms, eps, positions, p);
            return self.store_kv(kv, k, v, positions);
        }
        self.qk_norm_rope_dev(
            q,
            k,
            Some((v, kv)),
            n_head,
            n_head_kv,
            head_dim,
            norms,
            eps,
            positions,
            p,
        );
    }

    fn set_fault_policy(&self, faults: FaultPlan, gemm_fallback: bool) -> bool {
        let mut s = self.lock();
        s.fault_gemm_above = faults.prefill_gemm_max_rows;
        s.gemm_fallback = gemm_fallback;
        true
    }
}

impl CudaBackend {
    /// RMSNorm of `rows` rows from `xp` into `op` (may be equal).
    fn norm(&self, xp: u64, op: u64, rows: usize, w: &[f32], eps: f32, cap: usize) {
        let n = w.len();
        assert!(cap >= rows * n, "rms_norm: rows of {n}");
        let g = &*self.gpu;
        let mut s = self.lock();
        Self::check((|| {
            let wp = s.weights.device_ptr(&g.stream, f32_bytes(w))?;
            g.launch(
                "rms_norm",
                (rows as u32, 1, 1),
                (norm_threads(n), 1, 1),
                &[Arg::P(xp), Arg::P(op), Arg::P(wp), Arg::I(n as i32), Arg::F(eps)],
            )
        })());
    }
}
