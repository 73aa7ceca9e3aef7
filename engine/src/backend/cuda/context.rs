//! One CUDA device opened: its context and stream, the kernels loaded from the module [`super::compile`] gives,
//! the launch and graph settings read from the switches, and its memory.

use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::AtomicU64;
use std::time::Instant;

use cudarc::driver::CudaContext;

use super::Gpu;
use super::compile::{self, CompileReport, KERNEL_NAMES, arch_name};
use super::error::CudaError;
use super::graph::Graphs;
use super::launch::Profile;
use crate::device::cuda_libs;
use crate::switches;

/// Number of CUDA devices.
///
/// Errors: no driver, or the driver fails to initialise (no device, driver/library mismatch).
pub fn device_count() -> Result<usize, CudaError> {
    Ok(cuda_libs::device_count()?)
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
        // SAFETY: every buffer of this backend is used on `stream`, or on `side` between a fork and a join that order
        // it with `stream` (Gpu::fork), or by another backend's copy ordered with `stream` by events both ways
        // (CudaBackend::send_f32).
        unsafe { ctx.disable_event_tracking() };
        // A stream of our own: the legacy default stream cannot be captured into a CUDA graph.
        let stream = ctx.new_stream().map_err(CudaError::driver("stream creation"))?;
        let side = ctx.new_stream().map_err(CudaError::driver("stream creation"))?;
        let ev = || ctx.new_event(None).map_err(CudaError::driver("event creation"));
        let (fork_ev, join_ev, mark_ev) = (ev()?, ev()?, ev()?);
        let asleep_ev = ctx
            .new_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_BLOCKING_SYNC))
            .map_err(CudaError::driver("event creation"))?;
        let (major, minor) = ctx
            .compute_capability()
            .map_err(CudaError::driver("compute capability"))?;
        let arch = arch_name(major, minor);
        let target = switches::Target::Cuda {
            major: major as u32,
            minor: minor as u32,
        };
        let sms = ctx
            .attribute(cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(CudaError::driver("multiprocessor count"))? as usize;
        let start = Instant::now();
        let (ptx, cached, path) = compile::cached_ptx(arch, major, minor)?;
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
            side,
            fork_ev,
            join_ev,
            mark_ev,
            asleep_ev,
            on_side: false.into(),
            funcs,
            calls: AtomicU64::new(0),
            sync_launches: switches::flag(switches::SYNC_LAUNCHES, false),
            sticky: std::sync::OnceLock::new(),
            pdl: switches::speed_on(switches::PDL, &target),
            skip: switches::text_lossy(switches::SKIP_KERNELS)
                .map(|v| v.split(',').filter(|k| !k.is_empty()).map(str::to_string).collect())
                .unwrap_or_default(),
            profile: Mutex::new(Profile::default()),
            graphs: Mutex::new(Graphs::new(switches::speed_on(switches::CUDA_GRAPHS, &target))),
            profiling: switches::flag(switches::PROFILE_KERNELS, false).into(),
            compile,
            ordinal,
            sms,
            target,
        })
    }

    /// Waits, asleep in the driver (a blocking-sync event), for what `stream` has queued: the calling thread gives
    /// its core back while it waits. Under CUDA's default scheduling a wait spins on a core for as long as the work
    /// takes, which a decode step whose CPU join needs every other core cannot spare; waking costs some
    /// microseconds, once per step.
    ///
    /// Errors: recording or waiting failed.
    pub fn wait_asleep(&self) -> Result<(), CudaError> {
        let e = || CudaError::driver("waiting for the stream (blocking sync)");
        self.asleep_ev.record(&self.stream).map_err(e())?;
        self.asleep_ev.synchronize().map_err(e())
    }

    /// (free, total) device memory in bytes.
    pub fn mem_info(&self) -> Result<(usize, usize), CudaError> {
        self.ctx.mem_get_info().map_err(CudaError::driver("cuMemGetInfo"))
    }
}
