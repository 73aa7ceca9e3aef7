//! Runs `strata serve` for one arm: finds or builds the binary, starts it on a free port with the arm's args and
//! env, waits for /health, speaks its HTTP API, and stops it.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use serde_json::{Value, json};

use crate::scenario::ServerKind;

/// Locates the `strata` binary: `explicit`, else the one beside this executable (same target dir and profile).
/// When it is missing and this build's source tree is still there, builds it with cargo in the same profile.
///
/// Errors: no binary and the build failed (the caller exits 125, git bisect's skip).
pub fn strata_binary(explicit: Option<&Path>) -> Result<PathBuf> {
    if let Some(p) = explicit {
        if p.is_file() {
            return Ok(p.to_path_buf());
        }
        bail!("--strata {}: no such file", p.display());
    }
    let exe = std::env::current_exe().context("cannot locate the harness executable")?;
    let dir = exe.parent().context("the harness executable has no folder")?;
    // Test binaries live in target/<profile>/deps; the binaries one level up.
    let dirs = [
        dir.to_path_buf(),
        dir.parent().map(Path::to_path_buf).unwrap_or_default(),
    ];
    for d in &dirs {
        let cand = d.join(format!("strata{}", std::env::consts::EXE_SUFFIX));
        if cand.is_file() {
            return Ok(cand);
        }
    }
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    if !root.join("Cargo.toml").is_file() {
        bail!(
            "no `strata` binary beside {} and no source tree to build it from; give --strata PATH",
            exe.display()
        );
    }
    let release = dirs.iter().any(|d| d.ends_with("release"));
    eprintln!(
        "strata-harness: building `strata` ({} profile), it is missing beside {}",
        if release { "release" } else { "dev" },
        exe.display()
    );
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let mut cmd = Command::new(cargo);
    cmd.current_dir(&root)
        .args(["build", "-p", "strata-engine", "--bin", "strata"]);
    if release {
        cmd.arg("--release");
    }
    let status = cmd.status().context("cannot run cargo to build `strata`")?;
    if !status.success() {
        bail!("building `strata` failed ({status})");
    }
    for d in &dirs {
        let cand = d.join(format!("strata{}", std::env::consts::EXE_SUFFIX));
        if cand.is_file() {
            return Ok(cand);
        }
    }
    bail!("cargo built `strata` but it is not beside {}", exe.display())
}

/// llama.cpp's `llama-server` for the combinations that start one: `given` (`--llama-server`), else the build of
/// `fixtures/llamacpp/build.sh server` in the model cache.
///
/// Errors: `given` is not a file, or there is no build in the cache (the message says how to make one).
pub fn llama_server_binary(given: Option<&Path>) -> Result<PathBuf> {
    if let Some(p) = given {
        let why = match std::fs::metadata(p) {
            Err(e) => Some(e.to_string()),
            Ok(m) if !m.is_file() => Some("not a file".to_string()),
            #[cfg(unix)]
            Ok(m) if std::os::unix::fs::PermissionsExt::mode(&m.permissions()) & 0o111 == 0 => {
                Some("not executable".to_string())
            }
            Ok(_) => None,
        };
        if let Some(why) = why {
            bail!("--llama-server {}: {why}", p.display());
        }
        return Ok(p.to_path_buf());
    }
    let p = strata_engine::models::llama_cpp_bin("llama-server");
    if !p.is_file() {
        bail!(
            "llama-server is not built ({} is missing): run `fixtures/llamacpp/build.sh server`, or pass --llama-server PATH",
            p.display()
        );
    }
    Ok(p)
}

/// A running server: `strata serve`, or llama.cpp's `llama-server` beside it.
pub struct Server {
    child: Child,
    /// `http://127.0.0.1:PORT`.
    pub base: String,
    http: reqwest::blocking::Client,
    /// The context in tokens a request may use (`/health`'s `n_ctx`; 0 from an engine that does not say).
    pub n_ctx: usize,
    kind: ServerKind,
}

/// One HTTP answer: status and JSON body (`Value::Null` when the body is not JSON).
#[derive(Debug, Clone)]
pub struct Answer {
    pub status: u16,
    pub body: Value,
}

/// The `STRATA_*` switches of the harness's own environment that a server is started without: every one but
/// the folders where things are found (models, compiled kernels, CUDA's libraries, device profiles). A run
/// depends on its scenario file alone (its `env` sets switches): a speed switch or a fault rule left set in a
/// shell cannot change every arm at once unseen.
pub fn inherited_switches() -> Vec<String> {
    use strata_engine::switches as sw;
    let keep = [sw::MODELS_DIR, sw::KERNEL_CACHE, sw::CUDA_LIB_DIR, sw::DEVICE_PROFILES];
    std::env::vars_os()
        .filter_map(|(k, _)| k.into_string().ok())
        .filter(|k| k.starts_with("STRATA_") && !keep.contains(&k.as_str()))
        .collect()
}

fn free_port() -> Result<u16> {
    let l = TcpListener::bind("127.0.0.1:0").context("cannot find a free local port")?;
    Ok(l.local_addr()?.port())
}

impl Server {
    /// Starts `program` as a server of `kind` (`strata serve`, or llama.cpp's `llama-server`) on a free local
    /// port with `args` and `env` (and none of [`inherited_switches`]), its output (the human log) appended to
    /// `log`, and waits up to `timeout` for /health to answer 200 (both servers answer 503 while they load).
    ///
    /// Errors: the process cannot start, exits, or never becomes healthy.
    pub fn start(
        kind: ServerKind,
        program: &Path,
        args: &[String],
        env: &[(String, String)],
        log: &Path,
        timeout: Duration,
    ) -> Result<Server> {
        let port = free_port()?;
        let log_file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(log)
            .with_context(|| format!("cannot open {}", log.display()))?;
        let mut cmd = Command::new(program);
        for name in inherited_switches() {
            cmd.env_remove(name);
        }
        // The server dies with the harness, whatever kills it (SIGINT, SIGTERM, an abort): no orphan keeps a port,
        // a GPU or its memory.
        #[cfg(unix)]
        {
            use std::os::unix::process::CommandExt;
            // SAFETY: the hook calls only async-signal-safe functions (orphan::die_with_parent).
            unsafe {
                cmd.pre_exec(strata_engine::serve::orphan::die_with_parent());
            }
        }
        if kind == ServerKind::Strata {
            cmd.arg("serve");
        }
        cmd.args(["--host", "127.0.0.1", "--port", &port.to_string()])
            .args(args)
            .envs(env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(log_file.try_clone()?)
            .stderr(log_file);
        let child = cmd
            .spawn()
            .with_context(|| format!("cannot start {}", program.display()))?;
        let http = reqwest::blocking::Client::builder()
            .timeout(Duration::from_secs(900))
            .build()
            .context("cannot build the HTTP client")?;
        let mut server = Server {
            child,
            base: format!("http://127.0.0.1:{port}"),
            http,
            n_ctx: 0,
            kind,
        };
        server.wait_healthy(timeout)?;
        Ok(server)
    }

    /// Waits for /health to answer 200 (a worker loaded and ready).
    ///
    /// Errors: the server process exited, or `timeout` passed.
    pub fn wait_healthy(&mut self, timeout: Duration) -> Result<()> {
        let start = Instant::now();
        loop {
            if let Some(status) = self.child.try_wait()? {
                bail!(
                    "{} exited ({status}) before it became healthy; see its log",
                    self.kind.program()
                );
            }
            if let Ok(r) = self.http.get(format!("{}/health", self.base)).send()
                && r.status().as_u16() == 200
            {
                let body: Value = r.json().unwrap_or(Value::Null);
                self.n_ctx = body["n_ctx"].as_u64().unwrap_or(0) as usize;
                return Ok(());
            }
            if start.elapsed() > timeout {
                bail!("{} was not healthy after {} s", self.kind.program(), timeout.as_secs());
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// The server's process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The worker's process id from /health, when one is up (llama-server computes in its own process: its id).
    pub fn worker_pid(&self) -> Option<u32> {
        if self.kind == ServerKind::LlamaServer {
            return Some(self.pid());
        }
        let r = self.get_json("/health").ok()?;
        r.body["worker_pid"].as_u64().map(|p| p as u32)
    }

    fn get_json(&self, path: &str) -> Result<Answer> {
        let r = self.http.get(format!("{}{path}", self.base)).send()?;
        let status = r.status().as_u16();
        Ok(Answer {
            status,
            body: r.json().unwrap_or(Value::Null),
        })
    }

    /// `GET /metrics` as text.
    ///
    /// Errors: the request failed.
    pub fn metrics(&self) -> Result<String> {
        Ok(self.http.get(format!("{}/metrics", self.base)).send()?.text()?)
    }

    /// `strata_worker_restarts_total` from /metrics.
    ///
    /// Errors: the request failed or the counter is missing.
    pub fn restarts(&self) -> Result<u64> {
        metric_value(&self.metrics()?, "strata_worker_restarts_total").context("no strata_worker_restarts_total")
    }

    /// POSTs `body` to `path`.
    ///
    /// Errors: no HTTP answer at all (connection refused, timeout).
    pub fn post(&self, path: &str, body: &Value) -> Result<Answer> {
        let r = self.http.post(format!("{}{path}", self.base)).json(body).send()?;
        let status = r.status().as_u16();
        Ok(Answer {
            status,
            body: r.json().unwrap_or(Value::Null),
        })
    }

    /// The prompt tokens the server counts for a chat (`POST /v1/messages/count_tokens`; the template applied).
    ///
    /// Errors: the request failed or was refused.
    pub fn count_chat_tokens(&self, messages: &[crate::scenario::Message]) -> Result<usize> {
        let system: Vec<&str> = messages
            .iter()
            .filter(|m| m.role == "system")
            .map(|m| m.content.as_str())
            .collect();
        let rest: Vec<Value> = messages
            .iter()
            .filter(|m| m.role != "system")
            .map(|m| json!({"role": m.role, "content": m.content}))
            .collect();
        let mut body = json!({ "messages": rest });
        if !system.is_empty() {
            body["system"] = json!(system.join("\n"));
        }
        let a = self.post("/v1/messages/count_tokens", &body)?;
        match (a.status, a.body["input_tokens"].as_u64()) {
            (200, Some(n)) => Ok(n as usize),
            (s, _) => bail!("count_tokens answered {s}: {}", a.body),
        }
    }

    /// Stops the server (SIGKILL; its worker dies with it as its stdin closes).
    pub fn stop(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The value of an unlabelled metric in Prometheus text, summed over label sets if it has some.
pub fn metric_value(text: &str, name: &str) -> Option<u64> {
    let mut found = None;
    for line in text.lines().filter(|l| !l.starts_with('#')) {
        let Some(rest) = line.strip_prefix(name) else { continue };
        if !(rest.starts_with(' ') || rest.starts_with('{')) {
            continue;
        }
        let v = rest.rsplit(' ').next()?.parse::<f64>().ok()?;
        found = Some(found.unwrap_or(0) + v as u64);
    }
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metric_values_sum_label_sets() {
        let t = "# HELP x\nstrata_worker_restarts_total 2\nstrata_worker_restarts_totalx 9\n\
                 strata_requests_total{endpoint=\"/a\",status=\"200\"} 3\nstrata_requests_total{endpoint=\"/b\",status=\"503\"} 4\n";
        assert_eq!(metric_value(t, "strata_worker_restarts_total"), Some(2));
        assert_eq!(metric_value(t, "strata_requests_total"), Some(7));
        assert_eq!(metric_value(t, "missing"), None);
    }
}
