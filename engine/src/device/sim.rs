//! A simulated device's memory (DESIGN.md section 3, "Device profiles"): a `sim:PROFILE` device computes on the
//! CPU, and its memory readings, allocations and host registrations follow its profile
//! ([`crate::device::profile`]), at the profile's scale.
//!
//! The model, one account per device: `free = free at start - allocated - registered` where `registered` counts
//! only on a UMA profile (an APU's host memory registered with the device is charged against the device's free
//! memory: seed 001's "5.41 GiB free" after a 46.84 GiB arena was registered). An allocation fails, with the
//! driver's error name, when it would leave less free than the driver keeps (`memory.driver_keeps_free`). Every
//! change is a `memory` event with the free memory after it, so a report can draw the timeline.

use std::sync::{Arc, Mutex};

use crate::device::profile::{DeviceProfile, ProfileError};
use crate::events::{self, EventKind, Memory};

/// A simulated device: its profile, the scale in force, and its memory account.
#[derive(Debug)]
pub struct SimDevice {
    /// The profile's name (`gfx1151-strix-halo`).
    pub name: String,
    pub profile: DeviceProfile,
    scale: f64,
    state: Mutex<Account>,
}

#[derive(Debug, Default)]
struct Account {
    allocated: u64,
    registered: u64,
}

/// A failed simulated allocation or registration: what was asked and the account at the time.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{call} of {what} ({bytes} B) failed: {error} ({free} B free, the driver keeps {keeps} B free)")]
pub struct SimAllocError {
    /// `hipMalloc`, `hipHostRegister`, ...
    pub call: &'static str,
    /// The part being allocated (`the expert cache`, `the decode buffers`).
    pub what: String,
    pub bytes: u64,
    /// The driver's error name (`hipErrorOutOfMemory`).
    pub error: &'static str,
    pub free: u64,
    pub keeps: u64,
}

/// A live simulated allocation; dropping it frees its bytes (a `memory` event says so).
#[derive(Debug)]
pub struct SimAlloc {
    device: Arc<SimDevice>,
    what: String,
    bytes: u64,
    registered: bool,
}

impl SimAlloc {
    /// Bytes held.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }
    /// What it holds.
    pub fn what(&self) -> &str {
        &self.what
    }
}

impl Drop for SimAlloc {
    fn drop(&mut self) {
        let free = {
            let mut a = self.device.account();
            if self.registered {
                a.registered = a.registered.saturating_sub(self.bytes);
            } else {
                a.allocated = a.allocated.saturating_sub(self.bytes);
            }
            self.device.free_of(&a)
        };
        let op = if self.registered { "unregister" } else { "free" };
        self.device.event(op, &self.what, self.bytes, free, self.registered);
    }
}

impl SimDevice {
    /// Opens profile `name` for a model with `model_experts` bytes of routed experts (what an `experts` scale is
    /// computed from; `None` for a dense model).
    ///
    /// Errors: as [`DeviceProfile::find`].
    pub fn open(name: &str, model_experts: Option<u64>) -> Result<Arc<SimDevice>, ProfileError> {
        let profile = DeviceProfile::find(name)?;
        let scale = profile.scale.factor(model_experts);
        Ok(Arc::new(SimDevice {
            name: name.into(),
            profile,
            scale,
            state: Mutex::new(Account::default()),
        }))
    }

    fn account(&self) -> std::sync::MutexGuard<'_, Account> {
        // The account holds two counters: a panic while holding it cannot leave them torn.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The scale in force: every profile size is multiplied by it.
    pub fn scale(&self) -> f64 {
        self.scale
    }

    /// `bytes` of the reported card at the simulation's scale.
    pub fn scaled(&self, bytes: u64) -> u64 {
        (bytes as f64 * self.scale).round() as u64
    }

    /// `bytes` at the simulation's scale back on the reported card (for log lines that quote the report).
    pub fn unscaled(&self, bytes: u64) -> u64 {
        (bytes as f64 / self.scale).round() as u64
    }

    /// Total device memory, bytes (scaled).
    pub fn total(&self) -> u64 {
        self.scaled(self.profile.memory.total.0)
    }

    /// What the driver keeps free, bytes (scaled).
    pub fn driver_keeps_free(&self) -> u64 {
        self.scaled(self.profile.memory.driver_keeps_free.0)
    }

    /// The host's available memory, bytes (scaled).
    pub fn host_available(&self) -> u64 {
        self.scaled(self.profile.host.available.0)
    }

    fn free_of(&self, a: &Account) -> u64 {
        let charged = if self.profile.memory.uma { a.registered } else { 0 };
        self.scaled(self.profile.memory.free.0)
            .saturating_sub(a.allocated)
            .saturating_sub(charged)
    }

    /// The driver's reading: (free, total) bytes, as `cudaMemGetInfo` / `hipMemGetInfo` give them.
    pub fn mem_info(&self) -> (u64, u64) {
        (self.free_of(&self.account()), self.total())
    }

    /// Bytes registered host memory holds now (charged against free memory on a UMA device).
    pub fn registered(&self) -> u64 {
        self.account().registered
    }

    /// Allocates `bytes` of device memory for `what`.
    ///
    /// Errors: [`SimAllocError`] with the driver's out-of-memory name when the allocation would leave less free
    /// than the driver keeps; the account is unchanged.
    pub fn alloc(self: &Arc<Self>, what: &str, bytes: u64) -> Result<SimAlloc, SimAllocError> {
        let keeps = self.driver_keeps_free();
        let free = {
            let mut a = self.account();
            let free = self.free_of(&a);
            if free < keeps || bytes > free - keeps {
                drop(a);
                return Err(self.refused(false, what, bytes, free));
            }
            a.allocated += bytes;
            self.free_of(&a)
        };
        self.event("alloc", what, bytes, free, false);
        Ok(SimAlloc {
            device: self.clone(),
            what: what.into(),
            bytes,
            registered: false,
        })
    }

    /// Registers (page-locks for the device) `bytes` of host memory for `what`: on a UMA profile the bytes are
    /// charged against the device's free memory from now on.
    ///
    /// Errors: [`SimAllocError`] when the host has less available memory than `bytes` (the registration call
    /// refuses to lock what is not there).
    pub fn register_host(self: &Arc<Self>, what: &str, bytes: u64) -> Result<SimAlloc, SimAllocError> {
        if bytes > self.host_available() {
            return Err(self.refused(true, what, bytes, self.mem_info().0));
        }
        let free = {
            let mut a = self.account();
            a.registered += bytes;
            self.free_of(&a)
        };
        self.event("register", what, bytes, free, true);
        Ok(SimAlloc {
            device: self.clone(),
            what: what.into(),
            bytes,
            registered: true,
        })
    }

    /// A refused allocation (`host`: a registration) of `bytes` for `what` with `free` bytes free: its `memory`
    /// event, and the driver's error.
    fn refused(&self, host: bool, what: &str, bytes: u64, free: u64) -> SimAllocError {
        let api = self.profile.api;
        let (op, call) = if host {
            ("register_failed", api.host_register())
        } else {
            ("alloc_failed", api.malloc())
        };
        self.event(op, what, bytes, free, host);
        SimAllocError {
            call,
            what: what.into(),
            bytes,
            error: api.out_of_memory(),
            free,
            keeps: self.driver_keeps_free(),
        }
    }

    fn event(&self, op: &str, what: &str, bytes: u64, free: u64, host: bool) {
        events::emit(EventKind::Memory(Memory {
            device: format!("sim:{}", self.name),
            op: op.into(),
            what: what.into(),
            bytes,
            host,
            free_bytes: free,
            total_bytes: self.total(),
            scale: self.scale,
        }));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::profile::{Scale, Size};

    fn device(uma: bool, keeps: u64) -> Arc<SimDevice> {
        let mut profile = DeviceProfile::find("gfx1100-rx7900xtx").unwrap();
        profile.memory.total = Size(1000);
        profile.memory.free = Size(900);
        profile.memory.driver_keeps_free = Size(keeps);
        profile.memory.uma = uma;
        profile.host.available = Size(500);
        profile.scale = Scale::Factor(1.0);
        Arc::new(SimDevice {
            name: "t".into(),
            profile,
            scale: 1.0,
            state: Mutex::new(Account::default()),
        })
    }

    #[test]
    fn allocations_fail_at_the_drivers_floor_and_free_on_drop() {
        let d = device(false, 100);
        let a = d.alloc("a", 700).unwrap();
        assert_eq!(d.mem_info(), (200, 1000));
        // 101 bytes would leave 99, under the 100 the driver keeps.
        let e = d.alloc("the decode buffers", 101).unwrap_err();
        assert_eq!((e.error, e.free, e.keeps), ("hipErrorOutOfMemory", 200, 100));
        assert!(
            e.to_string().contains("hipMalloc of the decode buffers (101 B) failed"),
            "{e}"
        );
        assert_eq!(d.mem_info().0, 200, "a failed allocation takes nothing");
        let b = d.alloc("b", 100).unwrap();
        assert_eq!(d.mem_info().0, 100);
        drop((a, b));
        assert_eq!(d.mem_info().0, 900);
    }

    #[test]
    fn registered_host_memory_is_charged_on_uma_only() {
        let discrete = device(false, 0);
        let r = discrete.register_host("arena", 400).unwrap();
        assert_eq!(discrete.mem_info().0, 900);
        drop(r);
        let uma = device(true, 0);
        let r = uma.register_host("arena", 400).unwrap();
        assert_eq!(uma.mem_info().0, 500, "the reading collapses by the registered bytes");
        assert!(uma.alloc("x", 501).is_err() && uma.alloc("x", 500).is_ok());
        drop(r);
        assert_eq!(uma.registered(), 0);
        // More than the host has cannot be locked.
        assert_eq!(uma.register_host("arena", 501).unwrap_err().call, "hipHostRegister");
    }

    #[test]
    fn scale_shrinks_the_card() {
        let mut d = DeviceProfile::find("gfx1100-rx7900xtx").unwrap();
        d.scale = Scale::Factor(0.5);
        let s = SimDevice {
            name: "t".into(),
            scale: d.scale.factor(None),
            profile: d,
            state: Mutex::new(Account::default()),
        };
        assert_eq!(s.total(), 25753026560 / 2);
        assert_eq!(s.unscaled(s.scaled(1 << 30)), 1 << 30);
    }
}
