//! Quantize f32 rows into ggml blocks.
//!
//! Legacy types (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1) and BF16 / F16 are bit-exact with PyPI `gguf`'s
//! `gguf.quants.quantize`, which itself matches ggml's `quantize_row_*_ref` (checked against committed goldens).
//! The K types follow ggml's reference quantizers (`quantize_row_q{2,3,4,5,6}_K_ref`): for every sub-block a
//! weighted least-squares search over a few candidate scales picks the integer levels, then the sub-block scales
//! (and mins) are themselves quantized to 6 or 4 bits against an f16 super-block scale, and the levels are
//! recomputed against the rounded scales. They are not bit-exact with llama-quantize (the Q3_K level search is a
//! simpler one) but reach the same error. Measured relative RMS error `rms(dequant(quant(x)) - x) / rms(x)` on 64
//! standard gaussian rows of 4096 (the `quantize_round_trip_error_bounds` test asserts the bound row):
//!
//! | type | Q2_K | Q3_K | Q4_K | Q5_K | Q6_K | Q4_0 | Q4_1 | Q5_0 | Q5_1 | Q8_0 | BF16 | F16 |
//! |---|---|---|---|---|---|---|---|---|---|---|---|---|
//! | rmse/rms | 0.299 | 0.153 | 0.072 | 0.036 | 0.018 | 0.086 | 0.078 | 0.043 | 0.038 | 0.0053 | 0.0017 | 0.0002 |
//! | bound | 0.32 | 0.17 | 0.08 | 0.04 | 0.02 | 0.095 | 0.085 | 0.047 | 0.042 | 0.006 | 0.002 | 0.0003 |
//!
//! Every function here takes `src` of whole blocks and `dst` of exactly the matching byte count (checked by
//! [`super::quantize`]); rows are independent, so callers parallelize by row. No allocation.

use bytemuck::cast_slice_mut;

use super::blocks::*;
use super::types::QK_K;

/// ggml's `nearest_int`: round to nearest, ties to even, for |v| < 2^22 (larger values are clamped first, NaN
/// gives an arbitrary integer that callers clamp into range).
#[inline]
fn nearest_int(v: f32) -> i32 {
    let v = v.clamp(-4_194_303.0, 4_194_303.0);
    ((v + 12_582_912.0).to_bits() & 0x007F_FFFF) as i32 - 0x0040_0000
}

// ---- scalar element types -------------------------------------------------------------------------------------

pub(crate) fn quantize_f32(src: &[f32], dst: &mut [u8]) {
    for (v, d) in src.iter().zip(dst.chunks_exact_mut(4)) {
        d.copy_from_slice(&v.to_le_bytes());
    }
}

/// numpy's `astype(np.float16)`: round to nearest even.
pub(crate) fn quantize_f16(src: &[f32], dst: &mut [u8]) {
    for (v, d) in src.iter().zip(dst.chunks_exact_mut(2)) {
        d.copy_from_slice(&F16Bits::from_f32(*v).0);
    }
}

/// ggml's `ggml_compute_fp32_to_bf16`: NaN becomes a quiet NaN keeping sign and top payload bits, everything
/// else rounds to nearest even.
pub(crate) fn quantize_bf16(src: &[f32], dst: &mut [u8]) {
    for (v, d) in src.iter().zip(dst.chunks_exact_mut(2)) {
        d.copy_from_slice(&f32_to_bf16(*v).to_le_bytes());
    }
}

#[inline]
pub(crate) fn f32_to_bf16(v: f32) -> u16 {
    let n = v.to_bits();
    if n & 0x7FFF_FFFF > 0x7F80_0000 {
        return ((n >> 16) | 64) as u16;
    }
    ((n as u64 + 0x7FFF + ((n >> 16) & 1) as u64) >> 16) as u16
}

// ---- legacy 32-element blocks (bit-exact with gguf.quants) ----------------------------------------------------

/// The element of largest magnitude (the first one on ties) and that magnitude.
#[inline]
fn signed_absmax(x: &[f32]) -> f32 {
    let mut best = 0f32;
    let mut best_abs = 0f32;
    for &v in x {
        if v.abs() > best_abs {
            best_abs = v.abs();
            best = v;
        }
    }
    best
}

#[inline]
fn min_max(x: &[f32]) -> (f32, f32) {
    x.iter().fold((f32::INFINITY, f32::NEG_INFINITY), |(lo, hi), &v| {
        (lo.min(v), hi.max(v))
    })
}

#[inline]
fn inverse_or_zero(d: f32) -> f32 {
    if d == 0.0 { 0.0 } else { 1.0 / d }
}

/// Symmetric codes `trunc(x * id + offset)` clamped to `0..=qmax` (`quantize_row_q4_0_ref` / `q5_0`).
#[inline]
fn trunc_code(v: f32, qmax: i32) -> u8 {
    (v.trunc() as i32).clamp(0, qmax) as u8
}

/// `quantize_row_q4_0_ref`: `d = max / -8` (max the signed element of largest magnitude), codes
/// `trunc(x / d + 8.5)` clamped to 0..=15.
pub(crate) fn quantize_q4_0(src: &[f32], dst: &mut [u8]) {
    let blocks: &mut [BlockQ4_0] = cast_slice_mut(dst);
    for (b, x) in blocks.iter_mut().zip(src.chunks_exact(32)) {
        let d = signed_absmax(x) / -8.0;
        let id = inverse_or_zero(d);
        b.d = F16Bits::from_f32(d);
        for j in 0..16 {
            let lo = trunc_code(x[j] * id + 8.5, 15);
            let hi = trunc_code(x[j + 16] * id + 8.5, 15);
            b.qs[j] = lo | (hi << 4);
        }
    }
}

/// `quantize_row_q4_1_ref`: `d = (max - min) / 15`, `m = min`, codes `trunc((x - min) / d + 0.5)`.
pub(crate) fn quantize_q4_1(src: &[f32], dst: &mut [u8]) {
    let blocks: &mut [BlockQ4_1] = cast_slice_mut(dst);
    for (b, x) in blocks.iter_mut().zip(src.chunks_exact(32)) {
        let (min, max) = min_max(x);
        let d = (max - min) / 15.0;
        let id = inverse_or_zero(d);
        b.d = F16Bits::from_f32(d);
        b.m = F16Bits::from_f32(min);
        for j in 0..16 {
            let lo = trunc_code((x[j] - min) * id + 0.5, 15);
            let hi = trunc_code((x[j + 16] - min) * id + 0.5, 15);
            b.qs[j] = lo | (hi << 4);
        }
    }
}

/// `quantize_row_q5_0_ref`: `d = max / -16`, codes `trunc(x / d + 16.5)` clamped to 0..=31.
pub(crate) fn quantize_q5_0(src: &[f32], dst: &mut [u8]) {
    let blocks: &mut [BlockQ5_0] = cast_slice_mut(dst);
    for (b, x) in blocks.iter_mut().zip(src.chunks_exact(32)) {
        let d = signed_absmax(x) / -16.0;
        let id = inverse_or_zero(d);
        b.d = F16Bits::from_f32(d);
        let mut qh = 0u32;
        for j in 0..16 {
            let lo = trunc_code(x[j] * id + 16.5, 31);
            let hi = trunc_code(x[j + 16] * id + 16.5, 31);
            b.qs[j] = (lo & 0x0F) | ((hi & 0x0F) << 4);
            qh |= ((lo >> 4) as u32) << j | ((hi >> 4) as u32) << (j + 16);
        }
        b.qh = qh.to_le_bytes();
    }
}

/// `quantize_row_q5_1_ref`: `d = (max - min) / 31`, `m = min`, codes `trunc((x - min) / d + 0.5)`.
pub(crate) fn quantize_q5_1(src: &[f32], dst: &mut [u8]) {
    let blocks: &mut [BlockQ5_1] = cast_slice_mut(dst);
    for (b, x) in blocks.iter_mut().zip(src.chunks_exact(32)) {
        let (min, max) = min_max(x);
        let d = (max - min) / 31.0;
        let id = inverse_or_zero(d);
        b.d = F16Bits::from_f32(d);
        b.m = F16Bits::from_f32(min);
        let mut qh = 0u32;
        for j in 0..16 {
            let lo = trunc_code((x[j] - min) * id + 0.5, 31);
            let hi = trunc_code((x[j + 16] - min) * id + 0.5, 31);
            b.qs[j] = (lo & 0x0F) | ((hi & 0x0F) << 4);
            qh |= ((lo >> 4) as u32) << j | ((hi >> 4) as u32) << (j + 16);
        }
        b.qh = qh.to_le_bytes();
    }
}

/// `quantize_row_q8_0_ref`: `d = max|x| / 127`, codes `round(x / d)` (half away from zero).
pub(crate) fn quantize_q8_0(src: &[f32], dst: &mut [u8]) {
    let blocks: &mut [BlockQ8_0] = cast_slice_mut(dst);
    for (b, x) in blocks.iter_mut().zip(src.chunks_exact(32)) {
        let amax = x.iter().fold(0f32, |a, v| a.max(v.abs()));
        let d = amax / 127.0;
        let id = inverse_or_zero(d);
        b.d = F16Bits::from_f32(d);
        for (q, &v) in b.qs.iter_mut().zip(x) {
            *q = (v * id).round().clamp(-128.0, 127.0) as i8;
        }
    }
}

// ---- K quants -------------------------------------------------------------------------------------------------

/// Fits `x[i] ≈ scale * L[i] - min` with integer levels `L[i]` in `0..=nmax` and `min >= 0`, minimizing the
/// `w`-weighted squared (or, with `use_mad`, absolute) error: ggml's `make_qkx2_quants`, written anew.
///
/// Starts from the plain min/max grid, then tries `nstep + 1` grid densities `(nmax + rmin + rdelta * k) /
/// (max - min)`; for each, rounds the levels and solves the 2×2 weighted least-squares system for scale and min,
/// keeping the best. Returns `(scale, min)`; `levels` receives L.
#[allow(clippy::too_many_arguments)]
fn fit_scale_min(
    x: &[f32],
    w: &[f32],
    nmax: i32,
    levels: &mut [u8],
    rmin: f32,
    rdelta: f32,
    nstep: i32,
    use_mad: bool,
) -> (f32, f32) {
    let (mut lo, hi) = min_max(x);
    lo = lo.min(0.0);
    if hi == lo {
        levels.fill(0);
        return (0.0, -lo);
    }
    let err = |v: f32| if use_mad { v.abs() } else { v * v };
    let sum_w: f32 = w.iter().sum();
    let sum_x: f32 = x.iter().zip(w).map(|(x, w)| x * w).sum();
    let sum_x2: f32 = x.iter().zip(w).map(|(x, w)| x * x * w).sum();

    let iscale = nmax as f32 / (hi - lo);
    let mut scale = 1.0 / iscale;
    let mut min = lo;
    let mut best = 0f32;
    for ((l, &v), &wi) in levels.iter_mut().zip(x).zip(w) {
        *l = nearest_int(iscale * (v - lo)).clamp(0, nmax) as u8;
        best += wi * err(scale * *l as f32 + lo - v);
    }

    let mut trial = [0u8; 32];
    let trial = &mut trial[..x.len()];
    for k in 0..=nstep {
        let iscale = (rmin + rdelta * k as f32 + nmax as f32) / (hi - lo);
        let (mut sum_l, mut sum_l2, mut sum_xl) = (0f32, 0f32, 0f32);
        for ((l, &v), &wi) in trial.iter_mut().zip(x).zip(w) {
            let q = nearest_int(iscale * (v - lo)).clamp(0, nmax);
            *l = q as u8;
            let q = q as f32;
            sum_l += wi * q;
            sum_l2 += wi * q * q;
            sum_xl += wi * q * v;
        }
        let det = sum_w * sum_l2 - sum_l * sum_l;
        if det <= 0.0 {
            continue;
        }
        let mut this_scale = (sum_w * sum_xl - sum_x * sum_l) / det;
        let mut this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det;
        if this_min > 0.0 {
            this_min = 0.0;
            this_scale = sum_xl / sum_l2;
        }
        // The squared error expands into sums this pass already has (plus the constant Σw·x²), which halves the
        // work of the search; the absolute error has no such expansion.
        let cur: f32 = if use_mad {
            trial
                .iter()
                .zip(x)
                .zip(w)
                .map(|((&l, &v), &wi)| wi * err(this_scale * l as f32 + this_min - v))
                .sum()
        } else {
            let (s, m) = (this_scale, this_min);
            s * s * sum_l2 + 2.0 * s * m * sum_l - 2.0 * s * sum_xl + m * m * sum_w - 2.0 * m * sum_x + sum_x2
        };
        if cur < best {
            levels.copy_from_slice(trial);
            best = cur;
            scale = this_scale;
            min = this_min;
        }
    }
    (scale, -min)
}

/// Fits `x[i] ≈ scale * q[i]` with integer `q[i]` in `-nmax..nmax`, weighting each element by `x[i]²`: ggml's
/// `make_qx_quants` with `rmse_type = 1`, written anew. Tries 19 grid densities around `nmax / max|x|` and keeps
/// the one with the best weighted least-squares fit. Returns the scale; `levels` receives `q + nmax`.
fn fit_scale_symmetric(x: &[f32], nmax: i32, levels: &mut [u8]) -> f32 {
    let max = signed_absmax(x);
    if max.abs() < 1e-30 {
        levels.fill(nmax as u8);
        return 0.0;
    }
    let eval = |iscale: f32, levels: Option<&mut [u8]>| {
        let (mut sum_lx, mut sum_l2) = (0f32, 0f32);
        let mut levels = levels;
        for (i, &v) in x.iter().enumerate() {
            let q = nearest_int(iscale * v).clamp(-nmax, nmax - 1);
            if let Some(levels) = levels.as_deref_mut() {
                levels[i] = (q + nmax) as u8;
            }
            let w = v * v;
            sum_lx += w * v * q as f32;
            sum_l2 += w * (q * q) as f32;
        }
        (sum_lx, sum_l2)
    };
    let iscale = -(nmax as f32) / max;
    let (sum_lx, sum_l2) = eval(iscale, Some(levels));
    let mut scale = if sum_l2 > 0.0 { sum_lx / sum_l2 } else { 0.0 };
    let mut best = scale * sum_lx;
    for k in -9..=9 {
        if k == 0 {
            continue;
        }
        let iscale = -(nmax as f32 + 0.1 * k as f32) / max;
        let (sum_lx, sum_l2) = eval(iscale, None);
        if sum_l2 > 0.0 && sum_lx * sum_lx > best * sum_l2 {
            eval(iscale, Some(levels));
            scale = sum_lx / sum_l2;
            best = scale * sum_lx;
        }
    }
    scale
}

/// Quantizes the 8 (Q4_K, Q5_K) sub-block (scale, min) pairs to 6 bits against two f16 super-scales and packs
/// them into ggml's 12-byte layout (the inverse of [`scale_min_k4`]). Returns `(d, dmin, packed)`.
fn pack_scale_min_k4(scales: &[f32; 8], mins: &[f32; 8]) -> (F16Bits, F16Bits, [u8; 12]) {
    let max_scale = scales.iter().fold(0f32, |a, &s| a.max(s));
    let max_min = mins.iter().fold(0f32, |a, &m| a.max(m));
    let inv_scale = if max_scale > 0.0 { 63.0 / max_scale } else { 0.0 };
    let inv_min = if max_min > 0.0 { 63.0 / max_min } else { 0.0 };
    let mut packed = [0u8; 12];
    for j in 0..8 {
        let ls = nearest_int(inv_scale * scales[j]).clamp(0, 63) as u8;
        let lm = nearest_int(inv_min * mins[j]).clamp(0, 63) as u8;
        if j < 4 {
            packed[j] = ls;
            packed[j + 4] = lm;
        } else {
            packed[j + 4] = (ls & 0x0F) | ((lm & 0x0F) << 4);
            packed[j - 4] |= (ls >> 4) << 6;
            packed[j] |= (lm >> 4) << 6;
        }
    }
    (
        F16Bits::from_f32(max_scale / 63.0),
        F16Bits::from_f32(max_min / 63.0),
        packed,
    )
}

/// Levels of `x ≈ d1 * L - m1` against the rounded scales, `L` in `0..=nmax` (all 0 when `d1 == 0`).
#[inline]
fn affine_levels(x: &[f32], d1: f32, m1: f32, nmax: i32, levels: &mut [u8]) {
    if d1 == 0.0 {
        levels.fill(0);
        return;
    }
    for (l, &v) in levels.iter_mut().zip(x) {
        *l = nearest_int((v + m1) / d1).clamp(0, nmax) as u8;
    }
}

/// The shared first half of Q4_K and Q5_K: sub-block fits, packed scales, levels against the rounded scales.
fn quantize_k4_levels(
    x: &[f32],
    nmax: i32,
    rmin: f32,
    nstep: i32,
    levels: &mut [u8; QK_K],
) -> (F16Bits, F16Bits, [u8; 12]) {
    let mut scales = [0f32; 8];
    let mut mins = [0f32; 8];
    let mut w = [0f32; 32];
    for j in 0..8 {
        let xs = &x[32 * j..32 * j + 32];
        let av_x = (xs.iter().map(|v| v * v).sum::<f32>() / 32.0).sqrt();
        for (wi, &v) in w.iter_mut().zip(xs) {
            *wi = av_x + v.abs();
        }
        (scales[j], mins[j]) = fit_scale_min(xs, &w, nmax, &mut levels[32 * j..32 * j + 32], rmin, 0.1, nstep, false);
    }
    let (d, dmin, packed) = pack_scale_min_k4(&scales, &mins);
    let (d_f, dmin_f) = (d.to_f32(), dmin.to_f32());
    for j in 0..8 {
        let (sc, m) = scale_min_k4(&packed, j);
        let xs = &x[32 * j..32 * j + 32];
        affine_levels(
            xs,
            d_f * sc as f32,
            dmin_f * m as f32,
            nmax,
            &mut levels[32 * j..32 * j + 32],
        );
    }
    (d, dmin, packed)
}

/// `quantize_row_q4_K_ref`.
pub(crate) fn quantize_q4_k(src: &[f32], dst: &mut [u8]) {
    let blocks: &mut [BlockQ4K] = cast_slice_mut(dst);
    let mut levels = [0u8; QK_K];
    for (b, x) in blocks.iter_mut().zip(src.chunks_exact(QK_K)) {
        (b.d, b.dmin, b.scales) = quantize_k4_levels(x, 15, -1.0, 20, &mut levels);
        for c in 0..4 {
            for l in 0..32 {
                b.qs[32 * c + l] = levels[64 * c + l] | (levels[64 * c + 32 + l] << 4);
            }
        }
    }
}

/// `quantize_row_q5_K_ref`.
pub(crate) fn quantize_q5_k(src: &[f32], dst: &mut [u8]) {
    let blocks: &mut [BlockQ5K] = cast_slice_mut(dst);
    let mut levels = [0u8; QK_K];
    for (b, x) in blocks.iter_mut().zip(src.chunks_exact(QK_K)) {
        (b.d, b.dmin, b.scales) = quantize_k4_levels(x, 31, -0.5, 15, &mut levels);
        b.qh = [0; 32];
        for c in 0..4 {
            for l in 0..32 {
                let (lo, hi) = (levels[64 * c + l], levels[64 * c + 32 + l]);
                b.qs[32 * c + l] = (lo & 0x0F) | ((hi & 0x0F) << 4);
                b.qh[l] |= ((lo >> 4) << (2 * c)) | ((hi >> 4) << (2 * c + 1));
            }
        }
    }
}

/// `quantize_row_q6_K_ref`: 16 symmetric sub-block fits (levels -32..32), i8 sub-block scales against one f16
/// super-scale, levels recomputed against the rounded scales.
pub(crate) fn quantize_q6_k(src: &[f32], dst: &mut [u8]) {
    let blocks: &mut [BlockQ6K] = cast_slice_mut(dst);
    let mut levels = [0u8; QK_K];
    for (b, x) in blocks.iter_mut().zip(src.chunks_exact(QK_K)) {
        let mut scales = [0f32; 16];
        let mut max_scale = 0f32;
        for (j, s) in scales.iter_mut().enumerate() {
            *s = fit_scale_symmetric(&x[16 * j..16 * j + 16], 32, &mut levels[16 * j..16 * j + 16]);
            if s.abs() > max_scale.abs() {
                max_scale = *s;
            }
        }
        if max_scale.abs() < 1e-30 {
            *b = BlockQ6K {
                ql: [0; 128],
                qh: [0; 64],
                scales: [0; 16],
                d: F16Bits::default(),
            };
            continue;
        }
        let iscale = -128.0 / max_scale;
        b.d = F16Bits::from_f32(1.0 / iscale);
        let d = b.d.to_f32();
        for j in 0..16 {
            let sc = nearest_int(iscale * scales[j]).clamp(-128, 127) as i8;
            b.scales[j] = sc;
            let d1 = d * sc as f32;
            for (l, &v) in levels[16 * j..16 * j + 16].iter_mut().zip(&x[16 * j..16 * j + 16]) {
                *l = if d1 == 0.0 {
                    32
                } else {
                    (nearest_int(v / d1).clamp(-32, 31) + 32) as u8
                };
            }
        }
        for h in 0..2 {
            for l in 0..32 {
                let q = |s: usize| levels[128 * h + 32 * s + l];
                b.ql[64 * h + l] = (q(0) & 0x0F) | ((q(2) & 0x0F) << 4);
                b.ql[64 * h + 32 + l] = (q(1) & 0x0F) | ((q(3) & 0x0F) << 4);
                b.qh[32 * h + l] = (q(0) >> 4) | ((q(1) >> 4) << 2) | ((q(2) >> 4) << 4) | ((q(3) >> 4) << 6);
            }
        }
    }
}

/// `quantize_row_q3_K_ref`: 16 symmetric sub-block fits (levels -4..4), 6-bit signed sub-block scales against
/// one f16 super-scale, levels recomputed against the rounded scales. (ggml refines each level with
/// `make_q3_quants`; this uses the same search as Q6_K.)
pub(crate) fn quantize_q3_k(src: &[f32], dst: &mut [u8]) {
    let blocks: &mut [BlockQ3K] = cast_slice_mut(dst);
    let mut levels = [0u8; QK_K];
    for (b, x) in blocks.iter_mut().zip(src.chunks_exact(QK_K)) {
        let mut scales = [0f32; 16];
        let mut max_scale = 0f32;
        for (j, s) in scales.iter_mut().enumerate() {
            *s = fit_scale_symmetric(&x[16 * j..16 * j + 16], 4, &mut levels[16 * j..16 * j + 16]);
            if s.abs() > max_scale.abs() {
                max_scale = *s;
            }
        }
        b.hmask = [0; 32];
        b.qs = [0; 64];
        b.scales = [0; 12];
        let (iscale, d) = if max_scale.abs() < 1e-30 {
            (0.0, F16Bits::default())
        } else {
            let iscale = -32.0 / max_scale;
            (iscale, F16Bits::from_f32(1.0 / iscale))
        };
        b.d = d;
        let d = d.to_f32();
        for j in 0..16 {
            let stored = (nearest_int(iscale * scales[j]).clamp(-32, 31) + 32) as u8;
            b.scales[j % 8] |= (stored & 0x0F) << (4 * (j / 8));
            b.scales[8 + j % 4] |= (stored >> 4) << (2 * (j / 4));
            let d1 = d * (stored as i32 - 32) as f32;
            for (l, &v) in levels[16 * j..16 * j + 16].iter_mut().zip(&x[16 * j..16 * j + 16]) {
                *l = if d1 == 0.0 {
                    4
                } else {
                    (nearest_int(v / d1).clamp(-4, 3) + 4) as u8
                };
            }
        }
        for h in 0..2 {
            for s in 0..4 {
                for l in 0..32 {
                    let mut q = levels[128 * h + 32 * s + l];
                    if q > 3 {
                        b.hmask[l] |= 1 << (4 * h + s);
                        q -= 4;
                    }
                    b.qs[32 * h + l] |= q << (2 * s);
                }
            }
        }
    }
}

/// `quantize_row_q2_K_ref`: 16 affine sub-block fits (levels 0..=3, absolute-error search), 4-bit sub-block
/// scales and mins against two f16 super-scales, levels recomputed against the rounded scales.
pub(crate) fn quantize_q2_k(src: &[f32], dst: &mut [u8]) {
    let blocks: &mut [BlockQ2K] = cast_slice_mut(dst);
    let mut levels = [0u8; QK_K];
    let mut w = [0f32; 16];
    for (b, x) in blocks.iter_mut().zip(src.chunks_exact(QK_K)) {
        let mut scales = [0f32; 16];
        let mut mins = [0f32; 16];
        for j in 0..16 {
            let xs = &x[16 * j..16 * j + 16];
            for (wi, &v) in w.iter_mut().zip(xs) {
                *wi = v.abs();
            }
            (scales[j], mins[j]) = fit_scale_min(xs, &w, 3, &mut levels[16 * j..16 * j + 16], -0.5, 0.1, 15, true);
        }
        let max_scale = scales.iter().fold(0f32, |a, &s| a.max(s));
        let max_min = mins.iter().fold(0f32, |a, &m| a.max(m));
        let inv_scale = if max_scale > 0.0 { 15.0 / max_scale } else { 0.0 };
        let inv_min = if max_min > 0.0 { 15.0 / max_min } else { 0.0 };
        b.d = F16Bits::from_f32(max_scale / 15.0);
        b.dmin = F16Bits::from_f32(max_min / 15.0);
        let (d, dmin) = (b.d.to_f32(), b.dmin.to_f32());
        for j in 0..16 {
            let ls = nearest_int(inv_scale * scales[j]).clamp(0, 15) as u8;
            let lm = nearest_int(inv_min * mins[j]).clamp(0, 15) as u8;
            b.scales[j] = ls | (lm << 4);
            let xs = &x[16 * j..16 * j + 16];
            affine_levels(xs, d * ls as f32, dmin * lm as f32, 3, &mut levels[16 * j..16 * j + 16]);
        }
        b.qs = [0; 64];
        for h in 0..2 {
            for s in 0..4 {
                for l in 0..32 {
                    b.qs[32 * h + l] |= levels[128 * h + 32 * s + l] << (2 * s);
                }
            }
        }
    }
}
