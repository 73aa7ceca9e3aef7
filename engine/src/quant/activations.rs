//! Activations quantized to int8 once per matmul, the partner of the integer dot products
//! ([`super::dot_q8_fn`]).
//!
//! ggml multiplies a quantized weight row with activations that are themselves quantized (each weight type has a
//! `vec_dot_type` in ggml-cpu's type traits): 32-element blocks for the legacy types, 256-element `Q8_K` blocks
//! for the K and IQ super-block types, f32 for the float types. The weight codes times the activation codes then
//! sum in integers (AVX2 `vpmaddubsw` / `vpmaddwd`) and only one float multiply per block remains. This module
//! holds those activations: [`QuantizedActivations`] is a buffer the matmul owns and refills (no allocation once
//! it has grown to the largest matrix), [`ActivationVector`] one quantized vector of it.
//!
//! Codes (every format): per block of `B` values (32 or 256), `amax = max |x|`, `d = amax / 127` and
//! `q = round_ties_even(x * (127 / amax))`, so `q` is in -127..=127 and `x ≈ d * q` with `|x - d q| <= d / 2`.
//! Each block also keeps integer sums of its codes (`Σ q` per 32 values for [`ActivationFormat::Q8_1`], per 16
//! for [`ActivationFormat::Q8_K`]: ggml's `bsums`), which the kernels use for the weights' offsets and mins.
//! Blocks with `amax < 1e-30` (zero or denormal) quantize to `d = 0`, codes 0; a block holding NaN or ±inf gets
//! `d` NaN or inf and codes 0, so any dot product with it is NaN, as the f32 path would give.
//!
//! Storage matches ggml's where it rounds, because the CPU engine is held to llama.cpp's logits (a 135M model
//! moves by a KL divergence of 1e-3 when these roundings change): 32-value blocks store `d` rounded to f16
//! and, for Q8_1, `s = d Σq` computed from the unrounded `d` and rounded to f16 (`block_q8_1.s`, which Q4_1 and
//! Q5_1 multiply by their min), except where f16 would overflow; Q8_K keeps `d` in f32. Q8_0 and Q8_1 share one format here (Q8_0 ignores `s`).
//! One difference remains: ggml's `quantize_row_q8_K` scales by the block's signed maximum (`-127 / max`),
//! which negates codes and scale together and gives the same products.

use std::fmt;

use super::QuantError;
use super::activation_codes::quantize_codes;
use super::types::{GgmlType, QK_K};

/// How the activations of one weight type are stored for [`super::dot_q8_fn`] (ggml's `vec_dot_type`).
#[allow(non_camel_case_types)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ActivationFormat {
    /// Plain f32 (the partner of F32, F16, BF16 and Q8_K weights): the int8 path is the f32 [`super::DotFn`].
    F32,
    /// 32-value blocks with an f32 scale and `Σ q` per block: ggml's Q8_1 (and Q8_0, the same codes without the
    /// sum), for Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and IQ4_NL weights.
    Q8_1,
    /// 256-value blocks with an f32 scale and `Σ q` per 16 values: ggml's Q8_K, for Q2_K..Q6_K, IQ4_XS, IQ3_S
    /// and IQ2_XS weights.
    Q8_K,
}

impl ActivationFormat {
    /// Values per block (1 for f32) and values per code sum.
    pub(crate) const fn block_and_group(self) -> (usize, usize) {
        match self {
            ActivationFormat::F32 => (1, 1),
            ActivationFormat::Q8_1 => (32, 32),
            ActivationFormat::Q8_K => (QK_K, 16),
        }
    }
}

impl fmt::Display for ActivationFormat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ActivationFormat::F32 => "F32",
            ActivationFormat::Q8_1 => "Q8_1",
            ActivationFormat::Q8_K => "Q8_K",
        })
    }
}

/// One activation vector in the format of one weight type: what a [`super::DotQ8Fn`] multiplies a weight row
/// with. Borrowed from a [`QuantizedActivations`]; cheap to copy.
#[derive(Debug, Clone, Copy)]
pub struct ActivationVector<'a> {
    pub(crate) format: ActivationFormat,
    /// The values, for [`ActivationFormat::F32`]; empty otherwise.
    pub(crate) f32s: &'a [f32],
    /// One code per value (quantized formats).
    pub(crate) qs: &'a [i8],
    /// One scale per block.
    pub(crate) d: &'a [f32],
    /// `Σ q` per group (32 values for Q8_1, 16 for Q8_K).
    pub(crate) sums: &'a [i16],
    /// Q8_1 only, per block: `d Σq` rounded to f16 (ggml's `block_q8_1.s`, the partner of Q4_1's and Q5_1's
    /// min), computed with `d` before its own rounding.
    pub(crate) s: &'a [f32],
}

impl ActivationVector<'_> {
    /// The storage format.
    pub fn format(&self) -> ActivationFormat {
        self.format
    }

    /// Number of activation values.
    pub fn len(&self) -> usize {
        match self.format {
            ActivationFormat::F32 => self.f32s.len(),
            _ => self.qs.len(),
        }
    }

    /// Whether the vector has no values.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A buffer of activation vectors (one per token) quantized for one weight type, reused across matmuls.
///
/// [`QuantizedActivations::quantize`] refills it in place; its vectors stay valid until the next refill. Memory:
/// about 1.14 bytes per value (Q8_1), 1.14 (Q8_K) or 4 (F32).
#[derive(Debug, Clone)]
pub struct QuantizedActivations {
    format: ActivationFormat,
    ty: GgmlType,
    n: usize,
    count: usize,
    f32s: Vec<f32>,
    pub(crate) qs: Vec<i8>,
    pub(crate) d: Vec<f32>,
    pub(crate) sums: Vec<i16>,
    pub(crate) s: Vec<f32>,
}

impl Default for QuantizedActivations {
    fn default() -> Self {
        Self::new()
    }
}

impl QuantizedActivations {
    /// An empty buffer (no vectors).
    pub fn new() -> Self {
        QuantizedActivations {
            format: ActivationFormat::F32,
            ty: GgmlType::F32,
            n: 0,
            count: 0,
            f32s: Vec::new(),
            qs: Vec::new(),
            d: Vec::new(),
            sums: Vec::new(),
            s: Vec::new(),
        }
    }

    /// Quantize `x`, `x.len() / n` activation vectors of `n` values each (row-major: vector t is
    /// `x[t*n..(t+1)*n]`), into the format weight type `ty` multiplies with ([`super::activation_format`]).
    /// Replaces the previous contents; allocates only when the buffer must grow. AVX2 when available
    /// (bit-identical to the plain code).
    ///
    /// Errors: [`QuantError::Unsupported`] for types without a dot product, [`QuantError::NotWholeBlocks`] when
    /// `n` is not a whole number of `ty` blocks, [`QuantError::LengthMismatch`] when `x.len()` is not a multiple
    /// of `n` (or `n` is 0 and `x` is not empty).
    pub fn quantize(&mut self, ty: GgmlType, x: &[f32], n: usize) -> Result<(), QuantError> {
        self.quantize_with(ty, x, n, super::simd_available())
    }

    pub(crate) fn quantize_with(&mut self, ty: GgmlType, x: &[f32], n: usize, simd: bool) -> Result<(), QuantError> {
        const OP: &str = "quantize_activations";
        let format = super::activation_format(ty)?;
        let block_elems = ty.geometry().block_elems;
        if !n.is_multiple_of(block_elems) {
            return Err(QuantError::NotWholeBlocks {
                ty,
                op: OP,
                what: "activation vector length",
                len: n,
                block: block_elems,
            });
        }
        let count = x.len().checked_div(n).unwrap_or(0);
        if count * n != x.len() {
            return Err(QuantError::LengthMismatch {
                ty,
                op: OP,
                what: "activation matrix (whole vectors of the given length)",
                expected: count * n,
                actual: x.len(),
            });
        }
        self.format = format;
        self.ty = ty;
        self.n = n;
        self.count = count;
        let (block, group) = format.block_and_group();
        if format == ActivationFormat::F32 {
            self.f32s.clear();
            self.f32s.extend_from_slice(x);
            self.qs.clear();
            self.d.clear();
            self.sums.clear();
            self.s.clear();
            return Ok(());
        }
        self.f32s.clear();
        self.qs.resize(x.len(), 0);
        self.d.resize(x.len() / block, 0.0);
        self.sums.resize(x.len() / group, 0);
        quantize_codes(x, block, group, &mut self.qs, &mut self.d, &mut self.sums, simd);
        self.s.clear();
        if format == ActivationFormat::Q8_1 {
            // ggml's storage: `s = d Σq` and then `d` itself, each rounded to f16. Where ggml's f16 would overflow
            // to inf (activations beyond 65504 · 127), the f32 value stays: a finite result where ggml has none.
            let f16 = |v: f32| {
                let h = half::f16::from_f32(v).to_f32();
                if h.is_finite() || !v.is_finite() { h } else { v }
            };
            self.s
                .extend(self.d.iter().zip(&self.sums).map(|(&d, &q)| f16(d * q as f32)));
            self.d.iter_mut().for_each(|d| *d = f16(*d));
        }
        Ok(())
    }

    /// The format of the stored vectors.
    pub fn format(&self) -> ActivationFormat {
        self.format
    }

    /// The weight type the vectors were quantized for.
    pub fn weight_type(&self) -> GgmlType {
        self.ty
    }

    /// Values per vector.
    pub fn vector_len(&self) -> usize {
        self.n
    }

    /// Number of vectors.
    pub fn count(&self) -> usize {
        self.count
    }

    /// Vector `t` (`t < count()`; panics otherwise).
    pub fn vector(&self, t: usize) -> ActivationVector<'_> {
        assert!(t < self.count, "activation vector {t} of {}", self.count);
        let n = self.n;
        if self.format == ActivationFormat::F32 {
            return ActivationVector {
                format: self.format,
                f32s: &self.f32s[t * n..(t + 1) * n],
                qs: &[],
                d: &[],
                sums: &[],
                s: &[],
            };
        }
        let (block, group) = self.format.block_and_group();
        ActivationVector {
            format: self.format,
            f32s: &[],
            qs: &self.qs[t * n..(t + 1) * n],
            d: &self.d[t * n / block..(t + 1) * n / block],
            sums: &self.sums[t * n / group..(t + 1) * n / group],
            s: if self.s.is_empty() {
                &[]
            } else {
                &self.s[t * n / block..(t + 1) * n / block]
            },
        }
    }
}
