//! Device memory: byte buffers ([`DevBuf`]) and the count of their allocations (a decode graph stays valid while it
//! is unchanged), and a bump-pointer arena.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};

use super::error::CudaError;

/// Device allocations made by this process (every [`DevBuf`]): a decode graph stays valid while it is unchanged.
static ALLOCATIONS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Device allocations so far.
pub fn allocations() -> u64 {
    ALLOCATIONS.load(std::sync::atomic::Ordering::Relaxed)
}

/// A device buffer of bytes and its address.
pub struct DevBuf {
    buf: CudaSlice<u8>,
    pub ptr: u64,
    pub bytes: usize,
}

impl DevBuf {
    /// `bytes` uninitialised bytes on `stream`'s device (at least 1, so every buffer has an address).
    ///
    /// Errors: the allocation failed (the message gives the free memory).
    pub fn alloc(stream: &Arc<CudaStream>, bytes: usize) -> Result<DevBuf, CudaError> {
        let n = bytes.max(1);
        ALLOCATIONS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        // SAFETY: the buffer is written before it is read by every user of this type.
        let buf = unsafe { stream.alloc::<u8>(n) }.map_err(|source| CudaError::Alloc {
            bytes: n,
            free: stream.context().mem_get_info().map_or(0, |m| m.0),
            source,
        })?;
        let ptr = {
            let (p, _sync) = buf.device_ptr(stream);
            p
        };
        Ok(DevBuf { buf, ptr, bytes })
    }

    /// A copy of `data` on the device.
    ///
    /// Errors: allocation or copy failure.
    pub fn upload(stream: &Arc<CudaStream>, data: &[u8]) -> Result<DevBuf, CudaError> {
        let mut b = DevBuf::alloc(stream, data.len())?;
        if !data.is_empty() {
            stream
                .memcpy_htod(data, &mut b.buf.slice_mut(0..data.len()))
                .map_err(CudaError::driver("host-to-device copy"))?;
        }
        Ok(b)
    }

    /// Writes `data` at the start of the buffer (it must fit).
    pub fn write(&mut self, stream: &Arc<CudaStream>, data: &[u8]) -> Result<(), CudaError> {
        assert!(
            data.len() <= self.bytes,
            "DevBuf::write: {} > {}",
            data.len(),
            self.bytes
        );
        if data.is_empty() {
            return Ok(());
        }
        stream
            .memcpy_htod(data, &mut self.buf.slice_mut(0..data.len()))
            .map_err(CudaError::driver("host-to-device copy"))
    }

    /// Copies the first `bytes` bytes of `src` to the start of this buffer, in `stream`'s order (no wait).
    ///
    /// Panics if either buffer is shorter than `bytes`. Errors: the copy failed.
    pub fn copy_from(&mut self, stream: &Arc<CudaStream>, src: &DevBuf, bytes: usize) -> Result<(), CudaError> {
        assert!(
            bytes <= self.bytes && bytes <= src.bytes,
            "DevBuf::copy_from: {bytes} bytes from {} into {}",
            src.bytes,
            self.bytes
        );
        if bytes == 0 {
            return Ok(());
        }
        stream
            .memcpy_dtod(&src.buf.slice(0..bytes), &mut self.buf.slice_mut(0..bytes))
            .map_err(CudaError::driver("device-to-device copy"))
    }

    /// Copies `bytes` bytes from device address `src` (inside any buffer of this context, this one included, not
    /// overlapping the destination) to bytes `offset..offset + bytes` of this buffer, in `stream`'s order (no wait).
    ///
    /// Panics if the destination range is past the buffer. Errors: the copy failed.
    pub fn copy_in(
        &mut self,
        stream: &Arc<CudaStream>,
        offset: usize,
        src: u64,
        bytes: usize,
    ) -> Result<(), CudaError> {
        assert!(
            offset + bytes <= self.bytes,
            "DevBuf::copy_in: {offset} + {bytes} > {}",
            self.bytes
        );
        if bytes == 0 {
            return Ok(());
        }
        // SAFETY: the destination range is inside this buffer (checked), the source is a device range the caller
        // names, and the copy is ordered on `stream` with every other use of both.
        unsafe { cudarc::driver::result::memcpy_dtod_async(self.ptr + offset as u64, src, bytes, stream.cu_stream()) }
            .map_err(CudaError::driver("device-to-device copy"))
    }

    /// Reads the first `out.len()` bytes into `out`, waiting for the stream.
    pub fn read(&self, stream: &Arc<CudaStream>, out: &mut [u8]) -> Result<(), CudaError> {
        self.read_at(stream, 0, out)
    }

    /// Reads bytes `offset..offset + out.len()` into `out`, waiting for the stream.
    pub fn read_at(&self, stream: &Arc<CudaStream>, offset: usize, out: &mut [u8]) -> Result<(), CudaError> {
        assert!(
            offset + out.len() <= self.bytes,
            "DevBuf::read_at: {} + {} > {}",
            offset,
            out.len(),
            self.bytes
        );
        if out.is_empty() {
            return Ok(());
        }
        stream
            .memcpy_dtoh(&self.buf.slice(offset..offset + out.len()), out)
            .map_err(CudaError::driver("device-to-host copy"))?;
        stream.synchronize().map_err(CudaError::driver("stream synchronize"))
    }
}

/// A device arena carved by a bump pointer: the shape of the expert arena, and the self-test's subject.
pub struct Arena {
    buf: DevBuf,
    used: usize,
}

impl Arena {
    /// An arena of `bytes` bytes.
    ///
    /// Errors: the device cannot allocate it.
    pub fn new(stream: &Arc<CudaStream>, bytes: usize) -> Result<Arena, CudaError> {
        Ok(Arena {
            buf: DevBuf::alloc(stream, bytes)?,
            used: 0,
        })
    }

    /// `bytes` more, 256-byte aligned; `None` (refused) when they do not fit what is left.
    pub fn alloc(&mut self, bytes: usize) -> Option<u64> {
        let start = self.used.next_multiple_of(256);
        let end = start.checked_add(bytes)?;
        if end > self.buf.bytes {
            return None;
        }
        self.used = end;
        Some(self.buf.ptr + start as u64)
    }

    /// Bytes handed out.
    pub fn used(&self) -> usize {
        self.used
    }

    /// Capacity in bytes.
    pub fn capacity(&self) -> usize {
        self.buf.bytes
    }
}
