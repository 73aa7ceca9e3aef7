//! The int8 codes of activation blocks (`activations.rs` describes them): per block of 32 or 256 values a
//! scale, one code per value and the code sums, from the plain quantizer or its AVX2 twin, which does the same f32
//! operations in the same order and matches it bit for bit.

/// Quantize whole blocks of `block` values (a multiple of 32); lengths are consistent (checked by the caller).
pub(super) fn quantize_codes(
    x: &[f32],
    block: usize,
    group: usize,
    qs: &mut [i8],
    d: &mut [f32],
    sums: &mut [i16],
    simd: bool,
) {
    #[cfg(target_arch = "x86_64")]
    if simd {
        avx2::quantize_activations(x, block, group, qs, d, sums);
        return;
    }
    let _ = simd;
    quantize_codes_plain(x, block, group, qs, d, sums);
}

/// `(d, 127 / amax)` of a block with absolute maximum `amax` (NaN when the block holds a NaN); the inverse is 0
/// where the block quantizes to all-zero codes. Shared by the plain and AVX2 quantizers so they agree bit for bit.
#[inline]
pub(crate) fn block_scale(amax: f32) -> (f32, f32) {
    if amax.is_finite() && amax >= 1e-30 {
        (amax / 127.0, 127.0 / amax)
    } else if amax.is_finite() {
        (0.0, 0.0)
    } else {
        (amax / 127.0, 0.0)
    }
}

/// The plain quantizer, the semantics of the AVX2 one.
pub(crate) fn quantize_codes_plain(
    x: &[f32],
    block: usize,
    group: usize,
    qs: &mut [i8],
    d: &mut [f32],
    sums: &mut [i16],
) {
    for (((xb, qb), db), sb) in x
        .chunks_exact(block)
        .zip(qs.chunks_exact_mut(block))
        .zip(d.iter_mut())
        .zip(sums.chunks_exact_mut(block / group))
    {
        let amax = if xb.iter().any(|v| v.is_nan()) {
            f32::NAN
        } else {
            xb.iter().fold(0f32, |m, v| m.max(v.abs()))
        };
        let (scale, inv) = block_scale(amax);
        *db = scale;
        for (q, &v) in qb.iter_mut().zip(xb) {
            *q = if inv == 0.0 {
                0
            } else {
                (v * inv).round_ties_even() as i8
            };
        }
        for (s, qg) in sb.iter_mut().zip(qb.chunks_exact(group)) {
            *s = qg.iter().map(|&q| q as i16).sum();
        }
    }
}

/// The AVX2 quantizer. Safety: as in `avx2`: reached only after [`super::simd_available`]; memory is read and
/// written through bounds-checked slices.
#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::block_scale;
    use crate::quant::avx2::ld8;

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn hsum_i32(v: __m256i) -> i32 {
        let s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256::<1>(v));
        let s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
        _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32::<0b01>(s)))
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn hmax(v: __m256) -> f32 {
        let m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
        _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)))
    }

    /// [`super::quantize_codes_plain`] in AVX2, bit for bit: blocks of `block` (a multiple of 32) values, sums
    /// per `group` (16 or 32). Lengths are consistent (checked by the caller).
    #[target_feature(enable = "avx2,fma,f16c")]
    fn k_quantize(x: &[f32], block: usize, group: usize, qs: &mut [i8], d: &mut [f32], sums: &mut [i16]) {
        let abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFF_FFFF));
        let order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
        for (((xb, qb), db), sb) in x
            .chunks_exact(block)
            .zip(qs.chunks_exact_mut(block))
            .zip(d.iter_mut())
            .zip(sums.chunks_exact_mut(block / group))
        {
            let (mut mx, mut nan) = (_mm256_setzero_ps(), _mm256_setzero_ps());
            for c in xb.chunks_exact(8) {
                let v = ld8(c, 0);
                mx = _mm256_max_ps(mx, _mm256_and_ps(v, abs_mask));
                nan = _mm256_or_ps(nan, _mm256_cmp_ps::<_CMP_UNORD_Q>(v, v));
            }
            let amax = if _mm256_movemask_ps(nan) != 0 {
                f32::NAN
            } else {
                hmax(mx)
            };
            let (scale, inv) = block_scale(amax);
            *db = scale;
            if inv == 0.0 {
                qb.fill(0);
                sb.fill(0);
                continue;
            }
            let iv = _mm256_set1_ps(inv);
            for (k, (xc, qc)) in xb.chunks_exact(32).zip(qb.chunks_exact_mut(32)).enumerate() {
                let code = |i: usize| {
                    let v = _mm256_mul_ps(ld8(xc, 8 * i), iv);
                    _mm256_cvtps_epi32(_mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(v))
                };
                let (v0, v1, v2, v3) = (code(0), code(1), code(2), code(3));
                // packs interleave 128-bit lanes; the permute restores element order.
                let packed = _mm256_packs_epi16(_mm256_packs_epi32(v0, v1), _mm256_packs_epi32(v2, v3));
                let packed = _mm256_permutevar8x32_epi32(packed, order);
                // SAFETY: `qc` is 32 writable bytes (chunks_exact_mut(32)); the store is unaligned.
                unsafe { _mm256_storeu_si256(qc.as_mut_ptr().cast(), packed) };
                let (s01, s23) = (_mm256_add_epi32(v0, v1), _mm256_add_epi32(v2, v3));
                if group == 16 {
                    sb[2 * k] = hsum_i32(s01) as i16;
                    sb[2 * k + 1] = hsum_i32(s23) as i16;
                } else {
                    sb[k] = hsum_i32(_mm256_add_epi32(s01, s23)) as i16;
                }
            }
        }
    }

    /// Entry for [`super::quantize_codes`]; only valid where `simd_available()`.
    pub(super) fn quantize_activations(
        x: &[f32],
        block: usize,
        group: usize,
        qs: &mut [i8],
        d: &mut [f32],
        sums: &mut [i16],
    ) {
        debug_assert!(crate::quant::simd_available());
        // SAFETY: reached only when `simd_available()` found AVX2, FMA and F16C (`QuantizedActivations::quantize`).
        unsafe { k_quantize(x, block, group, qs, d, sums) }
    }
}
