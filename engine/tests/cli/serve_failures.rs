//! The failure contract of `strata serve` (DESIGN.md section 3, seed 000): a dead or silent worker gives 503
//! with the original's message (or an error event in a stream that already answered 200, never a cut stream
//! that looks whole), is restarted, and the next request gets 200; a closed stream cancels its generation. A
//! first worker that cannot load the model ends `strata serve` instead.

use std::time::{Duration, Instant};

use crate::serve_common::{Server, SseReader, signal};
use serde_json::{Value, json};

fn long_request(stream: bool) -> Value {
    json!({
        "messages": [{"role": "user", "content": "Write a very long story about a dragon."}],
        "max_tokens": 2000, "temperature": 0.8, "seed": 1, "stream": stream,
    })
}

/// Sends a long non-streaming chat request and signals the worker `after_ms` into it; returns the answer.
fn signal_during_long_request(s: &Server, sig: &'static str, after_ms: u64) -> reqwest::blocking::Response {
    let pid = s.worker_pid();
    let sender = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(after_ms));
        signal(pid, sig);
    });
    let r = s
        .client
        .post(s.url("/v1/chat/completions"))
        .json(&long_request(false))
        .send()
        .unwrap();
    sender.join().unwrap();
    r
}

fn short_request() -> Value {
    json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0})
}

#[test]
fn sigkill_of_the_worker_gives_503_then_the_next_request_200() {
    let s = Server::start();

    // Mid-stream: the stream has answered 200, so it ends with an error event and no [DONE].
    let pid = s.worker_pid();
    let mut sse = s.chat_stream(&long_request(true));
    for _ in 0..3 {
        sse.next_event().expect("a chunk before the kill");
    }
    signal(pid, "KILL");
    let rest = sse.rest();
    let last = rest.last().expect("an error event");
    assert_ne!(last.data, "[DONE]");
    let err: Value = serde_json::from_str(&last.data).unwrap();
    assert_eq!(err["error"]["type"], "server_error", "{err}");
    let msg = err["error"]["message"].as_str().unwrap();
    assert_eq!(
        msg,
        "the engine stopped unexpectedly (killed by signal 9); the next request restarts it"
    );

    // A non-streaming request in flight gets the 503 itself.
    s.wait_ready(Duration::from_secs(60));
    let r = signal_during_long_request(&s, "KILL", 1500);
    assert_eq!(r.status(), 503);
    assert!(r.headers().get("retry-after").is_some());
    let v: Value = r.json().unwrap();
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("the engine stopped unexpectedly"),
        "{v}"
    );

    // The worker comes back and serves.
    s.wait_ready(Duration::from_secs(60));
    let (status, v) = s.post("/v1/chat/completions", &short_request());
    assert_eq!(status, 200, "{v}");
    let (status, v) = s.post(
        "/v1/messages",
        &json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}),
    );
    assert_eq!(status, 200, "{v}");
    let metrics = s.metrics();
    assert!(
        metrics.contains(r#"strata_worker_deaths_total{cause="signal_9"} 2"#),
        "{metrics}"
    );
}

#[test]
fn a_worker_fault_is_reported_counted_and_survived() {
    let s = Server::start_with(&[], &[("STRATA_WORKER_FAULT_AFTER_TOKENS", "2")]);
    let (status, v) = s.post(
        "/v1/messages",
        &json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 20}),
    );
    assert_eq!(status, 503, "{v}");
    assert_eq!(v["type"], "error");
    assert_eq!(
        v["error"]["message"],
        "the engine stopped unexpectedly (exit code 101); the next request restarts it"
    );
    s.wait_ready(Duration::from_secs(60));
    let health = s.health();
    let death = health["last_worker_death"].as_str().unwrap();
    assert!(
        death.contains("exit code 101") && death.contains("injected fault"),
        "{death}"
    );
    let metrics = s.metrics();
    assert!(
        metrics.contains(r#"strata_worker_deaths_total{cause="exit_code_101"} 1"#),
        "{metrics}"
    );
    assert!(metrics.contains("strata_worker_faults_total 1"), "{metrics}");
    // Two tokens fit under the fault's threshold.
    let (status, v) = s.post(
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}),
    );
    assert_eq!(status, 200, "{v}");
}

/// A first worker that cannot load (a memory plan that does not fit, say) ends `strata serve` with exit 1 and the
/// cause, as llama-server does, instead of a worker restarted for ever behind a 503.
#[test]
fn a_first_worker_that_cannot_load_ends_serve() {
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_strata"))
        .args(["serve", "--port", "0"])
        .env("STRATA_WORKER_FAULT_AT_LOAD", "1")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let start = Instant::now();
    let status = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break st;
        }
        if start.elapsed() > Duration::from_secs(60) {
            child.kill().unwrap();
            panic!("serve went on after its worker could not load");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let mut err = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut err).unwrap();
    assert_eq!(status.code(), Some(1), "{err}");
    assert!(
        err.contains("could not load the model (exit code 1)") && err.contains("injected fault before loading"),
        "{err}"
    );
    assert!(!err.contains("restarting it"), "{err}");
}

#[test]
fn the_watchdog_stops_a_silent_worker() {
    // 5 s: long enough that a busy 2-core machine (this file's four servers run at once) still answers the short
    // request after the restart within it, short enough for a test.
    let s = Server::start_with(&["--watchdog-s", "5"], &[]);
    let r = signal_during_long_request(&s, "STOP", 1000);
    assert_eq!(r.status(), 503);
    let v: Value = r.json().unwrap();
    assert!(v["error"]["message"].as_str().unwrap().contains("watchdog"), "{v}");
    s.wait_ready(Duration::from_secs(60));
    assert!(
        s.metrics()
            .contains(r#"strata_worker_deaths_total{cause="watchdog"} 1"#)
    );
    let (status, _) = s.post("/v1/chat/completions", &short_request());
    assert_eq!(status, 200);
}

#[test]
fn a_closed_stream_stops_its_generation() {
    let s = Server::start();
    let r = s
        .client
        .post(s.url("/v1/chat/completions"))
        .json(&long_request(true))
        .send()
        .unwrap();
    let mut sse = SseReader::new(r);
    for _ in 0..3 {
        sse.next_event().unwrap();
    }
    drop(sse);
    // The 2000-token generation is cancelled, so a short request is answered at once.
    let start = Instant::now();
    let (status, v) = s.post("/v1/chat/completions", &short_request());
    assert_eq!(status, 200, "{v}");
    assert!(start.elapsed() < Duration::from_secs(20), "{:?}", start.elapsed());
    let metrics = s.metrics();
    assert!(metrics.contains("strata_requests_cancelled_total 1"), "{metrics}");
    let generated = s.metric("strata_generated_tokens_total");
    assert!(generated < 200.0, "the cancelled request went on: {generated} tokens");
}

/// Silent and slow clients (issue 19, point 1): 300 connections that send nothing, to a server limited to 256 open
/// files, do not keep `/health` or a chat from being answered (a new connection takes the oldest silent one's
/// place), and a connection that sends part of a header is closed at the header deadline (10 s).
#[test]
fn silent_connections_do_not_lock_clients_out() {
    use std::io::{Read, Write};
    let s = Server::start_with_files(&[], &[], Some(256));
    let addr = s.base.trim_start_matches("http://").to_string();
    let silent: Vec<std::net::TcpStream> = (0..300)
        .map(|_| std::net::TcpStream::connect(&addr).expect("connect"))
        .collect();
    std::thread::sleep(Duration::from_millis(300));
    let fresh = reqwest::blocking::Client::builder()
        .pool_max_idle_per_host(0)
        .timeout(Duration::from_secs(60))
        .build()
        .unwrap();
    let start = Instant::now();
    let r = fresh.get(s.url("/health")).send().expect("/health answers");
    assert_eq!(r.status(), 200);
    assert!(start.elapsed() < Duration::from_secs(5), "{:?}", start.elapsed());
    let r = fresh
        .post(s.url("/v1/chat/completions"))
        .json(&short_request())
        .send()
        .unwrap();
    assert_eq!(r.status(), 200);
    // Part of a header, then nothing: closed at the deadline, not held.
    let mut slow = std::net::TcpStream::connect(&addr).unwrap();
    slow.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    slow.write_all(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n").unwrap();
    let start = Instant::now();
    let mut buf = Vec::new();
    let _ = slow.read_to_end(&mut buf);
    let waited = start.elapsed();
    assert!(
        waited >= Duration::from_secs(8) && waited < Duration::from_secs(20),
        "closed after {waited:?}"
    );
    assert!(s.metrics().contains("strata_connections_refused_total"));
    drop(silent);
    // Keep-alive connections that asked once and now sit idle cannot lock others out either.
    let idle: Vec<std::net::TcpStream> = (0..250)
        .filter_map(|_| {
            let mut c = std::net::TcpStream::connect(&addr).ok()?;
            c.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
            c.write_all(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n").ok()?;
            let mut head = [0u8; 64];
            let n = c.read(&mut head).ok()?;
            (n > 0).then_some(c)
        })
        .collect();
    assert!(idle.len() > 100, "{} keep-alive connections", idle.len());
    let start = Instant::now();
    let r = fresh
        .get(s.url("/health"))
        .send()
        .expect("/health answers past idle keep-alive connections");
    assert_eq!(r.status(), 200);
    assert!(start.elapsed() < Duration::from_secs(5), "{:?}", start.elapsed());
}

/// SIGTERM (issue 19, point 4) drains as Ctrl-C does: no new connection is taken, a stream in flight runs on
/// until the drain deadline and then ends with an error event (never cut mid-chunk), and the server exits 0.
#[test]
fn sigterm_drains_and_ends_streams_properly() {
    let mut s = Server::start_with(&["--drain-s", "2"], &[]);
    let mut sse = s.chat_stream(&long_request(true));
    for _ in 0..3 {
        sse.next_event().expect("a chunk before the signal");
    }
    let start = Instant::now();
    signal(s.pid(), "TERM");
    let rest = sse.rest();
    let last = rest.last().expect("an ending event");
    assert_ne!(last.data, "[DONE]", "a 2000-token story does not finish in 2 s");
    let err: Value = serde_json::from_str(&last.data).unwrap();
    assert!(err["error"]["message"].as_str().unwrap().contains("--drain-s"), "{err}");
    let st = s
        .wait_exit(Duration::from_secs(10))
        .expect("strata serve exits after the drain");
    assert!(st.success(), "{st:?}");
    let took = start.elapsed();
    assert!(
        took >= Duration::from_millis(1500) && took < Duration::from_secs(8),
        "{took:?}"
    );
    // Nothing listens any more.
    assert!(std::net::TcpStream::connect(s.base.trim_start_matches("http://")).is_err());
}

/// About 3,300 tokens of plain text for the default model.
fn long_prompt() -> String {
    "the river runs past old stone walls and green fields ".repeat(300)
}

/// Starts a server with `flags`, sends a long streamed prompt and leaves once the stream has answered 200; then a
/// short chat. Returns how long the chat waited, and the prompt tokens the engine computed in all.
fn leave_during_prefill(flags: &[&str]) -> (Duration, f64) {
    let s = Server::start_with(flags, &[]);
    let r = s
        .client
        .post(s.url("/v1/completions"))
        .json(&json!({"prompt": long_prompt(), "max_tokens": 4, "stream": true}))
        .send()
        .unwrap();
    assert_eq!(r.status(), 200);
    drop(r);
    let start = Instant::now();
    let (status, v) = s.post("/v1/chat/completions", &short_request());
    assert_eq!(status, 200, "{v}");
    let waited = start.elapsed();
    assert_eq!(s.metric("strata_requests_cancelled_total"), 1.0);
    (waited, s.metric("strata_prompt_tokens_total"))
}

/// A client that leaves during a long prefill stops it at the next chunk (issue 19, point 5): the prompt tokens
/// the engine computed for it are a small part of the prompt, and the next client is not kept waiting.
#[test]
fn a_client_that_leaves_during_prefill_stops_it() {
    let (_, prompt_tokens) = leave_during_prefill(&["--prefill", "64", "--max-context", "4096"]);
    assert!(
        prompt_tokens < 2000.0,
        "the abandoned prefill went on: {prompt_tokens} prompt tokens computed"
    );
}

/// On the CPU a client that leaves stops the prefill inside its chunk too (issue 19, point 5): with one chunk of
/// the whole prompt, the next client is answered in seconds, not after the chunk.
#[test]
fn a_client_that_leaves_stops_even_a_single_long_chunk() {
    let (waited, prompt_tokens) = leave_during_prefill(&["--prefill", "4096", "--max-context", "4096"]);
    assert!(
        waited < Duration::from_secs(10),
        "waited {waited:?} behind the abandoned chunk"
    );
    assert!(
        prompt_tokens < 200.0,
        "the abandoned chunk counted: {prompt_tokens} prompt tokens"
    );
}

/// A single long prefill chunk is not taken for a hang (issue 19, point 5): the worker says it is busy while its
/// layers advance, so a watchdog shorter than the chunk lets it finish.
#[test]
fn a_long_prefill_chunk_outlives_a_short_watchdog() {
    let s = Server::start_with(
        &["--watchdog-s", "1", "--prefill", "4096", "--max-context", "4096"],
        &[],
    );
    let prompt = "the river runs past old stone walls and green fields ".repeat(100);
    let (status, v) = s.post("/v1/completions", &json!({"prompt": prompt, "max_tokens": 2}));
    assert_eq!(status, 200, "{v}");
    let prompt_ms = v["timings"]["prompt_ms"].as_f64().unwrap();
    assert!(
        prompt_ms > 2500.0,
        "the chunk took {prompt_ms} ms: too short to test a 1 s watchdog"
    );
    assert!(
        s.metrics().contains("strata_worker_restarts_total 0"),
        "{}",
        s.metrics()
    );
}

/// A worker that hangs while loading is noticed (issue 19, point 2): after `--load-timeout-s` it is killed, the
/// cause is in `/health` and the log, a waiting request gets 503 naming it, and a new worker is started.
#[test]
fn a_worker_that_hangs_while_loading_is_killed_and_restarted() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_strata"))
        .args(["serve", "--port", &port.to_string(), "--load-timeout-s", "2"])
        .env("STRATA_WORKER_FAULT_AT_LOAD", "hang")
        .env_remove("STRATA_API_KEY")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let base = format!("http://127.0.0.1:{port}");
    let client = reqwest::blocking::Client::builder()
        .timeout(Duration::from_secs(60))
        .build()
        .unwrap();
    let up = Instant::now();
    while client.get(format!("{base}/health")).send().is_err() {
        assert!(up.elapsed() < Duration::from_secs(60), "serve did not listen");
        std::thread::sleep(Duration::from_millis(50));
    }
    let start = Instant::now();
    let r = client
        .post(format!("{base}/v1/chat/completions"))
        .json(&short_request())
        .send()
        .unwrap();
    let waited = start.elapsed();
    assert_eq!(r.status(), 503);
    let v: Value = r.json().unwrap();
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("did not load within 2 s"),
        "{v}"
    );
    assert!(waited < Duration::from_secs(10), "{waited:?}");
    let h: Value = client.get(format!("{base}/health")).send().unwrap().json().unwrap();
    assert_eq!(h["status"], "loading");
    assert!(
        h["last_worker_death"].as_str().unwrap().contains("--load-timeout-s"),
        "{h}"
    );
    let metrics = client.get(format!("{base}/metrics")).send().unwrap().text().unwrap();
    assert!(
        metrics.contains("strata_worker_deaths_total{cause=\"load_timeout\"}"),
        "{metrics}"
    );
    child.kill().unwrap();
    let _ = child.wait();
    let mut err = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut err).unwrap();
    assert!(err.contains("did not load within 2 s"), "{err}");
}
