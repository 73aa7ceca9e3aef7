//! The expert store: where every routed expert's bytes live on the host (DESIGN.md section 3, "Expert cache").
//!
//! - [`StoreKind::Mmap`] reads the stacked `ffn_{gate,up,down}_exps` tensors in place from the mapped GGUF (its
//!   shards), with no copy: the OS page cache holds them (`--mmap-experts`).
//! - [`StoreKind::Arena`] copies them once, at load, into one host allocation owned by the store (which a GPU
//!   backend can page-lock, so uploads run at the link's pinned rate). If the allocation fails, or the arena
//!   would not fit in the host's available memory, [`ExpertStore::arena`] says why and the caller keeps `mmap`.
//!
//! Both hand out a layer's three stacked tensors, or one expert's gate, up and down rows, by index, as slices:
//! nothing is copied per use. A layer's tensors keep the GGUF's layout (expert `e` is the `e`-th of `n_expert`
//! equal parts of each tensor; [`super::ExpertShape`] gives the rows).

use rayon::prelude::*;

use crate::gguf::{GgufModel, TensorInfo};

/// Bytes one thread copies at a time into the arena.
const COPY_CHUNK: usize = 16 << 20;

use super::ExpertId;

/// Where the store keeps expert bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoreKind {
    Arena,
    Mmap,
}

impl std::fmt::Display for StoreKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            StoreKind::Arena => "arena",
            StoreKind::Mmap => "mmap",
        })
    }
}

/// One expert's bytes: its gate, up and down rows, in the GGUF's block format.
#[derive(Debug, Clone, Copy)]
pub struct ExpertBytes<'a> {
    pub gate: &'a [u8],
    pub up: &'a [u8],
    pub down: &'a [u8],
}

/// Why an arena was not made (the store stays `mmap`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ArenaError {
    #[error("the expert arena needs {need} bytes of host memory and {available} are available")]
    TooBig { need: u64, available: u64 },
    #[error("cannot allocate the {need}-byte expert arena: {why}")]
    Alloc { need: u64, why: String },
}

/// A MoE layer's three stacked expert tensors, as the weight map found them.
#[derive(Debug, Clone)]
pub struct LayerTensors {
    pub gate: TensorInfo,
    pub up: TensorInfo,
    pub down: TensorInfo,
}

/// Every routed expert of a model, by layer; layers without experts (dense ones) have none.
#[derive(Debug)]
pub struct ExpertStore {
    n_expert: usize,
    layers: Vec<Option<LayerTensors>>,
    /// The arena and, per layer, where its three tensors start in it.
    arena: Option<(Vec<u8>, Vec<[usize; 3]>)>,
}

impl ExpertStore {
    /// A store that reads the experts in place from the GGUF.
    pub fn mmap(layers: Vec<Option<LayerTensors>>, n_expert: usize) -> ExpertStore {
        ExpertStore {
            n_expert,
            layers,
            arena: None,
        }
    }

    /// Which store this is.
    pub fn kind(&self) -> StoreKind {
        if self.arena.is_some() {
            StoreKind::Arena
        } else {
            StoreKind::Mmap
        }
    }

    /// Bytes of every routed expert.
    pub fn bytes(&self) -> u64 {
        self.layers
            .iter()
            .flatten()
            .map(|l| l.gate.n_bytes + l.up.n_bytes + l.down.n_bytes)
            .sum()
    }

    /// The arena's host memory, for a backend to page-lock; `None` for `mmap`.
    pub fn arena(&self) -> Option<&[u8]> {
        self.arena.as_ref().map(|(a, _)| &a[..])
    }

    /// Frees the arena: the experts are read in place again (`mmap`).
    pub fn drop_arena(&mut self) {
        self.arena = None;
    }

    /// Copies every expert of `gguf` into an arena, calling `progress(bytes copied, bytes in all)` after each
    /// tensor. `available` is the host memory the arena may take (bytes; `None`: not known, try anyway).
    ///
    /// Errors: [`ArenaError::TooBig`] when the experts exceed `available`, [`ArenaError::Alloc`] when the
    /// allocation fails; the store is then unchanged (still `mmap`).
    pub fn make_arena(
        &mut self,
        gguf: &GgufModel,
        available: Option<u64>,
        mut progress: impl FnMut(u64, u64),
    ) -> Result<(), ArenaError> {
        if self.arena.is_some() {
            return Ok(());
        }
        let need = self.bytes();
        if let Some(available) = available
            && need > available
        {
            return Err(ArenaError::TooBig { need, available });
        }
        let mut arena = Vec::new();
        arena.try_reserve_exact(need as usize).map_err(|e| ArenaError::Alloc {
            need,
            why: e.to_string(),
        })?;
        let mut starts = Vec::with_capacity(self.layers.len());
        let mut filled = 0usize;
        {
            // Every core copies (one thread reading the page cache into fresh pages runs near 1 GiB/s).
            let spare = &mut arena.spare_capacity_mut()[..need as usize];
            for l in &self.layers {
                let mut at = [0usize; 3];
                if let Some(l) = l {
                    for (i, t) in [&l.gate, &l.up, &l.down].into_iter().enumerate() {
                        let src = gguf.tensor_data(t);
                        at[i] = filled;
                        let dst = &mut spare[filled..filled + src.len()];
                        dst.par_chunks_mut(COPY_CHUNK)
                            .zip(src.par_chunks(COPY_CHUNK))
                            .for_each(|(d, s)| {
                                // SAFETY: `d` and `s` have the same length, and a fresh allocation does not
                                // overlap the mapped file.
                                unsafe {
                                    std::ptr::copy_nonoverlapping(s.as_ptr(), d.as_mut_ptr().cast::<u8>(), s.len())
                                }
                            });
                        filled += src.len();
                        progress(filled as u64, need);
                    }
                }
                starts.push(at);
            }
        }
        assert_eq!(filled as u64, need, "the arena holds every expert tensor");
        // SAFETY: bytes 0..need were all written above.
        unsafe { arena.set_len(need as usize) };
        self.arena = Some((arena, starts));
        Ok(())
    }

    /// Layer `il`'s stacked gate, up and down tensors (their whole bytes), from the arena or the mapped file;
    /// `None` for a layer without experts.
    ///
    /// Panics if `il` is outside the model or `gguf` is not the model the store was made from.
    pub fn layer<'a>(&'a self, il: usize, gguf: &'a GgufModel) -> Option<[&'a [u8]; 3]> {
        let l = self.layers[il].as_ref()?;
        let ts = [&l.gate, &l.up, &l.down];
        Some(match &self.arena {
            Some((arena, starts)) => {
                let at = starts[il];
                [0, 1, 2].map(|i| &arena[at[i]..at[i] + ts[i].n_bytes as usize])
            }
            None => ts.map(|t| gguf.tensor_data(t)),
        })
    }

    /// One expert's rows: the `id.expert`-th of `n_expert` equal parts of each of its layer's tensors.
    ///
    /// Panics if the layer has no experts or the expert is outside the model.
    pub fn expert<'a>(&'a self, id: ExpertId, gguf: &'a GgufModel) -> ExpertBytes<'a> {
        let e = id.expert as usize;
        assert!(e < self.n_expert, "expert {e} of {}", self.n_expert);
        let [g, u, d] = self.layer(id.layer as usize, gguf).expect("a layer with experts");
        let part = |t: &'a [u8]| {
            let n = t.len() / self.n_expert;
            &t[e * n..(e + 1) * n]
        };
        ExpertBytes {
            gate: part(g),
            up: part(u),
            down: part(d),
        }
    }
}

/// The host memory available to a new allocation, in bytes (Linux `MemAvailable`), or `None` where it cannot
/// be read.
pub fn host_available_bytes() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib.saturating_mul(1024))
}
