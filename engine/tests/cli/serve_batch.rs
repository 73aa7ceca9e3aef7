//! `strata serve` answering several clients at once (issue 20): concurrent requests are computed together
//! (continuous batching over `--parallel` slots) and each gets the answer it gets alone; a worker that dies with
//! several requests in flight ends every one of them properly, and the next request is served.

use std::time::{Duration, Instant};

use crate::serve_common::{Server, SseReader, signal};
use serde_json::{Value, json};

const QUESTIONS: [&str; 4] = [
    "Tell me a story about a lighthouse keeper.",
    "Explain how a bicycle works.",
    "Write a poem about the sea.",
    "Describe the city of Paris.",
];

fn request(q: &str, stream: bool) -> Value {
    json!({
        "messages": [{"role": "user", "content": q}],
        "max_tokens": 40, "temperature": 0, "stream": stream,
    })
}

/// What a stream said: its text, when its first content arrived, when it ended, and its last event.
struct Streamed {
    text: String,
    first: Instant,
    end: Instant,
    last: String,
}

fn stream(s: &Server, body: &Value) -> Streamed {
    let mut sse = s.chat_stream(body);
    let (mut text, mut first, mut last) = (String::new(), None, String::new());
    while let Some(ev) = sse.next_event() {
        last = ev.data.clone();
        if ev.data == "[DONE]" {
            break;
        }
        let v: Value = serde_json::from_str(&ev.data).unwrap();
        if let Some(t) = v["choices"][0]["delta"]["content"].as_str()
            && !t.is_empty()
        {
            first.get_or_insert_with(Instant::now);
            text.push_str(t);
        }
        if v.get("error").is_some() {
            break;
        }
    }
    Streamed {
        text,
        first: first.unwrap_or_else(Instant::now),
        end: Instant::now(),
        last,
    }
}

/// Each of `QUESTIONS` (`ask(q, stream)` makes its request) alone, one after another, then the four as streams at
/// once; asserts each stream ended properly with its alone answer, and returns the streams.
fn alone_then_together(s: &std::sync::Arc<Server>, ask: fn(&str, bool) -> Value) -> Vec<Streamed> {
    let alone: Vec<String> = QUESTIONS
        .iter()
        .map(|q| {
            let (status, v) = s.post("/v1/chat/completions", &ask(q, false));
            assert_eq!(status, 200, "{v}");
            v["choices"][0]["message"]["content"].as_str().unwrap().to_string()
        })
        .collect();
    let handles: Vec<_> = QUESTIONS
        .iter()
        .map(|q| {
            let (s, body) = (s.clone(), ask(q, true));
            std::thread::spawn(move || stream(&s, &body))
        })
        .collect();
    let together: Vec<Streamed> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    for (i, (a, t)) in alone.iter().zip(&together).enumerate() {
        assert_eq!(t.last, "[DONE]", "stream {i}");
        assert_eq!(&t.text, a, "request {i}: together and alone differ");
    }
    together
}

#[test]
fn concurrent_requests_are_batched_and_answer_as_they_do_alone() {
    let s = std::sync::Arc::new(Server::start());
    let together = alone_then_together(&s, request);
    // They were computed together: every stream had its first token before any of them ended (one at a time,
    // the last one's first token would come after the first one's end).
    let last_first = together.iter().map(|t| t.first).max().unwrap();
    let first_end = together.iter().map(|t| t.end).min().unwrap();
    assert!(
        last_first < first_end,
        "the streams were answered one after another ({:?} after the first end)",
        last_first - first_end
    );
    let metrics = s.metrics();
    assert!(metrics.contains("strata_requests_running 0"), "{metrics}");
    // Each request's batch size (sequences a step over its steps): 1 for the four alone, more for the four together.
    let (sum, count) = (s.metric("strata_batch_size_sum"), s.metric("strata_batch_size_count"));
    assert_eq!(count, 8.0, "{metrics}");
    assert!(
        sum - 4.0 > 4.0 * 1.5,
        "the batched requests' mean batch size: {}",
        (sum - 4.0) / 4.0
    );
}

/// A KV pool smaller than the slots' contexts together (`--kv-tokens 256` for 4 slots of 256): four requests at
/// once need more blocks than it holds, so the newest are preempted and computed again later; each answer is still
/// the one it gets alone, and `/metrics` counts the pool and the preemptions.
#[test]
fn a_small_kv_pool_preempts_and_every_answer_is_as_alone() {
    let s = std::sync::Arc::new(Server::start_with(&["--max-context", "256", "--kv-tokens", "256"], &[]));
    assert_eq!(s.metric("strata_kv_blocks_total"), 16.0, "the pool before any request");
    fn ask(q: &str, stream: bool) -> Value {
        let mut r = request(q, stream);
        r["max_tokens"] = json!(90);
        r
    }
    alone_then_together(&s, ask);
    let metrics = s.metrics();
    assert_eq!(s.metric("strata_kv_blocks_total"), 16.0, "{metrics}");
    assert!(s.metric("strata_kv_preemptions_total") > 0.0, "{metrics}");
    assert!(s.metric("strata_kv_blocks_used") <= 16.0, "{metrics}");
}

#[test]
fn parallel_one_answers_one_request_at_a_time() {
    let s = std::sync::Arc::new(Server::start_with(&["--parallel", "1"], &[]));
    let handles: Vec<_> = QUESTIONS[..2]
        .iter()
        .map(|q| {
            let (s, body) = (s.clone(), request(q, true));
            std::thread::spawn(move || stream(&s, &body))
        })
        .collect();
    let t: Vec<Streamed> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    let (a, b) = if t[0].first < t[1].first {
        (&t[0], &t[1])
    } else {
        (&t[1], &t[0])
    };
    assert!(b.first >= a.end, "two requests overlapped with --parallel 1");
}

#[test]
fn a_worker_death_ends_every_request_in_flight_then_serves_again() {
    let s = std::sync::Arc::new(Server::start());
    let pid = s.worker_pid();
    let long = |q: &str| {
        json!({
            "messages": [{"role": "user", "content": q}],
            "max_tokens": 2000, "temperature": 0.8, "seed": 1, "stream": true,
        })
    };
    // Three streams in flight, each past its first chunk, and one plain request.
    let mut readers: Vec<SseReader> = QUESTIONS[..3].iter().map(|q| s.chat_stream(&long(q))).collect();
    for r in &mut readers {
        r.next_event().expect("a first chunk");
    }
    let plain = {
        let s = s.clone();
        std::thread::spawn(move || {
            let mut body = long(QUESTIONS[3]);
            body["stream"] = json!(false);
            let r = s.client.post(s.url("/v1/chat/completions")).json(&body).send().unwrap();
            r.status().as_u16()
        })
    };
    std::thread::sleep(Duration::from_millis(500));
    signal(pid, "KILL");
    for (i, r) in readers.iter_mut().enumerate() {
        let rest = r.rest();
        let last = rest
            .last()
            .unwrap_or_else(|| panic!("stream {i} ended without an error event"));
        assert_ne!(last.data, "[DONE]", "stream {i}");
        let err: Value = serde_json::from_str(&last.data).unwrap();
        let msg = err["error"]["message"].as_str().unwrap_or_default();
        assert!(msg.contains("the engine stopped unexpectedly"), "stream {i}: {err}");
    }
    assert_eq!(plain.join().unwrap(), 503);
    // The dead worker's slots and KV blocks went with it: its gauges read 0, not its last report.
    let metrics = s.metrics();
    for gauge in [
        "strata_requests_running 0",
        "strata_kv_blocks_used 0",
        "strata_kv_blocks_shared 0",
    ] {
        assert!(metrics.contains(gauge), "{gauge}: {metrics}");
    }
    s.wait_ready(Duration::from_secs(60));
    let (status, v) = s.post("/v1/chat/completions", &request("Hi", false));
    assert_eq!(status, 200, "{v}");
}

#[test]
fn slots_show_each_requests_state_and_the_cache_it_left() {
    let s = std::sync::Arc::new(Server::start_with(&["--parallel", "2"], &[]));
    let get = |s: &Server| -> Value { s.client.get(s.url("/slots")).send().unwrap().json().unwrap() };
    let idle = get(&s);
    assert_eq!(idle.as_array().unwrap().len(), 2, "{idle}");
    assert!(
        idle.as_array()
            .unwrap()
            .iter()
            .all(|x| x["state"] == "idle" && x["request"].is_null()),
        "{idle}"
    );
    // A long stream in flight: one slot decodes it.
    let body = json!({
        "messages": [{"role": "user", "content": "Write a very long story about a dragon."}],
        "max_tokens": 400, "temperature": 0.8, "seed": 1, "stream": true,
    });
    let r = s.client.post(s.url("/v1/chat/completions")).json(&body).send().unwrap();
    let mut sse = SseReader::new(r);
    for _ in 0..3 {
        sse.next_event().expect("a chunk");
    }
    let busy = get(&s);
    let slots = busy.as_array().unwrap();
    let decoding: Vec<&Value> = slots.iter().filter(|x| x["state"] == "decode").collect();
    assert_eq!(decoding.len(), 1, "{busy}");
    let d = decoding[0];
    assert!(
        d["request"].as_u64().is_some() && d["generated"].as_u64().unwrap() >= 1,
        "{d}"
    );
    assert_eq!(
        d["prompt_read"].as_u64().unwrap() + d["prompt_reused"].as_u64().unwrap(),
        d["prompt_tokens"].as_u64().unwrap()
    );
    assert!(
        d["cached_tokens"].as_u64().unwrap() > d["prompt_tokens"].as_u64().unwrap(),
        "{d}"
    );
    drop(sse);
    // Once it is cancelled the slot is idle again and keeps the cache for prefix reuse.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let v = get(&s);
        let slot = &v[d["id"].as_u64().unwrap() as usize];
        if slot["state"] == "idle" {
            assert!(slot["cached_tokens"].as_u64().unwrap() > 0, "{slot}");
            break;
        }
        assert!(Instant::now() < deadline, "the slot never went idle: {v}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// A request's grammar is compiled off the stepping thread: with every compile made a minute slow
/// (`STRATA_WORKER_GRAMMAR_DELAY_MS`), a stream already running goes on to its end while a structured-output
/// request that arrived after its first token is still compiling (before, the compile ran between two steps and
/// every running sequence waited for it).
#[test]
fn a_grammar_compiling_never_stalls_the_running_streams() {
    const DELAY: Duration = Duration::from_secs(60);
    let s = Server::start_with(&[], &[("STRATA_WORKER_GRAMMAR_DELAY_MS", "60000")]);
    // A long answer, so the structured request reaches the worker well before the stream could end.
    let mut long = request(QUESTIONS[0], true);
    long["max_tokens"] = json!(200);
    let mut sse = s.chat_stream(&long);
    loop {
        let ev = sse.next_event().expect("the stream's first token");
        let v: Value = serde_json::from_str(&ev.data).unwrap();
        if v["choices"][0]["delta"]["content"]
            .as_str()
            .is_some_and(|t| !t.is_empty())
        {
            break;
        }
    }
    // The structured request, from a thread that holds no handle on the server (it ends with the test).
    let (url, client) = (s.url("/v1/chat/completions"), s.client.clone());
    let body = json!({"messages": [{"role": "user", "content": "A JSON object, please."}], "max_tokens": 8,
                      "response_format": {"type": "json_object"}});
    let sent = Instant::now();
    let structured = std::thread::spawn(move || client.post(url).json(&body).send().map(|r| r.status()));
    let rest = sse.rest();
    let ended = Instant::now();
    assert_eq!(rest.last().map(|e| e.data.as_str()), Some("[DONE]"), "{rest:?}");
    assert!(
        ended - sent < DELAY && !structured.is_finished(),
        "the running stream ended {:?} after the structured request was sent (its compile takes {DELAY:?})",
        ended - sent
    );
}

/// A grammar compiling is work, not silence: with every compile 4 s long and `--watchdog-s 2`, a structured request
/// alone on the server is answered by the same worker (the heartbeat speaks for the compile; before, the watchdog
/// killed the worker and the request got a 503).
#[test]
fn a_grammar_compiling_is_not_silence_to_the_watchdog() {
    let s = Server::start_with(&["--watchdog-s", "2"], &[("STRATA_WORKER_GRAMMAR_DELAY_MS", "4000")]);
    let pid = s.worker_pid();
    let (status, v) = s.post(
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "A JSON object, please."}], "max_tokens": 8,
                "response_format": {"type": "json_object"}}),
    );
    assert_eq!(status, 200, "{v}");
    assert_eq!(s.worker_pid(), pid, "the worker was restarted");
}
