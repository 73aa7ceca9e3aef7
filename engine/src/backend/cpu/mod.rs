//! The CPU backend: the reference semantics of every [`Backend`] op, parallel with rayon.
//!
//! Parallelism: a matmul splits over row blocks × token tiles (one token tile in decode), a tile keeping its block
//! of weight rows in cache while its tokens pass over it. Quantized weights multiply int8 activations (quantized
//! once per matmul, ggml's `vec_dot_type`), each row unpacked once for up to 4 tokens; float weights (F32, F16,
//! BF16, and Q8_K, which multiplies f32 activations) take their own dot product per row and token. Either way a token's result does not depend on the batch
//! (a lone decode step and a step of many sequences give each token the same bits). Attention splits over KV
//! heads × token tiles in prefill, so the query heads of a GQA group share each key and value read, and over
//! query heads in decode; a step of several sequences attends over all of them in one pass. Ops run on rayon's
//! global pool (`--threads` sizes it).
//!
//! Hot paths: no locks and no logging anywhere below; allocation only for per-task scratch (once per rayon work
//! item, never per token or per row) and, in attention, one list of the step's runs per layer.

pub mod kernels;
pub mod spin;

use std::cell::Cell;

use rayon::prelude::*;

use super::{AttnOp, AttnParams, Backend, Experts, GluKind, MoeScratch, QMat, RopeKind, RopeParams, Routing, RunBufs};
use crate::quant::activations::{ActivationFormat, QuantizedActivations};
use crate::quant::{self, GgmlType};
use crate::state::batch::{BatchLayout, SeqRun};
use crate::state::kv::{KV_BLOCK_CELLS, KvCache, KvLayer};

/// Rows dequantized together in a prefill tile.
const PREFILL_ROWS: usize = 16;
/// Tokens per prefill tile: the number of times each dequantized row is reused.
const PREFILL_TOKENS: usize = 64;
/// Tokens a several-token dot product (`QMat::dot_q8_many`, or a packed kernel) takes at once in a matmul tile.
const MANY_TOKENS: usize = 4;
// A prefill tile holds whole groups of packed rows.
const _: () = assert!(PREFILL_ROWS % crate::quant::packed::ROWS == 0);
/// Tokens per attention task in prefill.
const ATTN_TOKENS: usize = 16;

/// Sizes rayon's global pool, which every CPU op runs on, to `threads` workers (at least 1); `None` keeps
/// rayon's default (one per core, or `RAYON_NUM_THREADS`). Call once, before the first op.
///
/// Errors: the pool was already started, or the OS refused the threads.
pub fn init_threads(threads: Option<usize>) -> Result<(), rayon::ThreadPoolBuildError> {
    match threads {
        Some(n) => rayon::ThreadPoolBuilder::new().num_threads(n.max(1)).build_global(),
        None => Ok(()),
    }
}

thread_local! {
    // The calling thread's activation buffer: grown to the largest matrix, then reused (no allocation per token,
    // no lock).
    static ACTIVATIONS: Cell<Option<Box<QuantizedActivations>>> = const { Cell::new(None) };
}

/// Most matrices [`Backend::matmul_many`] fuses into one dispatch.
const MAX_FUSED: usize = 4;
/// How many rows ahead of the one it computes a matmul task asks the cache for ([`prefetch_row`]). A task's rows
/// are a few KB (16 rows of 360 B for SmolLM2-135M at Q4_1), too short a stream for the hardware prefetcher to ramp
/// up on some machines: on this project's 2-core Intel CI-class VM (2026-12-05), decode waited on its weight loads,
/// and asking 2 to 8 rows ahead took tg64 from 74.3 to 114-121 tok/s and 4 sequences from 147 to 226-235
/// (`reports/2026-12-05-cpu-matmul-prefetch.md`).
const MATMUL_PREFETCH_ROWS: usize = 4;

/// The CPU backend (no state: threads come from rayon's global pool).
#[derive(Debug, Default, Clone, Copy)]
pub struct CpuBackend;

/// A pointer shared by parallel tasks that write disjoint elements.
#[derive(Clone, Copy)]
struct SharedOut(*mut f32);
// SAFETY: every task writes a set of indices no other task writes (argued at each use).
unsafe impl Send for SharedOut {}
unsafe impl Sync for SharedOut {}
impl SharedOut {
    #[inline]
    fn ptr(self) -> *mut f32 {
        self.0
    }
}

/// `silu(x) = x / (1 + e^-x)`.
#[inline]
pub fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// GELU, tanh approximation: `0.5 x (1 + tanh(√(2/π) (x + 0.044715 x³)))`.
#[inline]
pub fn gelu_tanh(x: f32) -> f32 {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    0.5 * x * (1.0 + (SQRT_2_OVER_PI * x * (1.0 + 0.044715 * x * x)).tanh())
}

/// GELU as ggml's CPU backend computes it (`GGML_GELU_FP16`, the default): 0 below -10, the identity above 10,
/// and between them [`gelu_tanh`] of the input rounded to f16, itself rounded to f16 (ggml looks the result up
/// in a 65,536-entry f16 table). Matching this rounding keeps gemma3's logits within llama.cpp's.
#[inline]
pub fn gelu_ggml(x: f32) -> f32 {
    if x <= -10.0 {
        0.0
    } else if x >= 10.0 {
        x
    } else {
        round_f16(gelu_tanh(round_f16(x)))
    }
}

impl CpuBackend {
    /// The matmul ([`Self::matmul_fused`] of one matrix). A token's result is its row's one-token dot product
    /// (for a packed matrix, the packed kernel's: [`crate::quant::packed`]), never depending on which other tokens
    /// share the batch: a decode token alone or among others, a prompt in
    /// any chunking, and an expert that receives one token of a batch all give the same bits.
    fn matmul_as(w: &QMat<'_>, x: &[f32], n_tok: usize, out: &mut [f32]) {
        Self::matmul_fused(std::slice::from_ref(w), x, n_tok, &mut [out]);
    }

    /// Up to [`MAX_FUSED`] matrices of one activation format and width that read the same `x` (a layer's q/k/v,
    /// or gate/up): one conversion of `x` (`n_tok` rows) to that format (int8 for quantized weights, ggml's
    /// `vec_dot_type`; an f32 copy for float weights and Q8_K) and one parallel pass over tiles of
    /// [`PREFILL_ROWS`] rows × [`PREFILL_TOKENS`] tokens of all of them (a tile never spans two matrices), so
    /// they cost one fork-join, not three or two; a tile keeps its block of weight rows in cache while its tokens
    /// pass over it. Inside a tile, a matrix with a several-token kernel ([`QMat::dot_q8_many`]) unpacks each row
    /// once for every [`MANY_TOKENS`] tokens; a packed matrix ([`QMat::packed`]) computes every token, one alone
    /// too, with its packed kernel, 8 rows at a time. Each (row, token) result is, bit for bit, that row's
    /// one-token result with that token's activations, whatever the batch.
    fn matmul_fused(ws: &[QMat<'_>], x: &[f32], n_tok: usize, outs: &mut [&mut [f32]]) {
        assert!(ws.len() <= MAX_FUSED && ws.len() == outs.len(), "matmul_many: matrices");
        let mut ptrs = [SharedOut(std::ptr::null_mut()); MAX_FUSED];
        let mut first_block = [0usize; MAX_FUSED + 1];
        for (i, (w, o)) in ws.iter().zip(outs.iter_mut()).enumerate() {
            assert_eq!(x.len(), n_tok * w.cols, "matmul: activations");
            assert_eq!(o.len(), n_tok * w.rows, "matmul: output {i}");
            assert!(
                w.act == ws[0].act && w.cols == ws[0].cols,
                "matmul_many: matrix {i}'s format or width"
            );
            ptrs[i] = SharedOut(o.as_mut_ptr());
            first_block[i + 1] = first_block[i] + w.rows.div_ceil(PREFILL_ROWS);
        }
        let tok_tiles = n_tok.div_ceil(PREFILL_TOKENS);
        let tasks = first_block[ws.len()] * tok_tiles;
        // Taken out of this thread's slot for the parallel pass, not borrowed across it: a rayon worker that waits
        // for its tasks may meanwhile run another caller's forward pass (work stealing), whose matmuls then find
        // the slot empty and use a buffer of their own. Boxed, not on this stack: the other threads read it while
        // this thread, a worker computing tasks too, writes its own stack frames, and sharing their cache lines
        // made every multi-token step slower (pp512 288 against 343 tok/s on the 2-core Intel VM).
        let mut qa = ACTIVATIONS.take().unwrap_or_default();
        qa.quantize(ws[0].ty, x, ws[0].cols)
            .expect("matrix checked at construction");
        {
            let qa = &qa;
            (0..tasks).into_par_iter().for_each(|task| {
                if n_tok > 1 {
                    super::progress::tick();
                }
                let (block, tt) = (task / tok_tiles, task % tok_tiles);
                let i = (0..ws.len())
                    .rfind(|&i| first_block[i] <= block)
                    .expect("block 0 is matrix 0's");
                let (w, out, rows) = (&ws[i], ptrs[i], ws[i].rows);
                let r0 = (block - first_block[i]) * PREFILL_ROWS;
                let r1 = (r0 + PREFILL_ROWS).min(rows);
                let t0 = tt * PREFILL_TOKENS;
                let t1 = (t0 + PREFILL_TOKENS).min(n_tok);
                if let Some(p) = w.packed {
                    // Rows packed eight at a time: every token of the matrix, one alone too, goes through the
                    // packed kernel (the same bits in any batch). Tiles start at multiples of PREFILL_ROWS, a
                    // multiple of 8, and a packed matrix has whole groups of 8 rows.
                    let mut ys = [[0f32; crate::quant::packed::ROWS]; MANY_TOKENS];
                    for g0 in (t0..t1).step_by(MANY_TOKENS) {
                        let g1 = (g0 + MANY_TOKENS).min(t1);
                        let vs: [_; MANY_TOKENS] = std::array::from_fn(|k| qa.vector((g0 + k).min(g1 - 1)));
                        let (vs, ys) = (&vs[..g1 - g0], &mut ys[..g1 - g0]);
                        for grp in r0 / crate::quant::packed::ROWS..r1 / crate::quant::packed::ROWS {
                            (p.kernel)(p.group(grp), vs, ys);
                            for (k, y) in ys.iter().enumerate() {
                                for (i, v) in y.iter().enumerate() {
                                    // SAFETY: element (g0 + k, 8 grp + i) of matrix i belongs to this task's row
                                    // block and token tile only, and is inside its output (g0 + k < n_tok,
                                    // 8 grp + i < r1 <= rows).
                                    unsafe {
                                        *out.ptr().add((g0 + k) * rows + grp * crate::quant::packed::ROWS + i) = *v
                                    };
                                }
                            }
                        }
                    }
                    return;
                }
                let Some(many) = w.dot_q8_many.filter(|_| t1 - t0 > 1) else {
                    for t in t0..t1 {
                        let v = qa.vector(t);
                        for r in r0..r1 {
                            // The rows' first pass asks for them; later tokens find them in the cache.
                            if t == t0 && r + MATMUL_PREFETCH_ROWS < rows {
                                prefetch_row(w, r + MATMUL_PREFETCH_ROWS);
                            }
                            // SAFETY: element (t, r) of matrix i belongs to this task's row block and token tile
                            // only, and is inside its output (t < n_tok, r < rows).
                            unsafe { *out.ptr().add(t * rows + r) = (w.dot_q8)(w.row(r), &v) };
                        }
                    }
                    return;
                };
                // Each row unpacked once for every MANY_TOKENS tokens (bit for bit the one-token results).
                let mut ys = [0f32; MANY_TOKENS];
                for g0 in (t0..t1).step_by(MANY_TOKENS) {
                    let g1 = (g0 + MANY_TOKENS).min(t1);
                    let vs: [_; MANY_TOKENS] = std::array::from_fn(|k| qa.vector((g0 + k).min(g1 - 1)));
                    let (vs, ys) = (&vs[..g1 - g0], &mut ys[..g1 - g0]);
                    for r in r0..r1 {
                        if g0 == t0 && r + MATMUL_PREFETCH_ROWS < rows {
                            prefetch_row(w, r + MATMUL_PREFETCH_ROWS);
                        }
                        many(w.row(r), vs, ys);
                        for (k, y) in ys.iter().enumerate() {
                            // SAFETY: element (g0 + k, r) of matrix i belongs to this task's row block and token
                            // tile only, and is inside its output (g0 + k < t1 <= n_tok, r < rows).
                            unsafe { *out.ptr().add((g0 + k) * rows + r) = *y };
                        }
                    }
                }
            });
        }
        ACTIVATIONS.set(Some(qa));
    }
}

/// RMSNorm of one row (ggml's `rms_norm`: the mean of squares summed in f64) times `w`.
#[inline]
fn rms_norm_row(x: &mut [f32], w: &[f32], eps: f32) {
    let ss: f64 = x.iter().map(|&v| (v as f64) * (v as f64)).sum();
    let scale = 1.0 / ((ss / x.len() as f64) as f32 + eps).sqrt();
    for (v, g) in x.iter_mut().zip(w) {
        *v = *v * scale * g;
    }
}

/// Rotates one token's heads (ggml's `rope_f32` with `ext_factor = 0`: θ_i = p · scale · base^(-2i/n_rot),
/// computed by repeated multiplication as ggml's rope cache does).
fn rope_token(x: &mut [f32], n_head: usize, head_dim: usize, pos: u32, p: &RopeParams) {
    let half = p.n_rot / 2;
    let theta_scale = p.theta_scale();
    let mut theta = pos as f32;
    // n_rot ≤ head_dim; heads wider than 1024 are rejected at load.
    let mut cs = [(0f32, 0f32); 512];
    for c in cs.iter_mut().take(half) {
        let t = p.freq_scale * theta;
        *c = (t.cos(), t.sin());
        theta *= theta_scale;
    }
    for h in 0..n_head {
        let v = &mut x[h * head_dim..(h + 1) * head_dim];
        for (i, &(cos, sin)) in cs.iter().take(half).enumerate() {
            let (a, b) = match p.kind {
                RopeKind::Normal => (2 * i, 2 * i + 1),
                RopeKind::Neox => (i, i + half),
            };
            let (x0, x1) = (v[a], v[b]);
            v[a] = x0 * cos - x1 * sin;
            v[b] = x0 * sin + x1 * cos;
        }
    }
}

/// Softmax of one row in place (ggml's `soft_max`: exponentials in f32, their sum in f64, then one multiply by
/// the f32 reciprocal). `-inf` entries become 0.
#[inline]
fn softmax_row(row: &mut [f32]) {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0f64;
    for x in row.iter_mut() {
        *x = (*x - max).exp();
        sum += *x as f64;
    }
    let inv = (1.0 / sum) as f32;
    row.iter_mut().for_each(|x| *x *= inv);
}

/// `x` rounded to the nearest f16 (round to nearest even), back in f32.
#[inline]
fn round_f16(x: f32) -> f32 {
    half::f16::from_f32(x).to_f32()
}

/// Per-task buffers of the attention.
struct AttnScratch {
    scores: Vec<f32>,
    /// The current query rounded to f16 (a decode task's query heads, `[hpt][head_dim]`, over an f16 cache).
    q: Vec<f32>,
    /// The task's keys in f32, `[n_keys][head_dim]`.
    k: Vec<f32>,
    acc: Vec<f32>,
    /// The value rows of one KV block in f32.
    v: Vec<f32>,
    /// One key's scores for the task's heads (decode over an f16 cache).
    d: Vec<f32>,
}

/// The ops on host slices, lengths taken from the slices: what the [`Backend`] impl below runs on the used
/// prefix of each buffer, and what op-level tests call directly.
impl CpuBackend {
    /// [`Backend::matmul`] on slices: `x` is `[n_tok][w.cols]`, `out` `[n_tok][w.rows]`.
    pub fn matmul(&self, w: &QMat<'_>, x: &[f32], n_tok: usize, out: &mut [f32]) {
        Self::matmul_as(w, x, n_tok, out);
    }

    /// [`Backend::matmul_many`] on slices.
    pub fn matmul_many(&self, ws: &[QMat<'_>], x: &[f32], n_tok: usize, outs: &mut [&mut [f32]]) {
        assert_eq!(ws.len(), outs.len(), "matmul_many: one output per matrix");
        let fusable =
            (1..=MAX_FUSED).contains(&ws.len()) && ws.iter().all(|w| w.act == ws[0].act && w.cols == ws[0].cols);
        if fusable {
            Self::matmul_fused(ws, x, n_tok, outs);
        } else {
            for (w, o) in ws.iter().zip(outs.iter_mut()) {
                self.matmul(w, x, n_tok, o);
            }
        }
    }

    /// [`Backend::rms_norm`] on a slice of whole rows of `w.len()`.
    pub fn rms_norm(&self, x: &mut [f32], w: &[f32], eps: f32) {
        let n = w.len();
        assert_eq!(x.len() % n, 0, "rms_norm: rows of {n}");
        if x.len() / n >= 64 {
            x.par_chunks_mut(n).for_each(|r| rms_norm_row(r, w, eps));
        } else {
            x.chunks_mut(n).for_each(|r| rms_norm_row(r, w, eps));
        }
    }

    /// [`Backend::rope`] on a slice.
    pub fn rope(&self, x: &mut [f32], n_head: usize, head_dim: usize, positions: &[u32], p: &RopeParams) {
        let width = n_head * head_dim;
        assert_eq!(x.len(), positions.len() * width, "rope: shape");
        assert!(
            p.n_rot <= head_dim && p.n_rot.is_multiple_of(2) && p.n_rot <= 1024,
            "rope: n_rot"
        );
        x.par_chunks_mut(width)
            .zip(positions.par_iter())
            .with_min_len(8)
            .for_each(|(t, &pos)| rope_token(t, n_head, head_dim, pos, p));
    }

    /// [`Backend::scale`] on a slice.
    pub fn scale(&self, x: &mut [f32], s: f32) {
        x.iter_mut().for_each(|v| *v *= s);
    }

    /// [`Backend::add`] on slices of one length.
    pub fn add(&self, x: &mut [f32], y: &[f32]) {
        assert_eq!(x.len(), y.len(), "add: lengths");
        x.iter_mut().zip(y).for_each(|(a, b)| *a += b);
    }

    /// [`Backend::store_kv`] on slices of `positions.len()` rows.
    pub fn store_kv(&self, kv: &mut KvLayer, k: &[f32], v: &[f32], positions: &[u32]) {
        let n = positions.len();
        assert!(
            n > 0 && k.len().is_multiple_of(n) && v.len().is_multiple_of(n),
            "store_kv: shapes"
        );
        let (wk, wv) = (k.len() / n, v.len() / n);
        for (t, &p) in positions.iter().enumerate() {
            kv.k.write(p as usize, &k[t * wk..(t + 1) * wk]);
            kv.v.write(p as usize, &v[t * wv..(t + 1) * wv]);
        }
    }

    /// [`Backend::attention`] on slices.
    pub fn attention(&self, q: &[f32], kv: &KvLayer, positions: &[u32], p: &AttnParams, out: &mut [f32]) {
        let run = SeqRun {
            seq: 0,
            start: 0,
            len: positions.len(),
            pos0: positions.first().map_or(0, |&x| x as usize),
        };
        self.attention_runs(q, &[kv], &[run], positions, p, out);
    }

    /// [`Backend::attention`] for every run of a step at once: run `r`'s tokens (`q` rows `run.tokens()`, at
    /// `positions[run.tokens()]`) attend over `kvs[r]` into the same rows of `out`, in one parallel pass over
    /// every run's tasks (one fork-join a layer for a batch, not one a sequence). A token's arithmetic is that
    /// of its run attended alone: its scores cover its own keys only, whatever else shares the task.
    pub fn attention_runs(
        &self,
        q: &[f32],
        kvs: &[&KvLayer],
        runs: &[SeqRun],
        positions: &[u32],
        p: &AttnParams,
        out: &mut [f32],
    ) {
        let n_tok = positions.len();
        let (dk, dv) = (p.head_dim, p.head_dim_v);
        assert_eq!(q.len(), n_tok * p.n_head * dk, "attention: q");
        assert_eq!(out.len(), n_tok * p.n_head * dv, "attention: out");
        assert_eq!(kvs.len(), runs.len(), "attention: one cache per run");
        for kv in kvs {
            assert_eq!(kv.k.head_dim(), dk, "attention: cache key width");
            assert_eq!(kv.v.head_dim(), dv, "attention: cache value width");
            assert_eq!(kv.k.heads(), p.n_head_kv, "attention: cache KV heads");
        }
        let group = p.n_head / p.n_head_kv;
        // Per run: tokens per task (1 in decode), query heads per task, and where its tasks start among the
        // step's. A task takes a whole GQA group in prefill, and in decode when the step's decode tokens times
        // the KV heads give every thread two tasks or more (several sequences), so each key and value converted
        // serves all of the group's heads; otherwise one head a task, so a lone sequence's few KV heads still
        // spread over every thread. Bit for bit the same either way: a query's scores and sums do not depend on
        // which other heads share its task.
        let decode_runs = runs.iter().filter(|r| r.len == 1).count();
        let decode_group = decode_runs * p.n_head_kv >= 2 * rayon::current_num_threads();
        let shape = |r: &SeqRun| match (r.len, decode_group) {
            (1, false) => (1, 1),
            (1, true) => (1, group),
            _ => (ATTN_TOKENS, group),
        };
        let mut first_task = Vec::with_capacity(runs.len() + 1);
        first_task.push(0);
        // Runs in order and disjoint (as `BatchLayout` makes them): each step row belongs to one run, so the tasks
        // below write disjoint rows of `out`.
        let mut next_row = 0;
        for r in runs {
            assert!(
                r.start >= next_row && r.start + r.len <= n_tok,
                "attention: runs overlap or pass the step"
            );
            next_row = r.start + r.len;
            let (tile, hpt) = shape(r);
            first_task.push(first_task.last().unwrap() + r.len.div_ceil(tile) * p.n_head_kv * (group / hpt));
        }
        let shared = SharedOut(out.as_mut_ptr());
        let first_key = |pos: usize| p.window.map_or(0, |w| (pos + 1).saturating_sub(w));
        (0..*first_task.last().unwrap()).into_par_iter().for_each_init(
            || AttnScratch {
                scores: Vec::new(),
                q: Vec::with_capacity(dk),
                k: Vec::new(),
                acc: Vec::new(),
                v: vec![0.0; KV_BLOCK_CELLS * dv],
                d: Vec::new(),
            },
            |s, task| {
                super::progress::tick();
                let ri = first_task.partition_point(|&f| f <= task) - 1;
                let (run, kv) = (&runs[ri], kvs[ri]);
                let (tile, hpt) = shape(run);
                let subs = group / hpt;
                // An f16 cache rounds what meets it to f16 as well, as ggml's f16 matmuls do (the other operand is
                // converted to the weight's `vec_dot_type`): the queries before q·k, the probabilities before ·v.
                let f16_keys = kv.k.ty() == GgmlType::F16;
                let f16_values = kv.v.ty() == GgmlType::F16;
                let task = task - first_task[ri];
                let (ti, rest) = (task / (p.n_head_kv * subs), task % (p.n_head_kv * subs));
                let (g, sub) = (rest / subs, rest % subs);
                let h0 = g * group + sub * hpt;
                // Step rows t0..t1, all of this run.
                let t0 = run.start + ti * tile;
                let t1 = (t0 + tile).min(run.start + run.len);
                let toks = &positions[t0..t1];
                let hi = toks.iter().map(|&x| x as usize).max().expect("non-empty tile");
                let lo = toks
                    .iter()
                    .map(|&x| first_key(x as usize))
                    .min()
                    .expect("non-empty tile");
                let n_keys = hi + 1 - lo;
                let n_q = toks.len() * hpt;
                // The task's keys converted to f32 once, then read by each of its queries (in prefill a tile's
                // tokens times a GQA group). Decode takes the same path, so a token's scores are the same bits
                // whether it was decoded or prefilled: the f16 rounding of the probabilities below would
                // otherwise turn one-ulp differences of summation order into visible ones.
                // A decode token over an f16 cache reads each key where it lies, converting as it goes
                // (`dot_f16`: the same bits as converting first), since the task's few queries read each key
                // once or a GQA group's times.
                let direct_keys = tile == 1 && f16_keys;
                if direct_keys {
                    s.k.resize(dk, 0.0);
                } else {
                    s.k.resize(n_keys * dk, 0.0);
                    kv.k.read_cells(lo, hi + 1, g, &mut s.k[..n_keys * dk]);
                }
                s.scores.clear();
                s.scores.resize(n_q * n_keys, f32::NEG_INFINITY);
                s.acc.clear();
                s.acc.resize(n_q * dv, 0.0);
                // Scores: query (t, hh) against every key it may see. A decode token over an f16 cache takes each
                // key once for the task's heads (`dots_f16`: each head's bits of `dot_f16`).
                if direct_keys {
                    let pos = toks[0] as usize;
                    let first = first_key(pos);
                    s.q.clear();
                    s.q.extend(q[(t0 * p.n_head + h0) * dk..][..hpt * dk].iter().map(|&x| round_f16(x)));
                    s.d.resize(hpt, 0.0);
                    for j in first..=pos {
                        match kv.k.cell_f16(j, g) {
                            Some(k16) => kernels::dots_f16(k16, &s.q, &mut s.d),
                            None => {
                                kv.k.read_cells(j, j + 1, g, &mut s.k[..dk]);
                                for (hh, d) in s.d.iter_mut().enumerate() {
                                    *d = kernels::dot(&s.k[..dk], &s.q[hh * dk..][..dk]);
                                }
                            }
                        }
                        for (hh, &d) in s.d.iter().enumerate() {
                            s.scores[hh * n_keys + j - lo] = p.scale * d;
                        }
                    }
                    for row in s.scores.chunks_mut(n_keys) {
                        softmax_row(row);
                        if f16_values {
                            row.iter_mut().for_each(|x| *x = round_f16(*x));
                        }
                    }
                } else {
                    for (ti, &pos) in toks.iter().enumerate() {
                        let pos = pos as usize;
                        let first = first_key(pos);
                        for hh in 0..hpt {
                            let mut qv = &q[((t0 + ti) * p.n_head + h0 + hh) * dk..][..dk];
                            if f16_keys {
                                s.q.clear();
                                s.q.extend(qv.iter().map(|&x| round_f16(x)));
                                qv = &s.q;
                            }
                            let row = &mut s.scores[(ti * hpt + hh) * n_keys..][..n_keys];
                            for j in first..=pos {
                                row[j - lo] = p.scale * kernels::dot(&s.k[(j - lo) * dk..][..dk], qv);
                            }
                            softmax_row(row);
                            if f16_values {
                                row.iter_mut().for_each(|x| *x = round_f16(*x));
                            }
                        }
                    }
                }
                // Values: each cached value row is read once per task and added into every query that sees it.
                // A decode token over an f16 cache reads each where it lies (the same bits as converting first);
                // otherwise a KV block at a time (converting them all first, as the keys are, costs a pass over
                // memory in decode, where each is read once).
                let rows: Option<Vec<&[half::f16]>> = match tile == 1 && f16_values {
                    true => (lo..=hi).map(|j| kv.v.cell_f16(j, g)).collect(),
                    false => None,
                };
                if let Some(rows) = rows {
                    // Each head's weighted sum of the values where they lie, its sums in registers across them
                    // (`axpy_rows_f16`: the bits of `axpy_f16` one value after another), 128 values at a time (16
                    // KiB at 64 f16 a head) so the task's heads read them from cache at any depth.
                    for c in (0..n_keys).step_by(128) {
                        let e = (c + 128).min(n_keys);
                        for qi in 0..n_q {
                            let w = &s.scores[qi * n_keys + c..qi * n_keys + e];
                            kernels::axpy_rows_f16(w, &rows[c..e], &mut s.acc[qi * dv..(qi + 1) * dv]);
                        }
                    }
                } else {
                    let mut j0 = lo;
                    while j0 <= hi {
                        let end = ((j0 / KV_BLOCK_CELLS + 1) * KV_BLOCK_CELLS).min(hi + 1);
                        let vs = &mut s.v[..(end - j0) * dv];
                        kv.v.read_cells(j0, end, g, vs);
                        for (j, v) in (j0..end).zip(vs.chunks_exact(dv)) {
                            for qi in 0..n_q {
                                let w = s.scores[qi * n_keys + j - lo];
                                if w != 0.0 {
                                    kernels::axpy(w, v, &mut s.acc[qi * dv..(qi + 1) * dv]);
                                }
                            }
                        }
                        j0 = end;
                    }
                }
                for ti in 0..toks.len() {
                    for hh in 0..hpt {
                        let src = &s.acc[(ti * hpt + hh) * dv..][..dv];
                        let dst = ((t0 + ti) * p.n_head + h0 + hh) * dv;
                        // SAFETY: head h0 + hh of step row t0 + ti belongs to this task alone (its run, token
                        // tile and head range), and lies inside `out`.
                        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), shared.ptr().add(dst), dv) };
                    }
                }
            },
        );
    }

    /// [`Backend::glu`] on slices of one length.
    pub fn glu(&self, gate: &mut [f32], up: &[f32], act: GluKind) {
        assert_eq!(gate.len(), up.len(), "glu: lengths");
        let f = match act {
            GluKind::SwiGlu => silu,
            GluKind::GeGlu => gelu_ggml,
        };
        gate.par_chunks_mut(4096)
            .zip(up.par_chunks(4096))
            .for_each(|(g, u)| g.iter_mut().zip(u).for_each(|(a, b)| *a = f(*a) * b));
    }

    /// Softmax of each row of width `width`, in place (the sum in f64).
    pub fn softmax(&self, x: &mut [f32], width: usize) {
        assert_eq!(x.len() % width, 0, "softmax: rows");
        x.chunks_mut(width).for_each(softmax_row);
    }

    /// The router of [`Backend::moe`]: `logits` is `[n_tok][n_expert]` (overwritten by the probabilities);
    /// fills `out` for `n_tok` tokens.
    pub fn route(&self, logits: &mut [f32], n_expert: usize, k: usize, normalize: bool, out: &mut Routing) {
        self.softmax(logits, n_expert);
        out.select(logits, n_expert, k, normalize);
    }

    /// The expert dispatch of [`Backend::moe`] for a given routing; `x` and `out` are `[n_tok][n_embd]`.
    pub fn moe_ffn(&self, ex: &Experts<'_>, x: &[f32], routing: &Routing, out: &mut [f32], s: &mut MoeScratch) {
        let n_embd = ex.gate.cols;
        let nff = ex.n_ff_exp;
        let n_tok = x.len() / n_embd;
        assert_eq!(out.len(), x.len(), "moe_ffn: output");
        assert_eq!(routing.ids.len(), n_tok * routing.k, "moe_ffn: routing");
        s.acc.clear();
        s.acc.resize(n_tok * n_embd, 0.0);
        let mut groups = std::mem::take(&mut s.groups);
        groups.group(routing, ex.n_expert);
        for e in groups.hit() {
            // The routing slots (token t's i-th choice is slot t * k + i) that chose expert e, whose tokens are
            // gathered into a contiguous batch.
            let slots = groups.slots(e);
            let m = slots.len();
            s.x.resize(m * n_embd, 0.0);
            for (i, &slot) in slots.iter().enumerate() {
                let t = slot as usize / routing.k;
                s.x[i * n_embd..(i + 1) * n_embd].copy_from_slice(&x[t * n_embd..][..n_embd]);
            }
            s.gate.resize(m * nff, 0.0);
            s.up.resize(m * nff, 0.0);
            s.down.resize(m * n_embd, 0.0);
            let x_e = &s.x[..m * n_embd];
            let [gate, up, down] = ex.expert(e);
            Self::matmul_as(&gate, x_e, m, &mut s.gate[..m * nff]);
            Self::matmul_as(&up, x_e, m, &mut s.up[..m * nff]);
            self.glu(&mut s.gate[..m * nff], &s.up[..m * nff], ex.act);
            Self::matmul_as(&down, &s.gate[..m * nff], m, &mut s.down[..m * n_embd]);
            for (i, &slot) in slots.iter().enumerate() {
                let (t, w) = (slot as usize / routing.k, routing.weights[slot as usize] as f64);
                let acc = &mut s.acc[t * n_embd..(t + 1) * n_embd];
                for (a, d) in acc.iter_mut().zip(&s.down[i * n_embd..(i + 1) * n_embd]) {
                    *a += w * *d as f64;
                }
            }
        }
        s.groups = groups;
        for (t, o) in out.chunks_mut(n_embd).enumerate() {
            let inv = if routing.normalized {
                let ws = &routing.weights[t * routing.k..(t + 1) * routing.k];
                1.0 / ws.iter().map(|&w| w as f64).sum::<f64>()
            } else {
                1.0
            };
            for (y, a) in o.iter_mut().zip(&s.acc[t * n_embd..(t + 1) * n_embd]) {
                *y = (a * inv) as f32;
            }
        }
    }
}

/// The most rows per task in [`CpuBackend::expert_rows`].
pub const EXPERT_ROWS: usize = 32;

/// The fewest rows per task in [`CpuBackend::expert_rows`] (below this a task's hand-off costs more than its rows).
pub const EXPERT_ROWS_MIN: usize = 4;

/// Rows per task when `rows` rows are shared by `threads` threads: about `per_thread` tasks each (a decode step's
/// one or two experts would otherwise leave some threads one task behind the rest), within
/// [`EXPERT_ROWS_MIN`]..=[`EXPERT_ROWS`].
fn rows_per_task(rows: usize, threads: usize, per_thread: usize) -> usize {
    rows.div_ceil(threads.max(1) * per_thread.max(1))
        .clamp(EXPERT_ROWS_MIN, EXPERT_ROWS)
}

/// The tasks each thread gets in [`CpuBackend::expert_rows`]'s passes, where the rows allow, unless
/// `STRATA_EXPERT_TASKS` says otherwise.
const TASKS_PER_THREAD: usize = 4;

/// How many rows ahead of the one it computes a task of [`CpuBackend::expert_rows`] asks the cache for, unless
/// `STRATA_EXPERT_PREFETCH` says otherwise: a task's rows are a few KB of one or two streams, too short for the
/// hardware prefetcher to ramp up, so without it each core waits on DRAM and computes by turns.
const PREFETCH_ROWS: usize = 2;

/// [`CpuBackend::expert_rows`]'s tuning, read once from the switches.
#[derive(Debug, Clone, Copy)]
struct ExpertTuning {
    tasks_per_thread: usize,
    prefetch_rows: usize,
}

fn expert_tuning() -> ExpertTuning {
    static T: std::sync::OnceLock<ExpertTuning> = std::sync::OnceLock::new();
    *T.get_or_init(|| ExpertTuning {
        tasks_per_thread: crate::switches::usize_in(crate::switches::EXPERT_TASKS, 1..=64).unwrap_or(TASKS_PER_THREAD),
        prefetch_rows: crate::switches::usize_in(crate::switches::EXPERT_PREFETCH, 0..=64).unwrap_or(PREFETCH_ROWS),
    })
}

/// Asks the cache for row `r` of `w` (each of its 64-byte lines), a hint only; nothing off x86-64.
#[inline(always)]
fn prefetch_row(w: &QMat<'_>, r: usize) {
    prefetch_bytes(w.row(r));
}

/// Asks the cache for every line of `row` (a prefetch never faults and reads nothing).
#[inline]
fn prefetch_bytes(row: &[u8]) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_MM_HINT_T0, _mm_prefetch};
        let p = row.as_ptr();
        // Every line the row touches: from its first byte, then its last (a row need not start on a line).
        for o in (0..row.len()).step_by(64).chain(row.len().checked_sub(1)) {
            // SAFETY: `o` is inside `row`; a prefetch reads nothing and never faults.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(p.add(o) as *const i8) };
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = row;
}

/// Reusable buffers of [`CpuBackend::expert_rows`] (grown on demand, kept between calls).
#[derive(Debug, Default)]
pub struct ExpertRowsScratch {
    /// The tokens quantized for the gate and the up matrix.
    xg: QuantizedActivations,
    xu: QuantizedActivations,
    /// Every job's GLU output quantized for the down matrix.
    hq: QuantizedActivations,
    /// `[jobs][n_ff_exp]`: each job's `glu(gate x, up x)`.
    h: Vec<f32>,
}

/// The threads [`CpuBackend::expert_rows`] runs its tasks on.
#[derive(Debug, Clone, Copy)]
pub enum Workers<'a> {
    /// Rayon's global pool (what every other CPU op uses).
    Rayon,
    /// A pool whose workers spin between jobs (bursts at a steady beat: [`spin`]).
    Spin(&'a spin::SpinPool),
}

impl<'a> Workers<'a> {
    /// The spinning pool when there is one, else rayon's.
    pub fn of(pool: Option<&'a spin::SpinPool>) -> Workers<'a> {
        pool.map_or(Workers::Rayon, Workers::Spin)
    }

    /// Threads that run the tasks: the spinning pool's workers and the caller, or rayon's threads.
    pub fn threads(self) -> usize {
        match self {
            Workers::Rayon => rayon::current_num_threads(),
            Workers::Spin(p) => p.workers() + 1,
        }
    }

    /// Runs `f(0..n)`, each once, and returns when all have run.
    pub fn run(self, n: usize, f: &(dyn Fn(usize) + Sync)) {
        self.run_beside(n, f, || ());
    }

    /// [`Workers::run`] with `beside` on the calling thread meanwhile ([`spin::SpinPool::run_beside`]; rayon's
    /// pool runs it first, then the tasks).
    pub fn run_beside<R>(self, n: usize, f: &(dyn Fn(usize) + Sync), beside: impl FnOnce() -> R) -> R {
        match self {
            Workers::Rayon => {
                let r = beside();
                (0..n).into_par_iter().for_each(f);
                r
            }
            Workers::Spin(p) => p.run_beside(n, f, beside),
        }
    }
}

/// Row `r` of `w` times vector `v` of `qa` (quantized weights), or times `f` (float weights, f32 activations).
#[inline]
fn dot_row(w: &QMat<'_>, r: usize, qa: &QuantizedActivations, v: usize, f: &[f32]) -> f32 {
    if w.act == ActivationFormat::F32 {
        (w.dot)(w.row(r), f)
    } else {
        (w.dot_q8)(w.row(r), &qa.vector(v))
    }
}

impl CpuBackend {
    /// Single experts at decode, unweighted: job `j = (e, t)` writes `out[j * n_embd..(j + 1) * n_embd]` =
    /// `down_e(glu(gate_e x_t, up_e x_t))` for token `t` of `x` (`[n_tok][n_embd]`). Each output is computed as
    /// [`CpuBackend::moe_ffn`] computes a one-token step (int8 activations quantized once per token and matrix,
    /// one dot product per row), bit for bit. Two parallel passes over every job's rows together, as tasks of
    /// [`EXPERT_ROWS_MIN`] to [`EXPERT_ROWS`] rows on `workers`, about four per thread (gate and up with the GLU;
    /// then, after the GLU outputs are quantized, the down rows), so the few experts a decode step misses keep
    /// every core busy. This is how the CPU computes the experts a GPU's expert cache misses (DESIGN.md section 3,
    /// "Expert cache"). No allocation once the scratch has grown. `beside` runs on the calling thread while the workers start on the first pass
    /// ([`Workers::run_beside`]): a GPU's launches for the experts it computes itself (`|| ()` for none); its
    /// value is returned.
    ///
    /// Panics if `x` is not whole tokens of `ex`'s width, `out` is not `jobs.len() * n_embd` values, or a job
    /// names an expert or token out of range.
    #[allow(clippy::too_many_arguments)]
    pub fn expert_rows<R>(
        &self,
        ex: &Experts<'_>,
        x: &[f32],
        jobs: &[(u32, u32)],
        out: &mut [f32],
        s: &mut ExpertRowsScratch,
        workers: Workers<'_>,
        beside: impl FnOnce() -> R,
    ) -> R {
        let (n_embd, nff) = (ex.gate.cols, ex.n_ff_exp);
        assert_eq!(x.len() % n_embd, 0, "expert_rows: activations");
        assert_eq!(out.len(), jobs.len() * n_embd, "expert_rows: output");
        let n_tok = x.len() / n_embd;
        assert!(
            jobs.iter()
                .all(|&(e, t)| (e as usize) < ex.n_expert && (t as usize) < n_tok),
            "expert_rows: a job out of range"
        );
        let quantize = |qa: &mut QuantizedActivations, w: &QMat<'_>, v: &[f32], n: usize| {
            if w.act != ActivationFormat::F32 {
                qa.quantize(w.ty, v, n).expect("matrix checked at construction");
            }
        };
        quantize(&mut s.xg, &ex.gate, x, n_embd);
        quantize(&mut s.xu, &ex.up, x, n_embd);
        s.h.resize(jobs.len() * nff, 0.0);
        let shape = ex.shape();
        let f = match ex.act {
            GluKind::SwiGlu => silu,
            GluKind::GeGlu => gelu_ggml,
        };
        // Pass 1: task i computes rows i * r1.. of every job's gate and up rows laid end to end (job j's row r
        // at j * nff + r), and their GLU.
        let (threads, tune) = (workers.threads(), expert_tuning());
        let pf = tune.prefetch_rows;
        let r1 = rows_per_task(jobs.len() * nff, threads, tune.tasks_per_thread);
        let h = SharedOut(s.h.as_mut_ptr());
        let (xg, xu) = (&s.xg, &s.xu);
        let r = workers.run_beside(
            (jobs.len() * nff).div_ceil(r1),
            &|task| {
                let rows = task * r1..((task + 1) * r1).min(jobs.len() * nff);
                let ahead = |i: usize| {
                    let g = shape.gate_rows(jobs[i / nff].0 as usize).start + i % nff;
                    prefetch_row(&ex.gate, g);
                    prefetch_row(&ex.up, g);
                };
                rows.clone().take(pf).for_each(ahead);
                for i in rows.clone() {
                    if pf > 0 && i + pf < rows.end {
                        ahead(i + pf);
                    }
                    let (j, r) = (i / nff, i % nff);
                    let (e, t) = (jobs[j].0 as usize, jobs[j].1 as usize);
                    let xt = &x[t * n_embd..(t + 1) * n_embd];
                    let g = shape.gate_rows(e).start + r;
                    // CpuBackend::glu's formula on the two rows' dot products.
                    let y = f(dot_row(&ex.gate, g, xg, t, xt)) * dot_row(&ex.up, g, xu, t, xt);
                    // SAFETY: task `task` alone writes h[i] for i in its rows; `s.h` holds jobs * nff values and
                    // outlives the pass (run returns when every task has).
                    unsafe { *h.ptr().add(i) = y };
                }
            },
            beside,
        );
        quantize(&mut s.hq, &ex.down, &s.h, nff);
        // Pass 2: task i computes rows i * r2.. of every job's down rows laid end to end (job j's row r at
        // j * n_embd + r, which is where its output goes).
        let r2 = rows_per_task(jobs.len() * n_embd, threads, tune.tasks_per_thread);
        let o = SharedOut(out.as_mut_ptr());
        let (hq, hs) = (&s.hq, &s.h);
        workers.run((jobs.len() * n_embd).div_ceil(r2), &|task| {
            let rows = task * r2..((task + 1) * r2).min(jobs.len() * n_embd);
            let ahead = |i: usize| {
                prefetch_row(
                    &ex.down,
                    shape.down_rows(jobs[i / n_embd].0 as usize).start + i % n_embd,
                )
            };
            rows.clone().take(pf).for_each(ahead);
            for i in rows.clone() {
                if pf > 0 && i + pf < rows.end {
                    ahead(i + pf);
                }
                let (j, r) = (i / n_embd, i % n_embd);
                let d = shape.down_rows(jobs[j].0 as usize).start + r;
                let y = dot_row(&ex.down, d, hq, j, &hs[j * nff..(j + 1) * nff]);
                // SAFETY: task `task` alone writes out[i] for i in its rows; `out` holds jobs * n_embd values
                // (asserted) and outlives the pass.
                unsafe { *o.ptr().add(i) = y };
            }
        });
        r
    }
}

/// What [`CpuBackend::expert_rate`] measured.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ExpertRate {
    /// Expert weight bytes computed per second, steps of `k` experts back to back.
    pub bytes_s: f64,
    /// Seconds a step costs beyond its bytes when it follows an idle gap (the threads' start, the passes'
    /// barriers): the fastest one-expert step after a gap, less its bytes at `bytes_s`.
    pub fixed_s: f64,
}

impl CpuBackend {
    /// How fast `workers` compute experts at decode ([`CpuBackend::expert_rows`], one token): every expert of
    /// `ex`'s layer once, `k` at a time (a step's misses), the fastest of 3 timed passes after one untimed pass
    /// (page faults, thread start; the fastest, since a thread the OS took away for a while only ever slows a pass
    /// down); then 8 one-expert steps, each after a 300 us gap. 0 bytes/s when the passes took no measurable time.
    pub fn expert_rate(&self, ex: &Experts<'_>, k: usize, workers: Workers<'_>) -> ExpertRate {
        let n_embd = ex.gate.cols;
        let k = k.clamp(1, ex.n_expert);
        let x: Vec<f32> = (0..n_embd).map(|i| ((i as f32) * 0.37).sin() * 0.1).collect();
        let mut out = vec![0f32; k * n_embd];
        let mut s = ExpertRowsScratch::default();
        let mut jobs: Vec<(u32, u32)> = Vec::with_capacity(k);
        let mut step = |first: usize, n: usize, out: &mut [f32]| {
            jobs.clear();
            jobs.extend((first..(first + n).min(ex.n_expert)).map(|e| (e as u32, 0)));
            let t = std::time::Instant::now();
            self.expert_rows(ex, &x, &jobs, &mut out[..jobs.len() * n_embd], &mut s, workers, || ());
            t.elapsed().as_secs_f64()
        };
        let mut pass = || (0..ex.n_expert).step_by(k).map(|e| step(e, k, &mut out)).sum::<f64>();
        pass();
        let secs = (0..3).map(|_| pass()).fold(f64::INFINITY, f64::min);
        let per_expert = ex.expert_bytes() as f64;
        let total = per_expert * ex.n_expert as f64;
        let bytes_s = if secs > 0.0 { total / secs } else { 0.0 };
        let one = (0..8)
            .map(|i| {
                std::thread::sleep(std::time::Duration::from_micros(300));
                step((i * 13) % ex.n_expert, 1, &mut out)
            })
            .fold(f64::INFINITY, f64::min);
        ExpertRate {
            bytes_s,
            fixed_s: if bytes_s > 0.0 {
                (one - per_expert / bytes_s).max(0.0)
            } else {
                one
            },
        }
    }
}

impl Backend for CpuBackend {
    type Buf = Vec<f32>;

    fn name(&self) -> &'static str {
        "cpu"
    }

    fn forward_on_rayon(&self) -> bool {
        true
    }

    fn reserve(&self, buf: &mut Vec<f32>, len: usize) {
        if buf.len() < len {
            buf.resize(len, 0.0);
        }
    }

    fn upload(&self, src: &[f32], dst: &mut Vec<f32>) {
        dst[..src.len()].copy_from_slice(src);
    }

    fn download(&self, src: &Vec<f32>, offset: usize, dst: &mut [f32]) {
        dst.copy_from_slice(&src[offset..offset + dst.len()]);
    }

    fn copy(&self, src: &Vec<f32>, src_offset: usize, dst: &mut Vec<f32>, dst_offset: usize, len: usize) {
        dst[dst_offset..dst_offset + len].copy_from_slice(&src[src_offset..src_offset + len]);
    }

    fn get_rows(&self, table: &QMat<'_>, ids: &[u32], out: &mut Vec<f32>) {
        let n = table.cols;
        for (t, &id) in ids.iter().enumerate() {
            quant::dequantize(table.ty, table.row(id as usize), &mut out[t * n..(t + 1) * n])
                .expect("embedding table checked at load");
        }
    }

    fn matmul(&self, w: &QMat<'_>, x: &Vec<f32>, n_tok: usize, out: &mut Vec<f32>) {
        CpuBackend::matmul(self, w, &x[..n_tok * w.cols], n_tok, &mut out[..n_tok * w.rows]);
    }

    fn matmul_many(&self, ws: &[QMat<'_>], x: &Vec<f32>, n_tok: usize, outs: &mut [&mut Vec<f32>]) {
        let cols = ws.first().map_or(0, |w| w.cols);
        let mut slices: Vec<&mut [f32]> = ws
            .iter()
            .zip(outs.iter_mut())
            .map(|(w, o)| &mut o[..n_tok * w.rows])
            .collect();
        CpuBackend::matmul_many(self, ws, &x[..n_tok * cols], n_tok, &mut slices);
    }

    fn rms_norm(&self, x: &mut Vec<f32>, rows: usize, w: &[f32], eps: f32) {
        CpuBackend::rms_norm(self, &mut x[..rows * w.len()], w, eps);
    }

    fn rope(&self, x: &mut Vec<f32>, n_head: usize, head_dim: usize, positions: &[u32], p: &RopeParams) {
        let n = positions.len() * n_head * head_dim;
        CpuBackend::rope(self, &mut x[..n], n_head, head_dim, positions, p);
    }

    fn scale(&self, x: &mut Vec<f32>, len: usize, s: f32) {
        CpuBackend::scale(self, &mut x[..len], s);
    }

    fn add(&self, x: &mut Vec<f32>, y: &Vec<f32>, len: usize) {
        CpuBackend::add(self, &mut x[..len], &y[..len]);
    }

    fn store_kv(&self, kv: &mut KvLayer, k: &Vec<f32>, v: &Vec<f32>, positions: &[u32]) {
        let n = positions.len();
        let (wk, wv) = (kv.k.width(), kv.v.width());
        CpuBackend::store_kv(self, kv, &k[..n * wk], &v[..n * wv], positions);
    }

    /// The step's q/k norms and RoPE at once (each token's rows at its own position), each run's keys and values
    /// stored into its own cache, then one attention pass over every run ([`CpuBackend::attention_runs`]): each
    /// token's arithmetic is that of its run attended alone, in one fork-join a layer instead of one a sequence.
    fn attend_runs(
        &self,
        q: &mut Vec<f32>,
        k: &mut Vec<f32>,
        v: &Vec<f32>,
        kvs: &mut [&mut KvCache],
        layer: usize,
        layout: &BatchLayout,
        a: &AttnOp<'_>,
        out: &mut Vec<f32>,
        _tmp: &mut RunBufs<Vec<f32>>,
    ) {
        let p = &a.params;
        let pos = layout.positions();
        let n = pos.len();
        self.qk_norm_rope(q, k, p.n_head, p.n_head_kv, p.head_dim, a.norms, a.eps, pos, a.rope);
        let (wk, wv) = (p.n_head_kv * p.head_dim, p.n_head_kv * p.head_dim_v);
        for run in layout.runs() {
            let t = run.tokens();
            let kv = &mut kvs[run.seq].layers[layer];
            CpuBackend::store_kv(
                self,
                kv,
                &k[t.start * wk..t.end * wk],
                &v[t.start * wv..t.end * wv],
                &pos[t],
            );
        }
        if let Some(sc) = a.q_scale {
            Backend::scale(self, q, n * p.n_head * p.head_dim, sc);
        }
        let layers: Vec<&KvLayer> = layout.runs().iter().map(|r| &kvs[r.seq].layers[layer]).collect();
        CpuBackend::attention_runs(
            self,
            &q[..n * p.n_head * p.head_dim],
            &layers,
            layout.runs(),
            pos,
            p,
            &mut out[..n * p.n_head * p.head_dim_v],
        );
    }

    fn attention(&self, q: &Vec<f32>, kv: &KvLayer, positions: &[u32], p: &AttnParams, out: &mut Vec<f32>) {
        let n = positions.len() * p.n_head;
        CpuBackend::attention(
            self,
            &q[..n * p.head_dim],
            kv,
            positions,
            p,
            &mut out[..n * p.head_dim_v],
        );
    }

    fn glu(&self, gate: &mut Vec<f32>, up: &Vec<f32>, len: usize, act: GluKind) {
        CpuBackend::glu(self, &mut gate[..len], &up[..len], act);
    }

    fn moe(
        &self,
        ex: &Experts<'_>,
        logits: &mut Vec<f32>,
        x: &Vec<f32>,
        n_tok: usize,
        k: usize,
        normalize: bool,
        out: &mut Vec<f32>,
        scratch: &mut MoeScratch,
    ) {
        let n_embd = ex.gate.cols;
        let mut routing = std::mem::take(&mut scratch.routing);
        self.route(
            &mut logits[..n_tok * ex.n_expert],
            ex.n_expert,
            k,
            normalize,
            &mut routing,
        );
        self.moe_ffn(ex, &x[..n_tok * n_embd], &routing, &mut out[..n_tok * n_embd], scratch);
        scratch.routing = routing;
    }
}
