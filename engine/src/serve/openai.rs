//! The OpenAI surface: `POST /v1/chat/completions`, `POST /v1/completions`, `GET /v1/models`.
//!
//! Source: OpenAI's API reference (chat completion and completion objects, their streaming chunks, the
//! `stream_options.include_usage` final chunk, `data: [DONE]`). Every answer also carries llama.cpp server's
//! `timings` object. A stream that fails after it answered 200 ends with a `data: {"error": ...}` line and no
//! `[DONE]`, so a client never takes a cut stream for a whole one.

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
    self, Api, ApiError, Completed, OneOrMany, STREAM_KEEPALIVE, collect, first_event, parse_body, response_id, submit,
};
use super::protocol::{Finish, Timings};
use super::supervisor::{EngineRequest, JobEvent};
use super::tools::{self, Tool, ToolChoice, ToolUse};
use crate::runtime::grammar::GrammarSpec;
use crate::runtime::sampling::{MAX_TOP_LOGPROBS, TokenLogprob};
use crate::tokenizer::{ChatContent, ChatMessage};

const API: Api = Api::OpenAi;

#[derive(Debug, Deserialize)]
struct StreamOptions {
    #[serde(default)]
    include_usage: bool,
}

/// The fields of a chat completion or completion request that Strata reads; others are ignored.
#[derive(Debug, Deserialize)]
struct Common {
    model: Option<String>,
    #[serde(default)]
    stream: bool,
    stream_options: Option<StreamOptions>,
    max_tokens: Option<i64>,
    max_completion_tokens: Option<i64>,
    #[serde(flatten)]
    sampling: api::SamplingFields,
    stop: Option<OneOrMany>,
    n: Option<i64>,
    tools: Option<Value>,
    tool_choice: Option<Value>,
    parallel_tool_calls: Option<bool>,
    /// Chat: `true` for each token's log-probability; legacy completions: the number of alternatives.
    logprobs: Option<Value>,
    /// Chat: alternatives per token (0..20), with `logprobs: true`.
    top_logprobs: Option<i64>,
    /// Structured output: `{"type": "text" | "json_object" | "json_schema", "json_schema": {...}}`.
    response_format: Option<Value>,
}

#[derive(Debug, Deserialize)]
struct ChatCompletionRequest {
    messages: Vec<ChatMessage>,
    #[serde(flatten)]
    common: Common,
}

#[derive(Debug, Deserialize)]
struct CompletionRequest {
    prompt: OneOrMany,
    #[serde(flatten)]
    common: Common,
    /// Legacy completions' options Strata does not implement: refused when set to anything but their off value,
    /// so they are never silently dropped.
    echo: Option<bool>,
    best_of: Option<i64>,
    suffix: Option<String>,
}

/// The message roles of OpenAI's chat API (`developer` is its newer name for `system`).
const ROLES: [&str; 5] = ["system", "developer", "user", "assistant", "tool"];

/// OpenAI content parts become one text (the chat templates expect strings); non-text parts are refused; null
/// content (an assistant turn with `tool_calls`) becomes empty text; a `developer` message becomes a `system` one.
///
/// Errors: a role outside OpenAI's (`messages[i].role` named, as OpenAI and vLLM refuse it); a part that is not
/// text.
pub fn flatten_content(api: Api, messages: Vec<ChatMessage>) -> Result<Vec<ChatMessage>, ApiError> {
    messages
        .into_iter()
        .enumerate()
        .map(|(i, mut m)| {
            if !ROLES.contains(&m.role.as_str()) {
                return Err(ApiError::invalid(
                    api,
                    format!(
                        "messages[{i}].role must be one of {}; got `{}`",
                        ROLES.join(", "),
                        m.role
                    ),
                ));
            }
            if m.role == "tool" && !m.extra.get("tool_call_id").is_some_and(Value::is_string) {
                return Err(ApiError::field(
                    api,
                    format!("messages[{i}].tool_call_id"),
                    format!("messages[{i}]: a `tool` message needs the tool_call_id of the call it answers"),
                ));
            }
            if m.role == "developer" {
                // The chat templates in GGUF files know `system`, not OpenAI's newer name for it.
                m.role = "system".into();
            }
            // Templates read a call's arguments as an object (`tool_call.function.arguments | tojson`, `.items()`);
            // the SDKs send them as a JSON string, so one that parses is given as its value, as llama.cpp does.
            if let Some(Value::Array(calls)) = m.extra.get_mut("tool_calls") {
                for call in calls {
                    if let Some(args) = call.get_mut("function").and_then(|f| f.get_mut("arguments"))
                        && let Some(v) = args.as_str().and_then(|a| serde_json::from_str::<Value>(a).ok())
                    {
                        *args = v;
                    }
                }
            }
            if m.content == ChatContent::Null {
                // An assistant turn that only called tools, as the SDKs send it back: many templates cannot print
                // none (they concatenate or split it), so it is rendered as empty text, as llama.cpp does.
                m.content = ChatContent::Text(String::new());
            }
            if let ChatContent::Parts(parts) = &m.content {
                let mut text = String::new();
                for p in parts {
                    match (p.kind.as_str(), &p.text) {
                        ("text", Some(t)) => text.push_str(t),
                        (kind, _) => {
                            return Err(ApiError::invalid(
                                api,
                                format!("content parts of type `{kind}` are not supported; send text"),
                            ));
                        }
                    }
                }
                m.content = ChatContent::Text(text);
            }
            Ok(m)
        })
        .collect()
}

fn finish_reason(f: Finish) -> &'static str {
    match f {
        Finish::Limit | Finish::Context => "length",
        Finish::Eog | Finish::StopString | Finish::Cancelled => "stop",
    }
}

fn usage(t: &Timings) -> Value {
    json!({
        "prompt_tokens": t.prompt_tokens(),
        "completion_tokens": t.predicted_n,
        "total_tokens": t.prompt_tokens() + t.predicted_n,
        "prompt_tokens_details": { "cached_tokens": t.cache_n },
    })
}

/// The log-probabilities a request asks for: `None`, or the number of alternatives per token. Chat takes
/// `logprobs: true` with `top_logprobs` 0..20; a legacy completion takes `logprobs` 0..20 (OpenAI's stops at 5).
///
/// Errors: a value of the wrong type or out of range (400 naming the field); `top_logprobs` without
/// `logprobs: true` (as OpenAI refuses it).
fn logprobs_asked(c: &Common, kind: Kind) -> Result<Option<usize>, ApiError> {
    let max = MAX_TOP_LOGPROBS as i64;
    let top = match c.top_logprobs {
        Some(n) if !(0..=max).contains(&n) => {
            return Err(ApiError::field(
                API,
                "top_logprobs",
                format!("top_logprobs must be between 0 and {max}, got {n}"),
            ));
        }
        n => n.map(|n| n as usize),
    };
    let asked = match (kind, c.logprobs.as_ref().filter(|v| !v.is_null())) {
        (_, None) => None,
        (Kind::Chat, Some(Value::Bool(b))) => b.then_some(top.unwrap_or(0)),
        (Kind::Chat, Some(v)) => {
            return Err(ApiError::field(
                API,
                "logprobs",
                format!("logprobs must be true or false, got {v}"),
            ));
        }
        (Kind::Text, Some(v)) => match v.as_i64() {
            Some(n) if (0..=max).contains(&n) => Some(n as usize),
            _ => {
                return Err(ApiError::field(
                    API,
                    "logprobs",
                    format!("logprobs must be a number of alternatives between 0 and {max}, got {v}"),
                ));
            }
        },
    };
    if top.is_some() && asked.is_none() && matches!(kind, Kind::Chat) {
        return Err(ApiError::field(
            API,
            "top_logprobs",
            "top_logprobs needs logprobs: true",
        ));
    }
    Ok(asked)
}

/// One token's text and bytes, as the `logprobs` objects name it.
fn token_text(state: &Shared, id: u32) -> (String, Vec<u8>) {
    let bytes = state.model.tokenizer.decode_bytes(&[id], false).unwrap_or_default();
    (String::from_utf8_lossy(&bytes).into_owned(), bytes)
}

/// A chat choice's `logprobs`: `{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}`.
fn chat_logprobs(state: &Shared, entries: &[TokenLogprob]) -> Value {
    let one = |id: u32, lp: f32| {
        let (token, bytes) = token_text(state, id);
        json!({ "token": token, "logprob": lp, "bytes": bytes })
    };
    let content: Vec<Value> = entries
        .iter()
        .map(|e| {
            let mut v = one(e.id, e.logprob);
            v["top_logprobs"] = e.top.iter().map(|&(id, lp)| one(id, lp)).collect();
            v
        })
        .collect();
    json!({ "content": content })
}

/// A legacy completion's token as text: itself when whole UTF-8, else OpenAI's `bytes:\xNN...` form (a token
/// that holds part of a character).
fn legacy_token(state: &Shared, id: u32) -> String {
    let (text, bytes) = token_text(state, id);
    match std::str::from_utf8(&bytes) {
        Ok(_) => text,
        Err(_) => bytes.iter().fold(String::from("bytes:"), |mut s, b| {
            s.push_str(&format!("\\x{b:02x}"));
            s
        }),
    }
}

/// A legacy completion's text offset, carried from token to token: the whole characters of its answer so far,
/// counted as each token's bytes arrive (up to the first byte that can never begin a character).
#[derive(Debug, Clone, Default)]
struct TextOffset {
    /// Characters before the next token.
    chars: usize,
    /// Bytes of a character not yet whole.
    pending: Vec<u8>,
    /// An invalid byte was seen: no later character counts.
    stuck: bool,
}

impl TextOffset {
    fn push(&mut self, bytes: &[u8]) {
        if self.stuck {
            return;
        }
        self.pending.extend_from_slice(bytes);
        let (valid, invalid) = match std::str::from_utf8(&self.pending) {
            Ok(s) => (s.len(), false),
            Err(e) => (e.valid_up_to(), e.error_len().is_some()),
        };
        let whole = std::str::from_utf8(&self.pending[..valid]).unwrap_or_default();
        self.chars += whole.chars().count();
        self.pending.drain(..valid);
        self.stuck = invalid;
    }
}

/// A legacy completion choice's `logprobs`: `{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`.
/// `answer` carries the text offset from chunk to chunk: a token's offset is the count of whole characters before
/// it.
fn text_logprobs(state: &Shared, entries: &[TokenLogprob], answer: &mut TextOffset) -> Value {
    let mut tokens = Vec::new();
    let mut token_logprobs = Vec::new();
    let mut top = Vec::new();
    let mut offsets = Vec::new();
    for e in entries {
        offsets.push(answer.chars);
        answer.push(&token_text(state, e.id).1);
        tokens.push(legacy_token(state, e.id));
        token_logprobs.push(e.logprob);
        let alternatives: serde_json::Map<String, Value> = e
            .top
            .iter()
            .map(|&(id, lp)| (legacy_token(state, id), lp.into()))
            .collect();
        top.push(alternatives);
    }
    json!({ "tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets })
}

/// Reads `tools` (`[{"type": "function", "function": {"name", "description", "parameters"}}]`), `tool_choice`
/// (`none`, `auto`, `required`, `{"type": "function", "function": {"name"}}`) and `parallel_tool_calls`.
///
/// Errors: 400 naming the field: a tool that is not a function or has a bad name or schema, an unknown choice,
/// a named function not on offer, a choice without tools.
fn tool_use(c: &Common) -> Result<ToolUse, ApiError> {
    let list = parse_tools(c.tools.as_ref())?;
    let choice = match c.tool_choice.as_ref().filter(|v| !v.is_null()) {
        None => None,
        Some(Value::String(s)) if s == "none" => Some(ToolChoice::None),
        Some(Value::String(s)) if s == "auto" => Some(ToolChoice::Auto),
        Some(Value::String(s)) if s == "required" => Some(ToolChoice::Required),
        Some(v) if v.get("type").and_then(Value::as_str) != Some("function") => {
            return Err(ApiError::field(
                API,
                "tool_choice",
                format!("tool_choice must be none, auto, required or a function to call, got {v}"),
            ));
        }
        Some(v) => match v.get("function").and_then(|f| f.get("name")).and_then(Value::as_str) {
            Some(name) if list.iter().any(|t| t.name == name) => Some(ToolChoice::Named(name.to_string())),
            Some(name) => {
                return Err(ApiError::field(
                    API,
                    "tool_choice",
                    format!("tool_choice names `{name}`, which is not in tools"),
                ));
            }
            None => {
                return Err(ApiError::field(
                    API,
                    "tool_choice",
                    format!(
                        "tool_choice must be none, auto, required or {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}, got {v}"
                    ),
                ));
            }
        },
    };
    if list.is_empty() && matches!(choice, Some(ToolChoice::Required | ToolChoice::Named(_))) {
        return Err(ApiError::field(
            API,
            "tool_choice",
            "tool_choice needs tools to choose from",
        ));
    }
    Ok(ToolUse {
        choice: choice.or((!list.is_empty()).then_some(ToolChoice::Auto)),
        tools: list,
        parallel: c.parallel_tool_calls.unwrap_or(true),
    })
}

/// Reads OpenAI's `tools`: `[{"type": "function", "function": {"name", "description", "parameters"}}]`.
///
/// Errors: 400 naming the field: not an array, a tool that is not a function, a bad name, description or
/// schema, a name given twice.
pub fn parse_tools(v: Option<&Value>) -> Result<Vec<Tool>, ApiError> {
    let items = match v.filter(|t| !t.is_null()) {
        None => return Ok(vec![]),
        Some(Value::Array(items)) => items,
        Some(_) => {
            return Err(ApiError::field(
                API,
                "tools",
                "tools must be an array of function tools",
            ));
        }
    };
    let mut list: Vec<Tool> = Vec::with_capacity(items.len());
    for (i, t) in items.iter().enumerate() {
        let at = format!("tools[{i}]");
        if t.get("type").and_then(Value::as_str) != Some("function") {
            return Err(ApiError::field(
                API,
                format!("{at}.type"),
                format!("{at}.type must be `function`"),
            ));
        }
        let f = t.get("function").filter(|f| f.is_object()).ok_or_else(|| {
            ApiError::field(
                API,
                format!("{at}.function"),
                format!("{at}.function must be an object"),
            )
        })?;
        let at = format!("{at}.function");
        let tool = tools::tool(&at, f.get("name"), f.get("description"), f.get("parameters"))
            .map_err(|m| ApiError::field(API, at.clone(), m))?;
        if list.iter().any(|t| t.name == tool.name) {
            return Err(ApiError::field(API, at, format!("tool `{}` is given twice", tool.name)));
        }
        list.push(tool);
    }
    Ok(list)
}

/// OpenAI's `tool_calls` of a message or (with `index`) of a stream delta.
fn tool_calls_json(calls: &[tools::Call], delta: bool) -> Vec<Value> {
    calls
        .iter()
        .enumerate()
        .map(|(i, c)| {
            let mut v = json!({
                "id": response_id("call_"),
                "type": "function",
                "function": { "name": c.name, "arguments": c.arguments.to_string() },
            });
            if delta {
                v["index"] = i.into();
            }
            v
        })
        .collect()
}

/// Turns the shared request fields into an engine request for `prompt`.
fn engine_request(
    state: &Shared,
    c: &Common,
    prompt: Vec<u32>,
    grammar: Option<GrammarSpec>,
    kind: Kind,
) -> Result<EngineRequest, ApiError> {
    state.model.check_name(API, c.model.as_deref())?;
    // OpenAI's default for legacy completions is 16 tokens; a chat answer runs to its end.
    let default_max = matches!(kind, Kind::Text).then_some(16);
    // A bad max_completion_tokens is named as itself (limit() says max_tokens).
    if let Some(n) = c.max_completion_tokens.filter(|&n| n <= 0) {
        return Err(ApiError::field(
            API,
            "max_completion_tokens",
            format!("max_completion_tokens must be at least 1, got {n}"),
        ));
    }
    let max = c.max_completion_tokens.or(c.max_tokens).or(default_max);
    let max_tokens = state.model.limit(API, &prompt, max)?;
    let stop = c.stop.clone().map(OneOrMany::into_vec).unwrap_or_default();
    api::check_stop(API, "stop", &stop)?;
    if grammar.is_some() && stop.iter().any(|s| !s.is_empty()) {
        return Err(ApiError::field(
            API,
            "stop",
            "stop cannot be combined with response_format or a forced tool call: a stop string would cut the structured answer",
        ));
    }
    Ok(EngineRequest {
        prompt,
        max_tokens,
        stop,
        sampling: api::sampling(API, &c.sampling, state.model.tokenizer.vocab_size())?,
        logprobs: logprobs_asked(c, kind)?,
        grammar,
    })
}

/// `POST /v1/chat/completions`.
pub async fn chat_completions(State(state): State<Shared>, body: Result<Bytes, BytesRejection>) -> Response {
    match chat(state, body).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

async fn chat(state: Shared, body: Result<Bytes, BytesRejection>) -> Result<Response, ApiError> {
    let st = state.clone();
    let (common, prompt, grammar, tool_use) = state
        .cpu
        .run(API, move || {
            let req: ChatCompletionRequest = parse_body(API, body)?;
            st.model.check_name(API, req.common.model.as_deref())?;
            let tool_use = tool_use(&req.common)?;
            let structured = st
                .model
                .structured_output(API, "response_format", req.common.response_format.as_ref())?;
            let grammar = st.model.answer_grammar(API, "response_format", structured, &tool_use)?;
            let messages = flatten_content(API, req.messages)?;
            let prompt = st.model.chat_prompt_with_tools(API, messages, &tool_use.tools)?.ids;
            Ok((req.common, prompt, grammar, tool_use))
        })
        .await?;
    let engine = engine_request(&state, &common, prompt, grammar, Kind::Chat)?;
    respond(state, &common, engine, Kind::Chat, tool_use).await
}

/// `POST /v1/completions`.
pub async fn completions(State(state): State<Shared>, body: Result<Bytes, BytesRejection>) -> Response {
    match complete(state, body).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

async fn complete(state: Shared, body: Result<Bytes, BytesRejection>) -> Result<Response, ApiError> {
    let st = state.clone();
    let (common, prompt, grammar) = state
        .cpu
        .run(API, move || {
            let req: CompletionRequest = parse_body(API, body)?;
            st.model.check_name(API, req.common.model.as_deref())?;
            if req.common.tools.as_ref().is_some_and(|t| !t.is_null()) {
                return Err(ApiError::field(
                    API,
                    "tools",
                    "tools are offered on /v1/chat/completions, not on legacy completions",
                ));
            }
            for (field, set) in [
                ("echo", req.echo == Some(true)),
                ("best_of", req.best_of.is_some_and(|b| b != 1)),
                ("suffix", req.suffix.as_ref().is_some_and(|s| !s.is_empty())),
            ] {
                if set {
                    return Err(ApiError::field(
                        API,
                        field,
                        format!("{field} is not supported on /v1/completions (leave it out, or at its default)"),
                    ));
                }
            }
            let grammar = st
                .model
                .structured_output(API, "response_format", req.common.response_format.as_ref())?;
            let text = match req.prompt.into_vec() {
                v if v.len() == 1 => v.into_iter().next().expect("one"),
                v => {
                    return Err(ApiError::invalid(
                        API,
                        format!("prompt must be one string (batches are not supported), got {}", v.len()),
                    ));
                }
            };
            Ok((req.common, st.model.text_prompt(API, &text)?, grammar))
        })
        .await?;
    let engine = engine_request(&state, &common, prompt, grammar, Kind::Text)?;
    respond(state, &common, engine, Kind::Text, ToolUse::default()).await
}

#[derive(Clone, Copy)]
enum Kind {
    Chat,
    Text,
}

impl Kind {
    fn prefix(self) -> &'static str {
        match self {
            Kind::Chat => "chatcmpl-",
            Kind::Text => "cmpl-",
        }
    }
}

/// The engine requests of `n` choices: the same prompt, each its own sequence; with a seed, choice `i` draws with
/// seed + i, so the choices differ and the answer can still be repeated.
fn choices(engine: EngineRequest, n: usize) -> Vec<EngineRequest> {
    (0..n)
        .map(|i| {
            let mut e = engine.clone();
            e.sampling.seed = e.sampling.seed.map(|s| s.wrapping_add(i as u64));
            e
        })
        .collect()
}

/// A job's events as a stream that ends after its `Done` or `Failed` (a receiver closed before either reads as a
/// 503 failure, as [`api::next_job_event`] does), tagged with its choice index.
fn choice_events(
    index: usize,
    pending: Option<JobEvent>,
    rx: tokio::sync::mpsc::UnboundedReceiver<JobEvent>,
) -> std::pin::Pin<Box<dyn futures_util::Stream<Item = (usize, JobEvent)> + Send>> {
    Box::pin(futures_util::stream::unfold(
        Some((pending, rx)),
        move |state| async move {
            let (mut pending, mut rx) = state?;
            let ev = api::next_job_event(&mut pending, &mut rx).await;
            let end = matches!(ev, JobEvent::Done { .. } | JobEvent::Failed { .. });
            Some(((index, ev), (!end).then_some((pending, rx))))
        },
    ))
}

async fn respond(
    state: Shared,
    c: &Common,
    engine: EngineRequest,
    kind: Kind,
    tool_use: ToolUse,
) -> Result<Response, ApiError> {
    let n = match c.n {
        None => 1,
        Some(n) if (1..=MAX_CHOICES as i64).contains(&n) => n as usize,
        Some(n) => {
            return Err(ApiError::field(
                API,
                "n",
                format!("n must be between 1 and {MAX_CHOICES}, got {n}"),
            ));
        }
    };
    // Each choice is a request in the queue: more than it holds could never be queued at once.
    let max_queue = state.supervisor.max_queue();
    if n > max_queue {
        return Err(ApiError::field(
            API,
            "n",
            format!("n is {n}, but the server queues at most {max_queue} requests (--max-queue), one per choice"),
        ));
    }
    let format = state.model.tool_format;
    let id = response_id(kind.prefix());
    let model = state.model.id.clone();
    let created = api::unix_now();
    let with_logprobs = engine.logprobs.is_some();
    // Every choice is queued before any is answered; a full queue answers 503 and drops (cancels) those queued.
    let mut rxs = Vec::with_capacity(n);
    for e in choices(engine, n) {
        rxs.push(submit(&state, API, e)?);
    }
    // The choice's `logprobs` for the tokens of one answer or chunk (null when the request asked for none);
    // `answer` carries a legacy completion's text offset from chunk to chunk.
    let logprobs_of = {
        let state = state.clone();
        move |entries: &[TokenLogprob], answer: &mut TextOffset| -> Value {
            match (with_logprobs, kind) {
                (false, _) => Value::Null,
                (true, Kind::Chat) => chat_logprobs(&state, entries),
                (true, Kind::Text) => text_logprobs(&state, entries, answer),
            }
        }
    };
    if !c.stream {
        let mut out = Vec::with_capacity(n);
        let mut totals: Option<Timings> = None;
        for (index, rx) in rxs.into_iter().enumerate() {
            let Completed {
                text,
                finish,
                timings,
                logprobs,
                ..
            } = collect(API, rx).await?;
            add_choice_timings(&mut totals, &timings);
            let logprobs = logprobs_of(&logprobs, &mut TextOffset::default());
            let (text, calls) = tool_use.split(format, text, finish);
            let cut = finish.is_cut();
            let mut finish = finish_reason(finish);
            if !calls.is_empty() && !cut {
                finish = "tool_calls";
            }
            out.push(match kind {
                Kind::Chat => {
                    let mut message = json!({ "role": "assistant", "content": text });
                    if !calls.is_empty() {
                        if text.is_empty() {
                            message["content"] = Value::Null;
                        }
                        message["tool_calls"] = tool_calls_json(&calls, false).into();
                    }
                    json!({ "index": index, "message": message, "logprobs": logprobs, "finish_reason": finish })
                }
                Kind::Text => json!({ "index": index, "text": text, "logprobs": logprobs, "finish_reason": finish }),
            });
        }
        let timings = totals.unwrap_or_default();
        let object = match kind {
            Kind::Chat => "chat.completion",
            Kind::Text => "text_completion",
        };
        return Ok(Json(json!({
            "id": id, "object": object, "created": created, "model": model,
            "choices": out,
            "usage": usage(&timings),
            "timings": timings,
        }))
        .into_response());
    }

    let include_usage = c.stream_options.as_ref().is_some_and(|o| o.include_usage);
    let first = first_event(API, &mut rxs[0]).await?;
    let chunk = move |index: usize, delta: Option<&str>, finish: Option<Finish>, role: bool| -> Value {
        let finish = finish.map(finish_reason);
        match kind {
            Kind::Chat => {
                let mut d = serde_json::Map::new();
                if role {
                    d.insert("role".into(), "assistant".into());
                }
                if let Some(t) = delta {
                    d.insert("content".into(), t.into());
                }
                json!({
                    "id": id, "object": "chat.completion.chunk", "created": created, "model": model,
                    "choices": [{ "index": index, "delta": d, "logprobs": null, "finish_reason": finish }],
                })
            }
            Kind::Text => json!({
                "id": id, "object": "text_completion", "created": created, "model": model,
                "choices": [{ "index": index, "text": delta.unwrap_or(""), "logprobs": null, "finish_reason": finish }],
            }),
        }
    };
    let data = |v: &Value| -> Result<SseEvent, Infallible> { Ok(SseEvent::default().data(v.to_string())) };
    let mut events = futures_util::stream::select_all(
        rxs.into_iter()
            .enumerate()
            .map(|(i, rx)| choice_events(i, if i == 0 { first.clone() } else { None }, rx)),
    );
    let stream = async_stream::stream! {
        use futures_util::StreamExt as _;
        if matches!(kind, Kind::Chat) {
            for i in 0..n {
                yield data(&chunk(i, Some(""), None, true));
            }
        }
        let mut offsets = vec![TextOffset::default(); n];
        let mut calls_streams: Vec<Option<tools::CallStream>> =
            (0..n).map(|_| tool_use.stream(format)).collect();
        let mut totals: Option<Timings> = None;
        let mut open = n;
        while let Some((i, ev)) = events.next().await {
            match ev {
                JobEvent::Text { text, logprobs } => {
                    let text = match calls_streams[i].as_mut() {
                        Some(cs) => cs.feed(&text),
                        None => text,
                    };
                    if text.is_empty() && logprobs.is_empty() {
                        continue;
                    }
                    let mut c = chunk(i, Some(&text), None, false);
                    c["choices"][0]["logprobs"] = logprobs_of(&logprobs, &mut offsets[i]);
                    yield data(&c);
                }
                JobEvent::Done { stop, timings, .. } => {
                    let mut called = false;
                    if let Some(cs) = calls_streams[i].take() {
                        let (rest, calls) = cs.finish(&tool_use.tools, stop.is_cut());
                        if !rest.is_empty() {
                            yield data(&chunk(i, Some(&rest), None, false));
                        }
                        // Each call: its id, type and name with empty arguments, then its arguments (OpenAI's
                        // stream shape for tool calls).
                        for (k, call) in tool_calls_json(&calls, true).into_iter().enumerate() {
                            let mut head = call.clone();
                            head["function"]["arguments"] = "".into();
                            let mut c = chunk(i, None, None, false);
                            c["choices"][0]["delta"] = json!({ "tool_calls": [head] });
                            yield data(&c);
                            let mut c = chunk(i, None, None, false);
                            c["choices"][0]["delta"] = json!({ "tool_calls": [{
                                "index": k, "function": { "arguments": call["function"]["arguments"] },
                            }] });
                            yield data(&c);
                        }
                        called = !calls.is_empty();
                    }
                    let mut last = chunk(i, None, Some(stop), false);
                    if called && !stop.is_cut() {
                        last["choices"][0]["finish_reason"] = "tool_calls".into();
                    }
                    last["timings"] = serde_json::to_value(timings).unwrap_or_default();
                    yield data(&last);
                    add_choice_timings(&mut totals, &timings);
                    open -= 1;
                    if open > 0 {
                        continue;
                    }
                    // Usage only when asked for, in a chunk of its own with no choices (OpenAI's stream shape).
                    if include_usage {
                        let timings = totals.unwrap_or_default();
                        let mut u = chunk(0, None, None, false);
                        u["choices"] = json!([]);
                        u["usage"] = usage(&timings);
                        u["timings"] = serde_json::to_value(timings).unwrap_or_default();
                        yield data(&u);
                    }
                    yield Ok(SseEvent::default().data("[DONE]"));
                    break;
                }
                JobEvent::Failed { status, message } => {
                    yield Ok(SseEvent::default().data(api::job_error(API, status, message).stream_body()));
                    break;
                }
            }
        }
    };
    Ok(Sse::new(stream)
        .keep_alive(KeepAlive::new().interval(STREAM_KEEPALIVE))
        .into_response())
}

/// The most choices one request may ask for (`n`).
const MAX_CHOICES: usize = 16;

/// Adds one choice's counts to a request's: the prompt once (the first choice's), the generated tokens and
/// decode time of every choice.
fn add_choice_timings(totals: &mut Option<Timings>, t: &Timings) {
    match totals {
        None => *totals = Some(*t),
        Some(sum) => {
            sum.predicted_n += t.predicted_n;
            sum.predicted_ms += t.predicted_ms;
        }
    }
}

/// `GET /v1/models`: the one model served.
pub async fn models(State(state): State<Shared>) -> Response {
    Json(json!({
        "object": "list",
        "data": [{
            "id": state.model.id, "object": "model", "created": state.model.created, "owned_by": "strata",
            "context_length": state.model.n_ctx,
        }],
    }))
    .into_response()
}
