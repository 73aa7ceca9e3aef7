//! Throughput of `quant::vec_dot` per quant type, next to this machine's memory read bandwidth.
//!
//! Run: `cargo bench -p strata-engine --bench quant_dot` (about two minutes). Prints one table: for each type its
//! bits per weight, then GB/s (10^9 bytes per second) of *weight bytes* consumed by one core running the
//! reference and the SIMD f32-activation dot product (`quant::dot_fn`) and the int8-activation one
//! (`quant::dot_q8_fn`, activations quantized once outside the timed loop, as a matmul does), over rows of 4096
//! weights:
//! - "L2": a 512 KiB set of rows, swept repeatedly (in cache; the kernel's compute ceiling);
//! - "DRAM": a 192 MiB set of rows, swept once per pass (beyond L2 and L3; what a decode step sees).
//!
//! The bandwidth lines above the table are a plain sum over a 1 GiB buffer, on one core and on all cores (rayon),
//! so the DRAM column can be read as a fraction of what one core can pull. A second table gives quantize
//! throughput (MB/s of f32 input on one core), for the model generator. Every figure is the best of 3 trials.

mod common;

use std::hint::black_box;

use common::{Rng, memory_bandwidth, rate};
use strata_engine::quant::{self, GgmlType};

const ROW_ELEMS: usize = 4096;
const L2_SET_BYTES: usize = 512 << 10;
const DRAM_SET_BYTES: usize = 192 << 20;

/// The weight types with a dot product (the kernel table; Q8_K is an activation type), widest first.
fn types() -> Vec<GgmlType> {
    let mut t: Vec<GgmlType> = quant::dot_types()
        .into_iter()
        .filter(|&t| t != GgmlType::Q8_K)
        .collect();
    t.sort_by(|a, b| b.bits_per_weight().total_cmp(&a.bits_per_weight()));
    t
}

fn rows(ty: GgmlType, n_rows: usize, rng: &mut Rng) -> Vec<u8> {
    common::rows(ty, n_rows, ROW_ELEMS, rng)
}

/// GB/s of weight bytes for the int8-activation `dot` over every row of `data`.
fn dot_q8_rate(ty: GgmlType, data: &[u8], x: &quant::ActivationVector<'_>, dot: quant::DotQ8Fn) -> f64 {
    let row_bytes = ty.row_bytes(ROW_ELEMS as u64).unwrap() as usize;
    quant::check_dot_q8(ty, &data[..row_bytes], x).unwrap();
    rate(data.len(), || {
        let mut s = 0f32;
        for row in data.chunks_exact(row_bytes) {
            s += dot(black_box(row), black_box(x));
        }
        black_box(s);
    }) / 1e9
}

/// GB/s of weight bytes for `dot` over every row of `data`.
fn dot_rate(ty: GgmlType, data: &[u8], x: &[f32], dot: quant::DotFn) -> f64 {
    let row_bytes = ty.row_bytes(ROW_ELEMS as u64).unwrap() as usize;
    quant::check_dot(ty, &data[..row_bytes], x).unwrap();
    rate(data.len(), || {
        let mut s = 0f32;
        for row in data.chunks_exact(row_bytes) {
            s += dot(black_box(row), black_box(x));
        }
        black_box(s);
    }) / 1e9
}

fn main() {
    // `cargo bench` passes `--bench`; anything else (like `cargo test --benches`) gets a quick smoke run.
    let full = std::env::args().any(|a| a == "--bench");
    let mut rng = Rng(0x5EED);
    let x: Vec<f32> = (0..ROW_ELEMS).map(|_| rng.uniform()).collect();
    let (revision, cpu) = (common::revision(), common::cpu_name());
    println!(
        "quant_dot: revision {}, cpu {cpu}, {} threads, SIMD (AVX2+FMA+F16C) {}",
        revision,
        rayon::current_num_threads(),
        if quant::simd_available() { "yes" } else { "no" }
    );
    println!("rows of {ROW_ELEMS} weights; GB/s = 10^9 bytes/s of weight bytes read by vec_dot on one core; best of 3");
    if !full {
        println!("(smoke run: pass --bench, as `cargo bench` does, for figures)");
    }
    if full {
        let (one, all) = memory_bandwidth();
        println!(
            "memory read bandwidth (sum over 1 GiB): one core {:.1} GB/s, all cores {:.1} GB/s",
            one / 1e9,
            all / 1e9
        );
    }
    println!();
    println!(
        "| type | bits/weight | ref L2 GB/s | SIMD L2 GB/s | ref DRAM GB/s | SIMD DRAM GB/s | SIMD/ref (L2) | SIMD DRAM Gweights/s | int8 act | int8 L2 GB/s | int8 DRAM GB/s | int8/SIMD (DRAM) | quantize act ns |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    let mut xq = quant::QuantizedActivations::new();
    // QUANT_DOT_TYPES=Q4_0,Q4_K limits the table to those types.
    let only: Option<Vec<GgmlType>> = std::env::var("QUANT_DOT_TYPES")
        .ok()
        .map(|v| v.split(',').filter_map(GgmlType::from_name).collect());
    for ty in types()
        .into_iter()
        .filter(|t| only.as_ref().is_none_or(|o| o.contains(t)))
    {
        let row_bytes = ty.row_bytes(ROW_ELEMS as u64).unwrap() as usize;
        let l2_rows = (L2_SET_BYTES / row_bytes).max(1);
        let dram_rows = if full { DRAM_SET_BYTES / row_bytes } else { l2_rows };
        let small = rows(ty, l2_rows, &mut rng);
        let big = rows(ty, dram_rows, &mut rng);
        let reference = quant::reference::dot_fn(ty).unwrap();
        let fast = quant::dot_fn(ty).unwrap();
        let (ref_l2, simd_l2) = (dot_rate(ty, &small, &x, reference), dot_rate(ty, &small, &x, fast));
        let (ref_mem, simd_mem) = (dot_rate(ty, &big, &x, reference), dot_rate(ty, &big, &x, fast));
        let fast_q8 = quant::dot_q8_fn(ty).unwrap();
        xq.quantize(ty, &x, ROW_ELEMS).unwrap();
        let v = xq.vector(0);
        let (q8_l2, q8_mem) = (dot_q8_rate(ty, &small, &v, fast_q8), dot_q8_rate(ty, &big, &v, fast_q8));
        // The once-per-matmul cost: quantizing one activation vector of ROW_ELEMS values.
        let mut buf = quant::QuantizedActivations::new();
        let quant_ns = 1e9 / rate(1, || buf.quantize(ty, black_box(&x), ROW_ELEMS).unwrap());
        let bpw = ty.bits_per_weight();
        println!(
            "| {ty} | {bpw:.4} | {ref_l2:.2} | {simd_l2:.2} | {ref_mem:.2} | {simd_mem:.2} | {:.1}x | {:.2} | {} | {q8_l2:.2} | {q8_mem:.2} | {:.2}x | {quant_ns:.0} |",
            simd_l2 / ref_l2,
            simd_mem * 8.0 / bpw,
            v.format(),
            q8_mem / simd_mem
        );
    }

    println!();
    println!("| quantize type | MB/s of f32 input, one core |");
    println!("|---|---|");
    let input: Vec<f32> = (0..64 * ROW_ELEMS).map(|_| rng.uniform()).collect();
    for ty in [
        GgmlType::Q8_0,
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q5_0,
        GgmlType::Q5_1,
        GgmlType::Q2_K,
        GgmlType::Q3_K,
        GgmlType::Q4_K,
        GgmlType::Q5_K,
        GgmlType::Q6_K,
        GgmlType::BF16,
    ] {
        let g = ty.geometry();
        let mut out = vec![0u8; input.len() / g.block_elems * g.block_bytes];
        let r = rate(input.len() * 4, || {
            quant::quantize(ty, black_box(&input), &mut out).unwrap()
        });
        println!("| {ty} | {:.0} |", r / 1e6);
    }
}
