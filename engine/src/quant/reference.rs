//! Plain (non-SIMD) dequantize and dot product: the semantics every fast path is tested against.
//!
//! Dequantize is bit-exact with ggml's `dequantize_row_*` (ggml-quants.c) and PyPI `gguf`'s
//! `gguf.quants.dequantize`: each weight is computed with the same f32 operations in the same order (no fused
//! multiply-add), which `engine/tests/formats/quant_goldens.rs` checks bit for bit. The reference dot product is
//! `Σ dequantize(row)[i] * x[i]` summed in f32, block by block, in 8 interleaved partial sums.

use bytemuck::cast_slice;

use super::blocks::*;
use super::iq_tables::{IQ2XS_GRID, IQ3S_GRID, KSIGNS_IQ2XS, KVALUES_IQ4NL};
use super::types::{GgmlType, QK_K};
use super::{DotFn, QuantError};

/// Reference dot product of a quantized row of type `ty` (`row`: whole blocks, `row.len() / block_bytes *
/// block_elems` weights) with `x` (as many f32 as the row has weights). Same contract and errors as
/// [`super::vec_dot`]; never uses SIMD intrinsics.
pub fn vec_dot(ty: GgmlType, row: &[u8], x: &[f32]) -> Result<f32, QuantError> {
    super::check_dot(ty, row, x)?;
    Ok((dot_fn(ty)?)(row, x))
}

/// The reference [`DotFn`] for `ty` (see [`super::dot_fn`] for the contract), or
/// [`QuantError::Unsupported`].
pub fn dot_fn(ty: GgmlType) -> Result<DotFn, QuantError> {
    super::kernels(ty, "vec_dot").map(|k| k.dot_reference)
}

/// The plain integer [`super::DotQ8Fn`] for weights of type `ty` (module `int8`; see [`super::dot_q8_fn`]), or
/// [`QuantError::Unsupported`].
pub fn dot_q8_fn(ty: GgmlType) -> Result<super::DotQ8Fn, QuantError> {
    super::kernels(ty, "vec_dot_q8").map(|k| k.dot_q8_reference)
}

/// Dequantize one block into `out` (exactly `Self::ELEMS` values).
pub(crate) trait Dequantize: QuantBlock {
    fn dequantize(&self, out: &mut [f32]);
}

/// Dequantize whole blocks of `B`; `dst` must hold exactly `src.len() / size_of::<B>() * B::ELEMS` values
/// (checked by the caller).
pub(crate) fn dequantize_blocks<B: Dequantize>(src: &[u8], dst: &mut [f32]) {
    let blocks: &[B] = cast_slice(src);
    for (b, out) in blocks.iter().zip(dst.chunks_exact_mut(B::ELEMS)) {
        b.dequantize(out);
    }
}

/// Reference dot of whole blocks of `B` with `x`. Extra bytes or elements beyond the shorter of the two are
/// ignored, so a wrong length gives a wrong sum but never a panic or out-of-bounds read.
pub(crate) fn dot_blocks<B: Dequantize>(row: &[u8], x: &[f32]) -> f32 {
    let n_blocks = (row.len() / size_of::<B>()).min(x.len() / B::ELEMS);
    let blocks: &[B] = cast_slice(&row[..n_blocks * size_of::<B>()]);
    let mut w = [0f32; QK_K];
    let w = &mut w[..B::ELEMS];
    let mut sum = 0f32;
    for (b, xs) in blocks.iter().zip(x.chunks_exact(B::ELEMS)) {
        b.dequantize(w);
        sum += dot_f32_plain(w, xs);
    }
    sum
}

/// `Σ a[i] * b[i]` over the common length, in 8 interleaved f32 partial sums (a shape the compiler vectorizes
/// without changing the result from one build to the next).
pub(crate) fn dot_f32_plain(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let mut acc = [0f32; 8];
    let (a8, a_tail) = a.as_chunks::<8>();
    let (b8, b_tail) = b.as_chunks::<8>();
    for (ca, cb) in a8.iter().zip(b8) {
        for k in 0..8 {
            acc[k] += ca[k] * cb[k];
        }
    }
    let mut sum = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for (p, q) in a_tail.iter().zip(b_tail) {
        sum += p * q;
    }
    sum
}

// ---- scalar element types -------------------------------------------------------------------------------------

/// F32: the bytes as little-endian f32.
pub(crate) fn dequantize_f32(src: &[u8], dst: &mut [f32]) {
    for (s, d) in src.chunks_exact(4).zip(dst.iter_mut()) {
        *d = f32::from_le_bytes([s[0], s[1], s[2], s[3]]);
    }
}

/// F16 (`ggml_fp16_to_fp32`): exact widening.
pub(crate) fn dequantize_f16(src: &[u8], dst: &mut [f32]) {
    for (s, d) in src.chunks_exact(2).zip(dst.iter_mut()) {
        *d = F16Bits([s[0], s[1]]).to_f32();
    }
}

/// BF16 (`ggml_bf16_to_fp32`): the 16 bits become the top half of an f32.
pub(crate) fn dequantize_bf16(src: &[u8], dst: &mut [f32]) {
    for (s, d) in src.chunks_exact(2).zip(dst.iter_mut()) {
        *d = bf16_to_f32(u16::from_le_bytes([s[0], s[1]]));
    }
}

#[inline]
pub(crate) fn bf16_to_f32(bits: u16) -> f32 {
    f32::from_bits((bits as u32) << 16)
}

/// Reference dot for the scalar types: widen 256 elements at a time, then [`dot_f32_plain`].
fn dot_scalar(elem_bytes: usize, widen: fn(&[u8], &mut [f32]), row: &[u8], x: &[f32]) -> f32 {
    let n = (row.len() / elem_bytes).min(x.len());
    let mut w = [0f32; QK_K];
    let mut sum = 0f32;
    for (chunk, xs) in row[..n * elem_bytes].chunks(QK_K * elem_bytes).zip(x[..n].chunks(QK_K)) {
        let w = &mut w[..xs.len()];
        widen(chunk, w);
        sum += dot_f32_plain(w, xs);
    }
    sum
}

pub(crate) fn dot_f32(row: &[u8], x: &[f32]) -> f32 {
    dot_scalar(4, dequantize_f32, row, x)
}

pub(crate) fn dot_f16(row: &[u8], x: &[f32]) -> f32 {
    dot_scalar(2, dequantize_f16, row, x)
}

pub(crate) fn dot_bf16(row: &[u8], x: &[f32]) -> f32 {
    dot_scalar(2, dequantize_bf16, row, x)
}

// ---- legacy 32-element blocks ---------------------------------------------------------------------------------

/// `dequantize_row_q4_0`.
impl Dequantize for BlockQ4_0 {
    fn dequantize(&self, out: &mut [f32]) {
        let d = self.d.to_f32();
        for (j, &q) in self.qs.iter().enumerate() {
            out[j] = d * ((q & 0x0F) as i32 - 8) as f32;
            out[j + 16] = d * ((q >> 4) as i32 - 8) as f32;
        }
    }
}

/// `dequantize_row_q4_1`.
impl Dequantize for BlockQ4_1 {
    fn dequantize(&self, out: &mut [f32]) {
        let (d, m) = (self.d.to_f32(), self.m.to_f32());
        for (j, &q) in self.qs.iter().enumerate() {
            out[j] = d * (q & 0x0F) as f32 + m;
            out[j + 16] = d * (q >> 4) as f32 + m;
        }
    }
}

/// `dequantize_row_q5_0`.
impl Dequantize for BlockQ5_0 {
    fn dequantize(&self, out: &mut [f32]) {
        let d = self.d.to_f32();
        let qh = u32::from_le_bytes(self.qh);
        for (j, &q) in self.qs.iter().enumerate() {
            let lo = (q & 0x0F) as u32 | ((qh >> j) & 1) << 4;
            let hi = (q >> 4) as u32 | ((qh >> (j + 16)) & 1) << 4;
            out[j] = d * (lo as i32 - 16) as f32;
            out[j + 16] = d * (hi as i32 - 16) as f32;
        }
    }
}

/// `dequantize_row_q5_1`.
impl Dequantize for BlockQ5_1 {
    fn dequantize(&self, out: &mut [f32]) {
        let (d, m) = (self.d.to_f32(), self.m.to_f32());
        let qh = u32::from_le_bytes(self.qh);
        for (j, &q) in self.qs.iter().enumerate() {
            let lo = (q & 0x0F) as u32 | ((qh >> j) & 1) << 4;
            let hi = (q >> 4) as u32 | ((qh >> (j + 16)) & 1) << 4;
            out[j] = d * lo as f32 + m;
            out[j + 16] = d * hi as f32 + m;
        }
    }
}

/// `dequantize_row_q8_0`.
impl Dequantize for BlockQ8_0 {
    fn dequantize(&self, out: &mut [f32]) {
        let d = self.d.to_f32();
        for (o, &q) in out.iter_mut().zip(&self.qs) {
            *o = q as f32 * d;
        }
    }
}

/// `dequantize_row_iq4_nl`.
impl Dequantize for BlockIQ4NL {
    fn dequantize(&self, out: &mut [f32]) {
        let d = self.d.to_f32();
        for (j, &q) in self.qs.iter().enumerate() {
            out[j] = d * KVALUES_IQ4NL[(q & 0x0F) as usize] as f32;
            out[j + 16] = d * KVALUES_IQ4NL[(q >> 4) as usize] as f32;
        }
    }
}

// ---- K quants ---------------------------------------------------------------------------------------------------

/// `dequantize_row_q2_K`.
impl Dequantize for BlockQ2K {
    fn dequantize(&self, out: &mut [f32]) {
        let (d, dmin) = (self.d.to_f32(), self.dmin.to_f32());
        for h in 0..2 {
            for s in 0..4 {
                for l in 0..32 {
                    let e = 128 * h + 32 * s + l;
                    let sc = self.scales[e / 16];
                    let dl = d * (sc & 0x0F) as f32;
                    let ml = dmin * (sc >> 4) as f32;
                    let q = (self.qs[32 * h + l] >> (2 * s)) & 3;
                    out[e] = dl * q as f32 - ml;
                }
            }
        }
    }
}

/// `dequantize_row_q3_K`.
impl Dequantize for BlockQ3K {
    fn dequantize(&self, out: &mut [f32]) {
        let d = self.d.to_f32();
        let scales = scales_q3k(&self.scales);
        for h in 0..2 {
            for s in 0..4 {
                for l in 0..32 {
                    let e = 128 * h + 32 * s + l;
                    let dl = d * (scales[e / 16] as i32 - 32) as f32;
                    let lo = ((self.qs[32 * h + l] >> (2 * s)) & 3) as i32;
                    let high_set = (self.hmask[l] >> (4 * h + s)) & 1 != 0;
                    let q = if high_set { lo } else { lo - 4 };
                    out[e] = dl * q as f32;
                }
            }
        }
    }
}

/// `dequantize_row_q4_K`.
impl Dequantize for BlockQ4K {
    fn dequantize(&self, out: &mut [f32]) {
        let (d, dmin) = (self.d.to_f32(), self.dmin.to_f32());
        for j in 0..8 {
            let (sc, m) = scale_min_k4(&self.scales, j);
            let (d1, m1) = (d * sc as f32, dmin * m as f32);
            let qs = &self.qs[32 * (j / 2)..32 * (j / 2) + 32];
            let shift = 4 * (j % 2);
            for (l, &q) in qs.iter().enumerate() {
                out[32 * j + l] = d1 * ((q >> shift) & 0x0F) as f32 - m1;
            }
        }
    }
}

/// `dequantize_row_q5_K`.
impl Dequantize for BlockQ5K {
    fn dequantize(&self, out: &mut [f32]) {
        let (d, dmin) = (self.d.to_f32(), self.dmin.to_f32());
        for j in 0..8 {
            let (sc, m) = scale_min_k4(&self.scales, j);
            let (d1, m1) = (d * sc as f32, dmin * m as f32);
            let qs = &self.qs[32 * (j / 2)..32 * (j / 2) + 32];
            let shift = 4 * (j % 2);
            for (l, &q) in qs.iter().enumerate() {
                let q = ((q >> shift) & 0x0F) | (((self.qh[l] >> j) & 1) << 4);
                out[32 * j + l] = d1 * q as f32 - m1;
            }
        }
    }
}

/// `dequantize_row_q6_K`.
impl Dequantize for BlockQ6K {
    fn dequantize(&self, out: &mut [f32]) {
        let d = self.d.to_f32();
        for h in 0..2 {
            for s in 0..4 {
                for l in 0..32 {
                    let e = 128 * h + 32 * s + l;
                    let lo = (self.ql[64 * h + l + 32 * (s & 1)] >> (4 * (s >> 1))) & 0x0F;
                    let hi = (self.qh[32 * h + l] >> (2 * s)) & 3;
                    let q = (lo | (hi << 4)) as i32 - 32;
                    out[e] = d * self.scales[e / 16] as f32 * q as f32;
                }
            }
        }
    }
}

/// `dequantize_row_q8_K`.
impl Dequantize for BlockQ8K {
    fn dequantize(&self, out: &mut [f32]) {
        let d = f32::from_le_bytes(self.d);
        for (o, &q) in out.iter_mut().zip(&self.qs) {
            *o = d * q as f32;
        }
    }
}

// ---- IQ quants ----------------------------------------------------------------------------------------------------

/// `dequantize_row_iq4_xs`.
impl Dequantize for BlockIQ4XS {
    fn dequantize(&self, out: &mut [f32]) {
        let d = self.d.to_f32();
        let scales_h = u16::from_le_bytes(self.scales_h);
        for i in 0..8 {
            let lo = (self.scales_l[i / 2] >> (4 * (i % 2))) & 0x0F;
            let hi = ((scales_h >> (2 * i)) & 3) as u8;
            let dl = d * ((lo | (hi << 4)) as i32 - 32) as f32;
            for (j, &q) in self.qs[16 * i..16 * i + 16].iter().enumerate() {
                out[32 * i + j] = dl * KVALUES_IQ4NL[(q & 0x0F) as usize] as f32;
                out[32 * i + j + 16] = dl * KVALUES_IQ4NL[(q >> 4) as usize] as f32;
            }
        }
    }
}

/// `dequantize_row_iq3_s`.
impl Dequantize for BlockIQ3S {
    fn dequantize(&self, out: &mut [f32]) {
        let d = self.d.to_f32();
        for g in 0..QK_K / 4 {
            let sc = (self.scales[g / 16] >> (4 * ((g / 8) % 2))) & 0x0F;
            let db = d * (1 + 2 * sc as i32) as f32;
            let idx = self.qs[g] as usize | ((self.qh[g / 8] as usize >> (g % 8)) & 1) << 8;
            let row = IQ3S_GRID[idx].to_le_bytes();
            for (k, &mag) in row.iter().enumerate() {
                let e = 4 * g + k;
                let v = db * mag as f32;
                out[e] = if (self.signs[e / 8] >> (e % 8)) & 1 != 0 { -v } else { v };
            }
        }
    }
}

/// `dequantize_row_iq2_xs`.
impl Dequantize for BlockIQ2XS {
    fn dequantize(&self, out: &mut [f32]) {
        let d = self.d.to_f32();
        for (g, q) in self.qs.iter().enumerate() {
            let q = u16::from_le_bytes(*q);
            let sc = (self.scales[g / 4] >> (4 * ((g / 2) % 2))) & 0x0F;
            let db = d * (0.5 + sc as f32) * 0.25;
            let row = IQ2XS_GRID[(q & 511) as usize].to_le_bytes();
            let signs = KSIGNS_IQ2XS[(q >> 9) as usize];
            for (k, &mag) in row.iter().enumerate() {
                let v = db * mag as f32;
                out[8 * g + k] = if (signs >> k) & 1 != 0 { -v } else { v };
            }
        }
    }
}
