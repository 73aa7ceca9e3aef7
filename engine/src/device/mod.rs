//! Devices: where an engine computes (`cpu`, `cuda:N`, `sim:PROFILE`), whether this machine has one, the CUDA
//! libraries they need ([`cuda_libs`]), and the fault plan every backend obeys ([`fault`]).
//!
//! DESIGN.md section 3 ("Device profiles"): a `sim:` device runs its arithmetic on the CPU and takes its memory,
//! library and fault behaviour from a YAML profile under `scenarios/devices/`. Profiles are not implemented yet:
//! a `sim:` device parses, displays and is refused by [`Device::available`] with that message.

pub mod cuda_libs;
pub mod fault;

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
    #[error("{device}: simulated device profiles (scenarios/devices/{profile}.yaml) are not implemented yet")]
    SimUnsupported { device: String, profile: String },
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
    /// devices; `sim:` devices are refused until device profiles exist.
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
            Device::Sim(p) => Err(DeviceError::SimUnsupported {
                device: self.to_string(),
                profile: p.clone(),
            }),
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
    fn cpu_is_available_and_sim_is_refused_by_name() {
        assert_eq!(Device::Cpu.available(), Ok(()));
        let e = Device::Sim("gfx1151-strix-halo".into())
            .available()
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("sim:gfx1151-strix-halo") && e.contains("scenarios/devices/gfx1151-strix-halo.yaml"),
            "{e}"
        );
    }
}
