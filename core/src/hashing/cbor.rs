//! A minimal canonical CBOR (RFC 8949 core deterministic encoding) writer that reproduces
//! `cbor2.dumps(obj, canonical=True)` for the object shapes vLLM hashes: tuples become arrays,
//! bytes byte strings, str text strings, ints use the shortest head (negative ints as major type
//! 1), None is `f6`. No maps, floats or tags occur, so nothing else of canonical ordering applies.

use super::preimage::PreimageWriter;

const MAJOR_UINT: u8 = 0;
const MAJOR_NEGINT: u8 = 1;
const MAJOR_BYTES: u8 = 2;
const MAJOR_TEXT: u8 = 3;
const MAJOR_ARRAY: u8 = 4;
const NULL: u8 = 0xf6;

/// Streams one canonical CBOR item into a caller-owned buffer.
pub(crate) struct CborWriter<'a> {
    out: &'a mut Vec<u8>,
}

impl<'a> CborWriter<'a> {
    /// Starts an item (clears `out`).
    pub(crate) fn new(out: &'a mut Vec<u8>) -> Self {
        out.clear();
        CborWriter { out }
    }

    /// Writes a major type with its argument in the shortest form.
    fn head(&mut self, major: u8, arg: u64) {
        let m = major << 5;
        if arg < 24 {
            self.out.push(m | arg as u8);
        } else if let Ok(v) = u8::try_from(arg) {
            self.out.extend_from_slice(&[m | 24, v]);
        } else if let Ok(v) = u16::try_from(arg) {
            self.out.push(m | 25);
            self.out.extend_from_slice(&v.to_be_bytes());
        } else if let Ok(v) = u32::try_from(arg) {
            self.out.push(m | 26);
            self.out.extend_from_slice(&v.to_be_bytes());
        } else {
            self.out.push(m | 27);
            self.out.extend_from_slice(&arg.to_be_bytes());
        }
    }
}

impl PreimageWriter for CborWriter<'_> {
    fn none(&mut self) {
        self.out.push(NULL);
    }

    fn uint(&mut self, v: u64) {
        self.head(MAJOR_UINT, v);
    }

    fn int(&mut self, v: i64) {
        if v >= 0 {
            self.head(MAJOR_UINT, v as u64);
        } else {
            // -1 - v never overflows for negative i64.
            self.head(MAJOR_NEGINT, (-1 - v) as u64);
        }
    }

    fn bytes(&mut self, b: &[u8]) {
        self.head(MAJOR_BYTES, b.len() as u64);
        self.out.extend_from_slice(b);
    }

    fn text(&mut self, s: &str, _shared: bool) {
        self.head(MAJOR_TEXT, s.len() as u64);
        self.out.extend_from_slice(s.as_bytes());
    }

    fn tuple_begin(&mut self, len: usize) {
        self.head(MAJOR_ARRAY, len as u64);
    }

    fn tuple_end(&mut self, _len: usize) {}

    fn finish(self) {}
}

#[cfg(test)]
mod tests {
    use super::*;

    fn int_hex(v: i64) -> String {
        let mut buf = Vec::new();
        let mut w = CborWriter::new(&mut buf);
        w.int(v);
        w.finish();
        hex::encode(buf)
    }

    #[test]
    fn minimal_int_heads() {
        // Expected bytes from cbor2.dumps(v, canonical=True).
        let cases: &[(i64, &str)] = &[
            (0, "00"),
            (23, "17"),
            (24, "1818"),
            (255, "18ff"),
            (256, "190100"),
            (65535, "19ffff"),
            (65536, "1a00010000"),
            (0xffff_ffff, "1affffffff"),
            (1 << 32, "1b0000000100000000"),
            (i64::MAX, "1b7fffffffffffffff"),
            (-1, "20"),
            (-24, "37"),
            (-25, "3818"),
            (-256, "38ff"),
            (-257, "390100"),
            (-8, "27"),
            (-65537, "3a00010000"),
            (i64::MIN, "3b7fffffffffffffff"),
        ];
        for (v, want) in cases {
            assert_eq!(int_hex(*v), *want, "int {v}");
        }
    }

    #[test]
    fn strings_bytes_arrays_and_null() {
        let mut buf = Vec::new();
        let mut w = CborWriter::new(&mut buf);
        w.tuple_begin(4);
        w.bytes(&[0xab; 16]);
        w.text("mm", true);
        w.uint(u64::from(u32::MAX));
        w.none();
        w.tuple_end(4);
        w.finish();
        assert_eq!(
            hex::encode(buf),
            "8450abababababababababababababababab626d6d1affffffff f6".replace(' ', "")
        );
        let mut buf = Vec::new();
        let mut w = CborWriter::new(&mut buf);
        w.text(&"x".repeat(300), false);
        w.finish();
        assert_eq!(&buf[..3], &[0x79, 0x01, 0x2c]);
    }
}
