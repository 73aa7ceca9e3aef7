//! `strata serve` on the default model through both APIs: answers, streams, usage and timings, errors in each
//! API's shape, the queue bound and the API key.

use std::time::{Duration, Instant};

use crate::serve_common::{Server, SseReader};
use serde_json::{Value, json};

const SYSTEM: &str = "You are a helpful AI assistant.";
const QUESTION: &str = "What is the capital of France?";

fn assert_timings(v: &Value) {
    for k in ["prompt_n", "cache_n", "prompt_ms", "predicted_n", "predicted_ms"] {
        assert!(v["timings"][k].is_number(), "timings.{k} missing in {v}");
    }
}

#[test]
fn openai_chat_completions_plain_and_streamed() {
    let s = Server::start();
    let req = json!({
        "model": "SmolLM2-135M-Instruct.Q4_1",
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}],
        "temperature": 0, "max_tokens": 24,
    });
    let (status, v) = s.post("/v1/chat/completions", &req);
    assert_eq!(status, 200, "{v}");
    let text = v["choices"][0]["message"]["content"].as_str().unwrap();
    assert!(text.contains("Paris"), "{text}");
    assert_eq!(v["object"], "chat.completion");
    let u = &v["usage"];
    assert_eq!(
        u["total_tokens"].as_u64().unwrap(),
        u["prompt_tokens"].as_u64().unwrap() + u["completion_tokens"].as_u64().unwrap()
    );
    assert_timings(&v);

    let mut stream_req = req.clone();
    stream_req["stream"] = json!(true);
    stream_req["stream_options"] = json!({"include_usage": true});
    let r = s
        .client
        .post(s.url("/v1/chat/completions"))
        .json(&stream_req)
        .send()
        .unwrap();
    assert_eq!(r.status(), 200);
    assert!(
        r.headers()["content-type"]
            .to_str()
            .unwrap()
            .starts_with("text/event-stream")
    );
    let events = SseReader::new(r).rest();
    assert_eq!(events.last().unwrap().data, "[DONE]");
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(&e.data).unwrap())
        .collect();
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let streamed: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert!(streamed.contains("Paris"), "{streamed}");
    let finish = chunks
        .iter()
        .find(|c| c["choices"][0]["finish_reason"].is_string())
        .unwrap();
    assert_timings(finish);
    let usage = chunks.last().unwrap();
    assert_eq!(usage["choices"], json!([]));
    assert!(usage["usage"]["completion_tokens"].as_u64().unwrap() > 0, "{usage}");
    // The same prompt again: its prefix is reused from the cache.
    assert!(
        usage["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap()
            > 0,
        "{usage}"
    );

    // A stop string ends the answer before it.
    let mut stop_req = req.clone();
    stop_req["stop"] = json!(["Paris"]);
    let (status, v) = s.post("/v1/chat/completions", &stop_req);
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    assert!(
        !v["choices"][0]["message"]["content"]
            .as_str()
            .unwrap()
            .contains("Paris")
    );
}

#[test]
fn openai_completions_and_models() {
    let s = Server::start();
    let models: Value = s.client.get(s.url("/v1/models")).send().unwrap().json().unwrap();
    assert_eq!(models["data"][0]["id"], "SmolLM2-135M-Instruct.Q4_1");
    let (status, v) = s.post(
        "/v1/completions",
        &json!({"model": "default", "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0, "seed": 3, "top_p": 0.9}),
    );
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["object"], "text_completion");
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    assert_eq!(v["usage"]["completion_tokens"], 4);
    assert_timings(&v);
    let r = s
        .client
        .post(s.url("/v1/completions"))
        .json(&json!({"prompt": "Once upon a time", "max_tokens": 3, "stream": true}))
        .send()
        .unwrap();
    let events = SseReader::new(r).rest();
    assert_eq!(events.last().unwrap().data, "[DONE]");
    let last: Value = serde_json::from_str(&events[events.len() - 2].data).unwrap();
    assert_eq!(last["timings"]["predicted_n"], 3, "{last}");
    assert!(
        last.get("usage").is_none(),
        "usage only with stream_options.include_usage: {last}"
    );
}

#[test]
fn unknown_paths_and_methods_answer_in_the_api_shape() {
    let s = Server::start();
    let r = s.client.get(s.url("/v1/nothing")).send().unwrap();
    assert_eq!(r.status(), 404);
    let v: Value = r.json().unwrap();
    assert!(v["error"]["message"].as_str().unwrap().contains("/v1/nothing"), "{v}");
    let r = s.client.get(s.url("/v1/chat/completions")).send().unwrap();
    assert_eq!(r.status(), 405);
    let v: Value = r.json().unwrap();
    assert!(v["error"]["message"].as_str().unwrap().contains("GET"), "{v}");
    let r = s.client.get(s.url("/v1/messages")).send().unwrap();
    assert_eq!(r.status(), 405);
    let v: Value = r.json().unwrap();
    assert_eq!(v["type"], "error", "Anthropic shape: {v}");
}

#[test]
fn anthropic_messages_plain_streamed_and_counted() {
    let s = Server::start();
    let req = json!({
        "model": "SmolLM2-135M-Instruct.Q4_1", "system": SYSTEM, "max_tokens": 24, "temperature": 0,
        "messages": [{"role": "user", "content": [{"type": "text", "text": QUESTION}]}],
    });
    let (status, v) = s.post("/v1/messages", &req);
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["type"], "message");
    assert_eq!(v["role"], "assistant");
    assert!(v["content"][0]["text"].as_str().unwrap().contains("Paris"), "{v}");
    assert!(["end_turn", "max_tokens"].contains(&v["stop_reason"].as_str().unwrap()));
    assert_timings(&v);
    let (status, count) = s.post(
        "/v1/messages/count_tokens",
        &json!({"model": "default", "system": SYSTEM, "messages": req["messages"]}),
    );
    assert_eq!(status, 200, "{count}");
    assert_eq!(count["input_tokens"], v["usage"]["input_tokens"]);

    let mut sreq = req.clone();
    sreq["stream"] = json!(true);
    sreq["stop_sequences"] = json!(["Paris"]);
    let r = s.client.post(s.url("/v1/messages")).json(&sreq).send().unwrap();
    assert_eq!(r.status(), 200);
    let events = SseReader::new(r).rest();
    let names: Vec<&str> = events.iter().map(|e| e.event.as_str()).collect();
    assert_eq!(&names[..2], ["message_start", "content_block_start"]);
    assert_eq!(
        &names[names.len() - 3..],
        ["content_block_stop", "message_delta", "message_stop"]
    );
    assert!(
        names[2..names.len() - 3].iter().all(|n| *n == "content_block_delta"),
        "{names:?}"
    );
    let delta: Value = serde_json::from_str(&events[events.len() - 2].data).unwrap();
    assert_eq!(delta["delta"]["stop_reason"], "stop_sequence", "{delta}");
    assert_eq!(delta["delta"]["stop_sequence"], "Paris");
    assert!(delta["usage"]["output_tokens"].as_u64().unwrap() > 0);
    assert_timings(&delta);
}

#[test]
fn bad_input_gets_4xx_in_each_api_shape_and_the_server_keeps_serving() {
    let s = Server::start_with(&["--max-context", "64", "--max-body-bytes", "4096"], &[]);
    let chat = "/v1/chat/completions";
    let msgs = json!([{"role": "user", "content": "Hi"}]);
    let openai_cases: Vec<(Vec<u8>, u16, &str)> = vec![
        (b"{not json".to_vec(), 400, "malformed JSON"),
        (br#"{"messages": "hi"}"#.to_vec(), 400, "invalid request"),
        (
            json!({"messages": msgs, "max_tokens": "ten"}).to_string().into_bytes(),
            400,
            "invalid request",
        ),
        (
            json!({"model": "gpt-4", "messages": msgs}).to_string().into_bytes(),
            404,
            "not served",
        ),
        (json!({"messages": []}).to_string().into_bytes(), 400, "empty"),
        (
            json!({"messages": [{"role": "wizard", "content": "Hi"}]})
                .to_string()
                .into_bytes(),
            400,
            "messages[0].role must be one of system, developer, user, assistant, tool; got `wizard`",
        ),
        (
            json!({"messages": msgs, "max_tokens": 0}).to_string().into_bytes(),
            400,
            "at least 1",
        ),
        (
            json!({"messages": msgs, "max_completion_tokens": -5})
                .to_string()
                .into_bytes(),
            400,
            "max_completion_tokens must be at least 1, got -5",
        ),
        (
            json!({"messages": msgs, "temperature": -1}).to_string().into_bytes(),
            400,
            "temperature",
        ),
        (
            b"{\"messages\": [{\"role\": \"user\", \"content\": \"\xff\xfe\"}]}".to_vec(),
            400,
            "UTF-8",
        ),
        (
            json!({"messages": [{"role": "user", "content": "word ".repeat(200)}]})
                .to_string()
                .into_bytes(),
            400,
            "context holds 64",
        ),
        (vec![b' '; 5000], 413, "max-body-bytes"),
        (
            json!({"messages": [{"role": "user", "content": "Hi"}],
                   "tools": [{"type": "retrieval"}]})
            .to_string()
            .into_bytes(),
            400,
            "tools[0].type must be `function`",
        ),
    ];
    for (body, status, needle) in openai_cases {
        let (got, v) = s.post_raw(chat, body.clone());
        assert_eq!(
            got,
            status,
            "{}: {v}",
            String::from_utf8_lossy(&body[..body.len().min(80)])
        );
        let msg = v["error"]["message"]
            .as_str()
            .unwrap_or_else(|| panic!("OpenAI shape: {v}"));
        assert!(msg.contains(needle), "{msg} lacks {needle}");
        assert!(v["error"]["type"].is_string());
    }
    // The prompt-over-context message names both counts.
    let (_, v) = s.post(
        chat,
        &json!({"messages": [{"role": "user", "content": "word ".repeat(200)}]}),
    );
    let msg = v["error"]["message"].as_str().unwrap();
    assert!(msg.contains("tokens but the context holds 64"), "{msg}");
    assert_eq!(v["error"]["code"], "context_length_exceeded");

    let anthropic_cases: Vec<(&str, Vec<u8>, u16)> = vec![
        ("/v1/messages", b"[1, 2".to_vec(), 400),
        ("/v1/messages", json!({"messages": msgs}).to_string().into_bytes(), 400),
        (
            "/v1/messages",
            json!({"messages": msgs, "max_tokens": 0}).to_string().into_bytes(),
            400,
        ),
        (
            "/v1/messages",
            json!({"model": "claude", "messages": msgs, "max_tokens": 5})
                .to_string()
                .into_bytes(),
            404,
        ),
        (
            "/v1/messages",
            json!({"messages": [], "max_tokens": 5}).to_string().into_bytes(),
            400,
        ),
        ("/v1/messages", vec![b' '; 5000], 413),
        (
            "/v1/messages",
            json!({"messages": msgs, "max_tokens": 5, "tools": [{"name": "f", "input_schema": {}}]})
                .to_string()
                .into_bytes(),
            400,
        ),
        (
            "/v1/messages/count_tokens",
            json!({"messages": 3}).to_string().into_bytes(),
            400,
        ),
    ];
    for (path, body, status) in anthropic_cases {
        let (got, v) = s.post_raw(path, body);
        assert_eq!(got, status, "{path}: {v}");
        assert_eq!(v["type"], "error", "Anthropic shape: {v}");
        assert!(
            v["error"]["type"].is_string() && v["error"]["message"].is_string(),
            "{v}"
        );
    }
    let (status, v) = s.post(chat, &json!({"messages": msgs, "max_tokens": 2}));
    assert_eq!(status, 200, "{v}");
    let metrics = s.metrics();
    for name in [
        "strata_requests_total",
        "strata_prompt_tokens_total",
        "strata_generated_tokens_total",
        "strata_prefill_seconds",
        "strata_decode_seconds",
        "strata_queue_depth",
        "strata_worker_restarts_total",
    ] {
        assert!(metrics.contains(name), "{name} missing from /metrics");
    }
    assert!(metrics.contains(r#"strata_requests_total{endpoint="/v1/chat/completions",status="400"}"#));
}

/// A streamed chat request of `max_tokens` whose first chunk has arrived, so the worker is busy with it.
fn busy_stream(s: &Server, messages: &Value, max_tokens: usize) -> reqwest::blocking::Response {
    use std::io::Read;
    let mut r = s
        .client
        .post(s.url("/v1/chat/completions"))
        .json(&json!({"messages": messages, "max_tokens": max_tokens, "stream": true}))
        .send()
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
    let mut chunk = [0u8; 64];
    assert!(r.read(&mut chunk).unwrap() > 0, "the first stream sent nothing");
    r
}

/// With `--parallel 1 --max-queue 1`: while one request is being answered, one more waits and is answered, and the rest get
/// 503 with Retry-After. The first request is a stream whose first chunk is read before the others are sent, so
/// the worker is busy with it (concurrent first requests would race for the one queue place).
#[test]
fn full_queue_answers_503_with_retry_after() {
    use std::io::Read;
    let s = std::sync::Arc::new(Server::start_with(&["--parallel", "1", "--max-queue", "1"], &[]));
    let story = json!([{"role": "user", "content": "Tell me a long story."}]);
    let mut first = busy_stream(&s, &story, 160);
    let body = json!({"messages": story, "max_tokens": 4});
    let handles: Vec<_> = (0..4)
        .map(|_| {
            let (s, body) = (s.clone(), body.clone());
            std::thread::spawn(move || {
                let r = s.client.post(s.url("/v1/chat/completions")).json(&body).send().unwrap();
                (r.status().as_u16(), r.headers().get("retry-after").is_some())
            })
        })
        .collect();
    // Let the busy stream finish so the queued request is answered.
    let mut rest = Vec::new();
    first.read_to_end(&mut rest).unwrap();
    let results: Vec<(u16, bool)> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    let busy: Vec<_> = results.iter().filter(|r| r.0 == 503).collect();
    assert!(!busy.is_empty(), "{results:?}");
    assert!(busy.iter().all(|r| r.1), "503 without Retry-After: {results:?}");
    assert!(
        results.iter().any(|r| r.0 == 200),
        "the queued request was not answered: {results:?}"
    );
    assert!(results.iter().all(|r| r.0 == 200 || r.0 == 503), "{results:?}");
    assert!(s.metrics().contains("strata_queue_rejected_total"));
}

/// A client that gives up while its request waits frees its place in `--max-queue` at once: with the one slot
/// busy for many seconds and both places taken by clients that then leave, `strata_queue_depth` returns to 0 within
/// a second while the slot is still busy, and the next request is queued (a stream answered 200), not refused
/// with 503.
#[test]
fn clients_that_leave_the_queue_free_their_places() {
    let s = Server::start_with(&["--parallel", "1", "--max-queue", "2", "--max-context", "2048"], &[]);
    let story = json!([{"role": "user", "content": "Tell me a long story."}]);
    let first = busy_stream(&s, &story, 1500);
    let body = json!({"messages": story, "max_tokens": 4});
    let quitter = reqwest::blocking::Client::builder()
        .timeout(std::time::Duration::from_millis(300))
        .build()
        .unwrap();
    for _ in 0..2 {
        let r = quitter.post(s.url("/v1/chat/completions")).json(&body).send();
        assert!(r.is_err(), "a queued request was answered within 300 ms: {r:?}");
    }
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(1);
    while s.metric("strata_queue_depth") > 0.0 && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    assert_eq!(s.metric("strata_queue_depth"), 0.0, "places held by clients that left");
    assert_eq!(
        s.metric("strata_requests_running"),
        1.0,
        "the busy stream ended too soon for this test"
    );
    let next = s
        .client
        .post(s.url("/v1/chat/completions"))
        .json(&json!({"messages": story, "max_tokens": 4, "stream": true}))
        .send()
        .unwrap();
    assert_eq!(next.status().as_u16(), 200);
    drop((first, next));
}

#[test]
fn api_key_is_required_when_set_and_public_addresses_need_one() {
    let s = Server::start_with(&["--api-key", "sekret"], &[]);
    let body = json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1});
    let r = s.client.post(s.url("/v1/chat/completions")).json(&body).send().unwrap();
    assert_eq!(r.status(), 401);
    let v: Value = r.json().unwrap();
    assert_eq!(v["error"]["type"], "authentication_error");
    let r = s.client.post(s.url("/v1/messages")).json(&body).send().unwrap();
    assert_eq!(r.status(), 401);
    assert_eq!(r.json::<Value>().unwrap()["type"], "error");
    let r = s
        .client
        .post(s.url("/v1/chat/completions"))
        .bearer_auth("wrong")
        .json(&body)
        .send()
        .unwrap();
    assert_eq!(r.status(), 401);
    // Answered before the body is read: the connection is closed, so a client cannot reuse it mid-body.
    assert_eq!(
        r.headers().get("connection").map(|v| v.to_str().unwrap()),
        Some("close")
    );
    let r = s
        .client
        .post(s.url("/v1/chat/completions"))
        .bearer_auth("sekret")
        .json(&body)
        .send()
        .unwrap();
    assert_eq!(r.status(), 200);
    let r = s
        .client
        .post(s.url("/v1/messages/count_tokens"))
        .header("x-api-key", "sekret")
        .json(&body)
        .send()
        .unwrap();
    assert_eq!(r.status(), 200);
    // Health stays open for probes.
    assert_eq!(s.client.get(s.url("/health")).send().unwrap().status(), 200);

    let out = std::process::Command::new(env!("CARGO_BIN_EXE_strata"))
        .args(["serve", "--host", "0.0.0.0", "--port", "0"])
        .env_remove("STRATA_API_KEY")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--insecure-public"), "{err}");
}

/// Opens a connection to `addr` and sends a POST to `path` with these headers and body bytes, nothing more;
/// returns the stream (read timeout 20 s) and when the request went out.
fn send_partial(addr: &str, path: &str, content_length: usize, body: &str) -> (std::net::TcpStream, Instant) {
    use std::io::Write;
    let mut c = std::net::TcpStream::connect(addr).expect("connect");
    c.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let start = Instant::now();
    write!(
        c,
        "POST {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {content_length}\r\n\r\n{body}"
    )
    .unwrap();
    c.flush().unwrap();
    (c, start)
}

/// A client that stops sending mid-body gets 408 within `--body-timeout-s` (its connection closed), in the API's
/// error shape, and the server keeps serving.
#[test]
fn a_stalled_body_gets_408_within_the_body_timeout() {
    use std::io::Read;
    let s = Server::start_with(&["--body-timeout-s", "2"], &[]);
    let addr = s.base.trim_start_matches("http://").to_string();
    // Promises 100 bytes, sends 10, then waits.
    let (mut c, start) = send_partial(&addr, "/v1/chat/completions", 100, "{\"messages");
    let mut answer = String::new();
    c.read_to_string(&mut answer).expect("the server answers and closes");
    let waited = start.elapsed();
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    assert!(answer.contains("--body-timeout-s"), "{answer}");
    assert!(answer.contains("\"invalid_request_error\""), "OpenAI shape: {answer}");
    assert!(
        waited >= Duration::from_millis(1500) && waited < Duration::from_secs(15),
        "answered after {waited:?}"
    );
    // A declared length over --max-body-bytes is refused at once, not after the deadline.
    let (mut c, start) = send_partial(&addr, "/v1/messages", 100_000_000, "");
    let mut head = [0u8; 512];
    let n = c.read(&mut head).expect("an answer");
    let head = String::from_utf8_lossy(&head[..n]);
    assert!(head.starts_with("HTTP/1.1 413"), "{head}");
    assert!(
        head.to_ascii_lowercase().contains("connection: close"),
        "unread body, reused connection: {head}"
    );
    assert!(start.elapsed() < Duration::from_millis(1500), "{:?}", start.elapsed());
    let (status, _) = s.post(
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}),
    );
    assert_eq!(status, 200);
}

/// A keyless loopback server is not usable from web pages (issue 19, point 6): a rebound `Host` gets 403 unless
/// `--allowed-host` names it; a POST not declared `application/json` (a cross-site form, a `text/plain` fetch)
/// gets 415; CORS preflights are answered for `--cors-origin`'s origins alone. With an API key, the key decides.
#[test]
fn a_keyless_server_refuses_rebound_hosts_form_posts_and_unknown_origins() {
    let s = Server::start_with(
        &["--allowed-host", "strata.lan", "--cors-origin", "https://app.example"],
        &[],
    );
    let chat = json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1});
    let with_host = |host: &str| {
        s.client
            .post(s.url("/v1/chat/completions"))
            .header("host", host)
            .json(&chat)
            .send()
            .unwrap()
    };
    let r = with_host("evil.example:8080");
    assert_eq!(r.status(), 403);
    let v: Value = r.json().unwrap();
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("--allowed-host evil.example"),
        "{v}"
    );
    assert_eq!(
        s.client
            .get(s.url("/health"))
            .header("host", "evil.example")
            .send()
            .unwrap()
            .status(),
        403
    );
    for ok in ["localhost:1234", "127.0.0.1", "[::1]:80", "STRATA.LAN:9"] {
        assert_eq!(with_host(ok).status(), 200, "{ok}");
    }
    // A form or text/plain POST, what a web page may send anywhere without a preflight.
    for ct in ["text/plain", "application/x-www-form-urlencoded", ""] {
        let mut req = s.client.post(s.url("/v1/chat/completions")).body(chat.to_string());
        if !ct.is_empty() {
            req = req.header("content-type", ct);
        }
        let r = req.send().unwrap();
        assert_eq!(r.status(), 415, "{ct:?}");
        assert_eq!(
            r.headers().get("connection").map(|v| v.to_str().unwrap()),
            Some("close")
        );
    }
    let r = s
        .client
        .post(s.url("/v1/chat/completions"))
        .header("content-type", "Application/JSON; charset=utf-8")
        .body(chat.to_string())
        .send()
        .unwrap();
    assert_eq!(r.status(), 200);
    // CORS: the allowed origin's preflight is answered; another's gets no CORS header.
    let preflight = |origin: &str| {
        s.client
            .request(reqwest::Method::OPTIONS, s.url("/v1/chat/completions"))
            .header("origin", origin)
            .header("access-control-request-method", "POST")
            .header("access-control-request-headers", "content-type")
            .send()
            .unwrap()
    };
    let r = preflight("https://app.example");
    assert_eq!(
        r.headers()
            .get("access-control-allow-origin")
            .map(|v| v.to_str().unwrap()),
        Some("https://app.example")
    );
    assert!(
        preflight("https://evil.example")
            .headers()
            .get("access-control-allow-origin")
            .is_none()
    );

    // With a key, the key is what protects the server: any Host, any content type reach the key check.
    let k = Server::start_with(&["--api-key", "sekret"], &[]);
    let r = k
        .client
        .post(k.url("/v1/chat/completions"))
        .header("host", "evil.example")
        .bearer_auth("sekret")
        .json(&chat)
        .send()
        .unwrap();
    assert_eq!(r.status(), 200);
    // A bad --cors-origin is refused at start.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_strata"))
        .args(["serve", "--port", "0", "--cors-origin", "app.example"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("--cors-origin"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Parsing and tokenizing run off the async threads (issue 19, point 3): while two clients post 3.5 MB
/// `count_tokens` bodies over and over, `/health` keeps answering within a second.
#[test]
fn big_bodies_being_tokenized_do_not_stall_health() {
    let s = Server::start();
    let text = "the river runs past old stone walls ".repeat(100_000);
    let body = json!({"model": "default", "messages": [{"role": "user", "content": text}]}).to_string();
    assert!(body.len() > 3_000_000 && body.len() < 4 * 1024 * 1024);
    let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let posters: Vec<_> = (0..2)
        .map(|_| {
            let (url, body, done) = (s.url("/v1/messages/count_tokens"), body.clone(), done.clone());
            std::thread::spawn(move || {
                let c = reqwest::blocking::Client::builder()
                    .timeout(Duration::from_secs(300))
                    .build()
                    .unwrap();
                let mut answered = 0;
                while !done.load(std::sync::atomic::Ordering::Relaxed) {
                    let r = c
                        .post(&url)
                        .header("content-type", "application/json")
                        .body(body.clone())
                        .send()
                        .unwrap();
                    assert!(r.status() == 200 || r.status() == 503, "{}", r.status());
                    answered += 1;
                }
                answered
            })
        })
        .collect();
    std::thread::sleep(Duration::from_millis(500));
    let mut worst = Duration::ZERO;
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(8) {
        let t = Instant::now();
        assert_eq!(s.client.get(s.url("/health")).send().unwrap().status(), 200);
        worst = worst.max(t.elapsed());
        std::thread::sleep(Duration::from_millis(100));
    }
    done.store(true, std::sync::atomic::Ordering::Relaxed);
    let answered: usize = posters.into_iter().map(|p| p.join().unwrap()).sum();
    assert!(answered >= 2, "the big bodies were not answered: {answered}");
    assert!(
        worst < Duration::from_secs(1),
        "/health took {worst:?} while big bodies were tokenized"
    );
}
