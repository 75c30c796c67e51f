//! `--gateways N`: the lines through the filter run behind N Envoy + indexer pairs, sharing their
//! decisions through Redis (`[peers]`) or not (`--peer-sharing off`), so a run shows what several
//! gateways cost kvroute's routing and the gap the sharing closes.

use clap::ValueEnum;
use serde::Serialize;

use super::policies::Policy;

/// Whether gateways share decisions.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum PeerSharing {
    /// `[peers]` through one redis-server the benchmark starts.
    On,
    /// No `[peers]`: each gateway routes on its own decisions.
    Off,
}

/// The gateways of one line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GatewaySetup {
    /// Envoy + indexer pairs.
    pub gateways: usize,
    /// Their indexers share decisions (only with more than one).
    pub sharing: bool,
}

impl GatewaySetup {
    /// One gateway: the benchmark as it always ran.
    pub const SINGLE: GatewaySetup = GatewaySetup {
        gateways: 1,
        sharing: false,
    };

    /// The setups `policy` runs in: every `gateways` count times every `sharing` mode for the
    /// policies through the filter and an indexer (one gateway once, sharing being moot there);
    /// one gateway for the others (plain Envoys and the shadow line).
    pub fn for_policy(policy: Policy, gateways: &[usize], sharing: &[PeerSharing]) -> Vec<Self> {
        if !policy.uses_indexer() || policy == Policy::Shadow {
            return vec![Self::SINGLE];
        }
        let mut out = Vec::new();
        for &n in gateways {
            let setups: Vec<Self> = if n <= 1 {
                vec![Self::SINGLE]
            } else {
                sharing
                    .iter()
                    .map(|&s| Self {
                        gateways: n,
                        sharing: s == PeerSharing::On,
                    })
                    .collect()
            };
            for s in setups {
                if !out.contains(&s) {
                    out.push(s);
                }
            }
        }
        if out.is_empty() {
            out.push(Self::SINGLE);
        }
        out
    }

    /// The line's name in tables: the policy alone for one gateway (the report as before), else
    /// with the gateways and the sharing mode, `kv (2 gateways, shared)`.
    pub fn label(self, policy: &str) -> String {
        if self.gateways <= 1 {
            policy.to_string()
        } else {
            format!(
                "{policy} ({} gateways, {})",
                self.gateways,
                if self.sharing { "shared" } else { "unshared" }
            )
        }
    }
}

/// What results.json records about a line with several gateways.
#[derive(Debug, Clone, Serialize)]
pub struct GatewayFacts {
    /// Envoy + indexer pairs.
    pub gateways: usize,
    /// Whether their indexers shared decisions.
    pub sharing: bool,
    /// How the client spread requests (`round robin`, `by session`).
    pub spread: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_gateway_is_the_plain_line() {
        let s = GatewaySetup::for_policy(Policy::Kv, &[1], &[PeerSharing::On]);
        assert_eq!(s, [GatewaySetup::SINGLE]);
        assert_eq!(s[0].label("kv"), "kv");
    }

    #[test]
    fn filter_lines_run_every_count_and_mode_once() {
        let s = GatewaySetup::for_policy(
            Policy::Kv,
            &[1, 2, 3, 2],
            &[PeerSharing::On, PeerSharing::Off],
        );
        let labels: Vec<String> = s.iter().map(|s| s.label("kv")).collect();
        assert_eq!(
            labels,
            [
                "kv",
                "kv (2 gateways, shared)",
                "kv (2 gateways, unshared)",
                "kv (3 gateways, shared)",
                "kv (3 gateways, unshared)"
            ]
        );
        let random = GatewaySetup::for_policy(Policy::Random, &[2], &[PeerSharing::Off]);
        assert_eq!(
            random,
            [GatewaySetup {
                gateways: 2,
                sharing: false
            }]
        );
    }

    #[test]
    fn plain_envoy_and_shadow_lines_run_once_with_one_gateway() {
        for p in [
            Policy::RoundRobin,
            Policy::LeastRequest,
            Policy::Session,
            Policy::Shadow,
        ] {
            let s = GatewaySetup::for_policy(p, &[2, 3], &[PeerSharing::On, PeerSharing::Off]);
            assert_eq!(s, [GatewaySetup::SINGLE], "{p}");
        }
    }
}
