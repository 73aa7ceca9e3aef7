//! One CUDA device: its context and stream, the kernels of `kernels/` compiled by NVRTC for its arch (cached on
//! disk), and checked launches.
//!
//! Kernel cache: the PTX of the whole program is written to `<cache>/strata/kernels/strata-HASH-sm_XY-drvN.ptx`,
//! where HASH is FNV-1a 64 of the sources and options, XY the compute capability and N the driver version, so a
//! second start compiles nothing. `STRATA_KERNEL_CACHE` overrides the folder.
//!
//! Launch checking (seed 003): every launch's return code is checked; with `STRATA_SYNC_LAUNCHES=1` the stream is
//! synchronised after each launch, so an asynchronous fault surfaces at the kernel that caused it. A failure
//! writes a `fault` event naming the kernel, grid, block and call number.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use cudarc::driver::{CudaContext, CudaEvent, CudaFunction, CudaStream, LaunchConfig, PushKernelArg};

use crate::events::{self, EventKind, Fallback, Fault, Launch};
use crate::device::cuda_libs;
use crate::backend::StepKey;
use crate::state::kv::SeqSlot;
use crate::switches;

/// The kernel sources, in compile order: the headers, then every `.cu` file of `kernels/`.
pub const KERNEL_SOURCES: &[(&str, &str)] = &[
    ("common.cuh", include_str!("../../../../kernels/common.cuh")),
    ("quant.cuh", include_str!("../../../../kernels/quant.cuh")),
    ("matvec.cu", include_str!("../../../../kernels/matvec.cu")),
    ("elementwise.cu", include_str!("../../../../kernels/elementwise.cu")),
    ("attention.cu", include_str!("../../../../kernels/attention.cu")),
    ("gemm.cu", include_str!("../../../../kernels/gemm.cu")),
    ("sampling.cu", include_str!("../../../../kernels/sampling.cu")),
];

/// Every kernel the backend launches (each must exist in the compiled module).
pub const KERNEL_NAMES: &[&str] = &[
    "top_logits_part",
    "top_logits_final",
    "mmv_f32",
    "mmv_f16",
    "mmv_bf16",
    "mmv_q4_0",
    "mmv_q4_1",
    "mmv_q5_0",
    "mmv_q5_1",
    "mmv_q8_0",
    "mmv_q2_k",
    "mmv_q3_k",
    "mmv_q4_k",
    "mmv_q5_k",
    "mmv_q6_k",
    "mmv_moe_f32",
    "mmv_moe_f16",
    "mmv_moe_bf16",
    "mmv_moe_q4_0",
    "mmv_moe_q4_1",
    "mmv_moe_q5_0",
    "mmv_moe_q5_1",
    "mmv_moe_q8_0",
    "mmv_moe_q2_k",
    "mmv_moe_q3_k",
    "mmv_moe_q4_k",
    "mmv_moe_q5_k",
    "mmv_moe_q6_k",
    "get_rows_f32",
    "get_rows_f16",
    "get_rows_bf16",
    "get_rows_q4_0",
    "get_rows_q4_1",
    "get_rows_q5_0",
    "get_rows_q5_1",
    "get_rows_q8_0",
    "get_rows_q2_k",
    "get_rows_q3_k",
    "get_rows_q4_k",
    "get_rows_q5_k",
    "get_rows_q6_k",
    "dq_f16_f32",
    "dq_f16_f16",
    "dq_f16_bf16",
    "dq_f16_q4_0",
    "dq_f16_q4_1",
    "dq_f16_q5_0",
    "dq_f16_q5_1",
    "dq_f16_q8_0",
    "dq_f16_q2_k",
    "dq_f16_q3_k",
    "dq_f16_q4_k",
    "dq_f16_q5_k",
    "dq_f16_q6_k",
    "gemm_f32",
    "gemm_f16",
    "gemm_bf16",
    "gemm_q4_0",
    "gemm_q4_1",
    "gemm_q5_0",
    "gemm_q5_1",
    "gemm_q8_0",
    "gemm_q2_k",
    "gemm_q3_k",
    "gemm_q4_k",
    "gemm_q5_k",
    "gemm_q6_k",
    "f32_to_f16",
    "rms_norm",
    "rope",
    "scale_f32",
    "add_f32",
    "glu",
    "kv_store_f16",
    "kv_store2_f16",
    "kv_store_q8_0",
    "copy_f32",
    "copy_f32x4",
    "mmv_wide_f32",
    "router_route",
    "mmv1_q4_k",
    "mmv1_q6_k",
    "add_rms_norm",
    "moe_combine_add_rms_norm",
    "qk_norm_rope",
    "moe_route",
    "moe_combine",
    "attn_decode",
    "attn_split_scores",
    "attn_split_exp",
    "attn_split_pv",
    "attn_prefill_f16",
    "attn_scores",
    "attn_softmax",
    "attn_pv",
    "sum_splits",
];

/// Why a CUDA operation failed.
#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    #[error(transparent)]
    Unavailable(#[from] cuda_libs::Unavailable),
    #[error("CUDA {what}: {source}")]
    Driver {
        what: String,
        source: cudarc::driver::DriverError,
    },
    #[error("NVRTC could not compile the kernels for {arch}: {log}")]
    Compile { arch: String, log: String },
    #[error("kernel {kernel} (grid {grid:?}, block {block:?}, launch #{call}) failed: {error}")]
    Launch {
        kernel: String,
        grid: (u32, u32, u32),
        block: (u32, u32, u32),
        call: u64,
        error: String,
    },
    #[error("no CUDA device {ordinal}: this machine has {count}")]
    NoSuchDevice { ordinal: usize, count: usize },
    #[error("cannot allocate {bytes} bytes on the device ({free} free): {source}")]
    Alloc {
        bytes: usize,
        free: usize,
        source: cudarc::driver::DriverError,
    },
}

impl CudaError {
    pub(crate) fn driver(what: impl Into<String>) -> impl FnOnce(cudarc::driver::DriverError) -> CudaError {
        let what = what.into();
        move |source| CudaError::Driver { what, source }
    }
}

/// One kernel argument (every kernel takes device pointers and scalars only).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Arg {
    /// A device pointer.
    P(u64),
    I(i32),
    L(i64),
    F(f32),
}

/// How the kernels were obtained at start.
#[derive(Debug, Clone)]
pub struct CompileReport {
    /// `sm_90`.
    pub arch: String,
    /// Read from the disk cache (no NVRTC call).
    pub cached: bool,
    /// NVRTC (or the cache read) plus the module load, in ms.
    pub ms: f64,
    pub path: PathBuf,
}

/// The folder of the kernel cache ([`crate::paths::kernel_cache_dir`]).
pub fn kernel_cache_dir() -> PathBuf {
    crate::paths::kernel_cache_dir()
}

/// The whole program NVRTC compiles: every source of [`KERNEL_SOURCES`] in order.
pub fn program_source() -> String {
    let mut s = String::new();
    for (name, text) in KERNEL_SOURCES {
        s.push_str(&format!("// ---- kernels/{name}\n"));
        s.push_str(text);
        s.push('\n');
    }
    s
}

/// NVRTC's options: C++17, device functions by default, and the words of `STRATA_KERNEL_DEFINES` (a tuning
/// diagnostic: `-DMMV_MINB=3` compiles a variant of the kernels; part of the cache key like the rest).
fn nvrtc_options() -> Vec<String> {
    let mut o: Vec<String> = vec!["--std=c++17".into(), "-default-device".into()];
    if let Some(extra) = switches::text_lossy(switches::KERNEL_DEFINES) {
        o.extend(extra.split_whitespace().map(str::to_string));
    }
    o
}

/// FNV-1a 64 of the program and options: the cache key's content part.
fn content_hash(src: &str, opts: &[String]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in src.bytes().chain(opts.iter().flat_map(|o| o.bytes())) {
        h ^= b as u64;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// Compiles the program for `arch` (`sm_90`) with NVRTC; needs no driver.
///
/// Errors: NVRTC missing, or a compile error (the log names the file and line).
pub fn compile_ptx(arch: &'static str) -> Result<String, CudaError> {
    let src = program_source();
    let opts = cudarc::nvrtc::CompileOptions {
        arch: Some(arch),
        options: nvrtc_options(),
        ..Default::default()
    };
    let ptx = cudarc::nvrtc::compile_ptx_with_opts(&src, opts).map_err(|e| CudaError::Compile {
        arch: arch.to_string(),
        log: format!("{e:?}"),
    })?;
    Ok(ptx.to_src())
}

/// NVRTC arch names are `&'static str`; these are the ones we compile for.
pub fn arch_name(major: i32, minor: i32) -> &'static str {
    match (major, minor) {
        (7, 0) => "sm_70",
        (7, 5) => "sm_75",
        (8, 0) => "sm_80",
        (8, 6) => "sm_86",
        (8, 7) => "sm_87",
        (8, 9) => "sm_89",
        (9, 0) => "sm_90",
        (10, 0) => "sm_100",
        (12, 0) => "sm_120",
        (m, _) if m >= 12 => "sm_120",
        (m, _) if m >= 10 => "sm_100",
        _ => "sm_80",
    }
}

/// The driver's version (`13000` for 13.0).
pub fn driver_version() -> Result<i32, CudaError> {
    let mut v = 0;
    // SAFETY: the driver library was loaded by `cuda_libs::load`; the call writes one int.
    unsafe { cudarc::driver::sys::cuDriverGetVersion(&mut v) }
        .result()
        .map_err(CudaError::driver("cuDriverGetVersion"))?;
    Ok(v)
}

/// NVRTC's version as (major, minor): the CUDA runtime the kernels are compiled with.
pub fn nvrtc_version() -> Option<(i32, i32)> {
    let (mut a, mut b) = (0, 0);
    // SAFETY: NVRTC was loaded by `loader`; the call writes two ints.
    let r = unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut a, &mut b) };
    (r == cudarc::nvrtc::sys::nvrtcResult::NVRTC_SUCCESS).then_some((a, b))
}

/// Number of CUDA devices.
///
/// Errors: no driver, or the driver fails to initialise (no device, driver/library mismatch).
pub fn device_count() -> Result<usize, CudaError> {
    Ok(cuda_libs::device_count()?)
}

/// An open device with the kernels loaded.
pub struct Gpu {
    pub ctx: Arc<CudaContext>,
    pub stream: Arc<CudaStream>,
    funcs: HashMap<&'static str, CudaFunction>,
    calls: AtomicU64,
    sync_launches: bool,
    /// Kernels are launched with programmatic dependent launch (sm_90 and later, unless `STRATA_PDL=0`): each may
    /// start while the one before it finishes, and waits in `pdl_enter()` (kernels/common.cuh) for its writes.
    pdl: bool,
    /// `STRATA_SKIP_KERNELS=a,b`: kernels left out of the decode-step graphs (a timing diagnostic, METHOD.md's
    /// "leave one stage out": a replayed step's time without them; the recording step runs them, so every buffer
    /// holds values of the right kind, but replayed steps compute wrong tokens). Empty unless set.
    skip: Vec<String>,
    /// `STRATA_PROFILE_KERNELS=1`: every launch between two timing events (see [`Gpu::kernel_profile`]).
    profile: Mutex<Profile>,
    profiling: std::sync::atomic::AtomicBool,
    /// Decode steps as CUDA graphs (see [`Gpu::step_begin`]).
    graphs: Mutex<Graphs>,
    pub compile: CompileReport,
    pub ordinal: usize,
    /// Streaming multiprocessors (launch sizing).
    pub sms: usize,
}

impl Gpu {
    /// Opens device `ordinal`, compiling (or reading from the cache) and loading every kernel.
    ///
    /// Errors: no driver or NVRTC, no such device, a compile or module-load failure.
    pub fn open(ordinal: usize) -> Result<Gpu, CudaError> {
        let count = device_count()?;
        if ordinal >= count {
            return Err(CudaError::NoSuchDevice { ordinal, count });
        }
        let ctx = CudaContext::new(ordinal).map_err(CudaError::driver("context creation"))?;
        // One stream, and buffers whose order we keep ourselves: cudarc's per-buffer events are not needed.
        // SAFETY: every buffer of this backend is used on `stream` alone.
        unsafe { ctx.disable_event_tracking() };
        // A stream of our own: the legacy default stream cannot be captured into a CUDA graph.
        let stream = ctx.new_stream().map_err(CudaError::driver("stream creation"))?;
        let (major, minor) = ctx
            .compute_capability()
            .map_err(CudaError::driver("compute capability"))?;
        let arch = arch_name(major, minor);
        let sms = ctx
            .attribute(cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(CudaError::driver("multiprocessor count"))? as usize;
        let start = Instant::now();
        let src = program_source();
        let key = content_hash(&src, &nvrtc_options());
        let drv = driver_version()?;
        let dir = kernel_cache_dir();
        let path = dir.join(format!("strata-{key:016x}-sm_{major}{minor}-drv{drv}.ptx"));
        let (ptx, cached) = match std::fs::read_to_string(&path) {
            Ok(p) => (p, true),
            Err(_) => {
                let p = compile_ptx(arch)?;
                // A cache that cannot be written only costs the next start a compile.
                let _ = std::fs::create_dir_all(&dir);
                let tmp = path.with_extension(format!("tmp{}", std::process::id()));
                if std::fs::write(&tmp, &p).is_ok() {
                    let _ = std::fs::rename(&tmp, &path);
                }
                (p, false)
            }
        };
        let module = ctx
            .load_module(cudarc::nvrtc::Ptx::from_src(ptx))
            .map_err(CudaError::driver("loading the kernel module"))?;
        let mut funcs = HashMap::new();
        for name in KERNEL_NAMES {
            let f = module
                .load_function(name)
                .map_err(CudaError::driver(format!("kernel {name}")))?;
            funcs.insert(*name, f);
        }
        let compile = CompileReport {
            arch: arch.to_string(),
            cached,
            ms: start.elapsed().as_secs_f64() * 1e3,
            path,
        };
        Ok(Gpu {
            ctx,
            stream,
            funcs,
            calls: AtomicU64::new(0),
            sync_launches: switches::flag(switches::SYNC_LAUNCHES, false),
            pdl: major >= 9 && switches::flag(switches::PDL, true),
            skip: switches::text_lossy(switches::SKIP_KERNELS)
                .map(|v| v.split(',').filter(|k| !k.is_empty()).map(str::to_string).collect())
                .unwrap_or_default(),
            profile: Mutex::new(Profile::default()),
            graphs: Mutex::new(Graphs {
                enabled: switches::flag(switches::CUDA_GRAPHS, true),
                ..Graphs::default()
            }),
            profiling: switches::flag(switches::PROFILE_KERNELS, false).into(),
            compile,
            ordinal,
            sms,
        })
    }

    /// Launches `kernel` on the stream and checks the result; with `STRATA_SYNC_LAUNCHES=1` also waits for it.
    ///
    /// Errors: the launch or (in sync mode) the kernel failed; a `fault` event was written.
    pub fn launch(
        &self,
        kernel: &'static str,
        grid: (u32, u32, u32),
        block: (u32, u32, u32),
        args: &[Arg],
    ) -> Result<(), CudaError> {
        {
            let mut gs = self.graphs.lock().unwrap_or_else(|e| e.into_inner());
            let gs = &mut *gs;
            match &mut gs.mode {
                StepMode::Eager => {}
                StepMode::Record { launches, .. } => launches.push(LaunchRec {
                    kernel,
                    grid,
                    block,
                    args: args.to_vec(),
                }),
                StepMode::Replay { key, next, diverged } if !*diverged => {
                    let recs = &gs.graphs.get(key).expect("replaying a stored graph").launches;
                    if recs.get(*next).is_some_and(|r| r.is(kernel, grid, block, args)) {
                        *next += 1;
                        return Ok(());
                    }
                    // The step left the recorded sequence: run what was skipped, then go on eagerly.
                    *diverged = true;
                    for r in &recs[..*next] {
                        self.raw_launch(r.kernel, r.grid, r.block, &r.args)?;
                    }
                }
                StepMode::Replay { .. } => {}
            }
        }
        self.raw_launch(kernel, grid, block, args)
    }

    /// Marks the start of a forward step with shape `key` (tokens and logits wanted). With graphs on, a decode
    /// step (`graphable`) is recorded the first time (run eagerly, then captured into a CUDA graph at
    /// [`Gpu::step_end`]) and replayed after: each launch is compared with the recorded one and skipped, and the
    /// graph runs at the step's end. A launch that differs (a grown buffer, another shape) makes the step run
    /// eagerly from there, and the graph is recorded anew. Off with `STRATA_CUDA_GRAPHS=0`, in sync-launch and
    /// profile modes.
    pub fn step_begin(&self, key: StepKey, graphable: bool) {
        let mut gs = self.graphs.lock().unwrap_or_else(|e| e.into_inner());
        let on = graphable && gs.enabled && !self.sync_launches && !self.profiling.load(Ordering::Relaxed);
        gs.mode = match (on, gs.graphs.contains_key(&key)) {
            (false, _) => StepMode::Eager,
            (true, true) => StepMode::Replay {
                key,
                next: 0,
                diverged: false,
            },
            (true, false) => StepMode::Record {
                key,
                launches: Vec::new(),
            },
        };
    }

    /// Ends the step begun by [`Gpu::step_begin`]: captures a recorded step into a graph, or launches the graph
    /// of a replayed one.
    ///
    /// Errors: a launch failed (a `fault` event was written); a failed capture only turns graphs off.
    pub fn step_end(&self) -> Result<(), CudaError> {
        let mut gs = self.graphs.lock().unwrap_or_else(|e| e.into_inner());
        match std::mem::replace(&mut gs.mode, StepMode::Eager) {
            StepMode::Eager => Ok(()),
            StepMode::Record { key, launches } => {
                match self.capture(&launches) {
                    Ok(graph) => {
                        gs.captures += 1;
                        gs.graphs.insert(
                            key,
                            Recorded {
                                launches,
                                graph,
                                verified_at: None,
                            },
                        );
                    }
                    Err(e) => {
                        gs.enabled = false;
                        events::emit(EventKind::Fallback(Fallback {
                            op: "decode_step".into(),
                            from: "cuda_graph".into(),
                            to: "launches".into(),
                            why: format!("CUDA graph capture failed: {e}"),
                            shape: None,
                            max_rows: None,
                        }));
                    }
                }
                Ok(())
            }
            StepMode::Replay { key, next, diverged } => {
                let gs = &mut *gs;
                let rec = gs.graphs.get_mut(&key).expect("replaying a stored graph");
                if !diverged && next == rec.launches.len() {
                    gs.replays += 1;
                    rec.verified_at = Some(super::store::allocations());
                    return rec.graph.0.launch().map_err(CudaError::driver("CUDA graph launch"));
                }
                if !diverged {
                    // The step stopped short of the recording: run the part it skipped.
                    for r in &rec.launches[..next] {
                        self.raw_launch(r.kernel, r.grid, r.block, &r.args)?;
                    }
                }
                gs.graphs.remove(&key);
                Ok(())
            }
        }
    }

    /// Host data crosses in the middle of a step (a download, or an upload of something the host computed):
    /// such a step is not a graph. A replayed step runs the launches it skipped so far and finishes eagerly (its
    /// graph is dropped at the end); a recorded step stops recording, so it is never captured.
    pub fn flush_step(&self) -> Result<(), CudaError> {
        let mut gs = self.graphs.lock().unwrap_or_else(|e| e.into_inner());
        let gs = &mut *gs;
        match &mut gs.mode {
            StepMode::Replay { key, next, diverged } if !*diverged => {
                *diverged = true;
                let recs = &gs.graphs.get(key).expect("replaying a stored graph").launches;
                for r in &recs[..*next] {
                    self.raw_launch(r.kernel, r.grid, r.block, &r.args)?;
                }
            }
            StepMode::Record { .. } => gs.mode = StepMode::Eager,
            _ => {}
        }
        Ok(())
    }

    /// Drops the recorded decode graphs of sequence `slot` (it ended).
    pub fn forget_slot(&self, slot: SeqSlot) {
        let mut gs = self.graphs.lock().unwrap_or_else(|e| e.into_inner());
        gs.graphs.retain(|k, _| k.slot != slot);
    }

    /// Whether the graph of `key` was verified and no device buffer was allocated since (see
    /// [`Gpu::replay_verified`]).
    pub fn can_replay(&self, key: StepKey) -> bool {
        let gs = self.graphs.lock().unwrap_or_else(|e| e.into_inner());
        matches!(gs.mode, StepMode::Eager)
            && gs.enabled
            && !self.sync_launches
            && !self.profiling.load(Ordering::Relaxed)
            && gs
                .graphs
                .get(&key)
                .is_some_and(|r| r.verified_at == Some(super::store::allocations()))
    }

    /// Launches the verified graph of `key` as a whole step (its inputs written by the caller first).
    ///
    /// Errors: the launch failed.
    pub fn replay_verified(&self, key: StepKey) -> Result<(), CudaError> {
        let mut gs = self.graphs.lock().unwrap_or_else(|e| e.into_inner());
        gs.replays += 1;
        gs.graphs
            .get(&key)
            .expect("checked by can_replay")
            .graph
            .0
            .launch()
            .map_err(CudaError::driver("CUDA graph launch"))
    }

    /// (graphs captured, graph replays) so far.
    pub fn graph_counts(&self) -> (u64, u64) {
        let gs = self.graphs.lock().unwrap_or_else(|e| e.into_inner());
        (gs.captures, gs.replays)
    }

    /// Captures `launches` into a graph (nothing runs).
    fn capture(&self, launches: &[LaunchRec]) -> Result<CudaGraph, CudaError> {
        for k in &self.skip {
            if !launches.iter().any(|r| r.kernel == k) {
                eprintln!("strata: STRATA_SKIP_KERNELS: `{k}` is not launched in this decode step (nothing left out)");
            }
        }
        self.stream
            .begin_capture(cudarc::driver::sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(CudaError::driver("begin graph capture"))?;
        let launched = launches
            .iter()
            .filter(|r| !self.skip.iter().any(|k| k == r.kernel))
            .try_for_each(|r| self.raw_launch(r.kernel, r.grid, r.block, &r.args));
        let graph = self
            .stream
            .end_capture(cudarc::driver::sys::CUgraphInstantiate_flags(0))
            .map_err(CudaError::driver("end graph capture"));
        launched?;
        let graph = graph?.ok_or_else(|| CudaError::Launch {
            kernel: "graph capture".into(),
            grid: (0, 0, 0),
            block: (0, 0, 0),
            call: 0,
            error: "empty graph".into(),
        })?;
        graph.upload().map_err(CudaError::driver("graph upload"))?;
        Ok(CudaGraph(graph))
    }

    /// Launches a kernel now (no graph bookkeeping).
    fn raw_launch(
        &self,
        kernel: &'static str,
        grid: (u32, u32, u32),
        block: (u32, u32, u32),
        args: &[Arg],
    ) -> Result<(), CudaError> {
        let call = self.calls.fetch_add(1, Ordering::Relaxed) + 1;
        let f = self.funcs.get(kernel).ok_or_else(|| CudaError::Launch {
            kernel: kernel.into(),
            grid,
            block,
            call,
            error: "no such kernel in the module".into(),
        })?;
        let profiling = self.profiling.load(Ordering::Relaxed);
        let timing = if profiling { self.timing_event() } else { None };
        let mut r = if self.pdl && !profiling {
            self.launch_pdl(f, grid, block, args)
        } else {
            let cfg = LaunchConfig {
                grid_dim: grid,
                block_dim: block,
                shared_mem_bytes: 0,
            };
            let mut b = self.stream.launch_builder(f);
            for a in args {
                match a {
                    Arg::P(v) => b.arg(v),
                    Arg::I(v) => b.arg(v),
                    Arg::L(v) => b.arg(v),
                    Arg::F(v) => b.arg(v),
                };
            }
            // SAFETY: each kernel's argument list is fixed by its caller in this backend, which passes pointers
            // to buffers it sized for the launch.
            unsafe { b.launch(cfg) }.map(|_| ())
        };
        if let Some(start) = timing
            && let Some(end) = self.timing_event()
        {
            let mut p = self.profile.lock().unwrap_or_else(|e| e.into_inner());
            p.pending.push((kernel, start, end));
            if p.pending.len() >= 4096 {
                p.fold();
            }
        }
        if r.is_ok() && self.sync_launches {
            r = self.stream.synchronize();
        }
        r.map_err(|e| {
            let error = e.to_string();
            events::emit(EventKind::Fault(Fault {
                error: error.clone(),
                kernel: Some(kernel.into()),
                launch: Some(Launch {
                    grid: [grid.0, grid.1, grid.2],
                    block: [block.0, block.1, block.2],
                    call,
                    synced: self.sync_launches,
                }),
                ..Fault::default()
            }));
            CudaError::Launch {
                kernel: kernel.into(),
                grid,
                block,
                call,
                error,
            }
        })
    }

    /// Launches `f` through `cuLaunchKernelEx` with programmatic stream serialization allowed: the kernel may
    /// begin while the previous one on the stream runs (CUDA programming guide, "Programmatic Dependent Launch
    /// and Synchronization"); it waits for that kernel's writes in `pdl_enter()`. In a captured stream the
    /// driver turns this into a programmatic edge of the graph.
    fn launch_pdl(
        &self,
        f: &CudaFunction,
        grid: (u32, u32, u32),
        block: (u32, u32, u32),
        args: &[Arg],
    ) -> Result<(), cudarc::driver::DriverError> {
        use cudarc::driver::sys;
        self.ctx.bind_to_thread()?;
        let mut params: Vec<*mut std::ffi::c_void> = args
            .iter()
            .map(|a| match a {
                Arg::P(v) => v as *const u64 as *mut std::ffi::c_void,
                Arg::I(v) => v as *const i32 as *mut std::ffi::c_void,
                Arg::L(v) => v as *const i64 as *mut std::ffi::c_void,
                Arg::F(v) => v as *const f32 as *mut std::ffi::c_void,
            })
            .collect();
        // SAFETY: the attribute value is a plain C union; `pad` zeroes it before the one field is set.
        let mut value: sys::CUlaunchAttributeValue = unsafe { std::mem::zeroed() };
        value.programmaticStreamSerializationAllowed = 1;
        let mut attr = sys::CUlaunchAttribute {
            id: sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
            pad: [0; 4],
            value,
        };
        let cfg = sys::CUlaunchConfig {
            gridDimX: grid.0,
            gridDimY: grid.1,
            gridDimZ: grid.2,
            blockDimX: block.0,
            blockDimY: block.1,
            blockDimZ: block.2,
            sharedMemBytes: 0,
            hStream: self.stream.cu_stream(),
            attrs: &mut attr,
            numAttrs: 1,
        };
        // SAFETY: `params` points at the argument values, alive for the call (the driver copies them); each
        // kernel's argument list is fixed by its caller in this backend, which sized the buffers for the launch.
        unsafe { sys::cuLaunchKernelEx(&cfg, f.cu_function(), params.as_mut_ptr(), std::ptr::null_mut()) }.result()
    }

    /// Runs `f` (work queued on the stream outside [`Gpu::launch`], such as a cuBLAS call) between two timing
    /// events under `name` when profiling.
    pub fn timed<T>(&self, name: &'static str, f: impl FnOnce() -> T) -> T {
        if !self.profiling.load(Ordering::Relaxed) {
            return f();
        }
        let start = self.timing_event();
        let r = f();
        if let (Some(start), Some(end)) = (start, self.timing_event()) {
            self.profile
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .pending
                .push((name, start, end));
        }
        r
    }

    /// A timing event recorded on the stream now (profile mode); `None` if the driver refused one.
    fn timing_event(&self) -> Option<CudaEvent> {
        let e = self
            .ctx
            .new_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT))
            .ok()?;
        e.record(&self.stream).ok()?;
        Some(e)
    }

    /// Turns per-launch timing on or off (also on at start with `STRATA_PROFILE_KERNELS=1`).
    pub fn set_profiling(&self, on: bool) {
        self.profiling.store(on, Ordering::Relaxed);
    }

    /// Per-kernel device time since the last call, from CUDA events around every launch made while profiling
    /// (otherwise empty): (kernel, launches, total ms), the most time first. Waits for
    /// the stream. The events add host work per launch, so time end-to-end runs without the variable.
    pub fn kernel_profile(&self) -> Vec<(&'static str, u64, f64)> {
        let mut p = self.profile.lock().unwrap_or_else(|e| e.into_inner());
        p.fold();
        let mut rows: Vec<_> = p.totals.drain().map(|(k, (n, ms))| (k, n, ms)).collect();
        rows.sort_by(|a, b| b.2.total_cmp(&a.2));
        rows
    }

    /// Launches so far (the number a `fault` event reports).
    pub fn launches(&self) -> u64 {
        self.calls.load(Ordering::Relaxed)
    }

    /// (free, total) device memory in bytes.
    pub fn mem_info(&self) -> Result<(usize, usize), CudaError> {
        self.ctx.mem_get_info().map_err(CudaError::driver("cuMemGetInfo"))
    }
}

/// Launch timings of profile mode: event pairs not yet read, and totals per kernel.
#[derive(Default)]
struct Profile {
    pending: Vec<(&'static str, CudaEvent, CudaEvent)>,
    totals: HashMap<&'static str, (u64, f64)>,
}

impl Profile {
    /// Reads every pending pair (waiting for them) into the totals.
    fn fold(&mut self) {
        for (k, start, end) in self.pending.drain(..) {
            let ms = start.elapsed_ms(&end).map_or(0.0, |m| m as f64);
            let t = self.totals.entry(k).or_insert((0, 0.0));
            t.0 += 1;
            t.1 += ms;
        }
    }
}

/// One recorded launch of a decode step.
#[derive(Debug, Clone)]
struct LaunchRec {
    kernel: &'static str,
    grid: (u32, u32, u32),
    block: (u32, u32, u32),
    args: Vec<Arg>,
}

impl LaunchRec {
    fn is(&self, kernel: &'static str, grid: (u32, u32, u32), block: (u32, u32, u32), args: &[Arg]) -> bool {
        self.kernel == kernel && self.grid == grid && self.block == block && self.args == args
    }
}

/// An instantiated CUDA graph. cudarc's graph is not `Send`; this one is only touched under [`Gpu`]'s graph
/// mutex, which serialises every use as the CUDA documentation requires.
struct CudaGraph(cudarc::driver::CudaGraph);
// SAFETY: see the type's doc: all access goes through `Gpu::graphs`' mutex.
unsafe impl Send for CudaGraph {}

/// A captured step: its launches (to compare the next steps with) and its graph.
struct Recorded {
    launches: Vec<LaunchRec>,
    graph: CudaGraph,
    /// The device allocation count ([`super::store::allocations`]) when a replay matched the recording launch
    /// for launch: while it is unchanged, every buffer the graph uses is the one it was recorded with.
    verified_at: Option<u64>,
}

#[derive(Default)]
enum StepMode {
    #[default]
    Eager,
    Record {
        key: StepKey,
        launches: Vec<LaunchRec>,
    },
    Replay {
        key: StepKey,
        next: usize,
        diverged: bool,
    },
}

#[derive(Default)]
struct Graphs {
    enabled: bool,
    mode: StepMode,
    graphs: HashMap<StepKey, Recorded>,
    captures: u64,
    replays: u64,
}

#[cfg(test)]
mod tests {
    use super::{KERNEL_NAMES, KERNEL_SOURCES};

    /// Every kernel a source file defines by name (not through a per-type macro) is in the launch list, so a
    /// new kernel cannot reach a GPU run unregistered ("no such kernel in the module").
    #[test]
    fn every_named_kernel_is_registered() {
        let mut defined = 0;
        for (file, src) in KERNEL_SOURCES {
            for part in src.split("extern \"C\" __global__ void").skip(1) {
                let part = part.trim_start();
                let part = match part.strip_prefix("__launch_bounds__(") {
                    Some(rest) => rest.split_once(')').map_or(rest, |(_, r)| r).trim_start(),
                    None => part,
                };
                // A bounds macro (MMV_BOUNDS) before the name.
                let part = match part.split_once(' ') {
                    Some((w, rest)) if w.ends_with("_BOUNDS") => rest.trim_start(),
                    _ => part,
                };
                let name: String = part.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect();
                if part[name.len()..].starts_with("##") || name.is_empty() {
                    continue; // generated per quant type
                }
                defined += 1;
                assert!(
                    KERNEL_NAMES.contains(&name.as_str()),
                    "{file}: kernel {name} is not in KERNEL_NAMES"
                );
            }
        }
        assert!(
            defined > 20,
            "found only {defined} named kernels: the parser no longer matches the sources"
        );
    }

    /// Every kernel, named or generated by a macro, calls `pdl_enter()` (directly, or through `mmv_fast_rows`,
    /// which calls it after its first weight loads) before the next kernel definition: a kernel launched with
    /// programmatic dependent launch that never waits would read its inputs before they are written.
    #[test]
    fn every_kernel_waits_for_the_kernel_before() {
        let mut kernels = 0;
        for (file, src) in KERNEL_SOURCES {
            for part in src.split("__global__ void").skip(1) {
                kernels += 1;
                let head: String = part.chars().take(60).collect();
                // The body: from its opening brace to the matching closing one.
                let open = part.find('{').expect("a kernel body");
                let mut depth = 0;
                let close = part[open..]
                    .char_indices()
                    .find_map(|(i, c)| {
                        depth += match c {
                            '{' => 1,
                            '}' => -1,
                            _ => 0,
                        };
                        (depth == 0).then_some(open + i)
                    })
                    .expect("a closed kernel body");
                let body = &part[open..close];
                // mmv_fast_rows and wide_dot_block call pdl_enter after their first weight loads.
                assert!(
                    ["pdl_enter()", "mmv_fast_rows<", "wide_dot_block("]
                        .iter()
                        .any(|c| body.contains(c)),
                    "{file}: kernel `{}` does not call pdl_enter()",
                    head.split('(').next().unwrap_or("").trim()
                );
            }
        }
        assert!(
            kernels > 30,
            "found only {kernels} kernels: the parser no longer matches the sources"
        );
    }
}
