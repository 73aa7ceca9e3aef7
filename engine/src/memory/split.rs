//! The layer split of a pipeline over several devices (`--device cuda:0,cuda:1`, `--layer-split`): which
//! contiguous run of transformer blocks each device computes. The first device also holds the token embeddings,
//! the last the output norm and head; the hidden state crosses once per boundary per step (llama.cpp's
//! `--split-mode layer`, the original Strata's pipeline split).

use std::fmt;
use std::ops::Range;
use std::str::FromStr;

use super::{ExpertGeometry, MemoryPlan, PlanConfig, WeightBytes, limit_of, prefill_bytes};
use crate::gguf::GgufModel;
use crate::model::HParams;
use crate::state::kv::KvError;

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
                "--layer-split takes `auto` or one positive layer count per device of a split (two or more), comma-separated (24,24), not `{s}`"
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

/// A stage as messages name it: `cuda:1 (layers 24-47)`.
pub fn stage_label(device: &dyn fmt::Display, layers: &Range<usize>) -> String {
    format!("{device} (layers {}-{})", layers.start, layers.end.saturating_sub(1))
}

impl LayerSplit {
    /// How the layers were placed, as the split's start line says it: `auto, by what each card may hold` or
    /// `--layer-split 20,28`.
    pub fn how(&self) -> String {
        match self {
            LayerSplit::Auto => "auto, by what each card may hold".to_string(),
            s => format!("--layer-split {s}"),
        }
    }

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
                if c.contains(&0) {
                    return Err(format!(
                        "--layer-split {self}: every device computes at least one layer"
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

/// One stage of a placed split: its card, its layers, and its share of the card.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stage {
    /// The CUDA device ordinal.
    pub ord: usize,
    /// The transformer blocks it computes.
    pub layers: Range<usize>,
    /// Its fraction of its card's free memory, `--vram-budget` and `--vram-reserve-mib`: `(its layers, the layers
    /// of every stage on the card)`; `(n, n)` for a card of its own.
    pub share: (u64, u64),
}

/// `x * num / den`, rounded down, without overflow.
pub fn scaled(x: u64, (num, den): (u64, u64)) -> u64 {
    (x as u128 * num as u128 / den.max(1) as u128) as u64
}

/// Places the stages of a split over the cards `ords` (one stage each, in order; a card may appear more than once)
/// by `split` (`auto`: by what each stage may hold).
///
/// `card_free[i]` is the free memory of stage `i`'s card in bytes, read before any stage allocated. A stage's
/// room for its layers is its part of its card (an equal part while the layers are not yet placed): the card's
/// limit under `--vram-budget`, less its part of the reserve, the tensors only it holds (the embeddings on the
/// first stage, the output norm and head on the last) and its prefill buffers: the whole memory plan but the
/// parts that grow with its layers (dense weights, experts, KV cache), which [`LayerSplit::ranges`] then
/// divides in proportion.
///
/// Errors: as [`LayerSplit::ranges`]; one `card_free` per card is required.
pub fn place(
    gguf: &GgufModel,
    hp: &HParams,
    ords: &[usize],
    card_free: &[u64],
    config: &PlanConfig,
    split: &LayerSplit,
) -> Result<Vec<Stage>, String> {
    assert_eq!(ords.len(), card_free.len(), "one free-memory reading per stage");
    let n_layer = hp.n_layer as usize;
    let tied = tied_head(gguf.tensors().iter().map(|t| t.name.as_str()));
    let on_card = |o: usize| ords.iter().filter(|&&x| x == o).count() as u64;
    // A stage's prefill buffers hold its largest dense matrix dequantized: a block's, or one only it holds.
    let largest_block = WeightBytes::of_matching(gguf, |name| tensor_layer(name).is_some()).largest_elements;
    let room: Vec<u64> = (0..ords.len())
        .map(|i| {
            let part = (1, on_card(ords[i]));
            let reserve = scaled(config.reserve, part);
            let limit = limit_of(
                scaled(card_free[i], part),
                config.budget.map(|b| scaled(b, part)),
                reserve,
            );
            let (first, last) = (i == 0, i + 1 == ords.len());
            let fixed = WeightBytes::of_matching(gguf, |name| {
                tensor_layer(name).is_none()
                    && ((first && name.starts_with("token_embd"))
                        || (last && stage_holds(name, &(n_layer..n_layer), n_layer, tied)))
            });
            let prefill = prefill_bytes(hp, largest_block.max(fixed.largest_elements), config.prefill_chunk);
            limit
                .saturating_sub(reserve)
                .saturating_sub(fixed.total())
                .saturating_sub(prefill)
        })
        .collect();
    let ranges = split.ranges(n_layer, &room)?;
    Ok(ranges
        .iter()
        .zip(card_shares(ords, &ranges))
        .enumerate()
        .map(|(i, (r, share))| Stage {
            ord: ords[i],
            layers: r.clone(),
            share,
        })
        .collect())
}

/// Each stage's [`Stage::share`]: stages on one card (`ords`, the card of each) share its memory in proportion to
/// their layers (`ranges`).
fn card_shares(ords: &[usize], ranges: &[Range<usize>]) -> Vec<(u64, u64)> {
    let len = |i: usize| ranges[i].len() as u64;
    (0..ords.len())
        .map(|i| {
            let all: u64 = (0..ords.len()).filter(|&j| ords[j] == ords[i]).map(len).sum();
            (len(i), all)
        })
        .collect()
}

/// The memory plan of the part of a model that computes `layers` (all of them on one card; a stage's own of a
/// split) with `share` of a card whose free memory is `free` bytes: its blocks' tensors (and the embeddings or
/// the head at the ends), its layers' experts and KV cache, its prefill buffers, against its share of the free
/// memory, `--vram-budget` and the reserve (stages on one card together keep the reserve once).
///
/// Errors: as [`MemoryPlan::new`].
pub fn stage_plan(
    gguf: &GgufModel,
    hp: &HParams,
    layers: &Range<usize>,
    share: (u64, u64),
    free: u64,
    config: &PlanConfig,
) -> Result<MemoryPlan, KvError> {
    let mut config = *config;
    config.budget = config.budget.map(|b| scaled(b, share));
    config.reserve = scaled(config.reserve, share);
    let mut stage_hp = hp.clone();
    stage_hp.n_layer = layers.len() as u32;
    let (weights, geometry) = stage_parts(gguf, hp, layers);
    MemoryPlan::new(&weights, &stage_hp, geometry.as_ref(), &config, scaled(free, share))
}

/// What the part of a model computing `layers` holds, as [`stage_plan`] plans it: its tensors' bytes (its
/// blocks', and the embeddings or the head at the ends) and its routed experts' geometry (the model's slot size,
/// since a slot holds any expert; the stage's layers).
pub fn stage_parts(gguf: &GgufModel, hp: &HParams, layers: &Range<usize>) -> (WeightBytes, Option<ExpertGeometry>) {
    let n_layer = hp.n_layer as usize;
    let tied = tied_head(gguf.tensors().iter().map(|t| t.name.as_str()));
    let weights = WeightBytes::of_matching(gguf, |name| stage_holds(name, layers, n_layer, tied));
    let geometry = ExpertGeometry::of(gguf, hp).map(|g| ExpertGeometry {
        moe_layers: moe_layers_in(gguf, layers),
        ..g
    });
    (weights, geometry)
}

/// The layers in `layers` with routed experts (`blk.N.ffn_*_exps` tensors).
fn moe_layers_in(gguf: &GgufModel, layers: &Range<usize>) -> usize {
    let moe: std::collections::BTreeSet<usize> = gguf
        .tensors()
        .iter()
        .filter(|t| super::is_routed_expert(&t.name))
        .filter_map(|t| tensor_layer(&t.name))
        .filter(|il| layers.contains(il))
        .collect();
    moe.len()
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
        let e = LayerSplit::Counts(vec![0, 48]).ranges(48, &[1, 1]).unwrap_err();
        assert!(e.contains("at least one layer"), "{e}");
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
    fn stages_on_one_card_share_it_by_their_layers() {
        // Two stages on cuda:0, 40 and 8 layers: 40/48 and 8/48 of its free memory and of its budget.
        let s = card_shares(&[0, 0], &[0..40, 40..48]);
        assert_eq!(s, vec![(40, 48), (8, 48)]);
        // One stage a card: each has its card to itself.
        assert_eq!(card_shares(&[0, 1], &[0..20, 20..48]), vec![(20, 20), (28, 28)]);
        // cuda:0, cuda:1, cuda:0: the two on cuda:0 share it, the one on cuda:1 does not.
        let s = card_shares(&[0, 1, 0], &[0..10, 10..30, 30..48]);
        assert_eq!(s, vec![(10, 28), (20, 20), (18, 28)]);
        assert_eq!(scaled(u64::MAX, (1, 2)), u64::MAX / 2);
        assert_eq!(scaled(48 << 30, (40, 48)), 40 << 30);
    }

    /// A synthetic MoE of `n_layer` layers written to a temporary file and opened.
    fn moe(n_layer: u32) -> (tempfile::TempDir, GgufModel, HParams) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m.gguf");
        let spec = crate::fixtures::synth::SynthSpec {
            n_layer,
            ..crate::fixtures::synth::SynthSpec::tiny_qwen3moe()
        };
        spec.write(&path).unwrap();
        let gguf = GgufModel::open(&path).unwrap();
        let hp = HParams::from_metadata(gguf.metadata()).unwrap();
        (dir, gguf, hp)
    }

    /// Every expert resident, so what fits depends on the layers alone.
    fn config(reserve: u64, prefill_chunk: usize) -> PlanConfig {
        PlanConfig {
            context: 256,
            kv: crate::state::kv::KvType::F16,
            sequences: 1,
            kv_tokens: None,
            prefill_chunk,
            reserve,
            cache: super::super::CacheSize::Slots(usize::MAX),
            budget: None,
            table_steps: true,
        }
    }

    #[test]
    fn the_stages_plans_add_up_to_the_whole_and_share_one_reserve() {
        let (_dir, gguf, hp) = moe(8);
        let cfg = config(1 << 20, 64);
        let free = 1u64 << 40;
        let whole = stage_plan(&gguf, &hp, &(0..8), (1, 1), free, &cfg).unwrap();
        let stages = place(
            &gguf,
            &hp,
            &[0, 0],
            &[free, free],
            &cfg,
            &LayerSplit::Counts(vec![3, 5]),
        )
        .unwrap();
        assert_eq!(
            stages,
            vec![
                Stage {
                    ord: 0,
                    layers: 0..3,
                    share: (3, 8)
                },
                Stage {
                    ord: 0,
                    layers: 3..8,
                    share: (5, 8)
                },
            ]
        );
        let plans: Vec<MemoryPlan> = stages
            .iter()
            .map(|s| stage_plan(&gguf, &hp, &s.layers, s.share, free, &cfg).unwrap())
            .collect();
        use super::super::Part;
        // Every tensor, expert and KV layer is on exactly one stage.
        for part in [Part::DenseWeights, Part::Experts, Part::KvCache] {
            let sum: u64 = plans.iter().map(|p| p.bytes(part)).sum();
            assert_eq!(sum, whole.bytes(part), "{part:?}");
        }
        // Two stages on one card keep its reserve once between them (3/8 and 5/8 of it), and see their shares of
        // its free memory.
        let reserve: u64 = plans.iter().map(|p| p.bytes(Part::Reserve)).sum();
        assert!(reserve.abs_diff(whole.bytes(Part::Reserve)) <= 1, "{reserve}");
        assert_eq!(plans[0].free, free / 8 * 3);
        // Each has prefill buffers of its own.
        assert!(plans.iter().all(|p| p.bytes(Part::PrefillBuffers) > 0));
    }

    #[test]
    fn auto_places_the_layers_so_each_stage_fits_when_the_cards_can_hold_them() {
        let (_dir, gguf, hp) = moe(12);
        // Prefill buffers of several layers' size: a placement that left them out would overfill the small card.
        let cfg = config(1 << 20, 2048);
        use super::super::Part;
        let whole = stage_plan(&gguf, &hp, &(0..12), (1, 1), u64::MAX, &cfg).unwrap();
        let layer = (whole.bytes(Part::DenseWeights) + whole.bytes(Part::Experts) + whole.bytes(Part::KvCache)) / 12;
        assert!(whole.bytes(Part::PrefillBuffers) > 4 * layer);
        // Two cards, each with what 4 | 8 layers need and half a layer more: no other split fits, and a placement
        // that counted only the weights would give the small card more than 4.
        let need = |r: Range<usize>| {
            let n = r.len() as u64;
            stage_plan(&gguf, &hp, &r, (n, n), u64::MAX, &cfg).unwrap().total() + layer / 2
        };
        let free = [need(0..4), need(4..12)];
        let stages = place(&gguf, &hp, &[0, 1], &free, &cfg, &LayerSplit::Auto).unwrap();
        assert_eq!(stages[0].layers, 0..4, "{stages:?}");
        for (s, f) in stages.iter().zip(free) {
            let plan = stage_plan(&gguf, &hp, &s.layers, s.share, f, &cfg).unwrap();
            assert_eq!(plan.verdict(), super::super::Verdict::Fits, "{s:?}\n{}", plan.to_text());
        }
        // Divided in proportion to the free memory alone (the prefill buffers and the ends' tensors counted as
        // layers), the small card would have taken more.
        let naive = LayerSplit::Auto.ranges(12, &free).unwrap();
        assert!(naive[0].len() > 4, "{naive:?}");
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
