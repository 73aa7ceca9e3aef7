//! The Anthropic surface: `POST /v1/messages` (plain and streaming) and `POST /v1/messages/count_tokens`.
//!
//! Source: Anthropic's Messages API reference: the message object, `stop_reason` values, and the streaming
//! event sequence `message_start`, `content_block_start`, `content_block_delta`*, `content_block_stop`,
//! `message_delta` (stop reason and output usage), `message_stop`; errors as `{"type":"error","error":{...}}`,
//! and in a stream as an `error` event (no `message_stop` follows, so a cut stream is never taken for a whole
//! one). Answers also carry llama.cpp server's `timings` object.

use std::convert::Infallible;

use axum::Json;
use axum::body::Bytes;
use axum::extract::State;
use axum::extract::rejection::BytesRejection;
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::{Value, json};

use super::Shared;
use super::api::{
    self, Api, ApiError, Completed, STREAM_KEEPALIVE, collect, first_event, parse_body, response_id, submit,
};
use super::protocol::{Finish, Timings};
use super::supervisor::{EngineRequest, JobEvent};
use super::tools::{self, ToolChoice, ToolUse};
use crate::tokenizer::{ChatContent, ChatMessage};

const API: Api = Api::Anthropic;

/// A content block: `text`, and for tool use `tool_use` (an assistant's call) and `tool_result` (its result, in a
/// user turn).
#[derive(Debug, Deserialize)]
struct Block {
    #[serde(rename = "type")]
    kind: String,
    text: Option<String>,
    /// `tool_use`: the call's id, tool name and arguments.
    id: Option<String>,
    name: Option<String>,
    input: Option<Value>,
    /// `tool_result`: the call it answers and its content (a string or text blocks).
    tool_use_id: Option<String>,
    content: Option<Value>,
}

/// A string, or a list of content blocks.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum Content {
    Text(String),
    Blocks(Vec<Block>),
}

/// The text of a `tool_result`'s content: a string, or the text of its text blocks.
fn result_text(v: Option<&Value>) -> Result<String, ApiError> {
    match v {
        None | Some(Value::Null) => Ok(String::new()),
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Array(blocks)) => blocks
            .iter()
            .map(|b| {
                match (
                    b.get("type").and_then(Value::as_str),
                    b.get("text").and_then(Value::as_str),
                ) {
                    (Some("text"), Some(t)) => Ok(t),
                    _ => Err(ApiError::invalid(API, "tool_result content must be text")),
                }
            })
            .collect(),
        Some(_) => Err(ApiError::invalid(
            API,
            "tool_result content must be a string or text blocks",
        )),
    }
}

impl Content {
    fn into_text(self) -> Result<String, ApiError> {
        let mut text = String::new();
        for m in self.into_messages("system")? {
            match m.content {
                ChatContent::Text(t) if m.role == "system" => text.push_str(&t),
                _ => return Err(ApiError::invalid(API, "system takes text blocks only")),
            }
        }
        Ok(text)
    }

    /// The chat messages of one turn of `role`: its text; an assistant's `tool_use` blocks as OpenAI-style
    /// `tool_calls` (arguments as objects, as templates read them); a user's `tool_result` blocks as `tool`
    /// messages before the user's text.
    fn into_messages(self, role: &str) -> Result<Vec<ChatMessage>, ApiError> {
        let blocks = match self {
            Content::Text(t) => return Ok(vec![ChatMessage::new(role, t)]),
            Content::Blocks(b) => b,
        };
        let mut out = Vec::new();
        let mut text = String::new();
        let mut calls = Vec::new();
        for b in blocks {
            match (b.kind.as_str(), role) {
                ("text", _) => text.push_str(b.text.as_deref().unwrap_or("")),
                ("tool_use", "assistant") => {
                    let (Some(id), Some(name)) = (b.id, b.name) else {
                        return Err(ApiError::invalid(API, "a tool_use block needs its id and name"));
                    };
                    calls.push(json!({
                        "id": id,
                        "type": "function",
                        "function": { "name": name, "arguments": b.input.unwrap_or(json!({})) },
                    }));
                }
                ("tool_result", "user") => {
                    let Some(call) = b.tool_use_id else {
                        return Err(ApiError::invalid(
                            API,
                            "a tool_result block needs the tool_use_id of the call it answers",
                        ));
                    };
                    let mut m = ChatMessage::new("tool", result_text(b.content.as_ref())?);
                    m.extra.insert("tool_call_id".into(), call.into());
                    out.push(m);
                }
                (kind, _) => {
                    return Err(ApiError::invalid(
                        API,
                        format!(
                            "content blocks of type `{kind}` are not supported in a `{role}` turn; send text, tool_use (assistant) or tool_result (user)"
                        ),
                    ));
                }
            }
        }
        if !calls.is_empty() {
            let mut m = ChatMessage::new(role, text);
            m.extra.insert("tool_calls".into(), calls.into());
            out.push(m);
        } else if !text.is_empty() || out.is_empty() {
            out.push(ChatMessage::new(role, text));
        }
        Ok(out)
    }
}

#[derive(Debug, Deserialize)]
struct InMessage {
    role: String,
    content: Content,
}

/// The conversation fields shared by `messages` and `count_tokens`.
#[derive(Debug, Default, Deserialize)]
struct Conversation {
    model: Option<String>,
    messages: Vec<InMessage>,
    system: Option<Content>,
    /// `[{"name", "description", "input_schema"}]`.
    tools: Option<Value>,
    /// `{"type": "auto" | "any" | "tool" | "none", "name", "disable_parallel_tool_use"}`.
    tool_choice: Option<Value>,
}

#[derive(Debug, Deserialize)]
struct MessagesRequest {
    #[serde(flatten)]
    conversation: Conversation,
    max_tokens: Option<i64>,
    #[serde(default)]
    stop_sequences: Vec<String>,
    #[serde(flatten)]
    sampling: api::SamplingFields,
    #[serde(default)]
    stream: bool,
    /// Structured output: `{"type": "json_schema", "schema": {...}}`.
    output_format: Option<Value>,
    /// The newer place for it: `output_config.format` (Anthropic's SDKs send this).
    output_config: Option<Value>,
}

/// Reads Anthropic's `tools` and `tool_choice`.
///
/// Errors: 400 naming the field: a tool without a valid name or with a non-object `input_schema`, a server tool
/// (`type` other than `custom`), an unknown choice, a named tool not on offer, a forcing choice without tools.
fn tool_use(c: &Conversation) -> Result<ToolUse, ApiError> {
    let items = match c.tools.as_ref().filter(|t| !t.is_null()) {
        None => vec![],
        Some(Value::Array(items)) => items.clone(),
        Some(_) => return Err(ApiError::invalid(API, "tools must be an array of tools")),
    };
    let mut list = Vec::with_capacity(items.len());
    for (i, t) in items.iter().enumerate() {
        let at = format!("tools[{i}]");
        if let Some(kind) = t.get("type").and_then(Value::as_str).filter(|k| *k != "custom") {
            return Err(ApiError::invalid(
                API,
                format!("{at}: server tools (`{kind}`) are not supported; give custom tools with an input_schema"),
            ));
        }
        let tool = tools::tool(&at, t.get("name"), t.get("description"), t.get("input_schema"))
            .map_err(|m| ApiError::invalid(API, m))?;
        if list.iter().any(|t: &tools::Tool| t.name == tool.name) {
            return Err(ApiError::invalid(
                API,
                format!("{at}: tool `{}` is given twice", tool.name),
            ));
        }
        list.push(tool);
    }
    let choice = c.tool_choice.as_ref().filter(|v| !v.is_null());
    let parallel = match choice.and_then(|v| v.get("disable_parallel_tool_use")) {
        None | Some(Value::Null) => true,
        Some(Value::Bool(b)) => !b,
        Some(v) => {
            return Err(ApiError::invalid(
                API,
                format!("tool_choice.disable_parallel_tool_use must be true or false, got {v}"),
            ));
        }
    };
    let choice = match choice.map(|v| (v.get("type").and_then(Value::as_str), v)) {
        None => None,
        Some((Some("auto"), _)) => Some(ToolChoice::Auto),
        Some((Some("any"), _)) => Some(ToolChoice::Required),
        Some((Some("none"), _)) => Some(ToolChoice::None),
        Some((Some("tool"), v)) => match v.get("name").and_then(Value::as_str) {
            Some(n) if list.iter().any(|t| t.name == n) => Some(ToolChoice::Named(n.to_string())),
            n => {
                return Err(ApiError::invalid(
                    API,
                    format!("tool_choice names {}, which is not in tools", n.unwrap_or("no tool")),
                ));
            }
        },
        Some((_, v)) => {
            return Err(ApiError::invalid(
                API,
                format!("tool_choice.type must be auto, any, tool or none, got {v}"),
            ));
        }
    };
    if list.is_empty() && matches!(choice, Some(ToolChoice::Required | ToolChoice::Named(_))) {
        return Err(ApiError::invalid(API, "tool_choice needs tools to choose from"));
    }
    Ok(ToolUse {
        choice: choice.or((!list.is_empty()).then_some(ToolChoice::Auto)),
        tools: list,
        parallel,
    })
}

/// Renders and tokenizes the conversation (system prompt first) with its tools.
fn prompt(state: &Shared, c: Conversation) -> Result<(Vec<u32>, ToolUse), ApiError> {
    state.model.check_name(API, c.model.as_deref())?;
    if c.messages.is_empty() {
        return Err(ApiError::invalid(
            API,
            "`messages` is empty: at least one message is needed",
        ));
    }
    let tool_use = tool_use(&c)?;
    let mut messages = Vec::with_capacity(c.messages.len() + 1);
    if let Some(system) = c.system {
        messages.push(ChatMessage::new("system", system.into_text()?));
    }
    for m in c.messages {
        if m.role != "user" && m.role != "assistant" {
            return Err(ApiError::invalid(
                API,
                format!(
                    "message role must be `user` or `assistant`, got `{}` (put system text in `system`)",
                    m.role
                ),
            ));
        }
        messages.extend(m.content.into_messages(&m.role)?);
    }
    let ids = state.model.chat_prompt_with_tools(API, messages, &tool_use.tools)?.ids;
    Ok((ids, tool_use))
}

/// `POST /v1/messages/count_tokens`: `{"input_tokens": N}`, the prompt exactly as `/v1/messages` would send it.
pub async fn count_tokens(State(state): State<Shared>, body: Result<Bytes, BytesRejection>) -> Response {
    let st = state.clone();
    api::answer_on_cpu(&state, API, move || {
        let c: Conversation = parse_body(API, body)?;
        Ok(json!({ "input_tokens": prompt(&st, c)?.0.len() }))
    })
    .await
}

fn stop_reason(f: Finish) -> &'static str {
    match f {
        Finish::Eog | Finish::Cancelled => "end_turn",
        Finish::StopString => "stop_sequence",
        Finish::Limit | Finish::Context => "max_tokens",
    }
}

/// `stop_sequence`: the stop sequence that ended the answer, or null.
fn stop_sequence(f: Finish, word: Option<&str>) -> Value {
    match (f, word) {
        (Finish::StopString, Some(w)) => w.into(),
        _ => Value::Null,
    }
}

fn usage(prompt_tokens: usize, t: Option<&Timings>) -> Value {
    json!({
        "input_tokens": prompt_tokens,
        "output_tokens": t.map_or(0, |t| t.predicted_n),
        "cache_read_input_tokens": t.map_or(0, |t| t.cache_n),
    })
}

/// A `tool_use` content block for `call`, with a fresh `toolu_` id.
fn tool_use_block(call: &tools::Call) -> Value {
    json!({ "type": "tool_use", "id": response_id("toolu_"), "name": call.name, "input": call.arguments })
}

/// `POST /v1/messages`.
pub async fn messages(State(state): State<Shared>, body: Result<Bytes, BytesRejection>) -> Response {
    match run(state, body).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

async fn run(state: Shared, body: Result<Bytes, BytesRejection>) -> Result<Response, ApiError> {
    let st = state.clone();
    let (req, max_tokens, prompt, grammar, tool_use) = state
        .cpu
        .run(API, move || {
            let mut req: MessagesRequest = parse_body(API, body)?;
            let Some(max_tokens) = req.max_tokens else {
                return Err(ApiError::invalid(API, "max_tokens is required"));
            };
            let structured = match req.output_config.as_ref().and_then(|c| c.get("format")) {
                Some(f) if req.output_format.is_none() => {
                    st.model.structured_output(API, "output_config.format", Some(f))?
                }
                _ => st
                    .model
                    .structured_output(API, "output_format", req.output_format.as_ref())?,
            };
            let conversation = std::mem::take(&mut req.conversation);
            let (prompt, tool_use) = prompt(&st, conversation)?;
            let grammar = st.model.answer_grammar(API, "output_format", structured, &tool_use)?;
            Ok((req, max_tokens, prompt, grammar, tool_use))
        })
        .await?;
    let format = state.model.tool_format;
    api::check_stop(API, "stop_sequences", &req.stop_sequences)?;
    if grammar.is_some() && req.stop_sequences.iter().any(|s| !s.is_empty()) {
        return Err(ApiError::invalid(
            API,
            "stop_sequences cannot be combined with output_format or a forced tool call: a stop sequence would cut the structured answer",
        ));
    }
    let n_prompt = prompt.len();
    let max_tokens = state.model.limit(API, &prompt, Some(max_tokens))?;
    let engine = EngineRequest {
        prompt,
        max_tokens,
        stop: req.stop_sequences,
        sampling: api::sampling(API, &req.sampling, state.model.tokenizer.vocab_size())?,
        logprobs: None,
        grammar,
    };
    let id = response_id("msg_");
    let model = state.model.id.clone();
    let mut rx = submit(&state, API, engine)?;
    if !req.stream {
        let Completed {
            text,
            finish,
            stop_word,
            timings,
            ..
        } = collect(API, rx).await?;
        let (text, calls) = tool_use.split(format, text, finish);
        let mut content = Vec::new();
        if !text.is_empty() || calls.is_empty() {
            content.push(json!({ "type": "text", "text": text }));
        }
        content.extend(calls.iter().map(tool_use_block));
        let reason = match (calls.is_empty(), finish) {
            (false, Finish::Eog | Finish::StopString) => "tool_use",
            _ => stop_reason(finish),
        };
        return Ok(Json(json!({
            "id": id, "type": "message", "role": "assistant", "model": model,
            "content": content,
            "stop_reason": reason,
            "stop_sequence": stop_sequence(finish, stop_word.as_deref()),
            "usage": usage(n_prompt, Some(&timings)),
            "timings": timings,
        }))
        .into_response());
    }

    let first = first_event(API, &mut rx).await?;
    let event = |name: &str, v: Value| -> Result<SseEvent, Infallible> {
        Ok(SseEvent::default().event(name).data(v.to_string()))
    };
    let stream = async_stream::stream! {
        yield event("message_start", json!({
            "type": "message_start",
            "message": {
                "id": id, "type": "message", "role": "assistant", "model": model, "content": [],
                "stop_reason": null, "stop_sequence": null, "usage": usage(n_prompt, None),
            },
        }));
        let text_start = json!({
            "type": "content_block_start", "index": 0, "content_block": { "type": "text", "text": "" },
        });
        // Without tools the text block opens at once; with tools, at its first text (an answer that is only
        // calls has none).
        let mut text_open = !tool_use.parses();
        if text_open {
            yield event("content_block_start", text_start.clone());
        }
        let mut calls_stream = tool_use.stream(format);
        let mut pending = first;
        loop {
            match api::next_job_event(&mut pending, &mut rx).await {
                JobEvent::Text { text, .. } => {
                    let text = match calls_stream.as_mut() {
                        Some(cs) => cs.feed(&text),
                        None => text,
                    };
                    if text.is_empty() {
                        continue;
                    }
                    if !text_open {
                        text_open = true;
                        yield event("content_block_start", text_start.clone());
                    }
                    yield event("content_block_delta", json!({
                        "type": "content_block_delta", "index": 0, "delta": { "type": "text_delta", "text": text },
                    }));
                }
                JobEvent::Done { stop, stop_word, timings } => {
                    let (rest, calls) = match calls_stream.take() {
                        Some(cs) => cs.finish(&tool_use.tools, stop.is_cut()),
                        None => (String::new(), vec![]),
                    };
                    if !rest.is_empty() || (calls.is_empty() && !text_open) {
                        if !text_open {
                            text_open = true;
                            yield event("content_block_start", text_start.clone());
                        }
                        yield event("content_block_delta", json!({
                            "type": "content_block_delta", "index": 0, "delta": { "type": "text_delta", "text": rest },
                        }));
                    }
                    if text_open {
                        yield event("content_block_stop", json!({ "type": "content_block_stop", "index": 0 }));
                    }
                    // Each call: a tool_use block opened with empty input, its arguments as one input_json_delta,
                    // closed (Anthropic's stream shape).
                    let first_index = usize::from(text_open);
                    for (i, call) in calls.iter().enumerate() {
                        let index = first_index + i;
                        let mut block = tool_use_block(call);
                        block["input"] = json!({});
                        yield event("content_block_start", json!({
                            "type": "content_block_start", "index": index, "content_block": block,
                        }));
                        yield event("content_block_delta", json!({
                            "type": "content_block_delta", "index": index,
                            "delta": { "type": "input_json_delta", "partial_json": call.arguments.to_string() },
                        }));
                        yield event("content_block_stop", json!({ "type": "content_block_stop", "index": index }));
                    }
                    let reason = match (calls.is_empty(), stop) {
                        (false, Finish::Eog | Finish::StopString) => "tool_use",
                        _ => stop_reason(stop),
                    };
                    yield event("message_delta", json!({
                        "type": "message_delta",
                        "delta": { "stop_reason": reason, "stop_sequence": stop_sequence(stop, stop_word.as_deref()) },
                        "usage": usage(n_prompt, Some(&timings)),
                        "timings": timings,
                    }));
                    yield event("message_stop", json!({ "type": "message_stop" }));
                    break;
                }
                JobEvent::Failed { status, message } => {
                    yield event("error", api::job_error(API, status, message).body());
                    break;
                }
            }
        }
    };
    Ok(Sse::new(stream)
        .keep_alive(KeepAlive::new().interval(STREAM_KEEPALIVE))
        .into_response())
}
