//! Decode steps as CUDA graphs: [`Gpu::launch`] records a step's launches, the step's end captures them into a
//! graph, and the next steps of the same key replay it (see [`Gpu::step_begin`]).

use std::collections::HashMap;
use std::sync::atomic::Ordering;

use super::Gpu;
use super::error::CudaError;
use super::launch::Arg;
use crate::backend::StepKey;
use crate::events::{self, EventKind, Fallback};
use crate::state::kv::SeqSlot;

impl Gpu {
    /// Launches `kernel` on the current stream (the side stream between [`Gpu::fork`] and [`Gpu::to_main`] or
    /// [`Gpu::join`]) and checks the result; with `STRATA_SYNC_LAUNCHES=1` also waits for it.
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

    /// Drops every recorded graph: a setting that changes a step's kernels was changed, and a whole-step replay
    /// ([`Gpu::can_replay`]) of a graph recorded before must not run the old ones.
    pub(super) fn forget_graphs(&self) {
        self.graphs.lock().unwrap_or_else(|e| e.into_inner()).graphs.clear();
    }

    /// Decode steps run their launches one by one from now on (a sticky fault counts every launch).
    pub(super) fn graphs_off(&self) {
        self.graphs.lock().unwrap_or_else(|e| e.into_inner()).enabled = false;
    }

    /// Marks the start of a forward step with shape `key` (tokens and logits wanted). With graphs on, a decode
    /// step (`graphable`) is recorded the first time (run eagerly, then captured into a CUDA graph at
    /// [`Gpu::step_end`]) and replayed after: each launch is compared with the recorded one and skipped, and the
    /// graph runs at the step's end. A launch that differs (a grown buffer, another shape) makes the step run
    /// eagerly from there, and the graph is recorded anew. Off with `STRATA_CUDA_GRAPHS=0`, in sync-launch and
    /// profile modes.
    pub fn step_begin(&self, key: StepKey, graphable: bool) {
        self.reset_lane();
        let mut gs = self.graphs.lock().unwrap_or_else(|e| e.into_inner());
        let on = graphable && gs.enabled && !self.sync_launches && !self.profiling.load(Ordering::Relaxed);
        let variant = gs.variant;
        let same = gs.graphs.get(&key).is_some_and(|r| r.variant == variant);
        gs.mode = match (on, same) {
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
                        let variant = gs.variant;
                        gs.graphs.insert(
                            key,
                            Recorded {
                                launches,
                                graph,
                                verified_at: None,
                                variant,
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
                    rec.verified_at = Some(super::buffer::allocations());
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
                .is_some_and(|r| r.verified_at == Some(super::buffer::allocations()) && r.variant == gs.variant)
    }

    /// Sets the variant of the steps that follow: a step of another variant than a key's graph was recorded under
    /// neither replays it nor is compared with it, and records its own. Steps of one shape can take other launch
    /// sequences by a choice made before the step (the expert cache's decode path: with the next layer's
    /// prefetch or without), and a whole-step replay ([`Gpu::can_replay`]) must not run the other one's graph.
    pub fn set_step_variant(&self, variant: u8) {
        self.graphs.lock().unwrap_or_else(|e| e.into_inner()).variant = variant;
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
        self.reset_lane();
        for k in &self.skip {
            if !launches.iter().any(|r| r.kernel == k) {
                eprintln!("strata: STRATA_SKIP_KERNELS: `{k}` is not launched in this decode step (nothing left out)");
            }
        }
        self.stream
            .begin_capture(cudarc::driver::sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(CudaError::driver("begin graph capture"))?;
        // Stream operations (`@fork`, `@join`) are never left out: the graph's branches must stay joined.
        let launched = launches
            .iter()
            .filter(|r| r.kernel.starts_with('@') || !self.skip.iter().any(|k| k == r.kernel))
            .try_for_each(|r| self.raw_launch(r.kernel, r.grid, r.block, &r.args));
        // A launch that failed inside a side branch leaves it open: join it so the capture can end.
        self.reset_lane();
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
    /// The device allocation count ([`super::buffer::allocations`]) when a replay matched the recording launch
    /// for launch: while it is unchanged, every buffer the graph uses is the one it was recorded with.
    verified_at: Option<u64>,
    /// The step variant it was recorded under ([`Gpu::set_step_variant`]).
    variant: u8,
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
pub(super) struct Graphs {
    enabled: bool,
    mode: StepMode,
    graphs: HashMap<StepKey, Recorded>,
    captures: u64,
    replays: u64,
    /// The variant of the steps now ([`Gpu::set_step_variant`]).
    variant: u8,
}

impl Graphs {
    /// No graphs yet; recording on when `enabled` (`STRATA_CUDA_GRAPHS`).
    pub(super) fn new(enabled: bool) -> Graphs {
        Graphs {
            enabled,
            ..Graphs::default()
        }
    }
}
