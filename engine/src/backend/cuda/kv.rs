//! KV caches on the device: each cache's device twin (keyed by sequence slot, layer and K/V, released with the slot;
//! the cache's only copy of the data), its row geometry, and the stores into it.

use super::buffer::DevBuf;
use super::error::CudaError;
use super::launch::Arg;
use super::{CudaBackend, DevVec, Gpu, Inner, grid1};
use crate::quant::GgmlType;
use crate::state::kv::{KvCache, KvLayer, KvRows};

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

    /// [`Backend::share_kv_prefix`] (the trait's method calls this): copies cells `0..cells` of every layer's keys
    /// and values from `src`'s device twins into `dst`'s, on the stream after the steps that wrote them. Returns
    /// false, copying nothing, when `src` has no twin for some layer (it never stored a cell there).
    pub(super) fn copy_kv_prefix_dev(&self, src: &KvCache, dst: &KvCache, cells: usize) -> bool {
        assert!(
            src.layers.len() == dst.layers.len() && cells <= src.n_ctx().min(dst.n_ctx()),
            "share_kv_prefix: caches of different shapes, or {cells} cells"
        );
        let g = &*self.gpu;
        let mut s = self.lock();
        let pairs = || {
            src.layers
                .iter()
                .zip(&dst.layers)
                .flat_map(|(a, b)| [(&a.k, &b.k), (&a.v, &b.v)])
        };
        if pairs().any(|(a, _)| s.kv.get(&a.id()).is_none_or(|d| d.ty != a.ty())) {
            return false;
        }
        Self::check((|| {
            for (a, b) in pairs() {
                assert!(
                    a.ty() == b.ty() && a.heads() == b.heads() && a.head_dim() == b.head_dim(),
                    "share_kv_prefix: row shapes"
                );
                let (_, row_bytes) = kv_geometry(a.ty(), a.heads(), a.head_dim());
                s.kv_twin(g, b)?;
                // The destination is taken out of the map while the source is borrowed from it.
                let mut d = s.kv.remove(&b.id()).expect("twin made above");
                let r = d.buf.copy_from(&g.stream, &s.kv[&a.id()].buf, cells * row_bytes);
                s.kv.insert(b.id(), d);
                r?;
            }
            Ok(())
        })());
        true
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
