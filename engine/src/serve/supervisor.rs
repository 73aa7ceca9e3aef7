//! The supervisor: owns the engine worker process, feeds it up to `--parallel` requests at a time in arrival order
//! from a bounded queue (the worker batches them), relays each one's output to its handler, and restarts the
//! worker when it dies or goes silent.
//!
//! Failure contract (DESIGN.md section 3, seed 000): when the worker dies, every request in flight and every
//! request queued at that moment end with [`JobEvent::Failed`] carrying one message, for example
//! `the engine stopped unexpectedly (exit code 1); the next request restarts it`; the cause is logged and
//! counted, and a new worker is started at once. Requests that arrive afterwards wait for it.

use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::process::{Child, ChildStdin};
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;

use super::WorkerFlags;
use super::metrics::Metrics;
use super::protocol::{Command, Finish, GenerateJob, Message, Timings};
use crate::runtime::grammar::GrammarSpec;
use crate::runtime::sampling::{SamplingParams, TokenLogprob};

/// What a request asks of the engine (the front has rendered and tokenized the prompt).
#[derive(Debug, Clone)]
pub struct EngineRequest {
    pub prompt: Vec<u32>,
    pub max_tokens: usize,
    pub stop: Vec<String>,
    pub sampling: SamplingParams,
    /// Log-probabilities of each token and this many alternatives ([`GenerateJob::logprobs`]).
    pub logprobs: Option<usize>,
    /// The grammar the answer must follow ([`GenerateJob::grammar`]).
    pub grammar: Option<GrammarSpec>,
}

/// What a handler receives for its request, in order: `Text`*, then one `Done` or `Failed`.
#[derive(Debug, Clone)]
pub enum JobEvent {
    /// Generated text, with the log-probabilities of its tokens when the request asked for them.
    Text { text: String, logprobs: Vec<TokenLogprob> },
    Done {
        stop: Finish,
        /// The stop string that ended the generation, when one did.
        stop_word: Option<String>,
        timings: Timings,
    },
    /// The request failed; `status` is the HTTP status to answer (503 when the engine died, 400 when the worker
    /// refused the request itself).
    Failed { status: u16, message: String },
}

/// Why a request could not be queued.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SubmitError {
    /// `--max-queue` requests are already waiting.
    QueueFull { max_queue: usize },
}

/// The worker's state as `/health` reports it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct WorkerState {
    pub ready: bool,
    /// The worker's process id while one runs.
    pub pid: Option<u32>,
    /// Why the last worker stopped, if one did.
    pub last_death: Option<String>,
    /// Set when the first worker could not load the model: the supervisor has stopped, and `strata serve` exits
    /// with this cause (as llama-server does when its model fails to load), instead of restarting a worker that
    /// fails the same way for ever behind a 503.
    pub gave_up: Option<String>,
}

struct Job {
    request: EngineRequest,
    events: mpsc::UnboundedSender<JobEvent>,
    /// Its place in `--max-queue`, given back when the job is taken off the queue or dropped.
    ticket: QueueTicket,
}

/// A queued job's [`QueuePlace`] and the task that gives it back when the client leaves first; dropping the
/// ticket (the supervisor took the job, or the job was dropped unserved) stops the task, which holds a clone of
/// the job's event sender, and gives the place back.
struct QueueTicket {
    place: Arc<QueuePlace>,
    watcher: tokio::task::AbortHandle,
}

impl Drop for QueueTicket {
    fn drop(&mut self) {
        self.watcher.abort();
        self.place.give_back();
    }
}

/// How many times `--max-queue` entries the job channel holds: entries whose clients left while waiting give
/// their places back at once but stay in the channel until the supervisor reaches them, so live requests find
/// room behind them, and the channel (so the memory of waiting prompts) stays bounded.
const QUEUE_SLACK: usize = 8;

/// A waiting request's place in `--max-queue` (and in `strata_queue_depth`), given back once: when the supervisor
/// takes the job, or when its client goes away first (a client that gives up while queued frees its place at
/// once, not when a slot frees).
struct QueuePlace {
    live: Arc<std::sync::atomic::AtomicUsize>,
    held: std::sync::atomic::AtomicBool,
    metrics: Arc<Metrics>,
}

impl QueuePlace {
    fn give_back(&self) {
        if self.held.swap(false, std::sync::atomic::Ordering::AcqRel) {
            self.live.fetch_sub(1, std::sync::atomic::Ordering::AcqRel);
            self.metrics.queue_depth.dec();
        }
    }
}

/// The handlers' side of the supervisor: cheap to clone.
#[derive(Clone)]
pub struct Supervisor {
    jobs: mpsc::Sender<Job>,
    state: watch::Receiver<WorkerState>,
    metrics: Arc<Metrics>,
    max_queue: usize,
    /// Requests waiting whose clients are still there (at most `max_queue`).
    live: Arc<std::sync::atomic::AtomicUsize>,
    /// Set by [`Supervisor::end_all`].
    ending: Arc<watch::Sender<bool>>,
    /// `GET /slots` queries for the worker.
    queries: mpsc::UnboundedSender<SlotsQuery>,
}

/// Where the worker's answer to a slots query goes.
type SlotsQuery = tokio::sync::oneshot::Sender<Vec<crate::runtime::batch::SlotState>>;

/// Settings of the supervision loop.
#[derive(Debug, Clone)]
pub struct SupervisorConfig {
    /// The flags passed to `strata worker`.
    pub worker: WorkerFlags,
    /// Requests allowed to wait for a slot.
    pub max_queue: usize,
    /// Requests the worker computes at once (its slots, `--parallel`).
    pub parallel: usize,
    /// A worker silent this long while a request is in flight is killed.
    pub watchdog: Duration,
    /// A worker that has not loaded the model this long after it started is killed and restarted.
    pub load_timeout: Duration,
}

/// How a worker's load ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Load {
    Ready,
    /// It exited (or closed its stdout) first.
    Exited,
    /// `load_timeout` passed first.
    TimedOut,
}

impl Supervisor {
    /// Starts the supervision task (it spawns the first worker at once) on the current tokio runtime.
    pub fn start(config: SupervisorConfig, metrics: Arc<Metrics>) -> Supervisor {
        let max_queue = config.max_queue.max(1);
        let (jobs_tx, jobs_rx) = mpsc::channel(max_queue.saturating_mul(QUEUE_SLACK));
        let (state_tx, state_rx) = watch::channel(WorkerState::default());
        let (ending, ending_rx) = watch::channel(false);
        let (queries, queries_rx) = mpsc::unbounded_channel();
        tokio::spawn(supervise(
            config,
            jobs_rx,
            state_tx,
            metrics.clone(),
            ending_rx,
            queries_rx,
        ));
        Supervisor {
            jobs: jobs_tx,
            state: state_rx,
            metrics,
            max_queue,
            live: Arc::default(),
            ending: Arc::new(ending),
            queries,
        }
    }

    /// Every slot of the worker, as it stands between two steps (`GET /slots`); `None` when no loaded worker answers within
    /// 5 s (it is loading, restarting, or stuck in a step longer than that).
    pub async fn slots(&self) -> Option<Vec<crate::runtime::batch::SlotState>> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        self.queries.send(tx).ok()?;
        tokio::time::timeout(Duration::from_secs(5), rx).await.ok()?.ok()
    }

    /// Ends every request now, at a shutdown's drain deadline: the running one is cancelled on the worker and
    /// its handler gets [`JobEvent::Failed`] (503, [`ENDING`]: a stream that answered 200 ends with an error event,
    /// not cut), and so does every queued one.
    pub fn end_all(&self) {
        let _ = self.ending.send(true);
    }

    /// Queues a request; its events arrive on the returned receiver. Dropping the receiver cancels the request
    /// (the worker stops within one token; while it waits in the queue, it gives its place back at once). Call
    /// on the tokio runtime.
    ///
    /// Errors: [`SubmitError::QueueFull`]: `--max-queue` requests wait already (or the channel holds
    /// [`QUEUE_SLACK`] times that, most of them left by their clients).
    pub fn submit(&self, request: EngineRequest) -> Result<mpsc::UnboundedReceiver<JobEvent>, SubmitError> {
        use std::sync::atomic::Ordering;
        let full = SubmitError::QueueFull {
            max_queue: self.max_queue,
        };
        if self
            .live
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < self.max_queue).then_some(n + 1)
            })
            .is_err()
        {
            return Err(full);
        }
        self.metrics.queue_depth.inc();
        let place = Arc::new(QueuePlace {
            live: self.live.clone(),
            held: true.into(),
            metrics: self.metrics.clone(),
        });
        let (tx, rx) = mpsc::unbounded_channel();
        let watcher = {
            let (events, place) = (tx.clone(), place.clone());
            tokio::spawn(async move {
                events.closed().await;
                place.give_back();
            })
            .abort_handle()
        };
        let ticket = QueueTicket { place, watcher };
        match self.jobs.try_send(Job {
            request,
            events: tx,
            ticket,
        }) {
            Ok(()) => Ok(rx),
            Err(_) => Err(full), // the job, and so its ticket, dropped: the place is given back
        }
    }

    /// Requests allowed to wait for a slot (`--max-queue`, at least 1).
    pub fn max_queue(&self) -> usize {
        self.max_queue
    }

    /// The worker's current state.
    pub fn state(&self) -> WorkerState {
        self.state.borrow().clone()
    }

    /// Waits until the supervisor gives up (the first worker could not load: [`WorkerState::gave_up`]) and
    /// returns why; never returns while a worker can load.
    pub async fn given_up(&self) -> String {
        let mut rx = self.state.clone();
        loop {
            if let Some(why) = rx.borrow_and_update().gave_up.clone() {
                return why;
            }
            if rx.changed().await.is_err() {
                return std::future::pending().await;
            }
        }
    }
}

/// A running worker: its process, its stdin, and its parsed stdout lines.
struct Worker {
    child: Child,
    stdin: ChildStdin,
    lines: mpsc::UnboundedReceiver<Message>,
    pid: Option<u32>,
    /// The last `fault` event's fields, for the death report.
    last_fault: Option<String>,
}

fn spawn_worker(flags: &WorkerFlags) -> std::io::Result<Worker> {
    let exe = std::env::current_exe()?;
    let mut cmd = tokio::process::Command::new(exe);
    cmd.arg("worker").args(flags.to_args());
    cmd.stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    cmd.kill_on_drop(true);
    // SAFETY: the hook calls only async-signal-safe functions (orphan::die_with_parent). It is spawned from a
    // runtime worker thread, which lives as long as the server.
    #[cfg(unix)]
    unsafe {
        cmd.pre_exec(super::orphan::die_with_parent());
    }
    let mut child = cmd.spawn()?;
    let stdin = child.stdin.take().expect("piped stdin");
    let stdout = child.stdout.take().expect("piped stdout");
    let (tx, rx) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        let mut lines = BufReader::new(stdout).lines();
        while let Ok(Some(line)) = lines.next_line().await {
            match serde_json::from_str::<Message>(&line) {
                Ok(m) => {
                    if tx.send(m).is_err() {
                        break;
                    }
                }
                Err(e) => eprintln!("strata serve: ignoring a worker line that is not protocol ({e}): {line}"),
            }
        }
    });
    Ok(Worker {
        pid: child.id(),
        child,
        stdin,
        lines: rx,
        last_fault: None,
    })
}

/// Describes how a worker ended: `exit code N`, `killed by signal N`, or why it was stopped.
fn exit_cause(status: Option<std::process::ExitStatus>) -> (String, String) {
    use std::os::unix::process::ExitStatusExt;
    match status {
        Some(s) => match (s.code(), s.signal()) {
            (Some(c), _) => (format!("exit code {c}"), format!("exit_code_{c}")),
            (None, Some(sig)) => (format!("killed by signal {sig}"), format!("signal_{sig}")),
            _ => ("exit status unknown".into(), "unknown".into()),
        },
        None => ("exit status unknown".into(), "unknown".into()),
    }
}

/// Stops the worker (if it still runs), reaps it and returns (message, metric label).
async fn bury(w: &mut Worker, killed: Option<(String, &str)>) -> (String, String, Option<String>) {
    let (text, label) = if let Some((why, label)) = killed {
        let _ = w.child.start_kill();
        let _ = w.child.wait().await;
        (why, label.to_string())
    } else {
        // Give the process a moment to be reaped after closing its stdout, then make sure it is gone.
        let status = match tokio::time::timeout(Duration::from_secs(5), w.child.wait()).await {
            Ok(Ok(s)) => Some(s),
            _ => {
                let _ = w.child.start_kill();
                w.child.wait().await.ok()
            }
        };
        exit_cause(status)
    };
    // A fault event written just before the exit may still be in the pipe.
    while let Ok(m) = w.lines.try_recv() {
        if let Message::Event(e) = m {
            note_event(w, &e, None);
        }
    }
    (text, label, w.last_fault.take())
}

fn death_message(cause: &str) -> String {
    format!("the engine stopped unexpectedly ({cause}); the next request restarts it")
}

/// The message of a request [`Supervisor::end_all`] ended.
pub const ENDING: &str = "the server is shutting down: this answer was cut at its drain deadline (--drain-s)";

async fn supervise(
    config: SupervisorConfig,
    mut jobs: mpsc::Receiver<Job>,
    state: watch::Sender<WorkerState>,
    metrics: Arc<Metrics>,
    ending: watch::Receiver<bool>,
    mut queries: mpsc::UnboundedReceiver<SlotsQuery>,
) {
    let mut next_id: u64 = 0;
    let mut backoff = Duration::from_millis(250);
    // Whether a worker has loaded in this server's life: until one has, a load failure is the flags' or the
    // machine's, not a crash, and restarting would fail the same way.
    let mut ever_ready = false;
    loop {
        // Start a worker and wait for it to load.
        state.send_modify(|s| {
            s.ready = false;
            s.pid = None;
        });
        metrics.worker_ready.set(0);
        let mut worker = match spawn_worker(&config.worker) {
            Ok(w) => w,
            Err(e) => {
                eprintln!("strata serve: cannot start the engine worker: {e}");
                fail_queued(&mut jobs, &format!("the engine cannot start ({e})"));
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(30));
                continue;
            }
        };
        state.send_modify(|s| s.pid = worker.pid);
        let load_deadline = Instant::now() + config.load_timeout;
        let ready = loop {
            tokio::select! {
                msg = worker.lines.recv() => match msg {
                    Some(Message::Ready { .. }) => break Load::Ready,
                    Some(Message::Event(e)) => note_event(&mut worker, &e, Some(&metrics)),
                    Some(Message::Kv(u)) => metrics.record_kv(&u),
                    Some(_) => {}
                    None => break Load::Exited,
                },
                _ = tokio::time::sleep_until(load_deadline) => break Load::TimedOut,
            }
        };
        if ready == Load::TimedOut {
            // A hung load is a dead worker: its cause in /health and the log, 503 to the waiting, a restart.
            let why = format!(
                "did not load within {} s, stopped (--load-timeout-s)",
                config.load_timeout.as_secs()
            );
            eprintln!("strata serve: the engine worker {why}");
            let (cause, label, fault) = bury(&mut worker, Some((why, "load_timeout"))).await;
            report_death(&metrics, &state, &cause, &label, fault.as_deref(), "while loading");
            fail_queued(&mut jobs, &death_message(&cause));
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(Duration::from_secs(30));
            continue;
        }
        if ready == Load::Exited {
            let (cause, label, fault) = bury(&mut worker, None).await;
            if !ever_ready {
                let why = format!("the engine worker could not load the model ({cause})");
                fail_queued(&mut jobs, &why);
                state.send_modify(|s| {
                    s.last_death = Some(cause.clone());
                    s.gave_up = Some(why);
                });
                return;
            }
            report_death(&metrics, &state, &cause, &label, fault.as_deref(), "while loading");
            fail_queued(&mut jobs, &death_message(&cause));
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(Duration::from_secs(30));
            continue;
        }
        backoff = Duration::from_millis(250);
        ever_ready = true;
        state.send_modify(|s| s.ready = true);
        metrics.worker_ready.set(1);

        // Serve jobs until the worker dies.
        // Queries sent while no worker was serving were not answered in time; their handlers are gone.
        while queries.try_recv().is_ok() {}
        let death = serve(
            &mut worker,
            &config,
            &mut jobs,
            &metrics,
            &mut next_id,
            ending.clone(),
            &mut queries,
        )
        .await;
        let death = match death {
            Ok(()) => return,
            Err(d) => d,
        };
        let (cause, label, fault) = death;
        report_death(&metrics, &state, &cause, &label, fault.as_deref(), "");
        fail_queued(&mut jobs, &death_message(&cause));
    }
}

/// Keeps the worker's last `fault` (its human line), to report with its death, and counts what the expert cache
/// did and each request's batch size into the metrics.
fn note_event(worker: &mut Worker, e: &super::protocol::Event, metrics: Option<&Metrics>) {
    match &e.kind {
        crate::events::EventKind::Fault(f) => worker.last_fault = Some(f.to_string()),
        crate::events::EventKind::ExpertCache(c) => {
            if let Some(m) = metrics {
                m.record_expert_cache(c);
            }
        }
        crate::events::EventKind::Request(r) => {
            if let Some(m) = metrics {
                m.batch_size.observe(r.batch_mean);
                m.kv_preemptions.inc_by(r.preempted.into());
            }
        }
        _ => {}
    }
}

fn report_death(
    metrics: &Metrics,
    state: &watch::Sender<WorkerState>,
    cause: &str,
    label: &str,
    fault: Option<&str>,
    when: &str,
) {
    let fault_text = fault.map(|f| format!("; last fault {f}")).unwrap_or_default();
    let when = if when.is_empty() {
        String::new()
    } else {
        format!(" {when}")
    };
    eprintln!("strata serve: the engine worker stopped{when} ({cause}){fault_text}; restarting it");
    metrics.worker_restarts.inc();
    metrics.worker_deaths.with_label_values(&[label]).inc();
    if fault.is_some() {
        metrics.worker_faults.inc();
    }
    state.send_modify(|s| {
        s.ready = false;
        s.pid = None;
        s.last_death = Some(format!("{cause}{fault_text}"));
    });
}

/// Ends every request waiting in the queue with a 503 carrying `message`.
fn fail_queued(jobs: &mut mpsc::Receiver<Job>, message: &str) {
    while let Ok(job) = jobs.try_recv() {
        drop(job.ticket);
        let _ = job.events.send(JobEvent::Failed {
            status: 503,
            message: message.to_string(),
        });
    }
}

async fn write_command(stdin: &mut ChildStdin, cmd: &Command) -> std::io::Result<()> {
    let mut line = serde_json::to_string(cmd).expect("commands serialize");
    line.push('\n');
    stdin.write_all(line.as_bytes()).await?;
    stdin.flush().await
}

/// A request on the worker: where its events go, and whether its cancel was sent.
struct InFlight {
    events: mpsc::UnboundedSender<JobEvent>,
    cancelled: bool,
    /// The task that says when the handler went away.
    watcher: tokio::task::AbortHandle,
}

/// Feeds the worker jobs, up to `config.parallel` in flight, and relays their messages until the worker dies
/// (`Err`: its cause, label and last fault, every request in flight already answered) or the queue closes (`Ok`).
/// A handler that goes away gets its request cancelled on the worker; at a shutdown's drain deadline
/// ([`Supervisor::end_all`]) every request in flight ends with [`ENDING`].
async fn serve(
    worker: &mut Worker,
    config: &SupervisorConfig,
    jobs: &mut mpsc::Receiver<Job>,
    metrics: &Metrics,
    next_id: &mut u64,
    mut ending: watch::Receiver<bool>,
    queries: &mut mpsc::UnboundedReceiver<SlotsQuery>,
) -> Result<(), (String, String, Option<String>)> {
    let mut inflight: std::collections::HashMap<u64, InFlight> = std::collections::HashMap::new();
    let mut asked: std::collections::HashMap<u64, SlotsQuery> = std::collections::HashMap::new();
    let mut next_query: u64 = 0;
    let (gone_tx, mut gone) = mpsc::unbounded_channel::<u64>();
    let mut deadline = Instant::now() + config.watchdog;
    let mut ended = false;
    let parallel = config.parallel.max(1);
    let end = |inflight: &mut std::collections::HashMap<u64, InFlight>, status: u16, message: &str| {
        for (_, f) in inflight.drain() {
            f.watcher.abort();
            let _ = f.events.send(JobEvent::Failed {
                status,
                message: message.to_string(),
            });
        }
        metrics.clear_worker_state();
    };
    let outcome = loop {
        tokio::select! {
            job = jobs.recv(), if inflight.len() < parallel => {
                let Some(job) = job else { break Ok(()) };
                drop(job.ticket);
                if job.events.is_closed() {
                    continue;
                }
                if ended {
                    let _ = job.events.send(JobEvent::Failed { status: 503, message: ENDING.into() });
                    continue;
                }
                *next_id += 1;
                let id = *next_id;
                let r = job.request;
                let cmd = Command::Generate(GenerateJob {
                    id,
                    prompt: r.prompt,
                    max_tokens: r.max_tokens,
                    stop: r.stop,
                    sampling: r.sampling,
                    logprobs: r.logprobs,
                    grammar: r.grammar,
                });
                if inflight.is_empty() {
                    deadline = Instant::now() + config.watchdog;
                }
                let watcher = {
                    let (events, gone_tx) = (job.events.clone(), gone_tx.clone());
                    tokio::spawn(async move {
                        events.closed().await;
                        let _ = gone_tx.send(id);
                    })
                    .abort_handle()
                };
                inflight.insert(id, InFlight { events: job.events, cancelled: false, watcher });
                if write_command(&mut worker.stdin, &cmd).await.is_err() {
                    break Err(None);
                }
            }
            msg = worker.lines.recv() => {
                deadline = Instant::now() + config.watchdog;
                match msg {
                    None => break Err(None),
                    Some(Message::Text { id, text, logprobs }) => {
                        if let Some(f) = inflight.get(&id) {
                            let _ = f.events.send(JobEvent::Text { text, logprobs });
                        }
                    }
                    Some(Message::Done {
                        id,
                        stop,
                        stop_word,
                        timings,
                    }) => {
                        metrics.record_timings(&timings);
                        if let Some(f) = inflight.remove(&id) {
                            f.watcher.abort();
                            let _ = f.events.send(JobEvent::Done {
                                stop,
                                stop_word,
                                timings,
                            });
                        }
                            }
                    Some(Message::Failed { id, message }) => {
                        if let Some(f) = inflight.remove(&id) {
                            f.watcher.abort();
                            let _ = f.events.send(JobEvent::Failed { status: 400, message });
                        }
                            }
                    Some(Message::Slots { id, slots }) => {
                        if let Some(q) = asked.remove(&id) {
                            let _ = q.send(slots);
                        }
                    }
                    Some(Message::Event(e)) => note_event(worker, &e, Some(metrics)),
                    Some(Message::Kv(u)) => metrics.record_kv(&u),
                    Some(_) => {}
                }
            }
            Some(q) = queries.recv() => {
                next_query += 1;
                asked.insert(next_query, q);
                if write_command(&mut worker.stdin, &Command::Slots { id: next_query }).await.is_err() {
                    break Err(None);
                }
            }
            Some(id) = gone.recv() => {
                if let Some(f) = inflight.get_mut(&id)
                    && !f.cancelled
                {
                    f.cancelled = true;
                    metrics.cancelled.inc();
                    if write_command(&mut worker.stdin, &Command::Cancel { id }).await.is_err() {
                        break Err(None);
                    }
                }
            }
            _ = tokio::time::sleep_until(deadline), if !inflight.is_empty() => {
                break Err(Some(format!(
                    "silent for {} s, stopped by the watchdog (--watchdog-s)",
                    config.watchdog.as_secs()
                )));
            }
            _ = async { let _ = ending.wait_for(|e| *e).await; }, if !ended => {
                ended = true;
                let ids: Vec<u64> = inflight.keys().copied().collect();
                end(&mut inflight, 503, ENDING);
                for id in ids {
                    let _ = write_command(&mut worker.stdin, &Command::Cancel { id }).await;
                }
            }
        }
        metrics.running.set(inflight.len() as i64);
    };
    match outcome {
        Ok(()) => Ok(()),
        Err(why) => {
            let killed = why.map(|w| (w, "watchdog"));
            let d = bury(worker, killed).await;
            end(&mut inflight, 503, &death_message(&d.0));
            Err(d)
        }
    }
}
