//! The CUDA backend: the [`Backend`] ops as CUDA kernels (kernels/*.cu, compiled by NVRTC at start).
//!
//! Design (issue 6, first step): the trait passes host slices, so each op copies its activations to the device,
//! runs its kernels and copies the result back. What is large stays on the device: every weight matrix is
//! copied once, on first use, into a [`store::WeightStore`] (all resident in VRAM here; experts are reached
//! through the same interface, one buffer per expert), and each KV cache has a device twin keyed by its host
//! address, which is the cache's only copy of the data (the host `KvCache` keeps the layout). The forward pass
//! stays the one of `model::forward`. Ops the GPU does not compute (IQ weight types, the router's softmax and
//! top-k, which read a few hundred values) run on the CPU backend, which defines the semantics anyway.
//!
//! Semantics follow the CPU backend (`backend::cpu`), including the f16 rounding of queries and probabilities
//! against an f16 cache; quantized weights multiply f32 activations (the CPU quantizes them to int8 first). The
//! parity test (engine/tests/cuda_parity.rs) states each op's tolerance.
//!
//! Prefill GEMM: weights dequantized to f16, activations converted to f16, cuBLAS `GemmEx` with f32 accumulation.
//! When the library fails, the backend falls back for good to our own kernel (`gemm_f16_tiled`) after one
//! `fallback` event (seed 000). `STRATA_FAULT_BLAS_GEMM_ABOVE=M` makes the library "fail" for batches over M
//! tokens, to exercise that path on real hardware.
//!
//! Errors: the trait has no error path, so a failed kernel panics after writing its `fault` event (the serve
//! worker's panic hook then exits and the server restarts it, DESIGN.md section 3).

pub mod events;
pub mod loader;
pub mod runtime;
pub mod select;
pub mod store;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use cudarc::cublas::CudaBlas;
use cudarc::cublas::sys as blas_sys;

use super::cpu::CpuBackend;
use super::{AttnParams, Backend, Experts, GluKind, MoeScratch, QMat, RopeKind, RopeParams, Routing};
use crate::quant::GgmlType;
use crate::runtime::kv::{KvLayer, KvRows};
use runtime::{Arg, CudaError, Gpu};
use store::{DevBuf, ResidentStore, WeightStore};

/// Most tokens a matmul runs as matrix-vector products; larger batches use the GEMM.
const MMV_MAX_TOKENS: usize = 4;
/// Keys per split of the decode attention's P·V pass.
const ATTN_SPLIT_KEYS: usize = 128;

/// The kernel-name suffix of a weight type the GPU computes with; `None`: the CPU runs that matmul.
pub fn kernel_type(ty: GgmlType) -> Option<&'static str> {
    Some(match ty {
        GgmlType::F32 => "f32",
        GgmlType::F16 => "f16",
        GgmlType::BF16 => "bf16",
        GgmlType::Q4_0 => "q4_0",
        GgmlType::Q4_1 => "q4_1",
        GgmlType::Q5_0 => "q5_0",
        GgmlType::Q5_1 => "q5_1",
        GgmlType::Q8_0 => "q8_0",
        GgmlType::Q2_K => "q2_k",
        GgmlType::Q3_K => "q3_k",
        GgmlType::Q4_K => "q4_k",
        GgmlType::Q5_K => "q5_k",
        GgmlType::Q6_K => "q6_k",
        _ => return None,
    })
}

/// Whether the GPU computes with `w` (a supported type in whole 32-value chunks).
pub fn gpu_computes(w: &QMat<'_>) -> bool {
    kernel_type(w.ty).is_some() && w.cols.is_multiple_of(32)
}

/// `&'static str` kernel names for the per-type kernels (the launcher keys kernels by static names).
fn typed(prefix: &str, ty: GgmlType) -> &'static str {
    let suffix = kernel_type(ty).expect("caller checked the type");
    runtime::KERNEL_NAMES
        .iter()
        .find(|n| n.strip_prefix(prefix) == Some(suffix))
        .expect("every type of kernel_type has its kernels")
}

/// Scratch buffers of one op, grown on demand.
#[derive(Clone, Copy)]
enum Slot {
    X = 0,
    Y,
    Z,
    Pos,
    Scores,
    Part,
    WF16,
    XF16,
    Idx,
}
const SLOTS: usize = 9;

/// A KV cache's device twin.
struct DevKv {
    buf: DevBuf,
    ty: GgmlType,
}

struct Inner {
    weights: Box<dyn WeightStore>,
    kv: HashMap<usize, DevKv>,
    slots: Vec<Option<DevBuf>>,
    blas: Option<CudaBlas>,
    blas_failed: bool,
    fault_blas_above: Option<usize>,
}

/// The CUDA backend over one device (see the module docs).
pub struct CudaBackend {
    gpu: Arc<Gpu>,
    inner: Mutex<Inner>,
    cpu: CpuBackend,
}

fn grid1(n: usize, block: u32) -> (u32, u32, u32) {
    ((n as u64).div_ceil(block as u64).max(1) as u32, 1, 1)
}

fn f32_bytes(x: &[f32]) -> &[u8] {
    bytemuck::cast_slice(x)
}

impl CudaBackend {
    /// Opens device `ordinal` with every weight resident in VRAM.
    ///
    /// Errors: CUDA unavailable, no such device, the kernels do not compile or load.
    pub fn new(ordinal: usize) -> Result<CudaBackend, CudaError> {
        let gpu = Arc::new(Gpu::open(ordinal)?);
        let blas = if loader::load()?.cublas.is_some() {
            CudaBlas::new(gpu.stream.clone()).ok()
        } else {
            None
        };
        if blas.is_none() {
            events::emit(
                "fallback",
                serde_json::json!({"what": "prefill_gemm", "from": "cublas", "to": "gemm_f16_tiled", "why": "cuBLAS not found or not initialised"}),
                "cuBLAS is not available; the prefill GEMM uses our own kernel",
            );
        }
        let fault_blas_above = std::env::var("STRATA_FAULT_BLAS_GEMM_ABOVE")
            .ok()
            .and_then(|v| v.parse().ok());
        Ok(CudaBackend {
            gpu,
            inner: Mutex::new(Inner {
                weights: Box::new(ResidentStore::default()),
                kv: HashMap::new(),
                slots: (0..SLOTS).map(|_| None).collect(),
                blas_failed: blas.is_none(),
                blas,
                fault_blas_above,
            }),
            cpu: CpuBackend,
        })
    }

    /// The device and how its kernels were obtained.
    pub fn gpu(&self) -> &Gpu {
        &self.gpu
    }

    /// Bytes of weights resident on the device.
    pub fn resident_weight_bytes(&self) -> usize {
        self.lock().weights.resident_bytes()
    }

    /// Waits for every queued kernel (benchmarks and event timings).
    ///
    /// Errors: a kernel failed.
    pub fn synchronize(&self) -> Result<(), CudaError> {
        self.gpu
            .stream
            .synchronize()
            .map_err(CudaError::driver("stream synchronize"))
    }

    /// The bytes of the device twin of one K or V cache (tests and diagnostics); `None` before its first store.
    pub fn kv_device_bytes(&self, rows: &KvRows) -> Option<Vec<u8>> {
        let s = self.lock();
        let d = s.kv.get(&(rows as *const KvRows as usize))?;
        let mut out = vec![0u8; d.buf.bytes];
        d.buf.read(&self.gpu.stream, &mut out).ok()?;
        Some(out)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Unwraps an op's result: the trait has no error path (module docs).
    fn check<T>(r: Result<T, CudaError>) -> T {
        r.unwrap_or_else(|e| panic!("CUDA backend: {e}"))
    }
}

impl Inner {
    /// Slot `s` with at least `bytes` bytes; its device address.
    fn slot(&mut self, gpu: &Gpu, s: Slot, bytes: usize) -> Result<u64, CudaError> {
        let cur = &mut self.slots[s as usize];
        if cur.as_ref().is_none_or(|b| b.bytes < bytes) {
            // Grow by half again so a batch that creeps up does not reallocate every call.
            let want = bytes.max(cur.as_ref().map_or(0, |b| b.bytes + b.bytes / 2));
            *cur = None;
            *cur = Some(DevBuf::alloc(&gpu.stream, want)?);
        }
        Ok(cur.as_ref().expect("just set").ptr)
    }

    fn upload(&mut self, gpu: &Gpu, s: Slot, data: &[u8]) -> Result<u64, CudaError> {
        let p = self.slot(gpu, s, data.len())?;
        self.slots[s as usize]
            .as_mut()
            .expect("sized")
            .write(&gpu.stream, data)?;
        Ok(p)
    }

    fn download(&self, gpu: &Gpu, s: Slot, out: &mut [f32]) -> Result<(), CudaError> {
        self.slots[s as usize]
            .as_ref()
            .expect("slot written before it is read")
            .read(&gpu.stream, bytemuck::cast_slice_mut(out))
    }

    /// `y[t][r] = W[r] · x[t]` on device buffers: matrix-vector kernels for a few tokens, else the GEMM.
    #[allow(clippy::too_many_arguments)]
    fn matmul_dev(
        &mut self,
        gpu: &Gpu,
        w: &QMat<'_>,
        wp: u64,
        xp: u64,
        n_tok: usize,
        yp: u64,
    ) -> Result<(), CudaError> {
        let (rows, cols) = (w.rows, w.cols);
        if n_tok <= MMV_MAX_TOKENS {
            return gpu.launch(
                typed("mmv_", w.ty),
                (rows.div_ceil(8) as u32, n_tok as u32, 1),
                (256, 1, 1),
                &[
                    Arg::P(wp),
                    Arg::P(xp),
                    Arg::P(yp),
                    Arg::I(rows as i32),
                    Arg::I(cols as i32),
                    Arg::L(w.row_bytes as i64),
                ],
            );
        }
        let wf = self.slot(gpu, Slot::WF16, rows * cols * 2)?;
        let xf = self.slot(gpu, Slot::XF16, n_tok * cols * 2)?;
        let chunks = rows * cols / 32;
        gpu.launch(
            typed("dq_f16_", w.ty),
            grid1(chunks, 256),
            (256, 1, 1),
            &[
                Arg::P(wp),
                Arg::P(wf),
                Arg::I(rows as i32),
                Arg::I(cols as i32),
                Arg::L(w.row_bytes as i64),
            ],
        )?;
        gpu.launch(
            "f32_to_f16",
            grid1(n_tok * cols, 256),
            (256, 1, 1),
            &[Arg::P(xp), Arg::P(xf), Arg::L((n_tok * cols) as i64)],
        )?;
        if !self.blas_failed {
            let injected = self.fault_blas_above.is_some_and(|m| n_tok > m);
            let r = if injected {
                Err(format!(
                    "injected failure (STRATA_FAULT_BLAS_GEMM_ABOVE={})",
                    self.fault_blas_above.unwrap_or(0)
                ))
            } else {
                self.gemm_blas(wf, xf, yp, rows, cols, n_tok)
            };
            match r {
                Ok(()) => return Ok(()),
                Err(why) => {
                    self.blas_failed = true;
                    events::emit(
                        "fallback",
                        serde_json::json!({"what": "prefill_gemm", "from": "cublas", "to": "gemm_f16_tiled",
                            "why": why, "m": n_tok, "n": rows, "k": cols}),
                        &format!(
                            "prefill gemm: cublasGemmEx failed ({why}) at {n_tok} tokens; using our own GEMM kernel from now on"
                        ),
                    );
                }
            }
        }
        gpu.launch(
            "gemm_f16_tiled",
            (rows.div_ceil(16) as u32, n_tok.div_ceil(16) as u32, 1),
            (16, 16, 1),
            &[
                Arg::P(wf),
                Arg::P(xf),
                Arg::P(yp),
                Arg::I(rows as i32),
                Arg::I(cols as i32),
                Arg::I(n_tok as i32),
            ],
        )
    }

    /// cuBLAS: out (column-major rows × n_tok) = Wᵀ' (W row-major is column-major cols × rows) · X.
    fn gemm_blas(&self, wf: u64, xf: u64, yp: u64, rows: usize, cols: usize, n_tok: usize) -> Result<(), String> {
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

    /// The device twin of one K or V cache of `width` values per row.
    fn kv_twin(&mut self, gpu: &Gpu, rows: &KvRows) -> Result<(u64, GgmlType), CudaError> {
        let key = rows as *const KvRows as usize;
        let fresh = self
            .kv
            .get(&key)
            .is_none_or(|d| d.buf.bytes != rows.bytes() || d.ty != rows.ty());
        if fresh {
            self.kv.remove(&key);
            let buf = DevBuf::alloc(&gpu.stream, rows.bytes())?;
            self.kv.insert(key, DevKv { buf, ty: rows.ty() });
        }
        let d = &self.kv[&key];
        Ok((d.buf.ptr, d.ty))
    }
}

/// Bytes of one head of a cache row and of a whole row, for `heads` heads of `head_dim` values of `ty`.
fn kv_geometry(ty: GgmlType, heads: usize, head_dim: usize) -> (usize, usize) {
    let hb = ty
        .row_bytes(head_dim as u64)
        .expect("cache head width checked at construction") as usize;
    (hb, hb * heads)
}

impl Backend for CudaBackend {
    fn name(&self) -> &'static str {
        "cuda"
    }

    fn matmul(&self, w: &QMat<'_>, x: &[f32], n_tok: usize, out: &mut [f32]) {
        if !gpu_computes(w) {
            return self.cpu.matmul(w, x, n_tok, out);
        }
        assert_eq!(x.len(), n_tok * w.cols, "matmul: activations");
        assert_eq!(out.len(), n_tok * w.rows, "matmul: output");
        let g = &*self.gpu;
        let mut s = self.lock();
        Self::check((|| {
            let wp = s.weights.device_ptr(&g.stream, w.data)?;
            let xp = s.upload(g, Slot::X, f32_bytes(x))?;
            let yp = s.slot(g, Slot::Y, out.len() * 4)?;
            s.matmul_dev(g, w, wp, xp, n_tok, yp)?;
            s.download(g, Slot::Y, out)
        })());
    }

    fn rms_norm(&self, x: &mut [f32], w: &[f32], eps: f32) {
        let n = w.len();
        assert_eq!(x.len() % n, 0, "rms_norm: rows of {n}");
        let g = &*self.gpu;
        let mut s = self.lock();
        Self::check((|| {
            let wp = s.weights.device_ptr(&g.stream, f32_bytes(w))?;
            let xp = s.upload(g, Slot::X, f32_bytes(x))?;
            g.launch(
                "rms_norm",
                ((x.len() / n) as u32, 1, 1),
                (256, 1, 1),
                &[Arg::P(xp), Arg::P(wp), Arg::I(n as i32), Arg::F(eps)],
            )?;
            s.download(g, Slot::X, x)
        })());
    }

    fn rope(&self, x: &mut [f32], n_head: usize, head_dim: usize, positions: &[u32], p: &RopeParams) {
        assert_eq!(x.len(), positions.len() * n_head * head_dim, "rope: shape");
        assert!(p.n_rot <= head_dim && p.n_rot.is_multiple_of(2), "rope: n_rot");
        let g = &*self.gpu;
        let mut s = self.lock();
        let theta_scale = p.freq_base.powf(-2.0 / p.n_rot as f32);
        Self::check((|| {
            let xp = s.upload(g, Slot::X, f32_bytes(x))?;
            let pp = s.upload(g, Slot::Pos, bytemuck::cast_slice(positions))?;
            let n = positions.len() * n_head * (p.n_rot / 2);
            g.launch(
                "rope",
                grid1(n, 256),
                (256, 1, 1),
                &[
                    Arg::P(xp),
                    Arg::P(pp),
                    Arg::I(positions.len() as i32),
                    Arg::I(n_head as i32),
                    Arg::I(head_dim as i32),
                    Arg::I(p.n_rot as i32),
                    Arg::F(theta_scale),
                    Arg::F(p.freq_scale),
                    Arg::I((p.kind == RopeKind::Neox) as i32),
                ],
            )?;
            s.download(g, Slot::X, x)
        })());
    }

    fn scale(&self, x: &mut [f32], sc: f32) {
        let g = &*self.gpu;
        let mut s = self.lock();
        Self::check((|| {
            let xp = s.upload(g, Slot::X, f32_bytes(x))?;
            g.launch(
                "scale_f32",
                grid1(x.len(), 256),
                (256, 1, 1),
                &[Arg::P(xp), Arg::F(sc), Arg::L(x.len() as i64)],
            )?;
            s.download(g, Slot::X, x)
        })());
    }

    fn add(&self, x: &mut [f32], y: &[f32]) {
        assert_eq!(x.len(), y.len(), "add: lengths");
        let g = &*self.gpu;
        let mut s = self.lock();
        Self::check((|| {
            let xp = s.upload(g, Slot::X, f32_bytes(x))?;
            let yp = s.upload(g, Slot::Y, f32_bytes(y))?;
            g.launch(
                "add_f32",
                grid1(x.len(), 256),
                (256, 1, 1),
                &[Arg::P(xp), Arg::P(yp), Arg::L(x.len() as i64)],
            )?;
            s.download(g, Slot::X, x)
        })());
    }

    fn store_kv(&self, kv: &mut KvLayer, k: &[f32], v: &[f32], positions: &[u32]) {
        let n_tok = positions.len();
        let g = &*self.gpu;
        let mut s = self.lock();
        Self::check((|| {
            let pp = s.upload(g, Slot::Pos, bytemuck::cast_slice(positions))?;
            for (rows, data) in [(&kv.k, k), (&kv.v, v)] {
                let width = data.len() / n_tok;
                let (_, row_bytes) = kv_geometry(rows.ty(), width / rows.head_dim(), rows.head_dim());
                let (dst, ty) = s.kv_twin(g, rows)?;
                let src = s.upload(g, Slot::X, f32_bytes(data))?;
                let (kernel, threads) = match ty {
                    GgmlType::F16 => ("kv_store_f16", n_tok * width),
                    // One warp per 32-value block.
                    _ => ("kv_store_q8_0", n_tok * width),
                };
                g.launch(
                    kernel,
                    grid1(threads, 256),
                    (256, 1, 1),
                    &[
                        Arg::P(src),
                        Arg::P(dst),
                        Arg::P(pp),
                        Arg::I(n_tok as i32),
                        Arg::I(width as i32),
                        Arg::L(row_bytes as i64),
                    ],
                )?;
            }
            Ok(())
        })());
    }

    fn attention(&self, q: &[f32], kv: &KvLayer, positions: &[u32], p: &AttnParams, out: &mut [f32]) {
        let n_tok = positions.len();
        let (dk, dv) = (p.head_dim, p.head_dim_v);
        assert_eq!(q.len(), n_tok * p.n_head * dk, "attention: q");
        assert_eq!(out.len(), n_tok * p.n_head * dv, "attention: out");
        let first_key = |pos: usize| p.window.map_or(0, |w| (pos + 1).saturating_sub(w));
        let hi = positions.iter().map(|&x| x as usize).max().expect("at least one token");
        let lo = positions
            .iter()
            .map(|&x| first_key(x as usize))
            .min()
            .expect("at least one token");
        let n_keys = hi + 1 - lo;
        let rows = n_tok * p.n_head;
        let g = &*self.gpu;
        let mut s = self.lock();
        Self::check((|| {
            let (khb, krb) = kv_geometry(kv.k.ty(), p.n_head_kv, dk);
            let (vhb, vrb) = kv_geometry(kv.v.ty(), p.n_head_kv, dv);
            let (kp, kty) = s.kv_twin(g, &kv.k)?;
            let (vp, vty) = s.kv_twin(g, &kv.v)?;
            let code = |t: GgmlType| if t == GgmlType::F16 { 0 } else { 1 };
            let qp = s.upload(g, Slot::X, f32_bytes(q))?;
            let pp = s.upload(g, Slot::Pos, bytemuck::cast_slice(positions))?;
            let sp = s.slot(g, Slot::Scores, rows * n_keys * 4)?;
            g.launch(
                "attn_scores",
                (n_keys.div_ceil(8) as u32, rows as u32, 1),
                (256, 1, 1),
                &[
                    Arg::P(qp),
                    Arg::P(kp),
                    Arg::P(sp),
                    Arg::P(pp),
                    Arg::I(p.n_head as i32),
                    Arg::I(p.n_head_kv as i32),
                    Arg::I(dk as i32),
                    Arg::I(lo as i32),
                    Arg::I(n_keys as i32),
                    Arg::F(p.scale),
                    Arg::I(p.window.unwrap_or(0) as i32),
                    Arg::L(krb as i64),
                    Arg::I(khb as i32),
                    Arg::I(code(kty)),
                ],
            )?;
            g.launch(
                "attn_softmax",
                (rows as u32, 1, 1),
                (256, 1, 1),
                &[Arg::P(sp), Arg::I(n_keys as i32), Arg::I((vty == GgmlType::F16) as i32)],
            )?;
            // Split-K over the keys when there are too few (token, head) rows to fill the device.
            let n_split = if rows >= 256 {
                1
            } else {
                n_keys.div_ceil(ATTN_SPLIT_KEYS)
            };
            let split_len = n_keys.div_ceil(n_split);
            let op = s.slot(g, Slot::Y, out.len() * 4)?;
            let target = if n_split == 1 {
                op
            } else {
                s.slot(g, Slot::Part, n_split * out.len() * 4)?
            };
            let threads = dv.next_multiple_of(32).min(256) as u32;
            g.launch(
                "attn_pv",
                (rows as u32, n_split as u32, 1),
                (threads, 1, 1),
                &[
                    Arg::P(sp),
                    Arg::P(vp),
                    Arg::P(target),
                    Arg::I(rows as i32),
                    Arg::I(p.n_head as i32),
                    Arg::I(p.n_head_kv as i32),
                    Arg::I(dv as i32),
                    Arg::I(lo as i32),
                    Arg::I(n_keys as i32),
                    Arg::I(split_len as i32),
                    Arg::L(vrb as i64),
                    Arg::I(vhb as i32),
                    Arg::I(code(vty)),
                ],
            )?;
            if n_split > 1 {
                g.launch(
                    "sum_splits",
                    grid1(out.len(), 256),
                    (256, 1, 1),
                    &[
                        Arg::P(target),
                        Arg::P(op),
                        Arg::I(n_split as i32),
                        Arg::L(out.len() as i64),
                    ],
                )?;
            }
            s.download(g, Slot::Y, out)
        })());
    }

    fn glu(&self, gate: &mut [f32], up: &[f32], act: GluKind) {
        assert_eq!(gate.len(), up.len(), "glu: lengths");
        let g = &*self.gpu;
        let mut s = self.lock();
        Self::check((|| {
            let gp = s.upload(g, Slot::X, f32_bytes(gate))?;
            let up_ = s.upload(g, Slot::Y, f32_bytes(up))?;
            let a = match act {
                GluKind::SwiGlu => 0,
                GluKind::GeGlu => 1,
            };
            g.launch(
                "glu",
                grid1(gate.len(), 256),
                (256, 1, 1),
                &[Arg::P(gp), Arg::P(up_), Arg::L(gate.len() as i64), Arg::I(a)],
            )?;
            s.download(g, Slot::X, gate)
        })());
    }

    fn softmax(&self, x: &mut [f32], width: usize) {
        self.cpu.softmax(x, width);
    }

    fn route(&self, logits: &mut [f32], n_expert: usize, k: usize, normalize: bool, out: &mut Routing) {
        self.cpu.route(logits, n_expert, k, normalize, out);
    }

    fn moe_ffn(&self, ex: &Experts<'_>, x: &[f32], routing: &Routing, out: &mut [f32], scr: &mut MoeScratch) {
        if ![ex.gate, ex.up, ex.down].iter().all(gpu_computes) {
            return self.cpu.moe_ffn(ex, x, routing, out, scr);
        }
        let n_embd = ex.gate.cols;
        let nff = ex.n_ff_exp;
        let n_tok = x.len() / n_embd;
        assert_eq!(out.len(), x.len(), "moe_ffn: output");
        assert_eq!(routing.ids.len(), n_tok * routing.k, "moe_ffn: routing");
        // Routing slots grouped by expert (expert order, then slot order, as the CPU visits them).
        scr.tokens.clear();
        let mut segments: Vec<(usize, usize, usize)> = Vec::new(); // (expert, first, count)
        for e in 0..ex.n_expert {
            let first = scr.tokens.len();
            scr.tokens.extend(
                routing
                    .ids
                    .iter()
                    .enumerate()
                    .filter(|(_, id)| **id as usize == e)
                    .map(|(s, _)| s as u32),
            );
            if scr.tokens.len() > first {
                segments.push((e, first, scr.tokens.len() - first));
            }
        }
        let total = scr.tokens.len();
        let rows_of: Vec<u32> = scr.tokens.iter().map(|&slot| slot / routing.k as u32).collect();
        scr.down.resize(total * n_embd, 0.0);
        let g = &*self.gpu;
        let mut s = self.lock();
        Self::check((|| {
            let xp = s.upload(g, Slot::X, f32_bytes(x))?;
            let ip = s.upload(g, Slot::Idx, bytemuck::cast_slice(&rows_of))?;
            let xg = s.slot(g, Slot::Z, total * n_embd * 4)?;
            g.launch(
                "gather_rows",
                grid1(total * n_embd, 256),
                (256, 1, 1),
                &[
                    Arg::P(xp),
                    Arg::P(ip),
                    Arg::P(xg),
                    Arg::I(total as i32),
                    Arg::I(n_embd as i32),
                ],
            )?;
            // Gate and up side by side per segment in Y ([total][2][nff] as two halves), down into Part.
            let gp = s.slot(g, Slot::Y, 2 * total * nff * 4)?;
            let up = gp + (total * nff * 4) as u64;
            let dp = s.slot(g, Slot::Part, total * n_embd * 4)?;
            for &(e, first, m) in &segments {
                let gate = ex.gate.rows_slice(e * nff, nff);
                let upm = ex.up.rows_slice(e * nff, nff);
                let down = ex.down.rows_slice(e * n_embd, n_embd);
                let (gw, uw, dw) = (
                    s.weights.device_ptr(&g.stream, gate.data)?,
                    s.weights.device_ptr(&g.stream, upm.data)?,
                    s.weights.device_ptr(&g.stream, down.data)?,
                );
                let xs = xg + (first * n_embd * 4) as u64;
                let (gs, us) = (gp + (first * nff * 4) as u64, up + (first * nff * 4) as u64);
                s.matmul_dev(g, &gate, gw, xs, m, gs)?;
                s.matmul_dev(g, &upm, uw, xs, m, us)?;
                let a = match ex.act {
                    GluKind::SwiGlu => 0,
                    GluKind::GeGlu => 1,
                };
                g.launch(
                    "glu",
                    grid1(m * nff, 256),
                    (256, 1, 1),
                    &[Arg::P(gs), Arg::P(us), Arg::L((m * nff) as i64), Arg::I(a)],
                )?;
                s.matmul_dev(g, &down, dw, gs, m, dp + (first * n_embd * 4) as u64)?;
            }
            s.download(g, Slot::Part, &mut scr.down[..total * n_embd])
        })());
        // The weighted sum in f64, as the CPU backend does it.
        scr.acc.clear();
        scr.acc.resize(n_tok * n_embd, 0.0);
        for (i, &slot) in scr.tokens.iter().enumerate() {
            let (t, w) = (slot as usize / routing.k, routing.weights[slot as usize] as f64);
            let acc = &mut scr.acc[t * n_embd..(t + 1) * n_embd];
            for (a, d) in acc.iter_mut().zip(&scr.down[i * n_embd..(i + 1) * n_embd]) {
                *a += w * *d as f64;
            }
        }
        for (t, o) in out.chunks_mut(n_embd).enumerate() {
            let inv = if routing.normalized {
                1.0 / routing.weights[t * routing.k..(t + 1) * routing.k]
                    .iter()
                    .map(|&w| w as f64)
                    .sum::<f64>()
            } else {
                1.0
            };
            for (y, a) in o.iter_mut().zip(&scr.acc[t * n_embd..(t + 1) * n_embd]) {
                *y = (a * inv) as f32;
            }
        }
    }
}
