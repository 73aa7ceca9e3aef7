//! The CUDA backend: the [`Backend`] ops as CUDA kernels (kernels/*.cu, compiled by NVRTC at start).
//!
//! Activations live on the device ([`DevVec`], the backend's buffer type): a forward pass uploads token ids
//! and downloads logits, nothing else crosses PCIe. Every weight matrix is copied once, on first use, into a
//! [`store::WeightStore`] (all resident in VRAM here; a MoE layer's stacked expert tensors are one buffer each,
//! an expert being a row range of it), and each KV cache has a device twin keyed by its sequence slot (released with it), which is
//! the cache's only copy of the data (the host `KvCache` keeps the layout). The forward pass stays the one of
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

pub mod runtime;
pub mod select;
pub mod store;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use cudarc::cublas::CudaBlas;
use cudarc::cublas::sys as blas_sys;

use super::cpu::CpuBackend;
use super::{AttnParams, Backend, Experts, GluKind, MoeScratch, QMat, RopeKind, RopeParams, Routing, StepKey};
use crate::quant::{self, GgmlType};
use crate::device::fault::{FaultPlan, OP_PREFILL_GEMM};
use crate::events::{self, EventKind, Fallback, Fault, GemmShape};
use crate::state::kv::{KvLayer, KvRows, KvRowsId, SeqSlot};
use runtime::{Arg, CudaError, Gpu};
use store::{DevBuf, ResidentStore, WeightStore};

/// Most tokens a matmul runs as matrix-vector products; larger batches use the GEMM.
const MMV_MAX_TOKENS: usize = 4;
/// Keys per split of the prefill fallback attention's P·V pass.
const ATTN_SPLIT_KEYS: usize = 128;
/// Most cache cells per split of the decode attention (flash-decoding): a span of more than one
/// [`crate::backend::ATTN_SPAN_BLOCK`] splits its keys over blocks of at most this many cells (fewer while the KV
/// heads times the splits would not give every SM two blocks; see [`decode_splits`]), a shorter one runs in one
/// block per head.
const DECODE_SPLIT_CELLS: usize = 64;
/// Most splits of a decode attention: longer spans give each split more cells.
const DECODE_MAX_SPLITS: usize = 256;

/// (splits, cells per split) of a decode attention over `span_blocks` blocks of [`crate::backend::ATTN_SPAN_BLOCK`]
/// cells: splits of [`DECODE_SPLIT_CELLS`], or more and shorter ones (down to 8 cells) until `n_head_kv` times the
/// splits reach two blocks per SM, at most `max_split`. Depends on the span's block count alone (a replayed graph's
/// launches stay right).
fn decode_splits(span_blocks: usize, n_head_kv: usize, sms: usize, max_split: usize) -> (usize, usize) {
    let cells = span_blocks * crate::backend::ATTN_SPAN_BLOCK;
    let want = cells
        .div_ceil(DECODE_SPLIT_CELLS)
        .max((2 * sms).div_ceil(n_head_kv.max(1)))
        .min(max_split)
        .max(1);
    let len = cells.div_ceil(want).next_multiple_of(8);
    (cells.div_ceil(len), len)
}

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
    runtime::KERNEL_NAMES
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
}
const SLOTS: usize = 19;
/// Counters in [`Slot::Counters`] (one per token of a decode step).
const COUNTERS: usize = 64;
const _: () = assert!(MMV_MAX_TOKENS <= COUNTERS);

/// Logits a block of `top_logits_part` sorts (kernels/sampling.cu `TOP_SORT`): a vocabulary of up to
/// `TOP_SORT * TOP_SORT / TOP_LOGITS` (262,144) tokens is selected on the device.
const TOP_SORT: usize = 4096;

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

/// A KV cache's device twin.
struct DevKv {
    buf: DevBuf,
    ty: GgmlType,
}

struct Inner {
    weights: Box<dyn WeightStore>,
    /// Device twins of KV rows, by sequence slot, layer and K/V (released with the slot).
    kv: HashMap<KvRowsId, DevKv>,
    slots: Vec<Option<DevBuf>>,
    /// The positions last uploaded to [`Slot::Pos`] (a decode step changes one value).
    pos: Vec<u32>,
    blas: Option<CudaBlas>,
    blas_failed: bool,
    /// `prefill_gemm:m>N` of `STRATA_FAULT`: the library GEMM "fails" for batches over N tokens.
    fault_gemm_above: Option<usize>,
    /// `--gemm-fallback`: whether a failed library GEMM falls back to our kernel (else the op fails).
    gemm_fallback: bool,
}

/// The CUDA backend over one device (see the module docs).
pub struct CudaBackend {
    gpu: Arc<Gpu>,
    inner: Mutex<Inner>,
    cpu: CpuBackend,
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

/// `out[i] = Σ_s part[s][i]` over `n_split` partial results of `n` values (split-K attention).
fn sum_splits_dev(gpu: &Gpu, part: u64, out: u64, n_split: usize, n: usize) -> Result<(), CudaError> {
    gpu.launch(
        "sum_splits",
        grid1(n, 256),
        (256, 1, 1),
        &[Arg::P(part), Arg::P(out), Arg::I(n_split as i32), Arg::L(n as i64)],
    )
}

fn glu_code(act: GluKind) -> i32 {
    match act {
        GluKind::SwiGlu => 0,
        GluKind::GeGlu => 1,
    }
}

impl CudaBackend {
    /// [`Backend::attention`], with (`rope`) attn_decode's fused q/k-norm, RoPE and K/V store of one token
    /// ([`Backend::rope_store_attention`]: the caller checked that the step takes attn_decode).
    fn attention_dev(
        &self,
        q: &DevVec,
        kv: &KvLayer,
        positions: &[u32],
        p: &AttnParams,
        out: &mut DevVec,
        rope: Option<DecodeRope>,
    ) {
        let n_tok = positions.len();
        let (dk, dv) = (p.head_dim, p.head_dim_v);
        let rows = n_tok * p.n_head;
        assert!(q.capacity() >= rows * dk, "attention: q");
        assert!(out.capacity() >= rows * dv, "attention: out");
        let first_key = |pos: usize| p.window.map_or(0, |w| (pos + 1).saturating_sub(w));
        let hi = positions.iter().map(|&x| x as usize).max().expect("at least one token");
        let lo = positions
            .iter()
            .map(|&x| first_key(x as usize))
            .min()
            .expect("at least one token");
        let n_keys = hi + 1 - lo;
        let g = &*self.gpu;
        let mut s = self.lock();
        Self::check((|| {
            let (khb, krb) = kv_geometry(kv.k.ty(), p.n_head_kv, dk);
            let (vhb, vrb) = kv_geometry(kv.v.ty(), p.n_head_kv, dv);
            let (kp, kty) = s.kv_twin(g, &kv.k)?;
            let (vp, vty) = s.kv_twin(g, &kv.v)?;
            let code = |t: GgmlType| if t == GgmlType::F16 { 0 } else { 1 };
            let pp = s.positions(g, positions)?;
            let n_ctx = kv.k.bytes() / krb;
            // Decode splits by the span (the step's key holds it in blocks of ATTN_SPAN_BLOCK, so a replayed
            // graph's split count and length stay right: both depend on the block count alone); the split buffers
            // are sized for the whole cache, so a longer span allocates nothing and the graphs of shorter ones stay
            // valid. Both decode kernels stage the query in shared memory: heads up to ATTN_DK_MAX (512) wide.
            let span_blocks = (hi + 1).div_ceil(crate::backend::ATTN_SPAN_BLOCK);
            let max_split = DECODE_MAX_SPLITS;
            let (n_split, split_len) = if span_blocks > 1 {
                decode_splits(span_blocks, p.n_head_kv, g.sms, max_split)
            } else {
                (1, n_ctx)
            };
            // (Heads wider than attn_decode takes also split, into one part if need be: the general path below
            // has position-dependent arguments, which a replayed graph must never have. Heads over 512 wide, which
            // neither decode kernel stages, take that path: correct, but their decode steps keep re-recording.)
            let decode = n_tok <= MMV_MAX_TOKENS && dk <= 512;
            assert!(
                rope.is_none() || (decode && n_split == 1 && dv <= 256),
                "attention: the fused RoPE serves attn_decode alone"
            );
            if decode && (n_split > 1 || dv > 256) {
                // Decode over a long span: split over the keys (four launches, arguments independent of the
                // position within the span block, so CUDA graphs replay them).
                let rows = n_tok * p.n_head;
                let sp = s.slot(g, Slot::Scores, rows * n_ctx * 4)?;
                let mp = s.slot(g, Slot::SplitMax, rows * max_split * 4)?;
                let ps = s.slot(g, Slot::SplitSum, rows * max_split * 8)?;
                let part = s.slot(g, Slot::Part, max_split * rows * dv * 4)?;
                let grid = (p.n_head as u32, n_tok as u32, n_split as u32);
                // Scores and P.V serve a KV head's whole GQA group per block.
                let grid_kv = (p.n_head_kv as u32, n_tok as u32, n_split as u32);
                let window = p.window.unwrap_or(0) as i32;
                g.launch(
                    "attn_split_scores",
                    grid_kv,
                    (256, 1, 1),
                    &[
                        Arg::P(q.ptr()),
                        Arg::P(kp),
                        Arg::P(sp),
                        Arg::P(mp),
                        Arg::P(pp),
                        Arg::I(p.n_head as i32),
                        Arg::I(p.n_head_kv as i32),
                        Arg::I(dk as i32),
                        Arg::F(p.scale),
                        Arg::I(window),
                        Arg::L(krb as i64),
                        Arg::I(khb as i32),
                        Arg::I(code(kty)),
                        Arg::I(n_ctx as i32),
                        Arg::I(split_len as i32),
                    ],
                )?;
                g.launch(
                    "attn_split_exp",
                    grid,
                    (128, 1, 1),
                    &[
                        Arg::P(sp),
                        Arg::P(mp),
                        Arg::P(ps),
                        Arg::P(pp),
                        Arg::I(p.n_head as i32),
                        Arg::I(window),
                        Arg::I(n_ctx as i32),
                        Arg::I(split_len as i32),
                    ],
                )?;
                g.launch(
                    "attn_split_pv",
                    grid_kv,
                    (256, 1, 1),
                    &[
                        Arg::P(sp),
                        Arg::P(ps),
                        Arg::P(vp),
                        Arg::P(part),
                        Arg::P(pp),
                        Arg::I(p.n_head as i32),
                        Arg::I(p.n_head_kv as i32),
                        Arg::I(dv as i32),
                        Arg::I(window),
                        Arg::L(vrb as i64),
                        Arg::I(vhb as i32),
                        Arg::I(code(vty)),
                        Arg::I(n_ctx as i32),
                        Arg::I(split_len as i32),
                        Arg::I(rows as i32),
                    ],
                )?;
                return sum_splits_dev(g, part, out.ptr(), n_split, rows * dv);
            }
            if decode && dv <= 256 {
                // Decode over a short cache: one launch whose arguments do not depend on the position.
                let sp = s.slot(g, Slot::Scores, rows * n_ctx * 4)?;
                let r = rope.unwrap_or_default();
                return g.launch(
                    "attn_decode",
                    (p.n_head as u32, n_tok as u32, 1),
                    (256, 1, 1),
                    &[
                        Arg::P(q.ptr()),
                        Arg::P(kp),
                        Arg::P(vp),
                        Arg::P(sp),
                        Arg::P(out.ptr()),
                        Arg::P(pp),
                        Arg::I(p.n_head as i32),
                        Arg::I(p.n_head_kv as i32),
                        Arg::I(dk as i32),
                        Arg::I(dv as i32),
                        Arg::F(p.scale),
                        Arg::I(p.window.unwrap_or(0) as i32),
                        Arg::L(krb as i64),
                        Arg::I(khb as i32),
                        Arg::I(code(kty)),
                        Arg::L(vrb as i64),
                        Arg::I(vhb as i32),
                        Arg::I(code(vty)),
                        Arg::I(n_ctx as i32),
                        Arg::P(r.kraw),
                        Arg::P(r.vraw),
                        Arg::P(r.qw),
                        Arg::P(r.kw),
                        Arg::F(r.eps),
                        Arg::I(r.n_rot as i32),
                        Arg::F(r.theta_scale),
                        Arg::F(r.freq_scale),
                        Arg::I(r.neox as i32),
                        Arg::P(if rope.is_some() { kp } else { 0 }),
                        Arg::P(if rope.is_some() { vp } else { 0 }),
                    ],
                );
            }
            let group = p.n_head / p.n_head_kv;
            let tensor_cores = kty == GgmlType::F16
                && vty == GgmlType::F16
                && group <= 8
                && [dk, dv].iter().all(|&d| d % 16 == 0 && d <= 128);
            if tensor_cores {
                // A block: one KV head, 16-token groups for every query head of its GQA group (8 warps at most).
                let tgroups = (8 / group).max(1);
                return g.launch(
                    "attn_prefill_f16",
                    (n_tok.div_ceil(16 * tgroups) as u32, p.n_head_kv as u32, 1),
                    ((32 * group * tgroups) as u32, 1, 1),
                    &[
                        Arg::P(q.ptr()),
                        Arg::P(kp),
                        Arg::P(vp),
                        Arg::P(out.ptr()),
                        Arg::P(pp),
                        Arg::I(n_tok as i32),
                        Arg::I(p.n_head as i32),
                        Arg::I(p.n_head_kv as i32),
                        Arg::I(dk as i32),
                        Arg::I(dv as i32),
                        Arg::F(p.scale),
                        Arg::I(p.window.unwrap_or(0) as i32),
                        Arg::L(krb as i64),
                        Arg::I(khb as i32),
                        Arg::L(vrb as i64),
                        Arg::I(vhb as i32),
                        Arg::I(tgroups as i32),
                    ],
                );
            }
            // Other caches (int8) and head widths: scores, softmax, then P.V, through a score matrix.
            let sp = s.slot(g, Slot::Scores, rows * n_keys * 4)?;
            g.launch(
                "attn_scores",
                (rows as u32, n_keys.div_ceil(8) as u32, 1),
                (256, 1, 1),
                &[
                    Arg::P(q.ptr()),
                    Arg::P(kp),
                    Arg::P(sp),
                    Arg::P(pp),
                    Arg::I(p.n_head as i32),
                    Arg::I(p.n_head_kv as i32),
                    Arg::I(dk as i32),
                    Arg::I(lo as i32),
                    Arg::I(n_keys as i32),
                    Arg::F(p.scale),
                    Arg::I(p.window.unwrap_or(0) as i32),
                    Arg::L(krb as i64),
                    Arg::I(khb as i32),
                    Arg::I(code(kty)),
                ],
            )?;
            g.launch(
                "attn_softmax",
                (rows as u32, 1, 1),
                (256, 1, 1),
                &[Arg::P(sp), Arg::I(n_keys as i32), Arg::I((vty == GgmlType::F16) as i32)],
            )?;
            // Split-K over the keys when there are too few (token, head) rows to fill the device.
            let n_split = if rows >= 256 {
                1
            } else {
                n_keys.div_ceil(ATTN_SPLIT_KEYS)
            };
            let split_len = n_keys.div_ceil(n_split);
            let target = if n_split == 1 {
                out.ptr()
            } else {
                s.slot(g, Slot::Part, n_split * rows * dv * 4)?
            };
            let threads = dv.next_multiple_of(32).min(256) as u32;
            g.launch(
                "attn_pv",
                (rows as u32, n_split as u32, 1),
                (threads, 1, 1),
                &[
                    Arg::P(sp),
                    Arg::P(vp),
                    Arg::P(target),
                    Arg::I(rows as i32),
                    Arg::I(p.n_head as i32),
                    Arg::I(p.n_head_kv as i32),
                    Arg::I(dv as i32),
                    Arg::I(lo as i32),
                    Arg::I(n_keys as i32),
                    Arg::I(split_len as i32),
                    Arg::L(vrb as i64),
                    Arg::I(vhb as i32),
                    Arg::I(code(vty)),
                ],
            )?;
            if n_split > 1 {
                sum_splits_dev(g, target, out.ptr(), n_split, rows * dv)?;
            }
            Ok(())
        })());
    }

    /// The `qk_norm_rope` launch, with `store` (values and an f16 cache) also writing the rotated keys and the
    /// values into the cache at `positions` (kernels/elementwise.cu `qk_norm_rope`).
    #[allow(clippy::too_many_arguments)]
    fn qk_norm_rope_dev(
        &self,
        q: &mut DevVec,
        k: &mut DevVec,
        store: Option<(&DevVec, &mut KvLayer)>,
        n_head: usize,
        n_head_kv: usize,
        head_dim: usize,
        norms: (Option<&[f32]>, Option<&[f32]>),
        eps: f32,
        positions: &[u32],
        p: &RopeParams,
    ) {
        let n_tok = positions.len();
        assert!(
            q.capacity() >= n_tok * n_head * head_dim && k.capacity() >= n_tok * n_head_kv * head_dim,
            "qk_norm_rope: shapes"
        );
        assert!(p.n_rot <= head_dim && p.n_rot.is_multiple_of(2), "qk_norm_rope: n_rot");
        for w in [norms.0, norms.1].into_iter().flatten() {
            assert_eq!(w.len(), head_dim, "qk_norm_rope: norm width");
        }
        let g = &*self.gpu;
        let mut s = self.lock();
        let theta_scale = p.theta_scale();
        Self::check((|| {
            let qw = s.norm_weights(g, norms.0)?;
            let kw = s.norm_weights(g, norms.1)?;
            let pp = s.positions(g, positions)?;
            let mut rows = n_tok * (n_head + n_head_kv);
            let (mut kc, mut vp, mut vc, mut dv) = (0, 0, 0, 0);
            if let Some((v, kv)) = store {
                dv = kv.v.head_dim();
                assert!(v.capacity() >= n_tok * n_head_kv * dv, "qk_norm_rope_store: values");
                kc = s.kv_twin(g, &kv.k)?.0;
                vc = s.kv_twin(g, &kv.v)?.0;
                vp = v.ptr();
                rows += n_tok * n_head_kv;
            }
            g.launch(
                "qk_norm_rope",
                (rows.div_ceil(8) as u32, 1, 1),
                (256, 1, 1),
                &[
                    Arg::P(q.ptr()),
                    Arg::P(k.ptr()),
                    Arg::P(qw),
                    Arg::P(kw),
                    Arg::P(pp),
                    Arg::I(n_tok as i32),
                    Arg::I(n_head as i32),
                    Arg::I(n_head_kv as i32),
                    Arg::I(head_dim as i32),
                    Arg::F(eps),
                    Arg::I(p.n_rot as i32),
                    Arg::F(theta_scale),
                    Arg::F(p.freq_scale),
                    Arg::I((p.kind == RopeKind::Neox) as i32),
                    Arg::P(kc),
                    Arg::P(vp),
                    Arg::P(vc),
                    Arg::I(dv as i32),
                ],
            )
        })());
    }

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
        Ok(CudaBackend {
            gpu,
            inner: Mutex::new(Inner {
                weights: Box::new(ResidentStore::default()),
                kv: HashMap::new(),
                slots: (0..SLOTS).map(|_| None).collect(),
                pos: Vec::new(),
                blas_failed: blas.is_none(),
                blas,
                fault_gemm_above: None,
                gemm_fallback: true,
            }),
            cpu: CpuBackend,
        })
    }

    /// The device and how its kernels were obtained.
    pub fn gpu(&self) -> &Gpu {
        &self.gpu
    }

    /// Bytes of weights resident on the device.
    pub fn resident_weight_bytes(&self) -> usize {
        self.lock().weights.resident_bytes()
    }

    /// Waits for every queued kernel (benchmarks and event timings).
    ///
    /// Errors: a kernel failed.
    pub fn synchronize(&self) -> Result<(), CudaError> {
        self.gpu
            .stream
            .synchronize()
            .map_err(CudaError::driver("stream synchronize"))
    }

    /// The bytes of the device twin of one K or V cache (tests and diagnostics); `None` before its first store.
    pub fn kv_device_bytes(&self, rows: &KvRows) -> Option<Vec<u8>> {
        let s = self.lock();
        let d = s.kv.get(&rows.id())?;
        let mut out = vec![0u8; d.buf.bytes];
        d.buf.read(&self.gpu.stream, &mut out).ok()?;
        Some(out)
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

    /// Matrix-vector products of up to three matrices of one type and width over the same `n_tok` activation
    /// rows (one launch): `ys[i][t][r] = ws[i][r] · x[t]`.
    fn mmv(&mut self, gpu: &Gpu, ws: &[(&QMat<'_>, u64, u64)], xp: u64, n_tok: usize) -> Result<(), CudaError> {
        assert!((1..=3).contains(&ws.len()), "mmv: one to three matrices");
        let w0 = ws[0].0;
        let mut p = [(0u64, 0u64, 0i32); 3];
        for (i, (w, wp, yp)) in ws.iter().enumerate() {
            p[i] = (*wp, *yp, w.rows as i32);
        }
        let total: usize = ws.iter().map(|(w, _, _)| w.rows).sum();
        if ws.len() == 1 && w0.ty == GgmlType::F32 && total <= 1024 && w0.cols.is_multiple_of(4) {
            // A router: too few rows to spread a warp per row over the SMs.
            return gpu.launch(
                "mmv_wide_f32",
                (total as u32, n_tok as u32, 1),
                (256, 1, 1),
                &[
                    Arg::P(p[0].0),
                    Arg::P(xp),
                    Arg::P(p[0].1),
                    Arg::I(total as i32),
                    Arg::I(w0.cols as i32),
                ],
            );
        }
        // Four rows per warp only where that still gives every SM of a large GPU two blocks (264 at 132 SMs):
        // smaller matrices take the one-row kernel, whose blocks spread over all of them.
        let (kernel, per_block) = match mmv_rows_per_block(w0.ty) {
            32 if total.div_ceil(32) < 264 => (typed("mmv1_", w0.ty), 8),
            n => (typed("mmv_", w0.ty), n),
        };
        gpu.launch(
            kernel,
            (total.div_ceil(per_block) as u32, n_tok as u32, 1),
            (256, 1, 1),
            &[
                Arg::P(p[0].0),
                Arg::P(p[1].0),
                Arg::P(p[2].0),
                Arg::P(xp),
                Arg::P(p[0].1),
                Arg::P(p[1].1),
                Arg::P(p[2].1),
                Arg::I(p[0].2),
                Arg::I(p[1].2),
                Arg::I(p[2].2),
                Arg::I(w0.cols as i32),
                Arg::L(w0.row_bytes as i64),
            ],
        )
    }

    /// `y[t][r] = W[r] · x[t]` on device buffers: matrix-vector kernels for a few tokens, else the GEMM.
    #[allow(clippy::too_many_arguments)]
    fn matmul_dev(
        &mut self,
        gpu: &Gpu,
        w: &QMat<'_>,
        wp: u64,
        xp: u64,
        n_tok: usize,
        yp: u64,
    ) -> Result<(), CudaError> {
        let (rows, cols) = (w.rows, w.cols);
        if n_tok <= MMV_MAX_TOKENS {
            return self.mmv(gpu, &[(w, wp, yp)], xp, n_tok);
        }
        if !self.blas_failed {
            let fault = match self.fault_gemm_above {
                Some(m) if n_tok > m => Some(format!(
                    "injected failure ({}={OP_PREFILL_GEMM}:m>{m})",
                    crate::device::fault::ENV_FAULT
                )),
                _ => None,
            };
            let r = match fault {
                Some(why) => Err(why),
                None => {
                    let wf = self.slot(gpu, Slot::WF16, rows * cols * 2)?;
                    gpu.launch(
                        typed("dq_f16_", w.ty),
                        grid1(rows * cols / 32, 256),
                        (256, 1, 1),
                        &[
                            Arg::P(wp),
                            Arg::P(wf),
                            Arg::I(rows as i32),
                            Arg::I(cols as i32),
                            Arg::L(w.row_bytes as i64),
                        ],
                    )?;
                    let xf = self.f16_copy(gpu, Slot::XF16, xp, n_tok * cols)?;
                    gpu.timed("cublasGemmEx", || self.gemm_blas(wf, xf, yp, rows, cols, n_tok))
                }
            };
            match r {
                Ok(()) => return Ok(()),
                Err(why) if self.gemm_fallback => {
                    self.blas_failed = true;
                    events::emit(EventKind::Fallback(Fallback {
                        op: OP_PREFILL_GEMM.into(),
                        from: "blas".into(),
                        to: "gemm_tensor_core".into(),
                        why: format!("cublasGemmEx: {why}"),
                        shape: Some(GemmShape { m: n_tok, n: rows, k: cols }),
                        max_rows: None,
                    }));
                }
                Err(why) => {
                    events::emit(EventKind::Fault(Fault {
                        error: format!("{why} (--gemm-fallback off)"),
                        op: Some(OP_PREFILL_GEMM.into()),
                        kernel: Some("cublasGemmEx".into()),
                        shape: Some(GemmShape { m: n_tok, n: rows, k: cols }),
                        ..Fault::default()
                    }));
                    return Err(CudaError::Launch {
                        kernel: "cublasGemmEx".into(),
                        grid: (0, 0, 0),
                        block: (0, 0, 0),
                        call: gpu.launches(),
                        error: why,
                    });
                }
            }
        }
        let tiles: Vec<[i32; 3]> = (0..n_tok)
            .step_by(128)
            .map(|r| [0, r as i32, (n_tok - r).min(128) as i32])
            .collect();
        let xf = self.f16_copy(gpu, Slot::XF16, xp, n_tok * cols)?;
        self.gemm_own(gpu, w, wp, 0, xf, 0, yp, &tiles)
    }

    /// `n` f32 values at `xp` as f16 in slot `s` (the tensor-core GEMMs' activations); returns the slot's address.
    fn f16_copy(&mut self, gpu: &Gpu, s: Slot, xp: u64, n: usize) -> Result<u64, CudaError> {
        let xf = self.slot(gpu, s, n * 2)?;
        gpu.launch(
            "f32_to_f16",
            grid1(n.div_ceil(8), 256),
            (256, 1, 1),
            &[Arg::P(xp), Arg::P(xf), Arg::L(n as i64)],
        )?;
        Ok(xf)
    }

    /// Our tensor-core GEMM (`gemm_T`, kernels/gemm.cu) over row tiles of up to 128: `tiles` lists (expert, first
    /// row, rows); expert e's matrix starts `e * expert_stride` bytes after `wp`. `y[r][n] = W_e[n] · x[r]` with
    /// `x` `[..][k]` in f16 ([`Inner::f16_copy`]) and `y` `[..][n]` in f32.
    #[allow(clippy::too_many_arguments)]
    fn gemm_own(
        &mut self,
        gpu: &Gpu,
        w: &QMat<'_>,
        wp: u64,
        expert_stride: usize,
        xp: u64,
        xrows: u64,
        yp: u64,
        tiles: &[[i32; 3]],
    ) -> Result<(), CudaError> {
        let tp = self.upload(gpu, Slot::Tiles, bytemuck::cast_slice(tiles))?;
        gpu.launch(
            typed("gemm_", w.ty),
            (w.rows.div_ceil(128) as u32, tiles.len() as u32, 1),
            (256, 1, 1),
            &[
                Arg::P(wp),
                Arg::L(expert_stride as i64),
                Arg::L(w.row_bytes as i64),
                Arg::P(xp),
                Arg::P(xrows),
                Arg::P(yp),
                Arg::P(tp),
                Arg::I(w.rows as i32),
                Arg::I(w.cols as i32),
            ],
        )
    }

    /// cuBLAS: out (column-major rows × n_tok) = Wᵀ' (W row-major is column-major cols × rows) · X.
    fn gemm_blas(&self, wf: u64, xf: u64, yp: u64, rows: usize, cols: usize, n_tok: usize) -> Result<(), String> {
        let blas = self.blas.as_ref().ok_or("cuBLAS not loaded")?;
        let (alpha, beta) = (1.0f32, 0.0f32);
        // SAFETY: wf holds rows × cols f16, xf n_tok × cols f16, yp n_tok × rows f32 (sized by the caller).
        unsafe {
            cudarc::cublas::result::gemm_ex(
                *blas.handle(),
                blas_sys::cublasOperation_t::CUBLAS_OP_T,
                blas_sys::cublasOperation_t::CUBLAS_OP_N,
                rows as i32,
                n_tok as i32,
                cols as i32,
                (&alpha as *const f32).cast(),
                wf as *const std::ffi::c_void,
                blas_sys::cudaDataType::CUDA_R_16F,
                cols as i32,
                xf as *const std::ffi::c_void,
                blas_sys::cudaDataType::CUDA_R_16F,
                cols as i32,
                (&beta as *const f32).cast(),
                yp as *mut std::ffi::c_void,
                blas_sys::cudaDataType::CUDA_R_32F,
                rows as i32,
                blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                blas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(|e| format!("{e:?}"))
    }

    /// The device twin of one K or V cache of `width` values per row.
    fn kv_twin(&mut self, gpu: &Gpu, rows: &KvRows) -> Result<(u64, GgmlType), CudaError> {
        let key = rows.id();
        let fresh = self
            .kv
            .get(&key)
            .is_none_or(|d| d.buf.bytes != rows.bytes() || d.ty != rows.ty());
        if fresh {
            self.kv.remove(&key);
            let buf = DevBuf::alloc(&gpu.stream, rows.bytes())?;
            self.kv.insert(key, DevKv { buf, ty: rows.ty() });
        }
        let d = &self.kv[&key];
        Ok((d.buf.ptr, d.ty))
    }

    /// The router's choice on the device (`moe_route`): `ids`/`wts` ([n_tok][k]) into their slots from the
    /// logits at `logits` ([n_tok][n_expert], overwritten by the probabilities).
    fn moe_route(
        &mut self,
        gpu: &Gpu,
        logits: u64,
        n_tok: usize,
        n_expert: usize,
        k: usize,
        normalize: bool,
    ) -> Result<(), CudaError> {
        let ids = self.slot(gpu, Slot::MoeIds, n_tok * k * 4)?;
        let wts = self.slot(gpu, Slot::MoeW, n_tok * k * 4)?;
        gpu.launch(
            "moe_route",
            (n_tok as u32, 1, 1),
            (256, 1, 1),
            &[
                Arg::P(logits),
                Arg::P(ids),
                Arg::P(wts),
                Arg::I(n_expert as i32),
                Arg::I(k as i32),
                Arg::I(normalize as i32),
            ],
        )
    }

    /// Expert dispatch on the device once routed ([`Inner::moe_route`]): `x` `[n_tok][n_embd]`; the weighted sum
    /// goes where `sum` says.
    #[allow(clippy::too_many_arguments)]
    fn moe_dispatch(
        &mut self,
        gpu: &Gpu,
        ex: &Experts<'_>,
        xp: u64,
        n_tok: usize,
        k: usize,
        normalized: bool,
        sum: MoeSum,
    ) -> Result<(), CudaError> {
        let (n_embd, nff) = (ex.gate.cols, ex.n_ff_exp);
        let slots = n_tok * k;
        let gw = self.weights.device_ptr(&gpu.stream, ex.gate.data)?;
        let uw = self.weights.device_ptr(&gpu.stream, ex.up.data)?;
        let dw = self.weights.device_ptr(&gpu.stream, ex.down.data)?;
        let ids = self.slots[Slot::MoeIds as usize].as_ref().expect("routed").ptr;
        let wts = self.slots[Slot::MoeW as usize].as_ref().expect("routed").ptr;
        let gp = self.slot(gpu, Slot::MoeGate, slots * nff * 4)?;
        let up = self.slot(gpu, Slot::MoeUp, slots * nff * 4)?;
        let dp = self.slot(gpu, Slot::MoeDown, slots * n_embd * 4)?;
        let same = ex.gate.ty == ex.up.ty;
        let rows_map = if n_tok <= MMV_MAX_TOKENS {
            // Decode: every slot reaches its expert by id on the device.
            #[allow(clippy::too_many_arguments)]
            let launch = |wa: u64,
                          wb: u64,
                          x: u64,
                          ya: u64,
                          yb: u64,
                          div: usize,
                          w: &QMat<'_>,
                          rows: usize,
                          z: u32,
                          xu: u64,
                          early: bool| {
                gpu.launch(
                    typed("mmv_moe_", w.ty),
                    (
                        rows.div_ceil(mmv_moe_rows_per_block(w.ty, w.cols)) as u32,
                        slots as u32,
                        z,
                    ),
                    (256, 1, 1),
                    &[
                        Arg::P(wa),
                        Arg::P(wb),
                        Arg::P(x),
                        Arg::P(ya),
                        Arg::P(yb),
                        Arg::P(ids),
                        Arg::I(div as i32),
                        Arg::I(rows as i32),
                        Arg::I(w.cols as i32),
                        Arg::L(w.row_bytes as i64),
                        Arg::P(xu),
                        Arg::I(glu_code(ex.act)),
                        Arg::I(early as i32),
                    ],
                )
            };
            if same {
                launch(gw, uw, xp, gp, up, k, &ex.gate, nff, 2, 0, false)?;
            } else {
                launch(gw, gw, xp, gp, gp, k, &ex.gate, nff, 1, 0, false)?;
                launch(uw, uw, xp, up, up, k, &ex.up, nff, 1, 0, false)?;
            }
            // The Q4_K down projection computes the GLU itself while it quantizes its activations (one launch
            // fewer); other types and rows wider than its staging take the GLU kernel first.
            let fused_glu = ex.down.ty == GgmlType::Q4_K && nff <= MMV_X_MAX;
            if !fused_glu {
                glu_dev(gpu, gp, up, slots * nff, ex.act)?;
            }
            launch(
                dw,
                dw,
                gp,
                dp,
                dp,
                1,
                &ex.down,
                n_embd,
                1,
                if fused_glu { up } else { 0 },
                // moe_route or router_route wrote the ids two launches back at least: the down projection's first
                // weight loads need not wait for the gate/up launch (common.cuh, pdl_enter, says why that holds).
                true,
            )?;
            0
        } else {
            // Prefill: read the routing back, group the slots by expert, one GEMM per expert and matrix.
            let mut ids_h = vec![0u32; slots];
            self.read_slot(gpu, Slot::MoeIds, &mut ids_h)?;
            let mut order: Vec<u32> = (0..slots as u32).collect();
            order.sort_by_key(|&s| (ids_h[s as usize], s));
            let mut row_of_slot = vec![0u32; slots];
            for (row, &s) in order.iter().enumerate() {
                row_of_slot[s as usize] = row as u32;
            }
            // Row r of the grouped work reads token tok_of_row[r] of x directly (no gathered copy).
            let tok_of_row: Vec<u32> = order.iter().map(|&s| s / k as u32).collect();
            let ip = self.upload(gpu, Slot::Idx, bytemuck::cast_slice(&tok_of_row))?;
            // One launch per matrix for every expert: tiles of up to 128 grouped rows, each naming its expert.
            let mut tiles: Vec<[i32; 3]> = Vec::new();
            let mut first = 0;
            while first < slots {
                let e = ids_h[order[first] as usize];
                let m = order[first..].iter().take_while(|&&s| ids_h[s as usize] == e).count();
                tiles.extend(
                    (0..m)
                        .step_by(128)
                        .map(|off| [e as i32, (first + off) as i32, (m - off).min(128) as i32]),
                );
                first += m;
            }
            let gate = ex.gate.rows_slice(0, nff);
            let upm = ex.up.rows_slice(0, nff);
            let down = ex.down.rows_slice(0, n_embd);
            let xf = self.f16_copy(gpu, Slot::XF16, xp, n_tok * n_embd)?;
            self.gemm_own(gpu, &gate, gw, nff * gate.row_bytes, xf, ip, gp, &tiles)?;
            self.gemm_own(gpu, &upm, uw, nff * upm.row_bytes, xf, ip, up, &tiles)?;
            glu_dev(gpu, gp, up, slots * nff, ex.act)?;
            let gf = self.f16_copy(gpu, Slot::GF16, gp, slots * nff)?;
            self.gemm_own(gpu, &down, dw, n_embd * down.row_bytes, gf, 0, dp, &tiles)?;
            self.upload(gpu, Slot::MoeRows, bytemuck::cast_slice(&row_of_slot))?
        };
        let Some(outp) = (match sum {
            MoeSum::Out(outp) => Some(outp),
            MoeSum::AddNorm { x, h, w, eps } => {
                assert_eq!(rows_map, 0, "moe: the fused sum serves decode steps");
                gpu.launch(
                    "moe_combine_add_rms_norm",
                    (n_tok as u32, 1, 1),
                    (norm_threads(n_embd), 1, 1),
                    &[
                        Arg::P(dp),
                        Arg::P(wts),
                        Arg::P(x),
                        Arg::P(h),
                        Arg::P(w),
                        Arg::I(k as i32),
                        Arg::I(n_embd as i32),
                        Arg::I(normalized as i32),
                        Arg::F(eps),
                    ],
                )?;
                None
            }
        }) else {
            return Ok(());
        };
        gpu.launch(
            "moe_combine",
            grid1(n_tok * n_embd, 256),
            (256, 1, 1),
            &[
                Arg::P(dp),
                Arg::P(rows_map),
                Arg::P(wts),
                Arg::P(outp),
                Arg::I(n_tok as i32),
                Arg::I(k as i32),
                Arg::I(n_embd as i32),
                Arg::I(normalized as i32),
            ],
        )
    }
}

/// The experts run on the device: types with kernels, and at most 1024 experts (the router kernel's staging); else
/// the CPU backend serves [`Backend::moe`] through host copies.
fn moe_on_device(ex: &Experts<'_>) -> bool {
    ex.n_expert <= 1024 && [ex.gate, ex.up, ex.down].iter().all(gpu_computes)
}

/// attn_decode's fused q/k-norm, RoPE and K/V store ([`Backend::rope_store_attention`]): the raw key and value rows'
/// addresses, the norms' weights on the device (0: none) and the RoPE parameters as `qk_norm_rope` takes them. The
/// default (all 0) is the plain launch.
#[derive(Clone, Copy, Default)]
struct DecodeRope {
    kraw: u64,
    vraw: u64,
    qw: u64,
    kw: u64,
    eps: f32,
    n_rot: usize,
    theta_scale: f32,
    freq_scale: f32,
    neox: bool,
}

/// Where [`Inner::moe_dispatch`] puts the experts' weighted sum (device addresses).
#[derive(Clone, Copy)]
enum MoeSum {
    /// Into `[n_tok][n_embd]` at this address (`moe_combine`).
    Out(u64),
    /// Added to the residual `x`, then `h = rms_norm(x) * w` (`w` 0: the add alone), in one launch at decode
    /// (`moe_combine_add_rms_norm`).
    AddNorm { x: u64, h: u64, w: u64, eps: f32 },
}

/// Bytes of one head of a cache row and of a whole row, for `heads` heads of `head_dim` values of `ty`.
fn kv_geometry(ty: GgmlType, heads: usize, head_dim: usize) -> (usize, usize) {
    let hb = ty
        .row_bytes(head_dim as u64)
        .expect("cache head width checked at construction") as usize;
    (hb, hb * heads)
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
        Self::check(self.gpu.flush_step());
        Self::check(b.read_at(&self.gpu.stream, offset * 4, bytemuck::cast_slice_mut(dst)));
    }

    fn copy(&self, src: &DevVec, src_offset: usize, dst: &mut DevVec, len: usize) {
        assert!(
            src_offset + len <= src.capacity() && len <= dst.capacity(),
            "copy: out of bounds"
        );
        Self::check(self.gpu.launch(
            "copy_f32",
            grid1(len, 256),
            (256, 1, 1),
            &[Arg::P(src.at(src_offset)), Arg::P(dst.ptr()), Arg::L(len as i64)],
        ));
    }

    fn top_logits(&self, logits: &DevVec, n: usize) -> bool {
        use crate::backend::top::TOP_LOGITS;
        let nb = n.div_ceil(TOP_SORT);
        if n == 0 || nb * TOP_LOGITS > TOP_SORT {
            return false;
        }
        assert!(
            n <= logits.capacity(),
            "top_logits: {n} logits in {}",
            logits.capacity()
        );
        let g = &*self.gpu;
        let mut s = self.lock();
        Self::check((|| {
            // Candidates (nb * TOP_LOGITS keys), then the blocks' finite counts.
            let cand = s.slot(g, Slot::TopCand, nb * TOP_LOGITS * 8 + nb * 4)?;
            let nfin = cand + (nb * TOP_LOGITS * 8) as u64;
            let out = s.slot(g, Slot::TopOut, (TOP_LOGITS + 1) * 8)?;
            g.launch(
                "top_logits_part",
                (nb as u32, 1, 1),
                (1024, 1, 1),
                &[
                    Arg::P(logits.ptr()),
                    Arg::I(n as i32),
                    Arg::I(TOP_SORT as i32),
                    Arg::P(cand),
                    Arg::P(nfin),
                ],
            )?;
            g.launch(
                "top_logits_final",
                (1, 1, 1),
                (1024, 1, 1),
                &[
                    Arg::P(cand),
                    Arg::I((nb * TOP_LOGITS) as i32),
                    Arg::P(nfin),
                    Arg::I(nb as i32),
                    Arg::P(out),
                ],
            )
        })());
        true
    }

    fn read_top_logits(&self, n: usize, out: &mut crate::backend::top::TopLogits) -> bool {
        use crate::backend::top::{TOP_LOGITS, TopLogits};
        if n == 0 || n.div_ceil(TOP_SORT) * TOP_LOGITS > TOP_SORT {
            return false;
        }
        Self::check(self.gpu.flush_step());
        let mut keys = [0u64; TOP_LOGITS + 1];
        let s = self.lock();
        let buf = s.slots[Slot::TopOut as usize]
            .as_ref()
            .expect("read_top_logits after top_logits");
        Self::check(buf.read_at(&self.gpu.stream, 0, bytemuck::cast_slice_mut(&mut keys)));
        out.entries.clear();
        out.entries
            .extend(keys[..TOP_LOGITS].iter().filter_map(|&k| TopLogits::from_key(k)));
        out.n_finite = keys[TOP_LOGITS] as usize;
        true
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
        let fusable = n_tok <= MMV_MAX_TOKENS
            && (1..=3).contains(&ws.len())
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
        let n_tok = positions.len();
        let g = &*self.gpu;
        let mut s = self.lock();
        Self::check((|| {
            let pp = s.positions(g, positions)?;
            if kv.k.ty() == GgmlType::F16 && kv.v.ty() == GgmlType::F16 {
                // Keys and values in one launch.
                let (wk, wv) = (kv.k.width(), kv.v.width());
                assert!(
                    k.capacity() >= n_tok * wk && v.capacity() >= n_tok * wv,
                    "store_kv: shapes"
                );
                let (kd, _) = s.kv_twin(g, &kv.k)?;
                let (vd, _) = s.kv_twin(g, &kv.v)?;
                return g.launch(
                    "kv_store2_f16",
                    grid1(n_tok * (wk + wv), 256),
                    (256, 1, 1),
                    &[
                        Arg::P(k.ptr()),
                        Arg::P(kd),
                        Arg::P(v.ptr()),
                        Arg::P(vd),
                        Arg::P(pp),
                        Arg::I(n_tok as i32),
                        Arg::I(wk as i32),
                        Arg::I(wv as i32),
                    ],
                );
            }
            for (rows, data) in [(&kv.k, k), (&kv.v, v)] {
                let width = rows.width();
                assert!(data.capacity() >= n_tok * width, "store_kv: shapes");
                let (_, row_bytes) = kv_geometry(rows.ty(), rows.heads(), rows.head_dim());
                let (dst, ty) = s.kv_twin(g, rows)?;
                let kernel = match ty {
                    GgmlType::F16 => "kv_store_f16",
                    // One warp per 32-value block.
                    _ => "kv_store_q8_0",
                };
                g.launch(
                    kernel,
                    grid1(n_tok * width, 256),
                    (256, 1, 1),
                    &[
                        Arg::P(data.ptr()),
                        Arg::P(dst),
                        Arg::P(pp),
                        Arg::I(n_tok as i32),
                        Arg::I(width as i32),
                        Arg::L(row_bytes as i64),
                    ],
                )?;
            }
            Ok(())
        })());
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
        let (dk, dv) = (p.head_dim, p.head_dim_v);
        // One launch (attn_decode with its q/k-norm, RoPE and K/V store) where a decode step takes attn_decode:
        // one token within the first span block, f16 caches, heads it stages whole in 16-byte rows.
        let fused = positions.len() == 1
            && (positions[0] as usize) < crate::backend::ATTN_SPAN_BLOCK
            && kv.k.ty() == GgmlType::F16
            && kv.v.ty() == GgmlType::F16
            && (kv.k.heads(), kv.k.head_dim(), kv.v.head_dim()) == (p.n_head_kv, dk, dv)
            && dk <= 512
            && dv <= 256
            && dk.is_multiple_of(8)
            && dv.is_multiple_of(8)
            && rope.n_rot <= dk
            && rope.n_rot.is_multiple_of(2);
        if !fused {
            self.qk_norm_rope_store(q, k, v, kv, p.n_head, dk, norms, eps, positions, rope);
            return self.attention(q, kv, positions, p, out);
        }
        assert!(
            k.capacity() >= p.n_head_kv * dk && v.capacity() >= p.n_head_kv * dv,
            "rope_store_attention: k/v"
        );
        for w in [norms.0, norms.1].into_iter().flatten() {
            assert_eq!(w.len(), dk, "rope_store_attention: norm width");
        }
        let rp = {
            let g = &*self.gpu;
            let mut s = self.lock();
            let qw = Self::check(s.norm_weights(g, norms.0));
            let kw = Self::check(s.norm_weights(g, norms.1));
            DecodeRope {
                kraw: k.ptr(),
                vraw: v.ptr(),
                qw,
                kw,
                eps,
                n_rot: rope.n_rot,
                theta_scale: rope.theta_scale(),
                freq_scale: rope.freq_scale,
                neox: rope.kind == RopeKind::Neox,
            }
        };
        self.attention_dev(q, kv, positions, p, out, Some(rp));
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
        let n_embd = ex.gate.cols;
        assert!(
            x.capacity() >= n_tok * n_embd && out.capacity() >= n_tok * n_embd,
            "moe: shapes"
        );
        assert!(logits.capacity() >= n_tok * ex.n_expert, "moe: router logits");
        assert!(k >= 1 && k <= ex.n_expert, "moe: k of n_expert");
        if !moe_on_device(ex) {
            // Experts of a type without kernels, or more experts than the router kernel takes (1024): the CPU
            // backend, through host copies.
            let mut lh = self.to_host(logits, 0, n_tok * ex.n_expert);
            let xh = self.to_host(x, 0, n_tok * n_embd);
            let mut routing = Routing::default();
            self.cpu.route(&mut lh, ex.n_expert, k, normalize, &mut routing);
            let mut oh = vec![0.0f32; n_tok * n_embd];
            self.cpu.moe_ffn(ex, &xh, &routing, &mut oh, scratch);
            return Backend::upload(self, &oh, out);
        }
        let g = &*self.gpu;
        let mut s = self.lock();
        Self::check((|| {
            s.moe_route(g, logits.ptr(), n_tok, ex.n_expert, k, normalize)?;
            s.moe_dispatch(g, ex, x.ptr(), n_tok, k, normalize, MoeSum::Out(out.ptr()))
        })());
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
        let n_embd = ex.gate.cols;
        if n_tok > MMV_MAX_TOKENS || !moe_on_device(ex) {
            return crate::backend::moe_add_rms_norm_steps(
                self, router, ex, logits, h, n_tok, k, normalize, tmp, x, norm, eps, scratch,
            );
        }
        // The router routes in its own launch (router_route) when it is the f32 matrix mmv_wide_f32 serves.
        let routed_by_router = router.ty == GgmlType::F32
            && router.rows == ex.n_expert
            && router.cols == n_embd
            && n_embd.is_multiple_of(4)
            && k <= 64;
        if !routed_by_router {
            self.matmul(router, h, n_tok, logits);
        }
        assert!(
            h.capacity() >= n_tok * n_embd && x.capacity() >= n_tok * n_embd,
            "moe_add_rms_norm: shapes"
        );
        assert!(norm.is_none_or(|w| w.len() == n_embd), "moe_add_rms_norm: norm width");
        assert!(logits.capacity() >= n_tok * ex.n_expert, "moe: router logits");
        assert!(k >= 1 && k <= ex.n_expert, "moe: k of n_expert");
        let g = &*self.gpu;
        let mut s = self.lock();
        Self::check((|| {
            let w = s.norm_weights(g, norm)?;
            if routed_by_router {
                let rw = s.weights.device_ptr(&g.stream, router.data)?;
                let ids = s.slot(g, Slot::MoeIds, n_tok * k * 4)?;
                let wts = s.slot(g, Slot::MoeW, n_tok * k * 4)?;
                let cnt = s.counters(g)?;
                g.launch(
                    "router_route",
                    (ex.n_expert as u32, n_tok as u32, 1),
                    (256, 1, 1),
                    &[
                        Arg::P(rw),
                        Arg::P(h.ptr()),
                        Arg::P(logits.ptr()),
                        Arg::I(ex.n_expert as i32),
                        Arg::I(n_embd as i32),
                        Arg::P(cnt),
                        Arg::P(ids),
                        Arg::P(wts),
                        Arg::I(k as i32),
                        Arg::I(normalize as i32),
                    ],
                )?;
            } else {
                s.moe_route(g, logits.ptr(), n_tok, ex.n_expert, k, normalize)?;
            }
            let sum = MoeSum::AddNorm {
                x: x.ptr(),
                h: h.ptr(),
                w,
                eps,
            };
            s.moe_dispatch(g, ex, h.ptr(), n_tok, k, normalize, sum)
        })());
    }

    fn step_begin(&self, n_tok: usize, key: StepKey) {
        self.gpu.step_begin(key, n_tok == 1);
    }

    fn step_end(&self) {
        Self::check(self.gpu.step_end());
    }

    fn release_slot(&self, slot: SeqSlot) {
        self.gpu.forget_slot(slot);
        self.lock().kv.retain(|id, _| id.slot != slot);
    }

    fn replay_step(&self, key: StepKey, ids: &[u32], positions: &[u32]) -> bool {
        if !self.gpu.can_replay(key) {
            return false;
        }
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

/// The device's two ceilings, measured (METHOD.md: datasheet rates are leads): copy bandwidth and dense f16
/// matrix rate. Benchmarks divide by them to give each figure beside its bound.
impl CudaBackend {
    /// Device-memory bandwidth in GB/s (1e9 bytes): the best of 6 copies of 1 GiB with 16-byte loads and stores
    /// (`copy_f32x4`), counting bytes read plus bytes written, timed by CUDA events.
    ///
    /// Errors: allocation or launch failure.
    pub fn measure_copy_gb_s(&self) -> Result<f64, CudaError> {
        let n = 1usize << 28; // f32 values: 1 GiB
        let g = &*self.gpu;
        let a = DevBuf::alloc(&g.stream, n * 4)?;
        let b = DevBuf::alloc(&g.stream, n * 4)?;
        // Random-looking data, never zeros: fill on the device with a pattern from the host.
        let pattern: Vec<f32> = (0..1u32 << 20)
            .map(|i| (i.wrapping_mul(2654435761) >> 8) as f32)
            .collect();
        let src = DevBuf::upload(&g.stream, f32_bytes(&pattern))?;
        for c in 0..n / pattern.len() {
            g.launch(
                "copy_f32",
                grid1(pattern.len(), 256),
                (256, 1, 1),
                &[
                    Arg::P(src.ptr),
                    Arg::P(a.ptr + (c * pattern.len() * 4) as u64),
                    Arg::L(pattern.len() as i64),
                ],
            )?;
        }
        let mut best = 0f64;
        for _ in 0..6 {
            let ms = self.time_ms(|| {
                g.launch(
                    "copy_f32x4",
                    (132 * 16, 1, 1),
                    (256, 1, 1),
                    &[Arg::P(a.ptr), Arg::P(b.ptr), Arg::L((n / 4) as i64)],
                )
            })?;
            best = best.max(2.0 * (n * 4) as f64 / (ms * 1e-3) / 1e9);
        }
        Ok(best)
    }

    /// Dense f16 matrix rate in TFLOP/s through cuBLAS `GemmEx` (f32 accumulation, the prefill GEMM's mode):
    /// the best of 5 products of 8192 × 8192 × 8192 over random operands; `None` without cuBLAS.
    ///
    /// Errors: allocation or launch failure.
    pub fn measure_gemm_tflops(&self) -> Result<Option<f64>, CudaError> {
        let n = 8192usize;
        let g = &*self.gpu;
        let mut rng = 0x2545_f491_4f6c_dd1du64;
        let host: Vec<u16> = (0..n * n)
            .map(|_| {
                rng ^= rng << 13;
                rng ^= rng >> 7;
                rng ^= rng << 17;
                half::f16::from_f32(((rng >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0).to_bits()
            })
            .collect();
        let a = DevBuf::upload(&g.stream, bytemuck::cast_slice(&host))?;
        let b = DevBuf::upload(&g.stream, bytemuck::cast_slice(&host))?;
        let c = DevBuf::alloc(&g.stream, n * n * 4)?;
        let s = self.lock();
        if s.blas.is_none() {
            return Ok(None);
        }
        let mut best = 0f64;
        for _ in 0..6 {
            let ms = self.time_ms(|| {
                s.gemm_blas(a.ptr, b.ptr, c.ptr, n, n, n)
                    .map_err(|error| CudaError::Launch {
                        kernel: "cublasGemmEx".into(),
                        grid: (0, 0, 0),
                        block: (0, 0, 0),
                        call: 0,
                        error,
                    })
            })?;
            best = best.max(2.0 * (n * n * n) as f64 / (ms * 1e-3) / 1e12);
        }
        Ok(Some(best))
    }

    /// Device milliseconds of the work `f` queues, between two CUDA events.
    fn time_ms(&self, f: impl FnOnce() -> Result<(), CudaError>) -> Result<f64, CudaError> {
        let ev = || {
            self.gpu
                .ctx
                .new_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT))
                .map_err(CudaError::driver("event"))
        };
        let (start, end) = (ev()?, ev()?);
        start
            .record(&self.gpu.stream)
            .map_err(CudaError::driver("event record"))?;
        f()?;
        end.record(&self.gpu.stream)
            .map_err(CudaError::driver("event record"))?;
        Ok(start.elapsed_ms(&end).map_err(CudaError::driver("event elapsed"))? as f64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Splits cover the span in multiples of 8 cells, never exceed the buffers' count, keep at most
    /// DECODE_SPLIT_CELLS per split, and give short spans enough blocks (two per SM over the KV heads).
    #[test]
    fn decode_splits_cover_the_span_and_fill_the_device() {
        for sms in [1, 46, 132] {
            for n_kv in [1, 3, 4, 8, 32] {
                for blocks in 2..200 {
                    let cells = blocks * crate::backend::ATTN_SPAN_BLOCK;
                    let (n, len) = decode_splits(blocks, n_kv, sms, DECODE_MAX_SPLITS);
                    assert!(
                        n * len >= cells && (n - 1) * len < cells,
                        "{blocks} blocks: {n} x {len}"
                    );
                    assert!(len % 8 == 0 && n <= DECODE_MAX_SPLITS, "{blocks} blocks: {n} x {len}");
                    if cells / DECODE_SPLIT_CELLS <= DECODE_MAX_SPLITS {
                        assert!(len <= DECODE_SPLIT_CELLS, "{blocks} blocks: {len} cells per split");
                    }
                    if len > 8 {
                        // At least one block per SM (two asked, rounding to 8 cells may halve it), unless capped.
                        let blocks_out = n * n_kv;
                        assert!(
                            2 * blocks_out + n_kv >= (2 * sms).min(n_kv * DECODE_MAX_SPLITS),
                            "{blocks} blocks, {n_kv} KV heads, {sms} SMs: {n} x {len}"
                        );
                    }
                }
            }
        }
        assert_eq!(decode_splits(9, 4, 132, DECODE_MAX_SPLITS), (48, 24));
        assert_eq!(decode_splits(65, 4, 132, DECODE_MAX_SPLITS), (130, 64));
    }
}
