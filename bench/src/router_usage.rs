//! CPU time and peak memory of a router's processes ([`RouterCost`] of a run), read from `/proc`: every process whose
//! process group is one of the router's (each supervised child leads its own group, so a
//! router's worker processes and threads are counted with it).

use std::collections::BTreeMap;
use std::fs;

/// CPU and memory of a set of process groups at one moment.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Usage {
    /// utime + stime of every live process in the groups, seconds.
    pub cpu_s: f64,
    /// The same by command name (`envoy`, `kvroute-indexer`), seconds.
    pub cpu_s_by_process: BTreeMap<String, f64>,
    /// Sum of the processes' `VmHWM` (each one's peak resident set), MB.
    pub peak_rss_mb: f64,
    /// Processes counted.
    pub processes: usize,
}

/// Router cost of one run: CPU seconds per 1,000 requests and peak memory.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct RouterCost {
    /// Router CPU seconds (user + system) per 1,000 requests sent.
    pub cpu_s_per_1k: f64,
    /// The same by command name (`envoy`, `kvroute-indexer`).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub cpu_s_per_1k_by_process: BTreeMap<String, f64>,
    /// Peak resident memory of the router's processes (sum of VmHWM), MB.
    pub peak_rss_mb: f64,
}

impl RouterCost {
    /// From usage samples taken before and after `requests` requests.
    pub fn between(before: &Usage, after: &Usage, requests: usize) -> Self {
        let per_1k = |cpu: f64| {
            if requests == 0 {
                0.0
            } else {
                cpu.max(0.0) * 1000.0 / requests as f64
            }
        };
        Self {
            cpu_s_per_1k: per_1k(after.cpu_s - before.cpu_s),
            cpu_s_per_1k_by_process: after
                .cpu_s_by_process
                .iter()
                .map(|(name, cpu)| {
                    let was = before.cpu_s_by_process.get(name).copied().unwrap_or(0.0);
                    (name.clone(), per_1k(cpu - was))
                })
                .collect(),
            peak_rss_mb: after.peak_rss_mb,
        }
    }

    /// `envoy 9.1, kvroute-indexer 1.8` (CPU s per 1k by process), empty when not split.
    pub fn split(&self) -> String {
        self.cpu_s_per_1k_by_process
            .iter()
            .map(|(name, cpu)| format!("{name} {cpu:.2}"))
            .collect::<Vec<_>>()
            .join(", ")
    }
}

/// Samples every process in `groups` (process group ids).
pub fn sample(groups: &[u32]) -> Usage {
    let ticks = clock_ticks();
    let mut usage = Usage::default();
    let Ok(entries) = fs::read_dir("/proc") else {
        return usage;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(pid) = name.to_str().and_then(|n| n.parse::<u32>().ok()) else {
            continue;
        };
        let Ok(stat) = fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        let Some(fields) = parse_stat(&stat) else {
            continue;
        };
        if !groups.contains(&fields.pgrp) {
            continue;
        }
        usage.processes += 1;
        let cpu = (fields.utime + fields.stime) as f64 / ticks;
        usage.cpu_s += cpu;
        *usage
            .cpu_s_by_process
            .entry(command_name(&stat).to_string())
            .or_default() += cpu;
        if let Ok(status) = fs::read_to_string(format!("/proc/{pid}/status")) {
            usage.peak_rss_mb += status_kb(&status, "VmHWM:") as f64 / 1024.0;
        }
    }
    usage
}

/// The fields of `/proc/<pid>/stat` we use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct StatFields {
    pgrp: u32,
    utime: u64,
    stime: u64,
}

/// Parses `/proc/<pid>/stat` (the command name may hold spaces and parentheses: fields are
/// counted from the last `)`).
fn parse_stat(stat: &str) -> Option<StatFields> {
    let rest = &stat[stat.rfind(')')? + 1..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // After the name: state(3) ppid(4) pgrp(5) ... utime(14) stime(15), 1-based as in proc(5).
    Some(StatFields {
        pgrp: fields.get(2)?.parse().ok()?,
        utime: fields.get(11)?.parse().ok()?,
        stime: fields.get(12)?.parse().ok()?,
    })
}

/// The command name of a `/proc/<pid>/stat` line (between the first `(` and the last `)`).
fn command_name(stat: &str) -> &str {
    match (stat.find('('), stat.rfind(')')) {
        (Some(a), Some(b)) if a < b => &stat[a + 1..b],
        _ => "?",
    }
}

fn status_kb(status: &str, key: &str) -> u64 {
    status
        .lines()
        .find_map(|l| l.strip_prefix(key))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

fn clock_ticks() -> f64 {
    // SAFETY: sysconf only reads a configuration value.
    let t = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if t > 0 {
        t as f64
    } else {
        100.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_fields_survive_odd_command_names() {
        let line =
            "1234 (we ird) (name)) S 1 1200 1200 0 -1 4194560 100 0 0 0 250 75 0 0 20 0 4 0 1 0 0";
        assert_eq!(
            parse_stat(line),
            Some(StatFields {
                pgrp: 1200,
                utime: 250,
                stime: 75
            })
        );
        assert_eq!(parse_stat("garbage"), None);
        assert_eq!(command_name(line), "we ird) (name)");
        assert_eq!(command_name("garbage"), "?");
    }

    #[test]
    fn this_process_group_is_sampled() {
        // SAFETY: getpgrp has no preconditions.
        let own = unsafe { libc::getpgrp() } as u32;
        // Burn a little CPU so the reading is non-zero.
        let mut x = 0u64;
        for i in 0..20_000_000u64 {
            x = x.wrapping_mul(31).wrapping_add(i);
        }
        assert!(x != 1);
        let u = sample(&[own]);
        assert!(u.processes >= 1);
        assert!(u.cpu_s > 0.0);
        assert!(u.peak_rss_mb > 0.0);
        let named: f64 = u.cpu_s_by_process.values().sum();
        assert!((named - u.cpu_s).abs() < 1e-9, "{:?}", u.cpu_s_by_process);
        assert_eq!(sample(&[u32::MAX]).processes, 0);
    }
}
