//! Expert profiles: how many lookups each (layer, expert) had, the routing statistics a cache can be pre-filled
//! from at start (`--expert-profile`, the original Strata's `--expert-profile`) and that a GPU's expert cache
//! learns while it runs (`--save-expert-profile`).
//!
//! File format (JSON; one layer's counts per line so a diff reads):
//!
//! ```text
//! {"strata_expert_profile":1,"n_layer":48,"n_expert":128,"lookups":[
//! [12,0,3,...],
//! ...
//! ]}
//! ```
//!
//! `lookups[layer][expert]` counts the cache's lookups of that expert (a prefill chunk looks each expert it
//! needs up once; a decode step once per routing slot). A routing trace ([`super::trace`], `--dump-routing`) is
//! read as a profile too: each of its records' experts counts one lookup.

use std::io::{Read, Write};
use std::path::Path;

use serde::{Deserialize, Serialize};

use super::ExpertId;
use super::trace::{Trace, geometry_error};

/// The version this build writes and reads.
pub const PROFILE_VERSION: u32 = 1;

/// The largest profile file read, in bytes (the largest geometry a trace may declare, 2^22 experts, at 20 digits
/// a count is under 90 MB).
pub const MAX_PROFILE_BYTES: u64 = 128 << 20;

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct ProfileFile {
    strata_expert_profile: u32,
    n_layer: u32,
    n_expert: u32,
    lookups: Vec<Vec<u64>>,
}

/// Lookups per expert of a model of `n_layer` layers (the model's, MoE or not, as the slot table counts them)
/// of `n_expert` experts each.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExpertProfile {
    pub n_layer: u32,
    pub n_expert: u32,
    /// `[layer * n_expert + expert]`.
    pub lookups: Vec<u64>,
}

impl ExpertProfile {
    /// A profile with no lookups.
    pub fn new(n_layer: u32, n_expert: u32) -> ExpertProfile {
        ExpertProfile {
            n_layer,
            n_expert,
            lookups: vec![0; n_layer as usize * n_expert as usize],
        }
    }

    /// A trace's lookups counted: each record's experts one lookup each.
    pub fn of_trace(t: &Trace) -> ExpertProfile {
        let mut p = ExpertProfile::new(t.header.n_layer, t.header.n_expert);
        for i in t.lookups() {
            p.lookups[i] += 1;
        }
        p
    }

    /// Reads a profile, or a routing trace as one, from `path`.
    ///
    /// Errors: one line naming what is wrong: the file cannot be read, is larger than [`MAX_PROFILE_BYTES`], is
    /// neither a profile nor a routing trace, has another version, an impossible geometry, or rows of the wrong
    /// length (naming the row); a trace's own errors ([`Trace::read`]).
    pub fn read(path: &Path) -> Result<ExpertProfile, String> {
        if Trace::is_trace_file(path) {
            return Trace::read(path)
                .map(|t| ExpertProfile::of_trace(&t))
                .map_err(|e| e.to_string());
        }
        let mut f = std::fs::File::open(path).map_err(|e| format!("cannot read it: {e}"))?;
        let mut text = String::new();
        (&mut f)
            .take(MAX_PROFILE_BYTES + 1)
            .read_to_string(&mut text)
            .map_err(|e| format!("cannot read it: {e}"))?;
        if text.len() as u64 > MAX_PROFILE_BYTES {
            return Err(format!(
                "larger than the {} MiB a profile may be",
                MAX_PROFILE_BYTES >> 20
            ));
        }
        let file: ProfileFile = serde_json::from_str(&text).map_err(|e| {
            format!(
                "not an expert profile ({e}); expected {{\"strata_expert_profile\":1,\"n_layer\":..,\"n_expert\":..,\"lookups\":[[..],..]}} or a routing trace"
            )
        })?;
        if file.strata_expert_profile != PROFILE_VERSION {
            return Err(format!(
                "expert profile version {}, this build reads version {PROFILE_VERSION}",
                file.strata_expert_profile
            ));
        }
        if let Some(why) = geometry_error(file.n_layer, file.n_expert, 1) {
            return Err(why);
        }
        if file.lookups.len() != file.n_layer as usize {
            return Err(format!(
                "{} rows of lookups where the header says {} layers",
                file.lookups.len(),
                file.n_layer
            ));
        }
        if let Some((l, row)) = file
            .lookups
            .iter()
            .enumerate()
            .find(|(_, r)| r.len() != file.n_expert as usize)
        {
            return Err(format!(
                "layer {l} has {} counts where the header says {} experts",
                row.len(),
                file.n_expert
            ));
        }
        Ok(ExpertProfile {
            n_layer: file.n_layer,
            n_expert: file.n_expert,
            lookups: file.lookups.concat(),
        })
    }

    /// Writes the profile to `path`, replacing it whole: written beside it first and renamed over it, so a
    /// reader (or a crash) never sees half a file.
    ///
    /// Errors: the file or its temporary cannot be written or renamed.
    pub fn write(&self, path: &Path) -> std::io::Result<()> {
        crate::paths::write_atomically(path, |w| {
            write!(
                w,
                "{{\"strata_expert_profile\":{PROFILE_VERSION},\"n_layer\":{},\"n_expert\":{},\"lookups\":[",
                self.n_layer, self.n_expert
            )?;
            for (l, row) in self.lookups.chunks(self.n_expert.max(1) as usize).enumerate() {
                let sep = if l == 0 { "\n" } else { ",\n" };
                write!(w, "{sep}{}", serde_json::to_string(row).map_err(std::io::Error::other)?)?;
            }
            writeln!(w, "\n]}}")
        })
    }

    /// `None` when the profile is of a model of `n_layer` layers of `n_expert` experts; else one line saying how
    /// they differ.
    pub fn mismatch(&self, n_layer: u32, n_expert: u32) -> Option<String> {
        (self.n_layer != n_layer || self.n_expert != n_expert).then(|| {
            format!(
                "a profile of {} layers x {} experts, the model has {n_layer} x {n_expert}",
                self.n_layer, self.n_expert
            )
        })
    }

    /// Adds `lookups` (`[layer * n_expert + expert]`, this profile's geometry) to the counts.
    ///
    /// Panics if the lengths differ.
    pub fn add(&mut self, lookups: &[u64]) {
        assert_eq!(lookups.len(), self.lookups.len(), "a profile of another geometry");
        for (a, &b) in self.lookups.iter_mut().zip(lookups) {
            *a = a.saturating_add(b);
        }
    }

    /// Every expert with a lookup, most looked up first (ties: lower layer, then lower expert first).
    pub fn ranked(&self) -> Vec<ExpertId> {
        let mut used: Vec<usize> = (0..self.lookups.len()).filter(|&i| self.lookups[i] > 0).collect();
        used.sort_by(|&a, &b| self.lookups[b].cmp(&self.lookups[a]).then(a.cmp(&b)));
        used.into_iter()
            .map(|i| ExpertId {
                layer: (i / self.n_expert as usize) as u32,
                expert: (i % self.n_expert as usize) as u32,
            })
            .collect()
    }

    /// All lookups counted.
    pub fn total(&self) -> u64 {
        self.lookups.iter().fold(0u64, |a, &b| a.saturating_add(b))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tmp(name: &str) -> std::path::PathBuf {
        let d = std::env::temp_dir().join(format!("strata-profile-{}-{name}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        d.join("p.json")
    }

    #[test]
    fn a_profile_round_trips_and_ranks_most_used_first() {
        let mut p = ExpertProfile::new(2, 3);
        p.add(&[0, 5, 1, 5, 0, 9]);
        let path = tmp("rt");
        p.write(&path).unwrap();
        let back = ExpertProfile::read(&path).unwrap();
        assert_eq!(back, p);
        let id = |layer, expert| ExpertId { layer, expert };
        // 9 first; the two 5s by layer; the unused experts not at all.
        assert_eq!(back.ranked(), vec![id(1, 2), id(0, 1), id(1, 0), id(0, 2)]);
        assert_eq!(back.total(), 20);
        assert_eq!(
            std::fs::read_dir(path.parent().unwrap())
                .unwrap()
                .filter(|e| e.as_ref().unwrap().file_name().to_string_lossy().contains(".tmp"))
                .count(),
            0,
            "no temporary file is left"
        );
    }

    #[test]
    fn a_routing_trace_reads_as_its_lookup_counts() {
        let mut t = Trace::new(2, 4, 2);
        t.push(0, 0, 0, &[3, 1]);
        t.push(0, 1, 0, &[2, 0]);
        t.push(1, 0, 1, &[3, 0]);
        let path = tmp("trace");
        t.write(&path).unwrap();
        let p = ExpertProfile::read(&path).unwrap();
        assert_eq!((p.n_layer, p.n_expert), (2, 4));
        assert_eq!(p.lookups, vec![1, 1, 0, 2, 1, 0, 1, 0]);
        assert_eq!(p.mismatch(2, 4), None);
        assert!(p.mismatch(3, 4).unwrap().contains("2 layers x 4 experts"));
    }

    #[test]
    fn bad_profiles_name_what_is_wrong() {
        let path = tmp("bad");
        let cases = [
            ("", "not an expert profile"),
            (
                "{\"strata_expert_profile\":2,\"n_layer\":1,\"n_expert\":2,\"lookups\":[[1,2]]}",
                "version 2",
            ),
            (
                "{\"strata_expert_profile\":1,\"n_layer\":2,\"n_expert\":2,\"lookups\":[[1,2]]}",
                "1 rows",
            ),
            (
                "{\"strata_expert_profile\":1,\"n_layer\":2,\"n_expert\":2,\"lookups\":[[1,2],[3]]}",
                "layer 1 has 1",
            ),
            (
                "{\"strata_expert_profile\":1,\"n_layer\":0,\"n_expert\":2,\"lookups\":[]}",
                "impossible geometry",
            ),
            (
                "{\"strata_expert_profile\":1,\"n_layer\":1,\"n_expert\":1,\"lookups\":[[-1]]}",
                "not an expert profile",
            ),
            (
                "{\"strata_routing_trace\":1,\"n_layer\":1,\"n_expert\":2,\"k\":3}",
                "top-3 of 2",
            ),
        ];
        for (text, want) in cases {
            std::fs::write(&path, text).unwrap();
            let e = ExpertProfile::read(&path).unwrap_err();
            assert!(e.contains(want), "{text:?}: {e}");
        }
        let e = ExpertProfile::read(&path.with_file_name("missing.json")).unwrap_err();
        assert!(e.contains("cannot read it"), "{e}");
    }
}
