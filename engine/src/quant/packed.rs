//! Weight rows packed eight at a time for the CPU's int8 matmul (`STRATA_CPU_PACK`).
//!
//! A row-at-a-time int8 dot product ([`super::DotQ8Fn`]) does its float work per row, block and token: the block's
//! 8 lanes of integer sums converted, scaled by `d_w d_x` and added, then summed across lanes at the end. With
//! several tokens a step (a batch's decode, a prompt) that float work, not the integer products, bounds the matmul.
//! Packed, the same block of 8 consecutive rows lies side by side, 4 bytes of each row in turn
//! (`[row0 q0..q3, row1 q0..q3, ..., row7 q0..q3]` in 32 bytes), so one `vpdpbusd` (or `vpmaddubsw`) of those
//! 32 bytes with 4 of a token's activation codes broadcast gives the 8 rows' partial sums in the 8 lanes. A
//! block's 8 integer sums are then scaled by the 8 rows' `d_w` (and, for Q4_1, their mins added) in one vector
//! operation: the float work per row and token is an eighth of the row-at-a-time kernel's. llama.cpp's CPU
//! backend repacks Q4_0 the same way for the same reason (`ggml-cpu/repack.cpp`, its 8×8 interleaved blocks);
//! this layout is our own.
//!
//! Layout of a packed matrix: groups of 8 rows, in row order; a group is its `cols / 32` blocks in column
//! order; a block of a group is
//! - Q4_0: the 8 rows' `d` (8 × f16), then 4 × 32 bytes of nibbles (register `g` holds `qs[4g..4g+4]` of each row:
//!   its low nibbles are elements `4g..4g+4`, its high nibbles elements `16+4g..16+4g+4`): 144 bytes;
//! - Q4_1: the 8 rows' `d`, then their `m` (8 × f16 each), then the nibbles as Q4_0's: 160 bytes;
//! - Q8_0: the 8 rows' `d`, then 8 × 32 bytes of codes (register `g` holds elements `4g..4g+4` of each row) stored
//!   as `q + 128` (unsigned, so `vpdpbusd` takes them; `128 Σx` is taken out through the activations' code sums):
//!   272 bytes.
//!
//! Every integer block sum is exact, so the results are one float order's: per row and token,
//! `acc = fma(d_w d_x, S_b, acc)` over the blocks in order (then, for Q4_1, `acc = fma(m_w, s_x, acc)` in the same
//! pass), as [`reference`] computes it in scalar code. A token's result does not depend on which tokens share the
//! call, nor on VNNI being used: a packed matrix gives one token the same bits alone and in any batch. It is not
//! the row-at-a-time kernel's order, so the switch changes results within float rounding (like any change of
//! summation order), never across a batch.

use super::activations::{ActivationFormat, ActivationVector};
use super::types::GgmlType;

/// Rows per packed group.
pub const ROWS: usize = 8;

/// A packed kernel: `out[t][r]` is row `r` of the 8-row `group`'s dot product with `xs[t]` (Q8_1 activations of
/// the group's row length), for `xs.len()` of 1 to 4 tokens. Returns NaN for a token whose activations are in
/// another format or shorter than the rows.
pub type PackedFn = fn(group: &[u8], xs: &[ActivationVector<'_>], out: &mut [[f32; ROWS]]);

/// A matrix packed for the CPU: `rows / 8` groups of [`Packed::group_bytes`] each.
pub struct Packed {
    pub ty: GgmlType,
    pub rows: usize,
    pub cols: usize,
    /// Bytes per group of 8 rows (`cols / 32` blocks).
    pub group_bytes: usize,
    pub bytes: Box<[u8]>,
    /// The kernel for this CPU.
    pub kernel: PackedFn,
}

impl std::fmt::Debug for Packed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Packed({} {}x{}, {} bytes)",
            self.ty,
            self.rows,
            self.cols,
            self.bytes.len()
        )
    }
}

impl Packed {
    /// Group `g`'s bytes (rows `8g..8g+8`).
    #[inline]
    pub fn group(&self, g: usize) -> &[u8] {
        &self.bytes[g * self.group_bytes..(g + 1) * self.group_bytes]
    }
}

/// Bytes of one block of a group (8 rows × 32 values) of `ty`; `None` for a type without a packed layout.
pub fn block_bytes(ty: GgmlType) -> Option<usize> {
    match ty {
        GgmlType::Q4_0 => Some(16 + 128),
        GgmlType::Q4_1 => Some(32 + 128),
        GgmlType::Q8_0 => Some(16 + 256),
        _ => None,
    }
}

/// `data` (`rows` rows of `cols` weights of `ty`, as the GGUF stores them) packed with this CPU's kernel, or
/// `None` where it cannot be: a type without a packed layout, rows not a multiple of 8, a row length that is
/// not whole blocks or data of another length, or a CPU without the AVX2 kernels.
pub fn pack(ty: GgmlType, data: &[u8], rows: usize, cols: usize) -> Option<Packed> {
    pack_with(ty, data, rows, cols, |_| {})
}

/// Rows packed per step of [`pack_with`].
const PACK_CHUNK_ROWS: usize = 1024;

/// [`pack`], calling `done(range)` with each byte range of `data` once its rows are packed (up to 1,024 rows at a
/// time), so the caller can release them as it goes: the file's pages and the packed copy are then never both
/// held in full.
pub fn pack_with(
    ty: GgmlType,
    data: &[u8],
    rows: usize,
    cols: usize,
    mut done: impl FnMut(std::ops::Range<usize>),
) -> Option<Packed> {
    let kernel = kernel(ty)?;
    let len = packed_len(ty, data.len(), rows, cols)?;
    let group_bytes = cols / 32 * block_bytes(ty)?;
    let row_bytes = data.len() / rows.max(1);
    // Zeroed pages are not resident until written: the copy grows chunk by chunk.
    let mut bytes = vec![0u8; len].into_boxed_slice();
    for r0 in (0..rows).step_by(PACK_CHUNK_ROWS) {
        let r1 = (r0 + PACK_CHUNK_ROWS).min(rows);
        let src = r0 * row_bytes..r1 * row_bytes;
        let dst = r0 / ROWS * group_bytes..r1 / ROWS * group_bytes;
        pack_into(ty, &data[src.clone()], r1 - r0, cols, &mut bytes[dst]);
        done(src);
    }
    Some(Packed {
        ty,
        rows,
        cols,
        group_bytes,
        bytes,
        kernel,
    })
}

/// This CPU's packed kernel for `ty` (`None` without AVX2, FMA and F16C, or for a type without a layout).
pub fn kernel(ty: GgmlType) -> Option<PackedFn> {
    #[cfg(target_arch = "x86_64")]
    if super::simd_available() {
        return match ty {
            GgmlType::Q4_0 => Some(super::avx2_packed::dot_q4_0),
            GgmlType::Q4_1 => Some(super::avx2_packed::dot_q4_1),
            GgmlType::Q8_0 => Some(super::avx2_packed::dot_q8_0),
            _ => None,
        };
    }
    let _ = ty;
    None
}

/// The packed bytes of `data` (see the module docs), in portable code; `None` as [`pack`] says.
pub fn pack_bytes(ty: GgmlType, data: &[u8], rows: usize, cols: usize) -> Option<Vec<u8>> {
    let mut out = vec![0u8; packed_len(ty, data.len(), rows, cols)?];
    pack_into(ty, data, rows, cols, &mut out);
    Some(out)
}

/// The bytes `rows` rows of `cols` weights of `ty` take packed, when `data_len` bytes of them can be packed
/// (`None` as [`pack`] says).
pub fn packed_len(ty: GgmlType, data_len: usize, rows: usize, cols: usize) -> Option<usize> {
    let bb = block_bytes(ty)?;
    if rows % ROWS != 0 || cols % 32 != 0 || cols == 0 {
        return None;
    }
    let row_bytes = cols / 32 * ty.geometry().block_bytes;
    if data_len != rows.checked_mul(row_bytes)? {
        return None;
    }
    Some(rows / ROWS * (cols / 32) * bb)
}

/// Packs `rows` rows of `data` into `out` ([`packed_len`] bytes; both checked by the caller): the groups of rows
/// `0..rows` in order, so consecutive calls over consecutive rows fill consecutive parts of one packed matrix.
pub fn pack_into(ty: GgmlType, data: &[u8], rows: usize, cols: usize, out: &mut [u8]) {
    let bb = block_bytes(ty).expect("a packed type");
    let src_bb = ty.geometry().block_bytes;
    let nb = cols / 32;
    let row_bytes = nb * src_bb;
    assert_eq!(out.len(), rows / ROWS * nb * bb, "packed bytes");
    for (gi, group) in out.chunks_exact_mut(nb * bb).enumerate() {
        for (b, dst) in group.chunks_exact_mut(bb).enumerate() {
            for r in 0..ROWS {
                let row = gi * ROWS + r;
                let src = &data[row * row_bytes + b * src_bb..][..src_bb];
                // d (and Q4_1's m) first, as f16 bits.
                dst[2 * r..2 * r + 2].copy_from_slice(&src[0..2]);
                let (qs, hdr) = match ty {
                    GgmlType::Q4_1 => {
                        dst[16 + 2 * r..16 + 2 * r + 2].copy_from_slice(&src[2..4]);
                        (&src[4..20], 32)
                    }
                    GgmlType::Q4_0 => (&src[2..18], 16),
                    _ => (&src[2..34], 16),
                };
                for (g, four) in qs.chunks_exact(4).enumerate() {
                    let at = hdr + 32 * g + 4 * r;
                    for (d, &q) in dst[at..at + 4].iter_mut().zip(four) {
                        // Q8_0's signed codes biased to unsigned.
                        *d = if ty == GgmlType::Q8_0 { q ^ 0x80 } else { q };
                    }
                }
            }
        }
    }
}

/// The packed kernels' results in scalar code, in their float order (the module docs): row `r` of `group` (of
/// `ty`) against `x`. The test oracle of the AVX2 kernels; NaN for activations that are not Q8_1 of the rows'
/// length.
pub fn reference(ty: GgmlType, group: &[u8], x: &ActivationVector<'_>) -> [f32; ROWS] {
    let Some(bb) = block_bytes(ty) else {
        return [f32::NAN; ROWS];
    };
    let nb = group.len() / bb;
    if x.format != ActivationFormat::Q8_1 || x.qs.len() < nb * 32 || x.d.len() < nb || x.s.len() < nb {
        return [f32::NAN; ROWS];
    }
    let f16 = |b: &[u8]| half::f16::from_le_bytes([b[0], b[1]]).to_f32();
    let mut acc = [0f32; ROWS];
    for (b, blk) in group.chunks_exact(bb).enumerate() {
        let xq = &x.qs[32 * b..32 * b + 32];
        for (r, acc) in acc.iter_mut().enumerate() {
            let mut s: i32 = 0;
            match ty {
                GgmlType::Q4_0 | GgmlType::Q4_1 => {
                    let hdr = if ty == GgmlType::Q4_1 { 32 } else { 16 };
                    for g in 0..4 {
                        for k in 0..4 {
                            let byte = blk[hdr + 32 * g + 4 * r + k];
                            let off = if ty == GgmlType::Q4_0 { 8 } else { 0 };
                            s += ((byte & 0x0F) as i32 - off) * xq[4 * g + k] as i32;
                            s += ((byte >> 4) as i32 - off) * xq[16 + 4 * g + k] as i32;
                        }
                    }
                }
                _ => {
                    for g in 0..8 {
                        for k in 0..4 {
                            let w = (blk[16 + 32 * g + 4 * r + k] ^ 0x80) as i8;
                            s += w as i32 * xq[4 * g + k] as i32;
                        }
                    }
                }
            }
            let d = f16(&blk[2 * r..]);
            *acc = (d * x.d[b]).mul_add(s as f32, *acc);
            if ty == GgmlType::Q4_1 {
                *acc = f16(&blk[16 + 2 * r..]).mul_add(x.s[b], *acc);
            }
        }
    }
    acc
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::QuantizedActivations;

    /// `rows` rows of `cols` random weights of `ty`, quantized.
    fn matrix(ty: GgmlType, rows: usize, cols: usize, seed: u64) -> Vec<u8> {
        let mut rng = crate::rng::SplitMix64::new(seed);
        let f: Vec<f32> = (0..rows * cols).map(|_| rng.unit() as f32 * 2.0 - 1.0).collect();
        let mut q = vec![0u8; rows * ty.row_bytes(cols as u64).unwrap() as usize];
        crate::quant::quantize(ty, &f, &mut q).unwrap();
        q
    }

    fn acts(ty: GgmlType, n: usize, cols: usize, seed: u64) -> QuantizedActivations {
        let mut rng = crate::rng::SplitMix64::new(seed);
        let x: Vec<f32> = (0..n * cols).map(|_| (rng.unit() as f32 * 2.0 - 1.0) * 3.0).collect();
        let mut qa = QuantizedActivations::default();
        qa.quantize(ty, &x, cols).unwrap();
        qa
    }

    #[test]
    fn the_packed_reference_is_the_row_dot_product_within_rounding() {
        for ty in [GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q8_0] {
            let (rows, cols) = (16, 96);
            let data = matrix(ty, rows, cols, 7);
            let packed = pack_bytes(ty, &data, rows, cols).unwrap();
            let gb = cols / 32 * block_bytes(ty).unwrap();
            assert_eq!(packed.len(), rows / ROWS * gb);
            let qa = acts(ty, 1, cols, 3);
            let row_bytes = data.len() / rows;
            for g in 0..rows / ROWS {
                let got = reference(ty, &packed[g * gb..(g + 1) * gb], &qa.vector(0));
                for (r, got) in got.iter().enumerate() {
                    let row = &data[(g * ROWS + r) * row_bytes..][..row_bytes];
                    // The int8 reference of the unpacked row: the same integer sums, another float order.
                    let want = crate::quant::vec_dot_q8(ty, row, &qa.vector(0)).unwrap();
                    assert!(
                        (got - want).abs() <= 1e-5 * want.abs().max(1.0),
                        "{ty} row {}: {got} against {want}",
                        g * ROWS + r
                    );
                }
            }
        }
    }

    #[test]
    fn what_cannot_be_packed_is_not() {
        let data = matrix(GgmlType::Q4_1, 12, 64, 1);
        assert!(pack_bytes(GgmlType::Q4_1, &data, 12, 64).is_none(), "12 rows");
        let data = matrix(GgmlType::Q4_1, 8, 64, 1);
        assert!(pack_bytes(GgmlType::Q4_1, &data[1..], 8, 64).is_none(), "short data");
        assert!(pack_bytes(GgmlType::Q4_K, &data, 8, 64).is_none(), "no layout");
        assert!(pack_bytes(GgmlType::Q4_1, &data, 8, 64).is_some());
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn the_kernels_give_the_reference_bits_for_every_batch_with_and_without_vnni() {
        if !crate::quant::simd_available() {
            eprintln!("skipped: this CPU has no AVX2, FMA and F16C");
            return;
        }
        for ty in [GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q8_0] {
            let (rows, cols) = (24, 160);
            let data = matrix(ty, rows, cols, 11);
            let p = pack(ty, &data, rows, cols).unwrap();
            let qa = acts(ty, 4, cols, 5);
            let xs: Vec<_> = (0..4).map(|t| qa.vector(t)).collect();
            for g in 0..rows / ROWS {
                let want: Vec<[f32; ROWS]> = xs.iter().map(|x| reference(ty, p.group(g), x)).collect();
                for n in 1..=4 {
                    for vnni in [false, true] {
                        if vnni && !crate::switches::host_vnni() {
                            continue;
                        }
                        let mut out = [[0f32; ROWS]; 4];
                        super::super::avx2_packed::dot_with(ty, vnni, p.group(g), &xs[..n], &mut out);
                        for t in 0..n {
                            assert_eq!(
                                out[t].map(f32::to_bits),
                                want[t].map(f32::to_bits),
                                "{ty} group {g} token {t} of {n}, vnni {vnni}"
                            );
                        }
                    }
                }
            }
            // The integer bounds: Q4 codes all 15 and Q8_0 codes all -128 (which the quantizer never writes, but a
            // file may hold) against activation codes of ±127 in every lane.
            let mut extreme = data.clone();
            let bb = ty.geometry().block_bytes;
            for blk in extreme.chunks_exact_mut(bb) {
                let qs = match ty {
                    GgmlType::Q4_1 => &mut blk[4..],
                    _ => &mut blk[2..],
                };
                qs.fill(if ty == GgmlType::Q8_0 { 0x80 } else { 0xFF });
            }
            let pe = pack(ty, &extreme, rows, cols).unwrap();
            let x: Vec<f32> = (0..cols).map(|i| if (i / 3) % 2 == 0 { 3.0 } else { -3.0 }).collect();
            let mut qx = QuantizedActivations::default();
            qx.quantize(ty, &x, cols).unwrap();
            assert!(qx.vector(0).qs.iter().all(|q| q.abs() == 127));
            let plus: Vec<f32> = vec![3.0; cols];
            let mut qp = QuantizedActivations::default();
            qp.quantize(ty, &plus, cols).unwrap();
            for x in [qx.vector(0), qp.vector(0)] {
                let want = reference(ty, pe.group(0), &x);
                let row = &extreme[..extreme.len() / rows];
                let by_row = crate::quant::vec_dot_q8(ty, row, &x).unwrap();
                assert!(
                    (want[0] - by_row).abs() <= 1e-5 * by_row.abs().max(1.0),
                    "{ty}: {} against {by_row}",
                    want[0]
                );
                for vnni in [false, true] {
                    if vnni && !crate::switches::host_vnni() {
                        continue;
                    }
                    let mut out = [[0f32; ROWS]; 1];
                    super::super::avx2_packed::dot_with(ty, vnni, pe.group(0), std::slice::from_ref(&x), &mut out);
                    assert_eq!(
                        out[0].map(f32::to_bits),
                        want.map(f32::to_bits),
                        "{ty} extreme, vnni {vnni}"
                    );
                }
            }
            // Activations of another format give NaN, never a wrong number.
            let other = acts(GgmlType::Q4_K, 1, 256, 1);
            let mut out = [[0f32; ROWS]; 1];
            (p.kernel)(p.group(0), &[other.vector(0)], &mut out);
            assert!(out[0].iter().all(|v| v.is_nan()), "{ty}");
        }
    }
}
