//! The block hasher: algorithms, NONE_HASH, the preimage tuple, chaining, and the wire value.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};
use sha2::{Digest as _, Sha256};
use xxhash_rust::xxh3::xxh3_128;

use super::cbor::CborWriter;
use super::extra_keys::{parse_version, ExtraKeyStyle, HashExtraKey, RequestExtras};
use super::pickle::PickleWriter;
use super::preimage::PreimageWriter;

/// The seed vLLM >= 0.29 uses for sha256/sha256_cbor when `PYTHONHASHSEED` is unset.
pub const DEFAULT_NONE_HASH_SEED: &str = "vllm-none-hash";

/// vLLM's `--prefix-caching-hash-algo`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum HashAlgo {
    /// `sha256`: sha256 of pickle protocol 5 (the engine's default).
    Sha256,
    /// `sha256_cbor`: sha256 of canonical CBOR (the one to recommend: no Python object model).
    Sha256Cbor,
    /// `xxhash`: xxh3-128 of pickle protocol 5.
    Xxhash,
    /// `xxhash_cbor`: xxh3-128 of canonical CBOR.
    XxhashCbor,
}

impl HashAlgo {
    /// All algorithms.
    pub const ALL: [HashAlgo; 4] = [
        HashAlgo::Sha256,
        HashAlgo::Sha256Cbor,
        HashAlgo::Xxhash,
        HashAlgo::XxhashCbor,
    ];

    /// vLLM's name for the algorithm.
    pub fn as_str(&self) -> &'static str {
        match self {
            HashAlgo::Sha256 => "sha256",
            HashAlgo::Sha256Cbor => "sha256_cbor",
            HashAlgo::Xxhash => "xxhash",
            HashAlgo::XxhashCbor => "xxhash_cbor",
        }
    }

    /// Digest length in bytes (32 for sha256*, 16 for xxhash*).
    pub fn digest_len(&self) -> usize {
        match self {
            HashAlgo::Sha256 | HashAlgo::Sha256Cbor => 32,
            HashAlgo::Xxhash | HashAlgo::XxhashCbor => 16,
        }
    }

    /// Whether vLLM derives a fixed NONE_HASH seed for it when `PYTHONHASHSEED` is unset
    /// (only the cryptographic ones).
    pub fn has_default_seed(&self) -> bool {
        matches!(self, HashAlgo::Sha256 | HashAlgo::Sha256Cbor)
    }

    fn uses_cbor(&self) -> bool {
        matches!(self, HashAlgo::Sha256Cbor | HashAlgo::XxhashCbor)
    }
}

impl fmt::Display for HashAlgo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for HashAlgo {
    type Err = HashError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        HashAlgo::ALL
            .into_iter()
            .find(|a| a.as_str() == s)
            .ok_or_else(|| HashError::UnknownAlgo(s.to_owned()))
    }
}

/// How an engine hashes blocks: what kvroute must know to reproduce its block hashes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HashConfig {
    /// `--prefix-caching-hash-algo`.
    pub algo: HashAlgo,
    /// The engine's `PYTHONHASHSEED` value, `None` when unset.
    pub seed: Option<String>,
    /// Shape of the extra keys (from the engine version).
    #[serde(default)]
    pub style: ExtraKeyStyle,
}

impl HashConfig {
    /// A config for a current (>= 0.31) engine.
    pub fn new(algo: HashAlgo, seed: Option<String>) -> Self {
        HashConfig {
            algo,
            seed,
            style: ExtraKeyStyle::Tagged,
        }
    }

    /// The config for an engine of the given vLLM version. Errors when that engine's hashes
    /// cannot be reproduced: vLLM < 0.29 without `PYTHONHASHSEED` (random NONE_HASH for every
    /// algorithm), or an unparsable version.
    pub fn for_engine_version(
        algo: HashAlgo,
        seed: Option<String>,
        engine_version: &str,
    ) -> Result<Self, HashError> {
        let (major, minor) = parse_version(engine_version)
            .ok_or_else(|| HashError::BadEngineVersion(engine_version.to_owned()))?;
        if seed.is_none() && (major, minor) < (0, 29) {
            return Err(HashError::UnreproducibleSeed {
                algo,
                engine_version: Some(engine_version.to_owned()),
            });
        }
        Ok(HashConfig {
            algo,
            seed,
            style: ExtraKeyStyle::for_engine_version(engine_version),
        })
    }

    /// The string NONE_HASH is derived from, or the error that makes it unknowable.
    pub fn none_hash_seed(&self) -> Result<&str, HashError> {
        match (&self.seed, self.algo.has_default_seed()) {
            (Some(seed), _) => Ok(seed),
            (None, true) => Ok(DEFAULT_NONE_HASH_SEED),
            (None, false) => Err(HashError::UnreproducibleSeed {
                algo: self.algo,
                engine_version: None,
            }),
        }
    }
}

/// Errors of the hashing module.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HashError {
    /// The engine derives NONE_HASH from a random per-process seed, so nobody else can compute
    /// its block hashes.
    #[error(
        "{algo}{} without PYTHONHASHSEED uses a random NONE_HASH per engine process, so its block \
         hashes cannot be reproduced: start every engine with the same PYTHONHASHSEED and configure \
         that seed here (or use sha256_cbor on vLLM >= 0.29)",
        engine_version.as_deref().map(|v| format!(" on vLLM {v}")).unwrap_or_default()
    )]
    UnreproducibleSeed {
        /// The engine's algorithm.
        algo: HashAlgo,
        /// The engine version, when the version is the reason (< 0.29).
        engine_version: Option<String>,
    },
    /// Not one of vLLM's algorithm names.
    #[error("unknown prefix-caching hash algorithm {0:?}: expected sha256, sha256_cbor, xxhash or xxhash_cbor")]
    UnknownAlgo(String),
    /// An engine version that is not `MAJOR.MINOR[.PATCH...]`.
    #[error("cannot parse vLLM version {0:?}: expected e.g. \"0.33.0\"")]
    BadEngineVersion(String),
}

/// A full block hash as the engine keeps it: 32 bytes (sha256*) or 16 bytes (xxhash*).
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Digest {
    bytes: [u8; 32],
    len: u8,
}

impl Digest {
    /// A digest from its bytes; `None` unless 16 or 32 bytes long.
    pub fn from_slice(b: &[u8]) -> Option<Self> {
        if b.len() != 16 && b.len() != 32 {
            return None;
        }
        let mut bytes = [0u8; 32];
        bytes[..b.len()].copy_from_slice(b);
        Some(Digest {
            bytes,
            len: b.len() as u8,
        })
    }

    /// The digest bytes.
    pub fn as_bytes(&self) -> &[u8] {
        &self.bytes[..usize::from(self.len)]
    }

    /// Lower-case hex of the digest bytes.
    pub fn to_hex(&self) -> String {
        hex::encode(self.as_bytes())
    }
}

impl fmt::Debug for Digest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Digest({})", self.to_hex())
    }
}

impl fmt::Display for Digest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_hex())
    }
}

/// The value vLLM puts in events for a digest (`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1`, the
/// default): `int.from_bytes(digest, "big") & (2**64 - 1)`, i.e. the last 8 bytes big-endian.
pub fn wire_u64(d: &Digest) -> u64 {
    let b = d.as_bytes();
    let mut tail = [0u8; 8];
    tail.copy_from_slice(&b[b.len() - 8..]);
    u64::from_be_bytes(tail)
}

/// The most blocks a prompt of `num_tokens` tokens can take from the prefix cache: the last
/// prompt token is always recomputed, so `(num_tokens - 1) / block_size` (0 for an empty prompt
/// or a zero block size).
pub fn usable_hit_blocks(num_tokens: usize, block_size: usize) -> usize {
    match (num_tokens, block_size) {
        (0, _) | (_, 0) => 0,
        (n, bs) => (n - 1) / bs,
    }
}

/// Whether CPython hands out one shared object for this string value whatever produced it: the
/// empty string and one-character Latin-1 strings are cached singletons.
fn is_cpython_singleton(s: &str) -> bool {
    let mut chars = s.chars();
    match (chars.next(), chars.next()) {
        (None, _) => true,
        (Some(c), None) => u32::from(c) < 256,
        _ => false,
    }
}

fn write_key<W: PreimageWriter>(w: &mut W, key: &HashExtraKey) {
    match key {
        HashExtraKey::Str(s) => w.text(s, is_cpython_singleton(s)),
        HashExtraKey::Tag(s) => w.text(s, true),
        HashExtraKey::Int(v) => w.int(*v),
        HashExtraKey::Bytes(b) => w.bytes(b),
        HashExtraKey::Tuple(items) => {
            w.tuple_begin(items.len());
            for item in items {
                write_key(w, item);
            }
            w.tuple_end(items.len());
        }
    }
}

fn write_block<W: PreimageWriter>(
    mut w: W,
    parent: &[u8],
    tokens: &[u32],
    extra: Option<&[HashExtraKey]>,
) {
    w.tuple_begin(3);
    w.bytes(parent);
    w.tuple_begin(tokens.len());
    for t in tokens {
        w.uint(u64::from(*t));
    }
    w.tuple_end(tokens.len());
    match extra {
        None => w.none(),
        Some(keys) => {
            w.tuple_begin(keys.len());
            for key in keys {
                write_key(&mut w, key);
            }
            w.tuple_end(keys.len());
        }
    }
    w.tuple_end(3);
    w.finish();
}

/// The seed serialised as a Python str.
fn write_seed(algo: HashAlgo, seed: &str, buf: &mut Vec<u8>) {
    if algo.uses_cbor() {
        let mut w = CborWriter::new(buf);
        w.text(seed, false);
        w.finish();
    } else {
        let mut w = PickleWriter::new(buf);
        w.text(seed, false);
        w.finish();
    }
}

/// The algorithm's digest of `bytes` (xxh3-128 in canonical big-endian order).
fn digest(algo: HashAlgo, bytes: &[u8]) -> Digest {
    let mut out = [0u8; 32];
    match algo {
        HashAlgo::Sha256 | HashAlgo::Sha256Cbor => {
            out.copy_from_slice(&Sha256::digest(bytes));
            Digest {
                bytes: out,
                len: 32,
            }
        }
        HashAlgo::Xxhash | HashAlgo::XxhashCbor => {
            out[..16].copy_from_slice(&xxh3_128(bytes).to_be_bytes());
            Digest {
                bytes: out,
                len: 16,
            }
        }
    }
}

/// Computes an engine's block hashes exactly as vLLM does (see the module docs).
#[derive(Debug, Clone)]
pub struct BlockHasher {
    algo: HashAlgo,
    style: ExtraKeyStyle,
    seed: String,
    none_hash: Digest,
}

impl BlockHasher {
    /// A hasher for `cfg`; computes NONE_HASH. Errors when the engine's hashes are not
    /// reproducible (xxhash* without a seed).
    pub fn new(cfg: &HashConfig) -> Result<Self, HashError> {
        let seed = cfg.none_hash_seed()?.to_owned();
        let mut buf = Vec::new();
        write_seed(cfg.algo, &seed, &mut buf);
        Ok(BlockHasher {
            algo: cfg.algo,
            style: cfg.style,
            seed,
            none_hash: digest(cfg.algo, &buf),
        })
    }

    /// The algorithm.
    pub fn algo(&self) -> HashAlgo {
        self.algo
    }

    /// The extra-key style.
    pub fn style(&self) -> ExtraKeyStyle {
        self.style
    }

    /// NONE_HASH, the parent of every chain's first block.
    pub fn none_hash(&self) -> &Digest {
        &self.none_hash
    }

    /// The bytes NONE_HASH is the digest of (the seed serialised as a Python str).
    pub fn none_hash_preimage(&self) -> Vec<u8> {
        let mut buf = Vec::new();
        self.write_seed(&mut buf);
        buf
    }

    fn write_seed(&self, buf: &mut Vec<u8>) {
        write_seed(self.algo, &self.seed, buf);
    }

    fn digest(&self, bytes: &[u8]) -> Digest {
        digest(self.algo, bytes)
    }

    /// Writes the serialised `(parent, tuple(tokens), extra)` into `buf` (cleared first).
    pub fn preimage_into(
        &self,
        buf: &mut Vec<u8>,
        parent: &Digest,
        tokens: &[u32],
        extra: Option<&[HashExtraKey]>,
    ) {
        if self.algo.uses_cbor() {
            write_block(CborWriter::new(buf), parent.as_bytes(), tokens, extra);
        } else {
            write_block(PickleWriter::new(buf), parent.as_bytes(), tokens, extra);
        }
    }

    /// The exact bytes vLLM serialises for one block before digesting them.
    pub fn preimage(
        &self,
        parent: &Digest,
        tokens: &[u32],
        extra: Option<&[HashExtraKey]>,
    ) -> Vec<u8> {
        let mut buf = Vec::new();
        self.preimage_into(&mut buf, parent, tokens, extra);
        buf
    }

    /// The hash of one full block: `hash_fn((parent, tuple(tokens), extra))`. Pass `None` for a
    /// block without extra keys (vLLM never hashes an empty tuple).
    pub fn hash_block(
        &self,
        parent: &Digest,
        tokens: &[u32],
        extra: Option<&[HashExtraKey]>,
    ) -> Digest {
        let mut buf = Vec::with_capacity(64 + tokens.len() * 5);
        self.preimage_into(&mut buf, parent, tokens, extra);
        self.digest(&buf)
    }

    /// The chained hashes of every full block of a prompt (a partial tail is never hashed);
    /// empty for a zero block size.
    pub fn block_hashes(
        &self,
        tokens: &[u32],
        block_size: usize,
        extras: &RequestExtras,
    ) -> Vec<Digest> {
        if block_size == 0 {
            return Vec::new();
        }
        let mut out = Vec::with_capacity(tokens.len() / block_size);
        let mut buf = Vec::with_capacity(64 + block_size * 5);
        let mut parent = self.none_hash;
        for (i, block) in tokens.chunks_exact(block_size).enumerate() {
            let keys = extras.block_extra_keys(i, block_size, self.style);
            self.preimage_into(&mut buf, &parent, block, keys.hash.as_deref());
            parent = self.digest(&buf);
            out.push(parent);
        }
        out
    }

    /// vLLM's hash of every full `block_size`-token block when requests are hashed every
    /// `hash_block_size` tokens (`--prefix-match-unit`): the chain runs over hash blocks and a
    /// block is named by the hash of its last one (`resolve_block_hashes`). Equal to
    /// [`BlockHasher::block_hashes`] when the two sizes are equal; empty when `hash_block_size` is
    /// zero or does not divide `block_size`.
    pub fn coarse_block_hashes(
        &self,
        tokens: &[u32],
        block_size: usize,
        hash_block_size: usize,
        extras: &RequestExtras,
    ) -> Vec<Digest> {
        if hash_block_size == 0 || block_size == 0 || !block_size.is_multiple_of(hash_block_size) {
            return Vec::new();
        }
        let per_block = block_size / hash_block_size;
        let fine = self.block_hashes(tokens, hash_block_size, extras);
        fine.into_iter()
            .skip(per_block - 1)
            .step_by(per_block)
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn algo_names_round_trip() {
        for a in HashAlgo::ALL {
            assert_eq!(a.to_string().parse::<HashAlgo>(), Ok(a));
            assert_eq!(
                serde_json::to_string(&a).ok(),
                Some(format!("\"{}\"", a.as_str()))
            );
        }
        assert!(matches!(
            "sha512".parse::<HashAlgo>(),
            Err(HashError::UnknownAlgo(_))
        ));
    }

    #[test]
    fn coarse_blocks_are_named_by_their_last_hash_block() {
        let h = BlockHasher::new(&HashConfig::new(HashAlgo::Sha256, None)).expect("hasher");
        let tokens: Vec<u32> = (0..70).collect();
        let none = RequestExtras::default();
        let fine = h.block_hashes(&tokens, 8, &none);
        let coarse = h.coarse_block_hashes(&tokens, 16, 8, &none);
        assert_eq!(coarse, vec![fine[1], fine[3], fine[5], fine[7]]);
        // Not what hashing whole blocks gives, which is why the self-check must know.
        assert_ne!(coarse, h.block_hashes(&tokens, 16, &none));
        assert_eq!(
            h.coarse_block_hashes(&tokens, 16, 16, &none),
            h.block_hashes(&tokens, 16, &none)
        );
        assert!(h.coarse_block_hashes(&tokens, 16, 6, &none).is_empty());
        assert!(h.coarse_block_hashes(&tokens, 16, 0, &none).is_empty());
    }

    #[test]
    fn xxhash_without_seed_is_refused() {
        for algo in [HashAlgo::Xxhash, HashAlgo::XxhashCbor] {
            let err = BlockHasher::new(&HashConfig::new(algo, None)).err();
            assert!(matches!(err, Some(HashError::UnreproducibleSeed { .. })));
            assert!(err
                .map(|e| e.to_string())
                .unwrap_or_default()
                .contains("PYTHONHASHSEED"));
            assert!(BlockHasher::new(&HashConfig::new(algo, Some("0".into()))).is_ok());
        }
    }

    #[test]
    fn old_engines_without_seed_are_refused() {
        let err = HashConfig::for_engine_version(HashAlgo::Sha256Cbor, None, "0.28.1");
        assert!(matches!(
            err,
            Err(HashError::UnreproducibleSeed {
                engine_version: Some(_),
                ..
            })
        ));
        let ok = HashConfig::for_engine_version(HashAlgo::Sha256Cbor, Some("7".into()), "0.28.1");
        assert_eq!(ok.map(|c| c.style), Ok(ExtraKeyStyle::Plain));
        let ok = HashConfig::for_engine_version(HashAlgo::Sha256, None, "0.29.0");
        assert_eq!(ok.map(|c| c.style), Ok(ExtraKeyStyle::Plain));
        assert!(matches!(
            HashConfig::for_engine_version(HashAlgo::Sha256, None, "latest"),
            Err(HashError::BadEngineVersion(_))
        ));
    }

    #[test]
    fn wire_value_and_usable_hits() {
        let d = Digest::from_slice(&[0x11; 16]).unwrap_or_else(|| unreachable!());
        assert_eq!(wire_u64(&d), 0x1111_1111_1111_1111);
        let mut b = [0u8; 32];
        b[24..].copy_from_slice(&[0xde, 0xad, 0xbe, 0xef, 0, 0, 0, 1]);
        let d = Digest::from_slice(&b).unwrap_or_else(|| unreachable!());
        assert_eq!(wire_u64(&d), 0xdead_beef_0000_0001);
        assert!(Digest::from_slice(&[0; 20]).is_none());
        assert_eq!(usable_hit_blocks(0, 16), 0);
        assert_eq!(usable_hit_blocks(16, 16), 0);
        assert_eq!(usable_hit_blocks(17, 16), 1);
        assert_eq!(usable_hit_blocks(1000, 16), 62);
        assert_eq!(usable_hit_blocks(10, 0), 0);
    }

    #[test]
    fn plain_style_pickle_has_no_tags() {
        // vLLM 0.15..=0.30 hashed ("sql-lora", ("img", 3), "salt") for block 0.
        let cfg = HashConfig {
            algo: HashAlgo::Sha256,
            seed: None,
            style: ExtraKeyStyle::Plain,
        };
        let h = BlockHasher::new(&cfg).unwrap_or_else(|e| panic!("{e}"));
        let keys = vec![
            HashExtraKey::Str("sql-lora".into()),
            HashExtraKey::Tuple(vec![HashExtraKey::Str("img".into()), HashExtraKey::Int(3)]),
            HashExtraKey::Str("salt".into()),
        ];
        let pre = hex::encode(h.preimage(h.none_hash(), &[1, 2], Some(&keys)));
        assert!(pre.ends_with(
            "4b014b028694\
             8c0873716c2d6c6f726194\
             8c03696d67944b038694\
             8c0473616c7494\
             879487942e"
        ));
    }

    #[test]
    fn single_char_strings_are_cpython_singletons() {
        assert!(is_cpython_singleton(""));
        assert!(is_cpython_singleton("a"));
        assert!(is_cpython_singleton("é"));
        assert!(!is_cpython_singleton("ā"));
        assert!(!is_cpython_singleton("ab"));
    }
}
