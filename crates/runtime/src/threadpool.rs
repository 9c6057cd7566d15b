//! A fork-join thread pool for the per-op parallelism of the forward pass.
//!
//! A decode step runs a couple of hundred small parallel regions (one per matrix
//! product), so the cost of starting one matters: at 100+ tokens/s a few
//! microseconds each would show. Workers therefore spin on a generation counter for a
//! short while after each region, and only then park on a condition variable. The
//! calling thread always takes part as worker 0.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How long an idle worker spins before it parks. Between two decode steps the engine
/// samples and detokenizes, which takes well under this.
const SPIN_BEFORE_PARK: Duration = Duration::from_millis(2);

/// Spins after which a waiting thread yields its core on each further turn. A region's
/// threads finish within a few microseconds of each other when each has a core; when
/// the machine is oversubscribed (other processes, more threads than cores), the thread
/// waited for may be descheduled, and pure spinning would burn the waiter's whole time
/// slice before the other gets the core back: decode at 2 threads fell below a tenth
/// of its speed that way on a loaded 2-core machine.
const SPINS_BEFORE_YIELD: u32 = 4096;

type Job = dyn Fn(usize, usize) + Sync;

struct Shared {
    /// Bumped once per region; workers wait for it to change.
    generation: AtomicUsize,
    /// Workers that finished the current region.
    finished: AtomicUsize,
    /// The current job, valid while a region runs. A raw pointer because its lifetime is
    /// that of the `run` call, which waits for every worker before returning.
    job: Mutex<Option<JobPtr>>,
    panicked: AtomicBool,
    stop: AtomicBool,
    park_lock: Mutex<()>,
    wake: Condvar,
    n_threads: usize,
}

#[derive(Clone, Copy)]
struct JobPtr(*const Job);
// SAFETY: the pointee is `Sync` and outlives every use (see `ThreadPool::run`).
unsafe impl Send for JobPtr {}

/// A fixed set of worker threads that run one closure at a time on all threads.
pub struct ThreadPool {
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
    /// Serializes `run` calls from different threads.
    running: Mutex<()>,
}

impl ThreadPool {
    /// A pool of `n_threads` threads in all, counting the caller (so `n_threads - 1`
    /// are spawned). Zero is taken as one.
    pub fn new(n_threads: usize) -> ThreadPool {
        let n_threads = n_threads.max(1);
        let shared = Arc::new(Shared {
            generation: AtomicUsize::new(0),
            finished: AtomicUsize::new(0),
            job: Mutex::new(None),
            panicked: AtomicBool::new(false),
            stop: AtomicBool::new(false),
            park_lock: Mutex::new(()),
            wake: Condvar::new(),
            n_threads,
        });
        let workers = (1..n_threads)
            .map(|index| {
                let shared = Arc::clone(&shared);
                std::thread::Builder::new()
                    .name(format!("ballast-worker-{index}"))
                    .spawn(move || worker_loop(&shared, index))
                    .expect("spawning a worker thread")
            })
            .collect();
        ThreadPool {
            shared,
            workers,
            running: Mutex::new(()),
        }
    }

    /// Number of threads, the caller included.
    pub fn n_threads(&self) -> usize {
        self.shared.n_threads
    }

    /// Runs `job(thread_index, n_threads)` once on every thread and returns when all
    /// have finished, with how long the calling thread (index 0) waited for the others
    /// after its own share: the cost of the region's barrier (`None` on one thread,
    /// where there is none). A panic in any of them is re-raised here.
    pub fn run(&self, job: &(dyn Fn(usize, usize) + Sync)) -> Option<Duration> {
        let n = self.shared.n_threads;
        if n == 1 {
            job(0, 1);
            return None;
        }
        let _serial = self.running.lock().unwrap_or_else(|e| e.into_inner());
        // SAFETY: erasing the lifetime is sound because this function does not return
        // before every worker has finished with the pointer (the wait below), and the
        // slot is cleared before returning.
        let ptr: *const Job = unsafe {
            std::mem::transmute::<*const (dyn Fn(usize, usize) + Sync + '_), *const Job>(job)
        };
        *self.shared.job.lock().unwrap_or_else(|e| e.into_inner()) = Some(JobPtr(ptr));
        self.shared.finished.store(0, Ordering::Release);
        {
            // Taking the park lock orders the bump against a worker about to park.
            let _g = self
                .shared
                .park_lock
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            self.shared.generation.fetch_add(1, Ordering::AcqRel);
            self.shared.wake.notify_all();
        }
        let mine = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| job(0, n)));
        let done = Instant::now();
        let mut spins = 0u32;
        while self.shared.finished.load(Ordering::Acquire) < n - 1 {
            spins = spins.saturating_add(1);
            if spins > SPINS_BEFORE_YIELD {
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
        }
        let waited = done.elapsed();
        *self.shared.job.lock().unwrap_or_else(|e| e.into_inner()) = None;
        if let Err(payload) = mine {
            std::panic::resume_unwind(payload);
        }
        if self.shared.panicked.swap(false, Ordering::AcqRel) {
            panic!("a ballast worker thread panicked");
        }
        Some(waited)
    }
}

fn worker_loop(shared: &Shared, index: usize) {
    let mut seen = 0usize;
    loop {
        let mut spin_start = Instant::now();
        let mut spins = 0u32;
        loop {
            if shared.stop.load(Ordering::Acquire) {
                return;
            }
            let g = shared.generation.load(Ordering::Acquire);
            if g != seen {
                seen = g;
                break;
            }
            spins += 1;
            if spins % 1024 == 0 && spin_start.elapsed() > SPIN_BEFORE_PARK {
                let guard = shared.park_lock.lock().unwrap_or_else(|e| e.into_inner());
                if shared.generation.load(Ordering::Acquire) == seen
                    && !shared.stop.load(Ordering::Acquire)
                {
                    let _guard = shared.wake.wait(guard).unwrap_or_else(|e| e.into_inner());
                }
                spin_start = Instant::now();
            }
            if spins > SPINS_BEFORE_YIELD {
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
        }
        let job = *shared.job.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(JobPtr(ptr)) = job {
            // SAFETY: `run` keeps the closure alive until `finished` reaches n - 1.
            let f = unsafe { &*ptr };
            if std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(index, shared.n_threads)))
                .is_err()
            {
                shared.panicked.store(true, Ordering::Release);
            }
        }
        shared.finished.fetch_add(1, Ordering::AcqRel);
    }
}

impl Drop for ThreadPool {
    fn drop(&mut self) {
        {
            let _g = self
                .shared
                .park_lock
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            self.shared.stop.store(true, Ordering::Release);
            self.shared.wake.notify_all();
        }
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}

/// The part `[start, end)` of `0..len` that thread `index` of `n` takes, in multiples
/// of `align` so that no block is split.
pub fn split_range(len: usize, align: usize, index: usize, n: usize) -> std::ops::Range<usize> {
    let align = align.max(1);
    let units = len.div_ceil(align);
    let start = (units * index / n * align).min(len);
    let end = (units * (index + 1) / n * align).min(len);
    start..end
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU64;

    #[test]
    fn every_thread_runs_every_region() {
        let pool = ThreadPool::new(3);
        let sum = AtomicU64::new(0);
        for _ in 0..1000 {
            pool.run(&|i, n| {
                assert_eq!(n, 3);
                sum.fetch_add(i as u64 + 1, Ordering::Relaxed);
            });
        }
        assert_eq!(sum.load(Ordering::Relaxed), 6 * 1000);
    }

    #[test]
    fn workers_wake_after_parking() {
        let pool = ThreadPool::new(2);
        std::thread::sleep(SPIN_BEFORE_PARK * 3);
        let hits = AtomicU64::new(0);
        pool.run(&|_, _| {
            hits.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(hits.load(Ordering::Relaxed), 2);
    }

    #[test]
    fn split_covers_everything_once() {
        for len in [0, 1, 7, 64, 577] {
            for n in 1..5 {
                let mut next = 0;
                for i in 0..n {
                    let r = split_range(len, 4, i, n);
                    assert_eq!(r.start, next);
                    next = r.end;
                }
                assert_eq!(next, len);
            }
        }
    }

    #[test]
    #[should_panic(expected = "boom")]
    fn a_panic_in_the_caller_propagates() {
        let pool = ThreadPool::new(2);
        pool.run(&|i, _| {
            if i == 0 {
                panic!("boom");
            }
        });
    }
}
