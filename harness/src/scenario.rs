//! Scenarios: the YAML a bug report becomes (DESIGN.md section 3, "Scenarios and reports").
//!
//! A scenario names a model, a device, engine args and env, a matrix of named arms, cases (prompts, sweeps,
//! repetitions) and expectations. The Rust types below are the schema: `scenario.schema.json` is generated from
//! them ([`json_schema`]) and checked in, so editors complete and check scenario files. [`load`] parses with
//! line-accurate errors and a "did you mean" suggestion for a misspelt key, then [`Scenario::validate`] checks
//! what the types cannot.

use std::collections::BTreeMap;
use std::path::Path;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// One scenario file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Scenario {
    /// Short name; it becomes part of the report folder's name (letters, digits, `-` and `_`).
    pub name: String,
    /// What the scenario replays (the bug report it comes from, and what it shows).
    #[serde(default)]
    pub description: String,
    /// A .gguf path, or `default` for the default model (fetched on first use).
    #[serde(default = "default_model")]
    pub model: String,
    /// `cpu`, `cuda:N`, `sim:PROFILE`, or CUDA devices split by layers (`cuda:0,cuda:1`); `--device` overrides it.
    #[serde(default = "default_device")]
    pub device: String,
    /// `strata serve` arguments shared by every arm.
    #[serde(default)]
    pub args: Vec<String>,
    /// Environment of `strata serve` (and its worker), shared by every arm.
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// Axes of named arms; the runs are their Cartesian product, in file order (axes sorted by name).
    #[serde(default)]
    pub matrix: BTreeMap<String, Vec<Arm>>,
    /// A matrix axis of the engine's speed switches (`strata switches`), added to `matrix`: arm `defaults` (the
    /// device's defaults), then one arm per switch that flips it (`PDL-off`: `STRATA_PDL=0`; `CPU_AVX512-on`),
    /// and, for `exact`, arm `all-exact-off` (`STRATA_ARCH_DEFAULTS=0`, the inexact switches kept at their
    /// defaults). With `same_tokens_as: defaults` and `same_logits_as: defaults`, it checks that an exact switch
    /// changes nothing.
    #[serde(default)]
    pub switches: Option<SwitchAxis>,
    /// Combinations of the matrix not to run: each entry maps axes to arm names (`{cache: resident, store:
    /// mmap}`), and drops every combination that has all of them (as GitHub Actions' `matrix.exclude`).
    #[serde(default)]
    pub exclude: Vec<BTreeMap<String, String>>,
    /// Requests per case (or per sweep point); the report gives median, min and max.
    #[serde(default = "one")]
    pub repetitions: u32,
    /// Most tokens generated per request.
    #[serde(default = "default_max_tokens")]
    pub max_tokens: usize,
    /// Expectations every case starts from (a case or an arm may override fields).
    #[serde(default)]
    pub expect: Expect,
    /// The cases, run in order against each arm's server.
    pub cases: Vec<Case>,
    /// A smaller run for `--quick` and for `cargo test`.
    #[serde(default)]
    pub quick: Option<Quick>,
    /// What to capture besides the worker's events, log and /metrics (always captured).
    #[serde(default)]
    pub captures: Captures,
}

fn default_model() -> String {
    "default".into()
}
fn default_device() -> String {
    "cpu".into()
}
fn one() -> u32 {
    1
}
fn default_max_tokens() -> usize {
    16
}
fn default_sample_ms() -> u64 {
    200
}

/// A named arm of one matrix axis: the arguments and environment it adds.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Arm {
    /// The arm's name within its axis (for example `on`, `off`, `f16`).
    pub name: String,
    /// Extra `strata serve` arguments.
    #[serde(default)]
    pub args: Vec<String>,
    /// Extra environment.
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// Exact counts of worker events over the whole run of a combination containing this arm (for example
    /// `fallback: 1`).
    #[serde(default)]
    pub expect_events: BTreeMap<String, u64>,
    /// The server of a combination containing this arm must fail to start, and the error it logs must contain
    /// this text (a replayed start-up failure, such as seed 001's allocation after the cache). Its cases do not
    /// run.
    #[serde(default)]
    pub expect_start_error: Option<String>,
    /// The device of a combination containing this arm, in place of the scenario's (and `--device`'s): a
    /// replay of several reports runs each on its own card (`sim:gfx1100-rx7900xtx`).
    #[serde(default)]
    pub device: Option<String>,
    /// The worker's `probe` event (the link probe's check) in a combination containing this arm: whether its
    /// readings were plausible (seed 000's were not).
    #[serde(default)]
    pub expect_probe: Option<ProbeExpect>,
    /// The server a combination containing this arm starts: `strata` (the default), or `llama-server`
    /// (llama.cpp's, the reference of the load benchmarks, side by side in one report). A `llama-server`
    /// combination gets `--host`, `--port` and `-m MODEL` from the harness and the `args` of its `llama-server`
    /// arms, nothing else (the scenario's `args` and other arms' are `strata serve` flags); it has no worker
    /// events, restarts or `/metrics`. Its binary: `strata-harness run --llama-server PATH`, else the build of
    /// `fixtures/llamacpp/build.sh server` in the model cache.
    #[serde(default)]
    pub server: ServerKind,
}

/// [`Arm::server`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "kebab-case")]
pub enum ServerKind {
    #[default]
    Strata,
    LlamaServer,
}

impl ServerKind {
    /// The program, as a report names it.
    pub fn program(self) -> &'static str {
        match self {
            ServerKind::Strata => "strata serve",
            ServerKind::LlamaServer => "llama-server",
        }
    }
}

/// [`Scenario::switches`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct SwitchAxis {
    /// The axis's name in the matrix.
    #[serde(default = "default_switch_axis")]
    pub axis: String,
    /// `exact` (every speed switch declared exact), `all` (every speed switch), or a list of names (`PDL` or
    /// `STRATA_PDL`).
    pub switches: SwitchSet,
}

fn default_switch_axis() -> String {
    "switch".into()
}

/// Which speed switches a [`SwitchAxis`] sweeps.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(untagged)]
pub enum SwitchSet {
    /// `exact` or `all`.
    Word(SwitchWord),
    /// Switch names.
    List(Vec<String>),
}

/// `exact` or `all`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum SwitchWord {
    Exact,
    All,
}

impl SwitchAxis {
    /// The axis's arms (see [`Scenario::switches`]).
    ///
    /// Errors: a name that is not a speed switch (with the list of those that are), or one named twice.
    pub fn arms(&self) -> Result<Vec<Arm>, String> {
        use strata_engine::switches::{self, ARCH_DEFAULTS, SWITCHES};
        let speed: Vec<_> = SWITCHES.iter().filter_map(|s| s.speed.map(|sp| (s.name, sp))).collect();
        let chosen: Vec<_> = match &self.switches {
            SwitchSet::Word(SwitchWord::All) => speed.clone(),
            SwitchSet::Word(SwitchWord::Exact) => speed.iter().copied().filter(|(_, sp)| sp.exact).collect(),
            SwitchSet::List(names) if names.is_empty() => {
                return Err("switches: the list names no switch: name at least one, or write `exact` or `all`".into());
            }
            SwitchSet::List(names) => {
                let mut v = Vec::new();
                for n in names {
                    let full = if n.starts_with("STRATA_") {
                        n.clone()
                    } else {
                        format!("STRATA_{n}")
                    };
                    let Some(&found) = speed.iter().find(|(s, _)| *s == full) else {
                        let known: Vec<&str> = speed.iter().map(|(s, _)| switches::short_name(s)).collect();
                        return Err(format!(
                            "switches: `{n}` is not a speed switch (speed switches: {}; `strata switches` lists every switch)",
                            known.join(", ")
                        ));
                    };
                    if v.iter().any(|(s, _)| *s == found.0) {
                        return Err(format!("switches: `{n}` is named twice"));
                    }
                    v.push(found);
                }
                v
            }
        };
        let arm = |name: String, env: BTreeMap<String, String>| Arm {
            name,
            args: vec![],
            env,
            expect_events: BTreeMap::new(),
            expect_start_error: None,
            device: None,
            expect_probe: None,
            server: ServerKind::Strata,
        };
        let mut arms = vec![arm("defaults".into(), BTreeMap::new())];
        for (name, sp) in &chosen {
            let (word, value) = if sp.on { ("off", "0") } else { ("on", "1") };
            arms.push(arm(
                format!("{}-{word}", switches::short_name(name)),
                BTreeMap::from([(name.to_string(), value.to_string())]),
            ));
        }
        if self.switches == SwitchSet::Word(SwitchWord::Exact) {
            let mut env = BTreeMap::from([(ARCH_DEFAULTS.to_string(), "0".to_string())]);
            for (name, sp) in &speed {
                if !sp.exact && sp.on {
                    env.insert(name.to_string(), "1".into());
                }
            }
            arms.push(arm("all-exact-off".into(), env));
        }
        Ok(arms)
    }
}

/// What the link probe's check must conclude.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ProbeExpect {
    /// Every reading at most the link's physical peak.
    pub plausible: bool,
}

/// What the `fault` event of a request that killed its worker must say about the failed launch.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct FaultExpect {
    /// The kernel (or, on a `sim:` device, the backend op) the launch fault names.
    #[serde(default)]
    pub kernel: Option<String>,
    /// Whether launches were synchronised (`STRATA_SYNC_LAUNCHES=1`), so the named kernel is the culprit.
    #[serde(default)]
    pub synced: Option<bool>,
}

/// One case: a prompt, or a sweep of exact token counts.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Case {
    /// The case's name in the report.
    pub name: String,
    /// The prompt (absent when `sweep` gives token counts).
    #[serde(default)]
    pub prompt: Option<Prompt>,
    /// Exact prompt token counts to run, one request (times repetitions) each.
    #[serde(default)]
    pub sweep: Option<Sweep>,
    /// Concurrent streaming clients for a duration, at each client count (a load case: throughput and latency
    /// percentiles instead of one answer per request).
    #[serde(default)]
    pub load: Option<Load>,
    /// Overrides the scenario's `repetitions`.
    #[serde(default)]
    pub repetitions: Option<u32>,
    /// Overrides the scenario's `max_tokens`.
    #[serde(default)]
    pub max_tokens: Option<usize>,
    /// Expectation fields overriding the scenario's.
    #[serde(default)]
    pub expect: Expect,
    /// Per-arm expectation fields (keyed by arm name), overriding the case's. A key `a+b` joins arms of
    /// different axes: it applies to the combinations that hold all of them, after the single arms.
    #[serde(default)]
    pub arms: BTreeMap<String, Expect>,
    /// Arm names: the case runs only in the combinations that hold one of them (empty: in every one). A
    /// scenario replaying several reports keeps each report's cases to its own arms.
    #[serde(default)]
    pub only: Vec<String>,
}

impl Case {
    /// Whether the case runs in the combination of arms `arm_names`.
    pub fn runs_in(&self, arm_names: &[String]) -> bool {
        self.only.is_empty() || self.only.iter().any(|a| arm_names.contains(a))
    }
}

/// A load case: for each count in `clients`, that many clients each send a streamed request (`max_tokens` as the
/// case says) as soon as their last one ended, for `seconds`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Load {
    /// Client counts, one run each (1 to 256).
    pub clients: Vec<usize>,
    /// Seconds each run's clients start requests for (the run ends when the last one is answered).
    pub seconds: f64,
    /// Each request's prompt: exactly this many tokens of plain text with a prefix unique to the request, sent to
    /// /v1/completions (default: a short chat unique to the request, to /v1/chat/completions).
    #[serde(default)]
    pub prompt_tokens: Option<usize>,
    /// Goodput's time-to-first-token target, ms: a request counts toward goodput when it meets every target given.
    #[serde(default)]
    pub ttft_ms: Option<f64>,
    /// Goodput's time-per-output-token target, ms.
    #[serde(default)]
    pub tpot_ms: Option<f64>,
}

/// A prompt: exactly one of `text`, `messages` or `tokens`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Prompt {
    /// Literal text, sent to /v1/completions as is.
    #[serde(default)]
    pub text: Option<String>,
    /// A chat, sent to /v1/chat/completions (the model's template renders it).
    #[serde(default)]
    pub messages: Option<Vec<Message>>,
    /// A prompt of exactly this many tokens in the model's tokenizer, with a prefix unique to the request.
    #[serde(default)]
    pub tokens: Option<usize>,
}

/// One chat message.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Message {
    /// `system`, `user` or `assistant`.
    pub role: String,
    pub content: String,
}

/// Token counts to sweep: a list or a range.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Sweep {
    /// Prompt token counts, either a list (`[53, 60, 72]`) or a range (`{from: 16, to: 1024}`).
    pub tokens: SweepValues,
    /// Bisect the range for the first failing token count (a request answered other than 200, or a worker
    /// restart) in O(log n) requests, assuming every count past it fails too.
    #[serde(default)]
    pub find_boundary: bool,
}

/// A sweep's values.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(untagged)]
pub enum SweepValues {
    List(Vec<usize>),
    Range(Range),
}

/// An inclusive range of token counts.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Range {
    pub from: usize,
    pub to: usize,
    /// Linear step; without it the points double from `from` (and `to` is always included).
    #[serde(default)]
    pub step: Option<usize>,
}

/// The most points a sweep may have: each is a request per arm and repetition.
pub const MAX_SWEEP_POINTS: usize = 1024;

/// The largest prompt, in tokens, a case or sweep may ask for: past any model's context (16 Mi tokens), and
/// small enough that building it never exhausts memory.
pub const MAX_PROMPT_TOKENS: usize = 1 << 24;

impl Range {
    /// The range's points: doubling from `from` (or `step` apart), with `to` always last (with `find_boundary`,
    /// only `from` and `to` matter).
    ///
    /// Errors: `to` is past [`MAX_PROMPT_TOKENS`], or the range has more than [`MAX_SWEEP_POINTS`] points; the
    /// arithmetic is checked, so no range wraps or loops.
    pub fn checked_points(&self) -> Result<Vec<usize>, String> {
        if self.to > MAX_PROMPT_TOKENS {
            return Err(format!(
                "`to: {}` is past the largest prompt a scenario may ask for, {MAX_PROMPT_TOKENS} tokens",
                self.to
            ));
        }
        let mut v = Vec::new();
        let mut x = self.from.max(1);
        while x < self.to {
            // x and `to` still to come.
            if v.len() + 2 > MAX_SWEEP_POINTS {
                return Err(format!(
                    "the range from {} to {} ({}) has more than {MAX_SWEEP_POINTS} points",
                    self.from,
                    self.to,
                    self.step.map_or("doubling".to_string(), |s| format!("step {s}"))
                ));
            }
            v.push(x);
            x = match self.step {
                Some(s) => x.checked_add(s.max(1)),
                None => x.checked_mul(2),
            }
            .unwrap_or(usize::MAX);
        }
        v.push(self.to);
        Ok(v)
    }

    /// [`Range::checked_points`] of a range [`Scenario::validate`] accepted (empty for one it refuses).
    pub fn points(&self) -> Vec<usize> {
        self.checked_points().unwrap_or_default()
    }
}

/// What a request must show; every field is optional and merges over the level above.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Expect {
    /// HTTP status (default 200).
    #[serde(default)]
    pub status: Option<u16>,
    /// Worker restarts the request may cause (default 0).
    #[serde(default)]
    pub restarts: Option<u64>,
    /// Lowest prefill rate, tokens/s (median over repetitions).
    #[serde(default)]
    pub min_prefill_tok_s: Option<f64>,
    /// Lowest decode rate, tokens/s (median over repetitions).
    #[serde(default)]
    pub min_decode_tok_s: Option<f64>,
    /// Highest worker resident memory during the case, MiB (2^20 bytes).
    #[serde(default)]
    pub max_rss_mib: Option<f64>,
    /// The output must contain this text (case-sensitive).
    #[serde(default)]
    pub contains: Option<String>,
    /// The output must match this regular expression.
    #[serde(default)]
    pub regex: Option<String>,
    /// The output, tokenized again, must start with these token ids.
    #[serde(default)]
    pub golden_tokens: Option<Vec<u32>>,
    /// For a `find_boundary` sweep: the first failing token count, or `none` when nothing fails.
    #[serde(default)]
    pub boundary: Option<BoundaryExpect>,
    /// Lowest decode hit rate of the VRAM expert cache, as a fraction in 0..=1: hits over lookups of the
    /// request's `expert_cache` events of phase `decode`, pooled over the repetitions. A run without such events
    /// (every expert resident, or a dense model) fails it.
    #[serde(default)]
    pub min_decode_hit_rate: Option<f64>,
    /// An arm of another matrix axis whose output this one must equal, request by request: the combination
    /// with that arm in place of this combination's arm on its axis (or, when `exclude` drops that one, the only
    /// combination with the arm), and the same case and token count.
    /// Greedy requests through the expert cache must write what the all-resident run writes (`same_output_as:
    /// resident`). A combination that already has the arm is not checked against itself.
    #[serde(default)]
    pub same_output_as: Option<String>,
    /// As `same_output_as`, for the generated token ids (the worker's `request` events): an exact speed switch
    /// writes the tokens its `defaults` arm writes.
    #[serde(default)]
    pub same_tokens_as: Option<String>,
    /// As `same_tokens_as`, for every step's logits, bit for bit (digests of them: the harness runs every
    /// combination with `STRATA_LOGITS_DIGEST=1` when a scenario uses this). A mismatch names the first step
    /// that differs.
    #[serde(default)]
    pub same_logits_as: Option<String>,
    /// Each request killed its worker with a launch fault, and the worker's `fault` event says this about it
    /// (seed 003: which kernel, and whether launches were synchronised).
    #[serde(default)]
    pub fault: Option<FaultExpect>,
}

/// An expected boundary: a token count, or `none`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(untagged)]
pub enum BoundaryExpect {
    At(usize),
    /// The word `none`.
    None(NoneWord),
}

/// The word `none`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum NoneWord {
    None,
}

impl Expect {
    /// `self` with every field `over` sets replaced.
    pub fn merged(&self, over: &Expect) -> Expect {
        Expect {
            status: over.status.or(self.status),
            restarts: over.restarts.or(self.restarts),
            min_prefill_tok_s: over.min_prefill_tok_s.or(self.min_prefill_tok_s),
            min_decode_tok_s: over.min_decode_tok_s.or(self.min_decode_tok_s),
            max_rss_mib: over.max_rss_mib.or(self.max_rss_mib),
            contains: over.contains.clone().or_else(|| self.contains.clone()),
            regex: over.regex.clone().or_else(|| self.regex.clone()),
            golden_tokens: over.golden_tokens.clone().or_else(|| self.golden_tokens.clone()),
            boundary: over.boundary.clone().or_else(|| self.boundary.clone()),
            min_decode_hit_rate: over.min_decode_hit_rate.or(self.min_decode_hit_rate),
            same_output_as: over.same_output_as.clone().or_else(|| self.same_output_as.clone()),
            same_tokens_as: over.same_tokens_as.clone().or_else(|| self.same_tokens_as.clone()),
            same_logits_as: over.same_logits_as.clone().or_else(|| self.same_logits_as.clone()),
            fault: over.fault.clone().or_else(|| self.fault.clone()),
        }
    }
}

/// The smaller run used by `--quick` and `cargo test`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Quick {
    /// Sweep points and ranges are capped at this many prompt tokens.
    pub max_prompt_tokens: usize,
    /// Repetitions per case.
    #[serde(default = "one")]
    pub repetitions: u32,
    /// Load runs last at most this many seconds (default 5).
    #[serde(default = "five")]
    pub load_seconds: f64,
}

fn five() -> f64 {
    5.0
}

/// Optional captures.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Captures {
    /// Memory sampling period, ms.
    #[serde(default = "default_sample_ms")]
    pub memory_sample_ms: u64,
}

impl Default for Captures {
    fn default() -> Self {
        Captures {
            memory_sample_ms: default_sample_ms(),
        }
    }
}

/// A scenario that cannot be used: where and why, written for the person at the terminal.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScenarioError {
    /// The file as given.
    pub file: String,
    /// 1-based line (0 when unknown).
    pub line: usize,
    /// 1-based column (0 when unknown).
    pub column: usize,
    /// What is wrong, and the fix when there is an obvious one.
    pub message: String,
}

impl std::fmt::Display for ScenarioError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.line == 0 {
            write!(f, "{}: {}", self.file, self.message)
        } else {
            write!(f, "{}:{}:{}: {}", self.file, self.line, self.column, self.message)
        }
    }
}

impl std::error::Error for ScenarioError {}

/// Reads and validates a scenario file.
///
/// Errors: an unreadable file; YAML or schema errors (with line, column and a suggestion); a failed
/// [`Scenario::validate`].
pub fn load(path: &Path) -> Result<Scenario, ScenarioError> {
    let text = std::fs::read_to_string(path).map_err(|e| ScenarioError {
        file: path.display().to_string(),
        line: 0,
        column: 0,
        message: format!("cannot read the scenario: {e}"),
    })?;
    parse(&path.display().to_string(), &text)
}

/// Parses and validates scenario text; `file` names it in errors.
///
/// Errors: as [`load`].
pub fn parse(file: &str, text: &str) -> Result<Scenario, ScenarioError> {
    let de = yaml_serde::Deserializer::from_str(text);
    let scenario: Scenario = serde_path_to_error::deserialize(de).map_err(|e| {
        let inner = e.into_inner();
        let (line, column) = inner.location().map_or((0, 0), |l| (l.line(), l.column()));
        let raw = inner.to_string();
        // yaml_serde appends " at line L column C"; we print the location up front instead.
        // Its message already starts with the path (`cases[0].expect: ...`).
        let mut msg = raw.split(" at line ").next().unwrap_or(&raw).to_string();
        if msg.contains("untagged enum SwitchSet") {
            msg = "switches.switches: give `exact`, `all`, or a list of speed switch names (`[PDL, CPU_AVX512]`; `strata switches` lists them)".into();
        } else if msg.starts_with("switches:") && msg.contains("expected struct SwitchAxis") {
            msg.push_str(": write `switches: {switches: exact}` (or `all`, or a list of names), with `axis: NAME` to name the axis");
        }
        ScenarioError {
            file: file.to_string(),
            line,
            column,
            message: format!("{msg}{}", suggestion(&msg)),
        }
    })?;
    let mut scenario = scenario;
    scenario.expand_switches().map_err(|message| ScenarioError {
        file: file.to_string(),
        line: locate_key(text, "switches"),
        column: if locate_key(text, "switches") > 0 { 1 } else { 0 },
        message,
    })?;
    if let Some((case, message)) = scenario.token_bounds() {
        let (line, column) = locate(text, case, "tokens");
        return Err(ScenarioError {
            file: file.to_string(),
            line,
            column,
            message,
        });
    }
    scenario.validate().map_err(|message| ScenarioError {
        file: file.to_string(),
        line: 0,
        column: 0,
        message,
    })?;
    Ok(scenario)
}

/// The 1-based line and column of key `key` in case `case` of scenario text `text` (the first such key after
/// the case's `name:` line, within the case), or (0, 0) when it cannot be found.
fn locate(text: &str, case: &str, key: &str) -> (usize, usize) {
    let lines: Vec<&str> = text.lines().collect();
    let Some(cases) = lines.iter().position(|l| l.trim_end() == "cases:") else {
        return (0, 0);
    };
    let name_of = |l: &str| -> Option<String> {
        let t = l.trim_start().strip_prefix('-').unwrap_or(l.trim_start()).trim_start();
        let v = t.strip_prefix("name:")?.trim();
        Some(v.trim_matches(|c| c == '"' || c == '\'').to_string())
    };
    let Some(start) = (cases + 1..lines.len()).find(|&i| name_of(lines[i]).as_deref() == Some(case)) else {
        return (0, 0);
    };
    // The case's own indentation (its `- ` item); a line at that indentation or less starting another item ends it.
    let indent = lines[start].len() - lines[start].trim_start().len();
    let pattern = format!("{key}:");
    for (i, l) in lines.iter().enumerate().skip(start) {
        let here = l.len() - l.trim_start().len();
        if i > start && !l.trim().is_empty() && here <= indent && l.trim_start().starts_with('-') {
            break;
        }
        if let Some(c) = l.find(&pattern) {
            return (i + 1, c + 1);
        }
    }
    (0, 0)
}

/// "; did you mean `x`?" for serde's `unknown field `a`, expected one of `b`, `c`` and `unknown variant`
/// messages, when one expected name is close.
fn suggestion(msg: &str) -> String {
    let Some(at) = msg.find("unknown field").or_else(|| msg.find("unknown variant")) else {
        return String::new();
    };
    let msg = &msg[at..];
    let quoted: Vec<&str> = msg.split('`').skip(1).step_by(2).collect();
    let Some((got, expected)) = quoted.split_first() else {
        return String::new();
    };
    expected
        .iter()
        .map(|e| (strsim::damerau_levenshtein(got, e), *e))
        .filter(|&(d, e)| d <= 2.max(e.len() / 3))
        .min()
        .map(|(_, e)| format!("; did you mean `{e}`?"))
        .unwrap_or_default()
}

/// The 1-based line of top-level key `key` in `text`, or 0.
fn locate_key(text: &str, key: &str) -> usize {
    let pattern = format!("{key}:");
    text.lines().position(|l| l.starts_with(&pattern)).map_or(0, |i| i + 1)
}

impl Scenario {
    /// Adds [`Scenario::switches`]'s axis to the matrix (once: the field is then `None`).
    ///
    /// Errors: the axis's name is already an axis of the matrix; [`SwitchAxis::arms`]'s errors.
    pub fn expand_switches(&mut self) -> Result<(), String> {
        let Some(sw) = self.switches.take() else {
            return Ok(());
        };
        if self.matrix.contains_key(&sw.axis) {
            return Err(format!(
                "switches: the matrix already has an axis `{}`: name the switches' axis otherwise (`axis: NAME`)",
                sw.axis
            ));
        }
        let arms = sw.arms()?;
        // What the axis sets (the switches it flips, and the master switch) must not be set for every arm alike.
        let master = strata_engine::switches::ARCH_DEFAULTS.to_string();
        let flipped: Vec<&String> = arms.iter().flat_map(|a| a.env.keys()).chain([&master]).collect();
        let owners = std::iter::once(("the scenario's env".to_string(), &self.env)).chain(self.matrix.iter().flat_map(
            |(axis, arms)| {
                arms.iter()
                    .map(move |a| (format!("arm `{}` of axis `{axis}`", a.name), &a.env))
            },
        ));
        for (owner, env) in owners {
            if let Some(k) = env.keys().find(|k| flipped.contains(k)) {
                return Err(format!(
                    "switches: {owner} sets {k}, which the `{}` axis sets per arm: with it the arms would not differ as their names say; drop it",
                    sw.axis
                ));
            }
        }
        for a in &arms {
            if let Some(axis) = self.axis_of(&a.name) {
                return Err(format!(
                    "switches: the `{}` axis's arm `{}` has the name of an arm of axis `{axis}`: rename that arm",
                    sw.axis, a.name
                ));
            }
        }
        self.matrix.insert(sw.axis.clone(), arms);
        Ok(())
    }

    /// Every expectation: the scenario's, each case's and each case's per-arm ones.
    fn expectations(&self) -> impl Iterator<Item = &Expect> {
        std::iter::once(&self.expect).chain(
            self.cases
                .iter()
                .flat_map(|c| std::iter::once(&c.expect).chain(c.arms.values())),
        )
    }

    /// Whether an expectation compares combinations with each other (`same_output_as`, `same_tokens_as`,
    /// `same_logits_as`): such a scenario's checks are judged only when the combinations run together.
    pub fn compares_combinations(&self) -> bool {
        self.expectations()
            .any(|e| e.same_output_as.is_some() || e.same_tokens_as.is_some() || e.same_logits_as.is_some())
    }

    /// Whether an expectation anywhere compares logits (`same_logits_as`): every combination then runs with
    /// `STRATA_LOGITS_DIGEST=1`.
    pub fn compares_logits(&self) -> bool {
        self.expectations().any(|e| e.same_logits_as.is_some())
    }

    /// The first case whose prompt or sweep asks for more than a scenario may ([`MAX_PROMPT_TOKENS`] tokens, or
    /// [`MAX_SWEEP_POINTS`] points): its name and the error, which names it.
    fn token_bounds(&self) -> Option<(&str, String)> {
        for c in &self.cases {
            let err = |e: String| Some((c.name.as_str(), format!("case `{}`: {e}", c.name)));
            if let Some(n) = c.prompt.as_ref().and_then(|p| p.tokens)
                && n > MAX_PROMPT_TOKENS
            {
                return err(format!(
                    "`tokens: {n}` is past the largest prompt a scenario may ask for, {MAX_PROMPT_TOKENS} tokens"
                ));
            }
            let Some(s) = &c.sweep else { continue };
            let e = match &s.tokens {
                SweepValues::List(v) if v.len() > MAX_SWEEP_POINTS => Some(format!(
                    "the sweep lists {} token counts, more than {MAX_SWEEP_POINTS}",
                    v.len()
                )),
                SweepValues::List(v) => v.iter().find(|&&n| n > MAX_PROMPT_TOKENS).map(|n| {
                    format!("the sweep's {n} tokens are past the largest prompt a scenario may ask for, {MAX_PROMPT_TOKENS} tokens")
                }),
                // Bisected: only the ends are requested.
                SweepValues::Range(r) if s.find_boundary => (r.to > MAX_PROMPT_TOKENS).then(|| {
                    format!("`to: {}` is past the largest prompt a scenario may ask for, {MAX_PROMPT_TOKENS} tokens", r.to)
                }),
                SweepValues::Range(r) => r.checked_points().err(),
            };
            if let Some(e) = e {
                return err(e);
            }
        }
        None
    }

    /// Checks what the types cannot: names, one prompt kind per case, sweeps over token counts, arm names the
    /// cases refer to.
    ///
    /// Errors: the first problem, as one line naming the case or arm.
    pub fn validate(&self) -> Result<(), String> {
        if let Some((_, message)) = self.token_bounds() {
            return Err(message);
        }
        let ok_name = |s: &str| !s.is_empty() && s.chars().all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_');
        if !ok_name(&self.name) {
            return Err(format!(
                "name `{}` must be non-empty and use only letters, digits, `-` and `_`",
                self.name
            ));
        }
        if self.cases.is_empty() {
            return Err("cases: at least one case is needed".into());
        }
        if self.repetitions == 0 || self.max_tokens == 0 {
            return Err("repetitions and max_tokens must be at least 1".into());
        }
        let mut arm_names = Vec::new();
        for (axis, arms) in &self.matrix {
            if !ok_name(axis) {
                return Err(format!(
                    "matrix: axis name `{axis}` must be non-empty and use only letters, digits, `-` and `_` (it names the logs' files)"
                ));
            }
            if arms.is_empty() {
                return Err(format!("matrix.{axis}: an axis needs at least one arm"));
            }
            for a in arms {
                if !ok_name(&a.name) {
                    return Err(format!(
                        "matrix.{axis}: arm name `{}` must use letters, digits, `-`, `_`",
                        a.name
                    ));
                }
                if arm_names.contains(&a.name) {
                    return Err(format!("matrix.{axis}: arm name `{}` is used twice", a.name));
                }
                arm_names.push(a.name.clone());
            }
        }
        for (i, ex) in self.exclude.iter().enumerate() {
            if ex.is_empty() {
                return Err(format!("exclude[{i}]: an entry needs at least one `axis: arm` pair"));
            }
            for (axis, arm) in ex {
                let Some(arms) = self.matrix.get(axis) else {
                    let axes: Vec<&str> = self.matrix.keys().map(String::as_str).collect();
                    return Err(format!(
                        "exclude[{i}]: `{axis}` is not an axis of the matrix (axes: {})",
                        if axes.is_empty() {
                            "none".to_string()
                        } else {
                            axes.join(", ")
                        }
                    ));
                };
                if !arms.iter().any(|a| &a.name == arm) {
                    let names: Vec<&str> = arms.iter().map(|a| a.name.as_str()).collect();
                    return Err(format!(
                        "exclude[{i}]: `{arm}` is not an arm of axis `{axis}` (arms: {})",
                        names.join(", ")
                    ));
                }
            }
        }
        self.check_expect("expect", &self.expect, &arm_names)?;
        for arm in self.matrix.values().flatten() {
            if arm.expect_start_error.as_ref().is_some_and(|t| t.trim().is_empty()) {
                return Err(format!(
                    "arm `{}`: expect_start_error is empty, which any log contains: give the text the error must hold",
                    arm.name
                ));
            }
            if let Some(d) = &arm.device {
                d.parse::<strata_engine::device::Device>()
                    .map_err(|e| format!("arm `{}`: device `{d}`: {e}", arm.name))?;
            }
        }
        let running = self.running_arm_names();
        if self.compares_logits() {
            let digest = strata_engine::switches::LOGITS_DIGEST;
            let envs = std::iter::once(("the scenario's env".to_string(), &self.env)).chain(
                self.matrix
                    .values()
                    .flatten()
                    .map(|a| (format!("arm `{}`", a.name), &a.env)),
            );
            for (owner, env) in envs {
                if let Some(v) = env.get(digest) {
                    return Err(format!(
                        "{owner} sets {digest} ({v:?}), and a `same_logits_as` compares the digests the harness turns on with it: drop it"
                    ));
                }
            }
        }
        for (key, x) in self.expectations().flat_map(|e| {
            [
                ("same_output_as", &e.same_output_as),
                ("same_tokens_as", &e.same_tokens_as),
                ("same_logits_as", &e.same_logits_as),
            ]
        }) {
            if let Some(x) = x
                && arm_names.contains(x)
                && !running.iter().any(|c| c.contains(x))
            {
                return Err(format!(
                    "{key} `{x}`: `exclude` drops every combination with arm `{x}`, so there is nothing to compare with"
                ));
            }
        }
        for names in &running {
            let devices: Vec<(&String, &String)> = self
                .matrix
                .values()
                .flatten()
                .filter(|a| names.contains(&a.name))
                .filter_map(|a| a.device.as_ref().map(|d| (&a.name, d)))
                .collect();
            if let Some(((a, da), (b, db))) = devices.iter().zip(devices.iter().skip(1)).find(|(x, y)| x.1 != y.1) {
                return Err(format!(
                    "arms `{a}` (device {da}) and `{b}` (device {db}) are in one combination: a combination runs on one device"
                ));
            }
        }
        for names in &running {
            let starts = !self
                .matrix
                .values()
                .flatten()
                .any(|a| names.contains(&a.name) && a.expect_start_error.is_some());
            if starts && !self.cases.iter().any(|c| c.runs_in(names)) {
                return Err(format!(
                    "the combination of arms {} runs no case (every case's `only` leaves it out): give it a case, or exclude it",
                    names.join(" + ")
                ));
            }
        }
        let mut case_names = Vec::new();
        for c in &self.cases {
            let at = format!("case `{}`", c.name);
            if case_names.contains(&&c.name) {
                return Err(format!("{at}: the name is used twice"));
            }
            case_names.push(&c.name);
            if let Some(l) = &c.load {
                if c.prompt.is_some() || c.sweep.is_some() {
                    return Err(format!("{at}: give one of `prompt`, `sweep` or `load`"));
                }
                if l.clients.is_empty() || l.clients.iter().any(|&n| n == 0 || n > 256) {
                    return Err(format!("{at}: load.clients are client counts from 1 to 256"));
                }
                if !(l.seconds > 0.0 && l.seconds <= 3600.0) {
                    return Err(format!("{at}: load.seconds must be above 0 and at most 3600"));
                }
                if l.prompt_tokens == Some(0) || l.prompt_tokens.is_some_and(|n| n > MAX_PROMPT_TOKENS) {
                    return Err(format!(
                        "{at}: load.prompt_tokens must be from 1 to {MAX_PROMPT_TOKENS}"
                    ));
                }
                if [l.ttft_ms, l.tpot_ms]
                    .iter()
                    .flatten()
                    .any(|t| !(*t > 0.0 && t.is_finite()))
                {
                    return Err(format!("{at}: load.ttft_ms and load.tpot_ms are positive milliseconds"));
                }
            }
            match (&c.prompt, &c.sweep) {
                _ if c.load.is_some() => {}
                (Some(p), None) => {
                    let kinds = [p.text.is_some(), p.messages.is_some(), p.tokens.is_some()];
                    if kinds.iter().filter(|&&k| k).count() != 1 {
                        return Err(format!(
                            "{at}: a prompt has exactly one of `text`, `messages`, `tokens`"
                        ));
                    }
                    if p.tokens == Some(0) || p.messages.as_ref().is_some_and(|m| m.is_empty()) {
                        return Err(format!("{at}: an empty prompt"));
                    }
                }
                (None, Some(s)) => {
                    let pts = match &s.tokens {
                        SweepValues::List(v) => v.clone(),
                        SweepValues::Range(r) => {
                            if r.from == 0 || r.from > r.to {
                                return Err(format!("{at}: a range needs 1 <= from <= to"));
                            }
                            if s.find_boundary {
                                vec![r.from, r.to]
                            } else {
                                r.points()
                            }
                        }
                    };
                    if pts.is_empty() || pts.contains(&0) {
                        return Err(format!("{at}: sweep token counts must be positive and not empty"));
                    }
                    if s.find_boundary && !matches!(s.tokens, SweepValues::Range(_)) {
                        return Err(format!(
                            "{at}: find_boundary needs a range (`tokens: {{from: A, to: B}}`)"
                        ));
                    }
                }
                _ => return Err(format!("{at}: give one of `prompt`, `sweep` or `load`")),
            }
            if c.repetitions == Some(0) || c.max_tokens == Some(0) {
                return Err(format!("{at}: repetitions and max_tokens must be at least 1"));
            }
            for arm in &c.only {
                if !arm_names.contains(arm) {
                    return Err(format!(
                        "{at}: only: `{arm}` names no arm of the matrix (arms: {})",
                        arm_names.join(", ")
                    ));
                }
            }
            if !c.only.is_empty() && !running.iter().any(|names| c.runs_in(names)) {
                return Err(format!(
                    "{at}: only: {} run in no combination that runs (`exclude` drops them)",
                    c.only.join(", ")
                ));
            }
            let mut joined: Vec<(Vec<&str>, &String)> = Vec::new();
            for key in c.arms.keys() {
                let mut axes = Vec::new();
                let mut parts: Vec<&str> = key.split('+').collect();
                if parts.iter().any(|p| p.is_empty()) {
                    return Err(format!(
                        "{at}: arms.{key}: an empty arm name (join arms as a+b, arms: {})",
                        arm_names.join(", ")
                    ));
                }
                for arm in parts.iter().copied() {
                    if !arm_names.iter().any(|a| a == arm) {
                        let what = if arm == key {
                            String::new()
                        } else {
                            format!(": `{arm}`")
                        };
                        return Err(format!(
                            "{at}: arms.{key}{what} names no arm of the matrix (arms: {})",
                            arm_names.join(", ")
                        ));
                    }
                    if let Some(axis) = self.axis_of(arm) {
                        if axes.contains(&axis) {
                            return Err(format!(
                                "{at}: arms.{key} names axis `{axis}` twice: a combination holds one arm of each axis"
                            ));
                        }
                        axes.push(axis);
                    }
                }
                if !running.iter().any(|c| parts.iter().all(|p| c.iter().any(|a| a == p))) {
                    return Err(format!(
                        "{at}: arms.{key} applies to no combination that runs (`exclude` drops every one with {})",
                        parts.join(" and ")
                    ));
                }
                parts.sort_unstable();
                if let Some((_, other)) = joined.iter().find(|(p, _)| *p == parts) {
                    return Err(format!(
                        "{at}: arms.{key} and arms.{other} name the same combination of arms: give one"
                    ));
                }
                joined.push((parts, key));
            }
            for e in std::iter::once(&c.expect).chain(c.arms.values()) {
                self.check_expect(&at, e, &arm_names)?;
                if e.fault.is_some() && c.sweep.as_ref().is_some_and(|s| s.find_boundary) {
                    return Err(format!(
                        "{at}: `fault` checks the requests a worker died of, and a boundary search's requests are probes that are not checked one by one: put it on a prompt or a plain sweep"
                    ));
                }
            }
        }
        Ok(())
    }

    /// Checks one expectation's fields that the types cannot; `at` names it in the error.
    fn check_expect(&self, at: &str, e: &Expect, arm_names: &[String]) -> Result<(), String> {
        if let Some(r) = &e.regex {
            regex_check(r).map_err(|m| format!("{at}: expect.regex: {m}"))?;
        }
        if let Some(h) = e.min_decode_hit_rate
            && !(0.0..=1.0).contains(&h)
        {
            return Err(format!(
                "{at}: min_decode_hit_rate {h} is not a fraction in 0..=1 (write 0.85 for 85%)"
            ));
        }
        for (key, x) in [
            ("same_output_as", &e.same_output_as),
            ("same_tokens_as", &e.same_tokens_as),
            ("same_logits_as", &e.same_logits_as),
        ] {
            if let Some(x) = x
                && !arm_names.contains(x)
            {
                return Err(format!(
                    "{at}: {key} `{x}` names no arm of the matrix (arms: {})",
                    if arm_names.is_empty() {
                        "none".to_string()
                    } else {
                        arm_names.join(", ")
                    }
                ));
            }
        }
        Ok(())
    }

    /// The axis that has the arm `name` (arm names are unique across axes).
    /// Whether `exclude` drops the combination of arms `names` (one per axis, in axis order).
    pub fn excludes(&self, names: &[String]) -> bool {
        let axes: Vec<&String> = self.matrix.keys().collect();
        self.exclude.iter().any(|ex| {
            ex.iter()
                .all(|(axis, arm)| axes.iter().zip(names).any(|(x, n)| *x == axis && n == arm))
        })
    }

    /// Every combination that runs: the Cartesian product of the matrix's axes (sorted by axis name; arms in file
    /// order), less the combinations `exclude` names; each is its (axis, arm) pairs in axis order.
    pub fn running_combinations(&self) -> Vec<Vec<(&str, &Arm)>> {
        let mut out = vec![Vec::new()];
        for (axis, arms) in &self.matrix {
            out = out
                .into_iter()
                .flat_map(|c: Vec<(&str, &Arm)>| {
                    arms.iter().map(move |a| {
                        let mut c = c.clone();
                        c.push((axis.as_str(), a));
                        c
                    })
                })
                .collect();
        }
        out.retain(|c| !self.excludes(&c.iter().map(|(_, a)| a.name.clone()).collect::<Vec<_>>()));
        out
    }

    /// The arm names of every combination that runs ([`Scenario::running_combinations`]), each in axis order.
    pub fn running_arm_names(&self) -> Vec<Vec<String>> {
        self.running_combinations()
            .iter()
            .map(|c| c.iter().map(|(_, a)| a.name.clone()).collect())
            .collect()
    }

    pub fn axis_of(&self, name: &str) -> Option<&str> {
        self.matrix
            .iter()
            .find(|(_, arms)| arms.iter().any(|a| a.name == name))
            .map(|(axis, _)| axis.as_str())
    }
}

fn regex_check(r: &str) -> Result<(), String> {
    regex::Regex::new(r).map(|_| ()).map_err(|e| e.to_string())
}

/// The JSON Schema of scenario files, generated from [`Scenario`] (checked in as `harness/scenario.schema.json`).
pub fn json_schema() -> String {
    let schema = schemars::schema_for!(Scenario);
    serde_json::to_string_pretty(&schema).expect("schemas serialize") + "\n"
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIN: &str = "name: t\ncases:\n  - name: a\n    prompt: {text: hi}\n";

    /// `switches:` adds an axis generated from the engine's registry: `defaults`, each switch flipped from its
    /// default, and for `exact` all of them off with the inexact ones kept; `same_logits_as` makes every
    /// combination digest its logits.
    #[test]
    fn a_switch_axis_flips_each_speed_switch_from_its_default() {
        let case = "cases:\n  - name: a\n    prompt: {text: hi}\n    expect: {same_logits_as: defaults}\n";
        let s = parse("t.yaml", &format!("name: t\nswitches: {{switches: exact}}\n{case}")).unwrap();
        assert!(s.switches.is_none() && s.compares_logits());
        let arms = &s.matrix["switch"];
        let names: Vec<&str> = arms.iter().map(|a| a.name.as_str()).collect();
        assert_eq!(
            names,
            [
                "defaults",
                "PDL-off",
                "CUDA_GRAPHS-off",
                "FETCH_OVERLAP-off",
                "CPU_AVX512-on",
                "CPU_VNNI-off",
                "MOE_GROUPS-off",
                "all-exact-off"
            ]
        );
        assert_eq!(arms[1].env["STRATA_PDL"], "0");
        assert_eq!(arms[4].env["STRATA_CPU_AVX512"], "1");
        assert_eq!(arms[5].env["STRATA_CPU_VNNI"], "0");
        assert_eq!(arms[6].env["STRATA_MOE_GROUPS"], "0");
        let all_off = &arms[7].env;
        assert_eq!(
            (
                all_off["STRATA_ARCH_DEFAULTS"].as_str(),
                all_off["STRATA_CPU_JOIN"].as_str(),
                all_off["STRATA_DEVICE_SLOT_TABLE"].as_str()
            ),
            ("0", "1", "1")
        );
        let all = parse(
            "t.yaml",
            &format!("name: t\nswitches: {{switches: all, axis: sw}}\n{case}"),
        )
        .unwrap();
        assert!(all.matrix["sw"].iter().any(|a| a.name == "CPU_JOIN-off"));
        assert!(!all.matrix["sw"].iter().any(|a| a.name == "all-exact-off"));
        let e = parse(
            "t.yaml",
            &format!("name: t\nswitches: {{switches: [PDL, GRAPHS]}}\n{case}"),
        )
        .unwrap_err();
        assert!(
            e.line == 2
                && e.message
                    .contains("`GRAPHS` is not a speed switch (speed switches: PDL, CUDA_GRAPHS"),
            "{e}"
        );
        let e = parse(
            "t.yaml",
            &format!("name: t\nmatrix:\n  switch: [{{name: x}}]\nswitches: {{switches: [STRATA_PDL]}}\n{case}"),
        )
        .unwrap_err();
        assert!(e.message.contains("already has an axis `switch`"), "{e}");
        let e = parse(
            "t.yaml",
            &format!(
                "name: t\nswitches: {{switches: [PDL]}}\n{}",
                case.replace("defaults}", "default}")
            ),
        )
        .unwrap_err();
        assert!(e.message.contains("same_logits_as `default` names no arm"), "{e}");
        let plain = parse("t.yaml", MIN).unwrap();
        assert!(!plain.compares_logits());
        // Refused: a list naming nothing; a switch the axis flips set for every arm; a generated arm's name
        // taken; the digests turned off; an axis name that is not a file name; a reference every combination
        // of which is excluded; a word that is neither `exact` nor `all`; a bare word.
        let bad = |yaml: String, want: &str| {
            let e = parse("t.yaml", &yaml).unwrap_err();
            assert!(e.message.contains(want), "{e}\n{yaml}");
        };
        bad(
            format!("name: t\nswitches: {{switches: []}}\n{case}"),
            "the list names no switch",
        );
        bad(
            format!("name: t\nenv: {{STRATA_CPU_AVX512: '1'}}\nswitches: {{switches: exact}}\n{case}"),
            "the scenario's env sets STRATA_CPU_AVX512",
        );
        bad(
            format!("name: t\nenv: {{STRATA_ARCH_DEFAULTS: '0'}}\nswitches: {{switches: exact}}\n{case}"),
            "sets STRATA_ARCH_DEFAULTS",
        );
        bad(
            format!(
                "name: t\nmatrix:\n  kv: [{{name: f16, env: {{STRATA_PDL: '0'}}}}]\nswitches: {{switches: [PDL]}}\n{case}"
            ),
            "arm `f16` of axis `kv` sets STRATA_PDL",
        );
        bad(
            format!("name: t\nmatrix:\n  kv: [{{name: defaults}}]\nswitches: {{switches: [PDL]}}\n{case}"),
            "rename that arm",
        );
        bad(
            format!("name: t\nenv: {{STRATA_LOGITS_DIGEST: '0'}}\nswitches: {{switches: [PDL]}}\n{case}"),
            "sets STRATA_LOGITS_DIGEST (\"0\")",
        );
        bad(
            format!("name: t\nenv: {{STRATA_LOGITS_DIGEST: ''}}\nswitches: {{switches: [PDL]}}\n{case}"),
            "sets STRATA_LOGITS_DIGEST",
        );
        bad(
            format!("name: t\nenv: {{STRATA_ARCH_DEFAULTS: '0'}}\nswitches: {{switches: [PDL]}}\n{case}"),
            "sets STRATA_ARCH_DEFAULTS",
        );
        bad(
            format!("name: t\nswitches: {{switches: [PDL], axis: '../x'}}\n{case}"),
            "axis name `../x`",
        );
        bad(
            format!("name: t\nswitches: {{switches: [PDL]}}\nexclude: [{{switch: defaults}}]\n{case}"),
            "drops every combination with arm `defaults`",
        );
        bad(
            format!("name: t\nswitches: {{switches: exakt}}\n{case}"),
            "give `exact`, `all`, or a list",
        );
        bad(
            format!("name: t\nswitches: exact\n{case}"),
            "write `switches: {switches: exact}`",
        );
    }

    #[test]
    fn minimal_scenario_gets_defaults() {
        let s = parse("t.yaml", MIN).unwrap();
        assert_eq!(s.model, "default");
        assert_eq!(s.device, "cpu");
        assert_eq!(s.repetitions, 1);
    }

    #[test]
    fn typo_gets_line_column_and_suggestion() {
        let e = parse("t.yaml", &format!("{MIN}repetitons: 3\n")).unwrap_err();
        assert_eq!(e.line, 5, "{e}");
        assert!(e.message.contains("did you mean `repetitions`?"), "{e}");
        let e = parse("t.yaml", "name: t\ncases:\n  - name: a\n    promt: {text: hi}\n").unwrap_err();
        assert_eq!((e.line, e.column), (4, 5), "{e}");
        assert!(e.message.contains("cases[0]") && e.message.contains("`prompt`"), "{e}");
    }

    #[test]
    fn semantic_errors_name_the_case() {
        let e = parse(
            "t.yaml",
            "name: t\ncases:\n  - name: a\n    prompt: {text: hi, tokens: 3}\n",
        )
        .unwrap_err();
        assert!(
            e.message.contains("case `a`") && e.message.contains("exactly one"),
            "{e}"
        );
        let e = parse(
            "t.yaml",
            "name: t\ncases:\n  - name: a\n    sweep: {tokens: [1, 2], find_boundary: true}\n",
        )
        .unwrap_err();
        assert!(e.message.contains("needs a range"), "{e}");
    }

    #[test]
    fn sweeps_past_the_bounds_are_refused_at_their_line_without_looping() {
        let case = |sweep: &str| {
            format!(
                "name: t\ncases:\n  - name: small\n    prompt: {{tokens: 8}}\n  - name: big\n    sweep:\n      tokens: {sweep}\n"
            )
        };
        for (sweep, says) in [
            // The doubling wrapped to 0 and looped for ever; a step of 1 asked for 80 GB of points.
            ("{from: 1, to: 18446744073709551615}", "past the largest prompt"),
            ("{from: 1, to: 10000000000, step: 1}", "past the largest prompt"),
            ("{from: 1, to: 100000, step: 1}", "more than 1024 points"),
            ("[1, 2, 99999999999]", "past the largest prompt"),
        ] {
            let e = parse("t.yaml", &case(sweep)).unwrap_err();
            assert_eq!((e.line, e.column), (7, 7), "{sweep}: {e}");
            assert!(
                e.message.contains("case `big`") && e.message.contains(says),
                "{sweep}: {e}"
            );
        }
        // A prompt of more tokens than any context.
        let e = parse(
            "t.yaml",
            "name: t\ncases:\n  - name: huge\n    prompt: {tokens: 1000000000}\n",
        )
        .unwrap_err();
        assert_eq!(e.line, 4, "{e}");
        assert!(
            e.message.contains("case `huge`") && e.message.contains("16777216"),
            "{e}"
        );
        // Bisected, only the ends are requested: a long range is fine there, and a linear step up to the cap.
        parse(
            "t.yaml",
            &case("{from: 1, to: 100000, step: 1}")
                .replace("tokens: {from", "find_boundary: true\n      tokens: {from"),
        )
        .unwrap();
        let r = Range {
            from: 1,
            to: 1024,
            step: Some(1),
        };
        assert_eq!(r.checked_points().unwrap().len(), MAX_SWEEP_POINTS);
        assert!(
            Range {
                from: 1,
                to: 1025,
                step: Some(1)
            }
            .checked_points()
            .is_err()
        );
        let r = Range {
            from: 3,
            to: MAX_PROMPT_TOKENS,
            step: None,
        };
        assert_eq!(r.checked_points().unwrap().last(), Some(&MAX_PROMPT_TOKENS));
    }

    #[test]
    fn range_points_double_and_end_at_to() {
        let r = Range {
            from: 16,
            to: 1024,
            step: None,
        };
        assert_eq!(r.points(), vec![16, 32, 64, 128, 256, 512, 1024]);
        let r = Range {
            from: 10,
            to: 25,
            step: Some(10),
        };
        assert_eq!(r.points(), vec![10, 20, 25]);
    }

    #[test]
    fn exclude_and_cross_arm_expectations_are_checked_by_name() {
        let base =
            "name: t\nmatrix:\n  cache: [{name: resident}, {name: small}]\n  store: [{name: arena}, {name: mmap}]\n";
        let case = "cases:\n  - name: a\n    prompt: {text: hi}\n";
        let ok = parse(
            "t.yaml",
            &format!("{base}exclude:\n  - {{cache: resident, store: mmap}}\n{case}"),
        )
        .unwrap();
        assert_eq!(ok.exclude.len(), 1);
        assert_eq!(ok.axis_of("mmap"), Some("store"));
        assert_eq!(ok.axis_of("gpu"), None);
        let e = parse("t.yaml", &format!("{base}exclude:\n  - {{cahce: resident}}\n{case}")).unwrap_err();
        assert!(
            e.message.contains("`cahce` is not an axis") && e.message.contains("cache, store"),
            "{e}"
        );
        let e = parse("t.yaml", &format!("{base}exclude:\n  - {{store: disk}}\n{case}")).unwrap_err();
        assert!(e.message.contains("`disk` is not an arm of axis `store`"), "{e}");
        let e = parse("t.yaml", &format!("{base}exclude:\n  - {{}}\n{case}")).unwrap_err();
        assert!(e.message.contains("exclude[0]"), "{e}");
        let e = parse("t.yaml", &format!("{base}expect: {{same_output_as: resdent}}\n{case}")).unwrap_err();
        assert!(e.message.contains("same_output_as `resdent` names no arm"), "{e}");
        let e = parse(
            "t.yaml",
            &format!("{base}{case}    expect: {{min_decode_hit_rate: 85}}\n"),
        )
        .unwrap_err();
        assert!(
            e.message.contains("case `a`") && e.message.contains("not a fraction"),
            "{e}"
        );
        let e = parse(
            "t.yaml",
            &format!("{base}{case}    arms:\n      small: {{same_output_as: nope}}\n"),
        )
        .unwrap_err();
        assert!(e.message.contains("case `a`") && e.message.contains("`nope`"), "{e}");
        let joined = |key: &str| {
            parse(
                "t.yaml",
                &format!("{base}{case}    arms:\n      {key}: {{min_decode_tok_s: 1}}\n"),
            )
        };
        assert!(joined("small+mmap").is_ok());
        let e = joined("small+mnap").unwrap_err();
        assert!(e.message.contains("arms.small+mnap: `mnap` names no arm"), "{e}");
        let e = joined("small+resident").unwrap_err();
        assert!(e.message.contains("names axis `cache` twice"), "{e}");
        let e = joined("small+").unwrap_err();
        assert!(e.message.contains("an empty arm name"), "{e}");
        let e = parse(
            "t.yaml",
            &format!("{base}exclude:\n  - {{cache: resident, store: mmap}}\n{case}    arms:\n      resident+mmap: {{min_decode_tok_s: 1}}\n"),
        )
        .unwrap_err();
        assert!(e.message.contains("applies to no combination that runs"), "{e}");
        let e = parse(
            "t.yaml",
            &format!("{base}{case}    arms:\n      small+mmap: {{min_decode_tok_s: 1}}\n      mmap+small: {{min_decode_tok_s: 2}}\n"),
        )
        .unwrap_err();
        assert!(e.message.contains("name the same combination"), "{e}");
    }

    #[test]
    fn boundary_expectation_reads_number_or_none() {
        let e: Expect = yaml_serde::from_str("boundary: 65").unwrap();
        assert_eq!(e.boundary, Some(BoundaryExpect::At(65)));
        let e: Expect = yaml_serde::from_str("boundary: none").unwrap();
        assert_eq!(e.boundary, Some(BoundaryExpect::None(NoneWord::None)));
    }
}
