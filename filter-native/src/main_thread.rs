//! The way from any thread to a filter configuration's main thread: Envoy's configuration
//! scheduler, plus a module-owned ticker thread that posts a tick every [`TICK`].
//!
//! Why a thread: the dynamic-module ABI (v0.2.0) has a scheduler usable from configuration scope
//! (`http_filter_config_scheduler_{new,commit,delete}`, events delivered on the main thread) but
//! no timer. The tokenizer fetches and their retries with backoff ([`Plugin::on_tick`]) must run
//! whether or not requests arrive (the tokenizer is fetched at start, as in the Wasm build), so a
//! small thread sleeps [`TICK`] and commits a tick event; the work itself (callouts) runs on the
//! main thread, where configuration-scope callouts belong. The thread holds no Envoy pointer but
//! the scheduler, and [`MainThread::shutdown`] stops and joins it before the scheduler is deleted.
//!
//! [`Plugin::on_tick`]: kvroute_filter::plugin::Plugin::on_tick
//! [`TICK`]: kvroute_filter::plugin::TICK

use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Duration;

use crate::envoy::Scheduler;

/// Scheduler event: run [`kvroute_filter::plugin::Plugin::on_tick`].
pub const EVENT_TICK: u64 = 1;
/// Scheduler event: dispatch the queued detached callouts.
pub const EVENT_FLUSH: u64 = 2;

/// A configuration's scheduler and its ticker.
#[derive(Debug)]
pub struct MainThread {
    /// `None` once shut down: nothing is posted any more.
    scheduler: Mutex<Option<Scheduler>>,
    stop: Condvar,
    ticker: Mutex<Option<JoinHandle<()>>>,
}

impl MainThread {
    /// Takes the scheduler and starts the ticker (one tick posted at once, then every `tick`).
    pub fn start(scheduler: Scheduler, tick: Duration) -> Arc<Self> {
        scheduler.commit(EVENT_TICK);
        let this = Arc::new(Self {
            scheduler: Mutex::new(Some(scheduler)),
            stop: Condvar::new(),
            ticker: Mutex::new(None),
        });
        let ticker = Arc::clone(&this);
        let spawned = std::thread::Builder::new()
            .name("kvroute-tick".into())
            .spawn(move || ticker.run_ticker(tick));
        match spawned {
            Ok(handle) => *lock(&this.ticker) = Some(handle),
            Err(e) => crate::envoy::log_error(&format!(
                "kvroute: cannot start the tick thread ({e}); tokenizer fetches are tried once"
            )),
        }
        this
    }

    fn run_ticker(&self, tick: Duration) {
        let mut slot = lock(&self.scheduler);
        loop {
            slot = self
                .stop
                .wait_timeout(slot, tick)
                .map(|(guard, _)| guard)
                .unwrap_or_else(|e| e.into_inner().0);
            match slot.as_ref() {
                Some(scheduler) => scheduler.commit(EVENT_TICK),
                None => return,
            }
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
        self.stop.notify_all();
        if let Some(handle) = lock(&self.ticker).take() {
            let _ = handle.join();
        }
        drop(scheduler);
    }
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|e| e.into_inner())
}
