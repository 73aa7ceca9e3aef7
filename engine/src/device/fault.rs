//! Fault injection: `STRATA_FAULT` makes an operation fail the way a vendor library did on someone's hardware,
//! so the harness can replay a bug report (and the engine's recovery path) on the CPU (DESIGN.md section 1,
//! seed 000).
//!
//! Grammar: a comma-separated list of rules:
//!
//! - `prefill_gemm:m>N`: a prefill matrix multiplication over a batch of more than N rows (N ≥ 1) fails, as
//!   rocBLAS's GEMM did on gfx1100 (`hipErrorInvalidDeviceFunction`) once a prompt passed 64 tokens. A batch of
//!   one row is decode (a matrix-vector product) and never fails.
//! - `sticky:KERNEL@N` (a `sim:` or `cuda:` device): the N-th launch of KERNEL (N ≥ 1) fails and leaves the device
//!   poisoned: every later launch or copy fails with the same error, as a CUDA 719 / HIP "unspecified launch
//!   failure" does (seed 003). The failure is asynchronous: without `STRATA_SYNC_LAUNCHES=1` it surfaces at the
//!   next call, an innocent one; with it, at KERNEL itself. [`LaunchGate`] keeps the count.
//! - `probe:unsynced` (a `cuda:` device): the link probe times each copy without waiting for it, so it reads the
//!   time to queue a copy: terabytes per second, as seed 000's probe did. The probe's check must catch it.
//! - `trap:KERNEL@N` (a `cuda:` device): the N-th launch of KERNEL runs a kernel that executes a trap instruction
//!   in its place, with its grid and block: a real poisoned context, reported by the driver itself.
//!
//! The variable is parsed once, at start-up ([`FaultPlan::from_env`]); a malformed value is an error there, never
//! ignored. The per-chunk check ([`FaultPlan::prefill_gemm_fails`]) is a comparison: no lock, no allocation.

/// The environment variable holding the fault rules.
pub const ENV_FAULT: &str = crate::switches::FAULT;

/// The name of the operation `prefill_gemm` rules target, as fault and fallback events report it.
pub const OP_PREFILL_GEMM: &str = "prefill_gemm";

/// The name of `sticky:KERNEL@N` rules.
pub const STICKY: &str = "sticky";
/// The name of `trap:KERNEL@N` rules.
pub const TRAP: &str = "trap";

/// The faults to inject; the default injects none.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct FaultPlan {
    /// `prefill_gemm:m>N`: the largest prefill batch, in rows (tokens), whose GEMM still succeeds.
    pub prefill_gemm_max_rows: Option<usize>,
    /// The failing GEMM's error as the vendor library said it, when a `sim:` profile's `blas` gave the limit
    /// (`None`: the rule came from `STRATA_FAULT`).
    pub prefill_gemm_error: Option<std::sync::Arc<str>>,
    /// `sticky:KERNEL@N` or `trap:KERNEL@N`: the launch that poisons the device.
    pub sticky: Option<StickyRule>,
    /// `probe:unsynced`: the CUDA link probe times its copies without waiting for them (seed 000's impossible
    /// readings, made on real hardware).
    pub probe_unsynced: bool,
}

/// A launch that fails and poisons the device for every later call (seed 003).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StickyRule {
    /// The kernel (a CUDA kernel's name; on a `sim:` device, a backend op's, [`SIM_KERNELS`]).
    pub kernel: String,
    /// Which launch of that kernel fails, counting from 1.
    pub launch: u64,
    /// `trap:`: a real trap on a CUDA device instead of an injected error.
    pub trap: bool,
}

impl std::fmt::Display for StickyRule {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = if self.trap { TRAP } else { STICKY };
        write!(f, "{kind}:{}@{}", self.kernel, self.launch)
    }
}

/// The "kernels" of a `sim:` device: the backend ops, each one launch, that `sticky:KERNEL@N` can name there.
pub const SIM_KERNELS: &[&str] = &[
    "upload",
    "download",
    "copy",
    "get_rows",
    "matmul",
    "matmul_many",
    "rms_norm",
    "rms_norm_into",
    "add_rms_norm_into",
    "rope",
    "qk_norm_rope",
    "qk_norm_rope_store",
    "rope_store_attention",
    "attend",
    "attend_runs",
    "scale",
    "add",
    "store_kv",
    "attention",
    "glu",
    "moe",
    "moe_add_rms_norm",
    "routed_experts",
    "top_logits",
    "read_top_logits",
    "top_logits_rows",
    "read_top_logits_rows",
];

/// A malformed `STRATA_FAULT` value.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FaultSpecError {
    #[error(
        "{ENV_FAULT}: unknown fault `{rule}`; the known ones are `prefill_gemm:m>N` (for example prefill_gemm:m>64), `sticky:KERNEL@N`, `trap:KERNEL@N` (for example sticky:moe@2) and `probe:unsynced`"
    )]
    UnknownRule { rule: String },
    #[error(
        "{ENV_FAULT}: `{rule}` needs a kernel and a launch number N ≥ 1 (for example sticky:moe@2: the second launch of moe)"
    )]
    BadLaunch { rule: String },
    #[error(
        "{ENV_FAULT}: `{rule}` needs a condition `m>N` with N a positive row count (for example prefill_gemm:m>64)"
    )]
    BadCondition { rule: String },
    #[error(
        "{ENV_FAULT}: `{rule}`: a second rule of its kind; give one prefill_gemm rule, one sticky or trap rule, one probe rule"
    )]
    Repeated { rule: String },
}

/// A prefill GEMM that the plan made fail: the operation and its shape (`m` rows × `k` inputs → `n` outputs).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GemmFault {
    /// Rows of the batch (tokens in the prefill chunk).
    pub m: usize,
    /// Inner dimension (the model width).
    pub k: usize,
    /// Output columns of the first projection that would have run.
    pub n: usize,
    /// The row limit the plan set (`m>limit` fails).
    pub limit: usize,
    /// The vendor library's error, when a device profile set the limit ([`FaultPlan::prefill_gemm_error`]).
    pub vendor_error: Option<std::sync::Arc<str>>,
}

impl GemmFault {
    /// Why it failed, without the operation and shape (a `fault` event carries those in fields of their own): the
    /// vendor library's error, or the injected rule.
    pub fn reason(&self) -> String {
        match &self.vendor_error {
            Some(e) => format!("{e} (the device profile's BLAS fails above {} rows)", self.limit),
            None => format!("injected GEMM failure ({ENV_FAULT}={OP_PREFILL_GEMM}:m>{})", self.limit),
        }
    }
}

impl std::fmt::Display for GemmFault {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{OP_PREFILL_GEMM} m={} n={} k={}: {}",
            self.m,
            self.n,
            self.k,
            self.reason()
        )
    }
}

impl FaultPlan {
    /// Parses a rule list; an empty or all-blank value injects nothing.
    ///
    /// Errors: an unknown rule, a malformed condition, a rule given twice.
    pub fn parse(spec: &str) -> Result<FaultPlan, FaultSpecError> {
        let mut plan = FaultPlan::default();
        for rule in spec.split(',').map(str::trim).filter(|r| !r.is_empty()) {
            let (kind, cond) = rule.split_once(':').unwrap_or((rule, ""));
            if matches!(kind.trim(), STICKY | TRAP) {
                let (kernel, n) = cond.split_once('@').unwrap_or((cond, ""));
                let kernel = kernel.trim();
                let launch = n
                    .trim()
                    .parse::<u64>()
                    .ok()
                    .filter(|&n| n >= 1)
                    .filter(|_| !kernel.is_empty() && kernel.chars().all(|c| c.is_ascii_alphanumeric() || c == '_'))
                    .ok_or_else(|| FaultSpecError::BadLaunch { rule: rule.into() })?;
                let r = StickyRule {
                    kernel: kernel.into(),
                    launch,
                    trap: kind.trim() == TRAP,
                };
                if plan.sticky.replace(r).is_some() {
                    return Err(FaultSpecError::Repeated { rule: rule.into() });
                }
                continue;
            }
            if kind.trim() == "probe" {
                if cond.trim() != "unsynced" {
                    return Err(FaultSpecError::UnknownRule { rule: rule.into() });
                }
                if std::mem::replace(&mut plan.probe_unsynced, true) {
                    return Err(FaultSpecError::Repeated { rule: rule.into() });
                }
                continue;
            }
            if kind.trim() != OP_PREFILL_GEMM {
                return Err(FaultSpecError::UnknownRule { rule: rule.into() });
            }
            let n = cond
                .trim()
                .strip_prefix('m')
                .and_then(|c| c.trim_start().strip_prefix('>'))
                .and_then(|n| n.trim().parse::<usize>().ok())
                .filter(|&n| n >= 1)
                .ok_or_else(|| FaultSpecError::BadCondition { rule: rule.into() })?;
            if plan.prefill_gemm_max_rows.replace(n).is_some() {
                return Err(FaultSpecError::Repeated { rule: rule.into() });
            }
        }
        Ok(plan)
    }

    /// The plan in `$STRATA_FAULT` (none when unset).
    ///
    /// Errors: as [`FaultPlan::parse`]; a value that is not UTF-8.
    pub fn from_env() -> Result<FaultPlan, FaultSpecError> {
        match crate::switches::text(ENV_FAULT) {
            Some(Ok(v)) => FaultPlan::parse(&v),
            None => Ok(FaultPlan::default()),
            Some(Err(rule)) => Err(FaultSpecError::UnknownRule { rule }),
        }
    }

    /// Whether a prefill batch of `rows` tokens hits the injected GEMM failure. Hot path: one comparison.
    #[inline]
    pub fn prefill_gemm_fails(&self, rows: usize) -> bool {
        rows > 1 && self.prefill_gemm_max_rows.is_some_and(|limit| rows > limit)
    }
}

impl StickyRule {
    /// Whether a `sim:` device can carry the rule out: a `sticky:` rule on one of [`SIM_KERNELS`] (a trap needs a
    /// real GPU).
    ///
    /// Errors: why not, in words that list the known kernels.
    pub fn check_sim(&self) -> Result<(), String> {
        if self.trap {
            return Err(format!(
                "{self}: a trap needs a real GPU (cuda:N); on a sim: device write sticky:{}@{}",
                self.kernel, self.launch
            ));
        }
        if !SIM_KERNELS.contains(&self.kernel.as_str()) {
            return Err(format!(
                "{self}: a sim: device has no kernel `{}`; its kernels are the backend's ops: {}",
                self.kernel,
                SIM_KERNELS.join(", ")
            ));
        }
        Ok(())
    }
}

/// What a launch does under a [`LaunchGate`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// Launch as usual.
    Run,
    /// `trap:`: launch the trap kernel in this one's place (the driver reports the failure from here on).
    Trap,
    /// The call fails with the driver's `error`: the poisoning launch itself when launches are synchronised,
    /// else any call after it.
    Fail { error: String },
}

/// Counts launches for a [`StickyRule`] and keeps the device's poisoned state (seed 003): the rule's launch
/// poisons it; every later call fails with the same error. Shared by the `sim:` device (every backend op is one
/// launch) and the CUDA backend (every kernel launch; `trap:` rules run a real trap instead).
#[derive(Debug)]
pub struct LaunchGate {
    rule: StickyRule,
    synced: bool,
    error: String,
    state: std::sync::Mutex<GateState>,
}

impl Drop for LaunchGate {
    /// A rule that never fired says so: a kernel the run never launched, or fewer launches than N, is a replay
    /// that reproduced nothing.
    fn drop(&mut self) {
        let s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if !s.poisoned {
            eprintln!(
                "strata: {ENV_FAULT}={}: {} launch(es) of {} ran, fewer than {}: the fault never fired",
                self.rule, s.seen, self.rule.kernel, self.rule.launch
            );
        }
    }
}

#[derive(Debug, Default)]
struct GateState {
    /// Launches of the rule's kernel so far.
    seen: u64,
    /// Whether the rule's launch has happened.
    poisoned: bool,
}

impl LaunchGate {
    /// A gate for `rule`; `synced`: launches are synchronised (`STRATA_SYNC_LAUNCHES=1`), so the failure surfaces
    /// at the poisoning launch; `error`: the driver's words for it (`hipErrorLaunchFailure: unspecified launch
    /// failure`).
    pub fn new(rule: StickyRule, synced: bool, error: impl Into<String>) -> LaunchGate {
        LaunchGate {
            rule,
            synced,
            error: error.into(),
            state: std::sync::Mutex::new(GateState::default()),
        }
    }

    /// Whether launches are synchronised.
    pub fn synced(&self) -> bool {
        self.synced
    }

    /// Whether the poisoning launch has happened.
    pub fn poisoned(&self) -> bool {
        self.state.lock().unwrap_or_else(|e| e.into_inner()).poisoned
    }

    /// A call that is no launch (a copy, a synchronisation): it fails once an injected sticky fault has fired, as
    /// every call on a poisoned context does; it runs otherwise (and after a trap, whose failures are the
    /// driver's).
    pub fn call(&self) -> Verdict {
        if !self.rule.trap && self.poisoned() {
            Verdict::Fail {
                error: self.error.clone(),
            }
        } else {
            Verdict::Run
        }
    }

    /// A launch (or copy) of `kernel`: what to do. One lock and a string comparison per launch.
    pub fn launch(&self, kernel: &str) -> Verdict {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if s.poisoned {
            // A trap's later failures are the driver's own.
            return if self.rule.trap {
                Verdict::Run
            } else {
                Verdict::Fail {
                    error: self.error.clone(),
                }
            };
        }
        if kernel != self.rule.kernel {
            return Verdict::Run;
        }
        s.seen += 1;
        if s.seen < self.rule.launch {
            return Verdict::Run;
        }
        s.poisoned = true;
        match (self.rule.trap, self.synced) {
            (true, _) => Verdict::Trap,
            (false, true) => Verdict::Fail {
                error: self.error.clone(),
            },
            // Asynchronous: the launch is queued fine; the error waits for the next call.
            (false, false) => Verdict::Run,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_seed_000_rule() {
        let p = FaultPlan::parse("prefill_gemm:m>64").unwrap();
        assert_eq!(p.prefill_gemm_max_rows, Some(64));
        assert!(!p.prefill_gemm_fails(64));
        assert!(p.prefill_gemm_fails(65));
        assert!(!p.prefill_gemm_fails(1));
        assert_eq!(
            FaultPlan::parse(" prefill_gemm : m > 8 ,")
                .unwrap()
                .prefill_gemm_max_rows,
            Some(8)
        );
    }

    #[test]
    fn empty_injects_nothing() {
        for s in ["", " ", ","] {
            let p = FaultPlan::parse(s).unwrap();
            assert_eq!(p, FaultPlan::default());
            assert!(!p.prefill_gemm_fails(100_000));
        }
    }

    #[test]
    fn malformed_rules_are_errors() {
        assert!(matches!(
            FaultPlan::parse("prefil_gemm:m>64"),
            Err(FaultSpecError::UnknownRule { .. })
        ));
        for bad in [
            "prefill_gemm",
            "prefill_gemm:",
            "prefill_gemm:m<64",
            "prefill_gemm:m>0",
            "prefill_gemm:m>x",
            "prefill_gemm:n>64",
        ] {
            assert!(
                matches!(FaultPlan::parse(bad), Err(FaultSpecError::BadCondition { .. })),
                "{bad}"
            );
        }
        assert!(matches!(
            FaultPlan::parse("prefill_gemm:m>64,prefill_gemm:m>8"),
            Err(FaultSpecError::Repeated { .. })
        ));
        let msg = FaultPlan::parse("oops").unwrap_err().to_string();
        assert!(
            msg.contains("STRATA_FAULT") && msg.contains("prefill_gemm:m>N"),
            "{msg}"
        );
    }

    #[test]
    fn fault_names_op_and_shape() {
        let f = GemmFault {
            m: 72,
            k: 576,
            n: 576,
            limit: 64,
            vendor_error: None,
        };
        let s = f.to_string();
        assert!(s.starts_with("prefill_gemm m=72 n=576 k=576"), "{s}");
    }

    #[test]
    fn parses_sticky_and_trap_rules() {
        let p = FaultPlan::parse("prefill_gemm:m>64, sticky:moe@2").unwrap();
        assert_eq!(p.prefill_gemm_max_rows, Some(64));
        let r = p.sticky.unwrap();
        assert_eq!((r.kernel.as_str(), r.launch, r.trap), ("moe", 2, false));
        assert_eq!(r.to_string(), "sticky:moe@2");
        let t = FaultPlan::parse("trap:mmv_q4_k@10").unwrap().sticky.unwrap();
        assert!(t.trap);
        assert_eq!(t.to_string(), "trap:mmv_q4_k@10");
        for bad in [
            "sticky:moe",
            "sticky:@2",
            "sticky:moe@0",
            "sticky:moe@x",
            "trap:mo e@1",
            "sticky:",
        ] {
            assert!(
                matches!(FaultPlan::parse(bad), Err(FaultSpecError::BadLaunch { .. })),
                "{bad}"
            );
        }
        assert!(FaultPlan::parse("probe:unsynced").unwrap().probe_unsynced);
        assert!(matches!(
            FaultPlan::parse("probe:fast"),
            Err(FaultSpecError::UnknownRule { .. })
        ));
        assert!(matches!(
            FaultPlan::parse("sticky:moe@1,trap:add@1"),
            Err(FaultSpecError::Repeated { .. })
        ));
    }

    #[test]
    fn an_asynchronous_sticky_fault_surfaces_at_the_next_call() {
        let rule = FaultPlan::parse("sticky:moe@2").unwrap().sticky.unwrap();
        let g = LaunchGate::new(rule, false, "hipErrorLaunchFailure");
        assert_eq!(g.launch("add"), Verdict::Run);
        assert_eq!(g.launch("moe"), Verdict::Run);
        assert!(!g.poisoned());
        // The second moe is queued without complaint; the innocent add after it fails, and so does every call.
        assert_eq!(g.launch("moe"), Verdict::Run);
        assert!(g.poisoned());
        let fail = Verdict::Fail {
            error: "hipErrorLaunchFailure".into(),
        };
        assert_eq!(g.launch("add"), fail);
        assert_eq!(g.launch("download"), fail);
    }

    #[test]
    fn a_synchronised_sticky_fault_fails_at_its_kernel() {
        let rule = FaultPlan::parse("sticky:moe@1").unwrap().sticky.unwrap();
        let g = LaunchGate::new(rule, true, "e");
        assert_eq!(g.launch("rms_norm"), Verdict::Run);
        assert_eq!(g.launch("moe"), Verdict::Fail { error: "e".into() });
        assert_eq!(g.launch("rms_norm"), Verdict::Fail { error: "e".into() });
    }

    #[test]
    fn a_trap_runs_once_and_leaves_the_rest_to_the_driver() {
        let rule = FaultPlan::parse("trap:k@1").unwrap().sticky.unwrap();
        let g = LaunchGate::new(rule, false, "e");
        assert_eq!(g.launch("k"), Verdict::Trap);
        assert_eq!(g.launch("k"), Verdict::Run);
        assert_eq!(g.launch("j"), Verdict::Run);
    }
}
