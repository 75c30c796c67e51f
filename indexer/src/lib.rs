//! kvroute-indexer library: the parts of the sidecar other binaries and tests reuse.

pub mod index;

pub mod agreement;
pub mod allocator;
pub mod api;
pub mod assess;
pub mod config;
pub mod decayed;
pub mod load;
pub mod lookup;
pub mod membership;
pub mod metrics;
pub mod peers;
pub mod policies;
pub mod policy_state;
pub mod reuse;
pub mod route;
pub mod scheduling;
pub mod scrape;
pub mod selfcheck;
pub mod server;
pub mod shadow;
pub mod snapshot;
pub mod state;
pub mod subscriber;
pub mod successors;
pub mod tokenizer_serving;
pub mod tools;
