//! The ABI rule: this module runs only inside the Envoy build its bindings were written for.
//!
//! Envoy itself only *warns* when a module reports another ABI version string, and then calls it
//! with whatever layouts it has; a wrong argument order would corrupt memory. So the module
//! checks for itself, at `envoy_dynamic_module_on_program_init`, that the process is the pinned
//! Envoy build: the GNU build-id of the main executable (Envoy stamps its git commit there; `envoy
//! --version` prints the same hash) must equal [`PINNED_ENVOY_BUILD`]. On a mismatch the init
//! returns null and Envoy refuses the configuration (docs/filter.md "Native build" quotes the
//! exact messages).

use std::ffi::{c_int, c_void};

/// The Envoy 1.40.0 release commit the bindings in [`crate::abi`] were written against
/// (`filter-native/envoy-build.txt`, which `cargo xtask setup` checks the installed Envoy against).
pub const PINNED_ENVOY_BUILD: &str = include_str!("../envoy-build.txt").trim_ascii();

/// The dynamic-module ABI version string of that commit, returned to Envoy at program init.
pub const ABI_VERSION: &std::ffi::CStr = c"v0.2.0";

/// The pin as it sits in the shared library: one marker string, read at run time through a
/// volatile load so the compiler cannot fold it into the comparison. The e2e test of the ABI
/// rule rewrites the 40 hex digits in a copy of the `.so` to get a module built for another Envoy.
#[used]
static PIN_MARKER: [u8; 60] = pin_marker();

/// The marker's prefix, before the 40 hex digits.
pub const PIN_MARKER_PREFIX: &str = "kvroute-envoy-build:";

/// `PIN_MARKER_PREFIX` + `PINNED_ENVOY_BUILD`, at compile time.
const fn pin_marker() -> [u8; 60] {
    let (prefix, pin) = (PIN_MARKER_PREFIX.as_bytes(), PINNED_ENVOY_BUILD.as_bytes());
    assert!(
        prefix.len() == 20 && pin.len() == 40,
        "envoy-build.txt holds a 40-hex commit"
    );
    let mut out = [0u8; 60];
    let mut i = 0;
    while i < 60 {
        out[i] = if i < 20 { prefix[i] } else { pin[i - 20] };
        i += 1;
    }
    out
}

/// Why this process is not the Envoy the module was built for.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum AbiMismatch {
    #[error(
        "kvroute_filter: ABI mismatch: this module was built for Envoy build {expected} \
         (dynamic-module ABI {abi}) but is loaded into Envoy build {found}; rebuild \
         kvroute-filter-native against that Envoy's abi.h (docs/filter.md, \"Native build\")"
    )]
    OtherBuild {
        expected: String,
        found: String,
        abi: &'static str,
    },
    #[error(
        "kvroute_filter: ABI mismatch: the host executable has no GNU build-id, so it cannot be \
         checked against the Envoy build {expected} this module was built for"
    )]
    NoBuildId { expected: String },
}

/// The pinned build as compiled into this library (read from [`PIN_MARKER`]).
pub fn pinned_build() -> String {
    let bytes: Vec<u8> = (0..PIN_MARKER.len())
        // SAFETY: reads within a static array.
        .map(|i| unsafe { std::ptr::read_volatile(PIN_MARKER.as_ptr().add(i)) })
        .collect();
    String::from_utf8_lossy(&bytes[PIN_MARKER_PREFIX.len()..]).into_owned()
}

/// Compares the host's build id with the pin.
pub fn check(host_build: Option<&str>) -> Result<(), AbiMismatch> {
    let expected = pinned_build();
    match host_build {
        None => Err(AbiMismatch::NoBuildId { expected }),
        Some(found) if found.eq_ignore_ascii_case(&expected) => Ok(()),
        Some(found) => Err(AbiMismatch::OtherBuild {
            expected,
            found: found.to_owned(),
            abi: ABI_VERSION.to_str().unwrap_or("?"),
        }),
    }
}

/// The GNU build-id (hex) of this process's main executable, if it has one.
pub fn host_build_id() -> Option<String> {
    let mut found: Option<String> = None;
    // SAFETY: dl_iterate_phdr calls `first_object` synchronously with valid `dl_phdr_info`
    // pointers; `found` outlives the call.
    unsafe {
        libc::dl_iterate_phdr(
            Some(first_object),
            (&mut found as *mut Option<String>).cast::<c_void>(),
        );
    }
    found
}

/// `dl_iterate_phdr` visits the main executable first; read its build id and stop.
unsafe extern "C" fn first_object(
    info: *mut libc::dl_phdr_info,
    _size: usize,
    data: *mut c_void,
) -> c_int {
    // SAFETY: both pointers come from dl_iterate_phdr / host_build_id (see there).
    let (info, found) = unsafe { (&*info, &mut *data.cast::<Option<String>>()) };
    for index in 0..usize::from(info.dlpi_phnum) {
        // SAFETY: dlpi_phdr points to dlpi_phnum program headers.
        let header = unsafe { &*info.dlpi_phdr.add(index) };
        if header.p_type != libc::PT_NOTE {
            continue;
        }
        let start = (info.dlpi_addr as usize).wrapping_add(header.p_vaddr as usize);
        // SAFETY: a PT_NOTE segment is mapped, readable, p_memsz bytes long.
        let notes =
            unsafe { std::slice::from_raw_parts(start as *const u8, header.p_memsz as usize) };
        if let Some(id) = gnu_build_id(notes) {
            *found = Some(id);
            return 1;
        }
    }
    1
}

/// Finds the `NT_GNU_BUILD_ID` note in an ELF note segment and returns its descriptor as hex.
pub fn gnu_build_id(mut notes: &[u8]) -> Option<String> {
    const NT_GNU_BUILD_ID: u32 = 3;
    let align4 = |n: usize| n.div_ceil(4) * 4;
    let word = |bytes: &[u8], at: usize| -> Option<u32> {
        Some(u32::from_ne_bytes(bytes.get(at..at + 4)?.try_into().ok()?))
    };
    while notes.len() >= 12 {
        let name_size = word(notes, 0)? as usize;
        let desc_size = word(notes, 4)? as usize;
        let kind = word(notes, 8)?;
        let name_end = 12usize.checked_add(align4(name_size))?;
        let desc_end = name_end.checked_add(align4(desc_size))?;
        let name = notes.get(12..12 + name_size)?;
        let desc = notes.get(name_end..name_end + desc_size)?;
        if kind == NT_GNU_BUILD_ID && name == b"GNU\0" {
            return Some(desc.iter().map(|b| format!("{b:02x}")).collect());
        }
        notes = notes.get(desc_end..)?;
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn note(name: &[u8], kind: u32, desc: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        out.extend((name.len() as u32).to_ne_bytes());
        out.extend((desc.len() as u32).to_ne_bytes());
        out.extend(kind.to_ne_bytes());
        out.extend(name);
        out.resize(out.len().div_ceil(4) * 4, 0);
        out.extend(desc);
        out.resize(out.len().div_ceil(4) * 4, 0);
        out
    }

    #[test]
    fn the_marker_holds_the_pinned_build() {
        assert_eq!(pinned_build(), PINNED_ENVOY_BUILD);
        assert_eq!(PIN_MARKER.len(), PIN_MARKER_PREFIX.len() + 40);
    }

    #[test]
    fn the_build_id_note_is_found_after_other_notes() {
        let mut segment = note(b"GNU\0", 1, &[0, 0, 0, 0, 3, 2, 0, 0]);
        segment.extend(note(b"GNU\0", 3, &[0x9e, 0x55, 0x80, 0xab]));
        assert_eq!(gnu_build_id(&segment).as_deref(), Some("9e5580ab"));
        assert_eq!(gnu_build_id(&note(b"Go\0\0", 3, &[1, 2])), None);
        assert_eq!(
            gnu_build_id(&segment[..20]),
            None,
            "a truncated note is not read"
        );
    }

    #[test]
    fn only_the_pinned_build_passes() {
        assert_eq!(check(Some(PINNED_ENVOY_BUILD)), Ok(()));
        assert_eq!(check(Some(&PINNED_ENVOY_BUILD.to_uppercase())), Ok(()));
        let other = check(Some("0123456789012345678901234567890123456789")).unwrap_err();
        let message = other.to_string();
        assert!(message.contains("ABI mismatch"), "{message}");
        assert!(message.contains(PINNED_ENVOY_BUILD), "{message}");
        assert!(matches!(check(None), Err(AbiMismatch::NoBuildId { .. })));
    }

    #[test]
    fn this_test_binary_has_a_build_id_that_is_not_envoys() {
        // rustc links with --build-id on Linux: the reader finds the main executable's note.
        let id = host_build_id().expect("test binary build id");
        assert!(
            id.len() >= 16 && id.chars().all(|c| c.is_ascii_hexdigit()),
            "{id}"
        );
        assert!(check(Some(&id)).is_err());
    }
}
