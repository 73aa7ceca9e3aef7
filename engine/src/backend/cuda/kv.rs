//! KV caches on the device: each cache's device twin (keyed by sequence slot, layer and K/V, released with the slot;
//! the cache's only copy of the data), its row geometry, and the stores into it.

use super::buffer::DevBuf;
use super::error::CudaError;
use super::launch::Arg;
use super::{CudaBackend, DevVec, Gpu, Inner, grid1};
use crate::quant::GgmlType;
use crate::state::kv::{KvLayer, KvRows};

/// A KV cache's device twin.
pub(super) struct DevKv {
    buf: DevBuf,
    ty: GgmlType,
}

/// Bytes of one head of a cache row and of a whole row, for `heads` heads of `head_dim` values of `ty`.
pub(super) fn kv_geometry(ty: GgmlType, heads: usize, head_dim: usize) -> (usize, usize) {
    let hb = ty
        .row_bytes(head_dim as u64)
        .expect("cache head width checked at construction") as usize;
    (hb, hb * heads)
}

impl CudaBackend {
    /// The bytes of the device twin of one K or V cache (tests and diagnostics); `None` before its first store.
    pub fn kv_device_bytes(&self, rows: &KvRows) -> Option<Vec<u8>> {
        let s = self.lock();
        let d = s.kv.get(&rows.id())?;
        let mut out = vec![0u8; d.buf.bytes];
        d.buf.read(&self.gpu.stream, &mut out).ok()?;
        Some(out)
    }

    /// [`Backend::store_kv`] (the trait's method calls this).
    pub(super) fn store_kv_dev(&self, kv: &mut KvLayer, k: &DevVec, v: &DevVec, positions: &[u32]) {
        let n_tok = positions.len();
        let g = &*self.gpu;
        let mut s = self.lock();
        Self::check((|| {
            let pp = s.positions(g, positions)?;
            if kv.k.ty() == GgmlType::F16 && kv.v.ty() == GgmlType::F16 {
                // Keys and values in one launch.
                let (wk, wv) = (kv.k.width(), kv.v.width());
                assert!(
                    k.capacity() >= n_tok * wk && v.capacity() >= n_tok * wv,
                    "store_kv: shapes"
                );
                let (kd, _) = s.kv_twin(g, &kv.k)?;
                let (vd, _) = s.kv_twin(g, &kv.v)?;
                return g.launch(
                    "kv_store2_f16",
                    grid1(n_tok * (wk + wv), 256),
                    (256, 1, 1),
                    &[
                        Arg::P(k.ptr()),
                        Arg::P(kd),
                        Arg::P(v.ptr()),
                        Arg::P(vd),
                        Arg::P(pp),
                        Arg::I(n_tok as i32),
                        Arg::I(wk as i32),
                        Arg::I(wv as i32),
                    ],
                );
            }
            for (rows, data) in [(&kv.k, k), (&kv.v, v)] {
                let width = rows.width();
                assert!(data.capacity() >= n_tok * width, "store_kv: shapes");
                let (_, row_bytes) = kv_geometry(rows.ty(), rows.heads(), rows.head_dim());
                let (dst, ty) = s.kv_twin(g, rows)?;
                let kernel = match ty {
                    GgmlType::F16 => "kv_store_f16",
                    // One warp per 32-value block.
                    _ => "kv_store_q8_0",
                };
                g.launch(
                    kernel,
                    grid1(n_tok * width, 256),
                    (256, 1, 1),
                    &[
                        Arg::P(data.ptr()),
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
}

impl Inner {
    /// The device twin of one K or V cache of `width` values per row.
    pub(super) fn kv_twin(&mut self, gpu: &Gpu, rows: &KvRows) -> Result<(u64, GgmlType), CudaError> {
        let key = rows.id();
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
