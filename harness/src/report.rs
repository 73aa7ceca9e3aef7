//! The report model (`report.json`, schema-versioned) and its Markdown rendering (`report.md`: the verdict first,
//! then the environment fingerprint, the case table per arm, boundaries, plots and failing cases' log excerpts).

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::capture::MemorySample;

/// Version of `report.json`'s layout; bump on any incompatible change.
pub const REPORT_SCHEMA_VERSION: u32 = 1;

/// Everything one run found.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Report {
    pub schema_version: u32,
    /// The scenario's name.
    pub scenario: String,
    pub scenario_file: String,
    pub description: String,
    /// The command line that produced the report.
    pub command: String,
    /// Start time, UTC, `YYYY-MM-DDTHH:MM:SSZ`.
    pub started_utc: String,
    pub duration_s: f64,
    /// Whether the `quick` settings were in force.
    pub quick: bool,
    pub environment: Environment,
    pub verdict: Verdict,
    pub arms: Vec<ArmReport>,
}

/// Where the run happened.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Environment {
    /// `git rev-parse HEAD` of the engine's source tree.
    pub git_rev: String,
    /// Whether that tree had uncommitted changes.
    pub git_dirty: bool,
    /// `release` or `dev`, from the engine binary's target folder.
    pub build_profile: String,
    pub strata_binary: String,
    /// The engine binary's `strata --version` line: its version and the commit it was built from (engine/build.rs),
    /// which may differ from `git_rev` when the binary was built elsewhere and carried; empty in older reports.
    #[serde(default)]
    pub engine_version: String,
    pub cpu: String,
    pub cpu_cores: usize,
    /// Host memory, bytes.
    pub ram_bytes: u64,
    pub os: String,
    pub device: String,
    pub driver: String,
}

/// The run's outcome.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Verdict {
    pub passed: bool,
    /// Expectations checked.
    pub checked: usize,
    /// Expectations not met.
    pub failed: usize,
    /// `same_*_as` checks not judged: their reference combination was left out of the run (`--arm`).
    #[serde(default)]
    pub unjudged: usize,
}

/// One combination of the matrix.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct ArmReport {
    /// `axis=arm` pairs joined by `,` (or `default` without a matrix).
    pub name: String,
    /// The arm names alone, for per-arm expectations.
    pub arm_names: Vec<String>,
    /// The server's arguments and environment beyond the harness's own.
    pub args: Vec<String>,
    pub env: BTreeMap<String, String>,
    /// The server it started: `strata serve`, or llama.cpp's `llama-server` beside it.
    #[serde(default)]
    pub server: crate::scenario::ServerKind,
    /// The device it ran on (the arm's `device`, else the scenario's or `--device`).
    #[serde(default)]
    pub device: String,
    /// Set when the server could not start: nothing else ran.
    pub error: Option<String>,
    /// The arm's `expect_start_error`: its server was meant not to start (a replayed failure), so `error` is its
    /// outcome, checked among `event_checks`, not a failure of the run.
    #[serde(default)]
    pub start_failure_expected: bool,
    pub rows: Vec<CaseRow>,
    pub boundaries: Vec<Boundary>,
    /// Load cases' runs, one per client count.
    #[serde(default)]
    pub loads: Vec<crate::load::LoadRow>,
    /// Worker events by kind, over the whole arm.
    pub events: BTreeMap<String, u64>,
    /// Checks of the arm's `expect_events`.
    pub event_checks: Vec<Check>,
    /// Every worker event, raw.
    pub raw_events: Vec<serde_json::Value>,
    pub memory: Vec<MemorySample>,
    /// Phase markers for the memory timeline: (ms since the run started, label).
    pub markers: Vec<(u64, String)>,
    /// Worker restarts over the arm (from /metrics).
    pub restarts: u64,
    /// Files under `logs/`, relative to the report folder.
    pub log_file: String,
    pub events_file: String,
    pub metrics_before_file: String,
    pub metrics_after_file: String,
}

impl ArmReport {
    /// The server did not start and the arm did not expect it to.
    pub fn unexpected_error(&self) -> bool {
        self.error.is_some() && !self.start_failure_expected
    }
}

/// One row of the case table: a case, or one sweep point, or one boundary probe, with its repetitions.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct CaseRow {
    pub case: String,
    /// `prompt`, `sweep` or `probe`.
    pub kind: String,
    /// Token count asked for (`tokens:` prompts and sweeps).
    pub tokens_requested: Option<usize>,
    pub samples: Vec<Sample>,
    pub prefill_tok_s: Option<Stat>,
    pub decode_tok_s: Option<Stat>,
    pub checks: Vec<Check>,
    /// The end of the server log while this row ran (for failing rows).
    pub log_excerpt: String,
}

/// One request.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Sample {
    pub status: u16,
    /// Prompt tokens the server saw (`usage.prompt_tokens`, or count_tokens for a chat before an error).
    pub prompt_tokens: Option<usize>,
    /// Prompt tokens reused from the server's cache.
    pub cached_tokens: Option<usize>,
    pub prefill_ms: Option<f64>,
    pub prefill_tok_s: Option<f64>,
    pub generated: Option<usize>,
    pub decode_ms: Option<f64>,
    pub decode_tok_s: Option<f64>,
    /// Worker restarts during the request.
    pub restarts: u64,
    pub output: String,
    /// The error message of a non-200 answer.
    pub error: String,
    pub t_start_ms: u64,
    pub t_end_ms: u64,
    /// Start and end of the request on the wall clock, ms since the Unix epoch: the clock the worker stamps its
    /// events with (`ts_ms`), so the events of this request are those between the two (0 in older reports).
    #[serde(default)]
    pub t_start_unix_ms: u64,
    #[serde(default)]
    pub t_end_unix_ms: u64,
    /// Worker resident set peak during the request, bytes.
    pub peak_worker_rss_bytes: u64,
    /// What the VRAM expert cache did for this request, by phase (`prefill`, `decode`), summed from its
    /// `expert_cache` events; empty when it sent none (every expert resident, a dense model, the CPU).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub expert_cache: BTreeMap<String, CacheCounts>,
    /// The worker's launch faults during the request (`fault` events naming a kernel), as the log says them:
    /// `moe_add_rms_norm launch #12 (synchronised)`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub faults: Vec<LaunchFault>,
    /// The generated token ids, from the worker's `request` event of this request.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tokens: Vec<u32>,
    /// One digest per generated token of the logits it was sampled from (`STRATA_LOGITS_DIGEST=1`; the `request`
    /// event's `logits_fnv`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub logits_fnv: Vec<String>,
}

/// A launch fault a `fault` event named.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct LaunchFault {
    pub kernel: String,
    /// The launch's number since the worker started.
    pub call: u64,
    pub synced: bool,
    pub error: String,
}

impl std::fmt::Display for LaunchFault {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} launch #{} ({})",
            self.kernel,
            self.call,
            if self.synced {
                "synchronised"
            } else {
                "not synchronised"
            }
        )
    }
}

/// Counts of the VRAM expert cache over one phase of one or more requests, from the worker's `expert_cache`
/// events (DESIGN.md section 3, "Expert cache"; `strata_engine::events::ExpertCache`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct CacheCounts {
    /// Lookups of (layer, expert) by the layers' steps.
    pub lookups: u64,
    pub hits: u64,
    /// Bytes copied from host memory to the device.
    pub bytes_uploaded: u64,
    /// Misses the CPU computed instead.
    pub cpu_computed: u64,
}

impl CacheCounts {
    /// Adds one `expert_cache` event's counts (missing fields count 0).
    pub fn add_event(&mut self, e: &serde_json::Value) {
        let n = |k: &str| e[k].as_u64().unwrap_or(0);
        self.lookups += n("lookups");
        self.hits += n("hits");
        self.bytes_uploaded += n("bytes_uploaded");
        self.cpu_computed += n("cpu_computed");
    }

    /// The sum of two counts.
    pub fn plus(self, o: CacheCounts) -> CacheCounts {
        CacheCounts {
            lookups: self.lookups + o.lookups,
            hits: self.hits + o.hits,
            bytes_uploaded: self.bytes_uploaded + o.bytes_uploaded,
            cpu_computed: self.cpu_computed + o.cpu_computed,
        }
    }

    /// Hits over lookups, in 0..=1 (`None` without lookups).
    pub fn hit_rate(&self) -> Option<f64> {
        (self.lookups > 0).then(|| self.hits as f64 / self.lookups as f64)
    }
}

impl CaseRow {
    /// The expert cache's counts of `phase` over the row's repetitions (`None` when no request had any).
    pub fn cache(&self, phase: &str) -> Option<CacheCounts> {
        self.samples
            .iter()
            .filter_map(|s| s.expert_cache.get(phase).copied())
            .reduce(CacheCounts::plus)
    }

    /// Tokens generated over the row's repetitions.
    pub fn generated(&self) -> usize {
        self.samples.iter().filter_map(|s| s.generated).sum()
    }
}

/// Median, min and max over repetitions.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Stat {
    pub median: f64,
    pub min: f64,
    pub max: f64,
    /// How many values (0 in reports older than this field).
    #[serde(default)]
    pub n: usize,
}

impl Stat {
    /// The statistics of `values` (`None` when empty).
    pub fn of(values: &[f64]) -> Option<Stat> {
        let mut v: Vec<f64> = values.iter().copied().filter(|x| x.is_finite()).collect();
        if v.is_empty() {
            return None;
        }
        v.sort_by(f64::total_cmp);
        let n = v.len();
        let median = if n % 2 == 1 {
            v[n / 2]
        } else {
            (v[n / 2 - 1] + v[n / 2]) / 2.0
        };
        Some(Stat {
            median,
            min: v[0],
            max: v[n - 1],
            n,
        })
    }

    /// Relative spread `(max - min) / median` (0 when the median is 0).
    pub fn spread(&self) -> f64 {
        if self.median > 0.0 {
            (self.max - self.min) / self.median
        } else {
            0.0
        }
    }
}

/// One expectation and what was seen.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Check {
    pub what: String,
    pub expected: String,
    pub got: String,
    pub passed: bool,
}

/// A boundary search's result.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Boundary {
    pub case: String,
    pub from: usize,
    pub to: usize,
    /// The first failing token count; `None` when `to` passes.
    pub first_failing: Option<usize>,
    /// The last passing token count seen.
    pub last_passing: Option<usize>,
    pub probes: usize,
    pub check: Option<Check>,
}

impl Report {
    /// A report of `scenario` with no arms and an empty environment (a starting point for tests and tools).
    pub fn empty(scenario: &str) -> Report {
        Report {
            schema_version: REPORT_SCHEMA_VERSION,
            scenario: scenario.into(),
            scenario_file: String::new(),
            description: String::new(),
            command: String::new(),
            started_utc: String::new(),
            duration_s: 0.0,
            quick: false,
            environment: Environment::default(),
            verdict: Verdict::default(),
            arms: Vec::new(),
        }
    }

    /// Every check of the run.
    pub fn checks(&self) -> impl Iterator<Item = &Check> {
        self.arms.iter().flat_map(|a| {
            a.rows
                .iter()
                .flat_map(|r| r.checks.iter())
                .chain(a.boundaries.iter().filter_map(|b| b.check.as_ref()))
                .chain(a.loads.iter().flat_map(|l| l.checks.iter()))
                .chain(a.event_checks.iter())
        })
    }

    /// Recomputes the verdict from the checks and arm errors.
    pub fn settle_verdict(&mut self) {
        let checked = self.checks().count();
        let failed = self.checks().filter(|c| !c.passed).count();
        let errors = self.arms.iter().filter(|a| a.unexpected_error()).count();
        self.verdict = Verdict {
            passed: failed == 0 && errors == 0,
            checked,
            failed: failed + errors,
            unjudged: self.verdict.unjudged,
        };
    }
}

/// The load runs of one arm, as vLLM's `bench serve` names the figures (latencies in ms: mean / p50 / p99).
fn load_table(m: &mut String, loads: &[crate::load::LoadRow]) {
    if loads.is_empty() {
        return;
    }
    let _ = writeln!(
        m,
        "\n### Load\n\nClosed loop: each client sends its next streamed request when the last ends. Latencies in ms, mean / p50 / p99.\n\n\
         | case | clients | completed / failed | req/s | output tok/s | total tok/s | TTFT | TPOT | ITL | goodput req/s | result |\n\
         |---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"
    );
    let lat = |l: &Option<crate::load::Latency>| {
        l.map_or("–".into(), |l| format!("{:.0} / {:.0} / {:.0}", l.mean, l.p50, l.p99))
    };
    for l in loads {
        let _ = writeln!(
            m,
            "| {} | {} | {} / {} | {:.2} | {:.1} | {:.1} | {} | {} | {} | {} | {} |",
            l.case,
            l.clients,
            l.completed,
            l.failed,
            l.requests_per_s,
            l.output_tok_s,
            l.total_tok_s,
            lat(&l.ttft_ms),
            lat(&l.tpot_ms),
            lat(&l.itl_ms),
            l.goodput_per_s.map_or("–".into(), |g| format!("{g:.2}")),
            if l.checks.iter().all(|c| c.passed) {
                "pass"
            } else {
                "**FAIL**"
            }
        );
    }
}

fn fmt_stat(s: &Option<Stat>) -> String {
    match s {
        None => "–".into(),
        Some(s) if (s.max - s.min).abs() < 0.05 => format!("{:.1}", s.median),
        Some(s) => format!("{:.1} ({:.1}–{:.1})", s.median, s.min, s.max),
    }
}

fn gib(bytes: u64) -> f64 {
    bytes as f64 / (1u64 << 30) as f64
}

/// A `probe` event in a few words: `19416.7 GB/s, peak 31.5: a probe bug`.
pub fn probe_summary(p: &serde_json::Value) -> String {
    format!(
        "{:.1} GB/s, peak {:.1}: {}",
        p["best_gb_s"].as_f64().unwrap_or(0.0),
        p["peak_gb_s"].as_f64().unwrap_or(0.0),
        if p["plausible"] == true {
            "plausible"
        } else {
            "a probe bug"
        }
    )
}

/// The arms side by side, from their events: the device, the link probe's check, the expert cache the device
/// gave room for, the outcome, and what was at fault (the allocation that failed, the kernel or GEMM whose fault
/// killed the worker, the op that fell back).
fn side_by_side(m: &mut String, arms: &[ArmReport]) {
    let _ = writeln!(m, "\n## Side by side\n");
    let _ = writeln!(
        m,
        "| arm | device | link probe | expert cache | outcome | at fault |\n|---|---|---|---|---|---|"
    );
    let gib = |b: f64| b / (1u64 << 30) as f64;
    for a in arms {
        let of = |kind: &'static str| a.raw_events.iter().filter(move |e| e["event"] == kind);
        let probe = of("probe").next().map_or("–".to_string(), |p| {
            probe_summary(p).replace("a probe bug", "**a probe bug**")
        });
        let memory: Vec<&serde_json::Value> = of("memory").collect();
        let on_card = |e: &serde_json::Value| {
            gib(e["bytes"].as_f64().unwrap_or(0.0) / e["scale"].as_f64().filter(|s| *s > 0.0).unwrap_or(1.0))
        };
        let cache = memory
            .iter()
            .find(|e| {
                e["op"] == "alloc"
                    && e["what"]
                        .as_str()
                        .is_some_and(|w| w.starts_with("the expert cache") || w.starts_with("the experts"))
            })
            .map_or("–".to_string(), |e| {
                format!(
                    "{}: {:.2} GiB on the card",
                    e["what"].as_str().unwrap_or(""),
                    on_card(e)
                )
            });
        let answered = a
            .rows
            .iter()
            .flat_map(|r| &r.samples)
            .filter(|s| s.status == 200)
            .count();
        let asked = a.rows.iter().map(|r| r.samples.len()).sum::<usize>();
        let outcome = match &a.error {
            Some(_) if a.start_failure_expected => "did not start (as expected)".to_string(),
            Some(_) => "**did not start**".to_string(),
            None if a.rows.is_empty() && !a.loads.is_empty() => {
                let failing = a.loads.iter().filter(|l| l.failed > 0).count();
                format!(
                    "{} load runs, {failing} with failed requests, {} restarts",
                    a.loads.len(),
                    a.restarts
                )
            }
            None => format!("{answered} of {asked} requests answered, {} restarts", a.restarts),
        };
        let failed_alloc = memory
            .iter()
            .find(|e| e["op"].as_str().is_some_and(|o| o.ends_with("_failed")));
        // The launch or operation a fault names, else the first fault's words (a failed copy, a panic).
        let fault = of("fault")
            .find(|e| e["kernel"].is_string() || e["op"].is_string())
            .or_else(|| of("fault").next());
        let fallback = of("fallback").next();
        let at_fault = if let Some(e) = failed_alloc {
            format!(
                "{} {} of {} B ({:.2} GiB on the card) failed",
                e["op"].as_str().unwrap_or("").trim_end_matches("_failed"),
                e["what"].as_str().unwrap_or(""),
                e["bytes"],
                on_card(e)
            )
        } else if let Some(f) = fault {
            match serde_json::from_value::<strata_engine::events::Fault>(f.clone()) {
                Ok(x) => x.to_string(),
                Err(_) => f["error"].as_str().unwrap_or("").to_string(),
            }
        } else if let Some(b) = fallback {
            format!(
                "{} on {} failed; fell back to {}",
                b["op"].as_str().unwrap_or(""),
                b["from"].as_str().unwrap_or(""),
                b["to"].as_str().unwrap_or("")
            )
        } else {
            "–".to_string()
        };
        let _ = writeln!(
            m,
            "| `{}` | {} | {probe} | {cache} | {outcome} | {} |",
            a.name,
            a.device,
            at_fault.replace('|', "\\|")
        );
    }
}

/// Renders `report.md`. `plots` are file names beside it (PNG), shown in order.
pub fn markdown(r: &Report, plots: &[String]) -> String {
    let mut m = String::new();
    let v = &r.verdict;
    let _ = writeln!(m, "# {} — {}\n", r.scenario, if v.passed { "PASS" } else { "FAIL" });
    if v.passed {
        let _ = writeln!(m, "**Verdict: PASS.** All {} expectations met.\n", v.checked);
    }
    if v.unjudged > 0 {
        let _ = writeln!(
            m,
            "**{} comparison{} not judged**: the combinations {} against were left out of this run (`--arm`).\n",
            v.unjudged,
            if v.unjudged == 1 { "" } else { "s" },
            if v.unjudged == 1 { "it compares" } else { "they compare" }
        );
    }
    if !v.passed {
        let _ = writeln!(
            m,
            "**Verdict: FAIL.** {} of {} expectations not met.\n",
            v.failed, v.checked
        );
        for a in &r.arms {
            if let Some(e) = a.error.as_ref().filter(|_| a.unexpected_error()) {
                let _ = writeln!(m, "- `{}`: the engine did not start: {e}", a.name);
            }
            for c in a.event_checks.iter().filter(|c| !c.passed) {
                let _ = writeln!(m, "- `{}`: {} expected {}, got {}", a.name, c.what, c.expected, c.got);
            }
            for (row, c) in a.rows.iter().flat_map(|row| row.checks.iter().map(move |c| (row, c))) {
                if !c.passed {
                    let _ = writeln!(
                        m,
                        "- `{}` / {}: {} expected {}, got {}",
                        a.name, row.case, c.what, c.expected, c.got
                    );
                }
            }
            for c in a.boundaries.iter().filter_map(|b| b.check.as_ref()) {
                if !c.passed {
                    let _ = writeln!(m, "- `{}`: {} expected {}, got {}", a.name, c.what, c.expected, c.got);
                }
            }
        }
        m.push('\n');
    }
    for a in &r.arms {
        for b in &a.boundaries {
            let found = match b.first_failing {
                Some(n) => format!("first failing prompt: **{n} tokens**"),
                None => format!("no failure up to {} tokens", b.to),
            };
            let _ = writeln!(
                m,
                "- Boundary `{}` / {}: {found} (searched {}..{} in {} request{})",
                a.name,
                b.case,
                b.from,
                b.to,
                b.probes,
                if b.probes == 1 { "" } else { "s" }
            );
        }
    }
    if !r.description.is_empty() {
        let _ = writeln!(m, "\n{}\n", r.description.trim());
    }
    if !r.arms.is_empty() {
        side_by_side(&mut m, &r.arms);
    }
    let e = &r.environment;
    let _ = writeln!(m, "\n## Environment\n");
    let _ = writeln!(m, "| | |\n|---|---|");
    let rows = [
        (
            "git revision",
            format!("`{}`{}", e.git_rev, if e.git_dirty { " (dirty)" } else { "" }),
        ),
        ("build profile", e.build_profile.clone()),
        ("engine binary", format!("`{}`", e.strata_binary)),
        (
            "engine version",
            if e.engine_version.is_empty() {
                "unknown".into()
            } else {
                format!("`{}`", e.engine_version)
            },
        ),
        ("CPU", format!("{} ({} cores)", e.cpu, e.cpu_cores)),
        ("RAM", format!("{:.1} GiB", gib(e.ram_bytes))),
        ("OS", e.os.clone()),
        ("device", e.device.clone()),
        ("driver", e.driver.clone()),
        ("scenario", format!("`{}`", r.scenario_file)),
        ("command", format!("`{}`", r.command)),
        ("started (UTC)", r.started_utc.clone()),
        ("duration", format!("{:.1} s", r.duration_s)),
    ];
    for (k, v) in rows {
        let _ = writeln!(m, "| {k} | {v} |");
    }
    if r.quick {
        let _ = writeln!(
            m,
            "\nQuick run: sweeps capped and repetitions reduced by the scenario's `quick` settings."
        );
    }
    for a in &r.arms {
        let _ = writeln!(m, "\n## Arm `{}`\n", a.name);
        if !a.args.is_empty() || !a.env.is_empty() {
            let env: Vec<String> = a.env.iter().map(|(k, v)| format!("{k}={v}")).collect();
            let line = [env.join(" "), a.server.program().to_string(), a.args.join(" ")];
            let _ = writeln!(
                m,
                "`{}`\n",
                line.iter()
                    .filter(|p| !p.is_empty())
                    .cloned()
                    .collect::<Vec<_>>()
                    .join(" ")
            );
        }
        if let Some(err) = &a.error {
            let expected = if a.start_failure_expected {
                " (the replayed failure this arm expects)"
            } else {
                ""
            };
            let _ = writeln!(m, "The engine did not start{expected}: {err}\n");
            continue;
        }
        if !a.rows.is_empty() {
            let _ = writeln!(
                m,
                "| case | tokens asked | prompt tokens (server) | status | prefill tok/s | decode tok/s | restarts | result |"
            );
            let _ = writeln!(m, "|---|---:|---:|---|---:|---:|---:|---|");
        }
        for row in &a.rows {
            let statuses: Vec<String> = {
                let mut s: Vec<u16> = row.samples.iter().map(|s| s.status).collect();
                s.dedup();
                s.iter().map(u16::to_string).collect()
            };
            let prompt: Vec<String> = {
                let mut p: Vec<usize> = row.samples.iter().filter_map(|s| s.prompt_tokens).collect();
                p.dedup();
                p.iter().map(usize::to_string).collect()
            };
            let restarts: u64 = row.samples.iter().map(|s| s.restarts).sum();
            let result = if row.checks.is_empty() {
                if row.samples.iter().all(|s| s.status == 200 && s.restarts == 0) {
                    "ok"
                } else {
                    "fails (boundary search)"
                }
            } else if row.checks.iter().all(|c| c.passed) {
                "pass"
            } else {
                "**FAIL**"
            };
            let _ = writeln!(
                m,
                "| {} | {} | {} | {} | {} | {} | {} | {} |",
                row.case,
                row.tokens_requested.map_or("–".into(), |n| n.to_string()),
                if prompt.is_empty() {
                    "–".into()
                } else {
                    prompt.join(", ")
                },
                statuses.join(", "),
                fmt_stat(&row.prefill_tok_s),
                fmt_stat(&row.decode_tok_s),
                restarts,
                result
            );
        }
        load_table(&mut m, &a.loads);
        let peak = a.memory.iter().map(|s| s.worker_rss_bytes).max().unwrap_or(0);
        let events: Vec<String> = a.events.iter().map(|(k, v)| format!("{k} {v}")).collect();
        let _ = writeln!(
            m,
            "\nWorker restarts: {}. Worker RSS peak: {:.0} MiB. Events: {}.",
            a.restarts,
            peak as f64 / (1u64 << 20) as f64,
            if events.is_empty() {
                "none".into()
            } else {
                events.join(", ")
            }
        );
        if a.rows
            .iter()
            .any(|r| r.cache("decode").is_some() || r.cache("prefill").is_some())
        {
            let _ = writeln!(
                m,
                "\nExpert cache, over the repetitions (from the worker's `expert_cache` events):\n\n\
                 | case | tokens asked | decode hit rate | decode lookups | decode MB uploaded / token | decode misses on the CPU / token | prefill hit rate | prefill MB uploaded |\n\
                 |---|---:|---:|---:|---:|---:|---:|---:|"
            );
            let pct = |c: Option<CacheCounts>| {
                c.and_then(|c| c.hit_rate())
                    .map_or("–".to_string(), |h| format!("{:.1}%", h * 100.0))
            };
            for row in &a.rows {
                let (d, p) = (row.cache("decode"), row.cache("prefill"));
                let per_tok = |x: Option<f64>| match (x, row.generated()) {
                    (Some(x), n) if n > 0 => format!("{:.1}", x / n as f64),
                    _ => "–".into(),
                };
                let _ = writeln!(
                    m,
                    "| {} | {} | {} | {} | {} | {} | {} | {} |",
                    row.case,
                    row.tokens_requested.map_or("–".into(), |n| n.to_string()),
                    pct(d),
                    d.map_or("–".into(), |d| d.lookups.to_string()),
                    per_tok(d.map(|d| d.bytes_uploaded as f64 / 1e6)),
                    per_tok(d.map(|d| d.cpu_computed as f64)),
                    pct(p),
                    p.map_or("–".into(), |p| format!("{:.1}", p.bytes_uploaded as f64 / 1e6)),
                );
            }
        }
        for c in &a.event_checks {
            let _ = writeln!(
                m,
                "- {}: expected {}, got {} — {}",
                c.what,
                c.expected,
                c.got,
                if c.passed { "pass" } else { "**FAIL**" }
            );
        }
        let _ = writeln!(
            m,
            "\nLogs: [`{}`]({}), events [`{}`]({}), /metrics [before]({}) and [after]({}).",
            a.log_file, a.log_file, a.events_file, a.events_file, a.metrics_before_file, a.metrics_after_file
        );
    }
    if !plots.is_empty() {
        let _ = writeln!(m, "\n## Plots\n");
        for p in plots {
            let svg = p.replace(".png", ".svg");
            let _ = writeln!(m, "![{p}]({p}) ([SVG]({svg}))\n");
        }
    }
    let failing: Vec<(&ArmReport, &CaseRow)> = r
        .arms
        .iter()
        .flat_map(|a| a.rows.iter().map(move |row| (a, row)))
        .filter(|(_, row)| {
            row.checks.iter().any(|c| !c.passed) || row.samples.iter().any(|s| s.status != 200 || s.restarts > 0)
        })
        .collect();
    if !failing.is_empty() {
        let _ = writeln!(m, "## Log excerpts of failing requests\n");
        for (a, row) in failing {
            let _ = writeln!(
                m,
                "<details><summary><code>{}</code> / {}{}</summary>\n\n```text\n{}\n```\n</details>\n",
                a.name,
                row.case,
                row.samples
                    .iter()
                    .find(|s| !s.error.is_empty())
                    .map_or(String::new(), |s| format!(": {} {}", s.status, s.error)),
                row.log_excerpt.trim_end()
            );
        }
    }
    m
}

/// Writes `report.json`.
///
/// Errors: the file cannot be written.
pub fn write_json(r: &Report, path: &Path) -> anyhow::Result<()> {
    std::fs::write(path, serde_json::to_string_pretty(r)? + "\n")?;
    Ok(())
}

/// Reads a `report.json` (a path to the file or to its folder).
///
/// Errors: unreadable, not a report, or of another schema version.
pub fn read_json(path: &Path) -> anyhow::Result<Report> {
    let file = if path.is_dir() {
        path.join("report.json")
    } else {
        path.to_path_buf()
    };
    let text = std::fs::read_to_string(&file).map_err(|e| anyhow::anyhow!("cannot read {}: {e}", file.display()))?;
    let r: Report =
        serde_json::from_str(&text).map_err(|e| anyhow::anyhow!("{} is not a report: {e}", file.display()))?;
    if r.schema_version != REPORT_SCHEMA_VERSION {
        anyhow::bail!(
            "{} has report schema version {}, this harness reads {}",
            file.display(),
            r.schema_version,
            REPORT_SCHEMA_VERSION
        );
    }
    Ok(r)
}

/// `YYYY-MM-DDTHH:MM:SSZ` for seconds since the Unix epoch (proleptic Gregorian, UTC).
pub fn utc_timestamp(secs: u64) -> String {
    let days = (secs / 86_400) as i64;
    let rem = secs % 86_400;
    // Howard Hinnant's civil_from_days.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let mo = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(mo <= 2);
    format!(
        "{y:04}-{mo:02}-{d:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stats_median_min_max() {
        let s = Stat::of(&[3.0, 1.0, 2.0, f64::NAN]).unwrap();
        assert_eq!((s.median, s.min, s.max), (2.0, 1.0, 3.0));
        assert_eq!(Stat::of(&[1.0, 2.0, 3.0, 4.0]).unwrap().median, 2.5);
        assert!(Stat::of(&[]).is_none());
        assert!((Stat::of(&[90.0, 110.0]).unwrap().spread() - 0.2).abs() < 1e-12);
    }

    #[test]
    fn utc_dates() {
        assert_eq!(utc_timestamp(0), "1970-01-01T00:00:00Z");
        assert_eq!(utc_timestamp(951_782_400), "2000-02-29T00:00:00Z");
        assert_eq!(utc_timestamp(1_798_761_599), "2026-12-31T23:59:59Z");
    }

    #[test]
    fn verdict_counts_failed_checks_and_dead_arms() {
        let mut r = Report {
            arms: vec![ArmReport {
                rows: vec![CaseRow {
                    checks: vec![
                        Check {
                            passed: true,
                            ..Check::default()
                        },
                        Check::default(),
                    ],
                    ..CaseRow::default()
                }],
                ..ArmReport::default()
            }],
            ..Report::empty("t")
        };
        r.settle_verdict();
        assert!(!r.verdict.passed);
        assert_eq!((r.verdict.checked, r.verdict.failed), (2, 1));
        r.arms[0].rows[0].checks[1].passed = true;
        r.settle_verdict();
        assert!(r.verdict.passed);
        r.arms[0].error = Some("x".into());
        r.settle_verdict();
        assert!(!r.verdict.passed);
    }
}
