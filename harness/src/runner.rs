//! Runs a scenario: the matrix's combinations one after another, each against its own `strata serve`, case by
//! case (prompts, sweeps, boundary searches, repetitions), then judges the expectations.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use indicatif::{ProgressBar, ProgressStyle};
use serde_json::{Value, json};

use crate::capture::{MemorySampler, count_events, read_events};
use crate::prompt::PromptBuilder;
use crate::report::{ArmReport, Boundary, CaseRow, Check, LaunchFault, Sample, Stat};
use crate::scenario::{Arm, BoundaryExpect, Case, Expect, Prompt, Scenario, ServerKind, SweepValues};
use crate::server::Server;

/// How long a server may take to become healthy (model load), and a worker to come back after a death.
const HEALTH_TIMEOUT: Duration = Duration::from_secs(300);

/// One combination of the matrix: an arm per axis.
#[derive(Debug, Clone)]
pub struct Combo {
    /// `axis=arm,...` or `default`.
    pub name: String,
    pub arms: Vec<Arm>,
    pub axes: Vec<String>,
}

impl Combo {
    /// The device it runs on: its arms' `device`, else `default` (the scenario's or `--device`).
    pub fn device(&self, default: &str) -> String {
        self.arms
            .iter()
            .find_map(|a| a.device.clone())
            .unwrap_or_else(|| default.to_string())
    }

    /// The server it starts: `llama-server` when one of its arms says so.
    pub fn server(&self) -> ServerKind {
        match self.arms.iter().any(|a| a.server == ServerKind::LlamaServer) {
            true => ServerKind::LlamaServer,
            false => ServerKind::Strata,
        }
    }

    /// The arm names, in axis order.
    pub fn arm_names(&self) -> Vec<String> {
        self.arms.iter().map(|a| a.name.clone()).collect()
    }

    /// A file-name-safe form of the name.
    pub fn slug(&self) -> String {
        self.name.replace([',', '='], "-")
    }
}

/// The combinations the scenario runs ([`Scenario::running_combinations`]), named.
pub fn combos(s: &Scenario) -> Vec<Combo> {
    s.running_combinations()
        .into_iter()
        .map(|c| Combo {
            name: if c.is_empty() {
                "default".into()
            } else {
                c.iter()
                    .map(|(x, a)| format!("{x}={}", a.name))
                    .collect::<Vec<_>>()
                    .join(",")
            },
            arms: c.iter().map(|(_, a)| (*a).clone()).collect(),
            axes: c.iter().map(|(x, _)| x.to_string()).collect(),
        })
        .collect()
}

/// Settings of one run beyond the scenario.
pub struct RunSettings {
    pub strata: PathBuf,
    /// llama.cpp's server, for the combinations that start it (`None`: none does).
    pub llama_server: Option<PathBuf>,
    pub model_path: PathBuf,
    /// `cpu` or `cuda:N`, passed to `strata serve --device`.
    pub device: String,
    pub quick: bool,
    /// The report folder (logs go to `logs/` inside).
    pub out_dir: PathBuf,
    /// Show progress bars (a terminal).
    pub progress: bool,
}

/// The first failing value in `[lo, hi]` for a predicate that fails from some point on: probes `hi`, then `lo`,
/// then bisects, O(log(hi - lo)) probes. Returns (first failing, last passing, probes made).
pub fn find_boundary(
    lo: usize,
    hi: usize,
    mut passes: impl FnMut(usize) -> Result<bool>,
) -> Result<(Option<usize>, Option<usize>, usize)> {
    let mut probes = 1;
    if passes(hi)? {
        return Ok((None, Some(hi), probes));
    }
    if lo == hi {
        return Ok((Some(hi), None, probes));
    }
    probes += 1;
    if !passes(lo)? {
        return Ok((Some(lo), None, probes));
    }
    let (mut good, mut bad) = (lo, hi);
    while bad - good > 1 {
        let mid = good + (bad - good) / 2;
        probes += 1;
        if passes(mid)? {
            good = mid;
        } else {
            bad = mid;
        }
    }
    Ok((Some(bad), Some(good), probes))
}

/// Runs every case of `s` against an already started server for `combo`; fills `arm.rows` and `arm.boundaries`.
struct ArmRun<'a> {
    s: &'a Scenario,
    combo: &'a Combo,
    server: &'a mut Server,
    prompts: &'a mut PromptBuilder,
    sampler: &'a MemorySampler,
    epoch: Instant,
    log_path: PathBuf,
    arm: &'a mut ArmReport,
    quick: Option<&'a crate::scenario::Quick>,
    bar: ProgressBar,
}

impl ArmRun<'_> {
    fn repetitions(&self, c: &Case) -> u32 {
        match self.quick {
            Some(q) => q.repetitions.max(1),
            None => c.repetitions.unwrap_or(self.s.repetitions),
        }
    }

    fn expect(&self, c: &Case) -> Expect {
        row_expect(self.s, &self.combo.arm_names(), &c.name)
    }

    fn log_len(&self) -> u64 {
        std::fs::metadata(&self.log_path).map_or(0, |m| m.len())
    }

    fn log_excerpt(&self, from: u64) -> String {
        let text = std::fs::read(&self.log_path).unwrap_or_default();
        let from = (from as usize).min(text.len());
        let tail = String::from_utf8_lossy(&text[from..]).into_owned();
        let lines: Vec<&str> = tail.lines().collect();
        lines[lines.len().saturating_sub(40)..].join("\n")
    }

    /// Sends one request and waits for the worker to be back if it died.
    fn request(&mut self, c: &Case, prompt: &Prompt, tokens: Option<usize>) -> Result<Sample> {
        let max_tokens = c.max_tokens.unwrap_or(self.s.max_tokens);
        let restarts_before = self.server.restarts().unwrap_or(0);
        let mut sample = Sample {
            t_start_ms: self.epoch.elapsed().as_millis() as u64,
            t_start_unix_ms: unix_ms(),
            ..Sample::default()
        };
        let (path, body, counted) = if let Some(n) = tokens.or(prompt.tokens) {
            let text = self.prompts.exact(n)?;
            (
                "/v1/completions",
                json!({"prompt": text, "max_tokens": max_tokens, "temperature": 0, "seed": 1}),
                None,
            )
        } else if let Some(text) = &prompt.text {
            let n = self.prompts.count(text)?;
            (
                "/v1/completions",
                json!({"prompt": text, "max_tokens": max_tokens, "temperature": 0, "seed": 1}),
                Some(n),
            )
        } else {
            let msgs = prompt.messages.clone().unwrap_or_default();
            let n = self.server.count_chat_tokens(&msgs).ok();
            let m: Vec<Value> = msgs
                .iter()
                .map(|m| json!({"role": m.role, "content": m.content}))
                .collect();
            (
                "/v1/chat/completions",
                json!({"messages": m, "max_tokens": max_tokens, "temperature": 0, "seed": 1}),
                n,
            )
        };
        let answer = self.server.post(path, &body);
        sample.t_end_ms = self.epoch.elapsed().as_millis() as u64;
        sample.t_end_unix_ms = unix_ms();
        match answer {
            Ok(a) => {
                sample.status = a.status;
                let b = &a.body;
                let t = &b["timings"];
                sample.prompt_tokens = b["usage"]["prompt_tokens"].as_u64().map(|n| n as usize).or(counted);
                sample.cached_tokens = t["cache_n"].as_u64().map(|n| n as usize);
                sample.prefill_ms = t["prompt_ms"].as_f64();
                sample.decode_ms = t["predicted_ms"].as_f64();
                sample.generated = t["predicted_n"].as_u64().map(|n| n as usize);
                let rate = |n: Option<u64>, ms: Option<f64>| match (n, ms) {
                    (Some(n), Some(ms)) if ms > 0.0 => Some(n as f64 / ms * 1e3),
                    _ => None,
                };
                sample.prefill_tok_s = rate(t["prompt_n"].as_u64(), sample.prefill_ms);
                sample.decode_tok_s = rate(t["predicted_n"].as_u64(), sample.decode_ms);
                let choice = &b["choices"][0];
                sample.output = choice["text"]
                    .as_str()
                    .or(choice["message"]["content"].as_str())
                    .unwrap_or("")
                    .to_string();
                sample.error = b["error"]["message"].as_str().unwrap_or("").to_string();
            }
            Err(e) => {
                sample.status = 0;
                sample.error = format!("no HTTP answer: {e:#}");
            }
        }
        if sample.status != 200 {
            // A dead worker is restarted by the front; wait for it so the next request meets a loaded one.
            self.server
                .wait_healthy(HEALTH_TIMEOUT)
                .context("the server did not come back after a failed request")?;
        }
        sample.restarts = self.server.restarts().unwrap_or(restarts_before) - restarts_before;
        if let Some(pid) = self.server.worker_pid() {
            self.sampler.worker_pid.store(pid, std::sync::atomic::Ordering::Relaxed);
        }
        self.bar.inc(1);
        Ok(sample)
    }

    /// Runs one row (`reps` requests) and returns it without checks.
    fn row(&mut self, c: &Case, kind: &str, tokens: Option<usize>) -> Result<CaseRow> {
        let reps = self.repetitions(c);
        let label = match tokens {
            Some(n) => format!("{} {n}", c.name),
            None => c.name.clone(),
        };
        self.bar.set_message(label.clone());
        self.arm.markers.push((self.epoch.elapsed().as_millis() as u64, label));
        let log_from = self.log_len();
        let prompt = c.prompt.clone().unwrap_or(Prompt {
            text: None,
            messages: None,
            tokens,
        });
        // A prompt past the server's context is answered 400 however long it is: one token past the context is
        // sent in its place (a billion-token prompt is never built). Expected anything but 400, it is the
        // scenario's mistake, said before anything is sent; a boundary search's probe past it simply fails.
        let asked = tokens.or(prompt.tokens);
        let n_ctx = self.server.n_ctx;
        let sent = match asked {
            Some(n) if n_ctx > 0 && n > n_ctx => {
                if kind != "probe" && self.expect(c).status != Some(400) {
                    return Err(ScenarioMistake(format!(
                        "case `{}`: a prompt of {n} tokens is past the server's context of {n_ctx} tokens: lower it, raise --max-context, or expect `status: 400`",
                        c.name
                    ))
                    .into());
                }
                Some(n_ctx + 1)
            }
            _ => tokens,
        };
        let mut samples = Vec::new();
        for _ in 0..reps {
            samples.push(self.request(c, &prompt, sent)?);
        }
        let stat = |f: fn(&Sample) -> Option<f64>| Stat::of(&samples.iter().filter_map(f).collect::<Vec<_>>());
        Ok(CaseRow {
            case: c.name.clone(),
            kind: kind.into(),
            tokens_requested: tokens.or(prompt.tokens),
            prefill_tok_s: stat(|s| s.prefill_tok_s),
            decode_tok_s: stat(|s| s.decode_tok_s),
            log_excerpt: self.log_excerpt(log_from),
            samples,
            checks: vec![],
        })
    }

    fn run_case(&mut self, c: &Case) -> Result<()> {
        let expect = self.expect(c);
        let cap = self.quick.map(|q| q.max_prompt_tokens);
        if let Some(load) = &c.load {
            let seconds = self.quick.map_or(load.seconds, |q| load.seconds.min(q.load_seconds));
            let max_tokens = c.max_tokens.unwrap_or(self.s.max_tokens);
            let prompts = std::sync::Mutex::new(&mut *self.prompts);
            for &clients in &load.clients {
                let label = format!("{} x{clients}", c.name);
                self.bar.set_message(label.clone());
                self.arm.markers.push((self.epoch.elapsed().as_millis() as u64, label));
                let row = crate::load::run(&c.name, load, clients, seconds, max_tokens, &self.server.base, &prompts)?;
                self.bar.inc(1);
                self.arm.loads.push(row);
            }
            return Ok(());
        }
        match (&c.prompt, &c.sweep) {
            (Some(_), _) => {
                let row = self.row(c, "prompt", None)?;
                self.arm.rows.push(row);
            }
            (None, Some(sw)) if sw.find_boundary => {
                let SweepValues::Range(r) = &sw.tokens else {
                    unreachable!("validated")
                };
                let to = cap.map_or(r.to, |cap| r.to.min(cap).max(r.from));
                let mut rows = Vec::new();
                let (first, last, probes) = find_boundary(r.from, to, |n| {
                    let row = self.row(c, "probe", Some(n))?;
                    let ok = row.samples.iter().all(|s| s.status == 200 && s.restarts == 0);
                    rows.push(row);
                    Ok(ok)
                })?;
                rows.sort_by_key(|row| row.tokens_requested);
                self.arm.rows.extend(rows);
                let check = expect.boundary.as_ref().map(|b| {
                    let want = match b {
                        BoundaryExpect::At(n) => Some(*n),
                        BoundaryExpect::None(_) => None,
                    };
                    let show = |x: Option<usize>| x.map_or("none".to_string(), |n| n.to_string());
                    Check {
                        what: format!("boundary of {}", c.name),
                        expected: show(want),
                        got: show(first),
                        passed: want == first,
                    }
                });
                self.arm.boundaries.push(Boundary {
                    case: c.name.clone(),
                    from: r.from,
                    to,
                    first_failing: first,
                    last_passing: last,
                    probes,
                    check,
                });
            }
            (None, Some(sw)) => {
                let mut pts = match &sw.tokens {
                    SweepValues::List(v) => v.clone(),
                    SweepValues::Range(r) => r.points(),
                };
                if let Some(cap) = cap {
                    pts.retain(|&n| n <= cap);
                }
                for n in pts {
                    let row = self.row(c, "sweep", Some(n))?;
                    self.arm.rows.push(row);
                }
            }
            (None, None) => unreachable!("validated"),
        }
        Ok(())
    }
}

/// Judges a row against `e` (boundary probes judged by their boundary instead, when one is expected).
pub fn check_row(row: &CaseRow, e: &Expect, tokenizer: Option<&strata_engine::tokenizer::Tokenizer>) -> Vec<Check> {
    let mut out = Vec::new();
    if row.kind == "probe" && e.boundary.is_some() {
        return out;
    }
    let want_status = e.status.unwrap_or(200);
    let statuses: Vec<String> = row.samples.iter().map(|s| s.status.to_string()).collect();
    out.push(Check {
        what: "HTTP status".into(),
        expected: want_status.to_string(),
        got: statuses.join(", "),
        passed: row.samples.iter().all(|s| s.status == want_status),
    });
    if let Some(f) = &e.fault {
        let seen: Vec<String> = row
            .samples
            .iter()
            .map(|s| match s.faults.first() {
                Some(x) => x.to_string(),
                None => "no launch fault".into(),
            })
            .collect();
        let mut want = Vec::new();
        if let Some(k) = &f.kernel {
            want.push(format!("kernel {k}"));
        }
        if let Some(sy) = f.synced {
            want.push(if sy { "synchronised" } else { "not synchronised" }.to_string());
        }
        out.push(Check {
            what: "the launch fault that killed the worker".into(),
            expected: want.join(", "),
            got: seen.join("; "),
            passed: !row.samples.is_empty()
                && row.samples.iter().all(|s| {
                    s.faults.first().is_some_and(|x| {
                        f.kernel.as_ref().is_none_or(|k| *k == x.kernel) && f.synced.is_none_or(|sy| sy == x.synced)
                    })
                }),
        });
    }
    let want_restarts = e.restarts.unwrap_or(0);
    out.push(Check {
        what: "worker restarts per request".into(),
        expected: want_restarts.to_string(),
        got: row
            .samples
            .iter()
            .map(|s| s.restarts.to_string())
            .collect::<Vec<_>>()
            .join(", "),
        passed: row.samples.iter().all(|s| s.restarts == want_restarts),
    });
    if let Some(n) = row.tokens_requested
        && row.kind != "probe"
        && want_status == 200
    {
        let seen: Vec<String> = row
            .samples
            .iter()
            .map(|s| s.prompt_tokens.map_or("?".into(), |p| p.to_string()))
            .collect();
        out.push(Check {
            what: "prompt tokens seen by the server".into(),
            expected: n.to_string(),
            got: seen.join(", "),
            passed: row.samples.iter().all(|s| s.prompt_tokens == Some(n)),
        });
    }
    let rate = |what: &str, min: Option<f64>, st: &Option<Stat>, out: &mut Vec<Check>| {
        if let Some(min) = min {
            let got = st.map(|s| s.median);
            out.push(Check {
                what: format!("{what} (median)"),
                expected: format!(">= {min} tok/s"),
                got: got.map_or("none".into(), |g| format!("{g:.1} tok/s")),
                passed: got.is_some_and(|g| g >= min),
            });
        }
    };
    rate("prefill rate", e.min_prefill_tok_s, &row.prefill_tok_s, &mut out);
    rate("decode rate", e.min_decode_tok_s, &row.decode_tok_s, &mut out);
    if let Some(min) = e.min_decode_hit_rate {
        let got = row.cache("decode");
        out.push(Check {
            what: "decode expert cache hit rate".into(),
            expected: format!(">= {:.1}%", min * 100.0),
            got: match got.and_then(|c| c.hit_rate().map(|h| (c, h))) {
                Some((c, h)) => format!("{:.1}% ({} hits / {} lookups)", h * 100.0, c.hits, c.lookups),
                None => "no decode `expert_cache` events (every expert resident?)".into(),
            },
            passed: got.and_then(|c| c.hit_rate()).is_some_and(|h| h >= min),
        });
    }
    if let Some(max) = e.max_rss_mib {
        let peak = row.samples.iter().map(|s| s.peak_worker_rss_bytes).max().unwrap_or(0) as f64 / 1048576.0;
        out.push(Check {
            what: "worker RSS peak".into(),
            expected: format!("<= {max} MiB"),
            got: format!("{peak:.0} MiB"),
            passed: peak <= max,
        });
    }
    for s in row.samples.iter().filter(|s| s.status == 200) {
        let short: String = s.output.chars().take(120).collect();
        if let Some(t) = &e.contains {
            out.push(Check {
                what: "output contains".into(),
                expected: format!("{t:?}"),
                got: format!("{short:?}"),
                passed: s.output.contains(t.as_str()),
            });
        }
        if let Some(r) = &e.regex {
            let ok = regex::Regex::new(r).is_ok_and(|re| re.is_match(&s.output));
            out.push(Check {
                what: "output matches".into(),
                expected: format!("/{r}/"),
                got: format!("{short:?}"),
                passed: ok,
            });
        }
        if let (Some(g), Some(tok)) = (&e.golden_tokens, tokenizer) {
            let ids = tok.encode(&s.output, false, false).unwrap_or_default();
            out.push(Check {
                what: "output tokens start with the golden ones".into(),
                expected: format!("{g:?}"),
                got: format!("{:?}", &ids[..ids.len().min(g.len())]),
                passed: ids.starts_with(g),
            });
        }
    }
    out
}

/// `strata serve` as this harness's engine parses it (for [`check_serve_args`]).
#[derive(clap::Parser)]
#[command(name = "strata serve")]
struct ServeLine {
    #[command(flatten)]
    serve: strata_engine::serve::ServeArgs,
}

/// Parses every combination's `strata serve` arguments (the scenario's, then its arms', with the harness's own
/// `--device`, `--model`, `--host` and `--port`) with the flags of the engine this harness was built with:
/// `strata-harness check` catches a typo in an arm (`--routing-trace synth:zipf`, `--kv f61`) before a run
/// starts a server. A run with another engine binary (`--strata`, bisect) does not apply it: that binary's flags
/// may differ.
///
/// Errors: the first combination whose arguments do not parse, named, with the parser's message.
pub fn check_serve_args(s: &Scenario) -> Result<(), String> {
    use clap::Parser;
    // llama-server's combinations: their arguments are llama.cpp's, which llama-server itself judges.
    for c in combos(s).into_iter().filter(|c| c.server() == ServerKind::Strata) {
        let mut args = vec!["strata serve".to_string()];
        args.extend(s.args.iter().cloned());
        for a in &c.arms {
            args.extend(a.args.iter().cloned());
        }
        args.extend([
            "--device".into(),
            s.device.clone(),
            "--model".into(),
            "model.gguf".into(),
        ]);
        args.extend(["--host".into(), "127.0.0.1".into(), "--port".into(), "0".into()]);
        if let Err(e) = ServeLine::try_parse_from(&args) {
            let msg = e.to_string();
            let first = msg.lines().next().unwrap_or("").trim_start_matches("error: ");
            return Err(format!(
                "combination `{}`: strata serve would refuse its arguments: {first}",
                c.name
            ));
        }
    }
    Ok(())
}

/// What a scenario can be checked for before anything runs, beyond its schema and [`Scenario::validate`]: its
/// device (`device`: the scenario's, or `--device`'s) parses, a model given as a file exists, every combination's
/// `strata serve` arguments parse ([`check_serve_args`]), and every `STRATA_FAULT` in its environment (the
/// scenario's or an arm's) is a fault plan the engine reads. These are the scenario author's mistakes: `check`
/// and `run` report them as scenario errors (exit 2), never as an engine that could not start (125), which bisect
/// would read as "skip this revision". Whether the device is on this machine is not checked here.
///
/// Errors: the first such mistake, naming it.
pub fn check_static(s: &Scenario, device: &str) -> Result<(), String> {
    // llama-server has no worker events, link probe or device flag: what an arm would expect of them is a mistake.
    for a in s
        .matrix
        .values()
        .flatten()
        .filter(|a| a.server == ServerKind::LlamaServer)
    {
        let strata_only = [
            ("expect_events", !a.expect_events.is_empty()),
            ("expect_start_error", a.expect_start_error.is_some()),
            ("expect_probe", a.expect_probe.is_some()),
            ("device", a.device.is_some()),
        ];
        if let Some((field, _)) = strata_only.iter().find(|(_, set)| *set) {
            return Err(format!(
                "arm `{}`: `{field}` is for strata serve, and this arm starts llama-server",
                a.name
            ));
        }
        // The harness gives the address and the model; an arm's own would leave it polling the wrong port.
        let owned = ["--host", "--port", "-m", "--model"];
        if let Some(flag) = a
            .args
            .iter()
            .find(|x| owned.contains(&x.split('=').next().unwrap_or("")))
        {
            return Err(format!(
                "arm `{}`: `{flag}` in llama-server's args: the harness sets --host, --port and -m itself",
                a.name
            ));
        }
    }
    for d in devices(s, device) {
        let parsed = d
            .parse::<strata_engine::device::Device>()
            .map_err(|e| format!("device `{d}`: {e}"))?;
        // A simulated device's profile is part of the scenario: a typo in its name or a mistake in its file is
        // the scenario's error, found before anything starts.
        if matches!(parsed, strata_engine::device::Device::Sim(_)) {
            parsed.available().map_err(|e| e.to_string())?;
        }
    }
    // A fault rule the combination's device cannot carry out is the scenario's error: a sticky launch failure or
    // a trap on the CPU (no device to poison), a trap or an op it does not have on a simulated device, the
    // unsynchronised probe anywhere but CUDA (the engine refuses each at start, which would read as exit 125).
    for c in combos(s) {
        let d = c.device(device);
        let fault = c
            .arms
            .iter()
            .rev()
            .find_map(|a| a.env.get(strata_engine::switches::FAULT))
            .or_else(|| s.env.get(strata_engine::switches::FAULT));
        let Some(plan) = fault.and_then(|v| strata_engine::device::fault::FaultPlan::parse(v).ok()) else {
            continue;
        };
        let bad = |why: String| {
            format!(
                "combination {}: {} on {d}: {why}",
                c.name,
                strata_engine::switches::FAULT
            )
        };
        if d.starts_with("cuda:") {
            continue;
        }
        if plan.probe_unsynced {
            return Err(bad(
                "probe:unsynced makes the CUDA link probe time copies it did not wait for; only a cuda: device has that probe (a sim: profile's link.probe_gb_s gives its readings)".into(),
            ));
        }
        if let Some(rule) = &plan.sticky {
            if d.starts_with("sim:") {
                rule.check_sim().map_err(bad)?;
            } else {
                return Err(bad(format!(
                    "{rule}: a sticky launch failure poisons a GPU, and {d} has none (use a sim: or cuda: device)"
                )));
            }
        }
    }
    let named = s.model == "default" || s.model.starts_with("synth:");
    if !named && !Path::new(&s.model).is_file() {
        return Err(format!(
            "model `{}`: no such file (a path, `default`, or `synth:PRESET`)",
            s.model
        ));
    }
    check_serve_args(s)?;
    let arms = combos(s).into_iter().flat_map(|c| c.arms);
    let envs = std::iter::once(("the scenario".to_string(), s.env.clone()))
        .chain(arms.map(|a| (format!("arm `{}`", a.name), a.env)));
    for (owner, env) in envs {
        if let Some(v) = env.get(strata_engine::switches::FAULT) {
            strata_engine::device::fault::FaultPlan::parse(v)
                .map_err(|e| format!("{owner}: {}={v:?}: {e}", strata_engine::switches::FAULT))?;
        }
    }
    Ok(())
}

/// Runs one combination: starts its server, runs every case, stops the server, reads the captures.
///
/// Errors: the server could not start (the arm's `error` is set instead and `Ok` returned), or a harness-side
/// failure (a prompt could not be built, the server vanished).
pub fn run_combo(
    s: &Scenario,
    combo: &Combo,
    settings: &RunSettings,
    prompts: &mut PromptBuilder,
    epoch: Instant,
) -> Result<ArmReport> {
    let logs = settings.out_dir.join("logs");
    std::fs::create_dir_all(&logs)?;
    prompts.restart();
    let slug = combo.slug();
    let log_path = logs.join(format!("{slug}.log"));
    let events_path = logs.join(format!("{slug}.events.jsonl"));
    let _ = std::fs::remove_file(&events_path);
    let kind = combo.server();
    let mut env: BTreeMap<String, String> = s.env.clone();
    let mut args = match kind {
        ServerKind::Strata => s.args.clone(),
        ServerKind::LlamaServer => Vec::new(),
    };
    for a in &combo.arms {
        env.extend(a.env.clone());
        if kind == ServerKind::Strata || a.server == ServerKind::LlamaServer {
            args.extend(a.args.clone());
        }
    }
    if s.compares_logits() {
        env.entry(strata_engine::switches::LOGITS_DIGEST.to_string())
            .or_insert_with(|| "1".into());
    }
    let mut arm = ArmReport {
        name: combo.name.clone(),
        arm_names: combo.arm_names(),
        args: args.clone(),
        env: env.clone(),
        log_file: format!("logs/{slug}.log"),
        events_file: format!("logs/{slug}.events.jsonl"),
        metrics_before_file: format!("logs/{slug}.metrics-before.txt"),
        metrics_after_file: format!("logs/{slug}.metrics-after.txt"),
        ..ArmReport::default()
    };
    let device = combo.device(&settings.device);
    arm.device = device.clone();
    arm.server = kind;
    let model = settings.model_path.display().to_string();
    let (program, full_args) = match kind {
        ServerKind::Strata => {
            let mut full = args.clone();
            full.extend([
                "--device".into(),
                device,
                "--model".into(),
                model,
                "--events".into(),
                events_path.display().to_string(),
            ]);
            (settings.strata.clone(), full)
        }
        ServerKind::LlamaServer => {
            let Some(bin) = settings.llama_server.clone() else {
                bail!("combination `{}` starts llama-server, and none was found", combo.name);
            };
            let mut full = vec!["-m".to_string(), model];
            full.extend(args.iter().cloned());
            (bin, full)
        }
    };
    let env_list: Vec<(String, String)> = env.into_iter().collect();
    let expected = combo.arms.iter().find_map(|a| a.expect_start_error.clone());
    arm.start_failure_expected = expected.is_some();
    let started = Server::start(kind, &program, &full_args, &env_list, &log_path, HEALTH_TIMEOUT);
    let mut server = match started {
        Ok(sv) => sv,
        Err(e) => {
            let cause = logged_error(&log_path);
            arm.error = Some(match &cause {
                Some(c) => format!("{e:#}: {c}"),
                None => format!("{e:#}"),
            });
            arm.raw_events = read_events(&events_path);
            arm.events = count_events(&arm.raw_events);
            for p in combo.arms.iter().filter_map(|a| a.expect_probe.as_ref()) {
                arm.event_checks.push(probe_check(&arm.raw_events, p.plausible));
            }
            if let Some(want) = expected {
                let log = std::fs::read_to_string(&log_path).unwrap_or_default();
                arm.event_checks.push(Check {
                    what: "the server's start fails, its log saying".into(),
                    expected: format!("`{want}`"),
                    got: cause.unwrap_or_else(|| "no error line in the log".into()),
                    passed: log.contains(&want),
                });
            }
            return Ok(arm);
        }
    };
    if let Some(want) = expected {
        arm.event_checks.push(Check {
            what: "the server's start fails, its log saying".into(),
            expected: format!("`{want}`"),
            got: "it started".into(),
            passed: false,
        });
    }
    let sampler = MemorySampler::start(
        server.pid(),
        Duration::from_millis(s.captures.memory_sample_ms.max(10)),
        epoch,
    );
    if let Some(pid) = server.worker_pid() {
        sampler.worker_pid.store(pid, std::sync::atomic::Ordering::Relaxed);
    }
    std::fs::write(
        settings.out_dir.join(&arm.metrics_before_file),
        server.metrics().unwrap_or_default(),
    )?;
    let restarts_start = server.restarts().unwrap_or(0);
    let bar = if settings.progress {
        let b = ProgressBar::new(0);
        b.set_style(
            ProgressStyle::with_template("{prefix:>24} [{bar:30}] {pos} requests  {msg}")
                .unwrap_or_else(|_| ProgressStyle::default_bar())
                .progress_chars("=> "),
        );
        b.set_prefix(combo.name.clone());
        b
    } else {
        ProgressBar::hidden()
    };
    let quick = if settings.quick { s.quick.as_ref() } else { None };
    let result = {
        let mut run = ArmRun {
            s,
            combo,
            server: &mut server,
            prompts,
            sampler: &sampler,
            epoch,
            log_path: log_path.clone(),
            arm: &mut arm,
            quick,
            bar: bar.clone(),
        };
        let planned: u64 = s
            .cases
            .iter()
            .filter(|c| c.runs_in(&combo.arm_names()))
            .map(|c| {
                let reps = u64::from(run.repetitions(c));
                let n = match &c.sweep {
                    None => 1,
                    Some(sw) if sw.find_boundary => 12,
                    Some(sw) => match &sw.tokens {
                        SweepValues::List(v) => v.len() as u64,
                        SweepValues::Range(r) => r.points().len() as u64,
                    },
                };
                n * reps
            })
            .sum();
        run.bar.set_length(planned);
        s.cases
            .iter()
            .enumerate()
            .filter(|(_, c)| c.runs_in(&combo.arm_names()))
            .try_for_each(|(i, c)| {
                run.prompts.start_case(i);
                run.run_case(c)
            })
    };
    bar.finish_and_clear();
    arm.restarts = server.restarts().unwrap_or(restarts_start) - restarts_start;
    std::fs::write(
        settings.out_dir.join(&arm.metrics_after_file),
        server.metrics().unwrap_or_default(),
    )?;
    server.stop();
    arm.memory = sampler.finish();
    arm.raw_events = read_events(&events_path);
    arm.events = count_events(&arm.raw_events);
    result?;
    attribute_cache_events(&mut arm);
    // Per-request RSS peaks, then the checks.
    for row in &mut arm.rows {
        for smp in &mut row.samples {
            smp.peak_worker_rss_bytes = arm
                .memory
                .iter()
                .filter(|m| m.t_ms >= smp.t_start_ms && m.t_ms <= smp.t_end_ms + 250)
                .map(|m| m.worker_rss_bytes)
                .max()
                .unwrap_or(0);
        }
    }
    let tok = prompts.tokenizer();
    for row in &mut arm.rows {
        let e = row_expect(s, &arm.arm_names, &row.case);
        row.checks = check_row(row, &e, Some(tok));
    }
    for a in &combo.arms {
        if let Some(p) = &a.expect_probe {
            arm.event_checks.push(probe_check(&arm.raw_events, p.plausible));
        }
        for (kind, want) in &a.expect_events {
            let got = arm.events.get(kind).copied().unwrap_or(0);
            arm.event_checks.push(Check {
                what: format!("`{kind}` events over the arm"),
                expected: want.to_string(),
                got: got.to_string(),
                passed: got == *want,
            });
        }
    }
    Ok(arm)
}

/// The check of an arm's `expect_probe`: the worker's `probe` event says its readings were `plausible` or not.
fn probe_check(events: &[Value], plausible: bool) -> Check {
    let probe = events.iter().find(|e| e["event"] == "probe");
    let got = probe.map_or("no probe event".into(), crate::report::probe_summary);
    Check {
        what: "the link probe's check".into(),
        expected: if plausible { "plausible" } else { "a probe bug" }.into(),
        got,
        passed: probe.is_some_and(|p| p["plausible"] == plausible),
    }
}

/// The first error line a server's log holds (`strata: error: ...`, the worker's cause of a failed start), without
/// its prefix.
fn logged_error(log: &std::path::Path) -> Option<String> {
    let text = std::fs::read_to_string(log).ok()?;
    text.lines()
        .find_map(|l| l.split_once("error: ").map(|(_, e)| e.trim().to_string()))
        .filter(|e| !e.is_empty())
}

/// Milliseconds since the Unix epoch, the clock of the worker's events.
fn unix_ms() -> u64 {
    strata_engine::events::unix_ms()
}

/// The expectation of case `case` in the combination of arms `arm_names`: the scenario's, the case's, then each
/// arm's override in axis order, then the overrides of joined arms (`a+b`) the combination holds all of, in key
/// order.
fn row_expect(s: &Scenario, arm_names: &[String], case: &str) -> Expect {
    let Some(c) = s.cases.iter().find(|c| c.name == case) else {
        return s.expect.clone();
    };
    let mut e = s.expect.merged(&c.expect);
    for a in arm_names {
        if let Some(o) = c.arms.get(a) {
            e = e.merged(o);
        }
    }
    for (key, o) in &c.arms {
        if key.contains('+') && key.split('+').all(|part| arm_names.iter().any(|a| a == part)) {
            e = e.merged(o);
        }
    }
    e
}

/// Gives each request the `expert_cache` events its worker stamped while the request ran (the harness sends one
/// request at a time, so the window is the request's), summed by phase.
pub fn attribute_cache_events(arm: &mut ArmReport) {
    let cache: Vec<&Value> = arm.raw_events.iter().filter(|e| e["event"] == "expert_cache").collect();
    let faults: Vec<&Value> = arm
        .raw_events
        .iter()
        .filter(|e| e["event"] == "fault" && e["kernel"].is_string() && e["call"].is_u64())
        .collect();
    let requests: Vec<&Value> = arm.raw_events.iter().filter(|e| e["event"] == "request").collect();
    for smp in arm.rows.iter_mut().flat_map(|r| r.samples.iter_mut()) {
        smp.expert_cache.clear();
        let within =
            |e: &&&Value| (smp.t_start_unix_ms..=smp.t_end_unix_ms).contains(&e["ts_ms"].as_u64().unwrap_or(0));
        // The last in the window: the previous request's event may carry the millisecond this one started in.
        let done = requests.iter().rfind(within);
        smp.tokens = done
            .and_then(|e| e["tokens"].as_array())
            .map(|v| v.iter().filter_map(|t| t.as_u64().map(|t| t as u32)).collect())
            .unwrap_or_default();
        smp.logits_fnv = done
            .and_then(|e| e["logits_fnv"].as_array())
            .map(|v| v.iter().filter_map(|d| d.as_str().map(str::to_string)).collect())
            .unwrap_or_default();
        smp.faults = faults
            .iter()
            .filter(|e| (smp.t_start_unix_ms..=smp.t_end_unix_ms).contains(&e["ts_ms"].as_u64().unwrap_or(0)))
            .map(|e| LaunchFault {
                kernel: e["kernel"].as_str().unwrap_or_default().into(),
                call: e["call"].as_u64().unwrap_or(0),
                synced: e["synced"].as_bool().unwrap_or(false),
                error: e["error"].as_str().unwrap_or_default().into(),
            })
            .collect();
        for e in &cache {
            let ts = e["ts_ms"].as_u64().unwrap_or(0);
            if ts >= smp.t_start_unix_ms && ts <= smp.t_end_unix_ms {
                let phase = e["phase"].as_str().unwrap_or("unknown").to_string();
                smp.expert_cache.entry(phase).or_default().add_event(e);
            }
        }
    }
}

/// A mistake in the scenario that only the run can see (a prompt past the server's context): the run stops with
/// exit 2, as `check`'s errors do, not as an engine failure.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct ScenarioMistake(pub String);

/// What a `same_*_as` expectation compares.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Same {
    /// `same_output_as`: the text.
    Output,
    /// `same_tokens_as`: the generated token ids.
    Tokens,
    /// `same_logits_as`: each step's logits digest.
    Logits,
}

impl Same {
    const ALL: [Same; 3] = [Same::Output, Same::Tokens, Same::Logits];

    /// The arm this kind's expectation names.
    fn arm(self, e: &Expect) -> Option<String> {
        match self {
            Same::Output => e.same_output_as.clone(),
            Same::Tokens => e.same_tokens_as.clone(),
            Same::Logits => e.same_logits_as.clone(),
        }
    }

    fn what(self) -> &'static str {
        match self {
            Same::Output => "output equals",
            Same::Tokens => "token ids equal",
            Same::Logits => "logits equal",
        }
    }

    /// `got` against `want` (answered requests): `None` when equal, else what differs.
    fn differs(self, got: &Sample, want: &Sample) -> Option<String> {
        fn first_difference<T: PartialEq>(a: &[T], b: &[T]) -> Option<usize> {
            (a != b).then(|| a.iter().zip(b).take_while(|(p, q)| p == q).count())
        }
        match self {
            Same::Output => {
                let short = |t: &str| format!("{:?}", t.chars().take(80).collect::<String>());
                let (a, b): (Vec<char>, Vec<char>) = (got.output.chars().collect(), want.output.chars().collect());
                first_difference(&a, &b).map(|at| format!("differs from character {at}: {}", short(&got.output)))
            }
            Same::Tokens => {
                if got.tokens.is_empty() || want.tokens.is_empty() {
                    return Some(
                        "no token ids: a request event without them (a worker older than the harness?)".into(),
                    );
                }
                first_difference(&got.tokens, &want.tokens).map(|at| {
                    format!(
                        "token {at} (counting from 0) differs: {} against {}",
                        got.tokens.get(at).map_or("(end)".into(), |t| t.to_string()),
                        want.tokens.get(at).map_or("(end)".into(), |t| t.to_string())
                    )
                })
            }
            Same::Logits => {
                if got.logits_fnv.is_empty() || want.logits_fnv.is_empty() {
                    return Some(format!(
                        "no logits digests: the request events have none ({}=1 was unset for a combination?)",
                        strata_engine::switches::LOGITS_DIGEST
                    ));
                }
                first_difference(&got.logits_fnv, &want.logits_fnv).map(|at| {
                    format!(
                        "the logits of token {at} (counting from 0) of {} differ",
                        got.logits_fnv.len()
                    )
                })
            }
        }
    }

    /// The check's `expected` column: what the reference holds.
    fn expected(self, want: &Sample) -> String {
        match self {
            Same::Output => format!("{:?}", want.output.chars().take(80).collect::<String>()),
            Same::Tokens => format!("the same {} tokens", want.tokens.len()),
            Same::Logits => format!("bit-identical logits at {} steps", want.logits_fnv.len()),
        }
    }

    fn same(self) -> &'static str {
        match self {
            Same::Output => "the same text",
            Same::Tokens => "the same tokens",
            Same::Logits => "the same logits",
        }
    }
}

/// The `same_output_as`, `same_tokens_as` and `same_logits_as` checks, which compare combinations with each
/// other, so they run after every combination: each row whose expectation names an arm X is compared, request by
/// request, with the same case's row in the combination that has X in place of this one's arm on X's axis, or,
/// when the scenario excludes that one, the combination with X that the scenario runs and that shares the most of
/// this one's other arms. `ran_all` is false when some combinations were left out on purpose (`--arm`): a row
/// whose reference was left out that way is not judged. A reference excluded with no single closest stand-in, or
/// whose server did not start, fails the check.
///
/// Returns how many checks were not judged (their reference left out by `--arm`).
pub fn check_same_outputs(s: &Scenario, arms: &mut [ArmReport], ran_all: bool) -> usize {
    let running = s.running_arm_names();
    let axes: Vec<&String> = s.matrix.keys().collect();
    let mut found: Vec<(usize, usize, Check)> = Vec::new();
    let mut unjudged = 0;
    for (ai, a) in arms.iter().enumerate() {
        for (ri, row) in a.rows.iter().enumerate() {
            let expect = row_expect(s, &a.arm_names, &row.case);
            for kind in Same::ALL {
                let Some(x) = kind.arm(&expect) else {
                    continue;
                };
                match same_check(s, arms, a, row, kind, &x, &running, &axes, ran_all) {
                    Judged::Check(check) => found.push((ai, ri, check)),
                    Judged::LeftOut => unjudged += 1,
                    Judged::NotApplicable => {}
                }
            }
        }
    }
    for (ai, ri, c) in found {
        arms[ai].rows[ri].checks.push(c);
    }
    unjudged
}

/// What [`same_check`] made of one expectation.
enum Judged {
    Check(Check),
    /// The reference combination was left out of the run (`--arm`).
    LeftOut,
    /// Nothing to compare: the row is a boundary probe, or the combination holds the arm itself.
    NotApplicable,
}

/// One `same_*_as` check of `row` of combination `a` against arm `x` ([`check_same_outputs`]).
#[allow(clippy::too_many_arguments)]
fn same_check(
    s: &Scenario,
    arms: &[ArmReport],
    a: &ArmReport,
    row: &CaseRow,
    kind: Same,
    x: &String,
    running: &[Vec<String>],
    axes: &[&String],
    ran_all: bool,
) -> Judged {
    if row.kind == "probe" || a.arm_names.contains(x) {
        return Judged::NotApplicable;
    }
    let Some(pos) = s.axis_of(x).and_then(|ax| axes.iter().position(|a| *a == ax)) else {
        return Judged::NotApplicable;
    };
    let mut want = a.arm_names.clone();
    if pos >= want.len() {
        return Judged::NotApplicable;
    }
    want[pos] = x.clone();
    let label = |names: &[String]| {
        let w: Vec<String> = axes.iter().zip(names).map(|(ax, n)| format!("{ax}={n}")).collect();
        w.join(",")
    };
    // The combination with X in place of this one's arm; when the scenario excludes it, the combination with X
    // (among those the scenario runs, whether or not `--arm` ran them) that shares the most of this one's other
    // arms, if one alone does (X's arm runs in fewer combinations, as an all-resident reference usually does).
    let shared = |names: &[String]| names.iter().zip(&want).filter(|(p, q)| p == q).count();
    let with_x: Vec<&Vec<String>> = running.iter().filter(|c| c.contains(x)).collect();
    let most = with_x.iter().map(|c| shared(c)).max().unwrap_or(0);
    let closest: Vec<&Vec<String>> = with_x.into_iter().filter(|c| shared(c) == most).collect();
    let target = if s.excludes(&want) && closest.len() == 1 {
        closest[0].clone()
    } else {
        want.clone()
    };
    // A case that `only:` keeps out of the reference's combination has nothing to compare with there.
    if s.cases.iter().any(|c| c.name == row.case && !c.runs_in(&target)) {
        return Judged::NotApplicable;
    }
    let reference = arms.iter().find(|b| b.arm_names == target);
    let at = match (row.kind.as_str(), row.tokens_requested) {
        ("sweep", Some(n)) => format!(" at {n} prompt tokens"),
        _ => String::new(),
    };
    let what = format!("{}{at} arm `{x}`'s ({})", kind.what(), label(&target));
    let fail = |got: String| Check {
        what: what.clone(),
        expected: kind.same().into(),
        got,
        passed: false,
    };
    Judged::Check(match reference {
        None if !ran_all && !s.excludes(&target) => return Judged::LeftOut,
        None if s.excludes(&target) => fail(format!(
            "that combination is excluded, and {} others with arm `{x}` share as many of its arms: name one by excluding the rest",
            closest.len()
        )),
        None => fail("that combination was not run".into()),
        Some(b) if b.error.is_some() => fail("that combination's engine did not start".into()),
        // Request by request: repetition i against the reference's repetition i (the same prompt: a case's
        // prompts depend on its position alone, PromptBuilder::start_case).
        Some(b) => match b
            .rows
            .iter()
            .find(|r| r.case == row.case && r.kind == row.kind && r.tokens_requested == row.tokens_requested)
            .filter(|r| r.samples.iter().any(|s| s.status == 200))
        {
            None => fail("that combination has no answered request for this row".into()),
            Some(refs) => {
                let bad = row.samples.iter().enumerate().find_map(|(i, smp)| {
                    let rep = |m: String| {
                        if row.samples.len() > 1 {
                            format!("repetition {}: {m}", i + 1)
                        } else {
                            m
                        }
                    };
                    match refs.samples.get(i) {
                        _ if smp.status != 200 => Some(rep(format!("status {}", smp.status))),
                        None => Some(rep("the reference has no such repetition".into())),
                        Some(r) if r.status != 200 => Some(rep(format!("the reference's status {}", r.status))),
                        Some(r) => kind.differs(smp, r).map(rep),
                    }
                });
                let first = refs.samples.iter().find(|s| s.status == 200).expect("filtered");
                Check {
                    what: what.clone(),
                    expected: kind.expected(first),
                    passed: bad.is_none(),
                    got: bad.unwrap_or_else(|| kind.same().into()),
                }
            }
        },
    })
}

/// The scenario's model as a local path (fetching the default model on first use).
///
/// Errors: the model cannot be found or fetched.
pub fn model_path(model: &str) -> Result<PathBuf> {
    Ok(strata_engine::models::resolve(Some(model))?)
}

/// The devices the combinations that run use: each one's arm `device`, else `default` (the scenario's or
/// `--device`), each once, in order.
pub fn devices(s: &Scenario, default: &str) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for c in combos(s) {
        let d = c.device(default);
        if !out.contains(&d) {
            out.push(d);
        }
    }
    if out.is_empty() {
        out.push(default.to_string());
    }
    out
}

/// Whether `device` can run here, and why not.
pub fn device_available(device: &str) -> Result<(), String> {
    let d: strata_engine::device::Device = device.parse().map_err(|e| format!("{e}"))?;
    d.available().map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn boundary_search_is_logarithmic_and_exact() {
        for b in [16, 17, 65, 1000, 4096] {
            let mut calls = 0;
            let (first, last, probes) = find_boundary(16, 4096, |n| {
                calls += 1;
                Ok(n < b)
            })
            .unwrap();
            assert_eq!(first, Some(b));
            assert_eq!(last, if b > 16 { Some(b - 1) } else { None });
            assert_eq!(probes, calls);
            assert!(calls <= 2 + 12, "{calls}");
        }
        let (first, last, probes) = find_boundary(16, 4096, |_| Ok(true)).unwrap();
        assert_eq!((first, last, probes), (None, Some(4096), 1));
    }

    #[test]
    fn matrix_is_a_cartesian_product() {
        let s = crate::scenario::parse(
            "t",
            "name: t\nmatrix:\n  kv: [{name: f16}, {name: int8}]\n  fb: [{name: on}, {name: off}]\ncases:\n  - name: a\n    prompt: {text: x}\n",
        )
        .unwrap();
        let names: Vec<String> = combos(&s).into_iter().map(|c| c.name).collect();
        assert_eq!(
            names,
            ["fb=on,kv=f16", "fb=on,kv=int8", "fb=off,kv=f16", "fb=off,kv=int8"]
        );
    }

    /// A case's expectation: the single arms' overrides in axis order, then a joined key's (`a+b`) in the
    /// combinations that hold both.
    #[test]
    fn joined_arm_expectations_apply_where_every_arm_is() {
        let s = crate::scenario::parse(
            "t",
            "name: t\nmatrix:\n  cache: [{name: resident}, {name: small}]\n  routing: [{name: own}, {name: locality}]\ncases:\n  - name: a\n    prompt: {text: x}\n    arms:\n      small: {min_decode_tok_s: 120}\n      small+locality: {min_decode_tok_s: 212}\n      locality: {min_prefill_tok_s: 5}\n",
        )
        .unwrap();
        let floor = |arms: &[&str]| {
            let names: Vec<String> = arms.iter().map(|a| a.to_string()).collect();
            let e = row_expect(&s, &names, "a");
            (e.min_decode_tok_s, e.min_prefill_tok_s)
        };
        assert_eq!(floor(&["small", "own"]), (Some(120.0), None));
        assert_eq!(floor(&["small", "locality"]), (Some(212.0), Some(5.0)));
        assert_eq!(floor(&["resident", "locality"]), (None, Some(5.0)));
    }

    /// `check` parses every combination's serve arguments: a typo in one arm is named; the checked-in scenarios
    /// all parse.
    #[test]
    fn serve_arguments_are_checked_per_combination() {
        let s = crate::scenario::parse(
            "t",
            "name: t\nargs: [\"--max-context\", \"1024\"]\nmatrix:\n  kv: [{name: f16, args: [\"--kv\", \"f16\"]}, {name: bad, args: [\"--kv\", \"f61\"]}]\ncases:\n  - name: a\n    prompt: {text: x}\n",
        )
        .unwrap();
        let e = check_serve_args(&s).unwrap_err();
        assert!(e.contains("combination `kv=bad`") && e.contains("f61"), "{e}");
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../scenarios");
        for f in std::fs::read_dir(dir).unwrap() {
            let p = f.unwrap().path();
            if p.extension().is_some_and(|x| x == "yaml") {
                let s = crate::scenario::load(&p).unwrap();
                check_serve_args(&s).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
            }
        }
    }

    /// A fault rule the device cannot carry out is the scenario's error in `check` (exit 2), not a start failure
    /// (exit 125) at run time (issue 19, point 11).
    #[test]
    fn fault_rules_the_device_cannot_carry_out_are_scenario_errors() {
        let with = |device: &str, rule: &str| {
            let s = crate::scenario::parse(
                "t",
                &format!("name: t\nmodel: synth:tiny-qwen3moe\ndevice: {device}\nenv: {{STRATA_FAULT: \"{rule}\"}}\ncases:\n  - name: a\n    prompt: {{text: x}}\n"),
            )
            .unwrap();
            check_static(&s, device)
        };
        assert!(
            with("cpu", "probe:unsynced")
                .unwrap_err()
                .contains("only a cuda: device")
        );
        assert!(with("cpu", "sticky:matmul@1").unwrap_err().contains("cpu has none"));
        assert!(with("cpu", "trap:matmul@1").is_err());
        assert!(with("sim:gfx1151-strix-halo", "trap:rms_norm@1").is_err());
        assert!(with("sim:gfx1151-strix-halo", "probe:unsynced").is_err());
        with("sim:gfx1151-strix-halo", "sticky:moe_add_rms_norm@2").unwrap();
        with("cuda:0", "trap:rms_norm@1").unwrap();
        with("cpu", "prefill_gemm:m>64").unwrap();
    }

    const OFFLOAD: &str = "name: t\nmatrix:\n  cache: [{name: resident}, {name: small}]\n  store: [{name: arena}, {name: mmap}]\nexclude:\n  - {cache: resident, store: mmap}\ncases:\n  - name: a\n    prompt: {text: x}\n    expect: {same_output_as: resident}\n";

    #[test]
    fn excluded_combinations_are_not_run() {
        let s = crate::scenario::parse("t", OFFLOAD).unwrap();
        let names: Vec<String> = combos(&s).into_iter().map(|c| c.name).collect();
        assert_eq!(
            names,
            [
                "cache=resident,store=arena",
                "cache=small,store=arena",
                "cache=small,store=mmap"
            ]
        );
    }

    fn answered(output: &str) -> Sample {
        Sample {
            status: 200,
            output: output.into(),
            ..Sample::default()
        }
    }

    fn arm(names: &[&str], outputs: &[&str]) -> ArmReport {
        ArmReport {
            name: names.join(","),
            arm_names: names.iter().map(|n| n.to_string()).collect(),
            rows: vec![CaseRow {
                case: "a".into(),
                kind: "prompt".into(),
                samples: outputs.iter().map(|o| answered(o)).collect(),
                ..CaseRow::default()
            }],
            ..ArmReport::default()
        }
    }

    /// `same_tokens_as` and `same_logits_as` compare the `request` events' token ids and logits digests, name the
    /// first step that differs, and fail when a request event had none (a check that cannot pass vacuously).
    #[test]
    fn tokens_and_logits_are_compared_step_by_step() {
        let s = crate::scenario::parse(
            "t",
            "name: t\nswitches: {switches: [PDL, CPU_AVX512]}\ncases:\n  - name: a\n    prompt: {text: x}\n    expect: {same_tokens_as: defaults, same_logits_as: defaults}\n",
        )
        .unwrap();
        let with = |names: &[&str], tokens: &[u32], fnv: &[&str]| {
            let mut a = arm(names, &["same text"]);
            a.rows[0].samples[0].tokens = tokens.to_vec();
            a.rows[0].samples[0].logits_fnv = fnv.iter().map(|d| d.to_string()).collect();
            a
        };
        let mut arms = vec![
            with(&["defaults"], &[5, 6, 7], &["a", "b", "c"]),
            with(&["PDL-off"], &[5, 6, 7], &["a", "b", "c"]),
            with(&["CPU_AVX512-on"], &[5, 9, 7], &["a", "x", "c"]),
        ];
        check_same_outputs(&s, &mut arms, true);
        assert!(arms[0].rows[0].checks.is_empty());
        let c = &arms[1].rows[0].checks;
        assert_eq!(c.len(), 2, "{c:?}");
        assert!(c.iter().all(|c| c.passed), "{c:?}");
        let c = &arms[2].rows[0].checks;
        assert!(
            !c[0].passed && c[0].what.starts_with("token ids equal arm `defaults`"),
            "{c:?}"
        );
        assert_eq!(c[0].got, "token 1 (counting from 0) differs: 9 against 6");
        assert!(
            !c[1].passed && c[1].got == "the logits of token 1 (counting from 0) of 3 differ",
            "{c:?}"
        );
        // No digests in the events: a failure that says so, not a pass.
        let mut arms = vec![with(&["defaults"], &[5], &[]), with(&["PDL-off"], &[5], &[])];
        check_same_outputs(&s, &mut arms, true);
        let c = &arms[1].rows[0].checks;
        assert!(
            c[0].passed && !c[1].passed && c[1].got.contains("no logits digests"),
            "{c:?}"
        );
    }

    /// Repetition i is compared with the reference's repetition i (each repetition of a `tokens:` case is sent
    /// its own prompt, the same in every combination).
    #[test]
    fn repetitions_are_compared_in_order() {
        let s = crate::scenario::parse("t", OFFLOAD).unwrap();
        let mut arms = vec![
            arm(&["resident", "arena"], &["one", "two"]),
            arm(&["small", "arena"], &["one", "two"]),
            arm(&["small", "mmap"], &["one", "one"]),
        ];
        check_same_outputs(&s, &mut arms, true);
        assert!(arms[1].rows[0].checks[0].passed, "{:?}", arms[1].rows[0].checks);
        let c = &arms[2].rows[0].checks[0];
        assert!(
            !c.passed && c.got.starts_with("repetition 2: differs from character 0"),
            "{c:?}"
        );
    }

    #[test]
    fn outputs_are_compared_with_the_named_arm_on_its_axis() {
        let s = crate::scenario::parse("t", OFFLOAD).unwrap();
        let mut arms = vec![
            arm(&["resident", "arena"], &["Paris is", "Paris is"]),
            arm(&["small", "arena"], &["Paris is", "Paris is"]),
            arm(&["small", "mmap"], &["Paris is", "Paris was"]),
        ];
        check_same_outputs(&s, &mut arms, true);
        // The resident arm is not checked against itself.
        assert!(arms[0].rows[0].checks.is_empty());
        let c = &arms[1].rows[0].checks;
        assert_eq!(c.len(), 1);
        assert!(c[0].passed && c[0].what.contains("cache=resident,store=arena"), "{c:?}");
        // small+mmap: resident+mmap is excluded, so the one combination with `resident` is the reference.
        let c = &arms[2].rows[0].checks;
        assert!(
            !c[0].passed && c[0].what.contains("(cache=resident,store=arena)"),
            "{c:?}"
        );
        assert!(c[0].got.contains("differs from character 6"), "{c:?}");
        // Not excluded: the exact combination is the reference, whatever else has the arm.
        let two = crate::scenario::parse(
            "t",
            &OFFLOAD.replace("{cache: resident, store: mmap}", "{cache: small, store: mmap}"),
        )
        .unwrap();
        let mut arms = vec![
            arm(&["resident", "arena"], &["Paris is"]),
            arm(&["resident", "mmap"], &["Paris is"]),
            arm(&["small", "arena"], &["Paris is"]),
        ];
        arms[1].arm_names = vec!["resident".into(), "mmap".into()];
        check_same_outputs(&two, &mut arms, true);
        assert!(arms[2].rows[0].checks[0].passed, "{:?}", arms[2].rows[0].checks);
        // Left out by --arm: not judged; present but different: fails, naming where.
        let mut arms = vec![arm(&["small", "arena"], &["Paris is"])];
        assert_eq!(check_same_outputs(&s, &mut arms, false), 1, "one comparison not judged");
        assert!(arms[0].rows[0].checks.is_empty());
        let mut arms = vec![
            arm(&["resident", "arena"], &["Paris is"]),
            arm(&["small", "arena"], &["Paris was"]),
        ];
        check_same_outputs(&s, &mut arms, true);
        let c = &arms[1].rows[0].checks[0];
        assert!(!c.passed && c.got.contains("character 6"), "{c:?}");
        // A reference whose engine did not start.
        let mut dead = arm(&["resident", "arena"], &[]);
        dead.error = Some("no GPU".into());
        let mut arms = vec![dead, arm(&["small", "arena"], &["Paris is"])];
        check_same_outputs(&s, &mut arms, true);
        assert!(!arms[1].rows[0].checks[0].passed);
    }

    /// With the exact reference excluded, the combination with the named arm that shares the most of the row's
    /// other arms is the reference; a tie is a failed check that says so.
    /// An arm with `server: llama-server` makes its combination start llama.cpp's server with that arm's
    /// arguments alone (not `strata serve`'s flags, which are not checked against it), and may not expect what
    /// only strata has.
    #[test]
    fn a_llama_server_arm_starts_llama_server_and_expects_nothing_of_strata() {
        let text = |extra: &str| {
            format!(
                "name: t\nargs: [\"--max-context\", \"1024\"]\nmatrix:\n  slots:\n    - {{name: p4, args: [\"--parallel\", \"4\"]}}\n    - {{name: llama, server: llama-server, args: [\"-np\", \"4\"]{extra}}}\ncases:\n  - name: a\n    prompt: {{text: x}}\n"
            )
        };
        let s = crate::scenario::parse("t", &text("")).unwrap();
        let kinds: Vec<(String, ServerKind)> = combos(&s).iter().map(|c| (c.name.clone(), c.server())).collect();
        assert_eq!(
            kinds,
            [
                ("slots=p4".to_string(), ServerKind::Strata),
                ("slots=llama".to_string(), ServerKind::LlamaServer)
            ]
        );
        // `-np` is no strata flag: only strata's combinations are parsed as `strata serve` lines.
        assert_eq!(check_serve_args(&s), Ok(()));
        assert_eq!(check_static(&s, "cpu"), Ok(()));
        let s = crate::scenario::parse("t", &text(", expect_events: {load: 1}")).unwrap();
        let e = check_static(&s, "cpu").unwrap_err();
        assert!(e.contains("arm `llama`") && e.contains("expect_events"), "{e}");
        assert!(crate::scenario::parse("t", &text("").replace("llama-server", "llamaserver")).is_err());
        // The harness owns the address and the model: an arm's own `--port` would leave it polling another port.
        let s = crate::scenario::parse("t", &text("").replace("\"-np\", \"4\"", "\"--port\", \"9\"")).unwrap();
        let e = check_static(&s, "cpu").unwrap_err();
        assert!(e.contains("`--port`"), "{e}");
    }

    #[test]
    fn an_excluded_reference_falls_back_to_the_closest_combination() {
        let s = crate::scenario::parse(
            "t",
            "name: t\nmatrix:\n  cache: [{name: resident}, {name: small}]\n  routing: [{name: own}, {name: loc}, {name: uni}]\n  store: [{name: arena}, {name: mmap}]\nexclude:\n  - {cache: resident, store: mmap}\n  - {cache: resident, routing: uni}\ncases:\n  - name: a\n    prompt: {text: x}\n    expect: {same_output_as: resident}\n",
        )
        .unwrap();
        let mut arms = vec![
            arm(&["resident", "own", "arena"], &["A"]),
            arm(&["resident", "loc", "arena"], &["B"]),
            arm(&["small", "loc", "mmap"], &["B"]),
            arm(&["small", "uni", "mmap"], &["C"]),
        ];
        check_same_outputs(&s, &mut arms, true);
        let c = &arms[2].rows[0].checks[0];
        assert!(
            c.passed && c.what.contains("cache=resident,routing=loc,store=arena"),
            "{c:?}"
        );
        let c = &arms[3].rows[0].checks[0];
        assert!(!c.passed && c.got.contains("2 others"), "{c:?}");
        // With `--arm`, the closest is chosen among what the scenario runs: left out, it is not judged (the
        // own-routed resident run that did run is not a stand-in).
        let mut arms = vec![
            arm(&["resident", "own", "arena"], &["A"]),
            arm(&["small", "loc", "mmap"], &["B"]),
        ];
        check_same_outputs(&s, &mut arms, false);
        assert!(arms[1].rows[0].checks.is_empty(), "{:?}", arms[1].rows[0].checks);
    }

    /// A request's token ids come from its own `request` event, even when the one before it ended in the
    /// millisecond it started in.
    #[test]
    fn request_events_go_to_their_own_request() {
        let mut a = arm(&["small", "arena"], &["x", "y"]);
        a.rows[0].samples[0].t_start_unix_ms = 100;
        a.rows[0].samples[0].t_end_unix_ms = 200;
        a.rows[0].samples[1].t_start_unix_ms = 200;
        a.rows[0].samples[1].t_end_unix_ms = 300;
        a.raw_events = vec![
            json!({"event": "request", "ts_ms": 200, "id": 1, "tokens": [1, 2]}),
            json!({"event": "request", "ts_ms": 290, "id": 2, "tokens": [3, 4], "logits_fnv": ["ab", "cd"]}),
        ];
        attribute_cache_events(&mut a);
        assert_eq!(a.rows[0].samples[0].tokens, [1, 2]);
        assert_eq!(a.rows[0].samples[1].tokens, [3, 4]);
        assert_eq!(a.rows[0].samples[1].logits_fnv, ["ab", "cd"]);
    }

    #[test]
    fn cache_events_go_to_the_request_that_ran_then() {
        let ev = |ts: u64, phase: &str, lookups: u64, hits: u64| {
            json!({"event": "expert_cache", "v": 2, "ts_ms": ts, "phase": phase, "lookups": lookups, "hits": hits,
                   "admitted": 0, "staged": 0, "evictions": 0, "bytes_uploaded": 1000, "cpu_computed": 2})
        };
        let mut a = arm(&["small", "arena"], &["x", "y"]);
        a.rows[0].samples[0].t_start_unix_ms = 100;
        a.rows[0].samples[0].t_end_unix_ms = 200;
        a.rows[0].samples[1].t_start_unix_ms = 201;
        a.rows[0].samples[1].t_end_unix_ms = 300;
        a.raw_events = vec![
            ev(99, "decode", 1000, 1000),
            ev(150, "prefill", 40, 10),
            ev(200, "decode", 100, 90),
            ev(250, "decode", 100, 70),
            json!({"event": "request", "ts_ms": 250, "id": 1}),
        ];
        attribute_cache_events(&mut a);
        let s0 = &a.rows[0].samples[0].expert_cache;
        assert_eq!(s0["prefill"].lookups, 40);
        assert_eq!(s0["decode"].hits, 90);
        assert_eq!(a.rows[0].samples[1].expert_cache["decode"].hits, 70);
        let d = a.rows[0].cache("decode").unwrap();
        assert_eq!(
            (d.lookups, d.hits, d.bytes_uploaded, d.cpu_computed),
            (200, 160, 2000, 4)
        );
        let e = Expect {
            min_decode_hit_rate: Some(0.8),
            ..Expect::default()
        };
        let c = check_row(&a.rows[0], &e, None);
        let hit = c.iter().find(|c| c.what.contains("hit rate")).unwrap();
        assert!(hit.passed && hit.got.starts_with("80.0%"), "{hit:?}");
        let e = Expect {
            min_decode_hit_rate: Some(0.81),
            ..Expect::default()
        };
        assert!(
            !check_row(&a.rows[0], &e, None)
                .iter()
                .find(|c| c.what.contains("hit rate"))
                .unwrap()
                .passed
        );
        // No events (every expert resident): the expectation fails instead of passing on nothing.
        let none = arm(&["resident", "arena"], &["x"]);
        let c = check_row(
            &none.rows[0],
            &Expect {
                min_decode_hit_rate: Some(0.0),
                ..Expect::default()
            },
            None,
        );
        assert!(c.iter().any(|c| c.what.contains("hit rate") && !c.passed), "{c:?}");
    }

    #[test]
    fn rows_are_judged() {
        let row = CaseRow {
            kind: "prompt".into(),
            tokens_requested: Some(53),
            samples: vec![Sample {
                status: 200,
                prompt_tokens: Some(53),
                output: "The capital is Paris.".into(),
                ..Sample::default()
            }],
            ..CaseRow::default()
        };
        let e = Expect {
            contains: Some("Paris".into()),
            regex: Some("capital".into()),
            ..Expect::default()
        };
        assert!(check_row(&row, &e, None).iter().all(|c| c.passed));
        let e = Expect {
            status: Some(503),
            contains: Some("Rome".into()),
            ..Expect::default()
        };
        let checks = check_row(&row, &e, None);
        assert_eq!(checks.iter().filter(|c| !c.passed).count(), 2, "{checks:?}");
    }
}
