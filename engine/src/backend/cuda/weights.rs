//! Device copies of weights, made on first use and kept (the KV caches' pages are in [`super::kv`]).
//!
//! [`WeightStore`] is the expert-store interface of the CUDA backend: the forward pass hands the backend host
//! views ([`QMat`]) and the store answers with a device pointer. [`ResidentStore`] keeps every matrix resident
//! in VRAM (this issue); a slot cache over host-resident experts (DESIGN.md section 1) replaces it behind the
//! same trait.

use std::collections::HashMap;
use std::sync::Arc;

use cudarc::driver::CudaStream;

use super::buffer::DevBuf;
use super::error::CudaError;

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
