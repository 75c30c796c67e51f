//! vLLM's KV event stream (`--kv-events-config`): the data model, a tolerant decoder for every
//! wire layout vLLM has shipped, and an encoder that writes the bytes vLLM 0.33.0 writes.

mod decode;
mod encode;
mod types;

pub use decode::{decode_batch, decode_batch_with, DecodeError, DecodeLimits};
pub use encode::{encode_batch, encode_batch_into, WireLayout};
pub use types::*;
