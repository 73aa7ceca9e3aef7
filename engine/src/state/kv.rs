//! The KV cache: keys and values of every layer for positions `0..n_ctx`, in f16 or int8.
//!
//! Cell `p` of a layer holds the token at position `p` (a linear cache: one sequence, no eviction). A row is
//! one token's keys (or values) for all KV heads, `n_head_kv * head_dim` values, stored as whole blocks of a
//! GGML type so the quant module's dot products and dequantizers apply as they are:
//! - `f16`: [`GgmlType::F16`], 2 bytes per value;
//! - `int8`: [`GgmlType::Q8_0`], blocks of 32 values with one f16 scale each (34 bytes per 32 values,
//!   1.0625 bytes per value). `head_dim` must be a multiple of 32 so a block never straddles two heads.

use std::fmt;
use std::str::FromStr;

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
/// process. A backend keys its device state by it (a GPU's twin of the cache, its recorded decode graphs), never
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

/// One layer's keys or values: `n_ctx` rows of `heads * head_dim` values.
#[derive(Debug)]
pub struct KvRows {
    id: KvRowsId,
    ty: GgmlType,
    data: Vec<u8>,
    head_dim: usize,
    heads: usize,
    /// Bytes of one head's slice of a row.
    head_bytes: usize,
}

impl KvRows {
    fn new(id: KvRowsId, ty: GgmlType, n_ctx: usize, heads: usize, head_dim: usize) -> KvRows {
        let head_bytes = ty.row_bytes(head_dim as u64).expect("head width checked") as usize;
        KvRows {
            id,
            ty,
            data: vec![0; n_ctx * heads * head_bytes],
            head_dim,
            heads,
            head_bytes,
        }
    }

    /// Stores `row` (`heads * head_dim` values) at `cell`, rounding to the cache type.
    pub fn write(&mut self, cell: usize, row: &[f32]) {
        let bytes = self.heads * self.head_bytes;
        let dst = &mut self.data[cell * bytes..(cell + 1) * bytes];
        quant::quantize(self.ty, row, dst).expect("row width fixed at construction");
    }

    /// The stored bytes of head `head` at `cell`.
    #[inline]
    fn head(&self, cell: usize, head: usize) -> &[u8] {
        let start = (cell * self.heads + head) * self.head_bytes;
        &self.data[start..start + self.head_bytes]
    }

    /// Head `head` of `cell` as f32 into `out` (`head_dim` values).
    #[inline]
    pub fn read(&self, cell: usize, head: usize, out: &mut [f32]) {
        let bytes = self.head(cell, head);
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

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        self.data.len()
    }
}

/// One layer of the cache.
#[derive(Debug)]
pub struct KvLayer {
    pub k: KvRows,
    pub v: KvRows,
}

/// The whole cache: one [`KvLayer`] per transformer block.
///
/// Not `Clone`: a cache is one sequence's state, with a slot of its own.
#[derive(Debug)]
pub struct KvCache {
    slot: SeqSlot,
    ty: KvType,
    n_ctx: usize,
    pub layers: Vec<KvLayer>,
}

impl KvCache {
    /// A cache of `n_ctx` cells per layer of `shape` (zero-filled, allocated now).
    ///
    /// Errors: `n_ctx` is 0; an int8 cache for a head width that is not a multiple of 32.
    pub fn new(shape: &KvShape, n_ctx: usize, ty: KvType) -> Result<KvCache, KvError> {
        if n_ctx == 0 {
            return Err(KvError::Empty);
        }
        shape.cell_bytes(ty)?;
        let (dk, dv, heads) = (shape.head_dim, shape.head_dim_v, shape.n_head_kv);
        let slot = SeqSlot::fresh();
        let id = |layer: usize, values| KvRowsId {
            slot,
            layer: layer as u32,
            values,
        };
        let layers = (0..shape.n_layer)
            .map(|il| KvLayer {
                k: KvRows::new(id(il, false), ty.ggml(), n_ctx, heads, dk),
                v: KvRows::new(id(il, true), ty.ggml(), n_ctx, heads, dv),
            })
            .collect();
        Ok(KvCache {
            slot,
            ty,
            n_ctx,
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

    /// Bytes held by all layers.
    pub fn bytes(&self) -> usize {
        self.layers.iter().map(|l| l.k.bytes() + l.v.bytes()).sum()
    }

    /// Copies cells `0..cells` of every layer's keys and values from `src`, a cache of the same model and type
    /// (a prompt prefix another sequence computed), byte for byte.
    ///
    /// Panics if the two differ in layers, row shapes or type, or `cells` is past either's `n_ctx`.
    pub fn copy_prefix_from(&mut self, src: &KvCache, cells: usize) {
        assert!(
            self.ty == src.ty && self.layers.len() == src.layers.len() && cells <= self.n_ctx.min(src.n_ctx),
            "copy_prefix_from: caches of different shapes, or {cells} cells"
        );
        for (d, s) in self.layers.iter_mut().zip(&src.layers) {
            for (d, s) in [(&mut d.k, &s.k), (&mut d.v, &s.v)] {
                assert!(
                    d.heads == s.heads && d.head_bytes == s.head_bytes,
                    "copy_prefix_from: row shapes"
                );
                let n = cells * d.heads * d.head_bytes;
                d.data[..n].copy_from_slice(&s.data[..n]);
            }
        }
    }
}
