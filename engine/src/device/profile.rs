//! Device profiles: what a `sim:PROFILE` device reports and does, read from `scenarios/devices/PROFILE.yaml`
//! (DESIGN.md section 3, "Device profiles"). The Rust types below are the schema: `scenarios/devices/
//! profile.schema.json` is generated from them ([`json_schema`]) and checked in.
//!
//! A profile describes one card as a bug report saw it: its name, architecture and wave size, the architectures
//! "this build was compiled for", its memory (total, free at start, what the driver keeps free, and whether it is a
//! UMA device whose registered host memory is charged against its free memory), the host's memory, the link and
//! what its probe reads, the vendor BLAS's limits, the other devices the driver lists, faults it always has, and a
//! `scale` that shrinks every size by one factor so a 64 GiB card runs on a 2-core machine with a small model.
//!
//! Sizes are written as `24 GiB`, `2560 MiB`, `63.6 GB` (binary and decimal units as `--vram-budget` takes them) or a
//! byte count.

use std::borrow::Cow;
use std::path::{Path, PathBuf};

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::memory::cache::parse_size;

/// A size in bytes, written as a number of bytes or a string with a unit (`24 GiB`, `2560 MiB`, `63.6 GB`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
#[serde(transparent)]
pub struct Size(pub u64);

impl<'de> Deserialize<'de> for Size {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Size, D::Error> {
        struct V;
        impl serde::de::Visitor<'_> for V {
            type Value = u64;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a byte count or a size such as `24 GiB`")
            }
            fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<u64, E> {
                Ok(v)
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<u64, E> {
                parse_size("a size", v).map_err(E::custom)
            }
        }
        let b = d.deserialize_any(V)?;
        if b > MAX_SIZE {
            return Err(serde::de::Error::custom(format!(
                "{b} bytes is more than any card or host has (at most 1 PiB)"
            )));
        }
        Ok(Size(b))
    }
}

impl JsonSchema for Size {
    fn schema_name() -> Cow<'static, str> {
        "Size".into()
    }
    fn json_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
        schemars::json_schema!({
            "description": "A size: a byte count, or a number and a unit (B, KiB, MiB, GiB, TiB; KB, MB, GB, TB), such as `24 GiB`.",
            "anyOf": [
                {"type": "integer", "minimum": 0},
                {"type": "string", "pattern": "^\\s*[0-9]+(\\.[0-9]+)?\\s*([KMGT]i?B?|B)?\\s*$"}
            ]
        })
    }
}

/// The API whose names a profile's errors carry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum Api {
    Hip,
    Cuda,
}

impl Api {
    /// The driver's name for an allocation that found no memory.
    pub fn out_of_memory(self) -> &'static str {
        match self {
            Api::Hip => "hipErrorOutOfMemory",
            Api::Cuda => "cudaErrorMemoryAllocation",
        }
    }

    /// The allocation call, as a log names it.
    pub fn malloc(self) -> &'static str {
        match self {
            Api::Hip => "hipMalloc",
            Api::Cuda => "cudaMalloc",
        }
    }

    /// The driver's words for a kernel that failed and poisoned the device (seed 003).
    pub fn launch_failure(self) -> &'static str {
        match self {
            Api::Hip => "hipErrorLaunchFailure: unspecified launch failure",
            Api::Cuda => "cudaErrorLaunchFailure: unspecified launch failure",
        }
    }

    /// The host-registration call.
    pub fn host_register(self) -> &'static str {
        match self {
            Api::Hip => "hipHostRegister",
            Api::Cuda => "cudaHostRegister",
        }
    }
}

/// A simulated card, as `scenarios/devices/NAME.yaml` describes it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct DeviceProfile {
    /// The card's name as its driver reports it (`AMD Radeon RX 7900 XTX`).
    pub name: String,
    /// What the profile reproduces and where its numbers come from.
    #[serde(default)]
    pub description: String,
    /// The API whose error names the device reports: hip or cuda.
    pub api: Api,
    /// Architecture name (`gfx1100`, `sm_90`).
    pub arch: String,
    /// Threads per wave (32 or 64; NVIDIA's warp is 32).
    pub wave: u32,
    /// Compute units / streaming multiprocessors.
    pub multiprocessors: u32,
    /// The architectures the report's build was compiled for; a device whose arch is not among them cannot run.
    pub compiled_for: Vec<String>,
    pub memory: MemorySpec,
    pub host: HostSpec,
    pub link: LinkSpec,
    #[serde(default)]
    pub blas: BlasSpec,
    /// Other devices the driver lists before or after this one (an iGPU listed as device 0, say). They are shown
    /// by `strata device --list-devices`; the simulated device is this profile's.
    #[serde(default)]
    pub other_devices: Vec<OtherDevice>,
    /// This device's index in the driver's list (the other devices take the other indices, in order).
    #[serde(default)]
    pub index: usize,
    /// `STRATA_FAULT` rules the device always has (DESIGN.md section 1), added to the environment's.
    #[serde(default)]
    pub faults: Option<String>,
    /// Shrinks every size of the profile (card and host memory, the driver's floor) and the engine's flags in
    /// device bytes (`--vram-reserve-mib`, `--vram-budget`) by one factor. A number, or `{experts: SIZE}`: the
    /// factor that makes the model's routed experts as large, next to the card, as the report's were.
    #[serde(default)]
    pub scale: Scale,
}

/// The card's memory.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct MemorySpec {
    /// Total device memory.
    pub total: Size,
    /// Free device memory at start, before the engine allocates anything.
    pub free: Size,
    /// Memory the driver refuses to give out: an allocation that would leave less free fails (Windows' WDDM keeps
    /// some free on a card; default 0).
    #[serde(default)]
    pub driver_keeps_free: Size,
    /// A UMA device (an APU whose "VRAM" is a carve-out of system memory): host memory registered with the
    /// device is charged against the device's free memory, both the reading and what an allocation may take.
    #[serde(default)]
    pub uma: bool,
}

/// The host's memory.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct HostSpec {
    /// Total host memory the OS sees.
    pub total: Size,
    /// Available host memory at start (Linux `MemAvailable`, Windows' available physical memory).
    pub available: Size,
    /// Whether large pages can back a host arena (Windows refuses them without the "Lock pages in memory"
    /// privilege: `VirtualAlloc` error 1314). Default true.
    #[serde(default = "yes")]
    pub large_pages: bool,
}

fn yes() -> bool {
    true
}

/// The host-to-device link.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct LinkSpec {
    /// PCIe generation (1 to 6); with `pcie_width` it gives the link's physical peak.
    pub pcie_gen: u32,
    /// PCIe lanes (1 to 16).
    pub pcie_width: u32,
    /// The link's physical peak, GB/s, when it is not a PCIe link (an APU reads host memory over its memory
    /// fabric). Absent: the PCIe generation and width give it.
    #[serde(default)]
    pub peak_gb_s: Option<f64>,
    /// What the link probe reads, GB/s (10^9 bytes per second), one reading per round in order, repeated when
    /// the probe asks for more. Empty: 80% of the physical peak.
    #[serde(default)]
    pub probe_gb_s: Vec<f64>,
}

impl LinkSpec {
    /// The link in words: `PCIe Gen4 x16`, or `memory fabric` when `peak_gb_s` gives the peak.
    pub fn what(&self) -> String {
        match self.peak_gb_s {
            Some(_) => "memory fabric".into(),
            None => format!("PCIe Gen{} x{}", self.pcie_gen, self.pcie_width),
        }
    }

    /// The link's physical peak host to device, bytes per second: the lane rate after line coding times the lanes
    /// (PCI-SIG: 2.5, 5, 8, 16, 32, 64 GT/s per lane for generations 1 to 6; 8b/10b coding to Gen2, 128b/130b
    /// after; Gen6's FLIT coding counted as 242/256).
    pub fn peak_bytes_s(&self) -> f64 {
        if let Some(p) = self.peak_gb_s {
            return p * 1e9;
        }
        let (gt_s, coding) = match self.pcie_gen {
            1 => (2.5, 0.8),
            2 => (5.0, 0.8),
            3 => (8.0, 128.0 / 130.0),
            4 => (16.0, 128.0 / 130.0),
            5 => (32.0, 128.0 / 130.0),
            _ => (64.0, 242.0 / 256.0),
        };
        gt_s * 1e9 * coding / 8.0 * self.pcie_width as f64
    }
}

/// The vendor BLAS.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct BlasSpec {
    /// The prefill GEMM fails for batches of more than this many rows (seed 000: rocBLAS had no kernel for
    /// gfx1100, status 6 past 64 rows). Absent: it never fails.
    #[serde(default)]
    pub gemm_fails_above_rows: Option<u32>,
    /// The error the failing GEMM reports, as the report's log shows it.
    #[serde(default)]
    pub error: Option<String>,
}

/// Another device the driver lists.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct OtherDevice {
    pub name: String,
    pub arch: String,
    pub memory: Size,
    pub wave: u32,
}

/// A profile's `scale`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(untagged)]
pub enum Scale {
    /// Every size times this factor (0 < factor ≤ 1).
    Factor(f64),
    /// The factor that makes the model's routed experts as large as `experts` were on the reported card.
    Experts { experts: Size },
}

impl Default for Scale {
    fn default() -> Scale {
        Scale::Factor(1.0)
    }
}

impl Scale {
    /// The factor for a model with `model_experts` bytes of routed experts (`None`: not known, or a dense model;
    /// an `experts` scale is then 1).
    pub fn factor(self, model_experts: Option<u64>) -> f64 {
        match self {
            Scale::Factor(f) => f,
            Scale::Experts { experts } => match model_experts {
                Some(m) if m > 0 && experts.0 > 0 => (m as f64 / experts.0 as f64).min(1.0),
                _ => 1.0,
            },
        }
    }
}

/// A profile that cannot be used, naming the file and what is wrong.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProfileError {
    #[error("sim:{name}: no profile {name}.yaml in {searched} (built in: {builtin})")]
    NotFound {
        name: String,
        searched: String,
        builtin: String,
    },
    #[error("{file}{}: {message}", if *line > 0 { format!(":{line}:{column}") } else { String::new() })]
    Invalid {
        file: String,
        line: usize,
        column: usize,
        message: String,
    },
}

/// The largest profile file read, bytes.
pub const MAX_PROFILE_BYTES: u64 = 1 << 20;

/// The deepest nesting of YAML flow collections (`[...]`, `{...}`) a profile may have.
const MAX_FLOW_DEPTH: usize = 16;

/// The largest size a profile may give (1 PiB): anything larger is a typo, and sums of such sizes would
/// overflow.
pub const MAX_SIZE: u64 = 1 << 50;

/// The profiles that ship inside the binary, so `sim:NAME` works from any folder: (name, YAML).
pub const BUILTIN: &[(&str, &str)] = &[
    (
        "gfx1100-rx7900xtx",
        include_str!("../../../scenarios/devices/gfx1100-rx7900xtx.yaml"),
    ),
    (
        "gfx1151-strix-halo",
        include_str!("../../../scenarios/devices/gfx1151-strix-halo.yaml"),
    ),
    ("h200", include_str!("../../../scenarios/devices/h200.yaml")),
];

/// The folders a profile `NAME.yaml` is looked for in, first match wins: `$STRATA_DEVICE_PROFILES`, then
/// `scenarios/devices` under the current folder. A name found in neither is looked up among [`BUILTIN`].
pub fn search_dirs() -> Vec<PathBuf> {
    let mut dirs = Vec::new();
    if let Some(d) = crate::switches::path(crate::switches::DEVICE_PROFILES) {
        dirs.push(d);
    }
    dirs.push(PathBuf::from("scenarios/devices"));
    dirs
}

impl DeviceProfile {
    /// Finds and reads profile `name` ([`search_dirs`], then [`BUILTIN`]).
    ///
    /// Errors: [`ProfileError::NotFound`]; [`ProfileError::Invalid`] for a file that does not parse or validate.
    pub fn find(name: &str) -> Result<DeviceProfile, ProfileError> {
        let dirs = search_dirs();
        for d in &dirs {
            let p = d.join(format!("{name}.yaml"));
            if p.is_file() {
                return DeviceProfile::load(&p);
            }
            if p.exists() {
                // A folder or a device node by the profile's name is a mistake to name, not a reason to fall back
                // to the built-in profile silently.
                return Err(ProfileError::Invalid {
                    file: p.display().to_string(),
                    line: 0,
                    column: 0,
                    message: "not a regular file".into(),
                });
            }
        }
        if let Some((_, text)) = BUILTIN.iter().find(|(n, _)| *n == name) {
            return DeviceProfile::parse(&format!("(built in) scenarios/devices/{name}.yaml"), text);
        }
        Err(ProfileError::NotFound {
            name: name.into(),
            searched: dirs
                .iter()
                .map(|d| d.display().to_string())
                .collect::<Vec<_>>()
                .join(", "),
            builtin: BUILTIN.iter().map(|(n, _)| *n).collect::<Vec<_>>().join(", "),
        })
    }

    /// Reads a profile file.
    ///
    /// Errors: [`ProfileError::Invalid`] for an unreadable file or one that does not parse or validate.
    pub fn load(path: &Path) -> Result<DeviceProfile, ProfileError> {
        let bad = |message: String| ProfileError::Invalid {
            file: path.display().to_string(),
            line: 0,
            column: 0,
            message,
        };
        let len = std::fs::metadata(path)
            .map_err(|e| bad(format!("cannot read the profile: {e}")))?
            .len();
        if len > MAX_PROFILE_BYTES {
            return Err(bad(format!(
                "{len} bytes; a profile is a page of YAML (at most {MAX_PROFILE_BYTES} bytes)"
            )));
        }
        // The length read above may be stale (a growing file, a device node): read at most one byte past it.
        let mut text = String::new();
        std::io::Read::read_to_string(
            &mut std::io::Read::take(
                std::fs::File::open(path).map_err(|e| bad(format!("cannot read the profile: {e}")))?,
                MAX_PROFILE_BYTES + 1,
            ),
            &mut text,
        )
        .map_err(|e| bad(format!("cannot read the profile: {e}")))?;
        if text.len() as u64 > MAX_PROFILE_BYTES {
            return Err(bad(format!(
                "more than {MAX_PROFILE_BYTES} bytes; a profile is a page of YAML"
            )));
        }
        DeviceProfile::parse(&path.display().to_string(), &text)
    }

    /// Parses and validates profile text; `file` names it in errors (with the line and column of a YAML or field
    /// error).
    ///
    /// Errors: [`ProfileError::Invalid`].
    pub fn parse(file: &str, text: &str) -> Result<DeviceProfile, ProfileError> {
        // Flow collections nested deeper than any profile needs make the YAML parser's time grow fast: refuse
        // them before parsing.
        let mut depth = 0usize;
        for c in text.chars() {
            match c {
                '[' | '{' => depth += 1,
                ']' | '}' => depth = depth.saturating_sub(1),
                _ => {}
            }
            if depth > MAX_FLOW_DEPTH {
                return Err(ProfileError::Invalid {
                    file: file.into(),
                    line: 0,
                    column: 0,
                    message: format!("brackets nested more than {MAX_FLOW_DEPTH} deep: not a device profile"),
                });
            }
        }
        let de = yaml_serde::Deserializer::from_str(text);
        let p: DeviceProfile = serde_path_to_error::deserialize(de).map_err(|e| {
            let path = e.path().to_string();
            let inner = e.into_inner();
            let (line, column) = inner.location().map_or((0, 0), |l| (l.line(), l.column()));
            let raw = inner.to_string();
            let msg = raw.split(" at line ").next().unwrap_or(&raw).to_string();
            ProfileError::Invalid {
                file: file.into(),
                line,
                column,
                message: if msg.starts_with(&path) || path == "." {
                    msg
                } else {
                    format!("{path}: {msg}")
                },
            }
        })?;
        p.validate().map_err(|message| ProfileError::Invalid {
            file: file.into(),
            line: 0,
            column: 0,
            message,
        })?;
        Ok(p)
    }

    /// Checks what the types cannot: sizes that agree with each other and numbers in range.
    ///
    /// Errors: one line naming the field.
    pub fn validate(&self) -> Result<(), String> {
        let m = &self.memory;
        if m.total.0 == 0 {
            return Err("memory.total: a card needs some memory".into());
        }
        if m.free.0 > m.total.0 {
            return Err(format!(
                "memory.free ({} B) is more than memory.total ({} B)",
                m.free.0, m.total.0
            ));
        }
        if m.driver_keeps_free.0 > m.free.0 {
            return Err("memory.driver_keeps_free is more than memory.free".into());
        }
        if self.host.available.0 > self.host.total.0 {
            return Err("host.available is more than host.total".into());
        }
        if !matches!(self.wave, 32 | 64) {
            return Err(format!("wave: {} threads; waves are 32 or 64", self.wave));
        }
        if !(1..=6).contains(&self.link.pcie_gen) || !(1..=16).contains(&self.link.pcie_width) {
            return Err(format!(
                "link: PCIe gen {} x{}; the generation is 1 to 6 and the width 1 to 16 lanes",
                self.link.pcie_gen, self.link.pcie_width
            ));
        }
        // Readings may be impossible (seed 000's were terabytes per second: the probe's check is what flags them),
        // but they are rates a probe can print: between a kilobyte and a petabyte per second.
        if let Some(r) = self
            .link
            .probe_gb_s
            .iter()
            .find(|r| !(r.is_finite() && (1e-6..=1e6).contains(*r)))
        {
            return Err(format!(
                "link.probe_gb_s: {r} is not a reading (a rate in GB/s, from 0.000001 to 1000000)"
            ));
        }
        if let Some(r) = self
            .link
            .peak_gb_s
            .filter(|r| !(r.is_finite() && (0.001..=10_000.0).contains(r)))
        {
            return Err(format!(
                "link.peak_gb_s: {r} is not a link's peak (a rate in GB/s, from 0.001 to 10000)"
            ));
        }
        if self.index > self.other_devices.len() {
            return Err(format!(
                "index {}: the driver lists {} device(s) with this one",
                self.index,
                self.other_devices.len() + 1
            ));
        }
        match self.scale {
            Scale::Factor(f) if !(1e-9..=1.0).contains(&f) => {
                return Err(format!("scale: {f}; a factor is from 1e-9 to 1"));
            }
            Scale::Experts { experts } if experts.0 == 0 => return Err("scale.experts: 0 bytes".into()),
            _ => {}
        }
        if let Some(f) = &self.faults {
            crate::device::fault::FaultPlan::parse(f).map_err(|e| format!("faults: {e}"))?;
        }
        if self.blas.gemm_fails_above_rows == Some(0) {
            return Err("blas.gemm_fails_above_rows: 0; a decode step (1 row) never fails, so give 1 or more".into());
        }
        Ok(())
    }

    /// Whether the build the report describes can run on this device's arch.
    pub fn compiled_for_arch(&self, arch: &str) -> bool {
        self.compiled_for.iter().any(|a| a == arch)
    }
}

/// The JSON Schema of device profiles, generated from [`DeviceProfile`] (checked in as
/// `scenarios/devices/profile.schema.json`).
pub fn json_schema() -> String {
    let schema = schemars::schema_for!(DeviceProfile);
    serde_json::to_string_pretty(&schema).expect("schemas serialize") + "\n"
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_builtin_profile_parses_and_matches_its_file() {
        for (name, text) in BUILTIN {
            let p = DeviceProfile::parse(name, text).unwrap_or_else(|e| panic!("{e}"));
            assert!(!p.name.is_empty() && !p.compiled_for.is_empty(), "{name}");
            let on_disk = std::fs::read_to_string(format!(
                "{}/../scenarios/devices/{name}.yaml",
                env!("CARGO_MANIFEST_DIR")
            ))
            .unwrap();
            assert_eq!(&on_disk, text, "{name}");
        }
    }

    #[test]
    fn the_checked_in_schema_is_the_types() {
        let path = format!(
            "{}/../scenarios/devices/profile.schema.json",
            env!("CARGO_MANIFEST_DIR")
        );
        let on_disk = std::fs::read_to_string(&path).unwrap_or_default();
        if on_disk != json_schema() {
            if std::env::var_os("STRATA_UPDATE_SCHEMA").is_some() {
                std::fs::write(&path, json_schema()).unwrap();
            } else {
                panic!("{path} is stale: rerun with STRATA_UPDATE_SCHEMA=1");
            }
        }
    }

    const MIN: &str = "name: X\napi: hip\narch: gfx1100\nwave: 32\nmultiprocessors: 4\ncompiled_for: [gfx1100]\n\
        memory: {total: 24 GiB, free: 23 GiB}\nhost: {total: 64 GiB, available: 40 GiB}\nlink: {pcie_gen: 4, pcie_width: 16}\n";

    #[test]
    fn sizes_units_and_defaults() {
        let p = DeviceProfile::parse("x.yaml", MIN).unwrap();
        assert_eq!(p.memory.total, Size(24 << 30));
        assert_eq!(p.memory.driver_keeps_free, Size(0));
        assert!(!p.memory.uma && p.host.large_pages);
        assert_eq!(p.scale.factor(Some(5)), 1.0);
        // PCIe Gen4 x16: 16 GT/s x 128/130 / 8 x 16 lanes = 31.5 GB/s.
        assert!(
            (p.link.peak_bytes_s() - 31.507_692e9).abs() < 1e3,
            "{}",
            p.link.peak_bytes_s()
        );
        let s = Scale::Experts { experts: Size(1000) };
        assert_eq!(s.factor(Some(10)), 0.01);
        assert_eq!(s.factor(None), 1.0);
    }

    #[test]
    fn mistakes_name_the_field_and_line() {
        let cases = [
            (MIN.replace("wave: 32", "wave: 48"), "wave: 48"),
            (MIN.replace("free: 23 GiB", "free: 25 GiB"), "memory.free"),
            (MIN.replace("free: 23 GiB", "free: 23 parsecs"), "memory.free"),
            (MIN.replace("api: hip", "api: metal"), "api"),
            (MIN.replace("pcie_gen: 4", "pcie_gen: 9"), "PCIe gen 9"),
            (MIN.to_string() + "scale: 2\n", "scale: 2"),
            (MIN.to_string() + "faults: bogus\n", "faults:"),
            (MIN.to_string() + "colour: red\n", "colour"),
            (
                MIN.to_string() + "blas: {gemm_fails_above_rows: 0}\n",
                "gemm_fails_above_rows",
            ),
            (MIN.to_string() + "index: 2\n", "index 2"),
            (
                MIN.replace("free: 23 GiB", "free: -5"),
                "a byte count or a size such as `24 GiB`",
            ),
            (
                MIN.replace("free: 23 GiB", "free: 18446744073709551615"),
                "at most 1 PiB",
            ),
            (
                MIN.to_string() + "other_devices: " + &"[".repeat(40) + "\n",
                "nested more than 16 deep",
            ),
        ];
        for (text, want) in cases {
            let e = DeviceProfile::parse("bad.yaml", &text).unwrap_err().to_string();
            assert!(e.starts_with("bad.yaml:") && e.contains(want), "{want}: {e}");
        }
        let e = DeviceProfile::parse("bad.yaml", &MIN.replace("api: hip", "api: metal")).unwrap_err();
        assert!(matches!(e, ProfileError::Invalid { line: 2, .. }), "{e:?}");
    }

    #[test]
    fn unknown_names_list_the_builtin_ones() {
        let e = DeviceProfile::find("no-such-card").unwrap_err().to_string();
        assert!(
            e.contains("sim:no-such-card") && e.contains("gfx1151-strix-halo"),
            "{e}"
        );
    }
}
