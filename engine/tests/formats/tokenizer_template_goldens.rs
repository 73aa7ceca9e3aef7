//! Chat templates render byte-identical to Hugging Face's `apply_chat_template` (issue 18, point 7): every template
//! of llama.cpp's collection (the llama-cpp-python 0.3.36 sdist's `models/templates`, extracted by
//! ci/fetch-models.sh) against goldens rendered offline by Python's jinja2 in Hugging Face's environment
//! (fixtures/templates/render.py: `tojson` keeping key order without HTML escaping, `{% generation %}`, loop
//! controls, `raise_exception`, a fixed `strftime_now` clock), for the conversations of fixtures/templates/cases.json:
//! plain turns, a system message with non-ASCII and HTML characters, tool definitions, and a tool call with its
//! result. A case Python refuses must be refused here too.

use std::path::{Path, PathBuf};

use serde_json::Value;
use strata_engine::models::TEMPLATES_DIR;
use strata_engine::tokenizer::{ChatRequest, ChatTemplate};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/templates")
}

fn read_json(path: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))).unwrap()
}

/// Where a render may differ from Python's, and why: (template, case, reason).
const KNOWN: &[(&str, &str, &str)] = &[(
    "meetkai-functionary-medium-v3.1.jinja",
    "*",
    "jinja2's Markup HTML-escapes a string added to a `|safe` one (`\"...\"|safe + t | tojson`), so Hugging Face \
         feeds this model `&#34;` for every quote of a tool schema; minijinja concatenates plainly",
)];

/// jinja2 refusals that minijinja renders instead (it iterates none as empty, and its `map` gives a list that
/// `tojson` writes, where jinja2's gives a generator `json.dumps` refuses): more lenient, never a different text
/// for a conversation both render.
fn lenient_here(python_error: &str) -> bool {
    python_error.contains("'NoneType' object is not iterable") || python_error.contains("Object of type generator")
}

#[test]
fn every_llama_cpp_template_renders_as_hugging_face_does() {
    let spec = read_json(&fixtures().join("cases.json"));
    let goldens = read_json(&fixtures().join("goldens.json"));
    let marker =
        strata_engine::models::require(&format!("{TEMPLATES_DIR}/.complete")).unwrap_or_else(|e| panic!("{e}"));
    let dir = marker.parent().unwrap();
    let bos = spec["bos_token"].as_str().unwrap();
    let eos = spec["eos_token"].as_str().unwrap();
    let now = spec["now_unix_s"].as_i64().unwrap();
    let goldens = goldens.as_object().unwrap();
    assert!(goldens.len() >= 70, "{} templates in the goldens", goldens.len());
    let mut failures = Vec::new();
    let mut compared = 0;
    for (name, entry) in goldens {
        let source = std::fs::read_to_string(dir.join(name)).unwrap_or_else(|e| panic!("{name}: {e}"));
        let template = ChatTemplate::compile(name, &source, bos, eos);
        if let Some(err) = entry.get("compile_error") {
            if template.is_ok() {
                failures.push(format!("{name}: compiles here, jinja2 refused it: {err}"));
            }
            continue;
        }
        let mut template = match template {
            Ok(t) => t,
            Err(e) => {
                failures.push(format!("{name}: does not compile here: {e}"));
                continue;
            }
        };
        template.set_clock(now);
        for (case, want) in entry.as_object().unwrap() {
            if KNOWN.iter().any(|(t, c, _)| *t == name && (*c == case || *c == "*")) {
                continue;
            }
            let c = &spec["cases"][case];
            let request: ChatRequest = serde_json::from_value(serde_json::json!({
                "messages": c["messages"],
                "tools": c.get("tools"),
                "add_generation_prompt": c["add_generation_prompt"],
            }))
            .unwrap();
            let got = template.render(&request);
            compared += 1;
            match (want.get("text"), got) {
                (Some(text), Ok(got)) if got == text.as_str().unwrap() => {}
                (Some(text), Ok(got)) => {
                    let text = text.as_str().unwrap();
                    let at = text.bytes().zip(got.bytes()).take_while(|(a, b)| a == b).count();
                    let near = |s: &str| {
                        s.get(at.saturating_sub(40)..(at + 60).min(s.len()))
                            .unwrap_or("")
                            .to_string()
                    };
                    failures.push(format!(
                        "{name} {case}: differs at byte {at}:\n  python: {:?}\n  strata: {:?}",
                        near(text),
                        near(&got)
                    ));
                }
                (Some(_), Err(e)) => failures.push(format!("{name} {case}: refused here: {e}")),
                (None, Ok(_)) if lenient_here(want["error"].as_str().unwrap_or("")) => {}
                (None, Ok(_)) => failures.push(format!(
                    "{name} {case}: rendered here, jinja2 refused it: {}",
                    want["error"]
                )),
                (None, Err(_)) => {}
            }
        }
    }
    assert!(compared > 300, "{compared} renders compared");
    assert!(
        failures.is_empty(),
        "{} of {compared}:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

/// Each tool-call family is detected from its template in llama.cpp's collection (issue 18, point 1).
#[test]
fn tool_formats_are_detected_from_real_templates() {
    use strata_engine::serve::tools::ToolFormat;
    let marker =
        strata_engine::models::require(&format!("{TEMPLATES_DIR}/.complete")).unwrap_or_else(|e| panic!("{e}"));
    let dir = marker.parent().unwrap();
    for (file, want) in [
        ("Qwen-Qwen3-0.6B.jinja", ToolFormat::Hermes),
        ("Qwen-Qwen2.5-7B-Instruct.jinja", ToolFormat::Hermes),
        ("NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja", ToolFormat::Hermes),
        ("meta-llama-Llama-3.1-8B-Instruct.jinja", ToolFormat::Llama3),
        ("meta-llama-Llama-3.3-70B-Instruct.jinja", ToolFormat::Llama3),
        ("mistralai-Mistral-Nemo-Instruct-2407.jinja", ToolFormat::Mistral),
    ] {
        let source = std::fs::read_to_string(dir.join(file)).unwrap();
        assert_eq!(ToolFormat::detect(&source), want, "{file}");
    }
}
