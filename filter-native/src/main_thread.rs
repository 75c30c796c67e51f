//! The way from any thread to a filter configuration's main thread: Envoy's configuration
//! scheduler, plus a module-owned ticker thread that posts a tick when the plugin has work due.
//!
//! Why a thread: the dynamic-module ABI (v0.2.0) has a scheduler usable from configuration scope
//! (`http_filter_config_scheduler_{new,commit,delete}`, events delivered on the main thread) but
//! no timer. The tokenizer fetches and their retries with backoff, and the completion reports held
//! past their hold ([`Plugin::on_tick`]), must run whether or not requests arrive, so a small
//! thread waits until the plugin's next work is due ([`Plugin::next_tick_ms`]) and commits a tick
//! event; the work itself (callouts) runs on the main thread, where configuration-scope callouts
//! belong. Whoever adds work due sooner than the ticker's wake-up wakes it ([`MainThread::wake`]);
//! with nothing pending it sleeps [`IDLE_TICK`] at a time, and it never posts ticks closer than
//! [`TICK`] apart. An idle gateway's main thread is not woken 20 times a second for nothing.
//! The thread holds no Envoy pointer but the scheduler, and [`MainThread::shutdown`] stops and
//! joins it before the scheduler is deleted.
//!
//! [`Plugin::on_tick`]: kvroute_filter::plugin::Plugin::on_tick
//! [`Plugin::next_tick_ms`]: kvroute_filter::plugin::Plugin::next_tick_ms
//! [`TICK`]: kvroute_filter::plugin::TICK
//! [`IDLE_TICK`]: kvroute_filter::tick_plan::IDLE_TICK

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Duration;

use crate::config_host::now_nanos;
use crate::envoy::Scheduler;

/// Where events go: Envoy's configuration scheduler (a recorder in tests).
pub trait Post: Send + Sync + 'static {
    /// Delivers `event` to the main thread.
    fn commit(&self, event: u64);
}

impl Post for Scheduler {
    fn commit(&self, event: u64) {
        Scheduler::commit(self, event);
    }
}

/// The host time (ms) from which the plugin has work for a tick, `None` while nothing is pending.
pub type NextDue = Box<dyn Fn() -> Option<u64> + Send>;

/// Scheduler event: run [`kvroute_filter::plugin::Plugin::on_tick`].
pub const EVENT_TICK: u64 = 1;
/// Scheduler event: dispatch the queued detached callouts.
pub const EVENT_FLUSH: u64 = 2;

/// A configuration's scheduler and its ticker.
#[derive(Debug)]
pub struct MainThread<S: Post = Scheduler> {
    /// `None` once shut down: nothing is posted any more.
    scheduler: Mutex<Option<S>>,
    /// Wakes the ticker: shutdown, or work due before it planned to wake.
    wake: Condvar,
    ticker: Mutex<Option<JoinHandle<()>>>,
    /// Host time (ms) the ticker sleeps until; `u64::MAX` while it is deciding (any new work
    /// wakes it then).
    sleeping_until: AtomicU64,
}

impl<S: Post> MainThread<S> {
    /// Takes the scheduler and starts the ticker: one tick posted at once, then one whenever
    /// `next_due` says work is due, at most one per `tick`; with nothing due it sleeps
    /// `idle_wait` at a time ([`IDLE_TICK`]).
    pub fn start(
        scheduler: S,
        tick: Duration,
        idle_wait: Duration,
        next_due: NextDue,
    ) -> Arc<Self> {
        scheduler.commit(EVENT_TICK);
        let this = Arc::new(Self {
            scheduler: Mutex::new(Some(scheduler)),
            wake: Condvar::new(),
            ticker: Mutex::new(None),
            sleeping_until: AtomicU64::new(u64::MAX),
        });
        let ticker = Arc::clone(&this);
        let spawned = std::thread::Builder::new()
            .name("kvroute-tick".into())
            .spawn(move || ticker.run_ticker(tick, idle_wait, &next_due));
        match spawned {
            Ok(handle) => *lock(&this.ticker) = Some(handle),
            Err(e) => crate::envoy::log_error(&format!(
                "kvroute: cannot start the tick thread ({e}); tokenizer fetches are tried once"
            )),
        }
        this
    }

    fn run_ticker(&self, tick: Duration, idle_wait: Duration, next_due: &NextDue) {
        let tick_ms = millis(tick).max(1);
        let idle_ms = millis(idle_wait).max(1);
        // The tick posted by `start`.
        let mut posted_ms = now_ms();
        let mut slot = lock(&self.scheduler);
        loop {
            let Some(scheduler) = slot.as_ref() else {
                return;
            };
            // Work added from here on wakes the ticker, even if `next_due` below misses it.
            self.sleeping_until.store(u64::MAX, Ordering::SeqCst);
            let now = now_ms();
            let wait_ms = match next_due() {
                Some(due) if due <= now => {
                    let since = now.saturating_sub(posted_ms);
                    if since >= tick_ms {
                        scheduler.commit(EVENT_TICK);
                        posted_ms = now;
                        tick_ms
                    } else {
                        tick_ms - since
                    }
                }
                Some(due) => (due - now).min(idle_ms),
                None => idle_ms,
            };
            self.sleeping_until
                .store(now.saturating_add(wait_ms), Ordering::SeqCst);
            slot = self
                .wake
                .wait_timeout(slot, Duration::from_millis(wait_ms))
                .map(|(guard, _)| guard)
                .unwrap_or_else(|e| e.into_inner().0);
        }
    }

    /// New work is due at `due_ms` (host ms): wakes the ticker if it sleeps past that.
    pub fn wake(&self, due_ms: u64) {
        if due_ms < self.sleeping_until.load(Ordering::SeqCst) {
            // Under the ticker's lock: it is either waiting (and hears this) or deciding (and
            // sees the work).
            let _slot = lock(&self.scheduler);
            self.wake.notify_all();
        }
    }

    /// Posts `event` to the main thread; false after shutdown.
    pub fn post(&self, event: u64) -> bool {
        match lock(&self.scheduler).as_ref() {
            Some(scheduler) => {
                scheduler.commit(event);
                true
            }
            None => false,
        }
    }

    /// Stops the ticker, waits for it, and deletes the scheduler. Idempotent.
    pub fn shutdown(&self) {
        let scheduler = lock(&self.scheduler).take();
        self.wake.notify_all();
        if let Some(handle) = lock(&self.ticker).take() {
            let _ = handle.join();
        }
        drop(scheduler);
    }
}

fn now_ms() -> u64 {
    now_nanos().map_or(0, |n| n / 1_000_000)
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|e| e.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;

    /// Records the time (host ms) of every tick posted.
    #[derive(Default)]
    struct Recorder(Arc<Mutex<Vec<u64>>>);

    impl Post for Recorder {
        fn commit(&self, event: u64) {
            if event == EVENT_TICK {
                lock(&self.0).push(now_ms());
            }
        }
    }

    /// A ticker under test, the ticks it posted, and its next work's due time.
    type Ticking = (
        Arc<MainThread<Recorder>>,
        Arc<Mutex<Vec<u64>>>,
        Arc<AtomicU64>,
    );

    /// A ticker over a recorder whose next work is `due` (`u64::MAX`: none), sleeping a minute
    /// when idle so that only a wake-up or a due time makes it tick within a test.
    fn ticker(tick_ms: u64) -> Ticking {
        let recorder = Recorder::default();
        let ticks = Arc::clone(&recorder.0);
        let due = Arc::new(AtomicU64::new(u64::MAX));
        let next = Arc::clone(&due);
        let main = MainThread::start(
            recorder,
            Duration::from_millis(tick_ms),
            Duration::from_secs(60),
            Box::new(move || Some(next.load(Ordering::SeqCst)).filter(|&d| d != u64::MAX)),
        );
        (main, ticks, due)
    }

    fn wait_for_ticks(ticks: &Mutex<Vec<u64>>, n: usize) -> bool {
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if lock(ticks).len() >= n {
                return true;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        false
    }

    #[test]
    fn with_nothing_due_only_the_first_tick_is_posted() {
        let (main, ticks, _) = ticker(10);
        std::thread::sleep(Duration::from_millis(300));
        assert_eq!(lock(&ticks).len(), 1, "the tick posted at start, then none");
        main.shutdown();
    }

    #[test]
    fn work_added_while_it_sleeps_wakes_the_ticker() {
        let (main, ticks, due) = ticker(10);
        std::thread::sleep(Duration::from_millis(50));
        let now = now_ms();
        due.store(now, Ordering::SeqCst);
        main.wake(now);
        assert!(
            wait_for_ticks(&ticks, 2),
            "woken, not left to its minute of idle sleep"
        );
        main.shutdown();
    }

    #[test]
    fn work_due_later_is_ticked_once_due_and_never_before() {
        let (main, ticks, due) = ticker(10);
        let at = now_ms() + 150;
        due.store(at, Ordering::SeqCst);
        // Due later than the wake-up it has planned (none): a wake-up tells it anyway.
        main.wake(at);
        assert!(wait_for_ticks(&ticks, 2), "ticked when due");
        assert!(lock(&ticks)[1] >= at, "not before the work was due");
        main.shutdown();
    }

    #[test]
    fn work_left_due_is_ticked_at_most_once_per_tick() {
        let (main, ticks, due) = ticker(40);
        let started = now_ms();
        due.store(started, Ordering::SeqCst);
        main.wake(started);
        std::thread::sleep(Duration::from_millis(400));
        main.shutdown();
        let elapsed = now_ms() - started;
        let n = lock(&ticks).len() as u64;
        assert!(n >= 2, "ticked while work was due");
        assert!(
            n <= elapsed / 40 + 2,
            "{n} ticks in {elapsed} ms: at most one per 40 ms tick"
        );
    }

    #[test]
    fn after_shutdown_nothing_is_posted() {
        let (main, ticks, due) = ticker(10);
        main.shutdown();
        let posted = lock(&ticks).len();
        due.store(now_ms(), Ordering::SeqCst);
        main.wake(now_ms());
        std::thread::sleep(Duration::from_millis(50));
        assert_eq!(lock(&ticks).len(), posted);
        assert!(!main.post(EVENT_TICK), "a shut-down thread posts nothing");
    }
}
