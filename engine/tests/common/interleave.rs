//! Several sequences through one engine (one model, one backend), stepped in turn, against each run alone: a
//! shared backend must keep each sequence's state apart (its KV cache, its recorded steps), so every sequence
//! gets exactly its own greedy tokens.

use strata_engine::backend::Backend;
use strata_engine::model::Model;
use strata_engine::runtime::generate::{Greedy, TokenSampler};
use strata_engine::runtime::session::{Session, SessionConfig};

/// The greedy tokens of `steps` decode steps after `prompt`, one session alone on `be`.
pub fn greedy_alone<B: Backend>(model: &Model, be: &B, cfg: SessionConfig, prompt: &[u32], steps: usize) -> Vec<u32> {
    greedy_interleaved(model, be, cfg, &[prompt], steps).remove(0)
}

/// The greedy tokens of `steps` decode steps after each prompt, with one session per prompt on the same `be`:
/// every prompt is prefilled in turn, then each round steps every session once.
pub fn greedy_interleaved<B: Backend>(
    model: &Model,
    be: &B,
    cfg: SessionConfig,
    prompts: &[&[u32]],
    steps: usize,
) -> Vec<Vec<u32>> {
    let mut sessions: Vec<Session<'_, B>> = prompts
        .iter()
        .map(|_| Session::new(model, be, cfg).expect("session"))
        .collect();
    let mut out: Vec<Vec<u32>> = vec![Vec::new(); prompts.len()];
    for ((s, p), o) in sessions.iter_mut().zip(prompts).zip(&mut out) {
        s.prefill(p).expect("prefill");
        o.push(Greedy.next_token(s.step_logits(), &[]));
    }
    for _ in 1..steps {
        for (s, o) in sessions.iter_mut().zip(&mut out) {
            let last = *o.last().expect("a first token");
            let logits = s.decode_top(last).expect("decode");
            o.push(Greedy.next_token(logits, &[]));
        }
    }
    out
}

/// Asserts that each of `prompts`, interleaved with the others on `be`, gets the tokens it gets alone.
pub fn assert_interleaved_equals_alone<B: Backend>(
    model: &Model,
    be: &B,
    cfg: SessionConfig,
    prompts: &[&[u32]],
    steps: usize,
) {
    let together = greedy_interleaved(model, be, cfg, prompts, steps);
    for (i, p) in prompts.iter().enumerate() {
        let alone = greedy_alone(model, be, cfg, p, steps);
        assert_eq!(
            together[i], alone,
            "sequence {i}: interleaved tokens differ from the same sequence alone"
        );
        assert_eq!(alone.len(), steps);
    }
}
