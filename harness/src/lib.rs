//! `strata-harness`: replays hardware bug reports as scenarios against `strata serve` and writes reproducible,
//! comparable, bisectable reports (DESIGN.md sections 1 and 3).
//!
//! - [`scenario`]: the YAML schema, parsing with line-accurate errors, validation, the JSON Schema.
//! - [`server`]: finding or building `strata`, starting and stopping `strata serve`, its HTTP API.
//! - [`prompt`]: prompts of an exact token count with unique prefixes.
//! - [`runner`]: the matrix, cases, sweeps, boundary search, expectations.
//! - [`capture`]: memory sampling and the worker's events.
//! - [`report`], [`plot`]: report.json, report.md, PNG and SVG plots. [`compare`] and [`bisect`]: the other
//!   commands.

pub mod bisect;
pub mod capture;
pub mod compare;
pub mod load;
pub mod plot;
pub mod prompt;
pub mod report;
pub mod runner;
pub mod scenario;
pub mod server;

use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use report::{Environment, Report, Verdict};

/// Exit code: every expectation met.
pub const EXIT_PASS: i32 = 0;
/// Exit code: some expectation failed.
pub const EXIT_FAIL: i32 = 1;
/// Exit code: the scenario (or another input) is wrong.
pub const EXIT_SCENARIO: i32 = 2;
/// Exit code: the engine could not be built or started at all (git bisect's "skip").
pub const EXIT_ENGINE: i32 = 125;

/// What `run` needs beyond the scenario file.
#[derive(Debug, Clone, Default)]
pub struct RunOptions {
    /// Overrides the scenario's device.
    pub device: Option<String>,
    /// Parent folder of report folders (`reports/`).
    pub out: PathBuf,
    /// The `strata` binary (default: beside this one, built when missing).
    pub strata: Option<PathBuf>,
    /// llama.cpp's `llama-server`, for arms with `server: llama-server` (default: the build of
    /// `fixtures/llamacpp/build.sh server` in the model cache).
    pub llama_server: Option<PathBuf>,
    /// Use the scenario's `quick` settings.
    pub quick: bool,
    /// The engine's source tree, for the git fingerprint (default: the current folder).
    pub source: Option<PathBuf>,
    /// Only these combinations (by name), all when empty.
    pub only_arms: Vec<String>,
    /// The command line to record.
    pub command: String,
}

/// A finished run: its exit code, report folder and report.
pub struct RunOutcome {
    pub exit_code: i32,
    pub folder: Option<PathBuf>,
    pub report: Option<Report>,
    /// One line for the terminal.
    pub summary: String,
}

fn git(dir: &Path, args: &[&str]) -> Option<String> {
    let out = Command::new("git").current_dir(dir).args(args).output().ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// The environment fingerprint: git revision and dirty flag of `source`, build profile and `--version` of `strata`,
/// host.
pub fn fingerprint(source: &Path, strata: &Path, device: &str) -> Environment {
    let mut sys = sysinfo::System::new();
    sys.refresh_memory();
    sys.refresh_cpu_all();
    let cpu = sys
        .cpus()
        .first()
        .map(|c| c.brand().trim().to_string())
        .filter(|b| !b.is_empty())
        .unwrap_or_else(|| std::env::consts::ARCH.to_string());
    let profile = if strata.components().any(|c| c.as_os_str() == "release") {
        "release"
    } else if strata.components().any(|c| c.as_os_str() == "debug") {
        "dev"
    } else {
        "unknown"
    };
    Environment {
        git_rev: git(source, &["rev-parse", "HEAD"]).unwrap_or_else(|| "unknown".into()),
        git_dirty: git(source, &["status", "--porcelain", "--untracked-files=no"]).is_some_and(|s| !s.is_empty()),
        build_profile: profile.into(),
        strata_binary: strata.display().to_string(),
        engine_version: Command::new(strata)
            .arg("--version")
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
            .unwrap_or_default(),
        cpu,
        cpu_cores: sys.cpus().len(),
        ram_bytes: sys.total_memory(),
        os: sysinfo::System::long_os_version().unwrap_or_else(|| std::env::consts::OS.into()),
        device: device.into(),
        driver: if device == "cpu" {
            "none (CPU)".into()
        } else {
            "unknown".into()
        },
    }
}

fn now_secs() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// A new report folder `<out>/<UTC date>-<scenario>-<rev>` (`-2`, `-3`... when taken).
///
/// Errors: it cannot be created.
pub fn report_folder(out: &Path, scenario: &str, rev: &str) -> std::io::Result<PathBuf> {
    let date = &report::utc_timestamp(now_secs())[..10];
    let short = &rev[..rev.len().min(8)];
    let base = out.join(format!("{date}-{scenario}-{short}"));
    let mut dir = base.clone();
    let mut n = 2;
    while dir.exists() {
        dir = PathBuf::from(format!("{}-{n}", base.display()));
        n += 1;
    }
    std::fs::create_dir_all(&dir)?;
    Ok(dir)
}

/// Why a run of `s` with `opts` would send no request, or leave a case with none, so that a PASS would mean
/// nothing: an `--arm` that names no combination, or a sweep whose every point lies above `--quick`'s cap.
fn nothing_to_run(s: &scenario::Scenario, opts: &RunOptions) -> Option<String> {
    let names: Vec<String> = runner::combos(s).into_iter().map(|c| c.name).collect();
    if let Some(a) = opts.only_arms.iter().find(|a| !names.contains(a)) {
        return Some(format!(
            "--arm {a}: no combination of the scenario has that name (it runs {})",
            names.join(", ")
        ));
    }
    let cap = s.quick.as_ref().filter(|_| opts.quick)?.max_prompt_tokens;
    for c in &s.cases {
        let Some(sw) = c.sweep.as_ref().filter(|sw| !sw.find_boundary) else {
            continue;
        };
        let points = match &sw.tokens {
            scenario::SweepValues::List(v) => v.clone(),
            scenario::SweepValues::Range(r) => r.points(),
        };
        if points.iter().all(|&n| n > cap) {
            return Some(format!(
                "case `{}`: every point of its sweep lies above the quick cap of {cap} prompt tokens (`quick: {{max_prompt_tokens: {cap}}}`), so --quick would run nothing for it",
                c.name
            ));
        }
    }
    None
}

/// Runs a scenario file end to end and writes its report folder.
pub fn run(scenario_file: &Path, opts: &RunOptions) -> RunOutcome {
    let fail = |code: i32, summary: String| RunOutcome {
        exit_code: code,
        folder: None,
        report: None,
        summary,
    };
    let s = match scenario::load(scenario_file) {
        Ok(s) => s,
        Err(e) => return fail(EXIT_SCENARIO, format!("scenario error: {e}")),
    };
    let device = opts.device.clone().unwrap_or_else(|| s.device.clone());
    if let Err(why) = runner::check_static(&s, &device) {
        return fail(
            EXIT_SCENARIO,
            format!("scenario error: {}: {why}", scenario_file.display()),
        );
    }
    for d in runner::devices(&s, &device) {
        if let Err(why) = runner::device_available(&d) {
            return fail(EXIT_ENGINE, format!("cannot run on this machine: {why}"));
        }
    }
    if opts.quick && s.quick.is_none() {
        return fail(
            EXIT_SCENARIO,
            format!("{}: --quick needs a `quick:` section", scenario_file.display()),
        );
    }
    if let Some(why) = nothing_to_run(&s, opts) {
        return fail(EXIT_SCENARIO, format!("{}: {why}", scenario_file.display()));
    }
    let strata = match server::strata_binary(opts.strata.as_deref()) {
        Ok(p) => p,
        Err(e) => return fail(EXIT_ENGINE, format!("the engine could not be built: {e:#}")),
    };
    let model_path = match runner::model_path(&s.model) {
        Ok(p) => p,
        Err(e) => return fail(EXIT_ENGINE, format!("the model is not available: {e:#}")),
    };
    let mut prompts = match prompt::PromptBuilder::open(&model_path) {
        Ok(p) => p,
        Err(e) => return fail(EXIT_SCENARIO, format!("cannot build prompts for this model: {e:#}")),
    };
    let source = opts.source.clone().unwrap_or_else(|| PathBuf::from("."));
    let environment = fingerprint(&source, &strata, &runner::devices(&s, &device).join(", "));
    let folder = match report_folder(&opts.out, &s.name, &environment.git_rev) {
        Ok(f) => f,
        Err(e) => {
            return fail(
                EXIT_SCENARIO,
                format!("cannot create a report folder in {}: {e}", opts.out.display()),
            );
        }
    };
    // llama.cpp's server, when a combination that runs starts it.
    let wants_llama = runner::combos(&s)
        .iter()
        .filter(|c| opts.only_arms.is_empty() || opts.only_arms.contains(&c.name))
        .any(|c| c.server() == scenario::ServerKind::LlamaServer);
    let llama_server = match wants_llama.then(|| server::llama_server_binary(opts.llama_server.as_deref())) {
        None => None,
        Some(Ok(p)) => Some(p),
        // A path the user gave is their input (2); a missing build is like an engine that cannot run (125).
        Some(Err(e)) => {
            let code = if opts.llama_server.is_some() {
                EXIT_SCENARIO
            } else {
                EXIT_ENGINE
            };
            return fail(code, format!("{e:#} (or leave its arms out with --arm)"));
        }
    };
    let settings = runner::RunSettings {
        strata,
        llama_server,
        model_path,
        device: device.clone(),
        quick: opts.quick,
        out_dir: folder.clone(),
        progress: std::io::stderr().is_terminal(),
    };
    let inherited = server::inherited_switches();
    if !inherited.is_empty() {
        eprintln!(
            "strata-harness: not passed to the servers, from your environment: {} (a run depends on its scenario alone: set a switch in the scenario's or an arm's `env`)",
            inherited.join(", ")
        );
    }
    let started = now_secs();
    let epoch = Instant::now();
    let mut arms = Vec::new();
    for combo in runner::combos(&s) {
        if !opts.only_arms.is_empty() && !opts.only_arms.contains(&combo.name) {
            continue;
        }
        eprintln!("strata-harness: {}: arm {}", s.name, combo.name);
        match runner::run_combo(&s, &combo, &settings, &mut prompts, epoch) {
            Ok(a) => arms.push(a),
            Err(e) => {
                let mistake = e.downcast_ref::<runner::ScenarioMistake>().is_some();
                return RunOutcome {
                    exit_code: if mistake { EXIT_SCENARIO } else { EXIT_FAIL },
                    folder: Some(folder),
                    report: None,
                    summary: if mistake {
                        format!("scenario error: {}: {e:#}", scenario_file.display())
                    } else {
                        format!("arm {} stopped: {e:#}", combo.name)
                    },
                };
            }
        }
    }
    let mut report = Report {
        schema_version: report::REPORT_SCHEMA_VERSION,
        scenario: s.name.clone(),
        scenario_file: scenario_file.display().to_string(),
        description: s.description.clone(),
        command: opts.command.clone(),
        started_utc: report::utc_timestamp(started),
        duration_s: epoch.elapsed().as_secs_f64(),
        quick: opts.quick,
        environment,
        verdict: Verdict::default(),
        arms,
    };
    let unjudged = runner::check_same_outputs(&s, &mut report.arms, opts.only_arms.is_empty());
    report.settle_verdict();
    report.verdict.unjudged = unjudged;
    let plots = plot::write_all(&folder, &report).unwrap_or_else(|e| {
        eprintln!("strata-harness: plots not drawn: {e:#}");
        Vec::new()
    });
    let md = report::markdown(&report, &plots);
    let written = std::fs::write(folder.join("report.md"), md)
        .map_err(anyhow::Error::from)
        .and_then(|_| report::write_json(&report, &folder.join("report.json")));
    if let Err(e) = written {
        return fail(
            EXIT_SCENARIO,
            format!("cannot write the report into {}: {e:#}", folder.display()),
        );
    }
    let all_dead = !report.arms.is_empty() && report.arms.iter().all(|a| a.unexpected_error());
    // A start that failed as its arm expected is a checked outcome, like a request.
    let requests: usize = report
        .arms
        .iter()
        .map(|a| a.rows.len() + a.loads.len() + usize::from(a.start_failure_expected && a.error.is_some()))
        .sum();
    let code = if all_dead {
        EXIT_ENGINE
    } else if requests == 0 {
        // Nothing was asked of the engine: not a pass (nothing_to_run catches the known ways before the run).
        return RunOutcome {
            exit_code: EXIT_SCENARIO,
            folder: Some(folder),
            report: Some(report),
            summary: "no request ran: no arm ran a case".into(),
        };
    } else if report.verdict.passed {
        EXIT_PASS
    } else {
        EXIT_FAIL
    };
    let boundaries: Vec<String> = report
        .arms
        .iter()
        .flat_map(|a| {
            a.boundaries.iter().map(move |b| {
                format!(
                    "{}: boundary {}",
                    a.name,
                    b.first_failing.map_or("none".into(), |n| n.to_string())
                )
            })
        })
        .collect();
    let summary = format!(
        "{}: {} ({} of {} expectations failed{}){}; report {}",
        s.name,
        if report.verdict.passed { "PASS" } else { "FAIL" },
        report.verdict.failed,
        report.verdict.checked,
        match report.verdict.unjudged {
            0 => String::new(),
            n => format!("; {n} comparisons not judged: their references were left out by --arm"),
        },
        if boundaries.is_empty() {
            String::new()
        } else {
            format!("; {}", boundaries.join("; "))
        },
        folder.join("report.md").display()
    );
    RunOutcome {
        exit_code: code,
        folder: Some(folder),
        report: Some(report),
        summary,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The fingerprint keeps the engine binary's own `--version` line (the commit it was built from), which is
    /// what names a carried binary's build when the source tree beside it is another revision.
    #[cfg(unix)]
    #[test]
    fn fingerprint_records_the_engine_version_line() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let fake = dir.path().join("strata");
        std::fs::write(&fake, "#!/bin/sh\necho 'strata 9.9.9 (0123456789ab)'\n").unwrap();
        std::fs::set_permissions(&fake, std::fs::Permissions::from_mode(0o755)).unwrap();
        let env = fingerprint(dir.path(), &fake, "cpu");
        assert_eq!(env.engine_version, "strata 9.9.9 (0123456789ab)");
        // A binary that cannot say: empty, shown as "unknown".
        let env = fingerprint(dir.path(), &dir.path().join("missing"), "cpu");
        assert_eq!(env.engine_version, "");
    }
}
