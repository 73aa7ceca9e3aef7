//! What the OpenAI and Anthropic surfaces share: the error type (mapped to each API's own JSON shape in one
//! place), body parsing, the served model's identity and prompt building, and running a request on the engine.

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use anyhow::{Context, Result};
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use tokio::sync::Semaphore;
use tokio::sync::mpsc::UnboundedReceiver;

use super::Shared;
use super::protocol::{Finish, Timings};
use super::supervisor::{EngineRequest, JobEvent, SubmitError};
use super::tools::{self, Tool, ToolFormat, ToolUse};
use crate::gguf::GgufModel;
use crate::model::hparams::HParams;
use crate::runtime::grammar::{GrammarEnv, GrammarError, GrammarSpec, RecentSpecs, spec_key};
use crate::runtime::sampling::{SamplingParams, TokenLogprob};
use crate::runtime::session::context_cells;
use crate::tokenizer::{ChatContent, ChatMessage, ChatPrompt, ChatRequest, ChatTemplate, Tokenizer};

/// Which API a request came through: it decides the error shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Api {
    /// `{"error": {"message", "type", "param", "code"}}`.
    OpenAi,
    /// `{"type": "error", "error": {"type", "message"}}`.
    Anthropic,
}

impl Api {
    /// The API a path belongs to (`/v1/messages...` is Anthropic's, everything else OpenAI's).
    pub fn for_path(path: &str) -> Api {
        if path.starts_with("/v1/messages") {
            Api::Anthropic
        } else {
            Api::OpenAi
        }
    }
}

/// The kinds of failure a client can see; each has one status and one type name per API.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    /// 400: malformed JSON, wrong types, bad values, a prompt over the context.
    InvalidRequest,
    /// 401: missing or wrong API key.
    Authentication,
    /// 404: an unknown model name or path.
    NotFound,
    /// 405: a known path with the wrong method.
    MethodNotAllowed,
    /// 413: a body over `--max-body-bytes`.
    TooLarge,
    /// 408: a body that did not arrive within `--body-timeout-s`.
    Timeout,
    /// 503 with Retry-After: the queue is full.
    Overloaded,
    /// 503 with Retry-After: the engine worker died or is restarting.
    EngineDown,
    /// 403: a `Host` that is not this keyless loopback server's (DNS rebinding).
    Forbidden,
    /// 415: a JSON route's body sent as something other than `application/json` (a browser's cross-site form).
    UnsupportedMediaType,
}

impl ErrorKind {
    fn status(self) -> StatusCode {
        match self {
            ErrorKind::InvalidRequest => StatusCode::BAD_REQUEST,
            ErrorKind::Authentication => StatusCode::UNAUTHORIZED,
            ErrorKind::NotFound => StatusCode::NOT_FOUND,
            ErrorKind::MethodNotAllowed => StatusCode::METHOD_NOT_ALLOWED,
            ErrorKind::TooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            ErrorKind::Timeout => StatusCode::REQUEST_TIMEOUT,
            ErrorKind::Overloaded | ErrorKind::EngineDown => StatusCode::SERVICE_UNAVAILABLE,
            ErrorKind::Forbidden => StatusCode::FORBIDDEN,
            ErrorKind::UnsupportedMediaType => StatusCode::UNSUPPORTED_MEDIA_TYPE,
        }
    }

    /// The error's `type` string in `api`'s vocabulary.
    fn type_name(self, api: Api) -> &'static str {
        match (api, self) {
            (
                _,
                ErrorKind::InvalidRequest
                | ErrorKind::MethodNotAllowed
                | ErrorKind::Timeout
                | ErrorKind::UnsupportedMediaType,
            ) => "invalid_request_error",
            (Api::OpenAi, ErrorKind::Forbidden) => "invalid_request_error",
            (Api::Anthropic, ErrorKind::Forbidden) => "permission_error",
            (_, ErrorKind::Authentication) => "authentication_error",
            (Api::OpenAi, ErrorKind::NotFound) => "invalid_request_error",
            (Api::Anthropic, ErrorKind::NotFound) => "not_found_error",
            (Api::OpenAi, ErrorKind::TooLarge) => "invalid_request_error",
            (Api::Anthropic, ErrorKind::TooLarge) => "request_too_large",
            (Api::OpenAi, ErrorKind::Overloaded | ErrorKind::EngineDown) => "server_error",
            (Api::Anthropic, ErrorKind::Overloaded) => "overloaded_error",
            (Api::Anthropic, ErrorKind::EngineDown) => "api_error",
        }
    }
}

/// An error answer: status, type and message in the shape of the API the request came through.
#[derive(Debug, Clone)]
pub struct ApiError {
    pub api: Api,
    pub kind: ErrorKind,
    pub message: String,
    /// OpenAI's `code` (`model_not_found`, `context_length_exceeded`).
    pub code: Option<&'static str>,
    /// OpenAI's `param`: the request field at fault (`temperature`, `messages[2].role`).
    pub param: Option<String>,
}

impl ApiError {
    pub fn new(api: Api, kind: ErrorKind, message: impl Into<String>) -> ApiError {
        ApiError {
            api,
            kind,
            message: message.into(),
            code: None,
            param: None,
        }
    }

    /// A 400 about request field `param`: the message names it, and OpenAI's `param` carries it.
    pub fn field(api: Api, param: impl Into<String>, message: impl Into<String>) -> ApiError {
        let mut e = ApiError::invalid(api, message);
        e.param = Some(param.into());
        e
    }

    /// A 400 `invalid_request_error`.
    pub fn invalid(api: Api, message: impl Into<String>) -> ApiError {
        ApiError::new(api, ErrorKind::InvalidRequest, message)
    }

    fn with_code(mut self, code: &'static str) -> ApiError {
        self.code = Some(code);
        self
    }

    /// The JSON body in the API's shape.
    pub fn body(&self) -> serde_json::Value {
        let ty = self.kind.type_name(self.api);
        match self.api {
            Api::OpenAi => serde_json::json!({
                "error": { "message": self.message, "type": ty, "param": self.param, "code": self.code }
            }),
            Api::Anthropic => serde_json::json!({
                "type": "error",
                "error": { "type": ty, "message": self.message }
            }),
        }
    }

    /// The error as an SSE `data:` payload for a stream that already answered 200.
    pub fn stream_body(&self) -> String {
        self.body().to_string()
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = self.kind.status();
        let mut resp = (status, axum::Json(self.body())).into_response();
        if status == StatusCode::SERVICE_UNAVAILABLE {
            resp.headers_mut()
                .insert(header::RETRY_AFTER, header::HeaderValue::from_static("1"));
        }
        resp
    }
}

/// Reads a JSON body into `T`, mapping every failure to a 4xx: over the size limit (413), not UTF-8, not
/// JSON, or JSON of the wrong shape or types (400, with serde's line and column).
pub fn parse_body<T: DeserializeOwned>(api: Api, body: Result<Bytes, BytesRejection>) -> Result<T, ApiError> {
    let bytes = body.map_err(|rej| {
        if rej.status() == StatusCode::PAYLOAD_TOO_LARGE {
            ApiError::new(
                api,
                ErrorKind::TooLarge,
                "the request body is larger than --max-body-bytes",
            )
        } else {
            ApiError::invalid(api, format!("cannot read the request body: {rej}"))
        }
    })?;
    let text = std::str::from_utf8(&bytes).map_err(|e| {
        ApiError::invalid(
            api,
            format!("the request body is not valid UTF-8 (at byte {})", e.valid_up_to()),
        )
    })?;
    let mut de = serde_json::Deserializer::from_str(text);
    let value: Result<T, (String, serde_json::Error)> = serde_path_to_error::deserialize(&mut de)
        .map_err(|e| (e.path().to_string(), e.into_inner()))
        .and_then(|v| de.end().map(|()| v).map_err(|e| (".".to_string(), e)));
    value.map_err(|(path, e)| {
        match e.classify() {
            serde_json::error::Category::Syntax | serde_json::error::Category::Eof => {
                ApiError::invalid(api, format!("malformed JSON: {e}"))
            }
            // A field the parser can name (not one inside a flattened or untagged part, which reads `?`).
            _ if path != "." && !path.contains('?') => {
                ApiError::field(api, path.clone(), format!("invalid request: {path}: {e}"))
            }
            _ => ApiError::invalid(api, format!("invalid request: {e}")),
        }
    })
}

/// One string or a list of strings (OpenAI's `stop`, a completion's `prompt`).
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(untagged)]
pub enum OneOrMany {
    One(String),
    Many(Vec<String>),
}

impl OneOrMany {
    pub fn into_vec(self) -> Vec<String> {
        match self {
            OneOrMany::One(s) => vec![s],
            OneOrMany::Many(v) => v,
        }
    }
}

/// The served model: its API name, tokenizer, chat template and context size, read from the GGUF's metadata
/// (no weights are read).
pub struct ModelInfo {
    /// The name clients use: the file name without `.gguf`.
    pub id: String,
    /// The GGUF file (its first shard).
    pub path: std::path::PathBuf,
    file_name: String,
    pub tokenizer: Tokenizer,
    pub template: Option<ChatTemplate>,
    /// Context cells the worker allocates, in tokens.
    pub n_ctx: usize,
    /// Unix seconds the server started (OpenAI's `created`).
    pub created: u64,
    /// How this model writes tool calls (`--tool-format`, else detected from its template).
    pub tool_format: ToolFormat,
    /// The vocabulary indexed for constrained decoding, built by the first request that asks for a grammar.
    grammar: std::sync::OnceLock<Result<Arc<GrammarEnv>, GrammarError>>,
    /// The [`GRAMMARS_CHECKED`] specs [`ModelInfo::check_grammar`] found enforceable and saw last, most recent
    /// first, by [`spec_key`] (of at most [`GRAMMAR_KEY_MAX`] bytes): a spec sent again (the same response or tool
    /// schema, request after request) is not compiled again at the front.
    checked: std::sync::Mutex<RecentSpecs<()>>,
    /// Specs [`ModelInfo::check_grammar`] checked anew (compiled, or refused before compiling).
    compiles: AtomicUsize,
}

/// Enforceable specs the front remembers ([`ModelInfo::check_grammar`]).
pub const GRAMMARS_CHECKED: usize = 16;
/// The largest spec (its [`spec_key`], bytes) the front remembers: at most 4 MiB held in all.
pub const GRAMMAR_KEY_MAX: usize = RecentSpecs::<()>::KEY_MAX;

impl ModelInfo {
    /// Reads the metadata of the model at `path`.
    ///
    /// Errors: the file is not a readable GGUF; its tokenizer, template or hyper-parameters are invalid.
    pub fn open(path: &Path, max_context: usize, tool_format: Option<ToolFormat>) -> Result<ModelInfo> {
        let gguf = GgufModel::open(path)?;
        let md = gguf.metadata();
        let hp = HParams::from_metadata(md).with_context(|| format!("{}: hyper-parameters", path.display()))?;
        let tokenizer = Tokenizer::from_metadata(md).with_context(|| format!("{}: tokenizer", path.display()))?;
        let template = ChatTemplate::from_metadata(md).with_context(|| format!("{}: chat template", path.display()))?;
        let file_name = path
            .file_name()
            .map_or(String::new(), |f| f.to_string_lossy().into_owned());
        Ok(ModelInfo {
            id: file_name.strip_suffix(".gguf").unwrap_or(&file_name).to_string(),
            path: path.to_path_buf(),
            file_name,
            tokenizer,
            n_ctx: context_cells(max_context, hp.n_ctx_train),
            created: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
            grammar: std::sync::OnceLock::new(),
            checked: std::sync::Mutex::new(RecentSpecs::new(GRAMMARS_CHECKED)),
            compiles: AtomicUsize::new(0),
            tool_format: tool_format
                .unwrap_or_else(|| ToolFormat::detect(template.as_ref().map_or("", |t| t.source()))),
            template,
        })
    }

    /// Checks that `spec` can be enforced on this model; `param` names the request field it came from. A spec
    /// among the [`GRAMMARS_CHECKED`] found enforceable and seen last is not compiled again.
    ///
    /// Errors: 400 naming `param` with the constraint engine's reason (an unsupported JSON-schema keyword, a Lark
    /// syntax error).
    pub fn check_grammar(&self, api: Api, param: &str, spec: &GrammarSpec) -> Result<(), ApiError> {
        let checked = || self.checked.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let key = spec_key(spec);
        if checked().get(&key).is_some() {
            return Ok(());
        }
        let env = self
            .grammar
            .get_or_init(|| GrammarEnv::new(&self.tokenizer).map(Arc::new))
            .as_ref()
            .map_err(|e| ApiError::field(api, param, format!("{param} cannot be enforced: {e}")))?;
        self.compiles.fetch_add(1, Ordering::Relaxed);
        env.check(spec)
            .map_err(|e| ApiError::field(api, param, format!("{param} cannot be enforced: {e}")))?;
        // Another request may have checked the same spec meanwhile: `keep` replaces it.
        checked().keep(key, ());
        Ok(())
    }

    /// Specs [`ModelInfo::check_grammar`] checked anew so far (the rest it had found enforceable before).
    pub fn grammar_compiles(&self) -> usize {
        self.compiles.load(Ordering::Relaxed)
    }

    /// The grammar an answer follows: `structured` (what the request's `field` asked for, from
    /// [`ModelInfo::structured_output`]) or the one forcing `tool_use`'s call, checked against this model.
    ///
    /// Errors: 400 naming `field` when both are asked for; 400 naming `tools` when the forced call cannot be
    /// enforced.
    pub fn answer_grammar(
        &self,
        api: Api,
        field: &str,
        structured: Option<GrammarSpec>,
        tool_use: &ToolUse,
    ) -> Result<Option<GrammarSpec>, ApiError> {
        let Some(forced) = tool_use.grammar(self.tool_format) else {
            return Ok(structured);
        };
        if structured.is_some() {
            return Err(ApiError::field(
                api,
                field,
                format!("{field} cannot be combined with a tool_choice that forces a call"),
            ));
        }
        self.check_grammar(api, "tools", &forced)?;
        Ok(Some(forced))
    }

    /// The grammar of a structured-output request field: OpenAI's `response_format` (`{"type": "text"}`,
    /// `{"type": "json_object"}`, `{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}`) or
    /// Anthropic's `output_format` (`{"type": "json_schema", "schema"}`), checked against this model. `None`:
    /// free text.
    ///
    /// Errors: 400 naming the field: an unknown type, a missing or non-object schema, a schema the constraint
    /// engine cannot enforce.
    pub fn structured_output(&self, api: Api, field: &str, v: Option<&Value>) -> Result<Option<GrammarSpec>, ApiError> {
        let Some(v) = v.filter(|v| !v.is_null()) else {
            return Ok(None);
        };
        let kind = v.get("type").and_then(Value::as_str).unwrap_or("");
        let (schema, at) = match (api, kind) {
            (Api::OpenAi, "text") => return Ok(None),
            (Api::OpenAi, "json_object") => (Some(serde_json::json!({ "type": "object" })), format!("{field}.type")),
            (Api::OpenAi, "json_schema") => (
                v.get("json_schema").and_then(|j| j.get("schema")).cloned(),
                format!("{field}.json_schema.schema"),
            ),
            (Api::Anthropic, "json_schema") => (v.get("schema").cloned(), format!("{field}.schema")),
            _ => {
                let known = if api == Api::OpenAi {
                    "`text`, `json_object` or `json_schema`"
                } else {
                    "`json_schema`"
                };
                return Err(ApiError::field(
                    api,
                    format!("{field}.type"),
                    format!(
                        "{field}.type must be {known}, got {}",
                        v.get("type").unwrap_or(&Value::Null)
                    ),
                ));
            }
        };
        let schema = schema
            .filter(|s| s.is_object() || s.is_boolean())
            .ok_or_else(|| ApiError::field(api, at.clone(), format!("{at} must be a JSON schema object")))?;
        let spec = GrammarSpec::JsonSchema { schema };
        self.check_grammar(api, &at, &spec)?;
        Ok(Some(spec))
    }

    /// Checks a request's `model`: absent, `default`, the id or the file name are this model.
    ///
    /// Errors: 404 naming the model that is served.
    pub fn check_name(&self, api: Api, name: Option<&str>) -> Result<(), ApiError> {
        match name {
            None => Ok(()),
            Some(n) if n == "default" || n == self.id || n == self.file_name => Ok(()),
            Some(n) => Err(ApiError::new(
                api,
                ErrorKind::NotFound,
                format!("model `{n}` is not served here; this server serves `{}`", self.id),
            )
            .with_code("model_not_found")),
        }
    }

    /// Renders a conversation through the chat template (opening the assistant's turn) and tokenizes it
    /// ([`ChatTemplate::prompt`]: control tokens in the messages are plain text, no second BOS).
    ///
    /// Errors: no messages; the model has no template; the template refuses the conversation.
    pub fn chat_prompt(&self, api: Api, messages: Vec<ChatMessage>) -> Result<ChatPrompt, ApiError> {
        self.chat_prompt_with_tools(api, messages, &[])
    }

    /// [`ModelInfo::chat_prompt`] offering `tools`: a template that prints `tools` gets them as OpenAI function
    /// objects; any other gets [`tools::generic_prompt`] in its system message (merged into the first one, or
    /// added before the conversation).
    ///
    /// Errors: as [`ModelInfo::chat_prompt`].
    pub fn chat_prompt_with_tools(
        &self,
        api: Api,
        mut messages: Vec<ChatMessage>,
        offered: &[Tool],
    ) -> Result<ChatPrompt, ApiError> {
        if messages.is_empty() {
            return Err(ApiError::invalid(
                api,
                "`messages` is empty: at least one message is needed",
            ));
        }
        let template = self.template.as_ref().ok_or_else(|| {
            ApiError::invalid(
                api,
                "this model has no chat template; use /v1/completions with a plain prompt",
            )
        })?;
        if !template.source().contains("tool_calls") {
            // A template that never prints an assistant's calls would drop them, and the model would not see
            // what it called: they are written into the turn's text in the format the generic prompt asks for.
            for m in &mut messages {
                let Some(serde_json::Value::Array(calls)) = m.extra.remove("tool_calls") else {
                    continue;
                };
                let mut text = match &m.content {
                    ChatContent::Text(t) => t.clone(),
                    _ => String::new(),
                };
                for c in &calls {
                    let f = c.get("function").unwrap_or(c);
                    let call = serde_json::json!({ "name": f.get("name"), "arguments": f.get("arguments") });
                    text.push_str(&format!("<tool_call>{call}</tool_call>"));
                }
                m.content = ChatContent::Text(text);
            }
        }
        let mut tools = None;
        if !offered.is_empty() {
            if template.source().contains("tools") {
                tools = Some(offered.iter().map(Tool::openai).collect());
            } else {
                let prompt = tools::generic_prompt(offered);
                match messages.first_mut() {
                    Some(m) if m.role == "system" => {
                        if let ChatContent::Text(t) = &mut m.content {
                            *t = format!("{t}\n\n{prompt}");
                        }
                    }
                    _ => messages.insert(0, ChatMessage::new("system", prompt)),
                }
            }
        }
        let request = ChatRequest {
            messages,
            tools,
            add_generation_prompt: true,
            ..ChatRequest::default()
        };
        template
            .prompt(&self.tokenizer, &request)
            .map_err(|e| ApiError::invalid(api, e.to_string()))
    }

    /// Tokenizes a plain prompt (special tokens in it are plain text).
    ///
    /// Errors: an empty prompt.
    pub fn text_prompt(&self, api: Api, text: &str) -> Result<Vec<u32>, ApiError> {
        if text.is_empty() {
            return Err(ApiError::invalid(api, "the prompt is empty"));
        }
        self.tokenizer
            .encode(text, true, false)
            .map_err(|e| ApiError::invalid(api, e.to_string()))
    }

    /// Checks that `prompt` fits the context and returns the generation limit: `max_tokens`, or what the
    /// context leaves when it is absent.
    ///
    /// Errors: a prompt over the context (400 with both counts; never truncated); `max_tokens` ≤ 0.
    pub fn limit(&self, api: Api, prompt: &[u32], max_tokens: Option<i64>) -> Result<usize, ApiError> {
        if prompt.len() > self.n_ctx {
            return Err(ApiError::invalid(
                api,
                format!(
                    "the prompt has {} tokens but the context holds {} (--max-context); shorten it",
                    prompt.len(),
                    self.n_ctx
                ),
            )
            .with_code("context_length_exceeded"));
        }
        match max_tokens {
            Some(n) if n <= 0 => Err(ApiError::invalid(
                api,
                format!("max_tokens must be at least 1, got {n}"),
            )),
            Some(n) => Ok(usize::try_from(n).unwrap_or(usize::MAX)),
            None => Ok((self.n_ctx - prompt.len()).max(1)),
        }
    }
}

/// The sampling fields a request may name: OpenAI's (`temperature`, `top_p`, `frequency_penalty`,
/// `presence_penalty`, `seed`, `logit_bias`), Anthropic's (`temperature`, `top_p`, `top_k`), and llama.cpp server's extensions
/// on either API (`top_k`, `min_p`, `repeat_penalty`, `repeat_last_n`). Every one named is used, through the same
/// sampler chain as `strata generate` ([`crate::runtime::sampling::Sampler`]); the others take
/// [`server_sampling_defaults`].
#[derive(Debug, Clone, Default, Deserialize)]
pub struct SamplingFields {
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<i64>,
    pub min_p: Option<f32>,
    pub repeat_penalty: Option<f32>,
    pub repeat_last_n: Option<i64>,
    pub frequency_penalty: Option<f32>,
    pub presence_penalty: Option<f32>,
    /// A seed for the random draw: the same seed and request give the same answer; -1 or absent draws one.
    pub seed: Option<i64>,
    /// OpenAI's `logit_bias`: token ids (as strings, the JSON object's keys) to a bias from -100 to 100 added to
    /// their logits.
    pub logit_bias: Option<std::collections::BTreeMap<String, f32>>,
}

/// What a request samples with when it names nothing: temperature 1 and top_p 1 (OpenAI's and Anthropic's
/// documented defaults), with llama.cpp's top_k 40 and min_p 0.05 guarding the tail, and no penalties (window 64).
/// `/props` shows them.
pub fn server_sampling_defaults() -> SamplingParams {
    SamplingParams {
        temperature: 1.0,
        top_p: 1.0,
        ..SamplingParams::default()
    }
}

/// The most stop strings a request may give, and the longest one in bytes. The worker checks every generated
/// token against each stop string inside the step that serves all running requests, so their number and size are
/// bounded (OpenAI's API takes 4; these leave room for clients that send more).
pub const MAX_STOP_STRINGS: usize = 32;
/// See [`MAX_STOP_STRINGS`].
pub const MAX_STOP_BYTES: usize = 1024;

/// Checks a request's stop strings (`field`: `stop` or `stop_sequences`) against [`MAX_STOP_STRINGS`] and
/// [`MAX_STOP_BYTES`].
///
/// Errors: 400 naming `field`, the count or the long string's index and the limit.
pub fn check_stop(api: Api, field: &str, stop: &[String]) -> Result<(), ApiError> {
    if stop.len() > MAX_STOP_STRINGS {
        return Err(ApiError::field(
            api,
            field,
            format!(
                "{field} has {} strings; at most {MAX_STOP_STRINGS} are supported",
                stop.len()
            ),
        ));
    }
    if let Some((i, s)) = stop.iter().enumerate().find(|(_, s)| s.len() > MAX_STOP_BYTES) {
        return Err(ApiError::field(
            api,
            field,
            format!(
                "{field}[{i}] is {} bytes long; at most {MAX_STOP_BYTES} are supported",
                s.len()
            ),
        ));
    }
    Ok(())
}

/// The most `logit_bias` entries a request may give (each is added to its token's logit every step, inside the
/// step all running requests share; OpenAI's API takes 300).
pub const MAX_LOGIT_BIAS: usize = 1024;

/// `repeat_penalty`'s range on the APIs: a logit divided by less than 0.001 (or multiplied by more than 1000)
/// may overflow f32 to infinity, which would take every draw.
const MIN_REPEAT_PENALTY: f32 = 0.001;
const MAX_REPEAT_PENALTY: f32 = 1000.0;

/// Builds a request's sampler chain from the fields it named and [`server_sampling_defaults`].
///
/// Ranges are each API's own: `temperature` 0..2 on OpenAI's and 0..1 on Anthropic's (0 is greedy), `top_p` and
/// `min_p` 0..1 (`top_p: 0` and `min_p: 1` keep the most likely token alone, `top_p: 1` and `min_p: 0` are off),
/// `frequency_penalty` and `presence_penalty` -2..2, `top_k` ≥ 0 (0 is off), `repeat_penalty` 0.001..1000 (1 is off),
/// `repeat_last_n` ≥ -1 (-1: the whole history, 0: penalties off), `seed` ≥ -1, `logit_bias` token ids below
/// `vocab` (the served model's vocabulary size) to biases -100..100.
///
/// Errors: a value outside its range or not finite, a `logit_bias` key that is not a token id of this model: 400
/// naming the field (OpenAI's `param`).
pub fn sampling(api: Api, f: &SamplingFields, vocab: usize) -> Result<SamplingParams, ApiError> {
    fn range(api: Api, name: &str, v: Option<f32>, lo: f32, hi: f32) -> Result<Option<f32>, ApiError> {
        match v {
            Some(x) if !(x.is_finite() && (lo..=hi).contains(&x)) => Err(ApiError::field(
                api,
                name,
                format!("{name} must be between {lo} and {hi}, got {x}"),
            )),
            v => Ok(v),
        }
    }
    let d = server_sampling_defaults();
    let max_temperature = if api == Api::Anthropic { 1.0 } else { 2.0 };
    let top_k = match f.top_k {
        Some(k) if k < 0 => {
            return Err(ApiError::field(
                api,
                "top_k",
                format!("top_k must be 0 (off) or more, got {k}"),
            ));
        }
        Some(k) => usize::try_from(k).unwrap_or(usize::MAX),
        None => d.top_k,
    };
    let repeat_penalty = match f.repeat_penalty {
        Some(r) if !(MIN_REPEAT_PENALTY..=MAX_REPEAT_PENALTY).contains(&r) => {
            return Err(ApiError::field(
                api,
                "repeat_penalty",
                format!(
                    "repeat_penalty must be between {MIN_REPEAT_PENALTY} and {MAX_REPEAT_PENALTY} (1 is off), got {r}"
                ),
            ));
        }
        r => r.unwrap_or(d.repeat_penalty),
    };
    let repeat_last_n = match f.repeat_last_n {
        Some(n) if !(-1..=i64::from(i32::MAX)).contains(&n) => {
            return Err(ApiError::field(
                api,
                "repeat_last_n",
                format!("repeat_last_n must be -1 (the whole history), 0 (off) or a window in tokens, got {n}"),
            ));
        }
        n => n.map_or(d.repeat_last_n, |n| n as i32),
    };
    let seed = match f.seed {
        Some(s) if s < -1 => {
            return Err(ApiError::field(
                api,
                "seed",
                format!("seed must be -1 (random) or more, got {s}"),
            ));
        }
        Some(-1) | None => None,
        Some(s) => Some(s as u64),
    };
    let mut logit_bias = Vec::new();
    if let Some(n) = f.logit_bias.as_ref().map(|b| b.len()).filter(|&n| n > MAX_LOGIT_BIAS) {
        return Err(ApiError::field(
            api,
            "logit_bias",
            format!("logit_bias has {n} entries; at most {MAX_LOGIT_BIAS} are supported"),
        ));
    }
    for (key, &bias) in f.logit_bias.iter().flatten() {
        // Canonical ids only ("5", not "05" or "+5"), so no token gets two entries.
        let id = key
            .parse::<u32>()
            .ok()
            .filter(|&id| (id as usize) < vocab && *key == id.to_string())
            .ok_or_else(|| {
                ApiError::field(
                    api,
                    "logit_bias",
                    format!(
                        "logit_bias: `{key}` is not a token id of this model (0 to {})",
                        vocab.saturating_sub(1)
                    ),
                )
            })?;
        range(api, "logit_bias", Some(bias), -100.0, 100.0)?;
        logit_bias.push((id, bias));
    }
    let params = SamplingParams {
        temperature: range(api, "temperature", f.temperature, 0.0, max_temperature)?.unwrap_or(d.temperature),
        top_p: range(api, "top_p", f.top_p, 0.0, 1.0)?.unwrap_or(d.top_p),
        top_k,
        min_p: range(api, "min_p", f.min_p, 0.0, 1.0)?.unwrap_or(d.min_p),
        repeat_penalty,
        repeat_last_n,
        frequency_penalty: range(api, "frequency_penalty", f.frequency_penalty, -2.0, 2.0)?
            .unwrap_or(d.frequency_penalty),
        presence_penalty: range(api, "presence_penalty", f.presence_penalty, -2.0, 2.0)?.unwrap_or(d.presence_penalty),
        seed,
        logit_bias,
    };
    // The sampler's own rules, so the worker never refuses what the front accepted.
    params.validate().map_err(|e| ApiError::invalid(api, e.to_string()))?;
    Ok(params)
}

/// How long a stream waits for its first event before committing to 200 and sending keep-alive comments.
pub const STREAM_COMMIT_WAIT: Duration = Duration::from_secs(2);
/// Interval of SSE keep-alive comments while nothing else is sent (a long prefill, a wait in the queue).
pub const STREAM_KEEPALIVE: Duration = Duration::from_secs(2);

/// The HTTP front's CPU work (parsing a body, rendering the chat template, tokenizing) off the async runtime's
/// threads (issue 19, point 3): run on the blocking pool, `parallel` at a time, at most `max_waiting` waiting for
/// their turn. Two clients posting 4 MB `count_tokens` bodies then cannot stall `/health` or other streams, whose
/// tasks keep the runtime's threads.
pub struct CpuGate {
    permits: Arc<Semaphore>,
    waiting: AtomicUsize,
    max_waiting: usize,
}

impl CpuGate {
    pub fn new(parallel: usize, max_waiting: usize) -> CpuGate {
        CpuGate {
            permits: Arc::new(Semaphore::new(parallel.max(1))),
            waiting: AtomicUsize::new(0),
            max_waiting,
        }
    }

    /// Runs `f` on the blocking pool when a permit is free.
    ///
    /// Errors: `f`'s; 503 (with Retry-After) when `max_waiting` requests already wait; a panic in `f` as a 400
    /// naming it.
    pub async fn run<T: Send + 'static>(
        &self,
        api: Api,
        f: impl FnOnce() -> Result<T, ApiError> + Send + 'static,
    ) -> Result<T, ApiError> {
        // Counted while it waits, however the wait ends: a client that leaves mid-wait drops this future, and
        // the guard gives its place back.
        struct Waiting<'a>(&'a AtomicUsize);
        impl Drop for Waiting<'_> {
            fn drop(&mut self) {
                self.0.fetch_sub(1, Ordering::SeqCst);
            }
        }
        let waiting = Waiting(&self.waiting);
        if self.waiting.fetch_add(1, Ordering::SeqCst) >= self.max_waiting {
            return Err(ApiError::new(
                api,
                ErrorKind::Overloaded,
                format!(
                    "the server is busy: {} requests are already waiting to be read and tokenized; retry later",
                    self.max_waiting
                ),
            ));
        }
        let permit = self.permits.clone().acquire_owned().await;
        drop(waiting);
        let permit = permit.expect("the semaphore is never closed");
        match tokio::task::spawn_blocking(move || {
            let _permit = permit;
            f()
        })
        .await
        {
            Ok(r) => r,
            Err(e) => Err(ApiError::invalid(api, format!("reading the request failed: {e}"))),
        }
    }
}

/// Runs `f` (parse, render, tokenize) on `state`'s [`CpuGate`] and answers the JSON it returns, or its error in
/// `api`'s shape: the whole of a route that does not reach the engine.
pub async fn answer_on_cpu(
    state: &Shared,
    api: Api,
    f: impl FnOnce() -> Result<Value, ApiError> + Send + 'static,
) -> Response {
    match state.cpu.run(api, f).await {
        Ok(v) => axum::Json(v).into_response(),
        Err(e) => e.into_response(),
    }
}

/// Queues a request on the engine.
///
/// Errors: 503 with Retry-After when the queue is full.
pub fn submit(state: &Shared, api: Api, request: EngineRequest) -> Result<UnboundedReceiver<JobEvent>, ApiError> {
    state.supervisor.submit(request).map_err(|e| {
        state.metrics.queue_rejected.inc();
        match e {
            SubmitError::QueueFull { max_queue } => ApiError::new(
                api,
                ErrorKind::Overloaded,
                format!("the server is busy: {max_queue} requests are already waiting (--max-queue); retry later"),
            ),
        }
    })
}

/// The error a failed job answers with.
pub fn job_error(api: Api, status: u16, message: String) -> ApiError {
    let kind = if status == 503 {
        ErrorKind::EngineDown
    } else {
        ErrorKind::InvalidRequest
    };
    ApiError::new(api, kind, message)
}

/// A finished non-streaming generation.
pub struct Completed {
    pub text: String,
    pub finish: Finish,
    /// The stop string that ended it, when one did.
    pub stop_word: Option<String>,
    pub timings: Timings,
    /// Each token's log-probability, when the request asked for them.
    pub logprobs: Vec<TokenLogprob>,
}

/// Waits for a whole generation.
///
/// Errors: the job failed (the engine died: 503; the worker refused the request: 400).
pub async fn collect(api: Api, mut rx: UnboundedReceiver<JobEvent>) -> Result<Completed, ApiError> {
    let mut text = String::new();
    let mut all = Vec::new();
    while let Some(ev) = rx.recv().await {
        match ev {
            JobEvent::Text { text: t, logprobs } => {
                text.push_str(&t);
                all.extend(logprobs);
            }
            JobEvent::Done {
                stop,
                stop_word,
                timings,
            } => {
                return Ok(Completed {
                    text,
                    finish: stop,
                    stop_word,
                    timings,
                    logprobs: all,
                });
            }
            JobEvent::Failed { status, message } => return Err(job_error(api, status, message)),
        }
    }
    Err(ApiError::new(
        api,
        ErrorKind::EngineDown,
        "the engine dropped the request",
    ))
}

/// Waits up to [`STREAM_COMMIT_WAIT`] for a stream's first event, so that a failure before any text (a death
/// during prefill, a refused request) is still answered with its own status rather than inside a 200.
///
/// Errors: the job failed before sending anything.
pub async fn first_event(api: Api, rx: &mut UnboundedReceiver<JobEvent>) -> Result<Option<JobEvent>, ApiError> {
    match tokio::time::timeout(STREAM_COMMIT_WAIT, rx.recv()).await {
        Err(_) => Ok(None),
        Ok(Some(JobEvent::Failed { status, message })) => Err(job_error(api, status, message)),
        Ok(Some(ev)) => Ok(Some(ev)),
        Ok(None) => Err(ApiError::new(
            api,
            ErrorKind::EngineDown,
            "the engine dropped the request",
        )),
    }
}

/// A stream's next job event: `pending` (the one [`first_event`] read) first, then the receiver's; a closed
/// receiver reads as a 503 failure, so a stream never ends as if it were whole.
pub async fn next_job_event(pending: &mut Option<JobEvent>, rx: &mut UnboundedReceiver<JobEvent>) -> JobEvent {
    if let Some(ev) = pending.take() {
        return ev;
    }
    rx.recv().await.unwrap_or_else(|| JobEvent::Failed {
        status: 503,
        message: "the engine dropped the request".into(),
    })
}

/// Seconds since the Unix epoch.
pub fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// A response id with `prefix` (`chatcmpl-`, `cmpl-`, `msg_`), unique within this process.
pub fn response_id(prefix: &str) -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(0);
    format!("{prefix}{:x}{:06x}", unix_now(), NEXT.fetch_add(1, Ordering::Relaxed))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A request that waits for the CPU gate and is dropped (its client left) gives its place back: the gate
    /// does not fill up with ghosts and answer 503 for ever.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_request_dropped_while_waiting_for_the_cpu_gate_frees_its_place() {
        let gate = Arc::new(CpuGate::new(1, 1));
        let (release, hold) = std::sync::mpsc::channel::<()>();
        let busy = {
            let g = gate.clone();
            tokio::spawn(async move {
                g.run(Api::OpenAi, move || {
                    let _ = hold.recv();
                    Ok(())
                })
                .await
            })
        };
        tokio::time::sleep(Duration::from_millis(50)).await;
        for _ in 0..3 {
            // Waits behind `busy`, then its client leaves.
            let r = tokio::time::timeout(Duration::from_millis(20), gate.run(Api::OpenAi, || Ok(()))).await;
            assert!(r.is_err(), "it waited");
        }
        release.send(()).unwrap();
        busy.await.unwrap().unwrap();
        gate.run(Api::OpenAi, || Ok(())).await.expect("a place is free");
    }
}
