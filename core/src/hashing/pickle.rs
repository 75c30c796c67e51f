//! A minimal pickle protocol 5 writer that reproduces CPython's `pickle.dumps(obj, protocol=5)`
//! (the C `_pickle` module) byte for byte for the object shapes vLLM hashes: tuples, bytes, str,
//! int and None.
//!
//! What CPython does, and this writer copies:
//! * `80 05` (PROTO 5), then the body in frames: `95` + u64 LE length. A frame is committed when it
//!   has reached 64 KiB after a tuple element has been written (never after the top-level object),
//!   bytes/str payloads of 64 KiB or more are written outside any frame, and a final frame shorter
//!   than 4 bytes gets no header.
//! * ints: `4b u8`, `4d u16`, `4a i32` (negative too), otherwise `8a n` + minimal two's complement
//!   little-endian bytes; ints and None are never memoised.
//! * bytes `43`/`42`/`8e`, str `8c`/`58`/`8d` (UTF-8), each followed by MEMOIZE `94`.
//! * tuples: `29` when empty (not memoised); 1-3 items: items then `85`/`86`/`87`; longer: `28`
//!   items `74`; then MEMOIZE `94`.
//! * The memo is keyed by object identity: a second occurrence of the *same* Python object is
//!   written as a memo get (`68 idx`, or `6a u32` from index 256). Only strings can be the same
//!   object twice in vLLM's preimages: the code's literal tags (`"mm"` twice in one block) and
//!   CPython's cached single-character / empty strings. Callers mark those as `shared`.

use super::preimage::PreimageWriter;

const PROTO: u8 = 0x80;
const FRAME: u8 = 0x95;
const FRAME_HEADER_SIZE: usize = 9;
const FRAME_SIZE_MIN: usize = 4;
const FRAME_SIZE_TARGET: usize = 64 * 1024;
const STOP: u8 = 0x2e;
const MEMOIZE: u8 = 0x94;
const BINGET: u8 = 0x68;
const LONG_BINGET: u8 = 0x6a;
const NONE: u8 = 0x4e;
const BININT: u8 = 0x4a;
const BININT1: u8 = 0x4b;
const BININT2: u8 = 0x4d;
const LONG1: u8 = 0x8a;
const LONG4: u8 = 0x8b;
const SHORT_BINBYTES: u8 = 0x43;
const BINBYTES: u8 = 0x42;
const BINBYTES8: u8 = 0x8e;
const SHORT_BINUNICODE: u8 = 0x8c;
const BINUNICODE: u8 = 0x58;
const BINUNICODE8: u8 = 0x8d;
const EMPTY_TUPLE: u8 = 0x29;
const MARK: u8 = 0x28;
const TUPLE: u8 = 0x74;
const TUPLE1: u8 = 0x85;

/// Streams one pickle into a caller-owned buffer.
pub(crate) struct PickleWriter<'a> {
    out: &'a mut Vec<u8>,
    /// Start of the open frame's reserved header, if a frame is open.
    frame_start: Option<usize>,
    /// Number of memo entries so far (the next MEMOIZE gets this index).
    memo_len: u32,
    /// Memo indexes of the strings that are one shared Python object per value.
    shared: Vec<(String, u32)>,
    /// How many tuples are open.
    depth: usize,
}

impl<'a> PickleWriter<'a> {
    /// Starts a pickle (clears `out` and writes PROTO 5).
    pub(crate) fn new(out: &'a mut Vec<u8>) -> Self {
        out.clear();
        out.extend_from_slice(&[PROTO, 5]);
        PickleWriter {
            out,
            frame_start: None,
            memo_len: 0,
            shared: Vec::new(),
            depth: 0,
        }
    }

    /// Writes into the current frame, opening one if none is open.
    fn write(&mut self, data: &[u8]) {
        if self.frame_start.is_none() {
            self.frame_start = Some(self.out.len());
            self.out.extend_from_slice(&[0u8; FRAME_HEADER_SIZE]);
        }
        self.out.extend_from_slice(data);
    }

    fn commit_frame(&mut self) {
        let Some(start) = self.frame_start.take() else {
            return;
        };
        let frame_len = self.out.len() - start - FRAME_HEADER_SIZE;
        if frame_len >= FRAME_SIZE_MIN {
            self.out[start] = FRAME;
            self.out[start + 1..start + FRAME_HEADER_SIZE]
                .copy_from_slice(&(frame_len as u64).to_le_bytes());
        } else {
            self.out.drain(start..start + FRAME_HEADER_SIZE);
        }
    }

    /// CPython checks the frame size after each tuple element it has saved.
    fn element_done(&mut self) {
        if self.depth == 0 {
            return;
        }
        if let Some(start) = self.frame_start {
            if self.out.len() - start - FRAME_HEADER_SIZE >= FRAME_SIZE_TARGET {
                self.commit_frame();
            }
        }
    }

    fn memoize(&mut self) -> u32 {
        self.write(&[MEMOIZE]);
        let idx = self.memo_len;
        self.memo_len += 1;
        idx
    }

    fn memo_get(&mut self, idx: u32) {
        match u8::try_from(idx) {
            Ok(small) => self.write(&[BINGET, small]),
            Err(_) => {
                let mut op = [LONG_BINGET, 0, 0, 0, 0];
                op[1..].copy_from_slice(&idx.to_le_bytes());
                self.write(&op);
            }
        }
    }

    /// An opcode + length header followed by a payload; big payloads bypass framing.
    fn write_sized(&mut self, header: &[u8], payload: &[u8]) {
        if payload.len() >= FRAME_SIZE_TARGET {
            self.commit_frame();
            self.out.extend_from_slice(header);
            self.out.extend_from_slice(payload);
        } else {
            self.write(header);
            self.write(payload);
        }
    }

    fn sized_header(len: usize, short: u8, long: u8, huge: u8) -> ([u8; 9], usize) {
        let mut h = [0u8; 9];
        if len <= 0xff {
            h[0] = short;
            h[1] = len as u8;
            (h, 2)
        } else if let Ok(l32) = u32::try_from(len) {
            h[0] = long;
            h[1..5].copy_from_slice(&l32.to_le_bytes());
            (h, 5)
        } else {
            h[0] = huge;
            h[1..9].copy_from_slice(&(len as u64).to_le_bytes());
            (h, 9)
        }
    }

    fn write_long(&mut self, v: i128) {
        if let Ok(small) = i32::try_from(v) {
            if (0..=0xff).contains(&small) {
                self.write(&[BININT1, small as u8]);
            } else if (0..=0xffff).contains(&small) {
                let b = (small as u16).to_le_bytes();
                self.write(&[BININT2, b[0], b[1]]);
            } else {
                let b = small.to_le_bytes();
                self.write(&[BININT, b[0], b[1], b[2], b[3]]);
            }
            return;
        }
        let bytes = v.to_le_bytes();
        let n = minimal_twos_complement_len(v);
        // n <= 16, so LONG4 is never needed for the values this writer takes.
        debug_assert!(n <= 255, "LONG4 ({LONG4:#x}) not needed");
        self.write(&[LONG1, n as u8]);
        self.write(&bytes[..n]);
    }
}

/// The number of bytes of the shortest little-endian two's complement form of `v` (CPython's
/// `encode_long`).
fn minimal_twos_complement_len(v: i128) -> usize {
    let mut n = 1;
    while n < 16 {
        let bits = 8 * n as u32;
        let min = -(1i128 << (bits - 1));
        let max = (1i128 << (bits - 1)) - 1;
        if v >= min && v <= max {
            return n;
        }
        n += 1;
    }
    16
}

impl PreimageWriter for PickleWriter<'_> {
    fn none(&mut self) {
        self.write(&[NONE]);
        self.element_done();
    }

    fn uint(&mut self, v: u64) {
        self.write_long(i128::from(v));
        self.element_done();
    }

    fn int(&mut self, v: i64) {
        self.write_long(i128::from(v));
        self.element_done();
    }

    fn bytes(&mut self, b: &[u8]) {
        let (h, n) = Self::sized_header(b.len(), SHORT_BINBYTES, BINBYTES, BINBYTES8);
        self.write_sized(&h[..n], b);
        self.memoize();
        self.element_done();
    }

    fn text(&mut self, s: &str, shared: bool) {
        if shared {
            if let Some(idx) = self.shared.iter().find(|(k, _)| k == s).map(|(_, i)| *i) {
                self.memo_get(idx);
                self.element_done();
                return;
            }
        }
        let (h, n) = Self::sized_header(s.len(), SHORT_BINUNICODE, BINUNICODE, BINUNICODE8);
        self.write_sized(&h[..n], s.as_bytes());
        let idx = self.memoize();
        if shared {
            self.shared.push((s.to_owned(), idx));
        }
        self.element_done();
    }

    fn tuple_begin(&mut self, len: usize) {
        if len > 3 {
            self.write(&[MARK]);
        }
        self.depth += 1;
    }

    fn tuple_end(&mut self, len: usize) {
        self.depth = self.depth.saturating_sub(1);
        match len {
            0 => self.write(&[EMPTY_TUPLE]),
            1..=3 => {
                self.write(&[TUPLE1 + (len as u8 - 1)]);
                self.memoize();
            }
            _ => {
                self.write(&[TUPLE]);
                self.memoize();
            }
        }
        self.element_done();
    }

    fn finish(mut self) {
        self.write(&[STOP]);
        self.commit_frame();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pickle_with(f: impl FnOnce(&mut PickleWriter<'_>)) -> String {
        let mut buf = Vec::new();
        let mut w = PickleWriter::new(&mut buf);
        f(&mut w);
        w.finish();
        hex::encode(buf)
    }

    /// The body of a one-frame pickle: strips `80 05 95 <len>` and the final `2e`.
    fn body(hex_pickle: &str) -> &str {
        &hex_pickle[22..hex_pickle.len() - 2]
    }

    fn int_body(v: i64) -> String {
        let mut buf = Vec::new();
        let mut w = PickleWriter::new(&mut buf);
        w.tuple_begin(1);
        w.int(v);
        w.tuple_end(1);
        w.finish();
        let h = hex::encode(&buf);
        // strip header and the `85 94 2e` tail
        h[22..h.len() - 6].to_owned()
    }

    #[test]
    fn int_widths_match_cpython() {
        // Expected bytes from CPython 3.11 `pickle.dumps((v,), 5)`.
        let cases: &[(i64, &str)] = &[
            (0, "4b00"),
            (255, "4bff"),
            (256, "4d0001"),
            (65535, "4dffff"),
            (65536, "4a00000100"),
            (0x7fff_ffff, "4affffff7f"),
            (0x8000_0000, "8a050000008000"),
            (0xffff_ffff, "8a05ffffffff00"),
            (-1, "4affffffff"),
            (-8, "4af8ffffff"),
            (-0x8000_0000, "4a00000080"),
            (-0x8000_0001, "8a05ffffff7fff"),
            (-(1 << 32), "8a0500000000ff"),
            (-(1 << 39), "8a050000000080"),
            (1 << 40, "8a06000000000001"),
            (i64::MAX, "8a08ffffffffffffff7f"),
            (i64::MIN, "8a080000000000000080"),
        ];
        for (v, want) in cases {
            assert_eq!(int_body(*v), *want, "int {v}");
        }
    }

    #[test]
    fn u32_tokens_at_and_above_2_pow_31_use_long1() {
        let h = pickle_with(|w| {
            w.tuple_begin(2);
            w.uint(u64::from(u32::MAX));
            w.uint(1 << 31);
            w.tuple_end(2);
        });
        assert_eq!(body(&h), "8a05ffffffff008a0500000080008694");
    }

    #[test]
    fn seed_string_pickle_matches_vllm_none_hash_preimage() {
        let h = pickle_with(|w| w.text("vllm-none-hash", false));
        assert_eq!(
            h,
            "80059512000000000000008c0e766c6c6d2d6e6f6e652d68617368942e"
        );
    }

    #[test]
    fn shared_strings_become_memo_gets_and_plain_ones_do_not() {
        let h = pickle_with(|w| {
            w.tuple_begin(3);
            w.text("mm", true);
            w.text("mm", true);
            w.text("mm", false);
            w.tuple_end(3);
        });
        assert_eq!(body(&h), "8c026d6d9468008c026d6d948794");
    }

    #[test]
    fn empty_and_long_tuples() {
        let h = pickle_with(|w| {
            w.tuple_begin(2);
            w.tuple_begin(0);
            w.tuple_end(0);
            w.tuple_begin(4);
            for i in 1..=4 {
                w.uint(i);
            }
            w.tuple_end(4);
            w.tuple_end(2);
        });
        assert_eq!(body(&h), "29284b014b024b034b0474948694");
    }

    #[test]
    fn tiny_final_frame_has_no_header() {
        // A bare None pickles as 80 05 4e 2e: the 2-byte frame is below FRAME_SIZE_MIN.
        assert_eq!(pickle_with(|w| w.none()), "80054e2e");
    }

    #[test]
    fn memo_get_switches_to_long_binget_after_255() {
        let mut buf = Vec::new();
        let mut w = PickleWriter::new(&mut buf);
        w.tuple_begin(258);
        for i in 0..256 {
            w.text(&format!("s{i}"), false);
        }
        w.text("tag", true);
        w.text("tag", true);
        w.tuple_end(258);
        w.finish();
        let h = hex::encode(&buf);
        assert!(
            h.ends_with("8c03746167946a0001000074942e"),
            "{}",
            &h[h.len() - 40..]
        );
    }

    #[test]
    fn big_frames_split_like_cpython() {
        // CPython 3.11: pickle.dumps((b'\x01'*32, (7,)*32749, None), 5) has frames of 65536 and 4
        // bytes; with 32748 ints it is one frame of 65538 bytes.
        for (k, frames) in [(32749usize, vec![65536u64, 4]), (32748, vec![65538])] {
            let mut buf = Vec::new();
            let mut w = PickleWriter::new(&mut buf);
            w.tuple_begin(3);
            w.bytes(&[1u8; 32]);
            w.tuple_begin(k);
            for _ in 0..k {
                w.uint(7);
            }
            w.tuple_end(k);
            w.none();
            w.tuple_end(3);
            w.finish();
            let mut got = Vec::new();
            let mut pos = 2;
            while pos < buf.len() && buf[pos] == FRAME {
                let len = u64::from_le_bytes(buf[pos + 1..pos + 9].try_into().expect("8 bytes"));
                got.push(len);
                pos += 9 + len as usize;
            }
            assert_eq!(got, frames, "k={k}");
            assert_eq!(pos, buf.len());
        }
    }

    #[test]
    fn huge_strings_are_written_outside_frames() {
        // CPython: pickle.dumps((b'\x01'*32, (1,2), (("lora", "a"*70000, "p"),)), 5): a 48-byte
        // frame, the BINUNICODE outside any frame, then a 12-byte frame.
        let big = "a".repeat(70000);
        let mut buf = Vec::new();
        let mut w = PickleWriter::new(&mut buf);
        w.tuple_begin(3);
        w.bytes(&[1u8; 32]);
        w.tuple_begin(2);
        w.uint(1);
        w.uint(2);
        w.tuple_end(2);
        w.tuple_begin(1);
        w.tuple_begin(3);
        w.text("lora", true);
        w.text(&big, false);
        w.text("p", true);
        w.tuple_end(3);
        w.tuple_end(1);
        w.tuple_end(3);
        w.finish();
        assert_eq!(buf.len(), 70085);
        assert_eq!(&buf[2..11], &[FRAME, 48, 0, 0, 0, 0, 0, 0, 0]);
        assert_eq!(buf[59], BINUNICODE);
        assert_eq!(&buf[70064..70073], &[FRAME, 12, 0, 0, 0, 0, 0, 0, 0]);
    }
}
