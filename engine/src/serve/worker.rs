//! The engine worker: the process that holds the model and runs up to `--parallel` requests at once for
//! `strata serve` (continuous batching, [`crate::runtime::batch`]), speaking [`super::protocol`] over stdin/stdout. It is started by the front as `strata worker ...` (a hidden
//! subcommand); a fault here kills only this process, and the front restarts it.

use std::collections::HashMap;
use std::io::{BufRead, Write};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, mpsc};

use anyhow::{Context, Result};

use super::WorkerFlags;
use super::protocol::{Command, Finish, GenerateJob, Message, Timings};
use crate::backend::AnyBackend;
use crate::device::fault::OP_PREFILL_GEMM;
use crate::events::{self, EventKind, Fallback, Fault, GemmShape};
use crate::runtime::batch::{BatchEvent, BatchJob, Batcher, StepTotals};
use crate::runtime::engine::Engine;
use crate::runtime::generate::TokenSampler;
use crate::runtime::generate::{GenerateError, GenerateOptions, GenerateStats};
use crate::runtime::grammar::{Constrained, GrammarEnv, RecentGrammars};
use crate::runtime::sampling::{MAX_TOP_LOGPROBS, Sampler};
use crate::runtime::session::SessionError;
use crate::tokenizer::Tokenizer;

/// Test hook: when set to N, the worker panics after sending N tokens of a request (a stand-in for a GPU fault,
/// so the failure contract can be tested on the CPU).
pub const ENV_FAULT_AFTER_TOKENS: &str = crate::switches::WORKER_FAULT_AFTER_TOKENS;

/// The `--events` file, opened once at start; events are rare (per request), so a mutex is fine here.
static EVENTS_FILE: OnceLock<Mutex<std::fs::File>> = OnceLock::new();

/// Opens (creating it if needed) the `--events` file for appending.
///
/// Errors: the file cannot be opened or created, naming it.
pub fn open_events_file(path: &std::path::Path) -> Result<std::fs::File> {
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .with_context(|| format!("cannot open the events file {}", path.display()))
}

/// Writes one protocol message as a line on stdout (events also to the `--events` file). A closed stdout means
/// the front is gone: the worker exits.
pub fn send(msg: &Message) {
    // One allocation per message; per token this is noise next to a forward pass.
    let line = serde_json::to_string(msg).expect("protocol messages serialize");
    if let (Message::Event(e), Some(file)) = (msg, EVENTS_FILE.get())
        && let Ok(mut f) = file.lock()
    {
        let _ = serde_json::to_writer(&mut *f, e).map(|_| writeln!(f));
    }
    let mut out = std::io::stdout().lock();
    if writeln!(out, "{line}").and_then(|_| out.flush()).is_err() {
        std::process::exit(0);
    }
}

/// Sends a `fault` event from the panic hook, so the front can log and count the cause of the death.
fn install_fault_hook() {
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let error = match (
            info.payload().downcast_ref::<&str>(),
            info.payload().downcast_ref::<String>(),
        ) {
            (Some(s), _) => s.to_string(),
            (_, Some(s)) => s.clone(),
            _ => "panic".to_string(),
        };
        events::emit(EventKind::Fault(Fault {
            error,
            location: info.location().map(|l| l.to_string()),
            ..Fault::default()
        }));
        default(info);
        // A panic on a pool thread must not leave a half-alive worker behind.
        std::process::exit(101);
    }));
}

/// Resident set size of this process in bytes (Linux `/proc/self/statm`), or 0 where it cannot be read.
pub fn rss_bytes(pid: Option<u32>) -> u64 {
    let path = match pid {
        Some(p) => format!("/proc/{p}/statm"),
        None => "/proc/self/statm".to_string(),
    };
    std::fs::read_to_string(path)
        .ok()
        .and_then(|s| s.split_whitespace().nth(1)?.parse::<u64>().ok())
        .map_or(0, |pages| pages * 4096)
}

/// Runs the worker until stdin closes: loads the model, sends `ready`, then serves `generate` commands in
/// arrival order, except that a job with a grammar joins once the grammar thread has compiled it (later jobs
/// without one, and `slots` queries, may go ahead of it).
///
/// Errors: the model cannot be loaded (the front sees the exit and reports it).
pub fn run(flags: &WorkerFlags) -> Result<()> {
    // Every event (the backend's too) travels over the protocol and into the --events file, and its human line
    // goes to stderr as `strata serve: ...`.
    events::set_log_prefix("strata serve");
    events::set_sink(|ev| send(&Message::Event(ev.clone())));
    install_fault_hook();
    // Ctrl-C in a terminal, and systemd's SIGTERM to the control group, reach the whole process group: the front
    // drains and ends the requests (--drain-s), and this worker ends when its stdin closes, its parent dies or the
    // front kills it, so those signals are the front's alone.
    #[cfg(unix)]
    // SAFETY: setting a signal's disposition to SIG_IGN installs no handler code.
    unsafe {
        libc::signal(libc::SIGINT, libc::SIG_IGN);
        libc::signal(libc::SIGTERM, libc::SIG_IGN);
    }
    if let Some(path) = &flags.events {
        let _ = EVENTS_FILE.set(Mutex::new(open_events_file(path)?));
    }
    if crate::switches::text_lossy(crate::switches::WORKER_FAULT_AT_LOAD).is_some_and(|v| v == "hang") {
        // A load that never ends (a test of --load-timeout-s).
        loop {
            std::thread::sleep(std::time::Duration::from_secs(3600));
        }
    }
    if crate::switches::text_lossy(crate::switches::WORKER_FAULT_AT_LOAD).is_some_and(|v| v == "1") {
        anyhow::bail!(
            "injected fault before loading ({})",
            crate::switches::WORKER_FAULT_AT_LOAD
        );
    }
    let engine = Engine::open(&flags.engine)?;
    let (model, tokenizer) = (&engine.model, &engine.tokenizer);
    let parallel = flags.engine.plan.sequences();
    let sessions = (0..parallel).map(|_| engine.session()).collect::<Result<Vec<_>, _>>()?;
    let n_ctx = sessions[0].n_ctx();
    let budget = flags.engine.plan.prefill_chunk();
    let mut batcher = Batcher::new(sessions, budget);
    let pool = engine.kv_pool();
    if let (Some(blocks), Ok(cell)) = (
        pool.capacity_blocks(),
        model.hp.kv_shape().cell_bytes(flags.engine.plan.kv),
    ) {
        let tokens = blocks * crate::state::kv::KV_BLOCK_CELLS;
        eprintln!(
            "strata serve: KV cache: {blocks} blocks of {} tokens ({tokens} tokens, {:.1} MiB {}) for {parallel} slots of up to {n_ctx} tokens",
            crate::state::kv::KV_BLOCK_CELLS,
            tokens as f64 * cell as f64 / (1u64 << 20) as f64,
            match pool.is_on_device() {
                true => "of VRAM, taken at start",
                false => "of host memory at most, taken as blocks are written",
            }
        );
    }
    events::emit(EventKind::Load(events::Load {
        model: engine.path.display().to_string(),
        device: flags.engine.device.to_string(),
        arch: model.hp.arch.to_string(),
        n_layer: model.hp.n_layer,
        n_ctx,
        load_ms: engine.load_ms,
        rss_bytes: rss_bytes(None),
        pid: std::process::id(),
    }));
    let _readings = engine.memory_readings(READING_PERIOD);

    // The reader thread turns stdin lines into jobs, and sets a request's cancel flag when the front cancels it
    // (before or after its job arrives), so a cancel reaches a generation in progress. Stdin closing means the
    // front is gone.
    // A job's sampler is built here too, and one with a grammar goes to the grammar thread first (compiling a
    // schema takes up to about a second, and indexing the vocabulary for the first one up to about a second for a
    // large vocabulary), so the stepping thread only ever takes ready jobs and no compile stalls the running
    // sequences' steps.
    let vocab = model.weights.output.rows;
    let flags_by_id: Arc<Mutex<CancelFlags>> = Arc::default();
    let running_id = Arc::new(AtomicU64::new(0));
    // The job whose grammar is being compiled (0: none): the heartbeat speaks for it, so a long compile is not
    // taken for a silent worker.
    let compiling_id = Arc::new(AtomicU64::new(0));
    let (jobs_tx, jobs_rx) = mpsc::channel::<Work>();
    let (compile_tx, compile_rx) = mpsc::channel::<(Box<GenerateJob>, Arc<AtomicBool>)>();
    {
        let flags_by_id = flags_by_id.clone();
        let jobs_tx = jobs_tx.clone();
        std::thread::spawn(move || {
            for line in std::io::stdin().lock().lines() {
                let Ok(line) = line else { break };
                match serde_json::from_str::<Command>(&line) {
                    Ok(Command::Generate(job)) => {
                        let flag = lock(&flags_by_id).flag(job.id);
                        let sent = match job.grammar {
                            Some(_) => compile_tx.send((Box::new(job), flag)).is_ok(),
                            None => {
                                let sampler = plain_sampler(&job, vocab);
                                jobs_tx.send(Work::Job(Box::new(job), flag, sampler)).is_ok()
                            }
                        };
                        if !sent {
                            break;
                        }
                    }
                    Ok(Command::Cancel { id }) => lock(&flags_by_id).cancel(id),
                    Ok(Command::Slots { id }) => {
                        if jobs_tx.send(Work::Slots(id)).is_err() {
                            break;
                        }
                    }
                    Err(e) => eprintln!("strata serve: worker ignores a bad command line ({e}): {line}"),
                }
            }
            std::process::exit(0);
        });
    }
    // The pool as it starts, before `ready` (a new worker's replaces a dead one's in /metrics).
    send(&Message::Kv(batcher.kv_usage()));
    send(&Message::Ready {
        n_ctx,
        pid: std::process::id(),
    });

    // The heartbeat: while requests run and the engine starts work, or a grammar compiles, the front hears so
    // every HEARTBEAT.
    {
        let (running_id, compiling_id) = (running_id.clone(), compiling_id.clone());
        std::thread::spawn(move || {
            let mut seen = crate::backend::progress::ticks();
            loop {
                std::thread::sleep(super::protocol::HEARTBEAT);
                let (id, now) = (running_id.load(Ordering::SeqCst), crate::backend::progress::ticks());
                let compiling = compiling_id.load(Ordering::SeqCst);
                if id != 0 && now != seen {
                    send(&Message::Busy { id });
                } else if compiling != 0 {
                    send(&Message::Busy { id: compiling });
                }
                seen = now;
            }
        });
    }
    let fault_after: Option<usize> = crate::switches::text_lossy(ENV_FAULT_AFTER_TOKENS).and_then(|v| v.parse().ok());
    std::thread::scope(|scope| {
        // llguidance's compiler recurses per schema level and property: the main thread's stack size, not a spawned
        // thread's 2 MiB (the front's limits keep a schema within 2 MiB; this is the margin).
        std::thread::Builder::new()
            .name("grammar".into())
            .stack_size(8 << 20)
            .spawn_scoped(scope, || {
                compile_grammars(compile_rx, jobs_tx, tokenizer, vocab, &compiling_id)
            })
            .expect("the grammar thread starts");
        step_loop(&engine, &mut batcher, &jobs_rx, &flags_by_id, &running_id, fault_after);
    });
    Ok(())
}

/// The stepping thread: takes every ready job at each step boundary, steps the batch and sends what it made,
/// until every job sender is gone.
fn step_loop(
    engine: &Engine,
    batcher: &mut Batcher<'_, AnyBackend>,
    jobs_rx: &mpsc::Receiver<Work>,
    flags_by_id: &Mutex<CancelFlags>,
    running_id: &AtomicU64,
    fault_after: Option<usize>,
) {
    let tokenizer = &engine.tokenizer;
    let mut sent: HashMap<u64, usize> = HashMap::new();
    let mut totals = StepTotals::default();
    let mut last_kv = batcher.kv_usage();
    let mut period_start = std::time::Instant::now();
    let mut last_step = period_start;
    loop {
        // Wait for work when there is none; take every job that has arrived, at each step boundary.
        if batcher.is_idle() {
            running_id.store(0, Ordering::SeqCst);
            // A burst of steps ended: its line now, over its own time (the idle time after it is no step's).
            if totals.steps > 0 {
                log_batching(&mut totals, last_step.duration_since(period_start));
            }
            match jobs_rx.recv() {
                Ok(w) => take(batcher, w),
                Err(_) => break,
            }
            period_start = std::time::Instant::now();
        }
        while let Ok(w) = jobs_rx.try_recv() {
            take(batcher, w);
        }
        running_id.store(batcher.ids().next().unwrap_or(0), Ordering::SeqCst);
        let report = batcher.step(tokenizer, &mut |ev| match ev {
            BatchEvent::Progress { id, read, total } => send(&Message::Progress { id, read, total }),
            BatchEvent::Text { id, text, logprobs } => {
                if let Some(limit) = fault_after {
                    let n = sent.entry(id).or_default();
                    if *n >= limit {
                        panic!("injected fault after {n} tokens ({ENV_FAULT_AFTER_TOKENS})");
                    }
                    *n += 1;
                }
                send(&Message::Text {
                    id,
                    text: text.to_string(),
                    logprobs,
                });
            }
            BatchEvent::Done { id, stats } => {
                sent.remove(&id);
                lock(flags_by_id).forget(id);
                done(id, &stats);
                engine.emit_expert_cache(Some(id));
            }
            BatchEvent::Failed { id, error } => {
                sent.remove(&id);
                lock(flags_by_id).forget(id);
                failed(id, error);
            }
        });
        let kv = batcher.kv_usage();
        if kv != last_kv {
            send(&Message::Kv(kv));
            last_kv = kv;
        }
        // Every BATCH_LOG_PERIOD with steps of several sequences, and when they end, one line of what batching did.
        totals.add(&report);
        last_step = std::time::Instant::now();
        let since = period_start.elapsed();
        if since >= BATCH_LOG_PERIOD {
            log_batching(&mut totals, since);
            period_start = std::time::Instant::now();
        }
    }
}

/// Logs what batching did over `busy` (when steps carried several sequences) and starts the next totals.
fn log_batching(totals: &mut StepTotals, busy: std::time::Duration) {
    if totals.max_sequences > 1 {
        eprintln!("strata serve: batching: {}", totals.line(busy.as_secs_f64()));
    }
    *totals = StepTotals::default();
}

/// The cancel flags of the requests the worker knows, and the ids the front cancelled before their job arrived.
#[derive(Default)]
struct CancelFlags {
    flags: HashMap<u64, Arc<AtomicBool>>,
    early: std::collections::HashSet<u64>,
}

impl CancelFlags {
    /// The flag of a job arriving now (already set if its cancel came first).
    fn flag(&mut self, id: u64) -> Arc<AtomicBool> {
        let f = Arc::new(AtomicBool::new(self.early.remove(&id)));
        self.flags.insert(id, f.clone());
        f
    }

    fn cancel(&mut self, id: u64) {
        match self.flags.get(&id) {
            Some(f) => f.store(true, Ordering::SeqCst),
            // A cancel for a job not read yet (or one already ended: forgotten when its id is never reused, and
            // bounded so a confused front cannot grow it).
            None if self.early.len() < 4096 => {
                self.early.insert(id);
            }
            None => {}
        }
    }

    fn forget(&mut self, id: u64) {
        self.flags.remove(&id);
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// A job's sampler, or why its settings or grammar were refused (the front checks both, so only a front of
/// another version sends one).
type BuiltSampler = Result<Box<dyn TokenSampler + Send>, String>;

/// What the reader and grammar threads hand the stepping thread, which takes it between two steps.
enum Work {
    /// A job, with its cancel flag and its sampler.
    Job(Box<GenerateJob>, Arc<AtomicBool>, BuiltSampler),
    /// A `slots` command: answered with the slots as they stand between steps.
    Slots(u64),
}

/// Takes `w` between two steps: queues a job on the scheduler, or answers a `slots` command.
fn take(batcher: &mut Batcher<'_, AnyBackend>, w: Work) {
    match w {
        Work::Job(job, cancel, sampler) => admit(batcher, *job, cancel, sampler),
        Work::Slots(id) => send(&Message::Slots {
            id,
            slots: batcher.slots(),
        }),
    }
}

/// The sampler of `job`'s sampling settings, without its grammar.
fn plain_sampler(job: &GenerateJob, vocab: usize) -> BuiltSampler {
    match Sampler::new(job.sampling.clone(), vocab) {
        Ok(s) => Ok(Box::new(s)),
        Err(e) => Err(e.to_string()),
    }
}

/// The grammar thread: gives each job from `rx` its sampler under its grammar and hands it to the stepping
/// thread, in arrival order, until the reader thread is gone. The vocabulary is indexed for the constraint engine
/// when the first grammar arrives. A grammar among the last few compiled is cloned, not compiled again
/// ([`RecentGrammars`]: a request's `n` choices compile once). A job cancelled before its turn goes on uncompiled
/// (its plain sampler), and the scheduler ends it as cancelled, so it holds up no job behind it.
fn compile_grammars(
    rx: mpsc::Receiver<(Box<GenerateJob>, Arc<AtomicBool>)>,
    to: mpsc::Sender<Work>,
    tokenizer: &Tokenizer,
    vocab: usize,
    compiling: &AtomicU64,
) {
    let delay = crate::switches::usize_in(crate::switches::WORKER_GRAMMAR_DELAY_MS, 0..=600_000).unwrap_or(0);
    let mut env: Option<Arc<GrammarEnv>> = None;
    // The `n` choices of a request, and a schema sent again, compile once.
    let mut recent = RecentGrammars::default();
    for (job, cancel) in rx {
        let sampler = plain_sampler(&job, vocab).and_then(|inner| {
            let Some(spec) = job.grammar.as_ref().filter(|_| !cancel.load(Ordering::SeqCst)) else {
                return Ok(inner);
            };
            compiling.store(job.id, Ordering::SeqCst);
            std::thread::sleep(std::time::Duration::from_millis(delay as u64));
            let env = match &env {
                Some(env) => env.clone(),
                None => env
                    .insert(Arc::new(GrammarEnv::new(tokenizer).map_err(|e| e.to_string())?))
                    .clone(),
            };
            let matcher = recent.matcher(&env, spec).map_err(|e| e.to_string())?;
            Ok(Box::new(Constrained::new(inner, matcher, env)) as Box<dyn TokenSampler + Send>)
        });
        compiling.store(0, Ordering::SeqCst);
        if to.send(Work::Job(job, cancel, sampler)).is_err() {
            break;
        }
    }
}

/// Queues a job on the scheduler with its sampler, or answers `failed` when its sampling settings or grammar
/// were refused.
fn admit(batcher: &mut Batcher<'_, AnyBackend>, job: GenerateJob, cancel: Arc<AtomicBool>, sampler: BuiltSampler) {
    match sampler {
        Ok(sampler) => batcher.submit(BatchJob {
            id: job.id,
            prompt: job.prompt,
            opts: GenerateOptions {
                logprobs: job.logprobs.map(|n| n.min(MAX_TOP_LOGPROBS)),
                ..GenerateOptions::new(job.max_tokens, job.stop)
            },
            sampler,
            cancel,
        }),
        Err(message) => send(&Message::Failed { id: job.id, message }),
    }
}

/// How often the worker logs what batching did (while several sequences share steps).
const BATCH_LOG_PERIOD: std::time::Duration = std::time::Duration::from_secs(10);

/// How often the worker reads its device's memory ([`Engine::memory_readings`]).
const READING_PERIOD: std::time::Duration = std::time::Duration::from_millis(200);

/// Reports a request that ended: its GEMM fallback (once), its `request` event, and `done`.
fn done(id: u64, stats: &GenerateStats) {
    if let Some(f) = &stats.prefill.gemm_fallback {
        events::emit(EventKind::Fallback(Fallback {
            op: OP_PREFILL_GEMM.into(),
            from: "blas".into(),
            to: "prefill_chunked".into(),
            why: f.to_string(),
            shape: Some(GemmShape { m: f.m, n: f.n, k: f.k }),
            max_rows: Some(f.limit),
        }));
    }
    let timings = Timings {
        prompt_n: stats.prefill.read,
        cache_n: stats.prefill.reused,
        prompt_ms: stats.prefill.ms,
        predicted_n: stats.generated,
        predicted_ms: stats.decode_ms,
    };
    events::emit(EventKind::Request(stats.request_event(id)));
    send(&Message::Done {
        id,
        stop: Finish::from(stats.stop),
        stop_word: stats.stop_word.clone(),
        timings,
    });
}

/// Reports a request that failed; a failed prefill GEMM with the fallback off ends the worker.
fn failed(id: u64, error: GenerateError) {
    if let GenerateError::Session(SessionError::GemmFault(f)) = &error {
        // The original engine died here (seed 000); with --gemm-fallback off so does the worker, after saying
        // which operation and shape failed.
        events::emit(EventKind::Fault(Fault {
            error: f.reason(),
            op: Some(OP_PREFILL_GEMM.into()),
            shape: Some(GemmShape { m: f.m, n: f.n, k: f.k }),
            request: Some(id),
            ..Fault::default()
        }));
        std::process::exit(1);
    }
    send(&Message::Failed {
        id,
        message: error.to_string(),
    });
}
