//! Quant goldens from PyPI `gguf` (fixtures/quant/gen_goldens.py; the file format is described there).
//!
//! - `dequant_<TYPE>.bin`: our [`quant::dequantize`] must equal `gguf.quants.dequantize` bit for bit (f32 bit
//!   patterns compared, so NaN equals NaN with the same payload).
//! - `quant_<TYPE>.bin`: our [`quant::quantize`] must produce the same bytes as `gguf.quants.quantize`.
//! - On the same blocks, the reference dot product must agree with `Σ dequantize(row)[i] * x[i]` computed in f64
//!   within `1e-5 * Σ |w[i] * x[i]|` (f32 accumulation over at most a few thousand terms), and the dispatched
//!   (SIMD) dot product within the same bound.

use std::path::{Path, PathBuf};

use strata_engine::quant::{self, GgmlType};

fn goldens_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/quant/goldens")
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().unwrap())
}

/// `(type, payload after the 12-byte header)` of one golden file.
fn read_golden(path: &Path, magic: &[u8; 4]) -> (GgmlType, u32, Vec<u8>) {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    assert_eq!(&bytes[..4], magic, "{}: bad magic", path.display());
    let ty = GgmlType::from_id(u32_at(&bytes, 4)).unwrap_or_else(|| panic!("{}: unknown type", path.display()));
    (ty, u32_at(&bytes, 8), bytes[12..].to_vec())
}

fn golden_files(prefix: &str) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(goldens_dir())
        .expect("fixtures/quant/goldens exists")
        .map(|e| e.unwrap().path())
        .filter(|p| p.file_name().unwrap().to_str().unwrap().starts_with(prefix))
        .collect();
    files.sort();
    files
}

/// The deterministic activation vector used for dot checks (a fixed LCG, values in [-1, 1)).
fn activations(n: usize) -> Vec<f32> {
    let mut state = 0x2545_F491_4F6C_DD1Du64;
    (0..n)
        .map(|_| {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((state >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

#[test]
fn dequantize_matches_gguf_bit_exact() {
    let files = golden_files("dequant_");
    assert!(
        files.len() >= 17,
        "expected goldens for every type, found {}",
        files.len()
    );
    let mut checked = Vec::new();
    for path in files {
        let (ty, n_blocks, payload) = read_golden(&path, b"SQDQ");
        if !quant::can_dequantize(ty) {
            continue;
        }
        let g = ty.geometry();
        let n_bytes = n_blocks as usize * g.block_bytes;
        let n_elems = n_blocks as usize * g.block_elems;
        let (raw, expected) = payload.split_at(n_bytes);
        assert_eq!(expected.len(), 4 * n_elems, "{}", path.display());
        let mut out = vec![0f32; n_elems];
        quant::dequantize(ty, raw, &mut out).unwrap();
        for (i, (got, want)) in out.iter().zip(expected.chunks_exact(4)).enumerate() {
            let want = u32::from_le_bytes(want.try_into().unwrap());
            assert_eq!(
                got.to_bits(),
                want,
                "{ty} element {i} (block {}): got {got:e}, gguf gives {:e}",
                i / g.block_elems,
                f32::from_bits(want)
            );
        }
        checked.push(ty);
    }
    // Every type with a dot product has a golden, but F32 (the reference itself) and Q8_K (an activation type
    // that no GGUF stores weights in): the list comes from the kernel table, so a new type needs its golden.
    let required: Vec<GgmlType> = quant::dot_types()
        .into_iter()
        .filter(|t| !matches!(t, GgmlType::F32 | GgmlType::Q8_K))
        .collect();
    assert_eq!(required.len(), 16, "{required:?}");
    for required in required {
        assert!(checked.contains(&required), "no golden checked for {required}");
    }
}

#[test]
fn quantize_matches_gguf_bit_exact() {
    let files = golden_files("quant_");
    assert!(files.len() >= 7, "expected quantize goldens, found {}", files.len());
    for path in files {
        let (ty, n_elems, payload) = read_golden(&path, b"SQQT");
        let (input, expected) = payload.split_at(4 * n_elems as usize);
        let input: Vec<f32> = input
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        let mut out = vec![0u8; expected.len()];
        quant::quantize(ty, &input, &mut out).unwrap();
        let block = ty.geometry().block_bytes;
        for (i, (got, want)) in out.chunks(block).zip(expected.chunks(block)).enumerate() {
            assert_eq!(got, want, "{ty} block {i}: our bytes differ from gguf.quants.quantize");
        }
    }
}

#[test]
fn dot_products_agree_with_f64_sum_of_dequantized() {
    for path in golden_files("dequant_") {
        let (ty, n_blocks, payload) = read_golden(&path, b"SQDQ");
        if !quant::can_dequantize(ty) {
            continue;
        }
        let g = ty.geometry();
        let raw = &payload[..n_blocks as usize * g.block_bytes];
        let n = n_blocks as usize * g.block_elems;
        let mut w = vec![0f32; n];
        quant::dequantize(ty, raw, &mut w).unwrap();
        if w.iter().any(|v| v.is_nan() || v.abs() >= 1e30) {
            continue; // the F16/BF16 goldens carry inf, NaN and huge values on purpose
        }
        let x = activations(n);
        let exact: f64 = w.iter().zip(&x).map(|(&a, &b)| a as f64 * b as f64).sum();
        let magnitude: f64 = w.iter().zip(&x).map(|(&a, &b)| (a as f64 * b as f64).abs()).sum();
        let tol = 1e-5 * magnitude + 1e-30;
        let reference = quant::reference::vec_dot(ty, raw, &x).unwrap() as f64;
        assert!(
            (reference - exact).abs() <= tol,
            "{ty}: reference {reference} vs f64 {exact} (tol {tol})"
        );
        let fast = quant::vec_dot(ty, raw, &x).unwrap() as f64;
        assert!(
            (fast - exact).abs() <= tol,
            "{ty}: vec_dot {fast} vs f64 {exact} (tol {tol})"
        );
    }
}
