//! Heterogeneous fleets (`--replica-speeds`): parsing, validation, and how each replica's share
//! of the work compares with its share of the capacity.

use std::path::Path;
use std::process::Command;

use anyhow::{bail, Context, Result};
use serde::Serialize;

use crate::replica_counters::ReplicaCounters;

/// One `--replica-speeds` value: a finite factor > 0 (clap value parser).
pub fn parse_speed(s: &str) -> std::result::Result<f64, String> {
    let v: f64 = s
        .trim()
        .parse()
        .map_err(|_| format!("{s:?} is not a number"))?;
    if !(v.is_finite() && v > 0.0) {
        return Err(format!("{s:?}: a speed must be > 0"));
    }
    Ok(v)
}

/// Fails unless `speeds` is empty (every replica at speed 1) or names every replica of every
/// fleet size in `fleets`.
pub fn check_speeds(speeds: &[f64], fleets: &[usize]) -> Result<()> {
    if speeds.is_empty() {
        return Ok(());
    }
    if let Some(n) = fleets.iter().find(|&&n| n != speeds.len()) {
        bail!(
            "--replica-speeds names {} replicas but the fleet has {n} (--replicas {}): give one speed per replica",
            speeds.len(),
            fleets
                .iter()
                .map(usize::to_string)
                .collect::<Vec<_>>()
                .join(",")
        );
    }
    Ok(())
}

/// Fails unless the simulator binary takes `--speed` (its `--help` lists it).
pub fn check_sim_has_speed(sim: &Path) -> Result<()> {
    let out = Command::new(sim)
        .arg("--help")
        .output()
        .with_context(|| format!("running {} --help", sim.display()))?;
    let help = String::from_utf8_lossy(&out.stdout);
    if !help.lines().any(|l| l.trim_start().starts_with("--speed ")) {
        bail!(
            "--replica-speeds needs a kvroute-sim with --speed; {} has none (rebuild it, or drop --no-build)",
            sim.display()
        );
    }
    Ok(())
}

/// The `kvroute-sim` arguments of replica `index` (none at the default speed).
pub fn sim_args(speeds: &[f64], index: usize) -> Vec<String> {
    match speeds.get(index) {
        Some(&s) => vec!["--speed".to_string(), s.to_string()],
        None => Vec::new(),
    }
}

/// The speed of each of `replicas` replicas: `speeds` as given, 1 where it names none.
pub fn speeds_or_ones(speeds: &[f64], replicas: usize) -> Vec<f64> {
    (0..replicas)
        .map(|i| speeds.get(i).copied().unwrap_or(1.0))
        .collect()
}

/// One replica's share of a run.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ReplicaShare {
    /// Speed factor.
    pub speed: f64,
    /// speed / the fleet's total.
    pub capacity_share: f64,
    /// Its finished requests / all.
    pub request_share: f64,
    /// Its computed prompt tokens (queried minus hit) / all: the prefill work it did.
    pub prefill_share: f64,
}

/// Shares of every replica from its counter deltas (speed 1 where `speeds` is empty).
pub fn shares(speeds: &[f64], replicas: &[ReplicaCounters]) -> Vec<ReplicaShare> {
    let speed = |i: usize| speeds.get(i).copied().unwrap_or(1.0);
    let total_speed: f64 = (0..replicas.len()).map(speed).sum();
    let total_requests: f64 = replicas.iter().map(|r| r.requests).sum();
    let computed = |r: &ReplicaCounters| (r.queries - r.hits).max(0.0);
    let total_computed: f64 = replicas.iter().map(computed).sum();
    let frac = |a: f64, b: f64| if b > 0.0 { a / b } else { 0.0 };
    replicas
        .iter()
        .enumerate()
        .map(|(i, r)| ReplicaShare {
            speed: speed(i),
            capacity_share: frac(speed(i), total_speed),
            request_share: frac(r.requests, total_requests),
            prefill_share: frac(computed(r), total_computed),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn speeds_parse_and_must_match_the_fleet() {
        assert_eq!(parse_speed("0.5"), Ok(0.5));
        assert_eq!(parse_speed(" 2 "), Ok(2.0));
        for bad in ["0", "-1", "inf", "NaN", "fast", ""] {
            assert!(parse_speed(bad).is_err(), "{bad}");
        }
        assert!(check_speeds(&[], &[4, 8]).is_ok());
        assert!(check_speeds(&[1.0, 1.0, 0.5, 0.5], &[4]).is_ok());
        let err = check_speeds(&[1.0, 0.5], &[4]).expect_err("mismatch");
        assert!(err
            .to_string()
            .contains("names 2 replicas but the fleet has 4"));
        assert!(check_speeds(&[1.0; 4], &[4, 8]).is_err());
        assert_eq!(sim_args(&[1.0, 0.5], 1), ["--speed", "0.5"]);
        assert!(sim_args(&[], 1).is_empty());
    }

    #[test]
    fn shares_compare_work_with_capacity() {
        let c = |queries: f64, hits: f64, requests: f64| ReplicaCounters {
            queries,
            hits,
            requests,
            preemptions: 0.0,
        };
        let s = shares(
            &[1.0, 1.0, 0.5, 0.5],
            &[
                c(400.0, 100.0, 3.0),
                c(300.0, 0.0, 3.0),
                c(100.0, 0.0, 2.0),
                c(0.0, 0.0, 0.0),
            ],
        );
        assert_eq!(s[0].capacity_share, 1.0 / 3.0);
        assert_eq!(s[2].capacity_share, 0.5 / 3.0);
        assert_eq!(s[0].request_share, 3.0 / 8.0);
        // Computed: 300, 300, 100, 0 of 700.
        assert_eq!(s[0].prefill_share, 300.0 / 700.0);
        assert_eq!(s[3].prefill_share, 0.0);
        let even = shares(&[], &[c(1.0, 0.0, 1.0), c(1.0, 0.0, 1.0)]);
        assert_eq!(even[1].speed, 1.0);
        assert_eq!(even[1].capacity_share, 0.5);
    }
}
