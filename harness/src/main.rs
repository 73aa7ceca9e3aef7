//! `strata-harness`: replays hardware bug reports as scenarios and writes reproducible, bisectable reports.

use std::path::PathBuf;

use clap::{Parser, Subcommand};
use strata_harness::{EXIT_ENGINE, EXIT_FAIL, EXIT_PASS, EXIT_SCENARIO, RunOptions};

/// Turns a bug report into a reproducible, comparable, bisectable report.
///
/// Exit codes: 0 every expectation met; 1 some failed (or a regression, for compare); 2 the scenario or another
/// input is wrong; 125 the engine could not be built or started (git bisect's skip).
#[derive(Parser)]
#[command(name = "strata-harness", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Run a scenario and write its report folder.
    Run {
        /// The scenario file (YAML).
        scenario: PathBuf,
        /// Device to run on (overrides the scenario's): cpu, cuda:N, sim:PROFILE.
        #[arg(long)]
        device: Option<String>,
        /// Parent folder of report folders.
        #[arg(long, default_value = "reports")]
        out: PathBuf,
        /// The `strata` binary (default: beside this one; built when missing).
        #[arg(long)]
        strata: Option<PathBuf>,
        /// llama.cpp's `llama-server`, for arms with `server: llama-server` (default: the build of
        /// `fixtures/llamacpp/build.sh server` in the model cache).
        #[arg(long)]
        llama_server: Option<PathBuf>,
        /// The scenario's smaller `quick:` run (capped sweeps, fewer repetitions).
        #[arg(long)]
        quick: bool,
        /// Run only this matrix combination (as named in the report, e.g. `fallback=on`); repeatable.
        #[arg(long = "arm")]
        arms: Vec<String>,
    },
    /// Compare two reports of one scenario (report folders or report.json files).
    Compare { old: PathBuf, new: PathBuf },
    /// Find the first commit in good..bad whose run of the scenario fails.
    Bisect {
        #[arg(long)]
        good: String,
        #[arg(long)]
        bad: String,
        scenario: PathBuf,
        #[arg(long, default_value = "reports/bisect")]
        out: PathBuf,
        #[arg(long)]
        quick: bool,
    },
    /// Check a scenario file without running it.
    Check { scenario: PathBuf },
    /// Print the JSON Schema of scenario files.
    Schema,
}

fn command_line() -> String {
    std::env::args().collect::<Vec<_>>().join(" ")
}

fn main() {
    let cli = Cli::parse();
    let code = match cli.command {
        Cmd::Run {
            scenario,
            device,
            out,
            strata,
            llama_server,
            quick,
            arms,
        } => {
            let opts = RunOptions {
                device,
                out,
                strata,
                llama_server,
                quick,
                source: None,
                only_arms: arms,
                command: command_line(),
            };
            let o = strata_harness::run(&scenario, &opts);
            eprintln!("strata-harness: {}", o.summary);
            o.exit_code
        }
        Cmd::Compare { old, new } => {
            match (
                strata_harness::report::read_json(&old),
                strata_harness::report::read_json(&new),
            ) {
                (Ok(a), Ok(b)) => {
                    let d = strata_harness::compare::compare(&a, &b);
                    print!("{}", strata_harness::compare::render(&a, &b, &d));
                    if d.iter().any(|x| x.is_regression()) {
                        EXIT_FAIL
                    } else {
                        EXIT_PASS
                    }
                }
                (Err(e), _) | (_, Err(e)) => {
                    eprintln!("strata-harness compare: {e:#}");
                    EXIT_SCENARIO
                }
            }
        }
        Cmd::Bisect {
            good,
            bad,
            scenario,
            out,
            quick,
        } => {
            let opts = RunOptions {
                out: std::path::absolute(&out).unwrap_or(out),
                quick,
                command: command_line(),
                ..RunOptions::default()
            };
            let scenario = std::path::absolute(&scenario).unwrap_or(scenario);
            match strata_harness::bisect::bisect(std::path::Path::new("."), &good, &bad, &scenario, &opts) {
                Ok((first_bad, last_good, tried)) => {
                    println!("first bad commit: {}", first_bad.rev);
                    if let Some(r) = &first_bad.report {
                        println!("  its report: {}", r.join("report.md").display());
                    }
                    if let Some(g) = &last_good {
                        println!("last good commit tried: {}", g.rev);
                        if let Some(r) = &g.report {
                            println!("  its report: {}", r.join("report.md").display());
                        }
                    }
                    println!("revisions tried: {}", tried.len());
                    EXIT_PASS
                }
                Err(e) => {
                    eprintln!("strata-harness bisect: {e:#}");
                    EXIT_SCENARIO
                }
            }
        }
        Cmd::Check { scenario } => match strata_harness::scenario::load(&scenario) {
            Ok(s) if let Err(e) = strata_harness::runner::check_static(&s, &s.device) => {
                eprintln!("{}: {e}", scenario.display());
                EXIT_SCENARIO
            }
            Ok(s) => {
                println!(
                    "{}: ok ({} cases, {} matrix combinations)",
                    scenario.display(),
                    s.cases.len(),
                    strata_harness::runner::combos(&s).len()
                );
                EXIT_PASS
            }
            Err(e) => {
                eprintln!("{e}");
                EXIT_SCENARIO
            }
        },
        Cmd::Schema => {
            print!("{}", strata_harness::scenario::json_schema());
            EXIT_PASS
        }
    };
    let _ = EXIT_ENGINE;
    std::process::exit(code);
}
