//! The KV event encoder: the bytes vLLM writes, for the engine simulator and compatibility tests.
//!
//! [`WireLayout::V0_33`] reproduces vLLM 0.33.0's msgspec output byte for byte: the batch as a
//! 3-element array (`data_parallel_rank` nil when absent), `ts` as float64, each event as a map with
//! `"type"` first and the fields in vLLM's declaration order, fields without a default always
//! written (nil when `None`), fields whose default is `None` omitted when `None`
//! (`omit_defaults`), and every length and integer in its smallest msgpack form, except that a
//! struct's map header is sized by its largest possible key count, as msgspec does (so
//! `BlockStored`, with 16 possible keys, always gets a map16 header).
//!
//! The `Array*` layouts write the positional arrays of older releases (tag first, every field the
//! release had, nil for `None`); fields a release did not have are dropped.

use super::types::{
    BlockRemoved, BlockStored, EventBatch, ExtraKeyValue, KvEvent, Medium, WireBlockHash,
};

/// Which vLLM release's wire format to write.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum WireLayout {
    /// vLLM >= 0.24 (byte-identical to 0.33.0): events as maps, `None` defaults omitted.
    #[default]
    V0_33,
    /// vLLM 0.9: `BlockStored [tag, hashes, parent, tokens, block_size, lora_id]`,
    /// `BlockRemoved [tag, hashes]`.
    Array0_9,
    /// vLLM 0.10-0.11: adds `medium` to both.
    Array0_11,
    /// vLLM 0.15: `BlockStored` adds `lora_name`.
    Array0_15,
    /// vLLM 0.22-0.23: `BlockStored` adds `extra_keys, group_idx, kv_cache_spec_kind,
    /// kv_cache_spec_sliding_window`; `BlockRemoved` adds `group_idx`.
    Array0_23,
}

impl WireLayout {
    /// The layout an engine of this version (`"0.23.0"`, `"v0.33.0rc1"`, ...) writes, or `None`
    /// when the version string does not parse or predates KV events (< 0.9).
    pub fn for_engine_version(version: &str) -> Option<WireLayout> {
        let v = version.trim().trim_start_matches('v');
        let mut parts = v.split('.');
        let major: u32 = parts.next()?.parse().ok()?;
        let minor_str = parts.next()?;
        let digits: String = minor_str
            .chars()
            .take_while(|c| c.is_ascii_digit())
            .collect();
        let minor: u32 = digits.parse().ok()?;
        Some(match (major, minor) {
            (0, 0..=8) => return None,
            (0, 9) => WireLayout::Array0_9,
            (0, 10..=14) => WireLayout::Array0_11,
            (0, 15..=21) => WireLayout::Array0_15,
            (0, 22..=23) => WireLayout::Array0_23,
            _ => WireLayout::V0_33,
        })
    }

    /// Number of elements after the tag in a positional `BlockStored` (0 for map layouts).
    fn stored_fields(self) -> usize {
        match self {
            WireLayout::V0_33 => 0,
            WireLayout::Array0_9 => 5,
            WireLayout::Array0_11 => 6,
            WireLayout::Array0_15 => 7,
            WireLayout::Array0_23 => 11,
        }
    }

    /// Number of elements after the tag in a positional `BlockRemoved` (0 for map layouts).
    fn removed_fields(self) -> usize {
        match self {
            WireLayout::V0_33 => 0,
            WireLayout::Array0_9 => 1,
            WireLayout::Array0_11 | WireLayout::Array0_15 => 2,
            WireLayout::Array0_23 => 3,
        }
    }
}

/// Encodes a batch in the given layout.
pub fn encode_batch(batch: &EventBatch, layout: WireLayout) -> Vec<u8> {
    let mut out = Vec::with_capacity(64 + batch.events.len() * 64);
    encode_batch_into(batch, layout, &mut out);
    out
}

/// Appends the encoding of `batch` to `out` (lets a publisher reuse one buffer).
pub fn encode_batch_into(batch: &EventBatch, layout: WireLayout, out: &mut Vec<u8>) {
    let w = &mut Writer(out);
    w.array_len(3);
    w.f64(batch.ts);
    w.array_len(batch.events.len());
    for ev in &batch.events {
        match layout {
            WireLayout::V0_33 => map_event(w, ev),
            _ => array_event(w, ev, layout),
        }
    }
    w.opt_int(batch.data_parallel_rank);
}

fn map_event(w: &mut Writer<'_>, ev: &KvEvent) {
    match ev {
        KvEvent::BlockStored(s) => stored_map(w, s),
        KvEvent::BlockRemoved(r) => removed_map(w, r),
        KvEvent::AllBlocksCleared => {
            w.map_len(1);
            w.str("type");
            w.str("AllBlocksCleared");
        }
        KvEvent::Unknown(name) => {
            w.map_len(1);
            w.str("type");
            w.str(name);
        }
    }
}

fn stored_map(w: &mut Writer<'_>, s: &BlockStored) {
    // `type` + the seven fields without a default, then the optional ones that are set.
    let optional = [
        s.extra_keys.is_some(),
        s.group_idx.is_some(),
        s.kv_cache_spec_kind.is_some(),
        s.kv_cache_spec_sliding_window.is_some(),
        s.locality.is_some(),
        s.ownership.is_some(),
        s.session_id.is_some(),
        s.lookahead_token_ids.is_some(),
    ];
    // msgspec sizes a struct's map header by the most keys it could write (tag + 15 fields = 16),
    // so a BlockStored always gets a map16 header, however few fields are set.
    w.map16_len(8 + optional.iter().filter(|b| **b).count());
    w.str("type");
    w.str("BlockStored");
    w.str("block_hashes");
    w.hashes(&s.block_hashes);
    w.str("parent_block_hash");
    w.opt_hash(s.parent_block_hash.as_ref());
    w.str("token_ids");
    w.tokens(&s.token_ids);
    w.str("block_size");
    w.uint(s.block_size as u64);
    w.str("lora_id");
    w.opt_int(s.lora_id);
    w.str("medium");
    w.opt_medium(s.medium);
    w.str("lora_name");
    w.opt_str(s.lora_name.as_deref());
    if let Some(keys) = &s.extra_keys {
        w.str("extra_keys");
        w.extra_keys(keys);
    }
    if let Some(v) = s.group_idx {
        w.str("group_idx");
        w.int(v);
    }
    if let Some(v) = &s.kv_cache_spec_kind {
        w.str("kv_cache_spec_kind");
        w.str(v);
    }
    if let Some(v) = s.kv_cache_spec_sliding_window {
        w.str("kv_cache_spec_sliding_window");
        w.int(v);
    }
    if let Some(v) = &s.locality {
        w.str("locality");
        w.str(v);
    }
    if let Some(v) = &s.ownership {
        w.str("ownership");
        w.str(v);
    }
    if let Some(v) = &s.session_id {
        w.str("session_id");
        w.str(v);
    }
    if let Some(lists) = &s.lookahead_token_ids {
        w.str("lookahead_token_ids");
        w.array_len(lists.len());
        for l in lists {
            w.tokens(l);
        }
    }
}

fn removed_map(w: &mut Writer<'_>, r: &BlockRemoved) {
    let optional = [
        r.group_idx.is_some(),
        r.locality.is_some(),
        r.ownership.is_some(),
    ];
    w.map_len(3 + optional.iter().filter(|b| **b).count());
    w.str("type");
    w.str("BlockRemoved");
    w.str("block_hashes");
    w.hashes(&r.block_hashes);
    w.str("medium");
    w.opt_medium(r.medium);
    if let Some(v) = r.group_idx {
        w.str("group_idx");
        w.int(v);
    }
    if let Some(v) = &r.locality {
        w.str("locality");
        w.str(v);
    }
    if let Some(v) = &r.ownership {
        w.str("ownership");
        w.str(v);
    }
}

fn array_event(w: &mut Writer<'_>, ev: &KvEvent, layout: WireLayout) {
    match ev {
        KvEvent::BlockStored(s) => {
            let n = layout.stored_fields();
            w.array_len(1 + n);
            w.str("BlockStored");
            w.hashes(&s.block_hashes);
            w.opt_hash(s.parent_block_hash.as_ref());
            w.tokens(&s.token_ids);
            w.uint(s.block_size as u64);
            w.opt_int(s.lora_id);
            if n >= 6 {
                w.opt_medium(s.medium);
            }
            if n >= 7 {
                w.opt_str(s.lora_name.as_deref());
            }
            if n >= 11 {
                match &s.extra_keys {
                    Some(keys) => w.extra_keys(keys),
                    None => w.nil(),
                }
                w.opt_int(s.group_idx);
                w.opt_str(s.kv_cache_spec_kind.as_deref());
                w.opt_int(s.kv_cache_spec_sliding_window);
            }
        }
        KvEvent::BlockRemoved(r) => {
            let n = layout.removed_fields();
            w.array_len(1 + n);
            w.str("BlockRemoved");
            w.hashes(&r.block_hashes);
            if n >= 2 {
                w.opt_medium(r.medium);
            }
            if n >= 3 {
                w.opt_int(r.group_idx);
            }
        }
        KvEvent::AllBlocksCleared => {
            w.array_len(1);
            w.str("AllBlocksCleared");
        }
        KvEvent::Unknown(name) => {
            w.array_len(1);
            w.str(name);
        }
    }
}

/// Minimal-form msgpack writer over a `Vec<u8>` (infallible).
struct Writer<'a>(&'a mut Vec<u8>);

impl Writer<'_> {
    fn nil(&mut self) {
        self.0.push(0xc0);
    }

    fn f64(&mut self, v: f64) {
        self.0.push(0xcb);
        self.0.extend_from_slice(&v.to_be_bytes());
    }

    fn uint(&mut self, v: u64) {
        if v < 0x80 {
            self.0.push(v as u8);
        } else if v <= u8::MAX as u64 {
            self.0.extend_from_slice(&[0xcc, v as u8]);
        } else if v <= u16::MAX as u64 {
            self.0.push(0xcd);
            self.0.extend_from_slice(&(v as u16).to_be_bytes());
        } else if v <= u32::MAX as u64 {
            self.0.push(0xce);
            self.0.extend_from_slice(&(v as u32).to_be_bytes());
        } else {
            self.0.push(0xcf);
            self.0.extend_from_slice(&v.to_be_bytes());
        }
    }

    fn int(&mut self, v: i64) {
        if v >= 0 {
            self.uint(v as u64);
        } else if v >= -32 {
            self.0.push(v as i8 as u8);
        } else if v >= i8::MIN as i64 {
            self.0.extend_from_slice(&[0xd0, v as i8 as u8]);
        } else if v >= i16::MIN as i64 {
            self.0.push(0xd1);
            self.0.extend_from_slice(&(v as i16).to_be_bytes());
        } else if v >= i32::MIN as i64 {
            self.0.push(0xd2);
            self.0.extend_from_slice(&(v as i32).to_be_bytes());
        } else {
            self.0.push(0xd3);
            self.0.extend_from_slice(&v.to_be_bytes());
        }
    }

    fn opt_int(&mut self, v: Option<i64>) {
        match v {
            Some(v) => self.int(v),
            None => self.nil(),
        }
    }

    fn len_header(&mut self, len: usize, fix: u8, fix_max: usize, m16: u8, m32: u8) {
        if len <= fix_max {
            self.0.push(fix | len as u8);
        } else if len <= u16::MAX as usize {
            self.0.push(m16);
            self.0.extend_from_slice(&(len as u16).to_be_bytes());
        } else {
            self.0.push(m32);
            // Lengths beyond u32 cannot be expressed in msgpack; saturate (never reached in practice).
            let l = u32::try_from(len).unwrap_or(u32::MAX);
            self.0.extend_from_slice(&l.to_be_bytes());
        }
    }

    fn array_len(&mut self, len: usize) {
        self.len_header(len, 0x90, 15, 0xdc, 0xdd);
    }

    fn map_len(&mut self, len: usize) {
        self.len_header(len, 0x80, 15, 0xde, 0xdf);
    }

    /// A map16 header even for a small count (what msgspec writes for structs with >= 16 fields).
    fn map16_len(&mut self, len: usize) {
        self.0.push(0xde);
        self.0.extend_from_slice(&(len as u16).to_be_bytes());
    }

    fn str(&mut self, s: &str) {
        let len = s.len();
        if len < 32 {
            self.0.push(0xa0 | len as u8);
        } else if len <= u8::MAX as usize {
            self.0.extend_from_slice(&[0xd9, len as u8]);
        } else if len <= u16::MAX as usize {
            self.0.push(0xda);
            self.0.extend_from_slice(&(len as u16).to_be_bytes());
        } else {
            self.0.push(0xdb);
            let l = u32::try_from(len).unwrap_or(u32::MAX);
            self.0.extend_from_slice(&l.to_be_bytes());
        }
        self.0.extend_from_slice(s.as_bytes());
    }

    fn opt_str(&mut self, s: Option<&str>) {
        match s {
            Some(s) => self.str(s),
            None => self.nil(),
        }
    }

    fn bin(&mut self, b: &[u8]) {
        let len = b.len();
        if len <= u8::MAX as usize {
            self.0.extend_from_slice(&[0xc4, len as u8]);
        } else if len <= u16::MAX as usize {
            self.0.push(0xc5);
            self.0.extend_from_slice(&(len as u16).to_be_bytes());
        } else {
            self.0.push(0xc6);
            let l = u32::try_from(len).unwrap_or(u32::MAX);
            self.0.extend_from_slice(&l.to_be_bytes());
        }
        self.0.extend_from_slice(b);
    }

    fn hash(&mut self, h: &WireBlockHash) {
        match h {
            WireBlockHash::Int(v) => self.uint(*v),
            WireBlockHash::Bytes(b) => self.bin(b),
        }
    }

    fn opt_hash(&mut self, h: Option<&WireBlockHash>) {
        match h {
            Some(h) => self.hash(h),
            None => self.nil(),
        }
    }

    fn hashes(&mut self, hs: &[WireBlockHash]) {
        self.array_len(hs.len());
        for h in hs {
            self.hash(h);
        }
    }

    fn tokens(&mut self, ts: &[u32]) {
        self.array_len(ts.len());
        for &t in ts {
            self.uint(t as u64);
        }
    }

    fn opt_medium(&mut self, m: Option<Medium>) {
        match m {
            Some(m) => self.str(m.as_str()),
            None => self.nil(),
        }
    }

    fn extra_value(&mut self, v: &ExtraKeyValue) {
        match v {
            ExtraKeyValue::Str(s) => self.str(s),
            ExtraKeyValue::Int(i) => self.int(*i),
            ExtraKeyValue::Bytes(b) => self.bin(b),
            ExtraKeyValue::List(l) => {
                self.array_len(l.len());
                for x in l {
                    self.extra_value(x);
                }
            }
        }
    }

    fn extra_keys(&mut self, keys: &[Option<Vec<ExtraKeyValue>>]) {
        self.array_len(keys.len());
        for entry in keys {
            match entry {
                Some(vals) => {
                    self.array_len(vals.len());
                    for v in vals {
                        self.extra_value(v);
                    }
                }
                None => self.nil(),
            }
        }
    }
}
