//! What the chaos scenarios read off the running stack: process memory, signals, the indexer's
//! and the replicas' Prometheus text, Envoy's stats.

use std::fs;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

use crate::stats::metric_sum;

/// Resident memory of a process: now and its peak (`VmRSS`, `VmHWM` of `/proc/<pid>/status`), MiB.
#[derive(Debug, Clone, Copy, Default)]
pub struct Memory {
    /// Resident now.
    pub rss_mib: f64,
    /// Peak resident since the process started.
    pub peak_mib: f64,
}

/// The memory of `pid`; zeros when the process is gone.
pub fn memory(pid: u32) -> Memory {
    let Ok(status) = fs::read_to_string(format!("/proc/{pid}/status")) else {
        return Memory::default();
    };
    let field = |name: &str| -> f64 {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|rest| rest.split_whitespace().next())
            .and_then(|kb| kb.parse::<f64>().ok())
            .map_or(0.0, |kb| kb / 1024.0)
    };
    Memory {
        rss_mib: field("VmRSS:"),
        peak_mib: field("VmHWM:"),
    }
}

/// The summed memory of several processes.
pub fn memory_of(pids: &[u32]) -> Memory {
    pids.iter()
        .map(|&p| memory(p))
        .fold(Memory::default(), |a, m| Memory {
            rss_mib: a.rss_mib + m.rss_mib,
            peak_mib: a.peak_mib + m.peak_mib,
        })
}

/// Sends `signal` to the process group `pgid` (every child of the stack leads its own group).
pub fn signal_group(pgid: u32, signal: i32) -> Result<()> {
    let pgid = i32::try_from(pgid).context("pid out of range")?;
    // SAFETY: kill(2) with a negative pid signals a process group; no memory is shared.
    let rc = unsafe { libc::kill(-pgid, signal) };
    if rc != 0 {
        bail!(
            "kill(-{pgid}, {signal}) failed: {}",
            std::io::Error::last_os_error()
        );
    }
    Ok(())
}

pub use kvroute_testkit::prom::{metrics_text, value_with_label as metric_with_label};

/// Requests the indexer counts in flight, over every replica.
pub fn indexer_in_flight(indexer: &str) -> Result<f64> {
    Ok(metric_sum(
        &metrics_text(indexer)?,
        "kvroute_indexer_replica_in_flight",
    ))
}

/// Polls `probe` every 100 ms until it returns true or `limit` passes; returns how long it took.
pub fn wait_for(limit: Duration, mut probe: impl FnMut() -> bool) -> Option<Duration> {
    let started = Instant::now();
    loop {
        if probe() {
            return Some(started.elapsed());
        }
        if started.elapsed() >= limit || crate::supervisor::interrupted() {
            return None;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

pub use kvroute_testkit::stack::envoy_stats;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labelled_samples_are_found_by_label() {
        let text = "# HELP x y\nm{replica=\"r0\",model=\"q\"} 3\nm{replica=\"r1\",model=\"q\"} 5\n";
        assert_eq!(metric_with_label(text, "m", "replica=\"r1\""), Some(5.0));
        assert_eq!(metric_with_label(text, "m", "replica=\"r2\""), None);
        assert_eq!(metric_with_label(text, "n", "replica=\"r0\""), None);
    }

    #[test]
    fn memory_of_this_process_is_read() {
        let m = memory(std::process::id());
        assert!(m.rss_mib > 0.0 && m.peak_mib >= m.rss_mib);
        assert_eq!(memory(u32::MAX).rss_mib, 0.0);
    }
}
