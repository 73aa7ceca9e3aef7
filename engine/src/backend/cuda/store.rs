//! Device copies of weights and of KV caches, made on first use and kept.
//!
//! [`WeightStore`] is the expert-store interface of the CUDA backend: the forward pass hands the backend host
//! views ([`QMat`]) and the store answers with a device pointer. [`ResidentStore`] keeps every matrix resident
//! in VRAM (this issue); a slot cache over host-resident experts (DESIGN.md section 1) replaces it behind the
//! same trait.

use std::collections::HashMap;
use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};

use super::runtime::CudaError;

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

/// Where the backend finds a weight matrix (or a norm vector) on the device.
pub trait WeightStore: Send {
    /// The device address of `data` (a matrix, an expert's rows, or a norm vector viewed as bytes), copying it
    /// on first use.
    ///
    /// Errors: the copy could not be allocated.
    fn device_ptr(&mut self, stream: &Arc<CudaStream>, data: &[u8]) -> Result<u64, CudaError>;

    /// Bytes held on the device.
    fn resident_bytes(&self) -> usize;
}

/// A cheap fingerprint of `data`: FNV-1a 64 over its first and last 64 bytes and 64 samples of 8 bytes spread
/// evenly between them (at most 640 bytes read, whatever the size).
pub fn fingerprint(data: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325 ^ data.len() as u64;
    let mut eat = |bytes: &[u8]| {
        for &b in bytes {
            h ^= b as u64;
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
    };
    let n = data.len();
    if n <= 640 {
        eat(data);
    } else {
        eat(&data[..64]);
        for i in 0..64 {
            let at = 64 + (n - 136) * i / 63;
            eat(&data[at..at + 8]);
        }
        eat(&data[n - 64..]);
    }
    h
}

/// One resident copy and the fingerprint of the host bytes it was made from.
struct Resident {
    buf: DevBuf,
    print: u64,
}

/// Every weight resident in VRAM, keyed by its host address and length (host views are stable: the mapped
/// file and the loaded norm vectors live as long as the model). A host buffer freed and another allocated at
/// the same address with the same length (tests, or a model loaded after another was dropped) must not get the
/// old copy: each lookup compares a [`fingerprint`] of the bytes, and a mismatch copies them again.
#[derive(Default)]
pub struct ResidentStore {
    map: HashMap<(usize, usize), Resident>,
    bytes: usize,
}

impl WeightStore for ResidentStore {
    fn device_ptr(&mut self, stream: &Arc<CudaStream>, data: &[u8]) -> Result<u64, CudaError> {
        let key = (data.as_ptr() as usize, data.len());
        let print = fingerprint(data);
        if let Some(r) = self.map.get(&key) {
            if r.print == print {
                return Ok(r.buf.ptr);
            }
            // Stale: the address now holds other bytes. The old copy is freed in stream order.
            self.map.remove(&key);
            self.bytes -= data.len();
        }
        let buf = DevBuf::upload(stream, data)?;
        let p = buf.ptr;
        self.bytes += data.len();
        self.map.insert(key, Resident { buf, print });
        Ok(p)
    }

    fn resident_bytes(&self) -> usize {
        self.bytes
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
