//! A live `strata serve` on the default model for the serve_* integration tests: started on a free loopback
//! port, waited for until `/health` says ready, killed on drop (its worker exits when its stdin closes).

#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;
use strata_engine::models;

pub struct Server {
    child: Child,
    pub base: String,
    pub client: reqwest::blocking::Client,
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

impl Server {
    /// Starts `strata serve` with `extra` flags and `env`, and waits (up to 120 s) until it is ready.
    pub fn start_with(extra: &[&str], env: &[(&str, &str)]) -> Server {
        Server::start_with_files(extra, env, None)
    }

    /// [`Server::start_with`], the server (and its worker) limited to `files` open files when given.
    pub fn start_with_files(extra: &[&str], env: &[(&str, &str)], files: Option<u64>) -> Server {
        let model = models::require(models::DEFAULT_MODEL_FILE).unwrap_or_else(|e| panic!("{e}"));
        let port = free_port();
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_strata"));
        cmd.args(["serve", "--model"])
            .arg(&model)
            .args(["--port", &port.to_string(), "--threads", "1"])
            .args(extra)
            .env_remove("STRATA_API_KEY")
            .stdin(Stdio::null())
            .stdout(Stdio::null());
        for (k, v) in env {
            cmd.env(k, v);
        }
        if let Some(n) = files {
            use std::os::unix::process::CommandExt;
            // SAFETY: setrlimit is async-signal-safe.
            unsafe {
                cmd.pre_exec(move || {
                    let r = libc::rlimit {
                        rlim_cur: n as libc::rlim_t,
                        rlim_max: n as libc::rlim_t,
                    };
                    if libc::setrlimit(libc::RLIMIT_NOFILE, &r) != 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                    Ok(())
                });
            }
        }
        let child = cmd.spawn().expect("strata serve starts");
        let s = Server {
            child,
            base: format!("http://127.0.0.1:{port}"),
            client: reqwest::blocking::Client::builder()
                .timeout(Duration::from_secs(300))
                .build()
                .unwrap(),
        };
        s.wait_ready(Duration::from_secs(120));
        s
    }

    /// The value of the unlabelled metric `name` in `/metrics`.
    pub fn metric(&self, name: &str) -> f64 {
        let text = self.metrics();
        text.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' '))
            .unwrap_or_else(|| panic!("no {name} in /metrics:\n{text}"))
            .parse()
            .unwrap()
    }

    /// The `strata serve` process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Waits up to `limit` for `strata serve` to exit; its exit status, or `None` if it still runs.
    pub fn wait_exit(&mut self, limit: Duration) -> Option<std::process::ExitStatus> {
        let start = Instant::now();
        loop {
            if let Some(st) = self.child.try_wait().expect("try_wait") {
                return Some(st);
            }
            if start.elapsed() > limit {
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn start() -> Server {
        Server::start_with(&[], &[])
    }

    /// Waits until `/health` answers 200.
    pub fn wait_ready(&self, limit: Duration) {
        let start = Instant::now();
        loop {
            if let Ok(r) = self.client.get(self.url("/health")).send()
                && r.status() == 200
            {
                return;
            }
            assert!(start.elapsed() < limit, "strata serve not ready after {limit:?}");
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    /// POSTs `body` (JSON) and returns (status, parsed body).
    pub fn post(&self, path: &str, body: &Value) -> (u16, Value) {
        let r = self
            .client
            .post(self.url(path))
            .json(body)
            .send()
            .expect("request sent");
        let status = r.status().as_u16();
        let text = r.text().expect("body read");
        (status, serde_json::from_str(&text).unwrap_or(Value::String(text)))
    }

    /// POSTs a streamed chat `body` to `/v1/chat/completions` and opens its stream, which must answer 200.
    pub fn chat_stream(&self, body: &Value) -> SseReader {
        let r = self
            .client
            .post(self.url("/v1/chat/completions"))
            .json(body)
            .send()
            .expect("request sent");
        assert_eq!(r.status(), 200);
        SseReader::new(r)
    }

    /// POSTs raw bytes.
    pub fn post_raw(&self, path: &str, body: Vec<u8>) -> (u16, Value) {
        let r = self
            .client
            .post(self.url(path))
            .header("content-type", "application/json")
            .body(body)
            .send()
            .expect("request sent");
        let status = r.status().as_u16();
        let text = r.text().expect("body read");
        (status, serde_json::from_str(&text).unwrap_or(Value::String(text)))
    }

    pub fn health(&self) -> Value {
        self.client.get(self.url("/health")).send().unwrap().json().unwrap()
    }

    pub fn metrics(&self) -> String {
        self.client.get(self.url("/metrics")).send().unwrap().text().unwrap()
    }

    /// The engine worker's pid, from `/health`.
    pub fn worker_pid(&self) -> u32 {
        self.health()["worker_pid"].as_u64().expect("a worker pid") as u32
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// An open SSE stream, read event by event.
pub struct SseReader {
    lines: BufReader<reqwest::blocking::Response>,
}

/// One SSE event: its `event:` name (empty when absent) and `data:` payload.
#[derive(Debug, Clone)]
pub struct SseEvent {
    pub event: String,
    pub data: String,
}

impl SseReader {
    pub fn new(r: reqwest::blocking::Response) -> SseReader {
        SseReader {
            lines: BufReader::new(r),
        }
    }

    /// The next event (comments skipped), or `None` at the end of the stream.
    pub fn next_event(&mut self) -> Option<SseEvent> {
        let mut ev = SseEvent {
            event: String::new(),
            data: String::new(),
        };
        let mut any = false;
        loop {
            let mut line = String::new();
            match self.lines.read_line(&mut line) {
                Ok(0) | Err(_) => return any.then_some(ev),
                Ok(_) => {}
            }
            let line = line.trim_end_matches(['\r', '\n']);
            if line.is_empty() {
                if any {
                    return Some(ev);
                }
                continue;
            }
            if line.starts_with(':') {
                continue;
            }
            any = true;
            if let Some(v) = line.strip_prefix("event:") {
                ev.event = v.trim().to_string();
            } else if let Some(v) = line.strip_prefix("data:") {
                ev.data.push_str(v.trim_start());
            }
        }
    }

    pub fn rest(&mut self) -> Vec<SseEvent> {
        std::iter::from_fn(|| self.next_event()).collect()
    }
}

/// Sends `kill -SIG pid`.
pub fn signal(pid: u32, sig: &str) {
    let ok = Command::new("kill")
        .args([&format!("-{sig}"), &pid.to_string()])
        .status()
        .expect("kill runs")
        .success();
    assert!(ok, "kill -{sig} {pid} failed");
}
