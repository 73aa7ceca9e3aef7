//! The KV cache: keys and values of every layer for positions `0..n_ctx`, in f16 or int8.
//!
//! Cell `p` of a layer holds the token at position `p` of one sequence. Cells are stored in blocks of
//! [`KV_BLOCK_CELLS`] taken from a [`KvPool`] the engine's sequences share as they are written (a paged cache):
//! a sequence holds only the blocks of the tokens it has, and sequences with a common prompt prefix share its
//! blocks, copying one only when they write it. Where the blocks live depends on the pool: in host memory, a
//! block per layer's keys or values, for the CPU; or on a device ([`KvPool::on_device`]), where a block is a
//! numbered row range of the pool's arrays of every layer and the cache keeps only its [`BlockTable`] (the GPU
//! backend stores and reads the data). A row is
//! one token's keys (or values) for all KV heads, `n_head_kv * head_dim` values, stored as whole blocks of a
//! GGML type so the quant module's dot products and dequantizers apply as they are:
//! - `f16`: [`GgmlType::F16`], 2 bytes per value;
//! - `int8`: [`GgmlType::Q8_0`], blocks of 32 values with one f16 scale each (34 bytes per 32 values,
//!   1.0625 bytes per value). `head_dim` must be a multiple of 32 so a block never straddles two heads.

use std::fmt;
use std::str::FromStr;
use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use half::slice::HalfFloatSliceExt;

use crate::quant::{self, GgmlType};

/// Storage type of the cache (`--kv f16|int8`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum KvType {
    #[default]
    F16,
    /// Per-32-value blocks of int8 with an f16 scale (ggml's Q8_0 layout).
    Int8,
}

impl KvType {
    /// The GGML block type rows are stored in.
    pub fn ggml(self) -> GgmlType {
        match self {
            KvType::F16 => GgmlType::F16,
            KvType::Int8 => GgmlType::Q8_0,
        }
    }
}

impl fmt::Display for KvType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            KvType::F16 => "f16",
            KvType::Int8 => "int8",
        })
    }
}

impl FromStr for KvType {
    type Err = String;
    fn from_str(s: &str) -> Result<KvType, String> {
        match s {
            "f16" => Ok(KvType::F16),
            "int8" | "q8_0" => Ok(KvType::Int8),
            _ => Err(format!("unknown KV cache type `{s}`; known: f16, int8")),
        }
    }
}

/// Why a cache could not be made.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KvError {
    #[error("an int8 KV cache needs head widths that are multiples of 32; this model has {head_dim}")]
    HeadDim { head_dim: usize },
    #[error("a KV cache needs a context of at least one token")]
    Empty,
}

/// The numbers a cache is sized from (a model's attention geometry; `model::HParams::kv_shape` gives them).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvShape {
    /// Layers with a KV cache.
    pub n_layer: usize,
    /// KV heads per layer (GQA: fewer than the query heads).
    pub n_head_kv: usize,
    /// Values per key head.
    pub head_dim: usize,
    /// Values per value head.
    pub head_dim_v: usize,
}

impl KvShape {
    /// Bytes of one cell (one token's keys and values over every layer) in a cache of type `ty`.
    ///
    /// Errors: an int8 cache for a head width that is not a multiple of 32.
    pub fn cell_bytes(&self, ty: KvType) -> Result<usize, KvError> {
        let mut per_layer: usize = 0;
        for d in [self.head_dim, self.head_dim_v] {
            let head = ty.ggml().row_bytes(d as u64).ok_or(KvError::HeadDim { head_dim: d })? as usize;
            // Saturating: a hostile header's geometry gives usize::MAX, never a wrapped small size.
            per_layer = per_layer.saturating_add(head.saturating_mul(self.n_head_kv));
        }
        Ok(per_layer.saturating_mul(self.n_layer))
    }
}

/// A sequence slot: the identity of one KV cache (one sequence's state) for as long as it lives, unique in the
/// process. A backend keys its device state by it (a GPU's page table of the cache, its recorded decode graphs), never
/// by a host address, and releases it when the sequence ends ([`crate::backend::Backend::release_slot`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SeqSlot(pub u32);

impl SeqSlot {
    /// A slot no other cache of this process has had.
    pub fn fresh() -> SeqSlot {
        static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(1);
        SeqSlot(NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed))
    }
}

/// Which rows of which cache: the slot, the layer, keys or values. A backend's key for its copy of the rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct KvRowsId {
    pub slot: SeqSlot,
    pub layer: u32,
    pub values: bool,
}

/// Cells per KV block: the unit a cache takes from its [`KvPool`], shares with another sequence and copies on
/// write (vLLM's default block size, "Efficient Memory Management for LLM Serving with PagedAttention", Kwon et
/// al. 2023, section 4).
pub const KV_BLOCK_CELLS: usize = 16;

/// The KV blocks of one engine's sequences: how many their caches may hold at once and how many they hold.
///
/// A block is [`KV_BLOCK_CELLS`] cells of every layer's keys and values. Each layer's keys and values of a block
/// are stored and counted apart (a block of `n_layer` layers is `2 * n_layer` *row blocks*), so the count is exact
/// whichever layer a copy-on-write reaches first. A cache takes a block when it first writes one of its cells and
/// gives it back when it forgets those cells ([`KvCache::truncate`]) or is dropped; a block shared by several
/// sequences ([`KvCache::share_prefix_from`]) is counted once.
///
/// The pool never refuses a write: the scheduler asks [`KvCache::rows_needed`] before a step and makes room first
/// (`runtime::batch`: it drops idle slots' caches, then preempts the newest sequence).
///
/// A pool on a device ([`KvPool::on_device`]) hands out whole blocks of every layer at once, numbered
/// `0..`[`KvPool::id_bound`] (the lowest freed number first, so a sequence that starts again after another ended
/// gets the same ascending rows), for the caches' [`BlockTable`]s.
#[derive(Debug)]
pub struct KvPool {
    /// Unique in the process: a backend's key for its storage of the pool's blocks.
    id: u32,
    /// Row blocks per block: 2 per layer.
    rows_per_block: usize,
    /// Most row blocks held at once; `None`: no limit.
    capacity: Option<usize>,
    held: AtomicUsize,
    /// The caches' blocks live on a device: their [`BlockTable`]s count, not their host rows.
    on_device: bool,
    /// Device block numbers given back, handed out again (lowest first) before new ones.
    free_ids: Mutex<std::collections::BinaryHeap<std::cmp::Reverse<u32>>>,
    /// One past the largest device block number handed out.
    next_id: AtomicU32,
}

impl KvPool {
    /// A pool of host blocks for caches of `shape` holding at most `tokens` cells per layer in all (rounded up to
    /// whole blocks), or any number (`None`).
    pub fn new(shape: &KvShape, tokens: Option<usize>) -> Arc<KvPool> {
        KvPool::placed(shape, tokens, false)
    }

    /// [`KvPool::new`] for caches a device keeps (a GPU backend's): blocks are numbered for the caches' block
    /// tables ([`KvRows::take_device_blocks`]), and the counts follow those tables.
    pub fn on_device(shape: &KvShape, tokens: Option<usize>) -> Arc<KvPool> {
        KvPool::placed(shape, tokens, true)
    }

    /// [`KvPool::on_device`] or [`KvPool::new`] as `on_device` says (a backend's
    /// [`crate::backend::Backend::kv_on_device`]).
    pub fn placed(shape: &KvShape, tokens: Option<usize>, on_device: bool) -> Arc<KvPool> {
        static NEXT: AtomicU32 = AtomicU32::new(1);
        let rows_per_block = 2 * shape.n_layer.max(1);
        Arc::new(KvPool {
            id: NEXT.fetch_add(1, Ordering::Relaxed),
            rows_per_block,
            capacity: tokens.map(|t| t.div_ceil(KV_BLOCK_CELLS).saturating_mul(rows_per_block)),
            held: AtomicUsize::new(0),
            on_device,
            free_ids: Mutex::new(std::collections::BinaryHeap::new()),
            next_id: AtomicU32::new(0),
        })
    }

    /// The pool's identity (unique in the process).
    pub fn id(&self) -> u32 {
        self.id
    }

    /// Whether the caches' blocks live on a device ([`KvPool::on_device`]).
    pub fn is_on_device(&self) -> bool {
        self.on_device
    }

    /// One past the largest device block number handed out so far: a device's arrays for the pool need this many
    /// blocks of rows. Never more than the most blocks held at once (freed numbers are handed out first).
    pub fn id_bound(&self) -> usize {
        self.next_id.load(Ordering::Relaxed) as usize
    }

    /// Blocks the pool may hold (`None`: no limit).
    pub fn capacity_blocks(&self) -> Option<usize> {
        self.capacity.map(|c| c / self.rows_per_block)
    }

    /// Blocks held now (a block counts once however many sequences share it; a block whose layers are partly
    /// copied counts as whole blocks rounded up).
    pub fn held_blocks(&self) -> usize {
        self.held_rows().div_ceil(self.rows_per_block)
    }

    /// Row blocks held now.
    pub fn held_rows(&self) -> usize {
        self.held.load(Ordering::Relaxed)
    }

    /// Row blocks that may still be taken (`None`: no limit).
    pub fn free_rows(&self) -> Option<usize> {
        self.capacity.map(|c| c.saturating_sub(self.held_rows()))
    }

    /// Row blocks per block (2 per layer).
    pub fn rows_per_block(&self) -> usize {
        self.rows_per_block
    }
}

/// One layer's keys or values for [`KV_BLOCK_CELLS`] cells, counted in its pool while it lives. Cloning it (a
/// copy-on-write of a shared block) takes another row block from the pool.
#[derive(Debug)]
struct RowBlock {
    data: Box<[u8]>,
    pool: Arc<KvPool>,
}

impl RowBlock {
    fn zeroed(bytes: usize, pool: &Arc<KvPool>) -> RowBlock {
        pool.held.fetch_add(1, Ordering::Relaxed);
        RowBlock {
            data: vec![0; bytes].into_boxed_slice(),
            pool: pool.clone(),
        }
    }
}

impl Clone for RowBlock {
    fn clone(&self) -> RowBlock {
        self.pool.held.fetch_add(1, Ordering::Relaxed);
        RowBlock {
            data: self.data.clone(),
            pool: self.pool.clone(),
        }
    }
}

impl Drop for RowBlock {
    fn drop(&mut self) {
        self.pool.held.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Blocks of `blocks` (a cache's, per layer on the host or its device table) a write of cells `from..to` would
/// take from the pool: those not held yet and those another cache shares (copied on write).
fn blocks_to_take<T>(blocks: &[Arc<T>], from: usize, to: usize) -> usize {
    if from >= to {
        return 0;
    }
    (from / KV_BLOCK_CELLS..=(to - 1) / KV_BLOCK_CELLS)
        .filter(|&b| blocks.get(b).is_none_or(|blk| Arc::strong_count(blk) > 1))
        .count()
}

/// Blocks of `blocks` past the first `keep` that no other cache shares (given back by a truncation to them).
fn own_past<T>(blocks: &[Arc<T>], keep: usize) -> usize {
    blocks.iter().skip(keep).filter(|b| Arc::strong_count(b) == 1).count()
}

/// Adds an identity (an address) of each block of `blocks` another cache shares to `out`.
fn add_shared<T>(blocks: &[Arc<T>], out: &mut std::collections::HashSet<usize>) {
    out.extend(
        blocks
            .iter()
            .filter(|b| Arc::strong_count(b) > 1)
            .map(|b| Arc::as_ptr(b) as *const u8 as usize),
    );
}

/// A block of a device pool: a number, rows `id * KV_BLOCK_CELLS..` of every layer's arrays on the device,
/// counted in its pool (as `rows_per_block` row blocks) while it lives and given back when dropped.
#[derive(Debug)]
struct DevBlock {
    id: u32,
    pool: Arc<KvPool>,
}

impl DevBlock {
    fn take(pool: &Arc<KvPool>) -> DevBlock {
        pool.held.fetch_add(pool.rows_per_block, Ordering::Relaxed);
        let reused = pool
            .free_ids
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .pop()
            .map(|r| r.0);
        let id = reused.unwrap_or_else(|| pool.next_id.fetch_add(1, Ordering::Relaxed));
        DevBlock { id, pool: pool.clone() }
    }
}

impl Drop for DevBlock {
    fn drop(&mut self) {
        self.pool.held.fetch_sub(self.pool.rows_per_block, Ordering::Relaxed);
        self.pool
            .free_ids
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(std::cmp::Reverse(self.id));
    }
}

/// A copy a device makes before a step writes a shared block ([`KvRows::take_device_blocks`]): every layer's
/// rows of block `src` into block `dst`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockCopy {
    pub src: u32,
    pub dst: u32,
}

/// The page table of a cache a device keeps: the pool block of each of its blocks of [`KV_BLOCK_CELLS`] cells
/// (cell `c` is row `ids()[c / KV_BLOCK_CELLS] * KV_BLOCK_CELLS + c % KV_BLOCK_CELLS` of each layer's array; the
/// kernels' `kv_cell`, kernels/common.cuh). Shared by the cache's layers, so a backend handed one layer reaches it
/// ([`KvRows::table`]).
#[derive(Debug, Default)]
pub struct BlockTable {
    blocks: Vec<Arc<DevBlock>>,
    /// Counts the changes of `blocks` (a device's copy of the table is current while this is what it copied).
    version: u64,
}

impl BlockTable {
    /// Changes with every change of the numbers (see [`BlockTable::ids`]).
    pub fn version(&self) -> u64 {
        self.version
    }

    fn truncate(&mut self, keep: usize) {
        if keep < self.blocks.len() {
            self.blocks.truncate(keep);
            self.version += 1;
        }
    }

    fn set(&mut self, blocks: Vec<Arc<DevBlock>>) {
        self.blocks = blocks;
        self.version += 1;
    }

    /// The pool block numbers of the cache's blocks `0..len`, in order.
    pub fn ids(&self) -> impl ExactSizeIterator<Item = u32> + '_ {
        self.blocks.iter().map(|b| b.id)
    }

    /// Blocks held.
    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }

    /// Takes from `pool` the blocks of cells `0..to` not held yet and, for those of `from..to` another cache
    /// shares, a block of its own whose copy it appends to `copies`. Returns whether any number changed.
    fn take(&mut self, pool: &Arc<KvPool>, from: usize, to: usize, copies: &mut Vec<BlockCopy>) -> bool {
        if from >= to {
            return false;
        }
        let last = (to - 1) / KV_BLOCK_CELLS;
        let mut changed = false;
        while self.blocks.len() <= last {
            self.blocks.push(Arc::new(DevBlock::take(pool)));
            changed = true;
        }
        for b in from / KV_BLOCK_CELLS..=last {
            if Arc::strong_count(&self.blocks[b]) > 1 {
                let own = Arc::new(DevBlock::take(pool));
                copies.push(BlockCopy {
                    src: self.blocks[b].id,
                    dst: own.id,
                });
                self.blocks[b] = own;
                changed = true;
            }
        }
        self.version += changed as u64;
        changed
    }
}

/// One layer's keys or values: `n_ctx` rows of `heads * head_dim` values, in blocks of [`KV_BLOCK_CELLS`] rows
/// taken from the cache's [`KvPool`] as they are first written (a paged cache: cell `p` is row `p %
/// KV_BLOCK_CELLS` of block `p / KV_BLOCK_CELLS`). A block another sequence shares is copied before it is
/// written.
#[derive(Debug)]
pub struct KvRows {
    id: KvRowsId,
    ty: GgmlType,
    /// Blocks of cells `0..blocks.len() * KV_BLOCK_CELLS`.
    blocks: Vec<Arc<RowBlock>>,
    pool: Arc<KvPool>,
    /// The cache's page table on a device (every layer's rows share it).
    table: Arc<Mutex<BlockTable>>,
    n_ctx: usize,
    head_dim: usize,
    heads: usize,
    /// Bytes of one head's slice of a row.
    head_bytes: usize,
}

impl KvRows {
    fn new(
        id: KvRowsId,
        ty: GgmlType,
        n_ctx: usize,
        (heads, head_dim): (usize, usize),
        pool: &Arc<KvPool>,
        table: &Arc<Mutex<BlockTable>>,
    ) -> KvRows {
        let head_bytes = ty.row_bytes(head_dim as u64).expect("head width checked") as usize;
        KvRows {
            id,
            ty,
            blocks: Vec::new(),
            pool: pool.clone(),
            table: table.clone(),
            n_ctx,
            head_dim,
            heads,
            head_bytes,
        }
    }

    /// Bytes of one row (`heads` heads of [`KvRows::head_dim`] values of [`KvRows::ty`]).
    pub fn row_bytes(&self) -> usize {
        self.heads * self.head_bytes
    }

    /// The pool the cache's blocks come from.
    pub fn pool(&self) -> &Arc<KvPool> {
        &self.pool
    }

    /// The cache's page table on a device (the same for every layer's rows of the cache). A device backend holds
    /// the lock while it reads or changes the table; nothing else takes it during a step.
    pub fn table(&self) -> MutexGuard<'_, BlockTable> {
        self.table.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// For a device writing cells `from..to` of the cache: takes the blocks of cells `0..to` not held yet and
    /// gives each block of `from..to` that another cache shares a block of its own, appending the copies of their
    /// rows the device must make first to `copies` (every layer's: the first layer a step writes takes them for
    /// all). Returns whether the table changed (the device's copy of it is stale).
    ///
    /// Panics if `to` is past `n_ctx`.
    pub fn take_device_blocks(&self, from: usize, to: usize, copies: &mut Vec<BlockCopy>) -> bool {
        assert!(to <= self.n_ctx, "KV write up to cell {to} of {}", self.n_ctx);
        self.table().take(&self.pool, from, to, copies)
    }

    /// Stores `row` (`heads * head_dim` values) at `cell`, rounding to the cache type. Takes the cell's block
    /// from the pool on its first write, and copies it first when another sequence shares it.
    ///
    /// Panics if `cell` is past `n_ctx`.
    pub fn write(&mut self, cell: usize, row: &[f32]) {
        assert!(cell < self.n_ctx, "KV write at cell {cell} of {}", self.n_ctx);
        let (b, bytes) = (cell / KV_BLOCK_CELLS, self.row_bytes());
        while self.blocks.len() <= b {
            self.blocks
                .push(Arc::new(RowBlock::zeroed(KV_BLOCK_CELLS * bytes, &self.pool)));
        }
        let block = Arc::make_mut(&mut self.blocks[b]);
        let at = (cell % KV_BLOCK_CELLS) * bytes;
        quant::quantize(self.ty, row, &mut block.data[at..at + bytes]).expect("row width fixed at construction");
    }

    /// The stored bytes of head `head` at `cell`; `None` for a cell whose block was never written.
    #[inline]
    fn head(&self, cell: usize, head: usize) -> Option<&[u8]> {
        let block = self.blocks.get(cell / KV_BLOCK_CELLS)?;
        let start = ((cell % KV_BLOCK_CELLS) * self.heads + head) * self.head_bytes;
        Some(&block.data[start..start + self.head_bytes])
    }

    /// Head `head` of `cell` as f32 into `out` (`head_dim` values); zeros for a cell never written.
    #[inline]
    pub fn read(&self, cell: usize, head: usize, out: &mut [f32]) {
        match self.head(cell, head) {
            Some(bytes) => self.convert(bytes, out),
            None => out.fill(0.0),
        }
    }

    /// Head `head` of cells `from..to` as f32 into `out` (`(to - from) * head_dim` values, cell by cell): what
    /// [`KvRows::read`] gives for each, a block at a time; zeros for cells never written.
    ///
    /// Panics if `out` is not that long.
    pub fn read_cells(&self, from: usize, to: usize, head: usize, out: &mut [f32]) {
        let d = self.head_dim;
        assert_eq!(out.len(), to.saturating_sub(from) * d, "read_cells: out");
        let (mut cell, mut rest) = (from, out);
        // The cells up to the end of `cell`'s block, then block by block.
        while !rest.is_empty() {
            let in_block = (KV_BLOCK_CELLS - cell % KV_BLOCK_CELLS).min(rest.len() / d);
            let (now, later) = rest.split_at_mut(in_block * d);
            match self.blocks.get(cell / KV_BLOCK_CELLS) {
                None => now.fill(0.0),
                Some(block) => {
                    for (i, o) in now.chunks_exact_mut(d).enumerate() {
                        let start = (((cell + i) % KV_BLOCK_CELLS) * self.heads + head) * self.head_bytes;
                        self.convert(&block.data[start..start + self.head_bytes], o);
                    }
                }
            }
            cell += in_block;
            rest = later;
        }
    }

    /// Cell `cell`'s head `head` as stored, when the rows are f16 and the cell's block is written (`None`
    /// otherwise: [`KvRows::read_cells`] reads it). The same values `read_cells` gives, unconverted.
    #[inline]
    pub fn cell_f16(&self, cell: usize, head: usize) -> Option<&[half::f16]> {
        if self.ty != GgmlType::F16 {
            return None;
        }
        let block = self.blocks.get(cell / KV_BLOCK_CELLS)?;
        let start = ((cell % KV_BLOCK_CELLS) * self.heads + head) * self.head_bytes;
        bytemuck::try_cast_slice(&block.data[start..start + self.head_bytes]).ok()
    }

    /// One head's stored bytes as f32.
    #[inline]
    fn convert(&self, bytes: &[u8], out: &mut [f32]) {
        if self.ty == GgmlType::F16
            && let Ok(halves) = bytemuck::try_cast_slice::<u8, half::f16>(bytes)
        {
            // Hot path of attention: half's slice conversion uses F16C when present.
            halves.convert_to_f32_slice(out);
            return;
        }
        quant::dequantize(self.ty, bytes, out).expect("head width fixed at construction");
    }

    /// Which rows these are (a backend's key for its copy of them).
    pub fn id(&self) -> KvRowsId {
        self.id
    }

    /// The storage type ([`GgmlType::F16`] or [`GgmlType::Q8_0`]).
    pub fn ty(&self) -> GgmlType {
        self.ty
    }

    /// Values per head.
    pub fn head_dim(&self) -> usize {
        self.head_dim
    }

    /// Heads per row.
    pub fn heads(&self) -> usize {
        self.heads
    }

    /// Values per row (`heads * head_dim`).
    pub fn width(&self) -> usize {
        self.heads * self.head_dim
    }

    /// Bytes of all `n_ctx` rows: what the rows take with every cell held.
    pub fn bytes(&self) -> usize {
        self.n_ctx * self.row_bytes()
    }

    /// Bytes of the blocks held now.
    pub fn held_bytes(&self) -> usize {
        self.blocks.len() * KV_BLOCK_CELLS * self.row_bytes()
    }
}

/// One layer of the cache.
#[derive(Debug)]
pub struct KvLayer {
    pub k: KvRows,
    pub v: KvRows,
}

/// The whole cache: one [`KvLayer`] per transformer block, paged in blocks of [`KV_BLOCK_CELLS`] cells from a
/// [`KvPool`].
///
/// Not `Clone`: a cache is one sequence's state, with a slot of its own.
#[derive(Debug)]
pub struct KvCache {
    slot: SeqSlot,
    ty: KvType,
    n_ctx: usize,
    pool: Arc<KvPool>,
    /// The page table on a device (a pool [`KvPool::on_device`]; every layer's rows hold it too).
    table: Arc<Mutex<BlockTable>>,
    pub layers: Vec<KvLayer>,
}

impl KvCache {
    /// A cache of `n_ctx` cells per layer of `shape`, in a pool of its own with no limit. Nothing is allocated
    /// until cells are written.
    ///
    /// Errors: `n_ctx` is 0; an int8 cache for a head width that is not a multiple of 32.
    pub fn new(shape: &KvShape, n_ctx: usize, ty: KvType) -> Result<KvCache, KvError> {
        KvCache::new_in(shape, n_ctx, ty, &KvPool::new(shape, None))
    }

    /// A cache of `n_ctx` cells per layer of `shape` whose blocks come from `pool` (a pool of caches of this
    /// shape: an engine's sequences share one).
    ///
    /// Errors: as [`KvCache::new`].
    ///
    /// Panics if `pool` was made for another number of layers.
    pub fn new_in(shape: &KvShape, n_ctx: usize, ty: KvType, pool: &Arc<KvPool>) -> Result<KvCache, KvError> {
        if n_ctx == 0 {
            return Err(KvError::Empty);
        }
        assert_eq!(
            pool.rows_per_block,
            2 * shape.n_layer.max(1),
            "KvCache::new_in: a pool of another model"
        );
        shape.cell_bytes(ty)?;
        let (dk, dv, heads) = (shape.head_dim, shape.head_dim_v, shape.n_head_kv);
        let slot = SeqSlot::fresh();
        let id = |layer: usize, values| KvRowsId {
            slot,
            layer: layer as u32,
            values,
        };
        let table = Arc::new(Mutex::new(BlockTable::default()));
        let layers = (0..shape.n_layer)
            .map(|il| KvLayer {
                k: KvRows::new(id(il, false), ty.ggml(), n_ctx, (heads, dk), pool, &table),
                v: KvRows::new(id(il, true), ty.ggml(), n_ctx, (heads, dv), pool, &table),
            })
            .collect();
        Ok(KvCache {
            slot,
            ty,
            n_ctx,
            pool: pool.clone(),
            table,
            layers,
        })
    }

    /// The cache's sequence slot.
    pub fn slot(&self) -> SeqSlot {
        self.slot
    }

    pub fn ty(&self) -> KvType {
        self.ty
    }

    /// Cells per layer: the longest sequence the cache holds, in tokens.
    pub fn n_ctx(&self) -> usize {
        self.n_ctx
    }

    /// The pool the cache's blocks come from.
    pub fn pool(&self) -> &Arc<KvPool> {
        &self.pool
    }

    /// Bytes of all layers with every cell held (see [`KvRows::bytes`]).
    pub fn bytes(&self) -> usize {
        self.layers.iter().map(|l| l.k.bytes() + l.v.bytes()).sum()
    }

    /// Bytes of the blocks the cache holds now (shared blocks included).
    pub fn held_bytes(&self) -> usize {
        if self.pool.on_device {
            let cell: usize = self.layers.iter().map(|l| l.k.row_bytes() + l.v.row_bytes()).sum();
            return self.held_blocks() * KV_BLOCK_CELLS * cell;
        }
        self.layers.iter().map(|l| l.k.held_bytes() + l.v.held_bytes()).sum()
    }

    /// Blocks the cache holds now (shared ones included).
    pub fn held_blocks(&self) -> usize {
        if self.pool.on_device {
            return self.table().len();
        }
        self.layers.first().map_or(0, |l| l.k.blocks.len())
    }

    /// The page table on a device (see [`KvRows::table`]).
    pub fn table(&self) -> MutexGuard<'_, BlockTable> {
        self.table.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Keeps cells `0..cells` and gives the blocks past them back to the pool (the sequence forgot those tokens).
    pub fn truncate(&mut self, cells: usize) {
        let keep = cells.div_ceil(KV_BLOCK_CELLS);
        for l in &mut self.layers {
            l.k.blocks.truncate(keep);
            l.v.blocks.truncate(keep);
        }
        self.table().truncate(keep);
    }

    /// Row blocks [`KvCache::truncate`] to `cells` would give back to the pool: the blocks past them that no other
    /// cache shares.
    pub fn rows_freed_by_truncate(&self, cells: usize) -> usize {
        let keep = cells.div_ceil(KV_BLOCK_CELLS);
        if self.pool.on_device {
            return own_past(&self.table().blocks, keep) * self.pool.rows_per_block;
        }
        self.layers
            .iter()
            .flat_map(|l| [&l.k, &l.v])
            .map(|r| own_past(&r.blocks, keep))
            .sum()
    }

    /// Row blocks a step writing cells `from..to` would take from the pool (see [`KvPool`]): in every layer,
    /// the blocks of those cells not held yet and those another sequence shares.
    pub fn rows_needed(&self, from: usize, to: usize) -> usize {
        if self.pool.on_device {
            return blocks_to_take(&self.table().blocks, from, to) * self.pool.rows_per_block;
        }
        self.layers
            .iter()
            .map(|l| blocks_to_take(&l.k.blocks, from, to) + blocks_to_take(&l.v.blocks, from, to))
            .sum()
    }

    /// Makes cells `0..cells` the blocks of `src` (a cache of the same model and type, in the same pool: a
    /// prompt prefix another sequence computed) and forgets the rest: the blocks are shared, not copied, and
    /// whichever sequence writes a shared block first copies it then (the last, partly filled block included).
    ///
    /// Panics if the two differ in layers, row shapes, type or pool, or `cells` is past either's `n_ctx`.
    pub fn share_prefix_from(&mut self, src: &KvCache, cells: usize) {
        assert!(
            self.ty == src.ty
                && Arc::ptr_eq(&self.pool, &src.pool)
                && self.layers.len() == src.layers.len()
                && cells <= self.n_ctx.min(src.n_ctx),
            "share_prefix_from: caches of different shapes or pools, or {cells} cells"
        );
        let n = cells.div_ceil(KV_BLOCK_CELLS);
        let shared: Vec<Arc<DevBlock>> = src.table().blocks.iter().take(n).cloned().collect();
        self.table().set(shared);
        for (d, s) in self.layers.iter_mut().zip(&src.layers) {
            for (d, s) in [(&mut d.k, &s.k), (&mut d.v, &s.v)] {
                assert!(
                    d.heads == s.heads && d.head_bytes == s.head_bytes,
                    "share_prefix_from: row shapes"
                );
                d.blocks.clear();
                d.blocks.extend(s.blocks.iter().take(n).cloned());
            }
        }
    }

    /// Adds to `out` an identity (an address) of each block of the first layer's keys that another cache shares
    /// (`strata serve`'s count of shared blocks: the same identity from two caches is one block).
    pub fn shared_blocks(&self, out: &mut std::collections::HashSet<usize>) {
        if self.pool.on_device {
            add_shared(&self.table().blocks, out);
        } else if let Some(l) = self.layers.first() {
            add_shared(&l.k.blocks, out);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape() -> KvShape {
        KvShape {
            n_layer: 2,
            n_head_kv: 2,
            head_dim: 32,
            head_dim_v: 32,
        }
    }

    fn row(cell: usize) -> Vec<f32> {
        (0..64).map(|i| (cell * 64 + i) as f32 * 0.25).collect()
    }

    fn fill(c: &mut KvCache, cells: std::ops::Range<usize>) {
        for cell in cells {
            for l in &mut c.layers {
                l.k.write(cell, &row(cell));
                l.v.write(cell, &row(cell + 1000));
            }
        }
    }

    fn key(c: &KvCache, layer: usize, cell: usize) -> Vec<f32> {
        let mut out = vec![0.0; 64];
        for h in 0..2 {
            c.layers[layer].k.read(cell, h, &mut out[h * 32..(h + 1) * 32]);
        }
        out
    }

    #[test]
    fn blocks_are_taken_as_cells_are_written_and_given_back_on_truncate_and_drop() {
        let pool = KvPool::new(&shape(), Some(64));
        assert_eq!((pool.capacity_blocks(), pool.held_blocks()), (Some(4), 0));
        let mut a = KvCache::new_in(&shape(), 64, KvType::F16, &pool).unwrap();
        assert_eq!(a.rows_needed(0, 17), 2 * 4, "two blocks of 2 layers x K, V");
        fill(&mut a, 0..17);
        assert_eq!((pool.held_blocks(), pool.held_rows(), a.held_blocks()), (2, 8, 2));
        assert_eq!(a.rows_needed(17, 32), 0, "cells of a block held");
        assert_eq!(key(&a, 1, 16), row(16));
        // A span across the block boundary and past the cells written reads as cell by cell.
        let mut span = vec![1.0; 20 * 32];
        a.layers[1].k.read_cells(3, 23, 1, &mut span);
        for (i, cell) in (3..23).enumerate() {
            let mut one = vec![1.0; 32];
            a.layers[1].k.read(cell, 1, &mut one);
            assert_eq!(span[i * 32..(i + 1) * 32], one[..], "cell {cell}");
        }
        assert_eq!(span[19 * 32..], [0.0; 32], "cell 22 was never written");
        assert_eq!(a.rows_freed_by_truncate(16), 4);
        assert_eq!(a.rows_freed_by_truncate(0), 8);
        a.truncate(16);
        assert_eq!(pool.held_blocks(), 1);
        assert_eq!(key(&a, 0, 16), vec![0.0; 64], "a cell given back reads as zeros");
        drop(a);
        assert_eq!(pool.held_rows(), 0);
    }

    #[test]
    fn a_shared_prefix_is_counted_once_and_copied_when_either_sequence_writes_it() {
        let pool = KvPool::new(&shape(), None);
        let mut a = KvCache::new_in(&shape(), 64, KvType::Int8, &pool).unwrap();
        let mut b = KvCache::new_in(&shape(), 64, KvType::Int8, &pool).unwrap();
        fill(&mut a, 0..20);
        let before = key(&a, 1, 19);
        b.share_prefix_from(&a, 18);
        assert_eq!(pool.held_blocks(), 2, "shared, not copied");
        let mut shared = std::collections::HashSet::new();
        a.shared_blocks(&mut shared);
        b.shared_blocks(&mut shared);
        assert_eq!(shared.len(), 2);
        assert_eq!(b.rows_freed_by_truncate(0), 0, "every block of b is a's too");
        // b writes cell 18 of the second block: it copies it; a's cell 18 and 19 keep their values.
        assert_eq!(b.rows_needed(18, 19), 4);
        let mut other = row(7);
        other[0] = -3.0;
        for l in &mut b.layers {
            l.k.write(18, &other);
            l.v.write(18, &other);
        }
        assert_eq!(pool.held_blocks(), 3);
        assert_eq!(key(&a, 1, 19), before);
        assert_ne!(key(&a, 1, 18), key(&b, 1, 18));
        assert_eq!(key(&a, 0, 5), key(&b, 0, 5), "the first block still shared");
        assert_eq!(a.rows_needed(18, 20), 0, "a's copy is its own again");
        drop(a);
        assert_eq!(b.rows_needed(0, 1), 0, "the last holder writes in place");
        drop(b);
        assert_eq!(pool.held_rows(), 0);
    }

    /// A device pool numbers whole blocks (every layer at once), hands a freed number out again first, shares a
    /// prefix's numbers, and gives a sequence writing a shared block a number of its own with the copy to make;
    /// its counts follow the tables, not the (empty) host rows.
    #[test]
    fn a_device_pool_numbers_blocks_shares_them_and_lists_the_copies_on_write() {
        let pool = KvPool::on_device(&shape(), Some(64));
        let rows = 2 * 2;
        let mut a = KvCache::new_in(&shape(), 64, KvType::F16, &pool).unwrap();
        let mut b = KvCache::new_in(&shape(), 64, KvType::F16, &pool).unwrap();
        assert_eq!(a.rows_needed(0, 20), 2 * rows);
        let mut copies = vec![];
        assert!(
            a.layers[1].v.take_device_blocks(0, 20, &mut copies),
            "any layer takes for the cache"
        );
        assert!(copies.is_empty());
        assert_eq!(a.table().ids().collect::<Vec<_>>(), [0, 1]);
        assert_eq!(
            (pool.held_blocks(), pool.held_rows(), pool.id_bound()),
            (2, 2 * rows, 2)
        );
        assert_eq!(
            (a.held_blocks(), a.rows_needed(0, 32), a.rows_needed(30, 33)),
            (2, 0, rows)
        );
        let v = a.table().version();
        assert!(!a.layers[0].k.take_device_blocks(16, 20, &mut copies), "nothing new");
        assert_eq!(a.table().version(), v);
        // b shares the first 18 cells: both blocks, counted once.
        b.share_prefix_from(&a, 18);
        assert_eq!(b.table().ids().collect::<Vec<_>>(), [0, 1]);
        assert_eq!(pool.held_blocks(), 2);
        let mut shared = std::collections::HashSet::new();
        a.shared_blocks(&mut shared);
        assert_eq!(shared.len(), 2);
        assert_eq!((b.rows_freed_by_truncate(0), b.rows_needed(18, 19)), (0, rows));
        // b writes cell 18: block 1 becomes its own, a copy of a's; block 0 stays shared.
        assert!(b.layers[0].k.take_device_blocks(18, 19, &mut copies));
        assert_eq!(copies, [BlockCopy { src: 1, dst: 2 }]);
        assert_eq!(b.table().ids().collect::<Vec<_>>(), [0, 2]);
        assert_eq!((pool.held_blocks(), a.rows_needed(18, 20)), (3, 0));
        // a forgets its second block: number 1 is free and handed out first.
        assert_eq!(a.rows_freed_by_truncate(16), rows);
        a.truncate(16);
        assert_eq!((pool.held_blocks(), a.table().version() > v), (2, true));
        copies.clear();
        a.layers[0].k.take_device_blocks(16, 40, &mut copies);
        assert_eq!(a.table().ids().collect::<Vec<_>>(), [0, 1, 3]);
        assert!(copies.is_empty());
        assert_eq!(
            (a.layers[0].k.blocks.len(), a.held_bytes()),
            (0, 3 * KV_BLOCK_CELLS * 2 * 2 * 64 * 2)
        );
        drop(a);
        assert_eq!((pool.held_blocks(), b.rows_needed(0, 1)), (2, 0));
        drop(b);
        assert_eq!(pool.held_rows(), 0);
        // Every number is free: a new sequence gets the lowest, in order.
        let c = KvCache::new_in(&shape(), 64, KvType::F16, &pool).unwrap();
        c.layers[0].k.take_device_blocks(0, 64, &mut copies);
        assert_eq!(c.table().ids().collect::<Vec<_>>(), [0, 1, 2, 3]);
        assert_eq!(pool.id_bound(), 4);
    }
}
