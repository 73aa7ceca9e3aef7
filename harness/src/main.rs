//! `strata-harness`: replays hardware bug reports as scenarios and writes reproducible, bisectable reports.
//!
//! The scenario runner (`run`), `compare` and `bisect` are built on the engine's `strata serve`; until those
//! land this binary only identifies itself.

use clap::Parser;

/// Turns a bug report into a reproducible, comparable, bisectable report (scenarios arrive with the server).
#[derive(Parser)]
#[command(name = "strata-harness", version, about)]
struct Cli {}

fn main() {
    Cli::parse();
    eprintln!(
        "strata-harness {}: no scenario runner in this build yet",
        env!("CARGO_PKG_VERSION")
    );
    std::process::exit(2);
}
