//! The expert cache's bookkeeping: which expert each of `N` slots holds, the slot table that maps (layer, expert)
//! to a slot (the table a device keeps a copy of, so a decode step that hits decides on the device), and the
//! eviction policy. The same code sizes nothing and moves no bytes: the CUDA backend copies experts into the slots
//! it names, and the simulator ([`super::simulate`]) replays routing traces through it.
//!
//! One pool of slots serves every layer. Policies (DESIGN.md section 3, "Expert cache"):
//! - [`Policy::Lru`]: evict the slot used longest ago.
//! - [`Policy::Lfru`]: evict the slot of lowest decayed use count: each use adds 1, and the count halves every
//!   `half_life` lookups, so an expert used often stays even when a burst of one-off experts passes (vLLM's LFRU
//!   proposal; with plain LRU the layers evict each other's experts in turn).
//! - [`Policy::Profile`]: the slots are filled once (from a routing profile) and never evicted; a miss is served
//!   around the cache.

use std::collections::BTreeSet;

use super::ExpertId;

/// How a full cache chooses the slot to give to a missing expert.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Policy {
    /// Least recently used.
    Lru,
    /// Least (exponentially decayed) frequently used: recency and frequency together.
    Lfru,
    /// Pinned from a routing profile: no eviction.
    Profile,
}

impl std::fmt::Display for Policy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Policy::Lru => "lru",
            Policy::Lfru => "lfru",
            Policy::Profile => "profile",
        })
    }
}

/// What [`SlotCache::access`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// The expert is in `slot`.
    Hit { slot: u32 },
    /// The expert was not cached and now owns `slot` (its bytes must be uploaded there); `evicted` is the expert
    /// that held the slot, if any.
    Admitted { slot: u32, evicted: Option<ExpertId> },
    /// Not cached, and not admitted (no slots, a pinned profile, or the caller's upload cap): the miss is served
    /// around the cache (computed where the expert lives).
    Bypassed,
}

/// Counts since the cache was made (or [`SlotCache::take_stats`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct CacheStats {
    pub lookups: u64,
    pub hits: u64,
    /// Misses given a slot (each one expert's bytes to upload).
    pub admitted: u64,
    /// Misses served around the cache.
    pub bypassed: u64,
    /// Admissions that took a slot from another expert.
    pub evictions: u64,
}

impl std::ops::AddAssign for CacheStats {
    fn add_assign(&mut self, c: CacheStats) {
        self.lookups += c.lookups;
        self.hits += c.hits;
        self.admitted += c.admitted;
        self.bypassed += c.bypassed;
        self.evictions += c.evictions;
    }
}

impl CacheStats {
    /// Hits over lookups, 0 when nothing was looked up.
    pub fn hit_rate(&self) -> f64 {
        if self.lookups == 0 {
            0.0
        } else {
            self.hits as f64 / self.lookups as f64
        }
    }
}

/// The slot-table value of an expert that no slot holds.
pub const NO_SLOT: i32 = -1;

/// `N` slots over `n_layer x n_expert` experts, with the slot table and the eviction order.
#[derive(Debug, Clone)]
pub struct SlotCache {
    n_expert: usize,
    policy: Policy,
    /// `[layer * n_expert + expert]`: the slot holding that expert, or [`NO_SLOT`].
    table: Vec<i32>,
    /// The expert each slot holds.
    owner: Vec<Option<ExpertId>>,
    /// Per slot, its eviction key (lowest goes first); `order` holds `(key, slot)` of every occupied slot.
    key: Vec<i64>,
    order: BTreeSet<(i64, u32)>,
    /// LFRU: per slot, whether its key holds a use count (false: just admitted, its first use not counted yet).
    counted: Vec<bool>,
    /// Slots never used yet, taken lowest first.
    free: Vec<u32>,
    /// Lookups so far: the clock of LRU and LFRU.
    clock: u64,
    /// LFRU: lookups for a use count to halve.
    half_life: f64,
    stats: CacheStats,
    /// `[layer * n_expert + expert]`: lookups of each expert since the cache was made (the profile it learns).
    uses: Vec<u64>,
}

/// Fixed-point scale of LFRU keys (keys are `i64` so the order is exact and total).
const KEY_SCALE: f64 = (1u64 << 24) as f64;

impl SlotCache {
    /// A cache of `slots` slots for a model of `n_layer` layers of `n_expert` experts each. LFRU's half-life is
    /// the number of lookups that fill the cache once (`slots`, at least 64).
    pub fn new(n_layer: usize, n_expert: usize, slots: usize, policy: Policy) -> SlotCache {
        let slots = slots.min(n_layer * n_expert);
        SlotCache {
            n_expert,
            policy,
            table: vec![NO_SLOT; n_layer * n_expert],
            owner: vec![None; slots],
            key: vec![0; slots],
            order: BTreeSet::new(),
            counted: vec![false; slots],
            free: (0..slots as u32).rev().collect(),
            clock: 0,
            half_life: slots.max(64) as f64,
            stats: CacheStats::default(),
            uses: vec![0; n_layer * n_expert],
        }
    }

    /// Slots in the cache.
    pub fn slots(&self) -> usize {
        self.owner.len()
    }

    pub fn policy(&self) -> Policy {
        self.policy
    }

    /// The slot table, `[layer * n_expert + expert]` -> slot or [`NO_SLOT`] (what the device's copy holds).
    pub fn table(&self) -> &[i32] {
        &self.table
    }

    /// The slot holding `id`, without counting a lookup.
    pub fn slot_of(&self, id: ExpertId) -> Option<u32> {
        let s = self.table[self.index(id)];
        (s != NO_SLOT).then_some(s as u32)
    }

    /// The expert in `slot`.
    pub fn owner(&self, slot: u32) -> Option<ExpertId> {
        self.owner[slot as usize]
    }

    pub fn stats(&self) -> CacheStats {
        self.stats
    }

    /// Lookups of each expert since the cache was made, `[layer * n_expert + expert]` (an expert profile's
    /// counts, [`super::profile::ExpertProfile`]); [`SlotCache::take_stats`] does not zero them.
    pub fn uses(&self) -> &[u64] {
        &self.uses
    }

    /// The counts so far, and zero them (per request or per phase).
    pub fn take_stats(&mut self) -> CacheStats {
        std::mem::take(&mut self.stats)
    }

    fn index(&self, id: ExpertId) -> usize {
        let i = id.layer as usize * self.n_expert + id.expert as usize;
        assert!(
            (id.expert as usize) < self.n_expert && i < self.table.len(),
            "expert {id:?} outside the model"
        );
        i
    }

    /// Looks `id` up for one use; on a miss, gives it a slot when `admit` is true and the policy allows (a free
    /// slot first, else the policy's victim). Counts the lookup and what happened.
    ///
    /// Panics if `id` is outside the model.
    pub fn access(&mut self, id: ExpertId, admit: bool) -> Access {
        let i = self.index(id);
        self.clock += 1;
        self.stats.lookups += 1;
        self.uses[i] += 1;
        let s = self.table[i];
        if s != NO_SLOT {
            self.stats.hits += 1;
            self.touch(s as u32);
            return Access::Hit { slot: s as u32 };
        }
        if !admit || self.slots() == 0 || (self.policy == Policy::Profile && self.free.is_empty()) {
            self.stats.bypassed += 1;
            return Access::Bypassed;
        }
        let (slot, evicted) = match self.free.pop() {
            Some(slot) => (slot, None),
            None => {
                let (_, slot) = self.order.pop_first().expect("a full cache has occupied slots");
                let old = self.owner[slot as usize].take().expect("an ordered slot is occupied");
                let oi = self.index(old);
                self.table[oi] = NO_SLOT;
                self.stats.evictions += 1;
                (slot, Some(old))
            }
        };
        self.place(slot, id, i);
        Access::Admitted { slot, evicted }
    }

    /// Whether a slot was never used yet (an admission now evicts nothing).
    pub fn has_free_slot(&self) -> bool {
        !self.free.is_empty()
    }

    /// The expert an admission would evict now: `None` when a slot is free, the cache has no slots, or the
    /// policy never evicts. A caller that is using that expert in the same step refuses the admission
    /// (`access(id, false)`), so a slot is never overwritten while a launch may still read it.
    pub fn would_evict(&self) -> Option<ExpertId> {
        if !self.free.is_empty() || self.policy == Policy::Profile {
            return None;
        }
        let &(_, slot) = self.order.first()?;
        self.owner[slot as usize]
    }

    /// Frees slots until `n` are free (or no slot is occupied), evicting the policy's victims in order (counted as
    /// evictions): what a device that admits misses on its own takes its slots from ([`SlotCache::free_slots`]).
    /// Returns the experts evicted. A profile cache evicts nothing.
    pub fn reserve_free(&mut self, n: usize) -> Vec<ExpertId> {
        let mut evicted = Vec::new();
        if self.policy == Policy::Profile {
            return evicted;
        }
        while self.free.len() < n.min(self.slots()) {
            let Some((_, slot)) = self.order.pop_first() else { break };
            let old = self.owner[slot as usize].take().expect("an ordered slot is occupied");
            let oi = self.index(old);
            self.table[oi] = NO_SLOT;
            self.stats.evictions += 1;
            self.free.push(slot);
            evicted.push(old);
        }
        evicted
    }

    /// The free slots in the order admissions take them (the next admission takes the first).
    pub fn free_slots(&self) -> impl Iterator<Item = u32> + '_ {
        self.free.iter().rev().copied()
    }

    /// Applies what a device decided on its own copy of the table (the CUDA backend's `expert_lookup`), one
    /// lookup at a time in the device's order: `(id, seen)` where `seen` is what the device found and did. The
    /// device admits only into free slots, in [`SlotCache::free_slots`]' order, so replaying its lookups here
    /// must give the same slots; each lookup is counted as [`SlotCache::access`] counts it.
    ///
    /// Errors: the first lookup whose outcome here differs from the device's, naming both (the two tables
    /// diverged: a bug, after which neither can be trusted).
    pub fn replay(&mut self, id: ExpertId, seen: Access) -> Result<(), String> {
        let admit = matches!(seen, Access::Admitted { .. });
        if admit && self.free.is_empty() {
            return Err(format!("the device admitted {id:?} with no slot free here"));
        }
        let here = self.access(id, admit);
        if here == seen {
            Ok(())
        } else {
            Err(format!("lookup of {id:?}: the device saw {seen:?}, the host {here:?}"))
        }
    }

    /// Puts `id` in a free slot without counting a lookup (pre-filling from a profile; the upload counts as
    /// `admitted`). Returns its slot, or `None` when no slot is free or it is already cached.
    pub fn pin(&mut self, id: ExpertId) -> Option<u32> {
        let i = self.index(id);
        if self.table[i] != NO_SLOT {
            return None;
        }
        let slot = self.free.pop()?;
        self.place(slot, id, i);
        Some(slot)
    }

    /// Pre-fills free slots from a profile's ranking (most used first, [`super::profile::ExpertProfile::ranked`]):
    /// the first experts that fit, pinned least used first, so that under LRU, where nothing was used yet, the
    /// least used of them is the first evicted. Returns each placed expert and its slot, in placement order (the
    /// bytes to upload); experts already cached are skipped.
    pub fn prefill(&mut self, ranked: &[ExpertId]) -> Vec<(ExpertId, u32)> {
        let mut take: Vec<ExpertId> = Vec::new();
        for &id in ranked {
            if take.len() == self.free.len() {
                break;
            }
            if self.slot_of(id).is_none() && !take.contains(&id) {
                take.push(id);
            }
        }
        take.into_iter()
            .rev()
            .filter_map(|id| self.pin(id).map(|slot| (id, slot)))
            .collect()
    }

    /// Gives `slot` to `id` (table index `i`) and counts the upload.
    fn place(&mut self, slot: u32, id: ExpertId, i: usize) {
        self.owner[slot as usize] = Some(id);
        self.table[i] = slot as i32;
        self.counted[slot as usize] = false;
        self.stats.admitted += 1;
        self.touch(slot);
    }

    /// Records a use of `slot` at the current clock and re-keys it.
    fn touch(&mut self, slot: u32) {
        let s = slot as usize;
        let key = match self.policy {
            Policy::Lru | Policy::Profile => self.clock as i64,
            Policy::Lfru => self.lfru_key(s),
        };
        self.order.remove(&(self.key[s], slot));
        self.key[s] = key;
        self.order.insert((key, slot));
    }

    /// LFRU's key of a slot used now. With count `c` last updated at time `t`, its value at time `now` is
    /// `c * 2^(-(now - t) / h)`, so `log2(c) + t / h` orders the slots the same way at every `now`: the key never
    /// needs updating between uses. A use adds 1 to the decayed count.
    fn lfru_key(&mut self, s: usize) -> i64 {
        let now = self.clock as f64 / self.half_life;
        // log2 of the decayed count before this use, at `now` (none for an expert just admitted).
        let before = if self.counted[s] {
            (self.key[s] as f64 / KEY_SCALE - now).exp2()
        } else {
            0.0
        };
        self.counted[s] = true;
        (((1.0 + before).log2() + now) * KEY_SCALE) as i64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(layer: u32, expert: u32) -> ExpertId {
        ExpertId { layer, expert }
    }

    /// Hits of a sequence of `(layer, expert)` accesses through a fresh cache.
    fn hits(policy: Policy, slots: usize, seq: &[(u32, u32)]) -> Vec<bool> {
        let mut c = SlotCache::new(2, 8, slots, policy);
        seq.iter()
            .map(|&(l, e)| matches!(c.access(id(l, e), true), Access::Hit { .. }))
            .collect()
    }

    #[test]
    fn lru_evicts_the_least_recently_used() {
        // Slots 2: a b a c b -> miss miss hit miss(evicts b) miss(evicts a).
        let seq = [(0, 1), (0, 2), (0, 1), (0, 3), (0, 2)];
        assert_eq!(hits(Policy::Lru, 2, &seq), [false, false, true, false, false]);
        let mut c = SlotCache::new(2, 8, 2, Policy::Lru);
        for &(l, e) in &seq[..4] {
            c.access(id(l, e), true);
        }
        assert_eq!(c.slot_of(id(0, 2)), None);
        assert!(c.slot_of(id(0, 1)).is_some() && c.slot_of(id(0, 3)).is_some());
        let s = c.stats();
        assert_eq!((s.lookups, s.hits, s.admitted, s.evictions), (4, 1, 3, 1));
    }

    #[test]
    fn the_table_names_exactly_the_cached_experts() {
        let mut c = SlotCache::new(2, 8, 3, Policy::Lru);
        for (l, e) in [(0, 1), (1, 1), (0, 5), (1, 7), (0, 1), (1, 2)] {
            c.access(id(l, e), true);
        }
        let mut held = 0;
        for (i, &s) in c.table().iter().enumerate() {
            if s != NO_SLOT {
                held += 1;
                assert_eq!(c.owner(s as u32), Some(id((i / 8) as u32, (i % 8) as u32)));
            }
        }
        assert_eq!(held, 3);
    }

    #[test]
    fn lfru_keeps_a_frequent_expert_through_a_burst_that_lru_lets_evict_it() {
        // Expert (0,0) used 6 times, then three one-off experts pass through 2 slots, then (0,0) again.
        let mut seq = vec![(0, 0); 6];
        seq.extend([(0, 1), (0, 2), (0, 3), (0, 0)]);
        assert!(!hits(Policy::Lru, 2, &seq)[9], "LRU evicted it");
        assert!(hits(Policy::Lfru, 2, &seq)[9], "LFRU kept it");
    }

    #[test]
    fn a_profile_cache_never_evicts_and_bypasses_misses() {
        let mut c = SlotCache::new(2, 8, 2, Policy::Profile);
        assert_eq!(c.pin(id(0, 4)), Some(0));
        assert_eq!(c.pin(id(1, 4)), Some(1));
        assert_eq!(c.pin(id(1, 5)), None);
        assert_eq!(c.access(id(1, 5), true), Access::Bypassed);
        assert_eq!(c.access(id(0, 4), true), Access::Hit { slot: 0 });
        assert_eq!(c.stats().bypassed, 1);
    }

    #[test]
    fn a_prefill_pins_the_top_of_a_ranking_and_lru_evicts_its_least_used_first() {
        let mut c = SlotCache::new(2, 8, 3, Policy::Lru);
        let ranked = [id(1, 7), id(0, 2), id(0, 5), id(1, 1)];
        let placed = c.prefill(&ranked);
        assert_eq!(placed, vec![(id(0, 5), 0), (id(0, 2), 1), (id(1, 7), 2)]);
        assert_eq!(c.stats().lookups, 0);
        assert_eq!(c.uses().iter().sum::<u64>(), 0);
        assert_eq!(c.access(id(1, 7), true), Access::Hit { slot: 2 });
        // Full: the first miss evicts the least used of the profile's experts.
        assert_eq!(
            c.access(id(1, 1), true),
            Access::Admitted {
                slot: 0,
                evicted: Some(id(0, 5))
            }
        );
        // Every lookup counts towards the learned profile; a prefill of a full cache places nothing.
        assert_eq!(c.uses()[8 + 7], 1);
        assert_eq!(c.uses()[8 + 1], 1);
        assert_eq!(c.uses().iter().sum::<u64>(), 2);
        assert!(c.prefill(&[id(0, 0)]).is_empty());
    }

    #[test]
    fn would_evict_names_the_victim_the_next_admission_takes() {
        let mut c = SlotCache::new(2, 8, 2, Policy::Lru);
        assert_eq!(c.would_evict(), None);
        c.access(id(0, 1), true);
        assert!(c.has_free_slot() && c.would_evict().is_none());
        c.access(id(1, 2), true);
        assert!(!c.has_free_slot());
        assert_eq!(c.would_evict(), Some(id(0, 1)));
        c.access(id(0, 1), true);
        assert_eq!(c.would_evict(), Some(id(1, 2)));
        assert_eq!(
            c.access(id(0, 3), true),
            Access::Admitted {
                slot: 1,
                evicted: Some(id(1, 2))
            }
        );
        let mut p = SlotCache::new(2, 8, 1, Policy::Profile);
        p.pin(id(0, 0));
        assert_eq!(p.would_evict(), None);
    }

    #[test]
    fn no_slots_or_no_admission_bypass() {
        let mut c = SlotCache::new(2, 8, 0, Policy::Lru);
        assert_eq!(c.access(id(0, 0), true), Access::Bypassed);
        let mut c = SlotCache::new(2, 8, 4, Policy::Lru);
        assert_eq!(c.access(id(0, 0), false), Access::Bypassed);
        assert_eq!(c.slot_of(id(0, 0)), None);
    }

    #[test]
    fn reserved_slots_are_the_policys_victims_and_admissions_take_them_in_order() {
        let mut c = SlotCache::new(2, 8, 3, Policy::Lru);
        for e in [1, 2, 3] {
            c.access(id(0, e), true);
        }
        c.access(id(0, 1), true);
        // LRU order now: 2, 3, 1. Two free slots evict 2 then 3.
        assert_eq!(c.reserve_free(2), vec![id(0, 2), id(0, 3)]);
        assert_eq!(c.slot_of(id(0, 2)), None);
        let free: Vec<u32> = c.free_slots().collect();
        assert_eq!(free.len(), 2);
        // The next admission takes the first free slot named, the one after the second.
        for &want in &free {
            match c.access(id(1, want + 4), true) {
                Access::Admitted { slot, evicted: None } => assert_eq!(slot, want),
                other => panic!("{other:?}"),
            }
        }
        assert_eq!(c.stats().evictions, 2);
        // A prefetch's placement (`pin`, no lookup counted) takes the free slots in the same order, between
        // admissions: the order the device's expert_prefetch and expert_lookup take them from one list.
        let mut d = SlotCache::new(2, 8, 4, Policy::Lru);
        let order: Vec<u32> = d.free_slots().collect();
        let before = d.stats().lookups;
        assert_eq!(d.pin(id(1, 0)), Some(order[0]));
        assert!(matches!(d.access(id(0, 3), true), Access::Admitted { slot, .. } if slot == order[1]));
        assert_eq!(d.pin(id(1, 5)), Some(order[2]));
        assert_eq!(d.pin(id(1, 5)), None, "cached already");
        assert_eq!(d.stats().lookups, before + 1);
        // The prefetched expert is then a hit of its layer's lookup.
        assert_eq!(d.access(id(1, 0), true), Access::Hit { slot: order[0] });
        // Never more than the slots; a profile cache reserves nothing.
        assert_eq!(c.reserve_free(10).len(), 3);
        assert!(c.reserve_free(10).is_empty());
        let mut p = SlotCache::new(2, 8, 2, Policy::Profile);
        p.pin(id(0, 0));
        assert!(p.reserve_free(2).is_empty());
    }

    #[test]
    fn a_replayed_device_log_gives_the_hosts_counts_and_refuses_a_divergence() {
        // The device's view of a step: (0,1) hit in the slot the host gave it, (0,5) admitted into the first free
        // slot, (0,6) staged (no slot left).
        let mut host = SlotCache::new(2, 8, 2, Policy::Lru);
        let Access::Admitted { slot: s1, .. } = host.access(id(0, 1), true) else {
            panic!()
        };
        let first_free = host.free_slots().next().expect("one free");
        let mut dev = host.clone();
        host.take_stats();
        host.replay(id(0, 1), Access::Hit { slot: s1 }).expect("hit");
        host.replay(
            id(0, 5),
            Access::Admitted {
                slot: first_free,
                evicted: None,
            },
        )
        .expect("admitted");
        host.replay(id(0, 6), Access::Bypassed).expect("staged");
        let s = host.stats();
        assert_eq!((s.lookups, s.hits, s.admitted, s.bypassed), (3, 1, 1, 1));
        assert_eq!(host.slot_of(id(0, 5)), Some(first_free));
        // A device that claims a hit the host does not have, or an admission with no free slot, is refused.
        assert!(dev.replay(id(1, 3), Access::Hit { slot: 0 }).is_err());
        dev.access(id(1, 4), true);
        assert!(
            dev.replay(id(1, 7), Access::Admitted { slot: 0, evicted: None })
                .is_err()
        );
    }
}
