//! Matrix products on the device: matrix-vector kernels for a few tokens; for more, the prefill GEMM (cuBLAS on f16
//! copies, or our tensor-core kernel once the library has failed, and always for a MoE layer's experts).

use cudarc::cublas::sys as blas_sys;

use super::error::CudaError;
use super::launch::Arg;
use super::{Gpu, Inner, MMV_X_MAX, Slot, grid1, mmv_rows_per_block, typed};
use crate::backend::{GluKind, QMat};
use crate::device::fault::OP_PREFILL_GEMM;
use crate::events::{self, EventKind, Fallback, Fault, GemmShape};
use crate::quant::GgmlType;

/// Most rows of a grid's second dimension (CUDA's limit): `mmv`'s launches carry a token per row.
const GRID_Y_MAX: usize = 65_535;

/// Tokens one block of `mmvt_*` reads each weight row for (kernels/matvec.cu, MMV_T); also the most rows of a
/// tile of `mmq_moe_*`.
pub(super) const MMVT_TOKENS: usize = 8;
/// Rows of one tile of `mmq_*` and `mmq_moe_*` (kernels/matvec.cu, MMQ_ROWS).
pub(super) const MMQ_ROWS: usize = 16;
/// Rows one block of `mmq_*` computes: two tiles of [`MMQ_ROWS`] (kernels/matvec.cu, MMQ_DENSE_RT).
pub(super) const MMQ_DENSE_ROWS: usize = 2 * MMQ_ROWS;
/// Rows one block of `mmq_moe_*` computes: two tiles of [`MMQ_ROWS`] (kernels/matvec.cu, MMQ_MOE_RT).
pub(super) const MMQ_MOE_ROWS: usize = 2 * MMQ_ROWS;
/// Bytes of one activation row staged as Q8_K (kernels/matvec.cu, `Q8kStage`; a static_assert there checks it).
pub(super) const Q8K_STAGE_BYTES: usize = 5184;

/// `n_tok` activation rows of `cols` values at `xp` quantized to Q8_K (`q8k_stage`) into the stages at `st`
/// (`Q8K_STAGE_BYTES` a row), in Q4_K's lane order or in order (`natural`). With `glu` (`up` rows as `xp`'s,
/// the activation), row t is the GLU `act(xp[t]) * up[t]` before it is quantized. Errors: the launch failed.
pub(super) fn q8k_stage_into(
    gpu: &Gpu,
    xp: u64,
    st: u64,
    n_tok: usize,
    cols: usize,
    natural: bool,
    glu: Option<(u64, GluKind)>,
) -> Result<(), CudaError> {
    let (up, act) = glu.map_or((0, 0), |(u, a)| (u, super::glu_code(a)));
    gpu.launch(
        "q8k_stage",
        (n_tok as u32, cols.div_ceil(2048) as u32, 1),
        (256, 1, 1),
        &[
            Arg::P(xp),
            Arg::P(up),
            Arg::P(st),
            Arg::I(cols as i32),
            Arg::I(act),
            Arg::I(natural as i32),
        ],
    )
}
/// Most tokens one `mmvt_*` launch takes (a longer batch-invariant prefill runs in parts), so the Q8_K staging
/// stays at 5 MiB.
const MMVT_MAX_TOKENS: usize = 1024;

/// Whether `mmvt_*` (several tokens per loaded weight row) computes `w`: a type of
/// [`super::compile::q8k_several_tokens`], rows of 256 to [`MMV_X_MAX`] values (the Q8_K staging's size).
pub(super) fn mmvt_fits(w: &QMat<'_>) -> bool {
    super::compile::q8k_several_tokens(w.ty) && w.cols.is_multiple_of(256) && (256..=MMV_X_MAX).contains(&w.cols)
}

/// Most tokens a matrix that `mmvt_*` does not take runs as matrix-vector products, each token reading its rows
/// again: 8, or the `STRATA_MMV_DENSE_TOKENS` setting when lower (measured on an H100 before `mmvt_*`: 16 was
/// slower than the GEMM at 16 tokens, `reports/2026-12-05-h100-batch-invariant.md`).
const MMV_PER_TOKEN_MAX: usize = 8;

impl Inner {
    /// Matrix-vector products of up to three matrices of one type and width over the same `n_tok` activation
    /// rows (one launch): `ys[i][t][r] = ws[i][r] · x[t]`. Several tokens (or one, when batch-invariant) of a
    /// matrix [`mmvt_fits`] takes take `mmvt_*`, which reads each weight row once for up to [`MMVT_TOKENS`] of
    /// them and gives a token the same bits whatever the others are; otherwise each token reads the rows again.
    pub(super) fn mmv(
        &mut self,
        gpu: &Gpu,
        ws: &[(&QMat<'_>, u64, u64)],
        xp: u64,
        n_tok: usize,
    ) -> Result<(), CudaError> {
        assert!((1..=3).contains(&ws.len()), "mmv: one to three matrices");
        let w0 = ws[0].0;
        let t_max = if (n_tok > 1 || self.batch_invariant) && mmvt_fits(w0) {
            MMVT_MAX_TOKENS
        } else {
            GRID_Y_MAX
        };
        if n_tok > t_max {
            // Launches of at most t_max tokens: the grid's rows (a token per block row), or mmvt's staging.
            for t0 in (0..n_tok).step_by(t_max) {
                let at: Vec<(&QMat<'_>, u64, u64)> = ws
                    .iter()
                    .map(|&(w, wp, yp)| (w, wp, yp + (t0 * w.rows * 4) as u64))
                    .collect();
                self.mmv(gpu, &at, xp + (t0 * w0.cols * 4) as u64, (n_tok - t0).min(t_max))?;
            }
            return Ok(());
        }
        let mut p = [(0u64, 0u64, 0i32); 3];
        for (i, (w, wp, yp)) in ws.iter().enumerate() {
            p[i] = (*wp, *yp, w.rows as i32);
        }
        let total: usize = ws.iter().map(|(w, _, _)| w.rows).sum();
        let mmvt = (n_tok > 1 || self.batch_invariant) && mmvt_fits(w0);
        if ws.len() == 1 && w0.ty == GgmlType::F32 && total <= 1024 && w0.cols.is_multiple_of(4) {
            // A router: too few rows to spread a warp per row over the SMs.
            return gpu.launch(
                "mmv_wide_f32",
                (total as u32, n_tok as u32, 1),
                (256, 1, 1),
                &[
                    Arg::P(p[0].0),
                    Arg::P(xp),
                    Arg::P(p[0].1),
                    Arg::I(total as i32),
                    Arg::I(w0.cols as i32),
                ],
            );
        }
        // Four rows per warp only where that still gives every SM of a large GPU two blocks (264 at 132 SMs):
        // smaller matrices take the one-row kernel, whose blocks spread over all of them.
        let one_row = total.div_ceil(32) < 264;
        // On the integer tensor cores: two tiles of 16 rows and 8 tokens a block.
        let mmq = mmvt && self.mmq_on() && matches!(w0.ty, GgmlType::Q4_K | GgmlType::Q6_K);
        let (kernel, per_block, x, grid_y) = if mmvt {
            // The activations quantized once, then every block of the product reads them. The slot is sized for
            // 16 tokens at least, so batches that grow a token at a time do not reallocate it step after step.
            // mmq_* read Q4_K's activations in order too.
            let natural = w0.ty == GgmlType::Q6_K || mmq;
            let st = self.q8k_stage(gpu, Slot::Q8k, xp, n_tok, n_tok.max(2 * MMVT_TOKENS), w0.cols, natural)?;
            let (k, n) = match (mmq, one_row) {
                (true, _) => ("mmq_", MMQ_DENSE_ROWS),
                (false, true) => ("mmvt1_", 8),
                (false, false) => ("mmvt_", 32),
            };
            (typed(k, w0.ty), n, st, n_tok.div_ceil(MMVT_TOKENS))
        } else {
            match mmv_rows_per_block(w0.ty) {
                32 if one_row => (typed("mmv1_", w0.ty), 8, xp, n_tok),
                n => (typed("mmv_", w0.ty), n, xp, n_tok),
            }
        };
        let mut args = vec![
            Arg::P(p[0].0),
            Arg::P(p[1].0),
            Arg::P(p[2].0),
            Arg::P(x),
            Arg::P(p[0].1),
            Arg::P(p[1].1),
            Arg::P(p[2].1),
            Arg::I(p[0].2),
            Arg::I(p[1].2),
            Arg::I(p[2].2),
            Arg::I(w0.cols as i32),
            Arg::L(w0.row_bytes as i64),
        ];
        if mmvt {
            args.push(Arg::I(n_tok as i32));
        }
        gpu.launch(
            kernel,
            (total.div_ceil(per_block) as u32, grid_y as u32, 1),
            (256, 1, 1),
            &args,
        )
    }

    /// Whether products of several Q4_K / Q6_K tokens may take the integer tensor cores (`mmq_*`, `mmq_moe_*`):
    /// `STRATA_MMQ` on and not batch-invariant (which keeps a lone decode step's kernels).
    pub(super) fn mmq_on(&self) -> bool {
        self.mmq && !self.batch_invariant
    }

    /// Most tokens a dense matmul runs as matrix-vector products: `STRATA_MMV_DENSE_TOKENS` (or
    /// [`super::CudaBackend::set_mmv_dense_tokens`]) when set, else [`super::MMV_DENSE_TOKENS_MMQ`] while `mmq_*`
    /// takes them ([`Inner::mmq_on`]) and [`super::MMV_DENSE_TOKENS`] while dp4a does.
    pub(super) fn mmv_dense_tokens(&self) -> usize {
        self.mmv_dense_tokens.unwrap_or(match self.mmq_on() {
            true => super::MMV_DENSE_TOKENS_MMQ,
            false => super::MMV_DENSE_TOKENS,
        })
    }

    /// `n_tok` activation rows of `cols` values at `xp` quantized to Q8_K (`q8k_stage`) into `slot`, sized for
    /// at least `room` rows: in Q4_K's lane order, or in order (`natural`: Q6_K's kernels and `mmq_*`). Returns
    /// the stages' address (`Q8K_STAGE_BYTES` a row). `cols` is a multiple of 256, at most [`MMV_X_MAX`].
    #[allow(clippy::too_many_arguments)]
    pub(super) fn q8k_stage(
        &mut self,
        gpu: &Gpu,
        slot: Slot,
        xp: u64,
        n_tok: usize,
        room: usize,
        cols: usize,
        natural: bool,
    ) -> Result<u64, CudaError> {
        let st = self.slot(gpu, slot, n_tok.max(room) * Q8K_STAGE_BYTES)?;
        q8k_stage_into(gpu, xp, st, n_tok, cols, natural, None)?;
        Ok(st)
    }

    /// A MoE layer's matrix `w` (one expert's rows; experts `expert_stride` bytes apart from `wp`) over the
    /// grouped rows of experts with few tokens, on the integer tensor cores (`mmq_moe_*`): `tiles` are (expert or
    /// cache slot id, first grouped row, rows <= 8); grouped row r reads the Q8_K stage `st` + `xrows[r]` (row r
    /// without `xrows`) and writes row r of `yp` (`[rows][w.rows]` f32). Errors: the upload or the launch failed.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn mmq_moe(
        &mut self,
        gpu: &Gpu,
        w: &QMat<'_>,
        wp: u64,
        expert_stride: usize,
        st: u64,
        xrows: u64,
        yp: u64,
        tiles: &[[i32; 3]],
    ) -> Result<(), CudaError> {
        let tp = self.upload(gpu, Slot::MmqTiles, bytemuck::cast_slice(tiles))?;
        gpu.launch(
            typed("mmq_moe_", w.ty),
            (w.rows.div_ceil(MMQ_MOE_ROWS) as u32, tiles.len() as u32, 1),
            (256, 1, 1),
            &[
                Arg::P(wp),
                Arg::L(expert_stride as i64),
                Arg::L(w.row_bytes as i64),
                Arg::P(tp),
                Arg::P(st),
                Arg::P(xrows),
                Arg::P(yp),
                Arg::I(w.rows as i32),
                Arg::I(w.cols as i32),
            ],
        )
    }

    /// `y[t][r] = W[r] · x[t]` on device buffers: matrix-vector kernels for a few tokens (up to
    /// [`Inner::mmv_dense_tokens`]) and for every step when batch-invariant, else the GEMM.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn matmul_dev(
        &mut self,
        gpu: &Gpu,
        w: &QMat<'_>,
        wp: u64,
        xp: u64,
        n_tok: usize,
        yp: u64,
    ) -> Result<(), CudaError> {
        let (rows, cols) = (w.rows, w.cols);
        let mmv_max = match mmvt_fits(w) {
            true => self.mmv_dense_tokens(),
            false => self.mmv_dense_tokens().min(MMV_PER_TOKEN_MAX),
        };
        if n_tok <= mmv_max || self.batch_invariant {
            return self.mmv(gpu, &[(w, wp, yp)], xp, n_tok);
        }
        if !self.blas_failed {
            let fault = match self.fault_gemm_above {
                Some(m) if n_tok > m => Some(format!(
                    "injected failure ({}={OP_PREFILL_GEMM}:m>{m})",
                    crate::device::fault::ENV_FAULT
                )),
                _ => None,
            };
            let r = match fault {
                Some(why) => Err(why),
                None => {
                    let wf = self.slot(gpu, Slot::WF16, rows * cols * 2)?;
                    gpu.launch(
                        typed("dq_f16_", w.ty),
                        grid1(rows * cols / 32, 256),
                        (256, 1, 1),
                        &[
                            Arg::P(wp),
                            Arg::P(wf),
                            Arg::I(rows as i32),
                            Arg::I(cols as i32),
                            Arg::L(w.row_bytes as i64),
                        ],
                    )?;
                    let xf = self.f16_copy(gpu, Slot::XF16, xp, n_tok * cols)?;
                    gpu.timed("cublasGemmEx", || self.gemm_blas(wf, xf, yp, rows, cols, n_tok))
                }
            };
            match r {
                Ok(()) => return Ok(()),
                Err(why) if self.gemm_fallback => {
                    self.blas_failed = true;
                    events::emit(EventKind::Fallback(Fallback {
                        op: OP_PREFILL_GEMM.into(),
                        from: "blas".into(),
                        to: "gemm_tensor_core".into(),
                        why: format!("cublasGemmEx: {why}"),
                        shape: Some(GemmShape {
                            m: n_tok,
                            n: rows,
                            k: cols,
                        }),
                        max_rows: None,
                    }));
                }
                Err(why) => {
                    events::emit(EventKind::Fault(Fault {
                        error: format!("{why} (--gemm-fallback off)"),
                        op: Some(OP_PREFILL_GEMM.into()),
                        kernel: Some("cublasGemmEx".into()),
                        shape: Some(GemmShape {
                            m: n_tok,
                            n: rows,
                            k: cols,
                        }),
                        ..Fault::default()
                    }));
                    return Err(CudaError::Launch {
                        kernel: "cublasGemmEx".into(),
                        grid: (0, 0, 0),
                        block: (0, 0, 0),
                        call: gpu.launches(),
                        error: why,
                    });
                }
            }
        }
        let tiles: Vec<[i32; 3]> = (0..n_tok)
            .step_by(128)
            .map(|r| [0, r as i32, (n_tok - r).min(128) as i32])
            .collect();
        let xf = self.f16_copy(gpu, Slot::XF16, xp, n_tok * cols)?;
        self.gemm_own(gpu, w, wp, 0, xf, 0, yp, &tiles)
    }

    /// `n` f32 values at `xp` as f16 in slot `s` (the tensor-core GEMMs' activations); returns the slot's address.
    pub(super) fn f16_copy(&mut self, gpu: &Gpu, s: Slot, xp: u64, n: usize) -> Result<u64, CudaError> {
        let xf = self.slot(gpu, s, n * 2)?;
        gpu.launch(
            "f32_to_f16",
            grid1(n.div_ceil(8), 256),
            (256, 1, 1),
            &[Arg::P(xp), Arg::P(xf), Arg::L(n as i64)],
        )?;
        Ok(xf)
    }

    /// Our tensor-core GEMM (`gemm_T`, kernels/gemm.cu) over row tiles of up to 128: `tiles` lists (expert, first
    /// row, rows); expert e's matrix starts `e * expert_stride` bytes after `wp`. `y[r][n] = W_e[n] · x[r]` with
    /// `x` `[..][k]` in f16 ([`Inner::f16_copy`]) and `y` `[..][n]` in f32. Each block computes its tile at the
    /// smallest height of 32, 64 and 128 rows that holds it and is at least `gemm_min_tile`, the same bits at any.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn gemm_own(
        &mut self,
        gpu: &Gpu,
        w: &QMat<'_>,
        wp: u64,
        expert_stride: usize,
        xp: u64,
        xrows: u64,
        yp: u64,
        tiles: &[[i32; 3]],
    ) -> Result<(), CudaError> {
        let tp = self.upload(gpu, Slot::Tiles, bytemuck::cast_slice(tiles))?;
        gpu.launch(
            typed("gemm_", w.ty),
            (w.rows.div_ceil(128) as u32, tiles.len() as u32, 1),
            (256, 1, 1),
            &[
                Arg::P(wp),
                Arg::L(expert_stride as i64),
                Arg::L(w.row_bytes as i64),
                Arg::P(xp),
                Arg::P(xrows),
                Arg::P(yp),
                Arg::P(tp),
                Arg::I(w.rows as i32),
                Arg::I(w.cols as i32),
                Arg::I(self.gemm_min_tile as i32),
            ],
        )
    }

    /// cuBLAS: out (column-major rows × n_tok) = Wᵀ' (W row-major is column-major cols × rows) · X.
    pub(super) fn gemm_blas(
        &self,
        wf: u64,
        xf: u64,
        yp: u64,
        rows: usize,
        cols: usize,
        n_tok: usize,
    ) -> Result<(), String> {
        let blas = self.blas.as_ref().ok_or("cuBLAS not loaded")?;
        let (alpha, beta) = (1.0f32, 0.0f32);
        // SAFETY: wf holds rows × cols f16, xf n_tok × cols f16, yp n_tok × rows f32 (sized by the caller).
        unsafe {
            cudarc::cublas::result::gemm_ex(
                *blas.handle(),
                blas_sys::cublasOperation_t::CUBLAS_OP_T,
                blas_sys::cublasOperation_t::CUBLAS_OP_N,
                rows as i32,
                n_tok as i32,
                cols as i32,
                (&alpha as *const f32).cast(),
                wf as *const std::ffi::c_void,
                blas_sys::cudaDataType::CUDA_R_16F,
                cols as i32,
                xf as *const std::ffi::c_void,
                blas_sys::cudaDataType::CUDA_R_16F,
                cols as i32,
                (&beta as *const f32).cast(),
                yp as *mut std::ffi::c_void,
                blas_sys::cudaDataType::CUDA_R_32F,
                rows as i32,
                blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                blas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(|e| format!("{e:?}"))
    }
}
