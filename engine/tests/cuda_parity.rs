//! CUDA against CPU, op by op and end to end (issue 6, in the manner of llama.cpp's test-backend-ops).
//!
//! Every test needs a CUDA GPU: on a machine without one they are listed as ignored with the reason. On the GPU
//! machine `ci/device-test.sh` runs them (`--ignored`). Each op states its tolerance as the relative error
//! ‖cuda − cpu‖ / ‖cpu‖. Where the two backends round differently, the tolerance says why.

use strata_engine::backend::cpu::CpuBackend;
use strata_engine::backend::cuda::{CudaBackend, DevVec};
use strata_engine::backend::{AttnParams, Backend, Experts, GluKind, MoeScratch, QMat, RopeKind, RopeParams};
use strata_engine::device::fault::FaultPlan;
use strata_engine::fixtures::synth::{SynthArch, SynthSpec, TensorTypes};
use strata_engine::model::{HParams, Model};
use strata_engine::quant::{self, GgmlType};
use strata_engine::runtime::sampling::TopLogits;
use strata_engine::runtime::session::{Session, SessionConfig, StepLogits};
use strata_engine::state::kv::{KV_BLOCK_CELLS, KvCache, KvRows, KvType};

const NEEDS_GPU: &str = "needs a CUDA GPU: run ci/device-test.sh on the device machine";

/// A seeded uniform draw in [-1, 1) (an LCG: enough for test data, no dependency).
struct Rng(u64);
impl Rng {
    fn f(&mut self) -> f32 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((self.0 >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
    fn vec(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.f() * scale).collect()
    }
}

fn rel_err(got: &[f32], want: &[f32]) -> f64 {
    assert_eq!(got.len(), want.len());
    let (mut num, mut den) = (0f64, 0f64);
    for (g, w) in got.iter().zip(want) {
        if !g.is_finite() {
            return f64::INFINITY;
        }
        num += ((g - w) as f64).powi(2);
        den += (*w as f64).powi(2);
    }
    (num / den.max(1e-30)).sqrt()
}

fn gpu() -> CudaBackend {
    CudaBackend::new(0).unwrap_or_else(|e| panic!("CUDA backend: {e}"))
}

/// `x` on the device.
fn up(g: &CudaBackend, x: &[f32]) -> DevVec {
    let mut d = DevVec::default();
    g.reserve(&mut d, x.len());
    g.upload(x, &mut d);
    d
}

/// The first `n` values of `d`, back on the host.
fn down(g: &CudaBackend, d: &DevVec, n: usize) -> Vec<f32> {
    let mut v = vec![0f32; n];
    g.download(d, 0, &mut v);
    v
}

/// One row of the op table: name, measured relative error, tolerance.
struct Row(String, f64, f64);

fn report(rows: &[Row]) {
    let mut bad = Vec::new();
    for Row(name, err, tol) in rows {
        let ok = err <= tol;
        println!(
            "{:<48} rel err {err:.2e}  tol {tol:.0e}  {}",
            name,
            if ok { "ok" } else { "FAIL" }
        );
        if !ok {
            bad.push(name.clone());
        }
    }
    assert!(bad.is_empty(), "over tolerance: {bad:?}");
}

/// One random matrix of `ty` per row count in `shapes`, `cols` wide (a type and shape the quantizer takes).
fn quantized_all(ty: GgmlType, shapes: &[usize], cols: usize, rng: &mut Rng) -> Vec<Vec<u8>> {
    shapes.iter().map(|&r| quantized(ty, r, cols, rng).unwrap()).collect()
}

/// [`quantized_all`]'s matrices as [`QMat`]s.
fn mats<'a>(ty: GgmlType, datas: &'a [Vec<u8>], shapes: &[usize], cols: usize) -> Vec<QMat<'a>> {
    datas
        .iter()
        .zip(shapes)
        .map(|(d, &r)| QMat::new(ty, d, r, cols).unwrap())
        .collect()
}

/// Random gate, up and down matrices of `ne` experts of `ty` (`[ne * f][e]`, `[ne * f][e]`, `[ne * e][f]`), for
/// [`experts`].
fn expert_data(ty: GgmlType, ne: usize, f: usize, e: usize, rng: &mut Rng) -> [Vec<u8>; 3] {
    let g = quantized(ty, ne * f, e, rng).unwrap();
    let u = quantized(ty, ne * f, e, rng).unwrap();
    let d = quantized(ty, ne * e, f, rng).unwrap();
    [g, u, d]
}

/// Layer 0's SwiGLU experts over [`expert_data`]'s matrices: `ne` experts of width `f` in a model of width `e`.
fn experts<'a>(ty: GgmlType, data: &'a [Vec<u8>; 3], ne: usize, f: usize, e: usize) -> Experts<'a> {
    Experts {
        gate: QMat::new(ty, &data[0], ne * f, e).unwrap(),
        up: QMat::new(ty, &data[1], ne * f, e).unwrap(),
        down: QMat::new(ty, &data[2], ne * e, f).unwrap(),
        n_expert: ne,
        n_ff_exp: f,
        act: GluKind::SwiGlu,
        layer: 0,
    }
}

/// A MoE layer's inputs: `n_tok` activation rows of width `e` and router logits over `ne` experts, leaning to the
/// first experts by `lean`: expert 0's logit plus `lean[0]` for every token, expert 1's plus `lean[1]` for three
/// tokens in four, expert 2's plus `lean[2]` for one in three.
fn moe_inputs(rng: &mut Rng, n_tok: usize, ne: usize, e: usize, lean: &[f32]) -> (Vec<f32>, Vec<f32>) {
    let x = rng.vec(n_tok * e, 1.0);
    let mut logits = rng.vec(n_tok * ne, 3.0);
    for t in 0..n_tok {
        for (i, &b) in lean.iter().enumerate() {
            let on = match i {
                0 => true,
                1 => t % 4 != 0,
                _ => t % 3 == 0,
            };
            logits[t * ne + i] += if on { b } else { 0.0 };
        }
    }
    (x, logits)
}

/// The CPU backend's MoE layer (normalized top-`k` weights) over `n_tok` tokens of `x` routed by `logits`.
fn moe_cpu(ex: &Experts<'_>, logits: &[f32], x: &[f32], n_tok: usize, k: usize) -> Vec<f32> {
    let mut out = vec![0f32; n_tok * ex.gate.cols];
    let cpu = CpuBackend;
    Backend::moe(
        &cpu,
        ex,
        &mut logits.to_vec(),
        &x.to_vec(),
        n_tok,
        k,
        true,
        &mut out,
        &mut MoeScratch::default(),
    );
    out
}

/// [`moe_cpu`] on the GPU backend.
fn moe_gpu(gpu: &CudaBackend, ex: &Experts<'_>, logits: &[f32], x: &[f32], n_tok: usize, k: usize) -> Vec<f32> {
    let n = n_tok * ex.gate.cols;
    let mut out = up(gpu, &vec![f32::NAN; n]);
    let mut lg = up(gpu, logits);
    gpu.moe(
        ex,
        &mut lg,
        &up(gpu, x),
        n_tok,
        k,
        true,
        &mut out,
        &mut MoeScratch::default(),
    );
    down(gpu, &out, n)
}

fn quantized(ty: GgmlType, rows: usize, cols: usize, rng: &mut Rng) -> Option<Vec<u8>> {
    let w = rng.vec(rows * cols, 1.0);
    let mut data = vec![0u8; rows * ty.row_bytes(cols as u64)? as usize];
    quant::quantize(ty, &w, &mut data).ok()?;
    Some(data)
}

/// The weight types the GPU computes with (the CUDA backend's kernel table).
fn types() -> Vec<GgmlType> {
    let t: Vec<GgmlType> = GgmlType::ALL
        .iter()
        .copied()
        .filter(|&t| strata_engine::backend::cuda::kernel_type(t).is_some())
        .collect();
    assert_eq!(t.len(), 13, "{t:?}");
    t
}

/// Matmul over types × shapes. Quantized weights: the CPU multiplies int8-quantized activations, the GPU f32 (or
/// f16 in the GEMM), so 2e-2; float weights: the GEMM's f16 activations, 5e-3.
#[test]
#[ignore = "needs a CUDA GPU: run ci/device-test.sh on the device machine"]
fn matmul_matches_cpu() {
    let _ = NEEDS_GPU;
    let (cpu, gpu) = (CpuBackend, gpu());
    // A second backend whose library GEMM "fails" above 4 tokens and whose matrix-vector kernels stop at 4: every
    // prefill shape runs on our own kernel.
    let own = self::gpu();
    assert!(own.set_fault_policy(FaultPlan::parse("prefill_gemm:m>4").unwrap(), true));
    own.set_mmv_dense_tokens(4);
    let mut rng = Rng(7);
    let mut rows_out = Vec::new();
    for ty in types() {
        for &(rows, cols, n_tok) in &[
            (64, 256, 1),
            (96, 512, 3),
            (128, 768, 37),
            (200, 1024, 130),
            (72, 2560, 2),
            // Several tokens per loaded row (mmvt_*, Q4_K and Q6_K): 8 tokens, one block's; 5 tokens of rows of
            // MMV_X_MAX values; rows over MMV_X_MAX values stay on the per-token kernels.
            (300, 2048, 8),
            (1000, 4096, 5),
            (40, 4352, 3),
            (8500, 256, 1),
            (40, 4352, 1),
            // K = 288, not a multiple of the GEMM's 64-value steps (its zero-filled last half step); 32-value block
            // types only (the K-quants' blocks are 256 wide).
            (24, 288, 9),
        ] {
            let Some(data) = quantized(ty, rows, cols, &mut rng) else {
                rows_out.push(Row(
                    format!("matmul {ty} {rows}x{cols}: no quantizer for this shape; skipped"),
                    0.0,
                    0.0,
                ));
                continue;
            };
            let w = QMat::new(ty, &data, rows, cols).unwrap();
            let x = rng.vec(n_tok * cols, 1.0);
            let mut a = vec![0f32; n_tok * rows];
            cpu.matmul(&w, &x, n_tok, &mut a);
            let mut bd = up(&gpu, &vec![f32::NAN; n_tok * rows]);
            Backend::matmul(&gpu, &w, &up(&gpu, &x), n_tok, &mut bd);
            let b = down(&gpu, &bd, n_tok * rows);
            if !a.iter().all(|v| v.is_finite()) {
                rows_out.push(Row(
                    format!("matmul {ty} {rows}x{cols} n_tok={n_tok}: CPU reference not finite"),
                    f64::INFINITY,
                    0.0,
                ));
            }
            let tol = if matches!(ty, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16) {
                5e-3
            } else {
                2e-2
            };
            rows_out.push(Row(
                format!("matmul {ty} {rows}x{cols} n_tok={n_tok}"),
                rel_err(&b, &a),
                tol,
            ));
            if n_tok > 4 {
                let mut od = up(&own, &vec![f32::NAN; n_tok * rows]);
                Backend::matmul(&own, &w, &up(&own, &x), n_tok, &mut od);
                rows_out.push(Row(
                    format!("matmul {ty} {rows}x{cols} n_tok={n_tok}, own tensor-core GEMM"),
                    rel_err(&down(&own, &od, n_tok * rows), &a),
                    tol,
                ));
            }
        }
    }
    report(&rows_out);
}

/// Up to three matrices in one launch (a layer's q/k/v at decode), and the embedding lookup, per type: the
/// same tolerances as matmul; get_rows is a dequantization, exact but for f32 rounding (1e-6).
#[test]
#[ignore = "needs a CUDA GPU: run ci/device-test.sh on the device machine"]
fn matmul_many_and_get_rows_match_cpu() {
    let (cpu, gpu) = (CpuBackend, gpu());
    let mut rng = Rng(17);
    let mut rows_out = Vec::new();
    for ty in types() {
        let cols = 512;
        let shapes = [384usize, 128, 136];
        let datas = quantized_all(ty, &shapes, cols, &mut rng);
        let ws = mats(ty, &datas, &shapes, cols);
        for n_tok in [1usize, 3] {
            let x = rng.vec(n_tok * cols, 1.0);
            let mut outs: Vec<DevVec> = shapes.iter().map(|&r| up(&gpu, &vec![f32::NAN; n_tok * r])).collect();
            let mut refs: Vec<&mut DevVec> = outs.iter_mut().collect();
            gpu.matmul_many(&ws, &up(&gpu, &x), n_tok, &mut refs);
            for (i, w) in ws.iter().enumerate() {
                let mut a = vec![0f32; n_tok * w.rows];
                cpu.matmul(w, &x, n_tok, &mut a);
                let b = down(&gpu, &outs[i], n_tok * w.rows);
                let tol = if matches!(ty, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16) {
                    5e-3
                } else {
                    2e-2
                };
                rows_out.push(Row(
                    format!("matmul_many {ty} matrix {i} n_tok={n_tok}"),
                    rel_err(&b, &a),
                    tol,
                ));
            }
        }
        let ids = [3u32, 0, 383, 3, 200];
        let mut want = Vec::new();
        let mut row = vec![0f32; cols];
        for &id in &ids {
            quant::dequantize(ty, ws[0].row(id as usize), &mut row).unwrap();
            want.extend_from_slice(&row);
        }
        let mut od = up(&gpu, &vec![f32::NAN; ids.len() * cols]);
        gpu.get_rows(&ws[0], &ids, &mut od);
        rows_out.push(Row(
            format!("get_rows {ty}"),
            rel_err(&down(&gpu, &od, ids.len() * cols), &want),
            1e-6,
        ));
    }
    report(&rows_out);
}

/// The dense kernel of several tokens (`mmvt_*`: each Q4_K or Q6_K weight row loaded once for up to 8 tokens)
/// gives every token the bits it gets alone, whatever the step's size (1 to 19 tokens, so one, two and three
/// blocks of tokens, full and partial; and 1,030, which takes two launches) and whether the rows come one matrix
/// or three to a launch, one row a warp (`mmvt1_*`) or four (`mmvt_*`, 8,508 rows whose matrices part inside a
/// warp); and it stays within 1e-5 of the CPU, which computes the same integer products of Q8_K activations (only
/// the f32 sums' order differs). Batch-invariant, so that every token count takes it; the kernel profile shows
/// that these kernels ran (the per-token ones would pass the rest too).
#[test]
#[ignore = "needs a CUDA GPU: run ci/device-test.sh on the device machine"]
fn several_tokens_per_loaded_row_give_each_token_its_bits_alone() {
    let (cpu, gpu) = (CpuBackend, gpu());
    gpu.set_batch_invariant(true);
    gpu.gpu().set_profiling(true);
    let mut rng = Rng(29);
    let mut rows_out = Vec::new();
    for ty in [GgmlType::Q4_K, GgmlType::Q6_K] {
        for (shapes, cols) in [
            (vec![333usize], 2048usize),
            (vec![520, 64, 72], 1024),
            (vec![96], 4096),
            (vec![5003, 2502, 1003], 2048),
        ] {
            let datas = quantized_all(ty, &shapes, cols, &mut rng);
            let ws = mats(ty, &datas, &shapes, cols);
            let n_max = 19;
            let x = rng.vec(n_max * cols, 1.0);
            // Each token alone.
            let alone: Vec<Vec<Vec<f32>>> = (0..n_max)
                .map(|t| {
                    let xd = up(&gpu, &x[t * cols..(t + 1) * cols]);
                    let mut outs: Vec<DevVec> = ws.iter().map(|w| up(&gpu, &vec![f32::NAN; w.rows])).collect();
                    let mut refs: Vec<&mut DevVec> = outs.iter_mut().collect();
                    gpu.matmul_many(&ws, &xd, 1, &mut refs);
                    ws.iter().zip(&outs).map(|(w, o)| down(&gpu, o, w.rows)).collect()
                })
                .collect();
            let mut differ = 0usize;
            for n in [2usize, 5, 8, 9, 16, 19, 1030] {
                // Token t is token t % 19 of x.
                let xs: Vec<f32> = (0..n)
                    .flat_map(|t| x[(t % n_max) * cols..(t % n_max + 1) * cols].iter().copied())
                    .collect();
                let xd = up(&gpu, &xs);
                let mut outs: Vec<DevVec> = ws.iter().map(|w| up(&gpu, &vec![f32::NAN; n * w.rows])).collect();
                let mut refs: Vec<&mut DevVec> = outs.iter_mut().collect();
                gpu.matmul_many(&ws, &xd, n, &mut refs);
                for (i, w) in ws.iter().enumerate() {
                    let got = down(&gpu, &outs[i], n * w.rows);
                    for t in 0..n {
                        let a = &alone[t % n_max][i];
                        let b = &got[t * w.rows..(t + 1) * w.rows];
                        differ += a.iter().zip(b).filter(|(p, q)| p.to_bits() != q.to_bits()).count();
                    }
                    if n == n_max {
                        let mut want = vec![0f32; n * w.rows];
                        cpu.matmul(w, &x[..n * cols], n, &mut want);
                        rows_out.push(Row(
                            format!(
                                "mmvt {ty} {}x{cols} matrix {i} of {}, {n} tokens against the CPU",
                                w.rows,
                                ws.len()
                            ),
                            rel_err(&got, &want),
                            1e-5,
                        ));
                    }
                }
            }
            rows_out.push(Row(
                format!("mmvt {ty} {shapes:?}x{cols}: values differing from each token alone (2-19 tokens)"),
                differ as f64,
                0.0,
            ));
        }
    }
    let ran: Vec<&str> = gpu.gpu().kernel_profile().iter().map(|(k, _, _)| *k).collect();
    for k in ["q8k_stage", "mmvt1_q4_k", "mmvt_q4_k", "mmvt1_q6_k", "mmvt_q6_k"] {
        assert!(ran.contains(&k), "{k} did not run: {ran:?}");
    }
    report(&rows_out);
}

/// The dense Q4_K and Q6_K products of several tokens on the integer tensor cores (`mmq_*`, `STRATA_MMQ`): within 1e-5
/// of the CPU (the same Q8_K integer products; only the f32 sums' order differs) and of `mmvt_*` (dp4a), on
/// matrices of 1 to 16 super-blocks a row (so 1 to 4 warps of a tile with work), one or three to a launch with
/// tiles of 16 rows (two a block) that part between matrices or pass the last row, and steps of 2 to 512 tokens
/// (one to 64 blocks of tokens, full and partial; a prompt step takes them up to `STRATA_MMV_DENSE_TOKENS`);
/// every token gets the bits it gets in a step of two (its columns never mix with another token's), and a token whose activations hold a NaN spreads it to its own outputs alone. The
/// kernel profile shows both `mmq_*` ran.
#[test]
#[ignore = "needs a CUDA GPU: run ci/device-test.sh on the device machine"]
fn tensor_core_q4_k_products_match_dp4a_and_the_cpu() {
    let (cpu, gpu) = (CpuBackend, gpu());
    gpu.set_mmv_dense_tokens(512);
    gpu.gpu().set_profiling(true);
    let mut rng = Rng(31);
    let mut rows_out = Vec::new();
    for (ty, shapes, cols) in [GgmlType::Q4_K, GgmlType::Q6_K].into_iter().flat_map(|ty| {
        [
            (vec![333usize], 2048usize),
            (vec![520, 64, 72], 1024),
            (vec![96, 7], 4096),
            (vec![37], 256),
            (vec![5003, 2502, 1003], 2048),
            (vec![130], 3840),
        ]
        .map(|(s, c)| (ty, s, c))
    }) {
        let datas = quantized_all(ty, &shapes, cols, &mut rng);
        let ws = mats(ty, &datas, &shapes, cols);
        let n_max = 512;
        let mut x = rng.vec(n_max * cols, 1.0);
        let run = |x: &[f32], n: usize| -> Vec<Vec<f32>> {
            let xd = up(&gpu, x);
            let mut outs: Vec<DevVec> = ws.iter().map(|w| up(&gpu, &vec![f32::NAN; n * w.rows])).collect();
            let mut refs: Vec<&mut DevVec> = outs.iter_mut().collect();
            gpu.matmul_many(&ws, &xd, n, &mut refs);
            ws.iter().zip(&outs).map(|(w, o)| down(&gpu, o, n * w.rows)).collect()
        };
        // Each token in a step of two: itself twice.
        gpu.set_mmq(true);
        let pairs: Vec<Vec<Vec<f32>>> = (0..n_max)
            .map(|t| {
                let row = &x[t * cols..(t + 1) * cols];
                let two: Vec<f32> = row.iter().chain(row).copied().collect();
                run(&two, 2)
                    .into_iter()
                    .zip(&ws)
                    .map(|(o, w)| o[..w.rows].to_vec())
                    .collect()
            })
            .collect();
        let mut differ = 0usize;
        for n in [2usize, 5, 8, 9, 16, 19, 64, 130, 512] {
            gpu.set_mmq(true);
            let got = run(&x[..n * cols], n);
            gpu.set_mmq(false);
            // dp4a and the CPU are compared at 19 and 64 tokens.
            let dp4a = match n <= 64 {
                true => run(&x[..n * cols], n),
                false => Vec::new(),
            };
            for (i, w) in ws.iter().enumerate() {
                for t in 0..n {
                    let a = &pairs[t][i];
                    let b = &got[i][t * w.rows..(t + 1) * w.rows];
                    differ += a.iter().zip(b).filter(|(p, q)| p.to_bits() != q.to_bits()).count();
                }
                if n == 19 || n == 64 {
                    let mut want = vec![0f32; n * w.rows];
                    cpu.matmul(w, &x[..n * cols], n, &mut want);
                    let what = format!("mmq {ty} {}x{cols} matrix {i} of {}, {n} tokens", w.rows, ws.len());
                    rows_out.push(Row(format!("{what} against the CPU"), rel_err(&got[i], &want), 1e-5));
                    rows_out.push(Row(format!("{what} against mmvt"), rel_err(&got[i], &dp4a[i]), 1e-5));
                }
            }
        }
        rows_out.push(Row(
            format!("mmq {ty} {shapes:?}x{cols}: values differing from each token in a step of two"),
            differ as f64,
            0.0,
        ));
        // A NaN in token 3's activations: its outputs are NaN, every other token's are its pair's bits.
        gpu.set_mmq(true);
        x[3 * cols + cols / 2] = f32::NAN;
        let got = run(&x[..9 * cols], 9);
        let mut wrong = 0usize;
        for (i, w) in ws.iter().enumerate() {
            for t in 0..9 {
                let b = &got[i][t * w.rows..(t + 1) * w.rows];
                wrong += match t {
                    3 => b.iter().filter(|v| !v.is_nan()).count(),
                    _ => pairs[t][i]
                        .iter()
                        .zip(b)
                        .filter(|(p, q)| p.to_bits() != q.to_bits())
                        .count(),
                };
            }
        }
        rows_out.push(Row(
            format!("mmq {ty} {shapes:?}x{cols}: a NaN in token 3, values not as expected"),
            wrong as f64,
            0.0,
        ));
    }
    gpu.set_mmq(true);
    let ran: Vec<&str> = gpu.gpu().kernel_profile().iter().map(|(k, _, _)| *k).collect();
    for k in ["mmq_q4_k", "mmq_q6_k", "mmvt_q4_k", "mmvt_q6_k"] {
        assert!(ran.contains(&k), "{k} did not run: {ran:?}");
    }
    report(&rows_out);
}

/// A short prompt's experts (steps of up to `STRATA_MMQ_PREFILL_TOKENS`, set to 256 here: about 8 tokens an expert
/// at 128 tokens under top-8 of 128) on the
/// integer tensor cores (`mmq_moe_*`, `STRATA_MMQ`) instead of the prefill GEMM: within 1e-3 of the CPU, which
/// computes the same integer products of Q8_K activations (the gated rows' quantization to Q8_K may round a code
/// apart where the two sums' orders differ: measured 1.1e-4 at 128 tokens of width 2,048, 2e-7 on the smaller
/// shapes), and within 2e-2 of the GEMM's f16 route (`STRATA_MMQ=0`); 1 to 32 tokens an
/// expert, and a router leaning to two experts, so an expert's rows span several tiles of 8. Each case's two routes
/// differ in some bits (so the mmq route ran), and the kernel profile shows both types' kernels ran.
#[test]
#[ignore = "needs a CUDA GPU: run ci/device-test.sh on the device machine"]
fn experts_with_few_tokens_on_the_tensor_cores_match_the_cpu() {
    let gpu = gpu();
    gpu.gpu().set_profiling(true);
    // Steps up to the most STRATA_MMQ_PREFILL_TOKENS allows take mmq_moe_*.
    gpu.set_mmq_prefill_tokens(256);
    let mut rng = Rng(37);
    let mut rows_out = Vec::new();
    // (type, tokens, experts, top-k, expert width, model width, skewed)
    for &(ty, n_tok, ne, k, f, e, skew) in &[
        (GgmlType::Q4_K, 16usize, 16usize, 4usize, 256usize, 512usize, false),
        (GgmlType::Q4_K, 40, 16, 4, 512, 256, false),
        (GgmlType::Q4_K, 128, 32, 8, 768, 2048, false),
        (GgmlType::Q4_K, 8, 64, 8, 256, 512, false),
        (GgmlType::Q4_K, 60, 16, 4, 256, 512, true),
        (GgmlType::Q6_K, 30, 8, 2, 256, 768, false),
        (GgmlType::Q6_K, 60, 16, 4, 512, 256, true),
        (GgmlType::Q4_K, 200, 32, 8, 768, 2048, false),
        (GgmlType::Q6_K, 256, 16, 4, 256, 512, true),
    ] {
        let data = expert_data(ty, ne, f, e, &mut rng);
        let ex = experts(ty, &data, ne, f, e);
        // Leaning to experts 0 and 1 (several tiles of 8 each), with weights that keep every expert's share
        // visible in the sum.
        let (x, logits) = moe_inputs(&mut rng, n_tok, ne, e, if skew { &[4.0, 3.0] } else { &[] });
        let want = moe_cpu(&ex, &logits, &x, n_tok, k);
        let mut got = Vec::new();
        for on in [true, false] {
            gpu.set_mmq(on);
            got.push(moe_gpu(&gpu, &ex, &logits, &x, n_tok, k));
        }
        let what = format!(
            "moe prefill {ty} n_tok={n_tok} {ne} experts top-{k} {e}x{f}{}",
            if skew { " skewed" } else { "" }
        );
        rows_out.push(Row(
            format!("{what}, mmq, against the CPU"),
            rel_err(&got[0], &want),
            1e-3,
        ));
        rows_out.push(Row(
            format!("{what}, mmq against the GEMM"),
            rel_err(&got[0], &got[1]),
            2e-2,
        ));
        let differ = got[0]
            .iter()
            .zip(&got[1])
            .filter(|(a, b)| a.to_bits() != b.to_bits())
            .count();
        assert!(differ > 0, "{what}: the mmq route gave the GEMM's bits (did it run?)");
    }
    gpu.set_mmq(true);
    gpu.set_mmq_prefill_tokens(strata_engine::memory::MMQ_MOE_TOKENS);
    let ran: Vec<&str> = gpu.gpu().kernel_profile().iter().map(|(k, _, _)| *k).collect();
    for k in ["mmq_moe_q4_k", "mmq_moe_q6_k", "gemm_q4_k", "gemm_q6_k"] {
        assert!(ran.contains(&k), "{k} did not run: {ran:?}");
    }
    report(&rows_out);
}

/// The prefill GEMM through our own kernel after an injected library failure: same results, one fallback.
#[test]
#[ignore = "needs a CUDA GPU: run ci/device-test.sh on the device machine"]
fn gemm_fallback_matches_cpu() {
    let (cpu, gpu) = (CpuBackend, gpu());
    assert!(gpu.set_fault_policy(FaultPlan::parse("prefill_gemm:m>64").unwrap(), true));
    // Every size on a GEMM: 32 tokens on cuBLAS, more on ours (not on mmq_*, which takes up to 64 by default).
    gpu.set_mmv_dense_tokens(16);
    let mut rng = Rng(11);
    let mut rows_out = Vec::new();
    for &n_tok in &[32usize, 72, 72, 200] {
        let (rows, cols) = (256, 512);
        let data = quantized(GgmlType::Q4_K, rows, cols, &mut rng).unwrap();
        let w = QMat::new(GgmlType::Q4_K, &data, rows, cols).unwrap();
        let x = rng.vec(n_tok * cols, 1.0);
        let mut a = vec![0f32; n_tok * rows];
        cpu.matmul(&w, &x, n_tok, &mut a);
        let mut bd = up(&gpu, &vec![f32::NAN; n_tok * rows]);
        Backend::matmul(&gpu, &w, &up(&gpu, &x), n_tok, &mut bd);
        let b = down(&gpu, &bd, n_tok * rows);
        rows_out.push(Row(
            format!("gemm after injected BLAS failure, n_tok={n_tok}"),
            rel_err(&b, &a),
            2e-2,
        ));
    }
    report(&rows_out);
}

/// Rows of values differing from `at[0]` (the GEMM with every tile 128 rows high) at the least heights 64 and 32
/// (`at[1]`, `at[2]`): each row's tolerance is 0.
fn same_bits_at_each_height(rows_out: &mut Vec<Row>, what: &str, at: &[Vec<f32>]) {
    for (i, height) in [64, 32].iter().enumerate() {
        let differ = at[0]
            .iter()
            .zip(&at[i + 1])
            .filter(|(p, q)| p.to_bits() != q.to_bits())
            .count();
        rows_out.push(Row(
            format!("{what}: values differing, tiles from {height} against 128"),
            differ as f64,
            0.0,
        ));
    }
}

/// The prefill GEMM's tile heights (a block of `gemm_T` computes 32, 64 or 128 rows) give the same bits: the MoE
/// prefill (each expert's tokens one tile: about 25, 50 and 100 rows, and a skewed router giving every height in
/// one launch) and a dense matrix through our GEMM (an injected BLAS failure), with every tile at 128 against the
/// least heights 64 and 32; outputs past the last whole block of 128 and K an odd multiple of 32 included, on six
/// weight types; and near the CPU. (That the small heights run shows as speed only: `STRATA_GEMM_MIN_TILE=128`
/// against the default in `strata bench`'s pp128, reports/2026-12-06-h100-gemm-tiles.md.)
#[test]
#[ignore = "needs a CUDA GPU: run ci/device-test.sh on the device machine"]
fn gemm_tile_heights_give_the_same_bits() {
    let (cpu, gpu) = (CpuBackend, gpu());
    // Prompts of up to 256 tokens would run their experts on mmq_moe_*, not the GEMM.
    gpu.set_mmq(false);
    assert!(gpu.set_fault_policy(FaultPlan::parse("prefill_gemm:m>16").unwrap(), true));
    gpu.gpu().set_profiling(true);
    let mut rng = Rng(31);
    let mut rows_out = Vec::new();
    // (type, tokens, experts, top-k, expert width, model width): about 25, 50 and 100 tokens an expert, and a
    // router skewed to a few experts (every height in one launch's tiles).
    for &(ty, n_tok, ne, k, f, e, skew) in &[
        (GgmlType::Q4_K, 100usize, 16usize, 4usize, 512usize, 256usize, false),
        (GgmlType::Q4_K, 200, 16, 4, 256, 512, false),
        (GgmlType::Q6_K, 100, 16, 4, 256, 256, false),
        (GgmlType::Q8_0, 90, 16, 4, 256, 256, false),
        (GgmlType::Q4_K, 150, 32, 4, 768, 2048, true),
        // Outputs past the last whole block of 128 (160, 288) and K an odd multiple of 32 (a zero-filled half
        // step), on more types' dequantizers.
        (GgmlType::Q4_0, 90, 16, 4, 160, 288, false),
        (GgmlType::Q8_0, 150, 8, 2, 224, 96, true),
        (GgmlType::F16, 60, 8, 4, 160, 288, false),
        (GgmlType::Q5_K, 100, 16, 4, 256, 512, false),
    ] {
        let data = expert_data(ty, ne, f, e, &mut rng);
        let ex = experts(ty, &data, ne, f, e);
        // Skewed: expert 0 for every token, 1 for most, 2 for some: tiles of 128, 64 and 32 rows beside small ones.
        let (x, logits) = moe_inputs(&mut rng, n_tok, ne, e, if skew { &[50.0, 40.0, 30.0] } else { &[] });
        let want = moe_cpu(&ex, &logits, &x, n_tok, k);
        let mut at = Vec::new();
        for height in [128, 64, 32] {
            gpu.set_gemm_min_tile(height);
            at.push(moe_gpu(&gpu, &ex, &logits, &x, n_tok, k));
        }
        let what = format!(
            "moe prefill {ty} n_tok={n_tok} {ne} experts top-{k} {e}x{f}{}",
            if skew { " skewed" } else { "" }
        );
        same_bits_at_each_height(&mut rows_out, &what, &at);
        rows_out.push(Row(format!("{what} against the CPU"), rel_err(&at[2], &want), 2e-2));
    }
    // A dense matrix through our GEMM (cuBLAS failed as injected past 16 tokens): tiles of 20, 50 and 128 + 72 rows,
    // and 200 outputs of 288 values.
    for (ty, n_tok, rows, cols) in [
        (GgmlType::Q4_K, 20usize, 384usize, 512usize),
        (GgmlType::Q4_K, 50, 384, 512),
        (GgmlType::Q4_K, 200, 384, 512),
        (GgmlType::Q8_0, 40, 200, 288),
    ] {
        let data = quantized(ty, rows, cols, &mut rng).unwrap();
        let w = QMat::new(ty, &data, rows, cols).unwrap();
        let x = rng.vec(n_tok * cols, 1.0);
        let mut at = Vec::new();
        for height in [128, 64, 32] {
            gpu.set_gemm_min_tile(height);
            let mut bd = up(&gpu, &vec![f32::NAN; n_tok * rows]);
            Backend::matmul(&gpu, &w, &up(&gpu, &x), n_tok, &mut bd);
            at.push(down(&gpu, &bd, n_tok * rows));
        }
        let what = format!("dense gemm {ty} {rows}x{cols} n_tok={n_tok}");
        same_bits_at_each_height(&mut rows_out, &what, &at);
        let mut want = vec![0f32; n_tok * rows];
        cpu.matmul(&w, &x, n_tok, &mut want);
        rows_out.push(Row(format!("{what} against the CPU"), rel_err(&at[2], &want), 2e-2));
    }
    let ran: Vec<&str> = gpu.gpu().kernel_profile().iter().map(|(k, _, _)| *k).collect();
    for k in [
        "gemm_q4_k",
        "gemm_q6_k",
        "gemm_q8_0",
        "gemm_q4_0",
        "gemm_f16",
        "gemm_q5_k",
    ] {
        assert!(ran.contains(&k), "{k} did not run: {ran:?}");
    }
    report(&rows_out);
}

#[test]
#[ignore = "needs a CUDA GPU: run ci/device-test.sh on the device machine"]
fn elementwise_ops_match_cpu() {
    let (cpu, gpu) = (CpuBackend, gpu());
    let mut rng = Rng(3);
    let mut rows = Vec::new();
    for &(n, w) in &[(1usize, 576usize), (17, 2048), (3, 64)] {
        let x = rng.vec(n * w, 3.0);
        let g = rng.vec(w, 1.0);
        let mut a = x.clone();
        cpu.rms_norm(&mut a, &g, 1e-6);
        let mut bd = up(&gpu, &x);
        gpu.rms_norm(&mut bd, n, &g, 1e-6);
        rows.push(Row(
            format!("rms_norm {n}x{w}"),
            rel_err(&down(&gpu, &bd, n * w), &a),
            1e-5,
        ));
        let mut od = up(&gpu, &vec![f32::NAN; n * w]);
        let xd = up(&gpu, &x);
        gpu.rms_norm_into(&xd, &mut od, n, &g, 1e-6);
        rows.push(Row(
            format!("rms_norm_into {n}x{w}"),
            rel_err(&down(&gpu, &od, n * w), &a),
            1e-5,
        ));
        rows.push(Row(
            format!("rms_norm_into {n}x{w} leaves x"),
            rel_err(&down(&gpu, &xd, n * w), &x),
            0.0,
        ));
    }
    for kind in [RopeKind::Normal, RopeKind::Neox] {
        let (nh, hd, n) = (8usize, 128usize, 9usize);
        let pos: Vec<u32> = (0..n as u32).map(|i| i * 311 + 5).collect();
        let p = RopeParams {
            kind,
            n_rot: hd,
            freq_base: 1e6,
            freq_scale: 1.0,
        };
        let x = rng.vec(n * nh * hd, 1.0);
        let mut a = x.clone();
        cpu.rope(&mut a, nh, hd, &pos, &p);
        let mut bd = up(&gpu, &x);
        Backend::rope(&gpu, &mut bd, nh, hd, &pos, &p);
        rows.push(Row(
            format!("rope {kind:?} {n}x{nh}x{hd}"),
            rel_err(&down(&gpu, &bd, x.len()), &a),
            1e-5,
        ));
    }
    for (act, tol) in [(GluKind::SwiGlu, 1e-6), (GluKind::GeGlu, 1e-3)] {
        let g0 = rng.vec(5000, 6.0);
        let u = rng.vec(5000, 1.0);
        let mut a = g0.clone();
        cpu.glu(&mut a, &u, act);
        let mut bd = up(&gpu, &g0);
        gpu.glu(&mut bd, &up(&gpu, &u), 5000, act);
        rows.push(Row(format!("glu {act:?}"), rel_err(&down(&gpu, &bd, 5000), &a), tol));
    }
    let x = rng.vec(3000, 1.0);
    let y = rng.vec(3000, 1.0);
    let mut a = x.clone();
    let mut bd = up(&gpu, &x);
    cpu.add(&mut a, &y);
    gpu.add(&mut bd, &up(&gpu, &y), 3000);
    rows.push(Row("add".into(), rel_err(&down(&gpu, &bd, 3000), &a), 1e-7));
    cpu.scale(&mut a, 0.37);
    gpu.scale(&mut bd, 3000, 0.37);
    rows.push(Row("scale".into(), rel_err(&down(&gpu, &bd, 3000), &a), 1e-7));
    // The fused residual add + norm, and per-head q/k-norm + RoPE, against the CPU's separate ops.
    for &(n, w) in &[(1usize, 2048usize), (33, 576)] {
        let (x, y, g) = (rng.vec(n * w, 2.0), rng.vec(n * w, 1.0), rng.vec(w, 1.0));
        let (mut xa, mut ha) = (x.clone(), vec![0f32; n * w]);
        Backend::add_rms_norm_into(&cpu, &mut xa, &y, &mut ha, n, &g, 1e-6);
        let (mut xd, mut hd) = (up(&gpu, &x), up(&gpu, &vec![f32::NAN; n * w]));
        gpu.add_rms_norm_into(&mut xd, &up(&gpu, &y), &mut hd, n, &g, 1e-6);
        rows.push(Row(
            format!("add_rms_norm_into {n}x{w}: sum"),
            rel_err(&down(&gpu, &xd, n * w), &xa),
            1e-7,
        ));
        rows.push(Row(
            format!("add_rms_norm_into {n}x{w}: norm"),
            rel_err(&down(&gpu, &hd, n * w), &ha),
            1e-5,
        ));
    }
    for (kind, norms) in [(RopeKind::Neox, true), (RopeKind::Normal, false)] {
        let (nh, nkv, hd, n) = (32usize, 4usize, 128usize, 5usize);
        let pos: Vec<u32> = (0..n as u32).map(|i| i * 97 + 3).collect();
        let p = RopeParams {
            kind,
            n_rot: hd,
            freq_base: 1e6,
            freq_scale: 1.0,
        };
        let (q, k, qn, kn) = (
            rng.vec(n * nh * hd, 2.0),
            rng.vec(n * nkv * hd, 2.0),
            rng.vec(hd, 1.0),
            rng.vec(hd, 1.0),
        );
        let nw = if norms {
            (Some(&qn[..]), Some(&kn[..]))
        } else {
            (None, None)
        };
        let (mut qa, mut ka) = (q.clone(), k.clone());
        Backend::qk_norm_rope(&cpu, &mut qa, &mut ka, nh, nkv, hd, nw, 1e-6, &pos, &p);
        let (mut qd, mut kd) = (up(&gpu, &q), up(&gpu, &k));
        gpu.qk_norm_rope(&mut qd, &mut kd, nh, nkv, hd, nw, 1e-6, &pos, &p);
        rows.push(Row(
            format!("qk_norm_rope {kind:?} norms={norms}: q"),
            rel_err(&down(&gpu, &qd, q.len()), &qa),
            1e-5,
        ));
        rows.push(Row(
            format!("qk_norm_rope {kind:?} norms={norms}: k"),
            rel_err(&down(&gpu, &kd, k.len()), &ka),
            1e-5,
        ));
        // The same with the keys and values stored in an f16 cache in the same launch (CPU: the two calls).
        let v = rng.vec(n * nkv * hd, 1.0);
        let hp = hp_for_attn(nh as u32, nkv as u32, hd as u32);
        let (mut kc, mut kg) = (
            KvCache::new(&hp.kv_shape(), 600, KvType::F16).unwrap(),
            KvCache::new(&hp.kv_shape(), 600, KvType::F16).unwrap(),
        );
        let (mut qa, mut ka) = (q.clone(), k.clone());
        cpu.qk_norm_rope_store(&mut qa, &mut ka, &v, &mut kc.layers[0], nh, hd, nw, 1e-6, &pos, &p);
        let (mut qd, mut kd) = (up(&gpu, &q), up(&gpu, &k));
        gpu.qk_norm_rope_store(
            &mut qd,
            &mut kd,
            &up(&gpu, &v),
            &mut kg.layers[0],
            nh,
            hd,
            nw,
            1e-6,
            &pos,
            &p,
        );
        rows.push(Row(
            format!("qk_norm_rope_store {kind:?} norms={norms}: q"),
            rel_err(&down(&gpu, &qd, q.len()), &qa),
            1e-5,
        ));
        for (name, rc, rg) in [
            ("k", &kc.layers[0].k, &kg.layers[0].k),
            ("v", &kc.layers[0].v, &kg.layers[0].v),
        ] {
            let cells: Vec<usize> = pos.iter().map(|&c| c as usize).collect();
            let (got, want) = cached_cells(&gpu, rc, rg, &cells, nkv, hd, GgmlType::F16);
            rows.push(Row(
                format!("qk_norm_rope_store {kind:?} norms={norms}: cached {name}"),
                rel_err(&got, &want),
                1e-3,
            ));
        }
    }
    let mut cd = up(&gpu, &vec![f32::NAN; 1000]);
    gpu.copy(&bd, 1500, &mut cd, 0, 1000);
    rows.push(Row("copy".into(), rel_err(&down(&gpu, &cd, 1000), &a[1500..2500]), 0.0));
    // Into an offset: values before it stay as they were.
    gpu.copy(&bd, 0, &mut cd, 600, 400);
    let mut want = a[1500..2100].to_vec();
    want.extend_from_slice(&a[..400]);
    rows.push(Row(
        "copy at an offset".into(),
        rel_err(&down(&gpu, &cd, 1000), &want),
        0.0,
    ));
    report(&rows);
}

/// The cache cells `cells` of every KV head as the GPU's pages of `rg` hold them (rows of `ty`) and as the CPU's
/// cache `rc` holds them, dequantized: `(got, want)`.
fn cached_cells(
    gpu: &CudaBackend,
    rc: &KvRows,
    rg: &KvRows,
    cells: &[usize],
    nkv: usize,
    hd: usize,
    ty: GgmlType,
) -> (Vec<f32>, Vec<f32>) {
    let hb = ty.row_bytes(hd as u64).unwrap() as usize;
    let dev = gpu.kv_device_bytes(rg).expect("pages after store");
    let (mut got, mut want, mut buf) = (Vec::new(), Vec::new(), vec![0f32; hd]);
    for &c in cells {
        for h in 0..nkv {
            rc.read(c, h, &mut buf);
            want.extend_from_slice(&buf);
            let at = (c * nkv + h) * hb;
            quant::dequantize(ty, &dev[at..at + hb], &mut buf).unwrap();
            got.extend_from_slice(&buf);
        }
    }
    (got, want)
}

fn hp_for_attn(nh: u32, nkv: u32, hd: u32) -> HParams {
    let mut spec = SynthSpec::tiny_qwen3moe();
    spec.n_layer = 1;
    spec.n_head = nh;
    spec.n_head_kv = nkv;
    spec.head_dim = hd;
    HParams::from_metadata(&spec.metadata()).unwrap()
}

/// The attention tests' shapes: query heads, KV heads, head width, cells, window.
const ATTN_SHAPES: [(u32, u32, u32, usize, Option<usize>); 5] = [
    (4, 2, 64, 600, None),
    (9, 3, 64, 300, Some(128)),
    (32, 4, 128, 1100, None),
    (8, 2, 128, 100, None),
    (4, 1, 288, 200, None),
];

/// A CPU and a GPU cache of one layer for a shape of [`ATTN_SHAPES`], with cells of `kv`, and its parameters.
fn attn_case(
    (nh, nkv, hd, ctx, window): (u32, u32, u32, usize, Option<usize>),
    kv: KvType,
) -> (KvCache, KvCache, AttnParams) {
    let hp = hp_for_attn(nh, nkv, hd);
    let p = AttnParams {
        n_head: nh as usize,
        n_head_kv: nkv as usize,
        head_dim: hd as usize,
        head_dim_v: hd as usize,
        scale: 1.0 / (hd as f32).sqrt(),
        window,
    };
    let cache = || KvCache::new(&hp.kv_shape(), ctx, kv).unwrap();
    (cache(), cache(), p)
}

/// Attention over f16 and int8 caches, prefill and decode, with and without a window. Both backends round the
/// same way (f16 queries and probabilities against an f16 cache); the rest is summation order: 1e-4.
#[test]
#[ignore = "needs a CUDA GPU: run ci/device-test.sh on the device machine"]
fn attention_matches_cpu() {
    let (cpu, gpu) = (CpuBackend, gpu());
    // The int8 cache's score-matrix path, which keeps the CPU's rounding (the tensor cores' has a test of its own).
    gpu.set_int8_flash(false);
    let mut rng = Rng(5);
    let mut rows = Vec::new();
    let mut dumped = false;
    for kv_ty in [KvType::F16, KvType::Int8] {
        for &shape in &ATTN_SHAPES {
            let (mut kc, mut kg, p) = attn_case(shape, kv_ty);
            let (nh, nkv, hd, ctx, window) = (p.n_head, p.n_head_kv, p.head_dim, shape.3, p.window);
            // Prefill ctx - 1 tokens in two chunks, then one decode step.
            let mut pos0 = 0;
            for n in [ctx / 2, ctx - 1 - ctx / 2, 1] {
                let pos: Vec<u32> = (pos0..pos0 + n).map(|p| p as u32).collect();
                let k = rng.vec(n * nkv * hd, 2.0);
                let v = rng.vec(n * nkv * hd, 1.0);
                let q = rng.vec(n * nh * hd, 2.0);
                cpu.store_kv(&mut kc.layers[0], &k, &v, &pos);
                gpu.store_kv(&mut kg.layers[0], &up(&gpu, &k), &up(&gpu, &v), &pos);
                // The stored cells themselves, dequantized: the GPU's pages against the CPU's cache.
                for (name, rc, rg) in [
                    ("k", &kc.layers[0].k, &kg.layers[0].k),
                    ("v", &kc.layers[0].v, &kg.layers[0].v),
                ] {
                    let ty = kv_ty.ggml();
                    let hb = ty.row_bytes(hd as u64).unwrap() as usize;
                    let dev = gpu.kv_device_bytes(rg).expect("pages after store");
                    let (mut want, mut got) = (Vec::new(), Vec::new());
                    let mut buf = vec![0f32; hd];
                    for &c in &pos {
                        for h in 0..nkv {
                            rc.read(c as usize, h, &mut buf);
                            want.extend_from_slice(&buf);
                            let at = (c as usize * nkv + h) * hb;
                            quant::dequantize(ty, &dev[at..at + hb], &mut buf).unwrap();
                            got.extend_from_slice(&buf);
                        }
                    }
                    let err = rel_err(&got, &want);
                    if err > 1e-6 && !dumped {
                        // The first differing block: source values, the CPU's bytes, the GPU's bytes.
                        dumped = true;
                        let src = if name == "k" { &k } else { &v };
                        let nbh = hd / 32;
                        if let Some(i) = (0..got.len()).find(|&i| got[i] != want[i]) {
                            let (t, blk) = (i / (nkv * hd), (i % (nkv * hd)) / 32);
                            let xs = &src[t * nkv * hd + blk * 32..][..32];
                            let mut cpu_b = vec![0u8; 34];
                            quant::quantize(ty, xs, &mut cpu_b).unwrap();
                            let at = (pos[t] as usize * nkv + blk / nbh) * hb + (blk % nbh) * 34;
                            println!(
                                "store_kv {name} first differing block: token {t} block {blk}\n  x   {xs:?}\n  cpu {cpu_b:02x?}\n  gpu {:02x?}",
                                &dev[at..at + 34]
                            );
                        }
                    }
                    rows.push(Row(
                        format!("store_kv {name} kv={kv_ty} h={nh}/{nkv} d={hd} n_tok={n} at {pos0}"),
                        err,
                        1e-6,
                    ));
                }
                let mut a = vec![0f32; n * nh * hd];
                cpu.attention(&q, &kc.layers[0], &pos, &p, &mut a);
                let mut bd = up(&gpu, &vec![f32::NAN; n * nh * hd]);
                Backend::attention(&gpu, &up(&gpu, &q), &kg.layers[0], &pos, &p, &mut bd);
                let b = down(&gpu, &bd, n * nh * hd);
                rows.push(Row(
                    format!("attention kv={kv_ty} h={nh}/{nkv} d={hd} n_tok={n} at {pos0} window={window:?}"),
                    rel_err(&b, &a),
                    1e-4,
                ));
                pos0 += n;
            }
        }
    }
    report(&rows);
}

/// `STRATA_INT8_FLASH`: prefill attention over an int8 cache on the tensor cores, its keys and values dequantized to
/// f16 tiles and its queries and probabilities rounded to f16 (the CPU keeps them in f32 against an int8 cache),
/// against the CPU: within 3e-3 relative error of the output (the score-matrix path: 1e-4), and not the bits of the
/// score-matrix path (so the tensor cores ran); end to end on the tiny MoE, mean KLD at most 0.002 as every CUDA
/// path.
#[test]
#[ignore = "needs a CUDA GPU: run ci/device-test.sh on the device machine"]
fn int8_flash_attention_stays_near_the_cpu() {
    let (cpu, gpu) = (CpuBackend, gpu());
    let mut rng = Rng(7);
    let mut rows = Vec::new();
    let mut differs = 0;
    // Every shape but the 288-wide heads, which the tensor cores do not take.
    for &shape in &ATTN_SHAPES[..4] {
        let (mut kc, mut kg, p) = attn_case(shape, KvType::Int8);
        let (nh, nkv, hd, ctx, window) = (p.n_head, p.n_head_kv, p.head_dim, shape.3, p.window);
        let mut pos0 = 0;
        for n in [ctx / 2, ctx - ctx / 2] {
            let pos: Vec<u32> = (pos0..pos0 + n).map(|p| p as u32).collect();
            let k = rng.vec(n * nkv * hd, 2.0);
            let v = rng.vec(n * nkv * hd, 1.0);
            let q = rng.vec(n * nh * hd, 2.0);
            cpu.store_kv(&mut kc.layers[0], &k, &v, &pos);
            gpu.store_kv(&mut kg.layers[0], &up(&gpu, &k), &up(&gpu, &v), &pos);
            let mut a = vec![0f32; n * nh * hd];
            cpu.attention(&q, &kc.layers[0], &pos, &p, &mut a);
            let mut outs = Vec::new();
            for flash in [false, true] {
                gpu.set_int8_flash(flash);
                let mut bd = up(&gpu, &vec![f32::NAN; n * nh * hd]);
                Backend::attention(&gpu, &up(&gpu, &q), &kg.layers[0], &pos, &p, &mut bd);
                outs.push(down(&gpu, &bd, n * nh * hd));
            }
            let what = format!("h={nh}/{nkv} d={hd} n_tok={n} at {pos0} window={window:?}");
            rows.push(Row(
                format!("int8 attention, score matrix, {what}"),
                rel_err(&outs[0], &a),
                1e-4,
            ));
            rows.push(Row(
                format!("int8 attention, tensor cores, {what}"),
                rel_err(&outs[1], &a),
                3e-3,
            ));
            differs += (outs[0] != outs[1]) as usize;
            pos0 += n;
        }
    }
    report(&rows);
    assert!(
        differs > 0,
        "the tensor-core path gave the score-matrix path's bits everywhere: it did not run"
    );
    end_to_end_with(
        "tiny-qwen3moe-int8flash",
        &SynthSpec::tiny_qwen3moe(),
        KvType::Int8,
        true,
    );
}

/// A decode step's attention from its raw projections (`Backend::rope_store_attention`: on the GPU one launch with
/// the q/k-norm, RoPE and K/V store for one token within the first 128 cells of an f16 cache, else the separate
/// steps) against the CPU's separate steps, after a prompt of `at` cached tokens: the output (1e-4, as attention)
/// and the cell the step stored (1e-3, as qk_norm_rope_store).
#[test]
#[ignore = "needs a CUDA GPU: run ci/device-test.sh on the device machine"]
fn rope_store_attention_matches_cpu() {
    let (cpu, gpu) = (CpuBackend, gpu());
    let mut rng = Rng(13);
    let mut rows = Vec::new();
    for &(nh, nkv, hd, kv_ty, window, norms, kind, at) in &[
        (32u32, 4u32, 128u32, KvType::F16, None, true, RopeKind::Neox, 0usize),
        (32, 4, 128, KvType::F16, None, true, RopeKind::Neox, 1),
        (32, 4, 128, KvType::F16, None, true, RopeKind::Neox, 127),
        (8, 2, 64, KvType::F16, Some(16usize), false, RopeKind::Normal, 40),
        (9, 3, 64, KvType::F16, None, true, RopeKind::Normal, 77),
        (32, 4, 128, KvType::F16, None, true, RopeKind::Neox, 128),
        (32, 4, 128, KvType::Int8, None, true, RopeKind::Neox, 50),
    ] {
        let hp = hp_for_attn(nh, nkv, hd);
        let (nh, nkv, hd) = (nh as usize, nkv as usize, hd as usize);
        let (mut kc, mut kg) = (
            KvCache::new(&hp.kv_shape(), 300, kv_ty).unwrap(),
            KvCache::new(&hp.kv_shape(), 300, kv_ty).unwrap(),
        );
        if at > 0 {
            let pos: Vec<u32> = (0..at as u32).collect();
            let (k, v) = (rng.vec(at * nkv * hd, 2.0), rng.vec(at * nkv * hd, 1.0));
            cpu.store_kv(&mut kc.layers[0], &k, &v, &pos);
            gpu.store_kv(&mut kg.layers[0], &up(&gpu, &k), &up(&gpu, &v), &pos);
        }
        let rope = RopeParams {
            kind,
            n_rot: hd,
            freq_base: 1e6,
            freq_scale: 1.0,
        };
        let p = AttnParams {
            n_head: nh,
            n_head_kv: nkv,
            head_dim: hd,
            head_dim_v: hd,
            scale: 1.0 / (hd as f32).sqrt(),
            window,
        };
        let (q, k, v) = (rng.vec(nh * hd, 2.0), rng.vec(nkv * hd, 2.0), rng.vec(nkv * hd, 1.0));
        let (qn, kn) = (rng.vec(hd, 1.0), rng.vec(hd, 1.0));
        let nw = if norms {
            (Some(&qn[..]), Some(&kn[..]))
        } else {
            (None, None)
        };
        let pos = [at as u32];
        let (mut qa, mut ka, mut a) = (q.clone(), k.clone(), vec![0f32; nh * hd]);
        cpu.rope_store_attention(
            &mut qa,
            &mut ka,
            &v,
            &mut kc.layers[0],
            nw,
            1e-6,
            &pos,
            &rope,
            &p,
            &mut a,
        );
        let (mut qd, mut kd, mut bd) = (up(&gpu, &q), up(&gpu, &k), up(&gpu, &vec![f32::NAN; nh * hd]));
        gpu.rope_store_attention(
            &mut qd,
            &mut kd,
            &up(&gpu, &v),
            &mut kg.layers[0],
            nw,
            1e-6,
            &pos,
            &rope,
            &p,
            &mut bd,
        );
        let what = format!(
            "rope_store_attention kv={kv_ty} h={nh}/{nkv} d={hd} {kind:?} norms={norms} window={window:?} at {at}"
        );
        rows.push(Row(
            format!("{what}: out"),
            rel_err(&down(&gpu, &bd, nh * hd), &a),
            1e-4,
        ));
        for (name, rc, rg) in [
            ("k", &kc.layers[0].k, &kg.layers[0].k),
            ("v", &kc.layers[0].v, &kg.layers[0].v),
        ] {
            let (got, want) = cached_cells(&gpu, rc, rg, &[at], nkv, hd, kv_ty.ggml());
            rows.push(Row(format!("{what}: cached {name}"), rel_err(&got, &want), 1e-3));
        }
    }
    report(&rows);
}

/// Router and expert dispatch (`Backend::moe`), decode (experts reached by id on the device) and prefill (tokens
/// grouped by expert), and at decode `Backend::moe_add_rms_norm` (the router routing in its own launch, the experts'
/// sum with the residual add and the next norm): the same experts are chosen (the logits are well separated, or tie
/// exactly and go to the lower id), both backends sum in f64; the matmuls differ as above: 2e-2.
#[test]
#[ignore = "needs a CUDA GPU: run ci/device-test.sh on the device machine"]
fn moe_ffn_matches_cpu() {
    let (cpu, gpu) = (CpuBackend, gpu());
    let mut rng = Rng(9);
    let mut rows = Vec::new();
    // (type, tokens, experts, top-k, expert width, model width): 160 experts give the router's lanes five experts
    // each; the decode kernels' row layouts: rows of at most four Q4_K/Q6_K super-blocks (two rows per group of
    // eight lanes: 256 to 1,024 values), of five to sixteen (one row per group: 1,280 and 2,048, the 30B-A3B shape)
    // and wider than the staging (4,608: f32 activations).
    for &(ty, n_tok, ne, k, f, e) in &[
        (GgmlType::Q4_K, 1usize, 16usize, 4usize, 512usize, 256usize),
        (GgmlType::Q8_0, 1, 16, 4, 512, 256),
        (GgmlType::Q4_K, 40, 16, 4, 512, 256),
        (GgmlType::Q6_K, 9, 16, 4, 512, 256),
        (GgmlType::Q4_K, 3, 160, 8, 256, 256),
        (GgmlType::Q6_K, 2, 32, 8, 256, 256),
        (GgmlType::Q4_K, 1, 8, 2, 768, 2048),
        (GgmlType::Q6_K, 2, 8, 4, 1024, 1280),
        (GgmlType::Q4_K, 1, 4, 2, 256, 4608),
    ] {
        let data = expert_data(ty, ne, f, e, &mut rng);
        let ex = experts(ty, &data, ne, f, e);
        let x = rng.vec(n_tok * e, 1.0);
        // 32 experts: whole-number logits, so many probabilities tie (the lower id wins on both backends).
        let mut logits = rng.vec(n_tok * ne, 3.0);
        if ne == 32 {
            logits.iter_mut().for_each(|l| *l = l.round());
        }
        for normalize in [true, false] {
            let mut a = vec![0f32; n_tok * e];
            let mut lc = logits.clone();
            Backend::moe(
                &cpu,
                &ex,
                &mut lc,
                &x,
                n_tok,
                k,
                normalize,
                &mut a,
                &mut MoeScratch::default(),
            );
            let mut bd = up(&gpu, &vec![f32::NAN; n_tok * e]);
            let mut lg = up(&gpu, &logits);
            gpu.moe(
                &ex,
                &mut lg,
                &up(&gpu, &x),
                n_tok,
                k,
                normalize,
                &mut bd,
                &mut MoeScratch::default(),
            );
            rows.push(Row(
                format!("moe {ty} n_tok={n_tok} {ne} experts top-{k} {e}x{f} normalize={normalize}"),
                rel_err(&down(&gpu, &bd, n_tok * e), &a),
                2e-2,
            ));
            // From the router (f32, as GGUFs store it: routed in its own launch on the device) to the experts'
            // sum added to a residual and the next norm (fused at decode on the device), against the CPU's separate
            // steps; without a norm (the last layer) the residual alone.
            let resid = rng.vec(n_tok * e, 1.0);
            let norm_w = rng.vec(e, 1.0);
            let router_w: Vec<u8> = rng.vec(ne * e, 0.5).iter().flat_map(|v| v.to_le_bytes()).collect();
            let router = QMat::new(GgmlType::F32, &router_w, ne, e).unwrap();
            for norm in [Some(&norm_w[..]), None] {
                let (mut hc, mut xc, mut tc) = (x.clone(), resid.clone(), vec![0f32; n_tok * e]);
                let mut lc = vec![0f32; n_tok * ne];
                cpu.moe_add_rms_norm(
                    &router,
                    &ex,
                    &mut lc,
                    &mut hc,
                    n_tok,
                    k,
                    normalize,
                    &mut tc,
                    &mut xc,
                    norm,
                    1e-6,
                    &mut MoeScratch::default(),
                );
                let (mut hg, mut xg, mut tg) = (up(&gpu, &x), up(&gpu, &resid), up(&gpu, &vec![0f32; n_tok * e]));
                let mut lg = up(&gpu, &vec![0f32; n_tok * ne]);
                gpu.moe_add_rms_norm(
                    &router,
                    &ex,
                    &mut lg,
                    &mut hg,
                    n_tok,
                    k,
                    normalize,
                    &mut tg,
                    &mut xg,
                    norm,
                    1e-6,
                    &mut MoeScratch::default(),
                );
                let what = format!(
                    "moe+add{} {ty} n_tok={n_tok} top-{k} normalize={normalize}",
                    if norm.is_some() { "+rms_norm" } else { "" }
                );
                rows.push(Row(
                    format!("{what}: residual"),
                    rel_err(&down(&gpu, &xg, n_tok * e), &xc),
                    2e-2,
                ));
                rows.push(Row(
                    format!("{what}: h"),
                    rel_err(&down(&gpu, &hg, n_tok * e), &hc),
                    2e-2,
                ));
            }
        }
    }
    report(&rows);
}

/// Mean KL divergence of `q` from `p` over rows of `vocab` logits (softmax in f64).
fn mean_kld(p: &[f32], q: &[f32], vocab: usize) -> f64 {
    let lsm = |r: &[f32]| {
        let m = r.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b)) as f64;
        let s: f64 = r.iter().map(|&x| (x as f64 - m).exp()).sum();
        r.iter().map(|&x| x as f64 - m - s.ln()).collect::<Vec<f64>>()
    };
    let n = p.len() / vocab;
    let mut tot = 0.0;
    for t in 0..n {
        let (lp, lq) = (lsm(&p[t * vocab..][..vocab]), lsm(&q[t * vocab..][..vocab]));
        tot += lp.iter().zip(&lq).map(|(a, b)| a.exp() * (a - b)).sum::<f64>();
    }
    tot / n as f64
}

/// SmolLM2-135M's shape (llama, 30 layers, 576 wide, 9/3 heads, Q4_1 with a Q8_0 embedding), generated: the real
/// file (94 MiB) does not travel to the GPU machine.
fn smollm2_shaped() -> SynthSpec {
    SynthSpec {
        arch: SynthArch::Llama,
        n_layer: 30,
        n_embd: 576,
        n_ff: 1536,
        n_head: 9,
        n_head_kv: 3,
        head_dim: 64,
        n_expert: 0,
        n_expert_used: 0,
        n_ff_exp: 0,
        vocab_size: 49152,
        n_ctx: 8192,
        rope_freq_base: 100_000.0,
        types: TensorTypes {
            embd: GgmlType::Q8_0,
            ..TensorTypes::uniform(GgmlType::Q4_1)
        },
        tied_output: true,
        zipf: 0.0,
        seed: 2,
        word_fillers: false,
    }
}

/// Teacher-forced logits (prefill path) and greedy decode logits (decode path), CUDA against CPU: mean KLD
/// ≤ 0.002 on each, for the given model.
fn end_to_end(name: &str, spec: &SynthSpec, kv: KvType) {
    end_to_end_with(name, spec, kv, false);
}

/// [`end_to_end`], with `STRATA_INT8_FLASH` set as `int8_flash` on the CUDA backends.
fn end_to_end_with(name: &str, spec: &SynthSpec, kv: KvType, int8_flash: bool) {
    let dir = std::env::temp_dir().join(format!("strata-cuda-parity-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(format!("{name}.gguf"));
    spec.write(&path).unwrap();
    let model = Model::load(&path).unwrap();
    let vocab = model.weights.output.rows;
    let cfg = SessionConfig {
        max_context: 1024,
        kv,
        prefill_chunk: Some(128),
    };
    let mut rng = Rng(13);
    let tokens: Vec<u32> = (0..300)
        .map(|_| ((rng.f() + 1.0) * 0.5 * (vocab - 1) as f32) as u32)
        .collect();
    let mut sc = Session::new(&model, &CpuBackend, cfg).unwrap();
    let (gpu_g, gpu_t) = (gpu(), gpu());
    gpu_g.set_int8_flash(int8_flash);
    gpu_t.set_int8_flash(int8_flash);
    let mut sg = Session::new(&model, &gpu_g, cfg).unwrap();
    // A third session decodes the same tokens with the candidates selected on the device (its cache filled the
    // same way as sg's, so its logits are sg's bit for bit).
    let mut st = Session::new(&model, &gpu_t, cfg).unwrap();
    st.logits_all(&tokens).unwrap();
    st.prefill(&tokens[..32]).unwrap();
    let a = sc.logits_all(&tokens).unwrap();
    let b = sg.logits_all(&tokens).unwrap();
    let kld_tf = mean_kld(&a, &b, vocab);
    // Decode: a 32-token prompt, then 24 steps fed the CPU's greedy choice (both see the same tokens).
    sc.prefill(&tokens[..32]).unwrap();
    sg.prefill(&tokens[..32]).unwrap();
    let (mut pa, mut pb) = (sc.logits().to_vec(), sg.logits().to_vec());
    let mut same_argmax = 0;
    for _ in 0..24 {
        let arg = |v: &[f32]| v.iter().enumerate().fold(0, |b, (i, &x)| if x > v[b] { i } else { b });
        let next = arg(&pa[pa.len() - vocab..]) as u32;
        same_argmax += (arg(&pb[pb.len() - vocab..]) as u32 == next) as usize;
        pa.extend_from_slice(sc.decode(next).unwrap());
        pb.extend_from_slice(sg.decode(next).unwrap());
        let want = TopLogits::from_logits(&pb[pb.len() - vocab..]);
        match st.decode_top(next).unwrap() {
            StepLogits::Top(t) => assert_eq!(t, &want, "{name}: device candidates differ from the logits' best"),
            StepLogits::Full(_) => panic!("{name}: the CUDA backend returned logits, not candidates"),
        }
    }
    let kld_dec = mean_kld(&pa, &pb, vocab);
    let (captures, replays) = sg.backend().gpu().graph_counts();
    println!(
        "{name} kv={kv}: teacher-forced mean KLD {kld_tf:.3e} over {} positions; decode mean KLD {kld_dec:.3e}, greedy argmax agrees {same_argmax}/24; decode CUDA graphs: {captures} captured, {replays} replays",
        tokens.len()
    );
    assert!(
        replays >= 20,
        "{name}: decode steps should replay their CUDA graph ({replays} replays)"
    );
    let _ = std::fs::remove_dir_all(&dir);
    assert!(kld_tf <= 0.002 && kld_dec <= 0.002, "{name}: KLD over 0.002");
}

/// The device's selection of the best 64 logits (kernels/sampling.cu) against the host's reference, exactly: sizes
/// around the block and candidate limits, ties, ±0, infinities and NaN; over 262,144 logits the backend declines.
#[test]
#[ignore = "needs a CUDA GPU: run ci/device-test.sh on the device machine"]
fn top_logits_match_the_host_selection() {
    let g = gpu();
    let mut rng = Rng(21);
    let mut cases = 0;
    for n in [1usize, 63, 64, 65, 4096, 4097, 49152, 151_936, 262_144] {
        for pattern in 0..6 {
            let mut x = rng.vec(n, 4.0);
            match pattern {
                1 => x.iter_mut().for_each(|v| *v = (*v * 2.0).round()),
                2 => {
                    (0..n).step_by(3).for_each(|i| x[i] = f32::NAN);
                    (1..n).step_by(11).for_each(|i| x[i] = f32::NEG_INFINITY);
                    x[n / 2] = -0.0;
                }
                3 => x[n - 1] = f32::INFINITY,
                4 => x.iter_mut().for_each(|v| *v = f32::NAN),
                5 => x.iter_mut().for_each(|v| *v = if *v > 0.0 { 0.0 } else { -0.0 }),
                _ => {}
            }
            let d = up(&g, &x);
            assert!(Backend::top_logits(&g, &d, n), "n={n}: the backend should select");
            let mut got = TopLogits::default();
            assert!(Backend::read_top_logits(&g, n, &mut got));
            assert_eq!(got, TopLogits::from_logits(&x), "n={n} pattern {pattern}");
            cases += 1;
        }
    }
    let big = up(&g, &vec![0.0; 262_145]);
    assert!(
        !Backend::top_logits(&g, &big, 262_145),
        "over 64 blocks of 4096: left to the host"
    );
    println!("top_logits: {cases} cases equal to the host's selection");
}

/// The selection for a step of several sequences (`top_logits_rows`): each row's candidates equal the host's
/// selection of that row, for one to 33 rows of a 151,936-token vocabulary and of 65 logits.
#[test]
#[ignore = "needs a CUDA GPU: run ci/device-test.sh on the device machine"]
fn top_logits_of_several_rows_match_the_host_selection() {
    let g = gpu();
    let mut rng = Rng(22);
    for n in [65usize, 151_936] {
        for rows in [1usize, 2, 7, 33] {
            let mut x = rng.vec(rows * n, 4.0);
            // Ties and a NaN in the second row.
            if rows > 1 {
                x[n..n + 40].iter_mut().for_each(|v| *v = 3.5);
                x[n + 41] = f32::NAN;
            }
            let d = up(&g, &x);
            assert!(Backend::top_logits_rows(&g, &d, rows, n), "n={n} rows={rows}");
            let mut got = vec![TopLogits::default(); rows];
            assert!(Backend::read_top_logits_rows(&g, n, &mut got));
            for (r, t) in got.iter().enumerate() {
                assert_eq!(
                    *t,
                    TopLogits::from_logits(&x[r * n..(r + 1) * n]),
                    "n={n} rows={rows} row {r}"
                );
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU: run ci/device-test.sh on the device machine"]
fn smollm2_shaped_kld_vs_cpu() {
    end_to_end("smollm2-shaped", &smollm2_shaped(), KvType::F16);
}

#[test]
#[ignore = "needs a CUDA GPU: run ci/device-test.sh on the device machine"]
fn tiny_qwen3moe_kld_vs_cpu() {
    end_to_end("tiny-qwen3moe", &SynthSpec::tiny_qwen3moe(), KvType::F16);
    end_to_end("tiny-qwen3moe-int8kv", &SynthSpec::tiny_qwen3moe(), KvType::Int8);
}

#[path = "common/interleave.rs"]
mod interleave;

#[path = "common/batched.rs"]
mod batched;

/// A device pool without a limit grows its arrays while four sequences take blocks, also inside a step that
/// carries all four (every run's cell is taken before the step reads the arrays' addresses), and each sequence
/// keeps the logits bits of its steps alone (batch-invariant kernels).
#[test]
#[ignore = "needs a CUDA GPU: run ci/device-test.sh on the device machine"]
fn a_device_pool_grows_inside_a_step_and_each_sequence_keeps_its_bits() {
    let (_dir, model) = tiny_moe();
    let g = gpu();
    g.set_batch_invariant(true);
    let pool = strata_engine::state::kv::KvPool::on_device(&model.hp.kv_shape(), None);
    interleave::assert_growing_pool_keeps_each_alone(&model, &g, &pool, 0.0);
    assert_eq!(pool.id_bound(), 8, "four sequences of two blocks each");
    println!("a device pool grown from 2 to 8 blocks: every step of four sequences as each alone, bit for bit");
    g.set_batch_invariant(false);
}

/// The KV cache paged on the device, through the continuous-batching scheduler with batch-invariant kernels (so a
/// sequence's bits do not depend on the company its steps keep): requests reusing another's 40-token prefix share
/// its blocks (and copy the partly filled one when they write it), and in a pool of 6 blocks (96 tokens) for 3
/// slots requests are preempted and computed again. Every request gives the tokens, logits bits, end and text it
/// gives alone through the scheduler (one slot, a pool of its own), and the pool's count of blocks matches the
/// caches' at every step (the helper checks it).
#[test]
#[ignore = "needs a CUDA GPU: run ci/device-test.sh on the device machine"]
fn paged_kv_on_the_device_shares_prefixes_and_preempts_as_alone() {
    let (_dir, model) = tiny_moe();
    let g = gpu();
    g.set_batch_invariant(true);
    let tok = strata_engine::tokenizer::Tokenizer::from_metadata(model.gguf.metadata()).unwrap();
    let prompts = batched::prompts(&tok);
    let ids = tok.encode(batched::TEXT, true, false).unwrap();
    let later = vec![[&ids[..40], &ids[50..55]].concat()];
    let want: Vec<_> = prompts
        .iter()
        .chain(&later)
        .map(|p| {
            let one = batched::batched(&model, &g, &tok, std::slice::from_ref(p), &[], 1, 24, None, None);
            one.done[0].clone().unwrap()
        })
        .collect();
    let ran = batched::batched(&model, &g, &tok, &prompts, &later, 3, 24, None, None);
    batched::assert_as_alone(&tok, &ran, &want);
    for i in [3, 4] {
        let p = &ran.done[i].as_ref().unwrap().prefill;
        assert_eq!(p.reused, 40, "request {i}: {p:?}");
    }
    let shared = ran.kv.iter().map(|k| k.blocks_shared).max().unwrap();
    assert!(shared >= 40 / KV_BLOCK_CELLS, "no block was shared: {:?}", ran.kv);
    let ran = batched::batched(&model, &g, &tok, &prompts, &[], 3, 24, None, Some(96));
    batched::assert_as_alone(&tok, &ran, &want[..4]);
    let preempted: u32 = ran.done.iter().map(|d| d.as_ref().unwrap().preempted).sum();
    assert!(preempted > 0, "nothing was preempted: {:?}", ran.kv);
    assert_eq!(ran.kv.last().unwrap().blocks_total, Some(6));
    println!(
        "paged KV on the device: 5 requests as alone with up to {shared} blocks shared; in 6 blocks, {preempted} preemptions and every request as alone"
    );
    g.set_batch_invariant(false);
}

/// The tiny qwen3moe, written to a temporary folder (removed with the returned guard) and loaded.
fn tiny_moe() -> (tempfile::TempDir, Model) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tiny-qwen3moe.gguf");
    SynthSpec::tiny_qwen3moe().write(&path).unwrap();
    let model = Model::load(&path).unwrap();
    (dir, model)
}

/// Two sequences through one CUDA backend, interleaved step by step (each records and replays its own decode
/// graphs), each get the greedy tokens they get alone, and the CPU's.
#[test]
#[ignore = "needs a CUDA GPU: run ci/device-test.sh on the device machine"]
fn two_sequences_interleaved_give_each_its_tokens_alone() {
    let (_dir, model) = tiny_moe();
    let cfg = SessionConfig {
        max_context: 512,
        kv: KvType::F16,
        prefill_chunk: Some(64),
    };
    let a: Vec<u32> = (0..7).map(|i| 300 + i * 37).collect();
    let b: Vec<u32> = (0..150).map(|i| 100 + i * 11 % 1900).collect();
    let g = gpu();
    interleave::assert_interleaved_equals_alone(&model, &g, cfg, &[&a, &b], 24);
    let (captured, replays) = g.gpu().graph_counts();
    assert!(replays > 0, "decode steps replayed no graph ({captured} captured)");
    let on_gpu = interleave::greedy_interleaved(&model, &g, cfg, &[&a, &b], 24);
    let on_cpu = interleave::greedy_interleaved(&model, &CpuBackend, cfg, &[&a, &b], 24);
    let same = on_gpu
        .iter()
        .flatten()
        .zip(on_cpu.iter().flatten())
        .filter(|(x, y)| x == y)
        .count();
    println!(
        "interleaved: {same} of 48 greedy tokens equal to the CPU's; {captured} graphs captured, {replays} replays"
    );
}

/// A prompt prefix taken from another sequence's device cache (its blocks shared, the partly filled one copied when
/// written) gives the logits bits of computing it, and leaves the other sequence as it was: the tiny qwen3moe, f16
/// and int8 caches.
#[test]
#[ignore = "needs a CUDA GPU: run ci/device-test.sh on the device machine"]
fn a_prefix_taken_from_another_sequence_gives_the_bits_of_computing_it() {
    let (_dir, model) = tiny_moe();
    interleave::assert_adopted_prefix_equals_computed(&model, &gpu());
}

/// One CUDA forward step carrying two sequences (two prompts; then one decode token of one and three new tokens
/// of the other) gives each the logits of the same steps alone, and the same greedy tokens: within 1e-4 of the
/// largest logit with the experts of such a step on the kernels a lone sequence's step takes
/// (`STRATA_MOE_DEVICE_TOKENS` 4; the batched matmul kernels may sum in another order than the one-token ones),
/// and within 1e-3 with the default 64, where the step's experts run on the decode kernels, token by token, and
/// the lone prompts' on the prefill kernels (as the batched decode attention is judged). Both with the dense
/// matmuls on the decode kernels up to 4 tokens (`STRATA_MMV_DENSE_TOKENS` 4), so the lone 7-token prompt and the
/// 57-token step both take the GEMM: at 8 (the default then; now 64, 16 with `mmq_*` off) the 7-token prompt took
/// the decode kernels, 3.1e-4 from the step's GEMM (H100, 2026-12-05, experts at 4), which the first arm's 1e-4 does not judge.
#[test]
#[ignore = "needs a CUDA GPU: run ci/device-test.sh on the device machine"]
fn one_step_carrying_two_sequences_gives_each_its_logits_alone() {
    let (_dir, model) = tiny_moe();
    let g = gpu();
    g.set_mmv_dense_tokens(4);
    for (tokens, tol) in [(4, 1e-4), (64, 1e-3)] {
        g.set_moe_device_tokens(tokens);
        for kv in [KvType::F16, KvType::Int8] {
            let d = interleave::assert_batched_steps_equal_alone(&model, &g, kv, tol);
            println!(
                "batched step, {kv} KV, experts of up to {tokens} tokens on the device's routing: largest difference from alone {d:e} of the largest logit"
            );
        }
    }
    // Batch-invariant kernels: the bits of each alone, with the experts in groups of 5 tokens and attention
    // launches of 3 tokens (so the 57-token step takes several of each, the last one short).
    g.set_batch_invariant(true);
    g.set_moe_device_tokens(5);
    g.set_batch_invariant_scores(3 * model.hp.n_head as usize * 128 * 4);
    for kv in [KvType::F16, KvType::Int8] {
        interleave::assert_batched_steps_equal_alone(&model, &g, kv, 0.0);
        println!("batched step, {kv} KV, batch-invariant: the bits of each sequence alone");
    }
    g.set_batch_invariant(false);
}

/// A tiny qwen3moe whose prefill steps stream more experts than the staging slots hold: 32 experts, top-2 (8
/// staging slots, so a 64-token chunk's experts go through them in several groups), Q4_K experts as the 30B
/// shape's (the decode kernels' fast path).
fn cache_test_spec() -> SynthSpec {
    SynthSpec {
        n_expert: 32,
        n_expert_used: 2,
        types: TensorTypes::uniform(GgmlType::Q4_K),
        ..SynthSpec::tiny_qwen3moe()
    }
}

/// Teacher-forced logits of 200 tokens (64-token prefill chunks), then 48 decode steps fed fixed tokens, and
/// 3-token steps (decode kernels, several tokens): every logit of the run.
fn cache_run(model: &Model, g: &CudaBackend, tokens: &[u32]) -> Vec<f32> {
    let cfg = SessionConfig {
        max_context: 512,
        kv: KvType::F16,
        prefill_chunk: Some(64),
    };
    let mut s = Session::new(model, g, cfg).unwrap();
    let mut all = s.logits_all(&tokens[..200]).unwrap();
    let mut s = Session::new(model, g, cfg).unwrap();
    s.prefill(&tokens[..32]).unwrap();
    for &t in &tokens[32..80] {
        all.extend_from_slice(s.decode(t).unwrap());
    }
    for w in tokens[80..92].chunks(3) {
        s.prefill(w).unwrap();
        all.extend_from_slice(s.logits());
    }
    all
}

/// The expert-cache tests' model (`cache_test_spec`, written to a temporary folder), its expert geometry, 200
/// token ids, and the all-resident run's logits ([`cache_run`]).
struct CacheFixture {
    dir: std::path::PathBuf,
    model: Model,
    geo: strata_engine::memory::ExpertGeometry,
    tokens: Vec<u32>,
    want: Vec<f32>,
    /// The staging slots [`CacheFixture::cached_gpu`] makes: one sequence's unless a test says otherwise.
    staging: usize,
}

impl CacheFixture {
    fn new(name: &str) -> CacheFixture {
        let dir = std::env::temp_dir().join(format!("strata-cuda-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("cache-moe.gguf");
        cache_test_spec().write(&path).unwrap();
        let model = Model::load(&path).unwrap();
        let geo = strata_engine::memory::ExpertGeometry::of(&model.gguf, &model.hp).unwrap();
        let vocab = model.weights.output.rows as u32;
        let tokens: Vec<u32> = (0..200u32).map(|i| (i * 977 + 13) % vocab).collect();
        let want = cache_run(&model, &gpu(), &tokens);
        assert!(want.iter().all(|v| v.is_finite()));
        CacheFixture {
            dir,
            model,
            staging: geo.staging(false, u64::MAX),
            geo,
            tokens,
            want,
        }
    }

    /// A fresh backend with an expert cache of `slots` slots, and the page lock of the arena when the model has
    /// one (drop it after the backend's last use). `device_table`: decode steps of one token keep the slot table
    /// on the device (when the arena is page-locked), else they decide on the host; `fetch_overlap`: there, in a
    /// step of one token, a layer's misses are fetched and computed on a second stream beside its hits.
    fn cached_gpu(
        &self,
        slots: usize,
        policy: strata_engine::experts::cache::Policy,
        device_table: bool,
        upload_cap: u32,
        fetch_overlap: bool,
        prefetch: bool,
    ) -> (CudaBackend, Option<strata_engine::backend::cuda::experts::HostPin>) {
        let g = gpu();
        let pin = self.model.experts.arena().map(|a| g.pin_host(a).unwrap());
        g.configure_expert_cache(strata_engine::backend::cuda::experts::ExpertCacheConfig {
            n_layer: self.model.hp.n_layer as usize,
            n_expert: self.geo.n_expert,
            slots,
            staging: self.staging,
            slot_bytes: self.geo.slot_bytes as usize,
            policy,
            k: self.model.hp.n_expert_used as usize,
            arena: pin.as_ref().and_then(|p| p.mapping()),
            device_table,
            upload_cap,
            fetch_overlap,
            cpu_join: true,
            n_embd: self.model.hp.n_embd as usize,
            prefetch,
        })
        .unwrap();
        (g, pin)
    }
}

impl Drop for CacheFixture {
    fn drop(&mut self) {
        self.model.experts.drop_arena();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Softmax of `l` in f64.
fn softmax64(l: &[f32]) -> Vec<f64> {
    let m = l.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b)) as f64;
    let e: Vec<f64> = l.iter().map(|&v| (v as f64 - m).exp()).collect();
    let z: f64 = e.iter().sum();
    e.into_iter().map(|v| v / z).collect()
}

/// When the CPU computes the misses (issue 16, point 6), the logits differ from the all-resident run only by the
/// two backends' rounding: with every decode miss on the CPU (0 and 4 slots) and with the cost model splitting
/// them (64 slots, equal link and CPU rates; and with `auto` choosing between that and the device's slot table by
/// measured step times), prefill is the resident run's bit for bit (it uploads), and every
/// decode position (one token, and 3-token steps) has a KLD against the resident distribution of at most 1e-4 on
/// average and 1e-3 at worst, with the same argmax unless the resident top two are within 1e-3 (a near-tie).
#[test]
#[ignore = "needs a CUDA GPU: run ci/device-test.sh on the device machine"]
fn cpu_computed_misses_stay_within_kld_of_the_resident_run() {
    use strata_engine::experts::cache::Policy;
    use strata_engine::experts::miss::{MissCost, MissPlan, MissPolicy};
    let mut f = CacheFixture::new("cpu-misses");
    f.model.use_arena(None, |_, _| {}).unwrap();
    let vocab = f.model.weights.output.rows as usize;
    let prefill = 200 * vocab;
    let even = MissCost {
        link_bytes_s: 1e9,
        cpu_bytes_s: 1e9,
        cpu_fixed_s: 0.0,
        copies_s: 0.0,
    };
    // With the device's slot table, the CPU joins it: `cpu` computes every miss inside the step's graph; `auto`
    // measures both paths (the device's, the link and the CPU splitting each layer's misses there, and the host's)
    // in its first 24 decode steps, then keeps one. Steps of several tokens decide on the host under `cpu`, and
    // on the device's table under `auto`, uploading every miss: with 64 slots, the single tokens' few misses
    // may all go over the link there, so the CPU's share is asserted with 4 slots.
    for (slots, policy, cost, device_table) in [
        (0, MissPolicy::Cpu, None, false),
        (4, MissPolicy::Cpu, None, false),
        (64, MissPolicy::Auto, Some(even), false),
        (0, MissPolicy::Cpu, None, true),
        (4, MissPolicy::Cpu, None, true),
        (64, MissPolicy::Auto, Some(even), true),
        (4, MissPolicy::Auto, Some(even), true),
    ] {
        let (g, pin) = f.cached_gpu(slots, Policy::Lru, device_table, u32::MAX, true, false);
        assert!(pin.is_some(), "the arena is page-locked");
        g.set_miss_plan(MissPlan { policy, cost }).unwrap();
        let got = cache_run(&f.model, &g, &f.tokens);
        let st = g.expert_cache_stats().unwrap();
        g.synchronize().unwrap();
        let (captured, replays) = g.gpu().graph_counts();
        drop(g);
        drop(pin);
        let want = &f.want[..];
        assert_eq!(got.len(), want.len());
        let same_prefill = got[..prefill]
            .iter()
            .zip(&want[..prefill])
            .all(|(a, b)| a.to_bits() == b.to_bits());
        let (mut sum, mut worst, mut rows, mut ties) = (0.0f64, 0.0f64, 0, 0);
        for (gr, wr) in got[prefill..].chunks(vocab).zip(want[prefill..].chunks(vocab)) {
            let (p, q) = (softmax64(wr), softmax64(gr));
            let kld: f64 = p
                .iter()
                .zip(&q)
                .filter(|(p, _)| **p > 0.0)
                .map(|(p, q)| p * (p / q.max(1e-300)).ln())
                .sum();
            sum += kld;
            worst = worst.max(kld);
            rows += 1;
            let top = |r: &[f32]| {
                (0..r.len())
                    .max_by(|&a, &b| r[a].total_cmp(&r[b]).then(b.cmp(&a)))
                    .unwrap()
            };
            if top(gr) != top(wr) {
                let mut sorted = wr.to_vec();
                sorted.sort_by(|a, b| b.total_cmp(a));
                assert!(
                    sorted[0] - sorted[1] < 1e-3,
                    "{slots} slots {policy}: argmax differs where the resident top two are {} apart",
                    sorted[0] - sorted[1]
                );
                ties += 1;
            }
        }
        let mean = sum / rows as f64;
        println!(
            "cpu misses, {slots} slots {policy}{}: decode {} lookups {} hits {} on the CPU ({} ms of CPU) {} MB up; {rows} decode positions: mean KLD {mean:.3e}, worst {worst:.3e}, argmax near-ties {ties}; prefill bit-identical {same_prefill}; {captured} graphs captured, {replays} replays",
            if device_table {
                " (device table, the CPU joining it)"
            } else {
                ""
            },
            st.decode.cache.lookups,
            st.decode.cache.hits,
            st.decode.cpu_computed,
            st.decode.cpu_us / 1000,
            st.decode.bytes_uploaded / 1_000_000,
        );
        if device_table && policy == MissPolicy::Cpu {
            // The CPU joined the device's table: its decode steps were graphs, the misses computed inside.
            assert!(
                replays > 0,
                "{slots} slots cpu on the device's table: no decode graph replayed"
            );
            assert_eq!(
                st.decode.bytes_uploaded, 0,
                "{slots} slots cpu: a decode miss was uploaded"
            );
        }
        assert!(
            same_prefill,
            "{slots} slots {policy}: prefill uploads, its logits must not change"
        );
        if !(device_table && policy == MissPolicy::Auto && slots == 64) {
            assert!(
                st.decode.cpu_computed > 0,
                "{slots} slots {policy}: the CPU computed nothing"
            );
        }
        if policy == MissPolicy::Auto {
            assert!(
                st.decode.bytes_uploaded > 0,
                "auto with equal rates uploads some misses"
            );
        }
        assert!(
            mean <= 1e-4 && worst <= 1e-3,
            "{slots} slots {policy}: KLD mean {mean:e}, worst {worst:e}"
        );
    }
}

/// The expert cache changes where experts come from, never the result (issue 16, point 6): with 0 slots, one per
/// layer, half and all but one, LRU and LFRU, from the mapped file and from a page-locked arena (with decode steps
/// deciding on the host, and on the device's slot table inside a CUDA graph, its misses fetched beside the hits'
/// compute on a second stream or before it), the logits of prefill chunks, decode
/// steps and 3-token steps are the all-resident run's bit for bit; and the cache's counts show what each size did
/// (no hit without slots, evictions when the slots are short).
#[test]
#[ignore = "needs a CUDA GPU: run ci/device-test.sh on the device machine"]
fn the_expert_cache_gives_the_resident_logits_bit_for_bit() {
    use strata_engine::experts::cache::Policy;
    let mut f = CacheFixture::new("cache");
    assert_eq!((f.geo.all(), f.staging), (128, 8));
    let mut cases = 0;
    // The last configuration prefetches each next layer's experts (`--expert-prefetch`; the others do not).
    for (arena, device_table, overlap, prefetch) in [
        (false, false, true, false),
        (true, false, true, false),
        (true, true, true, false),
        (true, true, false, false),
        (true, true, true, true),
    ] {
        if arena && f.model.experts.arena().is_none() {
            f.model.use_arena(None, |_, _| {}).unwrap();
        }
        // The profile the 64-slot LRU run learns pre-fills the last two configurations (`--expert-profile`).
        let mut learned: Option<strata_engine::experts::profile::ExpertProfile> = None;
        // The last configuration admits at most one miss per layer and decode step (`--upload-cap 1`).
        for (slots, policy, prefill, cap) in [
            (0, Policy::Lru, false, u32::MAX),
            (4, Policy::Lru, false, u32::MAX),
            (64, Policy::Lru, false, u32::MAX),
            (64, Policy::Lfru, false, u32::MAX),
            (127, Policy::Lru, false, u32::MAX),
            (64, Policy::Lru, true, u32::MAX),
            (64, Policy::Profile, true, u32::MAX),
            (4, Policy::Lru, false, 1),
        ] {
            let (g, pin) = f.cached_gpu(slots, policy, device_table, cap, overlap, prefetch);
            if prefill {
                let ranked = learned.as_ref().expect("learned by the 64-slot run").ranked();
                assert_eq!(
                    g.prefill_expert_cache(&f.model, &ranked).unwrap(),
                    slots.min(ranked.len())
                );
            }
            let got = cache_run(&f.model, &g, &f.tokens);
            let st = g.expert_cache_stats().unwrap();
            if (slots, policy, prefill, cap) == (64, Policy::Lru, false, u32::MAX) {
                let mut p =
                    strata_engine::experts::profile::ExpertProfile::new(f.model.hp.n_layer, f.model.hp.n_expert);
                p.add(&g.expert_lookups().unwrap());
                assert_eq!(p.total(), st.prefill.cache.lookups + st.decode.cache.lookups);
                learned = Some(p);
            }
            let (captured, replays) = g.gpu().graph_counts();
            g.synchronize().unwrap();
            drop(pin);
            let want = &f.want[..];
            let first_diff = got.iter().zip(want).position(|(a, b)| a.to_bits() != b.to_bits());
            let store = match (arena, device_table, overlap, prefetch) {
                (false, _, _, _) => "mmap",
                (true, false, _, _) => "arena, page-locked, table on the host",
                (true, true, true, false) => "arena, page-locked, table on the device, misses beside the hits",
                (true, true, true, true) => {
                    "arena, page-locked, table on the device, misses beside the hits, next layer prefetched"
                }
                (true, true, false, _) => "arena, page-locked, table on the device, misses before the hits",
            };
            let prefilled = match (prefill, cap) {
                (true, _) => ", pre-filled from the learned profile".to_string(),
                (_, u32::MAX) => String::new(),
                (_, c) => format!(", upload cap {c}"),
            };
            println!(
                "expert cache {slots} slots {policy}{prefilled} ({store}): prefill {} lookups {} hits {} MB up; decode {} lookups {} hits {} evictions {} MB up, {} prefetched {} used; {captured} graphs captured, {replays} replays; first differing logit {first_diff:?}",
                st.prefill.cache.lookups,
                st.prefill.cache.hits,
                st.prefill.bytes_uploaded / 1_000_000,
                st.decode.cache.lookups,
                st.decode.cache.hits,
                st.decode.cache.evictions,
                st.decode.bytes_uploaded / 1_000_000,
                st.decode.prefetched,
                st.decode.prefetch_used,
            );
            assert_eq!(got.len(), want.len());
            assert_eq!(
                first_diff, None,
                "{slots} slots {policy}: logits differ from the resident run"
            );
            assert!(
                st.prefill.cache.lookups > 0 && st.decode.cache.lookups > 0,
                "the cache was not used"
            );
            if slots == 0 {
                assert_eq!(st.prefill.cache.hits + st.decode.cache.hits, 0);
            }
            if slots == 4 {
                assert!(st.decode.cache.evictions > 0, "one slot per layer must evict");
            }
            if cap == 1 {
                // A decode layer-step looks up at least k experts and admits at most one (without the cap, 4 slots
                // evict on nearly every one: 445 evictions in 450 lookups).
                let k = f.model.hp.n_expert_used as u64;
                assert!(
                    st.decode.cache.admitted <= st.decode.cache.lookups / k,
                    "upload cap 1: {} admitted in {} lookups",
                    st.decode.cache.admitted,
                    st.decode.cache.lookups
                );
            }
            if policy == Policy::Profile {
                assert_eq!(
                    st.prefill.cache.evictions + st.decode.cache.evictions,
                    0,
                    "a profile cache evicted"
                );
                assert!(st.decode.cache.hits > 0, "the profile's experts were not used");
            }
            if !prefetch {
                assert_eq!(st.decode.prefetched, 0, "a prefetch without --expert-prefetch");
            } else if (slots, policy, prefill, cap) == (64, Policy::Lru, false, u32::MAX) {
                // Free slots are set aside each step: the router's guesses take some, and some are right.
                assert!(
                    st.decode.prefetched > 0 && st.decode.prefetch_used > 0,
                    "64 slots: {} prefetched, {} used",
                    st.decode.prefetched,
                    st.decode.prefetch_used
                );
            }
            assert!(st.decode.prefetch_used <= st.decode.prefetched);
            if slots == 127 {
                assert!(
                    st.decode.cache.hits > st.decode.cache.lookups / 2,
                    "127 of 128 slots mostly hit"
                );
            }
            // Decode steps through the device's table are graphs; deciding on the host, layer by layer, never.
            if device_table {
                assert!(replays > 0, "{slots} slots {policy}: no decode step replayed a graph");
            } else {
                assert_eq!(
                    captured, 0,
                    "{slots} slots {policy}: a step with host round trips was captured"
                );
            }
            cases += 1;
        }
    }
    println!("expert cache: {cases} configurations bit-identical to the resident run");
}

/// A sampler that takes the argmax and keeps every step's logits.
struct Recording(std::sync::Arc<std::sync::Mutex<Vec<Vec<f32>>>>);

impl strata_engine::runtime::generate::TokenSampler for Recording {
    fn next_token(&mut self, logits: StepLogits<'_>, _history: &[u32]) -> u32 {
        let StepLogits::Full(l) = logits else {
            panic!("a recording sampler gets whole logits")
        };
        self.0.lock().unwrap().push(l.to_vec());
        strata_engine::runtime::generate::argmax(l)
    }
}

/// `prompts` through the continuous-batching scheduler on `g` (one slot each, steps of at most 64 tokens, an f16
/// cache), `max_tokens` greedy tokens each: each sequence's tokens and the logits of every step it sampled from.
/// Panics unless some step carried at least four decode tokens.
fn batched_greedy(
    g: &CudaBackend,
    model: &Model,
    prompts: &[Vec<u32>],
    max_tokens: usize,
) -> (Vec<Vec<u32>>, Vec<Vec<Vec<f32>>>) {
    let (tokens, logits, most) = scheduled_greedy(g, model, prompts, max_tokens, KvType::F16);
    assert!(most >= 4, "the steps never carried four decode tokens");
    (tokens, logits)
}

/// Each sequence's logits of every step it sampled from.
type StepsLogits = Vec<Vec<Vec<f32>>>;

/// [`batched_greedy`] with a cache of type `kv`, and no check on the steps: also returns the most decode tokens a
/// step carried.
fn scheduled_greedy(
    g: &CudaBackend,
    model: &Model,
    prompts: &[Vec<u32>],
    max_tokens: usize,
    kv: KvType,
) -> (Vec<Vec<u32>>, StepsLogits, usize) {
    use strata_engine::runtime::batch::{BatchEvent, BatchJob, Batcher};
    use strata_engine::runtime::generate::GenerateOptions;
    use strata_engine::tokenizer::Tokenizer;
    let tok = Tokenizer::from_metadata(model.gguf.metadata()).unwrap();
    let cfg = SessionConfig {
        max_context: 512,
        kv,
        prefill_chunk: Some(64),
    };
    let sessions = (0..prompts.len())
        .map(|_| Session::new(model, g, cfg).unwrap())
        .collect();
    let mut b = Batcher::new(sessions, 64);
    let logs: Vec<_> = prompts
        .iter()
        .map(|_| std::sync::Arc::new(std::sync::Mutex::new(vec![])))
        .collect();
    for (i, p) in prompts.iter().enumerate() {
        b.submit(BatchJob {
            id: i as u64,
            prompt: p.clone(),
            opts: GenerateOptions {
                max_tokens,
                stop: vec![],
                logits_digest: false,
                logprobs: None,
            },
            sampler: Box::new(Recording(logs[i].clone())),
            cancel: Default::default(),
        });
    }
    let mut tokens = vec![vec![]; prompts.len()];
    let mut most = 0;
    while !b.is_idle() {
        let r = b.step(&tok, &mut |ev| {
            if let BatchEvent::Done { id, stats } = ev {
                tokens[id as usize] = stats.tokens;
            }
        });
        most = most.max(r.decoding);
    }
    let logits = logs.iter().map(|l| l.lock().unwrap().clone()).collect();
    (tokens, logits, most)
}

/// Of each sequence's steps in `got` and `want` ([`scheduled_greedy`]'s logits), how many differ in any bit.
fn steps_differing(got: &StepsLogits, want: &StepsLogits) -> usize {
    let bits = |a: &Vec<f32>, b: &Vec<f32>| a.iter().zip(b).any(|(p, q)| p.to_bits() != q.to_bits());
    got.iter()
        .zip(want)
        .map(|(a, b)| a.iter().zip(b).filter(|(x, y)| bits(x, y)).count())
        .sum()
}

/// Steps of several sequences decide their experts on the expert cache's device slot table, and give the
/// all-resident run's bits (issue 16, point 6; issue 20's batches): six sequences through the continuous-batching
/// scheduler (prompts of 3 to 300 tokens: 64-token chunks beside the others' decode tokens), Q4_K experts read by
/// the grouped decode kernels, with the staging the memory plan gives several sequences (a layer's every expert)
/// and caches of 0, 4, 64 and 127 slots, the misses of steps of one token fetched beside the hits or before them
/// (steps of several tokens fetch first either way; and 64 slots with the
/// next layer prefetched at steps of one token, 4 slots with `--upload-cap 1`), give every sequence the logits bits
/// and tokens of the same batch with every expert resident; and steps of several tokens ran on the table.
#[test]
#[ignore = "needs a CUDA GPU: run ci/device-test.sh on the device machine"]
fn batched_steps_on_the_device_slot_table_give_the_resident_bits() {
    use strata_engine::experts::cache::Policy;
    let mut f = CacheFixture::new("cache-batch");
    f.model.use_arena(None, |_, _| {}).unwrap();
    let prompts: Vec<Vec<u32>> = [7u32, 150, 300, 40, 3, 90]
        .iter()
        .map(|&n| (0..n).map(|i| 300 + (i * 37 + n) % 1500).collect())
        .collect();
    let (want_tokens, want, most) = scheduled_greedy(&gpu(), &f.model, &prompts, 24, KvType::F16);
    assert!(most >= 4, "the steps never carried four decode tokens");
    let mut cases = 0;
    f.staging = f.geo.staging(true, u64::MAX);
    assert_eq!(f.staging, f.geo.n_expert);
    let staging = f.staging;
    let mut configs: Vec<(usize, bool, bool, u32)> = [true, false]
        .iter()
        .flat_map(|&overlap| [0, 4, 64, 127].map(|slots| (slots, overlap, false, u32::MAX)))
        .collect();
    configs.extend([(64, true, true, u32::MAX), (4, true, false, 1)]);
    for (slots, overlap, prefetch, cap) in configs {
        let (g, pin) = f.cached_gpu(slots, Policy::Lru, true, cap, overlap, prefetch);
        let (tokens, got, _) = scheduled_greedy(&g, &f.model, &prompts, 24, KvType::F16);
        let st = g.expert_cache_stats().unwrap();
        let [one, many] = g.expert_table_steps().unwrap();
        g.synchronize().unwrap();
        drop(g);
        drop(pin);
        let differing = steps_differing(&got, &want);
        println!(
            "batched, {slots} slots, {staging} staging, fetch {}{}{}: table steps {one} of one token, {many} of several; decode {} lookups {} hits; {differing} steps' logits differ",
            // Steps of several tokens fetch first either way.
            if overlap {
                "beside the hits in one-token steps"
            } else {
                "first"
            },
            if prefetch { ", prefetch" } else { "" },
            if cap == 1 { ", upload cap 1" } else { "" },
            st.decode.cache.lookups,
            st.decode.cache.hits,
        );
        assert_eq!(tokens, want_tokens, "{slots} slots, {staging} staging: tokens");
        assert_eq!(
            differing, 0,
            "{slots} slots, {staging} staging: logits differ from the resident run"
        );
        assert!(
            many > 0,
            "{slots} slots, {staging} staging: no step of several tokens on the table"
        );
        assert!(st.decode.cache.lookups > 0, "the cache was not used");
        if slots == 0 {
            assert_eq!(st.decode.cache.hits, 0);
        }
        if slots == 127 {
            assert!(st.decode.cache.hits > 0, "127 of 128 slots never hit");
        }
        cases += 1;
    }
    println!("batched on the device's slot table: {cases} configurations bit-identical to the resident run");
    // Beside it, the same batch deciding on the host, layer by layer (no device table): steps of more than 4 tokens
    // take the prefill kernels there, not the resident run's decode kernels.
    let (g, pin) = f.cached_gpu(64, Policy::Lru, false, u32::MAX, true, false);
    let (_, got, _) = scheduled_greedy(&g, &f.model, &prompts, 24, KvType::F16);
    assert_eq!(g.expert_table_steps().unwrap(), [0, 0]);
    drop(g);
    drop(pin);
    let differing = steps_differing(&got, &want);
    println!("batched, 64 slots, host's table: {differing} steps' logits differ from the resident run");
}

/// With batch-invariant kernels (`--batch-invariant`), six sequences through the continuous-batching scheduler on
/// CUDA (prompts of 3 to 300 tokens: chunks of 64 mixed with the others' decode tokens, spans past two blocks of
/// 128 cells) give each the logits bits, hence the tokens, of the same sequence alone through the scheduler:
/// f16 and int8 caches, the tiny MoE at Q8_0 and with Q4_K experts (the 30B shape's decode kernels), the experts
/// in groups of 5 tokens and attention launches of 3 (so a step takes several of each). Prints how many of the
/// steps' logits differ without them.
#[test]
#[ignore = "needs a CUDA GPU: run ci/device-test.sh on the device machine"]
fn batch_invariant_kernels_give_each_sequence_its_bits_alone() {
    let prompts: Vec<Vec<u32>> = [7u32, 150, 300, 40, 3, 90]
        .iter()
        .map(|&n| (0..n).map(|i| 300 + (i * 37 + n) % 1500).collect())
        .collect();
    let g = gpu();
    for (name, spec) in [
        ("Q8_0", SynthSpec::tiny_qwen3moe()),
        ("Q4_K experts", cache_test_spec()),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("moe.gguf");
        spec.write(&path).unwrap();
        let model = Model::load(&path).unwrap();
        for kv in [KvType::F16, KvType::Int8] {
            let bits = |l: &[f32]| l.iter().map(|x| x.to_bits()).collect::<Vec<u32>>();
            // (steps compared, steps whose logits bits differ from alone)
            let compare = |invariant: bool| {
                g.set_batch_invariant(invariant);
                let (together, l_together, most) = scheduled_greedy(&g, &model, &prompts, 20, kv);
                assert!(most >= 4, "the steps never carried four decode tokens");
                let (mut steps, mut differ) = (0, 0);
                for (i, p) in prompts.iter().enumerate() {
                    let (alone, l_alone, _) = scheduled_greedy(&g, &model, std::slice::from_ref(p), 20, kv);
                    // (Without, a near tie may part the tokens, and one of the two may end sooner.)
                    for (a, b) in l_alone[0].iter().zip(&l_together[i]) {
                        steps += 1;
                        differ += usize::from(bits(a) != bits(b));
                    }
                    if invariant {
                        assert_eq!(together[i], alone[0], "{name}, {kv} KV, sequence {i}: tokens");
                        assert_eq!(l_alone[0].len(), l_together[i].len(), "sequence {i}: steps");
                    }
                }
                (steps, differ)
            };
            let without = compare(false);
            g.set_moe_device_tokens(5);
            g.set_batch_invariant_scores(3 * model.hp.n_head as usize * 512 * 4);
            let with = compare(true);
            g.set_batch_invariant(false);
            g.set_moe_device_tokens(64);
            g.set_batch_invariant_scores(256 << 20);
            println!(
                "{name}, {kv} KV: steps whose logits bits differ from alone: {} of {} batch-invariant, {} of {} without",
                with.1, with.0, without.1, without.0
            );
            assert!(with.0 > 0, "{with:?}");
            assert_eq!(with.1, 0, "{name}, {kv} KV: batch-invariant steps differ from alone");
        }
    }
}

/// Five sequences through the continuous-batching scheduler on CUDA, prompts of 3 to 150 tokens (past one span
/// block of 128 cells, where a lone decode step splits its keys), 20 greedy tokens each: the decode tokens of a
/// step in one attn_decode launch over their own caches, and split over the keys (`STRATA_BATCH_SPLIT_CELLS` 0),
/// give the logits of attending run by run (mean KLD at most 1e-6, every logit within 1e-3 of the largest), and
/// the same tokens.
#[test]
#[ignore = "needs a CUDA GPU: run ci/device-test.sh on the device machine"]
fn batched_decode_attention_equals_attending_run_by_run() {
    let (_dir, model) = tiny_moe();
    let prompts: Vec<Vec<u32>> = [7u32, 20, 150, 40, 3]
        .iter()
        .map(|&n| (0..n).map(|i| 300 + (i * 37 + n) % 1500).collect())
        .collect();
    let g = gpu();
    let run = |by_run: bool, split_cells: usize| {
        g.set_batch_attention(!by_run);
        g.set_batch_split_cells(split_cells);
        batched_greedy(&g, &model, &prompts, 20)
    };
    let (t_run, l_run) = run(true, usize::MAX);
    // The step's decode tokens in one attn_decode launch, then split over the keys (every span over 0 cells).
    for (how, split_cells) in [("in one launch", usize::MAX), ("split over the keys", 0)] {
        let (t_one, l_one) = run(false, split_cells);
        let (mut worst, mut kld, mut steps) = (0f64, 0f64, 0usize);
        for (i, (a, b)) in l_one.iter().zip(&l_run).enumerate() {
            assert_eq!(a.len(), b.len(), "{how}, sequence {i}: steps");
            for (x, y) in a.iter().zip(b) {
                worst = worst.max(rel_err(x, y));
                kld += mean_kld(y, x, y.len());
                steps += 1;
            }
        }
        let kld = kld / steps as f64;
        println!(
            "batched decode attention {how}: over {steps} steps, mean KLD from run by run {kld:e}, largest logit difference {worst:e} of the largest logit"
        );
        // The batched launches sum each token's keys in another order than a lone decode step (which splits past
        // 128 cells, by its own span), so the logits are close, not equal: far closer than this model's
        // CUDA-to-CPU KLD (about 2e-5).
        assert!(
            kld <= 1e-6 && worst <= 1e-3,
            "{how}: mean KLD {kld:e}, largest difference {worst:e}"
        );
        assert_eq!(t_one, t_run, "{how}");
    }
    g.set_batch_split_cells(strata_engine::backend::cuda::BATCH_SPLIT_CELLS);
}

/// Six prompts of 3 to 90 tokens for the grouped-experts tests.
fn grouped_prompts() -> Vec<Vec<u32>> {
    [5u32, 30, 90, 12, 3, 61]
        .iter()
        .map(|&n| (0..n).map(|i| 300 + (i * 41 + n) % 1500).collect())
        .collect()
}

/// The tiny Qwen3-MoE with experts of type `ty` and rows of 1,280 values (five super-blocks: the grouped kernels'
/// long-row path) into 256-value rows (the short-row path), with the down projections at `down` when given (Q4_K_M's
/// layout: Q4_K gate and up, Q6_K down), written into `dir`.
fn grouped_model(dir: &std::path::Path, ty: GgmlType, down: Option<GgmlType>) -> Model {
    let mut spec = SynthSpec::tiny_qwen3moe();
    spec.n_embd = 1280;
    spec.types.experts = ty;
    spec.types.experts_down = down;
    let path = dir.join(format!("tiny-qwen3moe-{ty:?}-{down:?}.gguf"));
    spec.write(&path).unwrap();
    Model::load(&path).unwrap()
}

/// Steps of several tokens group their routing slots by expert (`mmv_moe_group_*`, `STRATA_MOE_GROUPS`), steps of
/// up to 64 tokens on the device's routing (`STRATA_MOE_DEVICE_TOKENS` 64, so the prompt chunks in steps of several
/// sequences take the grouped kernels too): with Q4_K experts, Q6_K experts, and Q4_K gate and up over a Q6_K down
/// (Q4_K_M's layout, whose GLU runs apart), rows of 1,280 values (five super-blocks: the kernels' long-row path) into
/// 256-value rows (the short-row path), six sequences through the scheduler give bit for bit the logits of
/// computing each routing slot alone, and the same tokens.
#[test]
#[ignore = "needs a CUDA GPU: run ci/device-test.sh on the device machine"]
fn grouped_experts_give_the_bits_of_each_slot_alone() {
    let dir = std::env::temp_dir().join(format!("strata-cuda-groups-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let prompts = grouped_prompts();
    let g = gpu();
    g.set_moe_device_tokens(64);
    for (ty, down) in [
        (GgmlType::Q4_K, None),
        (GgmlType::Q6_K, None),
        (GgmlType::Q4_K, Some(GgmlType::Q6_K)),
    ] {
        let model = grouped_model(&dir, ty, down);
        g.set_moe_groups(false);
        let (t_slot, l_slot) = batched_greedy(&g, &model, &prompts, 16);
        g.set_moe_groups(true);
        let (t_group, l_group) = batched_greedy(&g, &model, &prompts, 16);
        for (i, (a, b)) in l_group.iter().zip(&l_slot).enumerate() {
            assert_eq!(a.len(), b.len(), "{ty:?} (down {down:?}) sequence {i}: steps");
            for (step, (x, y)) in a.iter().zip(b).enumerate() {
                let differ = x.iter().zip(y).filter(|(p, q)| p.to_bits() != q.to_bits()).count();
                assert_eq!(
                    differ, 0,
                    "{ty:?} (down {down:?}) sequence {i} step {step}: {differ} logits differ from slot by slot"
                );
            }
        }
        assert_eq!(t_group, t_slot, "{ty:?} (down {down:?})");
        println!(
            "grouped experts, {ty:?} (down {down:?}): {} steps bit for bit",
            l_group.iter().map(Vec::len).sum::<usize>()
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// A layer split over two stages on this one GPU (`--device cuda:0,cuda:0`: two backends, each with its own
/// stream, weights and KV arrays of its layers) gives each sequence the tokens and logits bits of one backend,
/// alone and batched with a shared prefix (the first stage takes the shared block and copies its layers' rows;
/// the second makes the same copy in its own arrays).
#[test]
#[ignore = "needs a CUDA GPU: run ci/device-test.sh on the device machine"]
fn a_layer_split_on_one_gpu_gives_the_bits_of_one_backend() {
    use strata_engine::backend::AnyBackend;
    use strata_engine::backend::split::Split;
    use strata_engine::device::Device;
    let (_dir, model) = tiny_moe();
    let tok = strata_engine::tokenizer::Tokenizer::from_metadata(model.gguf.metadata()).unwrap();
    let n = model.hp.n_layer as usize;
    let stage = || (Device::Cuda(0), AnyBackend::Cuda(Box::new(gpu())));
    let mut split = Split::new(vec![stage(), stage()]);
    split.place(&[0..n / 2, n / 2..n]);
    let sp = AnyBackend::Split(Box::new(split));
    let g = gpu();
    let prompts = batched::prompts(&tok);
    let ids = tok.encode(batched::TEXT, true, false).unwrap();
    let later = vec![[&ids[..40], &ids[50..55]].concat()];
    let all = [&prompts[..], &later[..]].concat();
    let one = batched::alone(&model, &g, &tok, &all, 24);
    let two = batched::alone(&model, &sp, &tok, &all, 24);
    for (i, (a, b)) in one.iter().zip(&two).enumerate() {
        assert_eq!(b.tokens, a.tokens, "request {i} alone: tokens");
        assert_eq!(b.logits_digests, a.logits_digests, "request {i} alone: logits bits");
    }
    let want = batched::batched(&model, &g, &tok, &prompts, &later, 3, 24, None, None);
    let got = batched::batched(&model, &sp, &tok, &prompts, &later, 3, 24, None, None);
    for i in 0..all.len() {
        let (a, b) = (want.done[i].as_ref().unwrap(), got.done[i].as_ref().unwrap());
        assert_eq!(b.tokens, a.tokens, "request {i} batched: tokens");
        assert_eq!(b.logits_digests, a.logits_digests, "request {i} batched: logits bits");
    }
    assert_eq!(got.done[3].as_ref().unwrap().prefill.reused, 40);
    let (carried, values) = sp.split().unwrap().carried();
    assert!(carried > 0, "nothing crossed the boundary");
    // Decode steps ran as each stage's CUDA graph, and whole (every stage's graph in turn).
    let replayed = sp.split().unwrap().replayed();
    assert!(replayed > 0, "no decode step of the split was replayed whole");
    for c in sp.cudas() {
        assert!(c.gpu().graph_counts().0 > 0, "a stage captured no decode graph");
    }
    println!(
        "layer split 0..{} | {}..{n} on cuda:0 twice: {} requests with the bits of one backend, alone and batched; {carried} buffers ({values} values) carried; {replayed} steps replayed whole",
        n / 2,
        n / 2,
        all.len()
    );
}
