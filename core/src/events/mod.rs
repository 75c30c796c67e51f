//! vLLM's KV event stream (`--kv-events-config`): the data model, a tolerant decoder for every
//! wire layout vLLM has shipped, and an encoder that writes the bytes vLLM 0.33.0 writes.

mod decode;
mod encode;
mod types;

// pub use decode::{decode_batch, DecodeError, DecodeLimits};
// pub use encode::{encode_batch, WireLayout};
// pub use types::*;
