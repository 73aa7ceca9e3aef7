//! The layer split of a pipeline over several devices (`--device cuda:0,cuda:1`, `--layer-split`): which
//! contiguous run of transformer blocks each device computes. The first device also holds the token embeddings,
//! the last the output norm and head; the hidden state crosses once per boundary per step (llama.cpp's
//! `--split-mode layer`, the original Strata's pipeline split).

use std::fmt;
use std::ops::Range;
use std::str::FromStr;

/// `--layer-split`: how the layers are spread over the devices of a split.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum LayerSplit {
    /// In proportion to what each device may hold once its fixed parts are placed ([`LayerSplit::ranges`]).
    #[default]
    Auto,
    /// Layers per device, in device order (`24,24`): they must add up to the model's layer count.
    Counts(Vec<usize>),
}

impl FromStr for LayerSplit {
    type Err = String;
    fn from_str(s: &str) -> Result<LayerSplit, String> {
        if s == "auto" {
            return Ok(LayerSplit::Auto);
        }
        let counts: Result<Vec<usize>, _> = s.split(',').map(|p| p.trim().parse::<usize>()).collect();
        match counts {
            Ok(c) if c.len() >= 2 && c.iter().all(|&n| n > 0) => Ok(LayerSplit::Counts(c)),
            _ => Err(format!(
                "--layer-split takes `auto` or one positive layer count per device, comma-separated (24,24), not `{s}`"
            )),
        }
    }
}

impl fmt::Display for LayerSplit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LayerSplit::Auto => f.write_str("auto"),
            LayerSplit::Counts(c) => {
                let s: Vec<String> = c.iter().map(usize::to_string).collect();
                f.write_str(&s.join(","))
            }
        }
    }
}

impl LayerSplit {
    /// The layers of each of `room.len()` devices, contiguous and in order, covering `0..n_layer`.
    ///
    /// `room[i]` is what device `i` may hold for its layers, in bytes (its free memory or budget less its
    /// reserve and its fixed parts: the embeddings on the first, the output head on the last). `Auto` gives each
    /// device layers in proportion to its room (largest remainders; at least one layer each); a device with no
    /// room counts as the smallest positive one, so the memory plan, not the split, names what does not fit.
    ///
    /// Errors: fewer layers than devices; counts that are not one per device or do not add up to `n_layer`.
    pub fn ranges(&self, n_layer: usize, room: &[u64]) -> Result<Vec<Range<usize>>, String> {
        let n = room.len();
        if n == 0 || n_layer < n {
            return Err(format!(
                "a model of {n_layer} layers cannot be split over {n} devices (each computes at least one layer)"
            ));
        }
        let counts = match self {
            LayerSplit::Counts(c) => {
                if c.len() != n {
                    return Err(format!(
                        "--layer-split {self}: {} counts for {n} devices (one per device)",
                        c.len()
                    ));
                }
                // Checked: counts near usize::MAX must not wrap around to the model's layer count.
                let sum = c.iter().try_fold(0usize, |a, &x| a.checked_add(x));
                if sum != Some(n_layer) {
                    let sum = sum.map_or("more than usize::MAX".to_string(), |s| s.to_string());
                    return Err(format!(
                        "--layer-split {self}: the counts add up to {sum}, and the model has {n_layer} layers"
                    ));
                }
                c.clone()
            }
            LayerSplit::Auto => auto_counts(n_layer, room),
        };
        let mut at = 0;
        Ok(counts
            .iter()
            .map(|&c| {
                let r = at..at + c;
                at += c;
                r
            })
            .collect())
    }
}

/// `n_layer` layers in proportion to `room`, at least one each (largest remainders).
fn auto_counts(n_layer: usize, room: &[u64]) -> Vec<usize> {
    let n = room.len();
    let floor = room.iter().copied().filter(|&r| r > 0).min().unwrap_or(1);
    let w: Vec<f64> = room.iter().map(|&r| r.max(floor) as f64).collect();
    let total: f64 = w.iter().sum();
    let exact: Vec<f64> = w.iter().map(|x| n_layer as f64 * x / total).collect();
    let mut counts: Vec<usize> = exact.iter().map(|e| (e.floor() as usize).max(1)).collect();
    // Over: a device raised to its one layer takes it from the one with the most.
    while counts.iter().sum::<usize>() > n_layer {
        let i = (0..n).max_by_key(|&i| counts[i]).expect("devices");
        counts[i] -= 1;
    }
    // Under: the largest remainders first; ties to the later device (the first also holds the embeddings).
    let mut order: Vec<usize> = (0..n).collect();
    order.sort_by(|&a, &b| {
        let (ra, rb) = (exact[a] - counts[a] as f64, exact[b] - counts[b] as f64);
        rb.total_cmp(&ra).then(b.cmp(&a))
    });
    let mut left = n_layer - counts.iter().sum::<usize>();
    for &i in order.iter().cycle() {
        if left == 0 {
            break;
        }
        counts[i] += 1;
        left -= 1;
    }
    counts
}

/// Which layers a tensor belongs to: `Some(il)` for `blk.IL.…`, `None` for the embeddings, the output norm and
/// head, and other tensors outside the blocks (llama.cpp's tensor names).
pub fn tensor_layer(name: &str) -> Option<usize> {
    name.strip_prefix("blk.")?.split('.').next()?.parse().ok()
}

/// Whether the stage computing `layers` of a model of `n_layer` layers holds the tensor `name`: its blocks'
/// tensors, the token embeddings on the first stage, the output norm and head on the last (`tied`: a model without
/// `output.weight` reads its head from the embeddings, so the last stage holds them too).
pub fn stage_holds(name: &str, layers: &Range<usize>, n_layer: usize, tied: bool) -> bool {
    let last = layers.end == n_layer;
    match tensor_layer(name) {
        Some(il) => layers.contains(&il),
        None if name.starts_with("token_embd") => layers.start == 0 || (tied && last),
        None => last,
    }
}

/// Whether `tensors` (names) tie the output head to the token embeddings (no `output.weight`).
pub fn tied_head<'a>(mut tensors: impl Iterator<Item = &'a str>) -> bool {
    !tensors.any(|n| n == "output.weight")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_prints_back() {
        assert_eq!("auto".parse::<LayerSplit>(), Ok(LayerSplit::Auto));
        assert_eq!("24,24".parse::<LayerSplit>(), Ok(LayerSplit::Counts(vec![24, 24])));
        assert_eq!(LayerSplit::Counts(vec![10, 20, 18]).to_string(), "10,20,18");
        for bad in ["", "24", "24,0", "a,b", "24,-1", "auto,1", "1,,2"] {
            let e = bad.parse::<LayerSplit>().unwrap_err();
            assert!(e.contains("--layer-split") && e.contains(&format!("`{bad}`")), "{e}");
        }
    }

    #[test]
    fn counts_must_be_one_per_device_and_add_up() {
        let c = LayerSplit::Counts(vec![20, 28]);
        assert_eq!(c.ranges(48, &[1, 1]).unwrap(), vec![0..20, 20..48]);
        let e = c.ranges(47, &[1, 1]).unwrap_err();
        assert!(e.contains("add up to 48") && e.contains("47 layers"), "{e}");
        let e = LayerSplit::Counts(vec![usize::MAX, 31])
            .ranges(30, &[1, 1])
            .unwrap_err();
        assert!(e.contains("more than usize::MAX") && e.contains("30 layers"), "{e}");
        let e = c.ranges(48, &[1, 1, 1]).unwrap_err();
        assert!(e.contains("2 counts for 3 devices"), "{e}");
        let e = LayerSplit::Auto.ranges(1, &[1, 1]).unwrap_err();
        assert!(e.contains("1 layers cannot be split over 2"), "{e}");
    }

    #[test]
    fn auto_follows_the_room_and_covers_every_layer() {
        let a = LayerSplit::Auto;
        assert_eq!(a.ranges(48, &[100, 100]).unwrap(), vec![0..24, 24..48]);
        // 3:1 room: 36 and 12 layers.
        assert_eq!(a.ranges(48, &[300, 100]).unwrap(), vec![0..36, 36..48]);
        // An odd count: the remainder goes to the later device.
        assert_eq!(a.ranges(5, &[7, 7]).unwrap(), vec![0..2, 2..5]);
        // No room on one device: it still computes a layer, and the plan names what does not fit.
        assert_eq!(a.ranges(4, &[0, 100]).unwrap(), vec![0..2, 2..4]);
        assert_eq!(a.ranges(40, &[1, 1_000_000]).unwrap(), vec![0..1, 1..40]);
        for (n, room) in [
            (48usize, vec![5u64, 9, 2]),
            (3, vec![1, 1, 1]),
            (97, vec![13, 0, 8, 21]),
        ] {
            let r = a.ranges(n, &room).unwrap();
            assert_eq!(r.len(), room.len());
            assert_eq!((r[0].start, r[r.len() - 1].end), (0, n));
            assert!(
                r.windows(2).all(|w| w[0].end == w[1].start && !w[0].is_empty()),
                "{r:?}"
            );
        }
    }

    #[test]
    fn stages_hold_their_blocks_and_the_ends_their_tensors() {
        assert_eq!(tensor_layer("blk.17.ffn_up_exps.weight"), Some(17));
        assert_eq!(tensor_layer("output.weight"), None);
        let (first, last) = (0..24, 24..48);
        let holds = |n, r, tied| stage_holds(n, r, 48, tied);
        assert!(holds("blk.3.attn_q.weight", &first, false) && !holds("blk.3.attn_q.weight", &last, false));
        assert!(holds("token_embd.weight", &first, false) && !holds("token_embd.weight", &last, false));
        // A tied head reads the embeddings on the last stage.
        assert!(holds("token_embd.weight", &last, true));
        assert!(holds("output_norm.weight", &last, false) && !holds("output.weight", &first, false));
        assert!(tied_head(["token_embd.weight", "blk.0.attn_q.weight"].into_iter()));
        assert!(!tied_head(["token_embd.weight", "output.weight"].into_iter()));
    }
}
