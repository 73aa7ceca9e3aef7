//! Scenarios as tests: every `scenarios/*.yaml` runs with its `quick:` settings, one trial per matrix combination
//! (libtest-mimic), or one trial for the whole matrix when its expectations compare combinations with each other
//! (`same_output_as`, `same_tokens_as`, `same_logits_as`: judged only when the reference runs too). A scenario
//! whose device this machine lacks is listed as ignored, with the reason in its name.
//! Each run's report.md is snapshotted (insta) with the volatile fields (rates, times, memory, host) redacted.
//!
//! The engine binary comes from the same target folder (`cargo test --workspace` builds it).

use std::path::{Path, PathBuf};

use libtest_mimic::{Arguments, Failed, Trial};
use strata_harness::{RunOptions, runner, scenario};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// report.md with everything that changes from run to run replaced by placeholders.
fn redact(md: &str) -> String {
    let mut out = Vec::new();
    let mut in_env = false;
    let mut in_load = false;
    // An arm with load runs answers as many requests as the machine's speed allows.
    let mut arm_has_load = false;
    for line in md.lines() {
        if line.starts_with("## Arm") {
            arm_has_load = false;
        }
        if line.starts_with("### Load") {
            in_load = true;
            arm_has_load = true;
        } else if line.starts_with('#') || line.starts_with("Worker restarts") {
            in_load = false;
        }
        if arm_has_load && line.starts_with("Worker restarts") {
            let line = redact_request_count(line);
            out.push(redact_rss(&line));
            continue;
        }
        if in_load && line.starts_with("| ") && !line.starts_with("| case") {
            // Keep the case, the client count and the result; the figures change from run to run.
            let mut cols: Vec<String> = line.split('|').map(str::to_string).collect();
            let n = cols.len();
            for c in &mut cols[3..n - 2] {
                *c = " [load] ".into();
            }
            out.push(cols.join("|"));
            continue;
        }
        if line.starts_with("## Log excerpts") {
            out.push("## Log excerpts of failing requests\n\n[redacted]".to_string());
            break;
        }
        if line.starts_with("## Environment") {
            in_env = true;
        } else if line.starts_with("## ") || line.starts_with("Quick run") {
            in_env = false;
        }
        if in_env && line.starts_with("| ") && !line.starts_with("| |") {
            let key = line.split('|').nth(1).unwrap_or("").trim();
            out.push(format!("| {key} | [redacted] |"));
            continue;
        }
        if line.starts_with("| ") && line.matches('|').count() == 9 && !line.starts_with("| case") {
            let mut cols: Vec<String> = line.split('|').map(str::to_string).collect();
            cols[5] = " [rate] ".into();
            cols[6] = " [rate] ".into();
            out.push(cols.join("|"));
            continue;
        }
        if line.contains("Worker RSS peak:") {
            out.push(redact_rss(line));
            continue;
        }
        out.push(line.to_string());
    }
    out.join("\n") + "\n"
}

/// `line` with its worker RSS figure replaced by a placeholder.
fn redact_rss(line: &str) -> String {
    match line.find("Worker RSS peak:") {
        Some(i) => {
            let rest = &line[i..];
            let end = rest.find("MiB.").map_or(rest.len(), |e| e + 4);
            format!("{}Worker RSS peak: [rss].{}", &line[..i], &rest[end..])
        }
        None => line.to_string(),
    }
}

/// `line` with the count after `request ` replaced by a placeholder (an events summary).
fn redact_request_count(line: &str) -> String {
    match line.find("request ") {
        Some(i) => {
            let digits = line[i + 8..].chars().take_while(char::is_ascii_digit).count();
            format!("{}request [n]{}", &line[..i], &line[i + 8 + digits..])
        }
        None => line.to_string(),
    }
}

/// Runs combination `combo` of `file` (every combination when `None`) and snapshots its report as `name`.
fn run_arm(file: &Path, combo: Option<&str>, name: &str) -> Result<(), Failed> {
    let out = tempfile::tempdir().map_err(|e| e.to_string())?;
    let opts = RunOptions {
        out: out.path().to_path_buf(),
        quick: true,
        source: Some(root()),
        only_arms: combo.map(str::to_string).into_iter().collect(),
        command: format!("cargo test -p strata-harness --test scenarios {name}"),
        ..RunOptions::default()
    };
    let o = strata_harness::run(file, &opts);
    // An arm whose server fails to start as it expects, or whose every request kills its worker as it expects,
    // has no answered request to plot.
    let plotted = o.report.as_ref().is_none_or(|r| {
        r.arms
            .iter()
            .any(|a| a.rows.iter().flat_map(|row| &row.samples).any(|s| s.status == 200))
    });
    let folder = o.folder.ok_or_else(|| format!("no report: {}", o.summary))?;
    let md = std::fs::read_to_string(folder.join("report.md")).map_err(|e| e.to_string())?;
    if o.exit_code != 0 {
        return Err(format!("exit {}: {}\n\n{md}", o.exit_code, o.summary).into());
    }
    for f in [
        "report.json",
        "tok_s_vs_prompt.png",
        "tok_s_vs_prompt.svg",
        "memory_timeline.png",
    ] {
        if (plotted || f == "report.json") && !folder.join(f).is_file() {
            return Err(format!("{f} missing from {}", folder.display()).into());
        }
    }
    let mut settings = insta::Settings::clone_current();
    settings.set_snapshot_path(root().join("harness/tests/snapshots"));
    settings.set_prepend_module_to_snapshot(false);
    settings.bind(|| insta::assert_snapshot!(name.replace([':', '=', ','], "_"), redact(&md)));
    Ok(())
}

fn main() {
    let args = Arguments::from_args();
    let mut trials = Vec::new();
    let mut files: Vec<PathBuf> = std::fs::read_dir(root().join("scenarios"))
        .expect("scenarios/ exists")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "yaml"))
        .collect();
    files.sort();
    for file in files {
        let stem = file.file_stem().unwrap_or_default().to_string_lossy().into_owned();
        let s = match scenario::load(&file) {
            Ok(s) => s,
            Err(e) => {
                let msg = e.to_string();
                trials.push(Trial::test(format!("{stem}::parse"), move || Err(msg.into())));
                continue;
            }
        };
        // (trial name, the combination it runs (None: all), the devices it needs)
        let runs: Vec<(String, Option<String>, Vec<String>)> = if s.compares_combinations() {
            vec![(format!("{stem}::all"), None, runner::devices(&s, &s.device))]
        } else {
            runner::combos(&s)
                .into_iter()
                .map(|c| {
                    (
                        format!("{stem}::{}", c.name),
                        Some(c.name.clone()),
                        vec![c.device(&s.device)],
                    )
                })
                .collect()
        };
        for (name, combo, devices) in runs {
            // A combination that starts llama.cpp's server needs its build (not made by ci/test.sh).
            let llama = runner::combos(&s)
                .iter()
                .filter(|c| combo.as_ref().is_none_or(|n| *n == c.name))
                .any(|c| c.server() == strata_harness::scenario::ServerKind::LlamaServer);
            let llama_missing = llama
                .then(|| strata_harness::server::llama_server_binary(None).err())
                .flatten()
                .map(|e| e.to_string());
            match llama_missing.or_else(|| devices.iter().find_map(|d| runner::device_available(d).err())) {
                Some(why) => {
                    trials.push(Trial::test(format!("{name} (ignored: {why})"), || Ok(())).with_ignored_flag(true))
                }
                None if s.quick.is_none() => trials.push(Trial::test(name.clone(), move || {
                    Err(format!("{name}: the scenario needs a `quick:` section to run as a test").into())
                })),
                None => {
                    let file = file.clone();
                    trials.push(Trial::test(name.clone(), move || {
                        run_arm(&file, combo.as_deref(), &name)
                    }));
                }
            }
        }
    }
    // The scenarios share a 2-core machine with the engine they start: one at a time.
    let mut args = args;
    args.test_threads = Some(1);
    libtest_mimic::run(&args, trials).exit();
}
