//! How the indexer's threads ask the kernel to share the CPU: the route path first, event intake
//! after it (`[scheduling]`, docs/performance.md "Fleet scale in one indexer").
//!
//! A route decision is on every request's critical path and takes ~0.1-0.3 ms; event intake,
//! scrapes and snapshots are throughput work whose latency nobody sees. On a busy host the
//! kernel's default slice (0.7 ms x (1 + log2 CPUs) under EEVDF) lets a woken API thread wait
//! behind event workers and other processes for a millisecond or more. Two per-thread requests,
//! both open to an unprivileged process (the third measure, an event thread yielding its CPU
//! after a batch once it has run `scheduling.event_yield_after_us` since it woke, is
//! [`yield_if_awake_for`], called by the subscriber):
//!
//! * the API runtime's threads ask for a short slice (`sched_attr.sched_runtime` of a
//!   `SCHED_OTHER` thread, Linux 6.12+): a task with a shorter slice gets an earlier deadline and
//!   preempts on wake-up, with the same CPU share as before;
//! * the event runtime's threads run `SCHED_BATCH`: the kernel treats them as CPU-bound and does
//!   not let their wake-ups preempt other tasks.
//!
//! Each request keeps the thread's nice value. Elsewhere than Linux, or when the kernel refuses
//! (an older kernel ignores the slice; a seccomp profile may refuse the call), the thread runs with
//! the kernel's defaults: nothing else depends on it.
//!
//! Apart from the kernel, the event streams wake the indexer less often: they run on a thread of
//! their own that pauses before it waits for its sockets ([`coalescing_runtime`]), so one wake-up
//! reads what every replica published during the pause.

use std::cell::Cell;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Why a thread's scheduling request was not applied.
#[derive(Debug, thiserror::Error)]
pub enum SchedError {
    /// The kernel refused `sched_getattr` / `sched_setattr`.
    #[error("{call}: {source}")]
    Syscall {
        call: &'static str,
        source: std::io::Error,
    },
    /// Not Linux.
    #[error("per-thread scheduling attributes are Linux-only")]
    Unsupported,
}

/// What a thread asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ThreadClass {
    /// A short slice: wakes ahead of CPU-bound work (the HTTP API).
    Latency(Duration),
    /// `SCHED_BATCH`: never preempts others on wake-up (event intake, scrapes, snapshots).
    Batch,
}

/// The slices the kernel accepts, in microseconds (`kernel/sched/syscalls.c`: 0.1 ms ..= 100 ms).
pub const SLICE_RANGE_US: std::ops::RangeInclusive<u64> = 100..=100_000;

/// Has every thread `builder` starts ask for `class` (`what` names the runtime in the log);
/// nothing when `class` is `None`.
pub fn on_thread_start(
    builder: &mut tokio::runtime::Builder,
    class: Option<ThreadClass>,
    what: &'static str,
) {
    if let Some(class) = class {
        builder.on_thread_start(move || apply_or_log(class, what));
    }
}

thread_local! {
    /// When this thread last woke (its runtime's unpark hook) or last yielded.
    static AWAKE_SINCE: Cell<Option<Instant>> = const { Cell::new(None) };
}

/// Notes that the calling thread woke now.
pub fn note_woke() {
    AWAKE_SINCE.with(|t| t.set(Some(Instant::now())));
}

/// Yields the calling thread's CPU (`sched_yield`) when it has run at least `after` since it last
/// woke or yielded, and returns whether it did. A thread whose runtime has no wake hook counts
/// from its first call.
pub fn yield_if_awake_for(after: Duration) -> bool {
    let now = Instant::now();
    let Some(since) = AWAKE_SINCE.with(Cell::get) else {
        AWAKE_SINCE.with(|t| t.set(Some(now)));
        return false;
    };
    if now.duration_since(since) < after {
        return false;
    }
    std::thread::yield_now();
    note_woke();
    true
}

/// The event streams' runtime (`scheduling.event_coalesce_ms`): one worker thread
/// (`kvroute-events`, scheduled as `class` asks) that sleeps `pause` each time it runs out of work,
/// before it waits for its sockets. What every stream sent during the pause is read in the next
/// wake-up: the thread wakes at most once per `pause` however many streams send, instead of once
/// per batch (one batch per engine step and replica).
pub fn coalescing_runtime(
    class: Option<ThreadClass>,
    pause: Duration,
) -> std::io::Result<tokio::runtime::Runtime> {
    let mut builder = tokio::runtime::Builder::new_multi_thread();
    builder.worker_threads(1).thread_name("kvroute-events");
    on_thread_start(&mut builder, class, "event streams");
    builder.on_thread_unpark(|| {
        note_woke();
        EVENT_WAKEUPS.fetch_add(1, Ordering::Relaxed);
    });
    builder.on_thread_park(move || std::thread::sleep(pause));
    builder.enable_all().build()
}

/// Wake-ups of the event streams' paused thread ([`coalescing_runtime`]) in this process.
static EVENT_WAKEUPS: AtomicU64 = AtomicU64::new(0);

/// How many times the event streams' paused thread has woken (0 without one): against the event
/// batches applied, how many batches each wake-up read.
pub fn event_wakeups() -> u64 {
    EVENT_WAKEUPS.load(Ordering::Relaxed)
}

/// Applies `class` to the calling thread.
pub fn apply_to_current_thread(class: ThreadClass) -> Result<(), SchedError> {
    imp::apply(class)
}

/// Applies `class` to the calling thread, logging a refusal once per process (`what` names the
/// runtime in the log) and then at debug level.
pub fn apply_or_log(class: ThreadClass, what: &str) {
    static WARNED: AtomicBool = AtomicBool::new(false);
    match apply_to_current_thread(class) {
        Ok(()) => tracing::debug!(runtime = what, ?class, "thread scheduling applied"),
        Err(e) if !WARNED.swap(true, Ordering::Relaxed) => {
            tracing::warn!(runtime = what, ?class, error = %e, "thread scheduling not applied; running with the kernel's defaults")
        }
        Err(e) => {
            tracing::debug!(runtime = what, ?class, error = %e, "thread scheduling not applied")
        }
    }
}

#[cfg(target_os = "linux")]
mod imp {
    use super::{SchedError, ThreadClass, SLICE_RANGE_US};

    fn attr_size() -> u32 {
        std::mem::size_of::<libc::sched_attr>() as u32
    }

    /// The calling thread's attributes.
    pub(super) fn current() -> Result<libc::sched_attr, SchedError> {
        // SAFETY: an all-zero `sched_attr` is a valid value of this plain C struct.
        let mut attr: libc::sched_attr = unsafe { std::mem::zeroed() };
        // SAFETY: pid 0 is the calling thread; the buffer is a `sched_attr` of the size passed.
        let rc = unsafe {
            libc::syscall(
                libc::SYS_sched_getattr,
                0,
                &mut attr as *mut libc::sched_attr,
                attr_size(),
                0,
            )
        };
        if rc != 0 {
            return Err(SchedError::Syscall {
                call: "sched_getattr",
                source: std::io::Error::last_os_error(),
            });
        }
        Ok(attr)
    }

    pub(super) fn apply(class: ThreadClass) -> Result<(), SchedError> {
        let mut attr = current()?;
        attr.size = attr_size();
        attr.sched_flags = 0;
        match class {
            ThreadClass::Latency(slice) => {
                // Only a fair-class thread has a slice; a real-time one is left as it is.
                if attr.sched_policy != libc::SCHED_OTHER as u32
                    && attr.sched_policy != libc::SCHED_BATCH as u32
                {
                    return Ok(());
                }
                attr.sched_policy = libc::SCHED_OTHER as u32;
                attr.sched_runtime = (slice.as_nanos() as u64)
                    .clamp(SLICE_RANGE_US.start() * 1000, SLICE_RANGE_US.end() * 1000);
            }
            ThreadClass::Batch => {
                if attr.sched_policy != libc::SCHED_OTHER as u32 {
                    return Ok(());
                }
                attr.sched_policy = libc::SCHED_BATCH as u32;
            }
        }
        // SAFETY: pid 0 is the calling thread; `attr` is a filled `sched_attr` whose `size` field
        // is its own size.
        let rc = unsafe {
            libc::syscall(
                libc::SYS_sched_setattr,
                0,
                &attr as *const libc::sched_attr,
                0,
            )
        };
        if rc != 0 {
            return Err(SchedError::Syscall {
                call: "sched_setattr",
                source: std::io::Error::last_os_error(),
            });
        }
        Ok(())
    }
}

#[cfg(not(target_os = "linux"))]
mod imp {
    use super::{SchedError, ThreadClass};

    pub(super) fn apply(_: ThreadClass) -> Result<(), SchedError> {
        Err(SchedError::Unsupported)
    }
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use super::*;

    /// Runs `f` on a fresh thread, so the test runner's threads keep their attributes.
    fn on_thread<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
        std::thread::spawn(f).join().expect("test thread")
    }

    #[test]
    fn a_latency_thread_gets_the_slice_it_asked_for_and_keeps_its_nice_value() {
        let (before, after) = on_thread(|| {
            // SAFETY: setpriority on the calling thread (tid) only lowers its priority.
            let tid = unsafe { libc::syscall(libc::SYS_gettid) } as libc::id_t;
            let rc = unsafe { libc::setpriority(libc::PRIO_PROCESS, tid, 3) };
            assert_eq!(rc, 0, "setpriority");
            let before = imp::current().expect("getattr");
            apply_to_current_thread(ThreadClass::Latency(Duration::from_micros(250)))
                .expect("setattr");
            (before, imp::current().expect("getattr"))
        });
        assert_eq!(before.sched_nice, 3);
        assert_eq!(after.sched_nice, 3, "the nice value is kept");
        assert_eq!(after.sched_policy, libc::SCHED_OTHER as u32);
        // Kernels before 6.12 accept the call and report no slice; 6.12+ report the request.
        assert!(
            after.sched_runtime == 250_000 || after.sched_runtime == before.sched_runtime,
            "slice {} ns",
            after.sched_runtime
        );
    }

    #[test]
    fn a_slice_below_the_kernels_minimum_is_raised_to_it() {
        let after = on_thread(|| {
            apply_to_current_thread(ThreadClass::Latency(Duration::from_micros(1)))
                .expect("setattr");
            imp::current().expect("getattr")
        });
        assert!(
            after.sched_runtime == 100_000 || after.sched_runtime == 0,
            "slice {} ns",
            after.sched_runtime
        );
    }

    #[test]
    fn a_thread_yields_only_once_it_has_run_long_enough_since_it_woke() {
        let (short, long, again) = on_thread(|| {
            note_woke();
            let short = yield_if_awake_for(Duration::from_secs(60));
            let long = yield_if_awake_for(Duration::ZERO);
            // The yield counts as a wake-up: the next burst starts from it.
            let again = yield_if_awake_for(Duration::from_secs(60));
            (short, long, again)
        });
        assert!(
            !short,
            "a thread awake for less than the budget keeps its CPU"
        );
        assert!(long, "a thread past the budget yields");
        assert!(!again, "the budget starts again after a yield");
    }

    #[test]
    fn a_batch_thread_is_sched_batch_and_keeps_its_nice_value() {
        let after = on_thread(|| {
            // SAFETY: as above.
            let tid = unsafe { libc::syscall(libc::SYS_gettid) } as libc::id_t;
            let rc = unsafe { libc::setpriority(libc::PRIO_PROCESS, tid, 5) };
            assert_eq!(rc, 0, "setpriority");
            apply_to_current_thread(ThreadClass::Batch).expect("setattr");
            imp::current().expect("getattr")
        });
        assert_eq!(after.sched_policy, libc::SCHED_BATCH as u32);
        assert_eq!(after.sched_nice, 5);
        // Only that thread changed.
        let here = imp::current().expect("getattr");
        assert_eq!(here.sched_policy, libc::SCHED_OTHER as u32);
    }
}

#[cfg(test)]
mod coalescing_tests {
    use super::*;

    #[test]
    fn a_coalescing_runtime_drains_its_inputs_at_most_once_per_pause() {
        let pause = Duration::from_millis(40);
        let rt = coalescing_runtime(None, pause).expect("runtime");
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<u32>();
        let (done_tx, done_rx) = std::sync::mpsc::channel();
        rt.spawn(async move {
            use futures::FutureExt;
            let (mut drains, mut received) = (0u32, 0u32);
            while received < 30 {
                // A drain starts when the task had to wait (its thread may then have parked).
                let next = match rx.recv().now_or_never() {
                    Some(next) => next,
                    None => {
                        drains += 1;
                        rx.recv().await
                    }
                };
                if next.is_none() {
                    break;
                }
                received += 1;
                while rx.try_recv().is_ok() {
                    received += 1;
                }
            }
            let _ = done_tx.send((drains, Instant::now()));
        });
        let start = Instant::now();
        for i in 0..30 {
            tx.send(i).expect("send");
            std::thread::sleep(Duration::from_millis(5));
        }
        let (drains, end) = done_rx
            .recv_timeout(Duration::from_secs(30))
            .expect("all 30 received");
        assert!(event_wakeups() >= 1, "the thread's wake-ups are counted");
        let elapsed = end.duration_since(start);
        // Each drain is followed by a pause before the next one can start (2 more for a message
        // landing between the task's wait and its thread's park).
        let bound = (elapsed.as_secs_f64() / pause.as_secs_f64()).floor() as u32 + 3;
        assert!(
            drains <= bound,
            "{drains} drains in {elapsed:?}: at most {bound} with a {pause:?} pause"
        );
        assert!(drains < 30, "30 messages 5 ms apart were not coalesced");
        rt.shutdown_background();
    }
}
