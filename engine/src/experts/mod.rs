//! Experts of a mixture-of-experts model, apart from how any backend computes them: which expert is which
//! ([`ExpertId`], the key of the expert store and of the VRAM slot cache), where one expert's rows are in the
//! stacked `ffn_{gate,up,down}_exps` tensors ([`ExpertShape`]), the router's choice ([`Routing`], top-k of the
//! softmax as llama.cpp's `build_moe_ffn`), and the dispatch of a batch's tokens to the experts they chose
//! ([`ExpertGroups`]); the slot cache's bookkeeping and policies ([`cache`]), routing traces and their
//! generator ([`trace`]), the cache simulator with Belady's bound ([`simulate`]), and the expert store, where
//! every expert's bytes live on the host (arena | mmap, [`store`]), and where a decode step's misses are computed
//! (uploaded or on the CPU, by a cost model: [`miss`]), and expert profiles, the lookup counts a cache is
//! pre-filled from and learns ([`profile`]) (DESIGN.md section 3, "Expert cache").

use std::ops::Range;

pub mod cache;
pub mod miss;
pub mod profile;
pub mod simulate;
pub mod store;
pub mod trace;

/// One expert of one layer: what a slot of the VRAM expert cache holds (its gate, up and down rows).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ExpertId {
    pub layer: u32,
    pub expert: u32,
}

/// The geometry of a layer's experts in the stacked tensors llama.cpp's converter writes: `ffn_gate_exps` and
/// `ffn_up_exps` are `n_expert * n_ff_exp` rows of `n_embd` values, expert `e` being rows
/// `e * n_ff_exp .. (e + 1) * n_ff_exp`; `ffn_down_exps` is `n_expert * n_embd` rows of `n_ff_exp`, expert `e`
/// being rows `e * n_embd .. (e + 1) * n_embd`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExpertShape {
    pub n_expert: usize,
    /// Rows of an expert's gate and up matrices (the expert FFN's width).
    pub n_ff_exp: usize,
    /// Rows of an expert's down matrix (the model width).
    pub n_embd: usize,
}

impl ExpertShape {
    /// Expert `e`'s rows of the stacked gate (and up) tensor.
    ///
    /// Panics if `e >= n_expert`.
    pub fn gate_rows(&self, e: usize) -> Range<usize> {
        assert!(e < self.n_expert, "expert {e} of {}", self.n_expert);
        e * self.n_ff_exp..(e + 1) * self.n_ff_exp
    }

    /// Expert `e`'s rows of the stacked down tensor.
    ///
    /// Panics if `e >= n_expert`.
    pub fn down_rows(&self, e: usize) -> Range<usize> {
        assert!(e < self.n_expert, "expert {e} of {}", self.n_expert);
        e * self.n_embd..(e + 1) * self.n_embd
    }
}

/// Tokens of the largest step whose experts a backend computes by id (the CUDA backend's decode kernels, which
/// check it against their own limit): such a step routes to at most this many tokens x top-k distinct experts per
/// layer, each needing a staging slot when it is not cached. Larger steps (prefill) stream their experts through
/// the staging slots in groups.
pub const STAGING_TOKENS: usize = 4;

/// Alignment of each matrix inside a VRAM cache slot, in bytes (what a device allocation guarantees).
pub const SLOT_ALIGN: usize = 256;

/// Where one expert's gate, up and down bytes (`bytes`, in that order) go inside a cache slot: their offsets, and
/// the bytes they span. Each matrix starts at a multiple of [`SLOT_ALIGN`]; a slot of a model is as large as the
/// largest span of any of its layers (layers may mix quant types).
pub fn slot_layout(bytes: [usize; 3]) -> ([usize; 3], usize) {
    let mut at = 0;
    let mut offsets = [0; 3];
    for (o, b) in offsets.iter_mut().zip(bytes) {
        *o = at;
        at = (at + b).next_multiple_of(SLOT_ALIGN);
    }
    (offsets, at)
}

/// The router's choice for a batch of `n_tok` tokens: `ids[t * k + i]` is token t's i-th expert, `weights[t * k +
/// i]` its weight. Index `t * k + i` is a *routing slot*.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct Routing {
    pub k: usize,
    pub ids: Vec<u32>,
    pub weights: Vec<f32>,
    /// The weights were renormalised to sum 1 per token. Expert dispatch then divides by their exact sum,
    /// which removes the f32 rounding of the normalisation: identical experts give exactly one expert's output.
    pub normalized: bool,
}

impl Routing {
    /// Chooses each token's experts from `probs`, `[n_tok][n_expert]` router probabilities (the softmax of the
    /// router's logits): the `k` largest, in decreasing order, ties to the lower id; weights renormalised to sum
    /// 1 per token when `normalize` (llama.cpp's `build_moe_ffn` with softmax gating and `norm_w`). Replaces what
    /// `self` held.
    ///
    /// Panics unless `1 <= k <= n_expert` and `probs` is whole rows.
    pub fn select(&mut self, probs: &[f32], n_expert: usize, k: usize, normalize: bool) {
        assert!(
            k >= 1 && k <= n_expert && probs.len().is_multiple_of(n_expert),
            "route: shapes"
        );
        self.k = k;
        self.normalized = normalize;
        self.ids.clear();
        self.weights.clear();
        for row in probs.chunks(n_expert) {
            let start = self.ids.len();
            for _ in 0..k {
                let mut best: Option<usize> = None;
                for (e, &pr) in row.iter().enumerate() {
                    if self.ids[start..].contains(&(e as u32)) {
                        continue;
                    }
                    if best.is_none_or(|b| pr > row[b]) {
                        best = Some(e);
                    }
                }
                let e = best.expect("k <= n_expert");
                self.ids.push(e as u32);
                self.weights.push(row[e]);
            }
            if normalize {
                let sum: f32 = self.weights[start..].iter().sum();
                self.weights[start..].iter_mut().for_each(|w| *w /= sum);
            }
        }
    }

    /// Tokens routed.
    pub fn n_tok(&self) -> usize {
        self.ids.len().checked_div(self.k).unwrap_or(0)
    }
}

/// A batch's routing slots grouped by expert: for each expert the slots that chose it, in increasing slot order
/// (so a dispatch that walks experts in id order and their tokens in slot order adds in a fixed order, whatever
/// the batch). Built in one pass over the routing (a counting sort), reused between batches.
#[derive(Debug, Default, Clone)]
pub struct ExpertGroups {
    /// `starts[e]..starts[e + 1]` indexes `slots` for expert e.
    starts: Vec<u32>,
    slots: Vec<u32>,
}

impl ExpertGroups {
    /// Groups `routing`'s slots by expert, for experts `0..n_expert`.
    ///
    /// Panics if a routed id is `>= n_expert`.
    pub fn group(&mut self, routing: &Routing, n_expert: usize) {
        self.starts.clear();
        self.starts.resize(n_expert + 1, 0);
        for &id in &routing.ids {
            assert!((id as usize) < n_expert, "routed to expert {id} of {n_expert}");
            self.starts[id as usize + 1] += 1;
        }
        for e in 0..n_expert {
            self.starts[e + 1] += self.starts[e];
        }
        self.slots.clear();
        self.slots.resize(routing.ids.len(), 0);
        let mut next = self.starts[..n_expert].to_vec();
        for (slot, &id) in routing.ids.iter().enumerate() {
            let at = &mut next[id as usize];
            self.slots[*at as usize] = slot as u32;
            *at += 1;
        }
    }

    /// The routing slots that chose expert `e`, in increasing order (token `slot / k`).
    pub fn slots(&self, e: usize) -> &[u32] {
        &self.slots[self.starts[e] as usize..self.starts[e + 1] as usize]
    }

    /// Experts grouped over.
    pub fn n_expert(&self) -> usize {
        self.starts.len().saturating_sub(1)
    }

    /// Experts that at least one token chose, in id order.
    pub fn hit(&self) -> impl Iterator<Item = usize> + '_ {
        (0..self.n_expert()).filter(|&e| !self.slots(e).is_empty())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slot_layout_aligns_each_matrix() {
        assert_eq!(
            slot_layout([884_736, 884_736, 884_736]),
            ([0, 884_736, 1_769_472], 2_654_208)
        );
        assert_eq!(slot_layout([1, 300, 5]), ([0, 256, 768], 1024));
        assert_eq!(slot_layout([0, 0, 0]), ([0, 0, 0], 0));
    }

    #[test]
    fn top_k_takes_the_largest_with_ties_to_the_lower_id() {
        let mut r = Routing::default();
        r.select(&[0.1, 0.4, 0.1, 0.4, 0.7, 0.1, 0.1, 0.1], 4, 2, false);
        assert_eq!(r.ids, [1, 3, 0, 1]);
        assert_eq!(r.weights, [0.4, 0.4, 0.7, 0.1]);
        assert_eq!(r.n_tok(), 2);
        r.select(&[0.1, 0.3, 0.0, 0.1], 4, 2, true);
        assert_eq!(r.ids, [1, 0]);
        assert!((r.weights[0] - 0.75).abs() < 1e-7 && (r.weights[1] - 0.25).abs() < 1e-7);
    }

    #[test]
    fn groups_list_each_experts_slots_in_order() {
        let r = Routing {
            k: 2,
            ids: vec![2, 0, 0, 2, 3, 2],
            weights: vec![0.0; 6],
            normalized: false,
        };
        let mut g = ExpertGroups::default();
        g.group(&r, 5);
        assert_eq!(g.slots(0), [1, 2]);
        assert_eq!(g.slots(1), [] as [u32; 0]);
        assert_eq!(g.slots(2), [0, 3, 5]);
        assert_eq!(g.slots(3), [4]);
        assert_eq!(g.hit().collect::<Vec<_>>(), [0, 2, 3]);
        // The same answer as the quadratic scan it replaces, on a random routing.
        let mut seed = 7u64;
        let ids: Vec<u32> = (0..64 * 8)
            .map(|_| {
                seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                (seed >> 33) as u32 % 16
            })
            .collect();
        let r = Routing {
            k: 8,
            weights: vec![0.0; ids.len()],
            ids,
            normalized: false,
        };
        g.group(&r, 16);
        for e in 0..16u32 {
            let scan: Vec<u32> = (0..r.ids.len() as u32).filter(|&s| r.ids[s as usize] == e).collect();
            assert_eq!(g.slots(e as usize), scan);
        }
    }

    #[test]
    fn expert_rows_tile_the_stacked_tensors() {
        let s = ExpertShape {
            n_expert: 4,
            n_ff_exp: 3,
            n_embd: 5,
        };
        assert_eq!(s.gate_rows(0), 0..3);
        assert_eq!(s.gate_rows(3), 9..12);
        assert_eq!(s.down_rows(2), 10..15);
    }
}
