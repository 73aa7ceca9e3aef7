//! AVX2 kernels over rows packed eight at a time (`super::packed`, whose module docs give the layout and the
//! float order these follow bit for bit).
//!
//! Per block of a group and per token: the 8 rows' integer sums in one register (lane `r` is row `r`), built from
//! 32-byte loads of the packed codes and 4 of the token's activation codes broadcast to every lane: one
//! `vpdpbusd` per 4 codes where the CPU has AVX-512 VNNI ([`super::avx2_int8::vnni_available`]), else
//! `vpmaddubsw` and `vpmaddwd`. Both give the same exact integers (Q4's nibble pairs sum to at most 2·15·127 per
//! i16 lane, and eight of them to 30,480; Q8_0's non-VNNI path moves the weight's sign onto the activation as
//! `avx2_int8` does, so its pairs stay below 2^15). Then one `vcvtdq2ps` and one FMA by the 8 rows' `d_w` times
//! the token's `d_x` (and for Q4_1 one more FMA of the 8 mins by the token's `s_x`).
//!
//! Safety: the kernels are reached only through the entries at the bottom, handed out by
//! [`super::packed::kernel`] after [`super::simd_available`]; the VNNI forms only where VNNI was found. Every
//! read goes through a slice whose length was checked for the whole call.

use std::arch::x86_64::*;

use super::activations::{ActivationFormat, ActivationVector};
use super::avx2::{ld128, ld256};
use super::avx2_int8::{dpbusd, vnni_available};
use super::packed::ROWS;
#[cfg(test)]
use super::types::GgmlType;

/// Which packed layout a kernel reads.
const Q4_0: u8 = 0;
const Q4_1: u8 = 1;
const Q8_0: u8 = 2;

/// Bytes of one block of a group of layout `K`.
const fn block_bytes(k: u8) -> usize {
    match k {
        Q4_0 => 144,
        Q4_1 => 160,
        _ => 272,
    }
}

/// 4 activation codes (`q[at..at + 4]`) in every i32 lane.
///
/// # Safety
/// `at + 4 <= q.len()`.
#[inline(always)]
unsafe fn bcast4(q: &[i8], at: usize) -> __m256i {
    // SAFETY: the caller's; an unaligned 4-byte read.
    unsafe { _mm256_set1_epi32(std::ptr::read_unaligned(q.as_ptr().add(at) as *const i32)) }
}

/// The 8 rows of `group` (layout `K`, `nb` blocks) against `N` tokens' Q8_1 activations: `out[t]` row by row.
/// `V`: `vpdpbusd`. Tokens whose activations are not Q8_1 covering the rows give NaN.
#[target_feature(enable = "avx2,fma,f16c")]
fn k_packed<const K: u8, const N: usize, const V: bool>(
    group: &[u8],
    xs: &[ActivationVector<'_>; N],
    out: &mut [[f32; ROWS]],
) {
    const { assert!(N >= 1 && N <= 4) };
    let bb = block_bytes(K);
    let nb = group.len() / bb;
    assert!(out.len() >= N, "packed kernel: an output row per token");
    for x in xs {
        if x.format != ActivationFormat::Q8_1
            || x.qs.len() < nb * 32
            || x.d.len() < nb
            || x.sums.len() < nb
            || x.s.len() < nb
        {
            for o in out.iter_mut().take(N) {
                *o = [f32::NAN; ROWS];
            }
            return;
        }
    }
    let m4 = _mm256_set1_epi8(0x0F);
    let ones16 = _mm256_set1_epi16(1);
    let flip = _mm256_set1_epi8(-128);
    let mut acc = [_mm256_setzero_ps(); N];
    for (b, blk) in group.chunks_exact(bb).enumerate() {
        let mut s = [_mm256_setzero_si256(); N];
        // SAFETY (every `bcast4` and `get_unchecked` below): `b < nb`, and every token's codes cover `32 nb`
        // values and its scales and sums `nb` blocks (checked above); `blk` is `bb` bytes, read by bounded loads.
        if K == Q8_0 {
            for g in 0..8 {
                let u = ld256(&blk[16 + 32 * g..16 + 32 * g + 32]);
                if V {
                    for t in 0..N {
                        s[t] = dpbusd(s[t], u, unsafe { bcast4(xs[t].qs, 32 * b + 4 * g) });
                    }
                } else {
                    let w = _mm256_xor_si256(u, flip);
                    let aw = _mm256_abs_epi8(w);
                    for t in 0..N {
                        let x = _mm256_sign_epi8(unsafe { bcast4(xs[t].qs, 32 * b + 4 * g) }, w);
                        s[t] = _mm256_add_epi32(s[t], _mm256_madd_epi16(_mm256_maddubs_epi16(aw, x), ones16));
                    }
                }
            }
            if V {
                // The codes were stored as q + 128.
                for t in 0..N {
                    let sum = unsafe { *xs[t].sums.get_unchecked(b) } as i32;
                    s[t] = _mm256_sub_epi32(s[t], _mm256_set1_epi32(128 * sum));
                }
            }
        } else {
            let hdr = if K == Q4_1 { 32 } else { 16 };
            let mut s16 = [_mm256_setzero_si256(); N];
            for g in 0..4 {
                let r = ld256(&blk[hdr + 32 * g..hdr + 32 * g + 32]);
                let lo = _mm256_and_si256(r, m4);
                let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(r), m4);
                for t in 0..N {
                    let (xl, xh) = unsafe { (bcast4(xs[t].qs, 32 * b + 4 * g), bcast4(xs[t].qs, 32 * b + 16 + 4 * g)) };
                    if V {
                        s[t] = dpbusd(dpbusd(s[t], lo, xl), hi, xh);
                    } else {
                        let pair = _mm256_add_epi16(_mm256_maddubs_epi16(lo, xl), _mm256_maddubs_epi16(hi, xh));
                        s16[t] = _mm256_add_epi16(s16[t], pair);
                    }
                }
            }
            for t in 0..N {
                if !V {
                    s[t] = _mm256_madd_epi16(s16[t], ones16);
                }
                if K == Q4_0 {
                    // Codes are nibble - 8.
                    let sum = unsafe { *xs[t].sums.get_unchecked(b) } as i32;
                    s[t] = _mm256_sub_epi32(s[t], _mm256_set1_epi32(8 * sum));
                }
            }
        }
        let d8 = _mm256_cvtph_ps(ld128(&blk[..16]));
        for t in 0..N {
            let dx = unsafe { *xs[t].d.get_unchecked(b) };
            acc[t] = _mm256_fmadd_ps(_mm256_mul_ps(d8, _mm256_set1_ps(dx)), _mm256_cvtepi32_ps(s[t]), acc[t]);
        }
        if K == Q4_1 {
            let m8 = _mm256_cvtph_ps(ld128(&blk[16..32]));
            for t in 0..N {
                let sx = unsafe { *xs[t].s.get_unchecked(b) };
                acc[t] = _mm256_fmadd_ps(m8, _mm256_set1_ps(sx), acc[t]);
            }
        }
    }
    for t in 0..N {
        // SAFETY: `out[t]` is 8 f32s; an unaligned store.
        unsafe { _mm256_storeu_ps(out[t].as_mut_ptr(), acc[t]) };
    }
}

/// `K`'s kernel for `xs.len()` (1 to 4) tokens, with or without VNNI.
fn dispatch<const K: u8>(vnni: bool, group: &[u8], xs: &[ActivationVector<'_>], out: &mut [[f32; ROWS]]) {
    macro_rules! call {
        ($n:literal) => {{
            let xs: &[ActivationVector<'_>; $n] = xs.try_into().expect("token count");
            // SAFETY: reached only after `simd_available()` (the module docs); the VNNI form only when `vnni`
            // says the CPU has it.
            unsafe {
                if vnni {
                    k_packed::<K, $n, true>(group, xs, out)
                } else {
                    k_packed::<K, $n, false>(group, xs, out)
                }
            }
        }};
    }
    match xs.len() {
        1 => call!(1),
        2 => call!(2),
        3 => call!(3),
        4 => call!(4),
        n => panic!("packed kernel: {n} tokens (1 to 4)"),
    }
}

/// The Q4_0 [`super::packed::PackedFn`].
pub(super) fn dot_q4_0(group: &[u8], xs: &[ActivationVector<'_>], out: &mut [[f32; ROWS]]) {
    dispatch::<Q4_0>(vnni_available(), group, xs, out)
}

/// The Q4_1 [`super::packed::PackedFn`].
pub(super) fn dot_q4_1(group: &[u8], xs: &[ActivationVector<'_>], out: &mut [[f32; ROWS]]) {
    dispatch::<Q4_1>(vnni_available(), group, xs, out)
}

/// The Q8_0 [`super::packed::PackedFn`].
pub(super) fn dot_q8_0(group: &[u8], xs: &[ActivationVector<'_>], out: &mut [[f32; ROWS]]) {
    dispatch::<Q8_0>(vnni_available(), group, xs, out)
}

/// The kernel of `ty` with VNNI on or off whatever the switch says (for tests that compare the two; `vnni` only
/// where the CPU has it).
#[cfg(test)]
pub(super) fn dot_with(ty: GgmlType, vnni: bool, group: &[u8], xs: &[ActivationVector<'_>], out: &mut [[f32; ROWS]]) {
    assert!(super::simd_available() && (!vnni || crate::switches::host_vnni()));
    match ty {
        GgmlType::Q4_0 => dispatch::<Q4_0>(vnni, group, xs, out),
        GgmlType::Q4_1 => dispatch::<Q4_1>(vnni, group, xs, out),
        GgmlType::Q8_0 => dispatch::<Q8_0>(vnni, group, xs, out),
        _ => panic!("{ty} has no packed layout"),
    }
}
