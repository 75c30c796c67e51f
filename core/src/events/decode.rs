//! A tolerant, bounded decoder for every KV event wire layout vLLM has shipped.
//!
//! A batch is the msgpack array `[ts, events, data_parallel_rank]` (two elements are accepted too).
//! Each event is either
//! * a **map** (vLLM >= 0.24): key `"type"` holds the class name, fields whose value is still the
//!   default `None` may be omitted, keys come in any order and unknown keys are skipped; or
//! * a positional **array** (vLLM <= 0.23): the class name first, then the fields in declaration
//!   order. Lengths differ per release (`BlockStored` 6/7/8/12 elements, `BlockRemoved` 2/3/4);
//!   the decoder reads the fields a given length carries and skips anything after the last field it
//!   knows.
//!
//! Block hashes may be integers of any msgpack width and sign (a negative value is reinterpreted as
//! the u64 with the same two's complement bits) or raw digest bytes (`bin`, or `str` from old
//! "raw" encoders). Event classes this decoder does not know become [`KvEvent::Unknown`].
//!
//! Safety against hostile or corrupt input: every read is bounds-checked, nothing is preallocated
//! beyond what the remaining input could possibly hold, nesting is depth-limited, and
//! [`DecodeLimits`] caps the payload, the events per batch and the hashes/tokens per event. Garbage
//! returns a [`DecodeError`]; it never panics.

use rmp::Marker;

use super::types::{
    BlockRemoved, BlockStored, EventBatch, ExtraKeyValue, KvEvent, Medium, WireBlockHash,
};

/// Upper bounds the decoder enforces on one payload. The defaults are generous for any real
/// engine and keep the worst-case memory of one decode to a small multiple of the payload size.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DecodeLimits {
    /// Largest payload accepted, in bytes (default 64 MiB).
    pub max_payload_bytes: usize,
    /// Most events in one batch (default 262,144).
    pub max_events: usize,
    /// Most block hashes in one event (default 1,048,576).
    pub max_block_hashes: usize,
    /// Most token ids in one event, lookahead tokens included (default 16,777,216).
    pub max_token_ids: usize,
    /// Longest raw-bytes block hash (default 64; vLLM digests are 16 or 32 bytes).
    pub max_hash_bytes: usize,
    /// Deepest msgpack nesting below an event field (extra keys, skipped unknown values;
    /// default 16).
    pub max_depth: usize,
}

impl Default for DecodeLimits {
    fn default() -> Self {
        DecodeLimits {
            max_payload_bytes: 64 << 20,
            max_events: 1 << 18,
            max_block_hashes: 1 << 20,
            max_token_ids: 1 << 24,
            max_hash_bytes: 64,
            max_depth: 16,
        }
    }
}

/// Why a payload could not be decoded. Offsets are byte positions in the payload.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DecodeError {
    /// The payload is larger than [`DecodeLimits::max_payload_bytes`].
    #[error("payload of {len} bytes exceeds the limit of {limit} bytes")]
    PayloadTooLarge {
        /// Payload length.
        len: usize,
        /// The configured limit.
        limit: usize,
    },
    /// The input ended in the middle of a value.
    #[error("truncated input at offset {offset}: {needed} more byte(s) needed")]
    Truncated {
        /// Where the missing bytes were expected.
        offset: usize,
        /// How many bytes were missing.
        needed: usize,
    },
    /// A value of the wrong msgpack type.
    #[error("at offset {offset}: expected {expected}, found msgpack marker 0x{marker:02x}")]
    UnexpectedType {
        /// Offset of the offending marker.
        offset: usize,
        /// What the decoder wanted.
        expected: &'static str,
        /// The marker byte found.
        marker: u8,
    },
    /// A string that is not UTF-8.
    #[error("at offset {offset}: string is not valid UTF-8")]
    InvalidUtf8 {
        /// Offset of the string's marker.
        offset: usize,
    },
    /// An integer that does not fit the field.
    #[error("at offset {offset}: integer {value} is out of range for {field}")]
    IntOutOfRange {
        /// Offset of the integer's marker.
        offset: usize,
        /// The field being read.
        field: &'static str,
        /// The value found.
        value: i128,
    },
    /// The batch array has a length other than 2 or 3.
    #[error("batch must be [ts, events, data_parallel_rank], got an array of {len} element(s)")]
    BadBatchLength {
        /// Elements found.
        len: usize,
    },
    /// A required field is absent (or nil).
    #[error("{event} event at offset {offset} has no `{field}`")]
    MissingField {
        /// Offset of the event.
        offset: usize,
        /// Event class.
        event: &'static str,
        /// Field name.
        field: &'static str,
    },
    /// An event map without a `"type"` key.
    #[error("event map at offset {offset} has no \"type\" key")]
    MissingEventType {
        /// Offset of the event.
        offset: usize,
    },
    /// A positional event array too short for its class.
    #[error("{event} event array at offset {offset} has {len} element(s), at least {min} needed")]
    ShortEventArray {
        /// Offset of the event.
        offset: usize,
        /// Event class.
        event: &'static str,
        /// Elements found.
        len: usize,
        /// Elements required.
        min: usize,
    },
    /// An event is neither a map nor an array (or an array with no tag).
    #[error("at offset {offset}: an event must be a map or a tagged array")]
    BadEvent {
        /// Offset of the event.
        offset: usize,
    },
    /// A [`DecodeLimits`] bound was exceeded.
    #[error("at offset {offset}: {what} count {found} exceeds the limit of {limit}")]
    LimitExceeded {
        /// Offset of the collection.
        offset: usize,
        /// What was counted.
        what: &'static str,
        /// The count announced by the input.
        found: usize,
        /// The configured limit.
        limit: usize,
    },
    /// Nesting deeper than [`DecodeLimits::max_depth`].
    #[error("at offset {offset}: nesting deeper than {limit}")]
    TooDeep {
        /// Offset of the value that went too deep.
        offset: usize,
        /// The configured limit.
        limit: usize,
    },
    /// Bytes left over after the batch.
    #[error("{count} trailing byte(s) after the batch at offset {offset}")]
    TrailingBytes {
        /// Where the batch ended.
        offset: usize,
        /// Bytes left.
        count: usize,
    },
}

type Result<T> = core::result::Result<T, DecodeError>;

/// Decodes one published payload with the default [`DecodeLimits`].
pub fn decode_batch(payload: &[u8]) -> Result<EventBatch> {
    decode_batch_with(payload, &DecodeLimits::default())
}

/// Decodes one published payload, enforcing `limits`.
pub fn decode_batch_with(payload: &[u8], limits: &DecodeLimits) -> Result<EventBatch> {
    if payload.len() > limits.max_payload_bytes {
        return Err(DecodeError::PayloadTooLarge {
            len: payload.len(),
            limit: limits.max_payload_bytes,
        });
    }
    let mut r = Reader {
        buf: payload,
        pos: 0,
        limits,
    };
    let batch = r.batch()?;
    if r.pos != payload.len() {
        return Err(DecodeError::TrailingBytes {
            offset: r.pos,
            count: payload.len() - r.pos,
        });
    }
    Ok(batch)
}

/// Field positions of a positional (`<= 0.23`) `BlockStored`, after the tag.
const STORED_ARRAY_FIELDS: [StoredField; 11] = [
    StoredField::BlockHashes,
    StoredField::ParentBlockHash,
    StoredField::TokenIds,
    StoredField::BlockSize,
    StoredField::LoraId,
    StoredField::Medium,
    StoredField::LoraName,
    StoredField::ExtraKeys,
    StoredField::GroupIdx,
    StoredField::KvCacheSpecKind,
    StoredField::KvCacheSpecSlidingWindow,
];

/// Field positions of a positional `BlockRemoved`, after the tag.
const REMOVED_ARRAY_FIELDS: [StoredField; 3] = [
    StoredField::BlockHashes,
    StoredField::Medium,
    StoredField::GroupIdx,
];

/// Every event field the decoder understands (both event classes share the names and types).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum StoredField {
    BlockHashes,
    ParentBlockHash,
    TokenIds,
    BlockSize,
    LoraId,
    Medium,
    LoraName,
    ExtraKeys,
    GroupIdx,
    KvCacheSpecKind,
    KvCacheSpecSlidingWindow,
    Locality,
    Ownership,
    SessionId,
    LookaheadTokenIds,
}

impl StoredField {
    fn from_key(key: &str) -> Option<StoredField> {
        Some(match key {
            "block_hashes" => StoredField::BlockHashes,
            "parent_block_hash" => StoredField::ParentBlockHash,
            "token_ids" => StoredField::TokenIds,
            "block_size" => StoredField::BlockSize,
            "lora_id" => StoredField::LoraId,
            "medium" => StoredField::Medium,
            "lora_name" => StoredField::LoraName,
            "extra_keys" => StoredField::ExtraKeys,
            "group_idx" => StoredField::GroupIdx,
            "kv_cache_spec_kind" => StoredField::KvCacheSpecKind,
            "kv_cache_spec_sliding_window" => StoredField::KvCacheSpecSlidingWindow,
            "locality" => StoredField::Locality,
            "ownership" => StoredField::Ownership,
            "session_id" => StoredField::SessionId,
            "lookahead_token_ids" => StoredField::LookaheadTokenIds,
            _ => return None,
        })
    }
}

/// The event classes the decoder knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum EventKind {
    Stored,
    Removed,
    Cleared,
}

impl EventKind {
    fn from_tag(tag: &str) -> Option<EventKind> {
        match tag {
            "BlockStored" => Some(EventKind::Stored),
            "BlockRemoved" => Some(EventKind::Removed),
            "AllBlocksCleared" => Some(EventKind::Cleared),
            _ => None,
        }
    }
}

/// Fields collected while reading one event; turned into a [`KvEvent`] at the end.
#[derive(Default)]
struct Fields {
    block_hashes: Option<Vec<WireBlockHash>>,
    token_ids: Option<Vec<u32>>,
    block_size: Option<u32>,
    stored: BlockStored,
}

/// A bounds-checked cursor over the payload.
struct Reader<'a, 'l> {
    buf: &'a [u8],
    pos: usize,
    limits: &'l DecodeLimits,
}

impl<'a> Reader<'a, '_> {
    fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    fn peek(&self) -> Result<u8> {
        self.buf
            .get(self.pos)
            .copied()
            .ok_or(DecodeError::Truncated {
                offset: self.pos,
                needed: 1,
            })
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        if n > self.remaining() {
            return Err(DecodeError::Truncated {
                offset: self.pos,
                needed: n - self.remaining(),
            });
        }
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    fn be<const N: usize>(&mut self) -> Result<[u8; N]> {
        let s = self.take(N)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }

    fn marker(&mut self) -> Result<Marker> {
        let b = self.peek()?;
        self.pos += 1;
        Ok(Marker::from_u8(b))
    }

    fn unexpected(&self, at: usize, expected: &'static str) -> DecodeError {
        DecodeError::UnexpectedType {
            offset: at,
            expected,
            marker: self.buf.get(at).copied().unwrap_or(0),
        }
    }

    /// Consumes a nil if one is next.
    fn take_nil(&mut self) -> Result<bool> {
        if self.peek()? == 0xc0 {
            self.pos += 1;
            Ok(true)
        } else {
            Ok(false)
        }
    }

    /// A capacity that the remaining input could back (each element takes at least one byte).
    fn capacity_for(&self, len: usize) -> usize {
        len.min(self.remaining())
    }

    fn len_after(&mut self, m: Marker) -> Result<Option<usize>> {
        Ok(Some(match m {
            Marker::FixArray(n) | Marker::FixMap(n) => n as usize,
            Marker::Array16 | Marker::Map16 => u16::from_be_bytes(self.be()?) as usize,
            Marker::Array32 | Marker::Map32 => u32::from_be_bytes(self.be()?) as usize,
            _ => return Ok(None),
        }))
    }

    /// An array header's announced length, not yet checked against the remaining input.
    fn array_header(&mut self) -> Result<usize> {
        let at = self.pos;
        let m = self.marker()?;
        match m {
            Marker::FixArray(_) | Marker::Array16 | Marker::Array32 => {}
            _ => return Err(self.unexpected(at, "an array")),
        }
        self.len_after(m)?
            .ok_or_else(|| self.unexpected(at, "an array"))
    }

    /// An array length the remaining input can back.
    fn array_len(&mut self) -> Result<usize> {
        let at = self.pos;
        let len = self.array_header()?;
        self.check_backed(at, len)?;
        Ok(len)
    }

    /// An array length that cannot exceed the remaining input (one byte per element minimum).
    fn check_backed(&self, at: usize, len: usize) -> Result<()> {
        if len > self.remaining() {
            return Err(DecodeError::Truncated {
                offset: at,
                needed: len - self.remaining(),
            });
        }
        Ok(())
    }

    /// An array length within `limit` that the remaining input can back.
    fn bounded_array_len(&mut self, what: &'static str, limit: usize) -> Result<usize> {
        let at = self.pos;
        let len = self.array_header()?;
        if len > limit {
            return Err(DecodeError::LimitExceeded {
                offset: at,
                what,
                found: len,
                limit,
            });
        }
        self.check_backed(at, len)?;
        Ok(len)
    }

    fn str_len(&mut self, m: Marker) -> Result<Option<usize>> {
        Ok(Some(match m {
            Marker::FixStr(n) => n as usize,
            Marker::Str8 | Marker::Bin8 => self.be::<1>()?[0] as usize,
            Marker::Str16 | Marker::Bin16 => u16::from_be_bytes(self.be()?) as usize,
            Marker::Str32 | Marker::Bin32 => u32::from_be_bytes(self.be()?) as usize,
            _ => return Ok(None),
        }))
    }

    fn str(&mut self) -> Result<&'a str> {
        let at = self.pos;
        let m = self.marker()?;
        let is_str = matches!(
            m,
            Marker::FixStr(_) | Marker::Str8 | Marker::Str16 | Marker::Str32
        );
        let len = match (is_str, self.str_len(m)?) {
            (true, Some(len)) => len,
            _ => return Err(self.unexpected(at, "a string")),
        };
        let bytes = self.take(len)?;
        core::str::from_utf8(bytes).map_err(|_| DecodeError::InvalidUtf8 { offset: at })
    }

    fn opt_string(&mut self) -> Result<Option<String>> {
        if self.take_nil()? {
            return Ok(None);
        }
        Ok(Some(self.str()?.to_owned()))
    }

    /// Any msgpack integer, widened.
    fn int(&mut self, expected: &'static str) -> Result<i128> {
        let at = self.pos;
        let m = self.marker()?;
        Ok(match m {
            Marker::FixPos(v) => v as i128,
            Marker::FixNeg(v) => v as i128,
            Marker::U8 => self.be::<1>()?[0] as i128,
            Marker::U16 => u16::from_be_bytes(self.be()?) as i128,
            Marker::U32 => u32::from_be_bytes(self.be()?) as i128,
            Marker::U64 => u64::from_be_bytes(self.be()?) as i128,
            Marker::I8 => i8::from_be_bytes(self.be()?) as i128,
            Marker::I16 => i16::from_be_bytes(self.be()?) as i128,
            Marker::I32 => i32::from_be_bytes(self.be()?) as i128,
            Marker::I64 => i64::from_be_bytes(self.be()?) as i128,
            _ => return Err(self.unexpected(at, expected)),
        })
    }

    fn int_as<T: TryFrom<i128>>(&mut self, field: &'static str) -> Result<T> {
        let at = self.pos;
        let v = self.int(field)?;
        T::try_from(v).map_err(|_| DecodeError::IntOutOfRange {
            offset: at,
            field,
            value: v,
        })
    }

    fn opt_i64(&mut self, field: &'static str) -> Result<Option<i64>> {
        if self.take_nil()? {
            return Ok(None);
        }
        self.int_as(field).map(Some)
    }

    fn float(&mut self) -> Result<f64> {
        let at = self.pos;
        match Marker::from_u8(self.peek()?) {
            Marker::F64 => {
                self.pos += 1;
                Ok(f64::from_be_bytes(self.be()?))
            }
            Marker::F32 => {
                self.pos += 1;
                Ok(f32::from_be_bytes(self.be()?) as f64)
            }
            _ => match self.int("a float timestamp") {
                Ok(v) => Ok(v as f64),
                Err(_) => Err(self.unexpected(at, "a float timestamp")),
            },
        }
    }

    /// A block hash: an integer of any width and sign (as u64 bits), or raw bytes.
    fn hash(&mut self) -> Result<WireBlockHash> {
        let at = self.pos;
        let m = self.marker()?;
        let v: u64 = match m {
            Marker::FixPos(v) => v as u64,
            Marker::FixNeg(v) => v as i64 as u64,
            Marker::U8 => self.be::<1>()?[0] as u64,
            Marker::U16 => u16::from_be_bytes(self.be()?) as u64,
            Marker::U32 => u32::from_be_bytes(self.be()?) as u64,
            Marker::U64 => u64::from_be_bytes(self.be()?),
            Marker::I8 => i8::from_be_bytes(self.be()?) as i64 as u64,
            Marker::I16 => i16::from_be_bytes(self.be()?) as i64 as u64,
            Marker::I32 => i32::from_be_bytes(self.be()?) as i64 as u64,
            Marker::I64 => i64::from_be_bytes(self.be()?) as u64,
            Marker::FixStr(_)
            | Marker::Str8
            | Marker::Str16
            | Marker::Str32
            | Marker::Bin8
            | Marker::Bin16
            | Marker::Bin32 => {
                let len = self
                    .str_len(m)?
                    .ok_or_else(|| self.unexpected(at, "a block hash"))?;
                if len > self.limits.max_hash_bytes {
                    return Err(DecodeError::LimitExceeded {
                        offset: at,
                        what: "block hash bytes",
                        found: len,
                        limit: self.limits.max_hash_bytes,
                    });
                }
                return Ok(WireBlockHash::Bytes(self.take(len)?.to_vec()));
            }
            _ => return Err(self.unexpected(at, "a block hash (int or bytes)")),
        };
        Ok(WireBlockHash::Int(v))
    }

    fn opt_hash(&mut self) -> Result<Option<WireBlockHash>> {
        if self.take_nil()? {
            return Ok(None);
        }
        self.hash().map(Some)
    }

    fn hashes(&mut self) -> Result<Vec<WireBlockHash>> {
        let len = self.bounded_array_len("block hashes", self.limits.max_block_hashes)?;
        let mut out = Vec::with_capacity(self.capacity_for(len));
        for _ in 0..len {
            out.push(self.hash()?);
        }
        Ok(out)
    }

    fn token_ids(&mut self, budget: &mut usize) -> Result<Vec<u32>> {
        let at = self.pos;
        let len = self.array_header()?;
        if len > *budget {
            return Err(DecodeError::LimitExceeded {
                offset: at,
                what: "token ids",
                found: len,
                limit: self.limits.max_token_ids,
            });
        }
        self.check_backed(at, len)?;
        *budget -= len;
        let mut out = Vec::with_capacity(self.capacity_for(len));
        for _ in 0..len {
            out.push(self.token_id()?);
        }
        Ok(out)
    }

    /// One token id: the encodings vLLM writes (positive fixint, uint 8/16/32) are read inline,
    /// anything else goes through the general integer path (and its range check).
    #[inline]
    fn token_id(&mut self) -> Result<u32> {
        let b = self.buf;
        let p = self.pos;
        match b.get(p..p + 5).or_else(|| b.get(p..)) {
            Some([m, ..]) if *m < 0x80 => {
                self.pos = p + 1;
                Ok(u32::from(*m))
            }
            Some([0xcc, v, ..]) => {
                self.pos = p + 2;
                Ok(u32::from(*v))
            }
            Some([0xcd, h, l, ..]) => {
                self.pos = p + 3;
                Ok(u32::from(u16::from_be_bytes([*h, *l])))
            }
            Some([0xce, a, b2, c, d]) => {
                self.pos = p + 5;
                Ok(u32::from_be_bytes([*a, *b2, *c, *d]))
            }
            _ => self.int_as::<u32>("token_ids"),
        }
    }

    fn medium(&mut self) -> Result<Option<Medium>> {
        if self.take_nil()? {
            return Ok(None);
        }
        // A tier this version does not know is kept as the lowest one, so it never earns GPU credit.
        Ok(Some(Medium::parse(self.str()?).unwrap_or(Medium::Storage)))
    }

    fn extra_value(&mut self, depth: usize) -> Result<ExtraKeyValue> {
        let at = self.pos;
        if depth > self.limits.max_depth {
            return Err(DecodeError::TooDeep {
                offset: at,
                limit: self.limits.max_depth,
            });
        }
        let m = Marker::from_u8(self.peek()?);
        match m {
            Marker::FixStr(_) | Marker::Str8 | Marker::Str16 | Marker::Str32 => {
                Ok(ExtraKeyValue::Str(self.str()?.to_owned()))
            }
            Marker::Bin8 | Marker::Bin16 | Marker::Bin32 => {
                self.pos += 1;
                let len = self
                    .str_len(m)?
                    .ok_or_else(|| self.unexpected(at, "bytes"))?;
                Ok(ExtraKeyValue::Bytes(self.take(len)?.to_vec()))
            }
            Marker::FixArray(_) | Marker::Array16 | Marker::Array32 => {
                Ok(ExtraKeyValue::List(self.extra_list(depth + 1)?))
            }
            _ => Ok(ExtraKeyValue::Int(self.int_as("extra_keys")?)),
        }
    }

    fn extra_list(&mut self, depth: usize) -> Result<Vec<ExtraKeyValue>> {
        let len = self.array_len()?;
        let mut out = Vec::with_capacity(self.capacity_for(len));
        for _ in 0..len {
            out.push(self.extra_value(depth)?);
        }
        Ok(out)
    }

    #[allow(clippy::type_complexity)]
    fn extra_keys(&mut self) -> Result<Option<Vec<Option<Vec<ExtraKeyValue>>>>> {
        if self.take_nil()? {
            return Ok(None);
        }
        let len = self.bounded_array_len("extra_keys entries", self.limits.max_block_hashes)?;
        let mut out = Vec::with_capacity(self.capacity_for(len));
        for _ in 0..len {
            if self.take_nil()? {
                out.push(None);
            } else {
                out.push(Some(self.extra_list(1)?));
            }
        }
        Ok(Some(out))
    }

    fn lookahead(&mut self, budget: &mut usize) -> Result<Option<Vec<Vec<u32>>>> {
        if self.take_nil()? {
            return Ok(None);
        }
        let len = self.bounded_array_len("lookahead lists", self.limits.max_block_hashes)?;
        let mut out = Vec::with_capacity(self.capacity_for(len));
        for _ in 0..len {
            out.push(self.token_ids(budget)?);
        }
        Ok(Some(out))
    }

    /// Skips one value of any type, depth-limited.
    fn skip(&mut self, depth: usize) -> Result<()> {
        let at = self.pos;
        if depth > self.limits.max_depth {
            return Err(DecodeError::TooDeep {
                offset: at,
                limit: self.limits.max_depth,
            });
        }
        let m = self.marker()?;
        let fixed = match m {
            Marker::Null | Marker::True | Marker::False | Marker::FixPos(_) | Marker::FixNeg(_) => {
                0
            }
            Marker::U8 | Marker::I8 => 1,
            Marker::U16 | Marker::I16 => 2,
            Marker::U32 | Marker::I32 | Marker::F32 => 4,
            Marker::U64 | Marker::I64 | Marker::F64 => 8,
            Marker::FixExt1 => 2,
            Marker::FixExt2 => 3,
            Marker::FixExt4 => 5,
            Marker::FixExt8 => 9,
            Marker::FixExt16 => 17,
            Marker::Ext8 => 1 + self.be::<1>()?[0] as usize,
            Marker::Ext16 => 1 + u16::from_be_bytes(self.be()?) as usize,
            Marker::Ext32 => 1 + u32::from_be_bytes(self.be()?) as usize,
            Marker::FixStr(_)
            | Marker::Str8
            | Marker::Str16
            | Marker::Str32
            | Marker::Bin8
            | Marker::Bin16
            | Marker::Bin32 => self
                .str_len(m)?
                .ok_or_else(|| self.unexpected(at, "a value"))?,
            Marker::FixArray(_) | Marker::Array16 | Marker::Array32 => {
                let n = self.len_after(m)?.unwrap_or(0);
                self.check_backed(at, n)?;
                for _ in 0..n {
                    self.skip(depth + 1)?;
                }
                0
            }
            Marker::FixMap(_) | Marker::Map16 | Marker::Map32 => {
                let n = self.len_after(m)?.unwrap_or(0);
                self.check_backed(at, n.saturating_mul(2))?;
                for _ in 0..n.saturating_mul(2) {
                    self.skip(depth + 1)?;
                }
                0
            }
            Marker::Reserved => return Err(self.unexpected(at, "a msgpack value")),
        };
        self.take(fixed)?;
        Ok(())
    }

    fn batch(&mut self) -> Result<EventBatch> {
        let len = self.array_len()?;
        if !(2..=3).contains(&len) {
            return Err(DecodeError::BadBatchLength { len });
        }
        let ts = self.float()?;
        let n = self.bounded_array_len("events", self.limits.max_events)?;
        let mut events = Vec::with_capacity(self.capacity_for(n));
        for _ in 0..n {
            events.push(self.event()?);
        }
        let data_parallel_rank = if len == 3 {
            self.opt_i64("data_parallel_rank")?
        } else {
            None
        };
        Ok(EventBatch {
            ts,
            events,
            data_parallel_rank,
        })
    }

    fn event(&mut self) -> Result<KvEvent> {
        let at = self.pos;
        let m = self.marker()?;
        match m {
            Marker::FixMap(_) | Marker::Map16 | Marker::Map32 => {
                let n = self.len_after(m)?.unwrap_or(0);
                self.check_backed(at, n.saturating_mul(2))?;
                self.map_event(at, n)
            }
            Marker::FixArray(_) | Marker::Array16 | Marker::Array32 => {
                let n = self.len_after(m)?.unwrap_or(0);
                self.check_backed(at, n)?;
                self.array_event(at, n)
            }
            _ => Err(DecodeError::BadEvent { offset: at }),
        }
    }

    /// A `>= 0.24` map event whose `n` entries start at the cursor.
    fn map_event(&mut self, at: usize, n: usize) -> Result<KvEvent> {
        let entries_start = self.pos;
        // msgspec writes the tag first; otherwise find it, then read the fields from the start.
        let tag = match self.find_tag(n)? {
            Some(tag) => tag,
            None => return Err(DecodeError::MissingEventType { offset: at }),
        };
        let kind = match EventKind::from_tag(tag) {
            Some(kind) => kind,
            None => {
                self.pos = entries_start;
                for _ in 0..n.saturating_mul(2) {
                    self.skip(1)?;
                }
                return Ok(KvEvent::Unknown(tag.to_owned()));
            }
        };
        self.pos = entries_start;
        let mut fields = Fields::default();
        let mut budget = self.limits.max_token_ids;
        for _ in 0..n {
            let key = self.str()?;
            if key == "type" {
                self.skip(1)?;
                continue;
            }
            match StoredField::from_key(key) {
                Some(field) if kind != EventKind::Cleared => {
                    self.field(field, &mut fields, &mut budget)?
                }
                _ => self.skip(1)?,
            }
        }
        finish(at, kind, fields)
    }

    /// Scans the `n` map entries at the cursor for the `"type"` key; leaves the cursor anywhere.
    fn find_tag(&mut self, n: usize) -> Result<Option<&'a str>> {
        for _ in 0..n {
            let key = self.str()?;
            if key == "type" {
                return Ok(Some(self.str()?));
            }
            self.skip(1)?;
        }
        Ok(None)
    }

    /// A `<= 0.23` positional event of `n` elements (tag first).
    fn array_event(&mut self, at: usize, n: usize) -> Result<KvEvent> {
        if n == 0 {
            return Err(DecodeError::BadEvent { offset: at });
        }
        let tag = self.str()?;
        let (kind, layout, min): (_, &[StoredField], usize) = match EventKind::from_tag(tag) {
            Some(EventKind::Stored) => (EventKind::Stored, &STORED_ARRAY_FIELDS, 4),
            Some(EventKind::Removed) => (EventKind::Removed, &REMOVED_ARRAY_FIELDS, 1),
            Some(EventKind::Cleared) => (EventKind::Cleared, &[], 0),
            None => {
                for _ in 1..n {
                    self.skip(1)?;
                }
                return Ok(KvEvent::Unknown(tag.to_owned()));
            }
        };
        if n - 1 < min {
            return Err(DecodeError::ShortEventArray {
                offset: at,
                event: kind_name(kind),
                len: n,
                min: min + 1,
            });
        }
        let mut fields = Fields::default();
        let mut budget = self.limits.max_token_ids;
        for i in 0..n - 1 {
            match layout.get(i) {
                Some(&field) => self.field(field, &mut fields, &mut budget)?,
                None => self.skip(1)?,
            }
        }
        finish(at, kind, fields)
    }

    /// Reads the value of `field` into `f`.
    fn field(&mut self, field: StoredField, f: &mut Fields, budget: &mut usize) -> Result<()> {
        let s = &mut f.stored;
        match field {
            StoredField::BlockHashes => {
                f.block_hashes = if self.take_nil()? {
                    None
                } else {
                    Some(self.hashes()?)
                }
            }
            StoredField::ParentBlockHash => s.parent_block_hash = self.opt_hash()?,
            StoredField::TokenIds => {
                f.token_ids = if self.take_nil()? {
                    None
                } else {
                    Some(self.token_ids(budget)?)
                }
            }
            StoredField::BlockSize => {
                f.block_size = if self.take_nil()? {
                    None
                } else {
                    Some(self.int_as("block_size")?)
                }
            }
            StoredField::LoraId => s.lora_id = self.opt_i64("lora_id")?,
            StoredField::Medium => s.medium = self.medium()?,
            StoredField::LoraName => s.lora_name = self.opt_string()?,
            StoredField::ExtraKeys => s.extra_keys = self.extra_keys()?,
            StoredField::GroupIdx => s.group_idx = self.opt_i64("group_idx")?,
            StoredField::KvCacheSpecKind => s.kv_cache_spec_kind = self.opt_string()?,
            StoredField::KvCacheSpecSlidingWindow => {
                s.kv_cache_spec_sliding_window = self.opt_i64("kv_cache_spec_sliding_window")?
            }
            StoredField::Locality => s.locality = self.opt_string()?,
            StoredField::Ownership => s.ownership = self.opt_string()?,
            StoredField::SessionId => s.session_id = self.opt_string()?,
            StoredField::LookaheadTokenIds => s.lookahead_token_ids = self.lookahead(budget)?,
        }
        Ok(())
    }
}

fn kind_name(kind: EventKind) -> &'static str {
    match kind {
        EventKind::Stored => "BlockStored",
        EventKind::Removed => "BlockRemoved",
        EventKind::Cleared => "AllBlocksCleared",
    }
}

/// Builds the event from collected fields, checking the required ones.
fn finish(at: usize, kind: EventKind, f: Fields) -> Result<KvEvent> {
    let missing = |field| DecodeError::MissingField {
        offset: at,
        event: kind_name(kind),
        field,
    };
    match kind {
        EventKind::Cleared => Ok(KvEvent::AllBlocksCleared),
        EventKind::Removed => Ok(KvEvent::BlockRemoved(BlockRemoved {
            block_hashes: f.block_hashes.ok_or_else(|| missing("block_hashes"))?,
            medium: f.stored.medium,
            group_idx: f.stored.group_idx,
            locality: f.stored.locality,
            ownership: f.stored.ownership,
        })),
        EventKind::Stored => {
            let mut s = f.stored;
            s.block_hashes = f.block_hashes.ok_or_else(|| missing("block_hashes"))?;
            s.token_ids = f.token_ids.ok_or_else(|| missing("token_ids"))?;
            s.block_size = f.block_size.ok_or_else(|| missing("block_size"))?;
            Ok(KvEvent::BlockStored(s))
        }
    }
}
