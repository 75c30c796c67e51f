//! Request to tokens.
