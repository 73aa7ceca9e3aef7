//! Scenario validation errors as users see them (insta snapshots), and the checked-in JSON Schema's freshness.

use std::path::Path;

use strata_harness::scenario;

fn err(text: &str) -> String {
    scenario::parse("bad.yaml", text).unwrap_err().to_string()
}

#[test]
fn validation_errors() {
    let cases = [
        (
            "typo at top level",
            "name: t\nrepetitons: 2\ncases:\n  - name: a\n    prompt: {text: hi}\n",
        ),
        (
            "typo in a case",
            "name: t\ncases:\n  - name: a\n    promt: {text: hi}\n",
        ),
        (
            "typo in an expectation",
            "name: t\ncases:\n  - name: a\n    prompt: {text: hi}\n    expect: {contain: Paris}\n",
        ),
        (
            "wrong type",
            "name: t\nrepetitions: many\ncases:\n  - name: a\n    prompt: {text: hi}\n",
        ),
        (
            "two prompt kinds",
            "name: t\ncases:\n  - name: a\n    prompt: {text: hi, tokens: 4}\n",
        ),
        (
            "unknown arm",
            "name: t\nmatrix:\n  kv: [{name: f16}]\ncases:\n  - name: a\n    prompt: {text: hi}\n    arms: {f61: {status: 503}}\n",
        ),
        (
            "boundary on a list",
            "name: t\ncases:\n  - name: a\n    sweep: {tokens: [1, 2], find_boundary: true}\n",
        ),
        ("no cases", "name: t\ncases: []\n"),
        (
            "bad regex",
            "name: t\ncases:\n  - name: a\n    prompt: {text: hi}\n    expect: {regex: \"(\"}\n",
        ),
        ("not yaml", "name: [t\n"),
        (
            "a case kept to an unknown arm",
            "name: t\nmatrix:\n  kv: [{name: f16}]\ncases:\n  - name: a\n    prompt: {text: hi}\n    only: [f61]\n",
        ),
        (
            "an arm's unknown device",
            "name: t\nmatrix:\n  kv: [{name: f16, device: gpu:0}]\ncases:\n  - name: a\n    prompt: {text: hi}\n",
        ),
        (
            "a fault expectation on a boundary search",
            "name: t\ncases:\n  - name: a\n    sweep: {tokens: {from: 1, to: 8}, find_boundary: true}\n    expect: {fault: {synced: true}}\n",
        ),
        (
            "an arm that runs no case",
            "name: t\nmatrix:\n  kv: [{name: f16}, {name: int8}]\ncases:\n  - name: a\n    prompt: {text: hi}\n    only: [f16]\n",
        ),
        (
            "two devices in one combination",
            "name: t\nmatrix:\n  a: [{name: x, device: cpu}]\n  b: [{name: y, device: \"sim:h200\"}]\ncases:\n  - name: a\n    prompt: {text: hi}\n",
        ),
        (
            "a typo in a fault expectation",
            "name: t\ncases:\n  - name: a\n    prompt: {text: hi}\n    expect: {fault: {kernal: moe}}\n",
        ),
    ];
    let text: String = cases
        .iter()
        .map(|(what, yaml)| format!("## {what}\n{}\n\n", err(yaml)))
        .collect();
    insta::assert_snapshot!(text);
}

#[test]
fn every_committed_scenario_is_valid() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scenarios");
    let mut n = 0;
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.extension().is_some_and(|x| x == "yaml") {
            scenario::load(&p).unwrap_or_else(|e| panic!("{e}"));
            n += 1;
        }
    }
    assert!(n >= 2, "quickstart and windows-hip at least");
}

#[test]
fn checked_in_schema_is_fresh() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("scenario.schema.json");
    let on_disk = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        on_disk == scenario::json_schema(),
        "{} is stale: regenerate it with `cargo run -p strata-harness -- schema > harness/scenario.schema.json`",
        path.display()
    );
}

/// `strata-harness check` on sweeps that wrapped, or asked for billions of points, on main at 9bf3496 (the doubling
/// wrapped to 0 and looped until memory ran out): now exit 2 at once, with the file, line and column of the
/// sweep's `tokens`. Each run is given 60 s before it counts as a hang.
#[test]
fn check_refuses_endless_sweeps_at_once() {
    let dir = std::env::temp_dir().join(format!("strata-harness-sweeps-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for (i, sweep) in [
        "{from: 1, to: 18446744073709551615}",
        "{from: 1, to: 10000000000, step: 1}",
    ]
    .iter()
    .enumerate()
    {
        let path = dir.join(format!("s{i}.yaml"));
        std::fs::write(
            &path,
            format!("name: t\ncases:\n  - name: small\n    prompt: {{tokens: 8}}\n  - name: big\n    sweep:\n      tokens: {sweep}\n"),
        )
        .unwrap();
        let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_strata-harness"))
            .arg("check")
            .arg(&path)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let t = std::time::Instant::now();
        let status = loop {
            if let Some(s) = child.try_wait().unwrap() {
                break s;
            }
            if t.elapsed() > std::time::Duration::from_secs(60) {
                let _ = child.kill();
                panic!("`check` on {sweep} still ran after 60 s");
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        };
        let out = child.wait_with_output().unwrap();
        let text = String::from_utf8_lossy(&out.stderr).to_string() + &String::from_utf8_lossy(&out.stdout);
        assert_eq!(status.code(), Some(2), "{sweep}: {text}");
        assert!(
            text.contains(&format!("s{i}.yaml:7:7: case `big`")) && text.contains("past the largest prompt"),
            "{sweep}: {text}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// `strata-harness run` with nothing to run, which printed "PASS (0 of 0)" and exited 0 on main at 9bf3496: an
/// `--arm` that names no combination, and a sweep whose every point lies above the `--quick` cap. Both are now
/// exit 2 before anything starts, naming why.
#[test]
fn run_refuses_to_pass_with_nothing_run() {
    let dir = std::env::temp_dir().join(format!("strata-harness-empty-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("q.yaml");
    std::fs::write(
        &path,
        "name: t\nmatrix:\n  kv: [{name: f16}, {name: int8}]\nquick: {max_prompt_tokens: 64}\ncases:\n  - name: small\n    prompt: {tokens: 8}\n  - name: big\n    sweep:\n      tokens: [128, 256]\n",
    )
    .unwrap();
    let run = |args: &[&str]| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_strata-harness"))
            .arg("run")
            .arg(&path)
            .args(["--out", dir.join("reports").to_str().unwrap()])
            .args(args)
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stderr).to_string() + &String::from_utf8_lossy(&out.stdout);
        (out.status.code(), text)
    };
    let (code, text) = run(&["--arm", "kv=f61"]);
    assert_eq!(code, Some(2), "{text}");
    assert!(
        text.contains("--arm kv=f61: no combination") && text.contains("kv=f16, kv=int8"),
        "{text}"
    );
    assert!(!text.contains("PASS"), "{text}");
    let (code, text) = run(&["--quick"]);
    assert_eq!(code, Some(2), "{text}");
    assert!(
        text.contains("case `big`: every point of its sweep lies above the quick cap of 64"),
        "{text}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// Scenario mistakes that `run` reported with exit 125 on main at 9bf3496 (which bisect reads as "skip this
/// revision") and `check` accepted: a bad device string, a missing model file, an unknown `strata serve` flag in
/// an arm's `args`, a malformed `STRATA_FAULT` in `env`. Now `check` names each and exits 2, and so does `run`,
/// before it starts anything.
#[test]
fn scenario_mistakes_are_exit_2_in_check_and_run() {
    let dir = std::env::temp_dir().join(format!("strata-harness-mistakes-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let case = "cases:\n  - name: a\n    prompt: {text: hi}\n";
    for (what, yaml, says) in [
        (
            "device",
            format!("name: t\ndevice: cuda:zero\n{case}"),
            "device `cuda:zero`",
        ),
        (
            "model",
            format!("name: t\nmodel: /no/such/model.gguf\n{case}"),
            "model `/no/such/model.gguf`: no such file",
        ),
        (
            "serve flag",
            format!("name: t\nmatrix:\n  kv: [{{name: q, args: [--kv-typo, f16]}}]\n{case}"),
            "--kv-typo",
        ),
        (
            "fault",
            format!("name: t\nmatrix:\n  f: [{{name: on, env: {{STRATA_FAULT: \"prefill_gemm:m>>64\"}}}}]\n{case}"),
            "arm `on`: STRATA_FAULT=",
        ),
    ] {
        let path = dir.join(format!("{}.yaml", what.replace(' ', "-")));
        std::fs::write(&path, yaml).unwrap();
        for cmd in ["check", "run"] {
            let out = std::process::Command::new(env!("CARGO_BIN_EXE_strata-harness"))
                .arg(cmd)
                .arg(&path)
                .args(if cmd == "run" {
                    vec!["--out", dir.to_str().unwrap()]
                } else {
                    vec![]
                })
                .output()
                .unwrap();
            let text = String::from_utf8_lossy(&out.stderr).to_string() + &String::from_utf8_lossy(&out.stdout);
            assert_eq!(out.status.code(), Some(2), "{cmd} with a bad {what}: {text}");
            assert!(text.contains(says), "{cmd} with a bad {what}: {text}");
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}
