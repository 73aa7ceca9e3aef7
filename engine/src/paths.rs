//! Strata's cache folders in one place: models (`STRATA_MODELS_DIR`) and compiled kernels
//! (`STRATA_KERNEL_CACHE`), both under `${XDG_CACHE_HOME:-$HOME/.cache}/strata` unless overridden; and the one
//! way files Strata writes whole are replaced ([`write_atomically`]).

use std::io::Write;
use std::path::{Path, PathBuf};

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

/// Writes `path` whole or not at all: `write` fills a temporary file beside it (named for this process, so two
/// writers never share one), which is synced and renamed over `path`. A failed write removes the temporary file
/// and leaves whatever `path` held untouched. A symbolic link at `path` is replaced by the file, not followed.
///
/// Errors: creating, writing, syncing or renaming failed (the `io::Error` as the system gave it).
pub fn write_atomically(
    path: &Path,
    write: impl FnOnce(&mut std::io::BufWriter<std::fs::File>) -> std::io::Result<()>,
) -> std::io::Result<()> {
    let mut name = path.file_name().unwrap_or_default().to_owned();
    name.push(format!(".tmp{}", std::process::id()));
    let tmp = path.with_file_name(name);
    let result = (|| {
        let mut w = std::io::BufWriter::new(std::fs::File::create(&tmp)?);
        write(&mut w)?;
        w.flush()?;
        w.into_inner().map_err(|e| e.into_error())?.sync_all()?;
        std::fs::rename(&tmp, path)
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_atomic_write_replaces_whole_or_leaves_the_old_file() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("f.txt");
        std::fs::write(&p, "old").unwrap();
        let e = write_atomically(&p, |w| {
            w.write_all(b"half")?;
            Err(std::io::Error::other("disk full"))
        });
        assert!(e.is_err());
        assert_eq!(std::fs::read_to_string(&p).unwrap(), "old");
        assert_eq!(
            std::fs::read_dir(dir.path()).unwrap().count(),
            1,
            "the temporary file is removed"
        );
        write_atomically(&p, |w| w.write_all(b"new")).unwrap();
        assert_eq!(std::fs::read_to_string(&p).unwrap(), "new");
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
    }
}
