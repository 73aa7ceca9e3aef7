//! Chat templates: the Jinja template in `tokenizer.chat_template`, rendered with minijinja the way Hugging Face's
//! `apply_chat_template` renders it.
//!
//! The environment matches transformers': `trim_blocks` and `lstrip_blocks` on, Python string and dict methods
//! (`.strip()`, `.startswith()`, `.items()`...) through `minijinja_contrib::pycompat`, the `raise_exception(msg)`
//! and `strftime_now(format)` functions, and the variables `messages`, `tools` (none when absent),
//! `add_generation_prompt`, `bos_token` and `eos_token`.

use std::error::Error as _;
use std::fmt::{self, Write as _};

use minijinja::{Environment, Error, ErrorKind, Value};
use serde::{Deserialize, Serialize};

use super::special::unguard;
use super::{Tokenizer, TokenizerError};
use crate::gguf::{Metadata, MetadataError};

/// The GGUF key of the default chat template; named variants live at `tokenizer.chat_template.<name>`.
pub const KEY_CHAT_TEMPLATE: &str = "tokenizer.chat_template";

const TEMPLATE_NAME: &str = "chat_template";

/// Why a chat template could not be loaded or rendered.
#[derive(Debug, thiserror::Error)]
pub enum TemplateError {
    #[error(transparent)]
    Metadata(#[from] MetadataError),
    /// The template does not compile; `line` is 1-based within the template.
    #[error("{key} does not compile{}: {message}", line.map(|l| format!(" (line {l})")).unwrap_or_default())]
    Syntax {
        key: String,
        line: Option<usize>,
        message: String,
    },
    /// The template called `raise_exception(message)`, usually because the conversation breaks its rules
    /// (roles not alternating, a system message where none is allowed).
    #[error("the chat template refused the conversation: {message}")]
    Raised { message: String },
    /// Rendering failed for another reason (an undefined method, a type error...).
    #[error("rendering the chat template failed{}: {message}", line.map(|l| format!(" (line {l})")).unwrap_or_default())]
    Render { line: Option<usize>, message: String },
}

/// The content of a message: plain text, or a list of typed parts (OpenAI's `[{"type": "text", "text": ...}]`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum ChatContent {
    Text(String),
    Parts(Vec<ContentPart>),
    /// `null` or absent: an assistant turn that only calls tools, as the SDKs send it back. The template sees
    /// none.
    #[default]
    Null,
}

/// One part of a multi-part message.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ContentPart {
    /// `text`, `image`, `image_url`...
    #[serde(rename = "type")]
    pub kind: String,
    /// The text of a `text` part.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub text: Option<String>,
    /// Any other fields, passed to the template as they are.
    #[serde(flatten)]
    pub extra: serde_json::Map<String, serde_json::Value>,
}

/// One message of a conversation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant`, `tool`...
    pub role: String,
    #[serde(default)]
    pub content: ChatContent,
    /// Other fields the template may read (`tool_calls`, `name`, `tool_call_id`...).
    #[serde(flatten)]
    pub extra: serde_json::Map<String, serde_json::Value>,
}

impl ChatMessage {
    /// A message with plain-text content.
    pub fn new(role: impl Into<String>, text: impl Into<String>) -> ChatMessage {
        ChatMessage {
            role: role.into(),
            content: ChatContent::Text(text.into()),
            extra: Default::default(),
        }
    }
}

/// What to render: the conversation, the tools on offer, and whether to open the assistant's turn.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ChatRequest {
    pub messages: Vec<ChatMessage>,
    /// Tool definitions (OpenAI's `{"type": "function", "function": {...}}` objects), or `None` (the template
    /// sees `tools` as none).
    #[serde(default)]
    pub tools: Option<Vec<serde_json::Value>>,
    /// Whether to end with the header of an assistant turn, so that generation continues as the assistant.
    #[serde(default)]
    pub add_generation_prompt: bool,
    /// Extra template variables (`enable_thinking`, `documents`...).
    #[serde(default)]
    pub extra: serde_json::Map<String, serde_json::Value>,
}

/// A conversation rendered and tokenized by [`ChatTemplate::prompt`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChatPrompt {
    /// The rendered text, as the template wrote it.
    pub text: String,
    /// Its token ids, BOS included where the model wants one.
    pub ids: Vec<u32>,
}

/// Why [`ChatTemplate::prompt`] failed.
#[derive(Debug, thiserror::Error)]
pub enum PromptError {
    #[error(transparent)]
    Template(#[from] TemplateError),
    #[error(transparent)]
    Tokenizer(#[from] TokenizerError),
}

/// Every string in `v` (object values, array items; not keys) through [`Tokenizer::guard_specials`].
fn guard_strings(tokenizer: &Tokenizer, v: &mut serde_json::Value) {
    match v {
        serde_json::Value::String(s) => {
            if let std::borrow::Cow::Owned(g) = tokenizer.guard_specials(s) {
                *s = g;
            }
        }
        serde_json::Value::Array(items) => items.iter_mut().for_each(|x| guard_strings(tokenizer, x)),
        serde_json::Value::Object(map) => map.values_mut().for_each(|x| guard_strings(tokenizer, x)),
        _ => {}
    }
}

/// The error `raise_exception` attaches, so that [`ChatTemplate::render`] can tell it from other failures.
#[derive(Debug)]
struct Raised(String);

impl fmt::Display for Raised {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Raised {}

/// A compiled chat template with the BOS and EOS texts it may print.
pub struct ChatTemplate {
    env: Environment<'static>,
    /// The template's Jinja source.
    source: String,
    bos_token: String,
    eos_token: String,
}

impl fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("bos_token", &self.bos_token)
            .field("eos_token", &self.eos_token)
            .finish()
    }
}

/// The text of the token whose id is stored at `id_key`, or "" when either is missing.
fn token_text(meta: &Metadata, id_key: &str) -> String {
    let Some(id) = meta.get(id_key).and_then(|v| v.as_u64()) else {
        return String::new();
    };
    let tokens = meta.get(super::KEY_TOKENS).and_then(|v| v.as_array()).unwrap_or(&[]);
    tokens
        .get(id as usize)
        .and_then(|v| v.as_str())
        .unwrap_or("")
        .to_string()
}

impl ChatTemplate {
    /// The template in `tokenizer.chat_template`, compiled, with `bos_token` and `eos_token` taken from
    /// `tokenizer.ggml.tokens` at `tokenizer.ggml.bos_token_id` / `eos_token_id`. `Ok(None)` when the GGUF has
    /// no template (base models often have none).
    ///
    /// Errors: the key holds a non-string ([`TemplateError::Metadata`]); the template does not compile
    /// ([`TemplateError::Syntax`], naming the key and the line).
    pub fn from_metadata(meta: &Metadata) -> Result<Option<ChatTemplate>, TemplateError> {
        Self::load(meta, KEY_CHAT_TEMPLATE)
    }

    /// A named variant, `tokenizer.chat_template.<name>` (`tool_use`, `rag`), as some GGUFs carry.
    ///
    /// Errors: as [`ChatTemplate::from_metadata`].
    pub fn from_metadata_named(meta: &Metadata, name: &str) -> Result<Option<ChatTemplate>, TemplateError> {
        Self::load(meta, &format!("{KEY_CHAT_TEMPLATE}.{name}"))
    }

    fn load(meta: &Metadata, key: &str) -> Result<Option<ChatTemplate>, TemplateError> {
        if !meta.contains(key) {
            return Ok(None);
        }
        let source = meta.get_str(key)?;
        let bos = token_text(meta, super::KEY_BOS_ID);
        let eos = token_text(meta, super::KEY_EOS_ID);
        Self::compile(key, source, bos, eos).map(Some)
    }

    /// Compiles `source` (`key` names where it came from, for errors).
    ///
    /// Errors: [`TemplateError::Syntax`] with the line of the first error.
    pub fn compile(
        key: &str,
        source: &str,
        bos_token: impl Into<String>,
        eos_token: impl Into<String>,
    ) -> Result<ChatTemplate, TemplateError> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", |message: String| -> Result<Value, Error> {
            Err(Error::new(ErrorKind::InvalidOperation, message.clone()).with_source(Raised(message)))
        });
        env.add_function("strftime_now", |format: String| strftime(&format, unix_now_s()));
        env.add_filter("tojson", tojson);
        env.add_filter("from_json", from_json);
        // jinja2's `iterable` is false for none (minijinja iterates none as empty); templates test `tools is
        // iterable` before `tools | length`.
        env.add_test("iterable", |v: &Value| {
            !v.is_none() && !v.is_undefined() && v.try_iter().is_ok()
        });
        env.add_filter("string", |v: &Value| Value::from(PyStr(v).to_string()));
        env.set_formatter(|out, _state, value| {
            write!(out, "{}", PyStr(value)).map_err(|e| Error::new(ErrorKind::WriteFailure, e.to_string()))
        });
        let syntax = |e: Error| TemplateError::Syntax {
            key: key.to_string(),
            line: e.line(),
            message: e.detail().unwrap_or(&e.to_string()).to_string(),
        };
        env.add_template_owned(TEMPLATE_NAME, without_generation_tags(source).into_owned())
            .map_err(syntax)?;
        if let Some(name) = unknown_filter(&env) {
            // jinja2 refuses an unknown filter when it compiles the template; minijinja only when it is reached.
            return Err(TemplateError::Syntax {
                key: key.to_string(),
                line: None,
                message: format!("no filter named '{name}'"),
            });
        }
        Ok(ChatTemplate {
            env,
            source: source.to_string(),
            bos_token: bos_token.into(),
            eos_token: eos_token.into(),
        })
    }

    /// Renders the conversation to the prompt text (special tokens written as text: encode it with
    /// `parse_special`).
    ///
    /// Errors: [`TemplateError::Raised`] with the template's own message when it calls `raise_exception`;
    /// [`TemplateError::Render`] for any other failure, with the template line.
    pub fn render(&self, request: &ChatRequest) -> Result<String, TemplateError> {
        self.render_with(request, &mut |_| {})
    }

    /// Renders `request` and tokenizes it as the model was trained (what `strata chat`, `generate --chat` and
    /// `strata serve` send to the model):
    /// - control-token texts inside the conversation's strings (message contents, tool calls, tool definitions)
    ///   are tokenized as plain text ([`Tokenizer::guard_specials`]): only the template's own markup becomes
    ///   control tokens, so a user cannot close their turn and forge another by typing `<|im_end|>`;
    /// - BOS is added as the tokenizer asks, unless the rendered text already starts with it (Gemma's templates
    ///   print `bos_token`): no second BOS, as llama.cpp and Hugging Face do.
    ///
    /// Errors: the template's ([`ChatTemplate::render`]) as [`PromptError::Template`]; the tokenizer's as
    /// [`PromptError::Tokenizer`].
    pub fn prompt(&self, tokenizer: &Tokenizer, request: &ChatRequest) -> Result<ChatPrompt, PromptError> {
        let guarded = self.render_with(request, &mut |v| guard_strings(tokenizer, v))?;
        let starts_with_bos = !self.bos_token.is_empty() && guarded.starts_with(&self.bos_token);
        let ids = tokenizer.encode_chat(&guarded, !starts_with_bos)?;
        let text = unguard(&guarded).into_owned();
        Ok(ChatPrompt { text, ids })
    }

    /// Renders `request`, letting `adjust` change the conversation's JSON (`messages` and `tools`) first.
    fn render_with(
        &self,
        request: &ChatRequest,
        adjust: &mut dyn FnMut(&mut serde_json::Value),
    ) -> Result<String, TemplateError> {
        let template = self.env.get_template(TEMPLATE_NAME).expect("added at compile time");
        let mut ctx = serde_json::Map::new();
        for (k, v) in &request.extra {
            ctx.insert(k.clone(), v.clone());
        }
        let mut messages = serde_json::to_value(&request.messages).expect("messages serialize");
        adjust(&mut messages);
        ctx.insert("messages".into(), messages);
        let mut tools = request
            .tools
            .as_ref()
            .map_or(serde_json::Value::Null, |t| t.clone().into());
        adjust(&mut tools);
        ctx.insert("tools".into(), tools);
        // Hugging Face passes `documents` (none without RAG documents) as it passes `tools`.
        ctx.entry("documents").or_insert(serde_json::Value::Null);
        ctx.insert("add_generation_prompt".into(), request.add_generation_prompt.into());
        ctx.insert("bos_token".into(), self.bos_token.clone().into());
        ctx.insert("eos_token".into(), self.eos_token.clone().into());
        template.render(Value::from_serialize(&ctx)).map_err(|e| {
            let mut source = e.source();
            while let Some(s) = source {
                if let Some(raised) = s.downcast_ref::<Raised>() {
                    return TemplateError::Raised {
                        message: raised.0.clone(),
                    };
                }
                source = s.source();
            }
            TemplateError::Render {
                line: e.line(),
                message: e.detail().unwrap_or(&e.to_string()).to_string(),
            }
        })
    }

    /// Fixes the clock `strftime_now` reads at `unix_s` (UTC), for renders that must not change with the date
    /// (goldens, tests).
    pub fn set_clock(&mut self, unix_s: i64) {
        self.env
            .add_function("strftime_now", move |format: String| strftime(&format, unix_s));
    }

    /// The template's Jinja source, as the GGUF holds it.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// The BOS text the template sees as `bos_token`.
    pub fn bos_token(&self) -> &str {
        &self.bos_token
    }

    /// The EOS text the template sees as `eos_token`.
    pub fn eos_token(&self) -> &str {
        &self.eos_token
    }
}

/// The first filter `env`'s template applies that `env` does not have.
fn unknown_filter(env: &Environment<'static>) -> Option<String> {
    use minijinja::machinery::{Instruction, get_compiled_template};
    let template = env.get_template(TEMPLATE_NAME).ok()?;
    let compiled = get_compiled_template(&template);
    let mut names: Vec<&str> = Vec::new();
    for instructions in std::iter::once(&compiled.instructions).chain(compiled.blocks.values()) {
        for i in 0..instructions.len() as u32 {
            if let Some(Instruction::ApplyFilter(name, ..)) = instructions.get(i)
                && !names.contains(name)
            {
                names.push(name);
            }
        }
    }
    names.into_iter().find_map(|name| {
        // A known filter may fail on `none`, but never as an unknown one.
        let probe = format!("{{{{ none | {name} }}}}");
        match env.render_str(&probe, ()) {
            Err(e) if e.kind() == ErrorKind::UnknownFilter => Some(name.to_string()),
            _ => None,
        }
    })
}

/// `source` with Hugging Face's `{% generation %}` and `{% endgeneration %}` tags (they mark the assistant's text
/// for training masks and render their body as it is) written as an `if true` block, their whitespace control
/// kept: minijinja has no such tag.
fn without_generation_tags(source: &str) -> std::borrow::Cow<'_, str> {
    if !source.contains("generation") {
        return std::borrow::Cow::Borrowed(source);
    }
    let mut out = String::with_capacity(source.len());
    let mut rest = source;
    while let Some(at) = rest.find("{%") {
        out.push_str(&rest[..at]);
        let tag = &rest[at..];
        let Some(end) = tag.find("%}") else {
            break;
        };
        let inner = &tag[2..end];
        let body = inner.trim_start_matches(['-', '+']).trim_end_matches(['-', '+']).trim();
        let replacement = match body {
            "generation" => Some("if true"),
            "endgeneration" => Some("endif"),
            _ => None,
        };
        match replacement {
            Some(r) => {
                let lead = &inner[..inner.len() - inner.trim_start_matches(['-', '+']).len()];
                let trail = &inner[inner.trim_end_matches(['-', '+']).len()..];
                out.push_str(&format!("{{%{lead} {r} {trail}%}}"));
            }
            None => out.push_str(&tag[..end + 2]),
        }
        rest = &tag[end + 2..];
    }
    out.push_str(rest);
    std::borrow::Cow::Owned(out)
}

/// Hugging Face's `tojson` filter: Python's `json.dumps(x, ensure_ascii=False, indent=None, separators=None,
/// sort_keys=False)`, so key order is kept and nothing is HTML-escaped (minijinja's own sorts keys and escapes
/// `<`, `>`, `&` and `'`). The keyword arguments are json.dumps': `ensure_ascii`, `indent` (a count of spaces or
/// a string), `separators` (a pair), `sort_keys`.
fn tojson(value: &Value, kwargs: minijinja::value::Kwargs) -> Result<Value, Error> {
    let ensure_ascii: Option<bool> = kwargs.get("ensure_ascii")?;
    let indent: Option<Value> = kwargs.get("indent")?;
    let separators: Option<Vec<String>> = kwargs.get("separators")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    kwargs.assert_all_used()?;
    let indent = match indent {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) => match v.as_i64() {
            Some(n) => Some(" ".repeat(n.max(0) as usize)),
            None => Some(v.as_str().unwrap_or_default().to_string()),
        },
    };
    let (item, key) = match separators.as_deref() {
        Some([item, key]) => (item.clone(), key.clone()),
        Some(_) => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                "tojson: separators must be a pair (item separator, key separator)",
            ));
        }
        None if indent.is_some() => (",".to_string(), ": ".to_string()),
        None => (", ".to_string(), ": ".to_string()),
    };
    let json =
        serde_json::to_value(value).map_err(|e| Error::new(ErrorKind::InvalidOperation, format!("tojson: {e}")))?;
    let mut out = String::new();
    PyJson {
        indent,
        item,
        key,
        sort_keys: sort_keys.unwrap_or(false),
        ensure_ascii: ensure_ascii.unwrap_or(false),
    }
    .write(&json, 0, &mut out);
    Ok(Value::from_safe_string(out))
}

/// `from_json` (vLLM's and llama.cpp's template extension, used by DeepSeek V3.2's and V4's templates): a JSON
/// string to its value.
fn from_json(text: &str) -> Result<Value, Error> {
    serde_json::from_str::<serde_json::Value>(text)
        .map(|v| Value::from_serialize(&v))
        .map_err(|e| Error::new(ErrorKind::InvalidOperation, format!("from_json: {e}")))
}

/// A value printed as jinja2 prints it (Python's `str`): `None`, `True` and `False`; strings as they are; lists and
/// dicts as Python's `repr` (`{'type': 'function'}`), where minijinja writes nothing for none, lower-case booleans
/// and JSON-like containers.
struct PyStr<'a>(&'a Value);

impl fmt::Display for PyStr<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        use minijinja::value::ValueKind;
        match self.0.kind() {
            ValueKind::String => f.write_str(self.0.as_str().unwrap_or_default()),
            ValueKind::Undefined => Ok(()),
            _ => PyRepr(self.0).fmt(f),
        }
    }
}

/// Python's `repr` of a value (strings quoted, as inside a printed list or dict).
struct PyRepr<'a>(&'a Value);

impl fmt::Display for PyRepr<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        use minijinja::value::ValueKind;
        let v = self.0;
        match v.kind() {
            ValueKind::Undefined | ValueKind::None => f.write_str("None"),
            ValueKind::Bool => f.write_str(if v.is_true() { "True" } else { "False" }),
            ValueKind::String => {
                let s = v.as_str().unwrap_or_default();
                // Python quotes with ' unless the text holds ' and no ".
                let q = if s.contains('\'') && !s.contains('"') {
                    '"'
                } else {
                    '\''
                };
                f.write_char(q)?;
                for c in s.chars() {
                    match c {
                        '\\' => f.write_str("\\\\")?,
                        '\n' => f.write_str("\\n")?,
                        '\r' => f.write_str("\\r")?,
                        '\t' => f.write_str("\\t")?,
                        c if c == q => write!(f, "\\{c}")?,
                        c if (c as u32) < 0x20 || c as u32 == 0x7f => write!(f, "\\x{:02x}", c as u32)?,
                        c => f.write_char(c)?,
                    }
                }
                f.write_char(q)
            }
            ValueKind::Seq => {
                f.write_char('[')?;
                for (i, x) in v.try_iter().into_iter().flatten().enumerate() {
                    if i > 0 {
                        f.write_str(", ")?;
                    }
                    PyRepr(&x).fmt(f)?;
                }
                f.write_char(']')
            }
            ValueKind::Map => {
                f.write_char('{')?;
                for (i, k) in v.try_iter().into_iter().flatten().enumerate() {
                    if i > 0 {
                        f.write_str(", ")?;
                    }
                    let x = v.get_item(&k).unwrap_or_default();
                    write!(f, "{}: {}", PyRepr(&k), PyRepr(&x))?;
                }
                f.write_char('}')
            }
            _ => write!(f, "{v}"),
        }
    }
}

/// Python's `json.dumps` layout (see [`tojson`]).
struct PyJson {
    indent: Option<String>,
    item: String,
    key: String,
    sort_keys: bool,
    ensure_ascii: bool,
}

impl PyJson {
    fn newline(&self, depth: usize, out: &mut String) {
        if let Some(ind) = &self.indent {
            out.push('\n');
            for _ in 0..depth {
                out.push_str(ind);
            }
        }
    }

    fn write(&self, v: &serde_json::Value, depth: usize, out: &mut String) {
        use serde_json::Value as J;
        match v {
            J::Null => out.push_str("null"),
            J::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
            J::Number(n) => out.push_str(&n.to_string()),
            J::String(s) => self.string(s, out),
            J::Array(items) if items.is_empty() => out.push_str("[]"),
            J::Array(items) => {
                out.push('[');
                for (i, x) in items.iter().enumerate() {
                    if i > 0 {
                        out.push_str(&self.item);
                    }
                    self.newline(depth + 1, out);
                    self.write(x, depth + 1, out);
                }
                self.newline(depth, out);
                out.push(']');
            }
            J::Object(map) if map.is_empty() => out.push_str("{}"),
            J::Object(map) => {
                let mut entries: Vec<(&String, &serde_json::Value)> = map.iter().collect();
                if self.sort_keys {
                    entries.sort_by(|a, b| a.0.cmp(b.0));
                }
                out.push('{');
                for (i, (k, x)) in entries.into_iter().enumerate() {
                    if i > 0 {
                        out.push_str(&self.item);
                    }
                    self.newline(depth + 1, out);
                    self.string(k, out);
                    out.push_str(&self.key);
                    self.write(x, depth + 1, out);
                }
                self.newline(depth, out);
                out.push('}');
            }
        }
    }

    /// A JSON string as Python writes it: `\"`, `\\`, `\n`, `\r`, `\t`, `\b`, `\f`, other control characters as
    /// `\u00XX`; with `ensure_ascii` every non-ASCII character as `\uXXXX` (UTF-16, surrogate pairs).
    fn string(&self, s: &str, out: &mut String) {
        use std::fmt::Write as _;
        out.push('"');
        for c in s.chars() {
            match c {
                '"' => out.push_str("\\\""),
                '\\' => out.push_str("\\\\"),
                '\n' => out.push_str("\\n"),
                '\r' => out.push_str("\\r"),
                '\t' => out.push_str("\\t"),
                '\u{8}' => out.push_str("\\b"),
                '\u{c}' => out.push_str("\\f"),
                c if (c as u32) < 0x20 || (self.ensure_ascii && !c.is_ascii()) => {
                    let mut units = [0u16; 2];
                    for u in c.encode_utf16(&mut units) {
                        let _ = write!(out, "\\u{u:04x}");
                    }
                }
                c => out.push(c),
            }
        }
        out.push('"');
    }
}

fn unix_now_s() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64)
}

/// Year, month (1-12) and day (1-31) of a day count since 1970-01-01 (proleptic Gregorian; the "days from civil"
/// inverse from Howard Hinnant's date algorithms).
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (yoe + era * 400 + i64::from(month <= 2), month, day)
}

/// Days since 1970-01-01 of a proleptic Gregorian date (the inverse of [`civil_from_days`]).
fn days_from_civil(year: i64, month: u32, day: u32) -> i64 {
    let y = if month <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = i64::from((month + 9) % 12);
    let doy = (153 * mp + 2) / 5 + i64::from(day) - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// Python's `strftime` for the common specifiers, in UTC: `%Y %y %m %d %e %j %H %I %M %S %p %B %b %h %A %a %%`.
/// Others are copied through as written.
fn strftime(format: &str, unix_s: i64) -> String {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    const WEEKDAYS: [&str; 7] = [
        "Monday",
        "Tuesday",
        "Wednesday",
        "Thursday",
        "Friday",
        "Saturday",
        "Sunday",
    ];
    let days = unix_s.div_euclid(86_400);
    let secs = unix_s.rem_euclid(86_400);
    let (year, month, day) = civil_from_days(days);
    let (hour, minute, second) = (secs / 3600, secs / 60 % 60, secs % 60);
    // 1970-01-01 was a Thursday (index 3 from Monday).
    let weekday = WEEKDAYS[(days + 3).rem_euclid(7) as usize];
    let month_name = MONTHS[month as usize - 1];
    let day_of_year = days - days_from_civil(year, 1, 1) + 1;
    let mut out = String::with_capacity(format.len() + 16);
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('Y') => out += &year.to_string(),
            Some('y') => out += &format!("{:02}", year.rem_euclid(100)),
            Some('m') => out += &format!("{month:02}"),
            Some('d') => out += &format!("{day:02}"),
            Some('e') => out += &format!("{day:>2}"),
            Some('j') => out += &format!("{day_of_year:03}"),
            Some('H') => out += &format!("{hour:02}"),
            Some('I') => out += &format!("{:02}", if hour % 12 == 0 { 12 } else { hour % 12 }),
            Some('M') => out += &format!("{minute:02}"),
            Some('S') => out += &format!("{second:02}"),
            Some('p') => out += if hour < 12 { "AM" } else { "PM" },
            Some('B') => out += month_name,
            Some('b') | Some('h') => out += &month_name[..3],
            Some('A') => out += weekday,
            Some('a') => out += &weekday[..3],
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strftime_formats_known_dates() {
        // 2024-07-26 13:25:09 UTC, a Friday, day 208 of a leap year (checked with Python's datetime).
        let t = 1_722_000_309;
        assert_eq!(strftime("%Y-%m-%d %H:%M:%S", t), "2024-07-26 13:25:09");
        assert_eq!(
            strftime("%d %B %Y, %A %a %b %j %p %I %%", t),
            "26 July 2024, Friday Fri Jul 208 PM 01 %"
        );
        assert_eq!(strftime("%Y-%m-%d", 0), "1970-01-01");
        assert_eq!(strftime("%Y-%m-%d %j", 951_782_400), "2000-02-29 060");
    }
}
