//! `strata inspect` on the real models, as a user runs it, and on bad input.

use std::path::PathBuf;
use std::process::{Command, Output};

use strata_engine::models;

fn model(file: &str) -> PathBuf {
    models::require(file).unwrap_or_else(|e| panic!("{e}"))
}

fn strata(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_strata"))
        .args(args)
        .output()
        .expect("run strata")
}

fn stdout(out: &Output) -> String {
    assert!(
        out.status.success(),
        "strata failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout.clone()).unwrap()
}

/// The value printed after `key` on its line of the hyper-parameter block.
fn field<'a>(text: &'a str, key: &str) -> &'a str {
    text.lines()
        .find_map(|l| {
            l.trim_start()
                .strip_prefix(key)
                .filter(|rest| rest.starts_with(' '))
                .map(str::trim)
        })
        .unwrap_or_else(|| panic!("no `{key}` line in:\n{text}"))
}

#[test]
fn smollm2_hyper_parameters_tokenizer_and_tensors() {
    let path = model(models::DEFAULT_MODEL_FILE);
    let text = stdout(&strata(&["inspect", path.to_str().unwrap()]));
    assert_eq!(field(&text, "architecture"), "llama");
    assert_eq!(field(&text, "n_layer"), "30");
    assert_eq!(field(&text, "n_embd"), "576");
    assert_eq!(field(&text, "n_head"), "9");
    assert_eq!(field(&text, "n_head_kv"), "3");
    assert_eq!(field(&text, "n_vocab"), "49152");
    assert!(
        text.contains("tokenizer    gpt2 (pre smollm), 49152 tokens, 48900 merges"),
        "{text}"
    );
    assert!(text.contains("chat template present"), "{text}");
    assert!(text.contains("blk.0.ffn_down.weight"), "{text}");
    // 210 Q4_1 + 61 F32 + 1 Q8_0 tensors (counted independently with PyPI gguf's GGUFReader).
    let totals: Vec<&str> = text
        .lines()
        .filter(|l| l.starts_with("Q4_1 ") || l.starts_with("F32 "))
        .collect();
    assert!(
        totals.iter().any(|l| l.split_whitespace().nth(1) == Some("210")),
        "{totals:?}"
    );
    assert!(
        totals.iter().any(|l| l.split_whitespace().nth(1) == Some("61")),
        "{totals:?}"
    );
}

#[test]
fn gemma3_hyper_parameters() {
    let path = model(models::GEMMA3_MODEL_FILE);
    let text = stdout(&strata(&["inspect", path.to_str().unwrap()]));
    assert_eq!(field(&text, "architecture"), "gemma3");
    assert_eq!(field(&text, "n_layer"), "18");
    assert_eq!(field(&text, "n_embd"), "640");
    assert_eq!(field(&text, "n_head"), "4");
    assert_eq!(field(&text, "n_head_kv"), "1");
    assert_eq!(field(&text, "head_dim"), "256 (v 256)");
    assert_eq!(field(&text, "sliding_win"), "512");
    assert!(
        text.contains("tokenizer    llama (pre default), 262144 tokens"),
        "{text}"
    );
}

#[test]
fn json_output_carries_the_same_facts() {
    let path = model(models::DEFAULT_MODEL_FILE);
    let json: serde_json::Value =
        serde_json::from_str(&stdout(&strata(&["inspect", "--json", path.to_str().unwrap()]))).expect("valid JSON");
    assert_eq!(json["architecture"], "llama");
    assert_eq!(json["hparams"]["n_layer"], 30);
    assert_eq!(json["hparams"]["n_head_kv"], 3);
    assert_eq!(json["tensors"].as_array().unwrap().len(), 272);
    let weights: u64 = json["tensors"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["bytes"].as_u64().unwrap())
        .sum();
    assert_eq!(json["memory"]["weights_bytes"].as_u64(), Some(weights));
    assert!(weights < json["file_bytes"].as_u64().unwrap());
    // The memory plan's KV cache at 4096 tokens: 30 layers x 3 KV heads x (64 + 64) values, at 2 bytes (f16) or
    // 34 bytes per 32 values (int8), counted by hand.
    let at = &json["memory"]["at_context"][0];
    assert_eq!(at["context_tokens"], 4096);
    assert_eq!(
        at["total_kv_f16_bytes"].as_u64(),
        Some(weights + 30 * 3 * 128 * 2 * 4096)
    );
    assert_eq!(
        at["total_kv_int8_bytes"].as_u64(),
        Some(weights + 30 * 3 * 4 * 34 * 4096)
    );
    assert_eq!(json["memory"]["expert_bytes"], 0);
}

/// A reader that leaves before strata writes (`strata inspect --json | true`) ends strata as it ends Unix tools, by
/// SIGPIPE, never with a panic (Rust's println! panics on a closed pipe while the signal is ignored).
#[cfg(unix)]
#[test]
fn a_reader_that_leaves_ends_it_without_a_panic() {
    use std::os::unix::process::ExitStatusExt;
    use std::process::Stdio;
    let path = model(models::DEFAULT_MODEL_FILE);
    let mut child = Command::new(env!("CARGO_BIN_EXE_strata"))
        .args(["inspect", "--json", path.to_str().unwrap()])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run strata");
    drop(child.stdout.take()); // the reader leaves before strata has opened the model
    let out = child.wait_with_output().expect("wait for strata");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!err.contains("panicked"), "strata panicked: {err}");
    assert_eq!(
        out.status.signal(),
        Some(13),
        "ended by SIGPIPE: {:?}, stderr {err}",
        out.status
    );
}

#[test]
fn bad_input_is_one_clear_error_and_no_panic() {
    let missing = strata(&["inspect", "/nonexistent/model.gguf"]);
    assert_eq!(missing.status.code(), Some(1));
    let err = String::from_utf8_lossy(&missing.stderr);
    assert!(
        err.contains("/nonexistent/model.gguf") && err.contains("does not exist"),
        "{err}"
    );

    let dir = tempfile::tempdir().unwrap();
    let cut = dir.path().join("cut.gguf");
    let bytes = std::fs::read(model(models::DEFAULT_MODEL_FILE)).unwrap();
    std::fs::write(&cut, &bytes[..100_000]).unwrap();
    let out = strata(&["inspect", cut.to_str().unwrap()]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("cut.gguf") && !err.contains("panicked"), "{err}");

    let unknown = strata(&["inspect", "--frobnicate"]);
    assert_eq!(unknown.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&unknown.stderr).contains("--frobnicate"));
}

#[test]
fn a_broken_chat_template_is_reported_with_its_line() {
    use strata_engine::fixtures::synth::SynthSpec;
    use strata_engine::gguf::Value;
    let dir = tempfile::tempdir().unwrap();
    let good = dir.path().join("good.gguf");
    let spec = SynthSpec {
        n_layer: 1,
        ..SynthSpec::tiny_qwen3moe()
    };
    spec.write(&good).unwrap();
    let text = stdout(&strata(&["inspect", good.to_str().unwrap()]));
    assert!(text.contains("chat template present\n"), "{text}");

    // The same model with a template whose second line never closes its block.
    let broken = dir.path().join("broken.gguf");
    with_metadata(&good, &broken, |md| {
        md.insert(
            "tokenizer.chat_template",
            Value::String("hello\n{% for m in messages %}{{ m.content }}".into()),
        )
    });
    let text = stdout(&strata(&["inspect", broken.to_str().unwrap()]));
    assert!(text.contains("chat template present but broken"), "{text}");
    let line = text
        .lines()
        .find(|l| l.contains("chat template error"))
        .expect("an error line");
    assert!(
        line.contains("tokenizer.chat_template") && line.contains("line"),
        "{line}"
    );
}

/// `strata --version` names the commit the binary was built from (engine/build.rs): the checkout's HEAD, with
/// "-dirty" when tracked files differ, or "unknown" outside a git checkout.
#[test]
fn version_names_the_commit_it_was_built_from() {
    let out = strata(&["--version"]);
    assert!(out.status.success());
    let line = String::from_utf8_lossy(&out.stdout).trim().to_string();
    let rev = line
        .strip_prefix(concat!("strata ", env!("CARGO_PKG_VERSION"), " ("))
        .and_then(|r| r.strip_suffix(')'))
        .unwrap_or_else(|| panic!("`strata --version` printed {line:?}"));
    let head = Command::new("git")
        .args(["rev-parse", "--short=12", "HEAD"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string());
    match head {
        Some(head) => assert!(
            rev == head || rev == format!("{head}-dirty"),
            "version names {rev}, HEAD is {head}"
        ),
        None => assert_eq!(rev, "unknown"),
    }
}

/// A MoE's routed experts are counted apart from its dense weights: the `_exps` tensors' bytes, summed here from
/// the tensor table the JSON carries.
#[test]
fn moe_expert_bytes_are_the_exps_tensors() {
    use strata_engine::fixtures::synth::SynthSpec;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("moe.gguf");
    SynthSpec::tiny_qwen3moe().write(&path).unwrap();
    let json: serde_json::Value =
        serde_json::from_str(&stdout(&strata(&["inspect", "--json", path.to_str().unwrap()]))).expect("valid JSON");
    let tensors = json["tensors"].as_array().unwrap();
    let exps: u64 = tensors
        .iter()
        .filter(|t| {
            let n = t["name"].as_str().unwrap();
            n.ends_with("_exps.weight")
        })
        .map(|t| t["bytes"].as_u64().unwrap())
        .sum();
    assert!(exps > 0);
    assert_eq!(json["memory"]["expert_bytes"].as_u64(), Some(exps));
    let text = stdout(&strata(&["inspect", path.to_str().unwrap()]));
    assert!(text.contains("(routed experts "), "{text}");
}

/// A model whose hyper-parameters cannot be read (here: no KV heads) is still inspectable, and its KV estimate is
/// `n/a` / `null`, not a cache of 0 bytes.
#[test]
fn unreadable_hyper_parameters_give_no_kv_estimate() {
    use strata_engine::fixtures::synth::SynthSpec;
    use strata_engine::gguf::Value;
    let dir = tempfile::tempdir().unwrap();
    let good = dir.path().join("good.gguf");
    SynthSpec {
        n_layer: 1,
        ..SynthSpec::tiny_qwen3moe()
    }
    .write(&good)
    .unwrap();
    let bad = dir.path().join("bad.gguf");
    with_metadata(&good, &bad, |md| {
        md.insert("qwen3moe.attention.head_count_kv", Value::U32(0))
    });
    let text = stdout(&strata(&["inspect", bad.to_str().unwrap()]));
    assert!(
        text.contains("KV f16 per token n/a (hyper-parameters unreadable)"),
        "{text}"
    );
    let json: serde_json::Value =
        serde_json::from_str(&stdout(&strata(&["inspect", "--json", bad.to_str().unwrap()]))).unwrap();
    assert!(json["hparams"].is_null());
    assert!(json["memory"]["kv_f16_bytes_per_token"].is_null());
    assert!(json["memory"]["at_context"][0]["total_kv_f16_bytes"].is_null());
}

/// Writes `out`: the model `src` with its metadata edited by `edit`, tensors unchanged.
fn with_metadata(src: &std::path::Path, out: &std::path::Path, edit: impl FnOnce(&mut strata_engine::gguf::Metadata)) {
    use strata_engine::gguf::{GgufModel, GgufWriter};
    let model = GgufModel::open(src).unwrap();
    let mut md = model.metadata().clone();
    edit(&mut md);
    let specs: Vec<_> = model
        .tensors()
        .iter()
        .map(|t| (t.name.clone(), t.dims.clone(), t.ty))
        .collect();
    let writer = GgufWriter::create(out, md, specs).unwrap();
    for (i, t) in model.tensors().iter().enumerate() {
        writer.write_tensor(i, model.tensor_data(t)).unwrap();
    }
    writer.finish().unwrap();
}

#[test]
fn a_cached_synth_model_that_is_not_this_builds_is_generated_again() {
    use strata_engine::fixtures::synth::{FILLERS_KEY, SynthSpec};
    let dir = tempfile::tempdir().unwrap();
    let cached = dir.path().join("synth/tiny-qwen3moe.gguf");
    std::fs::create_dir_all(cached.parent().unwrap()).unwrap();
    let fillers = |p: &std::path::Path| {
        let f = strata_engine::gguf::GgufFile::open(p).unwrap();
        f.metadata().get(FILLERS_KEY).map(|v| v.to_string())
    };
    let run = || {
        Command::new(env!("CARGO_BIN_EXE_strata"))
            .args(["inspect", "synth:tiny-qwen3moe"])
            .env(strata_engine::switches::MODELS_DIR, dir.path())
            .output()
            .unwrap()
    };
    // Files of other specs stand where the cache keeps synth:tiny-qwen3moe: word fillers, another seed.
    let stale = [
        (
            SynthSpec {
                word_fillers: true,
                ..SynthSpec::tiny_qwen3moe()
            },
            "has strata.synth.fillers \"words\" where this build's has absent",
        ),
        (
            SynthSpec {
                seed: 2,
                ..SynthSpec::tiny_qwen3moe()
            },
            "has strata.synth.seed 2 where this build's has 1",
        ),
    ];
    for (spec, why) in stale {
        spec.write(&cached).unwrap();
        let out = run();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{err}");
        assert!(err.contains(&format!("{why}; generating it again")), "{err}");
        assert_eq!(fillers(&cached), None);
        assert_eq!(
            std::fs::read(&cached).unwrap(),
            std::fs::read({
                let fresh = dir.path().join("fresh.gguf");
                SynthSpec::tiny_qwen3moe().write_with(&fresh, true).unwrap();
                fresh
            })
            .unwrap(),
            "the file generated again is this build's"
        );
    }
    // Now it matches and is used as it is; no partial file is left beside it.
    let again = run();
    assert!(again.status.success());
    assert!(!String::from_utf8_lossy(&again.stderr).contains("generating"));
    let names: Vec<_> = std::fs::read_dir(cached.parent().unwrap())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(names, ["tiny-qwen3moe.gguf"]);
}
