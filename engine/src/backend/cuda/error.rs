//! Why a CUDA operation failed: the error type every part of the CUDA backend returns (it depends on none of them).

use crate::device::cuda_libs;

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
    /// A call on a context an injected sticky fault poisoned (`STRATA_FAULT=sticky:KERNEL@N`): `what` failed with
    /// the driver's error, as every call after a real launch failure does.
    #[error("CUDA {what}: {error}")]
    Poisoned { what: String, error: String },
    /// The device's copy of the expert slot table and the host's disagree (`backend::cuda::experts`): a bug.
    #[error("the device's expert slot table and the host's diverged: {0}")]
    ExpertTable(String),
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
