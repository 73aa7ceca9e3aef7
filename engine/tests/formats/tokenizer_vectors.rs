//! llama.cpp's tokenizer test vectors (`ggml-vocab-<name>.gguf` with `.inp`/`.out`, from the llama-cpp-python
//! 0.3.36 sdist, fetched into the model cache by ci/fetch-models.sh): every input must encode to exactly the
//! expected ids, the way llama.cpp's tests/test-tokenizer-0.cpp checks them (`add_special` and `parse_special`
//! off), and decode back to the input.

use std::path::PathBuf;

use strata_engine::gguf::GgufFile;
use strata_engine::models::VOCAB_DIR;
use strata_engine::tokenizer::Tokenizer;

/// The separator between inputs in a `.inp` file (the file ends with one too).
const SEPARATOR: &str = "\n__ggml_vocab_test__\n";

fn vocab_path(name: &str) -> PathBuf {
    let file = format!("{VOCAB_DIR}/ggml-vocab-{name}.gguf");
    strata_engine::models::require(&file).unwrap_or_else(|e| panic!("{e}"))
}

/// (input text, expected ids) pairs of one vocabulary, parsed as test-tokenizer-0.cpp parses them.
fn read_vectors(name: &str) -> Vec<(String, Vec<u32>)> {
    let base = vocab_path(name);
    let read = |ext: &str| {
        let p = PathBuf::from(format!("{}.{ext}", base.display()));
        std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}; run ci/fetch-models.sh", p.display()))
    };
    let inp = read("inp");
    let out = read("out");
    let mut inputs = Vec::new();
    let mut pos = 0;
    while pos < inp.len() {
        match inp[pos..].find(SEPARATOR) {
            Some(i) => {
                inputs.push(inp[pos..pos + i].to_string());
                pos += i + SEPARATOR.len();
            }
            None => {
                inputs.push(inp[pos..].to_string());
                break;
            }
        }
    }
    let outputs: Vec<Vec<u32>> = out
        .lines()
        .map(|l| l.split_whitespace().map(|t| t.parse().expect("token id")).collect())
        .collect();
    assert_eq!(
        inputs.len(),
        outputs.len(),
        "{name}: .inp and .out disagree on the number of tests"
    );
    inputs.into_iter().zip(outputs).collect()
}

fn load(name: &str) -> Tokenizer {
    let file = GgufFile::open(vocab_path(name)).expect("vocab GGUF opens");
    Tokenizer::from_metadata(file.metadata()).unwrap_or_else(|e| panic!("{name}: {e}"))
}

/// Checks every vector of `name` and the decode round trip of every input; panics listing the failures.
fn check(name: &str) {
    let tok = load(name);
    let vectors = read_vectors(name);
    let mut failures = Vec::new();
    for (text, want) in &vectors {
        let got = tok
            .encode(text, false, false)
            .unwrap_or_else(|e| panic!("{name}: encoding {text:?}: {e}"));
        if &got != want {
            failures.push(format!("  {text:?}\n    want {want:?}\n    got  {got:?}"));
        }
        let back = tok.decode(&got).expect("ids in range");
        if &back != text {
            failures.push(format!("  round trip of {text:?} gave {back:?}"));
        }
    }
    eprintln!(
        "{name}: {} of {} vectors pass",
        vectors.len() - failures.len().min(vectors.len()),
        vectors.len()
    );
    assert!(
        failures.is_empty(),
        "{name}: {} failures:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

macro_rules! vocab_tests {
    ($($test:ident => $name:literal),* $(,)?) => {
        $(
            #[test]
            fn $test() {
                check($name);
            }
        )*
    };
}

vocab_tests! {
    gpt_2 => "gpt-2",
    llama_bpe => "llama-bpe",
    qwen2 => "qwen2",
    qwen35 => "qwen35",
    llama_spm => "llama-spm",
    phi_3 => "phi-3",
    starcoder => "starcoder",
    refact => "refact",
    command_r => "command-r",
    mpt => "mpt",
    falcon => "falcon",
    deepseek_coder => "deepseek-coder",
    deepseek_llm => "deepseek-llm",
}
