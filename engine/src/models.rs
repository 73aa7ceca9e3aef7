//! Where models live: the model cache and the default model, fetched on first use.
//!
//! The cache is `$STRATA_MODELS_DIR`, else `${XDG_CACHE_HOME:-$HOME/.cache}/strata/models`, and is filled by
//! `ci/fetch-models.sh` (DESIGN.md section 4: models come from PyPI, checked by sha256).

use std::path::{Path, PathBuf};
use std::process::Command;

/// File name of the default model (SmolLM2-135M-Instruct, Q4_1, `llama` architecture) in the cache.
pub const DEFAULT_MODEL_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";
/// File name of the second real model (gemma-3-270m, Q4_K_M, `gemma3` architecture) in the cache.
pub const GEMMA3_MODEL_FILE: &str = "gemma-3-270m-Q4_K_M.gguf";
/// Folder in the cache holding llama.cpp's tokenizer test vocabularies (`ggml-vocab-*.gguf` with `.inp`/`.out`).
pub const VOCAB_DIR: &str = "llama.cpp-vocab";
/// Folder in the cache holding llama.cpp's chat templates (`models/templates/*.jinja` of the llama-cpp-python
/// 0.3.36 sdist), which fixtures/templates/goldens.json was rendered from.
pub const TEMPLATES_DIR: &str = "llama.cpp-templates";

/// Errors from locating or fetching a model.
#[derive(Debug, thiserror::Error)]
pub enum ModelsError {
    #[error(
        "model `{name}` is not in the cache {dir} and could not be fetched: {reason}. Fetching needs PyPI; \
         offline, copy the files into that folder (see ci/fetch-models.sh for names and sha256)"
    )]
    NotFetched { name: String, dir: PathBuf, reason: String },
    #[error("model file {path} does not exist")]
    NoSuchFile { path: PathBuf },
    #[error("{path} is not in the model cache; run ci/fetch-models.sh (or `strata models fetch`) first")]
    NotInCache { path: PathBuf },
    #[error("model path {path} is not a regular file (a directory or a device?); give a .gguf file")]
    NotAFile { path: PathBuf },
    #[error("unknown generated model `synth:{name}`; known: {known}")]
    UnknownSynth { name: String, known: String },
    #[error("could not generate synth:{name} into {path}: {reason}")]
    NotGenerated {
        name: String,
        path: PathBuf,
        reason: String,
    },
}

/// The model cache folder (not created); see [`crate::paths::models_dir`].
pub fn models_dir() -> PathBuf {
    crate::paths::models_dir()
}

/// A program of the reference llama.cpp build (`fixtures/llamacpp/build.sh`, from the llama-cpp-python 0.3.36
/// sdist) in the model cache: `llama-bench`, `llama-server`, ... (the path, whether or not it is built).
pub fn llama_cpp_bin(name: &str) -> PathBuf {
    models_dir().join("llama.cpp-0.3.36/build/bin").join(name)
}

/// Path of a cached file, whether or not it exists yet.
pub fn cached(file: &str) -> PathBuf {
    models_dir().join(file)
}

/// The path of `file` (relative to the cache, e.g. [`DEFAULT_MODEL_FILE`] or `VOCAB_DIR/ggml-vocab-gpt-2.gguf`),
/// which must already be there: nothing is fetched.
///
/// Errors: [`ModelsError::NotInCache`], saying how to fetch it.
pub fn require(file: &str) -> Result<PathBuf, ModelsError> {
    let path = cached(file);
    if path.is_file() {
        Ok(path)
    } else {
        Err(ModelsError::NotInCache { path })
    }
}

/// The fetch script of the source tree this binary was built from, when that tree is still there.
fn fetch_script() -> Option<PathBuf> {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../ci/fetch-models.sh");
    script.is_file().then_some(script)
}

/// Resolves a `--model` argument: `default` (or nothing) is the default model, fetched on first use; anything
/// else is a path that must exist.
///
/// Errors: [`ModelsError::NoSuchFile`] for a missing path, [`ModelsError::NotAFile`] for a directory or device; [`ModelsError::NotFetched`] when the default model is
/// absent and the fetch script is missing or fails (its output goes to stderr).
pub fn resolve(model: Option<&str>) -> Result<PathBuf, ModelsError> {
    match model {
        None | Some("default") => {
            let path = cached(DEFAULT_MODEL_FILE);
            if !path.is_file() {
                fetch("default")?;
            }
            Ok(path)
        }
        Some(name) if name.starts_with(SYNTH_PREFIX) => synthesized(&name[SYNTH_PREFIX.len()..]),
        Some(p) => {
            let path = PathBuf::from(p);
            match std::fs::metadata(&path) {
                Ok(m) if m.is_file() => Ok(path),
                Ok(_) => Err(ModelsError::NotAFile { path }),
                Err(_) => Err(ModelsError::NoSuchFile { path }),
            }
        }
    }
}

/// Model names that the generator makes on first use (`synth:qwen3-30b-a3b`), instead of fetching: benchmark
/// shapes on machines that reach no registry (DESIGN.md section 4).
pub const SYNTH_PREFIX: &str = "synth:";

/// The generated models `synth:NAME` knows, with what they are.
pub const SYNTH_MODELS: &[(&str, &str)] = &[
    (
        "qwen3-30b-a3b",
        "Qwen3-30B-A3B's shape (qwen3moe, 48 layers, 128 experts, top-8), Q4_K with a Q6_K output, random blocks, filler tokens that render as words, about 17 GB",
    ),
    (
        "tiny-qwen3moe",
        "the 4-layer, 16-expert qwen3moe of the tests, Q8_0, about 15 MiB",
    ),
    (
        "small-qwen3moe",
        "tiny-qwen3moe with 64 experts a layer (top-4), Q8_0, about 53 MiB: experts 96% of the weights, as in a large MoE (the simulated-device replays)",
    ),
    (
        "small-qwen3moe-q4k",
        "small-qwen3moe with Q4_K experts, about 29 MiB: the CPU's Q4_K expert rows, as the 30B shape's (the speed-switch checks)",
    ),
];

/// `synth:NAME`: the cached file `synth/NAME.gguf`, generated there on first use (written to a temporary name,
/// then renamed, so an interrupted run leaves nothing half-written behind).
fn synthesized(name: &str) -> Result<PathBuf, ModelsError> {
    let spec = match name {
        "qwen3-30b-a3b" => crate::fixtures::synth::SynthSpec::qwen3_30b_a3b(),
        "tiny-qwen3moe" => crate::fixtures::synth::SynthSpec::tiny_qwen3moe(),
        "small-qwen3moe" => crate::fixtures::synth::SynthSpec {
            n_expert: 64,
            ..crate::fixtures::synth::SynthSpec::tiny_qwen3moe()
        },
        "small-qwen3moe-q4k" => {
            let mut spec = crate::fixtures::synth::SynthSpec {
                n_expert: 64,
                ..crate::fixtures::synth::SynthSpec::tiny_qwen3moe()
            };
            spec.types.experts = crate::quant::GgmlType::Q4_K;
            spec
        }
        _ => {
            return Err(ModelsError::UnknownSynth {
                name: name.to_string(),
                known: SYNTH_MODELS
                    .iter()
                    .map(|(n, _)| format!("synth:{n}"))
                    .collect::<Vec<_>>()
                    .join(", "),
            });
        }
    };
    let path = cached(&format!("synth/{name}.gguf"));
    if path.is_file() {
        // A file that is not what this build generates (another model there, an older generator's) is generated
        // again; one that does not parse is left for the load to name.
        match crate::gguf::GgufFile::open(&path).map(|f| synth_mismatch(f.metadata(), &spec)) {
            Ok(Some(why)) => eprintln!("strata: synth:{name} in the cache {why}; generating it again"),
            _ => return Ok(path),
        }
    }
    let fail = |reason: String| ModelsError::NotGenerated {
        name: name.to_string(),
        path: path.clone(),
        reason,
    };
    let dir = path.parent().expect("a file in the cache");
    std::fs::create_dir_all(dir).map_err(|e| fail(e.to_string()))?;
    crate::gguf::writer::remove_dead_partials(dir);
    eprintln!("strata: generating synth:{name} into {}", path.display());
    // The writer writes beside the path and renames into place, removing its partial file on failure.
    spec.write_with(&path, true).map_err(|e| fail(e.to_string()))?;
    Ok(path)
}

/// Why a cached synthetic model's metadata `md` is not what `spec` generates: the first of its architecture, shape,
/// vocabulary size, seed, router skew and filler tokens that differs (`None`: all agree).
fn synth_mismatch(md: &crate::gguf::Metadata, spec: &crate::fixtures::synth::SynthSpec) -> Option<String> {
    let want = spec.metadata();
    let a = spec.arch.gguf_arch();
    let keys = [
        "general.architecture".to_string(),
        format!("{a}.block_count"),
        format!("{a}.embedding_length"),
        format!("{a}.expert_count"),
        format!("{a}.vocab_size"),
        "strata.synth.seed".to_string(),
        "strata.synth.zipf".to_string(),
        crate::fixtures::synth::FILLERS_KEY.to_string(),
    ];
    let show = |v: Option<&crate::gguf::Value>| v.map_or("absent".to_string(), |v| v.to_string());
    keys.iter().find(|k| md.get(k) != want.get(k)).map(|k| {
        format!(
            "has {k} {} where this build's has {}",
            show(md.get(k)),
            show(want.get(k))
        )
    })
}

/// Runs `ci/fetch-models.sh WHAT` (`default` or `all`), which fills the cache; its progress goes to stderr.
pub fn fetch(what: &str) -> Result<(), ModelsError> {
    let fail = |reason: String| ModelsError::NotFetched {
        name: what.to_string(),
        dir: models_dir(),
        reason,
    };
    let script = fetch_script().ok_or_else(|| fail("the fetch script of this build's source tree is gone".into()))?;
    eprintln!("strata: fetching models ({what}) into {}", models_dir().display());
    let status = Command::new("bash")
        .arg(&script)
        .arg(what)
        .env(crate::switches::MODELS_DIR, models_dir())
        // The script's progress must not mix into our stdout, which may be JSON (`strata inspect --json`).
        .stdout(std::process::Stdio::from(std::io::stderr()))
        .status()
        .map_err(|e| fail(format!("could not run {}: {e}", script.display())))?;
    if status.success() {
        Ok(())
    } else {
        Err(fail(format!("{} exited with {status}", script.display())))
    }
}
