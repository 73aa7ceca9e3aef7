//! Where an expert that misses the VRAM cache is computed at decode (DESIGN.md section 3, "Expert cache": "a miss
//! is uploaded over PCIe on a copy stream or computed by the CPU while the GPU computes the hits; a cost model
//! picks, from the link and CPU rates measured at start").
//!
//! A decode step's layer has `n` missing experts, each `B` bytes (gate, up and down). Uploading `u` of them keeps
//! the link busy `u * B / link` before the GPU can compute them; the CPU computes the other `n - u` from host
//! memory in `fixed + (n - u) * B / cpu`, while the GPU works on the hits and the uploaded ones. The two sides run
//! at once, so a layer costs about the larger of the two. [`MissCost::cpu_count`] picks the `n - u` that makes it
//! smallest (ties go to the link: an uploaded expert also enters the cache, a CPU-computed one does not).
//!
//! At decode the weights dominate: a token's expert reads `B` bytes and does `2 * B * (values per byte)` flops,
//! so both sides are bandwidth-bound and the rates are bytes per second (measured at start by the engine: the
//! link with a copy from the expert store's memory, the CPU by computing a layer's experts from it).

/// `--miss-policy`: where a decode step's expert misses are computed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum MissPolicy {
    /// Upload every miss into a cache or staging slot (results bit-identical to the all-resident run).
    Upload,
    /// The CPU computes every miss; the cache only keeps what prefill put in it.
    Cpu,
    /// A cost model splits each layer's misses between the link and the CPU, by the rates measured at start.
    #[default]
    Auto,
}

impl std::fmt::Display for MissPolicy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            MissPolicy::Upload => "upload",
            MissPolicy::Cpu => "cpu",
            MissPolicy::Auto => "auto",
        })
    }
}

/// The rates the cost model weighs, measured at start.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MissCost {
    /// Host-to-device copy rate from the expert store's memory, bytes per second.
    pub link_bytes_s: f64,
    /// Rate at which the CPU computes experts at decode (weight bytes read per second, all threads).
    pub cpu_bytes_s: f64,
    /// Seconds the CPU's computation costs once per layer-step that computes any miss, beyond its bytes: waking
    /// the threads, the passes' barriers and tails.
    pub cpu_fixed_s: f64,
    /// Seconds the path adds once per layer-step that gives the CPU any miss: on the host's path, reading the
    /// activations back and uploading the rows; on the device's table with the CPU joining it, the mapped
    /// memory's round trip ([`MissCost::joined`]).
    pub copies_s: f64,
}

/// The decision for one layer-step: how many of its misses the CPU computes, given the policy.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MissPlan {
    pub policy: MissPolicy,
    /// The measured rates (`auto` needs them; `upload` and `cpu` ignore them).
    pub cost: Option<MissCost>,
}

impl Default for MissPlan {
    /// Every miss uploaded: what a backend does until the engine has measured the rates.
    fn default() -> MissPlan {
        MissPlan {
            policy: MissPolicy::Upload,
            cost: None,
        }
    }
}

impl MissPlan {
    /// This plan with its cost [`MissCost::joined`] (the device's table with the CPU joining it).
    pub fn joined(self, round_trip_s: f64) -> MissPlan {
        MissPlan {
            cost: self.cost.map(|c| c.joined(round_trip_s)),
            ..self
        }
    }

    /// Of `misses` missing experts of `expert_bytes` each, one token each, how many the CPU computes (the rest are
    /// uploaded).
    pub fn cpu_count(&self, misses: usize, expert_bytes: u64) -> usize {
        self.cpu_take(&vec![1; misses], expert_bytes)
    }

    /// How many of a layer-step's missing experts the CPU computes, taking them in the order given:
    /// `tokens[i]` is how many of the step's tokens chose the i-th (the CPU computes an expert once per token;
    /// the link carries it once).
    pub fn cpu_take(&self, tokens: &[usize], expert_bytes: u64) -> usize {
        match (self.policy, self.cost) {
            (MissPolicy::Upload, _) | (MissPolicy::Auto, None) => 0,
            (MissPolicy::Cpu, _) => tokens.len(),
            (MissPolicy::Auto, Some(c)) => c.cpu_take(tokens, expert_bytes),
        }
    }
}

impl MissCost {
    /// Seconds a layer-step takes when the CPU computes the first `cpu` of the missing experts (`tokens[i]`
    /// tokens each; `bytes` each) and the link carries the rest: the slower of the two sides.
    pub fn seconds(&self, tokens: &[usize], cpu: usize, bytes: u64) -> f64 {
        assert!(cpu <= tokens.len(), "{cpu} of {} misses", tokens.len());
        let link = (tokens.len() - cpu) as f64 * bytes as f64 / self.link_bytes_s;
        let host = if cpu == 0 {
            0.0
        } else {
            let jobs: usize = tokens[..cpu].iter().sum();
            self.cpu_fixed_s + self.copies_s + jobs as f64 * bytes as f64 / self.cpu_bytes_s
        };
        link.max(host)
    }

    /// How many of the missing experts (taken in order; `tokens[i]` tokens each, `bytes` each) the CPU should
    /// compute: the count that makes [`MissCost::seconds`] smallest, the fewest on a tie. A rate that is not a
    /// positive finite number leaves that side out (a probe that failed, or read an impossible value, is never
    /// used).
    pub fn cpu_take(&self, tokens: &[usize], bytes: u64) -> usize {
        let ok = |r: f64| r.is_finite() && r > 0.0;
        match (ok(self.link_bytes_s), ok(self.cpu_bytes_s)) {
            (true, false) | (false, false) => return 0,
            (false, true) => return tokens.len(),
            (true, true) => {}
        }
        let mut best = (0, self.seconds(tokens, 0, bytes));
        for cpu in 1..=tokens.len() {
            let t = self.seconds(tokens, cpu, bytes);
            if t < best.1 {
                best = (cpu, t);
            }
        }
        best.0
    }

    /// The cost when the CPU joins the device's slot table: the activations and rows cross through mapped memory
    /// inside the step, a round trip of `round_trip_s` seconds instead of the host path's copies.
    pub fn joined(self, round_trip_s: f64) -> MissCost {
        MissCost {
            copies_s: round_trip_s,
            ..self
        }
    }

    /// [`MissCost::cpu_take`] for `misses` experts of one token each.
    pub fn cpu_count(&self, misses: usize, bytes: u64) -> usize {
        self.cpu_take(&vec![1; misses], bytes)
    }
}

/// How a decode step of one token decides its experts, when its experts are in a mapped page-locked arena.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DecodePath {
    /// On the device's copy of the slot table, inside the step's CUDA graph: the misses are copied in over the
    /// link, or, when the CPU joins the table (the CUDA backend's `join`), split between the link and the CPU by
    /// the [`MissPlan`] on the device.
    Device,
    /// On the host, layer by layer (a round trip each): the misses are split between the link and the CPU by the
    /// [`MissPlan`].
    Host,
    /// [`DecodePath::Device`], and each MoE layer's next layer prefetched: its router applied to this layer's
    /// input, the experts it picks that are not cached copied in beside the rest of the step (`--expert-prefetch`).
    DevicePrefetch,
}

impl DecodePath {
    /// Whether the step decides its experts on the device's table.
    pub fn on_device(self) -> bool {
        self != DecodePath::Host
    }

    /// How the log names the path.
    pub fn describe(self, cpu_joins: bool) -> &'static str {
        match (self, cpu_joins) {
            (DecodePath::Host, _) => "on the host, the CPU computing misses beside the link",
            (DecodePath::Device, true) => {
                "on the device's slot table, the CPU computing its share of misses inside the graph"
            }
            (DecodePath::Device, false) => "on the device's slot table, every miss uploaded",
            (DecodePath::DevicePrefetch, true) => {
                "on the device's slot table with the next layer's experts prefetched, the CPU computing its share of misses inside the graph"
            }
            (DecodePath::DevicePrefetch, false) => {
                "on the device's slot table with the next layer's experts prefetched, every miss uploaded"
            }
        }
    }
}

/// `--miss-policy auto`'s choice among the [`DecodePath`]s, by their measured step times: the device's table
/// saves a host round trip per layer, the host's lets the CPU compute misses beside the link, the prefetch fills
/// the link while attention runs but costs launches and link time when it guesses wrong; which wins depends on how
/// often experts miss (routing locality, cache size), on the router and on the machine. Each round runs
/// [`PathChooser::EXPLORE`] steps on the device's table unmeasured (a warm-up: after a prompt, or after the host's
/// path, the cache's contents and the step's CUDA graph settle), then that many measured on each path in turn
/// (the host's first not counted: it drops the graph; the prefetch's first half not counted: its graph is recorded
/// anew and the cache settles), then the fastest by median for [`PathChooser::EXPLOIT`] steps.
#[derive(Debug, Clone)]
pub struct PathChooser {
    /// The paths measured, in the order a round runs them, each with the steps of its run not counted, then
    /// those counted.
    arms: Vec<(DecodePath, usize, usize)>,
    /// Measured step times of the current round, seconds, per arm.
    times: Vec<Vec<f64>>,
    /// Steps handed out in the current round.
    steps: usize,
    /// The path chosen by the last round, once there was one.
    chosen: Option<DecodePath>,
    /// The arm of the last step handed out, if its time counts.
    counted: Option<usize>,
    /// The last round's median step time of each path that had a reading, seconds.
    medians: Vec<(DecodePath, f64)>,
}

impl Default for PathChooser {
    /// Between the device's table and the host's path.
    fn default() -> PathChooser {
        PathChooser::new(false)
    }
}

impl PathChooser {
    /// Steps of each path measured per round (some of the first not counted).
    pub const EXPLORE: usize = 8;
    /// Steps on the chosen path before measuring again.
    pub const EXPLOIT: usize = 512;

    /// A chooser between the device's table and the host's path, and, with `prefetch`, the device's table with
    /// the next layer prefetched.
    pub fn new(prefetch: bool) -> PathChooser {
        let e = Self::EXPLORE;
        let mut arms = vec![(DecodePath::Device, e, e), (DecodePath::Host, 1, e - 1)];
        if prefetch {
            arms.push((DecodePath::DevicePrefetch, e / 2, e));
        }
        PathChooser {
            times: vec![Vec::new(); arms.len()],
            arms,
            steps: 0,
            chosen: None,
            counted: None,
            medians: Vec::new(),
        }
    }

    /// Steps of a round before the choice: each arm's uncounted and counted steps.
    fn explore_steps(&self) -> usize {
        self.arms.iter().map(|&(_, warm, counted)| warm + counted).sum()
    }

    /// The path of the next step.
    pub fn next(&mut self) -> DecodePath {
        let s = self.steps;
        self.steps += 1;
        let explore = self.explore_steps();
        let mut first = 0;
        for (i, &(path, warm, counted)) in self.arms.iter().enumerate() {
            let run = warm + counted;
            if s < first + run {
                self.counted = (s >= first + warm).then_some(i);
                return path;
            }
            first += run;
        }
        if s == explore {
            self.choose();
        }
        if s + 1 >= explore + Self::EXPLOIT {
            self.steps = 0;
        }
        self.counted = None;
        self.chosen.unwrap_or(DecodePath::Device)
    }

    /// The step [`PathChooser::next`] handed out last took `seconds` (its device time). Warm-up steps, the chosen
    /// path's steps, and a reading that is not a positive finite number are not counted.
    pub fn record(&mut self, seconds: f64) {
        if !(seconds.is_finite() && seconds > 0.0) {
            return;
        }
        if let Some(i) = self.counted.take() {
            self.times[i].push(seconds);
        }
    }

    /// A step that is not a decode step of one token ran (a prompt): what the current round measured so far
    /// was measured on another cache, so a round still measuring starts over, warm-up included. The chosen path
    /// stays.
    pub fn interrupt(&mut self) {
        if self.steps < self.explore_steps() {
            self.steps = 0;
            self.times.iter_mut().for_each(Vec::clear);
            self.counted = None;
        }
    }

    /// The path the last round chose (`None` before the first round ended).
    pub fn chosen(&self) -> Option<DecodePath> {
        self.chosen
    }

    /// The last round's median step time of each path that had a reading, seconds, in the round's order.
    pub fn medians(&self) -> &[(DecodePath, f64)] {
        &self.medians
    }

    /// Ends a round: the path of the lowest median step time (the device's table when it has no reading, and
    /// the earlier arm on a tie).
    fn choose(&mut self) {
        self.medians = self
            .arms
            .iter()
            .zip(&mut self.times)
            .filter_map(|(&(path, _, _), v)| {
                v.sort_by(f64::total_cmp);
                v.get(v.len() / 2).map(|&m| (path, m))
            })
            .collect();
        let device_measured = self.medians.iter().any(|&(p, _)| p == DecodePath::Device);
        self.chosen = Some(if device_measured {
            self.medians
                .iter()
                .fold(None, |best: Option<(DecodePath, f64)>, &(p, m)| match best {
                    Some((_, b)) if b <= m => best,
                    _ => Some((p, m)),
                })
                .map_or(DecodePath::Device, |(p, _)| p)
        } else {
            DecodePath::Device
        });
        self.times.iter_mut().for_each(Vec::clear);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs `n` steps through `c`, each path taking the time `time` gives it; returns the paths handed out.
    fn run(c: &mut PathChooser, n: usize, mut time: impl FnMut(DecodePath) -> f64) -> Vec<DecodePath> {
        (0..n)
            .map(|_| {
                let p = c.next();
                c.record(time(p));
                p
            })
            .collect()
    }

    #[test]
    fn the_chooser_measures_both_paths_then_keeps_the_faster_and_measures_again() {
        let e = PathChooser::EXPLORE;
        for (device_s, host_s, want) in [(5e-3, 10e-3, DecodePath::Device), (12e-3, 10e-3, DecodePath::Host)] {
            let mut c = PathChooser::default();
            let time = |p| if p == DecodePath::Device { device_s } else { host_s };
            let paths = run(&mut c, 3 * e + PathChooser::EXPLOIT, time);
            assert!(paths[..2 * e].iter().all(|&p| p == DecodePath::Device));
            assert!(paths[2 * e..3 * e].iter().all(|&p| p == DecodePath::Host));
            assert!(paths[3 * e..].iter().all(|&p| p == want), "{device_s} vs {host_s}");
            assert_eq!(c.chosen(), Some(want));
            assert_eq!(
                c.medians(),
                [(DecodePath::Device, device_s), (DecodePath::Host, host_s)]
            );
            // The next round measures both again, and follows a change.
            let paths = run(&mut c, 3 * e + 1, |p| if p == want { 1.0 } else { 1e-3 });
            assert_eq!(paths[0], DecodePath::Device);
            assert_eq!(paths[2 * e], DecodePath::Host);
            assert_ne!(paths[3 * e], want);
        }
    }

    #[test]
    fn with_the_prefetch_the_chooser_measures_three_paths_and_keeps_the_fastest() {
        let e = PathChooser::EXPLORE;
        for (prefetch_s, want) in [(4e-3, DecodePath::DevicePrefetch), (6e-3, DecodePath::Device)] {
            let mut c = PathChooser::new(true);
            let time = |p| match p {
                DecodePath::Device => 5e-3,
                DecodePath::Host => 10e-3,
                DecodePath::DevicePrefetch => prefetch_s,
            };
            // The device's warm-up and run (2 e), the host's (e), then the prefetch's (e / 2 + e).
            let explore = 3 * e + e / 2 + e;
            let paths = run(&mut c, explore + 4, time);
            assert!(paths[..2 * e].iter().all(|&p| p == DecodePath::Device));
            assert!(paths[2 * e..3 * e].iter().all(|&p| p == DecodePath::Host));
            assert!(paths[3 * e..explore].iter().all(|&p| p == DecodePath::DevicePrefetch));
            assert!(paths[explore..].iter().all(|&p| p == want), "prefetch {prefetch_s}");
            assert_eq!(
                c.medians(),
                [
                    (DecodePath::Device, 5e-3),
                    (DecodePath::Host, 10e-3),
                    (DecodePath::DevicePrefetch, prefetch_s)
                ]
            );
        }
        // Without the prefetch the round has two paths, and never hands the prefetch out.
        let mut c = PathChooser::new(false);
        let paths = run(&mut c, 3 * e + PathChooser::EXPLOIT, |_| 1e-3);
        assert!(!paths.contains(&DecodePath::DevicePrefetch));
        assert!(DecodePath::DevicePrefetch.on_device() && !DecodePath::Host.on_device());
    }

    #[test]
    fn a_prompt_while_measuring_restarts_the_round_but_not_while_exploiting() {
        let e = PathChooser::EXPLORE;
        let mut c = PathChooser::default();
        // Half-way through the host's measured run, a prompt: the round starts over from the warm-up.
        let paths = run(&mut c, 2 * e + 3, |_| 1.0);
        assert_eq!(paths[2 * e + 2], DecodePath::Host);
        c.interrupt();
        let paths = run(&mut c, 3 * e + 1, |p| if p == DecodePath::Host { 1.0 } else { 2.0 });
        assert!(paths[..2 * e].iter().all(|&p| p == DecodePath::Device));
        assert_eq!(paths[3 * e], DecodePath::Host);
        assert_eq!(c.medians(), [(DecodePath::Device, 2.0), (DecodePath::Host, 1.0)]);
        // While exploiting, a prompt changes nothing.
        c.interrupt();
        assert_eq!(c.next(), DecodePath::Host);
    }

    #[test]
    fn warm_ups_and_impossible_readings_do_not_count() {
        let e = PathChooser::EXPLORE;
        let mut c = PathChooser::default();
        // The device's warm-up run is slow (a cold cache after a prompt), and so is the host's first step (it
        // drops the graph), but the host's would win on them alone.
        let mut n = 0;
        let paths = run(&mut c, 3 * e + 1, |p| {
            n += 1;
            match p {
                DecodePath::Device if n <= e => 100.0,
                DecodePath::Device => 2.0,
                DecodePath::Host if n == 2 * e + 1 => 0.5,
                DecodePath::Host => 3.0,
                DecodePath::DevicePrefetch => unreachable!("no prefetch arm"),
            }
        });
        assert_eq!(paths[3 * e], DecodePath::Device);
        assert_eq!(c.medians(), [(DecodePath::Device, 2.0), (DecodePath::Host, 3.0)]);
        // No reading of the device's table, only the host's: the device's table still.
        let mut c = PathChooser::default();
        let paths = run(
            &mut c,
            3 * e + 1,
            |p| if p == DecodePath::Host { 1.0 } else { f64::NAN },
        );
        assert_eq!(paths[3 * e], DecodePath::Device);
        assert_eq!(c.medians(), [(DecodePath::Host, 1.0)]);
        // No reading at all: the device's table.
        let mut c = PathChooser::default();
        let paths = run(&mut c, 3 * e + 1, |_| f64::NAN);
        assert_eq!(paths[3 * e], DecodePath::Device);
        assert!(c.medians().is_empty());
    }

    const MB: u64 = 1_000_000;

    fn cost(link_gb_s: f64, cpu_gb_s: f64, fixed_us: f64) -> MissCost {
        MissCost {
            link_bytes_s: link_gb_s * 1e9,
            cpu_bytes_s: cpu_gb_s * 1e9,
            cpu_fixed_s: fixed_us * 1e-6,
            copies_s: 0.0,
        }
    }

    #[test]
    fn equal_rates_split_the_misses_in_half() {
        // 8 misses of 2.5 MB (50 us each on either side), both sides at 50 GB/s, no fixed cost: 4 and 4 (200 us
        // each side); 3 or 5 on the CPU leaves one side with 5 experts (250 us).
        let c = cost(50.0, 50.0, 0.0);
        let one = [1; 8];
        assert_eq!(c.cpu_count(8, 2_500_000), 4);
        assert!((c.seconds(&one, 4, 2_500_000) - 200e-6).abs() < 1e-12);
        assert!((c.seconds(&one, 3, 2_500_000) - 250e-6).abs() < 1e-12);
    }

    #[test]
    fn the_split_follows_the_rates_computed_by_hand() {
        // Link 53 GB/s, CPU 40 GB/s, 40 us fixed, 8 misses of 2.65 MB (the Qwen3-30B-A3B shape at Q4_K):
        // u uploaded take u * 50.0 us; c on the CPU take 40 + c * 66.25 us. c = 3: max(250.0, 238.75) = 250.0;
        // c = 4: max(200.0, 305.0); c = 2: max(300.0, 172.5). So 3.
        let c = cost(53.0, 40.0, 40.0);
        assert_eq!(c.cpu_count(8, 2_650_000), 3);
        // A slow CPU (5 GB/s: 530 us an expert) is never worth it for one miss on a fast link (50 us).
        assert_eq!(cost(53.0, 5.0, 40.0).cpu_count(1, 2_650_000), 0);
        // Pageable memory (--mmap-experts: 7.7 GB/s) against a 40 GB/s CPU: the CPU takes most of them.
        // u = 1: max(344.2, 40 + 7 * 66.25 = 503.75); u = 2: max(688.3, 437.5) -> 1 upload, 7 on the CPU.
        assert_eq!(cost(7.7, 40.0, 40.0).cpu_count(8, 2_650_000), 7);
    }

    #[test]
    fn the_join_drops_the_host_paths_copies_from_the_split() {
        // Link 53 GB/s, CPU 40 GB/s, 10 us fixed plus 30 us of the host path's copies, 8 misses of 2.65 MB: on the
        // host's path it is the 40 us case above (3 on the CPU). Joined with no round trip, c on the CPU take
        // 10 + c * 66.25 us:
        // c = 3: max(250.0, 208.75) = 250.0; c = 4: max(200.0, 275.0) = 275.0. Still 3; with 2 misses, host:
        // c = 1: max(50, 106.25) vs c = 0: 100 -> 0; joined: c = 1: max(50, 76.25) = 76.25 -> 1.
        let c = MissCost {
            copies_s: 30e-6,
            ..cost(53.0, 40.0, 10.0)
        };
        assert_eq!(
            (c.cpu_count(8, 2_650_000), c.joined(0.0).cpu_count(8, 2_650_000)),
            (3, 3)
        );
        assert_eq!(
            (c.cpu_count(2, 2_650_000), c.joined(0.0).cpu_count(2, 2_650_000)),
            (0, 1)
        );
        // A 30 us round trip is the host's path again.
        assert_eq!(c.joined(30e-6).cpu_count(2, 2_650_000), 0);
        let plan = MissPlan {
            policy: MissPolicy::Auto,
            cost: Some(c),
        };
        assert_eq!(plan.joined(5e-6).cost, Some(c.joined(5e-6)));
        assert_eq!(c.joined(5e-6).copies_s, 5e-6);
    }

    #[test]
    fn the_choice_is_the_fastest_split() {
        for link in [1.0, 7.7, 25.0, 53.0, 200.0] {
            for cpu in [0.5, 5.0, 40.0, 73.0, 400.0] {
                for fixed in [0.0, 40.0, 1000.0] {
                    let c = cost(link, cpu, fixed);
                    for n in 0..=16 {
                        // One token per expert, and a step of 4 tokens where some experts serve more.
                        let many: Vec<usize> = (0..n).map(|i| 1 + (i % 4)).collect();
                        for tokens in [vec![1; n], many] {
                            let k = c.cpu_take(&tokens, 3 * MB);
                            let t = c.seconds(&tokens, k, 3 * MB);
                            assert!(k <= n);
                            for other in 0..=n {
                                assert!(
                                    t <= c.seconds(&tokens, other, 3 * MB),
                                    "{link} {cpu} {fixed} {tokens:?}: {k} vs {other}"
                                );
                            }
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn the_cpu_pays_once_per_token_and_the_link_once_per_expert() {
        // Equal rates, 50 us an expert on either side: 4 experts of one token each split 2 and 2 (100 us); when
        // each is used by 3 tokens the CPU side costs 150 us an expert, so it takes 1 (150 us against 150 us on
        // the link), and none of 1 expert of 3 tokens.
        let c = cost(50.0, 50.0, 0.0);
        assert_eq!(c.cpu_take(&[1, 1, 1, 1], 2_500_000), 2);
        assert_eq!(c.cpu_take(&[3, 3, 3, 3], 2_500_000), 1);
        assert!((c.seconds(&[3, 3, 3, 3], 1, 2_500_000) - 150e-6).abs() < 1e-12);
        assert_eq!(c.cpu_take(&[3], 2_500_000), 0);
        let plan = MissPlan {
            policy: MissPolicy::Cpu,
            cost: None,
        };
        assert_eq!(plan.cpu_take(&[3, 1], 1), 2);
    }

    #[test]
    fn a_rate_that_was_not_measured_is_not_used() {
        assert_eq!(cost(f64::NAN, 40.0, 40.0).cpu_count(8, MB), 8);
        assert_eq!(cost(53.0, 0.0, 40.0).cpu_count(8, MB), 0);
        assert_eq!(cost(f64::INFINITY, 0.0, 40.0).cpu_count(8, MB), 0);
    }

    #[test]
    fn the_policies_override_the_model() {
        let c = Some(cost(53.0, 40.0, 40.0));
        let plan = |policy, cost| MissPlan { policy, cost };
        assert_eq!(plan(MissPolicy::Upload, c).cpu_count(8, 2_650_000), 0);
        assert_eq!(plan(MissPolicy::Cpu, c).cpu_count(8, 2_650_000), 8);
        assert_eq!(plan(MissPolicy::Auto, c).cpu_count(8, 2_650_000), 3);
        // auto before the rates are measured uploads everything (the bit-identical path).
        assert_eq!(plan(MissPolicy::Auto, None).cpu_count(8, 2_650_000), 0);
        assert_eq!(MissPlan::default().cpu_count(8, 1), 0);
        assert_eq!(plan(MissPolicy::Cpu, None).cpu_count(0, 1), 0);
    }
}
