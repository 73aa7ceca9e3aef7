//! Devices: where an engine computes (`cpu`, `cuda:N`, `sim:PROFILE`), whether this machine has one, the CUDA
//! libraries they need ([`cuda_libs`]), and the fault plan every backend obeys ([`fault`]).
//!
//! DESIGN.md section 3 ("Device profiles"): a `sim:` device runs its arithmetic on the CPU and takes its memory,
//! library and fault behaviour from a YAML profile under `scenarios/devices/` ([`profile`]); [`sim`] keeps its
//! memory account.

pub mod cuda_libs;
pub mod fault;
pub mod probe;
pub mod profile;
pub mod sim;

use std::fmt;
use std::str::FromStr;

/// Where an engine computes (`--device`, a scenario's `device`).
#[derive(Debug, Clone, PartialEq, Eq, Default, Hash)]
pub enum Device {
    #[default]
    Cpu,
    /// CUDA device N (`cuda` alone is `cuda:0`).
    Cuda(usize),
    /// A simulated device described by `scenarios/devices/PROFILE.yaml`.
    Sim(String),
    /// Several CUDA devices of this machine, in pipeline order (`cuda:0,cuda:1`): the model's layers are split over
    /// them (`--layer-split`), the first holds the token embeddings and the last the output head. A device may be
    /// named twice (`cuda:0,cuda:0`: two stages on one card, each with its own stream, for testing the split where
    /// one GPU is all there is).
    Split(Vec<usize>),
}

/// Most devices a layer split takes.
pub const MAX_SPLIT_DEVICES: usize = 16;

/// Why a device cannot be used here.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DeviceError {
    #[error(
        "unknown device `{0}`; known: cpu, cuda, cuda:N, sim:PROFILE, or CUDA devices split by layers: cuda:0,cuda:1"
    )]
    Unknown(String),
    #[error("--device {device}: {why}")]
    BadSplit { device: String, why: String },
    #[error("{device}: no CUDA here ({why})")]
    NoCuda { device: String, why: String },
    #[error("{device}: this machine has {count} CUDA device(s)")]
    NoSuchCuda { device: String, count: usize },
    #[error("{device}: {source}")]
    Profile {
        device: String,
        source: profile::ProfileError,
    },
    #[error("{device}: {name} ({arch}) is not an architecture the reported build was compiled for ({compiled_for})")]
    NotCompiledFor {
        device: String,
        name: String,
        arch: String,
        compiled_for: String,
    },
}

impl FromStr for Device {
    type Err = DeviceError;
    fn from_str(s: &str) -> Result<Device, DeviceError> {
        match s {
            "cpu" => Ok(Device::Cpu),
            "cuda" => Ok(Device::Cuda(0)),
            _ if s.contains(',') => {
                // A long list is named by its start (the error line stays short).
                let shown: String = match s.char_indices().nth(80) {
                    Some((at, _)) => format!("{}…", &s[..at]),
                    None => s.into(),
                };
                let bad = |why: String| DeviceError::BadSplit {
                    device: shown.clone(),
                    why,
                };
                let n = s.split(',').count();
                if n > MAX_SPLIT_DEVICES {
                    return Err(bad(format!(
                        "{n} devices; a layer split takes at most {MAX_SPLIT_DEVICES}"
                    )));
                }
                if s.split(',').any(|p| p.trim().is_empty()) {
                    return Err(bad(
                        "an empty entry (a stray comma?); name CUDA devices: cuda:0,cuda:1".into()
                    ));
                }
                let mut ords = Vec::new();
                for part in s.split(',').map(str::trim) {
                    match part.parse::<Device>() {
                        Ok(Device::Cuda(n)) => ords.push(n),
                        _ => {
                            return Err(bad(format!(
                                "`{part}` is not a CUDA device: a layer split takes CUDA devices only (cuda:N,cuda:M)"
                            )));
                        }
                    }
                }
                Ok(Device::Split(ords))
            }
            _ => {
                if let Some(n) = s.strip_prefix("cuda:") {
                    return n.parse().map(Device::Cuda).map_err(|_| DeviceError::Unknown(s.into()));
                }
                match s.strip_prefix("sim:") {
                    Some(p) if is_profile_name(p) => Ok(Device::Sim(p.to_string())),
                    _ => Err(DeviceError::Unknown(s.into())),
                }
            }
        }
    }
}

/// A profile name is a file stem: letters, digits, `-`, `_` and `.`, not starting with a dot.
fn is_profile_name(p: &str) -> bool {
    !p.is_empty()
        && !p.starts_with('.')
        && p.chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Device::Cpu => f.write_str("cpu"),
            Device::Cuda(n) => write!(f, "cuda:{n}"),
            Device::Sim(p) => write!(f, "sim:{p}"),
            Device::Split(ords) => {
                for (i, n) in ords.iter().enumerate() {
                    write!(f, "{}cuda:{n}", if i == 0 { "" } else { "," })?;
                }
                Ok(())
            }
        }
    }
}

impl Device {
    /// Whether the device computes on CUDA: `cuda:N`, or a layer split over CUDA devices.
    pub fn is_cuda(&self) -> bool {
        matches!(self, Device::Cuda(_) | Device::Split(_))
    }

    /// Whether this machine can run the device: always for `cpu`; for `cuda:N` a driver with more than N
    /// devices; for `sim:PROFILE` a profile that reads and validates, of an arch its build was compiled for.
    ///
    /// Errors: [`DeviceError`] naming the device and why.
    pub fn available(&self) -> Result<(), DeviceError> {
        match self {
            Device::Cpu => Ok(()),
            Device::Cuda(n) => {
                let count = cuda_libs::device_count().map_err(|e| DeviceError::NoCuda {
                    device: self.to_string(),
                    why: e.to_string(),
                })?;
                if *n >= count {
                    return Err(DeviceError::NoSuchCuda {
                        device: self.to_string(),
                        count,
                    });
                }
                Ok(())
            }
            Device::Split(ords) => ords.iter().try_for_each(|&n| Device::Cuda(n).available()),
            Device::Sim(p) => {
                let prof = profile::DeviceProfile::find(p).map_err(|source| DeviceError::Profile {
                    device: self.to_string(),
                    source,
                })?;
                if !prof.compiled_for_arch(&prof.arch) {
                    return Err(DeviceError::NotCompiledFor {
                        device: self.to_string(),
                        name: prof.name,
                        arch: prof.arch,
                        compiled_for: prof.compiled_for.join(","),
                    });
                }
                Ok(())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn devices_parse_and_display_back() {
        for s in ["cpu", "cuda:0", "cuda:3", "sim:gfx1100-rx7900xtx", "sim:h200"] {
            assert_eq!(s.parse::<Device>().unwrap().to_string(), s);
        }
        assert_eq!("cuda".parse::<Device>().unwrap(), Device::Cuda(0));
        for s in ["cuda:0,cuda:1", "cuda:0,cuda:0", "cuda:1,cuda:0,cuda:2"] {
            assert_eq!(s.parse::<Device>().unwrap().to_string(), s);
        }
        assert_eq!("cuda,cuda:1".parse::<Device>().unwrap(), Device::Split(vec![0, 1]));
        assert_eq!(" cuda:0, cuda:1".parse::<Device>().unwrap(), Device::Split(vec![0, 1]));
        for bad in ["cuda:0,cpu", "sim:h200,cuda:0", "cuda:0,cuda:x"] {
            let e = bad.parse::<Device>().unwrap_err().to_string();
            assert!(e.contains(bad) && e.contains("CUDA devices only"), "{e}");
        }
        for bad in ["cuda:0,", ",cuda:1", "cuda:0,,cuda:1", "cpu,", "cuda:0, ,cuda:1"] {
            let e = bad.parse::<Device>().unwrap_err().to_string();
            assert!(e.contains(bad) && e.contains("stray comma"), "{e}");
        }
        let many = vec!["cuda:0"; MAX_SPLIT_DEVICES + 1].join(",");
        let e = many.parse::<Device>().unwrap_err().to_string();
        assert!(e.contains("17 devices; a layer split takes at most 16"), "{e}");
        let e = vec!["cuda:0"; 15_000]
            .join(",")
            .parse::<Device>()
            .unwrap_err()
            .to_string();
        assert!(e.len() < 200 && e.contains("15000 devices"), "{e}");
        for bad in [
            "gpu", "cuda:", "cuda:x", "cuda:-1", "sim:", "sim:../x", "sim:a/b", "CPU",
        ] {
            let e = bad.parse::<Device>().unwrap_err().to_string();
            assert!(e.contains(bad) && e.contains("sim:PROFILE"), "{e}");
        }
    }

    #[test]
    fn cpu_and_the_builtin_profiles_are_available_and_unknown_ones_are_named() {
        assert_eq!(Device::Cpu.available(), Ok(()));
        for p in ["gfx1151-strix-halo", "gfx1100-rx7900xtx", "h200"] {
            assert_eq!(Device::Sim(p.into()).available(), Ok(()), "{p}");
        }
        let e = Device::Sim("rx9999".into()).available().unwrap_err().to_string();
        assert!(e.contains("sim:rx9999") && e.contains("rx9999.yaml"), "{e}");
    }
}
