//! AVX2 integer dot products (weight codes × int8 activation codes); the activations' AVX2 quantizer is in
//! `activation_codes`.
//!
//! The technique is ggml-cpu's x86 `ggml_vec_dot_*_q8_*` (arch/x86/quants.c), rewritten: unsigned weight codes
//! (nibbles, 5- and 6-bit codes, 2- and 3-bit planes) meet the signed activation bytes in `vpmaddubsw` (u8 × i8
//! pairs summed to i16, which cannot saturate here: |code| <= 63 and |q| <= 127), then `vpmaddwd` widens to i32
//! while multiplying by ones or by the integer sub-block scales. A weight offset (Q4_0's 8, Q5_0's 16, Q3_K's 4,
//! Q6_K's 32) is taken out afterwards through the activations' code sums, and mins likewise, so every block's sum
//! is exact in integers and only `d_w * d_x` (and `dmin * d_x`) are float. Signed weights (Q8_0, IQ4_NL,
//! IQ4_XS) use `vpsignb` to move the sign onto the activation (`|w| * sign(w) x`; |w| <= 128 and |x| <= 127 keep
//! the pairs below 2^15).
//!
//! The integer block sums equal the reference's (`super::int8`) exactly; the results differ only in f32
//! summation order.
//!
//! Safety: as in `avx2`: every kernel is reached through the entries at the bottom, handed out only after
//! [`super::simd_available`]; memory is read through bounds-checked slices, except in [`sum_blocks32`]'s loop, which
//! checks every token's lengths once per row and then reads unchecked.

use std::arch::x86_64::*;

use bytemuck::cast_slice;

use super::activations::{ActivationFormat, ActivationVector};
use super::avx2::{f16, hsum, ld128, ld256};
use super::blocks::*;
use super::iq_tables::{IQ2XS_GRID, IQ3S_GRID, KSIGNS_IQ2XS, KVALUES_IQ4NL};
use super::types::QK_K;

// ---- helpers --------------------------------------------------------------------------------------------------

/// 32 activation codes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn ldq(q: &[i8]) -> __m256i {
    ld256(cast_slice(&q[..32]))
}

/// `Σ` of pairs of pairs of `w[k] * x[k]` (w unsigned, x signed): 8 i32 lanes, lane k covering bytes 4k..4k+4.
/// `V` ([`vnni_available`]): one `vpdpbusd` instead of `vpmaddubsw` and `vpmaddwd`; the same sums (the pairs
/// never saturate here, see the module docs).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn mul_sum_u8_i8<const V: bool>(w: __m256i, x: __m256i) -> __m256i {
    if V {
        dpbusd(_mm256_setzero_si256(), w, x)
    } else {
        _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1))
    }
}

/// `acc + Σ` of quadruples of `w[k] * x[k]` (w unsigned, x signed) per i32 lane: AVX-512 VNNI's `vpdpbusd` on
/// 256-bit registers (EVEX-encoded, so AVX512VL too). Written as inline assembly so the kernels keep their AVX2
/// feature set and are compiled once for both paths; reached only where [`vnni_available`] found the CPU has it.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn dpbusd(acc: __m256i, w: __m256i, x: __m256i) -> __m256i {
    let mut acc = acc;
    // SAFETY: a register-only instruction (no memory, no stack, no flags), run only on CPUs with AVX-512 VNNI and
    // AVX512VL (the `V` entries are handed out only after `vnni_available()`).
    unsafe {
        std::arch::asm!(
            "{{evex}} vpdpbusd {acc}, {w}, {x}",
            acc = inout(ymm_reg) acc,
            w = in(ymm_reg) w,
            x = in(ymm_reg) x,
            options(pure, nomem, nostack, preserves_flags),
        );
    }
    acc
}

/// Whether the kernels' `V` forms run: this CPU has AVX-512 VNNI and AVX512VL, and `STRATA_CPU_VNNI` is not off
/// (read once). The results are the same bits either way.
pub(super) fn vnni_available() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| crate::switches::speed_on(crate::switches::CPU_VNNI, &crate::switches::Target::host()))
}

/// The 32 nibbles of a 16-byte `qs` in element order: low nibbles (elements 0..16), then high.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn nibbles32(qs: &[u8]) -> __m256i {
    let q = ld128(qs);
    _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16::<4>(q), q), _mm256_set1_epi8(0x0F))
}

/// Bytes 0xFF where bit k of `bits` is set (byte k), else 0.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn bits_to_bytes32(bits: u32) -> __m256i {
    let v = _mm256_shuffle_epi8(
        _mm256_set1_epi32(bits as i32),
        _mm256_setr_epi8(
            0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3,
        ),
    );
    let sel = _mm256_set1_epi64x(0x8040_2010_0804_0201_u64 as i64);
    _mm256_cmpeq_epi8(_mm256_and_si256(v, sel), sel)
}

/// Two sub-block scales as i16: `lo` for bytes 0..16 of a 32-byte group, `hi` for bytes 16..32.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn scale_pair(lo: i32, hi: i32) -> __m256i {
    _mm256_set_m128i(_mm_set1_epi16(hi as i16), _mm_set1_epi16(lo as i16))
}

/// One token's side of a 32-value kernel: its activation codes, scales, code sums and `d Σq`, per block.
#[derive(Clone, Copy)]
struct Act32<'a> {
    qs: &'a [[i8; 32]],
    ds: &'a [f32],
    sums: &'a [i16],
    ss: &'a [f32],
}

/// The blocks and each of `N` tokens' activations that both sides cover, for Q8_1 activations (`None` when a
/// token's are in another format). All tokens cover the same blocks: the fewest any of them, or the row, has.
#[inline(always)]
fn split32<'a, B: QuantBlock, const N: usize>(
    row: &'a [u8],
    xs: &[ActivationVector<'a>; N],
) -> Option<(&'a [B], [Act32<'a>; N])> {
    let mut n = row.len() / size_of::<B>();
    for x in xs {
        if x.format != ActivationFormat::Q8_1 {
            return None;
        }
        n = n.min(x.qs.len() / 32).min(x.d.len()).min(x.sums.len()).min(x.s.len());
    }
    // A loop, not `array::map`: the closure was not inlined, and cost 5% of a 4-token matmul.
    let mut acts = [Act32 {
        qs: &[],
        ds: &[],
        sums: &[],
        ss: &[],
    }; N];
    for (a, x) in acts.iter_mut().zip(xs) {
        *a = Act32 {
            qs: &x.qs.as_chunks::<32>().0[..n],
            ds: &x.d[..n],
            sums: &x.sums[..n],
            ss: &x.s[..n],
        };
    }
    Some((cast_slice(&row[..n * size_of::<B>()]), acts))
}

/// One token's side of a super-block kernel: its activation codes, scales and code sums per 16 values.
#[derive(Clone, Copy)]
struct ActK<'a> {
    qs: &'a [[i8; QK_K]],
    ds: &'a [f32],
    sums: &'a [[i16; 16]],
}

/// As [`split32`] for Q8_K activations.
#[inline]
fn split_k_n<'a, B: QuantBlock, const N: usize>(
    row: &'a [u8],
    xs: &[ActivationVector<'a>; N],
) -> Option<(&'a [B], [ActK<'a>; N])> {
    let mut n = row.len() / size_of::<B>();
    for x in xs {
        if x.format != ActivationFormat::Q8_K {
            return None;
        }
        n = n.min(x.qs.len() / QK_K).min(x.d.len()).min(x.sums.len() / 16);
    }
    let mut acts = [ActK {
        qs: &[],
        ds: &[],
        sums: &[],
    }; N];
    for (a, x) in acts.iter_mut().zip(xs) {
        *a = ActK {
            qs: &x.qs.as_chunks::<QK_K>().0[..n],
            ds: &x.d[..n],
            sums: &x.sums.as_chunks::<16>().0[..n],
        };
    }
    Some((cast_slice(&row[..n * size_of::<B>()]), acts))
}

/// [`split_k_n`] for one token, as the one-token kernels take it: blocks, codes, scales, sums.
#[inline]
#[allow(clippy::type_complexity)]
fn split_k<'a, B: QuantBlock>(
    row: &'a [u8],
    x: &ActivationVector<'a>,
) -> Option<(&'a [B], &'a [[i8; QK_K]], &'a [f32], &'a [[i16; 16]])> {
    let (blocks, [a]) = split_k_n::<B, 1>(row, std::array::from_ref(x))?;
    Some((blocks, a.qs, a.ds, a.sums))
}

/// The 16 code sums of a Q8_K block as i16 lanes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn ld_bsums(s: &[i16; 16]) -> __m256i {
    ld256(cast_slice(s))
}

// ---- 32-value blocks × Q8_1 -----------------------------------------------------------------------------------

/// The loop every 32-value kernel shares, for `N` tokens at once (`N` at most 4). `unpack(block)` gives what a
/// block's weights are for every token, worked out once: its codes, `d_w` and `m_w` (the min; 0 without one).
/// `term(codes, activation codes, Σq)` gives one token's 8 lanes of exact integer sums. The block's float terms
/// are `d_w d_x` times those sums and, when `MIN`, `m_w s` (`s` is the activation block's `d Σq` as ggml's Q8_1
/// stores it).
///
/// Two blocks per step into two accumulators per token, so one block's multiply-add latency does not hold up the
/// next. A token's float operations are the same, in the same order, whatever `N` is and whichever tokens share the call:
/// a token's result is bit for bit its one-token result (what keeps a batch from changing an answer).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn sum_blocks32<B: QuantBlock, W: Copy, const N: usize, const MIN: bool>(
    blocks: &[B],
    xs: &[Act32<'_>; N],
    unpack: impl Fn(&B) -> (W, f32, f32),
    term: impl Fn(W, &[i8; 32], i16) -> __m256i,
) -> [f32; N] {
    const { assert!(N >= 1 && N <= 4) };
    let n = blocks.len();
    // Bounds checked once here for every token, so the loop below reads without a check per block and token
    // (they cost as much as the arithmetic in a 4-token call).
    // (A loop, not `Iterator::all`: a closure handed to a function without these target features is not inlined.)
    for x in xs {
        assert!(x.qs.len() >= n && x.ds.len() >= n && x.sums.len() >= n && x.ss.len() >= n);
    }
    // SAFETY (every `at` below): `j < n`, and each slice of every token holds at least `n` items (asserted above).
    let at = |v: &[f32], j: usize| unsafe { *v.get_unchecked(j) };
    /// # Safety
    /// `j` is below the lengths of `x.qs` and `x.sums`.
    #[inline(always)]
    unsafe fn q_at<'a>(x: &Act32<'a>, j: usize) -> (&'a [i8; 32], i16) {
        // SAFETY: the caller's.
        unsafe { (x.qs.get_unchecked(j), *x.sums.get_unchecked(j)) }
    }
    let mut acc0 = [_mm256_setzero_ps(); N];
    let mut acc1 = [_mm256_setzero_ps(); N];
    let (mut min0, mut min1) = ([0f32; N], [0f32; N]);
    for i in 0..n / 2 {
        let (j, k) = (2 * i, 2 * i + 1);
        let ((wj, dj, mj), (wk, dk, mk)) = (unpack(&blocks[j]), unpack(&blocks[k]));
        for t in 0..N {
            let x = &xs[t];
            let ((qj, sj), (qk, sk)) = unsafe { (q_at(x, j), q_at(x, k)) };
            let (p0, p1) = (term(wj, qj, sj), term(wk, qk, sk));
            acc0[t] = _mm256_fmadd_ps(_mm256_set1_ps(dj * at(x.ds, j)), _mm256_cvtepi32_ps(p0), acc0[t]);
            acc1[t] = _mm256_fmadd_ps(_mm256_set1_ps(dk * at(x.ds, k)), _mm256_cvtepi32_ps(p1), acc1[t]);
        }
        if MIN {
            for t in 0..N {
                min0[t] += mj * at(xs[t].ss, j);
                min1[t] += mk * at(xs[t].ss, k);
            }
        }
    }
    if n % 2 == 1 {
        let j = n - 1;
        let (wj, dj, mj) = unpack(&blocks[j]);
        for t in 0..N {
            let x = &xs[t];
            let (qj, sj) = unsafe { q_at(x, j) };
            let p0 = term(wj, qj, sj);
            acc0[t] = _mm256_fmadd_ps(_mm256_set1_ps(dj * at(x.ds, j)), _mm256_cvtepi32_ps(p0), acc0[t]);
        }
        if MIN {
            for t in 0..N {
                min0[t] += mj * at(xs[t].ss, j);
            }
        }
    }
    // A loop, not `array::from_fn`: a closure handed to a function without these target features is not inlined.
    let mut out = [0f32; N];
    for t in 0..N {
        out[t] = hsum(_mm256_add_ps(acc0[t], acc1[t])) + (min0[t] + min1[t]);
    }
    out
}

/// Q4_0 × Q8_1 (`ggml_vec_dot_q4_0_q8_0`): `d_w d_x (Σ nibble·q - 8 Σ q)`.
#[target_feature(enable = "avx2,fma,f16c")]
fn k_q4_0<const N: usize, const V: bool>(row: &[u8], xs: &[ActivationVector<'_>; N]) -> [f32; N] {
    let Some((blocks, acts)) = split32::<BlockQ4_0, N>(row, xs) else {
        return [f32::NAN; N];
    };
    let unpack = |b: &BlockQ4_0| (nibbles32(&b.qs), f16(b.d), 0.0);
    sum_blocks32::<_, _, N, false>(blocks, &acts, unpack, |w, q, s| {
        // 8 lanes minus Σq each: minus 8 Σq in total.
        _mm256_sub_epi32(mul_sum_u8_i8::<V>(w, ldq(q)), _mm256_set1_epi32(s as i32))
    })
}

/// Q4_1 × Q8_1 (`ggml_vec_dot_q4_1_q8_1`): `d_w d_x Σ nibble·q + m d_x Σ q`.
#[target_feature(enable = "avx2,fma,f16c")]
fn k_q4_1<const N: usize, const V: bool>(row: &[u8], xs: &[ActivationVector<'_>; N]) -> [f32; N] {
    let Some((blocks, acts)) = split32::<BlockQ4_1, N>(row, xs) else {
        return [f32::NAN; N];
    };
    let unpack = |b: &BlockQ4_1| (nibbles32(&b.qs), f16(b.d), f16(b.m));
    sum_blocks32::<_, _, N, true>(blocks, &acts, unpack, |w, q, _| mul_sum_u8_i8::<V>(w, ldq(q)))
}

/// The 32 five-bit codes (0..32) of a Q5 block.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn five_bit32(qs: &[u8], qh: [u8; 4]) -> __m256i {
    let high = _mm256_and_si256(bits_to_bytes32(u32::from_le_bytes(qh)), _mm256_set1_epi8(0x10));
    _mm256_or_si256(nibbles32(qs), high)
}

/// Q5_0 × Q8_1 (`ggml_vec_dot_q5_0_q8_0`): `d_w d_x (Σ code·q - 16 Σ q)`.
#[target_feature(enable = "avx2,fma,f16c")]
fn k_q5_0<const N: usize, const V: bool>(row: &[u8], xs: &[ActivationVector<'_>; N]) -> [f32; N] {
    let Some((blocks, acts)) = split32::<BlockQ5_0, N>(row, xs) else {
        return [f32::NAN; N];
    };
    let unpack = |b: &BlockQ5_0| (five_bit32(&b.qs, b.qh), f16(b.d), 0.0);
    sum_blocks32::<_, _, N, false>(blocks, &acts, unpack, |w, q, s| {
        _mm256_sub_epi32(mul_sum_u8_i8::<V>(w, ldq(q)), _mm256_set1_epi32(2 * s as i32))
    })
}

/// Q5_1 × Q8_1 (`ggml_vec_dot_q5_1_q8_1`).
#[target_feature(enable = "avx2,fma,f16c")]
fn k_q5_1<const N: usize, const V: bool>(row: &[u8], xs: &[ActivationVector<'_>; N]) -> [f32; N] {
    let Some((blocks, acts)) = split32::<BlockQ5_1, N>(row, xs) else {
        return [f32::NAN; N];
    };
    let unpack = |b: &BlockQ5_1| (five_bit32(&b.qs, b.qh), f16(b.d), f16(b.m));
    sum_blocks32::<_, _, N, true>(blocks, &acts, unpack, |w, q, _| mul_sum_u8_i8::<V>(w, ldq(q)))
}

/// Signed weights as `vpmaddubsw` takes them: `|w|`, and `w` whose sign goes onto the activations.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn signed(w: __m256i) -> (__m256i, __m256i) {
    (_mm256_abs_epi8(w), w)
}

/// `Σ w·x` over pairs of pairs for weights split by [`signed`] (signed weights against signed activations), with
/// `|w|` worked out once for every token.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn mul_sum_signed<const V: bool>(w: (__m256i, __m256i), x: __m256i) -> __m256i {
    mul_sum_u8_i8::<V>(w.0, _mm256_sign_epi8(x, w.1))
}

/// Q8_0 × Q8_1 (`ggml_vec_dot_q8_0_q8_0`).
#[target_feature(enable = "avx2,fma,f16c")]
fn k_q8_0<const N: usize, const V: bool>(row: &[u8], xs: &[ActivationVector<'_>; N]) -> [f32; N] {
    let Some((blocks, acts)) = split32::<BlockQ8_0, N>(row, xs) else {
        return [f32::NAN; N];
    };
    let unpack = |b: &BlockQ8_0| (signed(ldq(&b.qs)), f16(b.d), 0.0);
    sum_blocks32::<_, _, N, false>(blocks, &acts, unpack, |w, q, _| mul_sum_signed::<V>(w, ldq(q)))
}

/// IQ4_NL × Q8_1 (`ggml_vec_dot_iq4_nl_q8_0`): nibbles to levels through `vpshufb`.
#[target_feature(enable = "avx2,fma,f16c")]
fn k_iq4_nl<const N: usize, const V: bool>(row: &[u8], xs: &[ActivationVector<'_>; N]) -> [f32; N] {
    let Some((blocks, acts)) = split32::<BlockIQ4NL, N>(row, xs) else {
        return [f32::NAN; N];
    };
    let table = ld128(cast_slice(&KVALUES_IQ4NL));
    let table = _mm256_set_m128i(table, table);
    let unpack = |b: &BlockIQ4NL| (signed(_mm256_shuffle_epi8(table, nibbles32(&b.qs))), f16(b.d), 0.0);
    sum_blocks32::<_, _, N, false>(blocks, &acts, unpack, |w, q, _| mul_sum_signed::<V>(w, ldq(q)))
}

// ---- super-blocks × Q8_K --------------------------------------------------------------------------------------

/// Q2_K × Q8_K (`ggml_vec_dot_q2_K_q8_K`): 2-bit codes, 4-bit scales and mins per 16 values.
#[target_feature(enable = "avx2,fma,f16c")]
fn k_q2_k(row: &[u8], x: &ActivationVector<'_>) -> f32 {
    let Some((blocks, qs, ds, sums)) = split_k::<BlockQ2K>(row, x) else {
        return f32::NAN;
    };
    let three = _mm256_set1_epi8(3);
    let mut acc = _mm256_setzero_ps();
    for (((b, q), &dx), bs) in blocks.iter().zip(qs).zip(ds).zip(sums) {
        let mut isum = _mm256_setzero_si256();
        for h in 0..2 {
            let qv = ld256(&b.qs[32 * h..]);
            for s in 0..4 {
                let w = _mm256_and_si256(_mm256_srl_epi16(qv, _mm_cvtsi32_si128(2 * s as i32)), three);
                let sub = 8 * h + 2 * s;
                let sc = scale_pair((b.scales[sub] & 0x0F) as i32, (b.scales[sub + 1] & 0x0F) as i32);
                let p = _mm256_maddubs_epi16(w, ldq(&q[128 * h + 32 * s..]));
                isum = _mm256_add_epi32(isum, _mm256_madd_epi16(p, sc));
            }
        }
        let mins = _mm_and_si128(_mm_srli_epi16::<4>(ld128(&b.scales)), _mm_set1_epi8(0x0F));
        let imin = _mm256_madd_epi16(ld_bsums(bs), _mm256_cvtepu8_epi16(mins));
        acc = _mm256_fmadd_ps(_mm256_set1_ps(f16(b.d) * dx), _mm256_cvtepi32_ps(isum), acc);
        acc = _mm256_fnmadd_ps(_mm256_set1_ps(f16(b.dmin) * dx), _mm256_cvtepi32_ps(imin), acc);
    }
    hsum(acc)
}

/// Q3_K × Q8_K (`ggml_vec_dot_q3_K_q8_K`): codes `lo2 + 4 hbit` (0..8), offset 4 taken out through the sums.
#[target_feature(enable = "avx2,fma,f16c")]
fn k_q3_k(row: &[u8], x: &ActivationVector<'_>) -> f32 {
    let Some((blocks, qs, ds, sums)) = split_k::<BlockQ3K>(row, x) else {
        return f32::NAN;
    };
    let (three, four) = (_mm256_set1_epi8(3), _mm256_set1_epi8(4));
    let mut acc = _mm256_setzero_ps();
    for (((b, q), &dx), bs) in blocks.iter().zip(qs).zip(ds).zip(sums) {
        let scales = scales_q3k(&b.scales);
        let hm = ld256(&b.hmask);
        let mut isum = _mm256_setzero_si256();
        for h in 0..2 {
            let qv = ld256(&b.qs[32 * h..]);
            for s in 0..4 {
                let lo = _mm256_and_si256(_mm256_srl_epi16(qv, _mm_cvtsi32_si128(2 * s as i32)), three);
                let bit = _mm256_set1_epi8((1u8 << (4 * h + s)) as i8);
                let set = _mm256_cmpeq_epi8(_mm256_and_si256(hm, bit), bit);
                let w = _mm256_or_si256(lo, _mm256_and_si256(set, four));
                let sub = 8 * h + 2 * s;
                let sc = scale_pair(scales[sub] as i32 - 32, scales[sub + 1] as i32 - 32);
                let p = _mm256_maddubs_epi16(w, ldq(&q[128 * h + 32 * s..]));
                isum = _mm256_add_epi32(isum, _mm256_madd_epi16(p, sc));
            }
        }
        let sc16 = _mm256_sub_epi16(_mm256_cvtepu8_epi16(ld128(&scales)), _mm256_set1_epi16(32));
        let offset = _mm256_madd_epi16(ld_bsums(bs), sc16);
        let isum = _mm256_sub_epi32(isum, _mm256_slli_epi32::<2>(offset));
        acc = _mm256_fmadd_ps(_mm256_set1_ps(f16(b.d) * dx), _mm256_cvtepi32_ps(isum), acc);
    }
    hsum(acc)
}

/// The 8 6-bit scales and 8 6-bit mins of a Q4_K / Q5_K block as bytes (`scale_min_k4` for j = 0..8, done on
/// whole 32-bit words).
#[inline]
fn k4_scales_mins(s: &[u8; 12]) -> (u64, u64) {
    let word = |i: usize| u32::from_le_bytes([s[i], s[i + 1], s[i + 2], s[i + 3]]);
    let (a, b, c) = (word(0), word(4), word(8));
    let sc_lo = a & 0x3F3F_3F3F;
    let m_lo = b & 0x3F3F_3F3F;
    let sc_hi = (c & 0x0F0F_0F0F) | ((a >> 6) & 0x0303_0303) << 4;
    let m_hi = ((c >> 4) & 0x0F0F_0F0F) | ((b >> 6) & 0x0303_0303) << 4;
    (sc_lo as u64 | (sc_hi as u64) << 32, m_lo as u64 | (m_hi as u64) << 32)
}

/// The loop Q4_K and Q5_K share, for `N` tokens at once: `scales(block)` gives a block's `d`, `dmin` and packed
/// 6-bit scales and mins, and `codes(block, c)` the codes of its sub-blocks 2c and 2c + 1 (32 bytes each), worked
/// out once for every token. A token's float operations are those of its one-token call, in the same order.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn k4_blocks<B: QuantBlock, const N: usize>(
    blocks: &[B],
    xs: &[ActK<'_>; N],
    scales: impl Fn(&B) -> (F16Bits, F16Bits, &[u8; 12]),
    codes: impl Fn(&B, usize) -> (__m256i, __m256i),
) -> [f32; N] {
    let mut acc = [_mm256_setzero_ps(); N];
    for (i, b) in blocks.iter().enumerate() {
        let (d, dmin, packed) = scales(b);
        let (scales, mins) = k4_scales_mins(packed);
        let mut isum = [_mm256_setzero_si256(); N];
        for c in 0..4 {
            let (lo, hi) = codes(b, c);
            let s_lo = _mm256_set1_epi16((scales >> (16 * c)) as u8 as i16);
            let s_hi = _mm256_set1_epi16((scales >> (16 * c + 8)) as u8 as i16);
            for t in 0..N {
                let q = &xs[t].qs[i];
                let p_lo = _mm256_madd_epi16(_mm256_maddubs_epi16(lo, ldq(&q[64 * c..])), s_lo);
                let p_hi = _mm256_madd_epi16(_mm256_maddubs_epi16(hi, ldq(&q[64 * c + 32..])), s_hi);
                isum[t] = _mm256_add_epi32(isum[t], _mm256_add_epi32(p_lo, p_hi));
            }
        }
        // Each min covers two groups of 16: duplicate it onto both i16 lanes `vpmaddwd` pairs.
        let m8 = _mm_cvtepu8_epi16(_mm_cvtsi64_si128(mins as i64));
        let m16 = _mm256_set_m128i(_mm_unpackhi_epi16(m8, m8), _mm_unpacklo_epi16(m8, m8));
        let (d, dmin) = (f16(d), f16(dmin));
        for t in 0..N {
            let x = &xs[t];
            let imin = _mm256_madd_epi16(ld_bsums(&x.sums[i]), m16);
            acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(d * x.ds[i]), _mm256_cvtepi32_ps(isum[t]), acc[t]);
            acc[t] = _mm256_fnmadd_ps(_mm256_set1_ps(dmin * x.ds[i]), _mm256_cvtepi32_ps(imin), acc[t]);
        }
    }
    let mut out = [0f32; N];
    for t in 0..N {
        out[t] = hsum(acc[t]);
    }
    out
}

/// Q4_K × Q8_K (`ggml_vec_dot_q4_K_q8_K`).
#[target_feature(enable = "avx2,fma,f16c")]
fn k_q4_k<const N: usize>(row: &[u8], xs: &[ActivationVector<'_>; N]) -> [f32; N] {
    let Some((blocks, acts)) = split_k_n::<BlockQ4K, N>(row, xs) else {
        return [f32::NAN; N];
    };
    let m4 = _mm256_set1_epi8(0x0F);
    let codes = |b: &BlockQ4K, c: usize| {
        let v = ld256(&b.qs[32 * c..]);
        (_mm256_and_si256(v, m4), _mm256_and_si256(_mm256_srli_epi16::<4>(v), m4))
    };
    k4_blocks(blocks, &acts, |b| (b.d, b.dmin, &b.scales), codes)
}

/// [`k_q4_k`] on 512-bit registers (AVX-512BW), bit for bit: each step takes one 32-byte group of codes as its low
/// nibbles (sub-block 2c) in the lower half and its high nibbles (2c + 1) in the upper half, against the 64
/// activation codes of the two sub-blocks (contiguous), so the upper half's lanes are [`k4_blocks`]'s `p_hi` and the
/// lower half's its `p_lo`. Folding the halves gives the same integer lanes, and the float steps are the same.
#[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
fn k_q4_k_512(row: &[u8], x: &ActivationVector<'_>) -> f32 {
    let Some((blocks, qs, ds, sums)) = split_k::<BlockQ4K>(row, x) else {
        return f32::NAN;
    };
    let m4 = _mm256_set1_epi8(0x0F);
    let mut acc = _mm256_setzero_ps();
    for (((b, q), &dx), bs) in blocks.iter().zip(qs).zip(ds).zip(sums) {
        let (scales, mins) = k4_scales_mins(&b.scales);
        let mut isum = _mm512_setzero_si512();
        for c in 0..4 {
            let v = ld256(&b.qs[32 * c..]);
            let lo = _mm256_and_si256(v, m4);
            let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(v), m4);
            let codes = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi);
            let qv = &q[64 * c..64 * c + 64];
            // SAFETY: `qv` is 64 readable bytes; the load is unaligned.
            let act = unsafe { _mm512_loadu_si512(qv.as_ptr().cast()) };
            let s_lo = _mm256_set1_epi16((scales >> (16 * c)) as u8 as i16);
            let s_hi = _mm256_set1_epi16((scales >> (16 * c + 8)) as u8 as i16);
            let sc = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(s_lo), s_hi);
            isum = _mm512_add_epi32(isum, _mm512_madd_epi16(_mm512_maddubs_epi16(codes, act), sc));
        }
        let isum = _mm256_add_epi32(_mm512_castsi512_si256(isum), _mm512_extracti64x4_epi64::<1>(isum));
        let m8 = _mm_cvtepu8_epi16(_mm_cvtsi64_si128(mins as i64));
        let m16 = _mm256_set_m128i(_mm_unpackhi_epi16(m8, m8), _mm_unpacklo_epi16(m8, m8));
        let imin = _mm256_madd_epi16(ld_bsums(bs), m16);
        acc = _mm256_fmadd_ps(_mm256_set1_ps(f16(b.d) * dx), _mm256_cvtepi32_ps(isum), acc);
        acc = _mm256_fnmadd_ps(_mm256_set1_ps(f16(b.dmin) * dx), _mm256_cvtepi32_ps(imin), acc);
    }
    hsum(acc)
}

/// Whether [`k_q4_k_512`] runs: `STRATA_CPU_AVX512=1` asks for it and this CPU has AVX-512F and BW (read once).
/// Off by default: on the H200 machine's Xeon one core reads Q4_K from L2 32% faster with it, but all cores
/// together, as the CPU's expert misses run, read 6-20% slower (`reports/2026-12-04-h200-2345a0e/`).
fn avx512bw() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| {
        crate::switches::speed_on(crate::switches::CPU_AVX512, &crate::switches::Target::host())
            && is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512bw")
    })
}

/// Q4_K × Q8_K on 512-bit registers when [`avx512bw`] says so, else [`k_q4_k`]: the same bits either way.
#[target_feature(enable = "avx2,fma,f16c")]
fn k_q4_k_any(row: &[u8], x: &ActivationVector<'_>) -> f32 {
    if avx512bw() {
        // SAFETY: `avx512bw()` found AVX-512F and BW; AVX2, FMA and F16C are this function's own features.
        unsafe { k_q4_k_512(row, x) }
    } else {
        k_q4_k::<1>(row, std::array::from_ref(x))[0]
    }
}

/// Q5_K × Q8_K (`ggml_vec_dot_q5_K_q8_K`): Q4_K plus bit j of `qh[l]` as bit 4 of sub-block j.
#[target_feature(enable = "avx2,fma,f16c")]
fn k_q5_k<const N: usize>(row: &[u8], xs: &[ActivationVector<'_>; N]) -> [f32; N] {
    let Some((blocks, acts)) = split_k_n::<BlockQ5K, N>(row, xs) else {
        return [f32::NAN; N];
    };
    let (m4, b4) = (_mm256_set1_epi8(0x0F), _mm256_set1_epi8(0x10));
    let codes = |b: &BlockQ5K, c: usize| {
        let qh = ld256(&b.qh);
        let high = |j: usize| {
            let bit = _mm256_set1_epi8((1u8 << j) as i8);
            _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qh, bit), bit), b4)
        };
        let v = ld256(&b.qs[32 * c..]);
        let lo = _mm256_or_si256(_mm256_and_si256(v, m4), high(2 * c));
        let hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16::<4>(v), m4), high(2 * c + 1));
        (lo, hi)
    };
    k4_blocks(blocks, &acts, |b| (b.d, b.dmin, &b.scales), codes)
}

/// Q6_K × Q8_K (`ggml_vec_dot_q6_K_q8_K`): 6-bit codes (0..64), offset 32 taken out through the sums. `N`
/// tokens at once, each block's codes worked out once; a token's float operations are its one-token call's.
#[target_feature(enable = "avx2,fma,f16c")]
fn k_q6_k<const N: usize>(row: &[u8], xs: &[ActivationVector<'_>; N]) -> [f32; N] {
    let Some((blocks, acts)) = split_k_n::<BlockQ6K, N>(row, xs) else {
        return [f32::NAN; N];
    };
    let (m4, m2) = (_mm256_set1_epi8(0x0F), _mm256_set1_epi8(0x03));
    let mut acc = [_mm256_setzero_ps(); N];
    for (i, b) in blocks.iter().enumerate() {
        let mut isum = [_mm256_setzero_si256(); N];
        for h in 0..2 {
            let qh = ld256(&b.qh[32 * h..]);
            for s in 0..4 {
                let ql = ld256(&b.ql[64 * h + 32 * (s & 1)..]);
                let lo = _mm256_and_si256(_mm256_srl_epi16(ql, _mm_cvtsi32_si128(4 * (s >> 1) as i32)), m4);
                let hi = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * s as i32)), m2);
                let w = _mm256_or_si256(lo, _mm256_slli_epi16::<4>(hi));
                let sub = 8 * h + 2 * s;
                let sc = scale_pair(b.scales[sub] as i32, b.scales[sub + 1] as i32);
                for t in 0..N {
                    let p = _mm256_maddubs_epi16(w, ldq(&acts[t].qs[i][128 * h + 32 * s..]));
                    isum[t] = _mm256_add_epi32(isum[t], _mm256_madd_epi16(p, sc));
                }
            }
        }
        let sc16 = _mm256_cvtepi8_epi16(ld128(cast_slice(&b.scales)));
        let d = f16(b.d);
        for t in 0..N {
            let x = &acts[t];
            let offset = _mm256_madd_epi16(ld_bsums(&x.sums[i]), sc16);
            let isum = _mm256_sub_epi32(isum[t], _mm256_slli_epi32::<5>(offset));
            acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(d * x.ds[i]), _mm256_cvtepi32_ps(isum), acc[t]);
        }
    }
    let mut out = [0f32; N];
    for t in 0..N {
        out[t] = hsum(acc[t]);
    }
    out
}

/// IQ4_XS × Q8_K (`ggml_vec_dot_iq4_xs_q8_K`): levels through `vpshufb`, 6-bit scales minus 32 per 32 values.
#[target_feature(enable = "avx2,fma,f16c")]
fn k_iq4_xs(row: &[u8], x: &ActivationVector<'_>) -> f32 {
    let Some((blocks, qs, ds, _)) = split_k::<BlockIQ4XS>(row, x) else {
        return f32::NAN;
    };
    let table = ld128(cast_slice(&KVALUES_IQ4NL));
    let table = _mm256_set_m128i(table, table);
    let mut acc = _mm256_setzero_ps();
    for ((b, q), &dx) in blocks.iter().zip(qs).zip(ds) {
        let scales_h = u16::from_le_bytes(b.scales_h);
        let mut isum = _mm256_setzero_si256();
        for i in 0..8 {
            let ls = ((b.scales_l[i / 2] >> (4 * (i % 2))) & 0x0F) | ((((scales_h >> (2 * i)) & 3) as u8) << 4);
            let w = _mm256_shuffle_epi8(table, nibbles32(&b.qs[16 * i..]));
            let xq = ldq(&q[32 * i..]);
            let p = _mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(xq, w));
            isum = _mm256_add_epi32(isum, _mm256_madd_epi16(p, _mm256_set1_epi16(ls as i16 - 32)));
        }
        acc = _mm256_fmadd_ps(_mm256_set1_ps(f16(b.d) * dx), _mm256_cvtepi32_ps(isum), acc);
    }
    hsum(acc)
}

/// `x` with the sign flipped where bit k of `bits` is set (byte k).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn apply_signs(x: __m256i, bits: u32) -> __m256i {
    _mm256_sign_epi8(x, _mm256_or_si256(bits_to_bytes32(bits), _mm256_set1_epi8(1)))
}

/// IQ3_S × Q8_K (`ggml_vec_dot_iq3_s_q8_K`): grid magnitudes (u8) times sign-flipped activations.
#[target_feature(enable = "avx2,fma,f16c")]
fn k_iq3_s(row: &[u8], x: &ActivationVector<'_>) -> f32 {
    let Some((blocks, qs, ds, _)) = split_k::<BlockIQ3S>(row, x) else {
        return f32::NAN;
    };
    let mut acc = _mm256_setzero_ps();
    for ((b, q), &dx) in blocks.iter().zip(qs).zip(ds) {
        let mut isum = _mm256_setzero_si256();
        for c in 0..8 {
            let qh = b.qh[c] as usize;
            let grid = |k: usize| IQ3S_GRID[b.qs[8 * c + k] as usize | ((qh >> k) & 1) << 8] as i32;
            let mags = _mm256_setr_epi32(grid(0), grid(1), grid(2), grid(3), grid(4), grid(5), grid(6), grid(7));
            let signs = u32::from_le_bytes([
                b.signs[4 * c],
                b.signs[4 * c + 1],
                b.signs[4 * c + 2],
                b.signs[4 * c + 3],
            ]);
            let xs = apply_signs(ldq(&q[32 * c..]), signs);
            let sc = 1 + 2 * ((b.scales[c / 2] >> (4 * (c % 2))) & 0x0F) as i16;
            let p = _mm256_maddubs_epi16(mags, xs);
            isum = _mm256_add_epi32(isum, _mm256_madd_epi16(p, _mm256_set1_epi16(sc)));
        }
        acc = _mm256_fmadd_ps(_mm256_set1_ps(f16(b.d) * dx), _mm256_cvtepi32_ps(isum), acc);
    }
    hsum(acc)
}

/// IQ2_XS × Q8_K (`ggml_vec_dot_iq2_xs_q8_K`): grid rows of 8 magnitudes, signs from `KSIGNS_IQ2XS`,
/// `d / 8 * (2 sc + 1)` per 16 values.
#[target_feature(enable = "avx2,fma,f16c")]
fn k_iq2_xs(row: &[u8], x: &ActivationVector<'_>) -> f32 {
    let Some((blocks, qs, ds, _)) = split_k::<BlockIQ2XS>(row, x) else {
        return f32::NAN;
    };
    let mut acc = _mm256_setzero_ps();
    for ((b, q), &dx) in blocks.iter().zip(qs).zip(ds) {
        let mut isum = _mm256_setzero_si256();
        for c in 0..8 {
            let code = |k: usize| u16::from_le_bytes(b.qs[4 * c + k]);
            let grid = |k: usize| IQ2XS_GRID[(code(k) & 511) as usize] as i64;
            let mags = _mm256_setr_epi64x(grid(0), grid(1), grid(2), grid(3));
            let sign = |k: usize| KSIGNS_IQ2XS[(code(k) >> 9) as usize];
            let xs = apply_signs(
                ldq(&q[32 * c..]),
                u32::from_le_bytes([sign(0), sign(1), sign(2), sign(3)]),
            );
            let sc = |j: usize| 1 + 2 * ((b.scales[j / 2] >> (4 * (j % 2))) & 0x0F) as i32;
            let p = _mm256_maddubs_epi16(mags, xs);
            isum = _mm256_add_epi32(isum, _mm256_madd_epi16(p, scale_pair(sc(2 * c), sc(2 * c + 1))));
        }
        acc = _mm256_fmadd_ps(_mm256_set1_ps(f16(b.d) * 0.125 * dx), _mm256_cvtepi32_ps(isum), acc);
    }
    hsum(acc)
}

/// [`k_q4_k`] alone (the 256-bit kernel), for the test that compares it with [`k_q4_k_512`].
#[cfg(test)]
pub(super) fn dot_q4_k_avx2(row: &[u8], x: &ActivationVector<'_>) -> f32 {
    assert!(super::simd_available());
    // SAFETY: AVX2, FMA and F16C were just found on this CPU.
    unsafe { k_q4_k::<1>(row, std::array::from_ref(x))[0] }
}

/// [`k_q4_k_512`] alone, for the same test.
#[cfg(test)]
pub(super) fn dot_q4_k_512(row: &[u8], x: &ActivationVector<'_>) -> f32 {
    assert!(is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512bw") && super::simd_available());
    // SAFETY: AVX-512F, AVX-512BW, AVX2, FMA and F16C were just found on this CPU.
    unsafe { k_q4_k_512(row, x) }
}

// ---- entries --------------------------------------------------------------------------------------------------

macro_rules! entries {
    ($($entry:ident => $kernel:ident,)*) => {$(
        #[doc = concat!("[`super::DotQ8Fn`] entry for `", stringify!($kernel), "`; only valid where `simd_available()`.")]
        pub(super) fn $entry(row: &[u8], x: &ActivationVector<'_>) -> f32 {
            debug_assert!(super::simd_available());
            // SAFETY: these entries are reached only through `super::dot_q8_fn`, which returns them only after
            // `simd_available()` found AVX2, FMA and F16C on this CPU.
            unsafe { $kernel(row, x) }
        }
    )*};
}

/// The one-token [`super::DotQ8Fn`] entry of a kernel written for `N` tokens; `kernel<V>`: a kernel with a
/// VNNI form, and an entry generic over it (`V` only where [`vnni_available`]).
macro_rules! one_token_entries {
    ($($entry:ident => $kernel:ident $(<$v:ident>)?,)*) => {$(
        #[doc = concat!("[`super::DotQ8Fn`] entry for `", stringify!($kernel), "`; only valid where `simd_available()`.")]
        pub(super) fn $entry $(<const $v: bool>)? (row: &[u8], x: &ActivationVector<'_>) -> f32 {
            // The one-token kernel behind a function of the same features, so this entry is a tail call.
            #[target_feature(enable = "avx2,fma,f16c")]
            fn one $(<const $v: bool>)? (row: &[u8], x: &ActivationVector<'_>) -> f32 {
                $kernel::<1 $(, $v)?>(row, std::array::from_ref(x))[0]
            }
            debug_assert!(super::simd_available() $(&& (!$v || vnni_available()))?);
            // SAFETY: as in `entries!` (and the VNNI form only where `vnni_available()`).
            unsafe { one $(::<$v>)? (row, x) }
        }
    )*};
}

/// The [`super::DotQ8ManyFn`] entry of a kernel written for `N` tokens: 4 tokens a call, then 2, then 1;
/// `kernel<V>` as in `one_token_entries!`.
macro_rules! many_entries {
    ($($entry:ident => $kernel:ident $(<$v:ident>)?,)*) => {$(
        #[doc = concat!("[`super::DotQ8ManyFn`] entry for `", stringify!($kernel), "`; only valid where `simd_available()`.")]
        pub(super) fn $entry $(<const $v: bool>)? (row: &[u8], xs: &[ActivationVector<'_>], out: &mut [f32]) {
            debug_assert!(super::simd_available() $(&& (!$v || vnni_available()))?);
            assert_eq!(xs.len(), out.len(), "dot_q8_many: one result per activation vector");
            let mut i = 0;
            // SAFETY: these entries are reached only through `super::dot_q8_many_fn`, which returns them only
            // after `simd_available()` found AVX2, FMA and F16C on this CPU.
            unsafe {
                while i + 4 <= xs.len() {
                    let four: &[ActivationVector<'_>; 4] = xs[i..i + 4].try_into().expect("4 vectors");
                    out[i..i + 4].copy_from_slice(&$kernel::<4 $(, $v)?>(row, four));
                    i += 4;
                }
                if i + 2 <= xs.len() {
                    let two: &[ActivationVector<'_>; 2] = xs[i..i + 2].try_into().expect("2 vectors");
                    out[i..i + 2].copy_from_slice(&$kernel::<2 $(, $v)?>(row, two));
                    i += 2;
                }
                if i < xs.len() {
                    out[i] = $kernel::<1 $(, $v)?>(row, std::array::from_ref(&xs[i]))[0];
                }
            }
        }
    )*};
}

one_token_entries! {
    dot_q4_0 => k_q4_0<V>,
    dot_q4_1 => k_q4_1<V>,
    dot_q5_0 => k_q5_0<V>,
    dot_q5_1 => k_q5_1<V>,
    dot_q8_0 => k_q8_0<V>,
    dot_iq4_nl => k_iq4_nl<V>,
    dot_q5_k => k_q5_k,
    dot_q6_k => k_q6_k,
}

many_entries! {
    dot_q4_0_many => k_q4_0<V>,
    dot_q4_1_many => k_q4_1<V>,
    dot_q5_0_many => k_q5_0<V>,
    dot_q5_1_many => k_q5_1<V>,
    dot_q8_0_many => k_q8_0<V>,
    dot_iq4_nl_many => k_iq4_nl<V>,
    dot_q4_k_many => k_q4_k,
    dot_q5_k_many => k_q5_k,
    dot_q6_k_many => k_q6_k,
}

entries! {
    dot_q2_k => k_q2_k,
    dot_q3_k => k_q3_k,
    dot_q4_k => k_q4_k_any,
    dot_iq4_xs => k_iq4_xs,
    dot_iq3_s => k_iq3_s,
    dot_iq2_xs => k_iq2_xs,
}

/// F32-activation entries: the f32 AVX2 kernels behind a [`super::DotQ8Fn`]; NaN when `x` is not F32.
macro_rules! f32_entries {
    ($($name:ident => $dot:path,)*) => {$(
        pub(super) fn $name(row: &[u8], x: &ActivationVector<'_>) -> f32 {
            if x.format != ActivationFormat::F32 {
                return f32::NAN;
            }
            $dot(row, x.f32s)
        }
    )*};
}

f32_entries! {
    dot_f32 => super::avx2::dot_f32,
    dot_f16 => super::avx2::dot_f16,
    dot_bf16 => super::avx2::dot_bf16,
}
