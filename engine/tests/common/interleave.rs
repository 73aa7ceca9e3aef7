//! Several sequences through one engine (one model, one backend), stepped in turn, against each run alone: a
//! shared backend must keep each sequence's state apart (its KV cache, its recorded steps), so every sequence
//! gets exactly its own greedy tokens. And one forward step that carries several sequences (a batch layout of
//! several runs) against the same steps run one sequence at a time.

use strata_engine::backend::Backend;
use strata_engine::model::{Logits, Model, Scratch};
use strata_engine::runtime::generate::{Greedy, TokenSampler};
use strata_engine::runtime::session::{Session, SessionConfig};
use strata_engine::state::batch::BatchLayout;
use strata_engine::state::kv::{KvCache, KvPool, KvType};

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

/// The logits one forward step leaves, read back: `[runs][vocab]` for [`Logits::Last`].
fn step<B: Backend>(
    model: &Model,
    be: &B,
    tokens: &[u32],
    layout: &BatchLayout,
    kvs: &mut [&mut KvCache],
    s: &mut Scratch<B>,
) -> Vec<f32> {
    let out = model.forward(be, tokens, layout, kvs, s, Logits::Last);
    model.read_logits(be, s, Logits::Last, layout, out.topped).to_vec()
}

/// Largest `|got - want|` over the largest `|want|`.
fn rel_diff(got: &[f32], want: &[f32]) -> f32 {
    assert_eq!(got.len(), want.len());
    let scale = want.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-30);
    got.iter().zip(want).fold(0f32, |m, (g, w)| m.max((g - w).abs())) / scale
}

/// One forward step that carries two sequences (both prompts as two runs), then a step with one decode token of
/// the first and three new tokens of the second, gives each sequence the logits of the same steps run alone,
/// within `tol` (largest difference over the largest logit) and with the same greedy token. Returns the largest
/// difference seen.
pub fn assert_batched_steps_equal_alone<B: Backend>(model: &Model, be: &B, kv: KvType, tol: f32) -> f32 {
    let vocab = model.weights.output.rows;
    let shape = model.hp.kv_shape();
    let a: Vec<u32> = (0..7).map(|i| 300 + i * 37).collect();
    // 57 tokens in the first step: at most 64, the most a GPU's step of several sequences runs its experts on the
    // decode kernels for.
    let b: Vec<u32> = (0..50).map(|i| 500 + i * 11).collect();
    let (a2, b2): (Vec<u32>, Vec<u32>) = (vec![901], vec![77, 1034, 1100]);

    // Alone: each sequence with its own cache and scratch, one run per step.
    let mut alone = Vec::new();
    for (p, next) in [(&a, &a2), (&b, &b2)] {
        let mut cache = KvCache::new(&shape, 128, kv).unwrap();
        let mut s = Scratch::<B>::default();
        let first = step(model, be, p, &BatchLayout::one(0, p.len()), &mut [&mut cache], &mut s);
        let second = step(
            model,
            be,
            next,
            &BatchLayout::one(p.len(), next.len()),
            &mut [&mut cache],
            &mut s,
        );
        alone.push((first, second));
    }

    // Together: one cache per sequence, one scratch, both sequences in each step.
    let (mut ca, mut cb) = (
        KvCache::new(&shape, 128, kv).unwrap(),
        KvCache::new(&shape, 128, kv).unwrap(),
    );
    let mut s = Scratch::<B>::default();
    let mut layout = BatchLayout::default();
    layout.push(0, 0, a.len());
    layout.push(1, 0, b.len());
    let tokens: Vec<u32> = a.iter().chain(&b).copied().collect();
    let first = step(model, be, &tokens, &layout, &mut [&mut ca, &mut cb], &mut s);
    // The second step lists the second sequence first: a run's sequence is named, not implied by its order.
    let mut layout = BatchLayout::default();
    layout.push(1, b.len(), b2.len());
    layout.push(0, a.len(), a2.len());
    let tokens: Vec<u32> = b2.iter().chain(&a2).copied().collect();
    let second = step(model, be, &tokens, &layout, &mut [&mut ca, &mut cb], &mut s);

    let argmax = |x: &[f32]| {
        (0..x.len())
            .max_by(|&i, &j| x[i].total_cmp(&x[j]).then(j.cmp(&i)))
            .unwrap()
    };
    let mut worst = 0f32;
    for (what, got, want) in [
        ("first sequence's prompt", &first[..vocab], &alone[0].0[..]),
        ("second sequence's prompt", &first[vocab..], &alone[1].0[..]),
        ("first sequence's decode step", &second[vocab..], &alone[0].1[..]),
        ("second sequence's three tokens", &second[..vocab], &alone[1].1[..]),
    ] {
        let d = rel_diff(got, want);
        assert!(
            d <= tol,
            "{what}: batched logits differ from alone by {d:e} (tolerance {tol:e})"
        );
        assert_eq!(argmax(got), argmax(want), "{what}: greedy token");
        worst = worst.max(d);
    }
    worst
}

/// A prompt prefix taken from another sequence ([`Session::adopt_prefix`]: shared blocks, in host memory on the CPU
/// and in VRAM on a GPU) gives the bits of computing it: sequence A prefills 60 tokens in 16-token chunks;
/// B, which held another prompt, takes A's first 45 cells (part of a block: B's writes after them copy that block)
/// and prefills a prompt that continues them differently, then decodes 4 tokens; C computes 48 tokens
/// in A's chunks, then the same prompt (keeping 45) and tokens. B's logits at every step equal C's bit for bit (the
/// same kernels over the same cells), and A's next step is as if nothing was taken, for an f16 and an int8 cache.
pub fn assert_adopted_prefix_equals_computed<B: Backend>(model: &Model, be: &B) {
    let vocab = model.weights.output.rows as u32;
    let ids: Vec<u32> = (0..80u32).map(|i| (i * 613 + 29) % vocab).collect();
    let other: Vec<u32> = (0..12u32).map(|i| (i * 211 + 7) % vocab).collect();
    let prompt_b: Vec<u32> = [&ids[..45], &other[..]].concat();
    assert_ne!(other[0], ids[45]);
    for kv in [KvType::F16, KvType::Int8] {
        let cfg = SessionConfig {
            max_context: 256,
            kv,
            prefill_chunk: Some(16),
        };
        let pool = KvPool::new(&model.hp.kv_shape(), None);
        let mut a = Session::new_in(model, be, cfg, &pool).expect("session");
        a.prefill(&ids[..60]).expect("prefill");
        let mut b = Session::new_in(model, be, cfg, &pool).expect("session");
        b.prefill(&other[..]).expect("prefill");
        assert!(b.adopt_prefix(&a, 45), "{kv}: the backend did not take the prefix");
        assert_eq!(b.tokens(), &ids[..45]);
        let mut c = Session::new(model, be, cfg).expect("session");
        c.prefill(&ids[..48]).expect("prefill");
        let mut runs = [&mut b, &mut c].map(|s| {
            let stats = s.prefill(&prompt_b).expect("prefill");
            assert_eq!((stats.reused, stats.read), (45, 12), "{kv}");
            let mut logits = vec![s.logits().to_vec()];
            for t in 0..4u32 {
                logits.push(s.decode((t * 97 + 5) % vocab).expect("decode").to_vec());
            }
            logits
        });
        let (got, want) = (std::mem::take(&mut runs[0]), std::mem::take(&mut runs[1]));
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            let same = g.iter().zip(w).all(|(x, y)| x.to_bits() == y.to_bits());
            assert!(
                same,
                "{kv}: step {i}: logits after an adopted prefix differ from computing it"
            );
        }
        // A's cells are its own still: its next step is as if nothing was taken.
        let mut d = Session::new(model, be, cfg).expect("session");
        d.prefill(&ids[..60]).expect("prefill");
        let want = d.decode(ids[60]).expect("decode").to_vec();
        assert!(
            a.decode(ids[60]).expect("decode") == want.as_slice(),
            "{kv}: the source sequence changed"
        );
    }
}

/// Four sequences whose caches of 32 cells take their blocks from `pool` (on a GPU, a device pool without a limit
/// starts at the first cache's context, 2 blocks, and grows its arrays as blocks are taken): each prefills 12
/// tokens alone, then the four decode 12 tokens together, one token each per step, so the step at position 16 takes
/// four new blocks at once. Each sequence's logits at every step equal, within `tol`, those of the same steps run
/// alone with a cache of its own (and the same greedy token). Returns the largest difference seen.
pub fn assert_growing_pool_keeps_each_alone<B: Backend>(
    model: &Model,
    be: &B,
    pool: &std::sync::Arc<KvPool>,
    tol: f32,
) -> f32 {
    let (shape, vocab) = (model.hp.kv_shape(), model.weights.output.rows);
    let prompt = |s: usize| -> Vec<u32> { (0..12).map(|i| (100 + 31 * s + 7 * i) as u32).collect() };
    let next = |s: usize, i: usize| (400 + 13 * s + 5 * i) as u32;
    let argmax = |x: &[f32]| {
        (0..x.len())
            .max_by(|&i, &j| x[i].total_cmp(&x[j]).then(j.cmp(&i)))
            .unwrap()
    };
    let mut alone: Vec<Vec<Vec<f32>>> = Vec::new();
    for s in 0..4 {
        let mut cache = KvCache::new(&shape, 32, KvType::F16).unwrap();
        let mut sc = Scratch::<B>::default();
        let mut got = vec![step(
            model,
            be,
            &prompt(s),
            &BatchLayout::one(0, 12),
            &mut [&mut cache],
            &mut sc,
        )];
        for i in 0..12 {
            let l = BatchLayout::one(12 + i, 1);
            got.push(step(model, be, &[next(s, i)], &l, &mut [&mut cache], &mut sc));
        }
        alone.push(got);
    }
    let mut caches: Vec<KvCache> = (0..4)
        .map(|_| KvCache::new_in(&shape, 32, KvType::F16, pool).unwrap())
        .collect();
    let mut sc = Scratch::<B>::default();
    let mut worst = 0f32;
    let mut check = |what: String, got: &[f32], want: &[f32]| {
        let d = rel_diff(got, want);
        assert!(d <= tol, "{what}: {d:e} from alone (tolerance {tol:e})");
        assert_eq!(argmax(got), argmax(want), "{what}: greedy token");
        worst = worst.max(d);
    };
    for (s, c) in caches.iter_mut().enumerate() {
        let got = step(model, be, &prompt(s), &BatchLayout::one(0, 12), &mut [c], &mut sc);
        check(format!("sequence {s}'s prompt"), &got, &alone[s][0]);
    }
    for i in 0..12 {
        let mut layout = BatchLayout::default();
        for s in 0..4 {
            layout.push(s, 12 + i, 1);
        }
        let tokens: Vec<u32> = (0..4).map(|s| next(s, i)).collect();
        let mut kvs: Vec<&mut KvCache> = caches.iter_mut().collect();
        let got = step(model, be, &tokens, &layout, &mut kvs, &mut sc);
        for s in 0..4 {
            let what = format!("sequence {s}'s decode step at position {}", 12 + i);
            check(what, &got[s * vocab..(s + 1) * vocab], &alone[s][1 + i]);
        }
    }
    worst
}
