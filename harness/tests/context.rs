//! A `tokens: N` prompt past the server's context (issue 19, point 9): the run says so as a scenario error (exit 2)
//! without building the prompt, or, when the case expects `status: 400`, sends one token past the context and
//! passes; a boundary search's probes past it fail as any 400 does.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

fn run(yaml: &str) -> (i32, String, Duration) {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("ctx.yaml");
    std::fs::write(&file, yaml).unwrap();
    let start = Instant::now();
    let out = Command::new(env!("CARGO_BIN_EXE_strata-harness"))
        .arg("run")
        .arg(&file)
        .arg("--out")
        .arg(dir.path().join("out"))
        .current_dir(Path::new(env!("CARGO_MANIFEST_DIR")).join(".."))
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stderr).into_owned() + &String::from_utf8_lossy(&out.stdout);
    (out.status.code().unwrap_or(-1), text, start.elapsed())
}

const HEAD: &str =
    "name: ctx\nmodel: synth:tiny-qwen3moe\ndevice: cpu\nargs: [\"--max-context\", \"256\"]\nmax_tokens: 2\n";

#[test]
fn a_prompt_past_the_context_is_a_scenario_error_said_before_it_is_built() {
    let (code, text, took) = run(&format!(
        "{HEAD}cases:\n  - name: huge\n    prompt: {{tokens: 10000000}}\n"
    ));
    assert_eq!(code, 2, "{text}");
    assert!(
        text.contains("case `huge`: a prompt of 10000000 tokens is past the server's context of 256 tokens"),
        "{text}"
    );
    assert!(took < Duration::from_secs(60), "{took:?}");
}

#[test]
fn a_prompt_past_the_context_expected_to_be_refused_is_sent_one_token_past_it() {
    let yaml = format!(
        "{HEAD}cases:\n  - name: huge\n    prompt: {{tokens: 10000000}}\n    expect: {{status: 400}}\n  - name: edge\n    sweep: {{tokens: {{from: 16, to: 10000000}}, find_boundary: true}}\n    expect: {{boundary: 257}}\n"
    );
    let (code, text, _) = run(&yaml);
    assert_eq!(code, 0, "{text}");
    assert!(text.contains("PASS"), "{text}");
}
