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
}

/// Why a device cannot be used here.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DeviceError {
    #[error("unknown device `{0}`; known: cpu, cuda, cuda:N, sim:PROFILE")]
    Unknown(String),
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
        }
    }
}

impl Device {
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
