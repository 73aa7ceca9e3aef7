//! Unit tests of the quant module: SIMD against reference, error contracts, quantize round trips.
//! (Bit-exactness against PyPI `gguf` lives in `engine/tests/quant_goldens.rs`.)

use super::*;
use blocks::F16Bits;

/// xorshift64*: deterministic test data without a dependency.
struct Rng(u64);

impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    /// Uniform in [-1, 1).
    fn uniform(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
    /// Standard normal (Box-Muller).
    fn gauss(&mut self) -> f32 {
        let u1 = ((self.next_u64() >> 11) as f64 + 1.0) / (1u64 << 53) as f64;
        let u2 = (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
        ((-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()) as f32
    }
}

/// Every type with a dot product.
const DOT_TYPES: &[GgmlType] = &[
    GgmlType::F32,
    GgmlType::F16,
    GgmlType::BF16,
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q8_0,
    GgmlType::Q2_K,
    GgmlType::Q3_K,
    GgmlType::Q4_K,
    GgmlType::Q5_K,
    GgmlType::Q6_K,
    GgmlType::Q8_K,
    GgmlType::IQ4_NL,
    GgmlType::IQ4_XS,
    GgmlType::IQ3_S,
    GgmlType::IQ2_XS,
];

/// Byte offsets of the f16 scale fields of each block type (`block_*` in ggml-common.h).
fn scale_offsets(ty: GgmlType) -> &'static [usize] {
    use GgmlType as T;
    match ty {
        T::Q4_0 | T::Q5_0 | T::Q8_0 | T::IQ4_NL | T::IQ4_XS | T::IQ3_S | T::IQ2_XS => &[0],
        T::Q4_1 | T::Q5_1 | T::Q4_K | T::Q5_K => &[0, 2],
        T::Q2_K => &[80, 82],
        T::Q3_K => &[108],
        T::Q6_K => &[208],
        _ => &[],
    }
}

/// A random row of `n_blocks` blocks: random bytes with finite scales (or random finite values for the
/// scalar types).
fn random_row(rng: &mut Rng, ty: GgmlType, n_blocks: usize) -> Vec<u8> {
    let g = ty.geometry();
    let n = n_blocks * g.block_elems;
    match ty {
        GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => {
            let vals: Vec<f32> = (0..n).map(|_| rng.gauss()).collect();
            let mut row = vec![0u8; n * g.block_bytes];
            quantize(ty, &vals, &mut row).unwrap();
            row
        }
        _ => {
            let mut row: Vec<u8> = (0..n_blocks * g.block_bytes).map(|_| rng.next_u64() as u8).collect();
            for block in row.chunks_exact_mut(g.block_bytes) {
                for &off in scale_offsets(ty) {
                    let d = rng.uniform() * 0.1;
                    block[off..off + 2].copy_from_slice(&F16Bits::from_f32(d).0);
                }
                if ty == GgmlType::Q8_K {
                    block[..4].copy_from_slice(&(rng.uniform() * 0.01).to_le_bytes());
                }
            }
            row
        }
    }
}

/// `Σ |w[i] * x[i]|`, the scale of the rounding error of any summation order.
fn abs_dot(ty: GgmlType, row: &[u8], x: &[f32]) -> f64 {
    let mut w = vec![0f32; x.len()];
    dequantize(ty, row, &mut w).unwrap();
    w.iter().zip(x).map(|(&a, &b)| (a as f64 * b as f64).abs()).sum()
}

#[test]
fn simd_matches_reference_within_1e5_of_abs_sum() {
    if !simd_available() {
        eprintln!("skipping: no AVX2+FMA+F16C on this CPU");
        return;
    }
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    for &ty in DOT_TYPES {
        let g = ty.geometry();
        // Row lengths with 1 block, several blocks, and (scalar types) a tail shorter than a SIMD step.
        let lens: &[usize] = if g.block_elems == 1 {
            &[7, 32, 100, 4096 + 13]
        } else {
            &[1, 3, 16]
        };
        for &n_blocks in lens {
            let row = random_row(&mut rng, ty, n_blocks);
            let x: Vec<f32> = (0..n_blocks * g.block_elems).map(|_| rng.uniform()).collect();
            let fast = vec_dot(ty, &row, &x).unwrap() as f64;
            let slow = reference::vec_dot(ty, &row, &x).unwrap() as f64;
            let tol = 1e-5 * abs_dot(ty, &row, &x) + 1e-30;
            assert!(
                (fast - slow).abs() <= tol,
                "{ty} {n_blocks} blocks: simd {fast} vs reference {slow}, tol {tol}"
            );
        }
    }
}

#[test]
fn dot_fn_tolerates_inconsistent_lengths() {
    let mut rng = Rng(7);
    for &ty in DOT_TYPES {
        let g = ty.geometry();
        let row = random_row(&mut rng, ty, 4);
        let x: Vec<f32> = (0..4 * g.block_elems).map(|_| rng.uniform()).collect();
        for f in [dot_fn(ty).unwrap(), reference::dot_fn(ty).unwrap()] {
            // Short activations, a partial trailing block, and empty inputs: a wrong sum, never a panic.
            let _ = f(&row, &x[..x.len() / 2 + 1]);
            let _ = f(&row[..row.len() - 1], &x);
            let _ = f(&[], &x);
            let _ = f(&row, &[]);
            let exact_prefix = f(&row[..2 * g.block_bytes], &x[..2 * g.block_elems]);
            assert_eq!(
                f(&row[..2 * g.block_bytes], &x),
                exact_prefix,
                "{ty}: extra x must be ignored"
            );
        }
    }
}

#[test]
fn errors_name_the_type_and_lengths() {
    let row = vec![0u8; 144 * 2];
    let mut out = vec![0f32; 500];
    let e = dequantize(GgmlType::Q4_K, &row, &mut out).unwrap_err();
    assert_eq!(
        e,
        QuantError::LengthMismatch {
            ty: GgmlType::Q4_K,
            op: "dequantize",
            what: "destination",
            expected: 512,
            actual: 500
        }
    );
    assert!(
        e.to_string().contains("Q4_K") && e.to_string().contains("512") && e.to_string().contains("500"),
        "{e}"
    );

    let e = dequantize(GgmlType::Q4_K, &row[..100], &mut out).unwrap_err();
    assert!(
        matches!(
            e,
            QuantError::NotWholeBlocks {
                ty: GgmlType::Q4_K,
                len: 100,
                block: 144,
                ..
            }
        ),
        "{e:?}"
    );
    assert!(e.to_string().contains("Q4_K") && e.to_string().contains("100"), "{e}");

    let e = vec_dot(GgmlType::Q8_0, &[0u8; 34], &[0f32; 31]).unwrap_err();
    assert!(e.to_string().contains("Q8_0") && e.to_string().contains("31"), "{e}");

    let e = dequantize(GgmlType::IQ1_S, &[0u8; 50], &mut [0f32; 256]).unwrap_err();
    assert_eq!(
        e,
        QuantError::Unsupported {
            ty: GgmlType::IQ1_S,
            op: "dequantize"
        }
    );
    assert!(e.to_string().contains("IQ1_S"), "{e}");

    let e = quantize(GgmlType::IQ4_XS, &[0f32; 256], &mut [0u8; 136]).unwrap_err();
    assert!(
        e.to_string().contains("IQ4_XS") && e.to_string().contains("quantize"),
        "{e}"
    );
    let e = quantize(GgmlType::Q4_0, &[0f32; 33], &mut [0u8; 18]).unwrap_err();
    assert!(e.to_string().contains("Q4_0") && e.to_string().contains("33"), "{e}");
    assert!(dot_fn(GgmlType::TQ1_0).is_err());
}

#[test]
fn q8_k_dequantizes_as_scale_times_code() {
    let mut block = BlockQ8K {
        d: 0.5f32.to_le_bytes(),
        qs: [0; QK_K],
        bsums: [[0; 2]; 16],
    };
    for (i, q) in block.qs.iter_mut().enumerate() {
        *q = (i as i32 - 128) as i8;
    }
    let mut out = [0f32; QK_K];
    dequantize(GgmlType::Q8_K, bytemuck::bytes_of(&block), &mut out).unwrap();
    for (i, v) in out.iter().enumerate() {
        assert_eq!(*v, 0.5 * (i as f32 - 128.0));
    }
}

/// `rms(dequantize(quantize(x)) - x) / rms(x)` over 64 standard gaussian rows of 4096 (seeded).
fn round_trip_error(ty: GgmlType) -> f64 {
    let mut rng = Rng(0xDEAD_BEEF);
    let n = 64 * 4096;
    let x: Vec<f32> = (0..n).map(|_| rng.gauss()).collect();
    let g = ty.geometry();
    let mut q = vec![0u8; n / g.block_elems * g.block_bytes];
    quantize(ty, &x, &mut q).unwrap();
    let mut y = vec![0f32; n];
    dequantize(ty, &q, &mut y).unwrap();
    let err: f64 = x.iter().zip(&y).map(|(&a, &b)| ((a - b) as f64).powi(2)).sum();
    let sig: f64 = x.iter().map(|&a| (a as f64).powi(2)).sum();
    (err / sig).sqrt()
}

#[test]
fn quantize_round_trip_error_bounds() {
    for (ty, bound) in [
        (GgmlType::Q2_K, 0.32),
        (GgmlType::Q3_K, 0.17),
        (GgmlType::Q4_K, 0.08),
        (GgmlType::Q5_K, 0.04),
        (GgmlType::Q6_K, 0.02),
        (GgmlType::Q4_0, 0.095),
        (GgmlType::Q4_1, 0.085),
        (GgmlType::Q5_0, 0.047),
        (GgmlType::Q5_1, 0.042),
        (GgmlType::Q8_0, 0.006),
        (GgmlType::BF16, 0.002),
        (GgmlType::F16, 0.0003),
    ] {
        let e = round_trip_error(ty);
        eprintln!("{ty}: relative rms error {e:.4}");
        assert!(e < bound, "{ty}: relative rms error {e} exceeds {bound}");
    }
}

#[test]
fn quantize_handles_zero_and_constant_blocks() {
    for ty in [
        GgmlType::Q2_K,
        GgmlType::Q3_K,
        GgmlType::Q4_K,
        GgmlType::Q5_K,
        GgmlType::Q6_K,
        GgmlType::Q4_0,
    ] {
        let g = ty.geometry();
        for fill in [0.0f32, 1.5, -0.25] {
            let x = vec![fill; QK_K];
            let mut q = vec![0u8; QK_K / g.block_elems * g.block_bytes];
            quantize(ty, &x, &mut q).unwrap();
            let mut y = vec![0f32; QK_K];
            dequantize(ty, &q, &mut y).unwrap();
            for v in &y {
                assert!(
                    (v - fill).abs() <= 0.02 * fill.abs() + 1e-6,
                    "{ty} fill {fill}: got {v}"
                );
            }
        }
    }
}

#[test]
fn quantize_is_idempotent_on_k_types() {
    // Quantizing already-quantized values must not lose more than a rounding step.
    for ty in [GgmlType::Q4_K, GgmlType::Q6_K] {
        let mut rng = Rng(3);
        let x: Vec<f32> = (0..4 * QK_K).map(|_| rng.gauss()).collect();
        let g = ty.geometry();
        let mut q = vec![0u8; 4 * g.block_bytes];
        quantize(ty, &x, &mut q).unwrap();
        let mut y = vec![0f32; x.len()];
        dequantize(ty, &q, &mut y).unwrap();
        let mut q2 = vec![0u8; q.len()];
        quantize(ty, &y, &mut q2).unwrap();
        let mut y2 = vec![0f32; x.len()];
        dequantize(ty, &q2, &mut y2).unwrap();
        let err: f64 = y.iter().zip(&y2).map(|(&a, &b)| ((a - b) as f64).powi(2)).sum::<f64>() / x.len() as f64;
        assert!(err.sqrt() < 0.05, "{ty}: re-quantization rms change {}", err.sqrt());
    }
}
