//! llama.cpp server's helper endpoints, which clients, UIs and scripts rely on: `POST /tokenize`,
//! `POST /detokenize`, `POST /apply-template` and `GET /props`.
//!
//! Source: llama.cpp `tools/server/README.md` (the request and answer fields keep its names). Bodies are read,
//! rendered and tokenized off the async threads ([`super::api::CpuGate`]), as the API routes are.

use axum::Json;
use axum::body::Bytes;
use axum::extract::State;
use axum::extract::rejection::BytesRejection;
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::json;

use super::Shared;
use super::api::{self, Api, ApiError, parse_body};
use crate::tokenizer::ChatMessage;

const API: Api = Api::OpenAi;

fn yes() -> bool {
    true
}

#[derive(Debug, Deserialize)]
struct TokenizeRequest {
    content: String,
    /// Add BOS (and EOS) where the model wants them; default false, as llama.cpp's.
    #[serde(default)]
    add_special: bool,
    /// Control tokens written in `content` (`<|im_start|>`) become their ids; default true, as llama.cpp's.
    #[serde(default = "yes")]
    parse_special: bool,
    /// Answer `{"id", "piece"}` objects instead of bare ids.
    #[serde(default)]
    with_pieces: bool,
}

/// `POST /tokenize` `{"content", "add_special"?, "parse_special"?, "with_pieces"?}`: `{"tokens": [ids]}`, or with
/// `with_pieces` `{"tokens": [{"id", "piece"}]}` where a piece that is not whole UTF-8 is its list of bytes.
pub async fn tokenize(State(state): State<Shared>, body: Result<Bytes, BytesRejection>) -> Response {
    /// A piece as text when it is whole UTF-8, else its bytes.
    #[derive(serde::Serialize)]
    #[serde(untagged)]
    enum Piece<'a> {
        Text(&'a str),
        Bytes(&'a [u8]),
    }
    #[derive(serde::Serialize)]
    struct Entry<'a> {
        id: u32,
        piece: Piece<'a>,
    }
    let st = state.clone();
    let r = state
        .cpu
        .run(API, move || {
            let req: TokenizeRequest = parse_body(API, body)?;
            let tok = &st.model.tokenizer;
            let ids = tok
                .encode(&req.content, req.add_special, req.parse_special)
                .map_err(|e| ApiError::invalid(API, e.to_string()))?;
            // Written straight to text, never as a JSON tree: a tree of a million pieces takes gigabytes.
            let body = if req.with_pieces {
                let entries: Vec<Entry<'_>> = ids
                    .iter()
                    .map(|&id| {
                        let bytes = tok.token_to_piece(id).unwrap_or(&[]);
                        let piece = std::str::from_utf8(bytes).map_or(Piece::Bytes(bytes), Piece::Text);
                        Entry { id, piece }
                    })
                    .collect();
                serde_json::to_string(&entries)
            } else {
                serde_json::to_string(&ids)
            };
            body.map(|b| format!("{{\"tokens\":{b}}}"))
                .map_err(|e| ApiError::invalid(API, e.to_string()))
        })
        .await;
    match r {
        Ok(body) => ([(axum::http::header::CONTENT_TYPE, "application/json")], body).into_response(),
        Err(e) => e.into_response(),
    }
}

#[derive(Debug, Deserialize)]
struct DetokenizeRequest {
    tokens: Vec<u32>,
}

/// `POST /detokenize` `{"tokens": [ids]}`: `{"content": text}` (control tokens as their text; a character cut
/// at the end as U+FFFD).
///
/// Errors: an id outside the vocabulary (400 naming it).
pub async fn detokenize(State(state): State<Shared>, body: Result<Bytes, BytesRejection>) -> Response {
    let st = state.clone();
    api::answer_on_cpu(&state, API, move || {
        let req: DetokenizeRequest = parse_body(API, body)?;
        let text = st
            .model
            .tokenizer
            .decode(&req.tokens)
            .map_err(|e| ApiError::field(API, "tokens", e.to_string()))?;
        Ok(json!({ "content": text }))
    })
    .await
}

#[derive(Debug, Deserialize)]
struct ApplyTemplateRequest {
    messages: Vec<ChatMessage>,
    /// OpenAI's `tools`, offered as `/v1/chat/completions` offers them.
    tools: Option<serde_json::Value>,
}

/// `POST /apply-template` `{"messages": [...], "tools"?: [...]}` (OpenAI's): `{"prompt": text}`, the conversation
/// rendered by the model's chat template with the assistant's turn opened, exactly as `/v1/chat/completions`
/// would send it.
///
/// Errors: as `/v1/chat/completions`' (no template, a role or part it refuses, the template's own refusal).
pub async fn apply_template(State(state): State<Shared>, body: Result<Bytes, BytesRejection>) -> Response {
    let st = state.clone();
    api::answer_on_cpu(&state, API, move || {
        let req: ApplyTemplateRequest = parse_body(API, body)?;
        let tools = super::openai::parse_tools(req.tools.as_ref())?;
        let messages = super::openai::flatten_content(API, req.messages)?;
        Ok(json!({ "prompt": st.model.chat_prompt_with_tools(API, messages, &tools)?.text }))
    })
    .await
}

/// `GET /props`: the server's settings as llama-server reports them: `default_generation_settings` (the
/// context and the sampling a request gets for every field it leaves out), `total_slots` (`--parallel`), the
/// model, and its chat template with its BOS and EOS texts.
pub async fn props(State(state): State<Shared>) -> Response {
    let d = api::server_sampling_defaults();
    let m = &state.model;
    Json(json!({
        "default_generation_settings": {
            "n_ctx": m.n_ctx,
            "params": {
                "temperature": d.temperature,
                "top_k": d.top_k,
                "top_p": d.top_p,
                "min_p": d.min_p,
                "repeat_penalty": d.repeat_penalty,
                "repeat_last_n": d.repeat_last_n,
                "presence_penalty": d.presence_penalty,
                "frequency_penalty": d.frequency_penalty,
                "seed": -1,
                "max_tokens": -1,
            },
        },
        "total_slots": state.parallel,
        "model": m.id,
        "model_path": m.path.display().to_string(),
        "chat_template": m.template.as_ref().map(|t| t.source()),
        "bos_token": m.template.as_ref().map(|t| t.bos_token()),
        "eos_token": m.template.as_ref().map(|t| t.eos_token()),
        "build_info": format!("strata {}", env!("CARGO_PKG_VERSION")),
    }))
    .into_response()
}
