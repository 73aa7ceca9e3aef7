//! Block layouts of the quantized ggml types, as `#[repr(C)]` structs over raw bytes.
//!
//! Source: the `block_*` structs of ggml's `ggml-common.h` (field order and sizes) and the GGUF specification's
//! type table. Every field is a byte array (f16 scales are [`F16Bits`]), so each struct has alignment 1 and
//! `bytemuck::cast_slice` turns any `&[u8]` of whole blocks into `&[Block]` wherever the bytes sit (an mmap'd
//! tensor need not be aligned to anything). Each size is pinned at compile time twice: against the literal byte
//! count ggml documents and against the geometry table in [`super::types`].

use bytemuck::{Pod, Zeroable};

use super::types::{GgmlType, QK_K};

/// An IEEE half-precision value stored as two little-endian bytes (ggml's `ggml_half`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Pod, Zeroable)]
#[repr(transparent)]
pub struct F16Bits(pub [u8; 2]);

impl F16Bits {
    /// The value widened to f32 (exact).
    #[inline]
    pub fn to_f32(self) -> f32 {
        half::f16::from_bits(u16::from_le_bytes(self.0)).to_f32()
    }

    /// The nearest f16 to `v` (round to nearest, ties to even; overflow gives ±inf), as numpy's
    /// `astype(np.float16)` and ggml's `GGML_FP32_TO_FP16` round.
    #[inline]
    pub fn from_f32(v: f32) -> F16Bits {
        F16Bits(half::f16::from_f32(v).to_bits().to_le_bytes())
    }
}

/// A block type: its ggml type and the number of elements one block holds.
pub trait QuantBlock: Pod {
    /// The ggml type whose blocks this struct describes.
    const TYPE: GgmlType;
    /// Elements per block (32 or [`QK_K`]).
    const ELEMS: usize;
}

macro_rules! block {
    ($name:ident, $ty:ident, $elems:expr, $bytes:literal) => {
        impl QuantBlock for $name {
            const TYPE: GgmlType = GgmlType::$ty;
            const ELEMS: usize = $elems;
        }
        const _: () = assert!(size_of::<$name>() == $bytes);
        const _: () = assert!(size_of::<$name>() == GgmlType::$ty.geometry().block_bytes);
        const _: () = assert!($elems == GgmlType::$ty.geometry().block_elems);
        const _: () = assert!(align_of::<$name>() == 1);
    };
}

/// `block_q4_0`: 32 weights `d * (q - 8)`, q a 4-bit code. Element j < 16 is the low nibble of `qs[j]`,
/// element j + 16 its high nibble.
#[allow(non_camel_case_types)]
#[derive(Debug, Clone, Copy, Pod, Zeroable)]
#[repr(C)]
pub struct BlockQ4_0 {
    pub d: F16Bits,
    pub qs: [u8; 16],
}
block!(BlockQ4_0, Q4_0, 32, 18);

/// `block_q4_1`: 32 weights `d * q + m`, q a 4-bit code, nibbles laid out as in [`BlockQ4_0`].
#[allow(non_camel_case_types)]
#[derive(Debug, Clone, Copy, Pod, Zeroable)]
#[repr(C)]
pub struct BlockQ4_1 {
    pub d: F16Bits,
    pub m: F16Bits,
    pub qs: [u8; 16],
}
block!(BlockQ4_1, Q4_1, 32, 20);

/// `block_q5_0`: 32 weights `d * (q - 16)`, q a 5-bit code: the nibble as in [`BlockQ4_0`] plus bit j of the
/// little-endian `qh` as bit 4 of element j.
#[allow(non_camel_case_types)]
#[derive(Debug, Clone, Copy, Pod, Zeroable)]
#[repr(C)]
pub struct BlockQ5_0 {
    pub d: F16Bits,
    pub qh: [u8; 4],
    pub qs: [u8; 16],
}
block!(BlockQ5_0, Q5_0, 32, 22);

/// `block_q5_1`: 32 weights `d * q + m`, q a 5-bit code laid out as in [`BlockQ5_0`].
#[allow(non_camel_case_types)]
#[derive(Debug, Clone, Copy, Pod, Zeroable)]
#[repr(C)]
pub struct BlockQ5_1 {
    pub d: F16Bits,
    pub m: F16Bits,
    pub qh: [u8; 4],
    pub qs: [u8; 16],
}
block!(BlockQ5_1, Q5_1, 32, 24);

/// `block_q8_0`: 32 weights `d * q`, q a signed byte.
#[allow(non_camel_case_types)]
#[derive(Debug, Clone, Copy, Pod, Zeroable)]
#[repr(C)]
pub struct BlockQ8_0 {
    pub d: F16Bits,
    pub qs: [i8; 32],
}
block!(BlockQ8_0, Q8_0, 32, 34);

/// `block_q2_K`: 256 weights in 16 sub-blocks of 16, weight `d * sc * q - dmin * m` with q a 2-bit code and
/// `scales[i]` = sc (low nibble) | m (high nibble) of sub-block i. Element `128*h + 32*s + l` is bits `2s..2s+2`
/// of `qs[32*h + l]`.
#[derive(Debug, Clone, Copy, Pod, Zeroable)]
#[repr(C)]
pub struct BlockQ2K {
    pub scales: [u8; QK_K / 16],
    pub qs: [u8; QK_K / 4],
    pub d: F16Bits,
    pub dmin: F16Bits,
}
block!(BlockQ2K, Q2_K, QK_K, 84);

/// `block_q3_K`: 256 weights in 16 sub-blocks of 16, weight `d * (sc - 32) * (q - 4)` with sc a 6-bit scale
/// (12 packed bytes) and q a 3-bit code: 2 bits laid out as in [`BlockQ2K`] plus bit `4h + s` of `hmask[l]` as bit 2.
#[derive(Debug, Clone, Copy, Pod, Zeroable)]
#[repr(C)]
pub struct BlockQ3K {
    pub hmask: [u8; QK_K / 8],
    pub qs: [u8; QK_K / 4],
    pub scales: [u8; 12],
    pub d: F16Bits,
}
block!(BlockQ3K, Q3_K, QK_K, 110);

/// `block_q4_K`: 256 weights in 8 sub-blocks of 32, weight `d * sc * q - dmin * m` with 6-bit sc and m
/// (12 packed bytes, see `get_scale_min_k4`) and q a 4-bit code: sub-block `2c` is the low nibbles of
/// `qs[32c..32c+32]`, sub-block `2c+1` the high nibbles.
#[derive(Debug, Clone, Copy, Pod, Zeroable)]
#[repr(C)]
pub struct BlockQ4K {
    pub d: F16Bits,
    pub dmin: F16Bits,
    pub scales: [u8; 12],
    pub qs: [u8; QK_K / 2],
}
block!(BlockQ4K, Q4_K, QK_K, 144);

/// `block_q5_K`: as [`BlockQ4K`] with a fifth bit: bit j of `qh[l]` is bit 4 of element l of sub-block j.
#[derive(Debug, Clone, Copy, Pod, Zeroable)]
#[repr(C)]
pub struct BlockQ5K {
    pub d: F16Bits,
    pub dmin: F16Bits,
    pub scales: [u8; 12],
    pub qh: [u8; QK_K / 8],
    pub qs: [u8; QK_K / 2],
}
block!(BlockQ5K, Q5_K, QK_K, 176);

/// `block_q6_K`: 256 weights in 16 sub-blocks of 16, weight `d * scales[i] * (q - 32)` with q a 6-bit code. In
/// half h, element `32*s + l` takes its low nibble from `ql[64h + l + 32*(s&1)]` (low nibble for s < 2, high
/// otherwise) and its top two bits from bits `2s..2s+2` of `qh[32h + l]`.
#[derive(Debug, Clone, Copy, Pod, Zeroable)]
#[repr(C)]
pub struct BlockQ6K {
    pub ql: [u8; QK_K / 2],
    pub qh: [u8; QK_K / 4],
    pub scales: [i8; QK_K / 16],
    pub d: F16Bits,
}
block!(BlockQ6K, Q6_K, QK_K, 210);

/// `block_q8_K`: 256 weights `d * q` with an f32 scale, plus the sums of each group of 16 codes (`bsums`,
/// used by ggml's integer dot products; ignored when dequantizing).
#[derive(Debug, Clone, Copy, Pod, Zeroable)]
#[repr(C)]
pub struct BlockQ8K {
    pub d: [u8; 4],
    pub qs: [i8; QK_K],
    pub bsums: [[u8; 2]; QK_K / 16],
}
block!(BlockQ8K, Q8_K, QK_K, 292);

/// `block_iq4_nl`: 32 weights `d * KVALUES_IQ4NL[q]`, nibbles laid out as in [`BlockQ4_0`].
#[derive(Debug, Clone, Copy, Pod, Zeroable)]
#[repr(C)]
pub struct BlockIQ4NL {
    pub d: F16Bits,
    pub qs: [u8; 16],
}
block!(BlockIQ4NL, IQ4_NL, 32, 18);

/// `block_iq4_xs`: 256 weights in 8 sub-blocks of 32, weight `d * (ls - 32) * KVALUES_IQ4NL[q]`. The 6-bit
/// `ls` of sub-block i is nibble `i % 2` of `scales_l[i / 2]` plus bits `2i..2i+2` of the little-endian
/// `scales_h` on top; each sub-block's 16 bytes of `qs` hold it as in [`BlockQ4_0`].
#[derive(Debug, Clone, Copy, Pod, Zeroable)]
#[repr(C)]
pub struct BlockIQ4XS {
    pub d: F16Bits,
    pub scales_h: [u8; 2],
    pub scales_l: [u8; QK_K / 64],
    pub qs: [u8; QK_K / 2],
}
block!(BlockIQ4XS, IQ4_XS, QK_K, 136);

/// `block_iq3_s`: 256 weights in 8 sub-blocks of 32, weight `d * (1 + 2*sc) * grid * sign`. Group g of 4
/// weights is row `qs[g] | bit g of qh << 8` of `IQ3S_GRID`; the sign of element e is bit `e % 8` of
/// `signs[e / 8]`; sc of sub-block i is nibble `i % 2` of `scales[i / 2]`.
#[derive(Debug, Clone, Copy, Pod, Zeroable)]
#[repr(C)]
pub struct BlockIQ3S {
    pub d: F16Bits,
    pub qs: [u8; QK_K / 4],
    pub qh: [u8; QK_K / 32],
    pub signs: [u8; QK_K / 8],
    pub scales: [u8; QK_K / 64],
}
block!(BlockIQ3S, IQ3_S, QK_K, 110);

/// `block_iq2_xs`: 256 weights in 16 sub-blocks of 16, weight `d * (0.5 + sc) * 0.25 * grid * sign`. Group g
/// of 8 weights is the little-endian u16 `qs[g]`: row `qs & 511` of `IQ2XS_GRID`, signs `KSIGNS_IQ2XS[qs >> 9]`
/// (bit k for element k); sc of sub-block i is nibble `i % 2` of `scales[i / 2]`.
#[derive(Debug, Clone, Copy, Pod, Zeroable)]
#[repr(C)]
pub struct BlockIQ2XS {
    pub d: F16Bits,
    pub qs: [[u8; 2]; QK_K / 8],
    pub scales: [u8; QK_K / 32],
}
block!(BlockIQ2XS, IQ2_XS, QK_K, 74);

/// The 6-bit scale and min of sub-block `j` (0..8) of a Q4_K / Q5_K block (ggml's `get_scale_min_k4`): sub-blocks
/// 0..4 keep theirs in the low 6 bits of bytes `j` and `j + 4`; sub-blocks 4..8 split theirs between a nibble of
/// byte `j + 4` and the top two bits of bytes `j - 4` and `j`.
#[inline]
pub fn scale_min_k4(scales: &[u8; 12], j: usize) -> (u8, u8) {
    if j < 4 {
        (scales[j] & 63, scales[j + 4] & 63)
    } else {
        let sc = (scales[j + 4] & 0x0F) | ((scales[j - 4] >> 6) << 4);
        let m = (scales[j + 4] >> 4) | ((scales[j] >> 6) << 4);
        (sc, m)
    }
}

/// The 16 unsigned 6-bit scales of a Q3_K block (the stored value; the weight uses `sc - 32`). Scale i has its low
/// nibble in byte `i % 8` (low nibble for i < 8, high otherwise) and its top two bits at bits `2*(i/4)..` of byte
/// `8 + i % 4`.
#[inline]
pub fn scales_q3k(scales: &[u8; 12]) -> [u8; 16] {
    let mut out = [0u8; 16];
    for (i, o) in out.iter_mut().enumerate() {
        let lo = (scales[i % 8] >> (4 * (i / 8))) & 0x0F;
        let hi = (scales[8 + i % 4] >> (2 * (i / 4))) & 0x03;
        *o = lo | (hi << 4);
    }
    out
}
