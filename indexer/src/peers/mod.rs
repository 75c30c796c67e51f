//! Decisions shared between the indexers of several gateways in front of one fleet.
//!
//! Every indexer already follows every replica's KV events, so the exact index is the same in all
//! of them. What each one knows only of its own requests is the load it sent (in-flight counts,
//! pending prefill), the predicted blocks of a sibling burst, session pins and approx-prefix
//! guesses. With `[peers]` configured, each indexer publishes every decision it counts
//! ([`kvroute_core::peers::PeerMessage::Routed`]) and every end of one ([`kvroute_core::peers::PeerMessage::Ended`]) on one Redis/Valkey
//! pub/sub channel, and applies its peers' messages as if it had decided them itself
//! ([`apply`]); its own come back on the channel and are skipped by their origin.
//!
//! Nothing waits on Redis: a decision is encoded and handed to a bounded queue (`try_send`; full
//! or disconnected: dropped and counted), a task publishes it. A server that is down is retried
//! with backoff ([`link`]); meanwhile every indexer routes on what it knows, `/readyz` says
//! `degraded`, and `kvroute_indexer_peers_connected` is 0. A lost message costs only its benefit:
//! the peers' copy of a decision expires like a local one.

mod apply;
mod config;
mod handle;
mod link;

pub use apply::apply_message;
pub use config::PeersSection;
pub use handle::{render_metrics, PeerLink, PeerStats};
pub use link::spawn;
