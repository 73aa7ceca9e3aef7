//! `strata-harness bisect --good REV --bad REV SCENARIO`: finds the first commit whose run of the scenario fails.
//! Each revision is checked out in a git worktree, its `strata` built there (a shared target folder keeps the
//! rebuilds incremental), and the scenario run against it by this harness; a revision that does not build is
//! skipped (exit 125), as `git bisect run` does.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};

use crate::{EXIT_ENGINE, EXIT_FAIL, EXIT_PASS, RunOptions};

/// What one revision gave.
#[derive(Debug, Clone)]
pub struct RevResult {
    pub rev: String,
    /// 0 good, 1 bad, 125 skipped.
    pub exit_code: i32,
    pub report: Option<PathBuf>,
}

fn git(repo: &Path, args: &[&str]) -> Result<String> {
    let out = Command::new("git")
        .current_dir(repo)
        .args(args)
        .output()
        .context("cannot run git")?;
    if !out.status.success() {
        bail!(
            "git {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// The commits after `good` up to and including `bad`, oldest first (first-parent line).
///
/// Errors: a revision does not resolve, or `good` is not an ancestor of `bad`.
pub fn candidates(repo: &Path, good: &str, bad: &str) -> Result<Vec<String>> {
    let good = git(repo, &["rev-parse", "--verify", &format!("{good}^{{commit}}")])?;
    let bad = git(repo, &["rev-parse", "--verify", &format!("{bad}^{{commit}}")])?;
    if git(repo, &["merge-base", "--is-ancestor", &good, &bad]).is_err() {
        bail!("--good {good} is not an ancestor of --bad {bad}");
    }
    let list = git(
        repo,
        &["rev-list", "--reverse", "--first-parent", &format!("{good}..{bad}")],
    )?;
    Ok(list.lines().map(str::to_string).collect())
}

/// Builds `rev`'s `strata` in a worktree and runs the scenario against it.
fn try_rev(repo: &Path, rev: &str, scenario: &Path, opts: &RunOptions, work: &Path) -> RevResult {
    let tree = work.join(format!("wt-{}", &rev[..rev.len().min(12)]));
    let target = work.join("target");
    let skip = RevResult {
        rev: rev.to_string(),
        exit_code: EXIT_ENGINE,
        report: None,
    };
    if !tree.exists() && git(repo, &["worktree", "add", "--detach", &tree.display().to_string(), rev]).is_err() {
        return skip;
    }
    eprintln!("strata-harness bisect: building {rev}");
    let built = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
        .current_dir(&tree)
        .env("CARGO_TARGET_DIR", &target)
        .args(["build", "-p", "strata-engine", "--bin", "strata"])
        .status()
        .is_ok_and(|s| s.success());
    let strata = target
        .join("debug")
        .join(format!("strata{}", std::env::consts::EXE_SUFFIX));
    let result = if built && strata.is_file() {
        let mut o = opts.clone();
        o.strata = Some(strata);
        o.source = Some(tree.clone());
        let out = crate::run(scenario, &o);
        eprintln!("strata-harness bisect: {rev}: {}", out.summary);
        RevResult {
            rev: rev.to_string(),
            exit_code: match out.exit_code {
                EXIT_PASS => EXIT_PASS,
                EXIT_FAIL => EXIT_FAIL,
                _ => EXIT_ENGINE,
            },
            report: out.folder,
        }
    } else {
        skip
    };
    let _ = git(repo, &["worktree", "remove", "--force", &tree.display().to_string()]);
    result
}

/// Bisects `good..bad`: returns the first bad commit's result, the last good one's, and every revision tried.
///
/// Errors: bad revisions; `bad` does not fail; no revision between could be built.
pub fn bisect(
    repo: &Path,
    good: &str,
    bad: &str,
    scenario: &Path,
    opts: &RunOptions,
) -> Result<(RevResult, Option<RevResult>, Vec<RevResult>)> {
    let revs = candidates(repo, good, bad)?;
    if revs.is_empty() {
        bail!("no commits between --good and --bad");
    }
    let work = std::env::temp_dir().join(format!("strata-bisect-{}", std::process::id()));
    std::fs::create_dir_all(&work)?;
    let mut tried: Vec<RevResult> = Vec::new();
    // Invariant: everything before lo is good (or skipped); revs[hi] is bad.
    let last = try_rev(repo, &revs[revs.len() - 1], scenario, opts, &work);
    tried.push(last.clone());
    if last.exit_code != EXIT_FAIL {
        bail!(
            "--bad {bad} does not fail the scenario (exit {}); nothing to bisect",
            last.exit_code
        );
    }
    let (mut lo, mut hi) = (0usize, revs.len() - 1);
    let mut good_result: Option<RevResult> = None;
    let mut bad_result = last;
    while lo < hi {
        let mut mid = lo + (hi - lo) / 2;
        let mut r = try_rev(repo, &revs[mid], scenario, opts, &work);
        tried.push(r.clone());
        // Skipped: walk forward to the next buildable revision below hi.
        while r.exit_code == EXIT_ENGINE && mid + 1 < hi {
            mid += 1;
            r = try_rev(repo, &revs[mid], scenario, opts, &work);
            tried.push(r.clone());
        }
        match r.exit_code {
            EXIT_FAIL => {
                hi = mid;
                bad_result = r;
            }
            EXIT_PASS => {
                lo = mid + 1;
                good_result = Some(r);
            }
            _ => break,
        }
    }
    let _ = std::fs::remove_dir_all(&work);
    Ok((bad_result, good_result, tried))
}
