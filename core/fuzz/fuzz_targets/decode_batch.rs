//! Fuzzes the KV event decoder: any input must decode or return an error (never panic, never
//! allocate without bound), and whatever decodes must survive a V0_33 re-encode and re-decode
//! with the same events.
#![no_main]

use kvroute_core::events::{decode_batch_with, encode_batch, DecodeLimits, WireLayout};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let limits = DecodeLimits {
        max_payload_bytes: 1 << 20,
        ..DecodeLimits::default()
    };
    if let Ok(batch) = decode_batch_with(data, &limits) {
        let bytes = encode_batch(&batch, WireLayout::V0_33);
        match decode_batch_with(&bytes, &DecodeLimits::default()) {
            Ok(again) => assert_eq!(again.events, batch.events),
            Err(e) => panic!("re-encoded batch does not decode: {e}"),
        }
    }
});
