//! Every `STRATA_*` environment switch, read here and nowhere else.
//!
//! Flags are the user's everyday settings (`--device`, `--kv`, ...); switches are the few settings that must
//! reach code no flag reaches (the kernel loader, the panic hook of a worker started by the server), diagnostics
//! (`STRATA_SYNC_LAUNCHES`, `STRATA_TRACE_TENSORS`) and fault injection for bug replays (`STRATA_FAULT`,
//! DESIGN.md section 1). [`SWITCHES`] lists each with its default and what it does; `strata switches` prints
//! that table with the values this process sees.
//!
//! A boolean switch is off when set to `0`, `false`, `off` or `no`, on when set to `1`, `true`, `on` or `yes`
//! (any case), and at its default when unset or empty; any other value is said once on stderr and ignored.

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
    /// A speed switch: a faster path that computes the same thing, whose default depends on the hardware.
    pub speed: Option<Speed>,
}

const fn sw(name: &'static str, default: &'static str, what: &'static str) -> Switch {
    Switch {
        name,
        default,
        what,
        secret: false,
        speed: None,
    }
}

/// A speed switch of [`SWITCHES`] (seeds 001 and 003 print the original's: "gfx1151 (Strix Halo): 18 exact speed
/// switches on by default (STRATA_GFX1151_DEFAULTS=0 turns them off; a switch you set is kept)").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Speed {
    /// On and off give bit-identical logits, hence tokens, whatever the flags (checked by `scenarios/switches.yaml`
    /// on the CPU and `scenarios/h200-switches.yaml` on the H200: `same_logits_as`). A switch that is not exact
    /// computes within the backends' tolerance by another route: DEVICE_SLOT_TABLE and CPU_JOIN add the CPU's
    /// expert rows in another order when the CPU computes misses (`reports/2026-12-04-h200-switches.md`).
    pub exact: bool,
    /// The targets it changes anything on (PDL needs sm_90; the CPU's 512-bit kernel needs AVX-512BW).
    pub applies: Applies,
    /// Whether it is on by default where it applies, unless [`ARCH_DEFAULTS`] is off.
    pub on: bool,
}

/// The targets a speed switch changes anything on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Applies {
    /// Every CUDA device.
    Cuda,
    /// CUDA devices of compute capability 9.0 and later.
    CudaSm90,
    /// Every target, where the host CPU has AVX-512F and BW (a CUDA device's expert misses run on the CPU too).
    HostAvx512bw,
    /// Every target, where the host CPU has AVX-512 VNNI and AVX512VL.
    HostVnni,
    /// The CPU backend (the host's, or a `sim:` device's), where the host CPU has AVX2, FMA and F16C.
    CpuAvx2,
}

impl Applies {
    /// Whether `target` is one of them.
    pub fn to(self, target: &Target) -> bool {
        match self {
            Applies::Cuda => matches!(target, Target::Cuda { .. }),
            Applies::CudaSm90 => matches!(target, Target::Cuda { major, .. } if *major >= 9),
            Applies::HostAvx512bw => host_avx512bw(),
            Applies::HostVnni => host_vnni(),
            Applies::CpuAvx2 => matches!(target, Target::Cpu { .. }) && crate::quant::simd_available(),
        }
    }
}

const fn speed(
    name: &'static str,
    default: &'static str,
    exact: bool,
    applies: Applies,
    on: bool,
    what: &'static str,
) -> Switch {
    Switch {
        name,
        default,
        what,
        secret: false,
        speed: Some(Speed { exact, applies, on }),
    }
}

/// The hardware a speed switch's default is decided for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    /// A CUDA device of compute capability `major.minor`.
    Cuda { major: u32, minor: u32 },
    /// The CPU backend, named by the architecture it runs as: the host's (`x86_64`), or a `sim:` device's
    /// (`gfx1151`: its arithmetic runs on the CPU backend).
    Cpu { arch: String },
}

impl Target {
    /// The CPU backend on this host.
    pub fn host() -> Target {
        Target::Cpu {
            arch: std::env::consts::ARCH.to_string(),
        }
    }

    /// `sm_90`, `x86_64`, `gfx1151`.
    pub fn name(&self) -> String {
        match self {
            Target::Cuda { major, minor } => format!("sm_{major}{minor}"),
            Target::Cpu { arch } => arch.clone(),
        }
    }
}

/// The host CPU has AVX-512F and BW.
fn host_avx512bw() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512bw")
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

pub(crate) fn host_vnni() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        is_x86_feature_detected!("avx512vnni") && is_x86_feature_detected!("avx512vl")
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
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
/// The expert cache's slot table on the device for decode steps (of one token, and of several that fit it).
pub const DEVICE_SLOT_TABLE: &str = "STRATA_DEVICE_SLOT_TABLE";
/// Expert fetches of one-token decode steps on a second stream, beside the hits' compute.
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
/// The CPU's int8 dot products of 32-value blocks through AVX-512 VNNI's `vpdpbusd`, where the CPU has it.
pub const CPU_VNNI: &str = "STRATA_CPU_VNNI";
/// The CPU backend packs Q4_0, Q4_1 and Q8_0 matrices eight rows at a time at load (`quant::packed`).
pub const CPU_PACK: &str = "STRATA_CPU_PACK";
/// A CUDA step of several sequences attends over their decode tokens in one launch.
pub const BATCH_ATTENTION: &str = "STRATA_BATCH_ATTENTION";
/// A CUDA step of several tokens reads each expert's rows once per group of the tokens routed to it.
pub const MOE_GROUPS: &str = "STRATA_MOE_GROUPS";
/// CUDA Q4_K and Q6_K products of a few tokens on the integer tensor cores: dense matrices of 2 to 16 tokens
/// (`mmq_q4_k`, `mmq_q6_k`) and the experts of prompt steps of up to `STRATA_MMQ_PREFILL_TOKENS` (`mmq_moe_*`).
pub const MMQ: &str = "STRATA_MMQ";
/// CUDA prefill attention over an int8 (Q8_0) KV cache on the tensor cores.
pub const INT8_FLASH: &str = "STRATA_INT8_FLASH";
/// Most tokens of a CUDA step whose experts run on the device's routing (a tuning knob).
pub const MOE_DEVICE_TOKENS: &str = "STRATA_MOE_DEVICE_TOKENS";
/// Most cells of the longest decode span a CUDA step of several sequences attends over in one launch (a tuning knob).
pub const BATCH_SPLIT_CELLS: &str = "STRATA_BATCH_SPLIT_CELLS";
/// Fewest rows of a tile of the CUDA prefill GEMM (a tuning knob).
pub const GEMM_MIN_TILE: &str = "STRATA_GEMM_MIN_TILE";
/// Most tokens a CUDA dense matmul runs as matrix-vector products (a tuning knob).
pub const MMV_DENSE_TOKENS: &str = "STRATA_MMV_DENSE_TOKENS";
/// Most tokens of a CUDA prefill step whose experts run on the integer tensor cores (a tuning knob).
pub const MMQ_PREFILL_TOKENS: &str = "STRATA_MMQ_PREFILL_TOKENS";
/// Off: every speed switch the user did not set is off, whatever the arch's default.
pub const ARCH_DEFAULTS: &str = "STRATA_ARCH_DEFAULTS";
/// A digest of every step's logits in each `request` event (for `same_logits_as`).
pub const LOGITS_DIGEST: &str = "STRATA_LOGITS_DIGEST";
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
/// The serve worker waits before compiling each request's grammar.
pub const WORKER_GRAMMAR_DELAY_MS: &str = "STRATA_WORKER_GRAMMAR_DELAY_MS";

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
        speed: None,
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
    speed(
        PDL,
        "1 on sm_90 and later",
        true,
        Applies::CudaSm90,
        true,
        "0: no programmatic dependent launch (sm_90 and later launch each kernel while the one before it ends)",
    ),
    speed(
        CUDA_GRAPHS,
        "1 on CUDA",
        true,
        Applies::Cuda,
        true,
        "0: decode steps launch their kernels one by one instead of replaying a CUDA graph",
    ),
    speed(
        DEVICE_SLOT_TABLE,
        "1 on CUDA",
        false,
        Applies::Cuda,
        true,
        "0: decode steps through the expert cache decide on the host, layer by layer (a round trip each), instead of on the device (inside the CUDA graph for a step of one token)",
    ),
    speed(
        FETCH_OVERLAP,
        "1 on CUDA",
        true,
        Applies::Cuda,
        true,
        "0: on the device's slot table, a MoE layer's misses in a step of one token are copied in before any of its experts is computed (as in steps of several tokens), instead of on a second stream while the hits are computed",
    ),
    speed(
        CPU_JOIN,
        "1 on CUDA",
        false,
        Applies::Cuda,
        true,
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
    speed(
        CPU_AVX512,
        "0",
        true,
        Applies::HostAvx512bw,
        false,
        "1: the CPU's Q4_K dot products on 512-bit registers where the CPU has AVX-512BW (the same results; on the H200 machine's Xeon slower with all cores busy; for comparing speed)",
    ),
    speed(
        CPU_VNNI,
        "1 where the CPU has AVX-512 VNNI",
        true,
        Applies::HostVnni,
        true,
        "0: the CPU's int8 dot products of Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and IQ4_NL weights without AVX-512 VNNI's vpdpbusd (the same results; for comparing speed)",
    ),
    speed(
        CPU_PACK,
        "1 on the CPU where it has AVX2",
        false,
        Applies::CpuAvx2,
        true,
        "0: the CPU backend reads Q4_0, Q4_1 and Q8_0 matrices in the file's layout, a row at a time, instead of packing them eight rows at a time at load (another summation order: logits within float rounding, a token's bits the same alone and in any batch either way; packed, the float work per row and token is an eighth: on a 2-core AMD EPYC VM with SmolLM2 Q4_1, pp512 603-609 tok/s against 368-369 unpacked, tg64 232-237 against 186-192, 4 sequences decoding together 498-528 against 338-346)",
    ),
    speed(
        BATCH_ATTENTION,
        "1 on CUDA",
        false,
        Applies::Cuda,
        true,
        "0: a CUDA step of several sequences (strata serve's continuous batching) attends run by run, instead of over all its decode tokens in one attn_decode launch over each one's own cache (another summation order: logits within 1e-3 of the largest, the same greedy tokens in cuda_parity; 2.4x the tokens per second at 32 clients on the H200)",
    ),
    speed(
        MOE_GROUPS,
        "1 on CUDA",
        true,
        Applies::Cuda,
        true,
        "0: a CUDA step of 8 or more tokens whose experts run on the device's routing (up to STRATA_MOE_DEVICE_TOKENS) reads each expert's rows once per token routed to it, instead of once for up to 4 of them (the same results, bit for bit; on an H100, 30B shape, 32 sequences decoding together 1,818 tok/s grouped against 1,606, 8: 1,122 against 1,116)",
    ),
    speed(
        MMQ,
        "1 on CUDA",
        false,
        Applies::Cuda,
        true,
        "0: a CUDA dense Q4_K or Q6_K matrix times 2 to STRATA_MMV_DENSE_TOKENS tokens (a batch of decode steps, a short prompt) runs on dp4a, each weight row read once for 8 tokens (mmvt_*), and a prompt step of up to STRATA_MMQ_PREFILL_TOKENS (256) runs its Q4_K/Q6_K experts on the f16 GEMM, instead of both on the integer tensor cores, one mma per sub-block of the type's scales for 16 rows and 8 tokens (mmq_*, mmq_moe_*: the same Q8_K integer products as the CPU's with another order of float sums, logits within float rounding of dp4a's; the f16 GEMM sits further from the CPU, about 1.4e-2 relative on the experts; a token's bits are the same in any step of 2 or more tokens either way; --batch-invariant keeps mmvt)",
    ),
    speed(
        INT8_FLASH,
        "1 on CUDA",
        false,
        Applies::Cuda,
        true,
        "0: CUDA prefill attention over an int8 (Q8_0) KV cache runs through a score matrix in f32, instead of on the tensor cores as the f16 cache's does with its keys and values dequantized to f16 tiles (there queries and probabilities are rounded to f16, which the CPU keeps in f32 against an int8 cache: output within 4.4e-4 relative error of the CPU's, mean KLD 2.6e-5 on the tiny MoE in cuda_parity; an 8,192-token prompt 7,439 tok/s through strata serve on the H200, against 298)",
    ),
    sw(
        MMV_DENSE_TOKENS,
        "64 while STRATA_MMQ is on, else 16",
        "N (4-512): most tokens a CUDA dense matmul runs as matrix-vector products (Q4_K and Q6_K rows read once for 8 tokens, on the integer tensor cores or with STRATA_MMQ=0 on dp4a), instead of an f16 copy of the matrix and cuBLAS (tuning; on an H100, 30B shape, mmq at 512 against 16: pp32 +17%, pp64 +7%, 32 sequences decoding together +12%, pp128 the same, pp256 -9%, pp512 -16%; dp4a: 16 sequences 1,340 tok/s at 16 against 1,234 at 8, 32 sequences 1,529 at 32 against 1,627 at 8)",
    ),
    sw(
        MMQ_PREFILL_TOKENS,
        "256",
        "N (1-256): most tokens of a CUDA prefill step (a prompt chunk with any decode tokens beside it) whose Q4_K/Q6_K experts run on the integer tensor cores (mmq_moe_*: tiles of up to 8 of an expert's tokens, Q8_K activations) instead of the f16 GEMM; off with STRATA_MMQ=0 or --batch-invariant (tuning)",
    ),
    sw(
        GEMM_MIN_TILE,
        "32",
        "32, 64 or 128: fewest rows of a tile of the CUDA prefill GEMM (our tensor-core kernel: the experts, and dense matrices where cuBLAS failed); each block computes its tile of an expert's tokens at the smallest of the three heights that holds its rows and is at least this, where 128 spent most of its matrix products and fragment loads on absent rows when an expert has few tokens (the same results, bit for bit; 128: every tile at 128, as before; tuning)",
    ),
    sw(
        BATCH_SPLIT_CELLS,
        "never",
        "N or never: a CUDA step of several sequences (strata serve's batches) whose longest decode span is over N cells attends split over the keys (flash-decoding: a block per KV head's GQA group, token and split, each key row read once for the group, as few splits as give every SM two blocks) instead of in one attn_decode launch (a block per query head and token over all its keys); 0: always split (tuning; another summation order, logits within 1e-3 of the largest; on the H200 with 64-cell splits, 32 sequences at depth 4,096 decoded at 576 tok/s against 803 in one launch)",
    ),
    sw(
        MOE_DEVICE_TOKENS,
        "64",
        "N (1-64): most tokens of a CUDA step of several sequences (strata serve's batches) without an expert cache whose experts run on the device's routing (the decode kernels, no read-back); larger steps read the routing back and run the experts as prefill does, and so does a step of one sequence past 4 tokens (tuning; 8 sequences decoding together: 900 tok/s at 64 against 450 at 4 on the H200)",
    ),
    sw(
        JOIN_ROUND_TRIP_US,
        "20",
        "N (0-1000): microseconds --miss-policy auto's cost model adds to the CPU's share of a layer-step when the CPU joins the device's slot table (the mapped memory's round trip: the GPU's request, the rows' read; tuning)",
    ),
    sw(
        ARCH_DEFAULTS,
        "1",
        "0: every speed switch you did not set is off, whatever this device's defaults (the start line lists them; a bisection of a wrong answer starts here)",
    ),
    sw(
        LOGITS_DIGEST,
        "0",
        "1: each request event carries an FNV-1a digest of every step's logits (their f32 bits; decode reads whole logits back, not the best candidates), so two runs can be shown bit-identical (the harness's same_logits_as sets it)",
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
         when its first worker cannot load); hang: it never loads (a test of --load-timeout-s)",
    ),
    sw(
        WORKER_GRAMMAR_DELAY_MS,
        "0",
        "N: the serve worker waits N ms before compiling each request's grammar (a test that a slow compile never \
         stalls the other requests' steps)",
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
    read_flag(name, &env_text).unwrap_or(default)
}

/// Whether speed switch `name` (one of [`SWITCHES`] with [`Switch::speed`]) is on for `target`: off where it does
/// not apply; else the user's value when set (as [`flag`] reads it); else off when [`ARCH_DEFAULTS`] is off; else the
/// switch's default.
pub fn speed_on(name: &str, target: &Target) -> bool {
    speed_on_in(name, target, &env_text)
}

/// [`speed_on`] with the environment `env` (a switch's value, `None` when unset).
fn speed_on_in(name: &str, target: &Target, env: &dyn Fn(&str) -> Option<String>) -> bool {
    let Some(sp) = SWITCHES.iter().find(|s| s.name == name).and_then(|s| s.speed) else {
        debug_assert!(false, "{name} is not a speed switch of SWITCHES");
        return false;
    };
    if !sp.applies.to(target) {
        return false;
    }
    match read_flag(name, env) {
        Some(user) => user,
        None => read_flag(ARCH_DEFAULTS, env).unwrap_or(true) && sp.on,
    }
}

/// The process environment's value of `name`, lossily as text.
fn env_text(name: &str) -> Option<String> {
    text_lossy(name)
}

/// A boolean switch's value: `Ok(None)` when unset or empty; off for `0`, `false`, `off`, `no`; on for `1`,
/// `true`, `on`, `yes` (any case). Errors: any other value.
fn parse_flag(v: Option<&str>) -> Result<Option<bool>, ()> {
    let Some(v) = v else { return Ok(None) };
    match v.trim().to_ascii_lowercase().as_str() {
        "" => Ok(None),
        "0" | "false" | "off" | "no" => Ok(Some(false)),
        "1" | "true" | "on" | "yes" => Ok(Some(true)),
        _ => Err(()),
    }
}

/// Boolean switch `name` in `env`; a value [`parse_flag`] refuses is said once on stderr, naming the switch and
/// the value, and counts as unset.
fn read_flag(name: &str, env: &dyn Fn(&str) -> Option<String>) -> Option<bool> {
    let v = env(name);
    parse_flag(v.as_deref()).unwrap_or_else(|()| {
        static SAID: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());
        let mut said = SAID.lock().unwrap_or_else(|p| p.into_inner());
        if !said.iter().any(|n| n == name) {
            said.push(name.to_string());
            eprintln!(
                "strata: {name}={:?} is not 0/1, false/true, off/on or no/yes: ignored (its default holds)",
                v.unwrap_or_default()
            );
        }
        None
    })
}

/// The speed switches as they stand for one target: the start line every engine prints ([`SpeedReport`]'s
/// Display).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SpeedReport {
    /// [`Target::name`].
    pub target: String,
    /// Short names (`PDL` for `STRATA_PDL`) of the switches that apply, with their state.
    pub on_exact: Vec<String>,
    pub on_inexact: Vec<String>,
    pub off: Vec<String>,
    /// Switches the user set, as `NAME=value`.
    pub set: Vec<String>,
    /// Whether [`ARCH_DEFAULTS`] left the defaults on.
    pub defaults: bool,
    /// Switches the user set that do not apply to the target (`PDL=1` on the CPU), as `NAME=value`.
    pub unapplied: Vec<String>,
}

/// `PDL` for `STRATA_PDL`.
pub fn short_name(name: &str) -> &str {
    name.strip_prefix("STRATA_").unwrap_or(name)
}

impl SpeedReport {
    /// The speed switches that apply to `target`, as [`speed_on`] decides them.
    pub fn of(target: &Target) -> SpeedReport {
        Self::of_in(target, &env_text)
    }

    /// [`SpeedReport::of`] with the environment `env`.
    fn of_in(target: &Target, env: &dyn Fn(&str) -> Option<String>) -> SpeedReport {
        let mut r = SpeedReport {
            target: target.name(),
            on_exact: vec![],
            on_inexact: vec![],
            off: vec![],
            set: vec![],
            defaults: read_flag(ARCH_DEFAULTS, env).unwrap_or(true),
            unapplied: vec![],
        };
        for s in SWITCHES {
            let Some(sp) = s.speed else { continue };
            let short = short_name(s.name).to_string();
            // Read as the engine reads it (a value that is no boolean is said once), applying here or not.
            let set = read_flag(s.name, env).and(env(s.name));
            if !sp.applies.to(target) {
                if let Some(v) = set {
                    r.unapplied.push(format!("{short}={}", v.trim()));
                }
                continue;
            }
            if let Some(v) = set {
                r.set.push(format!("{short}={}", v.trim()));
            }
            match (speed_on_in(s.name, target, env), sp.exact) {
                (true, true) => r.on_exact.push(short),
                (true, false) => r.on_inexact.push(short),
                (false, _) => r.off.push(short),
            }
        }
        r
    }
}

impl std::fmt::Display for SpeedReport {
    /// `sm_90: 3 exact speed switches on (STRATA_ARCH_DEFAULTS=0 turns the defaults off; a switch you set is kept):
    /// PDL CUDA_GRAPHS FETCH_OVERLAP; on, not exact: DEVICE_SLOT_TABLE CPU_JOIN; off: CPU_AVX512`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let list = |v: &[String]| if v.is_empty() { "none".to_string() } else { v.join(" ") };
        write!(
            f,
            "{}: {} exact speed switch{} on ({}; a switch you set is kept): {}",
            self.target,
            self.on_exact.len(),
            if self.on_exact.len() == 1 { "" } else { "es" },
            if self.defaults {
                format!("{ARCH_DEFAULTS}=0 turns the defaults off")
            } else {
                format!("{ARCH_DEFAULTS}=0: the defaults are off")
            },
            list(&self.on_exact)
        )?;
        if !self.on_inexact.is_empty() {
            write!(f, "; on, not exact: {}", list(&self.on_inexact))?;
        }
        if !self.off.is_empty() {
            write!(f, "; off: {}", list(&self.off))?;
        }
        if !self.set.is_empty() {
            write!(f, "; set by you: {}", self.set.join(" "))?;
        }
        if !self.unapplied.is_empty() {
            write!(f, "; set by you, no effect here: {}", self.unapplied.join(" "))?;
        }
        Ok(())
    }
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
        let default = match (s.default.is_empty(), s.speed) {
            (true, _) => "unset".to_string(),
            (false, None) => s.default.to_string(),
            (false, Some(sp)) => format!(
                "{} (a speed switch, {})",
                s.default,
                if sp.exact { "exact" } else { "not exact" }
            ),
        };
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

    fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let m: std::collections::HashMap<String, String> =
            pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        move |k| m.get(k).cloned()
    }

    const H200: Target = Target::Cuda { major: 9, minor: 0 };
    const A100: Target = Target::Cuda { major: 8, minor: 0 };

    #[test]
    fn speed_switches_follow_the_arch_then_the_master_switch_then_the_user() {
        let none = env(&[]);
        assert!(speed_on_in(PDL, &H200, &none));
        assert!(!speed_on_in(PDL, &A100, &none), "no PDL before sm_90");
        assert!(speed_on_in(CUDA_GRAPHS, &A100, &none));
        let cpu = Target::Cpu { arch: "gfx1151".into() };
        assert!(
            !speed_on_in(CUDA_GRAPHS, &cpu, &none),
            "a CUDA switch does nothing on the CPU backend"
        );
        assert!(!speed_on_in(CPU_AVX512, &cpu, &none), "off by default");
        let off = env(&[(ARCH_DEFAULTS, "0")]);
        assert!(!speed_on_in(PDL, &H200, &off) && !speed_on_in(CUDA_GRAPHS, &H200, &off));
        // A switch the user set is kept, either way, whatever the master switch says.
        let kept = env(&[(ARCH_DEFAULTS, "off"), (CUDA_GRAPHS, "yes"), (PDL, " ")]);
        assert!(speed_on_in(CUDA_GRAPHS, &H200, &kept));
        assert!(
            !speed_on_in(PDL, &H200, &kept),
            "an empty value is unset: the master switch decides"
        );
        let user_off = env(&[(FETCH_OVERLAP, "no")]);
        assert!(!speed_on_in(FETCH_OVERLAP, &H200, &user_off) && speed_on_in(PDL, &H200, &user_off));
        // Set on where it does not apply: still off.
        assert!(!speed_on_in(PDL, &A100, &env(&[(PDL, "1")])));
        // A value that is no boolean is ignored (said once): the default holds, either way.
        assert!(!speed_on_in(CPU_AVX512, &H200, &env(&[(CPU_AVX512, "disabled")])));
        assert!(speed_on_in(PDL, &H200, &env(&[(PDL, "nope")])));
        assert!(speed_on_in(PDL, &H200, &env(&[(ARCH_DEFAULTS, "garbage")])));
    }

    #[test]
    fn the_start_line_names_every_switch_that_applies_once() {
        let r = SpeedReport::of_in(&H200, &env(&[(CUDA_GRAPHS, "0")]));
        let line = r.to_string();
        // CPU_VNNI is on where this host's CPU has AVX-512 VNNI (a CUDA device's misses run on the host's CPU).
        let mut want = vec!["PDL", "FETCH_OVERLAP"];
        if host_vnni() {
            want.push("CPU_VNNI");
        }
        want.push("MOE_GROUPS");
        assert!(
            line.starts_with(&format!(
                "sm_90: {} exact speed switches on (STRATA_ARCH_DEFAULTS=0 turns the defaults off",
                want.len()
            )),
            "{line}"
        );
        assert_eq!(r.on_exact, want);
        assert_eq!(
            r.on_inexact,
            ["DEVICE_SLOT_TABLE", "CPU_JOIN", "BATCH_ATTENTION", "MMQ", "INT8_FLASH"]
        );
        assert!(r.off.contains(&"CUDA_GRAPHS".to_string()), "{line}");
        assert_eq!(r.set, ["CUDA_GRAPHS=0"]);
        assert!(line.ends_with("; set by you: CUDA_GRAPHS=0"), "{line}");
        let cpu = SpeedReport::of_in(&Target::Cpu { arch: "x86_64".into() }, &env(&[(PDL, "1")]));
        assert!(
            cpu.to_string().ends_with("; set by you, no effect here: PDL=1"),
            "{cpu}"
        );
        let cpu = SpeedReport::of_in(&Target::Cpu { arch: "x86_64".into() }, &env(&[(ARCH_DEFAULTS, "0")]));
        assert!(cpu.on_exact.is_empty() && cpu.on_inexact.is_empty(), "{cpu}");
        assert!(
            cpu.to_string()
                .starts_with("x86_64: 0 exact speed switches on (STRATA_ARCH_DEFAULTS=0: the defaults are off"),
            "{cpu}"
        );
    }
}
