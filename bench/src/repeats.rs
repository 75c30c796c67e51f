//! `--repeat N`: a workload's lines run N rounds, interleaved (every line once, then every line
//! again), so that a drift of the machine during the benchmark falls on every line alike; then
//! each line's spread over its runs, and each round's router CPU against the load-only line of
//! the same round. Tails at high load and router CPU move between runs of the same line by more
//! than many of the differences the benchmark is asked about: one run of each says little.

use serde::{Deserialize, Serialize};

use crate::summary::RunSummary;

/// The label of `label`'s run in round `round` (1-based): the first round keeps the plain label,
/// so every check and table that looks a line up by name reads the first round.
pub fn run_label(label: &str, round: u32) -> String {
    if round <= 1 {
        label.to_string()
    } else {
        format!("{label} (run {round})")
    }
}

/// Smallest, median and largest of a line's values over its runs.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Spread {
    pub min: f64,
    pub median: f64,
    pub max: f64,
}

impl Spread {
    /// Of `values` (`None` when there are none; NaNs are left out).
    pub fn of(values: impl IntoIterator<Item = f64>) -> Option<Self> {
        let mut v: Vec<f64> = values.into_iter().filter(|x| !x.is_nan()).collect();
        if v.is_empty() {
            return None;
        }
        v.sort_by(f64::total_cmp);
        Some(Self {
            min: v[0],
            median: crate::stats::percentile(&v, 50.0)?,
            max: v[v.len() - 1],
        })
    }
}

/// One line's numbers over its runs of one workload.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LineSpread {
    /// The line's label (its first round's).
    pub policy: String,
    /// The load point and fleet of its runs.
    pub load: String,
    pub replicas: usize,
    pub gpu_blocks: usize,
    /// Runs found (failed runs are left out).
    pub runs: usize,
    pub hit_rate: Option<Spread>,
    pub ttft_p50_ms: Option<Spread>,
    pub ttft_p90_ms: Option<Spread>,
    pub ttft_p99_ms: Option<Spread>,
    pub router_cpu_s_per_1k: Option<Spread>,
    /// The line this one's router CPU is compared with, round by round (the first load-only
    /// line), and the ratio in each round where both ran.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu_baseline: Option<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub cpu_ratio_by_round: Vec<f64>,
}

/// The spreads of `labels` (first-round labels, in order) over `rounds` rounds of `runs` (the
/// workload's runs at one load and fleet; other runs are ignored), router CPU compared with
/// `baseline`'s in each round.
pub fn spreads(
    runs: &[RunSummary],
    labels: &[String],
    rounds: u32,
    baseline: Option<&str>,
) -> Vec<LineSpread> {
    let run_of = |label: &str, round: u32| {
        let name = run_label(label, round);
        runs.iter()
            .find(|r| r.policy == name && r.first_error.is_none())
    };
    let cpu = |r: &RunSummary| r.router_cost.as_ref().map(|c| c.cpu_s_per_1k);
    labels
        .iter()
        .map(|label| {
            let of_line: Vec<&RunSummary> = (1..=rounds).filter_map(|k| run_of(label, k)).collect();
            let ratio_by_round: Vec<f64> = match baseline {
                Some(b) if b != label => (1..=rounds)
                    .filter_map(|k| {
                        let mine = cpu(run_of(label, k)?)?;
                        let base = cpu(run_of(b, k)?)?;
                        (base > 0.0).then(|| mine / base)
                    })
                    .collect(),
                _ => Vec::new(),
            };
            let at = of_line.first();
            LineSpread {
                policy: label.clone(),
                load: at.map(|r| r.load.clone()).unwrap_or_default(),
                replicas: at.map_or(0, |r| r.replicas),
                gpu_blocks: at.map_or(0, |r| r.gpu_blocks),
                runs: of_line.len(),
                hit_rate: Spread::of(of_line.iter().map(|r| r.hit_rate)),
                ttft_p50_ms: Spread::of(of_line.iter().filter_map(|r| r.ttft_p50_ms)),
                ttft_p90_ms: Spread::of(of_line.iter().filter_map(|r| r.ttft_p90_ms)),
                ttft_p99_ms: Spread::of(of_line.iter().filter_map(|r| r.ttft_p99_ms)),
                router_cpu_s_per_1k: Spread::of(of_line.iter().filter_map(|r| cpu(r))),
                cpu_baseline: (!ratio_by_round.is_empty())
                    .then(|| baseline.unwrap_or_default().to_string()),
                cpu_ratio_by_round: ratio_by_round,
            }
        })
        .collect()
}

/// `median [min-max]` with `digits` decimals, times `scale`.
fn show(s: Option<Spread>, scale: f64, digits: usize) -> String {
    match s {
        Some(s) => format!(
            "{:.d$} [{:.d$}-{:.d$}]",
            s.median * scale,
            s.min * scale,
            s.max * scale,
            d = digits
        ),
        None => "-".to_string(),
    }
}

/// Prints the spreads under a workload's runs.
pub fn print(spreads: &[LineSpread], rounds: u32) {
    println!("    spread over {rounds} interleaved runs, median [min-max]:");
    for s in spreads {
        println!(
            "    {:<14} runs {}  hit {} %  TTFT p50 {} p90 {} p99 {} ms  router CPU {} s per 1k",
            s.policy,
            s.runs,
            show(s.hit_rate, 100.0, 1),
            show(s.ttft_p50_ms, 1.0, 0),
            show(s.ttft_p90_ms, 1.0, 0),
            show(s.ttft_p99_ms, 1.0, 0),
            show(s.router_cpu_s_per_1k, 1.0, 2),
        );
        if let (Some(b), Some(r)) = (
            &s.cpu_baseline,
            Spread::of(s.cpu_ratio_by_round.iter().copied()),
        ) {
            let each: Vec<String> = s
                .cpu_ratio_by_round
                .iter()
                .map(|x| format!("{x:.2}x"))
                .collect();
            println!(
                "    {:<14} router CPU / {b}'s, run by run: {} (median {:.2}x)",
                s.policy,
                each.join(", "),
                r.median
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::router_usage::RouterCost;

    fn run(policy: &str, hit: f64, p90: f64, cpu: f64) -> RunSummary {
        let mut r = crate::report::tests::run(policy, "6", 6.0, hit, p90);
        r.router_cost = Some(RouterCost {
            cpu_s_per_1k: cpu,
            cpu_s_per_1k_by_process: Default::default(),
            peak_rss_mb: 100.0,
        });
        r
    }

    #[test]
    fn the_first_round_keeps_the_plain_label() {
        assert_eq!(run_label("kv", 1), "kv");
        assert_eq!(run_label("kv", 3), "kv (run 3)");
    }

    #[test]
    fn medians_of_odd_and_even_counts() {
        let s = Spread::of([3.0, 1.0, 2.0]).expect("spread");
        assert_eq!((s.min, s.median, s.max), (1.0, 2.0, 3.0));
        let s = Spread::of([4.0, 1.0, 2.0, 3.0, f64::NAN]).expect("spread");
        assert_eq!((s.min, s.median, s.max), (1.0, 2.5, 4.0));
        assert!(Spread::of([]).is_none());
    }

    #[test]
    fn cpu_is_compared_round_by_round_and_failed_runs_are_left_out() {
        let mut failed = run("kv (run 3)", 0.0, 0.0, 99.0);
        failed.first_error = Some("boom".into());
        let runs = vec![
            run("kv", 0.9, 140.0, 12.0),
            run("round-robin", 0.5, 900.0, 10.0),
            run("kv (run 2)", 0.8, 150.0, 11.0),
            run("round-robin (run 2)", 0.5, 950.0, 11.0),
            failed,
            run("round-robin (run 3)", 0.5, 1000.0, 9.0),
        ];
        let labels = vec!["kv".to_string(), "round-robin".to_string()];
        let s = spreads(&runs, &labels, 3, Some("round-robin"));
        assert_eq!(s[0].runs, 2);
        assert_eq!((s[0].load.as_str(), s[0].replicas), ("6", 4));
        assert_eq!(s[0].cpu_ratio_by_round, vec![1.2, 1.0]);
        assert_eq!(s[0].cpu_baseline.as_deref(), Some("round-robin"));
        let p90 = s[0].ttft_p90_ms.expect("p90");
        assert_eq!((p90.min, p90.median, p90.max), (140.0, 145.0, 150.0));
        assert_eq!(s[1].runs, 3);
        assert!(s[1].cpu_ratio_by_round.is_empty(), "no ratio to itself");
        assert_eq!(s[1].cpu_baseline, None);
    }
}
