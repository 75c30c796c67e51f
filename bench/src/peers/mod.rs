//! The routers people run today, as peers in the routing benchmark (issue 7): each installed
//! from PyPI into its own venv under `<cache>/peers/<name>` ([`install`]), started in front of
//! the same `kvroute-sim` replicas on 127.0.0.1 ([`launch`]), and measured with the same client
//! and the replicas' own counters; the router's CPU time and peak memory come from `/proc`
//! ([`usage`]). A peer that cannot be installed or started is reported as such, never dropped.

mod catalogue;
mod launch;
mod report;
pub mod run;
mod spec;

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use serde_json::{json, Value};

pub use catalogue::{select, PeerPolicy};
use kvroute_testkit::peer_install as install;
pub use spec::PeerEnv;

use crate::stack::Stack;

/// The peer part of one benchmark invocation: the selected lines, run after the benchmark's
/// own policies on every workload, and the Peers section written at the end.
pub struct PeerBench {
    lines: Vec<PeerPolicy>,
    cache: PathBuf,
    env: PeerEnv,
    cfg: run::PeerRunConfig,
    /// Per workload: kvroute's own summaries of the same run, then the peers'.
    results: Vec<report::WorkloadPeers>,
}

impl PeerBench {
    /// `lines` from `--peers` (empty: nothing runs).
    pub fn new(
        lines: Vec<PeerPolicy>,
        cache: PathBuf,
        env: PeerEnv,
        cfg: run::PeerRunConfig,
    ) -> Self {
        Self {
            lines,
            cache,
            env,
            cfg,
            results: Vec::new(),
        }
    }

    /// The fleet the next workloads run on (KV blocks per replica, work directory).
    pub fn set_fleet(&mut self, gpu_blocks: usize, work_dir: &Path) {
        self.env.gpu_blocks = gpu_blocks;
        self.env.work_dir = work_dir.to_path_buf();
    }

    /// Whether any peer line was selected.
    pub fn is_empty(&self) -> bool {
        self.lines.is_empty()
    }

    /// Runs every selected line on `workload` (ctx names the workload and fleet; its policy is
    /// replaced by the line's name); `ours` are the benchmark's own summaries of the same workload.
    /// Prints one line per peer through `print`.
    pub fn run_workload(
        &mut self,
        stack: &mut Stack,
        workload: &crate::workloads::Workload,
        ctx: &crate::summary::RunContext,
        ours: &[crate::summary::RunSummary],
        print: impl Fn(&crate::summary::RunSummary),
    ) -> Result<()> {
        let mut runs = Vec::new();
        for line in self.lines.clone() {
            let mut ctx = ctx.clone();
            ctx.policy = line.name.to_string();
            let run = run::run_line(
                stack,
                &line,
                workload,
                &ctx,
                &self.cfg,
                &self.cache,
                &self.env,
            )?;
            print(&run.summary);
            if let Some(c) = &run.cost {
                println!(
                    "      router CPU {:.2} s / 1k requests, peak RSS {:.0} MB, ready in {:.1} s, engine TTFT relayed in {}/{} responses",
                    c.cpu_s_per_1k,
                    c.peak_rss_mb,
                    run.startup_s.unwrap_or(0.0),
                    run.engine_ttft_relayed,
                    run.summary.requests
                );
            }
            if let Some(h) = &run.helper_cost {
                println!(
                    "      helpers (not the router): CPU {:.2} s / 1k requests, peak RSS {:.0} MB",
                    h.cpu_s_per_1k, h.peak_rss_mb
                );
            }
            runs.push((line, run));
        }
        let label = format!("{} at {}", workload.name, workload.load_label());
        self.results.push(report::WorkloadPeers {
            name: label,
            ours: ours.to_vec(),
            peers: runs,
        });
        Ok(())
    }

    /// Writes `peers.json` into `out_dir` and, unless `report` is None, the Peers section of it.
    pub fn finish(&self, out_dir: &Path, report: Option<(&Path, report::PeerFacts)>) -> Result<()> {
        let json: Vec<Value> = self
            .results
            .iter()
            .map(|w| {
                let (name, runs) = (&w.name, &w.peers);
                json!({
                    "workload": name,
                    "peers": runs.iter().map(|(p, r)| json!({
                        "line": p.name,
                        "version": p.version(),
                        "tuned": p.tuned,
                        "summary": r.summary,
                        "router_cost": r.cost,
                        "helper_cost": r.helper_cost,
                        "startup_s": r.startup_s,
                        "engine_ttft_relayed": r.engine_ttft_relayed,
                    })).collect::<Vec<_>>(),
                })
            })
            .collect();
        let path = out_dir.join("peers.json");
        std::fs::write(&path, serde_json::to_string_pretty(&json)? + "\n")
            .with_context(|| format!("writing {}", path.display()))?;
        println!("bench: peer results in {}", path.display());
        if let Some((doc, facts)) = report {
            report::splice(doc, &report::render_section(&facts, &self.results))?;
            println!("bench: wrote the Peers section of {}", doc.display());
        }
        Ok(())
    }
}

pub use report::PeerFacts;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::router_usage::{RouterCost, Usage};
    use catalogue::peer_policies;
    use install::Product;

    #[test]
    fn every_product_has_a_line_and_names_are_unique() {
        let all = peer_policies();
        for p in Product::ALL {
            assert!(all.iter().any(|l| l.launch.product() == p), "{}", p.name());
        }
        let mut names: Vec<&str> = all.iter().map(|p| p.name).collect();
        names.sort();
        names.dedup();
        assert_eq!(names.len(), all.len());
        for p in &all {
            assert_eq!(p.name.parse::<PeerPolicy>().expect("parse"), *p);
        }
    }

    #[test]
    fn selection_by_product_line_or_all() {
        let s = |v: &[&str]| select(&v.iter().map(|s| s.to_string()).collect::<Vec<_>>());
        assert_eq!(s(&["all"]).expect("all").len(), peer_policies().len());
        let vr = s(&["vllm-router"]).expect("product");
        assert_eq!(vr.len(), 3);
        assert!(vr.iter().all(|p| p.launch.product() == Product::VllmRouter));
        let two = s(&["dynamo:kv", "dynamo"]).expect("dedup");
        assert_eq!(two.len(), 2);
        assert!(s(&["nginx"]).is_err());
        // `litellm` is LiteLLM's own lines; `two-layer` (LiteLLM on kvroute) is asked for by name.
        let litellm = s(&["litellm"]).expect("product");
        assert_eq!(litellm.len(), 2);
        assert!(litellm.iter().all(|p| !p.launch.needs_kvroute()));
        let two_layer = s(&["two-layer"]).expect("line");
        assert_eq!(two_layer.len(), 1);
        assert!(two_layer[0].launch.needs_kvroute());
        assert_eq!(two_layer[0].launch.product(), Product::Litellm);
    }

    #[test]
    fn cost_per_thousand_requests() {
        let before = Usage {
            cpu_s: 10.0,
            cpu_s_by_process: [("envoy".to_string(), 10.0)].into(),
            peak_rss_mb: 50.0,
            processes: 1,
        };
        let after = Usage {
            cpu_s: 13.5,
            cpu_s_by_process: [
                ("envoy".to_string(), 13.0),
                ("kvroute-indexer".to_string(), 0.5),
            ]
            .into(),
            peak_rss_mb: 80.0,
            processes: 2,
        };
        let c = RouterCost::between(&before, &after, 500);
        assert!((c.cpu_s_per_1k - 7.0).abs() < 1e-9);
        // A process that appeared during the run counts from zero.
        assert_eq!(c.split(), "envoy 6.00, kvroute-indexer 1.00");
        assert_eq!(c.peak_rss_mb, 80.0);
        assert_eq!(RouterCost::between(&before, &after, 0).cpu_s_per_1k, 0.0);
    }
}
