//! The expert cache's part of the plan (DESIGN.md section 3, "Expert cache" and "Memory plan"): its flags
//! ([`ExpertFlags`]), a model's routed experts as slots see them ([`ExpertGeometry`]), and how many VRAM slots a
//! device's memory gives ([`size_cache`]).
//!
//! A slot holds one expert of one layer (gate, up and down, laid out by [`crate::experts::slot_layout`]). When the
//! experts do not all fit, the device also keeps [`ExpertGeometry::staging`] staging slots: an expert a step needs
//! and the cache does not hold (or may not take) is uploaded there for that step.

use crate::experts::cache::Policy;
use crate::experts::miss::MissPolicy;
use crate::experts::slot_layout;
use crate::experts::trace::RoutingSource;
use crate::gguf::GgufModel;
use crate::model::HParams;

/// Default `--vram-reserve-mib`: device memory kept free for the driver, the BLAS workspace and fragmentation (the
/// original Strata's default).
pub const DEFAULT_VRAM_RESERVE_MIB: u64 = 700;

pub use crate::experts::STAGING_TOKENS;

/// `--expert-cache`: how many VRAM slots routed experts get.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CacheSize {
    /// What the memory plan leaves after the dense weights, the KV cache, prefill buffers and the reserve; every
    /// expert stays resident when they all fit.
    Auto,
    /// This many slots (0: every expert a step needs is uploaded for that step alone).
    Slots(usize),
}

impl std::fmt::Display for CacheSize {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CacheSize::Auto => f.write_str("auto"),
            CacheSize::Slots(n) => write!(f, "{n}"),
        }
    }
}

/// Most slots `--expert-cache N` takes (a model has at most 2^22 experts in all, `experts::trace`'s bound).
pub const MAX_SLOTS: usize = 1 << 22;

fn parse_cache_size(s: &str) -> Result<CacheSize, String> {
    if s == "auto" {
        return Ok(CacheSize::Auto);
    }
    match s.parse::<usize>() {
        Ok(n) if n <= MAX_SLOTS => Ok(CacheSize::Slots(n)),
        _ => Err(format!(
            "--expert-cache takes `auto` or a slot count from 0 to {MAX_SLOTS}, not `{s}`"
        )),
    }
}

fn parse_reserve(s: &str) -> Result<u64, String> {
    match s.parse::<u64>() {
        Ok(n) if n <= 1 << 20 => Ok(n),
        _ => Err(format!("--vram-reserve-mib takes MiB from 0 to 1048576, not `{s}`")),
    }
}

/// Parses a size: a number (decimals allowed) and a unit, `B`, `KiB`, `MiB`, `GiB`, `TiB` (binary; `K`, `M`, `G`,
/// `T` mean the same) or `KB`, `MB`, `GB`, `TB` (decimal), in any case; a bare number is bytes. `10.7GiB`, `11000MiB`, `12GB`.
///
/// Errors: anything else, or a size of 0 or above 1024 TiB, as a one-line message naming `flag`.
pub fn parse_size(flag: &str, s: &str) -> Result<u64, String> {
    let bad = || format!("{flag} takes a size from 1 byte to 1024TiB, such as 10.7GiB, 11000MiB or 12GB, not `{s}`");
    let t = s.trim();
    let split = t.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let value: f64 = num.parse().map_err(|_| bad())?;
    let scale: f64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "k" | "kib" => 1024.0,
        "m" | "mib" => 1024.0 * 1024.0,
        "g" | "gib" => 1024.0 * 1024.0 * 1024.0,
        "t" | "tib" => 1024.0f64.powi(4),
        "kb" => 1e3,
        "mb" => 1e6,
        "gb" => 1e9,
        "tb" => 1e12,
        _ => return Err(bad()),
    };
    let bytes = value * scale;
    if !(bytes >= 1.0 && bytes <= (1u64 << 50) as f64) {
        return Err(bad());
    }
    Ok(bytes as u64)
}

fn parse_budget(s: &str) -> Result<u64, String> {
    parse_size("--vram-budget", s)
}

/// `--routing-trace`: a file, or a `synth:` spec ([`RoutingSource`]).
fn parse_routing_source(s: &str) -> Result<RoutingSource, String> {
    s.parse()
}

fn parse_upload_cap(s: &str) -> Result<u32, String> {
    match s.parse::<u32>() {
        Ok(n) if n <= 1 << 20 => Ok(n),
        _ => Err(format!(
            "--upload-cap takes a count of experts from 0 to 1048576, not `{s}`"
        )),
    }
}

fn parse_on_off(s: &str) -> Result<bool, String> {
    match s {
        "on" => Ok(true),
        "off" => Ok(false),
        _ => Err(format!("--expert-prefetch takes on or off, not `{s}`")),
    }
}

fn parse_policy(s: &str) -> Result<Policy, String> {
    match s {
        "lru" => Ok(Policy::Lru),
        "lfru" => Ok(Policy::Lfru),
        "profile" => Ok(Policy::Profile),
        _ => Err(format!("--expert-policy takes lru, lfru or profile, not `{s}`")),
    }
}

/// The expert cache's flags (part of the plan flags: every engine command and `strata device --selftest`). They
/// apply to a GPU device; on the CPU every expert is read where the store keeps it.
#[derive(Debug, Clone, PartialEq, Eq, clap::Args)]
pub struct ExpertFlags {
    /// VRAM slots for routed experts, one expert of one layer each: `auto` (what the memory plan leaves; all
    /// experts resident when they fit), a count, or 0 (no slots: each step uploads the experts it needs, or
    /// computes them on the CPU as --miss-policy says).
    #[arg(long, default_value = "auto", value_parser = parse_cache_size, allow_hyphen_values = true)]
    pub expert_cache: CacheSize,
    /// MiB of device memory the plan keeps free (driver, BLAS workspace, fragmentation).
    #[arg(long, default_value_t = DEFAULT_VRAM_RESERVE_MIB, value_parser = parse_reserve, allow_hyphen_values = true)]
    pub vram_reserve_mib: u64,
    /// The most device memory the plan may use, as 10.7GiB or 11000MiB (default: the device's free memory):
    /// for comparisons at equal VRAM.
    #[arg(long, value_parser = parse_budget, allow_hyphen_values = true)]
    pub vram_budget: Option<u64>,
    /// Read the experts in place from the GGUF (the OS page cache holds them) instead of copying them into a
    /// page-locked host arena at load.
    #[arg(long)]
    pub mmap_experts: bool,
    /// Which expert an expert cache that is full evicts: lru (least recently used), lfru (least frequently,
    /// with decay), or profile (none: the slots --expert-profile fills stay, and other misses are served around
    /// the cache).
    #[arg(long, default_value = "lru", value_parser = parse_policy)]
    pub expert_policy: Policy,
    /// At most this many misses of a MoE layer in a decode step take a slot of a GPU's expert cache (evicting
    /// another expert); the rest are read for that step alone or computed by the CPU. Keeps a burst of one-off
    /// experts from flushing the cache. Default: no cap.
    #[arg(long, value_parser = parse_upload_cap, allow_hyphen_values = true)]
    pub upload_cap: Option<u32>,
    /// Pre-fill a GPU's expert cache at start with the experts this profile looked up most, as many as there are
    /// slots: a --save-expert-profile file, or a routing trace (--dump-routing).
    #[arg(long)]
    pub expert_profile: Option<std::path::PathBuf>,
    /// Save the expert cache's lookups of each expert to this file (JSON) after every request and at exit, adding
    /// to the counts it holds when it is a profile of this model: the profile --expert-profile reads. A GPU with
    /// an expert cache only.
    #[arg(long)]
    pub save_expert_profile: Option<std::path::PathBuf>,
    /// Route every MoE layer as this routing trace says instead of by its router: benchmarks of random-weight
    /// models with a real model's locality. A file (`strata experts synth-trace`, --dump-routing), or
    /// synth:locality[:SEED] (the published Qwen3-30B-A3B locality) or synth:uniform[:SEED], generated at start
    /// for the model. The tokens are not the model's. CUDA devices only.
    #[arg(long, value_parser = parse_routing_source)]
    pub routing_trace: Option<RoutingSource>,
    /// Where a GPU's decode steps compute the experts its cache misses: upload (into a cache or staging slot;
    /// results bit-identical to the all-resident run), cpu (every miss on the CPU while the GPU computes the
    /// hits), or auto (a cost model splits each layer's misses by the link and CPU rates measured at start).
    #[arg(long, default_value = "auto", value_enum)]
    pub miss_policy: MissPolicy,
    /// On a GPU with an expert cache, once a decode step's MoE layer is computed, apply the router of the layer
    /// after it (when that is a MoE layer) to this layer's input and copy the (at most 2) experts it picks that are
    /// not cached into free or staging slots while the step goes on: on or off. Steps on the device's slot table
    /// whose experts' down projection is Q4_K (the fused GLU) only. Results never change; a wrong guess costs link time and a
    /// slot. Under --miss-policy auto it is a third path that auto measures and keeps only when it is faster.
    /// Off by default (on a Qwen3-30B-A3B-shaped model with random weights it guessed 96% right but was never
    /// faster: README, "Expert prefetch"), and always off with --routing-trace (the trace, not the router,
    /// chooses).
    #[arg(long, default_value = "off", value_parser = parse_on_off, action = clap::ArgAction::Set)]
    pub expert_prefetch: bool,
    /// How the expert cache is sized on a simulated device: plan (every part, the KV cache and prefill buffers
    /// too, against the free memory read before anything is registered; on a UMA device the host arena is a part
    /// of the plan, and the experts are read in place when it does not fit), or original (the original Strata's:
    /// the free memory read after the arena is registered, all of it but the reserve; it reproduces seed 001).
    #[arg(long, default_value = "plan", value_enum)]
    pub cache_sizing: CacheSizing,
}

/// `--cache-sizing`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum CacheSizing {
    #[default]
    Plan,
    Original,
}

impl std::fmt::Display for CacheSizing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            CacheSizing::Plan => "plan",
            CacheSizing::Original => "original",
        })
    }
}

impl Default for ExpertFlags {
    fn default() -> ExpertFlags {
        ExpertFlags {
            expert_cache: CacheSize::Auto,
            vram_reserve_mib: DEFAULT_VRAM_RESERVE_MIB,
            vram_budget: None,
            mmap_experts: false,
            expert_policy: Policy::Lru,
            upload_cap: None,
            expert_profile: None,
            save_expert_profile: None,
            routing_trace: None,
            miss_policy: MissPolicy::Auto,
            expert_prefetch: false,
            cache_sizing: CacheSizing::Plan,
        }
    }
}

impl ExpertFlags {
    /// The flags as command-line arguments: parsing them back gives these flags.
    pub fn to_args(&self) -> Vec<String> {
        let mut a = vec![
            "--expert-cache".to_string(),
            self.expert_cache.to_string(),
            "--vram-reserve-mib".into(),
            self.vram_reserve_mib.to_string(),
            "--expert-policy".into(),
            self.expert_policy.to_string(),
            "--miss-policy".into(),
            self.miss_policy.to_string(),
        ];
        if let Some(b) = self.vram_budget {
            a.extend(["--vram-budget".into(), b.to_string()]);
        }
        if self.mmap_experts {
            a.push("--mmap-experts".into());
        }
        if let Some(t) = &self.routing_trace {
            a.extend(["--routing-trace".into(), t.to_string()]);
        }
        if let Some(c) = self.upload_cap {
            a.extend(["--upload-cap".into(), c.to_string()]);
        }
        if let Some(p) = &self.expert_profile {
            a.extend(["--expert-profile".into(), p.display().to_string()]);
        }
        if let Some(p) = &self.save_expert_profile {
            a.extend(["--save-expert-profile".into(), p.display().to_string()]);
        }
        if self.expert_prefetch {
            a.extend(["--expert-prefetch".into(), "on".into()]);
        }
        if self.cache_sizing != CacheSizing::Plan {
            a.extend(["--cache-sizing".into(), self.cache_sizing.to_string()]);
        }
        a
    }

    /// `--vram-reserve-mib` in bytes.
    pub fn reserve_bytes(&self) -> u64 {
        self.vram_reserve_mib << 20
    }
}

/// A model's routed experts as cache slots see them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExpertGeometry {
    /// Layers with routed experts.
    pub moe_layers: usize,
    pub n_expert: usize,
    /// Experts a token routes to (top-k).
    pub k: usize,
    /// Bytes of one slot: the largest [`slot_layout`] span of any layer's expert.
    pub slot_bytes: u64,
}

impl ExpertGeometry {
    /// The geometry of `model`'s routed experts (`ffn_{gate,up,down}_exps`, each `n_expert` equal parts), or
    /// `None` when it has none.
    pub fn of(model: &GgufModel, hp: &HParams) -> Option<ExpertGeometry> {
        let n_expert = hp.n_expert as usize;
        if n_expert == 0 {
            return None;
        }
        let mut layers: std::collections::BTreeMap<&str, [usize; 3]> = Default::default();
        for t in model.tensors() {
            let Some((layer, m)) = ["ffn_gate_exps.", "ffn_up_exps.", "ffn_down_exps."]
                .iter()
                .enumerate()
                .find_map(|(m, pat)| t.name.find(pat).map(|at| (&t.name[..at], m)))
            else {
                continue;
            };
            layers.entry(layer).or_default()[m] = (t.n_bytes / n_expert as u64) as usize;
        }
        let slot_bytes = layers.values().map(|b| slot_layout(*b).1).max()? as u64;
        Some(ExpertGeometry {
            moe_layers: layers.len(),
            n_expert,
            k: (hp.n_expert_used as usize).max(1),
            slot_bytes,
        })
    }

    /// Every routed expert of the model.
    pub fn all(&self) -> usize {
        self.moe_layers * self.n_expert
    }

    /// Staging slots a device keeps beside a cache that does not hold every expert, out of `room` bytes:
    /// [`STAGING_TOKENS`] x top-k (at most one layer's experts), what one sequence's decode steps need; for steps of
    /// `several` sequences (`--parallel` of 2 or more, and their steps may use the device's slot table:
    /// [`super::PlanConfig::table_steps`]), one layer's every expert, the most any step can miss, so those steps
    /// decide their experts on the device too (the CUDA backend's slot table), with the kernels and the bits of the
    /// resident run, unless that would take over an eighth of `room`, which a small cache keeps for its hits (then
    /// the host decides steps of more than [`STAGING_TOKENS`] tokens, layer by layer).
    pub fn staging(&self, several: bool, room: u64) -> usize {
        let layer = self.n_expert as u64;
        match several && layer.saturating_mul(self.slot_bytes).saturating_mul(8) <= room {
            true => self.n_expert,
            false => (STAGING_TOKENS * self.k).min(self.n_expert),
        }
    }
}

/// Where a plan puts the routed experts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(tag = "mode", rename_all = "snake_case")]
pub enum ExpertPlacement {
    /// Every expert resident on the device (uploaded on first use, kept).
    AllResident,
    /// A cache of `slots` slots and `staging` staging slots of `slot_bytes` each; every expert lives on the host.
    Cache {
        slots: usize,
        staging: usize,
        slot_bytes: u64,
    },
}

/// The slots a device gets: `size` as asked, against `room`, the bytes the plan leaves for experts after
/// everything else (dense weights, KV cache, prefill buffers; the reserve is already out of it), for experts of
/// `expert_bytes` in all, and the staging slots beside them, for steps of `several` sequences or not
/// ([`ExpertGeometry::staging`]; with a fixed count, out of the room its slots leave).
///
/// `auto` keeps every expert resident when their `expert_bytes` fit in `room`, else takes as many slots as `room` holds beside
/// the staging slots (0 when even those do not fit: the plan then does not fit). A count is capped at every
/// expert; a count that covers every expert is the all-resident placement.
pub fn size_cache(
    size: CacheSize,
    geometry: &ExpertGeometry,
    several: bool,
    room: u64,
    expert_bytes: u64,
) -> ExpertPlacement {
    let all = geometry.all();
    let slot = geometry.slot_bytes.max(1);
    let (slots, staging) = match size {
        CacheSize::Slots(n) => {
            let n = n.min(all);
            (n, geometry.staging(several, room.saturating_sub(n as u64 * slot)))
        }
        CacheSize::Auto if expert_bytes <= room => (all, 0),
        CacheSize::Auto => {
            let staging = geometry.staging(several, room);
            let slots = (room.saturating_sub(staging as u64 * slot) / slot).min(all as u64) as usize;
            (slots, staging)
        }
    };
    if slots >= all {
        ExpertPlacement::AllResident
    } else {
        ExpertPlacement::Cache {
            slots,
            staging,
            slot_bytes: geometry.slot_bytes,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const G: ExpertGeometry = ExpertGeometry {
        moe_layers: 4,
        n_expert: 16,
        k: 2,
        slot_bytes: 1000,
    };

    #[test]
    fn auto_keeps_everything_resident_when_it_fits_and_counts_slots_beside_staging_when_not() {
        assert_eq!(G.all(), 64);
        assert_eq!(G.staging(false, u64::MAX), 8);
        assert_eq!(
            size_cache(CacheSize::Auto, &G, false, 64_000, 64_000),
            ExpertPlacement::AllResident
        );
        // 63,999 bytes: not all 64; 8 staging slots take 8,000, leaving 55 slots.
        let c = |slots| ExpertPlacement::Cache {
            slots,
            staging: 8,
            slot_bytes: 1000,
        };
        assert_eq!(size_cache(CacheSize::Auto, &G, false, 63_999, 64_000), c(55));
        assert_eq!(size_cache(CacheSize::Auto, &G, false, 8_999, 64_000), c(0));
        assert_eq!(size_cache(CacheSize::Auto, &G, false, 100, 64_000), c(0));
        assert_eq!(size_cache(CacheSize::Slots(10), &G, false, u64::MAX, 64_000), c(10));
        assert_eq!(size_cache(CacheSize::Slots(0), &G, false, u64::MAX, 64_000), c(0));
        assert_eq!(
            size_cache(CacheSize::Slots(64), &G, false, 0, 64_000),
            ExpertPlacement::AllResident
        );
        assert_eq!(
            size_cache(CacheSize::Slots(1000), &G, false, 0, 64_000),
            ExpertPlacement::AllResident
        );
        // Mixed quant types: slots are as large as the largest layer's expert, but `auto` keeps every expert
        // resident when their real bytes fit.
        assert_eq!(
            size_cache(CacheSize::Auto, &G, false, 50_000, 50_000),
            ExpertPlacement::AllResident
        );
        // Staging is at most one layer's experts.
        let wide = ExpertGeometry {
            k: 8,
            n_expert: 16,
            ..G
        };
        assert_eq!(wide.staging(false, u64::MAX), 16);
    }

    /// Several sequences get a layer's every expert as staging slots (any step stays on the device's slot table)
    /// when they take at most an eighth of the room; else, and for one sequence, 4 tokens' experts.
    #[test]
    fn several_sequences_stage_a_layer_while_the_room_allows() {
        // Top-2 of 16 experts, 1,000-byte slots: 4 tokens stage 8 experts.
        assert_eq!(G.staging(false, u64::MAX), 8);
        assert_eq!(G.staging(true, u64::MAX), 16);
        assert_eq!(G.staging(true, 128_000), 16);
        // 16 slots are 16,000 bytes: over an eighth of 127,999.
        assert_eq!(G.staging(true, 127_999), 8);
        // The slots beside them are what the room leaves.
        let c = |slots, staging| ExpertPlacement::Cache {
            slots,
            staging,
            slot_bytes: 1000,
        };
        let big = ExpertGeometry { moe_layers: 40, ..G };
        assert_eq!(size_cache(CacheSize::Auto, &big, true, 200_000, 640_000), c(184, 16));
        assert_eq!(size_cache(CacheSize::Auto, &big, true, 127_999, 640_000), c(119, 8));
        assert_eq!(size_cache(CacheSize::Auto, &big, false, 200_000, 640_000), c(192, 8));
        // A fixed count: the eighth is of the room its slots leave (100 slots leave 100,000 bytes: 8 staging).
        assert_eq!(
            size_cache(CacheSize::Slots(100), &big, true, 200_000, 640_000),
            c(100, 8)
        );
        assert_eq!(
            size_cache(CacheSize::Slots(50), &big, true, 200_000, 640_000),
            c(50, 16)
        );
    }

    #[test]
    fn sizes_parse_in_binary_and_decimal_units() {
        let p = |s| parse_size("--vram-budget", s);
        assert_eq!(p("10.7GiB"), Ok((10.7 * (1u64 << 30) as f64) as u64));
        assert_eq!(p("11000MiB"), Ok(11000 << 20));
        assert_eq!(p("12GB"), Ok(12_000_000_000));
        assert_eq!(p("2g"), Ok(2 << 30));
        assert_eq!(p("4096"), Ok(4096));
        for bad in ["", "GiB", "-1GiB", "0", "1.2.3G", "5 parsecs", "2PiB", "nan"] {
            let e = p(bad).unwrap_err();
            assert!(e.contains("--vram-budget") && e.contains(bad), "{e}");
        }
    }

    #[test]
    fn flags_parse_back_and_refuse_bad_values() {
        #[derive(clap::Parser)]
        struct P {
            #[command(flatten)]
            e: ExpertFlags,
        }
        use clap::Parser;
        let d = P::parse_from(["x"]).e;
        assert_eq!(d, ExpertFlags::default());
        let f = P::parse_from([
            "x",
            "--expert-cache",
            "123",
            "--vram-reserve-mib",
            "512",
            "--vram-budget",
            "10.7GiB",
            "--mmap-experts",
            "--expert-policy",
            "lfru",
            "--routing-trace",
            "t.jsonl",
            "--miss-policy",
            "cpu",
            "--expert-profile",
            "p.json",
            "--save-expert-profile",
            "q.json",
            "--upload-cap",
            "2",
            "--expert-prefetch",
            "on",
        ])
        .e;
        assert!(!d.expert_prefetch && f.expert_prefetch);
        assert_eq!(f.miss_policy, MissPolicy::Cpu);
        assert_eq!(f.expert_cache, CacheSize::Slots(123));
        assert_eq!(f.reserve_bytes(), 512 << 20);
        assert!(f.mmap_experts && f.expert_policy == Policy::Lfru);
        assert_eq!(f.save_expert_profile.as_deref(), Some(std::path::Path::new("q.json")));
        assert_eq!(f.upload_cap, Some(2));
        let back = P::parse_from(std::iter::once("x".to_string()).chain(f.to_args())).e;
        assert_eq!(back, f);
        for (flag, v) in [
            ("--expert-cache", "-1"),
            ("--vram-budget", "-1GiB"),
            ("--expert-cache", "lots"),
            ("--vram-reserve-mib", "x"),
            ("--vram-budget", "0"),
            ("--expert-policy", "fifo"),
            ("--upload-cap", "-1"),
            ("--upload-cap", "lots"),
            ("--miss-policy", "gpu"),
            ("--expert-prefetch", "yes"),
        ] {
            let e = P::try_parse_from(["x".to_string(), format!("{flag}={v}")])
                .err()
                .unwrap()
                .to_string();
            assert!(e.contains(flag), "{e}");
        }
    }
}
