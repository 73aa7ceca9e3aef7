//! `strata serve`: an HTTP front (axum) speaking the OpenAI and Anthropic APIs, over one supervised engine worker
//! process (DESIGN.md section 3).
//!
//! - [`protocol`]: the JSON-lines protocol between the front and the worker.
//! - [`worker`]: the worker process (`strata worker`, hidden): loads the model, runs one request at a time.
//! - [`supervisor`]: spawns, feeds, watches and restarts the worker; the bounded request queue.
//! - [`api`]: what both APIs share: errors in each API's shape, body parsing, prompts, the model's identity.
//! - [`openai`] and [`anthropic`]: the two API surfaces. [`metrics`]: `/metrics`.
//!
//! The front renders chat templates and tokenizes (to count tokens and refuse an over-long prompt before it
//! queues) but never loads weights; the worker does.

pub mod anthropic;
pub mod api;
pub mod helpers;
pub mod listen;
pub mod metrics;
pub mod openai;
pub mod orphan;
pub mod protocol;
pub mod supervisor;
pub mod tools;
pub mod worker;

use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use axum::Router;
use axum::extract::{DefaultBodyLimit, MatchedPath, Request, State};
use axum::http::{HeaderMap, Method, StatusCode, Uri, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use subtle::ConstantTimeEq;

use api::{Api, ApiError, ErrorKind, ModelInfo};
use metrics::Metrics;
use supervisor::{Supervisor, SupervisorConfig};

/// Requests `strata serve` computes at once without `--parallel` (llama-server's default too).
pub const DEFAULT_PARALLEL: usize = 4;

/// The environment variable read when `--api-key` is not given.
pub const ENV_API_KEY: &str = crate::switches::API_KEY;

pub use crate::runtime::engine::{EngineFlags, OnOff, PrefillChunk};

/// What `strata worker` is started with: the engine flags, and where its events go.
#[derive(Debug, Clone, clap::Args)]
pub struct WorkerFlags {
    #[command(flatten)]
    pub engine: EngineFlags,
    /// Append the worker's structured events (JSON lines, DESIGN.md section 3) to this file.
    #[arg(long)]
    pub events: Option<std::path::PathBuf>,
}

impl WorkerFlags {
    /// The flags as command-line arguments, for `strata worker`.
    pub fn to_args(&self) -> Vec<String> {
        let mut a = self.engine.to_args();
        if let Some(p) = &self.events {
            a.extend(["--events".into(), p.display().to_string()]);
        }
        a
    }
}

/// `strata serve` flags.
#[derive(Debug, Clone, clap::Args)]
pub struct ServeArgs {
    #[command(flatten)]
    pub engine: EngineFlags,
    /// Append the worker's structured events (JSON lines, DESIGN.md section 3) to this file.
    #[arg(long)]
    pub events: Option<std::path::PathBuf>,
    /// Address to bind. A non-loopback address needs an API key (or --insecure-public).
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    #[arg(long, default_value_t = 8080)]
    pub port: u16,
    /// Requests allowed to wait for a slot (`--parallel` run at once; 1 to 1,000,000); beyond it the answer is 503
    /// with Retry-After. A request with `n` choices takes `n`.
    #[arg(long, default_value_t = 16, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=1_000_000))]
    pub max_queue: usize,
    /// A worker silent this many seconds while a request is in flight is killed and restarted (at most a week).
    #[arg(long, default_value_t = 120, value_parser = clap::value_parser!(u64).range(1..=604_800))]
    pub watchdog_s: u64,
    /// Largest request body in bytes; a larger one gets 413.
    #[arg(long, default_value_t = 4 * 1024 * 1024)]
    pub max_body_bytes: usize,
    /// Seconds a request body may take to arrive in full; a client that stops sending mid-body gets 408 and its
    /// connection is closed, instead of holding it open for ever.
    #[arg(long, default_value_t = 30, value_parser = clap::value_parser!(u64).range(1..))]
    pub body_timeout_s: u64,
    /// Require this key as `Authorization: Bearer KEY` or `x-api-key: KEY` (else $STRATA_API_KEY).
    #[arg(long)]
    pub api_key: Option<String>,
    /// Allow a non-loopback address without an API key.
    #[arg(long)]
    pub insecure_public: bool,
    /// Seconds a worker may take to load the model before it is taken for hung, killed and restarted (default:
    /// 120 plus 20 a GiB of the model file; at most a week).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=604_800))]
    pub load_timeout_s: Option<u64>,
    /// Seconds Ctrl-C or SIGTERM waits for the answers in flight to finish before the server exits (at most an
    /// hour; a second interrupt ends the wait).
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u64).range(0..=3600), allow_hyphen_values = true)]
    pub drain_s: u64,
    /// A host name a keyless loopback server also answers (repeatable). Without an API key such a server
    /// answers only loopback names in `Host` (`localhost`, `127.0.0.1`, `[::1]`): a web page whose name a DNS
    /// rebinding points at 127.0.0.1 is refused with 403.
    #[arg(long = "allowed-host", value_name = "NAME")]
    pub allowed_hosts: Vec<String>,
    /// A web origin whose pages may call the API from a browser (repeatable; `https://app.example.com`): CORS
    /// preflights from it are answered, and its answers carry `Access-Control-Allow-Origin`. No other origin's.
    #[arg(long = "cors-origin", value_name = "ORIGIN")]
    pub cors_origins: Vec<String>,
    /// How the model writes tool calls (default: detected from its chat template; Hermes `<tool_call>` blocks
    /// when the template shows none).
    #[arg(long, value_enum)]
    pub tool_format: Option<tools::ToolFormat>,
}

/// Everything the handlers share.
pub struct AppState {
    pub model: ModelInfo,
    pub supervisor: Supervisor,
    pub metrics: Arc<Metrics>,
    api_key: Option<String>,
    /// Host names answered besides loopback ones, lower-case; `None`: any (a key is required, or the server
    /// was bound to a public address on purpose).
    allowed_hosts: Option<Vec<String>>,
    /// Origins answered CORS (`--cors-origin`).
    cors_origins: Vec<axum::http::HeaderValue>,
    /// Where requests are parsed and tokenized (off the async threads).
    pub cpu: api::CpuGate,
    /// Slots: requests computed at once (`--parallel`).
    pub parallel: usize,
}

/// Shared handler state.
pub type Shared = Arc<AppState>;

/// Resolves `host:port`, refusing a non-loopback address without a key unless `insecure_public`.
///
/// Errors: the address does not resolve; a public address without a key.
pub fn bind_address(host: &str, port: u16, has_key: bool, insecure_public: bool) -> Result<SocketAddr> {
    let addrs: Vec<SocketAddr> = (host, port)
        .to_socket_addrs()
        .with_context(|| format!("cannot resolve --host {host}"))?
        .collect();
    let Some(&addr) = addrs.first() else {
        bail!("--host {host} resolves to no address");
    };
    if !addrs.iter().all(|a| a.ip().is_loopback()) && !has_key && !insecure_public {
        bail!(
            "--host {host} is reachable from other machines, and no API key is set; give --api-key (or \
             ${ENV_API_KEY}), or --insecure-public to serve without one"
        );
    }
    Ok(addr)
}

/// Runs `strata serve` until the process is interrupted.
///
/// Errors: the model's metadata cannot be read; the address is refused or cannot be bound.
pub fn run(args: ServeArgs) -> Result<()> {
    let api_key = args
        .api_key
        .clone()
        .or_else(|| crate::switches::text_lossy(ENV_API_KEY))
        .filter(|k| !k.is_empty());
    let addr = bind_address(&args.host, args.port, api_key.is_some(), args.insecure_public)?;
    // A malformed fault switch is an error now, not a worker that dies at every start.
    crate::device::fault::FaultPlan::from_env()?;
    // Flags a layer split refuses, before the device is opened.
    args.engine.check_split()?;
    // A device the worker cannot open is an error now, not a worker restarted for ever behind a 503.
    let device = &args.engine.device;
    device
        .available()
        .with_context(|| format!("cannot use --device {device}"))?;
    // An events file the worker cannot open is an error now, not a worker restarted for ever.
    if let Some(path) = &args.events {
        worker::open_events_file(path)?;
    }
    let path = crate::models::resolve(Some(&args.engine.model))?;
    // A routing trace the worker would refuse is an error now, not a worker restarted for ever.
    args.engine.check_routing_trace(&path)?;
    let model = ModelInfo::open(&path, args.engine.max_context(), args.tool_format)?;
    let cors_origins = args
        .cors_origins
        .iter()
        .map(|o| {
            // What a browser sends: the scheme and the host in lower case, a port only when not the default.
            let o = o.trim().trim_end_matches('/').to_ascii_lowercase();
            let host = o.strip_prefix("https://").or_else(|| o.strip_prefix("http://"));
            let bad = || anyhow::anyhow!("--cors-origin {o:?}: an origin is a scheme and a host (and a port), such as https://app.example.com, with no path");
            let host = host.filter(|h| !h.is_empty() && !h.contains('/')).ok_or_else(bad)?;
            if (o.starts_with("https://") && host.ends_with(":443")) || (o.starts_with("http://") && host.ends_with(":80")) {
                bail!("--cors-origin {o:?}: a browser leaves the default port out of its Origin; write it without");
            }
            axum::http::HeaderValue::from_str(&o).with_context(|| format!("--cors-origin {o:?}"))
        })
        .collect::<Result<Vec<_>>>()?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    rt.block_on(async move {
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .with_context(|| format!("cannot listen on {addr}"))?;
        let metrics = Arc::new(Metrics::new());
        let mut engine = args.engine.clone();
        // The worker must load the file the front read, even if `default` would resolve differently later.
        engine.model = path.display().to_string();
        // `strata serve` computes DEFAULT_PARALLEL requests at once unless --parallel says otherwise.
        let parallel = *engine.plan.parallel.get_or_insert(DEFAULT_PARALLEL);
        let supervisor = Supervisor::start(
            SupervisorConfig {
                worker: WorkerFlags {
                    engine,
                    events: args.events.clone(),
                },
                max_queue: args.max_queue,
                parallel,
                watchdog: Duration::from_secs(args.watchdog_s.max(1)),
                load_timeout: Duration::from_secs(args.load_timeout_s.unwrap_or_else(|| default_load_timeout_s(&path))),
            },
            metrics.clone(),
        );
        let state = Arc::new(AppState {
            model,
            supervisor,
            metrics,
            allowed_hosts: (api_key.is_none() && addr.ip().is_loopback())
                .then(|| args.allowed_hosts.iter().map(|h| host_name(h).to_ascii_lowercase()).collect()),
            api_key,
            cors_origins,
            cpu: api::CpuGate::new(CPU_JOBS, args.max_queue.max(1) * 2),
            parallel,
        });
        eprintln!(
            "strata serve: listening on http://{} (model {}, context {} tokens, {parallel} slots{})",
            listener.local_addr()?,
            state.model.id,
            state.model.n_ctx,
            if state.api_key.is_some() {
                ", API key required"
            } else {
                ""
            }
        );
        let watched = state.clone();
        let supervisor = state.supervisor.clone();
        let refused = state.metrics.connections_refused.clone();
        let ender = state.supervisor.clone();
        let app = router(state, args.max_body_bytes, Duration::from_secs(args.body_timeout_s));
        let drain = Duration::from_secs(args.drain_s);
        listen::serve(
            listener,
            app,
            listen::connection_limit(),
            drain,
            async move {
                let why = tokio::select! {
                    _ = tokio::signal::ctrl_c() => "interrupted (Ctrl-C)",
                    _ = terminated() => "terminated (SIGTERM)",
                    _ = watched.supervisor.given_up() => return,
                };
                eprintln!(
                    "strata serve: {why}: no new connections; finishing the answers in flight, at most {} s (--drain-s; interrupt again to stop now)",
                    drain.as_secs()
                );
            },
            async {
                tokio::select! {
                    _ = tokio::signal::ctrl_c() => {}
                    _ = terminated() => {}
                }
                eprintln!("strata serve: interrupted again: ending the answers in flight now");
            },
            move || ender.end_all(),
            move || refused.inc(),
        )
        .await;
        match supervisor.state().gave_up {
            Some(why) => anyhow::bail!("{why}; its error is above"),
            None => Ok(()),
        }
    })
}

/// `--load-timeout-s`'s default for the model at `path`: 120 s, plus 20 s a GiB of its file (a 17 GB model: 7.5
/// minutes; reading it from a slow disk and copying its experts into the arena fit in that).
fn default_load_timeout_s(path: &std::path::Path) -> u64 {
    let gib = std::fs::metadata(path).map_or(0, |m| m.len()) as f64 / (1u64 << 30) as f64;
    120 + (20.0 * gib).ceil() as u64
}

/// Requests parsed and tokenized at once, on the blocking pool ([`api::CpuGate`]).
const CPU_JOBS: usize = 2;

/// Resolves when the process gets SIGTERM (what systemd, docker and Kubernetes send); never elsewhere.
async fn terminated() {
    #[cfg(unix)]
    {
        if let Ok(mut s) = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            s.recv().await;
            return;
        }
    }
    std::future::pending::<()>().await
}

/// The routes, with the body limit and deadline, the API-key check and the request counter.
pub fn router(state: Shared, max_body_bytes: usize, body_timeout: Duration) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(openai::chat_completions))
        .route("/v1/completions", post(openai::completions))
        .route("/v1/models", get(openai::models))
        .route("/v1/messages", post(anthropic::messages))
        .route("/v1/messages/count_tokens", post(anthropic::count_tokens))
        .route("/metrics", get(metrics_text))
        .route("/slots", get(slots))
        .route("/props", get(helpers::props))
        .route("/tokenize", post(helpers::tokenize))
        .route("/detokenize", post(helpers::detokenize))
        .route("/apply-template", post(helpers::apply_template))
        .fallback(no_route)
        .method_not_allowed_fallback(wrong_method)
        .layer(middleware::from_fn(move |req: Request, next: Next| {
            read_body_in_time(req, next, max_body_bytes, body_timeout)
        }))
        .layer(middleware::from_fn_with_state(state.clone(), require_key))
        .route("/health", get(health))
        .layer(middleware::from_fn_with_state(state.clone(), guard_browser))
        .layer(middleware::from_fn_with_state(state.clone(), count_requests))
        .layer(DefaultBodyLimit::max(max_body_bytes))
        .layer(cors(&state.cors_origins))
        .with_state(state)
}

/// CORS for `origins` alone (`--cors-origin`): their preflights are answered and their answers carry
/// `Access-Control-Allow-Origin`; with none, no answer carries CORS headers, so a browser keeps other sites'
/// scripts from reading any.
fn cors(origins: &[axum::http::HeaderValue]) -> tower_http::cors::CorsLayer {
    use tower_http::cors::{AllowOrigin, CorsLayer};
    CorsLayer::new()
        .allow_origin(AllowOrigin::list(origins.iter().cloned()))
        .allow_methods([Method::GET, Method::POST])
        .allow_headers([
            header::CONTENT_TYPE,
            header::AUTHORIZATION,
            header::HeaderName::from_static("x-api-key"),
            header::HeaderName::from_static("anthropic-version"),
        ])
}

/// What keeps web pages from using a keyless server (issue 19, point 6): on a loopback address without an API
/// key, a `Host` that is not a loopback name or an `--allowed-host` gets 403 (DNS rebinding); and, without an API
/// key, a POST to the API whose body is not declared `application/json` gets 415 (a cross-site form or
/// `text/plain` fetch needs no CORS preflight, a JSON one does).
async fn guard_browser(State(s): State<Shared>, req: Request, next: Next) -> Response {
    let api = api_of(req.uri());
    if let Some(allowed) = &s.allowed_hosts
        && let Some(host) = req.headers().get(header::HOST)
    {
        let name = host_name(host.to_str().unwrap_or("")).to_ascii_lowercase();
        if !loopback_name(&name) && !allowed.contains(&name) {
            let msg = format!(
                "Host {name:?} is not this server's: without an API key, strata serve on a loopback address answers only loopback names (localhost, 127.0.0.1, [::1]); start it with --allowed-host {name} to answer that name too"
            );
            return ApiError::new(api, ErrorKind::Forbidden, msg).into_response();
        }
    }
    if s.api_key.is_none() && req.method() == Method::POST && req.uri().path().starts_with("/v1/") {
        let ct = req
            .headers()
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("");
        let essence = ct.split(';').next().unwrap_or("").trim().to_ascii_lowercase();
        if essence != "application/json" {
            let msg = format!(
                "the body must be sent as Content-Type: application/json, not {:?} (curl: -H 'Content-Type: application/json')",
                if ct.is_empty() { "none" } else { ct }
            );
            return closing(ApiError::new(api, ErrorKind::UnsupportedMediaType, msg).into_response());
        }
    }
    next.run(req).await
}

/// The host of a `Host` header value: `localhost` of `localhost:8080`, `::1` of `[::1]:8080`.
fn host_name(value: &str) -> &str {
    let v = value.trim();
    if let Some(rest) = v.strip_prefix('[') {
        return rest.split(']').next().unwrap_or("");
    }
    v.rsplit_once(':')
        .filter(|(_, port)| port.chars().all(|c| c.is_ascii_digit()))
        .map_or(v, |(h, _)| h)
}

/// `localhost` (or a name under it), or a loopback IP address.
fn loopback_name(name: &str) -> bool {
    name == "localhost"
        || name.ends_with(".localhost")
        || name.parse::<std::net::IpAddr>().is_ok_and(|ip| ip.is_loopback())
}

/// Reads the whole request body before routing, within `deadline`: a body still incomplete then gets 408 (the
/// connection is closed), one over `limit` bytes 413, both in the shape of the API the path belongs to.
async fn read_body_in_time(req: Request, next: Next, limit: usize, deadline: Duration) -> Response {
    let (parts, body) = req.into_parts();
    let api = api_of(&parts.uri);
    let too_large = || {
        ApiError::new(
            api,
            ErrorKind::TooLarge,
            "the request body is larger than --max-body-bytes",
        )
        .into_response()
    };
    let declared = parts
        .headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
    if declared.is_some_and(|n| n > limit as u64) {
        // Refused before a byte of it is read: the connection cannot be reused.
        return closing(too_large());
    }
    match tokio::time::timeout(deadline, axum::body::to_bytes(body, limit)).await {
        Ok(Ok(bytes)) => {
            next.run(Request::from_parts(parts, axum::body::Body::from(bytes)))
                .await
        }
        Ok(Err(e)) => {
            if std::error::Error::source(&e).is_some_and(|s| s.is::<http_body_util::LengthLimitError>()) {
                // The rest of the body is unread.
                closing(too_large())
            } else {
                ApiError::invalid(api, format!("cannot read the request body: {e}")).into_response()
            }
        }
        Err(_) => {
            let msg = format!(
                "the request body did not arrive within {} s (--body-timeout-s)",
                deadline.as_secs()
            );
            closing(ApiError::new(api, ErrorKind::Timeout, msg).into_response())
        }
    }
}

/// `r` with `Connection: close`: an answer sent before the request's body was read whole (issue 19, point 7).
fn closing(mut r: Response) -> Response {
    r.headers_mut()
        .insert(header::CONNECTION, header::HeaderValue::from_static("close"));
    r
}

/// Whether a request announces a body (a `Content-Length` above 0, or a `Transfer-Encoding`).
fn carries_body(headers: &HeaderMap) -> bool {
    headers.contains_key(header::TRANSFER_ENCODING)
        || headers
            .get(header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok()?.trim().parse::<u64>().ok())
            .is_some_and(|n| n > 0)
}

/// The API a path belongs to, for the shape of its error answers.
fn api_of(uri: &Uri) -> Api {
    if uri.path().starts_with("/v1/messages") {
        Api::Anthropic
    } else {
        Api::OpenAi
    }
}

/// 404 for an unknown path, in the error shape of the API it looks like.
async fn no_route(uri: Uri) -> Response {
    let msg = format!("no such endpoint: {}", uri.path());
    ApiError::new(api_of(&uri), ErrorKind::NotFound, msg).into_response()
}

/// 405 for a known path called with the wrong method.
async fn wrong_method(method: Method, uri: Uri) -> Response {
    let msg = format!("{} does not accept {method}", uri.path());
    ApiError::new(api_of(&uri), ErrorKind::MethodNotAllowed, msg).into_response()
}

async fn health(State(s): State<Shared>) -> Response {
    let w = s.supervisor.state();
    let body = serde_json::json!({
        "status": if w.ready { "ok" } else { "loading" },
        "model": s.model.id,
        "n_ctx": s.model.n_ctx,
        "worker_pid": w.pid,
        "last_worker_death": w.last_death,
    });
    let status = if w.ready {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (status, axum::Json(body)).into_response()
}

/// `GET /slots`: each slot of the engine (`--parallel`): its state (`idle`, `prefill`, `decode`), its request,
/// its KV cache's size and the tokens it holds, and the request's prompt and generated counts (llama-server has
/// the same route). 503 while no loaded worker answers.
async fn slots(State(s): State<Shared>) -> Response {
    match s.supervisor.slots().await {
        Some(slots) => axum::Json(slots).into_response(),
        None => ApiError::new(
            api::Api::OpenAi,
            ErrorKind::EngineDown,
            "the engine is loading or busy; /slots answers once a worker serves",
        )
        .into_response(),
    }
}

async fn metrics_text(State(s): State<Shared>) -> Response {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")],
        s.metrics.render(),
    )
        .into_response()
}

/// The key a request presents: `Authorization: Bearer KEY` or `x-api-key: KEY`.
fn presented_key(headers: &HeaderMap) -> Option<&[u8]> {
    if let Some(v) = headers.get(header::AUTHORIZATION) {
        let v = v.as_bytes();
        if v.len() > 7 && v[..7].eq_ignore_ascii_case(b"bearer ") {
            return Some(&v[7..]);
        }
    }
    headers.get("x-api-key").map(|v| v.as_bytes())
}

/// Whether `presented` equals `key`, compared in constant time (only the length can leak).
pub fn key_matches(presented: &[u8], key: &[u8]) -> bool {
    presented.ct_eq(key).into()
}

async fn require_key(State(s): State<Shared>, req: Request, next: Next) -> Response {
    if let Some(key) = &s.api_key {
        let ok = presented_key(req.headers()).is_some_and(|p| key_matches(p, key.as_bytes()));
        if !ok {
            let api = Api::for_path(req.uri().path());
            let r = ApiError::new(
                api,
                ErrorKind::Authentication,
                "missing or wrong API key: send `Authorization: Bearer KEY` or `x-api-key: KEY`",
            )
            .into_response();
            // Answered without reading the body: a client reusing the connection would send its next request
            // into the rest of this one's body.
            return if carries_body(req.headers()) { closing(r) } else { r };
        }
    }
    next.run(req).await
}

async fn count_requests(State(s): State<Shared>, req: Request, next: Next) -> Response {
    let endpoint = req
        .extensions()
        .get::<MatchedPath>()
        .map_or("other".to_string(), |p| p.as_str().to_string());
    let resp = next.run(req).await;
    s.metrics
        .requests
        .with_label_values(&[endpoint.as_str(), resp.status().as_str()])
        .inc();
    resp
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn public_address_needs_a_key() {
        assert!(bind_address("127.0.0.1", 0, false, false).is_ok());
        assert!(bind_address("0.0.0.0", 0, false, false).is_err());
        assert!(bind_address("0.0.0.0", 0, true, false).is_ok());
        assert!(bind_address("0.0.0.0", 0, false, true).is_ok());
    }

    #[test]
    fn keys_compare() {
        assert!(key_matches(b"secret", b"secret"));
        assert!(!key_matches(b"secreT", b"secret"));
        assert!(!key_matches(b"secret2", b"secret"));
        let mut h = HeaderMap::new();
        h.insert(header::AUTHORIZATION, "Bearer abc".parse().unwrap());
        assert_eq!(presented_key(&h), Some(&b"abc"[..]));
        let mut h = HeaderMap::new();
        h.insert("x-api-key", "xyz".parse().unwrap());
        assert_eq!(presented_key(&h), Some(&b"xyz"[..]));
    }
}
