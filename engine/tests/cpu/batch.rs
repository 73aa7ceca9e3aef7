//! Continuous batching on the CPU (issue 20, point 4): a sequence computed inside a batch, with prompt chunks and
//! other sequences' decode tokens in the same steps, gives the tokens and the logits bits it gives alone; a
//! request that waits for a slot, one that is cancelled and one that fails leave the others as they were; and so
//! does a request preempted for KV blocks and computed again.

use std::path::{Path, PathBuf};

use strata_engine::backend::AnyBackend;
use strata_engine::backend::cpu::CpuBackend;
use strata_engine::backend::split::Split;
use strata_engine::backend::{AttnOp, AttnParams, Backend, RopeKind, RopeParams, RunBufs, attend_runs_one_by_one};
use strata_engine::device::Device;
use strata_engine::fixtures::synth::SynthSpec;
use strata_engine::model::Model;
use strata_engine::models;
use strata_engine::quant::GgmlType;
use strata_engine::rng::SplitMix64;
use strata_engine::runtime::generate::{GenerateStats, StopReason};
use strata_engine::state::batch::BatchLayout;
use strata_engine::state::kv::{KV_BLOCK_CELLS, KvCache, KvShape, KvType};
use strata_engine::tokenizer::Tokenizer;

use crate::batched::{TEXT, alone, assert_as_alone, batched, prompts};

fn tiny_moe() -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tiny-qwen3moe.gguf");
    SynthSpec::tiny_qwen3moe().write(&path).unwrap();
    (dir, path)
}

/// Runs `check` on the default model and on a tiny MoE.
fn on_dense_and_moe(check: fn(&Path)) {
    check(&models::require(models::DEFAULT_MODEL_FILE).unwrap_or_else(|e| panic!("{e}")));
    let (_dir, path) = tiny_moe();
    check(&path);
}

fn check_equal_to_alone(path: &Path) {
    check_model_equal_to_alone(Model::load(path).unwrap());
}

fn check_model_equal_to_alone(model: Model) {
    let tok = Tokenizer::from_metadata(model.gguf.metadata()).unwrap();
    let prompts = prompts(&tok);
    // A prompt sharing its first 40 tokens with the second, sent once the first four have ended: it takes the
    // second's slot and reuses that prefix.
    let ids = tok.encode(TEXT, true, false).unwrap();
    let later = vec![[&ids[..40], &ids[50..55]].concat()];
    let want = alone(&model, &CpuBackend, &tok, &[&prompts[..], &later[..]].concat(), 24);
    let ran = batched(&model, &CpuBackend, &tok, &prompts, &later, 3, 24, None, None);
    assert_as_alone(&tok, &ran, &want);
    // It was a batch: steps of several sequences, some mixing a prompt chunk with decode tokens.
    assert!(ran.steps.iter().any(|s| s.sequences == 3), "{:?}", ran.steps);
    assert!(
        ran.steps.iter().any(|s| s.decoding > 0 && s.tokens > s.decoding),
        "no step mixed prefill and decode: {:?}",
        ran.steps
    );
    // Its request events say so: the first three ran with others, and the fourth waited for a slot.
    assert!(
        ran.done[..3].iter().all(|d| d.as_ref().unwrap().batch_mean > 1.5),
        "{:?}",
        ran.done
    );
    assert!(want.iter().all(|w| w.batch_mean == 1.0 && w.queued_ms == 0.0));
    let fourth = ran.done[3].as_ref().unwrap();
    assert!(fourth.queued_ms > 0.0);
    // The fourth shares its first 40 tokens with the second, which another slot holds: its slot (the first
    // request's, which held 7 of them) shares those cells' blocks instead of computing them, and gets the same
    // bits.
    assert_eq!(fourth.prefill.reused, 40, "{:?}", fourth.prefill);
    assert!(
        ran.kv.iter().any(|k| k.blocks_shared >= 40 / KV_BLOCK_CELLS),
        "no block was shared: {:?}",
        ran.kv
    );
    assert!(ran.done.iter().all(|d| d.as_ref().unwrap().preempted == 0));
    let fifth = ran.done[4].as_ref().unwrap();
    assert_eq!(fifth.prefill.reused, 40, "{:?}", fifth.prefill);
}

/// The default model and a tiny MoE.
#[test]
fn batched_sequences_give_the_tokens_and_logits_of_each_alone() {
    on_dense_and_moe(check_equal_to_alone);
}

/// The default model with its matrices packed eight rows at a time (`STRATA_CPU_PACK`, the engine's default on an
/// AVX2 CPU): every token of a packed matrix goes through the packed kernel, so a batch still changes no bit.
#[test]
fn packed_matrices_give_batched_sequences_the_bits_of_each_alone() {
    let mut model = Model::load(models::require(models::DEFAULT_MODEL_FILE).unwrap_or_else(|e| panic!("{e}"))).unwrap();
    if model.pack_for_cpu(None).unwrap().0 == 0 {
        eprintln!("skipped: this CPU has no packed kernels (AVX2, FMA and F16C)");
        return;
    }
    check_model_equal_to_alone(model);
}

/// Float matrices (F16 attention and dense layers, BF16 experts, an F32 output) take their own dot product per
/// row and token, so a step of several sequences gives each the bits it gets alone here too.
#[test]
fn batched_float_sequences_give_the_tokens_and_logits_of_each_alone() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tiny-qwen3moe-float.gguf");
    let mut spec = SynthSpec::tiny_qwen3moe();
    spec.types.attn = GgmlType::F16;
    spec.types.ffn = GgmlType::F16;
    spec.types.experts = GgmlType::BF16;
    spec.types.output = GgmlType::F32;
    spec.write(&path).unwrap();
    check_equal_to_alone(&path);
}

#[test]
fn a_cancelled_or_failed_request_leaves_the_others_as_they_were() {
    let (_dir, path) = tiny_moe();
    let model = Model::load(&path).unwrap();
    let tok = Tokenizer::from_metadata(model.gguf.metadata()).unwrap();
    let mut prompts = prompts(&tok);
    prompts[2] = vec![1, 2, u32::MAX];
    let want = alone(&model, &CpuBackend, &tok, &prompts[..2], 24);
    // Request 1 is cancelled in its prefill (60 tokens in chunks of at most 16: it needs four or more steps).
    let ran = batched(&model, &CpuBackend, &tok, &prompts, &[], 3, 24, Some((1, 2)), None);
    let first = ran.done[0].as_ref().unwrap();
    assert_eq!(first.tokens, want[0].tokens);
    assert_eq!(first.logits_digests, want[0].logits_digests);
    let cancelled = ran.done[1].as_ref().unwrap();
    assert_eq!(cancelled.stop, StopReason::Cancelled);
    assert!(
        cancelled.prefill.cancelled && cancelled.tokens.is_empty(),
        "{cancelled:?}"
    );
    let failed = ran.failed[2].as_deref().unwrap();
    assert!(failed.contains("outside the model's vocabulary"), "{failed}");
    // The fourth took a free slot and ran as it does alone.
    let fourth = ran.done[3].as_ref().unwrap();
    let want4 = alone(&model, &CpuBackend, &tok, &prompts[3..], 24);
    assert_eq!(fourth.tokens, want4[0].tokens);
    assert_eq!(fourth.logits_digests, want4[0].logits_digests);
}

/// A KV pool of 6 blocks (96 tokens) for 3 slots whose requests need up to 84 tokens each: requests are
/// preempted (their blocks dropped) and computed again later, and each still gives the tokens and logits bits it
/// gives alone; the pool never holds more than its blocks.
fn check_preempted_equal_to_alone(path: &Path) {
    let model = Model::load(path).unwrap();
    let tok = Tokenizer::from_metadata(model.gguf.metadata()).unwrap();
    let prompts = prompts(&tok);
    let want = alone(&model, &CpuBackend, &tok, &prompts, 24);
    let ran = batched(&model, &CpuBackend, &tok, &prompts, &[], 3, 24, None, Some(96));
    assert_as_alone(&tok, &ran, &want);
    let done: Vec<&GenerateStats> = ran.done.iter().map(|d| d.as_ref().unwrap()).collect();
    let preempted: u32 = done.iter().map(|d| d.preempted).sum();
    assert!(preempted > 0, "nothing was preempted: {:?}", ran.kv);
    assert!(done.iter().any(|d| d.recomputed > 0), "nothing was computed again");
    assert_eq!(ran.kv.last().unwrap().preemptions, u64::from(preempted));
    assert!(ran.kv.iter().any(|k| k.waiting_preempted > 0));
    assert_eq!(ran.kv.last().unwrap().blocks_total, Some(6));
}

/// The default model and a tiny MoE.
#[test]
fn preempted_sequences_give_the_tokens_and_logits_of_each_alone() {
    on_dense_and_moe(check_preempted_equal_to_alone);
}

/// A request that follows another on one slot whose pool is just its context keeps the prefix they share (its
/// slot's blocks past it count as free, they are not dropped to make room), and runs as alone.
#[test]
fn a_tight_pool_keeps_the_prefix_a_slot_holds() {
    let (_dir, path) = tiny_moe();
    let model = Model::load(&path).unwrap();
    let tok = Tokenizer::from_metadata(model.gguf.metadata()).unwrap();
    let ids = tok.encode(TEXT, true, false).unwrap();
    let (first, then) = (ids[..60].to_vec(), [&ids[..40], &ids[50..55]].concat());
    let want = alone(&model, &CpuBackend, &tok, &[first.clone(), then.clone()], 24);
    let ran = batched(&model, &CpuBackend, &tok, &[first], &[then], 1, 24, None, Some(96));
    assert_as_alone(&tok, &ran, &want);
    let second = ran.done[1].as_ref().unwrap();
    assert_eq!(second.prefill.reused, 40, "{:?}", second.prefill);
}

/// A request cancelled while it waits for a slot ends at once, before the request ahead of it: it holds no
/// place in the queue.
#[test]
fn a_request_cancelled_while_waiting_ends_at_once() {
    let (_dir, path) = tiny_moe();
    let model = Model::load(&path).unwrap();
    let tok = Tokenizer::from_metadata(model.gguf.metadata()).unwrap();
    let prompts = prompts(&tok);
    let ran = batched(
        &model,
        &CpuBackend,
        &tok,
        &prompts[..3],
        &[],
        1,
        24,
        Some((1, 2)),
        Some(512),
    );
    let cancelled = ran.done[1].as_ref().unwrap();
    assert_eq!(cancelled.stop, StopReason::Cancelled);
    assert_eq!(ran.ended[0], 1, "the cancelled request ended first: {:?}", ran.ended);
    assert!(ran.done[0].is_some() && ran.done[2].is_some());
}

/// A request that cannot fit the pool even alone (a pool smaller than its context, which `strata serve` refuses
/// at start) fails with a message naming the pool, and the others run as alone.
#[test]
fn a_request_larger_than_the_kv_pool_fails_and_the_others_run() {
    let (_dir, path) = tiny_moe();
    let model = Model::load(&path).unwrap();
    let tok = Tokenizer::from_metadata(model.gguf.metadata()).unwrap();
    let prompts = prompts(&tok);
    let (small, big) = (prompts[0].clone(), prompts[1].clone());
    let want = alone(&model, &CpuBackend, &tok, std::slice::from_ref(&small), 8);
    let ran = batched(&model, &CpuBackend, &tok, &[small, big], &[], 2, 8, None, Some(48));
    assert_eq!(ran.done[0].as_ref().unwrap().tokens, want[0].tokens);
    let failed = ran.failed[1].as_deref().unwrap_or_else(|| panic!("{:?}", ran.done[1]));
    assert!(failed.contains("KV cache pool holds 48 tokens"), "{failed}");
}

/// The CPU's `attend_runs` (the step's norms and RoPE at once, one attention pass over every run) gives, bit for
/// bit, what attending run by run gives: GQA groups of 1 to 8, sliding windows, a query scale (gemma3), f16 and
/// int8 caches, over steps mixing decode tokens and prompt chunks of 4 sequences.
#[test]
fn attending_every_run_at_once_equals_attending_run_by_run() {
    let be = CpuBackend;
    // Values in [-2, 2).
    let mut rng = SplitMix64::new(99);
    let mut f = move || (rng.unit() * 4.0 - 2.0) as f32;
    for &(nh, nkv, window, qscale, kvty) in &[
        (8usize, 2usize, None, None, KvType::F16),
        (8, 2, Some(5usize), None, KvType::F16),
        (6, 3, Some(3), Some(0.3f32), KvType::Int8),
        (4, 4, None, Some(0.5), KvType::Int8),
        (8, 1, Some(20), None, KvType::F16),
    ] {
        let (dk, dv) = (32usize, 32usize);
        let shape = KvShape {
            n_layer: 1,
            n_head_kv: nkv,
            head_dim: dk,
            head_dim_v: dv,
        };
        let rope = RopeParams {
            kind: RopeKind::Neox,
            n_rot: dk,
            freq_base: 10000.0,
            freq_scale: 1.0,
        };
        let qn: Vec<f32> = (0..dk).map(|_| 1.0 + 0.1 * f()).collect();
        let kn: Vec<f32> = (0..dk).map(|_| 1.0 + 0.1 * f()).collect();
        let op = AttnOp {
            norms: (Some(&qn), Some(&kn)),
            eps: 1e-6,
            rope: &rope,
            params: AttnParams {
                n_head: nh,
                n_head_kv: nkv,
                head_dim: dk,
                head_dim_v: dv,
                scale: if qscale.is_some() { 1.0 } else { 0.17 },
                window,
            },
            q_scale: qscale,
        };
        // 4 sequences with some history; steps mixing decode and prefill chunks.
        let mut a: Vec<KvCache> = (0..4).map(|_| KvCache::new(&shape, 128, kvty).unwrap()).collect();
        let mut b: Vec<KvCache> = (0..4).map(|_| KvCache::new(&shape, 128, kvty).unwrap()).collect();
        let mut pos = [0usize; 4];
        let steps: Vec<Vec<(usize, usize)>> = vec![
            vec![(0, 17), (1, 1), (2, 33), (3, 2)],
            vec![(2, 1), (0, 1), (3, 40), (1, 16)],
            vec![(1, 1), (0, 1), (2, 1), (3, 1)],
            vec![(3, 5), (2, 1)],
        ];
        for step in steps {
            let mut layout = BatchLayout::default();
            for &(s, n) in &step {
                layout.push(s, pos[s], n);
                pos[s] += n;
            }
            let n = layout.n_tok();
            let q0: Vec<f32> = (0..n * nh * dk).map(|_| f()).collect();
            let k0: Vec<f32> = (0..n * nkv * dk).map(|_| f()).collect();
            let v0: Vec<f32> = (0..n * nkv * dv).map(|_| f()).collect();
            let (mut qa, mut ka) = (q0.clone(), k0.clone());
            let (mut qb, mut kb) = (q0.clone(), k0.clone());
            let mut oa = vec![0f32; n * nh * dv];
            let mut ob = vec![1f32; n * nh * dv];
            let mut ra: Vec<&mut KvCache> = a.iter_mut().collect();
            let mut rb: Vec<&mut KvCache> = b.iter_mut().collect();
            let mut tmp = RunBufs::<Vec<f32>>::default();
            be.attend_runs(&mut qa, &mut ka, &v0, &mut ra, 0, &layout, &op, &mut oa, &mut tmp);
            let mut tmp2 = RunBufs::<Vec<f32>>::default();
            attend_runs_one_by_one(
                &be,
                &mut qb,
                &mut kb,
                &v0,
                &mut rb,
                0,
                layout.runs(),
                layout.positions(),
                &op,
                &mut ob,
                &mut tmp2,
            );
            for i in 0..oa.len() {
                assert_eq!(
                    oa[i].to_bits(),
                    ob[i].to_bits(),
                    "nh={nh} nkv={nkv} win={window:?} i={i}"
                );
            }
        }
    }
}

/// A split of the layers over three CPU backends, `0..1`, `1..n-1` and `n-1..n` (two boundaries; the
/// embeddings on the first, the head on the last; the block tables shared and copied on write across stages).
fn three_stages(n_layer: usize) -> AnyBackend {
    let cpu = || (Device::Cpu, AnyBackend::Cpu(CpuBackend, None));
    let mut split = Split::new(vec![cpu(), cpu(), cpu()]);
    split.place(&[0..1, 1..n_layer - 1, n_layer - 1..n_layer]);
    AnyBackend::Split(Box::new(split))
}

fn check_split_equal_to_one_backend(path: &Path) {
    let model = Model::load(path).unwrap();
    let tok = Tokenizer::from_metadata(model.gguf.metadata()).unwrap();
    let prompts = prompts(&tok);
    let ids = tok.encode(TEXT, true, false).unwrap();
    let later = vec![[&ids[..40], &ids[50..55]].concat()];
    let all = [&prompts[..], &later[..]].concat();
    let want = alone(&model, &CpuBackend, &tok, &all, 24);
    let be = three_stages(model.hp.n_layer as usize);
    let split_alone = alone(&model, &be, &tok, &all, 24);
    for (i, (got, w)) in split_alone.iter().zip(&want).enumerate() {
        assert_eq!(got.tokens, w.tokens, "request {i} alone: tokens");
        assert_eq!(got.logits_digests, w.logits_digests, "request {i} alone: logits bits");
    }
    let ran = batched(&model, &be, &tok, &prompts, &later, 3, 24, None, None);
    assert_as_alone(&tok, &ran, &want);
    // The fourth request reused a prefix another slot held: shared blocks across the stages.
    assert_eq!(ran.done[3].as_ref().unwrap().prefill.reused, 40);
    // Every step crossed both boundaries with the residual stream and its norm.
    let (carried, values) = be.split().unwrap().carried();
    assert!(carried > 0 && carried % 4 == 0, "{carried} buffers carried");
    assert!(
        values >= carried * model.hp.n_embd as u64,
        "{values} values in {carried} buffers"
    );
}

/// A layer split (`--device cuda:0,cuda:1`; here over CPU backends, which run the same boundary logic) gives
/// every sequence the tokens and logits bits of one backend, alone and batched with a shared prefix.
#[test]
fn a_layer_split_gives_the_tokens_and_logits_bits_of_one_backend() {
    on_dense_and_moe(check_split_equal_to_one_backend);
}
