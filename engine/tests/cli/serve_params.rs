//! `strata serve` uses every sampling parameter a request names, with the same sampler chain as `strata generate`
//! (issue 18, point 4), and the API details clients rely on: values as clients send them (`top_p: 0`, `min_p: 1`),
//! range errors naming the field, Anthropic's `stop_sequence` and `system` blocks, OpenAI's stream `usage` only
//! when asked, and llama.cpp server's helper endpoints.

use std::process::Command;

use crate::serve_common::{Server, SseReader};
use serde_json::{Value, json};
use strata_engine::models;

const PROMPT: &str = "Once upon a time, in a small village,";
const QUESTION: &str = "Tell me a short story about a cat.";
const TOKENS: usize = 24;

/// The text `strata generate` prints for `prompt` with `flags` (its trailing newline removed).
fn generate(chat: bool, prompt: &str, flags: &[String]) -> String {
    let model = models::require(models::DEFAULT_MODEL_FILE).unwrap_or_else(|e| panic!("{e}"));
    let mut c = Command::new(env!("CARGO_BIN_EXE_strata"));
    c.args(["generate", "--model"])
        .arg(&model)
        .args([
            "--threads",
            "1",
            "--prompt",
            prompt,
            "--max-tokens",
            &TOKENS.to_string(),
        ])
        .args(flags);
    if chat {
        c.arg("--chat");
    }
    let out = c.output().expect("strata generate runs");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8(out.stdout).unwrap();
    text.strip_suffix('\n').unwrap_or(&text).to_string()
}

/// `strata generate`'s flags for the sampling fields of `fields`, the server's defaults for the others
/// (`/props` says which: temperature 1, top_p 1, top_k 40, min_p 0.05, no penalties over 64 tokens).
fn flags(fields: &Value) -> Vec<String> {
    let get = |k: &str, d: f64| fields.get(k).and_then(Value::as_f64).unwrap_or(d).to_string();
    let mut f = vec![
        ("--temp", get("temperature", 1.0)),
        ("--top-p", get("top_p", 1.0)),
        ("--top-k", get("top_k", 40.0)),
        ("--min-p", get("min_p", 0.05)),
        ("--repeat-penalty", get("repeat_penalty", 1.0)),
        ("--repeat-last-n", get("repeat_last_n", 64.0)),
        ("--presence-penalty", get("presence_penalty", 0.0)),
        ("--frequency-penalty", get("frequency_penalty", 0.0)),
    ];
    if let Some(seed) = fields.get("seed") {
        f.push(("--seed", seed.to_string()));
    }
    f.into_iter().flat_map(|(k, v)| [k.to_string(), v]).collect()
}

fn merged(base: &Value, extra: &Value) -> Value {
    let mut v = base.clone();
    for (k, x) in extra.as_object().unwrap() {
        v[k] = x.clone();
    }
    v
}

fn completion(s: &Server, fields: &Value) -> String {
    let req = merged(&json!({"prompt": PROMPT, "max_tokens": TOKENS}), fields);
    let (status, v) = s.post("/v1/completions", &req);
    assert_eq!(status, 200, "{req} -> {v}");
    v["choices"][0]["text"].as_str().unwrap().to_string()
}

fn chat(s: &Server, fields: &Value) -> String {
    let req = merged(
        &json!({"messages": [{"role": "user", "content": QUESTION}], "max_tokens": TOKENS}),
        fields,
    );
    let (status, v) = s.post("/v1/chat/completions", &req);
    assert_eq!(status, 200, "{req} -> {v}");
    v["choices"][0]["message"]["content"].as_str().unwrap().to_string()
}

fn message(s: &Server, fields: &Value) -> String {
    let req = merged(
        &json!({"messages": [{"role": "user", "content": QUESTION}], "max_tokens": TOKENS}),
        fields,
    );
    let (status, v) = s.post("/v1/messages", &req);
    assert_eq!(status, 200, "{req} -> {v}");
    v["content"][0]["text"].as_str().unwrap().to_string()
}

/// Each parameter, sent alone over a fixed base (a seed, and greedy for the penalties), gives exactly what
/// `strata generate` gives with the same flags, and changes the answer against the base: so every one is read
/// and used as the sampler chain says. Both OpenAI routes and Anthropic's (its `temperature` is at most 1).
#[test]
fn every_sampling_parameter_is_used_as_strata_generate_uses_it() {
    let s = Server::start_with(&["--parallel", "1"], &[]);
    let sampled = json!({"temperature": 1.0, "seed": 11});
    let greedy = json!({"temperature": 0});
    let cases: Vec<(&str, Value, Value)> = vec![
        ("temperature", json!({"temperature": 0.3}), sampled.clone()),
        ("top_k", json!({"top_k": 2}), sampled.clone()),
        ("top_p", json!({"top_p": 0.3}), sampled.clone()),
        ("min_p", json!({"min_p": 0.3}), sampled.clone()),
        ("seed", json!({"seed": 12}), sampled.clone()),
        (
            "repeat_penalty",
            json!({"repeat_penalty": 1.8, "repeat_last_n": 32}),
            greedy.clone(),
        ),
        ("frequency_penalty", json!({"frequency_penalty": 1.5}), greedy.clone()),
        ("presence_penalty", json!({"presence_penalty": 1.5}), greedy.clone()),
    ];
    type Route = fn(&Server, &Value) -> String;
    let routes: [(&str, Route, bool); 3] = [
        ("/v1/completions", completion, false),
        ("/v1/chat/completions", chat, true),
        ("/v1/messages", message, true),
    ];
    for (route, call, is_chat) in routes {
        let prompt = if is_chat { QUESTION } else { PROMPT };
        for (name, param, base) in &cases {
            let with = merged(base, param);
            let served = call(&s, &with);
            let generated = generate(is_chat, prompt, &flags(&with));
            assert_eq!(served, generated, "{route} {with}: served vs strata generate");
            let without = call(&s, base);
            assert_ne!(served, without, "{route}: {name} changed nothing ({with} vs {base})");
        }
    }
}

/// Values as clients send them: `top_p: 0` and `min_p: 1` keep the most likely token alone (greedy at any
/// temperature and seed), `top_k: 1` too; `top_k: 0`, `top_p: 1`, `min_p: 0` are accepted as "off".
#[test]
fn top_p_zero_and_min_p_one_are_greedy_and_off_values_are_accepted() {
    let s = Server::start();
    let greedy = completion(&s, &json!({"temperature": 0}));
    for seed in [1, 2, 3] {
        for greedy_field in [json!({"top_p": 0}), json!({"min_p": 1}), json!({"top_k": 1})] {
            let req = merged(&json!({"temperature": 2.0, "seed": seed}), &greedy_field);
            assert_eq!(completion(&s, &req), greedy, "{req}");
        }
    }
    let off = completion(
        &s,
        &json!({"temperature": 0.7, "seed": 5, "top_k": 0, "top_p": 1, "min_p": 0}),
    );
    assert!(!off.is_empty());
}

/// A value outside the API's range is a 400 whose message names the field (and OpenAI's `param` carries it).
#[test]
fn out_of_range_values_name_their_field() {
    let s = Server::start();
    let chat = |extra: Value| {
        merged(
            &json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}),
            &extra,
        )
    };
    for (field, bad) in [
        ("temperature", json!(2.5)),
        ("temperature", json!(-0.1)),
        ("top_p", json!(1.1)),
        ("top_k", json!(-1)),
        ("min_p", json!(1.5)),
        ("frequency_penalty", json!(2.5)),
        ("presence_penalty", json!(-3)),
        ("repeat_penalty", json!(0)),
        ("repeat_last_n", json!(-2)),
        ("seed", json!(-5)),
        ("logit_bias", json!({"abc": 5})),
        ("logit_bias", json!({"1": 101})),
        ("logit_bias", json!({"99999999": 1})),
        ("logit_bias", json!({"05": 1})),
        (
            "logit_bias",
            json!(
                (0..1025)
                    .map(|i| (i.to_string(), json!(1)))
                    .collect::<serde_json::Map<_, _>>()
            ),
        ),
        ("stop", json!(vec!["x"; 33])),
        ("stop", json!(["a", "b".repeat(1025)])),
    ] {
        let (status, v) = s.post("/v1/chat/completions", &chat(json!({ field: bad })));
        assert_eq!(status, 400, "{field}={bad}: {v}");
        assert_eq!(v["error"]["param"], field, "{v}");
        assert!(v["error"]["message"].as_str().unwrap().contains(field), "{v}");
    }
    // Anthropic's temperature stops at 1; its stop_sequences have the same limits as OpenAI's stop.
    for (field, bad) in [("temperature", json!(1.5)), ("stop_sequences", json!(vec!["x"; 33]))] {
        let (status, v) = s.post("/v1/messages", &chat(json!({ field: bad })));
        assert_eq!(status, 400, "{v}");
        assert_eq!(v["type"], "error");
        assert!(v["error"]["message"].as_str().unwrap().contains(field), "{v}");
    }
    // Legacy completions' options that are not implemented are refused, not dropped; their defaults pass.
    for (field, bad) in [("echo", json!(true)), ("best_of", json!(3)), ("suffix", json!("end"))] {
        let (status, v) = s.post("/v1/completions", &json!({"prompt": "Hi", "max_tokens": 2, field: bad}));
        assert_eq!(status, 400, "{field}={bad}: {v}");
        assert_eq!(v["error"]["param"], field, "{v}");
    }
    let (status, v) = s.post(
        "/v1/completions",
        &json!({"prompt": "Hi", "max_tokens": 2, "echo": false, "best_of": 1, "suffix": ""}),
    );
    assert_eq!(status, 200, "{v}");
    // Within range on OpenAI's: 2 is its top.
    let (status, v) = s.post("/v1/chat/completions", &chat(json!({"temperature": 2, "seed": -1})));
    assert_eq!(status, 200, "{v}");
}

/// OpenAI's `logit_bias`: -100 on the greedy answer's first token changes the answer and its first token; +100
/// on another token makes the answer start with that token.
#[test]
fn logit_bias_bans_and_forces_tokens() {
    let s = Server::start();
    let first_id = |text: &str| {
        let (status, v) = s.post("/tokenize", &json!({"content": text, "parse_special": false}));
        assert_eq!(status, 200, "{v}");
        v["tokens"][0].as_u64().unwrap()
    };
    let base = chat(&s, &json!({"temperature": 0}));
    let first = first_id(&base);
    let banned = chat(&s, &json!({"temperature": 0, "logit_bias": {first.to_string(): -100}}));
    assert_ne!(banned, base);
    assert_ne!(first_id(&banned), first, "{base:?} then {banned:?}");
    let forced_id = first_id("Banana");
    let (_, piece) = s.post("/detokenize", &json!({"tokens": [forced_id]}));
    let piece = piece["content"].as_str().unwrap().to_string();
    let forced = chat(
        &s,
        &json!({"temperature": 0, "logit_bias": {forced_id.to_string(): 100}}),
    );
    assert!(forced.starts_with(&piece), "{piece:?} forced, got {forced:?}");
}

/// The answer's first words, to stop on.
fn words(text: &str, n: usize) -> Vec<String> {
    text.split_whitespace().take(n).map(str::to_string).collect()
}

/// Anthropic's `stop_sequence` names the sequence that matched, among several, streamed and not.
#[test]
fn anthropic_stop_sequence_names_the_one_that_matched() {
    let s = Server::start();
    let base = json!({"messages": [{"role": "user", "content": QUESTION}], "max_tokens": TOKENS, "temperature": 0});
    let full = message(&s, &base);
    let w = words(&full, 4);
    assert!(w.len() == 4, "{full}");
    let stop = w[2].clone();
    let stops = json!(["never-generated-1", stop, "never-generated-2"]);
    let (status, v) = s.post("/v1/messages", &merged(&base, &json!({"stop_sequences": stops})));
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["stop_reason"], "stop_sequence", "{v}");
    assert_eq!(v["stop_sequence"], json!(stop), "{v}");
    assert!(!v["content"][0]["text"].as_str().unwrap().contains(&stop));

    let r = s
        .client
        .post(s.url("/v1/messages"))
        .json(&merged(&base, &json!({"stop_sequences": stops, "stream": true})))
        .send()
        .unwrap();
    let events = SseReader::new(r).rest();
    let delta = events
        .iter()
        .find(|e| e.event == "message_delta")
        .expect("a message_delta");
    let delta: Value = serde_json::from_str(&delta.data).unwrap();
    assert_eq!(delta["delta"]["stop_sequence"], json!(stop), "{delta}");

    // An answer that ends another way has none.
    let (_, v) = s.post(
        "/v1/messages",
        &merged(&base, &json!({"stop_sequences": ["never-generated"]})),
    );
    assert_eq!(v["stop_sequence"], Value::Null, "{v}");
}

/// `system` as a string or as text blocks is the same prompt: the same `input_tokens` from `count_tokens` and
/// from the answer, and `count_tokens` counts it (a longer system, more tokens).
#[test]
fn anthropic_system_string_and_blocks_count_the_same() {
    let s = Server::start();
    let messages = json!([{"role": "user", "content": "Hi"}]);
    let count = |system: Value| {
        let mut req = json!({"messages": messages});
        if !system.is_null() {
            req["system"] = system;
        }
        let (status, v) = s.post("/v1/messages/count_tokens", &req);
        assert_eq!(status, 200, "{v}");
        v["input_tokens"].as_u64().unwrap()
    };
    let text = "You answer in one short sentence.";
    let as_string = count(json!(text));
    let as_blocks = count(json!([{"type": "text", "text": text}]));
    assert_eq!(as_string, as_blocks);
    assert!(count(json!(format!("{text} {text}"))) > as_string);
    let (status, v) = s.post(
        "/v1/messages",
        &json!({"messages": messages, "system": [{"type": "text", "text": text}], "max_tokens": 2}),
    );
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["usage"]["input_tokens"].as_u64().unwrap(), as_string);
}

/// A streamed OpenAI answer carries `usage` only with `stream_options.include_usage`, in a last chunk of its
/// own with no choices.
#[test]
fn openai_stream_usage_only_when_asked() {
    let s = Server::start();
    let base =
        json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0, "stream": true});
    let chunks = |req: &Value| -> Vec<Value> {
        let events = s.chat_stream(req).rest();
        assert_eq!(events.last().unwrap().data, "[DONE]");
        events[..events.len() - 1]
            .iter()
            .map(|e| serde_json::from_str(&e.data).unwrap())
            .collect()
    };
    let plain = chunks(&base);
    assert!(plain.iter().all(|c| c.get("usage").is_none()), "{plain:?}");
    let asked = chunks(&merged(&base, &json!({"stream_options": {"include_usage": true}})));
    let last = asked.last().unwrap();
    assert_eq!(last["choices"], json!([]));
    assert!(last["usage"]["completion_tokens"].as_u64().unwrap() > 0, "{last}");
    assert!(asked[..asked.len() - 1].iter().all(|c| c.get("usage").is_none()));
}

/// `/tokenize`, `/detokenize`, `/apply-template`, `/props` and `context_length` in `/v1/models`, as llama.cpp's
/// server answers them.
#[test]
fn helper_endpoints_answer_as_llama_server_does() {
    let s = Server::start_with(&["--parallel", "2", "--max-context", "512"], &[]);
    let (status, v) = s.post("/tokenize", &json!({"content": "Hello<|im_end|> world"}));
    assert_eq!(status, 200, "{v}");
    let ids: Vec<u64> = v["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap())
        .collect();
    assert!(
        ids.contains(&2),
        "parse_special is on by default: <|im_end|> is id 2 ({ids:?})"
    );
    let (_, plain) = s.post(
        "/tokenize",
        &json!({"content": "Hello<|im_end|> world", "parse_special": false}),
    );
    assert!(!plain["tokens"].as_array().unwrap().contains(&json!(2)), "{plain}");
    let (_, pieces) = s.post("/tokenize", &json!({"content": "Hello world", "with_pieces": true}));
    let joined: String = pieces["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["piece"].as_str().unwrap().to_string())
        .collect();
    assert!(joined.contains("Hello"), "{pieces}");

    let (status, v) = s.post("/detokenize", &json!({"tokens": ids}));
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["content"], "Hello<|im_end|> world");
    let (status, v) = s.post("/detokenize", &json!({"tokens": [1, 999_999_999]}));
    assert_eq!(status, 400, "{v}");
    assert!(v["error"]["message"].as_str().unwrap().contains("999999999"), "{v}");

    let (status, v) = s.post(
        "/apply-template",
        &json!({"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]}),
    );
    assert_eq!(status, 200, "{v}");
    assert_eq!(
        v["prompt"],
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n"
    );

    let props: Value = s.client.get(s.url("/props")).send().unwrap().json().unwrap();
    assert_eq!(props["total_slots"], 2);
    assert_eq!(props["default_generation_settings"]["n_ctx"], 512);
    let p = &props["default_generation_settings"]["params"];
    assert_eq!(
        (p["temperature"].as_f64(), p["top_k"].as_u64()),
        (Some(1.0), Some(40)),
        "{props}"
    );
    assert!(props["chat_template"].as_str().unwrap().contains("im_start"), "{props}");
    let models: Value = s.client.get(s.url("/v1/models")).send().unwrap().json().unwrap();
    assert_eq!(models["data"][0]["context_length"], 512);
}

/// A generation cut by `max_tokens` inside a multi-byte character ends before it, never with U+FFFD.
#[test]
fn a_cut_character_is_dropped_not_replaced() {
    let s = Server::start();
    // Emoji and CJK text take several byte tokens each in SmolLM2's vocabulary; forcing the prompt to repeat
    // them makes greedy decoding produce them, and a small max_tokens cuts one.
    let prompt = "🐱🐱🐱🐱🐱🐱🐱🐱🐱🐱🐱🐱🐱🐱🐱🐱";
    let mut saw_cut = false;
    for max in 1..=6 {
        let (status, v) = s.post(
            "/v1/completions",
            &json!({"prompt": prompt, "max_tokens": max, "temperature": 0}),
        );
        assert_eq!(status, 200, "{v}");
        let text = v["choices"][0]["text"].as_str().unwrap();
        assert!(!text.contains('\u{FFFD}'), "max_tokens {max}: {text:?}");
        let generated = v["usage"]["completion_tokens"].as_u64().unwrap();
        // Tokens generated, no character completed: the answer was cut inside one.
        saw_cut |= generated > 0 && text.is_empty();
    }
    assert!(
        saw_cut,
        "no answer was cut inside a character: the test does not test the cut"
    );
}

/// What the SDKs send back after a tool call: an assistant turn with `content: null` and `tool_calls`, then a
/// `tool` message. It is rendered by the template (SmolLM2's prints no calls, so they are written into the turn's
/// text) and answered, not refused.
#[test]
fn an_assistant_turn_with_null_content_and_a_tool_result_are_accepted() {
    let s = Server::start();
    let messages = json!([
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": "{\"location\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 C and sunny"}
    ]);
    let (status, v) = s.post(
        "/v1/chat/completions",
        &json!({"messages": messages, "max_tokens": 4, "temperature": 0}),
    );
    assert_eq!(status, 200, "{v}");
    let (_, p) = s.post("/apply-template", &json!({"messages": messages}));
    let prompt = p["prompt"].as_str().unwrap();
    assert!(
        prompt.contains("<|im_start|>assistant\n<tool_call>{\"name\":\"get_weather\"")
            && prompt.contains("21 C and sunny"),
        "{prompt}"
    );
}

/// `strata generate --logprobs FILE --top-logprobs N`: one JSON line a token.
fn generated_logprobs(chat: bool, prompt: &str, flags: &[String], top: usize) -> Vec<Value> {
    let file = tempfile::NamedTempFile::new().unwrap();
    let mut f = flags.to_vec();
    f.extend([
        "--logprobs".to_string(),
        file.path().display().to_string(),
        "--top-logprobs".to_string(),
        top.to_string(),
    ]);
    generate(chat, prompt, &f);
    std::fs::read_to_string(file.path())
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// `logprobs` and `top_logprobs` on chat completions and `logprobs` on legacy completions, streamed and not: the
/// same numbers as `strata generate --logprobs` for the same request (penalties included), a log-distribution
/// (alternatives most likely first, their probabilities summing to at most 1, the greedy token the first),
/// and one entry per generated token.
#[test]
fn logprobs_agree_with_strata_generate_streamed_and_not() {
    let s = Server::start_with(&["--parallel", "1"], &[]);
    for fields in [
        json!({"temperature": 0}),
        json!({"temperature": 0, "frequency_penalty": 1.0}),
    ] {
        let req = merged(
            &json!({"messages": [{"role": "user", "content": QUESTION}], "max_tokens": TOKENS,
                    "logprobs": true, "top_logprobs": 3}),
            &fields,
        );
        let (status, v) = s.post("/v1/chat/completions", &req);
        assert_eq!(status, 200, "{v}");
        let content = v["choices"][0]["logprobs"]["content"].as_array().unwrap().clone();
        assert_eq!(
            content.len() as u64,
            v["usage"]["completion_tokens"].as_u64().unwrap(),
            "{v}"
        );
        let joined: String = content.iter().map(|e| e["token"].as_str().unwrap()).collect();
        assert_eq!(joined, v["choices"][0]["message"]["content"].as_str().unwrap());
        let want = generated_logprobs(true, QUESTION, &flags(&fields), 3);
        assert_eq!(want.len(), content.len());
        for (e, w) in content.iter().zip(&want) {
            assert_eq!(e["token"], w["token"]);
            let (a, b) = (e["logprob"].as_f64().unwrap(), w["logprob"].as_f64().unwrap());
            assert!((a - b).abs() <= 1e-5, "{e} vs {w}");
            let top = e["top_logprobs"].as_array().unwrap();
            assert_eq!(top.len(), 3);
            assert_eq!(top[0]["token"], e["token"], "greedy: the token is the most likely");
            let lps: Vec<f64> = top.iter().map(|t| t["logprob"].as_f64().unwrap()).collect();
            assert!(lps.windows(2).all(|p| p[0] >= p[1]) && lps[0] <= 0.0, "{lps:?}");
            assert!(lps.iter().map(|l| l.exp()).sum::<f64>() <= 1.0 + 1e-6);
            assert_eq!(e["bytes"].as_array().unwrap().len(), e["token"].as_str().unwrap().len());
        }
        // Streamed: the chunks' entries are the same.
        let mut sreq = req.clone();
        sreq["stream"] = json!(true);
        let events = s.chat_stream(&sreq).rest();
        let streamed: Vec<Value> = events[..events.len() - 1]
            .iter()
            .filter_map(|e| {
                let c: Value = serde_json::from_str(&e.data).unwrap();
                c["choices"][0]["logprobs"]["content"].as_array().cloned()
            })
            .flatten()
            .collect();
        assert_eq!(streamed, content);
    }

    // Legacy completions: `logprobs: N`.
    let (status, v) = s.post(
        "/v1/completions",
        &json!({"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "logprobs": 2}),
    );
    assert_eq!(status, 200, "{v}");
    let lp = &v["choices"][0]["logprobs"];
    let tokens: Vec<&str> = lp["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_str().unwrap())
        .collect();
    assert_eq!(tokens.concat(), v["choices"][0]["text"].as_str().unwrap());
    assert_eq!(lp["token_logprobs"].as_array().unwrap().len(), tokens.len());
    assert_eq!(lp["top_logprobs"][0].as_object().unwrap().len(), 2, "{lp}");
    let offsets: Vec<u64> = lp["text_offset"]
        .as_array()
        .unwrap()
        .iter()
        .map(|o| o.as_u64().unwrap())
        .collect();
    assert_eq!(offsets[0], 0);
    assert!(offsets.windows(2).all(|p| p[0] <= p[1]));
    // Without asking: null.
    let (_, v) = s.post("/v1/completions", &json!({"prompt": PROMPT, "max_tokens": 2}));
    assert_eq!(v["choices"][0]["logprobs"], Value::Null);

    for (bad, field) in [
        (json!({"logprobs": true, "top_logprobs": 21}), "top_logprobs"),
        (json!({"top_logprobs": 2}), "top_logprobs"),
        (json!({"logprobs": "yes"}), "logprobs"),
    ] {
        let req = merged(
            &json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}),
            &bad,
        );
        let (status, v) = s.post("/v1/chat/completions", &req);
        assert_eq!(status, 400, "{bad}: {v}");
        assert_eq!(v["error"]["param"], field, "{v}");
    }
}

/// `n` choices decode the same prompt as separate sequences (batched): with a seed, choice i draws with seed + i,
/// so choice 0 is the answer of the same request with n 1; usage counts every choice's tokens; a stream carries
/// each choice's index and finish; `n` outside 1..16 is a 400.
#[test]
fn n_choices_are_decoded_as_separate_sequences() {
    let s = Server::start();
    let base =
        json!({"messages": [{"role": "user", "content": QUESTION}], "max_tokens": 8, "temperature": 1.0, "seed": 5});
    let (status, v) = s.post("/v1/chat/completions", &merged(&base, &json!({"n": 3})));
    assert_eq!(status, 200, "{v}");
    let choices = v["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 3);
    let texts: Vec<&str> = choices
        .iter()
        .map(|c| c["message"]["content"].as_str().unwrap())
        .collect();
    for (i, c) in choices.iter().enumerate() {
        assert_eq!(c["index"], i);
    }
    let one = chat(&s, &base);
    assert_eq!(texts[0], one, "choice 0 is the n = 1 answer");
    let seed6 = chat(&s, &merged(&base, &json!({"seed": 6})));
    assert_eq!(texts[1], seed6, "choice 1 draws with seed + 1");
    assert_eq!(v["usage"]["completion_tokens"], 24, "{v}");

    let events = s.chat_stream(&merged(&base, &json!({"n": 2, "stream": true}))).rest();
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(&e.data).unwrap())
        .collect();
    for (i, want) in texts.iter().take(2).enumerate() {
        let text: String = chunks
            .iter()
            .filter(|c| c["choices"][0]["index"] == i)
            .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
            .collect();
        assert_eq!(&text, want, "streamed choice {i}");
        assert!(
            chunks
                .iter()
                .any(|c| c["choices"][0]["index"] == i && c["choices"][0]["finish_reason"].is_string())
        );
    }
    for bad in [0, 17] {
        let (status, v) = s.post("/v1/chat/completions", &merged(&base, &json!({"n": bad})));
        assert_eq!(status, 400, "{v}");
        assert_eq!(v["error"]["param"], "n");
    }
    // Each choice is a request in the queue: more choices than --max-queue could never all be queued (an idle
    // server answered 503 for ever), so they are refused as a bad request naming the flag.
    let small = Server::start_with(&["--max-queue", "2"], &[]);
    let (status, v) = small.post("/v1/chat/completions", &merged(&base, &json!({"n": 3})));
    assert_eq!(status, 400, "{v}");
    assert_eq!(v["error"]["param"], "n");
    assert!(v["error"]["message"].as_str().unwrap().contains("--max-queue"), "{v}");
    let (status, v) = small.post("/v1/chat/completions", &merged(&base, &json!({"n": 2})));
    assert_eq!(status, 200, "{v}");
}

/// Review fixes: U+FDD0 typed in a message is kept; a repeat_penalty small enough to overflow the logits is a
/// 400; a type error names its field where serde can tell it (not inside the flattened sampling fields); legacy logprobs write partial-character tokens as `bytes:` and keep their
/// offsets inside the text.
#[test]
fn odd_values_are_kept_refused_or_written_as_openai_does() {
    let s = Server::start();
    let (_, p) = s.post(
        "/apply-template",
        &json!({"messages": [{"role": "user", "content": "x\u{FDD0}y"}]}),
    );
    assert!(p["prompt"].as_str().unwrap().contains("x\u{FDD0}y"), "{p}");
    let chat = |extra: Value| {
        merged(
            &json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}),
            &extra,
        )
    };
    let (status, v) = s.post("/v1/chat/completions", &chat(json!({"repeat_penalty": 1e-38})));
    assert_eq!(
        (status, v["error"]["param"].as_str()),
        (400, Some("repeat_penalty")),
        "{v}"
    );
    let (status, v) = s.post(
        "/v1/chat/completions",
        &json!({"messages": [{"role": 5, "content": "Hi"}]}),
    );
    assert_eq!(
        (status, v["error"]["param"].as_str()),
        (400, Some("messages[0].role")),
        "{v}"
    );
    let (status, v) = s.post(
        "/v1/completions",
        &json!({"prompt": "Translate to Chinese: hello =", "max_tokens": 6, "logprobs": 5, "temperature": 0}),
    );
    assert_eq!(status, 200, "{v}");
    let text = v["choices"][0]["text"].as_str().unwrap();
    let lp = &v["choices"][0]["logprobs"];
    let chars = text.chars().count() as u64;
    for o in lp["text_offset"].as_array().unwrap() {
        assert!(o.as_u64().unwrap() <= chars, "{lp} vs {text:?}");
    }
    let tokens: Vec<&str> = lp["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_str().unwrap())
        .collect();
    assert!(tokens.iter().all(|t| !t.contains('\u{FFFD}')), "{tokens:?}");
}
