//! A pool of worker threads that spin between jobs: for work that comes in bursts of a few hundred microseconds
//! at a steady beat, such as the experts a GPU's expert cache misses at each MoE layer of a decode step (DESIGN.md
//! section 3, "Expert cache"). Rayon's workers go to sleep in the gap between two such bursts, and waking them
//! costs about as much as the burst; these workers spin for [`SPIN`] after their last task (llama.cpp's thread
//! pool polls the same way), then park until the next job.
//!
//! A job is `n` independent tasks `f(0..n)`; the caller runs tasks too and returns once every task has run and no
//! worker can still reach `f`. Tasks are handed out one at a time by an atomic counter. One thread runs jobs on a
//! pool at a time (two callers are safe, each waiting for the other's job too), and a task must not run a job on
//! its own pool: its worker would wait for itself.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::{JoinHandle, Thread};
use std::time::{Duration, Instant};

/// How long an idle worker spins before it parks.
pub const SPIN: Duration = Duration::from_millis(2);

/// One job's tasks and counters, on the stack of [`SpinPool::run`]'s caller for the length of the call.
struct Job<'a> {
    f: &'a (dyn Fn(usize) + Sync),
    n: usize,
    next: AtomicUsize,
    done: AtomicUsize,
}

impl Job<'_> {
    /// Runs tasks until none is left. A panicking task aborts the process: other threads may still hold this
    /// job's address, so it must not unwind past [`SpinPool::run`].
    fn work(&self) {
        let abort = AbortOnPanic;
        loop {
            let i = self.next.fetch_add(1, Ordering::Relaxed);
            if i >= self.n {
                break;
            }
            (self.f)(i);
            self.done.fetch_add(1, Ordering::Release);
        }
        std::mem::forget(abort);
    }
}

/// The published job, as an address: `Job<'a>` with its lifetime erased (see [`SpinPool::run`]).
#[derive(Clone, Copy)]
struct JobPtr(*const Job<'static>);
// SAFETY: the pointer is only dereferenced by workers registered in `active` while `run` keeps the job alive.
unsafe impl Send for JobPtr {}

struct Shared {
    /// Bumped once per job.
    generation: AtomicU64,
    /// The current job, if any; a worker takes it and registers in `active` under this lock.
    job: Mutex<Option<JobPtr>>,
    /// Workers holding the current job's address.
    active: AtomicUsize,
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
            generation: AtomicU64::new(0),
            job: Mutex::new(None),
            active: AtomicUsize::new(0),
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
            next: AtomicUsize::new(0),
            done: AtomicUsize::new(0),
        };
        let s = &*self.shared;
        // SAFETY (of the erased lifetime): `job` outlives every use of this address. Workers take it only under
        // the lock and register in `active` before releasing it; below, the address is withdrawn under the same
        // lock and `run` waits until `active` is 0, so no worker holds it when `job` goes out of scope.
        let ptr = JobPtr(&job as *const Job<'_> as *const Job<'static>);
        *s.job.lock().unwrap_or_else(|e| e.into_inner()) = Some(ptr);
        s.generation.fetch_add(1, Ordering::Release);
        for t in &self.threads {
            t.unpark();
        }
        let r = {
            // `beside` must not unwind past the job either.
            let abort = AbortOnPanic;
            let r = beside();
            std::mem::forget(abort);
            r
        };
        job.work();
        wait_until(|| job.done.load(Ordering::Acquire) >= n);
        *s.job.lock().unwrap_or_else(|e| e.into_inner()) = None;
        wait_until(|| s.active.load(Ordering::Acquire) == 0);
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
    let mut seen = s.generation.load(Ordering::Acquire);
    let mut idle_since = Instant::now();
    loop {
        let g = s.generation.load(Ordering::Acquire);
        if s.stop.load(Ordering::Acquire) {
            return;
        }
        if g == seen {
            if idle_since.elapsed() < SPIN {
                std::hint::spin_loop();
            } else {
                // Unparked by `run` (a token left before this park returns it at once) or by `drop`.
                std::thread::park();
            }
            continue;
        }
        seen = g;
        let taken = {
            let job = s.job.lock().unwrap_or_else(|e| e.into_inner());
            if job.is_some() {
                s.active.fetch_add(1, Ordering::AcqRel);
            }
            *job
        };
        if let Some(JobPtr(p)) = taken {
            // SAFETY: registered in `active` under the lock while the job was published (`run`'s comment).
            let job = unsafe { &*p };
            job.work();
            s.active.fetch_sub(1, Ordering::Release);
        }
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
