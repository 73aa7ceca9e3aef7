//! KV caches on the device, paged: each [`KvPool`] of the engine has, per layer's keys or values, one array of rows
//! on the device (`blocks * KV_BLOCK_CELLS` rows, block `b` at rows `b * KV_BLOCK_CELLS..`), and each sequence a
//! page table (`u32` per block of its cells: the pool block holding them; the cache's [`BlockTable`]). Kernels find
//! cell `c` at row `pages[c / KV_BLOCK_CELLS] * KV_BLOCK_CELLS + c % KV_BLOCK_CELLS` (`kv_cell`,
//! kernels/common.cuh). Sequences with a common prefix share its blocks; a block is copied (every layer's rows) when
//! a sequence writes one another holds ("Efficient Memory Management for Large Language Model Serving with
//! PagedAttention", Kwon et al. 2023, sections 4.1-4.4).
//!
//! The device's copy is the cache's only copy of the data (its host rows stay empty); the host keeps the block
//! numbers ([`KvPool::on_device`] counts them).

use std::collections::HashMap;
use std::sync::{Arc, Weak};

use super::buffer::DevBuf;
use super::error::CudaError;
use super::launch::Arg;
use super::{CudaBackend, DevVec, Gpu, Inner, grid1};
use crate::quant::GgmlType;
use crate::state::kv::{BlockCopy, KV_BLOCK_CELLS, KvLayer, KvPool, KvRows, SeqSlot};

/// One layer's keys or values of a pool on the device.
struct DevArray {
    buf: DevBuf,
    /// Bytes of one row (one cell).
    row_bytes: usize,
    ty: GgmlType,
}

/// A [`KvPool`]'s rows on the device: an array per layer's keys or values, allocated at its first use, all of
/// `blocks` blocks. Dropped once the pool is (the backend holds it weakly).
pub(super) struct DevPool {
    pool: Weak<KvPool>,
    blocks: usize,
    arrays: HashMap<(u32, bool), DevArray>,
}

impl DevPool {
    /// Room for `need` blocks: the arrays grown (by half again at least) and their rows moved when fewer.
    fn grow(&mut self, gpu: &Gpu, need: usize) -> Result<(), CudaError> {
        if need > self.blocks {
            let blocks = need.max(self.blocks + self.blocks / 2);
            for a in self.arrays.values_mut() {
                let mut buf = DevBuf::alloc(&gpu.stream, blocks * KV_BLOCK_CELLS * a.row_bytes)?;
                buf.copy_from(&gpu.stream, &a.buf, a.buf.bytes)?;
                a.buf = buf;
            }
            self.blocks = blocks;
        }
        Ok(())
    }

    /// Every array's rows of block `c.src` into block `c.dst` (a copy-on-write), on the stream.
    fn copy_block(&mut self, gpu: &Gpu, c: BlockCopy) -> Result<(), CudaError> {
        for a in self.arrays.values_mut() {
            let bytes = KV_BLOCK_CELLS * a.row_bytes;
            let src = a.buf.ptr + (c.src as usize * bytes) as u64;
            a.buf.copy_in(&gpu.stream, c.dst as usize * bytes, src, bytes)?;
        }
        Ok(())
    }
}

/// A sequence's page table on the device, and the version of the host's table it holds
/// ([`crate::state::kv::BlockTable::version`]; `None`: none yet).
pub(super) struct DevTable {
    buf: DevBuf,
    version: Option<u64>,
}

/// Bytes of one head of a cache row and of a whole row, for `heads` heads of `head_dim` values of `ty`.
pub(super) fn kv_geometry(ty: GgmlType, heads: usize, head_dim: usize) -> (usize, usize) {
    let hb = ty
        .row_bytes(head_dim as u64)
        .expect("cache head width checked at construction") as usize;
    (hb, hb * heads)
}

/// Where one layer's keys or values of a sequence are on the device: the layer's array of the pool and the
/// sequence's page table (kernels/common.cuh `kv_cell`).
#[derive(Clone, Copy)]
pub(super) struct KvDev {
    pub base: u64,
    pub pages: u64,
    pub ty: GgmlType,
}

impl CudaBackend {
    /// The bytes of one K or V cache's `n_ctx` rows as the device holds them, cell by cell (tests and
    /// diagnostics); cells of blocks the cache does not hold read as zeros. `None` before the pool's array for those
    /// rows exists (nothing was stored in that layer).
    pub fn kv_device_bytes(&self, rows: &KvRows) -> Option<Vec<u8>> {
        let s = self.lock();
        let a = s
            .kv_pools
            .get(&rows.pool().id())?
            .arrays
            .get(&(rows.id().layer, rows.id().values))?;
        let rb = a.row_bytes;
        let mut out = vec![0u8; rows.bytes()];
        let ids: Vec<u32> = rows.table().ids().collect();
        for (b, chunk) in out.chunks_mut(KV_BLOCK_CELLS * rb).enumerate() {
            if let Some(&id) = ids.get(b) {
                a.buf
                    .read_at(&self.gpu.stream, id as usize * KV_BLOCK_CELLS * rb, chunk)
                    .ok()?;
            }
        }
        Some(out)
    }

    /// Allocates the device arrays of `cache`'s pool (every layer's keys and values, at the pool's size) now, not
    /// at the first step that stores into them: the engine does this at start, after the weights, so the memory plan
    /// is met or refused before any request. `cache` is any cache of the pool (its rows give the layers' geometry);
    /// `layers`, the layers this backend computes (all of them, or a stage's of a layer split). Returns the bytes
    /// the pool's arrays take.
    ///
    /// Errors: an allocation failed.
    pub fn alloc_kv_pool(
        &self,
        cache: &crate::state::kv::KvCache,
        layers: std::ops::Range<usize>,
    ) -> Result<u64, CudaError> {
        let g = &*self.gpu;
        let mut s = self.lock();
        for l in cache.layers.get(layers).unwrap_or_default() {
            s.kv_array(g, &l.k)?;
            s.kv_array(g, &l.v)?;
        }
        let p = s.kv_pools.get(&cache.pool().id());
        Ok(p.map_or(0, |p| p.arrays.values().map(|a| a.buf.bytes as u64).sum()))
    }

    /// Makes this backend a stage of a layer split, whose sequences' block tables the other stages share: the
    /// copy-on-write copies its steps make are kept for [`CudaBackend::take_kv_copies`] (the first stage to write a
    /// shared block takes it in the host's table, so the others learn of the copy only this way).
    pub fn share_kv_copies(&self) {
        self.lock().kv_copies_out.get_or_insert_with(Vec::new);
    }

    /// The copy-on-write copies made since the last call (empty unless [`CudaBackend::share_kv_copies`]).
    pub fn take_kv_copies(&self) -> Vec<(u32, BlockCopy)> {
        self.lock()
            .kv_copies_out
            .as_mut()
            .map(std::mem::take)
            .unwrap_or_default()
    }

    /// Makes another stage's copy-on-write copies in this backend's arrays (its layers' rows), on its stream, ahead of
    /// its next kernels. A pool this backend has no arrays of yet holds nothing to copy.
    pub fn make_kv_copies(&self, copies: &[(u32, BlockCopy)]) {
        if copies.is_empty() {
            return;
        }
        let g = &*self.gpu;
        let mut s = self.lock();
        Self::check((|| {
            for &(pool, c) in copies {
                let Some(p) = s.kv_pools.get_mut(&pool) else { continue };
                let need = p.pool.upgrade().map_or(0, |pl| pl.id_bound());
                p.grow(g, need)?;
                p.copy_block(g, c)?;
            }
            Ok(())
        })());
    }

    /// [`crate::backend::Backend::reserve_kv`] (the trait's method calls this).
    pub(super) fn reserve_kv_dev(&self, kv: &crate::state::kv::KvCache, from: usize, to: usize) {
        let Some(l) = kv.layers.first() else { return };
        let g = &*self.gpu;
        Self::check(self.lock().kv_cells(g, &l.k, from, to));
    }

    /// [`crate::backend::Backend::store_kv`] (the trait's method calls this).
    pub(super) fn store_kv_dev(&self, kv: &mut KvLayer, k: &DevVec, v: &DevVec, positions: &[u32]) {
        let n_tok = positions.len();
        let g = &*self.gpu;
        let mut s = self.lock();
        Self::check((|| {
            s.kv_store_cells(g, kv, positions)?;
            let pp = s.positions(g, positions)?;
            let kd = s.kv_dev(g, &kv.k)?;
            let vd = s.kv_dev(g, &kv.v)?;
            if kd.ty == GgmlType::F16 && vd.ty == GgmlType::F16 {
                // Keys and values in one launch.
                let (wk, wv) = (kv.k.width(), kv.v.width());
                assert!(
                    k.capacity() >= n_tok * wk && v.capacity() >= n_tok * wv,
                    "store_kv: shapes"
                );
                return g.launch(
                    "kv_store2_f16",
                    grid1(n_tok * (wk + wv), 256),
                    (256, 1, 1),
                    &[
                        Arg::P(k.ptr()),
                        Arg::P(kd.base),
                        Arg::P(v.ptr()),
                        Arg::P(vd.base),
                        Arg::P(kd.pages),
                        Arg::P(pp),
                        Arg::I(n_tok as i32),
                        Arg::I(wk as i32),
                        Arg::I(wv as i32),
                    ],
                );
            }
            for (rows, data, d) in [(&kv.k, k, kd), (&kv.v, v, vd)] {
                let width = rows.width();
                assert!(data.capacity() >= n_tok * width, "store_kv: shapes");
                let kernel = match d.ty {
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
                        Arg::P(d.base),
                        Arg::P(d.pages),
                        Arg::P(pp),
                        Arg::I(n_tok as i32),
                        Arg::I(width as i32),
                        Arg::L(rows.row_bytes() as i64),
                    ],
                )?;
            }
            Ok(())
        })());
    }
}

impl Inner {
    /// Before a store into `kv` at `positions` (a run's consecutive cells): [`Inner::kv_cells`] over them.
    pub(super) fn kv_store_cells(&mut self, gpu: &Gpu, kv: &KvLayer, positions: &[u32]) -> Result<(), CudaError> {
        let lo = positions.iter().min().map_or(0, |&p| p as usize);
        let hi = positions.iter().max().map_or(0, |&p| p as usize + 1);
        self.kv_cells(gpu, &kv.k, lo, hi)
    }

    /// Makes cells `from..to` of the cache `rows` belongs to writable on the device: takes their blocks
    /// ([`KvRows::take_device_blocks`]), grows the pool's arrays to every block number handed out, copies the rows
    /// of each block the cache no longer shares (every layer's), and uploads the cache's page table where it
    /// changed. The first layer a step writes does this for every layer; the others find nothing to do (no more
    /// than a look at the table and two map lookups: this runs for every layer of every sequence of a step).
    ///
    /// Errors: an allocation or copy failed.
    pub(super) fn kv_cells(&mut self, gpu: &Gpu, rows: &KvRows, from: usize, to: usize) -> Result<(), CudaError> {
        let mut copies: Vec<BlockCopy> = Vec::new();
        rows.take_device_blocks(from, to, &mut copies);
        let pool = rows.pool();
        if let Some(out) = self.kv_copies_out.as_mut() {
            out.extend(copies.iter().map(|c| (pool.id(), *c)));
        }
        let room = self.kv_pools.get(&pool.id()).map_or(0, |p| p.blocks);
        if !copies.is_empty() || pool.id_bound() > room {
            let p = self.kv_pool_blocks(gpu, rows)?;
            for &c in &copies {
                p.copy_block(gpu, c)?;
            }
        }
        self.kv_table(gpu, rows).map(|_| ())
    }

    /// The pool of `rows` on the device, with room for every block number its pool handed out: made at its first
    /// use with the pool's capacity (or the cache's whole context, for a pool without one), and grown (by half again
    /// at least) when numbers pass it. Growing moves the arrays: a recorded graph naming them is not replayed
    /// whole after an allocation ([`Gpu::can_replay`]), and a step compared with it launch by launch finds other
    /// arguments and records anew. Pools dropped on the host are freed when a new one is made.
    fn kv_pool_blocks(&mut self, gpu: &Gpu, rows: &KvRows) -> Result<&mut DevPool, CudaError> {
        let pool = rows.pool();
        if !self.kv_pools.contains_key(&pool.id()) {
            self.kv_pools.retain(|_, p| p.pool.strong_count() > 0);
        }
        let need = pool.id_bound().max(1);
        let p = self.kv_pools.entry(pool.id()).or_insert_with(|| DevPool {
            pool: Arc::downgrade(pool),
            blocks: pool
                .capacity_blocks()
                .unwrap_or_else(|| rows.bytes().div_ceil(rows.row_bytes()).div_ceil(KV_BLOCK_CELLS))
                .max(need),
            arrays: HashMap::new(),
        });
        p.grow(gpu, need)?;
        Ok(p)
    }

    /// The sequence's page table on the device, uploaded when the host's changed since; returns its address.
    fn kv_table(&mut self, gpu: &Gpu, rows: &KvRows) -> Result<u64, CudaError> {
        let slot: SeqSlot = rows.id().slot;
        let table = rows.table();
        if let Some(t) = self.kv_tables.get(&slot)
            && t.version == Some(table.version())
        {
            return Ok(t.buf.ptr);
        }
        let n_blocks = rows.bytes().div_ceil(rows.row_bytes()).div_ceil(KV_BLOCK_CELLS).max(1);
        if self.kv_tables.get(&slot).is_none_or(|t| t.buf.bytes != 4 * n_blocks) {
            let buf = DevBuf::upload(&gpu.stream, &vec![0u8; 4 * n_blocks])?;
            self.kv_tables.insert(slot, DevTable { buf, version: None });
        }
        let t = self.kv_tables.get_mut(&slot).expect("made above");
        let ids: Vec<u32> = table.ids().collect();
        t.buf.write(&gpu.stream, bytemuck::cast_slice(&ids))?;
        t.version = Some(table.version());
        Ok(t.buf.ptr)
    }

    /// Where `rows` are on the device (made if need be: the pool's array, zero blocks of the page table before
    /// any is taken). The addresses hold until the next [`Inner::kv_cells`] of the pool, which may grow (move)
    /// its arrays.
    ///
    /// Errors: an allocation failed.
    ///
    /// Panics if the pool's array for these rows holds another row type (caches of two KV types in one pool).
    pub(super) fn kv_dev(&mut self, gpu: &Gpu, rows: &KvRows) -> Result<KvDev, CudaError> {
        let pages = self.kv_table(gpu, rows)?;
        let (base, ty) = self.kv_array(gpu, rows)?;
        Ok(KvDev { base, pages, ty })
    }

    /// The address and row type of the pool's array for `rows` (its layer's keys or values), allocated at the
    /// pool's size if it is not yet.
    ///
    /// Errors and panics: as [`Inner::kv_dev`].
    fn kv_array(&mut self, gpu: &Gpu, rows: &KvRows) -> Result<(u64, GgmlType), CudaError> {
        let key = (rows.id().layer, rows.id().values);
        let have = self.kv_pools.get(&rows.pool().id()).and_then(|p| p.arrays.get(&key));
        if let Some(a) = have
            && a.ty == rows.ty()
            && a.row_bytes == rows.row_bytes()
        {
            return Ok((a.buf.ptr, a.ty));
        }
        let p = self.kv_pool_blocks(gpu, rows)?;
        if let Some(a) = p.arrays.get(&key) {
            // One array per layer's keys or values: every cache of a pool has the pool's row type.
            panic!(
                "KV pool {}: layer {} rows of {:?}, {} bytes, and a cache of {:?}, {} bytes in it",
                rows.pool().id(),
                key.0,
                a.ty,
                a.row_bytes,
                rows.ty(),
                rows.row_bytes()
            );
        }
        let buf = DevBuf::alloc(&gpu.stream, p.blocks * KV_BLOCK_CELLS * rows.row_bytes())?;
        let ptr = buf.ptr;
        p.arrays.insert(
            key,
            DevArray {
                buf,
                row_bytes: rows.row_bytes(),
                ty: rows.ty(),
            },
        );
        Ok((ptr, rows.ty()))
    }
}
