//! The engine's structured events (DESIGN.md section 3): one typed enum, one variant per kind, each with a
//! schema version and a timestamp, and the human log line rendered from the same value.
//!
//! Wire form, one JSON object per line (the worker protocol and `--events FILE`):
//! `{"event": KIND, "v": 2, "ts_ms": ..., ...fields}`. Kinds:
//!
//! - `load`: the model is loaded (model path, device, context cells, load time, resident set);
//! - `request`: one request's counts and times (the summary line of `strata generate`);
//! - `expert_cache`: what the VRAM expert cache did in one phase (prefill or decode) of one request
//!   ([`ExpertCache`]);
//! - `fallback`: something failed and something else runs instead, for good ([`Fallback`]);
//! - `fault`: something failed and the process cannot go on ([`Fault`]): a kernel launch (its grid and block
//!   absent on a `sim:` device, whose kernels are CPU ops), a copy on a poisoned device, a library GEMM with the
//!   fallback off, a panic;
//! - `memory`: a device's memory changed (an allocation, a free, a host registration, one that failed) with its
//!   free memory after it ([`Memory`]; a `sim:` device sends one per change);
//! - `probe`: the link probe's readings checked against the link's physical peak ([`Probe`]).
//!
//! Fields added within a version are optional (`memory` and `probe` are kinds added in version 2, and a `fault`'s
//! launch `grid` and `block` may be absent), so a reader of version 2 reads them all.
//!
//! Producers call [`emit`]: the human line goes to stderr, the event to the process's sink, which the serve
//! worker installs ([`set_sink`]) to forward events over its protocol and into its `--events` file. Any layer may
//! emit (the CUDA backend does), since this module imports nothing of the engine's.
//!
//! Schema history: version 1 carried free-form fields, with two `fallback` shapes and four `fault` shapes;
//! version 2 has one shape per kind.

use std::fmt;
use std::sync::{OnceLock, RwLock};

use serde::{Deserialize, Serialize};

/// Version of the event schema, carried by every [`Event`] as `v`.
pub const SCHEMA_VERSION: u32 = 2;

/// One event: its kind and fields, stamped with the schema version and the time.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Event {
    pub v: u32,
    /// Milliseconds since the Unix epoch.
    pub ts_ms: u64,
    #[serde(flatten)]
    pub kind: EventKind,
}

/// What happened, one variant per kind (the `event` field on the wire).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum EventKind {
    Load(Load),
    Request(Request),
    ExpertCache(ExpertCache),
    Fallback(Fallback),
    Fault(Fault),
    Memory(Memory),
    Probe(Probe),
}

/// `probe`: the link probe's readings and its check against the link's physical peak (DESIGN.md section 1, seed
/// 000): a reading above the peak is a probe bug, reported and never used.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Probe {
    /// `sim:gfx1100-rx7900xtx`, `cuda:0`.
    pub device: String,
    /// The readings, GB/s (10^9 bytes per second), in the order taken.
    pub readings_gb_s: Vec<f64>,
    /// The best reading, GB/s.
    pub best_gb_s: f64,
    /// The link's physical peak host to device, GB/s.
    pub peak_gb_s: f64,
    /// The link (`PCIe Gen4 x16`).
    pub link: String,
    /// Every reading is a positive rate at most the peak.
    pub plausible: bool,
    /// The rate planned with, GB/s: the best reading when plausible, else the peak-derived default.
    pub used_gb_s: f64,
}

/// `memory`: a device's memory changed (DESIGN.md section 3): an allocation, a free, a host registration, or one
/// that failed, with the device's free memory after it. A simulated device emits one per change, so a report can
/// draw its timeline.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Memory {
    /// `sim:gfx1151-strix-halo`, `cuda:0`.
    pub device: String,
    /// `alloc`, `free`, `register`, `unregister`, `alloc_failed`, `register_failed`.
    pub op: String,
    /// The part (`the expert cache`, `the expert arena`).
    pub what: String,
    pub bytes: u64,
    /// Host memory registered with the device, not device memory.
    #[serde(default)]
    pub host: bool,
    /// The device's free memory after the change (its driver's reading), bytes.
    pub free_bytes: u64,
    pub total_bytes: u64,
    /// The simulation's scale (1 on a real device): bytes on the reported card are these over it.
    #[serde(default = "one")]
    pub scale: f64,
}

fn one() -> f64 {
    1.0
}

/// `expert_cache`: what the VRAM expert cache did in one phase of one request (DESIGN.md section 3, "Expert
/// cache"). Counts are lookups of (layer, expert) by the layers' steps.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ExpertCache {
    /// The request (`None` outside a server).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub request: Option<u64>,
    /// `prefill` or `decode`.
    pub phase: String,
    pub lookups: u64,
    pub hits: u64,
    /// Misses uploaded into a cache slot.
    pub admitted: u64,
    /// Misses uploaded into a staging slot for the step alone.
    pub staged: u64,
    /// Admissions that took a slot from another expert.
    pub evictions: u64,
    /// Bytes copied from host memory to the device.
    pub bytes_uploaded: u64,
    /// Misses computed by the CPU instead of uploaded (`--miss-policy cpu|auto`; absent in events written before
    /// it existed: 0).
    #[serde(default)]
    pub cpu_computed: u64,
    /// Experts `--expert-prefetch` copied in before their layer's lookup, into a cache slot (counted in `admitted`
    /// too) or a prefetch staging slot (a use of one is counted in `staged`); absent in events written before it
    /// existed: 0.
    #[serde(default)]
    pub prefetched: u64,
    /// Of those, the ones the lookup then used (`prefetched - prefetch_used` were wasted).
    #[serde(default)]
    pub prefetch_used: u64,
    /// On a layer split, each stage's own cache (the counts above add them up); empty on one card.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub stages: Vec<StageCache>,
}

/// One stage's part of an [`ExpertCache`] event on a layer split: its card's cache of its layers' experts.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StageCache {
    /// The stage as messages name it: `cuda:1 (layers 24-47)`.
    pub stage: String,
    pub lookups: u64,
    pub hits: u64,
    /// Bytes copied from host memory to this card.
    pub bytes_uploaded: u64,
    /// Misses of this stage's layers computed by the CPU.
    pub cpu_computed: u64,
}

/// `load`: a worker (or command) loaded its model.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Load {
    /// The model file.
    pub model: String,
    /// `cpu`, `cuda:0`, ...
    pub device: String,
    /// `llama`, `qwen3moe`, ...
    pub arch: String,
    pub n_layer: u32,
    /// Context cells, in tokens.
    pub n_ctx: usize,
    pub load_ms: f64,
    /// Resident set after loading, bytes.
    pub rss_bytes: u64,
    /// The worker's process id.
    pub pid: u32,
}

/// `request`: what one request did.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Request {
    pub id: u64,
    /// Prompt tokens: reused plus read.
    pub prompt_tokens: usize,
    /// Prompt tokens whose cache cells were kept from an earlier request.
    pub reused: usize,
    /// Prompt tokens computed.
    pub read: usize,
    pub prefill_ms: f64,
    /// Tokens generated (a final end-of-generation token included).
    pub generated: usize,
    pub decode_ms: f64,
    /// Why it ended: `eog`, `stop_string`, `limit`, `context`, `cancelled`.
    pub stop: String,
    /// The generated token ids, in order (a final end-of-generation token included).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tokens: Vec<u32>,
    /// With `STRATA_LOGITS_DIGEST=1`: one digest per sampled token of the logits it was sampled from (FNV-1a,
    /// 64 bits, over the `vocab` f32 values' little-endian bytes), as 16 hex digits. Equal digests: bit-identical
    /// logits (up to a 2^-64 chance).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub logits_fnv: Vec<String>,
    /// Milliseconds the request waited in the worker for a slot (`--parallel`, continuous batching).
    #[serde(default)]
    pub queued_ms: f64,
    /// Sequences per forward step, averaged over the steps that computed this request's tokens (1: it ran alone).
    #[serde(default)]
    pub batch_mean: f64,
    /// Times the request was preempted for KV blocks (`--kv-tokens`): its cells were dropped and computed again.
    #[serde(default, skip_serializing_if = "is_zero_u32")]
    pub preempted: u32,
    /// Tokens computed again after those preemptions.
    #[serde(default, skip_serializing_if = "is_zero_usize")]
    pub recomputed: usize,
}

fn is_zero_u32(n: &u32) -> bool {
    *n == 0
}

fn is_zero_usize(n: &usize) -> bool {
    *n == 0
}

/// The shape of a matrix multiplication: `m` rows (tokens) × `k` inputs → `n` outputs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct GemmShape {
    pub m: usize,
    pub n: usize,
    pub k: usize,
}

/// `fallback`: `op` failed on `from` and runs on `to` from now on.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Fallback {
    /// The operation: `prefill_gemm`, `decode_step`.
    pub op: String,
    /// What failed: `blas` (a vendor library GEMM: cuBLAS, or the simulated one on the CPU), `cuda_graph`.
    pub from: String,
    /// What runs instead: `gemm_tensor_core` (our CUDA GEMM), `prefill_chunked` (prefill in batches of at most
    /// `max_rows`), `launches` (kernels one by one).
    pub to: String,
    /// The error, as the failing layer said it.
    pub why: String,
    /// The failing call's shape, when it was a GEMM.
    #[serde(flatten, default, skip_serializing_if = "Option::is_none")]
    pub shape: Option<GemmShape>,
    /// The largest batch that still works, in rows, when the fallback caps batches.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_rows: Option<usize>,
}

/// `fault`: an operation failed and the process stops (the server restarts its worker).
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct Fault {
    /// The error, as the failing layer said it.
    pub error: String,
    /// The operation (`prefill_gemm`), when known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub op: Option<String>,
    /// The kernel or library call (`mmv_moe_q4_k`, `cublasGemmEx`), when one failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kernel: Option<String>,
    /// The launch, when a kernel failed.
    #[serde(flatten, default, skip_serializing_if = "Option::is_none")]
    pub launch: Option<Launch>,
    /// The shape, when a GEMM failed.
    #[serde(flatten, default, skip_serializing_if = "Option::is_none")]
    pub shape: Option<GemmShape>,
    /// The request it happened in.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub request: Option<u64>,
    /// Source location, for a panic.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub location: Option<String>,
}

/// A kernel launch: grid and block, the launch's number since start, and whether launches were synchronised
/// (`STRATA_SYNC_LAUNCHES=1`: then the faulting kernel is this one, not a later one).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Launch {
    /// Blocks per grid; absent on a `sim:` device, whose "kernels" are CPU ops with no launch geometry.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub grid: Option<[u32; 3]>,
    /// Threads per block; absent on a `sim:` device.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub block: Option<[u32; 3]>,
    /// The launch's number since the process started, counting every kernel's.
    pub call: u64,
    pub synced: bool,
}

/// Milliseconds since the Unix epoch: the clock of every event's `ts_ms` (0 if the clock is before the epoch).
pub fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

impl Event {
    /// `kind` stamped now with the current schema version.
    pub fn now(kind: EventKind) -> Event {
        Event {
            v: SCHEMA_VERSION,
            ts_ms: unix_ms(),
            kind,
        }
    }

    /// The kind's name on the wire (`load`, `request`, `fallback`, `fault`).
    pub fn name(&self) -> &'static str {
        self.kind.name()
    }
}

impl EventKind {
    /// The kind's name on the wire.
    pub fn name(&self) -> &'static str {
        match self {
            EventKind::Load(_) => "load",
            EventKind::Request(_) => "request",
            EventKind::ExpertCache(_) => "expert_cache",
            EventKind::Fallback(_) => "fallback",
            EventKind::Fault(_) => "fault",
            EventKind::Memory(_) => "memory",
            EventKind::Probe(_) => "probe",
        }
    }
}

/// Tokens per second of `n` tokens in `ms` milliseconds (0 for no time).
fn rate(n: usize, ms: f64) -> f64 {
    if ms > 0.0 { n as f64 / ms * 1e3 } else { 0.0 }
}

impl fmt::Display for Request {
    /// The summary line: `prompt 53 tokens = 0 reused + 53 read in 634 ms (83.6 tok/s), 47 generated in 775 ms
    /// (60.6 tok/s)`, then for a preempted request `; preempted N times for KV blocks, M tokens computed again,
    /// queued Q ms in all` and for a cancelled one `; cancelled`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "prompt {} tokens = {} reused + {} read in {:.0} ms ({:.1} tok/s), {} generated in {:.0} ms ({:.1} tok/s)",
            self.prompt_tokens,
            self.reused,
            self.read,
            self.prefill_ms,
            rate(self.read, self.prefill_ms),
            self.generated,
            self.decode_ms,
            rate(self.generated, self.decode_ms)
        )?;
        if self.preempted > 0 {
            let times = if self.preempted == 1 { "time" } else { "times" };
            write!(
                f,
                "; preempted {} {times} for KV blocks, {} tokens computed again, queued {:.0} ms in all",
                self.preempted, self.recomputed, self.queued_ms
            )?;
        }
        if self.stop == "cancelled" {
            write!(f, "; cancelled")?;
        }
        Ok(())
    }
}

impl fmt::Display for GemmShape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "m={} n={} k={}", self.m, self.n, self.k)
    }
}

impl fmt::Display for Fault {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(op) = &self.op {
            write!(f, "{op} ")?;
        }
        if let Some(k) = &self.kernel {
            write!(f, "{k} ")?;
        }
        if let Some(l) = &self.launch {
            if let (Some(g), Some(b)) = (l.grid, l.block) {
                write!(f, "grid {g:?} block {b:?} ")?;
            }
            write!(
                f,
                "launch #{}{} ",
                l.call,
                if l.synced {
                    " (synchronised)"
                } else {
                    " (not synchronised: an earlier launch may be at fault)"
                }
            )?;
        }
        if let Some(s) = &self.shape {
            write!(f, "{s} ")?;
        }
        write!(f, "failed: {}", self.error)?;
        if let Some(r) = self.request {
            write!(f, " (request {r})")?;
        }
        if let Some(l) = &self.location {
            write!(f, " at {l}")?;
        }
        Ok(())
    }
}

/// `hits` of `lookups` in percent (0 without lookups).
fn hit_rate(hits: u64, lookups: u64) -> f64 {
    if lookups > 0 {
        100.0 * hits as f64 / lookups as f64
    } else {
        0.0
    }
}

impl fmt::Display for EventKind {
    /// The human log line of the event (without the `strata:` prefix).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            EventKind::Load(l) => write!(
                f,
                "worker {} loaded {} ({}, {} layers) on {} in {:.0} ms",
                l.pid, l.model, l.arch, l.n_layer, l.device, l.load_ms
            ),
            EventKind::Request(r) => write!(f, "{r}"),
            EventKind::ExpertCache(c) => {
                write!(
                    f,
                    "{} expert cache hit rate: {:.1}% ({} hits / {} lookups), {} uploaded ({} into slots, {} staged, {} evictions), {:.1} MB",
                    c.phase,
                    hit_rate(c.hits, c.lookups),
                    c.hits,
                    c.lookups,
                    c.admitted + c.staged,
                    c.admitted,
                    c.staged,
                    c.evictions,
                    c.bytes_uploaded as f64 / 1e6
                )?;
                if c.cpu_computed > 0 {
                    write!(f, "; {} computed by the CPU", c.cpu_computed)?;
                }
                if c.prefetched > 0 {
                    write!(
                        f,
                        "; {} prefetched, {} used, {} wasted",
                        c.prefetched,
                        c.prefetch_used,
                        c.prefetched.saturating_sub(c.prefetch_used)
                    )?;
                }
                for s in &c.stages {
                    write!(
                        f,
                        "; {}: {:.1}% ({} / {}), {:.1} MB",
                        s.stage,
                        hit_rate(s.hits, s.lookups),
                        s.hits,
                        s.lookups,
                        s.bytes_uploaded as f64 / 1e6
                    )?;
                }
                Ok(())
            }
            EventKind::Fallback(b) => {
                write!(f, "fallback: {} on {} failed", b.op, b.from)?;
                if let Some(s) = &b.shape {
                    write!(f, " at {s}")?;
                }
                write!(f, " ({}); {} runs on {}", b.why, b.op, b.to)?;
                if let Some(n) = b.max_rows {
                    write!(f, " in batches of at most {n} rows")?;
                }
                write!(f, " from now on")
            }
            EventKind::Fault(x) => write!(f, "fault: {x}"),
            EventKind::Probe(p) => {
                let list: Vec<String> = p.readings_gb_s.iter().map(|r| format!("{r:.1}")).collect();
                write!(
                    f,
                    "probe: {} link {:.1} GB/s host->device (best of {}); the link's peak is {:.1} GB/s ({}): ",
                    p.device,
                    p.best_gb_s,
                    list.join(" "),
                    p.peak_gb_s,
                    p.link
                )?;
                if p.plausible {
                    write!(f, "plausible, used")
                } else {
                    write!(
                        f,
                        "a reading above the peak is a probe bug, not a rate: not used; planning with {:.1} GB/s",
                        p.used_gb_s
                    )
                }
            }
            EventKind::Memory(m) => {
                let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
                write!(
                    f,
                    "memory: {} {} {:.2} MiB{} for {}; {:.2} of {:.2} MiB free",
                    m.device,
                    m.op.replace('_', " "),
                    mib(m.bytes),
                    if m.host { " of host memory" } else { "" },
                    m.what,
                    mib(m.free_bytes),
                    mib(m.total_bytes)
                )?;
                if m.scale != 1.0 {
                    write!(
                        f,
                        " (scale {:.3e}: {:.2} GiB free on the reported card)",
                        m.scale,
                        m.free_bytes as f64 / m.scale / (1u64 << 30) as f64
                    )?;
                }
                Ok(())
            }
        }
    }
}

type Sink = Box<dyn Fn(&Event) + Send + Sync>;
static SINK: OnceLock<Sink> = OnceLock::new();
static PREFIX: RwLock<&'static str> = RwLock::new("strata");

/// Installs the process's event sink (first call wins; later calls are ignored).
pub fn set_sink(f: impl Fn(&Event) + Send + Sync + 'static) {
    let _ = SINK.set(Box::new(f));
}

/// Sets the prefix of the human lines [`emit`] prints (`strata` by default; the serve worker's is
/// `strata serve`).
pub fn set_log_prefix(prefix: &'static str) {
    *PREFIX.write().unwrap_or_else(|e| e.into_inner()) = prefix;
}

/// The prefix set by [`set_log_prefix`].
pub fn log_prefix() -> &'static str {
    *PREFIX.read().unwrap_or_else(|e| e.into_inner())
}

/// Stamps `kind`, prints its human line on stderr and hands the event to the process's sink, if any.
pub fn emit(kind: EventKind) {
    let ev = Event::now(kind);
    eprintln!("{}: {}", log_prefix(), ev.kind);
    if let Some(sink) = SINK.get() {
        sink(&ev);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn round_trip(kind: EventKind) -> String {
        let ev = Event::now(kind);
        let line = serde_json::to_string(&ev).unwrap();
        assert_eq!(serde_json::from_str::<Event>(&line).unwrap(), ev, "{line}");
        line
    }

    #[test]
    fn every_kind_round_trips_with_its_name_version_and_time() {
        let line = round_trip(EventKind::Fallback(Fallback {
            op: "prefill_gemm".into(),
            from: "blas".into(),
            to: "prefill_chunked".into(),
            why: "injected".into(),
            shape: Some(GemmShape { m: 72, n: 576, k: 576 }),
            max_rows: Some(64),
        }));
        assert!(
            line.contains(r#""event":"fallback""#) && line.contains(r#""v":2"#),
            "{line}"
        );
        assert!(
            line.contains(r#""m":72"#) && line.contains(r#""max_rows":64"#),
            "{line}"
        );
        let line = round_trip(EventKind::Fault(Fault {
            error: "boom".into(),
            location: Some("src/x.rs:1:2".into()),
            ..Fault::default()
        }));
        assert!(!line.contains("kernel") && !line.contains("grid"), "{line}");
        round_trip(EventKind::Fault(Fault {
            error: "unspecified launch failure".into(),
            kernel: Some("mmv_q4_k".into()),
            launch: Some(Launch {
                grid: Some([1, 2, 3]),
                block: Some([128, 1, 1]),
                call: 9,
                synced: true,
            }),
            ..Fault::default()
        }));
        let r = Request {
            id: 1,
            prompt_tokens: 53,
            reused: 0,
            read: 53,
            prefill_ms: 634.0,
            generated: 47,
            decode_ms: 775.0,
            stop: "eog".into(),
            tokens: vec![3, 1, 4],
            logits_fnv: vec!["cbf29ce484222325".into()],
            queued_ms: 1.5,
            batch_mean: 2.25,
            preempted: 0,
            recomputed: 0,
        };
        let json = serde_json::to_value(&r).unwrap();
        assert_eq!(
            (json["queued_ms"].as_f64(), json["batch_mean"].as_f64()),
            (Some(1.5), Some(2.25))
        );
        assert_eq!(
            r.to_string(),
            "prompt 53 tokens = 0 reused + 53 read in 634 ms (83.6 tok/s), 47 generated in 775 ms (60.6 tok/s)"
        );
        assert!(json.get("preempted").is_none(), "0 is left out: {json}");
        let r = Request {
            preempted: 2,
            recomputed: 75,
            ..r
        };
        assert_eq!(serde_json::to_value(&r).unwrap()["preempted"], 2);
        assert!(
            r.to_string()
                .ends_with("; preempted 2 times for KV blocks, 75 tokens computed again, queued 2 ms in all"),
            "{r}"
        );
        round_trip(EventKind::Request(r));
        let c = ExpertCache {
            request: Some(3),
            phase: "decode".into(),
            lookups: 22118,
            hits: 19579,
            admitted: 2400,
            staged: 139,
            evictions: 2300,
            bytes_uploaded: 6_728_000_000,
            cpu_computed: 0,
            prefetched: 0,
            prefetch_used: 0,
            stages: Vec::new(),
        };
        // The original's line (seed 000), then what was uploaded.
        assert_eq!(
            EventKind::ExpertCache(c.clone()).to_string(),
            "decode expert cache hit rate: 88.5% (19579 hits / 22118 lookups), 2539 uploaded (2400 into slots, 139 staged, 2300 evictions), 6728.0 MB"
        );
        let line = round_trip(EventKind::ExpertCache(c.clone()));
        assert!(
            line.contains(r#""event":"expert_cache""#) && line.contains(r#""phase":"decode""#),
            "{line}"
        );
        // Misses the CPU computed are named after the uploads; an event without the field reads as none.
        let cpu = ExpertCache {
            cpu_computed: 1200,
            ..c.clone()
        };
        assert!(
            EventKind::ExpertCache(cpu.clone())
                .to_string()
                .ends_with("6728.0 MB; 1200 computed by the CPU")
        );
        round_trip(EventKind::ExpertCache(cpu));
        let old = line
            .replace(r#","cpu_computed":0"#, "")
            .replace(r#","prefetched":0"#, "")
            .replace(r#","prefetch_used":0"#, "");
        assert!(!old.contains("cpu_computed") && !old.contains("prefetch"), "{old}");
        let back: Event = serde_json::from_str(&old).unwrap();
        assert!(matches!(
            back.kind,
            EventKind::ExpertCache(ExpertCache {
                cpu_computed: 0,
                prefetched: 0,
                prefetch_used: 0,
                ..
            })
        ));
        // Prefetches are named last, with the wasted ones.
        let pf = ExpertCache {
            prefetched: 300,
            prefetch_used: 240,
            ..c.clone()
        };
        assert!(
            EventKind::ExpertCache(pf.clone())
                .to_string()
                .ends_with("6728.0 MB; 300 prefetched, 240 used, 60 wasted"),
            "{}",
            EventKind::ExpertCache(pf.clone())
        );
        round_trip(EventKind::ExpertCache(pf));
        // A layer split names each stage's cache last; one card's event has no `stages` field.
        assert!(!line.contains("stages"), "{line}");
        let split = ExpertCache {
            stages: vec![
                StageCache {
                    stage: "cuda:0 (layers 0-23)".into(),
                    lookups: 12000,
                    hits: 11000,
                    bytes_uploaded: 2_000_000_000,
                    cpu_computed: 0,
                },
                StageCache {
                    stage: "cuda:1 (layers 24-47)".into(),
                    lookups: 10118,
                    hits: 8579,
                    bytes_uploaded: 4_728_000_000,
                    cpu_computed: 0,
                },
            ],
            ..c.clone()
        };
        let text = EventKind::ExpertCache(split.clone()).to_string();
        assert!(
            text.ends_with(
                "6728.0 MB; cuda:0 (layers 0-23): 91.7% (11000 / 12000), 2000.0 MB; cuda:1 (layers 24-47): 84.8% (8579 / 10118), 4728.0 MB"
            ),
            "{text}"
        );
        round_trip(EventKind::ExpertCache(split));
    }

    #[test]
    fn human_lines_name_what_failed() {
        let f = Fault {
            error: "an illegal memory access".into(),
            kernel: Some("attn_decode".into()),
            launch: Some(Launch {
                grid: Some([8, 1, 1]),
                block: Some([128, 1, 1]),
                call: 4711,
                synced: true,
            }),
            ..Fault::default()
        };
        let line = EventKind::Fault(f).to_string();
        assert!(line.contains("attn_decode") && line.contains("#4711"), "{line}");
        let b = EventKind::Fallback(Fallback {
            op: "prefill_gemm".into(),
            from: "cublas".into(),
            to: "gemm_tensor_core".into(),
            why: "status 6".into(),
            shape: None,
            max_rows: None,
        });
        assert!(b.to_string().contains("gemm_tensor_core"), "{b}");
    }
}
