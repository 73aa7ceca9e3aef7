//! A step's best logits, selected where they were computed ([`crate::backend::Backend::top_logits`]): what a
//! decode step returns to the host's sampler instead of the whole vocabulary.

/// How many candidates [`TopLogits`] holds: the largest `top_k` a step's device-side selection serves.
pub const TOP_LOGITS: usize = 64;

/// The best [`TOP_LOGITS`] logits of one step, selected where the logits were computed (a GPU backend does it on
/// the device, so a decode step returns 64 candidates instead of the whole vocabulary). With the penalties off,
/// these decide the sampler chain's token whenever it keeps at most `top_k <= TOP_LOGITS` tokens or is greedy
/// (`runtime::sampling::Sampler::try_sample_top` gives exactly `Sampler::try_sample`'s token).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TopLogits {
    /// (id, logit), best first: the logit descending in IEEE total order (+inf first, -inf last; -0 counts as
    /// and comes back as +0), then the lowest id (the chain's own order, `by_logit_desc`); NaN logits are left
    /// out. At most [`TOP_LOGITS`] entries.
    pub entries: Vec<(u32, f32)>,
    /// How many of the step's logits are finite (the top-k filter applies only when `top_k` is below it).
    pub n_finite: usize,
}

impl TopLogits {
    /// The sort key of logit `v` of token `id`: larger is better, in the order of [`TopLogits::entries`]; a NaN
    /// has the smallest keys. The GPU kernels (kernels/sampling.cu) compute the same keys.
    pub fn key(v: f32, id: u32) -> u64 {
        let b = (v + 0.0).to_bits(); // -0 as +0
        let o = if v.is_nan() {
            0
        } else if b & 0x8000_0000 != 0 {
            !b
        } else {
            b | 0x8000_0000
        };
        (o as u64) << 32 | (u32::MAX - id) as u64
    }

    /// The entry a key stands for; `None` for a NaN logit's key (or padding).
    pub fn from_key(key: u64) -> Option<(u32, f32)> {
        let o = (key >> 32) as u32;
        if o == 0 {
            return None;
        }
        let bits = if o & 0x8000_0000 != 0 { o & 0x7FFF_FFFF } else { !o };
        Some((u32::MAX - key as u32, f32::from_bits(bits)))
    }

    /// The reference selection on the host, from one step's logits.
    pub fn from_logits(logits: &[f32]) -> TopLogits {
        let mut keys: Vec<u64> = logits
            .iter()
            .enumerate()
            .map(|(i, &v)| TopLogits::key(v, i as u32))
            .collect();
        let k = TOP_LOGITS.min(keys.len());
        if k > 0 && k < keys.len() {
            keys.select_nth_unstable_by(k - 1, |a, b| b.cmp(a));
        }
        keys.truncate(k);
        keys.sort_unstable_by(|a, b| b.cmp(a));
        TopLogits {
            entries: keys.into_iter().filter_map(TopLogits::from_key).collect(),
            n_finite: logits.iter().filter(|v| v.is_finite()).count(),
        }
    }

    /// The greedy token: the largest logit that is not NaN, the lowest id among equal ones (-0 equals +0, which
    /// the keys already make one value, so it is the first entry); `None` when every logit is NaN.
    pub fn argmax(&self) -> Option<u32> {
        self.entries.first().map(|e| e.0)
    }
}
