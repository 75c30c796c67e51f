//! Byte-level edits of a valid input, for property tests that feed a parser almost-valid bytes:
//! flip a byte, insert a token (random bytes or one of the caller's syntax pieces), delete a
//! run, truncate, or duplicate a run. Every edit applies to any input, empty included.

use proptest::prelude::*;

/// One edit; positions are taken modulo the input's length when applied.
#[derive(Debug, Clone)]
pub enum ByteMutation {
    /// XOR the byte at the position with a non-zero value.
    Flip(usize, u8),
    /// Insert bytes at the position.
    Insert(usize, Vec<u8>),
    /// Delete up to this many bytes from the position.
    Delete(usize, usize),
    /// Cut the input at the position.
    Truncate(usize),
    /// Insert a copy of up to this many bytes from the position, at the position.
    Duplicate(usize, usize),
}

/// Edits that insert random bytes or one of `tokens` (the syntax of the format under test:
/// brackets, quotes, keywords, escapes), delete up to 15 bytes or duplicate up to 63.
pub fn byte_mutation(tokens: &'static [&'static str]) -> impl Strategy<Value = ByteMutation> {
    let token = prop_oneof![
        prop::collection::vec(any::<u8>(), 1..4),
        prop::sample::select(tokens).prop_map(|s: &str| s.as_bytes().to_vec()),
    ];
    prop_oneof![
        (any::<usize>(), any::<u8>()).prop_map(|(i, b)| ByteMutation::Flip(i, b)),
        (any::<usize>(), token).prop_map(|(i, t)| ByteMutation::Insert(i, t)),
        (any::<usize>(), 1usize..16).prop_map(|(i, n)| ByteMutation::Delete(i, n)),
        any::<usize>().prop_map(ByteMutation::Truncate),
        (any::<usize>(), 1usize..64).prop_map(|(i, n)| ByteMutation::Duplicate(i, n)),
    ]
}

/// Applies `m` to `bytes`.
pub fn apply(bytes: &mut Vec<u8>, m: &ByteMutation) {
    let len = bytes.len();
    let at = |i: usize| i % (len + 1);
    match m {
        ByteMutation::Flip(i, b) if len > 0 => bytes[i % len] ^= b | 1,
        ByteMutation::Flip(..) => {}
        ByteMutation::Insert(i, t) => {
            let i = at(*i);
            bytes.splice(i..i, t.iter().copied());
        }
        ByteMutation::Delete(i, n) => {
            let i = at(*i);
            bytes.drain(i..(i + n).min(len));
        }
        ByteMutation::Truncate(i) => bytes.truncate(at(*i)),
        ByteMutation::Duplicate(i, n) => {
            let i = at(*i);
            let chunk: Vec<u8> = bytes[i..(i + n).min(len)].to_vec();
            bytes.splice(i..i, chunk);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_edit_applies_to_any_input() {
        for input in [b"".to_vec(), b"{}".to_vec(), b"[1,2,3]".to_vec()] {
            for m in [
                ByteMutation::Flip(7, 0),
                ByteMutation::Insert(99, b"x".to_vec()),
                ByteMutation::Delete(5, 15),
                ByteMutation::Truncate(1),
                ByteMutation::Duplicate(3, 63),
            ] {
                let mut bytes = input.clone();
                apply(&mut bytes, &m);
            }
        }
        let mut b = b"abc".to_vec();
        apply(&mut b, &ByteMutation::Flip(1, 0));
        assert_eq!(b, b"acc");
        let mut b = b"abc".to_vec();
        apply(&mut b, &ByteMutation::Duplicate(1, 2));
        assert_eq!(b, b"abcbc");
        let mut b = b"abc".to_vec();
        apply(&mut b, &ByteMutation::Delete(1, 9));
        assert_eq!(b, b"a");
    }
}
