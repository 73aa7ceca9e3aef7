//! Strata's cache folders in one place: models (`STRATA_MODELS_DIR`) and compiled kernels
//! (`STRATA_KERNEL_CACHE`), both under `${XDG_CACHE_HOME:-$HOME/.cache}/strata` unless overridden.

use std::path::PathBuf;

use crate::switches;

/// `${XDG_CACHE_HOME:-$HOME/.cache}/strata` (`./.cache/strata` when neither is set).
pub fn cache_root() -> PathBuf {
    let cache = std::env::var_os("XDG_CACHE_HOME")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .unwrap_or_else(|| PathBuf::from(".cache"));
    cache.join("strata")
}

/// The model cache folder (not created): `$STRATA_MODELS_DIR`, else `cache_root()/models`.
pub fn models_dir() -> PathBuf {
    switches::path(switches::MODELS_DIR).unwrap_or_else(|| cache_root().join("models"))
}

/// The compiled-kernel cache folder (not created): `$STRATA_KERNEL_CACHE`, else `cache_root()/kernels`.
pub fn kernel_cache_dir() -> PathBuf {
    switches::path(switches::KERNEL_CACHE).unwrap_or_else(|| cache_root().join("kernels"))
}
