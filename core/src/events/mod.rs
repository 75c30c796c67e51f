//! vLLM's KV event stream (`--kv-events-config`): the data model, a tolerant decoder for every
//! wire layout vLLM has shipped, an encoder that writes the bytes vLLM 0.33.0 writes, and the
//! ZeroMQ frame layouts around them ([`frames`]).

mod decode;
mod encode;
pub mod frames;
mod types;

pub use decode::{decode_batch, decode_batch_with, DecodeError, DecodeLimits};
pub use encode::{encode_batch, encode_batch_into, WireLayout};
pub use types::*;
