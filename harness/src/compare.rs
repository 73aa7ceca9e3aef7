//! `strata-harness compare OLD NEW`: per-metric ratios between two reports of the same scenario; regressions are
//! listed first. A metric is judged only with [`MIN_SAMPLES`] requests or more on each side (one request's rate on
//! a shared machine moves by a fifth from run to run), and a regression needs both a drop past the noise
//! threshold (the repetitions' spread, at least [`MIN_NOISE`]) and ranges that do not overlap: identical runs
//! compare clean.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use crate::report::{Report, Stat};

/// Smallest noise threshold, as a fraction (5 %).
pub const MIN_NOISE: f64 = 0.05;

/// Requests a metric needs on each side to be judged (`repetitions:`).
pub const MIN_SAMPLES: usize = 3;

/// One metric of one row in both reports.
#[derive(Debug, Clone, PartialEq)]
pub struct Delta {
    /// `arm / case / tokens / metric`.
    pub key: String,
    pub old: f64,
    pub new: f64,
    /// new / old.
    pub ratio: f64,
    /// The noise threshold for this metric, as a fraction.
    pub threshold: f64,
    /// The old and new values' ranges (min, max) and counts.
    pub old_range: (f64, f64),
    pub new_range: (f64, f64),
    pub samples: (usize, usize),
}

impl Delta {
    /// Whether both sides have [`MIN_SAMPLES`] values or more.
    pub fn judged(&self) -> bool {
        self.samples.0 >= MIN_SAMPLES && self.samples.1 >= MIN_SAMPLES
    }
    /// A judged slowdown beyond the threshold whose values all lie below the old ones (every metric compared is
    /// a rate: higher is better).
    pub fn is_regression(&self) -> bool {
        self.judged() && self.ratio < 1.0 - self.threshold && self.new_range.1 < self.old_range.0
    }
    /// A judged speed-up beyond the threshold whose values all lie above the old ones.
    pub fn is_improvement(&self) -> bool {
        self.judged() && self.ratio > 1.0 + self.threshold && self.new_range.0 > self.old_range.1
    }
}

fn rows(r: &Report) -> BTreeMap<String, Stat> {
    let mut m = BTreeMap::new();
    for a in &r.arms {
        for row in &a.rows {
            let tok = row.tokens_requested.map_or(String::new(), |n| format!(" / {n} tokens"));
            for (metric, st) in [("prefill tok/s", row.prefill_tok_s), ("decode tok/s", row.decode_tok_s)] {
                if let Some(st) = st {
                    m.insert(format!("{} / {}{tok} / {metric}", a.name, row.case), st);
                }
            }
        }
    }
    m
}

/// The metrics both reports have, regressions first (worst first), then the rest by key.
pub fn compare(old: &Report, new: &Report) -> Vec<Delta> {
    let (o, n) = (rows(old), rows(new));
    let mut out: Vec<Delta> = o
        .iter()
        .filter_map(|(k, a)| {
            let b = n.get(k)?;
            (a.median > 0.0).then(|| Delta {
                key: k.clone(),
                old: a.median,
                new: b.median,
                ratio: b.median / a.median,
                threshold: a.spread().max(b.spread()).max(MIN_NOISE),
                old_range: (a.min, a.max),
                new_range: (b.min, b.max),
                samples: (a.n, b.n),
            })
        })
        .collect();
    out.sort_by(|x, y| {
        y.is_regression()
            .cmp(&x.is_regression())
            .then(if x.is_regression() {
                x.ratio.total_cmp(&y.ratio)
            } else {
                std::cmp::Ordering::Equal
            })
            .then(x.key.cmp(&y.key))
    });
    out
}

/// The comparison as a Markdown table, with a one-line summary first.
pub fn render(old: &Report, new: &Report, deltas: &[Delta]) -> String {
    let regressions = deltas.iter().filter(|d| d.is_regression()).count();
    let unjudged = deltas.iter().filter(|d| !d.judged()).count();
    let mut s = String::new();
    let _ = writeln!(
        s,
        "{}: {} regression(s) beyond the noise threshold among {} metrics judged{} ({} `{}` -> {} `{}`)\n",
        new.scenario,
        regressions,
        deltas.len() - unjudged,
        if unjudged > 0 {
            format!(
                "; {unjudged} with fewer than {MIN_SAMPLES} requests a side, too few to judge (give their cases `repetitions: {MIN_SAMPLES}`)"
            )
        } else {
            String::new()
        },
        old.started_utc,
        &old.environment.git_rev[..old.environment.git_rev.len().min(10)],
        new.started_utc,
        &new.environment.git_rev[..new.environment.git_rev.len().min(10)],
    );
    let _ = writeln!(
        s,
        "| metric | old | new | new/old | noise | |\n|---|---:|---:|---:|---:|---|"
    );
    for d in deltas {
        let tag = if !d.judged() {
            format!("too few samples ({} and {})", d.samples.0, d.samples.1)
        } else if d.is_regression() {
            "**REGRESSION**".into()
        } else if d.is_improvement() {
            "faster".into()
        } else {
            "within noise".into()
        };
        let _ = writeln!(
            s,
            "| {} | {:.1} | {:.1} | {:.3} | ±{:.1} % | {tag} |",
            d.key,
            d.old,
            d.new,
            d.ratio,
            d.threshold * 100.0
        );
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::{ArmReport, CaseRow};

    fn report(prefill: [f64; 3]) -> Report {
        Report {
            arms: vec![ArmReport {
                name: "a".into(),
                rows: vec![CaseRow {
                    case: "c".into(),
                    tokens_requested: Some(64),
                    prefill_tok_s: Stat::of(&prefill),
                    ..CaseRow::default()
                }],
                ..ArmReport::default()
            }],
            ..Report::empty("t")
        }
    }

    #[test]
    fn regression_beyond_spread_is_flagged() {
        let old = report([100.0, 98.0, 102.0]);
        let deltas = compare(&old, &report([80.0, 79.0, 81.0]));
        assert_eq!(deltas.len(), 1);
        assert!(deltas[0].is_regression(), "{deltas:?}");
        assert!((deltas[0].ratio - 0.8).abs() < 1e-9);
        // A wide spread hides a 10 % drop.
        let noisy = report([100.0, 70.0, 130.0]);
        assert!(!compare(&noisy, &report([90.0, 89.0, 91.0]))[0].is_regression());
        assert!(render(&old, &old, &compare(&old, &old)).contains("0 regression(s)"));
        // Overlapping ranges are noise, however far the medians moved.
        assert!(!compare(&old, &report([80.0, 79.0, 99.0]))[0].is_regression());
    }

    /// Single requests are not judged (issue 19, point 13: identical --quick runs must compare clean): a 23 %
    /// drop of one request is reported as too few samples, not a regression.
    #[test]
    fn single_requests_are_too_few_to_judge() {
        let one = |v: f64| {
            let mut r = report([v, v, v]);
            r.arms[0].rows[0].prefill_tok_s = Stat::of(&[v]);
            r
        };
        let (a, b) = (one(100.0), one(77.0));
        let d = compare(&a, &b);
        assert!(!d[0].judged() && !d[0].is_regression(), "{d:?}");
        let text = render(&a, &b, &d);
        assert!(
            text.contains("0 regression(s)") && text.contains("1 with fewer than 3 requests"),
            "{text}"
        );
        assert!(text.contains("too few samples (1 and 1)"), "{text}");
    }
}
