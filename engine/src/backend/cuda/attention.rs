//! Attention on the device: decode in one launch or split over the keys (flash-decoding), prefill on tensor cores
//! for f16 caches and (`STRATA_INT8_FLASH`) int8 caches dequantized to f16 tiles, the general scores / softmax /
//! P·V path for the rest, and the fused q/k-norm and RoPE launch
//! (with the K/V store, and inside attn_decode at decode).

use super::error::CudaError;
use super::kv::kv_geometry;
use super::launch::Arg;
use super::{CudaBackend, DevVec, Gpu, MMV_MAX_TOKENS, Slot, grid1};
use crate::backend::{AttnParams, Backend, RopeKind, RopeParams};
use crate::quant::GgmlType;
use crate::state::kv::KvLayer;

/// Keys per split of the prefill fallback attention's P·V pass.
const ATTN_SPLIT_KEYS: usize = 128;
/// Most cache cells per split of the decode attention (flash-decoding): a span of more than one
/// [`crate::backend::ATTN_SPAN_BLOCK`] splits its keys over blocks of at most this many cells (fewer while the KV
/// heads times the splits would not give every SM two blocks; see [`decode_splits`]), a shorter one runs in one
/// block per head.
const DECODE_SPLIT_CELLS: usize = 64;
/// Most bytes of scores one batch-invariant attention launch stages (its queries' rows over the whole cache, where a
/// span is too long for shared memory): longer steps take several launches.
pub(super) const BATCH_INVARIANT_SCORES: usize = 256 << 20;
/// Keys attn_decode keeps in shared memory (kernels/attention.cu `ATTN_DEC_KEYS`): a query over no more stages no
/// scores in global memory.
const ATTN_DEC_KEYS: usize = 1024;
/// Widest key head `attn_decode` (and the split kernels' first step) stages in shared memory: kernels/attention.cu
/// `ATTN_DK_MAX`.
pub const DECODE_MAX_DK: usize = 512;
/// Widest value head `attn_decode` stages (its P·V sums, 256 floats of shared memory).
pub const DECODE_MAX_DV: usize = 256;
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

/// (splits, cells per split) of the decode attention of a step of several sequences whose longest span is `cells`
/// cells, over `groups` KV heads x tokens: as few splits as give every SM two blocks (each block's staging and
/// reductions are then spread over many keys), each a multiple of 8 cells, at least [`DECODE_SPLIT_CELLS`] cells
/// long (a short span takes one split). No graph replays such a step, so the count may follow the span.
fn batch_splits(cells: usize, groups: usize, sms: usize) -> (usize, usize) {
    let want = (2 * sms)
        .div_ceil(groups.max(1))
        .min(cells.div_ceil(DECODE_SPLIT_CELLS))
        .clamp(1, DECODE_MAX_SPLITS);
    let len = cells.div_ceil(want).next_multiple_of(8);
    (cells.div_ceil(len), len)
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

/// attn_decode's fused q/k-norm, RoPE and K/V store ([`Backend::rope_store_attention`]): the raw key and value rows'
/// addresses, the norms' weights on the device (0: none) and the RoPE parameters as `qk_norm_rope` takes them. The
/// default (all 0) is the plain launch.
#[derive(Clone, Copy, Default)]
pub(super) struct DecodeRope {
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

impl DecodeRope {
    /// The fused launch's arguments: raw keys and values at `kraw` / `vraw`, the norms' weights at `qw` / `kw`.
    fn fused(kraw: u64, vraw: u64, qw: u64, kw: u64, eps: f32, rope: &RopeParams) -> DecodeRope {
        DecodeRope {
            kraw,
            vraw,
            qw,
            kw,
            eps,
            n_rot: rope.n_rot,
            theta_scale: rope.theta_scale(),
            freq_scale: rope.freq_scale,
            neox: rope.kind == RopeKind::Neox,
        }
    }
}

/// One attn_decode launch's arguments (kernels/attention.cu): the queries, caches, scores and output addresses, the
/// positions (`pos`, one per token row of the grid), the heads' geometry as the kernel takes it, the fused RoPE
/// ([`DecodeRope`]; all 0: none), the caches it stores the token's key and value into (`kc`, `vc`; 0: none) and the
/// per-token page tables of a step of several sequences (`kvtab`; 0: none). The caches are their layer's pool
/// arrays (`k`, `v`) and the sequence's page table (`pages`; kernels/common.cuh `kv_cell`).
struct DecodeLaunch<'a> {
    q: u64,
    k: u64,
    v: u64,
    pages: u64,
    scores: u64,
    out: u64,
    pos: u64,
    p: &'a AttnParams,
    /// (row bytes, head bytes, type code) of the key and value caches.
    kgeo: (usize, usize, i32),
    vgeo: (usize, usize, i32),
    n_ctx: usize,
    rope: DecodeRope,
    kc: u64,
    vc: u64,
    kvtab: u64,
}

/// Launches attn_decode over `n_tok` token rows (grid (heads, n_tok)).
fn launch_attn_decode(g: &Gpu, n_tok: usize, l: &DecodeLaunch<'_>) -> Result<(), CudaError> {
    let (p, r) = (l.p, &l.rope);
    g.launch(
        "attn_decode",
        (p.n_head as u32, n_tok as u32, 1),
        (256, 1, 1),
        &[
            Arg::P(l.q),
            Arg::P(l.k),
            Arg::P(l.v),
            Arg::P(l.pages),
            Arg::P(l.scores),
            Arg::P(l.out),
            Arg::P(l.pos),
            Arg::I(p.n_head as i32),
            Arg::I(p.n_head_kv as i32),
            Arg::I(p.head_dim as i32),
            Arg::I(p.head_dim_v as i32),
            Arg::F(p.scale),
            Arg::I(p.window.unwrap_or(0) as i32),
            Arg::L(l.kgeo.0 as i64),
            Arg::I(l.kgeo.1 as i32),
            Arg::I(l.kgeo.2),
            Arg::L(l.vgeo.0 as i64),
            Arg::I(l.vgeo.1 as i32),
            Arg::I(l.vgeo.2),
            Arg::I(l.n_ctx as i32),
            Arg::P(r.kraw),
            Arg::P(r.vraw),
            Arg::P(r.qw),
            Arg::P(r.kw),
            Arg::F(r.eps),
            Arg::I(r.n_rot as i32),
            Arg::F(r.theta_scale),
            Arg::F(r.freq_scale),
            Arg::I(r.neox as i32),
            Arg::P(l.kc),
            Arg::P(l.vc),
            Arg::P(l.kvtab),
        ],
    )
}

/// The split decode attention's buffers and shape (kernels/attention.cu `attn_split_*`): the scores (`n_tok` x
/// heads x the cache's cells, f32), the splits' maxima (f32) and sums (f64), `n_split` per query head, and the
/// splits' P.V parts (`n_split` x `n_tok` x heads x `dv`, f32), `split_len` cells per split.
struct SplitLaunch {
    scores: u64,
    pmax: u64,
    psum: u64,
    part: u64,
    n_tok: usize,
    n_split: usize,
    split_len: usize,
}

/// Launches the decode attention split over the keys (flash-decoding) for `s.n_tok` token rows: scores and P.V a
/// block per KV head's GQA group (grid (KV heads, tokens, splits)), the exponentials per query head, then the splits'
/// sum into `l.out`. Takes `l`'s queries, caches, positions, geometry and `kvtab` (per-token caches of a step of
/// several sequences; 0: `l.k`, `l.v` and `l.pages` for every token); not its scores or fused RoPE.
fn launch_split_decode(g: &Gpu, l: &DecodeLaunch<'_>, s: &SplitLaunch) -> Result<(), CudaError> {
    let p = l.p;
    let rows = s.n_tok * p.n_head;
    let grid = (p.n_head as u32, s.n_tok as u32, s.n_split as u32);
    // Scores and P.V serve a KV head's whole GQA group per block.
    let grid_kv = (p.n_head_kv as u32, s.n_tok as u32, s.n_split as u32);
    let window = p.window.unwrap_or(0) as i32;
    g.launch(
        "attn_split_scores",
        grid_kv,
        (256, 1, 1),
        &[
            Arg::P(l.q),
            Arg::P(l.k),
            Arg::P(l.pages),
            Arg::P(s.scores),
            Arg::P(s.pmax),
            Arg::P(l.pos),
            Arg::I(p.n_head as i32),
            Arg::I(p.n_head_kv as i32),
            Arg::I(p.head_dim as i32),
            Arg::F(p.scale),
            Arg::I(window),
            Arg::L(l.kgeo.0 as i64),
            Arg::I(l.kgeo.1 as i32),
            Arg::I(l.kgeo.2),
            Arg::I(l.n_ctx as i32),
            Arg::I(s.split_len as i32),
            Arg::P(l.kvtab),
        ],
    )?;
    g.launch(
        "attn_split_exp",
        grid,
        (128, 1, 1),
        &[
            Arg::P(s.scores),
            Arg::P(s.pmax),
            Arg::P(s.psum),
            Arg::P(l.pos),
            Arg::I(p.n_head as i32),
            Arg::I(window),
            Arg::I(l.n_ctx as i32),
            Arg::I(s.split_len as i32),
        ],
    )?;
    g.launch(
        "attn_split_pv",
        grid_kv,
        (256, 1, 1),
        &[
            Arg::P(s.scores),
            Arg::P(s.psum),
            Arg::P(l.v),
            Arg::P(l.pages),
            Arg::P(s.part),
            Arg::P(l.pos),
            Arg::I(p.n_head as i32),
            Arg::I(p.n_head_kv as i32),
            Arg::I(p.head_dim_v as i32),
            Arg::I(window),
            Arg::L(l.vgeo.0 as i64),
            Arg::I(l.vgeo.1 as i32),
            Arg::I(l.vgeo.2),
            Arg::I(l.n_ctx as i32),
            Arg::I(s.split_len as i32),
            Arg::I(rows as i32),
            Arg::P(l.kvtab),
        ],
    )?;
    sum_splits_dev(g, s.part, l.out, s.n_split, rows * p.head_dim_v)
}

/// One qk_norm_rope launch's arguments (kernels/elementwise.cu): the queries and keys (rotated in place), the
/// norms' weights (0: none), the positions, and, with `kc` (0: no store), the f16 caches the keys and the values
/// (`vsrc`, `dv` wide) go to: the pool arrays `kc` and `vc` at the cells the page table `pages` names, or each
/// token's own table's with `kvtab` (a step of several sequences).
struct QkNormRope {
    q: u64,
    k: u64,
    qw: u64,
    kw: u64,
    pos: u64,
    n_tok: usize,
    n_head: usize,
    n_head_kv: usize,
    head_dim: usize,
    eps: f32,
    rope: RopeParams,
    kc: u64,
    vsrc: u64,
    vc: u64,
    dv: usize,
    pages: u64,
    kvtab: u64,
}

/// Launches qk_norm_rope: a warp per query and key head row, and per value head row when it stores.
fn launch_qk_norm_rope(g: &Gpu, l: &QkNormRope) -> Result<(), CudaError> {
    let mut rows = l.n_tok * (l.n_head + l.n_head_kv);
    if l.kc != 0 {
        rows += l.n_tok * l.n_head_kv;
    }
    g.launch(
        "qk_norm_rope",
        (rows.div_ceil(8) as u32, 1, 1),
        (256, 1, 1),
        &[
            Arg::P(l.q),
            Arg::P(l.k),
            Arg::P(l.qw),
            Arg::P(l.kw),
            Arg::P(l.pos),
            Arg::I(l.n_tok as i32),
            Arg::I(l.n_head as i32),
            Arg::I(l.n_head_kv as i32),
            Arg::I(l.head_dim as i32),
            Arg::F(l.eps),
            Arg::I(l.rope.n_rot as i32),
            Arg::F(l.rope.theta_scale()),
            Arg::F(l.rope.freq_scale),
            Arg::I((l.rope.kind == RopeKind::Neox) as i32),
            Arg::P(l.kc),
            Arg::P(l.vsrc),
            Arg::P(l.vc),
            Arg::I(l.dv as i32),
            Arg::P(l.pages),
            Arg::P(l.kvtab),
        ],
    )
}

impl CudaBackend {
    /// [`Backend::attention`], with (`rope`) attn_decode's fused q/k-norm, RoPE and K/V store of one token
    /// ([`Backend::rope_store_attention`]: the caller checked that the step takes attn_decode).
    pub(super) fn attention_dev(
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
            if rope.is_some() {
                // attn_decode stores the token's key and value.
                s.kv_store_cells(g, kv, positions)?;
            }
            let (kd, vd) = (s.kv_dev(g, &kv.k)?, s.kv_dev(g, &kv.v)?);
            let (kp, kty, vp, vty, pg) = (kd.base, kd.ty, vd.base, vd.ty, kd.pages);
            let code = |t: GgmlType| if t == GgmlType::F16 { 0 } else { 1 };
            let pp = s.positions(g, positions)?;
            let n_ctx = kv.k.bytes() / krb;
            // attn_decode's arguments over this cache, unfused (the launches below set their buffers).
            let launch = DecodeLaunch {
                q: q.ptr(),
                k: kp,
                v: vp,
                pages: pg,
                scores: 0,
                out: out.ptr(),
                pos: pp,
                p,
                kgeo: (krb, khb, code(kty)),
                vgeo: (vrb, vhb, code(vty)),
                n_ctx,
                rope: DecodeRope::default(),
                kc: 0,
                vc: 0,
                kvtab: 0,
            };
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
            if s.batch_invariant && rope.is_none() && dk <= DECODE_MAX_DK && dv <= DECODE_MAX_DV {
                // Batch-invariant: every query in its own attn_decode block over its keys in order, whatever the
                // step's other tokens (no split over the keys, whose count follows the span; no tensor cores,
                // whose tiles a decode step does not take), in launches of at most BATCH_INVARIANT_SCORES bytes
                // of scores (none where every span fits shared memory, unless one token: a decode step's
                // arguments stay the same at every position, so its graph replays).
                let per_tok = p.n_head * n_ctx * 4;
                let group = (s.bi_scores / per_tok).clamp(1, n_tok.min(65_535));
                let sp = match n_tok > 1 && n_keys <= ATTN_DEC_KEYS {
                    true => 0,
                    false => s.slot(g, Slot::Scores, group * per_tok)?,
                };
                for t0 in (0..n_tok).step_by(group) {
                    let l = DecodeLaunch {
                        q: q.ptr() + (t0 * p.n_head * dk * 4) as u64,
                        scores: sp,
                        out: out.ptr() + (t0 * p.n_head * dv * 4) as u64,
                        pos: pp + (t0 * 4) as u64,
                        ..launch
                    };
                    launch_attn_decode(g, (n_tok - t0).min(group), &l)?;
                }
                return Ok(());
            }
            // (Heads wider than attn_decode takes also split, into one part if need be: the general path below
            // has position-dependent arguments, which a replayed graph must never have. Heads over 512 wide, which
            // neither decode kernel stages, take that path: correct, but their decode steps keep re-recording.)
            let decode = n_tok <= MMV_MAX_TOKENS && dk <= DECODE_MAX_DK;
            assert!(
                rope.is_none() || (decode && n_split == 1 && dv <= DECODE_MAX_DV),
                "attention: the fused RoPE serves attn_decode alone"
            );
            if decode && (n_split > 1 || dv > DECODE_MAX_DV) {
                // Decode over a long span: split over the keys (four launches, arguments independent of the
                // position within the span block, so CUDA graphs replay them).
                let rows = n_tok * p.n_head;
                let split = SplitLaunch {
                    scores: s.slot(g, Slot::Scores, rows * n_ctx * 4)?,
                    pmax: s.slot(g, Slot::SplitMax, rows * max_split * 4)?,
                    psum: s.slot(g, Slot::SplitSum, rows * max_split * 8)?,
                    part: s.slot(g, Slot::Part, max_split * rows * dv * 4)?,
                    n_tok,
                    n_split,
                    split_len,
                };
                return launch_split_decode(g, &launch, &split);
            }
            if decode && dv <= DECODE_MAX_DV {
                // Decode over a short cache: one launch whose arguments do not depend on the position.
                let sp = s.slot(g, Slot::Scores, rows * n_ctx * 4)?;
                let l = DecodeLaunch {
                    scores: sp,
                    rope: rope.unwrap_or_default(),
                    kc: if rope.is_some() { kp } else { 0 },
                    vc: if rope.is_some() { vp } else { 0 },
                    ..launch
                };
                return launch_attn_decode(g, n_tok, &l);
            }
            let group = p.n_head / p.n_head_kv;
            // An int8 cache takes the tensor cores behind STRATA_INT8_FLASH (its rows dequantized to f16 tiles in
            // blocks of 32).
            let int8_flash = self.int8_flash.load(std::sync::atomic::Ordering::Relaxed);
            let tile_ok = |t: GgmlType, d: usize| {
                d.is_multiple_of(16)
                    && d <= 128
                    && (t == GgmlType::F16 || (int8_flash && t == GgmlType::Q8_0 && d.is_multiple_of(32)))
            };
            let tensor_cores = group <= 8 && tile_ok(kty, dk) && tile_ok(vty, dv);
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
                        Arg::P(pg),
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
                        Arg::I(code(kty)),
                        Arg::I(code(vty)),
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
                    Arg::P(pg),
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
                    Arg::P(pg),
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
    pub(super) fn qk_norm_rope_dev(
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
        Self::check((|| {
            let qw = s.norm_weights(g, norms.0)?;
            let kw = s.norm_weights(g, norms.1)?;
            let pp = s.positions(g, positions)?;
            let (mut kc, mut vp, mut vc, mut dv, mut pages) = (0, 0, 0, 0, 0);
            if let Some((v, kv)) = store {
                dv = kv.v.head_dim();
                assert!(v.capacity() >= n_tok * n_head_kv * dv, "qk_norm_rope_store: values");
                s.kv_store_cells(g, kv, positions)?;
                let (kd, vd) = (s.kv_dev(g, &kv.k)?, s.kv_dev(g, &kv.v)?);
                (kc, vc, pages) = (kd.base, vd.base, kd.pages);
                vp = v.ptr();
            }
            let l = QkNormRope {
                q: q.ptr(),
                k: k.ptr(),
                qw,
                kw,
                pos: pp,
                n_tok,
                n_head,
                n_head_kv,
                head_dim,
                eps,
                rope: *p,
                kc,
                vsrc: vp,
                vc,
                dv,
                pages,
                kvtab: 0,
            };
            launch_qk_norm_rope(g, &l)
        })());
    }

    /// [`Backend::rope_store_attention`] (the trait's method calls this).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn rope_store_attention_dev(
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
        // (Not when batch-invariant: the fused kernel's dot product of the token's own key sums in another order
        // than a prompt's query takes.)
        let fused = positions.len() == 1
            && !self.lock().batch_invariant
            && (positions[0] as usize) < crate::backend::ATTN_SPAN_BLOCK
            && kv.k.ty() == GgmlType::F16
            && kv.v.ty() == GgmlType::F16
            && (kv.k.heads(), kv.k.head_dim(), kv.v.head_dim()) == (p.n_head_kv, dk, dv)
            && dk <= DECODE_MAX_DK
            && dv <= DECODE_MAX_DV
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
            DecodeRope::fused(k.ptr(), v.ptr(), qw, kw, eps, rope)
        };
        self.attention_dev(q, kv, positions, p, out, Some(rp));
    }
}

impl CudaBackend {
    /// The decode tokens of a step of several sequences in one attn_decode launch (continuous batching): `runs`
    /// are one-token runs at rows 0..runs.len() of `q`, `k`, `v` and `out`, each over layer `layer` of its own
    /// sequence's cache `kvs[run.seq]`, with attn_decode's fused q/k-norm, RoPE and K/V store; `invariant`
    /// (batch-invariant steps), with the q/k-norm, RoPE and K/V store of a lone step's qk_norm_rope launch first
    /// (into each token's own caches) and attn_decode unfused, each token's arithmetic that of its step alone.
    /// Returns false (nothing done) where that launch does not apply: a query scale (gemma3), caches that are not
    /// f16, heads it does not stage, or fewer than two runs; the caller then attends run by run.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn attend_decode_runs(
        &self,
        q: &mut DevVec,
        k: &mut DevVec,
        v: &DevVec,
        kvs: &mut [&mut crate::state::kv::KvCache],
        layer: usize,
        runs: &[crate::state::batch::SeqRun],
        positions: &[u32],
        a: &crate::backend::AttnOp<'_>,
        out: &mut DevVec,
        invariant: bool,
    ) -> bool {
        let p = &a.params;
        let (dk, dv, n) = (p.head_dim, p.head_dim_v, runs.len());
        let rope = a.rope;
        let same_geometry = runs.iter().all(|r| {
            let kv = &kvs[r.seq].layers[layer];
            kv.k.ty() == GgmlType::F16
                && kv.v.ty() == GgmlType::F16
                && (kv.k.heads(), kv.k.head_dim(), kv.v.head_dim()) == (p.n_head_kv, dk, dv)
                && kv.k.bytes() == kvs[runs[0].seq].layers[layer].k.bytes()
        });
        let applies = n >= 2
            && a.q_scale.is_none()
            && runs.iter().enumerate().all(|(i, r)| r.len == 1 && r.start == i)
            && same_geometry
            && dk <= DECODE_MAX_DK
            && dv <= DECODE_MAX_DV
            && dk.is_multiple_of(8)
            && dv.is_multiple_of(8)
            && rope.n_rot <= dk
            && rope.n_rot.is_multiple_of(2);
        if !applies {
            return false;
        }
        let rows = n * p.n_head;
        assert!(
            q.capacity() >= rows * dk && out.capacity() >= rows * dv,
            "attend_decode_runs: q/out"
        );
        assert!(
            k.capacity() >= n * p.n_head_kv * dk && v.capacity() >= n * p.n_head_kv * dv,
            "attend_decode_runs: k/v"
        );
        let g = &*self.gpu;
        let mut s = self.lock();
        Self::check((|| {
            let first = &kvs[runs[0].seq].layers[layer];
            let (khb, krb) = kv_geometry(GgmlType::F16, p.n_head_kv, dk);
            let (vhb, vrb) = kv_geometry(GgmlType::F16, p.n_head_kv, dv);
            let n_ctx = first.k.bytes() / krb;
            // Each token's cell in its own sequence's cache; the kernels' table: its page table and its pool's
            // key and value arrays.
            // (Every run's cell first: taking one may grow its pool's arrays, which moves them.)
            for (r, &pos) in runs.iter().zip(positions) {
                s.kv_cells(g, &kvs[r.seq].layers[layer].k, pos as usize, pos as usize + 1)?;
            }
            let mut tab: Vec<u64> = Vec::with_capacity(3 * n);
            for r in runs {
                let kv = &kvs[r.seq].layers[layer];
                let (kd, vd) = (s.kv_dev(g, &kv.k)?, s.kv_dev(g, &kv.v)?);
                tab.extend([kd.pages, kd.base, vd.base]);
            }
            let tp = s.upload(g, Slot::KvTable, bytemuck::cast_slice(&tab))?;
            let pp = s.positions(g, &positions[..n])?;
            let sp = s.slot(g, Slot::Scores, rows * n_ctx * 4)?;
            let qw = s.norm_weights(g, a.norms.0)?;
            let kw = s.norm_weights(g, a.norms.1)?;
            // A long span splits over the keys (each key row read once for its GQA group, the work spread over
            // more blocks than heads x tokens), unless batch-invariant.
            let span = positions[..n].iter().map(|&x| x as usize + 1).max().unwrap_or(0);
            let split = !invariant && span > self.batch_split_cells.load(std::sync::atomic::Ordering::Relaxed);
            // Fused: attn_decode rotates and stores each token itself; batch-invariant and split: qk_norm_rope
            // first.
            let (fused, kc, vc) = match invariant || split {
                false => (DecodeRope::fused(k.ptr(), v.ptr(), qw, kw, a.eps, rope), tab[1], tab[2]),
                true => (DecodeRope::default(), 0, 0),
            };
            let l = DecodeLaunch {
                q: q.ptr(),
                k: tab[1],
                v: tab[2],
                pages: tab[0],
                scores: sp,
                out: out.ptr(),
                pos: pp,
                p,
                kgeo: (krb, khb, 0),
                vgeo: (vrb, vhb, 0),
                n_ctx,
                rope: fused,
                kc,
                vc,
                kvtab: tp,
            };
            if invariant || split {
                let store = QkNormRope {
                    q: q.ptr(),
                    k: k.ptr(),
                    qw,
                    kw,
                    pos: pp,
                    n_tok: n,
                    n_head: p.n_head,
                    n_head_kv: p.n_head_kv,
                    head_dim: dk,
                    eps: a.eps,
                    rope: *rope,
                    kc: tab[1],
                    vsrc: v.ptr(),
                    vc: tab[2],
                    dv,
                    pages: tab[0],
                    kvtab: tp,
                };
                launch_qk_norm_rope(g, &store)?;
            }
            if split {
                let (n_split, split_len) = batch_splits(span, p.n_head_kv * n, g.sms);
                let sl = SplitLaunch {
                    scores: sp,
                    pmax: s.slot(g, Slot::SplitMax, rows * n_split * 4)?,
                    psum: s.slot(g, Slot::SplitSum, rows * n_split * 8)?,
                    part: s.slot(g, Slot::Part, n_split * rows * dv * 4)?,
                    n_tok: n,
                    n_split,
                    split_len,
                };
                return launch_split_decode(g, &l, &sl);
            }
            launch_attn_decode(g, n, &l)
        })());
        true
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
        // A batch: 32 sequences x 4 KV heads fill the SMs' two blocks with 3 splits; 8 sequences with 9.
        assert_eq!(batch_splits(4096, 128, 132), (3, 1368));
        assert_eq!(batch_splits(4096, 32, 132), (9, 456));
        assert_eq!(batch_splits(100, 128, 132), (2, 56));
        assert_eq!(batch_splits(64, 128, 132), (1, 64));
        for cells in [1, 7, 64, 65, 1000, 4096, 40_000] {
            for groups in [1, 8, 128, 4096] {
                let (n, len) = batch_splits(cells, groups, 132);
                assert!(
                    n * len >= cells && (n - 1) * len < cells,
                    "{cells} cells, {groups}: {n} x {len}"
                );
                assert!(len.is_multiple_of(8) && n <= DECODE_MAX_SPLITS);
            }
        }
        assert_eq!(decode_splits(65, 4, 132, DECODE_MAX_SPLITS), (130, 64));
    }
}
