//! Mixture-of-experts on the device: the router's softmax and top-k, the experts reached by id at decode or as
//! grouped GEMMs in prefill, and their weighted sum (with the residual add and the next norm at decode).

use super::error::CudaError;
use super::experts::ExpertPool;
use super::launch::Arg;
use super::matmul::{MMVT_TOKENS, Q8K_STAGE_BYTES, mmvt_fits, q8k_stage_into};
use super::{
    CudaBackend, DevVec, Gpu, Inner, MMV_MAX_TOKENS, MMV_X_MAX, MOE_GROUP_INTS, MOE_GROUP_MAX_SLOTS, MOE_GROUP_T, Slot,
    glu_code, glu_dev, gpu_computes, grid1, mmv_moe_rows_per_block, norm_threads, typed,
};
use crate::backend::{Backend, Experts, MoeScratch, QMat};
use crate::quant::GgmlType;

/// The experts run on the device: types with kernels, and at most 1024 experts (the router kernel's staging); else
/// the CPU backend serves [`Backend::moe`] through host copies.
fn moe_on_device(ex: &Experts<'_>) -> bool {
    ex.n_expert <= 1024 && [ex.gate, ex.up, ex.down].iter().all(gpu_computes)
}

impl Inner {
    /// Most tokens of a step whose experts run on the decode kernels, by id (larger steps read the routing back
    /// and group the slots by expert on the host, as prefill does): with an expert cache (`pool`), in a step on
    /// its device slot table, what the table takes ([`ExpertPool::table_tokens`]: the step fits, or it would not
    /// be on the table), else [`MMV_MAX_TOKENS`] (its staging slots are sized for them: each layer reads the
    /// routing back to place them); for one sequence without a cache the same, so its logits are the same bits
    /// with a cache and without; for a step of several sequences without a cache, the `STRATA_MOE_DEVICE_TOKENS`
    /// setting, within what the group table takes (`k` experts per token). Batch-invariant steps take the
    /// device's routing at every size without a cache, in groups of this many
    /// ([`CudaBackend::set_batch_invariant`]).
    pub(super) fn device_routed_tokens(&self, pool: Option<&ExpertPool>, k: usize) -> usize {
        match pool {
            Some(p) if p.table_active() => p.table_tokens(),
            Some(_) => MMV_MAX_TOKENS,
            None if self.step_sequences <= 1 && !self.batch_invariant => MMV_MAX_TOKENS,
            None => self.moe_device_tokens.min(MOE_GROUP_MAX_SLOTS / k.max(1)).max(1),
        }
    }
}

/// Whether matrix `w`'s experts have a grouped kernel (`mmv_moe_group_*`: Q4_K and Q6_K with Q8_K activations,
/// rows of at most [`MMV_X_MAX`] values).
fn groups_experts(w: &QMat<'_>) -> bool {
    super::compile::q8k_several_tokens(w.ty) && w.cols <= MMV_X_MAX
}

/// The most groups `moe_groups` makes of `slots` routing slots over `n_expert` experts (the grouped kernels' grid):
/// at most one per slot, and per expert one per [`MOE_GROUP_T`] of its slots.
fn most_groups(slots: usize, n_expert: usize) -> usize {
    slots.min(slots.min(n_expert) + slots / MOE_GROUP_T)
}

/// Whether a decode step's down projection computes the GLU itself while it quantizes its activations (one launch
/// fewer): the Q4_K one, for rows within its staging; other types take the GLU kernel first.
fn fuses_glu(ex: &Experts<'_>) -> bool {
    ex.down.ty == GgmlType::Q4_K && ex.n_ff_exp <= MMV_X_MAX
}

/// Where [`Inner::moe_dispatch`] puts the experts' weighted sum (device addresses).
#[derive(Clone, Copy)]
enum MoeSum {
    /// Into `[n_tok][n_embd]` at this address (`moe_combine`).
    Out(u64),
    /// Added to the residual `x`, then `h = rms_norm(x) * w` (`w` 0: the add alone), in one launch at decode
    /// (`moe_combine_add_rms_norm`).
    AddNorm { x: u64, h: u64, w: u64, eps: f32 },
}

impl CudaBackend {
    /// [`Backend::moe`] (the trait's method calls this).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn moe_dev(
        &self,
        ex: &Experts<'_>,
        logits: &mut DevVec,
        x: &DevVec,
        n_tok: usize,
        k: usize,
        normalize: bool,
        out: &mut DevVec,
        scratch: &mut MoeScratch,
    ) {
        let n_embd = ex.gate.cols;
        assert!(
            x.capacity() >= n_tok * n_embd && out.capacity() >= n_tok * n_embd,
            "moe: shapes"
        );
        assert!(logits.capacity() >= n_tok * ex.n_expert, "moe: router logits");
        assert!(k >= 1 && k <= ex.n_expert, "moe: k of n_expert");
        if !moe_on_device(ex) {
            // Experts of a type without kernels, or more experts than the router kernel takes (1024): the CPU
            // backend, through host copies.
            let mut lh = self.to_host(logits, 0, n_tok * ex.n_expert);
            let xh = self.to_host(x, 0, n_tok * n_embd);
            let mut routing = std::mem::take(&mut scratch.routing);
            self.cpu.route(&mut lh, ex.n_expert, k, normalize, &mut routing);
            let mut oh = vec![0.0f32; n_tok * n_embd];
            self.cpu.moe_ffn(ex, &xh, &routing, &mut oh, scratch);
            scratch.routing = routing;
            self.lock().moe_on_host = true;
            return Backend::upload(self, &oh, out);
        }
        let g = &*self.gpu;
        let mut s = self.lock();
        s.moe_on_host = false;
        // Batch-invariant: every token on the device's routing, in groups it takes.
        let group = match s.batch_invariant {
            true => s.device_routed_tokens(s.experts.as_ref(), k),
            false => n_tok,
        };
        Self::check((|| {
            for t0 in (0..n_tok).step_by(group) {
                let n = (n_tok - t0).min(group);
                s.moe_route(g, logits.at(t0 * ex.n_expert), n, ex.n_expert, k, normalize)?;
                let sum = MoeSum::Out(out.at(t0 * n_embd));
                s.moe_dispatch(g, ex, x.at(t0 * n_embd), n, k, normalize, sum)?;
            }
            Ok(())
        })());
    }

    /// [`Backend::moe_add_rms_norm`] (the trait's method calls this).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn moe_add_rms_norm_dev(
        &self,
        router: &QMat<'_>,
        ex: &Experts<'_>,
        logits: &mut DevVec,
        h: &mut DevVec,
        n_tok: usize,
        k: usize,
        normalize: bool,
        tmp: &mut DevVec,
        x: &mut DevVec,
        norm: Option<&[f32]>,
        eps: f32,
        scratch: &mut MoeScratch,
    ) {
        let n_embd = ex.gate.cols;
        let (device_tokens, invariant) = {
            let s = self.lock();
            (s.device_routed_tokens(s.experts.as_ref(), k), s.batch_invariant)
        };
        if (n_tok > device_tokens && !invariant) || !moe_on_device(ex) {
            return crate::backend::moe_add_rms_norm_steps(
                self, router, ex, logits, h, n_tok, k, normalize, tmp, x, norm, eps, scratch,
            );
        }
        // The router routes in its own launch (router_route) when it is the f32 matrix mmv_wide_f32 serves.
        let routed_by_router = router.ty == GgmlType::F32
            && router.rows == ex.n_expert
            && router.cols == n_embd
            && n_embd.is_multiple_of(4)
            && k <= 64;
        if !routed_by_router {
            self.matmul(router, h, n_tok, logits);
        }
        assert!(
            h.capacity() >= n_tok * n_embd && x.capacity() >= n_tok * n_embd,
            "moe_add_rms_norm: shapes"
        );
        assert!(norm.is_none_or(|w| w.len() == n_embd), "moe_add_rms_norm: norm width");
        assert!(logits.capacity() >= n_tok * ex.n_expert, "moe: router logits");
        assert!(k >= 1 && k <= ex.n_expert, "moe: k of n_expert");
        let g = &*self.gpu;
        let mut s = self.lock();
        s.moe_on_host = false;
        Self::check((|| {
            let w = s.norm_weights(g, norm)?;
            let rw = match routed_by_router {
                true => {
                    let rw = s.weights.device_ptr(&g.stream, router.data)?;
                    if s.routers.len() <= ex.layer {
                        s.routers.resize(ex.layer + 1, (0, 0, 0));
                    }
                    s.routers[ex.layer] = (rw, router.rows, router.cols);
                    rw
                }
                false => 0,
            };
            // Batch-invariant steps of more tokens than the device's routing takes run in groups of them (each
            // token's arithmetic is the same in any group).
            for t0 in (0..n_tok).step_by(device_tokens) {
                let n = (n_tok - t0).min(device_tokens);
                let (hp, lp) = (h.at(t0 * n_embd), logits.at(t0 * ex.n_expert));
                if routed_by_router {
                    let ids = s.slot(g, Slot::MoeIds, n * k * 4)?;
                    let wts = s.slot(g, Slot::MoeW, n * k * 4)?;
                    let route = RouterRoute {
                        router: rw,
                        x: hp,
                        n_tok: n,
                        logits: lp,
                        ids,
                        wts,
                    };
                    s.router_route(g, &route, ex.n_expert, n_embd, k, normalize)?;
                } else {
                    s.moe_route(g, lp, n, ex.n_expert, k, normalize)?;
                }
                let sum = MoeSum::AddNorm {
                    x: x.at(t0 * n_embd),
                    h: hp,
                    w,
                    eps,
                };
                s.moe_dispatch(g, ex, hp, n, k, normalize, sum)?;
            }
            Ok(())
        })());
    }
}

/// Device addresses of one `router_route` launch: the f32 router (`[n_expert][n_embd]`), the `n_tok` tokens'
/// activations, and where the logits (`[n_tok][n_expert]`), experts and weights (`[n_tok][k]`) go.
struct RouterRoute {
    router: u64,
    x: u64,
    n_tok: usize,
    logits: u64,
    ids: u64,
    wts: u64,
}

/// Where a dispatch finds its experts: each matrix's (gate, up, down) base address and the bytes from one expert
/// (or cache slot) to the next; kernels index them by expert id, or by slot id with a cache.
struct ExpertsAt {
    base: [u64; 3],
    stride: [usize; 3],
}

/// The experts of `ex`'s layer in the cache's slots.
fn pool_at(pool: &ExpertPool, ex: &Experts<'_>) -> ExpertsAt {
    ExpertsAt {
        base: [0, 1, 2].map(|m| pool.base(ex, m)),
        stride: [pool.stride(); 3],
    }
}

/// `n` f32 values at `src` to f16 at `dst` (`f32_to_f16`).
fn f16_rows(gpu: &Gpu, src: u64, dst: u64, n: usize) -> Result<(), CudaError> {
    gpu.launch(
        "f32_to_f16",
        grid1(n.div_ceil(8), 256),
        (256, 1, 1),
        &[Arg::P(src), Arg::P(dst), Arg::L(n as i64)],
    )
}

impl Inner {
    /// The router's choice on the device (`moe_route`): `ids`/`wts` ([n_tok][k]) into their slots from the
    /// logits at `logits` ([n_tok][n_expert], overwritten by the probabilities).
    fn moe_route(
        &mut self,
        gpu: &Gpu,
        logits: u64,
        n_tok: usize,
        n_expert: usize,
        k: usize,
        normalize: bool,
    ) -> Result<(), CudaError> {
        let ids = self.slot(gpu, Slot::MoeIds, n_tok * k * 4)?;
        let wts = self.slot(gpu, Slot::MoeW, n_tok * k * 4)?;
        gpu.launch(
            "moe_route",
            (n_tok as u32, 1, 1),
            (256, 1, 1),
            &[
                Arg::P(logits),
                Arg::P(ids),
                Arg::P(wts),
                Arg::I(n_expert as i32),
                Arg::I(k as i32),
                Arg::I(normalize as i32),
            ],
        )
    }

    /// Expert dispatch on the device once routed ([`Inner::moe_route`]): `x` `[n_tok][n_embd]`; the weighted sum
    /// goes where `sum` says. The experts come from the expert cache when the backend has one, else from the
    /// resident copies of the stacked tensors.
    #[allow(clippy::too_many_arguments)]
    fn moe_dispatch(
        &mut self,
        gpu: &Gpu,
        ex: &Experts<'_>,
        xp: u64,
        n_tok: usize,
        k: usize,
        normalized: bool,
        sum: MoeSum,
    ) -> Result<(), CudaError> {
        let on_table = self.experts.as_ref().is_some_and(|p| p.table_active());
        if let Some(replay) = self.replay.as_mut().filter(|_| !on_table) {
            // The trace's experts in place of the router's (the router's weights stay); on the device's slot
            // table, the step's routing is on the device already (`table_lookup` copies it in).
            let mut ids = Vec::new();
            replay.next(ex.layer, n_tok, &mut ids);
            // Host data in the middle of a step: the step must not become a graph.
            gpu.flush_step()?;
            self.upload(gpu, Slot::MoeIds, bytemuck::cast_slice(&ids))?;
        }
        let mut pool = self.experts.take();
        let r = self.moe_dispatch_with(gpu, ex, xp, n_tok, k, normalized, sum, pool.as_mut());
        self.experts = pool;
        r
    }

    /// For a step of `n_tok` tokens whose routing slots at `ids` (`slots`: expert or cache slot ids, `MOE_SKIP`
    /// left out) read `ex`'s experts: their group table ([`Inner::moe_groups`]) when the step has several tokens,
    /// groups are on and a matrix of `ex` has a grouped kernel; else `None` (one weight read per slot).
    fn step_groups(
        &mut self,
        gpu: &Gpu,
        ex: &Experts<'_>,
        ids: u64,
        n_tok: usize,
        slots: usize,
    ) -> Result<Option<u64>, CudaError> {
        let groupable = groups_experts(&ex.gate) || groups_experts(&ex.down);
        match n_tok >= self.moe_groups_from && groupable {
            true => self.moe_groups(gpu, ids, slots).map(Some),
            false => Ok(None),
        }
    }

    /// The routing slots at `ids` (`slots` of them) grouped by expert on the device (`moe_groups`): the group
    /// table's address, for [`Inner::mmv_experts`].
    fn moe_groups(&mut self, gpu: &Gpu, ids: u64, slots: usize) -> Result<u64, CudaError> {
        assert!(slots <= MOE_GROUP_MAX_SLOTS, "moe_groups: {slots} routing slots");
        let groups = self.slot(gpu, Slot::MoeGroups, (1 + slots * MOE_GROUP_INTS) * 4)?;
        // A block of the next power of two of threads: its scan runs over the block.
        gpu.launch(
            "moe_groups",
            (1, 1, 1),
            (slots.next_power_of_two().max(32) as u32, 1, 1),
            &[Arg::P(ids), Arg::I(slots as i32), Arg::P(groups)],
        )?;
        Ok(groups)
    }

    /// The decode experts' launches: gate and up (one launch when they share type and stride), the GLU unless
    /// the down projection fuses it, and the down projection, each routing slot reading the expert (or cache
    /// slot) `ids` names at `at`; `bufs` are the gate, up and down outputs (`[slots][n_ff_exp]`,
    /// `[slots][n_ff_exp]`, `[slots][n_embd]`). With `groups` ([`Inner::moe_groups`] of `ids`), the matrices of
    /// a type with a grouped kernel read each expert's rows once per group of slots (the same results, bit for
    /// bit). `early`: the down projection's first weight loads may go out before it waits for the launch before
    /// it (no launch of the step wrote its weights: not when `expert_fetch` copied misses into their slots).
    #[allow(clippy::too_many_arguments)]
    fn mmv_experts(
        &mut self,
        gpu: &Gpu,
        ex: &Experts<'_>,
        at: &ExpertsAt,
        ids: u64,
        groups: Option<u64>,
        xp: u64,
        bufs: [u64; 3],
        k: usize,
        slots: usize,
        early: bool,
    ) -> Result<(), CudaError> {
        let (n_embd, nff) = (ex.gate.cols, ex.n_ff_exp);
        let [gp, up, dp] = bufs;
        let same = ex.gate.ty == ex.up.ty;
        let most_groups = most_groups(slots, ex.n_expert);
        #[allow(clippy::too_many_arguments)]
        let launch = |m: usize,
                      wb: u64,
                      x: u64,
                      ya: u64,
                      yb: u64,
                      div: usize,
                      w: &QMat<'_>,
                      rows: usize,
                      z: u32,
                      xu: u64,
                      early: bool| {
            let grouped = groups.filter(|_| groups_experts(w));
            let (kernel, ids, blocks_y) = match grouped {
                Some(g) => (typed("mmv_moe_group_", w.ty), g, most_groups),
                None => (typed("mmv_moe_", w.ty), ids, slots),
            };
            gpu.launch(
                kernel,
                (
                    rows.div_ceil(mmv_moe_rows_per_block(w.ty, w.cols)) as u32,
                    blocks_y as u32,
                    z,
                ),
                (256, 1, 1),
                &[
                    Arg::P(at.base[m]),
                    Arg::P(wb),
                    Arg::P(x),
                    Arg::P(ya),
                    Arg::P(yb),
                    Arg::P(ids),
                    Arg::I(div as i32),
                    Arg::I(rows as i32),
                    Arg::I(w.cols as i32),
                    Arg::L(w.row_bytes as i64),
                    Arg::L(at.stride[m] as i64),
                    Arg::P(xu),
                    Arg::I(glu_code(ex.act)),
                    Arg::I(early as i32),
                ],
            )
        };
        // Gate and up in one launch need the same type and the same stride (the kernel takes one).
        if same && at.stride[0] == at.stride[1] {
            launch(0, at.base[1], xp, gp, up, k, &ex.gate, nff, 2, 0, false)?;
        } else {
            launch(0, at.base[0], xp, gp, gp, k, &ex.gate, nff, 1, 0, false)?;
            launch(1, at.base[1], xp, up, up, k, &ex.up, nff, 1, 0, false)?;
        }
        let fused_glu = fuses_glu(ex);
        if !fused_glu {
            glu_dev(gpu, gp, up, slots * nff, ex.act)?;
        }
        launch(
            2,
            at.base[2],
            gp,
            dp,
            dp,
            1,
            &ex.down,
            n_embd,
            1,
            if fused_glu { up } else { 0 },
            // moe_route or router_route wrote the ids two launches back at least (with a cache, the host
            // wrote them before both): the down projection's first weight loads need not wait for the
            // gate/up launch (common.cuh, pdl_enter, says why that holds), unless `early` says a launch of this
            // step wrote those weights.
            early,
        )
    }

    /// The expert prefetch (`--expert-prefetch`) after layer `ex`'s experts on the device's table (the overlap
    /// path, which a fused GLU needs): the router of the layer right after it on this layer's input `xp`
    /// (`router_route`, into the prefetch's own slots), then [`ExpertPool::table_prefetch`] of the experts it
    /// picks. Nothing when the pool cannot prefetch that layer (not a MoE layer the table has looked up), or its
    /// router is not known yet or not an f32 matrix of this layer's shape.
    fn prefetch_next(
        &mut self,
        gpu: &Gpu,
        pool: &mut ExpertPool,
        ex: &Experts<'_>,
        xp: u64,
        normalized: bool,
    ) -> Result<(), CudaError> {
        let next = ex.layer + 1;
        let (n_expert, n_embd, k) = (ex.n_expert, ex.gate.cols, pool.config().k);
        let (rw, rows, cols) = self.routers.get(next).copied().unwrap_or((0, 0, 0));
        if rw == 0 || (rows, cols) != (n_expert, n_embd) || !pool.can_prefetch(next) {
            return Ok(());
        }
        let route = RouterRoute {
            router: rw,
            x: xp,
            n_tok: 1,
            logits: self.slot(gpu, Slot::PrefetchLogits, n_expert * 4)?,
            ids: self.slot(gpu, Slot::PrefetchIds, k * 4)?,
            wts: self.slot(gpu, Slot::PrefetchW, k * 4)?,
        };
        self.router_route(gpu, &route, n_expert, n_embd, k, normalized)?;
        pool.table_prefetch(gpu, next, route.ids)
    }

    /// `router_route` (kernels/matvec.cu): the router's logits and top-`k` choice in one launch, for `route`'s
    /// tokens, `n_expert` experts of width `n_embd`.
    ///
    /// Errors: the counters could not be made, or the launch failed.
    fn router_route(
        &mut self,
        gpu: &Gpu,
        route: &RouterRoute,
        n_expert: usize,
        n_embd: usize,
        k: usize,
        normalize: bool,
    ) -> Result<(), CudaError> {
        let cnt = self.counters(gpu)?;
        gpu.launch(
            "router_route",
            (n_expert as u32, route.n_tok as u32, 1),
            (256, 1, 1),
            &[
                Arg::P(route.router),
                Arg::P(route.x),
                Arg::P(route.logits),
                Arg::I(n_expert as i32),
                Arg::I(n_embd as i32),
                Arg::P(cnt),
                Arg::P(route.ids),
                Arg::P(route.wts),
                Arg::I(k as i32),
                Arg::I(normalize as i32),
            ],
        )
    }

    /// [`Inner::moe_dispatch`] with the expert cache (if any) out of `self`.
    #[allow(clippy::too_many_arguments)]
    fn moe_dispatch_with(
        &mut self,
        gpu: &Gpu,
        ex: &Experts<'_>,
        xp: u64,
        n_tok: usize,
        k: usize,
        normalized: bool,
        sum: MoeSum,
        mut pool: Option<&mut ExpertPool>,
    ) -> Result<(), CudaError> {
        let (n_embd, nff) = (ex.gate.cols, ex.n_ff_exp);
        let slots = n_tok * k;
        let ids = self.slots[Slot::MoeIds as usize].as_ref().expect("routed").ptr;
        let wts = self.slots[Slot::MoeW as usize].as_ref().expect("routed").ptr;
        let gp = self.slot(gpu, Slot::MoeGate, slots * nff * 4)?;
        let up = self.slot(gpu, Slot::MoeUp, slots * nff * 4)?;
        let dp = self.slot(gpu, Slot::MoeDown, slots * n_embd * 4)?;
        let resident = |s: &mut Self| -> Result<ExpertsAt, CudaError> {
            Ok(ExpertsAt {
                base: [
                    s.weights.device_ptr(&gpu.stream, ex.gate.data)?,
                    s.weights.device_ptr(&gpu.stream, ex.up.data)?,
                    s.weights.device_ptr(&gpu.stream, ex.down.data)?,
                ],
                stride: [
                    nff * ex.gate.row_bytes,
                    nff * ex.up.row_bytes,
                    n_embd * ex.down.row_bytes,
                ],
            })
        };
        let rows_map = if n_tok <= self.device_routed_tokens(pool.as_deref(), k) {
            // Decode: every slot reaches its expert by id on the device (by its cache slot's id with a cache).
            let bufs = [gp, up, dp];
            match pool.as_deref_mut() {
                None => {
                    let at = resident(self)?;
                    let groups = self.step_groups(gpu, ex, ids, n_tok, slots)?;
                    self.mmv_experts(gpu, ex, &at, ids, groups, xp, bufs, k, slots, true)?;
                }
                Some(pool) if pool.table_active() => {
                    // The device's slot table: the misses are copied in from the mapped arena and every expert is
                    // read from its slot (no host round trip: a step of one token stays a graph); with a CPU join
                    // (steps of one token), the CPU computes its share of the misses meanwhile, and cpu_join
                    // writes their rows before the sum. Several tokens' slots are grouped by cache slot, as the
                    // resident experts' by expert: the same bits.
                    let sp = self.slot(gpu, Slot::MoeSlotIds, 3 * slots * 4)?;
                    pool.table_lookup(gpu, ex, n_tok, ids, xp, sp, self.replay.is_some())?;
                    let at = pool_at(pool, ex);
                    let joins = n_tok == 1 && pool.table_joins();
                    // The GLU is fused into the Q4_K down projection alone; a separate GLU launch spans every
                    // slot, so the two halves below could not run side by side. A step of several tokens fetches
                    // first: its misses' launches, ungrouped beside the hits' grouped ones, and the second
                    // stream's events cost more than the overlap gave (x8 decode on the 30B shape at 10.7 GiB, an
                    // H100: 944 tok/s fetching first against 882 and 887 beside, reports/2026-12-07-h100-fetch-first/).
                    if pool.config().fetch_overlap && n_tok == 1 && fuses_glu(ex) {
                        // On a second stream, the misses are copied in and computed; on the stream, the hits
                        // are computed meanwhile (each half skips the other's slots: MOE_SKIP; one token's slots
                        // have no groups). The sum waits for both.
                        let (hits, misses) = (sp + (slots * 4) as u64, sp + (2 * slots * 4) as u64);
                        gpu.fork()?;
                        pool.table_fetch(gpu, ex)?;
                        self.mmv_experts(gpu, ex, &at, misses, None, xp, bufs, k, slots, false)?;
                        gpu.to_main()?;
                        // Experts prefetched for this layer are hits: their copies come first.
                        pool.wait_prefetch(gpu, ex.layer)?;
                        self.mmv_experts(gpu, ex, &at, hits, None, xp, bufs, k, slots, false)?;
                        if joins {
                            pool.table_cpu_join(gpu, dp, n_embd)?;
                        }
                        gpu.join()?;
                        self.prefetch_next(gpu, pool, ex, xp, normalized)?;
                    } else {
                        pool.wait_prefetch(gpu, ex.layer)?;
                        pool.table_fetch(gpu, ex)?;
                        let groups = self.step_groups(gpu, ex, sp, n_tok, slots)?;
                        self.mmv_experts(gpu, ex, &at, sp, groups, xp, bufs, k, slots, false)?;
                        if joins {
                            pool.table_cpu_join(gpu, dp, n_embd)?;
                        }
                    }
                }
                Some(pool) => {
                    let mut ids_h = vec![0u32; slots];
                    if pool.may_use_cpu(ex, slots) {
                        // The CPU may compute some misses: the activations come back with the routing (one wait).
                        // Launches a replayed step deferred run first.
                        gpu.flush_step()?;
                        pool.cpu.queue_x_read(&gpu.ctx, &gpu.stream, xp, n_tok * n_embd)?;
                    }
                    self.read_slot(gpu, Slot::MoeIds, &mut ids_h)?;
                    pool.begin(&gpu.stream, ex, true)?;
                    let on_cpu = pool.choose_cpu_misses(ex, &ids_h, k);
                    // The GPU's part: place the experts (hits in place, misses uploaded), then its launches.
                    let mut gpu_part = |s: &mut Self, pool: &mut ExpertPool| -> Result<(), CudaError> {
                        pool.place_decode(&gpu.stream, ex, &mut ids_h)?;
                        let sp = s.upload(gpu, Slot::MoeSlotIds, bytemuck::cast_slice(&ids_h))?;
                        s.mmv_experts(gpu, ex, &pool_at(pool, ex), sp, None, xp, bufs, k, slots, true)
                    };
                    if on_cpu {
                        // The CPU's workers start on their experts while this thread queues the GPU's part; the
                        // CPU's rows then replace the placeholder rows of dp.
                        let mut cpu = std::mem::take(&mut pool.cpu);
                        let queued = cpu.compute_beside(&gpu.ctx, ex, || gpu_part(self, pool));
                        pool.cpu = cpu;
                        queued??;
                        let n = pool.cpu.rows();
                        let src = self.slot(gpu, Slot::MoeCpuRows, n * (n_embd + 1) * 4)?;
                        pool.upload_cpu_rows(&gpu.stream, src)?;
                        gpu.launch(
                            "scatter_rows_f32",
                            grid1(n * n_embd, 256),
                            (256, 1, 1),
                            &[
                                Arg::P(src),
                                Arg::P(src + (n * n_embd * 4) as u64),
                                Arg::P(dp),
                                Arg::I(n as i32),
                                Arg::I(n_embd as i32),
                            ],
                        )?;
                    } else {
                        gpu_part(self, pool)?;
                    }
                }
            }
            0
        } else {
            // Prefill: read the routing back, group the slots by expert, one GEMM per expert and matrix.
            let mut ids_h = vec![0u32; slots];
            self.read_slot(gpu, Slot::MoeIds, &mut ids_h)?;
            let mut order: Vec<u32> = (0..slots as u32).collect();
            order.sort_by_key(|&s| (ids_h[s as usize], s));
            let mut row_of_slot = vec![0u32; slots];
            for (row, &s) in order.iter().enumerate() {
                row_of_slot[s as usize] = row as u32;
            }
            // Row r of the grouped work reads token tok_of_row[r] of x directly (no gathered copy).
            let tok_of_row: Vec<u32> = order.iter().map(|&s| s / k as u32).collect();
            let ip = self.upload(gpu, Slot::Idx, bytemuck::cast_slice(&tok_of_row))?;
            // A step of at most mmq_moe_tokens (STRATA_MMQ_PREFILL_TOKENS) runs its experts on mmq_moe_* (Q8_K activations, tiles of 8
            // of an expert's rows), a longer one on the GEMM (f16 activations). Not both in one step: a GEMM launch
            // for a few busy experts costs about what one for all of them does (its blocks' K loop, not the bytes,
            // sets its time), measured on an H100 at 128 tokens (reports/2026-12-06-h100-mmq.md).
            let mmq = self.mmq_on()
                && n_tok <= self.mmq_moe_tokens
                && [&ex.gate, &ex.up, &ex.down].iter().all(|w| mmvt_fits(w));
            let (xf, gf) = match !mmq {
                true => (
                    self.f16_copy(gpu, Slot::XF16, xp, n_tok * n_embd)?,
                    self.slot(gpu, Slot::GF16, slots * nff * 2)?,
                ),
                false => (0, 0),
            };
            let (xq, gq) = match mmq {
                true => (
                    self.q8k_stage(gpu, Slot::MoeQ8k, xp, n_tok, n_tok, n_embd, true)?,
                    self.slot(gpu, Slot::MoeQ8kDown, slots * Q8K_STAGE_BYTES)?,
                ),
                false => (0, 0),
            };
            let at = match pool.as_deref_mut() {
                None => resident(self)?,
                Some(pool) => {
                    pool.begin(&gpu.stream, ex, false)?;
                    pool_at(pool, ex)
                }
            };
            let gate = ex.gate.rows_slice(0, nff);
            let upm = ex.up.rows_slice(0, nff);
            let down = ex.down.rows_slice(0, n_embd);
            // Launches per matrix for a group of experts: tiles of up to 128 grouped rows for the GEMM, or of up to
            // 8 for mmq_moe_*, each naming its expert (or its slot). Without a cache every expert is one group;
            // with one, a group ends when the staging slots are full.
            let height = if mmq { MMVT_TOKENS } else { 128 };
            let group = |s: &mut Self, tiles: &[[i32; 3]], rows: std::ops::Range<usize>| -> Result<(), CudaError> {
                if tiles.is_empty() {
                    return Ok(());
                }
                let (r0, n) = ((rows.start * nff) as u64, rows.len() * nff);
                if mmq {
                    s.mmq_moe(gpu, &gate, at.base[0], at.stride[0], xq, ip, gp, tiles)?;
                    s.mmq_moe(gpu, &upm, at.base[1], at.stride[1], xq, ip, up, tiles)?;
                    // The GLU computed as the gated rows are quantized for the down projection.
                    let stage = gq + (rows.start * Q8K_STAGE_BYTES) as u64;
                    let glu = Some((up + r0 * 4, ex.act));
                    q8k_stage_into(gpu, gp + r0 * 4, stage, rows.len(), nff, true, glu)?;
                    s.mmq_moe(gpu, &down, at.base[2], at.stride[2], gq, 0, dp, tiles)
                } else {
                    s.gemm_own(gpu, &gate, at.base[0], at.stride[0], xf, ip, gp, tiles)?;
                    s.gemm_own(gpu, &upm, at.base[1], at.stride[1], xf, ip, up, tiles)?;
                    glu_dev(gpu, gp + r0 * 4, up + r0 * 4, n, ex.act)?;
                    f16_rows(gpu, gp + r0 * 4, gf + r0 * 2, n)?;
                    s.gemm_own(gpu, &down, at.base[2], at.stride[2], gf, 0, dp, tiles)
                }
            };
            let mut tiles: Vec<[i32; 3]> = Vec::new();
            let (mut first, mut group_first) = (0, 0);
            while first < slots {
                let e = ids_h[order[first] as usize];
                let m = order[first..].iter().take_while(|&&s| ids_h[s as usize] == e).count();
                let at_slot = match pool.as_deref_mut() {
                    None => e,
                    Some(pool) => match pool.slot(&gpu.stream, ex, e)? {
                        Some(slot) => slot,
                        None => {
                            // The group's staging slots are taken: queue its launches (after its uploads), then
                            // stage the next group into the other half while they run.
                            pool.ready(&gpu.stream)?;
                            group(self, &tiles, group_first..first)?;
                            pool.group_done(&gpu.stream)?;
                            tiles.clear();
                            group_first = first;
                            pool.slot(&gpu.stream, ex, e)?
                                .expect("a staging slot is free in the other half")
                        }
                    },
                };
                tiles.extend(
                    (0..m)
                        .step_by(height)
                        .map(|off| [at_slot as i32, (first + off) as i32, (m - off).min(height) as i32]),
                );
                first += m;
            }
            if let Some(pool) = pool.as_deref_mut() {
                pool.ready(&gpu.stream)?;
            }
            group(self, &tiles, group_first..slots)?;
            if let Some(pool) = pool {
                pool.group_done(&gpu.stream)?;
            }
            self.upload(gpu, Slot::MoeRows, bytemuck::cast_slice(&row_of_slot))?
        };
        let Some(outp) = (match sum {
            MoeSum::Out(outp) => Some(outp),
            MoeSum::AddNorm { x, h, w, eps } => {
                assert_eq!(rows_map, 0, "moe: the fused sum serves decode steps");
                gpu.launch(
                    "moe_combine_add_rms_norm",
                    (n_tok as u32, 1, 1),
                    (norm_threads(n_embd), 1, 1),
                    &[
                        Arg::P(dp),
                        Arg::P(wts),
                        Arg::P(x),
                        Arg::P(h),
                        Arg::P(w),
                        Arg::I(k as i32),
                        Arg::I(n_embd as i32),
                        Arg::I(normalized as i32),
                        Arg::F(eps),
                    ],
                )?;
                None
            }
        }) else {
            return Ok(());
        };
        gpu.launch(
            "moe_combine",
            grid1(n_tok * n_embd, 256),
            (256, 1, 1),
            &[
                Arg::P(dp),
                Arg::P(rows_map),
                Arg::P(wts),
                Arg::P(outp),
                Arg::I(n_tok as i32),
                Arg::I(k as i32),
                Arg::I(n_embd as i32),
                Arg::I(normalized as i32),
            ],
        )
    }
}
