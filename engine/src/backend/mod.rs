//! Backends: the operations a forward pass is made of, behind one trait.
//!
//! DESIGN.md section 3: one forward pass per architecture (`model::forward`) is written against [`Backend`]; the
//! CPU backend ([`cpu::CpuBackend`]) defines the semantics every other backend must reproduce within stated
//! tolerances.
//!
//! Layout conventions shared by every op:
//! - activations are row-major f32, one row per token: `[n_tok][width]`;
//! - a weight matrix ([`QMat`]) is ggml's layout: `rows` quantized rows of `cols` weights each, and a matmul
//!   computes `out[t][r] = Σ_c W[r][c] · x[t][c]` (ggml's `mul_mat(W, x)`);
//! - per-head tensors are `[n_tok][n_head][head_dim]`, heads contiguous within a token row;
//! - the KV cache is indexed by absolute position: cell `p` holds the keys and values of the token at
//!   position `p` (see [`crate::state::kv`]).

pub mod cpu;
pub mod cuda;

/// Work started by the engine, counted so `strata serve`'s worker can show its watchdog a long step is computing.
pub mod progress {
    use std::sync::atomic::{AtomicU64, Ordering};

    static TICKS: AtomicU64 = AtomicU64::new(0);

    /// Counts one piece of work started (a layer, a task of a prefill matmul or of attention).
    #[inline]
    pub fn tick() {
        TICKS.fetch_add(1, Ordering::Relaxed);
    }

    /// Pieces of work started in this process: a count that moves while the engine computes and stops when it
    /// hangs (`strata serve`'s heartbeat, issue 19 point 5).
    pub fn ticks() -> u64 {
        TICKS.load(Ordering::Relaxed)
    }

    use std::cell::Cell;
    use std::sync::atomic::AtomicBool;

    thread_local! {
        /// The cancel flag a forward pass on this thread reads between layers (null: none).
        static CANCEL: Cell<*const AtomicBool> = const { Cell::new(std::ptr::null()) };
        /// A forward pass on this thread stopped between layers because of it.
        static ABORTED: Cell<bool> = const { Cell::new(false) };
    }

    /// While alive, forward passes on this thread stop between layers once `flag` is set ([`stop_here`]); the
    /// previous flag comes back on drop.
    pub struct CancelScope<'a> {
        previous: *const AtomicBool,
        _flag: std::marker::PhantomData<&'a AtomicBool>,
    }

    /// Arms `flag` for this thread's forward passes ([`CancelScope`]).
    pub fn cancel_scope(flag: &AtomicBool) -> CancelScope<'_> {
        let previous = CANCEL.replace(flag as *const AtomicBool);
        CancelScope {
            previous,
            _flag: std::marker::PhantomData,
        }
    }

    impl Drop for CancelScope<'_> {
        fn drop(&mut self) {
            CANCEL.set(self.previous);
        }
    }

    /// Whether a forward pass should stop here: the armed flag is set. Records that it did ([`take_aborted`]).
    pub fn stop_here() -> bool {
        let p = CANCEL.get();
        // SAFETY: a non-null pointer was set by a CancelScope that borrows the flag and resets it on drop, or by
        // `on_rayon` for the length of its call, inside the caller's scope, resetting it on return and on unwind
        // (`Lent`): the flag outlives every read here.
        let stop = !p.is_null() && unsafe { (*p).load(Ordering::Relaxed) };
        if stop {
            ABORTED.set(true);
        }
        stop
    }

    /// Whether a forward pass on this thread stopped early since the last call (and clears it).
    pub fn take_aborted() -> bool {
        ABORTED.replace(false)
    }

    /// [`take_aborted`] without clearing it.
    pub fn aborted() -> bool {
        ABORTED.get()
    }

    /// The armed cancel flag, carried to another thread by [`on_rayon`].
    struct Armed(*const AtomicBool);

    // SAFETY: the flag is an `AtomicBool` (Sync) that the caller's `CancelScope` keeps alive for as long as
    // `on_rayon` runs, and the other thread holds the pointer no longer than that (`Lent` takes it back there, on
    // return and on unwind).
    unsafe impl Send for Armed {}

    /// The cancel flag and abort record a rayon worker had before [`on_rayon`] lent it another thread's, put back
    /// when dropped, also when the pass panics: no pointer to a flag outlives its lender, and a pass nested inside
    /// another on the same worker (work stealing) neither sees nor clears the other's record.
    struct Lent {
        cancel: *const AtomicBool,
        aborted: bool,
    }

    impl Drop for Lent {
        fn drop(&mut self) {
            CANCEL.set(self.cancel);
            ABORTED.set(self.aborted);
        }
    }

    /// Runs `f` on a thread of rayon's global pool, unless this thread is a worker of a rayon pool already, and
    /// returns its value: with this thread's cancel flag armed there for its forward pass ([`stop_here`]), and
    /// with whether the pass stopped early brought back here ([`take_aborted`]). The CPU backend's ops fork onto rayon's pool: forked
    /// from a thread outside it, each op puts its caller to sleep and wakes it again, about 240 sleeps and wakes a
    /// decode step of SmolLM2-135M; from a worker, the caller works on the op's first tasks and nobody sleeps
    /// (tg64 121 -> 158-170 tok/s on the 2-core Intel VM, `reports/2026-12-05-cpu-matmul-prefetch.md`).
    pub fn on_rayon<R: Send>(f: impl FnOnce() -> R + Send) -> R {
        if rayon::current_thread_index().is_some() {
            return f();
        }
        let armed = Armed(CANCEL.get());
        let (r, aborted) = rayon::scope(move |_| {
            let armed = armed;
            let _lent = Lent {
                cancel: CANCEL.replace(armed.0),
                aborted: ABORTED.replace(false),
            };
            let r = f();
            (r, ABORTED.get())
        });
        if aborted {
            ABORTED.set(true);
        }
        r
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn a_pass_on_a_worker_reads_the_callers_flag_and_its_stop_comes_back() {
            let flag = AtomicBool::new(false);
            let _scope = cancel_scope(&flag);
            take_aborted();
            let (on_worker, stopped) = on_rayon(|| (rayon::current_thread_index().is_some(), stop_here()));
            assert!(on_worker && !stopped);
            assert!(!take_aborted());
            flag.store(true, Ordering::Relaxed);
            assert!(on_rayon(stop_here), "the caller's flag is armed on the worker");
            assert!(take_aborted(), "the worker's stop is the caller's");
            assert!(!take_aborted());
        }

        #[test]
        fn a_pass_that_panics_on_a_worker_leaves_no_flag_there() {
            let flag = AtomicBool::new(true);
            {
                let _scope = cancel_scope(&flag);
                let r = std::panic::catch_unwind(|| {
                    on_rayon(|| {
                        assert!(stop_here());
                        panic!("a pass panics");
                    })
                });
                assert!(r.is_err());
            }
            // Every worker of the pool is back to no flag and no abort record.
            let clean = rayon::broadcast(|_| CANCEL.get().is_null() && !ABORTED.get());
            assert!(clean.iter().all(|&c| c), "{clean:?}");
        }
    }
}
pub mod split;
pub mod top;

pub use crate::device::Device;
pub use crate::experts::Routing;
pub use cuda::select::{AnyBackend, OpenError};
pub use top::{TOP_LOGITS, TopLogits};

use crate::device::fault::FaultPlan;
use crate::experts::{ExpertGroups, ExpertShape};
use crate::gguf::{GgufModel, TensorInfo};
use crate::quant::activations::ActivationFormat;
use crate::quant::{self, DotFn, DotQ8Fn, DotQ8ManyFn, GgmlType, QuantError};
use crate::state::batch::{BatchLayout, SeqRun};
use crate::state::kv::{KvCache, KvLayer, SeqSlot};

/// A quantized weight matrix viewed in place (zero-copy) in a GGUF mapping: `rows` rows of `cols` weights.
#[derive(Clone, Copy)]
pub struct QMat<'a> {
    pub ty: GgmlType,
    /// Whole rows, `rows * row_bytes` bytes.
    pub data: &'a [u8],
    pub rows: usize,
    pub cols: usize,
    /// Bytes per row (`ty.row_bytes(cols)`).
    pub row_bytes: usize,
    /// The per-row f32-activation dot product chosen once for `ty`.
    pub dot: DotFn,
    /// The per-row int8-activation dot product (ggml's `vec_dot` with `vec_dot_type` activations).
    pub dot_q8: DotQ8Fn,
    /// `dot_q8` for several tokens at once, bit for bit its results, where the CPU and type have one.
    pub dot_q8_many: Option<DotQ8ManyFn>,
    /// The activation format `dot_q8` takes; [`ActivationFormat::F32`] for float weights, which use `dot`.
    pub act: ActivationFormat,
    /// The rows packed eight at a time for the CPU's matmul (`STRATA_CPU_PACK`, [`crate::quant::packed`]), which
    /// then computes every token of the matrix from them; `data` stays the file's layout for everything else.
    pub packed: Option<&'a crate::quant::packed::Packed>,
}

impl<'a> QMat<'a> {
    /// A view of `data` as `rows × cols` weights of `ty`.
    ///
    /// Errors: `ty` has no dot product, `cols` is not whole blocks, or `data` is not exactly the matrix.
    pub fn new(ty: GgmlType, data: &'a [u8], rows: usize, cols: usize) -> Result<QMat<'a>, QuantError> {
        let dot = quant::dot_fn(ty)?;
        let dot_q8 = quant::dot_q8_fn(ty)?;
        let dot_q8_many = quant::dot_q8_many_fn(ty);
        let act = quant::activation_format(ty)?;
        let row_bytes = ty.row_bytes(cols as u64).ok_or(QuantError::NotWholeBlocks {
            ty,
            op: "matmul",
            what: "row length",
            len: cols,
            block: ty.geometry().block_elems,
        })? as usize;
        if data.len() != rows * row_bytes {
            return Err(QuantError::LengthMismatch {
                ty,
                op: "matmul",
                what: "matrix bytes",
                expected: rows * row_bytes,
                actual: data.len(),
            });
        }
        Ok(QMat {
            ty,
            data,
            rows,
            cols,
            row_bytes,
            dot,
            dot_q8,
            dot_q8_many,
            act,
            packed: None,
        })
    }

    /// Row `r`'s bytes.
    #[inline]
    pub fn row(&self, r: usize) -> &'a [u8] {
        &self.data[r * self.row_bytes..(r + 1) * self.row_bytes]
    }

    /// Rows `start..start + n` as a matrix of their own (an expert of a stacked `*_exps` tensor).
    pub fn rows_slice(&self, start: usize, n: usize) -> QMat<'a> {
        QMat {
            data: &self.data[start * self.row_bytes..(start + n) * self.row_bytes],
            rows: n,
            packed: None,
            ..*self
        }
    }
}

/// Where a weight matrix lives in the model file: resolved to a [`QMat`] per use, which costs a few
/// comparisons (no copy, no lookup by name).
#[derive(Debug, Clone)]
pub struct MatRef {
    pub info: TensorInfo,
    pub rows: usize,
    pub cols: usize,
    /// Its rows packed for the CPU's matmul ([`MatRef::pack`]), where they are.
    pub packed: Option<std::sync::Arc<crate::quant::packed::Packed>>,
}

impl MatRef {
    /// The zero-copy view of this matrix in `gguf` (with its packed rows, where it has them).
    ///
    /// Panics if `gguf` is not the model the reference was built from (the loader checked every matrix).
    #[inline]
    pub fn view<'a>(&'a self, gguf: &'a GgufModel) -> QMat<'a> {
        let mut m = QMat::new(self.info.ty, gguf.tensor_data(&self.info), self.rows, self.cols)
            .expect("matrix checked at load time");
        m.packed = self.packed.as_deref();
        m
    }

    /// Packs the matrix's rows for the CPU's matmul ([`crate::quant::packed::pack`]), releasing the file's pages
    /// of each chunk of rows once packed ([`GgufModel::release_range`]); returns whether it could (its type has a
    /// packed layout, its rows are a multiple of 8 and the CPU has the kernels).
    pub fn pack(&mut self, gguf: &GgufModel) -> bool {
        if self.packed.is_none() {
            let data = gguf.tensor_data(&self.info);
            let release = |r: std::ops::Range<usize>| gguf.release_range(&self.info, r);
            self.packed = crate::quant::packed::pack_with(self.info.ty, data, self.rows, self.cols, release)
                .map(std::sync::Arc::new);
        }
        self.packed.is_some()
    }
}

/// RoPE variant (ggml's `mode`): which dimensions form a rotated pair.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RopeKind {
    /// GPT-J style, pairs `(2i, 2i+1)` (llama).
    Normal,
    /// GPT-NeoX style, pairs `(i, i + n_rot/2)` (qwen3, gemma3).
    Neox,
}

/// Rotary embedding parameters (ggml's `rope_ext` with `ext_factor = 0`, `attn_factor = 1`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RopeParams {
    pub kind: RopeKind,
    /// Rotated dimensions per head (`n_rot`, even, ≤ head_dim); the rest pass through.
    pub n_rot: usize,
    /// θ base (`rope.freq_base`).
    pub freq_base: f32,
    /// Position multiplier (1 / linear scaling factor).
    pub freq_scale: f32,
}

impl RopeParams {
    /// The ratio between the rotation rates of successive pairs, `freq_base^(-2 / n_rot)` (ggml's `theta_scale`):
    /// pair i turns by `pos · freq_scale · theta_scale^i` radians.
    pub fn theta_scale(&self) -> f32 {
        self.freq_base.powf(-2.0 / self.n_rot as f32)
    }
}

/// Causal attention parameters.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AttnParams {
    pub n_head: usize,
    pub n_head_kv: usize,
    pub head_dim: usize,
    pub head_dim_v: usize,
    /// Multiplies `q·k` before the softmax.
    pub scale: f32,
    /// Sliding window in tokens: a query at position `p` sees keys at `p - window < j ≤ p` (llama.cpp's
    /// `LLAMA_SWA_TYPE_STANDARD`). `None`: every earlier position.
    pub window: Option<usize>,
}

/// One layer's attention as the forward pass asks for it ([`Backend::attend`]): the per-head q/k norms, RoPE,
/// the attention itself, and (gemma3) a scale of the rotated queries before it.
#[derive(Debug, Clone, Copy)]
pub struct AttnOp<'a> {
    /// Per-head RMSNorm weights of q and k (`head_dim` each), when the architecture has them.
    pub norms: (Option<&'a [f32]>, Option<&'a [f32]>),
    pub eps: f32,
    pub rope: &'a RopeParams,
    pub params: AttnParams,
    /// Multiplies the rotated queries before attention (then `params.scale` is 1).
    pub q_scale: Option<f32>,
}

/// Per-run copies of a step's projections for [`Backend::attend_runs`]'s default, grown on demand and reused.
pub struct RunBufs<B> {
    pub q: B,
    pub k: B,
    pub v: B,
    pub att: B,
}

impl<B: Default> Default for RunBufs<B> {
    fn default() -> Self {
        RunBufs {
            q: B::default(),
            k: B::default(),
            v: B::default(),
            att: B::default(),
        }
    }
}

/// Gated FFN activation: `out = act(gate) * up`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GluKind {
    /// `silu(g) * u` (llama, qwen3).
    SwiGlu,
    /// `gelu(g) * u`, GELU in its tanh form with ggml's f16 rounding (gemma3; see `cpu::gelu_ggml`).
    GeGlu,
}

/// A MoE layer's experts: three stacked tensors, expert `e` being rows `e * rows .. (e + 1) * rows` of each.
#[derive(Clone, Copy)]
pub struct Experts<'a> {
    /// `[n_expert × n_ff_exp] × n_embd`.
    pub gate: QMat<'a>,
    /// `[n_expert × n_ff_exp] × n_embd`.
    pub up: QMat<'a>,
    /// `[n_expert × n_embd] × n_ff_exp`.
    pub down: QMat<'a>,
    pub n_expert: usize,
    pub n_ff_exp: usize,
    pub act: GluKind,
    /// The layer's index in the model (the expert cache's key).
    pub layer: usize,
}

impl<'a> Experts<'a> {
    /// Where each expert's rows are in the stacked tensors.
    pub fn shape(&self) -> ExpertShape {
        ExpertShape {
            n_expert: self.n_expert,
            n_ff_exp: self.n_ff_exp,
            n_embd: self.gate.cols,
        }
    }

    /// Bytes of one expert: its gate, up and down rows.
    pub fn expert_bytes(&self) -> u64 {
        [&self.gate, &self.up, &self.down]
            .iter()
            .map(|w| (w.data.len() / self.n_expert) as u64)
            .sum()
    }

    /// Expert `e`'s gate, up and down matrices, viewed in place.
    ///
    /// Panics if `e >= n_expert`.
    pub fn expert(&self, e: usize) -> [QMat<'a>; 3] {
        let s = self.shape();
        let (g, d) = (s.gate_rows(e), s.down_rows(e));
        [
            self.gate.rows_slice(g.start, g.len()),
            self.up.rows_slice(g.start, g.len()),
            self.down.rows_slice(d.start, d.len()),
        ]
    }
}

/// Reusable host buffers of the CPU's expert dispatch, grown on demand and kept between calls.
#[derive(Debug, Default)]
pub struct MoeScratch {
    /// The router's choice for the current batch.
    pub routing: Routing,
    /// The routing slots of the batch grouped by expert.
    pub groups: ExpertGroups,
    /// Weighted sum of the expert outputs, `[n_tok][n_embd]`, in f64.
    pub acc: Vec<f64>,
    pub x: Vec<f32>,
    pub gate: Vec<f32>,
    pub up: Vec<f32>,
    pub down: Vec<f32>,
}

/// Cells per block of attention span in a step's key ([`Backend::step_begin`]): a decode step over a span of
/// `b` blocks (`ceil((last position + 1) / ATTN_SPAN_BLOCK)`) may size its attention launches by `b` (the CUDA
/// backend runs one attention launch for `b = 1` and splits the keys by `b` above: `decode_splits` in
/// backend/cuda), so steps of another span are recorded apart.
pub const ATTN_SPAN_BLOCK: usize = 128;

/// The identity of a forward step for a backend that records steps (CUDA graphs): the sequence whose KV cache and
/// scratch buffers it uses, and an opaque shape chosen by the step driver (equal shapes: the same launches).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct StepKey {
    pub slot: SeqSlot,
    pub shape: u64,
}

/// The operations of a forward pass over activation buffers that live where the backend computes: host
/// memory for the CPU ([`Vec<f32>`]), device memory for a GPU. The forward pass moves data between host and
/// backend only through [`Backend::upload`] (token ids become embeddings through [`Backend::get_rows`]) and
/// [`Backend::download`] (logits), so a GPU backend keeps every activation of a layer on the device.
///
/// Shapes are in each method's doc; element counts are explicit because a buffer may be longer than its use
/// (buffers grow to the largest batch and are reused). Every method panics on inconsistent shapes (a bug in
/// the caller, which sizes everything from the hyper-parameters checked at load) and, on a GPU, on a device
/// fault after writing its `fault` event (DESIGN.md section 3: the worker dies, the server restarts it).
pub trait Backend: Send + Sync {
    /// An f32 activation buffer.
    type Buf: Default + Send;

    /// A short name for logs (`cpu`, `cuda`).
    fn name(&self) -> &'static str;

    /// Makes `buf` hold at least `len` values (their contents are unspecified after a growth).
    fn reserve(&self, buf: &mut Self::Buf, len: usize);

    /// `dst[..src.len()] = src` (dst must hold them).
    fn upload(&self, src: &[f32], dst: &mut Self::Buf);

    /// `dst = src[offset..offset + dst.len()]`, waiting for pending work.
    fn download(&self, src: &Self::Buf, offset: usize, dst: &mut [f32]);

    /// `dst[dst_offset..dst_offset + len] = src[src_offset..src_offset + len]`.
    fn copy(&self, src: &Self::Buf, src_offset: usize, dst: &mut Self::Buf, dst_offset: usize, len: usize);

    /// Queues the selection of the best [`TOP_LOGITS`] of one token's `n`
    /// logits, `logits[..n]`, where they were computed (a decode step then returns those candidates, not the
    /// vocabulary; [`TopLogits`] says what they are). Returns false when this backend
    /// leaves the selection to the host (the default; also a vocabulary the backend cannot select from): the
    /// caller downloads the logits instead. The answer depends on `n` alone.
    fn top_logits(&self, _logits: &Self::Buf, _n: usize) -> bool {
        false
    }

    /// Reads the selection queued by the last [`Backend::top_logits`] over `n` logits into `out`, waiting for
    /// pending work. Returns false (nothing read) where `top_logits(_, n)` returns false.
    fn read_top_logits(&self, _n: usize, _out: &mut TopLogits) -> bool {
        false
    }

    /// [`Backend::top_logits`] for each of `rows` rows of `n` logits, `logits[r * n..(r + 1) * n]` (a step of
    /// several sequences). Returns false when the backend leaves the selection to the host (the default).
    fn top_logits_rows(&self, _logits: &Self::Buf, _rows: usize, _n: usize) -> bool {
        false
    }

    /// Reads the selections queued by the last [`Backend::top_logits_rows`] over `out.len()` rows of `n` logits,
    /// waiting for pending work. Returns false (nothing read) where that call returns false.
    fn read_top_logits_rows(&self, _n: usize, _out: &mut [TopLogits]) -> bool {
        false
    }

    /// Embedding lookup: `out[t] = dequantize(table row ids[t])`, `out` `[ids.len()][table.cols]`
    /// (ggml's `get_rows`). Ids were checked against `table.rows` by the caller.
    fn get_rows(&self, table: &QMat<'_>, ids: &[u32], out: &mut Self::Buf);

    /// `out[t][r] = Σ_c W[r][c] · x[t][c]` for `n_tok` tokens: `x` is `[n_tok][w.cols]`, `out` `[n_tok][w.rows]`.
    fn matmul(&self, w: &QMat<'_>, x: &Self::Buf, n_tok: usize, out: &mut Self::Buf);

    /// `outs[i] = ws[i] · x` for every i, each as [`Backend::matmul`] computes it (`x` is `[n_tok][cols]` for
    /// every matrix; `outs[i]` is `[n_tok][ws[i].rows]`). A backend may share work among matrices that read the
    /// same activations (a layer's q/k/v, its gate/up).
    fn matmul_many(&self, ws: &[QMat<'_>], x: &Self::Buf, n_tok: usize, outs: &mut [&mut Self::Buf]);

    /// RMSNorm of `rows` rows of width `w.len()`, in place: `x = x / sqrt(mean(x²) + eps) * w` (ggml's
    /// `rms_norm` then `mul`). Per-head q/k-norm is the same call with `w` of width `head_dim`.
    fn rms_norm(&self, x: &mut Self::Buf, rows: usize, w: &[f32], eps: f32);

    /// `out[..rows·w.len()] = rms_norm(x)` out of place (a layer's `h = norm(x)`); `x` is unchanged.
    fn rms_norm_into(&self, x: &Self::Buf, out: &mut Self::Buf, rows: usize, w: &[f32], eps: f32) {
        self.copy(x, 0, out, 0, rows * w.len());
        self.rms_norm(out, rows, w, eps);
    }

    /// Rotates each head of each token in place: `x` is `[positions.len()][n_head][head_dim]`.
    fn rope(&self, x: &mut Self::Buf, n_head: usize, head_dim: usize, positions: &[u32], p: &RopeParams);

    /// A layer's queries and keys before attention: per-head RMSNorm with `q_norm`/`k_norm` when given, then
    /// RoPE, as [`Backend::rms_norm`] and [`Backend::rope`] on each (which is the default). `q` is
    /// `[n_tok][n_head][head_dim]`, `k` `[n_tok][n_head_kv][head_dim]`, `n_tok = positions.len()`. A backend may
    /// do it in one pass.
    #[allow(clippy::too_many_arguments)]
    fn qk_norm_rope(
        &self,
        q: &mut Self::Buf,
        k: &mut Self::Buf,
        n_head: usize,
        n_head_kv: usize,
        head_dim: usize,
        norms: (Option<&[f32]>, Option<&[f32]>),
        eps: f32,
        positions: &[u32],
        p: &RopeParams,
    ) {
        let n = positions.len();
        if let Some(w) = norms.0 {
            self.rms_norm(q, n * n_head, w, eps);
        }
        if let Some(w) = norms.1 {
            self.rms_norm(k, n * n_head_kv, w, eps);
        }
        self.rope(q, n_head, head_dim, positions, p);
        self.rope(k, n_head_kv, head_dim, positions, p);
    }

    /// [`Backend::qk_norm_rope`], then [`Backend::store_kv`] of the rotated keys and of `v` (the default); a
    /// backend may do both in one pass.
    #[allow(clippy::too_many_arguments)]
    fn qk_norm_rope_store(
        &self,
        q: &mut Self::Buf,
        k: &mut Self::Buf,
        v: &Self::Buf,
        kv: &mut KvLayer,
        n_head: usize,
        head_dim: usize,
        norms: (Option<&[f32]>, Option<&[f32]>),
        eps: f32,
        positions: &[u32],
        p: &RopeParams,
    ) {
        let n_head_kv = kv.k.heads();
        self.qk_norm_rope(q, k, n_head, n_head_kv, head_dim, norms, eps, positions, p);
        self.store_kv(kv, k, v, positions);
    }

    /// A layer's attention from its raw projections: [`Backend::qk_norm_rope_store`] of `q`, `k` and `v` (with
    /// `rope` and the q/k norms), then [`Backend::attention`] of `q` over `kv` into `out` (the default, which an
    /// override must equal within rounding: the parity test states the tolerance); shapes as those two take them.
    /// A backend may do both in one pass (the CUDA backend for a decode step over a short cache); `q` and `k` are
    /// then left unrotated.
    #[allow(clippy::too_many_arguments)]
    fn rope_store_attention(
        &self,
        q: &mut Self::Buf,
        k: &mut Self::Buf,
        v: &Self::Buf,
        kv: &mut KvLayer,
        norms: (Option<&[f32]>, Option<&[f32]>),
        eps: f32,
        positions: &[u32],
        rope: &RopeParams,
        p: &AttnParams,
        out: &mut Self::Buf,
    ) {
        self.qk_norm_rope_store(q, k, v, kv, p.n_head, p.head_dim, norms, eps, positions, rope);
        self.attention(q, kv, positions, p, out);
    }

    /// One layer's attention for a step of one sequence, from its raw projections, as [`AttnOp`] describes it:
    /// with `q_scale` (gemma3), [`Backend::qk_norm_rope_store`], the scale of the rotated queries, then
    /// [`Backend::attention`]; without, [`Backend::rope_store_attention`] (the default; shapes as those take them).
    #[allow(clippy::too_many_arguments)]
    fn attend(
        &self,
        q: &mut Self::Buf,
        k: &mut Self::Buf,
        v: &Self::Buf,
        kv: &mut KvLayer,
        positions: &[u32],
        a: &AttnOp<'_>,
        out: &mut Self::Buf,
    ) {
        let p = &a.params;
        match a.q_scale {
            Some(sc) => {
                self.qk_norm_rope_store(q, k, v, kv, p.n_head, p.head_dim, a.norms, a.eps, positions, a.rope);
                self.scale(q, positions.len() * p.n_head * p.head_dim, sc);
                self.attention(q, kv, positions, p, out);
            }
            None => self.rope_store_attention(q, k, v, kv, a.norms, a.eps, positions, a.rope, p, out),
        }
    }

    /// One layer's attention for a step that carries several sequences ([`BatchLayout`]): the tokens of each run
    /// store their keys and values into, and attend over, layer `layer` of their own sequence's cache
    /// (`kvs[run.seq]`). `q`, `k`, `v` and `out` hold every token of the step, in the layout's order, shaped as
    /// [`Backend::attend`] takes them. The default attends run by run ([`attend_runs_one_by_one`]): the same
    /// arithmetic per token as the run alone. A backend may attend over every sequence in one launch.
    #[allow(clippy::too_many_arguments)]
    fn attend_runs(
        &self,
        q: &mut Self::Buf,
        k: &mut Self::Buf,
        v: &Self::Buf,
        kvs: &mut [&mut KvCache],
        layer: usize,
        layout: &BatchLayout,
        a: &AttnOp<'_>,
        out: &mut Self::Buf,
        tmp: &mut RunBufs<Self::Buf>,
    ) {
        attend_runs_one_by_one(
            self,
            q,
            k,
            v,
            kvs,
            layer,
            layout.runs(),
            layout.positions(),
            a,
            out,
            tmp,
        );
    }

    /// Multiplies the first `len` values by `s`.
    fn scale(&self, x: &mut Self::Buf, len: usize, s: f32);

    /// `x[..len] += y[..len]`.
    fn add(&self, x: &mut Self::Buf, y: &Self::Buf, len: usize);

    /// `x += y` then `out = rms_norm(x)` over `rows` rows of width `w.len()` (a residual add and the next
    /// norm), as [`Backend::add`] then [`Backend::rms_norm_into`] (the default).
    fn add_rms_norm_into(
        &self,
        x: &mut Self::Buf,
        y: &Self::Buf,
        out: &mut Self::Buf,
        rows: usize,
        w: &[f32],
        eps: f32,
    ) {
        self.add(x, y, rows * w.len());
        self.rms_norm_into(x, out, rows, w, eps);
    }

    /// Writes the keys and values of tokens at `positions` into `kv`: `k` is `[n_tok][n_head_kv * head_dim]`,
    /// `v` `[n_tok][n_head_kv * head_dim_v]`.
    fn store_kv(&self, kv: &mut KvLayer, k: &Self::Buf, v: &Self::Buf, positions: &[u32]);

    /// Causal attention with GQA over the cache: query head `h` uses KV head `h / (n_head / n_head_kv)`; the
    /// query at `positions[t]` attends to cells `max(0, p - window + 1)..=p`. `q` is `[n_tok][n_head][head_dim]`,
    /// `out` `[n_tok][n_head][head_dim_v]`. The cache must already hold every attended cell.
    fn attention(&self, q: &Self::Buf, kv: &KvLayer, positions: &[u32], p: &AttnParams, out: &mut Self::Buf);

    /// `gate[..len] = act(gate) * up`, element-wise.
    fn glu(&self, gate: &mut Self::Buf, up: &Self::Buf, len: usize, act: GluKind);

    /// A MoE FFN from the router's logits (`[n_tok][n_expert]`, overwritten): per token, softmax over all
    /// experts, the `k` largest probabilities (ties to the lower id), renormalised to sum 1 when `normalize`
    /// (llama.cpp's `build_moe_ffn` with softmax gating and `norm_w`); then
    /// `out[t] = Σ_i weights[t,i] · down_e(act(gate_e(x[t])) * up_e(x[t]))` over token t's experts `e`
    /// (divided by the weights' exact sum when renormalised), summed in f64. `x` and `out` are `[n_tok][n_embd]`.
    /// `scratch` holds the CPU's host buffers; a GPU backend keeps its own on the device.
    #[allow(clippy::too_many_arguments)]
    fn moe(
        &self,
        ex: &Experts<'_>,
        logits: &mut Self::Buf,
        x: &Self::Buf,
        n_tok: usize,
        k: usize,
        normalize: bool,
        out: &mut Self::Buf,
        scratch: &mut MoeScratch,
    );

    /// A MoE FFN from its router to the next layer's norm: the router's logits `logits = router · h`
    /// (`[n_tok][n_expert]`, [`Backend::matmul`]), [`Backend::moe`] of `h` into `tmp`, `x += tmp`, then
    /// `h = rms_norm(x) * norm` when `norm` is given (the last layer has none: `h` is left as it was). `h`, `tmp`
    /// and `x` are `[n_tok][n_embd]`; the contents of `tmp` and `logits` are unspecified after (a backend may never
    /// write `tmp`). The default does exactly those steps ([`moe_add_rms_norm_steps`]); a backend may route in the
    /// router's launch and sum the experts, add and normalize in one pass, with the same arithmetic.
    #[allow(clippy::too_many_arguments)]
    fn moe_add_rms_norm(
        &self,
        router: &QMat<'_>,
        ex: &Experts<'_>,
        logits: &mut Self::Buf,
        h: &mut Self::Buf,
        n_tok: usize,
        k: usize,
        normalize: bool,
        tmp: &mut Self::Buf,
        x: &mut Self::Buf,
        norm: Option<&[f32]>,
        eps: f32,
        scratch: &mut MoeScratch,
    ) {
        moe_add_rms_norm_steps(
            self, router, ex, logits, h, n_tok, k, normalize, tmp, x, norm, eps, scratch,
        );
    }

    /// Brackets one forward pass of `n_tok` tokens. The caller (the step driver, `runtime::session`) gives each
    /// step a [`StepKey`]: the sequence whose buffers it uses and its shape (tokens, logits wanted, attention span in
    /// blocks of [`ATTN_SPAN_BLOCK`] cells: a step's launches may depend on all three). A GPU backend records a
    /// decode step into a CUDA graph and replays it on later steps of the same key. No data may be read back
    /// between the two calls but through [`Backend::download`].
    fn step_begin(&self, _n_tok: usize, _key: StepKey) {}

    /// Tells the backend how many sequences the forward pass about to run carries (its [`BatchLayout`]'s runs;
    /// called first by every forward pass): a GPU may pick other kernels for a step of several sequences, whose
    /// results are judged against each sequence alone within a tolerance, than for one sequence, whose results
    /// its expert cache must not change. The default ignores it.
    fn step_sequences(&self, _n: usize) {}

    /// Whether forward passes should run on a thread of rayon's pool ([`progress::on_rayon`]): the CPU backend's,
    /// whose ops fork onto that pool. The default (false) runs them on the caller's thread.
    fn forward_on_rayon(&self) -> bool {
        false
    }

    /// Ends the step begun by [`Backend::step_begin`] (a GPU backend launches the step's graph here).
    fn step_end(&self) {}

    /// Brackets one forward pass of `sequences` sequences together (`runtime::session::step_together`, `n_tok`
    /// tokens in all), which is never recorded as a graph: a GPU's expert cache may decide such a step's experts
    /// on the device's slot table when it fits there (DESIGN.md section 3, "Expert cache"). The default ignores
    /// it.
    fn batch_step_begin(&self, _n_tok: usize, _sequences: usize) {}

    /// Ends the pass [`Backend::batch_step_begin`] began (its launches are queued).
    fn batch_step_end(&self) {}

    /// The forward pass is at layer `il` (`0` also at the start of a step, before the embeddings). A layer split
    /// ([`split`]) moves to the stage computing it, and answers `true` at the first layer of a stage after the
    /// first: the caller then sizes its scratch buffers again (on the new stage) and carries the residual stream
    /// into it ([`Backend::carry`]). Every other backend: `false`.
    fn enter_layer(&self, _il: usize) -> bool {
        false
    }

    /// After [`Backend::enter_layer`] answered `true`: the first `len` values of `buf` from the previous stage's
    /// copy into the current stage's (sized). Nothing on a backend that is not a split.
    fn carry(&self, _buf: &mut Self::Buf, _len: usize) {}

    /// After the [`Backend::carry`]s at a stage's first layer: the stage may begin its part of the step (a layer
    /// split begins the stage's step here, after the carried values arrived, so that the CUDA graph of the
    /// stage's launches reads them from its input buffers). Nothing on a backend that is not a split.
    fn carried(&self) {}

    /// Runs a whole decode step from a graph verified on earlier steps, when the backend has one for `key` and
    /// nothing it depends on changed since: `ids` and `positions` become its inputs and its logits land where the
    /// forward pass leaves them. Returns false (nothing done) otherwise; the caller then runs the forward pass,
    /// bracketed by [`Backend::step_begin`] / [`Backend::step_end`] (a GPU with an expert cache may have decided
    /// how the step routes already, and ends that decision there). The graph writes the KV cache and reads the scratch it was recorded with, which is why the key names the
    /// sequence: each sequence (its cache and scratch) replays only its own graphs.
    fn replay_step(&self, _key: StepKey, _ids: &[u32], _positions: &[u32]) -> bool {
        false
    }

    /// The experts the last MoE op ([`Backend::moe`], [`Backend::moe_add_rms_norm`]) chose for its `n_tok` tokens,
    /// `[n_tok][k]` (the router's top-k, in its order), into `out` (`--dump-routing`). The default reads the
    /// routing the CPU's op left in `scratch`; a GPU reads its own back (a round trip, so such a step is no graph).
    fn routed_experts(&self, scratch: &MoeScratch, n_tok: usize, k: usize, out: &mut Vec<u32>) {
        out.clear();
        out.extend_from_slice(&scratch.routing.ids[..n_tok * k]);
    }

    /// Forgets what the backend keeps for sequence `slot` (a GPU's copy of its KV cache, its recorded graphs):
    /// the sequence ended. The default keeps nothing.
    fn release_slot(&self, _slot: SeqSlot) {}

    /// Whether the backend keeps KV caches on a device (their blocks then come from a pool made with
    /// [`crate::state::kv::KvPool::on_device`]), not in the host rows (the CPU; the default).
    fn kv_on_device(&self) -> bool {
        false
    }

    /// Makes cells `from..to` of `kv` writable before a step that stores there without a forward pass on the host
    /// (a replayed decode step, [`Backend::replay_step`]): a device takes their blocks and updates its page table.
    /// A forward pass's stores do this themselves. The default (host caches, written as they are stored) does
    /// nothing.
    fn reserve_kv(&self, _kv: &KvCache, _from: usize, _to: usize) {}

    /// Hands the backend the injected faults and the `--gemm-fallback` policy. Returns whether the backend
    /// applies them itself (a GPU with a library GEMM and our own kernel behind it); otherwise the session
    /// applies them by capping its prefill batch (the CPU).
    fn set_fault_policy(&self, _faults: FaultPlan, _gemm_fallback: bool) -> bool {
        false
    }
}

/// [`Backend::attend_runs`] run by run, for `runs` of a step whose tokens are at `positions` (the whole step's): a
/// run that starts the step is given to [`Backend::attend`] as it is (rows `0..run.len` of the buffers); any other
/// has its rows copied into `tmp`, attended there and its output copied back.
#[allow(clippy::too_many_arguments)]
pub fn attend_runs_one_by_one<B: Backend + ?Sized>(
    be: &B,
    q: &mut B::Buf,
    k: &mut B::Buf,
    v: &B::Buf,
    kvs: &mut [&mut KvCache],
    layer: usize,
    runs: &[SeqRun],
    positions: &[u32],
    a: &AttnOp<'_>,
    out: &mut B::Buf,
    tmp: &mut RunBufs<B::Buf>,
) {
    let p = &a.params;
    let (wq, wk, wv, wo) = (
        p.n_head * p.head_dim,
        p.n_head_kv * p.head_dim,
        p.n_head_kv * p.head_dim_v,
        p.n_head * p.head_dim_v,
    );
    for run in runs {
        let kv = &mut kvs[run.seq].layers[layer];
        let pos = &positions[run.tokens()];
        if run.start == 0 {
            be.attend(q, k, v, kv, pos, a, out);
            continue;
        }
        let (t0, n) = (run.start, run.len);
        for (buf, w) in [(&mut tmp.q, wq), (&mut tmp.k, wk), (&mut tmp.v, wv), (&mut tmp.att, wo)] {
            be.reserve(buf, n * w);
        }
        be.copy(q, t0 * wq, &mut tmp.q, 0, n * wq);
        be.copy(k, t0 * wk, &mut tmp.k, 0, n * wk);
        be.copy(v, t0 * wv, &mut tmp.v, 0, n * wv);
        be.attend(&mut tmp.q, &mut tmp.k, &tmp.v, kv, pos, a, &mut tmp.att);
        be.copy(&tmp.att, 0, out, t0 * wo, n * wo);
    }
}

/// [`Backend::moe_add_rms_norm`] as its separate steps: [`Backend::matmul`] of the router, [`Backend::moe`] into
/// `tmp`, then [`Backend::add_rms_norm_into`] (or [`Backend::add`] without a norm).
#[allow(clippy::too_many_arguments)]
pub fn moe_add_rms_norm_steps<B: Backend + ?Sized>(
    be: &B,
    router: &QMat<'_>,
    ex: &Experts<'_>,
    logits: &mut B::Buf,
    h: &mut B::Buf,
    n_tok: usize,
    k: usize,
    normalize: bool,
    tmp: &mut B::Buf,
    x: &mut B::Buf,
    norm: Option<&[f32]>,
    eps: f32,
    scratch: &mut MoeScratch,
) {
    be.matmul(router, h, n_tok, logits);
    be.moe(ex, logits, h, n_tok, k, normalize, tmp, scratch);
    match norm {
        Some(w) => be.add_rms_norm_into(x, tmp, h, n_tok, w, eps),
        None => be.add(x, tmp, n_tok * ex.gate.cols),
    }
}
