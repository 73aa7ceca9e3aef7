//! The one memory plan (DESIGN.md section 3, "Memory plan"): what running a model needs, part by part, computed
//! from its GGUF tensor table and hyper-parameters before anything is allocated, and compared with a device's
//! free memory as FITS or DOES NOT FIT. `strata device --selftest --model M` prints it against the card's free
//! memory, `strata inspect` prints its weights and KV cache at two context lengths, and the flags it is computed
//! from ([`PlanFlags`]) are the engine's.
//!
//! Sizes are bytes. The KV cache is sized as [`crate::state::kv::KvCache`] allocates it (cells x
//! [`KvShape::cell_bytes`]), so the plan and the allocation cannot disagree.

use crate::experts::miss::MissPolicy;
use std::fmt;

pub mod cache;
pub mod split;

pub use cache::{CacheSize, CacheSizing, ExpertFlags, ExpertGeometry, ExpertPlacement};

use crate::gguf::GgufModel;
use crate::model::HParams;
pub use crate::model::inspect::human_bytes;
use crate::state::kv::{KvError, KvShape, KvType};

/// Default `--max-context`, in tokens (capped by the model's training context).
pub const DEFAULT_MAX_CONTEXT: usize = 4096;
/// Prefill chunk used by `--prefill auto`, in tokens.
pub const AUTO_PREFILL_CHUNK: usize = 512;

/// Cells a sequence's KV cache holds: `max_context` capped by the model's training context (`n_ctx_train`, 0
/// when the metadata has none), in tokens. The server uses it to refuse an over-long prompt before queueing it.
pub fn context_cells(max_context: usize, n_ctx_train: u32) -> usize {
    match n_ctx_train as usize {
        0 => max_context,
        train => max_context.min(train),
    }
}

/// Parses a `--prefill` value: a positive token count, or `auto` (`None`: [`AUTO_PREFILL_CHUNK`]).
///
/// Errors: anything else, as a one-line message naming the flag.
pub fn parse_prefill_chunk(s: &str) -> Result<Option<usize>, String> {
    if s == "auto" {
        return Ok(None);
    }
    match s.parse::<usize>() {
        Ok(n) if n > 0 => Ok(Some(n)),
        _ => Err(format!("--prefill takes a positive token count or `auto`, not `{s}`")),
    }
}

/// A `--prefill` value: tokens per prefill chunk, `None` for `auto`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PrefillChunk(pub Option<usize>);

fn parse_max_context(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(n) if n > 0 => Ok(n),
        _ => Err(format!("--max-context takes a positive token count, not `{s}`")),
    }
}

fn parse_kv_tokens(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(n) if n > 0 => Ok(n),
        Err(e) if *e.kind() == std::num::IntErrorKind::PosOverflow => {
            Err(format!("--kv-tokens `{s}` is too large (at most {})", usize::MAX))
        }
        _ => Err(format!("--kv-tokens takes a positive token count, not `{s}`")),
    }
}

/// Most sequences `--parallel` may ask for.
pub const MAX_PARALLEL: usize = 256;

fn parse_parallel(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(n) if (1..=MAX_PARALLEL).contains(&n) => Ok(n),
        _ => Err(format!(
            "--parallel takes a sequence count from 1 to {MAX_PARALLEL}, not `{s}`"
        )),
    }
}

fn parse_prefill(s: &str) -> Result<PrefillChunk, String> {
    parse_prefill_chunk(s).map(PrefillChunk)
}

/// The flags a memory plan is computed from, defined once: every engine command has them (inside
/// `runtime::engine::EngineFlags`) and so does `strata device --selftest`.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct PlanFlags {
    /// KV cache type: f16, or int8 (blocks of 32 values with an f16 scale).
    #[arg(long, value_enum, default_value = "f16")]
    pub kv: KvType,
    /// Context size in tokens, capped by the model's training context (default 4096; `strata bench`: its longest
    /// test). A longer request is an error, never truncated.
    #[arg(long, value_parser = parse_max_context)]
    pub max_context: Option<usize>,
    /// Prefill chunk in tokens, or `auto` (512; `strata bench` defaults to the whole prompt in one batch).
    #[arg(long, value_parser = parse_prefill)]
    pub prefill: Option<PrefillChunk>,
    /// Sequences computed together, 1 to 256 (`strata serve`'s slots, default 4 there; 1 elsewhere). Each may
    /// hold up to --max-context tokens of KV cache; the plan holds --kv-tokens, by default that many for each.
    #[arg(long, value_parser = parse_parallel, allow_hyphen_values = true)]
    pub parallel: Option<usize>,
    /// Tokens of KV cache all sequences share, rounded up to blocks of 16 (default: --parallel x --max-context,
    /// each in whole blocks: every sequence at its full context at once). It matters where sequences share the pool
    /// (`strata serve`); refused by `strata bench`. A smaller pool lets more sequences run than fit at full length: when it fills, idle slots' cached prompts are dropped, then
    /// the newest sequence is preempted and recomputed once there is room. At least --max-context; past --parallel
    /// x --max-context it is lowered to that. On a GPU the pool is allocated at this size in VRAM (the memory
    /// plan's KV cache part).
    #[arg(long, value_parser = parse_kv_tokens, allow_hyphen_values = true)]
    pub kv_tokens: Option<usize>,
    /// The expert cache's flags.
    #[command(flatten)]
    pub experts: ExpertFlags,
}

impl PlanFlags {
    /// `--max-context`, or its default ([`DEFAULT_MAX_CONTEXT`]).
    pub fn max_context(&self) -> usize {
        self.max_context.unwrap_or(DEFAULT_MAX_CONTEXT)
    }

    /// Sequences with a KV cache (`--parallel`, default 1).
    pub fn sequences(&self) -> usize {
        self.parallel.unwrap_or(1)
    }

    /// Tokens per prefill chunk (`auto`: [`AUTO_PREFILL_CHUNK`]).
    pub fn prefill_chunk(&self) -> usize {
        self.prefill.and_then(|p| p.0).unwrap_or(AUTO_PREFILL_CHUNK)
    }

    /// The flags as command-line arguments: parsing them back gives these flags.
    pub fn to_args(&self) -> Vec<String> {
        let mut a = vec!["--kv".to_string(), self.kv.to_string()];
        if let Some(n) = self.max_context {
            a.extend(["--max-context".into(), n.to_string()]);
        }
        if let Some(p) = self.prefill {
            a.extend(["--prefill".into(), p.0.map_or("auto".into(), |n| n.to_string())]);
        }
        if let Some(n) = self.parallel {
            a.extend(["--parallel".into(), n.to_string()]);
        }
        if let Some(n) = self.kv_tokens {
            a.extend(["--kv-tokens".into(), n.to_string()]);
        }
        a.extend(self.experts.to_args());
        a
    }
}

/// The weights of a model by where they will live: dense (attention, norms, embeddings, output head, dense FFNs,
/// routers, shared experts) and routed experts (the `ffn_{gate,up,down}_exps` tensors, which the expert store
/// will keep in host memory). Bytes as stored in the GGUF.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WeightBytes {
    pub dense: u64,
    pub experts: u64,
    /// Elements of the largest dense tensor (the f16 copy a prefill GEMM may dequantize it into; the experts'
    /// GEMMs read their quantized blocks directly).
    pub largest_elements: u64,
}

impl WeightBytes {
    /// Sums `model`'s tensor table. Sums saturate: a hostile header cannot overflow them.
    pub fn of(model: &GgufModel) -> WeightBytes {
        WeightBytes::of_matching(model, |_| true)
    }

    /// [`WeightBytes::of`] over the tensors whose name `keep` accepts (a stage's of a layer split:
    /// [`split::stage_holds`]).
    pub fn of_matching(model: &GgufModel, keep: impl Fn(&str) -> bool) -> WeightBytes {
        let mut w = WeightBytes {
            dense: 0,
            experts: 0,
            largest_elements: 0,
        };
        for t in model.tensors().iter().filter(|t| keep(&t.name)) {
            if is_routed_expert(&t.name) {
                w.experts = w.experts.saturating_add(t.n_bytes);
            } else {
                w.dense = w.dense.saturating_add(t.n_bytes);
                w.largest_elements = w.largest_elements.max(t.n_elements());
            }
        }
        w
    }

    /// Every weight, dense and experts.
    pub fn total(&self) -> u64 {
        self.dense.saturating_add(self.experts)
    }
}

/// Whether `name` is a routed-expert tensor (`blk.N.ffn_gate_exps.weight` and friends, llama.cpp's names; the
/// shared expert's `ffn_*_shexp` is dense).
pub fn is_routed_expert(name: &str) -> bool {
    name.contains("_exps.")
}

/// What a plan is computed for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PlanConfig {
    /// KV cells (tokens of context; see [`context_cells`]).
    pub context: usize,
    pub kv: KvType,
    /// Sequences, each with a KV cache of `context` cells (`--parallel`).
    pub sequences: usize,
    /// `--kv-tokens`: the cells the sequences' KV caches share (default: `sequences` x `context`).
    pub kv_tokens: Option<usize>,
    /// Tokens per prefill chunk.
    pub prefill_chunk: usize,
    /// Bytes kept free on the device (`--vram-reserve-mib`).
    pub reserve: u64,
    /// `--expert-cache`.
    pub cache: CacheSize,
    /// `--vram-budget`: the most bytes the plan's parts may take, the reserve apart.
    pub budget: Option<u64>,
    /// Whether steps of several sequences may decide their experts on a GPU's device slot table, so the staging
    /// slots are sized for them ([`cache::ExpertGeometry::staging`]): the experts in the page-locked arena (not
    /// `--mmap-experts`) and a miss policy other than `cpu`.
    pub table_steps: bool,
}

impl PlanConfig {
    /// The plan `flags` ask for on a model trained to `n_ctx_train` tokens (the context capped as a session caps
    /// it).
    pub fn from_flags(flags: &PlanFlags, n_ctx_train: u32) -> PlanConfig {
        PlanConfig {
            context: context_cells(flags.max_context(), n_ctx_train),
            kv: flags.kv,
            sequences: flags.sequences(),
            kv_tokens: flags.kv_tokens,
            prefill_chunk: flags.prefill_chunk(),
            reserve: flags.experts.reserve_bytes(),
            cache: flags.experts.expert_cache,
            budget: flags.experts.vram_budget,
            table_steps: !flags.experts.mmap_experts && flags.experts.miss_policy != MissPolicy::Cpu,
        }
    }
}

/// One part of a plan.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Part {
    /// Every weight that is not a routed expert.
    DenseWeights,
    /// The routed experts, all resident on the device.
    Experts,
    /// The expert cache's slots (the experts live in host memory).
    ExpertCache,
    /// Slots an expert a step needs is uploaded to when the cache does not hold it.
    ExpertStaging,
    KvCache,
    /// A prefill chunk's activations and the largest matrix dequantized to f16.
    PrefillBuffers,
    /// Kept free for the driver, the BLAS workspace and fragmentation.
    Reserve,
    /// The host expert arena, registered with a UMA device, which charges it against the device's memory.
    UmaArena,
}

impl Part {
    /// The part as the plan's table names it.
    pub fn label(self) -> &'static str {
        match self {
            Part::DenseWeights => "dense weights",
            Part::Experts => "experts (all resident)",
            Part::ExpertCache => "expert cache",
            Part::ExpertStaging => "expert staging",
            Part::KvCache => "KV cache",
            Part::PrefillBuffers => "prefill buffers",
            Part::Reserve => "reserve",
            Part::UmaArena => "expert arena (UMA, charged)",
        }
    }
}

/// Whether a plan fits in a device's free memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub enum Verdict {
    #[serde(rename = "FITS")]
    Fits,
    #[serde(rename = "DOES NOT FIT")]
    DoesNotFit,
}

impl fmt::Display for Verdict {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Verdict::Fits => "FITS",
            Verdict::DoesNotFit => "DOES NOT FIT",
        })
    }
}

/// A memory plan: the bytes of each part on the device, in the order they are allocated, and the device memory
/// it was made for.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct MemoryPlan {
    pub parts: Vec<(Part, u64)>,
    /// KV cells planned for, per sequence.
    pub context: usize,
    /// Sequences with a KV cache of up to `context` cells each.
    pub sequences: usize,
    /// KV cells of all sequences together: `--kv-tokens` rounded up to whole blocks, at most `sequences` x
    /// `context` (their default).
    pub kv_cells: usize,
    #[serde(serialize_with = "display")]
    pub kv: KvType,
    /// Where the routed experts go (`None`: the model has none).
    pub experts: Option<ExpertPlacement>,
    /// The device's free memory the plan was made against, bytes.
    pub free: u64,
    /// `--vram-budget`, bytes.
    pub budget: Option<u64>,
    /// The host side, when the experts live in a host arena: its bytes and the host's available memory (`None`:
    /// not known).
    pub host_arena: Option<(u64, Option<u64>)>,
}

fn display<S: serde::Serializer, T: fmt::Display>(v: &T, s: S) -> Result<S::Ok, S::Error> {
    s.collect_str(v)
}

impl MemoryPlan {
    /// The plan of a model with `weights`, hyper-parameters `hp` and routed experts `experts` under `config`, on a
    /// device with `free` bytes free (`u64::MAX` for a plan of every expert resident, as `auto` gives when they
    /// fit). The expert cache takes what the other parts leave of the limit ([`MemoryPlan::limit`]), as
    /// [`cache::size_cache`] says.
    ///
    /// Errors: [`KvError::HeadDim`] when `config.kv` is int8 and the model's head width is not a multiple of 32
    /// (the cache could not be made either).
    pub fn new(
        weights: &WeightBytes,
        hp: &HParams,
        experts: Option<&ExpertGeometry>,
        config: &PlanConfig,
        free: u64,
    ) -> Result<MemoryPlan, KvError> {
        let kv_cells = kv_cells(config);
        let kv = kv_bytes(&hp.kv_shape(), config.kv, kv_cells)?;
        let prefill = prefill_bytes(hp, weights.largest_elements, config.prefill_chunk);
        let mut plan = MemoryPlan {
            parts: vec![(Part::DenseWeights, weights.dense)],
            context: config.context,
            sequences: config.sequences.max(1),
            kv_cells,
            kv: config.kv,
            experts: None,
            free,
            budget: config.budget,
            host_arena: None,
        };
        let others = [weights.dense, kv, prefill, config.reserve]
            .iter()
            .fold(0u64, |a, &b| a.saturating_add(b));
        let room = limit_of(free, config.budget, config.reserve).saturating_sub(others);
        match experts {
            Some(g) if weights.experts > 0 => {
                let placement = cache::size_cache(
                    config.cache,
                    g,
                    config.sequences > 1 && config.table_steps,
                    room,
                    weights.experts,
                );
                plan.parts.extend(match placement {
                    ExpertPlacement::AllResident => vec![(Part::Experts, weights.experts)],
                    ExpertPlacement::Cache {
                        slots,
                        staging,
                        slot_bytes,
                    } => vec![
                        (Part::ExpertCache, (slots as u64).saturating_mul(slot_bytes)),
                        (Part::ExpertStaging, (staging as u64).saturating_mul(slot_bytes)),
                    ],
                });
                plan.experts = Some(placement);
            }
            _ if weights.experts > 0 => plan.parts.push((Part::Experts, weights.experts)),
            _ => {}
        }
        plan.parts.extend([
            (Part::KvCache, kv),
            (Part::PrefillBuffers, prefill),
            (Part::Reserve, config.reserve),
        ]);
        Ok(plan)
    }

    /// The plan with its host side: an arena of `bytes` against `available` host memory (what
    /// [`crate::experts::store::ExpertStore::make_arena`] checks).
    pub fn with_host_arena(mut self, bytes: u64, available: Option<u64>) -> MemoryPlan {
        self.host_arena = Some((bytes, available));
        self
    }

    /// The plan on a UMA device where registering the host arena of `bytes` charges it against the device's free
    /// memory: `self` must have been made against `free - bytes`; the arena becomes a part (after the dense
    /// weights) and the plan's free memory is the device's again.
    pub fn with_uma_arena(mut self, bytes: u64, available: Option<u64>) -> MemoryPlan {
        self.parts.insert(1.min(self.parts.len()), (Part::UmaArena, bytes));
        self.free = self.free.saturating_add(bytes);
        self.host_arena = Some((bytes, available));
        self
    }

    /// Whether the host arena fits the host's available memory (`None` without an arena or a reading).
    pub fn host_verdict(&self) -> Option<Verdict> {
        let (bytes, available) = self.host_arena?;
        Some(if bytes <= available? {
            Verdict::Fits
        } else {
            Verdict::DoesNotFit
        })
    }

    /// The most the plan may take, reserve included: the device's free memory, or the budget plus the reserve when
    /// that is less.
    pub fn limit(&self) -> u64 {
        limit_of(self.free, self.budget, self.bytes(Part::Reserve))
    }

    /// The bytes of `part` (0 when the plan has none).
    pub fn bytes(&self, part: Part) -> u64 {
        self.parts.iter().filter(|(p, _)| *p == part).map(|(_, b)| *b).sum()
    }

    /// Every part together, in bytes.
    pub fn total(&self) -> u64 {
        self.parts.iter().fold(0u64, |s, (_, b)| s.saturating_add(*b))
    }

    /// The plan against its limit ([`MemoryPlan::limit`]).
    pub fn verdict(&self) -> Verdict {
        if self.total() <= self.limit() {
            Verdict::Fits
        } else {
            Verdict::DoesNotFit
        }
    }

    /// The expert cache's slots (`None` when every expert is resident or the model has none).
    pub fn cache_slots(&self) -> Option<usize> {
        match self.experts {
            Some(ExpertPlacement::Cache { slots, .. }) => Some(slots),
            _ => None,
        }
    }

    /// The plan as a table, one part a line, then the total, the device's free memory (and the budget) and the
    /// verdict (the original Strata's layout: seed 000's self-test).
    pub fn to_text(&self) -> String {
        let mut s = String::new();
        for (part, bytes) in &self.parts {
            let label = match (part, self.experts) {
                (Part::ExpertCache, Some(ExpertPlacement::Cache { slots, .. })) => {
                    format!("expert cache ({slots} slots)")
                }
                (Part::ExpertStaging, Some(ExpertPlacement::Cache { staging, .. })) => {
                    format!("expert staging ({staging} slots)")
                }
                _ => part.label().to_string(),
            };
            s += &format!("  {label:<26} {:>12.6} GB\n", *bytes as f64 / 1e9);
        }
        s += &format!(
            "  {:<26} {:>12.6} GB ({})\n",
            "plan",
            self.total() as f64 / 1e9,
            human_bytes(self.total())
        );
        s += &format!("  {:<26} {}\n", "device free", gib(self.free));
        if let Some(b) = self.budget {
            s += &format!("  {:<26} {} (+ reserve)\n", "budget (--vram-budget)", gib(b));
        }
        s += &format!("  {:<26} {}\n", "plan vs free", self.verdict());
        if let Some((bytes, available)) = self.host_arena {
            s += &format!("  {:<26} {:>12.6} GB\n", "expert arena (host)", bytes as f64 / 1e9);
            match (available, self.host_verdict()) {
                (Some(a), Some(v)) => {
                    s += &format!("  {:<26} {}\n", "host available", gib(a));
                    s += &format!(
                        "  {:<26} {v}{}\n",
                        "arena vs host",
                        if v == Verdict::Fits {
                            ""
                        } else {
                            " (the experts are read in place instead)"
                        }
                    );
                }
                _ => s += &format!("  {:<26} not known\n", "host available"),
            }
        }
        s
    }

    /// What does not fit, in one line naming the parts and the numbers (for an error before any allocation).
    pub fn shortfall(&self) -> String {
        let parts: Vec<String> = self
            .parts
            .iter()
            .filter(|(_, b)| *b > 0)
            .map(|(p, b)| format!("{} {}", p.label(), human_bytes(*b)))
            .collect();
        let limit = match self.budget {
            Some(b) if b.saturating_add(self.bytes(Part::Reserve)) < self.free => {
                format!("--vram-budget {} + reserve", human_bytes(b))
            }
            _ => format!("{} free on the device", human_bytes(self.free)),
        };
        let kv = match self.bytes(Part::KvCache) {
            0 => String::new(),
            _ => format!(
                "; the KV cache ({} tokens) shrinks with a lower --kv-tokens, --parallel or --max-context",
                self.kv_cells
            ),
        };
        format!(
            "the memory plan needs {} ({}) and the limit is {limit}{kv}",
            human_bytes(self.total()),
            parts.join(" + ")
        )
    }
}

/// [`MemoryPlan::limit`] of a device with `free` bytes free, a budget and a reserve.
/// The prefill buffers' bytes ([`Part::PrefillBuffers`]) for chunks of `chunk` tokens: six f32 buffers of the
/// widest row (the FFN's, or the routed experts' together), one f16 copy of the chunk's hidden states, and the
/// largest dense matrix (`largest_elements`) dequantized to f16 for the GEMM. Saturating.
pub fn prefill_bytes(hp: &HParams, largest_elements: u64, chunk: usize) -> u64 {
    let chunk = chunk as u64;
    let widest = (hp.n_embd.max(hp.n_ff).max(hp.n_ff_exp * hp.n_expert_used.max(1)) as u64).max(1);
    chunk
        .saturating_mul(widest)
        .saturating_mul(4 * 6)
        .saturating_add(largest_elements.saturating_mul(2))
        .saturating_add(chunk.saturating_mul(hp.n_embd as u64).saturating_mul(2))
}

/// Most tokens of a prefill step whose experts run on the CUDA backend's integer tensor cores (`mmq_moe_*`) by
/// default (`STRATA_MMQ_PREFILL_TOKENS` sets it, up to [`MMQ_MOE_TOKENS_MAX`]): past it they take the f16 GEMM. On
/// an H100, Qwen3-30B-A3B shape, 256 against 128: pp136 +9.5%, pp192 +3.9%, pp256 the same
/// (reports/2026-12-07-h100-mmq-prefill-256/).
pub const MMQ_MOE_TOKENS: usize = 256;

/// The most `STRATA_MMQ_PREFILL_TOKENS` may say, so that the Q8_K stages of such a step stay small: 5,184 bytes a
/// token and a routed row, 11.4 MiB asked at 256 tokens of top-8 (a scratch slot grows by half again, so up to about
/// 17 MiB taken). The memory plan does not count them apart: such a step leaves most of the chunk's f32 buffers
/// unused (a chunk of 512 tokens plans 75 MiB of them on the Qwen3-30B-A3B shape) and takes no f16 copies for the
/// GEMM.
pub const MMQ_MOE_TOKENS_MAX: usize = 256;

pub(crate) fn limit_of(free: u64, budget: Option<u64>, reserve: u64) -> u64 {
    budget.map_or(free, |b| free.min(b.saturating_add(reserve)))
}

/// KV cells the sequences of `config` share: `--kv-tokens` rounded up to whole blocks of
/// [`crate::state::kv::KV_BLOCK_CELLS`], at most (and by default) every sequence at its whole context
/// ([`full_pool_cells`]).
pub fn kv_cells(config: &PlanConfig) -> usize {
    let full = full_pool_cells(config.context, config.sequences);
    config.kv_tokens.map_or(full, |t| whole_blocks(t).min(full))
}

/// KV cells that hold `sequences` sequences of `context` cells each at once: each sequence's cells in whole blocks
/// of [`crate::state::kv::KV_BLOCK_CELLS`] (a block is never split between two sequences).
pub fn full_pool_cells(context: usize, sequences: usize) -> usize {
    whole_blocks(context).saturating_mul(sequences.max(1))
}

/// `cells` rounded up to whole KV blocks.
fn whole_blocks(cells: usize) -> usize {
    let b = crate::state::kv::KV_BLOCK_CELLS;
    cells.div_ceil(b).saturating_mul(b)
}

/// Bytes of a KV cache of `cells` cells of type `ty`: what [`crate::state::kv::KvCache::new`] allocates.
///
/// Errors: [`KvError::HeadDim`] for an int8 cache of a head width that is not a multiple of 32.
pub fn kv_bytes(shape: &KvShape, ty: KvType, cells: usize) -> Result<u64, KvError> {
    Ok((shape.cell_bytes(ty)? as u64).saturating_mul(cells as u64))
}

/// What `strata inspect` shows of the plan: the weights and the KV cache at a few context lengths.
#[derive(Debug, Clone, serde::Serialize)]
pub struct MemoryEstimate {
    pub weights_bytes: u64,
    /// Of which routed experts.
    pub expert_bytes: u64,
    /// KV-cache bytes per token with f16 K and V; `None` when the hyper-parameters cannot be read.
    pub kv_f16_bytes_per_token: Option<u64>,
    /// Weights + KV cache at each context length.
    pub at_context: Vec<ContextEstimate>,
}

/// Weights + KV cache at one context length, in bytes; `None` where that cache cannot be made (an int8 cache
/// needs head widths that are multiples of 32) or sized (unreadable hyper-parameters).
#[derive(Debug, Clone, serde::Serialize)]
pub struct ContextEstimate {
    pub context_tokens: u64,
    pub total_kv_f16_bytes: Option<u64>,
    pub total_kv_int8_bytes: Option<u64>,
}

impl MemoryEstimate {
    /// The estimate for `model` at 4096 tokens and at its training context; `hp` is `None` when the
    /// hyper-parameters cannot be read (an unsupported architecture is still inspectable: weights only).
    pub fn new(model: &GgufModel, hp: Option<&HParams>) -> MemoryEstimate {
        let weights = WeightBytes::of(model);
        let mut contexts = vec![4096];
        if let Some(h) = hp
            && h.n_ctx_train > 0
            && h.n_ctx_train != 4096
        {
            contexts.push(h.n_ctx_train as usize);
        }
        let with_kv = |ty: KvType, n: usize| {
            let kv = kv_bytes(&hp?.kv_shape(), ty, n).ok()?;
            Some(weights.total().saturating_add(kv))
        };
        MemoryEstimate {
            weights_bytes: weights.total(),
            expert_bytes: weights.experts,
            kv_f16_bytes_per_token: hp.and_then(|h| h.kv_shape().cell_bytes(KvType::F16).ok().map(|b| b as u64)),
            at_context: contexts
                .into_iter()
                .map(|n| ContextEstimate {
                    context_tokens: n as u64,
                    total_kv_f16_bytes: with_kv(KvType::F16, n),
                    total_kv_int8_bytes: with_kv(KvType::Int8, n),
                })
                .collect(),
        }
    }

    /// The estimate as `strata inspect` prints it.
    pub fn to_text(&self) -> String {
        let why = if self.kv_f16_bytes_per_token.is_none() {
            "n/a (hyper-parameters unreadable)"
        } else {
            "n/a (head width not a multiple of 32)"
        };
        let or_na = |b: Option<u64>| b.map_or(why.into(), human_bytes);
        let mut s = String::from("\nmemory estimate (weights + KV cache)\n");
        s += &format!("  weights          {}", human_bytes(self.weights_bytes));
        if self.expert_bytes > 0 {
            s += &format!(" (routed experts {})", human_bytes(self.expert_bytes));
        }
        s += "\n";
        s += &format!("  KV f16 per token {}\n", or_na(self.kv_f16_bytes_per_token));
        for c in &self.at_context {
            s += &format!(
                "  context {:>6}   {} with f16 KV, {} with int8 KV\n",
                c.context_tokens,
                or_na(c.total_kv_f16_bytes),
                or_na(c.total_kv_int8_bytes)
            );
        }
        s
    }
}

/// `b` bytes as GiB with three decimals and the exact count: `23.987 GiB (25756696576 B)`.
pub fn gib(b: u64) -> String {
    format!("{:.3} GiB ({b} B)", b as f64 / (1u64 << 30) as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hp(head_dim: u32) -> HParams {
        let mut md = crate::gguf::Metadata::new();
        use crate::gguf::Value;
        md.insert("general.architecture", Value::String("llama".into()));
        for (k, v) in [
            ("block_count", 2),
            ("embedding_length", 64 * 4),
            ("feed_forward_length", 512),
            ("attention.head_count", 4),
            ("attention.head_count_kv", 2),
            ("attention.key_length", head_dim),
            ("attention.value_length", head_dim),
            ("context_length", 8192),
            ("vocab_size", 100),
        ] {
            md.insert(format!("llama.{k}"), Value::U32(v));
        }
        md.insert("llama.attention.layer_norm_rms_epsilon", Value::F32(1e-5));
        HParams::from_metadata(&md).unwrap()
    }

    const W: WeightBytes = WeightBytes {
        dense: 1000,
        experts: 0,
        largest_elements: 10,
    };

    #[test]
    fn kv_part_is_what_the_cache_allocates() {
        let h = hp(64);
        let cfg = PlanConfig {
            context: 300,
            sequences: 1,
            kv_tokens: None,
            kv: KvType::F16,
            prefill_chunk: 8,
            reserve: 7,
            cache: CacheSize::Auto,
            budget: None,
            table_steps: true,
        };
        let plan = MemoryPlan::new(&W, &h, None, &cfg, u64::MAX).unwrap();
        let mut cache = crate::state::kv::KvCache::new(&h.kv_shape(), 300, KvType::F16).unwrap();
        for cell in 0..300 {
            for l in &mut cache.layers {
                l.k.write(cell, &[0.5; 128]);
                l.v.write(cell, &[0.5; 128]);
            }
        }
        // 2 layers x 2 heads x (64 + 64) values x 2 bytes x 304 cells (300 in whole blocks of 16), counted by hand:
        // what the cache holds once its 300 cells are written.
        assert_eq!(plan.bytes(Part::KvCache), 2 * 2 * 128 * 2 * 304);
        assert_eq!(plan.bytes(Part::KvCache), cache.held_bytes() as u64);
        assert_eq!(plan.bytes(Part::Reserve), 7);
        assert_eq!(plan.bytes(Part::Experts), 0);
        // Prefill: 8 x 512 x 24 + 10 x 2 + 8 x 256 x 2.
        assert_eq!(plan.bytes(Part::PrefillBuffers), 8 * 512 * 24 + 20 + 8 * 256 * 2);
        assert_eq!(
            plan.total(),
            1000 + 2 * 2 * 128 * 2 * 304 + 8 * 512 * 24 + 20 + 8 * 256 * 2 + 7
        );
    }

    #[test]
    fn verdict_turns_at_the_total() {
        let cfg = PlanConfig::from_flags(&PlanFlags::default(), 8192);
        assert_eq!(cfg.reserve, 700 << 20);
        let at = |free| MemoryPlan::new(&W, &hp(64), None, &cfg, free).unwrap();
        let total = at(u64::MAX).total();
        assert_eq!(at(total).context, 4096);
        assert_eq!(at(total).verdict(), Verdict::Fits);
        assert_eq!(at(total - 1).verdict(), Verdict::DoesNotFit);
        let text = at(total - 1).to_text();
        assert!(text.contains("plan vs free               DOES NOT FIT"), "{text}");
        assert!(at(total - 1).shortfall().contains("free on the device"));
        let why = at(total - 1).shortfall();
        assert!(
            why.contains("the KV cache (4096 tokens) shrinks with a lower --kv-tokens, --parallel or --max-context"),
            "{why}"
        );
        // A budget caps the parts, the reserve apart.
        let budget = PlanConfig {
            budget: Some(total - cfg.reserve - 1),
            ..cfg
        };
        let p = MemoryPlan::new(&W, &hp(64), None, &budget, u64::MAX).unwrap();
        assert_eq!(p.verdict(), Verdict::DoesNotFit);
        assert!(p.shortfall().contains("--vram-budget"), "{}", p.shortfall());
        assert!(p.to_text().contains("budget (--vram-budget)"));
    }

    #[test]
    fn the_expert_cache_takes_what_the_other_parts_leave() {
        // 2 MoE layers of 8 experts of 1,000-byte slots (top-2: 8 staging slots, one layer's worth).
        let g = ExpertGeometry {
            moe_layers: 2,
            n_expert: 8,
            k: 2,
            slot_bytes: 1000,
        };
        let w = WeightBytes {
            experts: 16 * 1000,
            ..W
        };
        let cfg = PlanConfig {
            context: 16,
            sequences: 1,
            kv_tokens: None,
            kv: KvType::F16,
            prefill_chunk: 8,
            reserve: 100,
            cache: CacheSize::Auto,
            budget: None,
            table_steps: true,
        };
        let resident = MemoryPlan::new(&w, &hp(64), Some(&g), &cfg, u64::MAX).unwrap();
        assert_eq!(resident.experts, Some(ExpertPlacement::AllResident));
        assert_eq!(resident.bytes(Part::Experts), 16_000);
        let others = resident.total() - 16_000;
        // 1 byte short of every expert: 8 staging slots and what is left, 7 slots (7,999 / 1,000).
        let tight = MemoryPlan::new(&w, &hp(64), Some(&g), &cfg, others + 15_999).unwrap();
        assert_eq!(tight.cache_slots(), Some(7));
        assert_eq!(tight.bytes(Part::ExpertCache), 7_000);
        assert_eq!(tight.bytes(Part::ExpertStaging), 8_000);
        assert_eq!(tight.bytes(Part::Experts), 0);
        assert_eq!(tight.verdict(), Verdict::Fits);
        assert!(
            tight.to_text().contains("expert cache (7 slots)"),
            "{}",
            tight.to_text()
        );
        // The same through a budget on a large card: the budget excludes the reserve (a large one here, so
        // counting it inside the budget would leave no slot).
        let big_reserve = PlanConfig { reserve: 9_000, ..cfg };
        let others_big = others - 100 + 9_000;
        let budget = PlanConfig {
            budget: Some(others_big + 15_999 - 9_000),
            ..big_reserve
        };
        let b = MemoryPlan::new(&w, &hp(64), Some(&g), &budget, 1 << 40).unwrap();
        assert_eq!(b.cache_slots(), Some(7));
        assert_eq!(b.limit(), others_big + 15_999);
        assert_eq!(b.verdict(), Verdict::Fits);
        // The host side: the arena against the host's memory, apart from the device's verdict.
        let host = tight.clone().with_host_arena(16_000, Some(15_999));
        assert_eq!(
            (host.verdict(), host.host_verdict()),
            (Verdict::Fits, Some(Verdict::DoesNotFit))
        );
        assert!(
            host.to_text()
                .contains("arena vs host              DOES NOT FIT (the experts are read in place instead)"),
            "{}",
            host.to_text()
        );
        assert_eq!(
            tight.clone().with_host_arena(16_000, Some(16_000)).host_verdict(),
            Some(Verdict::Fits)
        );
        assert_eq!(tight.clone().with_host_arena(16_000, None).host_verdict(), None);
        // No room for the staging slots: 0 slots and a plan that does not fit.
        let none = MemoryPlan::new(&w, &hp(64), Some(&g), &cfg, others + 10).unwrap();
        assert_eq!((none.cache_slots(), none.verdict()), (Some(0), Verdict::DoesNotFit));
    }

    #[test]
    fn int8_plan_of_a_head_width_the_cache_refuses_is_an_error() {
        let cfg = PlanConfig {
            context: 16,
            sequences: 1,
            kv_tokens: None,
            kv: KvType::Int8,
            prefill_chunk: 8,
            reserve: 0,
            cache: CacheSize::Auto,
            budget: None,
            table_steps: true,
        };
        assert_eq!(
            MemoryPlan::new(&W, &hp(48), None, &cfg, u64::MAX),
            Err(KvError::HeadDim { head_dim: 48 })
        );
        assert!(MemoryPlan::new(&W, &hp(64), None, &cfg, u64::MAX).is_ok());
    }

    #[test]
    fn expert_tensors_are_told_from_shared_and_dense_ones() {
        assert!(is_routed_expert("blk.3.ffn_gate_exps.weight"));
        assert!(is_routed_expert("blk.3.ffn_down_exps.weight"));
        assert!(!is_routed_expert("blk.3.ffn_gate_shexp.weight"));
        assert!(!is_routed_expert("blk.3.ffn_gate_inp.weight"));
        assert!(!is_routed_expert("blk.3.ffn_up.weight"));
    }

    #[test]
    fn flags_round_trip_through_their_arguments() {
        #[derive(clap::Parser)]
        struct P {
            #[command(flatten)]
            plan: PlanFlags,
        }
        use clap::Parser;
        let f = P::parse_from(["x", "--kv", "int8", "--max-context", "100", "--prefill", "auto"]).plan;
        let back = P::parse_from(std::iter::once("x".to_string()).chain(f.to_args())).plan;
        assert_eq!(back.to_args(), f.to_args());
        assert_eq!(
            (back.kv, back.max_context, back.prefill),
            (KvType::Int8, Some(100), Some(PrefillChunk(None)))
        );
        assert!(P::try_parse_from(["x", "--max-context", "0"]).is_err());
    }
}
