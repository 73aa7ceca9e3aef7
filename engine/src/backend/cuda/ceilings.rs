//! The device's measured ceilings (copy bandwidth, dense f16 matrix rate), which benchmarks print their figures
//! beside.

use super::buffer::DevBuf;
use super::error::CudaError;
use super::launch::Arg;
use super::{CudaBackend, f32_bytes, grid1};

/// The device's two ceilings, measured (METHOD.md: datasheet rates are leads): copy bandwidth and dense f16
/// matrix rate. Benchmarks divide by them to give each figure beside its bound.
impl CudaBackend {
    /// Device-memory bandwidth in GB/s (1e9 bytes): the best of 6 copies of 1 GiB with 16-byte loads and stores
    /// (`copy_f32x4`), counting bytes read plus bytes written, timed by CUDA events.
    ///
    /// Errors: allocation or launch failure.
    pub fn measure_copy_gb_s(&self) -> Result<f64, CudaError> {
        let n = 1usize << 28; // f32 values: 1 GiB
        let g = &*self.gpu;
        let a = DevBuf::alloc(&g.stream, n * 4)?;
        let b = DevBuf::alloc(&g.stream, n * 4)?;
        // Random-looking data, never zeros: fill on the device with a pattern from the host.
        let pattern: Vec<f32> = (0..1u32 << 20)
            .map(|i| (i.wrapping_mul(2654435761) >> 8) as f32)
            .collect();
        let src = DevBuf::upload(&g.stream, f32_bytes(&pattern))?;
        for c in 0..n / pattern.len() {
            g.launch(
                "copy_f32",
                grid1(pattern.len(), 256),
                (256, 1, 1),
                &[
                    Arg::P(src.ptr),
                    Arg::P(a.ptr + (c * pattern.len() * 4) as u64),
                    Arg::L(pattern.len() as i64),
                ],
            )?;
        }
        let mut best = 0f64;
        for _ in 0..6 {
            let ms = self.time_ms(|| {
                g.launch(
                    "copy_f32x4",
                    (132 * 16, 1, 1),
                    (256, 1, 1),
                    &[Arg::P(a.ptr), Arg::P(b.ptr), Arg::L((n / 4) as i64)],
                )
            })?;
            best = best.max(2.0 * (n * 4) as f64 / (ms * 1e-3) / 1e9);
        }
        Ok(best)
    }

    /// Dense f16 matrix rate in TFLOP/s through cuBLAS `GemmEx` (f32 accumulation, the prefill GEMM's mode):
    /// the best of 5 products of 8192 × 8192 × 8192 over random operands; `None` without cuBLAS.
    ///
    /// Errors: allocation or launch failure.
    pub fn measure_gemm_tflops(&self) -> Result<Option<f64>, CudaError> {
        let n = 8192usize;
        let g = &*self.gpu;
        let mut rng = 0x2545_f491_4f6c_dd1du64;
        let host: Vec<u16> = (0..n * n)
            .map(|_| {
                rng ^= rng << 13;
                rng ^= rng >> 7;
                rng ^= rng << 17;
                half::f16::from_f32(((rng >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0).to_bits()
            })
            .collect();
        let a = DevBuf::upload(&g.stream, bytemuck::cast_slice(&host))?;
        let b = DevBuf::upload(&g.stream, bytemuck::cast_slice(&host))?;
        let c = DevBuf::alloc(&g.stream, n * n * 4)?;
        let s = self.lock();
        if s.blas.is_none() {
            return Ok(None);
        }
        let mut best = 0f64;
        for _ in 0..6 {
            let ms = self.time_ms(|| {
                s.gemm_blas(a.ptr, b.ptr, c.ptr, n, n, n)
                    .map_err(|error| CudaError::Launch {
                        kernel: "cublasGemmEx".into(),
                        grid: (0, 0, 0),
                        block: (0, 0, 0),
                        call: 0,
                        error,
                    })
            })?;
            best = best.max(2.0 * (n * n * n) as f64 / (ms * 1e-3) / 1e12);
        }
        Ok(Some(best))
    }

    /// Device milliseconds of the work `f` queues, between two CUDA events.
    fn time_ms(&self, f: impl FnOnce() -> Result<(), CudaError>) -> Result<f64, CudaError> {
        let ev = || {
            self.gpu
                .ctx
                .new_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT))
                .map_err(CudaError::driver("event"))
        };
        let (start, end) = (ev()?, ev()?);
        start
            .record(&self.gpu.stream)
            .map_err(CudaError::driver("event record"))?;
        f()?;
        end.record(&self.gpu.stream)
            .map_err(CudaError::driver("event record"))?;
        Ok(start.elapsed_ms(&end).map_err(CudaError::driver("event elapsed"))? as f64)
    }
}

impl CudaBackend {
    /// The time of one [`CudaBackend::send_f32`] of `bytes` to `to` (best of 3 rounds of 20, in seconds, the
    /// copies queued back to back, host submission included, and waited for on `to`'s stream): about what a
    /// layer split's boundary costs a step when `bytes` is what it carries.
    ///
    /// Errors: an allocation failed. Panics (after a `fault` event) when a copy fails, as `send_f32` does.
    pub fn measure_send(&self, to: &CudaBackend, bytes: usize) -> Result<f64, CudaError> {
        let len = bytes.div_ceil(4).max(1);
        let src = DevBuf::alloc(&self.gpu.stream, len * 4)?;
        let dst = DevBuf::alloc(&to.gpu.stream, len * 4)?;
        let mut best = f64::INFINITY;
        for _ in 0..3 {
            to.gpu
                .stream
                .synchronize()
                .map_err(CudaError::driver("stream synchronize"))?;
            let start = std::time::Instant::now();
            for _ in 0..20 {
                self.send_f32(src.ptr, to, dst.ptr, len);
            }
            to.gpu
                .stream
                .synchronize()
                .map_err(CudaError::driver("stream synchronize"))?;
            best = best.min(start.elapsed().as_secs_f64() / 20.0);
        }
        Ok(best)
    }
}
