//! Captures during a run: memory samples on a timer (host RSS of the server and its worker, and the host's
//! MemAvailable, via sysinfo), and the worker's structured events read back from its `--events` file.

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use sysinfo::{Pid, ProcessRefreshKind, ProcessesToUpdate, System};

/// One memory reading.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct MemorySample {
    /// Milliseconds since the run started.
    pub t_ms: u64,
    /// Resident set of the `strata serve` front, bytes.
    pub serve_rss_bytes: u64,
    /// Resident set of the engine worker, bytes (0 while none runs).
    pub worker_rss_bytes: u64,
    /// The host's available memory (MemAvailable), bytes.
    pub mem_available_bytes: u64,
}

/// A background sampler; [`MemorySampler::finish`] stops it and returns its samples.
pub struct MemorySampler {
    stop: Arc<AtomicBool>,
    /// The worker's pid, kept current by the runner (0: unknown).
    pub worker_pid: Arc<AtomicU32>,
    handle: JoinHandle<Vec<MemorySample>>,
}

impl MemorySampler {
    /// Starts sampling the server `serve_pid` every `period`, with times relative to `epoch`.
    pub fn start(serve_pid: u32, period: Duration, epoch: Instant) -> MemorySampler {
        let stop = Arc::new(AtomicBool::new(false));
        let worker_pid = Arc::new(AtomicU32::new(0));
        let (s, w) = (stop.clone(), worker_pid.clone());
        let handle = std::thread::spawn(move || {
            let mut sys = System::new();
            let mut out = Vec::new();
            while !s.load(Ordering::Relaxed) {
                let wp = w.load(Ordering::Relaxed);
                let pids = [Pid::from_u32(serve_pid), Pid::from_u32(wp)];
                // A server that computes in its own process (llama-server) is its own worker.
                let n = if wp == 0 || wp == serve_pid { 1 } else { 2 };
                sys.refresh_processes_specifics(
                    ProcessesToUpdate::Some(&pids[..n]),
                    true,
                    ProcessRefreshKind::nothing().with_memory(),
                );
                sys.refresh_memory();
                let rss = |p: Pid| sys.process(p).map_or(0, |p| p.memory());
                out.push(MemorySample {
                    t_ms: epoch.elapsed().as_millis() as u64,
                    serve_rss_bytes: rss(pids[0]),
                    worker_rss_bytes: if wp == 0 { 0 } else { rss(pids[1]) },
                    mem_available_bytes: sys.available_memory(),
                });
                std::thread::sleep(period);
            }
            out
        });
        MemorySampler {
            stop,
            worker_pid,
            handle,
        }
    }

    /// Stops the sampler and returns every sample taken.
    pub fn finish(self) -> Vec<MemorySample> {
        self.stop.store(true, Ordering::Relaxed);
        self.handle.join().unwrap_or_default()
    }
}

/// Reads an `--events` file: one JSON object per line; lines that are not JSON objects are skipped.
pub fn read_events(path: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v.is_object())
        .collect()
}

/// Counts events by kind (`event` field).
pub fn count_events(events: &[serde_json::Value]) -> std::collections::BTreeMap<String, u64> {
    let mut m = std::collections::BTreeMap::new();
    for e in events {
        if let Some(k) = e["event"].as_str() {
            *m.entry(k.to_string()).or_insert(0) += 1;
        }
    }
    m
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_are_read_and_counted() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("e.jsonl");
        std::fs::write(
            &p,
            "{\"event\":\"load\",\"v\":1}\nnot json\n{\"event\":\"fallback\"}\n{\"event\":\"load\"}\n[1]\n",
        )
        .unwrap();
        let ev = read_events(&p);
        assert_eq!(ev.len(), 3);
        let c = count_events(&ev);
        assert_eq!(c.get("load"), Some(&2));
        assert_eq!(c.get("fallback"), Some(&1));
    }

    #[test]
    fn sampler_reads_this_process() {
        let s = MemorySampler::start(std::process::id(), Duration::from_millis(10), Instant::now());
        std::thread::sleep(Duration::from_millis(60));
        let v = s.finish();
        assert!(!v.is_empty());
        assert!(v[0].serve_rss_bytes > 0 && v[0].mem_available_bytes > 0, "{v:?}");
    }
}
