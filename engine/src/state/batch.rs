//! The batch layout of one forward step: which of the step's tokens belong to which sequence, at which positions.
//!
//! A step carries one *run* per sequence: a contiguous range of the step's tokens (a decode token, a prefill chunk,
//! or several new tokens of one sequence), at consecutive positions of that sequence, whose keys and values go to
//! that sequence's KV cache. Every op but attention treats the step's tokens as rows and ignores the layout;
//! attention reads it (`Backend::attend_runs`).

/// One sequence's tokens in a step: tokens `start..start + len` of the step, at positions `pos0..pos0 + len` of the
/// sequence whose KV cache is the step's `seq`-th.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SeqRun {
    pub seq: usize,
    pub start: usize,
    pub len: usize,
    pub pos0: usize,
}

impl SeqRun {
    /// The run's tokens, as indices into the step.
    pub fn tokens(&self) -> std::ops::Range<usize> {
        self.start..self.start + self.len
    }
}

/// The runs of one step, in token order, and every token's position.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BatchLayout {
    runs: Vec<SeqRun>,
    positions: Vec<u32>,
}

impl BatchLayout {
    /// `n` tokens of one sequence (the step's cache 0) at positions `pos0..pos0 + n`.
    pub fn one(pos0: usize, n: usize) -> BatchLayout {
        let mut b = BatchLayout::default();
        b.push(0, pos0, n);
        b
    }

    /// Empties the layout, keeping its allocations.
    pub fn clear(&mut self) {
        self.runs.clear();
        self.positions.clear();
    }

    /// Appends `len` tokens of the step's `seq`-th sequence at positions `pos0..pos0 + len`.
    ///
    /// Panics if `len` is 0 or the sequence already has a run in this step (its tokens must be one run, so the
    /// causal order inside the step is the position order).
    pub fn push(&mut self, seq: usize, pos0: usize, len: usize) {
        assert!(len > 0, "batch: an empty run");
        assert!(
            self.runs.iter().all(|r| r.seq != seq),
            "batch: sequence {seq} has two runs in one step"
        );
        self.runs.push(SeqRun {
            seq,
            start: self.positions.len(),
            len,
            pos0,
        });
        self.positions.extend((pos0..pos0 + len).map(|p| p as u32));
    }

    /// The runs, in token order.
    pub fn runs(&self) -> &[SeqRun] {
        &self.runs
    }

    /// Every token's position in its sequence, `[n_tok]`.
    pub fn positions(&self) -> &[u32] {
        &self.positions
    }

    /// Tokens in the step.
    pub fn n_tok(&self) -> usize {
        self.positions.len()
    }

    /// Whether the step carries one sequence only.
    pub fn is_single(&self) -> bool {
        self.runs.len() == 1
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_tile_the_step_in_order() {
        let mut b = BatchLayout::default();
        b.push(1, 7, 1);
        b.push(0, 0, 3);
        assert_eq!(b.positions(), [7, 0, 1, 2]);
        assert_eq!(b.runs()[1].tokens(), 1..4);
        assert_eq!(b.n_tok(), 4);
        assert!(!b.is_single());
        assert_eq!(BatchLayout::one(5, 2).positions(), [5, 6]);
    }

    #[test]
    #[should_panic(expected = "two runs in one step")]
    fn a_sequence_has_one_run_per_step() {
        let mut b = BatchLayout::default();
        b.push(0, 0, 1);
        b.push(0, 1, 1);
    }
}
