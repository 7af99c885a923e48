//! Runs a schedule's steps on the process's thread pool: every thread walks the steps in order,
//! claims chunks of each step's work items from a shared counter, and waits at a barrier before
//! the next step. A work item's result never depends on which thread runs it or how items are
//! chunked, so outputs are bit-identical for any thread count.

use super::jit::StepFn;
use std::sync::atomic::{AtomicI64, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};

/// Raw pointers handed to generated code, shareable across the pool's threads.
#[derive(Clone, Copy)]
pub struct Args {
    /// Buffer addresses, one per plan buffer.
    pub bufs: *const *mut u8,
    /// The integer table.
    pub ints: *const i64,
    /// Scratch memory: `threads × scratch_bytes`.
    pub scratch: *mut u8,
    /// Scratch bytes per thread.
    pub scratch_bytes: usize,
}

// SAFETY: the pointers address memory that outlives the scoped threads; generated code writes
// disjoint parts of it per work item (and scratch per thread), and steps are separated by a
// barrier.
unsafe impl Send for Args {}
// SAFETY: as above.
unsafe impl Sync for Args {}

impl Args {
    /// Runs items `lo..hi` of `f` on thread `t`'s scratch.
    fn call(&self, f: StepFn, lo: i64, hi: i64, t: usize) {
        // SAFETY: each thread's scratch slice lies within the `threads × scratch_bytes` block;
        // the rest as for `Args`.
        unsafe {
            let scratch = self.scratch.add(t * self.scratch_bytes);
            f(self.bufs, self.ints, lo, hi, scratch)
        }
    }
}

/// Work items per chunk: about four chunks per thread, so faster threads take more.
fn chunk(items: i64, threads: usize) -> i64 {
    (items / (threads as i64 * 4)).max(1)
}

/// The threads a run with `threads` uses: no more than the largest step has work items.
pub fn used_threads(items: &[i64], threads: usize) -> usize {
    let most = items.iter().copied().max().unwrap_or(0);
    threads.clamp(1, usize::try_from(most).unwrap_or(1).max(1))
}

/// Runs every step (`funcs[s]` over `items[s]` work items, in order) with `threads` threads
/// (≥ 1): on the process's persistent pool ([`Pool`]), whose workers wait for work spinning a
/// little before they sleep, so a short run (a decoding step) pays microseconds to go parallel,
/// not a thread start per worker. When the pool is busy with another run (two runs at once from
/// different threads), this run starts threads of its own for the call. When the operating
/// system refuses a thread, nothing runs and the error is returned.
pub fn run(items: &[i64], funcs: &[StepFn], args: Args, threads: usize) -> std::io::Result<()> {
    let threads = used_threads(items, threads);
    if threads == 1 {
        for (f, n) in funcs.iter().zip(items) {
            if *n > 0 {
                args.call(*f, 0, *n, 0);
            }
        }
        return Ok(());
    }
    if let Some(omp) = openmp::shared() {
        omp.run(&Job::new(items, funcs, args, threads));
        return Ok(());
    }
    match Pool::global().and_then(|pool| pool.try_run(items, funcs, args, threads)) {
        Some(result) => result,
        None => run_scoped(items, funcs, args, threads),
    }
}

/// The work of one run: what every participating thread does, and how they meet between steps.
struct Job<'a> {
    items: &'a [i64],
    funcs: &'a [StepFn],
    args: Args,
    threads: usize,
    counters: Vec<AtomicI64>,
    barrier: SpinBarrier,
}

impl Job<'_> {
    fn new<'a>(items: &'a [i64], funcs: &'a [StepFn], args: Args, threads: usize) -> Job<'a> {
        let counters = items.iter().map(|_| AtomicI64::new(0)).collect();
        Job { items, funcs, args, threads, counters, barrier: SpinBarrier::new(threads) }
    }

    /// Every step on the calling thread alone (thread 0's scratch): what a team of the wrong
    /// size does instead of [`Job::work`].
    fn work_alone(&self) {
        for (f, n) in self.funcs.iter().zip(self.items) {
            if *n > 0 {
                self.args.call(*f, 0, *n, 0);
            }
        }
    }

    /// Thread `t`'s part: chunks of each step's items, then the barrier before the next step.
    fn work(&self, t: usize) {
        for (s, f) in self.funcs.iter().enumerate() {
            let n = self.items[s];
            if n > 0 {
                let size = chunk(n, self.threads);
                loop {
                    let lo = self.counters[s].fetch_add(size, Ordering::Relaxed);
                    if lo >= n {
                        break;
                    }
                    let hi = (lo + size).min(n);
                    self.args.call(*f, lo, hi, t);
                }
            }
            self.barrier.wait();
        }
    }
}

/// [`run`] on threads started for this call (scoped: they end with it).
fn run_scoped(items: &[i64], funcs: &[StepFn], args: Args, threads: usize) -> std::io::Result<()> {
    let job = Job::new(items, funcs, args, threads);
    let gate = Gate::default();
    std::thread::scope(|scope| {
        for t in 1..threads {
            let (job, gate) = (&job, &gate);
            let spawned = std::thread::Builder::new().spawn_scoped(scope, move || {
                if gate.wait() {
                    job.work(t);
                }
            });
            if let Err(e) = spawned {
                gate.open(false);
                return Err(e);
            }
        }
        gate.open(true);
        job.work(0);
        Ok(())
    })
}

/// Waits between the steps of a run: the last thread to arrive releases the others, who spin
/// (then yield, then sleep briefly) meanwhile. Steps are short, so a sleeping barrier's wake-up
/// (tens of microseconds) would cost more than the step.
struct SpinBarrier {
    arrived: AtomicUsize,
    generation: AtomicUsize,
    threads: usize,
}

impl SpinBarrier {
    fn new(threads: usize) -> SpinBarrier {
        SpinBarrier { arrived: AtomicUsize::new(0), generation: AtomicUsize::new(0), threads }
    }

    fn wait(&self) {
        let generation = self.generation.load(Ordering::Acquire);
        if self.arrived.fetch_add(1, Ordering::AcqRel) + 1 == self.threads {
            self.arrived.store(0, Ordering::Relaxed);
            self.generation.fetch_add(1, Ordering::Release);
            return;
        }
        let mut backoff = Backoff::default();
        while self.generation.load(Ordering::Acquire) == generation {
            backoff.pause();
        }
    }
}

/// Waiting that spins first, then yields the core, then sleeps in short naps (a machine with
/// fewer free cores than threads must not stall on a spinning waiter).
#[derive(Default)]
struct Backoff {
    rounds: u32,
}

impl Backoff {
    fn pause(&mut self) {
        self.rounds = self.rounds.saturating_add(1);
        if self.rounds < 2_000 {
            std::hint::spin_loop();
        } else if self.rounds < 2_200 {
            std::thread::yield_now();
        } else {
            std::thread::sleep(std::time::Duration::from_micros(50));
        }
    }
}

/// The process's worker threads, started the first time a run wants more than one thread and
/// grown to the most any run asked for. Between runs a worker spins for a short while (about
/// 50 µs: the gap between a model's consecutive attention calls), then sleeps until the next.
/// One run uses the pool at a time. A child process made by `fork` (Python's multiprocessing,
/// data loader workers) has none of its parent's threads: it starts a pool of its own.
pub struct Pool {
    shared: Arc<Shared>,
    /// Serialises runs, and counts the workers started.
    busy: Mutex<usize>,
    /// The process that started the workers.
    pid: u32,
}

/// What the caller and the workers share.
struct Shared {
    /// The current job: its number, its address (0: none) and its thread count; behind a lock
    /// for sleepers.
    slot: Mutex<(u64, usize, usize)>,
    posted: Condvar,
    /// The number of the latest job (read by spinning workers without the lock).
    latest: AtomicU64,
    /// Workers done with the latest job.
    done: AtomicUsize,
}

static POOL: Mutex<Option<Arc<Pool>>> = Mutex::new(None);

impl Pool {
    /// The process's pool (a new one in a forked child).
    fn global() -> Option<Arc<Pool>> {
        let mut pool = POOL.lock().ok()?;
        let pid = std::process::id();
        if pool.as_ref().is_none_or(|p| p.pid != pid) {
            let shared = Arc::new(Shared {
                slot: Mutex::new((0, 0, 0)),
                posted: Condvar::new(),
                latest: AtomicU64::new(0),
                done: AtomicUsize::new(0),
            });
            // The parent's pool (in a forked child) is left alone: its threads are not here.
            std::mem::forget(pool.take());
            *pool = Some(Arc::new(Pool { shared, busy: Mutex::new(0), pid }));
        }
        pool.clone()
    }

    /// Runs the job on the pool: `None` when another run holds it.
    fn try_run(&self, items: &[i64], funcs: &[StepFn], args: Args, threads: usize) -> Option<std::io::Result<()>> {
        let mut started = match self.busy.try_lock() {
            Ok(guard) => guard,
            Err(std::sync::TryLockError::WouldBlock) => return None,
            Err(std::sync::TryLockError::Poisoned(e)) => e.into_inner(),
        };
        while *started + 1 < threads {
            // A new worker waits for the jobs after the latest one (it may start after the next
            // is posted: that one is its first).
            let (shared, t, seen) = (Arc::clone(&self.shared), *started + 1, self.shared.latest.load(Ordering::Acquire));
            if let Err(e) = std::thread::Builder::new().name(format!("attnc-{t}")).spawn(move || worker(&shared, t, seen)) {
                return Some(Err(e));
            }
            *started += 1;
        }
        let job = Job::new(items, funcs, args, threads);
        let shared = &self.shared;
        shared.done.store(0, Ordering::Relaxed);
        let number = {
            let mut slot = shared.slot.lock().unwrap_or_else(|e| e.into_inner());
            slot.0 += 1;
            slot.1 = std::ptr::from_ref(&job) as usize;
            slot.2 = threads;
            shared.latest.store(slot.0, Ordering::Release);
            slot.0
        };
        shared.posted.notify_all();
        job.work(0);
        // Every participant is past its last use of `job` when it counts itself done; the other
        // workers never touch it. Only then may it go out of scope.
        let mut backoff = Backoff::default();
        while shared.done.load(Ordering::Acquire) + 1 < threads {
            backoff.pause();
        }
        let mut slot = shared.slot.lock().unwrap_or_else(|e| e.into_inner());
        if slot.0 == number {
            slot.1 = 0;
        }
        Some(Ok(()))
    }
}

/// How long an idle worker spins before it sleeps.
const IDLE_SPIN: std::time::Duration = std::time::Duration::from_micros(50);

/// Worker `t` of the pool: waits for each job after job number `seen`, and takes part when the
/// job has more than `t` threads.
fn worker(shared: &Shared, t: usize, mut seen: u64) {
    loop {
        // Spin for about 50 µs (a run's next call often comes that soon: the next layer's
        // attention, the next decoding step), then sleep until a job comes.
        let start = std::time::Instant::now();
        let mut spins = 0u32;
        while shared.latest.load(Ordering::Acquire) == seen {
            std::hint::spin_loop();
            spins = spins.wrapping_add(1);
            if spins.is_multiple_of(64) && start.elapsed() > IDLE_SPIN {
                break;
            }
        }
        let (number, address, threads) = {
            let mut slot = shared.slot.lock().unwrap_or_else(|e| e.into_inner());
            while slot.0 == seen {
                slot = shared.posted.wait(slot).unwrap_or_else(|e| e.into_inner());
            }
            *slot
        };
        seen = number;
        // Only a participant (a worker numbered below the job's thread count) reads the job.
        if address == 0 || t >= threads {
            continue;
        }
        // SAFETY: the caller keeps the job alive until every participant has counted itself
        // done, which happens after this worker's last use of it; the address was posted with
        // this job's number under the lock.
        let job = unsafe { &*(address as *const Job) };
        job.work(t);
        shared.done.fetch_add(1, Ordering::AcqRel);
    }
}
/// Holds the workers until every one has started: then they all run (`true`), or, when a
/// thread could not be started, they all return (`false`).
#[derive(Default)]
struct Gate {
    state: Mutex<Option<bool>>,
    opened: Condvar,
}

impl Gate {
    fn open(&self, run: bool) {
        *self.state.lock().unwrap_or_else(|e| e.into_inner()) = Some(run);
        self.opened.notify_all();
    }

    fn wait(&self) -> bool {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            if let Some(run) = *state {
                return run;
            }
            state = self.opened.wait(state).unwrap_or_else(|e| e.into_inner());
        }
    }
}

/// Runs on the team of an OpenMP runtime the process has already loaded (PyTorch's `libgomp`)
/// instead of attnc's own pool, when asked to ([`share`]). Called from PyTorch, attnc's workers
/// would otherwise share the cores with OpenMP's, which spin a while after every parallel
/// operation of PyTorch's (libgomp's default wait policy) and so take much of a core from an
/// attnc run made just then; on OpenMP's team those same threads run attnc's work items. The
/// runtime is reached through GNU libgomp's ABI (`GOMP_parallel`, `omp_get_thread_num`,
/// `omp_get_num_threads`), which LLVM's and Intel's OpenMP runtimes export too.
pub mod openmp {
    use super::Job;
    use std::ffi::{c_int, c_uint, c_void};
    use std::path::{Path, PathBuf};
    use std::sync::{Arc, RwLock};

    type Parallel = unsafe extern "C" fn(extern "C" fn(*mut c_void), *mut c_void, c_uint, c_uint);
    type Query = unsafe extern "C" fn() -> c_int;

    /// The OpenMP runtime in use.
    pub(super) struct Team {
        parallel: Parallel,
        thread_num: Query,
        num_threads: Query,
        path: PathBuf,
        /// The process that loaded it: a forked child (whose OpenMP threads did not survive
        /// the fork) runs on attnc's own pool.
        pid: u32,
        _lib: libloading::Library,
    }

    static SHARED: RwLock<Option<Arc<Team>>> = RwLock::new(None);

    /// Why an OpenMP runtime cannot be used.
    #[derive(Debug, thiserror::Error)]
    pub enum OpenMpError {
        /// It is not loaded in this process (it is only ever used, never loaded).
        #[error("{path}: not an OpenMP runtime loaded in this process ({reason})")]
        NotLoaded {
            /// The library asked for.
            path: PathBuf,
            /// The loader's or the symbol lookup's message.
            reason: String,
        },
        /// Not on this operating system.
        #[error("sharing an OpenMP runtime's threads is supported on Linux only")]
        Unsupported,
    }

    /// Runs multi-threaded steps on the team of the OpenMP runtime at `path`, already loaded in
    /// this process (the library is looked up, never loaded; asking for one that is not loaded
    /// is an error and changes nothing). `None` goes back to attnc's own pool.
    pub fn share(path: Option<&Path>) -> Result<(), OpenMpError> {
        let team = match path {
            None => None,
            Some(path) => Some(Arc::new(open(path)?)),
        };
        if let Ok(mut shared) = SHARED.write() {
            *shared = team;
        }
        Ok(())
    }

    /// The OpenMP runtime whose team runs multi-threaded steps, if any ([`share`]).
    pub fn shared_path() -> Option<PathBuf> {
        shared().map(|t| t.path.clone())
    }

    pub(super) fn shared() -> Option<Arc<Team>> {
        let team = SHARED.read().ok()?.clone()?;
        (team.pid == std::process::id()).then_some(team)
    }

    #[cfg(target_os = "linux")]
    fn open(path: &Path) -> Result<Team, OpenMpError> {
        use libloading::os::unix::{Library, RTLD_NOW};
        /// glibc's and musl's `RTLD_NOLOAD`: only a library already loaded.
        const RTLD_NOLOAD: c_int = 4;
        let fail = |reason: String| OpenMpError::NotLoaded { path: path.to_path_buf(), reason };
        // SAFETY: RTLD_NOLOAD loads nothing: no initialiser runs; the handle keeps the library
        // loaded while the team is in use.
        let lib = unsafe { Library::open(Some(path), RTLD_NOW | RTLD_NOLOAD) }.map_err(|e| fail(e.to_string()))?;
        // SAFETY: the symbols have these C signatures in libgomp's ABI.
        let (parallel, thread_num, num_threads) = unsafe {
            let parallel = *lib.get::<Parallel>(b"GOMP_parallel\0").map_err(|e| fail(e.to_string()))?;
            let thread_num = *lib.get::<Query>(b"omp_get_thread_num\0").map_err(|e| fail(e.to_string()))?;
            let num_threads = *lib.get::<Query>(b"omp_get_num_threads\0").map_err(|e| fail(e.to_string()))?;
            (parallel, thread_num, num_threads)
        };
        Ok(Team { parallel, thread_num, num_threads, path: path.to_path_buf(), pid: std::process::id(), _lib: lib.into() })
    }

    #[cfg(not(target_os = "linux"))]
    fn open(_: &Path) -> Result<Team, OpenMpError> {
        Err(OpenMpError::Unsupported)
    }

    /// A run and the runtime it runs on, handed to every thread of the team.
    struct Region<'a, 'j> {
        job: &'a Job<'j>,
        team: &'a Team,
    }

    /// One team thread's part: [`Job::work`] when the team has the run's thread count (every
    /// thread sees the same count), else the whole run on thread 0 (a nested region of one).
    extern "C" fn body(data: *mut c_void) {
        // SAFETY: `data` is the `Region` that `Team::run` keeps alive until `GOMP_parallel`
        // returns, which is after every thread of the team has left this function.
        let region = unsafe { &*(data as *const Region) };
        // SAFETY: OpenMP queries, valid inside a parallel region.
        let (t, n) = unsafe { ((region.team.thread_num)(), (region.team.num_threads)()) };
        let (t, n) = (usize::try_from(t).unwrap_or(0), usize::try_from(n).unwrap_or(0));
        if n == region.job.threads {
            region.job.work(t);
        } else if t == 0 {
            region.job.work_alone();
        }
    }

    impl Team {
        /// Runs `job` on a team of `job.threads` threads.
        pub(super) fn run(&self, job: &Job) {
            let region = Region { job, team: self };
            let threads = c_uint::try_from(job.threads).unwrap_or(c_uint::MAX);
            // SAFETY: `body` reads `region` only during the call, which waits for the team.
            unsafe { (self.parallel)(body, &region as *const Region as *mut c_void, threads, 0) };
        }
    }
}
