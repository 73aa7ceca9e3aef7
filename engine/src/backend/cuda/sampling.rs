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
        if !selects(n) {
            return false;
        }
        let nb = n.div_ceil(TOP_SORT);
        assert!(
            n <= logits.capacity(),
            "top_logits: {n} logits in {}",
            logits.capacity()
        );
        let g = &*self.gpu;
        let mut s = self.lock();
        Self::check((|| {
            let cand = s.slot(g, Slot::TopCand, candidate_bytes(nb))?;
            let out = s.slot(g, Slot::TopOut, (TOP_LOGITS + 1) * 8)?;
            launch_top(g, logits.ptr(), n, cand, out)
        })());
        true
    }

    /// [`Backend::read_top_logits`] (the trait's method calls this).
    pub(super) fn read_top_logits_dev(&self, n: usize, out: &mut crate::backend::top::TopLogits) -> bool {
        use crate::backend::top::TOP_LOGITS;
        if !selects(n) {
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
        fill_top(out, &keys);
        true
    }

    /// [`Backend::top_logits_rows`]: [`Self::top_logits_dev`]'s two launches per row, into slots of their own.
    pub(super) fn top_logits_rows_dev(&self, logits: &DevVec, rows: usize, n: usize) -> bool {
        use crate::backend::top::TOP_LOGITS;
        if !selects(n) || rows == 0 {
            return false;
        }
        let nb = n.div_ceil(TOP_SORT);
        assert!(
            rows * n <= logits.capacity(),
            "top_logits_rows: {rows} x {n} logits in {}",
            logits.capacity()
        );
        let g = &*self.gpu;
        let mut s = self.lock();
        // Each row's candidates (u64) start 16-byte aligned: the finite counts (u32) after them may end anywhere.
        let per_cand = candidate_bytes(nb).next_multiple_of(16);
        let per_out = (TOP_LOGITS + 1) * 8;
        Self::check((|| {
            let cand0 = s.slot(g, Slot::TopCandRows, rows * per_cand)?;
            let out0 = s.slot(g, Slot::TopOutRows, rows * per_out)?;
            (0..rows).try_for_each(|r| {
                launch_top(
                    g,
                    logits.ptr() + (r * n * 4) as u64,
                    n,
                    cand0 + (r * per_cand) as u64,
                    out0 + (r * per_out) as u64,
                )
            })
        })());
        true
    }

    /// [`Backend::read_top_logits_rows`]: every row's selection in one copy.
    pub(super) fn read_top_logits_rows_dev(&self, n: usize, out: &mut [crate::backend::top::TopLogits]) -> bool {
        use crate::backend::top::TOP_LOGITS;
        if !selects(n) || out.is_empty() {
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
            fill_top(o, k);
        }
        true
    }
}

/// Whether the device selects from `n` logits: at least one, and at most [`TOP_SORT`] blocks' candidates for
/// `top_logits_final` to sort.
fn selects(n: usize) -> bool {
    n > 0 && n.div_ceil(TOP_SORT) * crate::backend::top::TOP_LOGITS <= TOP_SORT
}

/// Bytes of `top_logits_part`'s output for `nb` blocks: `nb * TOP_LOGITS` candidate keys, then the blocks' finite
/// counts.
fn candidate_bytes(nb: usize) -> usize {
    nb * crate::backend::top::TOP_LOGITS * 8 + nb * 4
}

/// The two launches selecting the best [`crate::backend::top::TOP_LOGITS`] of the `n` f32 logits at `logits`:
/// `top_logits_part` writes each 4,096-logit block's candidates and finite count at `cand`
/// ([`candidate_bytes`]), `top_logits_final` the selection's keys and the finite count at `out`.
fn launch_top(g: &super::Gpu, logits: u64, n: usize, cand: u64, out: u64) -> Result<(), super::CudaError> {
    use crate::backend::top::TOP_LOGITS;
    let nb = n.div_ceil(TOP_SORT);
    let nfin = cand + (nb * TOP_LOGITS * 8) as u64;
    g.launch(
        "top_logits_part",
        (nb as u32, 1, 1),
        (1024, 1, 1),
        &[
            Arg::P(logits),
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
}

/// One row's selection from its `TOP_LOGITS + 1` keys as `top_logits_final` wrote them.
fn fill_top(out: &mut crate::backend::top::TopLogits, keys: &[u64]) {
    use crate::backend::top::{TOP_LOGITS, TopLogits};
    out.entries.clear();
    out.entries
        .extend(keys[..TOP_LOGITS].iter().filter_map(|&k| TopLogits::from_key(k)));
    out.n_finite = keys[TOP_LOGITS] as usize;
}
