//! Plain integer dot products of a quantized weight row with int8 activations ([`ActivationVector`]): the
//! semantics every AVX2 kernel of `avx2_int8` is tested against.
//!
//! Each weight block is unpacked to integer codes and integer (sub-)block scales such that
//! `w = d * scale * code - dmin * min` (32-value types: `w = d * code + m`), the codes multiply the activation
//! codes in exact integer arithmetic, and one f32 expression per block applies `d`, `dmin` and the activation
//! scale. Sources: ggml's `dequantize_row_*` (the weight formulas) and ggml-cpu's `ggml_vec_dot_*_q8_*` (the
//! pairing of each weight type with Q8_0, Q8_1 or Q8_K activations).

use bytemuck::cast_slice;

use super::activations::{ActivationFormat, ActivationVector};
use super::blocks::*;
use super::iq_tables::{IQ2XS_GRID, IQ3S_GRID, KSIGNS_IQ2XS, KVALUES_IQ4NL};
use super::types::QK_K;

/// A 32-value block as integers: `w[i] = d * codes[i] + m`.
pub(crate) trait IntBlock32: QuantBlock {
    /// `(d, m, codes)`.
    fn unpack(&self) -> (f32, f32, [i8; 32]);
}

/// A 256-value super-block as integers: `w[i] = d * scales[i / 16] * codes[i] - dmin * mins[i / 16]`.
pub(crate) trait IntBlockK: QuantBlock {
    /// Fills `codes`, `scales`, `mins` and returns `(d, dmin)`.
    fn unpack(&self, codes: &mut [i8; QK_K], scales: &mut [i32; 16], mins: &mut [i32; 16]) -> (f32, f32);
}

/// Reference dot of whole 32-value blocks with Q8_1 activations. Uses the blocks both sides cover; NaN when `x`
/// is not Q8_1.
pub(crate) fn dot_blocks32<B: IntBlock32>(row: &[u8], x: &ActivationVector<'_>) -> f32 {
    if x.format != ActivationFormat::Q8_1 {
        return f32::NAN;
    }
    let n = (row.len() / size_of::<B>())
        .min(x.qs.len() / 32)
        .min(x.d.len())
        .min(x.s.len());
    let blocks: &[B] = cast_slice(&row[..n * size_of::<B>()]);
    let mut sum = 0f32;
    for (((b, q), &dx), &s) in blocks.iter().zip(x.qs.chunks_exact(32)).zip(x.d).zip(x.s) {
        let (d, m, codes) = b.unpack();
        let isum: i32 = codes.iter().zip(q).map(|(&c, &q)| c as i32 * q as i32).sum();
        sum += d * dx * isum as f32;
        if m != 0.0 {
            sum += m * s;
        }
    }
    sum
}

/// Reference dot of whole super-blocks with Q8_K activations. Uses the blocks both sides cover; NaN when `x` is
/// not Q8_K.
pub(crate) fn dot_blocks_k<B: IntBlockK>(row: &[u8], x: &ActivationVector<'_>) -> f32 {
    if x.format != ActivationFormat::Q8_K {
        return f32::NAN;
    }
    let n = (row.len() / size_of::<B>())
        .min(x.qs.len() / QK_K)
        .min(x.d.len())
        .min(x.sums.len() / 16);
    let blocks: &[B] = cast_slice(&row[..n * size_of::<B>()]);
    let (mut codes, mut scales, mut mins) = ([0i8; QK_K], [0i32; 16], [0i32; 16]);
    let mut sum = 0f32;
    for (((b, q), &dx), bsums) in blocks
        .iter()
        .zip(x.qs.chunks_exact(QK_K))
        .zip(x.d)
        .zip(x.sums.chunks_exact(16))
    {
        let (d, dmin) = b.unpack(&mut codes, &mut scales, &mut mins);
        let mut isum = 0i64;
        let mut imin = 0i64;
        for j in 0..16 {
            let part: i32 = (0..16).map(|l| codes[16 * j + l] as i32 * q[16 * j + l] as i32).sum();
            isum += scales[j] as i64 * part as i64;
            imin += mins[j] as i64 * bsums[j] as i64;
        }
        sum += d * dx * isum as f32;
        if dmin != 0.0 {
            sum -= dmin * dx * imin as f32;
        }
    }
    sum
}

// ---- 32-value blocks ------------------------------------------------------------------------------------------

/// The 32 nibbles of a 16-byte `qs` in element order (low nibbles, then high), minus `offset`.
fn nibble_codes(qs: &[u8; 16], offset: i8) -> [i8; 32] {
    let mut c = [0i8; 32];
    for (j, &q) in qs.iter().enumerate() {
        c[j] = (q & 0x0F) as i8 - offset;
        c[j + 16] = (q >> 4) as i8 - offset;
    }
    c
}

/// Q5 codes: nibbles plus bit j of `qh` as bit 4 of element j, minus `offset`.
fn five_bit_codes(qs: &[u8; 16], qh: [u8; 4], offset: i8) -> [i8; 32] {
    let mut c = nibble_codes(qs, 0);
    let qh = u32::from_le_bytes(qh);
    for (j, c) in c.iter_mut().enumerate() {
        *c = (*c | (((qh >> j) & 1) << 4) as i8) - offset;
    }
    c
}

impl IntBlock32 for BlockQ4_0 {
    fn unpack(&self) -> (f32, f32, [i8; 32]) {
        (self.d.to_f32(), 0.0, nibble_codes(&self.qs, 8))
    }
}

impl IntBlock32 for BlockQ4_1 {
    fn unpack(&self) -> (f32, f32, [i8; 32]) {
        (self.d.to_f32(), self.m.to_f32(), nibble_codes(&self.qs, 0))
    }
}

impl IntBlock32 for BlockQ5_0 {
    fn unpack(&self) -> (f32, f32, [i8; 32]) {
        (self.d.to_f32(), 0.0, five_bit_codes(&self.qs, self.qh, 16))
    }
}

impl IntBlock32 for BlockQ5_1 {
    fn unpack(&self) -> (f32, f32, [i8; 32]) {
        (self.d.to_f32(), self.m.to_f32(), five_bit_codes(&self.qs, self.qh, 0))
    }
}

impl IntBlock32 for BlockQ8_0 {
    fn unpack(&self) -> (f32, f32, [i8; 32]) {
        (self.d.to_f32(), 0.0, self.qs)
    }
}

impl IntBlock32 for BlockIQ4NL {
    fn unpack(&self) -> (f32, f32, [i8; 32]) {
        let mut c = nibble_codes(&self.qs, 0);
        for c in &mut c {
            *c = KVALUES_IQ4NL[*c as usize];
        }
        (self.d.to_f32(), 0.0, c)
    }
}

// ---- 256-value super-blocks -----------------------------------------------------------------------------------

impl IntBlockK for BlockQ2K {
    fn unpack(&self, codes: &mut [i8; QK_K], scales: &mut [i32; 16], mins: &mut [i32; 16]) -> (f32, f32) {
        for (e, c) in codes.iter_mut().enumerate() {
            let (h, s, l) = (e / 128, (e / 32) % 4, e % 32);
            *c = ((self.qs[32 * h + l] >> (2 * s)) & 3) as i8;
        }
        for (j, &sc) in self.scales.iter().enumerate() {
            scales[j] = (sc & 0x0F) as i32;
            mins[j] = (sc >> 4) as i32;
        }
        (self.d.to_f32(), self.dmin.to_f32())
    }
}

impl IntBlockK for BlockQ3K {
    fn unpack(&self, codes: &mut [i8; QK_K], scales: &mut [i32; 16], mins: &mut [i32; 16]) -> (f32, f32) {
        for (e, c) in codes.iter_mut().enumerate() {
            let (h, s, l) = (e / 128, (e / 32) % 4, e % 32);
            let lo = ((self.qs[32 * h + l] >> (2 * s)) & 3) as i8;
            let high_set = (self.hmask[l] >> (4 * h + s)) & 1 != 0;
            *c = if high_set { lo } else { lo - 4 };
        }
        for (s, &sc) in scales.iter_mut().zip(&scales_q3k(&self.scales)) {
            *s = sc as i32 - 32;
        }
        *mins = [0; 16];
        (self.d.to_f32(), 0.0)
    }
}

/// Q4_K and Q5_K: 8 sub-blocks of 32 with 6-bit scales and mins, each spread over two groups of 16.
fn k4_scales(packed: &[u8; 12], scales: &mut [i32; 16], mins: &mut [i32; 16]) {
    for j in 0..8 {
        let (sc, m) = scale_min_k4(packed, j);
        scales[2 * j..2 * j + 2].fill(sc as i32);
        mins[2 * j..2 * j + 2].fill(m as i32);
    }
}

impl IntBlockK for BlockQ4K {
    fn unpack(&self, codes: &mut [i8; QK_K], scales: &mut [i32; 16], mins: &mut [i32; 16]) -> (f32, f32) {
        for (e, c) in codes.iter_mut().enumerate() {
            let (j, l) = (e / 32, e % 32);
            *c = ((self.qs[32 * (j / 2) + l] >> (4 * (j % 2))) & 0x0F) as i8;
        }
        k4_scales(&self.scales, scales, mins);
        (self.d.to_f32(), self.dmin.to_f32())
    }
}

impl IntBlockK for BlockQ5K {
    fn unpack(&self, codes: &mut [i8; QK_K], scales: &mut [i32; 16], mins: &mut [i32; 16]) -> (f32, f32) {
        for (e, c) in codes.iter_mut().enumerate() {
            let (j, l) = (e / 32, e % 32);
            let lo = (self.qs[32 * (j / 2) + l] >> (4 * (j % 2))) & 0x0F;
            *c = (lo | (((self.qh[l] >> j) & 1) << 4)) as i8;
        }
        k4_scales(&self.scales, scales, mins);
        (self.d.to_f32(), self.dmin.to_f32())
    }
}

impl IntBlockK for BlockQ6K {
    fn unpack(&self, codes: &mut [i8; QK_K], scales: &mut [i32; 16], mins: &mut [i32; 16]) -> (f32, f32) {
        for (e, c) in codes.iter_mut().enumerate() {
            let (h, s, l) = (e / 128, (e / 32) % 4, e % 32);
            let lo = (self.ql[64 * h + l + 32 * (s & 1)] >> (4 * (s >> 1))) & 0x0F;
            let hi = (self.qh[32 * h + l] >> (2 * s)) & 3;
            *c = (lo | (hi << 4)) as i8 - 32;
        }
        for (s, &sc) in scales.iter_mut().zip(&self.scales) {
            *s = sc as i32;
        }
        *mins = [0; 16];
        (self.d.to_f32(), 0.0)
    }
}

impl IntBlockK for BlockIQ4XS {
    fn unpack(&self, codes: &mut [i8; QK_K], scales: &mut [i32; 16], mins: &mut [i32; 16]) -> (f32, f32) {
        let scales_h = u16::from_le_bytes(self.scales_h);
        for i in 0..8 {
            let lo = (self.scales_l[i / 2] >> (4 * (i % 2))) & 0x0F;
            let hi = ((scales_h >> (2 * i)) & 3) as u8;
            scales[2 * i..2 * i + 2].fill((lo | (hi << 4)) as i32 - 32);
            let qs: &[u8; 16] = self.qs[16 * i..16 * i + 16].try_into().unwrap();
            for (c, &n) in codes[32 * i..32 * i + 32].iter_mut().zip(&nibble_codes(qs, 0)) {
                *c = KVALUES_IQ4NL[n as usize];
            }
        }
        *mins = [0; 16];
        (self.d.to_f32(), 0.0)
    }
}

impl IntBlockK for BlockIQ3S {
    fn unpack(&self, codes: &mut [i8; QK_K], scales: &mut [i32; 16], mins: &mut [i32; 16]) -> (f32, f32) {
        for g in 0..QK_K / 4 {
            let idx = self.qs[g] as usize | ((self.qh[g / 8] as usize >> (g % 8)) & 1) << 8;
            for (k, &mag) in IQ3S_GRID[idx].to_le_bytes().iter().enumerate() {
                let e = 4 * g + k;
                let negative = (self.signs[e / 8] >> (e % 8)) & 1 != 0;
                codes[e] = if negative { -(mag as i8) } else { mag as i8 };
            }
        }
        for (j, s) in scales.iter_mut().enumerate() {
            *s = 1 + 2 * ((self.scales[j / 4] >> (4 * ((j / 2) % 2))) & 0x0F) as i32;
        }
        *mins = [0; 16];
        (self.d.to_f32(), 0.0)
    }
}

/// IQ2_XS: `d * (0.5 + sc) * 0.25 = (d / 8) * (2 sc + 1)`.
impl IntBlockK for BlockIQ2XS {
    fn unpack(&self, codes: &mut [i8; QK_K], scales: &mut [i32; 16], mins: &mut [i32; 16]) -> (f32, f32) {
        for (g, q) in self.qs.iter().enumerate() {
            let q = u16::from_le_bytes(*q);
            let signs = KSIGNS_IQ2XS[(q >> 9) as usize];
            for (k, &mag) in IQ2XS_GRID[(q & 511) as usize].to_le_bytes().iter().enumerate() {
                codes[8 * g + k] = if (signs >> k) & 1 != 0 { -(mag as i8) } else { mag as i8 };
            }
        }
        for (j, s) in scales.iter_mut().enumerate() {
            *s = 1 + 2 * ((self.scales[j / 2] >> (4 * (j % 2))) & 0x0F) as i32;
        }
        *mins = [0; 16];
        (self.d.to_f32() * 0.125, 0.0)
    }
}

// ---- float weights: the int8 path is the f32 path -------------------------------------------------------------

/// A [`super::DotQ8Fn`] for weights whose activations stay f32: NaN when `x` is not F32.
macro_rules! f32_entries {
    ($($name:ident => $dot:path,)*) => {$(
        pub(crate) fn $name(row: &[u8], x: &ActivationVector<'_>) -> f32 {
            if x.format != ActivationFormat::F32 {
                return f32::NAN;
            }
            $dot(row, x.f32s)
        }
    )*};
}

f32_entries! {
    dot_f32 => super::reference::dot_f32,
    dot_f16 => super::reference::dot_f16,
    dot_bf16 => super::reference::dot_bf16,
    dot_q8_k => super::reference::dot_blocks::<BlockQ8K>,
}
