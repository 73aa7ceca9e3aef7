//! The link probe's check (DESIGN.md section 1, seed 000): a host-to-device probe reading is a copy's bytes over
//! its time, and a reading above the link's physical peak is a bug of the probe (seed 000's RX 7900 XTX read
//! 5.6 to 19.4 TB/s over a PCIe Gen4 x16 link of 31.5 GB/s), never a rate to plan with. [`check`] judges the
//! readings against the peak; the verdict is logged in one line and sent as a `probe` event, and a cost model
//! takes [`ProbeVerdict::used_bytes_s`]: the best reading when every reading is plausible, else the peak-derived
//! default.

use crate::device::profile::LinkSpec;
use crate::events::{self, EventKind, Probe};

/// The share of a link's physical peak a host-to-device copy of pinned memory reaches, used when the probe
/// cannot be trusted: about what PCIe Gen4 and Gen5 x16 links measure (25 of 31.5 GB/s, 52 of 63 GB/s).
pub const DEFAULT_LINK_FRACTION: f64 = 0.8;

/// The link's physical peak, and how it was found.
#[derive(Debug, Clone, PartialEq)]
pub struct LinkPeak {
    /// Bytes per second, host to device.
    pub bytes_s: f64,
    /// What it is (`PCIe Gen4 x16`, `memory fabric`, `PCIe Gen5 x16 (assumed: the link could not be read)`).
    pub what: String,
}

impl LinkPeak {
    /// The peak of a profile's link ([`LinkSpec::peak_bytes_s`], [`LinkSpec::what`]).
    pub fn of(link: &LinkSpec) -> LinkPeak {
        LinkPeak {
            bytes_s: link.peak_bytes_s(),
            what: link.what(),
        }
    }
}

/// The probe's verdict.
#[derive(Debug, Clone, PartialEq)]
pub struct ProbeVerdict {
    /// The readings, GB/s (10^9 bytes per second), in the order taken.
    pub readings_gb_s: Vec<f64>,
    /// The best (highest) reading, GB/s: what the original Strata took.
    pub best_gb_s: f64,
    /// Every reading is a positive rate at most the peak.
    pub plausible: bool,
    /// The rate to plan with, bytes per second: the best reading when plausible, else
    /// [`DEFAULT_LINK_FRACTION`] of the peak.
    pub used_bytes_s: f64,
}

/// Judges `readings_gb_s` (GB/s) against `peak`: one reading above the peak (or not a positive rate) makes the
/// whole probe implausible, since the same code measured them all.
pub fn check(readings_gb_s: &[f64], peak: &LinkPeak) -> ProbeVerdict {
    let best = readings_gb_s.iter().copied().fold(0.0f64, f64::max);
    let plausible = !readings_gb_s.is_empty()
        && readings_gb_s
            .iter()
            .all(|r| r.is_finite() && *r > 0.0 && r * 1e9 <= peak.bytes_s);
    ProbeVerdict {
        readings_gb_s: readings_gb_s.to_vec(),
        best_gb_s: best,
        plausible,
        used_bytes_s: if plausible {
            best * 1e9
        } else {
            peak.bytes_s * DEFAULT_LINK_FRACTION
        },
    }
}

/// Judges `readings_gb_s` against `peak` ([`check`]) and sends the verdict as `device`'s `probe` event, which the
/// log shows as one line (`strata: probe: ...`).
pub fn judge(device: &str, readings_gb_s: &[f64], peak: &LinkPeak) -> ProbeVerdict {
    let v = check(readings_gb_s, peak);
    report(device, peak, &v);
    v
}

fn report(device: &str, peak: &LinkPeak, v: &ProbeVerdict) {
    events::emit(EventKind::Probe(Probe {
        device: device.into(),
        readings_gb_s: v.readings_gb_s.clone(),
        best_gb_s: v.best_gb_s,
        peak_gb_s: peak.bytes_s / 1e9,
        link: peak.what.clone(),
        plausible: v.plausible,
        used_gb_s: v.used_bytes_s / 1e9,
    }));
}

/// The PCIe link of the device at PCI address `bus_id` (`0000:19:00.0`), read from Linux sysfs: the card's
/// maximum (`max_link_speed`, `max_link_width`), an upper bound no honest reading passes (the current link can be
/// slower while the card idles, so it would condemn honest readings), else the current link; `None` where neither
/// can be read.
pub fn pcie_link(bus_id: &str) -> Option<LinkPeak> {
    let dir = std::path::Path::new("/sys/bus/pci/devices").join(bus_id.to_ascii_lowercase());
    let read = |f: &str| std::fs::read_to_string(dir.join(f)).ok();
    let parse = |speed: String, width: String| -> Option<(f64, u32)> {
        Some((
            speed.split_whitespace().next()?.parse().ok()?,
            width.trim().parse().ok()?,
        ))
    };
    let (gt_s, width) = read("max_link_speed")
        .zip(read("max_link_width"))
        .and_then(|(s, w)| parse(s, w))
        .or_else(|| {
            read("current_link_speed")
                .zip(read("current_link_width"))
                .and_then(|(s, w)| parse(s, w))
        })?;
    let generation = match gt_s {
        x if x <= 2.5 => 1,
        x if x <= 5.0 => 2,
        x if x <= 8.0 => 3,
        x if x <= 16.0 => 4,
        x if x <= 32.0 => 5,
        _ => 6,
    };
    let mut peak = LinkPeak::of(&LinkSpec {
        pcie_gen: generation,
        pcie_width: width.clamp(1, 16),
        peak_gb_s: None,
        probe_gb_s: vec![],
    });
    peak.what += &format!(", {bus_id}");
    Some(peak)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gen4() -> LinkPeak {
        LinkPeak {
            bytes_s: 31.5e9,
            what: "PCIe Gen4 x16".into(),
        }
    }

    #[test]
    fn seed_000_readings_are_a_probe_bug() {
        let v = check(&[9038.2, 10294.7, 19416.7, 18417.5, 5598.2], &gen4());
        assert!(!v.plausible);
        assert_eq!(v.best_gb_s, 19416.7);
        assert!((v.used_bytes_s - 31.5e9 * DEFAULT_LINK_FRACTION).abs() < 1.0);
    }

    #[test]
    fn readings_under_the_peak_are_used() {
        let v = check(&[24.1, 25.3, 24.9], &gen4());
        assert!(v.plausible);
        assert_eq!(v.used_bytes_s, 25.3e9);
        // One impossible reading among good ones still condemns the probe; so do no readings at all.
        assert!(!check(&[24.1, 40.0], &gen4()).plausible);
        assert!(!check(&[], &gen4()).plausible);
        assert!(!check(&[f64::NAN], &gen4()).plausible);
    }
}
