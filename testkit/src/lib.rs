//! Test helpers shared by kvroute's crates (a dev-dependency only, never shipped).
//!
//! * [`cases`]: the proptest configuration every property test uses.
//! * [`json`]: arbitrary JSON values biased by the caller's strings and keys.
//! * [`mutate`]: byte-level edits of a valid input (JSON bodies, configuration files), the
//!   proptest strategy that makes them and the function that applies them.

pub mod cases;
pub mod json;
pub mod mutate;
