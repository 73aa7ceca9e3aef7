//! AVX2 + FMA + F16C dot products of one quantized row with f32 activations.
//!
//! Each kernel widens the weight codes of a block to f32 in registers (bytes through `vpmovsxbd` / `vpmovzxbd`,
//! nibbles and bit planes unpacked with byte masks and shifts, IQ4 levels through a `pshufb` table, IQ grids by
//! row lookups) and multiply-adds them with `x`, applying each (sub-)block scale once per sub-block and each min
//! through the sub-block's `Σ x`. The arithmetic is the reference's (`super::reference`, ggml's
//! `dequantize_row_*`) up to f32 summation order. ggml's own AVX2 `ggml_vec_dot_*` instead quantize `x` to
//! Q8; that is the int8 path (`avx2_int8`), which the matmul uses; this f32 path stays exact up to rounding.
//!
//! Safety: every kernel is a `#[target_feature(enable = "avx2,fma,f16c")]` function reached only through the
//! `DotFn` entries at the bottom, which [`super::dot_fn`] hands out only after [`super::simd_available`]. All
//! memory access goes through [`ld8`], [`ld128`] and [`ld256`], which take slices and check their bounds, so a
//! kernel given inconsistent lengths reads only the blocks both slices cover.

use std::arch::x86_64::*;

use bytemuck::cast_slice;

use super::blocks::*;
use super::iq_tables::{IQ2XS_GRID, IQ3S_GRID, KSIGNS_IQ2XS, KVALUES_IQ4NL};
use super::reference::{bf16_to_f32, dot_f32_plain};
use super::types::QK_K;

// ---- loads and small helpers ----------------------------------------------------------------------------------

/// 8 f32 from `x[at..at + 8]` (bounds-checked).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn ld8(x: &[f32], at: usize) -> __m256 {
    let s = &x[at..at + 8];
    // SAFETY: `s` is 8 readable f32; the load is unaligned.
    unsafe { _mm256_loadu_ps(s.as_ptr()) }
}

/// 16 bytes from the start of `b` (bounds-checked).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn ld128(b: &[u8]) -> __m128i {
    let s = &b[..16];
    // SAFETY: `s` is 16 readable bytes; the load is unaligned.
    unsafe { _mm_loadu_si128(s.as_ptr().cast()) }
}

/// 32 bytes from the start of `b` (bounds-checked).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn ld256(b: &[u8]) -> __m256i {
    let s = &b[..32];
    // SAFETY: `s` is 32 readable bytes; the load is unaligned.
    unsafe { _mm256_loadu_si256(s.as_ptr().cast()) }
}

/// The f16 as f32 (`vcvtph2ps`), through inline asm: with the intrinsic, LLVM sees that only lane 0 matters and
/// loads the half with a `vpinsrw` into whatever register is free, often a loop's accumulator, which chains
/// every block's scale onto the previous block's multiply-add (measured: Q4_0 x Q8_1 ran at a third of its
/// speed). The asm operand needs the whole register, so it is built with a dependency-free `vmovd`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn f16(h: F16Bits) -> f32 {
    let v = _mm_cvtsi32_si128(u16::from_le_bytes(h.0) as i32);
    let out: __m128;
    // SAFETY: one register-to-register F16C instruction (F16C is enabled on this function); no memory access.
    unsafe {
        std::arch::asm!(
            "vcvtph2ps {o}, {i}",
            o = lateout(xmm_reg) out,
            i = in(xmm_reg) v,
            options(pure, nomem, nostack, preserves_flags)
        )
    };
    _mm_cvtss_f32(out)
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn hsum(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)))
}

/// The low 8 signed bytes of `v` as f32.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn i8x8(v: __m128i) -> __m256 {
    _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v))
}

/// The low 8 unsigned bytes of `v` as f32.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn u8x8(v: __m128i) -> __m256 {
    _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v))
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn high64(v: __m128i) -> __m128i {
    _mm_unpackhi_epi64(v, v)
}

/// `acc + Σ q[k] * x[at + k]` for the 16 signed byte codes of `q`, as 8 lanes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn dot16_i8(q: __m128i, x: &[f32], at: usize, acc: __m256) -> __m256 {
    let a = _mm256_fmadd_ps(i8x8(q), ld8(x, at), acc);
    _mm256_fmadd_ps(i8x8(high64(q)), ld8(x, at + 8), a)
}

/// `(Σ q[k] * x[at + k], Σ x[at + k])` for the 16 unsigned byte codes of `q`, as 8 lanes each.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn dot16_u8_sum(q: __m128i, x: &[f32], at: usize) -> (__m256, __m256) {
    let (x0, x1) = (ld8(x, at), ld8(x, at + 8));
    let a = _mm256_fmadd_ps(u8x8(high64(q)), x1, _mm256_mul_ps(u8x8(q), x0));
    (a, _mm256_add_ps(x0, x1))
}

/// `(Σ q[k] * x[at + k], Σ x[at + k])` for the 32 unsigned byte codes of `q`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn dot32_u8_sum(q: __m256i, x: &[f32], at: usize) -> (__m256, __m256) {
    let (a0, s0) = dot16_u8_sum(_mm256_castsi256_si128(q), x, at);
    let (a1, s1) = dot16_u8_sum(_mm256_extracti128_si256::<1>(q), x, at + 16);
    (_mm256_add_ps(a0, a1), _mm256_add_ps(s0, s1))
}

/// Bytes 0xFF where the matching bit of `bits` (bit k for byte k, 16 bits) is set, else 0.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn bits_to_mask16(bits: u32) -> __m128i {
    let v = _mm_set1_epi16(bits as u16 as i16);
    let v = _mm_shuffle_epi8(v, _mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1));
    let sel = _mm_set1_epi64x(0x8040_2010_0804_0201_u64 as i64);
    _mm_cmpeq_epi8(_mm_and_si128(v, sel), sel)
}

/// 8 lanes of -0.0 where bit k of `bits` is set (lane k), else +0.0: xor it into a vector to flip signs.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn sign_flips8(bits: u8) -> __m256 {
    let sel = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    let set = _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(bits as i32), sel), sel);
    _mm256_castsi256_ps(_mm256_slli_epi32::<31>(set))
}

/// The blocks of `row` and the activations both slices cover.
#[inline]
fn split<'a, B: QuantBlock>(row: &'a [u8], x: &'a [f32]) -> (&'a [B], &'a [f32]) {
    let n = (row.len() / size_of::<B>()).min(x.len() / B::ELEMS);
    (cast_slice(&row[..n * size_of::<B>()]), &x[..n * B::ELEMS])
}

// ---- scalar element types -------------------------------------------------------------------------------------

/// F32 · f32: 4 accumulators over 32 elements, scalar tail.
#[target_feature(enable = "avx2,fma,f16c")]
fn k_f32(row: &[u8], x: &[f32]) -> f32 {
    let n = (row.len() / 4).min(x.len());
    let mut acc = [_mm256_setzero_ps(); 4];
    let main = n / 32 * 32;
    for i in (0..main).step_by(32) {
        for (k, a) in acc.iter_mut().enumerate() {
            let w = &row[4 * (i + 8 * k)..4 * (i + 8 * k + 8)];
            // SAFETY: `w` is 32 readable bytes (8 f32, unaligned load).
            let wv = unsafe { _mm256_loadu_ps(w.as_ptr().cast()) };
            *a = _mm256_fmadd_ps(wv, ld8(x, i + 8 * k), *a);
        }
    }
    let mut tail = [0f32; 32];
    super::reference::dequantize_f32(&row[4 * main..4 * n], &mut tail[..n - main]);
    let sum = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
    hsum(sum) + dot_f32_plain(&tail[..n - main], &x[main..n])
}

/// F16 · f32: `vcvtph2ps`, 4 accumulators.
#[target_feature(enable = "avx2,fma,f16c")]
fn k_f16(row: &[u8], x: &[f32]) -> f32 {
    let n = (row.len() / 2).min(x.len());
    let mut acc = [_mm256_setzero_ps(); 4];
    let main = n / 32 * 32;
    for i in (0..main).step_by(32) {
        for (k, a) in acc.iter_mut().enumerate() {
            let w = _mm256_cvtph_ps(ld128(&row[2 * (i + 8 * k)..]));
            *a = _mm256_fmadd_ps(w, ld8(x, i + 8 * k), *a);
        }
    }
    let mut tail = [0f32; 32];
    super::reference::dequantize_f16(&row[2 * main..2 * n], &mut tail[..n - main]);
    let sum = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
    hsum(sum) + dot_f32_plain(&tail[..n - main], &x[main..n])
}

/// BF16 · f32: widen to 32 bits and shift into the top half, 4 accumulators.
#[target_feature(enable = "avx2,fma,f16c")]
fn k_bf16(row: &[u8], x: &[f32]) -> f32 {
    let n = (row.len() / 2).min(x.len());
    let mut acc = [_mm256_setzero_ps(); 4];
    let main = n / 32 * 32;
    for i in (0..main).step_by(32) {
        for (k, a) in acc.iter_mut().enumerate() {
            let w = _mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(ld128(&row[2 * (i + 8 * k)..])));
            *a = _mm256_fmadd_ps(_mm256_castsi256_ps(w), ld8(x, i + 8 * k), *a);
        }
    }
    let mut sum = hsum(_mm256_add_ps(
        _mm256_add_ps(acc[0], acc[1]),
        _mm256_add_ps(acc[2], acc[3]),
    ));
    for (w, &xv) in row[2 * main..2 * n].chunks_exact(2).zip(&x[main..n]) {
        sum += bf16_to_f32(u16::from_le_bytes([w[0], w[1]])) * xv;
    }
    sum
}

// ---- legacy 32-element blocks ---------------------------------------------------------------------------------

/// Q8_0 (`dequantize_row_q8_0`).
#[target_feature(enable = "avx2,fma,f16c")]
fn k_q8_0(row: &[u8], x: &[f32]) -> f32 {
    let (blocks, x) = split::<BlockQ8_0>(row, x);
    let mut acc = _mm256_setzero_ps();
    for (b, xs) in blocks.iter().zip(x.chunks_exact(32)) {
        let q = ld256(cast_slice(&b.qs));
        let (lo, hi) = (_mm256_castsi256_si128(q), _mm256_extracti128_si256::<1>(q));
        let a = dot16_i8(hi, xs, 16, dot16_i8(lo, xs, 0, _mm256_setzero_ps()));
        acc = _mm256_fmadd_ps(_mm256_set1_ps(f16(b.d)), a, acc);
    }
    hsum(acc)
}

/// The 32 nibbles of a 16-byte `qs`: (elements 0..16, elements 16..32).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn nibbles(qs: &[u8]) -> (__m128i, __m128i) {
    let q = ld128(qs);
    let m = _mm_set1_epi8(0x0F);
    (_mm_and_si128(q, m), _mm_and_si128(_mm_srli_epi16::<4>(q), m))
}

/// Q4_0 (`dequantize_row_q4_0`).
#[target_feature(enable = "avx2,fma,f16c")]
fn k_q4_0(row: &[u8], x: &[f32]) -> f32 {
    let (blocks, x) = split::<BlockQ4_0>(row, x);
    let mut acc = _mm256_setzero_ps();
    let eight = _mm_set1_epi8(8);
    for (b, xs) in blocks.iter().zip(x.chunks_exact(32)) {
        let (lo, hi) = nibbles(&b.qs);
        let a = dot16_i8(_mm_sub_epi8(lo, eight), xs, 0, _mm256_setzero_ps());
        let a = dot16_i8(_mm_sub_epi8(hi, eight), xs, 16, a);
        acc = _mm256_fmadd_ps(_mm256_set1_ps(f16(b.d)), a, acc);
    }
    hsum(acc)
}

/// Q4_1 (`dequantize_row_q4_1`): `d Σ q x + m Σ x`.
#[target_feature(enable = "avx2,fma,f16c")]
fn k_q4_1(row: &[u8], x: &[f32]) -> f32 {
    let (blocks, x) = split::<BlockQ4_1>(row, x);
    let mut acc = _mm256_setzero_ps();
    for (b, xs) in blocks.iter().zip(x.chunks_exact(32)) {
        let (lo, hi) = nibbles(&b.qs);
        let (a, s) = dot32_u8_sum(_mm256_set_m128i(hi, lo), xs, 0);
        acc = _mm256_fmadd_ps(_mm256_set1_ps(f16(b.d)), a, acc);
        acc = _mm256_fmadd_ps(_mm256_set1_ps(f16(b.m)), s, acc);
    }
    hsum(acc)
}

/// The 32 five-bit codes of a Q5 block: nibbles plus bit j of `qh` as bit 4.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn five_bit(qs: &[u8], qh: [u8; 4]) -> (__m128i, __m128i) {
    let (lo, hi) = nibbles(qs);
    let qh = u32::from_le_bytes(qh);
    let b4 = _mm_set1_epi8(0x10);
    let lo = _mm_or_si128(lo, _mm_and_si128(bits_to_mask16(qh & 0xFFFF), b4));
    let hi = _mm_or_si128(hi, _mm_and_si128(bits_to_mask16(qh >> 16), b4));
    (lo, hi)
}

/// Q5_0 (`dequantize_row_q5_0`).
#[target_feature(enable = "avx2,fma,f16c")]
fn k_q5_0(row: &[u8], x: &[f32]) -> f32 {
    let (blocks, x) = split::<BlockQ5_0>(row, x);
    let mut acc = _mm256_setzero_ps();
    let sixteen = _mm_set1_epi8(16);
    for (b, xs) in blocks.iter().zip(x.chunks_exact(32)) {
        let (lo, hi) = five_bit(&b.qs, b.qh);
        let a = dot16_i8(_mm_sub_epi8(lo, sixteen), xs, 0, _mm256_setzero_ps());
        let a = dot16_i8(_mm_sub_epi8(hi, sixteen), xs, 16, a);
        acc = _mm256_fmadd_ps(_mm256_set1_ps(f16(b.d)), a, acc);
    }
    hsum(acc)
}

/// Q5_1 (`dequantize_row_q5_1`).
#[target_feature(enable = "avx2,fma,f16c")]
fn k_q5_1(row: &[u8], x: &[f32]) -> f32 {
    let (blocks, x) = split::<BlockQ5_1>(row, x);
    let mut acc = _mm256_setzero_ps();
    for (b, xs) in blocks.iter().zip(x.chunks_exact(32)) {
        let (lo, hi) = five_bit(&b.qs, b.qh);
        let (a, s) = dot32_u8_sum(_mm256_set_m128i(hi, lo), xs, 0);
        acc = _mm256_fmadd_ps(_mm256_set1_ps(f16(b.d)), a, acc);
        acc = _mm256_fmadd_ps(_mm256_set1_ps(f16(b.m)), s, acc);
    }
    hsum(acc)
}

/// IQ4_NL (`dequantize_row_iq4_nl`): nibbles to levels through a `pshufb` table.
#[target_feature(enable = "avx2,fma,f16c")]
fn k_iq4_nl(row: &[u8], x: &[f32]) -> f32 {
    let (blocks, x) = split::<BlockIQ4NL>(row, x);
    let table = ld128(cast_slice(&KVALUES_IQ4NL));
    let mut acc = _mm256_setzero_ps();
    for (b, xs) in blocks.iter().zip(x.chunks_exact(32)) {
        let (lo, hi) = nibbles(&b.qs);
        let a = dot16_i8(_mm_shuffle_epi8(table, lo), xs, 0, _mm256_setzero_ps());
        let a = dot16_i8(_mm_shuffle_epi8(table, hi), xs, 16, a);
        acc = _mm256_fmadd_ps(_mm256_set1_ps(f16(b.d)), a, acc);
    }
    hsum(acc)
}

// ---- K quants -------------------------------------------------------------------------------------------------

/// Q2_K (`dequantize_row_q2_K`): per 16-element sub-block, `d sc Σ q x - dmin m Σ x`.
#[target_feature(enable = "avx2,fma,f16c")]
fn k_q2_k(row: &[u8], x: &[f32]) -> f32 {
    let (blocks, x) = split::<BlockQ2K>(row, x);
    let mut acc = _mm256_setzero_ps();
    let three = _mm256_set1_epi8(3);
    for (b, xs) in blocks.iter().zip(x.chunks_exact(QK_K)) {
        let (mut acc_q, mut acc_m) = (_mm256_setzero_ps(), _mm256_setzero_ps());
        for h in 0..2 {
            let qv = ld256(&b.qs[32 * h..]);
            for s in 0..4 {
                let q = _mm256_and_si256(_mm256_srl_epi16(qv, _mm_cvtsi32_si128(2 * s as i32)), three);
                for (half, q16) in [_mm256_castsi256_si128(q), _mm256_extracti128_si256::<1>(q)]
                    .into_iter()
                    .enumerate()
                {
                    let sub = 8 * h + 2 * s + half;
                    let (a, sx) = dot16_u8_sum(q16, xs, 16 * sub);
                    let sc = b.scales[sub];
                    acc_q = _mm256_fmadd_ps(_mm256_set1_ps((sc & 0x0F) as f32), a, acc_q);
                    acc_m = _mm256_fmadd_ps(_mm256_set1_ps((sc >> 4) as f32), sx, acc_m);
                }
            }
        }
        acc = _mm256_fmadd_ps(_mm256_set1_ps(f16(b.d)), acc_q, acc);
        acc = _mm256_fnmadd_ps(_mm256_set1_ps(f16(b.dmin)), acc_m, acc);
    }
    hsum(acc)
}

/// Q3_K (`dequantize_row_q3_K`): 2-bit planes minus 4 where the `hmask` bit is clear, signed 6-bit scales.
#[target_feature(enable = "avx2,fma,f16c")]
fn k_q3_k(row: &[u8], x: &[f32]) -> f32 {
    let (blocks, x) = split::<BlockQ3K>(row, x);
    let mut acc = _mm256_setzero_ps();
    let (three, four) = (_mm256_set1_epi8(3), _mm256_set1_epi8(4));
    for (b, xs) in blocks.iter().zip(x.chunks_exact(QK_K)) {
        let scales = scales_q3k(&b.scales);
        let hm = ld256(&b.hmask);
        let mut acc_b = _mm256_setzero_ps();
        for h in 0..2 {
            let qv = ld256(&b.qs[32 * h..]);
            for s in 0..4 {
                let lo = _mm256_and_si256(_mm256_srl_epi16(qv, _mm_cvtsi32_si128(2 * s as i32)), three);
                let bit = _mm256_set1_epi8((1u8 << (4 * h + s)) as i8);
                let clear = _mm256_cmpeq_epi8(_mm256_and_si256(hm, bit), _mm256_setzero_si256());
                let q = _mm256_sub_epi8(lo, _mm256_and_si256(clear, four));
                for (half, q16) in [_mm256_castsi256_si128(q), _mm256_extracti128_si256::<1>(q)]
                    .into_iter()
                    .enumerate()
                {
                    let sub = 8 * h + 2 * s + half;
                    let a = dot16_i8(q16, xs, 16 * sub, _mm256_setzero_ps());
                    acc_b = _mm256_fmadd_ps(_mm256_set1_ps((scales[sub] as i32 - 32) as f32), a, acc_b);
                }
            }
        }
        acc = _mm256_fmadd_ps(_mm256_set1_ps(f16(b.d)), acc_b, acc);
    }
    hsum(acc)
}

/// The shared body of Q4_K and Q5_K: `q_of(c)` gives the 32 low and 32 high codes of byte group c (sub-blocks
/// 2c and 2c + 1).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn k4_block(
    d: F16Bits,
    dmin: F16Bits,
    scales: &[u8; 12],
    xs: &[f32],
    q_of: impl Fn(usize) -> (__m256i, __m256i),
    acc: __m256,
) -> __m256 {
    let (mut acc_q, mut acc_m) = (_mm256_setzero_ps(), _mm256_setzero_ps());
    for c in 0..4 {
        let (lo, hi) = q_of(c);
        for (k, q) in [lo, hi].into_iter().enumerate() {
            let sub = 2 * c + k;
            let (a, sx) = dot32_u8_sum(q, xs, 32 * sub);
            let (sc, m) = scale_min_k4(scales, sub);
            acc_q = _mm256_fmadd_ps(_mm256_set1_ps(sc as f32), a, acc_q);
            acc_m = _mm256_fmadd_ps(_mm256_set1_ps(m as f32), sx, acc_m);
        }
    }
    let acc = _mm256_fmadd_ps(_mm256_set1_ps(f16(d)), acc_q, acc);
    _mm256_fnmadd_ps(_mm256_set1_ps(f16(dmin)), acc_m, acc)
}

/// Q4_K (`dequantize_row_q4_K`).
#[target_feature(enable = "avx2,fma,f16c")]
fn k_q4_k(row: &[u8], x: &[f32]) -> f32 {
    let (blocks, x) = split::<BlockQ4K>(row, x);
    let mut acc = _mm256_setzero_ps();
    let m4 = _mm256_set1_epi8(0x0F);
    for (b, xs) in blocks.iter().zip(x.chunks_exact(QK_K)) {
        let q_of = |c: usize| {
            let q = ld256(&b.qs[32 * c..]);
            (_mm256_and_si256(q, m4), _mm256_and_si256(_mm256_srli_epi16::<4>(q), m4))
        };
        acc = k4_block(b.d, b.dmin, &b.scales, xs, q_of, acc);
    }
    hsum(acc)
}

/// Q5_K (`dequantize_row_q5_K`): Q4_K plus bit j of `qh[l]` as bit 4 of sub-block j.
#[target_feature(enable = "avx2,fma,f16c")]
fn k_q5_k(row: &[u8], x: &[f32]) -> f32 {
    let (blocks, x) = split::<BlockQ5K>(row, x);
    let mut acc = _mm256_setzero_ps();
    let (m4, b4) = (_mm256_set1_epi8(0x0F), _mm256_set1_epi8(0x10));
    for (b, xs) in blocks.iter().zip(x.chunks_exact(QK_K)) {
        let qh = ld256(&b.qh);
        let high = |j: usize| {
            let bit = _mm256_set1_epi8((1u8 << j) as i8);
            _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qh, bit), bit), b4)
        };
        let q_of = |c: usize| {
            let q = ld256(&b.qs[32 * c..]);
            let lo = _mm256_or_si256(_mm256_and_si256(q, m4), high(2 * c));
            let hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16::<4>(q), m4), high(2 * c + 1));
            (lo, hi)
        };
        acc = k4_block(b.d, b.dmin, &b.scales, xs, q_of, acc);
    }
    hsum(acc)
}

/// Q6_K (`dequantize_row_q6_K`).
#[target_feature(enable = "avx2,fma,f16c")]
fn k_q6_k(row: &[u8], x: &[f32]) -> f32 {
    let (blocks, x) = split::<BlockQ6K>(row, x);
    let mut acc = _mm256_setzero_ps();
    let (m4, m2, off) = (_mm256_set1_epi8(0x0F), _mm256_set1_epi8(0x03), _mm256_set1_epi8(32));
    for (b, xs) in blocks.iter().zip(x.chunks_exact(QK_K)) {
        let mut acc_b = _mm256_setzero_ps();
        for h in 0..2 {
            let qh = ld256(&b.qh[32 * h..]);
            for s in 0..4 {
                let ql = ld256(&b.ql[64 * h + 32 * (s & 1)..]);
                let lo = _mm256_and_si256(_mm256_srl_epi16(ql, _mm_cvtsi32_si128(4 * (s >> 1) as i32)), m4);
                let hi = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * s as i32)), m2);
                let q = _mm256_sub_epi8(_mm256_or_si256(lo, _mm256_slli_epi16::<4>(hi)), off);
                for (half, q16) in [_mm256_castsi256_si128(q), _mm256_extracti128_si256::<1>(q)]
                    .into_iter()
                    .enumerate()
                {
                    let sub = 8 * h + 2 * s + half;
                    let a = dot16_i8(q16, xs, 16 * sub, _mm256_setzero_ps());
                    acc_b = _mm256_fmadd_ps(_mm256_set1_ps(b.scales[sub] as f32), a, acc_b);
                }
            }
        }
        acc = _mm256_fmadd_ps(_mm256_set1_ps(f16(b.d)), acc_b, acc);
    }
    hsum(acc)
}

// ---- IQ quants ----------------------------------------------------------------------------------------------------

/// IQ4_XS (`dequantize_row_iq4_xs`).
#[target_feature(enable = "avx2,fma,f16c")]
fn k_iq4_xs(row: &[u8], x: &[f32]) -> f32 {
    let (blocks, x) = split::<BlockIQ4XS>(row, x);
    let table = ld128(cast_slice(&KVALUES_IQ4NL));
    let mut acc = _mm256_setzero_ps();
    for (b, xs) in blocks.iter().zip(x.chunks_exact(QK_K)) {
        let scales_h = u16::from_le_bytes(b.scales_h);
        let mut acc_b = _mm256_setzero_ps();
        for i in 0..8 {
            let ls = ((b.scales_l[i / 2] >> (4 * (i % 2))) & 0x0F) | ((((scales_h >> (2 * i)) & 3) as u8) << 4);
            let (lo, hi) = nibbles(&b.qs[16 * i..]);
            let a = dot16_i8(_mm_shuffle_epi8(table, lo), xs, 32 * i, _mm256_setzero_ps());
            let a = dot16_i8(_mm_shuffle_epi8(table, hi), xs, 32 * i + 16, a);
            acc_b = _mm256_fmadd_ps(_mm256_set1_ps((ls as i32 - 32) as f32), a, acc_b);
        }
        acc = _mm256_fmadd_ps(_mm256_set1_ps(f16(b.d)), acc_b, acc);
    }
    hsum(acc)
}

/// IQ3_S (`dequantize_row_iq3_s`): two 4-byte grid rows per 8 weights, signs from the sign bytes.
#[target_feature(enable = "avx2,fma,f16c")]
fn k_iq3_s(row: &[u8], x: &[f32]) -> f32 {
    let (blocks, x) = split::<BlockIQ3S>(row, x);
    let mut acc = _mm256_setzero_ps();
    for (b, xs) in blocks.iter().zip(x.chunks_exact(QK_K)) {
        let mut acc_b = _mm256_setzero_ps();
        for i in 0..8 {
            let mut a = _mm256_setzero_ps();
            for k in 0..4 {
                let p = 4 * i + k; // 8 weights: groups 2p and 2p + 1
                let idx = |g: usize| b.qs[g] as usize | ((b.qh[g / 8] as usize >> (g % 8)) & 1) << 8;
                let rows = _mm_set_epi32(0, 0, IQ3S_GRID[idx(2 * p + 1)] as i32, IQ3S_GRID[idx(2 * p)] as i32);
                let w = _mm256_xor_ps(u8x8(rows), sign_flips8(b.signs[p]));
                a = _mm256_fmadd_ps(w, ld8(xs, 8 * p), a);
            }
            let sc = (b.scales[i / 2] >> (4 * (i % 2))) & 0x0F;
            acc_b = _mm256_fmadd_ps(_mm256_set1_ps((1 + 2 * sc as i32) as f32), a, acc_b);
        }
        acc = _mm256_fmadd_ps(_mm256_set1_ps(f16(b.d)), acc_b, acc);
    }
    hsum(acc)
}

/// IQ2_XS (`dequantize_row_iq2_xs`): one 8-byte grid row per 8 weights, signs through `KSIGNS_IQ2XS`.
#[target_feature(enable = "avx2,fma,f16c")]
fn k_iq2_xs(row: &[u8], x: &[f32]) -> f32 {
    let (blocks, x) = split::<BlockIQ2XS>(row, x);
    let mut acc = _mm256_setzero_ps();
    for (b, xs) in blocks.iter().zip(x.chunks_exact(QK_K)) {
        let mut acc_b = _mm256_setzero_ps();
        for i in 0..16 {
            let mut a = _mm256_setzero_ps();
            for g in [2 * i, 2 * i + 1] {
                let q = u16::from_le_bytes(b.qs[g]);
                let grid = _mm_cvtsi64_si128(IQ2XS_GRID[(q & 511) as usize] as i64);
                let w = _mm256_xor_ps(u8x8(grid), sign_flips8(KSIGNS_IQ2XS[(q >> 9) as usize]));
                a = _mm256_fmadd_ps(w, ld8(xs, 8 * g), a);
            }
            let sc = (b.scales[i / 2] >> (4 * (i % 2))) & 0x0F;
            acc_b = _mm256_fmadd_ps(_mm256_set1_ps(0.5 + sc as f32), a, acc_b);
        }
        acc = _mm256_fmadd_ps(_mm256_set1_ps(f16(b.d) * 0.25), acc_b, acc);
    }
    hsum(acc)
}

// ---- DotFn entries --------------------------------------------------------------------------------------------

macro_rules! entries {
    ($($entry:ident => $kernel:ident,)*) => {$(
        #[doc = concat!("[`super::DotFn`] entry for `", stringify!($kernel), "`; only valid where `simd_available()`.")]
        pub(super) fn $entry(row: &[u8], x: &[f32]) -> f32 {
            debug_assert!(super::simd_available());
            // SAFETY: these entries are reached only through `super::dot_fn`, which returns them only after
            // `simd_available()` found AVX2, FMA and F16C on this CPU.
            unsafe { $kernel(row, x) }
        }
    )*};
}

entries! {
    dot_f32 => k_f32,
    dot_f16 => k_f16,
    dot_bf16 => k_bf16,
    dot_q4_0 => k_q4_0,
    dot_q4_1 => k_q4_1,
    dot_q5_0 => k_q5_0,
    dot_q5_1 => k_q5_1,
    dot_q8_0 => k_q8_0,
    dot_iq4_nl => k_iq4_nl,
    dot_q2_k => k_q2_k,
    dot_q3_k => k_q3_k,
    dot_q4_k => k_q4_k,
    dot_q5_k => k_q5_k,
    dot_q6_k => k_q6_k,
    dot_iq4_xs => k_iq4_xs,
    dot_iq3_s => k_iq3_s,
    dot_iq2_xs => k_iq2_xs,
}
