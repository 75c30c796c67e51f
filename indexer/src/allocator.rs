//! The allocator `kvroute-indexer` ships with (mimalloc) and how it is set up: one place, so
//! the binary and its benchmarks run the same allocator the same way
//! ([`global_allocator!`](crate::global_allocator)).
//!
//! mimalloc makes index ingest 25-40 % faster than glibc malloc (docs/performance.md). Its v3
//! defaults keep freed memory for a second and commit whole arenas up front, where a purge only
//! marks pages reusable and the kernel keeps counting them resident: a one-time burst (building
//! a model's tokenizer bundle and digest, ~46 MiB live at its peak) left the process at ~100 MiB.
//! [`configure`] sets v2's 10 ms purge delay and commit on demand (56 MiB; docs/operations.md,
//! "Sizing"). An operator's `MIMALLOC_*` environment still wins.

use std::ffi::CStr;
use std::os::raw::{c_char, c_long};

/// The global allocator type (declared by [`global_allocator!`](crate::global_allocator)).
pub use mimalloc::MiMalloc as Allocator;

/// `mi_option_arena_eager_commit` in the mimalloc v3 header that `libmimalloc-sys` 0.1.49 builds
/// (`include/mimalloc.h`, `mi_option_e`; the sys crate names only some options).
const ARENA_EAGER_COMMIT: libmimalloc_sys::mi_option_t = 4;
/// `mi_option_purge_delay` in the same enumeration (milliseconds).
const PURGE_DELAY: libmimalloc_sys::mi_option_t = 15;

/// One option [`configure`] sets.
struct Setting {
    option: libmimalloc_sys::mi_option_t,
    /// The environment variable that overrides it (mimalloc's own).
    env: &'static CStr,
    /// Its name in `/metrics`.
    label: &'static str,
    value: c_long,
}

/// The settings [`configure`] applies.
const SETTINGS: [Setting; 2] = [
    Setting {
        option: ARENA_EAGER_COMMIT,
        env: c"MIMALLOC_ARENA_EAGER_COMMIT",
        label: "arena_eager_commit",
        value: 0,
    },
    Setting {
        option: PURGE_DELAY,
        env: c"MIMALLOC_PURGE_DELAY",
        label: "purge_delay",
        value: 10,
    },
];

/// The options [`configure`] sets, as mimalloc holds them now: (name, value). `/metrics`
/// reports them, so a binary whose pre-`main` set-up did not run (or an environment that
/// overrides it) shows.
pub fn in_effect() -> [(&'static str, c_long); 2] {
    // SAFETY: reads an integer from mimalloc's option table.
    SETTINGS.map(|s| (s.label, unsafe { libmimalloc_sys::mi_option_get(s.option) }))
}

extern "C" {
    /// The C library's `getenv`: reads the environment without allocating, so [`configure`]
    /// can run before the first allocation.
    fn getenv(name: *const c_char) -> *const c_char;
}

/// Applies the allocator settings to every option the environment does not set. Allocates
/// nothing, so it can run (and on Linux does, from [`global_allocator!`](crate::global_allocator))
/// before the first allocation: commit on demand only applies to arenas reserved after it.
pub extern "C" fn configure() {
    for s in SETTINGS {
        // SAFETY: `getenv` reads a NUL-terminated name; nothing in this process changes its
        // environment while this runs (before `main`, or at its start).
        let from_env = unsafe { !getenv(s.env.as_ptr()).is_null() };
        if !from_env {
            // SAFETY: `mi_option_set` stores an integer in mimalloc's option table; callable at
            // any time from any thread, before or after mimalloc's own initialisation.
            unsafe { libmimalloc_sys::mi_option_set(s.option, s.value) };
        }
    }
}

/// Declares [`Allocator`] as the binary's global allocator and, on Linux, runs [`configure`]
/// before `main` (an `.init_array` entry, after mimalloc's own high-priority constructor and
/// before the Rust runtime's first allocation).
#[macro_export]
macro_rules! global_allocator {
    () => {
        #[global_allocator]
        static ALLOCATOR: $crate::allocator::Allocator = $crate::allocator::Allocator;

        #[cfg(target_os = "linux")]
        #[used]
        #[link_section = ".init_array"]
        static CONFIGURE_ALLOCATOR: extern "C" fn() = $crate::allocator::configure;
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn option_numbers_are_the_ones_the_sys_crate_names_around_them() {
        // The enumeration is positional: pin our two numbers to neighbours the crate names, so
        // a sys-crate upgrade that renumbers them fails here instead of setting another option.
        assert_eq!(ARENA_EAGER_COMMIT - 2, libmimalloc_sys::mi_option_verbose);
        assert_eq!(
            ARENA_EAGER_COMMIT + 2,
            libmimalloc_sys::mi_option_large_os_pages
        );
        assert_eq!(PURGE_DELAY + 1, libmimalloc_sys::mi_option_use_numa_nodes);
    }

    #[test]
    fn in_effect_names_every_setting() {
        let names: Vec<_> = in_effect().iter().map(|(n, _)| *n).collect();
        assert_eq!(names, ["arena_eager_commit", "purge_delay"]);
    }

    #[test]
    fn configure_sets_the_options_the_environment_leaves_alone() {
        configure();
        for (s, (label, now)) in SETTINGS.iter().zip(in_effect()) {
            let name = s.env.to_str().expect("ASCII");
            assert_eq!(label, s.label);
            if std::env::var_os(name).is_none() {
                assert_eq!(now, s.value, "{name}");
            }
        }
    }
}
