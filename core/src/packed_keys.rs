//! The wire form of router keys in `POST /v1/route` (`api::RouteRequest::router_keys`): the keys
//! as little-endian 8-byte integers, in order, in standard padded base64. A 19-digit decimal key
//! in a JSON array costs ~20 bytes and an integer parse; packed it costs 10.7 bytes and a copy,
//! which matters when a 128k-token prompt carries 8,000 keys on every request.
//!
//! Readers take either form: a JSON array of integers (hand-written clients, `curl`) or the packed
//! string. Writers send the packed string.

use std::fmt;

use base64::engine::general_purpose::STANDARD;
use base64::Engine as _;
use serde::de::{self, SeqAccess, Visitor};
use serde::{Deserializer, Serializer};

/// Bytes per key in the packed form.
pub const KEY_BYTES: usize = 8;

/// Why a packed string is not a list of keys.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PackedKeysError {
    /// Not standard padded base64.
    #[error("router_keys is not base64: {0}")]
    Base64(String),
    /// The decoded bytes are not whole 8-byte keys.
    #[error("router_keys holds {0} bytes, not a whole number of {KEY_BYTES}-byte keys")]
    Length(usize),
}

/// `keys` in the packed form.
pub fn encode(keys: &[u64]) -> String {
    let mut bytes = Vec::with_capacity(keys.len() * KEY_BYTES);
    for k in keys {
        bytes.extend_from_slice(&k.to_le_bytes());
    }
    STANDARD.encode(bytes)
}

/// The keys of a packed string.
pub fn decode(text: &str) -> Result<Vec<u64>, PackedKeysError> {
    let bytes = STANDARD
        .decode(text)
        .map_err(|e| PackedKeysError::Base64(e.to_string()))?;
    if bytes.len() % KEY_BYTES != 0 {
        return Err(PackedKeysError::Length(bytes.len()));
    }
    Ok(bytes
        .chunks_exact(KEY_BYTES)
        .map(|c| {
            let mut b = [0u8; KEY_BYTES];
            b.copy_from_slice(c);
            u64::from_le_bytes(b)
        })
        .collect())
}

/// Serde for an `Option<Vec<u64>>` of router keys (`#[serde(with = "packed_keys::option")]`):
/// writes the packed string, reads either form.
pub mod option {
    use super::*;

    /// Writes `Some(keys)` packed (fields that skip `None` never get here with it).
    pub fn serialize<S: Serializer>(keys: &Option<Vec<u64>>, s: S) -> Result<S::Ok, S::Error> {
        match keys {
            Some(k) => s.serialize_str(&encode(k)),
            None => s.serialize_none(),
        }
    }

    /// Reads a packed string, an array of integers, or null.
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Vec<u64>>, D::Error> {
        d.deserialize_any(KeysVisitor)
    }
}

struct KeysVisitor;

impl<'de> Visitor<'de> for KeysVisitor {
    type Value = Option<Vec<u64>>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("router keys: a base64 string of little-endian u64s or an array of integers")
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
        decode(v).map(Some).map_err(E::custom)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        // Bounded by the body, which the reader bounds.
        let mut keys = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(1 << 16));
        while let Some(k) = seq.next_element::<u64>()? {
            keys.push(k);
        }
        Ok(Some(keys))
    }

    fn visit_none<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(None)
    }

    fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(None)
    }

    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_any(KeysVisitor)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde::{Deserialize, Serialize};

    #[derive(Debug, PartialEq, Serialize, Deserialize)]
    struct Holder {
        #[serde(default, skip_serializing_if = "Option::is_none", with = "option")]
        keys: Option<Vec<u64>>,
    }

    #[test]
    fn keys_round_trip_packed_at_every_edge() {
        for keys in [
            vec![],
            vec![0],
            vec![u64::MAX, 1, 0x0102_0304_0506_0708],
            (0..1000u64)
                .map(|i| i.wrapping_mul(0x9E37_79B9_7F4A_7C15))
                .collect(),
        ] {
            let text = encode(&keys);
            assert_eq!(decode(&text).expect("decode"), keys);
            let json = serde_json::to_string(&Holder {
                keys: Some(keys.clone()),
            })
            .expect("ser");
            assert!(json.starts_with(r#"{"keys":""#), "{json}");
            let back: Holder = serde_json::from_str(&json).expect("de");
            assert_eq!(back.keys, Some(keys));
        }
    }

    #[test]
    fn the_packed_form_is_little_endian_bytes_in_base64() {
        assert_eq!(encode(&[1]), "AQAAAAAAAAA=");
        assert_eq!(encode(&[u64::MAX]), "//////////8=");
    }

    #[test]
    fn readers_take_arrays_and_null_too() {
        let h: Holder =
            serde_json::from_str(r#"{"keys":[18446744073709551615,1]}"#).expect("array");
        assert_eq!(h.keys, Some(vec![u64::MAX, 1]));
        let h: Holder = serde_json::from_str(r#"{"keys":null}"#).expect("null");
        assert_eq!(h.keys, None);
        let h: Holder = serde_json::from_str("{}").expect("absent");
        assert_eq!(h.keys, None);
    }

    #[test]
    fn bad_packed_strings_are_refused_with_the_reason() {
        // Padding is required: the writer always pads.
        assert!(matches!(
            decode("AQAAAAAAAAA"),
            Err(PackedKeysError::Base64(_))
        ));
        assert!(matches!(
            decode("AQAAAAAAAA=="),
            Err(PackedKeysError::Length(7))
        ));
        assert!(matches!(
            decode("not base64!"),
            Err(PackedKeysError::Base64(_))
        ));
        let err = serde_json::from_str::<Holder>(r#"{"keys":"AQID"}"#).expect_err("3 bytes");
        assert!(
            err.to_string()
                .contains("not a whole number of 8-byte keys"),
            "{err}"
        );
        assert!(serde_json::from_str::<Holder>(r#"{"keys":[-1]}"#).is_err());
        assert!(serde_json::from_str::<Holder>(r#"{"keys":7}"#).is_err());
    }
}
