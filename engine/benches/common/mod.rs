//! What the benchmarks share: data without a dependency, best-of-3 rates, the machine's read bandwidth (the bound
//! a weight-streaming kernel is read against) and quantized random rows.

#![allow(dead_code)] // each benchmark uses part of this module

use std::hint::black_box;
use std::time::{Duration, Instant};

use rayon::prelude::*;
use strata_engine::quant::{self, GgmlType};

/// The shortest trial [`rate`] times.
pub const MIN_TRIAL: Duration = Duration::from_millis(120);

/// xorshift64: benchmark data without a dependency.
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    /// Uniform in [-1, 1).
    pub fn uniform(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
}

/// Best-of-3 rate (bytes / second) of `f`, which processes `bytes_per_call` bytes per call.
pub fn rate(bytes_per_call: usize, mut f: impl FnMut()) -> f64 {
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

/// Read bandwidth (bytes / second) of summing a 1 GiB buffer on one core and on all of rayon's threads.
pub fn memory_bandwidth() -> (f64, f64) {
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

/// `n_rows` rows of `cols` weights of `ty` with random codes and sane scales: one 1 MiB (or smaller) tile of
/// quantized random data, repeated.
pub fn rows(ty: GgmlType, n_rows: usize, cols: usize, rng: &mut Rng) -> Vec<u8> {
    let row_bytes = ty.row_bytes(cols as u64).unwrap() as usize;
    let tile_rows = n_rows.min((1 << 20) / row_bytes).max(1);
    let vals: Vec<f32> = (0..tile_rows * cols).map(|_| rng.uniform()).collect();
    let mut tile = vec![0u8; tile_rows * row_bytes];
    let tile_ty = if quant::can_quantize(ty) { ty } else { GgmlType::F32 };
    if tile_ty == ty {
        tile.par_chunks_mut(row_bytes)
            .zip(vals.par_chunks(cols))
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

/// `git rev-parse --short HEAD`, or empty.
pub fn revision() -> String {
    std::process::Command::new("git")
        .args(["rev-parse", "--short", "HEAD"])
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .unwrap_or_default()
        .trim()
        .to_string()
}

/// The CPU's model name from /proc/cpuinfo.
pub fn cpu_name() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .map(|l| l.split(':').nth(1).unwrap_or("").trim().to_string())
        })
        .unwrap_or_else(|| "unknown".into())
}
