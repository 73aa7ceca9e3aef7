//! The backend of a device: `--device cpu|cuda:N`, and a backend that is either.

use super::error::CudaError;
use super::{CudaBackend, DevVec};
use crate::backend::StepKey;
use crate::backend::cpu::CpuBackend;
use crate::backend::split::Split;
use crate::backend::{AttnOp, AttnParams, Backend, Experts, GluKind, MoeScratch, QMat, RopeParams, RunBufs};
use std::sync::atomic::{AtomicU64, Ordering};

use crate::device::fault::{FaultPlan, LaunchGate, StickyRule, Verdict};
use crate::device::{Device, DeviceError};
use crate::events::{self, EventKind, Fault, Launch};
use crate::state::batch::BatchLayout;
use crate::state::kv::{KvCache, KvLayer, SeqSlot};

/// Why a device's backend could not be opened.
#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    #[error(transparent)]
    Device(#[from] DeviceError),
    #[error(transparent)]
    Cuda(#[from] CudaError),
}

/// The backend of a [`Device`]: every [`Backend`] call goes to the CPU or the CUDA backend.
pub enum AnyBackend {
    /// The CPU; on a `sim:` device with a sticky fault, the launches it counts.
    Cpu(CpuBackend, Option<Box<SimLaunches>>),
    Cuda(Box<CudaBackend>),
    /// A layer split: each op goes to the stage computing now ([`crate::backend::split`]).
    Split(Box<Split>),
}

/// A `sim:` device's launches under a sticky fault (`STRATA_FAULT=sticky:KERNEL@N`, seed 003): every backend op
/// is one launch, numbered from the start; the gate decides which fails.
pub struct SimLaunches {
    gate: LaunchGate,
    device: String,
    calls: AtomicU64,
}

impl SimLaunches {
    /// Launch number `n` of `kernel`: nothing, or, where the gate says it fails, a `fault` event naming it and a
    /// panic (the backends have no error path; the serve worker's panic hook exits and the server restarts it).
    fn launch(&self, kernel: &'static str) {
        let call = self.calls.fetch_add(1, Ordering::Relaxed) + 1;
        if let Verdict::Fail { error } = self.gate.launch(kernel) {
            events::emit(EventKind::Fault(Fault {
                error: error.clone(),
                kernel: Some(kernel.into()),
                launch: Some(Launch {
                    grid: None,
                    block: None,
                    call,
                    synced: self.gate.synced(),
                }),
                ..Fault::default()
            }));
            panic!("{}: {kernel} (launch #{call}) failed: {error}", self.device);
        }
    }
}

impl AnyBackend {
    /// Opens `device` (the CUDA device, its kernels, cuBLAS).
    ///
    /// A `sim:` device computes on the CPU backend; its memory, link and faults are the engine's to simulate
    /// ([`crate::device::sim`]).
    ///
    /// Errors: CUDA is unavailable on this machine (one line saying why), no such device, kernels failed; a
    /// `sim:` profile that cannot be read or is of an arch its build was not compiled for.
    pub fn open(device: &Device) -> Result<AnyBackend, OpenError> {
        Ok(match device {
            Device::Cpu => AnyBackend::Cpu(CpuBackend, None),
            Device::Cuda(n) => AnyBackend::Cuda(Box::new(CudaBackend::new(*n)?)),
            Device::Split(ords) => {
                let mut stages = Vec::with_capacity(ords.len());
                for &n in ords {
                    stages.push((Device::Cuda(n), AnyBackend::Cuda(Box::new(CudaBackend::new(n)?))));
                }
                AnyBackend::Split(Box::new(Split::new(stages)))
            }
            Device::Sim(_) => {
                device.available()?;
                AnyBackend::Cpu(CpuBackend, None)
            }
        })
    }

    /// Arms a sticky fault (`sticky:KERNEL@N`, `trap:KERNEL@N`) on `device`: `error` is its driver's words for a
    /// failed launch (a `sim:` device's; CUDA's are the driver's own). On CUDA the kernel must be one of the
    /// module's; on a `sim:` device one of [`crate::device::fault::SIM_KERNELS`]. Returns whether launches are
    /// synchronised (`STRATA_SYNC_LAUNCHES=1`: the fault surfaces at its kernel).
    ///
    /// Errors: no such kernel (the message lists the known ones); a trap on a device that cannot trap; a sticky
    /// fault on the plain CPU, which has no device to poison.
    pub fn arm_sticky(&mut self, device: &Device, rule: &StickyRule, error: &str) -> Result<bool, String> {
        match self {
            AnyBackend::Cuda(c) => c.arm_sticky(rule),
            AnyBackend::Split(_) => Err(format!(
                "{rule}: a sticky fault counts the launches of one device; {device} is a layer split (use --device cuda:N)"
            )),
            AnyBackend::Cpu(_, sim) => {
                if !matches!(device, Device::Sim(_)) {
                    return Err(format!(
                        "{rule}: a sticky launch failure poisons a GPU; {device} has none (use --device sim:PROFILE or cuda:N)"
                    ));
                }
                rule.check_sim()?;
                let synced = crate::switches::flag(crate::switches::SYNC_LAUNCHES, false);
                *sim = Some(Box::new(SimLaunches {
                    gate: LaunchGate::new(rule.clone(), synced, error),
                    device: device.to_string(),
                    calls: AtomicU64::new(0),
                }));
                Ok(synced)
            }
        }
    }

    /// The CUDA backend, when that is what this is (a split is several: [`AnyBackend::cudas`]).
    pub fn cuda(&self) -> Option<&CudaBackend> {
        match self {
            AnyBackend::Cuda(c) => Some(c),
            AnyBackend::Cpu(..) | AnyBackend::Split(_) => None,
        }
    }

    /// Every CUDA backend this computes on: this one, or a split's stages' in pipeline order.
    pub fn cudas(&self) -> Vec<&CudaBackend> {
        match self {
            AnyBackend::Cuda(c) => vec![c],
            AnyBackend::Cpu(..) => Vec::new(),
            AnyBackend::Split(s) => s.stages().iter().flat_map(|st| st.be.cudas()).collect(),
        }
    }

    /// The layer split, when this is one.
    pub fn split(&self) -> Option<&Split> {
        match self {
            AnyBackend::Split(s) => Some(s),
            _ => None,
        }
    }

    /// The layer split, to place its layers ([`Split::place`]).
    pub fn split_mut(&mut self) -> Option<&mut Split> {
        match self {
            AnyBackend::Split(s) => Some(s),
            _ => None,
        }
    }
}

/// An activation buffer of an [`AnyBackend`]: host memory for the CPU, device memory for CUDA; empty until the
/// backend first sizes it.
#[derive(Default)]
pub enum AnyBuf {
    #[default]
    Empty,
    Host(Vec<f32>),
    Dev(DevVec),
    /// A layer split's buffer: one per stage, each of its stage's backend ([`crate::backend::split`]).
    Staged(Vec<AnyBuf>),
}

impl AnyBuf {
    fn host(&self) -> &Vec<f32> {
        match self {
            AnyBuf::Host(v) => v,
            _ => panic!("AnyBackend: a CPU op got a buffer the CPU backend did not size"),
        }
    }
    fn host_mut(&mut self) -> &mut Vec<f32> {
        match self {
            AnyBuf::Host(v) => v,
            _ => panic!("AnyBackend: a CPU op got a buffer the CPU backend did not size"),
        }
    }
    fn dev(&self) -> &DevVec {
        match self {
            AnyBuf::Dev(v) => v,
            _ => panic!("AnyBackend: a CUDA op got a buffer the CUDA backend did not size"),
        }
    }
    fn dev_mut(&mut self) -> &mut DevVec {
        match self {
            AnyBuf::Dev(v) => v,
            _ => panic!("AnyBackend: a CUDA op got a buffer the CUDA backend did not size"),
        }
    }
    /// Stage `i`'s buffer of a split's.
    pub(crate) fn stage(&self, i: usize) -> &AnyBuf {
        match self {
            AnyBuf::Staged(v) if i < v.len() => &v[i],
            _ => panic!("AnyBackend: a split's op got a buffer its stage {i} did not size"),
        }
    }
    /// Stage `i`'s buffer of a split's, made (empty) where it is not yet.
    pub(crate) fn stage_mut(&mut self, i: usize) -> &mut AnyBuf {
        if !matches!(self, AnyBuf::Staged(_)) {
            *self = AnyBuf::Staged(Vec::new());
        }
        let AnyBuf::Staged(v) = self else { unreachable!() };
        if v.len() <= i {
            v.resize_with(i + 1, AnyBuf::default);
        }
        &mut v[i]
    }
}

/// Moves scratch buffers out of [`AnyBuf`]s for one backend's call and back after it: a buffer of the other
/// backend's kind (or none) starts empty, and the backend sizes it. `stage`: a layer split's stage, whose buffers
/// of the split's ([`AnyBuf::Staged`]) are the ones moved; `None`: the buffers themselves.
fn with_bufs<T: Default, R>(
    bufs: &mut RunBufs<AnyBuf>,
    stage: Option<usize>,
    take: fn(AnyBuf) -> Option<T>,
    wrap: fn(T) -> AnyBuf,
    call: impl FnOnce(&mut RunBufs<T>) -> R,
) -> R {
    fn at(b: &mut AnyBuf, stage: Option<usize>) -> &mut AnyBuf {
        match stage {
            Some(i) => b.stage_mut(i),
            None => b,
        }
    }
    let out = |b: &mut AnyBuf| take(std::mem::take(at(b, stage))).unwrap_or_default();
    let mut t = RunBufs {
        q: out(&mut bufs.q),
        k: out(&mut bufs.k),
        v: out(&mut bufs.v),
        att: out(&mut bufs.att),
    };
    let r = call(&mut t);
    *at(&mut bufs.q, stage) = wrap(t.q);
    *at(&mut bufs.k, stage) = wrap(t.k);
    *at(&mut bufs.v, stage) = wrap(t.v);
    *at(&mut bufs.att, stage) = wrap(t.att);
    r
}

/// Runs one op on whichever backend this is, each buffer argument unwrapped to that backend's type:
/// `dispatch!(self, be, op, [x, out], [y], be.op(w, x, out))` with `x`, `out` taken `&mut` and `y` `&`. On a
/// `sim:` device the op is first a launch named `op` ([`SimLaunches::launch`]).
macro_rules! dispatch {
    ($self:ident, $be:ident, $op:ident, [$($m:ident),*], [$($r:ident),*], $call:expr) => {
        match $self {
            AnyBackend::Cpu($be, sim) => {
                if let Some(sim) = sim {
                    sim.launch(stringify!($op));
                }
                $(let $m = $m.host_mut();)*
                $(let $r = $r.host();)*
                $call
            }
            AnyBackend::Cuda(c) => {
                let $be: &CudaBackend = c;
                $(let $m = $m.dev_mut();)*
                $(let $r = $r.dev();)*
                $call
            }
            AnyBackend::Split(sp) => {
                let (i, $be) = sp.current();
                $(let $m = $m.stage_mut(i);)*
                $(let $r = $r.stage(i);)*
                $call
            }
        }
    };
}

impl Backend for AnyBackend {
    type Buf = AnyBuf;

    fn name(&self) -> &'static str {
        match self {
            AnyBackend::Cpu(c, _) => c.name(),
            AnyBackend::Cuda(c) => c.name(),
            AnyBackend::Split(s) => s.current().1.name(),
        }
    }
    fn reserve(&self, buf: &mut AnyBuf, len: usize) {
        match self {
            AnyBackend::Cpu(c, _) => {
                if !matches!(buf, AnyBuf::Host(_)) {
                    *buf = AnyBuf::Host(Vec::new());
                }
                Backend::reserve(c, buf.host_mut(), len)
            }
            AnyBackend::Cuda(c) => {
                if !matches!(buf, AnyBuf::Dev(_)) {
                    *buf = AnyBuf::Dev(DevVec::default());
                }
                Backend::reserve(&**c, buf.dev_mut(), len)
            }
            AnyBackend::Split(s) => {
                let (i, be) = s.current();
                be.reserve(buf.stage_mut(i), len)
            }
        }
    }
    fn enter_layer(&self, il: usize) -> bool {
        match self {
            AnyBackend::Split(s) => s.enter_layer(il),
            AnyBackend::Cpu(..) | AnyBackend::Cuda(_) => false,
        }
    }
    fn carry(&self, buf: &mut AnyBuf, len: usize) {
        if let AnyBackend::Split(s) = self {
            s.carry(buf, len)
        }
    }
    fn carried(&self) {
        if let AnyBackend::Split(s) = self {
            s.carried_in()
        }
    }
    fn upload(&self, src: &[f32], dst: &mut AnyBuf) {
        dispatch!(self, be, upload, [dst], [], be.upload(src, dst))
    }
    fn download(&self, src: &AnyBuf, offset: usize, dst: &mut [f32]) {
        dispatch!(self, be, download, [], [src], be.download(src, offset, dst))
    }
    fn copy(&self, src: &AnyBuf, src_offset: usize, dst: &mut AnyBuf, dst_offset: usize, len: usize) {
        dispatch!(
            self,
            be,
            copy,
            [dst],
            [src],
            Backend::copy(be, src, src_offset, dst, dst_offset, len)
        )
    }
    fn get_rows(&self, table: &QMat<'_>, ids: &[u32], out: &mut AnyBuf) {
        dispatch!(self, be, get_rows, [out], [], be.get_rows(table, ids, out))
    }
    fn matmul(&self, w: &QMat<'_>, x: &AnyBuf, n_tok: usize, out: &mut AnyBuf) {
        dispatch!(self, be, matmul, [out], [x], Backend::matmul(be, w, x, n_tok, out))
    }
    fn matmul_many(&self, ws: &[QMat<'_>], x: &AnyBuf, n_tok: usize, outs: &mut [&mut AnyBuf]) {
        match self {
            AnyBackend::Cpu(be, sim) => {
                if let Some(sim) = sim {
                    sim.launch("matmul_many");
                }
                let mut o: Vec<&mut Vec<f32>> = outs.iter_mut().map(|b| b.host_mut()).collect();
                Backend::matmul_many(be, ws, x.host(), n_tok, &mut o)
            }
            AnyBackend::Cuda(be) => {
                let mut o: Vec<&mut DevVec> = outs.iter_mut().map(|b| b.dev_mut()).collect();
                Backend::matmul_many(&**be, ws, x.dev(), n_tok, &mut o)
            }
            AnyBackend::Split(s) => {
                let (i, be) = s.current();
                let mut o: Vec<&mut AnyBuf> = outs.iter_mut().map(|b| b.stage_mut(i)).collect();
                be.matmul_many(ws, x.stage(i), n_tok, &mut o)
            }
        }
    }
    fn rms_norm(&self, x: &mut AnyBuf, rows: usize, w: &[f32], eps: f32) {
        dispatch!(self, be, rms_norm, [x], [], Backend::rms_norm(be, x, rows, w, eps))
    }
    fn rms_norm_into(&self, x: &AnyBuf, out: &mut AnyBuf, rows: usize, w: &[f32], eps: f32) {
        dispatch!(
            self,
            be,
            rms_norm_into,
            [out],
            [x],
            be.rms_norm_into(x, out, rows, w, eps)
        )
    }
    fn rope(&self, x: &mut AnyBuf, n_head: usize, head_dim: usize, positions: &[u32], p: &RopeParams) {
        dispatch!(
            self,
            be,
            rope,
            [x],
            [],
            Backend::rope(be, x, n_head, head_dim, positions, p)
        )
    }
    fn scale(&self, x: &mut AnyBuf, len: usize, s: f32) {
        dispatch!(self, be, scale, [x], [], Backend::scale(be, x, len, s))
    }
    fn add(&self, x: &mut AnyBuf, y: &AnyBuf, len: usize) {
        dispatch!(self, be, add, [x], [y], Backend::add(be, x, y, len))
    }
    fn store_kv(&self, kv: &mut KvLayer, k: &AnyBuf, v: &AnyBuf, positions: &[u32]) {
        dispatch!(
            self,
            be,
            store_kv,
            [],
            [k, v],
            Backend::store_kv(be, kv, k, v, positions)
        )
    }
    fn attention(&self, q: &AnyBuf, kv: &KvLayer, positions: &[u32], p: &AttnParams, out: &mut AnyBuf) {
        dispatch!(
            self,
            be,
            attention,
            [out],
            [q],
            Backend::attention(be, q, kv, positions, p, out)
        )
    }
    #[allow(clippy::too_many_arguments)]
    fn rope_store_attention(
        &self,
        q: &mut AnyBuf,
        k: &mut AnyBuf,
        v: &AnyBuf,
        kv: &mut KvLayer,
        norms: (Option<&[f32]>, Option<&[f32]>),
        eps: f32,
        positions: &[u32],
        rope: &RopeParams,
        p: &AttnParams,
        out: &mut AnyBuf,
    ) {
        dispatch!(
            self,
            be,
            rope_store_attention,
            [q, k, out],
            [v],
            be.rope_store_attention(q, k, v, kv, norms, eps, positions, rope, p, out)
        )
    }
    #[allow(clippy::too_many_arguments)]
    fn attend(
        &self,
        q: &mut AnyBuf,
        k: &mut AnyBuf,
        v: &AnyBuf,
        kv: &mut KvLayer,
        positions: &[u32],
        a: &AttnOp<'_>,
        out: &mut AnyBuf,
    ) {
        dispatch!(
            self,
            be,
            attend,
            [q, k, out],
            [v],
            be.attend(q, k, v, kv, positions, a, out)
        )
    }
    #[allow(clippy::too_many_arguments)]
    fn attend_runs(
        &self,
        q: &mut AnyBuf,
        k: &mut AnyBuf,
        v: &AnyBuf,
        kvs: &mut [&mut KvCache],
        layer: usize,
        layout: &BatchLayout,
        a: &AttnOp<'_>,
        out: &mut AnyBuf,
        tmp: &mut RunBufs<AnyBuf>,
    ) {
        match self {
            AnyBackend::Cpu(be, sim) => {
                if let Some(sim) = sim {
                    sim.launch("attend_runs");
                }
                let (q, k, v, out) = (q.host_mut(), k.host_mut(), v.host(), out.host_mut());
                let take = |b| match b {
                    AnyBuf::Host(v) => Some(v),
                    _ => None,
                };
                with_bufs(tmp, None, take, AnyBuf::Host, |t| {
                    be.attend_runs(q, k, v, kvs, layer, layout, a, out, t)
                })
            }
            AnyBackend::Cuda(c) => {
                let be: &CudaBackend = c;
                let (q, k, v, out) = (q.dev_mut(), k.dev_mut(), v.dev(), out.dev_mut());
                let take = |b| match b {
                    AnyBuf::Dev(v) => Some(v),
                    _ => None,
                };
                with_bufs(tmp, None, take, AnyBuf::Dev, |t| {
                    be.attend_runs(q, k, v, kvs, layer, layout, a, out, t)
                })
            }
            AnyBackend::Split(s) => {
                let (i, be) = s.current();
                let (q, k, v, out) = (q.stage_mut(i), k.stage_mut(i), v.stage(i), out.stage_mut(i));
                with_bufs(tmp, Some(i), Some, std::convert::identity, |t| {
                    be.attend_runs(q, k, v, kvs, layer, layout, a, out, t)
                })
            }
        }
    }
    fn glu(&self, gate: &mut AnyBuf, up: &AnyBuf, len: usize, act: GluKind) {
        dispatch!(self, be, glu, [gate], [up], Backend::glu(be, gate, up, len, act))
    }
    #[allow(clippy::too_many_arguments)]
    fn moe(
        &self,
        ex: &Experts<'_>,
        logits: &mut AnyBuf,
        x: &AnyBuf,
        n_tok: usize,
        k: usize,
        normalize: bool,
        out: &mut AnyBuf,
        scratch: &mut MoeScratch,
    ) {
        dispatch!(
            self,
            be,
            moe,
            [logits, out],
            [x],
            be.moe(ex, logits, x, n_tok, k, normalize, out, scratch)
        )
    }
    #[allow(clippy::too_many_arguments)]
    fn moe_add_rms_norm(
        &self,
        router: &QMat<'_>,
        ex: &Experts<'_>,
        logits: &mut AnyBuf,
        h: &mut AnyBuf,
        n_tok: usize,
        k: usize,
        normalize: bool,
        tmp: &mut AnyBuf,
        x: &mut AnyBuf,
        norm: Option<&[f32]>,
        eps: f32,
        scratch: &mut MoeScratch,
    ) {
        dispatch!(
            self,
            be,
            moe_add_rms_norm,
            [logits, h, tmp, x],
            [],
            be.moe_add_rms_norm(router, ex, logits, h, n_tok, k, normalize, tmp, x, norm, eps, scratch)
        )
    }
    fn step_sequences(&self, n: usize) {
        match self {
            AnyBackend::Cuda(c) => c.step_sequences(n),
            AnyBackend::Split(s) => s.stages().iter().for_each(|st| st.be.step_sequences(n)),
            AnyBackend::Cpu(..) => {}
        }
    }

    fn forward_on_rayon(&self) -> bool {
        match self {
            AnyBackend::Cpu(c, _) => c.forward_on_rayon(),
            AnyBackend::Cuda(c) => c.forward_on_rayon(),
            AnyBackend::Split(s) => s.stages().iter().all(|st| st.be.forward_on_rayon()),
        }
    }

    fn step_begin(&self, n_tok: usize, key: StepKey) {
        match self {
            AnyBackend::Cuda(c) => c.step_begin(n_tok, key),
            AnyBackend::Split(s) => s.step_begin(n_tok, key),
            AnyBackend::Cpu(..) => {}
        }
    }
    fn step_end(&self) {
        match self {
            AnyBackend::Cuda(c) => c.step_end(),
            AnyBackend::Split(s) => s.step_end(),
            AnyBackend::Cpu(..) => {}
        }
    }
    fn batch_step_begin(&self, n_tok: usize, sequences: usize) {
        match self {
            AnyBackend::Cuda(c) => c.batch_step_begin(n_tok, sequences),
            AnyBackend::Split(s) => s
                .stages()
                .iter()
                .for_each(|st| st.be.batch_step_begin(n_tok, sequences)),
            AnyBackend::Cpu(..) => {}
        }
    }
    fn batch_step_end(&self) {
        match self {
            AnyBackend::Cuda(c) => c.batch_step_end(),
            AnyBackend::Split(s) => s.stages().iter().for_each(|st| st.be.batch_step_end()),
            AnyBackend::Cpu(..) => {}
        }
    }
    fn release_slot(&self, slot: SeqSlot) {
        match self {
            AnyBackend::Cuda(c) => c.release_slot(slot),
            AnyBackend::Split(s) => {
                s.forget_slot(slot);
                s.stages().iter().for_each(|st| st.be.release_slot(slot))
            }
            AnyBackend::Cpu(..) => {}
        }
    }
    fn kv_on_device(&self) -> bool {
        match self {
            AnyBackend::Cuda(_) => true,
            AnyBackend::Cpu(..) => false,
            AnyBackend::Split(s) => s.stages().iter().any(|st| st.be.kv_on_device()),
        }
    }
    fn reserve_kv(&self, kv: &crate::state::kv::KvCache, from: usize, to: usize) {
        match self {
            AnyBackend::Cuda(c) => c.reserve_kv(kv, from, to),
            AnyBackend::Split(s) => s.reserve_kv(kv, from, to),
            AnyBackend::Cpu(..) => {}
        }
    }
    fn routed_experts(&self, scratch: &MoeScratch, n_tok: usize, k: usize, out: &mut Vec<u32>) {
        match self {
            AnyBackend::Cuda(c) => c.routed_experts(scratch, n_tok, k, out),
            AnyBackend::Cpu(c, sim) => {
                if let Some(sim) = sim {
                    sim.launch("routed_experts");
                }
                c.routed_experts(scratch, n_tok, k, out)
            }
            AnyBackend::Split(s) => s.current().1.routed_experts(scratch, n_tok, k, out),
        }
    }
    fn replay_step(&self, key: StepKey, ids: &[u32], positions: &[u32]) -> bool {
        match self {
            AnyBackend::Cuda(c) => c.replay_step(key, ids, positions),
            AnyBackend::Split(s) => s.replay_step(key, ids, positions),
            AnyBackend::Cpu(..) => false,
        }
    }
    fn add_rms_norm_into(&self, x: &mut AnyBuf, y: &AnyBuf, out: &mut AnyBuf, rows: usize, w: &[f32], eps: f32) {
        dispatch!(
            self,
            be,
            add_rms_norm_into,
            [x, out],
            [y],
            be.add_rms_norm_into(x, y, out, rows, w, eps)
        )
    }
    #[allow(clippy::too_many_arguments)]
    fn qk_norm_rope(
        &self,
        q: &mut AnyBuf,
        k: &mut AnyBuf,
        n_head: usize,
        n_head_kv: usize,
        head_dim: usize,
        norms: (Option<&[f32]>, Option<&[f32]>),
        eps: f32,
        positions: &[u32],
        p: &RopeParams,
    ) {
        dispatch!(
            self,
            be,
            qk_norm_rope,
            [q, k],
            [],
            be.qk_norm_rope(q, k, n_head, n_head_kv, head_dim, norms, eps, positions, p)
        )
    }
    #[allow(clippy::too_many_arguments)]
    fn qk_norm_rope_store(
        &self,
        q: &mut AnyBuf,
        k: &mut AnyBuf,
        v: &AnyBuf,
        kv: &mut KvLayer,
        n_head: usize,
        head_dim: usize,
        norms: (Option<&[f32]>, Option<&[f32]>),
        eps: f32,
        positions: &[u32],
        p: &RopeParams,
    ) {
        dispatch!(
            self,
            be,
            qk_norm_rope_store,
            [q, k],
            [v],
            be.qk_norm_rope_store(q, k, v, kv, n_head, head_dim, norms, eps, positions, p)
        )
    }
    fn top_logits(&self, logits: &AnyBuf, n: usize) -> bool {
        dispatch!(self, be, top_logits, [], [logits], Backend::top_logits(be, logits, n))
    }
    fn read_top_logits(&self, n: usize, out: &mut crate::backend::top::TopLogits) -> bool {
        match self {
            AnyBackend::Cpu(c, sim) => {
                if let Some(sim) = sim {
                    sim.launch("read_top_logits");
                }
                c.read_top_logits(n, out)
            }
            AnyBackend::Cuda(c) => c.read_top_logits(n, out),
            AnyBackend::Split(s) => s.current().1.read_top_logits(n, out),
        }
    }
    fn top_logits_rows(&self, logits: &AnyBuf, rows: usize, n: usize) -> bool {
        dispatch!(
            self,
            be,
            top_logits_rows,
            [],
            [logits],
            Backend::top_logits_rows(be, logits, rows, n)
        )
    }
    fn read_top_logits_rows(&self, n: usize, out: &mut [crate::backend::top::TopLogits]) -> bool {
        match self {
            AnyBackend::Cpu(c, sim) => {
                if let Some(sim) = sim {
                    sim.launch("read_top_logits_rows");
                }
                c.read_top_logits_rows(n, out)
            }
            AnyBackend::Cuda(c) => c.read_top_logits_rows(n, out),
            AnyBackend::Split(s) => s.current().1.read_top_logits_rows(n, out),
        }
    }
    fn set_fault_policy(&self, faults: FaultPlan, gemm_fallback: bool) -> bool {
        match self {
            AnyBackend::Cpu(c, _) => c.set_fault_policy(faults, gemm_fallback),
            AnyBackend::Cuda(c) => c.set_fault_policy(faults, gemm_fallback),
            AnyBackend::Split(s) => s.stages().iter().fold(false, |any, st| {
                st.be.set_fault_policy(faults.clone(), gemm_fallback) | any
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    /// `AnyBackend` forwards every `Backend` method, those with a default too: a default here would silently
    /// replace the CUDA backend's own version (a fused launch, the device's candidate selection) with the
    /// generic one.
    #[test]
    fn any_backend_forwards_every_backend_method() {
        let trait_src = include_str!("../mod.rs");
        let start = trait_src.find("pub trait Backend").expect("the Backend trait");
        let body = &trait_src[start..];
        let end = body.find("\n}\n").expect("the trait's end");
        let here = include_str!("select.rs");
        let mut n = 0;
        for line in body[..end].lines() {
            let l = line.trim_start();
            if let Some(rest) = l.strip_prefix("fn ") {
                let name: String = rest.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect();
                n += 1;
                assert!(
                    here.contains(&format!("fn {name}(")),
                    "AnyBackend does not forward Backend::{name}"
                );
            }
        }
        assert!(
            n > 20,
            "found only {n} Backend methods: the parser no longer matches the trait"
        );
    }

    /// Every kernel a `sim:` sticky fault may name is one that `AnyBackend` launches there, and every op it
    /// launches is nameable.
    #[test]
    fn sim_kernels_are_the_launched_ops() {
        let here = include_str!("select.rs");
        let mut launched: Vec<String> = Vec::new();
        for (i, _) in here.match_indices("dispatch!(") {
            let args: Vec<&str> = here[i + 10..].splitn(4, ',').map(str::trim).collect();
            if args[0] == "self" && args[2] != "op" {
                launched.push(args[2].into());
            }
        }
        for (i, _) in here.match_indices("sim.launch(\"") {
            let rest = &here[i + 12..];
            launched.push(rest[..rest.find('"').unwrap()].into());
        }
        launched.sort();
        launched.dedup();
        let mut known: Vec<String> = crate::device::fault::SIM_KERNELS
            .iter()
            .map(|s| s.to_string())
            .collect();
        known.sort();
        assert_eq!(launched, known);
    }
}
