//! Choosing a device: `--device cpu|cuda:N`, and a backend that is either.

use std::fmt;
use std::str::FromStr;

use super::CudaBackend;
use super::runtime::CudaError;
use crate::backend::cpu::CpuBackend;
use crate::backend::{AttnParams, Backend, Experts, GluKind, MoeScratch, QMat, RopeParams, Routing};
use crate::runtime::kv::KvLayer;

/// Where a session computes (`--device`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Device {
    #[default]
    Cpu,
    /// CUDA device N (`cuda` alone is `cuda:0`).
    Cuda(usize),
}

impl FromStr for Device {
    type Err = String;
    fn from_str(s: &str) -> Result<Device, String> {
        match s {
            "cpu" => Ok(Device::Cpu),
            "cuda" => Ok(Device::Cuda(0)),
            _ => s
                .strip_prefix("cuda:")
                .and_then(|n| n.parse().ok())
                .map(Device::Cuda)
                .ok_or_else(|| format!("unknown device `{s}`; known: cpu, cuda, cuda:N")),
        }
    }
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Device::Cpu => f.write_str("cpu"),
            Device::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

/// The backend of a [`Device`]: every [`Backend`] call goes to the CPU or the CUDA backend.
pub enum AnyBackend {
    Cpu(CpuBackend),
    Cuda(Box<CudaBackend>),
}

impl AnyBackend {
    /// Opens `device` (the CUDA device, its kernels, cuBLAS).
    ///
    /// Errors: CUDA is unavailable on this machine (one line saying why), no such device, kernels failed.
    pub fn open(device: Device) -> Result<AnyBackend, CudaError> {
        Ok(match device {
            Device::Cpu => AnyBackend::Cpu(CpuBackend),
            Device::Cuda(n) => AnyBackend::Cuda(Box::new(CudaBackend::new(n)?)),
        })
    }

    /// The CUDA backend, when that is what this is.
    pub fn cuda(&self) -> Option<&CudaBackend> {
        match self {
            AnyBackend::Cuda(c) => Some(c),
            AnyBackend::Cpu(_) => None,
        }
    }

    fn be(&self) -> &dyn Backend {
        match self {
            AnyBackend::Cpu(c) => c,
            AnyBackend::Cuda(c) => &**c,
        }
    }
}

impl Backend for AnyBackend {
    fn name(&self) -> &'static str {
        self.be().name()
    }
    fn matmul(&self, w: &QMat<'_>, x: &[f32], n_tok: usize, out: &mut [f32]) {
        self.be().matmul(w, x, n_tok, out)
    }
    fn matmul_many(&self, ws: &[QMat<'_>], x: &[f32], n_tok: usize, outs: &mut [&mut [f32]]) {
        self.be().matmul_many(ws, x, n_tok, outs)
    }
    fn rms_norm(&self, x: &mut [f32], w: &[f32], eps: f32) {
        self.be().rms_norm(x, w, eps)
    }
    fn rope(&self, x: &mut [f32], n_head: usize, head_dim: usize, positions: &[u32], p: &RopeParams) {
        self.be().rope(x, n_head, head_dim, positions, p)
    }
    fn scale(&self, x: &mut [f32], s: f32) {
        self.be().scale(x, s)
    }
    fn add(&self, x: &mut [f32], y: &[f32]) {
        self.be().add(x, y)
    }
    fn store_kv(&self, kv: &mut KvLayer, k: &[f32], v: &[f32], positions: &[u32]) {
        self.be().store_kv(kv, k, v, positions)
    }
    fn attention(&self, q: &[f32], kv: &KvLayer, positions: &[u32], p: &AttnParams, out: &mut [f32]) {
        self.be().attention(q, kv, positions, p, out)
    }
    fn glu(&self, gate: &mut [f32], up: &[f32], act: GluKind) {
        self.be().glu(gate, up, act)
    }
    fn softmax(&self, x: &mut [f32], width: usize) {
        self.be().softmax(x, width)
    }
    fn route(&self, logits: &mut [f32], n_expert: usize, k: usize, normalize: bool, out: &mut Routing) {
        self.be().route(logits, n_expert, k, normalize, out)
    }
    fn moe_ffn(&self, ex: &Experts<'_>, x: &[f32], routing: &Routing, out: &mut [f32], scratch: &mut MoeScratch) {
        self.be().moe_ffn(ex, x, routing, out, scratch)
    }
}
