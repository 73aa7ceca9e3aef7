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
use crate::tokenizer::ChatMessage;

const API: Api = Api::Anthropic;

/// A content block; only `text` blocks are supported.
#[derive(Debug, Deserialize)]
struct Block {
    #[serde(rename = "type")]
    kind: String,
    text: Option<String>,
}

/// A string, or a list of content blocks.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum Content {
    Text(String),
    Blocks(Vec<Block>),
}

impl Content {
    fn into_text(self) -> Result<String, ApiError> {
        match self {
            Content::Text(t) => Ok(t),
            Content::Blocks(blocks) => {
                let mut text = String::new();
                for b in blocks {
                    match (b.kind.as_str(), b.text) {
                        ("text", Some(t)) => text.push_str(&t),
                        (kind, _) => {
                            return Err(ApiError::invalid(
                                API,
                                format!("content blocks of type `{kind}` are not supported; send text"),
                            ));
                        }
                    }
                }
                Ok(text)
            }
        }
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
    tools: Option<Value>,
    tool_choice: Option<Value>,
    /// Structured output: `{"type": "json_schema", "schema": {...}}`.
    output_format: Option<Value>,
}

/// Renders and tokenizes the conversation (system prompt first).
fn prompt(state: &Shared, c: Conversation) -> Result<Vec<u32>, ApiError> {
    state.model.check_name(API, c.model.as_deref())?;
    if c.messages.is_empty() {
        return Err(ApiError::invalid(
            API,
            "`messages` is empty: at least one message is needed",
        ));
    }
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
        messages.push(ChatMessage::new(m.role, m.content.into_text()?));
    }
    Ok(state.model.chat_prompt(API, messages)?.ids)
}

/// `POST /v1/messages/count_tokens`: `{"input_tokens": N}`, the prompt exactly as `/v1/messages` would send it.
pub async fn count_tokens(State(state): State<Shared>, body: Result<Bytes, BytesRejection>) -> Response {
    let st = state.clone();
    api::answer_on_cpu(&state, API, move || {
        let c: Conversation = parse_body(API, body)?;
        Ok(json!({ "input_tokens": prompt(&st, c)?.len() }))
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

/// `POST /v1/messages`.
pub async fn messages(State(state): State<Shared>, body: Result<Bytes, BytesRejection>) -> Response {
    match run(state, body).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

async fn run(state: Shared, body: Result<Bytes, BytesRejection>) -> Result<Response, ApiError> {
    let st = state.clone();
    let (req, max_tokens, prompt, grammar) = state
        .cpu
        .run(API, move || {
            let mut req: MessagesRequest = parse_body(API, body)?;
            api::refuse_tools(API, req.tools.as_ref(), req.tool_choice.as_ref())?;
            let Some(max_tokens) = req.max_tokens else {
                return Err(ApiError::invalid(API, "max_tokens is required"));
            };
            let grammar = st
                .model
                .structured_output(API, "output_format", req.output_format.as_ref())?;
            let conversation = std::mem::take(&mut req.conversation);
            let prompt = prompt(&st, conversation)?;
            Ok((req, max_tokens, prompt, grammar))
        })
        .await?;
    let n_prompt = prompt.len();
    let max_tokens = state.model.limit(API, &prompt, Some(max_tokens))?;
    let engine = EngineRequest {
        prompt,
        max_tokens,
        stop: req.stop_sequences,
        sampling: api::sampling(API, &req.sampling)?,
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
        return Ok(Json(json!({
            "id": id, "type": "message", "role": "assistant", "model": model,
            "content": [{ "type": "text", "text": text }],
            "stop_reason": stop_reason(finish),
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
        yield event("content_block_start", json!({
            "type": "content_block_start", "index": 0, "content_block": { "type": "text", "text": "" },
        }));
        let mut pending = first;
        loop {
            match api::next_job_event(&mut pending, &mut rx).await {
                JobEvent::Text { text, .. } if text.is_empty() => {}
                JobEvent::Text { text, .. } => yield event("content_block_delta", json!({
                    "type": "content_block_delta", "index": 0, "delta": { "type": "text_delta", "text": text },
                })),
                JobEvent::Done { stop, stop_word, timings } => {
                    yield event("content_block_stop", json!({ "type": "content_block_stop", "index": 0 }));
                    yield event("message_delta", json!({
                        "type": "message_delta",
                        "delta": { "stop_reason": stop_reason(stop), "stop_sequence": stop_sequence(stop, stop_word.as_deref()) },
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
