//! Kernel launches on a [`Gpu`]'s stream: the arguments, the checked launch (`Gpu::raw_launch`; [`Gpu::launch`],
//! which every op calls, records and replays decode steps around it in `graph.rs`), programmatic dependent
//! launch, and per-launch timing (profile mode).
//!
//! Launch checking (seed 003): every launch's return code is checked; with `STRATA_SYNC_LAUNCHES=1` the stream is
//! synchronised after each launch, so an asynchronous fault surfaces at the kernel that caused it. A failure
//! writes a `fault` event naming the kernel, grid, block and call number.

use std::collections::HashMap;
use std::sync::atomic::Ordering;

use cudarc::driver::{CudaEvent, CudaFunction, LaunchConfig, PushKernelArg};

use super::Gpu;
use super::error::CudaError;
use crate::device::fault::Verdict;
use crate::events::{self, EventKind, Fault, Launch};

/// One kernel argument (every kernel takes device pointers and scalars only).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Arg {
    /// A device pointer.
    P(u64),
    I(i32),
    L(i64),
    F(f32),
}

/// The stream operations a step records among its launches (so a CUDA graph captures them as edges), by the
/// names [`Gpu::launch`] takes them under: `@` is no kernel's first letter.
const FORK: &str = "@fork";
const TO_MAIN: &str = "@main";
const JOIN: &str = "@join";
const MARK: &str = "@mark";
const WAIT_MARK: &str = "@wait_mark";

impl Gpu {
    /// Starts work beside the stream's: what the stream has queued so far comes first, then the launches that
    /// follow go to the side stream until [`Gpu::to_main`] or [`Gpu::join`]. Recorded in a decode step like a
    /// launch, so its graph holds the two branches (CUDA programming guide, "Stream capture", cross-stream
    /// dependencies).
    ///
    /// Errors: the event could not be recorded or waited for.
    pub(super) fn fork(&self) -> Result<(), CudaError> {
        self.launch(FORK, (1, 1, 1), (1, 1, 1), &[])
    }

    /// After [`Gpu::fork`]: the launches that follow go to the stream again, beside what the side stream does.
    ///
    /// Errors: only as [`Gpu::launch`]'s bookkeeping (a replayed step's skipped launches failed).
    pub(super) fn to_main(&self) -> Result<(), CudaError> {
        self.launch(TO_MAIN, (1, 1, 1), (1, 1, 1), &[])
    }

    /// Ends the side branch: the stream's launches that follow wait for everything queued on the side stream.
    ///
    /// Errors: the event could not be recorded or waited for.
    pub(super) fn join(&self) -> Result<(), CudaError> {
        self.launch(JOIN, (1, 1, 1), (1, 1, 1), &[])
    }

    /// Marks the point the side stream has reached (between [`Gpu::fork`] and [`Gpu::to_main`]): a later
    /// [`Gpu::wait_mark`] makes the stream wait for the side's launches up to here alone, not for what the side
    /// queues after it (as [`Gpu::join`] would).
    ///
    /// Errors: the event could not be recorded.
    pub(super) fn mark(&self) -> Result<(), CudaError> {
        self.launch(MARK, (1, 1, 1), (1, 1, 1), &[])
    }

    /// The stream's launches that follow wait for the side stream's up to the last [`Gpu::mark`].
    ///
    /// Errors: the event could not be waited for.
    pub(super) fn wait_mark(&self) -> Result<(), CudaError> {
        self.launch(WAIT_MARK, (1, 1, 1), (1, 1, 1), &[])
    }

    /// The stream launches go to now.
    fn current(&self) -> &std::sync::Arc<cudarc::driver::CudaStream> {
        if self.on_side.load(Ordering::Relaxed) {
            &self.side
        } else {
            &self.stream
        }
    }

    /// Closes a side branch a failed step may have left open: the stream waits for the side stream (so a graph
    /// capture holds no unjoined branch), and launches go to the stream again. Nothing when no branch is open.
    pub(super) fn reset_lane(&self) {
        if self.on_side.load(Ordering::Relaxed) {
            // A failure here is the stream's own, and the next launch on it reports it.
            let _ = self.lane_op(JOIN);
        }
    }

    /// Carries out one of the stream operations [`Gpu::fork`], [`Gpu::to_main`] and [`Gpu::join`] record.
    fn lane_op(&self, op: &'static str) -> Result<(), CudaError> {
        let e = || CudaError::driver("ordering the side stream");
        match op {
            FORK => {
                self.fork_ev.record(&self.stream).map_err(e())?;
                self.side.wait(&self.fork_ev).map_err(e())?;
                self.on_side.store(true, Ordering::Relaxed);
            }
            TO_MAIN => self.on_side.store(false, Ordering::Relaxed),
            MARK => self.mark_ev.record(&self.side).map_err(e())?,
            WAIT_MARK => self.stream.wait(&self.mark_ev).map_err(e())?,
            JOIN => {
                self.join_ev.record(&self.side).map_err(e())?;
                self.stream.wait(&self.join_ev).map_err(e())?;
                self.on_side.store(false, Ordering::Relaxed);
            }
            _ => unreachable!("{op} is no stream operation"),
        }
        Ok(())
    }

    /// A call that is no launch (`what`: `device-to-host copy`, `stream synchronize`) on a context an injected
    /// sticky fault has poisoned fails as the driver would, with a `fault` event naming the call; otherwise
    /// nothing.
    ///
    /// Errors: [`CudaError::Poisoned`].
    pub(super) fn poisoned(&self, what: &'static str) -> Result<(), CudaError> {
        if let Some(Verdict::Fail { error }) = self.sticky.get().map(|g| g.call()) {
            events::emit(EventKind::Fault(Fault {
                error: error.clone(),
                op: Some(what.into()),
                ..Fault::default()
            }));
            return Err(CudaError::Poisoned {
                what: what.into(),
                error,
            });
        }
        Ok(())
    }

    /// Launches a kernel now (no graph bookkeeping), on the current stream (see [`Gpu::fork`]).
    pub(super) fn raw_launch(
        &self,
        kernel: &'static str,
        grid: (u32, u32, u32),
        block: (u32, u32, u32),
        args: &[Arg],
    ) -> Result<(), CudaError> {
        if kernel.starts_with('@') {
            return self.lane_op(kernel);
        }
        let call = self.calls.fetch_add(1, Ordering::Relaxed) + 1;
        let f = self.funcs.get(kernel).ok_or_else(|| CudaError::Launch {
            kernel: kernel.into(),
            grid,
            block,
            call,
            error: "no such kernel in the module".into(),
        })?;
        // A sticky fault (seed 003): this launch fails as injected, or runs the trap kernel in its place.
        let (mut f, mut args) = (f, args);
        let injected = match self.sticky.get().map(|g| g.launch(kernel)) {
            Some(Verdict::Fail { error }) => Some(error),
            Some(Verdict::Trap) => {
                f = &self.funcs["strata_trap"];
                args = &[];
                None
            }
            _ => None,
        };
        let profiling = self.profiling.load(Ordering::Relaxed);
        // A launch that failed as injected never ran: nothing to time.
        let timing = if profiling && injected.is_none() {
            self.timing_event()
        } else {
            None
        };
        let mut r = if injected.is_some() {
            Ok(())
        } else if self.pdl && !profiling {
            self.launch_pdl(f, grid, block, args)
        } else {
            let cfg = LaunchConfig {
                grid_dim: grid,
                block_dim: block,
                shared_mem_bytes: 0,
            };
            let mut b = self.current().launch_builder(f);
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
            r = self.current().synchronize();
        }
        let r = match injected {
            Some(error) => Err(error),
            None => r.map_err(|e| e.to_string()),
        };
        r.map_err(|error| {
            events::emit(EventKind::Fault(Fault {
                error: error.clone(),
                kernel: Some(kernel.into()),
                launch: Some(Launch {
                    grid: Some([grid.0, grid.1, grid.2]),
                    block: Some([block.0, block.1, block.2]),
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
            hStream: self.current().cu_stream(),
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
        e.record(self.current()).ok()?;
        Some(e)
    }

    /// Turns per-launch timing on or off (also on at start with `STRATA_PROFILE_KERNELS=1`).
    pub fn set_profiling(&self, on: bool) {
        self.profiling.store(on, Ordering::Relaxed);
    }

    /// Per-kernel device time since the last call, from CUDA events around every launch made while profiling
    /// (otherwise empty): (kernel, launches, total ms), the most time first. Launches on the side stream
    /// ([`Gpu::fork`]) run beside the stream's, so the totals may add up to more than the wall time. Waits for
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
}

/// Launch timings of profile mode: event pairs not yet read, and totals per kernel.
#[derive(Default)]
pub(super) struct Profile {
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
