//! Tool calling through `strata serve` on the default model (issue 18, point 1). SmolLM2's template shows no
//! tools, so they are offered by the generic prompt in the Hermes format; `tool_choice: required` and a named
//! function force the answer through the constrained decoder into a well-formed call, which is parsed back into
//! OpenAI's `tool_calls` and Anthropic's `tool_use`; an agent loop (call, result, answer) runs end to end.

use crate::serve_common::Server;
use serde_json::{Value, json};

fn tools() -> Value {
    json!([
        {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                           "required": ["city"], "additionalProperties": false}}},
        {"type": "function", "function": {"name": "get_time", "description": "Current time in a time zone",
            "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 20}},
                           "required": ["zone"], "additionalProperties": false}}}
    ])
}

fn ask() -> Value {
    json!([{"role": "user", "content": "What is the weather in Paris?"}])
}

#[test]
fn forced_calls_parse_into_tool_calls_streamed_and_not() {
    let s = Server::start();
    for (choice, want) in [
        (json!("required"), None),
        (
            json!({"type": "function", "function": {"name": "get_time"}}),
            Some("get_time"),
        ),
    ] {
        let req = json!({"messages": ask(), "tools": tools(), "tool_choice": choice, "max_tokens": 80,
                         "temperature": 0, "parallel_tool_calls": false});
        let (status, v) = s.post("/v1/chat/completions", &req);
        assert_eq!(status, 200, "{v}");
        let choice0 = &v["choices"][0];
        assert_eq!(choice0["finish_reason"], "tool_calls", "{v}");
        let calls = choice0["message"]["tool_calls"].as_array().unwrap();
        assert_eq!(calls.len(), 1, "parallel_tool_calls false: one call ({v})");
        let f = &calls[0]["function"];
        let name = f["name"].as_str().unwrap();
        assert!(["get_weather", "get_time"].contains(&name));
        if let Some(w) = want {
            assert_eq!(name, w);
        }
        let args: Value = serde_json::from_str(f["arguments"].as_str().unwrap()).unwrap();
        let key = if name == "get_weather" { "city" } else { "zone" };
        assert!(args[key].is_string() && args.as_object().unwrap().len() == 1, "{args}");
        assert!(calls[0]["id"].as_str().unwrap().starts_with("call_"));

        // Streamed: a head delta (id, name, empty arguments), then the arguments.
        let mut sreq = req.clone();
        sreq["stream"] = json!(true);
        let events = s.chat_stream(&sreq).rest();
        let chunks: Vec<Value> = events[..events.len() - 1]
            .iter()
            .map(|e| serde_json::from_str(&e.data).unwrap())
            .collect();
        let deltas: Vec<&Value> = chunks
            .iter()
            .filter_map(|c| c["choices"][0]["delta"]["tool_calls"].get(0))
            .collect();
        assert_eq!(deltas.len(), 2, "{chunks:?}");
        assert_eq!(deltas[0]["function"]["name"], name);
        let streamed_args: String = deltas
            .iter()
            .filter_map(|d| d["function"]["arguments"].as_str())
            .collect();
        assert_eq!(streamed_args, f["arguments"].as_str().unwrap());
        let finish = chunks
            .iter()
            .find_map(|c| c["choices"][0]["finish_reason"].as_str())
            .unwrap();
        assert_eq!(finish, "tool_calls");
        let content: String = chunks
            .iter()
            .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
            .collect();
        assert!(!content.contains("<tool_call>"), "{content}");
    }
}

/// The agent loop: the model calls a tool, gets its result back as the SDKs send it (the assistant turn with
/// `content: null` and `tool_calls`, then a `tool` message), and answers in text.
#[test]
fn an_agent_loop_runs_end_to_end() {
    let s = Server::start();
    let (_, v) = s.post(
        "/v1/chat/completions",
        &json!({"messages": ask(), "tools": tools(), "tool_choice": "required", "max_tokens": 80, "temperature": 0}),
    );
    let message = v["choices"][0]["message"].clone();
    let call = &message["tool_calls"][0];
    let mut messages = ask().as_array().unwrap().clone();
    messages.push(message.clone());
    messages
        .push(json!({"role": "tool", "tool_call_id": call["id"], "content": "{\"sky\": \"clear\", \"celsius\": 21}"}));
    let (status, v) = s.post(
        "/v1/chat/completions",
        &json!({"messages": messages, "tools": tools(), "tool_choice": "none", "max_tokens": 24, "temperature": 0}),
    );
    assert_eq!(status, 200, "{v}");
    assert!(
        v["choices"][0]["message"]["tool_calls"].is_null(),
        "tool_choice none: {v}"
    );
    assert!(!v["choices"][0]["message"]["content"].as_str().unwrap().is_empty());
    // `auto` answers too (a call or text, as the model decides).
    let (status, v) = s.post(
        "/v1/chat/completions",
        &json!({"messages": ask(), "tools": tools(), "max_tokens": 40, "temperature": 0}),
    );
    assert_eq!(status, 200, "{v}");
    let f = v["choices"][0]["finish_reason"].as_str().unwrap();
    assert!(["stop", "length", "tool_calls"].contains(&f), "{v}");
}

#[test]
fn bad_tools_are_refused_naming_the_field() {
    let s = Server::start();
    for (extra, param) in [
        (json!({"tools": [{"type": "retrieval"}]}), "tools[0].type"),
        (
            json!({"tools": [{"type": "function", "function": {"name": "has space"}}]}),
            "tools[0].function",
        ),
        (
            json!({"tools": [{"type": "function", "function": {"name": "f", "parameters": 3}}]}),
            "tools[0].function",
        ),
        (
            json!({"tools": tools(), "tool_choice": {"type": "function", "function": {"name": "nope"}}}),
            "tool_choice",
        ),
        (json!({"tool_choice": "required"}), "tool_choice"),
        (json!({"tools": tools(), "tool_choice": "sometimes"}), "tool_choice"),
    ] {
        let mut req = json!({"messages": ask(), "max_tokens": 4});
        for (k, v) in extra.as_object().unwrap() {
            req[k] = v.clone();
        }
        let (status, v) = s.post("/v1/chat/completions", &req);
        assert_eq!(status, 400, "{extra}: {v}");
        assert_eq!(v["error"]["param"], param, "{v}");
    }
}

fn anthropic_tools() -> Value {
    json!([
        {"name": "get_weather", "description": "Current weather in a city",
         "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                          "required": ["city"], "additionalProperties": false}}
    ])
}

/// Anthropic's tools: `tool_choice: any` forces a `tool_use` block (streamed as a tool_use block with an
/// input_json_delta), its `tool_result` goes back in a user turn, and `count_tokens` counts the tools.
#[test]
fn anthropic_tool_use_round_trip() {
    let s = Server::start();
    let req = json!({"messages": ask(), "tools": anthropic_tools(),
                     "tool_choice": {"type": "any", "disable_parallel_tool_use": true},
                     "max_tokens": 80, "temperature": 0});
    let (status, v) = s.post("/v1/messages", &req);
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["stop_reason"], "tool_use", "{v}");
    let uses = v["content"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|b| b["type"] == "tool_use")
        .count();
    assert_eq!(uses, 1, "disable_parallel_tool_use: one call ({v})");
    let block = v["content"]
        .as_array()
        .unwrap()
        .iter()
        .find(|b| b["type"] == "tool_use")
        .unwrap()
        .clone();
    assert_eq!(block["name"], "get_weather");
    assert!(block["input"]["city"].is_string(), "{block}");
    assert!(block["id"].as_str().unwrap().starts_with("toolu_"));

    let mut sreq = req.clone();
    sreq["stream"] = json!(true);
    let r = s.client.post(s.url("/v1/messages")).json(&sreq).send().unwrap();
    let events = crate::serve_common::SseReader::new(r).rest();
    let data: Vec<Value> = events.iter().map(|e| serde_json::from_str(&e.data).unwrap()).collect();
    let start = data
        .iter()
        .find(|d| d["type"] == "content_block_start" && d["content_block"]["type"] == "tool_use")
        .expect("a tool_use block");
    assert_eq!(start["content_block"]["name"], "get_weather");
    let partial: String = data
        .iter()
        .filter_map(|d| d["delta"]["partial_json"].as_str())
        .collect();
    assert_eq!(serde_json::from_str::<Value>(&partial).unwrap(), block["input"]);
    let delta = data.iter().find(|d| d["type"] == "message_delta").unwrap();
    assert_eq!(delta["delta"]["stop_reason"], "tool_use");

    // The result goes back; the model answers in text.
    let messages = json!([
        ask()[0],
        {"role": "assistant", "content": [block]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": block["id"], "content": "21 C, clear"}]}
    ]);
    let (status, v) = s.post(
        "/v1/messages",
        &json!({"messages": messages, "tools": anthropic_tools(), "tool_choice": {"type": "none"}, "max_tokens": 24, "temperature": 0}),
    );
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["content"][0]["type"], "text", "{v}");

    // count_tokens counts the tools as the real call renders them.
    let count = |body: Value| {
        s.post("/v1/messages/count_tokens", &body).1["input_tokens"]
            .as_u64()
            .unwrap()
    };
    let with = count(json!({"messages": ask(), "tools": anthropic_tools()}));
    let without = count(json!({"messages": ask()}));
    assert!(with > without, "{with} vs {without}");
    assert_eq!(
        with,
        s.post(
            "/v1/messages",
            &json!({"messages": ask(), "tools": anthropic_tools(), "max_tokens": 1})
        )
        .1["usage"]["input_tokens"]
            .as_u64()
            .unwrap()
    );

    // Bad input.
    for bad in [
        json!({"tools": [{"name": "x y", "input_schema": {}}]}),
        json!({"tools": anthropic_tools(), "tool_choice": {"type": "tool", "name": "nope"}}),
        json!({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}),
        json!({"tool_choice": {"type": "any"}}),
    ] {
        let mut req = json!({"messages": ask(), "max_tokens": 4});
        for (k, v) in bad.as_object().unwrap() {
            req[k] = v.clone();
        }
        let (status, v) = s.post("/v1/messages", &req);
        assert_eq!(status, 400, "{bad}: {v}");
        assert_eq!(v["type"], "error");
    }
}

/// What the attack and the new-user review found, held: a `$ref` chain deep enough to overflow the schema
/// compiler is a 400 (and the server lives); a tool schema with its own `$defs` is forced correctly; a forced
/// answer cut by max_tokens ends as `length` without the half call in its text; stop strings cannot cut a
/// structured answer; a template without tool support still shows the calls made; `/apply-template` takes tools.
#[test]
fn tool_and_schema_edge_cases_hold() {
    let s = Server::start();
    // A chat request of 4 tokens whose answer must match `schema`.
    let with_schema = |schema: &Value| {
        json!({"messages": ask(), "max_tokens": 4,
               "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}})
    };
    // A 1000-long $ref chain.
    let mut defs = serde_json::Map::new();
    for i in 0..1000 {
        defs.insert(format!("a{i}"), json!({"$ref": format!("#/$defs/a{}", i + 1)}));
    }
    defs.insert("a1000".into(), json!({"type": "integer"}));
    let schema = json!({"$ref": "#/$defs/a0", "$defs": defs});
    let (status, v) = s.post("/v1/chat/completions", &with_schema(&schema));
    assert_eq!(status, 400, "{v}");
    assert!(v["error"]["message"].as_str().unwrap().contains("nests deeper"), "{v}");
    let (status, v) = s.post(
        "/v1/messages",
        &json!({"messages": ask(), "max_tokens": 4, "output_config": {"format": {"type": "json_schema", "schema": schema}}}),
    );
    assert_eq!(status, 400, "{v}");
    assert_eq!(s.health()["status"], "ok");
    // Flat schemas (the depth check passes them) whose objects llguidance's compiler recursed through until the
    // stack overflowed: 10,000 properties; 10,000 names only in `required`; seven `allOf` branches of 1,000.
    let props = |from: usize, n: usize| -> serde_json::Map<String, Value> {
        (from..from + n)
            .map(|i| (format!("p{i}"), json!({"type": "string"})))
            .collect()
    };
    let names: Vec<String> = (0..10_000).map(|i| format!("p{i}")).collect();
    let branches: Vec<Value> = (0..7)
        .map(|b| json!({"type": "object", "properties": props(1000 * b, 1000)}))
        .collect();
    let wide_ones = [
        (json!({"type": "object", "properties": props(0, 10_000)}), 10_000),
        (json!({"type": "object", "required": names}), 10_000),
        (json!({"allOf": branches}), 7_000),
    ];
    for (wide, n) in &wide_ones {
        let (status, v) = s.post("/v1/chat/completions", &with_schema(wide));
        assert_eq!(status, 400, "{v}");
        assert!(
            v["error"]["message"]
                .as_str()
                .unwrap()
                .contains(&format!("{n} property names")),
            "{v}"
        );
        let (status, v) = s.post(
            "/v1/chat/completions",
            &json!({"messages": ask(), "max_tokens": 4, "tool_choice": "required",
                    "tools": [{"type": "function", "function": {"name": "f", "parameters": wide}}]}),
        );
        assert_eq!(status, 400, "{v}");
        assert!(v["error"]["message"].as_str().unwrap().contains("tools[0]"), "{v}");
    }
    assert_eq!(s.health()["status"], "ok");
    // $refs that lead back to themselves through $refs alone describe no value: refused up front (they used to
    // pass, and the answer ended empty with "stop" when the constraint engine found out mid-answer).
    let loops = [
        json!({"$ref": "#"}),
        json!({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}),
        json!({"$defs": {"a": {"$ref": "#/$defs/a"}}, "type": "object", "properties": {"x": {"$ref": "#/$defs/a"}},
               "required": ["x"]}),
    ];
    for looped in &loops {
        let (status, v) = s.post("/v1/chat/completions", &with_schema(looped));
        assert_eq!(status, 400, "{looped}: {v}");
        assert!(
            v["error"]["message"].as_str().unwrap().contains("leads back to itself"),
            "{v}"
        );
    }
    let (status, v) = s.post(
        "/v1/chat/completions",
        &json!({"messages": ask(), "max_tokens": 4, "tool_choice": "required",
                "tools": [{"type": "function", "function": {"name": "f", "parameters": loops[2]}}]}),
    );
    assert_eq!(status, 400, "{v}");
    // A tree (a $ref back to an object that holds it) is a real schema, not a loop.
    let tree = json!({"$defs": {"n": {"type": "object", "properties": {"kids": {"type": "array", "maxItems": 2,
                      "items": {"$ref": "#/$defs/n"}}}, "additionalProperties": false}}, "$ref": "#/$defs/n"});
    let (status, v) = s.post("/v1/chat/completions", &with_schema(&tree));
    assert_eq!(status, 200, "{v}");
    // A $ref inside a value (a default) is data, not a loop.
    let (status, v) = s.post(
        "/v1/chat/completions",
        &with_schema(&json!({"type": "object", "default": {"$ref": "#/default"}})),
    );
    assert_eq!(status, 200, "{v}");
    // A tool's arguments are an object: parameters of another type are refused (OpenAI's rule); a list of types
    // holding "object" passes.
    let (status, v) = s.post(
        "/v1/chat/completions",
        &json!({"messages": ask(), "max_tokens": 4, "tools": [{"type": "function", "function": {"name": "f",
                "parameters": {"type": ["object", "null"], "properties": {"a": {"type": "string"}}}}}]}),
    );
    assert_eq!(status, 200, "{v}");
    let (status, v) = s.post(
        "/v1/chat/completions",
        &json!({"messages": ask(), "max_tokens": 4, "tool_choice": "required",
                "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]}),
    );
    assert_eq!(status, 400, "{v}");
    assert!(
        v["error"]["message"].as_str().unwrap().contains("type \"object\""),
        "{v}"
    );

    // Pydantic-style parameters.
    let pyd = json!([{"type": "function", "function": {"name": "get_weather", "parameters": {
        "$defs": {"Loc": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                          "required": ["city"], "additionalProperties": false}},
        "type": "object", "properties": {"where": {"$ref": "#/$defs/Loc"}}, "required": ["where"],
        "additionalProperties": false}}}]);
    let (status, v) = s.post(
        "/v1/chat/completions",
        &json!({"messages": ask(), "tools": pyd, "tool_choice": "required", "parallel_tool_calls": false,
                "max_tokens": 80, "temperature": 0}),
    );
    assert_eq!(status, 200, "{v}");
    let args: Value = serde_json::from_str(
        v["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"]
            .as_str()
            .unwrap(),
    )
    .unwrap();
    assert!(args["where"]["city"].is_string(), "{args}");

    // Cut inside a forced call.
    let (status, v) = s.post(
        "/v1/chat/completions",
        &json!({"messages": ask(), "tools": tools(), "tool_choice": "required", "max_tokens": 12, "temperature": 0}),
    );
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["choices"][0]["finish_reason"], "length", "{v}");
    let content = v["choices"][0]["message"]["content"].as_str().unwrap_or("");
    assert!(!content.contains("<tool_call>"), "{v}");

    // stop with a grammar.
    let (status, v) = s.post(
        "/v1/chat/completions",
        &json!({"messages": ask(), "max_tokens": 4, "stop": [","], "response_format": {"type": "json_object"}}),
    );
    assert_eq!(status, 400, "{v}");
    assert_eq!(v["error"]["param"], "stop");

    // The calls an assistant made stay visible to a template without tool support; tools show in /apply-template.
    let messages = json!([
        ask()[0],
        {"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function",
            "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "21 C"}
    ]);
    let (status, p) = s.post("/apply-template", &json!({"messages": messages, "tools": tools()}));
    assert_eq!(status, 200, "{p}");
    let prompt = p["prompt"].as_str().unwrap();
    assert!(
        prompt.contains(r#"<tool_call>{"name":"get_weather","arguments":{"city":"Paris"}}</tool_call>"#),
        "{prompt}"
    );
    assert!(prompt.contains("get_time"), "the tools are offered: {prompt}");
    // A tool message must say which call it answers.
    let (status, v) = s.post(
        "/v1/chat/completions",
        &json!({"messages": [ask()[0], {"role": "tool", "content": "21 C"}], "max_tokens": 2}),
    );
    assert_eq!(
        (status, v["error"]["param"].as_str()),
        (400, Some("messages[1].tool_call_id")),
        "{v}"
    );
    // Anthropic: a tool_use block needs its id.
    let (status, v) = s.post(
        "/v1/messages",
        &json!({"messages": [ask()[0], {"role": "assistant", "content": [{"type": "tool_use", "name": "get_weather", "input": {}}]}],
                "max_tokens": 2}),
    );
    assert_eq!(status, 400, "{v}");
}
