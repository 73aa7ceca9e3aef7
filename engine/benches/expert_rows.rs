//! The CPU's expert throughput at decode: `CpuBackend::expert_rows`, the path that computes the experts a GPU's
//! expert cache misses (DESIGN.md section 3, "Expert cache"), next to this machine's all-core read bandwidth, the
//! bound (the experts stream from host memory once per use).
//!
//! Run: `cargo bench -p strata-engine --bench expert_rows` (about a minute). Experts of Qwen3-30B-A3B's shape
//! (n_embd 2048, n_ff_exp 768, 128 experts per layer, Q4_K: 2.65 MB each) in 4 layers (1.36 GB, well past the
//! last-level cache); each step computes `k` experts for one token, never the same expert twice in a row. One
//! table row per `k` and pool:
//! - "back to back": steps with no gap, the rate `strata bench` measures at start (GB/s of expert bytes and its
//!   fraction of the read bandwidth);
//! - "beat": each step after a 60 us gap, as at decode (the GPU computes the rest of a layer in between): the
//!   median and 90th percentile of a step's wall time, the time its bytes take at the read bandwidth, and the
//!   difference (what a step costs beyond its bytes: the threads' wake-up, the two passes' barriers, the tail).
//!
//! Pools: `spin` is the CUDA backend's CPU join (a spinning pool of the cores less two, plus the caller), `rayon`
//! the global pool. EXPERT_ROWS_K=1,2,4,8 picks the k values; EXPERT_ROWS_WORKERS the spinning pool's workers;
//! EXPERT_ROWS_POOLS=spin (or rayon) one pool. STRATA_EXPERT_TASKS and STRATA_EXPERT_PREFETCH tune the kernel
//! (`strata switches`).

mod common;

use std::time::{Duration, Instant};

use common::{Rng, memory_bandwidth};
use strata_engine::backend::cpu::spin::SpinPool;
use strata_engine::backend::cpu::{CpuBackend, ExpertRowsScratch, Workers};
use strata_engine::backend::{Experts, GluKind, QMat};
use strata_engine::quant::GgmlType;
use strata_engine::switches;

const N_EMBD: usize = 2048;
const N_FF_EXP: usize = 768;
const N_EXPERT: usize = 128;
const LAYERS: usize = 4;

struct Layer {
    gate: Vec<u8>,
    up: Vec<u8>,
    down: Vec<u8>,
}

fn experts(l: &Layer) -> Experts<'_> {
    let ty = GgmlType::Q4_K;
    Experts {
        gate: QMat::new(ty, &l.gate, N_EXPERT * N_FF_EXP, N_EMBD).unwrap(),
        up: QMat::new(ty, &l.up, N_EXPERT * N_FF_EXP, N_EMBD).unwrap(),
        down: QMat::new(ty, &l.down, N_EXPERT * N_EMBD, N_FF_EXP).unwrap(),
        n_expert: N_EXPERT,
        n_ff_exp: N_FF_EXP,
        act: GluKind::SwiGlu,
        layer: 0,
    }
}

/// Spins for `d` (a GPU's share of a layer: the CPU's threads stay awake, as they do at decode).
fn spin_for(d: Duration) {
    let t = Instant::now();
    while t.elapsed() < d {
        std::hint::spin_loop();
    }
}

fn main() {
    let full = std::env::args().any(|a| a == "--bench");
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let workers: usize = std::env::var("EXPERT_ROWS_WORKERS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(cores.saturating_sub(2));
    let ks: Vec<usize> = std::env::var("EXPERT_ROWS_K")
        .ok()
        .map(|v| v.split(',').filter_map(|k| k.parse().ok()).collect())
        .unwrap_or_else(|| vec![1, 2, 4, 8]);
    let layers = if full { LAYERS } else { 1 };
    let mut rng = Rng(0xE4E4);
    let ty = GgmlType::Q4_K;
    let store: Vec<Layer> = (0..layers)
        .map(|_| Layer {
            gate: common::rows(ty, N_EXPERT * N_FF_EXP, N_EMBD, &mut rng),
            up: common::rows(ty, N_EXPERT * N_FF_EXP, N_EMBD, &mut rng),
            down: common::rows(ty, N_EXPERT * N_EMBD, N_FF_EXP, &mut rng),
        })
        .collect();
    let exs: Vec<Experts<'_>> = store.iter().map(experts).collect();
    let expert_bytes = exs[0].expert_bytes() as f64;
    println!(
        "expert_rows: revision {}, cpu {}, {cores} cores; Q4_K experts of {:.2} MB (n_embd {N_EMBD}, n_ff_exp {N_FF_EXP}), {layers} layers of {N_EXPERT}; {}={}, {}={}",
        common::revision(),
        common::cpu_name(),
        expert_bytes / 1e6,
        switches::EXPERT_TASKS,
        std::env::var(switches::EXPERT_TASKS).unwrap_or_else(|_| "default".into()),
        switches::EXPERT_PREFETCH,
        std::env::var(switches::EXPERT_PREFETCH).unwrap_or_else(|_| "default".into()),
    );
    if !full {
        println!("(smoke run: pass --bench, as `cargo bench` does, for figures)");
    }
    let bw = if full { memory_bandwidth().1 } else { 1e11 };
    println!("bound: all-core read bandwidth (sum over 1 GiB) {:.1} GB/s", bw / 1e9);
    println!();
    println!(
        "| pool | threads | k | back to back GB/s | of the read bandwidth | beat: step median us | p90 us | bytes at the bandwidth us | beyond the bytes us |"
    );
    println!("|---|---|---|---|---|---|---|---|---|");
    let pool = SpinPool::new(workers).expect("threads");
    let x: Vec<f32> = (0..N_EMBD).map(|_| rng.uniform()).collect();
    let mut s = ExpertRowsScratch::default();
    let steps = if full { 400 } else { 8 };
    let pools = std::env::var("EXPERT_ROWS_POOLS").unwrap_or_else(|_| "spin,rayon".into());
    for (name, w, threads) in [
        ("spin", Workers::Spin(&pool), workers + 1),
        ("rayon", Workers::Rayon, rayon::current_num_threads()),
    ] {
        if !pools.split(',').any(|p| p == name) {
            continue;
        }
        for &k in &ks {
            let mut out = vec![0f32; k * N_EMBD];
            let mut jobs: Vec<(u32, u32)> = Vec::with_capacity(k);
            let mut next = 0usize;
            let mut step = |s: &mut ExpertRowsScratch, out: &mut [f32]| {
                let ex = &exs[(next / N_EXPERT) % layers];
                jobs.clear();
                jobs.extend((0..k).map(|i| (((next + i) % N_EXPERT) as u32, 0)));
                next += k;
                let t = Instant::now();
                CpuBackend.expert_rows(ex, &x, &jobs, out, s, w, || ());
                t.elapsed().as_secs_f64()
            };
            // Warm-up (page faults, threads), then back to back.
            for _ in 0..steps / 4 {
                step(&mut s, &mut out);
            }
            let secs: f64 = (0..steps).map(|_| step(&mut s, &mut out)).sum();
            let gbs = steps as f64 * k as f64 * expert_bytes / secs;
            let mut beat: Vec<f64> = (0..steps)
                .map(|_| {
                    spin_for(Duration::from_micros(60));
                    step(&mut s, &mut out)
                })
                .collect();
            beat.sort_by(f64::total_cmp);
            let (med, p90) = (beat[beat.len() / 2], beat[beat.len() * 9 / 10]);
            let ideal = k as f64 * expert_bytes / bw;
            println!(
                "| {name} | {threads} | {k} | {:.1} | {:.0}% | {:.1} | {:.1} | {:.1} | {:.1} |",
                gbs / 1e9,
                100.0 * gbs / bw,
                med * 1e6,
                p90 * 1e6,
                ideal * 1e6,
                (med - ideal) * 1e6
            );
        }
    }
}
