//! Top-logits selection on the device (kernels/sampling.cu): the sampler's candidates come back as a few keys, not
//! the whole vocabulary.

use super::launch::Arg;
use super::{CudaBackend, DevVec, Slot};

/// Logits a block of `top_logits_part` sorts (kernels/sampling.cu `TOP_SORT`): a vocabulary of up to
/// `TOP_SORT * TOP_SORT / TOP_LOGITS` (262,144) tokens is selected on the device.
const TOP_SORT: usize = 4096;

impl CudaBackend {
    /// [`Backend::top_logits`] (the trait's method calls this).
    pub(super) fn top_logits_dev(&self, logits: &DevVec, n: usize) -> bool {
        use crate::backend::top::TOP_LOGITS;
        let nb = n.div_ceil(TOP_SORT);
        if n == 0 || nb * TOP_LOGITS > TOP_SORT {
            return false;
        }
        assert!(
            n <= logits.capacity(),
            "top_logits: {n} logits in {}",
            logits.capacity()
        );
        let g = &*self.gpu;
        let mut s = self.lock();
        Self::check((|| {
            // Candidates (nb * TOP_LOGITS keys), then the blocks' finite counts.
            let cand = s.slot(g, Slot::TopCand, nb * TOP_LOGITS * 8 + nb * 4)?;
            let nfin = cand + (nb * TOP_LOGITS * 8) as u64;
            let out = s.slot(g, Slot::TopOut, (TOP_LOGITS + 1) * 8)?;
            g.launch(
                "top_logits_part",
                (nb as u32, 1, 1),
                (1024, 1, 1),
                &[
                    Arg::P(logits.ptr()),
                    Arg::I(n as i32),
                    Arg::I(TOP_SORT as i32),
                    Arg::P(cand),
                    Arg::P(nfin),
                ],
            )?;
            g.launch(
                "top_logits_final",
                (1, 1, 1),
                (1024, 1, 1),
                &[
                    Arg::P(cand),
                    Arg::I((nb * TOP_LOGITS) as i32),
                    Arg::P(nfin),
                    Arg::I(nb as i32),
                    Arg::P(out),
                ],
            )
        })());
        true
    }

    /// [`Backend::read_top_logits`] (the trait's method calls this).
    pub(super) fn read_top_logits_dev(&self, n: usize, out: &mut crate::backend::top::TopLogits) -> bool {
        use crate::backend::top::{TOP_LOGITS, TopLogits};
        if n == 0 || n.div_ceil(TOP_SORT) * TOP_LOGITS > TOP_SORT {
            return false;
        }
        Self::check(self.gpu.poisoned("device-to-host copy"));
        Self::check(self.gpu.flush_step());
        let mut keys = [0u64; TOP_LOGITS + 1];
        let s = self.lock();
        let buf = s.slots[Slot::TopOut as usize]
            .as_ref()
            .expect("read_top_logits after top_logits");
        Self::check(buf.read_at(&self.gpu.stream, 0, bytemuck::cast_slice_mut(&mut keys)));
        out.entries.clear();
        out.entries
            .extend(keys[..TOP_LOGITS].iter().filter_map(|&k| TopLogits::from_key(k)));
        out.n_finite = keys[TOP_LOGITS] as usize;
        true
    }

    /// [`Backend::top_logits_rows`]: [`Self::top_logits_dev`]'s two launches per row, into slots of their own.
    pub(super) fn top_logits_rows_dev(&self, logits: &DevVec, rows: usize, n: usize) -> bool {
        use crate::backend::top::TOP_LOGITS;
        let nb = n.div_ceil(TOP_SORT);
        if n == 0 || rows == 0 || nb * TOP_LOGITS > TOP_SORT {
            return false;
        }
        assert!(
            rows * n <= logits.capacity(),
            "top_logits_rows: {rows} x {n} logits in {}",
            logits.capacity()
        );
        let g = &*self.gpu;
        let mut s = self.lock();
        // Each row's candidates (u64) start 16-byte aligned: the finite counts (u32) after them may end anywhere.
        let per_cand = (nb * TOP_LOGITS * 8 + nb * 4).next_multiple_of(16);
        let per_out = (TOP_LOGITS + 1) * 8;
        Self::check((|| {
            let cand0 = s.slot(g, Slot::TopCandRows, rows * per_cand)?;
            let out0 = s.slot(g, Slot::TopOutRows, rows * per_out)?;
            for r in 0..rows {
                let cand = cand0 + (r * per_cand) as u64;
                let nfin = cand + (nb * TOP_LOGITS * 8) as u64;
                let out = out0 + (r * per_out) as u64;
                g.launch(
                    "top_logits_part",
                    (nb as u32, 1, 1),
                    (1024, 1, 1),
                    &[
                        Arg::P(logits.ptr() + (r * n * 4) as u64),
                        Arg::I(n as i32),
                        Arg::I(TOP_SORT as i32),
                        Arg::P(cand),
                        Arg::P(nfin),
                    ],
                )?;
                g.launch(
                    "top_logits_final",
                    (1, 1, 1),
                    (1024, 1, 1),
                    &[
                        Arg::P(cand),
                        Arg::I((nb * TOP_LOGITS) as i32),
                        Arg::P(nfin),
                        Arg::I(nb as i32),
                        Arg::P(out),
                    ],
                )?;
            }
            Ok(())
        })());
        true
    }

    /// [`Backend::read_top_logits_rows`]: every row's selection in one copy.
    pub(super) fn read_top_logits_rows_dev(&self, n: usize, out: &mut [crate::backend::top::TopLogits]) -> bool {
        use crate::backend::top::{TOP_LOGITS, TopLogits};
        if n == 0 || out.is_empty() || n.div_ceil(TOP_SORT) * TOP_LOGITS > TOP_SORT {
            return false;
        }
        Self::check(self.gpu.poisoned("device-to-host copy"));
        Self::check(self.gpu.flush_step());
        let mut keys = vec![0u64; out.len() * (TOP_LOGITS + 1)];
        let s = self.lock();
        let buf = s.slots[Slot::TopOutRows as usize]
            .as_ref()
            .expect("read_top_logits_rows after top_logits_rows");
        Self::check(buf.read_at(&self.gpu.stream, 0, bytemuck::cast_slice_mut(&mut keys)));
        for (o, k) in out.iter_mut().zip(keys.chunks_exact(TOP_LOGITS + 1)) {
            o.entries.clear();
            o.entries
                .extend(k[..TOP_LOGITS].iter().filter_map(|&k| TopLogits::from_key(k)));
            o.n_finite = k[TOP_LOGITS] as usize;
        }
        true
    }
}
