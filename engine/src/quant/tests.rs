//! Unit tests of the quant module: SIMD against reference, error contracts, quantize round trips.
//! (Bit-exactness against PyPI `gguf` lives in `engine/tests/formats/quant_goldens.rs`.)

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

/// Every type with a dot product, from the kernel table; the count guards against the table losing types.
fn dot_types() -> Vec<GgmlType> {
    let t = super::dot_types();
    assert_eq!(t.len(), 18, "types with a dot product: {t:?}");
    t
}

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
    for ty in dot_types() {
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
    for ty in dot_types() {
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

// ---- int8 activations ---------------------------------------------------------------------------------------

/// Every weight type with an int8 path (the float types and Q8_K keep f32 activations), from the kernel table.
fn int8_types() -> Vec<GgmlType> {
    let t = super::int8_types();
    assert_eq!(t.len(), 14, "types with an int8 path: {t:?}");
    t
}

/// The activations as quantized: `d * q` per value (or the f32 values).
fn dequantized_activations(x: &ActivationVector<'_>) -> Vec<f64> {
    if x.format == ActivationFormat::F32 {
        return x.f32s.iter().map(|&v| v as f64).collect();
    }
    let block = x.qs.len() / x.d.len().max(1);
    x.qs.iter()
        .enumerate()
        .map(|(i, &q)| x.d[i / block] as f64 * q as f64)
        .collect()
}

/// `(Σ w[i] y[i], Σ |w[i] y[i]|)` in f64 for the dequantized row `w`.
fn dot_f64(ty: GgmlType, row: &[u8], y: &[f64]) -> (f64, f64) {
    let mut w = vec![0f32; y.len()];
    dequantize(ty, row, &mut w).unwrap();
    w.iter().zip(y).fold((0.0, 0.0), |(s, a), (&w, &y)| {
        (s + w as f64 * y, a + (w as f64 * y).abs())
    })
}

#[test]
fn activation_formats_follow_ggml_vec_dot_type() {
    use ActivationFormat as A;
    for (ty, f) in [
        (GgmlType::F32, A::F32),
        (GgmlType::F16, A::F32),
        (GgmlType::BF16, A::F32),
        (GgmlType::Q8_K, A::F32),
        (GgmlType::Q4_0, A::Q8_1),
        (GgmlType::Q4_1, A::Q8_1),
        (GgmlType::Q5_0, A::Q8_1),
        (GgmlType::Q5_1, A::Q8_1),
        (GgmlType::Q8_0, A::Q8_1),
        (GgmlType::IQ4_NL, A::Q8_1),
        (GgmlType::Q2_K, A::Q8_K),
        (GgmlType::Q3_K, A::Q8_K),
        (GgmlType::Q4_K, A::Q8_K),
        (GgmlType::Q5_K, A::Q8_K),
        (GgmlType::Q6_K, A::Q8_K),
        (GgmlType::IQ4_XS, A::Q8_K),
        (GgmlType::IQ3_S, A::Q8_K),
        (GgmlType::IQ2_XS, A::Q8_K),
    ] {
        assert_eq!(activation_format(ty).unwrap(), f, "{ty}");
    }
    assert!(activation_format(GgmlType::TQ1_0).is_err());
}

#[test]
fn activation_quantizer_simd_is_bit_exact_with_plain() {
    if !simd_available() {
        eprintln!("skipping: no AVX2+FMA+F16C on this CPU");
        return;
    }
    let mut rng = Rng(11);
    for ty in [GgmlType::Q4_0, GgmlType::Q4_K] {
        for scale in [1.0f32, 1e-3, 1e4, 1e-32] {
            let mut x: Vec<f32> = (0..8 * QK_K).map(|_| rng.gauss() * scale).collect();
            // A zero block, a block with a NaN, one with +inf, exact .5 ties, an outlier.
            x[..QK_K].fill(0.0);
            x[QK_K + 3] = f32::NAN;
            x[2 * QK_K + 7] = f32::INFINITY;
            x[3 * QK_K..3 * QK_K + 32].copy_from_slice(&std::array::from_fn::<f32, 32, _>(|i| i as f32 - 15.5));
            x[4 * QK_K + 1] = 1e3 * scale;
            let (mut a, mut b) = (QuantizedActivations::new(), QuantizedActivations::new());
            a.quantize_with(ty, &x, 2 * QK_K, true).unwrap();
            b.quantize_with(ty, &x, 2 * QK_K, false).unwrap();
            assert_eq!(a.qs, b.qs, "{ty} x{scale}: codes");
            assert_eq!(a.sums, b.sums, "{ty} x{scale}: sums");
            let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&a.d), bits(&b.d), "{ty} x{scale}: scales");
        }
    }
}

#[test]
fn activation_quantizer_codes_and_special_blocks() {
    let mut x = vec![0f32; 4 * QK_K];
    for (i, v) in x.iter_mut().enumerate().skip(QK_K) {
        *v = (i as f32 * 0.37).sin();
    }
    x[2 * QK_K + 5] = f32::NAN;
    x[3 * QK_K + 9] = f32::NEG_INFINITY;
    for ty in [GgmlType::Q4_0, GgmlType::Q6_K] {
        let q = quantize_activations(ty, &x).unwrap();
        let v = q.vector(0);
        let block = ty.geometry().block_elems;
        let dq = dequantized_activations(&v);
        for (b, &d) in v.d.iter().enumerate() {
            let range = b * block..(b + 1) * block;
            if range.contains(&(2 * QK_K + 5)) {
                assert!(d.is_nan(), "{ty} block {b}");
            } else if range.contains(&(3 * QK_K + 9)) {
                assert!(d.is_infinite(), "{ty} block {b}");
            } else if b * block < QK_K {
                assert_eq!(d, 0.0);
            } else {
                let amax = x[range.clone()].iter().fold(0f32, |m, v| m.max(v.abs()));
                // 32-value blocks store the scale rounded to f16, as ggml's Q8_0/Q8_1 do; Q8_K keeps it exact.
                let exact = amax / 127.0;
                let want = if block == 32 {
                    half::f16::from_f32(exact).to_f32()
                } else {
                    exact
                };
                assert_eq!(d, want, "{ty} block {b}");
                assert!(v.qs[range.clone()].iter().any(|&c| c.abs() == 127));
                // Codes come from the exact scale: within half a step of x, plus 127 steps of the scale's rounding.
                let slack = exact as f64 * 0.5 * (1.0 + 1e-6) + 127.0 * (d as f64 - exact as f64).abs();
                for i in range {
                    assert!((dq[i] - x[i] as f64).abs() <= slack, "{ty} {i}");
                }
            }
        }
        assert!(v.qs.iter().all(|&c| c != i8::MIN));
    }
}

#[test]
fn int8_simd_matches_reference_within_1e5_of_abs_sum() {
    if !simd_available() {
        eprintln!("skipping: no AVX2+FMA+F16C on this CPU");
        return;
    }
    let mut rng = Rng(0x1234_5678);
    for ty in dot_types() {
        let g = ty.geometry();
        let lens: &[usize] = if g.block_elems == 1 {
            &[7, 4096 + 13]
        } else {
            &[1, 3, 16]
        };
        for &n_blocks in lens {
            let row = random_row(&mut rng, ty, n_blocks);
            let x: Vec<f32> = (0..n_blocks * g.block_elems).map(|_| rng.gauss()).collect();
            let q = quantize_activations(ty, &x).unwrap();
            let v = q.vector(0);
            let fast = vec_dot_q8(ty, &row, &v).unwrap() as f64;
            let slow = (reference::dot_q8_fn(ty).unwrap())(&row, &v) as f64;
            let (_, abs) = dot_f64(ty, &row, &dequantized_activations(&v));
            let tol = 1e-5 * abs + 1e-30;
            assert!(
                (fast - slow).abs() <= tol,
                "{ty} {n_blocks} blocks: simd {fast} vs reference {slow}, tol {tol}"
            );
        }
    }
}

#[test]
fn int8_reference_equals_dot_with_quantized_activations() {
    // The integer kernels compute exactly Σ w[i] * (d q)[i]: only f32 rounding of the block terms differs.
    let mut rng = Rng(99);
    for ty in int8_types() {
        let g = ty.geometry();
        for n_blocks in [1, 5] {
            let row = random_row(&mut rng, ty, n_blocks);
            let x: Vec<f32> = (0..n_blocks * g.block_elems).map(|_| rng.gauss()).collect();
            let q = quantize_activations(ty, &x).unwrap();
            let v = q.vector(0);
            let got = (reference::dot_q8_fn(ty).unwrap())(&row, &v) as f64;
            let (want, abs) = dot_f64(ty, &row, &dequantized_activations(&v));
            assert!(
                (got - want).abs() <= 1e-5 * abs + 1e-30,
                "{ty} {n_blocks} blocks: {got} vs {want} (Σ|wx| {abs})"
            );
        }
    }
}

/// Largest `|int8 dot - exact| / Σ|w x|` over 64 rows of 4096 weights (quantized with our quantizers, or random
/// codes for the IQ types), for gaussian activations and for gaussian activations with 1% outliers of 20σ.
fn int8_relative_error(ty: GgmlType, outliers: bool) -> f64 {
    let mut rng = Rng(0xC0FFEE);
    let n = 4096;
    let g = ty.geometry();
    let mut worst = 0f64;
    for _ in 0..64 {
        let row = if can_quantize(ty) {
            let w: Vec<f32> = (0..n).map(|_| rng.gauss() * 0.02).collect();
            let mut row = vec![0u8; n / g.block_elems * g.block_bytes];
            quantize(ty, &w, &mut row).unwrap();
            row
        } else {
            random_row(&mut rng, ty, n / g.block_elems)
        };
        let x: Vec<f32> = (0..n)
            .map(|_| {
                let v = rng.gauss();
                if outliers && rng.next_u64().is_multiple_of(100) {
                    20.0 * v
                } else {
                    v
                }
            })
            .collect();
        let q = quantize_activations(ty, &x).unwrap();
        let got = vec_dot_q8(ty, &row, &q.vector(0)).unwrap() as f64;
        let exact: Vec<f64> = x.iter().map(|&v| v as f64).collect();
        let (want, abs) = dot_f64(ty, &row, &exact);
        worst = worst.max((got - want).abs() / abs);
    }
    worst
}

#[test]
fn int8_dot_error_against_exact_f32_activations() {
    // Bounds: about 2.5x the worst case measured (with outliers) over 64 rows; see quant/mod.rs for the table.
    for ty in int8_types() {
        let (gauss, spiky) = (int8_relative_error(ty, false), int8_relative_error(ty, true));
        let bound = if activation_format(ty).unwrap() == ActivationFormat::Q8_K {
            1.2e-2
        } else {
            4e-3
        };
        eprintln!("{ty}: max |int8 - exact| / Σ|wx|: gaussian {gauss:.2e}, with outliers {spiky:.2e}");
        assert!(gauss < bound && spiky < bound, "{ty}: {gauss} / {spiky} exceed {bound}");
    }
}

#[test]
fn int8_edge_cases() {
    let mut rng = Rng(5);
    for ty in int8_types() {
        let g = ty.geometry();
        let n = 2 * QK_K;
        let row = random_row(&mut rng, ty, n / g.block_elems);
        let zero_row = vec![0u8; row.len()];
        let x: Vec<f32> = (0..n).map(|_| rng.gauss()).collect();
        let q = quantize_activations(ty, &x).unwrap();
        let zx = quantize_activations(ty, &vec![0f32; n]).unwrap();
        for f in [dot_q8_fn(ty).unwrap(), reference::dot_q8_fn(ty).unwrap()] {
            assert_eq!(f(&zero_row, &q.vector(0)), 0.0, "{ty}: zero row");
            assert_eq!(f(&row, &zx.vector(0)), 0.0, "{ty}: zero activations");
            // Large magnitudes: scale x by 1e30; the result scales with it and stays finite.
            let big: Vec<f32> = x.iter().map(|v| v * 1e30).collect();
            let qb = quantize_activations(ty, &big).unwrap();
            let (small, large) = (f(&row, &q.vector(0)) as f64, f(&row, &qb.vector(0)) as f64);
            // The scales of 32-value blocks are f16 for `small` and (beyond f16's range) f32 for `large`: each
            // block's term agrees to f16's precision, 2^-11, so the sums agree within 2^-11 Σ|w x|.
            let exact: Vec<f64> = x.iter().map(|&v| v as f64).collect();
            let (_, abs) = dot_f64(ty, &row, &exact);
            assert!(
                large.is_finite() && (large / 1e30 - small).abs() <= 1e-3 * abs + 1e-3,
                "{ty}: {small} vs {large} (Σ|wx| {abs})"
            );
            // A NaN activation makes the dot NaN, as on the f32 path.
            let mut xn = x.clone();
            xn[QK_K + 1] = f32::NAN;
            let qn = quantize_activations(ty, &xn).unwrap();
            assert!(f(&row, &qn.vector(0)).is_nan(), "{ty}: NaN activation");
            // Inconsistent lengths: a wrong sum, never a panic; extra activations are ignored.
            let v = q.vector(0);
            let _ = f(&row[..row.len() - 1], &v);
            let _ = f(&[], &v);
            let prefix = f(&row[..g.block_bytes], &v);
            let short = quantize_activations(ty, &x[..g.block_elems]).unwrap();
            assert_eq!(prefix, f(&row[..g.block_bytes], &short.vector(0)), "{ty}: prefix");
            let _ = f(&row, &short.vector(0));
            // Activations in another format: NaN, not garbage.
            let other = if activation_format(ty).unwrap() == ActivationFormat::Q8_K {
                GgmlType::Q4_0
            } else {
                GgmlType::Q4_K
            };
            let wrong = quantize_activations(other, &x).unwrap();
            assert!(f(&row, &wrong.vector(0)).is_nan(), "{ty}: wrong format");
            let f32s = quantize_activations(GgmlType::F32, &x).unwrap();
            assert!(f(&row, &f32s.vector(0)).is_nan(), "{ty}: f32 activations");
        }
    }
}

#[test]
fn int8_checked_entry_errors() {
    let x = vec![0.5f32; 512];
    let q = quantize_activations(GgmlType::Q4_K, &x).unwrap();
    let e = vec_dot_q8(GgmlType::Q4_0, &[0u8; 18 * 16], &q.vector(0)).unwrap_err();
    assert_eq!(
        e,
        QuantError::ActivationFormat {
            ty: GgmlType::Q4_0,
            op: "vec_dot_q8",
            expected: ActivationFormat::Q8_1,
            actual: ActivationFormat::Q8_K
        }
    );
    assert!(e.to_string().contains("Q4_0") && e.to_string().contains("Q8_K"), "{e}");
    let e = vec_dot_q8(GgmlType::Q4_K, &[0u8; 144], &q.vector(0)).unwrap_err();
    assert!(
        matches!(
            e,
            QuantError::LengthMismatch {
                expected: 256,
                actual: 512,
                ..
            }
        ),
        "{e:?}"
    );
    let e = quantize_activations(GgmlType::Q4_K, &x[..100]).unwrap_err();
    assert!(
        matches!(
            e,
            QuantError::NotWholeBlocks {
                len: 100,
                block: 256,
                ..
            }
        ),
        "{e:?}"
    );
    let e = QuantizedActivations::new()
        .quantize(GgmlType::Q4_0, &x[..96], 64)
        .unwrap_err();
    assert!(
        matches!(
            e,
            QuantError::LengthMismatch {
                expected: 64,
                actual: 96,
                ..
            }
        ),
        "{e:?}"
    );
    assert!(quantize_activations(GgmlType::IQ1_S, &x).is_err());
    assert!(dot_q8_fn(GgmlType::TQ2_0).is_err());
    // n = 0: no vectors.
    let mut q = QuantizedActivations::new();
    q.quantize(GgmlType::Q4_0, &[], 0).unwrap();
    assert_eq!(q.count(), 0);
}

#[test]
fn activation_buffer_reuse_matches_fresh_quantization() {
    let mut rng = Rng(17);
    let x: Vec<f32> = (0..3 * 512).map(|_| rng.gauss()).collect();
    let mut buf = QuantizedActivations::new();
    buf.quantize(GgmlType::Q6_K, &x, 512).unwrap();
    buf.quantize(GgmlType::Q4_1, &x[..64], 64).unwrap();
    buf.quantize(GgmlType::Q4_1, &x, 512).unwrap();
    assert_eq!(
        (buf.count(), buf.vector_len(), buf.format()),
        (3, 512, ActivationFormat::Q8_1)
    );
    for t in 0..3 {
        let fresh = quantize_activations(GgmlType::Q4_1, &x[t * 512..(t + 1) * 512]).unwrap();
        let (a, b) = (buf.vector(t), fresh.vector(0));
        assert_eq!((a.qs, a.d, a.sums), (b.qs, b.d, b.sums), "vector {t}");
    }
    buf.quantize(GgmlType::BF16, &x, 512).unwrap();
    assert_eq!(buf.vector(2).f32s, &x[1024..]);
}

#[test]
fn q4_k_on_512_bit_registers_gives_the_avx2_kernels_bits() {
    if !simd_available() || !(is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512bw")) {
        eprintln!("skipping: no AVX-512BW on this CPU (the AVX2 kernel runs there, so there is nothing to compare)");
        return;
    }
    let mut rng = Rng(512);
    for n_blocks in [1, 3, 8] {
        for scale in [1.0f32, 1e-3, 1e3] {
            let row = random_row(&mut rng, GgmlType::Q4_K, n_blocks);
            let x: Vec<f32> = (0..n_blocks * QK_K).map(|_| rng.gauss() * scale).collect();
            let mut a = QuantizedActivations::new();
            a.quantize(GgmlType::Q4_K, &x, n_blocks * QK_K).unwrap();
            let v = a.vector(0);
            let (wide, narrow) = (avx2_int8::dot_q4_k_512(&row, &v), avx2_int8::dot_q4_k_avx2(&row, &v));
            assert!(wide.is_finite(), "{n_blocks} blocks x{scale}: {wide}");
            assert_eq!(
                wide.to_bits(),
                narrow.to_bits(),
                "{n_blocks} blocks x{scale}: {wide} vs {narrow}"
            );
        }
    }
}

#[test]
fn vnni_kernels_give_the_avx2_kernels_bits() {
    if !simd_available() || !avx2_int8::vnni_available() {
        eprintln!("skipping: no AVX-512 VNNI on this CPU, or STRATA_CPU_VNNI=0 (nothing to compare)");
        return;
    }
    /// A type's one-token and several-token entries, VNNI form first.
    macro_rules! forms {
        ($ty:ident, $one:ident, $many:ident) => {
            (
                GgmlType::$ty,
                (
                    avx2_int8::$one::<true> as DotQ8Fn,
                    avx2_int8::$one::<false> as DotQ8Fn,
                    avx2_int8::$many::<true> as DotQ8ManyFn,
                    avx2_int8::$many::<false> as DotQ8ManyFn,
                ),
            )
        };
    }
    let kernels = [
        forms!(Q4_0, dot_q4_0, dot_q4_0_many),
        forms!(Q4_1, dot_q4_1, dot_q4_1_many),
        forms!(Q5_0, dot_q5_0, dot_q5_0_many),
        forms!(Q5_1, dot_q5_1, dot_q5_1_many),
        forms!(Q8_0, dot_q8_0, dot_q8_0_many),
        forms!(IQ4_NL, dot_iq4_nl, dot_iq4_nl_many),
    ];
    let mut rng = Rng(0x564e_4e49);
    for (ty, (one_v, one, many_v, many)) in kernels {
        // Random bytes as weights reach every code (Q8_0's -128 too); the activations' largest code is ±127.
        for n_blocks in [1, 2, 7, 18] {
            let row = random_row(&mut rng, ty, n_blocks);
            let n = n_blocks * 32;
            let x: Vec<f32> = (0..5 * n).map(|_| rng.gauss() * 3.0).collect();
            let mut a = QuantizedActivations::new();
            a.quantize(ty, &x, n).unwrap();
            let vs: Vec<_> = (0..5).map(|t| a.vector(t)).collect();
            for v in &vs {
                let (got, want) = (one_v(&row, v), one(&row, v));
                assert!(want.is_finite(), "{ty:?} {n_blocks} blocks: {want}");
                assert_eq!(
                    got.to_bits(),
                    want.to_bits(),
                    "{ty:?} {n_blocks} blocks: {got} vs {want}"
                );
            }
            let (mut got, mut want) = ([0f32; 5], [0f32; 5]);
            many_v(&row, &vs, &mut got);
            many(&row, &vs, &mut want);
            assert_eq!(
                got.map(f32::to_bits),
                want.map(f32::to_bits),
                "{ty:?} {n_blocks} blocks, 5 tokens"
            );
        }
    }
}

#[test]
fn several_token_kernels_give_each_tokens_one_token_bits() {
    if !simd_available() {
        eprintln!("skipping: no AVX2+FMA+F16C on this CPU (no several-token kernels run there)");
        return;
    }
    let many_types: Vec<GgmlType> = int8_types()
        .into_iter()
        .filter(|&t| dot_q8_many_fn(t).is_some())
        .collect();
    assert_eq!(many_types.len(), 9, "types with a several-token kernel: {many_types:?}");
    let mut rng = Rng(0x4d41_4e59);
    for ty in many_types {
        let (one, many) = (dot_q8_fn(ty).unwrap(), dot_q8_many_fn(ty).unwrap());
        let block = ty.geometry().block_elems;
        // Odd and even block counts (the 32-value kernels take blocks in pairs), and every group size 1..=9
        // (4 + 4 + 1, 4 + 2, ...), with activations of very different scales side by side.
        for n_blocks in [1, 2, 3, 16] {
            let row = random_row(&mut rng, ty, n_blocks);
            for n_vec in 1..=9 {
                let cols = n_blocks * block;
                let x: Vec<f32> = (0..n_vec * cols)
                    .map(|i| rng.gauss() * [1.0, 1e-3, 1e3][(i / cols) % 3])
                    .collect();
                let mut q = QuantizedActivations::new();
                q.quantize(ty, &x, cols).unwrap();
                let vs: Vec<_> = (0..n_vec).map(|t| q.vector(t)).collect();
                let mut got = vec![f32::NAN; n_vec];
                many(&row, &vs, &mut got);
                for (t, v) in vs.iter().enumerate() {
                    let want = one(&row, v);
                    assert!(want.is_finite(), "{ty}: {want}");
                    assert_eq!(
                        got[t].to_bits(),
                        want.to_bits(),
                        "{ty}, {n_blocks} blocks, token {t} of {n_vec}: {} vs one token's {want}",
                        got[t]
                    );
                }
            }
        }
    }
}
