//! `GET /metrics`: the server's counters in the Prometheus text format (the `prometheus` crate's registry and
//! encoder).

use prometheus::{Encoder, Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge, Opts, Registry, TextEncoder};

use super::protocol::Timings;

/// Every metric `strata serve` exports, registered in one registry. Names carry their unit (`_seconds`,
/// `_total`).
pub struct Metrics {
    registry: Registry,
    /// `strata_requests_total{endpoint, status}`: HTTP requests answered, by route and status code.
    pub requests: IntCounterVec,
    /// `strata_prompt_tokens_total`: prompt tokens of completed requests (computed plus reused).
    pub prompt_tokens: IntCounter,
    /// `strata_prompt_tokens_reused_total`: prompt tokens reused from the KV cache.
    pub prompt_tokens_reused: IntCounter,
    /// `strata_generated_tokens_total`.
    pub generated_tokens: IntCounter,
    /// `strata_prefill_seconds`: prefill time per request.
    pub prefill_seconds: Histogram,
    /// `strata_decode_seconds`: decode time per request.
    pub decode_seconds: Histogram,
    /// `strata_queue_depth`: requests waiting for a slot (`--parallel` are computed at once).
    pub queue_depth: IntGauge,
    /// `strata_requests_running`: requests in a slot of the engine (at most `--parallel`).
    pub running: IntGauge,
    /// `strata_batch_size`: per request, the sequences per forward step over the steps that computed it (its
    /// `request` event's `batch_mean`; 1 when it ran alone).
    pub batch_size: Histogram,
    /// `strata_kv_blocks_used`: KV blocks (16 tokens of every layer) the slots' caches hold, a shared block once.
    pub kv_blocks_used: IntGauge,
    /// `strata_kv_blocks_total`: blocks the KV pool may hold (`--kv-tokens`).
    pub kv_blocks_total: IntGauge,
    /// `strata_kv_blocks_shared`: blocks held by several slots (a common prompt prefix, computed once).
    pub kv_blocks_shared: IntGauge,
    /// `strata_kv_preemptions_total`: times completed requests were preempted for KV blocks and computed again.
    pub kv_preemptions: IntCounter,
    /// `strata_requests_preempted`: preempted requests waiting for KV blocks to go on.
    pub preempted: IntGauge,
    /// `strata_queue_rejected_total`: requests answered 503 because the queue was full.
    pub queue_rejected: IntCounter,
    /// `strata_connections_refused_total`: connections closed at once because the connection limit was reached.
    pub connections_refused: IntCounter,
    /// `strata_worker_restarts_total`: worker deaths, each followed by a restart.
    pub worker_restarts: IntCounter,
    /// `strata_worker_deaths_total{cause}`: the same deaths by cause (`exit_code_N`, `signal_N`, `watchdog`).
    pub worker_deaths: IntCounterVec,
    /// `strata_worker_faults_total`: worker deaths that sent a `fault` event first.
    pub worker_faults: IntCounter,
    /// `strata_worker_ready`: 1 while a loaded worker is serving.
    pub worker_ready: IntGauge,
    /// `strata_requests_cancelled_total`: requests whose client went away before the end.
    pub cancelled: IntCounter,
    /// `strata_expert_cache_lookups_total{phase}`: (layer, expert) lookups of the VRAM expert cache, by phase
    /// (`prefill`, `decode`).
    pub expert_cache_lookups: IntCounterVec,
    /// `strata_expert_cache_hits_total{phase}`.
    pub expert_cache_hits: IntCounterVec,
    /// `strata_expert_cache_uploaded_bytes_total{phase}`: bytes copied from host memory to the device.
    pub expert_cache_uploaded_bytes: IntCounterVec,
    /// `strata_expert_cache_cpu_computed_total{phase}`: misses the CPU computed instead of uploading them.
    pub expert_cache_cpu_computed: IntCounterVec,
    /// `strata_expert_cache_prefetched_total{phase}`: experts `--expert-prefetch` copied in ahead of their layer.
    pub expert_cache_prefetched: IntCounterVec,
    /// `strata_expert_cache_prefetch_used_total{phase}`: prefetched experts their layer then used.
    pub expert_cache_prefetch_used: IntCounterVec,
    /// `strata_expert_cache_stage_lookups_total{stage,phase}`: on a layer split, each stage's own cache
    /// (`stage` as the log names it: `cuda:1 (layers 24-47)`); no series on one card.
    pub expert_cache_stage_lookups: IntCounterVec,
    /// `strata_expert_cache_stage_hits_total{stage,phase}`.
    pub expert_cache_stage_hits: IntCounterVec,
    /// `strata_expert_cache_stage_uploaded_bytes_total{stage,phase}`: bytes copied from host memory to the
    /// stage's card.
    pub expert_cache_stage_uploaded_bytes: IntCounterVec,
}

impl Metrics {
    /// A fresh registry with every metric at zero.
    pub fn new() -> Metrics {
        let registry = Registry::new();
        let requests = IntCounterVec::new(
            Opts::new(
                "strata_requests_total",
                "HTTP requests answered, by endpoint and status code",
            ),
            &["endpoint", "status"],
        )
        .expect("valid metric");
        let counter = |name: &str, help: &str| IntCounter::new(name, help).expect("valid metric");
        let seconds = |name: &str, help: &str| {
            Histogram::with_opts(HistogramOpts::new(name, help).buckets(vec![
                0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
            ]))
            .expect("valid metric")
        };
        let by_phase =
            |name: &str, help: &str| IntCounterVec::new(Opts::new(name, help), &["phase"]).expect("valid metric");
        let by_stage = |name: &str, help: &str| {
            IntCounterVec::new(Opts::new(name, help), &["stage", "phase"]).expect("valid metric")
        };
        let m = Metrics {
            expert_cache_stage_lookups: by_stage(
                "strata_expert_cache_stage_lookups_total",
                "lookups of (layer, expert) in one layer-split stage's expert cache, by stage and phase",
            ),
            expert_cache_stage_hits: by_stage(
                "strata_expert_cache_stage_hits_total",
                "a layer-split stage's expert cache lookups that hit, by stage and phase",
            ),
            expert_cache_stage_uploaded_bytes: by_stage(
                "strata_expert_cache_stage_uploaded_bytes_total",
                "bytes of experts copied from host memory to a layer-split stage's card, by stage and phase",
            ),
            expert_cache_lookups: by_phase(
                "strata_expert_cache_lookups_total",
                "lookups of (layer, expert) in the VRAM expert cache, by phase",
            ),
            expert_cache_hits: by_phase(
                "strata_expert_cache_hits_total",
                "expert cache lookups that hit, by phase",
            ),
            expert_cache_uploaded_bytes: by_phase(
                "strata_expert_cache_uploaded_bytes_total",
                "bytes of experts copied from host memory to the device, by phase",
            ),
            expert_cache_cpu_computed: by_phase(
                "strata_expert_cache_cpu_computed_total",
                "expert cache misses computed by the CPU instead of uploaded, by phase",
            ),
            expert_cache_prefetched: by_phase(
                "strata_expert_cache_prefetched_total",
                "experts prefetched into the expert cache ahead of their layer, by phase",
            ),
            expert_cache_prefetch_used: by_phase(
                "strata_expert_cache_prefetch_used_total",
                "prefetched experts their layer then used, by phase",
            ),
            requests,
            prompt_tokens: counter("strata_prompt_tokens_total", "prompt tokens of completed requests"),
            prompt_tokens_reused: counter(
                "strata_prompt_tokens_reused_total",
                "prompt tokens reused from the KV cache",
            ),
            generated_tokens: counter("strata_generated_tokens_total", "tokens generated"),
            prefill_seconds: seconds("strata_prefill_seconds", "prefill time per request, seconds"),
            decode_seconds: seconds("strata_decode_seconds", "decode time per request, seconds"),
            queue_depth: IntGauge::new("strata_queue_depth", "requests waiting for a slot of the engine")
                .expect("valid metric"),
            running: IntGauge::new("strata_requests_running", "requests in a slot of the engine")
                .expect("valid metric"),
            batch_size: Histogram::with_opts(
                HistogramOpts::new(
                    "strata_batch_size",
                    "sequences per forward step over each request's steps (1: it ran alone)",
                )
                .buckets(vec![1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0, 24.0, 32.0, 64.0]),
            )
            .expect("valid metric"),
            kv_blocks_used: IntGauge::new(
                "strata_kv_blocks_used",
                "KV blocks of 16 tokens the slots' caches hold (a shared block once)",
            )
            .expect("valid metric"),
            kv_blocks_total: IntGauge::new("strata_kv_blocks_total", "KV blocks the pool may hold (--kv-tokens)")
                .expect("valid metric"),
            kv_blocks_shared: IntGauge::new(
                "strata_kv_blocks_shared",
                "KV blocks held by several slots (a common prompt prefix)",
            )
            .expect("valid metric"),
            preempted: IntGauge::new(
                "strata_requests_preempted",
                "preempted requests waiting for KV blocks to go on",
            )
            .expect("valid metric"),
            kv_preemptions: counter(
                "strata_kv_preemptions_total",
                "times completed requests were preempted for KV blocks and computed again",
            ),
            queue_rejected: counter(
                "strata_queue_rejected_total",
                "requests refused because the queue was full",
            ),
            connections_refused: counter(
                "strata_connections_refused_total",
                "connections closed at once because the connection limit was reached",
            ),
            worker_restarts: counter(
                "strata_worker_restarts_total",
                "engine worker deaths, each followed by a restart",
            ),
            worker_deaths: IntCounterVec::new(
                Opts::new("strata_worker_deaths_total", "engine worker deaths by cause"),
                &["cause"],
            )
            .expect("valid metric"),
            worker_faults: counter("strata_worker_faults_total", "worker deaths preceded by a fault event"),
            worker_ready: IntGauge::new("strata_worker_ready", "1 while a loaded engine worker serves")
                .expect("valid metric"),
            cancelled: counter(
                "strata_requests_cancelled_total",
                "requests whose client went away first",
            ),
            registry,
        };
        // Both phases from the start, at 0: a dashboard reads 0 rather than no data before the first request
        // (and on a device without an expert cache).
        for c in [
            &m.expert_cache_lookups,
            &m.expert_cache_hits,
            &m.expert_cache_uploaded_bytes,
            &m.expert_cache_cpu_computed,
            &m.expert_cache_prefetched,
            &m.expert_cache_prefetch_used,
        ] {
            for phase in ["prefill", "decode"] {
                c.with_label_values(&[phase]);
            }
        }
        let r = &m.registry;
        let all: [Box<dyn prometheus::core::Collector>; 30] = [
            Box::new(m.expert_cache_stage_lookups.clone()),
            Box::new(m.expert_cache_stage_hits.clone()),
            Box::new(m.expert_cache_stage_uploaded_bytes.clone()),
            Box::new(m.preempted.clone()),
            Box::new(m.kv_blocks_used.clone()),
            Box::new(m.kv_blocks_total.clone()),
            Box::new(m.kv_blocks_shared.clone()),
            Box::new(m.kv_preemptions.clone()),
            Box::new(m.expert_cache_lookups.clone()),
            Box::new(m.expert_cache_cpu_computed.clone()),
            Box::new(m.expert_cache_prefetched.clone()),
            Box::new(m.expert_cache_prefetch_used.clone()),
            Box::new(m.expert_cache_hits.clone()),
            Box::new(m.expert_cache_uploaded_bytes.clone()),
            Box::new(m.requests.clone()),
            Box::new(m.prompt_tokens.clone()),
            Box::new(m.prompt_tokens_reused.clone()),
            Box::new(m.generated_tokens.clone()),
            Box::new(m.prefill_seconds.clone()),
            Box::new(m.decode_seconds.clone()),
            Box::new(m.queue_depth.clone()),
            Box::new(m.running.clone()),
            Box::new(m.batch_size.clone()),
            Box::new(m.queue_rejected.clone()),
            Box::new(m.connections_refused.clone()),
            Box::new(m.worker_restarts.clone()),
            Box::new(m.worker_deaths.clone()),
            Box::new(m.worker_faults.clone()),
            Box::new(m.worker_ready.clone()),
            Box::new(m.cancelled.clone()),
        ];
        for c in all {
            r.register(c).expect("metric names are unique");
        }
        m
    }

    /// Sets the KV pool's gauges to the worker's last report (a pool with no limit shows its total as 0).
    pub fn record_kv(&self, u: &crate::runtime::batch::KvUsage) {
        let g = |n: usize| i64::try_from(n).unwrap_or(i64::MAX);
        self.kv_blocks_used.set(g(u.blocks_used));
        self.kv_blocks_total.set(g(u.blocks_total.unwrap_or(0)));
        self.kv_blocks_shared.set(g(u.blocks_shared));
        self.preempted.set(g(u.waiting_preempted));
    }

    /// Zeroes the gauges of a worker that stopped (requests running, preempted requests, KV blocks used and
    /// shared): its slots and caches went with it. The pool's total stays (the next worker's is the same).
    pub fn clear_worker_state(&self) {
        self.running.set(0);
        self.kv_blocks_used.set(0);
        self.kv_blocks_shared.set(0);
        self.preempted.set(0);
    }

    /// Adds one completed request's counts and times.
    pub fn record_timings(&self, t: &Timings) {
        self.prompt_tokens.inc_by(t.prompt_tokens() as u64);
        self.prompt_tokens_reused.inc_by(t.cache_n as u64);
        self.generated_tokens.inc_by(t.predicted_n as u64);
        self.prefill_seconds.observe(t.prompt_ms / 1e3);
        self.decode_seconds.observe(t.predicted_ms / 1e3);
    }

    /// Adds what the expert cache did in one phase of a request (an `expert_cache` event).
    pub fn record_expert_cache(&self, c: &crate::events::ExpertCache) {
        let phase = [c.phase.as_str()];
        self.expert_cache_lookups.with_label_values(&phase).inc_by(c.lookups);
        self.expert_cache_hits.with_label_values(&phase).inc_by(c.hits);
        self.expert_cache_uploaded_bytes
            .with_label_values(&phase)
            .inc_by(c.bytes_uploaded);
        self.expert_cache_cpu_computed
            .with_label_values(&phase)
            .inc_by(c.cpu_computed);
        self.expert_cache_prefetched
            .with_label_values(&phase)
            .inc_by(c.prefetched);
        self.expert_cache_prefetch_used
            .with_label_values(&phase)
            .inc_by(c.prefetch_used);
        for s in &c.stages {
            let l = [s.stage.as_str(), c.phase.as_str()];
            self.expert_cache_stage_lookups.with_label_values(&l).inc_by(s.lookups);
            self.expert_cache_stage_hits.with_label_values(&l).inc_by(s.hits);
            self.expert_cache_stage_uploaded_bytes
                .with_label_values(&l)
                .inc_by(s.bytes_uploaded);
        }
    }

    /// The registry in the Prometheus text exposition format (version 0.0.4).
    pub fn render(&self) -> String {
        let mut buf = Vec::new();
        TextEncoder::new()
            .encode(&self.registry.gather(), &mut buf)
            .expect("text encoding does not fail");
        String::from_utf8(buf).expect("the text format is UTF-8")
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn expert_cache_events_add_up_by_phase() {
        let m = Metrics::new();
        // Every phase's series exists at 0 before any event.
        let fresh = m.render();
        for line in [
            r#"strata_expert_cache_lookups_total{phase="decode"} 0"#,
            r#"strata_expert_cache_cpu_computed_total{phase="prefill"} 0"#,
        ] {
            assert!(fresh.contains(line), "{line} missing from\n{fresh}");
        }
        let ev = |phase: &str, lookups, hits, bytes| crate::events::ExpertCache {
            request: Some(1),
            phase: phase.into(),
            lookups,
            hits,
            admitted: lookups - hits,
            staged: 0,
            evictions: 0,
            bytes_uploaded: bytes,
            cpu_computed: lookups / 10,
            prefetched: lookups / 5,
            prefetch_used: lookups / 25,
            stages: Vec::new(),
        };
        assert!(!fresh.contains("strata_expert_cache_stage_lookups_total{"), "{fresh}");
        // A layer split's event: its stages' counts go to their own series, the totals as on one card.
        let stage = |s: &str, lookups, hits, bytes| crate::events::StageCache {
            stage: s.into(),
            lookups,
            hits,
            bytes_uploaded: bytes,
            cpu_computed: 0,
        };
        let mut split = ev("decode", 100, 90, 1000);
        split.stages = vec![
            stage("cuda:0 (layers 0-23)", 60, 58, 200),
            stage("cuda:1 (layers 24-47)", 40, 32, 800),
        ];
        m.record_expert_cache(&split);
        let text = m.render();
        for line in [
            r#"strata_expert_cache_stage_lookups_total{phase="decode",stage="cuda:0 (layers 0-23)"} 60"#,
            r#"strata_expert_cache_stage_hits_total{phase="decode",stage="cuda:1 (layers 24-47)"} 32"#,
            r#"strata_expert_cache_stage_uploaded_bytes_total{phase="decode",stage="cuda:1 (layers 24-47)"} 800"#,
            r#"strata_expert_cache_lookups_total{phase="decode"} 100"#,
        ] {
            assert!(text.contains(line), "{line} missing from\n{text}");
        }
        let m = Metrics::new();
        m.record_expert_cache(&ev("decode", 100, 90, 1000));
        m.record_expert_cache(&ev("decode", 50, 10, 7));
        m.record_expert_cache(&ev("prefill", 8, 0, 64));
        let text = m.render();
        for line in [
            r#"strata_expert_cache_lookups_total{phase="decode"} 150"#,
            r#"strata_expert_cache_hits_total{phase="decode"} 100"#,
            r#"strata_expert_cache_uploaded_bytes_total{phase="decode"} 1007"#,
            r#"strata_expert_cache_lookups_total{phase="prefill"} 8"#,
            r#"strata_expert_cache_uploaded_bytes_total{phase="prefill"} 64"#,
            r#"strata_expert_cache_cpu_computed_total{phase="decode"} 15"#,
            r#"strata_expert_cache_cpu_computed_total{phase="prefill"} 0"#,
            r#"strata_expert_cache_prefetched_total{phase="decode"} 30"#,
            r#"strata_expert_cache_prefetch_used_total{phase="decode"} 6"#,
        ] {
            assert!(text.contains(line), "{line} missing from\n{text}");
        }
    }
}
