//! Block pool cost per scheduled token (filled in below).
fn main() {}
