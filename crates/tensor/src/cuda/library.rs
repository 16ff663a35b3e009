//! Which CUDA libraries load. cudarc opens each library at its first call and panics when it
//! is missing, so Kiln probes a library before its first use and keeps what it finds loaded.

use std::sync::OnceLock;

/// Whether the NVIDIA driver library can be loaded at all (cudarc would panic on first use).
pub(crate) fn driver_present() -> bool {
    static PRESENT: OnceLock<bool> = OnceLock::new();
    *PRESENT.get_or_init(|| held_open(&["libcuda.so.1", "libcuda.so"]))
}

/// Whether one of the library file `names` loads; the first that does stays loaded for the
/// process. (cudarc's own probes open and close a library, and its loader opens it again:
/// cuBLASLt's 550 MB would load twice.)
pub(crate) fn held_open<S: AsRef<str>>(names: &[S]) -> bool {
    names.iter().any(|name| {
        // SAFETY: loading a CUDA library runs its initialisers, as cudarc's loader does with
        // the same file; it is never unloaded, as cudarc never unloads its own.
        unsafe { libloading::Library::new(name.as_ref()) }.map(std::mem::forget).is_ok()
    })
}
