//! Structured output through `strata serve` (issue 18, point 2): OpenAI's `response_format` (`json_object`,
//! `json_schema`) and Anthropic's `output_format`, enforced by constrained decoding: the answer always parses and
//! validates, streamed and not, greedy and sampled; a schema the engine cannot enforce is a 400 naming the part.

use crate::serve_common::Server;
use serde_json::{Value, json};

fn cat_schema() -> Value {
    json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 16},
            "lives": {"type": "integer", "minimum": 1, "maximum": 9},
            "indoor": {"type": "boolean"}
        },
        "required": ["name", "lives", "indoor"],
        "additionalProperties": false
    })
}

fn assert_cat(text: &str) {
    let v: Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("{e}: {text:?}"));
    let o = v.as_object().unwrap();
    assert_eq!(o.len(), 3, "{text}");
    assert!(o["name"].as_str().unwrap().chars().count() <= 16, "{text}");
    assert!((1..=9).contains(&o["lives"].as_i64().unwrap()), "{text}");
    assert!(o["indoor"].is_boolean(), "{text}");
}

#[test]
fn structured_output_always_parses_and_validates() {
    let s = Server::start();
    let messages = json!([{"role": "user", "content": "Tell me about a cat."}]);
    let format = json!({"type": "json_schema", "json_schema": {"name": "cat", "strict": true, "schema": cat_schema()}});
    for sampling in [json!({"temperature": 0}), json!({"temperature": 1.2, "seed": 9})] {
        let mut req = json!({"messages": messages, "max_tokens": 120, "response_format": format});
        for (k, v) in sampling.as_object().unwrap() {
            req[k] = v.clone();
        }
        let (status, v) = s.post("/v1/chat/completions", &req);
        assert_eq!(status, 200, "{v}");
        assert_eq!(v["choices"][0]["finish_reason"], "stop", "{v}");
        assert_cat(v["choices"][0]["message"]["content"].as_str().unwrap());
        // Streamed.
        req["stream"] = json!(true);
        let events = s.chat_stream(&req).rest();
        let text: String = events[..events.len() - 1]
            .iter()
            .filter_map(|e| {
                let c: Value = serde_json::from_str(&e.data).ok()?;
                c["choices"][0]["delta"]["content"].as_str().map(str::to_string)
            })
            .collect();
        assert_cat(&text);
    }

    // Three choices of one request, each under a clone of the grammar the worker compiled once, sampled side by
    // side: each that ends is a cat; one cut at max_tokens (the schema allows whitespace, which a hot sampler may
    // write at length) is one begun. (tests/cpu's grammar tests count the compiles.)
    let (status, v) = s.post(
        "/v1/chat/completions",
        &json!({"messages": messages, "max_tokens": 120, "temperature": 1.2, "seed": 4, "n": 3,
                "response_format": format}),
    );
    assert_eq!(status, 200, "{v}");
    let choices = v["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 3, "{v}");
    let mut ended = 0;
    for c in choices {
        let text = c["message"]["content"].as_str().unwrap();
        match c["finish_reason"].as_str() {
            Some("stop") => {
                assert_cat(text);
                ended += 1;
            }
            Some("length") => assert!(text.trim_start().starts_with('{'), "{text}"),
            _ => panic!("{v}"),
        }
    }
    assert!(ended > 0, "no choice ended: {v}");

    // json_object: any JSON object.
    let (status, v) = s.post(
        "/v1/chat/completions",
        &json!({"messages": messages, "max_tokens": 80, "temperature": 0, "response_format": {"type": "json_object"}}),
    );
    assert_eq!(status, 200, "{v}");
    let text = v["choices"][0]["message"]["content"].as_str().unwrap();
    if v["choices"][0]["finish_reason"] == "stop" {
        assert!(serde_json::from_str::<Value>(text).unwrap().is_object(), "{text}");
    } else {
        assert!(text.trim_start().starts_with('{'), "{text}");
    }

    // Legacy completions take response_format too.
    let (status, v) = s.post(
        "/v1/completions",
        &json!({"prompt": "A cat:", "max_tokens": 120, "temperature": 0, "response_format": format}),
    );
    assert_eq!(status, 200, "{v}");
    assert_cat(v["choices"][0]["text"].as_str().unwrap());

    // Anthropic's output_format.
    let (status, v) = s.post(
        "/v1/messages",
        &json!({"messages": messages, "max_tokens": 120, "temperature": 0,
                "output_format": {"type": "json_schema", "schema": cat_schema()}}),
    );
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["stop_reason"], "end_turn", "{v}");
    assert_cat(v["content"][0]["text"].as_str().unwrap());
}

#[test]
fn unenforceable_formats_are_refused_naming_the_part() {
    let s = Server::start();
    let messages = json!([{"role": "user", "content": "Hi"}]);
    for (format, param) in [
        (
            json!({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}),
            "response_format.json_schema.schema",
        ),
        (
            json!({"type": "json_schema", "json_schema": {"name": "x"}}),
            "response_format.json_schema.schema",
        ),
        (json!({"type": "yaml"}), "response_format.type"),
        // A schema no value satisfies: a $ref that only leads back to itself, through anyOf or allOf.
        (
            json!({"type": "json_schema", "json_schema": {"name": "x", "schema": {"anyOf": [{"$ref": "#"}]}}}),
            "response_format.json_schema.schema",
        ),
        (
            json!({"type": "json_schema", "json_schema": {"name": "x", "schema":
                {"$defs": {"a": {"allOf": [{"$ref": "#/$defs/a"}]}}, "$ref": "#/$defs/a"}}}),
            "response_format.json_schema.schema",
        ),
    ] {
        let (status, v) = s.post(
            "/v1/chat/completions",
            &json!({"messages": messages, "max_tokens": 4, "response_format": format}),
        );
        assert_eq!(status, 400, "{format}: {v}");
        assert_eq!(v["error"]["param"], param, "{v}");
        assert!(v["error"]["message"].as_str().unwrap().contains(param), "{v}");
    }
    let (status, v) = s.post(
        "/v1/messages",
        &json!({"messages": messages, "max_tokens": 4, "output_format": {"type": "json_schema", "schema": {"type": "strin"}}}),
    );
    assert_eq!(status, 400, "{v}");
    assert!(
        v["error"]["message"].as_str().unwrap().contains("output_format.schema"),
        "{v}"
    );
    // The server still answers.
    let (status, _) = s.post("/v1/chat/completions", &json!({"messages": messages, "max_tokens": 2}));
    assert_eq!(status, 200);
}
