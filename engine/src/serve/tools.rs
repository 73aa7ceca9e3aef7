//! Tool calling (issue 18, point 1): the tools a request offers, in the model's own format; what the model writes,
//! parsed back into calls; and, for `tool_choice: required` or a named function, a grammar that makes the answer
//! a well-formed call to a tool on offer.
//!
//! Formats, detected from the chat template (or `--tool-format`), as the models were trained (llama.cpp's
//! `common/chat.cpp` detects the same families):
//! - [`ToolFormat::Hermes`] (Hermes, Qwen 2.5 and 3, SmolLM3...): `<tool_call>\n{"name": N, "arguments": {...}}\n
//!   </tool_call>`, one block a call;
//! - [`ToolFormat::Llama3`] (Llama 3.1 to 3.3 JSON tool calling): the whole answer is `{"name": N, "parameters":
//!   {...}}`, after an optional `<|python_tag|>`;
//! - [`ToolFormat::Mistral`] (Mistral Nemo, Small): `[TOOL_CALLS][{"name": N, "arguments": {...}}, ...]`.
//!
//! A template that does not print `tools` gets [`generic_prompt`]: a system message listing the tools as JSON and
//! asking for Hermes blocks, so any chat model can be offered tools.

use serde_json::{Value, json};

use super::protocol::Finish;
use crate::runtime::grammar::GrammarSpec;

/// How a model writes its tool calls.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ToolFormat {
    /// `<tool_call>{"name", "arguments"}</tool_call>` blocks.
    Hermes,
    /// One JSON object `{"name", "parameters"}` as the whole answer.
    Llama3,
    /// `[TOOL_CALLS]` then a JSON array of `{"name", "arguments"}`.
    Mistral,
}

impl ToolFormat {
    /// The format a chat template's source shows; Hermes when it shows none (the generic prompt asks for it).
    pub fn detect(template: &str) -> ToolFormat {
        if template.contains("[TOOL_CALLS]") {
            ToolFormat::Mistral
        } else if template.contains("<tool_call>") {
            ToolFormat::Hermes
        } else if template.contains("<|python_tag|>") || template.contains("ipython") {
            ToolFormat::Llama3
        } else {
            ToolFormat::Hermes
        }
    }

    /// Text an answer's calls start with: output from it on is held back while streaming until the answer
    /// ends, then parsed.
    pub fn marker(self) -> &'static str {
        match self {
            ToolFormat::Hermes => "<tool_call>",
            ToolFormat::Llama3 => "{",
            ToolFormat::Mistral => "[TOOL_CALLS]",
        }
    }

    /// The key of a call's arguments in this format.
    fn arguments_key(self) -> &'static str {
        match self {
            ToolFormat::Llama3 => "parameters",
            _ => "arguments",
        }
    }
}

/// One function on offer.
#[derive(Debug, Clone, PartialEq)]
pub struct Tool {
    pub name: String,
    pub description: Option<String>,
    /// JSON schema of the arguments (`{"type": "object"}` when absent).
    pub parameters: Value,
}

impl Tool {
    /// The OpenAI function object the chat templates read (`{"type": "function", "function": {...}}`).
    pub fn openai(&self) -> Value {
        let mut f = json!({ "name": self.name });
        if let Some(d) = &self.description {
            f["description"] = d.clone().into();
        }
        f["parameters"] = self.parameters.clone();
        json!({ "type": "function", "function": f })
    }
}

/// Which calls the answer may or must make (OpenAI's `tool_choice`, Anthropic's `tool_choice.type`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToolChoice {
    /// No call: the tools are shown, the answer is text.
    None,
    /// The model decides.
    Auto,
    /// At least one call, to any tool.
    Required,
    /// A call to this tool.
    Named(String),
}

/// The tools a request offers and what it asks of them.
#[derive(Debug, Clone, Default)]
pub struct ToolUse {
    pub tools: Vec<Tool>,
    /// `None` with no tools.
    pub choice: Option<ToolChoice>,
    /// Several calls may be made at once (`parallel_tool_calls`, Anthropic's `disable_parallel_tool_use`).
    pub parallel: bool,
}

impl ToolUse {
    /// Whether the answer is parsed for calls (tools on offer, and the choice is not `none`).
    pub fn parses(&self) -> bool {
        !self.tools.is_empty() && !matches!(self.choice, Some(ToolChoice::None))
    }

    /// The grammar forcing a call, for `required` and a named tool ([`grammar`]).
    pub fn grammar(&self, format: ToolFormat) -> Option<GrammarSpec> {
        grammar(format, &self.tools, self.choice.as_ref()?, self.parallel)
    }

    /// A whole answer's text and calls ([`parse`]) when it is parsed for calls ([`ToolUse::parses`]), else its
    /// text alone.
    pub fn split(&self, format: ToolFormat, text: String, finish: Finish) -> (String, Vec<Call>) {
        if self.parses() {
            parse(format, &text, &self.tools, finish.is_cut())
        } else {
            (text, vec![])
        }
    }

    /// A [`CallStream`] for a streamed answer that is parsed for calls.
    pub fn stream(&self, format: ToolFormat) -> Option<CallStream> {
        self.parses().then(|| CallStream::new(format))
    }
}

/// Checks a tool name as OpenAI does: 1 to 64 of `a-z A-Z 0-9 _ -`.
fn valid_name(name: &str) -> bool {
    (1..=64).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-' || b == b'.')
}

/// Reads one tool from its name, description and parameter schema; `at` names it for errors.
///
/// Errors: a missing or invalid name, a schema that is not a JSON object or whose `type` is not `"object"` (the
/// arguments are an object, as OpenAI requires), a schema [`crate::runtime::grammar::check_schema_size`] refuses.
pub fn tool(
    at: &str,
    name: Option<&Value>,
    description: Option<&Value>,
    schema: Option<&Value>,
) -> Result<Tool, String> {
    let name = name
        .and_then(Value::as_str)
        .filter(|n| valid_name(n))
        .ok_or_else(|| format!("{at}: name must be 1 to 64 letters, digits, `_`, `-` or `.`"))?;
    let parameters = match schema {
        None | Some(Value::Null) => json!({ "type": "object" }),
        Some(s) if s.is_object() => s.clone(),
        Some(_) => return Err(format!("{at}: the parameter schema must be a JSON object")),
    };
    // `"object"`, or a list of types that holds it (`["object", "null"]`).
    if let Some(ty) = parameters.get("type")
        && ty != "object"
        && !ty.as_array().is_some_and(|t| t.iter().any(|t| t == "object"))
    {
        return Err(format!(
            "{at}: the parameter schema must have type \"object\" (the arguments are an object), not {ty}"
        ));
    }
    crate::runtime::grammar::check_schema_size(&parameters).map_err(|e| format!("{at}: {e}"))?;
    if description.is_some_and(|d| !d.is_null() && !d.is_string()) {
        return Err(format!("{at}: description must be a string"));
    }
    Ok(Tool {
        name: name.to_string(),
        description: description.and_then(Value::as_str).map(str::to_string),
        parameters,
    })
}

/// One call the model made.
#[derive(Debug, Clone, PartialEq)]
pub struct Call {
    pub name: String,
    /// The arguments object.
    pub arguments: Value,
}

/// A system message offering `tools` to a model whose template does not print them: the tools as JSON, one a
/// line, and the Hermes call format.
pub fn generic_prompt(tools: &[Tool]) -> String {
    let mut s = String::from("You can call functions to help answer. The functions, as JSON schemas, one a line:\n");
    for t in tools {
        s.push_str(&t.openai()["function"].to_string());
        s.push('\n');
    }
    s.push_str(
        "To call a function, answer with <tool_call>{\"name\": \"FUNCTION\", \"arguments\": {ARGUMENTS}}</tool_call> \
         (one block a call) and nothing else. Otherwise answer normally.",
    );
    s
}

/// The grammar an answer must follow for `choice` (`Required` or `Named`) in `format`: one call (several when
/// `parallel`) to the tools allowed, each with arguments valid against the tool's schema. `None` for `Auto` and
/// `None`.
pub fn grammar(format: ToolFormat, tools: &[Tool], choice: &ToolChoice, parallel: bool) -> Option<GrammarSpec> {
    let allowed: Vec<&Tool> = match choice {
        ToolChoice::None | ToolChoice::Auto => return None,
        ToolChoice::Required => tools.iter().collect(),
        ToolChoice::Named(n) => tools.iter().filter(|t| &t.name == n).collect(),
    };
    let key = format.arguments_key();
    // Each tool's schema goes under `$defs` of the call schema, its own `$ref`s rebased there, so that a
    // Pydantic-style schema (`{"$defs": ..., "$ref": "#/$defs/..."}`) keeps pointing at its own definitions.
    let mut defs = serde_json::Map::new();
    let calls: Vec<Value> = allowed
        .iter()
        .enumerate()
        .map(|(i, t)| {
            let mut params = t.parameters.clone();
            rebase_refs(&mut params, &format!("#/$defs/t{i}"));
            defs.insert(format!("t{i}"), params);
            json!({
                "type": "object",
                "properties": { "name": { "const": t.name }, key: { "$ref": format!("#/$defs/t{i}") } },
                "required": ["name", key],
                "additionalProperties": false,
            })
        })
        .collect();
    let with_defs = |mut root: Value| {
        root["$defs"] = Value::Object(defs.clone());
        root
    };
    let grammar = match format {
        ToolFormat::Hermes => {
            // At most MAX_PARALLEL_CALLS calls: a small model forced to call may otherwise repeat calls until
            // max_tokens.
            let mut start = String::from("call");
            if parallel {
                for _ in 1..MAX_PARALLEL_CALLS {
                    start = format!("call (\"\\n\" {start})?");
                }
            }
            let call = with_defs(json!({ "anyOf": calls }));
            format!("start: {start}\ncall: \"<tool_call>\\n\" body \"\\n</tool_call>\"\nbody: %json {call}\n")
        }
        ToolFormat::Llama3 => format!("start: body\nbody: %json {}\n", with_defs(json!({ "anyOf": calls }))),
        ToolFormat::Mistral => {
            let most = if parallel { MAX_PARALLEL_CALLS } else { 1 };
            let array =
                with_defs(json!({ "type": "array", "items": { "anyOf": calls }, "minItems": 1, "maxItems": most }));
            format!("start: \"[TOOL_CALLS]\" body\nbody: %json {array}\n")
        }
    };
    Some(GrammarSpec::Lark { grammar })
}

/// The most calls a forced answer may make at once.
pub const MAX_PARALLEL_CALLS: usize = 8;

/// Rewrites every local `$ref` in `v` (`#`, `#/...`) to point under `base` (`#/$defs/t0`, `#/$defs/t0/...`).
fn rebase_refs(v: &mut Value, base: &str) {
    match v {
        Value::Object(map) => {
            if let Some(Value::String(r)) = map.get_mut("$ref")
                && let Some(rest) = r.strip_prefix('#')
            {
                *r = format!("{base}{rest}");
            }
            for (k, x) in map.iter_mut() {
                if k != "$ref" {
                    rebase_refs(x, base);
                }
            }
        }
        Value::Array(items) => items.iter_mut().for_each(|x| rebase_refs(x, base)),
        _ => {}
    }
}

/// Splits an answer into its text and its calls. Text that looks like a call but does not parse, or names no
/// tool on offer, stays text, unless the answer was `cut` (by max_tokens or the context) inside it: a call left
/// unfinished is dropped, never shown as text.
pub fn parse(format: ToolFormat, text: &str, tools: &[Tool], cut: bool) -> (String, Vec<Call>) {
    // Cut inside the marker itself (`<tool`): that is not text either.
    let text = if cut {
        without_partial_marker(format, text)
    } else {
        text
    };
    let known = |name: &str| tools.iter().any(|t| t.name == name);
    let call_of = |v: &Value| -> Option<Call> {
        let name = v.get("name")?.as_str()?;
        if !known(name) {
            return None;
        }
        let args = v.get(format.arguments_key()).or_else(|| v.get("arguments"))?;
        // Some models write the arguments as a JSON string.
        let arguments = match args {
            Value::String(s) => serde_json::from_str(s).ok()?,
            a => a.clone(),
        };
        Some(Call {
            name: name.to_string(),
            arguments,
        })
    };
    match format {
        ToolFormat::Hermes => {
            let mut rest = String::new();
            let mut calls = Vec::new();
            let mut t = text;
            while let Some(start) = t.find("<tool_call>") {
                let after = &t[start + "<tool_call>".len()..];
                let Some(end) = after.find("</tool_call>") else {
                    break;
                };
                match serde_json::from_str::<Value>(after[..end].trim())
                    .ok()
                    .as_ref()
                    .and_then(call_of)
                {
                    Some(c) => {
                        rest.push_str(&t[..start]);
                        calls.push(c);
                    }
                    None => rest.push_str(&t[..start + "<tool_call>".len() + end + "</tool_call>".len()]),
                }
                t = &after[end + "</tool_call>".len()..];
            }
            // An unfinished call at the end (the answer was cut inside it) is not text.
            if (cut || !calls.is_empty())
                && let Some(open) = t.find("<tool_call>")
            {
                t = &t[..open];
            }
            rest.push_str(t);
            (rest.trim().to_string(), calls)
        }
        ToolFormat::Llama3 => {
            let body = text.trim().trim_start_matches("<|python_tag|>").trim();
            match serde_json::from_str::<Value>(body).ok().as_ref().and_then(call_of) {
                Some(c) => (String::new(), vec![c]),
                None if cut && body.starts_with('{') => (String::new(), vec![]),
                None => (text.to_string(), vec![]),
            }
        }
        ToolFormat::Mistral => {
            let Some(at) = text.find("[TOOL_CALLS]") else {
                return (text.to_string(), vec![]);
            };
            let body = text[at + "[TOOL_CALLS]".len()..].trim();
            let calls: Option<Vec<Call>> = serde_json::from_str::<Vec<Value>>(body)
                .ok()
                .and_then(|items| items.iter().map(call_of).collect());
            match calls {
                Some(c) if !c.is_empty() => (text[..at].trim().to_string(), c),
                _ if cut => (text[..at].trim().to_string(), vec![]),
                _ => (text.to_string(), vec![]),
            }
        }
    }
}

/// Streams an answer that may hold calls: text goes out as it comes, except from where a call may start
/// ([`ToolFormat::marker`]; for [`ToolFormat::Llama3`] only at the very start of the answer), which is held until
/// the answer ends and then parsed ([`CallStream::finish`]).
#[derive(Debug)]
pub struct CallStream {
    format: ToolFormat,
    held: String,
    /// A marker was seen: everything from it is held.
    calling: bool,
    /// Llama 3 only: text that is not a call went out, so no call can follow.
    settled: bool,
}

impl CallStream {
    pub fn new(format: ToolFormat) -> CallStream {
        CallStream {
            format,
            held: String::new(),
            calling: false,
            settled: false,
        }
    }

    /// Takes a piece of the answer; returns the text that can go out now.
    pub fn feed(&mut self, text: &str) -> String {
        self.held.push_str(text);
        if self.calling || self.settled {
            return if self.settled {
                std::mem::take(&mut self.held)
            } else {
                String::new()
            };
        }
        let marker = self.format.marker();
        if self.format == ToolFormat::Llama3 {
            let t = self.held.trim_start();
            if t.starts_with(marker) || t.starts_with("<|python_tag|>") {
                self.calling = true;
                return String::new();
            }
            if t.is_empty() || "<|python_tag|>".starts_with(t) {
                return String::new();
            }
            self.settled = true;
            return std::mem::take(&mut self.held);
        }
        if let Some(at) = self.held.find(marker) {
            self.calling = true;
            let before: String = self.held.drain(..at).collect();
            return before;
        }
        // Hold back the longest tail that may begin the marker.
        let keep = (1..marker.len().min(self.held.len() + 1))
            .rev()
            .find(|&k| {
                self.held.is_char_boundary(self.held.len() - k) && marker.starts_with(&self.held[self.held.len() - k..])
            })
            .unwrap_or(0);
        self.held.drain(..self.held.len() - keep).collect()
    }

    /// Ends the answer (`cut`: by max_tokens or the context): the text still held that is not a call, and the
    /// calls ([`parse`]).
    pub fn finish(self, tools: &[Tool], cut: bool) -> (String, Vec<Call>) {
        if !self.calling {
            let held = if cut {
                without_partial_marker(self.format, &self.held).to_string()
            } else {
                self.held
            };
            return (held, vec![]);
        }
        parse(self.format, &self.held, tools, cut)
    }
}

/// `text` without a tail that is the start of `format`'s marker (an answer cut while writing it).
fn without_partial_marker(format: ToolFormat, text: &str) -> &str {
    let marker = format.marker();
    let keep = (1..marker.len().min(text.len() + 1))
        .rev()
        .find(|&k| text.is_char_boundary(text.len() - k) && marker.starts_with(&text[text.len() - k..]))
        .unwrap_or(0);
    &text[..text.len() - keep]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn weather() -> Vec<Tool> {
        vec![
            tool(
                "t",
                Some(&json!("get_weather")),
                None,
                Some(&json!({"type": "object", "properties": {"city": {"type": "string"}}})),
            )
            .unwrap(),
        ]
    }

    #[test]
    fn each_format_parses_its_calls_and_leaves_other_text() {
        let tools = weather();
        let (text, calls) = parse(
            ToolFormat::Hermes,
            "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>{\"name\": \"get_weather\", \"arguments\": \"{\\\"city\\\": \\\"Oslo\\\"}\"}</tool_call>",
            &tools,
            false,
        );
        assert_eq!(text, "Let me check.");
        assert_eq!(calls.len(), 2);
        assert_eq!(calls[1].arguments, json!({"city": "Oslo"}));
        // An unknown tool stays text.
        let (text, calls) = parse(
            ToolFormat::Hermes,
            "<tool_call>{\"name\": \"nope\", \"arguments\": {}}</tool_call>",
            &tools,
            false,
        );
        assert!(calls.is_empty() && text.contains("nope"));
        let (text, calls) = parse(
            ToolFormat::Llama3,
            "<|python_tag|>{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Rome\"}}",
            &tools,
            false,
        );
        assert_eq!((text.as_str(), calls[0].arguments["city"].as_str()), ("", Some("Rome")));
        let (_, calls) = parse(ToolFormat::Llama3, "{\"weather\": 1}", &tools, false);
        assert!(calls.is_empty());
        let (text, calls) = parse(
            ToolFormat::Mistral,
            "[TOOL_CALLS][{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Bern\"}}]",
            &tools,
            false,
        );
        assert_eq!((text.as_str(), calls.len()), ("", 1));
    }

    #[test]
    fn a_stream_holds_back_only_what_may_be_a_call() {
        let tools = weather();
        let mut s = CallStream::new(ToolFormat::Hermes);
        let mut out = s.feed("Sure. <tool");
        out += &s.feed("_c");
        assert_eq!(out, "Sure. ", "the marker's start is held");
        out += &s.feed("all>{\"name\": \"get_weather\", \"arguments\": {}}</tool_call>");
        assert_eq!(out, "Sure. ");
        let (rest, calls) = s.finish(&tools, false);
        assert_eq!((rest.as_str(), calls.len()), ("", 1));
        let mut s = CallStream::new(ToolFormat::Hermes);
        assert_eq!(s.feed("a <b> c"), "a <b> c");
        let mut s = CallStream::new(ToolFormat::Llama3);
        assert_eq!(s.feed("  "), "");
        assert_eq!(s.feed("Hello {x}"), "  Hello {x}", "a Llama 3 call is the whole answer");
        assert_eq!(s.finish(&tools, false).1.len(), 0);
        // Cut inside the marker: the partial marker is not text.
        let mut s = CallStream::new(ToolFormat::Hermes);
        assert_eq!(s.feed("Hi <tool"), "Hi ");
        assert_eq!(s.finish(&tools, true).0, "");
        assert_eq!(parse(ToolFormat::Hermes, "<tool", &tools, true).0, "");
        assert_eq!(parse(ToolFormat::Hermes, "<tool", &tools, false).0, "<tool");
    }

    #[test]
    fn formats_are_detected_from_templates() {
        assert_eq!(ToolFormat::detect("{{ '<tool_call>' }}"), ToolFormat::Hermes);
        assert_eq!(ToolFormat::detect("[TOOL_CALLS]"), ToolFormat::Mistral);
        assert_eq!(ToolFormat::detect("<|python_tag|>"), ToolFormat::Llama3);
        assert_eq!(ToolFormat::detect("{{ messages }}"), ToolFormat::Hermes);
        assert!(
            tool("tools[0]", Some(&json!("bad name")), None, None)
                .unwrap_err()
                .contains("tools[0]")
        );
    }
}
