//! The cache simulator: a routing trace replayed through the slot cache ([`SlotCache`], the code the engine
//! runs) under a policy and a slot count, beside Belady's optimal hit count for the same slots (the ceiling no
//! online policy can pass), and the bytes that would cross the link.

use std::collections::BTreeSet;

use super::ExpertId;
use super::cache::{CacheStats, Policy, SlotCache};
use super::profile::ExpertProfile;
use super::trace::Trace;

/// One simulation's settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SimConfig {
    pub slots: usize,
    pub policy: Policy,
    /// At most this many uploads per layer per step; the rest of a step's misses in that layer are served around
    /// the cache (computed where the expert lives). `None`: no cap.
    pub upload_cap: Option<u32>,
}

/// Replays `trace` through a fresh cache. A [`Policy::Profile`] cache is first filled with the trace's most used
/// experts (an oracle profile: the best a profile of this trace could do).
pub fn simulate(trace: &Trace, cfg: &SimConfig) -> CacheStats {
    let h = trace.header;
    let mut cache = SlotCache::new(h.n_layer as usize, h.n_expert as usize, cfg.slots, cfg.policy);
    if cfg.policy == Policy::Profile {
        cache.prefill(&ExpertProfile::of_trace(trace).ranked());
    }
    let k = h.k as usize;
    let mut uploads = 0u32;
    let mut at = (u64::MAX, u32::MAX);
    for (r, &(step, layer, _)) in trace.records.iter().enumerate() {
        if (step, layer) != at {
            at = (step, layer);
            uploads = 0;
        }
        for &e in &trace.experts[r * k..(r + 1) * k] {
            let admit = cfg.upload_cap.is_none_or(|cap| uploads < cap);
            if let super::cache::Access::Admitted { .. } = cache.access(ExpertId { layer, expert: e }, admit) {
                uploads += 1;
            }
        }
    }
    cache.stats()
}

/// Belady's optimal hit count for `slots` slots over `trace` (Belady 1966, MIN with bypass): on a miss, the
/// expert is admitted only if some cached expert is next used later than it, and then that one is evicted. No
/// policy, with or without bypass, hits more often on the same lookups.
pub fn belady_hits(trace: &Trace, slots: usize) -> u64 {
    let seq: Vec<usize> = trace.lookups().collect();
    // next[i]: the index of the next lookup of seq[i]'s expert, or usize::MAX.
    let mut next = vec![usize::MAX; seq.len()];
    let mut seen = std::collections::HashMap::new();
    for i in (0..seq.len()).rev() {
        if let Some(&j) = seen.get(&seq[i]) {
            next[i] = j;
        }
        seen.insert(seq[i], i);
    }
    // Cached experts by their next use; `when[expert]` is the key it is filed under.
    let mut cached: BTreeSet<(usize, usize)> = BTreeSet::new();
    let mut when = std::collections::HashMap::new();
    let mut hits = 0;
    for (i, &x) in seq.iter().enumerate() {
        if let Some(w) = when.remove(&x) {
            hits += 1;
            cached.remove(&(w, x));
        } else if slots == 0 {
            continue;
        } else if cached.len() == slots {
            let &(far, y) = cached.last().expect("a full cache");
            if next[i] >= far {
                continue;
            }
            cached.pop_last();
            when.remove(&y);
        }
        cached.insert((next[i], x));
        when.insert(x, next[i]);
    }
    hits
}

#[cfg(test)]
mod tests {
    use super::super::trace::{SynthRouting, synth_trace};
    use super::*;

    /// A trace of one layer, top-1, with the experts in `seq`, one token per step.
    fn one_layer(seq: &[u32]) -> Trace {
        let mut t = Trace::new(1, 8, 1);
        for (i, &e) in seq.iter().enumerate() {
            t.push(i as u64, 0, i as u64, &[e]);
        }
        t
    }

    /// A b c a b d a b, 2 slots, counted by hand:
    /// LRU:    a- b- c-(a out) a-(b out) b-(c out) d-(a out) a-(b out) b-(d out): 0 hits.
    /// Belady: a- b- c(bypass: used never again) a+ b+ d(bypass) a+ b+: 4 hits.
    #[test]
    fn a_known_trace_gives_the_hit_counts_computed_by_hand() {
        let t = one_layer(&[0, 1, 2, 0, 1, 3, 0, 1]);
        let lru = SimConfig {
            slots: 2,
            policy: Policy::Lru,
            upload_cap: None,
        };
        let s = simulate(&t, &lru);
        assert_eq!((s.lookups, s.hits, s.admitted, s.evictions), (8, 0, 8, 6));
        assert_eq!(belady_hits(&t, 2), 4);
        // 3 slots: LRU keeps a and b through c (c out at d): hits a b, then d evicts c, then a b hit: 4.
        assert_eq!(simulate(&t, &SimConfig { slots: 3, ..lru }).hits, 4);
        assert_eq!(belady_hits(&t, 3), 4);
        assert_eq!(belady_hits(&t, 0), 0);
        // The oracle profile pins a and b (used 3 times each) before the trace: all six of their lookups hit.
        let p = simulate(
            &t,
            &SimConfig {
                policy: Policy::Profile,
                ..lru
            },
        );
        assert_eq!((p.hits, p.bypassed), (6, 2));
    }

    #[test]
    fn an_upload_cap_bypasses_the_rest_of_a_steps_misses_in_a_layer() {
        // Step 0: four misses, cap 1: one admitted, three bypassed; step 1: one hit, one admitted, two bypassed.
        let mut t = Trace::new(1, 8, 4);
        t.push(0, 0, 0, &[0, 1, 2, 3]);
        t.push(1, 0, 1, &[0, 1, 2, 3]);
        let s = simulate(
            &t,
            &SimConfig {
                slots: 8,
                policy: Policy::Lru,
                upload_cap: Some(1),
            },
        );
        assert_eq!((s.admitted, s.bypassed, s.hits), (2, 5, 1));
    }

    /// On locality and random traces, at several sizes, no demand-filled policy beats Belady (a profile cache is
    /// filled before the trace, so its first uses hit: it is not a demand cache and Belady does not bound it).
    #[test]
    fn belady_is_never_beaten() {
        for routing in [SynthRouting::QWEN3_30B, SynthRouting::RANDOM] {
            let t = synth_trace(4, 32, 4, 300, routing, 3);
            for slots in [0, 4, 16, 40, 128] {
                let best = belady_hits(&t, slots);
                for policy in [Policy::Lru, Policy::Lfru] {
                    for upload_cap in [None, Some(2)] {
                        let s = simulate(
                            &t,
                            &SimConfig {
                                slots,
                                policy,
                                upload_cap,
                            },
                        );
                        assert!(
                            s.hits <= best,
                            "{policy} {slots} slots: {} hits > Belady {best}",
                            s.hits
                        );
                        assert_eq!(s.lookups, 300 * 4 * 4);
                    }
                }
                // All experts fit: only the first use of each misses.
                if slots == 128 {
                    let distinct = t.lookups().collect::<std::collections::HashSet<_>>().len() as u64;
                    assert_eq!(best, 300 * 16 - distinct);
                }
            }
        }
    }
}
