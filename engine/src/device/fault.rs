//! Fault injection: `STRATA_FAULT` makes an operation fail the way a vendor library did on someone's hardware,
//! so the harness can replay a bug report (and the engine's recovery path) on the CPU (DESIGN.md section 1,
//! seed 000).
//!
//! Grammar: a comma-separated list of rules; today one kind exists:
//!
//! - `prefill_gemm:m>N`: a prefill matrix multiplication over a batch of more than N rows (N ≥ 1) fails, as
//!   rocBLAS's GEMM did on gfx1100 (`hipErrorInvalidDeviceFunction`) once a prompt passed 64 tokens. A batch of
//!   one row is decode (a matrix-vector product) and never fails.
//!
//! The variable is parsed once, at start-up ([`FaultPlan::from_env`]); a malformed value is an error there, never
//! ignored. The per-chunk check ([`FaultPlan::prefill_gemm_fails`]) is a comparison: no lock, no allocation.

/// The environment variable holding the fault rules.
pub const ENV_FAULT: &str = crate::switches::FAULT;

/// The name of the operation `prefill_gemm` rules target, as fault and fallback events report it.
pub const OP_PREFILL_GEMM: &str = "prefill_gemm";

/// The faults to inject; the default injects none.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct FaultPlan {
    /// `prefill_gemm:m>N`: the largest prefill batch, in rows (tokens), whose GEMM still succeeds.
    pub prefill_gemm_max_rows: Option<usize>,
}

/// A malformed `STRATA_FAULT` value.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FaultSpecError {
    #[error("{ENV_FAULT}: unknown fault `{rule}`; the known one is `prefill_gemm:m>N` (for example prefill_gemm:m>64)")]
    UnknownRule { rule: String },
    #[error(
        "{ENV_FAULT}: `{rule}` needs a condition `m>N` with N a positive row count (for example prefill_gemm:m>64)"
    )]
    BadCondition { rule: String },
    #[error("{ENV_FAULT}: `{rule}` repeats a fault already given")]
    Repeated { rule: String },
}

/// A prefill GEMM that the plan made fail: the operation and its shape (`m` rows × `k` inputs → `n` outputs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GemmFault {
    /// Rows of the batch (tokens in the prefill chunk).
    pub m: usize,
    /// Inner dimension (the model width).
    pub k: usize,
    /// Output columns of the first projection that would have run.
    pub n: usize,
    /// The row limit the plan set (`m>limit` fails).
    pub limit: usize,
}

impl std::fmt::Display for GemmFault {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{OP_PREFILL_GEMM} m={} n={} k={}: injected GEMM failure ({ENV_FAULT}={OP_PREFILL_GEMM}:m>{})",
            self.m, self.n, self.k, self.limit
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
        };
        let s = f.to_string();
        assert!(s.starts_with("prefill_gemm m=72 n=576 k=576"), "{s}");
    }
}
