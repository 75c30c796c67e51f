//! Router keys.
