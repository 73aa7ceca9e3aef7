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
