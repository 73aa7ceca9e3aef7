//! Block quantization formats: layout, dequantize, dot products (CPU reference and SIMD), quantize.
//!
//! A quantized row of `n` weights of type `ty` is `n / block_elems` blocks of `block_bytes` bytes each (see
//! [`GgmlType::geometry`]); the block layouts are the structs in [`blocks`]. Everything here works on such rows
//! as `&[u8]` (any alignment) and on f32 activations.
//!
//! | entry | what | errors |
//! |---|---|---|
//! | [`dequantize`] | row bytes to f32, bit-exact with ggml / PyPI `gguf` | [`QuantError`] |
//! | [`vec_dot`] | `Σ w[i] * x[i]` for one quantized row, SIMD when the CPU has it | [`QuantError`] |
//! | [`dot_fn`] | the [`DotFn`] behind `vec_dot`, chosen once, for the matmul's per-row loop | unsupported type |
//! | [`reference::vec_dot`] | the plain dot product every SIMD path is tested against | [`QuantError`] |
//! | [`QuantizedActivations`] | activations quantized once per matmul for a weight type (int8 path) | [`QuantError`] |
//! | [`dot_q8_fn`] / [`vec_dot_q8`] | `Σ w[i] * x̂[i]` with int8 activations, integer arithmetic per block | [`QuantError`] |
//! | [`reference::dot_q8_fn`] | the plain integer kernels the AVX2 ones are tested against | unsupported type |
//! | [`quantize`] | f32 to row bytes (bit-exact with `gguf.quants.quantize` where that exists) | [`QuantError`] |
//!
//! Types: dequantize and dot support F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K,
//! Q6_K, Q8_K, IQ4_NL, IQ4_XS, IQ3_S and IQ2_XS. Quantize supports F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1
//! (bit-exact with `gguf`), and Q2_K, Q3_K, Q4_K, Q5_K, Q6_K (ggml's per-sub-block scale search, reimplemented;
//! not bit-exact with llama-quantize, see [`quantize`]).
//!
//! SIMD: on x86_64 with AVX2, FMA and F16C (checked at run time), every dot type except Q8_K has an AVX2 kernel
//! on both paths (modules `avx2` and `avx2_int8`); Q8_K (an activation format, never a weight) uses the
//! reference. Other CPUs use the references.
//!
//! # Which dot product a matmul should use
//!
//! The int8 path, as ggml does: per matrix, `dot_q8_fn(w.ty)`; per activation matrix (all tokens at once),
//! `QuantizedActivations::quantize(w.ty, x, cols)` into a buffer the caller keeps; per output,
//! `dot(row, &xq.vector(t))`. Quantizing costs about 2 µs per 4096 values on one core, once per activation
//! vector and weight *format* (every matrix whose type shares an [`ActivationFormat`] can share the buffer:
//! Q4_K and Q6_K both take Q8_K). The integer kernels read 4-bit weights 1.3x to 3x faster than the
//! f32-activation ones (`engine/benches/quant_dot.rs`); for F32, F16, BF16 the int8 path *is* the f32 path.
//!
//! ```
//! # use strata_engine::quant::{self, GgmlType, QuantizedActivations};
//! # let (ty, cols, rows, n_tok) = (GgmlType::Q4_0, 64, 3, 2);
//! # let w = vec![0u8; rows * 36]; let x = vec![0.5f32; n_tok * cols]; let mut out = vec![0f32; n_tok * rows];
//! let dot = quant::dot_q8_fn(ty)?; // once per matrix
//! let mut xq = QuantizedActivations::new(); // kept across matmuls: no allocation once grown
//! xq.quantize(ty, &x, cols)?; // once per activation matrix
//! for t in 0..n_tok {
//!     let v = xq.vector(t);
//!     for (r, row) in w.chunks_exact(ty.row_bytes(cols as u64).unwrap() as usize).enumerate() {
//!         out[t * rows + r] = dot(row, &v);
//!     }
//! }
//! # Ok::<(), quant::QuantError>(())
//! ```
//!
//! Numerics. The f32 path computes `Σ w[i] x[i]` up to f32 summation order (`|simd - reference| <= 1e-5 Σ|w x|`
//! in the tests). The int8 path computes `Σ w[i] x̂[i]` exactly in integers per block, where `x̂` is `x` rounded
//! to 8 bits per block (`|x - x̂| <= amax_block / 254`); the SIMD kernels match the reference within
//! `1e-5 Σ|w x̂|` (f32 rounding of the block terms only) and the quantizer is bit-exact between SIMD and plain.
//! Against the exact `Σ w x` (f64, unquantized activations) the int8 path errs by at most, over 64 rows of
//! 4096 (test `int8_dot_error_against_exact_f32_activations`, as a fraction of `Σ|w x|`):
//!
//! | activations | gaussian x | gaussian x with 1% outliers of 20σ | asserted bound |
//! |---|---|---|---|
//! | Q8_1 (32-value blocks: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL) | 3.2e-4 .. 4.1e-4 | 1.4e-3 .. 1.5e-3 | 4e-3 |
//! | Q8_K (256-value blocks: K and IQ types) | 3.2e-4 .. 5.8e-4 | 3.3e-3 .. 4.6e-3 | 1.2e-2 |
//!
//! That is far below the weights' own quantization error (Q4 round trip ≈ 8e-2 rms), and it is the error
//! llama.cpp makes too: ggml's CPU matmul quantizes activations to the same formats with the same rounding
//! (differences: ggml keeps the activation scale as f16 and maps Q8_K's signed maximum to -128; see
//! [`activations`]), so the int8 path moves our logits *toward* llama.cpp's, not away.

mod activation_codes;
pub mod activations;
pub mod blocks;
mod int8;
pub mod iq_tables;
pub mod packed;
pub mod quantize;
pub mod reference;
pub mod types;

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx2_int8;
#[cfg(target_arch = "x86_64")]
mod avx2_packed;

pub use activations::{ActivationFormat, ActivationVector, QuantizedActivations};
pub use types::{Geometry, GgmlType, QK_K};

use blocks::*;

/// A dot-product kernel for one quant type: `row` holds whole blocks, `x` one f32 per weight of the row, and the
/// result is `Σ dequantize(row)[i] * x[i]`.
///
/// A `DotFn` does not validate lengths (the matmul checks them once per matrix with [`check_dot`]). With
/// inconsistent lengths it uses only the blocks covered by both slices, so the sum is wrong but the call never
/// panics or reads out of bounds.
pub type DotFn = fn(row: &[u8], x: &[f32]) -> f32;

/// An integer dot-product kernel for one weight type: `row` holds whole blocks, `x` the activations quantized
/// for that type ([`QuantizedActivations`]), and the result is `Σ dequantize(row)[i] * x̂[i]` where `x̂` is the
/// activations as quantized (for F32, F16 and BF16 weights, the f32 [`DotFn`]).
///
/// Like [`DotFn`] it does not validate (see [`check_dot_q8`]): with inconsistent lengths it uses only the blocks
/// both sides cover; with activations in another format than the type's it returns NaN. Never panics or reads
/// out of bounds.
pub type DotQ8Fn = fn(row: &[u8], x: &ActivationVector<'_>) -> f32;

/// A [`DotQ8Fn`] for several tokens at once: `out[t]` is `row`'s dot product with `xs[t]`, **bit for bit** what
/// the type's [`DotQ8Fn`] gives for that vector alone (the same float operations in the same order), while each
/// block of `row` is unpacked once for up to 4 tokens. What makes a matmul of several tokens cheaper per token
/// than one of a single token without a token's result depending on the others.
///
/// The bits equal the one-token call's when every vector of `xs` is in the type's format with one value per weight
/// of `row` (as a matmul quantizes them). Otherwise, as [`DotQ8Fn`], it never panics or reads out of bounds but the
/// sums are wrong: every token covers only the blocks the shortest vector has, and a vector in another format
/// makes the whole call NaN. Panics if `out` and `xs` differ in length.
pub type DotQ8ManyFn = fn(row: &[u8], xs: &[ActivationVector<'_>], out: &mut [f32]);

/// A quantizer for one type: whole blocks of f32 in, exactly the matching bytes out (lengths checked by
/// [`quantize`]).
pub(crate) type QuantizeFn = fn(src: &[f32], dst: &mut [u8]);

/// An error from a quant entry point. Every message names the ggml type.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum QuantError {
    /// `op` (dequantize, vec_dot or quantize) has no implementation for `ty`.
    #[error("{op} is not implemented for {ty} tensors")]
    Unsupported { ty: GgmlType, op: &'static str },
    /// A byte or element count is not a whole number of `ty` blocks.
    #[error("{ty} {op}: {what} of {len} is not a whole number of {ty} blocks of {block}")]
    NotWholeBlocks {
        ty: GgmlType,
        op: &'static str,
        what: &'static str,
        len: usize,
        block: usize,
    },
    /// Activations quantized for another weight type than the row's.
    #[error("{ty} {op}: activations are {actual}, {ty} weights multiply {expected} activations")]
    ActivationFormat {
        ty: GgmlType,
        op: &'static str,
        expected: ActivationFormat,
        actual: ActivationFormat,
    },
    /// The two sides of a call disagree on the number of weights.
    #[error("{ty} {op}: {what} has length {actual}, expected {expected} for the given {ty} data")]
    LengthMismatch {
        ty: GgmlType,
        op: &'static str,
        what: &'static str,
        expected: usize,
        actual: usize,
    },
}

/// Dequantize a row (or several rows) of `ty`: `src` is whole blocks, `dst` receives
/// `src.len() / block_bytes * block_elems` f32 values.
///
/// Bit-exact with ggml's `dequantize_row_*` (`ggml-quants.c`) and with PyPI `gguf`'s `gguf.quants.dequantize`
/// (checked against committed goldens in `engine/tests/formats/quant_goldens.rs`).
///
/// Errors: [`QuantError::NotWholeBlocks`] when `src` is not whole blocks, [`QuantError::LengthMismatch`] when
/// `dst` has a different length, [`QuantError::Unsupported`] for types without a dequantizer.
pub fn dequantize(ty: GgmlType, src: &[u8], dst: &mut [f32]) -> Result<(), QuantError> {
    const OP: &str = "dequantize";
    let k = kernels(ty, OP)?;
    let n = elems_of_bytes(ty, OP, "source bytes", src.len())?;
    check_len(ty, OP, "destination", n, dst.len())?;
    (k.dequantize)(src, dst);
    Ok(())
}

/// Dot product of one quantized row with an f32 vector: `Σ dequantize(row)[i] * x[i]`, summed in f32 (the
/// result of the AVX2 path when available, else [`reference::vec_dot`]).
///
/// `row`: whole blocks of `ty`; `x`: exactly `row.len() / block_bytes * block_elems` values.
///
/// Errors: [`QuantError::NotWholeBlocks`], [`QuantError::LengthMismatch`] (`x`), [`QuantError::Unsupported`].
pub fn vec_dot(ty: GgmlType, row: &[u8], x: &[f32]) -> Result<f32, QuantError> {
    check_dot(ty, row, x)?;
    Ok((dot_fn(ty)?)(row, x))
}

/// The fastest [`DotFn`] for `ty` on this CPU (AVX2+FMA+F16C when detected, else the reference). Call it once
/// per matrix and the result per row.
///
/// Errors: [`QuantError::Unsupported`].
pub fn dot_fn(ty: GgmlType) -> Result<DotFn, QuantError> {
    let k = kernels(ty, "vec_dot")?;
    Ok(match k.dot_simd {
        Some(f) if simd_available() => f,
        _ => k.dot_reference,
    })
}

/// Checks that `row` is whole blocks of `ty` and that `x` has one value per weight: the validation
/// [`vec_dot`] does, for callers that hold a [`DotFn`].
pub fn check_dot(ty: GgmlType, row: &[u8], x: &[f32]) -> Result<(), QuantError> {
    const OP: &str = "vec_dot";
    let n = elems_of_bytes(ty, OP, "row bytes", row.len())?;
    check_len(ty, OP, "activation vector", n, x.len())
}

/// The activation format weight type `ty` multiplies with on the int8 path (ggml's `vec_dot_type`): Q8_1 for
/// Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and IQ4_NL; Q8_K for Q2_K..Q6_K, IQ4_XS, IQ3_S and IQ2_XS; F32 for F32, F16,
/// BF16 and Q8_K.
///
/// Errors: [`QuantError::Unsupported`].
pub fn activation_format(ty: GgmlType) -> Result<ActivationFormat, QuantError> {
    Ok(kernels(ty, "vec_dot_q8")?.activations)
}

/// Quantize one activation vector `x` for weights of type `ty` (a new buffer; a matmul keeps one
/// [`QuantizedActivations`] and calls [`QuantizedActivations::quantize`] instead).
///
/// Errors: as [`QuantizedActivations::quantize`].
pub fn quantize_activations(ty: GgmlType, x: &[f32]) -> Result<QuantizedActivations, QuantError> {
    let mut q = QuantizedActivations::new();
    q.quantize(ty, x, x.len())?;
    Ok(q)
}

/// Dot product of one quantized row with activations quantized for its type: `Σ dequantize(row)[i] * x̂[i]`
/// (integer arithmetic inside each block, see [`DotQ8Fn`]).
///
/// Errors: [`QuantError::NotWholeBlocks`], [`QuantError::ActivationFormat`], [`QuantError::LengthMismatch`],
/// [`QuantError::Unsupported`].
pub fn vec_dot_q8(ty: GgmlType, row: &[u8], x: &ActivationVector<'_>) -> Result<f32, QuantError> {
    check_dot_q8(ty, row, x)?;
    Ok((dot_q8_fn(ty)?)(row, x))
}

/// The fastest [`DotQ8Fn`] for weights of type `ty` on this CPU (AVX2 where this module has a kernel and the CPU
/// has AVX2+FMA+F16C, else the plain integer reference). Call it once per matrix and the result per row.
///
/// Errors: [`QuantError::Unsupported`].
pub fn dot_q8_fn(ty: GgmlType) -> Result<DotQ8Fn, QuantError> {
    let k = kernels(ty, "vec_dot_q8")?;
    Ok(match k.dot_q8_simd {
        Some(f) if simd_available() => f,
        _ => k.dot_q8_reference,
    })
}

/// The [`DotQ8ManyFn`] for weights of type `ty` on this CPU: `Some` where the CPU has AVX2+FMA+F16C and this
/// module has a several-token kernel for `ty` (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL, Q4_K, Q5_K, Q6_K), else
/// `None`: call [`dot_q8_fn`]'s kernel once per token instead, which gives the same bits.
pub fn dot_q8_many_fn(ty: GgmlType) -> Option<DotQ8ManyFn> {
    let k = kernels(ty, "vec_dot_q8").ok()?;
    k.dot_q8_many_simd.filter(|_| simd_available())
}

/// Checks that `row` is whole blocks of `ty`, that `x` is in `ty`'s activation format and that it has one value
/// per weight: the validation [`vec_dot_q8`] does, for callers that hold a [`DotQ8Fn`].
pub fn check_dot_q8(ty: GgmlType, row: &[u8], x: &ActivationVector<'_>) -> Result<(), QuantError> {
    const OP: &str = "vec_dot_q8";
    let expected = activation_format(ty)?;
    if x.format() != expected {
        return Err(QuantError::ActivationFormat {
            ty,
            op: OP,
            expected,
            actual: x.format(),
        });
    }
    let n = elems_of_bytes(ty, OP, "row bytes", row.len())?;
    check_len(ty, OP, "activation vector", n, x.len())
}

/// Whether the AVX2 kernels run on this CPU (x86_64 with AVX2, FMA and F16C).
pub fn simd_available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// The types [`dequantize`] and [`vec_dot`] support, in id order: read from the kernel table, so a type added
/// there is listed (and tested) everywhere at once.
pub fn dot_types() -> Vec<GgmlType> {
    GgmlType::ALL.iter().copied().filter(|&t| can_dequantize(t)).collect()
}

/// The types [`quantize`] supports, in id order (from the kernel table).
pub fn quantize_types() -> Vec<GgmlType> {
    GgmlType::ALL.iter().copied().filter(|&t| can_quantize(t)).collect()
}

/// The types whose [`vec_dot_q8`] multiplies int8-quantized activations (the float types and Q8_K keep f32
/// activations), in id order (from the kernel table).
pub fn int8_types() -> Vec<GgmlType> {
    GgmlType::ALL
        .iter()
        .copied()
        .filter(|&t| activation_format(t).is_ok_and(|a| a != ActivationFormat::F32))
        .collect()
}

/// Whether [`quantize`] supports `ty`.
pub fn can_quantize(ty: GgmlType) -> bool {
    kernels(ty, "quantize").is_ok_and(|k| k.quantize.is_some())
}

/// Whether [`dequantize`] and [`vec_dot`] support `ty`.
pub fn can_dequantize(ty: GgmlType) -> bool {
    kernels(ty, "dequantize").is_ok()
}

/// Quantize f32 values to `ty`: `src` is whole blocks of elements (a multiple of `block_elems`), `dst` receives
/// exactly `src.len() / block_elems * block_bytes` bytes. Rows are independent, so callers parallelize by row.
///
/// Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, BF16 and F16 are bit-exact with PyPI `gguf`'s `gguf.quants.quantize` (and
/// ggml's `quantize_row_*_ref`). Q2_K..Q6_K follow ggml's reference quantizers (`quantize_row_q4_K_ref` and
/// friends: a weighted least-squares search of each sub-block's scale and min, then 6- or 4-bit super-block
/// scales); see [`quantize`](mod@quantize) for the error each reaches.
///
/// Errors: [`QuantError::NotWholeBlocks`] when `src.len()` is not a multiple of `block_elems`,
/// [`QuantError::LengthMismatch`] for `dst`, [`QuantError::Unsupported`] for types without a quantizer.
pub fn quantize(ty: GgmlType, src: &[f32], dst: &mut [u8]) -> Result<(), QuantError> {
    const OP: &str = "quantize";
    let f = kernels(ty, OP)?
        .quantize
        .ok_or(QuantError::Unsupported { ty, op: OP })?;
    let g = ty.geometry();
    if !src.len().is_multiple_of(g.block_elems) {
        return Err(QuantError::NotWholeBlocks {
            ty,
            op: OP,
            what: "source elements",
            len: src.len(),
            block: g.block_elems,
        });
    }
    check_len(
        ty,
        OP,
        "destination",
        src.len() / g.block_elems * g.block_bytes,
        dst.len(),
    )?;
    f(src, dst);
    Ok(())
}

/// Per-type kernels, the one table of what each type supports. Each function takes whole blocks with lengths
/// already checked.
pub(crate) struct Kernels {
    pub dequantize: fn(&[u8], &mut [f32]),
    pub dot_reference: DotFn,
    /// AVX2+FMA+F16C kernel; call only when [`simd_available`].
    pub dot_simd: Option<DotFn>,
    pub quantize: Option<QuantizeFn>,
    /// The int8 path: the activation format, the plain kernel and the AVX2 one (call only when
    /// [`simd_available`]).
    pub activations: ActivationFormat,
    pub dot_q8_reference: DotQ8Fn,
    pub dot_q8_simd: Option<DotQ8Fn>,
    /// The AVX2 kernel for several tokens at once, where there is one (call only when [`simd_available`]).
    pub dot_q8_many_simd: Option<DotQ8ManyFn>,
}

impl Kernels {
    fn int8(self, activations: ActivationFormat, reference: DotQ8Fn, simd: Option<DotQ8Fn>) -> Kernels {
        Kernels {
            activations,
            dot_q8_reference: reference,
            dot_q8_simd: simd,
            ..self
        }
    }

    /// Adds the several-token kernel.
    fn many(self, many: Option<DotQ8ManyFn>) -> Kernels {
        Kernels {
            dot_q8_many_simd: many,
            ..self
        }
    }
}

macro_rules! simd {
    ($name:ident) => {
        simd!(avx2, DotFn, $name)
    };
    ($module:ident, $fn_ty:ty, $name:ident) => {{
        #[cfg(target_arch = "x86_64")]
        let f: Option<$fn_ty> = Some($module::$name);
        #[cfg(not(target_arch = "x86_64"))]
        let f: Option<$fn_ty> = None;
        f
    }};
}

/// The AVX2 [`DotQ8Fn`] named `$name` in `avx2_int8`.
macro_rules! simd8 {
    ($name:ident) => {
        simd!(avx2_int8, DotQ8Fn, $name)
    };
}

/// The AVX2 [`DotQ8ManyFn`] named `$name` in `avx2_int8`.
macro_rules! many8 {
    ($name:ident) => {
        simd!(avx2_int8, DotQ8ManyFn, $name)
    };
}

/// The AVX2 kernel `$name` of type `$fn_ty` in `avx2_int8` that has a VNNI form: that form where
/// `avx2_int8::vnni_available()`.
macro_rules! vnni {
    ($fn_ty:ty, $name:ident) => {{
        #[cfg(target_arch = "x86_64")]
        let f: Option<$fn_ty> = Some(match avx2_int8::vnni_available() {
            true => avx2_int8::$name::<true>,
            false => avx2_int8::$name::<false>,
        });
        #[cfg(not(target_arch = "x86_64"))]
        let f: Option<$fn_ty> = None;
        f
    }};
}

pub(crate) fn kernels(ty: GgmlType, op: &'static str) -> Result<Kernels, QuantError> {
    use ActivationFormat::{F32 as A_F32, Q8_1 as A_Q8_1, Q8_K as A_Q8_K};
    use GgmlType as T;
    use quantize as q;
    use reference as r;
    /// A block type's f32 kernels; the int8 columns start as the plain f32 path and `.int8(..)` sets them.
    fn blocks<B: r::Dequantize>(dot_simd: Option<DotFn>, quantize: Option<QuantizeFn>) -> Kernels {
        Kernels {
            dequantize: r::dequantize_blocks::<B>,
            dot_reference: r::dot_blocks::<B>,
            dot_simd,
            quantize,
            activations: A_F32,
            dot_q8_reference: int8::dot_q8_k,
            dot_q8_simd: None,
            dot_q8_many_simd: None,
        }
    }
    fn scalar(dequantize: fn(&[u8], &mut [f32]), dot_reference: DotFn, dot_simd: Option<DotFn>) -> Kernels {
        Kernels {
            dequantize,
            dot_reference,
            dot_simd,
            quantize: None,
            activations: A_F32,
            dot_q8_reference: int8::dot_f32,
            dot_q8_simd: None,
            dot_q8_many_simd: None,
        }
    }
    fn b32<B: int8::IntBlock32>() -> DotQ8Fn {
        int8::dot_blocks32::<B>
    }
    fn bk<B: int8::IntBlockK>() -> DotQ8Fn {
        int8::dot_blocks_k::<B>
    }
    Ok(match ty {
        T::F32 => Kernels {
            quantize: Some(q::quantize_f32),
            ..scalar(r::dequantize_f32, r::dot_f32, simd!(dot_f32))
        }
        .int8(A_F32, int8::dot_f32, simd8!(dot_f32)),
        T::F16 => Kernels {
            quantize: Some(q::quantize_f16),
            ..scalar(r::dequantize_f16, r::dot_f16, simd!(dot_f16))
        }
        .int8(A_F32, int8::dot_f16, simd8!(dot_f16)),
        T::BF16 => Kernels {
            quantize: Some(q::quantize_bf16),
            ..scalar(r::dequantize_bf16, r::dot_bf16, simd!(dot_bf16))
        }
        .int8(A_F32, int8::dot_bf16, simd8!(dot_bf16)),
        T::Q4_0 => blocks::<BlockQ4_0>(simd!(dot_q4_0), Some(q::quantize_q4_0))
            .int8(A_Q8_1, b32::<BlockQ4_0>(), vnni!(DotQ8Fn, dot_q4_0))
            .many(vnni!(DotQ8ManyFn, dot_q4_0_many)),
        T::Q4_1 => blocks::<BlockQ4_1>(simd!(dot_q4_1), Some(q::quantize_q4_1))
            .int8(A_Q8_1, b32::<BlockQ4_1>(), vnni!(DotQ8Fn, dot_q4_1))
            .many(vnni!(DotQ8ManyFn, dot_q4_1_many)),
        T::Q5_0 => blocks::<BlockQ5_0>(simd!(dot_q5_0), Some(q::quantize_q5_0))
            .int8(A_Q8_1, b32::<BlockQ5_0>(), vnni!(DotQ8Fn, dot_q5_0))
            .many(vnni!(DotQ8ManyFn, dot_q5_0_many)),
        T::Q5_1 => blocks::<BlockQ5_1>(simd!(dot_q5_1), Some(q::quantize_q5_1))
            .int8(A_Q8_1, b32::<BlockQ5_1>(), vnni!(DotQ8Fn, dot_q5_1))
            .many(vnni!(DotQ8ManyFn, dot_q5_1_many)),
        T::Q8_0 => blocks::<BlockQ8_0>(simd!(dot_q8_0), Some(q::quantize_q8_0))
            .int8(A_Q8_1, b32::<BlockQ8_0>(), vnni!(DotQ8Fn, dot_q8_0))
            .many(vnni!(DotQ8ManyFn, dot_q8_0_many)),
        T::Q2_K => {
            blocks::<BlockQ2K>(simd!(dot_q2_k), Some(q::quantize_q2_k)).int8(A_Q8_K, bk::<BlockQ2K>(), simd8!(dot_q2_k))
        }
        T::Q3_K => {
            blocks::<BlockQ3K>(simd!(dot_q3_k), Some(q::quantize_q3_k)).int8(A_Q8_K, bk::<BlockQ3K>(), simd8!(dot_q3_k))
        }
        T::Q4_K => blocks::<BlockQ4K>(simd!(dot_q4_k), Some(q::quantize_q4_k))
            .int8(A_Q8_K, bk::<BlockQ4K>(), simd8!(dot_q4_k))
            .many(many8!(dot_q4_k_many)),
        T::Q5_K => blocks::<BlockQ5K>(simd!(dot_q5_k), Some(q::quantize_q5_k))
            .int8(A_Q8_K, bk::<BlockQ5K>(), simd8!(dot_q5_k))
            .many(many8!(dot_q5_k_many)),
        T::Q6_K => blocks::<BlockQ6K>(simd!(dot_q6_k), Some(q::quantize_q6_k))
            .int8(A_Q8_K, bk::<BlockQ6K>(), simd8!(dot_q6_k))
            .many(many8!(dot_q6_k_many)),
        T::Q8_K => blocks::<BlockQ8K>(None, None),
        T::IQ4_NL => blocks::<BlockIQ4NL>(simd!(dot_iq4_nl), None)
            .int8(A_Q8_1, b32::<BlockIQ4NL>(), vnni!(DotQ8Fn, dot_iq4_nl))
            .many(vnni!(DotQ8ManyFn, dot_iq4_nl_many)),
        T::IQ4_XS => blocks::<BlockIQ4XS>(simd!(dot_iq4_xs), None).int8(A_Q8_K, bk::<BlockIQ4XS>(), simd8!(dot_iq4_xs)),
        T::IQ3_S => blocks::<BlockIQ3S>(simd!(dot_iq3_s), None).int8(A_Q8_K, bk::<BlockIQ3S>(), simd8!(dot_iq3_s)),
        T::IQ2_XS => blocks::<BlockIQ2XS>(simd!(dot_iq2_xs), None).int8(A_Q8_K, bk::<BlockIQ2XS>(), simd8!(dot_iq2_xs)),
        _ => return Err(QuantError::Unsupported { ty, op }),
    })
}

/// Elements held by `len` bytes of `ty`, or [`QuantError::NotWholeBlocks`].
fn elems_of_bytes(ty: GgmlType, op: &'static str, what: &'static str, len: usize) -> Result<usize, QuantError> {
    let g = ty.geometry();
    if !len.is_multiple_of(g.block_bytes) {
        return Err(QuantError::NotWholeBlocks {
            ty,
            op,
            what,
            len,
            block: g.block_bytes,
        });
    }
    Ok(len / g.block_bytes * g.block_elems)
}

fn check_len(
    ty: GgmlType,
    op: &'static str,
    what: &'static str,
    expected: usize,
    actual: usize,
) -> Result<(), QuantError> {
    if expected != actual {
        return Err(QuantError::LengthMismatch {
            ty,
            op,
            what,
            expected,
            actual,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests;
