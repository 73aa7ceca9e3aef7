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
//!   position `p` (see [`crate::runtime::kv`]).

pub mod cpu;
pub mod cuda;

pub use cuda::select::{AnyBackend, Device};

use crate::gguf::{GgufModel, TensorInfo};
use crate::quant::activations::ActivationFormat;
use crate::quant::{self, DotFn, DotQ8Fn, GgmlType, QuantError};
use crate::runtime::kv::KvLayer;

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
    /// The activation format `dot_q8` takes; [`ActivationFormat::F32`] for float weights, which use `dot`.
    pub act: ActivationFormat,
}

impl<'a> QMat<'a> {
    /// A view of `data` as `rows × cols` weights of `ty`.
    ///
    /// Errors: `ty` has no dot product, `cols` is not whole blocks, or `data` is not exactly the matrix.
    pub fn new(ty: GgmlType, data: &'a [u8], rows: usize, cols: usize) -> Result<QMat<'a>, QuantError> {
        let dot = quant::dot_fn(ty)?;
        let dot_q8 = quant::dot_q8_fn(ty)?;
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
            act,
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
}

impl MatRef {
    /// The zero-copy view of this matrix in `gguf`.
    ///
    /// Panics if `gguf` is not the model the reference was built from (the loader checked every matrix).
    #[inline]
    pub fn view<'a>(&self, gguf: &'a GgufModel) -> QMat<'a> {
        QMat::new(self.info.ty, gguf.tensor_data(&self.info), self.rows, self.cols)
            .expect("matrix checked at load time")
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
}

/// The router's choice for a batch: `ids[t * k + i]` is token t's i-th expert, `weights` its weight.
#[derive(Debug, Default, Clone)]
pub struct Routing {
    pub k: usize,
    pub ids: Vec<u32>,
    pub weights: Vec<f32>,
    /// The weights were renormalised to sum 1 per token. Expert dispatch then divides by their exact sum,
    /// which removes the f32 rounding of the normalisation: identical experts give exactly one expert's output.
    pub normalized: bool,
}

/// Reusable buffers for [`Backend::moe_ffn`], grown on demand and kept between calls.
#[derive(Debug, Default)]
pub struct MoeScratch {
    /// Routing slots (`t * k + i`) of the tokens sent to the current expert.
    pub tokens: Vec<u32>,
    /// Weighted sum of the expert outputs, `[n_tok][n_embd]`, in f64.
    pub acc: Vec<f64>,
    pub x: Vec<f32>,
    pub gate: Vec<f32>,
    pub up: Vec<f32>,
    pub down: Vec<f32>,
}

/// The operations of a forward pass. Shapes are in each method's doc; every method panics on inconsistent
/// lengths (a bug in the caller, which sizes everything from the hyper-parameters checked at load).
pub trait Backend: Send + Sync {
    /// A short name for logs (`cpu`).
    fn name(&self) -> &'static str;

    /// `out[t][r] = Σ_c W[r][c] · x[t][c]` for `n_tok` tokens: `x` is `[n_tok][w.cols]`, `out` `[n_tok][w.rows]`.
    fn matmul(&self, w: &QMat<'_>, x: &[f32], n_tok: usize, out: &mut [f32]);

    /// `outs[i] = ws[i] · x` for every i, each as [`Backend::matmul`] computes it (`x` is `[n_tok][cols]` for
    /// every matrix; `outs[i]` is `[n_tok][ws[i].rows]`). A backend may share work among matrices that read the
    /// same activations (a layer's q/k/v, its gate/up); the default runs them one after another.
    fn matmul_many(&self, ws: &[QMat<'_>], x: &[f32], n_tok: usize, outs: &mut [&mut [f32]]) {
        matmul_each(self, ws, x, n_tok, outs);
    }

    /// RMSNorm of each row of width `w.len()`, in place: `x = x / sqrt(mean(x²) + eps) * w` (ggml's
    /// `rms_norm` then `mul`). `x` is `[rows][w.len()]`; per-head q/k-norm is the same call with `w` of
    /// width `head_dim`.
    fn rms_norm(&self, x: &mut [f32], w: &[f32], eps: f32);

    /// Rotates each head of each token in place: `x` is `[positions.len()][n_head][head_dim]`.
    fn rope(&self, x: &mut [f32], n_head: usize, head_dim: usize, positions: &[u32], p: &RopeParams);

    /// Multiplies every element by `s`.
    fn scale(&self, x: &mut [f32], s: f32);

    /// `x += y`.
    fn add(&self, x: &mut [f32], y: &[f32]);

    /// Writes the keys and values of tokens at `positions` into `kv`: `k` is `[n_tok][n_head_kv * head_dim]`,
    /// `v` `[n_tok][n_head_kv * head_dim_v]`.
    fn store_kv(&self, kv: &mut KvLayer, k: &[f32], v: &[f32], positions: &[u32]);

    /// Causal attention with GQA over the cache: query head `h` uses KV head `h / (n_head / n_head_kv)`; the
    /// query at `positions[t]` attends to cells `max(0, p - window + 1)..=p`. `q` is `[n_tok][n_head][head_dim]`,
    /// `out` `[n_tok][n_head][head_dim_v]`. The cache must already hold every attended cell.
    fn attention(&self, q: &[f32], kv: &KvLayer, positions: &[u32], p: &AttnParams, out: &mut [f32]);

    /// `gate = act(gate) * up`, element-wise.
    fn glu(&self, gate: &mut [f32], up: &[f32], act: GluKind);

    /// Softmax of each row of width `width`, in place.
    fn softmax(&self, x: &mut [f32], width: usize);

    /// Router: `logits` is `[n_tok][n_expert]`; per token, softmax over all experts, the `k` largest
    /// probabilities (ties to the lower id), renormalised to sum 1 when `normalize` (llama.cpp's
    /// `build_moe_ffn` with softmax gating and `norm_w`). Fills `out` for `n_tok` tokens.
    fn route(&self, logits: &mut [f32], n_expert: usize, k: usize, normalize: bool, out: &mut Routing);

    /// Expert dispatch: `out[t] = Σ_i weights[t,i] · down_e(act(gate_e(x[t])) * up_e(x[t]))` over token t's
    /// chosen experts `e` (divided by `Σ_i weights[t,i]` when `routing.normalized`), summed in f64. `x` and
    /// `out` are `[n_tok][n_embd]`.
    fn moe_ffn(&self, ex: &Experts<'_>, x: &[f32], routing: &Routing, out: &mut [f32], scratch: &mut MoeScratch);
}

/// [`Backend::matmul_many`] as separate [`Backend::matmul`] calls (its default, and a backend's fallback).
pub fn matmul_each<B: Backend + ?Sized>(be: &B, ws: &[QMat<'_>], x: &[f32], n_tok: usize, outs: &mut [&mut [f32]]) {
    assert_eq!(ws.len(), outs.len(), "matmul_many: one output per matrix");
    for (w, o) in ws.iter().zip(outs.iter_mut()) {
        be.matmul(w, x, n_tok, o);
    }
}
