//! Issue 17, point 6: replaying the seeds is deterministic. `scenarios/windows-hip.yaml` (its `quick:` run) three
//! times must give the same verdict, the same boundaries, the same status, restarts and launch faults for every
//! request, and the same side-by-side table, and the verdict must be a pass (a run that checked nothing would be
//! trivially the same three times).

use std::path::PathBuf;

use strata_harness::RunOptions;
use strata_harness::report::Report;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// What must not change between runs of the same scenario.
fn outcome(r: &Report, md: &str) -> String {
    let mut s = format!(
        "passed {} checked {} failed {}\n",
        r.verdict.passed, r.verdict.checked, r.verdict.failed
    );
    for a in &r.arms {
        s += &format!("arm {} error {} restarts {}\n", a.name, a.error.is_some(), a.restarts);
        for b in &a.boundaries {
            s += &format!("  boundary {} {:?} {:?}\n", b.case, b.first_failing, b.last_passing);
        }
        for row in &a.rows {
            for smp in &row.samples {
                let faults: Vec<String> = smp.faults.iter().map(|f| f.to_string()).collect();
                s += &format!(
                    "  {} {:?} status {} restarts {} faults {faults:?} output {:?}\n",
                    row.case, row.tokens_requested, smp.status, smp.restarts, smp.output
                );
            }
        }
    }
    let table = md
        .split("## Side by side")
        .nth(1)
        .and_then(|t| t.split("\n## ").next())
        .unwrap_or("");
    s + table
}

#[test]
fn windows_hip_gives_the_same_verdict_and_boundaries_three_times() {
    let file = root().join("scenarios/windows-hip.yaml");
    let mut seen: Vec<String> = Vec::new();
    let mut folders = Vec::new();
    let outs: Vec<tempfile::TempDir> = (0..3).map(|_| tempfile::tempdir().unwrap()).collect();
    for (i, out) in outs.iter().enumerate() {
        let opts = RunOptions {
            out: out.path().to_path_buf(),
            quick: true,
            source: Some(root()),
            command: "cargo test -p strata-harness --test determinism".into(),
            ..RunOptions::default()
        };
        let o = strata_harness::run(&file, &opts);
        assert_eq!(o.exit_code, 0, "run {i}: {}", o.summary);
        let r = o.report.expect("a report");
        let folder = o.folder.unwrap();
        let md = std::fs::read_to_string(folder.join("report.md")).unwrap();
        folders.push(folder);
        assert!(r.verdict.passed && r.verdict.checked > 20, "run {i}: {}", o.summary);
        assert!(
            r.arms
                .iter()
                .any(|a| a.boundaries.iter().any(|b| b.first_failing == Some(65))),
            "run {i}: seed 000's boundary"
        );
        seen.push(outcome(&r, &md));
    }
    for (i, s) in seen.iter().enumerate().skip(1) {
        assert_eq!(s, &seen[0], "run {i} differs from run 0");
    }
    // Issue 19, point 13: the same runs compared pairwise with `strata-harness compare` flag no regression.
    for (a, b) in [(0, 1), (1, 2), (0, 2)] {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_strata-harness"))
            .arg("compare")
            .arg(folders[a].join("report.json"))
            .arg(folders[b].join("report.json"))
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert_eq!(out.status.code(), Some(0), "runs {a} and {b}:\n{text}");
        assert!(text.contains(" 0 regression(s)"), "{text}");
    }
}
