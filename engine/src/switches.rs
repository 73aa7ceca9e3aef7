//! Every `STRATA_*` environment switch, read here and nowhere else.
//!
//! Flags are the user's everyday settings (`--device`, `--kv`, ...); switches are the few settings that must
//! reach code no flag reaches (the kernel loader, the panic hook of a worker started by the server), diagnostics
//! (`STRATA_SYNC_LAUNCHES`, `STRATA_TRACE_TENSORS`) and fault injection for bug replays (`STRATA_FAULT`,
//! DESIGN.md section 1). [`SWITCHES`] lists each with its default and what it does; `strata switches` prints
//! that table with the values this process sees.
//!
//! A boolean switch is off when set to `0`, `false`, `off` or `no`, on when set to anything else, and at its
//! default when unset or empty.

use std::ffi::OsString;
use std::path::PathBuf;

/// One switch: its variable, its default (as the user would write it; empty: unset) and what it does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Switch {
    pub name: &'static str,
    pub default: &'static str,
    pub what: &'static str,
    /// Its value is a secret: listed as `(set)`, never printed.
    pub secret: bool,
}

const fn sw(name: &'static str, default: &'static str, what: &'static str) -> Switch {
    Switch {
        name,
        default,
        what,
        secret: false,
    }
}

/// The model cache folder.
pub const MODELS_DIR: &str = "STRATA_MODELS_DIR";
/// The compiled-kernel cache folder.
pub const KERNEL_CACHE: &str = "STRATA_KERNEL_CACHE";
/// A folder searched for CUDA's libraries.
pub const CUDA_LIB_DIR: &str = "STRATA_CUDA_LIB_DIR";
/// `strata serve`'s API key when `--api-key` is not given.
pub const API_KEY: &str = "STRATA_API_KEY";
/// Fault injection rules (grammar in [`crate::device::fault`]).
pub const FAULT: &str = "STRATA_FAULT";
/// Synchronise after every kernel launch.
pub const SYNC_LAUNCHES: &str = "STRATA_SYNC_LAUNCHES";
/// Programmatic dependent launch.
pub const PDL: &str = "STRATA_PDL";
/// CUDA graphs for decode steps.
pub const CUDA_GRAPHS: &str = "STRATA_CUDA_GRAPHS";
/// The expert cache's slot table on the device for decode steps of one token.
pub const DEVICE_SLOT_TABLE: &str = "STRATA_DEVICE_SLOT_TABLE";
/// Expert fetches of decode steps on a second stream, beside the hits' compute.
pub const FETCH_OVERLAP: &str = "STRATA_FETCH_OVERLAP";
/// The CPU computing its share of expert misses inside decode graphs, on the device's slot table.
pub const CPU_JOIN: &str = "STRATA_CPU_JOIN";
/// Blocks per matrix of the expert fetch kernel (a tuning knob).
pub const FETCH_BLOCKS: &str = "STRATA_FETCH_BLOCKS";
/// The CPU join's round trip in the cost model, microseconds (a tuning knob).
pub const JOIN_ROUND_TRIP_US: &str = "STRATA_JOIN_ROUND_TRIP_US";
/// Tasks per thread of the CPU's expert rows (a tuning knob).
pub const EXPERT_TASKS: &str = "STRATA_EXPERT_TASKS";
/// Rows the CPU's expert rows prefetch ahead (a tuning knob).
pub const EXPERT_PREFETCH: &str = "STRATA_EXPERT_PREFETCH";
/// Experts the expert prefetch copies per layer at most (a tuning knob).
pub const PREFETCH_MAX: &str = "STRATA_PREFETCH_MAX";
/// The CPU's 512-bit Q4_K kernel, where the CPU has AVX-512BW (off by default).
pub const CPU_AVX512: &str = "STRATA_CPU_AVX512";
/// Per-launch timing.
pub const PROFILE_KERNELS: &str = "STRATA_PROFILE_KERNELS";
/// Kernels left out of decode graphs.
pub const SKIP_KERNELS: &str = "STRATA_SKIP_KERNELS";
/// Extra NVRTC options (kernel variants).
pub const KERNEL_DEFINES: &str = "STRATA_KERNEL_DEFINES";
/// One line per intermediate tensor.
pub const TRACE_TENSORS: &str = "STRATA_TRACE_TENSORS";
/// The serve worker panics after this many tokens of a request.
pub const WORKER_FAULT_AFTER_TOKENS: &str = "STRATA_WORKER_FAULT_AFTER_TOKENS";
/// The serve worker fails before loading its model.
pub const WORKER_FAULT_AT_LOAD: &str = "STRATA_WORKER_FAULT_AT_LOAD";

/// A folder searched first for `sim:PROFILE` device profiles.
pub const DEVICE_PROFILES: &str = "STRATA_DEVICE_PROFILES";

/// Every switch, in the order `strata switches` lists them.
pub const SWITCHES: &[Switch] = &[
    sw(
        DEVICE_PROFILES,
        "",
        "a folder searched first for sim:NAME device profiles (NAME.yaml); then ./scenarios/devices, then the built-in ones",
    ),
    sw(
        MODELS_DIR,
        "${XDG_CACHE_HOME:-~/.cache}/strata/models",
        "the model cache folder (fetched and generated models)",
    ),
    sw(
        KERNEL_CACHE,
        "${XDG_CACHE_HOME:-~/.cache}/strata/kernels",
        "the folder of compiled CUDA kernels, keyed by content hash, arch and driver",
    ),
    sw(
        CUDA_LIB_DIR,
        "",
        "a folder searched first for libcuda, libnvrtc and libcublas (after the loader path)",
    ),
    Switch {
        name: API_KEY,
        default: "",
        what: "strata serve's API key when --api-key is not given",
        secret: true,
    },
    sw(
        FAULT,
        "",
        "injected faults, comma-separated: prefill_gemm:m>64 (a prefill GEMM of more than 64 rows fails, seed 000), sticky:KERNEL@N (the N-th launch of KERNEL poisons the device, seed 003), trap:KERNEL@N (a real trap on CUDA), probe:unsynced (the CUDA link probe times copies it did not wait for)",
    ),
    sw(
        SYNC_LAUNCHES,
        "0",
        "1: synchronise after every CUDA kernel (every op of a sim: device) so a fault names its kernel, grid, block and launch number",
    ),
    sw(
        PDL,
        "1",
        "0: no programmatic dependent launch (sm_90 and later launch each kernel while the one before it ends)",
    ),
    sw(
        CUDA_GRAPHS,
        "1",
        "0: decode steps launch their kernels one by one instead of replaying a CUDA graph",
    ),
    sw(
        DEVICE_SLOT_TABLE,
        "1",
        "0: decode steps through the expert cache decide on the host, layer by layer (a round trip each), instead of on the device inside the CUDA graph",
    ),
    sw(
        FETCH_OVERLAP,
        "1",
        "0: on the device's slot table, a MoE layer's misses are copied in before any of its experts is computed, instead of on a second stream while the hits are computed",
    ),
    sw(
        CPU_JOIN,
        "1",
        "0: decode steps whose miss policy gives the CPU expert misses decide on the host, layer by layer, instead of on the device's slot table with the CPU answering inside the CUDA graph",
    ),
    sw(
        FETCH_BLOCKS,
        "264",
        "N (1-4096): blocks per matrix of expert_fetch, the kernel that copies an expert cache's misses in over the link (tuning)",
    ),
    sw(
        EXPERT_TASKS,
        "4",
        "N (1-64): tasks per thread in each pass of the CPU's expert rows (the misses the CPU computes at decode; tuning)",
    ),
    sw(
        EXPERT_PREFETCH,
        "2",
        "N (0-64): rows ahead of the one it computes that a task of the CPU's expert rows asks the cache for (0: none; tuning)",
    ),
    sw(
        PREFETCH_MAX,
        "2",
        "N (1-64): experts --expert-prefetch copies per MoE layer at most, the router's surest first (tuning)",
    ),
    sw(
        CPU_AVX512,
        "0",
        "1: the CPU's Q4_K dot products on 512-bit registers where the CPU has AVX-512BW (the same results; on the H200 machine's Xeon slower with all cores busy; for comparing speed)",
    ),
    sw(
        JOIN_ROUND_TRIP_US,
        "20",
        "N (0-1000): microseconds --miss-policy auto's cost model adds to the CPU's share of a layer-step when the CPU joins the device's slot table (the mapped memory's round trip: the GPU's request, the rows' read; tuning)",
    ),
    sw(
        PROFILE_KERNELS,
        "0",
        "1: time every kernel launch with CUDA events (strata bench prints the table)",
    ),
    sw(
        SKIP_KERNELS,
        "",
        "a,b: leave these kernels out of decode graphs (timing diagnostic: replayed steps compute wrong tokens)",
    ),
    sw(
        KERNEL_DEFINES,
        "",
        "extra NVRTC options compiling a kernel variant, e.g. -DMMV_MINB=3 (part of the kernel cache key)",
    ),
    sw(
        TRACE_TENSORS,
        "0",
        "1: print one line per intermediate tensor of every forward pass (named as llama.cpp's graph nodes)",
    ),
    sw(
        WORKER_FAULT_AFTER_TOKENS,
        "",
        "N: the serve worker panics after sending N tokens of a request (a test of the restart contract)",
    ),
    sw(
        WORKER_FAULT_AT_LOAD,
        "0",
        "1: the serve worker exits with an error before loading its model (a test of `strata serve` giving up \
         when its first worker cannot load)",
    ),
];

/// The raw value of `name` (one of [`SWITCHES`]).
fn raw(name: &str) -> Option<OsString> {
    debug_assert!(SWITCHES.iter().any(|s| s.name == name), "{name} is not in SWITCHES");
    std::env::var_os(name)
}

/// A boolean switch: off when set to `0`, `false`, `off` or `no` (any case), on when set to anything else;
/// `default` when unset or empty.
pub fn flag(name: &str, default: bool) -> bool {
    raw(name).map_or(default, |v| {
        let v = v.to_string_lossy().trim().to_ascii_lowercase();
        match v.as_str() {
            "" => default,
            "0" | "false" | "off" | "no" => false,
            _ => true,
        }
    })
}

/// A text switch; `None` when unset.
///
/// Errors: a value that is not UTF-8 (returned lossily converted, to be named in the caller's error).
pub fn text(name: &str) -> Option<Result<String, String>> {
    raw(name).map(|v| v.into_string().map_err(|v| v.to_string_lossy().into_owned()))
}

/// A text switch, `None` when unset or not UTF-8 (for switches whose bad value has no better meaning).
pub fn text_lossy(name: &str) -> Option<String> {
    raw(name).map(|v| v.to_string_lossy().into_owned())
}

/// A number switch within `range`; `None` when unset, and when set to anything else (said once on stderr, naming
/// the switch, the value and the range: the caller keeps its default).
pub fn usize_in(name: &str, range: std::ops::RangeInclusive<usize>) -> Option<usize> {
    let v = text_lossy(name)?;
    match v.trim().parse() {
        Ok(n) if range.contains(&n) => Some(n),
        _ => {
            eprintln!(
                "strata: {name}={v:?} is not a number from {} to {}: ignored",
                range.start(),
                range.end()
            );
            None
        }
    }
}

/// A folder switch; `None` when unset or empty.
pub fn path(name: &str) -> Option<PathBuf> {
    raw(name).filter(|v| !v.is_empty()).map(PathBuf::from)
}

/// The commit this binary was built from (`engine/build.rs`: `git describe`, `-dirty` when tracked files
/// differed), a build-time value rather than a switch.
pub const BUILD_REV: &str = env!("STRATA_BUILD_REV");

/// The `strata switches` table: each switch with its value in this process, its default and what it does.
pub fn table() -> String {
    let mut out = String::new();
    let width = SWITCHES.iter().map(|s| s.name.len()).max().unwrap_or(0);
    for s in SWITCHES {
        let value = match raw(s.name) {
            None => "(unset)".to_string(),
            Some(_) if s.secret => "(set)".to_string(),
            Some(v) => format!("{:?}", v.to_string_lossy()),
        };
        let default = if s.default.is_empty() { "unset" } else { s.default };
        out.push_str(&format!(
            "{:width$}  {value}\n{:width$}  default {default}: {}\n",
            s.name, "", s.what
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_switch_is_listed_once_with_a_description() {
        let mut names: Vec<_> = SWITCHES.iter().map(|s| s.name).collect();
        names.sort();
        names.dedup();
        assert_eq!(names.len(), SWITCHES.len());
        for s in SWITCHES {
            assert!(s.name.starts_with("STRATA_") && !s.what.is_empty(), "{s:?}");
        }
        let t = table();
        for s in SWITCHES {
            assert!(t.contains(s.name), "{t}");
        }
    }
}
