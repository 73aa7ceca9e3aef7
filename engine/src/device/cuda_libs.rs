//! Finding CUDA's shared libraries at run time, and counting the devices (DESIGN.md section 6: cudarc with dynamic loading).
//!
//! cudarc opens each library by name (`libcuda.so.1`, `libnvrtc.so.13`, ...) and panics when it is missing.
//! Before cudarc's first call we open every library ourselves: by name first (the loader path:
//! `LD_LIBRARY_PATH`, the ld.so cache), then by full path in `STRATA_CUDA_LIB_DIR`, `CUDA_HOME`, `CUDA_PATH`,
//! the usual install folders and the pip wheels' folders (`nvidia/cu13/lib`). A library opened by full path is
//! kept open, so cudarc's later open by name finds it by its soname. A missing library is a typed error with
//! one line for the user, never a panic.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// How one library was found.
#[derive(Debug, Clone)]
pub struct Found {
    /// `cuda`, `nvrtc`, `cublas`.
    pub lib: &'static str,
    /// The name or full path that opened it.
    pub from: String,
}

/// CUDA is not usable on this machine: the one line to print.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{0}")]
pub struct Unavailable(pub String);

/// Library names tried by name (the loader path) before the folders, most specific first.
struct LibSpec {
    lib: &'static str,
    names: &'static [&'static str],
    /// File-name prefix looked for in the folders.
    prefix: &'static str,
    /// Libraries it needs that live beside it (opened first from the same folder).
    companions: &'static [&'static str],
}

const DRIVER: LibSpec = LibSpec {
    lib: "cuda",
    names: &["libcuda.so.1", "libcuda.so"],
    prefix: "libcuda.so",
    companions: &[],
};
const NVRTC: LibSpec = LibSpec {
    lib: "nvrtc",
    names: &["libnvrtc.so.13", "libnvrtc.so"],
    prefix: "libnvrtc.so",
    companions: &["libnvrtc-builtins.so"],
};
const CUBLAS: LibSpec = LibSpec {
    lib: "cublas",
    names: &["libcublas.so.13", "libcublas.so"],
    prefix: "libcublas.so",
    companions: &["libcublasLt.so"],
};

/// Folders searched after the loader path, in order.
fn search_dirs() -> Vec<PathBuf> {
    let mut dirs = Vec::new();
    if let Some(d) = crate::switches::path(crate::switches::CUDA_LIB_DIR) {
        dirs.push(d);
    }
    for var in ["CUDA_HOME", "CUDA_PATH", "CUDA_ROOT"] {
        if let Some(root) = std::env::var_os(var) {
            let root = PathBuf::from(root);
            for sub in ["lib64", "lib", "targets/x86_64-linux/lib"] {
                dirs.push(root.join(sub));
            }
        }
    }
    for d in [
        "/usr/local/cuda/lib64",
        "/usr/local/cuda/targets/x86_64-linux/lib",
        "/usr/local/nvidia/lib64",
        "/usr/local/nvidia/lib",
        "/usr/lib/x86_64-linux-gnu",
        "/usr/lib64",
        "/usr/lib/wsl/lib",
        "/opt/cuda/lib64",
    ] {
        dirs.push(PathBuf::from(d));
    }
    // pip wheels (nvidia-cuda-nvrtc, nvidia-cublas): <prefix>/lib/python3.*/site-packages/nvidia/{cu13,..}/lib.
    let mut prefixes: Vec<PathBuf> = ["/usr/local/lib", "/usr/lib", "/opt/torch/.venv/lib"]
        .iter()
        .map(PathBuf::from)
        .collect();
    if let Some(v) = std::env::var_os("VIRTUAL_ENV") {
        prefixes.push(PathBuf::from(v).join("lib"));
    }
    for prefix in prefixes {
        let Ok(entries) = std::fs::read_dir(&prefix) else {
            continue;
        };
        for e in entries.flatten() {
            let name = e.file_name();
            if !name.to_string_lossy().starts_with("python3") {
                continue;
            }
            for site in ["site-packages", "dist-packages"] {
                for sub in ["nvidia/cu13/lib", "nvidia/cuda_nvrtc/lib", "nvidia/cublas/lib"] {
                    dirs.push(e.path().join(site).join(sub));
                }
            }
        }
    }
    dirs
}

/// Opens `path` and keeps it open for the life of the process (cudarc later finds it by soname).
fn open_forever(path: &Path) -> bool {
    // SAFETY: loading a CUDA library runs its initialisers, which have no preconditions on us.
    match unsafe { libloading::Library::new(path) } {
        Ok(lib) => {
            std::mem::forget(lib);
            true
        }
        Err(_) => false,
    }
}

/// The files in `dir` whose names start with `prefix`, longest (most versioned) name first.
fn matching(dir: &Path, prefix: &str) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut v: Vec<PathBuf> = entries
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            p.file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with(prefix) && !n.to_string_lossy().contains(".alt."))
        })
        .collect();
    v.sort_by_key(|p| std::cmp::Reverse(p.as_os_str().len()));
    v
}

fn locate(spec: &LibSpec, dirs: &[PathBuf]) -> Option<Found> {
    for name in spec.names {
        if open_forever(Path::new(name)) {
            return Some(Found {
                lib: spec.lib,
                from: format!("{name} (loader path)"),
            });
        }
    }
    for dir in dirs {
        let candidates = matching(dir, spec.prefix);
        if candidates.is_empty() {
            continue;
        }
        for c in spec.companions {
            if let Some(p) = matching(dir, c).first() {
                open_forever(p);
            }
        }
        for p in candidates {
            if open_forever(&p) {
                return Some(Found {
                    lib: spec.lib,
                    from: p.display().to_string(),
                });
            }
        }
    }
    None
}

/// What [`load`] found: the driver and NVRTC (both needed), and cuBLAS (optional: without it the prefill GEMM
/// uses our own kernel).
#[derive(Debug, Clone)]
pub struct Loaded {
    pub driver: Found,
    pub nvrtc: Found,
    pub cublas: Option<Found>,
}

/// Opens the driver, NVRTC and cuBLAS once per process.
///
/// Errors: no driver library (no NVIDIA driver on this machine), or no NVRTC; the message names what to
/// install or set.
pub fn load() -> Result<&'static Loaded, Unavailable> {
    static LOADED: OnceLock<Result<Loaded, Unavailable>> = OnceLock::new();
    LOADED
        .get_or_init(|| {
            let dirs = search_dirs();
            let driver = locate(&DRIVER, &dirs).ok_or_else(|| {
                Unavailable(
                    "no CUDA driver on this machine (libcuda.so.1 not found on the loader path, in STRATA_CUDA_LIB_DIR, CUDA_HOME, CUDA_PATH or the usual folders); use --device cpu".into(),
                )
            })?;
            // SAFETY: the library was opened above; cudarc's check only tries to open it again.
            if !unsafe { cudarc::driver::sys::is_culib_present() } {
                return Err(Unavailable(format!(
                    "the CUDA driver was found at {} but cudarc cannot open it by name; add its folder to LD_LIBRARY_PATH",
                    driver.from
                )));
            }
            let nvrtc = locate(&NVRTC, &dirs).ok_or_else(|| {
                Unavailable(
                    "NVRTC (libnvrtc.so.13) not found: install CUDA 13's NVRTC (pip install nvidia-cuda-nvrtc) or set CUDA_HOME / STRATA_CUDA_LIB_DIR".into(),
                )
            })?;
            // SAFETY: as above.
            if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
                return Err(Unavailable(format!(
                    "NVRTC was found at {} but cudarc cannot open it by name; add its folder to LD_LIBRARY_PATH",
                    nvrtc.from
                )));
            }
            // SAFETY: as above.
            let cublas = locate(&CUBLAS, &dirs).filter(|_| unsafe { cudarc::cublas::sys::is_culib_present() });
            Ok(Loaded { driver, nvrtc, cublas })
        })
        .as_ref()
        .map_err(Clone::clone)
}

/// Opens NVRTC alone (compiling kernels needs no driver: CI compile-checks kernels this way).
///
/// Errors: NVRTC not found.
pub fn load_nvrtc() -> Result<Found, Unavailable> {
    let found = locate(&NVRTC, &search_dirs())
        .ok_or_else(|| Unavailable("NVRTC (libnvrtc.so.13) not found; set STRATA_CUDA_LIB_DIR".into()))?;
    // SAFETY: the library was opened above.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Err(Unavailable(format!(
            "NVRTC found at {} but not openable by name",
            found.from
        )));
    }
    Ok(found)
}

/// Number of CUDA devices on this machine.
///
/// Errors: no driver or NVRTC ([`Unavailable`], one line saying what to install), or the driver fails to
/// initialise (no device, driver/library mismatch), named with the failing call.
pub fn device_count() -> Result<usize, Unavailable> {
    load()?;
    cudarc::driver::result::init().map_err(|e| Unavailable(format!("CUDA cuInit failed: {e}")))?;
    let n = cudarc::driver::result::device::get_count()
        .map_err(|e| Unavailable(format!("CUDA cuDeviceGetCount failed: {e}")))?;
    Ok(n as usize)
}
