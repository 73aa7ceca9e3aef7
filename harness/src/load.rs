//! Load cases: N concurrent streaming clients for a duration against one server, each sending its next request
//! as soon as the last one ends (a closed loop, as vLLM's `benchmark_serving` with unlimited rate and
//! llama.cpp's server bench), and the serving metrics vLLM's `bench serve` prints: request and output-token
//! throughput, TTFT, TPOT and ITL percentiles, and goodput against latency targets (DistServe's "goodput":
//! requests per second that meet every target).
//!
//! TTFT is the time from sending a request to its first content chunk; ITL the gaps between its content
//! chunks; TPOT its time after the first chunk divided by its output tokens after the first (`usage`); all
//! measured by the client on loopback.

use std::io::BufRead;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use anyhow::Result;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use crate::prompt::PromptBuilder;
use crate::report::Check;
use crate::scenario::Load;

/// Percentiles of a latency, in ms.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Latency {
    pub mean: f64,
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
}

impl Latency {
    /// Of `xs` (ms); `None` when empty. Percentiles by nearest rank.
    pub fn of(xs: &[f64]) -> Option<Latency> {
        if xs.is_empty() {
            return None;
        }
        let mut v = xs.to_vec();
        v.sort_by(f64::total_cmp);
        let at = |p: f64| v[((p / 100.0 * v.len() as f64).ceil() as usize).clamp(1, v.len()) - 1];
        Some(Latency {
            mean: v.iter().sum::<f64>() / v.len() as f64,
            p50: at(50.0),
            p90: at(90.0),
            p99: at(99.0),
        })
    }
}

/// One load run: `clients` clients for the case's duration, and what they measured.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct LoadRow {
    pub case: String,
    pub clients: usize,
    /// From the first request sent to the last answer, s.
    pub duration_s: f64,
    /// Requests answered in full (`[DONE]`).
    pub completed: usize,
    /// Requests that ended otherwise: an HTTP error, an error event, a cut stream. Each is named in `errors`.
    pub failed: usize,
    pub errors: Vec<String>,
    /// Completed requests per second.
    pub requests_per_s: f64,
    /// Output tokens of completed requests per second (`usage.completion_tokens`).
    pub output_tok_s: f64,
    /// Prompt and output tokens of completed requests per second.
    pub total_tok_s: f64,
    pub ttft_ms: Option<Latency>,
    pub tpot_ms: Option<Latency>,
    pub itl_ms: Option<Latency>,
    /// Completed requests per second whose TTFT and TPOT met the case's targets (`None`: no target given).
    pub goodput_per_s: Option<f64>,
    pub checks: Vec<Check>,
}

/// What one request measured.
#[derive(Debug, Default)]
struct Measured {
    ok: bool,
    error: String,
    ttft_ms: Option<f64>,
    gaps_ms: Vec<f64>,
    prompt_tokens: usize,
    output_tokens: usize,
    /// From the first content chunk to the end, ms.
    decode_ms: f64,
}

impl Measured {
    fn tpot_ms(&self) -> Option<f64> {
        (self.output_tokens > 1).then(|| self.decode_ms / (self.output_tokens - 1) as f64)
    }
}

/// Sends one streamed request to `base` and reads it to its end.
fn one(http: &reqwest::blocking::Client, base: &str, path: &str, body: &Value) -> Measured {
    let mut m = Measured::default();
    let t0 = Instant::now();
    let r = match http.post(format!("{base}{path}")).json(body).send() {
        Ok(r) => r,
        Err(e) => {
            m.error = format!("no HTTP answer: {e}");
            return m;
        }
    };
    if r.status() != 200 {
        let status = r.status().as_u16();
        let v: Value = r.json().unwrap_or(Value::Null);
        m.error = format!("HTTP {status}: {}", v["error"]["message"].as_str().unwrap_or(""));
        return m;
    }
    let mut first: Option<Instant> = None;
    let mut last: Option<Instant> = None;
    for line in std::io::BufReader::new(r).lines() {
        let Ok(line) = line else {
            m.error = "the stream was cut".into();
            return m;
        };
        let Some(data) = line.strip_prefix("data:").map(str::trim) else {
            continue;
        };
        if data == "[DONE]" {
            m.ok = true;
            break;
        }
        let Ok(v) = serde_json::from_str::<Value>(data) else {
            m.error = format!("a chunk that is not JSON: {data}");
            return m;
        };
        if let Some(e) = v.get("error") {
            m.error = format!("error event: {}", e["message"].as_str().unwrap_or(""));
            return m;
        }
        if let Some(u) = v.get("usage").filter(|u| !u.is_null()) {
            m.prompt_tokens = u["prompt_tokens"].as_u64().unwrap_or(0) as usize;
            m.output_tokens = u["completion_tokens"].as_u64().unwrap_or(0) as usize;
        }
        let c = &v["choices"][0];
        let text = c["delta"]["content"].as_str().or(c["text"].as_str()).unwrap_or("");
        if !text.is_empty() {
            let now = Instant::now();
            match last {
                None => m.ttft_ms = Some((now - t0).as_secs_f64() * 1e3),
                Some(l) => m.gaps_ms.push((now - l).as_secs_f64() * 1e3),
            }
            first.get_or_insert(now);
            last = Some(now);
        }
    }
    if !m.ok {
        m.error = "the stream ended without [DONE]".into();
    }
    if let Some(f) = first {
        m.decode_ms = f.elapsed().as_secs_f64() * 1e3;
    }
    m
}

/// Runs `load` with `clients` clients against `base` for `seconds`: each client sends a streamed request with a
/// prompt unique to it (an exact token count from `prompts`, or a short chat), `max_tokens` each, temperature 0.7
/// with its own seed, then the next, until `seconds` have passed since the start; the run ends when every request
/// started has ended.
pub fn run(
    case: &str,
    load: &Load,
    clients: usize,
    seconds: f64,
    max_tokens: usize,
    base: &str,
    prompts: &Mutex<&mut PromptBuilder>,
) -> Result<LoadRow> {
    // A fresh connection per request: llama-server's HTTP library closes a kept-alive connection after a few
    // requests, which a pooled client meets as a failed send (about 0.1 ms on loopback, for every server alike).
    let http = reqwest::blocking::Client::builder()
        .timeout(Duration::from_secs(900))
        .pool_max_idle_per_host(0)
        .build()?;
    let start = Instant::now();
    let deadline = start + Duration::from_secs_f64(seconds);
    let results: Mutex<Vec<Measured>> = Mutex::new(Vec::new());
    let failed_prompt: Mutex<Option<anyhow::Error>> = Mutex::new(None);
    std::thread::scope(|s| {
        for c in 0..clients {
            let (http, results, failed_prompt) = (&http, &results, &failed_prompt);
            s.spawn(move || {
                let mut n = 0u64;
                while Instant::now() < deadline {
                    n += 1;
                    let seed = (c as u64) << 32 | n;
                    let (path, body) = match load.prompt_tokens {
                        Some(t) => {
                            let text = match prompts.lock().unwrap_or_else(|e| e.into_inner()).exact(t) {
                                Ok(text) => text,
                                Err(e) => {
                                    *failed_prompt.lock().unwrap_or_else(|e| e.into_inner()) = Some(e);
                                    return;
                                }
                            };
                            ("/v1/completions", json!({"prompt": text}))
                        }
                        None => (
                            "/v1/chat/completions",
                            json!({"messages": [{"role": "user", "content": format!("[{c}-{n}] Tell me about the sea.")}]}),
                        ),
                    };
                    let mut body = body;
                    for (k, v) in [
                        ("max_tokens", json!(max_tokens)),
                        ("temperature", json!(0.7)),
                        ("seed", json!(seed)),
                        ("stream", json!(true)),
                        ("stream_options", json!({"include_usage": true})),
                    ] {
                        body[k] = v;
                    }
                    let m = one(http, base, path, &body);
                    results.lock().unwrap_or_else(|e| e.into_inner()).push(m);
                }
            });
        }
    });
    if let Some(e) = failed_prompt.into_inner().unwrap_or_else(|e| e.into_inner()) {
        return Err(e.context(format!("case `{case}`: building a load prompt")));
    }
    let duration_s = start.elapsed().as_secs_f64();
    let results = results.into_inner().unwrap_or_else(|e| e.into_inner());
    Ok(summarize(case, load, clients, duration_s, &results))
}

fn summarize(case: &str, load: &Load, clients: usize, duration_s: f64, results: &[Measured]) -> LoadRow {
    let done: Vec<&Measured> = results.iter().filter(|m| m.ok).collect();
    let failed: Vec<&Measured> = results.iter().filter(|m| !m.ok).collect();
    let mut errors: Vec<String> = failed.iter().map(|m| m.error.clone()).collect();
    errors.sort();
    errors.dedup();
    let per_s = |x: f64| if duration_s > 0.0 { x / duration_s } else { 0.0 };
    let output: usize = done.iter().map(|m| m.output_tokens).sum();
    let prompt: usize = done.iter().map(|m| m.prompt_tokens).sum();
    let ttft: Vec<f64> = done.iter().filter_map(|m| m.ttft_ms).collect();
    let tpot: Vec<f64> = done.iter().filter_map(|m| m.tpot_ms()).collect();
    let itl: Vec<f64> = done.iter().flat_map(|m| m.gaps_ms.iter().copied()).collect();
    let goodput_per_s = (load.ttft_ms.is_some() || load.tpot_ms.is_some()).then(|| {
        let good = done
            .iter()
            .filter(|m| load.ttft_ms.is_none_or(|t| m.ttft_ms.is_some_and(|x| x <= t)))
            .filter(|m| load.tpot_ms.is_none_or(|t| m.tpot_ms().is_none_or(|x| x <= t)))
            .count();
        per_s(good as f64)
    });
    let checks = vec![
        Check {
            what: format!("{case} with {clients} clients: requests that failed"),
            expected: "0".into(),
            got: if errors.is_empty() {
                failed.len().to_string()
            } else {
                format!("{} ({})", failed.len(), errors.join("; "))
            },
            passed: failed.is_empty(),
        },
        Check {
            what: format!("{case} with {clients} clients: requests completed"),
            expected: "at least 1".into(),
            got: done.len().to_string(),
            passed: !done.is_empty(),
        },
    ];
    LoadRow {
        case: case.into(),
        clients,
        duration_s,
        completed: done.len(),
        failed: failed.len(),
        errors,
        requests_per_s: per_s(done.len() as f64),
        output_tok_s: per_s(output as f64),
        total_tok_s: per_s((output + prompt) as f64),
        ttft_ms: Latency::of(&ttft),
        tpot_ms: Latency::of(&tpot),
        itl_ms: Latency::of(&itl),
        goodput_per_s,
        checks,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_by_nearest_rank() {
        let xs: Vec<f64> = (1..=100).map(f64::from).collect();
        let l = Latency::of(&xs).unwrap();
        assert_eq!((l.p50, l.p90, l.p99, l.mean), (50.0, 90.0, 99.0, 50.5));
        assert_eq!(Latency::of(&[7.0]).unwrap().p99, 7.0);
        assert!(Latency::of(&[]).is_none());
    }

    #[test]
    fn failures_goodput_and_rates_are_counted() {
        let load = Load {
            clients: vec![2],
            seconds: 10.0,
            prompt_tokens: None,
            ttft_ms: Some(100.0),
            tpot_ms: None,
        };
        let ok = |ttft: f64, out: usize| Measured {
            ok: true,
            ttft_ms: Some(ttft),
            output_tokens: out,
            prompt_tokens: 10,
            decode_ms: 90.0,
            gaps_ms: vec![10.0; out.saturating_sub(1)],
            ..Measured::default()
        };
        let bad = Measured {
            error: "HTTP 503: busy".into(),
            ..Measured::default()
        };
        let row = summarize("c", &load, 2, 2.0, &[ok(50.0, 10), ok(150.0, 10), bad]);
        assert_eq!((row.completed, row.failed), (2, 1));
        assert_eq!(row.output_tok_s, 10.0);
        assert_eq!(row.total_tok_s, 20.0);
        assert_eq!(row.goodput_per_s, Some(0.5));
        assert_eq!(row.tpot_ms.unwrap().p50, 10.0);
        assert!(!row.checks[0].passed && row.checks[0].got.contains("HTTP 503"));
        assert!(row.checks[1].passed);
    }
}
