//! The value stream a block-hash preimage is written as: the one interface between the hasher
//! (which walks `(parent, tokens, extra_keys)`) and the pickle and CBOR encoders (which implement
//! it). The encoders depend on this module only; the hasher depends on them.

/// Receives the Python object `(parent, tokens, extra_keys)` as a stream of values; implemented
/// by the pickle and CBOR writers.
pub(crate) trait PreimageWriter {
    /// Python `None`.
    fn none(&mut self);
    /// A non-negative int.
    fn uint(&mut self, v: u64);
    /// An int.
    fn int(&mut self, v: i64);
    /// A `bytes` object.
    fn bytes(&mut self, b: &[u8]);
    /// A `str`; `shared` when every occurrence of this value is the same Python object.
    fn text(&mut self, s: &str, shared: bool);
    /// Opens a tuple of `len` items.
    fn tuple_begin(&mut self, len: usize);
    /// Closes the tuple opened with the same `len`.
    fn tuple_end(&mut self, len: usize);
    /// Ends the top-level object.
    fn finish(self);
}
