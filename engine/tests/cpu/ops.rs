//! CPU backend ops against plain scalar references: matmul (decode and prefill tiling), RMSNorm, RoPE (normal
//! and neox), attention (naive softmax(QKᵀ)V with GQA, causal and sliding window), int8 vs f16 KV, router,
//! expert dispatch.

use half::f16;
use strata_engine::backend::cpu::spin::SpinPool;
use strata_engine::backend::cpu::{CpuBackend, ExpertRowsScratch, Workers, gelu_ggml, gelu_tanh, silu};
use strata_engine::backend::{AttnParams, Experts, GluKind, MoeScratch, QMat, RopeKind, RopeParams, Routing};
use strata_engine::model::{Arch, HParams};
use strata_engine::quant::{self, GgmlType};
use strata_engine::state::kv::{KvCache, KvType};

/// Deterministic pseudo-random values in [-1, 1).
fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

fn max_rel_err(got: &[f32], want: &[f32]) -> f32 {
    assert_eq!(got.len(), want.len());
    let scale = want.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-6);
    got.iter().zip(want).fold(0f32, |m, (a, b)| m.max((a - b).abs())) / scale
}

fn quantized(ty: GgmlType, rows: usize, cols: usize, seed: u64) -> (Vec<u8>, Vec<f32>) {
    let w = values(rows * cols, seed);
    let mut bytes = vec![0u8; ty.row_bytes(cols as u64).unwrap() as usize * rows];
    quant::quantize(ty, &w, &mut bytes).unwrap();
    let mut deq = vec![0f32; rows * cols];
    quant::dequantize(ty, &bytes, &mut deq).unwrap();
    (bytes, deq)
}

fn naive_matmul(w: &[f32], rows: usize, cols: usize, x: &[f32], n_tok: usize) -> Vec<f32> {
    let mut out = vec![0f32; n_tok * rows];
    for t in 0..n_tok {
        for r in 0..rows {
            out[t * rows + r] = (0..cols)
                .map(|c| w[r * cols + c] as f64 * x[t * cols + c] as f64)
                .sum::<f64>() as f32;
        }
    }
    out
}

#[test]
fn matmul_matches_dequantized_reference_for_decode_and_prefill_tiles() {
    let be = CpuBackend;
    for (ty, rows, cols) in [
        (GgmlType::Q4_1, 37, 64),
        (GgmlType::Q8_0, 70, 96),
        (GgmlType::Q4_K, 21, 256),
        (GgmlType::F16, 5, 40),
        (GgmlType::F32, 18, 13),
    ] {
        let (bytes, deq) = quantized(ty, rows, cols, 7);
        let w = QMat::new(ty, &bytes, rows, cols).unwrap();
        for n_tok in [1, 3, 65, 130] {
            let x = values(n_tok * cols, 11 + n_tok as u64);
            let mut out = vec![0f32; n_tok * rows];
            be.matmul(&w, &x, n_tok, &mut out);
            let want = naive_matmul(&deq, rows, cols, &x, n_tok);
            let err = max_rel_err(&out, &want);
            if quant::activation_format(ty).unwrap() == quant::ActivationFormat::F32 {
                assert!(err < 1e-5, "{ty} {rows}x{cols} n_tok={n_tok}: {err}");
            } else {
                // Int8 activations (ggml's vec_dot_type): within their rounding of the f32 result, and equal to
                // the quant module's int8 dot product of each (row, token).
                assert!(err < 2e-2, "{ty} {rows}x{cols} n_tok={n_tok}: {err}");
                for t in 0..n_tok {
                    let qa = quant::quantize_activations(ty, &x[t * cols..(t + 1) * cols]).unwrap();
                    for r in 0..rows {
                        let want = quant::vec_dot_q8(ty, w.row(r), &qa.vector(0)).unwrap();
                        assert_eq!(out[t * rows + r], want, "{ty} row {r} token {t}");
                    }
                }
            }
        }
    }
}

/// `matmul_many` of `ws` gives each matrix `matmul`'s results bit for bit.
fn assert_fused_equals_each(ws: &[QMat<'_>], x: &[f32], n_tok: usize, what: &str) {
    let be = CpuBackend;
    let mut got: Vec<Vec<f32>> = ws.iter().map(|w| vec![f32::NAN; n_tok * w.rows]).collect();
    let mut outs: Vec<&mut [f32]> = got.iter_mut().map(|o| o.as_mut_slice()).collect();
    be.matmul_many(ws, x, n_tok, &mut outs);
    for (i, w) in ws.iter().enumerate() {
        let mut want = vec![0f32; n_tok * w.rows];
        be.matmul(w, x, n_tok, &mut want);
        assert_eq!(got[i], want, "{what} matrix {i} ({}) n_tok={n_tok}", w.ty);
    }
}

#[test]
fn packed_matmul_gives_each_token_the_packed_kernels_bits_in_any_batch() {
    // STRATA_CPU_PACK: Q4_0, Q4_1 and Q8_0 rows packed eight at a time. Every (row, token) of a matmul is the
    // packed kernel's scalar reference bit for bit, whatever the batch and tiling, and within the int8 rounding of
    // the f32 product; matmul_many fuses packed matrices with the same bits.
    let be = CpuBackend;
    let cols = 96;
    let mats: Vec<(GgmlType, usize, Vec<u8>, Vec<f32>)> =
        [(GgmlType::Q4_0, 40), (GgmlType::Q4_1, 64), (GgmlType::Q8_0, 24)]
            .into_iter()
            .enumerate()
            .map(|(i, (ty, rows))| {
                let (bytes, deq) = quantized(ty, rows, cols, 90 + i as u64);
                (ty, rows, bytes, deq)
            })
            .collect();
    let packs: Vec<_> = mats
        .iter()
        .map(|(ty, rows, bytes, _)| quant::packed::pack(*ty, bytes, *rows, cols))
        .collect();
    if !quant::simd_available() {
        assert!(packs.iter().all(Option::is_none), "packed without the AVX2 kernels");
        return;
    }
    let ws: Vec<QMat<'_>> = mats
        .iter()
        .zip(&packs)
        .map(|((ty, rows, bytes, _), p)| {
            let mut w = QMat::new(*ty, bytes, *rows, cols).unwrap();
            w.packed = Some(p.as_ref().expect("packable"));
            w
        })
        .collect();
    for n_tok in [1, 2, 5, 65, 130] {
        let x = values(n_tok * cols, 200 + n_tok as u64);
        for (w, (ty, rows, _, deq)) in ws.iter().zip(&mats) {
            let mut out = vec![f32::NAN; n_tok * rows];
            be.matmul(w, &x, n_tok, &mut out);
            let err = max_rel_err(&out, &naive_matmul(deq, *rows, cols, &x, n_tok));
            assert!(err < 2e-2, "{ty} n_tok={n_tok}: {err}");
            let p = w.packed.unwrap();
            for t in 0..n_tok {
                let qa = quant::quantize_activations(*ty, &x[t * cols..(t + 1) * cols]).unwrap();
                for g in 0..rows / 8 {
                    let want = quant::packed::reference(*ty, p.group(g), &qa.vector(0));
                    for (i, want) in want.iter().enumerate() {
                        assert_eq!(
                            out[t * rows + 8 * g + i].to_bits(),
                            want.to_bits(),
                            "{ty} row {} token {t} of {n_tok}",
                            8 * g + i
                        );
                    }
                }
            }
        }
        assert_fused_equals_each(&ws, &x, n_tok, "packed");
    }
}

#[test]
fn matmul_many_equals_one_matmul_per_matrix() {
    // q/k/v-like (three types sharing Q8_1 activations: fused in decode), gate/up-like (Q4_K, Q8_K), and a mix of
    // activation formats (not fusable: the fallback). Every case must give matmul's results bit for bit.
    let cases: [&[(GgmlType, usize)]; 3] = [
        &[(GgmlType::Q4_1, 64), (GgmlType::Q8_0, 17), (GgmlType::Q5_0, 33)],
        &[(GgmlType::Q4_K, 40), (GgmlType::Q6_K, 40)],
        &[(GgmlType::Q4_0, 9), (GgmlType::Q4_K, 12), (GgmlType::F16, 5)],
    ];
    let cols = 256;
    for (ci, case) in cases.iter().enumerate() {
        let mats: Vec<(Vec<u8>, usize, GgmlType)> = case
            .iter()
            .enumerate()
            .map(|(i, &(ty, rows))| (quantized(ty, rows, cols, 50 + i as u64).0, rows, ty))
            .collect();
        let ws: Vec<QMat<'_>> = mats
            .iter()
            .map(|(b, rows, ty)| QMat::new(*ty, b, *rows, cols).unwrap())
            .collect();
        for n_tok in [1, 3] {
            let x = values(n_tok * cols, 60 + n_tok as u64);
            assert_fused_equals_each(&ws, &x, n_tok, &format!("case {ci}"));
        }
    }
}

#[test]
fn rms_norm_matches_reference() {
    let be = CpuBackend;
    let n = 48;
    let w = values(n, 3);
    for rows in [1, 70] {
        let x = values(rows * n, 4);
        let mut got = x.clone();
        be.rms_norm(&mut got, &w, 1e-5);
        for r in 0..rows {
            let row = &x[r * n..(r + 1) * n];
            let ms = row.iter().map(|v| v * v).sum::<f32>() / n as f32;
            let want: Vec<f32> = row.iter().zip(&w).map(|(v, g)| v / (ms + 1e-5).sqrt() * g).collect();
            assert!(max_rel_err(&got[r * n..(r + 1) * n], &want) < 1e-5);
        }
    }
}

fn naive_rope(x: &mut [f32], n_head: usize, d: usize, pos: u32, p: &RopeParams) {
    let half = p.n_rot / 2;
    for h in 0..n_head {
        let v = &mut x[h * d..(h + 1) * d];
        for i in 0..half {
            let theta = pos as f64 * p.freq_scale as f64 * (p.freq_base as f64).powf(-2.0 * i as f64 / p.n_rot as f64);
            let (a, b) = match p.kind {
                RopeKind::Normal => (2 * i, 2 * i + 1),
                RopeKind::Neox => (i, i + half),
            };
            let (x0, x1) = (v[a] as f64, v[b] as f64);
            v[a] = (x0 * theta.cos() - x1 * theta.sin()) as f32;
            v[b] = (x0 * theta.sin() + x1 * theta.cos()) as f32;
        }
    }
}

#[test]
fn rope_normal_and_neox_match_reference_and_leave_unrotated_dims() {
    let be = CpuBackend;
    let (n_head, d) = (3, 32);
    let positions = [0u32, 1, 7, 100, 1000];
    for kind in [RopeKind::Normal, RopeKind::Neox] {
        for (n_rot, base, scale) in [(32, 10_000.0, 1.0), (16, 1_000_000.0, 0.25)] {
            let p = RopeParams {
                kind,
                n_rot,
                freq_base: base,
                freq_scale: scale,
            };
            let x = values(positions.len() * n_head * d, 9);
            let mut got = x.clone();
            be.rope(&mut got, n_head, d, &positions, &p);
            let mut want = x.clone();
            for (t, &pos) in positions.iter().enumerate() {
                naive_rope(&mut want[t * n_head * d..(t + 1) * n_head * d], n_head, d, pos, &p);
            }
            // θ by repeated multiplication (as ggml) drifts from powf by a few f32 ulps times the position.
            let err = max_rel_err(&got, &want);
            assert!(err < 2e-4, "{kind:?} n_rot={n_rot}: {err}");
            if n_rot < d {
                for t in 0..positions.len() {
                    for h in 0..n_head {
                        let (a, b) = ((t * n_head + h) * d + n_rot, (t * n_head + h + 1) * d);
                        assert_eq!(got[a..b], x[a..b], "unrotated dims changed");
                    }
                }
            }
            // The two variants pair different dimensions, so they must differ.
            let other = RopeParams {
                kind: if kind == RopeKind::Normal {
                    RopeKind::Neox
                } else {
                    RopeKind::Normal
                },
                ..p
            };
            let mut o = x.clone();
            be.rope(&mut o, n_head, d, &positions, &other);
            assert!(max_rel_err(&o, &got) > 1e-2);
        }
    }
}

fn hp(n_head: u32, n_head_kv: u32, head_dim: u32) -> HParams {
    HParams {
        arch: Arch::Llama,
        n_layer: 1,
        n_ctx_train: 0,
        n_embd: n_head * head_dim,
        n_ff: 0,
        n_head,
        n_head_kv,
        head_dim,
        head_dim_v: head_dim,
        rms_eps: 1e-5,
        rope_freq_base: 10_000.0,
        rope_scale: 1.0,
        rope_dim: head_dim,
        n_expert: 0,
        n_expert_used: 0,
        n_ff_exp: 0,
        sliding_window: None,
        vocab_size: 300,
    }
}

/// softmax(q·kᵀ·scale)·v per head over the visible positions, in f64, with K and V rounded to f16 as the cache
/// stores them.
fn naive_attention(q: &[f32], k: &[f32], v: &[f32], n_tok: usize, p: &AttnParams) -> Vec<f32> {
    let (d, nh, nkv) = (p.head_dim, p.n_head, p.n_head_kv);
    let r = |x: f32| f16::from_f32(x).to_f32() as f64;
    let mut out = vec![0f32; n_tok * nh * d];
    for t in 0..n_tok {
        for h in 0..nh {
            let g = h / (nh / nkv);
            let first = p.window.map_or(0, |w| (t + 1).saturating_sub(w));
            let qv = &q[(t * nh + h) * d..][..d];
            let scores: Vec<f64> = (first..=t)
                .map(|j| {
                    let kv = &k[(j * nkv + g) * d..][..d];
                    // An f16 cache meets an f16 query (ggml's f16 matmul converts its other operand).
                    qv.iter().zip(kv).map(|(a, b)| r(*a) * r(*b)).sum::<f64>() * p.scale as f64
                })
                .collect();
            let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let e: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
            let sum: f64 = e.iter().sum();
            for i in 0..d {
                // ... and f16 probabilities.
                let acc: f64 = (first..=t)
                    .zip(&e)
                    .map(|(j, w)| r((w / sum) as f32) * r(v[(j * nkv + g) * d + i]))
                    .sum();
                out[(t * nh + h) * d + i] = acc as f32;
            }
        }
    }
    out
}

fn run_attention(
    kv_ty: KvType,
    n_tok: usize,
    p: &AttnParams,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    split: usize,
) -> Vec<f32> {
    let be = CpuBackend;
    let mut cache = KvCache::new(
        &hp(p.n_head as u32, p.n_head_kv as u32, p.head_dim as u32).kv_shape(),
        n_tok,
        kv_ty,
    )
    .unwrap();
    let (wq, wk) = (p.n_head * p.head_dim, p.n_head_kv * p.head_dim);
    let mut out = vec![0f32; n_tok * wq];
    // Two batches (prefill chunks): the second attends to cells the first wrote.
    for (t0, t1) in [(0, split), (split, n_tok)] {
        let pos: Vec<u32> = (t0 as u32..t1 as u32).collect();
        be.store_kv(&mut cache.layers[0], &k[t0 * wk..t1 * wk], &v[t0 * wk..t1 * wk], &pos);
        be.attention(
            &q[t0 * wq..t1 * wq],
            &cache.layers[0],
            &pos,
            p,
            &mut out[t0 * wq..t1 * wq],
        );
    }
    out
}

#[test]
fn attention_matches_naive_softmax_qk_v_with_gqa_and_window() {
    let n_tok = 40;
    for (n_head, n_head_kv, window) in [(4, 4, None), (6, 2, None), (4, 1, Some(5))] {
        let d = 32;
        let p = AttnParams {
            n_head,
            n_head_kv,
            head_dim: d,
            head_dim_v: d,
            scale: 1.0 / (d as f32).sqrt(),
            window,
        };
        let q = values(n_tok * n_head * d, 21);
        let k = values(n_tok * n_head_kv * d, 22);
        let v = values(n_tok * n_head_kv * d, 23);
        let want = naive_attention(&q, &k, &v, n_tok, &p);
        for split in [1, 17] {
            let got = run_attention(KvType::F16, n_tok, &p, &q, &k, &v, split);
            let err = max_rel_err(&got, &want);
            assert!(
                err < 1e-4,
                "heads {n_head}/{n_head_kv} window {window:?} split {split}: {err}"
            );
        }
        // GQA mapping: a wrong group assignment (each query head on KV head 0) must be detected.
        if n_head_kv > 1 {
            let mut k0 = k.clone();
            let mut v0 = v.clone();
            for t in 0..n_tok {
                for g in 1..n_head_kv {
                    let (a, b) = ((t * n_head_kv) * d, (t * n_head_kv + g) * d);
                    k0.copy_within(a..a + d, b);
                    v0.copy_within(a..a + d, b);
                }
            }
            assert!(max_rel_err(&naive_attention(&q, &k0, &v0, n_tok, &p), &want) > 1e-2);
        }
    }
}

#[test]
fn int8_kv_attention_stays_close_to_f16() {
    let (n_tok, n_head, n_head_kv, d) = (64, 8, 2, 64);
    let p = AttnParams {
        n_head,
        n_head_kv,
        head_dim: d,
        head_dim_v: d,
        scale: 1.0 / (d as f32).sqrt(),
        window: None,
    };
    let q = values(n_tok * n_head * d, 31)
        .iter()
        .map(|x| x * 4.0)
        .collect::<Vec<_>>();
    let k = values(n_tok * n_head_kv * d, 32);
    let v = values(n_tok * n_head_kv * d, 33);
    let f = run_attention(KvType::F16, n_tok, &p, &q, &k, &v, 10);
    let i = run_attention(KvType::Int8, n_tok, &p, &q, &k, &v, 10);
    let err = max_rel_err(&i, &f);
    // Q8_0 keeps about 2.5 significant digits: small but nonzero error.
    assert!(err > 0.0 && err < 2e-2, "int8 vs f16: {err}");
    let int8 = KvCache::new(&hp(8, 2, 64).kv_shape(), 100, KvType::Int8).unwrap();
    let f16c = KvCache::new(&hp(8, 2, 64).kv_shape(), 100, KvType::F16).unwrap();
    assert_eq!(
        int8.bytes() * 64,
        f16c.bytes() * 34,
        "int8 cache is 34 bytes per 32 values"
    );
    assert!(
        KvCache::new(&hp(2, 1, 48).kv_shape(), 10, KvType::Int8).is_err(),
        "head width 48 is not whole blocks"
    );
}

#[test]
fn router_softmax_top_k_renormalised() {
    let be = CpuBackend;
    let logits = vec![0.5f32, 2.0, -1.0, 2.0, 1.0, 0.0, 3.0, -2.0];
    let mut l = logits.clone();
    let mut r = Routing::default();
    be.route(&mut l, 4, 2, true, &mut r);
    // Token 0: experts 1 and 3 tie; both are picked, equal weights.
    assert_eq!(r.ids, vec![1, 3, 2, 0]);
    assert!((r.weights[0] - 0.5).abs() < 1e-6 && (r.weights[1] - 0.5).abs() < 1e-6);
    let e: Vec<f32> = logits[4..].iter().map(|x| x.exp()).collect();
    let want = e[2] / (e[2] + e[0]);
    assert!((r.weights[2] - want).abs() < 1e-6);
    // Without renormalisation the weights are the softmax probabilities over all experts.
    let mut l = logits.clone();
    be.route(&mut l, 4, 2, false, &mut r);
    let sum: f32 = e.iter().sum();
    assert!((r.weights[2] - e[2] / sum).abs() < 1e-6);
}

#[test]
fn moe_dispatch_matches_per_token_expert_loop() {
    let be = CpuBackend;
    // F16 experts: f32 activations, so the reference loop below is exact up to summation order.
    let (n_expert, nff, e, n_tok, k) = (4, 64, 32, 9, 2);
    let (gb, gd) = quantized(GgmlType::F16, n_expert * nff, e, 41);
    let (ub, ud) = quantized(GgmlType::F16, n_expert * nff, e, 42);
    let (db, dd) = quantized(GgmlType::F16, n_expert * e, nff, 43);
    for act in [GluKind::SwiGlu, GluKind::GeGlu] {
        let ex = Experts {
            gate: QMat::new(GgmlType::F16, &gb, n_expert * nff, e).unwrap(),
            up: QMat::new(GgmlType::F16, &ub, n_expert * nff, e).unwrap(),
            down: QMat::new(GgmlType::F16, &db, n_expert * e, nff).unwrap(),
            n_expert,
            n_ff_exp: nff,
            act,
            layer: 0,
        };
        let x = values(n_tok * e, 44);
        let mut logits = values(n_tok * n_expert, 45);
        let mut routing = Routing::default();
        be.route(&mut logits, n_expert, k, true, &mut routing);
        let mut out = vec![0f32; n_tok * e];
        be.moe_ffn(&ex, &x, &routing, &mut out, &mut MoeScratch::default());
        let f = match act {
            GluKind::SwiGlu => silu,
            GluKind::GeGlu => gelu_ggml,
        };
        let mut want = vec![0f32; n_tok * e];
        for t in 0..n_tok {
            let xt = &x[t * e..(t + 1) * e];
            for i in 0..k {
                let ex_id = routing.ids[t * k + i] as usize;
                let g = naive_matmul(&gd[ex_id * nff * e..(ex_id + 1) * nff * e], nff, e, xt, 1);
                let u = naive_matmul(&ud[ex_id * nff * e..(ex_id + 1) * nff * e], nff, e, xt, 1);
                let a: Vec<f32> = g.iter().zip(&u).map(|(g, u)| f(*g) * u).collect();
                let d = naive_matmul(&dd[ex_id * e * nff..(ex_id + 1) * e * nff], e, nff, &a, 1);
                for c in 0..e {
                    want[t * e + c] += routing.weights[t * k + i] * d[c];
                }
            }
        }
        assert!(max_rel_err(&out, &want) < 1e-5, "{act:?}");
    }
}

/// The CPU's computation of the experts a GPU cache misses (`expert_rows`, several experts and tokens at once)
/// gives each (expert, token) exactly what a one-token MoE step through that expert alone gives, bit for bit: for
/// int8-activation types (Q4_K with Q8_K activations, Q8_0) and a float type (F16, f32 activations, also at widths
/// that end in a short task), with jobs that repeat an expert and a token, on rayon's pool and on spinning workers.
#[test]
fn expert_rows_equal_one_token_steps_bit_for_bit() {
    let be = CpuBackend;
    let (n_expert, n_tok) = (5, 3);
    let pool = SpinPool::new(2).unwrap();
    // (type, n_ff_exp, n_embd): the F16 shape is not whole 32-row tasks (the last task of each pass is short).
    for (ty, nff, e) in [
        (GgmlType::Q4_K, 256, 256),
        (GgmlType::Q8_0, 256, 256),
        (GgmlType::F16, 256, 256),
        (GgmlType::F16, 40, 48),
    ] {
        let (gb, _) = quantized(ty, n_expert * nff, e, 51);
        let (ub, _) = quantized(ty, n_expert * nff, e, 52);
        let (db, _) = quantized(ty, n_expert * e, nff, 53);
        let ex = Experts {
            gate: QMat::new(ty, &gb, n_expert * nff, e).unwrap(),
            up: QMat::new(ty, &ub, n_expert * nff, e).unwrap(),
            down: QMat::new(ty, &db, n_expert * e, nff).unwrap(),
            n_expert,
            n_ff_exp: nff,
            act: GluKind::SwiGlu,
            layer: 0,
        };
        let x = values(n_tok * e, 54);
        let jobs: Vec<(u32, u32)> = vec![(4, 0), (0, 2), (4, 1), (2, 2), (4, 0)];
        let mut got = vec![f32::NAN; jobs.len() * e];
        let mut scratch = ExpertRowsScratch::default();
        be.expert_rows(&ex, &x, &jobs, &mut got, &mut scratch, Workers::Rayon, || ());
        // Again on spinning workers, with the same scratch: the same bits, nothing left over from the first call.
        let mut again = vec![0f32; jobs.len() * e];
        be.expert_rows(&ex, &x, &jobs, &mut again, &mut scratch, Workers::Spin(&pool), || ());
        assert!(
            got.iter().zip(&again).all(|(a, b)| a.to_bits() == b.to_bits()),
            "{ty}: not repeatable"
        );
        // The rate probe runs the same code over every expert of the layer.
        let rate = be.expert_rate(&ex, 2, Workers::Spin(&pool));
        assert!(rate.bytes_s > 0.0 && rate.fixed_s >= 0.0, "{ty}: {rate:?}");
        for (j, &(ex_id, t)) in jobs.iter().enumerate() {
            let routing = Routing {
                k: 1,
                ids: vec![ex_id],
                weights: vec![1.0],
                normalized: false,
            };
            let xt = &x[t as usize * e..(t as usize + 1) * e];
            let mut want = vec![0f32; e];
            be.moe_ffn(&ex, xt, &routing, &mut want, &mut MoeScratch::default());
            assert!(want.iter().any(|v| *v != 0.0));
            let row = &got[j * e..(j + 1) * e];
            let diff = row.iter().zip(&want).position(|(a, b)| a.to_bits() != b.to_bits());
            assert_eq!(diff, None, "{ty}: job {j} (expert {ex_id}, token {t})");
        }
    }
}

#[test]
fn activations_match_their_formulas() {
    assert!((silu(1.0) - 1.0 / (1.0 + (-1f32).exp())).abs() < 1e-7);
    // gelu(x) ≈ x·Φ(x): Φ(1) = 0.841345
    assert!((gelu_tanh(1.0) - 0.841345).abs() < 1e-3);
    assert!(gelu_tanh(-10.0).abs() < 1e-6);
    // ggml's f16 GELU: the input and the result rounded to f16, clamped outside ±10.
    assert_eq!(gelu_ggml(1.0), f16::from_f32(gelu_tanh(1.0)).to_f32());
    assert_eq!(
        gelu_ggml(0.1234567),
        f16::from_f32(gelu_tanh(f16::from_f32(0.1234567).to_f32())).to_f32()
    );
    assert_eq!((gelu_ggml(-10.5), gelu_ggml(12.0)), (0.0, 12.0));
}
