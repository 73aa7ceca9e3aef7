//! Routing traces: which experts each token chose in each layer, in the order the engine looked them up, and a
//! generator of traces with a given routing locality (random-weight models route near-uniformly, so their
//! benchmarks need a realistic trace to mean anything; DESIGN.md section 5 has the published figures).
//!
//! File format (JSON Lines, one object per line): a header, then one record per (step, layer, token):
//!
//! ```text
//! {"strata_routing_trace":1,"n_layer":48,"n_expert":128,"k":8}
//! {"step":0,"layer":0,"token":0,"experts":[17,3,99,5,64,120,8,41]}
//! ```
//!
//! `step` counts forward steps, `token` is the token's position in its sequence, `experts` the router's top-k in
//! its order. Records are in lookup order: a step's layers in order, and in each layer the step's tokens.

use std::io::{BufRead, Write};
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::rng::SplitMix64;

/// The version this build writes and reads.
pub const TRACE_VERSION: u32 = 1;

/// The largest geometry a trace may declare: layers x experts (the slot table's entries) and top-k. Real MoEs
/// are far below (Qwen3-30B-A3B: 48 x 128, top-8; DeepSeek-V3: 61 x 256, top-8).
pub const MAX_EXPERTS_IN_ALL: u64 = 1 << 22;
pub const MAX_K: u32 = 1024;
/// The most lookups (records x k) a trace may hold in memory: 2^28, 1 GiB of expert ids.
pub const MAX_LOOKUPS: u64 = 1 << 28;

/// Checks a geometry against the limits: one line naming what is out of range, or `None`.
pub fn geometry_error(n_layer: u32, n_expert: u32, k: u32) -> Option<String> {
    if n_layer == 0 || n_expert == 0 || k == 0 || k > n_expert {
        return Some(format!(
            "impossible geometry: {n_layer} layers, top-{k} of {n_expert} experts (need at least one layer and 1 <= k <= experts)"
        ));
    }
    if n_layer as u64 * n_expert as u64 > MAX_EXPERTS_IN_ALL || k > MAX_K {
        return Some(format!(
            "{n_layer} layers x {n_expert} experts, top-{k}: above the {MAX_EXPERTS_IN_ALL} experts and top-{MAX_K} a trace may declare"
        ));
    }
    None
}

/// Longest line a trace may have, in bytes (a record of the most experts a token may choose, 1024, is under
/// 8 KiB): a file with no line breaks is an error, not all of memory.
pub const MAX_LINE_BYTES: usize = 64 << 10;

/// Lines of at most [`MAX_LINE_BYTES`] (without the line break; a `\r` before it is dropped).
struct BoundedLines<R> {
    r: R,
}

impl<R: BufRead> Iterator for BoundedLines<R> {
    type Item = std::io::Result<String>;

    fn next(&mut self) -> Option<Self::Item> {
        let mut buf = Vec::new();
        match std::io::Read::take(self.r.by_ref(), MAX_LINE_BYTES as u64 + 1).read_until(b'\n', &mut buf) {
            Ok(0) => None,
            Ok(_) => {
                if buf.last() == Some(&b'\n') {
                    buf.pop();
                    if buf.last() == Some(&b'\r') {
                        buf.pop();
                    }
                } else if buf.len() > MAX_LINE_BYTES {
                    return Some(Err(std::io::Error::new(
                        std::io::ErrorKind::InvalidData,
                        format!("a line longer than {MAX_LINE_BYTES} bytes: not a routing trace"),
                    )));
                }
                Some(String::from_utf8(buf).map_err(|_| {
                    std::io::Error::new(std::io::ErrorKind::InvalidData, "not UTF-8 text: not a routing trace")
                }))
            }
            Err(e) => Some(Err(e)),
        }
    }
}

/// A read error of line `n`: content errors name the line, others (a directory, a failing disk) the file.
fn line_error(e: std::io::Error, n: usize, path: &str) -> TraceError {
    if e.kind() == std::io::ErrorKind::InvalidData {
        TraceError::Format {
            path: path.to_string(),
            line: n,
            what: e.to_string(),
        }
    } else {
        TraceError::Io {
            path: path.to_string(),
            source: e,
        }
    }
}

/// Where `--routing-trace` takes its routing from: a trace file, or a trace generated at start for the model's
/// geometry by [`synth_trace`] (so a benchmark or a scenario needs no file):
///
/// - `synth:locality[:SEED]`: the published Qwen3-30B-A3B locality ([`SynthRouting::QWEN3_30B`]);
/// - `synth:uniform[:SEED]`: no locality ([`SynthRouting::RANDOM`]);
/// - anything else is a file (`./synth:locality` names a file of that name).
///
/// The seed defaults to 1 (`strata experts synth-trace`'s, so `synth:locality` replays what `synth-trace --tokens
/// 4096` writes for the model's geometry); the generated trace holds [`SYNTH_REPLAY_TOKENS`] tokens (fewer when
/// the model's geometry would pass [`MAX_LOOKUPS`]), replayed from the start again after its end.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RoutingSource {
    File(std::path::PathBuf),
    Synth { uniform: bool, seed: u64 },
}

/// Tokens of a trace `--routing-trace synth:...` generates (as many as `ci/device-test.sh` writes with synth-trace).
pub const SYNTH_REPLAY_TOKENS: u64 = 4096;

impl std::str::FromStr for RoutingSource {
    type Err = String;

    /// Errors: a `synth:` spec that is neither `locality` nor `uniform`, or whose seed is not a number (the
    /// message says what is expected).
    fn from_str(s: &str) -> Result<RoutingSource, String> {
        let Some(spec) = s.strip_prefix("synth:") else {
            if s.is_empty() {
                return Err("an empty path: give a routing trace file, synth:locality or synth:uniform".into());
            }
            return Ok(RoutingSource::File(s.into()));
        };
        let (kind, seed) = spec.split_once(':').unwrap_or((spec, "1"));
        let uniform = match kind {
            "locality" => false,
            "uniform" => true,
            _ => {
                return Err(format!(
                    "`{s}`: expected synth:locality or synth:uniform, optionally followed by :SEED (./{s} for a file of that name)"
                ));
            }
        };
        let seed = seed
            .parse()
            .map_err(|_| format!("`{s}`: the seed `{seed}` is not a whole number from 0 to {}", u64::MAX))?;
        Ok(RoutingSource::Synth { uniform, seed })
    }
}

impl std::fmt::Display for RoutingSource {
    /// The spec [`RoutingSource::from_str`](std::str::FromStr::from_str) reads back.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RoutingSource::File(p) if p.to_str().is_some_and(|s| s.starts_with("synth:")) => {
                write!(f, "./{}", p.display())
            }
            RoutingSource::File(p) => write!(f, "{}", p.display()),
            RoutingSource::Synth { uniform, seed } => {
                write!(f, "synth:{}:{seed}", if *uniform { "uniform" } else { "locality" })
            }
        }
    }
}

impl RoutingSource {
    /// The trace for a model of `n_layer` layers, top-`k` of `n_expert` experts: read from the file, or
    /// generated.
    ///
    /// Errors: the file cannot be read or is not a trace; the geometry is outside what a trace may hold.
    pub fn trace(&self, n_layer: u32, n_expert: u32, k: u32) -> Result<Trace, String> {
        match self {
            RoutingSource::File(p) => Trace::read(p).map_err(|e| e.to_string()),
            &RoutingSource::Synth { uniform, seed } => {
                if let Some(why) = geometry_error(n_layer, n_expert, k) {
                    return Err(why);
                }
                let tokens = SYNTH_REPLAY_TOKENS.min(MAX_LOOKUPS / (n_layer as u64 * k as u64));
                let r = if uniform {
                    SynthRouting::RANDOM
                } else {
                    SynthRouting::QWEN3_30B
                };
                Ok(synth_trace(n_layer, n_expert, k, tokens, r, seed))
            }
        }
    }
}

/// A trace replayed into a router (`--routing-trace`): each layer hands out its records' experts in trace order,
/// one record per routed token, starting over at the end. Benchmarks on random-weight models use it to route as a
/// real model does; the logits it gives are not the model's (the router's weights are kept for other experts).
#[derive(Debug, Clone)]
pub struct RoutingReplay {
    k: usize,
    /// Per layer, its records' experts, `k` per record.
    layers: Vec<Vec<u32>>,
    /// Per layer, the next record.
    next: Vec<usize>,
}

impl RoutingReplay {
    /// The replay of `trace` into a model of `n_layer` layers of `n_expert` experts choosing `k` each.
    ///
    /// Errors: the geometry differs from the model's, or a layer of the model has no record (as a message naming
    /// both).
    pub fn new(trace: &Trace, n_layer: u32, n_expert: u32, k: u32) -> Result<RoutingReplay, String> {
        let h = trace.header;
        if (h.n_layer, h.n_expert, h.k) != (n_layer, n_expert, k) {
            return Err(format!(
                "the trace routes {} layers of {} experts, top-{}; the model has {n_layer} layers of {n_expert} experts, top-{k}",
                h.n_layer, h.n_expert, h.k
            ));
        }
        let mut layers = vec![Vec::new(); n_layer as usize];
        for (i, &(_, layer, _)) in trace.records.iter().enumerate() {
            layers[layer as usize].extend_from_slice(trace.experts_of(i));
        }
        if let Some(l) = layers.iter().position(|v| v.is_empty()) {
            return Err(format!("the trace has no record of layer {l}"));
        }
        Ok(RoutingReplay {
            k: k as usize,
            next: vec![0; layers.len()],
            layers,
        })
    }

    /// The experts of the next `n_tok` tokens of `layer`, `[n_tok][k]`, written into `ids`.
    ///
    /// Panics if `layer` is outside the model.
    pub fn next(&mut self, layer: usize, n_tok: usize, ids: &mut Vec<u32>) {
        ids.clear();
        let recs = &self.layers[layer];
        let n = recs.len() / self.k;
        for _ in 0..n_tok {
            let r = self.next[layer];
            ids.extend_from_slice(&recs[r * self.k..(r + 1) * self.k]);
            self.next[layer] = (r + 1) % n;
        }
    }
}

/// A trace's first line.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TraceHeader {
    pub strata_routing_trace: u32,
    pub n_layer: u32,
    pub n_expert: u32,
    pub k: u32,
}

/// One record: the experts one token chose in one layer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TraceRecord {
    pub step: u64,
    pub layer: u32,
    pub token: u64,
    pub experts: Vec<u32>,
}

/// Why a trace could not be read or written; each names the file and, for content, the line.
#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    #[error("{path}: {source}")]
    Io { path: String, source: std::io::Error },
    #[error("{path}:{line}: {what}")]
    Format { path: String, line: usize, what: String },
}

/// A routing trace in memory: the header and the records, experts stored flat (`k` per record).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Trace {
    pub header: TraceHeader,
    /// `(step, layer, token)` per record.
    pub records: Vec<(u64, u32, u64)>,
    /// `k` experts per record, in record order.
    pub experts: Vec<u32>,
}

impl Trace {
    /// An empty trace of this geometry.
    pub fn new(n_layer: u32, n_expert: u32, k: u32) -> Trace {
        Trace {
            header: TraceHeader {
                strata_routing_trace: TRACE_VERSION,
                n_layer,
                n_expert,
                k,
            },
            records: Vec::new(),
            experts: Vec::new(),
        }
    }

    /// Appends a record.
    ///
    /// Panics if `experts` is not `k` experts of this model or `layer` is outside it (a caller bug: traces read
    /// from files are checked by [`Trace::read`]).
    pub fn push(&mut self, step: u64, layer: u32, token: u64, experts: &[u32]) {
        let h = &self.header;
        assert!(
            layer < h.n_layer && experts.len() == h.k as usize && experts.iter().all(|&e| e < h.n_expert),
            "trace record outside the model"
        );
        self.records.push((step, layer, token));
        self.experts.extend_from_slice(experts);
    }

    /// Record `i`'s experts.
    pub fn experts_of(&self, i: usize) -> &[u32] {
        let k = self.header.k as usize;
        &self.experts[i * k..(i + 1) * k]
    }

    /// Every lookup in order, as `layer * n_expert + expert` (the slot table's index).
    pub fn lookups(&self) -> impl Iterator<Item = usize> + '_ {
        let (n_expert, k) = (self.header.n_expert as usize, self.header.k as usize);
        self.records.iter().enumerate().flat_map(move |(i, &(_, layer, _))| {
            self.experts[i * k..(i + 1) * k]
                .iter()
                .map(move |&e| layer as usize * n_expert + e as usize)
        })
    }

    /// Writes the trace to `path`, replacing it whole ([`crate::paths::write_atomically`]: a failed write leaves
    /// what was there).
    ///
    /// Errors: the file cannot be written.
    pub fn write(&self, path: &Path) -> Result<(), TraceError> {
        crate::paths::write_atomically(path, |w| {
            line(w, &self.header)?;
            for (i, &(step, layer, token)) in self.records.iter().enumerate() {
                let r = TraceRecord {
                    step,
                    layer,
                    token,
                    experts: self.experts_of(i).to_vec(),
                };
                line(w, &r)?;
            }
            Ok(())
        })
        .map_err(|source| TraceError::Io {
            path: path.display().to_string(),
            source,
        })
    }

    /// Whether the file at `path` starts with a routing trace's header line (of any geometry): what may be
    /// replaced by a new trace without losing something else. `false` for a file that cannot be read, and for
    /// anything but a regular file (a FIFO is never opened: it would block).
    pub fn is_trace_file(path: &Path) -> bool {
        // Only a regular file is opened: a FIFO or a device would block or never end.
        if !std::fs::metadata(path).is_ok_and(|m| m.is_file()) {
            return false;
        }
        let Ok(mut f) = std::fs::File::open(path) else {
            return false;
        };
        let Ok(len) = f.metadata().map(|m| m.len()) else {
            return false;
        };
        first_and_last_lines(&mut f, len).is_ok_and(|(first, _)| serde_json::from_str::<TraceHeader>(&first).is_ok())
    }

    /// Reads a trace from `path`, checking every record against the header.
    ///
    /// Errors: the file cannot be read; a line that is not a header or record (with its line number), a version
    /// this build does not read, a record outside the model's geometry.
    pub fn read(path: &Path) -> Result<Trace, TraceError> {
        let p = path.display().to_string();
        let file = std::fs::File::open(path).map_err(|source| TraceError::Io {
            path: p.clone(),
            source,
        })?;
        let fmt = |line: usize, what: String| TraceError::Format {
            path: p.clone(),
            line,
            what,
        };
        let mut lines = BoundedLines {
            r: std::io::BufReader::new(file),
        };
        let first = lines
            .next()
            .ok_or_else(|| fmt(1, "empty file: a routing trace starts with its header line".into()))?
            .map_err(|e| line_error(e, 1, &p))?;
        let header: TraceHeader = serde_json::from_str(&first).map_err(|e| {
            fmt(
                1,
                format!(
                    "not a routing trace header ({e}); expected {{\"strata_routing_trace\":1,\"n_layer\":..,\"n_expert\":..,\"k\":..}}"
                ),
            )
        })?;
        if header.strata_routing_trace != TRACE_VERSION {
            return Err(fmt(
                1,
                format!(
                    "trace version {} is not the {TRACE_VERSION} this build reads",
                    header.strata_routing_trace
                ),
            ));
        }
        if let Some(what) = geometry_error(header.n_layer, header.n_expert, header.k) {
            return Err(fmt(1, what));
        }
        let mut t = Trace {
            header,
            records: Vec::new(),
            experts: Vec::new(),
        };
        for (i, line) in lines.enumerate() {
            let n = i + 2;
            let line = line.map_err(|e| line_error(e, n, &p))?;
            if line.trim().is_empty() {
                continue;
            }
            let r: TraceRecord = serde_json::from_str(&line).map_err(|e| fmt(n, e.to_string()))?;
            if r.layer >= header.n_layer {
                return Err(fmt(n, format!("layer {} of a {}-layer trace", r.layer, header.n_layer)));
            }
            if r.experts.len() != header.k as usize {
                return Err(fmt(
                    n,
                    format!("{} experts where the header says top-{}", r.experts.len(), header.k),
                ));
            }
            if let Some(e) = r.experts.iter().find(|&&e| e >= header.n_expert) {
                return Err(fmt(n, format!("expert {e} of {}", header.n_expert)));
            }
            if let Some((_, e)) = r.experts.iter().enumerate().find(|(i, e)| r.experts[..*i].contains(e)) {
                return Err(fmt(n, format!("expert {e} chosen twice in one record")));
            }
            if let Some(&(s0, l0, t0)) = t.records.last()
                && (r.step, r.layer, r.token) <= (s0, l0, t0)
            {
                return Err(fmt(
                    n,
                    format!(
                        "record (step {}, layer {}, token {}) is not after the one before it (step {s0}, layer {l0}, token {t0}): records go in lookup order, each once",
                        r.step, r.layer, r.token
                    ),
                ));
            }
            if (t.experts.len() as u64 + header.k as u64) > MAX_LOOKUPS {
                return Err(fmt(
                    n,
                    format!("more than {MAX_LOOKUPS} lookups: too long a trace to simulate in memory"),
                ));
            }
            t.records.push((r.step, r.layer, r.token));
            t.experts.extend_from_slice(&r.experts);
        }
        Ok(t)
    }
}

/// One JSON value and a line break: every line of a trace.
fn line(w: &mut impl Write, v: &impl Serialize) -> std::io::Result<()> {
    serde_json::to_writer(&mut *w, v)?;
    w.write_all(b"\n")
}

/// A routing trace written while the engine runs (`--dump-routing`): the header, then each forward step's records
/// as the step routes them. A file that already holds a trace of the same geometry is appended to, its steps
/// numbered on from the file's last (a restarted `strata serve` worker loses nothing).
pub struct TraceWriter {
    w: std::io::BufWriter<std::fs::File>,
    path: String,
    header: TraceHeader,
    /// The step the next [`TraceWriter::begin_step`] starts.
    next_step: u64,
    step: u64,
}

impl TraceWriter {
    /// Opens `path` for a model of this geometry: a new trace, or the trace already there continued.
    ///
    /// Errors: the file cannot be read or written; it holds something other than a trace of this geometry (named
    /// with what it holds).
    pub fn open(path: &Path, n_layer: u32, n_expert: u32, k: u32) -> Result<TraceWriter, TraceError> {
        let p = path.display().to_string();
        let io = |source| TraceError::Io {
            path: p.clone(),
            source,
        };
        let header = TraceHeader {
            strata_routing_trace: TRACE_VERSION,
            n_layer,
            n_expert,
            k,
        };
        let mut file = std::fs::OpenOptions::new()
            .read(true)
            .append(true)
            .create(true)
            .open(path)
            .map_err(io)?;
        // One writer per file: two runs appending at once would write two headers, or number their steps from
        // the same last one. The lock goes with the file (the process's exit releases it).
        file.try_lock().map_err(|e| match e {
            std::fs::TryLockError::WouldBlock => TraceError::Format {
                path: p.clone(),
                line: 0,
                what:
                    "another process is writing its routing to this file (it holds the file's lock): use another file"
                        .into(),
            },
            std::fs::TryLockError::Error(e) => io(e),
        })?;
        let len = file.metadata().map_err(io)?.len();
        let next_step = if len == 0 {
            0
        } else {
            let (first, last) = first_and_last_lines(&mut file, len).map_err(io)?;
            let fmt = |what: String| TraceError::Format {
                path: p.clone(),
                line: 1,
                what,
            };
            let theirs: TraceHeader = serde_json::from_str(&first).map_err(|e| {
                fmt(format!(
                    "not a routing trace ({e}): --dump-routing appends only to a trace"
                ))
            })?;
            if theirs != header {
                return Err(fmt(format!(
                    "a trace of {} layers x {} experts, top-{}; this model routes {n_layer} x {n_expert}, top-{k}: use another file",
                    theirs.n_layer, theirs.n_expert, theirs.k
                )));
            }
            match serde_json::from_str::<TraceRecord>(&last) {
                Ok(r) => r
                    .step
                    .checked_add(1)
                    .ok_or_else(|| fmt(format!("its last record is at step {}: no step can follow it", r.step)))?,
                Err(_) if last == first => 0,
                Err(e) => return Err(fmt(format!("its last line is not a record ({e})"))),
            }
        };
        let ends_in_newline = len == 0 || {
            use std::io::{Read, Seek, SeekFrom};
            let mut b = [0u8];
            file.seek(SeekFrom::Start(len - 1)).map_err(io)?;
            file.read_exact(&mut b).map_err(io)?;
            b[0] == b'\n'
        };
        let mut w = std::io::BufWriter::new(file);
        if len == 0 {
            line(&mut w, &header).map_err(io)?;
        } else if !ends_in_newline {
            // A file cut after its last record (or edited by hand): end that line before the next record.
            w.write_all(b"\n").map_err(io)?;
        }
        Ok(TraceWriter {
            w,
            path: p,
            header,
            next_step,
            step: next_step,
        })
    }

    /// Starts the records of the next forward step.
    pub fn begin_step(&mut self) {
        self.step = self.next_step;
        self.next_step = self.next_step.saturating_add(1);
    }

    /// Records that the token at position `token` chose `experts` (the router's top-k, in its order) at `layer`,
    /// in the current step.
    ///
    /// Errors: the write failed; the record is outside the header's geometry (a caller bug, reported as a
    /// format error rather than written).
    pub fn record(&mut self, layer: u32, token: u64, experts: &[u32]) -> Result<(), TraceError> {
        let h = &self.header;
        if layer >= h.n_layer || experts.len() != h.k as usize || experts.iter().any(|&e| e >= h.n_expert) {
            return Err(TraceError::Format {
                path: self.path.clone(),
                line: 0,
                what: format!("layer {layer}'s routing {experts:?} is outside the trace's geometry"),
            });
        }
        let r = TraceRecord {
            step: self.step,
            layer,
            token,
            experts: experts.to_vec(),
        };
        line(&mut self.w, &r).map_err(|source| TraceError::Io {
            path: self.path.clone(),
            source,
        })
    }

    /// Writes what is buffered to the file.
    ///
    /// Errors: the write failed.
    pub fn flush(&mut self) -> Result<(), TraceError> {
        self.w.flush().map_err(|source| TraceError::Io {
            path: self.path.clone(),
            source,
        })
    }
}

/// The first and the last non-empty line of a file of `len` bytes (at most [`MAX_LINE_BYTES`] each), read from
/// its start and its end.
fn first_and_last_lines(file: &mut std::fs::File, len: u64) -> std::io::Result<(String, String)> {
    use std::io::{Read, Seek, SeekFrom};
    let bad = || std::io::Error::new(std::io::ErrorKind::InvalidData, "not UTF-8 text: not a routing trace");
    let mut read_at = |at: u64, n: u64| -> std::io::Result<Vec<u8>> {
        file.seek(SeekFrom::Start(at))?;
        let mut buf = Vec::new();
        Read::by_ref(&mut *file).take(n).read_to_end(&mut buf)?;
        Ok(buf)
    };
    let cap = MAX_LINE_BYTES as u64 + 2;
    let head = read_at(0, cap.min(len))?;
    let first = head.split(|&b| b == b'\n').next().unwrap_or(&[]);
    let tail = read_at(len.saturating_sub(cap), cap.min(len))?;
    let last = tail
        .split(|&b| b == b'\n')
        .rev()
        .find(|l| !l.iter().all(u8::is_ascii_whitespace))
        .unwrap_or(&[]);
    let text = |b: &[u8]| {
        String::from_utf8(b.to_vec())
            .map(|s| s.trim_end().to_string())
            .map_err(|_| bad())
    };
    Ok((text(first)?, text(last)?))
}

/// What a trace's routing looks like, measured per layer over consecutive tokens (DESIGN.md section 5 gives
/// these figures for Qwen3-30B-A3B with real weights).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Locality {
    /// Of a token's experts, the fraction the previous token (same layer) also chose.
    pub reused_next: f64,
    /// Of a token's experts, the fraction one of the 8 previous tokens chose.
    pub reused_within_8: f64,
    /// Median distance, in tokens, back to an expert's previous use in its layer (over uses that had one).
    pub median_reuse_distance: f64,
}

impl Trace {
    /// Measures the trace's locality over one-token records (decode steps), layer by layer.
    pub fn locality(&self) -> Locality {
        let (n_layer, n_expert) = (self.header.n_layer as usize, self.header.n_expert as usize);
        // Per layer: the tokens seen so far (their index in the layer's sequence) and each expert's last use.
        let mut seq = vec![0usize; n_layer];
        let mut last = vec![usize::MAX; n_layer * n_expert];
        let (mut next, mut within8, mut total) = (0u64, 0u64, 0u64);
        let mut distances = Vec::new();
        for (i, &(_, layer, _)) in self.records.iter().enumerate() {
            let l = layer as usize;
            let t = seq[l];
            seq[l] += 1;
            for &e in self.experts_of(i) {
                let slot = &mut last[l * n_expert + e as usize];
                if t > 0 {
                    total += 1;
                    if *slot != usize::MAX {
                        let d = t - *slot;
                        next += (d == 1) as u64;
                        within8 += (d <= 8) as u64;
                        distances.push(d);
                    }
                }
                *slot = t;
            }
        }
        distances.sort_unstable();
        let frac = |x: u64| if total == 0 { 0.0 } else { x as f64 / total as f64 };
        Locality {
            reused_next: frac(next),
            reused_within_8: frac(within8),
            median_reuse_distance: distances.get(distances.len() / 2).map_or(0.0, |&d| d as f64),
        }
    }
}

/// How [`synth_trace`] chooses experts.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SynthRouting {
    /// Probability that one of a token's picks repeats an expert the previous token chose (per pick).
    pub reuse_next: f64,
    /// Probability that a pick repeats an expert of one of the tokens 2..=8 back.
    pub reuse_2_to_8: f64,
    /// Zipf exponent of fresh picks over the experts (0: uniform). Expert popularity is shuffled per layer.
    pub zipf: f64,
}

impl SynthRouting {
    /// Locality fitted to DESIGN.md section 5's published Qwen3-30B-A3B figures (45% of a token's experts reused
    /// at the next token, 80% within 8, median reuse distance 2) at top-8 of 128 experts; see the test
    /// `default_synth_trace_has_the_published_locality` for what it measures.
    pub const QWEN3_30B: SynthRouting = SynthRouting {
        reuse_next: 0.36,
        reuse_2_to_8: 0.42,
        zipf: 0.0,
    };

    /// No locality: every pick uniform over the experts (how a random-weight model routes).
    pub const RANDOM: SynthRouting = SynthRouting {
        reuse_next: 0.0,
        reuse_2_to_8: 0.0,
        zipf: 0.0,
    };
}

/// A decode trace of `tokens` one-token steps through `n_layer` layers, top-`k` of `n_expert` experts, with the
/// locality `r` asks for; deterministic in `seed`.
///
/// Panics unless the geometry passes [`geometry_error`], `tokens * n_layer * k` is at most [`MAX_LOOKUPS`], the
/// probabilities are in `0..=1` with a sum of at most 1, and `zipf` is finite and >= 0.
pub fn synth_trace(n_layer: u32, n_expert: u32, k: u32, tokens: u64, r: SynthRouting, seed: u64) -> Trace {
    assert!(geometry_error(n_layer, n_expert, k).is_none(), "trace geometry");
    assert!(
        tokens.saturating_mul(n_layer as u64 * k as u64) <= MAX_LOOKUPS,
        "trace length"
    );
    assert!(r.zipf.is_finite() && r.zipf >= 0.0, "zipf exponent");
    assert!(
        (0.0..=1.0).contains(&r.reuse_next)
            && (0.0..=1.0).contains(&r.reuse_2_to_8)
            && r.reuse_next + r.reuse_2_to_8 <= 1.0,
        "reuse probabilities"
    );
    let mut rng = SplitMix64::new(seed);
    let (n, kk) = (n_expert as usize, k as usize);
    // Per layer: a popularity order (a shuffled rank per expert) for Zipf picks.
    let ranks: Vec<Vec<u32>> = (0..n_layer)
        .map(|_| {
            let mut p: Vec<u32> = (0..n_expert).collect();
            for i in (1..n).rev() {
                p.swap(i, rng.below(i as u64 + 1) as usize);
            }
            p
        })
        .collect();
    // Zipf CDF over ranks.
    let weights: Vec<f64> = (1..=n).map(|i| (i as f64).powf(-r.zipf)).collect();
    let sum: f64 = weights.iter().sum();
    let cdf: Vec<f64> = weights
        .iter()
        .scan(0.0, |acc, w| {
            *acc += w / sum;
            Some(*acc)
        })
        .collect();
    // Per layer, the last 8 tokens' experts (most recent first).
    let mut history: Vec<std::collections::VecDeque<Vec<u32>>> = vec![Default::default(); n_layer as usize];
    let mut trace = Trace::new(n_layer, n_expert, k);
    let mut chosen: Vec<u32> = Vec::with_capacity(kk);
    for t in 0..tokens {
        for l in 0..n_layer as usize {
            chosen.clear();
            let h = &history[l];
            while chosen.len() < kk {
                let u = rng.unit();
                let from = if u < r.reuse_next {
                    h.front()
                } else if u < r.reuse_next + r.reuse_2_to_8 && h.len() > 1 {
                    h.get(1 + rng.below(h.len() as u64 - 1) as usize)
                } else {
                    None
                };
                let e = match from {
                    Some(prev) => prev[rng.below(prev.len() as u64) as usize],
                    None => {
                        // A fresh pick by popularity; after 32 draws that all hit chosen experts (a steep Zipf),
                        // the most popular expert not chosen yet.
                        let fresh = (0..32).find_map(|_| {
                            let u = rng.unit();
                            let e = ranks[l][cdf.partition_point(|&c| c < u).min(n - 1)];
                            (!chosen.contains(&e)).then_some(e)
                        });
                        fresh.unwrap_or_else(|| *ranks[l].iter().find(|e| !chosen.contains(e)).expect("k <= n_expert"))
                    }
                };
                if !chosen.contains(&e) {
                    chosen.push(e);
                }
            }
            trace.push(t, l as u32, t, &chosen);
            let h = &mut history[l];
            h.push_front(chosen.clone());
            h.truncate(8);
        }
    }
    trace
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_line_past_the_limit_is_an_error_naming_the_line_not_all_of_memory() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("t.jsonl");
        std::fs::write(&p, vec![b'x'; MAX_LINE_BYTES + 10]).unwrap();
        let e = Trace::read(&p).unwrap_err().to_string();
        assert!(e.contains(":1:") && e.contains("longer than"), "{e}");
        let mut t = Trace::new(2, 8, 2);
        t.push(0, 0, 0, &[1, 2]);
        t.write(&p).unwrap();
        let mut text = std::fs::read(&p).unwrap();
        text.extend(vec![b' '; MAX_LINE_BYTES + 1]);
        std::fs::write(&p, &text).unwrap();
        let e = Trace::read(&p).unwrap_err().to_string();
        assert!(e.contains(":3:") && e.contains("longer than"), "{e}");
        std::fs::write(&p, [0xffu8, 0xfe, b'\n']).unwrap();
        let e = Trace::read(&p).unwrap_err().to_string();
        assert!(e.contains(":1:") && e.contains("UTF-8"), "{e}");
    }

    #[test]
    fn a_replay_hands_out_each_layers_records_in_order_and_wraps() {
        let mut t = Trace::new(2, 8, 2);
        t.push(0, 0, 0, &[1, 2]);
        t.push(0, 1, 0, &[3, 4]);
        t.push(1, 0, 1, &[5, 6]);
        let mut r = RoutingReplay::new(&t, 2, 8, 2).unwrap();
        let mut ids = Vec::new();
        r.next(0, 3, &mut ids);
        assert_eq!(ids, [1, 2, 5, 6, 1, 2]);
        r.next(1, 2, &mut ids);
        assert_eq!(ids, [3, 4, 3, 4]);
        r.next(0, 1, &mut ids);
        assert_eq!(ids, [5, 6]);
        assert!(RoutingReplay::new(&t, 2, 16, 2).unwrap_err().contains("16 experts"));
        let mut one_layer = Trace::new(2, 8, 2);
        one_layer.push(0, 0, 0, &[1, 2]);
        assert!(RoutingReplay::new(&one_layer, 2, 8, 2).unwrap_err().contains("layer 1"));
    }

    #[test]
    fn a_trace_round_trips_through_its_file() {
        let t = synth_trace(3, 16, 4, 20, SynthRouting::QWEN3_30B, 7);
        assert_eq!(t.records.len(), 60);
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("t.jsonl");
        t.write(&p).unwrap();
        assert_eq!(Trace::read(&p).unwrap(), t);
        let first = std::fs::read_to_string(&p).unwrap();
        assert!(first.starts_with("{\"strata_routing_trace\":1,\"n_layer\":3,\"n_expert\":16,\"k\":4}\n"));
    }

    #[test]
    fn a_dump_writes_a_trace_that_reads_back_and_appends_after_its_last_step() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("dump.jsonl");
        let mut w = TraceWriter::open(&path, 2, 8, 2).unwrap();
        for step_tokens in [&[0u64, 1, 2][..], &[3]] {
            w.begin_step();
            for layer in 0..2 {
                for &t in step_tokens {
                    w.record(layer, t, &[(t % 8) as u32, ((t + 1 + layer as u64) % 8) as u32])
                        .unwrap();
                }
            }
        }
        w.flush().unwrap();
        drop(w);
        let t = Trace::read(&path).unwrap();
        assert_eq!((t.header.n_layer, t.header.n_expert, t.header.k), (2, 8, 2));
        assert_eq!(t.records.len(), 8);
        assert_eq!(t.records[6], (1, 0, 3));
        assert_eq!(t.experts_of(7), &[3, 5]);
        // Reopened, it goes on after step 1; the whole file still reads as one trace.
        let mut w = TraceWriter::open(&path, 2, 8, 2).unwrap();
        w.begin_step();
        w.record(0, 4, &[6, 7]).unwrap();
        w.record(1, 4, &[7, 0]).unwrap();
        w.flush().unwrap();
        drop(w);
        let t = Trace::read(&path).unwrap();
        assert_eq!(t.records.len(), 10);
        assert_eq!(t.records[8], (2, 0, 4));
        // A header alone (a dump that routed nothing yet) starts at step 0.
        let fresh = dir.path().join("fresh.jsonl");
        drop(TraceWriter::open(&fresh, 2, 8, 2).unwrap());
        let mut w = TraceWriter::open(&fresh, 2, 8, 2).unwrap();
        w.begin_step();
        w.record(0, 0, &[1, 2]).unwrap();
        w.flush().unwrap();
        assert_eq!(Trace::read(&fresh).unwrap().records[0], (0, 0, 0));
        // A record outside the geometry is refused, not written.
        assert!(w.record(2, 0, &[1, 2]).is_err() && w.record(0, 0, &[1, 9]).is_err() && w.record(0, 0, &[1]).is_err());
    }

    #[test]
    fn a_dump_ends_a_cut_last_line_refuses_a_second_writer_and_a_last_step() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("cut.jsonl");
        std::fs::write(
            &path,
            "{\"strata_routing_trace\":1,\"n_layer\":2,\"n_expert\":8,\"k\":2}\n{\"step\":4,\"layer\":0,\"token\":0,\"experts\":[1,2]}",
        )
        .unwrap();
        let mut w = TraceWriter::open(&path, 2, 8, 2).unwrap();
        // While it is open, a second writer is refused by name instead of interleaving.
        let e = TraceWriter::open(&path, 2, 8, 2).err().unwrap().to_string();
        assert!(
            e.contains("another process is writing") && e.contains("cut.jsonl"),
            "{e}"
        );
        w.begin_step();
        w.record(0, 1, &[3, 4]).unwrap();
        w.flush().unwrap();
        drop(w);
        let t = Trace::read(&path).unwrap();
        assert_eq!(t.records, vec![(4, 0, 0), (5, 0, 1)]);
        // A last step no step can follow.
        let end = dir.path().join("end.jsonl");
        std::fs::write(
            &end,
            format!("{{\"strata_routing_trace\":1,\"n_layer\":2,\"n_expert\":8,\"k\":2}}\n{{\"step\":{},\"layer\":0,\"token\":0,\"experts\":[1,2]}}\n", u64::MAX),
        )
        .unwrap();
        let e = TraceWriter::open(&end, 2, 8, 2).err().unwrap().to_string();
        assert!(e.contains("no step can follow"), "{e}");
    }

    #[test]
    fn a_dump_refuses_a_file_that_is_not_this_models_trace() {
        let dir = tempfile::tempdir().unwrap();
        let other = dir.path().join("other.jsonl");
        drop(TraceWriter::open(&other, 4, 16, 4).unwrap());
        let e = TraceWriter::open(&other, 2, 8, 2).err().unwrap().to_string();
        assert!(
            e.contains("4 layers x 16 experts, top-4") && e.contains("2 x 8, top-2"),
            "{e}"
        );
        let text = dir.path().join("notes.txt");
        std::fs::write(&text, "my notes\n").unwrap();
        let e = TraceWriter::open(&text, 2, 8, 2).err().unwrap().to_string();
        assert!(e.contains("notes.txt") && e.contains("not a routing trace"), "{e}");
        assert_eq!(
            std::fs::read_to_string(&text).unwrap(),
            "my notes\n",
            "the file was left alone"
        );
        let e = TraceWriter::open(dir.path(), 2, 8, 2).err().unwrap().to_string();
        assert!(e.contains(&dir.path().display().to_string()), "{e}");
    }

    #[test]
    fn bad_lines_are_named_with_their_number() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("t.jsonl");
        let head = "{\"strata_routing_trace\":1,\"n_layer\":2,\"n_expert\":8,\"k\":2}\n";
        for (body, want) in [
            (
                "{\"step\":0,\"layer\":0,\"token\":0,\"experts\":[1,2]}\n{\"step\":1,\"layer\":2,\"token\":0,\"experts\":[1,2]}\n",
                ":3: layer 2 of a 2-layer trace",
            ),
            (
                "{\"step\":0,\"layer\":0,\"token\":0,\"experts\":[1]}\n",
                ":2: 1 experts where the header says top-2",
            ),
            (
                "{\"step\":0,\"layer\":0,\"token\":0,\"experts\":[1,9]}\n",
                ":2: expert 9 of 8",
            ),
            (
                "{\"step\":0,\"layer\":0,\"token\":0,\"experts\":[1,2],\"x\":1}\n",
                ":2: unknown field `x`",
            ),
            ("not json\n", ":2: expected"),
            (
                "{\"step\":0,\"layer\":0,\"token\":0,\"experts\":[3,3]}\n",
                ":2: expert 3 chosen twice",
            ),
            (
                "{\"step\":1,\"layer\":0,\"token\":0,\"experts\":[1,2]}\n{\"step\":0,\"layer\":1,\"token\":0,\"experts\":[1,2]}\n",
                ":3: record (step 0, layer 1, token 0) is not after",
            ),
            (
                "{\"step\":0,\"layer\":0,\"token\":0,\"experts\":[1,2]}\n{\"step\":0,\"layer\":0,\"token\":0,\"experts\":[1,2]}\n",
                ":3: record (step 0, layer 0, token 0) is not after",
            ),
        ] {
            std::fs::write(&p, format!("{head}{body}")).unwrap();
            let e = Trace::read(&p).unwrap_err().to_string();
            assert!(e.contains(want), "{e}");
        }
        std::fs::write(
            &p,
            "{\"strata_routing_trace\":2,\"n_layer\":2,\"n_expert\":8,\"k\":2}\n",
        )
        .unwrap();
        assert!(Trace::read(&p).unwrap_err().to_string().contains(":1: trace version 2"));
        std::fs::write(&p, "").unwrap();
        assert!(Trace::read(&p).unwrap_err().to_string().contains(":1: empty file"));
        // A header whose slot table alone would take gigabytes is refused before anything is allocated.
        std::fs::write(
            &p,
            "{\"strata_routing_trace\":1,\"n_layer\":4294967295,\"n_expert\":16,\"k\":4}\n",
        )
        .unwrap();
        assert!(
            Trace::read(&p)
                .unwrap_err()
                .to_string()
                .contains(":1: 4294967295 layers x 16 experts")
        );
    }

    /// The default locality model, measured on a 48-layer, top-8 of 128 trace, is within a few points of the
    /// published Qwen3-30B-A3B figures (45% at the next token, 80% within 8, median distance 2); a random trace
    /// has the locality of chance (8/128 = 6% at the next token).
    #[test]
    fn default_synth_trace_has_the_published_locality() {
        let l = synth_trace(48, 128, 8, 400, SynthRouting::QWEN3_30B, 1).locality();
        assert!((0.43..=0.48).contains(&l.reused_next), "{l:?}");
        assert!((0.77..=0.83).contains(&l.reused_within_8), "{l:?}");
        assert!(l.median_reuse_distance <= 2.0, "{l:?}");
        let r = synth_trace(48, 128, 8, 400, SynthRouting::RANDOM, 1).locality();
        assert!((0.04..=0.08).contains(&r.reused_next), "{r:?}");
        // A steep Zipf still finds k distinct experts (the most popular ones), in bounded time.
        let steep = SynthRouting {
            zipf: 1e6,
            ..SynthRouting::RANDOM
        };
        let t = synth_trace(2, 128, 8, 10, steep, 1);
        assert!(t.locality().reused_next > 0.99);
    }

    /// `--routing-trace` specs: `synth:` generates for the model's geometry (the same trace `strata experts
    /// synth-trace` writes with that seed), a file is a file, and bad specs say what is expected.
    #[test]
    fn routing_sources_parse_print_and_generate() {
        use std::str::FromStr;
        for (spec, want) in [
            (
                "synth:locality",
                RoutingSource::Synth {
                    uniform: false,
                    seed: 1,
                },
            ),
            ("synth:uniform:7", RoutingSource::Synth { uniform: true, seed: 7 }),
            ("t.jsonl", RoutingSource::File("t.jsonl".into())),
            ("./synth:locality", RoutingSource::File("./synth:locality".into())),
        ] {
            let got = RoutingSource::from_str(spec).unwrap();
            assert_eq!(got, want, "{spec}");
            assert_eq!(
                RoutingSource::from_str(&got.to_string()).unwrap(),
                got,
                "{spec} printed as {got}"
            );
        }
        assert_eq!(
            RoutingSource::File("synth:x".into()).to_string(),
            "./synth:x",
            "a file whose name looks like a spec prints as a path"
        );
        for bad in ["synth:", "synth:zipf", "synth:uniform:-1", "synth:locality:x", ""] {
            let e = RoutingSource::from_str(bad).unwrap_err();
            assert!(e.contains("synth:locality") || e.contains("seed"), "{bad}: {e}");
        }
        let t = RoutingSource::Synth {
            uniform: false,
            seed: 3,
        }
        .trace(4, 32, 2)
        .unwrap();
        assert_eq!(
            t,
            synth_trace(4, 32, 2, SYNTH_REPLAY_TOKENS, SynthRouting::QWEN3_30B, 3)
        );
        let u = RoutingSource::Synth { uniform: true, seed: 3 }.trace(4, 32, 2).unwrap();
        assert_eq!(u, synth_trace(4, 32, 2, SYNTH_REPLAY_TOKENS, SynthRouting::RANDOM, 3));
        assert_ne!(t, u);
        assert!(RoutingSource::Synth { uniform: true, seed: 0 }.trace(0, 32, 2).is_err());
        let e = RoutingSource::File("/nonexistent/t.jsonl".into())
            .trace(4, 32, 2)
            .unwrap_err();
        assert!(e.contains("/nonexistent/t.jsonl"), "{e}");
    }

    /// A FIFO (or a folder) is not a trace, and asking does not block on it.
    #[test]
    fn a_fifo_is_not_a_trace_and_is_not_opened() {
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("fifo");
        let made = std::process::Command::new("mkfifo").arg(&fifo).status();
        if made.is_ok_and(|s| s.success()) {
            assert!(!Trace::is_trace_file(&fifo));
        }
        assert!(!Trace::is_trace_file(dir.path()));
    }
}
