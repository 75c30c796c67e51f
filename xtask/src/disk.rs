//! Free disk space before a build. A clean `cargo xtask test` writes ~8.5 GB into the target
//! directory (measured 2026-12-05 from an empty debug directory: ~3.3 GB of debug artifacts,
//! the release, Wasm and e2e builds, the tool cache); a disk that fills up mid-build fails with
//! `No space left on device` deep in a compiler's output (a CI run did). This warns first, naming
//! the filesystem and what is free.

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

/// Bytes a clean `cargo xtask test` writes into its target directory, rounded up.
pub const CLEAN_TEST_BYTES: u64 = 10 << 30;

/// Bytes this user may still write on the filesystem holding `path` (or its nearest existing
/// ancestor); `None` when that cannot be read.
pub fn available_bytes(path: &Path) -> Option<u64> {
    let existing = path.ancestors().find(|p| p.exists())?;
    let c_path = CString::new(existing.as_os_str().as_bytes()).ok()?;
    // SAFETY: an all-zero `statvfs` is a valid value of this plain C struct.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: `c_path` is NUL-terminated and `st` is a valid place for the answer.
    let rc = unsafe { libc::statvfs(c_path.as_ptr(), &mut st) };
    (rc == 0).then(|| st.f_bavail.saturating_mul(st.f_frsize))
}

/// The warning for `free` bytes left under `dir` when a build may need `needed`; `None` when
/// there is room.
pub fn low_space_warning(dir: &Path, free: u64, needed: u64) -> Option<String> {
    const GB: f64 = (1u64 << 30) as f64;
    (free < needed).then(|| {
        format!(
            "only {:.1} GB free on the filesystem of {} (a clean build writes up to {:.0} GB): \
             it may fail with `No space left on device`; free space there or set \
             CARGO_TARGET_DIR to another disk",
            free as f64 / GB,
            dir.display(),
            needed as f64 / GB
        )
    })
}

/// Prints [`low_space_warning`] for `dir` when it applies.
pub fn warn_if_low(dir: &Path, needed: u64, who: &str) {
    let warning = available_bytes(dir).and_then(|free| low_space_warning(dir, free, needed));
    if let Some(w) = warning {
        eprintln!("{who}: warning: {w}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn free_space_is_read_from_the_nearest_existing_directory() {
        let dir = std::env::temp_dir();
        let free = available_bytes(&dir).expect("statvfs of the temp dir");
        assert!(free > 0);
        let missing = dir.join("kvroute-no-such-dir/below");
        assert!(available_bytes(&missing).is_some(), "its ancestor is read");
    }

    #[test]
    fn the_warning_names_the_directory_and_the_numbers() {
        let dir = Path::new("/srv/target");
        assert_eq!(low_space_warning(dir, 20 << 30, CLEAN_TEST_BYTES), None);
        let w = low_space_warning(dir, 1 << 29, CLEAN_TEST_BYTES).expect("low");
        assert!(w.contains("0.5 GB free"), "{w}");
        assert!(w.contains("/srv/target") && w.contains("10 GB"), "{w}");
    }
}
