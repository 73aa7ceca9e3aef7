#![allow(dead_code)] // each test binary uses some of these helpers
//! Continuous batching through the scheduler, on any backend: each prompt alone (the reference), and prompts run
//! together through [`Batcher`] with a shared KV pool, recording what each request gave and what the pool held
//! (the CPU's batching tests, and the GPU's with batch-invariant kernels).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use strata_engine::backend::Backend;
use strata_engine::model::Model;
use strata_engine::runtime::batch::{BatchEvent, BatchJob, Batcher, KvUsage, StepReport};
use strata_engine::runtime::generate::{GenerateOptions, GenerateStats, Greedy, generate};
use strata_engine::runtime::session::{Session, SessionConfig};
use strata_engine::state::kv::{KvPool, KvType};
use strata_engine::tokenizer::Tokenizer;

pub const TEXT: &str = "The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France. It is named \
after the engineer Gustave Eiffel, whose company designed and built the tower from 1887 to 1889. Locally nicknamed \
\"La dame de fer\" (French for \"Iron Lady\"), it was constructed as the centrepiece of the 1889 World's Fair.";

/// Prefill chunks of 16 tokens: every prompt below takes several steps, mixed with the others' decode tokens.
pub fn config() -> SessionConfig {
    SessionConfig {
        max_context: 512,
        kv: KvType::F16,
        prefill_chunk: Some(16),
    }
}

pub fn opts(max_tokens: usize) -> GenerateOptions {
    GenerateOptions {
        max_tokens,
        stop: vec![],
        logits_digest: true,
        logprobs: None,
    }
}

/// Each prompt alone on a fresh session of `be`: the reference.
pub fn alone<B: Backend>(
    model: &Model,
    be: &B,
    tok: &Tokenizer,
    prompts: &[Vec<u32>],
    max_tokens: usize,
) -> Vec<GenerateStats> {
    prompts
        .iter()
        .map(|p| {
            let mut s = Session::new(model, be, config()).unwrap();
            generate(&mut s, tok, p, &opts(max_tokens), &mut Greedy, &mut |_| {})
                .unwrap()
                .1
        })
        .collect()
}

pub struct Ran {
    pub done: Vec<Option<GenerateStats>>,
    pub failed: Vec<Option<String>>,
    pub text: Vec<String>,
    pub steps: Vec<StepReport>,
    /// The KV pool after each step.
    pub kv: Vec<KvUsage>,
    /// Request ids in the order they ended (done or failed).
    pub ended: Vec<u64>,
}

/// Runs `prompts` through a scheduler of `parallel` slots, all submitted at once (request i has id i), then, once
/// they have all ended, `then` (ids following); `cancel` is set on request `cancel_at.0` once `cancel_at.1` steps
/// have run. The slots share a KV pool of `kv_tokens` (no limit: `None`), on the device where `be` keeps its
/// caches there.
#[allow(clippy::too_many_arguments)]
pub fn batched<B: Backend>(
    model: &Model,
    be: &B,
    tok: &Tokenizer,
    prompts: &[Vec<u32>],
    then: &[Vec<u32>],
    parallel: usize,
    max_tokens: usize,
    cancel_at: Option<(usize, usize)>,
    kv_tokens: Option<usize>,
) -> Ran {
    let pool = KvPool::placed(&model.hp.kv_shape(), kv_tokens, be.kv_on_device());
    let sessions = (0..parallel)
        .map(|_| Session::new_in(model, be, config(), &pool).unwrap())
        .collect();
    let mut b = Batcher::new(sessions, 16);
    let all: Vec<&Vec<u32>> = prompts.iter().chain(then).collect();
    let flags: Vec<Arc<AtomicBool>> = all.iter().map(|_| Arc::new(AtomicBool::new(false))).collect();
    let job = |i: usize| BatchJob {
        id: i as u64,
        prompt: all[i].clone(),
        opts: opts(max_tokens),
        sampler: Box::new(Greedy),
        cancel: flags[i].clone(),
    };
    for i in 0..prompts.len() {
        b.submit(job(i));
    }
    let n = all.len();
    let mut ran = Ran {
        done: vec![None; n],
        failed: vec![None; n],
        text: vec![String::new(); n],
        steps: vec![],
        kv: vec![],
        ended: vec![],
    };
    let mut second = false;
    loop {
        if b.is_idle() {
            if second || then.is_empty() {
                break;
            }
            second = true;
            for i in prompts.len()..n {
                b.submit(job(i));
            }
        }
        if let Some((who, after)) = cancel_at
            && ran.steps.len() == after
        {
            flags[who].store(true, Ordering::Relaxed);
        }
        let report = b.step(tok, &mut |ev| match ev {
            BatchEvent::Text { id, text, .. } => ran.text[id as usize].push_str(text),
            BatchEvent::Done { id, stats } => {
                ran.done[id as usize] = Some(stats);
                ran.ended.push(id);
            }
            BatchEvent::Failed { id, error } => {
                ran.failed[id as usize] = Some(error.to_string());
                ran.ended.push(id);
            }
            BatchEvent::Progress { .. } => {}
        });
        assert!(report.sequences <= parallel && report.tokens <= 16, "{report:?}");
        ran.steps.push(report);
        let kv = b.kv_usage();
        assert_eq!(kv.blocks_used, pool.held_blocks());
        if let Some(total) = kv.blocks_total {
            assert!(kv.blocks_used <= total, "step {}: {kv:?}", ran.steps.len());
        }
        ran.kv.push(kv);
        assert!(ran.steps.len() < 10_000, "the scheduler never went idle");
    }
    ran
}

pub fn prompts(tok: &Tokenizer) -> Vec<Vec<u32>> {
    let ids = tok.encode(TEXT, true, false).unwrap();
    assert!(ids.len() >= 60);
    vec![
        ids[..7].to_vec(),
        ids[..60].to_vec(),
        tok.encode("What is the capital of France? The capital of France is", true, false)
            .unwrap(),
        // Waits for a slot.
        [&ids[..40], &ids[45..50]].concat(),
    ]
}

/// Every request of `ran` ended as it does alone (`want`): the same tokens, logits bits, end and text.
pub fn assert_as_alone(tok: &Tokenizer, ran: &Ran, want: &[GenerateStats]) {
    for (i, w) in want.iter().enumerate() {
        let got = ran.done[i]
            .as_ref()
            .unwrap_or_else(|| panic!("request {i}: {:?}", ran.failed[i]));
        assert_eq!(got.tokens, w.tokens, "request {i}: tokens");
        assert_eq!(got.logits_digests, w.logits_digests, "request {i}: logits bits");
        assert_eq!(got.stop, w.stop, "request {i}");
        let printed: Vec<u32> = w.tokens.iter().copied().filter(|&t| !tok.is_eog(t)).collect();
        assert_eq!(ran.text[i], tok.decode(&printed).unwrap(), "request {i}: text");
    }
}
