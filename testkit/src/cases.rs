//! One proptest configuration for every property test of the workspace.

use proptest::test_runner::{Config, FileFailurePersistence};

/// `default_cases` cases (or `PROPTEST_CASES` when set), failures kept in
/// `<test file>.proptest-regressions` next to the test (committed, replayed first), and at most
/// `max_shrink_iters` shrinking steps (proptest's default when `None`). The seed is proptest's:
/// `PROPTEST_RNG_SEED`, which `cargo xtask test` fixes.
pub fn config(default_cases: u32, max_shrink_iters: Option<u32>) -> Config {
    let cases = std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default_cases);
    let defaults = Config::default();
    Config {
        cases,
        failure_persistence: Some(Box::new(FileFailurePersistence::WithSource(
            "proptest-regressions",
        ))),
        max_shrink_iters: max_shrink_iters.unwrap_or(defaults.max_shrink_iters),
        ..defaults
    }
}
