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

use std::hint::black_box;
use std::time::{Duration, Instant};

use rayon::prelude::*;
use strata_engine::quant::{self, GgmlType};

const ROW_ELEMS: usize = 4096;
const L2_SET_BYTES: usize = 512 << 10;
const DRAM_SET_BYTES: usize = 192 << 20;
const MIN_TRIAL: Duration = Duration::from_millis(120);

/// The weight types with a dot product (the kernel table; Q8_K is an activation type), widest first.
fn types() -> Vec<GgmlType> {
    let mut t: Vec<GgmlType> = quant::dot_types()
        .into_iter()
        .filter(|&t| t != GgmlType::Q8_K)
        .collect();
    t.sort_by(|a, b| b.bits_per_weight().total_cmp(&a.bits_per_weight()));
    t
}

/// xorshift64: benchmark data without a dependency.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn uniform(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
}

/// Best-of-3 rate (bytes / second) of `f`, which processes `bytes_per_call` bytes per call.
fn rate(bytes_per_call: usize, mut f: impl FnMut()) -> f64 {
    let mut best = 0f64;
    for _ in 0..3 {
        let start = Instant::now();
        let mut calls = 0u64;
        while start.elapsed() < MIN_TRIAL {
            f();
            calls += 1;
        }
        best = best.max(calls as f64 * bytes_per_call as f64 / start.elapsed().as_secs_f64());
    }
    best
}

/// Read bandwidth (bytes / second) of summing a 1 GiB buffer on one core and on all cores.
fn memory_bandwidth() -> (f64, f64) {
    let buf: Vec<u64> = (0..(1usize << 30) / 8).map(|i| i as u64).collect();
    let bytes = buf.len() * 8;
    let sum = |s: &[u64]| {
        let mut acc = [0u64; 8];
        for c in s.chunks_exact(8) {
            for k in 0..8 {
                acc[k] = acc[k].wrapping_add(c[k]);
            }
        }
        acc.iter().fold(0u64, |a, &b| a.wrapping_add(b))
    };
    let one = rate(bytes, || {
        black_box(sum(black_box(&buf)));
    });
    let all = rate(bytes, || {
        black_box(buf.par_chunks(1 << 20).map(sum).reduce(|| 0, u64::wrapping_add));
    });
    (one, all)
}

/// `n_rows` rows of `ty` with random codes and sane scales: one 1 MiB (or smaller) tile of quantized random data,
/// repeated.
fn rows(ty: GgmlType, n_rows: usize, rng: &mut Rng) -> Vec<u8> {
    let row_bytes = ty.row_bytes(ROW_ELEMS as u64).unwrap() as usize;
    let tile_rows = n_rows.min((1 << 20) / row_bytes).max(1);
    let vals: Vec<f32> = (0..tile_rows * ROW_ELEMS).map(|_| rng.uniform()).collect();
    let mut tile = vec![0u8; tile_rows * row_bytes];
    let tile_ty = if quant::can_quantize(ty) { ty } else { GgmlType::F32 };
    if tile_ty == ty {
        tile.par_chunks_mut(row_bytes)
            .zip(vals.par_chunks(ROW_ELEMS))
            .for_each(|(d, s)| {
                quant::quantize(ty, s, d).unwrap();
            });
    } else {
        // IQ types have no quantizer: random codes, each block's leading f16 scale set to 0.01.
        let bb = ty.geometry().block_bytes;
        for (i, b) in tile.iter_mut().enumerate() {
            *b = if i % bb < 2 {
                [0x1F, 0x21][i % bb]
            } else {
                rng.next() as u8
            };
        }
    }
    let mut out = Vec::with_capacity(n_rows * row_bytes);
    while out.len() < n_rows * row_bytes {
        let take = (n_rows * row_bytes - out.len()).min(tile.len());
        out.extend_from_slice(&tile[..take]);
    }
    out
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
    let revision = std::process::Command::new("git")
        .args(["rev-parse", "--short", "HEAD"])
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .unwrap_or_default();
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .map(|l| l.split(':').nth(1).unwrap_or("").trim().to_string())
        })
        .unwrap_or_else(|| "unknown".into());
    println!(
        "quant_dot: revision {}, cpu {cpu}, {} threads, SIMD (AVX2+FMA+F16C) {}",
        revision.trim(),
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
