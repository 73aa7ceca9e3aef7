//! A pool of worker threads that spin between jobs: for work that comes in bursts of a few hundred microseconds
//! at a steady beat, such as the experts a GPU's expert cache misses at each MoE layer of a decode step (DESIGN.md
//! section 3, "Expert cache"). Rayon's workers go to sleep in the gap between two such bursts, and waking them
//! costs about as much as the burst; these workers spin for [`SPIN`] after their last task (llama.cpp's thread
//! pool polls the same way), then park until the next job.
//!
//! A job is `n` independent tasks `f(0..n)`; the caller runs tasks too and returns once every task has run and no
//! worker can still reach `f`. Tasks are handed out one at a time by an atomic counter. The hand-off takes no
//! lock: the job is published as an atomic pointer, a worker registers in a counter before it reads the pointer,
//! and the caller withdraws the pointer before it waits for that counter to reach zero (both sides sequentially
//! consistent, so one of them always sees the other). Only parked workers are woken. One thread runs jobs on a
//! pool at a time (two callers are safe, each waiting for the other's job too), and a task must not run a job on
//! its own pool: its worker would wait for itself.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU64, AtomicUsize, Ordering};
use std::thread::{JoinHandle, Thread};
use std::time::{Duration, Instant};

/// How long an idle worker spins before it parks.
pub const SPIN: Duration = Duration::from_millis(2);

/// A value alone on its cache lines (two, for the adjacent-line prefetcher), so that counters every thread
/// writes do not slow the reads of another.
#[repr(align(128))]
struct Padded<T>(T);

/// One job's tasks and counters, on the stack of [`SpinPool::run`]'s caller for the length of the call.
struct Job<'a> {
    f: &'a (dyn Fn(usize) + Sync),
    n: usize,
    /// The next task to hand out.
    next: Padded<AtomicUsize>,
    /// Tasks that have run; each thread adds its count once, when no task is left.
    done: Padded<AtomicUsize>,
}

impl Job<'_> {
    /// Runs tasks until none is left. A panicking task aborts the process: other threads may still hold this
    /// job's address, so it must not unwind past [`SpinPool::run`].
    fn work(&self) {
        let abort = AbortOnPanic;
        let mut ran = 0;
        loop {
            let i = self.next.0.fetch_add(1, Ordering::Relaxed);
            if i >= self.n {
                break;
            }
            (self.f)(i);
            ran += 1;
        }
        if ran > 0 {
            // Release: the tasks' writes happen before the caller's acquire of the total.
            self.done.0.fetch_add(ran, Ordering::Release);
        }
        std::mem::forget(abort);
    }
}

struct Shared {
    /// Bumped once per job; what idle workers poll.
    generation: Padded<AtomicU64>,
    /// The current job (`Job<'a>` with its lifetime erased, see [`SpinPool::run`]), or null.
    job: AtomicPtr<Job<'static>>,
    /// Workers that may hold the current job's address: registered before they read `job`.
    active: Padded<AtomicUsize>,
    /// Workers parked or about to park (registered before their last look at `generation`).
    parked: Padded<AtomicUsize>,
    stop: AtomicBool,
}

/// Worker threads that spin between jobs (module docs). Dropping the pool stops and joins them.
pub struct SpinPool {
    shared: Arc<Shared>,
    threads: Vec<Thread>,
    handles: Vec<JoinHandle<()>>,
}

impl std::fmt::Debug for SpinPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SpinPool({} workers)", self.threads.len())
    }
}

impl SpinPool {
    /// A pool of `workers` threads (0: the caller runs every task alone).
    ///
    /// Errors: the OS refused a thread.
    pub fn new(workers: usize) -> std::io::Result<SpinPool> {
        let shared = Arc::new(Shared {
            generation: Padded(AtomicU64::new(0)),
            job: AtomicPtr::new(std::ptr::null_mut()),
            active: Padded(AtomicUsize::new(0)),
            parked: Padded(AtomicUsize::new(0)),
            stop: AtomicBool::new(false),
        });
        let mut handles = Vec::with_capacity(workers);
        for i in 0..workers {
            let s = shared.clone();
            handles.push(
                std::thread::Builder::new()
                    .name(format!("strata-spin-{i}"))
                    .spawn(move || worker(&s))?,
            );
        }
        Ok(SpinPool {
            threads: handles.iter().map(|h| h.thread().clone()).collect(),
            shared,
            handles,
        })
    }

    /// Worker threads (the caller of [`SpinPool::run`] works beside them).
    pub fn workers(&self) -> usize {
        self.threads.len()
    }

    /// Runs `f(0)`, ..., `f(n - 1)`, each exactly once, on the workers and the calling thread; returns when all
    /// have run. A panicking task aborts the process (its panic message is printed first).
    pub fn run(&self, n: usize, f: &(dyn Fn(usize) + Sync)) {
        self.run_beside(n, f, || ());
    }

    /// [`SpinPool::run`], with `beside` run on the calling thread while the workers start on the tasks (it then
    /// helps with what is left): other work to queue meanwhile, such as a GPU's launches. Returns `beside`'s value.
    pub fn run_beside<R>(&self, n: usize, f: &(dyn Fn(usize) + Sync), beside: impl FnOnce() -> R) -> R {
        if n == 0 {
            return beside();
        }
        let job = Job {
            f,
            n,
            next: Padded(AtomicUsize::new(0)),
            done: Padded(AtomicUsize::new(0)),
        };
        let s = &*self.shared;
        // SAFETY (of the erased lifetime): `job` outlives every use of this address. A worker dereferences it only
        // between registering in `active` and leaving it, and reads the pointer after registering; below, the
        // pointer is withdrawn before `run` waits for `active` to be 0. All four are SeqCst, so either the
        // withdrawal precedes the worker's read (it sees null or a later job) or its registration precedes the
        // wait's read (the wait covers it): no worker holds the address when `job` goes out of scope.
        let ptr = &job as *const Job<'_> as *mut Job<'static>;
        s.job.store(ptr, Ordering::SeqCst);
        s.generation.0.fetch_add(1, Ordering::SeqCst);
        // A worker registers in `parked` before its last look at `generation` (SeqCst both sides): one that may
        // have missed the bump is counted here and woken; spinning workers see the bump by themselves.
        if s.parked.0.load(Ordering::SeqCst) > 0 {
            for t in &self.threads {
                t.unpark();
            }
        }
        let r = {
            // `beside` must not unwind past the job either.
            let abort = AbortOnPanic;
            let r = beside();
            std::mem::forget(abort);
            r
        };
        job.work();
        wait_until(|| job.done.0.load(Ordering::Acquire) >= n);
        s.job.store(std::ptr::null_mut(), Ordering::SeqCst);
        wait_until(|| s.active.0.load(Ordering::SeqCst) == 0);
        r
    }
}

/// Spins until `done()`, yielding the core now and then (a worker that holds the last task may have been
/// descheduled).
fn wait_until(done: impl Fn() -> bool) {
    let mut spins = 0u32;
    while !done() {
        spins += 1;
        if spins.is_multiple_of(1024) {
            std::thread::yield_now();
        } else {
            std::hint::spin_loop();
        }
    }
}

fn worker(s: &Shared) {
    let mut seen = s.generation.0.load(Ordering::Acquire);
    let mut idle_since = Instant::now();
    loop {
        let g = s.generation.0.load(Ordering::Acquire);
        if s.stop.load(Ordering::Acquire) {
            return;
        }
        if g == seen {
            if idle_since.elapsed() < SPIN {
                std::hint::spin_loop();
            } else {
                s.parked.0.fetch_add(1, Ordering::SeqCst);
                // Unparked by `run` (a token left before this park returns it at once) or by `drop`.
                if s.generation.0.load(Ordering::SeqCst) == seen && !s.stop.load(Ordering::SeqCst) {
                    std::thread::park();
                }
                s.parked.0.fetch_sub(1, Ordering::SeqCst);
            }
            continue;
        }
        seen = g;
        s.active.0.fetch_add(1, Ordering::SeqCst);
        let p = s.job.load(Ordering::SeqCst);
        if !p.is_null() {
            // SAFETY: registered in `active` before reading the pointer (`run_beside`'s comment).
            unsafe { &*p }.work();
        }
        s.active.0.fetch_sub(1, Ordering::Release);
        idle_since = Instant::now();
    }
}

/// Aborts the process if a task panics: `run` would otherwise wait for ever for its task, or free a job other
/// threads still read.
struct AbortOnPanic;

impl Drop for AbortOnPanic {
    fn drop(&mut self) {
        eprintln!("strata: a task panicked on a spin-pool worker");
        std::process::abort();
    }
}

impl Drop for SpinPool {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Release);
        for t in &self.threads {
            t.unpark();
        }
        for h in self.handles.drain(..) {
            let _ = h.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    /// The lock-free hand-off under churn: thousands of tiny jobs back to back (workers still inside the last
    /// job's `work` when the next is published), some after a gap long enough for the workers to park. Every
    /// task runs once and the sums come out whole: a worker that read a withdrawn job, or a job freed while a
    /// worker held it, would show here (and under Miri or a sanitizer).
    #[test]
    fn thousands_of_tiny_jobs_with_parks_between_some() {
        let pool = SpinPool::new(3).unwrap();
        for round in 0..4000usize {
            let n = 1 + round % 9;
            let counts: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
            pool.run(n, &|i| {
                counts[i].fetch_add(1, Ordering::Relaxed);
            });
            assert!(counts.iter().all(|c| c.load(Ordering::Relaxed) == 1), "round {round}");
            if round % 1000 == 999 {
                std::thread::sleep(SPIN * 2);
            }
        }
    }

    #[test]
    fn every_task_runs_once_in_every_job() {
        let pool = SpinPool::new(3).unwrap();
        assert_eq!(pool.workers(), 3);
        for n in [0, 1, 2, 7, 64, 1000] {
            for _ in 0..20 {
                let counts: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
                pool.run(n, &|i| {
                    counts[i].fetch_add(1, Ordering::Relaxed);
                });
                assert!(counts.iter().all(|c| c.load(Ordering::Relaxed) == 1), "n = {n}");
            }
        }
    }

    #[test]
    fn workers_that_parked_wake_for_the_next_job() {
        let pool = SpinPool::new(2).unwrap();
        let sum = AtomicUsize::new(0);
        pool.run(10, &|i| {
            sum.fetch_add(i, Ordering::Relaxed);
        });
        // Past the spin time: the workers are parked, and must still take part (or at least not hang the job).
        std::thread::sleep(SPIN * 3);
        let seen = Mutex::new(std::collections::HashSet::new());
        pool.run(200, &|i| {
            sum.fetch_add(i, Ordering::Relaxed);
            seen.lock().unwrap().insert(std::thread::current().id());
            std::thread::sleep(Duration::from_micros(50));
        });
        assert_eq!(sum.load(Ordering::Relaxed), 45 + 199 * 200 / 2);
        assert!(seen.lock().unwrap().len() >= 2, "the parked workers did not wake");
    }

    #[test]
    fn work_beside_runs_on_the_caller_while_the_tasks_run() {
        let pool = SpinPool::new(2).unwrap();
        let done = AtomicUsize::new(0);
        let me = std::thread::current().id();
        let r = pool.run_beside(
            100,
            &|_| {
                done.fetch_add(1, Ordering::Relaxed);
            },
            || {
                assert_eq!(std::thread::current().id(), me);
                7
            },
        );
        assert_eq!((r, done.load(Ordering::Relaxed)), (7, 100));
        assert_eq!(pool.run_beside(0, &|_| unreachable!(), || 3), 3);
    }

    #[test]
    fn a_pool_without_workers_runs_on_the_caller_and_drop_joins() {
        let pool = SpinPool::new(0).unwrap();
        let me = std::thread::current().id();
        pool.run(5, &|_| assert_eq!(std::thread::current().id(), me));
        drop(SpinPool::new(4).unwrap());
    }
}
